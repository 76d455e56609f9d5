#!/usr/bin/env bash
# Plants deliberate bugs, one at a time, in a copy of cuda/, and checks that the emulator
# suite catches every one: each mutant rebuilds only the emulator library (the build.sh that
# build.rs generated, run on the copy) and runs one emulator test binary against it (the
# binary is built once; the mutated library is loaded in place of its own with LD_PRELOAD).
# Exits non-zero when a mutant survives, does not apply exactly once, or does not compile.
#
#   scripts/mutants.sh            every mutant
#   scripts/mutants.sh NAME...    only those
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
# A mutant that hangs a wait without a deadline is reported after 1 s of virtual time
# instead of the default 60 s.
export TPFUSE_EMU_DEADLOCK_NS=${TPFUSE_EMU_DEADLOCK_NS:-1000000000}

echo "mutants: building the emulator tests" >&2
json=$(cargo test --features emulator --no-run --message-format=json 2>/dev/null)
test_binary() {
  grep -o "\"executable\":\"[^\"]*/$1-[0-9a-f]*\"" <<<"$json" | head -n 1 | cut -d'"' -f4
}
probe=$(test_binary emu_ops)
[ -x "$probe" ] || { echo "mutants: no emu_ops test binary" >&2; exit 1; }
# The emulator library is linked as libcuda.so (its soname), beside the generated build.sh.
emu_lib=$(ldd "$probe" | grep -o '/[^ ]*/libcuda\.so' | head -n 1 || true)
build="$(dirname "${emu_lib:-.}")/build.sh"
[ -f "$build" ] || { echo "mutants: no emulator build script beside ${emu_lib:-libcuda.so (not found by ldd)}" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The same build, reusing the objects already in OUT/obj: a mutant starts from the baseline's
# objects less those of the translation units its edits reach (units_reaching).
incremental="$work/build-incremental.sh"
sed -e '/^rm -f "\$out"\/obj\/\*\.o$/d' \
  -e 's|^  "c++" "\${flags\[@\]}" -c "\$src"|  [ -f "$out/obj/$(basename "$src").o" ] \|\| "c++" "${flags[@]}" -c "$src"|' \
  "$build" >"$incremental"
if grep -q '^rm -f "\$out"/obj' "$incremental" || ! grep -q '|| "c++"' "$incremental"; then
  echo "mutants: cannot derive an incremental build from $build" >&2
  exit 1
fi

# The translation units (cuda/*.cu, cuda/emu/*.cpp, relative to DIR) that FILE reaches: itself,
# or every unit that includes it directly or through other headers of DIR.
units_reaching() {
  local dir=$1 file=$2
  case $file in *.cu | *.cpp) echo "$file" && return 0 ;; esac
  local frontier=("$(basename "$file")") seen=" " f g rel
  while [ ${#frontier[@]} -gt 0 ]; do
    f=${frontier[0]}
    frontier=("${frontier[@]:1}")
    for g in $(grep -l "#include \"$f\"" "$dir"/*.cu "$dir"/*.cuh "$dir"/*.h "$dir"/emu/*.cpp "$dir"/emu/*.hpp 2>/dev/null); do
      rel=${g#"$dir"/}
      case "$seen" in *" $rel "*) continue ;; esac
      seen+="$rel "
      case $rel in
      *.cu | *.cpp) echo "$rel" ;;
      *) frontier+=("$(basename "$rel")") ;;
      esac
    done
  done
}

# Builds $work/NAME's library once: the baseline whole; a mutant from the baseline's objects,
# recompiling only the units its edited files reach (all of them without a baseline).
build_library() {
  local name=$1 out="$work/$1/out" unit file
  [ -f "$out/libtpfuse_emu.so" ] && return 0
  if [ "$name" = baseline ] || [ ! -f "$work/baseline/out/libtpfuse_emu.so" ]; then
    bash "$build" "$work/$name/cuda" "$out"
    return
  fi
  mkdir -p "$out/obj"
  cp "$work/baseline/out/obj/"*.o "$out/obj/"
  while read -r file; do
    for unit in $(units_reaching "$work/$name/cuda" "$file"); do
      rm -f "$out/obj/$(basename "$unit").o"
    done
  done <"$work/$name.files"
  bash "$incremental" "$work/$name/cuda" "$out"
}

# Copies cuda/ to $work/NAME/cuda and applies the edits: FILE OLD NEW, repeated; each OLD must
# occur exactly once.
apply() {
  local name=$1
  shift
  rm -rf "$work/$name"
  mkdir -p "$work/$name"
  cp -r cuda "$work/$name/cuda"
  : >"$work/$name.files"
  while [ $# -gt 0 ]; do
    local file=$1 old=$2 new=$3
    shift 3
    echo "$file" >>"$work/$name.files"
    if ! OLD="$old" NEW="$new" perl -0777 -i -pe \
      'BEGIN { $n = 0 } $n += s/\Q$ENV{OLD}\E/$ENV{NEW}/g; END { exit($n == 1 ? 0 : 3) }' \
      "$work/$name/cuda/$file"; then
      echo "mutants: $name: the text to replace does not occur exactly once in cuda/$file" >&2
      return 1
    fi
  done
}

# Builds $work/NAME's library and runs test binary TEST against it; prints the outcome.
# Returns 0 when the tests pass (for a mutant: it survived).
run_tests() {
  local name=$1 test=$2
  local bin
  bin=$(test_binary "$test")
  [ -x "$bin" ] || { echo "mutants: no test binary $test" >&2; return 2; }
  if ! build_library "$name" >"$work/$name/build.log" 2>&1; then
    echo "mutants: $name does not compile:" >&2
    tail -n 20 "$work/$name/build.log" >&2
    return 2
  fi
  # Under each schedule the suite runs, until one fails (random and pct with fixed seeds).
  # One process per test, stopping at the first that fails: a caught mutant costs the tests
  # up to the one that catches it, not the whole binary (whose other tests may each wait out
  # a deadlock horizon).
  local schedule tests t
  tests=$("$bin" --list 2>/dev/null | sed -n 's/: test$//p')
  [ -n "$tests" ] || { echo "mutants: $test lists no tests" >&2; return 2; }
  for schedule in forward reverse random:1 random:2 pct:1; do
    for t in $tests; do
      LD_PRELOAD="$work/$name/out/libtpfuse_emu.so" TPFUSE_EMU_SCHEDULE=${schedule%%:*} \
        TPFUSE_EMU_SEED=${schedule#*:} timeout 600 "$bin" --exact "$t" >"$work/$name/test.log" 2>&1 ||
        { echo "$schedule" >"$work/$name/schedule"; return 1; }
    done
  done
  return 0
}

selected=("$@")
wanted() {
  [ ${#selected[@]} -eq 0 ] && return 0
  local s
  for s in "${selected[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

total=0
caught=0
failed=()
names=()
started=$(date +%s)
# Mutants run TPFUSE_MUTANT_JOBS at a time (default: the CPU count), each in its own copy of
# cuda/ with its own library and logs; the outcomes are printed in order once all are done.
jobs_max=${TPFUSE_MUTANT_JOBS:-$(nproc 2>/dev/null || echo 2)}
# mutant NAME TEST DESCRIPTION FILE OLD NEW [FILE OLD NEW ...]
mutant() {
  local name=$1 test=$2 what=$3
  shift 3
  wanted "$name" || return 0
  names+=("$name")
  printf '%s\t%s\n' "$test" "$what" >"$work/$name.about"
  if ! apply "$name" "$@"; then
    echo "apply 0" >"$work/$name.outcome"
    return 0
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  (
    t0=$(date +%s)
    status=0
    run_tests "$name" "$test" || status=$?
    echo "$status $(($(date +%s) - t0))" >"$work/$name.outcome"
  ) &
}

# Prints the outcome of mutant NAME and counts it.
report() {
  local name=$1 test what status secs
  IFS=$'\t' read -r test what <"$work/$name.about"
  read -r status secs <"$work/$name.outcome"
  total=$((total + 1))
  if [ "$status" = apply ]; then
    failed+=("$name (does not apply)")
  elif [ "$status" -eq 0 ]; then
    echo "SURVIVED  $name ($what): $test passed (${secs}s)"
    failed+=("$name (survived)")
  elif [ "$status" -eq 2 ]; then
    failed+=("$name (does not build)")
  else
    caught=$((caught + 1))
    local first
    first=$(awk '/^failures:$/ { n++ } n == 2 && /^    / { print $1; exit }' "$work/$name/test.log")
    echo "caught    $name ($what) by $test::${first:-?} ($(cat "$work/$name/schedule")) in ${secs}s"
  fi
}

# The unmutated copy must pass, or every "caught" below would mean nothing.
# Every binary a mutant below names, under the same five schedules, two at a time.
if wanted baseline; then
  apply baseline
  build_library baseline >"$work/baseline/build.log" 2>&1 ||
    { echo "mutants: the unmutated cuda/ does not compile" >&2; tail -n 20 "$work/baseline/build.log" >&2; exit 1; }
  binaries=$(sed -n 's/^mutant [^ ]* \(emu_[a-z_]*\) .*/\1/p' scripts/mutants.sh | sort -u)
  for t in $binaries; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    mkdir -p "$work/baseline-$t"
    ln -sfn "$work/baseline/out" "$work/baseline-$t/out"
    (run_tests "baseline-$t" "$t" && touch "$work/baseline-$t/passed") &
  done
  wait
  for t in $binaries; do
    [ -f "$work/baseline-$t/passed" ] || { echo "mutants: the unmutated cuda/ fails $t:" >&2; cat "$work/baseline-$t/test.log" >&2; exit 1; }
  done
  echo "baseline  unmutated cuda/ passes" $binaries
fi

mutant closing-barrier emu_all_reduce "one-shot without its closing barrier" \
  all_reduce.cu $'static_cast<T *>(nullptr));\n  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);\n  barrier.commit();\n  if (gamma' \
  $'static_cast<T *>(nullptr));\n  barrier.commit();\n  if (gamma'
mutant first-barrier emu_all_reduce "one-shot reads peers before they staged" \
  all_reduce.cu $'copy_range(input, static_cast<T *>(peers.data[g.rank]), r);\n  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);' \
  $'copy_range(input, static_cast<T *>(peers.data[g.rank]), r);'
mutant reverse-rank-order emu_all_reduce "ranks summed W-1..0 (vector path)" \
  reduce.cuh 'x[p] = load16_peer(static_cast<const T *>(peers.data[p]) + offset + i);' \
  'x[p] = load16_peer(static_cast<const T *>(peers.data[world - 1 - p]) + offset + i);'
mutant no-sync-before-release emu_all_reduce "a barrier publishes before the whole block is done" \
  barrier.cuh $'const uint32_t value = ++epoch_;\n    __syncthreads();' 'const uint32_t value = ++epoch_;'
mutant wait-own-rank-only emu_all_reduce "a barrier that waits only for rank 0" \
  barrier.cuh 'if (peer < g_.world) {' 'if (peer < 1) {'
mutant no-timeout-broadcast emu_all_reduce "a timed-out rank does not tell its peers" \
  barrier.cuh 'if (p != g.rank) st_release_sys' 'if (false) st_release_sys'
mutant missing-rank-not-told emu_all_reduce "a timed-out rank does not tell the rank that was late" \
  barrier.cuh 'if (p != g.rank) st_release_sys' 'if (p != g.rank && p != static_cast<int>(word & 0xffu)) st_release_sys'
mutant no-descriptor-check emu_all_reduce "the first barrier does not compare the ranks' descriptors" \
  barrier.cuh 'ld_relaxed_sys(own_.descriptor(blockIdx.x, peer)) != descriptor_' 'false'
mutant descriptor-without-grid emu_all_reduce "the descriptor leaves out the grid" \
  all_reduce.cu 'static_cast<uint64_t>(grid), bias != nullptr' 'uint64_t{0}, bias != nullptr'
mutant no-clock-backstop emu_all_reduce "a wait trusts %globaltimer alone" \
  barrier.cuh '(waited_cycles > 0 && static_cast<uint64_t>(waited_cycles) > backstop_cycles_)' 'false'
mutant failed-output-unmarked emu_all_reduce "a block that gives up leaves its outputs as they were" \
  failure.cuh 'if (p == nullptr) return;' 'return;'
mutant no-host-publish emu_all_reduce "a failed launch does not publish its error word to the host" \
  barrier.cuh 'if (g.host_error != nullptr) st_release_sys' 'if (false) st_release_sys'
mutant rmsnorm-after-failure emu_all_reduce "the two-shot RMSNorm normalises a failed launch's marker" \
  epilogue.cu 'if (failed) {' 'if (false) {'
mutant residual-not-written emu_all_reduce "the epilogue does not write the residual back" \
  epilogue.cuh 'if (residual != nullptr) store16(residual + i, y);' ''
mutant bias-column-per-vector emu_all_reduce "the vector epilogue takes the bias at the row's first column" \
  epilogue.cuh 'b = load16(bias + i % hidden);' 'b = load16(bias + i / hidden % 1);'
mutant two-shot-residual emu_all_reduce "two-shot does not gather peers' slices into residual" \
  all_reduce.cu 'if (residual != nullptr) copy_range(static_cast<const T *>(out), residual, r);' ''
mutant partials-reversed emu_all_reduce "one-shot adds a row's segment partials in reverse (fused and unfused bits differ)" \
  all_reduce.cu 'partial_of(seg, staging, first + s)' 'partial_of(seg, staging, first + seg.per_row - 1 - s)'
# The outside reader's race (issue 21): one float per unit from the start of the staging, inside
# an earlier block's range, which a peer's block may still read, or this rank's late block copy
# over the partial. Only the pct schedule shows it.
mutant partials-at-staging-start emu_all_reduce "one-shot keeps unit u's RMSNorm partial at byte 4u of its staging" \
  all_reduce.cu 'return reinterpret_cast<float *>(staging + seg.begin(u));' 'return reinterpret_cast<float *>(staging) + u;'
mutant no-rank-meet emu_all_reduce "one-shot normalises before the rank's other blocks wrote their partials" \
  all_reduce.cu 'if (!barrier.meet_rank_blocks()) return false;' ''
mutant half-warp-sum emu_all_reduce "RMSNorm's warp sum skips the first shuffle" \
  epilogue.cuh 'for (int offset = 16; offset > 0; offset >>= 1)' 'for (int offset = 8; offset > 0; offset >>= 1)'
mutant all-gather-offset emu_all_reduce "all-gather writes every rank's part at its own offset" \
  all_reduce.cu 'uint4 *dst = out + p * len_vectors;' 'uint4 *dst = out + g.rank * len_vectors;'
# Issue 21, defect 3: the C ABI's checks before a launch (each mutant is one check's old form).
mutant all-reduce-past-capacity emu_all_reduce "all-reduce launches a message larger than the staging" \
  all_reduce.cu $'  if (!fits2(rows, hidden, sizeof(T), g.capacity)) return cudaErrorInvalidValue;\n' ''
mutant all-reduce-capacity-product emu_all_reduce "all-reduce checks the capacity with a product that wraps" \
  all_reduce.cu 'if (!fits2(rows, hidden, sizeof(T), g.capacity)) return' 'if (rows * hidden * sizeof(T) > g.capacity) return'
mutant all-reduce-misaligned emu_all_reduce "all-reduce launches with pointers off a 16-byte boundary" \
  all_reduce.cu $'if (!is_aligned16(input) || !is_aligned16(out) || !is_aligned16(bias) || !is_aligned16(residual) ||\n      !is_aligned16(gamma)) {' 'if (false) {'
mutant all-reduce-partial-vector-rows emu_all_reduce "all-reduce launches bias or gamma with rows of partial vectors" \
  all_reduce.cu '(bias != nullptr || gamma != nullptr) && hidden % Vec16<T>::kLen != 0' 'false'
mutant reduce-scatter-unchecked emu_all_reduce "reduce-scatter launches without checking capacity, alignment or len" \
  all_reduce.cu $'if (!fits2(static_cast<size_t>(group->world), len, size, group->capacity) || (len * size) % 16 != 0 ||\n      !is_aligned16(input) || !is_aligned16(out)) {' \
  'if (false) {'
mutant reduce-scatter-capacity-one-slice emu_all_reduce "reduce-scatter checks one slice, not world slices, against the staging" \
  all_reduce.cu 'fits2(static_cast<size_t>(group->world), len,' 'fits2(1, len,'
mutant all-gather-unchecked emu_all_reduce "all-gather launches without checking capacity or alignment" \
  all_reduce.cu 'if (len_bytes > group->capacity || !is_aligned16(input) || !is_aligned16(out)) return' 'if (false) return'
mutant descriptor-without-eps emu_all_reduce "the ranks' descriptors leave out eps (different eps, different bits)" \
  all_reduce.cu 'gamma != nullptr, gamma != nullptr ? float_bits(eps) : 0});' 'gamma != nullptr});'
mutant scalar-tail emu_reduce_ranks "reduce_ranks skips the scalar tail" \
  reduce_ranks.cu 'for (size_t i = vec_len * kVec + first; i < len; i += stride) {' \
  'for (size_t i = len + first; i < len; i += stride) {'
mutant swap-b-fragment emu_gemm "two B fragment registers swapped" \
  gemm_sm80.cuh 'bf[2 * p][0], bf[2 * p][1],' 'bf[2 * p][1], bf[2 * p][0],'
mutant no-a-swizzle emu_gemm "cp.async of A without the shared-memory swizzle" \
  gemm_sm80.cuh 'a_dst[i] = r * Cfg::kRowBytes + ((chunk ^ swizzle_term<Cfg::kChunks>(r)) << 4);' \
  'a_dst[i] = r * Cfg::kRowBytes + (chunk << 4);'
mutant wait-group-off-by-one emu_gemm "cp.async.wait_group STAGES-1 instead of STAGES-2" \
  gemm_sm80.cuh 'cp_async_wait<STAGES - 2>();' 'cp_async_wait<STAGES - 1>();'
mutant no-sync-after-wait emu_gemm "no __syncthreads after the stage wait" \
  gemm_sm80.cuh $'cp_async_wait<STAGES - 2>();\n    __syncthreads();' 'cp_async_wait<STAGES - 2>();'
mutant load-before-sync emu_gemm "the next stage is loaded before the barrier that frees it" \
  gemm_sm80.cuh $'    __syncthreads();\n    if (t + STAGES - 1 < slices) load_slice(write_stage, t + STAGES - 1);' \
  $'    if (t + STAGES - 1 < slices) load_slice(write_stage, t + STAGES - 1);\n    __syncthreads();'
mutant last-slice-steps emu_gemm "the last k-slice runs one k16-step too few" \
  gemm_sm80.cuh 'const int last_steps = (k - (slices - 1) * BK + 15) / 16;' \
  'const int last_steps = (k - (slices - 1) * BK) / 16;'
mutant epilogue-no-bias emu_gemm "the GEMM epilogue reads bias at column 0" \
  gemm_epilogue.cuh 'const Vec16<T> b = load16(bias + col);' 'const Vec16<T> b = load16(bias);'
mutant flag-before-tile emu_gemm_all_reduce "the fused kernel publishes a tile's flag before computing the tile" \
  gemm_all_reduce.cu $'    gemm_tile<T, Cfg>(DenseRows<T>{x, k}, w, m, n, k, tm, tn, staging, smem);\n    __syncthreads(); // the tile\'s stores (and the epilogue\'s reads of smem), before the flags\n    fused::publish(peers, g, tile, flag_value);' \
  $'    fused::publish(peers, g, tile, flag_value);\n    gemm_tile<T, Cfg>(DenseRows<T>{x, k}, w, m, n, k, tm, tn, staging, smem);\n    __syncthreads();'
mutant no-sync-before-flag emu_gemm_all_reduce "the fused kernel publishes a tile's flag before the whole block stored it" \
  gemm_all_reduce.cu $'    __syncthreads(); // the tile\'s stores (and the epilogue\'s reads of smem), before the flags\n' ''
mutant epoch-not-advanced emu_gemm_all_reduce "the fused kernel's launches all use epoch 1" \
  fused_flags.cuh '*own.fused_epoch() = st.epoch;' ''
mutant norm-before-row-complete emu_gemm_all_reduce "the first block to reduce a tile of a strip normalises it" \
  gemm_all_reduce.cu '+ 1u == static_cast<uint32_t>(L.tiles_n);' '+ 1u == 1u;'
mutant fused-failure-unmarked emu_fused_failures "the fused kernel's last block leaves a failed launch's outputs" \
  fused_flags.cuh '  return st.last && st.failed;' '  return false;'
mutant fused-no-descriptor-check emu_fused_failures "the fused kernel accepts a tile flag of another launch's shape" \
  fused_flags.cuh '(v & kDescriptorMask) != descriptor' 'false'
mutant epoch-window-half-range emu_fused_failures "the fused kernel takes any flag in the half range after this launch as ready" \
  fused_flags.cuh 'return ahead(v) <= 1;' 'return ahead(v) < (kEpochMask >> 1);'
mutant two-shot-gather-from-rank-0 emu_gemm_all_reduce "two-shot gathers every row from rank 0's area" \
  gemm_all_reduce.cu 'const int owner = row / slice;' 'const int owner = 0;'
mutant two-shot-slice-flag-early emu_gemm_all_reduce "two-shot publishes its slice after its first reduced tile" \
  gemm_all_reduce.cu '+ 1u == static_cast<uint32_t>(L.slice_tiles);' '+ 1u == 1u;'
mutant two-shot-gather-without-waiting emu_gemm_all_reduce "two-shot gathers without waiting for the slice flags" \
  gemm_all_reduce.cu 'fused::await(peers, g, deadline, st, fused::kSliceSlot, threadIdx.x, descriptor, true);' ';'
mutant two-shot-peer-residual-kept emu_gemm_all_reduce "two-shot leaves the peers' rows of the residual" \
  gemm_all_reduce.cu 'owner != g.rank ? residual + at : nullptr;' 'false ? residual + at : nullptr;'
mutant scatter-rank-0-rows emu_gemm_all_reduce "GEMM + reduce-scatter gives every rank rank 0's rows" \
  gemm_all_reduce.cu 'const int row_begin = reduction.scatter ? g.rank * slice : 0;' 'const int row_begin = 0;'
mutant gather-without-waiting emu_gemm_all_reduce "all-gather + GEMM reads the peers' rows without waiting for their flags" \
  all_gather_gemm.cu '    if (needed != 0) {' '    if (false) {'
mutant norm-partials-in-result-half emu_gemm_all_reduce "one-shot keeps its RMSNorm partials where all-gather + GEMM pushes" \
  all_reduce.cu 'normalize_units(barrier, seg, units, static_cast<T *>(peers.data[g.rank]), gamma' \
  'normalize_units(barrier, seg, units, static_cast<T *>(peers.data[g.rank]) + g.capacity / sizeof(T), gamma'
mutant gather-push-own-area-only emu_gemm_all_reduce "all-gather + GEMM pushes a rank's rows into its own area only" \
  all_gather_gemm.cu 'for (int j = 1; j <= g.world; ++j) {' 'for (int j = g.world; j <= g.world; ++j) {'
mutant gather-push-at-rank-0-rows emu_gemm_all_reduce "all-gather + GEMM pushes every rank's rows to rank 0's rows" \
  all_gather_gemm.cu 'static_cast<size_t>(g.rank) * part_vectors * 16;' 'static_cast<size_t>(0) * part_vectors * 16;'
mutant gather-no-sync-before-flag emu_gemm_all_reduce "all-gather + GEMM publishes a part's flag before the whole block pushed it" \
  all_gather_gemm.cu $'    __syncthreads(); // every thread\'s stores, before the flags\n' ''
# Co-residency (issue 21, defect 2): launched as plain grids, the blocks that fit start and wait
# for blocks that cannot; only the residency model and another kernel holding SMs show it.
mutant fused-launch-not-cooperative emu_fused_failures "the fused kernels are plain launches (partly resident grids)" \
  backend.cuh '__PRETTY_FUNCTION__, grid, block, smem, stream, true)' '__PRETTY_FUNCTION__, grid, block, smem, stream, false)'
mutant one-shot-rmsnorm-not-cooperative emu_fused_failures "the one-shot RMSNorm, whose blocks meet, is a plain launch" \
  all_reduce.cu 'TPFUSE_LAUNCH_COOPERATIVE(one_shot_kernel<T>' 'TPFUSE_LAUNCH(one_shot_kernel<T>'
# Right results, wasted work: only the counters see these.
mutant gather-tiles-read-a-peer emu_counters "all-gather + GEMM's tiles read the gathered rows from the next rank's area" \
  all_gather_gemm.cu 'DenseRows<T> rows{static_cast<const T *>(peers.data[g.rank]) + exchange, k};' \
  'DenseRows<T> rows{static_cast<const T *>(peers.data[(g.rank + 1) % g.world]) + exchange, k};'
mutant double-peer-read emu_counters "the reduction loads every peer's vector twice" \
  reduce.cuh 'x[p] = load16_peer(static_cast<const T *>(peers.data[p]) + offset + i);' \
  $'{ x[p] = load16_peer(static_cast<const T *>(peers.data[p]) + offset + i);\n      x[p] = load16_peer(static_cast<const T *>(peers.data[p]) + offset + i); }'
mutant residual-over-the-link emu_counters "two-shot reads the peers' results again for the residual" \
  all_reduce.cu 'copy_range(static_cast<const T *>(out), residual, r);' 'copy_range_from_peer(result, residual, r);'
mutant no-swizzle emu_counters "the GEMM's shared memory unswizzled (bank conflicts, same results)" \
  gemm_sm80.cuh 'return kChunks == 8 ? (row & 7) : ((row >> 1) & 3);' 'return 0;'
mutant extra-barrier emu_counters "one-shot passes a third barrier" \
  all_reduce.cu $'  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);\n  barrier.commit();\n  if (gamma' \
  $'  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);\n  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);\n  barrier.commit();\n  if (gamma'
mutant embedding-positive-zero-mask emu_vocab_embedding "another rank's tokens written as +0.0 (the sum loses -0.0)" \
  vocab_embedding.cu 'id < vocab ? uint16_t{0x8000} : nan_bits' 'id < vocab ? uint16_t{0x0000} : nan_bits'
mutant embedding-padding-row-looked-up emu_vocab_embedding "an id past the vocabulary reads the rank's padding row" \
  vocab_embedding.cu 'if (id < vocab && offset < rows) {' 'if (offset < rows) {'
# The emulator's own twins: a wrong emulation must fail its own tests.
mutant emu-cp-async-lands-early emu_ops "the emulator lands every cp.async group at any wait" \
  emu/device_ops.cpp 'while (f.committed.size() > static_cast<size_t>(pending)) {' 'while (!f.committed.empty()) {'
mutant emu-ldmatrix-banks emu_counters "the emulator counts a phase's bank conflicts by 4-byte bank" \
  emu/warp.cpp '++rows_in_quad[(in[8 * i + r].addr >> 4) & 7]' '++rows_in_quad[(in[8 * i + r].addr >> 2) & 7]'
mutant emu-registers-free emu_all_reduce "the emulator counts no registers toward an SM's room" \
  emu/residency.cpp 'f.warp_registers = (registers * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;' 'f.warp_registers = 0;'
mutant emu-cooperative-in-part emu_fused_failures "the emulator starts a cooperative grid's blocks as they fit" \
  emu/scheduler.cpp 'if (l->cooperative && l->next_block == 0 && !all_blocks_fit(dev, *l)) continue;' ''
# (In common.cuh, not emu/device.hpp: the mutants rebuild the units that include an edited file
# from cuda/, and device.hpp is reached only through the shims of emu/include.)
mutant emu-misaligned-accepted emu_ops "the emulator accepts a load off its size's alignment" \
  common.cuh $'  ::tpfuse_emu::check_aligned(p, sizeof(T));\n  ::tpfuse_emu::count_load(p, sizeof(T));\n#endif\n  return *p;' $'  ::tpfuse_emu::count_load(p, sizeof(T));\n#endif\n  return *p;'
mutant emu-shared-overrun-unchecked emu_ops "the emulator lets a block write past its shared memory" \
  emu/scheduler.cpp 'if (!overrun.empty() && !b->launch->failed) {' 'if (false) {'
mutant emu-arch-ignored emu_ops "the emulator's SMs have an H100's limits whatever the architecture" \
  emu/residency.cpp '    if (l.arch == arch) return l;' '    if (false) return l;'
mutant emu-mma-b-rows emu_ops "the emulated mma reads b1 as k rows 2t..2t+1" \
  emu/warp.cpp 'B[2 * t + 8 * r][g] =' 'B[2 * t + 0 * r][g] ='

wait
for name in "${names[@]}"; do report "$name"; done
echo
echo "mutants: $caught of $total caught in $(($(date +%s) - started)) s ($jobs_max at a time)"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'mutants: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
