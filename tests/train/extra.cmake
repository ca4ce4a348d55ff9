# test_llama.cpp runs its PyTorch reference (tests/train/llama_reference.py) from the source tree,
# with Debian's interpreter, which python3-torch and python3-numpy install into (cmake/python.cmake
# says why a python3 earlier on PATH is not it).
if(DEFINED Python3_EXECUTABLE)
  set(meshgrad_reference_python ${Python3_EXECUTABLE})
elseif(EXISTS /usr/bin/python3)
  set(meshgrad_reference_python /usr/bin/python3)
else()
  set(meshgrad_reference_python python3)
endif()
target_compile_definitions(test_train PRIVATE MESHGRAD_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                              MESHGRAD_REFERENCE_PYTHON="${meshgrad_reference_python}")
