#!/usr/bin/env bash
# dev/memory_check.sh — the memory plan against what the device reports after a few training steps,
# on one GPU: every setting below trains ITERS (5) steps of train_gpt --mock-data and compares the
# plan's "in use" (allocations + the stated CUDA context / cuBLAS constants, megatron.h MT_PLAN_*) with
# what cudaMemGetInfo reports then (train_gpt's "memory after N iterations" line). The issue's bar:
# within 5%. Settings: the GPT-2 1.5B shape and the Llama-3.2-1B shape (16 x 2048, 32 heads in 8
# groups, SwiGLU 8192, RoPE, untied, seq 2048, vocab 128256), each bf16 with and without optimizer
# offload (all of it, and half), the 1.5B shape also in FP8 and fp32 (smaller micro-batch), and each
# with activation recompute: selective (layernorm and mlp), full uniform 1 and full block (half the
# layers).
# Then the recompute overhead: ms/iter of none, selective and full recompute on the 1.5B shape (and
# the Llama-1B shape), OVERHEAD_ITERS (20) steps each, timed over the last 10, against none (the
# issue's goals: selective at most 1.05x, full at most 1.36x), and the largest micro-batch (a power
# of 2) whose plan fits the device under each setting. OVERHEAD=0 skips both.
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/memory_check.sh            Environment: ITERS (5), OUT (/tmp/memory_check), TOL (5, percent),
#                                  OVERHEAD (1), OVERHEAD_ITERS (20), MEMORY (1; 0 skips the plan
#                                  against the device and runs only the overhead tables)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/memory_check}
ITERS=${ITERS:-5}
TOL=${TOL:-5}
mkdir -p "$OUT"
gpt15="--num-layers 48 --hidden-size 1600 --num-attention-heads 25 --seq-length 1024 --vocab-size 50257"
llama1b="--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
  --ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 2048 --vocab-size 128256"
sel="--recompute-granularity selective --recompute-modules layernorm mlp"
full_uniform="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
full_block="--recompute-granularity full --recompute-method block --recompute-num-layers"
common="--mock-data --hidden-dropout 0 --attention-dropout 0 --tokenizer-type NullTokenizer --train-iters $ITERS --log-interval $ITERS --lr 1e-4 \
  --eval-iters 0 --sample-tokens 0"
settings=(
  "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8"
  "gpt2-1.5b bf16 offload 1.0|$gpt15 --bf16 --micro-batch-size 8 --optimizer-cpu-offload"
  "gpt2-1.5b bf16 offload 0.5|$gpt15 --bf16 --micro-batch-size 8 --optimizer-cpu-offload --optimizer-offload-fraction 0.5"
  "gpt2-1.5b fp8 hybrid|$gpt15 --bf16 --micro-batch-size 8 --fp8-format hybrid"
  "gpt2-1.5b fp32|$gpt15 --micro-batch-size 2"
  "llama-1b bf16|$llama1b --bf16 --micro-batch-size 4"
  "llama-1b bf16 offload 1.0|$llama1b --bf16 --micro-batch-size 4 --optimizer-cpu-offload"
  "llama-1b bf16 offload 0.5|$llama1b --bf16 --micro-batch-size 4 --optimizer-cpu-offload --optimizer-offload-fraction 0.5"
  "gpt2-1.5b bf16 selective|$gpt15 --bf16 --micro-batch-size 8 $sel"
  "gpt2-1.5b bf16 full uniform 1|$gpt15 --bf16 --micro-batch-size 8 $full_uniform"
  "gpt2-1.5b bf16 full block 24|$gpt15 --bf16 --micro-batch-size 8 $full_block 24"
  "gpt2-1.5b fp32 full uniform 1|$gpt15 --micro-batch-size 2 $full_uniform"
  "llama-1b bf16 selective|$llama1b --bf16 --micro-batch-size 4 $sel"
  "llama-1b bf16 full uniform 1|$llama1b --bf16 --micro-batch-size 4 $full_uniform"
  "llama-1b bf16 full block 8 offload 1.0|$llama1b --bf16 --micro-batch-size 4 $full_block 8 --optimizer-cpu-offload"
)
fail=0
if [ "${MEMORY:-1}" != 0 ]; then
echo "| setting | plan (GiB) | device after $ITERS steps (GiB) | difference | ms/iter |"
echo "| --- | ---: | ---: | ---: | ---: |"
for s in "${settings[@]}"; do
  name=${s%%|*}; flags=${s#*|}; log="$OUT/${name// /_}.log"
  # shellcheck disable=SC2086
  if ! ./train_gpt $flags $common >"$log" 2>&1; then
    echo "| $name | failed: see $log | | | |"; fail=1; continue
  fi
  line=$(grep "memory after" "$log")
  used=$(sed 's/.*reports \([0-9.]*\) GiB.*/\1/' <<<"$line")
  plan=$(sed 's/.*the plan \([0-9.]*\) GiB.*/\1/' <<<"$line")
  diff=$(sed 's/.*GiB (\([-+0-9.]*\)%).*/\1/' <<<"$line")
  ms=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  echo "| $name | $plan | $used | $diff% | $ms |"
  awk -v d="$diff" -v t="$TOL" 'BEGIN { exit (d < -t || d > t) }' || fail=1
done
[ $fail -eq 0 ] && echo "every setting within ${TOL}%" || echo "FAIL: a setting failed or is off by more than ${TOL}%"
fi

# ---- the recompute overhead: ms/iter against none, the same shape and micro-batch ----
if [ "${OVERHEAD:-1}" != 0 ]; then
  N=${OVERHEAD_ITERS:-20}
  timed="--mock-data --tokenizer-type NullTokenizer --train-iters $N --log-interval 10 --lr 1e-4 --eval-iters 0 \
    --sample-tokens 0"
  overhead=(
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|none|"
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|selective (core_attn: flash keeps no scores)|--recompute-activations"
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|selective (act)|--recompute-activations --recompute-modules act"
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|selective (layernorm, mlp)|$sel"
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|full uniform 1|$full_uniform"
    "gpt2-1.5b bf16|$gpt15 --bf16 --micro-batch-size 8|full block 24|$full_block 24"
    "llama-1b bf16|$llama1b --bf16 --micro-batch-size 4|none|"
    "llama-1b bf16|$llama1b --bf16 --micro-batch-size 4|selective (layernorm, mlp)|$sel"
    "llama-1b bf16|$llama1b --bf16 --micro-batch-size 4|full uniform 1|$full_uniform"
  )
  echo
  echo "| shape | recompute | ms/iter (last 10 of $N) | vs none | activations planned (GiB) |"
  echo "| --- | --- | ---: | ---: | ---: |"
  base_ms=""
  for s in "${overhead[@]}"; do
    IFS='|' read -r shape flags name extra <<<"$s"
    log="$OUT/overhead_${shape// /_}_${name//[ (),:]/_}.log"
    # shellcheck disable=SC2086
    if ! ./train_gpt $flags $extra $timed >"$log" 2>&1; then
      echo "| $shape | $name | failed: see $log | | |"; fail=1; continue
    fi
    ms=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
    act=$(grep -m1 "^  activations" "$log" | awk '{print $2}')
    [ "$name" = none ] && base_ms=$ms
    ratio=$(awk -v a="$ms" -v b="$base_ms" 'BEGIN { if (b > 0) printf "%.3fx", a / b; else print "?" }')
    echo "| $shape | $name | $ms | $ratio | $act |"
  done

  # the largest micro-batch (powers of 2) whose plan fits this device: train_gpt refuses the rest at
  # startup, before allocating, so the plan decides it (--plan: no GPU work)
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | awk '{printf "%.1f", $1 / 1024}')
  echo
  echo "| shape | recompute | largest micro-batch that fits ${gib:-80} GiB (planned) |"
  echo "| --- | --- | ---: |"
  for s in "${overhead[@]}"; do
    IFS='|' read -r shape flags name extra <<<"$s"
    flags=${flags% --micro-batch-size *} # (each entry ends with its micro-batch)
    best=none
    for mbs in 1 2 4 8 16 32 64 128; do
      # shellcheck disable=SC2086
      ./train_gpt $flags $extra --micro-batch-size $mbs --plan --gpu-memory-gib "${gib:-80}" $timed >/dev/null 2>&1 || break
      best=$mbs
    done
    echo "| $shape | $name | $best |"
  done
fi
exit $fail
