#!/usr/bin/env bash
# dev/bench/cp_bench.sh — context parallelism's benchmark (issue #36), one command on one or two H200s.
#
# Parts (arguments; default: attention cp1, and cp2 long too when two GPUs are visible):
#   attention  one GPU: causal attention forward and backward, bf16, B=1, H=32, Hkv=8, d=128, at T=32768 and
#              131072: ours (dev/cuda/flash_attention --bench: the kernels the trainer takes) against PyTorch's
#              SDPA with only its FlashAttention backend (dev/bench/attention_sdpa.py), CUDA events, median
#              of 7 after 2 warm-ups; TFLOP/s by the causal count 2*B*H*T^2*d forward, 2.5x that backward.
#   cp1        one GPU: the Llama-3-8B layer shape (hidden 4096, ffn 14336 SwiGLU, 32 heads in 8 query groups,
#              RMSNorm, RoPE base 500000, no biases, vocabulary 128256 tied: as dev/bench/fp8_speed.sh's
#              llama8b-layers) with LAYERS layers at sequence 16384 and 32768, micro-batch 1, global batch 1.
#   cp2        two GPUs: the same at --context-parallel-size 2 --cp-comm-type p2p (mpirun -np 2), and the
#              ratio of its TFLOP/s/GPU to cp1's at the same sequence (the issue's goal: at least 0.90).
#   cp2a2a     two GPUs: the same at --cp-comm-type a2a (Ulysses: attention on whole sequences of half the heads,
#              the Hopper kernels where they run), beside p2p's rows.
#   long       two GPUs: sequence 131072 at CP=2: --plan for one GPU (with full recompute of every layer, the
#              least memory short of offloading the optimizer: must say it does not fit) and for two (the
#              recompute chosen as below: must fit), then LONG_ITERS training iterations.
#
# Layers: LAYERS, else the most that fit one GPU at sequence 16384 without recompute (train_gpt --plan). The
# same model at every sequence length and CP size. Recompute "as needed": for each run the first of none,
# selective, full block N (the fewest layers N, Megatron's --recompute-method block) that --plan says fits,
# so CP=1 recomputes only where it must; every run's plan is kept in $CPB_OUT/plan_*.log. "Fits": the plan's
# total in use at most the device's memory (nvidia-smi, else GPU_GIB, 139) less MARGIN_GIB (2; the plan is
# within 0.3% of what the device reports, dev/bench/results/memory_h100.md).
#
# Every training run: bf16, --mock-data, the distributed optimizer with overlapped gradient reduce-scatter and
# parameter all-gather (a no-op at one GPU; at CP=2 the optimizer is sharded over the DP x CP ranks, as in
# Megatron), no dropout. Timing: train_gpt's log line (Megatron's elapsed time per iteration, averaged over the
# last log interval: iterations ITERS/2+1 .. ITERS); TFLOP/s/GPU is that line's (Megatron's formula, which does
# not count recomputed forwards); tokens/s/GPU = sequence / GPUs / (ms/1000); memory: what the device reported
# in use after training (the plan's figure beside it). The long run logs every iteration and reports the last.
#
# Run from the repository root on a GPU machine (builds what it needs: make train_gpt, and the lab):
#   dev/bench/cp_bench.sh                       # everything the visible GPUs allow
#   dev/bench/cp_bench.sh attention cp1         # the one-GPU parts (about 5-6 minutes on an H200, build included)
#   dev/bench/cp_bench.sh cp2 cp2a2a long       # the two-GPU parts (about 4-5 minutes once built)
# Environment: CPB_OUT (/tmp/cp_bench: logs, plans, one result file per row; a later call adds its rows to
# the earlier call's, so the final table shows both), ITERS (6), LONG_ITERS (3), LAYERS, GPU_GIB, MARGIN_GIB
# (2), RUN_TIMEOUT (300 s a training run), LONG_TIMEOUT (420 s), PYTHON (python3). A part that fails or times
# out becomes a FAILED row naming its log; the others still run. mpirun: --allow-run-as-root --bind-to none
# -x NCCL_NVLS_ENABLE=0.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export NCCL_NVLS_ENABLE=0
OUTD=${CPB_OUT:-/tmp/cp_bench}
ITERS=${ITERS:-6}
LONG_ITERS=${LONG_ITERS:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
LONG_TIMEOUT=${LONG_TIMEOUT:-420}
MARGIN=${MARGIN_GIB:-2}
PY=${PYTHON:-python3}
COMM=p2p # the CP runs' --cp-comm-type (the cp2a2a part: a2a)
mkdir -p "$OUTD" || exit 1
case "$ITERS" in '' | *[!0-9]*) echo "cp_bench: ITERS must be a number >= 2" >&2; exit 2 ;; esac
case "$LONG_ITERS" in '' | *[!0-9]*) echo "cp_bench: LONG_ITERS must be a number >= 1" >&2; exit 2 ;; esac
case "${LAYERS:-1}" in '' | *[!0-9]* | 0) echo "cp_bench: LAYERS must be a number >= 1" >&2; exit 2 ;; esac
[ "$ITERS" -ge 2 ] || { echo "cp_bench: ITERS must be >= 2" >&2; exit 2; }
[ "$LONG_ITERS" -ge 1 ] || { echo "cp_bench: LONG_ITERS must be >= 1" >&2; exit 2; }

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
dev_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1 |
  awk '$1 + 0 >= 8192 { printf "%.1f", $1 / 1024 }') # MiB; nothing when unknown ([N/A])
GIB=${GPU_GIB:-${dev_gib:-139}}
BUDGET=$(awk -v g="$GIB" -v m="$MARGIN" 'BEGIN { printf "%.1f", g - m }')
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(attention cp1)
  [ "$ngpu" -ge 2 ] && parts+=(cp2 cp2a2a long)
fi
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
for p in "${parts[@]}"; do
  case "$p" in attention | cp1 | cp2 | cp2a2a | long) ;; *) echo "cp_bench: unknown part '$p' (attention cp1 cp2 cp2a2a long)" >&2; exit 2 ;; esac
done
echo "cp_bench: parts ${parts[*]}; $ngpu GPU(s) (${gpu:-none}), plans against $BUDGET GiB ($GIB less $MARGIN); logs in $OUTD"
{ want cp2 || want cp2a2a || want long; } && [ "$ngpu" -lt 2 ] && echo "cp_bench: cp2 and long need two GPUs ($ngpu visible): their rows will say so"

# ---- build: train_gpt and the attention lab side by side (each compiles megatron.cu once) ----
build_start=$(date +%s)
if want cp1 || want cp2 || want cp2a2a || want long; then
  timeout 480 make -j"$(nproc)" train_gpt >"$OUTD/build_train_gpt.log" 2>&1 &
  bt=$!
fi
if want attention; then
  timeout 480 make -C dev/cuda flash_attention >"$OUTD/build_lab.log" 2>&1 &
  bl=$!
fi
[ -n "${bt:-}" ] && { wait "$bt" || echo "cp_bench: make train_gpt failed (see $OUTD/build_train_gpt.log)"; }
[ -n "${bl:-}" ] && { wait "$bl" || echo "cp_bench: building dev/cuda/flash_attention failed (see $OUTD/build_lab.log)"; }
echo "cp_bench: build took $(($(date +%s) - build_start)) s"

# ---- attention: ours and torch's SDPA (flash) on one GPU ----
SHAPES=("1,32,8,32768,128" "1,32,8,131072,128")
if want attention; then
  rm -f "$OUTD"/attn_*.row
  args=(); for s in "${SHAPES[@]}"; do args+=(--bench "$s"); done
  if [ -x dev/cuda/flash_attention ]; then
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 180 dev/cuda/flash_attention "${args[@]}" >"$OUTD/attn_ours.log" 2>&1 ||
      echo "cp_bench: flash_attention --bench exited $? (see $OUTD/attn_ours.log)"
  else
    echo "flash_attention was not built" >"$OUTD/attn_ours.log"
  fi
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 240 "$PY" dev/bench/attention_sdpa.py "${args[@]}" >"$OUTD/attn_torch.log" 2>&1 ||
    echo "cp_bench: attention_sdpa.py exited $? (see $OUTD/attn_torch.log)"
  grep -h '^torch ' "$OUTD/attn_torch.log" >"$OUTD/attn_torch_version.txt" 2>/dev/null
  for side in ours torch; do
    grep '^BENCH' "$OUTD/attn_$side.log" 2>/dev/null | while read -r line; do
      T=$(echo "$line" | sed -n 's/.* T=\([0-9]*\) .*/\1/p')
      [ -n "$T" ] && echo "$line" >"$OUTD/attn_${side}_$T.row"
    done
  done
  tail -n 3 "$OUTD/attn_ours.log" "$OUTD/attn_torch.log"
fi

# ---- the model and its plans ----
MODEL=(--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
  --num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
  --disable-bias-linear --tokenizer-type NullTokenizer --vocab-size 128256)
RUN=(--bf16 --mock-data --micro-batch-size 1 --global-batch-size 1 --hidden-dropout 0 --attention-dropout 0
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --adam-beta2 0.95
  --clip-grad 1.0 --eval-iters 0 --sample-tokens 0 --log-throughput
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
MPIRUN=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np 2)

# plan LOG WORLD L S [flags...] -> train_gpt --plan's exit status (0 fits, 1 does not, 2 refused), output in LOG
plan() {
  local log=$1 world=$2 L=$3 S=$4; shift 4
  local cp=(); [ "$world" = 2 ] && cp=(--context-parallel-size 2 --cp-comm-type "$COMM")
  ./train_gpt --plan --world-size "$world" --gpu-memory-gib "$BUDGET" "${MODEL[@]}" "${RUN[@]}" "${cp[@]}" \
    --num-layers "$L" --seq-length "$S" --max-position-embeddings "$S" --train-iters "$ITERS" "$@" >"$log" 2>&1
}
# the most layers (1..64) that fit one GPU at sequence 16384 without recompute; 0 if none
pick_layers() {
  local lo=0 hi=65 mid # lo fits (0: nothing known to), hi does not (65: past the search)
  while [ $((hi - lo)) -gt 1 ]; do
    mid=$(((lo + hi) / 2))
    if plan "$OUTD/plan_layers.log" 1 "$mid" 16384; then lo=$mid; else hi=$mid; fi
  done
  [ "$lo" -ge 1 ] && plan "$OUTD/plan_layers.log" 1 "$lo" 16384 # leave the chosen plan in the log
  echo "$lo"
}
# choose_recompute WORLD S -> the flags of the least recompute that fits (printed), or "none fits"
# (exit 1); the chosen plan is left in $OUTD/plan_w<WORLD>_s<S>.log
choose_recompute() {
  local world=$1 S=$2 log="$OUTD/plan_w$1_s$2.log" lo hi mid
  plan "$log" "$world" "$L" "$S" && { echo ""; return 0; }
  [ $? -eq 1 ] || { echo "plan refused: $(grep -m1 -v '^ ' "$log")"; return 1; }
  plan "$log" "$world" "$L" "$S" --recompute-granularity selective && { echo "--recompute-granularity selective"; return 0; }
  block() { echo "--recompute-granularity full --recompute-method block --recompute-num-layers $1"; }
  # shellcheck disable=SC2046
  plan "$log" "$world" "$L" "$S" $(block "$L") || { echo "not even with every layer recomputed"; return 1; }
  lo=0; hi=$L # hi fits, lo does not (0: none recomputed, known not to fit)
  while [ $((hi - lo)) -gt 1 ]; do
    mid=$(((lo + hi) / 2))
    # shellcheck disable=SC2046
    if plan "$log" "$world" "$L" "$S" $(block "$mid"); then hi=$mid; else lo=$mid; fi
  done
  # shellcheck disable=SC2046
  plan "$log" "$world" "$L" "$S" $(block "$hi")
  block "$hi"
}
in_use() { grep -m1 'in use .*expected per GPU' "$1" | awk '{ print $3 }'; }
recompute_name() { # flags -> a short name
  case "$1" in
    "") echo none ;;
    *selective*) echo selective ;;
    *uniform*) echo "full, every layer" ;;
    *) echo "full, block ${1##* } of $L" ;;
  esac
}

# train TAG WORLD S ITERS INTERVAL TIMEOUT FLAGS -> a row file $OUTD/train_TAG.row
# fields: tag|S|world|layers|recompute|ms|tokens/s/GPU|TFLOP/s/GPU|GiB in use|GiB planned
train() {
  local tag=$1 world=$2 S=$3 iters=$4 interval=$5 tmo=$6 flags=$7 log="$OUTD/train_$1.log" row="$OUTD/train_$1.row"
  local launch=(./train_gpt) cp=()
  [ "$world" = 2 ] && launch=("${MPIRUN[@]}" ./train_gpt) && cp=(--context-parallel-size 2 --cp-comm-type "$COMM")
  # shellcheck disable=SC2206
  local cmd=(timeout "$tmo" "${launch[@]}" "${MODEL[@]}" "${RUN[@]}" "${cp[@]}" --num-layers "$L" --seq-length "$S"
    --max-position-embeddings "$S" --train-iters "$iters" --log-interval "$interval" $flags)
  echo "cp_bench: $tag: ${cmd[*]}"
  echo "# ${cmd[*]}" >"$log"
  local start rc; start=$(date +%s)
  "${cmd[@]}" >>"$log" 2>&1
  rc=$?
  local line ms tf mem planned tps
  line=$(grep -E "iteration +$iters/ +$iters \|.*elapsed time per iteration" "$log" | tail -n1)
  if [ -z "$line" ]; then
    echo "$tag|$S|$world|$L|$(recompute_name "$flags")|FAILED (exit $rc after $(($(date +%s) - start)) s, see $log)|||||" >"$row"
    tail -n 5 "$log"
    return 1
  fi
  ms=$(echo "$line" | sed 's/.*per iteration (ms): \([^ ]*\).*/\1/')
  tf=$(echo "$line" | sed 's/.*TFLOP\/s\/GPU): \([^ ]*\).*/\1/')
  mem=$(grep -m1 '^memory after' "$log" | sed 's/.*device reports \([0-9.]*\) GiB in use, the plan \([0-9.]*\) GiB.*/\1 \2/')
  planned=${mem#* }; mem=${mem% *}
  tps=$(awk -v s="$S" -v n="$world" -v ms="$ms" 'BEGIN { printf "%.0f", s / n / (ms / 1000) }')
  echo "$tag|$S|$world|$L|$(recompute_name "$flags")|$ms|$tps|$tf|$mem|$planned" >"$row"
  echo "  -> $ms ms/iter, $tps tokens/s/GPU, $tf TFLOP/s/GPU, $mem GiB in use (plan $planned); $(($(date +%s) - start)) s"
}

if want cp1 || want cp2 || want cp2a2a || want long; then
  if [ ! -x ./train_gpt ]; then
    echo "cp_bench: no ./train_gpt (the build failed: $OUTD/build_train_gpt.log)"
    for p in cp1 cp2 cp2a2a long; do want $p && echo "$p|-|-|-|-|FAILED (no train_gpt)|||||" >"$OUTD/train_${p}_nobuild.row"; done
  else
    rm -f "$OUTD"/train_*_nobuild.row
    L=${LAYERS:-$(pick_layers)}
    if [ -n "${LAYERS:-}" ]; then
      echo "cp_bench: $L layers (LAYERS)"
    else
      echo "cp_bench: $L layers, the most that fit one GPU at sequence 16384 without recompute ($(in_use "$OUTD/plan_layers.log") GiB planned)"
    fi
    if [ "$L" -lt 1 ]; then
      echo "cp_bench: not one layer fits $BUDGET GiB at sequence 16384" | tee "$OUTD/train_layers_none.row"
    fi
  fi
fi
run_seq() { # WORLD S TAG
  local world=$1 S=$2 tag=$3 flags
  rm -f "$OUTD/train_$tag.row"
  if [ "$world" -gt "$ngpu" ]; then
    echo "$tag|$S|$world|${L:-}|-|SKIPPED ($ngpu GPU(s) visible)|||||" >"$OUTD/train_$tag.row"; return
  fi
  if ! flags=$(choose_recompute "$world" "$S"); then
    echo "$tag|$S|$world|$L|-|DOES NOT FIT ($flags; see $OUTD/plan_w${world}_s$S.log)|||||" >"$OUTD/train_$tag.row"; return
  fi
  echo "cp_bench: $tag plan ($(recompute_name "$flags")): $(in_use "$OUTD/plan_w${world}_s$S.log") GiB of $BUDGET"
  train "$tag" "$world" "$S" "$ITERS" $((ITERS / 2)) "$RUN_TIMEOUT" "$flags"
}
if [ -x ./train_gpt ] && [ "${L:-0}" -ge 1 ]; then
  if want cp1; then for S in 16384 32768; do run_seq 1 "$S" "cp1_s$S"; done; fi
  if want cp2; then for S in 16384 32768; do run_seq 2 "$S" "cp2_s$S"; done; fi
  if want cp2a2a; then COMM=a2a; for S in 16384 32768; do run_seq 2 "$S" "cp2a2a_s$S"; done; COMM=p2p; fi
  if want long; then
    S=131072
    rm -f "$OUTD/train_long.row" "$OUTD/long_verdict.txt"
    # one GPU: every layer recomputed, the least memory this model can take on one GPU without offloading
    plan "$OUTD/plan_long_1gpu.log" 1 "$L" "$S" --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    rc1=$?
    case $rc1 in
      1) v1="does NOT fit" ;;
      0) v1="FITS (the goal wants it not to)" ;;
      *) v1="plan refused: $(tail -n1 "$OUTD/plan_long_1gpu.log")" ;;
    esac
    v1="one GPU (full recompute, every layer): $(in_use "$OUTD/plan_long_1gpu.log") GiB, $v1"
    echo "cp_bench: --plan at 131072, $v1"; cat "$OUTD/plan_long_1gpu.log"
    if flags=$(choose_recompute 2 "$S"); then
      cp "$OUTD/plan_w2_s$S.log" "$OUTD/plan_long_2gpu.log"
      v2="two GPUs, CP=2 ($(recompute_name "$flags")): $(in_use "$OUTD/plan_long_2gpu.log") GiB, fits"
      echo "cp_bench: --plan at 131072, $v2"; cat "$OUTD/plan_long_2gpu.log"
      printf '%s\n%s\n' "$v1" "$v2" >"$OUTD/long_verdict.txt"
      if [ "$ngpu" -ge 2 ]; then
        train long 2 "$S" "$LONG_ITERS" 1 "$LONG_TIMEOUT" "$flags"
      else
        echo "long|$S|2|$L|$(recompute_name "$flags")|SKIPPED ($ngpu GPU(s) visible)|||||" >"$OUTD/train_long.row"
      fi
    else
      v2="two GPUs, CP=2: does NOT fit ($flags)"
      printf '%s\n%s\n' "$v1" "$v2" >"$OUTD/long_verdict.txt"
      echo "long|$S|2|$L|-|DOES NOT FIT on two GPUs (see $OUTD/plan_w2_s$S.log)|||||" >"$OUTD/train_long.row"
    fi
  fi
fi

# ---- the table: every row file in $OUTD (this call's and an earlier call's) ----
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" "$1" 2>/dev/null; }
table="$OUTD/cp_bench.md"
{
  echo "## cp_bench ($(git rev-parse --short HEAD 2>/dev/null), ${gpu:-unknown GPU}, $(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  echo "Causal attention, bf16, B=1, H=32, Hkv=8, d=128, one GPU; TFLOP/s by 2*B*H*T^2*d forward, 2.5x backward:"
  echo
  echo "| T | side | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s | ours / torch (fwd+bwd) |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
  for s in "${SHAPES[@]}"; do
    T=$(echo "$s" | cut -d, -f4)
    o="$OUTD/attn_ours_$T.row" t="$OUTD/attn_torch_$T.row"
    ver=$(cut -d, -f1 "$OUTD/attn_torch_version.txt" 2>/dev/null) gqa=$(field "$t" gqa)
    for side in ours torch; do
      f="$OUTD/attn_${side}_$T.row"
      name=ours
      [ $side = torch ] && name="torch SDPA flash${ver:+ ($ver)}${gqa:+, GQA $gqa}"
      if [ -s "$f" ]; then
        ratio=""
        [ $side = ours ] && [ -s "$t" ] && ratio=$(awk -v a="$(field "$o" fwdbwd_tflops)" -v b="$(field "$t" fwdbwd_tflops)" 'BEGIN { if (b > 0) printf "%.2fx", a / b }')
        echo "| $T | $name | $(field "$f" fwd_ms) | $(field "$f" fwd_tflops) | $(field "$f" bwd_ms) | $(field "$f" bwd_tflops) | $(field "$f" fwdbwd_tflops) | $ratio |"
      else
        echo "| $T | $name | FAILED or not run (see $OUTD/attn_$side.log) | | | | | |"
      fi
    done
  done
  echo
  echo "Llama-3-8B layer shape, micro-batch 1, global batch 1, bf16; ms/iter and TFLOP/s/GPU from train_gpt's log line (Megatron's formula):"
  echo
  echo "| sequence | CP (GPUs) | layers | recompute | ms/iter | tokens/s/GPU | TFLOP/s/GPU | GiB in use (plan) | CP2 / CP1 |"
  echo "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
  for f in "$OUTD"/train_cp1_s16384.row "$OUTD"/train_cp2_s16384.row "$OUTD"/train_cp2a2a_s16384.row \
    "$OUTD"/train_cp1_s32768.row "$OUTD"/train_cp2_s32768.row "$OUTD"/train_cp2a2a_s32768.row "$OUTD"/train_long.row "$OUTD"/train_*_nobuild.row "$OUTD"/train_layers_none.row; do
    [ -s "$f" ] || continue
    IFS='|' read -r tag S world layers rec ms tps tf mem planned <"$f"
    ratio=""
    comm=""; [ "$world" = 2 ] && comm=" p2p"; [ "${tag#cp2a2a_}" != "$tag" ] && comm=" a2a"
    if [ "${tag#cp2}" != "$tag" ] && [ -s "$OUTD/train_cp1_s$S.row" ]; then
      tf1=$(cut -d'|' -f8 "$OUTD/train_cp1_s$S.row")
      ratio=$(awk -v a="$tf" -v b="$tf1" 'BEGIN { if (a > 0 && b > 0) printf "**%.2f**", a / b }')
    fi
    echo "| $S | $world$comm | $layers | $rec | $ms | $tps | $tf | ${mem:+$mem ($planned)} | $ratio |"
  done
  if [ -s "$OUTD/long_verdict.txt" ]; then
    echo
    echo "Sequence 131072, train_gpt --plan (against $BUDGET GiB):"
    sed 's/^/- /' "$OUTD/long_verdict.txt"
  fi
  echo
  echo "Goals (issue #36): CP2 / CP1 >= 0.90 at each sequence; 131072 tokens training on two GPUs where --plan says one"
  echo "does not fit. Timing: iterations $((ITERS / 2 + 1))-$ITERS of $ITERS (the long run: iteration $LONG_ITERS of $LONG_ITERS)."
} >"$table"
echo
cat "$table"
