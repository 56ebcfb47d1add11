#!/usr/bin/env bash
# dev/gpu_check.sh — the one command to run on a GPU machine: build for sm_90, run the test suite
# (GPU tests included; multi-GPU tests under mpirun when several GPUs are visible), run the
# built-in training job, and end with a short summary table. Logs go to $OUT (or /tmp/mt_gpu_check).
#   dev/gpu_check.sh            everything
#   dev/gpu_check.sh tests      build + tests only (single: the one-GPU tests; multi: the mpirun tests)
#   dev/gpu_check.sh jobs       build + the training jobs and the dead-rank check only
# With several GPUs the one-GPU tests are sharded over them (MT_TEST_SHARD=k/n, one process per GPU).
# The tests run with MT_TEST_STRICT=1 (a missing dev/data file or built tool, or an FP8/cuBLASLt
# refusal, fails instead of skipping), and the skips their summaries name are compared with
# dev/gpu_expected_skips.txt: an unexpected skip, or an expected one that ran, is a row of the table
# and makes the exit status 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mt_gpu_check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
what=${1:-all}
declare -a rows
print_rows() { printf '%s\n' "${rows[@]}" | awk -F'|' '{ printf "%-34s %-44s %s\n", $1, $2, $3 }'; }

# check_skips PART LOG...: the skips the logs' summaries name (`skipped: group/name (reason)`, and
# `skipped (reason): N tests` as "(reason)") against PART's lines of dev/gpu_expected_skips.txt. A
# log that did not reach its last line is left out (its row says so already).
skip_mismatch=0
check_skips() {
  local part=$1; shift
  local logs=() f key reason
  for f in "$@"; do tail -n1 "$f" | grep -qE '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' && logs+=("$f"); done
  [ ${#logs[@]} -gt 0 ] || return 0
  local expected
  expected=$(awk -F'|' -v p="$part" '/^[^#]/ { gsub(/^ +| +$/, "", $1); gsub(/^ +| +$/, "", $2); if ($1 == p) print $2 }' dev/gpu_expected_skips.txt)
  while IFS='|' read -r key reason; do
    [ -n "$key" ] || continue
    if ! grep -qxF -- "$key" <<< "$expected"; then
      rows+=("unexpected skip ($part)|$key|$reason"); skip_mismatch=1
    fi
  done < <(cat "${logs[@]}" | sed -n -e 's/^skipped: \([^ ]*\) (\(.*\))$/\1|\2/p' -e 's/^skipped (\(.*\)): \([0-9]*\) tests*$/(\1)|\2 tests/p')
  while read -r key; do
    case "$key" in ''|'('*) continue ;; esac # a folded line may be absent (a filter, no such test)
    grep -qxF -- "[${key%%/*}] ${key#*/}" "${logs[@]}" || continue # not run in these logs
    if ! grep -qF -- "skipped: $key (" "${logs[@]}"; then # (not cat | grep -q: under pipefail cat's SIGPIPE fails it)
      rows+=("expected skip ran ($part)|$key|update dev/gpu_expected_skips.txt"); skip_mismatch=1
    fi
  done <<< "$expected"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)

start=$(date +%s)
# the MoE tests' vectors are not in the repository (the tree that travels to the GPU machine must stay
# under 64 MiB): written here by dev/ref_moe.py (float64 on the CPU, beside the build)
moe_vectors_pid=""
if [ ! -f dev/data/moe_vectors/mixtral_tiny.bin ]; then
  python3 dev/ref_moe.py >"$OUT/ref_moe.log" 2>&1 &
  moe_vectors_pid=$!
fi
if make -j"$(nproc)" GPU_ARCH=90 all >"$OUT/build.log" 2>&1; then
  rows+=("build (sm_90)|ok|$(( $(date +%s) - start )) s")
else
  tail -30 "$OUT/build.log"; rows+=("build (sm_90)|FAILED|see build.log")
  print_rows; exit 1
fi

run_single=0; run_multi=0; run_jobs=0
case "$what" in
  all) run_single=1; run_multi=1; run_jobs=1 ;;
  tests) run_single=1; run_multi=1 ;;
  single) run_single=1 ;;
  multi) run_multi=1 ;;
  jobs) run_jobs=1 ;;
  *) echo "dev/gpu_check.sh: unknown part '$what' (all, tests, single, multi, jobs)"; exit 2 ;;
esac

if [ -n "$moe_vectors_pid" ]; then
  if wait "$moe_vectors_pid"; then rows+=("MoE vectors (dev/ref_moe.py)|written|")
  else rows+=("MoE vectors (dev/ref_moe.py)|FAILED|see ref_moe.log"); fi
fi
if [ $run_single = 1 ]; then
  start=$(date +%s)
  shards=$(( ngpu > 1 ? ngpu : 1 ))
  for ((k = 0; k < shards; k++)); do
    CUDA_VISIBLE_DEVICES=$k MT_TEST_SHARD=$k/$shards MT_TEST_STRICT=1 timeout 500 ./test_megatron > "$OUT/test_shard$k.log" 2>&1 &
  done
  wait
  cat "$OUT"/test_shard*.log > "$OUT/test.log"
  grep -hE "^failed|FAIL" "$OUT"/test_shard*.log | head -20
  total=$(for ((k = 0; k < shards; k++)); do tail -n1 "$OUT/test_shard$k.log"; done |
    awk '/passed,.*failed,.*skipped/ { p += $1; f += $3; s += $5; n++ }
         END { printf "%d passed, %d failed, %d skipped", p, f, s; if (n < '"$shards"') printf " (%d of '"$shards"' shards ended)", n }')
  rows+=("test_megatron ($shards shards)|$total|$(( $(date +%s) - start )) s")
  check_skips single $(for ((k = 0; k < shards; k++)); do echo "$OUT/test_shard$k.log"; done)
fi
# multi-GPU tests: over 2 and (with 4 GPUs) 4 ranks, each against one GPU (NPS: the rank counts to
# run, default "2 4"; GROUPS_MULTI: the feature groups, default all; MULTI_TIMEOUT: seconds a group
# may take, default 240)
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0"
if [ $run_multi = 1 ] && [ "$ngpu" -gt 1 ] && command -v mpirun >/dev/null; then
  for np in ${NPS:-2 4}; do
    [ "$ngpu" -ge "$np" ] || continue
    # one mpirun per feature, each cut at MULTI_TIMEOUT s (a hang must not eat the session's GPU time)
    for g in ${GROUPS_MULTI:-data_parallel expert_parallel context_parallel tensor_parallel pipeline memory checkpoint_tool recompute faults cp_attention}; do
      start=$(date +%s)
      rm -f /tmp/mt_test_rank*.log
      timeout "${MULTI_TIMEOUT:-240}" $MPIRUN -x MT_TEST_STRICT=1 -np "$np" ./test_megatron multigpu.$g > "$OUT/test_mpi${np}_$g.log" 2>&1
      grep -E "FAIL|^failed" "$OUT/test_mpi${np}_$g.log" | head -5
      for f in /tmp/mt_test_rank*.log; do # the other ranks' output
        [ -f "$f" ] || continue
        r=$(basename "$f" .log); cp "$f" "$OUT/test_mpi${np}_${g}_${r#mt_test_}.log"
        grep -B1 -A2 -E "FAIL" "$f" | grep -v "FAIL on another rank" | sed "s/^/  ${r#mt_test_}: /" | head -8
      done
      rows+=("multigpu.$g (mpirun -np $np)|$(tail -n1 "$OUT/test_mpi${np}_$g.log")|$(( $(date +%s) - start )) s")
      check_skips "np$np" "$OUT/test_mpi${np}_$g.log"
    done
  done
fi

if [ $run_jobs = 1 ]; then
  rm -rf checkpoints/builtin
  start=$(date +%s)
  ./train_gpt > "$OUT/train_builtin.log" 2>&1
  last=$(grep "elapsed time per iteration" "$OUT/train_builtin.log" | tail -n1)
  val=$(grep -E "validation loss at iteration [0-9]+( on validation set)? \|" "$OUT/train_builtin.log" | tail -n1 | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
  ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  tf=$(echo "$last" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
  loss=$(echo "$last" | sed 's/.*lm loss: \([^ ]*\).*/\1/')
  rows+=("train_gpt (built-in job)|loss $loss val $val|${ms} ms/iter ${tf} TFLOP/s $(( $(date +%s) - start )) s")
  # Megatron-LM's launch scripts, shrunk, on one GPU (issue #21): every flag implemented or refused
  timeout 400 python3 dev/megatron_scripts_check.py > "$OUT/megatron_scripts.log" 2>&1
  grep -A8 "FAILED" "$OUT/megatron_scripts.log" | head -20
  rows+=("Megatron's scripts, shrunk|$(tail -n1 "$OUT/megatron_scripts.log")|dev/megatron_scripts_check.py")
  # the same job data-parallel: the same global batch of 32, split over the ranks
  if [ "$ngpu" -gt 1 ] && command -v mpirun >/dev/null; then
    np=$ngpu; [ "$np" -gt 4 ] && np=4
    rm -rf checkpoints/builtin_dp
    start=$(date +%s)
    timeout 120 $MPIRUN -np "$np" ./train_gpt --micro-batch-size $((32 / np)) --use-distributed-optimizer \
      --overlap-grad-reduce --overlap-param-gather --save checkpoints/builtin_dp > "$OUT/train_builtin_dp.log" 2>&1
    last=$(grep "elapsed time per iteration" "$OUT/train_builtin_dp.log" | tail -n1)
    val=$(grep -E "validation loss at iteration [0-9]+( on validation set)? \|" "$OUT/train_builtin_dp.log" | tail -n1 | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
    ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    loss=$(echo "$last" | sed 's/.*lm loss: \([^ ]*\).*/\1/')
    rows+=("train_gpt built-in, $np GPUs DP|loss $loss val $val|${ms} ms/iter $(( $(date +%s) - start )) s")
    # tensor parallel over 2 GPUs (the built-in model has 6 heads: TP=2), with sequence parallelism
    rm -rf checkpoints/builtin_tp
    start=$(date +%s)
    timeout 120 $MPIRUN -np 2 ./train_gpt --tensor-model-parallel-size 2 --sequence-parallel \
      --save checkpoints/builtin_tp > "$OUT/train_builtin_tp.log" 2>&1
    last=$(grep "elapsed time per iteration" "$OUT/train_builtin_tp.log" | tail -n1)
    val=$(grep -E "validation loss at iteration [0-9]+( on validation set)? \|" "$OUT/train_builtin_tp.log" | tail -n1 | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
    ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    loss=$(echo "$last" | sed 's/.*lm loss: \([^ ]*\).*/\1/')
    rows+=("train_gpt built-in, TP=2 + SP|loss $loss val $val|${ms} ms/iter $(( $(date +%s) - start )) s")
    # pipeline parallel over 2 GPUs against one, 4 micro-batches a step (dev/pp_check.sh has more layouts)
    for pp in 1 2; do
      rm -rf checkpoints/builtin_pp$pp
      start=$(date +%s)
      timeout 120 $MPIRUN -np $pp ./train_gpt --pipeline-model-parallel-size $pp --micro-batch-size 8 \
        --sample-tokens 0 --save checkpoints/builtin_pp$pp 2>&1 | tee "$OUT/train_builtin_pp$pp.log" > /dev/null
      last=$(grep "elapsed time per iteration" "$OUT/train_builtin_pp$pp.log" | tail -n1)
      val=$(grep -E "validation loss at iteration [0-9]+( on validation set)? \|" "$OUT/train_builtin_pp$pp.log" | tail -n1 | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
      ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
      loss=$(echo "$last" | sed 's/.*lm loss: \([^ ]*\).*/\1/')
      rows+=("train_gpt built-in mbs 8, PP=$pp|loss $loss val $val|${ms} ms/iter $(( $(date +%s) - start )) s")
    done
    # a rank frozen mid-run: the watchdog ends the job with one line (--distributed-timeout-minutes)
    timeout 300 bash dev/timeout_check.sh > "$OUT/timeout_check.log" 2>&1
    rows+=("dead-rank watchdog (2 GPUs)|$(tail -n1 "$OUT/timeout_check.log")|dev/timeout_check.sh")
  fi
fi

echo
echo "==== summary ($(head -n1 "$OUT/gpu.txt")) ===="
print_rows
[ $skip_mismatch = 0 ] || { echo "skips differ from dev/gpu_expected_skips.txt (rows above)"; exit 1; }
