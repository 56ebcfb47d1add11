#!/usr/bin/env python3
"""
ref_gpt.py: the PyTorch reference for megatron.c's GPT core, and the writer of its GPU test vectors.

A small, readable GPT model *as Megatron-LM builds it*, computed in float64 on the CPU, trained for a
few AdamW steps with Megatron's semantics (sample-counted LR schedule, global-norm clipping, FusedAdam
in adam_w_mode). It writes one binary file per configuration that test_megatron.cu loads: the initial
weights, the batches, and the results (logits, loss, every gradient, several optimizer steps) to compare.

    python dev/ref_gpt.py                      # write every file in CONFIGS to dev/data/gpt_vectors/
    python dev/ref_gpt.py --only gpt2_tiny     # write one of them
    python dev/ref_gpt.py --check FILE...      # re-read files, verify them, recompute everything
    python dev/ref_gpt.py --selftest           # check the hand-written model against torch's own pieces

Only torch (CPU is enough) and numpy are needed.

Model, flavor "gpt2" (flavor code 0)
------------------------------------
L layers, hidden h, n heads, g = n query groups, head dim d = h/n, ffn f, padded vocab Vp, seq length T,
P = T position embeddings. No dropout.
  x = wte[token] + wpe[position]
  per layer (pre-LN):
    a   = LN1(x)                                      (eps 1e-5, weight and bias)
    qkv = a @ Wqkv^T + bqkv, Wqkv [3h, h] in Megatron's grouped layout: for head i, rows
          [i*3d, i*3d+d) are q_i, [i*3d+d, i*3d+2d) k_i, [i*3d+2d, i*3d+3d) v_i (bias alike).
          (General GQA form: per group j, (n/g)*d rows of q, then d rows of k, then d rows of v.)
    o   = concat_i softmax(causal(q_i k_i^T / sqrt(d))) v_i           -> [T, h], heads in order
    x   = x + o @ Wproj^T + bproj
    m   = LN2(x)
    x   = x + gelu_tanh(m @ Wfc1^T + bfc1) @ Wfc2^T + bfc2
          gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))  (Megatron's bias-gelu fusion / TE)
  y = LN_final(x); logits = y @ wte^T over all Vp columns (tied output layer; padding columns included
  in the softmax, as in Megatron); loss = mean cross entropy over every token of the global batch.

Canonical parameter order (every tensor float32, row-major, concatenated; per-layer tensors stacked
with a leading L dimension). Same order as megatron.h's MT_P_* enum:
   1 word_embeddings [Vp, h]         2 position_embeddings [P, h]
   3 ln1_weight [L, h]               4 ln1_bias [L, h]
   5 qkv_weight [L, 3h, h]           6 qkv_bias [L, 3h]
   7 proj_weight [L, h, h]           8 proj_bias [L, h]
   9 ln2_weight [L, h]              10 ln2_bias [L, h]
  11 fc1_weight [L, f, h]           12 fc1_bias [L, f]
  13 fc2_weight [L, h, f]           14 fc2_bias [L, h]
  15 final_ln_weight [h]            16 final_ln_bias [h]

Initial weights (numpy default_rng(seed), never zeros): Normal(0, 0.02) for matrices and embeddings,
proj and fc2 Normal(0, 0.02/sqrt(2L)); biases Normal(0, 0.02); LayerNorm weights 1 + Normal(0, 0.1);
LayerNorm biases Normal(0, 0.05). They are rounded to float32 *before* anything is computed, so the
float32 params0 in the file is exactly the starting point. The float hyper-parameters are likewise
rounded to float32 (what the file holds) before use.

Training, S steps (k = 0..S-1), global batch G (the C side may run it as G/mb micro-batches of mb
with gradient accumulation: the mean over the global batch is the same thing):
  loss_k, grad = mean loss and its gradient on batch k
  norm_k = global L2 norm over all gradients; coeff = clip_grad / (norm_k + 1e-6); if coeff < 1: grad *= coeff
  lr_k   = lr(k*G), Megatron's OptimizerParamScheduler counted in samples, warmup W = lr_warmup_iters*G,
           decay D = lr_decay_iters*G, init lr 0:
             num <= W (W > 0): max_lr * num / W;   num > D: min_lr;
             else cosine: r = (num-W)/(D-W), min_lr + (max_lr-min_lr) * 0.5 * (cos(pi r) + 1)
           (so step 0 runs with lr 0; Adam's moments and step count still advance)
  AdamW (apex/TE FusedAdam, adam_w_mode=1), t = k+1:
           m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  mhat = m/(1-b1^t);  vhat = v/(1-b2^t)
           p = p - lr_k * (mhat / (sqrt(vhat) + eps) + wd_p * p)
           wd_p = weight_decay for 2-D weights and both embeddings, 0 for biases and LayerNorm params.
Tokens are uniform in [0, Vp-64), so the top 64 padded columns never appear as labels.

File format, dev/data/gpt_vectors/<name>.bin, little-endian
-----------------------------------------------------------
header int32[256]:
  [0] magic 20261121  [1] version 1  [2] flavor (0 = gpt2)  [3] L  [4] h  [5] n heads  [6] f  [7] Vp
  [8] P  [9] T  [10] G global batch  [11] suggested micro batch mb  [12] S steps
  [13] number of parameter floats  [14] number of query groups (= n for gpt2)  [15..255] 0
hyper float32[64]:
  [0] max_lr  [1] min_lr  [2] lr_warmup_iters  [3] lr_decay_iters  [4] b1  [5] b2  [6] eps
  [7] weight_decay  [8] clip_grad  [9] norm (LayerNorm) eps  [10..63] 0
then, in order (N = header[13]):
  params0       float32[N]           initial weights, canonical order
  tokens        int32[S, G, T+1]     inputs [..., :T], labels [..., 1:]
  logits        float32[G, T, Vp]    step 0's batch, params0
  loss0         float32[1]           mean loss of step 0's batch, params0
  grads0        float32[N]           gradient of loss0 w.r.t. params0 (before clipping)
  losses        float32[S]           loss of each step, before its update
  grad_norms    float32[S]           global gradient norm of each step, before clipping
  lrs           float32[S]           learning rate each step used
  params_final  float32[N]           weights after the S steps
Everything is computed in float64 and written as float32. The file ends there (size is exact).

Comparing against it: the gradient of the key biases (rows [i*3d+d, i*3d+2d) of qkv_bias) is zero in
exact arithmetic (softmax is shift-invariant per query), here ~1e-20; in fp32 it is rounding noise
that Adam (eps 1e-8) can turn into updates of up to ~lr per step, so compare params_final with an
absolute tolerance of a few lr there (or skip those entries). Steps 0 and 1 see the same weights
(step 0's lr is 0).

Adding a flavor ("llama": RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases): give it a code in
FLAVORS, its tensors in param_specs(), and its pieces in the few places marked "flavor dispatch"
(embed / norm / attention / mlp / output layer). The file layout stays the same.
"""
import argparse
import math
import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

MAGIC = 20261121
VERSION = 1
HEADER_INTS = 256
HYPER_FLOATS = 64
FLAVORS = {"gpt2": 0}          # "llama": 1 later
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt_vectors")

torch.set_default_dtype(torch.float64)


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    flavor: str = "gpt2"
    L: int = 2            # layers
    h: int = 64           # hidden
    n: int = 4            # attention heads
    g: int = 0            # query groups (0: = n)
    f: int = 256          # ffn hidden
    Vp: int = 512         # padded vocab
    T: int = 32           # sequence length
    P: int = 0            # max position embeddings (0: = T)
    G: int = 4            # global batch (sequences)
    mb: int = 2           # suggested micro batch
    S: int = 10           # optimizer steps
    seed: int = 1234
    # optimizer / schedule
    max_lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 2
    lr_decay_iters: int = 0   # 0: = S
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 0.0    # 0: chosen by a dry run so that clipping is active on some steps only
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.g == 0: object.__setattr__(self, "g", self.n)
        if self.P == 0: object.__setattr__(self, "P", self.T)
        if self.lr_decay_iters == 0: object.__setattr__(self, "lr_decay_iters", self.S)
        assert self.flavor in FLAVORS, self.flavor
        assert self.h % self.n == 0 and self.n % self.g == 0 and self.G % self.mb == 0
        assert self.T <= self.P and self.Vp > 64

    @property
    def d(self):          # head dim (kv channels)
        return self.h // self.n


CONFIGS = {
    "gpt2_tiny": Config(L=2, h=64, n=4, f=256, Vp=512, T=32, G=4, mb=2, S=10),
    # Meant as L=3, h=128, f=512, Vp=1024 but that is ~9 MB (the three parameter copies dominate, not
    # the logits); this keeps head dim 64, T=64, mb=1 (4 micro-batches) and f != h at ~3.9 MB.
    "gpt2_small": Config(L=2, h=128, n=2, f=256, Vp=256, T=64, G=4, mb=1, S=6),
}


def f32(x):
    """Round a Python float to float32 and back: the value the file (and so the C side) holds."""
    return float(np.float32(x))


# ------------------------------------------------------------------------------------------------
# Parameters: names, shapes, init, weight decay, in canonical order (flavor dispatch)
# ------------------------------------------------------------------------------------------------

# init kinds: "normal" N(0, std), "normal_scaled" N(0, std/sqrt(2L)), "bias" N(0, std),
#             "norm_w" 1 + N(0, 0.1), "norm_b" N(0, 0.05)
def param_specs(cfg):
    """[(name, shape, init kind, weight decay?)] in canonical file order."""
    L, h, f, Vp, P = cfg.L, cfg.h, cfg.f, cfg.Vp, cfg.P
    qkv = (cfg.n + 2 * cfg.g) * cfg.d
    if cfg.flavor == "gpt2":
        return [
            ("word_embeddings",     (Vp, h),          "normal",        True),
            ("position_embeddings", (P, h),           "normal",        True),
            ("ln1_weight",          (L, h),           "norm_w",        False),
            ("ln1_bias",            (L, h),           "norm_b",        False),
            ("qkv_weight",          (L, qkv, h),      "normal",        True),
            ("qkv_bias",            (L, qkv),         "bias",          False),
            ("proj_weight",         (L, h, cfg.n * cfg.d), "normal_scaled", True),
            ("proj_bias",           (L, h),           "bias",          False),
            ("ln2_weight",          (L, h),           "norm_w",        False),
            ("ln2_bias",            (L, h),           "norm_b",        False),
            ("fc1_weight",          (L, f, h),        "normal",        True),
            ("fc1_bias",            (L, f),           "bias",          False),
            ("fc2_weight",          (L, h, f),        "normal_scaled", True),
            ("fc2_bias",            (L, h),           "bias",          False),
            ("final_ln_weight",     (h,),             "norm_w",        False),
            ("final_ln_bias",       (h,),             "norm_b",        False),
        ]
    raise NotImplementedError(cfg.flavor)


def num_params(cfg):
    return sum(int(np.prod(s)) for _, s, _, _ in param_specs(cfg))


def init_params(cfg):
    """Deterministic initial weights (float64 tensors holding float32-representable values)."""
    rng = np.random.default_rng(cfg.seed)
    std = cfg.init_std
    out = {}
    for name, shape, kind, _ in param_specs(cfg):
        if kind == "normal":
            a = rng.normal(0.0, std, shape)
        elif kind == "normal_scaled":
            a = rng.normal(0.0, std / math.sqrt(2.0 * cfg.L), shape)
        elif kind == "bias":
            a = rng.normal(0.0, std, shape)
        elif kind == "norm_w":
            a = 1.0 + rng.normal(0.0, 0.1, shape)
        elif kind == "norm_b":
            a = rng.normal(0.0, 0.05, shape)
        else:
            raise ValueError(kind)
        out[name] = torch.from_numpy(a.astype(np.float32).astype(np.float64))
    return out


def flatten(cfg, tensors):
    return np.concatenate([tensors[name].detach().numpy().reshape(-1) for name, _, _, _ in param_specs(cfg)])


def unflatten(cfg, flat):
    out, off = {}, 0
    for name, shape, _, _ in param_specs(cfg):
        k = int(np.prod(shape))
        out[name] = torch.from_numpy(np.asarray(flat[off:off + k], dtype=np.float64).reshape(shape).copy())
        off += k
    assert off == len(flat)
    return out


# ------------------------------------------------------------------------------------------------
# The model, written out by hand (float64)
# ------------------------------------------------------------------------------------------------

def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)      # biased variance, as nn.LayerNorm
    return (x - mu) / torch.sqrt(var + eps) * w + b


def gelu_tanh(z):
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def split_qkv(cfg, qkv):
    """[B, T, (n+2g)d] in Megatron's grouped layout -> q [B, n, T, d], k, v [B, g, T, d]."""
    B, T, _ = qkv.shape
    n, g, d = cfg.n, cfg.g, cfg.d
    x = qkv.view(B, T, g, (n // g + 2) * d)
    q = x[..., : (n // g) * d].reshape(B, T, n, d)
    k = x[..., (n // g) * d: (n // g + 1) * d]
    v = x[..., (n // g + 1) * d:]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def causal_attention(q, k, v):
    """Plain softmax attention, scale 1/sqrt(d), causal. q [B, n, T, d], k, v [B, g, T, d]."""
    n, g, T, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    if g != n:                                   # GQA: each group serves n/g consecutive heads
        k = k.repeat_interleave(n // g, dim=1)
        v = v.repeat_interleave(n // g, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p @ v


class Pieces:
    """The building blocks the forward pass is made of; the self-test swaps in torch's own."""
    layer_norm = staticmethod(layer_norm)
    gelu = staticmethod(gelu_tanh)
    attention = staticmethod(causal_attention)


class TorchPieces:
    layer_norm = staticmethod(lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps))
    gelu = staticmethod(lambda z: F.gelu(z, approximate="tanh"))

    @staticmethod
    def attention(q, k, v):
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forward(cfg, p, tokens, pieces=Pieces):
    """tokens int64 [B, T] -> logits [B, T, Vp]. p: dict name -> tensor (flavor dispatch below)."""
    B, T = tokens.shape
    assert cfg.flavor == "gpt2"
    x = p["word_embeddings"][tokens] + p["position_embeddings"][:T].unsqueeze(0)
    for l in range(cfg.L):
        a = pieces.layer_norm(x, p["ln1_weight"][l], p["ln1_bias"][l], cfg.norm_eps)
        qkv = a @ p["qkv_weight"][l].T + p["qkv_bias"][l]
        q, k, v = split_qkv(cfg, qkv)
        o = pieces.attention(q, k, v)                        # [B, n, T, d]
        o = o.transpose(1, 2).reshape(B, T, cfg.n * cfg.d)   # heads concatenated in order
        x = x + (o @ p["proj_weight"][l].T + p["proj_bias"][l])
        m = pieces.layer_norm(x, p["ln2_weight"][l], p["ln2_bias"][l], cfg.norm_eps)
        z = pieces.gelu(m @ p["fc1_weight"][l].T + p["fc1_bias"][l])
        x = x + (z @ p["fc2_weight"][l].T + p["fc2_bias"][l])
    y = pieces.layer_norm(x, p["final_ln_weight"], p["final_ln_bias"], cfg.norm_eps)
    return y @ p["word_embeddings"].T                         # tied output layer, all Vp columns


def cross_entropy(logits, labels):
    """Mean over all tokens of -log softmax(logits)[label]."""
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()


def loss_and_grads(cfg, params, batch, pieces=Pieces):
    """batch int32 [G, T+1] -> (loss, {name: grad}, logits)."""
    t = torch.from_numpy(batch.astype(np.int64))
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    logits = forward(cfg, p, t[:, :-1], pieces)
    loss = cross_entropy(logits, t[:, 1:])
    names = [s[0] for s in param_specs(cfg)]
    grads = torch.autograd.grad(loss, [p[k] for k in names])
    return loss.item(), dict(zip(names, grads)), logits.detach()


# ------------------------------------------------------------------------------------------------
# Optimizer: Megatron's sample-counted schedule, global-norm clipping, FusedAdam (adam_w_mode)
# ------------------------------------------------------------------------------------------------

def hyper(cfg):
    """The hyper-parameters as the file holds them (float32-rounded)."""
    return dict(max_lr=f32(cfg.max_lr), min_lr=f32(cfg.min_lr), b1=f32(cfg.b1), b2=f32(cfg.b2),
                eps=f32(cfg.eps), weight_decay=f32(cfg.weight_decay), clip_grad=f32(cfg.clip_grad),
                norm_eps=f32(cfg.norm_eps))


def learning_rate(cfg, num_steps):
    hp = hyper(cfg)
    max_lr, min_lr = hp["max_lr"], hp["min_lr"]
    warmup = cfg.lr_warmup_iters * cfg.G
    decay = cfg.lr_decay_iters * cfg.G
    if warmup > 0 and num_steps <= warmup:
        return 0.0 + (max_lr - 0.0) * float(num_steps) / float(warmup)
    if num_steps > decay:
        return min_lr
    ratio = float(num_steps - warmup) / float(decay - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def train(cfg, params0, tokens):
    """Runs S steps. Returns (losses, grad_norms, lrs, final params dict)."""
    hp = hyper(cfg)
    specs = param_specs(cfg)
    p = {k: v.clone() for k, v in params0.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    losses, norms, lrs = [], [], []
    for k in range(cfg.S):
        loss, grads, _ = loss_and_grads(cfg, p, tokens[k])
        norm = math.sqrt(sum(float((gr ** 2).sum()) for gr in grads.values()))
        if hp["clip_grad"] > 0:
            coeff = hp["clip_grad"] / (norm + 1e-6)
            if coeff < 1.0:
                grads = {n: gr * coeff for n, gr in grads.items()}
        lr = learning_rate(cfg, k * cfg.G)
        t = k + 1
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        for name, _, _, decay in specs:
            gr = grads[name]
            wd = hp["weight_decay"] if decay else 0.0
            m[name] = b1 * m[name] + (1 - b1) * gr
            v2[name] = b2 * v2[name] + (1 - b2) * gr * gr
            mhat = m[name] / (1 - b1 ** t)
            vhat = v2[name] / (1 - b2 ** t)
            p[name] = p[name] - lr * (mhat / (torch.sqrt(vhat) + eps) + wd * p[name])
        losses.append(loss); norms.append(norm); lrs.append(lr)
    return losses, norms, lrs, p


def make_tokens(cfg):
    rng = np.random.default_rng(cfg.seed + 1)
    return rng.integers(0, cfg.Vp - 64, size=(cfg.S, cfg.G, cfg.T + 1)).astype(np.int32)


def choose_clip(cfg, params0, tokens):
    """A clip_grad that clips some steps and not others, as far as possible from every step's norm
    (so that the C side's rounding cannot flip a decision). Iterates because clipping changes the path."""
    _, norms, _, _ = train(replace(cfg, clip_grad=0.0), params0, tokens)
    best = None
    for _ in range(6):
        cands = sorted(norms)
        # candidates: geometric midpoints between neighbouring norms, rounded to 2 significant digits
        opts = []
        for a, b in zip(cands, cands[1:]):
            c = math.sqrt(a * b)
            c = float(f"{c:.2g}")
            below = sum(x < c for x in norms)
            if below >= 2 and len(norms) - below >= 2:
                margin = min(abs(x - c) / c for x in norms)
                balance = min(below, len(norms) - below)
                opts.append((min(margin, 0.05) + 0.01 * balance, c))
        if not opts:
            c = float(f"{float(np.median(norms)):.2g}")
        else:
            c = max(opts)[1]
        _, new_norms, _, _ = train(replace(cfg, clip_grad=c), params0, tokens)
        clipped = sum(x > c for x in new_norms)
        margin = min(abs(x - c) / c for x in new_norms)
        if 2 <= clipped <= len(new_norms) - 2 and margin > 0.01:
            return c, new_norms
        best = (c, new_norms) if best is None else best
        norms = new_norms
    return best


# ------------------------------------------------------------------------------------------------
# Writing and checking files
# ------------------------------------------------------------------------------------------------

def header_arrays(cfg):
    hd = np.zeros(HEADER_INTS, dtype="<i4")
    hd[:15] = [MAGIC, VERSION, FLAVORS[cfg.flavor], cfg.L, cfg.h, cfg.n, cfg.f, cfg.Vp, cfg.P, cfg.T,
               cfg.G, cfg.mb, cfg.S, num_params(cfg), cfg.g]
    hp = np.zeros(HYPER_FLOATS, dtype="<f4")
    hp[:10] = [cfg.max_lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.lr_decay_iters, cfg.b1, cfg.b2, cfg.eps,
               cfg.weight_decay, cfg.clip_grad, cfg.norm_eps]
    return hd, hp


def generate(name, cfg, out_dir=OUT_DIR):
    params0 = init_params(cfg)
    tokens = make_tokens(cfg)
    if cfg.clip_grad == 0.0:
        clip, _ = choose_clip(cfg, params0, tokens)
        cfg = replace(cfg, clip_grad=clip)
    loss0, grads0, logits = loss_and_grads(cfg, params0, tokens[0])
    losses, norms, lrs, pfin = train(cfg, params0, tokens)
    assert abs(losses[0] - loss0) < 1e-12
    hd, hp = header_arrays(cfg)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".bin")
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(hd.tobytes()); fh.write(hp.tobytes())
        fh.write(flatten(cfg, params0).astype("<f4").tobytes())
        fh.write(tokens.astype("<i4").tobytes())
        fh.write(logits.numpy().astype("<f4").tobytes())
        fh.write(np.array([loss0], dtype="<f4").tobytes())
        fh.write(flatten(cfg, grads0).astype("<f4").tobytes())
        fh.write(np.array(losses, dtype="<f4").tobytes())
        fh.write(np.array(norms, dtype="<f4").tobytes())
        fh.write(np.array(lrs, dtype="<f4").tobytes())
        fh.write(flatten(cfg, pfin).astype("<f4").tobytes())
    os.replace(tmp, path)
    print(f"{path}: {os.path.getsize(path)} bytes, {num_params(cfg)} params, clip_grad {cfg.clip_grad}")
    print(f"  losses     {' '.join(f'{x:.6f}' for x in losses)}")
    print(f"  grad norms {' '.join(f'{x:.5f}' for x in norms)}  (clipped: "
          f"{sum(x > f32(cfg.clip_grad) for x in norms)}/{cfg.S})")
    print(f"  lrs        {' '.join(f'{x:.3e}' for x in lrs)}")
    return path


def read_file(path):
    """Returns (cfg, dict of arrays). Raises ValueError on a malformed file."""
    raw = open(path, "rb").read()
    if len(raw) < 4 * (HEADER_INTS + HYPER_FLOATS):
        raise ValueError("file shorter than its header")
    hd = np.frombuffer(raw, dtype="<i4", count=HEADER_INTS)
    hp = np.frombuffer(raw, dtype="<f4", count=HYPER_FLOATS, offset=4 * HEADER_INTS)
    if hd[0] != MAGIC or hd[1] != VERSION:
        raise ValueError(f"bad magic/version {hd[0]} {hd[1]}")
    flavor = {v: k for k, v in FLAVORS.items()}[int(hd[2])]
    L, h, n, f, Vp, P, T, G, mb, S, N, g = (int(x) for x in hd[3:15])
    if any(hd[15:]) or any(hp[10:]):
        raise ValueError("reserved header fields not zero")
    cfg = Config(flavor=flavor, L=L, h=h, n=n, g=g, f=f, Vp=Vp, T=T, P=P, G=G, mb=mb, S=S,
                 max_lr=float(hp[0]), min_lr=float(hp[1]), lr_warmup_iters=int(hp[2]),
                 lr_decay_iters=int(hp[3]), b1=float(hp[4]), b2=float(hp[5]), eps=float(hp[6]),
                 weight_decay=float(hp[7]), clip_grad=float(hp[8]), norm_eps=float(hp[9]))
    if num_params(cfg) != N:
        raise ValueError(f"header says {N} params, the shapes give {num_params(cfg)}")
    layout = [("params0", "<f4", N), ("tokens", "<i4", S * G * (T + 1)), ("logits", "<f4", G * T * Vp),
              ("loss0", "<f4", 1), ("grads0", "<f4", N), ("losses", "<f4", S), ("grad_norms", "<f4", S),
              ("lrs", "<f4", S), ("params_final", "<f4", N)]
    off = 4 * (HEADER_INTS + HYPER_FLOATS)
    expect = off + 4 * sum(c for _, _, c in layout)
    if len(raw) != expect:
        raise ValueError(f"size {len(raw)} != expected {expect}")
    arrs = {}
    for name, dt, count in layout:
        arrs[name] = np.frombuffer(raw, dtype=dt, count=count, offset=off)
        off += 4 * count
    arrs["tokens"] = arrs["tokens"].reshape(S, G, T + 1)
    arrs["logits"] = arrs["logits"].reshape(G, T, Vp)
    return cfg, arrs


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check(path):
    cfg, a = read_file(path)
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    print(f"{path}: {cfg.flavor} L={cfg.L} h={cfg.h} n={cfg.n} g={cfg.g} f={cfg.f} Vp={cfg.Vp} T={cfg.T} "
          f"G={cfg.G} mb={cfg.mb} S={cfg.S} N={num_params(cfg)} clip_grad={cfg.clip_grad}")
    expect(all(np.isfinite(v).all() for k, v in a.items() if k != "tokens"), "every float finite")
    expect(a["tokens"].min() >= 0 and a["tokens"].max() < cfg.Vp - 64, "tokens in [0, Vp-64)")
    expect(a["loss0"][0] == a["losses"][0], "loss0 == losses[0]")
    expect(a["losses"][-1] < a["losses"][0], f"loss decreases ({a['losses'][0]:.5f} -> {a['losses'][-1]:.5f})")
    gn = math.sqrt(float((a["grads0"].astype(np.float64) ** 2).sum()))
    expect(abs(gn - a["grad_norms"][0]) / gn < 1e-5, "|grads0| == grad_norms[0]")
    clipped = int((a["grad_norms"] > cfg.clip_grad).sum())
    expect(0 < clipped < cfg.S, f"clipping active on {clipped}/{cfg.S} steps")
    lrs = [learning_rate(cfg, k * cfg.G) for k in range(cfg.S)]
    expect(rel_err(a["lrs"], lrs) < 1e-6, "lrs follow the schedule")
    expect(not np.array_equal(a["params0"], a["params_final"]), "params moved")
    # recompute everything from params0 + tokens + hyper-parameters
    p0 = unflatten(cfg, a["params0"])
    loss0, grads0, logits = loss_and_grads(cfg, p0, a["tokens"][0])
    expect(rel_err(a["logits"], logits.numpy()) < 1e-6, f"logits recomputed (rel {rel_err(a['logits'], logits.numpy()):.1e})")
    expect(abs(a["loss0"][0] - loss0) / loss0 < 1e-6, "loss0 recomputed")
    expect(rel_err(a["grads0"], flatten(cfg, grads0)) < 1e-6, "grads0 recomputed")
    losses, norms, _, pfin = train(cfg, p0, a["tokens"])
    expect(rel_err(a["losses"], losses) < 1e-6 and rel_err(a["grad_norms"], norms) < 1e-6, "losses, norms recomputed")
    expect(rel_err(a["params_final"], flatten(cfg, pfin)) < 1e-6, "params_final recomputed")
    return ok


# ------------------------------------------------------------------------------------------------
# Self-test: the hand-written pieces against torch's, the gradient against finite differences,
# the optimizer against torch.optim.AdamW
# ------------------------------------------------------------------------------------------------

def selftest():
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    for name, cfg in CONFIGS.items():
        print(f"selftest {name}")
        params = init_params(cfg)
        batch = make_tokens(cfg)[0]
        t = torch.from_numpy(batch.astype(np.int64))
        mine = forward(cfg, params, t[:, :-1])
        ref = forward(cfg, params, t[:, :-1], TorchPieces)
        expect(rel_err(mine.numpy(), ref.numpy()) < 1e-12,
               f"forward == SDPA/F.layer_norm/F.gelu version (rel {rel_err(mine.numpy(), ref.numpy()):.1e})")
        # nn.LayerNorm module against the hand-written one
        ln = torch.nn.LayerNorm(cfg.h, eps=cfg.norm_eps)
        with torch.no_grad():
            ln.weight.copy_(params["ln1_weight"][0]); ln.bias.copy_(params["ln1_bias"][0])
        x = torch.randn(3, cfg.h)
        expect(rel_err(layer_norm(x, params["ln1_weight"][0], params["ln1_bias"][0], cfg.norm_eps).numpy(),
                       ln(x).detach().numpy()) < 1e-12, "layer_norm == nn.LayerNorm")
        # the grouped QKV layout, head by head
        qkv = torch.arange(cfg.T * 3 * cfg.h, dtype=torch.float64).view(1, cfg.T, 3 * cfg.h)
        q, k, v = split_qkv(cfg, qkv)
        d, i = cfg.d, cfg.n - 1
        expect(torch.equal(q[0, i], qkv[0, :, i * 3 * d: i * 3 * d + d]) and
               torch.equal(k[0, i], qkv[0, :, i * 3 * d + d: i * 3 * d + 2 * d]) and
               torch.equal(v[0, i], qkv[0, :, i * 3 * d + 2 * d: i * 3 * d + 3 * d]), "grouped qkv layout")
        loss_a = cross_entropy(mine, t[:, 1:]).item()
        loss_b = F.cross_entropy(ref.reshape(-1, cfg.Vp), t[:, 1:].reshape(-1)).item()
        expect(abs(loss_a - loss_b) < 1e-12, f"cross_entropy == F.cross_entropy ({loss_a:.8f})")
        # gradient vs central finite differences on a few coordinates of every tensor
        loss, grads, _ = loss_and_grads(cfg, params, batch)
        rng = np.random.default_rng(0)
        worst = 0.0
        for pname, shape, _, _ in param_specs(cfg):
            for _ in range(3):
                idx = tuple(int(rng.integers(0, s)) for s in shape)
                if pname == "word_embeddings" and _ == 0:
                    idx = (cfg.Vp - 1, idx[1])             # a padding row: gradient only via the softmax
                e = 1e-5
                pp = {kk: vv.clone() for kk, vv in params.items()}
                pp[pname][idx] += e
                lp = cross_entropy(forward(cfg, pp, t[:, :-1]), t[:, 1:]).item()
                pp[pname][idx] -= 2 * e
                lm = cross_entropy(forward(cfg, pp, t[:, :-1]), t[:, 1:]).item()
                fd = (lp - lm) / (2 * e)
                an = grads[pname][idx].item()
                # tolerance: relative, with an absolute floor for tiny entries (FD noise ~1e-10)
                worst = max(worst, abs(fd - an) / (abs(an) + 1e-5))
        expect(worst < 1e-5, f"gradient == finite differences on {3 * len(param_specs(cfg))} coordinates "
                             f"(worst |fd-an|/(|an|+1e-5) {worst:.1e})")
    # AdamW: our update against torch.optim.AdamW (same math: decoupled decay on the old p)
    cfg = replace(CONFIGS["gpt2_tiny"], S=3, clip_grad=1e9)
    params = init_params(cfg)
    tokens = make_tokens(cfg)
    _, _, lrs, pfin = train(cfg, params, tokens)
    hp = hyper(cfg)
    tp = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    groups = [{"params": [tp[nm] for nm, _, _, dcy in param_specs(cfg) if dcy], "weight_decay": hp["weight_decay"]},
              {"params": [tp[nm] for nm, _, _, dcy in param_specs(cfg) if not dcy], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(hp["b1"], hp["b2"]), eps=hp["eps"])
    for k in range(cfg.S):
        _, grads, _ = loss_and_grads(cfg, {kk: vv.detach() for kk, vv in tp.items()}, tokens[k])
        for nm in tp:
            tp[nm].grad = grads[nm]
        for gr in opt.param_groups:
            gr["lr"] = lrs[k]
        opt.step()
    e = rel_err(flatten(cfg, pfin), flatten(cfg, tp))
    expect(e < 1e-12, f"AdamW == torch.optim.AdamW over {cfg.S} steps (rel {e:.1e})")
    print("selftest", "passed" if ok else "FAILED")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--check", nargs="+", metavar="FILE", help="verify vector files")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), help="write only these configurations")
    ap.add_argument("--out", default=OUT_DIR)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.selftest:
        sys.exit(0 if selftest() else 1)
    if args.check:
        sys.exit(0 if all([check(p) for p in args.check]) else 1)
    for name in args.only or CONFIGS:
        generate(name, CONFIGS[name], args.out)


if __name__ == "__main__":
    main()
