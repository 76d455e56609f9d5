#!/usr/bin/env bash
# Does tpfuse compose with an engine's build? `cargo check` of scratch engine crates that
# depend on this checkout (a path dependency), each resolved afresh from crates.io:
#   candle      tpfuse next to cudarc with candle-core 0.11.1's exact cudarc features
#               (`dynamic-linking`, `cuda-version-from-build-system`, cuBLAS, cuBLASLt, cuRAND,
#               NVRTC, f8), resolved afresh. candle-core itself, with tpfuse's `candle` feature,
#               is scripts/candle-check.sh's (tpfuse's graph, candle-kernels' nvcc build
#               replaced by a check-only stub).
#   cuda-12080  an engine that names its CUDA version on cudarc (12.8: the oldest tpfuse's
#               kernels build with)
#   static      an engine that links the CUDA libraries statically (cudarc `static-linking`)
#   oldest      cudarc 0.19.0, the oldest tpfuse's Cargo.toml accepts
#   newest      the newest cudarc 0.19 on crates.io, tpfuse's default features alone
# The crates live in target/compat and share one target directory. Kernels are not compiled
# (TPFUSE_SKIP_KERNELS=1: the CUDA code is the same in every case; bindings only).
#   scripts/compat.sh [CASE...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
eval "$(scripts/setup.sh)"
export TPFUSE_SKIP_KERNELS=1
export CARGO_TARGET_DIR=$root/target/compat/target
# cudarc's static-linking bundles libstdc++.a, which rustc looks for on its -L path. Set for
# every case: the flags are part of every crate's fingerprint, and one set lets the cases
# share the crates they have in common.
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$(dirname "$(g++ -print-file-name=libstdc++.a)")"

# manifest CASE CUDARC_LINE: the scratch crate's Cargo.toml.
manifest() {
  cat <<EOF
[package]
name = "compat-$1"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
tpfuse = { path = "$root" }
$2

[workspace]
EOF
}

# What an engine writes: tpfuse's types next to cudarc's.
main_rs() {
  cat <<'EOF'
use std::sync::Arc;

fn main() {
    let _: Option<Arc<cudarc::driver::CudaStream>> = None;
    let _ = tpfuse::device::driver_present();
    let _: Option<tpfuse::TpGroup> = None;
}
EOF
}

cudarc_line() {
  case $1 in
  candle)
    echo 'cudarc = { version = "0.19.10", default-features = false, features = ["std", "cublas", "cublaslt", "curand", "driver", "nvrtc", "f16", "f8", "cuda-version-from-build-system", "dynamic-linking"] }' ;;
  cuda-12080) echo 'cudarc = { version = "0.19", default-features = false, features = ["std", "driver", "cuda-12080"] }' ;;
  static) echo 'cudarc = { version = "0.19", default-features = false, features = ["std", "driver", "static-linking"] }' ;;
  oldest | newest) echo 'cudarc = { version = "0.19", default-features = false }' ;;
  *) echo "compat: unknown case $1" >&2; exit 2 ;;
  esac
}

cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(candle cuda-12080 static oldest newest)
failed=()
for case in "${cases[@]}"; do
  dir=$root/target/compat/$case
  mkdir -p "$dir/src"
  manifest "$case" "$(cudarc_line "$case")" >"$dir/Cargo.toml"
  main_rs >"$dir/src/main.rs"
  rm -f "$dir/Cargo.lock"
  started=$(date +%s)
  (
    cd "$dir"
    cargo generate-lockfile --quiet
    case $case in
    oldest) cargo update --quiet -p cudarc --precise 0.19.0 ;;
    esac
    echo "== compat $case: cudarc $(cargo tree --quiet -i cudarc --depth 0 | head -n 1 | awk '{print $2}')"
    cargo check --quiet
  ) && echo "== compat $case: ok in $(($(date +%s) - started)) s" || {
    echo "== compat $case: FAILED" >&2
    failed+=("$case")
  }
done
[ ${#failed[@]} -eq 0 ] || { echo "compat: FAILED: ${failed[*]}" >&2; exit 1; }
