#include "tessera/core/caching_allocator.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tessera/core/error.h"

namespace tessera {

// Named, not anonymous: the types are members of CachingAllocator::Impl, which has linkage.
namespace caching_detail {

// A piece of a segment. Invariant: within a segment, blocks tile the raw allocation in address
// order (prev/next), and no two neighbours are both free (a freed block merges at once), so a
// free block whose prev and next are null is a whole segment that can go back to the device.
struct Block {
  char* ptr = nullptr;
  size_t size = 0;
  StreamId stream = 0;
  bool small = false;   // carved from a small segment: goes back to the small pool
  bool in_use = false;  // handed out, or freed with events still pending
  Block* prev = nullptr;
  Block* next = nullptr;
  std::vector<StreamId> used_on;  // other streams that used it (record_stream)
  int pending_events = 0;
};

// Best fit: the smallest free block of the stream that is large enough, lowest address first.
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    return std::tie(a->stream, a->size, a->ptr) < std::tie(b->stream, b->size, b->ptr);
  }
};
using Pool = std::set<Block*, BlockOrder>;

}  // namespace caching_detail

using caching_detail::Block;
using caching_detail::Pool;

namespace {

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

}  // namespace

struct CachingAllocator::Impl {
  std::unique_ptr<DeviceMemory> memory;
  Device device;
  mutable std::mutex mu;
  Pool small_pool, large_pool;
  std::unordered_map<void*, Block*> live;        // handed out, by pointer
  std::vector<Block*> segments;                  // first block of each segment
  std::deque<std::pair<void*, Block*>> pending;  // events a freed block waits for
  CachingStats stats;

  Pool& pool_of(const Block* b) { return b->small ? small_pool : large_pool; }
  Block* live_block(void* ptr, const char* op, const char* otherwise) const {
    auto it = live.find(ptr);
    TESSERA_CHECK(it != live.end(), op, " on ", device.str(), ": ", ptr, " ", otherwise);
    return it->second;
  }

  Block* allocate(size_t nbytes, StreamId stream);
  void free_block(Block* b);
  void process_events(bool synchronized);
  void release_free_segments();
  Block* new_segment(size_t size, bool small, StreamId stream);
  void split(Block* b, size_t size);
  [[noreturn]] void out_of_memory(size_t nbytes, size_t segment_size);
};

CachingAllocator::CachingAllocator(std::unique_ptr<DeviceMemory> memory)
    : impl_(std::make_unique<Impl>()) {
  TESSERA_CHECK(memory != nullptr, "CachingAllocator: no DeviceMemory given");
  impl_->device = memory->device();
  impl_->memory = std::move(memory);
}

CachingAllocator::~CachingAllocator() {
  Impl& s = *impl_;
  if (!s.pending.empty()) s.memory->synchronize();
  for (auto& [event, block] : s.pending)
    s.memory->release_event(event);
  for (Block* head : s.segments) {
    s.memory->raw_free(head->ptr);
    for (Block* b = head; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

Device CachingAllocator::device() const {
  return impl_->device;
}

void* CachingAllocator::allocate(size_t nbytes) {
  return allocate(nbytes, impl_->memory->current_stream());
}

void* CachingAllocator::allocate(size_t nbytes, StreamId stream) {
  if (nbytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(impl_->mu);
  Block* b = impl_->allocate(nbytes, stream);
  detail::record_alloc(impl_->device, nbytes);
  return b->ptr;
}

Block* CachingAllocator::Impl::allocate(size_t nbytes, StreamId stream) {
  process_events(false);
  const size_t size = round_up(nbytes, kBlockRound);
  const bool small = size <= kSmallRequest;
  Pool& pool = small ? small_pool : large_pool;
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool.lower_bound(&key);
  Block* b = nullptr;
  if (it != pool.end() && (*it)->stream == stream) {
    b = *it;
    pool.erase(it);
  } else {
    const size_t segment_size = small                    ? kSmallSegment
                                : size <= kMediumRequest ? kLargeSegment
                                                         : round_up(size, kSegmentRound);
    b = new_segment(segment_size, small, stream);
    if (b == nullptr) {
      // Cached memory of other sizes and streams may be what the device lacks.
      ++stats.cache_flushes;
      process_events(true);
      release_free_segments();
      b = new_segment(segment_size, small, stream);
      if (b == nullptr) out_of_memory(nbytes, segment_size);
    }
  }
  split(b, size);
  b->in_use = true;
  live.emplace(b->ptr, b);
  stats.allocated_bytes += int64_t(b->size);
  return b;
}

// Cuts b down to `size` when the rest is worth keeping as a block of its own: any rest in a
// small segment, only more than a small request's worth in a large one (a large block that is
// a little too big is handed out whole rather than leaving a sliver no large request fits).
void CachingAllocator::Impl::split(Block* b, size_t size) {
  const size_t rest = b->size - size;
  if (rest < (b->small ? kBlockRound : kSmallRequest + 1)) return;
  Block* r = new Block;
  r->ptr = b->ptr + size;
  r->size = rest;
  r->stream = b->stream;
  r->small = b->small;
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  pool_of(r).insert(r);
}

Block* CachingAllocator::Impl::new_segment(size_t size, bool small, StreamId stream) {
  void* raw = memory->raw_allocate(size);
  if (raw == nullptr) return nullptr;
  Block* b = new Block;
  b->ptr = static_cast<char*>(raw);
  b->size = size;
  b->stream = stream;
  b->small = small;
  segments.push_back(b);
  ++stats.segments;
  ++stats.raw_allocations;
  stats.reserved_bytes += int64_t(size);
  stats.peak_reserved_bytes = std::max(stats.peak_reserved_bytes, stats.reserved_bytes);
  return b;
}

void CachingAllocator::Impl::out_of_memory(size_t nbytes, size_t segment_size) {
  int64_t cached = 0;
  for (const Pool* p : {&small_pool, &large_pool})
    for (const Block* b : *p)
      cached += int64_t(b->size);
  TESSERA_FAIL("out of memory on ", device.str(), " allocating ", nbytes,
               " bytes: a new segment of ", segment_size,
               " bytes failed after the cache was freed; ", stats.reserved_bytes,
               " bytes reserved, ", stats.allocated_bytes, " in use, ", cached,
               " cached in pieces too small or on other streams");
}

void CachingAllocator::deallocate(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  Block* b = s.live_block(ptr, "deallocate",
                          "was not handed out by this allocator (or was freed already)");
  s.live.erase(ptr);
  s.stats.allocated_bytes -= int64_t(b->size);
  detail::record_free(s.device, nbytes);
  if (b->used_on.empty()) {
    s.free_block(b);
    return;
  }
  // Work queued on the other streams may still read or write the block.
  for (StreamId other : b->used_on) {
    s.pending.emplace_back(s.memory->record_event(other), b);
    ++b->pending_events;
  }
  b->used_on.clear();
}

void CachingAllocator::Impl::free_block(Block* b) {
  b->in_use = false;
  if (Block* n = b->next; n != nullptr && !n->in_use) {
    pool_of(n).erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  if (Block* p = b->prev; p != nullptr && !p->in_use) {
    pool_of(p).erase(p);  // its size, hence its place in the pool, changes
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  pool_of(b).insert(b);
}

// Frees the blocks whose events have completed (all of them after a device synchronize).
void CachingAllocator::Impl::process_events(bool synchronize) {
  if (pending.empty()) return;
  if (synchronize) memory->synchronize();
  for (auto it = pending.begin(); it != pending.end();) {
    if (!synchronize && !memory->event_done(it->first)) {
      ++it;
      continue;
    }
    memory->release_event(it->first);
    Block* b = it->second;
    it = pending.erase(it);
    if (--b->pending_events == 0) free_block(b);
  }
}

void CachingAllocator::Impl::release_free_segments() {
  std::vector<Block*> kept;
  for (Block* head : segments) {
    if (head->in_use || head->next != nullptr) {
      kept.push_back(head);
      continue;
    }
    pool_of(head).erase(head);
    memory->raw_free(head->ptr);
    stats.reserved_bytes -= int64_t(head->size);
    --stats.segments;
    delete head;
  }
  segments = std::move(kept);
}

void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  Block* b = s.live_block(ptr, "record_stream", "is not a live block of this allocator");
  if (stream != b->stream &&
      std::find(b->used_on.begin(), b->used_on.end(), stream) == b->used_on.end())
    b->used_on.push_back(stream);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->process_events(true);
  impl_->release_free_segments();
}

CachingStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace tessera
