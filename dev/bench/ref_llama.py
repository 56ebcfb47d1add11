#!/usr/bin/env python3
"""dev/bench/ref_llama.py — a PyTorch Llama (the Llama-3.2-1B layout) for dev/bench/torch_speed.py --model llama,
the model train_gpt builds from Megatron's flags --swiglu --normalization RMSNorm --position-embedding-type rope
--use-rope-scaling --group-query-attention --disable-bias-linear (tied embeddings); and, with moe=MoESpec(...),
the same model with every MLP a Megatron-Core MoE layer (torch_speed.py --model moe: Mixtral and Qwen3-MoE layers;
see class MoE), optionally with --kv-channels, --qk-layernorm, --untie-embeddings-and-output-weights and no RoPE
scaling:

  pre-norm RMSNorm (eps 1e-5, F.rms_norm), fused QKV linear in Megatron's grouped layout (per query group:
  n/g query heads, then one key and one value head, d rows each), RoPE (rotate_half convention, theta 500000,
  Llama-3.1 "llama3" frequency scaling, cos/sin precomputed once), grouped-query attention through
  F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) (k/v not repeated), SwiGLU MLP with a fused
  [gate; up] linear of 2f rows (act = silu(gate) * up), no biases, output layer tied to the word embeddings over
  the whole padded vocabulary, no dropout. Init (Megatron's): normal(0.02), output projections (attention proj
  and fc2) 0.02 / sqrt(2L), norms 1. qk_layernorm: RMSNorm over each query and key head (d channels) after the
  split, before RoPE (Megatron's q_layernorm / k_layernorm). untie: a separate output layer, normal(0.02).
  Where the installed torch lacks F.rms_norm or F.scaled_dot_product_attention (torch < 2.4 / 2.0: the CPU
  self-test's), the same formulas written out (_rms_norm, _causal_attention).

  python dev/bench/ref_llama.py      # CPU self-test: tiny forward+backward, RoPE and logits against transformers;
                                     # the MoE layer (both expert paths) against dev/ref_moe.py in float64
"""
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def _wide(t):
    """t in fp32 (the precision the bench computes norms, softmaxes, the router and the loss in), or t itself
    when it is float64 (the CPU self-test against dev/ref_moe.py)."""
    return t if t.dtype == torch.float64 else t.float()


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


def _rms_norm(x, w, eps):
    """F.rms_norm where torch has it (>= 2.4); else the formula, in fp32, cast back to x's dtype."""
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = _wide(x)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * _wide(w)).to(x.dtype)


def _causal_attention(q, k, v):
    """q [B, n, T, d], k, v [B, g, T, d] -> [B, n, T, d]: SDPA (causal, GQA through enable_gqa) where torch has
    it; else softmax(q k^T / sqrt(d)) v written out, k/v repeated per group (torch < 2.0: the CPU self-test)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    T = q.shape[2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(_wide(s), dim=-1).to(q.dtype) @ v


class RMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return _rms_norm(x, self.weight, self.eps)


# ------------------------------------------------------------------------------------------------
# Mixture of experts: Megatron-Core's MoE layer (dev/moe_semantics.md) with the alltoall dispatcher at EP = 1,
# dropless, softmax router with the top-k before the softmax, the aux_loss load balancing
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoESpec:
    E: int                  # --num-experts
    k: int                  # --moe-router-topk
    fe: int                 # --moe-ffn-hidden-size (SwiGLU experts: fc1 has 2 fe rows)
    aux_coeff: float        # --moe-aux-loss-coeff of --moe-router-load-balancing-type aux_loss
    experts: str = "auto"   # grouped_mm (torch._grouped_mm), loop (one GEMM per expert), emulated (the grouped
                            # path with its GEMM as a Python loop: the CPU self-test), auto: grouped_mm if torch has it
    align: int = 8          # grouped_mm: each expert's rows padded to a multiple of this (1: no padding)
    dtype: torch.dtype = None  # the experts' compute dtype (torch.bfloat16 under bf16 autocast); None: the input's


def experts_path(spec):
    """The expert path a spec runs: auto is grouped_mm where torch has torch._grouped_mm, else loop."""
    if spec.experts == "auto":
        return "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"
    if spec.experts == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm: use experts loop")
    return spec.experts


def _eager(fn):
    """fn outside torch.compile's graph (its shapes depend on the data): torch.compiler.disable where torch has it."""
    compiler = getattr(torch, "compiler", None)
    return compiler.disable(fn) if compiler is not None and hasattr(compiler, "disable") else fn


def _grouped_mm_emulated(a, b, offs):
    """torch._grouped_mm(a [R, K], b [G, K, N], offs) written as a loop (rows past offs[-1] are left 0)."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


@_eager
def _experts_loop(x_rows, p_rows, offs, fc1, fc2, fe, dt):
    """The experts one GEMM pair each on their contiguous rows (offs: row ends, read back to the host)."""
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            gate, up = (x_rows[start:end] @ fc1[e].to(dt).t()).chunk(2, dim=-1)
            a = (_wide(F.silu(gate) * up) * p_rows[start:end, None]).to(dt)
            outs.append(a @ fc2[e].to(dt).t())
        start = end
    return torch.cat(outs, 0)


class MoE(nn.Module):
    """One MoE layer on the pre-MLP norm's output x [B, T, h] -> (y [B, T, h], aux loss (a scalar)).

    Tokens in Megatron's order (n = t * B + b). Router: logits = x W_r^T in fp32 (autocast off: Megatron's
    --moe-router-dtype fp32) [N, E]; top-k of the logits, softmax over those k (p [N, k], fp32); no capacity
    (dropless). aux_loss: S = softmax(logits) over all E, c = tokens per expert of the top-k map,
    aux = sum_e (sum_n S[n, e]) c[e] E coeff / (k N^2) (Megatron's switch_load_balancing_loss_func; its
    gradient reaches the router through S). Permutation: the N k (token, expert) pairs sorted by expert
    (a stable argsort, so tokens ascend inside an expert), each expert's rows padded with zero rows to a
    multiple of align for torch._grouped_mm (fixed shapes: R = N k + E (align - 1) rows, the ones past the
    last expert's end never read back). Experts (weights fc1 [E, 2 fe, h], gate rows first, fc2 [E, h, fe]):
    z = x fc1_e^T, a = silu(gate) * up * p (the probability scales the activation before fc2, as Megatron),
    y = a fc2_e^T, in the compute dtype (bf16 under autocast; the weights cast explicitly). Unpermute: each
    token's k rows summed (index_add) in the compute dtype."""

    def __init__(self, h, spec):
        super().__init__()
        self.spec, self.path = spec, experts_path(spec)
        E, fe = spec.E, spec.fe
        self.router = nn.Parameter(torch.empty(E, h))
        self.fc1 = nn.Parameter(torch.empty(E, 2 * fe, h))
        self.fc2 = nn.Parameter(torch.empty(E, h, fe))

    def route(self, xs):
        """xs [N, h] -> top-k experts idx [N, k], their probabilities p [N, k] (fp32), the aux loss."""
        E, k = self.spec.E, self.spec.k
        N = xs.shape[0]
        with torch.autocast(device_type=xs.device.type, enabled=False):
            logits = F.linear(_wide(xs), _wide(self.router))                    # [N, E] fp32
        top, idx = torch.topk(logits, k, dim=-1)
        p = torch.softmax(top, dim=-1)
        counts = torch.zeros(E, dtype=logits.dtype, device=xs.device).scatter_add_(
            0, idx.reshape(-1), torch.ones(N * k, dtype=logits.dtype, device=xs.device))
        aux = (torch.softmax(logits, dim=-1).sum(0) * counts).sum() * (E * self.spec.aux_coeff / (k * N * N))
        return idx, p, aux

    def permute(self, idx, align):
        """idx [N, k] -> (pos [N k]: the row of the r-th pair in expert order, token [N k]: its token,
        order [N k]: its index in idx.reshape(-1), offs [E] int32: each expert's end row, R: rows in all)."""
        E, k = self.spec.E, self.spec.k
        flat = idx.reshape(-1)                                                   # pair a = n k + j
        order = torch.argsort(flat, stable=True)                                 # expert-major, tokens ascending
        counts = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + (align - 1)) // align * align
        end = torch.cumsum(padded, 0)
        e_sorted = flat[order]
        rank = torch.arange(flat.numel(), device=idx.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
        pos = (end - padded)[e_sorted] + rank
        return pos, order // k, order, end.to(torch.int32), flat.numel() + E * (align - 1)

    def forward(self, x):
        B, T, h = x.shape
        N, fe = B * T, self.spec.fe
        dt = self.spec.dtype or x.dtype
        xs = x.transpose(0, 1).reshape(N, h)
        idx, p, aux = self.route(xs)
        align = self.spec.align if self.path != "loop" else 1
        pos, token, order, offs, R = self.permute(idx, align)
        if self.path == "loop":                                                  # R = N k, pos = 0 .. R-1
            y_rows = _experts_loop(xs[token].to(dt), p.reshape(-1)[order], offs, self.fc1, self.fc2, fe, dt)
        else:
            gemm = torch._grouped_mm if self.path == "grouped_mm" else _grouped_mm_emulated
            src = torch.full((R,), N, dtype=torch.int64, device=x.device).scatter(0, pos, token)
            x_pad = torch.cat([xs.to(dt), xs.new_zeros(1, h, dtype=dt)])[src]   # [R, h], padding rows 0
            pidx = torch.full((R,), N * self.spec.k, dtype=torch.int64, device=x.device).scatter(0, pos, order)
            p_pad = torch.cat([p.reshape(-1), p.new_zeros(1)])[pidx]              # [R]
            gate, up = gemm(x_pad, self.fc1.to(dt).transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            a = (_wide(F.silu(gate) * up) * p_pad[:, None]).to(dt)           # [R, fe]
            y_rows = gemm(a, self.fc2.to(dt).transpose(-2, -1), offs=offs)[pos]  # [N k, h], expert order
        y = xs.new_zeros(N, h, dtype=dt).index_add(0, token, y_rows)
        return y.view(T, B, h).transpose(0, 1), aux


class Block(nn.Module):
    def __init__(self, h, n, g, d, f, eps, qk_layernorm=False, moe=None):
        super().__init__()
        self.n, self.g, self.d = n, g, d
        self.norm1 = RMSNorm(h, eps)
        self.qkv = nn.Linear(h, (n + 2 * g) * d, bias=False)  # per group: [q_0 .. q_{n/g-1}, k, v], d rows each
        self.q_norm = RMSNorm(d, eps) if qk_layernorm else None
        self.k_norm = RMSNorm(d, eps) if qk_layernorm else None
        self.proj = nn.Linear(n * d, h, bias=False)
        self.norm2 = RMSNorm(h, eps)
        if moe is None:
            self.fc1 = nn.Linear(h, 2 * f, bias=False)         # [gate; up]
            self.fc2 = nn.Linear(f, h, bias=False)
        self.moe = MoE(h, moe) if moe is not None else None

    def forward(self, x, cos, sin):
        """x [B, T, h] -> (x [B, T, h], the MoE layer's aux loss or None)."""
        B, T, _ = x.shape
        r = self.n // self.g
        q, k, v = self.qkv(self.norm1(x)).view(B, T, self.g, r + 2, self.d).split([r, 1, 1], dim=3)
        q, k = q.reshape(B, T, self.n, self.d), k.reshape(B, T, self.g, self.d)  # query head i: group i // r
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(B, T, self.g, self.d)
        o = _causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, self.n * self.d))
        if self.moe is not None:
            y, aux = self.moe(self.norm2(x))
            return x + y, aux
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up), None


class Llama(nn.Module):
    def __init__(self, L, h, n, g, f, Vp, S, d=None, theta=500000.0, rope_scaling=(32.0, 1.0, 4.0, 8192), eps=1e-5,
                 qk_layernorm=False, untie=False, moe=None):
        super().__init__()
        d = d or h // n
        assert n % g == 0 and d % 2 == 0, (n, g, d)
        self.L, self.h, self.n, self.g, self.d, self.f, self.Vp, self.S = L, h, n, g, d, f, Vp, S
        self.wte = nn.Embedding(Vp, h)
        self.blocks = nn.ModuleList([Block(h, n, g, d, f, eps, qk_layernorm, moe) for _ in range(L)])
        self.norm_f = RMSNorm(h, eps)
        self.out = nn.Linear(h, Vp, bias=False) if untie else None  # untied output layer
        inv = llama3_inv_freq(d, theta, *rope_scaling) if rope_scaling else 1.0 / theta ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)                 # [S, d]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx, targets=None):
        """Logits [B, T, Vp]; with targets the training objective: the cross entropy plus, with MoE layers,
        their aux losses (what backward() runs on, as Megatron's; not the "lm loss" alone)."""
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        aux = None
        for blk in self.blocks:
            x, a = blk(x, cos, sin)
            if a is not None:
                aux = a if aux is None else aux + a
        logits = F.linear(self.norm_f(x), self.wte.weight if self.out is None else self.out.weight)  # all Vp columns
        if targets is None:
            return logits
        loss = F.cross_entropy(_wide(logits).view(-1, self.Vp), targets.reshape(-1))
        return loss if aux is None else loss + aux

    @torch.no_grad()
    def init_megatron(self, seed, std=0.02):
        """normal(std), attention proj and fc2 (the experts' too) std / sqrt(2L), norms 1 (on the parameters'
        device). The router, the experts' fc1 and the untied output layer: normal(std)."""
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                s = std / math.sqrt(2 * self.L) if name.endswith(("proj.weight", "fc2.weight", "moe.fc2")) else std
                p.normal_(0.0, s, generator=gen)

    def param_groups(self, weight_decay):
        """Weight decay on the 2-D and 3-D weights (embeddings, qkv, proj, fc1, fc2, router, experts, output)
        only, not on the norms."""
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
    if hasattr(F, "scaled_dot_product_attention"):
        q, k, v = torch.randn(B, n, S, 16), torch.randn(B, g, S, 16), torch.randn(B, g, S, 16)
        o1 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o2 = F.scaled_dot_product_attention(q, k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1),
                                            is_causal=True)
        print(f"enable_gqa vs repeat_interleave'd k/v: max |diff| {(o1 - o2).abs().max().item():.3g}")
        assert (o1 - o2).abs().max() < 1e-5
    else:
        print(f"torch {torch.__version__} has no F.scaled_dot_product_attention: the written-out attention ran")

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


def _ref_moe():
    """dev/ref_moe.py (float64 reference of megatron.c's MoE; it needs float64 as the default dtype, which its
    import sets: moe_self_test restores the caller's)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import ref_moe  # noqa: E402
    return ref_moe


def _from_ref(model, p):
    """Copy dev/ref_moe.py's parameters p (its names, per-layer tensors stacked) into the bench model."""
    with torch.no_grad():
        model.wte.weight.copy_(p["word_embeddings"])
        model.norm_f.weight.copy_(p["final_ln_weight"])
        model.out.weight.copy_(p["output_weight"])
        for l, b in enumerate(model.blocks):
            for mine, theirs in ((b.norm1.weight, "ln1_weight"), (b.qkv.weight, "qkv_weight"),
                                 (b.q_norm.weight, "q_layernorm_weight"), (b.k_norm.weight, "k_layernorm_weight"),
                                 (b.proj.weight, "proj_weight"), (b.norm2.weight, "ln2_weight"),
                                 (b.moe.router, "router_weight"), (b.moe.fc1, "expert_fc1_weight"),
                                 (b.moe.fc2, "expert_fc2_weight")):
                mine.copy_(p[theirs][l])


def moe_self_test():
    """The bench's MoE model (every layer MoE, kv channels != h / n, qk-layernorm, untied, RoPE base 1e6)
    against dev/ref_moe.py on the same weights and tokens, float64 on the CPU: the objective (cross entropy
    plus the aux losses) and the gradient of every parameter, for each expert path that runs here: loop,
    emulated (the grouped path's padding and offsets with its GEMM as a loop) at align 8 and 1, and
    grouped_mm where this torch has it. Tolerance 1e-10 relative (float64 throughout, the RoPE table rebuilt
    in float64 here; the bench builds it in float32, which alone moves the result by ~3e-7). A wrong layout,
    routing, probability or aux loss term moves the result by 1e-3 or more (the aux loss is ~2e-2 of it)."""
    dtype = torch.get_default_dtype()
    try:
        _moe_self_test(_ref_moe())
    finally:
        torch.set_default_dtype(dtype)


def _moe_self_test(ref_moe):
    torch.set_default_dtype(torch.float64)
    L, h, n, g, d, f, V, T, B, E, k, fe = 2, 64, 4, 2, 32, 96, 256, 32, 2, 8, 2, 32
    cfg = ref_moe.MoEConfig(flavor="llama", L=L, h=h, n=n, g=g, kv=d, f=f, Vp=V, T=T, G=B, mb=B, E=E, topk=k, fe=fe,
                            untied=True, qk_layernorm=True, rotary_base=1e6, lb=("aux_loss",), aux_coeff=(1e-2,))
    p = {name: t.clone().requires_grad_(True) for name, t in ref_moe.init_params(cfg).items()}
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(5))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits, aux = ref_moe.forward(cfg, p, x, training=True)
    ref_obj = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)) + aux
    ref_obj.backward()
    paths = [("loop", 1), ("emulated", 8), ("emulated", 1)] + ([("grouped_mm", 8)] if hasattr(torch, "_grouped_mm") else [])
    for path, align in paths:
        spec = MoESpec(E=E, k=k, fe=fe, aux_coeff=cfg.coeff("aux_loss"), experts=path, align=align)  # 1e-2 in fp32
        model = Llama(L, h, n, g, f, V, T, d=d, theta=1e6, rope_scaling=None, qk_layernorm=True, untie=True,
                      moe=spec).double()
        _from_ref(model, {name: t.detach() for name, t in p.items()})
        inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)   # the RoPE table in float64 here
        ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        model.cos, model.sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        try:
            obj = model(x, y)
        except (RuntimeError, NotImplementedError) as e:   # grouped_mm without a float64 CPU kernel
            print(f"MoE path {path}: does not run on the CPU here ({str(e).splitlines()[0]})")
            continue
        obj.backward()
        mine = {"word_embeddings": model.wte.weight.grad, "output_weight": model.out.weight.grad,
                "router_weight": torch.stack([b.moe.router.grad for b in model.blocks]),
                "expert_fc1_weight": torch.stack([b.moe.fc1.grad for b in model.blocks]),
                "expert_fc2_weight": torch.stack([b.moe.fc2.grad for b in model.blocks]),
                "qkv_weight": torch.stack([b.qkv.weight.grad for b in model.blocks]),
                "q_layernorm_weight": torch.stack([b.q_norm.weight.grad for b in model.blocks])}
        worst = max(((mine[name] - p[name].grad).abs().max() / p[name].grad.abs().max()).item() for name in mine)
        d_obj = abs(obj.item() - ref_obj.item()) / abs(ref_obj.item())
        print(f"MoE model vs dev/ref_moe.py (float64, E={E} top-{k} fe={fe}, experts {path}, align {align}): "
              f"objective {obj.item():.10f} vs {ref_obj.item():.10f} (rel {d_obj:.1e}, aux {aux.item():.3e}), "
              f"gradients: worst max|diff| / max|grad| {worst:.1e} over {len(mine)} tensors")
        assert d_obj < 1e-10 and worst < 1e-10, (path, align, d_obj, worst)


if __name__ == "__main__":
    self_test()
    moe_self_test()
    print("ref_llama self-test: OK")
