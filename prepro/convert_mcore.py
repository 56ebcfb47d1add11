#!/usr/bin/env python3
"""
convert_mcore.py: megatron.c checkpoints <-> Megatron-Core `torch_dist` checkpoints of GPTModel.

    python prepro/convert_mcore.py --to-mcore CKPT OUT [--iteration N] [--optimizer distributed|plain|none]
                                   [--no-verify] [--lr 3e-4 --min-lr 0 --lr-decay-style cosine --lr-warmup-samples 0
                                    --lr-decay-samples 0 --weight-decay 0.01 --adam-beta1 0.9
                                    --adam-beta2 0.999 --adam-eps 1e-8]
    python prepro/convert_mcore.py --from-mcore MCORE OUT [--iteration N]

A tool, not part of the trainer: it needs torch and megatron-core (`pip install megatron-core`; it runs
on the CPU: a one-process gloo group is made when none exists). Files are written and read through
megatron-core's own dist_checkpointing.save / load, so the directory is what the installed version
writes with `--ckpt-format torch_dist` (.metadata, __0_0.distcp, common.pt, metadata.json) under
Megatron's `iter_0000100/` and `latest_checkpointed_iteration.txt`.

This project's side (megatron.h section 13): iter_N/mp_rank_00/model_optim_rng.bin, a header of 64 int64
words then fp32 master weights, Adam m and v in the canonical order of mt_param_layout; the manifest
(CRC-32C of every file) is written last, as the trainer writes it, and the header's manifest mark is 1.
--to-mcore reads a checkpoint after megatron.h's integrity rule (mt_checkpoint_check_integrity, restated
in check_integrity below): its manifest verified (every listed file's size and CRC-32C, nothing
unlisted), or without one the header's manifest mark: 1 (saved with one) is refused, 0 (from before
manifests) is read with a warning; a refusal is one line naming the file, and --no-verify reads such a
checkpoint anyway, with a warning. Only TP = 1, PP = 1 checkpoints with
the optimizer not sharded are read or written: `prepro/checkpoint_tool reshard CKPT OUT --target-tp 1
--target-pp 1` makes one from any layout (and `--target-tp N` goes back after --from-mcore).
Megatron-Core's side is layout-free (global tensors), so Megatron loads it at any TP / PP.

Tensor names (Megatron-Core's sharded_state_dict keys: every layer stacked on a leading axis of L; the
local layer spec maps input_layernorm / pre_mlp_layernorm to the same keys as Transformer Engine's
fused linear_qkv / linear_fc1 norms, so both specs read the same checkpoint; checked here with the local
spec, which is what runs without Transformer Engine):
    word_embeddings     embedding.word_embeddings.weight                  [Vp, h]
    position_embeddings embedding.position_embeddings.weight              [P, h]     (learned only)
    ln1_weight / _bias  decoder.layers.self_attention.linear_qkv.layer_norm_weight / _bias   [L, h]
    qkv_weight / _bias  decoder.layers.self_attention.linear_qkv.weight / .bias   [L, (n+2g)d, h]
    proj_weight / _bias decoder.layers.self_attention.linear_proj.weight / .bias  [L, h, n d]
    ln2_weight / _bias  decoder.layers.mlp.linear_fc1.layer_norm_weight / _bias   [L, h]
    fc1_weight / _bias  decoder.layers.mlp.linear_fc1.weight / .bias      [L, f or 2f, h]
    fc2_weight / _bias  decoder.layers.mlp.linear_fc2.weight / .bias      [L, h, f]
    final_ln_weight / _bias  decoder.final_layernorm.weight / .bias       [h]
    output_weight       output_layer.weight                               [Vp, h]    (untied only)
Both sides keep QKV in Megatron's grouped layout (per query group: its heads' q rows, then k, then v),
SwiGLU's fc1 as [gate; up] (Megatron-Core's global tensor at any TP), and --apply-layernorm-1p's norm
weights as w - 1, so every tensor is copied unchanged: no permutation, no arithmetic.

Optimizer state, as Megatron-Core names it in torch_dist:
    --optimizer distributed (default): the distributed optimizer's `fully_reshardable` form
        (Megatron-LM's --dist-ckpt-optim-fully-reshardable): optimizer.state.param.<key> (fp32 master),
        optimizer.state.exp_avg.<key>, optimizer.state.exp_avg_sq.<key>, and
        content_metadata distrib_optim_sharding_type = fully_reshardable;
    --optimizer plain: the non-distributed mixed-precision optimizer's optimizer.state.fp32_param.<key>,
        exp_avg, exp_avg_sq;
    --optimizer none: weights only.
The model tensors hold the master weights cast to the run's precision (bf16 / fp16 / fp32), as Megatron
copies them after every step. --from-mcore takes the master weights from optimizer.state.param or
fp32_param when present (else the model tensors, Adam moments zero); the distributed optimizer's default
`dp_reshardable` form (bucket-space tensors) is refused with one line: save with
--dist-ckpt-optim-fully-reshardable.

Non-tensor state: common.pt holds `args` (an argparse.Namespace with Megatron's names for the model's
shape and flavour, seed, consumed_train_samples, the precision), `iteration`, `checkpoint_version` 3.0,
`opt_param_scheduler` (num_steps = the header's scheduler steps; the schedule's values from the flags
above: resume in Megatron with --override-opt_param-scheduler if they differ from the run's) and the
optimizer's param groups (weight decay and no weight decay, with Adam's `step`) and, in fp16, the loss
scaler (scale, growth_tracker, hysteresis_tracker). Not carried: Megatron's RNG states (resume with
--no-load-rng) and this project's FP8 delayed-scaling state (dropped with a note; the trainer starts the
scales afresh). Mixture-of-experts models (--num-experts, either way) are refused with one line: their
experts, routers and expert bias have no mapping here yet.
"""
import argparse
import math
import os
import shutil
import struct
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

# ------------------------------------------------------------------------------------------------
# This project's checkpoint: header words (megatron.h, enum MT_CK_*) and the canonical layout
# ------------------------------------------------------------------------------------------------

CK_MAGIC, CK_VERSION = 0x4B43544D, 1
HEADER_WORDS = 64
W = dict(zip(
    "MAGIC VERSION LAYERS HIDDEN HEADS GROUPS KV FFN VOCAB POSITIONS NUM_PARAMS PRECISION ITERATION CONSUMED "
    "SCHED_STEPS ADAM_STEP SEED GROWTH HYSTERESIS LOSS_SCALE_BITS TP PP SHARDED_DP DP_RANK SHARD_NUMEL "
    "NORMALIZATION SWIGLU POSITION_TYPE ROTARY_BASE_BITS ROTARY_PERCENT_BITS ROPE_SCALING_FACTOR_BITS UNTIED "
    "NO_BIAS_LINEAR NORM_EPS_BITS TRUE_VOCAB TP_RANK FP8_TENSORS FP8_HISTORY_LEN FP8_HISTORY_POS PP_RANK VP "
    "STAGE_NUMEL LAYERNORM_1P DDP_OVERLAP DDP_BUCKET_SIZE MANIFESTED SQUARED_RELU QK_LAYERNORM NUM_EXPERTS MOE_FFN "
    "MOE_SHARED MOE_SHARED_GATE MOE_LAYERS MOE_LAYER_FREQ MOE_EXPERT_BIAS".split(), range(64)))
MANIFEST = "manifest.txt"
MANIFEST_HEAD = "megatron.c checkpoint manifest 1"
PRECISIONS = {0: "fp32", 1: "bf16", 2: "fp16"}
NORMS = {0: "LayerNorm", 1: "RMSNorm"}
POSITIONS = {0: "learned_absolute", 1: "rope", 2: "none"}

LAYER = "decoder.layers."
MCORE_KEYS = [  # canonical order (megatron.h MT_P_*): our name, Megatron-Core key
    ("word_embeddings", "embedding.word_embeddings.weight"),
    ("position_embeddings", "embedding.position_embeddings.weight"),
    ("ln1_weight", LAYER + "self_attention.linear_qkv.layer_norm_weight"),
    ("ln1_bias", LAYER + "self_attention.linear_qkv.layer_norm_bias"),
    ("qkv_weight", LAYER + "self_attention.linear_qkv.weight"),
    ("qkv_bias", LAYER + "self_attention.linear_qkv.bias"),
    ("proj_weight", LAYER + "self_attention.linear_proj.weight"),
    ("proj_bias", LAYER + "self_attention.linear_proj.bias"),
    ("ln2_weight", LAYER + "mlp.linear_fc1.layer_norm_weight"),
    ("ln2_bias", LAYER + "mlp.linear_fc1.layer_norm_bias"),
    ("fc1_weight", LAYER + "mlp.linear_fc1.weight"),
    ("fc1_bias", LAYER + "mlp.linear_fc1.bias"),
    ("fc2_weight", LAYER + "mlp.linear_fc2.weight"),
    ("fc2_bias", LAYER + "mlp.linear_fc2.bias"),
    ("final_ln_weight", "decoder.final_layernorm.weight"),
    ("final_ln_bias", "decoder.final_layernorm.bias"),
    ("output_weight", "output_layer.weight"),
]


class ConvertError(Exception):
    """One line that says what is wrong; the tool prints it and exits 1."""


def f64_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_f64(w):
    return struct.unpack("<d", struct.pack("<q", int(w)))[0]


def model_of_header(h):
    """The model's shape and flavour from a header (names as Megatron's args)."""
    m = SimpleNamespace(
        num_layers=h[W["LAYERS"]], hidden_size=h[W["HIDDEN"]], num_attention_heads=h[W["HEADS"]],
        num_query_groups=h[W["GROUPS"]], kv_channels=h[W["KV"]], ffn_hidden_size=h[W["FFN"]],
        padded_vocab_size=h[W["VOCAB"]], max_position_embeddings=h[W["POSITIONS"]],
        normalization=NORMS[h[W["NORMALIZATION"]]], swiglu=bool(h[W["SWIGLU"]]),
        position_embedding_type=POSITIONS[h[W["POSITION_TYPE"]]],
        untie_embeddings_and_output_weights=bool(h[W["UNTIED"]]), add_bias_linear=not h[W["NO_BIAS_LINEAR"]],
        apply_layernorm_1p=bool(h[W["LAYERNORM_1P"]]), norm_epsilon=bits_f64(h[W["NORM_EPS_BITS"]]) or 1e-5,
        rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0)
    if m.position_embedding_type == "rope":
        m.rotary_base = bits_f64(h[W["ROTARY_BASE_BITS"]])
        m.rotary_percent = bits_f64(h[W["ROTARY_PERCENT_BITS"]])
        scaling = bits_f64(h[W["ROPE_SCALING_FACTOR_BITS"]])
        m.use_rope_scaling = scaling > 0
        if scaling > 0: m.rope_scaling_factor = scaling
    return m


def param_layout(m):
    """[(our name, Megatron-Core key, shape)] of the tensors the model has, canonical order
    (mt_param_layout at TP = 1)."""
    L, h, f, V = m.num_layers, m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
    ln, b = m.normalization == "LayerNorm", m.add_bias_linear
    f1 = 2 * f if m.swiglu else f
    shapes = {
        "word_embeddings": (V, h), "position_embeddings": (m.max_position_embeddings, h),
        "ln1_weight": (L, h), "ln1_bias": (L, h), "qkv_weight": (L, qkv, h), "qkv_bias": (L, qkv),
        "proj_weight": (L, h, m.num_attention_heads * m.kv_channels), "proj_bias": (L, h),
        "ln2_weight": (L, h), "ln2_bias": (L, h), "fc1_weight": (L, f1, h), "fc1_bias": (L, f1),
        "fc2_weight": (L, h, f), "fc2_bias": (L, h), "final_ln_weight": (h,), "final_ln_bias": (h,),
        "output_weight": (V, h)}
    present = {"position_embeddings": m.position_embedding_type == "learned_absolute",
               "ln1_bias": ln, "ln2_bias": ln, "final_ln_bias": ln, "qkv_bias": b, "proj_bias": b,
               "fc1_bias": b, "fc2_bias": b, "output_weight": m.untie_embeddings_and_output_weights}
    return [(name, key, shapes[name]) for name, key in MCORE_KEYS if present.get(name, True)]


# CRC-32C (Castagnoli, reflected 0x82f63b78, as mt_crc32c_extend): the bytes are cut into lanes that
# numpy advances together one byte a step, then the lanes' CRCs are joined pairwise with zlib's
# crc32_combine rule (shifting a CRC by n zero bytes is a linear map over GF(2)), level by level.
_POLY = 0x82F63B78
_TABLE = np.array([(lambda c: [c := (c >> 1) ^ (_POLY if c & 1 else 0) for _ in range(8)][-1])(i)
                   for i in range(256)], dtype=np.uint32)


def _gf2_times(mat, vec):
    """mat (32 column words) times the vectors vec (uint32 array)."""
    out = np.zeros_like(vec)
    for bit in range(32):
        out ^= np.where((vec >> np.uint32(bit)) & np.uint32(1), np.uint32(mat[bit]), np.uint32(0))
    return out


def _gf2_square(mat):
    return [int(x) for x in _gf2_times(mat, np.array(mat, dtype=np.uint32))]   # mat times each of its columns


def _zeros_operator(nbytes):
    """The map that appends nbytes zero bytes to a (pre/post-conditioned) CRC-32C, zlib's way."""
    odd = [_POLY] + [1 << i for i in range(31)]      # one zero bit
    op = [1 << i for i in range(32)]                   # identity
    sq = _gf2_square(_gf2_square(_gf2_square(odd)))   # eight zero bits: one byte
    n = nbytes
    while n:
        if n & 1: op = [int(x) for x in _gf2_times(sq, np.array(op, dtype=np.uint32))]
        sq = _gf2_square(sq)
        n >>= 1
    return op


def crc32c_combine(crc_a, crc_b, length_b):
    """The CRC-32C of A followed by B from theirs (zlib's crc32_combine rule)."""
    return int(_gf2_times(_zeros_operator(length_b), np.array([crc_a], dtype=np.uint32))[0]) ^ crc_b


def crc32c(data):
    buf = np.frombuffer(data, dtype=np.uint8)
    n = len(buf)
    if n == 0: return 0
    lanes = 1
    while lanes * 2 <= n // 4096 and lanes < (1 << 16): lanes *= 2
    per = n // lanes                                   # lanes of `per` bytes, then the tail
    body = buf[:lanes * per].reshape(lanes, per)
    crc = np.full(lanes, 0xFFFFFFFF, dtype=np.uint32)
    for j in range(per):
        crc = _TABLE[(crc ^ body[:, j]) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
    crc ^= np.uint32(0xFFFFFFFF)
    length = per
    while len(crc) > 1:                                # join neighbours: crc(A B) = shift(crc A) ^ crc B
        crc = _gf2_times(_zeros_operator(length), crc[0::2]) ^ crc[1::2]   # crc32c_combine, vectorised
        length *= 2
    c = int(crc[0]) ^ 0xFFFFFFFF
    for byte in buf[lanes * per:].tolist():
        c = int(_TABLE[(c ^ byte) & 0xFF]) ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def crc32c_file(path, chunk=1 << 26):
    """(size, CRC-32C) of a file, read a chunk at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                return size, crc
            crc, size = crc32c_combine(crc, crc32c(data), len(data)), size + len(data)


# ------------------------------------------------------------------------------------------------
# The integrity rule (megatron.h mt_checkpoint_check_integrity), before any of a checkpoint is read
# ------------------------------------------------------------------------------------------------

def _files_under(root):
    """Every regular file under root, relative and '/'-joined, but the manifest and its temporaries."""
    out = []
    for d, dirs, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            if rel == MANIFEST or rel.startswith(MANIFEST + ".tmp."):
                continue
            out.append(rel)
    return out


def verify_manifest(iter_dir):
    """iter_dir/manifest.txt checked as mt_checkpoint_manifest_verify does: every listed file there with
    its size and CRC-32C, nothing unlisted beside them; ConvertError naming the first bad file."""
    path = os.path.join(iter_dir, MANIFEST)
    try:
        text = open(path, "rb").read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
    lines = text.split("\n")
    if len(lines) < 3 or lines[0] != MANIFEST_HEAD or not lines[1].startswith("files ") or \
            not lines[1][6:].isdigit() or lines[-1] != "":
        raise ConvertError(f"{path} is not a checkpoint manifest (bad first lines)")
    count = int(lines[1][6:])
    entries = lines[2:-1]
    if len(entries) != count:
        raise ConvertError(f"{path}: {len(entries)} file lines, but it counts {count}")
    listed = set()
    for i, line in enumerate(entries):
        parts = line.split(" ", 2)
        ok = len(parts) == 3 and len(parts[0]) == 8 and all(c in "0123456789abcdef" for c in parts[0]) and \
            parts[1].isdigit() and parts[2] and not parts[2].startswith("/") and \
            all(p not in ("", ".", "..") for p in parts[2].split("/"))
        if not ok:
            raise ConvertError(f"{path}: line {i + 3} is not '<crc32c> <size> <path>'")
        crc, size, rel = int(parts[0], 16), int(parts[1]), parts[2]
        listed.add(rel)
        f = os.path.join(iter_dir, rel)
        if not os.path.exists(f):
            raise ConvertError(f"checkpoint {iter_dir}: {rel} is missing")
        if not os.path.isfile(f):
            raise ConvertError(f"checkpoint {iter_dir}: {rel} is not a regular file")
        have = os.path.getsize(f)
        if have != size:
            raise ConvertError(f"checkpoint {iter_dir}: {rel} has {have} bytes, its manifest says {size} "
                               f"({'truncated' if have < size else 'too long'})")
        _, got = crc32c_file(f)
        if got != crc:
            raise ConvertError(f"checkpoint {iter_dir}: {rel} is corrupted (CRC-32C {got:08x}, its manifest says "
                               f"{crc:08x})")
    for rel in sorted(_files_under(iter_dir)):
        if rel not in listed:
            raise ConvertError(f"checkpoint {iter_dir}: {rel} is not in its manifest")


def check_integrity(iter_dir, no_verify=False):
    """The rule every reader applies first: None when the checkpoint passes, a warning line when it is read
    anyway (from before manifests, or a failure under no_verify); ConvertError when it is refused."""
    if not os.path.isdir(iter_dir):
        raise ConvertError(f"no checkpoint at {iter_dir}")
    try:
        if os.path.lexists(os.path.join(iter_dir, MANIFEST)):
            verify_manifest(iter_dir)
            return None
        rank = os.path.join(iter_dir, "mp_rank_00")
        first = os.path.join(rank if os.path.isdir(rank) else rank + "_000", "model_optim_rng.bin")
        try:
            with open(first, "rb") as f:
                raw = f.read(8 * HEADER_WORDS)
        except OSError as e:
            raise ConvertError(f"cannot open {first}: {e.strerror}")
        if len(raw) != 8 * HEADER_WORDS:
            raise ConvertError(f"{first} is truncated (no header)")
        h = struct.unpack(f"<{HEADER_WORDS}q", raw)
        if h[W["MAGIC"]] != CK_MAGIC or h[W["VERSION"]] != CK_VERSION or h[W["MANIFESTED"]] not in (0, 1):
            raise ConvertError(f"{first} is not a megatron.c checkpoint (bad magic, version or manifest mark)")
        if h[W["MANIFESTED"]] == 0:
            return f"checkpoint {iter_dir} has no {MANIFEST}: saved before manifests, it is read without an " \
                   "integrity check"
        raise ConvertError(f"checkpoint {iter_dir} has no {MANIFEST} but was saved with one: incomplete or tampered")
    except ConvertError as e:
        if not no_verify:
            raise
        return f"{e} (read anyway: integrity checking is off)"


# ------------------------------------------------------------------------------------------------
# Reading and writing this project's checkpoint (TP = 1, PP = 1, optimizer not sharded)
# ------------------------------------------------------------------------------------------------

def read_tracker(d):
    path = os.path.join(d, "latest_checkpointed_iteration.txt")
    try:
        text = open(path).read().strip()
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror}")
    if not text.isdigit():
        raise ConvertError(f"{path} does not hold one decimal iteration ({text[:40]!r})")
    return int(text)


def read_ours(ckpt, iteration=None, no_verify=False):
    """(header list, {our name: float32 array} for master, m, v as dicts), after the integrity rule."""
    it = read_tracker(ckpt) if iteration is None else iteration
    warning = check_integrity(os.path.join(ckpt, f"iter_{it:07d}"), no_verify)
    if warning:
        print(f"convert_mcore: warning: {warning}", file=sys.stderr)
    path = os.path.join(ckpt, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.bin")
    if not os.path.isfile(path):
        others = [p for p in os.listdir(os.path.join(ckpt, f"iter_{it:07d}"))] if os.path.isdir(
            os.path.join(ckpt, f"iter_{it:07d}")) else []
        hint = " (a TP / PP > 1 layout: prepro/checkpoint_tool reshard it to --target-tp 1 --target-pp 1 first)" \
            if others else ""
        raise ConvertError(f"{path} is missing{hint}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8 * HEADER_WORDS)
        if len(raw) != 8 * HEADER_WORDS:
            raise ConvertError(f"{path}: shorter than its {8 * HEADER_WORDS}-byte header")
        h = list(struct.unpack(f"<{HEADER_WORDS}q", raw))
        if h[W["MAGIC"]] != CK_MAGIC or h[W["VERSION"]] != CK_VERSION:
            raise ConvertError(f"{path} is not a megatron.c checkpoint (bad magic or version)")
        if h[W["TP"]] != 1 or h[W["PP"]] != 1 or h[W["SHARDED_DP"]] != 0:
            raise ConvertError(f"{path}: TP {h[W['TP']]}, PP {h[W['PP']]}, optimizer sharded over "
                               f"{h[W['SHARDED_DP']]} DP ranks; this tool reads TP 1, PP 1, not sharded: "
                               "prepro/checkpoint_tool reshard it to --target-tp 1 --target-pp 1 first")
        for word in ("LAYERS", "HIDDEN", "HEADS", "GROUPS", "KV", "FFN", "VOCAB", "POSITIONS"):
            if not 1 <= h[W[word]] < 2 ** 31:
                raise ConvertError(f"{path}: header word {word} is {h[W[word]]}, outside [1, 2^31)")
        if h[W["NORMALIZATION"]] not in NORMS or h[W["POSITION_TYPE"]] not in POSITIONS or \
                h[W["PRECISION"]] not in PRECISIONS or h[W["MANIFESTED"]] not in (0, 1):
            raise ConvertError(f"{path}: unknown normalization, position type, precision or manifest mark word")
        for word, flag in (("SQUARED_RELU", "--squared-relu"), ("QK_LAYERNORM", "--qk-layernorm")):
            if h[W[word]]:
                raise ConvertError(f"{path}: the model was trained with {flag}, which this tool does not convert")
        if h[W["NUM_EXPERTS"]]:
            raise ConvertError(f"{path}: a mixture-of-experts model (--num-experts {h[W['NUM_EXPERTS']]}), which this "
                               "tool does not convert (its experts, routers and expert bias have no mapping here yet)")
        m = model_of_header(h)
        layout = param_layout(m)
        n = sum(int(np.prod(s)) for _, _, s in layout)
        if n != h[W["NUM_PARAMS"]]:
            raise ConvertError(f"{path}: the header says {h[W['NUM_PARAMS']]} parameters but its model has {n}")
        fp8 = h[W["FP8_TENSORS"]] * (4 + 16 + 4 * h[W["FP8_HISTORY_LEN"]])
        if size != 8 * HEADER_WORDS + 12 * n + fp8:
            raise ConvertError(f"{path}: {size} bytes, its header calls for {8 * HEADER_WORDS + 12 * n + fp8}")
        arrays = []
        for _ in range(3):
            a = np.fromfile(f, dtype="<f4", count=n)
            if len(a) != n:
                raise ConvertError(f"{path}: truncated")
            arrays.append(a)
    if fp8:
        print(f"note: {path} holds FP8 delayed-scaling state for {h[W['FP8_TENSORS']]} tensors; "
              "Megatron-Core's checkpoint does not get it (the scales start afresh)")
    out = []
    for a in arrays:
        d, off = {}, 0
        for name, _, shape in layout:
            k = int(np.prod(shape))
            d[name] = a[off:off + k].reshape(shape)
            off += k
        out.append(d)
    return h, m, layout, out


def write_file_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_iteration(out_dir, it, fill):
    """OUT/iter_N made whole or not at all: fill(tmp) writes its files into a temporary directory that
    is then renamed into place; the tracker comes last (temporary name, fsync, rename)."""
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, f"iter_{it:07d}")
    if os.path.exists(final):
        raise ConvertError(f"{final} exists; choose another output directory")
    tmp = tempfile.mkdtemp(prefix=f".iter_{it:07d}.", dir=out_dir)
    try:
        fill(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tracker = os.path.join(out_dir, "latest_checkpointed_iteration.txt")
    write_file_synced(tracker + ".tmp", f"{it}\n".encode())
    os.rename(tracker + ".tmp", tracker)
    return final


def write_ours(out_dir, h, layout, master, m, v):
    """OUT/iter_N/mp_rank_00/model_optim_rng.bin, written a tensor at a time (its CRC-32C built up as it
    goes), then its manifest (the mark of a complete checkpoint; the header's manifest mark says so)."""
    h = list(h)
    h[W["MANIFESTED"]] = 1
    for arrays in (master, m, v):
        for name, _, shape in layout:
            if tuple(np.shape(arrays[name])) != tuple(shape):
                raise ConvertError(f"{name}: shape {np.shape(arrays[name])}, the model calls for {tuple(shape)}")
    rel = "mp_rank_00/model_optim_rng.bin"

    def fill(tmp):
        os.makedirs(os.path.join(tmp, "mp_rank_00"))
        header = struct.pack(f"<{HEADER_WORDS}q", *h)
        crc, size = crc32c(header), len(header)
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(header)
            for arrays in (master, m, v):
                for name, _, _ in layout:
                    data = np.ascontiguousarray(arrays[name], dtype="<f4").tobytes()
                    f.write(data)
                    crc, size = crc32c_combine(crc, crc32c(data), len(data)), size + len(data)
            f.flush()
            os.fsync(f.fileno())
        manifest = f"megatron.c checkpoint manifest 1\nfiles 1\n{crc:08x} {size} {rel}\n"
        write_file_synced(os.path.join(tmp, "manifest.txt"), manifest.encode())
    return write_iteration(out_dir, h[W["ITERATION"]], fill)


# ------------------------------------------------------------------------------------------------
# Megatron-Core's side
# ------------------------------------------------------------------------------------------------

def mcore():
    """megatron.core's dist_checkpointing, with a one-process gloo group when none exists."""
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
    except ImportError as e:
        raise ConvertError(f"needs torch and megatron-core ({e}); pip install megatron-core")
    if not torch.cuda.is_available():
        # megatron-core's torch_dist writer waits for its (non-blocking) device-to-host copies with
        # torch.cuda.synchronize() and all-reduces its success flag on torch.cuda.current_device(); with
        # no GPU every tensor here is on the CPU already and gloo reduces on the CPU
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    _tensor_properties_shim(torch)
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="convert_mcore_store_", delete=False).name
        os.unlink(store)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return torch, dist_checkpointing, ShardedTensor


def _tensor_properties_shim(torch):
    """megatron-core (0.16) rebuilds each stored tensor's metadata as torch.empty(size,
    **TensorProperties.__dict__), which newer torch refuses once its TensorProperties has a `strides`
    field. Its module then gets a torch whose empty() leaves `strides` out (nothing else changes)."""
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
    if "strides" not in getattr(dcp_metadata.TensorProperties, "__dataclass_fields__", {}) or \
            isinstance(mcore_torch_strategy.torch, _TorchWithoutStrides):
        return
    mcore_torch_strategy.torch = _TorchWithoutStrides(torch)


class _TorchWithoutStrides:
    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        kwargs.pop("strides", None)
        return self._torch.empty(*args, **kwargs)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPT_KEYS = {"distributed": "param", "plain": "fp32_param"}


def megatron_args(h, m):
    """Megatron's argument names for what the header knows (the `args` of common.pt)."""
    precision = PRECISIONS[h[W["PRECISION"]]]
    a = argparse.Namespace(**vars(m))
    a.group_query_attention = m.num_query_groups != m.num_attention_heads
    a.add_position_embedding = m.position_embedding_type == "learned_absolute"
    a.vocab_size = h[W["TRUE_VOCAB"]] or None
    a.seed = h[W["SEED"]]
    a.consumed_train_samples = h[W["CONSUMED"]]
    a.consumed_valid_samples = 0
    a.iteration = h[W["ITERATION"]]
    a.bf16, a.fp16 = precision == "bf16", precision == "fp16"
    a.params_dtype = TORCH_DTYPES[precision]
    a.hysteresis = h[W["HYSTERESIS"]] if precision != "fp16" else 2
    a.tensor_model_parallel_size = a.pipeline_model_parallel_size = 1
    a.ckpt_format = "torch_dist"
    a.hidden_dropout = a.attention_dropout = 0.0
    a.megatron_c_header_words = HEADER_WORDS   # marks a checkpoint written by this tool
    return a


def to_mcore(ckpt, out, iteration, optimizer, sched, no_verify=False):
    h, m, layout, (master, adam_m, adam_v) = read_ours(ckpt, iteration, no_verify)   # the integrity rule first
    torch, dcp, ShardedTensor = mcore()
    precision = PRECISIONS[h[W["PRECISION"]]]
    model_dtype = getattr(torch, TORCH_DTYPES[precision])
    it = h[W["ITERATION"]]

    def sharded(key, array, dtype):   # no copy for fp32 (the arrays are views of the file's)
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        t = t if dtype == torch.float32 else t.to(dtype)
        return ShardedTensor.from_rank_offsets(key, t, replica_id=0)

    model_sd = {key: sharded(key, master[name], model_dtype) for name, key, _ in layout}
    # the linear layers' `_extra_state` (Transformer Engine's FP8 metadata; None in the local spec and
    # without FP8): GPTModel asks for them on load, one object per layer as its sharded_state_dict has them
    from megatron.core.dist_checkpointing import ShardedObject
    L = m.num_layers
    for linear in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        for layer in range(L):
            key = f"{LAYER}{linear}._extra_state"
            model_sd[f"{key}/{layer}"] = ShardedObject(key, None, (L,), (layer,), replica_id=0)
    model_sd["output_layer._extra_state"] = ShardedObject("output_layer._extra_state", None, (1,), (0,), replica_id=0)
    sd = {"args": megatron_args(h, m), "checkpoint_version": 3.0, "iteration": it, "model": model_sd,
          "num_floating_point_operations_so_far": 0}
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer != "none":
        step = h[W["ADAM_STEP"]]
        group = lambda wd: {"lr": sched.lr, "weight_decay": wd, "betas": (sched.adam_beta1, sched.adam_beta2),
                            "eps": sched.adam_eps, "bias_correction": True, "amsgrad": False, "step": step,
                            "wd_mult": 1.0 if wd else 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
                            "is_decoupled_lr": False, "max_lr": sched.lr, "min_lr": sched.min_lr}
        state = {}
        for s, arrays in ((OPT_KEYS[optimizer], master), ("exp_avg", adam_m), ("exp_avg_sq", adam_v)):
            for name, key, _ in layout:
                k = f"optimizer.state.{s}.{key}"
                state[k] = sharded(k, arrays[name], torch.float32)
        opt = {"optimizer": {"param_groups": [group(sched.weight_decay), group(0.0)]}, "param_state": state}
        if optimizer == "distributed":
            opt["param_state_sharding_type"] = "fully_reshardable"
            content["distrib_optim_sharding_type"] = "fully_reshardable"
        if precision == "fp16":
            opt["grad_scaler"] = {"scale": torch.tensor(bits_f64(h[W["LOSS_SCALE_BITS"]]), dtype=torch.float32),
                                  "growth_tracker": h[W["GROWTH"]], "hysteresis_tracker": h[W["HYSTERESIS"]]}
        sd["optimizer"] = opt
        sd["opt_param_scheduler"] = {
            "max_lr": sched.lr, "lr_warmup_steps": sched.lr_warmup_samples, "num_steps": h[W["SCHED_STEPS"]],
            "lr_decay_style": sched.lr_decay_style, "lr_decay_steps": sched.lr_decay_samples,
            "min_lr": sched.min_lr, "start_wd": sched.weight_decay, "end_wd": sched.weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": 0}
    return write_iteration(out, it, lambda tmp: dcp.save(sd, tmp, content_metadata=content))


def arg(a, name, default=None):
    v = getattr(a, name, default)
    return default if v is None else v


def from_mcore(src, out, iteration):
    torch, dcp, ShardedTensor = mcore()
    it = read_tracker(src) if iteration is None else iteration
    d = os.path.join(src, f"iter_{it:07d}")
    if not os.path.isfile(os.path.join(d, "metadata.json")):
        raise ConvertError(f"{d} is not a torch_dist checkpoint (no metadata.json)")
    common = dcp.load_common_state_dict(d)
    content = dcp.load_content_metadata(d) or {}
    a = common.get("args")
    if a is None:
        raise ConvertError(f"{d}: its common state has no `args` (the model's flavour comes from them)")
    metadata = dcp.load_tensors_metadata(d)
    keys = set(metadata)
    if content.get("distrib_optim_sharding_type", "") == "dp_reshardable" or \
            any(k.startswith("optimizer.distributed.") and ".gbuf_idx_" in k for k in keys):
        raise ConvertError(f"{d}: the distributed optimizer's state is in dp_reshardable (bucket) form; "
                           "save it with --dist-ckpt-optim-fully-reshardable")
    heads = int(a.num_attention_heads)
    groups = int(a.num_query_groups) if arg(a, "group_query_attention", False) and arg(a, "num_query_groups") \
        else heads
    position = arg(a, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none"):
        raise ConvertError(f"{d}: position_embedding_type {position!r} has no counterpart here")
    if arg(a, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        raise ConvertError(f"{d}: normalization {a.normalization!r} has no counterpart here")
    if arg(a, "num_experts", 0):
        raise ConvertError(f"{d}: a mixture-of-experts model (--num-experts {a.num_experts}), which this tool does not "
                           "convert")
    for flag in ("squared_relu", "qk_layernorm"):
        if arg(a, flag, False):
            raise ConvertError(f"{d}: the model was trained with --{flag.replace('_', '-')}, which this tool does not "
                               "convert")
    m = SimpleNamespace(
        num_layers=int(a.num_layers), hidden_size=int(a.hidden_size), num_attention_heads=heads,
        num_query_groups=groups, kv_channels=int(arg(a, "kv_channels", a.hidden_size // heads)),
        ffn_hidden_size=int(arg(a, "ffn_hidden_size", 4 * a.hidden_size)),
        padded_vocab_size=int(metadata["embedding.word_embeddings.weight"].global_shape[0]),
        max_position_embeddings=int(a.max_position_embeddings),
        normalization=arg(a, "normalization", "LayerNorm"), swiglu=bool(arg(a, "swiglu", False)),
        position_embedding_type=position,
        untie_embeddings_and_output_weights=bool(arg(a, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bool(arg(a, "add_bias_linear", True)),
        apply_layernorm_1p=bool(arg(a, "apply_layernorm_1p", False)),
        norm_epsilon=float(arg(a, "norm_epsilon", 1e-5)), rotary_base=float(arg(a, "rotary_base", 10000)),
        rotary_percent=float(arg(a, "rotary_percent", 1.0)), use_rope_scaling=bool(arg(a, "use_rope_scaling", False)),
        rope_scaling_factor=float(arg(a, "rope_scaling_factor", 8.0)))
    layout = param_layout(m)
    for name, key, shape in layout:
        if key not in metadata:
            raise ConvertError(f"{d}: tensor {key} is missing (the args call for it)")
        if tuple(metadata[key].global_shape) != tuple(shape):
            raise ConvertError(f"{d}: {key} is {tuple(metadata[key].global_shape)}, the args call for {tuple(shape)}")
    model_keys = {key for _, key, _ in layout}
    extra = sorted(k for k in keys if not k.startswith("optimizer.") and k not in model_keys and
                   not k.endswith("_extra_state") and k != "rng_state" and not k.startswith("rerun_state")
                   and k != "common_state")
    if extra:
        raise ConvertError(f"{d}: tensor {extra[0]} has no counterpart in this project's model")
    master_key = next((s for s in ("param", "fp32_param")
                       if all(f"optimizer.state.{s}.{key}" in keys for _, key, _ in layout)), None)
    with_adam = all(f"optimizer.state.{s}.{key}" in keys for s in ("exp_avg", "exp_avg_sq") for _, key, _ in layout)
    request = {}
    for name, key, shape in layout:
        names = [key] if master_key is None else []
        names += [f"optimizer.state.{s}.{key}" for s in ([master_key] if master_key else []) +
                  (["exp_avg", "exp_avg_sq"] if with_adam else [])]
        for k in names:
            request[k] = ShardedTensor.from_rank_offsets(
                k, torch.empty(tuple(shape), dtype=metadata[k].dtype), replica_id=0)
    loaded = dcp.load(request, d)
    f32 = lambda k: loaded[k].to(torch.float32).numpy()
    zeros = {name: np.zeros(shape, np.float32) for name, _, shape in layout}
    master = {name: f32(f"optimizer.state.{master_key}.{key}" if master_key else key) for name, key, _ in layout}
    adam_m = {name: f32(f"optimizer.state.exp_avg.{key}") for name, key, _ in layout} if with_adam else zeros
    adam_v = {name: f32(f"optimizer.state.exp_avg_sq.{key}") for name, key, _ in layout} if with_adam else zeros
    if master_key is None:
        print(f"note: {d} has no fp32 master weights; the model tensors ({metadata[layout[0][1]].dtype}) are "
              "the master weights" + ("" if with_adam else ", and Adam's moments start at zero"))
    opt = common.get("optimizer", {}) or {}
    groups_ = (opt.get("optimizer") or {}).get("param_groups") or [{}]
    steps = {int(g["step"]) for g in groups_ if g.get("step") is not None}
    if len(steps) > 1:
        raise ConvertError(f"{d}: the optimizer's param groups are at different Adam steps {sorted(steps)}")
    precision = "fp16" if arg(a, "fp16", False) else "bf16" if arg(a, "bf16", False) else "fp32"
    scaler = opt.get("grad_scaler") or {}
    sched_ = common.get("opt_param_scheduler") or {}
    h = [0] * HEADER_WORDS
    vals = {
        "MAGIC": CK_MAGIC, "VERSION": CK_VERSION, "LAYERS": m.num_layers, "HIDDEN": m.hidden_size,
        "HEADS": m.num_attention_heads, "GROUPS": m.num_query_groups, "KV": m.kv_channels, "FFN": m.ffn_hidden_size,
        "VOCAB": m.padded_vocab_size, "POSITIONS": m.max_position_embeddings,
        "NUM_PARAMS": sum(int(np.prod(s)) for _, _, s in layout),
        "PRECISION": {v: k for k, v in PRECISIONS.items()}[precision], "ITERATION": int(common.get("iteration", it)),
        "CONSUMED": int(arg(a, "consumed_train_samples", 0)), "SCHED_STEPS": int(sched_.get("num_steps", 0)),
        "ADAM_STEP": steps.pop() if steps else 0, "SEED": int(arg(a, "seed", 1234)),
        "GROWTH": int(scaler.get("growth_tracker", 0)),
        "HYSTERESIS": int(scaler.get("hysteresis_tracker", arg(a, "hysteresis", 2))),
        "LOSS_SCALE_BITS": f64_bits(float(scaler["scale"]) if "scale" in scaler else 1.0), "TP": 1, "PP": 1,
        "NORMALIZATION": {v: k for k, v in NORMS.items()}[m.normalization], "SWIGLU": int(m.swiglu),
        "POSITION_TYPE": {v: k for k, v in POSITIONS.items()}[position],
        "UNTIED": int(m.untie_embeddings_and_output_weights), "NO_BIAS_LINEAR": int(not m.add_bias_linear),
        "NORM_EPS_BITS": f64_bits(m.norm_epsilon), "TRUE_VOCAB": int(arg(a, "vocab_size", 0) or 0),
        "LAYERNORM_1P": int(m.apply_layernorm_1p)}
    if position == "rope":
        vals.update(ROTARY_BASE_BITS=f64_bits(m.rotary_base), ROTARY_PERCENT_BITS=f64_bits(m.rotary_percent),
                    ROPE_SCALING_FACTOR_BITS=f64_bits(m.rope_scaling_factor if m.use_rope_scaling else 0.0))
    for k, v in vals.items():
        h[W[k]] = v
    if h[W["TRUE_VOCAB"]] > h[W["VOCAB"]]:
        h[W["TRUE_VOCAB"]] = 0
    return write_ours(out, h, layout, master, adam_m, adam_v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    way = ap.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-mcore", nargs=2, metavar=("CKPT", "OUT"), help="this project's -> torch_dist")
    way.add_argument("--from-mcore", nargs=2, metavar=("MCORE", "OUT"), help="torch_dist -> this project's")
    ap.add_argument("--iteration", type=int, help="the iteration to convert (default: the tracker's)")
    ap.add_argument("--optimizer", choices=("distributed", "plain", "none"), default="distributed")
    ap.add_argument("--no-verify", action="store_true",
                    help="--to-mcore: read a checkpoint whose manifest check fails (or that lost the manifest it "
                         "was saved with) anyway, with a warning")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=0.0)
    ap.add_argument("--lr-decay-style", default="cosine")
    ap.add_argument("--lr-warmup-samples", type=int, default=0)
    ap.add_argument("--lr-decay-samples", type=int, default=0)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--adam-beta1", type=float, default=0.9)
    ap.add_argument("--adam-beta2", type=float, default=0.999)
    ap.add_argument("--adam-eps", type=float, default=1e-8)
    args = ap.parse_args(argv)
    if args.iteration is not None and args.iteration < 0:
        ap.error("--iteration must be >= 0")
    for name in ("lr", "min_lr", "weight_decay", "adam_eps"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            ap.error(f"--{name.replace('_', '-')} must be a finite number >= 0")
    if args.lr_warmup_samples < 0 or args.lr_decay_samples < 0:
        ap.error("--lr-warmup-samples and --lr-decay-samples must be >= 0")
    if args.no_verify and not args.to_mcore:
        ap.error("--no-verify goes with --to-mcore (it reads this project's checkpoint)")
    try:
        if args.to_mcore:
            done = to_mcore(args.to_mcore[0], args.to_mcore[1], args.iteration, args.optimizer, args, args.no_verify)
        else:
            done = from_mcore(args.from_mcore[0], args.from_mcore[1], args.iteration)
    except ConvertError as e:
        print(f"convert_mcore: {e}", file=sys.stderr)
        return 1
    print(f"convert_mcore: wrote {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
