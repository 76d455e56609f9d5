#!/usr/bin/env bash
# The main job: installs what is missing (scripts/setup.sh), then runs `tpfuse doctor`.
# Extra arguments go to tpfuse doctor (e.g. `--build` for the ptxas report).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
exec cargo run --quiet --release --bin tpfuse -- doctor "$@"
