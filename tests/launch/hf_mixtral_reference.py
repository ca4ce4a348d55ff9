"""`meshgrad grads` of a Mixtral model in Hugging Face's file layout, against PyTorch.

usage: hf_mixtral_reference.py CONFIG.json WEIGHTS.safetensors BATCH.safetensors GRADS.safetensors
                               [--capacity-factor=X]
       hf_mixtral_reference.py --self-test
exit 0 when the loss, the aux loss and every gradient agree within 1e-9 relative (the largest
element difference over the largest element of the reference), 1 otherwise; the figures are printed.

The model is written from transformers' modeling_mixtral.py semantics, in float64: the attention,
RMSNorm and RoPE of tests/train/llama_reference.py (Mixtral's attention is Mistral's: no biases,
a sliding window on every layer when sliding_window is set), and in place of the SwiGLU MLP the
MixtralSparseMoeBlock: router softmax over all E experts, top-k, the k weights renormalised to sum
to one, each chosen expert w2(silu(w1 x) * w3 x) weighted and summed. With output_router_logits
the loss also carries router_aux_loss_coef * load_balancing_loss_func(every layer's router logits)
(no attention mask); GRADS holds the total under "loss" and the aux term alone under "aux_loss".
--capacity-factor=X keeps at most ceil(X * N * k / E) assignments per expert and layer, in
(token, top-k slot) order; the rest are dropped from the output (the aux loss does not see drops).

The weights are as a Hugging Face file holds them: every torch.nn.Linear weight (q/k/v/o_proj, the
router block_sparse_moe.gate, the experts' w1/w2/w3, lm_head) is [out, in] and computes x @ W.T.
This script turns them into x @ W form, runs the model, and compares each gradient transposed back
to the file's layout. CONFIG is the config.json meshgrad would export, with Hugging Face's defaults.

Why 1e-9 and not llama's 1e-12: meshgrad sums the k expert outputs of a token, and the tokens an
expert gathers through its all-to-all, in another order than this script does; in float64 each
such reordering costs ~1e-15 relative per operation, and the router's softmax/renormalisation and
the aux loss chain several of them. A wrong model moves a figure by far more: --self-test shows
each variant below (no renormalisation, aux loss left out, aux on top-k probabilities, top-1, and
under a capacity the drops taken in slot order) moves the loss or a gradient by more than 1e-9,
and round-trips this checker through safetensors files.
"""
import json
import math
import os
import struct
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
import llama_reference as ref  # noqa: E402

TOLERANCE = 1e-9
WRONG_AT_LEAST = 1e-9

# Wrong models --self-test must tell from the right one (each moves a figure by > WRONG_AT_LEAST).
WRONG_VARIANTS = {
    "no_renorm": "top-k routing weights not renormalised to sum to one",
    "no_aux": "aux loss left out of the loss",
    "aux_topk_probs": "aux loss on the router probabilities kept after top-k instead of all of them",
    "top1": "top-1 routing instead of top-k",
}
# Wrong only when a capacity drops assignments (--self-test runs it with --capacity-factor=0.5).
CAPACITY_VARIANTS = {
    "capacity_slot_major": "capacity kept in (slot, token) order instead of (token, slot)",
}
# Mistral's reference code takes the softmax over the k largest logits instead of over all E and
# renormalising. That is the same function: p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j), and
# top-k of the softmax picks the same experts as top-k of the logits. No comparison can tell it
# from the right model, so --self-test checks that it agrees (meshgrad may compute either form).
EQUIVALENT_VARIANTS = {
    "softmax_topk": "softmax over the top-k logits instead of over all experts, then renormalised",
}


def is_linear(name):
    return (name.endswith("_proj.weight") or name == "lm_head.weight"
            or name.endswith("block_sparse_moe.gate.weight")
            or (".block_sparse_moe.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))))


def complete_config(cfg):
    """Hugging Face's defaults (LlamaConfig's for the shared keys, MixtralConfig's for the rest)."""
    cfg = dict(cfg)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("rope_theta", 1e6)
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("num_local_experts", 8)
    cfg.setdefault("num_experts_per_tok", 2)
    cfg.setdefault("router_aux_loss_coef", 0.001)
    cfg.setdefault("output_router_logits", False)
    cfg.setdefault("sliding_window", None)
    return cfg


def moe(p, pre, x, cfg, capacity_factor=None, variant=""):
    """MixtralSparseMoeBlock on x [N, C]; returns (output [N, C], router logits [N, E], dropped)."""
    n_tok = x.shape[0]
    experts = cfg["num_local_experts"]
    k = 1 if variant == "top1" else cfg["num_experts_per_tok"]
    logits = x @ p[pre + ".block_sparse_moe.gate.weight"]            # [N, E]
    probs = torch.softmax(logits, dim=-1)                              # over all E experts
    top, chosen = torch.topk(probs, k, dim=-1)                         # [N, k], largest first
    if variant == "softmax_topk":
        weights = torch.softmax(logits.gather(-1, chosen), dim=-1)
    elif variant == "no_renorm":
        weights = top
    else:
        weights = top / top.sum(-1, keepdim=True)
    # The expert indices are constants: gradients reach the router only through `weights`.

    # Capacity: expert e keeps its first `capacity` assignments in (token, slot) order, i.e. in
    # the row-major order of chosen [N, k]; later ones are dropped (absent from the output).
    # (A token picks an expert at most once, so for one expert this is simply token order; the
    # wrong variant capacity_slot_major ranks every token's slot 0 before any slot 1, GShard-like.)
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * n_tok * k / experts)
        for e in range(experts):
            hits = chosen == e                                          # [N, k]
            if variant == "capacity_slot_major":
                rank = torch.cumsum(hits.T.reshape(-1).to(torch.int64), 0).view(k, n_tok).T
            else:
                rank = torch.cumsum(hits.reshape(-1).to(torch.int64), 0).view(n_tok, k)
            keep &= ~(hits & (rank > capacity))                         # rank: 1-based among e's
    dropped = int((~keep).sum())

    out = torch.zeros_like(x)
    for e in range(experts):
        tok, slot = torch.where((chosen == e) & keep)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        ex = f"{pre}.block_sparse_moe.experts.{e}"
        y = (F.silu(xe @ p[ex + ".w1.weight"]) * (xe @ p[ex + ".w3.weight"])) @ p[ex + ".w2.weight"]
        out = out.index_add(0, tok, y * weights[tok, slot].unsqueeze(-1))
    return out, logits, dropped


def load_balancing(router_logits, experts, k, variant=""):
    """load_balancing_loss_func(gate_logits, num_experts, top_k) with no attention mask."""
    if variant == "top1":
        k = 1
    logits = torch.cat(router_logits, dim=0)                            # [L*N, E]
    probs = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, k, dim=-1)
    expert_mask = F.one_hot(selected, experts).to(torch.float64)        # [L*N, k, E], a constant
    tokens_per_expert = expert_mask.mean(dim=0)                         # [k, E]
    if variant == "aux_topk_probs":
        probs = probs * expert_mask.sum(dim=1)                          # only the chosen experts
    router_prob_per_expert = probs.mean(dim=0)                          # [E]
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * experts


def loss_of(p, cfg, inputs, targets, capacity_factor=None, variant=""):
    """(total loss, aux loss, dropped assignments per layer). Line for line ref.loss_of's model
    (no q/k/v biases, every layer windowed when sliding_window is set) but for the MoE block."""
    h_dim, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    b, t = inputs.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    freqs = torch.outer(torch.arange(t, dtype=torch.float64), ref.inverse_frequencies(cfg, d, ""))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rot = ref.rotate_half

    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    window = cfg.get("sliding_window") or 0
    if window:   # Hugging Face's kv_idx > q_idx - sliding_window, on every Mixtral layer
        pos = torch.arange(t)
        mask = mask.masked_fill(pos[None, :] <= pos[:, None] - window, float("-inf"))

    h = p["model.embed_tokens.weight"][inputs]
    router_logits, dropped = [], []
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        n = rms(h, p[pre + ".input_layernorm.weight"])
        q = (n @ p[pre + ".self_attn.q_proj.weight"]).view(b, t, heads, d).transpose(1, 2)
        k = (n @ p[pre + ".self_attn.k_proj.weight"]).view(b, t, kv, d).transpose(1, 2)
        v = (n @ p[pre + ".self_attn.v_proj.weight"]).view(b, t, kv, d).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        groups = heads // kv   # repeat_kv: query head j reads key/value head j // groups
        k = k[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
        v = v[:, :, None].expand(b, kv, groups, t, d).reshape(b, heads, t, d)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(b, t, heads * d) @ p[pre + ".self_attn.o_proj.weight"]
        m = rms(h, p[pre + ".post_attention_layernorm.weight"])
        # The MoE block sees all B*T tokens as one [N, C] batch (capacity counts over all of them).
        y, logits, drop = moe(p, pre, m.reshape(b * t, h_dim), cfg, capacity_factor, variant)
        h = h + y.view(b, t, h_dim)
        router_logits.append(logits)
        dropped.append(drop)
    h = rms(h, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"].T if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = h @ head
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    aux = load_balancing(router_logits, cfg["num_local_experts"], cfg["num_experts_per_tok"], variant)
    if cfg["output_router_logits"] and variant != "no_aux":
        loss = loss + cfg["router_aux_loss_coef"] * aux
    return loss, aux, dropped


def to_reference(weights, linear=is_linear):
    """File layout -> x @ W form, float64 leaves that keep their gradients (`linear`: which names are
    nn.Linear weights, stored [out, in])."""
    p = {}
    for name, w in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        w = w.to(torch.float64)
        p[name] = (w.T.contiguous() if linear(name) else w.clone()).requires_grad_(True)
    return p


def gradients(p, linear=is_linear):
    """Each gradient in the file's layout (an expert nothing reached has a zero gradient)."""
    out = {}
    for n, w in p.items():
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        out[n] = g.T if linear(n) else g
    return out


def compare(loss, aux, output_router_logits, grads, mine):
    """The reference's loss, aux loss and gradients (`mine`, file layout) against meshgrad's file
    `grads`, printed as the llama scripts do; 0 when all agree within TOLERANCE, else 1."""
    theirs = grads["loss"].item()
    worst = abs(loss.item() - theirs) / abs(loss.item())
    print(f"loss: reference {loss.item()!r}, meshgrad {theirs!r}, relative difference {worst:.2e}")
    ok = worst <= TOLERANCE
    if "aux_loss" in grads:
        theirs = grads["aux_loss"].item()
        r = abs(aux.item() - theirs) / abs(aux.item())
        print(f"aux_loss: reference {aux.item()!r}, meshgrad {theirs!r}, relative difference {r:.2e}")
        ok = ok and r <= TOLERANCE
        worst = max(worst, r)
    elif output_router_logits:
        print("output_router_logits is true but meshgrad wrote no aux_loss")
        ok = False
    names = list(mine)
    missing = [n for n in names if n not in grads]
    if missing:
        print(f"meshgrad wrote no gradient for {missing}")
        ok = False
    for n in names:
        if n in missing:
            continue
        g = mine[n]
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


def main(config_path, weights_path, batch_path, grads_path, capacity_factor=None):
    with open(config_path) as f:
        cfg = json.load(f)
    if cfg.get("model_type", "mixtral") != "mixtral":
        print(f"model_type is {cfg['model_type']!r}, this script checks 'mixtral'")
        return 1
    cfg = complete_config(cfg)
    weights, _ = ref.read_safetensors(weights_path)
    batch, _ = ref.read_safetensors(batch_path)
    grads, _ = ref.read_safetensors(grads_path)
    p = to_reference(weights)
    loss, aux, dropped = loss_of(p, cfg, batch["inputs"], batch["targets"], capacity_factor)
    loss.backward()
    if capacity_factor is not None:
        n_tok = batch["inputs"].numel()
        capacity = math.ceil(capacity_factor * n_tok * cfg["num_experts_per_tok"] / cfg["num_local_experts"])
        print(f"capacity factor {capacity_factor}: at most {capacity} of {n_tok * cfg['num_experts_per_tok']} "
              f"assignments per expert; dropped per layer {dropped}")

    return compare(loss, aux, cfg["output_router_logits"], grads, gradients(p))


# ---------------------------------------------------------------------------------------------
# --self-test

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.int64: "I64"}


def write_safetensors(path, tensors):
    """A minimal safetensors writer (F64 and I64 only), enough for ref.read_safetensors."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        data = t.numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)   # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def random_model(cfg, gen):
    """Random float64 weights in Hugging Face's layout."""
    c, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, heads, kv = cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    def norm():
        return 1 + rnd(c, scale=0.1)

    w = {"model.embed_tokens.weight": rnd(v, c, scale=1.0), "model.norm.weight": norm(), "lm_head.weight": rnd(v, c)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        w[pre + ".input_layernorm.weight"] = norm()
        w[pre + ".post_attention_layernorm.weight"] = norm()
        w[pre + ".self_attn.q_proj.weight"] = rnd(heads * d, c)
        w[pre + ".self_attn.k_proj.weight"] = rnd(kv * d, c)
        w[pre + ".self_attn.v_proj.weight"] = rnd(kv * d, c)
        w[pre + ".self_attn.o_proj.weight"] = rnd(c, heads * d)
        w[pre + ".block_sparse_moe.gate.weight"] = rnd(cfg["num_local_experts"], c, scale=0.5)
        for e in range(cfg["num_local_experts"]):
            ex = f"{pre}.block_sparse_moe.experts.{e}"
            w[ex + ".w1.weight"], w[ex + ".w3.weight"], w[ex + ".w2.weight"] = rnd(f, c), rnd(f, c), rnd(c, f)
    return w


def run(weights, cfg, inputs, targets, capacity_factor=None, variant=""):
    p = to_reference(weights)
    loss, aux, dropped = loss_of(p, cfg, inputs, targets, capacity_factor, variant)
    loss.backward()
    return loss.item(), aux.item(), gradients(p), dropped


def moved(a, b):
    """How far run() result a is from b: the loss and every gradient, relative as main() measures."""
    return max([abs(a[0] - b[0]) / abs(b[0])] + [ref.relative(a[2][n], b[2][n]) for n in b[2]])


def self_test():
    gen = torch.Generator().manual_seed(20240607)
    cfg = {"model_type": "mixtral", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
           "output_router_logits": True, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}
    full = complete_config(cfg)
    weights = random_model(full, gen)
    b, t = 2, 6
    inputs = torch.randint(0, cfg["vocab_size"], (b, t), generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (b, t), generator=gen)
    targets[0, 2] = -100   # an ignored position, as the trainer's batches have
    ok = True

    right = run(weights, full, inputs, targets)
    print(f"right model: loss {right[0]!r}, aux {right[1]!r}")

    # 1. Every Mixtral-only line above sits on the Llama model of llama_reference: with one expert
    #    and k = 1 (routing weight exactly 1) and no aux loss, this model is ref.loss_of's with
    #    mlp.gate/up/down_proj = w1/w3/w2; checked with and without a sliding window.
    for window in (None, 3):
        one = dict(full, num_local_experts=1, num_experts_per_tok=1, output_router_logits=False,
                   sliding_window=window, attention_bias=False)
        w1 = {n: w for n, w in weights.items() if ".experts." not in n or ".experts.0." in n}
        w1 = {n: (w[:1] if n.endswith("gate.weight") else w) for n, w in w1.items()}
        mine = run(w1, one, inputs, targets)
        rename = {".block_sparse_moe.experts.0.w1.": ".mlp.gate_proj.", ".block_sparse_moe.experts.0.w3.": ".mlp.up_proj.",
                  ".block_sparse_moe.experts.0.w2.": ".mlp.down_proj."}
        p = {}
        for n, w in w1.items():
            if n.endswith("block_sparse_moe.gate.weight"):
                continue
            for a, z in rename.items():
                n = n.replace(a, z)
            p[n] = (w.T.contiguous() if is_linear(n) else w.clone()).requires_grad_(True)
        loss = ref.loss_of(p, one, inputs, targets)
        loss.backward()
        back = {v: k for k, v in rename.items()}
        theirs_grads = {}
        for n, w in p.items():
            g = w.grad.T if is_linear(n) else w.grad
            for z, a in back.items():
                n = n.replace(z, a)
            theirs_grads[n] = g
        mine_grads = {n: g for n, g in mine[2].items() if not n.endswith("block_sparse_moe.gate.weight")}
        r = max([abs(mine[0] - loss.item()) / abs(loss.item())] +
                [ref.relative(mine_grads[n], theirs_grads[n]) for n in theirs_grads])
        print(f"one expert, k = 1, sliding_window {window}: against llama_reference.loss_of {r:.2e}")
        if r > 1e-12:
            print("  the attention here is not llama_reference's")
            ok = False

    # 2. Each wrong model must move the loss or a gradient by more than WRONG_AT_LEAST.
    smallest = math.inf
    for variant, what in WRONG_VARIANTS.items():
        r = moved(run(weights, full, inputs, targets, variant=variant), right)
        smallest = min(smallest, r)
        print(f"a wrong model ({variant}: {what}) moves a figure by {r:.2e}")
        if r <= WRONG_AT_LEAST:
            print(f"  the comparison cannot tell '{variant}' from the right model")
            ok = False
    print(f"smallest move of a wrong model: {smallest:.2e} (tolerance {TOLERANCE})")
    for variant, what in EQUIVALENT_VARIANTS.items():
        r = moved(run(weights, full, inputs, targets, variant=variant), right)
        print(f"an equivalent form ({variant}: {what}) moves a figure by {r:.2e}, as it must not")
        if r > TOLERANCE:
            print(f"  '{variant}' should be the same function as the right model")
            ok = False

    # 3. Capacity, then a round trip through files: the reference's own gradients must pass, a
    #    gradient off by 1e-6 relative, or a missing aux_loss, must fail; likewise with a capacity
    #    that drops assignments.
    capacity_factor = 0.5
    capped = run(weights, full, inputs, targets, capacity_factor)
    print(f"capacity factor {capacity_factor}: dropped per layer {capped[3]}, "
          f"moves a figure by {moved(capped, right):.2e} against no capacity")
    if sum(capped[3]) == 0 or moved(capped, right) <= WRONG_AT_LEAST:
        print("  the capacity test drops nothing that matters")
        ok = False
    for variant, what in CAPACITY_VARIANTS.items():
        r = moved(run(weights, full, inputs, targets, capacity_factor, variant), capped)
        print(f"a wrong model ({variant}: {what}) moves a figure by {r:.2e}")
        if r <= WRONG_AT_LEAST:
            print(f"  the comparison cannot tell '{variant}' from the right model")
            ok = False
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, n) for n in ("config.json", "model.safetensors", "batch.safetensors", "grads.safetensors")]
        with open(files[0], "w") as f:   # without tie_word_embeddings: main() must default it
            json.dump({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}, f)
        write_safetensors(files[1], weights)
        write_safetensors(files[2], {"inputs": inputs, "targets": targets})

        def write_grads(result, edit=None):
            g = {"loss": torch.tensor(result[0], dtype=torch.float64),
                 "aux_loss": torch.tensor(result[1], dtype=torch.float64)} | dict(result[2])
            if edit:
                edit(g)
            write_safetensors(files[3], g)

        def perturb(g):   # the largest element of one gradient, by 1e-6 relative
            name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
            flat = g[name].clone().reshape(-1)
            i = flat.abs().argmax()
            flat[i] *= 1 + 1e-6
            g[name] = flat.view_as(g[name])

        def drop_aux(g):
            del g["aux_loss"]

        checks = [("the reference's own gradients", right, None, None, 0),
                  ("one gradient element off by 1e-6 relative", right, perturb, None, 1),
                  ("no aux_loss with output_router_logits", right, drop_aux, None, 1),
                  (f"--capacity-factor={capacity_factor}, its own gradients", capped, None, capacity_factor, 0),
                  ("capacity gradients checked without capacity", capped, None, None, 1),
                  (f"--capacity-factor={capacity_factor}, a gradient off by 1e-6", capped, perturb, capacity_factor, 1)]
        for what, result, edit, cap, expect in checks:
            write_grads(result, edit)
            print(f"-- round trip: {what} (expect exit {expect})")
            got = main(*files, capacity_factor=cap)
            if got != expect:
                print(f"  main() exited {got}, expected {expect}")
                ok = False
    print("self-test " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def parse(argv):
    if argv == ["--self-test"]:
        return None
    if len(argv) not in (4, 5):
        raise ValueError("expected 4 files and an optional --capacity-factor=X")
    capacity_factor = None
    if len(argv) == 5:
        flag, _, value = argv[4].partition("=")
        if flag != "--capacity-factor" or not value:
            raise ValueError(f"unknown argument {argv[4]!r}")
        capacity_factor = float(value)
        if not capacity_factor > 0 or math.isinf(capacity_factor):
            raise ValueError(f"--capacity-factor must be a positive number, not {value!r}")
    return argv[:4], capacity_factor


if __name__ == "__main__":
    try:
        parsed = parse(sys.argv[1:])
    except ValueError as err:
        print(f"{err}\n{__doc__.splitlines()[2]}\n{__doc__.splitlines()[3]}\n{__doc__.splitlines()[4]}", file=sys.stderr)
        sys.exit(2)
    sys.exit(self_test() if parsed is None else main(*parsed[0], capacity_factor=parsed[1]))
