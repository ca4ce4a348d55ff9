# reliability-3 (issue 37): CLI tests of the resume area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.

# tests/cli/r3_resume.sh, one case per test: where a resumed run writes (N1: from a copy, a copy's
# step, in place, given outputs, --no-metrics; N78: a read-only copy), commit numbers out of range (N67), errors
# about options taken from the checkpoint (N58, N53, N71, --shard-optimizer), and what an aborted
# run leaves (C30).
foreach(case copy copy_step in_place given no_metrics readonly commit_overflow grad_accum mesh_invariant mesh shard_optimizer aborted)
  add_test(NAME cli_r3_resume_${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_resume.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/r3-resume-${case} ${case})
  set_tests_properties(cli_r3_resume_${case} PROPERTIES LABELS cli TIMEOUT 150 SKIP_RETURN_CODE 77)
endforeach()
