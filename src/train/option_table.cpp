// The table of a training run's options (contract in include/meshgrad/train/option_table.hpp).
#include "meshgrad/train/option_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::train {

namespace {

// The accessor of a member of TrainOptions: MG_MEMBER(model.layers).
#define MG_MEMBER(EXPR) +[](TrainOptions& o) -> auto& { return o.EXPR; }

// The two flags of ParallelConfig::invariance: true asks for `mode` (the stronger mode wins, so the
// order of the two flags does not matter), false drops `mode` only (the other flag's mode stays),
// which is where two independent booleans ended: the record's and Python's false values.
template <nn::Invariance mode>
FlagAdapter invariance_flag() {
  return {[](const TrainOptions& o) { return o.parallel.invariance == mode; },
          [](TrainOptions& o, bool on) {
            if (on) {
              o.parallel.require(mode);
            } else if (o.parallel.invariance == mode) {
              o.parallel.invariance = nn::Invariance::None;
            }
          }};
}

const FlagAdapter kNoMetrics{[](const TrainOptions& o) { return o.metrics_path.empty(); },
                             [](TrainOptions& o, bool on) {
                               if (on) o.metrics_path.clear();
                             }};

const TextAdapter kReduceDtype{
    [](const TrainOptions& o) {
      return std::string(o.parallel.reduce_dtype == DType::BFloat16 ? "bf16" : "float32");
    },
    [](TrainOptions& o, const std::string& v) {
      MG_CHECK(v == "float32" || v == "bf16", "--reduce-dtype must be float32 or bf16, got '{}'", v);
      o.parallel.reduce_dtype = v == "bf16" ? DType::BFloat16 : DType::Float32;
    }};
const TextAdapter kCpSchedule{
    [](const TrainOptions& o) { return std::string(o.parallel.cp_ring ? "ring" : "all-gather"); },
    [](TrainOptions& o, const std::string& v) {
      MG_CHECK(v == "ring" || v == "all-gather", "--cp-schedule must be ring or all-gather, got '{}'", v);
      o.parallel.cp_ring = v == "ring";
    }};
const TextAdapter kDtype{[](const TrainOptions& o) { return std::string(dtype_name(o.model.dtype)); },
                         [](TrainOptions& o, const std::string& v) { o.model.dtype = parse_dtype(v); }};

constexpr const char* kOptimizer = "Optimizer and schedule";
constexpr const char* kCheckpoints = "Checkpoints";

using K = OptionKind;
using R = Recorded;

std::vector<TrainOption> where_and_what() {
  return {
      {.name = "mesh", .kind = K::Text, .help = "Mesh axes pp, dp, fsdp, ep, cp and tp, e.g. tp=2, dp=2,tp=2, "
       "fsdp=2,tp=2, pp=2,tp=2, cp=2,tp=2 or tp=2x2 (2-D)", .field = SurfaceHeld{}, .surface_default = "tp=2"},
      {.name = "backend", .kind = K::Text, .help = "threads (rank threads) or mpi (under mpirun)",
       .field = SurfaceHeld{}, .choices = {"threads", "mpi"}, .surface_default = "threads"},
      // The model's shape (interop::model_config_fields' order and names), then its run-time sizes.
      {.name = "layers", .kind = K::Int, .help = "Transformer blocks (n_layer)", .field = MG_MEMBER(model.layers),
       .recorded = R::Fixed, .min = 1},
      {.name = "hidden", .kind = K::Int, .help = "Model width (n_embd)", .field = MG_MEMBER(model.hidden),
       .recorded = R::Fixed, .min = 1},
      {.name = "ffn", .kind = K::Int, .help = "Feed-forward width (0: 4 x hidden)", .field = MG_MEMBER(model.ffn),
       .recorded = R::Fixed, .min = 0},
      {.name = "heads", .kind = K::Int, .help = "Attention heads (n_head)", .field = MG_MEMBER(model.heads),
       .recorded = R::Fixed, .min = 1},
      {.name = "vocab", .kind = K::Int, .help = "Vocabulary size (0: the data's)", .field = MG_MEMBER(model.vocab),
       .recorded = R::Fixed, .min = 0},
      {.name = "positions", .kind = K::Int, .help = "Position table rows, n_positions (0: --seq)",
       .field = MG_MEMBER(model.positions), .recorded = R::Fixed, .min = 0},
      {.name = "layer-norm-epsilon", .kind = K::Double, .help = "LayerNorm's epsilon",
       .field = MG_MEMBER(model.layer_norm_epsilon), .recorded = R::Fixed},
      {.name = "dtype", .kind = K::Text, .help = "The weights' type, float32 or float64 (bf16 training: --precision "
       "bf16)", .field = kDtype, .recorded = R::Fixed,
       .choices = {"float32", "float64"}},
      {.name = "precision", .kind = K::Text, .help = "float32, or bf16: matrix products and attention take bf16 "
       "inputs (float32 accumulation); weights, gradients, AdamW moments, softmax, norms and loss stay float32 "
       "(needs --dtype float32)", .field = MG_MEMBER(precision), .recorded = R::Kept, .choices = {"float32", "bf16"}},
      {.name = "reduce-dtype", .kind = K::Text, .help = "float32, or bf16: gradients cross the data-parallel axes (dp "
       "buckets, fsdp's reduce-scatter) as bf16, half the bytes, summed in float32 and rounded once (float32 models, "
       "not with the invariant modes)", .field = kReduceDtype, .recorded = R::Kept, .choices = {"float32", "bf16"}},
      {.name = "seq", .kind = K::Int, .help = "Sequence length T", .field = MG_MEMBER(model.seq),
       .recorded = R::Kept, .min = 1},
      {.name = "batch", .kind = K::Int, .help = "Global batch B (rows split over dp)", .field = MG_MEMBER(model.batch),
       .recorded = R::Kept, .min = 1},
      {.name = "dropout", .kind = K::Double, .help = "Dropout probability", .field = MG_MEMBER(model.dropout),
       .recorded = R::Kept},
      // The model family and the Llama family's own sizes and function (interop::model_config_fields:
      // a checkpoint records them all; one written before them reads as GPT-2's defaults).
      {.name = "model", .kind = K::Text, .help = "Model family: gpt (GPT-2) or llama (RMSNorm, RoPE, grouped-query "
       "attention, SwiGLU: Llama 2/3, Qwen2, Mistral-style)",
       .field = MG_MEMBER(model.kind), .recorded = R::Fixed, .choices = {"gpt", "llama"}},
      {.name = "kv-heads", .kind = K::Int, .help = "With --model llama: key/value heads, num_key_value_heads (0: "
       "--heads)", .field = MG_MEMBER(model.kv_heads), .recorded = R::Fixed, .min = 0},
      {.name = "head-dim", .kind = K::Int, .help = "With --model llama: features per head (0: hidden / heads)",
       .field = MG_MEMBER(model.head_dim), .recorded = R::Fixed, .min = 0},
      {.name = "rope-theta", .kind = K::Double, .help = "With --model llama: RoPE's base, rope_theta",
       .field = MG_MEMBER(model.rope_theta), .recorded = R::Fixed},
      {.name = "tie-word-embeddings", .kind = K::Flag, .help = "With --model llama: the output layer is the token "
       "embedding transposed", .field = MG_MEMBER(model.tie_word_embeddings), .recorded = R::Fixed},
      {.name = "attention-bias", .kind = K::Flag, .help = "With --model llama: q, k and v projections with biases "
       "(Qwen2)", .field = MG_MEMBER(model.attention_bias), .recorded = R::Fixed},
      {.name = "rope-scaling", .kind = K::Text, .help = "With --model llama: rope_scaling's type, linear or llama3 "
       "(empty: none)", .field = MG_MEMBER(model.rope_scaling), .recorded = R::Fixed},
      {.name = "rope-factor", .kind = K::Double, .help = "With --rope-scaling: rope_scaling.factor",
       .field = MG_MEMBER(model.rope_factor), .recorded = R::Fixed},
      {.name = "rope-low-freq-factor", .kind = K::Double, .help = "With --rope-scaling llama3: low_freq_factor",
       .field = MG_MEMBER(model.rope_low_freq_factor), .recorded = R::Fixed},
      {.name = "rope-high-freq-factor", .kind = K::Double, .help = "With --rope-scaling llama3: high_freq_factor",
       .field = MG_MEMBER(model.rope_high_freq_factor), .recorded = R::Fixed},
      {.name = "rope-original-positions", .kind = K::Int, .help = "With --rope-scaling llama3: "
       "original_max_position_embeddings", .field = MG_MEMBER(model.rope_original_positions), .recorded = R::Fixed,
       .min = 1},
      {.name = "sliding-window", .kind = K::Int, .help = "With --model llama: sliding-window attention over this many "
       "positions (Mistral's sliding_window; 0: none)", .field = MG_MEMBER(model.sliding_window),
       .recorded = R::Fixed, .min = 0},
      {.name = "max-window-layers", .kind = K::Int, .help = "With --sliding-window: the first layer that slides (Qwen2's "
       "max_window_layers; 0: every layer, as Mistral)", .field = MG_MEMBER(model.max_window_layers),
       .recorded = R::Fixed, .min = 0},
      {.name = "model-type", .kind = K::Text, .help = "With --model llama: the Hugging Face model_type it is "
       "(what export writes)", .field = MG_MEMBER(model.model_type), .recorded = R::Fixed,
       .choices = {"llama", "qwen2", "mistral", "mixtral", "qwen2_moe"}},
      {.name = "experts", .kind = K::Int, .help = "With --model llama: a sparse mixture of experts of this many SwiGLU "
       "experts in every block (Mixtral's num_local_experts; 0: the dense MLP)", .field = MG_MEMBER(model.experts),
       .recorded = R::Fixed, .min = 0},
      {.name = "experts-per-token", .kind = K::Int, .help = "With --experts: the experts each token is routed to "
       "(num_experts_per_tok)", .field = MG_MEMBER(model.experts_per_token), .recorded = R::Fixed, .min = 1},
      {.name = "router-aux-loss-coef", .kind = K::Double, .help = "With --experts: the load-balancing loss's "
       "coefficient (router_aux_loss_coef)", .field = MG_MEMBER(model.router_aux_loss_coef), .recorded = R::Fixed},
      {.name = "output-router-logits", .kind = K::Flag, .help = "With --experts: add the load-balancing loss to the "
       "loss (output_router_logits)", .field = MG_MEMBER(model.output_router_logits), .recorded = R::Fixed},
      {.name = "expert-ffn", .kind = K::Int, .help = "With --experts: each routed expert's width (Qwen2-MoE's "
       "moe_intermediate_size; 0: --ffn, as Mixtral)", .field = MG_MEMBER(model.expert_ffn), .recorded = R::Fixed,
       .min = 0},
      {.name = "shared-expert-ffn", .kind = K::Int, .help = "With --experts: a shared expert of this width in every "
       "sparse layer, gated by sigmoid(x g) (Qwen2-MoE's shared_expert_intermediate_size; 0: none)",
       .field = MG_MEMBER(model.shared_expert_ffn), .recorded = R::Fixed, .min = 0},
      {.name = "norm-topk-prob", .kind = K::Flag, .help = "With --experts: renormalise each token's k routing weights "
       "to sum to 1 (the default, Mixtral's; --no-norm-topk-prob: Qwen2-MoE's norm_topk_prob false)",
       .field = MG_MEMBER(model.norm_topk_prob), .recorded = R::Fixed},
      {.name = "decoder-sparse-step", .kind = K::Int, .help = "With --experts: every this-many-th block is a mixture "
       "of experts (Qwen2-MoE's decoder_sparse_step; 1: every block)", .field = MG_MEMBER(model.decoder_sparse_step),
       .recorded = R::Fixed, .min = 1},
      {.name = "mlp-only-layers", .kind = K::IntList, .help = "With --experts: blocks that keep a dense MLP, e.g. 0,5 "
       "(Qwen2-MoE's mlp_only_layers)", .field = MG_MEMBER(model.mlp_only_layers), .recorded = R::Fixed, .min = 0,
       .example = "0,5"},
      {.name = "capacity-factor", .kind = K::Double, .help = "With --experts: each expert takes at most ceil(f x "
       "tokens x k / experts) of a rank's tokens per forward and drops the rest, counted (0: dropless, the default)",
       .field = MG_MEMBER(model.capacity_factor), .recorded = R::Kept},
  };
}

std::vector<TrainOption> parallelism() {
  return {
      {.name = "sequence-parallel", .kind = K::Flag, .help = "Sequence parallelism (reduce-scatter / all-gather "
       "along the sequence)", .field = MG_MEMBER(parallel.sequence_parallel), .recorded = R::Kept},
      {.name = "overlap", .kind = K::Flag, .help = "Overlap backward communication with compute",
       .field = MG_MEMBER(parallel.overlap), .recorded = R::Kept},
      {.name = "regather", .kind = K::Flag, .help = "With --sequence-parallel: keep only the local input shard of "
       "each column layer and re-gather it in backward into one buffer shared by the layers (less memory, one more "
       "all-gather per layer)", .field = MG_MEMBER(parallel.recompute_allgather), .recorded = R::Kept},
      {.name = "checkpoint-blocks", .kind = K::Flag, .help = "Activation checkpointing per transformer block",
       .field = MG_MEMBER(parallel.checkpoint_blocks), .recorded = R::Kept},
      {.name = "reshard-after-forward", .kind = K::Flag, .help = "With an fsdp axis: free each block's gathered "
       "parameters after its forward (the default); --no-reshard-after-forward keeps them to its backward (one "
       "all-gather fewer per block and step, more memory: ZeRO-2)",
       .field = MG_MEMBER(parallel.reshard_after_forward), .recorded = R::Kept},
      {.name = "shard-optimizer", .kind = K::Flag, .help = "Shard the gradients and AdamW moments over dp (ZeRO): "
       "reduce-scatter instead of all-reduce, each rank steps its shard, parameters all-gathered once per step; "
       "needs dp > 1", .field = MG_MEMBER(parallel.shard_optimizer), .recorded = R::Kept},
      {.name = "tp-invariant", .kind = K::Flag, .help = "Bitwise the same model at every tensor-parallel degree "
       "that keeps the fixed reduction tree (docs/mesh-invariance.md); one BLAS thread per rank",
       .field = invariance_flag<nn::Invariance::Tp>(), .recorded = R::Kept},
      {.name = "invariant-blocks", .kind = K::Int, .help = "With --tp-invariant: fixed blocks per split dimension "
       "(a power of two; tp must divide it)", .field = MG_MEMBER(parallel.invariant_blocks), .recorded = R::Kept,
       .min = 1},
      {.name = "mesh-invariant", .kind = K::Flag, .help = "Bitwise the same model on every mesh for the same global "
       "batch: --tp-invariant's tree over the features and the batch cut into --batch-blocks row blocks added in "
       "one fixed tree over micro-batches, dp, fsdp and pipeline stages (docs/mesh-invariance.md); one BLAS thread "
       "per rank", .field = invariance_flag<nn::Invariance::Mesh>(), .recorded = R::Kept},
      {.name = "batch-blocks", .kind = K::Int, .help = "With --mesh-invariant: row blocks of the global batch, each "
       "its own micro-batch (a power of two dividing --batch; dp x fsdp must divide it)",
       .field = MG_MEMBER(parallel.batch_blocks), .recorded = R::Kept, .min = 1},
      {.name = "cp-schedule", .kind = K::Text, .help = "With cp=C: attention's keys and values passed around a ring "
       "of the cp ranks, each transfer in flight while the piece at hand is computed and the parts merged exactly "
       "(ring), or all-gathered first (all-gather; what --mesh-invariant's --sequence-blocks use)",
       .field = kCpSchedule, .recorded = R::Kept, .choices = {"ring", "all-gather"}},
      {.name = "sequence-blocks", .kind = K::Int, .help = "With --mesh-invariant: fixed blocks of every sequence, "
       "each product over tokens run per block and the blocks added in one tree (a power of two dividing --seq; "
       "cp=C needs a multiple of 2C; 1: none)", .field = MG_MEMBER(parallel.sequence_blocks), .recorded = R::Kept,
       .min = 1},
      {.name = "pp-layers", .kind = K::IntList, .help = "With pp=P: transformer blocks per stage, e.g. 3,3 (P counts "
       "summing to --layers; default an even split)", .field = MG_MEMBER(parallel.pp_layers), .recorded = R::Kept,
       .min = 1, .example = "3,3"},
      {.name = "pp-schedule", .kind = K::Text, .help = "With pp=P: 1f1b (activations of at most P micro-batches per "
       "stage) or gpipe (all forwards, then all backwards)", .field = MG_MEMBER(pp_schedule), .recorded = R::Kept,
       .choices = {"1f1b", "gpipe"}},
      {.name = "blas-threads", .kind = K::Int, .help = "OpenBLAS threads per rank (0: max(1, cores / ranks on the "
       "node)). Runs meant to be bitwise alike on meshes of different sizes (pp=2 against --grad-accum on one rank) "
       "need the same count: give both --blas-threads 1. The invariant modes run 1",
       .field = MG_MEMBER(blas_threads), .recorded = R::Kept, .min = 0,
       .max = static_cast<unsigned long long>(blas::kMaxThreadsPerRank)},
  };
}

std::vector<TrainOption> optimizer() {
  return {
      {.name = "steps", .kind = K::Int, .help = "Optimizer steps", .field = MG_MEMBER(steps), .recorded = R::Kept,
       .min = 1},
      {.name = "lr", .kind = K::Double, .help = "Peak learning rate", .field = MG_MEMBER(lr), .recorded = R::Kept,
       .group = kOptimizer},
      {.name = "warmup", .kind = K::Int, .help = "Steps of linear warmup from lr / warmup to lr",
       .field = MG_MEMBER(warmup_steps), .recorded = R::Kept, .group = kOptimizer, .min = 0},
      {.name = "lr-schedule", .kind = K::Text, .help = "After warmup: cosine or linear decay to --min-lr over "
       "--decay-steps, constant, or wsd (warmup-stable-decay: constant, then linear to --min-lr over the last "
       "--decay-fraction)", .field = MG_MEMBER(lr_schedule), .recorded = R::Kept, .group = kOptimizer,
       .choices = {"cosine", "linear", "constant", "wsd"}},
      {.name = "min-lr", .kind = K::Double, .help = "Learning rate at the end of the decay, in [0, --lr] (-1: lr / 10)",
       .field = MG_MEMBER(min_lr), .recorded = R::Kept, .group = kOptimizer},
      {.name = "decay-steps", .kind = K::Int, .help = "Steps of the decay after warmup, independent of --steps (-1: "
       "to the last step); min-lr after them", .field = MG_MEMBER(decay_steps), .recorded = R::Kept,
       .group = kOptimizer, .min = 1, .minus_one = "to the last step"},
      {.name = "decay-fraction", .kind = K::Double, .help = "wsd: the fraction of --decay-steps that decays (the rest "
       "is stable)", .field = MG_MEMBER(decay_fraction), .recorded = R::Kept, .group = kOptimizer},
      {.name = "beta1", .kind = K::Double, .help = "AdamW: decay rate of the first moment", .field = MG_MEMBER(beta1),
       .recorded = R::Kept, .group = kOptimizer},
      {.name = "beta2", .kind = K::Double, .help = "AdamW: decay rate of the second moment", .field = MG_MEMBER(beta2),
       .recorded = R::Kept, .group = kOptimizer},
      {.name = "eps", .kind = K::Double, .help = "AdamW: epsilon added to the second moment's square root",
       .field = MG_MEMBER(eps), .recorded = R::Kept, .group = kOptimizer},
      {.name = "weight-decay", .kind = K::Double, .help = "AdamW: decoupled weight decay of the 2-D weights (matrices "
       "and embeddings; not biases or norms)", .field = MG_MEMBER(weight_decay), .recorded = R::Kept,
       .group = kOptimizer},
      {.name = "peak-gflops", .kind = K::Double, .help = "The mesh's peak GFLOP/s for the MFU shown, 0.001 to 1e12 "
       "(0: measured at start with a GEMM)", .field = MG_MEMBER(peak_gflops), .group = kOptimizer},
      {.name = "seed", .kind = K::Seed, .help = "Seed of initialisation, data order and dropout",
       .field = MG_MEMBER(seed), .recorded = R::Kept, .min = 0},
  };
}

std::vector<TrainOption> data_and_outputs() {
  return {
      {.name = "data", .kind = K::Path, .help = "A directory from `meshgrad prepare` (train.bin, or train_*.bin shards "
       "read in order), a glob of shards ('DIR/train_*.bin'), an llm.c .bin token file, or a text file (bytes are "
       "tokens); default: built-in corpus", .field = MG_MEMBER(data_path), .recorded = R::Kept},
      {.name = "val-data", .kind = K::Path, .help = "Validate on this instead of the data's own split: a prepared "
       "directory (its val.bin or val_*.bin), a token file, or a glob of shards", .field = MG_MEMBER(val_data_path),
       .recorded = R::Kept},
      {.name = "metrics", .kind = K::Path, .help = "JSON-lines metrics file (one object per step)",
       .field = MG_MEMBER(metrics_path), .recorded = R::Kept, .record_empty = true},
      {.name = "no-metrics", .kind = K::Flag, .help = "Write no metrics file", .field = kNoMetrics,
       .surfaces = kCommandLine, .alias_of = "metrics"},
      {.name = "save", .kind = K::Path, .help = "Write the trained parameters (full tensors) to this safetensors file",
       .field = MG_MEMBER(save_path), .recorded = R::Kept},
      {.name = "eval-every", .kind = K::Int, .help = "Evaluate the validation loss every N steps and after the last "
       "(0 = never; needs a prepared --data directory)", .field = MG_MEMBER(eval_every), .recorded = R::Kept, .min = 0},
      {.name = "eval-steps", .kind = K::Int, .help = "Validation batches per evaluation", .field = MG_MEMBER(eval_steps),
       .recorded = R::Kept, .min = 1},
      {.name = "sample-every", .kind = K::Int, .help = "Print (and write to the metrics) a sample of the model every N "
       "steps (0 = never); on any mesh", .field = MG_MEMBER(sample_every), .recorded = R::Kept, .min = 0},
      {.name = "sample-tokens", .kind = K::Int, .help = "Tokens per sample", .field = MG_MEMBER(sample_tokens),
       .recorded = R::Kept, .min = 1},
      {.name = "sample-prompt", .kind = K::Text, .help = "The text samples continue (cut to the model's positions: "
       "--positions, default --seq tokens)", .field = MG_MEMBER(sample_prompt), .recorded = R::Kept},
      {.name = "grad-clip", .kind = K::Double, .help = "Clip the global L2 norm of the gradient to this (0 = off); "
       "grad_norm is in the metrics either way", .field = MG_MEMBER(grad_clip), .recorded = R::Kept},
      {.name = "grad-accum", .kind = K::Int, .help = "Micro-batches per step: each replica's rows of --batch in K "
       "parts, one reduction per step (on a pipeline: what flows through the stages)", .field = MG_MEMBER(grad_accum),
       .recorded = R::Kept, .min = 1},
      {.name = "micro-batches", .kind = K::Int, .help = "The same as --grad-accum, the pipeline's name for it: with "
       "pp=P, M micro-batches flow through the stages; the bubble is (P-1)/(M+P-1)", .field = MG_MEMBER(grad_accum),
       .alias_of = "grad-accum", .min = 1},
  };
}

std::vector<TrainOption> checkpoints_and_the_rest() {
  return {
      {.name = "checkpoint-dir", .kind = K::Path, .help = "Write sharded checkpoints (parameters, optimizer, data "
       "position, RNG) into DIR/step_XXXXXXXX every --save-every steps and at the end; SIGTERM / Ctrl-C then "
       "checkpoint and stop", .field = MG_MEMBER(checkpoint_dir), .recorded = R::Kept, .group = kCheckpoints},
      {.name = "save-every", .kind = K::Int, .help = "Steps between checkpoints (0: only at the end)",
       .field = MG_MEMBER(save_every), .recorded = R::Kept, .group = kCheckpoints, .min = 0},
      {.name = "keep", .kind = K::Int, .help = "Keep only the newest K checkpoints (0: all)", .field = MG_MEMBER(keep),
       .recorded = R::Kept, .group = kCheckpoints, .min = 0},
      {.name = "sync-checkpoints", .kind = K::Flag, .help = "Write checkpoints before training goes on (default: in "
       "the background after an in-memory snapshot)", .field = MG_MEMBER(checkpoint_sync), .recorded = R::Kept,
       .group = kCheckpoints},
      {.name = "resume", .kind = K::Path, .help = "Resume from a checkpoint directory, or the newest one under a "
       "--checkpoint-dir; options come from it unless given again (the model's shape cannot change); new "
       "checkpoints go into the folder resumed from unless --checkpoint-dir is given", .field = MG_MEMBER(resume),
       .group = kCheckpoints},
      {.name = "keep-schedule", .kind = K::Flag, .help = "With --resume and another --steps: keep the checkpoint's "
       "learning-rate schedule (its decay ends where it did; without it the decay stretches to the new last step)",
       .field = MG_MEMBER(keep_schedule), .group = kCheckpoints},
      {.name = "data-changed-ok", .kind = K::Flag, .help = "With --resume: go on although the data's content differs "
       "from the checkpoint's (it is refused otherwise, naming both content hashes)",
       .field = MG_MEMBER(data_changed_ok), .group = kCheckpoints},
      {.name = "model-config", .kind = K::Path, .help = "A Hugging Face config.json (model_type gpt2, llama, qwen2 or "
       "mistral) the model's shape comes from; a size option also given must agree with it",
       .field = MG_MEMBER(model_config)},
      {.name = "init-from", .kind = K::Path, .help = "Start from a Hugging Face GPT-2 directory (config.json + "
       "model.safetensors) instead of random weights; the sizes come from its config.json",
       .field = MG_MEMBER(init_from)},
      {.name = "trace", .kind = K::Path, .help = "Write a Chrome trace (Perfetto / chrome://tracing) of the run to "
       "this JSON file: per rank and communicator, each layer's forward and backward, each collective, each wait; "
       "see docs/tracing.md", .field = MG_MEMBER(trace_path)},
      // The command line always shows progress (on stderr, rank 0); Python chooses.
      {.name = "progress", .kind = K::Flag, .help = "Show progress on stderr (rank 0)", .field = MG_MEMBER(progress),
       .surfaces = kPython},
  };
}

#undef MG_MEMBER

}  // namespace

std::string TrainOption::python_keyword() const {
  std::string key = name;
  std::replace(key.begin(), key.end(), '-', '_');
  return key;
}

const std::vector<TrainOption>& train_option_table() {
  static const std::vector<TrainOption> table = [] {
    std::vector<TrainOption> t;
    for (auto part : {where_and_what, parallelism, optimizer, data_and_outputs, checkpoints_and_the_rest}) {
      for (TrainOption& o : part()) t.push_back(std::move(o));
    }
    return t;
  }();
  return table;
}

const TrainOption& train_option(const std::string& name) {
  const auto& table = train_option_table();
  const auto it = std::find_if(table.begin(), table.end(), [&](const TrainOption& o) { return o.name == name; });
  MG_CHECK(it != table.end(), "train: no option named '{}'", name);
  return *it;
}

nlohmann::json option_value(const TrainOption& option, const TrainOptions& o) {
  // The accessors only name a member; reading through them does not write.
  auto& options = const_cast<TrainOptions&>(o);
  return std::visit(
      [&](const auto& field) -> nlohmann::json {
        using F = std::decay_t<decltype(field)>;
        if constexpr (std::is_same_v<F, SurfaceHeld>) return nullptr;
        else if constexpr (std::is_same_v<F, FlagAdapter> || std::is_same_v<F, TextAdapter>) return field.get(o);
        else return field(options);
      },
      option.field);
}

void set_option_value(const TrainOption& option, TrainOptions& o, const nlohmann::json& value) {
  std::visit(
      [&](const auto& field) {
        using F = std::decay_t<decltype(field)>;
        if constexpr (std::is_same_v<F, SurfaceHeld>) return;
        else if constexpr (std::is_same_v<F, FlagAdapter>) field.set(o, value.get<bool>());
        else if constexpr (std::is_same_v<F, TextAdapter>) field.set(o, value.get<std::string>());
        else value.get_to(field(o));
      },
      option.field);
}

}  // namespace meshgrad::train
