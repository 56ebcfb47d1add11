#!/usr/bin/env python3
"""
ref_moe.py: the PyTorch reference for megatron.c's mixture of experts (issue #34), and the writer of its
test vectors.

ref_gpt.py's model (its flavours and switches, imported from it) in which the MLP of the layers that
--moe-layer-freq marks is a Megatron-Core MoE layer: router, top-k, auxiliary losses, capacity and dropping,
the deterministic permutation, the routed experts, the shared expert, the aux-loss-free expert bias.
Float64 on the CPU. dev/moe_semantics.md states the semantics (flag by flag, with Megatron's defaults and
refusals); this file computes exactly that, and dev/moe_mcore_check.py compares it with megatron-core.

    python dev/ref_moe.py                      # write every file in CONFIGS to dev/data/moe_vectors/
    python dev/ref_moe.py --only mixtral_tiny  # write one of them
    python dev/ref_moe.py --check FILE...      # re-read files, verify them, recompute everything
    python dev/ref_moe.py --selftest           # independent formulations, finite differences, repeatability

Only torch (CPU) and numpy are needed.

Token order
-----------
Megatron's hidden states are [s, b, h]; the router, the capacity and the permutation see the micro-batch's
tokens flattened sequence-major: token n = t * B + b (B = sequences in the micro-batch). This order decides
which tokens the "position" drop policy drops, the order of tokens inside an expert's rows, and how
seq_aux_loss splits sequences. Everything per micro-batch: logits, capacity, the aux losses (the loss of a
micro-batch of mb sequences is not that of a larger batch), so the files' mb is binding, not a suggestion.

One MoE layer (input m = the pre-MLP norm's output, N = B*T tokens, E experts, k = topk)
-------------------------------------------------------------------------------------------
  logits = m @ router_weight^T (+ router_bias)                                [N, E]  (fp32 in Megatron)
  probs, map = top-k routing (route()), then capacity dropping (drop())       [N, E]  (0 / False off the map)
  rows     = the (token, expert) pairs of map, expert-major, tokens ascending (permute())
  expert e on its rows x [n_e, h] with probabilities p [n_e]:
      z = x @ fc1_e^T (+ b1_e); a = act(z) * p; y = a @ fc2_e^T (+ b2_e * p)
      act: SwiGLU silu(z[:, :fe]) * z[:, fe:]; squared relu; or GELU, one of two (MoEConfig.gelu): "erf",
      torch's exact GELU (Megatron refuses its fused tanh-GELU with per-token probabilities, so an MoE GELU
      model runs --no-bias-gelu-fusion, and every GELU of such a model, dense layers too, is the erf one), or
      "tanh", ref_gpt's gelu_tanh (Megatron with --use-te-activation-func: Transformer Engine's GELU, the
      tanh approximation, in the experts and the dense MLPs alike; megatron.c's GELU)
  out[n]   = sum of the rows of token n, in ascending expert order (unpermute())
           + shared(m) (shared expert MLP, fe = --moe-shared-expert-intermediate-size, no biases;
             with --moe-shared-expert-gate times sigmoid(m @ shared_gate_weight))
The layer returns out; the residual adds it like the dense MLP's output.

Objective of one step (M = G/mb micro-batches): (1/M) sum_mb [ CE_mb + sum over MoE layers of
aux_loss + seq_aux_loss + global_aux_loss + z_loss ] (each term as moe_semantics.md gives it; all carry the
micro-batch's 1/M like the language-model loss, as Megatron's MoEAuxLossAutoScaler scale does). The
reported loss (losses[], loss0) is the language-model loss alone, as Megatron's "lm loss".
After the step's backward: expert_bias += rate * sign(mean(count) - count), float32, count = the final
routing map's tokens per expert summed over the step's micro-batches. Then clipping and AdamW as ref_gpt.

Parameters, canonical order (float32, per-layer tensors stacked; Ld dense, Lm MoE layers)
-----------------------------------------------------------------------------------------
ref_gpt.py's order, with fc1_weight/fc1_bias/fc2_weight/fc2_bias stacked over the Ld dense layers only
(absent when every layer is MoE), and before final_ln_weight:
  router_weight [Lm, E, h]            router_bias [Lm, E]                      (bias: --add-bias-linear)
  expert_fc1_weight [Lm, E, f1e, h]   expert_fc1_bias [Lm, E, f1e]             (f1e = 2 fe with SwiGLU)
  expert_fc2_weight [Lm, E, h, fe]    expert_fc2_bias [Lm, E, h]
  shared_fc1_weight [Lm, fs1, h]      shared_fc2_weight [Lm, h, fs]            (shared expert; fs1 = 2 fs SwiGLU)
  shared_gate_weight [Lm, h]                                                   (--moe-shared-expert-gate)
Init as ref_gpt's kinds (matrices N(0, 0.02), fc2-like N(0, 0.02/sqrt(2L)), biases N(0, 0.02)), rounded to
float32. Weight decay on every matrix (router and shared gate included), none on biases, as Megatron's
default (no decay for biases and 1-D tensors). The expert bias is a buffer, not a parameter.

File format, dev/data/moe_vectors/<name>.bin, little-endian
-----------------------------------------------------------
header int32[256]: words 0..26 as ref_gpt.py's (word 0 = MOE_MAGIC, word 1 version 1, word 13 = this
  file's parameter count), then
  [32] E  [33] topk  [34] fe  [35] score (0 softmax, 1 sigmoid)  [36] pre_softmax  [37] num_groups (0 none)
  [38] group_topk  [39] load balancing types (bits: 1 aux_loss, 2 seq_aux_loss, 4 global_aux_loss)
  [40] expert bias (0/1)  [41] drop policy (0 probs, 1 position)  [42] pad to capacity (0/1)
  [43] shared expert size (0 none)  [44] shared gate (0/1)  [45] Lm  [46] N0 = mb * T
  [47] GELU kind (0 erf, 1 tanh; 0 with swiglu or squared relu)
  [64 + l] 1 if layer l is MoE (l < L <= 192); every other word 0
hyper float32[64]: [0..14] as ref_gpt.py's, then [16] topk scaling factor (0 none) [17] aux_loss coeff
  [18] seq_aux_loss coeff [19] global_aux_loss coeff [20] z-loss coeff (0 none) [21] bias update rate
  [22] capacity factor (0: dropless); every other word 0
then ref_gpt.py's arrays (params0, tokens, logits, loss0, grads0, losses, grad_norms, lrs, params_final;
logits computed micro-batch by micro-batch, evaluation: no aux losses, capacity still applies), then
  moe_losses        float32[S, 4, Lm]  per step, kind (load_balancing, seq_load_balancing,
                                        global_load_balancing, z), MoE layer: the logged value (loss / coeff,
                                        the mean over the step's micro-batches); 0 for kinds that are off
  tokens_per_expert int32[S, Lm, E]    final routing map's tokens per expert, summed over the step
  expert_bias       float32[S+1, Lm, E] the bias each step routed with, then the one after the last step
  route_probs0      float32[Lm, N0, E] step 0, micro-batch 0, params0, training forward: final probabilities
  route_map0        int32[Lm, N0, E]   the same step's final routing map (1 routed, or padded to capacity)
"""
import argparse
import contextlib
import math
import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_gpt  # noqa: E402
from ref_gpt import (Config, Pieces, f32, hyper, learning_rate, make_tokens, rel_err, rope_angles,  # noqa: E402
                     split_qkv, HEADER_INTS, HYPER_FLOATS)

MOE_MAGIC = 20261134
MOE_VERSION = 1
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "moe_vectors")
LB_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")           # the three aux losses, bits 1, 2, 4
LOG_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
SIGMOID_EPS = 1e-20                                                    # Megatron's top-k normalisation guard

torch.set_default_dtype(torch.float64)


# ------------------------------------------------------------------------------------------------
# Configuration: Megatron's MoE flags (their defaults where the flag has one) on ref_gpt's Config
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEConfig(Config):
    E: int = 8                  # --num-experts
    layer_freq: object = 1      # --moe-layer-freq: int N (layer l is MoE when l % N == 0) or a tuple of 0/1
    fe: int = 0                 # --moe-ffn-hidden-size (0: = f, Megatron's default)
    topk: int = 2               # --moe-router-topk
    score: str = "softmax"      # --moe-router-score-function softmax | sigmoid
    pre_softmax: bool = False   # --moe-router-pre-softmax
    scaling: float = 0.0        # --moe-router-topk-scaling-factor (0: none)
    num_groups: int = 0         # --moe-router-num-groups (0: none)
    group_topk: int = 0         # --moe-router-group-topk (0: no group-limited routing)
    lb: tuple = ("aux_loss",)   # --moe-router-load-balancing-type (one or more; "none")
    aux_coeff: tuple = (0.0,)   # --moe-aux-loss-coeff, one per type
    z_coeff: float = 0.0        # --moe-z-loss-coeff (0: none)
    expert_bias: bool = False   # --moe-router-enable-expert-bias
    bias_rate: float = 1e-3     # --moe-router-bias-update-rate
    capacity: float = 0.0       # --moe-expert-capacity-factor (0: dropless)
    drop_policy: str = "probs"  # --moe-token-drop-policy probs | position
    pad: bool = False           # --moe-pad-expert-input-to-capacity
    shared: int = 0             # --moe-shared-expert-intermediate-size (0: none)
    shared_gate: bool = False   # --moe-shared-expert-gate
    gelu: str = "erf"           # without swiglu / squared_relu: "erf" (torch's GELU) or "tanh" (TE's; see above)

    def __post_init__(self):
        super().__post_init__()
        if self.fe == 0:
            object.__setattr__(self, "fe", self.f)
        for why in moe_refusals(self):
            raise ValueError(why)

    @property
    def f1e(self):
        return 2 * self.fe if self.swiglu else self.fe

    @property
    def fs1(self):
        return 2 * self.shared if self.swiglu else self.shared

    def coeff(self, kind):
        """The coefficient of one aux-loss type (0 when that type is not selected)."""
        return f32(self.aux_coeff[self.lb.index(kind)]) if kind in self.lb else 0.0


def moe_refusals(cfg):
    """What Megatron refuses (and what this reference does not build), one line each; [] when fine."""
    out = []
    E, k = cfg.E, cfg.topk
    if E <= 0:
        out.append("num_moe_experts must be non-negative")
    if not 1 <= k <= E:
        out.append(f"--moe-router-topk {k} must be in [1, --num-experts {E}] (torch.topk fails beyond)")
    if cfg.score not in ("softmax", "sigmoid"):
        out.append(f"--moe-router-score-function {cfg.score}: softmax or sigmoid here")
    if k == 1 and cfg.score == "softmax" and not cfg.pre_softmax:
        out.append("Please use --moe-router-pre-softmax when topk is 1.")
    if cfg.group_topk:
        if not cfg.num_groups:
            out.append("When using group limited routing, moe_router_num_groups must be specified.")
        elif E % cfg.num_groups:
            out.append(f"num_moe_experts ({E}) should be divisible by moe_router_num_groups ({cfg.num_groups}).")
        elif cfg.group_topk > cfg.num_groups:
            out.append(f"moe_router_group_topk ({cfg.group_topk}) should be smaller than moe_router_num_groups "
                       f"({cfg.num_groups}).")
        elif k < cfg.group_topk or k > cfg.group_topk * (E // cfg.num_groups):   # ours: Megatron runs it
            out.append(f"group-limited routing needs group_topk <= topk <= group_topk * experts per group "
                       f"({cfg.group_topk} <= {k} <= {cfg.group_topk * (E // cfg.num_groups)})")
    if len(cfg.lb) != len(cfg.aux_coeff):
        out.append("moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type")
    for t in cfg.lb:
        if t not in LB_TYPES + ("none",):
            out.append(f"--moe-router-load-balancing-type {t}: not built (sinkhorn, quantile_balancing)")
    if cfg.expert_bias and cfg.score != "sigmoid":
        out.append("Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions.")
    if cfg.capacity < 0:
        out.append("a negative --moe-expert-capacity-factor means dropless in Megatron: give none instead")
    if cfg.pad and cfg.capacity == 0:
        out.append("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity")
    if cfg.drop_policy not in ("probs", "position"):
        out.append(f"--moe-token-drop-policy {cfg.drop_policy}")
    if cfg.shared and cfg.bias:
        out.append("bias is not supported in the shared experts, please set '--disable-bias-linear' instead.")
    if cfg.gelu not in ("erf", "tanh"):
        out.append(f"gelu {cfg.gelu}: erf or tanh")
    if cfg.shared_gate and not cfg.shared:
        out.append("--moe-shared-expert-gate without --moe-shared-expert-intermediate-size")
    if cfg.hidden_dropout or cfg.attention_dropout:
        out.append("dropout with MoE: not in this reference")
    if isinstance(cfg.layer_freq, int):
        if cfg.layer_freq < 1:
            out.append("--moe-layer-freq must be >= 1")
    elif len(cfg.layer_freq) != cfg.L or any(v not in (0, 1) for v in cfg.layer_freq):
        out.append(f"--moe-layer-freq pattern must have {cfg.L} entries of 0/1")
    if cfg.L > 192:
        out.append("more than 192 layers do not fit the file header")
    return out


def moe_layers(cfg):
    """[bool] per layer: is it MoE (Megatron: l % freq == 0 for an int, else the pattern's 1s)."""
    if isinstance(cfg.layer_freq, int):
        return [l % cfg.layer_freq == 0 for l in range(cfg.L)]
    return [bool(v) for v in cfg.layer_freq]


def layer_index(cfg):
    """For each layer, its index among the layers of its kind (dense or MoE)."""
    kinds, nd, nm, out = moe_layers(cfg), 0, 0, []
    for is_moe in kinds:
        out.append(nm if is_moe else nd)
        nm, nd = nm + is_moe, nd + (not is_moe)
    return out


def n_moe(cfg):
    return sum(moe_layers(cfg))


CONFIGS = {
    # Mixtral-style: softmax after top-2 of 8 experts, aux_loss and z-loss, SwiGLU, RMSNorm, rope, GQA
    "mixtral_tiny": MoEConfig(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                              E=8, topk=2, fe=32, lb=("aux_loss",), aux_coeff=(1e-2,), z_coeff=1e-3),
    # DeepSeek-style: one dense layer then MoE, sigmoid scores, 4 groups of 4 experts with top-2 groups,
    # top-4 with scaling 2.5, expert bias (aux-loss-free), seq_aux_loss, a shared expert
    "deepseek_tiny": MoEConfig(flavor="llama", L=3, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                               E=16, topk=4, fe=24, layer_freq=(0, 1, 1), score="sigmoid", scaling=2.5,
                               num_groups=4, group_topk=2, lb=("seq_aux_loss",), aux_coeff=(1e-3,),
                               expert_bias=True, bias_rate=1e-3, shared=48),
    # the same DeepSeek-style router with every layer MoE (megatron.c's first MoE phase builds no dense layers
    # beside MoE ones)
    "deepseek_tiny_all": MoEConfig(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                                   E=16, topk=4, fe=24, score="sigmoid", scaling=2.5, num_groups=4, group_topk=2,
                                   lb=("seq_aux_loss",), aux_coeff=(1e-3,), expert_bias=True, bias_rate=1e-3,
                                   shared=48),
    # Qwen3-MoE-style: 128 small experts, top-8, softmax after top-k (HF norm_topk_prob=True), qk-layernorm,
    # the global-batch aux loss
    # (hidden 32 and experts of width 8 keep its 128 experts' file small: the test vectors travel with the tree)
    "qwen3_tiny": MoEConfig(flavor="llama", L=2, h=32, n=4, g=2, kv=16, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                            qk_layernorm=True, E=128, topk=8, fe=8, lb=("global_aux_loss",), aux_coeff=(1e-3,)),
    # capacity 1.0 with the probs policy (tokens dropped, not padded)
    "moe_cap_probs": MoEConfig(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                               E=8, topk=2, fe=32, lb=("aux_loss",), aux_coeff=(1e-2,), capacity=1.0),
    # capacity 1.0 with the position policy and padding to capacity, pre-softmax
    "moe_cap_position_pad": MoEConfig(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2,
                                      S=20, E=8, topk=2, fe=32, pre_softmax=True, lb=("aux_loss",),
                                      aux_coeff=(1e-2,), capacity=1.0, drop_policy="position", pad=True),
    # GPT-2 flavour: biases everywhere (router, experts), erf GELU, top-1 (pre-softmax), MoE every other
    # layer (layer 0 MoE, layer 1 dense), all three aux losses together, gated shared expert not possible
    # with biases (Megatron refuses), so none
    "gpt2_moe": MoEConfig(L=2, h=64, n=4, f=128, Vp=256, T=32, G=4, mb=2, S=20, E=4, topk=1, fe=64,
                          pre_softmax=True, layer_freq=2, lb=("aux_loss", "seq_aux_loss", "global_aux_loss"),
                          aux_coeff=(1e-2, 1e-2, 1e-2), z_coeff=1e-3),
    # GPT flavour (LayerNorm, learned positions, biases everywhere: the router's and each expert's fc1 and fc2,
    # the fc2 bias weighted by the row's probability), GELU experts (tanh: TE's, megatron.c's), top-2 softmax,
    # MoE layers 0 and 2 beside a dense GELU layer 1, the aux loss and the z-loss; no shared expert (Megatron
    # refuses one with biases)
    "gpt_moe_tiny": MoEConfig(L=3, h=64, n=4, f=128, Vp=256, T=32, G=4, mb=2, S=20, E=4, topk=2, fe=48,
                              layer_freq=2, lb=("aux_loss",), aux_coeff=(1e-2,), z_coeff=1e-3, gelu="tanh"),
    # squared-ReLU experts (--squared-relu: the model's activation, relu(z)^2, in the experts and the dense MLP
    # alike, as Megatron's), Llama flavour, MoE layers 0 and 2 beside a dense layer 1, top-2 softmax, the aux loss
    "sqrelu_moe_tiny": MoEConfig(flavor="llama", L=3, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                                 swiglu=False, squared_relu=True, E=4, topk=2, fe=32, layer_freq=2,
                                 lb=("aux_loss",), aux_coeff=(1e-2,)),
    # the gated shared expert (Qwen2-MoE's) with the sigmoid router without bias, top-2 (normalised)
    "moe_shared_gate": MoEConfig(flavor="llama", L=2, h=64, n=4, g=2, f=96, Vp=256, T=32, G=4, mb=2, S=20,
                                 E=8, topk=2, fe=32, score="sigmoid", lb=("none",), aux_coeff=(0.0,),
                                 shared=64, shared_gate=True),
}


# ------------------------------------------------------------------------------------------------
# Parameters: names, shapes, init kinds, weight decay, in canonical order
# ------------------------------------------------------------------------------------------------

def param_specs(cfg):
    """[(name, shape, init kind, weight decay?)] in canonical file order (absent tensors skipped)."""
    Lm = n_moe(cfg)
    Ld = cfg.L - Lm
    E, h, b = cfg.E, cfg.h, cfg.bias
    moe = [("router_weight",      (Lm, E, h),           "normal",        True,  True),
           ("router_bias",        (Lm, E),              "bias",          False, b),
           ("expert_fc1_weight",  (Lm, E, cfg.f1e, h),  "normal",        True,  True),
           ("expert_fc1_bias",    (Lm, E, cfg.f1e),     "bias",          False, b),
           ("expert_fc2_weight",  (Lm, E, h, cfg.fe),   "normal_scaled", True,  True),
           ("expert_fc2_bias",    (Lm, E, h),           "bias",          False, b),
           ("shared_fc1_weight",  (Lm, cfg.fs1, h),     "normal",        True,  cfg.shared > 0),
           ("shared_fc2_weight",  (Lm, h, cfg.shared),  "normal_scaled", True,  cfg.shared > 0),
           ("shared_gate_weight", (Lm, h),              "normal",        True,  cfg.shared_gate)]
    out = []
    for name, shape, kind, decay in ref_gpt.param_specs(cfg):
        if name == "final_ln_weight" and Lm:
            out += [(n, s, k, d) for n, s, k, d, present in moe if present]
        if name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
            if Ld == 0:
                continue
            shape = (Ld,) + tuple(shape[1:])
        out.append((name, shape, kind, decay))
    return out


def num_params(cfg):
    return sum(int(np.prod(s)) for _, s, _, _ in param_specs(cfg))


def init_params(cfg):
    """Deterministic initial weights (float64 tensors holding float32 values), ref_gpt's kinds."""
    rng = np.random.default_rng(cfg.seed)
    std = cfg.init_std
    draw = {"normal": lambda s: rng.normal(0.0, std, s),
            "normal_scaled": lambda s: rng.normal(0.0, std / math.sqrt(2.0 * cfg.L), s),
            "bias": lambda s: rng.normal(0.0, std, s),
            "norm_w": lambda s: (0.0 if cfg.layernorm_1p else 1.0) + rng.normal(0.0, 0.1, s),
            "norm_b": lambda s: rng.normal(0.0, 0.05, s)}
    return {name: torch.from_numpy(draw[kind](shape).astype(np.float32).astype(np.float64))
            for name, shape, kind, _ in param_specs(cfg)}


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
# Router: scores, top-k (plain or group-limited), capacity, auxiliary losses
# ------------------------------------------------------------------------------------------------

def topk_desc(x, k):
    """The k largest along the last dim, in descending order; ties go to the lower index (a stable sort),
    which is the order megatron.c keeps too (torch.topk leaves ties unspecified)."""
    idx = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return x.gather(-1, idx), idx


def group_limit(cfg, s):
    """Group-limited routing's mask: s [N, E] outside the group_topk groups whose score (the sum of their
    top k/group_topk entries) is largest becomes -inf. Returns (s, group scores [N, G]); (s, None) without."""
    if not cfg.group_topk:
        return s, None
    N, E = s.shape
    G = cfg.num_groups
    group_scores = topk_desc(s.reshape(N, G, E // G), cfg.topk // cfg.group_topk)[0].sum(-1)
    gmask = torch.zeros(N, G, dtype=torch.bool).scatter(1, topk_desc(group_scores, cfg.group_topk)[1], True)
    return s.masked_fill(~gmask.repeat_interleave(E // G, dim=1), float("-inf")), group_scores


def select_topk(cfg, s, k):
    """Top-k of s [N, E], group-limited when configured. Returns (values, indices) [N, k]."""
    return topk_desc(group_limit(cfg, s)[0], k)


def route(cfg, logits, expert_bias=None):
    """Megatron's topk_routing_with_score_function: logits [N, E] -> (probs [N, E] zero off the map,
    map [N, E] bool). expert_bias [E] (sigmoid only) moves the selection, not the probabilities."""
    k = cfg.topk
    if cfg.score == "softmax":
        if cfg.pre_softmax:                       # softmax over all experts, then the top-k of it
            probs, idx = select_topk(cfg, torch.softmax(logits, dim=-1), k)
        else:                                     # top-k of the logits, softmax over those k
            top, idx = select_topk(cfg, logits, k)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, idx = select_topk(cfg, scores + expert_bias, k)
            top = scores.gather(1, idx)
        else:
            top, idx = select_topk(cfg, scores, k)
        probs = top / (top.sum(-1, keepdim=True) + SIGMOID_EPS) if k > 1 else top
    if cfg.scaling:
        probs = probs * f32(cfg.scaling)
    dense = torch.zeros_like(logits).scatter(1, idx, probs)
    rmap = torch.zeros(logits.shape, dtype=torch.bool).scatter(1, idx, True)
    return dense, rmap


def capacity_of(cfg, N):
    """Tokens an expert may take in a micro-batch of N tokens: ceil(N k / E * factor), in double."""
    return math.ceil((N * cfg.topk / cfg.E) * f32(cfg.capacity))


def drop(cfg, probs, rmap):
    """Megatron's apply_router_token_dropping. Per expert (column), keep the capacity C tokens with the
    largest probabilities ("probs") or the first C routed tokens in token order ("position"); ties go to
    the lower token index. C > N keeps everything. With pad, the map becomes the kept set itself (exactly C
    tokens per expert, zero-probability ones among them); otherwise the routed tokens that were kept."""
    N = probs.shape[0]
    C = capacity_of(cfg, N)
    if C > N:
        keep = torch.ones_like(rmap)
    else:
        key = probs.detach() if cfg.drop_policy == "probs" else rmap.to(torch.float64)
        order = torch.sort(key, dim=0, descending=True, stable=True).indices[:C]        # [C, E]
        keep = torch.zeros_like(rmap).scatter(0, order, True)
    fmap = keep if cfg.pad else (rmap & keep)
    return probs * fmap, fmap


def aux_scores(cfg, logits):
    """The scores and map the aux losses use (compute_routing_scores_for_aux_loss): softmax over all experts,
    or sigmoid normalised over all experts; the map is their plain top-k (no bias, no groups, no dropping)."""
    if cfg.score == "softmax":
        s = torch.softmax(logits, dim=-1)
    else:
        s = torch.sigmoid(logits)
        s = s / (s.sum(-1, keepdim=True) + SIGMOID_EPS)
    _, idx = topk_desc(s, cfg.topk)
    return s, torch.zeros(logits.shape, dtype=torch.bool).scatter(1, idx, True)


def switch_loss(scores, counts, n_tokens, cfg, coeff):
    """switch_load_balancing_loss_func: sum_i (sum_n scores[n, i]) * counts[i] * E coeff / (k n_tokens^2)."""
    return (scores.sum(0) * counts).sum() * (cfg.E * coeff / (cfg.topk * n_tokens * n_tokens))


def z_loss(logits, coeff):
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


# ------------------------------------------------------------------------------------------------
# Permutation, experts, the MoE layer
# ------------------------------------------------------------------------------------------------

def permute(rmap):
    """rmap [N, E] -> (token [R], expert [R], counts [E]): the rows the experts read, expert-major and,
    inside an expert, tokens ascending (what Megatron's stable argsort of map^T gives). Row r holds token
    token[r] for expert expert[r]; the inverse map is (token, expert) -> r."""
    N, E = rmap.shape
    flat = torch.nonzero(rmap.t().reshape(-1)).squeeze(1)          # ascending: expert-major
    return flat % N, flat // N, rmap.sum(0)


def unpermute(rows_out, token, N):
    """Sum of each token's rows, rows taken in ascending order (= ascending expert)."""
    return torch.zeros(N, rows_out.shape[1]).index_add(0, token, rows_out)


def erf_gelu(z):
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def activation(cfg, z, f, pieces=Pieces):
    """MoE models' activations (dense MLPs of an MoE model too): SwiGLU, squared relu, or GELU (erf or tanh)."""
    if cfg.swiglu:
        return pieces.silu(z[..., :f]) * z[..., f:]
    if cfg.squared_relu:
        return pieces.squared_relu(z)
    return pieces.gelu(z) if cfg.gelu == "tanh" else erf_gelu(z)


def expert_mlp(cfg, x, p, w1, b1, w2, b2):
    """One expert on its rows x [n, h] with probabilities p [n]: the probability scales the activation
    (Megatron >= core 0.13 multiplies it there), and the fc2 bias."""
    z = x @ w1.T if b1 is None else x @ w1.T + b1
    a = activation(cfg, z, cfg.fe) * p[:, None]
    y = a @ w2.T
    return y if b2 is None else y + b2 * p[:, None]


class MoEState:
    """What the routers carry between micro-batches and steps: the expert bias (float32 values) and, within
    a step, the tokens per expert of the final maps (for the bias update) and the global aux loss's
    running counts; plus the logged values of the step."""

    def __init__(self, cfg):
        self.cfg, Lm, E = cfg, n_moe(cfg), cfg.E
        self.expert_bias = np.zeros((Lm, E), dtype=np.float32)
        self.new_step()

    def new_step(self):
        Lm, E = n_moe(self.cfg), self.cfg.E
        self.tokens = np.zeros((Lm, E), dtype=np.int64)        # final map counts, this step
        self.global_counts = np.zeros((Lm, E), dtype=np.float64)
        self.global_steps = np.zeros(Lm, dtype=np.int64)
        self.logged = np.zeros((4, Lm), dtype=np.float64)      # sum over micro-batches of loss / coeff

    def update_bias(self):
        """After the step: bias += rate * sign(mean - count), in float32 (Megatron's expert_bias is fp32)."""
        counts = self.tokens.astype(np.float32)
        mean = counts.sum(-1, keepdims=True) / np.float32(self.cfg.E)
        step = np.sign(mean - counts).astype(np.float32) * np.float32(self.cfg.bias_rate)
        self.expert_bias = (self.expert_bias + step).astype(np.float32)


def moe_layer(cfg, w, m, il, st=None, training=False, record=None):
    """One MoE layer. m [B, T, h] (the pre-MLP norm's output) -> (out [B, T, h], aux objective term).
    il: the layer's index among the MoE layers; st: MoEState (None: no bias, no bookkeeping);
    training: aux losses, z-loss and the bias counts; record: a list that receives a dict of the layer's
    router logits, expert bias, final probabilities and map."""
    B, T, h = m.shape
    N, E = B * T, cfg.E
    xs = m.transpose(0, 1).reshape(N, h)                                 # token n = t * B + b
    logits = xs @ w["router_weight"].T
    if "router_bias" in w:
        logits = logits + w["router_bias"]
    aux = torch.zeros(())
    if training and cfg.z_coeff:
        zl = z_loss(logits, f32(cfg.z_coeff))
        aux = aux + zl
        if st is not None:
            st.logged[3, il] += zl.item() / f32(cfg.z_coeff)
    bias = torch.from_numpy(st.expert_bias[il].astype(np.float64)) if (st is not None and cfg.expert_bias) else None
    probs, rmap = route(cfg, logits, bias)
    if cfg.capacity:
        probs, rmap = drop(cfg, probs, rmap)
    if training and any(cfg.coeff(t) > 0 for t in LB_TYPES):
        s, amap = aux_scores(cfg, logits)
        counts = amap.sum(0).to(torch.float64)
        terms = []
        if cfg.coeff("aux_loss") > 0:
            terms.append((0, switch_loss(s, counts, N, cfg, cfg.coeff("aux_loss")), cfg.coeff("aux_loss")))
        if cfg.coeff("seq_aux_loss") > 0:     # per sequence b: its T tokens, then the mean over the B sequences
            s_seq = s.reshape(T, B * E)
            c_seq = amap.reshape(T, B * E).sum(0).to(torch.float64)
            terms.append((1, switch_loss(s_seq, c_seq, T, cfg, cfg.coeff("seq_aux_loss")) / B,
                          cfg.coeff("seq_aux_loss")))
        if cfg.coeff("global_aux_loss") > 0:  # counts averaged over the step's micro-batches so far
            if st is None:
                raise ValueError("global_aux_loss needs the step's state")
            st.global_counts[il] += counts.numpy()
            st.global_steps[il] += 1
            avg = torch.from_numpy(st.global_counts[il] / st.global_steps[il])
            terms.append((2, switch_loss(s, avg, N, cfg, cfg.coeff("global_aux_loss")), cfg.coeff("global_aux_loss")))
        for kind, loss, coeff in terms:
            aux = aux + loss
            if st is not None:
                st.logged[kind, il] += loss.item() / coeff
    if training and st is not None:
        st.tokens[il] += rmap.sum(0).numpy()
    if record is not None:
        record.append(dict(logits=logits.detach().clone(), bias=bias, probs=probs.detach().clone(), map=rmap.clone()))
    token, expert, counts = permute(rmap)
    x_rows = xs[token]
    p_rows = probs[token, expert]
    outs = []
    for e in range(E):                        # rows of expert e: one contiguous block
        sl = slice(int(counts[:e].sum()), int(counts[:e + 1].sum()))
        outs.append(expert_mlp(cfg, x_rows[sl], p_rows[sl], w["expert_fc1_weight"][e],
                               w["expert_fc1_bias"][e] if "expert_fc1_bias" in w else None,
                               w["expert_fc2_weight"][e], w["expert_fc2_bias"][e] if "expert_fc2_bias" in w else None))
    out = unpermute(torch.cat(outs, 0), token, N)
    if cfg.shared:
        sh = activation(cfg, xs @ w["shared_fc1_weight"].T, cfg.shared) @ w["shared_fc2_weight"].T
        if cfg.shared_gate:
            sh = sh * torch.sigmoid(xs @ w["shared_gate_weight"][:, None])
        out = out + sh
    return out.reshape(T, B, h).transpose(0, 1), aux


def moe_layer_dense(cfg, w, m, expert_bias=None):
    """The same layer written without any permutation (self-test): every expert on every token, masked."""
    B, T, h = m.shape
    xs = m.transpose(0, 1).reshape(B * T, h)
    logits = xs @ w["router_weight"].T + (w["router_bias"] if "router_bias" in w else 0.0)
    probs, rmap = route(cfg, logits, expert_bias)
    if cfg.capacity:
        probs, rmap = drop(cfg, probs, rmap)
    out = torch.zeros_like(xs)
    for e in range(cfg.E):
        y = expert_mlp(cfg, xs, probs[:, e], w["expert_fc1_weight"][e],
                       w["expert_fc1_bias"][e] if "expert_fc1_bias" in w else None, w["expert_fc2_weight"][e],
                       w["expert_fc2_bias"][e] if "expert_fc2_bias" in w else None)
        out = out + y * rmap[:, e:e + 1]
    if cfg.shared:
        sh = activation(cfg, xs @ w["shared_fc1_weight"].T, cfg.shared) @ w["shared_fc2_weight"].T
        if cfg.shared_gate:
            sh = sh * torch.sigmoid(xs @ w["shared_gate_weight"][:, None])
        out = out + sh
    return out.reshape(T, B, h).transpose(0, 1)


MOE_KEYS = ("router_weight", "router_bias", "expert_fc1_weight", "expert_fc1_bias", "expert_fc2_weight",
            "expert_fc2_bias", "shared_fc1_weight", "shared_fc2_weight", "shared_gate_weight")
LAYER_KEYS = ("ln1_weight", "ln1_bias", "qkv_weight", "qkv_bias", "q_layernorm_weight", "q_layernorm_bias",
              "k_layernorm_weight", "k_layernorm_bias", "proj_weight", "proj_bias", "ln2_weight", "ln2_bias")


def forward(cfg, p, tokens, st=None, training=False, records=None, pieces=Pieces):
    """tokens int64 [B, T] (one micro-batch) -> (logits [B, T, Vp], aux objective term of all MoE layers).
    The attention half of each layer is ref_gpt.forward's (without dropout), written with its pieces."""
    B, T = tokens.shape

    def norm(x, w, b):
        if cfg.layernorm_1p:
            w = 1.0 + w
        if cfg.norm == "layernorm":
            return pieces.layer_norm(x, w, b, cfg.norm_eps)
        return pieces.rms_norm(x, w, cfg.norm_eps)

    def linear(x, w, b):
        return x @ w.T if b is None else x @ w.T + b

    kinds, index = moe_layers(cfg), layer_index(cfg)
    x = p["word_embeddings"][tokens]
    if cfg.position == "learned":
        x = x + p["position_embeddings"][:T].unsqueeze(0)
    ang = rope_angles(cfg, T) if cfg.position == "rope" else None
    aux = torch.zeros(())
    for l in range(cfg.L):
        w = {k: p[k][l] if k in p else None for k in LAYER_KEYS}
        a = norm(x, w["ln1_weight"], w["ln1_bias"])
        q, k, v = split_qkv(cfg, linear(a, w["qkv_weight"], w["qkv_bias"]))
        if cfg.qk_layernorm:
            q = norm(q, w["q_layernorm_weight"], w["q_layernorm_bias"])
            k = norm(k, w["k_layernorm_weight"], w["k_layernorm_bias"])
        if ang is not None:
            q, k = pieces.rope(q, ang), pieces.rope(k, ang)
        o = pieces.attention(q, k, v).transpose(1, 2).reshape(B, T, cfg.n * cfg.d)
        x = x + linear(o, w["proj_weight"], w["proj_bias"])
        m = norm(x, w["ln2_weight"], w["ln2_bias"])
        i = index[l]
        if kinds[l]:
            mw = {k: p[k][i] for k in MOE_KEYS if k in p}
            y, a_l = moe_layer(cfg, mw, m, i, st, training, records)
            aux = aux + a_l
        else:
            z = linear(m, p["fc1_weight"][i], p["fc1_bias"][i] if "fc1_bias" in p else None)
            y = linear(activation(cfg, z, cfg.f, pieces), p["fc2_weight"][i], p["fc2_bias"][i] if "fc2_bias" in p else None)
        x = x + y
    y = norm(x, p["final_ln_weight"], p.get("final_ln_bias"))
    return y @ (p["output_weight"] if cfg.untied else p["word_embeddings"]).T, aux


def token_losses(cfg, logits, tok):
    """Per-position cross entropy [B, T] and the loss mask (ref_gpt.masked_loss's: input token != eod)."""
    labels = tok[:, 1:]
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask = (tok[:, :-1] != cfg.eod).to(ce.dtype) if cfg.eod >= 0 else torch.ones_like(ce)
    return ce, mask


def step_objective(cfg, params, batch, st, records=None):
    """The step's objective (mean over micro-batches of CE_mb + the MoE terms), the reported loss, and
    the routing records of every micro-batch. params: tensors (leaves for autograd or not)."""
    t = torch.from_numpy(batch.astype(np.int64))
    M = cfg.G // cfg.mb
    objective, ce_sum, mask_sum = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for i in range(M):
        tok = t[i * cfg.mb:(i + 1) * cfg.mb]
        logits, aux = forward(cfg, params, tok[:, :-1], st, training=True, records=records)
        ce, mask = token_losses(cfg, logits, tok)
        objective = objective + ((ce * mask).sum() / mask.sum() + aux) / M
        ce_sum, mask_sum = ce_sum + (ce * mask).sum().detach(), mask_sum + mask.sum()
    return objective, (ce_sum / mask_sum).item()


def loss_and_grads(cfg, params, batch, st, records=None):
    """One step's reported loss and the objective's gradients ({name: grad}); st collects the step's
    counts and logged values (call st.new_step() before, st.update_bias() after)."""
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    objective, loss = step_objective(cfg, p, batch, st, records)
    names = [s[0] for s in param_specs(cfg)]
    return loss, dict(zip(names, torch.autograd.grad(objective, [p[k] for k in names])))


def eval_logits(cfg, params, batch, expert_bias=None):
    """Evaluation logits [G, T, Vp], micro-batch by micro-batch (capacity per micro-batch; no aux losses)."""
    t = torch.from_numpy(batch.astype(np.int64))
    st = MoEState(cfg)
    if expert_bias is not None:
        st.expert_bias = expert_bias.copy()
    with torch.no_grad():
        return torch.cat([forward(cfg, params, t[i:i + cfg.mb, :-1], st)[0] for i in range(0, cfg.G, cfg.mb)])


# ------------------------------------------------------------------------------------------------
# Training: ref_gpt's clipping, schedule and AdamW, with the expert-bias update after each step
# ------------------------------------------------------------------------------------------------

def train(cfg, params0, tokens, trace=None, records=None):
    """Runs S steps. Returns (losses, grad_norms, lrs, final params dict); trace (a dict) receives the
    per-step MoE records (moe_losses, tokens_per_expert, expert_bias); records (a list) every router's
    logits, bias, probabilities and map (moe_layer's record)."""
    hp = hyper(cfg)
    specs = param_specs(cfg)
    p = {k: v.clone() for k, v in params0.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    st = MoEState(cfg)
    losses, norms, lrs, moe_losses, tpe, biases = [], [], [], [], [], [st.expert_bias.copy()]
    M = cfg.G // cfg.mb
    for k in range(cfg.S):
        st.new_step()
        loss, grads = loss_and_grads(cfg, p, tokens[k], st, records)
        if cfg.expert_bias:
            st.update_bias()                 # finalize_model_grads, before the optimizer step
        moe_losses.append(st.logged / M)
        tpe.append(st.tokens.copy())
        biases.append(st.expert_bias.copy())
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
            p[name] = p[name] - lr * ((m[name] / (1 - b1 ** t)) / (torch.sqrt(v2[name] / (1 - b2 ** t)) + eps)
                                      + wd * p[name])
        losses.append(loss); norms.append(norm); lrs.append(lr)
    if trace is not None:
        trace.update(moe_losses=np.array(moe_losses), tokens_per_expert=np.array(tpe), expert_bias=np.array(biases))
    return losses, norms, lrs, p


@contextlib.contextmanager
def _ref_gpt_trains_moe():
    """ref_gpt.choose_clip calls ref_gpt's module-level train(); point it at this model's for the call."""
    saved = ref_gpt.train
    ref_gpt.train = train
    try:
        yield
    finally:
        ref_gpt.train = saved


def choose_clip(cfg, params0, tokens):
    with _ref_gpt_trains_moe():
        return ref_gpt.choose_clip(cfg, params0, tokens)


def selection_scores(cfg, logits, bias=None):
    """What top-k selects on ([N, E]; -inf outside the chosen groups) and the group scores (or None)."""
    if cfg.score == "softmax":
        s = torch.softmax(logits, -1) if cfg.pre_softmax else logits
    else:
        s = torch.sigmoid(logits) + (bias if bias is not None else 0.0)
    return group_limit(cfg, s)


def decision_margins(cfg, records):
    """How close the routing decisions of a run came to a tie, as the fp32 C side must take the same ones:
    the smallest gap, relative to the scores' spread over the micro-batch, between the k-th and (k+1)-th
    selection score (top-k), the group_topk-th and next group score (groups), the aux map's k-th and next
    aux score (aux losses), and, with the probs drop policy, an expert's C-th and (C+1)-th probability."""
    out = {}

    def gap(name, v, i, spread):
        v = torch.sort(v, -1, descending=True).values
        if v.shape[-1] > i:
            g = v[..., i - 1] - v[..., i]
            g = g[torch.isfinite(g) & (v[..., i - 1] > 0 if name == "capacity" else torch.isfinite(g))]
            if g.numel():
                out[name] = min(out.get(name, float("inf")), float(g.min()) / spread)

    for r in records:
        s, gs = selection_scores(cfg, r["logits"], r["bias"])
        fin = s[torch.isfinite(s)]
        spread = float(fin.max() - fin.min()) + 1e-30
        gap("top-k", s, cfg.topk, spread)
        if gs is not None:
            gap("groups", gs, cfg.group_topk, spread)
        if any(cfg.coeff(t) > 0 for t in LB_TYPES):
            sa, _ = aux_scores(cfg, r["logits"])
            gap("aux map", sa, cfg.topk, float(sa.max() - sa.min()) + 1e-30)
        if cfg.capacity and cfg.drop_policy == "probs":
            probs, _ = route(cfg, r["logits"], r["bias"])
            C = capacity_of(cfg, probs.shape[0])
            if C < probs.shape[0]:
                gap("capacity", probs.t(), C, 1.0)
    return out


# ------------------------------------------------------------------------------------------------
# Writing and checking files
# ------------------------------------------------------------------------------------------------

def lb_bits(cfg):
    return sum(1 << i for i, t in enumerate(LB_TYPES) if cfg.coeff(t) > 0)


def header_arrays(cfg):
    hd, hp = ref_gpt.header_arrays(cfg)                      # words 0..26 / 0..14 as a dense file's
    hd[0], hd[1], hd[13] = MOE_MAGIC, MOE_VERSION, num_params(cfg)
    hd[32:48] = [cfg.E, cfg.topk, cfg.fe, int(cfg.score == "sigmoid"), int(cfg.pre_softmax), cfg.num_groups,
                 cfg.group_topk, lb_bits(cfg), int(cfg.expert_bias), int(cfg.drop_policy == "position"),
                 int(cfg.pad), cfg.shared, int(cfg.shared_gate), n_moe(cfg), cfg.mb * cfg.T,
                 int(cfg.gelu == "tanh" and not cfg.swiglu and not cfg.squared_relu)]
    hd[64:64 + cfg.L] = [int(v) for v in moe_layers(cfg)]
    hp[16:23] = [cfg.scaling, cfg.coeff("aux_loss"), cfg.coeff("seq_aux_loss"), cfg.coeff("global_aux_loss"),
                 cfg.z_coeff, cfg.bias_rate, cfg.capacity]
    return hd, hp


def layout(cfg):
    N, S, G, T, Lm, E = num_params(cfg), cfg.S, cfg.G, cfg.T, n_moe(cfg), cfg.E
    N0 = cfg.mb * T
    return [("params0", "<f4", (N,)), ("tokens", "<i4", (S, G, T + 1)), ("logits", "<f4", (G, T, cfg.Vp)),
            ("loss0", "<f4", (1,)), ("grads0", "<f4", (N,)), ("losses", "<f4", (S,)), ("grad_norms", "<f4", (S,)),
            ("lrs", "<f4", (S,)), ("params_final", "<f4", (N,)), ("moe_losses", "<f4", (S, 4, Lm)),
            ("tokens_per_expert", "<i4", (S, Lm, E)), ("expert_bias", "<f4", (S + 1, Lm, E)),
            ("route_probs0", "<f4", (Lm, N0, E)), ("route_map0", "<i4", (Lm, N0, E))]


def compute(cfg, params0, tokens):
    """Everything a file holds, from the weights and tokens."""
    st = MoEState(cfg)
    st.new_step()
    loss0, grads0 = loss_and_grads(cfg, params0, tokens[0], st)
    logits = eval_logits(cfg, params0, tokens[0])
    rec = []
    with torch.no_grad():
        t0 = torch.from_numpy(tokens[0, :cfg.mb].astype(np.int64))
        forward(cfg, params0, t0[:, :-1], MoEState(cfg), training=True, records=rec)
    trace, run = {}, []
    losses, norms, lrs, pfin = train(cfg, params0, tokens, trace, run)
    assert abs(losses[0] - loss0) < 1e-12
    return dict(params0=flatten(cfg, params0), tokens=tokens, logits=logits.numpy(), loss0=np.array([loss0]),
                grads0=flatten(cfg, grads0), losses=np.array(losses), grad_norms=np.array(norms),
                lrs=np.array(lrs), params_final=flatten(cfg, pfin),
                moe_losses=trace["moe_losses"], tokens_per_expert=trace["tokens_per_expert"],
                expert_bias=trace["expert_bias"],
                route_probs0=np.stack([r["probs"].numpy() for r in rec]),
                route_map0=np.stack([r["map"].numpy().astype(np.int32) for r in rec]), margins=decision_margins(cfg, run))


def generate(name, cfg, out_dir=OUT_DIR):
    params0 = init_params(cfg)
    tokens = make_tokens(cfg)
    if cfg.clip_grad == 0.0:
        clip, _ = choose_clip(cfg, params0, tokens)
        cfg = replace(cfg, clip_grad=clip)
    arrays = compute(cfg, params0, tokens)
    hd, hp = header_arrays(cfg)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".bin")
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(hd.tobytes()); fh.write(hp.tobytes())
        for key, dt, shape in layout(cfg):
            a = np.asarray(arrays[key]).astype(dt)
            assert a.shape == shape, (key, a.shape, shape)
            fh.write(a.tobytes())
    os.replace(tmp, path)
    print(f"{path}: {os.path.getsize(path)} bytes, {num_params(cfg)} params, clip_grad {cfg.clip_grad}")
    print(f"  losses     {' '.join(f'{x:.6f}' for x in arrays['losses'])}")
    print(f"  grad norms {' '.join(f'{x:.5f}' for x in arrays['grad_norms'])}  (clipped: "
          f"{sum(x > f32(cfg.clip_grad) for x in arrays['grad_norms'])}/{cfg.S})")
    ml = arrays["moe_losses"]
    for j, nm in enumerate(LOG_NAMES):
        if ml[:, j].any():
            print(f"  {nm:27s} {ml[0, j].mean():.6f} -> {ml[-1, j].mean():.6f} (mean over MoE layers)")
    print("  closest routing decisions of the run (gap / score spread): "
          + ", ".join(f"{k} {v:.1e}" for k, v in arrays["margins"].items()))
    if cfg.expert_bias:
        print(f"  expert bias after {cfg.S} steps: |b| max {np.abs(arrays['expert_bias'][-1]).max():.4f}")
    return path


def read_file(path):
    """Returns (cfg, dict of arrays). Raises ValueError on a malformed file."""
    raw = open(path, "rb").read()
    if len(raw) < 4 * (HEADER_INTS + HYPER_FLOATS):
        raise ValueError("file shorter than its header")
    hd = np.frombuffer(raw, dtype="<i4", count=HEADER_INTS)
    hp = np.frombuffer(raw, dtype="<f4", count=HYPER_FLOATS, offset=4 * HEADER_INTS)
    if hd[0] != MOE_MAGIC or hd[1] != MOE_VERSION:
        raise ValueError(f"bad magic/version {hd[0]} {hd[1]}")
    L = int(hd[3])
    if not 1 <= L <= 192:
        raise ValueError(f"bad layer count {L}")
    pattern = tuple(int(v) for v in hd[64:64 + L])
    lbits = int(hd[39])
    lb = tuple(t for i, t in enumerate(LB_TYPES) if lbits >> i & 1) or ("none",)
    coeffs = tuple(float(hp[17 + LB_TYPES.index(t)]) for t in lb) if lb != ("none",) else (0.0,)
    flavors = {v: k for k, v in ref_gpt.FLAVORS.items()}
    try:
        cfg = MoEConfig(flavor=flavors[int(hd[2])], L=L, h=int(hd[4]), n=int(hd[5]), f=int(hd[6]), Vp=int(hd[7]),
                        P=int(hd[8]), T=int(hd[9]), G=int(hd[10]), mb=int(hd[11]), S=int(hd[12]), g=int(hd[14]),
                        kv=int(hd[15]), norm={v: k for k, v in ref_gpt.NORMS.items()}[int(hd[16])],
                        swiglu=bool(hd[17]), position={v: k for k, v in ref_gpt.POSITIONS.items()}[int(hd[18])],
                        untied=bool(hd[19]), bias=not hd[20], layernorm_1p=bool(hd[22]), eod=int(hd[23]) - 1,
                        squared_relu=bool(hd[25]), qk_layernorm=bool(hd[26]),
                        rotary_base=float(hp[10]) if hd[18] == 1 else Config.rotary_base,
                        rotary_percent=float(hp[11]) if hd[18] == 1 else Config.rotary_percent,
                        rope_scaling_factor=float(hp[12]) if hd[18] == 1 else 0.0,
                        max_lr=float(hp[0]), min_lr=float(hp[1]), lr_warmup_iters=int(hp[2]),
                        lr_decay_iters=int(hp[3]), b1=float(hp[4]), b2=float(hp[5]), eps=float(hp[6]),
                        weight_decay=float(hp[7]), clip_grad=float(hp[8]), norm_eps=float(hp[9]),
                        E=int(hd[32]), topk=int(hd[33]), fe=int(hd[34]), score="sigmoid" if hd[35] else "softmax",
                        pre_softmax=bool(hd[36]), num_groups=int(hd[37]), group_topk=int(hd[38]), lb=lb,
                        aux_coeff=coeffs, expert_bias=bool(hd[40]), drop_policy="position" if hd[41] else "probs",
                        pad=bool(hd[42]), shared=int(hd[43]), shared_gate=bool(hd[44]), layer_freq=pattern,
                        gelu="tanh" if hd[47] else "erf",
                        scaling=float(hp[16]), z_coeff=float(hp[20]), bias_rate=float(hp[21]), capacity=float(hp[22]))
    except (KeyError, AssertionError, ValueError) as e:
        raise ValueError(f"inconsistent header: {e}")
    hd2, hp2 = header_arrays(cfg)
    if not (np.array_equal(hd2, hd) and np.array_equal(hp2, hp)):
        raise ValueError("header does not round-trip through MoEConfig")
    off = 4 * (HEADER_INTS + HYPER_FLOATS)
    lay = layout(cfg)
    expect = off + 4 * sum(int(np.prod(s)) for _, _, s in lay)
    if len(raw) != expect:
        raise ValueError(f"size {len(raw)} != expected {expect}")
    arrs = {}
    for name, dt, shape in lay:
        count = int(np.prod(shape))
        arrs[name] = np.frombuffer(raw, dtype=dt, count=count, offset=off).reshape(shape)
        off += 4 * count
    return cfg, arrs


def check(path):
    cfg, a = read_file(path)
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    print(f"{path}: {cfg.flavor} L={cfg.L} h={cfg.h} E={cfg.E} topk={cfg.topk} fe={cfg.fe} {cfg.score} "
          f"layers {''.join('M' if v else 'D' for v in moe_layers(cfg))} N={num_params(cfg)} S={cfg.S}")
    expect(all(np.isfinite(v).all() for k, v in a.items() if k not in ("tokens", "tokens_per_expert", "route_map0")),
           "every float finite")
    expect(a["losses"][-1] < a["losses"][0], f"loss decreases ({a['losses'][0]:.5f} -> {a['losses'][-1]:.5f})")
    clipped = int((a["grad_norms"] > cfg.clip_grad).sum())
    expect(0 < clipped < cfg.S, f"clipping active on {clipped}/{cfg.S} steps")
    routed = a["tokens_per_expert"].sum(-1)                                          # [S, Lm]
    if not cfg.capacity:
        expect((routed == cfg.G * cfg.T * cfg.topk).all(), "dropless: G*T*topk routed pairs per layer and step")
    elif cfg.pad:
        C = capacity_of(cfg, cfg.mb * cfg.T)
        expect((routed == cfg.E * min(C, cfg.mb * cfg.T) * (cfg.G // cfg.mb)).all(),
               "padded: E*C pairs per micro-batch, every layer and step")
    else:
        expect((routed < cfg.G * cfg.T * cfg.topk).any(), f"tokens dropped ({int(routed.min())} of "
                                                           f"{cfg.G * cfg.T * cfg.topk} pairs kept at the fewest)")
    if cfg.capacity:
        C = capacity_of(cfg, cfg.mb * cfg.T)
        mx = a["route_map0"].sum(1).max()
        expect(mx <= C and (not cfg.pad or (a["route_map0"].sum(1) == min(C, cfg.mb * cfg.T)).all()),
               f"capacity {C}: at most C tokens per expert{' and exactly C (padded)' if cfg.pad else ''}")
    p0 = unflatten(cfg, a["params0"])
    fresh = compute(cfg, p0, np.asarray(a["tokens"]))
    for key in ("logits", "loss0", "grads0", "losses", "grad_norms", "params_final", "moe_losses", "expert_bias",
                "route_probs0"):
        if key == "expert_bias" and not cfg.expert_bias:
            expect(not np.asarray(a[key]).any(), "expert_bias all zero (off)")
            continue
        e = rel_err(a[key], fresh[key])
        expect(e < 1e-6, f"{key} recomputed (rel {e:.1e})")
    for key in ("tokens_per_expert", "route_map0"):
        expect(np.array_equal(a[key], fresh[key]), f"{key} recomputed (equal)")
    print("  closest routing decisions of the run (gap / score spread): "
          + ", ".join(f"{k} {v:.1e}" for k, v in fresh["margins"].items()))
    return ok


# ------------------------------------------------------------------------------------------------
# Self-test: independent formulations of each piece, finite differences, repeatability
# ------------------------------------------------------------------------------------------------

def _hf_style_router(cfg, logits, bias=None):
    """The routers as Hugging Face's models write them (Mixtral / Qwen3-MoE: softmax over all experts,
    top-k, renormalised when norm_topk_prob; DeepSeek-V3: sigmoid, bias only for the choice, groups scored
    by their top-2 sum, normalised, times routed_scaling_factor), written here from their description."""
    N, E = logits.shape
    if cfg.score == "softmax":
        s = torch.softmax(logits, -1)
        w, idx = torch.topk(s, cfg.topk, dim=-1)
        if not cfg.pre_softmax:                  # norm_topk_prob=True
            w = w / w.sum(-1, keepdim=True)
    else:
        s = torch.sigmoid(logits)
        choice = s + (bias if bias is not None else 0.0)
        if cfg.group_topk:
            G = cfg.num_groups
            gsc = choice.view(N, G, -1).topk(cfg.topk // cfg.group_topk, dim=-1)[0].sum(-1)
            gi = gsc.topk(cfg.group_topk, dim=-1)[1]
            gm = torch.zeros(N, G).scatter(1, gi, 1.0).unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
            choice = choice.masked_fill(gm == 0, float("-inf"))
        idx = choice.topk(cfg.topk, dim=-1)[1]
        w = s.gather(1, idx)
        if cfg.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + SIGMOID_EPS)
    if cfg.scaling:
        w = w * f32(cfg.scaling)
    return torch.zeros(N, E).scatter(1, idx, w)


def selftest():
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    torch.manual_seed(0)
    z = torch.randn(1000) * 4
    expect(rel_err(erf_gelu(z).numpy(), torch.nn.functional.gelu(z).numpy()) < 1e-14, "erf_gelu == F.gelu")
    for name, cfg in CONFIGS.items():
        print(f"selftest {name} (E={cfg.E} topk={cfg.topk} {cfg.score}{' pre' if cfg.pre_softmax else ''}"
              f"{f' groups {cfg.num_groups}/{cfg.group_topk}' if cfg.group_topk else ''}"
              f"{f' capacity {cfg.capacity} {cfg.drop_policy}' if cfg.capacity else ''}{' pad' if cfg.pad else ''}"
              f"{f' shared {cfg.shared}' if cfg.shared else ''}{' gate' if cfg.shared_gate else ''}, "
              f"layers {''.join('M' if v else 'D' for v in moe_layers(cfg))})")
        params = init_params(cfg)
        tokens = make_tokens(cfg)
        N = cfg.mb * cfg.T
        logits = torch.randn(N, cfg.E) * 2
        bias = torch.randn(cfg.E) * 0.05 if cfg.expert_bias else None
        # 1. routing == the Hugging Face style written independently
        probs, rmap = route(cfg, logits, bias)
        e = rel_err(probs.numpy(), _hf_style_router(cfg, logits, bias).numpy())
        expect(e < 1e-14 and (rmap.sum(1) == cfg.topk).all(), f"route == the HF-style router (rel {e:.1e}), k per token")
        # 2. aux loss == E * sum_i f_i P_i; z-loss == mean (log sum exp)^2
        s, amap = aux_scores(cfg, logits)
        f_i = amap.sum(0) / (N * cfg.topk)
        P_i = s.mean(0)
        lhs = switch_loss(s, amap.sum(0).double(), N, cfg, 1.0).item()
        expect(abs(lhs - cfg.E * float((f_i * P_i).sum())) < 1e-14, f"aux loss == E sum f_i P_i ({lhs:.6f})")
        zl = z_loss(logits, 1.0).item()
        expect(abs(zl - float(np.mean(np.log(np.exp(logits.numpy()).sum(1)) ** 2))) < 1e-12, "z-loss == mean lse^2")
        # 3. capacity: at most C per expert, and the kept ones are the right ones
        if cfg.capacity:
            p2, m2 = drop(cfg, probs, rmap)
            C = capacity_of(cfg, N)
            good = bool((m2.sum(0) <= C).all())
            for e_ in range(cfg.E):
                routed = torch.nonzero(rmap[:, e_]).squeeze(1).tolist()
                if cfg.drop_policy == "position":
                    want = set(routed[:C])
                else:
                    want = set(sorted(routed, key=lambda n: (-float(probs[n, e_]), n))[:C])
                kept = set(torch.nonzero(m2[:, e_] & rmap[:, e_]).squeeze(1).tolist())
                good &= kept == want
                if cfg.pad:
                    good &= int(m2[:, e_].sum()) == min(C, N) and bool((p2[:, e_][~rmap[:, e_]] == 0).all())
            dropped = int((rmap & ~m2).sum())
            expect(good and dropped > 0, f"capacity {C}: kept = the {cfg.drop_policy} policy's choice per expert "
                                         f"({dropped} of {N * cfg.topk} dropped){', padded to C' if cfg.pad else ''}")
        # 4. permutation: rows grouped by expert, tokens ascending, counts, every routed pair once
        token, expert, counts = permute(rmap)
        good = bool((expert[1:] >= expert[:-1]).all()) and torch.equal(counts, rmap.sum(0))
        same = expert[1:] == expert[:-1]
        good &= bool((token[1:][same] > token[:-1][same]).all())
        good &= int(rmap[token, expert].sum()) == len(token) == int(rmap.sum())
        expect(good, f"permute: {len(token)} rows expert-major, tokens ascending, counts")
        # 5. the layer through permute/unpermute == the dense masked formulation (no permutation)
        il = 0
        mw = {k: params[k][il] for k in MOE_KEYS if k in params}
        m = torch.randn(cfg.mb, cfg.T, cfg.h)
        st = MoEState(cfg)
        if cfg.expert_bias:
            st.expert_bias[il] = bias.numpy().astype(np.float32)
        y1, _ = moe_layer(cfg, mw, m, il, st)
        y2 = moe_layer_dense(cfg, mw, m, torch.from_numpy(st.expert_bias[il].astype(np.float64)) if cfg.expert_bias else None)
        e = rel_err(y1.numpy(), y2.numpy())
        expect(e < 1e-13, f"MoE layer == the dense masked formulation (rel {e:.1e})")
        # 6. repeatability: two runs of 3 steps agree bitwise (losses, params, bias)
        c3 = replace(cfg, S=3, clip_grad=1.0)
        tr_a, tr_b = {}, {}
        la, na, _, pa = train(c3, params, tokens, tr_a)
        lb_, nb, _, pb = train(c3, params, tokens, tr_b)
        same = la == lb_ and na == nb and np.array_equal(flatten(c3, pa), flatten(c3, pb)) and \
            all(np.array_equal(tr_a[k], tr_b[k]) for k in tr_a)
        expect(same, "two runs of 3 steps agree bitwise")
        if cfg.expert_bias:
            tpe, eb = tr_a["tokens_per_expert"], tr_a["expert_bias"]
            mean = tpe.sum(-1, keepdims=True) / cfg.E
            want = (eb[:-1] + np.sign(mean - tpe).astype(np.float32) * np.float32(cfg.bias_rate)).astype(np.float32)
            expect(np.array_equal(want, eb[1:]) and np.abs(eb[-1]).max() > 0,
                   f"expert bias: b += rate sign(mean - count) each step (|b| {np.abs(eb[-1]).max():.4f})")
        # 7. the objective's gradient against central finite differences (routing held: a coordinate whose
        #    +-eps changes any routing decision is skipped and counted)
        loss, grads = loss_and_grads(cfg, params, tokens[0], MoEState(cfg))
        rng = np.random.default_rng(0)
        worst, skipped, tried = 0.0, 0, 0

        def objective(pp):
            rec = []
            st_ = MoEState(cfg)
            with torch.no_grad():
                obj, _ = step_objective(cfg, pp, tokens[0], st_, records=rec)
            return obj.item(), [r["map"] for r in rec]
        for pname, shape, _, _ in param_specs(cfg):
            for _ in range(2):
                idx = tuple(int(rng.integers(0, s_)) for s_ in shape)
                eps = 1e-5
                pp = {kk: vv.clone() for kk, vv in params.items()}
                pp[pname][idx] += eps
                lp, mp = objective(pp)
                pp[pname][idx] -= 2 * eps
                lm, mm = objective(pp)
                tried += 1
                if any(not torch.equal(a_, b_) for a_, b_ in zip(mp, mm)):
                    skipped += 1
                    continue
                fd = (lp - lm) / (2 * eps)
                an = grads[pname][idx].item()
                worst = max(worst, abs(fd - an) / (abs(an) + 1e-5))
        expect(worst < 1e-5 and skipped < tried // 4,
               f"gradient == finite differences on {tried - skipped} coordinates, {skipped} skipped "
               f"(worst |fd-an|/(|an|+1e-5) {worst:.1e})")
        # 8. the aux terms reach the router: with them off, the router's gradient changes
        if any(cfg.coeff(t) > 0 for t in LB_TYPES) or cfg.z_coeff:
            off = replace(cfg, lb=("none",), aux_coeff=(0.0,), z_coeff=0.0)
            _, g_off = loss_and_grads(off, params, tokens[0], MoEState(off))
            d = float((grads["router_weight"] - g_off["router_weight"]).abs().max())
            expect(d > 1e-8, f"the aux losses move the router's gradient (by {d:.1e})")
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
