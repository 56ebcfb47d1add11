#!/usr/bin/env bash
# dev/bench/fp8_speed.sh — train_gpt's FP8 recipes against its bf16 on one GPU and, with TORCH=1,
# PyTorch in the same command: bf16 (torch.compile, SDPA flash, fused AdamW) and torchao's float8
# training (tensorwise, compiled; torchao from a wheel: carry .whl and install it first, see the
# device README). Mock data / random tokens; ours timed by Megatron's log line over the second half
# of ITERS (default 30) iterations, torch by CUDA events (median of ITERS after warm-up).
#   [TORCH=1] dev/bench/fp8_speed.sh [1.5b] [llama8b-layers]        (after make train_gpt)
# 1.5b: GPT-2 1.5B shape (48 x 1600, 25 heads, seq 1024, micro-batch 8; not a multiple of 128, so no
# blockwise); llama8b-layers: Llama-3-8B's layer shape (hidden 4096, ffn 14336, 32 heads in 8 groups,
# seq 4096, vocabulary 128256) with LAYERS (default 8) layers, micro-batch 1, the output layer tied to
# the embeddings on both sides (the reference PyTorch Llama ties them).
set -uo pipefail
cd "$(dirname "$0")/../.."
ITERS=${ITERS:-30}
OUT=${OUT:-/tmp/fp8_speed}
mkdir -p "$OUT"
models=("$@"); [ ${#models[@]} -eq 0 ] && models=(1.5b llama8b-layers)
printf '%-16s %-24s %10s %12s %12s %14s %8s\n' model recipe ms/iter tokens/s TFLOP/s/GPU "GiB in use" "vs bf16"
for model in "${models[@]}"; do
  case "$model" in
    1.5b) shape="--num-layers 48 --hidden-size 1600 --num-attention-heads 25"; S=1024; V=50257; MBS=8
          tshape="--num-layers 48 --hidden-size 1600 --num-attention-heads 25 --padded-vocab-size 50304"
          recipes="bf16 delayed tensorwise" ;;
    llama8b-layers) shape="--num-layers ${LAYERS:-8} --hidden-size 4096 --num-attention-heads 32 --group-query-attention \
          --num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope \
          --rotary-base 500000 --disable-bias-linear"; S=4096; V=128256; MBS=1
          tshape="--model llama --num-layers ${LAYERS:-8} --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 \
          --ffn-hidden-size 14336 --padded-vocab-size 128256"
          recipes="bf16 delayed tensorwise blockwise" ;;
    *) echo "fp8_speed: unknown model $model" >&2; exit 2 ;;
  esac
  base=""
  for r in $recipes; do
    fp8=""; [ "$r" != bf16 ] && fp8="--fp8-format hybrid --fp8-recipe $r"
    [ "$r" = delayed ] && fp8="$fp8 --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
    log="$OUT/${model}_$r.log"
    ./train_gpt $shape $fp8 --seq-length $S --max-position-embeddings $S --mock-data --hidden-dropout 0 --attention-dropout 0 --log-throughput --tokenizer-type NullTokenizer \
      --vocab-size $V --bf16 --micro-batch-size $MBS --global-batch-size $MBS --train-iters "$ITERS" \
      --log-interval $((ITERS / 2)) --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
      --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --eval-iters 0 --sample-tokens 0 >"$log" 2>&1 \
      || { printf '%-16s %-24s FAILED: %s\n' "$model" "ours $r" "$(grep -m1 -i 'error\|train_gpt:' "$log")"; continue; }
    line=$(grep "elapsed time per iteration" "$log" | tail -n1)
    ms=$(echo "$line" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    tf=$(echo "$line" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
    gib=$(grep -m1 "device reports" "$log" | sed 's/.*device reports \([^ ]*\) GiB.*/\1/')
    tok=$(awk -v ms="$ms" -v t=$((MBS * S)) 'BEGIN { printf "%.0f", t / ms * 1000 }')
    [ "$r" = bf16 ] && base=$ms
    printf '%-16s %-24s %10s %12s %12s %14s %8s\n' "$model" "ours $r" "$ms" "$tok" "$tf" "$gib" \
      "$(awk -v b="${base:-0}" -v m="$ms" 'BEGIN { if (b > 0) printf "%.2fx", b / m }')"
  done
  [ "${TORCH:-0}" = 1 ] || continue
  for f8 in none tensorwise; do
    log="$OUT/${model}_torch_$f8.log"
    python3 dev/bench/torch_speed.py $tshape --seq-length $S --mbs $MBS --iters "$ITERS" --float8 $f8 >"$log" 2>&1 \
      || { printf '%-16s %-24s FAILED: %s\n' "$model" "torch $f8" "$(tail -n1 "$log")"; continue; }
    res=$(grep '^RESULT ' "$log" | sed 's/^RESULT //')
    ms=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['ms'])" "$res")
    gib=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['device_in_use_gib'])" "$res")
    tok=$(awk -v ms="$ms" -v t=$((MBS * S)) 'BEGIN { printf "%.0f", t / ms * 1000 }')
    ours_ms=$(grep "elapsed time per iteration" "$OUT/${model}_bf16.log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    ours_tf=$(grep "elapsed time per iteration" "$OUT/${model}_bf16.log" | tail -n1 | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
    tf=$(awk -v otf="$ours_tf" -v oms="$ours_ms" -v ms="$ms" 'BEGIN { printf "%.1f", otf * oms / ms }')
    name="torch compile bf16"; [ $f8 != none ] && name="torch compile torchao $f8"
    printf '%-16s %-24s %10s %12s %12s %14s %8s\n' "$model" "$name" "$ms" "$tok" "$tf" "$gib" \
      "$(awk -v b="${base:-0}" -v m="$ms" 'BEGIN { if (b > 0) printf "%.2fx", b / m }')"
  done
done
echo "(vs bf16: our bf16 ms/iter over the row's; TFLOP/s/GPU of the torch rows in Megatron's formula from ours)"
