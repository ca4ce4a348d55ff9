# reliability-3 (issue 37): CLI tests of the check area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.

# N39: a NaN or infinite loss, gradient or weight fails the check, naming it (NaN compares false with
# every tolerance, so it passed as "no error"), in the tolerance mode and the bitwise one.
meshgrad_cli_test(r3_check_nan_fails 1 "FAIL: not finite \\(NaN or infinite\\): mesh loss of step 2 \\(nan\\); mesh gradient of wte.weight at step 1"
                  ${mg} check --mesh tp=2 --layers 1 --inject-fault scale:tp:nan)
meshgrad_cli_test(r3_check_inf_float32_fails 1 "FAIL: not finite \\(NaN or infinite\\): mesh loss of step 2"
                  ${mg} check --mesh tp=2 --layers 1 --dtype float32 --inject-fault scale:tp:inf)
meshgrad_cli_test(r3_check_nan_tp_invariant_fails 1 "FAIL: not finite \\(NaN or infinite\\): mesh loss of step 2"
                  ${mg} check --mesh tp=2 --layers 1 --tp-invariant --inject-fault scale:tp:nan)
# N38: a fault on an axis the mesh lacks, or has with one rank, is refused up front naming the axes; one
# on an axis whose backward runs no reduction (pp: sends and receives) never fires, and fails.
meshgrad_cli_test(r3_check_fault_unknown_axis 1 "--inject-fault: the mesh tp=2 has no axis 'bogus' of more than one rank.*the mesh's axes: dp=1, tp=2"
                  ${mg} check --mesh tp=2 --layers 1 --inject-fault drop:bogus)
meshgrad_cli_test(r3_check_fault_axis_of_one_rank 1 "--inject-fault: the mesh tp=2 has no axis 'dp' of more than one rank"
                  ${mg} check --mesh tp=2 --layers 1 --inject-fault drop:dp)
meshgrad_cli_test(r3_check_fault_never_fired 1 "FAIL: the injected fault drop:pp never fired: no backward reduction ran on axis 'pp'"
                  ${mg} check --mesh pp=2 --inject-fault drop:pp)
meshgrad_cli_test(r3_check_fault_counted 1 "injected fault: drop:tp \\(changed [1-9][0-9]* reductions.*FAIL: the mesh model differs"
                  ${mg} check --mesh tp=2 --layers 1 --inject-fault drop:tp)
# N42: a pipeline's micro-batches of unequal rows are refused as train refuses them; the header shows
# the micro-batches.
meshgrad_cli_test(r3_check_pipeline_unequal_micro_batches 1 "check: --micro-batches 3 on pp=2,tp=1: each data-parallel replica's 4 rows of --batch 4 must divide into 3 micro-batches of equal rows"
                  ${mg} check --mesh pp=2 --micro-batches 3 --batch 4)
meshgrad_cli_test(r3_check_header_micro_batches 0 "2 steps of 2 micro-batches.*PASS"
                  ${mg} check --mesh pp=2 --micro-batches 2 --batch 4)
