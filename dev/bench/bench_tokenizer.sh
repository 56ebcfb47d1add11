#!/usr/bin/env bash
# Tokenizer speed: megatron.c's preprocess_data against tiktoken and HF tokenizers (if installed),
# on the Project Gutenberg books, on this machine, in one run. Prints MB/s with 1 thread and all cores.
#
#   dev/bench/bench_tokenizer.sh [BOOKS] [ENCODING]
#     BOOKS     books.tar.xz or a directory of .txt files (default ../shared/data/gutenberg/books.tar.xz)
#     ENCODING  gpt2 (default), cl100k_base, o200k_base, llama3 (the last three read rank files
#               from ../shared/data, or SHARED=/path/to/shared/data), or hf:DIR (a directory with a
#               tokenizer.json, e.g. hf:dev/data/tokenizers/llama3)
# Needs: python3 with tiktoken (pip install tiktoken; tokenizers optional).
set -euo pipefail
cd "$(dirname "$0")/../.."
BOOKS="${1:-../shared/data/gutenberg/books.tar.xz}"
ENCODING="${2:-gpt2}"
SHARED="${SHARED:-../shared/data}"
make -s prepro/preprocess_data
if [ -d "$BOOKS" ]; then
  DIR="$BOOKS"
else
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  tar xJf "$BOOKS" -C "$TMP"
  DIR="$TMP"
fi
python3 dev/bench/bench_tokenizer.py --books "$DIR" --encoding "$ENCODING" --shared "$SHARED" --threads "$(nproc)"
