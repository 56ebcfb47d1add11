#!/usr/bin/env bash
# dev/async_save_check.sh — what a checkpoint save costs the step loop, with and without --async-save,
# on one GPU, for the GPT-2 1.5B shape (bf16, --mock-data): ITERS steps (200) saving every INTERVAL
# (100) iterations into OUT (long enough for the background write of ~19 GB to end before the next
# save), once synchronously and once with --async-save. Prints the disk's own write speed (dd of
# 4 GiB with fsync), then per run the step loop's wait for each save (train_gpt's "the step loop
# waited" / "staged in" lines: for async the device-to-host copy into pinned memory, plus
# any earlier save still being written), the mean iteration time and, for the sync run, the save's
# bandwidth (checkpoint bytes over its wait); then the load time of the last checkpoint (train_gpt
# --load's "in N ms"). Checks that both runs' last checkpoints are identical (their manifests, which
# hold every file's size and CRC-32C, are equal: a 1.5B checkpoint is ~19 GB, so the sync run's are
# deleted before the async run to fit a 64 GiB disk) and that the losses of the two runs are equal.
# With --async-save train_gpt allocates the pinned staging (12 bytes per parameter: about 19 GB here)
# at startup, so every save's stall is its device-to-host copy.
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/async_save_check.sh        Environment: ITERS (200), INTERVAL (100), OUT (/tmp/async_save_check)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/async_save_check}
ITERS=${ITERS:-200}
INTERVAL=${INTERVAL:-100}
rm -rf "$OUT"
mkdir -p "$OUT"
gpt15="--num-layers 48 --hidden-size 1600 --num-attention-heads 25 --seq-length 1024 --max-position-embeddings 1024 \
  --vocab-size 50257"
common="--mock-data --tokenizer-type NullTokenizer --bf16 --micro-batch-size 8 --global-batch-size 8 --train-iters $ITERS \
  --log-interval 10 --lr 1e-4 --eval-iters 0 --sample-tokens 0 --save-interval $INTERVAL"
fail=0
dd if=/dev/zero of="$OUT/dd.bin" bs=64M count=64 conv=fsync 2>"$OUT/dd.log" \
  && echo "disk: $(tail -n1 "$OUT/dd.log" | sed 's/.*, //') writing 4 GiB with fsync (dd)"
rm -f "$OUT/dd.bin"
last=""
for mode in sync async; do
  flags=""
  [ "$mode" = async ] && flags="--async-save"
  # shellcheck disable=SC2086
  ./train_gpt $gpt15 $common --save "$OUT/ckpt_$mode" $flags >"$OUT/$mode.log" 2>&1 || { echo "$mode: failed (see $OUT/$mode.log)"; fail=1; continue; }
  waits=$(grep -o 'waited [0-9.]* ms\|staged in [0-9.]* ms' "$OUT/$mode.log" | grep -o '[0-9.]*' | tr '\n' ' ')
  ms=$(grep -o 'per iteration (ms): [0-9.]*' "$OUT/$mode.log" | awk '{ s += $NF; n++ } END { if (n) printf "%.1f", s / n }')
  last=$(cat "$OUT/ckpt_$mode/latest_checkpointed_iteration.txt" 2>/dev/null)
  it=$(printf "iter_%07d" "${last:-0}")
  bytes=$(du -sb "$OUT/ckpt_$mode/$it" 2>/dev/null | cut -f1)
  bw=""
  if [ "$mode" = sync ]; then
    w=$(grep -o 'waited [0-9.]* ms' "$OUT/$mode.log" | head -n1 | grep -o '[0-9.]*')
    bw=$(awk -v b="${bytes:-0}" -v w="${w:-0}" 'BEGIN { if (w > 0) printf " | first save %.2f GB/s", b / w / 1e6 }')
  fi
  echo "$mode: the step loop's wait per save (ms): $waits| mean iteration $ms ms | checkpoint $(awk -v b="${bytes:-0}" 'BEGIN { printf "%.2f GB", b / 1e9 }')$bw"
  cp "$OUT/ckpt_$mode/$it/manifest.txt" "$OUT/manifest_$mode.txt" 2>/dev/null
  if [ "$mode" = sync ]; then rm -rf "$OUT/ckpt_sync"; fi
done
# load time: the async run's last checkpoint, loaded by a run that trains no further step
# shellcheck disable=SC2086
./train_gpt $gpt15 ${common/--train-iters $ITERS/--train-iters ${last:-0}} --load "$OUT/ckpt_async" >"$OUT/load.log" 2>&1
if grep -q 'loaded checkpoint' "$OUT/load.log"; then grep -o 'loaded checkpoint .*' "$OUT/load.log" | head -n1 | sed 's/(.*consumed) //'
else echo "FAIL: the load failed (see $OUT/load.log)"; fail=1; fi
if [ -n "$last" ] && [ -s "$OUT/manifest_sync.txt" ] && cmp -s "$OUT/manifest_sync.txt" "$OUT/manifest_async.txt"; then
  echo "iteration $last: sync and async checkpoints identical (manifests equal: every file's size and CRC-32C)"
else
  echo "FAIL: the sync and async checkpoints of iteration ${last:-?} differ"; fail=1
fi
loss() { grep -o 'lm loss: [0-9.E+-]*' "$1"; }
if [ "$(loss "$OUT/sync.log")" = "$(loss "$OUT/async.log")" ]; then echo "losses equal"; else echo "FAIL: losses differ"; fail=1; fi
rm -rf "$OUT/ckpt_async"
exit $fail
