#!/usr/bin/env python3
"""
hellaswag_check.py: eval_hellaswag's per-item choices against transformers scoring the same items on the
same model, exported to Hugging Face format.

    make eval_hellaswag prepro/convert_hf dev/data/hellaswag_val_full.txt
    python3 dev/hellaswag_check.py --load CKPT_DIR [--num-examples 500] [--bf16] [--keep DIR]

Needs torch, numpy, transformers and safetensors, and a GPU for eval_hellaswag. A GPT-2 checkpoint (the
GPT-2 tokenizer of dev/data/gpt2 on both sides: the tokenizers library's BPE here, prepro/tokenizer.h there). It

  1. exports the checkpoint: `prepro/convert_hf --export CKPT_DIR --out DIR/hf`;
  2. runs `./eval_hellaswag --load CKPT_DIR --num-examples N --per-example DIR/c.tsv [--bf16]`;
  3. scores the first N items of dev/data/hellaswag_val_full.txt(.bz2) with GPT2LMHeadModel in float64,
     as lm-evaluation-harness does: context = the context line, continuation = " " + ending (a
     context's trailing spaces move to the continuation), the continuation's tokens are those of the
     whole text past the context's tokens, the input is (context + continuation)[-(max_len + 1):][:-1],
     an ending's log-likelihood is the sum of log_softmax over its tokens; acc = argmax of the sums,
     acc_norm = argmax of sum / len(ending) (characters);
  4. requires, for every item: the same continuation token counts; every ending's log-likelihood within
     the tolerance; the same acc and acc_norm choice. An item whose two candidate endings are closer
     (in the float64 scores) than twice the tolerance is a near tie: reported, not a failure.

Tolerances: fp32 logits agree with transformers' to ~1e-5 relative (dev/hf_check.py), i.e. ~1e-4 per
token's log-probability: 1e-3 + 1e-4 per token; bf16 (8-bit mantissa, ~4e-3 relative on logits of
magnitude ~10): 0.1 + 0.05 per token. Prints one line per failing item (at most 20), the two
accuracies, and exits non-zero on any failure.
"""
import argparse
import bz2
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_items(n):
    path = os.path.join(ROOT, "dev/data/hellaswag_val_full.txt")
    if os.path.isfile(path):
        lines = open(path, encoding="utf-8").read().split("\n")
    else:
        lines = bz2.open(path + ".bz2", "rt", encoding="utf-8").read().split("\n")
    items = []
    for k in range(0, len(lines) - 5, 6):
        if len(items) == n:
            break
        items.append((lines[k].rstrip("\r"), int(lines[k + 1]), [x.rstrip("\r") for x in lines[k + 2:k + 6]]))
    return items


class GPT2Tokens:
    """GPT-2's byte-level BPE from its two files, through the tokenizers library (on the GPU machine's transformers,
    GPT2TokenizerFast(vocab_file=, merges_file=) encoded every text to no ids)."""

    def __init__(self, vocab, merges):
        from tokenizers import Tokenizer, models, pre_tokenizers
        self.t = Tokenizer(models.BPE.from_file(vocab, merges))
        self.t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.eos_token_id = 50256  # <|endoftext|>
        if self.t.encode("Hello world").ids != [15496, 995]:
            sys.exit("hellaswag_check: the GPT-2 tokenizer did not load (Hello world -> "
                     f"{self.t.encode('Hello world').ids})")

    def encode(self, text):
        return self.t.encode(text).ids


def harness_scores(model, tok, items, max_len):
    """-> per item: (log-likelihoods [4], continuation token counts [4], chars [4]) as the harness computes them."""
    import torch
    out = []
    for context, _, endings in items:
        rows, spans = [], []
        for ending in endings:
            ctx, cont = context, " " + ending
            spaces = len(ctx) - len(ctx.rstrip(" "))
            if spaces:
                cont, ctx = ctx[-spaces:] + cont, ctx[:-spaces]
            whole = tok.encode(ctx + cont)
            ctx_enc = tok.encode(ctx)
            cont_enc = whole[len(ctx_enc):]
            full = (ctx_enc + cont_enc)[-(max_len + 1):]
            rows.append(full[:-1])
            spans.append((len(full) - 1 - len(cont_enc), cont_enc))
        width = max(len(r) for r in rows)
        batch = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows], device=model.device)
        with torch.no_grad():  # causal attention: the padding after a row does not reach its positions
            logp = torch.log_softmax(model(batch).logits.double(), dim=-1)
        ll = [float(sum(logp[r, start + j, t] for j, t in enumerate(cont))) for r, (start, cont) in enumerate(spans)]
        out.append((ll, [len(c) for _, c in spans], [len(e) for e in endings]))
    return out


def argmax(values):
    best = 0
    for k in range(1, len(values)):
        if values[k] > values[best]:
            best = k
    return best


def main():
    ap = argparse.ArgumentParser(description="eval_hellaswag against transformers on the exported model")
    ap.add_argument("--load", required=True, help="a megatron.c checkpoint directory (GPT-2, TP=1)")
    ap.add_argument("--num-examples", type=int, default=500)
    ap.add_argument("--bf16", action="store_true", help="run eval_hellaswag in bf16 (looser tolerance)")
    ap.add_argument("--eval", default=os.path.join(ROOT, "eval_hellaswag"))
    ap.add_argument("--convert", default=os.path.join(ROOT, "prepro/convert_hf"))
    ap.add_argument("--keep", help="keep the export and eval_hellaswag's per-item file here")
    args = ap.parse_args()
    if not 1 <= args.num_examples <= 10042:
        ap.error("--num-examples: 1 to 10042")

    import torch
    from transformers import GPT2LMHeadModel

    work = args.keep or tempfile.mkdtemp(prefix="hellaswag_check_")
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    shutil.rmtree(hf_dir, ignore_errors=True)
    subprocess.run([args.convert, "--export", args.load, "--out", hf_dir], check=True)
    tsv = os.path.join(work, "c.tsv")
    cmd = [args.eval, "--load", args.load, "--num-examples", str(args.num_examples), "--per-example", tsv]
    run = subprocess.run(cmd + (["--bf16"] if args.bf16 else []), cwd=ROOT, check=True, capture_output=True, text=True)
    print(run.stdout.strip().splitlines()[-1])
    rows = [line.split("\t") for line in open(tsv).read().strip().split("\n")[1:]]
    c_items = [dict(label=int(r[1]), pred=int(r[2]), pred_norm=int(r[3]), ll=[float(x) for x in r[4:8]],
                    tokens=[int(x) for x in r[8:12]], chars=[int(x) for x in r[12:16]]) for r in rows]

    model = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float64).eval()
    if torch.cuda.is_available():
        model = model.to("cuda")
    tok = GPT2Tokens(os.path.join(ROOT, "dev/data/gpt2/gpt2-vocab.json"), os.path.join(ROOT, "dev/data/gpt2/gpt2-merges.txt"))
    items = read_items(args.num_examples)
    if len(items) != len(c_items):
        sys.exit(f"hellaswag_check: eval_hellaswag scored {len(c_items)} items, expected {len(items)}")
    ref = harness_scores(model, tok, items, model.config.n_positions)

    failures, ties, acc, acc_norm = [], 0, [0, 0], [0, 0]
    for i, ((ll, ntok, chars), c) in enumerate(zip(ref, c_items)):
        label = items[i][1]
        tol = [(0.1 + 0.05 * n) if args.bf16 else (1e-3 + 1e-4 * n) for n in ntok]
        pred, pred_norm = argmax(ll), argmax([v / n for v, n in zip(ll, chars)])
        acc[0] += c["pred"] == label
        acc[1] += pred == label
        acc_norm[0] += c["pred_norm"] == label
        acc_norm[1] += pred_norm == label
        bad = []
        if c["label"] != label or c["tokens"] != ntok or c["chars"] != chars:
            bad.append(f"label/tokens/chars {c['label']}/{c['tokens']}/{c['chars']} vs {label}/{ntok}/{chars}")
        far = [e for e in range(4) if abs(c["ll"][e] - ll[e]) > tol[e]]
        if far:
            bad.append("log-likelihoods " + ", ".join(f"{e}: {c['ll'][e]:.6f} vs {ll[e]:.6f}" for e in far))
        for name, mine, theirs, score in (("acc", c["pred"], pred, ll),
                                          ("acc_norm", c["pred_norm"], pred_norm, [v / n for v, n in zip(ll, chars)])):
            if mine != theirs:
                bound = 2 * max(tol[mine], tol[theirs]) / (1 if name == "acc" else min(chars[mine], chars[theirs]))
                if abs(score[mine] - score[theirs]) <= bound:
                    ties += 1
                else:
                    bad.append(f"{name} choice {mine} vs {theirs}")
        if bad:
            failures.append(f"item {i}: " + "; ".join(bad))
    for line in failures[:20]:
        print("FAIL  " + line)
    n = len(items)
    print(f"hellaswag_check: {n} items | eval_hellaswag acc {acc[0] / n:.4f} acc_norm {acc_norm[0] / n:.4f} | "
          f"transformers acc {acc[1] / n:.4f} acc_norm {acc_norm[1] / n:.4f} | {ties} near ties | "
          f"{len(failures)} items failed")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
