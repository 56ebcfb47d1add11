#!/usr/bin/env bash
# dev/bitwise_jobs.sh — short training jobs whose log lines and final checkpoints prove that a change
# left the numbers bitwise alone: run it with the binary before and after the change (same GPU kind),
# then compare the two tables (or `diff -r` the two output folders' .lines files).
#   dev/bitwise_jobs.sh [TRAIN_GPT [OUT]]     defaults: ./train_gpt, /tmp/mt_bitwise
# Each job logs every step (log interval 1) and ends with a checkpoint. A job's row holds the md5 of
# its checkpoint files (fp32 master weights, Adam moments, scheduler and data position: the whole
# state, bitwise) and the md5 of its log's numbers: every iteration line and every validation/test
# line with the timestamp, the step time, throughput and MFU taken out (they are timing, not state).
# Jobs gpt_accum and llama_fp8_pp2 run twice to show the table itself is repeatable. With two or more GPUs the
# parallel jobs (TP=2 with SP, PP=2, DP=2 with the distributed optimizer and overlapped reduction)
# run under mpirun too.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-./train_gpt}
OUT=${2:-/tmp/mt_bitwise}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
short="--train-iters 30 --log-interval 1 --eval-interval 15 --eval-iters 2 --sample-tokens 0 --log-params-norm --log-num-zeros-in-grad"
llama="--num-layers 4 --hidden-size 512 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
  --untie-embeddings-and-output-weights"
# name | processes | flags
jobs=(
  "builtin|1|"
  "gpt_accum|1|$short --micro-batch-size 8 --global-batch-size 32"
  "gpt_accum_again|1|$short --micro-batch-size 8 --global-batch-size 32"
  "llama_accum|1|$short $llama --micro-batch-size 4 --global-batch-size 16"
  "gpt_fp16|1|$short --fp16 --micro-batch-size 16 --global-batch-size 32"
  "llama_fp8_delayed|1|$short $llama --bf16 --fp8-format hybrid --fp8-recipe delayed --micro-batch-size 4 --global-batch-size 16"
  "llama_fp8_blockwise|1|$short $llama --bf16 --fp8-format e4m3 --fp8-recipe blockwise --ffn-hidden-size 1536 --micro-batch-size 4 --global-batch-size 16"
  "gpt_recompute_full|1|$short --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --micro-batch-size 8 --global-batch-size 32"
  "llama_qkln_offload|1|$short $llama --qk-layernorm --use-distributed-optimizer --optimizer-cpu-offload --micro-batch-size 4 --global-batch-size 16"
  "gpt_tp2_sp|2|$short --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 8 --global-batch-size 32"
  "llama_pp2|2|$short $llama --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 16"
  "llama_fp8_pp2|2|$short $llama --bf16 --fp8-format hybrid --fp8-recipe delayed --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 16"
  "llama_fp8_pp2_again|2|$short $llama --bf16 --fp8-format hybrid --fp8-recipe delayed --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 16"
  "gpt_dp2_distopt|2|$short --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --micro-batch-size 8 --global-batch-size 32"
)
printf '%-20s %-34s %-14s %s\n' job "checkpoint md5 (all files)" "log md5" "last loss line" > "$OUT/bitwise.txt"
for row in "${jobs[@]}"; do
  IFS='|' read -r n np flags <<< "$row"
  if [ "$np" -gt "$ngpu" ]; then printf '%-20s skipped: needs %s GPUs\n' "$n" "$np" >> "$OUT/bitwise.txt"; continue; fi
  rm -rf "checkpoints/bw_$n"
  if [ "$np" = 1 ]; then
    timeout 300 $BIN $flags --save "checkpoints/bw_$n" > "$OUT/bw_$n.log" 2>&1 || echo "job $n FAILED (exit $?)" | tee -a "$OUT/bitwise.txt"
  else
    timeout 300 $MPIRUN -np "$np" $BIN $flags --save "checkpoints/bw_$n" > "$OUT/bw_$n.log" 2>&1 || echo "job $n FAILED (exit $?)" | tee -a "$OUT/bitwise.txt"
  fi
  # manifest.txt left out: it only lists the other files' checksums
  sum=$(find "checkpoints/bw_$n" -type f ! -name manifest.txt | sort | xargs cat 2>/dev/null | md5sum | cut -c1-32)
  grep -E ' iteration +[0-9]+/|validation loss|test loss' "$OUT/bw_$n.log" \
    | sed -E -e 's/^ *\[[^]]*\]//' -e 's/elapsed time per iteration \(ms\): [0-9.]+ \|//' \
             -e 's/throughput per GPU \(TFLOP\/s\/GPU\): [0-9.]+ \|//' -e 's/MFU: [0-9.]+% \|//' > "$OUT/bw_$n.lines"
  printf '%-20s %-34s %-14s %s (%s lines)\n' "$n" "$sum" "$(md5sum < "$OUT/bw_$n.lines" | cut -c1-12)" \
    "$(grep -o 'lm loss: [0-9.E+-]*' "$OUT/bw_$n.log" | tail -n1)" "$(wc -l < "$OUT/bw_$n.lines")" >> "$OUT/bitwise.txt"
  rm -rf "checkpoints/bw_$n"
done
cat "$OUT/bitwise.txt"
