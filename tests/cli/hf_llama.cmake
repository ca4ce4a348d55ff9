# The Llama family's Hugging Face directories from the command line (tests/cli/hf_llama.sh): save,
# export, init-from (whole and sharded), sample and grads --mesh-invariant.
add_test(NAME train_cli_hf_llama
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/hf_llama.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_hf_llama)
set_tests_properties(train_cli_hf_llama PROPERTIES LABELS train TIMEOUT 180)
