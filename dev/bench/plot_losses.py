#!/usr/bin/env python3
"""
plot_losses.py: train and validation loss curves of one or more train_gpt logs, overlaid.

    python3 dev/bench/plot_losses.py LOG [LOG ...] [--labels L1 L2 ...] --out losses.png [--title T]

Reads train_gpt's log lines (Megatron's format):
  " [date time] iteration   N/   M | ... | lm loss: X | ... |"   -> train loss (mean over the log interval)
  " validation loss at iteration N | lm loss value: X | ..."     -> validation loss
Each log gets one colour: its train loss as a light line, its validation losses as markers on a line.
With two logs or more, a second panel shows each log's validation loss relative to the first log's
at the same evaluation (in %, with the +-1% band), the first log being the baseline (bf16).
Non-finite losses (nan, inf) are left out of the curves and counted in a printed line.
Needs only matplotlib (Agg backend); without it, one line is printed and the exit status is 0.
"""
import argparse
import math
import os
import re
import sys

ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
TRAIN_LOSS_RE = re.compile(r"\|\s*lm loss:\s*([^\s|]+)")
VAL_RE = re.compile(r"^\s*validation loss at iteration\s+(\d+)\s*\|\s*lm loss value:\s*([^\s|]+)")


def to_float(s):
    try:
        return float(s)
    except ValueError:
        return float("nan")


def parse_log(path):
    """-> (train [(iteration, loss)], val [(iteration, loss)]), in the log's order."""
    train, val = [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = VAL_RE.match(line)
            if m:
                val.append((int(m.group(1)), to_float(m.group(2))))
                continue
            m = ITER_RE.search(line)
            if m:
                loss = TRAIN_LOSS_RE.search(line)
                if loss:
                    train.append((int(m.group(1)), to_float(loss.group(1))))
    return train, val


def finite(points):
    return [(i, v) for i, v in points if math.isfinite(v)]


def main():
    ap = argparse.ArgumentParser(description="overlay train_gpt loss curves")
    ap.add_argument("logs", nargs="+", help="train_gpt logs")
    ap.add_argument("--labels", nargs="+", help="one label per log (default: the file names)")
    ap.add_argument("--out", required=True, help="output image (.png)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args()
    labels = args.labels or [os.path.splitext(os.path.basename(p))[0] for p in args.logs]
    if len(labels) != len(args.logs):
        sys.exit(f"plot_losses: {len(args.logs)} logs but {len(labels)} labels")

    runs = []
    for path, label in zip(args.logs, labels):
        if not os.path.isfile(path):
            sys.exit(f"plot_losses: no such file: {path}")
        train, val = parse_log(path)
        bad = len(train) - len(finite(train)) + len(val) - len(finite(val))
        if bad:
            print(f"plot_losses: {label}: {bad} non-finite loss value(s) left out of the plot")
        if not train and not val:
            print(f"plot_losses: {label}: no iteration or validation lines in {path}; left out")
            continue
        runs.append((f"{label} ({bad} non-finite)" if bad else label, finite(train), finite(val)))
    if not runs:
        sys.exit("plot_losses: none of the logs has loss lines")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken installation
        print(f"plot_losses: matplotlib is not usable ({type(e).__name__}: {e}); no plot written")
        return 0

    base_val = dict(runs[0][2])  # the first log's validation losses by iteration (the last one wins)
    compare = len(runs) > 1 and bool(base_val)
    if compare:
        fig, (ax, axr) = plt.subplots(2, 1, figsize=(10, 8.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    else:
        fig, ax = plt.subplots(figsize=(10, 6))
        axr = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # y range: the curves after the first tenth of training (the first steps' ~11 would flatten the rest)
    tail = []
    for _, train, val in runs:
        last = max([i for i, _ in train + val] or [1])
        tail += [v for i, v in train + val if i >= 0.1 * last]
    for k, (label, train, val) in enumerate(runs):
        c = colors[k % len(colors)]
        if train:
            ax.plot([i for i, _ in train], [v for _, v in train], color=c, alpha=0.45, linewidth=1.0,
                    label=f"{label} train")
        if val:
            ax.plot([i for i, _ in val], [v for _, v in val], color=c, marker="o", markersize=4, linewidth=1.2,
                    label=f"{label} validation")
        if axr is not None and k > 0 and val:
            rel = [(i, 100.0 * (v / base_val[i] - 1.0)) for i, v in dict(val).items()
                   if i in base_val and base_val[i] > 0]
            if rel:
                axr.plot([i for i, _ in rel], [r for _, r in rel], color=c, marker="o", markersize=4,
                         linewidth=1.2, label=f"{label} / {runs[0][0]}")
    if tail:
        lo, hi = min(tail), max(tail)
        pad = 0.05 * (hi - lo) if hi > lo else 0.1
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel("lm loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(runs) > 2 else 1)
    if args.title:
        ax.set_title(args.title)
    if axr is not None:
        axr.axhspan(-1.0, 1.0, color="green", alpha=0.08, label="within 1%")
        axr.axhline(0.0, color=colors[0], linewidth=1.0)
        axr.set_ylabel(f"val loss vs {runs[0][0]} (%)")
        axr.set_xlabel("iteration")
        axr.grid(True, alpha=0.3)
        axr.legend(fontsize=8)
    else:
        ax.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot_losses: wrote {args.out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
