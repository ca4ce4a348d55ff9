"""GPT-2's transformer block written in Python on meshgrad's layers: what a block of one's own looks like.

A block is any object with forward(x, seq, dropout) -> Tensor and parameters() -> [Parameter]. Its linears
come from a tensor-parallel plan (column / row by name), so the same code runs at tp=1, tp=2, with sequence
parallelism, and inside FSDP units and pipeline stages that the runner adds from outside. Built with the
names and initialisation of meshgrad's C++ GPT-2, this block trains bit for bit as `--model gpt` does
(python/tests/test_training_api.py holds it to that).
"""
import math

import meshgrad as mg

GPT2_PLAN = mg.Plan("gpt2-in-python", [
    ("h.*.attn.c_attn", "column"),   # q, k, v: each rank computes its heads
    ("h.*.attn.c_proj", "row"),      # the heads' outputs summed over tp (reduce-scattered under SP)
    ("h.*.mlp.c_fc", "column"),
    ("h.*.mlp.c_proj", "row"),
])


def heads_first(t, seq, heads, head_dim):
    """[T, B, heads * D] -> [B, heads, T, D]."""
    return t.reshape([seq, t.size(1), heads, head_dim]).permute([1, 2, 0, 3]).contiguous()


class Gpt2Block:
    """x + drop(attn(ln_1(x))), then h + drop(mlp(ln_2(h))): x is [T(_local), B, C]."""

    def __init__(self, name, layer, config, ctx, seed, plan=GPT2_PLAN):
        c, dtype = config["hidden"], config["dtype"]
        self.ctx = ctx
        self.head_dim = c // config["heads"]
        proj_std = 0.02 / math.sqrt(2.0 * config["layers"])
        eps = config["layer_norm_epsilon"]
        self.ln_1 = mg.LayerNorm(ctx, f"{name}.ln_1", c, eps=eps, dtype=dtype)
        self.c_attn = plan.linear(ctx, f"{name}.attn.c_attn", c, 3 * c, blocks=3, out_unit=self.head_dim, seed=seed,
                                  dtype=dtype)
        self.c_proj = plan.linear(ctx, f"{name}.attn.c_proj", c, c, in_unit=self.head_dim, init_std=proj_std,
                                  seed=seed, dtype=dtype)
        self.ln_2 = mg.LayerNorm(ctx, f"{name}.ln_2", c, eps=eps, dtype=dtype)
        self.c_fc = plan.linear(ctx, f"{name}.mlp.c_fc", c, config["ffn"], seed=seed, dtype=dtype)
        self.mlp_proj = plan.linear(ctx, f"{name}.mlp.c_proj", config["ffn"], c, init_std=proj_std, seed=seed,
                                    dtype=dtype)

    def attention(self, x, seq):
        qkv = self.c_attn(x, seq)                      # [T, B, 3 * H_local * D]: the whole sequence
        local = qkv.size(2) // 3
        heads = local // self.head_dim
        q, k, v = (heads_first(t, seq, heads, self.head_dim) for t in mg.split(qkv, 2, [local, local, local]))
        y = self.ctx.attention(q, k, v)                # [B, H_local, T, D]
        y = y.permute([2, 0, 1, 3]).contiguous().reshape([seq, y.size(0), local])
        return self.c_proj(y, seq)                     # [T(_local), B, C]

    def forward(self, x, seq, dropout):
        h = x + dropout(self.attention(self.ln_1(x, seq), seq))
        return h + dropout(self.mlp_proj(mg.gelu(self.c_fc(self.ln_2(h, seq), seq)), seq))

    def parameters(self):
        # The one-rank model's order: GPT-2's (ln_1, attn, ln_2, mlp).
        return (self.ln_1.parameters() + self.c_attn.parameters() + self.c_proj.parameters() +
                self.ln_2.parameters() + self.c_fc.parameters() + self.mlp_proj.parameters())
