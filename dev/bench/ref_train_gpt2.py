#!/usr/bin/env python3
"""
ref_train_gpt2.py: the PyTorch side of dev/bench/gutenberg_run.sh. It trains the same GPT-2 as
train_gpt, from the same initial weights, on the same samples in the same order, with the same
hyper-parameters, and prints Megatron-style log lines (the ones train_gpt prints) so that one parser
reads both logs.

    python dev/bench/ref_train_gpt2.py --data-prefix P_text_document --train-index DIR --valid-index DIR \
        --init CKPT_DIR [--expect-init-loss-from OURS_INIT_LOG] [--iters 2000 ...]
    python dev/bench/ref_train_gpt2.py --check-vectors dev/data/gpt_vectors/gpt2_tiny.bin   # CPU self-test
    python dev/bench/ref_train_gpt2.py --compare OURS_LOG TORCH_LOG                         # the table

Only torch and numpy are needed (no tokenizer library, no network).

The model (GPT-2 as Megatron builds it): learned absolute positions, pre-LN (LayerNorm eps 1e-5, weight
and bias), fused QKV in Megatron's grouped layout (per head i: q_i, k_i, v_i, d rows each, which this
model keeps as is: the checkpoint's tensors are used without reordering), causal
F.scaled_dot_product_attention (flash attention on the GPU: the other SDPA backends are switched off
unless --sdpa any), GELU (tanh), biases everywhere, output layer tied to the word embeddings over the
whole padded vocabulary (padding columns in the softmax, as Megatron), no dropout.

Precision: fp32 weights, torch.autocast(bfloat16) for the forward (matmuls and attention in bf16,
LayerNorm / softmax / loss in fp32 as autocast does), fp32 gradients and AdamW state: the "fp32
master weights + bf16 compute" recipe. Megatron/train_gpt keep bf16 weight copies and fp32 masters,
which rounds the same weights to bf16 for the GEMMs; the two agree to bf16 rounding noise.

Training (Megatron semantics): global batch --gbs as --gbs/--mbs micro-batches with gradient
accumulation (loss = mean over the global batch), clip the global gradient norm to --clip-grad
(coeff = clip / (norm + 1e-6) when < 1), torch.optim.AdamW(fused=True) with weight decay on the
2-D weights and both embeddings only, betas (0.9, 0.95), eps 1e-8. Learning rate: Megatron's
OptimizerParamScheduler counted in samples, starting at 0: iteration k (0-based) uses lr(k*gbs),
linear warmup over lr_warmup_iters*gbs samples, cosine to --min-lr at lr_decay_iters*gbs.

Data: Megatron's GPT samples, reconstructed from the .bin/.idx and the index arrays that
`prepro/dataset_info --output-dir` writes (document_index.npy: the split's *sequence ids* into the
whole dataset; sample_index.npy: rows (position in document_index, token offset); shuffle_index.npy).
Sample k = tokens of documents document_index[d0..d1] from offset o0 (in d0) to o1 (in d1) inclusive,
(d0, o0) = sample_index[shuffle[k]], (d1, o1) = sample_index[shuffle[k] + 1]: seq_length + 1 tokens.
Iteration it takes train samples [it*gbs, (it+1)*gbs) (Megatron's sequential sampler, one rank);
evaluation j takes valid samples [j*eval_iters*gbs, (j+1)*eval_iters*gbs) (the valid iterator carries
on across evaluations), at every --eval-interval and once more after training, as train_gpt does.

Initial weights: train_gpt's checkpoint (DIR/iter_N/mp_rank_00/model_optim_rng.bin, or that file):
int64[64] header (magic "MTCK", version, layers, hidden, heads, groups, kv channels, ffn, padded vocab,
positions, number of parameters, ...), then the fp32 master weights in megatron.h's canonical order
(MT_P_*), then Adam m and v (ignored). The model's shape is taken from the header.
"""
import argparse
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# Checkpoint (megatron.cu section 19) and the canonical parameter order (megatron.h MT_P_*)
# ------------------------------------------------------------------------------------------------

CKPT_MAGIC = 0x4B43544D  # "MTCK"
CKPT_HEADER_WORDS = 64
(CK_MAGIC, CK_VERSION, CK_LAYERS, CK_HIDDEN, CK_HEADS, CK_GROUPS, CK_KV, CK_FFN, CK_VOCAB, CK_POSITIONS,
 CK_NUM_PARAMS, CK_PRECISION, CK_ITERATION, CK_CONSUMED, CK_SCHED_STEPS, CK_ADAM_STEP, CK_SEED) = range(17)


def canonical_specs(L, h, n, f, Vp, P):
    """(name, shape) in megatron.h's MT_P_* order (groups = heads, kv channels = h / n)."""
    return [
        ("word_embeddings", (Vp, h)), ("position_embeddings", (P, h)),
        ("ln1_weight", (L, h)), ("ln1_bias", (L, h)),
        ("qkv_weight", (L, 3 * h, h)), ("qkv_bias", (L, 3 * h)),
        ("proj_weight", (L, h, h)), ("proj_bias", (L, h)),
        ("ln2_weight", (L, h)), ("ln2_bias", (L, h)),
        ("fc1_weight", (L, f, h)), ("fc1_bias", (L, f)),
        ("fc2_weight", (L, h, f)), ("fc2_bias", (L, h)),
        ("final_ln_weight", (h,)), ("final_ln_bias", (h,)),
    ]


def checkpoint_file(path):
    if os.path.isdir(path):
        tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
        if os.path.isfile(tracker):
            it = int(open(tracker).read().strip())
            path = os.path.join(path, f"iter_{it:07d}", "mp_rank_00", "model_optim_rng.bin")
        else:
            path = os.path.join(path, "mp_rank_00", "model_optim_rng.bin")
    if not os.path.isfile(path):
        sys.exit(f"ref_train_gpt2: no checkpoint file at {path}")
    return path


def read_checkpoint(path):
    """-> (shape dict, flat fp32 numpy array of the master weights, header)."""
    path = checkpoint_file(path)
    hd = np.fromfile(path, dtype="<i8", count=CKPT_HEADER_WORDS)
    if len(hd) != CKPT_HEADER_WORDS or hd[CK_MAGIC] != CKPT_MAGIC:
        sys.exit(f"ref_train_gpt2: {path} is not a megatron.c checkpoint (magic)")
    if hd[CK_VERSION] != 1:
        print(f"ref_train_gpt2: warning: checkpoint version {int(hd[CK_VERSION])} (this reader knows 1); reading "
              f"the header words and the fp32 weights that follow it as version 1 lays them out")
    shape = dict(L=int(hd[CK_LAYERS]), h=int(hd[CK_HIDDEN]), n=int(hd[CK_HEADS]), f=int(hd[CK_FFN]),
                 Vp=int(hd[CK_VOCAB]), P=int(hd[CK_POSITIONS]))
    g, kv, N = int(hd[CK_GROUPS]), int(hd[CK_KV]), int(hd[CK_NUM_PARAMS])
    if g != shape["n"] or kv * shape["n"] != shape["h"]:
        sys.exit(f"ref_train_gpt2: {path}: only groups == heads and kv * heads == hidden are handled here")
    expect = sum(int(np.prod(s)) for _, s in canonical_specs(**shape))
    if N != expect:
        sys.exit(f"ref_train_gpt2: {path}: header says {N} parameters, the shapes give {expect}")
    size = os.path.getsize(path)
    if size != 8 * CKPT_HEADER_WORDS + 3 * 4 * N and (hd[CK_VERSION] == 1 or size < 8 * CKPT_HEADER_WORDS + 4 * N):
        sys.exit(f"ref_train_gpt2: {path}: {size} bytes, expected {8 * CKPT_HEADER_WORDS + 12 * N} "
                 f"(header, weights, Adam m and v)")
    flat = np.fromfile(path, dtype="<f4", count=N, offset=8 * CKPT_HEADER_WORDS)
    return shape, flat, hd


def write_checkpoint(path, model, iteration=0):
    """Writes the model's weights in train_gpt's checkpoint format (Adam m, v zero). For tests."""
    flat = model.to_canonical()
    hd = np.zeros(CKPT_HEADER_WORDS, dtype="<i8")
    hd[[CK_MAGIC, CK_VERSION, CK_LAYERS, CK_HIDDEN, CK_HEADS, CK_GROUPS, CK_KV, CK_FFN, CK_VOCAB,
        CK_POSITIONS, CK_NUM_PARAMS, CK_ITERATION]] = [
        CKPT_MAGIC, 1, model.L, model.h, model.n, model.n, model.h // model.n, model.f, model.Vp, model.P,
        flat.size, iteration]
    d = os.path.join(path, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model_optim_rng.bin"), "wb") as fh:
        fh.write(hd.tobytes())
        fh.write(flat.astype("<f4").tobytes())
        fh.write(np.zeros(2 * flat.size, dtype="<f4").tobytes())
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, h, n, f, eps):
        super().__init__()
        self.n, self.d = n, h // n
        self.ln1 = nn.LayerNorm(h, eps=eps)
        self.qkv = nn.Linear(h, 3 * h)      # rows in Megatron's grouped layout: head i -> [q_i, k_i, v_i]
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=eps)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, self.n, 3, self.d)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))          # [B, n, T, d] each
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, h, n, f, Vp, P, eps=1e-5):
        super().__init__()
        self.L, self.h, self.n, self.f, self.Vp, self.P = L, h, n, f, Vp, P
        self.wte = nn.Embedding(Vp, h)
        self.wpe = nn.Embedding(P, h)
        self.blocks = nn.ModuleList([Block(h, n, f, eps) for _ in range(L)])
        self.ln_f = nn.LayerNorm(h, eps=eps)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)                 # tied, all Vp columns
        return F.cross_entropy(logits.float().view(-1, self.Vp), targets.reshape(-1))

    # canonical tensors <-> modules
    def _targets(self):
        B = self.blocks
        return {
            "word_embeddings": [self.wte.weight], "position_embeddings": [self.wpe.weight],
            "ln1_weight": [b.ln1.weight for b in B], "ln1_bias": [b.ln1.bias for b in B],
            "qkv_weight": [b.qkv.weight for b in B], "qkv_bias": [b.qkv.bias for b in B],
            "proj_weight": [b.proj.weight for b in B], "proj_bias": [b.proj.bias for b in B],
            "ln2_weight": [b.ln2.weight for b in B], "ln2_bias": [b.ln2.bias for b in B],
            "fc1_weight": [b.fc1.weight for b in B], "fc1_bias": [b.fc1.bias for b in B],
            "fc2_weight": [b.fc2.weight for b in B], "fc2_bias": [b.fc2.bias for b in B],
            "final_ln_weight": [self.ln_f.weight], "final_ln_bias": [self.ln_f.bias],
        }

    def specs(self):
        return canonical_specs(self.L, self.h, self.n, self.f, self.Vp, self.P)

    @torch.no_grad()
    def load_canonical(self, flat):
        targets, off = self._targets(), 0
        for name, shape in self.specs():
            k = int(np.prod(shape))
            a = torch.tensor(np.asarray(flat[off:off + k], dtype=np.float32)).view(shape)
            ts = targets[name]
            if len(ts) == 1:
                ts[0].copy_(a.view(ts[0].shape))
            else:
                for l, t in enumerate(ts):
                    t.copy_(a[l].view(t.shape))
            off += k
        assert off == flat.size, (off, flat.size)

    @torch.no_grad()
    def to_canonical(self):
        targets = self._targets()
        return np.concatenate([torch.stack([t.detach().float().cpu() for t in targets[name]]).numpy().reshape(-1)
                               for name, _ in self.specs()])

    @torch.no_grad()
    def init_megatron(self, seed, std=0.02):
        """Megatron's init (for runs without --init): normal(std), proj/fc2 std/sqrt(2L), biases 0, LN 1."""
        g = torch.Generator().manual_seed(seed)
        for name, ts in self._targets().items():
            for t in ts:
                if name.endswith("bias"):
                    t.zero_()
                elif name.startswith("ln") or name.startswith("final_ln"):
                    t.fill_(1.0)
                else:
                    s = std / math.sqrt(2 * self.L) if name in ("proj_weight", "fc2_weight") else std
                    t.copy_(torch.randn(t.shape, generator=g) * s)

    def param_groups(self, weight_decay):
        decay = {id(t) for name in ("word_embeddings", "position_embeddings", "qkv_weight", "proj_weight",
                                    "fc1_weight", "fc2_weight") for t in self._targets()[name]}
        params = list(self.parameters())
        return [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------------
# Data: Megatron's .bin/.idx (spec section 1) and GPT samples (spec section 2)
# ------------------------------------------------------------------------------------------------

IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
              8: np.uint16}


class IndexedDataset:
    def __init__(self, prefix):
        with open(prefix + ".idx", "rb") as fh:
            head = fh.read(34)
        if len(head) != 34 or head[:9] != b"MMIDIDX\x00\x00":
            sys.exit(f"ref_train_gpt2: {prefix}.idx is not an MMIDIDX index")
        version = int.from_bytes(head[9:17], "little")
        code = head[17]
        n = int.from_bytes(head[18:26], "little")
        if version != 1 or code not in IDX_DTYPES:
            sys.exit(f"ref_train_gpt2: {prefix}.idx: version {version}, dtype code {code}")
        self.dtype = np.dtype(IDX_DTYPES[code])
        self.lengths = np.fromfile(prefix + ".idx", dtype="<i4", count=n, offset=34)
        self.pointers = np.fromfile(prefix + ".idx", dtype="<i8", count=n, offset=34 + 4 * n)
        self.bin = np.memmap(prefix + ".bin", dtype=self.dtype, mode="r")
        if n and (self.pointers[-1] // self.dtype.itemsize + self.lengths[-1]) > len(self.bin):
            sys.exit(f"ref_train_gpt2: {prefix}.bin is shorter than its .idx says")

    def read(self, seq, offset, length):
        start = int(self.pointers[seq]) // self.dtype.itemsize + offset
        return self.bin[start:start + length]


class GPTSplit:
    """One split's samples, from dataset_info's document/sample/shuffle_index.npy."""

    def __init__(self, ds, index_dir, seq_length):
        self.ds, self.S = ds, seq_length
        self.doc = np.load(os.path.join(index_dir, "document_index.npy"))
        self.sample = np.load(os.path.join(index_dir, "sample_index.npy"))
        self.shuffle = np.load(os.path.join(index_dir, "shuffle_index.npy"))
        if self.sample.ndim != 2 or len(self.sample) != len(self.shuffle) + 1:
            sys.exit(f"ref_train_gpt2: {index_dir}: inconsistent sample/shuffle index")

    def __len__(self):
        return len(self.shuffle)

    def get(self, k):
        i = int(self.shuffle[k])
        d0, o0 = (int(x) for x in self.sample[i])
        d1, o1 = (int(x) for x in self.sample[i + 1])
        parts = []
        for d in range(d0, d1 + 1):
            seq = int(self.doc[d])
            off = o0 if d == d0 else 0
            end = o1 + 1 if d == d1 else int(self.ds.lengths[seq])
            parts.append(self.ds.read(seq, off, end - off))
        out = np.concatenate(parts).astype(np.int64)
        if len(out) != self.S + 1:
            sys.exit(f"ref_train_gpt2: sample {k} has {len(out)} tokens, expected {self.S + 1} "
                     f"(index built for another --seq-length?)")
        return out

    def batch(self, first, count):
        if first + count > len(self):
            sys.exit(f"ref_train_gpt2: the split ran out of samples at {first + count} of {len(self)} "
                     f"(index built for fewer iterations?)")
        return np.stack([self.get(first + i) for i in range(count)])


def gpt2_byte_decoder(vocab_file):
    """GPT-2 ids -> bytes, from encoder.json (bytes_to_unicode inverted), to decode samples."""
    import json
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    enc = json.load(open(vocab_file, encoding="utf-8"))
    return {i: bytes(byte_of[ch] for ch in tok) for tok, i in enc.items()}


def escape_like_dataset_info(b):
    """prepro/dataset_info.c print_text: control characters escaped, other bytes as they are."""
    out = bytearray()
    for c in b:
        if c == 10: out += b"\\n"
        elif c == 9: out += b"\\t"
        elif c == 13: out += b"\\r"
        elif c == 34: out += b'\\"'
        elif c == 92: out += b"\\\\"
        elif c < 32 or c == 127: out += b"\\x%02x" % c
        else: out.append(c)
    return bytes(out)


def check_against_dataset_info(split, name, log_path, vocab_file):
    """Compares our first samples with what `dataset_info --show-split NAME` printed (token ids without
    a tokenizer: the first 32 ids; with one: the whole sample decoded). Returns the number compared."""
    raw = open(log_path, "rb").read()
    pat = re.compile(rb"^" + name.encode() + rb" sample (\d+) \((\d+) tokens\): (.*)$", re.M)
    compared = 0
    decoder = None
    for m in pat.finditer(raw):
        k, ntok, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        ours = split.get(k)
        if ntok != len(ours):
            sys.exit(f"ref_train_gpt2: {log_path}: {name} sample {k} has {ntok} tokens, ours {len(ours)}")
        if rest.startswith(b"["):
            ids = [int(x) for x in rest.strip(b"[]. ").split()]
            ok = list(ours[:len(ids)]) == ids
            what = f"first {len(ids)} token ids"
        else:
            if decoder is None:
                decoder = gpt2_byte_decoder(vocab_file)
            text = b"".join(decoder[int(t)] for t in ours)
            ok = rest == b'"' + escape_like_dataset_info(text) + b'"'
            what = f"all {len(ours)} tokens decoded"
        if not ok:
            sys.exit(f"ref_train_gpt2: {name} sample {k} differs from dataset_info's ({log_path}, {what})")
        print(f"data check: {name} sample {k}: {what} equal to dataset_info's")
        compared += 1
    return compared


# ------------------------------------------------------------------------------------------------
# Schedule and one training step
# ------------------------------------------------------------------------------------------------

def megatron_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps):
    """Megatron's OptimizerParamScheduler.get_lr (lr_warmup_init 0, cosine); lengths in samples."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


class Trainer:
    def __init__(self, model, run_model, args, device):
        self.model, self.run_model, self.args, self.device = model, run_model, args, device
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(model.param_groups(args.weight_decay), lr=0.0,
                                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                     fused=fused)
        self.params = [p for p in model.parameters()]
        self.micro = args.gbs // args.mbs
        self.autocast = args.dtype == "bf16"

    def _ctx(self):
        if self.autocast:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    def step(self, batch, lr):
        """batch: int64 tensor [gbs, S+1] on the device. Returns (loss, grad norm) as 0-d tensors."""
        a = self.args
        for g in self.opt.param_groups:
            g["lr"] = lr
        total = torch.zeros((), device=self.device)
        for m in range(self.micro):
            mb = batch[m * a.mbs:(m + 1) * a.mbs]
            with self._ctx():
                loss = self.run_model(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
            (loss / self.micro).backward()
            total += loss.detach().float()
        if a.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, a.clip_grad)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / self.micro, norm

    @torch.no_grad()
    def evaluate(self, batch):
        a = self.args
        total = torch.zeros((), device=self.device)
        for m in range(self.micro):
            mb = batch[m * a.mbs:(m + 1) * a.mbs]
            with self._ctx():
                total += self.model(mb[:, :-1], mb[:, 1:]).float()
        return total / self.micro


# ------------------------------------------------------------------------------------------------
# Log lines (train_gpt's format) and the comparison table
# ------------------------------------------------------------------------------------------------

def log_iteration(it, iters, consumed, ms, lr, gbs, loss, norm, tokens_per_s):
    print(f" [torch] iteration {it:8d}/{iters:8d} | consumed samples: {consumed:12d} | "
          f"elapsed time per iteration (ms): {ms:.1f} | tokens per second: {tokens_per_s:.0f} | "
          f"learning rate: {lr:.6E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} | "
          f"grad norm: {norm:.3f} |", flush=True)


def log_validation(it, loss):
    line = f" validation loss at iteration {it} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(loss, 20)):.6E} | "
    print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)


ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?"
                     r"lm loss: ([0-9.Ee+-]+) \|(?:.*?grad norm: ([0-9.naif]+) \|)?")
VALID_RE = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: ([0-9.Ee+-]+)")


def parse_log(path):
    """-> dict(train={it: (loss, ms, grad_norm)}, valid=[(it, loss)], total_s, ms=[...])"""
    out = dict(train={}, valid=[], total_s=None, tokens_per_s=None)
    if not path or not os.path.isfile(path):
        return out
    for line in open(path, encoding="utf-8", errors="replace"):
        m = ITER_RE.search(line)
        if m and "consumed samples" in line:
            out["train"][int(m.group(1))] = (float(m.group(4)), float(m.group(3)),
                                            float(m.group(5)) if m.group(5) else float("nan"))
            continue
        m = VALID_RE.search(line)
        if m:
            out["valid"].append((int(m.group(1)), float(m.group(2))))
            continue
        m = re.search(r"training took ([0-9.]+) s", line)
        if m:
            out["total_s"] = float(m.group(1))
    return out


def steady_ms(train):
    """Mean ms/iteration over the logged windows, leaving out the first (start-up, compilation)."""
    ms = [v[1] for _, v in sorted(train.items())]
    ms = ms[1:] if len(ms) > 1 else ms
    return sum(ms) / len(ms) if ms else float("nan")


def compare(ours_path, torch_path, gbs, seq, out_path=None):
    ours, ref = parse_log(ours_path), parse_log(torch_path)
    f = lambda x: "" if x is None else f"{x:.4f}"
    f1 = lambda x: "" if x is None else f"{x:.1f}"
    d = lambda a, b: "" if a is None or b is None else f"{a - b:+.4f}"
    vo = {}
    for i, (it, loss) in enumerate(ours["valid"]):
        vo[(it, sum(1 for j, _ in ours["valid"][:i] if j == it))] = loss
    vr = {}
    for i, (it, loss) in enumerate(ref["valid"]):
        vr[(it, sum(1 for j, _ in ref["valid"][:i] if j == it))] = loss
    rows = sorted(set(ours["train"]) | set(ref["train"]) | {k[0] for k in vo} | {k[0] for k in vr})
    lines = ["| iteration | ours train loss | torch train loss | diff | ours val loss | torch val loss | diff |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for it in rows:
        to = ours["train"].get(it, (None,))[0]
        tr = ref["train"].get(it, (None,))[0]
        a, b = vo.get((it, 0)), vr.get((it, 0))
        lines.append(f"| {it} | {f(to)} | {f(tr)} | {d(to, tr)} | {f(a)} | {f(b)} | {d(a, b)} |")
        if (it, 1) in vo or (it, 1) in vr:   # the evaluation after training (next valid samples)
            a, b = vo.get((it, 1)), vr.get((it, 1))
            lines.append(f"| {it} (final eval) | | | | {f(a)} | {f(b)} | {d(a, b)} |")
    tok = gbs * seq
    ms_o, ms_r = steady_ms(ours["train"]), steady_ms(ref["train"])
    lines.append("")
    lines.append("| | ours (train_gpt) | torch |")
    lines.append("| --- | ---: | ---: |")
    lines.append(f"| ms / iteration (mean of log windows after the first) | {ms_o:.1f} | {ms_r:.1f} |")
    lines.append(f"| tokens / s | {tok / ms_o * 1000:.0f} | {tok / ms_r * 1000:.0f} |")
    lines.append(f"| training loop time (s, incl. evaluations; torch incl. compilation) | "
                 f"{f1(ours['total_s'])} | {f1(ref['total_s'])} |")
    text = "\n".join(lines)
    print(text)
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(text + "\n")
    return ours, ref


def first_loss_from_log(path):
    """lm loss of the first logged iteration of a train_gpt log (run it with --log-interval 1)."""
    for line in open(path, encoding="utf-8", errors="replace"):
        m = ITER_RE.search(line)
        if m and "consumed samples" in line:
            if int(m.group(1)) != 1:
                sys.exit(f"ref_train_gpt2: {path}: the first logged iteration is {m.group(1)}, not 1 "
                         f"(run train_gpt with --log-interval 1)")
            return float(m.group(4))
    sys.exit(f"ref_train_gpt2: no iteration line in {path}")


# ------------------------------------------------------------------------------------------------
# Self-test against dev/ref_gpt.py's float64 vectors (CPU)
# ------------------------------------------------------------------------------------------------

def check_vectors(path):
    """Runs this file's model and training step (fp32, CPU, eager) on a dev/data/gpt_vectors file and
    compares logits, losses, grad norms and the final weights with the float64 reference's."""
    raw = open(path, "rb").read()
    hd = np.frombuffer(raw, dtype="<i4", count=256)
    hp = np.frombuffer(raw, dtype="<f4", count=64, offset=1024)
    if hd[0] != 20261121 or hd[2] != 0:
        sys.exit(f"ref_train_gpt2: {path} is not a gpt2 vector file")
    if any(hd[15:24]):   # NoPE, a loss mask, ...: switches this plain GPT-2 does not model
        print(f"{path}: skipped (header words 15..23 {[int(x) for x in hd[15:24]]}: not the plain GPT-2 model)")
        return True
    L, h, n, f, Vp, P, T, G, mb, S, N, g = (int(x) for x in hd[3:15])
    off = 1024 + 256

    def take(dtype, count):
        nonlocal off
        a = np.frombuffer(raw, dtype=dtype, count=count, offset=off)
        off += 4 * count
        return a
    params0 = take("<f4", N); tokens = take("<i4", S * G * (T + 1)).reshape(S, G, T + 1)
    logits_ref = take("<f4", G * T * Vp).reshape(G, T, Vp); loss0 = take("<f4", 1)[0]; take("<f4", N)
    losses_ref = take("<f4", S); norms_ref = take("<f4", S); lrs_ref = take("<f4", S); pfin_ref = take("<f4", N)
    torch.manual_seed(0)
    model = GPT(L, h, n, f, Vp, P, eps=float(hp[9]))
    model.load_canonical(params0)
    assert np.array_equal(model.to_canonical(), params0)
    args = argparse.Namespace(gbs=G, mbs=mb, weight_decay=float(hp[7]), adam_beta1=float(hp[4]),
                              adam_beta2=float(hp[5]), adam_eps=float(hp[6]), clip_grad=float(hp[8]), dtype="fp32")
    dev = torch.device("cpu")
    tr = Trainer(model, model, args, dev)
    # logits of step 0's batch
    with torch.no_grad():
        t = torch.from_numpy(tokens[0].astype(np.int64))
        x = model.wte(t[:, :-1]) + model.wpe(torch.arange(T))
        for blk in model.blocks:
            x = blk(x)
        logits = F.linear(model.ln_f(x), model.wte.weight).numpy()
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  [{'ok' if cond else 'FAIL'}] {what}")
        ok &= bool(cond)
    rel = float(np.abs(logits - logits_ref).max() / np.abs(logits_ref).max())
    print(f"{path}: L={L} h={h} n={n} f={f} Vp={Vp} T={T} G={G} mb={mb} S={S}")
    expect(rel < 1e-5, f"logits (max rel err {rel:.1e})")
    losses, norms, lrs = [], [], []
    for k in range(S):
        lr = megatron_lr(k * G, float(hp[0]), float(hp[1]), int(hp[2]) * G, int(hp[3]) * G)
        loss, norm = tr.step(torch.from_numpy(tokens[k].astype(np.int64)), lr)
        losses.append(float(loss)); norms.append(float(norm)); lrs.append(lr)
    e = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_ref))
    expect(abs(losses[0] - loss0) / loss0 < 1e-5 and e < 1e-5, f"losses over {S} steps (max rel err {e:.1e})")
    e = max(abs(a - b) / abs(b) for a, b in zip(norms, norms_ref))
    expect(e < 1e-4, f"grad norms (max rel err {e:.1e}; clip {float(hp[8]):.3g} active on "
                     f"{sum(x > float(hp[8]) for x in norms_ref)} steps)")
    e = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lrs, lrs_ref))
    expect(e < 1e-6, f"learning rates (max rel err {e:.1e})")
    pfin = model.to_canonical()
    # key biases have exactly-zero gradients in exact arithmetic: compare them loosely (ref_gpt.py notes)
    kmask = np.zeros(N, dtype=bool)
    o = 0
    for name, shape in model.specs():
        k = int(np.prod(shape))
        if name == "qkv_bias":
            d = h // n
            rows = np.zeros((L, n, 3, d), dtype=bool)
            rows[:, :, 1, :] = True
            kmask[o:o + k] = rows.reshape(-1)
        o += k
    diff = np.abs(pfin.astype(np.float64) - pfin_ref)
    expect(diff[~kmask].max() < 2e-5, f"final weights, key biases aside (max abs diff {diff[~kmask].max():.1e})")
    expect(diff[kmask].max() < S * float(hp[0]), f"key biases (max abs diff {diff[kmask].max():.1e} < S*lr)")
    print("check-vectors", "passed" if ok else "FAILED")
    return ok


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description="PyTorch GPT-2 reference run for dev/bench/gutenberg_run.sh")
    ap.add_argument("--data-prefix", help=".bin/.idx prefix (the --data-path of train_gpt)")
    ap.add_argument("--train-index", help="dir with the train split's {document,sample,shuffle}_index.npy")
    ap.add_argument("--valid-index", help="dir with the valid split's index arrays")
    ap.add_argument("--init", help="train_gpt checkpoint (dir or model_optim_rng.bin) with the initial weights")
    ap.add_argument("--expect-init-loss-from", metavar="LOG",
                    help="train_gpt log of the --exit-interval 1 --log-interval 1 run: the first batch's loss "
                         "at the initial weights must agree within --init-loss-tol")
    ap.add_argument("--init-loss-tol", type=float, default=1e-2)
    ap.add_argument("--check-dataset-info", nargs=2, action="append", metavar=("SPLIT", "LOG"), default=[],
                    help="compare our samples with the ones `dataset_info --show-split SPLIT` printed to LOG")
    ap.add_argument("--vocab-file", default="dev/data/gpt2/gpt2-vocab.json")
    # model (taken from the checkpoint header with --init)
    ap.add_argument("--num-layers", type=int, default=12)
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--num-attention-heads", type=int, default=12)
    ap.add_argument("--ffn-hidden-size", type=int, default=0)
    ap.add_argument("--padded-vocab-size", type=int, default=50304)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234, help="init seed without --init")
    # training
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--lr-warmup-iters", type=int, default=100)
    ap.add_argument("--lr-decay-iters", type=int, default=0, help="0: --iters")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--adam-beta1", type=float, default=0.9)
    ap.add_argument("--adam-beta2", type=float, default=0.95)
    ap.add_argument("--adam-eps", type=float, default=1e-8)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--log-interval", type=int, default=50)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-iters", type=int, default=10)
    # execution
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--compile", choices=["on", "off"], default=None, help="torch.compile (default: on with cuda)")
    ap.add_argument("--sdpa", choices=["flash", "any"], default="flash",
                    help="flash: only the flash-attention SDPA backend on cuda (errors if it cannot run)")
    ap.add_argument("--tiny", action="store_true",
                    help="a CPU-sized run: 2 layers, hidden 256, 4 heads, seq 256, mbs 2, gbs 4, 20 iterations, "
                         "log 5, eval every 10 over 2 batches (indices must be built for the same)")
    ap.add_argument("--save-init", metavar="DIR", help="write the initial weights as a train_gpt checkpoint (tests)")
    ap.add_argument("--check-vectors", nargs="+", metavar="FILE", help="self-test on dev/data/gpt_vectors files")
    ap.add_argument("--compare", nargs=2, metavar=("OURS_LOG", "TORCH_LOG"), help="print the side-by-side table")
    ap.add_argument("--table-out", help="with --compare: also write the table (markdown) here")
    if "--tiny" in sys.argv[1:]:   # presets that explicit flags still override
        ap.set_defaults(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256,
                        max_position_embeddings=256, mbs=2, gbs=4, iters=20, log_interval=5, eval_interval=10,
                        eval_iters=2, lr_warmup_iters=2)
    args = ap.parse_args()

    if args.check_vectors:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        sys.exit(0 if all([check_vectors(p) for p in args.check_vectors]) else 1)
    if args.compare:
        compare(args.compare[0], args.compare[1], args.gbs, args.seq_length, args.table_out)
        return
    for k in ("data_prefix", "train_index", "valid_index"):
        if not getattr(args, k):
            ap.error(f"--{k.replace('_', '-')} is required")
    if args.gbs % args.mbs:
        ap.error("--gbs must be a multiple of --mbs")

    device = torch.device(args.device)
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    use_compile = (args.compile or ("on" if device.type == "cuda" else "off")) == "on"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True     # fp32 matmuls (none under autocast) may use TF32
        torch.backends.cudnn.allow_tf32 = True
        if args.sdpa == "flash":
            torch.backends.cuda.enable_flash_sdp(True)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_math_sdp(False)
            if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
                torch.backends.cuda.enable_cudnn_sdp(False)

    # data
    ds = IndexedDataset(args.data_prefix)
    train = GPTSplit(ds, args.train_index, args.seq_length)
    valid = GPTSplit(ds, args.valid_index, args.seq_length)
    for split_name, log in args.check_dataset_info:
        n = check_against_dataset_info(train if split_name == "train" else valid, split_name, log, args.vocab_file)
        if n == 0:
            sys.exit(f"ref_train_gpt2: no '{split_name} sample' lines in {log}")
    n_evals = args.iters // args.eval_interval if args.eval_interval > 0 else 0
    need_valid = (n_evals + 1) * args.eval_iters * args.gbs
    if len(train) < args.iters * args.gbs or len(valid) < need_valid:
        sys.exit(f"ref_train_gpt2: the index arrays hold {len(train)} train / {len(valid)} valid samples, this run "
                 f"needs {args.iters * args.gbs} / {need_valid}: build them with dataset_info for the same "
                 f"--train-iters, --global-batch-size, --eval-interval, --eval-iters")

    # model
    if args.init:
        shape, flat, hd = read_checkpoint(args.init)
        model = GPT(**shape)
        model.load_canonical(flat)
        print(f"initial weights from {checkpoint_file(args.init)} (iteration {int(hd[CK_ITERATION])}, "
              f"{flat.size} parameters)")
    else:
        f = args.ffn_hidden_size or 4 * args.hidden_size
        model = GPT(args.num_layers, args.hidden_size, args.num_attention_heads, f, args.padded_vocab_size,
                    args.max_position_embeddings)
        model.init_megatron(args.seed)
        print(f"initial weights: Megatron-style init from seed {args.seed} (no --init)")
    if model.P < args.seq_length:
        sys.exit(f"ref_train_gpt2: --seq-length {args.seq_length} exceeds the model's {model.P} positions")
    if len(ds.bin) and int(ds.bin.max()) >= model.Vp:
        sys.exit(f"ref_train_gpt2: token id {int(ds.bin.max())} exceeds the padded vocabulary {model.Vp}")
    if args.save_init:
        write_checkpoint(args.save_init, model)
        print(f"wrote the initial weights to {args.save_init}")
    model.to(device)
    run_model = torch.compile(model) if use_compile else model
    trainer = Trainer(model, run_model, args, device)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {model.L} layers, hidden {model.h}, {model.n} heads, ffn {model.f}, padded vocab {model.Vp}, "
          f"positions {model.P}, {nparams} parameters; seq {args.seq_length}, micro-batch {args.mbs}, global batch "
          f"{args.gbs}, {args.iters} iterations; device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {args.dtype} "
          f"({'autocast, fp32 weights' if args.dtype == 'bf16' else 'fp32'}), compile {use_compile}, "
          f"sdpa {args.sdpa}, fused AdamW {device.type == 'cuda'}, torch {torch.__version__}", flush=True)

    expect_loss = first_loss_from_log(args.expect_init_loss_from) if args.expect_init_loss_from else None
    decay_iters = args.lr_decay_iters or args.iters
    warmup, decay = args.lr_warmup_iters * args.gbs, decay_iters * args.gbs
    pin = device.type == "cuda"

    def to_dev(a):
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if pin else t

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    consumed_valid = 0

    def evaluate(it):
        nonlocal consumed_valid
        model.eval()
        total = 0.0
        for _ in range(args.eval_iters):
            total += float(trainer.evaluate(to_dev(valid.batch(consumed_valid, args.gbs))))
            consumed_valid += args.gbs
        model.train()
        log_validation(it, total / args.eval_iters)

    t_start = time.time()
    window_losses, window_time, window_steps = [], 0.0, 0
    next_batch = to_dev(train.batch(0, args.gbs))
    sync()
    t0 = time.time()
    for it in range(args.iters):
        batch = next_batch
        lr = megatron_lr(it * args.gbs, args.lr, args.min_lr, warmup, decay)
        loss, norm = trainer.step(batch, lr)
        if it + 1 < args.iters:
            next_batch = to_dev(train.batch((it + 1) * args.gbs, args.gbs))   # overlaps the GPU's work
        window_losses.append(loss)
        window_steps += 1
        if it == 0:
            first = float(loss)
            msg = f"torch: first batch's loss at the initial weights {first:.6f}"
            if expect_loss is not None:
                msg += f"; train_gpt's {expect_loss:.6f} (diff {first - expect_loss:+.2e}, tolerance {args.init_loss_tol})"
            print(msg + f"; first step incl. {'compilation ' if use_compile else ''}{time.time() - t0:.1f} s", flush=True)
            if expect_loss is not None and not abs(first - expect_loss) <= args.init_loss_tol:
                sys.exit("ref_train_gpt2: the initial losses disagree: the weights, the data order or the model "
                         "differ from train_gpt's; stopping")
        done = it + 1
        if done % args.log_interval == 0 or done == args.iters:
            sync()
            window_time += time.time() - t0
            mean_loss = float(torch.stack(window_losses).mean())
            ms = 1000.0 * window_time / window_steps
            next_lr = megatron_lr(done * args.gbs, args.lr, args.min_lr, warmup, decay)
            log_iteration(done, args.iters, done * args.gbs, ms, next_lr, args.gbs, mean_loss, float(norm),
                          args.gbs * args.seq_length / (ms / 1000.0))
            window_losses, window_time, window_steps = [], 0.0, 0
            if args.eval_interval > 0 and done % args.eval_interval == 0 and args.eval_iters > 0:
                evaluate(done)
            sync()
            t0 = time.time()
        elif args.eval_interval > 0 and done % args.eval_interval == 0 and args.eval_iters > 0:
            sync()
            window_time += time.time() - t0
            evaluate(done)
            t0 = time.time()
    sync()
    print(f"training took {time.time() - t_start:.1f} s", flush=True)
    if args.eval_iters > 0 and len(valid) >= consumed_valid + args.eval_iters * args.gbs:
        evaluate(args.iters)   # as Megatron / train_gpt: once more after training, on the next valid samples


if __name__ == "__main__":
    main()
