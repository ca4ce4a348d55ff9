"""`meshgrad grads` of a Llama-family model in Hugging Face's file layout, against PyTorch.

usage: hf_llama_reference.py CONFIG.json WEIGHTS.safetensors BATCH.safetensors GRADS.safetensors
exit 0 when the loss and every gradient agree within 1e-12 relative (the largest element
difference over the largest element), 1 otherwise; the figures are printed.

The weights are as a Hugging Face file holds them: every torch.nn.Linear weight (q/k/v/o_proj,
gate/up/down_proj, lm_head) is [out, in] and computes x @ W.T. This script turns them into x @ W
form itself, by the names Hugging Face gives linears, runs the model of tests/train/llama_reference.py
(written from modeling_llama.py's semantics, float64), and compares each gradient transposed back
to the file's layout with what meshgrad wrote. The config is the config.json meshgrad would
export: its defaults are Hugging Face's (num_key_value_heads = heads, head_dim = hidden / heads,
qwen2's q/k/v biases always on).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
import llama_reference as ref  # noqa: E402

TOLERANCE = 1e-12


def is_linear(name):
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def main(config_path, weights_path, batch_path, grads_path):
    with open(config_path) as f:
        cfg = json.load(f)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["attention_bias"] = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("tie_word_embeddings", False)
    weights, _ = ref.read_safetensors(weights_path)
    batch, _ = ref.read_safetensors(batch_path)
    grads, _ = ref.read_safetensors(grads_path)
    p = {}
    for name, w in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        w = w.to(torch.float64)
        p[name] = (w.T.contiguous() if is_linear(name) else w).requires_grad_(True)
    loss = ref.loss_of(p, cfg, batch["inputs"], batch["targets"])
    loss.backward()
    theirs = grads["loss"].item()
    worst = abs(loss.item() - theirs) / abs(loss.item())
    print(f"loss: reference {loss.item()!r}, meshgrad {theirs!r}, relative difference {worst:.2e}")
    ok = worst <= TOLERANCE
    names = [n for n in p]
    missing = [n for n in names if n not in grads]
    if missing:
        print(f"meshgrad wrote no gradient for {missing}")
        ok = False
    for n in names:
        if n in missing:
            continue
        g = p[n].grad.T if is_linear(n) else p[n].grad
        if tuple(grads[n].shape) != tuple(g.shape):
            print(f"gradient of {n}: shape {tuple(grads[n].shape)}, the file layout is {tuple(g.shape)}")
            ok = False
            continue
        r = ref.relative(grads[n].to(torch.float64), g)
        if r > TOLERANCE:
            print(f"gradient of {n}: relative difference {r:.2e} > {TOLERANCE}")
            ok = False
        worst = max(worst, r)
    print(f"largest relative difference over the loss and {len(names)} gradients: {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
