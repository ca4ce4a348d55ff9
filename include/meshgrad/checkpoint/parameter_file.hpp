// Loading and saving parameters as safetensors files of *full* tensors by name, whatever the
// tensor-parallel degree: a file saved at tp=4 loads at tp=1, 2 or 3 and vice versa.
//
// Names and layouts are the parameters' own (Hugging Face GPT-2 names, W stored [in, out] as GPT-2's
// Conv1D does), so a GPT-2 checkpoint in safetensors form loads as is.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/tensor/tensor.hpp"
#include "meshgrad/io/safetensors.hpp"

namespace meshgrad::checkpoint {

// Loads every parameter from the full tensor of the same name in the file at path (file_prefix +
// the parameter's name: "transformer." for a Hugging Face GPT2LMHeadModel file): each rank reads
// the full tensor and copies its own shard (nn::take_shard with the parameter's ShardSpec over tp)
// into param->value, in place and without recording autograd history. A file tensor in another
// floating dtype is converted to the parameter's dtype (float64 -> float32 rounds to nearest; F16
// and BF16 are read as float32, exactly). Tensors in the file that no parameter names are ignored,
// whatever their dtype.
//
// All-or-nothing: every name, shape and dtype is checked before any parameter is changed. Throws
// SafetensorsError naming the file and the parameter for a malformed file, a missing name, a full
// shape that differs from param->full_shape (both shapes in the message), int64 data for a
// floating parameter, or a dtype meshgrad does not read. Not collective: every rank of tp calls it and reads the file itself (under
// MPI across machines, the file must be visible to every rank).
void load_parameters(const std::string& path, const std::vector<nn::Parameter*>& params,
                     const dist::ProcessGroup& tp, const std::string& file_prefix = "");

// Every parameter's full tensor by name, in memory: gathered over tp (nn::gather_full: collective, every
// rank of tp calls it with the same parameters in the same order); rank `writer_rank` of tp gets them,
// and with `stages` (a pipeline's pp group of more than one stage, each stage's caller passing its own
// parameters and group) stage 0's writer gets every stage's in stage order. The others get an empty
// list. What save_parameters writes; what a training run samples from.
std::vector<std::pair<std::string, Tensor>> gather_full_parameters(const std::vector<nn::Parameter*>& params,
                                                                   const dist::ProcessGroup& tp, int writer_rank = 0,
                                                                   const dist::ProcessGroup* stages = nullptr);

// Gathers every parameter's full tensor (nn::gather_full: collective, every rank of tp calls this
// with the same parameters in the same order) and rank `writer_rank` of tp writes them by name,
// atomically (see write_safetensors), with the given metadata ("format": "pt" lets Hugging Face
// tools load the file). Other ranks return once their part of the gathers is done. With several tp
// groups (a dp axis), call it from one of them or give each a different path.
// stages (a pipeline's pp group, more than one stage): each stage calls it with its own parameters
// from its own group; the writers of the later stages send their full tensors to stage 0's, which
// writes every stage's, in stage order (the one-rank model's order).
void save_parameters(const std::string& path, const std::vector<nn::Parameter*>& params,
                     const dist::ProcessGroup& tp, int writer_rank = 0,
                     const std::map<std::string, std::string>& metadata = {{"format", "pt"}},
                     const dist::ProcessGroup* stages = nullptr);

// The full gradient of every parameter by name, for gradient dumps (`meshgrad grads`): each rank's
// param->value.grad() is gathered over tp like the values (collective: every rank calls it). A
// parameter whose grad is undefined counts as zeros of its shard's shape and dtype. The local
// gradients must already be complete for their shards: partial sums (a replicated parameter used
// on sequence-sharded data) must be reduced before.
std::vector<std::pair<std::string, Tensor>> gather_gradients(const std::vector<nn::Parameter*>& params,
                                                             const dist::ProcessGroup& tp);

// A pipeline's full tensors in one place: each stage's caller passes what its stage holds; stage 0
// (rank 0 of `stages`) gets every stage's, in stage order (the one-rank model's), the others an
// empty list. Collective over `stages`, one caller per stage (e.g. the first rank of each stage's
// parameter group). Point to point with the communicator's deadline.
std::vector<std::pair<std::string, Tensor>> collect_on_first_stage(std::vector<std::pair<std::string, Tensor>> full,
                                                                   const dist::ProcessGroup& stages);

}  // namespace meshgrad::checkpoint
