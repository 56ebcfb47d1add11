#!/usr/bin/env bash
# dev/reshard_check.sh — checkpoints on a GPU machine: manifest, verify, resume, and prepro/checkpoint_tool's
# resharding loaded by train_gpt (after make all).
#   1. train_gpt (built-in job, TP 1) saves at iterations 20 and 40; checkpoint_tool verify passes on it.
#   2. iteration 20 resharded TP1 -> TP2 -> TP1 x PP2 x VP3 -> TP1; train_gpt loads the result and its
#      losses for iterations 21..40 equal the uninterrupted run's (bitwise, as printed).
#   3. a flipped byte in iteration 40: checkpoint_tool verify and reshard fail naming the file, train_gpt
#      --load warns and resumes from iteration 20, the newest complete one, and with
#      --no-verify-checkpoint it warns and resumes from iteration 40.
#   4. with 2 GPUs and mpirun: a TP 2 run's checkpoint resharded to TP 1 loads on one GPU and trains on.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/mt_reshard_check}
rm -rf "$WORK" && mkdir -p "$WORK"
export NCCL_NVLS_ENABLE=0
FAILED=0
fail() { echo "  FAIL: $*"; FAILED=$((FAILED + 1)); }
T=prepro/checkpoint_tool
TG=(./train_gpt --train-iters 40 --log-interval 1 --eval-interval 0 --sample-tokens 0)
# "iteration loss" lines of a log after iteration $2
loss() { grep -o 'iteration *[0-9]*/ *40 .*lm loss: [0-9.E+-]*' "$1" | awk -v from="$2" '{ split($2, a, "/"); if (a[1] + 0 > from) print a[1], $NF }'; }

"${TG[@]}" --save "$WORK/a" --save-interval 20 >"$WORK/a.log" 2>&1 || fail "the TP 1 run failed: $(tail -1 "$WORK/a.log")"
$T verify "$WORK/a" || fail "verify of a fresh save"
$T info "$WORK/a" --iteration 20 >"$WORK/info.txt" || fail "info"

prev="$WORK/a"; it="--iteration 20"
for step in "2 1 1" "1 2 3" "1 1 1"; do  # the built-in job has 6 layers: PP 2 x VP 3
  set -- $step
  out="$WORK/r_tp$1_pp$2_vp$3"
  $T reshard "$prev" "$out" --target-tp "$1" --target-pp "$2" --target-vp "$3" $it || fail "reshard to TP $1 PP $2 VP $3"
  $T verify "$out" >/dev/null || fail "verify of the TP $1 PP $2 VP $3 reshard"
  prev="$out"; it=""
done
"${TG[@]}" --load "$prev" --save "$WORK/b_save" >"$WORK/b.log" 2>&1 || fail "train_gpt --load of the round trip: $(tail -1 "$WORK/b.log")"
if [ -n "$(loss "$WORK/b.log" 20)" ] && [ "$(loss "$WORK/b.log" 20)" = "$(loss "$WORK/a.log" 20)" ]; then
  echo "  TP1 -> TP2 -> TP1xPP2xVP3 -> TP1 round trip: iterations 21..40 equal the uninterrupted run's"
else
  fail "the round trip's losses differ from the uninterrupted run's"
fi

cp -r "$WORK/a" "$WORK/damaged"
python3 - "$WORK/damaged/iter_0000040/mp_rank_00/model_optim_rng.bin" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(-1000, 2); b = f.read(1); f.seek(-1000, 2); f.write(bytes([b[0] ^ 0x10]))
PY
$T verify "$WORK/damaged" 2>"$WORK/verify.err" && fail "verify passed a flipped byte"
grep -q "model_optim_rng.bin is corrupted" "$WORK/verify.err" || fail "verify's line: $(cat "$WORK/verify.err")"
$T reshard "$WORK/damaged" "$WORK/damaged_tp2" --target-tp 2 --target-pp 1 2>"$WORK/reshard.err" && fail "reshard took a flipped byte"
grep -q "model_optim_rng.bin is corrupted" "$WORK/reshard.err" || fail "reshard's line: $(cat "$WORK/reshard.err")"
"${TG[@]}" --load "$WORK/damaged" --save "$WORK/c_save" >"$WORK/c.log" 2>&1 || fail "train_gpt --load of the damaged dir: $(tail -1 "$WORK/c.log")"
grep -q "warning: the tracker's iteration 40 was refused" "$WORK/c.log" && grep -q "loaded checkpoint from .* at iteration 20" "$WORK/c.log" \
  || fail "no fallback to iteration 20 with a warning"
"${TG[@]}" --load "$WORK/damaged" --no-verify-checkpoint >"$WORK/nv.log" 2>&1 || fail "--no-verify-checkpoint: $(tail -1 "$WORK/nv.log")"
grep -q "warning: .*is corrupted.*read anyway" "$WORK/nv.log" && grep -q "loaded checkpoint from .* at iteration 40" "$WORK/nv.log" \
  || fail "--no-verify-checkpoint did not read iteration 40 with a warning"
[ "$(loss "$WORK/c.log" 20)" = "$(loss "$WORK/a.log" 20)" ] || fail "the fallback's losses differ"

ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -ge 2 ] && command -v mpirun >/dev/null; then
  mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np 2 "${TG[@]}" --tensor-model-parallel-size 2 \
    --save "$WORK/tp2" --save-interval 20 >"$WORK/tp2.log" 2>&1 || fail "the TP 2 run failed: $(tail -1 "$WORK/tp2.log")"
  $T verify "$WORK/tp2" || fail "verify of the TP 2 save"
  $T reshard "$WORK/tp2" "$WORK/tp2_to_1" --target-tp 1 --target-pp 1 --iteration 20 || fail "reshard TP 2 -> 1"
  "${TG[@]}" --load "$WORK/tp2_to_1" --save "$WORK/d_save" >"$WORK/d.log" 2>&1 || fail "train_gpt TP 1 --load of the TP 2 checkpoint: $(tail -1 "$WORK/d.log")"
  echo "  TP 2 -> TP 1: iteration 21 loss $(loss "$WORK/d.log" 20 | head -1) (TP 2 run: $(loss "$WORK/tp2.log" 20 | head -1))"
else
  echo "  (one GPU: the TP 2 save -> TP 1 load part needs 2 GPUs and mpirun)"
fi
echo "reshard check: $FAILED failures"
[ "$FAILED" -eq 0 ]
