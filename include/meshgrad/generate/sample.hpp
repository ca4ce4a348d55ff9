// Text generation from a trained GPT on any mesh: `meshgrad sample` and `meshgrad.sample` in Python.
//
//   prompt --tokenizer--> ids --prefill (Model::decode of the whole prompt)--> logits of the last position
//          --choose_token--> id --decode of that one position (keys/values cached)--> logits --> ...
//
// Every rank runs the same loop on the same ids: the model's decode gathers the whole vocabulary's
// logits over tp (the same bits on every rank), and choose_token is a pure function of those logits,
// the seed and the step, so all ranks pick the same token without exchanging it (dp replicas
// included). Greedy (temperature 0) is the argmax, lowest id among ties; the logits of two meshes
// differ only by the rounding of their reordered sums, so greedy text is the same at every mesh
// unless two top logits are that close (~1e-6 relative in float32, ~1e-15 in float64).
//
// The context: generation stops at `tokens` new tokens or when the model has seen n_positions
// tokens (the prompt and the tokens fed back): the last token is chosen from the logits of position
// n_positions - 1, so prompt + output hold at most n_positions + 1 tokens. There is no sliding
// window (a GPT-2 with learned positions would see every token at a new position after a slide, and
// the cache would have to be recomputed); the result says when it stopped for this reason.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::generate {

// ---- where the weights come from -------------------------------------------------------------------

// A checkpoint path resolved to a model and its weights, read from headers only (no tensor data).
struct SampleWeights {
  std::string checkpoint;      // as given
  std::string weights;         // the safetensors file of full tensors in Hugging Face names and layout,
                               // or (b) the Hugging Face directory (whole or sharded)
  std::string config_source;   // where the sizes came from: a config.json, or the file's metadata
  nn::ModelConfig model;       // the sizes; dtype = the weights' (wte.weight's), dropout 0
  std::string tokenizer_dir;   // the checkpoint directory when it holds tokenizer files, else ""
  std::string sharded_checkpoint;   // (c): the checkpoint directory step_XXXXXXXX, else ""
  // (a) with "gpt2_config" in its metadata and a config.json beside it: that config.json, which the
  // file's own description overrides (front-ends say so); else "".
  std::string ignored_config;
};

// What a checkpoint path may be:
//  (a) a safetensors file (e.g. from `meshgrad train --save`); the sizes from, in order: its
//      metadata key "gpt2_config" (that JSON as a string, which `train --save` writes: the file's
//      own description wins), else a config.json beside it (Hugging Face GPT-2 format, for files
//      of other tools); else an error naming both;
//  (b) a Hugging Face style directory of either family (GPT-2, llama, qwen2, mistral) with config.json
//      and model.safetensors or a sharded set's model.safetensors.index.json (and, optionally,
//      the tokenizer: vocab.json + merges.txt or encoder.json + vocab.bpe);
//  (c) a sharded training checkpoint (train --checkpoint-dir): a step_XXXXXXXX directory, or the
//      checkpoint directory (its newest); sizes from the saved configuration, the tokenizer from the
//      run's prepared data directory when it is still there; each rank reads only its pieces.
// Anything else is an InvalidArgument saying it is "not a safetensors file or model directory". The
// config is checked against the file's tensor shapes (check_gpt2_config_against_weights).
// This and load_sample_weights are the one place a new checkpoint format is added.
SampleWeights resolve_sample_weights(const std::string& checkpoint);

// Loads the weights into a model built from weights.model (each rank its own shards; not
// collective: every rank reads the file).
void load_sample_weights(const SampleWeights& weights, const std::vector<nn::Parameter*>& params,
                         const dist::DeviceMesh& mesh);

// ---- tokens ------------------------------------------------------------------------------------------

// Text <-> ids: bytes (id = byte value, vocabulary 256) or a GPT-2 BPE tokenizer.
class SampleTokenizer {
 public:
  static SampleTokenizer bytes();
  static SampleTokenizer bpe(text::Tokenizer tokenizer, std::string source);
  // Not thread-safe (the BPE cache); call before the ranks start.
  std::vector<std::int64_t> encode(std::string_view text);
  // The bytes of one id (may be part of a UTF-8 character). Throws for an id >= vocab_size().
  std::string token_bytes(std::int64_t id) const;
  std::int64_t vocab_size() const;
  // "bytes" or "GPT-2 BPE from DIR".
  const std::string& description() const { return description_; }

 private:
  std::optional<text::Tokenizer> bpe_;
  std::string description_;
};

// The tokenizer for a model of vocabulary `model_vocab`:
//  - tokenizer_dir given: vocab.json + merges.txt or encoder.json + vocab.bpe in it, or a
//    `meshgrad prepare` output directory (its meta.json names the tokenizer files);
//  - else weights.tokenizer_dir (a model directory holding the tokenizer files);
//  - else bytes, when the model's vocabulary is 256.
// Otherwise an error saying to pass --tokenizer. The tokenizer's vocabulary must not exceed the
// model's (a model may have more ids, e.g. padded to a multiple of 64: those are never chosen).
SampleTokenizer resolve_sample_tokenizer(const std::string& tokenizer_dir, const SampleWeights& weights);

// ---- choosing a token ------------------------------------------------------------------------------

struct SamplingOptions {
  double temperature = 1.0;   // 0 = greedy
  int top_k = 0;              // 0 = the whole vocabulary
  std::uint64_t seed = 1234;
  double top_p = 1.0;         // nucleus sampling (Hugging Face's top_p); 1 = off; in (0, 1]
};

// The next token from the logits of the whole vocabulary, over ids [0, allowed) (allowed <= 0:
// all). A pure function of its arguments, so every rank that has the same logits picks the same id.
//  - temperature 0: the argmax, the lowest id among equal maxima;
//  - else: the top_k largest logits (all when top_k is 0 or >= allowed; among equal values the
//    lower ids first), p_i = exp((l_i - max) / T) / sum, in float64; with top_p < 1 only the
//    nucleus of them, as Hugging Face's TopPLogitsWarper keeps it (after temperature and top-k): in
//    ascending order of p (among equal values the higher ids first) the tokens whose cumulative
//    probability is <= 1 - top_p are dropped, the most likely always kept; u = random::uniform(seed, step)
//    (counter-based: the same seed and step give the same u on any rank or run); the chosen id is
//    the first in id order whose cumulative probability exceeds u.
// Throws InvalidArgument when a logit is not finite (naming the step and the id).
std::int64_t choose_token(std::span<const double> logits, const SamplingOptions& options, std::uint64_t step,
                          std::int64_t allowed = 0);

// ---- generation --------------------------------------------------------------------------------------

struct GenerateOptions {
  int tokens = 64;                 // new tokens, >= 1
  SamplingOptions sampling;
  std::int64_t allowed_vocab = 0;  // choose only ids below this (the tokenizer's vocabulary); 0 = all
  // false: recompute the whole sequence for every token (no cache): O(T^2) per token, for
  // benchmarks and tests only.
  bool use_cache = true;
};

struct Generation {
  std::vector<std::int64_t> tokens;   // the new ids
  bool context_full = false;          // stopped before `tokens` because n_positions was reached
  std::int64_t attention_scores = 0;  // q . k products computed by this rank (KvCache counter)
};

// Collective over the model's mesh (every rank calls it with the same prompt and options; each gets
// the same tokens). prompt: 1 .. n_positions ids. on_token(id) runs on every rank after each token
// is chosen (print on one rank). The model must be built without sequence parallelism.
Generation generate(nn::Model& model, const std::vector<std::int64_t>& prompt, const GenerateOptions& options,
                    const std::function<void(std::int64_t)>& on_token = {});

// ---- the job (`meshgrad sample`, `meshgrad.sample`) -----------------------------------------------

struct SampleJob {
  std::string checkpoint;   // see resolve_sample_weights
  std::string prompt;       // bytes (UTF-8 text usually)
  int tokens = 64;
  SamplingOptions sampling;
  std::string tokenizer;    // --tokenizer DIR; "" = see resolve_sample_tokenizer
  // --tp-invariant: the model in TP-invariant mode (docs/mesh-invariance.md): the logits, and so every
  // sampled token, are bitwise the same at every tp that keeps the fixed tree of invariant_blocks.
  bool tp_invariant = false;
  int invariant_blocks = 4;
  // Called on mesh rank 0 with the text as it is produced (the prompt first, then each token's
  // bytes as valid UTF-8: a character split across tokens comes out when it is complete). May be
  // empty.
  std::function<void(std::string_view)> on_text;
};

struct SampleResult {
  std::string text;                          // prompt + continuation, valid UTF-8 (as on_text gave it)
  std::vector<std::int64_t> prompt_tokens;   // the encoded prompt
  std::vector<std::int64_t> new_tokens;
  bool context_full = false;                 // stopped at n_positions before `tokens` new tokens
  std::int64_t n_positions = 0;
  std::string tokenizer;                     // SampleTokenizer::description()
  std::string mesh;                          // DeviceMesh::str()
  std::string config_source;                 // where the sizes came from (SampleWeights::config_source)
  std::string ignored_config;                // SampleWeights::ignored_config: a config.json not read
  bool leader = false;   // this process hosted mesh rank 0 (the one that called on_text): under mpi
                         // only one process prints; the others have the same result otherwise
};

// The option checks every front-end gets, with the CLI's option names: prompt empty, tokens < 1,
// temperature < 0 or not finite, top_k < 0, checkpoint empty.
void check_sample_job(const SampleJob& job);

// Checks the job, resolves the weights and the tokenizer, encodes the prompt (longer than
// n_positions: an error) -- all before any rank starts -- then builds the model on every rank
// (the model's own checks: e.g. more tp ranks than heads), loads the weights and generates.
// Returns the result as mesh rank 0 sees it (under mpi each process its own rank's: the same tokens).
SampleResult run_sample_job(const SampleJob& job, const dist::RunOnMesh& run_on_mesh);

}  // namespace meshgrad::generate
