"""`meshgrad export` and `train --init-from` against an independent GPT-2: the exported directory is
read with a safetensors reader written here (JSON header + numpy.frombuffer), the model is built in
PyTorch as Hugging Face's modeling_gpt2.py defines GPT2LMHeadModel (Conv1D weights [in, out],
gelu_new, pre-LN blocks, causal softmax attention scaled by 1/sqrt(head size), tied lm_head,
layer_norm_epsilon from config.json), and its loss on a batch must equal meshgrad's.

Tolerances. float64 (meshgrad grads --dtype float64 on the exported values widened, against PyTorch
in float64): 1e-12 relative. Both compute the same formulas, so only float64 rounding (unit roundoff
1.1e-16, a few hundred operations deep, in different orders) separates them; measured: 2e-16 to
3e-16. This is the comparison that pins the model: test_the_reference_can_tell_a_wrong_model shows
that the erf form of GELU instead of gelu_new (4e-10), layer_norm_epsilon 1e-6 instead of 1e-5
(2e-7) or a Conv1D weight read transposed (2e-4) each move the loss by at least 100 times it.
float32: 1e-6 relative (about 12 units in the last place at a loss of 5.5). Both sides round every
product and sum to float32 (unit roundoff 6e-8) in different orders (OpenBLAS and meshgrad's tp=2
all-reduces vs PyTorch's kernels); measured: 0 to 1 unit in the last place (9e-8). It shows that
the float32 path loads and computes the same model; it cannot see the GELU form, the float64 check
does.

Needs the meshgrad CLI (MESHGRAD_CLI, set by ctest) and python3-torch (scripts/install-deps.sh).
"""
import json
import math
import os
import struct
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

CLI = os.environ.get("MESHGRAD_CLI", "")

SIZES = dict(layers=2, hidden=32, heads=4, seq=16)


def meshgrad(*args):
    assert CLI and os.path.exists(CLI), "set MESHGRAD_CLI to the meshgrad binary (ctest does)"
    run = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"meshgrad {' '.join(map(str, args))} failed:\n{run.stderr}"
    return run


# ---- a safetensors reader and writer, from the format's description --------------------------------

def read_safetensors(path):
    """(metadata, {name: numpy array (F16/BF16 widened to float32)}, {name: stored dtype}, {name: raw bytes})"""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    arrays, dtypes, raw = {}, {}, {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        b = data[8 + n + begin:8 + n + end]
        kind = entry["dtype"]
        if kind == "F32":
            a = np.frombuffer(b, "<f4")
        elif kind == "F64":
            a = np.frombuffer(b, "<f8")
        elif kind == "I64":
            a = np.frombuffer(b, "<i8")
        elif kind == "F16":
            a = np.frombuffer(b, "<f2").astype(np.float32)
        elif kind == "BF16":   # the upper half of a float32
            a = (np.frombuffer(b, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise AssertionError(f"{path}: unexpected dtype {kind} of {name}")
        arrays[name] = a.reshape(entry["shape"])
        dtypes[name] = kind
        raw[name] = b
    return metadata, arrays, dtypes, raw


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype name, shape, bytes)}"""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, (kind, shape, b) in tensors.items():
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- GPT-2 as Hugging Face's modeling_gpt2.py computes it -----------------------------------------

def gelu_new(x):
    # transformers.activations.NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def conv1d(x, weight, bias):
    # transformers.pytorch_utils.Conv1D: weight [in, out]; y = x @ W + b
    size_out = x.size()[:-1] + (weight.size(-1),)
    return torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(size_out)


def gpt2_loss(weights, config, inputs, targets, dtype, activation=gelu_new):
    """Mean cross-entropy of GPT2LMHeadModel on inputs [B, T] against targets [B, T] (the labels already
    shifted; -100 ignored), no dropout (eval mode)."""
    W = {k: torch.tensor(np.asarray(v, dtype=np.float64), dtype=dtype) for k, v in weights.items()}
    C, H, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    D = C // H
    x = torch.tensor(inputs)
    B, T = x.shape
    h = W["wte.weight"][x] + W["wpe.weight"][torch.arange(T)]
    causal = torch.tril(torch.ones((T, T), dtype=torch.bool))
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        a = F.layer_norm(h, (C,), W[p + "ln_1.weight"], W[p + "ln_1.bias"], eps)
        q, k, v = conv1d(a, W[p + "attn.c_attn.weight"], W[p + "attn.c_attn.bias"]).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).permute(0, 2, 1, 3) for t in (q, k, v))
        s = torch.matmul(q, k.transpose(-1, -2))
        s = s / torch.full([], v.size(-1) ** 0.5, dtype=s.dtype)
        s = torch.where(causal, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
        y = torch.matmul(F.softmax(s, dim=-1), v).permute(0, 2, 1, 3).reshape(B, T, C)
        h = h + conv1d(y, W[p + "attn.c_proj.weight"], W[p + "attn.c_proj.bias"])
        m = F.layer_norm(h, (C,), W[p + "ln_2.weight"], W[p + "ln_2.bias"], eps)
        m = conv1d(activation(conv1d(m, W[p + "mlp.c_fc.weight"], W[p + "mlp.c_fc.bias"])),
                   W[p + "mlp.c_proj.weight"], W[p + "mlp.c_proj.bias"])
        h = h + m
    h = F.layer_norm(h, (C,), W["ln_f.weight"], W["ln_f.bias"], eps)
    logits = torch.matmul(h, W["wte.weight"].t())   # lm_head tied to wte, no bias
    return F.cross_entropy(logits.view(-1, logits.size(-1)), torch.tensor(targets).view(-1),
                           ignore_index=-100).item()


# ---- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A meshgrad run (5 steps at tp=2, so the weights are trained, not the initialisation) exported
    in float32, float16 and bfloat16."""
    d = tmp_path_factory.mktemp("hf")
    meshgrad("train", "--mesh", "tp=2", "--steps", 5, "--lr", "1e-2", "--batch", 4, "--no-metrics",
             "--layers", SIZES["layers"], "--hidden", SIZES["hidden"], "--heads", SIZES["heads"],
             "--seq", SIZES["seq"], "--save", d / "ck.safetensors")
    for dtype in ("float32", "float16", "bfloat16"):
        meshgrad("export", "--checkpoint", d / "ck.safetensors", "--out", d / dtype, "--dtype", dtype)
    return d


def batch(seed=0, B=3, T=16, vocab=256):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab, size=(B, T), dtype=np.int64)
    targets = rng.integers(0, vocab, size=(B, T), dtype=np.int64)
    targets[1, :5] = -100   # ignored positions (transformers' ignore_index)
    return inputs, targets


def meshgrad_loss(tmp_path, model_dir, inputs, targets, dtype, mesh="tp=2"):
    """`meshgrad grads` on the directory's config.json and model.safetensors: its loss. float64: on a
    float64 copy of the weights written here (the same values, widened), so that grads computes and
    reports the loss in float64 (it writes the loss in the weights' dtype)."""
    b = tmp_path / "batch.safetensors"
    write_safetensors(b, {"inputs": ("I64", inputs.shape, inputs.tobytes()),
                          "targets": ("I64", targets.shape, targets.tobytes())})
    weights = model_dir / "model.safetensors"
    if dtype == "float64":
        _, arrays, _, _ = read_safetensors(weights)
        weights = tmp_path / "weights64.safetensors"
        write_safetensors(weights, {k: ("F64", a.shape, a.astype("<f8").tobytes()) for k, a in arrays.items()})
    out = tmp_path / f"grads-{dtype}.safetensors"
    if out.exists():
        out.unlink()
    meshgrad("grads", "--config", model_dir / "config.json", "--weights", weights,
             "--batch", b, "--mesh", mesh, "--dtype", dtype, "--out", out)
    _, result, dtypes, _ = read_safetensors(out)
    assert dtypes["loss"] == ("F64" if dtype == "float64" else "F32")
    return float(result["loss"])


# ---- tests ------------------------------------------------------------------------------------------

def test_the_exported_directory_is_a_hugging_face_gpt2(exported):
    config = json.loads((exported / "float32" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"] is True
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (SIZES["layers"], SIZES["hidden"], SIZES["heads"])
    assert config["n_positions"] == config["n_ctx"] == SIZES["seq"] and config["vocab_size"] == 256
    meta, arrays, dtypes, _ = read_safetensors(exported / "float32" / "model.safetensors")
    assert meta == {"format": "pt"}
    assert "lm_head.weight" not in arrays and not any(k.startswith("transformer.") for k in arrays)
    C = SIZES["hidden"]
    assert arrays["h.1.attn.c_attn.weight"].shape == (C, 3 * C)   # Conv1D: [in, out]
    assert arrays["h.1.mlp.c_proj.weight"].shape == (4 * C, C)
    assert set(dtypes.values()) == {"F32"}
    # The float32 export is the checkpoint, bit for bit.
    _, ck, _, ck_raw = read_safetensors(exported / "ck.safetensors")
    _, _, _, raw = read_safetensors(exported / "float32" / "model.safetensors")
    assert set(ck) == set(raw) and all(ck_raw[k] == raw[k] for k in ck)


def test_half_exports_are_rounded_to_nearest_even_as_numpy_and_torch_round(exported):
    _, f32, _, _ = read_safetensors(exported / "float32" / "model.safetensors")
    _, _, d16, raw16 = read_safetensors(exported / "float16" / "model.safetensors")
    _, _, dbf, rawbf = read_safetensors(exported / "bfloat16" / "model.safetensors")
    assert set(d16.values()) == {"F16"} and set(dbf.values()) == {"BF16"}
    for name, a in f32.items():
        assert raw16[name] == a.astype("<f2").tobytes(), name
        bf = torch.tensor(a).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
        assert rawbf[name] == bf, name
    assert json.loads((exported / "bfloat16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("export", ["float32", "float16", "bfloat16"])
def test_pytorch_gpt2_gives_meshgrads_loss(exported, tmp_path, export):
    model_dir = exported / export
    config = json.loads((model_dir / "config.json").read_text())
    _, weights, _, _ = read_safetensors(model_dir / "model.safetensors")
    inputs, targets = batch()
    ref64 = gpt2_loss(weights, config, inputs, targets, torch.float64)
    ref32 = gpt2_loss(weights, config, inputs, targets, torch.float32)
    got64 = meshgrad_loss(tmp_path, model_dir, inputs, targets, "float64")
    got32 = meshgrad_loss(tmp_path, model_dir, inputs, targets, "float32")
    assert 4.0 < ref64 < 7.0   # a byte model a few steps in: near ln 256 = 5.55
    print(f"{export}: float64 {got64!r} vs {ref64!r} ({abs(got64 - ref64) / ref64:.1e}), "
          f"float32 {got32!r} vs {ref32!r} ({abs(got32 - ref32) / ref32:.1e})")
    assert got64 == pytest.approx(ref64, rel=1e-12, abs=0)
    assert got32 == pytest.approx(ref32, rel=1e-6, abs=0)
    assert got32 == pytest.approx(ref64, rel=1e-6, abs=0)


def test_the_reference_can_tell_a_wrong_model(exported):
    """The float64 tolerance (1e-12) is tight enough to see a different model: each change below moves
    the loss by at least 100 times it (and reading a weight transposed by 100 times the float32 one)."""
    model_dir = exported / "float32"
    config = json.loads((model_dir / "config.json").read_text())
    _, weights, _, _ = read_safetensors(model_dir / "model.safetensors")
    inputs, targets = batch()
    ref = gpt2_loss(weights, config, inputs, targets, torch.float64)

    def moved(w=weights, c=config, activation=gelu_new):
        return abs(gpt2_loss(w, c, inputs, targets, torch.float64, activation) - ref) / ref

    assert moved(activation=lambda x: F.gelu(x)) > 100 * 1e-12   # erf GELU ("gelu") instead of gelu_new
    assert moved(c=dict(config, layer_norm_epsilon=1e-6)) > 100 * 1e-12
    transposed = dict(weights)
    w = weights["h.0.attn.c_attn.weight"]
    transposed["h.0.attn.c_attn.weight"] = w.T.reshape(w.shape)   # [out, in] read as [in, out]
    assert moved(w=transposed) > 100 * 1e-6


def test_train_init_from_a_save_pretrained_style_directory(exported, tmp_path):
    """A directory as GPT2LMHeadModel.save_pretrained(torch_dtype=float16) writes it: names under
    "transformer.", F16, the tied lm_head and the old attention-mask buffers present. `train
    --init-from` must start from exactly those weights: its step-1 loss (before the update) on a
    token file of T + 1 tokens (every row is the one window) equals PyTorch's on the same tokens."""
    _, f32, _, _ = read_safetensors(exported / "float32" / "model.safetensors")
    config = json.loads((exported / "float32" / "config.json").read_text())
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(config, torch_dtype="float16")))
    T = SIZES["seq"]
    tensors = {"transformer." + k: ("F16", a.shape, a.astype("<f2").tobytes()) for k, a in f32.items()}
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    for i in range(config["n_layer"]):
        mask = np.tril(np.ones((T, T), dtype=np.uint8)).reshape(1, 1, T, T)
        tensors[f"transformer.h.{i}.attn.bias"] = ("U8", mask.shape, mask.tobytes())
        tensors[f"transformer.h.{i}.attn.masked_bias"] = ("F32", (), np.float32(-1e4).tobytes())
    write_safetensors(hf / "model.safetensors", tensors, {"format": "pt"})

    tokens = np.random.default_rng(1).integers(0, 256, size=T + 1).astype(np.uint16)
    head = np.zeros(256, dtype=np.int32)
    head[:3] = (20240520, 1, T + 1)   # llm.c token file: magic, version, count
    (tmp_path / "tokens.bin").write_bytes(head.tobytes() + tokens.tobytes())
    metrics = tmp_path / "m.jsonl"
    meshgrad("train", "--init-from", hf, "--data", tmp_path / "tokens.bin", "--steps", 1, "--seq", T,
             "--batch", 2, "--mesh", "tp=2", "--metrics", metrics)
    first = [json.loads(line) for line in metrics.read_text().splitlines()][1]["loss"]

    weights = {k: a.astype(np.float16).astype(np.float32) for k, a in f32.items()}
    inputs = np.tile(tokens[:T].astype(np.int64), (2, 1))
    targets = np.tile(tokens[1:].astype(np.int64), (2, 1))
    assert first == pytest.approx(gpt2_loss(weights, config, inputs, targets, torch.float32), rel=1e-6, abs=0)


def test_python_train_takes_init_from(exported):
    """meshgrad.train(init_from=...) as the CLI: sizes from config.json, a disagreeing one refused."""
    import meshgrad as mg
    one = mg.train(init_from=str(exported / "float32"), mesh="tp=1", steps=1, seq=SIZES["seq"], dtype="float64")
    two = mg.train(init_from=str(exported / "float32"), mesh="tp=2", steps=1, seq=SIZES["seq"], dtype="float64")
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-12)
    fresh = mg.train(mesh="tp=1", steps=1, seq=SIZES["seq"], dtype="float64", layers=SIZES["layers"],
                     hidden=SIZES["hidden"], heads=SIZES["heads"])
    assert abs(fresh[0]["loss"] - one[0]["loss"]) > 1e-6
    with pytest.raises(mg.InvalidArgument, match="--layers 3 disagrees with n_layer = 2"):
        mg.train(init_from=str(exported / "float32"), layers=3, steps=1, seq=SIZES["seq"])
