#!/usr/bin/env bash
# The test suite: installs what is missing (scripts/setup.sh), then, with `--features
# gpu-tests` (a GPU machine), `cargo test` whole; otherwise the CPU tests, the emulator suite
# (every kernel of cuda/ executed on the CPU emulator, under four schedules, then the GPU
# tests on the emulator: scripts/emulator-suite.sh) and the planted bugs it must catch
# (scripts/mutants.sh).
# Extra arguments go to the first cargo test (e.g. `--features gpu-tests` on a GPU machine).
# TPFUSE_CUDA_ARCHS=sm_90a builds one architecture instead of all (faster while iterating).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
started=$(date +%s)
case " $* " in
*gpu-tests*)
  cargo test "$@"
  echo "== cargo test in $(($(date +%s) - started)) s"
  exit 0
  ;;
esac
# Without a GPU, the CPU tests: the unit tests, the binaries', tests/cpu_*.rs and the doc
# tests. tests/gpu_*.rs and tests/emu_*.rs are left to the emulator suite below, which runs
# them (this build would only list the GPU tests as ignored and the emulator's as empty,
# after compiling and linking 28 binaries for that).
targets=(--lib --bins)
for f in tests/cpu_*.rs; do
  targets+=(--test "$(basename "$f" .rs)")
done
cargo test "${targets[@]}" "$@"
cargo test --doc "$@"
echo "== cargo test (the CPU tests) in $(($(date +%s) - started)) s"
scripts/emulator-suite.sh
scripts/mutants.sh
