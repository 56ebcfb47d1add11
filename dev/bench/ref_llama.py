#!/usr/bin/env python3
"""dev/bench/ref_llama.py — a PyTorch Llama (the Llama-3.2-1B layout) for dev/bench/torch_speed.py --model llama,
the model train_gpt builds from Megatron's flags --swiglu --normalization RMSNorm --position-embedding-type rope
--use-rope-scaling --group-query-attention --disable-bias-linear (tied embeddings):

  pre-norm RMSNorm (eps 1e-5, F.rms_norm), fused QKV linear in Megatron's grouped layout (per query group:
  n/g query heads, then one key and one value head, d rows each), RoPE (rotate_half convention, theta 500000,
  Llama-3.1 "llama3" frequency scaling, cos/sin precomputed once), grouped-query attention through
  F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) (k/v not repeated), SwiGLU MLP with a fused
  [gate; up] linear of 2f rows (act = silu(gate) * up), no biases, output layer tied to the word embeddings over
  the whole padded vocabulary, no dropout. Init (Megatron's): normal(0.02), output projections (attention proj
  and fc2) 0.02 / sqrt(2L), norms 1.

  python dev/bench/ref_llama.py      # CPU self-test: tiny forward+backward, RoPE and logits against transformers
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def llama3_inv_freq(d, theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192):
    """RoPE inverse frequencies with Llama-3.1's "llama3" scaling: wavelengths above original/low are divided by
    factor, those below original/high are kept, and the ones between are interpolated smoothly."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, T, heads, d]; cos, sin [T, d] (fp32, cast to x's dtype as transformers does)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, h, n, g, d, f, eps):
        super().__init__()
        self.n, self.g, self.d = n, g, d
        self.norm1 = RMSNorm(h, eps)
        self.qkv = nn.Linear(h, (n + 2 * g) * d, bias=False)  # per group: [q_0 .. q_{n/g-1}, k, v], d rows each
        self.proj = nn.Linear(n * d, h, bias=False)
        self.norm2 = RMSNorm(h, eps)
        self.fc1 = nn.Linear(h, 2 * f, bias=False)             # [gate; up]
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        r = self.n // self.g
        q, k, v = self.qkv(self.norm1(x)).view(B, T, self.g, r + 2, self.d).split([r, 1, 1], dim=3)
        q = apply_rope(q.reshape(B, T, self.n, self.d), cos, sin)   # query head i belongs to group i // r
        k = apply_rope(k.reshape(B, T, self.g, self.d), cos, sin)
        v = v.reshape(B, T, self.g, self.d)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, self.n * self.d))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, L, h, n, g, f, Vp, S, d=None, theta=500000.0, rope_scaling=(32.0, 1.0, 4.0, 8192), eps=1e-5):
        super().__init__()
        d = d or h // n
        assert n % g == 0 and d % 2 == 0, (n, g, d)
        self.L, self.h, self.n, self.g, self.d, self.f, self.Vp, self.S = L, h, n, g, d, f, Vp, S
        self.wte = nn.Embedding(Vp, h)
        self.blocks = nn.ModuleList([Block(h, n, g, d, f, eps) for _ in range(L)])
        self.norm_f = RMSNorm(h, eps)
        inv = llama3_inv_freq(d, theta, *rope_scaling) if rope_scaling else 1.0 / theta ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)                 # [S, d]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = F.linear(self.norm_f(x), self.wte.weight)      # tied, all Vp columns
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, self.Vp), targets.reshape(-1))

    @torch.no_grad()
    def init_megatron(self, seed, std=0.02):
        """normal(std), attention proj and fc2 std / sqrt(2L), norms 1 (on the parameters' device)."""
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                s = std / math.sqrt(2 * self.L) if name.endswith(("proj.weight", "fc2.weight")) else std
                p.normal_(0.0, s, generator=gen)

    def param_groups(self, weight_decay):
        """Weight decay on the 2-D weights (embeddings, qkv, proj, fc1, fc2) only, not on the norms."""
        params = list(self.parameters())
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------------
# CPU self-test
# ------------------------------------------------------------------------------------------------

def _hf_rope(d, S, theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, head_dim=d, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                       "low_freq_factor": low, "high_freq_factor": high,
                                       "original_max_position_embeddings": original})
    rot = LlamaRotaryEmbedding(cfg)
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), torch.arange(S)[None])
    return rot.inv_freq, cos[0], sin[0]


def _to_hf(model):
    """transformers' LlamaForCausalLM holding this model's weights (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    m = model
    cfg = LlamaConfig(vocab_size=m.Vp, hidden_size=m.h, intermediate_size=m.f, num_hidden_layers=m.L,
                      num_attention_heads=m.n, num_key_value_heads=m.g, head_dim=m.d, max_position_embeddings=131072,
                      rms_norm_eps=m.norm_f.eps, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg).eval()
    r = m.n // m.g
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(m.wte.weight)
        hf.model.norm.weight.copy_(m.norm_f.weight)
        for blk, hl in zip(m.blocks, hf.model.layers):
            w = blk.qkv.weight.view(m.g, r + 2, m.d, m.h)
            hl.self_attn.q_proj.weight.copy_(w[:, :r].reshape(m.n * m.d, m.h))
            hl.self_attn.k_proj.weight.copy_(w[:, r].reshape(m.g * m.d, m.h))
            hl.self_attn.v_proj.weight.copy_(w[:, r + 1].reshape(m.g * m.d, m.h))
            hl.self_attn.o_proj.weight.copy_(blk.proj.weight)
            hl.mlp.gate_proj.weight.copy_(blk.fc1.weight[:m.f])
            hl.mlp.up_proj.weight.copy_(blk.fc1.weight[m.f:])
            hl.mlp.down_proj.weight.copy_(blk.fc2.weight)
            hl.input_layernorm.weight.copy_(blk.norm1.weight)
            hl.post_attention_layernorm.weight.copy_(blk.norm2.weight)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    return hf


def self_test():
    torch.manual_seed(0)
    L, h, n, g, f, V, S, B = 2, 128, 4, 2, 256, 512, 32, 2
    model = Llama(L, h, n, g, f, V, S)
    model.init_megatron(1234)
    with torch.no_grad():   # non-trivial norm weights, so that a mix-up of the norms would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, V, (B, S + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    nparams = sum(p.numel() for p in model.parameters())
    expect = V * h + L * (h * (n + 2 * g) * (h // n) + n * (h // n) * h + 2 * f * h + f * h + 2 * h) + h
    assert nparams == expect, (nparams, expect)
    loss = model(x, y)
    loss.backward()
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                   for p in model.parameters())
    print(f"tiny llama (L={L} h={h} heads={n} groups={g} ffn={f} vocab={V} seq={S} batch={B}): {nparams} params, "
          f"loss {loss.item():.4f} (ln V = {math.log(V):.4f}), all grads finite and non-zero: {grads_ok}")
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(V)) < 0.5 and grads_ok

    # GQA: enable_gqa (k/v not repeated) against explicitly repeated k/v
    q, k, v = torch.randn(B, n, S, 16), torch.randn(B, g, S, 16), torch.randn(B, g, S, 16)
    o1 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o2 = F.scaled_dot_product_attention(q, k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1),
                                        is_causal=True)
    print(f"enable_gqa vs repeat_interleave'd k/v: max |diff| {(o1 - o2).abs().max().item():.3g}")
    assert (o1 - o2).abs().max() < 1e-5

    try:
        import transformers
    except ImportError:
        print("transformers not installed: RoPE and logits not compared against it")
        return
    for d, SS in ((64, 2048), (h // n, S)):
        inv_hf, cos_hf, sin_hf = _hf_rope(d, SS)
        m = Llama(1, d * 4, 4, 4, 8, 8, SS)
        di = (llama3_inv_freq(d) - inv_hf).abs().max().item()
        dc = (m.cos - cos_hf).abs().max().item()
        ds = (m.sin - sin_hf).abs().max().item()
        print(f"RoPE llama3 (head dim {d}, {SS} positions) vs transformers {transformers.__version__} "
              f"LlamaRotaryEmbedding: max |diff| inv_freq {di:.3g}, cos {dc:.3g}, sin {ds:.3g}")
        assert max(di, dc, ds) < 1e-6
    hf = _to_hf(model)
    with torch.no_grad():
        lo, lh = model(x), hf(input_ids=x).logits
        loss_h = F.cross_entropy(lh.view(-1, V), y.reshape(-1))
    dl = (lo - lh).abs().max().item()
    print(f"logits vs transformers LlamaForCausalLM (same weights, eager attention): max |diff| {dl:.3g}; "
          f"loss {loss.item():.6f} vs {loss_h.item():.6f}")
    assert dl < 1e-4
    print("ref_llama self-test: OK")


if __name__ == "__main__":
    self_test()
