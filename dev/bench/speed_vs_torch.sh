#!/usr/bin/env bash
# dev/bench/speed_vs_torch.sh — single-GPU training speed of train_gpt against PyTorch on the same
# GPU in the same command: same model, same micro-batch, same sequence length, bf16.
# Models: 124m, 1.5b (GPT-2 layout, seq 1024, vocab 50257) and llama1b (the Llama-3.2-1B shape: 16 layers,
# hidden 2048, 32 heads, 8 query groups, SwiGLU ffn 8192, RMSNorm, RoPE theta 500000 with llama3 scaling
# factor 32, no biases, tied embeddings, seq 2048, vocab 128256).
# Mixture of experts (issue #34's speed benchmark; every layer MoE, EP 1, micro-batch 1, seq 4096, RMSNorm,
# SwiGLU experts, RoPE base 1e6 without scaling, untied output layer, no biases; the router's logits in fp32,
# top-k of the logits then softmax over the k, aux_loss load balancing, dropless; ours with --moe-grouped-gemm
# --moe-token-dispatcher-type alltoall --moe-router-dtype fp32):
#   mixtral   Mixtral-8x7B's layers: hidden 4096, 32 heads, 8 query groups, 8 experts of ffn 14336, top-2,
#             aux_loss 1e-2, vocab 32000; 4 layers (MIXTRAL_LAYERS or LAYERS), as many as fit one H200 (139 GiB)
#             on both sides. Sized by memory: 1451M parameters a layer (41.9M attention, 1409M experts) + 262M
#             embedding and output layer. Ours at 18 bytes a parameter (bf16 weights, fp32 grads, fp32 master,
#             Adam m and v): 4 layers 102 GiB of state (train_gpt --plan: 107.4 GiB in use, 5.0 GiB of it
#             activations), 5 layers 126 GiB (--plan: 132.5 GiB). Torch at 16 bytes (fp32 weights, grads, Adam)
#             plus bf16 copies of the weights for the GEMMs (up to 2 bytes more), activations and the experts'
#             weight gradients passing through bf16 and fp32 temporaries (~6 GiB): 4 layers ~112 GiB, 5 layers
#             ~136 GiB, too close to 139 GiB. So 4.
#   qwen3moe  Qwen3-30B-A3B's layers: hidden 2048, 32 heads, 4 query groups, kv channels 128, qk-layernorm, 128
#             experts of ffn 768, top-8 (softmax after the top-k: Qwen's norm_topk_prob), vocab 151936; 4 layers
#             (QWEN3MOE_LAYERS or LAYERS): 3.1B parameters, train_gpt --plan 55.8 GiB. aux_loss 1e-3 on both
#             sides: Qwen's Megatron recipe may use global_aux_loss, whose counts (summed over the data-parallel
#             ranks, averaged over the step's micro-batches so far) are, with one micro-batch per step on one
#             GPU, this micro-batch's: the same loss as aux_loss here.
#   For these, a second "ours" row runs train_gpt with MT_MOE_GEMM=loop (the experts one GEMM each), and torch
#   runs its experts as torch._grouped_mm where the installed torch has it, else one GEMM each (its row says
#   which, and how much of the model torch.compile compiled). TFLOP/s: train_gpt's count (Megatron's formula with
#   MoE: the top-k experts' GEMMs per token, the router not counted) for every row.
# PyTorch: torch.compile, bf16 autocast, SDPA flash attention, fused AdamW (dev/bench/torch_speed.py,
# with the models of dev/bench/ref_train_gpt2.py and dev/bench/ref_llama.py).
# Ours: train_gpt --mock-data --bf16 (timing from its log line over the second half of the run).
#
# Run from the repository root on a GPU machine after `make train_gpt`:
#   dev/bench/speed_vs_torch.sh [models...]          models: 124m 1.5b llama1b mixtral qwen3moe (default: 124m 1.5b)
# Environment: ITERS (30), OUT (/tmp/speed_vs_torch), TORCH_ARGS (extra torch_speed.py flags, e.g.
# "--moe-align 1" or "--experts loop"), PROFILE=1 to add torch's per-kernel GPU time of one
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
    mixtral) L=${MIXTRAL_LAYERS:-${LAYERS:-4}}; H=4096; N=32; MBS=1; MAXTRY=""; S=4096; V=32000 ;;
    qwen3moe) L=${QWEN3MOE_LAYERS:-${LAYERS:-4}}; H=2048; N=32; MBS=1; MAXTRY=""; S=4096; V=151936 ;;
    *) echo "speed_vs_torch: unknown model $model" >&2; exit 2 ;;
  esac
  shape="--num-layers $L --hidden-size $H --num-attention-heads $N"
  tshape="$shape --seq-length $S"
  moe=0
  if [ "$model" = llama1b ]; then
    shape="$shape --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu \
      --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling \
      --rope-scaling-factor 32 --disable-bias-linear"
    tshape="--model llama $tshape --num-query-groups 8 --ffn-hidden-size 8192 --padded-vocab-size $V"
  elif [ "$model" = mixtral ] || [ "$model" = qwen3moe ]; then
    moe=1
    if [ "$model" = mixtral ]; then  # G query groups, kv channels, dense ffn (unused: every layer MoE), experts E, top-k, expert ffn, aux coefficient
      G=8; KV=128; F=14336; E=8; K=2; FE=14336; AUX=1e-2; QK=""
    else
      G=4; KV=128; F=6144; E=128; K=8; FE=768; AUX=1e-3; QK="--qk-layernorm"
    fi
    shape="$shape --group-query-attention --num-query-groups $G --kv-channels $KV $QK --ffn-hidden-size $F --swiglu \
      --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 --disable-bias-linear \
      --untie-embeddings-and-output-weights --num-experts $E --moe-router-topk $K --moe-ffn-hidden-size $FE \
      --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff $AUX --moe-grouped-gemm \
      --moe-token-dispatcher-type alltoall --moe-router-dtype fp32"
    tshape="--model moe $tshape --num-query-groups $G --kv-channels $KV $QK --rotary-base 1e6 --num-experts $E \
      --topk $K --moe-ffn $FE --aux-coeff $AUX --padded-vocab-size $V"
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
  r_loop=""  # MoE: ours again with the experts' GEMMs one by one
  [ $moe = 1 ] && r_loop=$(MT_MOE_GEMM=loop ours "$shape" "$MBS" "$OUT/ours_${model}_loop.log")
  read -r ms_l tf_l gib_l <<<"$r_loop"
  if [ "${OURS_ONLY:-0}" = 1 ]; then
    echo "| $model | $MBS | megatron.c | ${ms_o:-FAILED} | | ${tf_o:-} | | ${gib_o:-} (device in use) | |" >>"$table"
    [ $moe = 1 ] && echo "| $model | $MBS | megatron.c MT_MOE_GEMM=loop | ${ms_l:-FAILED} | | ${tf_l:-} | | ${gib_l:-} (device in use) | |" >>"$table"
    continue
  fi
  # shellcheck disable=SC2086
  python dev/bench/torch_speed.py $tshape --mbs "$MBS" --iters "$ITERS" ${PROFILE:+--profile} ${TORCH_ARGS:-} \
    >"$OUT/torch_$model.log" 2>&1
  res=$(grep '^RESULT ' "$OUT/torch_$model.log" | sed 's/^RESULT //')
  if [ -z "$r" ] || [ -z "$res" ]; then
    echo "| $model | $MBS | FAILED (see $OUT) | | | | | | |" >>"$table"; tail -5 "$OUT/ours_$model.log" "$OUT/torch_$model.log"; continue
  fi
  python3 - "$model" "$MBS" "$ms_o" "$gib_o" "$res" "$tf_o" "$peak" "$S" "$moe" "${ms_l:-}" "${gib_l:-}" >>"$table" <<'EOF'
import json, sys
model, mbs, ms_o, gib_o, res, tf_o, peak, S, moe, ms_l, gib_l = sys.argv[1:]
t = json.loads(res)
mbs, ms_o, gib_o, tf_o, peak, S = int(mbs), float(ms_o), float(gib_o), float(tf_o), float(peak), int(S)
tok = mbs * S
flops = tf_o * 1e12 * ms_o / 1e3  # Megatron's FLOPs per iteration, as train_gpt computes them
def row(side, ms, mem, ratio):
    tf = flops / (ms / 1e3) / 1e12
    print(f"| {model} | {mbs} | {side} | {ms:.1f} | {tok / (ms / 1e3):,.0f} | {tf:.1f} | {100 * tf / peak:.1f}% | {mem} | {ratio} |")
row("megatron.c", ms_o, f"{gib_o:.1f} (device in use)", f"**{t['ms'] / ms_o:.2f}x**")
if ms_l:  # MoE: the experts one GEMM each (MT_MOE_GEMM=loop)
    row("megatron.c, MT_MOE_GEMM=loop", float(ms_l), f"{float(gib_l):.1f} (device in use)" if gib_l else "",
        f"{t['ms'] / float(ms_l):.2f}x")
elif moe == "1":
    print(f"| {model} | {mbs} | megatron.c, MT_MOE_GEMM=loop: FAILED | | | | | | |")
side = f"torch {t['torch']} compile"
if "experts" in t:  # MoE: the experts' path, and how much torch.compile compiled
    side = f"torch {t['torch']}, experts {t['experts']} (align {t['moe_align']}), compile {t['compile']}"
row(side, t["ms"], f"{t['device_in_use_gib']:.1f} (device in use); {t['peak_reserved_gib']:.1f} "
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
