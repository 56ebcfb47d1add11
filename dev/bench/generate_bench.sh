#!/usr/bin/env bash
# Generation speed on one GPU (issue #37's benchmark): decode tokens/s at batch 1, 8 and 64, time to first
# token, and the memory-bandwidth bound (weight + cache bytes a step over the measured copy bandwidth), for
# the GPT-2 1.5B and Llama-3.2-1B shapes with random bf16 weights (dev/generate_bench.c); then, when python
# has torch and transformers, transformers' generate with its static cache and torch.compile on the same
# shapes (dev/bench/hf_generate_bench.py). First the decode GEMV against cuBLAS on both models' linears
# (dev/generate_bench --gemv). At the end one table: per model and batch, our tokens/s, its share of the
# bound, transformers' tokens/s and the ratio.
#
#   dev/bench/generate_bench.sh [PROMPT] [NEW]     (defaults 128 and 256)
#
# GEMV=0 skips the GEMV table, OURS=0 our decode runs, HF=0 transformers'; MODELS (default "gpt2-1.5b
# llama-3.2-1b") the models run. Each side's RESULT lines are kept per model in $RESULTS (default: a new
# temporary folder), ours-MODEL.txt and hf-MODEL.txt, and the table reads every such file there: runs with
# the same RESULTS add up (e.g. HF=0 first, then OURS=0 GEMV=0 MODELS=gpt2-1.5b, then the same for Llama:
# transformers' compiles take minutes a model). A failure of transformers' side (an old transformers, a
# compile error, out of memory, HF_TIMEOUT seconds a model passed: default 540) is reported and never stops
# the table; our side failing makes the script's exit status 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
PROMPT="${1:-128}"
NEW="${2:-256}"
PY="${MT_PYTHON:-python3}"
RESULTS="${RESULTS:-$(mktemp -d)}"
MODELS="${MODELS:-gpt2-1.5b llama-3.2-1b}"
HF_TIMEOUT="${HF_TIMEOUT:-540}"
mkdir -p "$RESULTS" || exit 1
make -s dev/generate_bench || exit 1
git log -1 --format='commit %h %s' 2>/dev/null || true
status=0
if [ "${GEMV:-1}" != 0 ]; then ./dev/generate_bench --gemv || status=1; fi
if [ "${OURS:-1}" != 0 ]; then
  for model in $MODELS; do
    ./dev/generate_bench --model "$model" --batches 1,8,64 --prompt "$PROMPT" --new "$NEW" | tee "$RESULTS/ours-$model.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "dev/generate_bench --model $model failed"; status=1; }
  done
fi
if [ "${HF:-1}" != 0 ]; then
  if "$PY" -c 'import torch, transformers' 2>/dev/null; then
    for model in $MODELS; do
      timeout "$HF_TIMEOUT" "$PY" dev/bench/hf_generate_bench.py --model "$model" --batches 1,8,64 \
        --prompt "$PROMPT" --new "$NEW" 2>&1 | tee "$RESULTS/hf-$model.txt"
      rc="${PIPESTATUS[0]}"
      [ "$rc" = 0 ] || echo "transformers' generate on $model: exit status $rc (124: past HF_TIMEOUT=$HF_TIMEOUT s); its missing batches show as '-'"
    done
  else
    echo "transformers' generate: skipped ($PY without torch or transformers; MT_PYTHON names another python)"
  fi
fi
# The table: RESULT {json} lines of both sides, joined on (model, batch).
python3 - "$RESULTS" "$PROMPT" "$NEW" <<'PYEOF' || true
import glob, json, os, sys
def results(prefix):
    out = {}
    for path in sorted(glob.glob(os.path.join(sys.argv[1], prefix + "-*.txt"))):
        for line in open(path, errors="replace"):
            if line.startswith("RESULT "):
                try:
                    r = json.loads(line[7:])
                    out[(r["model"], int(r["batch"]))] = r
                except (ValueError, KeyError):
                    pass
    return out
ours, hf = results("ours"), results("hf")
print(f"\ndecode tokens/s, prompt {sys.argv[2]}, {sys.argv[3]} new tokens (greedy, random bf16 weights, one GPU)")
print(f"{'model':<13} {'batch':>5} {'ours':>10} {'of bound':>9} {'ms/step':>8} {'transformers':>13} {'ms/step':>8} {'ours/hf':>8}")
for key in sorted(set(ours) | set(hf), key=lambda k: (k[0], k[1])):
    o, h = ours.get(key, {}), hf.get(key, {})
    ot, ht = o.get("tokens_per_s"), h.get("tokens_per_s")
    f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"
    hs = f(ht, ".1f") if ht is not None else ("failed" if "error" in h else "-")
    ratio = f"{ot / ht:.2f}x" if ot and ht else "-"
    print(f"{key[0]:<13} {key[1]:>5} {f(ot, '.1f'):>10} {f(o.get('of_bound'), '.1f') + ('%' if 'of_bound' in o else ''):>9} "
          f"{f(o.get('ms_per_step'), '.3f'):>8} {hs:>13} {f(h.get('ms_per_step'), '.3f'):>8} {ratio:>8}")
for key, h in sorted(hf.items()):
    if "error" in h:
        print(f"transformers {key[0]} batch {key[1]}: {h['error']}")
print(f"(RESULT lines kept in {sys.argv[1]})")
PYEOF
exit "$status"
