#!/usr/bin/env python3
"""
mcore_integrity_check.py: prepro/convert_mcore.py's integrity rule on the host (numpy only, no torch or
megatron-core; tests/test_checkpoint_tool.h runs it when python3 has numpy).

    python dev/mcore_integrity_check.py [--checkpoint-tool prepro/checkpoint_tool]

A small checkpoint of this project (GPT-2, 2 layers, hidden 16, random arrays) is written with
convert_mcore's own writer (write_ours: manifest, manifest mark 1) and then, each through
`convert_mcore.py --to-mcore` (main, as a user runs it):
  1. intact: it passes the rule (the run then stops where megatron-core is needed, or converts where it
     is installed) and check_integrity says nothing;
  2. one flipped byte in model_optim_rng.bin: refused, exit 1, one line naming the file ("corrupted");
     with --no-verify: one warning line naming it, and the run goes on past the rule;
  3. the manifest deleted (the header says it was saved with one): refused ("incomplete or tampered");
     with --no-verify: a warning;
  4. a file the manifest does not list: refused naming it;
  5. a checkpoint from before manifests (mark 0, no manifest): read with a warning, no refusal; a
     mixture-of-experts checkpoint (its --num-experts header word): refused in one line;
  6. with --checkpoint-tool (when built): the C side agrees: `checkpoint_tool verify` accepts the
     Python-written checkpoint and refuses the damaged one, and the manifest `checkpoint_tool reshard`
     writes (C) verifies here (Python), its header carrying the mark.
Prints one line per check and exits non-zero if any failed.
"""
import argparse
import contextlib
import io
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "prepro"))
import convert_mcore as cm  # noqa: E402

W = cm.W
FAILED = []


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    if not ok:
        FAILED.append(what)


def header(manifested):
    h = [0] * cm.HEADER_WORDS
    m = dict(MAGIC=cm.CK_MAGIC, VERSION=cm.CK_VERSION, LAYERS=2, HIDDEN=16, HEADS=2, GROUPS=2, KV=8, FFN=64,
             VOCAB=128, POSITIONS=8, PRECISION=1, ITERATION=3, CONSUMED=24, SCHED_STEPS=24, ADAM_STEP=3, SEED=1234,
             HYSTERESIS=2, LOSS_SCALE_BITS=cm.f64_bits(1.0), TP=1, PP=1, NORM_EPS_BITS=cm.f64_bits(1e-5),
             TRUE_VOCAB=100, MANIFESTED=manifested)
    for k, v in m.items():
        h[W[k]] = v
    layout = cm.param_layout(cm.model_of_header(h))
    h[W["NUM_PARAMS"]] = sum(int(np.prod(s)) for _, _, s in layout)
    return h, layout


def write(path):
    h, layout = header(0)   # write_ours sets the mark itself
    rng = np.random.default_rng(7)
    arrays = [{n: rng.normal(0, 1, s).astype(np.float32) for n, _, s in layout} for _ in range(3)]
    cm.write_ours(path, h, layout, *arrays)
    return os.path.join(path, "iter_0000003")


def run(argv):
    """convert_mcore.main(argv): (exit code, stderr lines)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cm.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


def past_rule(rc, lines):
    """The run went past the integrity rule: it converted (megatron-core installed) or stopped at its import."""
    return rc == 0 or (rc == 1 and any("needs torch and megatron-core" in line for line in lines))


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--checkpoint-tool", default=os.path.join(ROOT, "prepro", "checkpoint_tool"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mcore_integrity_")
    try:
        good = os.path.join(work, "good")
        it_dir = write(good)
        model = os.path.join(it_dir, "mp_rank_00", "model_optim_rng.bin")
        with open(model, "rb") as f:
            mark = struct.unpack(f"<{cm.HEADER_WORDS}q", f.read(8 * cm.HEADER_WORDS))[W["MANIFESTED"]]
        check("write_ours sets the manifest mark", mark == 1, f"word {W['MANIFESTED']} is {mark}")
        check("intact: check_integrity says nothing", cm.check_integrity(it_dir) is None)
        rc, lines = run(["--to-mcore", good, os.path.join(work, "out0")])
        check("intact: --to-mcore goes past the rule", past_rule(rc, lines) and
              not any("warning" in line for line in lines), f"exit {rc}, {lines}")

        cases = [
            ("a flipped byte", "flip", "mp_rank_00/model_optim_rng.bin is corrupted"),
            ("the manifest deleted", "unlink", "has no manifest.txt but was saved with one"),
            ("an unlisted file", "extra", "stray.bin is not in its manifest"),
        ]
        for what, kind, needle in cases:
            d = os.path.join(work, kind)
            shutil.copytree(good, d)
            idir = os.path.join(d, "iter_0000003")
            if kind == "flip":
                flip(os.path.join(idir, "mp_rank_00", "model_optim_rng.bin"), 9000)
            elif kind == "unlink":
                os.unlink(os.path.join(idir, "manifest.txt"))
            else:
                open(os.path.join(idir, "mp_rank_00", "stray.bin"), "wb").write(b"x")
            rc, lines = run(["--to-mcore", d, os.path.join(work, "out_" + kind)])
            check(f"{what}: refused, exit 1, one line naming it", rc == 1 and len(lines) == 1 and needle in lines[0],
                  f"exit {rc}, {lines}")
            check(f"{what}: nothing written", not os.path.exists(os.path.join(work, "out_" + kind)))
            rc, lines = run(["--to-mcore", d, os.path.join(work, "out_nv_" + kind), "--no-verify"])
            warned = [line for line in lines if line.startswith("convert_mcore: warning:") and needle in line]
            check(f"{what}: --no-verify warns and goes on", len(warned) == 1 and past_rule(rc, lines),
                  f"exit {rc}, {lines}")
            if os.path.exists(args.checkpoint_tool):
                r = subprocess.run([args.checkpoint_tool, "verify", d], capture_output=True, text=True)
                check(f"{what}: checkpoint_tool verify refuses it too", r.returncode == 1 and needle in r.stderr,
                      r.stderr.strip())

        # a checkpoint from before manifests: mark 0, no manifest
        old = os.path.join(work, "old")
        shutil.copytree(good, old)
        oldm = os.path.join(old, "iter_0000003", "mp_rank_00", "model_optim_rng.bin")
        with open(oldm, "r+b") as f:
            f.seek(8 * W["MANIFESTED"])
            f.write(struct.pack("<q", 0))
        os.unlink(os.path.join(old, "iter_0000003", "manifest.txt"))
        rc, lines = run(["--to-mcore", old, os.path.join(work, "out_old")])
        check("before manifests: read with a warning", past_rule(rc, lines) and
              any("saved before manifests" in line and "warning" in line for line in lines), f"exit {rc}, {lines}")
        # a mixture-of-experts checkpoint (its header's --num-experts word): refused in one line, nothing written
        moe = os.path.join(work, "moe")
        h, layout = header(0)
        h[W["NUM_EXPERTS"]] = 4
        rng = np.random.default_rng(8)
        cm.write_ours(moe, h, layout, *[{n: rng.normal(0, 1, s).astype(np.float32) for n, _, s in layout}
                                        for _ in range(3)])
        rc, lines = run(["--to-mcore", moe, os.path.join(work, "out_moe")])
        check("an MoE checkpoint: --to-mcore refuses it in one line", rc == 1 and len(lines) == 1 and
              "mixture-of-experts model (--num-experts 4)" in lines[0] and
              not os.path.exists(os.path.join(work, "out_moe")), f"exit {rc}, {lines}")
        # usage: --no-verify goes with --to-mcore
        rc, lines = run(["--from-mcore", good, os.path.join(work, "out_usage"), "--no-verify"])
        check("--no-verify with --from-mcore is a usage error (exit 2)", rc == 2, f"exit {rc}")

        if os.path.exists(args.checkpoint_tool):
            r = subprocess.run([args.checkpoint_tool, "verify", good], capture_output=True, text=True)
            check("checkpoint_tool verify accepts the Python-written checkpoint", r.returncode == 0, r.stderr.strip())
            resh = os.path.join(work, "resharded")
            r = subprocess.run([args.checkpoint_tool, "reshard", good, resh, "--target-tp", "1", "--target-pp", "1"],
                               capture_output=True, text=True)
            ok = r.returncode == 0
            if ok:
                try:
                    cm.verify_manifest(os.path.join(resh, "iter_0000003"))
                    h, _, _, _ = cm.read_ours(resh)
                    ok = h[W["MANIFESTED"]] == 1
                except cm.ConvertError as e:
                    ok, r = False, SimpleErr(str(e))
            check("checkpoint_tool reshard's manifest (C) verifies here (Python), mark 1", ok, r.stderr.strip())
        else:
            print(f"skip: {args.checkpoint_tool} is not built (the C side's agreement)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'}")
    return 1 if FAILED else 0


class SimpleErr:
    def __init__(self, text):
        self.stderr = text


if __name__ == "__main__":
    sys.exit(main())
