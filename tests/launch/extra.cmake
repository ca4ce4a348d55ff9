# test_hf_llama.cpp runs its PyTorch reference (tests/launch/hf_llama_reference.py, which imports
# tests/train/llama_reference.py) from the source tree with Debian's interpreter, as test_train does.
if(DEFINED Python3_EXECUTABLE)
  set(meshgrad_launch_reference_python ${Python3_EXECUTABLE})
elseif(EXISTS /usr/bin/python3)
  set(meshgrad_launch_reference_python /usr/bin/python3)
else()
  set(meshgrad_launch_reference_python python3)
endif()
target_compile_definitions(test_launch PRIVATE MESHGRAD_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                               MESHGRAD_REFERENCE_PYTHON="${meshgrad_launch_reference_python}")
