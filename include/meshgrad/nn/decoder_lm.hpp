// Decoder-only language models: a family's module tree (DecoderFamily: what each piece computes)
// and the one Model that runs any family on any mesh (make_decoder_lm), applying from outside what
// is not the family's business:
//
//   pipeline stages     which blocks this rank builds (ParallelConfig::pp_layers), the activation a
//                       stage receives, the first stage embedding and the last computing the loss
//   FSDP                one unit per block and one for the stage's own parameters (embedding, final
//                       norm, output layer), prefetched one block ahead, regathered for backward
//   activation ckpt     each block's forward recomputed in backward (--checkpoint-blocks)
//   dropout streams     one generator for the model; a stage skips the seeds earlier stages draw,
//                       and every mask is drawn by global index (rows of the global batch, SP offset)
//   tied embeddings     the output layer's use of the token table, on one stage or across a
//                       pipeline (nn/tied_weight.hpp)
//   the loss            vocabulary-parallel cross-entropy over the logits, partial over dp x fsdp
//   decoding            the key/value cache and the decode loop (Model::new_cache, decode)
//
// A family owns its module tree and its tensor-parallel plan (tp_plan.hpp) and nothing else: GPT-2
// is src/nn/gpt2.cpp. docs/DESIGN.md ("A model family") lists the files a new family touches.
//
// Activations between pieces are [T(_local), B, C]: sequence first, sharded along T over tp under
// sequence parallelism. `seq` is the length of the sequence this rank's layers see: the global T, or
// under context parallelism (cp, nn/context_parallel.hpp) this rank's two chunks of it, T / cp, which
// SP then splits over tp. Whatever asks where a row lies in the whole sequence (positions, dropout
// masks, attention's keys) asks local_chunks(ctx, seq).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/nn/context_parallel.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/tp_plan.hpp"

namespace meshgrad::nn {

// Dropout at one place of the forward: x -> x with this use's mask (identity when dropout is off or
// in evaluation). Each call draws the next seed of the model's stream.
using Dropout = std::function<Tensor(const Tensor&)>;

// The first row of this rank's piece of a [T, B, C] activation of a sequence of `seq` rows: its
// shard's offset under sequence parallelism (a 2-D grid keeps activations whole), else 0.
std::int64_t sequence_shard_offset(const ParallelContext& ctx, std::int64_t seq);
// The global positions of this rank's piece of a [T(_local), B, C] activation whose sequence has
// `seq` rows here (its SP shard of its cp chunks), as runs of consecutive positions.
std::vector<PositionRun> activation_positions(const ParallelContext& ctx, std::int64_t seq);

// The pieces of the module tree one rank builds: the embedding (the first pipeline stage), blocks
// [first_block, end_block), the head (the last stage). A mesh without pp builds them all.
struct StagePieces {
  bool embedding = true;
  bool head = true;
  int first_block = 0;
  int end_block = 0;
};

// One transformer block: [T(_local), B, C] -> the same. Its forward runs inside its FSDP unit's
// bracket and its name's trace scope and communication label (the runner's business, not its own).
class DecoderBlock {
 public:
  virtual ~DecoderBlock() = default;
  // "h.3": the trace scope, the communication label and the FSDP unit's name.
  virtual const std::string& name() const = 0;
  // Training and evaluation forward; records the graph when grad mode is on.
  virtual Tensor forward(const Tensor& x, std::int64_t seq, const Dropout& dropout) const = 0;
  // Decoding (no graph, no SP): x [T_new, B, C] at positions start .. start + T_new - 1; this
  // rank's keys and values of them are written into keys, values (cache_shape) and the queries
  // attend to positions 0 .. their own. scores += the q . k products computed.
  virtual Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, std::int64_t start,
                                std::int64_t& scores) const = 0;
  // The cache buffers of one block: [B, H_kv_local, capacity, D] (this rank's key/value heads).
  virtual Shape cache_shape(std::int64_t batch, std::int64_t capacity) const = 0;
  // Its parameters in the one-rank model's order.
  virtual void collect(std::vector<Parameter*>& out) = 0;
};

// A family's module tree, built for one rank's StagePieces on a context (its layers split as the
// family's plan says). Constructing it checks the sizes against the mesh (InvalidArgument naming
// them).
class DecoderFamily {
 public:
  virtual ~DecoderFamily() = default;
  // Dropout seeds one forward draws in the embedding and in each block (each use draws one), so a
  // stage can start where the whole model's stream is at its first block.
  virtual int embedding_dropout_draws() const = 0;
  virtual int block_dropout_draws() const = 0;

  // The token table, vocabulary-parallel: on the embedding's stage, and, when the output layer is
  // tied to it (tied_output), on the head's stage too, as a copy the runner refreshes (not listed
  // in parameters). nullptr on other stages.
  virtual VocabParallelEmbedding* token_embedding() = 0;
  virtual bool tied_output() const = 0;
  // The embedding's stage: ids [T, B] -> [T(_local), B, C], reduced over tp (reduce-scattered along
  // T under SP), dropout applied. positions: the global positions of the ids' rows (one run from 0
  // in training without cp; this rank's chunks under cp; the new positions when decoding). table:
  // this rank's rows of the token table as the graph should use them (the runner may put the tied
  // weight's node between).
  virtual Tensor embed(const Tensor& ids, const Tensor& table, const std::vector<PositionRun>& positions,
                       const Dropout& dropout) const = 0;
  // The blocks this rank built, in order.
  virtual const std::vector<std::shared_ptr<DecoderBlock>>& blocks() const = 0;
  // The head's stage: the final norm, then this rank's logits [T', B, V_local] (columns
  // [vocab_offset, +V_local) of the vocabulary). tied_weight: the token table's rows [V_local, C] as
  // the output layer should use them when tied_output (else undefined: the head has its own weight).
  virtual Tensor final_norm(const Tensor& h, std::int64_t seq) const = 0;
  virtual Tensor output_logits(const Tensor& h, std::int64_t seq, const Tensor& tied_weight) const = 0;
  virtual std::int64_t vocab_offset() const = 0;
  // The blocks of the local vocabulary the output layer computes in (ParallelContext::feature_plan).
  virtual const tree::SplitPlan& output_plan() const = 0;
  // A mixture of experts (nn/moe.hpp). begin_forward: a forward of this rank's stage starts, in
  // training or evaluation (Model::set_training).
  // auxiliary_loss: the term the family adds to the loss of the forward that just ran (the
  // load-balancing loss times its coefficient), this rank's share, averaged over `forwards` forwards
  // per step; undefined for none. take_expert_load: Model::take_expert_load.
  virtual void begin_forward(bool /*training*/) {}
  virtual Tensor auxiliary_loss(int /*forwards*/) { return Tensor(); }
  virtual ExpertLoad take_expert_load() { return {}; }
  // Parameters of the embedding (first stage) and of the head (last stage), in the one-rank order.
  virtual std::vector<Parameter*> embedding_parameters() = 0;
  virtual std::vector<Parameter*> head_parameters() = 0;
};

using DecoderFamilyFactory = std::function<std::unique_ptr<DecoderFamily>(
    const ModelConfig& config, const ParallelContextPtr& ctx, const StagePieces& pieces, std::uint64_t seed)>;

// The Model running `family` on the mesh: ctx from (mesh, parallel), this rank's stage from the pp
// axis, then the family built for its pieces. config.kind names the model in messages and traces.
std::unique_ptr<Model> make_decoder_lm(const ModelConfig& config, const ParallelConfig& parallel,
                                       dist::DeviceMeshPtr mesh, std::uint64_t seed, const DecoderFamilyFactory& family);

// GPT-2 (src/nn/gpt2.cpp): its module tree and its tensor-parallel plan.
std::unique_ptr<DecoderFamily> make_gpt2_family(const ModelConfig& config, const ParallelContextPtr& ctx,
                                                const StagePieces& pieces, std::uint64_t seed);
const TensorParallelPlan& gpt2_tp_plan();

// A family of GPT-2's embedding (wte, wpe), final norm (ln_f) and tied output layer around blocks
// of the caller's: make_block(name, layer, config, ctx, seed) builds block `layer` ("h.3") on the
// context, its linears split by the caller's plan (TensorParallelPlan::linear), its parameters
// named under `name` and initialised from the seed. block_dropout_draws: the dropout uses one
// block's forward draws (each call of its Dropout draws one). The runner applies pipelines, FSDP,
// activation checkpointing and the tied weight to these blocks as to GPT-2's.
using DecoderBlockFactory = std::function<std::shared_ptr<DecoderBlock>(
    const std::string& name, int layer, const ModelConfig& config, const ParallelContextPtr& ctx, std::uint64_t seed)>;
DecoderFamilyFactory gpt2_family_with_blocks(DecoderBlockFactory make_block, int block_dropout_draws);

// Registers `kind` (nn::register_model) as the decoder language model of `family`: make_model
// then runs it through make_decoder_lm. counts_like as ModelKind's ("gpt" for gpt2_family_with_blocks).
// decodes: whether every block implements forward_cached (ModelKind::decodes).
void register_decoder_family(const std::string& kind, DecoderFamilyFactory family, const std::string& counts_like = "gpt",
                             bool decodes = true);

// The Llama family (src/nn/llama.cpp; kind "llama"): Llama 2/3, TinyLlama, SmolLM, Qwen2 (q/k/v
// biases), Mistral (sliding-window attention; Qwen2 from max_window_layers on), Mixtral (a sparse
// mixture of experts for every MLP, ModelConfig::experts > 0), in Hugging Face's names.
std::unique_ptr<DecoderFamily> make_llama_family(const ModelConfig& config, const ParallelContextPtr& ctx,
                                                 const StagePieces& pieces, std::uint64_t seed);
const TensorParallelPlan& llama_tp_plan();

}  // namespace meshgrad::nn
