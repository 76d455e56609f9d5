#!/usr/bin/env bash
# The emulator suite: every tests/emu_*.rs with `--features emulator`, under four schedules
# (forward, reverse, and random and pct with a fresh seed, printed; forward and random under
# the weak memory model), then the GPU suite on the emulator, the rest of `cargo test
# --features emulator` (tests/cpu_*.rs, the binaries, the doc tests), the report of the kernel
# instantiations that ran and a check that every __global__ kernel of cuda/ is among them.
# Each emulator test runs as its own process, one per core (scripts/run-tests.sh).
#   TPFUSE_EMU_SEED=N    the random and pct schedules' seed (default: the time)
#   TPFUSE_TEST_SEED=N   the tests' data seed (default: the same as TPFUSE_EMU_SEED)
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"

tests=()
for f in tests/emu_*.rs; do
  tests+=(--test "$(basename "$f" .rs)")
done
report=$(mktemp)
trap 'rm -f "$report"' EXIT
seed=${TPFUSE_EMU_SEED:-$(date +%s)}
# Fresh data every run (the tests' inputs derive from it; a failure prints it).
export TPFUSE_TEST_SEED=${TPFUSE_TEST_SEED:-$seed}
echo "== data seed TPFUSE_TEST_SEED=$TPFUSE_TEST_SEED"
suite=$(scripts/test-binaries.sh --features emulator "${tests[@]}")
started=$(date +%s)
# Forward and random run under the weak memory model (TPFUSE_EMU_MEMORY: weak, each weak load
# the oldest value the PTX model allows; weak-random, any of them), reverse and pct under
# sequentially consistent memory.
# The copies of scripts/emu-copies.txt run under the two sequentially consistent passes
# only: the weak-memory passes cost three quarters of the suite's time. The f32 copies run
# under all four: only f32 sums show an order of addition that changes with the schedule (on
# the tests' inputs, f16 and bf16 sums are exact in f32: EMULATOR-NOTES).
copies=$(grep -v '^#' scripts/emu-copies.txt)
for pass in forward:weak reverse:sc random:weak-random pct:sc; do
  schedule=${pass%%:*} memory=${pass#*:} skip=
  [ "$memory" = sc ] || skip=$copies
  echo "== emulator suite, schedule $schedule$(case $schedule in random | pct) echo " (TPFUSE_EMU_SEED=$seed)" ;; esac), memory $memory"
  # shellcheck disable=SC2086 # one executable per line
  TPFUSE_EMU_SCHEDULE=$schedule TPFUSE_EMU_SEED=$seed TPFUSE_EMU_MEMORY=$memory TPFUSE_EMU_REPORT=$report \
    TPFUSE_TEST_SKIP="$(echo $skip)" TPFUSE_TEST_SKIP_WHY="a copy, run under reverse and pct: scripts/emu-copies.txt" \
    scripts/run-tests.sh $suite
done
echo "== emulator suite: 4 schedules in $(($(date +%s) - started)) s"

# The GPU suite on the emulator: the crate's unit tests and every tests/gpu_*.rs, through
# cudarc and the emulated driver (TpGroup, symmetric memory, ops, linear layers, CUDA graphs:
# the Rust layer above the kernels), once, in the forward schedule, on a device of 16 SMs (the
# CTA budgets follow the SM count). Tests that need NCCL, IPC between processes, cuBLASLt or
# NVML are listed as ignored with their reason. tests/gpu_candle.rs is built only with the
# `candle` feature (candle's CUDA backend, which the emulator does not provide; GPU only).
gpu=(--lib)
for f in tests/gpu_*.rs; do
  [ "$(basename "$f")" = gpu_candle.rs ] || gpu+=(--test "$(basename "$f" .rs)")
done
gpu_started=$(date +%s)
echo "== the GPU suite on the emulator: the crate's unit tests, ${gpu[*]}"
gpu_suite=$(scripts/test-binaries.sh --features emulator "${gpu[@]}")
# shellcheck disable=SC2086
TPFUSE_EMU_REPORT=$report TPFUSE_EMU_SMS=16 scripts/run-tests.sh $gpu_suite
echo "== the GPU suite on the emulator in $(($(date +%s) - gpu_started)) s"

# The rest of `cargo test --features emulator` (the command a newcomer types): every test
# target the passes above did not run (tests/cpu_*.rs, the binaries' unit tests) and the doc
# tests, under the same feature. With the passes above, every target of that command has run.
rest=(--bins)
for f in tests/*.rs; do
  case $(basename "$f") in emu_* | gpu_*) ;; *) rest+=(--test "$(basename "$f" .rs)") ;; esac
done
echo "== the rest of cargo test --features emulator: ${rest[*]}, doc tests"
cargo test --features emulator "${rest[@]}"
cargo test --features emulator --doc

# The TP-4 decoder MLP example against its f64 reference (fails on a mismatch); the test
# profile reuses the GPU suite's build.
echo "== examples/tp_decoder_mlp on the emulator"
TPFUSE_EMU_SMS=16 cargo run --profile test --features emulator --example tp_decoder_mlp

# The report: launches and blocks per kernel instantiation, summed over every test process.
echo "== kernel instantiations executed on the emulator (launches, blocks, kernel)"
awk -F'\t' '{ l[$3] += $1; b[$3] += $2 } END { for (k in l) printf "%8d %9d  %s\n", l[k], b[k], k }' "$report" |
  sort -k3
count=$(cut -f3 "$report" | sort -u | wc -l)
echo "== $count kernel instantiations executed"

# Every __global__ kernel of cuda/ ran: the name a launch site gives it starts with the kernel's
# name without its _kernel suffix (gemm.cu launches gemm_sm80_kernel<...> as gemm_sm80).
missing=0
for kernel in $(grep -h -A2 '__global__' cuda/*.cu cuda/*.cuh | grep -o '[a-z_0-9]*_kernel(' | tr -d '(' | sort -u); do
  stem=${kernel%_kernel}
  if ! awk -F'\t' -v stem="$stem" 'index($3, stem) == 1 { found = 1 } END { exit !found }' "$report"; then
    echo "NOT EXECUTED: $kernel"
    missing=1
  fi
done
[ $missing -eq 0 ] || { echo "emulator suite: some kernels of cuda/ never ran" >&2; exit 1; }
echo "== every __global__ kernel of cuda/ executed"
