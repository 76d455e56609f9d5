#!/usr/bin/env bash
# The test suite: installs what is missing (scripts/setup.sh), then `cargo test`.
# Extra arguments go to cargo test (e.g. `--features gpu-tests` on a GPU machine).
# TPFUSE_CUDA_ARCHS=sm_90a builds one architecture instead of all (faster while iterating).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
exec cargo test "$@"
