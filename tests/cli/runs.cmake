# The command line's file handling, end to end (tests/cli/cli_files.sh). Included by
# tests/CMakeLists.txt.
add_test(NAME train_cli_files
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_files.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_files)
set_tests_properties(train_cli_files PROPERTIES LABELS train TIMEOUT 120)

# Checkpoints with real processes and signals: SIGKILL + bitwise resume, a kill during a save,
# SIGTERM preemption, a second SIGINT, random kills (tests/cli/checkpoint_cli.py).
add_test(NAME train_checkpoint_cli
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/checkpoint_cli.py $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_checkpoint_cli)
set_tests_properties(train_checkpoint_cli PROPERTIES LABELS train TIMEOUT 300)
if(MESHGRAD_WITH_MPI)
  # The same under mpirun: bitwise MPI resume, an MPI checkpoint resharded onto rank threads, SIGTERM.
  add_test(NAME train_checkpoint_cli_mpi
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/checkpoint_cli.py $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_checkpoint_cli_mpi --mpi
                   "${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe")
  set_tests_properties(train_checkpoint_cli_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 300)
endif()
# The kill-and-resume soak (tests/cli/kill_resume_soak.py), few cycles: one --save-every 1 run of 2
# rank threads (tp=2) SIGKILLed 9 times, 3 in each phase (a step, an async save's writing, the
# commit; the last two held open by MESHGRAD_CHECKPOINT_TEST_DELAY_MS), and resumed each time; every
# checkpoint verifies and equals the uninterrupted run's, every loss bitwise. ~10 s. The 50-cycle
# command is in docs/training.md.
add_test(NAME train_kill_resume_soak
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/kill_resume_soak.py $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_kill_resume_soak --cycles 9)
set_tests_properties(train_kill_resume_soak PROPERTIES LABELS train TIMEOUT 300)
if(MESHGRAD_WITH_MPI)
  # The same under mpirun, 2 processes at dp=2, 6 cycles (2 per phase): mpirun and both ranks
  # killed at once. ~15 s.
  add_test(NAME train_kill_resume_soak_mpi
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/kill_resume_soak.py $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_kill_resume_soak_mpi --cycles 6 --mesh dp=2 --mpi
                   "${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe")
  # RESOURCE_LOCK mpirun_kill: the tests that kill a rank of an mpirun job and time the survivors run
  # one at a time (train_multihost's --enable-recovery survivor once ended before its deadline while
  # another such test ran beside it under ctest -j2; alone it passed every time).
  set_tests_properties(train_kill_resume_soak_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 300 RESOURCE_LOCK mpirun_kill)
endif()
# `meshgrad export` and `train --init-from` end to end (tests/cli/cli_hf.sh); with MPI, the same
# loading at tp=2 across processes (label mpi).
add_test(NAME train_cli_hf
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_hf.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_hf)
set_tests_properties(train_cli_hf PROPERTIES LABELS train TIMEOUT 120)
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_hf_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_hf.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_hf_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  set_tests_properties(train_cli_hf_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 180)
endif()
# --trace end to end (tests/cli/cli_trace.sh): train and the benches write a trace that
# `meshgrad trace summary` / `trace svg` read back; bad paths are refused before the first step.
add_test(NAME train_cli_trace
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_trace.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_trace)
set_tests_properties(train_cli_trace PROPERTIES LABELS train TIMEOUT 120)
if(MESHGRAD_WITH_MPI)
  # Under mpirun: one file with a pid per process.
  add_test(NAME train_cli_trace_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_trace.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_trace_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  set_tests_properties(train_cli_trace_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 120)
endif()
if(MESHGRAD_WITH_MPI)
  # Two hosts made of network namespaces, ranks over TCP only (tests/cli/multihost.py): tp=2 and dp=2
  # bitwise equal to rank threads, checkpoints from both hosts resumed, latency and loss, a killed
  # host's rank. Skipped (exit 77) where the machine cannot make namespaces (needs root).
  add_test(NAME train_multihost
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/multihost.py $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_multihost ${MPIEXEC_EXECUTABLE})
  # ctest's timeout kills the test with SIGKILL, before it can remove its namespaces: this clean-up runs
  # after it whatever its outcome and removes those of runs that are gone.
  add_test(NAME train_multihost_cleanup
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli/multihost.py --cleanup)
  set_tests_properties(train_multihost PROPERTIES LABELS "train;mpi;multihost" TIMEOUT 240 SKIP_RETURN_CODE 77
                       FIXTURES_REQUIRED multihost_netns RESOURCE_LOCK mpirun_kill)
  set_tests_properties(train_multihost_cleanup PROPERTIES LABELS "train;mpi;multihost" TIMEOUT 60
                       FIXTURES_CLEANUP multihost_netns)
endif()

# Pipeline parallelism end to end (tests/cli/cli_pipeline.sh): pp=2, pp=4, pp=2,tp=2 and pp=2,dp=2 bitwise
# as --grad-accum, both schedules, the trace, refusals; with MPI the same on 4 processes and a stage
# killed mid-run failing the survivor at the deadline, naming the operation and the missing rank.
add_test(NAME train_cli_pipeline
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_pipeline.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_pipeline)
set_tests_properties(train_cli_pipeline PROPERTIES LABELS train TIMEOUT 180)
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_pipeline_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_pipeline.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_pipeline_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  set_tests_properties(train_cli_pipeline_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 240 RESOURCE_LOCK mpirun_kill)
endif()
# Mesh-invariant training end to end (tests/cli/cli_mesh_invariant.sh): the same bits on dp, fsdp, pp and
# tp meshes, elastic resume of a checkpoint on other meshes, check, refusals; with MPI dp=2,tp=2 under
# mpirun against one rank's threads run.
add_test(NAME train_cli_mesh_invariant
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_mesh_invariant.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_mesh_invariant)
set_tests_properties(train_cli_mesh_invariant PROPERTIES LABELS train TIMEOUT 180)
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_mesh_invariant_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_mesh_invariant.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_mesh_invariant_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root
                   --oversubscribe)
  set_tests_properties(train_cli_mesh_invariant_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 120 RESOURCE_LOCK mpirun_kill)
endif()
# Sharded data parallelism end to end (tests/cli/cli_fsdp.sh): fsdp=2 and --shard-optimizer bitwise as
# dp=2, a sharded checkpoint resumed on another mesh, the trace, refusals; with MPI the same runs
# under mpirun, bitwise against the threads runs.
add_test(NAME train_cli_fsdp
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_fsdp.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_fsdp)
set_tests_properties(train_cli_fsdp PROPERTIES LABELS train TIMEOUT 180)
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_fsdp_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cli_fsdp.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_fsdp_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  set_tests_properties(train_cli_fsdp_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 240)
endif()

# `make train` needs only the build packages (tests/cli/train_deps.sh): the train set of
# scripts/install-deps.sh, and a configure without tests, benchmarks and Python that looks for none
# of their packages.
add_test(NAME make_train_deps
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/train_deps.sh ${PROJECT_SOURCE_DIR}
                 ${CMAKE_CURRENT_BINARY_DIR}/make_train_deps)
set_tests_properties(make_train_deps PROPERTIES LABELS cli TIMEOUT 120)
