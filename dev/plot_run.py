#!/usr/bin/env python3
"""
plot_run.py: pictures of one or more runs, overlaid: loss, learning rate and throughput PNGs from
train_gpt logs (or dev/bench/ref_train_gpt2.py's, same format) or TensorBoard event directories.

    python3 dev/plot_run.py RUN [RUN ...] [--label L1 L2 ...] [--out-dir DIR] [--prefix P]
                            [--only loss,lr,throughput] [--title T]

RUN: a log file, or a --tensorboard-dir (or one event file in it). Labels default to the file or
directory names. Writes DIR/Ploss.png, DIR/Plr.png, DIR/Pthroughput.png (DIR: ., P: empty):
  loss        each run's train loss (a light line) and validation losses (markers on a line); with two
              runs or more, a lower panel: each run's validation loss relative to the first run's at
              the same iteration (%, with the +-1% band), the first run being the baseline
  lr          the learning rate by iteration
  throughput  TFLOP/s per GPU by iteration and, where a log says its sequence length (train_gpt's
              "model: ... seq N" line) or prints tokens per second (ref_train_gpt2.py), tokens/s
What a log gives:   " [..] iteration N/M | consumed samples: C | elapsed time per iteration (ms): T |
  throughput per GPU (TFLOP/s/GPU): F | learning rate: R | global batch size: G | lm loss: L | ..."
  and " validation loss at iteration N [on validation set] | lm loss value: V | ...".
What an event directory gives (TensorBoard's reader, pip install tensorboard): lm loss, lm loss
  validation, learning-rate, throughput (with --log-timers-to-tensorboard).
Non-finite values are left out of the curves and counted in a printed line. Needs matplotlib (Agg);
without it one line is printed and the exit status is 0, so a script's other results stand.
"""
import argparse
import math
import os
import re
import sys

ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
FIELD_RE = re.compile(r"\|\s*([a-zA-Z /()%-]+?):\s*([^|]+?)\s*(?=\|)")
VAL_RE = re.compile(r"^\s*validation loss at iteration\s+(\d+)(?: on validation set)?\s*\|\s*lm loss value:\s*([^\s|]+)")
SEQ_RE = re.compile(r"^model:.*\bseq (\d+),")


def to_float(s):
    try:
        return float(s)
    except ValueError:
        return float("nan")


def empty_run():
    return dict(train=[], val=[], lr=[], tflops=[], tokens=[])


def parse_log(path):
    """A train_gpt log -> {train, val, lr, tflops, tokens: [(iteration, value)]}, in the log's order."""
    run, seq = empty_run(), None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = SEQ_RE.match(line)
            if m:
                seq = int(m.group(1))
                continue
            m = VAL_RE.match(line)
            if m:
                run["val"].append((int(m.group(1)), to_float(m.group(2))))
                continue
            m = ITER_RE.search(line)
            if not m:
                continue
            it = int(m.group(1))
            fields = dict((k.strip(), v.strip()) for k, v in FIELD_RE.findall(line[m.end() - 1:] + "|"))
            if "lm loss" in fields:
                run["train"].append((it, to_float(fields["lm loss"])))
            if "learning rate" in fields:
                run["lr"].append((it, to_float(fields["learning rate"])))
            if "throughput per GPU (TFLOP/s/GPU)" in fields:
                run["tflops"].append((it, to_float(fields["throughput per GPU (TFLOP/s/GPU)"])))
            if "tokens per second" in fields:
                run["tokens"].append((it, to_float(fields["tokens per second"])))
            elif seq and "global batch size" in fields and "elapsed time per iteration (ms)" in fields:
                ms = to_float(fields["elapsed time per iteration (ms)"])
                if ms > 0:
                    run["tokens"].append((it, to_float(fields["global batch size"]) * seq / (ms / 1000.0)))
    return run


def parse_events(path):
    """A TensorBoard directory (or event file) -> the same dict, from its scalars."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        sys.exit(f"plot_run: {path} is an event directory: reading it needs the tensorboard package "
                 "(pip install tensorboard)")
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    run = empty_run()
    for key, tag in (("train", "lm loss"), ("val", "lm loss validation"), ("lr", "learning-rate"),
                     ("tflops", "throughput")):
        if tag in tags:
            run[key] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return run


def is_events(path):
    return os.path.isdir(path) or "tfevents" in os.path.basename(path)


def finite(points):
    return [(i, v) for i, v in points if math.isfinite(v)]


def plot_loss(plt, runs, path, title):
    base_val = dict(runs[0][1]["val"])  # the first run's validation losses by iteration (the last one wins)
    compare = len(runs) > 1 and bool(base_val)
    if compare:
        fig, (ax, axr) = plt.subplots(2, 1, figsize=(10, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    else:
        fig, ax = plt.subplots(figsize=(10, 6))
        axr = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # y range: the curves after the first tenth of training (the first steps' ~11 would flatten the rest)
    tail = []
    for _, run in runs:
        last = max([i for i, _ in run["train"] + run["val"]] or [1])
        tail += [v for i, v in run["train"] + run["val"] if i >= 0.1 * last]
    for k, (label, run) in enumerate(runs):
        c = colors[k % len(colors)]
        if run["train"]:
            ax.plot(*zip(*run["train"]), color=c, alpha=0.45, linewidth=1.0, label=f"{label} train")
        if run["val"]:
            ax.plot(*zip(*run["val"]), color=c, marker="o", markersize=4, linewidth=1.2, label=f"{label} validation")
        if axr is not None and k > 0 and run["val"]:
            rel = [(i, 100.0 * (v / base_val[i] - 1.0)) for i, v in dict(run["val"]).items()
                   if i in base_val and base_val[i] > 0]
            if rel:
                axr.plot(*zip(*rel), color=c, marker="o", markersize=4, linewidth=1.2, label=f"{label} / {runs[0][0]}")
    if tail:
        lo, hi = min(tail), max(tail)
        pad = 0.05 * (hi - lo) if hi > lo else 0.1
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel("lm loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(runs) > 2 else 1)
    if title:
        ax.set_title(title)
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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_series(plt, runs, panels, path, title):
    """panels: [(key, y label, log scale)], one panel each, runs overlaid; panels no run has are left out."""
    panels = [p for p in panels if any(run[p[0]] for _, run in runs)]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 4.2 * len(panels)), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, ylabel, log) in zip(axes[:, 0], panels):
        for k, (label, run) in enumerate(runs):
            if run[key]:
                ax.plot(*zip(*run[key]), color=colors[k % len(colors)], marker=".", markersize=3, linewidth=1.0,
                        label=label)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("iteration")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description="loss / learning-rate / throughput pictures of train_gpt runs")
    ap.add_argument("runs", nargs="+", help="train_gpt logs or TensorBoard directories")
    ap.add_argument("--label", "--labels", dest="labels", nargs="+", help="one label per run (default: file names)")
    ap.add_argument("--out-dir", default=".", help="where the PNGs go (default: .)")
    ap.add_argument("--prefix", default="", help="file name prefix (PREFIXloss.png, ...)")
    ap.add_argument("--only", default="loss,lr,throughput", help="comma-separated: loss, lr, throughput")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args()
    labels = args.labels or [os.path.splitext(os.path.basename(os.path.normpath(p)))[0] for p in args.runs]
    if len(labels) != len(args.runs):
        sys.exit(f"plot_run: {len(args.runs)} runs but {len(labels)} labels")
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in ("loss", "lr", "throughput")]
    if unknown:
        sys.exit(f"plot_run: --only {','.join(unknown)}: expected loss, lr or throughput")

    runs = []
    for path, label in zip(args.runs, labels):
        if not os.path.exists(path):
            sys.exit(f"plot_run: no such file or directory: {path}")
        run = parse_events(path) if is_events(path) else parse_log(path)
        bad = sum(len(v) - len(finite(v)) for v in run.values())
        run = {k: finite(v) for k, v in run.items()}
        if bad:
            print(f"plot_run: {label}: {bad} non-finite value(s) left out of the plots")
        if not any(run.values()):
            print(f"plot_run: {label}: nothing to plot in {path}; left out")
            continue
        runs.append((f"{label} ({bad} non-finite)" if bad else label, run))
    if not runs:
        sys.exit("plot_run: none of the runs has anything to plot")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken installation
        print(f"plot_run: matplotlib is not usable ({type(e).__name__}: {e}); no plot written")
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    out = lambda name: os.path.join(args.out_dir, f"{args.prefix}{name}.png")  # noqa: E731
    if "loss" in wanted and any(run["train"] or run["val"] for _, run in runs):
        plot_loss(plt, runs, out("loss"), args.title)
        written.append(out("loss"))
    if "lr" in wanted and plot_series(plt, runs, [("lr", "learning rate", False)], out("lr"), args.title):
        written.append(out("lr"))
    if "throughput" in wanted and plot_series(plt, runs, [("tflops", "TFLOP/s per GPU", False),
                                                          ("tokens", "tokens/s", False)], out("throughput"), args.title):
        written.append(out("throughput"))
    print(f"plot_run: wrote {', '.join(written) if written else 'nothing'} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
