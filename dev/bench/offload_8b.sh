#!/usr/bin/env bash
# dev/bench/offload_8b.sh — the largest Llama-shaped model on one GPU (issue #20's last goal: at least
# 6B parameters at sequence 4096): Llama-3-8B's shape (32 layers, hidden 4096, 32 heads in 8 groups,
# SwiGLU 14336, RoPE base 500000, untied, vocab 128256: 8.03B parameters) in bf16 with full
# recompute (uniform, 1 layer) and the whole optimizer offloaded (--optimizer-cpu-offload: master
# weights and Adam moments, 12 bytes a parameter, in pinned host memory: about 90 GiB). The plan
# (train_gpt --plan, no GPU) says what the GPU holds: bf16 parameters 15 GiB, fp32 gradients 30 GiB,
# one micro-batch's activations 3 GiB, about 49 GiB in all.
#
# Prints the plan, then trains ITERS (6) steps of micro-batch 1 x 4096 tokens, global batch GBS (8),
# on --mock-data, and ends with a table row: parameters, ms per iteration, tokens/s, Megatron's
# TFLOP/s/GPU (train_gpt's log line counts the recomputed forward as Megatron does) and the memory
# the device reported after the first iterations. Needs about 100 GiB of host memory.
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/bench/offload_8b.sh        Environment: ITERS (6), GBS (8), LAYERS (32), OUT (/tmp/offload_8b)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/offload_8b}
ITERS=${ITERS:-6}
GBS=${GBS:-8}
LAYERS=${LAYERS:-32}
mkdir -p "$OUT"
model="--num-layers $LAYERS --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
  --num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
  --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096
  --tokenizer-type NullTokenizer --vocab-size 128256"
run="--bf16 --micro-batch-size 1 --global-batch-size $GBS --recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1 --optimizer-cpu-offload --optimizer-offload-fraction 1.0 --mock-data --train-iters $ITERS
  --log-interval 1 --log-throughput --eval-iters 0 --sample-tokens 0 --lr 1e-4 --hidden-dropout 0 --attention-dropout 0"
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1 | awk '{ printf "%.1f", $1 / 1024 }')
# shellcheck disable=SC2086
./train_gpt --plan --world-size 1 ${gib:+--gpu-memory-gib $gib} $model $run 2>&1 | tee "$OUT/plan.log" | tail -n 13
free -g | head -n 2
start=$(date +%s)
# shellcheck disable=SC2086
./train_gpt $model $run > "$OUT/train.log" 2>&1
rc=$?
tail -n 4 "$OUT/train.log"
[ $rc -eq 0 ] || { echo "offload_8b: train_gpt exited $rc (see $OUT/train.log)"; exit 1; }
params=$(grep -o "[0-9]* parameters on this GPU" "$OUT/plan.log" | head -n1 | cut -d' ' -f1)
# the last iteration's line (the first ones include the pinned allocation's warm-up)
last=$(grep "elapsed time per iteration" "$OUT/train.log" | tail -n1)
ms=$(echo "$last" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
tf=$(echo "$last" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
mem=$(grep -m1 "memory after" "$OUT/train.log" | sed 's/^ *//')
tps=$(awk -v ms="$ms" -v gbs="$GBS" 'BEGIN { if (ms > 0) printf "%.0f", gbs * 4096 / (ms / 1000) }')
echo
echo "| model | parameters | ms/iter | tokens/s | TFLOP/s/GPU | wall |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
echo "| Llama-3-8B shape, seq 4096, full recompute, optimizer offloaded | $params | $ms | $tps | $tf | $(( $(date +%s) - start )) s |"
echo "$mem"
