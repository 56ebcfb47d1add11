#!/usr/bin/env bash
# dev/bitwise_jobs.sh — short training jobs whose losses and final checkpoints prove that a change
# left the numbers bitwise alone: run it before and after (same GPU kind), compare the two tables.
# Each job prints every step's loss (log interval 1) and ends with a checkpoint; the md5 of the
# checkpoint (fp32 master weights, Adam moments, scheduler, data position) is bitwise state.
# Job B runs twice to show the table itself is repeatable.   Usage: dev/bitwise_jobs.sh (after make)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mt_bitwise}
mkdir -p "$OUT"
short="--train-iters 40 --log-interval 1 --eval-interval 20 --eval-iters 2 --sample-tokens 0"
llama="--num-layers 4 --hidden-size 512 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
  --untie-embeddings-and-output-weights"
declare -a names=(builtin gpt_accum gpt_accum_again llama_accum gpt_fp16)
declare -a flags=(
  ""
  "$short --micro-batch-size 8 --global-batch-size 32"
  "$short --micro-batch-size 8 --global-batch-size 32"
  "$short $llama --micro-batch-size 4 --global-batch-size 16"
  "$short --fp16 --micro-batch-size 16 --global-batch-size 32"
)
printf '%-18s %-34s %s\n' job "checkpoint md5 (all files)" "last loss line" > "$OUT/bitwise.txt"
for i in "${!names[@]}"; do
  n=${names[$i]}
  rm -rf "checkpoints/bw_$n"
  ./train_gpt ${flags[$i]} --save "checkpoints/bw_$n" > "$OUT/bw_$n.log" 2>&1 || echo "job $n FAILED (exit $?)"
  # manifest.txt left out: it only lists the other files' checksums (tables from before it stay comparable)
  sum=$(find "checkpoints/bw_$n" -type f ! -name manifest.txt | sort | xargs cat 2>/dev/null | md5sum | cut -c1-32)
  grep -o "lm loss: [0-9.E+-]*" "$OUT/bw_$n.log" | md5sum | cut -c1-12 > "$OUT/bw_$n.losses_md5"
  printf '%-18s %-34s losses md5 %s, %s\n' "$n" "$sum" "$(cat "$OUT/bw_$n.losses_md5")" \
    "$(grep -o 'lm loss: [0-9.E+-]*' "$OUT/bw_$n.log" | tail -n1)" >> "$OUT/bitwise.txt"
done
cat "$OUT/bitwise.txt"
