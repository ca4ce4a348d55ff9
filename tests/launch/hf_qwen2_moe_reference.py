"""`meshgrad grads` of a Qwen2-MoE model in Hugging Face's file layout, against PyTorch.

usage: hf_qwen2_moe_reference.py CONFIG.json WEIGHTS.safetensors BATCH.safetensors GRADS.safetensors [--capacity-factor=X]
       hf_qwen2_moe_reference.py --self-test
exit 0 when the loss, the load-balancing loss and every gradient agree within 1e-9 relative (as
hf_mixtral_reference.py measures, and for its reasons), 1 otherwise.

Written from transformers' modeling_qwen2_moe.py semantics, in float64:
- attention as Qwen2's (q/k/v projections with biases, o_proj without), RMSNorm, RoPE, grouped-query
  attention; no sliding window (use_sliding_window is refused here);
- block i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else a
  dense SwiGLU MLP `mlp.{gate,up,down}_proj` of intermediate_size;
- a sparse block `mlp`: softmax over all num_experts of x @ mlp.gate^T, the num_experts_per_tok
  largest, renormalised only with norm_topk_prob (default false); routed expert e is
  down_proj(silu(gate_proj x) * up_proj x) of moe_intermediate_size (`mlp.experts.e.*`); plus
  sigmoid(x @ mlp.shared_expert_gate^T) * shared_expert(x), a SwiGLU MLP of
  shared_expert_intermediate_size (`mlp.shared_expert.*`);
- the loss: cross-entropy, plus router_aux_loss_coef x load_balancing_loss_func over the sparse
  blocks' router logits when output_router_logits (hf_mixtral_reference.load_balancing);
- with --capacity-factor=X each sparse block's expert keeps its first ceil(X N k / E) assignments in
  (token, slot) order; the shared expert is never capped.
The self-test shows the comparison can fail: renormalising the top-k, an ungated shared expert, no
shared expert, the dense block made sparse and the aux loss over every block each move a figure by
more than 1e-9, and a gradient perturbed by 1e-6 in a file fails main().
"""
import json
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_mixtral_reference as mix  # noqa: E402

ref = mix.ref


def is_linear(name):
    return name.endswith("_proj.weight") or name == "lm_head.weight" or name.endswith(
        (".mlp.gate.weight", ".shared_expert_gate.weight"))


def complete_config(cfg):
    """Qwen2MoeConfig's defaults for the keys a file may leave out."""
    cfg = dict(cfg)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    for key, value in (("rope_theta", 10000.0), ("rms_norm_eps", 1e-6), ("tie_word_embeddings", False),
                       ("num_experts_per_tok", 4), ("norm_topk_prob", False), ("decoder_sparse_step", 1),
                       ("mlp_only_layers", []), ("router_aux_loss_coef", 0.001), ("output_router_logits", False),
                       ("shared_expert_intermediate_size", 0)):
        cfg.setdefault(key, value)
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window true is not checked by this script")
    return cfg


def sparse(cfg, layer, variant=""):
    if variant == "all_sparse":
        return True
    return (layer not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
            and (layer + 1) % cfg["decoder_sparse_step"] == 0)


def swiglu(p, pre, x):
    return (F.silu(x @ p[pre + ".gate_proj.weight"]) * (x @ p[pre + ".up_proj.weight"])) @ p[pre + ".down_proj.weight"]


def moe(p, pre, x, cfg, capacity_factor, variant):
    """Qwen2MoeSparseMoeBlock on x [N, C]: (output, router logits, dropped assignments)."""
    n_tok, experts, k = x.shape[0], cfg["num_experts"], cfg["num_experts_per_tok"]
    logits = x @ p[pre + ".mlp.gate.weight"]
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    renorm = cfg["norm_topk_prob"] != (variant == "flip_norm_topk")
    weights = top / top.sum(-1, keepdim=True) if renorm else top
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * n_tok * k / experts)
        for e in range(experts):
            hits = chosen == e
            rank = torch.cumsum(hits.reshape(-1).to(torch.int64), 0).view(n_tok, k)
            keep &= ~(hits & (rank > capacity))
    out = torch.zeros_like(x)
    for e in range(experts):
        tok, slot = torch.where((chosen == e) & keep)
        if tok.numel():
            out = out.index_add(0, tok, swiglu(p, f"{pre}.mlp.experts.{e}", x[tok]) * weights[tok, slot].unsqueeze(-1))
    if cfg["shared_expert_intermediate_size"] > 0 and variant != "no_shared":
        shared = swiglu(p, pre + ".mlp.shared_expert", x)
        gate = torch.sigmoid(x @ p[pre + ".mlp.shared_expert_gate.weight"])
        out = out + (shared if variant == "ungated_shared" else gate * shared)
    return out, logits, int((~keep).sum())


def loss_of(p, cfg, inputs, targets, capacity_factor=None, variant=""):
    """(total loss, aux loss, dropped assignments per sparse block)."""
    c, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    b, t = inputs.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    freqs = torch.outer(torch.arange(t, dtype=torch.float64), ref.inverse_frequencies(cfg, d, ""))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    h = p["model.embed_tokens.weight"][inputs]
    router_logits, dropped = [], []
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        n = rms(h, p[pre + ".input_layernorm.weight"])

        def proj(name, width):
            return (n @ p[f"{pre}.self_attn.{name}.weight"] + p[f"{pre}.self_attn.{name}.bias"]).view(
                b, t, width, d).transpose(1, 2)

        q, k, v = proj("q_proj", heads), proj("k_proj", kv), proj("v_proj", kv)
        q, k = q * cos + ref.rotate_half(q) * sin, k * cos + ref.rotate_half(k) * sin
        groups = heads // kv
        k = k[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
        v = v[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(b, t, heads * d) @ p[pre + ".self_attn.o_proj.weight"]
        m = rms(h, p[pre + ".post_attention_layernorm.weight"]).reshape(b * t, c)
        if sparse(cfg, layer, variant) and pre + ".mlp.gate.weight" in p:
            y, logits, drop = moe(p, pre, m, cfg, capacity_factor, variant)
            router_logits.append(logits)
            dropped.append(drop)
        else:
            y = swiglu(p, pre + ".mlp", m)
            if variant == "aux_every_block":
                router_logits.append(m @ p[f"model.layers.{layer - 1 if layer else layer + 1}.mlp.gate.weight"])
        h = h + y.view(b, t, c)
    h = rms(h, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"].T if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = h @ head
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    aux = mix.load_balancing(router_logits, cfg["num_experts"], cfg["num_experts_per_tok"])
    if cfg["output_router_logits"]:
        loss = loss + cfg["router_aux_loss_coef"] * aux
    return loss, aux, dropped


def to_reference(weights):
    return mix.to_reference(weights, is_linear)


def gradients(p):
    return mix.gradients(p, is_linear)


def main(config_path, weights_path, batch_path, grads_path, capacity_factor=None):
    with open(config_path) as f:
        cfg = complete_config(json.load(f))
    if cfg.get("model_type") != "qwen2_moe":
        print(f"model_type is {cfg.get('model_type')!r}, this script checks 'qwen2_moe'")
        return 1
    weights, _ = ref.read_safetensors(weights_path)
    batch, _ = ref.read_safetensors(batch_path)
    grads, _ = ref.read_safetensors(grads_path)
    p = to_reference(weights)
    loss, aux, dropped = loss_of(p, cfg, batch["inputs"], batch["targets"], capacity_factor)
    loss.backward()
    if capacity_factor is not None:
        print(f"capacity factor {capacity_factor}: dropped per sparse block {dropped}")
    return mix.compare(loss, aux, cfg["output_router_logits"], grads, gradients(p))


def random_model(cfg, gen):
    c, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    def mlp(pre, width):
        return {pre + ".gate_proj.weight": rnd(width, c), pre + ".up_proj.weight": rnd(width, c),
                pre + ".down_proj.weight": rnd(c, width)}

    w = {"model.embed_tokens.weight": rnd(v, c, scale=1.0), "model.norm.weight": 1 + rnd(c, scale=0.1),
         "lm_head.weight": rnd(v, c)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        w[pre + ".input_layernorm.weight"] = 1 + rnd(c, scale=0.1)
        w[pre + ".post_attention_layernorm.weight"] = 1 + rnd(c, scale=0.1)
        for name, width in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            w[f"{pre}.self_attn.{name}.weight"], w[f"{pre}.self_attn.{name}.bias"] = rnd(width, c), rnd(width)
        w[pre + ".self_attn.o_proj.weight"] = rnd(c, heads * d)
        if sparse(cfg, i):
            w[pre + ".mlp.gate.weight"] = rnd(cfg["num_experts"], c, scale=0.5)
            for e in range(cfg["num_experts"]):
                w.update(mlp(f"{pre}.mlp.experts.{e}", cfg["moe_intermediate_size"]))
            w.update(mlp(pre + ".mlp.shared_expert", cfg["shared_expert_intermediate_size"]))
            w[pre + ".mlp.shared_expert_gate.weight"] = rnd(1, c)
        else:
            w.update(mlp(pre + ".mlp", cfg["intermediate_size"]))
    return w


def self_test():
    gen = torch.Generator().manual_seed(20241128)
    cfg = complete_config({"model_type": "qwen2_moe", "hidden_size": 16, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
                           "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20, "vocab_size": 32,
                           "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1],
                           "output_router_logits": True, "router_aux_loss_coef": 0.02})
    weights = random_model(cfg, gen)
    inputs = torch.randint(0, 32, (2, 6), generator=gen)
    targets = torch.randint(0, 32, (2, 6), generator=gen)

    def run(variant=""):
        p = to_reference(weights)
        loss, aux, _ = loss_of(p, cfg, inputs, targets, variant=variant)
        loss.backward()
        return loss.item(), gradients(p)

    right = run()
    ok = True
    for variant in ("flip_norm_topk", "ungated_shared", "no_shared", "aux_every_block"):
        other = run(variant)
        moved = max([abs(other[0] - right[0]) / abs(right[0])] + [ref.relative(other[1][n], right[1][n]) for n in right[1]])
        print(f"variant {variant}: moves a figure by {moved:.2e}")
        ok = ok and moved > 1e-9
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f) for f in ("config.json", "w.safetensors", "b.safetensors", "g.safetensors")]
        with open(files[0], "w") as f:
            json.dump(cfg, f)
        mix.write_safetensors(files[1], weights)
        mix.write_safetensors(files[2], {"inputs": inputs, "targets": targets})
        p = to_reference(weights)
        loss, aux, _ = loss_of(p, cfg, inputs, targets)
        loss.backward()
        grads = dict(gradients(p), loss=torch.tensor(loss.item(), dtype=torch.float64),
                     aux_loss=torch.tensor(aux.item(), dtype=torch.float64))
        mix.write_safetensors(files[3], grads)
        ok = ok and main(*files) == 0
        name = "model.layers.2.mlp.shared_expert_gate.weight"
        grads[name] = grads[name] * (1 + 1e-6)
        mix.write_safetensors(files[3], grads)
        ok = ok and main(*files) == 1
    print("self-test " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--self-test"]:
        sys.exit(self_test())
    factor = None
    if len(args) == 5 and args[4].startswith("--capacity-factor="):
        factor = float(args.pop().split("=", 1)[1])
    if len(args) != 4:
        print(__doc__.splitlines()[2], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*args, capacity_factor=factor))
