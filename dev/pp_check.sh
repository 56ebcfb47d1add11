#!/usr/bin/env bash
# dev/pp_check.sh — pipeline parallelism on the GPUs this machine has (2 or 4): the multi-GPU pipeline
# tests (against PP = 1; SKIP_TESTS=1 leaves them out), the built-in job at PP = 1, PP = 2 and
# PP = 2 x VP = 3 (6 layers, one per chunk) with 4 micro-batches a step (SKIP_JOBS=1 leaves them out), and the pipeline bubble
# against (P-1)/(V M): PP = 2 at M = 2..16; with 4 GPUs also PP = 4 at M = 4..16; and PP = 2 with
# VP = 1 and VP = 2 on one model at M = 4..16. Ends with a table of losses and speed. Run after make.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mt_pp_check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0"
declare -a rows
if [ "$ngpu" -ge 2 ] && [ -z "${SKIP_TESTS:-}" ]; then
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
[ -z "${SKIP_JOBS:-}" ] && run pp1 1
if [ "$ngpu" -ge 2 ] && [ -z "${SKIP_JOBS:-}" ]; then
  run pp2 2 --pipeline-model-parallel-size 2
  run pp2_vp3 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3
  ls -d checkpoints/pp_pp2/iter_*/mp_rank_* | head -5
fi
# the pipeline bubble: with the work split over P stages an iteration ideally takes t(PP=1) / P; the
# 1F1B schedule adds (P-1)/(V*M) of that (Narayanan et al.; V model chunks per rank, interleaved).
# Measured: t(PP=P) / (t(PP=1) / P) - 1, on models whose stages do equal work, so the figure also
# holds the transfers and any imbalance left. (The built-in model is no test of it: its output layer,
# on the last stage alone, does most of the work.)
ms_of() { grep "elapsed time per iteration" "$1" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/'; }
bubble_row() { # model tag, P stages on P GPUs, V chunks per rank, M micro-batches a step, the model's flags, the split's
  local tag=$1 P=$2 V=$3 m=$4 model=$5 split=$6 t1 tp bub vp_flag=""
  # BUBBLE_ROWS (e.g. "h4096:8 h2048_10:4"): only these model:M rows
  if [ -n "${BUBBLE_ROWS:-}" ] && [[ " $BUBBLE_ROWS " != *" $tag:$m "* ]]; then return; fi
  local b="$model --micro-batch-size 4 --global-batch-size $((4 * m)) --sample-tokens 0 --train-iters 20 --lr-warmup-iters 2 --eval-iters 0 --log-interval 10"
  local one="$OUT/bubble_${tag}_pp1_$m.log" many="$OUT/bubble_${tag}_pp${P}_vp${V}_$m.log"
  [ -f "$one" ] || ./train_gpt $b > "$one" 2>&1 # PP = 1 once per model and M
  [ "$V" -gt 1 ] && vp_flag="--num-virtual-stages-per-pipeline-rank $V"
  timeout 120 $MPIRUN -np "$P" ./train_gpt $b --pipeline-model-parallel-size "$P" $vp_flag $split > "$many" 2>&1
  t1=$(ms_of "$one")
  tp=$(ms_of "$many")
  [ -n "$t1" ] || tail -3 "$one"
  [ -n "$tp" ] || tail -3 "$many"
  bub=$(awk -v a="$t1" -v b="$tp" -v p="$P" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / (a / p) - 1; else print "-" }')
  local name="PP=$P"; [ "$V" -gt 1 ] && name="PP=$P x VP=$V"
  rows+=("bubble $name ($tag), M=$m|measured $bub, (P-1)/(VM) $(awk -v m="$m" -v p="$P" -v v="$V" 'BEGIN { printf "%.3f", (p - 1) / (v * m) }')|PP=1 ${t1} ms, $name ${tp} ms")
}
h2048="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 256"
h2048_10="--num-layers 10 --hidden-size 2048 --num-attention-heads 16 --seq-length 256"
# hidden 4096: the output layer (2 h V = 412M FLOPs a token) weighs one layer (24 h^2 + 4 s h = 407M),
# so --account-for-loss-in-pipeline-split balances 7 layers: PP = 2 gets 4 | 3 + output, VP = 2 gets
# 2 | 2 | 2 | 1 + output
h4096="--num-layers 7 --hidden-size 4096 --num-attention-heads 32 --seq-length 256"
if [ "$ngpu" -ge 2 ]; then
  # two stages: 8 layers, the last stage 3 and the output layer (about 5 layers' worth each)
  for m in 2 4 8 16; do bubble_row h2048 2 1 "$m" "$h2048" "--decoder-last-pipeline-num-layers 3"; done
  for m in 4 8 16; do
    bubble_row h4096 2 1 "$m" "$h4096" "--account-for-loss-in-pipeline-split"
    bubble_row h4096 2 2 "$m" "$h4096" "--account-for-loss-in-pipeline-split"
  done
fi
# four stages: 10 layers, the last stage 1 and the output layer (about 3 each)
if [ "$ngpu" -ge 4 ]; then
  for m in 4 8 16; do bubble_row h2048_10 4 1 "$m" "$h2048_10" "--decoder-last-pipeline-num-layers 1"; done
fi
echo "==== pipeline check ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $ngpu GPUs) ===="
printf '%s\n' "${rows[@]}" | awk -F'|' '{ printf "%-44s %-44s %s\n", $1, $2, $3 }'
