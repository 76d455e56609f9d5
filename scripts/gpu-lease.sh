#!/usr/bin/env bash
# Runs the GPU bundle on a lent GPU machine (the workplace's device tool) inside a fixed time,
# from the repository root there, with dist/tpfuse-gpu-bundle.tar.xz carried (scripts/gpu-bundle.sh
# builds it here; the machine has no Rust and no network):
#
#   scripts/gpu-lease.sh SECONDS [TEST_SECONDS]
#
# doctor, selftest and the tests get the first TEST_SECONDS (default: half), each test binary
# at most 90 s; the benches get what is left, less 20 s to pack the logs. The benches print
# only their summary tables (from their own event-timed medians): criterion's sampling is
# filtered out, which takes a GPU minute per bench binary. A step that would start past its
# share is recorded as skipped. Everything lands in $OUT: summary.txt (each step, exit code,
# seconds), logs.tgz (every step's log), env.txt (GPU, driver, libraries found). host_cost then
# runs once more with criterion's sampling (bench/host-cost-sampled.log).
set -u
total=${1:?usage: scripts/gpu-lease.sh SECONDS [TEST_SECONDS]}
tests_share=${2:-$((total / 2))}
out=${OUT:?OUT must name the folder that comes back}
start=$(date +%s)
here=$(pwd)
work=$(mktemp -d)
bundle=$work/tpfuse-gpu-bundle
tar -C "$work" -xJf "$here/dist/tpfuse-gpu-bundle.tar.xz" ||
  { echo "no bundle (carry dist/tpfuse-gpu-bundle.tar.xz)"; exit 2; }

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi 2>&1 | head -n 20
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1
  uname -a
  ldd --version 2>&1 | head -n 1
} >"$out/env.txt"

# cuBLASLt for the gemm bench's reference (the CUDA 13 wheel or toolkit on the image).
lt=$(find /opt /usr/local /usr/lib -name 'libcublasLt.so.1[0-9]*' 2>/dev/null | head -n 1)
if [ -n "$lt" ]; then
  export LD_LIBRARY_PATH="$(dirname "$lt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
echo "cuBLASLt: ${lt:-not found}" >>"$out/env.txt"

export TPFUSE_BUNDLE_DEADLINE=$((start + tests_share))
TPFUSE_STEP_TIMEOUT=90 TPFUSE_BUNDLE_STEPS=doctor,selftest,tests \
  "$bundle/run.sh" "$work/tests" >"$work/tests.out" 2>&1
grep -h "^test .* FAILED\|panicked\|^failures:" "$work"/tests/*.log 2>/dev/null | head -n 40

export TPFUSE_BUNDLE_DEADLINE=$((start + total - 20))
TPFUSE_STEP_TIMEOUT=120 TPFUSE_BUNDLE_STEPS=bench \
  TPFUSE_BENCH_ARGS="--noplot no-criterion-sampling-on-a-lease" \
  "$bundle/run.sh" "$work/bench" >"$work/bench.out" 2>&1

# host_cost measures nothing with criterion's sampling filtered out (its numbers are
# criterion's): it runs again here with sampling, short, if the lease has a minute left.
if [ $((start + total - 20 - $(date +%s))) -ge 60 ]; then
  (cd "$work/bench" && CRITERION_HOME="$work/bench/criterion-host-cost" \
    timeout --kill-after=5 55 "$bundle/benches/host_cost" --bench --noplot \
    --warm-up-time 1 --measurement-time 2 >host-cost-sampled.log 2>&1
  echo "host_cost sampled: exit $?" >>summary.txt)
fi

cat "$work/tests/summary.txt" "$work/bench/summary.txt" >"$out/summary.txt" 2>/dev/null
(cd "$work" && tar czf "$out/logs.tgz" tests bench tests.out bench.out)
for f in "$work"/bench/bench-*.log "$work"/bench/host-cost-sampled.log; do
  [ -e "$f" ] && grep -v '^Benchmarking\|^$' "$f" | tail -n 80
done
echo
cat "$out/summary.txt"
echo "gpu-lease: $(($(date +%s) - start)) s"
