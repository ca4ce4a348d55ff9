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

# N135 / N136: bench pipeline's options are checked by their own names before anything runs.
set(r3_bench_pipeline ${mg} bench pipeline --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 1)
meshgrad_cli_test(r3_bench_pipeline_micro_zero 105 "--micro: must be >= 1, got 0" ${r3_bench_pipeline} --stages 2 --micro 0)
meshgrad_cli_test(r3_bench_pipeline_micro_negative 105 "--micro: must be an integer >= 1, got '-2'" ${r3_bench_pipeline} --micro -2)
meshgrad_cli_test(r3_bench_pipeline_stages_negative 105 "--stages: must be an integer >= 1, got '-1'" ${r3_bench_pipeline} --stages -1)
meshgrad_cli_test(r3_bench_pipeline_stages_zero 105 "--stages: must be >= 1, got 0" ${r3_bench_pipeline} --stages 0)
meshgrad_cli_test(r3_bench_pipeline_stages_above_layers 1 "bench pipeline: --stages 4: a pipeline of 4 stages needs at least 4 transformer blocks, and --layers is 2"
                  ${r3_bench_pipeline} --stages 2,4 --micro 1)
meshgrad_cli_test(r3_bench_pipeline_micro_not_dividing 1 "bench pipeline: --micro 3: --batch 4 does not divide into 3 micro-batches"
                  ${r3_bench_pipeline} --stages 2 --micro 1,3)

# N20 / N21: --pp-layers' sum in 64 bits; an empty list is named as empty, not read as 0.
set(r3_t2 --steps 1 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics)
meshgrad_cli_test(r3_pp_layers_overflow 1 "--pp-layers 2147483647,2147483647: the counts add up to 4294967294 blocks, and the model has 2"
                  ${mg} train --mesh pp=2 ${r3_t2} --pp-layers 2147483647,2147483647)
meshgrad_cli_test(r3_pp_layers_empty NONZERO "--pp-layers: an empty count in the list: give integers >= 1, e.g. 3,3"
                  bash -c "exec ${mg} train --mesh pp=2 --steps 1 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --pp-layers ''")
meshgrad_cli_test(r3_pp_layers_zero 105 "--pp-layers: must be >= 1, got 0" ${mg} explain --mesh pp=2 --pp-layers 0,2)

# N89: prepare's integer options name the option and the bound (not CLI11's 310-digit range).
meshgrad_cli_test(r3_prepare_chunk_bytes_zero 105 "--chunk-bytes: must be >= 1, got 0"
                  ${mg} prepare --vocab v.json --merges m.txt --out o --chunk-bytes 0 x.txt)
meshgrad_cli_test(r3_prepare_chunk_bytes_text 105 "--chunk-bytes: must be an integer >= 1, got 'abc'"
                  ${mg} prepare --vocab v.json --merges m.txt --out o --chunk-bytes abc x.txt)
meshgrad_cli_test(r3_prepare_shard_tokens_zero 105 "--shard-tokens: must be >= 1, got 0"
                  ${mg} prepare --vocab v.json --merges m.txt --out o --shard-tokens 0 x.txt)

# N29: the tp-invariant split names the mesh's axes as written (fsdp=3), not a dp=3 it does not have.
meshgrad_cli_test(r3_tp_invariant_names_fsdp 1 "--tp-invariant: the data-parallel ranks \\(dp x fsdp = 3 on fsdp=3,tp=1\\) and --grad-accum 1 must be powers of two"
                  ${mg} train --steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 6 --no-metrics --mesh fsdp=3 --tp-invariant)

# N3 / N6: --min-lr takes [0, lr] or the documented -1; --decay-steps names its range and its -1.
set(r3_t --steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics)
meshgrad_cli_test(r3_min_lr_negative 1 "--min-lr must be between 0 and --lr \\(0.003\\), or -1 for lr / 10, got -5"
                  ${mg} train ${r3_t} --min-lr -5 --lr-schedule linear)
meshgrad_cli_test(r3_min_lr_minus_inf 1 "--min-lr must be between 0 and --lr \\(0.003\\), or -1 for lr / 10, got -inf"
                  ${mg} train ${r3_t} --min-lr -inf)
meshgrad_cli_test(r3_decay_steps_too_large 105 "--decay-steps: must be -1 \\(to the last step\\) or an integer in \\[1, 2147483647\\], got '99999999999'"
                  ${mg} train ${r3_t} --decay-steps 99999999999)
meshgrad_cli_test(r3_decay_steps_fraction 105 "--decay-steps: must be -1 \\(to the last step\\) or an integer in \\[1, 2147483647\\], got '1e3'"
                  ${mg} train ${r3_t} --decay-steps 1e3)
# F5: "help" in a --config file would print the help and train nothing.
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/r3_help_config.json "{\"help\": true, \"steps\": 2}")
meshgrad_cli_test(r3_config_help_refused 1 "--config '.*r3_help_config.json': help is not an option a configuration file can give"
                  ${mg} train ${r3_t} --config ${CMAKE_CURRENT_BINARY_DIR}/r3_help_config.json)
# N27, N34, R9, N102: an option given whose value changes nothing gets a note at start-up; the run goes on.
meshgrad_cli_test(r3_note_reshard_without_fsdp 0 "note: --no-reshard-after-forward changes nothing: the mesh dp=2,tp=1 has no fsdp axis"
                  ${mg} train ${r3_t} --mesh dp=2 --no-reshard-after-forward)
meshgrad_cli_test(r3_note_batch_blocks_without_mode 0 "note: --batch-blocks 8 changes nothing without --mesh-invariant"
                  ${mg} train ${r3_t} --batch-blocks 8)
meshgrad_cli_test(r3_note_invariant_blocks_without_mode 0 "note: --invariant-blocks 8 changes nothing without --tp-invariant or --mesh-invariant"
                  ${mg} train ${r3_t} --invariant-blocks 8)
meshgrad_cli_test(r3_note_data_changed_ok_without_resume 0 "note: --data-changed-ok changes nothing without --resume"
                  ${mg} train ${r3_t} --data-changed-ok)
meshgrad_cli_test(r3_note_warmup_longer_than_run 0 "note: --warmup 1000000 is longer than the run's 2 steps: the learning rate stays below --lr 0.003"
                  ${mg} train --steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --warmup 1000000)
# N118: a --sample-prompt longer than the model's positions is noted, and the sample shows what the model saw.
meshgrad_cli_test(r3_note_sample_prompt_longer_than_positions 0 "note: --sample-prompt is 40 tokens and the model has 16 positions"
                  ${mg} train --steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --sample-every 2 --sample-tokens 4
                  --sample-prompt 0123456789012345678901234567890123456789)
add_test(NAME cli_r3_notes_quiet COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_notes_quiet.sh ${mg}
                                         ${CMAKE_CURRENT_BINARY_DIR}/cli_r3_notes_quiet)
set_tests_properties(cli_r3_notes_quiet PROPERTIES LABELS cli TIMEOUT 120)
meshgrad_cli_test(r3_check_note_batch_blocks_without_mode 0 "check: note: --batch-blocks 8 changes nothing without --mesh-invariant"
                  ${mg} check --mesh tp=2 --layers 1 --batch-blocks 8)
# A refusal names the mode the user asked for (N53's fresh-run half): --mesh-invariant holds
# --tp-invariant's tree, and was refused under that name.
meshgrad_cli_test(r3_mesh_invariant_refusal_names_its_mode 1 "--mesh-invariant: tp=3 cannot keep the fixed tree"
                  ${mg} train --mesh tp=3 --mesh-invariant --steps 1 --no-metrics)
meshgrad_cli_test(r3_tp_invariant_refusal_names_its_mode 1 "--tp-invariant: tp=3 cannot keep the fixed tree"
                  ${mg} train --mesh tp=3 --tp-invariant --steps 1 --no-metrics)
