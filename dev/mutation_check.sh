#!/usr/bin/env bash
# dev/mutation_check.sh — issue #38's proof that the suite catches the bugs we would make: each
# dev/mutations/<name>.patch plants one plausible bug (a few comment lines, then a `git diff`):
#
#     # mutation: <one line: the bug it plants>
#     # kills: <test_megatron filter> [np=<N>]     (one line per test that must fail; np=N: under mpirun -np N)
#
#   dev/mutation_check.sh build [VAR=value ...]
#       (the CPU machine) for each patch: a temporary copy of the working tree as it is (tracked files
#       with their uncommitted changes, and untracked files git does not ignore: the patch is made
#       against these files), the patch applied with `git apply`, `make test_megatron` there with the
#       make variables given (e.g. GPU_ARCH=90), one build at a time; the binary goes, gzip'd, to
#       dev/mutants/<name>/test_megatron.gz (ignored by git; ~2 MB each, so that the device tool's
#       64 MiB carry holds them all). A patch that does not apply is an error.
#   dev/mutation_check.sh run
#       (the GPU machine, from the repository root, with dev/mutants/ carried and the unmutated
#       ./test_megatron built) for each patch and each of its kills lines: the mutant on that filter
#       (under `mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np N` when np=N; a
#       line needing more GPUs than the machine has is "not run"), which must end with
#       `N passed, F failed, N skipped` with F >= 1 (KILLED; a run that ends without that line, a
#       crash or a timeout, also counts as killed and says so), then the unmutated ./test_megatron on
#       the same filter, which must pass (at least one test passed, none failed). A table at the end.
#   dev/mutation_check.sh check
#       (anywhere, no GPU; the host test faults_mutation_patches_apply runs it) each patch's comment
#       lines are well formed, each kills filter names a test or group of the suite, and the patch
#       applies to the working tree (`git apply --check`).
#
# Environment: MUTANTS="name ..." (only these patches; default all), TIMEOUT (seconds per run, default
# 900), LOGS (run: where each run's output goes, default /tmp/mutation_check), NGPUS (run: the GPU
# count, default from nvidia-smi -L), CLEAN=0 (run: skip the unmutated runs, when the same device run
# has just passed the suite's multi-GPU groups).
# Exit status: 0 when every listed test kills its mutant and passes unmutated; 1 when a mutant
# survives, the unmutated binary fails, a mutant is missing or a patch does not apply; 2 usage; 3 when
# nothing failed but some lines were not run (too few GPUs).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
what=${1:-}
[ $# -gt 0 ] && shift
TIMEOUT=${TIMEOUT:-900}
LOGS=${LOGS:-/tmp/mutation_check}

patches() {
  local p name
  for p in dev/mutations/*.patch; do
    [ -e "$p" ] || continue
    name=$(basename "$p" .patch)
    if [ -n "${MUTANTS:-}" ] && [[ " $MUTANTS " != *" $name "* ]]; then continue; fi
    echo "$p"
  done
}

# "filter np" per kills line of patch $1 (np 1 when not given)
kills_of() {
  sed -n 's/^# kills:[[:space:]]*//p' "$1" | while read -r filter rest; do
    np=1
    case "$rest" in np=*) np=${rest#np=} ;; "") ;; *) np=bad ;; esac
    echo "$filter $np"
  done
}

# the working tree as it is (tracked files as modified, untracked files not ignored) into $1
copy_tree() {
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$1"
}

case "$what" in
build)
  for v in "$@"; do
    case "$v" in *=*) ;; *) echo "build takes make variables (VAR=value), not '$v'" >&2; exit 2 ;; esac
  done
  command -v git >/dev/null || { echo "git is needed to copy the tree" >&2; exit 2; }
  fail=0
  for p in $(patches); do
    name=$(basename "$p" .patch)
    tmp=$(mktemp -d /tmp/mt_mutant.XXXXXX)
    echo "== $name: building in $tmp"
    copy_tree "$tmp"
    if ! (cd "$tmp" && git apply "$ROOT/$p"); then
      echo "   FAIL: $p does not apply to the working tree"; fail=1; rm -rf "$tmp"; continue
    fi
    if ! make -C "$tmp" test_megatron "$@" >"$tmp.log" 2>&1; then
      echo "   FAIL: the mutant does not build (last lines of $tmp.log):"; tail -n 15 "$tmp.log" | sed 's/^/     /'
      fail=1; rm -rf "$tmp"; continue
    fi
    mkdir -p "dev/mutants/$name"
    rm -f "dev/mutants/$name/test_megatron"
    gzip -9 -c "$tmp/test_megatron" >"dev/mutants/$name/test_megatron.gz.tmp" &&
      mv "dev/mutants/$name/test_megatron.gz.tmp" "dev/mutants/$name/test_megatron.gz"
    { echo "patch: $p"; echo "tree: $(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
      echo "make variables: $*"; date -u; } >"dev/mutants/$name/built_from.txt"
    echo "   dev/mutants/$name/test_megatron.gz ($(wc -c <"dev/mutants/$name/test_megatron.gz") bytes)"
    rm -rf "$tmp" "$tmp.log"
  done
  exit $fail
  ;;

check)
  # the suite's full test names (group.name), as the runner selects them
  names=$(${TEST_BIN:-./test_megatron} --list) || { echo "FAIL cannot list the suite's tests (build test_megatron first)"; exit 1; }
  fail=0; n=0
  for p in $(patches); do
    n=$((n + 1))
    grep -q '^# mutation: .' "$p" || { echo "FAIL $p: no '# mutation: ' line"; fail=1; }
    [ -n "$(kills_of "$p")" ] || { echo "FAIL $p: no '# kills: ' line"; fail=1; }
    while read -r filter np; do
      [ -n "$filter" ] || continue
      [[ "$np" =~ ^[1-9][0-9]*$ ]] || { echo "FAIL $p: kills $filter: np must be np=<N>"; fail=1; }
      grep -qF -- "$filter" <<<"$names" || { echo "FAIL $p: kills $filter: no test or group of the suite has that in its name"; fail=1; }
    done < <(kills_of "$p")
    if ! err=$(git apply --check "$p" 2>&1); then echo "FAIL $p does not apply to the working tree: $err"; fail=1; fi
  done
  echo "mutation patches checked: $n, $([ $fail -eq 0 ] && echo 'all well formed and applying' || echo 'some FAILED')"
  exit $fail
  ;;

run)
  [ -x ./test_megatron ] || { echo "./test_megatron is not built (make test_megatron)" >&2; exit 2; }
  mkdir -p "$LOGS"
  gpus=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  summary_re='^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'
  # runs binary $1 on filter $2 with np $3, output to $4; prints "passed failed skipped rc" (-1s without a summary)
  run_one() {
    local bin=$1 filter=$2 np=$3 log=$4 rc
    if [ "$np" -gt 1 ]; then
      timeout -k 30 "$TIMEOUT" mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np "$np" \
        "$bin" "$filter" >"$log" 2>&1 </dev/null
    else
      timeout -k 30 "$TIMEOUT" "$bin" "$filter" >"$log" 2>&1 </dev/null
    fi
    rc=$?
    local last; last=$(grep -E "$summary_re" "$log" | tail -n 1)
    if [ -n "$last" ]; then echo "$(sed 's/ passed, / /; s/ failed, / /; s/ skipped//' <<<"$last") $rc"
    else echo "-1 -1 -1 $rc"; fi
  }
  declare -A clean_result
  rows=(); survived=0; clean_bad=0; not_run=0; missing=0
  for p in $(patches); do
    name=$(basename "$p" .patch)
    dir="dev/mutants/$name"
    bin="$dir/test_megatron"
    if [ ! -x "$bin" ] && [ -f "$bin.gz" ]; then
      gzip -dc "$bin.gz" >"$LOGS/$name.bin" && chmod +x "$LOGS/$name.bin" && bin="$LOGS/$name.bin"
    fi
    if [ ! -x "$bin" ]; then
      rows+=("| $name | (all) | | NOT BUILT: dev/mutation_check.sh build | |"); missing=1; continue
    fi
    while read -r filter np; do
      [ -n "$filter" ] || continue
      if ! [[ "$np" =~ ^[1-9][0-9]*$ ]]; then rows+=("| $name | $filter | ? | bad kills line | |"); missing=1; continue; fi
      if [ "$np" -gt "$gpus" ]; then
        plural=s; [ "$np" -eq 1 ] && plural=
        rows+=("| $name | $filter | $np | not run (needs $np GPU$plural, $gpus here) | |"); not_run=1; continue
      fi
      tag="${name}__${filter}__np$np"
      echo "== $name: $filter (np $np)"
      read -r pa fa sa rc < <(run_one "$bin" "$filter" "$np" "$LOGS/$tag.mutant.log")
      if [ "$fa" -ge 1 ]; then verdict="KILLED ($fa failed)"
      elif [ "$fa" -lt 0 ]; then
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="KILLED (timed out after ${TIMEOUT} s, no summary line)"
        else verdict="KILLED (crashed: exit $rc, no summary line)"; fi
      elif [ "$pa" -eq 0 ]; then verdict="SURVIVED (nothing ran: $sa skipped)"; survived=1
      else verdict="SURVIVED ($pa passed)"; survived=1; fi
      key="$filter np$np"
      if [ "${CLEAN:-1}" = 0 ]; then clean_result[$key]="passes (not rerun: CLEAN=0, the suite's run stands)"; fi
      if [ -z "${clean_result[$key]:-}" ]; then
        read -r pc fc sc rcc < <(run_one ./test_megatron "$filter" "$np" "$LOGS/clean__${filter}__np$np.log")
        if [ "$fc" -eq 0 ] && [ "$pc" -ge 1 ] && [ "$rcc" -eq 0 ]; then clean_result[$key]="passes ($pc passed)"
        elif [ "$fc" -lt 0 ]; then clean_result[$key]="FAILS (exit $rcc, no summary line)"
        elif [ "$pc" -eq 0 ] && [ "$fc" -eq 0 ]; then clean_result[$key]="FAILS (nothing ran: $sc skipped)"
        else clean_result[$key]="FAILS ($fc failed)"; fi
      fi
      [[ "${clean_result[$key]}" == passes* ]] || clean_bad=1
      echo "   mutant: $verdict; unmutated: ${clean_result[$key]}"
      rows+=("| $name | $filter | $np | $verdict | ${clean_result[$key]} |")
    done < <(kills_of "$p")
  done
  echo
  echo "| mutation | test | np | mutant | unmutated ./test_megatron |"
  echo "| --- | --- | ---: | --- | --- |"
  printf '%s\n' "${rows[@]}"
  echo "(each run's output: $LOGS)"
  if [ $survived -ne 0 ] || [ $clean_bad -ne 0 ] || [ $missing -ne 0 ]; then
    echo "mutation check: FAILED"; exit 1
  fi
  if [ $not_run -ne 0 ]; then echo "mutation check: every line run was killed and passes unmutated; some were not run"; exit 3; fi
  echo "mutation check: every mutant killed by every listed test, each test passing unmutated"
  exit 0
  ;;

*)
  echo "usage: dev/mutation_check.sh build [VAR=value ...] | run | check   (see the comment at the top)" >&2
  exit 2
  ;;
esac
