#!/usr/bin/env bash
# The emulator suite once under AddressSanitizer: the kernels and the emulator are compiled
# again with -fsanitize=address (the build.sh that build.rs generated, run with
# TPFUSE_EMU_CXXFLAGS), and every emulator test binary (tests/emu_*.rs, built once for the
# suite) runs with that library loaded in place of its own. Device memory is host memory, so
# an out-of-bounds access of a kernel or of the emulator is reported. The Rust test code is
# not instrumented: the ASan runtime is preloaded first.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
tests=()
for f in tests/emu_*.rs; do
  tests+=(--test "$(basename "$f" .rs)")
done
suite=$(scripts/test-binaries.sh --features emulator "${tests[@]}")
# The emulator library beside its build.sh, from a binary that links it: emu_ops (as
# mutants.sh does; cargo lists the binaries in no fixed order, and emu_selftest runs the CLI
# and links no libcuda.so itself).
probe=$(grep '/emu_ops-[0-9a-f]*$' <<<"$suite" | head -n 1)
emu_lib=$(ldd "$probe" | grep -o '/[^ ]*/libcuda\.so' | head -n 1 || true)
build="$(dirname "${emu_lib:-.}")/build.sh"
[ -f "$build" ] || { echo "emulator-asan: no emulator build script beside ${emu_lib:-libcuda.so}" >&2; exit 1; }
asan=$(gcc -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "emulator-asan: no libasan.so ($asan)" >&2; exit 1; }

out=target/emulator-asan
started=$(date +%s)
# -g1: line tables for the reports, a quarter less compile time than -g; -O1 (after the
# script's -O2): what AddressSanitizer's documentation recommends, and a faster compile;
# __forceinline__ a plain inline (TPFUSE_EMU_INLINE_AS_ASKED, cuda/emu/include/cuda_runtime.h):
# the same code, built in 29 s instead of 54 (gemm_all_reduce.cu 36 -> 11 s), its tests ~10%
# slower.
TPFUSE_EMU_CXXFLAGS="-fsanitize=address -fno-omit-frame-pointer -g1 -O1 -DTPFUSE_EMU_INLINE_AS_ASKED" bash "$build" cuda "$out"
echo "== the emulator built with AddressSanitizer in $(($(date +%s) - started)) s"
# Left out under AddressSanitizer, for CI's time: the copies of scripts/emu-copies.txt (each
# runs uninstrumented in the emulator suite, and its original runs here).
skip=$(grep -v '^#' scripts/emu-copies.txt)
# shellcheck disable=SC2086 # one executable per line
TPFUSE_TEST_PRELOAD="$asan $PWD/$out/libtpfuse_emu.so" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  TPFUSE_TEST_SKIP="$(echo $skip)" TPFUSE_TEST_SKIP_WHY="under AddressSanitizer: see scripts/emulator-asan.sh" \
  scripts/run-tests.sh $suite
echo "== the emulator suite under AddressSanitizer in $(($(date +%s) - started)) s"
