#!/usr/bin/env bash
# dev/bench/dp_scaling.sh — data-parallel scaling of train_gpt: GPT-2 124M and the GPT-2 1.5B shape
# (48 layers, 1600 hidden, 25 heads), T=1024, bf16, on 1, 2 and 4 GPUs of one node, with the
# distributed optimizer, gradient reduce-scatter / parameter all-gather overlapped and not.
#
# Weak scaling, as data parallelism is used: every GPU runs the same micro-batch (MBS) and the same
# number of micro-batches per step (ACCUM), so the global batch grows with the GPU count. Efficiency
# = tokens/s per GPU at N GPUs / tokens/s at 1 GPU. Data: --mock-data (random tokens), so nothing
# but the binary is needed.
#
# Run from the repository root on a multi-GPU machine after `make train_gpt`:
#   dev/bench/dp_scaling.sh [models...]     models: 124m 1.5b (default both)
# Environment: ITERS (20), GPUS ("1 2 4", those present), OUT (/tmp/dp_scaling), OVERLAP ("off on":
# which of the two to run), BIN (./train_gpt: the binary, to compare two builds), INDEPENDENT (1: also
# run, for each N > 1, N one-GPU jobs at once, one a GPU, no communication: the slowest of them is
# what data parallelism could reach on these GPUs and this host, its row names that one's time).
# Timing: train_gpt's own log line (Megatron's elapsed time per iteration, averaged over the last
# log interval: iterations ITERS/2+1 .. ITERS, after the warm-up half).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/dp_scaling}
ITERS=${ITERS:-20}
mkdir -p "$OUT"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
GPUS=${GPUS:-"1 2 4"}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(124m 1.5b)
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0"
BIN=${BIN:-./train_gpt}
# the job every run shares, at global batch $1 (MBS and ITERS from above)
job_flags() {
  echo "--seq-length 1024 --max-position-embeddings 1024 --mock-data --hidden-dropout 0 --attention-dropout 0" \
    "--log-throughput --tokenizer-type NullTokenizer --vocab-size 50257 --bf16 --micro-batch-size $MBS" \
    "--global-batch-size $1 --train-iters $ITERS --log-interval $((ITERS / 2)) --lr 1e-4 --min-lr 1e-5" \
    "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --eval-iters 0 --sample-tokens 0"
}
ms_of() { grep "elapsed time per iteration" "$1" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/'; }

table="$OUT/dp_scaling.md"
{
  echo "| model | GPUs | overlap | global batch | ms/iter | tokens/s/GPU | TFLOP/s/GPU | MFU | scaling efficiency |"
  echo "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
} >"$table"

for model in "${models[@]}"; do
  case "$model" in
    124m) shape="--num-layers 12 --hidden-size 768 --num-attention-heads 12"; MBS=16; ACCUM=2 ;;
    1.5b) shape="--num-layers 48 --hidden-size 1600 --num-attention-heads 25"; MBS=8; ACCUM=2 ;;
    *) echo "dp_scaling: unknown model $model (124m or 1.5b)" >&2; exit 2 ;;
  esac
  base=""
  for n in $GPUS; do
    [ "$n" -le "$ngpu" ] || continue
    for overlap in ${OVERLAP:-off on}; do
      flags="--use-distributed-optimizer"
      [ "$overlap" = on ] && flags="$flags --overlap-grad-reduce --overlap-param-gather"
      gbs=$((MBS * ACCUM * n))
      log="$OUT/${model}_${n}gpu_overlap_${overlap}.log"
      launch=""
      [ "$n" -gt 1 ] && launch="$MPIRUN -np $n"
      timeout 600 $launch $BIN $shape $(job_flags "$gbs") $flags >"$log" 2>&1
      line=$(grep "elapsed time per iteration" "$log" | tail -n1)
      if [ -z "$line" ]; then
        echo "| $model | $n | $overlap | $gbs | FAILED (see $log) | | | | |" >>"$table"
        tail -5 "$log"
        continue
      fi
      ms=$(echo "$line" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
      tf=$(echo "$line" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
      mfu=$(echo "$line" | sed 's/.*MFU: \([^ ]*\).*/\1/')
      tps=$(awk -v g="$gbs" -v n="$n" -v ms="$ms" 'BEGIN { printf "%.0f", g * 1024 / n / (ms / 1000) }')
      key="${model}_${overlap}"
      [ "$n" = 1 ] && eval "base_$overlap=$tps"
      b=$(eval echo "\${base_$overlap:-}")
      eff=$([ -n "$b" ] && awk -v t="$tps" -v b="$b" 'BEGIN { printf "%.1f%%", 100 * t / b }')
      echo "| $model | $n | $overlap | $gbs | $ms | $tps | $tf | $mfu | ${eff:-} |" >>"$table"
      echo "$key n=$n: $ms ms/iter, $tps tokens/s/GPU, $tf TFLOP/s/GPU, efficiency ${eff:-n/a}"
    done
    if [ -n "${INDEPENDENT:-}" ] && [ "$n" -gt 1 ]; then # n one-GPU jobs side by side, the slowest counts
      gbs=$((MBS * ACCUM))
      for ((k = 0; k < n; k++)); do
        CUDA_VISIBLE_DEVICES=$k timeout 600 $BIN $shape $(job_flags "$gbs") --use-distributed-optimizer \
          >"$OUT/${model}_${n}x1gpu_$k.log" 2>&1 &
      done
      wait
      ms=$(for ((k = 0; k < n; k++)); do ms_of "$OUT/${model}_${n}x1gpu_$k.log"; done | sort -g | tail -n1)
      all=$(for ((k = 0; k < n; k++)); do ms_of "$OUT/${model}_${n}x1gpu_$k.log"; done | tr '\n' ' ')
      tps=$(awk -v g="$gbs" -v ms="$ms" 'BEGIN { if (ms > 0) printf "%.0f", g * 1024 / (ms / 1000) }')
      b=${base_on:-${base_off:-}}
      eff=$([ -n "$b" ] && [ -n "$tps" ] && awk -v t="$tps" -v b="$b" 'BEGIN { printf "%.1f%%", 100 * t / b }')
      echo "| $model | $n x 1, independent (ms: $all) | - | $gbs each | $ms | $tps | | | ${eff:-} |" >>"$table"
      echo "${model} $n independent one-GPU jobs: ms/iter $all"
    fi
  done
  unset base_on base_off
done
echo
echo "==== data-parallel scaling ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1), $ngpu GPUs) ===="
cat "$table"
