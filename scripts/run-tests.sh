#!/usr/bin/env bash
# Runs every test of the given test binaries, each test its own process, TPFUSE_TEST_JOBS
# (default: the cores) at a time. The emulator runs a process's kernels on one device thread,
# so one test binary keeps one core busy; tests side by side keep them all.
# Prints a line per test (ok, ignored with its reason, FAILED), the whole output of every
# failure, and a line per binary; exits 1 when a test failed or a binary lists none.
#   scripts/run-tests.sh BINARY...
# The environment passes through (TPFUSE_EMU_*); with TPFUSE_EMU_REPORT set, every process
# appends its report to that file (one write each). TPFUSE_TEST_PRELOAD is the test
# processes' LD_PRELOAD (and no other process's). TPFUSE_TEST_SKIP names tests
# (BINARY::TEST, space-separated) this run leaves out: each is printed as skipped, with the
# reason in TPFUSE_TEST_SKIP_WHY, and counted apart (never as passed).
set -euo pipefail
jobs_max=${TPFUSE_TEST_JOBS:-$(nproc 2>/dev/null || echo 2)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One test in the background: $work/N.log its output, $work/N.status "rc seconds".
start() {
  local n=$1 bin=$2 test=$3
  (
    t0=$(date +%s%N)
    rc=0
    LD_PRELOAD=${TPFUSE_TEST_PRELOAD:-${LD_PRELOAD:-}} "$bin" --exact "$test" </dev/null >"$work/$n.log" 2>&1 || rc=$?
    echo "$rc $((($(date +%s%N) - t0) / 1000000))" >"$work/$n.status"
  ) &
}

failed=()
n=0
: >"$work/binaries"
: >"$work/queue"
for bin in "$@"; do
  name=$(basename "$bin" | sed 's/-[0-9a-f]*$//')
  listed=$("$bin" --list 2>/dev/null | sed -n 's/: test$//p')
  [ -n "$listed" ] || { echo "run-tests: $name lists no tests" >&2; failed+=("$name (no tests)"); continue; }
  first=$((n + 1))
  for test in $listed; do
    n=$((n + 1))
    echo "$name $test" >"$work/$n.name"
    echo "$n $bin $name::$test" >>"$work/queue"
  done
  echo "$first $n $name" >>"$work/binaries"
done
# The slowest tests first (scripts/slow-tests.txt, slowest first; a hint for the order only):
# a long test started last would keep one core busy while the others idle.
slow=$(dirname "$0")/slow-tests.txt
{
  if [ -f "$slow" ]; then
    grep -v '^#' "$slow" | while read -r want; do awk -v t="$want" '$3 == t' "$work/queue"; done
  fi
  cat "$work/queue"
} | awk '!seen[$1]++' >"$work/order"
skip=" ${TPFUSE_TEST_SKIP:-} "
while read -r i bin full; do
  if [[ "$skip" == *" $full "* ]]; then
    echo "skip" >"$work/$i.status"
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  read -r _ test <"$work/$i.name"
  start "$i" "$bin" "$test"
done <"$work/order"
wait

while read -r first last name; do
  passed=0 ignored=0 bad=0 skipped=0 ms=0
  for ((i = first; i <= last; i++)); do
    read -r _ test <"$work/$i.name"
    read -r rc t <"$work/$i.status"
    if [ "$rc" = skip ]; then
      skipped=$((skipped + 1))
      echo "test $name::$test ... skipped in this run (${TPFUSE_TEST_SKIP_WHY:-TPFUSE_TEST_SKIP})"
      continue
    fi
    ms=$((ms + t))
    if [ "$rc" -ne 0 ]; then
      bad=$((bad + 1))
      failed+=("$name::$test")
      echo "test $name::$test ... FAILED ($((t / 1000)).$((t % 1000 / 100)) s)"
      sed 's/^/    /' "$work/$i.log"
    elif grep -q '^test result: ok. 0 passed; 0 failed; 1 ignored' "$work/$i.log"; then
      ignored=$((ignored + 1))
      echo "test $name::$test ... $(sed -n "s/^test $test \.\.\. //p" "$work/$i.log")"
    else
      passed=$((passed + 1))
      echo "test $name::$test ... ok ($((t / 1000)).$((t % 1000 / 100)) s)"
    fi
  done
  echo "== $name: $passed passed, $bad failed, $ignored ignored$([ "$skipped" -eq 0 ] || echo ", $skipped skipped"); $((ms / 1000)) s of test time"
done <"$work/binaries"

if [ ${#failed[@]} -gt 0 ]; then
  printf 'run-tests: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
