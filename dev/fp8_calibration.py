#!/usr/bin/env python3
"""
fp8_calibration.py: the numbers behind the FP8-against-float64 bounds of tests/test_fp8.h.

megatron.c's FP8 training (bf16 model, the four linears of every layer in FP8: forward, input-gradient
and weight-gradient GEMMs) is emulated on the CPU for a vector file of dev/ref_gpt.py, and compared with
that file's float64 results by the measures the GPU test uses:
  grad0   step 0's gradient (every micro-batch accumulated), per tensor ||g - g_ref|| / ||g_ref||
  elem0   the same, per element: max_i |g_i - g_ref,i| / rms(g_ref) (a tolerance scaled to the tensor)
  loss    max over the steps of |loss_k - loss_ref,k| / |loss_ref,S-1 - loss_ref,0| (the loss's movement)
  norm    max over the steps of |norm_k - norm_ref,k| / norm_ref,k (the global gradient norm, before clipping)
  weights per tensor ||w_S - w_ref,S|| / ||w_ref,S - w_0|| (each tensor's own movement), the worst tensor
(key-bias entries of qkv_bias left out everywhere: their exact gradient is 0, see ref_gpt.py). It runs
bf16 alone, the three recipes, and the planted bugs, so that a bound can sit a margin above the recipes
and far below the bugs.

    python3 dev/fp8_calibration.py                          # dev/data/gpt_vectors/gpt2_fp8.bin
    python3 dev/fp8_calibration.py --file F.bin --runs bf16 delayed
    python3 dev/fp8_calibration.py --selftest               # the encoder and the emulation's plumbing

What is emulated (megatron.cu sections 12-13 and fp8_linear_*; everything in float64 holding the
values the GPU holds):
  bf16    the model copy of the weights is bf16(master); every activation a kernel stores is rounded to
          bf16 (embedding sum, norm outputs, linear outputs, attention output, GELU, residual adds,
          logits) and so is every activation gradient (the same points, backwards); GEMMs accumulate
          exactly (fp32 in the GPU: ~1e-7, far below everything here); weight gradients, the master
          weights and Adam in float64 (fp32 on the GPU).
  FP8     a cast is fp8(float32(x * scale)), round to nearest even with subnormals, saturating; the GEMM
          multiplies the dequantised operands (byte * scale_inv). Formats: hybrid, E4M3 for x and W and
          E5M2 for the output gradient dy (--fp8-format hybrid, as the test runs; --format e4m3: all E4M3).
          delayed     per-tensor scales from an amax history of 4 with max (the test's settings), scale
                      fp32(fp8_max / amax), all scales 1 in the first step; the amaxes a step records are
                      the forward casts of x, the weights' cast (once per step) and dy's cast; x^T is
                      recast with x's scale.
          tensorwise  per-tensor scale fp32(fp8_max / amax) of the tensor being cast; x^T with x's scale.
          blockwise   power-of-2 scales (fp32(fp8_max / amax) with its mantissa cleared): x and dy in 1x128
                      blocks of their rows for the forward and input gradient, W in 128x128 blocks; the
                      weight gradient dy^T x with dy^T and x^T cast in 1x128 blocks along the tokens.
  steps   each micro-batch's loss is its mean over its tokens divided by the micro-batch count (what
          megatron.c's grad_scale does); global-norm clipping, the sample-counted schedule and AdamW as
          ref_gpt.py's train().
The bugs (--runs names):
  blockwise_last_mb   blockwise, and the four linears' weight gradients keep only the last micro-batch's
                      (the weight-gradient GEMM with beta 0 instead of accumulate_gradients)
  delayed_no_dy_amax  delayed, and dy's amax never recorded (its cast not "fresh"): the gradients keep scale
                      1 after the first step
  no_wgrad_scale_inv  tensorwise, and the weight-gradient GEMM of one linear (layer 0's fc1) forgets dy's
                      scale_inv: that tensor's gradient is fp8_max / amax(dy) times too large
  wgrad_w_scale_inv   delayed, and the weight-gradient GEMMs dequantise x^T with the weight's scale_inv
                      instead of x's: right in the first step (every scale is still 1), every FP8 weight
                      gradient off by amax(W) / amax(x) after it
  wgrad_w_scale_inv_tw the same with tensorwise (wrong from the first step)
--seeds N repeats everything for N more seeds of the file's configuration (a new float64 reference each):
the spread of each measure over independent weights, batches and so rounding patterns, which the GPU's
own pattern (another accumulation order, flash attention) is one more sample of.
Not emulated: the GPU's accumulation order, flash attention's internal rounding, fp32 vs float64 in the
optimizer: all ~1e-3 of bf16's effects or less.
"""
import argparse
import math
import os
import sys
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_gpt as R  # noqa: E402

torch.set_default_dtype(torch.float64)

FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}   # mantissa bits, smallest normal exponent, max


# ------------------------------------------------------------------------------------------------
# Number formats
# ------------------------------------------------------------------------------------------------

def to_f32(x):
    return x.to(torch.float32).to(torch.float64)


def to_bf16(x):
    """float64 -> float32 -> bf16 (round to nearest even at each), back to float64."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def fp8_round(v, fmt):
    """The value of fp8(v) for float64 v holding float32 values: nearest, ties to even, subnormals,
    saturating at +-max (cvt.rn.satfinite)."""
    mbits, emin, fmax = FORMATS[fmt]
    a = v.abs()
    _, ex = torch.frexp(a)                       # a = m 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
    e = torch.clamp(ex.to(torch.float64) - 1, min=emin)
    ulp = torch.pow(2.0, e - mbits)
    q = torch.clamp(torch.round(a / ulp) * ulp, max=fmax)   # torch.round: half to even
    return torch.where(v < 0, -q, q)


def fp8_values(fmt):
    """Every finite non-negative value of a format, from its bit patterns (the self-test's table)."""
    mbits, emin, fmax = FORMATS[fmt]
    ebits = 4 if fmt == "e4m3" else 5
    bias = 2 ** (ebits - 1) - 1
    out = []
    for code in range(2 ** (ebits + mbits)):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        v = m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
        if v <= fmax:
            out.append(v)
    return np.array(sorted(set(out)))


def pow2_below(s):
    """The largest power of two not above s (s a positive normal float32)."""
    _, ex = torch.frexp(s)
    return torch.pow(2.0, ex.to(torch.float64) - 1)


def scale_of(amax, fmt):
    """fp32(fp8_max / amax), 1 where amax is 0 (megatron.cu fp8_scale_from_amax_value)."""
    fmax = torch.tensor(FORMATS[fmt][2], dtype=torch.float32)
    a = amax.to(torch.float32)
    s = torch.where(a > 0, fmax / torch.where(a > 0, a, torch.ones_like(a)), torch.ones_like(a))
    return s.to(torch.float64)


def cast(x, fmt, scale):
    """Per-tensor: dequantised fp8(float32(x * scale)) * float32(1 / scale) (scale a float32 value)."""
    s = np.float32(scale)
    return fp8_round(to_f32(x * float(s)), fmt) * float(np.float32(1.0) / s)


def cast_1x128(x, fmt):
    """x [N, K], 1x128 blocks along each row, power-of-2 scales."""
    N, K = x.shape
    b = x.reshape(N, K // 128, 128)
    s = pow2_below(scale_of(b.abs().amax(-1, keepdim=True), fmt))
    return (fp8_round(to_f32(b * s), fmt) / s).reshape(N, K)


def cast_128x128(w, fmt):
    """w [R, C] in 128x128 blocks, power-of-2 scales."""
    Rr, C = w.shape
    b = w.reshape(Rr // 128, 128, C // 128, 128)
    s = pow2_below(scale_of(b.abs().amax(dim=(1, 3), keepdim=True), fmt))
    return (fp8_round(to_f32(b * s), fmt) / s).reshape(Rr, C)


# ------------------------------------------------------------------------------------------------
# One run's FP8 state and the FP8 linear
# ------------------------------------------------------------------------------------------------

LINEARS = ("qkv", "proj", "fc1", "fc2")
X, W, G = 0, 1, 2


class FP8:
    """recipe None (bf16 only), "delayed", "tensorwise", "blockwise"; bug: a --runs bug name or None."""

    def __init__(self, recipe, bug=None, history_len=4, fmt="hybrid"):
        self.recipe, self.bug, self.history_len = recipe, bug, history_len
        self.fwd, self.bwd = "e4m3", ("e5m2" if fmt == "hybrid" else "e4m3")
        self.scale, self.amax, self.history, self.pos = {}, {}, {}, 0
        self.weights = {}                                      # this step's weight casts
        self.training = True

    def fmt(self, role):
        return self.bwd if role == G else self.fwd

    def record(self, key, t):
        if self.recipe == "delayed" and self.training:
            self.amax[key] = max(self.amax.get(key, 0.0), float(t.abs().max()))

    def per_tensor(self, key, t, fresh):
        """Per-tensor cast of t for slot key = (layer, linear, role)."""
        fmt = self.fmt(key[2])
        if self.recipe == "tensorwise" and fresh:
            self.scale[key] = float(scale_of(t.abs().max(), fmt))
        if self.recipe == "delayed" and fresh:
            self.record(key, t)
        return cast(t, fmt, self.scale.get(key, 1.0))

    def after_step(self):
        """Delayed scaling: this step's amaxes enter the histories (max of 4), the scales follow."""
        if self.recipe != "delayed":
            return
        for key, a in self.amax.items():
            h = self.history.setdefault(key, [0.0] * self.history_len)
            h[self.pos] = a
            if max(h) > 0:
                self.scale[key] = float(scale_of(torch.tensor(max(h)), self.fmt(key[2])))
        self.pos = (self.pos + 1) % self.history_len
        self.amax = {}

    def weight(self, key, w):
        """The weight's FP8 copy (cast once per step, at its first use)."""
        if key not in self.weights:
            if self.recipe == "blockwise":
                self.weights[key] = cast_128x128(w, self.fwd)
            else:
                self.weights[key] = self.per_tensor(key, w, fresh=True)
        return self.weights[key]


class Linear(torch.autograd.Function):
    """y [N, out] = x [N, in] W^T through FP8: the forward, input-gradient and weight-gradient GEMMs."""

    @staticmethod
    def forward(ctx, x, w, f8, layer, linear, last_micro_batch):
        kx, kw, kg = (layer, linear, X), (layer, linear, W), (layer, linear, G)
        if f8.recipe == "blockwise":
            xq = cast_1x128(x, f8.fwd)
        else:
            xq = f8.per_tensor(kx, x, fresh=True)
        wq = f8.weight(kw, w)
        ctx.save_for_backward(x, wq)
        ctx.f8, ctx.keys, ctx.last = f8, (kx, kw, kg), last_micro_batch
        return xq @ wq.T

    @staticmethod
    def backward(ctx, dy):
        x, wq = ctx.saved_tensors
        f8, (kx, kw, kg) = ctx.f8, ctx.keys
        if f8.recipe == "blockwise":
            dx = cast_1x128(dy, f8.bwd) @ wq
            dw = cast_1x128(dy.T.contiguous(), f8.bwd) @ cast_1x128(x.T.contiguous(), f8.fwd).T
            if f8.bug == "blockwise_last_mb" and not ctx.last:
                dw = torch.zeros_like(dw)             # overwritten by the next micro-batch (beta 0)
        else:
            fresh = not (f8.bug == "delayed_no_dy_amax")
            if fresh:
                dyq = f8.per_tensor(kg, dy, fresh=True)
            else:                                     # cast with the slot's scale, amax not recorded
                dyq = cast(dy, f8.bwd, f8.scale.get(kg, 1.0))
            dx = dyq @ wq
            xq = f8.per_tensor(kx, x, fresh=False)
            if f8.bug == "wgrad_w_scale_inv":         # the bytes of x^T times W's scale_inv
                xq = xq * (float(np.float32(1.0) / np.float32(f8.scale.get(kw, 1.0))) /
                           float(np.float32(1.0) / np.float32(f8.scale.get(kx, 1.0))))
            dw = dyq.T @ xq
            if f8.bug == "no_wgrad_scale_inv" and kx[:2] == (0, 2):
                dw = dw * f8.scale.get(kg, 1.0)       # dy's scale_inv not applied
        return dx, dw, None, None, None, None


class Round(torch.autograd.Function):
    """A stored bf16 activation: rounded forward, and its gradient rounded backward."""

    @staticmethod
    def forward(ctx, x):
        return to_bf16(x)

    @staticmethod
    def backward(ctx, g):
        return to_bf16(g)


# ------------------------------------------------------------------------------------------------
# The model (ref_gpt.py's forward with the precision's rounding points) and training
# ------------------------------------------------------------------------------------------------

def forward(cfg, p, tokens, f8, precise=False, last_micro_batch=True):
    """tokens [B, T] -> logits [B, T, Vp]; p: the bf16 model weights (leaves). f8 None: bf16 GEMMs.
    precise: no rounding at all (the self-test: must equal ref_gpt.forward)."""
    assert not cfg.layernorm_1p and cfg.hidden_dropout == 0 and cfg.attention_dropout == 0
    B, T = tokens.shape
    rnd = (lambda t: t) if precise else Round.apply

    def norm(x, w, b):
        return rnd(R.layer_norm(x, w, b, cfg.norm_eps) if cfg.norm == "layernorm" else R.rms_norm(x, w, cfg.norm_eps))

    def linear(x, w, b, layer, k):
        x2 = x.reshape(-1, x.shape[-1])
        y = x2 @ w.T if f8 is None or f8.recipe is None else Linear.apply(x2, w, f8, layer, k, last_micro_batch)
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return rnd(y if b is None else y + b)

    x = p["word_embeddings"][tokens]
    if cfg.position == "learned":
        x = x + p["position_embeddings"][:T].unsqueeze(0)
    x = rnd(x)
    ang = R.rope_angles(cfg, T) if cfg.position == "rope" else None
    for l in range(cfg.L):
        g = lambda k: p[k][l] if k in p else None  # noqa: E731
        a = norm(x, g("ln1_weight"), g("ln1_bias"))
        q, k, v = R.split_qkv(cfg, linear(a, g("qkv_weight"), g("qkv_bias"), l, 0))
        if ang is not None:
            q, k = rnd(R.apply_rope(q, ang)), rnd(R.apply_rope(k, ang))
        o = rnd(R.causal_attention(q, k, v)).transpose(1, 2).reshape(B, T, cfg.n * cfg.d)
        x = rnd(x + linear(o, g("proj_weight"), g("proj_bias"), l, 1))
        m = norm(x, g("ln2_weight"), g("ln2_bias"))
        z = linear(m, g("fc1_weight"), g("fc1_bias"), l, 2)
        z = rnd(R.silu(z[..., :cfg.f]) * z[..., cfg.f:] if cfg.swiglu else R.gelu_tanh(z))
        x = rnd(x + linear(z, g("fc2_weight"), g("fc2_bias"), l, 3))
    y = norm(x, p["final_ln_weight"], p.get("final_ln_bias"))
    out = p["output_weight"] if cfg.untied else p["word_embeddings"]
    return rnd(y @ out.T)


def step_gradients(cfg, master, batch, f8, precise=False):
    """One step's mean loss and gradients, micro-batch by micro-batch, as megatron.c runs them."""
    count = cfg.G // cfg.mb
    model = {k: (v.clone() if precise else to_bf16(v)).requires_grad_(True) for k, v in master.items()}
    if f8 is not None:
        f8.weights = {}
    total = {k: torch.zeros_like(v) for k, v in master.items()}
    loss = 0.0
    for i in range(count):
        t = torch.from_numpy(batch[i * cfg.mb:(i + 1) * cfg.mb].astype(np.int64))
        logits = forward(cfg, model, t[:, :-1], f8, precise, last_micro_batch=i == count - 1)
        ce = R.cross_entropy(logits, t[:, 1:])
        grads = torch.autograd.grad(ce / count, [model[k] for k in master])
        for k, gr in zip(master, grads):
            total[k] += gr
        loss += ce.item() / count
    return loss, total


def train(cfg, params0, tokens, f8):
    """ref_gpt.train's loop on step_gradients. Returns (losses, norms, final params, step 0's grads)."""
    hp = R.hyper(cfg)
    p = {k: v.clone() for k, v in params0.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    losses, norms, grads0 = [], [], None
    decay = {name: dcy for name, _, _, dcy in R.param_specs(cfg)}
    for k in range(cfg.S):
        loss, grads = step_gradients(cfg, p, tokens[k], f8)
        if grads0 is None:
            grads0 = {n: gr.clone() for n, gr in grads.items()}
        norm = math.sqrt(sum(float((gr ** 2).sum()) for gr in grads.values()))
        coeff = hp["clip_grad"] / (norm + 1e-6)
        if hp["clip_grad"] > 0 and coeff < 1.0:
            grads = {n: gr * coeff for n, gr in grads.items()}
        lr = R.learning_rate(cfg, k * cfg.G)
        b1, b2, eps, t = hp["b1"], hp["b2"], hp["eps"], k + 1
        for name in p:
            gr, wd = grads[name], (hp["weight_decay"] if decay[name] else 0.0)
            m[name] = b1 * m[name] + (1 - b1) * gr
            v2[name] = b2 * v2[name] + (1 - b2) * gr * gr
            p[name] = p[name] - lr * (m[name] / (1 - b1 ** t) / (torch.sqrt(v2[name] / (1 - b2 ** t)) + eps) +
                                      wd * p[name])
        if f8 is not None:
            f8.after_step()
        losses.append(loss)
        norms.append(norm)
    return losses, norms, p, grads0


# ------------------------------------------------------------------------------------------------
# The measures
# ------------------------------------------------------------------------------------------------

def key_bias(cfg):
    """Mask [L, qkv width] of the key-bias entries of qkv_bias (their exact gradient is 0)."""
    d, r = cfg.d, cfg.n // cfg.g
    mask = np.zeros((cfg.L, (cfg.n + 2 * cfg.g) * d), dtype=bool)
    for j in range(cfg.g):
        base = j * (r + 2) * d
        mask[:, base + r * d: base + (r + 1) * d] = True
    return mask


def kept(cfg, name, t):
    t = t.detach().numpy() if torch.is_tensor(t) else t
    if name == "qkv_bias":
        return t[~key_bias(cfg)]
    return t.reshape(-1)


def measures(cfg, ref, run, p0):
    """ref: dict losses, norms, grads0, final (float64); run: (losses, norms, final, grads0)."""
    losses, norms, final, grads0 = run
    out = {"grad0": {}, "elem0": {}, "weights": {}}
    for name, _, _, _ in R.param_specs(cfg):
        g, gr = kept(cfg, name, grads0[name]), kept(cfg, name, ref["grads0"][name])
        out["grad0"][name] = np.linalg.norm(g - gr) / np.linalg.norm(gr)
        out["elem0"][name] = np.abs(g - gr).max() / (np.linalg.norm(gr) / math.sqrt(gr.size))
        w, wr, w0 = kept(cfg, name, final[name]), kept(cfg, name, ref["final"][name]), kept(cfg, name, p0[name])
        out["weights"][name] = np.linalg.norm(w - wr) / np.linalg.norm(wr - w0)
    move = abs(ref["losses"][-1] - ref["losses"][0])
    out["loss"] = [abs(a - b) / move for a, b in zip(losses, ref["losses"])]
    out["norm"] = [abs(a - b) / b for a, b in zip(norms, ref["norms"])]
    return out


def worst(d):
    k = max(d, key=lambda n: d[n])
    return d[k], k


def selftest(cfg, params0, tokens):
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)

    rng = np.random.default_rng(7)
    for fmt in FORMATS:                   # the encoder against nearest-even search over the code table
        vals = fp8_values(fmt)
        x = np.concatenate([vals, (vals[1:] + vals[:-1]) / 2,              # every code and every tie
                            np.exp(rng.uniform(np.log(vals[1] / 4), np.log(vals[-1] * 2), 20000))])
        x = x.astype(np.float32).astype(np.float64)
        got = fp8_round(torch.from_numpy(np.concatenate([x, -x])), fmt).numpy()
        want = []
        for a in x:
            i = np.searchsorted(vals, a)
            if i >= len(vals):
                want.append(vals[-1]); continue
            lo, hi = vals[max(i - 1, 0)], vals[i]
            if a == hi or hi - a < a - lo:
                want.append(hi)
            elif a - lo < hi - a:
                want.append(lo)
            else:                          # a tie: the even code (codes are ordered like values)
                want.append(lo if (np.searchsorted(vals, lo) % 2 == 0) else hi)
        want = np.array(want)
        expect(np.array_equal(got, np.concatenate([want, -want])),
               f"{fmt}: fp8_round == nearest-even over the {len(vals)} non-negative codes ({2 * len(x)} values)")
    t = torch.from_numpy(rng.normal(size=(256, 384)) * np.exp(rng.uniform(-3, 3, size=(256, 1))))
    q = cast_1x128(t, "e4m3")
    rel = (q - t).abs() / t.abs().reshape(256, 3, 128).amax(-1, keepdim=True).expand(256, 3, 128).reshape(256, 384)
    expect(float(rel.max()) <= 2.0 ** -4 * 2, f"1x128 blocks: |error| <= 2^-4 x 2 x block amax ({float(rel.max()):.3g})")
    # the emulation's plumbing without rounding: ref_gpt's loss and gradients exactly
    cfg1 = cfg
    loss, grads = step_gradients(cfg1, params0, tokens[0], None, precise=True)
    rl, rg, _ = R.loss_and_grads(cfg1, params0, tokens[0])
    e = max(float((grads[k] - rg[k]).abs().max() / rg[k].abs().max()) for k in rg)
    expect(abs(loss - rl) < 1e-12 and e < 1e-10, f"unrounded micro-batches == ref_gpt.loss_and_grads "
                                                  f"(loss {abs(loss - rl):.1e}, grads rel {e:.1e})")
    print("selftest", "passed" if ok else "FAILED")
    return ok


BUGS = {"blockwise_last_mb": "blockwise", "delayed_no_dy_amax": "delayed", "no_wgrad_scale_inv": "tensorwise",
        "wgrad_w_scale_inv": "delayed", "wgrad_w_scale_inv_tw": "tensorwise"}


def calibrate(cfg, p0, tokens, ref, runs, verbose, label="", fmt="hybrid"):
    """Runs each of `runs` and prints its row; returns {run: measures}."""
    out = {}
    for name in runs:
        recipe = None if name == "bf16" else BUGS.get(name, name)
        f8 = FP8(recipe, bug=name if name in BUGS else None, fmt=fmt)
        if f8.bug == "wgrad_w_scale_inv_tw":
            f8.bug = "wgrad_w_scale_inv"
        m = measures(cfg, ref, train(cfg, p0, tokens, f8), p0)
        out[name] = m
        g, gn = worst(m["grad0"])
        e, en = worst(m["elem0"])
        w, wn = worst(m["weights"])
        print(f"{label}{name:20s} {g:7.4f} {gn:>15s} {e:7.3f} {en:>15s} {max(m['loss']):7.4f} {max(m['norm']):7.4f} "
              f"{max(m['norm'][1:]):8.4f} {w:7.4f} {wn:>15s}", flush=True)
        if verbose:
            for n in m["grad0"]:
                print(f"    {n:20s} grad0 {m['grad0'][n]:.4f} elem0 {m['elem0'][n]:.3f} weights {m['weights'][n]:.4f}")
            print("    loss per step", " ".join(f"{x:.4f}" for x in m["loss"]))
            print("    norm per step", " ".join(f"{x:.4f}" for x in m["norm"]))
    return out


def reference(cfg, p0, tokens):
    """ref_gpt.py's float64 results for a configuration (what a vector file holds)."""
    _, grads0, _ = R.loss_and_grads(cfg, p0, tokens[0])
    losses, norms, _, final = R.train(cfg, p0, tokens)
    return {"losses": losses, "norms": norms, "grads0": grads0, "final": final}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--file", default=os.path.join(R.OUT_DIR, "gpt2_fp8.bin"))
    ap.add_argument("--runs", nargs="+", default=["bf16", "delayed", "tensorwise", "blockwise"] + list(BUGS))
    ap.add_argument("--seeds", type=int, default=0, help="also N more seeds of the file's configuration")
    ap.add_argument("--format", choices=["hybrid", "e4m3"], default="hybrid", help="--fp8-format (hybrid)")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="every tensor's numbers")
    args = ap.parse_args()
    cfg, a = R.read_file(args.file)
    p0 = R.unflatten(cfg, a["params0"])
    tokens = a["tokens"]
    if args.selftest:
        sys.exit(0 if selftest(cfg, p0, tokens) else 1)
    ref = {"losses": [float(x) for x in a["losses"]], "norms": [float(x) for x in a["grad_norms"]],
           "grads0": R.unflatten(cfg, a["grads0"]), "final": R.unflatten(cfg, a["params_final"])}
    print(f"{args.file}: {cfg.flavor} L={cfg.L} h={cfg.h} f={cfg.f} T={cfg.T} G={cfg.G} mb={cfg.mb} S={cfg.S}; "
          f"reference loss {ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f} "
          f"(moves {abs(ref['losses'][-1] - ref['losses'][0]):.4f})")
    print(f"{'run':20s} {'grad0':>23s} {'elem0':>23s} {'loss':>7s} {'norm':>7s} {'norm k>0':>8s} {'weights':>23s}")
    calibrate(cfg, p0, tokens, ref, args.runs, args.verbose, fmt=args.format)
    base = R.CONFIGS.get(os.path.basename(args.file)[:-4])
    for k in range(1, args.seeds + 1):
        c = replace(base if base else cfg, seed=cfg.seed + 1000 * k, clip_grad=cfg.clip_grad)
        q0, tk = R.init_params(c), R.make_tokens(c)
        r = reference(c, q0, tk)
        print(f"seed {c.seed}: reference loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)
        calibrate(c, q0, tk, r, args.runs, args.verbose, label="  ", fmt=args.format)


if __name__ == "__main__":
    main()
