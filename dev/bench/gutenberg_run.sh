#!/usr/bin/env bash
# dev/bench/gutenberg_run.sh — GPT-2 124M, bf16, on the Gutenberg books: train_gpt against a PyTorch
# reference with the same initial weights, the same samples in the same order and the same
# hyper-parameters, and a side-by-side table of train and validation losses and speed.
#
# Run from the repository root on a GPU machine, after building:
#   make -j GPU_ARCH=90 train_gpt prepro/preprocess_data prepro/dataset_info
#   dev/bench/gutenberg_run.sh [--iters N] [--eval-interval N] [--tarball PATH] [--skip-ours] [--skip-torch]
#                              [--tiny]
#
# Steps (each one's output in a log):
#   1. dev/bench/prepare_gutenberg.py: books.tar.xz -> one JSONL line per book (header/footer cut)
#   2. prepro/preprocess_data (GPT-2 BPE, --append-eod) -> WORK/gutenberg_text_document.{bin,idx}
#   3. prepro/dataset_info: the train and valid splits' index arrays (.npy) for these flags, and
#      their first samples (ids and decoded text), which the PyTorch side checks its own against
#   4. train_gpt --exit-interval 1 --log-interval 1 --save: the initial weights (iteration 1 runs
#      at learning rate 0) and the first batch's loss, which the PyTorch side must reproduce
#   5. dev/bench/ref_train_gpt2.py: the PyTorch run (torch.compile, flash SDPA, fused AdamW, bf16 autocast)
#   6. train_gpt: the full run
#   7. the table: OUT/results.md
# (and first, 0.: ref_train_gpt2.py --check-vectors, the PyTorch model and optimizer against
#  dev/ref_gpt.py's float64 vectors, which train_gpt's GPU tests use too)
# --iters N shortens both runs alike (cosine decay over N iterations, warmup min(100, max(1, N/10))).
# --skip-ours / --skip-torch reuse the previous run's log of that side from OUT.
# TORCH_ARGS="..." (environment) is appended to ref_train_gpt2.py's flags, e.g. "--compile off" or
# "--sdpa any" should torch.compile or the flash-only SDPA setting fail on some torch version.
# --tiny: a smoke test of the whole pipeline (2 layers, hidden 256, seq 256, batch 4, 20 iterations,
# eval every 10 over 2 batches; the PyTorch side runs on the CPU when no GPU is visible).
#
# Logs and the table go to $OUT (default /tmp/gutenberg_run; at most 6 files); the data, index arrays
# and the initial checkpoint (1.5 GB) to $WORK (default /tmp/gutenberg_work).
# Note: --split is 969,31,0, not 969,30,1: with 108 books, "969,30,1" gives the test split the sequence
# range [108, 108), which is empty (Megatron would not build it either); 969,31,0 keeps train =
# books [0, 105) and valid = books [105, 108) and has no test split.
set -euo pipefail
cd "$(dirname "$0")/../.."

ITERS=2000
EVAL_INTERVAL=250
TARBALL=.gutenberg/books.tar.xz
SKIP_OURS=0
SKIP_TORCH=0
TINY=0
ITERS_SET=0
EVAL_SET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) ITERS=${2:?--iters needs a value}; ITERS_SET=1; shift 2 ;;
    --eval-interval) EVAL_INTERVAL=${2:?--eval-interval needs a value}; EVAL_SET=1; shift 2 ;;
    --tarball) TARBALL=${2:?--tarball needs a value}; shift 2 ;;
    --skip-ours) SKIP_OURS=1; shift ;;
    --skip-torch) SKIP_TORCH=1; shift ;;
    --tiny) TINY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gutenberg_run: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-/tmp/gutenberg_run}
WORK=${WORK:-/tmp/gutenberg_work}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"

# the run's configuration: one place, both sides
LAYERS=12 HIDDEN=768 HEADS=12 SEQ=1024 MBS=8 GBS=16 LOG_INTERVAL=50 EVAL_ITERS=10
if [ "$TINY" = 1 ]; then
  LAYERS=2 HIDDEN=256 HEADS=4 SEQ=256 MBS=2 GBS=4 LOG_INTERVAL=5 EVAL_ITERS=2
  [ "$ITERS_SET" = 1 ] || ITERS=20
  [ "$EVAL_SET" = 1 ] || EVAL_INTERVAL=10
fi
SEED=1234
SPLIT=969,31,0
WARMUP=$(( ITERS / 10 < 1 ? 1 : (ITERS / 10 > 100 ? 100 : ITERS / 10) ))
VOCAB=dev/data/gpt2/gpt2-vocab.json
MERGES=dev/data/gpt2/gpt2-merges.txt
PREFIX=$WORK/gutenberg_text_document

fail() { echo "gutenberg_run: error: $*" >&2; exit 1; }
stage_start=0
stage() { stage_start=$(date +%s); echo; echo "==== [$(date +%T)] $*"; }
declare -a timings
stage_done() { timings+=("$1|$(( $(date +%s) - stage_start )) s"); }
current="setup"
trap 'echo "gutenberg_run: FAILED during: $current (logs in $OUT)" >&2' ERR

# ---- checks ---------------------------------------------------------------------------------------
[ -f "$TARBALL" ] || fail "no $TARBALL (copy books.tar.xz there, or pass --tarball PATH)"
for b in train_gpt prepro/preprocess_data prepro/dataset_info; do
  [ -x "$b" ] || fail "$b is not built (run: make -j GPU_ARCH=90 train_gpt prepro/preprocess_data prepro/dataset_info)"
done
[ -f "$VOCAB" ] && [ -f "$MERGES" ] || fail "missing $VOCAB / $MERGES"
[[ "$ITERS" =~ ^[0-9]+$ ]] && [ "$ITERS" -gt 0 ] || fail "--iters must be a positive integer"
[[ "$EVAL_INTERVAL" =~ ^[0-9]+$ ]] && [ "$EVAL_INTERVAL" -gt 0 ] || fail "--eval-interval must be a positive integer"
if [ "$SKIP_TORCH" = 0 ]; then
  if [ "$TINY" = 1 ]; then check="import torch, numpy"
  else check="import torch, numpy; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"; fi
  "$PY" -c "$check" || fail "python3 with torch (CUDA) and numpy is needed for the reference run"
fi
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } \
  | tee "$OUT/gpu.txt"
echo "$LAYERS layers, hidden $HIDDEN, $HEADS heads; iterations $ITERS, eval every $EVAL_INTERVAL over $EVAL_ITERS batches, global batch $GBS x $SEQ tokens (micro $MBS), split $SPLIT, seed $SEED"

# ---- 0. the PyTorch model and optimizer against the float64 reference's vectors (CPU, ~10 s) -------
if [ "$SKIP_TORCH" = 0 ] && ls dev/data/gpt_vectors/*.bin >/dev/null 2>&1; then
  current="ref_train_gpt2.py --check-vectors"
  stage "0. PyTorch reference: self-test against dev/data/gpt_vectors (float64 dev/ref_gpt.py)"
  "$PY" dev/bench/ref_train_gpt2.py --check-vectors dev/data/gpt_vectors/*.bin 2>&1 | tee "$OUT/prep.log"
  stage_done "PyTorch self-test (CPU)"
fi

# ---- 1-3. data ------------------------------------------------------------------------------------
current="prepare + preprocess + dataset_info"
stage "1-3. data: prepare_gutenberg.py, preprocess_data, dataset_info"
{
  "$PY" dev/bench/prepare_gutenberg.py "$TARBALL" "$WORK/gutenberg.jsonl"
  prepro/preprocess_data --input "$WORK/gutenberg.jsonl" --output-prefix "$WORK/gutenberg" --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod \
    --workers "$(nproc)" --quiet
  for split in train valid; do
    rm -rf "$WORK/index_$split"
    common=(--data-path "$PREFIX" --seq-length $SEQ --split $SPLIT --seed $SEED --train-iters "$ITERS"
            --global-batch-size $GBS --eval-interval "$EVAL_INTERVAL" --eval-iters $EVAL_ITERS --show-split $split)
    prepro/dataset_info "${common[@]}" --output-dir "$WORK/index_$split" | tee "$WORK/dataset_info_${split}_ids.log"
    prepro/dataset_info "${common[@]}" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
      > "$WORK/dataset_info_${split}_text.log"
  done
} 2>&1 | tee -a "$OUT/prep.log"
[ -f "$PREFIX.bin" ] && [ -f "$WORK/index_train/shuffle_index.npy" ] && [ -f "$WORK/index_valid/shuffle_index.npy" ] \
  || fail "the data stage did not produce its files (see $OUT/prep.log)"
stage_done "data (prepare, preprocess_data, dataset_info)"

OURS_FLAGS=(--num-layers $LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS --seq-length $SEQ
  --max-position-embeddings $SEQ --micro-batch-size $MBS --global-batch-size $GBS --train-iters "$ITERS"
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters $WARMUP --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --bf16 --hidden-dropout 0 --attention-dropout 0
  --init-method-std 0.02 --data-path "$PREFIX" --split $SPLIT --tokenizer-type GPT2BPETokenizer
  --vocab-file "$VOCAB" --merge-file "$MERGES" --eval-interval "$EVAL_INTERVAL" --eval-iters $EVAL_ITERS
  --seed $SEED --sample-tokens 0)

# ---- 4. initial weights ---------------------------------------------------------------------------
if [ "$SKIP_TORCH" = 0 ]; then
  current="train_gpt --exit-interval 1 (initial weights)"
  stage "4. train_gpt: initial weights (--exit-interval 1 --save)"
  rm -rf "$WORK/init_ckpt"
  ./train_gpt "${OURS_FLAGS[@]}" --log-interval 1 --exit-interval 1 --save "$WORK/init_ckpt" 2>&1 \
    | tee "$OUT/ours_init.log"
  [ -f "$WORK/init_ckpt/iter_0000001/mp_rank_00/model_optim_rng.bin" ] \
    || fail "train_gpt did not save $WORK/init_ckpt/iter_0000001 (see $OUT/ours_init.log)"
  stage_done "train_gpt initial weights (1 iteration + save)"

  # ---- 5. PyTorch ---------------------------------------------------------------------------------
  current="ref_train_gpt2.py (PyTorch)"
  stage "5. PyTorch reference"
  "$PY" dev/bench/ref_train_gpt2.py --data-prefix "$PREFIX" --train-index "$WORK/index_train" \
    --valid-index "$WORK/index_valid" --init "$WORK/init_ckpt" --expect-init-loss-from "$OUT/ours_init.log" \
    --check-dataset-info train "$WORK/dataset_info_train_ids.log" \
    --check-dataset-info train "$WORK/dataset_info_train_text.log" \
    --check-dataset-info valid "$WORK/dataset_info_valid_ids.log" \
    --check-dataset-info valid "$WORK/dataset_info_valid_text.log" --vocab-file "$VOCAB" \
    --iters "$ITERS" --seq-length $SEQ --mbs $MBS --gbs $GBS --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters $WARMUP \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --log-interval $LOG_INTERVAL --eval-interval "$EVAL_INTERVAL" --eval-iters $EVAL_ITERS ${TORCH_ARGS:-} 2>&1 \
    | tee "$OUT/torch.log"
  grep -q "^training took" "$OUT/torch.log" || fail "the PyTorch run did not finish (see $OUT/torch.log)"
  stage_done "PyTorch run (startup, compilation, training, evaluations)"
  rm -rf "$WORK/init_ckpt"
fi

# ---- 6. ours --------------------------------------------------------------------------------------
if [ "$SKIP_OURS" = 0 ]; then
  current="train_gpt (full run)"
  stage "6. train_gpt"
  ./train_gpt "${OURS_FLAGS[@]}" --log-interval $LOG_INTERVAL 2>&1 | tee "$OUT/ours.log"
  grep -q "^training took" "$OUT/ours.log" || fail "train_gpt did not finish (see $OUT/ours.log)"
  stage_done "train_gpt run (startup, training, evaluations)"
fi

# ---- 7. table -------------------------------------------------------------------------------------
current="comparison table"
stage "7. side by side"
{
  echo "# GPT-2 ($LAYERS layers, hidden $HIDDEN, $HEADS heads) on the Gutenberg books: train_gpt vs PyTorch"
  echo
  echo "GPU: $(head -n1 "$OUT/gpu.txt"). $ITERS iterations of $GBS x $SEQ tokens (micro-batch $MBS), bf16, lr 6e-4"
  echo "cosine to 6e-5, warmup $WARMUP, wd 0.1, betas (0.9, 0.95), clip 1.0, split $SPLIT, seed $SEED; same initial"
  echo "weights and data order on both sides. Train loss: mean over each $LOG_INTERVAL-iteration window; val loss:"
  echo "$EVAL_ITERS global batches every $EVAL_INTERVAL iterations (the valid iterator carries on), plus one after training."
  echo
  echo "- train_gpt: $(grep -m1 '^model:' "$OUT/ours.log" 2>/dev/null | sed 's/^model: //' || echo '(no log)')"
  echo "- PyTorch: $(grep -m1 '^model:' "$OUT/torch.log" 2>/dev/null | sed 's/^model: //' || echo '(no log)')"
  echo "- $(grep -m1 "^torch: first batch" "$OUT/torch.log" 2>/dev/null || echo 'initial-loss check: (no log)')"
  echo "- data check: $(grep -c '^data check:.*equal' "$OUT/torch.log" 2>/dev/null || true) samples equal to dataset_info's"
  echo
} > "$OUT/results.md"
"$PY" dev/bench/ref_train_gpt2.py --compare "$OUT/ours.log" "$OUT/torch.log" --gbs $GBS --seq-length $SEQ \
  --table-out "$WORK/table.md" >/dev/null
cat "$WORK/table.md" >> "$OUT/results.md"
stage_done "table"
{
  echo
  echo "| stage | wall time |"
  echo "| --- | ---: |"
  for t in "${timings[@]}"; do echo "| ${t%%|*} | ${t##*|} |"; done
  echo "| total | $(( $(date +%s) - T0 )) s |"
} >> "$OUT/results.md"
echo
cat "$OUT/results.md"
echo
echo "logs: $OUT/{prep,ours_init,torch,ours}.log, table: $OUT/results.md"
