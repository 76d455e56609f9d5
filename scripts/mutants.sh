#!/usr/bin/env bash
# Plants deliberate bugs, one at a time, in a copy of cuda/, and checks that the emulator
# suite catches every one: each mutant rebuilds only the emulator library (the build.sh that
# build.rs generated, run on the copy) and runs the one emulator test that must catch it (the
# test binaries are built once; the mutated library is loaded in place of their own with
# LD_PRELOAD). Exits non-zero when a mutant survives, does not apply exactly once, or does not
# compile.
#
#   scripts/mutants.sh            every mutant
#   scripts/mutants.sh NAME...    only those
#
# A mutant names its catcher as BINARY::TEST, run in the forward schedule, or
# BINARY::TEST@SCHEDULE:SEED (a bug that only an adversarial interleaving shows), either with
# the suffix +weak or +weak-random for a bug that only the weak-memory mode shows (a missing
# release, acquire, barrier or scope: TPFUSE_EMU_MEMORY). The
# baseline (cuda/ unmutated, built the same way) must pass every catcher first, so a catch is
# the mutant's doing. The tests' data is the tests' fixed default (TPFUSE_TEST_SEED unset):
# a catch replays. The emulator suite runs the same tests on fresh data under every schedule.
#
# The libraries here are built with -g0, and the kernel units (cuda/*.cu) at -O0 with
# __forceinline__ a plain inline (TPFUSE_EMU_INLINE_AS_ASKED): a mutant of a header reached by
# three kernel units recompiles in ~5 s instead of ~30 s (gemm_all_reduce.cu alone: 3.6 s at
# -O0 with every forced inline copied, 1.4 s without); its test runs up to ~1.5x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup.sh)"
unset TPFUSE_TEST_SEED
# A mutant that hangs a wait without a deadline is reported after 1 s of virtual time
# instead of the default 60 s.
export TPFUSE_EMU_DEADLOCK_NS=${TPFUSE_EMU_DEADLOCK_NS:-1000000000}
# Likewise the deadline of the tests' launches on raw ranks (tests/common/emu.rs, Ranks): a
# mutant that leaves a flag unanswered fails at 1 s of virtual time instead of 60 (the
# emulator spins through a wait's virtual minute: 75 s of a run for started-window-one-ahead).
export TPFUSE_TEST_TIMEOUT_NS=${TPFUSE_TEST_TIMEOUT_NS:-1000000000}

echo "mutants: building the emulator tests" >&2
# With the environment the emulator suite built them in: build.rs reruns when the emulator's
# flags change, so the flags below are set only after this build (else this build and the
# next script's would each recompile the emulator).
json=$(cargo test --features emulator --no-run --message-format=json 2>/dev/null)
export TPFUSE_EMU_CXXFLAGS=-g0 TPFUSE_EMU_KERNEL_CXXFLAGS="-O0 -DTPFUSE_EMU_INLINE_AS_ASKED"
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
  # The baseline's precompiled standard headers, linked (the same list and flags; build.sh
  # checks the list, and replaces a .gch rather than writing into it).
  cp -rl "$work/baseline/out/pch" "$out/"
  while read -r file; do
    for unit in $(units_reaching "$work/$name/cuda" "$file"); do
      rm -f "$out/obj/$(basename "$unit").o"
    done
  done <"$work/$name.files"
  TPFUSE_EMU_KEEP_OBJECTS=1 bash "$build" "$work/$name/cuda" "$out"
}

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

# Runs catcher SPEC (BINARY::TEST[@SCHEDULE:SEED][+MEMORY]) against $work/NAME's library: 0
# when it passes, 1 when it fails, 2 when it cannot run.
run_test() {
  local name=$1 spec=$2
  local binary=${spec%%::*} rest=${spec#*::} bin schedule=forward seed=1 memory=sc
  if [ "${rest%+*}" != "$rest" ]; then
    memory=${rest##*+}
    rest=${rest%+*}
  fi
  local test=${rest%@*}
  if [ "$rest" != "$test" ]; then
    schedule=${rest#*@}
    seed=${schedule#*:}
    schedule=${schedule%%:*}
  fi
  bin=$(test_binary "$binary")
  [ -x "$bin" ] || { echo "mutants: no test binary $binary" >&2; return 2; }
  local listed
  listed=$("$bin" --list 2>/dev/null)
  grep -qx "$test: test" <<<"$listed" || { echo "mutants: $binary has no test $test" >&2; return 2; }
  local built=$SECONDS
  if ! build_library "$name" >"$work/$name/build.log" 2>&1; then
    echo "mutants: $name does not compile:" >&2
    tail -n 20 "$work/$name/build.log" >&2
    return 2
  fi
  echo $((SECONDS - built)) >"$work/$name.build"
  LD_PRELOAD="$work/$name/out/libtpfuse_emu.so" TPFUSE_EMU_SCHEDULE=$schedule TPFUSE_EMU_SEED=$seed \
    TPFUSE_EMU_MEMORY=$memory timeout 600 "$bin" --exact "$test" >"$work/$name/test.log" 2>&1 || return 1
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
jobs_max=${TPFUSE_MUTANT_JOBS:-$(nproc 2>/dev/null || echo 2)}
mutant() {
  local name=$1 spec=$2 what=$3
  shift 3
  wanted "$name" || return 0
  names+=("$name")
  printf '%s\t%s\n' "$spec" "$what" >"$work/$name.about"
  if ! apply "$name" "$@"; then
    echo "apply 0" >"$work/$name.outcome"
    return 0
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  (
    t0=$(date +%s)
    status=0
    run_test "$name" "$spec" || status=$?
    echo "$status $(($(date +%s) - t0))" >"$work/$name.outcome"
  ) &
}

report() {
  local name=$1 spec what status secs
  IFS=$'\t' read -r spec what <"$work/$name.about"
  read -r status secs <"$work/$name.outcome"
  total=$((total + 1))
  if [ "$status" = apply ]; then
    failed+=("$name (does not apply)")
  elif [ "$status" -eq 0 ]; then
    echo "SURVIVED  $name ($what): $spec passed (${secs}s)"
    failed+=("$name (survived)")
  elif [ "$status" -eq 2 ]; then
    failed+=("$name (does not build or run)")
  else
    caught=$((caught + 1))
    echo "caught    $name ($what) by $spec in ${secs}s (its build $(cat "$work/$name.build" 2>/dev/null || echo ?)s)"
  fi
}

# The baseline: every catcher named below passes on the unmutated cuda/ (built as the mutants
# are), under its schedule.
if wanted baseline; then
  apply baseline
  build_library baseline >"$work/baseline/build.log" 2>&1 ||
    { echo "mutants: the unmutated cuda/ does not compile" >&2; tail -n 20 "$work/baseline/build.log" >&2; exit 1; }
  specs=$(sed -n 's/^mutant [^ ]* \([a-z]*_[a-z_]*::[^ ]*\) .*/\1/p' scripts/mutants.sh | sort -u)
  i=0
  for spec in $specs; do
    i=$((i + 1))
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    mkdir -p "$work/baseline-$i"
    ln -sfn "$work/baseline/out" "$work/baseline-$i/out"
    (run_test "baseline-$i" "$spec" && touch "$work/baseline-$i/passed") &
  done
  wait
  i=0
  for spec in $specs; do
    i=$((i + 1))
    [ -f "$work/baseline-$i/passed" ] || { echo "mutants: the unmutated cuda/ fails $spec:" >&2; cat "$work/baseline-$i/test.log" >&2; exit 1; }
  done
  echo "baseline  unmutated cuda/ passes the $(wc -w <<<"$specs") catchers"
fi

# No barrier closes a collective launch (barrier.cuh, "Finished launches"): a rank's next
# launch waits for its peers' announcements instead. Only the pct schedule runs a rank whole
# launches ahead of a peer that still reads its staging.
mutant no-finished-wait emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue@pct:1 "a collective launch stages before its peers finished the one before" \
  barrier.cuh 'if (peer < g.world && *failures_ == 0 && !await_peer_finished(' 'if (false && !await_peer_finished('
# Only the random schedule's long loads (schedules.cpp, preempt_at_load) hold a warp back while
# the rest of its block counts the block finished: without them a loop of plain loads ran as one
# step, and this mutant passed every seed an outside review tried.
mutant finish-counts-before-block-done emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue@random:1 "a block counts itself finished before its other warps read the peers' staging" \
  barrier.cuh $'  __device__ void finish() const {\n    __syncthreads();\n    if (threadIdx.x == 0) {' $'  __device__ void finish() const {\n    if (threadIdx.x == 0) {'
mutant finish-announces-nothing emu_all_reduce::all_gather_every_world "the rank's last block does not announce the launch it finished" \
  barrier.cuh 'st_release_sys(Pad{peers_.signals[threadIdx.x]}.finished(g_.rank), *own_.finished_count());' ''
mutant finished-count-stays emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue@pct:1 "the rank's count of finished launches never grows (every wait passes at once)" \
  barrier.cuh '        *own_.finished_count() += 1;' ''
mutant finished-flag-gpu emu_all_reduce::all_gather_every_world+weak "the finished launch announced with st.release.gpu (peers on other GPUs)" \
  barrier.cuh 'st_release_sys(Pad{peers_.signals[threadIdx.x]}.finished(g_.rank), *own_.finished_count());' \
  'st_release_gpu(Pad{peers_.signals[threadIdx.x]}.finished(g_.rank), *own_.finished_count());'
mutant fused-begin-skips-finished emu_gemm_all_reduce::an_all_gather_gemm_right_after_a_one_shot_rmsnorm_overlaps_nothing@pct:1 "a fused launch pushes into a peer's result area before the peers finished the all-reduce before" \
  fused_flags.cuh 'if (st.failed == 0 && !await_peer_finished(' 'if (false && !await_peer_finished('
mutant first-barrier emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "one-shot reads peers before they staged" \
  all_reduce.cu $'copy_range(input, static_cast<T *>(peers.data[g.rank]), r);\n  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);' \
  $'copy_range(input, static_cast<T *>(peers.data[g.rank]), r);'
mutant reverse-rank-order emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "ranks summed W-1..0 (vector path)" \
  reduce.cuh 'const T *rank_p = static_cast<const T *>(peers.data[p]) + offset + i;' \
  'const T *rank_p = static_cast<const T *>(peers.data[world - 1 - p]) + offset + i;'
mutant no-sync-before-release emu_all_reduce::all_gather_every_world@random:1 "a barrier publishes before the whole block is done" \
  barrier.cuh $'const uint32_t value = ++epoch_;\n    __syncthreads();' 'const uint32_t value = ++epoch_;'
mutant wait-own-rank-only emu_all_reduce::a_failed_two_shot_marks_out_and_residual_through_its_rmsnorm "a barrier that waits only for rank 0" \
  barrier.cuh 'if (peer < g_.world) {' 'if (peer < 1) {'
mutant no-timeout-broadcast emu_all_reduce::a_missing_rank_times_out_on_every_survivor_within_the_deadline "a timed-out rank does not tell its peers" \
  barrier.cuh 'if (p != g.rank) st_release_sys' 'if (false) st_release_sys'
mutant missing-rank-not-told emu_all_reduce::a_missing_rank_times_out_on_every_survivor_within_the_deadline "a timed-out rank does not tell the rank that was late" \
  barrier.cuh 'if (p != g.rank) st_release_sys' 'if (p != g.rank && p != static_cast<int>(word & 0xffu)) st_release_sys'
mutant no-descriptor-check emu_all_reduce::ranks_that_launch_different_sizes_or_grids_get_a_mismatch_not_wrong_data "the first barrier does not compare the ranks' descriptors" \
  barrier.cuh 'ld_relaxed_sys(own_.descriptor(blockIdx.x, peer)) != descriptor_' 'false'
mutant barrier-blind-to-fused-peer emu_all_reduce::a_rank_by_packets_against_one_by_flags_is_a_mismatch_not_a_timeout "a stalled barrier does not look for a peer in a fused launch (a timeout at the deadline)" \
  barrier.cuh 'if (elsewhere >= 0 && started_fused_beyond(own, elsewhere)' 'if (false && started_fused_beyond(own, elsewhere)'
mutant barrier-fused-peer-window emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "a stalled barrier takes a peer's started flag of this rank's own last fused launch for one beyond it" \
  barrier.cuh 'return ahead == 1;' 'return ahead <= 1;'
mutant descriptor-without-grid emu_all_reduce::ranks_that_launch_different_sizes_or_grids_get_a_mismatch_not_wrong_data "the descriptor leaves out the grid" \
  all_reduce.cu 'static_cast<uint64_t>(grid), bias != nullptr' 'uint64_t{0}, bias != nullptr'
mutant no-clock-backstop emu_all_reduce::a_wait_ends_when_the_timer_stands_still "a wait trusts %globaltimer alone" \
  barrier.cuh '(waited_cycles > 0 && static_cast<uint64_t>(waited_cycles) > backstop_cycles_)' 'false'
mutant failed-output-unmarked emu_all_reduce::a_failed_two_shot_marks_out_and_residual_through_its_rmsnorm "a block that gives up leaves its outputs as they were" \
  failure.cuh 'if (p == nullptr) return;' 'return;'
mutant no-host-publish emu_all_reduce::a_missing_rank_times_out_on_every_survivor_within_the_deadline "a failed launch does not publish its error word to the host" \
  barrier.cuh 'if (g.host_error != nullptr) st_release_sys' 'if (false) st_release_sys'
mutant rmsnorm-blocks-do-not-loop gpu_epilogue::rms_norm_loops_over_more_rows_than_a_launch_has_blocks "the RMSNorm blocks normalise one row each and leave the rows past the grid" \
  epilogue.cu 'row < rows; row += gridDim.x' 'row < rows && row < gridDim.x; row += gridDim.x'
mutant rmsnorm-after-failure emu_all_reduce::a_failed_two_shot_marks_out_and_residual_through_its_rmsnorm "the two-shot RMSNorm normalises a failed launch's marker" \
  epilogue.cu 'if (failed) {' 'if (false) {'
mutant residual-not-written emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "the epilogue does not write the residual back" \
  epilogue.cuh 'if (residual != nullptr) store16(residual + i, y);' ''
mutant bias-column-per-vector emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "the vector epilogue takes the bias at the row's first column" \
  epilogue.cuh 'reinterpret_cast<const uint4 *>(bias + i % hidden)' 'reinterpret_cast<const uint4 *>(bias + i / hidden % 1)'
mutant two-shot-residual emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "two-shot does not gather peers' slices into residual" \
  all_reduce.cu 'if (residual != nullptr) st_global(reinterpret_cast<uint4 *>(residual + at), v[j]);' ''
mutant copy-last-of-round-skipped emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "a copy stores all but the last vector of each round of loads" \
  copy.cuh 'if (i + j * stride < end) store(i + j * stride, v[j]);' 'if (i + j * stride + stride < end) store(i + j * stride, v[j]);'
mutant copy-rounds-overlap emu_counters::the_all_reduce_moves_what_the_plan_says_block_by_block "a copy steps one vector, not a round, copying each vector up to four times (same values)" \
  copy.cuh 'for (size_t i = first; i < end; i += kCopyInFlight * stride) {' 'for (size_t i = first; i < end; i += stride) {'
mutant gather-chunks-own-rank emu_counters::two_shot_reads_twice_the_peers_share "two-shot gathers its own slice too (same values, more bytes)" \
  all_reduce.cu 'return first + j != rank && r[j].begin + i + kVec <= r[j].end;' 'return r[j].begin + i + kVec <= r[j].end;'
mutant gather-chunks-tail-dropped emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "two-shot does not gather the elements past the last whole vector" \
  all_reduce.cu 'for (size_t i = tail + threadIdx.x; i < r[j].end; i += kThreads) {' 'for (size_t i = tail + threadIdx.x; i < tail; i += kThreads) {'
mutant all-gather-from-rank-0 emu_all_reduce::all_gather_every_world "all-gather loads every rank's part from rank 0" \
  all_reduce.cu 'if (p < g.world) v[p] = ld_global_cg(static_cast<const uint4 *>(peers.data[p]) + i);' \
  'if (p < g.world) v[p] = ld_global_cg(static_cast<const uint4 *>(peers.data[0]) + i);'
mutant partials-reversed emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "one-shot adds a row's segment partials in reverse (fused and unfused bits differ)" \
  all_reduce.cu 'sum += ld_global(partials + first + s);' 'sum += ld_global(partials + first + seg.per_row - 1 - s);'
# The outside reader's race (issue 21), and the closing barrier's absence: the partials in
# the staging, which a peer's block may still read. Only the pct schedule shows it.
mutant partials-in-staging emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue@pct:1 "one-shot keeps unit u's RMSNorm partial at byte 4u of its staging" \
  all_reduce.cu 'return reinterpret_cast<float *>(static_cast<char *>(peers.data[g.rank]) + g.capacity);' 'return static_cast<float *>(peers.data[g.rank]);'
mutant no-rank-meet emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "one-shot normalises before the rank's other blocks wrote their partials" \
  all_reduce.cu 'if (!barrier.meet_rank_blocks()) return false;' ''
# A row of one RMSNorm segment: one-shot normalises it in one block, from registers.
mutant whole-rows-never emu_counters::the_all_reduce_moves_what_the_plan_says_block_by_block "one-shot normalises rows of one segment as segments whose blocks meet (the same bits, more bytes and phases)" \
  all_reduce.cu 'const bool whole_rows = gamma != nullptr && seg.per_row == 1;' 'const bool whole_rows = false;'
mutant whole-rows-of-two-segments emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "one-shot normalises rows of two segments from one vector a thread" \
  all_reduce.cu 'const bool whole_rows = gamma != nullptr && seg.per_row == 1;' 'const bool whole_rows = gamma != nullptr && seg.per_row <= 2;'
mutant whole-rows-gamma-of-vector-0 emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "every thread multiplies by gamma's first vector" \
  all_reduce.cu 'gamma_held = load16(gamma + gamma_col);' 'gamma_held = load16(gamma);'
mutant whole-rows-unnormalised emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "one-shot stores a row of one segment without its RMSNorm" \
  all_reduce.cu 'if (held) store16(out + i, normalize_vector(h, gamma_held, rstd));' 'if (held) store16(out + i, h);'
mutant held-squares-without-tree emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "the held sum of squares skips the warp's shuffle tree" \
  epilogue.cuh 'const float ss = warp_tree(held ? squares_of(v) : 0.f);' 'const float ss = held ? squares_of(v) : 0.f;'
# A register read before it is written: the emulator starts a kernel's locals as a pattern
# (build.rs), not the zeros a fresh fiber stack would give.
mutant held-squares-of-unheld emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "threads past the row add the squares of a vector they never loaded" \
  epilogue.cuh 'const float ss = warp_tree(held ? squares_of(v) : 0.f);' 'const float ss = warp_tree(squares_of(v));'
mutant reduce-last-rank-only emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "each rank's vector replaces the sum instead of adding to it" \
  reduce.cuh 'acc[j] = p == 0 ? Elem<T>::to_f32(x.v[j]) : acc[j] + Elem<T>::to_f32(x.v[j]);' 'acc[j] = Elem<T>::to_f32(x.v[j]);'
# Rows of several segments, a block of one: the segment is held in registers too.
mutant one-segment-never emu_counters::the_all_reduce_moves_what_the_plan_says_block_by_block "a block of one segment of a longer row reads it back to normalise it (the same bits, more bytes and phases)" \
  all_reduce.cu 'const bool one_segment = gamma != nullptr && seg.per_row > 1 && units.end - units.begin == 1;' 'const bool one_segment = false;'
mutant one-segment-no-meet emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a block of one segment reads the row's partials before the other blocks stored theirs" \
  all_reduce.cu 'const bool met = barrier.meet_rank_blocks();' 'const bool met = true;'
mutant one-segment-gamma-of-segment-0 emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a block of a row's second segment multiplies by gamma's first segment" \
  all_reduce.cu 'const size_t gamma_col = units.begin % seg.per_row * kSegment<T> + threadIdx.x * Vec16<T>::kLen;' 'const size_t gamma_col = threadIdx.x * Vec16<T>::kLen;'
mutant one-segment-grid-of-vectors emu_counters::the_all_reduce_moves_what_the_plan_says_block_by_block "rows of 4096 + 2048 get 512-vector blocks, some of two segments (the same bits, more bytes)" \
  all_reduce.cu '    if (per_row > 1) grid = static_cast<int>(units < static_cast<size_t>(g.blocks) ? units : g.blocks);
    else if' '    if'
# A block of fewer threads than a segment's vectors (the fused kernels' 32-256) runs its turns
# in rounds, each issuing its loads together.
mutant norm-squares-skip-rounds emu_gemm_all_reduce::rows_past_the_stage_normalise_in_rounds "a small block's sum of squares runs every other round of turns" \
  epilogue.cuh $'first += kRound) {\n    uint4 raw[kRound];' $'first += 2 * kRound) {\n    uint4 raw[kRound];'
mutant norm-normalize-skip-rounds emu_gemm_all_reduce::rows_past_the_stage_normalise_in_rounds "a small block normalises every other round of turns" \
  epilogue.cuh $'first += kRound) {\n    uint4 xs[kRound], gs[kRound];' $'first += 2 * kRound) {\n    uint4 xs[kRound], gs[kRound];'
# A row staged in shared memory (the fused kernels' blocks, once their GEMM is done): cp.async
# of x and gamma, then the segment loop's trees read from there.
mutant staged-no-wait emu_gemm_all_reduce::small_blocks_normalise_rows_from_shared_memory "a staged row is read before its copies are waited for" \
  epilogue.cuh $'  cp_async_commit();\n  cp_async_wait<0>(); // this thread\'s copies' '  cp_async_commit(); //'
# No barrier between a row's copies and its reads: each thread reads back only the vectors it
# copied (or, gathering, stored) itself. A copy by another thread is then a race.
mutant staged-copies-by-another-thread emu_gemm_all_reduce::small_blocks_normalise_rows_from_shared_memory "thread t stages the vectors thread kBlock - 1 - t reads, with no barrier between" \
  epilogue.cuh $'  for (size_t i = static_cast<size_t>(threadIdx.x) * kVec; i < hidden; i += static_cast<size_t>(kBlock) * kVec)\n    cp_async_16(' $'  for (size_t i = static_cast<size_t>(kBlock - 1 - threadIdx.x) * kVec; i < hidden; i += static_cast<size_t>(kBlock) * kVec)\n    cp_async_16('
mutant gather-staged-by-another-thread emu_gemm_all_reduce::small_blocks_normalise_rows_from_shared_memory "the two-shot's gather stages the vectors another thread reads, with no barrier between" \
  gemm_all_reduce.cu '          threadIdx.x * kVec, hidden, blockDim.x * kVec,' '          (blockDim.x - 1 - threadIdx.x) * kVec, hidden, blockDim.x * kVec,'
mutant staged-gamma-over-x emu_gemm_all_reduce::small_blocks_normalise_rows_from_shared_memory "a staged row's gamma is copied over its x" \
  epilogue.cuh '  T *gs = xs + hidden; // hidden is a multiple of the vector' '  T *gs = xs; // hidden is a multiple of the vector'
mutant staged-squares-of-segment-0 emu_gemm_all_reduce::rows_of_two_segments_normalise_from_shared_memory "a staged row of two segments sums its first segment's squares twice" \
  epilogue.cuh '      const size_t i = s * kSegment<T> + turn_offset<T, kBlock>(t);' '      const size_t i = turn_offset<T, kBlock>(t);'
mutant stage-over-names emu_gemm_all_reduce::a_block_of_three_strips_normalises_them_from_shared_memory "the RMSNorm's stage overlaps count_strips' names of the strips the block completed" \
  gemm_all_reduce.cu 'const NormStage stage{smem + kNamesBytes,' 'const NormStage stage{smem,'
# The stage is taken where the plan says (every path gives the same bits: only the counters
# tell them apart).
mutant stage-never-used emu_counters::the_fused_rmsnorm_moves_what_the_plan_says_row_by_row "the fused kernels lend their RMSNorm no stage" \
  gemm_all_reduce.cu 'static_cast<size_t>(Cfg::kSmemBytes) - kNamesBytes};' '0};'
mutant stage-fit-strict emu_counters::the_fused_rmsnorm_moves_what_the_plan_says_row_by_row "a row that fills the stage exactly goes segment by segment" \
  epilogue.cuh '    if (staged_row_bytes<T>(hidden) <= stage.bytes) {' '    if (staged_row_bytes<T>(hidden) < stage.bytes) {'
mutant gather-stage-never-used emu_counters::the_fused_rmsnorm_moves_what_the_plan_says_row_by_row "the two-shot's gather copies into out and normalises there, where its row fits the stage" \
  gemm_all_reduce.cu '  const bool staged = gamma != nullptr && staged_row_bytes<T>(hidden) <= stage.bytes;' '  const bool staged = false;'
mutant held-norm-gamma-of-turn-0 emu_gemm_all_reduce::blocks_that_hold_a_row_normalise_it_from_registers "a block that holds its row normalises every turn with its first turn's gamma" \
  epilogue.cuh 'normalize_vector(vec_of<T>(xs[h]), vec_of<T>(gs[h]), rstd));' 'normalize_vector(vec_of<T>(xs[h]), vec_of<T>(gs[0]), rstd));'
mutant held-norm-squares-of-turn-0 emu_gemm_all_reduce::blocks_that_hold_a_row_normalise_it_from_registers "a block that holds its row adds its first turn's squares for every turn" \
  epilogue.cuh 'turn_squares<T, kBlock>(warp_sums, t, xs[h],' 'turn_squares<T, kBlock>(warp_sums, t, xs[0],'
# Rows of two segments held by the standalone kernel (the two-shot's RMSNorm), against the
# one-shot's segments spread over blocks.
mutant held-row-first-segment-only emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a held row of two segments sums the first segment's squares only" \
  epilogue.cuh 'if (static_cast<size_t>(s) * kSegment<T> >= hidden) break;' 'if (s > 0) break;'
mutant held-row-segments-share-vectors emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a held row sums the first segment's vectors for every segment" \
  epilogue.cuh 'const int h = s * kTurnsOf + t;' 'const int h = t;'
mutant held-row-stores-first-segment-only emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a held row of two segments stores its first segment only" \
  epilogue.cuh $'  for (int h = 0; h < kHeld; ++h) {\n    if (at(h) < hidden) store16(' $'  for (int h = 0; h < kTurnsOf; ++h) {\n    if (at(h) < hidden) store16('
mutant held-row-one-segment-standalone emu_counters::the_two_shots_rmsnorm_moves_what_the_plan_says_block_by_block "the standalone RMSNorm holds one segment where the plan says two (the same bits, x read twice)" \
  epilogue.cuh 'constexpr int kHeldSegments = kBlock >= kThreads && sizeof(T) == 2 ? 2 :' 'constexpr int kHeldSegments = kBlock >= kThreads && sizeof(T) == 2 ? 1 :'
mutant half-warp-sum emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "RMSNorm's warp sum skips the first shuffle" \
  epilogue.cuh 'for (int offset = 16; offset > 0; offset >>= 1)' 'for (int offset = 8; offset > 0; offset >>= 1)'
mutant all-gather-offset emu_all_reduce::all_gather_every_world "all-gather writes every rank's part at its own offset" \
  all_reduce.cu 'uint4 *dst = out + p * len_vectors;' 'uint4 *dst = out + g.rank * len_vectors;'
# Issue 21, defect 3: the C ABI's checks before a launch (each mutant is one check's old form).
mutant all-reduce-past-capacity emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "all-reduce launches a message larger than the staging" \
  all_reduce.cu $'  if (!fits2(rows, hidden, sizeof(T), g.capacity)) return cudaErrorInvalidValue;\n' ''
mutant all-reduce-capacity-product emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "all-reduce checks the capacity with a product that wraps" \
  all_reduce.cu 'if (!fits2(rows, hidden, sizeof(T), g.capacity)) return' 'if (rows * hidden * sizeof(T) > g.capacity) return'
mutant all-reduce-misaligned emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "all-reduce launches with pointers off a 16-byte boundary" \
  all_reduce.cu $'if (!is_aligned16(input) || !is_aligned16(out) || !is_aligned16(bias) || !is_aligned16(residual) ||\n      !is_aligned16(gamma)) {' 'if (false) {'
mutant all-reduce-partial-vector-rows emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "all-reduce launches bias or gamma with rows of partial vectors" \
  all_reduce.cu '(bias != nullptr || gamma != nullptr) && hidden % Vec16<T>::kLen != 0' 'false'
mutant reduce-scatter-unchecked emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "reduce-scatter launches without checking capacity, alignment or len" \
  all_reduce.cu $'if (!fits2(static_cast<size_t>(group->world), len, size, group->capacity) || (len * size) % 16 != 0 ||\n      !is_aligned16(input) || !is_aligned16(out)) {' \
  'if (false) {'
mutant reduce-scatter-capacity-one-slice emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "reduce-scatter checks one slice, not world slices, against the staging" \
  all_reduce.cu 'fits2(static_cast<size_t>(group->world), len,' 'fits2(1, len,'
mutant all-gather-unchecked emu_all_reduce::bad_calls_are_refused_before_anything_is_launched "all-gather launches without checking capacity or alignment" \
  all_reduce.cu 'if (len_bytes > group->capacity || !is_aligned16(input) || !is_aligned16(out)) return' 'if (false) return'
mutant descriptor-without-eps emu_all_reduce::ranks_that_pass_different_eps_get_a_mismatch_not_different_bits "the ranks' descriptors leave out eps (different eps, different bits)" \
  all_reduce.cu 'gamma != nullptr, gamma != nullptr ? float_bits(eps) : 0});' 'gamma != nullptr});'
mutant scalar-tail emu_reduce_ranks::reduce_ranks_bf16_every_world_and_length "reduce_ranks skips the scalar tail" \
  reduce_ranks.cu 'for (size_t i = vec_len * kVec + first; i < len; i += stride) {' \
  'for (size_t i = len + first; i < len; i += stride) {'
mutant swap-b-fragment emu_gemm::gemm_auto_picks_a_config_that_gives_the_same_bits "two B fragment registers swapped" \
  gemm_sm80.cuh 'bf[2 * p][0], bf[2 * p][1],' 'bf[2 * p][1], bf[2 * p][0],'
mutant no-a-swizzle emu_gemm::gemm_auto_picks_a_config_that_gives_the_same_bits "cp.async of A without the shared-memory swizzle" \
  gemm_sm80.cuh 'a_dst[i] = r * Cfg::kRowBytes + ((chunk ^ swizzle_term<Cfg::kChunks>(r)) << 4);' \
  'a_dst[i] = r * Cfg::kRowBytes + (chunk << 4);'
mutant wait-group-off-by-one emu_gemm::gemm_auto_picks_a_config_that_gives_the_same_bits "cp.async.wait_group STAGES-1 instead of STAGES-2" \
  gemm_sm80.cuh 'cp_async_wait<STAGES - 2>();' 'cp_async_wait<STAGES - 1>();'
mutant no-sync-after-wait emu_gemm::gemm_auto_picks_a_config_that_gives_the_same_bits "no __syncthreads after the stage wait" \
  gemm_sm80.cuh $'cp_async_wait<STAGES - 2>();\n    __syncthreads();' 'cp_async_wait<STAGES - 2>();'
mutant load-before-sync emu_gemm::gemm_bf16_every_config_shape_and_epilogue@random:1 "the next stage is loaded before the barrier that frees it" \
  gemm_sm80.cuh $'    __syncthreads();\n    if (t + STAGES - 1 < slices) load_slice(write_stage, first_slice + t + STAGES - 1);' \
  $'    if (t + STAGES - 1 < slices) load_slice(write_stage, first_slice + t + STAGES - 1);\n    __syncthreads();'
mutant last-slice-steps emu_gemm::gemm_bf16_every_config_shape_and_epilogue "the last k-slice runs one k16-step too few" \
  gemm_sm80.cuh 'const int last_steps = (k_end - (first_slice + slices - 1) * BK + 15) / 16;' \
  'const int last_steps = (k_end - (first_slice + slices - 1) * BK) / 16;'
mutant split-chain-not-restarted gpu_gemm::split_k_bf16 "a part's chain starts from the previous part's, not from zero" \
  gemm_sm80.cuh $'            total[i][j][q] = first_part ? acc[i][j][q] : total[i][j][q] + acc[i][j][q];\n            acc[i][j][q] = 0.0f;' \
  '            total[i][j][q] = first_part ? acc[i][j][q] : total[i][j][q] + acc[i][j][q];'
mutant split-last-part-alone gpu_gemm::split_k_bf16 "a tile run in one block keeps only its last part" \
  gemm_sm80.cuh 'if (split.last - split.first > 1) {' 'if (false) {'
mutant split-fold-wrong-part gpu_gemm::split_k_bf16 "the parallel split folds the parts in another order (part S - j for part j)" \
  gemm_split.cuh 'const Vec16<float> lo = load16_peer(sum + j * mn), hi = load16_peer(sum + j * mn + 4);' \
  'const Vec16<float> lo = load16_peer(sum + (parts - j) * mn), hi = load16_peer(sum + (parts - j) * mn + 4);'
mutant split-fold-sum-not-read gpu_gemm::split_k_bf16 "a block's first fold starts from uninitialised registers, not the running sum" \
  gemm_split.cuh '        if (!loaded) {' '        if (false) {'
mutant split-count-kept gpu_gemm::split_k_bf16 "the parallel split leaves its tiles' words set (the next launch never finishes a tile)" \
  gemm_split.cuh '        *word = 0; // every part folded: no other block touches the word in this launch' ''
mutant split-boundary-32 gpu_gemm::split_k_bf16 "part boundaries at multiples of 32 (inside a 64-deep k-slice)" \
  gemm_sm80.cuh 'return static_cast<int>(64 * (k64 * p / parts));' 'return static_cast<int>(32 * (2 * k64 * p / parts));'
mutant select-128-only-when-full cpu_gemm::the_tile_configuration_fills_the_gpu "128x128 tiles only once they give every SM a block (not 90%)" \
  gemm.cu 'return big_tiles * 10 >= static_cast<size_t>(sms) * 9 ?' 'return big_tiles >= static_cast<size_t>(sms) ?'
mutant fused-tile-shallow cpu_gemm::the_configurations_describe_themselves "the fused kernels run tile-64x64's 32-deep slices" \
  gemm_sm80.cuh 'using type = FusedTile64x64;' 'using type = Tile64x64;'
mutant split-release-early gpu_gemm::split_k_bf16@random:1+weak-random "a part marked stored before the whole block stored its chains" \
  gemm_split.cuh $'  __syncthreads(); // every thread\'s partial stores, before thread 0\'s release\n' ''
mutant split-no-sync-after-acquire gpu_gemm::split_k_bf16+weak-random "the block reads the parts without the barrier after thread 0's acquire" \
  gemm_split.cuh $'  __syncthreads(); // thread 0\'s acquire, before the block\'s loads of the running sum\n' ''
mutant split-count-relaxed gpu_gemm::split_k_bf16+weak-random "a part marked stored relaxed (no release, no acquire)" \
  gemm_split.cuh 'atomic_add_acq_rel_gpu(word, 1u << part)' 'atomicAdd(word, 1u << part)'
mutant split-fold-count-relaxed gpu_gemm::split_k_bf16@random:1+weak-random "a fold counted relaxed (no release of the running sum, no acquire of the next part)" \
  gemm_split.cuh 'atomic_add_acq_rel_gpu(word, static_cast<uint32_t>(end - first) << kFoldedShift)' 'atomicAdd(word, static_cast<uint32_t>(end - first) << kFoldedShift)'
mutant split-fold-no-sync gpu_gemm::split_k_bf16+weak-random "a fold counted before the whole block stored the running sum" \
  gemm_split.cuh $'    __syncthreads(); // every thread\'s fold (and read of run_end), before thread 0\'s release\n' ''
mutant split-fold-stops gpu_gemm::split_k_bf16@random:1 "the folding block stops after its run even when the next part is stored (its block left it)" \
  gemm_split.cuh 'run_end = (old >> end & 1u) != 0 ? stored_run_end(old, end, parts) : -1;' 'run_end = -1;'
mutant split-fold-skips-run gpu_gemm::split_k_bf16 "a block that folds from its part on folds none of it unless it is the last run" \
  gemm_split.cuh 'if (end == parts || end > (first > 0 ? first : 1))' 'if (end == parts)'
mutant split-fold-always gpu_gemm::split_k_bf16@reverse:1 "every block folds from its part on, whatever was folded before" \
  gemm_split.cuh 'run_end = old >> kFoldedShift == static_cast<uint32_t>(part) ?' 'run_end = true ?'
mutant split-counts-by-tiles emu_counters::one_scratch_serves_splits_of_every_shape "the partials start after the call's own counts (their place moves with the tile count)" \
  gemm.cu 'reinterpret_cast<float *>(base + kSplitCountsBytes)' 'reinterpret_cast<float *>(base + (tiles * 4 + 255) / 256 * 256)'
mutant epilogue-no-bias emu_gemm::gemm_auto_picks_a_config_that_gives_the_same_bits "the GEMM epilogue reads bias at column 0" \
  gemm_epilogue.cuh 'const Vec16<T> b = load16(bias + col);' 'const Vec16<T> b = load16(bias);'
mutant flag-before-tile emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "the fused kernel publishes a block's flag before computing its tiles" \
  gemm_all_reduce.cu $'    return;\n  }\n#pragma unroll 1' $'    return;\n  }\n  if (flags) fused::publish(peers, g, blockIdx.x, flag_value);\n#pragma unroll 1'
mutant fused-split-flag-before-fold emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "the fused parallel split publishes a tile before folding its parts" \
  gemm_all_reduce.cu 'if (fused::split_unit<T, Cfg>(peers,' 'if ((fused::publish(peers, g, tile, flag_value), true) && fused::split_unit<T, Cfg>(peers,'
mutant fused-split-fold-no-sync emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the fused parallel split publishes a tile before the whole block stored its sum" \
  gemm_split.cuh $'    __syncthreads(); // every thread\'s fold (and read of run_end), before thread 0\'s release\n' ''
mutant fused-split-await-first-tile-only emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "with the parts in parallel, a block waits only for its first tile's flags" \
  gemm_all_reduce.cu 'for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x)
          if (span_of' 'for (int tile = blockIdx.x; tile < tiles; tile += tiles)
          if (span_of'
mutant fused-split-first-part-only emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the fused parallel split computes only the first part of each tile" \
  gemm_all_reduce.cu 'for (int unit = blockIdx.x; unit < tiles * parts; unit += gridDim.x) {' 'for (int unit = blockIdx.x; unit < tiles; unit += gridDim.x) {'
mutant fused-split-never-parallel emu_counters::the_fused_split_runs_its_parts_as_the_grids_units "the fused kernel runs a tile's parts in its block where the plan runs them in parallel" \
  fused_split.cuh 'return gemm::kParallelSplit<Cfg> && parts > 1' 'return false && parts > 1'
mutant flag-after-first-tile emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "the fused kernel publishes a block's flag after its first tile" \
  gemm_all_reduce.cu $'    st.clock.tile_computed();\n  }\n  if (flags)' $'    st.clock.tile_computed();\n    fused::publish(peers, g, blockIdx.x, flag_value);\n  }\n  if (flags)'
mutant reduce-without-waiting emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "the fused kernel reduces its tiles without waiting for the other ranks' flags" \
  gemm_all_reduce.cu 'fused::await(peers, g, deadline, st, blockIdx.x, threadIdx.x, descriptor);' ';'
mutant reduce-first-tile-only emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the fused kernel reduces only the first of a block's tiles" \
  gemm_all_reduce.cu $'      tile += gridDim.x;\n      if (tile >= tiles) return;' $'      return;'
mutant reduce-vectors-by-tile-width emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the fused reduction steps a tile's vectors by the configuration's width, not the tile's" \
  gemm_all_reduce.cu 'min(Cfg::kBlockN, L.n - n0) / Vec16<T>::kLen};' 'Cfg::kBlockN / Vec16<T>::kLen};'
mutant fused-blocks-per-sm-one emu_counters::the_fused_grid_fills_the_sms_it_is_given "the fused kernel's occupancy query reports one block an SM" \
  gemm_all_reduce.cu 'return blocks_per_sm<decltype(t)>(config, n);' 'return (*n = 1, 0);'
mutant gather-blocks-per-sm-one emu_counters::the_fused_grid_fills_the_sms_it_is_given "all-gather + GEMM's occupancy query reports one block an SM" \
  all_gather_gemm.cu 'return blocks_per_sm<decltype(t)>(config, n);' 'return (*n = 1, 0);'
mutant no-sync-before-flag emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the fused kernel publishes a block's flag before the whole block stored its tiles" \
  gemm_all_reduce.cu $'    __syncthreads(); // the tile\'s stores and the epilogue\'s reads of smem, before the next\n' ''
mutant epoch-not-advanced emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the fused kernel's launches all use epoch 1" \
  fused_flags.cuh '*own.fused_epoch() = st.epoch;' ''
mutant norm-before-row-complete emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the first block to reduce a tile of a strip normalises it" \
  gemm_all_reduce.cu '+ 1u == static_cast<uint32_t>(L.tiles_n)) {' '+ 1u == 1u) {'
mutant strip-count-relaxed emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak-random "the fused strip counts added relaxed (the completing thread acquires no other block's rows)" \
  gemm_all_reduce.cu '    if (atomic_add_acq_rel_gpu(count, 1u) + 1u' '    if (atomicAdd(count, 1u) + 1u'
mutant strip-rows-without-waiting emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "one-shot normalises its dealt rows without waiting for the strip's flag" \
  gemm_all_reduce.cu 'fused::await_flag(L.peers, L.g, deadline, st, flag, L.g.rank, L.descriptor, true);' '(void)flag;'
mutant strip-flag-weak-store emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the strip's flag stored without release" \
  gemm_all_reduce.cu 'st_release_gpu(own.strip_flag(span.tm), fused::flag_of(st.epoch, L.descriptor));' '*own.strip_flag(span.tm) = fused::flag_of(st.epoch, L.descriptor);'
mutant strip-flag-cta emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the strip's flag (st.release.gpu, u64) released at CTA scope: the other blocks' acquires do not synchronise with it" \
  ptx.cuh $'Order::Release, ::tpfuse_emu::Scope::Gpu);\n#else\n  asm volatile("st.release.gpu.global.u64' $'Order::Release, ::tpfuse_emu::Scope::Cta);\n#else\n  asm volatile("st.release.cta.global.u64'
mutant gather-residual-own-rows emu_counters::the_fused_gemm_all_reduce_moves_what_the_plan_says_block_by_block "the two-shot's gather writes its own slice's rows into the residual again (the same bits: only the counters show it)" \
  gemm_all_reduce.cu 'residual != nullptr && owner != g.rank ? residual + at : nullptr' 'residual != nullptr ? residual + at : nullptr'
mutant strip-flag-every-tile emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the strip's flag published by every thread that counted one of its tiles" \
  gemm_all_reduce.cu $'    if (atomic_add_acq_rel_gpu(count, 1u) + 1u' $'    st_release_gpu(own.strip_flag(span.tm), fused::flag_of(st.epoch, L.descriptor));\n    if (atomic_add_acq_rel_gpu(count, 1u) + 1u'
mutant strip-counts-first-pass-only emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "a block counts toward their strips only as many of its tiles as it has threads" \
  gemm_all_reduce.cu 'for (int j = threadIdx.x; j < mine; j += blockDim.x) {' 'for (int j = threadIdx.x; j < mine; j += mine) {'
mutant strip-one-row-per-block emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "one-shot normalises only the first row dealt to each block" \
  gemm_all_reduce.cu 'for (int row = blockIdx.x; row < L.m; row += gridDim.x) {' 'for (int row = blockIdx.x; row < L.m; row += L.m) {'
mutant strip-rows-on-block-0 emu_counters::the_fused_rmsnorm_moves_what_the_plan_says_row_by_row "one-shot normalises every dealt row on block 0 (the same bits, one block's chain)" \
  gemm_all_reduce.cu 'for (int row = blockIdx.x; row < L.m; row += gridDim.x) {' 'for (int row = blockIdx.x == 0 ? 0 : L.m; row < L.m; ++row) {'
mutant strip-first-row-skipped emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "the block completing a strip leaves its first row" \
  gemm_all_reduce.cu '    if (row < 0) continue;' '    continue;'
mutant fused-failure-unmarked emu_fused_failures::a_missing_rank_is_named_by_the_two_shot_too "the fused kernel's last block leaves a failed launch's outputs" \
  fused_flags.cuh '  return st.last && st.failed;' '  return false;'
mutant fused-no-descriptor-check emu_fused_failures::ranks_that_launch_different_shapes_get_a_mismatch "the fused kernel accepts a tile flag of another launch's shape" \
  fused_flags.cuh '    mismatch = of_launch_otherwise(v, st.epoch, descriptor);' '    mismatch = false;'
mutant started-otherwise-any-epoch emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result "a stalled fused wait takes a late peer's started flag of an earlier launch, of another kind, for a mismatch" \
  fused_flags.cuh 'return (v >> kDescriptorBits) == (epoch & kEpochMask) && (v & kDescriptorMask) != descriptor;' 'return (v & kDescriptorMask) != descriptor;'
mutant epoch-window-half-range emu_fused_failures::a_flag_of_a_long_past_launch_is_not_ready "the fused kernel takes any flag in the half range after this launch as ready" \
  fused_flags.cuh 'return (((v >> kDescriptorBits) - epoch) & kEpochMask) <= 1;' 'return (((v >> kDescriptorBits) - epoch) & kEpochMask) < (kEpochMask >> 1);'
# Packets (cuda/packets.cuh): the one-shot GEMM + all-reduce's exchange at decode sizes.
# Not here: the packet half by parity (one half for every launch survived the back-to-back
# test under pct:1: a consumer's block must fall behind a peer's whole next launch).
mutant packets-tag-unchecked emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16@random:1 "a packet is taken before its tag says it is there" \
  packets.cuh 'return static_cast<uint32_t>(x >> 32) == tag; }' 'return true; }'
mutant packets-not-cleared gpu_gemm_all_reduce::a_graph_of_the_fused_op_replays_100_times "the consumer leaves its packets (a later launch of the same parity finds them)" \
  packets.cuh $'      st_global(at, zero);\n      st_global(at + 1, zero);' ''
mutant packets-half-cleared gpu_gemm_all_reduce::a_graph_of_the_fused_op_replays_100_times "the consumer clears two of a vector's four packets" \
  packets.cuh $'      st_global(at + 1, zero);\n' ''
mutant packets-words-swapped emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "a packet pair's words stored in each other's place" \
  packets.cuh 'first{t | raw.x, t | raw.y}' 'first{t | raw.y, t | raw.x}'
mutant packets-source-0 emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "every rank stores its packets as rank 0's" \
  packets.cuh 'source(Pad{peers.signals[p]}, epoch, rank, part)' 'source(Pad{peers.signals[p]}, epoch, 0, part)'
mutant packets-own-pad-skipped emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "a rank stores its packets into every pad but its own" \
  packets.cuh 'for (int j = 1; j <= world; ++j) {' 'for (int j = 1; j < world; ++j) {'
# The one-shot all-reduce by packets (cuda/all_reduce_packets.cu).
mutant ar-packets-never emu_counters::a_decode_message_launches_only_the_blocks_it_needs "the one-shot all-reduce goes by flags where the group offers packets (the same bits)" \
  all_reduce_packets.cu 'return g.packet_bytes != 0 && bytes % 16 == 0' 'return false && bytes % 16 == 0'
mutant ar-packets-second-segment-unsent emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a row's second RMSNorm segment is never sent (its consumers wait to the deadline)" \
  all_reduce_packets.cu $'    for (int s = 0; s < segments; ++s)\n      if (col(s) < hidden) x.send(' $'    for (int s = 0; s < 1; ++s)\n      if (col(s) < hidden) x.send('
mutant ar-packets-second-segment-unsquared emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "the row's sum of squares leaves out its second segment" \
  all_reduce_packets.cu '      if (s < segments) sum += held_sum_of_squares(' '      if (s < 1) sum += held_sum_of_squares('
mutant ar-packets-gamma-of-segment-0 emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "every segment of a row normalised with the first segment's gamma" \
  all_reduce_packets.cu 'gam[s] = load16(gamma + col(s));' 'gam[s] = load16(gamma + col(0));'
mutant ar-packets-not-normalised emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "a row by packets is stored without its RMSNorm" \
  all_reduce_packets.cu 'normalize_vector(parked[s * kThreads + threadIdx.x], gam[s], rstd)' 'parked[s * kThreads + threadIdx.x]'
mutant ar-packets-no-bias emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue "the all-reduce by packets leaves out the bias" \
  all_reduce_packets.cu 'Epilogue<T>{bias, residual, hidden}' 'Epilogue<T>{nullptr, residual, hidden}'
mutant ar-packets-vectors-of-block-0 emu_all_reduce::all_reduce_f32_every_world_path_and_epilogue "every block of the flat all-reduce by packets takes block 0's vectors" \
  all_reduce_packets.cu 'const Range mine = share(n / kVec, blockIdx.x, gridDim.x);' 'const Range mine = share(n / kVec, 0, gridDim.x);'
mutant ar-packets-failure-unmarked emu_all_reduce::a_missing_rank_times_out_on_every_survivor_within_the_deadline "a failed all-reduce by packets leaves its outputs unmarked" \
  all_reduce_packets.cu $'    mark_failed(out, 0, n);\n    mark_failed(residual, 0, n);' ''
# The weak passes report a strong load that reads a write it is not morally strong with
# (weak_memory.cpp, check_race): on a GPU a packet stored weakly may be seen torn.
mutant packets-stored-weak emu_all_reduce::a_late_rank_within_the_deadline_gives_the_right_result+weak "a vector's packets stored with a weak st.global.v4 (no single-copy atomicity)" \
  packets.cuh $'    st_relaxed_sys_v2(dst, first);\n    st_relaxed_sys_v2(dst + 2, second);' \
  $'    st_global(reinterpret_cast<uint4 *>(dst), uint4{static_cast<uint32_t>(first.lo), static_cast<uint32_t>(first.lo >> 32), static_cast<uint32_t>(first.hi), static_cast<uint32_t>(first.hi >> 32)});\n    st_global(reinterpret_cast<uint4 *>(dst + 2), uint4{static_cast<uint32_t>(second.lo), static_cast<uint32_t>(second.lo >> 32), static_cast<uint32_t>(second.hi), static_cast<uint32_t>(second.hi >> 32)});'
# The started flags order a launch's packets after the clears of launch E - 2 (fused_flags.cuh,
# begin). Without that order the weak passes land the clear last, as a GPU may
# (weak_memory.cpp, land_racing_writes_last); before they did, the mutant survived. (Leaving
# the wait out but keeping the first load's acquire survives: in the back-to-back tests that
# load already reads the flag of E - 1.)
mutant started-acquire-relaxed emu_all_reduce::all_reduces_by_packets_back_to_back_each_get_their_own_inputs+weak "a block reads a peer's started flag relaxed (nothing orders the peer's clears before its packets)" \
  fused_flags.cuh 'if (waiter) seen = ld_acquire_sys(own.started(threadIdx.x));' 'if (waiter) seen = ld_relaxed_sys(own.started(threadIdx.x));'
mutant packets-never emu_counters::fused_gemm_all_reduce_reads_the_peers_once_or_twice_by_slices "the one-shot exchanges by flags where the plan says packets (the same bits)" \
  gemm_all_reduce.cu 'const bool packets = !reduction.scatter && g.packet_bytes != 0 &&' 'const bool packets = false && g.packet_bytes != 0 &&'
mutant started-window-one-ahead emu_gemm_all_reduce::reduce_scatters_and_all_reduces_back_to_back_complete@pct:1 "a block takes only a peer's started flag of the launch before or this one, not the next (a reduce-scatter's peer may be there)" \
  fused_flags.cuh 'return (((v >> kDescriptorBits) - epoch) & kEpochMask) <= 2;' 'return (((v >> kDescriptorBits) - epoch) & kEpochMask) <= 1;'
mutant started-as-rank-0 emu_gemm_all_reduce::launches_in_a_row_each_get_their_own_inputs "block 0 announces every rank's start as rank 0's" \
  fused_flags.cuh 'Pad{peers.signals[threadIdx.x]}.started(g.rank)' 'Pad{peers.signals[threadIdx.x]}.started(0)'
mutant two-shot-gather-from-rank-0 emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "two-shot gathers every row from rank 0's area" \
  gemm_all_reduce.cu 'const int owner = row / slice;' 'const int owner = 0;'
mutant two-shot-slice-flag-early emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "two-shot publishes its slice once the first block counted its tiles" \
  fused_flags.cuh 'st.last = before + add == total;' 'st.last = before == 0;'
mutant two-shot-gather-without-waiting emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "two-shot gathers without waiting for the slice flags" \
  gemm_all_reduce.cu 'fused::await(peers, g, deadline, st, fused::kSliceSlot, threadIdx.x, descriptor, true);' ';'
mutant two-shot-peer-residual-kept emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "two-shot leaves the peers' rows of the residual" \
  gemm_all_reduce.cu 'owner != g.rank ? residual + at : nullptr;' 'false ? residual + at : nullptr;'
mutant scatter-rank-0-rows emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16 "GEMM + reduce-scatter gives every rank rank 0's rows" \
  gemm_all_reduce.cu 'const int row_begin = reduction.scatter ? g.rank * slice : 0;' 'const int row_begin = 0;'
mutant gather-without-waiting emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "all-gather + GEMM reads the peers' rows without waiting for their gather flags" \
  all_gather_gemm.cu '    if (needed != 0) {' '    if (false) {'
mutant gather-push-own-area-only emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "all-gather + GEMM pushes a rank's rows into its own area only" \
  all_gather_gemm.cu 'for (int j = 1; j <= g.world; ++j) {' 'for (int j = g.world; j <= g.world; ++j) {'
mutant gather-push-at-rank-0-rows emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "all-gather + GEMM pushes every rank's rows to rank 0's rows" \
  all_gather_gemm.cu 'static_cast<size_t>(g.rank) * part_vectors * 16;' 'static_cast<size_t>(0) * part_vectors * 16;'
mutant gather-no-sync-before-count emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm+weak "all-gather + GEMM counts a part before the whole block pushed it" \
  all_gather_gemm.cu $'    __syncthreads(); // every thread\'s stores, before the count\n' ''
mutant gather-count-relaxed emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm+weak "a counted unit's system-scope adds are relaxed (no release, no acquire): all-gather + GEMM's count" \
  fused_flags.cuh 'if constexpr (kSystem) before = atomic_add_acq_rel_sys(count, add);' 'if constexpr (kSystem) before = atomicAdd(count, add);'
mutant slice-count-relaxed emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the two-shot's slice count added relaxed, a counted unit's gpu-scope add (the slice flag covers no other block's rows)" \
  fused_flags.cuh 'else before = atomic_add_acq_rel_gpu(count, add);' 'else before = atomicAdd(count, add);'
mutant gather-flag-by-every-block emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm@random:1 "every block of a counted unit publishes its flag, not the one that completes the count" \
  fused_flags.cuh 'if (st.last) publish(peers, g, slot, flag_of(st.epoch, descriptor));' 'if (true) publish(peers, g, slot, flag_of(st.epoch, descriptor));'
mutant gather-flag-before-count-read emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm@random:1+weak-random "a counted unit's flag threads read thread 0's count decision without the barrier" \
  fused_flags.cuh $'  __syncthreads(); // thread 0\'s acquire, before the releases of the flag\n' ''
mutant gather-empty-share-uncounted emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "a block of all-gather + GEMM with no share of the input does not count its part (the flag never comes)" \
  all_gather_gemm.cu 'gather_count(), 1u, gridDim.x,' 'gather_count(), begin < end ? 1u : 0u, gridDim.x,'
mutant gather-count-never-reset emu_gemm_all_reduce::all_gather_gemm_launches_in_a_row_each_get_their_own_inputs "a counted unit's count never goes back to 0 (the next launch never completes it)" \
  fused_flags.cuh 'if (st.last) *count = 0; // no other block' 'if (false) *count = 0; // no other block'
mutant descriptor-size-not-type-gather emu_fused_failures::all_gather_gemm_against_another_launch_is_a_mismatch "all-gather + GEMM's descriptor names the element size, not the type (f16 passes for bf16)" \
  all_gather_gemm.cu 'launch_descriptor({kKindAllGatherGemm, Elem<T>::kDtype,' 'launch_descriptor({kKindAllGatherGemm, sizeof(T),'
mutant descriptor-size-not-type-fused emu_fused_failures::ranks_that_launch_different_shapes_get_a_mismatch "GEMM + all-reduce's descriptor names the element size, not the type" \
  gemm_all_reduce.cu 'launch_descriptor({reduction.kind, Elem<T>::kDtype,' 'launch_descriptor({reduction.kind, sizeof(T),'
mutant descriptor-size-not-type-all-reduce emu_all_reduce::ranks_that_launch_different_sizes_or_grids_get_a_mismatch_not_wrong_data "the all-reduce's descriptor names the element size, not the type" \
  all_reduce.cu 'static_cast<uint64_t>(algo), Elem<T>::kDtype,' 'static_cast<uint64_t>(algo), sizeof(T),'
mutant gather-split-first-part-only emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "all-gather + GEMM's parallel split computes only the first part of each tile" \
  all_gather_gemm.cu 'const int units = split_parallel ? tiles * parts : tiles;' 'const int units = tiles;'
mutant gather-split-word-per-tile-row emu_gemm_all_reduce::all_gather_gemm_equals_all_gather_then_gemm "all-gather + GEMM's parallel split counts the parts of a tile row's tiles in one word" \
  all_gather_gemm.cu 'tile, tm, tn, unit / tiles, parts' 'tm, tm, tn, unit / tiles, parts'
# Co-residency (issue 21, defect 2): launched as plain grids, the blocks that fit start and wait
# for blocks that cannot; only the residency model and another kernel holding SMs show it.
mutant fused-launch-not-cooperative emu_fused_failures::launches_wait_for_the_sms_another_kernel_holds "the fused kernels are plain launches (partly resident grids)" \
  backend.cuh '__PRETTY_FUNCTION__, grid, block, smem, stream, true)' '__PRETTY_FUNCTION__, grid, block, smem, stream, false)'
mutant one-shot-rmsnorm-not-cooperative emu_fused_failures::launches_wait_for_the_sms_another_kernel_holds "the one-shot RMSNorm, whose blocks meet, is a plain launch" \
  all_reduce.cu 'TPFUSE_LAUNCH_COOPERATIVE(one_shot_kernel<T>' 'TPFUSE_LAUNCH(one_shot_kernel<T>'
# Right results, wasted work: only the counters see these.
mutant gather-split-never-parallel emu_counters::all_gather_gemm_moves_each_rows_part_across_once "all-gather + GEMM runs a tile's parts in its block where the plan runs them in parallel" \
  all_gather_gemm.cu 'const bool split_parallel = fused::split_in_parallel<Cfg>(' 'const bool split_parallel = false && fused::split_in_parallel<Cfg>('
mutant gather-tiles-read-a-peer emu_counters::all_gather_gemm_moves_each_rows_part_across_once "all-gather + GEMM's tiles read the gathered rows from the next rank's area" \
  all_gather_gemm.cu 'DenseRows<T> rows{static_cast<const T *>(peers.data[g.rank]) + exchange, k};' \
  'DenseRows<T> rows{static_cast<const T *>(peers.data[(g.rank + 1) % g.world]) + exchange, k};'
mutant double-peer-read emu_counters::all_gather_and_reduce_scatter_read_each_peer_once "the reduction loads every peer's vector twice" \
  reduce.cuh 'raw[p] = ld_global_cg(reinterpret_cast<const uint4 *>(rank_p));' \
  $'raw[p] = ld_global_cg(reinterpret_cast<const uint4 *>(rank_p));\n      raw[p] = ld_global_cg(reinterpret_cast<const uint4 *>(rank_p));'
mutant residual-over-the-link emu_counters::two_shot_reads_twice_the_peers_share "two-shot reads the peers' results again for the residual" \
  all_reduce.cu 'if (residual != nullptr) st_global(reinterpret_cast<uint4 *>(residual + at), v[j]);' \
  'if (residual != nullptr) st_global(reinterpret_cast<uint4 *>(residual + at), ld_global_cg(reinterpret_cast<const uint4 *>(static_cast<const T *>(peers.data[first + j]) + result_offset + at)));'
mutant no-swizzle emu_counters::gemm_reads_each_tile_once_without_bank_conflicts "the GEMM's shared memory unswizzled (bank conflicts, same results)" \
  gemm_sm80.cuh 'return kChunks == 8 ? (row & 7) : ((row >> 1) & 3);' 'return 0;'
mutant extra-barrier emu_counters::a_decode_message_launches_only_the_blocks_it_needs "one-shot passes a second barrier" \
  all_reduce.cu $'    if (!normalized) return give_up(barrier, out, residual, r);\n  }\n  barrier.finish();' \
  $'    if (!normalized) return give_up(barrier, out, residual, r);\n  }\n  if (!barrier.arrive_and_wait()) return give_up(barrier, out, residual, r);\n  barrier.finish();'
mutant embedding-positive-zero-mask emu_vocab_embedding::lookup_copies_the_rank_s_rows_and_masks_the_rest "another rank's tokens written as +0.0 (the sum loses -0.0)" \
  vocab_embedding.cu 'id < vocab ? uint16_t{0x8000} : nan_bits' 'id < vocab ? uint16_t{0x0000} : nan_bits'
mutant embedding-padding-row-looked-up emu_vocab_embedding::lookup_copies_the_rank_s_rows_and_masks_the_rest "an id past the vocabulary reads the rank's padding row" \
  vocab_embedding.cu 'if (id < vocab && offset < rows) {' 'if (offset < rows) {'
# Orders and scopes (issue 22): each weakens one synchronisation of the PTX memory model;
# only the weak-memory mode (+weak) sees stale data or reports the scope.
mutant barrier-flag-relaxed emu_all_reduce::all_gather_every_world+weak "the cross-rank barrier's flag stored relaxed, not release" \
  barrier.cuh '      st_release_sys(theirs.flag(blockIdx.x, g_.rank), value);' '      st_relaxed_sys(theirs.flag(blockIdx.x, g_.rank), value);'
mutant barrier-acquire-relaxed emu_all_reduce::all_gather_every_world+weak "the cross-rank barrier's flag (and the finished launches' count) read relaxed, not acquire" \
  barrier.cuh '  (void)ld_acquire_sys(flag); // the acquire: orders what follows' '  (void)ld_relaxed_sys(flag); // the acquire: orders what follows'
mutant barrier-no-sync-after-acquire emu_all_reduce::all_gather_every_world+weak "the block reads peers' data without the __syncthreads after the acquiring threads" \
  barrier.cuh $'    __syncthreads();\n    const bool passed = *failures_ == 0;' $'    const bool passed = *failures_ == 0;'
mutant release-sys-to-gpu emu_all_reduce::all_gather_every_world+weak "st.release.sys made st.release.gpu (peers on other GPUs)" \
  ptx.cuh $'Order::Release, ::tpfuse_emu::Scope::Sys);\n#else\n  asm volatile("st.release.sys.global.u32' $'Order::Release, ::tpfuse_emu::Scope::Gpu);\n#else\n  asm volatile("st.release.gpu.global.u32'
mutant acquire-sys-to-gpu emu_all_reduce::all_gather_every_world+weak "ld.acquire.sys made ld.acquire.gpu (peers on other GPUs)" \
  ptx.cuh $'Order::Acquire, ::tpfuse_emu::Scope::Sys);\n#else\n  uint32_t v;\n  asm volatile("ld.acquire.sys.global.u32' $'Order::Acquire, ::tpfuse_emu::Scope::Gpu);\n#else\n  uint32_t v;\n  asm volatile("ld.acquire.gpu.global.u32'
mutant meet-generation-relaxed emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue+weak "the rank's blocks meet on a generation stored relaxed, not release" \
  barrier.cuh '        st_release_gpu(generation, seen + 1u);' '        st_relaxed_sys(generation, seen + 1u);'
mutant meet-generation-cta emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue+weak "the rank's blocks meet on a count and generation (st.release.gpu, u32) released at CTA scope (the generation's acquire catches it)" \
  ptx.cuh $'Order::Release, ::tpfuse_emu::Scope::Gpu);\n#else\n  asm volatile("st.release.gpu.global.u32' $'Order::Release, ::tpfuse_emu::Scope::Cta);\n#else\n  asm volatile("st.release.cta.global.u32'
mutant counter-acq-rel-relaxed emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue+weak "atom.acq_rel.gpu made atom.relaxed.gpu (the blocks' meeting and the fused counters)" \
  ptx.cuh $'::tpfuse_emu::Order::AcqRel, ::tpfuse_emu::Scope::Gpu);\n#else\n  uint32_t old;\n  asm volatile("atom.acq_rel.gpu' $'::tpfuse_emu::Order::Relaxed, ::tpfuse_emu::Scope::Gpu);\n#else\n  uint32_t old;\n  asm volatile("atom.relaxed.gpu'
mutant counter-gpu-to-cta emu_all_reduce::all_reduce_bf16_every_world_path_and_epilogue+weak "atom.acq_rel.gpu made atom.acq_rel.cta (blocks of one rank)" \
  ptx.cuh $'::tpfuse_emu::Order::AcqRel, ::tpfuse_emu::Scope::Gpu);\n#else\n  uint32_t old;\n  asm volatile("atom.acq_rel.gpu' $'::tpfuse_emu::Order::AcqRel, ::tpfuse_emu::Scope::Cta);\n#else\n  uint32_t old;\n  asm volatile("atom.acq_rel.cta'
mutant fused-flag-release-relaxed emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the fused kernels' u64 flags stored relaxed, not release" \
  ptx.cuh $'Order::Release, ::tpfuse_emu::Scope::Sys);\n#else\n  asm volatile("st.release.sys.global.u64' $'Order::Relaxed, ::tpfuse_emu::Scope::Sys);\n#else\n  asm volatile("st.relaxed.sys.global.u64'
mutant fused-flag-acquire-relaxed emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the fused kernels' flags read relaxed, not acquire" \
  fused_flags.cuh '    const uint64_t v = ld_acquire_sys(flag); // the acquire' '    const uint64_t v = ld_relaxed_sys(flag); // the acquire'
mutant fused-no-sync-after-acquire emu_gemm_all_reduce::fused_equals_gemm_then_all_reduce_bf16+weak "the fused block reads a unit without the __syncthreads after the acquiring threads" \
  fused_flags.cuh $'  __syncthreads();\n  const bool ok = st.failed == 0;' $'  const bool ok = st.failed == 0;'
# The emulator's own twins: a wrong emulation must fail its own tests.
mutant emu-cp-async-lands-early emu_ops::cp_async_lands_whole_groups_at_the_wait_that_completes_them "the emulator lands every cp.async group at any wait" \
  emu/device_ops.cpp 'while (f.committed.size() > static_cast<size_t>(pending)) {' 'while (!f.committed.empty()) {'
mutant emu-ldmatrix-banks emu_counters::gemm_reads_each_tile_once_without_bank_conflicts "the emulator counts a phase's bank conflicts by 4-byte bank" \
  emu/warp.cpp '++rows_in_quad[(in[8 * i + r].addr >> 4) & 7]' '++rows_in_quad[(in[8 * i + r].addr >> 2) & 7]'
mutant emu-mma-last-k-dropped emu_gemm::gemm_bf16_every_config_shape_and_epilogue "the emulator's mma.sync leaves out the 16th product of each sum" \
  emu/warp.cpp 'for (int k = 0; k < 16; ++k) {' 'for (int k = 0; k < 15; ++k) {'
mutant emu-registers-free emu_all_reduce::registers_hold_an_sm_and_a_cooperative_grid_past_them_is_refused "the emulator counts no registers toward an SM's room" \
  emu/residency.cpp 'f.warp_registers = (registers * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;' 'f.warp_registers = 0;'
mutant emu-cooperative-in-part emu_fused_failures::launches_wait_for_the_sms_another_kernel_holds "the emulator starts a cooperative grid's blocks as they fit" \
  emu/scheduler.cpp 'if (l->cooperative && l->next_block == 0 && !all_blocks_fit(dev, *l)) continue;' ''
mutant emu-weak-acquire-ignored emu_litmus::synchronised_shapes_never_show_the_forbidden_outcome "the weak mode's acquire does not join the release's view" \
  emu/weak_memory.cpp 'if (x.release) join(acquires(o) ? t.acquired : t.observed, *x.release);' 'if (x.release) join(t.observed, *x.release);'
mutant emu-weak-bar-sync-ignored emu_all_reduce::all_gather_every_world+weak "the weak mode's bar.sync shares no view among the block's threads" \
  emu/scheduler.cpp '  if (weak_memory) memory_barrier(b);' ''
mutant emu-weak-boundary-global emu_litmus::a_kernel_boundary_orders_only_what_cuda_orders "a launch starts seeing every stream's completed launches (the emulator's rule before 2026-11-28)" \
  emu/weak_memory.cpp $'  l.start = s.known;\n' $'  l.start = s.known;\n  for (auto &other : device().streams) l.start.join(other->known);\n'
mutant emu-weak-writes-in-order emu_litmus::a_kernel_boundary_orders_only_what_cuda_orders "racing writes land in the order the emulator runs them" \
  emu/weak_memory.cpp '  uint8_t open = bytes;  // the bytes no seen version below has written yet' '  uint8_t open = 0;'
mutant emu-weak-race-stops-at-other-bytes emu_litmus::a_kernel_boundary_orders_only_what_cuda_orders "a seen write of other bytes of the word ends the search for racing writes" \
  emu/weak_memory.cpp '    if ((x.bytes & open) == 0) continue;' '    if ((x.bytes & open) == 0) break;'
# (In common.cuh, not emu/device.hpp: the mutants rebuild the units that include an edited file
# from cuda/, and device.hpp is reached only through the shims of emu/include.)
mutant emu-misaligned-accepted emu_ops::a_misaligned_16_byte_global_access_fails_the_launch "the emulator accepts a load off its size's alignment" \
  common.cuh $'  ::tpfuse_emu::check_aligned(p, sizeof(T));\n  ::tpfuse_emu::count_load(p, sizeof(T));\n  return ::tpfuse_emu::load_global(p);' $'  ::tpfuse_emu::count_load(p, sizeof(T));\n  return ::tpfuse_emu::load_global(p);'
mutant emu-shared-overrun-unchecked emu_ops::a_write_past_shared_memory_fails_the_launch "the emulator lets a block write past its shared memory" \
  emu/scheduler.cpp 'if (!overrun.empty() && !b->launch->failed) {' 'if (false) {'
mutant emu-arch-ignored emu_ops::the_architecture_sets_the_sms_limits "the emulator's SMs have an H100's limits whatever the architecture" \
  emu/residency.cpp '    if (l.arch == arch) return l;' '    if (false) return l;'
mutant kernel-list-no-epilogues emu_loading::a_first_use_waits_for_the_device_and_groups_load_every_kernel_first "load_kernels leaves the epilogue kernels unloaded" \
  kernel_list.cu '  tpfuse::epilogue_kernels(list);' ''
mutant kernel-list-no-bias-residual-bf16 emu_loading::a_first_use_waits_for_the_device_and_groups_load_every_kernel_first "load_kernels leaves bias_residual<bf16> unloaded (the H200's unfused hang)" \
  epilogue.cu '  list.add(bias_residual_kernel<__nv_bfloat16>);' ''
mutant emu-lazy-load-no-wait emu_loading::a_first_use_waits_for_the_device_and_groups_load_every_kernel_first "the emulator's first use of a kernel waits for nothing" \
  emu/loading.cpp '  if (!targets.empty()) run_until_completed(lk, targets);' ''
mutant phases-no-tile-count gpu_gemm_all_reduce::fused_reduce_scatter_equals_gemm_then_reduce_scatter "the phase records count no tiles" \
  phase_clock.cuh '    if (threadIdx.x == 0) ++tiles;' ''
mutant phases-first-block-only gpu_gemm_all_reduce::fused_reduce_scatter_equals_gemm_then_reduce_scatter "only block 0 stores its phase record" \
  phase_clock.cuh 'if (threadIdx.x != 0 || blockIdx.x >= TPFUSE_MAX_PHASE_BLOCKS) return;' 'if (threadIdx.x != 0 || blockIdx.x >= 1) return;'
mutant phases-marks-from-start gpu_gemm_all_reduce::fused_reduce_scatter_equals_gemm_then_reduce_scatter "every phase interval is counted from the block's start" \
  phase_clock.cuh '    last = now;' ''
mutant phases-wait-as-reduce emu_counters::a_late_rank_shows_in_the_others_wait_phase "the fused GEMM + all-reduce counts its waits as reduction" \
  gemm_all_reduce.cu '  st.clock.mark(fused::kPhaseWait);' '  st.clock.mark(fused::kPhaseReduce);'
mutant emu-mma-b-rows emu_ops::mma_m16n8k16_bf16_matches_the_isa_fragment_tables "the emulated mma reads b1 as k rows 2t..2t+1" \
  emu/warp.cpp 'B[2 * t + 8 * r][g] =' 'B[2 * t + 0 * r][g] ='

wait
for name in "${names[@]}"; do report "$name"; done
echo
echo "mutants: $caught of $total caught in $(($(date +%s) - started)) s ($jobs_max at a time)"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'mutants: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
