#!/usr/bin/env bash
# dev/bench/tp_scaling.sh — tensor-parallel layouts of train_gpt on the GPUs of one node (4 H200s by
# default): TP=1 (DP=4), TP=2 (DP=2) and TP=4 (DP=1), each TP>1 layout with and without sequence
# parallelism (SP), bf16, distributed optimizer with gradient reduce-scatter / parameter all-gather
# overlapped. Reported per layout: ms/iter, tokens/s per GPU, TFLOP/s/GPU, MFU and rank 0's memory.
#
# Models:
#   1.5b     GPT-2 1.5B-class: 48 layers, hidden 1536, 24 heads of 64, ffn 4 x 1536, T=1024, vocab 50257.
#            Not the exact GPT-2 XL shape (hidden 1600, 25 heads): 25 heads do not divide by TP=2 or 4
#            and Megatron (and train_gpt) need heads % TP == 0, and a head dim of 64 (or 128) keeps the
#            bf16 flash-attention kernels. 48 x 1536 with 24 heads is the nearest GPT-2-XL-sized shape
#            whose heads divide by 2 and 4 (about 1.4B parameters).
#   llama1b  the Llama-3.2-1B shape exactly as dev/bench/speed_vs_torch.sh passes it to train_gpt: 16
#            layers, hidden 2048, 32 heads, 8 query groups, SwiGLU ffn 8192, RMSNorm, RoPE base 500000
#            with llama3 scaling factor 32, no biases, tied embeddings, T=2048, vocab 128256.
#
# Strong scaling in the batch: the global batch (GBS) is the same for every layout. Each DP rank runs
# micro-batches of MBS, so at TP=t the DP size is GPUS/t and every rank runs GBS / (MBS x GPUS/t)
# micro-batches per step. tokens/s/GPU = GBS x T / GPUS / (ms/iter / 1000). SP is only meaningful
# with TP > 1: TP=1 runs once, its SP column is "-". Data: --mock-data (random tokens), so nothing but
# the binary is needed.
#
# Run from the repository root on a multi-GPU machine after `make train_gpt`:
#   dev/bench/tp_scaling.sh [models...]     models: 1.5b llama1b (default both)
# Environment: ITERS (20), GPUS (4: the world size; needs that many visible GPUs; smaller runs the
# layouts that fit, TP in {1,2,4} with TP <= GPUS, DP = GPUS/TP), MBS (micro-batch per DP rank;
# default 4 for 1.5b, 2 for llama1b), GBS (global batch; default 64 for 1.5b, 32 for llama1b),
# OUT (/tmp/tp_scaling). The table is printed at the end and saved to $OUT/tp_scaling.md; logs are
# $OUT/<model>_tp<T>_dp<D>_sp<off|on|->.log (the first line is the command).
# Timing: train_gpt's own log line (Megatron's elapsed time per iteration, averaged over the last
# log interval: iterations ITERS/2+1 .. ITERS, after the warm-up half); TFLOP/s/GPU and MFU are that
# line's (Megatron's FLOP formula). Memory: train_gpt prints no device peak; the column is its
# startup memory plan for rank 0 (planned total) and what the device reported in use once the
# trainer had allocated everything (it plans and allocates all memory once, at startup).
# A run that fails or times out (600 s) is a FAILED row naming its log; the others still run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/tp_scaling}
ITERS=${ITERS:-20}
GPUS=${GPUS:-4}
mkdir -p "$OUT"
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(1.5b llama1b)
for model in "${models[@]}"; do
  case "$model" in 1.5b | llama1b) ;; *) echo "tp_scaling: unknown model $model (1.5b or llama1b)" >&2; exit 2 ;; esac
done
MPIRUN=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np "$GPUS")

if [ "$ITERS" -lt 2 ]; then echo "tp_scaling: ITERS must be >= 2" >&2; exit 2; fi
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -lt "$GPUS" ]; then
  echo "tp_scaling: $ngpu GPU(s) visible, $GPUS needed; skipping (set GPUS=$ngpu or fewer to run the layouts that fit)"
  exit 0
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)

table="$OUT/tp_scaling.md"
{
  echo "| model | TP | DP | SP | global batch | ms/iter | tokens/s/GPU | TFLOP/s/GPU | MFU | memory (GiB, rank 0: planned total / device in use after setup; no peak is printed) |"
  echo "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
} >"$table"
notes=()

for model in "${models[@]}"; do
  case "$model" in
    1.5b)
      name="GPT-2 1.5B-class (48L, 1536h, 24 heads)"
      shape=(--num-layers 48 --hidden-size 1536 --num-attention-heads 24)
      S=1024; V=50257; mbs=${MBS:-4}; gbs=${GBS:-64} ;;
    llama1b)
      name="Llama-3.2-1B shape (16L, 2048h, 32 heads, 8 groups)"
      shape=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu
        --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling
        --rope-scaling-factor 32 --disable-bias-linear)
      S=2048; V=128256; mbs=${MBS:-2}; gbs=${GBS:-32} ;;
    *) echo "tp_scaling: unknown model $model (1.5b or llama1b)" >&2; exit 2 ;;
  esac
  notes+=("$model: T=$S, micro-batch $mbs per DP rank, global batch $gbs")
  for tp in 1 2 4; do
    if [ "$tp" -gt "$GPUS" ] || [ $((GPUS % tp)) -ne 0 ]; then continue; fi
    dp=$((GPUS / tp))
    sps="off on"
    [ "$tp" = 1 ] && sps="-"
    for sp in $sps; do
      if [ $((gbs % (mbs * dp))) -ne 0 ]; then
        echo "| $name | $tp | $dp | $sp | $gbs | SKIPPED (global batch not a multiple of $mbs x DP $dp) | | | | |" >>"$table"
        continue
      fi
      accum=$((gbs / (mbs * dp)))
      flags=(--tensor-model-parallel-size "$tp" --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
      [ "$sp" = on ] && flags+=(--sequence-parallel)
      log="$OUT/${model}_tp${tp}_dp${dp}_sp${sp}.log"
      cmd=(timeout 600 "${MPIRUN[@]}" ./train_gpt "${shape[@]}" --seq-length "$S" --max-position-embeddings "$S"
        --mock-data --hidden-dropout 0 --attention-dropout 0 --log-throughput --tokenizer-type NullTokenizer --vocab-size "$V" --bf16
        --micro-batch-size "$mbs" --global-batch-size "$gbs" --train-iters "$ITERS" --log-interval $((ITERS / 2))
        --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
        --eval-iters 0 --sample-tokens 0 "${flags[@]}")
      echo "$model TP=$tp DP=$dp SP=$sp ($accum micro-batch(es) of $mbs per rank): ${cmd[*]}"
      echo "# ${cmd[*]}" >"$log"
      "${cmd[@]}" >>"$log" 2>&1
      rc=$?
      # the line of the last iteration: the average over iterations ITERS/2+1 .. ITERS
      line=$(grep -E "iteration +$ITERS/ +$ITERS \|.*elapsed time per iteration" "$log" | tail -n1)
      if [ -z "$line" ]; then
        echo "| $name | $tp | $dp | $sp | $gbs | FAILED (exit $rc, see $log) | | | | |" >>"$table"
        tail -5 "$log"
        continue
      fi
      [ "$rc" -ne 0 ] && echo "tp_scaling: warning: $log has its last log line but exited $rc"
      ms=$(echo "$line" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
      tf=$(echo "$line" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
      mfu=$(echo "$line" | sed 's/.*MFU: \([^ ]*\).*/\1/')
      tps=$(awk -v g="$gbs" -v s="$S" -v n="$GPUS" -v ms="$ms" 'BEGIN { printf "%.0f", g * s / n / (ms / 1000) }')
      mem=$(grep -m1 "GiB planned; device reports" "$log" |
        sed 's/.*total *\([0-9.]*\) GiB planned; device reports \([0-9.]*\) GiB in use.*/\1 \2/' |
        awk 'NF == 2 { printf "%.1f / %.1f", $1, $2 }')
      echo "| $name | $tp | $dp | $sp | $gbs | $ms | $tps | $tf | $mfu | ${mem:-n/a} |" >>"$table"
      echo "  -> $ms ms/iter, $tps tokens/s/GPU, $tf TFLOP/s/GPU, MFU $mfu, memory ${mem:-n/a} GiB"
    done
  done
done
{
  echo
  echo "$GPUS GPU(s): ${gpu:-unknown GPU}; ITERS=$ITERS (timing over iterations $((ITERS / 2 + 1))-$ITERS); bf16, --mock-data,"
  echo "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather; NCCL_NVLS_ENABLE=0."
  for n in "${notes[@]}"; do echo "- $n"; done
} >>"$table"
echo
echo "==== tensor-parallel scaling (${gpu:-unknown GPU}, $GPUS GPUs) ===="
cat "$table"
