#!/usr/bin/env python3
"""Reference vectors for megatron.h's dataset code (sections 2-4), checked by tests/test_dataset.h.

This is an independent numpy re-statement of how Megatron-LM builds GPT samples
(megatron/core/datasets: gpt_dataset.py, helpers.cpp, blended_dataset.py,
blended_megatron_dataset_builder.py, blended_megatron_dataset_config.py, utils.py). The random
parts use numpy.random.RandomState itself, so the vectors are what Megatron computes; the loops of
helpers.cpp are restated in Python. It writes, under dev/data/dataset_vectors/:

  datasets/<name>.{bin,idx}     small synthetic datasets (uint16 and int32 tokens, empty documents,
                                zero-length sequences, a sentence-level one with several sequences
                                per document)
  cases.txt                     one line per case: name|prefixes|weights|split|seq_length|seed|samples
  cases/<name>/meta.txt         per split and dataset: range, samples requested, tokens/epoch, epochs,
                                separate final epoch, first shuffle range, length; blend sizes
  cases/<name>/arrays.npys      the case's arrays, each the exact bytes np.save writes, back to back
                                (meta.txt: "array NAME OFFSET SIZE"):
                                  <split>-<k>-{document,sample,shuffle}_index  as Megatron caches them
                                  <split>-dataset_{index,sample_index}         the blend, if blended
                                  <split>-tokens    tokens of the samples listed on meta's "tokens" line
  rng.txt                       MT19937 outputs, 64-bit random_interval draws, a large shuffle

Run from the repository root: python3 dev/gen_dataset_vectors.py  (numpy only, a few seconds).
"""
import functools
import io
import math
import os
import re
import shutil
import struct

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "dataset_vectors")
SPLITS = ["train", "valid", "test"]
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


# ---------------------------------------------------------------------------------------------
# .bin/.idx (MMIDIDX v1)


def write_indexed(prefix, dtype_code, documents):
    """documents: list of documents, each a list of sequences (lists of token ids)."""
    dt = DTYPES[dtype_code]
    itemsize = np.dtype(dt).itemsize
    lengths, doc_idx, chunks = [], [0], []
    for doc in documents:
        for seq in doc:
            lengths.append(len(seq))
            chunks.append(np.asarray(seq, dtype=dt))
        doc_idx.append(len(lengths))
    with open(prefix + ".bin", "wb") as f:
        for c in chunks:
            f.write(c.tobytes())
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if lengths:
        pointers[1:] = np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * itemsize)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.asarray(lengths, dtype=np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(doc_idx, dtype=np.int64).tobytes())


class Indexed:
    def __init__(self, prefix):
        raw = open(prefix + ".idx", "rb").read()
        assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", raw[9:17])[0] == 1
        self.dtype = DTYPES[raw[17]]
        n, d = struct.unpack("<QQ", raw[18:34])
        self.lengths = np.frombuffer(raw, dtype=np.int32, count=n, offset=34)
        self.pointers = np.frombuffer(raw, dtype=np.int64, count=n, offset=34 + 4 * n)
        self.bin = np.fromfile(prefix + ".bin", dtype=self.dtype)
        self.itemsize = np.dtype(self.dtype).itemsize

    def get(self, i, offset=0, length=None):
        if length is None:
            length = int(self.lengths[i]) - offset
        start = int(self.pointers[i]) // self.itemsize + offset
        return self.bin[start:start + length]


# ---------------------------------------------------------------------------------------------
# Megatron's logic, restated


def normalize(w):
    w = np.array(w, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split):
    v = [float(x) for x in re.findall(r"[.0-9]+", split)]
    v = v + [0.0] * (3 - len(v))
    assert len(v) == 3
    v = normalize(v)
    ends = functools.reduce(lambda acc, x: acc + [acc[-1] + x], v, [0])
    return [None if ends[i + 1] <= ends[i] else (ends[i], ends[i + 1]) for i in range(3)]


def shuffled_documents(documents, epochs, rs, separate):
    if separate and epochs > 1:
        return np.concatenate((shuffled_documents(documents, epochs - 1, rs, False),
                               shuffled_documents(documents, 1, rs, False)))
    out = np.tile(np.asarray(documents, dtype=np.int32), epochs).astype(np.int32)
    rs.shuffle(out)
    return out


def sample_rows(sizes, doc_index, S, epochs, T):
    """helpers.cpp build_sample_idx with drop_last_partial_sequence and one extra token."""
    n = (epochs * T - 1) // S
    big = max(len(doc_index), int(sizes.max())) > np.iinfo(np.int32).max
    rows = np.zeros((n + 1, 2), dtype=np.int64 if big else np.int32)
    d, off = 0, 0
    for k in range(1, n + 1):
        need = S + 1
        while need != 0:
            avail = int(sizes[doc_index[d]]) - off
            need -= avail
            if need <= 0:
                off += need + avail - 1
                need = 0
            else:
                if d == len(doc_index) - 1:
                    off = int(sizes[doc_index[d]]) - 1
                    break
                d += 1
                off = 0
        rows[k] = (d, off)
    return rows


def shuffled_range(first, total, rs):
    dt = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    a = np.arange(0, first, dtype=dt)
    rs.shuffle(a)
    if first == total:
        return a
    b = np.arange(first, total, dtype=dt)
    rs.shuffle(b)
    return np.concatenate((a, b))


class GPT:
    """One split of one dataset (GPTDataset)."""

    def __init__(self, ds, begin, end, num_samples, S, seed):
        self.ds, self.S, self.begin, self.end = ds, S, begin, end
        self.requested = num_samples
        T = int(np.sum(ds.lengths[begin:end]))
        assert T >= 2, "split too small"
        E = 1
        if num_samples is not None:
            while E * T < num_samples * S + 1:
                E += 1
        separate, sans = False, None
        if E > 1:
            sans = ((E - 1) * T - 1) // S
            from_final = num_samples - sans
            per_epoch = (T - 1) // S
            assert 0 <= from_final <= per_epoch + 1
            separate = from_final < int(0.80 * per_epoch)
        rs = np.random.RandomState(seed)
        self.document_index = shuffled_documents(np.arange(begin, end, dtype=np.int32), E, rs, separate)
        self.sample_index = sample_rows(ds.lengths, self.document_index, S, E, T)
        n = self.sample_index.shape[0] - 1
        self.shuffle_index = shuffled_range(sans if separate else n, n, rs)
        self.T, self.E, self.separate = T, E, separate
        self.sans = sans if separate else n

    def __len__(self):
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx):
        i = self.shuffle_index[idx]
        d0, o0 = (int(x) for x in self.sample_index[i])
        d1, o1 = (int(x) for x in self.sample_index[i + 1])
        if d0 == d1:
            parts = [self.ds.get(self.document_index[d0], o0, o1 - o0 + 1)]
        else:
            parts = []
            for d in range(d0, d1 + 1):
                parts.append(self.ds.get(self.document_index[d], o0 if d == d0 else 0,
                                         None if d < d1 else o1 + 1))
        out = np.concatenate(parts).astype(np.int64)
        assert len(out) == self.S + 1
        return out


def blending(weights, size):
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    count = [0] * len(weights)
    for s in range(size):
        x = max(float(s), 1.0)
        best, best_err = 0, weights[0] * x - count[0]
        for d in range(1, len(weights)):
            e = weights[d] * x - count[d]
            if e > best_err:
                best, best_err = d, e
        index[s] = best
        sample[s] = count[best]
        count[best] += 1
    return index, sample


def exhaustive_blending(sizes):
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    index = np.zeros(total, dtype=np.int16)
    sample = np.zeros(total, dtype=np.int64)
    count = [0] * len(sizes)
    unspent = list(range(len(sizes)))
    s = 0
    while unspent:
        x = max(float(s), 1.0)
        best, best_err = -1, -np.finfo(np.float64).max
        for d in unspent:
            e = w[d] * x - count[d]
            if e > best_err:
                best, best_err = d, e
        index[s] = best
        sample[s] = count[best]
        count[best] += 1
        if sizes[best] - count[best] == 0:
            unspent.remove(best)
        s += 1
    return index, sample


def build(prefixes, weights, split, S, seed, sizes):
    """BlendedMegatronDatasetBuilder: per split (mids, blend or None, size)."""
    datasets = [Indexed(p) for p in prefixes]
    matrix = split_matrix(split)
    blended = not (len(prefixes) == 1 and weights is None)
    w1 = normalize(weights) if weights is not None else None
    out = []
    for i in range(3):
        if matrix[i] is None:
            out.append(None)
            continue
        t = sizes[i]
        mids, targets = [], []
        for k, ds in enumerate(datasets):
            n = len(ds.lengths)
            b, e = int(round(matrix[i][0] * float(n))), int(round(matrix[i][1] * float(n)))
            if not blended:
                req = t
            elif w1 is None:
                req = None
            else:
                targets.append(int(math.ceil(t * w1[k])))
                req = int(math.ceil(math.ceil(t * w1[k]) * (1 + 0.005)))
            mids.append(GPT(ds, b, e, req, S, seed))
        if not blended:
            out.append((mids, None, len(mids[0])))
            continue
        if w1 is not None:
            size = sum(targets)
            blend = blending(normalize(w1), size)
        else:
            lens = [len(m) for m in mids]
            if t is not None:
                size = min(t, sum(lens))
                blend = blending(normalize(lens), size)
            else:
                size = sum(lens)
                blend = exhaustive_blending(lens)
        counts = np.bincount(blend[0], minlength=len(mids))
        for k, m in enumerate(mids):
            assert counts[k] <= len(m), "oversampled"
        out.append((mids, blend, size))
    return out


# ---------------------------------------------------------------------------------------------
# data and cases


def make_datasets(d):
    rng = np.random.default_rng(20240601)

    def docs_one_seq(n, hi, vocab, min_tail):
        docs = []
        for j in range(n):
            L = int(rng.integers(0, hi))
            if rng.random() < 0.06:
                L = 0
            if j >= n - 20:
                L = max(L, min_tail)
            docs.append([rng.integers(0, vocab, L).tolist()])
        return docs

    write_indexed(os.path.join(d, "u16"), 8, docs_one_seq(2000, 40, 50257, 5))
    write_indexed(os.path.join(d, "i32"), 4, docs_one_seq(600, 80, 200000, 5))
    write_indexed(os.path.join(d, "small"), 8, [[rng.integers(0, 1000, int(rng.integers(20, 60))).tolist()]
                                                for _ in range(10)])
    sent = []
    for j in range(300):
        k = int(rng.integers(0, 5)) if j < 280 else 3
        sent.append([rng.integers(0, 30000, int(rng.integers(2 if j >= 280 else 0, 20))).tolist()
                     for _ in range(k)])
    write_indexed(os.path.join(d, "sent"), 8, sent)


# name, prefixes, weights, split, seq_length, seed, samples (None = Megatron's None)
CASES = [
    ("u16_default", ["u16"], None, "969, 30, 1", 32, 1234, [1500, 60, 8]),
    ("u16_noseparate", ["u16"], None, "98,2,0", 16, 7, [4266, 200, 0]),
    ("u16_zero", ["u16"], None, "969,30,1", 32, 1234, [100, 0, 0]),
    # 1123 samples per epoch: 870 from the final one is below int(0.80*1123) = 898 (separate), 898 is not
    ("u16_threshold", ["u16"], None, "969,30,1", 32, 77, [1123 + 870, 60, 8]),
    ("u16_threshold_edge", ["u16"], None, "969,30,1", 32, 78, [1123 + 898, 60, 8]),
    ("i32_seed0", ["i32"], None, "969,30,1", 64, 0, [500, 50, 10]),
    ("i32_seedmax", ["i32"], None, "1,1,1", 100, 4294967295, [300, 300, 300]),
    ("i32_none", ["i32"], None, "969,30,1", 64, 1234, [None, None, None]),
    ("small_halfeven", ["small"], None, "1,1,2", 8, 1234, [40, 40, 40]),
    ("small_thirds", ["small"], None, "1,1,1", 9, 42, [25, 3, 100]),
    ("sent_level", ["sent"], None, "969,30,1", 24, 99, [300, 30, 5]),
    ("blend3_weighted", ["u16", "i32", "sent"], [0.5, 0.3, 0.2], "969,30,1", 16, 1234, [1000, 100, 20]),
    # normalize(normalize(w)) != normalize(w) here, and the blend differs: Megatron normalizes twice
    ("blend3_double_norm", ["u16", "i32", "sent"], [2.75, 0.08, 6.47], "969,30,1", 16, 4321, [1000, 100, 20]),
    ("blend2_raw_weights", ["u16", "sent"], [30, 70], "98,2,0", 32, 5, [500, 60, 0]),
    ("blend2_unweighted", ["u16", "sent"], None, "90,8,2", 16, 1234, [400, 40, 100]),
    ("blend2_unweighted_none", ["u16", "sent"], None, "90,8,2", 16, 11, [300, None, None]),
    ("single_weighted", ["small"], [1.0], "1,1,1", 8, 3, [30, 10, 10]),
]


def fmt_num(x):
    return repr(float(x)) if isinstance(x, float) else str(x)


def main():
    if os.path.isdir(ROOT):
        shutil.rmtree(ROOT)
    dsdir = os.path.join(ROOT, "datasets")
    os.makedirs(dsdir)
    make_datasets(dsdir)

    manifest = []
    for name, prefixes, weights, split, S, seed, sizes in CASES:
        result = build([os.path.join(dsdir, p) for p in prefixes], weights, split, S, seed, sizes)
        cdir = os.path.join(ROOT, "cases", name)
        os.makedirs(cdir)
        meta, blob = [], io.BytesIO()

        def save(array_name, array):
            one = io.BytesIO()
            np.save(one, array)
            meta.append(f"array {array_name} {blob.tell()} {len(one.getvalue())}")
            blob.write(one.getvalue())

        for i, r in enumerate(result):
            sp = SPLITS[i]
            if r is None:
                meta.append(f"size {sp} 0")
                continue
            mids, blend, size = r
            meta.append(f"size {sp} {size}")
            for k, m in enumerate(mids):
                req = -1 if m.requested is None else m.requested
                meta.append(f"mid {sp} {k} {m.begin} {m.end} {req} {m.T} {m.E} {int(m.separate)} {m.sans} {len(m)}")
                save(f"{sp}-{k}-document_index", m.document_index)
                save(f"{sp}-{k}-sample_index", m.sample_index)
                save(f"{sp}-{k}-shuffle_index", m.shuffle_index)
            if blend is not None:
                save(f"{sp}-dataset_index", blend[0])
                save(f"{sp}-dataset_sample_index", blend[1])
            if size > 0:
                picks = sorted(set(list(range(min(6, size))) + [size // 2, size - 1]))
                toks = []
                for idx in picks:
                    if blend is None:
                        toks.append(mids[0][idx])
                    else:
                        toks.append(mids[blend[0][idx]][blend[1][idx]])
                meta.append(f"tokens {sp} " + " ".join(str(x) for x in picks))
                save(f"{sp}-tokens", np.asarray(toks, dtype=np.int32))
        with open(os.path.join(cdir, "arrays.npys"), "wb") as f:
            f.write(blob.getvalue())
        with open(os.path.join(cdir, "meta.txt"), "w") as f:
            f.write("\n".join(meta) + "\n")
        w = "-" if weights is None else ",".join(fmt_num(x) for x in weights)
        n = ",".join("-1" if x is None else str(x) for x in sizes)
        manifest.append(f"{name}|{','.join(prefixes)}|{w}|{split}|{S}|{seed}|{n}")
    with open(os.path.join(ROOT, "cases.txt"), "w") as f:
        f.write("\n".join(manifest) + "\n")

    # The generator: MT19937 words after RandomState(seed), 64-bit random_interval draws (legacy
    # randint on uint64 is the same masked rejection), and a shuffle of more than 2^16 elements.
    lines = []
    for seed in [0, 1, 1234, 4294967295]:
        words = np.random.RandomState(seed)._bit_generator.random_raw(8)
        lines.append("mt19937 %d %s" % (seed, " ".join(str(int(x)) for x in words)))
    for seed, mx in [(1234, (1 << 40) + 12345), (7, (1 << 63) + 5)]:
        draws = np.random.RandomState(seed).randint(0, mx + 1, size=6, dtype=np.uint64)
        lines.append("interval64 %d %d %s" % (seed, mx, " ".join(str(int(x)) for x in draws)))
    for seed, n in [(1234, 100003), (99, 70000)]:
        a = np.arange(n, dtype=np.uint32)
        np.random.RandomState(seed).shuffle(a)
        checksum = int(np.sum(a.astype(np.uint64) * (np.arange(n, dtype=np.uint64) + np.uint64(1)),
                              dtype=np.uint64))
        lines.append("shuffle %d %d %d %s %s" % (seed, n, checksum, " ".join(str(int(x)) for x in a[:8]),
                                                 " ".join(str(int(x)) for x in a[-8:])))
    with open(os.path.join(ROOT, "rng.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")

    total = 0
    for dirpath, _, files in os.walk(ROOT):
        total += sum(os.path.getsize(os.path.join(dirpath, x)) for x in files)
    print(f"wrote {ROOT}: {len(CASES)} cases, {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
