#!/usr/bin/env bash
# Generation speed on one GPU (issue #37's benchmark): decode tokens/s at batch 1, 8 and 64, time to first
# token, and the memory-bandwidth bound (weight + cache bytes a step over the measured copy bandwidth), for
# the GPT-2 1.5B and Llama-3.2-1B shapes with random bf16 weights (dev/generate_bench.c); then, when python
# has torch and transformers, transformers' generate with its static cache and torch.compile on the same
# shapes (dev/bench/hf_generate_bench.py; HF=0 skips it). First the decode GEMV against cuBLAS on both models'
# linears (dev/generate_bench --gemv; GEMV=0 skips it).
#
#   dev/bench/generate_bench.sh [PROMPT] [NEW]     (defaults 128 and 256)
set -euo pipefail
cd "$(dirname "$0")/../.."
PROMPT="${1:-128}"
NEW="${2:-256}"
make -s dev/generate_bench
git log -1 --format='commit %h %s' 2>/dev/null || true
if [ "${GEMV:-1}" != 0 ]; then ./dev/generate_bench --gemv; fi
for model in gpt2-1.5b llama-3.2-1b; do
  ./dev/generate_bench --model "$model" --batches 1,8,64 --prompt "$PROMPT" --new "$NEW"
done
if [ "${HF:-1}" != 0 ] && ${MT_PYTHON:-python3} -c 'import torch, transformers' 2>/dev/null; then
  for model in gpt2-1.5b llama-3.2-1b; do
    ${MT_PYTHON:-python3} dev/bench/hf_generate_bench.py --model "$model" --batches 1,8,64 --prompt "$PROMPT" --new "$NEW"
  done
else
  echo "transformers' generate: skipped (python3 with torch and transformers needed; HF=0 skips it)"
fi
