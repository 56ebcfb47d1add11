#!/usr/bin/env bash
# dev/bench/fp8_convergence.sh — does FP8 training converge like bf16? The same GPT (default: GPT-2 350M
# shape, 24 layers, hidden 1024, 16 heads) trained on the Gutenberg books once per recipe (bf16, then
# FP8 hybrid with delayed, tensorwise, blockwise scaling), same seed, same data order, same
# hyper-parameters; a table of the final losses (each FP8 recipe's final validation loss against
# bf16's: PASS within 1%), NaN and skipped iterations, speed, the validation losses side by side,
# and a plot of the curves.
#
# Run from the repository root on a GPU machine, after building:
#   make -j GPU_ARCH=90 train_gpt prepro/preprocess_data
#   dev/bench/fp8_convergence.sh [--iters N] [--layers L] [--hidden H] [--heads A]
#                                [--recipes "bf16 delayed tensorwise blockwise"] [--tarball PATH]
#                                [--tiny] [--reuse]
#
# Defaults: 1000 iterations of 32 x 1024 tokens (micro-batch 8, global batch 32), lr 3e-4 cosine to
# 3e-5, warmup min(100, max(1, iters/10)), weight decay 0.1, betas (0.9, 0.95), clip 1.0, bf16
# (FP8 runs keep bf16 outside the FP8 GEMMs), dropout 0, seed 1234, split 969,31,0, log every 10
# iterations, eval every 100 iterations over 10 global batches (and once more after training, as
# Megatron does). FP8 runs add --fp8-format hybrid --fp8-recipe R; delayed also
# --fp8-amax-history-len 1024 --fp8-amax-compute-algo max (as Megatron's example scripts).
# --tiny: a smoke run of the whole pipeline (2 layers, hidden 256, 4 heads, seq 256, micro-batch 4,
#   global batch 8, 30 iterations, log every iteration, eval every 10 over 2 batches); flags given
#   with it still win (e.g. --tiny --iters 50).
# --reuse: a recipe whose log in OUT is a finished run of the same command line is not run again
#   (to split the recipes over several invocations: run "--recipes bf16", then
#   "--recipes 'bf16 delayed' --reuse", ..., with the same OUT; the last one writes the whole table).
#   Each 350M run takes minutes (1000 x 32k tokens, plus 11 evaluations), so the four recipes may not
#   fit one 10-minute command: OUT (and WORK) must then be a folder that stays between the commands.
# A recipe that train_gpt refuses (exit status != 0 before its first iteration, e.g. a recipe not
# built yet) is reported as "refused: <its error line>" and the next recipe runs. bf16 runs first
# (if it does not start, the script stops there: the others would fail alike);
# without a finished, clean bf16 run there is no ratio and no FP8 recipe can PASS.
# PASS (per FP8 recipe): all iterations ran, no NaN and no skipped iteration, no non-finite loss
# printed, and |final validation loss / bf16's - 1| <= 1%.
# Exit status: 0 when the bf16 baseline is usable and every FP8 recipe that ran passes (refused
# ones do not count), 1 otherwise or on a failed step (one line says which).
#
# Writes to OUT (default /tmp/fp8_convergence; at most 7 files): prep.log (data stage),
# train_<recipe>.log (one per recipe), results.md (the tables, also printed at the end),
# loss.png (dev/plot_run.py; skipped with one line if matplotlib is missing).
# Data (JSONL, .bin/.idx, reused while the tarball is unchanged) and scratch go to WORK
# (default /tmp/fp8_work). TRAIN_GPT (default ./train_gpt) and PYTHON (default python3) may be set.
set -uo pipefail
cd "$(dirname "$0")/../.." || { echo "fp8_convergence: error: cannot cd to the repository root" >&2; exit 1; }

ITERS='' LAYERS='' HIDDEN='' HEADS=''
RECIPES="bf16 delayed tensorwise blockwise"
TARBALL=.gutenberg/books.tar.xz
TINY=0
REUSE=0
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --iters|--layers|--hidden|--heads|--recipes|--tarball)
      [ $# -ge 2 ] || { echo "fp8_convergence: error: $1 needs a value" >&2; exit 2; }
      case "$1" in
        --iters) ITERS=$2 ;; --layers) LAYERS=$2 ;; --hidden) HIDDEN=$2 ;; --heads) HEADS=$2 ;;
        --recipes) RECIPES=$2 ;; --tarball) TARBALL=$2 ;;
      esac
      shift 2 ;;
    --tiny) TINY=1; shift ;;
    --reuse) REUSE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fp8_convergence: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# ---- configuration: one place ---------------------------------------------------------------------
if [ "$TINY" = 1 ]; then
  D_ITERS=30 D_LAYERS=2 D_HIDDEN=256 D_HEADS=4 SEQ=256 MBS=4 GBS=8 LOG_INTERVAL=1 EVAL_INTERVAL=10 EVAL_ITERS=2
else
  D_ITERS=1000 D_LAYERS=24 D_HIDDEN=1024 D_HEADS=16 SEQ=1024 MBS=8 GBS=32 LOG_INTERVAL=10 EVAL_INTERVAL=100 EVAL_ITERS=10
fi
ITERS=${ITERS:-$D_ITERS} LAYERS=${LAYERS:-$D_LAYERS} HIDDEN=${HIDDEN:-$D_HIDDEN} HEADS=${HEADS:-$D_HEADS}
SEED=1234
SPLIT=969,31,0   # not 969,30,1: with 108 books that gives an empty test range (see gutenberg_run.sh)
LR=3e-4 MIN_LR=3e-5
VOCAB=dev/data/gpt2/gpt2-vocab.json
MERGES=dev/data/gpt2/gpt2-merges.txt
OUT=${OUT:-/tmp/fp8_convergence}
WORK=${WORK:-/tmp/fp8_work}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
PY=${PYTHON:-python3}
PREFIX=$WORK/gutenberg_text_document
TMP=$WORK/fp8_convergence_scratch
export PYTHONUNBUFFERED=1

fail() { echo "fp8_convergence: error: $*" >&2; exit 1; }
is_posint() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ]; }
for v in ITERS LAYERS HIDDEN HEADS; do is_posint "${!v}" || fail "--${v,,} must be a positive integer (got '${!v}')"; done
[ $(( HIDDEN % HEADS )) -eq 0 ] || fail "--hidden $HIDDEN is not a multiple of --heads $HEADS"
WARMUP=$(( ITERS / 10 < 1 ? 1 : (ITERS / 10 > 100 ? 100 : ITERS / 10) ))

# recipes: known names, no repeats, bf16 first
declare -a LIST=()
has_bf16=0
for r in $RECIPES; do
  case "$r" in bf16|delayed|tensorwise|blockwise) ;; *) fail "unknown recipe '$r' (bf16, delayed, tensorwise, blockwise)" ;; esac
  for seen in "${LIST[@]+"${LIST[@]}"}"; do [ "$seen" = "$r" ] && fail "recipe '$r' is listed twice"; done
  if [ "$r" = bf16 ]; then has_bf16=1; else LIST+=("$r"); fi
done
[ "$has_bf16" = 1 ] && LIST=(bf16 "${LIST[@]+"${LIST[@]}"}")
[ "${#LIST[@]}" -gt 0 ] || fail "--recipes is empty"

# ---- checks ---------------------------------------------------------------------------------------
[ -x "$TRAIN_GPT" ] || fail "$TRAIN_GPT is not built (run: make -j GPU_ARCH=90 train_gpt prepro/preprocess_data)"
[ -f "$VOCAB" ] && [ -f "$MERGES" ] || fail "missing $VOCAB / $MERGES"
command -v "$PY" >/dev/null 2>&1 || fail "no $PY (needed for the data stage and the plot)"
mkdir -p "$OUT" "$WORK" "$TMP" || fail "cannot create $OUT / $WORK"
# the files this script writes in OUT (anything else there is left alone); with --reuse the train logs stay
rm -f "$OUT/prep.log" "$OUT/results.md" "$OUT/loss.png"
if [ "$REUSE" = 0 ]; then
  for r in bf16 delayed tensorwise blockwise; do rm -f "$OUT/train_$r.log"; done
fi
rm -f "$TMP"/*

T0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
[ -n "$GPU" ] || GPU="unknown (nvidia-smi gave nothing)"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null) || COMMIT=""
if [ -z "$COMMIT" ]; then COMMIT=unknown
elif ! git diff --quiet HEAD -- 2>/dev/null; then COMMIT="$COMMIT (+ uncommitted changes)"; fi
echo "fp8_convergence: GPU $GPU, commit $COMMIT"
echo "fp8_convergence: $LAYERS layers, hidden $HIDDEN, $HEADS heads, seq $SEQ; $ITERS iterations of $GBS x $SEQ tokens" \
     "(micro-batch $MBS); recipes: ${LIST[*]}; OUT=$OUT WORK=$WORK"

declare -a timings=()
stage_start=0
stage() { stage_start=$(date +%s); echo; echo "==== [$(date +%T)] $*"; }
stage_done() { timings+=("$1|$(( $(date +%s) - stage_start )) s"); }

# ---- 1. data: the same steps as gutenberg_run.sh (prepare_gutenberg.py -> JSONL -> preprocess_data) --
stage "1. data: $TARBALL -> $PREFIX.{bin,idx}"
STAMP_FILE=$WORK/gutenberg.stamp
stamp=""
[ -f "$TARBALL" ] && stamp="$(cd "$(dirname "$TARBALL")" && pwd)/$(basename "$TARBALL") $(stat -c '%s %Y' "$TARBALL" 2>/dev/null)"
if [ -f "$PREFIX.bin" ] && [ -f "$PREFIX.idx" ] && [ -f "$STAMP_FILE" ] && { [ -z "$stamp" ] || [ "$(cat "$STAMP_FILE")" = "$stamp" ]; }; then
  echo "reusing $PREFIX.{bin,idx} (made from $(cat "$STAMP_FILE"))" | tee "$OUT/prep.log"
  stage_done "data (reused)"
else
  [ -f "$TARBALL" ] || fail "no $TARBALL (copy books.tar.xz there, or pass --tarball PATH)"
  [ -x prepro/preprocess_data ] || fail "prepro/preprocess_data is not built (run: make -j GPU_ARCH=90 prepro/preprocess_data)"
  rm -f "$STAMP_FILE" "$PREFIX.bin" "$PREFIX.idx"
  "$PY" dev/bench/prepare_gutenberg.py "$TARBALL" "$WORK/gutenberg.jsonl" 2>&1 | tee "$OUT/prep.log"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "prepare_gutenberg.py failed (see $OUT/prep.log)"
  prepro/preprocess_data --input "$WORK/gutenberg.jsonl" --output-prefix "$WORK/gutenberg" --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod \
    --workers "$(nproc)" --quiet 2>&1 | tee -a "$OUT/prep.log"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "prepro/preprocess_data failed (see $OUT/prep.log)"
  [ -f "$PREFIX.bin" ] && [ -f "$PREFIX.idx" ] || fail "preprocess_data did not write $PREFIX.{bin,idx} (see $OUT/prep.log)"
  echo "$stamp" > "$STAMP_FILE"
  stage_done "data (prepare_gutenberg.py, preprocess_data)"
fi

# ---- 2. one run per recipe ------------------------------------------------------------------------
COMMON=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ"
  --max-position-embeddings "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --bf16 --hidden-dropout 0
  --attention-dropout 0 --init-method-std 0.02 --data-path "$PREFIX" --split "$SPLIT"
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --log-interval "$LOG_INTERVAL"
  --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --seed "$SEED" --sample-tokens 0 --log-throughput)
recipe_flags() {
  case "$1" in
    bf16) ;;
    delayed) echo "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    *) echo "--fp8-format hybrid --fp8-recipe $1" ;;
  esac
}
ITER_LINE=' iteration +[0-9]+/ *[0-9]+ \|'
last_iteration() {  # the last iteration number a log printed (0 if none)
  local n
  n=$(grep -E "$ITER_LINE" "$1" 2>/dev/null | tail -n1 | sed -E 's/.* iteration +([0-9]+)\/.*/\1/')
  echo "${n:-0}"
}
error_line() {  # train_gpt's error line (its last "train_gpt: ..." line), else the log's last non-empty line
  local l
  l=$(grep -E '^train_gpt: ' "$1" | tail -n1)
  [ -n "$l" ] || l=$(grep -v '^[[:space:]]*$' "$1" | tail -n1)
  echo "${l:-(no output)}"
}

declare -A STATUS=()
for r in "${LIST[@]}"; do
  log=$OUT/train_$r.log
  # shellcheck disable=SC2207
  rflags=($(recipe_flags "$r"))
  header="# fp8_convergence $r: $TRAIN_GPT ${COMMON[*]} ${rflags[*]+"${rflags[*]}"}"
  if [ "$REUSE" = 1 ] && [ -f "$log" ] && [ "$(head -n1 "$log")" = "$header" ] && grep -q '^training took' "$log" \
     && [ "$(last_iteration "$log")" = "$ITERS" ]; then
    echo; echo "==== $r: reusing the finished run in $log"
    STATUS[$r]=ran
    timings+=("train_gpt $r|reused")
    continue
  fi
  stage "2. train_gpt: $r${rflags[*]+ (${rflags[*]})}"
  echo "$header" > "$log"
  "$TRAIN_GPT" "${COMMON[@]}" "${rflags[@]+"${rflags[@]}"}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  last=$(last_iteration "$log")
  if [ "$rc" != 0 ] && [ "$last" = 0 ]; then
    STATUS[$r]="refused: $(error_line "$log")"
    echo "fp8_convergence: $r ${STATUS[$r]}"
  elif [ "$rc" != 0 ]; then
    STATUS[$r]="failed (exit status $rc; last iteration logged: $last): $(error_line "$log")"
    echo "fp8_convergence: $r ${STATUS[$r]}"
  elif [ "$last" != "$ITERS" ]; then
    STATUS[$r]="incomplete: exit status 0 but the last iteration logged is $last of $ITERS"
    echo "fp8_convergence: $r ${STATUS[$r]}"
  else
    STATUS[$r]=ran
  fi
  stage_done "train_gpt $r"
  if [ "$r" = bf16 ] && [ "$last" = 0 ]; then   # the plain run did not start: every other would fail alike
    fail "the bf16 baseline did not start ($(error_line "$log")); see $log"
  fi
  if [ "$r" = bf16 ] && [ "${STATUS[$r]}" != ran ]; then
    echo "fp8_convergence: warning: the bf16 baseline did not finish; FP8 recipes get no ratio and no PASS" >&2
  fi
done

# ---- 3. numbers from the logs ---------------------------------------------------------------------
stage "3. tables and plot"
# per log: "last_iter final_train final_val skipped nan nonfinite ms_median tflops_median" (n/a where none)
log_stats() {
  awk -F'|' -v pat="$ITER_LINE" -v msfile="$TMP/ms" -v tffile="$TMP/tf" '
    function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t\r]+$/, "", s); return s }
    function after(s) { sub(/^[^:]*:/, "", s); return trim(s) }   # "name: value" -> value
    function bad(v) { return v ~ /[nN][aA][nN]|[iI][nN][fF]/ }
    function fmt(v) { return bad(v) ? v : sprintf("%.4f", v) }
    $0 ~ pat {
      n++
      for (i = 1; i <= NF; i++) {
        f = trim($i)
        if (f ~ /iteration +[0-9]+\//) { s = f; sub(/.*iteration +/, "", s); split(s, a, "/"); it = a[1] + 0 }
        else if (f ~ /^lm loss:/) { train = after(f); if (bad(train)) nonfinite++ }
        else if (f ~ /^elapsed time per iteration \(ms\):/) ms[n] = after(f)
        else if (f ~ /^throughput per GPU/) tf[n] = after(f)
        else if (f ~ /^number of skipped iterations:/) skipped += after(f)
        else if (f ~ /^number of nan iterations:/) nans += after(f)
      }
      next
    }
    /^ *validation loss at iteration [0-9]+( on validation set)? *\|/ {
      for (i = 1; i <= NF; i++) { f = trim($i); if (f ~ /^lm loss value:/) { val = after(f); if (bad(val)) nonfinite++ } }
    }
    END {
      if (n == 0) { print "0 n/a n/a 0 0 0"; exit }
      printf "%d %s %s %d %d %d\n", it, fmt(train), (val == "" ? "n/a" : fmt(val)), skipped, nans, nonfinite
      first = (n > 1) ? 2 : 1   # the first log window holds the start-up (first-call set-up, allocations)
      for (k = first; k <= n; k++) { print ms[k] > msfile; print tf[k] > tffile }
    }' "$1"
}
median() {  # median of the numbers in a file, one a line
  sort -g "$1" | awk '{ v[NR] = $1 } END { if (NR == 0) print "n/a"; else if (NR % 2) print v[(NR + 1) / 2];
                                           else printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
val_points() {  # "label value" for each validation line; the repeat at the last iteration is the end-of-training eval
  awk -F'|' '/^ *validation loss at iteration [0-9]+( on validation set)? *\|/ {
      it = $1; sub(/.*iteration +/, "", it); it = it + 0
      v = $2; sub(/^[^:]*: */, "", v); sub(/ +$/, "", v)
      lab = (it == prev) ? it " (end)" : it; prev = it
      if (v !~ /[nN][aA][nN]|[iI][nN][fF]/) v = sprintf("%.4f", v)
      print lab "\t" v }' "$1"
}
train_points() {  # "iteration value" at every eval interval (and the last iteration)
  awk -F'|' -v pat="$ITER_LINE" -v every="$EVAL_INTERVAL" -v last="$ITERS" '$0 ~ pat {
      it = $1; sub(/.*iteration +/, "", it); split(it, a, "/"); it = a[1] + 0
      if (it % every != 0 && it != last) next
      for (i = 2; i <= NF; i++) { f = $i; if (f ~ /^ *lm loss:/) { sub(/^ *lm loss: */, "", f); sub(/ +$/, "", f)
        if (f !~ /[nN][aA][nN]|[iI][nN][fF]/) f = sprintf("%.4f", f)
        print it "\t" f } } }' "$1"
}
ratio_pct() {  # ratio_pct VALUE BASE -> "ratio signed-percent" (awk float maths)
  awk -v v="$1" -v b="$2" 'BEGIN { r = v / b; printf "%.4f %+.2f%%\n", r, 100 * (r - 1) }'
}

RAN=()
BASE_VAL=""
OVERALL=0
FP8_RAN=0 FP8_PASS=0
TABLE="$TMP/table.md"
{
  echo "| recipe | status | final train loss | final val loss | ratio to bf16 | within 1% | NaN iterations | skipped iterations | non-finite losses printed | ms/iter (median) | TFLOP/s/GPU (median) |"
  echo "| --- | --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |"
} > "$TABLE"
for r in "${LIST[@]}"; do
  log=$OUT/train_$r.log
  st=${STATUS[$r]}
  if [ "$(last_iteration "$log")" = 0 ]; then   # refused (or died before its first log line)
    echo "| $r | ${st//|/\\|} | | | | | | | | | |" >> "$TABLE"
    [ "$r" = bf16 ] || [[ "$st" == refused:* ]] || OVERALL=1
    continue
  fi
  rm -f "$TMP/ms" "$TMP/tf"
  log_stats "$log" > "$TMP/stats" || fail "cannot read $log"
  read -r it train val skipped nans nonfinite < "$TMP/stats"
  ms=$(median "$TMP/ms"); tf=$(median "$TMP/tf")
  RAN+=("$r")
  ratio="" verdict=""
  clean=$(( skipped == 0 && nans == 0 && nonfinite == 0 ))
  if [ "$r" = bf16 ]; then
    [ "$st" = ran ] && [ "$val" != n/a ] && [ "$clean" = 1 ] && BASE_VAL=$val
    ratio="1.0000"
    verdict=$([ -n "$BASE_VAL" ] && echo "baseline" || echo "baseline unusable")
  else
    FP8_RAN=$(( FP8_RAN + 1 ))
    pass=1
    [ "$st" = ran ] && [ "$clean" = 1 ] && [ "$val" != n/a ] || pass=0
    if [ "$st" != ran ]; then
      ratio="n/a (did not finish)"; pass=0
    elif [ -n "$BASE_VAL" ] && [ "$val" != n/a ]; then
      read -r ratio pct < <(ratio_pct "$val" "$BASE_VAL")
      ratio="$ratio ($pct)"
      awk -v v="$val" -v b="$BASE_VAL" 'BEGIN { d = v / b - 1; exit !(d <= 0.01 && d >= -0.01) }' || pass=0
    else
      ratio="n/a"; pass=0
    fi
    if [ "$pass" = 1 ]; then verdict=PASS; FP8_PASS=$(( FP8_PASS + 1 )); else verdict=FAIL; OVERALL=1; fi
  fi
  stcell=$([ "$st" = ran ] && echo "ran $it/$ITERS" || echo "${st//|/\\|}")
  echo "| $r | $stcell | $train | $val | $ratio | $verdict | $nans | $skipped | $nonfinite | $ms | $tf |" >> "$TABLE"
done
[ -n "$BASE_VAL" ] || OVERALL=1   # nothing to compare with: nothing proved

# validation (and train) losses side by side: one row per eval point, one column per recipe that ran
side_by_side() {  # side_by_side KIND(val|train) -> markdown table on stdout
  local kind=$1 files=() r
  [ "${#RAN[@]}" -gt 0 ] || { echo "(no run printed any loss)"; return; }
  for r in "${RAN[@]}"; do
    if [ "$kind" = val ]; then val_points "$OUT/train_$r.log" > "$TMP/${kind}_$r"
    else train_points "$OUT/train_$r.log" > "$TMP/${kind}_$r"; fi
    files+=("$TMP/${kind}_$r")
  done
  awk -F'\t' -v names="${RAN[*]}" -v has_base="$([ "${RAN[0]}" = bf16 ] && echo 1 || echo 0)" '
    FNR == 1 { f++ }
    { lab[f, FNR] = $1; v[f, FNR] = $2; if (FNR > rows) rows = FNR; if (FNR > nrows[f]) nrows[f] = FNR }
    END {
      nf = split(names, name, " ")
      hdr = "| iteration |"; sep = "| ---: |"
      for (k = 1; k <= nf; k++) {
        hdr = hdr " " name[k] " |"; sep = sep " ---: |"
        if (k > 1 && has_base) { hdr = hdr " " name[k] " vs bf16 |"; sep = sep " ---: |" }
      }
      print hdr; print sep
      for (i = 1; i <= rows; i++) {
        l = ""; for (k = 1; k <= nf && l == ""; k++) if ((k, i) in lab) l = lab[k, i]
        line = "| " l " |"
        for (k = 1; k <= nf; k++) {
          x = ((k, i) in v) ? v[k, i] : ""
          line = line " " x " |"
          if (k > 1 && has_base) {
            b = ((1, i) in v) ? v[1, i] : ""
            if (x != "" && b != "" && x !~ /[nN][aA][nN]|[iI][nN][fF]/ && b !~ /[nN][aA][nN]|[iI][nN][fF]/ && b + 0 != 0)
              line = line sprintf(" %+.2f%% |", 100 * (x / b - 1))
            else line = line " |"
          }
        }
        print line
      }
    }' "${files[@]}"
}
stage_done "tables"

# the plot (the table stands without it)
PLOT_NOTE=""
if [ "${#RAN[@]}" -gt 0 ]; then
  plot_logs=() plot_labels=()
  for r in "${RAN[@]}"; do plot_logs+=("$OUT/train_$r.log"); plot_labels+=("$r"); done
  "$PY" dev/plot_run.py "${plot_logs[@]}" --label "${plot_labels[@]}" --out-dir "$OUT" --only loss \
    --title "GPT ${LAYERS}L/${HIDDEN}H on Gutenberg, $ITERS iters x $((GBS * SEQ)) tokens: bf16 vs FP8 (hybrid)"
  prc=$?
  if [ "$prc" != 0 ]; then PLOT_NOTE="loss.png: not written (plot_run.py exit status $prc)"
  elif [ ! -f "$OUT/loss.png" ]; then PLOT_NOTE="loss.png: not written (matplotlib missing, see the output above)"
  else PLOT_NOTE="loss.png: train (light) and validation (markers) loss curves; lower panel: validation loss vs bf16 in %"; fi
else
  PLOT_NOTE="loss.png: not written (no run printed any loss)"
fi
echo "$PLOT_NOTE"

# ---- 4. results.md --------------------------------------------------------------------------------
{
  echo "# FP8 convergence: GPT ($LAYERS layers, hidden $HIDDEN, $HEADS heads) on the Gutenberg books"
  echo
  echo "GPU: $GPU. Commit: $COMMIT. Date: $(date '+%Y-%m-%d %H:%M %Z')."
  echo
  echo "$ITERS iterations of $GBS x $SEQ = $((GBS * SEQ)) tokens (micro-batch $MBS), lr $LR cosine to $MIN_LR, warmup"
  echo "$WARMUP, weight decay 0.1, betas (0.9, 0.95), clip 1.0, bf16, dropout 0, split $SPLIT, seed $SEED, GPT-2 BPE;"
  echo "the same initial weights and data order for every recipe. FP8 recipes: --fp8-format hybrid (E4M3 forward,"
  echo "E5M2 gradients) --fp8-recipe R; delayed with --fp8-amax-history-len 1024 --fp8-amax-compute-algo max."
  echo "Final train loss: the mean over the last $LOG_INTERVAL-iteration log window. Validation loss: $EVAL_ITERS global"
  echo "batches every $EVAL_INTERVAL iterations (the valid iterator carries on) plus one more after training (\"end\");"
  echo "the final validation loss is that last one. PASS: all iterations ran, no NaN or skipped iteration, and"
  echo "|final val loss / bf16's - 1| <= 1%. ms/iter and TFLOP/s/GPU: medians over the log windows after the first"
  echo "(train_gpt's own numbers: training steps only, evaluations excluded)."
  echo
  cat "$TABLE"
  echo
  echo "## Validation loss at every evaluation"
  echo
  side_by_side val
  echo
  echo "## Train loss at every evaluation interval (mean over the $LOG_INTERVAL-iteration log window ending there)"
  echo
  side_by_side train
  echo
  echo "$PLOT_NOTE"
  echo
  echo "| stage | wall time |"
  echo "| --- | ---: |"
  for t in "${timings[@]}"; do echo "| ${t%%|*} | ${t##*|} |"; done
  echo "| total | $(( $(date +%s) - T0 )) s |"
} > "$OUT/results.md" || fail "cannot write $OUT/results.md"

echo
cat "$OUT/results.md"
echo
refused=""
for r in "${LIST[@]}"; do [[ "${STATUS[$r]}" == refused:* ]] && refused+=" $r"; done
summary="$FP8_PASS of $FP8_RAN FP8 recipe(s) that ran PASS${refused:+ (refused:$refused)}"
[ -n "$BASE_VAL" ] || summary="$summary; no usable bf16 baseline (it must run, finish, and have no NaN/skipped iteration)"
if [ "$OVERALL" = 0 ]; then echo "fp8_convergence: $summary"; else echo "fp8_convergence: FAIL: $summary"; fi
echo "fp8_convergence: files in $OUT: $(cd "$OUT" && ls prep.log train_*.log results.md loss.png 2>/dev/null | tr '\n' ' ')"
exit "$OVERALL"
