# MPI conformance suite and fault tests, run under mpirun. Included by tests/CMakeLists.txt.
if(MESHGRAD_WITH_MPI)
  add_executable(test_comm_mpi ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi/test_comm_mpi.cpp)
  target_include_directories(test_comm_mpi PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(test_comm_mpi PRIVATE meshgrad_comm MPI::MPI_C GTest::gtest)
  # Root in containers; more ranks than cores on small machines.
  set(meshgrad_mpirun ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe)
  foreach(np 2 4)
    add_test(NAME comm_mpi_conformance_np${np}
             COMMAND ${meshgrad_mpirun} ${MPIEXEC_NUMPROC_FLAG} ${np} $<TARGET_FILE:test_comm_mpi>)
    set_tests_properties(comm_mpi_conformance_np${np} PROPERTIES LABELS "comm;mpi" TIMEOUT 240)
  endforeach()
  # A rank killed (SIGKILL) or absent: survivors must report CommTimeout/PeerFailed within the deadline.
  foreach(mode kill skip)
    add_test(NAME comm_mpi_fault_${mode}_np3
             COMMAND ${CMAKE_COMMAND} -DMPIRUN=${MPIEXEC_EXECUTABLE} -DEXE=$<TARGET_FILE:test_comm_mpi>
                     -DMODE=${mode} -DNP=3 -DDIR=${CMAKE_CURRENT_BINARY_DIR}/comm_fault_${mode}
                     -P ${CMAKE_CURRENT_SOURCE_DIR}/comm/mpi/check_fault.cmake)
    set_tests_properties(comm_mpi_fault_${mode}_np3 PROPERTIES LABELS "comm;mpi" TIMEOUT 60)
  endforeach()
endif()
