#!/usr/bin/env bash
# dev/async_save_check.sh — what a checkpoint save costs the step loop, with and without --async-save,
# on one GPU, for the GPT-2 1.5B shape (bf16, --mock-data): ITERS steps (30) saving every INTERVAL (10)
# iterations into OUT, once synchronously and once with --async-save. Prints, per run, the step loop's
# wait for each save (train_gpt's "the step loop waited" / "staged in" lines: for async the
# device-to-host copy into pinned memory, plus any earlier save still being written), the mean
# iteration time, and checks that both runs' last checkpoints are byte-identical (cmp of every file)
# and that the losses of the two runs are equal. The first async save also allocates its pinned staging
# (12 bytes per parameter: about 19 GB here), kept for the later ones.
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/async_save_check.sh        Environment: ITERS (30), INTERVAL (10), OUT (/tmp/async_save_check)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/async_save_check}
ITERS=${ITERS:-30}
INTERVAL=${INTERVAL:-10}
rm -rf "$OUT"
mkdir -p "$OUT"
gpt15="--num-layers 48 --hidden-size 1600 --num-attention-heads 25 --seq-length 1024 --max-position-embeddings 1024 \
  --vocab-size 50257"
common="--mock-data --tokenizer-type NullTokenizer --bf16 --micro-batch-size 8 --global-batch-size 8 --train-iters $ITERS \
  --log-interval 1 --lr 1e-4 --eval-iters 0 --sample-tokens 0 --save-interval $INTERVAL"
fail=0
for mode in sync async; do
  flags=""
  [ "$mode" = async ] && flags="--async-save"
  # shellcheck disable=SC2086
  ./train_gpt $gpt15 $common --save "$OUT/ckpt_$mode" $flags >"$OUT/$mode.log" 2>&1 || { echo "$mode: failed (see $OUT/$mode.log)"; fail=1; continue; }
  waits=$(grep -o 'waited [0-9.]* ms\|staged in [0-9.]* ms' "$OUT/$mode.log" | grep -o '[0-9.]*' | tr '\n' ' ')
  ms=$(grep -o 'per iteration (ms): [0-9.]*' "$OUT/$mode.log" | awk '{ s += $NF; n++ } END { if (n) printf "%.1f", s / n }')
  echo "$mode: the step loop's wait per save (ms): $waits| mean iteration $ms ms"
done
last=$(cat "$OUT/ckpt_sync/latest_checkpointed_iteration.txt" 2>/dev/null)
it=$(printf "iter_%07d" "${last:-0}")
if [ -n "$last" ] && diff -r "$OUT/ckpt_sync/$it" "$OUT/ckpt_async/$it" >/dev/null; then
  echo "iteration $last: sync and async checkpoints byte-identical"
else
  echo "FAIL: the sync and async checkpoints of iteration ${last:-?} differ"; fail=1
fi
loss() { grep -o 'lm loss: [0-9.E+-]*' "$1"; }
if [ "$(loss "$OUT/sync.log")" = "$(loss "$OUT/async.log")" ]; then echo "losses equal"; else echo "FAIL: losses differ"; fail=1; fi
exit $fail
