#!/usr/bin/env python3
"""dev/bench/plot_results.py — the README's two pictures, drawn from the measured result tables in
dev/bench/results (matplotlib, no server):

  gutenberg_124m_h100.md  ->  gutenberg_124m_h100.png   train_gpt's loss curve beside PyTorch's on the
                                                         Gutenberg books (train: 50-iteration means;
                                                         validation: the periodic evaluations)
  speed_vs_torch_h100.md  ->  speed_vs_torch_h100.png   tokens/s per GPU, train_gpt against
                                                         torch.compile, per model (the file's first,
                                                         current table)

Each picture's title names the commit its table says it measured. Usage (repository root):
  python3 dev/bench/plot_results.py [--results dev/bench/results]
"""
import argparse
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def commit_of(text):
    """The commit the file's opening line says the results were measured at."""
    m = re.search(r"[Aa]s of commit ([0-9a-f]{7,40})", text)
    return m.group(1) if m else "unknown commit"


def table_rows(lines, start=0):
    """The rows of the first markdown table at or after line `start`: lists of cell strings."""
    rows, inside = [], False
    for line in lines[start:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if all(re.fullmatch(r":?-+:?", c) for c in cells):
                inside = True
                continue
            if inside:
                rows.append(cells)
        elif inside:
            break
    return rows


def number(cell):
    cell = cell.replace(",", "").replace("*", "").rstrip("x").strip()
    try:
        return float(cell)
    except ValueError:
        return None


def plot_gutenberg(path, out):
    text = open(path).read()
    rows = table_rows(text.splitlines())
    it, ours, torch, vit, vours, vtorch = [], [], [], [], [], []
    for r in rows:
        i = number(r[0])
        if i is None:
            continue
        if number(r[1]) is not None and number(r[2]) is not None:
            it.append(i), ours.append(number(r[1])), torch.append(number(r[2]))
        if len(r) > 5 and number(r[4]) is not None and number(r[5]) is not None:
            vit.append(i), vours.append(number(r[4])), vtorch.append(number(r[5]))
    if not it:
        sys.exit(f"{path}: no loss table found")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(it, ours, color="tab:green", label="train_gpt, train (50-iteration mean)")
    ax.plot(it, torch, color="tab:blue", linestyle="--", label="PyTorch, train (50-iteration mean)")
    if vit:
        ax.plot(vit, vours, "o", color="tab:green", label="train_gpt, validation")
        ax.plot(vit, vtorch, "x", color="tab:blue", markersize=8, label="PyTorch, validation")
    ax.set_xlabel("iteration (16 x 1024 tokens)")
    ax.set_ylabel("loss")
    ax.set_ylim(min(min(ours), min(torch), *(vours or [9])) - 0.2, 8.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"GPT-2 124M on the Gutenberg books, bf16, same weights and data (H100, commit {commit_of(text)})",
                 fontsize=8.5)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}: {len(it)} train points, {len(vit)} validation points")


def plot_speed(path, out):
    text = open(path).read()
    lines = text.splitlines()
    rows = table_rows(lines)
    section = next((l for l in lines if l.startswith("## ")), "")
    m = re.search(r"Commit ([0-9a-f]{7,40})", section)
    commit = m.group(1) if m else commit_of(text)
    models, ours, torch = [], [], []
    for r in rows:
        model, side, tokens = r[0], r[2], number(r[4])
        if tokens is None:
            continue
        if model not in models:
            models.append(model), ours.append(None), torch.append(None)
        k = models.index(model)
        if side.startswith("megatron.c"):
            ours[k] = tokens
        elif side.startswith("torch"):
            torch[k] = tokens
    if not models or None in ours or None in torch:
        sys.exit(f"{path}: the first table lacks a side for some model")
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.6), dpi=110)
    axes = axes if len(models) > 1 else [axes]
    for ax, model, o, t in zip(axes, models, ours, torch):
        ax.bar([0, 1], [o, t], color=["tab:green", "tab:blue"])
        ax.set_xticks([0, 1], ["train_gpt", "torch.compile"])
        ax.set_title(f"GPT-2 {model}: {o / t:.2f}x", fontsize=9)
        ax.set_ylabel("tokens/s per GPU")
        for x, v in zip([0, 1], [o, t]):
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(o, t) * 1.15)
    fig.suptitle(f"One H100, bf16, seq 1024 (commit {commit})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}: " + ", ".join(f"{m} {o / t:.2f}x" for m, o, t in zip(models, ours, torch)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="dev/bench/results")
    a = ap.parse_args()
    r = a.results
    plot_gutenberg(os.path.join(r, "gutenberg_124m_h100.md"), os.path.join(r, "gutenberg_124m_h100.png"))
    plot_speed(os.path.join(r, "speed_vs_torch_h100.md"), os.path.join(r, "speed_vs_torch_h100.png"))


if __name__ == "__main__":
    main()
