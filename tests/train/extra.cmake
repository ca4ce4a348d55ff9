# The command line's file handling, end to end (tests/train/cli_files.sh). Included by
# tests/CMakeLists.txt.
add_test(NAME train_cli_files
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/cli_files.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_files)
set_tests_properties(train_cli_files PROPERTIES LABELS train TIMEOUT 120)

# --trace end to end (tests/train/cli_trace.sh): train and the benches write a trace that
# `meshgrad trace summary` / `trace svg` read back; bad paths are refused before the first step.
add_test(NAME train_cli_trace
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/cli_trace.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_trace)
set_tests_properties(train_cli_trace PROPERTIES LABELS train TIMEOUT 120)
if(MESHGRAD_WITH_MPI)
  # Under mpirun: one file with a pid per process.
  add_test(NAME train_cli_trace_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/cli_trace.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_trace_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  set_tests_properties(train_cli_trace_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 120)
endif()
