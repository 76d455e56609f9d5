// weak_memory.cpp: TPFUSE_EMU_MEMORY=weak and weak-random, global memory under the PTX ISA's
// memory consistency model as far as tpfuse's kernels use it (memory_model.hpp says how; the
// sections cited are the PTX ISA's "Memory Consistency Model" chapter).
//
// Memory itself always holds the newest value of every word: host code, copies and the `sc`
// mode read it. While launches run, each word they write keeps its versions here, in
// coherence order (the order the device thread performed the writes), and a kernel's weak
// load picks among them by the reading thread's view. A launch's completion commits its
// versions (a kernel boundary: everything after it sees them) and drops the ones nobody can
// read any more.
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
  uint64_t next_number = 1;                                      // versions, in coherence order
  uint64_t completions = 0;                                      // launches completed so far
  std::vector<uint64_t> completed_at;                            // by launch id: its completion (0: running)
  std::vector<uint64_t> started_at;                              // by launch id: completions before it started
  std::unordered_map<uint64_t, std::vector<uintptr_t>> written;  // launch id -> words
  View sc_sys;                                                   // fence.sc orders, per scope instance
  std::unordered_map<int, View> sc_gpu;
  std::unordered_map<uint64_t, View> sc_cta;
};

State &state() {
  static State *s = new State();  // device thread only; never destroyed (like device())
  return *s;
}

// Whether launch `launch` completed within completion frontier `frontier` (a kernel boundary
// the view has passed).
bool completed_within(uint64_t launch, uint64_t frontier) {
  const State &st = state();
  const uint64_t at = launch < st.completed_at.size() ? st.completed_at[launch] : 0;
  return at != 0 && at <= frontier;
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
  into.frontier = std::max(into.frontier, from.frontier);
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
    if (st.completed_at.size() <= l.memory_id) {
      st.completed_at.resize(l.memory_id + 1024, 0);
      st.started_at.resize(l.memory_id + 1024, 0);
    }
    st.started_at[l.memory_id] = st.completions;
  }
  return l.memory_id;
}

// Whether fiber f has seen version x of `word` (program order, its block's view, its own).
bool seen(Fiber &f, const Version &x, uintptr_t word) {
  Block &b = *f.block;
  const View &bv = block_memory(b).view;
  const uint64_t frontier = f.memory ? std::max(bv.frontier, f.memory->acquired.frontier) : bv.frontier;
  if (completed_within(x.launch, frontier)) return true;
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

// Appends the version memory now holds at word w, written by f.
Version &push_version(Fiber &f, uintptr_t w, bool strong, Order o, Scope s) {
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
  // A kernel boundary: the launch sees every launch completed before it started (those
  // before it on its stream among them).
  b.memory->view.frontier = state().started_at[launch_id(*b.launch)];
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

void memory_launch_done(Launch &l) {
  if (l.memory_id == 0) return;
  State &st = state();
  st.completed_at[l.memory_id] = ++st.completions;
  // The oldest frontier a running launch may still read by: versions completed within it are
  // seen by everyone, so the older ones can go.
  uint64_t oldest = st.completions;
  bool running = false;
  for (const Stream *s : device().active) {
    if (s->running && s->running.get() != &l && s->running->memory_id != 0) {
      oldest = std::min(oldest, st.started_at[s->running->memory_id]);
      running = true;
    }
  }
  if (!running) {  // nothing runs: memory holds what everyone sees
    st.pages.clear();
    st.last_key = ~uintptr_t{0};
    st.last_page = nullptr;
    st.written.clear();
    return;
  }
  auto it = st.written.find(l.memory_id);
  if (it == st.written.end()) return;
  for (uintptr_t w : it->second) {
    Word *found = find_word(w);
    if (found == nullptr) continue;
    Word &word = *found;
    int k = static_cast<int>(word.versions.size()) - 1;
    while (k >= 0 && !completed_within(word.versions[k].launch, oldest)) --k;
    if (k < 0) continue;
    word.base = word.versions[k].value;
    word.versions.erase(word.versions.begin(), word.versions.begin() + k + 1);
    if (word.versions.empty()) erase_word(w);
  }
  st.written.erase(it);
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
  for (uintptr_t w = word_of(p); w < end; w += 4) push_version(f, w, false, Order::Relaxed, Scope::Cta);
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
    Version &x = push_version(f, w, true, o, s);
    x.release = carried;
    x.releases = carried != nullptr;
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
  Version &x = push_version(f, w, true, o, s);
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
