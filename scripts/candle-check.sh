#!/usr/bin/env bash
# tpfuse's `candle` feature against the newest candle-core 0.11 with `cuda` (cudarc with
# `dynamic-linking`), in tpfuse's own graph, which is tpfuse next to candle-core as an engine
# has it: clippy -D warnings of src/candle, examples/candle_tp_mlp.rs and tests/gpu_candle.rs,
# and rustdoc. candle-kernels is replaced by the check-only stub of
# scripts/candle-kernels-stub.sh (the real crate's Rust API without its nvcc build of candle's
# kernels, which takes tens of minutes on two cores), patched in from the command line; the
# patch and the update rewrite Cargo.lock, which is put back however this ends. Nothing here
# links: candle's CUDA backend runs on a GPU only (tests/gpu_candle.rs under gpu-tests).
# Kernels are not compiled (TPFUSE_SKIP_KERNELS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
eval "$(scripts/setup.sh)"
export TPFUSE_SKIP_KERNELS=1
stub=$root/target/candle-kernels-stub
mkdir -p target
cp Cargo.lock target/Cargo.lock.candle-check
trap 'cp target/Cargo.lock.candle-check Cargo.lock' EXIT
cargo update --quiet -p candle-core
scripts/candle-kernels-stub.sh "$stub" >/dev/null
# Its own target directory, dependencies unoptimised (they are only type-checked; the build
# scripts and proc macros that do run are quicker to compile at -O0).
export CARGO_TARGET_DIR=$root/target/candle-check
args=(--features candle --config "patch.crates-io.candle-kernels.path=\"$stub\""
  --config 'profile.dev.package."*".opt-level=0')
# The stub must be what the graph uses, and cudaforge (the real crate's build) gone: a stub
# whose version candle-core does not accept would be ignored with a warning.
cargo tree --quiet "${args[@]}" -i candle-kernels --depth 0 | grep -qF "($stub)" ||
  { echo "candle-check: the candle-kernels stub at $stub is NOT used" >&2; exit 1; }
! cargo tree --quiet "${args[@]}" -i cudaforge --depth 0 >/dev/null 2>&1 ||
  { echo "candle-check: cudaforge is still in the graph" >&2; exit 1; }
echo "== candle-check: candle-core $(cargo tree --quiet "${args[@]}" -i candle-core --depth 0 | awk '{print $2}'), cudarc $(cargo tree --quiet "${args[@]}" -i cudarc --depth 0 | head -n 1 | awk '{print $2}')"
cargo clippy --quiet --lib --example candle_tp_mlp --test gpu_candle "${args[@]}" -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps "${args[@]}"
echo "== candle-check: ok"
