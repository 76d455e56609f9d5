#!/usr/bin/env bash
# The test suite: installs what is missing (scripts/setup.sh), then `cargo test`; then, unless
# it runs the GPU suite (`--features gpu-tests`), the emulator suite (every kernel of cuda/
# executed on the CPU emulator, under four schedules: scripts/emulator-suite.sh) and the
# planted bugs it must catch (scripts/mutants.sh).
# Extra arguments go to the first cargo test (e.g. `--features gpu-tests` on a GPU machine).
# TPFUSE_CUDA_ARCHS=sm_90a builds one architecture instead of all (faster while iterating).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
started=$(date +%s)
cargo test "$@"
echo "== cargo test in $(($(date +%s) - started)) s"
case " $* " in
*gpu-tests*) exit 0 ;;
esac
scripts/emulator-suite.sh
scripts/mutants.sh
