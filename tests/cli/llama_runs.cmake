# The Llama family through the command line (issue 38; tests/cli/llama_runs.sh, one case per test):
# resume bit for bit, resharding a tp=2 SP checkpoint to tp=1 and fsdp=2, --mesh-invariant's elastic
# resume, --sample-every against `meshgrad sample --checkpoint`, check and explain with --model llama
# and --model-config, --trace, and what is still refused. Included by tests/CMakeLists.txt.
foreach(case resume reshard mesh_invariant sample check_explain trace refused)
  add_test(NAME cli_llama_${case}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/llama_runs.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/llama-runs-${case} ${case})
  set_tests_properties(cli_llama_${case} PROPERTIES LABELS cli TIMEOUT 150)
endforeach()
