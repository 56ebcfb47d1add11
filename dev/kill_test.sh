#!/usr/bin/env bash
# dev/kill_test.sh — crash consistency under kill -9 (issue #23). Each tool that writes a result is
# started again and again and killed with SIGKILL at moments spread over its whole run (the last ones
# land in the commit at the end). After every kill a reader must find either the old complete result
# or nothing it accepts (never a mix of old and new files; a dataset is always found, old or new); the
# next run of the same tool must succeed and leave no temporaries behind.
#
#   dev/kill_test.sh          CPU: preprocess_data with two --json-keys, merge_datasets, convert_hf
#                             --import and --export (needs `make all` and python3 with numpy)
#   dev/kill_test.sh gpu      then train_gpt (needs a GPU): kill -9 during --save (the tracked checkpoint
#                             always loads); kill -9 at random moments of a run with --async-save every
#                             iteration, after its first committed save (ASYNC_TRIALS, default 24: the
#                             tracked checkpoint is the newest
#                             complete one and the resumed run continues bitwise); SIGTERM with
#                             --exit-signal-handler (saves, exits 0, and the resumed run's losses equal an
#                             uninterrupted run's, bitwise)
#   TRIALS=N (default 12) kills per tool; WORK=DIR (default /tmp/mt_kill_test.<pid>, removed at the end);
#   PARTS="cpu save async sigterm" (the default with gpu; cpu alone without) runs only the parts named
#
# What the readers are: prepro/dataset_info (the .bin/.idx reader) for datasets; convert_hf --export
# (the checkpoint reader: every header word and the file sizes) for checkpoints; for a Hugging Face
# directory, config.json present means "accepted", and then config.json and the weights must be one
# export's (their checksums). The last line is "kill test: N failures" (exit status 1 if N > 0).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-cpu}
TRIALS=${TRIALS:-12}
if [ "$what" = gpu ]; then PARTS=${PARTS:-cpu save async sigterm}; else PARTS=${PARTS:-cpu}; fi
part() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
WORK=${WORK:-/tmp/mt_kill_test.$$}
rm -rf "$WORK"
mkdir -p "$WORK"
FAILED=0
fail() { echo "  FAIL: $*"; FAILED=$((FAILED + 1)); }
for tool in prepro/preprocess_data prepro/merge_datasets prepro/dataset_info prepro/convert_hf; do
  [ -x "$tool" ] || { echo "$tool is not built: make all"; exit 2; }
done

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
sums() { cat "$@" 2>/dev/null | md5sum | cut -d' ' -f1; } # a set of files as one checksum
temporaries() { find "$1" -maxdepth 1 -name '*.tmp*' 2>/dev/null | wc -l; }

# ms it takes to run "$@" (to completion, output dropped)
duration_ms() {
  local t0; t0=$(now_ms)
  "$@" >/dev/null 2>&1 || { echo "  the reference run failed: $*" >&2; echo 0; return; }
  echo $(( $(now_ms) - t0 ))
}

# ms from the start of "$@" until its output first holds $1 (the run goes on to its end); 0 if never
ms_until() {
  local pattern=$1; shift
  local t0 at=0 log=$WORK/until.log
  t0=$(now_ms)
  "$@" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$at" -eq 0 ] && grep -q "$pattern" "$log"; then at=$(( $(now_ms) - t0 )); fi
    sleep 0.01
  done
  wait "$pid"
  if [ "$at" -eq 0 ] && grep -q "$pattern" "$log"; then at=$(( $(now_ms) - t0 )); fi
  echo "$at"
}

# the kill moments: TRIALS points spread over the run, the last ones in its final tenth (the commit)
delays_ms() {
  local total=$1 k
  for k in $(seq 1 "$TRIALS"); do
    if [ "$k" -le $(( TRIALS * 2 / 3 )) ]; then echo $(( total * k / (TRIALS * 2 / 3 + 1) ));
    else echo $(( total * 9 / 10 + total * (k - TRIALS * 2 / 3) / (10 * (TRIALS - TRIALS * 2 / 3)) )); fi
  done
}

# starts "$@", kills it with SIGKILL after $1 ms if it still runs; prints "killed" or "finished"
run_killed() {
  local ms=$1; shift
  "$@" >/dev/null 2>&1 &
  local pid=$!
  sleep "$(awk "BEGIN { printf \"%.3f\", $ms / 1000 }")"
  if kill -9 "$pid" 2>/dev/null; then wait "$pid" 2>/dev/null; echo killed; else wait "$pid"; echo finished; fi
}

# The commit at a run's end is a few renames; timed kills rarely land between them. With strace on
# the PATH every rename is held for 0.2 s after it happened, and the tool (strace's child; a traced
# process would outlive its tracer) is killed once $1 renames have run: a crash after each rename.
HAVE_STRACE=0
command -v strace >/dev/null && strace -qq -o /dev/null -e trace=/^rename true 2>/dev/null && HAVE_STRACE=1
run_killed_after_renames() {
  local n=$1; shift
  local log=$WORK/strace.log
  rm -f "$log"
  strace -f -qq --seccomp-bpf -o "$log" -e trace=/^rename -e inject=/^rename:delay_exit=200000 "$@" >/dev/null 2>&1 &
  local spid=$! child=""
  for _ in $(seq 1 6000); do
    [ "$(cat "$log" 2>/dev/null | grep -c rename)" -ge "$n" ] && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.01
  done
  child=$(pgrep -P "$spid" | head -1)
  [ -n "$child" ] && kill -9 "$child" 2>/dev/null
  wait "$spid" 2>/dev/null
}
# how many renames a whole run of "$@" makes (0 without strace)
count_renames() {
  [ "$HAVE_STRACE" -eq 1 ] || { echo 0; return; }
  strace -f -qq --seccomp-bpf -o "$WORK/strace.log" -e trace=/^rename "$@" >/dev/null 2>&1
  cat "$WORK/strace.log" 2>/dev/null | grep -c rename
}
# the kills of one tool: TRIALS timed ones ("t<ms>"), then one after each rename ("r<n>")
kill_points() {
  local ms=$1 renames=$2 d n
  for d in $(delays_ms "$ms"); do echo "t$d"; done
  for n in $(seq 1 "$renames"); do echo "r$n"; done
}
kill_at() { # kill_at t<ms>|r<n> CMD...
  local point=$1; shift
  case $point in
    t*) run_killed "${point#t}" "$@" >/dev/null ;;
    r*) run_killed_after_renames "${point#r}" "$@" ;;
  esac
}

# one dataset prefix: refused (one line), or exactly the old or the new pair; prints old|new|nothing.
# With no .idx at its name the reader reads the old pair where the commit moved it aside
# (<prefix>.idx.tmp.<pid>.old, and <prefix>.bin.tmp.<pid>.old once the .bin was moved too).
dataset_state() {
  local prefix=$1 old=$2 new=$3
  if prepro/dataset_info --data-path "$prefix" >/dev/null 2>"$WORK/reader.err"; then
    local idx=$prefix.idx bin=$prefix.bin
    if [ ! -e "$idx" ]; then
      idx=$(ls "$prefix".idx.tmp.*.old 2>/dev/null | head -1)
      local aside=${idx%.old}; aside=$prefix.bin.tmp.${aside##*.tmp.}.old
      [ -e "$aside" ] && bin=$aside
    fi
    local s; s=$(sums "$bin" "$idx")
    if [ "$s" = "$old" ]; then echo old; elif [ "$s" = "$new" ]; then echo new; else echo MIXED; fi
  else
    [ "$(wc -l < "$WORK/reader.err")" -eq 1 ] || fail "$prefix refused without one line: $(cat "$WORK/reader.err")"
    echo nothing
  fi
}

summary() { sort | uniq -c | awk '{ printf "%s %s, ", $1, $2 }'; }

if part cpu; then
# ---- the inputs ----------------------------------------------------------------------------------
echo "inputs in $WORK"
python3 - "$WORK" <<'EOF'
import json, sys, numpy as np
work = sys.argv[1]
text = open("dev/data/tinyshakespeare.txt", encoding="utf-8").read().split("\n\n")
for name, order in (("old", 1), ("new", -1)):          # two corpora of different content
    with open(f"{work}/{name}.jsonl", "w") as f:
        for rep in range(12):
            for i, passage in enumerate(text[::order]):
                f.write(json.dumps({"text": passage, "title": f"{name} {rep} {i} " + passage[:40]}) + "\n")
# two GPT-2 checkpoints in Hugging Face's layout (config.json + model.safetensors, F32), ~50M parameters
L, h, V, P = 8, 512, 50257, 1024
def tensors(seed):
    rng = np.random.default_rng(seed)
    def w(*shape): return (rng.standard_normal(shape, dtype=np.float32) * 0.02)
    out = {"transformer.wte.weight": w(V, h), "transformer.wpe.weight": w(P, h)}
    for l in range(L):
        p = f"transformer.h.{l}."
        out.update({p + "ln_1.weight": np.ones(h, np.float32), p + "ln_1.bias": np.zeros(h, np.float32),
                    p + "attn.c_attn.weight": w(h, 3 * h), p + "attn.c_attn.bias": np.zeros(3 * h, np.float32),
                    p + "attn.c_proj.weight": w(h, h), p + "attn.c_proj.bias": np.zeros(h, np.float32),
                    p + "ln_2.weight": np.ones(h, np.float32), p + "ln_2.bias": np.zeros(h, np.float32),
                    p + "mlp.c_fc.weight": w(h, 4 * h), p + "mlp.c_fc.bias": np.zeros(4 * h, np.float32),
                    p + "mlp.c_proj.weight": w(4 * h, h), p + "mlp.c_proj.bias": np.zeros(h, np.float32)})
    out["transformer.ln_f.weight"] = np.ones(h, np.float32)
    out["transformer.ln_f.bias"] = np.zeros(h, np.float32)
    return out
for name, seed in (("hf_a", 1), ("hf_b", 2)):
    import os
    os.makedirs(f"{work}/{name}", exist_ok=True)
    json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": L, "n_embd": h, "n_head": 8,
               "n_positions": P, "vocab_size": V}, open(f"{work}/{name}/config.json", "w"))
    t = tensors(seed)
    header, offset = {}, 0
    for k, a in t.items():
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - (8 + len(hb)) % 8) % 8)
    with open(f"{work}/{name}/model.safetensors", "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in t.values(): f.write(a.tobytes())
EOF
[ -f "$WORK/hf_b/model.safetensors" ] || { echo "could not make the inputs (python3 with numpy)"; exit 2; }

# ---- preprocess_data: two --json-keys, one set ---------------------------------------------------
echo "preprocess_data (--json-keys text title), $TRIALS kills"
PP=(prepro/preprocess_data --tokenizer-type GPT2BPETokenizer --vocab-file dev/data/gpt2/gpt2-vocab.json
    --merge-file dev/data/gpt2/gpt2-merges.txt --json-keys text title --append-eod --workers 2 --quiet)
mkdir -p "$WORK/pp"
"${PP[@]}" --input "$WORK/new.jsonl" --output-prefix "$WORK/pp/ref" >/dev/null || fail "preprocess_data (new) failed"
ms=$(duration_ms "${PP[@]}" --input "$WORK/old.jsonl" --output-prefix "$WORK/pp/corpus")
declare -A OLD NEW
for key in text title; do
  OLD[$key]=$(sums "$WORK/pp/corpus_${key}_document.bin" "$WORK/pp/corpus_${key}_document.idx")
  NEW[$key]=$(sums "$WORK/pp/ref_${key}_document.bin" "$WORK/pp/ref_${key}_document.idx")
done
renames=$(count_renames "${PP[@]}" --input "$WORK/old.jsonl" --output-prefix "$WORK/pp/corpus")
states=""
for d in $(kill_points "$ms" "$renames"); do
  kill_at "$d" "${PP[@]}" --input "$WORK/new.jsonl" --output-prefix "$WORK/pp/corpus"
  for key in text title; do
    s=$(dataset_state "$WORK/pp/corpus_${key}_document" "${OLD[$key]}" "${NEW[$key]}")
    [ "$s" = MIXED ] && fail "preprocess_data killed at $d: $key's .bin and .idx are of two runs"
    [ "$s" = nothing ] && fail "preprocess_data killed at $d: no $key dataset found (the old one must stay until replaced)"
    states+="$s "
  done
  # back to the old result for the next trial (each trial replaces old by new)
  "${PP[@]}" --input "$WORK/old.jsonl" --output-prefix "$WORK/pp/corpus" >/dev/null || fail "the rerun after a kill failed"
  [ "$(temporaries "$WORK/pp")" -eq 0 ] || fail "temporaries left after the rerun: $(ls "$WORK/pp" | grep tmp)"
done
echo "  datasets found after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run, $renames renames)"

# ---- merge_datasets --------------------------------------------------------------------------------
echo "merge_datasets, $TRIALS kills"
mkdir -p "$WORK/merge_old" "$WORK/merge_new" "$WORK/merged"
for i in $(seq -w 1 12); do
  for e in bin idx; do
    ln -f "$WORK/pp/corpus_text_document.$e" "$WORK/merge_old/part$i.$e"
    ln -f "$WORK/pp/ref_text_document.$e" "$WORK/merge_new/part$i.$e"
  done
done
prepro/merge_datasets --input "$WORK/merge_new" --output-prefix "$WORK/merged/ref" >/dev/null || fail "merge (new) failed"
ms=$(duration_ms prepro/merge_datasets --input "$WORK/merge_old" --output-prefix "$WORK/merged/m")
old=$(sums "$WORK/merged/m.bin" "$WORK/merged/m.idx"); new=$(sums "$WORK/merged/ref.bin" "$WORK/merged/ref.idx")
renames=$(count_renames prepro/merge_datasets --input "$WORK/merge_old" --output-prefix "$WORK/merged/m")
states=""
for d in $(kill_points "$ms" "$renames"); do
  kill_at "$d" prepro/merge_datasets --input "$WORK/merge_new" --output-prefix "$WORK/merged/m"
  s=$(dataset_state "$WORK/merged/m" "$old" "$new")
  [ "$s" = MIXED ] && fail "merge_datasets killed at $d: its .bin and .idx are of two runs"
  [ "$s" = nothing ] && fail "merge_datasets killed at $d: no dataset found (the old one must stay until replaced)"
  states+="$s "
  prepro/merge_datasets --input "$WORK/merge_old" --output-prefix "$WORK/merged/m" >/dev/null || fail "the rerun failed"
  [ "$(temporaries "$WORK/merged")" -eq 0 ] || fail "temporaries left after the rerun"
done
echo "  datasets found after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run, $renames renames)"

# ---- convert_hf --import: a checkpoint or nothing, and the retry is never blocked ----------------
echo "convert_hf --import, $TRIALS kills"
ms=$(duration_ms prepro/convert_hf --import "$WORK/hf_a" --save "$WORK/ck_a")
prepro/convert_hf --import "$WORK/hf_b" --save "$WORK/ck_b" >/dev/null || fail "import of hf_b failed"
rm -rf "$WORK/ck"
renames=$(count_renames prepro/convert_hf --import "$WORK/hf_a" --save "$WORK/ck")
states=""
for d in $(kill_points "$ms" "$renames"); do
  rm -rf "$WORK/ck"
  kill_at "$d" prepro/convert_hf --import "$WORK/hf_a" --save "$WORK/ck"
  if [ -e "$WORK/ck/latest_checkpointed_iteration.txt" ]; then
    prepro/convert_hf --export "$WORK/ck" --out "$WORK/probe" >/dev/null 2>"$WORK/reader.err" \
      || fail "import killed at $d: a tracked checkpoint does not load: $(cat "$WORK/reader.err")"
    states+="complete "
  else
    states+="nothing "
    prepro/convert_hf --import "$WORK/hf_a" --save "$WORK/ck" >/dev/null 2>"$WORK/reader.err" \
      || fail "import killed at $d: the retry failed: $(cat "$WORK/reader.err")"
  fi
  [ "$(temporaries "$WORK/ck")" -eq 0 ] || fail "import killed at $d: temporaries left after the retry"
done
echo "  checkpoints found after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run, $renames renames)"

# ---- convert_hf --export: the old export, or no config.json ----------------------------------------
echo "convert_hf --export, $TRIALS kills"
prepro/convert_hf --export "$WORK/ck_b" --out "$WORK/hf_ref" >/dev/null || fail "export of ck_b failed"
ms=$(duration_ms prepro/convert_hf --export "$WORK/ck_a" --out "$WORK/hf_out")
old=$(sums "$WORK/hf_out/config.json" "$WORK/hf_out/model.safetensors")
new=$(sums "$WORK/hf_ref/config.json" "$WORK/hf_ref/model.safetensors")
renames=$(count_renames prepro/convert_hf --export "$WORK/ck_a" --out "$WORK/hf_out")
states=""
for d in $(kill_points "$ms" "$renames"); do
  kill_at "$d" prepro/convert_hf --export "$WORK/ck_b" --out "$WORK/hf_out"
  if [ -e "$WORK/hf_out/config.json" ]; then
    s=$(sums "$WORK/hf_out/config.json" "$WORK/hf_out/model.safetensors")
    if [ "$s" = "$old" ]; then states+="old "; elif [ "$s" = "$new" ]; then states+="new ";
    else fail "export killed at $d: config.json and model.safetensors are of two exports"; fi
  else
    states+="nothing "
  fi
  prepro/convert_hf --export "$WORK/ck_a" --out "$WORK/hf_out" >/dev/null || fail "the re-export failed"
  [ "$(temporaries "$WORK/hf_out")" -eq 0 ] || fail "export: temporaries left after the rerun"
done
echo "  exports found after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run, $renames renames)"

fi # part cpu

# ---- train_gpt (GPU) ---------------------------------------------------------------------------------
if [ "$what" = gpu ]; then
  [ -x ./train_gpt ] && [ -x prepro/checkpoint_tool ] || { echo "./train_gpt or prepro/checkpoint_tool is not built"; exit 2; }
  # the built-in job with a small model (3.3M parameters: 40 MB checkpoints, against 360 MB for the
  # built-in 30M, whose saves every 1-2 iterations made a run take 13 s on an H100, mostly writing)
  TG=(./train_gpt --train-iters 40 --log-interval 1 --eval-interval 0 --sample-tokens 0 --num-layers 2 --hidden-size 64
      --num-attention-heads 2)
  # the losses of log $1's iterations after $2, as printed (%.6E): two runs compare bitwise
  loss_after() { grep -o 'iteration *[0-9]*/ *[0-9]* .*lm loss: [0-9.E+-]*' "$1" | awk -v from="$2" '{ split($2, a, "/"); if (a[1] + 0 > from) print a[1], $NF }'; }
  if part save; then
  echo "train_gpt: kill -9 while saving every 2 iterations, $TRIALS kills"
  ms=$(duration_ms "${TG[@]}" --save "$WORK/tg_ref" --save-interval 2)
  states=""
  for d in $(kill_points "$ms" 0) r1 r2 r3 r8 r9 r10; do  # r<n>: a save's renames (dir aside, dir in, tracker)
    rm -rf "$WORK/tg"
    kill_at "$d" "${TG[@]}" --save "$WORK/tg" --save-interval 2
    if [ -e "$WORK/tg/latest_checkpointed_iteration.txt" ]; then
      prepro/convert_hf --export "$WORK/tg" --out "$WORK/tg_probe" >/dev/null 2>"$WORK/reader.err" \
        || fail "train_gpt killed at $d: the tracked checkpoint does not load: $(cat "$WORK/reader.err")"
      # the manifest (written last, before the rename) verifies: headers, sizes, checksums
      prepro/checkpoint_tool verify "$WORK/tg" >/dev/null 2>"$WORK/verify.err" \
        || fail "train_gpt killed at $d: the tracked checkpoint does not verify: $(cat "$WORK/verify.err")"
      states+="iteration_$(cat "$WORK/tg/latest_checkpointed_iteration.txt") "
      # and the run resumes from it, saves again (tidying what the killed save left) and finishes
      "${TG[@]}" --load "$WORK/tg" --save "$WORK/tg" --save-interval 2 >"$WORK/tg_resume.log" 2>&1 \
        || fail "train_gpt killed at $d: the resumed run failed: $(tail -1 "$WORK/tg_resume.log")"
      [ -z "$(find "$WORK/tg" -maxdepth 1 \( -name '.tmp_iter_*' -o -name '*.old' \))" ] \
        || fail "train_gpt: a killed save's leftovers survived the next save"
    else
      states+="nothing "
    fi
  done
  echo "  checkpoints found after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run)"
  fi # part save

  # --async-save: a save every iteration, written in the background while the next steps run; kill -9
  # at random moments. The tracked checkpoint is always a complete one (its manifest verifies), the
  # newest complete one or (a kill between the rename and the tracker) the one before it; the run
  # resumed from it loads exactly it and its losses equal the uninterrupted run's, bitwise.
  if part async; then
  ATRIALS=${ASYNC_TRIALS:-24}
  TA=("${TG[@]}" --async-save --save-interval 1)
  echo "train_gpt --async-save: kill -9 at random moments of a run saving every iteration, $ATRIALS kills"
  "${TG[@]}" --save "$WORK/ta_straight" >"$WORK/async_straight.log" 2>&1 || fail "the uninterrupted run failed"
  ms=$(duration_ms "${TA[@]}" --save "$WORK/ta_ref")
  # the kills fall after the first committed save (an earlier one leaves nothing to resume from:
  # at cf9b28b 10 of 24 uniform kills did), uniformly up to the run's end
  rm -rf "$WORK/ta_first"
  first=$(ms_until "saved checkpoint at iteration" "${TA[@]}" --save "$WORK/ta_first")
  [ "$first" -gt 0 ] && [ "$first" -lt "$ms" ] || first=0
  states=""
  for k in $(seq 1 "$ATRIALS"); do
    d=$(( first + (RANDOM * 32768 + RANDOM) % (ms - first > 0 ? ms - first : 1) ))
    rm -rf "$WORK/ta"
    kill_at "t$d" "${TA[@]}" --save "$WORK/ta"
    if [ ! -e "$WORK/ta/latest_checkpointed_iteration.txt" ]; then states+="nothing "; continue; fi
    tracked=$(cat "$WORK/ta/latest_checkpointed_iteration.txt")
    newest=-1
    for it_dir in "$WORK"/ta/iter_*; do
      [ -d "$it_dir" ] || continue
      it=$((10#${it_dir##*iter_}))
      prepro/checkpoint_tool verify "$WORK/ta" --iteration "$it" >/dev/null 2>&1 && [ "$it" -gt "$newest" ] && newest=$it
    done
    prepro/checkpoint_tool verify "$WORK/ta" >/dev/null 2>"$WORK/verify.err" \
      || fail "async, killed at ${d} ms: the tracked checkpoint ($tracked) does not verify: $(cat "$WORK/verify.err")"
    if [ "$tracked" = "$newest" ]; then states+="newest "
    elif [ "$tracked" = "$((newest - 1))" ]; then states+="untracked_newest "
    else fail "async, killed at ${d} ms: the tracker says $tracked, the newest complete checkpoint is $newest"; fi
    "${TA[@]}" --load "$WORK/ta" --save "$WORK/ta" >"$WORK/ta_resume.log" 2>&1 \
      || fail "async, killed at ${d} ms: the resumed run failed: $(tail -1 "$WORK/ta_resume.log")"
    grep -q "loaded checkpoint from $WORK/ta at iteration $tracked " "$WORK/ta_resume.log" \
      || fail "async, killed at ${d} ms: the resumed run did not load iteration $tracked"
    [ "$tracked" -ge 40 ] || { [ -n "$(loss_after "$WORK/ta_resume.log" "$tracked")" ] \
      && [ "$(loss_after "$WORK/ta_resume.log" "$tracked")" = "$(loss_after "$WORK/async_straight.log" "$tracked")" ]; } \
      || fail "async, killed at ${d} ms: the losses after iteration $tracked differ from the uninterrupted run's"
    [ -z "$(find "$WORK/ta" -maxdepth 1 \( -name '.tmp_iter_*' -o -name '*.old' \))" ] \
      || fail "async: a killed save's leftovers survived the next save"
  done
  echo "  tracked checkpoints after the kills: $(echo $states | tr ' ' '\n' | summary)(${ms} ms a run, the first save committed at ${first} ms)"
  fi # part async

  if part sigterm; then
  echo "train_gpt: SIGTERM with --exit-signal-handler, then resume"
  # 400 iterations (the small model runs a few ms each): the signal, sent once iteration 12 is logged,
  # lands well before the end
  TS=("${TG[@]}" --train-iters 400)
  "${TS[@]}" --save "$WORK/tg_straight" >"$WORK/straight.log" 2>&1 || fail "the uninterrupted run failed"
  rm -rf "$WORK/tg_term"
  "${TS[@]}" --save "$WORK/tg_term" --exit-signal-handler >"$WORK/term.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q "iteration  *12/" "$WORK/term.log" 2>/dev/null && break; sleep 0.05; done
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  [ "$rc" -eq 0 ] || fail "SIGTERM: exit status $rc, want 0"
  grep -q "exiting program after receiving SIGTERM" "$WORK/term.log" || fail "SIGTERM: no 'exiting program' line"
  stop=$(cat "$WORK/tg_term/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  grep -q "saved checkpoint at iteration $stop " "$WORK/term.log" || fail "SIGTERM: no checkpoint saved at the stop ($stop)"
  grep -q "iteration  *400/" "$WORK/term.log" && fail "SIGTERM: the run reached its end before the signal"
  "${TS[@]}" --load "$WORK/tg_term" --save "$WORK/tg_term" >"$WORK/resume.log" 2>&1 || fail "SIGTERM: the resume failed"
  # the losses after the stop equal the uninterrupted run's, bitwise (as printed: %.6E)
  if [ "$stop" != none ] && [ "$(loss_after "$WORK/resume.log" "$stop")" = "$(loss_after "$WORK/straight.log" "$stop")" ] \
     && [ -n "$(loss_after "$WORK/resume.log" "$stop")" ]; then
    echo "  stopped at iteration $stop, resumed: iterations $((stop + 1))..400 equal the uninterrupted run's"
  else
    fail "SIGTERM: the resumed losses differ from the uninterrupted run's (stop $stop)"
  fi
  fi # part sigterm
fi

rm -rf "$WORK"
echo "kill test: $FAILED failures"
[ "$FAILED" -eq 0 ]
