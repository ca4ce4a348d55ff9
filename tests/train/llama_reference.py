"""An independent Llama-family model in PyTorch, written from Hugging Face's modeling_llama.py
semantics (LlamaRMSNorm, rotate-half RoPE with rope_init_fn's default, linear and llama3 inverse
frequencies, repeat_kv for grouped-query attention, SwiGLU, tied or untied lm_head, q/k/v biases as
Qwen2's), in float64, checking meshgrad's loss and gradients (tests/train/test_llama.cpp writes them).

usage: llama_reference.py FILE.safetensors      exit 0 when every figure agrees within 1e-12
relative, 1 otherwise (the differences are printed).

Weights are meshgrad's [in, out] (y = x W); Hugging Face's nn.Linear holds W^T. The RoPE tables
are float64 here (Hugging Face computes inv_freq in float32; the issue asks float64 runs to be
float64 throughout). The script also shows that it can tell a wrong model: each variant below
(interleaved RoPE, rms_norm_eps x 10, key/value heads repeated in the wrong order, no RoPE scaling)
must move the loss or a gradient by more than 1e-9 relative, or the comparison proves nothing.
"""
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

TOLERANCE = 1e-12
WRONG_AT_LEAST = 1e-9
DTYPES = {"F64": np.float64, "F32": np.float32, "I64": np.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out, meta


def inverse_frequencies(cfg, head_dim, variant):
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", "default")
    if variant == "no_scaling":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x):   # the GPT-J / Meta-checkpoint layout: pairs (0, 1), (2, 3), ...
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def loss_of(p, cfg, inputs, targets, variant=""):
    h_dim, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    eps = cfg["rms_norm_eps"] * (10 if variant == "eps" else 1)
    b, t = inputs.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = inverse_frequencies(cfg, d, variant)
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    if variant == "interleaved":
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rot = rotate_interleaved if variant == "interleaved" else rotate_half

    def linear(x, name, bias=False):
        y = x @ p[name + ".weight"]
        return y + p[name + ".bias"] if bias and (name + ".bias") in p else y

    h = p["model.embed_tokens.weight"][inputs]
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    # Sliding-window layers (Mistral: all; Qwen2: from max_window_layers on) also mask the keys at
    # or before q - window (Hugging Face's kv_idx > q_idx - sliding_window).
    window = cfg.get("sliding_window") or 0
    pos = torch.arange(t)
    window_mask = mask.masked_fill(pos[None, :] <= pos[:, None] - window, float("-inf")) if window else mask
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        n = rms(h, p[pre + ".input_layernorm.weight"])
        bias = cfg["attention_bias"]
        q = linear(n, pre + ".self_attn.q_proj", bias).view(b, t, heads, d).transpose(1, 2)
        k = linear(n, pre + ".self_attn.k_proj", bias).view(b, t, kv, d).transpose(1, 2)
        v = linear(n, pre + ".self_attn.v_proj", bias).view(b, t, kv, d).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        groups = heads // kv
        if variant == "repeat_order":
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k = k[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
            v = v[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
        windowed = window and layer >= cfg.get("max_window_layers", 0) and variant != "no_window"
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + (window_mask if windowed else mask), dim=-1) @ v
        h = h + linear(att.transpose(1, 2).reshape(b, t, heads * d), pre + ".self_attn.o_proj")
        m = rms(h, p[pre + ".post_attention_layernorm.weight"])
        gate = F.silu(linear(m, pre + ".mlp.gate_proj"))
        h = h + linear(gate * linear(m, pre + ".mlp.up_proj"), pre + ".mlp.down_proj")
    h = rms(h, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"].T if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = h @ head
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def relative(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def main(path):
    t, meta = read_safetensors(path)
    cfg = json.loads(meta["config"])
    names = [k[len("param."):] for k in t if k.startswith("param.")]
    inputs, targets = t["batch.inputs"], t["batch.targets"]
    theirs_loss = t["loss"].item()

    def run(variant=""):
        p = {n: t["param." + n].clone().requires_grad_(True) for n in names}
        loss = loss_of(p, cfg, inputs, targets, variant)
        loss.backward()
        return loss.item(), {n: p[n].grad for n in names}

    loss, grads = run()
    worst = abs(loss - theirs_loss) / abs(loss)
    print(f"loss: reference {loss!r}, meshgrad {theirs_loss!r}, relative difference {worst:.2e}")
    ok = worst <= TOLERANCE
    for n in names:
        r = relative(t["grad." + n], grads[n])
        if r > TOLERANCE:
            print(f"gradient of {n}: relative difference {r:.2e} > {TOLERANCE}")
            ok = False
        worst = max(worst, r)
    print(f"largest relative difference over the loss and {len(names)} gradients: {worst:.2e}")
    variants = ["interleaved", "eps", "no_scaling", "no_window"] + (["repeat_order"] if cfg["num_key_value_heads"] > 1 else [])
    for variant in variants:
        if variant == "no_scaling" and not cfg.get("rope_scaling"):
            continue
        if variant == "no_window" and not cfg.get("sliding_window"):
            continue
        wrong_loss, wrong_grads = run(variant)
        moved = max([abs(wrong_loss - theirs_loss) / abs(theirs_loss)] +
                    [relative(t["grad." + n], wrong_grads[n]) for n in names])
        print(f"a wrong model ({variant}) moves a figure by {moved:.2e}")
        if moved < WRONG_AT_LEAST:
            print(f"  the comparison cannot tell '{variant}' from the right model")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
