// The models meshgrad trains and checks ("gpt" and "mlp"), behind one interface the trainer, the
// equivalence checker, `grads`, `explain` and the benchmarks use. A decoder family is a module tree
// plus a tensor-parallel plan run by nn/decoder_lm.hpp (docs/DESIGN.md, "A model family").
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::nn {

// Sizes. GPT uses every field (Hugging Face names in comments); the MLP model uses
// hidden, ffn, seq, batch (tokens = seq * batch) and layers.
struct ModelConfig {
  std::string kind = "gpt";   // "gpt" or "mlp"
  int layers = 2;             // n_layer
  int hidden = 64;            // n_embd
  int ffn = 0;                // 0 = 4 * hidden (GPT-2)
  int heads = 4;              // n_head
  int vocab = 256;            // vocab_size
  int positions = 0;          // n_positions; 0 = seq
  int seq = 32;               // T of a batch
  int batch = 4;              // B of a batch
  double layer_norm_epsilon = 1e-5;   // layer_norm_epsilon; the Llama family's rms_norm_eps
  double dropout = 0.0;       // embd/resid dropout probability (training only)
  DType dtype = DType::Float32;
  // The Llama family (kind "llama": Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral), exactly Hugging
  // Face's semantics; ffn is intermediate_size there, positions max_position_embeddings.
  int kv_heads = 0;                 // num_key_value_heads (grouped-query attention); 0 = heads
  int head_dim = 0;                 // head_dim; 0 = hidden / heads
  double rope_theta = 10000.0;      // rope_theta
  // rope_scaling: "" (none), "linear" (positions / rope_factor) or "llama3" (Llama 3.1's smoothed
  // frequency bands: rope_factor, low/high_freq_factor, original_max_position_embeddings).
  std::string rope_scaling{};
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int rope_original_positions = 8192;
  bool tie_word_embeddings = false; // tie_word_embeddings: lm_head is embed_tokens^T
  bool attention_bias = false;      // q, k, v projections with biases (Qwen2)
  // Sliding-window attention: layers max_window_layers .. layers - 1 attend to their last
  // sliding_window positions only (Mistral: every layer, max_window_layers 0; Qwen2 with
  // use_sliding_window: the layers from its max_window_layers on). sliding_window 0: none.
  int sliding_window = 0;
  int max_window_layers = 0;
  std::string model_type = "llama"; // config.json's model_type: llama, qwen2, mistral, mixtral or qwen2_moe (export)
  // Mixture of experts (model_type "mixtral", nn/moe.hpp): every block's MLP is a sparse MoE block
  // of `experts` SwiGLU experts of ffn features (num_local_experts), each token routed to
  // `experts_per_token` of them (num_experts_per_tok). experts 0: the dense MLP.
  int experts = 0;
  int experts_per_token = 2;
  double router_aux_loss_coef = 0.001;   // router_aux_loss_coef
  bool output_router_logits = false;     // output_router_logits: the load-balancing loss joins the loss
  // Qwen2-MoE (model_type "qwen2_moe"): the routed experts' width moe_intermediate_size (expert_ffn;
  // 0: ffn, as Mixtral's intermediate_size), a shared expert of shared_expert_intermediate_size
  // features gated by sigmoid(x g) in every sparse layer (0: none), the k weights renormalised only
  // with norm_topk_prob (Mixtral always), and the layers that are sparse: (i + 1) %
  // decoder_sparse_step == 0 and i not in mlp_only_layers (the others a dense MLP of ffn features).
  int expert_ffn = 0;
  int shared_expert_ffn = 0;
  bool norm_topk_prob = true;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers{};
  // A run option, not Hugging Face's: each expert takes at most ceil(capacity_factor * tokens * k /
  // experts) of one micro-batch's tokens on one rank and drops the rest (counted); 0: dropless.
  double capacity_factor = 0;
  bool moe() const { return experts > 0; }
  int expert_ffn_size() const { return expert_ffn > 0 ? expert_ffn : ffn_size(); }
  // Whether block `layer` is a mixture of experts (the others are dense).
  bool sparse_layer(int layer) const {
    return experts > 0 && decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0 &&
           std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
  }
  int ffn_size() const { return ffn > 0 ? ffn : 4 * hidden; }
  int kv_head_count() const { return kv_heads > 0 ? kv_heads : heads; }
  int head_size() const { return head_dim > 0 ? head_dim : (heads > 0 ? hidden / heads : 0); }
  int n_positions() const { return positions > 0 ? positions : seq; }
  // The attention window of block `layer` (0: plain causal attention).
  int attention_window(int layer) const {
    return sliding_window > 0 && layer >= max_window_layers ? sliding_window : 0;
  }

  // A GPT of these sizes, every other field at its default: how code that does not parse a file
  // builds a model's configuration.
  static ModelConfig gpt(int layers, int hidden, int heads, int vocab, int seq = 32, int batch = 4,
                         DType dtype = DType::Float32);
  // This configuration with the sizes that define the parameters (layers, hidden, ffn, heads, vocab,
  // positions, layer_norm_epsilon) taken from `shape`, and kind "gpt": a run's options (seq, batch,
  // dropout, dtype) with a file's model.
  ModelConfig with_shape_of(const ModelConfig& shape) const;
};

// The summation-order modes of ParallelConfig::invariance, weakest first.
enum class Invariance { None, Tp, Mesh };
// "none", "tp", "mesh".
const char* invariance_name(Invariance mode);
// The command-line option that asks for the mode, without its dashes: "tp-invariant",
// "mesh-invariant" ("" for None). Refusals name the mode the user asked for by it.
const char* invariance_option(Invariance mode);

// How the model is parallelised on its mesh. The mesh has a "tp" axis and optionally a "dp" axis.
struct ParallelConfig {
  bool sequence_parallel = false;    // reduce-scatter / all-gather along the sequence between layers
  bool overlap = false;              // column layers overlap their backward communication with compute
  bool recompute_allgather = false;  // column layers keep only the local input shard (SP) and re-gather in backward
  bool checkpoint_blocks = false;    // activation checkpointing per transformer block
  // The summation-order mode (docs/mesh-invariance.md), one of three (each holds the one before):
  //   None  the backends' rank order: fastest, bits depend on the mesh.
  //   Tp    TP-invariant (--tp-invariant): the loss, gradients and updates are bitwise the same at
  //         every tp that keeps the fixed reduction tree of invariant_blocks blocks (a power of two;
  //         tp must divide it and every split dimension must cut into whole blocks).
  //   Mesh  mesh-invariant (--mesh-invariant): Tp's tree over the features, and the global batch cut
  //         into batch_blocks fixed row blocks (a power of two that the batch, and dp x fsdp times
  //         the micro-batches, divide), each block's forward and backward run alone and the blocks
  //         added in one fixed binary tree wherever they lie (micro-batches, dp, fsdp, pipeline). The
  //         same global batch then gives the same bits on every mesh that keeps both trees.
  // Both invariant modes pin OpenBLAS to one thread per rank (its results depend on the thread count).
  Invariance invariance = Invariance::None;
  int invariant_blocks = 4;
  int batch_blocks = 4;
  // Mesh only: the sequence's fixed blocks (--sequence-blocks, a power of two; 1: the whole sequence
  // is one block). Every product over tokens runs per block and every sum over tokens (weight,
  // norm and bias gradients, the embedding's rows, the loss, attention's key gradients) adds the
  // blocks in one fixed tree whose leaves are in the order 0, N-1, 1, N-2, ..., so that each cp rank's
  // blocks (chunks r and 2 cp - 1 - r) are a subtree: the bits are the same at every cp that divides
  // N / 2 (docs/mesh-invariance.md, "cp: sequence blocks").
  int sequence_blocks = 1;
  // Context parallelism's attention in the normal mode (--cp-schedule): true, the ring (the keys and
  // values passed rank to rank, each transfer in flight during the piece at hand's products, the
  // parts merged exactly); false, all-gathered before the products (what the sequence blocks use).
  bool cp_ring = true;
  // Mesh with sequence_blocks > 1: the sequence blocks are in force.
  bool sequence_blocked() const { return mesh_invariant() && sequence_blocks > 1; }
  // Tp or Mesh: the features' fixed tree (what the layers and the tp reductions follow).
  bool tp_invariant() const { return invariance != Invariance::None; }
  // Mesh: the batch's fixed row blocks too (what the trainer's split and sums follow).
  bool mesh_invariant() const { return invariance == Invariance::Mesh; }
  // Asks for `mode` on top of what is asked already: the stronger mode wins, so --tp-invariant with
  // --mesh-invariant (in either order) is mesh-invariant, which holds the tp mode's tree.
  void require(Invariance mode) { invariance = std::max(invariance, mode); }
  // FSDP (a mesh with fsdp > 1, nn/fsdp.hpp): give each block's gathered parameters back after its
  // forward and gather them again for its backward (ZeRO-3's memory); false keeps them from forward
  // to backward (--no-reshard-after-forward: one gather fewer per block and step, ZeRO-2's memory).
  bool reshard_after_forward = true;
  // ZeRO on the dp axis (--shard-optimizer): the parameters' shards, gradients and AdamW moments are
  // Sp(0) on dp as on an fsdp axis, but every rank keeps the whole parameters between steps, gathered
  // once per step after the update (lazily, at the next forward): plain dp's memory for parameters,
  // 1/dp of it for gradients and moments, no gather in backward. Needs dp > 1 and no fsdp axis.
  bool shard_optimizer = false;
  // Pipeline parallelism (a mesh with a pp axis of p > 1 stages): the number of transformer blocks
  // of each stage, in stage order (p entries summing to the model's layers); empty: an even split,
  // the first layers % p stages taking one more. The embedding lives on the first stage, ln_f and
  // the tied output layer on the last.
  std::vector<int> pp_layers = {};
  // The element type gradients travel in over the data-parallel axes (--reduce-dtype): Float32, or
  // BFloat16 (half the bytes: the dp buckets' all-reduce and fsdp's reduce-scatter send bf16 copies,
  // summed in float32 and rounded once, and the result is widened back into the float32 gradient).
  // The tp axes' few reductions stay float32. Not with the invariant modes (their fixed tree would
  // round at other nodes on other meshes) and only for float32 models.
  DType reduce_dtype = DType::Float32;
};

// Where this rank's stage lies in a pipeline: stage `index` of `count` holds transformer blocks
// [first_block, end_block). A mesh without a pp axis is one stage holding every block.
struct PipelineStage {
  int index = 0;
  int count = 1;
  int first_block = 0;
  int end_block = 0;
  bool is_first() const { return index == 0; }
  bool is_last() const { return index + 1 == count; }
};

// The blocks of each of `stages` stages for a model of `layers` blocks: `requested` (--pp-layers)
// when given, else the even split. Throws InvalidArgument naming the values when there are more
// stages than blocks, or `requested` has the wrong count, a stage without blocks, or another sum.
std::vector<int> stage_layer_counts(int layers, int stages, const std::vector<int>& requested);

// One batch: int64 tokens and targets, [B, T] (this dp rank's share of the global batch). Its rows
// are rows [row_offset, row_offset + B) of a global batch of global_rows rows (0: the batch is the
// global batch): element-wise random numbers (dropout) are drawn by global index, so a row gets the
// same mask whichever replica or micro-batch holds it.
struct Batch {
  Tensor inputs;
  Tensor targets;
  std::int64_t row_offset = 0;
  std::int64_t global_rows = 0;
};

// The keys and values of the positions a GPT has seen, for incremental decoding (Model::decode).
// Per transformer block, this rank's attention heads (tensor-parallel: each rank caches the heads it
// computes): keys[l], values[l] are [B, H_local, capacity, D] buffers of which positions
// [0, length) are filled. capacity = n_positions, allocated once (Model::new_cache), so a decode
// step writes only its own positions and reads the `length` cached ones: O(T) per new token.
struct KvCache {
  std::int64_t batch = 0;
  std::int64_t length = 0;     // positions held (the next token's position)
  std::int64_t capacity = 0;   // n_positions
  std::vector<Tensor> keys, values;
  // q . k products the attention computed through this cache (all its decode calls, every block,
  // this rank's heads): a cost counter, so a test can see that a step with T cached positions
  // touches T keys per head, not T^2.
  std::int64_t attention_scores = 0;
};

// The routing of a mixture of experts over some training forwards (nn/moe.hpp), summed over the
// ranks that route other tokens: per MoE layer of this rank's stage, the assignments each expert
// received (tokens x k, before capacity drops), the assignments dropped by the capacity factor, and
// the load-balancing loss summed over the forwards (before router_aux_loss_coef).
struct ExpertLoad {
  std::vector<std::string> layers;                 // "model.layers.0.block_sparse_moe"
  std::vector<std::vector<std::int64_t>> tokens;   // [layer][expert]
  std::int64_t dropped = 0;
  double aux_loss = 0;
  bool empty() const { return layers.empty(); }
};

class Model {
 public:
  virtual ~Model() = default;
  // Mean cross-entropy over all B*T positions of the *global* batch, as this rank's contribution:
  // the sum of its tokens' losses divided by the global token count, replicated over tp. Summing
  // the returned values over dp ranks gives the global loss; its gradients summed over dp are the
  // global gradients. Records the graph when parameters require grad.
  virtual Tensor loss(const Batch& batch, std::int64_t global_tokens) = 0;
  // Every parameter, in a fixed order (the same on every rank).
  virtual std::vector<Parameter*> parameters() = 0;
  virtual const ModelConfig& config() const = 0;
  // Enables/disables dropout (training mode).
  virtual void set_training(bool training) = 0;
  // The position of the model's random stream (dropout draws one seed per use): a checkpoint keeps
  // it so that a resumed run draws the masks of the run never stopped.
  virtual std::uint64_t random_state() const { return 0; }
  virtual void set_random_state(std::uint64_t /*state*/) {}
  // Gradient accumulation under FSDP (nn/fsdp.hpp): while on, backward sums the gathered
  // parameters' gradients unsharded and reduces nothing; the backward after it is turned off reduces
  // the whole sum, as dp reduces .grad once. Every rank switches at the same micro-batch. No effect
  // without an fsdp axis.
  virtual void set_accumulating(bool /*on*/) {}

  // ---- pipeline parallelism (a mesh with a pp axis; pipeline/executor.hpp runs the stages) ---------
  // This rank's stage (one stage of every block without a pp axis).
  virtual PipelineStage stage() const { return {0, 1, 0, config().layers}; }
  // One micro-batch through this rank's stage. input: the activation the previous stage sent
  // (stage_input_shape; undefined on the first stage). Returns the activation for the next stage
  // (every stage but the last), or the loss as loss() returns it (the last stage). Records the
  // graph when parameters require grad; the executor ties it to the neighbours' with dist::send /
  // dist::recv. A model without stages is one stage (this default returns loss()); given an input,
  // it throws InvalidArgument naming its kind.
  virtual Tensor forward_stage(const Batch& batch, const Tensor& input, std::int64_t global_tokens);
  // The shape of the activation a stage receives for micro-batch `batch` (in the model's dtype).
  virtual Shape stage_input_shape(const Batch& batch) const;
  // Before the first forward of a step or an evaluation: the copies a stage keeps of another
  // stage's parameters (GPT: the last stage's copy of the tied wte) take their current values.
  // Collective over the pp group; nothing without a pp axis.
  virtual void refresh_stage_copies() {}

  // ---- inference (GPT only; the others throw InvalidArgument naming their kind) --------------------
  // An empty cache for `batch` sequences (collective-free; allocates the whole capacity).
  virtual KvCache new_cache(std::int64_t batch);
  // Logits of the tokens `ids` continuing the sequences held in `cache`, without recording a graph
  // and without dropout; their keys and values are appended to the cache. Collective over the
  // model's tp group (every rank calls it with the same ids).
  //   ids: int64 [B, T_new] (B = cache.batch), positions cache.length .. cache.length + T_new - 1,
  //        which must be < n_positions
  //   returns [B, T_new, V] (all_positions) or [B, V] (the last position only), the whole
  //        vocabulary gathered over tp, in the model's dtype, the same bits on every rank.
  // An empty cache makes it a full forward of ids (the prefill); then one position per call.
  // The training forward and this one compute the same function: one decode of a whole sequence
  // gives the logits loss() takes the cross-entropy of. The model must be built without sequence
  // parallelism (a training layout: the sequence is not split when decoding).
  virtual Tensor decode(const Tensor& ids, KvCache& cache, bool all_positions = false);
  // The order of the model's sums over ranks (ParallelContext::reduce_order): the fixed tree in
  // TP-invariant mode. The trainer adds its own sums in the same order: micro-batches, the dp
  // replicas, the reported loss, and the gradient norm (exact in the tree order, grad_norm.hpp).
  virtual dist::ReduceOrder reduce_order() const { return dist::ReduceOrder::RankOrder; }
  // The batch axis whose ranks run sibling row blocks in each micro-batch: ep under --mesh-invariant
  // (docs/mesh-invariance.md, "ep"), where an expert's owner adds the sources' blocks of one
  // micro-batch. Gradients and losses are summed over it per micro-batch, in the tree, before the
  // micro-batches' tree; the batch is dealt out block by block (train::micro_batches_of_rank).
  // nullptr: none.
  virtual const dist::ProcessGroup* sibling_block_group() const { return nullptr; }
  // The group each micro-batch's gradients and loss are summed over before the micro-batches' tree
  // (optim::MicroBatchGradients, MicroBatchLosses): the sibling-block group, or cp under
  // --mesh-invariant's sequence blocks, whose ranks hold sibling subtrees of every row block's
  // sequence (docs/mesh-invariance.md, "cp"). nullptr: none (the synchroniser sums the axes once).
  virtual const dist::ProcessGroup* micro_batch_sum_group() const { return sibling_block_group(); }
  // The parameters each of the model's communication units carries, by the label its collectives
  // record (an FSDP unit's "fsdp:<name>": the tensors its all-gathers and reduce-scatters move), in
  // the order the units are built; empty when the model has none (no fsdp). For reports (explain).
  virtual std::vector<std::pair<std::string, std::vector<std::string>>> communication_units() const { return {}; }
  // A mixture of experts' routing since the last call (training forwards only), then cleared;
  // empty for a dense model. Collective: every rank of the mesh calls it.
  virtual ExpertLoad take_expert_load() { return {}; }
};

// Builds a model on the mesh with deterministic initialisation from seed: the same seed gives
// shards equal to the slices of the tp=1 model's parameters, whatever the mesh. config.kind picks
// the model: gpt, llama, mlp, or a kind registered below.
std::unique_ptr<Model> make_model(const ModelConfig& config, const ParallelConfig& parallel,
                                  dist::DeviceMeshPtr mesh, std::uint64_t seed);

// ---- models from outside the library -------------------------------------------------------------
// A program's own model joins every tool that builds models through make_model (the trainer with
// its checkpoints, resume, evaluation and metrics; `check`'s equivalence; grads; explain) by
// registering a kind: make_model(config) with config.kind == kind then calls `build`. The factory
// must honour make_model's contract (collective construction, deterministic initialisation from
// the seed, the same parameters in the same order on every rank).
using ModelFactory = std::function<std::unique_ptr<Model>(const ModelConfig& config, const ParallelConfig& parallel,
                                                          dist::DeviceMeshPtr mesh, std::uint64_t seed)>;
struct ModelKind {
  ModelFactory build;
  // The built-in kind whose FLOP count (train::model_flops_per_token, MFU) and lookup-only parameters
  // this model's follow: "gpt" for a family on GPT-2's embedding and head (gpt2_family_with_blocks),
  // "" for none (every parameter counted as multiplied, no attention term).
  std::string counts_like{};
  // Whether the model decodes (Model::new_cache, decode): what sampling needs. false lets the
  // trainer refuse --sample-every before its first step rather than at the first sample.
  bool decodes = true;
};
// Registers `kind` (letters, digits, '_' and '-'; not gpt, llama or mlp). Throws InvalidArgument
// naming the kind when it is built in, malformed, or registered already (unregister it first).
// Thread-safe; a registration lasts until unregister_model or the end of the process.
void register_model(const std::string& kind, ModelKind model);
// Removes `kind`; false when it was not registered.
bool unregister_model(const std::string& kind);
// The registered kind's entry, nullptr for a built-in or unknown kind (shared: it stays valid while
// held, even when the kind is unregistered meanwhile).
std::shared_ptr<const ModelKind> registered_model(const std::string& kind);
// Every kind make_model builds: the built-in ones, then the registered ones in name order.
std::vector<std::string> model_kinds();

}  // namespace meshgrad::nn
