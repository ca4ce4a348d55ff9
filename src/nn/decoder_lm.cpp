// The runner of decoder-only families (decoder_lm.hpp): the pipeline cut, FSDP units, activation
// checkpointing, the dropout stream, the tied output layer, the loss and decoding, applied to a
// family's module tree from outside.
#include "meshgrad/nn/decoder_lm.hpp"

#include "meshgrad/autograd/checkpoint.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/fsdp.hpp"
#include "meshgrad/nn/tied_weight.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

namespace {

// A block as the runner holds it: the family's block and its FSDP unit (nullptr without FSDP).
// Shared with the closures a checkpointed block keeps for its recomputation.
struct StageBlock {
  std::shared_ptr<DecoderBlock> block;
  std::unique_ptr<FsdpUnit> unit;

  // The block's forward inside its label, trace scope and FSDP bracket: its parameters gathered for
  // this forward and given back after it unless a graph will read them before a regather
  // (ParallelContext::reshard_after_forward).
  Tensor forward(const Tensor& x, std::int64_t seq, const Dropout& dropout, const ParallelContext& ctx) const {
    dist::CommLabelScope label(block->name());
    trace::Scope scope(block->name());
    const FsdpForwardScope gathered(unit.get(), !autograd::GradMode::is_enabled() || ctx.reshard_after_forward());
    return block->forward(x, seq, dropout);
  }
};

// What the dropout needs, owned jointly by the model and by the closures a checkpointed block keeps
// for its recomputation (so a node never points into a model that moved or died).
struct DropoutState {
  double p = 0;
  bool training = true;
  ParallelContextPtr ctx;
  random::Generator gen;
};

class DecoderLM final : public Model {
 public:
  DecoderLM(const ModelConfig& cfg, const ParallelConfig& parallel, dist::DeviceMeshPtr mesh, std::uint64_t seed,
            const DecoderFamilyFactory& make_family)
      : cfg_(cfg), ctx_(ParallelContext::on(std::move(mesh), parallel)),
        dropout_(std::make_shared<DropoutState>(DropoutState{cfg.dropout, true, ctx_, random::Generator(seed ^ 0xD50F)})) {
    const std::vector<int> counts = stage_layer_counts(cfg.layers, ctx_->pp_size(), parallel.pp_layers);
    stage_.index = ctx_->pp_rank();
    stage_.count = ctx_->pp_size();
    for (int s = 0; s < stage_.index; ++s) stage_.first_block += counts[static_cast<std::size_t>(s)];
    stage_.end_block = stage_.first_block + counts[static_cast<std::size_t>(stage_.index)];
    family_ = make_family(cfg, ctx_, {stage_.is_first(), stage_.is_last(), stage_.first_block, stage_.end_block}, seed);
    // The tied table's two uses: on the stages holding the table (a middle stage has neither use).
    if (family_->tied_output() && family_->token_embedding() != nullptr) {
      tied_name_ = table_name();
      tied_ = std::make_unique<TiedWeight>(tied_name_, ctx_, stage_);
    }
    build_fsdp_units();
  }
  DecoderLM(const DecoderLM&) = delete;
  DecoderLM& operator=(const DecoderLM&) = delete;

  Tensor loss(const Batch& batch, std::int64_t global_tokens) override {
    // loss() runs the whole model on this rank. A pipeline's stages run through
    // pipeline/executor.hpp (train, evaluate, grads, check and explain all do), never through here.
    MG_CHECK(stage_.count == 1, "{}: the mesh {} is a pipeline of {} stages (this rank holds blocks {}..{}): "
             "loss() runs the whole model; run a pipeline's step through pipeline::run_step", cfg_.kind,
             ctx_->mesh->str(), stage_.count, stage_.first_block, stage_.end_block - 1);
    return forward_stage(batch, Tensor(), global_tokens);
  }

  PipelineStage stage() const override { return stage_; }

  Shape stage_input_shape(const Batch& batch) const override {
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1) / ctx_->cp_size();   // this rank's chunks
    const ParallelContext& ctx = *ctx_;
    const std::int64_t t_local = ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).size : seq;
    return {t_local, b, cfg_.hidden};
  }

  void refresh_stage_copies() override {
    if (stage_.count == 1 || !tied_) return;
    const Tensor& table = family_->token_embedding()->weight.value;
    tied_->refresh_copy(stage_.is_first() ? table : Tensor(), stage_.is_last() ? table : Tensor());
  }

  Tensor forward_stage(const Batch& batch, const Tensor& input, std::int64_t global_tokens) override {
    check_batch(batch, input);
    const ParallelContext& ctx = *ctx_;
    // The sequence this rank's layers see: its two chunks under cp (nn/context_parallel.hpp).
    const std::int64_t seq = batch.inputs.size(1) / ctx.cp_size();
    trace::Scope model_scope(cfg_.kind);   // ops between the layers (positions, dropout) belong to it
    const bool recording = autograd::GradMode::is_enabled();
    const FsdpForwardScope root_gathered(root_unit_.get(), /*release=*/!recording);

    const Dropout dropout = dropout_for(batch);
    // A stage draws the dropout seeds the whole model draws for its layers, and leaves the stream
    // where the whole model's forward does.
    const std::shared_ptr<DropoutState>& state = dropout_;
    const bool draws = state->training && state->p > 0;
    const std::uint64_t stream_start = state->gen.counter();
    if (draws) state->gen.set_counter(stream_start + (stage_.is_first() ? 0 : dropout_draws(stage_.first_block)));

    family_->begin_forward(state->training);
    Tensor h = stage_.is_first() ? embed(batch, dropout) : input;
    h = run_blocks(h, seq, dropout, recording);
    if (draws) state->gen.set_counter(stream_start + dropout_draws(cfg_.layers));
    if (!stage_.is_last()) return h;
    h = family_->final_norm(h, seq);
    Tensor tied;
    if (tied_) {
      dist::CommLabelScope label("lm_head");   // a pipeline's tied gradient goes to the first stage from here
      tied = tied_->output_use(stage_.is_first() ? family_->token_embedding()->weight.operand() : tied_copy());
    }
    const Tensor logits = family_->output_logits(h, seq, tied);   // [T, B, V_local]: never gathered
    const Tensor targets = take_local_chunks(batch.targets.transpose(0, 1).contiguous(), ctx).view({-1});
    const Tensor loss = vocab_parallel_cross_entropy(reshape(logits, {-1, logits.size(2)}), targets,
                                                     family_->vocab_offset(), cfg_.vocab, ctx.tp,
                                                     static_cast<double>(global_tokens), -100, &family_->output_plan(),
                                                     ctx.reduce_order(),
                                                     ctx.sequence_row_blocks(logits.size(0), logits.size(0), logits.size(1)));
    const Tensor aux =
        cfg_.moe() && cfg_.output_router_logits ? family_->auxiliary_loss(forwards_per_step(batch)) : Tensor();
    return ctx.loss_partial_over_dp(aux.defined() ? add(loss, aux) : loss);
  }

  std::vector<Parameter*> parameters() override {
    // This stage's parameters, in the one-rank model's order (a pipeline's stages, concatenated in
    // stage order, list every parameter once: the last stage's copy of a tied table is not one).
    std::vector<Parameter*> out;
    if (stage_.is_first()) out = family_->embedding_parameters();
    for (const auto& b : blocks_) b->block->collect(out);
    if (stage_.is_last()) {
      for (Parameter* p : family_->head_parameters()) out.push_back(p);
    }
    return out;
  }
  const ModelConfig& config() const override { return cfg_; }
  void set_training(bool training) override { dropout_->training = training; }
  std::uint64_t random_state() const override { return dropout_->gen.counter(); }
  void set_random_state(std::uint64_t state) override { dropout_->gen.set_counter(state); }
  dist::ReduceOrder reduce_order() const override { return ctx_->reduce_order(); }
  ExpertLoad take_expert_load() override { return family_->take_expert_load(); }
  const dist::ProcessGroup* sibling_block_group() const override {
    return ctx_->config.mesh_invariant() && ctx_->expert_parallel() ? &ctx_->expert_group() : nullptr;
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> communication_units() const override {
    std::vector<std::pair<std::string, std::vector<std::string>>> out;
    const auto names = [](const std::vector<Parameter*>& params) {
      std::vector<std::string> n;
      for (const Parameter* p : params) n.push_back(p->name);
      return n;
    };
    for (const auto& b : blocks_) {
      if (!b->unit) continue;
      std::vector<Parameter*> params;
      b->block->collect(params);
      out.emplace_back("fsdp:" + b->unit->name(), names(params));
    }
    if (root_unit_) {
      std::vector<Parameter*> own;
      if (stage_.is_first()) own = family_->embedding_parameters();
      if (stage_.is_last()) {
        for (Parameter* p : family_->head_parameters()) own.push_back(p);
      }
      out.emplace_back("fsdp:" + root_unit_->name(), names(own));
    }
    return out;
  }
  const dist::ProcessGroup* micro_batch_sum_group() const override {
    // ep and the sequence blocks' cp never meet (ParallelContext refuses the pair).
    if (ctx_->sequence_blocked() && ctx_->context_parallel()) return &ctx_->context_group();
    return sibling_block_group();
  }
  void set_accumulating(bool on) override {
    if (tied_) tied_->set_accumulating(on);
    if (root_unit_) root_unit_->set_accumulating(on);
    for (const auto& b : blocks_) {
      if (b->unit) b->unit->set_accumulating(on);
    }
  }

  KvCache new_cache(std::int64_t batch) override;
  Tensor decode(const Tensor& ids, KvCache& cache, bool all_positions) override;

 private:
  // The tied table's name in messages: "wte" of "wte.weight".
  std::string table_name() {
    const std::string& name = family_->token_embedding()->weight.name;
    const std::size_t dot = name.rfind('.');
    return dot == std::string::npos ? name : name.substr(0, dot);
  }

  // The forwards one optimizer step averages a per-forward term over (the load-balancing loss): the
  // micro-batch rounds, each a forward on every rank that splits the batch, in the normal mode; the
  // row blocks under --mesh-invariant, where every forward is one block on one rank.
  // A batch that does not say where it lies in a global one (global_rows 0) is one forward's.
  int forwards_per_step(const Batch& batch) const {
    if (batch.global_rows <= 0) return 1;
    const std::int64_t b = batch.inputs.size(0), rows = batch.global_rows;
    const std::int64_t per_forward = ctx_->config.mesh_invariant() ? b : b * ctx_->batch_replicas();
    MG_CHECK(rows % per_forward == 0, "{}: a forward of {} rows ({} per rank) does not divide the global batch of {} "
             "rows", cfg_.kind, per_forward, b, rows);
    return static_cast<int>(rows / per_forward);
  }

  // Dropout seeds the forward draws before block `block`.
  std::uint64_t dropout_draws(int block) const {
    return static_cast<std::uint64_t>(family_->embedding_dropout_draws()) +
           static_cast<std::uint64_t>(family_->block_dropout_draws()) * static_cast<std::uint64_t>(block);
  }

  // The FSDP units: one per block, and the stage's own parameters (embedding, head) as one more. The
  // unit gathered first in a stage's forward comes last in its backward and delivers every
  // reduction: the stage's own where it has one, else its first block's.
  void build_fsdp_units() {
    const bool fsdp = ctx_->fsdp_active();
    const std::shared_ptr<FsdpReductions> reductions = fsdp ? FsdpUnit::new_reductions() : nullptr;
    const bool has_own_unit = stage_.is_first() || stage_.is_last();
    for (const std::shared_ptr<DecoderBlock>& block : family_->blocks()) {
      auto held = std::make_shared<StageBlock>();
      held->block = block;
      if (fsdp) {
        std::vector<Parameter*> params;
        block->collect(params);
        const bool last_in_backward = !has_own_unit && blocks_.empty();
        held->unit = std::make_unique<FsdpUnit>(block->name(), std::move(params), ctx_, reductions, last_in_backward);
      }
      blocks_.push_back(std::move(held));
    }
    if (!fsdp || !has_own_unit) return;
    // Gathered for the whole forward and backward: a tied table is used at both ends, and its two
    // gradients must meet unsharded (dp's sum). In a pipeline each end has its own.
    std::vector<Parameter*> own;
    if (stage_.is_first()) own = family_->embedding_parameters();
    if (stage_.is_last()) {
      for (Parameter* p : family_->head_parameters()) own.push_back(p);
    }
    root_unit_ = std::make_unique<FsdpUnit>(cfg_.kind, std::move(own), ctx_, reductions, /*last_in_backward=*/true);
  }

  void check_batch(const Batch& batch, const Tensor& input) const;
  void check_tokens(const Tensor& t, const char* what, bool ignore_allowed) const;

  // Masks by global index: the row offset and row count of the global batch (dp replicas and
  // micro-batches hold slices of it), the positions of this rank's rows in the sequence (its SP
  // shard, its cp chunks). Holds the shared state, not the model: a checkpointed block calls it again
  // during backward.
  Dropout dropout_for(const Batch& batch) const {
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1), c = cfg_.hidden;
    const std::int64_t rows = batch.global_rows > 0 ? batch.global_rows : b;
    const std::int64_t row0 = batch.global_rows > 0 ? batch.row_offset : 0;
    return [state = dropout_, seq, rows, row0, c](const Tensor& x) {
      if (!state->training || state->p == 0) return x;
      const std::uint64_t seed = state->gen.next_seed();
      const std::vector<PositionRun> runs = activation_positions(*state->ctx, seq / state->ctx->cp_size());
      TensorList parts;
      for (const PositionRun& r : runs) {
        const Tensor piece = runs.size() == 1 ? x : narrow(x, 0, r.local, r.size);
        parts.push_back(dropout_global(piece, state->p, seed, {seq, rows, c}, {r.global, row0, 0}));
      }
      return parts.size() == 1 ? parts[0] : cat(parts, 0);
    };
  }

  // The first stage's pieces before the blocks: [T(_local), B, C], dropout applied.
  Tensor embed(const Batch& batch, const Dropout& dropout) const {
    // [T, B], or this rank's chunks [T / cp, B] of it
    const Tensor ids = take_local_chunks(batch.inputs.transpose(0, 1).contiguous(), *ctx_);
    const std::vector<PositionRun> positions = local_chunks(*ctx_, ids.size(0));
    const Tensor& table = family_->token_embedding()->weight.operand();
    if (!tied_) return family_->embed(ids, table, positions, dropout);
    Tensor used;
    {
      dist::CommLabelScope label(tied_name_);   // a pipeline's tied gradient arrives here from the last stage
      used = tied_->embedding_use(table);
    }
    return family_->embed(ids, used, positions, dropout);
  }

  // This stage's blocks, each checkpointed or with its FSDP regather as the options say.
  Tensor run_blocks(Tensor h, std::int64_t seq, const Dropout& dropout, bool recording) const {
    const ParallelContextPtr& ctx = ctx_;
    if (!blocks_.empty() && blocks_[0]->unit) blocks_[0]->unit->prefetch();
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const std::shared_ptr<const StageBlock> block = blocks_[i];
      // FSDP: the next block's gathers run while this one computes.
      if (i + 1 < blocks_.size() && blocks_[i + 1]->unit) blocks_[i + 1]->unit->prefetch();
      if (ctx->config.checkpoint_blocks) {
        h = autograd::checkpoint(
            [block, seq, dropout, ctx](const TensorList& in) {
              return TensorList{block->forward(in[0], seq, dropout, *ctx)};
            },
            {h}, {&dropout_->gen})[0];
      } else {
        h = block->forward(h, seq, dropout, *ctx);
        if (block->unit && recording && ctx->reshard_after_forward()) {
          // Its backward finds the block's parameters gathered again, and the previous block's on the way.
          h = block->unit->regather_before_backward(h, i > 0 ? blocks_[i - 1]->unit.get() : nullptr);
        }
      }
    }
    return h;
  }

  // The last stage's copy of the tied table, as the output layer uses it: this rank's tp piece. With
  // parameters sharded over fsdp (or dp under --shard-optimizer) the copy holds this rank's rows like
  // the first stage's shard it is refreshed from, and is gathered here (not differentiable: the
  // gradient goes to the first stage, nn/tied_weight.hpp).
  Tensor tied_copy() const {
    const Parameter& weight = family_->token_embedding()->weight;
    const Tensor& shard = weight.value;
    if (ctx_->fsdp_axis < 0 || ctx_->mesh->axis_size(ctx_->fsdp_axis) == 1) return shard;
    const dist::ProcessGroup& group = ctx_->mesh->group(ctx_->fsdp_axis);
    const Shape piece = weight.operand_shape();
    Tensor gathered;
    {
      autograd::NoGradGuard no_grad;
      gathered = dist::all_gather(shard.detach(), group, 0, shard_sizes(piece[0], group.size()));
    }
    gathered.set_requires_grad(true);
    return gathered;
  }

  void check_one_stage(const char* what) const {
    MG_CHECK(stage_.count == 1, "{} {}: incremental decoding runs the whole model on one stage, and this mesh has a "
             "pipeline of {} stages (sample and generate on a mesh without pp)", cfg_.kind, what, stage_.count);
  }

  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  PipelineStage stage_;
  std::unique_ptr<DecoderFamily> family_;
  std::unique_ptr<TiedWeight> tied_;                  // a tied output layer only
  std::string tied_name_;                              // the tied table's ("wte")
  std::vector<std::shared_ptr<StageBlock>> blocks_;   // shared with checkpointed regions' closures
  std::shared_ptr<DropoutState> dropout_;
  std::unique_ptr<FsdpUnit> root_unit_;   // FSDP: the stage's own parameters (the blocks have their own)
};

void DecoderLM::check_batch(const Batch& batch, const Tensor& input) const {
  const char* kind = cfg_.kind.c_str();
  check_dtype(batch.inputs, DType::Int64, kind, "inputs");
  check_dtype(batch.targets, DType::Int64, kind, "targets");
  MG_CHECK(batch.inputs.dim() == 2 && batch.targets.shape() == batch.inputs.shape(),
           "{}: inputs {} and targets {} must both be [B, T]", kind, shape_str(batch.inputs.shape()),
           shape_str(batch.targets.shape()));
  const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1);
  MG_CHECK(seq >= 1 && b >= 1, "{}: a batch needs at least one row and one position, got [B, T] = [{}, {}]", kind, b,
           seq);
  MG_CHECK(seq <= cfg_.n_positions(), "{}: sequence length {} exceeds n_positions {}", kind, seq, cfg_.n_positions());
  check_context_sequence(*ctx_, seq, kind);
  if (stage_.is_first()) check_tokens(batch.inputs, "input", /*ignore_allowed=*/false);
  if (stage_.is_last()) check_tokens(batch.targets, "target", /*ignore_allowed=*/true);
  MG_CHECK(stage_.is_first() != input.defined(), "{} stage {} of {}: {}", kind, stage_.index, stage_.count,
           stage_.is_first() ? "the first stage embeds the tokens and takes no input activation"
                             : "a later stage needs the activation of the stage before it");
  if (input.defined()) {
    MG_CHECK(input.shape() == stage_input_shape(batch) && input.dtype() == cfg_.dtype, "{} stage {}: the input "
             "activation is {} {}, expected {} {}", kind, stage_.index, shape_str(input.shape()),
             dtype_name(input.dtype()), shape_str(stage_input_shape(batch)), dtype_name(cfg_.dtype));
  }
  const std::int64_t rows = batch.global_rows > 0 ? batch.global_rows : b;
  const std::int64_t row0 = batch.global_rows > 0 ? batch.row_offset : 0;
  MG_CHECK(row0 >= 0 && row0 + b <= rows, "{}: batch rows [{}, {}) lie outside its global batch of {} rows", kind,
           row0, row0 + b, rows);
}

// Every token of a [B, T] batch tensor in [0, vocab) (a target may be the ignore index -100), or an
// error naming the row and position of the first that is not (the layers see [T, B] and would name
// a flat index of that).
void DecoderLM::check_tokens(const Tensor& t, const char* what, bool ignore_allowed) const {
  const std::vector<std::int64_t> v = t.to_int64_vector();
  const std::int64_t cols = t.size(1);
  for (std::size_t i = 0; i < v.size(); ++i) {
    if ((v[i] >= 0 && v[i] < cfg_.vocab) || (ignore_allowed && v[i] == -100)) continue;
    throw InvalidArgument(fmt::format("{}: {} token {} at batch row {}, position {} is outside the vocabulary [0, {})",
                                      cfg_.kind, what, v[i], static_cast<std::int64_t>(i) / cols,
                                      static_cast<std::int64_t>(i) % cols, cfg_.vocab));
  }
}

KvCache DecoderLM::new_cache(std::int64_t batch) {
  check_one_stage("new_cache");
  MG_CHECK(batch >= 1, "{}: a key/value cache needs at least one sequence, got batch {}", cfg_.kind, batch);
  KvCache cache;
  cache.batch = batch;
  cache.capacity = cfg_.n_positions();
  for (const auto& b : blocks_) {
    const Shape shape = b->block->cache_shape(batch, cache.capacity);
    cache.keys.push_back(Tensor::empty(shape, cfg_.dtype));     // positions >= length are never read
    cache.values.push_back(Tensor::empty(shape, cfg_.dtype));
  }
  return cache;
}

// The forward of loss() on the new positions only, every block reading the earlier positions' keys
// and values from the cache instead of recomputing them.
Tensor DecoderLM::decode(const Tensor& ids, KvCache& cache, bool all_positions) {
  check_one_stage("decode");
  const std::string what = cfg_.kind + " decode";
  MG_CHECK(!ctx_->expert_parallel(), "{}: decoding runs one sequence batch on every rank, and the mesh {} splits the "
           "experts over ep: sample on a mesh without ep (a checkpoint reshards onto any mesh)", what, ctx_->mesh->str());
  check_dtype(ids, DType::Int64, what.c_str(), "ids");
  MG_CHECK(cache.keys.size() == blocks_.size() && cache.values.size() == blocks_.size() &&
               cache.capacity == cfg_.n_positions() && cache.length >= 0 && cache.length <= cache.capacity,
           "{}: the cache ({} blocks, capacity {}) was not made by this model's new_cache ({} blocks, "
           "n_positions {})", what, cache.keys.size(), cache.capacity, blocks_.size(), cfg_.n_positions());
  MG_CHECK(ids.dim() == 2 && ids.size(0) == cache.batch && ids.size(1) >= 1,
           "{}: ids must be int64 [B, T_new] with B = {} (the cache's) and T_new >= 1, got {}", what, cache.batch,
           shape_str(ids.shape()));
  const ParallelContext& ctx = *ctx_;
  MG_CHECK(!ctx.sequence_parallel(), "{}: the model was built with sequence parallelism, a training layout; build it "
           "without (ParallelConfig::sequence_parallel = false) to decode", what);
  const std::int64_t b = ids.size(0), t_new = ids.size(1), start = cache.length;
  MG_CHECK(start + t_new <= cfg_.n_positions(), "{}: positions {} .. {} do not fit in n_positions = {} (the cache "
           "holds {})", what, start, start + t_new - 1, cfg_.n_positions(), start);
  autograd::NoGradGuard no_grad;
  const FsdpForwardScope root_gathered(root_unit_.get(), /*release=*/true);
  family_->begin_forward(false);
  const Tensor tids = ids.transpose(0, 1).contiguous();   // [T_new, B]
  const Tensor& table = family_->token_embedding()->weight.operand();
  Tensor h = family_->embed(tids, table, {{0, start, t_new}}, [](const Tensor& x) { return x; });   // [T_new, B, C]
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    const StageBlock& held = *blocks_[l];
    dist::CommLabelScope label(held.block->name());
    const FsdpForwardScope gathered(held.unit.get(), /*release=*/true);
    h = held.block->forward_cached(h, cache.keys[l], cache.values[l], start, cache.attention_scores);
  }
  if (!all_positions) h = narrow(h, 0, t_new - 1, 1);   // only the last position's logits are wanted
  const std::int64_t rows = h.size(0);
  h = family_->final_norm(h, rows);
  const Tensor local = family_->output_logits(h, rows, tied_ ? table : Tensor());   // [T', B, V_local]
  Tensor logits;
  {
    dist::CommLabelScope label("lm_head");
    logits = dist::gather_from_region(local, ctx.tp, -1, cfg_.vocab);   // [T', B, V] on every rank
  }
  cache.length = start + t_new;
  logits = permute(logits, {1, 0, 2}).contiguous();   // [B, T', V]
  return all_positions ? logits : logits.view({b, cfg_.vocab});
}

}  // namespace

std::int64_t sequence_shard_offset(const ParallelContext& ctx, std::int64_t seq) {
  return ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).offset : 0;
}

std::vector<PositionRun> activation_positions(const ParallelContext& ctx, std::int64_t seq) {
  const std::int64_t rows = ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).size : seq;
  return rows_of(local_chunks(ctx, seq), sequence_shard_offset(ctx, seq), rows);
}

std::unique_ptr<Model> make_decoder_lm(const ModelConfig& config, const ParallelConfig& parallel,
                                       dist::DeviceMeshPtr mesh, std::uint64_t seed,
                                       const DecoderFamilyFactory& family) {
  return std::make_unique<DecoderLM>(config, parallel, std::move(mesh), seed, family);
}

}  // namespace meshgrad::nn
