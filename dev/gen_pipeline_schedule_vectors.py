#!/usr/bin/env python3
"""Reference order of Megatron's 1F1B pipeline schedules, for tests/test_pipeline_schedule.h.

Written from the description of megatron/core/pipeline_parallel/schedules.py (the forward/backward
loops of forward_backward_pipelining_without_interleaving and ..._with_interleaving), not from its
code, and independently of megatron.h: it walks the three phases as Megatron's loops do (warm-up,
steady 1F1B, cool-down), picking the micro-batch and model chunk of the k-th forward and backward from
the micro-batch-group table.

Writes dev/data/pipeline_vectors/schedules.txt, one line per (PP, VP, M, group size, rank):
    pp vp m g rank warmup op op ...     op = F<micro-batch>.<chunk> or B<micro-batch>.<chunk>
g = 0 means the default group size (PP).

    python3 dev/gen_pipeline_schedule_vectors.py
"""
import os

SETTINGS = [  # (PP, VP, M, group size; 0 = default PP)
    (1, 1, 1, 0), (1, 1, 5, 0), (2, 1, 1, 0), (2, 1, 4, 0), (4, 1, 2, 0), (4, 1, 8, 0), (8, 1, 5, 0),
    (2, 2, 4, 0), (2, 2, 6, 0), (2, 3, 5, 3), (4, 2, 8, 0), (4, 2, 12, 0), (4, 2, 12, 8), (4, 3, 16, 6),
    (3, 4, 9, 0), (4, 4, 4, 0), (8, 2, 16, 0), (8, 3, 24, 8), (2, 4, 7, 5), (4, 2, 10, 6),
]


def table(m, vp, g):
    """(micro-batch, chunk) of the k-th forward: micro-batch groups of g, each walked over all chunks."""
    out = []
    start = 0
    while start < m:
        stop = m if start + g >= m else start + g
        out += [(mb, c) for c in range(vp) for mb in range(start, stop)]
        start = stop
    return out


def warmup_count(pp, vp, m, g, rank):
    if vp == 1:
        return min(pp - rank - 1, m)
    return min((pp - rank - 1) * 2 + (vp - 1) * g, m * vp)


def schedule(pp, vp, m, g, rank):
    g = g if (g > 0 and vp > 1) else (pp if vp > 1 else 1)
    total = m * vp
    tab = table(m, vp, g)

    def fwd(k):
        mb, c = tab[k]
        return "F%d.%d" % (mb, c)

    def bwd(k):
        mb, c = tab[k]
        return "B%d.%d" % (mb, vp - 1 - c)

    w = warmup_count(pp, vp, m, g, rank)
    ops = [fwd(k) for k in range(w)]            # warm-up: forwards only
    for i in range(total - w):                  # steady state: one forward, then one backward
        ops += [fwd(w + i), bwd(i)]
    ops += [bwd(k) for k in range(total - w, total)]  # cool-down: the backwards left
    return w, ops


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "data", "pipeline_vectors", "schedules.txt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for pp, vp, m, g in SETTINGS:
            for rank in range(pp):
                w, ops = schedule(pp, vp, m, g, rank)
                f.write("%d %d %d %d %d %d %s\n" % (pp, vp, m, g, rank, w, " ".join(ops)))
    print("wrote", path)


if __name__ == "__main__":
    main()
