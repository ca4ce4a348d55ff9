// The sampler of `train --sample-every` (TrainOptions::sampler): text from a training run's model on
// mesh rank 0, from the full parameters the run gathered there. Internal to the launch layer, which
// is the one that may use both train and generate.
#pragma once

#include "meshgrad/train/options.hpp"

namespace meshgrad::launch {

// Sets options.sampler and options.check_sampler. The tokenizer is the data's: a prepared
// directory's (its meta.json names the tokenizer files; a token file or glob of shards whose folder
// holds a meta.json counts as that folder), else bytes. It is resolved and the prompt encoded here,
// before any rank starts (the BPE encoder is not thread-safe); a model whose vocabulary is not 256
// without a tokenizer (or smaller than the tokenizer's) is refused by options.check_sampler, before
// step 1, naming the data. Each call of the sampler builds a one-rank copy of the model (no
// parallelism, on a communicator of its own), loads the full tensors and generates
// options.sample_tokens tokens at temperature 1 over the whole vocabulary with sampling seed = the
// run's seed + the step (what `meshgrad sample --seed SEED+STEP` draws from the weights of that
// step), returning the prompt and its continuation as valid UTF-8.
void set_train_sampler(train::TrainOptions& options);

}  // namespace meshgrad::launch
