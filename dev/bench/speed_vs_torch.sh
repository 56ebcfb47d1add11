#!/usr/bin/env bash
# dev/bench/speed_vs_torch.sh — single-GPU training speed of train_gpt against PyTorch on the same
# GPU in the same command: same model, same micro-batch, same sequence length, bf16.
# Models: 124m, 1.5b (GPT-2 layout, seq 1024, vocab 50257) and llama1b (the Llama-3.2-1B shape: 16 layers,
# hidden 2048, 32 heads, 8 query groups, SwiGLU ffn 8192, RMSNorm, RoPE theta 500000 with llama3 scaling
# factor 32, no biases, tied embeddings, seq 2048, vocab 128256).
# PyTorch: torch.compile, bf16 autocast, SDPA flash attention, fused AdamW (dev/bench/torch_speed.py,
# with the models of dev/bench/ref_train_gpt2.py and dev/bench/ref_llama.py).
# Ours: train_gpt --mock-data --bf16 (timing from its log line over the second half of the run).
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/bench/speed_vs_torch.sh [models...]          models: 124m 1.5b llama1b (default: 124m 1.5b)
# Environment: ITERS (30), OUT (/tmp/speed_vs_torch), PROFILE=1 to add torch's per-kernel GPU time of one
# step to $OUT/torch_<model>.log, MAX_MBS=1 to also search the largest
# micro-batch that fits (doubling; each torch attempt recompiles, so it is slow), OURS_ONLY=1 to time
# train_gpt alone (a quick check between changes; no ratio), BASELINE=path/to/another/train_gpt with
# OURS_ONLY=1 to time that binary and ./train_gpt alternately, ROUNDS (3) times each, in one table (an
# A/B on one machine: H100 instances differ by a few percent).
# Reported: tokens/s, TFLOP/s/GPU (Megatron's formula, from train_gpt's log line; the same FLOPs per
# iteration for torch), MFU (989 TFLOP/s dense bf16 on H100/H200),
# peak memory (both: what the device reports in use, context and libraries included; ours once
# everything is allocated, torch's after its timed steps, its allocator keeping what it reserved; and
# torch's allocator max reserved and max allocated), and the ratio ours / torch.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/speed_vs_torch}
ITERS=${ITERS:-30}
mkdir -p "$OUT"
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(124m 1.5b)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
peak=989

ours() { # model-flags mbs log [binary] -> "ms tflops gib" or ""; sequence length $S and vocabulary $V of the model
  local shape=$1 mbs=$2 log=$3 bin=${4:-./train_gpt}
  $bin $shape --seq-length "$S" --max-position-embeddings "$S" --mock-data --hidden-dropout 0 --attention-dropout 0 --log-throughput --tokenizer-type NullTokenizer \
    --vocab-size "$V" --bf16 --micro-batch-size "$mbs" --global-batch-size "$mbs" --train-iters "$ITERS" \
    --log-interval $((ITERS / 2)) --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --eval-iters 0 --sample-tokens 0 >"$log" 2>&1 || return 1
  local ms gib tf
  ms=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  tf=$(grep "elapsed time per iteration" "$log" | tail -n1 | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
  gib=$(grep "device reports" "$log" | sed 's/.*device reports \([^ ]*\) GiB.*/\1/')
  echo "$ms $tf $gib"
}

table="$OUT/speed_vs_torch.md"
{
  echo "| model | micro-batch | side | ms/iter | tokens/s | TFLOP/s/GPU | MFU | peak memory (GiB) | ours / torch |"
  echo "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
} >"$table"

for model in "${models[@]}"; do
  # shape: train_gpt's flags; tshape: torch_speed.py's; S: sequence length; V: vocabulary (padded to 128 by both)
  case "$model" in
    124m) L=12; H=768; N=12; MBS=16; MAXTRY="32 64 128"; S=1024; V=50257 ;;
    1.5b) L=48; H=1600; N=25; MBS=8; MAXTRY="16 32"; S=1024; V=50257 ;;
    llama1b) L=16; H=2048; N=32; MBS=4; MAXTRY="8 16"; S=2048; V=128256 ;;
    *) echo "speed_vs_torch: unknown model $model" >&2; exit 2 ;;
  esac
  shape="--num-layers $L --hidden-size $H --num-attention-heads $N"
  tshape="$shape --seq-length $S"
  if [ "$model" = llama1b ]; then
    shape="$shape --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu \
      --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling \
      --rope-scaling-factor 32 --disable-bias-linear"
    tshape="--model llama $tshape --num-query-groups 8 --ffn-hidden-size 8192 --padded-vocab-size $V"
  fi
  if [ "${OURS_ONLY:-0}" = 1 ] && [ -n "${BASELINE:-}" ]; then
    for round in $(seq "${ROUNDS:-3}"); do
      for side in baseline ours; do
        bin=./train_gpt; [ $side = baseline ] && bin=$BASELINE
        read -r ms_o tf_o gib_o <<<"$(ours "$shape" "$MBS" "$OUT/${side}_${model}_$round.log" "$bin")"
        echo "| $model | $MBS | $side ($bin), round $round | ${ms_o:-FAILED} | | ${tf_o:-} | | ${gib_o:-} (device in use) | |" >>"$table"
      done
    done
    continue
  fi
  r=$(ours "$shape" "$MBS" "$OUT/ours_$model.log")
  read -r ms_o tf_o gib_o <<<"$r"
  if [ "${OURS_ONLY:-0}" = 1 ]; then
    echo "| $model | $MBS | megatron.c | ${ms_o:-FAILED} | | ${tf_o:-} | | ${gib_o:-} (device in use) | |" >>"$table"
    continue
  fi
  python dev/bench/torch_speed.py $tshape --mbs "$MBS" --iters "$ITERS" ${PROFILE:+--profile} \
    >"$OUT/torch_$model.log" 2>&1
  res=$(grep '^RESULT ' "$OUT/torch_$model.log" | sed 's/^RESULT //')
  if [ -z "$r" ] || [ -z "$res" ]; then
    echo "| $model | $MBS | FAILED (see $OUT) | | | | | | |" >>"$table"; tail -5 "$OUT/ours_$model.log" "$OUT/torch_$model.log"; continue
  fi
  python3 - "$model" "$MBS" "$ms_o" "$gib_o" "$res" "$tf_o" "$peak" "$S" >>"$table" <<'EOF'
import json, sys
model, mbs, ms_o, gib_o, res, tf_o, peak, S = sys.argv[1:]
t = json.loads(res)
mbs, ms_o, gib_o, tf_o, peak, S = int(mbs), float(ms_o), float(gib_o), float(tf_o), float(peak), int(S)
tok = mbs * S
flops = tf_o * 1e12 * ms_o / 1e3  # Megatron's FLOPs per iteration, as train_gpt computes them
def row(side, ms, mem, ratio):
    tf = flops / (ms / 1e3) / 1e12
    print(f"| {model} | {mbs} | {side} | {ms:.1f} | {tok / (ms / 1e3):,.0f} | {tf:.1f} | {100 * tf / peak:.1f}% | {mem} | {ratio} |")
row("megatron.c", ms_o, f"{gib_o:.1f} (device in use)", f"**{t['ms'] / ms_o:.2f}x**")
row(f"torch {t['torch']} compile", t["ms"], f"{t['device_in_use_gib']:.1f} (device in use); {t['peak_reserved_gib']:.1f} "
    f"reserved, {t['peak_allocated_gib']:.1f} allocated", "1.00x")
EOF
  if [ "${MAX_MBS:-0}" = 1 ]; then
    best_o=$MBS; best_t=$MBS
    for m in $MAXTRY; do ITERS=4 ours "$shape" "$m" "$OUT/ours_${model}_mbs$m.log" >/dev/null && best_o=$m || break; done
    for m in $MAXTRY; do python dev/bench/torch_speed.py $tshape \
      --mbs "$m" --iters 2 --warmup 1 >"$OUT/torch_${model}_mbs$m.log" 2>&1 && best_t=$m || break; done
    echo "| $model | largest micro-batch tried ($MBS $MAXTRY) | ours $best_o, torch $best_t | | | | | | |" >>"$table"
  fi
done
echo
echo "==== single-GPU speed vs PyTorch ($gpu) ===="
cat "$table"
