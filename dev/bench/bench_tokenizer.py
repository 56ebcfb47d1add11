#!/usr/bin/env python3
"""Tokenizer throughput: prepro/preprocess_data vs tiktoken vs HF tokenizers, same corpus, same machine.

Called by dev/bench/bench_tokenizer.sh (which extracts the corpus and builds the binary).
Documents: every book cut into ~8 KB pieces at paragraph breaks, written as JSONL for
preprocess_data and kept in memory for the Python libraries. MB/s = UTF-8 bytes of the document
texts / wall seconds. preprocess_data's time is the whole process (loading the tokenizer,
reading and parsing the JSONL, writing the .bin/.idx); the libraries' time is the encode call only.
With --encoding hf:DIR, preprocess_data's HuggingFaceTokenizer (ids: the template's BOS included,
as tokenizer(text).input_ids) runs against the tokenizers library on the same documents.
"""
import argparse
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "dev"))


def documents(books_dir, target=8192):
    docs = []
    for path in sorted(glob.glob(os.path.join(books_dir, "**", "*.txt"), recursive=True)):
        text = open(path, "rb").read().decode("utf-8", errors="replace")
        cur, size = [], 0
        for para in text.replace("\r\n", "\n").split("\n\n"):
            cur.append(para)
            size += len(para) + 2
            if size >= target:
                docs.append("\n\n".join(cur))
                cur, size = [], 0
        if cur:
            docs.append("\n\n".join(cur))
    return docs


def timed(fn, repeats):
    best, out = None, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best, out


def run_preprocess(args, jsonl, tmp, tok_flags, mb):
    """preprocess_data's best MB/s per thread count and its token count. Thread counts alternate
    (1, N, 1, N, ...) so that load from other processes hits both alike; the best run of each counts."""
    best = {}
    for _ in range(args.repeats):
        for threads in sorted({1, args.threads}):
            cmd = [args.bin, "--input", jsonl, "--output-prefix", os.path.join(tmp, "out"), "--workers", str(threads),
                   "--quiet"] + tok_flags
            dt, _ = timed(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL), 1)
            best[threads] = min(dt, best.get(threads, dt))
    idx = open(os.path.join(tmp, "out_text_document.idx"), "rb").read()
    n = struct.unpack("<Q", idx[18:26])[0]
    return {t: mb / dt for t, dt in best.items()}, sum(struct.unpack("<%di" % n, idx[34:34 + 4 * n]))


def bench_hf(args, docs, mb):
    """HuggingFaceTokenizer on a tokenizer.json: preprocess_data against tokenizers' encode_batch
    (in a subprocess per thread count: RAYON_NUM_THREADS is read once per process)."""
    path = args.encoding[3:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "books.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        rates, ours = run_preprocess(args, jsonl, tmp, ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path], mb)
        for threads, rate in sorted(rates.items()):
            rows.append(("megatron.c preprocess_data (JSONL in, .bin/.idx out)", threads, rate))
        theirs = None
        for threads in sorted({1, args.threads}):
            code = ("import sys,time,json;from tokenizers import Tokenizer;t=Tokenizer.from_file(sys.argv[1]);"
                    "docs=[json.loads(l)['text'] for l in open(sys.argv[2],encoding='utf-8')];best=1e9\n"
                    "for r in range(int(sys.argv[3])):\n"
                    " s=time.perf_counter();o=t.encode_batch(docs);best=min(best,time.perf_counter()-s)\n"
                    "print(best, sum(len(e.ids) for e in o))")
            env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
            r = subprocess.run([sys.executable, "-c", code, os.path.join(path, "tokenizer.json"), jsonl, str(args.lib_repeats)],
                               env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print("HF tokenizers not run: %s" % (r.stderr.strip().splitlines() or ["?"])[-1])
                break
            dt, theirs = r.stdout.split()
            rows.append(("HF tokenizers encode_batch", threads, mb / float(dt)))
    print("tokens: preprocess_data %d, tokenizers %s -> %s" % (ours, theirs, "same count" if str(ours) == theirs else "DIFFERENT"))
    print("%-58s %8s %9s" % ("", "threads", "MB/s"))
    for name, threads, rate in rows:
        print("%-58s %8d %9.1f" % (name, threads, rate))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--books", required=True, help="directory with the extracted books")
    ap.add_argument("--bin", default=os.path.join(REPO, "prepro", "preprocess_data"))
    ap.add_argument("--encoding", default="gpt2",
                    help="gpt2 (GPT2BPETokenizer's files), cl100k_base, o200k_base, llama3 (rank files), or "
                         "hf:DIR (a tokenizer.json directory: preprocess_data's HuggingFaceTokenizer against the "
                         "tokenizers library)")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=5, help="runs of preprocess_data per thread count (best is reported)")
    ap.add_argument("--lib-repeats", type=int, default=1, help="runs of each Python library (best is reported)")
    args = ap.parse_args()

    docs = documents(args.books)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print("corpus: %d documents, %.1f MB (%s), encoding %s, %d cores" % (len(docs), mb, args.books, args.encoding, os.cpu_count()))
    rows = []

    import gen_tokenizer_vectors as g
    if args.encoding.startswith("hf:"):
        return bench_hf(args, docs, mb)
    if args.encoding == "gpt2":
        enc = g.load_encodings(args.shared, names=(), with_gpt2_files=True)["gpt2_files"]
        tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(REPO, "dev/data/gpt2/gpt2-vocab.json"),
                     "--merge-file", os.path.join(REPO, "dev/data/gpt2/gpt2-merges.txt")]
    else:
        enc = g.load_encodings(args.shared, names=(args.encoding,), with_gpt2_files=False)[args.encoding]
        model = {"cl100k_base": "tiktoken/cl100k_base.tiktoken", "o200k_base": "tiktoken/o200k_base.tiktoken",
                 "llama3": "llama3/tokenizer.model"}[args.encoding]
        tok_type = "Llama3Tokenizer" if args.encoding == "llama3" else "TiktokenFileTokenizer"
        tok_flags = ["--tokenizer-type", tok_type, "--tokenizer-model", os.path.join(args.shared, model)]

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "books.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        rates, ours_tokens = run_preprocess(args, jsonl, tmp, tok_flags, mb)
        for threads, rate in sorted(rates.items()):
            rows.append(("megatron.c preprocess_data (JSONL in, .bin/.idx out)", threads, rate))

        # The libraries are 5-20x slower: one timed run each (--lib-repeats).
        dt, ids = timed(lambda: [enc.encode_ordinary(d) for d in docs], args.lib_repeats)
        rows.append(("tiktoken encode_ordinary", 1, mb / dt))
        tik_tokens = sum(map(len, ids))
        if args.threads > 1:
            dt, _ = timed(lambda: enc.encode_ordinary_batch(docs, num_threads=args.threads), args.lib_repeats)
            rows.append(("tiktoken encode_ordinary_batch", args.threads, mb / dt))

        if args.encoding == "gpt2":
            for threads in sorted({1, args.threads}):
                code = ("import sys,time,json;from tokenizers import Tokenizer,models,pre_tokenizers;"
                        "t=Tokenizer(models.BPE.from_file(sys.argv[1],sys.argv[2]));"
                        "t.pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False);"
                        "docs=[json.loads(l)['text'] for l in open(sys.argv[3],encoding='utf-8')];best=1e9\n"
                        "for r in range(int(sys.argv[4])):\n"
                        " s=time.perf_counter();o=t.encode_batch(docs);best=min(best,time.perf_counter()-s)\n"
                        "print(best, sum(len(e.ids) for e in o))")
                env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
                r = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "dev/data/gpt2/gpt2-vocab.json"),
                                    os.path.join(REPO, "dev/data/gpt2/gpt2-merges.txt"), jsonl, str(args.lib_repeats)],
                                   env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    print("HF tokenizers not run: %s" % (r.stderr.strip().splitlines() or ["?"])[-1])
                    break
                dt, hf_tokens = r.stdout.split()
                rows.append(("HF tokenizers encode_batch (%s tokens)" % ("same" if int(hf_tokens) == tik_tokens else "DIFFERENT"),
                             threads, mb / float(dt)))

    print("tokens: preprocess_data %d, tiktoken %d -> %s" % (ours_tokens, tik_tokens, "same count" if ours_tokens == tik_tokens else "DIFFERENT"))
    print("%-58s %8s %9s" % ("", "threads", "MB/s"))
    for name, threads, rate in rows:
        print("%-58s %8d %9.1f" % (name, threads, rate))


if __name__ == "__main__":
    main()
