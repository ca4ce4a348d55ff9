"""Peer probe: a Llama-family model (Hugging Face's LlamaForCausalLM semantics: RMSNorm, RoPE in the
rotate-half layout, grouped-query attention, SwiGLU MLP, tied or untied output layer, no biases)
trained with AdamW in PyTorch (Debian python3-torch 1.13, CPU, 2 threads), written plainly as
transformers' modeling_llama computes it (1.13 has no fused attention: scores, mask, softmax, as
its eager path). Prints tokens/s over the timed steps and the process's peak resident memory.
Run: /usr/bin/python3 torch_llama_train.py STEPS LAYERS HIDDEN HEADS KV_HEADS FFN SEQ BATCH VOCAB WARMUP TIED
(TIED 1: lm_head is embed_tokens^T)."""
import math, resource, sys, time, torch, torch.nn as nn, torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(s, C, eps=1e-5):
        super().__init__()
        s.weight = nn.Parameter(torch.ones(C)); s.eps = eps
    def forward(s, x):
        return s.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(s, C, H, KV, F_):
        super().__init__()
        s.H, s.KV, s.D = H, KV, C // H
        s.input_layernorm = RMSNorm(C); s.post_attention_layernorm = RMSNorm(C)
        s.q_proj = nn.Linear(C, H * s.D, bias=False); s.k_proj = nn.Linear(C, KV * s.D, bias=False)
        s.v_proj = nn.Linear(C, KV * s.D, bias=False); s.o_proj = nn.Linear(H * s.D, C, bias=False)
        s.gate_proj = nn.Linear(C, F_, bias=False); s.up_proj = nn.Linear(C, F_, bias=False)
        s.down_proj = nn.Linear(F_, C, bias=False)
    def forward(s, x, cos, sin, mask):
        B, T, C = x.shape
        n = s.input_layernorm(x)
        q = s.q_proj(n).view(B, T, s.H, s.D).transpose(1, 2)
        k = s.k_proj(n).view(B, T, s.KV, s.D).transpose(1, 2)
        v = s.v_proj(n).view(B, T, s.KV, s.D).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        g = s.H // s.KV
        k = k[:, :, None].expand(B, s.KV, g, T, s.D).reshape(B, s.H, T, s.D)   # repeat_kv
        v = v[:, :, None].expand(B, s.KV, g, T, s.D).reshape(B, s.H, T, s.D)
        a = ((q @ k.transpose(-2, -1)) / math.sqrt(s.D) + mask).softmax(-1)
        x = x + s.o_proj((a @ v).transpose(1, 2).reshape(B, T, s.H * s.D))
        m = s.post_attention_layernorm(x)
        return x + s.down_proj(F.silu(s.gate_proj(m)) * s.up_proj(m))


class Llama(nn.Module):
    def __init__(s, L, C, H, KV, F_, V, tied, theta=10000.0):
        super().__init__()
        s.embed_tokens = nn.Embedding(V, C)
        s.layers = nn.ModuleList(Block(C, H, KV, F_) for _ in range(L))
        s.norm = RMSNorm(C)
        s.lm_head = None if tied else nn.Linear(C, V, bias=False)
        s.inv_freq = 1.0 / theta ** (torch.arange(0, C // H, 2, dtype=torch.float32) / (C // H))
    def forward(s, idx, tgt):
        T = idx.shape[1]
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), s.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = s.embed_tokens(idx)
        for b in s.layers: x = b(x, cos, sin, mask)
        x = s.norm(x)
        logits = x @ s.embed_tokens.weight.t() if s.lm_head is None else s.lm_head(x)
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


if __name__ == "__main__":
    steps, L, C, H, KV, F_, T, B, V, warmup, tied = (int(a) for a in sys.argv[1:12])
    torch.set_num_threads(2); torch.manual_seed(0)
    m = Llama(L, C, H, KV, F_, V, tied == 1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    data = torch.randint(0, V, (B * T * 64 + 1,))
    nparams = sum(p.numel() for p in m.parameters())
    def step(i):
        o = (i * B * T) % (data.numel() - B * T - 1)
        x = data[o:o + B * T].view(B, T); y = data[o + 1:o + B * T + 1].view(B, T)
        loss = m(x, y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); return loss
    for i in range(warmup): step(i)
    t = time.perf_counter()
    for i in range(steps): loss = step(i)
    t = time.perf_counter() - t
    tok = steps * B * T
    print(f"torch llama layers={L} hidden={C} heads={H} kv_heads={KV} ffn={F_} seq={T} batch={B} vocab={V} "
          f"tied={tied} ({nparams} parameters): {tok / t:.0f} tokens/s, {t / steps * 1e3:.1f} ms/step, "
          f"loss {loss.item():.4f}, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
