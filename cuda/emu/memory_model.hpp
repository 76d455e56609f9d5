// memory_model.hpp: the state of the weak-memory mode (TPFUSE_EMU_MEMORY=weak|weak-random,
// weak_memory.cpp) that threads and blocks carry: what each has seen of the others' writes.
//
// The model is the PTX ISA's memory consistency model as tpfuse's kernels use it, made
// operational with views (docs/emulator.md, "Weak memory"):
// - Every write to global memory by a kernel is a version of its 4-byte word, stamped with its
//   writer (launch, block, thread), the block's bar.sync count then (epoch) and the thread's
//   write sequence.
// - A thread may read, of a word, the newest version it has seen (its view) or a newer one;
//   `weak` reads the oldest it may (the newest it has seen), `weak-random` any it may.
// - A view grows by: program order (a thread sees its own writes); bar.sync (the block's
//   threads see each other's writes before it); an acquire pattern that reads what a release
//   pattern wrote, both morally strong (scopes that include each other): the reader's view
//   joins the view the release carried; a strong read of a morally strong write (causality
//   order: the write comes before everything after the read); fence.sc (an order over the
//   fences of one scope instance); kernel completion: a view holds a completion frontier, the
//   count of launch completions it has seen (a launch starts with the count then, a release
//   carries it), and a finished launch's writes are seen by the views whose frontier reaches
//   its completion (a launch on its stream after it, or a thread that synchronised with one).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace tpfuse_emu {

// A thread's writes up to `seq` (its write sequence).
struct ThreadMark {
  uint32_t thread;
  uint32_t seq;
};

// What a view holds of one block (by its residency serial): every write made before its bar.sync
// number `epoch_floor`, and each listed thread's writes up to its mark.
struct BlockMark {
  uint64_t block;
  uint64_t launch;  // the block's launch: once it completed, the mark is moot
  uint32_t epoch_floor = 0;
  std::vector<ThreadMark> threads;  // sorted by thread
};

// A version a strong read observed: the word's versions up to `number` (coherence order).
struct Point {
  uintptr_t word;
  uint64_t number;
};

struct View {
  uint64_t frontier = 0;          // launch completions seen: every launch that completed by then
  std::vector<BlockMark> blocks;  // sorted by block
  std::vector<Point> points;      // sorted by word
};

// A thread's part (Fiber::memory).
struct ThreadMemory {
  uint32_t seq = 0;                           // its write sequence
  View acquired;                              // what it has seen beyond its block's view
  View observed;                              // release views its relaxed strong reads met (for fence.acquire)
  std::shared_ptr<const View> fenced;         // the view of its last release fence (for a relaxed store after it)
  std::unordered_map<uintptr_t, uint64_t> read_floor;  // weak-random: the newest version read per word
};

// A block's part (Block::memory): the view its threads share since its last bar.sync.
struct BlockMemory {
  View view;
  uint32_t epoch = 0;  // bar.sync count
  int gpu = 0;         // the scope .gpu: the stream's rank tag, else its device
};

} // namespace tpfuse_emu
