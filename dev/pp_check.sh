#!/usr/bin/env bash
# dev/pp_check.sh — pipeline parallelism on the GPUs this machine has (2 or 4): the multi-GPU pipeline
# tests (against PP = 1), the built-in job at PP = 1, PP = 2 and PP = 2 x VP = 3 (6 layers, one per
# chunk) with 4 micro-batches a step, the pipeline bubble at M = 2..16 against (P-1)/M (PP = 2; with
# 4 GPUs also PP = 4 at M = 4..16; the PP = 4 rows not yet run), and a table of their losses and
# speed. Run after make.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mt_pp_check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0"
declare -a rows
if [ "$ngpu" -ge 2 ]; then
  np=2; [ "$ngpu" -ge 4 ] && np=4
  timeout 240 $MPIRUN -np $np ./test_megatron multigpu.pipeline 2>&1 | tee "$OUT/test_pp.log" | grep -v "^\[" 
  rows+=("test_megatron multigpu.pipeline (np $np)|$(tail -n1 "$OUT/test_pp.log")|")
fi
job="--micro-batch-size 8 --sample-tokens 0"
run() { # name, processes, flags
  local name=$1 np=$2; shift 2
  rm -rf "checkpoints/pp_$name"
  if [ "$np" -gt 1 ]; then timeout 120 $MPIRUN -np "$np" ./train_gpt $job "$@" --save "checkpoints/pp_$name" > "$OUT/$name.log" 2>&1
  else ./train_gpt $job "$@" --save "checkpoints/pp_$name" > "$OUT/$name.log" 2>&1; fi
  local last=$(grep "elapsed time per iteration" "$OUT/$name.log" | tail -n1)
  local val=$(grep "validation loss" "$OUT/$name.log" | tail -n1 | sed 's/.*lm loss value: \([^ ]*\).*/\1/')
  local ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  local loss=$(echo "$last" | sed 's/.*lm loss: \([^ ]*\).*/\1/')
  rows+=("train_gpt built-in, $name|loss $loss val $val|${ms} ms/iter")
  [ -n "$last" ] || tail -5 "$OUT/$name.log"
}
run pp1 1
if [ "$ngpu" -ge 2 ]; then
  run pp2 2 --pipeline-model-parallel-size 2
  run pp2_vp3 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3
  ls -d checkpoints/pp_pp2/iter_*/mp_rank_* | head -5
fi
# the pipeline bubble, on a model whose two stages do equal work (8 layers of hidden 2048; the last
# stage gets 3 layers and the output layer, about 5 layers' worth): with the work split over P stages
# an iteration ideally takes t(PP=1) / P; the 1F1B schedule adds (P-1)/(V*M) of that (Narayanan et
# al.). Measured: t(PP=P) / (t(PP=1) / P) - 1. (The built-in model is no test of it: its output
# layer, on the last stage alone, does most of the work.)
if [ "$ngpu" -ge 2 ]; then
  model="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 256"
  for m in 2 4 8 16; do
    b="$model --micro-batch-size 4 --global-batch-size $((4 * m)) --sample-tokens 0 --train-iters 40 --eval-iters 0 --log-interval 20"
    ./train_gpt $b > "$OUT/bubble1_$m.log" 2>&1
    timeout 120 $MPIRUN -np 2 ./train_gpt $b --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 3 > "$OUT/bubble2_$m.log" 2>&1
    t1=$(grep "elapsed time per iteration" "$OUT/bubble1_$m.log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    t2=$(grep "elapsed time per iteration" "$OUT/bubble2_$m.log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    [ -n "$t2" ] || tail -3 "$OUT/bubble2_$m.log"
    bub=$(awk -v a="$t1" -v b="$t2" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / (a / 2) - 1; else print "-" }')
    rows+=("bubble PP=2, M=$m|measured $bub, (P-1)/M $(awk -v m=$m 'BEGIN { printf "%.3f", 1 / m }')|PP=1 ${t1} ms, PP=2 ${t2} ms")
  done
fi
# four stages (4 GPUs): 10 layers, the last stage 1 layer and the output layer (about 3 layers'
# worth, as 3 on each other stage): t(PP=4) / (t(PP=1) / 4) - 1 against (P-1)/M = 3/M
if [ "$ngpu" -ge 4 ]; then
  model="--num-layers 10 --hidden-size 2048 --num-attention-heads 16 --seq-length 256"
  for m in 4 8 16; do
    b="$model --micro-batch-size 4 --global-batch-size $((4 * m)) --sample-tokens 0 --train-iters 40 --eval-iters 0 --log-interval 20"
    ./train_gpt $b > "$OUT/bubble4_1_$m.log" 2>&1
    timeout 120 $MPIRUN -np 4 ./train_gpt $b --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 1 > "$OUT/bubble4_4_$m.log" 2>&1
    t1=$(grep "elapsed time per iteration" "$OUT/bubble4_1_$m.log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    t4=$(grep "elapsed time per iteration" "$OUT/bubble4_4_$m.log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    [ -n "$t4" ] || tail -3 "$OUT/bubble4_4_$m.log"
    bub=$(awk -v a="$t1" -v b="$t4" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / (a / 4) - 1; else print "-" }')
    rows+=("bubble PP=4, M=$m|measured $bub, (P-1)/M $(awk -v m=$m 'BEGIN { printf "%.3f", 3 / m }')|PP=1 ${t1} ms, PP=4 ${t4} ms")
  done
fi
echo "==== pipeline check ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $ngpu GPUs) ===="
printf '%s\n' "${rows[@]}" | awk -F'|' '{ printf "%-44s %-44s %s\n", $1, $2, $3 }'
