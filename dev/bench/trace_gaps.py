#!/usr/bin/env python3
"""Where a GPU's idle time goes, from a CUPTI trace written by dev/cuda/libkernel_trace.so (our stand-in for
an Nsight Systems timeline). Standard library only.

  python3 dev/bench/trace_gaps.py trace.csv [--from-ms A] [--to-ms B] [--steps N] [--device D]
  python3 dev/bench/trace_gaps.py trace.csv --step-kernel embedding_forward --skip 10   (whole steps only)
  python3 dev/bench/trace_gaps.py --self-test

GPU activities (kernels, memcpys, memsets of one device) sorted by start; busy = the union of their intervals;
every gap between the end of all work so far and the next start is idle time, split by cause:
  host-late       the API call that launched the next activity (the runtime/driver record with its correlation
                  id) returned after the GPU had run dry: the GPU waited for the host. Split further into the
                  part overlapping a blocking host call (sync records, synchronous memcpys, *Synchronize calls),
                  the part after such a call returned inside the gap (the host's work between a sync and the
                  next launch), and the rest (the host launches slower than the GPU runs).
  launch latency  the launch was queued before the GPU ran dry: the gap is the GPU's own kernel-to-kernel cost.
  unknown         no launch record for the correlation id (e.g. dropped by MT_TRACE_START_MS).
Windows are in ms from the first GPU activity of the device. --step-kernel picks the window as whole steps:
from the start of occurrence skip+1 of a kernel launched once per step to the start of its last occurrence,
and sets --steps to the number of steps in between. With --steps, totals are per step.
"""
import argparse, bisect, collections, csv, re, sys

GPU_KINDS = ("kernel", "memcpy", "memset")
API_KINDS = ("runtime", "driver")
# API calls that block the host until the GPU is done (names as kernel_trace.cpp writes them, "_vN" removed)
BLOCKING = re.compile(r"^cu(da)?(Device|Ctx|Stream|Event)Synchronize|^cudaMemcpy(2D|3D)?(_ptds)?$|"
                      r"^cuMemcpy(DtoH|HtoD|DtoD)?(_ptds)?$|^cudaMemset(_ptds)?$")
HIST = [1, 2, 5, 10, 20, 50, 100, 1000, float("inf")]  # gap histogram bin edges, microseconds


class Rec:
    __slots__ = ("kind", "name", "start", "end", "corr", "stream", "dev")

    def __init__(self, kind, name, start, end, corr=None, stream=None, dev=None):
        self.kind, self.name, self.start, self.end = kind, name, start, end
        self.corr, self.stream, self.dev = corr, stream, dev


def load(path):
    def num(s):
        return int(s) if s not in (None, "") else None
    recs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(l for l in f if not l.startswith("#")):
            try:
                recs.append(Rec(row["kind"], row["name"], int(row["start_ns"]), int(row["end_ns"]),
                                num(row.get("correlation_id")), num(row.get("stream_id")), num(row.get("device_id"))))
            except (KeyError, ValueError, TypeError):
                continue  # a torn or foreign line: skip it rather than abort the analysis
    return recs


def short(name, width=60):
    """A kernel's name without its parameter list and return type, cut to width."""
    n = re.sub(r"^void ", "", name)
    depth = 0
    for i, c in enumerate(n):  # cut at the first '(' outside template brackets
        depth += (c == "<") - (c == ">")
        if c == "(" and depth <= 0:
            n = n[:i]
            break
    return n if len(n) <= width else n[:width - 1] + "~"


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(iv, starts, a, b):
    """Time of [a, b] covered by the sorted disjoint intervals iv (starts: their starts)."""
    t, i = 0, max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(iv) and iv[i][0] < b:
        t += max(0, min(b, iv[i][1]) - max(a, iv[i][0]))
        i += 1
    return t


def analyse(recs, from_ms=None, to_ms=None, device=None, step_kernel=None, skip=0, steps=None):
    gpu_all = [r for r in recs if r.kind in GPU_KINDS and r.end >= r.start]
    if device is None:  # the device with the most activities
        counts = collections.Counter(r.dev for r in gpu_all)
        device = counts.most_common(1)[0][0] if counts else None
    gpu = sorted((r for r in gpu_all if r.dev == device), key=lambda r: (r.start, r.end))
    if not gpu:
        raise SystemExit("trace_gaps: no GPU activity in the trace")
    t0 = gpu[0].start
    lo = t0 + from_ms * 1e6 if from_ms is not None else float("-inf")
    hi = t0 + to_ms * 1e6 if to_ms is not None else float("inf")
    if step_kernel:
        marks = [r.start for r in gpu if r.kind == "kernel" and step_kernel in r.name]
        if len(marks) < skip + 2:
            raise SystemExit(f"trace_gaps: {len(marks)} launches of '{step_kernel}', need --skip + 2 = {skip + 2}")
        lo, hi, steps = marks[skip], marks[-1], len(marks) - 1 - skip
    gpu = [r for r in gpu if lo <= r.start < hi]
    if not gpu:
        raise SystemExit("trace_gaps: no GPU activity in the window")
    apis = [r for r in recs if r.kind in API_KINDS]
    launch_end = {}  # correlation id -> when the launching call returned (runtime and driver: the later)
    for r in apis:
        if r.corr is not None:
            launch_end[r.corr] = max(launch_end.get(r.corr, r.end), r.end)
    blocking = union((r.start, r.end) for r in recs
                     if (r.kind == "sync" and r.name != "stream_wait_event") or (r.kind in API_KINDS and BLOCKING.match(r.name)))
    bstarts = [s for s, _ in blocking]
    bends = [e for _, e in blocking]

    res = dict(device=device, n=len(gpu), steps=steps, span=0, busy=0, causes=collections.Counter(),
               hist=[[0, 0] for _ in HIST], gaps=[], kernels={}, api={})
    end, prev, busy_since = gpu[0].start, None, gpu[0].start
    for r in gpu:
        k = res["kernels"].setdefault(short(r.name), [0, 0, 0])  # calls, time, idle just before
        k[0] += 1
        k[1] += r.end - r.start
        gap = r.start - end
        if prev is not None and gap > 0:
            res["busy"] += end - busy_since
            busy_since = r.start
            k[2] += gap
            le = launch_end.get(r.corr) if r.corr is not None else None
            if le is None:
                cause = "unknown"
            elif le > end:
                cause = "host-late"
                ov = overlap(blocking, bstarts, end, r.start)
                i = bisect.bisect_right(bends, r.start) - 1  # the last blocking call that returned in the gap
                after = 0
                if i >= 0 and bends[i] > end:
                    after = r.start - bends[i] - overlap(blocking, bstarts, bends[i], r.start)
                res["causes"]["host-late: during a blocking call"] += ov
                res["causes"]["host-late: after a blocking call"] += after
                res["causes"]["host-late: launching"] += gap - ov - after
                if ov + after:
                    cause = "host-late, sync"
            else:
                cause = "launch latency"
            res["causes"][cause.split(",")[0]] += gap
            b = bisect.bisect_right(HIST, gap / 1e3)
            res["hist"][b][0] += 1
            res["hist"][b][1] += gap
            res["gaps"].append((gap, prev.name, r.name, cause, r.start - t0))
        if prev is None or r.end > end:
            end, prev = r.end, r
    res["busy"] += end - busy_since
    res["span"] = end - gpu[0].start
    res["gaps"].sort(key=lambda g: -g[0])
    wlo, whi = gpu[0].start, end
    for r in apis:  # host time in API calls that start in the window
        if wlo <= r.start < whi:
            a = res["api"].setdefault(r.name, [0, 0])
            a[0] += 1
            a[1] += r.end - r.start
    return res


def report(res, out=sys.stdout):
    div = res["steps"] or 1
    per = f" per step ({res['steps']} steps)" if res["steps"] else ""
    ms = lambda ns: ns / div / 1e6
    idle = res["span"] - res["busy"]
    p = lambda *a: print(*a, file=out)
    n = f"{res['n']} GPU activities" + (f" ({res['n'] / div:.0f} per step)" if res["steps"] else "")
    p(f"device {res['device']}, {n}; times in ms{per}")
    p(f"span {ms(res['span']):.3f}  busy {ms(res['busy']):.3f}  idle {ms(idle):.3f} ({100 * idle / max(res['span'], 1):.1f}%)")
    for c in ("host-late", "host-late: during a blocking call", "host-late: after a blocking call",
              "host-late: launching", "launch latency", "unknown"):
        t = res["causes"].get(c, 0)
        p(f"  {c:36s} {ms(t):9.3f}  {100 * t / max(idle, 1):5.1f}% of idle")
    p("gaps (us): " + "  ".join(f"<{h:g}: {n} ({ms(t):.3f})" for h, (n, t) in zip(HIST, res["hist"]) if n))
    p("largest gaps (us, at ms from the first GPU activity):")
    for gap, a, b, cause, at in res["gaps"][:20]:
        p(f"  {gap / 1e3:8.1f} @{at / 1e6:9.3f} {cause:15s} {short(a, 34):34s} -> {short(b, 34)}")
    p(f"{'kernel (top 25 by time)':56s} {'calls':>6s} {'total':>8s} {'mean us':>8s} {'idle before':>11s}")
    for name, (n, t, i) in sorted(res["kernels"].items(), key=lambda kv: -kv[1][1])[:25]:
        p(f"{short(name, 56):56s} {n / div:6.0f} {ms(t):8.3f} {t / n / 1e3:8.1f} {ms(i):11.3f}")
    p(f"{'host API call (top 15 by time)':56s} {'calls':>6s} {'total':>8s} {'mean us':>8s}")
    for name, (n, t) in sorted(res["api"].items(), key=lambda kv: -kv[1][1])[:15]:
        p(f"{short(name, 56):56s} {n / div:6.0f} {ms(t):8.3f} {t / n / 1e3:8.1f}")


def self_test():
    """A synthetic trace with known gaps (microseconds, written in ns) and the figures it must give."""
    u = 1000
    K = lambda name, s, e, corr, dev=0: Rec("kernel", name, s * u, e * u, corr, 7, dev)
    A = lambda corr, s, e, kind="runtime", name="cudaLaunchKernel": Rec(kind, name, s * u, e * u, corr)
    recs = [
        K("void a(float*)", 0, 10, 1), A(1, -5, -4),
        K("b", 12, 20, 2), A(2, 3, 5),                           # launched in time: 2 us launch latency
        K("b2", 14, 18, 3), A(3, 6, 7),                          # concurrent with b: no gap
        K("c", 30, 40, 4), A(4, 20, 29, "driver", "cuLaunchKernelEx"),  # late launch, no sync: 10 us launching
        Rec("sync", "stream_sync", 35 * u, 42 * u, 9),           # host blocked until 42
        K("d", 50, 60, 5), A(5, 45, 49),                         # gap 40-50: 2 during the sync, 8 after it
        K("e", 61, 70, 6),                                       # no launch record: 1 us unknown
        K("other_device", 100, 200, 10, dev=1),                  # ignored: another device
        K("no_corr", 70, 75, None), A(None, 1, 2),               # missing correlation ids: no gap, no crash
        Rec("runtime", "cudaMemcpy", 80 * u, 90 * u, 11),        # host-only, outside any gap
    ]
    r = analyse(recs)
    assert r["device"] == 0 and r["n"] == 7, r
    assert (r["span"], r["busy"]) == (75 * u, 52 * u), (r["span"], r["busy"])
    c = r["causes"]
    assert c["launch latency"] == 2 * u and c["unknown"] == 1 * u and c["host-late"] == 20 * u, c
    assert c["host-late: during a blocking call"] == 2 * u and c["host-late: after a blocking call"] == 8 * u, c
    assert c["host-late: launching"] == 10 * u, c
    assert [g[0] for g in r["gaps"]] == [10 * u, 10 * u, 2 * u, 1 * u], r["gaps"]
    assert r["kernels"]["d"] == [1, 10 * u, 10 * u] and r["kernels"]["a"][0] == 1, r["kernels"]
    w = analyse(recs, from_ms=0.011, to_ms=0.065)  # b, b2, c, d, e: gaps 10+10+1
    assert w["n"] == 5 and w["span"] == 58 * u and w["busy"] - w["span"] == -21 * u, w
    s = analyse(recs, step_kernel="b", skip=0)  # from b (12) to b2 (14), the last "b..." launch: one step
    assert s["steps"] == 1 and s["n"] == 1, s
    report(r, out=open("/dev/null", "w"))
    print("self-test passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--from-ms", type=float)
    ap.add_argument("--to-ms", type=float)
    ap.add_argument("--steps", type=int, help="divide totals by this many steps")
    ap.add_argument("--device", type=int, help="device id (default: the one with the most GPU activities)")
    ap.add_argument("--step-kernel", help="a kernel name part launched once per step: the window is whole steps")
    ap.add_argument("--skip", type=int, default=0, help="with --step-kernel: steps to leave out at the start")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.csv:
        ap.error("a trace CSV is needed")
    if (a.steps is not None and a.steps < 1) or a.skip < 0:
        ap.error("--steps must be >= 1 and --skip >= 0")
    report(analyse(load(a.csv), a.from_ms, a.to_ms, a.device, a.step_kernel, a.skip, a.steps))


if __name__ == "__main__":
    main()
