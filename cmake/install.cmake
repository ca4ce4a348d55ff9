# Installing meshgrad as a library (`cmake --install build --prefix P`):
#   P/include/meshgrad/...                      public headers
#   P/lib/libmeshgrad.so                        the whole library in one shared object
#   P/lib/cmake/meshgrad/                       find_package(meshgrad) -> meshgrad::meshgrad
#   P/lib/pkgconfig/meshgrad.pc                 pkg-config --cflags --libs meshgrad
#   P/bin/meshgrad                              the CLI
# The per-layer static targets stay for the build's own layering and tests; libmeshgrad.so takes
# every object of them (whole-archive), so they are built position-independent.
include(CMakePackageConfigHelpers)

foreach(layer ${meshgrad_layers})
  set_target_properties(meshgrad_${layer} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endforeach()

# A shared library needs a source of its own; everything else comes from the layer archives.
file(WRITE ${PROJECT_BINARY_DIR}/meshgrad_shared.cpp "// libmeshgrad.so: the objects of the layer archives\n")
add_library(meshgrad_shared SHARED ${PROJECT_BINARY_DIR}/meshgrad_shared.cpp)
set_target_properties(meshgrad_shared PROPERTIES OUTPUT_NAME meshgrad EXPORT_NAME meshgrad
                      VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
set(layer_archives)
foreach(layer ${meshgrad_layers})
  list(APPEND layer_archives meshgrad_${layer})
endforeach()
target_link_libraries(meshgrad_shared PRIVATE -Wl,--whole-archive ${layer_archives} -Wl,--no-whole-archive)
# What a user of the installed library needs: the headers, C++20 and the libraries the public
# headers use (fmt in error.hpp; nlohmann-json in safetensors.hpp; MPI in comm/mpi.hpp).
target_include_directories(meshgrad_shared INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                           $<INSTALL_INTERFACE:include>)
target_compile_features(meshgrad_shared INTERFACE cxx_std_20)
target_link_libraries(meshgrad_shared PUBLIC fmt::fmt nlohmann_json::nlohmann_json Threads::Threads meshgrad_openblas)
set(meshgrad_pc_requires "fmt nlohmann_json")
set(meshgrad_pc_cflags "")
if(MESHGRAD_WITH_MPI)
  target_link_libraries(meshgrad_shared PUBLIC MPI::MPI_C)
  target_compile_definitions(meshgrad_shared INTERFACE MESHGRAD_HAVE_MPI=1)
  string(APPEND meshgrad_pc_requires " ompi-c")
  set(meshgrad_pc_cflags "-DMESHGRAD_HAVE_MPI=1")
endif()
# The OpenBLAS interface target travels with the package as meshgrad::openblas (Debian paths).
set_target_properties(meshgrad_openblas PROPERTIES EXPORT_NAME openblas)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/meshgrad DESTINATION include)
install(TARGETS meshgrad_shared meshgrad_openblas EXPORT meshgrad-targets
        LIBRARY DESTINATION lib ARCHIVE DESTINATION lib RUNTIME DESTINATION bin)
install(TARGETS meshgrad_cli RUNTIME DESTINATION bin)
install(EXPORT meshgrad-targets NAMESPACE meshgrad:: DESTINATION lib/cmake/meshgrad)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/meshgrad-config.cmake.in
                              ${PROJECT_BINARY_DIR}/meshgrad-config.cmake INSTALL_DESTINATION lib/cmake/meshgrad)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/meshgrad-config-version.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/meshgrad-config.cmake ${PROJECT_BINARY_DIR}/meshgrad-config-version.cmake
        DESTINATION lib/cmake/meshgrad)
configure_file(${CMAKE_CURRENT_LIST_DIR}/meshgrad.pc.in ${PROJECT_BINARY_DIR}/meshgrad.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/meshgrad.pc DESTINATION lib/pkgconfig)

# scripts/test-install.sh: install to a temporary prefix, build and run examples/ against it with
# find_package and with pkg-config, import the installed Python module (when built).
# Not under a sanitizer: the examples build as an outside project would, without its flags.
if(MESHGRAD_BUILD_TESTS AND NOT MESHGRAD_SANITIZER)
  set(meshgrad_install_test_args ${PROJECT_BINARY_DIR})
  if(TARGET meshgrad_python)
    list(APPEND meshgrad_install_test_args --python ${Python3_EXECUTABLE})
  endif()
  add_test(NAME install.examples COMMAND ${PROJECT_SOURCE_DIR}/scripts/test-install.sh ${meshgrad_install_test_args})
  # COST: its seconds here, ctest's first estimate on a fresh checkout (tests/CMakeLists.txt, the end).
  set_tests_properties(install.examples PROPERTIES LABELS install TIMEOUT 900 COST 14)
endif()
