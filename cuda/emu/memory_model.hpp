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
//   fences of one scope instance); kernel completion: a view holds a completion frontier (of
//   each stream, how many of its kernel launches completed before the holder: Frontier), and a
//   finished launch's writes are seen by the views whose frontier holds it. A launch starts
//   with what CUDA orders before it: its stream's earlier work (and, through the kernel
//   boundary, everything that work had seen), the events its stream waited for, and what the
//   host had synchronised with when it enqueued the launch; a release carries the frontier on.
//   A peer's launch that merely completed earlier is not ordered before it.
#pragma once

#include <algorithm>
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

// A completion frontier: of each stream (its slot in Device::streams), how many of its kernel
// launches (the first n it started: a stream's launches complete in order) are ordered before
// the holder. Sorted by slot; an absent slot is 0.
struct Frontier {
  std::vector<std::pair<uint32_t, uint64_t>> done;

  // Where slot's entry is, or would go.
  std::vector<std::pair<uint32_t, uint64_t>>::const_iterator at(uint32_t slot) const {
    return std::lower_bound(done.begin(), done.end(), std::make_pair(slot, uint64_t{0}));
  }
  uint64_t of(uint32_t slot) const {
    auto it = at(slot);
    return it != done.end() && it->first == slot ? it->second : 0;
  }
  void raise(uint32_t slot, uint64_t n) {
    auto it = done.begin() + (at(slot) - done.cbegin());
    if (it != done.end() && it->first == slot) {
      it->second = std::max(it->second, n);
    } else {
      done.insert(it, {slot, n});
    }
  }
  // this := this ⊔ o (one pass over both).
  void join(const Frontier &o) {
    if (o.done.empty()) return;
    if (done.empty()) {
      done = o.done;
      return;
    }
    if (o.done.size() <= done.size() &&
        std::all_of(o.done.begin(), o.done.end(), [&](const auto &e) { return of(e.first) >= e.second; }))
      return;  // holds it already: no allocation
    std::vector<std::pair<uint32_t, uint64_t>> merged;
    merged.reserve(done.size() + o.done.size());
    auto a = done.cbegin();
    auto b = o.done.cbegin();
    while (a != done.cend() && b != o.done.cend()) {
      if (a->first < b->first) {
        merged.push_back(*a++);
      } else if (b->first < a->first) {
        merged.push_back(*b++);
      } else {
        merged.emplace_back(a->first, std::max(a->second, b->second));
        ++a, ++b;
      }
    }
    merged.insert(merged.end(), a, done.cend());
    merged.insert(merged.end(), b, o.done.cend());
    done.swap(merged);
  }
  // this := this ⊓ o: what both hold.
  void meet(const Frontier &o) {
    std::vector<std::pair<uint32_t, uint64_t>> kept;
    for (const auto &e : done) {
      const uint64_t n = std::min(e.second, o.of(e.first));
      if (n > 0) kept.emplace_back(e.first, n);
    }
    done.swap(kept);
  }
};

struct View {
  Frontier frontier;              // the launches seen complete (kernel boundaries passed)
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
