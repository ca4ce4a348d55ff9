# The Python module `meshgrad` (python/meshgrad.cpp, pybind11), built when pybind11 is found.
# It links the static layers (so the module is self-contained) and installs to
# PREFIX/lib/python3/dist-packages, Debian's directory for modules of /usr/bin/python3.
option(MESHGRAD_PYTHON "Build the Python module (needs pybind11-dev, python3-pybind11)" ON)
if(NOT MESHGRAD_PYTHON)
  return()
endif()
if(MESHGRAD_SANITIZER)
  # A sanitized extension cannot be loaded into an unsanitized interpreter (the runtime must come
  # first); make test-asan / test-tsan check the C++ library, the normal build checks the module.
  message(STATUS "meshgrad: the Python module is not built with MESHGRAD_SANITIZER=${MESHGRAD_SANITIZER}")
  return()
endif()
# Debian's interpreter, the one python3-pybind11 / python3-numpy / python3-pytest install into
# (a pyenv or venv python3 earlier on PATH usually lacks them); -DPython3_EXECUTABLE=... overrides.
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3)
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_FOUND)
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import pybind11; print(pybind11.get_cmake_dir())"
                  OUTPUT_VARIABLE meshgrad_pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(PYBIND11_FINDPYTHON ON)
  find_package(pybind11 CONFIG QUIET HINTS ${meshgrad_pybind11_dir})
endif()
if(NOT pybind11_FOUND)
  message(STATUS "meshgrad: pybind11 not found, the Python module is not built "
                 "(install the Debian packages pybind11-dev python3-pybind11)")
  return()
endif()

# NO_EXTRAS: no LTO (its serial link is slow and warns); the work is in the library anyway.
# A front-end like the CLI: it starts ranks and runs jobs through the library's launch API.
pybind11_add_module(meshgrad_python NO_EXTRAS ${PROJECT_SOURCE_DIR}/python/meshgrad.cpp
                    ${PROJECT_SOURCE_DIR}/python/training_api.cpp)
target_compile_definitions(meshgrad_python PRIVATE MESHGRAD_VERSION="${PROJECT_VERSION}")
set_target_properties(meshgrad_python PROPERTIES OUTPUT_NAME meshgrad
                      LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/python)
target_link_libraries(meshgrad_python PRIVATE meshgrad)
install(TARGETS meshgrad_python LIBRARY DESTINATION lib/python3/dist-packages)

if(MESHGRAD_BUILD_TESTS)
  add_test(NAME python.pytest
           COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider ${PROJECT_SOURCE_DIR}/python/tests)
  # MESHGRAD_CLI: test_hf_gpt2.py runs `meshgrad train / export / grads` and checks them against PyTorch.
  # COST: its seconds here, ctest's first estimate on a fresh checkout (tests/CMakeLists.txt, the end).
  set_tests_properties(python.pytest PROPERTIES LABELS python TIMEOUT 600 COST 13
                       ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python;MESHGRAD_CLI=$<TARGET_FILE:meshgrad_cli>")
  if(MESHGRAD_WITH_MPI)
    add_test(NAME python.mpi COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe ${MPIEXEC_NUMPROC_FLAG} 2
                                     ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/python/tests/mpi_check.py)
    set_tests_properties(python.mpi PROPERTIES LABELS "python;mpi" TIMEOUT 120
                         ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python")
  endif()
endif()
