#!/usr/bin/env bash
# dev/gpu_groups.sh — multi-GPU test groups in parallel queues on one machine, so that a 4-GPU lease
# runs two np-2 queues at once (dev/gpu_check.sh runs one group after the other).
#   dev/gpu_groups.sh "0,1:2:checkpoint_tool recompute" "2,3:2:memory faults"
# Each argument is one queue, run beside the others: the GPUs it may use (CUDA_VISIBLE_DEVICES), the
# rank count, then the groups (multigpu.<group>), one after the other, each under a 300 s timeout
# (TIMEOUT), with MT_TEST_STRICT=1. Every run's output and its other ranks' logs go to
# $OUT/<group>.np<N>/ (OUT default /tmp/mt_gpu_groups); one line per run at the end, and the exit
# status is 1 when a run did not end with "N passed, 0 failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mt_gpu_groups}
mkdir -p "$OUT"
queue() {
  local devs=${1%%:*} rest=${1#*:}; local np=${rest%%:*} groups=${rest#*:} g d
  for g in $groups; do
    d="$OUT/$g.np$np"; mkdir -p "$d"; rm -f "$d"/mt_test_rank*.log
    local start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$devs MT_TEST_LOG_DIR=$d MT_TEST_STRICT=1 timeout -k 20 "${TIMEOUT:-300}" \
      mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -x MT_TEST_STRICT -x MT_TEST_LOG_DIR \
      -x CUDA_VISIBLE_DEVICES -np "$np" ./test_megatron "multigpu.$g" > "$d/out.log" 2>&1 </dev/null
    echo "multigpu.$g np $np (GPUs $devs): $(tail -n1 "$d/out.log") ($(( $(date +%s) - start )) s)" > "$d/result.txt"
  done
}
for q in "$@"; do queue "$q" & done
wait
status=0
for r in "$OUT"/*/result.txt; do
  cat "$r"
  grep -qE ": [0-9]+ passed, 0 failed, [0-9]+ skipped \(" "$r" || status=1
  d=$(dirname "$r"); grep -h -E "FAIL|^failed" "$d"/out.log "$d"/mt_test_rank*.log 2>/dev/null | grep -v "on another rank" | head -12 | sed 's/^/    /'
done
exit $status
