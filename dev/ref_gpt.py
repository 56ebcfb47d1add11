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
                                               # (and, where importable, transformers' LlamaForCausalLM)

Only torch (CPU is enough) and numpy are needed; the self-test also uses transformers when it is there.

Model, flavor "gpt2" (flavor code 0)
------------------------------------
L layers, hidden h, n heads, g = n query groups, head dim d = h/n, ffn f, padded vocab Vp, seq length T,
P = T position embeddings. No dropout. (Config fields: norm "layernorm", swiglu False, position
"learned", untied False, bias True; kv 0 means d = h/n.)
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
     (qk_layernorm only: q_layernorm_weight [L, d], q_layernorm_bias [L, d],
                         k_layernorm_weight [L, d], k_layernorm_bias [L, d]; the biases with LayerNorm)
   7 proj_weight [L, h, h]           8 proj_bias [L, h]
   9 ln2_weight [L, h]              10 ln2_bias [L, h]
  11 fc1_weight [L, f, h]           12 fc1_bias [L, f]
  13 fc2_weight [L, h, f]           14 fc2_bias [L, h]
  15 final_ln_weight [h]            16 final_ln_bias [h]
  17 output_weight [Vp, h]          (untied only)
Tensors a configuration does not have are skipped (see the llama flavor below), the rest keep this order.

Initial weights (numpy default_rng(seed), never zeros): Normal(0, 0.02) for matrices and embeddings,
proj and fc2 Normal(0, 0.02/sqrt(2L)); biases Normal(0, 0.02); LayerNorm weights 1 + Normal(0, 0.1);
LayerNorm biases Normal(0, 0.05). They are rounded to float32 *before* anything is computed, so the
float32 params0 in the file is exactly the starting point. The float hyper-parameters are likewise
rounded to float32 (what the file holds) before use, except norm_eps, which generation uses as given
(1e-5; its float32 rounding moves the float64 logits by ~3e-10 relative, far below float32 resolution).
output_weight (untied) is Normal(0, 0.02); RMSNorm weights are "norm weights" like LayerNorm's.

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
           wd_p = weight_decay for 2-D weights, both embeddings and output_weight; 0 for biases and
           norm weights/biases.
Tokens are uniform in [0, Vp-64), so the top 64 padded columns never appear as labels (with zipf > 0:
Zipf-distributed over the same range, a config field that the file does not record: its tokens are stored).

File format, dev/data/gpt_vectors/<name>.bin, little-endian
-----------------------------------------------------------
header int32[256]:
  [0] magic 20261121  [1] version 1  [2] flavor (0 = gpt2, 1 = llama)  [3] L  [4] h  [5] n heads  [6] f
  [7] Vp  [8] P  [9] T  [10] G global batch  [11] suggested micro batch mb  [12] S steps
  [13] number of parameter floats  [14] g query groups (= n for gpt2)
  [15] kv channels d (0 in gpt2 files: d = h/n)  [16] normalization (0 LayerNorm, 1 RMSNorm)
  [17] swiglu (0/1)  [18] position type (0 learned, 1 rope, 2 none)  [19] untied output (0/1)
  [20] disable_bias (0 biases present, 1 none)  [21] use_rope_scaling (0/1)
  [22] layernorm_1p (0/1)  [23] eod + 1 (0: no loss mask)  [24] the dropout seed (0 without dropout)
  [25] squared_relu (0/1)  [26] qk_layernorm (0/1)
  [27] reset_position_ids (0/1)  [28] reset_attention_mask (0/1)  [29] the documents' eod + 1 (0 without resets)
  [30..255] 0
  (words 15..29 are all 0 for gpt2, so files written before they existed read the same)
hyper float32[64]:
  [0] max_lr  [1] min_lr  [2] lr_warmup_iters  [3] lr_decay_iters  [4] b1  [5] b2  [6] eps
  [7] weight_decay  [8] clip_grad  [9] norm eps  [10] rotary_base  [11] rotary_percent
  [12] rope_scaling_factor (0: no scaling)  [13] hidden_dropout  [14] attention_dropout  [15..63] 0
  (10..12 are 0 without rope)
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

Model, flavor "llama" (flavor code 1)
-------------------------------------
The gpt2 model with these Megatron switches, each a Config field of its own (the flavor sets them all):
  norm = "rmsnorm"   (--normalization RMSNorm) every LN(x) becomes x / sqrt(mean(x^2) + eps) * w, no bias
  swiglu = True      (--swiglu) fc1 is [2f, h]: z = m @ Wfc1^T; act = silu(z[..., :f]) * z[..., f:]
                     (gate rows first, then up rows); fc2 [h, f]; silu(z) = z * sigmoid(z)
  position = "rope"  (--position-embedding-type rope) no position_embeddings; after the QKV split, q and k
                     of every head are rotated, positions t = 0..T-1 of each sequence, non-interleaved
                     (rotate_half) form on the first rot = int(d * rotary_percent) dims:
                       inv_freq[i] = rotary_base^(-2i/rot), i < rot/2; angle[t, i] = t * inv_freq[i]
                       x1 = x[:rot/2], x2 = x[rot/2:rot]: out = cat(x1 cos - x2 sin, x2 cos + x1 sin, x[rot:])
                     rope_scaling_factor > 0 (--use-rope-scaling, Llama 3.1; HF rope_type "llama3"; low 1,
                     high 4, original max positions 8192): wavelen = 2 pi / inv_freq; wavelen < 2048: keep;
                     > 8192: inv_freq / factor; else s = (8192/wavelen - 1)/3,
                     inv_freq = (1-s) inv_freq/factor + s inv_freq. All in float64.
  untied = True      (--untie-embeddings-and-output-weights) logits = y @ output_weight^T, [Vp, h]
  bias = False       (--disable-bias-linear) no qkv/proj/fc1/fc2 biases
  kv                 (--kv-channels) head dim d, may differ from h/n: qkv [(n+2g)d, h], proj [h, n*d]
GQA as above (g groups; each group serves n/g consecutive heads). The canonical order is gpt2's without
position_embeddings and every *_bias, plus output_weight: word_embeddings, ln1_weight, qkv_weight,
proj_weight, ln2_weight, fc1_weight [L, 2f, h], fc2_weight, final_ln_weight, output_weight.
The self-test checks the forward pass against transformers' LlamaForCausalLM (q/k/v_proj cut from the
grouped QKV rows, gate/up_proj = fc1 rows [:f]/[f:], HF's float32 casts lifted to float64) to ~1e-15.

Comparing against it (gpt2, without qk_layernorm, whose key norm makes it a real gradient): the gradient of
the key biases (rows [i*3d+d, i*3d+2d) of qkv_bias) is zero in exact arithmetic (softmax is shift-invariant
per query), here ~1e-20; in fp32 it is rounding noise
that Adam (eps 1e-8) can turn into updates of up to ~lr per step, so compare params_final with an
absolute tolerance of a few lr there (or skip those entries). Steps 0 and 1 see the same weights
(step 0's lr is 0).

Switches of Megatron's functional-test configurations (any flavor; header words 25, 26):
  squared_relu       (--squared-relu) the MLP's activation is relu(z)^2 instead of gelu_tanh (not with swiglu)
  qk_layernorm       (--qk-layernorm, Megatron-Core's q_layernorm / k_layernorm) after the QKV split, every
                     query head q_i [d] becomes norm(q_i) with q_layernorm_weight (and _bias with LayerNorm),
                     every key head k_j norm(k_j) with k_layernorm_weight/_bias: the model's norm kind, eps
                     and layernorm_1p, one weight per kind shared by all heads; rope rotates the results.
                     Init as the other norms' (norm_w, norm_b).

Switches of train_gpt's launch-script flags (any flavor; header words 18, 22, 23):
  position = "none"  (--position-embedding-type none, NoPE) neither position_embeddings nor rope
  layernorm_1p       (--apply-layernorm-1p) every norm weight tensor holds w - 1 and the norms use 1 + w;
                     its initial values are N(0, 0.1) (the same spread around the same effective weight)
  eod = e >= 0       (--eod-mask-loss, end-of-document id e) a position counts unless its *input* token is
                     e; the gradient is that of Megatron's objective, the mean over the G/mb micro-batches
                     of each one's sum(loss * mask) / sum(mask); loss0 and losses are the reported loss,
                     sum(loss * mask) / sum(mask) over the whole batch. Tokens hold e at ~1 in 8 positions.

Documents (--reset-position-ids, --reset-attention-mask; header words 27-29), with the end-of-document id
e = doc_eod (or eod when doc_eod < 0), as Megatron's gpt_dataset._get_ltor_masks_and_position_ids runs on
each sequence's inputs: for each position i holding e, in order, with reset_attention_mask the mask rows
after i lose the columns up to i (the eod belongs to the document it ends), and with reset_position_ids
the positions after i drop by i + 1 - prev (prev = the previous such i + 1, first 0): positions restart
at 0 at i + 1. The learned table is read at those positions, RoPE rotates by them; attention keeps the
causal mask and the document mask together (masked scores are -inf before the softmax, so dropout sees
probability 0 there). Tokens hold e at ~1 in 8 positions, and at input position 0 of sequence 0, the
last input position of sequence 1, two in a row in sequence 3; sequence 2 holds none.

Dropout (--hidden-dropout, --attention-dropout; header word 24, hyper 13-14): Megatron's four sites,
each x -> x * keep / (1 - p) in training, with megatron.c's masks (megatron.cu section 5), so that the
C side can be compared element for element:
  x = dropout_emb(wte[token] + wpe[position])                       (hidden p)
  o = dropout_attn(softmax(causal(q k^T / sqrt(d)))) v               (attention p; LSE/softmax are P's)
  x = x + dropout_proj(o @ Wproj^T + bproj);  x = x + dropout_fc2(mlp(m) @ Wfc2^T + bfc2)   (hidden p)
The mask bits: key = stream(seed, iteration, layer, site) (splitmix64 chain, site 0 embeddings with
layer -1, 1 attention, 2 proj, 3 fc2); element bits = splitmix64(key + counter * 0x9E3779B97F4A7C15),
the low 32 bits for an even column, the high 32 for an odd one, kept when >= round(p * 2^32), scaled by
float32(1 / (1 - p)). Counters: hidden [G*T, h] row r = g*T + t, column c: r * ceil(h/2) + c // 2;
attention [G, n, T, T]: ((g*n + head) * T + q) * ceil(T/2) + k // 2. g is the sample's number in the
step's global batch and the iteration is the step k, so micro-batching does not change the masks.
logits are written without dropout (evaluation); loss0, grads0 and the steps with it.

Adding a flavor: give it a code in FLAVORS and its switches in FLAVOR_SWITCHES; a new switch needs its
tensors in param_specs(), its piece in forward() (both marked "flavor dispatch") and a header word.
"""
import argparse
import contextlib
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
FLAVORS = {"gpt2": 0, "llama": 1}
# What each flavor sets the model switches to (every switch can still be given on its own).
FLAVOR_SWITCHES = {
    "gpt2":  dict(norm="layernorm", swiglu=False, position="learned", untied=False, bias=True),
    "llama": dict(norm="rmsnorm",   swiglu=True,  position="rope",    untied=True,  bias=False),
}
NORMS = {"layernorm": 0, "rmsnorm": 1}
POSITIONS = {"learned": 0, "rope": 1, "none": 2}
# Llama-3.1 RoPE scaling constants (HF "llama3" rope type, Megatron's apply_rope_scaling)
ROPE_LOW_FREQ_FACTOR, ROPE_HIGH_FREQ_FACTOR, ROPE_ORIG_MAX_POS = 1.0, 4.0, 8192
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt_vectors")

torch.set_default_dtype(torch.float64)


def f32(x):
    """Round a Python float to float32 and back: the value the file (and so the C side) holds."""
    return float(np.float32(x))


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
    zipf: float = 0.0     # > 0: tokens drawn from a Zipf law of this exponent (make_tokens; not in the file's header)
    kv: int = 0           # kv channels = head dim d (0: = h // n)
    # model switches (None: the flavor's, see FLAVOR_SWITCHES)
    norm: str = None      # "layernorm" | "rmsnorm"
    swiglu: bool = None   # fc1 [2f, h], act = silu(gate) * up
    position: str = None  # "learned" (position_embeddings) | "rope" | "none" (NoPE)
    untied: bool = None   # separate output_weight
    bias: bool = None     # linear biases (qkv, proj, fc1, fc2)
    layernorm_1p: bool = False  # --apply-layernorm-1p: norm weights hold w - 1, the norms use (1 + w)
    squared_relu: bool = False  # --squared-relu: act = relu(z)^2 (not with swiglu)
    qk_layernorm: bool = False  # --qk-layernorm: q and k heads normalised after the split, before rope
    eod: int = -1         # --eod-mask-loss with this end-of-document id (-1: every position counts)
    reset_position_ids: bool = False    # --reset-position-ids (documents end at doc_eod, or eod)
    reset_attention_mask: bool = False  # --reset-attention-mask
    doc_eod: int = -1     # the documents' end-of-document id (-1: eod's)
    hidden_dropout: float = 0.0     # --hidden-dropout (embeddings, proj and fc2 branches)
    attention_dropout: float = 0.0  # --attention-dropout (the attention probabilities)
    # rope (hyper[10..12]; 0 in files without rope)
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling_factor: float = 0.0   # > 0: Llama-3.1 scaling with this factor
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
        assert self.flavor in FLAVORS, self.flavor
        if self.g == 0: object.__setattr__(self, "g", self.n)
        if self.P == 0: object.__setattr__(self, "P", self.T)
        if self.lr_decay_iters == 0: object.__setattr__(self, "lr_decay_iters", self.S)
        for k, v in FLAVOR_SWITCHES[self.flavor].items():
            if getattr(self, k) is None: object.__setattr__(self, k, v)
        assert self.norm in NORMS and self.position in POSITIONS, (self.norm, self.position)
        assert (self.kv > 0 or self.h % self.n == 0) and self.n % self.g == 0 and self.G % self.mb == 0
        assert self.T <= self.P and self.Vp > 64
        assert not (self.squared_relu and self.swiglu), "squared_relu and swiglu exclude each other"
        if self.reset_position_ids or self.reset_attention_mask:
            assert self.doc_end >= 0, "the resets need an end-of-document id"
        if self.position == "rope":
            assert self.rotary_base > 0 and 0 < self.rotary_percent <= 1 and self.rope_scaling_factor >= 0
            assert self.rot > 0 and self.rot % 2 == 0, self.rot

    @property
    def d(self):          # head dim (kv channels)
        return self.kv if self.kv else self.h // self.n

    @property
    def f1(self):         # fc1 rows: [gate; up] with swiglu
        return 2 * self.f if self.swiglu else self.f

    @property
    def docs(self):       # documents change positions or the mask
        return self.reset_position_ids or self.reset_attention_mask

    @property
    def doc_end(self):    # the documents' end-of-document id
        return self.doc_eod if self.doc_eod >= 0 else self.eod

    @property
    def rot(self):        # rotary dims per head (rope)
        return int(self.d * f32(self.rotary_percent))


CONFIGS = {
    "gpt2_tiny": Config(L=2, h=64, n=4, f=256, Vp=512, T=32, G=4, mb=2, S=10),
    # Meant as L=3, h=128, f=512, Vp=1024 but that is ~9 MB (the three parameter copies dominate, not
    # the logits); this keeps head dim 64, T=64, mb=1 (4 micro-batches) and f != h at ~3.9 MB.
    "gpt2_small": Config(L=2, h=128, n=2, f=256, Vp=256, T=64, G=4, mb=1, S=6),
    # GQA (2 groups of 2 heads), d = 16, Llama-3.1 rope scaling with d = 16 hitting all three branches
    # (keep i <= 5, smooth i = 6, divide i = 7)
    "llama_tiny": Config(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=512, T=32, G=4, mb=2, S=10,
                         rotary_base=10000.0, rotary_percent=1.0, rope_scaling_factor=8.0),
    # MQA (1 group), kv channels 64 so attention width n*d = 128 != h, partial rotary (32 of 64 dims)
    "llama_small": Config(flavor="llama", L=2, h=64, n=2, g=1, kv=64, f=128, Vp=256, T=64, G=4, mb=1, S=6,
                          rotary_base=500000.0, rotary_percent=0.5, rope_scaling_factor=0.0),
    # train_gpt's launch-script flags that change the model or the loss (tests/test_flags.h):
    # --eod-mask-loss, with micro-batches of different counted positions, and NoPE (--position-embedding-type none);
    "gpt2_eod_nope": Config(L=2, h=64, n=4, f=256, Vp=512, T=32, G=4, mb=2, S=6, position="none", eod=447),
    "llama_eod": Config(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=512, T=32, G=4, mb=1, S=10, eod=0),
    # --apply-layernorm-1p on LayerNorm (weights and biases) and on RMSNorm
    "gpt2_1p": Config(L=2, h=64, n=4, f=256, Vp=512, T=32, G=4, mb=2, S=6, layernorm_1p=True),
    "llama_1p": Config(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=512, T=32, G=4, mb=2, S=10, layernorm_1p=True),
    # dropout 0.1 at all four sites: GPT-2 with one head of dim 128 and Llama with GQA heads of dim 64
    # (bf16 runs the flash kernels at both head dims), an odd T (attention counters straddle no rows)
    "gpt2_dropout": Config(L=2, h=128, n=1, f=128, Vp=256, T=33, G=4, mb=2, S=6,
                           hidden_dropout=0.1, attention_dropout=0.1),
    "llama_dropout": Config(flavor="llama", L=2, h=64, n=4, g=2, kv=64, f=128, Vp=256, T=32, G=4, mb=1, S=6,
                            rotary_base=500000.0, hidden_dropout=0.1, attention_dropout=0.1),
    # FP8 against float64 (tests/test_fp8.h, calibrated by dev/fp8_calibration.py): every dimension the
    # blockwise recipe casts in 128-blocks is a multiple of 128 (hidden 128, QKV 384, ffn 256, micro-batches
    # of 2 x 64 = 128 tokens), two micro-batches per step, and Zipf-distributed tokens, whose skewed
    # frequencies a model learns fast: the loss falls ~16% in 12 steps (uniform tokens: ~3%)
    "gpt2_fp8": Config(L=2, h=128, n=2, f=256, Vp=256, T=64, G=4, mb=2, S=12, zipf=1.0),
    # Megatron's functional-test switches (issue #32): --squared-relu on GPT-2 (with its biases: the bias
    # is added before the activation), and --qk-layernorm on both flavours, head dim 64 (bf16 runs the
    # flash kernels): GPT-2's LayerNorm with biases (two heads of 64 over hidden 64, learned positions),
    # Llama's RMSNorm with MQA, partial rotary after the norms, and --apply-layernorm-1p's w - 1 weights
    "gpt2_sqrelu": Config(L=2, h=64, n=4, f=128, Vp=256, T=32, G=4, mb=2, S=6, squared_relu=True),
    "gpt2_qkln": Config(L=2, h=64, n=2, kv=64, f=128, Vp=256, T=32, G=4, mb=2, S=6, qk_layernorm=True),
    "llama_qkln": Config(flavor="llama", L=2, h=64, n=2, g=1, kv=64, f=96, Vp=256, T=32, G=4, mb=2, S=6, max_lr=3e-3,
                         rotary_base=500000.0, rotary_percent=0.5, qk_layernorm=True, layernorm_1p=True),
    # documents (issue #36): --reset-position-ids and --reset-attention-mask, head dim 64 (bf16 runs the flash
    # kernels; T = 80 spans two key tiles of 64 and a partial query tile). GPT-2: learned positions read at the
    # reset positions, every loss position counts, attention and hidden dropout 0.1 under the document mask;
    # Llama: RoPE at the reset positions with GQA, and --eod-mask-loss on the same eod.
    "gpt2_docs": Config(L=2, h=128, n=2, f=256, Vp=256, T=80, G=4, mb=2, S=6, reset_position_ids=True,
                        reset_attention_mask=True, doc_eod=7, hidden_dropout=0.1, attention_dropout=0.1),
    "llama_docs": Config(flavor="llama", L=2, h=64, n=4, g=2, kv=64, f=128, Vp=256, T=80, G=4, mb=1, S=6,
                         rotary_base=10000.0, reset_position_ids=True, reset_attention_mask=True, eod=5),
}


# ------------------------------------------------------------------------------------------------
# Parameters: names, shapes, init, weight decay, in canonical order (flavor dispatch)
# ------------------------------------------------------------------------------------------------

# init kinds: "normal" N(0, std), "normal_scaled" N(0, std/sqrt(2L)), "bias" N(0, std),
#             "norm_w" 1 + N(0, 0.1), "norm_b" N(0, 0.05)
def param_specs(cfg):
    """[(name, shape, init kind, weight decay?)] in canonical file order (absent tensors skipped)."""
    L, h, f, Vp, P = cfg.L, cfg.h, cfg.f, cfg.Vp, cfg.P
    qkv = (cfg.n + 2 * cfg.g) * cfg.d
    ln, b, learned = cfg.norm == "layernorm", cfg.bias, cfg.position == "learned"
    specs = [
        ("word_embeddings",     (Vp, h),               "normal",        True,  True),
        ("position_embeddings", (P, h),                "normal",        True,  learned),
        ("ln1_weight",          (L, h),                "norm_w",        False, True),
        ("ln1_bias",            (L, h),                "norm_b",        False, ln),
        ("qkv_weight",          (L, qkv, h),           "normal",        True,  True),
        ("qkv_bias",            (L, qkv),              "bias",          False, b),
        ("q_layernorm_weight",  (L, cfg.d),            "norm_w",        False, cfg.qk_layernorm),
        ("q_layernorm_bias",    (L, cfg.d),            "norm_b",        False, cfg.qk_layernorm and ln),
        ("k_layernorm_weight",  (L, cfg.d),            "norm_w",        False, cfg.qk_layernorm),
        ("k_layernorm_bias",    (L, cfg.d),            "norm_b",        False, cfg.qk_layernorm and ln),
        ("proj_weight",         (L, h, cfg.n * cfg.d), "normal_scaled", True,  True),
        ("proj_bias",           (L, h),                "bias",          False, b),
        ("ln2_weight",          (L, h),                "norm_w",        False, True),
        ("ln2_bias",            (L, h),                "norm_b",        False, ln),
        ("fc1_weight",          (L, cfg.f1, h),        "normal",        True,  True),
        ("fc1_bias",            (L, cfg.f1),           "bias",          False, b),
        ("fc2_weight",          (L, h, f),             "normal_scaled", True,  True),
        ("fc2_bias",            (L, h),                "bias",          False, b),
        ("final_ln_weight",     (h,),                  "norm_w",        False, True),
        ("final_ln_bias",       (h,),                  "norm_b",        False, ln),
        ("output_weight",       (Vp, h),               "normal",        True,  cfg.untied),
    ]
    return [(name, shape, kind, decay) for name, shape, kind, decay, present in specs if present]


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
        elif kind == "norm_w":      # the weight; with layernorm_1p the stored w - 1
            a = (0.0 if cfg.layernorm_1p else 1.0) + rng.normal(0.0, 0.1, shape)
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


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(z):
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def silu(z):
    return z / (1.0 + torch.exp(-z))


def squared_relu(z):
    return torch.where(z > 0, z, torch.zeros_like(z)) ** 2


def rope_inv_freq(cfg):
    """inv_freq [rot/2] (float64), with Llama-3.1 scaling when rope_scaling_factor > 0."""
    rot, base, factor = cfg.rot, f32(cfg.rotary_base), f32(cfg.rope_scaling_factor)
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    if factor > 0:
        lo_wavelen = ROPE_ORIG_MAX_POS / ROPE_LOW_FREQ_FACTOR     # 8192: longer waves are divided
        hi_wavelen = ROPE_ORIG_MAX_POS / ROPE_HIGH_FREQ_FACTOR    # 2048: shorter waves are kept
        out = []
        for fr in inv.tolist():
            wavelen = 2 * math.pi / fr
            if wavelen < hi_wavelen:
                out.append(fr)
            elif wavelen > lo_wavelen:
                out.append(fr / factor)
            else:
                smooth = (ROPE_ORIG_MAX_POS / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
                out.append((1 - smooth) * fr / factor + smooth * fr)
        inv = torch.tensor(out, dtype=torch.float64)
    return inv


def rope_angles(cfg, T):
    """angle[t, i] = t * inv_freq[i], [T, rot/2]."""
    return torch.arange(T, dtype=torch.float64)[:, None] * rope_inv_freq(cfg)[None, :]


def apply_rope(x, ang):
    """x [B, heads, T, d], ang [T, rot/2]: Megatron's non-interleaved (rotate_half) form on x[..., :rot]."""
    r2 = ang.shape[-1]
    x1, x2, rest = x[..., :r2], x[..., r2:2 * r2], x[..., 2 * r2:]
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def split_qkv(cfg, qkv):
    """[B, T, (n+2g)d] in Megatron's grouped layout -> q [B, n, T, d], k, v [B, g, T, d]."""
    B, T, _ = qkv.shape
    n, g, d = cfg.n, cfg.g, cfg.d
    x = qkv.view(B, T, g, (n // g + 2) * d)
    q = x[..., : (n // g) * d].reshape(B, T, n, d)
    k = x[..., (n // g) * d: (n // g + 1) * d]
    v = x[..., (n // g + 1) * d:]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def causal_attention(q, k, v, drop_probs=None, allowed=None):
    """Plain softmax attention, scale 1/sqrt(d), causal. q [B, n, T, d], k, v [B, g, T, d]. drop_probs:
    attention dropout applied to the probabilities before they multiply v. allowed [B, T, T] bool (None:
    causal): which keys each query sees (documents)."""
    n, g, T, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    if g != n:                                   # GQA: each group serves n/g consecutive heads
        k = k.repeat_interleave(n // g, dim=1)
        v = v.repeat_interleave(n // g, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1) if allowed is None else ~allowed[:, None]
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if drop_probs is not None:
        p = drop_probs(p)
    return p @ v


class Pieces:
    """The building blocks the forward pass is made of; the self-test swaps in torch's own."""
    layer_norm = staticmethod(layer_norm)
    rms_norm = staticmethod(rms_norm)
    gelu = staticmethod(gelu_tanh)
    silu = staticmethod(silu)
    squared_relu = staticmethod(squared_relu)
    rope = staticmethod(apply_rope)
    attention = staticmethod(causal_attention)


def _torch_rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TorchPieces:
    layer_norm = staticmethod(lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps))
    rms_norm = staticmethod(_torch_rms_norm)
    gelu = staticmethod(lambda z: F.gelu(z, approximate="tanh"))
    silu = staticmethod(F.silu)
    squared_relu = staticmethod(lambda z: torch.pow(F.relu(z), 2))     # Megatron's megatron.core.activations

    @staticmethod
    def rope(x, ang):
        """The same rotation written as complex multiplication: (x1 + i x2) * e^{i angle}."""
        r2 = ang.shape[-1]
        z = torch.complex(x[..., :r2], x[..., r2:2 * r2]) * torch.polar(torch.ones_like(ang), ang)
        return torch.cat([z.real, z.imag, x[..., 2 * r2:]], dim=-1)

    @staticmethod
    def attention(q, k, v, allowed=None):
        if allowed is not None:  # documents: SDPA with the boolean mask (True: attend), GQA heads repeated
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            if not hasattr(F, "scaled_dot_product_attention"):   # torch < 2.0
                s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed[:, None], float("-inf"))
                return torch.softmax(s, dim=-1) @ v
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        if k.shape[1] != q.shape[1]:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except TypeError:        # torch < 2.5
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ------------------------------------------------------------------------------------------------
# Dropout with megatron.c's masks (megatron.cu section 5; see "Dropout" above)
# ------------------------------------------------------------------------------------------------

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
DROPOUT_SALT = np.uint64(0x64726F706F757421)
SITE_EMBEDDING, SITE_ATTENTION, SITE_PROJ, SITE_FC2 = 0, 1, 2, 3


def splitmix64(x):
    """SplitMix64's output function of state x + golden (uint64 arrays, wrapping)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def dropout_stream(seed, iteration, layer, site):
    k = splitmix64(np.uint64(seed) ^ DROPOUT_SALT)
    k = splitmix64(k ^ np.uint64(iteration))
    return splitmix64(k ^ np.uint64((layer + 1) * 4 + site))


def dropout_threshold(p):
    return min(int(math.floor(p * 4294967296.0 + 0.5)), 0xFFFFFFFF)


def dropout_keep(key, counters, columns, p):
    """bool mask: element with this counter and column parity kept at probability 1 - p."""
    with np.errstate(over="ignore"):
        bits = splitmix64(np.uint64(key) + counters.astype(np.uint64) * GOLDEN)
    half = np.where((columns & 1) == 1, bits >> np.uint64(32), bits & np.uint64(0xFFFFFFFF))
    return half >= np.uint64(dropout_threshold(p))


class Dropout:
    """The masks of one training step (iteration) over the step's global batch [G, T]."""

    def __init__(self, cfg, iteration):
        self.cfg, self.iteration = cfg, iteration
        self.p_hidden, self.p_attention = f32(cfg.hidden_dropout), f32(cfg.attention_dropout)

    @staticmethod
    def scale(p):
        return float(np.float32(1.0 / (1.0 - p)))

    def hidden_mask(self, G, T, C, layer, site):
        rows = np.arange(G * T, dtype=np.uint64)[:, None]
        cols = np.arange(C, dtype=np.int64)[None, :]
        counters = rows * np.uint64((C + 1) // 2) + (cols // 2).astype(np.uint64)
        keep = dropout_keep(dropout_stream(self.cfg.seed, self.iteration, layer, site), counters, cols, self.p_hidden)
        return keep.reshape(G, T, C)

    def attention_mask(self, G, n, T, layer):
        gh = np.arange(G * n, dtype=np.uint64)[:, None, None]
        q = np.arange(T, dtype=np.uint64)[None, :, None]
        k = np.arange(T, dtype=np.int64)[None, None, :]
        counters = (gh * np.uint64(T) + q) * np.uint64((T + 1) // 2) + (k // 2).astype(np.uint64)
        keep = dropout_keep(dropout_stream(self.cfg.seed, self.iteration, layer, SITE_ATTENTION), counters, k,
                            self.p_attention)
        return keep.reshape(G, n, T, T)

    def hidden(self, x, layer, site):
        if self.p_hidden == 0.0:
            return x
        G, T, C = x.shape
        m = torch.from_numpy(self.hidden_mask(G, T, C, layer, site).astype(np.float64))
        return x * (m * self.scale(self.p_hidden))

    def attention(self, probs, layer):
        if self.p_attention == 0.0:
            return probs
        G, n, T, _ = probs.shape
        m = torch.from_numpy(self.attention_mask(G, n, T, layer).astype(np.float64))
        return probs * (m * self.scale(self.p_attention))


def megatron_documents(cfg, tokens):
    """Megatron's gpt_dataset._get_ltor_masks_and_position_ids on each sequence of tokens [B, T] (the
    inputs): (allowed [B, T, T] bool, the causal mask with --reset-attention-mask's cuts, or None without
    it; positions [B, T] int64, reset with --reset-position-ids)."""
    B, T = tokens.shape
    allowed = torch.ones(B, T, T, dtype=torch.bool).tril()
    positions = torch.arange(T, dtype=torch.int64).repeat(B, 1)
    for b in range(B):
        prev = 0
        for i in (tokens[b] == cfg.doc_end).nonzero().flatten().tolist():
            if cfg.reset_attention_mask:
                allowed[b, i + 1:, :i + 1] = False
            if cfg.reset_position_ids:
                positions[b, i + 1:] -= i + 1 - prev
                prev = i + 1
    return (allowed if cfg.reset_attention_mask else None), positions


def forward(cfg, p, tokens, pieces=Pieces, drop=None):
    """tokens int64 [B, T] -> logits [B, T, Vp]. p: dict name -> tensor (flavor dispatch below). drop: a
    Dropout (training with dropout; B is then the step's global batch) or None."""
    B, T = tokens.shape
    allowed, positions = megatron_documents(cfg, tokens) if cfg.docs else (None, None)

    def norm(x, w, b):            # b is None without LayerNorm
        if cfg.layernorm_1p:      # zero-centred weights (Megatron's --apply-layernorm-1p)
            w = 1.0 + w
        if cfg.norm == "layernorm":
            return pieces.layer_norm(x, w, b, cfg.norm_eps)
        return pieces.rms_norm(x, w, cfg.norm_eps)

    def linear(x, w, b):          # b is None without biases
        return x @ w.T if b is None else x @ w.T + b

    x = p["word_embeddings"][tokens]
    if cfg.position == "learned":
        x = x + (p["position_embeddings"][positions] if positions is not None else
                 p["position_embeddings"][:T].unsqueeze(0))
    if drop is not None:
        x = drop.hidden(x, -1, SITE_EMBEDDING)
    ang = rope_angles(cfg, T) if cfg.position == "rope" else None
    if ang is not None and positions is not None:   # [B, 1, T, rot/2]: each row at its reset position
        ang = ang[positions].unsqueeze(1)
    for l in range(cfg.L):
        w = {k: p[k][l] if k in p else None for k in
             ("ln1_weight", "ln1_bias", "qkv_weight", "qkv_bias", "q_layernorm_weight", "q_layernorm_bias",
              "k_layernorm_weight", "k_layernorm_bias", "proj_weight", "proj_bias", "ln2_weight",
              "ln2_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")}
        a = norm(x, w["ln1_weight"], w["ln1_bias"])
        q, k, v = split_qkv(cfg, linear(a, w["qkv_weight"], w["qkv_bias"]))
        if cfg.qk_layernorm:                                 # per head [d], before rope
            q = norm(q, w["q_layernorm_weight"], w["q_layernorm_bias"])
            k = norm(k, w["k_layernorm_weight"], w["k_layernorm_bias"])
        if ang is not None:                                  # rope on q and k, after the split
            q, k = pieces.rope(q, ang), pieces.rope(k, ang)
        if drop is None:                                     # [B, n, T, d]
            o = pieces.attention(q, k, v) if allowed is None else pieces.attention(q, k, v, allowed=allowed)
        else:
            o = causal_attention(q, k, v, lambda probs: drop.attention(probs, l), allowed)
        o = o.transpose(1, 2).reshape(B, T, cfg.n * cfg.d)   # heads concatenated in order
        proj = linear(o, w["proj_weight"], w["proj_bias"])
        x = x + (proj if drop is None else drop.hidden(proj, l, SITE_PROJ))
        m = norm(x, w["ln2_weight"], w["ln2_bias"])
        z = linear(m, w["fc1_weight"], w["fc1_bias"])
        if cfg.swiglu:
            z = pieces.silu(z[..., :cfg.f]) * z[..., cfg.f:]   # gate rows first, then up rows
        elif cfg.squared_relu:
            z = pieces.squared_relu(z)
        else:
            z = pieces.gelu(z)
        fc2 = linear(z, w["fc2_weight"], w["fc2_bias"])
        x = x + (fc2 if drop is None else drop.hidden(fc2, l, SITE_FC2))
    y = norm(x, p["final_ln_weight"], p.get("final_ln_bias"))
    out = p["output_weight"] if cfg.untied else p["word_embeddings"]   # untied / tied output layer
    return y @ out.T                                                  # all Vp columns


def cross_entropy(logits, labels):
    """Mean over all tokens of -log softmax(logits)[label]."""
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()


def masked_loss(cfg, logits, tokens):
    """Megatron's loss with --eod-mask-loss (pretrain_gpt.loss_func + the schedule's normalisation): a
    position counts unless its *input* token is cfg.eod; each micro-batch of cfg.mb sequences gives
    sum(loss * mask) / sum(mask), the objective is the mean over the G/mb micro-batches, and the
    reported loss is sum(loss * mask) / sum(mask) over the whole batch. Returns (objective, reported)."""
    labels = tokens[:, 1:]
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)             # [G, T]
    mask = (tokens[:, :-1] != cfg.eod).to(ce.dtype)
    per_mb = [(ce[i:i + cfg.mb] * mask[i:i + cfg.mb]).sum() / mask[i:i + cfg.mb].sum()
              for i in range(0, cfg.G, cfg.mb)]
    return sum(per_mb) / len(per_mb), (ce * mask).sum() / mask.sum()


def loss_and_grads(cfg, params, batch, pieces=Pieces, iteration=0):
    """batch int32 [G, T+1] of step `iteration` -> (loss, {name: grad}, logits); with a loss mask the loss
    is the reported one and the gradients are the objective's (masked_loss). With dropout the loss and
    gradients are the training step's (masks of that iteration), the logits evaluation's (no dropout)."""
    t = torch.from_numpy(batch.astype(np.int64))
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    has_dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
    logits = forward(cfg, p, t[:, :-1], pieces, Dropout(cfg, iteration) if has_dropout else None)
    if cfg.eod >= 0:
        objective, loss = masked_loss(cfg, logits, t)
    else:
        objective = loss = cross_entropy(logits, t[:, 1:])
    names = [s[0] for s in param_specs(cfg)]
    grads = torch.autograd.grad(objective, [p[k] for k in names])
    if has_dropout:
        with torch.no_grad():
            logits = forward(cfg, p, t[:, :-1], pieces)
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
        loss, grads, _ = loss_and_grads(cfg, p, tokens[k], iteration=k)
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
    if cfg.zipf > 0:   # P(r-th most frequent) ~ r^-zipf over [0, Vp-64), the ranks shuffled over the ids
        V = cfg.Vp - 64
        law = np.arange(1, V + 1, dtype=np.float64) ** -cfg.zipf
        ranked = rng.permutation(V)
        tokens = ranked[rng.choice(V, size=(cfg.S, cfg.G, cfg.T + 1), p=law / law.sum())].astype(np.int32)
    else:
        tokens = rng.integers(0, cfg.Vp - 64, size=(cfg.S, cfg.G, cfg.T + 1)).astype(np.int32)
    if cfg.eod >= 0:   # documents: an end-of-document token at ~1 in 8 positions, a different count per sequence
        tokens[rng.random(tokens.shape) < 0.125] = cfg.eod
    if cfg.docs:       # the documents' edge cases (see "Documents" above; G >= 4)
        e = cfg.doc_end
        if cfg.eod < 0:
            tokens[rng.random(tokens.shape) < 0.125] = e
        tokens[:, 0, 0] = e
        tokens[:, 1, cfg.T - 1] = e
        tokens[:, 2, :][tokens[:, 2, :] == e] = e + 1
        tokens[:, 3, 5:7] = e
    return tokens


def choose_clip(cfg, params0, tokens):
    """A clip_grad that clips some steps and not others, as far as possible from every step's norm
    (so that the C side's rounding cannot flip a decision). Iterates because clipping changes the path."""
    _, norms, _, _ = train(replace(cfg, clip_grad=0.0), params0, tokens)
    norms0, best = norms, None
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
    # Fallback, only when the balanced search above found nothing safe (norms packed within a few
    # percent, as in llama_tiny): the candidates with the widest margin that leave >= 2 steps on each
    # side, at 2 then 3 significant digits.
    cands = sorted(norms0)
    for digits in (2, 3):
        opts = {float(f"{math.sqrt(a * b):.{digits}g}") for a, b in zip(cands, cands[1:])}
        opts = [c for c in opts if 2 <= sum(x < c for x in norms0) <= len(norms0) - 2]
        for c in sorted(opts, key=lambda c: -min(abs(x - c) / c for x in norms0))[:3]:
            _, new_norms, _, _ = train(replace(cfg, clip_grad=c), params0, tokens)
            clipped = sum(x > c for x in new_norms)
            if 2 <= clipped <= len(new_norms) - 2 and min(abs(x - c) / c for x in new_norms) > 0.01:
                return c, new_norms
    return best


# ------------------------------------------------------------------------------------------------
# Writing and checking files
# ------------------------------------------------------------------------------------------------

def header_arrays(cfg):
    rope = cfg.position == "rope"
    hd = np.zeros(HEADER_INTS, dtype="<i4")
    dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
    hd[:30] = [MAGIC, VERSION, FLAVORS[cfg.flavor], cfg.L, cfg.h, cfg.n, cfg.f, cfg.Vp, cfg.P, cfg.T,
               cfg.G, cfg.mb, cfg.S, num_params(cfg), cfg.g,
               cfg.d if (cfg.kv or cfg.flavor != "gpt2") else 0,   # gpt2 files keep 0 (= h/n) here
               NORMS[cfg.norm], int(cfg.swiglu), POSITIONS[cfg.position], int(cfg.untied), int(not cfg.bias),
               int(rope and cfg.rope_scaling_factor > 0), int(cfg.layernorm_1p), cfg.eod + 1,
               cfg.seed if dropout else 0, int(cfg.squared_relu), int(cfg.qk_layernorm),
               int(cfg.reset_position_ids), int(cfg.reset_attention_mask), cfg.doc_end + 1 if cfg.docs else 0]
    hp = np.zeros(HYPER_FLOATS, dtype="<f4")
    hp[:15] = [cfg.max_lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.lr_decay_iters, cfg.b1, cfg.b2, cfg.eps,
               cfg.weight_decay, cfg.clip_grad, cfg.norm_eps,
               cfg.rotary_base if rope else 0.0, cfg.rotary_percent if rope else 0.0,
               cfg.rope_scaling_factor if rope else 0.0, cfg.hidden_dropout, cfg.attention_dropout]
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
    flavors = {v: k for k, v in FLAVORS.items()}
    if int(hd[2]) not in flavors:
        raise ValueError(f"unknown flavor code {hd[2]}")
    L, h, n, f, Vp, P, T, G, mb, S, N, g, kv = (int(x) for x in hd[3:16])
    norm_c, swiglu, pos_c, untied, no_bias, scaling, one_p, eod1 = (int(x) for x in hd[16:24])
    dropout_seed, hidden_dropout, attention_dropout = int(hd[24]), float(hp[13]), float(hp[14])
    squared_relu, qk_layernorm = int(hd[25]), int(hd[26])
    reset_pos, reset_mask, doc_eod1 = int(hd[27]), int(hd[28]), int(hd[29])
    if any(hd[30:]) or any(hp[15:]):
        raise ValueError("reserved header fields not zero")
    if squared_relu not in (0, 1) or qk_layernorm not in (0, 1):
        raise ValueError(f"bad switches squared_relu {squared_relu}, qk_layernorm {qk_layernorm}")
    if norm_c not in NORMS.values() or pos_c not in POSITIONS.values() or \
            any(x not in (0, 1) for x in (swiglu, untied, no_bias, scaling, one_p)) or not 0 <= eod1 <= Vp - 64:
        raise ValueError(f"bad model switches {[int(x) for x in hd[16:24]]}")
    rope = pos_c == POSITIONS["rope"]
    if not rope and (any(hp[10:13]) or scaling):
        raise ValueError("rope fields set without rope")
    if rope and scaling != int(hp[12] > 0):
        raise ValueError(f"use_rope_scaling {scaling} but rope_scaling_factor {hp[12]}")
    try:
        cfg = Config(flavor=flavors[int(hd[2])], L=L, h=h, n=n, g=g, kv=kv, f=f, Vp=Vp, T=T, P=P, G=G, mb=mb, S=S,
                     norm={v: k for k, v in NORMS.items()}[norm_c], swiglu=bool(swiglu),
                     position={v: k for k, v in POSITIONS.items()}[pos_c], untied=bool(untied), bias=not no_bias,
                     layernorm_1p=bool(one_p), eod=eod1 - 1, squared_relu=bool(squared_relu),
                     qk_layernorm=bool(qk_layernorm), reset_position_ids=bool(reset_pos),
                     reset_attention_mask=bool(reset_mask), doc_eod=doc_eod1 - 1 if doc_eod1 - 1 != eod1 - 1 else -1,
                     hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                     seed=dropout_seed if dropout_seed else Config.seed,
                     rotary_base=float(hp[10]) if rope else Config.rotary_base,
                     rotary_percent=float(hp[11]) if rope else Config.rotary_percent,
                     rope_scaling_factor=float(hp[12]) if rope else 0.0,
                     max_lr=float(hp[0]), min_lr=float(hp[1]), lr_warmup_iters=int(hp[2]),
                     lr_decay_iters=int(hp[3]), b1=float(hp[4]), b2=float(hp[5]), eps=float(hp[6]),
                     weight_decay=float(hp[7]), clip_grad=float(hp[8]), norm_eps=float(hp[9]))
    except AssertionError as e:
        raise ValueError(f"inconsistent header: {e}")
    if num_params(cfg) != N:
        raise ValueError(f"header says {N} params, the shapes give {num_params(cfg)}")
    hd2, hp2 = header_arrays(cfg)
    if not (np.array_equal(hd2, hd) and np.array_equal(hp2, hp)):
        raise ValueError("header does not round-trip through Config")
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

    print(f"{path}: {cfg.flavor} L={cfg.L} h={cfg.h} n={cfg.n} g={cfg.g} d={cfg.d} f={cfg.f} Vp={cfg.Vp} "
          f"T={cfg.T} G={cfg.G} mb={cfg.mb} S={cfg.S} N={num_params(cfg)} clip_grad={cfg.clip_grad}")
    rope = f" rotary_base={cfg.rotary_base:g} rotary_percent={cfg.rotary_percent:g} (rot {cfg.rot}) " \
           f"rope_scaling_factor={cfg.rope_scaling_factor:g}" if cfg.position == "rope" else ""
    print(f"  {cfg.norm} swiglu={int(cfg.swiglu)} {cfg.position} untied={int(cfg.untied)} "
          f"bias={int(cfg.bias)}{rope}")
    for name, c in CONFIGS.items():                   # a file of a known name should match its config
        if os.path.basename(path) == name + ".bin":
            c = replace(c, clip_grad=cfg.clip_grad)
            ha, pa = header_arrays(c)
            hb, pb = header_arrays(cfg)
            expect(np.array_equal(ha, hb) and np.array_equal(pa, pb), f"header matches CONFIGS[{name!r}]")
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

class _Float64Torch:
    """Stands in for the name `torch` inside transformers' modeling files during the comparison: the same
    module, except that torch.float32 and torch.float mean float64. HF pins float32 in LlamaRMSNorm, the
    rotary tables (inv_freq, cos, sin) and the eager softmax; lifting those pins (and nothing else) lets
    the comparison reach ~1e-13 instead of float32's ~1e-7. Position ids still go through Tensor.float()
    (float32), which is exact for integers."""
    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _hf_float64(modules):
    saved = [(m, m.torch) for m in modules]
    try:
        for m in modules:
            m.torch = _Float64Torch()
        yield
    finally:
        for m, t in saved:
            m.torch = t


def _hf_llama(cfg, params):
    """A transformers LlamaForCausalLM of cfg's shape (float64, eager attention) holding our weights."""
    import inspect
    from transformers import LlamaConfig, LlamaForCausalLM
    n, g, d, h, f = cfg.n, cfg.g, cfg.d, cfg.h, cfg.f
    assert cfg.rot == d, "HF's Llama has no partial rotary"
    rope = {"rope_type": "default"}
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "llama3", "factor": f32(cfg.rope_scaling_factor),
                "low_freq_factor": ROPE_LOW_FREQ_FACTOR, "high_freq_factor": ROPE_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": ROPE_ORIG_MAX_POS}
    kw = dict(vocab_size=cfg.Vp, hidden_size=h, intermediate_size=f, num_hidden_layers=cfg.L,
              num_attention_heads=n, num_key_value_heads=g, head_dim=d, hidden_act="silu",
              max_position_embeddings=131072, rms_norm_eps=cfg.norm_eps, attention_bias=False,
              mlp_bias=False, tie_word_embeddings=False, attn_implementation="eager")
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:     # transformers >= 5
        kw["rope_parameters"] = dict(rope, rope_theta=f32(cfg.rotary_base))
    else:
        kw["rope_theta"] = f32(cfg.rotary_base)
        kw["rope_scaling"] = rope if cfg.rope_scaling_factor > 0 else None
    model = LlamaForCausalLM(LlamaConfig(**kw)).to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    r = n // g
    with torch.no_grad():
        m = model.model
        m.embed_tokens.weight.copy_(params["word_embeddings"])
        for l, layer in enumerate(m.layers):
            Wqkv = params["qkv_weight"][l].view(g, (r + 2) * d, h)      # per group: r q heads, k, v
            layer.self_attn.q_proj.weight.copy_(Wqkv[:, :r * d].reshape(n * d, h))
            layer.self_attn.k_proj.weight.copy_(Wqkv[:, r * d:(r + 1) * d].reshape(g * d, h))
            layer.self_attn.v_proj.weight.copy_(Wqkv[:, (r + 1) * d:].reshape(g * d, h))
            layer.self_attn.o_proj.weight.copy_(params["proj_weight"][l])
            layer.input_layernorm.weight.copy_(params["ln1_weight"][l])
            layer.post_attention_layernorm.weight.copy_(params["ln2_weight"][l])
            layer.mlp.gate_proj.weight.copy_(params["fc1_weight"][l][:f])
            layer.mlp.up_proj.weight.copy_(params["fc1_weight"][l][f:])
            layer.mlp.down_proj.weight.copy_(params["fc2_weight"][l])
        m.norm.weight.copy_(params["final_ln_weight"])
        model.lm_head.weight.copy_(params["output_weight"])
    return model


def hf_selftest(cfg, params, tokens, mine, expect):
    """Our llama forward against transformers' LlamaForCausalLM (skipped when transformers is missing)."""
    try:
        import transformers
        from transformers import modeling_rope_utils
        from transformers.models.llama import modeling_llama
    except ImportError:
        print("  [skip] transformers not importable: no comparison with LlamaForCausalLM")
        return
    mods = [modeling_llama, modeling_rope_utils]
    hcfg = cfg
    if cfg.rot != cfg.d:                  # HF's Llama rotates every dim: compare a full-rotary twin
        hcfg = replace(cfg, rotary_percent=1.0)
        mine = forward(hcfg, params, tokens)
    what = f"transformers {transformers.__version__} LlamaForCausalLM" + \
           (" (rotary_percent 1.0 twin)" if hcfg is not cfg else "")
    with _hf_float64(mods):
        model = _hf_llama(hcfg, params)
        with torch.no_grad():
            hf = model(input_ids=tokens, use_cache=False).logits
        hf_inv = model.model.rotary_emb.inv_freq
    e_inv = rel_err(rope_inv_freq(hcfg).numpy(), hf_inv.numpy())
    e = rel_err(mine.numpy(), hf.numpy())
    expect(e_inv < 1e-14, f"rope inv_freq == {what}'s ({'llama3 scaled' if hcfg.rope_scaling_factor > 0 else 'default'}, "
                          f"rel {e_inv:.1e})")
    expect(e < 1e-12, f"logits == {what} in float64 (rel {e:.1e})")
    # the same model with HF's float32 pins left in place: agreement only to float32 rounding
    model = _hf_llama(hcfg, params)
    with torch.no_grad():
        hf32 = model(input_ids=tokens, use_cache=False).logits
    e32 = rel_err(mine.numpy(), hf32.numpy())
    expect(e32 < 1e-5, f"logits == the same, with HF's float32 pins (rel {e32:.1e})")
    if cfg.rot != cfg.d:                  # partial rotary: GPT-NeoX's rotary (HF) applies to the first rot dims
        from transformers import GPTNeoXConfig
        from transformers.models.gpt_neox import modeling_gpt_neox as neox
        import inspect
        kw = dict(hidden_size=cfg.n * cfg.d, num_attention_heads=cfg.n, max_position_embeddings=cfg.T)
        if "rope_parameters" in inspect.signature(GPTNeoXConfig.__init__).parameters:
            kw["rope_parameters"] = {"rope_type": "default", "rope_theta": f32(cfg.rotary_base),
                                     "partial_rotary_factor": f32(cfg.rotary_percent)}
        else:
            kw.update(rotary_emb_base=f32(cfg.rotary_base), rotary_pct=f32(cfg.rotary_percent))
        with _hf_float64(mods + [neox]):
            remb = neox.GPTNeoXRotaryEmbedding(GPTNeoXConfig(**kw))
            q, k = torch.randn(2, cfg.n, cfg.T, cfg.d), torch.randn(2, cfg.g, cfg.T, cfg.d)
            cos, sin = remb(q, torch.arange(cfg.T)[None])
            hq, hk = neox.apply_rotary_pos_emb(q, k, cos, sin)
        ang = rope_angles(cfg, cfg.T)
        e = max(rel_err(apply_rope(q, ang).numpy(), hq.numpy()), rel_err(apply_rope(k, ang).numpy(), hk.numpy()))
        expect(e < 1e-12, f"partial rope ({cfg.rot} of {cfg.d} dims, base {cfg.rotary_base:g}) == transformers "
                          f"GPT-NeoX rotary (rel {e:.1e})")


def selftest():
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    for name, cfg in CONFIGS.items():
        act = 'swiglu' if cfg.swiglu else 'squared relu' if cfg.squared_relu else 'gelu'
        print(f"selftest {name} ({cfg.flavor}: {cfg.norm}{' + qk norms' if cfg.qk_layernorm else ''}, {act}, {cfg.position}, "
              f"{'untied' if cfg.untied else 'tied'}, {'bias' if cfg.bias else 'no bias'}, n={cfg.n} g={cfg.g} d={cfg.d})")
        params = init_params(cfg)
        batch = make_tokens(cfg)[0]
        t = torch.from_numpy(batch.astype(np.int64))
        mine = forward(cfg, params, t[:, :-1])
        ref = forward(cfg, params, t[:, :-1], TorchPieces)
        what = "F.layer_norm/F.gelu" if cfg.norm == "layernorm" else "F.rms_norm/F.silu/complex rope"
        expect(rel_err(mine.numpy(), ref.numpy()) < 1e-12,
               f"forward == SDPA/{what} version (rel {rel_err(mine.numpy(), ref.numpy()):.1e})")
        x = torch.randn(3, cfg.h)
        if cfg.norm == "layernorm":      # nn.LayerNorm module against the hand-written one
            ln = torch.nn.LayerNorm(cfg.h, eps=cfg.norm_eps)
            with torch.no_grad():
                ln.weight.copy_(params["ln1_weight"][0]); ln.bias.copy_(params["ln1_bias"][0])
            expect(rel_err(layer_norm(x, params["ln1_weight"][0], params["ln1_bias"][0], cfg.norm_eps).numpy(),
                           ln(x).detach().numpy()) < 1e-12, "layer_norm == nn.LayerNorm")
        elif hasattr(torch.nn, "RMSNorm"):
            rn = torch.nn.RMSNorm(cfg.h, eps=cfg.norm_eps)
            with torch.no_grad():
                rn.weight.copy_(params["ln1_weight"][0])
            expect(rel_err(rms_norm(x, params["ln1_weight"][0], cfg.norm_eps).numpy(),
                           rn(x).detach().numpy()) < 1e-12, "rms_norm == nn.RMSNorm")
        if cfg.swiglu:
            z = torch.randn(1000) * 4
            expect(rel_err(silu(z).numpy(), F.silu(z).numpy()) < 1e-14, "silu == F.silu")
        if cfg.squared_relu:
            z = torch.randn(1000) * 4
            expect(rel_err(squared_relu(z).numpy(), torch.pow(F.relu(z), 2).numpy()) == 0.0,
                   "squared_relu == relu(z)^2 (megatron.core.activations.squared_relu)")
        # the grouped QKV layout, head by head: head i is member i % (n/g) of group j = i // (n/g)
        d, r = cfg.d, cfg.n // cfg.g
        W = (cfg.n + 2 * cfg.g) * d
        qkv = torch.arange(cfg.T * W, dtype=torch.float64).view(1, cfg.T, W)
        q, k, v = split_qkv(cfg, qkv)
        good = True
        for i in range(cfg.n):
            j, base = i // r, (i // r) * (r + 2) * d
            good &= torch.equal(q[0, i], qkv[0, :, base + (i % r) * d: base + (i % r + 1) * d])
            good &= torch.equal(k[0, j], qkv[0, :, base + r * d: base + (r + 1) * d])
            good &= torch.equal(v[0, j], qkv[0, :, base + (r + 1) * d: base + (r + 2) * d])
        expect(good, f"grouped qkv layout ({cfg.g} groups of {r} q heads, then k, then v)")
        if cfg.position == "rope":
            ang = rope_angles(cfg, cfg.T)
            xq, xk = torch.randn(1, 1, cfg.T, d), torch.randn(1, 1, cfg.T, d)
            rq, rk = apply_rope(xq, ang), apply_rope(xk, ang)
            # a rotation: norms kept, position 0 untouched, dims past rot untouched, and q.k depends on t-s only
            xs = xq[0, 0, 0].expand(cfg.T, d).reshape(1, 1, cfg.T, d)   # the same vector at every position
            ys = xk[0, 0, 0].expand(cfg.T, d).reshape(1, 1, cfg.T, d)
            dots = (apply_rope(xs, ang)[0, 0] @ apply_rope(ys, ang)[0, 0].T)   # [t, s]
            shift = max(float((dots.diagonal(o)[1:] - dots.diagonal(o)[:-1]).abs().max())
                        for o in range(-cfg.T + 2, cfg.T - 1))
            expect(torch.allclose(rq.norm(dim=-1), xq.norm(dim=-1), rtol=1e-14, atol=0) and
                   torch.equal(rq[..., 0, :], xq[..., 0, :]) and torch.equal(rq[..., cfg.rot:], xq[..., cfg.rot:])
                   and shift < 1e-12,
                   f"rope is a rotation of dims [0, {cfg.rot}) of {d}, relative (max q.k drift along a "
                   f"diagonal {shift:.1e})")
            if cfg.rope_scaling_factor > 0:
                plain = rope_inv_freq(replace(cfg, rope_scaling_factor=0.0))
                scaled = rope_inv_freq(cfg)
                fac = f32(cfg.rope_scaling_factor)
                keep = int((scaled == plain).sum())
                div = int(torch.isclose(scaled, plain / fac, rtol=1e-15, atol=0).sum())
                smooth = len(plain) - keep - div
                expect(keep > 0 and div > 0 and smooth > 0,
                       f"rope scaling hits every branch: keep {keep}, smooth {smooth}, divide {div} "
                       f"of {len(plain)} frequencies")
        loss_a = cross_entropy(mine, t[:, 1:]).item()
        loss_b = F.cross_entropy(ref.reshape(-1, cfg.Vp), t[:, 1:].reshape(-1)).item()
        expect(abs(loss_a - loss_b) < 1e-12, f"cross_entropy == F.cross_entropy ({loss_a:.8f})")
        # gradient vs central finite differences on a few coordinates of every tensor
        loss, grads, _ = loss_and_grads(cfg, params, batch)
        rng = np.random.default_rng(0)
        worst = 0.0
        out_name = "output_weight" if cfg.untied else "word_embeddings"
        for pname, shape, _, _ in param_specs(cfg):
            for _ in range(3):
                idx = tuple(int(rng.integers(0, s)) for s in shape)
                if pname == out_name and _ == 0:
                    idx = (cfg.Vp - 1, idx[1])             # a padding row: gradient only via the softmax
                e = 1e-5
                pp = {kk: vv.clone() for kk, vv in params.items()}

                def objective(pp):      # the training objective loss_and_grads differentiates
                    dropped = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
                    logits = forward(cfg, pp, t[:, :-1], drop=Dropout(cfg, 0) if dropped else None)
                    return (masked_loss(cfg, logits, t)[0] if cfg.eod >= 0 else cross_entropy(logits, t[:, 1:])).item()
                pp[pname][idx] += e
                lp = objective(pp)
                pp[pname][idx] -= 2 * e
                lm = objective(pp)
                fd = (lp - lm) / (2 * e)
                an = grads[pname][idx].item()
                # tolerance: relative, with an absolute floor for tiny entries (FD noise ~1e-10)
                worst = max(worst, abs(fd - an) / (abs(an) + 1e-5))
        expect(worst < 1e-5, f"gradient == finite differences on {3 * len(param_specs(cfg))} coordinates "
                             f"(worst |fd-an|/(|an|+1e-5) {worst:.1e})")
        if cfg.flavor == "llama" and not cfg.docs:   # HF's Llama takes no document mask here
            hf_selftest(cfg, params, t[:, :-1], mine, expect)
        if cfg.docs:   # the documents: Megatron's loop against doc_start's rule (key j seen iff start <= j <= i)
            allowed, positions = megatron_documents(cfg, t[:, :-1])
            good = True
            for b in range(t.shape[0]):
                start = 0
                for i in range(cfg.T):
                    if i > 0 and int(t[b, i - 1]) == cfg.doc_end:
                        start = i
                    good &= int(positions[b, i]) == (i - start if cfg.reset_position_ids else i)
                    if allowed is not None:
                        good &= all(bool(allowed[b, i, j]) == (start <= j <= i) for j in range(cfg.T))
            eods = int((t[:, :-1] == cfg.doc_end).sum())
            expect(good and eods >= 8, f"documents: {eods} eod inputs, positions and mask follow doc_start")
    # AdamW: our update against torch.optim.AdamW (same math: decoupled decay on the old p)
    for name in ("gpt2_tiny", "llama_tiny"):
        cfg = replace(CONFIGS[name], S=3, clip_grad=1e9)
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
        expect(e < 1e-12, f"AdamW == torch.optim.AdamW over {cfg.S} steps, {name} (rel {e:.1e})")
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
