// schedules.cpp: the order in which the device thread runs the resident blocks' threads
// (TPFUSE_EMU_SCHEDULE). A schedule only orders; what a thread may do at each step (its
// scheduling points) is device_ops.cpp's and warp.cpp's.
//
//   forward / reverse  every resident block gets one turn a pass, in residency order (or its
//                      reverse), threads ascending (descending);
//   random             a fresh permutation of every warp of every resident block each pass;
//   pct                priorities with change points (probabilistic concurrency testing): the
//                      highest-priority block that can make progress runs, alone, until it
//                      cannot; every other block stands still meanwhile, at whatever point it
//                      reached (even before its first instruction). So one block (of one rank)
//                      is held back while the others run on as far as they can, and a rank can
//                      run whole launches ahead of a peer that is still in the previous one.
#include "scheduler.hpp"

#include <algorithm>

namespace tpfuse_emu {
namespace {

// splitmix64 of a, b and c: the pct schedule's draws, each a function of what it is for.
uint64_t mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull ^ (c + 0x632be59bd9b4e5bbull) * 0x94d049bb133111ebull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Runs the runnable fibers of one block round-robin (threads ascending, or descending in the
// reverse schedule) until a round makes no progress (its fibers only polled unchanged flags)
// or kMaxRounds rounds: a block runs ahead as far as it can, as one SM may run far ahead of
// another. Returns the number of resumes.
constexpr int kMaxRounds = 256;
int run_block(Device &dev, Block &b, std::vector<Fiber *> &order) {
  int resumed = 0;
  const bool progress_before = dev.progress;
  bool any_progress = false;
  for (int round = 0; round < kMaxRounds && !b.launch->failed; ++round) {
    if (b.dirty) {
      b.runnable.clear();
      for (auto &f : b.fibers)
        if (f->state == FiberState::Ready) b.runnable.push_back(f.get());
      b.dirty = false;
    }
    if (b.runnable.empty()) break;
    order.assign(b.runnable.begin(), b.runnable.end());
    if (dev.config.schedule == TPFUSE_EMU_SCHEDULE_REVERSE) std::reverse(order.begin(), order.end());
    dev.progress = false;
    for (Fiber *f : order) {
      if (b.launch->failed) break;
      if (f->state != FiberState::Ready) continue;
      resume(dev, f);
      ++resumed;
    }
    const bool round_progress = dev.progress;
    any_progress = any_progress || round_progress;
    if (!round_progress) break;
  }
  dev.progress = progress_before || any_progress;
  return resumed;
}

// forward / reverse: every resident block gets one turn (run_block), in residency order or
// its reverse. When a turn finishes a block, its SM starts the next waiting block at once
// and that block takes its turn right after, before the rest of the pass: a rank that
// finishes a kernel early runs ahead into its next one, as on a GPU.
int run_block_turns(Device &dev, std::vector<Fiber *> &scratch) {
  std::vector<Block *> order;
  for (auto &b : dev.resident)
    if (!b->gone) order.push_back(b.get());
  if (dev.config.schedule == TPFUSE_EMU_SCHEDULE_REVERSE) std::reverse(order.begin(), order.end());
  int ran = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    Block *b = order[i];
    if (b->gone) continue;
    ran += run_block(dev, *b, scratch);
    if (b->live > 0 && !b->launch->failed) continue;
    const std::vector<Block *> started = start_freed_slots(dev);
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(i + 1), started.begin(), started.end());
  }
  return ran;
}

// random: one permutation of every warp of every resident block; when its turn comes a warp
// runs its lanes round-robin (in a random order) for 1, 2, 4, 8 or 16 rounds, fewer if a
// round makes no progress. Warps of different blocks interleave between any two scheduling
// points, and some warps run many steps ahead of others: a block that publishes before all
// its threads are done, or a stage overwritten while a slower warp still reads it, shows.
int run_interleaved(Device &dev, std::vector<Fiber *> &lanes) {
  struct WarpTurn {
    Block *block;
    size_t first;
  };
  std::vector<WarpTurn> order;
  int ran = 0;
  const bool progress_before = dev.progress;
  bool any_progress = false;
  for (auto &b : dev.resident) {
    if (b->gone) continue;
    for (size_t w = 0; w < b->fibers.size(); w += 32) order.push_back(WarpTurn{b.get(), w});
    // A thread at a long load sits out this pass: it counts as run (its load is under way),
    // so a pass where every thread waits for a load is not a deadlock.
    for (size_t t = 0; dev.at_long_loads > 0 && t < b->fibers.size(); ++t) {
      Fiber &f = *b->fibers[t];
      if (f.load_passes == 0) continue;
      if (--f.load_passes == 0) --dev.at_long_loads;
      ++ran;
      any_progress = true;
    }
  }
  std::shuffle(order.begin(), order.end(), dev.rng);
  for (const WarpTurn &turn : order) {
    Block &b = *turn.block;
    if (b.gone) continue;
    const int rounds = 1 << (dev.rng() % 5);
    for (int r = 0; r < rounds && !b.launch->failed; ++r) {
      lanes.clear();
      for (size_t t = turn.first; t < std::min(turn.first + 32, b.fibers.size()); ++t)
        if (b.fibers[t]->state == FiberState::Ready && b.fibers[t]->load_passes == 0) lanes.push_back(b.fibers[t].get());
      if (lanes.empty()) break;
      std::shuffle(lanes.begin(), lanes.end(), dev.rng);
      dev.progress = false;
      for (Fiber *f : lanes) {
        if (b.launch->failed || f->state != FiberState::Ready) continue;
        resume(dev, f);
        ++ran;
      }
      any_progress = any_progress || dev.progress;
      if (!dev.progress) break;
    }
    if (b.live == 0 || b.launch->failed) start_freed_slots(dev);
  }
  dev.progress = progress_before || any_progress;
  return ran;
}

// pct: a step runs the first block, in priority order, that makes progress (run_block: until
// it cannot go on), then the pass ends, so the next step starts again from the top: a block
// runs only while every block above it is stuck. The step's block is demoted below every
// block with 1 chance in kChangeOdds (a change point), so that no order is kept for ever.
constexpr uint64_t kChangeOdds = 64;
int run_prioritized(Device &dev, std::vector<Fiber *> &scratch) {
  std::vector<Block *> order;
  for (auto &b : dev.resident)
    if (!b->gone) order.push_back(b.get());
  std::sort(order.begin(), order.end(), [](const Block *a, const Block *b) {
    return a->demoted != b->demoted ? a->demoted < b->demoted : a->priority > b->priority;
  });
  const bool progress_before = dev.progress;
  int ran = 0;
  for (Block *b : order) {
    if (b->gone) continue;
    dev.progress = false;
    ran += run_block(dev, *b, scratch);
    const bool ended = b->live == 0 || b->launch->failed;
    if (!dev.progress && !ended) continue;
    if (mix(dev.config.seed, 0x7063745f73746570ull, dev.pct_steps++) % kChangeOdds == 0) {
      b->demoted = ++dev.demotions;
    }
    if (ended) start_freed_slots(dev);
    dev.progress = true;
    return ran;
  }
  dev.progress = progress_before;
  return ran;
}

} // namespace

// pct: a random priority; half of the launches keep their blocks' priorities in one band, so
// that the rank (its stream) runs ahead of or behind its peers as a whole, the others spread
// theirs among every block's. Drawn from the seed, the stream (its creation order), the
// launch's place on its stream and the block's index, not from one sequence of draws: the
// same seed gives the same priorities however the host's enqueues interleave with the device.
void place_in_schedule(Device &dev, Block &b) {
  if (dev.config.schedule != TPFUSE_EMU_SCHEDULE_PCT) return;
  const Launch &l = *b.launch;
  uint64_t stream = 0;
  while (stream < dev.streams.size() && dev.streams[stream].get() != l.stream) ++stream;
  const uint64_t launch = mix(dev.config.seed, stream, l.ordinal);
  const uint64_t block = mix(launch, 0x626c6f636bull, b.idx.x);
  b.priority = launch % 2 == 0 ? (launch | 1) << 32 | block >> 32 : block;
}
// random: a kernel's global load (cuda/common.cuh's helpers, a packet's, cp.async's source) is
// a scheduling point one time in kPreemptLoads, drawn from the seed, where the thread then
// sits out 1 to kParkPasses passes (a load that takes long). A warp's run of plain loads is
// cut at a random place, and other warps, of its block, of other blocks and of other ranks'
// launches, run on meanwhile, as they do while a GPU warp waits for its load. Without it a
// loop of plain loads ran as one step: a block that counted itself finished (an atomic)
// before its other warps had read the peers' staging, a missing __syncthreads that lets a
// peer restage under those reads, passed every seed an outside review tried.
constexpr uint64_t kPreemptLoads = 32;
constexpr uint64_t kParkPasses = 8;
void preempt_at_load() {
  Device &dev = device();
  if (dev.config.schedule != TPFUSE_EMU_SCHEDULE_RANDOM || dev.rng() % kPreemptLoads != 0) return;
  current_fiber().load_passes = 1 + static_cast<int>(dev.rng() % kParkPasses);
  ++dev.at_long_loads;
  dev.progress = true;
  yield_to_scheduler();
}

int run_pass(Device &dev, std::vector<Fiber *> &scratch) {
  int ran;
  switch (dev.config.schedule) {
  case TPFUSE_EMU_SCHEDULE_RANDOM: ran = run_interleaved(dev, scratch); break;
  case TPFUSE_EMU_SCHEDULE_PCT: ran = run_prioritized(dev, scratch); break;
  default: ran = run_block_turns(dev, scratch); break;
  }
  sweep(dev);
  return ran;
}

} // namespace tpfuse_emu
