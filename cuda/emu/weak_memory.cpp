// weak_memory.cpp: TPFUSE_EMU_MEMORY=weak and weak-random, global memory under the PTX ISA's
// memory consistency model as far as tpfuse's kernels use it (memory_model.hpp says how; the
// sections cited are the PTX ISA's "Memory Consistency Model" chapter).
//
// Memory itself always holds the newest value of every word: host code, copies and the `sc`
// mode read it. Each word kernels write keeps its versions here, in coherence order (the
// order the device thread performed the writes), and a kernel's weak load picks among them by
// the reading thread's view. A launch's versions are committed (memory holds them for
// everyone, and they go) once every launch that may still start or run is ordered after it:
// after the host synchronised with it, not merely after it completed (collect()).
#include <algorithm>
#include <cstring>
#include <random>
#include <sstream>

#include "scheduler.hpp"

namespace tpfuse_emu {

bool weak_memory = false;

namespace {

struct Version {
  uint32_t value;   // the word after this write
  uint64_t number;  // its place in the word's coherence order (1, 2, ...)
  uint64_t launch, block;
  uint32_t thread, epoch, seq;
  uint8_t bytes;  // which of the word's bytes it wrote (bit i: byte i)
  bool strong;
  Order order;
  Scope scope;
  int gpu;
  unsigned block_index;
  std::shared_ptr<const View> release;  // what a release pattern carried (null otherwise)
  bool releases = false;                // this write is a release pattern's (not only a carrier)
};

struct Word {
  bool present = false;  // whether the word has a history (else memory holds its committed value)
  uint32_t base;         // the value before the first version, seen by every running thread
  std::vector<Version> versions;
};

// The words with versions, by 4 KiB page: one hash lookup per page (and none for a load in
// the page looked up last), then an index into the page's words, held in place (a load's
// history is one pointer away).
constexpr uintptr_t kPageWords = 1024;
struct Page {
  uint32_t used = 0;
  Word words[kPageWords];
};

struct State {
  bool random = false;
  std::mt19937_64 rng;
  uint64_t next_launch = 1;
  std::unordered_map<uintptr_t, std::unique_ptr<Page>> pages;
  uintptr_t last_key = ~uintptr_t{0};
  Page *last_page = nullptr;
  uint64_t next_number = 1;  // versions, in coherence order
  // By launch id: its stream's slot and its number there (its ordinal + 1), as a Frontier
  // counts it.
  std::vector<std::pair<uint32_t, uint64_t>> origin;
  std::vector<uint64_t> committed;  // by slot: its first n launches are seen by everyone
  std::unordered_map<uint64_t, std::vector<uintptr_t>> written;  // launch id -> words
  View sc_sys;                                                   // fence.sc orders, per scope instance
  std::unordered_map<int, View> sc_gpu;
  std::unordered_map<uint64_t, View> sc_cta;
};

State &state() {
  static State *s = new State();  // device thread only; never destroyed (like device())
  return *s;
}

// Launch `launch`'s stream slot and number there ({0, 0}: it never started).
std::pair<uint32_t, uint64_t> origin_of(uint64_t launch) {
  const State &st = state();
  return launch < st.origin.size() ? st.origin[launch] : std::pair<uint32_t, uint64_t>{0, 0};
}

// Whether the first `number` launches of stream slot `slot` are committed.
bool committed_at(uint32_t slot, uint64_t number) {
  const State &st = state();
  return slot < st.committed.size() && number <= st.committed[slot];
}

// Whether launch `launch` is committed: every launch that may still run is ordered after it.
bool committed(uint64_t launch) {
  const auto [slot, number] = origin_of(launch);
  return number != 0 && committed_at(slot, number);
}

// Whether launch `launch` completed within `frontier` (a kernel boundary the view has passed),
// or is committed.
bool completed_within(uint64_t launch, const Frontier &frontier) {
  const auto [slot, number] = origin_of(launch);
  return number != 0 && (committed(launch) || frontier.of(slot) >= number);
}

// Drops f's entries that every view holds (committed launches): views stay small.
void prune(Frontier &f) {
  f.done.erase(std::remove_if(f.done.begin(), f.done.end(),
                              [](const std::pair<uint32_t, uint64_t> &e) { return committed_at(e.first, e.second); }),
               f.done.end());
}

uintptr_t word_of(const void *p) { return reinterpret_cast<uintptr_t>(p) & ~uintptr_t{3}; }

// ---- Views: sorted vectors of marks and points, one entry per key.

uint64_t key_of(const BlockMark &m) { return m.block; }
uint32_t key_of(const ThreadMark &t) { return t.thread; }
uintptr_t key_of(const Point &p) { return p.word; }

// v's entry with key k, or null.
template <typename E, typename K> const E *find(const std::vector<E> &v, K k) {
  auto it = std::lower_bound(v.begin(), v.end(), k, [](const E &e, K x) { return key_of(e) < x; });
  return it != v.end() && key_of(*it) == k ? &*it : nullptr;
}

// v's entry with key k, inserted as `absent` when there is none.
template <typename E, typename K> E &entry(std::vector<E> &v, K k, E absent) {
  auto it = std::lower_bound(v.begin(), v.end(), k, [](const E &e, K x) { return key_of(e) < x; });
  if (it == v.end() || key_of(*it) != k) it = v.insert(it, std::move(absent));
  return *it;
}

BlockMark &block_mark(View &v, uint64_t block, uint64_t launch) {
  return entry(v.blocks, block, BlockMark{block, launch, 0, {}});
}

void mark_thread(BlockMark &m, uint32_t thread, uint32_t seq) {
  ThreadMark &t = entry(m.threads, thread, ThreadMark{thread, seq});
  t.seq = std::max(t.seq, seq);
}

void add_point(View &v, uintptr_t word, uint64_t number) {
  Point &p = entry(v.points, word, Point{word, number});
  p.number = std::max(p.number, number);
}

// into := into ⊔ from for vectors sorted by key: one pass over both (an insert per entry
// moved the rest of `into` each time: quadratic in the points a block's barrier gathers),
// `both` combining the entries of a key in both.
template <typename E, typename Both> void merge_sorted(std::vector<E> &into, const std::vector<E> &from, Both both) {
  if (from.empty()) return;
  std::vector<E> merged;
  merged.reserve(into.size() + from.size());
  auto a = into.begin(), b = from.begin();
  while (a != into.end() && b != from.end()) {
    if (key_of(*a) < key_of(*b)) {
      merged.push_back(*a++);
    } else if (key_of(*b) < key_of(*a)) {
      merged.push_back(*b++);
    } else {
      merged.push_back(both(*a++, *b++));
    }
  }
  merged.insert(merged.end(), a, into.end());
  merged.insert(merged.end(), b, from.end());
  into.swap(merged);
}

// into := into ⊔ from, leaving out the marks of launches its frontier has seen complete.
void join(View &into, const View &from) {
  into.frontier.join(from.frontier);
  for (const BlockMark &m : from.blocks) {
    if (completed_within(m.launch, into.frontier)) continue;
    BlockMark &to = block_mark(into, m.block, m.launch);
    to.epoch_floor = std::max(to.epoch_floor, m.epoch_floor);
    merge_sorted(to.threads, m.threads,
                 [](const ThreadMark &x, const ThreadMark &y) { return ThreadMark{x.thread, std::max(x.seq, y.seq)}; });
  }
  merge_sorted(into.points, from.points,
               [](const Point &x, const Point &y) { return Point{x.word, std::max(x.number, y.number)}; });
}

bool covers(const View &v, const Version &x) {
  const BlockMark *m = find(v.blocks, x.block);
  if (m == nullptr) return false;
  if (x.epoch < m->epoch_floor) return true;
  const ThreadMark *t = find(m->threads, x.thread);
  return t != nullptr && x.seq <= t->seq;
}

bool covers_point(const View &v, uintptr_t word, uint64_t number) {
  const Point *p = find(v.points, word);
  return p != nullptr && number <= p->number;
}

ThreadMemory &thread_memory(Fiber &f) {
  if (!f.memory) f.memory = std::make_unique<ThreadMemory>();
  return *f.memory;
}

BlockMemory &block_memory(Block &b) {
  if (!b.memory) memory_block_start(b);
  return *b.memory;
}

uint64_t launch_id(Launch &l) {
  if (l.memory_id == 0) {
    State &st = state();
    l.memory_id = st.next_launch++;
    if (st.origin.size() <= l.memory_id) st.origin.resize(l.memory_id + 1024, {0, 0});
    st.origin[l.memory_id] = {l.stream->slot, l.ordinal + 1};
  }
  return l.memory_id;
}

// Whether fiber f has seen version x of `word` (program order, its block's view, its own).
bool seen(Fiber &f, const Version &x, uintptr_t word) {
  Block &b = *f.block;
  const View &bv = block_memory(b).view;
  if (completed_within(x.launch, bv.frontier)) return true;
  if (f.memory && completed_within(x.launch, f.memory->acquired.frontier)) return true;
  if (x.block == b.order && x.thread == f.tid.x) return true;
  if (covers(bv, x) || covers_point(bv, word, x.number)) return true;
  return f.memory && (covers(f.memory->acquired, x) || covers_point(f.memory->acquired, word, x.number));
}

// Whether scope `s` of thread (gpu, block) includes the thread (gpu2, block2).
bool includes(Scope s, int gpu, uint64_t block, int gpu2, uint64_t block2) {
  switch (s) {
  case Scope::Cta: return block == block2;
  case Scope::Gpu: return gpu == gpu2;
  case Scope::Sys: return true;
  }
  return false;
}

bool morally_strong(const Version &x, Fiber &f, Scope reader) {
  const int gpu = block_memory(*f.block).gpu;
  return x.strong && includes(x.scope, x.gpu, x.block, gpu, f.block->order) &&
         includes(reader, gpu, f.block->order, x.gpu, x.block);
}

const char *scope_name(Scope s) { return s == Scope::Cta ? "cta" : s == Scope::Gpu ? "gpu" : "sys"; }
const char *order_name(Order o) {
  switch (o) {
  case Order::Relaxed: return "relaxed";
  case Order::Acquire: return "acquire";
  case Order::Release: return "release";
  case Order::AcqRel: return "acq_rel";
  case Order::SeqCst: return "sc";
  }
  return "?";
}
bool acquires(Order o) { return o == Order::Acquire || o == Order::AcqRel || o == Order::SeqCst; }
bool releases(Order o) { return o == Order::Release || o == Order::AcqRel || o == Order::SeqCst; }

// The view a release by f carries: what f has seen, and its own writes so far.
std::shared_ptr<const View> release_view(Fiber &f) {
  Block &b = *f.block;
  ThreadMemory &t = thread_memory(f);
  auto v = std::make_shared<View>(block_memory(b).view);
  join(*v, t.acquired);
  mark_thread(block_mark(*v, b.order, launch_id(*b.launch)), f.tid.x, t.seq);
  ++t.seq;  // its later writes are not released by this
  return v;
}

Page *find_page(uintptr_t w, bool create) {
  State &st = state();
  const uintptr_t key = w / (4 * kPageWords);
  if (key == st.last_key) return st.last_page;
  auto it = st.pages.find(key);
  Page *page = nullptr;
  if (it != st.pages.end()) {
    page = it->second.get();
  } else if (create) {
    page = (st.pages[key] = std::make_unique<Page>()).get();
  } else {
    return nullptr;
  }
  st.last_key = key;
  st.last_page = page;
  return page;
}

// Word w's history, or null when it has none (memory holds its committed value).
Word *find_word(uintptr_t w) {
  Page *page = find_page(w, false);
  if (page == nullptr) return nullptr;
  Word &word = page->words[(w / 4) % kPageWords];
  return word.present ? &word : nullptr;
}

Word &word_entry(uintptr_t w) {
  Page *page = find_page(w, true);
  Word &word = page->words[(w / 4) % kPageWords];
  if (!word.present) {
    word.present = true;
    std::memcpy(&word.base, reinterpret_cast<const void *>(w), 4);
    ++page->used;
  }
  return word;
}

void erase_word(uintptr_t w) {
  State &st = state();
  const uintptr_t key = w / (4 * kPageWords);
  auto it = st.pages.find(key);
  if (it == st.pages.end()) return;
  Page &page = *it->second;
  Word &word = page.words[(w / 4) % kPageWords];
  if (!word.present) return;
  word.present = false;
  word.versions.clear();
  if (--page.used == 0) {
    if (st.last_key == key) {
      st.last_key = ~uintptr_t{0};
      st.last_page = nullptr;
    }
    st.pages.erase(it);
  }
}

// The bytes of word w that [begin, end) covers (bit i: byte i).
uint8_t bytes_of(uintptr_t w, uintptr_t begin, uintptr_t end) {
  uint8_t m = 0;
  for (uintptr_t a = std::max(w, begin); a < std::min(w + 4, end); ++a) m |= static_cast<uint8_t>(1u << (a - w));
  return m;
}

// Appends the version memory now holds at word w, written by f.
Version &push_version(Fiber &f, uintptr_t w, uint8_t bytes, bool strong, Order o, Scope s) {
  State &st = state();
  Block &b = *f.block;
  const uint64_t launch = launch_id(*b.launch);
  Word &word = word_entry(w);
  if (word.versions.empty() || word.versions.back().launch != launch) st.written[launch].push_back(w);
  Version x{};
  std::memcpy(&x.value, reinterpret_cast<const void *>(w), 4);
  x.number = st.next_number++;
  x.launch = launch;
  x.block = b.order;
  x.thread = f.tid.x;
  x.epoch = block_memory(b).epoch;
  x.seq = f.memory ? f.memory->seq : 0;
  x.bytes = bytes;
  x.strong = strong;
  x.order = o;
  x.scope = s;
  x.gpu = block_memory(b).gpu;
  x.block_index = b.idx.x;
  word.versions.push_back(std::move(x));
  return word.versions.back();
}

// The value a weak load by f reads at word w.
uint32_t weak_value(Fiber &f, uintptr_t w) {
  State &st = state();
  Word *found = find_word(w);
  if (found == nullptr) {
    uint32_t v;
    std::memcpy(&v, reinterpret_cast<const void *>(w), 4);
    return v;
  }
  Word &word = *found;
  const auto &vs = word.versions;
  // The newest version f has seen (-1: the committed base): the oldest it may read.
  int k = static_cast<int>(vs.size()) - 1;
  while (k >= 0 && !seen(f, vs[k], w)) --k;
  if (!st.random) return k < 0 ? word.base : vs[k].value;
  // weak-random: any version from there on, never older than one this thread read before
  // (coherence of reads, CoRR).
  ThreadMemory &t = thread_memory(f);
  auto floor = t.read_floor.find(w);
  int lo = k;
  if (floor != t.read_floor.end()) {
    while (lo + 1 < static_cast<int>(vs.size()) && (lo < 0 || vs[lo].number < floor->second)) ++lo;
  }
  const int n = static_cast<int>(vs.size());
  const int pick = lo + static_cast<int>(st.rng() % static_cast<uint64_t>(n - lo));
  if (pick < 0) return word.base;
  if (pick > k) t.read_floor[w] = vs[pick].number;
  return vs[pick].value;
}

[[noreturn]] void narrow_scope(Fiber &f, const Version &x, Order o, Scope s, uintptr_t w) {
  std::ostringstream why;
  why << "an acquire (ld/atom ." << order_name(o) << "." << scope_name(s) << ") on GPU " << block_memory(*f.block).gpu
      << ", block " << f.block->idx.x << ", thread " << f.tid.x << " read at " << reinterpret_cast<const void *>(w)
      << " the value of a release (." << order_name(x.order) << "." << scope_name(x.scope) << ") on GPU " << x.gpu
      << ", block " << x.block_index << ", thread " << x.thread
      << ": their scopes do not include each other (not morally strong), so nothing is synchronised";
  fail_launch(cudaErrorLaunchFailure, why.str());
}

// A strong load by f of word w, whose newest version (the one it reads) is x. When x is not
// morally strong with it (a weak write, or a strong one whose scope and the load's do not
// include each other) and not ordered before it (f has not seen it), the two race: the PTX ISA
// promises single-copy atomicity, the whole value of one write, only between morally strong
// accesses ("Memory Consistency Model": morally strong, data races), and a GPU may show a
// torn or stale word (a packet's tag with another write's data). The emulator's loads read
// whole words, so the race is reported instead: the launch fails, naming both accesses.
void check_race(Fiber &f, const Version &x, Order o, Scope s, uintptr_t w) {
  if (morally_strong(x, f, s) || seen(f, x, w)) return;
  std::ostringstream why;
  why << "a strong load (ld." << order_name(o) << "." << scope_name(s) << ") on GPU " << block_memory(*f.block).gpu
      << ", block " << f.block->idx.x << ", thread " << f.tid.x << " read at " << reinterpret_cast<const void *>(w)
      << (!x.strong   ? std::string(" a weak write")
          : x.releases ? std::string(" a release (.") + order_name(x.order) + "." + scope_name(x.scope) + ")"
                       : std::string(" a strong write (.") + order_name(x.order) + "." + scope_name(x.scope) + ")")
      << " on GPU " << x.gpu << ", block " << x.block_index << ", thread " << x.thread
      << " that is not morally strong with it and not ordered before it: a data race";
  fail_launch(cudaErrorLaunchFailure, why.str());
}

// After a write by f of `bytes` of word w (strong or weak; a strong one of scope s), now the
// word's newest version: every older version that f has not seen (not ordered before the
// write), back to the newest seen one that wrote each byte, that wrote one of those bytes and
// is not morally strong with it races it. The PTX ISA leaves the coherence order of two such
// writes free (and promises nothing of a data race), so on a GPU the older write may land last: a packet's
// clear over the next launch's packet, a stale value over a fresh one. `weak` lands every such
// write again after f's (a copy of the version, the same writer: memory ends with its bytes);
// `weak-random` does so by a coin. Without it the emulator would perform writes in the order it
// runs them, kinder than a GPU.
void land_racing_writes_last(Fiber &f, uintptr_t w, uint8_t bytes, bool strong, Scope s) {
  State &st = state();
  Word &word = *find_word(w);
  std::vector<Version> racing;
  uint8_t open = bytes;  // the bytes no seen version below has written yet
  for (size_t k = word.versions.size() - 1; open != 0 && k-- > 0;) {
    const Version &x = word.versions[k];
    if ((x.bytes & open) == 0) continue;
    if (seen(f, x, w)) {  // ordered before: and so, in coherence order, what precedes it
      open &= static_cast<uint8_t>(~x.bytes);
      continue;
    }
    if (strong && morally_strong(x, f, s)) continue;
    if (st.random && (st.rng() & 1)) continue;
    racing.push_back(x);
    racing.back().bytes &= open;
  }
  for (auto x = racing.rbegin(); x != racing.rend(); ++x) {
    uint32_t value;
    std::memcpy(&value, reinterpret_cast<const void *>(w), 4);
    for (int i = 0; i < 4; ++i) {
      const uint32_t byte = 0xffu << (8 * i);
      if (x->bytes & (1u << i)) value = (value & ~byte) | (x->value & byte);
    }
    std::memcpy(reinterpret_cast<void *>(w), &value, 4);
    Version again = *x;
    again.value = value;
    again.number = st.next_number++;
    word.versions.push_back(std::move(again));
    st.written[x->launch].push_back(w);
  }
}

// A strong read by f of words [p, p + bytes) in memory now: observation, and the acquire.
void observe(Fiber &f, const void *p, size_t bytes, Order o, Scope s) {
  ThreadMemory &t = thread_memory(f);
  for (uintptr_t w = word_of(p); w < reinterpret_cast<uintptr_t>(p) + bytes; w += 4) {
    const Word *word = find_word(w);
    if (word == nullptr || word->versions.empty()) continue;  // committed
    const Version &x = word->versions.back();
    if (!x.strong) continue;  // a weak write: a data race, nothing is ordered by it
    if (!morally_strong(x, f, s)) {
      if (acquires(o) && x.releases) narrow_scope(f, x, o, s, w);
      continue;
    }
    add_point(t.acquired, w, x.number);  // causality: x precedes what follows this read
    if (x.release) join(acquires(o) ? t.acquired : t.observed, *x.release);
  }
}

bool in_shared(const Block &b, const void *p) {
  const unsigned char *c = static_cast<const unsigned char *>(p);
  if (!b.dynamic_smem.empty() && c >= b.dynamic_smem.data() && c < b.dynamic_smem.data() + b.dynamic_smem.size()) {
    return true;
  }
  for (const Block::Static &s : b.statics)
    if (c >= s.start && c < s.start + s.bytes) return true;
  return false;
}

} // namespace

void configure_memory(int32_t mode, uint64_t seed) {
  State &st = state();
  weak_memory = mode != TPFUSE_EMU_MEMORY_SC;
  st.random = mode == TPFUSE_EMU_MEMORY_WEAK_RANDOM;
  st.rng.seed(seed ^ 0x5eed3e3017ull);
  st.pages.clear();
  st.last_key = ~uintptr_t{0};
  st.last_page = nullptr;
  st.written.clear();
  st.sc_sys = View{};
  st.sc_gpu.clear();
  st.sc_cta.clear();
}

bool is_global(const void *p) {
  Fiber *f = running_fiber;
  return f != nullptr && !in_shared(*f->block, p);
}

void memory_block_start(Block &b) {
  b.memory = std::make_unique<BlockMemory>();
  const Stream &s = *b.launch->stream;
  b.memory->gpu = s.rank >= 0 ? s.rank : 1000 + s.device;
  // A kernel boundary: the launch sees what was ordered before it started
  // (memory_operation_starts).
  b.memory->view.frontier = b.launch->start;
}

void memory_barrier(Block &b) {
  BlockMemory &m = block_memory(b);
  // The threads' points are gathered, sorted and merged into the block's view once: a join per
  // thread walked the block's whole view each time (512 threads, each with the points of the
  // packets it read, made the all-reduce by packets spend most of its time here).
  std::vector<Point> points;
  for (auto &f : b.fibers) {
    if (!f->memory) continue;
    View &acquired = f->memory->acquired;
    points.insert(points.end(), acquired.points.begin(), acquired.points.end());
    acquired.points.clear();
    join(m.view, acquired);  // its frontier and block marks
    acquired = View{};
  }
  std::sort(points.begin(), points.end(),
            [](const Point &x, const Point &y) { return x.word != y.word ? x.word < y.word : x.number > y.number; });
  // One entry a word, its newest number (first after the sort).
  points.erase(std::unique(points.begin(), points.end(), [](const Point &x, const Point &y) { return x.word == y.word; }),
               points.end());
  merge_sorted(m.view.points, points,
               [](const Point &x, const Point &y) { return Point{x.word, std::max(x.number, y.number)}; });
  ++m.epoch;
  block_mark(m.view, b.order, launch_id(*b.launch)).epoch_floor = m.epoch;
}

namespace {

// Commits what every launch that may still run is ordered after (under mu): the meet of what
// the host has synchronised with (a new stream's launches, and any enqueued from now on, start
// from it), each running launch's start (`starting`'s too, a launch no stream runs yet), and
// each waiting stream's next operation's. A word's versions up to its newest committed one go
// (memory holds the newest value).
void collect(const Launch *starting) {
  Device &dev = device();
  State &st = state();
  Frontier bound = dev.host_known;
  if (starting != nullptr) bound.meet(starting->start);
  for (auto &stream : dev.streams) {
    const Stream &s = *stream;
    if (s.running) {
      bound.meet(s.running->start);
    } else if (!s.queue.empty()) {
      Frontier next = s.known;
      next.join(s.queue.front()->after);
      bound.meet(next);
    }
  }
  bool raised = false;
  for (const auto &[slot, n] : bound.done) {
    if (st.committed.size() <= slot) st.committed.resize(slot + 1, 0);
    if (n > st.committed[slot]) {
      st.committed[slot] = n;
      raised = true;
    }
  }
  if (!raised) return;
  prune(dev.host_known);  // copied into every operation enqueued from now on
  for (auto it = st.written.begin(); it != st.written.end();) {
    if (!committed(it->first)) {
      ++it;
      continue;
    }
    for (uintptr_t w : it->second) {
      Word *found = find_word(w);
      if (found == nullptr) continue;
      Word &word = *found;
      int k = static_cast<int>(word.versions.size()) - 1;
      while (k >= 0 && !committed(word.versions[k].launch)) --k;
      if (k < 0) continue;
      word.base = word.versions[k].value;
      word.versions.erase(word.versions.begin(), word.versions.begin() + k + 1);
      if (word.versions.empty()) erase_word(w);
    }
    it = st.written.erase(it);
  }
}

} // namespace

void memory_operation_starts(Stream &s, Launch &l) {
  s.known.join(l.after);
  if (l.joins) s.known.join(*l.joins);
  if (l.records) *l.records = s.known;
  if (!l.body) return;
  launch_id(l);
  l.start = s.known;
  prune(l.start);
  collect(&l);
  // Memory freed since the last kernel started may be allocated again: its versions go.
  Device &dev = device();
  for (const auto &[begin, end] : dev.freed) memory_host_write(reinterpret_cast<const void *>(begin), end - begin);
  dev.freed.clear();
}

void memory_block_done(Block &b) {
  if (!b.memory) return;
  Frontier &end = b.launch->end;
  end.join(b.memory->view.frontier);
  for (auto &f : b.fibers)
    if (f->memory) end.join(f->memory->acquired.frontier);
}

void memory_launch_done(Stream &s, Launch &l) {
  // A kernel boundary: the stream's next work sees the launch, and what its threads saw.
  s.known.join(l.end);
  s.known.raise(s.slot, l.ordinal + 1);
  collect(nullptr);
}

void memory_host_write(const void *p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  for (uintptr_t page = begin & ~(4 * kPageWords - 1); page < end; page += 4 * kPageWords) {
    if (find_page(page, false) == nullptr) continue;
    for (uintptr_t w = std::max(page, word_of(p)); w < std::min(end, page + 4 * kPageWords); w += 4) erase_word(w);
  }
}

void weak_load(const void *p, void *out, size_t bytes) {
  Fiber &f = current_fiber();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  unsigned char *o = static_cast<unsigned char *>(out);
  if (state().pages.empty()) {
    std::memcpy(out, p, bytes);
    return;
  }
  for (uintptr_t w = word_of(p); w < end; w += 4) {
    const uint32_t v = weak_value(f, w);
    const unsigned char *vb = reinterpret_cast<const unsigned char *>(&v);
    for (uintptr_t a = std::max(w, begin); a < std::min(w + 4, end); ++a) o[a - begin] = vb[a - w];
  }
}

void weak_store(void *p, const void *v, size_t bytes) {
  Fiber &f = current_fiber();
  if (in_shared(*f.block, p)) {
    std::memcpy(p, v, bytes);
    return;
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  for (uintptr_t w = word_of(p); w < end; w += 4) word_entry(w);  // the bases, before the write
  std::memcpy(p, v, bytes);
  for (uintptr_t w = word_of(p); w < end; w += 4) {
    const uint8_t bytes_here = bytes_of(w, begin, end);
    push_version(f, w, bytes_here, false, Order::Relaxed, Scope::Cta);
    land_racing_writes_last(f, w, bytes_here, false, Scope::Cta);
  }
}

void memory_strong_read(const void *p, size_t bytes, Order o, Scope s) {
  Fiber &f = current_fiber();
  for (uintptr_t w = word_of(p); w < reinterpret_cast<uintptr_t>(p) + bytes; w += 4) {
    const Word *word = find_word(w);
    if (word != nullptr && !word->versions.empty()) check_race(f, word->versions.back(), o, s, w);
  }
  observe(f, p, bytes, o, s);
}

void memory_strong_write(void *p, const void *v, size_t bytes, Order o, Scope s) {
  Fiber &f = current_fiber();
  ThreadMemory &t = thread_memory(f);
  std::shared_ptr<const View> carried;
  if (releases(o)) {
    carried = release_view(f);
  } else if (t.fenced) {
    carried = t.fenced;  // fence.release; st.relaxed: a release pattern (8.8, form 3)
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  for (uintptr_t w = word_of(p); w < end; w += 4) word_entry(w);
  if (bytes == 8) {
    uint64_t x;
    std::memcpy(&x, v, 8);
    __atomic_store_n(static_cast<uint64_t *>(p), x, __ATOMIC_RELEASE);
  } else {
    uint32_t x;
    std::memcpy(&x, v, 4);
    __atomic_store_n(static_cast<uint32_t *>(p), x, __ATOMIC_RELEASE);
  }
  for (uintptr_t w = word_of(p); w < end; w += 4) {
    const uint8_t bytes_here = bytes_of(w, begin, end);
    Version &x = push_version(f, w, bytes_here, true, o, s);
    x.release = carried;
    x.releases = carried != nullptr;
    land_racing_writes_last(f, w, bytes_here, true, s);
  }
}

uint32_t memory_rmw(uint32_t *p, Order o, Scope s, const std::function<uint32_t(uint32_t)> &op) {
  Fiber &f = current_fiber();
  const uintptr_t w = word_of(p);
  Word &word = word_entry(w);
  // The read half: the newest value (an atomic reads the last write in coherence order).
  std::shared_ptr<const View> before;
  if (!word.versions.empty() && morally_strong(word.versions.back(), f, s)) before = word.versions.back().release;
  observe(f, p, 4, acquires(o) ? Order::Acquire : Order::Relaxed, s);
  const uint32_t old = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  // The write half: a release carries f's view; any RMW carries on the release it read
  // (observation order through atomic operations, 8.9.2).
  ThreadMemory &t = thread_memory(f);
  std::shared_ptr<const View> carried = releases(o) ? release_view(f) : t.fenced;
  const bool is_release = carried != nullptr;
  if (before) {
    auto v = std::make_shared<View>(carried ? *carried : View{});
    join(*v, *before);
    carried = v;
  }
  __atomic_store_n(p, op(old), __ATOMIC_RELEASE);
  // An atomic reads the last write in coherence order and lands right after it: no write it
  // races lands later (land_racing_writes_last is for plain and strong stores).
  Version &x = push_version(f, w, 0xF, true, o, s);
  x.release = carried;
  x.releases = is_release;
  return old;
}

void memory_fence(Order o, Scope s) {
  State &st = state();
  Fiber &f = current_fiber();
  ThreadMemory &t = thread_memory(f);
  if (acquires(o)) {
    join(t.acquired, t.observed);  // ld.relaxed; fence: an acquire pattern (8.8, form 3)
    t.observed = View{};
  }
  View *sc = nullptr;
  if (o == Order::SeqCst) {
    // fence.sc: the fences of one scope instance are totally ordered (Fence-SC order); a
    // later one synchronises with every earlier one (8.9.4).
    sc = s == Scope::Sys ? &st.sc_sys : s == Scope::Gpu ? &st.sc_gpu[block_memory(*f.block).gpu] : &st.sc_cta[f.block->order];
    join(t.acquired, *sc);
  }
  if (releases(o)) {
    t.fenced = release_view(f);
    if (sc != nullptr) join(*sc, *t.fenced);
  }
}


} // namespace tpfuse_emu
