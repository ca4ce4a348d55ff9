// --blas-threads: checked with the other options, applied on every rank before its first GEMM
// (contracts in include/meshgrad/train/trainer.hpp and tensor/blas.hpp).
#include <fmt/format.h>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train {

void check_blas_threads(const TrainOptions& o) {
  // A value the user did not give on a resume is the checkpoint's: say so, or the message names an
  // option they never typed.
  const std::string origin =
      !o.resume_dir.empty() && o.given_options.count("blas-threads") == 0 ? " (from the checkpoint)" : "";
  MG_CHECK(o.blas_threads >= 0 && o.blas_threads <= blas::kMaxThreadsPerRank,
           "train: --blas-threads must be 0 (automatic) to {}, got {}{}", blas::kMaxThreadsPerRank, o.blas_threads,
           origin);
  MG_CHECK(o.blas_threads <= 1 || !o.parallel.tp_invariant(),
           "train: --blas-threads {}{}: --{} runs one BLAS thread per rank (OpenBLAS's split of a GEMM over threads "
           "changes its bits); give --blas-threads 1{}", o.blas_threads, origin,
           nn::invariance_option(o.parallel.invariance), origin.empty() ? " or leave it out" : "");
}

void use_blas_threads(const TrainOptions& o) {
  if (o.blas_threads > 0) blas::set_threads_per_rank(o.blas_threads, fmt::format("--blas-threads {}", o.blas_threads));
}

}  // namespace meshgrad::train
