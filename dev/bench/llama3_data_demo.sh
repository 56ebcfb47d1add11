#!/usr/bin/env bash
# dev/bench/llama3_data_demo.sh — the Llama flavour fed by Llama-3-tokenized Megatron data, end to end.
# Step 1 (any machine with Llama-3's tokenizer.model): tiny shakespeare -> .bin/.idx with
#   prepro/preprocess_data --tokenizer-type Llama3Tokenizer (one JSON line per paragraph).
# Step 2 (GPU): a small Llama-shaped model (RMSNorm, SwiGLU, rope with Llama-3.1 scaling, GQA 6 heads
#   in 2 groups, untied, no biases, Llama-3's vocabulary of 128256) trains on it.
#   dev/bench/llama3_data_demo.sh prepare TOKENIZER_MODEL     # writes llama3_demo/shakes_text_document.*
#   dev/bench/llama3_data_demo.sh train                       # on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  prepare)
    make prepro/preprocess_data >/dev/null
    mkdir -p llama3_demo
    python3 -c "
import json
with open('llama3_demo/shakes.jsonl', 'w') as f:
    for p in open('dev/data/tinyshakespeare.txt').read().split('\n\n'): f.write(json.dumps({'text': p}) + '\n')"
    prepro/preprocess_data --input llama3_demo/shakes.jsonl --output-prefix llama3_demo/shakes --json-keys text \
      --tokenizer-type Llama3Tokenizer --tokenizer-model "$2" --append-eod --workers 4 ;;
  train)
    ./train_gpt --num-layers 6 --hidden-size 384 --num-attention-heads 6 --group-query-attention \
      --num-query-groups 2 --kv-channels 64 --swiglu --normalization RMSNorm --position-embedding-type rope \
      --rotary-base 500000 --use-rope-scaling --untie-embeddings-and-output-weights --disable-bias-linear \
      --seq-length 256 --max-position-embeddings 256 --micro-batch-size 32 --global-batch-size 32 \
      --train-iters 400 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1 \
      --adam-beta2 0.95 --clip-grad 1.0 --bf16 --hidden-dropout 0 --attention-dropout 0 \
      --data-path llama3_demo/shakes_text_document --split 90,10,0 \
      --tokenizer-type NullTokenizer --vocab-size 128256 --log-interval 100 --eval-interval 200 --eval-iters 5 \
      --sample-tokens 0 ;;
  *) echo "usage: $0 prepare TOKENIZER_MODEL | train" >&2; exit 2 ;;
esac
