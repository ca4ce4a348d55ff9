# meshgrad prepare --tokenizer tokenizer.json (tests/cli/tokenizer.sh): Llama 3's real tokenizer.json
# (npm test data), uint32 token files, train and sample on them, refusals by key and value.
add_test(NAME cli_prepare_tokenizer_json
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/tokenizer.sh $<TARGET_FILE:meshgrad_cli>
                 ${PROJECT_SOURCE_DIR}/third_party/npm ${CMAKE_CURRENT_BINARY_DIR}/cli_prepare_tokenizer_json)
set_tests_properties(cli_prepare_tokenizer_json PROPERTIES LABELS cli TIMEOUT 300)
