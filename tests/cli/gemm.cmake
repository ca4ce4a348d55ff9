# The float32 product library (oneDNN or OpenBLAS) in whole runs: tests/cli/gemm_library.sh.
if(MESHGRAD_ONEDNN)
  set(gemm_onednn 1)
else()
  set(gemm_onednn 0)
endif()
add_test(NAME train_cli_gemm_library
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/gemm_library.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_gemm_library ${gemm_onednn})
set_tests_properties(train_cli_gemm_library PROPERTIES LABELS train TIMEOUT 240)
# --precision bf16 in whole runs: tests/cli/precision_bf16.sh.
add_test(NAME train_cli_precision_bf16
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/precision_bf16.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_precision_bf16 ${gemm_onednn})
set_tests_properties(train_cli_precision_bf16 PROPERTIES LABELS train TIMEOUT 240)
# A mixture of experts in whole runs, ep and its combinations: tests/cli/moe.sh.
add_test(NAME train_cli_moe
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/moe.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_moe)
set_tests_properties(train_cli_moe PROPERTIES LABELS train TIMEOUT 300)
# Context parallelism in whole runs, cp and its combinations: tests/cli/cp.sh.
add_test(NAME train_cli_cp
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/cp.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_cp)
set_tests_properties(train_cli_cp PROPERTIES LABELS train TIMEOUT 300)
# A resume with another --steps: the schedule change said, --keep-schedule: tests/cli/resume_schedule.sh.
add_test(NAME train_cli_resume_schedule
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/resume_schedule.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_resume_schedule)
set_tests_properties(train_cli_resume_schedule PROPERTIES LABELS train TIMEOUT 120)
# --eval-steps' cap said, MFU's peak cached per machine, the ETA: tests/cli/progress_notes.sh.
add_test(NAME train_cli_progress_notes
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/progress_notes.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_progress_notes)
set_tests_properties(train_cli_progress_notes PROPERTIES LABELS train TIMEOUT 120)
# explain --config: a training run's metrics or checkpoint described, fsdp rows naming their tensors.
add_test(NAME cli_explain_config
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/explain_config.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/cli_explain_config)
set_tests_properties(cli_explain_config PROPERTIES LABELS cli TIMEOUT 120)
