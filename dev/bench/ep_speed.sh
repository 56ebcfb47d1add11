#!/usr/bin/env bash
# dev/bench/ep_speed.sh — expert parallelism's cost on two GPUs (issue #34's goal: EP = 2 at >= 90% of EP = 1's
# tokens/s per GPU for Qwen3-30B-A3B's layers). The same job under mpirun -np 2, data parallel (DP = 2), once
# with the experts replicated (EP = 1) and once split over the two GPUs (EP = 2, the all-to-all dispatcher):
# Qwen3-30B-A3B's layers (hidden 2048, 32 heads, 4 query groups, kv 128, qk-layernorm, 128 experts of ffn 768,
# top-8, vocab 151936), LAYERS (4) of them, seq 4096, micro-batch 1, two micro-batches per rank (global batch
# 4), bf16, mock data, ITERS (20) iterations, timing from train_gpt's log line over the second half.
# Prints one row per EP: ms/iter, tokens/s per GPU, TFLOP/s/GPU (Megatron's formula with MoE), device memory.
#   dev/bench/ep_speed.sh            (OUT: /tmp/ep_speed)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ep_speed}; ITERS=${ITERS:-20}; L=${LAYERS:-4}
mkdir -p "$OUT"
S=4096; V=151936; GBS=4
shape="--num-layers $L --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 4 \
  --kv-channels 128 --qk-layernorm --ffn-hidden-size 6144 --swiglu --normalization RMSNorm \
  --position-embedding-type rope --rotary-base 1000000 --disable-bias-linear --untie-embeddings-and-output-weights \
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-router-load-balancing-type aux_loss \
  --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-dtype fp32"
echo "| EP | ms/iter | tokens/s per GPU | TFLOP/s/GPU | device memory (GiB) |"
echo "| ---: | ---: | ---: | ---: | ---: |"
for ep in 1 2; do
  log="$OUT/ep$ep.log"
  # shellcheck disable=SC2086
  mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np 2 ./train_gpt $shape --expert-model-parallel-size $ep \
    --seq-length $S --max-position-embeddings $S --mock-data --hidden-dropout 0 --attention-dropout 0 --log-throughput \
    --tokenizer-type NullTokenizer --vocab-size $V --bf16 --micro-batch-size 1 --global-batch-size $GBS \
    --train-iters "$ITERS" --log-interval $((ITERS / 2)) --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --eval-iters 0 --sample-tokens 0 \
    --use-distributed-optimizer >"$log" 2>&1 || { echo "| $ep | FAILED (see $log) | | | |"; tail -5 "$log"; continue; }
  ms=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  tf=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
  gib=$(grep "device reports" "$log" | head -n1 | sed 's/.*device reports \([^ ]*\) GiB.*/\1/')
  tps=$(python3 -c "print(f'{$GBS * $S / 2 / ($ms / 1000):.0f}')")
  echo "| $ep | $ms | $tps | $tf | $gib |"
done
