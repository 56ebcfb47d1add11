#!/usr/bin/env bash
# dev/timeout_check.sh — a rank that stops answering (issue #23, --distributed-timeout-minutes), on 2 GPUs:
# train_gpt runs under mpirun (PP = 2, then DP = 2); once it logs iterations, rank 1 is frozen with
# SIGSTOP (a hung process: its peer's collective or transfer never completes). The other rank's
# watchdog must end the job within the timeout (0.25 minutes) plus a few seconds, with one line
# "train_gpt: rank 0: the ... stream has made no progress ..." and a non-zero exit status, instead of
# hanging. Prints a table; the last line is "timeout check: N failures". Run after make all.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
WORK=${WORK:-/tmp/mt_timeout_check}
rm -rf "$WORK" && mkdir -p "$WORK"
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0"
FAILED=0
declare -a rows
case_run() { # name, flags
  local name=$1; shift
  local log="$WORK/$name.log"
  $MPIRUN -np 2 ./train_gpt --sample-tokens 0 --train-iters 1000000 --eval-interval 0 --log-interval 10 \
    --distributed-timeout-minutes 0.25 "$@" > "$log" 2>&1 &
  local launcher=$! waited=0
  while ! grep -q "elapsed time per iteration" "$log" && [ $waited -lt 120 ]; do sleep 1; waited=$((waited + 1)); done
  local victim=""
  for p in $(pgrep -f "^./train_gpt"); do
    grep -qz "^OMPI_COMM_WORLD_RANK=1$" /proc/$p/environ 2>/dev/null && victim=$p
  done
  if [ -z "$victim" ]; then
    rows+=("$name|FAIL: no rank 1 running after ${waited} s|"); FAILED=$((FAILED + 1))
    kill -9 $launcher 2>/dev/null; pkill -9 -f "^./train_gpt"; return
  fi
  local stopped=$(date +%s.%N)
  kill -STOP "$victim"
  local ended=0
  for i in $(seq 1 120); do
    if ! kill -0 $launcher 2>/dev/null; then ended=1; break; fi
    sleep 1
  done
  local took=$(awk -v a="$stopped" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  wait $launcher 2>/dev/null; local code=$?
  kill -CONT "$victim" 2>/dev/null; kill -9 "$victim" 2>/dev/null; pkill -9 -f "^./train_gpt"
  local line=$(grep "^train_gpt: rank 0: .*made no progress\|^train_gpt: rank 0: NCCL reports" "$log" | head -n1)
  if [ $ended = 1 ] && [ "$code" != 0 ] && [ -n "$line" ]; then
    rows+=("$name|ended in ${took} s after the stop, exit $code|${line:0:150}")
  else
    rows+=("$name|FAIL: ended $ended, exit $code, ${took} s|${line:-no watchdog line}"); FAILED=$((FAILED + 1))
    tail -5 "$log"
  fi
}
case_run pp2 --pipeline-model-parallel-size 2 --micro-batch-size 8
case_run dp2 --micro-batch-size 16
echo "==== timeout check ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) ===="
printf '%s\n' "${rows[@]}" | awk -F'|' '{ printf "%-6s %-44s %s\n", $1, $2, $3 }'
echo "timeout check: $FAILED failures"
[ $FAILED = 0 ]
