"""A transformer block of one's own: GPT-J's and PaLM's "parallel" block, written in Python on meshgrad.

    x + drop(attention(norm(x)) + mlp(norm(x)))     one RMSNorm; attention and a SwiGLU MLP side by side

A block is any object with forward(x, seq, dropout) -> Tensor and parameters() -> [Parameter]; x is the
activation [T(_local), B, C] (sequence first; T_local under sequence parallelism). Its linears come from a
tensor-parallel plan that says, by name, which are column-parallel (output features split) and which
row-parallel (input features split, outputs summed over tp): the block never branches on the mesh, and the
runner adds FSDP units, pipeline stages, activation checkpointing and checkpoints from outside.

    meshgrad.register_family("parallel-block", ParallelBlock, dropout_draws=1)
    meshgrad.Model(mesh, kind="parallel-block", ...)      # or meshgrad.train(model="parallel-block", ...)
"""
import math

import meshgrad as mg

PLAN = mg.Plan("parallel-block", [
    ("h.*.attn.qkv", "column"),      # q, k, v fused: each rank computes whole heads
    ("h.*.attn.out", "row"),         # the heads' outputs summed over tp (reduce-scattered under SP)
    ("h.*.mlp.gate_up", "column"),   # gate and up fused, split alike
    ("h.*.mlp.down", "row"),
])


class ParallelBlock:
    def __init__(self, name, layer, config, ctx, seed):
        c, dtype = config["hidden"], config["dtype"]
        self.ctx = ctx
        self.head_dim = c // config["heads"]
        self.ffn = config["ffn"]
        out_std = 0.02 / math.sqrt(2.0 * config["layers"])   # two residual writes per block, as GPT-2
        self.norm = mg.RMSNorm(ctx, f"{name}.norm", c, eps=1e-6, dtype=dtype)
        self.qkv = PLAN.linear(ctx, f"{name}.attn.qkv", c, 3 * c, bias=False, blocks=3, out_unit=self.head_dim,
                               seed=seed, dtype=dtype)
        self.out = PLAN.linear(ctx, f"{name}.attn.out", c, c, bias=False, in_unit=self.head_dim, init_std=out_std,
                               seed=seed, dtype=dtype)
        self.gate_up = PLAN.linear(ctx, f"{name}.mlp.gate_up", c, 2 * self.ffn, bias=False, blocks=2, seed=seed,
                                   dtype=dtype)
        self.down = PLAN.linear(ctx, f"{name}.mlp.down", self.ffn, c, bias=False, init_std=out_std, seed=seed,
                                dtype=dtype)

    def attention(self, h, seq):
        qkv = self.qkv(h, seq)                                   # [T, B, 3 * H_local * D]: the whole sequence
        local = qkv.size(2) // 3
        heads, b = local // self.head_dim, qkv.size(1)
        q, k, v = (t.reshape([seq, b, heads, self.head_dim]).permute([1, 2, 0, 3]).contiguous()
                   for t in mg.split(qkv, 2, [local, local, local]))
        y = self.ctx.attention(q, k, v)                         # [B, H_local, T, D], causal, any mesh
        return self.out(y.permute([2, 0, 1, 3]).contiguous().reshape([seq, b, local]), seq)

    def mlp(self, h, seq):
        gate_up = self.gate_up(h, seq)                           # [T, B, 2 * F_local]
        f = gate_up.size(2) // 2
        gate, up = mg.split(gate_up, 2, [f, f])
        return self.down(mg.silu(gate) * up, seq)

    def forward(self, x, seq, dropout):
        h = self.norm(x, seq)
        return x + dropout(self.attention(h, seq) + self.mlp(h, seq))

    def parameters(self):
        return (self.norm.parameters() + self.qkv.parameters() + self.out.parameters() + self.gate_up.parameters() +
                self.down.parameters())
