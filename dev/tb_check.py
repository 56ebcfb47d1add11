#!/usr/bin/env python3
"""
tb_check.py: reads a train_gpt --tensorboard-dir with TensorBoard's own reader (EventAccumulator) and
checks that its scalars say what the train_gpt log says.

    python3 dev/tb_check.py LOG TB_DIR          # exit status 0 when every check passes
    python3 dev/tb_check.py --vectors           # the protobuf vectors of tests/test_tensorboard.h

Needs the tensorboard package (pip install tensorboard). On a GPU machine, for example:

    ./train_gpt --train-iters 60 --log-interval 10 --eval-interval 20 --eval-iters 2 \\
        --tensorboard-dir /tmp/tb_run --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard \\
        --log-memory-to-tensorboard | tee /tmp/tb_run.log
    python3 dev/tb_check.py /tmp/tb_run.log /tmp/tb_run

and, on any machine, against the synthetic run the host test writes:

    MT_TB_SAMPLE_DIR=/tmp/tbs ./test_megatron tensorboard_sample_run
    python3 dev/tb_check.py /tmp/tbs/train.log /tmp/tbs/tb

Checks, each one line PASS/FAIL:
  - the tags: learning-rate, batch-size, lm loss, loss-scale, grad-norm and each "... vs samples" twin;
    lm loss validation (+ vs samples) when the log has validation lines; every tag's steps evenly
    spaced (--tensorboard-log-interval), none missing between the first and the last;
  - per log line (iteration N, consumed samples C): learning-rate, batch-size, loss-scale and
    grad-norm at step N equal the line's values; "X vs samples" at step C equals X at step N; the
    line's lm loss (the mean over its interval) equals the mean of TensorBoard's lm loss over the
    interval's iterations when all of them are there; iteration-time (s) and throughput, when
    written, equal the line's elapsed time per iteration (ms) and TFLOP/s/GPU;
  - each validation line: lm loss validation at its iteration (and lm loss validation ppl when
    written) equals the line's lm loss value (PPL); test lines: lm loss test;
  - at least one text summary (the arguments), each a non-empty string.
Tolerances: the log prints %.6E (7 significant digits: relative 5e-7), TensorBoard keeps float32
(relative 6e-8): relative 1e-6; grad norm printed %.3f: 5e-4 absolute; times %.1f: 0.05 absolute.
"""
import argparse
import math
import os
import re
import sys

ITER_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
FIELD_RE = re.compile(r"\|\s*([a-zA-Z /()%-]+?):\s*([^|]+?)\s*(?=\|)")
VAL_RE = re.compile(r"^\s*validation loss at iteration\s+(\d+)( on (validation|test) set)?\s*\|(.*)$")
OLD_TEST_RE = re.compile(r"^\s*test loss at iteration\s+(\d+)\s*\|(.*)$")


def parse_log(path):
    """-> (iteration lines [dict], evaluation lines [(kind, iteration, loss, ppl)])."""
    iters, evals = [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = VAL_RE.match(line)
            t = OLD_TEST_RE.match(line)
            if m or t:
                kind = "test" if (t or m.group(3) == "test") else "validation"
                rest = (t.group(2) if t else m.group(4))
                fields = dict((k.strip(), v.strip()) for k, v in FIELD_RE.findall("|" + rest))
                evals.append((kind, int((t or m).group(1)), float(fields["lm loss value"]),
                              float(fields["lm loss PPL"])))
                continue
            m = ITER_RE.search(line)
            if not m:
                continue
            fields = dict((k.strip(), v.strip()) for k, v in FIELD_RE.findall(line[m.end() - 1:] + "|"))
            iters.append({
                "iteration": int(m.group(1)),
                "consumed": int(fields["consumed samples"]),
                "ms": float(fields["elapsed time per iteration (ms)"]),
                "tflops": float(fields.get("throughput per GPU (TFLOP/s/GPU)", "nan")),
                "lr": float(fields["learning rate"]),
                "gbs": int(fields["global batch size"]),
                "loss": float(fields["lm loss"]),
                "loss_scale": float(fields["loss scale"]),
                "grad_norm": float(fields["grad norm"]),
                "skipped": int(fields["number of skipped iterations"]),
            })
    return iters, evals


def load_events(tb_dir):
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        sys.exit("tb_check: the tensorboard package is not installed (pip install tensorboard)")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {}
    for tag in acc.Tags()["scalars"]:
        scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    texts = {}
    for tag in acc.Tags()["tensors"]:
        texts[tag] = [e.tensor_proto.string_val for e in acc.Tensors(tag)]
    return scalars, texts


class Checks:
    def __init__(self):
        self.failed = 0
        self.passed = 0

    def row(self, ok, what, detail=""):
        print(f"{'PASS' if ok else 'FAIL'}  {what}{'  (' + detail + ')' if detail else ''}")
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def close(a, b, rel=1e-6, abs_tol=0.0):
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= abs_tol + rel * max(abs(a), abs(b))


def at(series, step):
    """The values at step (several when written more than once, in the file's order)."""
    return [v for s, v in series if s == step]


def print_vectors():
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c, masked_crc32c
    import struct
    text_meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text", content=b""))
    text_tensor = TensorProto(dtype="DT_STRING", string_val=[b"6e-4"],
                              tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    events = {
        "file_version": Event(wall_time=1700000000.25, file_version="brain.Event:2"),
        "scalar": Event(wall_time=1700000000.25, step=300,
                        summary=Summary(value=[Summary.Value(tag="lm loss", simple_value=2.5)])),
        "scalar_zero": Event(wall_time=1700000000.25,
                             summary=Summary(value=[Summary.Value(tag="x", simple_value=0.0)])),
        "text": Event(wall_time=1700000000.25, step=7, summary=Summary(value=[
            Summary.Value(tag="lr/text_summary", metadata=text_meta, tensor=text_tensor)])),
    }
    for name, event in events.items():
        data = event.SerializeToString()
        print(f"{name} ({len(data)} bytes): " + ", ".join(f"0x{b:02x}" for b in data))
    for data in (b"123456789", bytes(32), b"\xff" * 32, bytes(range(32)), struct.pack("<Q", 27)):
        print(f"crc32c {data[:9]!r}...: {crc32c(data):#010x}, masked {masked_crc32c(data):#010x}")


def main():
    ap = argparse.ArgumentParser(description="check a train_gpt TensorBoard directory against its log")
    ap.add_argument("log", nargs="?", help="train_gpt's output")
    ap.add_argument("tb_dir", nargs="?", help="the --tensorboard-dir")
    ap.add_argument("--vectors", action="store_true", help="print tests/test_tensorboard.h's protobuf vectors")
    args = ap.parse_args()
    if args.vectors:
        print_vectors()
        return 0
    if not args.log or not args.tb_dir:
        ap.error("LOG and TB_DIR are required")
    if not os.path.isdir(args.tb_dir) or not any("tfevents" in f for f in os.listdir(args.tb_dir)):
        sys.exit(f"tb_check: no event file in {args.tb_dir}")
    iters, evals = parse_log(args.log)
    if not iters and not evals:
        sys.exit(f"tb_check: no iteration or validation lines in {args.log}")
    scalars, texts = load_events(args.tb_dir)
    c = Checks()

    names = ["learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm"] if iters else []
    if any(kind == "validation" for kind, *_ in evals if iters):
        names.append("lm loss validation")
    missing = [t for n in names for t in (n, n + " vs samples") if t not in scalars]
    c.row(not missing, f"tags: {', '.join(names)} and their 'vs samples' twins",
          "missing: " + ", ".join(missing) if missing else f"{len(scalars)} scalar tags")
    for tag, series in sorted(scalars.items()):
        if tag.endswith(" vs samples") or tag in ("lm loss validation", "lm loss validation ppl", "lm loss test",
                                                  "lm loss test ppl", "iteration-time", "throughput"):
            continue
        steps = sorted(set(s for s, _ in series))
        gaps = sorted(set(b - a for a, b in zip(steps, steps[1:])))
        c.row(len(gaps) <= 1, f"{tag}: steps evenly spaced", f"{len(steps)} steps {steps[0]}..{steps[-1]}, spacing {gaps}")

    prev = None
    for line in iters:
        n, consumed = line["iteration"], line["consumed"]
        bad = []
        for tag, key, rel, abs_tol in (("learning-rate", "lr", 1e-6, 0.0), ("batch-size", "gbs", 0.0, 0.0),
                                       ("loss-scale", "loss_scale", 1e-6, 0.05), ("grad-norm", "grad_norm", 1e-6, 5e-4)):
            got = at(scalars.get(tag, []), n)
            if tag == "grad-norm" and line["skipped"]:
                continue  # a skipped step has no gradient norm (Megatron writes none)
            if len(got) != 1 or not close(got[0], float(line[key]), rel, abs_tol):
                bad.append(f"{tag} {got} vs log {line[key]}")
            twin = at(scalars.get(tag + " vs samples", []), consumed)
            if got and (len(twin) != 1 or twin[0] != got[0]):
                bad.append(f"{tag} vs samples at {consumed}: {twin} vs {got}")
        if "iteration-time" in scalars:
            got = at(scalars["iteration-time"], n)
            if len(got) != 1 or not close(got[0] * 1000.0, line["ms"], 1e-6, 0.05 + 1e-4 * line["ms"]):
                bad.append(f"iteration-time {got} s vs log {line['ms']} ms")
        if "throughput" in scalars:
            got = at(scalars["throughput"], n)
            if len(got) != 1 or not close(got[0], line["tflops"], 1e-6, 0.05):
                bad.append(f"throughput {got} vs log {line['tflops']}")
        # the line's lm loss: the mean over its interval (prev, n] of the unskipped iterations
        first = prev + 1 if prev is not None else None
        if first is not None and not line["skipped"]:
            losses = [at(scalars.get("lm loss", []), k) for k in range(first, n + 1)]
            if all(len(v) == 1 for v in losses):
                mean = sum(v[0] for v in losses) / len(losses)
                if not close(mean, line["loss"], 1e-6):
                    bad.append(f"lm loss mean over {first}..{n} {mean:.7g} vs log {line['loss']:.7g}")
        elif first is None:
            got = at(scalars.get("lm loss", []), n)
            if n == 1 and (len(got) != 1 or not close(got[0], line["loss"], 1e-6)):
                bad.append(f"lm loss {got} vs log {line['loss']}")
        c.row(not bad, f"log line at iteration {n}", "; ".join(bad))
        prev = n

    seen = {}
    for kind, n, loss, ppl in evals:
        tag = "lm loss validation" if kind == "validation" else "lm loss test"
        if tag not in scalars:
            c.row(kind == "test", f"{kind} at iteration {n}: {tag}",
                  "not written" + (" (the final test evaluation is optional)" if kind == "test" else ""))
            continue
        k = seen.get((tag, n), 0)
        seen[(tag, n)] = k + 1
        got = at(scalars[tag], n)
        bad = []
        if len(got) <= k or not close(got[k], loss, 1e-6):
            bad.append(f"{tag} {got} vs log {loss}")
        if tag + " ppl" in scalars:
            got = at(scalars[tag + " ppl"], n)
            if len(got) <= k or not close(got[k], ppl, 1e-6):
                bad.append(f"{tag} ppl {got} vs log {ppl}")
        c.row(not bad, f"{kind} line at iteration {n}", "; ".join(bad))

    text_tags = [t for t in texts if t.endswith("/text_summary")]
    empty = [t for t in text_tags if not texts[t] or not texts[t][-1] or not texts[t][-1][0].decode()]
    c.row(bool(text_tags) and not empty, "arguments as text summaries", f"{len(text_tags)} texts" +
          (", empty: " + ", ".join(empty) if empty else ""))
    print(f"tb_check: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
