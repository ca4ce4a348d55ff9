"""The Python module against the library's own guarantees: training lowers the loss, gradients do
not depend on the mesh, explain counts the collectives of the DESIGN table, tensors share memory
with numpy, the GIL is free while ranks run, and bad input is an exception naming it.

ctest runs this against the built module (PYTHONPATH=build/python)."""
import json
import math
import struct
import threading
import time

import numpy as np
import pytest

import meshgrad


# ---- train -----------------------------------------------------------------------------------

def test_train_returns_one_dict_per_step_and_the_loss_falls():
    steps = meshgrad.train(mesh="tp=2", steps=30, layers=1, hidden=32, heads=4, seq=16, batch=8)
    assert [s["step"] for s in steps] == list(range(1, 31))
    assert set(steps[0]) == {"step", "loss", "tokens_per_s", "gflops", "elapsed_s", "lr", "grad_norm", "ms_per_step",
                             "mfu"}
    assert all(0 < s["mfu"] < 1 and s["ms_per_step"] > 0 for s in steps)
    assert all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)
    # Byte tokens start near ln(256) = 5.55 and fall on the built-in corpus.
    assert abs(steps[0]["loss"] - math.log(256)) < 0.2
    assert np.mean([s["loss"] for s in steps[-5:]]) < steps[0]["loss"] - 0.5


def test_train_is_the_same_on_any_mesh():
    one = meshgrad.train(mesh="tp=1", steps=3, dtype="float64")
    two = meshgrad.train(mesh="dp=2,tp=2", steps=3, dtype="float64")
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)


def test_train_tp_invariant_gives_the_same_bytes_on_any_mesh(tmp_path):
    # --tp-invariant: tp=2 and dp=2 x tp=2 (with 2 micro-batches on the single rank) save the bytes of
    # one rank; the normal mode does not (the low bits differ).
    def saved(name, **kw):
        path = tmp_path / name
        steps = meshgrad.train(steps=3, layers=1, hidden=32, heads=4, seq=16, batch=4, dropout=0.1,
                               save=str(path), **kw)
        return [s["loss"] for s in steps], path.read_bytes()
    one = saved("one.safetensors", mesh="tp=1", tp_invariant=True)
    assert saved("tp2.safetensors", mesh="tp=2", tp_invariant=True) == one
    accum = saved("accum.safetensors", mesh="tp=1", tp_invariant=True, grad_accum=2)
    assert saved("dp2tp2.safetensors", mesh="dp=2,tp=2", tp_invariant=True) == accum
    assert saved("normal.safetensors", mesh="tp=2")[1] != one[1]


def test_train_precision_bf16_reaches_the_run_and_keeps_mesh_invariance(tmp_path):
    # precision="bf16" (docs/training.md, "Mixed precision"): recorded in the header with the kernels
    # of its products, other losses than float32's but close, the same bytes on every mesh under
    # mesh_invariant; a float64 model is refused naming both.
    metrics = tmp_path / "m.jsonl"
    kw = dict(steps=3, layers=2, hidden=32, heads=4, seq=16, batch=8)
    f32 = [s["loss"] for s in meshgrad.train(**kw)]
    b16 = [s["loss"] for s in meshgrad.train(precision="bf16", metrics=str(metrics), **kw)]
    header = json.loads(metrics.read_text().splitlines()[0])
    assert header["config"]["precision"] == "bf16" and header["bf16_products"]
    assert b16 != f32 and b16 == pytest.approx(f32, rel=1e-2)
    def saved(name, **more):
        path = tmp_path / name
        steps = meshgrad.train(precision="bf16", mesh_invariant=True, save=str(path), **kw, **more)
        return [s["loss"] for s in steps], path.read_bytes()
    one = saved("one.safetensors", mesh="tp=1")
    for mesh in ("dp=2", "tp=2", "fsdp=2,tp=2"):
        assert saved(mesh + ".safetensors", mesh=mesh) == one, mesh
    with pytest.raises(ValueError, match="--precision bf16 needs --dtype float32"):
        meshgrad.train(precision="bf16", dtype="float64", steps=1)


def test_train_mixture_of_experts_over_ep_reports_the_load_and_keeps_mesh_invariance(tmp_path):
    # experts=4 on mesh="ep=2" (docs/training.md, "Mixture of experts"): each step's row carries the
    # expert load (every token's 2 picks in each layer) and the load-balancing loss; mesh_invariant
    # gives one rank's bytes at ep=2 and dp=2,ep=2; ep=3 of 4 experts is refused naming both.
    kw = dict(model="llama", layers=2, hidden=32, heads=4, experts=4, experts_per_token=2,
              output_router_logits=True, seq=16, batch=8, steps=2)
    steps = meshgrad.train(mesh="ep=2", **kw)
    for s in steps:
        assert [sum(layer) for layer in s["expert_load"]] == [8 * 16 * 2] * 2
        assert s["aux_loss"] > 0.5 and s["dropped"] == 0
    def saved(name, mesh):
        path = tmp_path / name
        rows = meshgrad.train(mesh=mesh, mesh_invariant=True, save=str(path), **kw)
        return [s["loss"] for s in rows], path.read_bytes()
    one = saved("one.safetensors", "tp=1")
    for mesh in ("ep=2", "dp=2,ep=2"):
        assert saved(mesh + ".safetensors", mesh) == one, mesh
    with pytest.raises(ValueError, match="ep = 3 does not divide the 4 experts"):
        meshgrad.train(mesh="ep=3", **dict(kw, batch=6))


def test_train_context_parallel_follows_the_one_rank_losses_and_refuses_a_bad_sequence():
    # mesh="cp=2" and "cp=2,tp=2" (docs/training.md, "Context parallelism"): each rank holds two chunks
    # of every sequence, and the losses are one rank's (float32: other sums, 2e-5); the float64
    # gradients are checked at 1e-9 in C++. A sequence that does not cut into 2 x cp chunks is refused.
    kw = dict(model="llama", layers=2, hidden=32, heads=4, kv_heads=2, seq=32, batch=4, steps=3)
    one = [s["loss"] for s in meshgrad.train(mesh="tp=1", **kw)]
    for mesh in ("cp=2", "cp=2,tp=2"):
        got = [s["loss"] for s in meshgrad.train(mesh=mesh, **kw)]
        assert all(abs(a - b) <= 2e-5 * abs(a) for a, b in zip(one, got)), (mesh, one, got)
    with pytest.raises(ValueError, match="a sequence of 30 positions does not cut into 8 equal chunks"):
        meshgrad.train(mesh="cp=4", **dict(kw, seq=30))


def test_train_mesh_invariant_gives_the_same_bytes_on_every_mesh(tmp_path):
    # mesh_invariant=True (docs/mesh-invariance.md): dp, fsdp, a pipeline and tp save one rank's bytes
    # and report its losses and gradient norms; the header records the mode; 8 rows cannot cut into 3
    # blocks (ValueError naming --batch-blocks).
    def saved(name, **kw):
        path = tmp_path / name
        steps = meshgrad.train(steps=3, layers=2, hidden=32, heads=4, seq=16, batch=8, dropout=0.1, grad_clip=0.5,
                               mesh_invariant=True, save=str(path), **kw)
        return [(s["loss"], s["grad_norm"]) for s in steps], path.read_bytes()
    one = saved("one.safetensors", mesh="tp=1")
    for mesh in ("dp=2", "fsdp=2,tp=2", "pp=2", "dp=4", "tp=2x2"):
        assert saved(mesh + ".safetensors", mesh=mesh) == one, mesh
    metrics = tmp_path / "m.jsonl"
    meshgrad.train(steps=1, batch=8, mesh_invariant=True, batch_blocks=8, metrics=str(metrics))
    config = json.loads(metrics.read_text().splitlines()[0])["config"]
    assert (config["mesh-invariant"], config["batch-blocks"]) == (True, 8)
    with pytest.raises(ValueError, match="--batch-blocks 3 must be a power of two"):
        meshgrad.train(steps=1, batch=8, mesh_invariant=True, batch_blocks=3)


def test_train_mesh_invariant_context_parallel_with_sequence_blocks(tmp_path):
    # sequence_blocks=8 (docs/mesh-invariance.md, "cp"): cp=2, cp=4 and cp=2,tp=2 save one rank's
    # bytes; without the blocks cp=2 under the mode is refused naming the multiple it needs.
    def saved(name, **kw):
        path = tmp_path / name
        steps = meshgrad.train(steps=2, layers=2, hidden=32, heads=4, seq=16, batch=4, dropout=0.1,
                               mesh_invariant=True, sequence_blocks=8, save=str(path), **kw)
        return [(s["loss"], s["grad_norm"]) for s in steps], path.read_bytes()
    one = saved("one.safetensors", mesh="tp=1")
    for mesh in ("cp=2", "cp=4", "cp=2,tp=2"):
        assert saved(mesh + ".safetensors", mesh=mesh) == one, mesh
    with pytest.raises(ValueError, match="a multiple of 2 x cp = 4"):
        meshgrad.train(steps=1, mesh="cp=2", mesh_invariant=True)


def test_fsdp_and_the_sharded_optimizer_train_the_bytes_of_dp(tmp_path):
    # mesh="fsdp=2,tp=2" and shard_optimizer=True at dp=2 save the bytes and losses of plain dp
    # (docs/training.md, "Sharded data parallelism"); their gradients are the same arrays.
    def saved(name, **kw):
        path = tmp_path / name
        steps = meshgrad.train(steps=3, layers=2, hidden=32, heads=4, seq=16, batch=6, dropout=0.1,
                               grad_clip=0.5, save=str(path), **kw)
        return [(s["loss"], s["grad_norm"]) for s in steps], path.read_bytes()
    dp = saved("dp.safetensors", mesh="dp=2,tp=2", sequence_parallel=True)
    assert saved("fsdp.safetensors", mesh="fsdp=2,tp=2", sequence_parallel=True) == dp
    assert saved("zero.safetensors", mesh="dp=2,tp=2", sequence_parallel=True, shard_optimizer=True) == dp
    assert saved("fsdp3.safetensors", mesh="fsdp=3", reshard_after_forward=False) == \
        saved("dp3.safetensors", mesh="dp=3")
    sharded, plain = meshgrad.grads(mesh="fsdp=3", batch=6), meshgrad.grads(mesh="dp=3", batch=6)
    assert sharded.keys() == plain.keys()
    for name in plain:
        assert np.array_equal(sharded[name], plain[name]), name
    with pytest.raises(meshgrad.InvalidArgument, match="--shard-optimizer shards the optimizer state over the dp"):
        meshgrad.train(steps=1, mesh="tp=2", shard_optimizer=True)


def test_blas_threads_reach_the_ranks_and_the_metrics():
    # blas_threads= is --blas-threads: at hidden 64 OpenBLAS splits the GEMMs over the threads, and with
    # the same count on both, pp=2 trains the bits of one rank's grad_accum (the automatic count gives the
    # one rank more threads than each stage: docs/training.md, "Pipeline parallelism").
    def run(**kw):
        steps = meshgrad.train(steps=2, layers=2, hidden=64, heads=4, seq=32, batch=8, blas_threads=1, **kw)
        return [(s["loss"], s["grad_norm"]) for s in steps]
    assert run(mesh="pp=2", micro_batches=4) == run(mesh="tp=1", grad_accum=4)
    with pytest.raises(meshgrad.InvalidArgument, match="--blas-threads 2: --tp-invariant runs one BLAS thread"):
        meshgrad.train(steps=1, mesh="tp=1", tp_invariant=True, blas_threads=2)


def test_a_pipeline_trains_the_bits_of_gradient_accumulation():
    # mesh="pp=2" with micro_batches=4 runs the stages in 1F1B (or GPipe) and reports the losses and
    # gradient norms of one rank with grad_accum=4, bit for bit (docs/training.md, "Pipeline parallelism").
    def run(**kw):
        steps = meshgrad.train(steps=4, layers=4, hidden=32, heads=4, seq=16, batch=8, dropout=0.1,
                               grad_clip=0.5, **kw)
        return [(s["loss"], s["grad_norm"]) for s in steps]
    one_rank = run(mesh="tp=1", grad_accum=4)
    assert run(mesh="pp=2", micro_batches=4) == one_rank
    assert run(mesh="pp=2", micro_batches=4, pp_schedule="gpipe", pp_layers=[1, 3]) == one_rank
    assert run(mesh="pp=2,tp=2", micro_batches=2, sequence_parallel=True) == \
        run(mesh="tp=2", grad_accum=2, sequence_parallel=True)
    # grads on a pipeline: one micro-batch through the stages, every stage's gradients, one rank's bits.
    piped, whole = meshgrad.grads(mesh="pp=2,tp=2", layers=2, batch=4), meshgrad.grads(mesh="tp=2", layers=2, batch=4)
    assert piped.keys() == whole.keys()
    for name in whole:
        assert np.array_equal(piped[name], whole[name]), name
    rows = meshgrad.explain(mesh="pp=2", layers=2, batch=4, micro_batches=4)
    sends = [r for r in rows if r["op"] == "send" and r["layer"] == "pp 0->1" and r["phase"] == "forward"]
    assert len(sends) == 4 and all(r["stage"] == 0 and r["axis"] == "pp" for r in sends)
    assert {r["stage"] for r in rows} == {0, 1}
    with pytest.raises(meshgrad.InvalidArgument, match="give micro_batches or grad_accum, not both"):
        meshgrad.train(mesh="pp=2", micro_batches=2, grad_accum=2)
    with pytest.raises(meshgrad.InvalidArgument, match="--pp-layers 1,1,1: 3 counts for a pipeline of 2 stages"):
        meshgrad.train(mesh="pp=2", layers=3, pp_layers=[1, 1, 1])


def test_train_takes_a_text_file(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    steps = meshgrad.train(steps=2, data=str(data))
    assert len(steps) == 2 and abs(steps[0]["loss"] - math.log(256)) < 0.2


def test_train_takes_the_optimizer_options_by_their_cli_names(tmp_path):
    # The keywords are the command-line options with _ for -; the metrics header records them under
    # the command-line names.
    metrics = tmp_path / "m.jsonl"
    steps = meshgrad.train(steps=4, warmup=1, lr_schedule="linear", min_lr=1e-4, decay_steps=2, beta1=0.8,
                           beta2=0.99, eps=1e-6, weight_decay=0.05, metrics=str(metrics))
    config = json.loads(metrics.read_text().splitlines()[0])["config"]
    assert (config["lr-schedule"], config["min-lr"], config["decay-steps"], config["beta1"], config["beta2"],
            config["eps"], config["weight-decay"]) == ("linear", 1e-4, 2, 0.8, 0.99, 1e-6, 0.05)
    # Step 1 warms up; steps 2 and 3 decay linearly from 3e-3 (the middle at step 3); step 4 is at min_lr.
    assert [s["lr"] for s in steps[1:]] == pytest.approx([3e-3, (3e-3 + 1e-4) / 2, 1e-4])
    with pytest.raises(ValueError, match="--lr-schedule must be cosine, linear, constant or wsd"):
        meshgrad.train(steps=1, lr_schedule="step")


def test_train_writes_the_metrics_file_and_saves(tmp_path):
    metrics, saved = tmp_path / "m.jsonl", tmp_path / "w.safetensors"
    steps = meshgrad.train(steps=2, metrics=str(metrics), save=str(saved))
    header, *lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert header["type"] == "header"
    assert [line["loss"] for line in lines] == [s["loss"] for s in steps]
    assert saved.stat().st_size > 0


def test_train_refuses_a_bytes_path_that_is_not_utf8_before_training(tmp_path):
    # A bytes path may hold any bytes, but a run records its paths as UTF-8 JSON (checkpoints, --save's
    # metadata): refused up front, by the checks the CLI runs, not at the first save after training
    # (reliability-3 N80).
    data = bytes(tmp_path) + b"/d\xff.txt"
    with open(data, "wb") as f:
        f.write(b"the quick brown fox jumps over the lazy dog. " * 20)
    saved = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=r"--data '.*d\\xFF\.txt' is not valid UTF-8 \(byte 0xFF at offset"):
        meshgrad.train(steps=2, data=data, save=str(saved))
    assert not saved.exists()


# ---- grads -----------------------------------------------------------------------------------

def test_grads_from_a_seed_do_not_depend_on_the_mesh():
    sizes = dict(layers=2, hidden=32, heads=4, seq=8, batch=4, dtype="float64", seed=5)
    ref = meshgrad.grads(mesh="tp=1", **sizes)
    assert "wte.weight" in ref and ref["wte.weight"].shape == (256, 32)
    assert all(g.dtype == np.float64 for g in ref.values())
    for mesh in ("tp=2", "dp=2,tp=2", "tp=4", "tp=2x2"):   # tp=2x2: 2-D tensor parallelism
        got = meshgrad.grads(mesh=mesh, **sizes)
        assert got.keys() == ref.keys()
        for name, g in ref.items():
            scale = max(np.abs(g).max(), 1e-30)
            assert np.abs(got[name] - g).max() / scale < 1e-10, (mesh, name)
    other = meshgrad.grads(mesh="tp=1", **{**sizes, "seed": 6})
    assert np.abs(other["wte.weight"] - ref["wte.weight"]).max() > 1e-6


def write_safetensors(path, tensors):
    """A minimal safetensors writer (header JSON + raw little-endian data)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = {np.dtype(np.int64): "I64", np.dtype(np.float32): "F32"}[array.dtype]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        blobs.append(array.tobytes())
        offset += array.nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_grads_from_files_match_across_meshes(tmp_path):
    weights = tmp_path / "w.safetensors"
    meshgrad.train(mesh="tp=1", steps=1, layers=1, hidden=32, heads=4, seq=16, batch=4, save=str(weights))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"n_layer": 1, "n_head": 4, "n_embd": 32, "vocab_size": 256, "n_positions": 16,
                                  "layer_norm_epsilon": 1e-5}))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 9), dtype=np.int64)
    batch = tmp_path / "batch.safetensors"
    write_safetensors(batch, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    files = dict(config=str(config), weights=str(weights), batch_file=str(batch))
    ref = meshgrad.grads(mesh="tp=1", **files)
    got = meshgrad.grads(mesh="tp=2", **files)
    assert ref["wte.weight"].dtype == np.float32   # the weights' dtype
    for name, g in ref.items():
        assert np.abs(got[name] - g).max() <= 1e-4 * max(np.abs(g).max(), 1e-30), name


# ---- explain ---------------------------------------------------------------------------------

def test_explain_counts_the_mlp_all_reduces():
    # All-reduce mode, one MLP block on tp=2: the row layer all-reduces Y in forward, the column
    # layer all-reduces dX in backward; each buffer is [T, B, C] float32.
    rows = meshgrad.explain(model="mlp", mesh="tp=2", layers=1, hidden=64, seq=32, batch=4)
    graph = [(r["phase"], r["op"], r["axis"], r["bytes"]) for r in rows if r["source"] == "graph"]
    assert graph == [("forward", "all_reduce", "tp", 32 * 4 * 64 * 4), ("backward", "all_reduce", "tp", 32 * 4 * 64 * 4)]
    assert all(r["predicted_us"] > 0 and r["ranks"] == 2 for r in rows)
    custom = meshgrad.explain(model="mlp", mesh="tp=2", layers=1, alpha_us=1.0, beta_gbs=1.0)
    assert len(custom) == 2
    # An FSDP unit's rows name the tensors they carry; a tp row carries no group.
    fsdp = meshgrad.explain(model="gpt", mesh="fsdp=2", layers=1)
    unit = [r for r in fsdp if r["layer"] == "fsdp:h.0"]
    assert unit and all("h.0.attn.c_attn.weight" in r["tensors"] for r in unit)
    assert all(r["tensors"] == [] for r in rows)


# ---- tensors and numpy -----------------------------------------------------------------------

def test_tensor_numpy_round_trip_shares_memory():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = meshgrad.Tensor(a)
    assert t.shape == [3, 4] and t.dtype == "float32"
    v1, v2 = np.asarray(t), t.numpy()
    # No copy either way: the tensor views the array's memory and numpy views the tensor's.
    assert np.shares_memory(v1, v2) and np.shares_memory(v1, a)
    np.testing.assert_array_equal(v1, a)
    v1[0, 0] = 42
    assert t.numpy()[0, 0] == 42 and a[0, 0] == 42
    a[2, 3] = -7
    assert t.numpy()[2, 3] == -7


def test_tensor_keeps_the_adopted_array_alive():
    t = meshgrad.Tensor(np.full((1000, 100), 3.5, dtype=np.float64))   # no other reference to the array
    import gc
    gc.collect()
    assert t.numpy().sum() == 3.5 * 100000


def test_tensor_from_a_strided_array_views_it_and_readonly_arrays_are_copied():
    base = np.arange(20, dtype=np.float64).reshape(4, 5)
    a = base[:, ::2]                                   # positive strides: viewed, not copied
    t = meshgrad.Tensor(a)
    np.testing.assert_array_equal(t.numpy(), a)
    assert np.shares_memory(t.numpy(), base)
    r = np.arange(6, dtype=np.float32)
    r.setflags(write=False)                            # meshgrad may write into tensors: copied
    tr = meshgrad.Tensor(r)
    assert not np.shares_memory(tr.numpy(), r)
    np.testing.assert_array_equal(tr.numpy(), r)
    reversed_ = np.arange(5, dtype=np.float64)[::-1]   # a negative stride: copied
    np.testing.assert_array_equal(meshgrad.Tensor(reversed_).numpy(), reversed_)
    np.testing.assert_array_equal(meshgrad.Tensor(np.array([3, -1], dtype=np.int64)).numpy(), [3, -1])


def test_train_checkpoints_and_resumes_from_python(tmp_path):
    ck = str(tmp_path / "ck")
    first = meshgrad.train(mesh="tp=2", steps=6, checkpoint_dir=ck, save_every=3, dropout=0.1)
    import shutil, os
    shutil.rmtree(os.path.join(ck, "step_00000006"))
    resumed = meshgrad.train(resume=ck)                # mesh, sizes and steps from the checkpoint
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first[3:]]   # bitwise
    # A corrupt checkpoint is a meshgrad.CheckpointError (a meshgrad.Error), not a ValueError: nothing
    # the caller passed was wrong.
    with open(os.path.join(ck, "step_00000006", "manifest.json"), "w") as f:
        f.write("{")
    with pytest.raises(meshgrad.CheckpointError, match="step_00000006") as caught:
        meshgrad.train(resume=ck, steps=8)
    assert isinstance(caught.value, meshgrad.Error) and not isinstance(caught.value, ValueError)
    assert issubclass(meshgrad.FileError, OSError) and issubclass(meshgrad.FileError, meshgrad.Error)


def test_a_llama_checkpoints_and_resumes_from_python(tmp_path):
    """The Llama family's checkpoints from Python: a resume takes the model from the checkpoint alone
    (grouped-query attention, RoPE base, a tied head, q/k/v biases) and continues bit for bit; on
    another mesh (tp=2 with SP -> fsdp=2) it continues within float64 rounding (only the order of
    split sums differs: 1e-9 relative is far above that, far below a wrong shard or field)."""
    import os
    import shutil
    ck = str(tmp_path / "ck")
    llama = dict(model="llama", layers=2, hidden=32, heads=4, kv_heads=2, rope_theta=1000.0, tie_word_embeddings=True,
                 attention_bias=True, seq=16, batch=4, dtype="float64")
    first = meshgrad.train(mesh="tp=2", sequence_parallel=True, steps=6, checkpoint_dir=ck, save_every=3, **llama)
    shutil.rmtree(os.path.join(ck, "step_00000006"))
    resumed = meshgrad.train(resume=ck)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first[3:]]   # bitwise
    other = meshgrad.train(resume=os.path.join(ck, "step_00000003"), mesh="fsdp=2", checkpoint_dir=str(tmp_path / "ck2"))
    assert [m["loss"] for m in other] == pytest.approx([m["loss"] for m in first[3:]], rel=1e-9)
    # A shape the checkpoint does not hold is refused naming the option.
    with pytest.raises(meshgrad.CheckpointError, match="--kv-heads 4"):
        meshgrad.train(resume=ck, kv_heads=4)
    # A run shaped by a Hugging Face config.json resumes as that model too.
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
                                  "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                                  "rope_theta": 1000000.0, "tie_word_embeddings": True}))
    ck3 = str(tmp_path / "ck3")
    whole = meshgrad.train(model_config=str(config), mesh="tp=2", steps=4, seq=16, batch=4, dtype="float64",
                           checkpoint_dir=ck3, save_every=2)
    shutil.rmtree(os.path.join(ck3, "step_00000004"))
    assert [m["loss"] for m in meshgrad.train(resume=ck3)] == [m["loss"] for m in whole[2:]]


def test_gradient_arrays_outlive_the_call():
    g = meshgrad.grads(seed=1)
    arrays = list(g.values())
    del g
    assert all(np.isfinite(a).all() for a in arrays)


def test_unsupported_numpy_dtype_is_named():
    with pytest.raises(TypeError, match="int32"):
        meshgrad.Tensor(np.zeros(3, dtype=np.int32))


# ---- sample ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small byte-level GPT trained a little and saved (n_positions = seq = 32)."""
    path = tmp_path_factory.mktemp("sample") / "w.safetensors"
    meshgrad.train(mesh="tp=2", steps=300, layers=1, hidden=32, heads=4, seq=32, batch=8, save=str(path))
    return str(path)


def test_sample_greedy_text_is_the_same_on_every_mesh(trained):
    texts = {mesh: meshgrad.sample(checkpoint=trained, prompt="The ", tokens=20, temperature=0, mesh=mesh)
             for mesh in ("tp=1", "tp=2", "dp=2,tp=2", "tp=2x2")}
    first = texts["tp=1"]
    assert first.startswith("The ") and len(first) == 24
    assert len(set(first[4:])) > 3, first   # not one repeated byte
    assert all(t == first for t in texts.values()), texts


def test_sample_seeds_top_k_and_top_p(trained):
    def run(**kw):
        return meshgrad.sample(checkpoint=trained, prompt="The ", tokens=24, **kw)
    assert run(seed=5) == run(seed=5, mesh="tp=1")
    assert run(seed=5) != run(seed=6)
    assert run(top_k=1, temperature=2.0, seed=9) == run(temperature=0)
    # A nucleus of (almost) no probability keeps only the most likely token: greedy.
    assert run(top_p=1e-9, temperature=2.0, seed=9) == run(temperature=0)
    assert run(top_p=1.0, seed=5) == run(seed=5)


def test_sample_returns_valid_text_for_any_bytes(trained):
    # A byte-level model may emit bytes that are not UTF-8; the result is still a str (U+FFFD for them).
    text = meshgrad.sample(checkpoint=trained, prompt="caf\u00e9 ", tokens=30, temperature=3.0, seed=1)
    assert isinstance(text, str) and text.startswith("caf\u00e9 ")


def test_sample_errors_name_the_option(trained, tmp_path):
    with pytest.raises(TypeError, match="missing required keyword argument 'tokens'"):
        meshgrad.sample(checkpoint=trained, prompt="a")
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_a'"):
        meshgrad.sample(checkpoint=trained, prompt="a", tokens=2, top_a=0.9)
    with pytest.raises(meshgrad.InvalidArgument, match=r"--top-p must be in \(0, 1\]"):
        meshgrad.sample(checkpoint=trained, prompt="a", tokens=2, top_p=0.0)
    with pytest.raises(meshgrad.InvalidArgument, match="--prompt is empty"):
        meshgrad.sample(checkpoint=trained, prompt="", tokens=2)
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        meshgrad.sample(checkpoint=trained, prompt="a", tokens=2, temperature=-1.0)
    with pytest.raises(meshgrad.InvalidArgument, match="--top-k must be >= 0"):
        meshgrad.sample(checkpoint=trained, prompt="a", tokens=2, top_k=-1)
    with pytest.raises(meshgrad.InvalidArgument, match="longer than the model's context n_positions = 32"):
        meshgrad.sample(checkpoint=trained, prompt="x" * 33, tokens=2)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(meshgrad.InvalidArgument, match="is not a safetensors file or model directory"):
        meshgrad.sample(checkpoint=str(notes), prompt="a", tokens=2)
    with pytest.raises(meshgrad.InvalidArgument, match="is not a directory"):
        meshgrad.sample(checkpoint=trained, prompt="a", tokens=2, tokenizer=str(notes))


# ---- the GIL -----------------------------------------------------------------------------------

def test_the_gil_is_released_while_ranks_run():
    # Python code in this thread keeps running while another thread trains: the longest pause
    # between two iterations here stays far below the training time.
    done = threading.Event()
    elapsed = []

    def work():
        t0 = time.monotonic()
        meshgrad.train(steps=15, layers=2, hidden=128, seq=64, batch=8)
        elapsed.append(time.monotonic() - t0)
        done.set()

    thread = threading.Thread(target=work)
    last, longest = time.monotonic(), 0.0
    thread.start()
    while not done.is_set():
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    thread.join()
    assert elapsed[0] > 0.2, "training too short to tell"
    assert longest < elapsed[0] / 2, (longest, elapsed[0])


# ---- errors ----------------------------------------------------------------------------------

def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepz'"):
        meshgrad.train(stepz=3)
    with pytest.raises(TypeError, match="'batch_size'"):
        meshgrad.grads(batch_size=3)
    with pytest.raises(TypeError, match="'linkk'"):
        meshgrad.explain(linkk="shm")


def test_wrong_type_is_a_type_error_naming_the_keyword():
    with pytest.raises(TypeError, match="steps must be int"):
        meshgrad.train(steps=2.5)
    # The Python type, not the C++ one (std::__cxx11::basic_string).
    with pytest.raises(TypeError, match=r"mesh must be str, got None"):
        meshgrad.train(mesh=None)
    # bool is an int subclass: steps=True ran one step; a number keyword takes no bool (issue 37, N124).
    with pytest.raises(TypeError, match=r"steps must be int, got True \(bool\)"):
        meshgrad.train(steps=True)
    with pytest.raises(TypeError, match=r"lr must be float, got False \(bool\)"):
        meshgrad.train(steps=1, lr=False)
    with pytest.raises(TypeError, match=r"pp_layers must be a list of int, got \[True, 1\] \(an item is a bool\)"):
        meshgrad.train(steps=1, pp_layers=[True, 1])
    # A str UTF-8 cannot hold is a value error saying so, not "must be str, got ... (str)".
    with pytest.raises(ValueError, match=r"prompt 'a\\udc80b' cannot be encoded as UTF-8"):
        meshgrad.sample(checkpoint="unused.safetensors", prompt="a\udc80b", tokens=1)


def test_out_of_range_and_invalid_numbers_are_named():
    # An int too large is a range error, not "must be int".
    with pytest.raises(ValueError, match=r"steps must be an int in \[-2147483648, 2147483647\], got 1099511627776"):
        meshgrad.train(steps=2**40)
    with pytest.raises(ValueError, match="--warmup must be >= 0, got -5"):
        meshgrad.train(steps=1, warmup=-5)
    with pytest.raises(ValueError, match="--grad-accum must be >= 1, got 0"):
        meshgrad.train(steps=1, grad_accum=0)
    # A path given empty is refused, never taken as "none" (resume="" would train from scratch).
    with pytest.raises(ValueError, match="--resume: the path is empty"):
        meshgrad.train(steps=1, resume="")


def test_meshgrad_errors_keep_their_message():
    with pytest.raises(meshgrad.InvalidArgument, match="--mesh 'tp2': 'tp2' is not axis=size"):
        meshgrad.train(mesh="tp2")
    with pytest.raises(meshgrad.InvalidArgument, match="unknown axis .sp.; the valid axes are pp, dp, fsdp, ep, cp and tp"):
        meshgrad.grads(mesh="tp=2,sp=2")
    with pytest.raises(ValueError, match="--layers must be >= 1, got 0"):
        meshgrad.train(layers=0)
    with pytest.raises(meshgrad.Error, match="unknown --backend 'thread'"):
        meshgrad.train(backend="thread")
    with pytest.raises(meshgrad.Error, match="no-such-file.txt"):
        meshgrad.train(data="no-such-file.txt")
    with pytest.raises(meshgrad.InvalidArgument, match="go together"):
        meshgrad.grads(config="config.json")
    with pytest.raises(meshgrad.InvalidArgument, match="unknown link"):
        meshgrad.explain(link="nvlink")
    with pytest.raises(meshgrad.InvalidArgument, match="ffn must be >= 0"):
        meshgrad.explain(ffn=-1)
    with pytest.raises(meshgrad.InvalidArgument, match="layers, hidden, heads and vocab must be positive"):
        meshgrad.explain(layers=0)


# ---- Ctrl-C ----------------------------------------------------------------------------------

def _interrupted_run(tmp_path, checkpoint_dir):
    """A script training for (nearly) ever, SIGINT once it has taken a few steps: returns (rc,
    stdout, stderr, seconds from the signal to the exit)."""
    import os
    import signal
    import subprocess
    import sys
    metrics = tmp_path / "m.jsonl"
    script = tmp_path / "long_run.py"
    script.write_text(
        "import meshgrad\n"
        "try:\n"
        f"    meshgrad.train(mesh='tp=2', steps=1000000, layers=1, hidden=32, heads=4, seq=16, batch=4,\n"
        f"                   metrics={str(metrics)!r}, checkpoint_dir={checkpoint_dir!r})\n"
        "    print('finished')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 4:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the run took no steps within 60 s")
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("Ctrl-C did not stop meshgrad.train within 30 s (reliability-2 Y6)")
    return proc.returncode, out, err, time.monotonic() - t0, metrics


def test_ctrl_c_stops_train_and_raises_keyboard_interrupt(tmp_path):
    rc, out, err, seconds, metrics = _interrupted_run(tmp_path, None)
    assert rc == 0 and out.strip() == "interrupted", (rc, out, err)
    assert seconds < 10, seconds
    steps = [json.loads(l) for l in metrics.read_text().splitlines() if '"step"' in l]
    assert 3 <= len(steps) < 1000000


def test_ctrl_c_with_a_checkpoint_dir_saves_the_step_it_stopped_at(tmp_path):
    ck = tmp_path / "ck"
    rc, out, err, seconds, metrics = _interrupted_run(tmp_path, str(ck))
    assert rc == 0 and out.strip() == "interrupted", (rc, out, err)
    last = [json.loads(l) for l in metrics.read_text().splitlines() if '"step"' in l][-1]["step"]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))[-1] == f"step_{last:08d}", \
        (last, list(ck.iterdir()))


def _train_keywords():
    # The keywords of the option table (meshgrad.train_options(): what train(), its docstring and
    # `meshgrad train` are made from) that Python takes.
    table = meshgrad.train_options()
    assert len(table) > 55 and all(o["help"] for o in table), table
    return [o["keyword"] for o in table if o["keyword"] is not None]


def test_train_docstring_names_every_keyword_train_takes():
    # train()'s docstring is the reference a Python user reads: every keyword it accepts (listed by
    # the error for an unknown one) appears there as name=default (review-3: ffn, vocab, positions and
    # layer_norm_epsilon were accepted but missing), one a line, in the table's order.
    with pytest.raises(TypeError) as e:
        meshgrad.train(no_such_keyword=1)
    taken = str(e.value).split("(it takes: ", 1)[1].rstrip(")").split(", ")
    assert sorted(taken) == sorted(_train_keywords())
    documented = [line.split("=", 1)[0].strip() for line in meshgrad.train.__doc__.splitlines()
                  if line.startswith("  ") and "=" in line]
    assert documented == _train_keywords()
    assert "  steps=5: " in meshgrad.train.__doc__ and "  metrics=None: " in meshgrad.train.__doc__


def test_every_table_keyword_is_taken_by_train():
    # Each keyword of the table reaches train()'s reading of its keywords: a value of no type is a
    # TypeError naming it (not an unexpected keyword), raised before anything runs.
    for key in _train_keywords():
        with pytest.raises(TypeError) as e:
            meshgrad.train(**{key: object()})
        assert "unexpected keyword" not in str(e.value) and f"{key} must be" in str(e.value), (key, str(e.value))


def test_grads_of_a_llama_in_hugging_face_layout_on_any_mesh_and_mesh_invariant(tmp_path):
    weights = tmp_path / "w.safetensors"
    meshgrad.train(mesh="tp=1", steps=1, model="llama", layers=2, hidden=32, heads=4, kv_heads=2, seq=16, batch=4,
                   save=str(weights))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
                                  "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 256, "max_position_embeddings": 16, "rms_norm_eps": 1e-5}))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 9), dtype=np.int64)
    batch = tmp_path / "batch.safetensors"
    write_safetensors(batch, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    files = dict(config=str(config), weights=str(weights), batch_file=str(batch))
    ref = meshgrad.grads(mesh="tp=1", **files)
    # Hugging Face's layout: q_proj.weight is nn.Linear's [out, in].
    assert ref["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    assert ref["model.layers.0.mlp.gate_proj.weight"].shape == (128, 32)
    for mesh in ("tp=2", "pp=2", "fsdp=2"):
        got = meshgrad.grads(mesh=mesh, **files)
        for name, g in ref.items():
            assert np.abs(got[name] - g).max() <= 1e-5 * max(np.abs(g).max(), 1e-30), (mesh, name)
    inv = dict(files, mesh_invariant=True, invariant_blocks=2)
    one = meshgrad.grads(mesh="tp=1", **inv)
    for mesh in ("tp=2", "dp=2"):
        got = meshgrad.grads(mesh=mesh, **inv)
        for name, g in one.items():
            assert np.array_equal(got[name], g), (mesh, name)


def test_explain_costs_on_a_link_measured_on_the_meshes_ranks():
    rows = meshgrad.explain(model="gpt", mesh="tp=2", link="measured")
    link = rows[0]["link"]
    assert link["name"] == "measured" and link["alpha_us"] >= 0 and link["beta_gbs"] > 0
    assert all(r["link"] == link for r in rows)
    # Each row is costed on the fitted link: an all-reduce of n = 2 takes 2 (alpha + bytes / (2 beta)).
    ring = [r for r in rows if r["op"] == "all_reduce" and r["ranks"] == 2 and r["algorithm"] == "ring"]
    assert ring
    for r in ring:
        want = 2 * (link["alpha_us"] + r["bytes"] / 2 / (link["beta_gbs"] * 1e3))
        assert r["predicted_us"] == pytest.approx(want, rel=1e-9)
    with pytest.raises(meshgrad.InvalidArgument, match="has 1 rank: there is no link to measure"):
        meshgrad.explain(model="gpt", mesh="tp=1", link="measured")
