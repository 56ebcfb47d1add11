#!/usr/bin/env bash
# dev/fuzz/run.sh SECONDS TARGET... — runs each libFuzzer target for SECONDS on its seed corpus
# (dev/fuzz/corpus/<name>/, read only: new inputs go to a temporary directory) with its dictionary
# (dev/fuzz/<name>.dict) when there is one. Extra libFuzzer flags: FUZZ_ARGS (e.g. "-jobs=4 -workers=4").
# Fails on the first target that finds a crash, a leak, undefined behaviour or a timeout (the reproducer
# is left as dev/fuzz/crash-* / timeout-* / leak-* / oom-*).
set -euo pipefail
seconds=$1
shift
cd "$(dirname "$0")/../.."
status=0
for bin in "$@"; do
  name=$(basename "$bin")
  name=${name#fuzz_}
  work=$(mktemp -d)
  dict=()
  [ -f "dev/fuzz/$name.dict" ] && dict=(-dict="dev/fuzz/$name.dict")
  echo "== fuzz_$name: ${seconds}s"
  if ! "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix=dev/fuzz/ "${dict[@]}" ${FUZZ_ARGS:-} "$work" "dev/fuzz/corpus/$name" 2>"$work.log"; then
    tail -n 60 "$work.log"
    echo "fuzz_$name: FAILED (reproducer: dev/fuzz/crash-*, timeout-*, leak-* or oom-*)"
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::average_exec_per_sec|Done [0-9]+ runs" "$work.log" | tr '\n' ' '
    echo
  fi
  rm -rf "$work" "$work.log"
  [ $status -ne 0 ] && break
done
exit $status
