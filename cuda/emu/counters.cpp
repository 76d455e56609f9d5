// counters.cpp: what the kernels move and how often they synchronise, per launch and per
// block (tpfuse_emu.h, "Counters"; docs/emulator.md). Device code reports its accesses
// through count_load / count_store (the helpers of cuda/common.cuh and cp.async),
// count_barrier (cuda/barrier.cuh) and ldmatrix (warp.cpp); a block adds them to its own
// counters, copied into its launch's records when it finishes.
//
// Rank tags: virtual ranks share one device, so the Rust side tags each rank's symmetric
// memory and stream. A launch takes the tag table in force when it starts (an immutable
// snapshot, replaced under mu by every change) so the device thread reads it without a lock.
#include <malloc.h>

#include <algorithm>
#include <cstring>

#include "scheduler.hpp"

namespace tpfuse_emu {
namespace {

// The running block, when its launch is being counted.
Block *counted_block() {
  Block *b = current_fiber().block;
  return b->launch->counting ? b : nullptr;
}

// The rank whose memory holds `p`; -1 when untagged.
int owner_of(const Tags &tags, const void *p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const Tag &t : tags)
    if (a >= t.begin && a < t.end) return t.rank;
  return -1;
}

// Whether `p` is another rank's memory than the running launch's (both tags known).
bool is_peer(const Block &b, const void *p) {
  const int owner = owner_of(*b.launch->tags, p);
  return owner >= 0 && b.launch->rank >= 0 && owner != b.launch->rank;
}

// Replaces the tag table with `edit` applied to a copy (mu held).
template <typename F> void edit_tags(Device &dev, F edit) {
  auto next = std::make_shared<Tags>(*dev.tags);
  edit(*next);
  dev.tags = std::move(next);
}

void drop_tags(Tags &tags, uintptr_t begin, uintptr_t end) {
  tags.erase(std::remove_if(tags.begin(), tags.end(), [&](const Tag &t) { return t.begin < end && begin < t.end; }),
             tags.end());
}

} // namespace

void count_load(const void *p, size_t bytes) {
  preempt_at_load();
  Block *b = counted_block();
  if (b == nullptr) return;
  b->counters.global_read_bytes += bytes;
  if (is_peer(*b, p)) b->counters.peer_read_bytes += bytes;
}

void count_store(const void *p, size_t bytes) {
  Block *b = counted_block();
  if (b == nullptr) return;
  b->counters.global_write_bytes += bytes;
  if (is_peer(*b, p)) b->counters.peer_write_bytes += bytes;
}

void count_barrier() {
  Block *b = counted_block();
  if (b != nullptr) b->counters.barriers += 1;
}

void counters_launch_starts(Device &dev, Stream &s, Launch &l) {
  l.counting = dev.counting;
  l.rank = s.rank;
  if (!l.counting) return;
  l.tags = dev.tags;
  l.block_counters.assign(static_cast<size_t>(l.grid.x) * l.grid.y * l.grid.z, tpfuse_emu_block_counters{});
}

void counters_block_done(Block &b) {
  Launch &l = *b.launch;
  if (!l.counting) return;
  b.counters.block = b.idx.x;
  b.counters.rank = l.rank;
  l.block_counters.at(b.idx.x) = b.counters;
}

void counters_launch_done(Device &dev, Launch &l) {
  if (!l.counting) return;
  const uint64_t index = dev.records.size();
  for (size_t i = 0; i < l.block_counters.size(); ++i) {
    l.block_counters[i].launch = index;
    l.block_counters[i].block = static_cast<uint32_t>(i);
    l.block_counters[i].rank = l.rank;
  }
  dev.records.push_back(LaunchRecord{l.name, std::move(l.block_counters)});
}

// Device memory is freed here (cudaFree, cuMemFree*): its tags go with it.
void free_device_memory(void *ptr) {
  if (ptr == nullptr) return;
  Device &dev = device();
  {
    std::lock_guard<std::mutex> lk(dev.mu);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr);
    const uintptr_t end = begin + malloc_usable_size(ptr);
    bool tagged = false;
    for (const Tag &t : *dev.tags) tagged = tagged || (t.begin < end && begin < t.end);
    if (tagged) edit_tags(dev, [&](Tags &tags) { drop_tags(tags, begin, end); });
    if (weak_memory) dev.freed.emplace_back(begin, end);
  }
  std::free(ptr);
}

} // namespace tpfuse_emu

using namespace tpfuse_emu;

extern "C" {

void tpfuse_emu_tag_memory(const void *ptr, size_t bytes, int32_t rank) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr);
  edit_tags(dev, [&](Tags &tags) {
    drop_tags(tags, begin, begin + bytes);
    tags.push_back(Tag{begin, begin + bytes, rank});
  });
}

void tpfuse_emu_tag_stream(void *stream, int32_t rank) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  stream_of(static_cast<cudaStream_t>(stream))->rank = rank;
}

void tpfuse_emu_counters_start(void) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  dev.records.clear();
  dev.counting = true;
}

void tpfuse_emu_counters_stop(void) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  dev.counting = false;
}

size_t tpfuse_emu_counters_blocks(tpfuse_emu_block_counters *out, size_t cap) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  size_t n = 0;
  for (const LaunchRecord &r : dev.records) {
    for (const tpfuse_emu_block_counters &b : r.blocks) {
      if (out != nullptr && n < cap) out[n] = b;
      ++n;
    }
  }
  return n;
}

size_t tpfuse_emu_counters_launch_name(uint64_t launch, char *buf, size_t cap) {
  Device &dev = device();
  std::lock_guard<std::mutex> lk(dev.mu);
  return copy_out(launch < dev.records.size() ? dev.records[launch].name : std::string(), buf, cap);
}

} // extern "C"
