#!/usr/bin/env bash
# Per-kernel GPU time of one train_gpt iteration, from Nsight Compute (ncu), summed by kernel name
# (clocks left as they run, --clock-control none, so the times compare with a torch.profiler trace).
#   [TOP=25] dev/bench/profile_kernels.sh [train_gpt flags...]   (default: GPT-2 124M, T=1024, micro-batch 8;
#   TOP: how many kernels the table lists, the most expensive first)
# Needs dev/data/tinyshakespeare_text_document.{bin,idx} (run ./train_gpt once) and ncu on the PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mt_profile}
mkdir -p "$OUT"
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
  ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 8
        --global-batch-size 8 --lr 1e-4 --bf16 --data-path dev/data/tinyshakespeare_text_document
        --vocab-file dev/data/gpt2/gpt2-vocab.json --merge-file dev/data/gpt2/gpt2-merges.txt
        --eval-iters 0 --split 1,0,0 --hidden-dropout 0 --attention-dropout 0)
fi
./train_gpt "${ARGS[@]}" --train-iters 30 --log-interval 10 | grep " iteration " | tail -n 2
ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" ./train_gpt "${ARGS[@]}" --train-iters 1 >/dev/null
python3 - "$OUT/ncu.csv" "${TOP:-25}" <<'PY'
import csv, re, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
total, count = collections.Counter(), collections.Counter()
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    name = re.sub(r"\(.*", "", r["Kernel Name"])[:60]
    v = float(r["Metric Value"].replace(",", ""))
    scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}.get(r.get("Metric Unit", "nsecond"), 1e-6)
    total[name] += v * scale; count[name] += 1
s = sum(total.values())
print(f"{'kernel':60s} {'calls':>6s} {'ms':>9s} {'share':>6s}")
for k, v in total.most_common(int(sys.argv[2])):
    print(f"{k:60s} {count[k]:6d} {v:9.3f} {100*v/s:5.1f}%")
print(f"{'total (one iteration incl. init kernels)':60s} {sum(count.values()):6d} {s:9.3f}")
PY
