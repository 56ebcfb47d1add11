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
# the pipeline bubble: with the work split over P stages an iteration ideally takes t(PP=1) / P; the
# 1F1B schedule adds (P-1)/(V*M) of that (Narayanan et al.). Measured: t(PP=P) / (t(PP=1) / P) - 1,
# on models whose stages do equal work (the output layer is worth about 2 layers of hidden 2048, so
# the last stage gets fewer layers). (The built-in model is no test of it: its output layer, on the
# last stage alone, does most of the work.)
ms_of() { grep "elapsed time per iteration" "$1" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/'; }
bubble_row() { # P stages on P GPUs, M micro-batches a step, the model's flags, the last stage's layers
  local P=$1 m=$2 model=$3 last=$4 t1 tp bub
  local b="$model --micro-batch-size 4 --global-batch-size $((4 * m)) --sample-tokens 0 --train-iters 40 --eval-iters 0 --log-interval 20"
  ./train_gpt $b > "$OUT/bubble${P}_pp1_$m.log" 2>&1
  timeout 120 $MPIRUN -np "$P" ./train_gpt $b --pipeline-model-parallel-size "$P" --decoder-last-pipeline-num-layers "$last" \
    > "$OUT/bubble${P}_pp${P}_$m.log" 2>&1
  t1=$(ms_of "$OUT/bubble${P}_pp1_$m.log")
  tp=$(ms_of "$OUT/bubble${P}_pp${P}_$m.log")
  [ -n "$tp" ] || tail -3 "$OUT/bubble${P}_pp${P}_$m.log"
  bub=$(awk -v a="$t1" -v b="$tp" -v p="$P" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / (a / p) - 1; else print "-" }')
  rows+=("bubble PP=$P, M=$m|measured $bub, (P-1)/M $(awk -v m="$m" -v p="$P" 'BEGIN { printf "%.3f", (p - 1) / m }')|PP=1 ${t1} ms, PP=$P ${tp} ms")
}
# two stages: 8 layers, the last stage 3 and the output layer (about 5 layers' worth each)
if [ "$ngpu" -ge 2 ]; then
  for m in 2 4 8 16; do bubble_row 2 "$m" "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 256" 3; done
fi
# four stages (4 GPUs; not yet run): 10 layers, the last stage 1 and the output layer (about 3 each)
if [ "$ngpu" -ge 4 ]; then
  for m in 4 8 16; do bubble_row 4 "$m" "--num-layers 10 --hidden-size 2048 --num-attention-heads 16 --seq-length 256" 1; done
fi
echo "==== pipeline check ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $ngpu GPUs) ===="
printf '%s\n' "${rows[@]}" | awk -F'|' '{ printf "%-44s %-44s %s\n", $1, $2, $3 }'
