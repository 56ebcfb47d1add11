#!/usr/bin/env python3
"""dev/megatron_scripts_check.py — Megatron-LM's own launch scripts, shrunk, run by train_gpt on one GPU
(issue #21's last proof).

The argument lists of the scripts are in dev/data/megatron_scripts/ (one argv token per line, as bash
expands them). Each list is given to ./train_gpt as it is, except for:
  - the model and the run made small: layers, widths, heads, sequence, batch, iteration or sample
    counts, evaluation and log intervals (the flags that carry sizes get new values, nothing else);
  - the layout set to one GPU: tensor and pipeline parallel sizes 1 (sequence parallelism stays asked
    for: with TP = 1 it has nothing to split, as in Megatron);
  - the flags this build refuses removed, each with the line train_gpt refuses it with (none of the
    scripts' flags is refused now: the Mixtral script's MoE flags run as given, its expert-parallel
    size set to 1 like the other parallel sizes, as MoE is built for one GPU and data parallelism);
  - paths: data, tokenizer files, checkpoints, TensorBoard and the data cache point into --work;
    the data is tiny shakespeare, tokenized by prepro/preprocess_data with each script's own tokenizer
    kind (GPT-2 BPE; Llama-3's tokenizer.json for HuggingFaceTokenizer; Mixtral's Llama2Tokenizer,
    a SentencePiece model, is given Mistral's tokenizer.json, the same vocabulary, as
    HuggingFaceTokenizer).
Every other flag is passed unchanged: a flag train_gpt does not take would stop the run, so a run that
trains shows every remaining flag answered. Prints, per script, the command, the exit status, the
informational line, the last iteration line and the validation line; logs stay in --work.

  python3 dev/megatron_scripts_check.py                 # on a GPU machine, after make all
  python3 dev/megatron_scripts_check.py --plan-only     # no GPU: parse and plan each (train_gpt --plan)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

SCRIPTS = ["gpt3_175b.txt", "llama3_8b_fp8_mock.txt", "llama3_8b_fp8_data.txt", "mixtral_8x7b.txt",
           "run_simple_mcore_train_loop.txt"]

# sizes: flag -> the value it gets wherever the script gives it
SMALL = {
    "--num-layers": "4", "--hidden-size": "256", "--ffn-hidden-size": "704", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "64", "--seq-length": "256", "--max-position-embeddings": "256",
    "--micro-batch-size": "2", "--global-batch-size": "8",
    "--train-iters": "40", "--lr-decay-iters": "40", "--lr-warmup-iters": "4",
    "--train-samples": "320", "--lr-decay-samples": "300", "--lr-warmup-samples": "16",
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "1",
    "--eval-interval": "20", "--eval-iters": "2", "--log-interval": "5", "--save-interval": "20",
}
# removed with their values, each refused by this build with one line (printed); none since MoE is built
REFUSED = ()
# the batch-size schedule (thresholds in tokens) in the small run's sizes: 4 sequences of 256 until
# 10240 tokens (40 samples, iteration 10), then 8 (--global-batch-size, the last size)
SMALL_SCHEDULE = ["0:4", "10240:8"]


def read_script(path):
    tokens = [line.rstrip("\n") for line in open(path) if not line.startswith("#") and line.strip()]
    flags = []  # [flag, [values]]
    for tok in tokens:
        if tok.startswith("--"):
            flags.append([tok, []])
        elif flags:
            flags[-1][1].append(tok)
        else:
            raise SystemExit(f"{path}: value {tok!r} before any flag")
    return flags


def prepare_data(train_gpt_dir, work, kind, model):
    """tiny shakespeare, one document per non-empty line (32,777: enough that every script's --split
    leaves documents in each part, Mixtral's 99990,8,2 included: 2 / 100000 of them rounds to 1),
    tokenized as the script's tokenizer kind does; returns the prefix."""
    prefix = os.path.join(work, f"shakespeare_{kind}")
    if os.path.exists(prefix + "_text_document.idx"):
        return prefix + "_text_document"
    jsonl = os.path.join(work, "shakespeare_lines.jsonl")
    with open("dev/data/tinyshakespeare.txt", encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    os.replace(jsonl + ".tmp", jsonl)
    cmd = [os.path.join(train_gpt_dir, "prepro", "preprocess_data"), "--input", jsonl,
           "--output-prefix", prefix, "--append-eod"]
    if kind == "gpt2":
        cmd += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "dev/data/gpt2/gpt2-vocab.json",
                "--merge-file", "dev/data/gpt2/gpt2-merges.txt"]
    else:
        cmd += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"preprocess_data failed: {r.stdout}{r.stderr}")
    return prefix + "_text_document"


def refusal(train_gpt, flag, values):
    """train_gpt's one line for a refused flag"""
    r = subprocess.run([train_gpt, flag] + values + ["--plan", "--world-size", "1"], capture_output=True, text=True)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith("train_gpt:")]
    return lines[0] if lines else f"(exit {r.returncode}, no line)"


def shrink(name, flags, work, train_gpt):
    out, notes = [], []
    run_dir = os.path.join(work, name.replace(".txt", ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    tokenizer = dict((f, v) for f, v in flags if f == "--tokenizer-type").get("--tokenizer-type", ["GPT2BPETokenizer"])[0]
    hf_model = None
    if tokenizer == "HuggingFaceTokenizer":
        hf_model = "dev/data/tokenizers/llama3/tokenizer.json"
    elif tokenizer == "Llama2Tokenizer":
        hf_model = "dev/data/tokenizers/mistral/tokenizer.json"
        notes.append("Llama2Tokenizer (SentencePiece tokenizer.model) -> HuggingFaceTokenizer with Mistral's tokenizer.json")
    for flag, values in flags:
        if flag in REFUSED:
            notes.append(f"removed {' '.join([flag] + values)}: {refusal(train_gpt, flag, values)}")
            continue
        if flag == "--step-batch-size-schedule":
            values = SMALL_SCHEDULE
        elif flag in SMALL:
            values = [SMALL[flag]]
        elif flag in ("--save", "--load"):
            values = [os.path.join(run_dir, "ckpt")]
        elif flag == "--tensorboard-dir":
            values = [os.path.join(run_dir, "tensorboard")]
        elif flag == "--data-cache-path":
            values = [os.path.join(run_dir, "cache")]
        elif flag == "--vocab-file":
            values = ["dev/data/gpt2/gpt2-vocab.json"]
        elif flag == "--merge-file":
            values = ["dev/data/gpt2/gpt2-merges.txt"]
        elif flag == "--tokenizer-type" and tokenizer == "Llama2Tokenizer":
            values = ["HuggingFaceTokenizer"]
        elif flag == "--tokenizer-model":
            values = [hf_model]
        elif flag == "--data-path":
            kind = "gpt2" if tokenizer == "GPT2BPETokenizer" else os.path.basename(os.path.dirname(hf_model))
            values = ["DATA:" + kind]
        out.append([flag, values])
    return out, notes, run_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-gpt", default="./train_gpt")
    ap.add_argument("--work", default="/tmp/mt_megatron_scripts")
    ap.add_argument("--plan-only", action="store_true", help="train_gpt --plan (no GPU, no data read)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    a = ap.parse_args()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    train_gpt_dir = os.path.dirname(os.path.abspath(a.train_gpt))
    os.makedirs(a.work, exist_ok=True)
    failures = 0
    rows = []
    for name in SCRIPTS:
        flags = read_script(os.path.join("dev/data/megatron_scripts", name))
        flags, notes, run_dir = shrink(name, flags, a.work, a.train_gpt)
        args = []
        for flag, values in flags:
            args.append(flag)
            for v in values:
                if v.startswith("DATA:"):  # the dataset in the script's tokenization (not read by --plan)
                    kind = v[5:]
                    model = None if kind == "gpt2" else f"dev/data/tokenizers/{kind}/tokenizer.json"
                    v = "unused" if a.plan_only else prepare_data(train_gpt_dir, a.work, kind, model)
                args.append(v)
        cmd = [a.train_gpt] + args + (["--plan", "--world-size", "1"] if a.plan_only else [])
        log = os.path.join(run_dir, "train.log")
        print(f"==== {name}")
        for n in notes:
            print(f"  {n}")
        print("  " + " ".join(cmd))
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout)
            text, code = r.stdout, r.returncode
        except subprocess.TimeoutExpired as e:
            text, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        open(log, "w").write(text)
        lines = text.splitlines()
        pick = lambda key: next((l.strip() for l in reversed(lines) if key in l), "")
        info = next((l.strip() for l in lines if "no effect in this build" in l or "informational" in l.lower()), "")
        it = pick("elapsed time per iteration")
        val = pick("validation loss at iteration")
        print(f"  exit {code}")
        if info:
            print(f"  {info[:400]}")
        if a.plan_only:
            print("  " + "\n  ".join(lines[-3:]))
        else:
            print(f"  {it[:300]}")
            print(f"  {val[:200]}")
        ok = code == 0 and (a.plan_only or it)
        if not ok:
            failures += 1
            own = [l for l in lines if l.strip() and not l.startswith("-----") and "MPI" not in l
                   and not any(w in l for w in ("NOTE: invoking", "You may or may not", "exactly when", "with errorcode"))]
            print("  FAILED; the end of its log (mpirun's abort banner left out):\n    " + "\n    ".join(own[-8:]))
        rows.append((name, "ok" if ok else f"FAILED (exit {code})"))
    print("==== megatron scripts")
    for name, state in rows:
        print(f"  {name:34s} {state}")
    print(f"megatron scripts: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
