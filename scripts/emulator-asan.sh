#!/usr/bin/env bash
# The emulator suite once under AddressSanitizer: the kernels and the emulator are compiled
# with -fsanitize=address (TPFUSE_EMU_SANITIZE=address, in their own target directory), and
# device memory is host memory, so an out-of-bounds access of a kernel is reported.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
export CARGO_TARGET_DIR=target/asan TPFUSE_EMU_SANITIZE=address
# Only the emulator suite's binaries (tests/emu_*.rs) are built here.
tests=()
for f in tests/emu_*.rs; do
  tests+=(--test "$(basename "$f" .rs)")
done
json=$(cargo test --features emulator --no-run --message-format=json "${tests[@]}")
asan=$(gcc -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "emulator-asan: no libasan.so ($asan)" >&2; exit 1; }
status=0
for f in tests/emu_*.rs; do
  name=$(basename "$f" .rs)
  bin=$(grep -o "\"executable\":\"[^\"]*/$name-[0-9a-f]*\"" <<<"$json" | head -n 1 | cut -d'"' -f4)
  echo "== $name under AddressSanitizer"
  # The Rust binary is not instrumented: the ASan runtime must be loaded first.
  LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 "$bin" --test-threads=1 || status=1
done
exit $status
