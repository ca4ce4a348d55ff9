# reliability-3 (issue 37): CLI tests of the bitwise area. Included by tests/CMakeLists.txt after cli.cmake,
# whose meshgrad_cli_test(), ${mg} and ${tiny} it uses.

# Every bitwise promise of docs/training.md at hidden 64 on 1 and 2 BLAS threads (tests/cli/r3_bitwise.sh): pp=2
# = --grad-accum on one rank, fsdp=2 and --shard-optimizer = dp=2, resume on the same mesh and a pp=2
# checkpoint on one rank, --mesh-invariant's pp=2 = tp=1 and its resume; with MPI pp=2 under mpirun too.
add_test(NAME train_cli_r3_bitwise
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_bitwise.sh $<TARGET_FILE:meshgrad_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_cli_r3_bitwise)
set_tests_properties(train_cli_r3_bitwise PROPERTIES LABELS train TIMEOUT 180)
if(MESHGRAD_WITH_MPI)
  add_test(NAME train_cli_r3_bitwise_mpi
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_bitwise.sh $<TARGET_FILE:meshgrad_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_cli_r3_bitwise_mpi ${MPIEXEC_EXECUTABLE} --allow-run-as-root
                   --oversubscribe)
  set_tests_properties(train_cli_r3_bitwise_mpi PROPERTIES LABELS "train;mpi" TIMEOUT 240)
endif()

# --blas-threads: refused above 1 under the invariant modes (they run one), naming the source when a resume took
# it from the checkpoint; the banner names it.
meshgrad_cli_test(r3_blas_threads_tp_invariant 1 "--blas-threads 2: --tp-invariant runs one BLAS thread per rank"
                  ${mg} train --mesh tp=1 --tp-invariant --blas-threads 2 ${tiny})
meshgrad_cli_test(r3_blas_threads_mesh_invariant 1 "--blas-threads 3: --mesh-invariant runs one BLAS thread per rank"
                  ${mg} train --mesh dp=2 --mesh-invariant --blas-threads 3 ${tiny})
meshgrad_cli_test(r3_blas_threads_banner 0 "compute: 1 BLAS thread per rank \\(--blas-threads 1; automatic: "
                  ${mg} train --mesh tp=1 --blas-threads 1 ${tiny})
meshgrad_cli_test(r3_blas_threads_range 105 "--blas-threads: must be <= 256, got 300"
                  ${mg} train --blas-threads 300 ${tiny})
set(r3_bt_ck ${CMAKE_CURRENT_BINARY_DIR}/r3-blas-threads-ck)
meshgrad_cli_test(r3_blas_threads_from_checkpoint 1
                  "--blas-threads 2 \\(from the checkpoint\\): --mesh-invariant runs one BLAS thread per rank"
                  bash -c "rm -rf ${r3_bt_ck} && ${mg} train --mesh tp=1 --blas-threads 2 --steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --checkpoint-dir ${r3_bt_ck} >/dev/null 2>&1 && exec ${mg} train --resume ${r3_bt_ck} --steps 2 --mesh-invariant")

# Every example of docs/training.md's "What is refused: the examples" is refused, with its message and before a
# step (tests/cli/r3_doc_refusals.sh reads them from the doc).
add_test(NAME cli_r3_doc_refusals
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/r3_doc_refusals.sh $<TARGET_FILE:meshgrad_cli>
                 ${PROJECT_SOURCE_DIR}/docs/training.md ${CMAKE_CURRENT_BINARY_DIR}/cli_r3_doc_refusals)
set_tests_properties(cli_r3_doc_refusals PROPERTIES LABELS cli TIMEOUT 300)

# N140: a --save file's own gpt2_config gives the sizes; a config.json beside it is not read, and sample says so.
set(r3_cfg_dir ${CMAKE_CURRENT_BINARY_DIR}/r3-sample-config-beside)
meshgrad_cli_test(r3_sample_config_beside_is_not_read 0
                  "the model's sizes came from the '[^']*w.safetensors' metadata \"gpt2_config\"; the config.json beside the file \\('[^']*config.json'\\) was not read"
                  bash -c "rm -rf ${r3_cfg_dir} && mkdir ${r3_cfg_dir} && ${mg} train --mesh tp=1 --steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics --save ${r3_cfg_dir}/w.safetensors >/dev/null 2>&1 && printf '{\"n_layer\": 3, \"n_head\": 2}' > ${r3_cfg_dir}/config.json && exec ${mg} sample --checkpoint ${r3_cfg_dir}/w.safetensors --mesh tp=1 --prompt a --tokens 2 --temperature 0")
