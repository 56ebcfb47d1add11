#!/usr/bin/env bash
# dev/bench/trace_step.sh — where the GPU idles during train_gpt's steady-state steps, without Nsight Systems:
# runs train_gpt untraced (its ms/iter, the reference), then under the CUPTI tracer dev/cuda/libkernel_trace.so
# (its ms/iter shows the tracer's own cost), then dev/bench/trace_gaps.py on whole steps of the trace.
#   dev/bench/trace_step.sh                      GPT-2 124M, micro-batch 16, seq 1024, mock data, bf16: the flags of
#                                                speed_vs_torch.sh's 124m "ours" run (ITERS iterations)
#   dev/bench/trace_step.sh <train_gpt flags>    any other run (include --train-iters > SKIP + 1 yourself)
# Run from anywhere on a GPU machine after `make train_gpt`. Environment: ITERS (30), SKIP (10: steps left out at
# the start), STEP_KERNEL (embedding_forward_kernel, launched once per micro-batch: with gradient accumulation
# the "steps" are micro-batches), OUT (/tmp/trace_step), PLAIN=0 to skip the untraced run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/trace_step}
ITERS=${ITERS:-30}
SKIP=${SKIP:-10}
mkdir -p "$OUT"
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
  ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
        --mock-data --hidden-dropout 0 --attention-dropout 0 --log-throughput --tokenizer-type NullTokenizer
        --vocab-size 50257 --bf16 --micro-batch-size 16 --global-batch-size 16 --train-iters "$ITERS"
        --log-interval $((ITERS / 2)) --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2
        --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --eval-iters 0 --sample-tokens 0)
fi
make -C dev/cuda libkernel_trace.so >"$OUT/make.log" 2>&1 || { cat "$OUT/make.log"; exit 1; }
ms() { grep "elapsed time per iteration" "$1" | tail -n1 | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/'; }
if [ "${PLAIN:-1}" != 0 ]; then
  ./train_gpt "${ARGS[@]}" >"$OUT/plain.log" 2>&1 || { tail -5 "$OUT/plain.log"; exit 1; }
  echo "untraced: $(ms "$OUT/plain.log") ms/iter (last log interval)"
fi
rm -f "$OUT/trace.csv"
CUDA_INJECTION64_PATH=$PWD/dev/cuda/libkernel_trace.so MT_TRACE_OUT=$OUT/trace.csv ./train_gpt "${ARGS[@]}" \
  >"$OUT/traced.log" 2>&1 || { tail -5 "$OUT/traced.log"; exit 1; }
echo "traced:   $(ms "$OUT/traced.log") ms/iter; $(grep '^kernel_trace:' "$OUT/traced.log" | tr '\n' ' ')"
grep '^#' "$OUT/trace.csv"
python3 dev/bench/trace_gaps.py "$OUT/trace.csv" --step-kernel "${STEP_KERNEL:-embedding_forward_kernel}" --skip "$SKIP"
