# reliability-3 (issue 37): CLI tests of the outputs area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.
#
# Each of these runs would have trained and then failed or destroyed a file: they must be refused
# before step 1, so their output must not show a step ("step 1/").

# r3_outputs_test(NAME RC REGEX NOT_REGEX ARGS...): meshgrad_cli_test with output that must not match NOT_REGEX.
function(r3_outputs_test name rc regex not_regex)
  string(REPLACE ";" "|" args "${ARGN}")
  add_test(NAME cli_${name}
           COMMAND ${CMAKE_COMMAND} "-DARGS=${args}" -DRC=${rc} "-DREGEX=${regex}" "-DNOT_REGEX=${not_regex}"
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect.cmake)
  set_tests_properties(cli_${name} PROPERTIES LABELS cli TIMEOUT 150)
endfunction()

set(r3o ${CMAKE_CURRENT_BINARY_DIR}/r3-outputs)
set(r3o_model --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4)

# N80, N81: text the run records (checkpoint manifests and --save's safetensors metadata are strict
# UTF-8 JSON) that is not UTF-8 is refused naming the option and the byte's offset, not at the
# first save after the training.
r3_outputs_test(r3_outputs_data_not_utf8 1 "train: --data 'd.xFF.txt' is not valid UTF-8 \\(byte 0xFF at offset 1\\)"
                "step 1/"
                bash -c "rm -rf ${r3o}/n80 && mkdir -p ${r3o}/n80 && cd ${r3o}/n80 && head -c 4000 ${PROJECT_SOURCE_DIR}/README.md > $'d\\xff.txt' && exec ${mg} train --steps 3 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --data $'d\\xff.txt' --save w.st")
r3_outputs_test(r3_outputs_checkpoint_dir_not_utf8 1
                "train: --checkpoint-dir 'ck.xFE' is not valid UTF-8 \\(byte 0xFE at offset 2\\)" "step 1/"
                bash -c "rm -rf ${r3o}/n81a && mkdir -p ${r3o}/n81a && cd ${r3o}/n81a && exec ${mg} train --steps 3 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --checkpoint-dir $'ck\\xfe'")
r3_outputs_test(r3_outputs_sample_prompt_not_utf8 1
                "train: --sample-prompt '.xFF.xFE' is not valid UTF-8 \\(byte 0xFF at offset 0\\)" "step 1/"
                bash -c "rm -rf ${r3o}/n81b && mkdir -p ${r3o}/n81b && cd ${r3o}/n81b && exec ${mg} train --steps 3 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --sample-prompt $'\\xff\\xfe' --checkpoint-dir x --save-every 2")
# A relative path is recorded absolute: a working directory that is not UTF-8 is named.
r3_outputs_test(r3_outputs_working_directory_not_utf8 1
                "--data 'r.md' is recorded as the absolute path '[^']*w.xFE/r.md', which is not valid UTF-8 \\(byte 0xFE at offset [0-9]+: the working directory's path\\)"
                "step 1/"
                bash -c "rm -rf ${r3o}/n81c && mkdir -p ${r3o}/n81c/$'w\\xfe' && cd ${r3o}/n81c/$'w\\xfe' && head -c 4000 ${PROJECT_SOURCE_DIR}/README.md > r.md && exec ${mg} train --steps 3 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --metrics m.jsonl --data r.md")

# N84, N85: an output file under a name the checkpoints use (step_XXXXXXXX, .step_*, .lock) is refused
# naming both options; before, the metrics file was exchanged away by the step-2 commit and deleted,
# and --save failed after the training.
r3_outputs_test(r3_outputs_metrics_in_checkpoint_names 1
                "--metrics 'nc/step_00000002' lies in --checkpoint-dir 'nc' under the name 'step_00000002', which its checkpoints use"
                "step 1/"
                bash -c "rm -rf ${r3o}/n84 && mkdir -p ${r3o}/n84/nc && cd ${r3o}/n84 && exec ${mg} train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --checkpoint-dir nc --save-every 2 --metrics nc/step_00000002")
r3_outputs_test(r3_outputs_save_in_checkpoint_names 1
                "--save 'nc2/step_00000004' lies in --checkpoint-dir 'nc2' under the name 'step_00000004'" "step 1/"
                bash -c "rm -rf ${r3o}/n85 && mkdir -p ${r3o}/n85/nc2 && cd ${r3o}/n85 && exec ${mg} train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --checkpoint-dir nc2 --save-every 2 --save nc2/step_00000004")
r3_outputs_test(r3_outputs_trace_on_checkpoint_lock 1 "--trace 'nc3/.lock' lies in --checkpoint-dir 'nc3'" "step 1/"
                bash -c "rm -rf ${r3o}/n85b && mkdir -p ${r3o}/n85b/nc3 && cd ${r3o}/n85b && exec ${mg} train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --checkpoint-dir nc3 --trace nc3/.lock")
# Other names in the checkpoint directory stay the user's.
meshgrad_cli_test(r3_outputs_metrics_beside_checkpoints 0 "metrics-kept.*metrics written to nc4/m.jsonl"
                  bash -c "rm -rf ${r3o}/n84b && mkdir -p ${r3o}/n84b/nc4 && cd ${r3o}/n84b && ${mg} train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --checkpoint-dir nc4 --save-every 2 --metrics nc4/m.jsonl && test -s nc4/m.jsonl && test -d nc4/step_00000004 && echo metrics-kept")

# C17: a second run on a live run's metrics file is refused naming the process that holds it (before,
# both ran and the file lost most of the first run's lines). tests/cli/r3_outputs_metrics_lock.sh.
meshgrad_cli_test(r3_outputs_metrics_one_run_at_a_time 0
                  "PASS: the second run was refused.*--metrics 'shared.jsonl' is in use by another run \\(process [0-9]+ holds its lock\\)"
                  bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_outputs_metrics_lock.sh ${mg} ${r3o}/c17)

# N117: --sample-every with a vocabulary the data has no tokenizer for is refused before step 1 (it
# was refused at the first sample, after the training until then).
r3_outputs_test(r3_outputs_sample_every_bytes_vocab 1
                "train: --sample-every: the model's vocabulary has 300 tokens but the built-in corpus has no tokenizer"
                "step 1/"
                ${mg} train --steps 4 ${r3o_model} --no-metrics --vocab 300 --sample-every 2)
r3_outputs_test(r3_outputs_sample_every_token_file_without_meta 1
                "train: --sample-every: the model's vocabulary has 500 tokens but the data 'nometa.bin' has no tokenizer"
                "step 1/"
                bash -c "rm -rf ${r3o}/n117 && mkdir -p ${r3o}/n117 && cd ${r3o}/n117 && python3 -c \"__import__('sys').stdout.buffer.write(__import__('struct').pack('<256i', 20240520, 1, 5000, *([0] * 253)) + __import__('struct').pack('<5000H', *[i * 7919 % 500 for i in range(5000)]))\" > nometa.bin && exec ${mg} train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --data nometa.bin --sample-every 2 --checkpoint-dir c")

# N10: --peak-gflops that is not a machine's peak (a 300-digit MFU, or none without a word).
foreach(peak 1e-300 -5 nan inf 1e300)
  meshgrad_cli_test(r3_outputs_peak_gflops_${peak} 1
                    "train: --peak-gflops must be 0 \\(measured at start\\) or the mesh's peak GFLOP/s, from 0.001 to 1e12, got"
                    ${mg} train ${tiny} --peak-gflops ${peak})
endforeach()
# N9: a weight decay that flips the weights is refused naming both options (the run ended with
# "the loss became -nan ...: lower --lr").
meshgrad_cli_test(r3_outputs_weight_decay_flips_weights 1 "train: --lr 0.003 times --weight-decay 1e\\+308 is 3e\\+305, which must be below 1"
                  ${mg} train --steps 2 ${r3o_model} --no-metrics --weight-decay 1e308)

# C19: --save that cannot fit its file system is refused before step 1 with the bytes needed and free
# (tests/cli/r3_outputs_free_space.sh; skipped where a tmpfs cannot be mounted).
add_test(NAME cli_r3_outputs_save_without_space
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_outputs_free_space.sh ${mg} ${r3o}/c19)
set_tests_properties(cli_r3_outputs_save_without_space PROPERTIES LABELS cli TIMEOUT 150 SKIP_RETURN_CODE 77)
