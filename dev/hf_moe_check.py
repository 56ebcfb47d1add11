#!/usr/bin/env python3
"""
hf_moe_check.py: end-to-end check of prepro/convert_hf's mixtures of experts against Hugging Face
transformers' MixtralForCausalLM and Qwen3MoeForCausalLM (dev/hf_check.py does GPT-2 and Llama; this
script uses its helpers and prints the same table).

    make prepro/convert_hf && python dev/hf_moe_check.py           # from the repository root
    python dev/hf_moe_check.py --hf-logits ./dev/hf_logits --keep /tmp/hfm
    python dev/hf_moe_check.py --write DIR     # only write the models and their reference logits (the GPU
                                               # test hf_gpu_moe_transformers in tests/test_hf.h reads them)

Needs torch, numpy, transformers (4.51 or later: Qwen3-MoE) and safetensors; no internet (the models are
built locally). Three small random models (MODELS below), every weight perturbed so that no mapping
error hides behind a zero or a one, the routers' weights large enough that the top-k decisions are far
from ties (the closest decision gap is printed with each model):

  mixtral        MixtralForCausalLM: 4 experts, top-2, GQA, untied, rope_theta 1e6
  qwen3          Qwen3MoeForCausalLM: 8 experts of width 32, top-4, norm_topk_prob false (our
                 --moe-router-pre-softmax), head_dim 24 != hidden / heads, q_norm / k_norm, untied
  qwen3_tied     Qwen3MoeForCausalLM: norm_topk_prob true (our default router), tied embeddings

For each it
  1. saves the model (save_pretrained, safetensors) and imports it with `prepro/convert_hf --import`;
     the printed train_gpt flags must carry the MoE settings (--num-experts, --moe-router-topk,
     --moe-ffn-hidden-size, --moe-router-pre-softmax for norm_topk_prob false, --qk-layernorm,
     --moe-aux-loss-coeff = router_aux_loss_coef);
  2. reads the checkpoint back: the header's MoE words (experts, expert width, MoE layers), Adam m = v = 0,
     and the master weights equal, bitwise, to the HF tensors laid out as stated here (router [E, h],
     each expert's fc1 = [gate (w1 / gate_proj); up (w3 / up_proj)], fc2 = w2 / down_proj, q_norm / k_norm);
     then dev/ref_moe.py's float64 forward of the checkpoint's weights must give the float64 transformers
     model's logits (relative norm error < 1e-6: a float64 transformers model still computes RoPE's cos/sin
     and the router's softmax in float32, ~1e-7 here; a mapping or routing error is O(0.1)): the mapping
     and the router's semantics (Megatron's softmax after top-k = HF's softmax, top-k, renormalised;
     pre-softmax = norm_topk_prob false) together;
  3. GPU, when the logits tool exists: `HF_LOGITS CKPT TOKENS LOGITS --moe-router-topk K
     [--moe-router-pre-softmax] [--bf16]` against transformers' fp32 logits: relative norm error < 1e-5 in
     fp32; bf16 < 3e-2 over the tokens once the 10% worst are set aside (bf16 rounding of the router's
     input can flip a near-tie top-k decision, which changes that token's output entirely);
  4. exports the checkpoint back (`convert_hf --export --moe-router-topk K [...] --moe-aux-loss-coeff C`),
     loads it with from_pretrained (no missing / unexpected keys), config.json's fields as the original's,
     every tensor and the logits bitwise; a bfloat16 export loads; re-importing the export gives a
     byte-identical checkpoint; an export without --moe-router-topk is refused (exit 2, one line);
  5. the model saved sharded and in bfloat16 imports to a byte-identical checkpoint (bf16: the upcast one);
  6. refused with one line: Mixtral's sliding_window and router_jitter_noise, Qwen3-MoE's
     decoder_sparse_step 2, mlp_only_layers, use_sliding_window, attention_bias, a shared expert size,
     a missing expert tensor.

Prints one table and exits non-zero if any row failed.
"""
import argparse
import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_check  # noqa: E402  (GPT-2 / Llama checks: the helpers and the table)
from hf_check import (CK_HEADER_WORDS, clean_load, load_logged, read_checkpoint, read_logits, record, rel_err,  # noqa: E402
                      rows, run, write_tokens)
import ref_moe  # noqa: E402  (sets torch's default dtype to float64: put it back)

torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

L, H, NH, NG, V, P, B, T = 2, 64, 4, 2, 300, 128, 2, 32
MODELS = {  # name: class, experts, top-k, expert width, head dim, norm_topk_prob, tied, aux coefficient
    "mixtral": dict(qwen=False, E=4, k=2, fe=48, d=16, norm=True, tied=False, coef=0.02),
    "qwen3": dict(qwen=True, E=8, k=4, fe=32, d=24, norm=False, tied=False, coef=0.001),
    "qwen3_tied": dict(qwen=True, E=8, k=2, fe=32, d=16, norm=True, tied=True, coef=0.0),
}
QWEN3_FFN = 96  # Qwen3-MoE's intermediate_size (the dense MLP's, unused with every layer MoE)
# header words (megatron.h, MT_CK_*): the MoE shape after MT_CK_QK_LAYERNORM
CK_QK_LAYERNORM, CK_NUM_EXPERTS, CK_MOE_FFN, CK_MOE_SHARED, CK_MOE_SHARED_GATE, CK_MOE_LAYERS = 47, 48, 49, 50, 51, 52
CONFIG_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
                 "rope_theta", "rope_scaling", "sliding_window", "num_experts_per_tok", "router_aux_loss_coef",
                 "output_router_logits"]
MIXTRAL_FIELDS = ["num_local_experts", "router_jitter_noise"]
QWEN3_FIELDS = ["num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "use_sliding_window", "attention_bias"]


def make_model(name, seed):
    m = MODELS[name]
    torch.manual_seed(seed)
    common = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NG, vocab_size=V,
                  max_position_embeddings=P, num_experts_per_tok=m["k"], tie_word_embeddings=m["tied"],
                  router_aux_loss_coef=m["coef"], bos_token_id=V - 1, eos_token_id=V - 1)
    if m["qwen"]:
        cfg = Qwen3MoeConfig(intermediate_size=QWEN3_FFN, moe_intermediate_size=m["fe"], num_experts=m["E"],
                             head_dim=m["d"], norm_topk_prob=m["norm"], rms_norm_eps=1e-6, rope_theta=10000.0, **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = MixtralConfig(intermediate_size=m["fe"], num_local_experts=m["E"], rms_norm_eps=1e-5, rope_theta=1e6,
                            **common)
        model = MixtralForCausalLM(cfg)
    model.eval()
    if hasattr(model, "set_experts_implementation"):  # transformers 5: its grouped_mm path takes no float64
        model.set_experts_implementation("eager")
    with torch.no_grad():  # no unit norm weights, nothing at its initial value; routers far from ties
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            elif pname.endswith(".gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.detach().cpu().numpy()


def decision_gap(model64, tokens, k):
    """The closest top-k decision of the float64 model on these tokens: min over layers and tokens of the
    gap between the k-th and (k+1)-th router logit (nan where this transformers does not return them)."""
    try:
        with torch.no_grad():
            out = model64(torch.from_numpy(tokens).long(), output_router_logits=True)
        router_logits = [r if torch.is_tensor(r) else r[0] for r in out.router_logits]
    except Exception:  # noqa: BLE001  (only a printed figure)
        return float("nan")
    gaps = []
    for logits in router_logits:
        s = torch.sort(logits.double(), dim=-1, descending=True).values
        if s.shape[-1] > k:
            gaps.append(float((s[:, k - 1] - s[:, k]).min()))
    return min(gaps) if gaps else float("inf")


def canonical(name, sd):
    """Our canonical parameter vector of the tensors save_pretrained wrote (sd: the per-expert names, as
    on disk; transformers 5 fuses the experts in memory), stated on its own (ref_moe.py's order:
    word_embeddings, ln1, qkv (Megatron's grouped rows), [q_layernorm, k_layernorm,] proj, ln2, router,
    expert fc1 [E, 2fe, h] = per expert [gate; up], expert fc2 [E, h, fe], final norm, output layer)."""
    m = MODELS[name]
    d, E = m["d"], m["E"]
    Vp = (V + 127) // 128 * 128
    t = {k: v.detach().float().numpy() for k, v in sd.items()}

    def padded(w):
        out = np.zeros((Vp, H), dtype=np.float32)
        out[:V] = w
        return out

    layer = lambda l, n: t[f"model.layers.{l}.{n}.weight"]  # noqa: E731
    moe = "mlp" if m["qwen"] else "block_sparse_moe"
    names = ("gate_proj", "up_proj", "down_proj") if m["qwen"] else ("w1", "w3", "w2")
    qkv = []
    for l in range(L):
        q = layer(l, "self_attn.q_proj").reshape(NG, NH // NG * d, H)
        k = layer(l, "self_attn.k_proj").reshape(NG, d, H)
        v = layer(l, "self_attn.v_proj").reshape(NG, d, H)
        qkv.append(np.concatenate([q, k, v], axis=1).reshape(-1))
    pieces = [padded(t["model.embed_tokens.weight"]).reshape(-1)]
    pieces += [layer(l, "input_layernorm") for l in range(L)] + qkv
    if m["qwen"]:
        pieces += [layer(l, "self_attn.q_norm") for l in range(L)] + [layer(l, "self_attn.k_norm") for l in range(L)]
    pieces += [layer(l, "self_attn.o_proj").reshape(-1) for l in range(L)]
    pieces += [layer(l, "post_attention_layernorm") for l in range(L)]
    pieces += [layer(l, f"{moe}.gate").reshape(-1) for l in range(L)]
    pieces += [np.concatenate([layer(l, f"{moe}.experts.{e}.{names[0]}"), layer(l, f"{moe}.experts.{e}.{names[1]}")])
               .reshape(-1) for l in range(L) for e in range(E)]
    pieces += [layer(l, f"{moe}.experts.{e}.{names[2]}").reshape(-1) for l in range(L) for e in range(E)]
    pieces += [t["model.norm.weight"]]
    if not m["tied"]:
        pieces += [padded(t["lm_head.weight"]).reshape(-1)]
    return np.concatenate(pieces).astype(np.float32)


def ref_config(name):
    m = MODELS[name]
    return ref_moe.MoEConfig(flavor="llama", L=L, h=H, n=NH, g=NG, kv=m["d"], f=QWEN3_FFN if m["qwen"] else m["fe"],
                             Vp=(V + 127) // 128 * 128, T=T, P=P, G=B, mb=B, untied=not m["tied"],
                             rotary_base=10000.0 if m["qwen"] else 1e6, norm_eps=1e-6 if m["qwen"] else 1e-5,
                             qk_layernorm=m["qwen"], E=m["E"], topk=m["k"], fe=m["fe"], pre_softmax=not m["norm"],
                             lb=("aux_loss",), aux_coeff=(m["coef"],))


@contextlib.contextmanager
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def moe_flags(name):
    m = MODELS[name]
    return ["--moe-router-topk", str(m["k"])] + ([] if m["norm"] else ["--moe-router-pre-softmax"])


def check_moe(name, seed, args, work):
    conv = args.convert_hf
    m = MODELS[name]
    title = "Qwen3-MoE" if m["qwen"] else "Mixtral"
    model = make_model(name, seed)
    hf_dir = os.path.join(work, name + "_hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, T), dtype=np.int64)
    ref32 = hf_logits(model, tokens)
    model64 = make_model(name, seed).double()
    ref64 = hf_logits(model64, tokens)
    gap = decision_gap(model64, tokens, m["k"])

    # 1. import
    ckpt = os.path.join(work, name + "_ckpt")
    rc, out, err = run([conv, "--import", hf_dir, "--save", ckpt])
    if not record(f"{name}: import ({title})", rc == 0, err.strip() or "rc 0"):
        return
    want = [f"--num-experts {m['E']} --moe-router-topk {m['k']} --moe-ffn-hidden-size {m['fe']}",
            "--normalization RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type rope",
            f"--group-query-attention --num-query-groups {NG}", f"--vocab-size {V}",
            f"--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff {m['coef']:g}"]
    want += ["--qk-layernorm"] if m["qwen"] else []
    want += [] if m["norm"] else ["--moe-router-pre-softmax"]
    want += [f"--kv-channels {m['d']}"] if m["d"] * NH != H else []
    missing = [f for f in want if f not in out]
    unwanted = [f for f in ["--moe-router-pre-softmax", "--qk-layernorm", "--untie"]
                if f in out and not {"--moe-router-pre-softmax": not m["norm"], "--qk-layernorm": m["qwen"],
                                     "--untie": not m["tied"]}[f]]
    record(f"{name}: printed train_gpt flags", not missing and not unwanted,
           "missing " + ", ".join(missing) if missing else ("unwanted " + ", ".join(unwanted) if unwanted else "all present"))

    # 2. the checkpoint, read back: header words, the canonical layout bitwise, the float64 forward
    it, header, arrays, n, raw = read_checkpoint(ckpt)
    want_params = canonical(name, load_file(os.path.join(hf_dir, "model.safetensors")))
    words = (header[CK_QK_LAYERNORM] == int(m["qwen"]) and header[CK_NUM_EXPERTS] == m["E"] and
             header[CK_MOE_FFN] == m["fe"] and header[CK_MOE_SHARED] == 0 and header[CK_MOE_SHARED_GATE] == 0 and
             header[CK_MOE_LAYERS] == L and n == want_params.size)
    master, adam = arrays[:n], arrays[n:3 * n]
    record(f"{name}: checkpoint header (MoE words), Adam zero", bool(words and not adam.any() and
                                                                     len(raw) == 8 * CK_HEADER_WORDS + 12 * n),
           f"{n} parameters" + ("" if words else f"; header {list(header[:56])}"))
    same = master.shape == want_params.shape and np.array_equal(master.view(np.uint32), want_params.view(np.uint32))
    record(f"{name}: canonical weights = HF tensors in our layout", bool(same),
           "bitwise (router, experts' [gate; up] and down, qk norms)" if same else "differ")
    cfg = ref_config(name)
    with float64_default():
        ours64 = ref_moe.forward(cfg, ref_moe.unflatten(cfg, master), torch.from_numpy(tokens))[0].numpy()[:, :, :V]
    e = rel_err(ours64, ref64)
    record(f"{name}: ref_moe.py fp64 forward of the checkpoint vs transformers fp64", e < 1e-6,
           f"rel err {e:.1e}; closest top-k decision gap {gap:.2e}")

    # 3. GPU logits through the trainer
    tool = args.hf_logits
    if tool and os.path.exists(tool):
        tok_path = os.path.join(work, name + "_tokens.bin")
        write_tokens(tok_path, tokens)
        for prec, flags in (("fp32", []), ("bf16", ["--bf16"])):
            out_path = os.path.join(work, f"{name}_logits_{prec}.bin")
            rc, out, err = run([tool, ckpt, tok_path, out_path] + moe_flags(name) + flags)
            if rc != 0:
                record(f"{name}: GPU logits {prec} vs transformers fp32", False, (err.strip() or out.strip())[-200:])
                continue
            ours = read_logits(out_path)[:, :, :V]
            if prec == "fp32":
                e = rel_err(ours, ref32)
                record(f"{name}: GPU logits fp32 vs transformers fp32", e < 1e-5, f"rel err {e:.1e} (tol 1e-5)")
            else:
                e, worst = trimmed_rel_err(ours, ref32)
                record(f"{name}: GPU logits bf16 vs transformers fp32", e < 3e-2,
                       f"rel err {e:.1e} without the 10% worst tokens (tol 3e-2); the worst token {worst:.1e}")
    else:
        record(f"{name}: GPU logits vs transformers", None, f"no {tool} (see the docstring)")

    # 4. export (with the router's settings) and reload
    out_dir = os.path.join(work, name + "_export")
    rc, out, err = run([conv, "--export", ckpt, "--out", out_dir + "_refused"])
    lines = err.strip().splitlines()
    record(f"{name}: export without --moe-router-topk refused", rc == 2 and len(lines) == 1 and "--moe-router-topk" in err
           and not os.path.exists(out_dir + "_refused"), lines[0] if lines else f"rc {rc}")
    flags = moe_flags(name) + ["--moe-aux-loss-coeff", repr(m["coef"])]
    rc, out, err = run([conv, "--export", ckpt, "--out", out_dir] + flags)
    cls = Qwen3MoeForCausalLM if m["qwen"] else MixtralForCausalLM
    if record(f"{name}: export", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(out_dir, cls)
        ok, detail = clean_load(info, log)
        record(f"{name}: from_pretrained(export) loads cleanly", ok, detail)
        fields = CONFIG_FIELDS + (QWEN3_FIELDS if m["qwen"] else MIXTRAL_FIELDS)

        def field(cfg, k):  # head_dim None (transformers 5's Mixtral default) is hidden / heads
            v = getattr(cfg, k, None)
            return cfg.hidden_size // cfg.num_attention_heads if k == "head_dim" and v is None else v

        diff = [k for k in fields if field(back.config, k) != field(model.config, k)]
        record(f"{name}: exported config.json", not diff, "differs: " + ", ".join(
            f"{k} {field(back.config, k)!r} != {field(model.config, k)!r}" for k in diff) if diff else
               f"{len(fields)} fields as the original's")
        sd0, sd1 = model.state_dict(), back.state_dict()
        diff = [k for k in sd0 if k not in sd1 or not torch.equal(sd0[k], sd1[k])]
        record(f"{name}: exported tensors bitwise equal", not diff and set(sd0) == set(sd1),
               f"{len(sd0)} tensors" + (", differ: " + ", ".join(diff[:3]) if diff else ""))
        e = float(np.abs(hf_logits(back, tokens) - ref32).max())
        record(f"{name}: round-trip logits vs original", e == 0, "bitwise" if e == 0 else f"max abs diff {e:.1e}")
        keys = set(load_file(os.path.join(out_dir, "model.safetensors")))
        orig = set(load_file(os.path.join(hf_dir, "model.safetensors")))
        record(f"{name}: exported keys = save_pretrained's", keys == orig, f"{len(keys)} keys")
        again = os.path.join(work, name + "_reimport")
        rc, _, err = run([conv, "--import", out_dir, "--save", again])
        same = rc == 0 and read_checkpoint(again)[4] == raw
        record(f"{name}: import(export) checkpoint", same, err.strip() if rc else ("byte-identical" if same else "differs"))
    bf_dir = os.path.join(work, name + "_export_bf16")
    rc, out, err = run([conv, "--export", ckpt, "--out", bf_dir, "--dtype", "bfloat16"] + flags)
    if record(f"{name}: export --dtype bfloat16", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(bf_dir, cls)
        ok, detail = clean_load(info, log)
        e, _ = trimmed_rel_err(hf_logits(back.float(), tokens), ref32)
        record(f"{name}: bf16 export loads cleanly, logits close", ok and e < 3e-2, f"{detail}; rel err {e:.1e}")

    # 5. the same model, stored differently: the checkpoint must come out byte-identical
    shard_dir = os.path.join(work, name + "_sharded")
    model.save_pretrained(shard_dir, safe_serialization=True, max_shard_size="100KB")
    bf_src = os.path.join(work, name + "_bf16src")
    model_bf = make_model(name, seed).to(torch.bfloat16)
    model_bf.save_pretrained(bf_src, safe_serialization=True)
    ref_bf = os.path.join(work, name + "_bf16ref")
    model_bf.float().save_pretrained(ref_bf, safe_serialization=True)
    rc, _, err = run([conv, "--import", ref_bf, "--save", ref_bf + "_ckpt"])
    variants = {"sharded (index.json)": (shard_dir, raw),
                "stored in bfloat16": (bf_src, read_checkpoint(ref_bf + "_ckpt")[4] if rc == 0 else None)}
    for label, (src, want_raw) in variants.items():
        dst = src + "_ckpt"
        rc, _, err = run([conv, "--import", src, "--save", dst])
        same = rc == 0 and want_raw is not None and read_checkpoint(dst)[4] == want_raw
        record(f"{name}: import {label}", same, err.strip() if rc else ("byte-identical checkpoint" if same else "differs"))


def trimmed_rel_err(ours, ref, drop=0.1):
    """Relative norm error over the tokens once the `drop` share with the largest error is set aside, and
    the largest per-token relative error (a flipped routing decision changes one token entirely)."""
    a = np.asarray(ours, dtype=np.float64).reshape(-1, ref.shape[-1])
    b = np.asarray(ref, dtype=np.float64).reshape(-1, ref.shape[-1])
    num, den = ((a - b) ** 2).sum(-1), (b ** 2).sum(-1)
    per = np.sqrt(num / np.maximum(den, 1e-300))
    keep = np.argsort(per)[:len(per) - int(drop * len(per))]
    return float(np.sqrt(num[keep].sum() / den[keep].sum())), float(per.max())


def reject_cases(args, work):
    conv = args.convert_hf
    sources = {}
    for name in ("mixtral", "qwen3"):
        src = os.path.join(work, name + "_reject_src")
        make_model(name, 11).save_pretrained(src, safe_serialization=True)
        sources[name] = src
    sd = load_file(os.path.join(sources["qwen3"], "model.safetensors"))
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    missing_path = os.path.join(work, "qwen3_missing.safetensors")
    save_file(sd, missing_path, metadata={"format": "pt"})
    cases = [  # label, model, config change, weights file (None: the model's), expected words
        ("Mixtral sliding_window 4096", "mixtral", lambda c: c.update(sliding_window=4096), None,
         "sliding_window set is not supported"),
        ("Mixtral router_jitter_noise 0.1", "mixtral", lambda c: c.update(router_jitter_noise=0.1), None,
         "router_jitter_noise 0.1 is not supported"),
        ("Qwen3-MoE decoder_sparse_step 2", "qwen3", lambda c: c.update(decoder_sparse_step=2), None,
         "MoE models with dense layers are not built yet"),
        ("Qwen3-MoE mlp_only_layers [0]", "qwen3", lambda c: c.update(mlp_only_layers=[0]), None,
         "mlp_only_layers lists 1 layers with a dense MLP"),
        ("Qwen3-MoE use_sliding_window", "qwen3", lambda c: c.update(use_sliding_window=True, sliding_window=16), None,
         "use_sliding_window true is not supported"),
        ("Qwen3-MoE attention_bias", "qwen3", lambda c: c.update(attention_bias=True), None,
         "attention_bias true is not supported"),
        ("a shared expert", "qwen3", lambda c: c.update(shared_expert_intermediate_size=64), None,
         "has no shared expert"),
        ("a missing expert tensor", "qwen3", lambda c: None, missing_path,
         "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing"),
    ]
    for k, (label, name, change, weights, words) in enumerate(cases):
        src = os.path.join(work, "mcase%d" % k)
        os.makedirs(src)
        c = json.load(open(os.path.join(sources[name], "config.json")))
        change(c)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(c, f)
        shutil.copy(weights or os.path.join(sources[name], "model.safetensors"), os.path.join(src, "model.safetensors"))
        dst = src + "_ckpt"
        rc, out, err = run([conv, "--import", src, "--save", dst])
        lines = err.strip().splitlines()
        message = lines[0].replace(src + "/", "") if lines else ""
        ok = rc == 1 and len(lines) == 1 and words in message and not os.path.exists(dst)
        record(f"rejects {label}", ok, message if lines else f"rc {rc}, no message")


def write_models(out):
    """--write: for each model, OUT/NAME/ (save_pretrained) and OUT/NAME.ref.bin: int32 B, T, V, the tokens
    int32 [B, T], the float64 transformers model's logits float64 [B, T, V] (little-endian)."""
    os.makedirs(out, exist_ok=True)
    for i, name in enumerate(MODELS):
        seed = 2024 + i
        model = make_model(name, seed)
        model.save_pretrained(os.path.join(out, name), safe_serialization=True)
        tokens = np.random.default_rng(seed).integers(0, V, size=(B, T), dtype=np.int64)
        model64 = make_model(name, seed).double()
        logits = hf_logits(model64, tokens)
        with open(os.path.join(out, name + ".ref.bin"), "wb") as f:
            f.write(struct.pack("<iii", B, T, V))
            f.write(tokens.astype("<i4").tobytes())
            f.write(logits.astype("<f8").tobytes())
        print(f"{name}: {out}/{name} and {name}.ref.bin (closest top-k decision gap "
              f"{decision_gap(model64, tokens, MODELS[name]['k']):.2e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--convert-hf", default=os.path.join(hf_check.ROOT, "prepro", "convert_hf"))
    ap.add_argument("--hf-logits", default=os.path.join(hf_check.ROOT, "dev", "hf_logits"))
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    ap.add_argument("--write", metavar="DIR", help="only write the models and their reference logits to DIR")
    args = ap.parse_args()
    transformers.logging.set_verbosity_warning()
    if args.write:
        write_models(args.write)
        return
    if not os.path.exists(args.convert_hf):
        sys.exit(f"hf_moe_check: {args.convert_hf} not found: build it with `make prepro/convert_hf`")
    work = args.keep or tempfile.mkdtemp(prefix="hf_moe_check_")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    try:
        for i, name in enumerate(MODELS):
            check_moe(name, 5678 + i, args, work)
        reject_cases(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'check':<{width}}  result  detail")
    for check, status, detail in rows:
        print(f"{check:<{width}}  {status:<6}  {detail}")
    failed = sum(r[1] == "FAIL" for r in rows)
    print(f"{sum(r[1] == 'PASS' for r in rows)} passed, {failed} failed, {sum(r[1] == 'SKIP' for r in rows)} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
