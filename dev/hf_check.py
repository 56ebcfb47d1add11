#!/usr/bin/env python3
"""
hf_check.py: end-to-end check of prepro/convert_hf against Hugging Face transformers' GPT-2 and Llama.

    make prepro/convert_hf && python dev/hf_check.py            # from the repository root
    python dev/hf_check.py --hf-logits ./dev/hf_logits --keep /tmp/hfc

Needs torch, numpy, transformers and safetensors (no internet: the models are built locally, never
downloaded). For each of two small random GPT2LMHeadModels (2 layers, n_embd 128, 2 and 4 heads,
n_positions 64, vocab 1000; every weight, bias and LayerNorm parameter perturbed so that no
mapping error can hide behind a zero or a one) it

  1. saves the model with save_pretrained(dir, safe_serialization=True) and imports it with
     `prepro/convert_hf --import dir --save ckpt` (the printed train_gpt flags are checked);
  2. reads the checkpoint file back in Python (header words, Adam m = v = 0, zero padded vocabulary
     rows) and runs dev/ref_gpt.py's float64 GPT forward on its canonical weights: the logits must
     equal the float64 transformers model's on the same tokens (relative norm error < 1e-9). This
     checks the whole mapping (Conv1D transposes, Megatron's grouped QKV rows) without a GPU;
  3. GPU, when the logits tool exists: `HF_LOGITS CKPT TOKENS.bin LOGITS.bin [--bf16]` (default
     ./dev/hf_logits, built on mt_trainer_load + mt_trainer_logits), compared with transformers' fp32
     logits over the first V columns: relative norm error < 1e-5 in fp32 and < 3e-2 in bf16.
       TOKENS.bin: int32 B, int32 T, then int32 tokens [B, T] (little-endian)
       LOGITS.bin: int32 B, int32 T, int32 Vp, then float32 logits [B, T, Vp]
     Without the tool this row says SKIP;
  4. exports the checkpoint back (`convert_hf --export ckpt --out dir2 --vocab-size 1000`), loads it
     with GPT2LMHeadModel.from_pretrained, failing on any missing / unexpected / mismatched key or a
     log line saying so, and requires every tensor and the logits to be bitwise equal to the original
     model's (the round trip only copies floats); a --dtype bfloat16 export must load cleanly too;
  5. imports the same model saved three other ways, which must give a byte-identical checkpoint:
     sharded (model.safetensors.index.json), with GPT2Model's key names ("h.0...", no "transformer.")
     plus the old attn.bias / attn.masked_bias buffers, and stored in bfloat16 (compared with the
     bfloat16 weights);
  6. feeds convert_hf broken inputs (truncated file, header length past the end, malformed JSON
     header, unknown dtype, overlapping offsets, missing tensor, unsupported activation): each must
     exit 1 with one error line that names the problem, and leave no checkpoint behind.

The Llama cases mirror these with three small random LlamaForCausalLMs (2 layers, hidden 128, 4
heads, 2 kv heads, intermediate 256, vocab 1000, 16384 positions, rope_theta 500000, llama3 rope
scaling with factor 8; head_dim 32 untied, head_dim 64 untied, head_dim 32 tied; every weight and norm
perturbed):

  1. import, with the printed train_gpt flags (RMSNorm, SwiGLU, rope, GQA, untied, no biases);
  2. the checkpoint read back: the header's shape and flavour words (RMSNorm, SwiGLU, rope, base,
     percent, scaling factor, untied, no biases, epsilon, true vocabulary), Adam m = v = 0, and the
     master weights equal, bitwise, to the HF tensors laid out as Megatron does (stated here: per
     query group the q rows of its heads, then its k rows, its v rows; fc1 = [gate; up]; zero padded
     vocabulary rows);
  3. GPU logits (fp32 and bf16) against transformers' fp32, the same tolerances;
  4. export without --vocab-size (the header has it), LlamaForCausalLM.from_pretrained with no
     missing / unexpected keys, config.json's fields as the original's, every tensor and the logits
     bitwise; a bfloat16 export; re-importing the export gives a byte-identical checkpoint;
  5. the model saved sharded and in bfloat16 imports to a byte-identical checkpoint;
  6. refused with one line: rope scaling type "linear", attention_bias true, hidden_act "gelu", a
     missing k_proj.

Prints one table and exits non-zero if any row failed.
"""
import argparse
import io
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import ref_gpt  # noqa: E402  (sets torch's default dtype to float64: put it back)

torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

CK_HEADER_WORDS = 64
MODELS = [  # name, heads
    ("gpt2_h2", 2),
    ("gpt2_h4", 4),
]
L, H, P, V, B = 2, 128, 64, 1000, 2
LLAMA_MODELS = [  # name, head_dim, tied
    ("llama_d32", 32, False),
    ("llama_d64", 64, False),
    ("llama_d32_tied", 32, True),
]
LN, LG, LF, LP, LT = 4, 2, 256, 16384, 64  # heads, kv heads, intermediate, max positions, tokens per row
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# header words (megatron.h, MT_CK_*)
CK_NORMALIZATION, CK_SWIGLU, CK_POSITION_TYPE, CK_ROTARY_BASE, CK_ROTARY_PERCENT, CK_ROPE_SCALING = 25, 26, 27, 28, 29, 30
CK_UNTIED, CK_NO_BIAS, CK_NORM_EPS, CK_TRUE_VOCAB = 31, 32, 33, 34
CK_MANIFESTED = 45  # 1: committed with its manifest.txt (every writer sets it)


def rest_of_header_ok(header):
    """The words after the true vocabulary: the manifest mark 1, every other one 0."""
    rest = [int(w) for i, w in enumerate(header) if i > CK_TRUE_VOCAB and i != CK_MANIFESTED]
    return header[CK_MANIFESTED] == 1 and not any(rest)

rows = []  # (check, status, detail)


def record(check, ok, detail=""):
    status = "PASS" if ok is True else ("SKIP" if ok is None else "FAIL")
    rows.append((check, status, detail))
    return ok


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def make_model(heads, seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=L, n_embd=H, n_head=heads, n_positions=P, vocab_size=V,
                     bos_token_id=V - 1, eos_token_id=V - 1)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # no zero biases, no unit LayerNorm weights: every mapping error shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.05)
            elif ".ln_" in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.detach().cpu().numpy()


def read_checkpoint(ckpt):
    it = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip())
    path = os.path.join(ckpt, "iter_%07d" % it, "mp_rank_00", "model_optim_rng.bin")
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:8 * CK_HEADER_WORDS], dtype="<i8")
    n = int(header[10])
    arrays = np.frombuffer(raw[8 * CK_HEADER_WORDS:], dtype="<f4")
    return it, header, arrays, n, raw


def as_double(word):
    return struct.unpack("<d", struct.pack("<q", int(word)))[0]


def load_logged(path, cls=GPT2LMHeadModel):
    """from_pretrained with transformers' log captured; returns (model, info, log text)."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = cls.from_pretrained(path, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    return model.eval(), info, buf.getvalue()


def clean_load(info, log):
    bad = [k for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info.get(k)]
    low = log.lower()
    words = [w for w in ("missing", "unexpected", "newly initialized", "mismatch") if w in low]
    return not bad and not words, "keys: %s; log: %s" % (bad or "ok", words or "ok")


def write_tokens(path, tokens):
    b, t = tokens.shape
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", b, t))
        f.write(tokens.astype("<i4").tobytes())


def read_logits(path):
    raw = open(path, "rb").read()
    b, t, vp = struct.unpack("<iii", raw[:12])
    return np.frombuffer(raw[12:], dtype="<f4").reshape(b, t, vp)


def check_model(name, heads, seed, args, work):
    conv = args.convert_hf
    model = make_model(heads, seed)
    hf_dir = os.path.join(work, name + "_hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, P), dtype=np.int64)
    ref32 = hf_logits(model, tokens)

    # 1. import
    ckpt = os.path.join(work, name + "_ckpt")
    rc, out, err = run([conv, "--import", hf_dir, "--save", ckpt])
    if not record(f"{name}: import", rc == 0, err.strip() or "rc 0"):
        return
    d = H // heads
    want_flags = [f"--num-layers {L}", f"--hidden-size {H}", f"--num-attention-heads {heads}",
                  f"--ffn-hidden-size {4 * H}", f"--seq-length {P}", f"--max-position-embeddings {P}",
                  "--norm-epsilon 1e-05", "--make-vocab-size-divisible-by 128", f"--vocab-size {V}"]
    missing = [f for f in want_flags if f not in out]
    record(f"{name}: printed train_gpt flags", not missing, "missing " + ", ".join(missing) if missing else "all present")

    # 2. the checkpoint, read back, through the float64 reference forward
    it, header, arrays, n, raw = read_checkpoint(ckpt)
    Vp = 1024
    cfg = ref_gpt.Config(L=L, h=H, n=heads, f=4 * H, Vp=Vp, T=P, P=P)
    words_ok = (it == 0 and header[0] == 0x4B43544D and header[1] == 1 and list(header[2:10]) ==
                [L, H, heads, heads, d, 4 * H, Vp, P] and n == ref_gpt.num_params(cfg) and header[11] == 1 and
                header[12] == 0 and header[16] == 1234 and header[18] == 2 and
                struct.unpack("<d", struct.pack("<q", int(header[19])))[0] == 1.0 and header[20] == 1 and
                header[21] == 1 and header[22] == 0 and not header[23:CK_NORM_EPS].any() and
                as_double(header[CK_NORM_EPS]) == 1e-5 and header[CK_TRUE_VOCAB] == V and
                rest_of_header_ok(header))
    size_ok = len(raw) == 8 * CK_HEADER_WORDS + 12 * n
    master, m, v = arrays[:n], arrays[n:2 * n], arrays[2 * n:3 * n]
    params = ref_gpt.unflatten(cfg, master)
    pad_zero = not params["word_embeddings"][V:].any()
    record(f"{name}: checkpoint header and layout", bool(words_ok and size_ok and not m.any() and not v.any() and pad_zero),
           f"{len(raw)} bytes, {n} parameters, m = v = 0, padded rows zero: {pad_zero}")
    ours64 = ref_gpt.forward(cfg, params, torch.from_numpy(tokens)).numpy()[:, :, :V]
    model64 = make_model(heads, seed).double()
    ref64 = hf_logits(model64, tokens)
    e = rel_err(ours64, ref64)
    record(f"{name}: ref_gpt.py fp64 forward of the checkpoint vs transformers fp64", e < 1e-9, f"rel err {e:.1e}")

    # 3. GPU logits through the trainer
    tool = args.hf_logits
    if tool and os.path.exists(tool):
        tok_path = os.path.join(work, name + "_tokens.bin")
        write_tokens(tok_path, tokens)
        for prec, tol, flags in (("fp32", 1e-5, []), ("bf16", 3e-2, ["--bf16"])):
            out_path = os.path.join(work, f"{name}_logits_{prec}.bin")
            rc, out, err = run([tool, ckpt, tok_path, out_path] + flags)
            if rc != 0:
                record(f"{name}: GPU logits {prec} vs transformers fp32", False, (err.strip() or out.strip())[-200:])
                continue
            ours = read_logits(out_path)
            e = rel_err(ours[:, :, :V], ref32)
            record(f"{name}: GPU logits {prec} vs transformers fp32", e < tol, f"rel err {e:.1e} (tol {tol:g})")
    else:
        record(f"{name}: GPU logits vs transformers", None, f"no {tool} (see the docstring)")

    # 4. export and reload
    out_dir = os.path.join(work, name + "_export")
    rc, out, err = run([conv, "--export", ckpt, "--out", out_dir, "--vocab-size", str(V)])
    if record(f"{name}: export", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(out_dir)
        ok, detail = clean_load(info, log)
        record(f"{name}: from_pretrained(export) loads cleanly", ok, detail)
        sd0, sd1 = model.state_dict(), back.state_dict()
        diff = [k for k in sd0 if k not in sd1 or not torch.equal(sd0[k], sd1[k])]
        record(f"{name}: exported tensors bitwise equal", not diff and set(sd0) == set(sd1),
               f"{len(sd0)} tensors" + (", differ: " + ", ".join(diff[:3]) if diff else ""))
        e = float(np.abs(hf_logits(back, tokens) - ref32).max())
        record(f"{name}: round-trip logits vs original", e <= 1e-6, "bitwise" if e == 0 else f"max abs diff {e:.1e}")
        keys = set(load_file(os.path.join(out_dir, "model.safetensors")))
        record(f"{name}: exported keys", keys == set(k for k in sd0 if k != "lm_head.weight"),
               f"{len(keys)} keys, lm_head.weight tied (not stored)")
    bf_dir = os.path.join(work, name + "_export_bf16")
    rc, out, err = run([conv, "--export", ckpt, "--out", bf_dir, "--vocab-size", str(V), "--dtype", "bfloat16"])
    if record(f"{name}: export --dtype bfloat16", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(bf_dir)
        ok, detail = clean_load(info, log)
        e = rel_err(hf_logits(back.float(), tokens), ref32)
        record(f"{name}: bf16 export loads cleanly, logits close", ok and e < 3e-2, f"{detail}; rel err {e:.1e}")

    # 5. the same model, stored differently: the checkpoint must come out byte-identical
    variants = {}
    shard_dir = os.path.join(work, name + "_sharded")
    model.save_pretrained(shard_dir, safe_serialization=True, max_shard_size="500KB")
    variants["sharded (index.json)"] = (shard_dir, raw)
    old_dir = os.path.join(work, name + "_oldnames")
    os.makedirs(old_dir)
    shutil.copy(os.path.join(hf_dir, "config.json"), old_dir)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    old = {k[len("transformer."):] if k.startswith("transformer.") else k: t for k, t in sd.items()}
    for layer in range(L):
        old[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(P, P, dtype=torch.uint8)).view(1, 1, P, P)
        old[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, os.path.join(old_dir, "model.safetensors"), metadata={"format": "pt"})
    variants["GPT2Model names + mask buffers"] = (old_dir, raw)
    bf_src = os.path.join(work, name + "_bf16src")
    model_bf = make_model(heads, seed).to(torch.bfloat16)
    model_bf.save_pretrained(bf_src, safe_serialization=True)
    # what the bf16 checkpoint must hold: the bf16 weights, upcast
    ref_bf = os.path.join(work, name + "_bf16ref")
    model_bf.float().save_pretrained(ref_bf, safe_serialization=True)
    rc, _, err = run([conv, "--import", ref_bf, "--save", ref_bf + "_ckpt"])
    variants["stored in bfloat16"] = (bf_src, read_checkpoint(ref_bf + "_ckpt")[4] if rc == 0 else None)
    for label, (src, want) in variants.items():
        dst = src + "_ckpt"
        rc, _, err = run([conv, "--import", src, "--save", dst])
        same = rc == 0 and want is not None and read_checkpoint(dst)[4] == want
        record(f"{name}: import {label}", same, err.strip() if rc else ("byte-identical checkpoint" if same else "differs"))


def corrupt_cases(args, work):
    conv = args.convert_hf
    model = make_model(2, 7)
    good = os.path.join(work, "corrupt_src")
    model.save_pretrained(good, safe_serialization=True)
    blob = open(os.path.join(good, "model.safetensors"), "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])

    def rewrite(h):  # a new header, same data, padded with spaces to the same 8-byte alignment
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
        return struct.pack("<Q", len(text)) + text + blob[8 + n:]

    names = [k for k in header if k != "__metadata__"]
    by_offset = sorted(names, key=lambda k: header[k]["data_offsets"][0])
    first, second = by_offset[0], by_offset[1]
    h_dtype = json.loads(json.dumps(header))
    h_dtype[first]["dtype"] = "Q7"
    h_overlap = json.loads(json.dumps(header))
    h_overlap[second]["data_offsets"] = [x - 4 for x in h_overlap[second]["data_offsets"]]
    h_range = json.loads(json.dumps(header))
    h_range[first]["data_offsets"] = [0, 12]
    h_hole = json.loads(json.dumps(header))
    h_hole.pop("transformer.ln_f.bias")  # its bytes stay: a gap in the data region
    sd = load_file(os.path.join(good, "model.safetensors"))
    sd.pop("transformer.ln_f.bias")
    missing_path = os.path.join(work, "missing.safetensors")
    save_file(sd, missing_path, metadata={"format": "pt"})
    blob_missing = open(missing_path, "rb").read()
    cfg_gelu = json.load(open(os.path.join(good, "config.json")))
    cfg_gelu["activation_function"] = "relu"
    cases = [  # label, model.safetensors bytes, config.json (None: unchanged), expected words in the message
        ("truncated file", blob[:-100], None, "truncated"),
        ("header length past the end", struct.pack("<Q", len(blob)) + blob[8:], None, "larger than the file"),
        ("malformed JSON header", blob[:8] + blob[8:8 + n].replace(b'"dtype"', b'"dtype" ', 1).replace(b",", b",,", 1)
         + blob[8 + n:], None, "malformed JSON"),
        ("unknown dtype", rewrite(h_dtype), None, "unknown dtype"),
        ("overlapping tensors", rewrite(h_overlap), None, "overlap"),
        ("offsets disagree with shape", rewrite(h_range), None, "needs"),
        ("bytes that belong to no tensor", rewrite(h_hole), None, "belong to no tensor"),
        ("missing tensor", blob_missing, None, "transformer.ln_f.bias is missing"),
        ("activation relu", blob, cfg_gelu, "activation_function"),
    ]
    for k, (label, data, config, words) in enumerate(cases):
        src = os.path.join(work, "case%d" % k)  # a name that cannot match the expected words
        os.makedirs(src)
        with open(os.path.join(src, "model.safetensors"), "wb") as f:
            f.write(data)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(config if config is not None else json.load(open(os.path.join(good, "config.json"))), f)
        dst = src + "_ckpt"
        rc, out, err = run([conv, "--import", src, "--save", dst])
        lines = err.strip().splitlines()
        message = lines[0].replace(src + "/", "") if lines else ""
        ok = rc == 1 and len(lines) == 1 and words in message and not os.path.exists(dst)
        record(f"rejects {label}", ok, message if lines else f"rc {rc}, no message")


def make_llama(head_dim, tied, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=LF, num_hidden_layers=L, num_attention_heads=LN,
                      num_key_value_heads=LG, head_dim=head_dim, vocab_size=V, max_position_embeddings=LP,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=tied,
                      bos_token_id=V - 1, eos_token_id=V - 1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # no unit norm weights, nothing left at its initial value
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def llama_canonical(sd, d, tied):
    """Our canonical parameter vector of a Llama state dict, stated on its own: per layer the fused QKV
    rows in Megatron's grouped layout (for query group j: the q rows of its LN/LG heads, its k rows, its
    v rows), fc1 = [gate; up]; padded vocabulary rows zero; order word_embeddings, ln1, qkv, proj, ln2,
    fc1, fc2, final norm, output layer (untied only)."""
    Vp = (V + 127) // 128 * 128
    t = {k: v.detach().float().numpy() for k, v in sd.items()}

    def padded(w):
        out = np.zeros((Vp, H), dtype=np.float32)
        out[:V] = w
        return out

    layer = lambda l, name: t[f"model.layers.{l}.{name}.weight"]  # noqa: E731
    qkv = []
    for l in range(L):
        q = layer(l, "self_attn.q_proj").reshape(LG, LN // LG * d, H)
        k = layer(l, "self_attn.k_proj").reshape(LG, d, H)
        v = layer(l, "self_attn.v_proj").reshape(LG, d, H)
        qkv.append(np.concatenate([q, k, v], axis=1).reshape(-1))
    pieces = [padded(t["model.embed_tokens.weight"]).reshape(-1)]
    pieces += [layer(l, "input_layernorm") for l in range(L)] + qkv
    pieces += [layer(l, "self_attn.o_proj").reshape(-1) for l in range(L)]
    pieces += [layer(l, "post_attention_layernorm") for l in range(L)]
    pieces += [np.concatenate([layer(l, "mlp.gate_proj"), layer(l, "mlp.up_proj")]).reshape(-1) for l in range(L)]
    pieces += [layer(l, "mlp.down_proj").reshape(-1) for l in range(L)]
    pieces += [t["model.norm.weight"]]
    if not tied:
        pieces += [padded(t["lm_head.weight"]).reshape(-1)]
    return np.concatenate(pieces).astype(np.float32)


LLAMA_CONFIG_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                       "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "rope_theta", "rope_scaling",
                       "rope_parameters"]


def check_llama(name, d, tied, seed, args, work):
    conv = args.convert_hf
    model = make_llama(d, tied, seed)
    hf_dir = os.path.join(work, name + "_hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, LT), dtype=np.int64)
    ref32 = hf_logits(model, tokens)

    # 1. import
    ckpt = os.path.join(work, name + "_ckpt")
    rc, out, err = run([conv, "--import", hf_dir, "--save", ckpt])
    if not record(f"{name}: import", rc == 0, err.strip() or "rc 0"):
        return
    want_flags = [f"--num-layers {L}", f"--hidden-size {H}", f"--num-attention-heads {LN}",
                  f"--group-query-attention --num-query-groups {LG}", f"--ffn-hidden-size {LF}",
                  f"--seq-length {LP}", f"--max-position-embeddings {LP}", "--norm-epsilon 1e-05",
                  "--normalization RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type rope",
                  "--rotary-base 500000", "--use-rope-scaling --rope-scaling-factor 8", f"--vocab-size {V}"]
    want_flags += [f"--kv-channels {d}"] if d * LN != H else []
    missing = [f for f in want_flags if f not in out]
    extra = [f for f in ["--kv-channels"] if d * LN == H and f in out]
    extra += ["--untie-embeddings-and-output-weights"] if tied and "--untie" in out else []
    missing += ["--untie-embeddings-and-output-weights"] if not tied and "--untie" not in out else []
    record(f"{name}: printed train_gpt flags", not missing and not extra,
           "missing " + ", ".join(missing) if missing else ("unwanted " + ", ".join(extra) if extra else "all present"))

    # 2. the checkpoint, read back: header words and the canonical layout, bitwise
    it, header, arrays, n, raw = read_checkpoint(ckpt)
    Vp = 1024
    want = llama_canonical(model.state_dict(), d, tied)
    words_ok = (it == 0 and header[0] == 0x4B43544D and header[1] == 1 and
                list(header[2:10]) == [L, H, LN, LG, d, LF, Vp, LP] and n == want.size and header[11] == 1 and
                header[12] == 0 and header[20] == 1 and header[21] == 1 and header[22] == 0 and
                header[CK_NORMALIZATION] == 1 and header[CK_SWIGLU] == 1 and header[CK_POSITION_TYPE] == 1 and
                as_double(header[CK_ROTARY_BASE]) == 500000.0 and as_double(header[CK_ROTARY_PERCENT]) == 1.0 and
                as_double(header[CK_ROPE_SCALING]) == 8.0 and header[CK_UNTIED] == (0 if tied else 1) and
                header[CK_NO_BIAS] == 1 and as_double(header[CK_NORM_EPS]) == 1e-5 and header[CK_TRUE_VOCAB] == V and
                rest_of_header_ok(header))
    size_ok = len(raw) == 8 * CK_HEADER_WORDS + 12 * n
    master, m, v = arrays[:n], arrays[n:2 * n], arrays[2 * n:3 * n]
    record(f"{name}: checkpoint header (shape, flavour words)", bool(words_ok and size_ok and not m.any() and not v.any()),
           f"{len(raw)} bytes, {n} parameters, m = v = 0" + ("" if words_ok else f"; header {list(header[:35])}"))
    same = master.shape == want.shape and np.array_equal(master.view(np.uint32), want.view(np.uint32))
    record(f"{name}: canonical weights = HF tensors in Megatron's layout", bool(same),
           "bitwise (grouped QKV, [gate; up], zero padding)" if same else "differ")

    # 3. GPU logits through the trainer
    tool = args.hf_logits
    if tool and os.path.exists(tool):
        tok_path = os.path.join(work, name + "_tokens.bin")
        write_tokens(tok_path, tokens)
        for prec, tol, flags in (("fp32", 1e-5, []), ("bf16", 3e-2, ["--bf16"])):
            out_path = os.path.join(work, f"{name}_logits_{prec}.bin")
            rc, out, err = run([tool, ckpt, tok_path, out_path] + flags)
            if rc != 0:
                record(f"{name}: GPU logits {prec} vs transformers fp32", False, (err.strip() or out.strip())[-200:])
                continue
            ours = read_logits(out_path)
            e = rel_err(ours[:, :, :V], ref32)
            record(f"{name}: GPU logits {prec} vs transformers fp32", e < tol, f"rel err {e:.1e} (tol {tol:g})")
    else:
        record(f"{name}: GPU logits vs transformers", None, f"no {tool} (see the docstring)")

    # 4. export (vocabulary and epsilon from the header) and reload
    out_dir = os.path.join(work, name + "_export")
    rc, out, err = run([conv, "--export", ckpt, "--out", out_dir])
    if record(f"{name}: export", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(out_dir, LlamaForCausalLM)
        ok, detail = clean_load(info, log)
        record(f"{name}: from_pretrained(export) loads cleanly", ok, detail)
        diff_cfg = [k for k in LLAMA_CONFIG_FIELDS if getattr(back.config, k, None) != getattr(model.config, k, None)]
        record(f"{name}: exported config.json", not diff_cfg, "differs: " + ", ".join(diff_cfg) if diff_cfg else
               f"{len(LLAMA_CONFIG_FIELDS)} fields as the original's")
        sd0, sd1 = model.state_dict(), back.state_dict()
        diff = [k for k in sd0 if k not in sd1 or not torch.equal(sd0[k], sd1[k])]
        record(f"{name}: exported tensors bitwise equal", not diff and set(sd0) == set(sd1),
               f"{len(sd0)} tensors" + (", differ: " + ", ".join(diff[:3]) if diff else ""))
        e = float(np.abs(hf_logits(back, tokens) - ref32).max())
        record(f"{name}: round-trip logits vs original", e <= 1e-6, "bitwise" if e == 0 else f"max abs diff {e:.1e}")
        keys = set(load_file(os.path.join(out_dir, "model.safetensors")))
        record(f"{name}: exported keys", keys == set(k for k in sd0 if not (tied and k == "lm_head.weight")),
               f"{len(keys)} keys" + (", lm_head.weight tied (not stored)" if tied else ", lm_head.weight stored"))
        again = os.path.join(work, name + "_reimport")
        rc, _, err = run([conv, "--import", out_dir, "--save", again])
        same = rc == 0 and read_checkpoint(again)[4] == raw
        record(f"{name}: import(export) checkpoint", same, err.strip() if rc else ("byte-identical" if same else "differs"))
    bf_dir = os.path.join(work, name + "_export_bf16")
    rc, out, err = run([conv, "--export", ckpt, "--out", bf_dir, "--dtype", "bfloat16"])
    if record(f"{name}: export --dtype bfloat16", rc == 0, err.strip() or "rc 0"):
        back, info, log = load_logged(bf_dir, LlamaForCausalLM)
        ok, detail = clean_load(info, log)
        e = rel_err(hf_logits(back.float(), tokens), ref32)
        record(f"{name}: bf16 export loads cleanly, logits close", ok and e < 3e-2, f"{detail}; rel err {e:.1e}")

    # 5. the same model, stored differently: the checkpoint must come out byte-identical
    shard_dir = os.path.join(work, name + "_sharded")
    model.save_pretrained(shard_dir, safe_serialization=True, max_shard_size="500KB")
    bf_src = os.path.join(work, name + "_bf16src")
    model_bf = make_llama(d, tied, seed).to(torch.bfloat16)
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


def llama_reject_cases(args, work):
    conv = args.convert_hf
    good = os.path.join(work, "llama_reject_src")
    make_llama(32, False, 11).save_pretrained(good, safe_serialization=True)
    config = json.load(open(os.path.join(good, "config.json")))
    blob = open(os.path.join(good, "model.safetensors"), "rb").read()

    def rope_linear(c):  # transformers 5 writes rope_parameters, 4 rope_scaling
        c["rope_parameters" if c.get("rope_parameters") else "rope_scaling"]["rope_type"] = "linear"

    sd = load_file(os.path.join(good, "model.safetensors"))
    sd.pop("model.layers.0.self_attn.k_proj.weight")
    missing_path = os.path.join(work, "llama_missing.safetensors")
    save_file(sd, missing_path, metadata={"format": "pt"})
    cases = [  # label, config change, model.safetensors bytes, expected words
        ("rope scaling type linear", rope_linear, blob, 'type "linear" is not supported'),
        ("attention_bias true", lambda c: c.update(attention_bias=True), blob, "attention_bias true is not supported"),
        ("hidden_act gelu", lambda c: c.update(hidden_act="gelu"), blob, 'hidden_act "gelu" is not supported'),
        ("missing k_proj", lambda c: None, open(missing_path, "rb").read(),
         "model.layers.0.self_attn.k_proj.weight is missing"),
    ]
    for k, (label, change, data, words) in enumerate(cases):
        src = os.path.join(work, "lcase%d" % k)
        os.makedirs(src)
        c = json.loads(json.dumps(config))
        change(c)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(c, f)
        with open(os.path.join(src, "model.safetensors"), "wb") as f:
            f.write(data)
        dst = src + "_ckpt"
        rc, out, err = run([conv, "--import", src, "--save", dst])
        lines = err.strip().splitlines()
        message = lines[0].replace(src + "/", "") if lines else ""
        ok = rc == 1 and len(lines) == 1 and words in message and not os.path.exists(dst)
        record(f"llama rejects {label}", ok, message if lines else f"rc {rc}, no message")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--convert-hf", default=os.path.join(ROOT, "prepro", "convert_hf"))
    ap.add_argument("--hf-logits", default=os.path.join(ROOT, "dev", "hf_logits"))
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    args = ap.parse_args()
    if not os.path.exists(args.convert_hf):
        sys.exit(f"hf_check: {args.convert_hf} not found: build it with `make prepro/convert_hf`")
    transformers.logging.set_verbosity_warning()
    transformers.logging.disable_progress_bar() if hasattr(transformers.logging, "disable_progress_bar") else None
    work = args.keep or tempfile.mkdtemp(prefix="hf_check_")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    try:
        for i, (name, heads) in enumerate(MODELS):
            check_model(name, heads, 1234 + i, args, work)
        corrupt_cases(args, work)
        for i, (name, head_dim, tied) in enumerate(LLAMA_MODELS):
            check_llama(name, head_dim, tied, 4321 + i, args, work)
        llama_reject_cases(args, work)
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
