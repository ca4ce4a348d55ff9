# Runs test_comm_mpi in fault mode under mpirun and checks that every survivor (all ranks but 1)
# wrote "ok CommTimeout|PeerFailed <ms> ..." within the time limit. mpirun's own exit status is
# non-zero when a rank dies, so it is not the verdict: the marker files are.
# --enable-recovery: without it OpenMPI's mpirun tears the whole job down as soon as one rank dies,
# so survivors never get to report (they do not hang either: they are killed).
#   cmake -DMPIRUN=... -DEXE=... -DMODE=kill|skip -DNP=3 -DDIR=... -P check_fault.cmake
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIRUN} --allow-run-as-root --oversubscribe --enable-recovery -np ${NP} ${EXE} --fault=${MODE}
                        --marker-dir=${DIR}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 45)
string(TIMESTAMP t1 "%s")
math(EXPR elapsed "${t1} - ${t0}")
message(STATUS "mpirun exit: ${rc} after ${elapsed} s\n${out}\n${err}")
math(EXPR last "${NP} - 1")
foreach(r RANGE 0 ${last})
  if(r EQUAL 1)
    continue()
  endif()
  if(NOT EXISTS ${DIR}/rank${r}.txt)
    message(FATAL_ERROR "survivor rank ${r} wrote no marker: it did not report the failure (killed or hung)")
  endif()
  file(READ ${DIR}/rank${r}.txt line)
  if(NOT line MATCHES "^ok (CommTimeout|PeerFailed) ([0-9]+) ")
    message(FATAL_ERROR "survivor rank ${r} reported: ${line}")
  endif()
  if(CMAKE_MATCH_2 GREATER 5000)
    message(FATAL_ERROR "survivor rank ${r} took ${CMAKE_MATCH_2} ms (deadline 300 ms): ${line}")
  endif()
  message(STATUS "rank ${r}: ${line}")
endforeach()
