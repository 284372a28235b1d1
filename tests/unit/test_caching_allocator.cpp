// The caching allocator's policy on a stand-in device: host memory with a capacity, streams as
// numbers and events the test completes by hand.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "common/counting_allocator.h"
#include "tessera/core/caching_allocator.h"
#include "tessera/core/factory.h"
#include "tessera/testing/expect_error.h"

namespace {

using tessera::CachingAllocator;
using tessera::Device;
using tessera::StreamId;

struct FakeEvent {
  StreamId stream;
  bool done = false;
};

// What the test sees of the device: raw allocations, events, synchronizations.
struct FakeDeviceLog {
  size_t capacity = size_t(1) << 30;
  size_t in_use = 0;
  std::map<void*, size_t> raw;  // live raw allocations
  int raw_frees = 0;
  int synchronizes = 0;
  StreamId current = 0;
  std::vector<FakeEvent*> events;  // live events
};

class FakeDeviceMemory final : public tessera::DeviceMemory {
 public:
  explicit FakeDeviceMemory(FakeDeviceLog* log) : log_(log) {}
  Device device() const override { return Device::cuda(15); }
  void* raw_allocate(size_t nbytes) override {
    if (log_->in_use + nbytes > log_->capacity) return nullptr;
    void* p = std::malloc(nbytes);
    log_->raw[p] = nbytes;
    log_->in_use += nbytes;
    return p;
  }
  void raw_free(void* ptr) override {
    auto it = log_->raw.find(ptr);
    ASSERT_NE(it, log_->raw.end());
    log_->in_use -= it->second;
    log_->raw.erase(it);
    ++log_->raw_frees;
    std::free(ptr);
  }
  StreamId current_stream() const override { return log_->current; }
  void* record_event(StreamId stream) override {
    log_->events.push_back(new FakeEvent{stream});
    return log_->events.back();
  }
  bool event_done(void* event) override { return static_cast<FakeEvent*>(event)->done; }
  void release_event(void* event) override {
    std::erase(log_->events, static_cast<FakeEvent*>(event));
    delete static_cast<FakeEvent*>(event);
  }
  void synchronize() override {
    ++log_->synchronizes;
    for (FakeEvent* e : log_->events)
      e->done = true;
  }

 private:
  FakeDeviceLog* log_;
};

struct Fixture {
  FakeDeviceLog log;
  std::unique_ptr<CachingAllocator> alloc =
      std::make_unique<CachingAllocator>(std::make_unique<FakeDeviceMemory>(&log));
};

constexpr size_t kMiB = size_t(1) << 20;

TEST(CachingAllocator, FreedBlockIsReusedWithoutAskingTheDevice) {
  Fixture f;
  void* a = f.alloc->allocate(1000);
  f.alloc->deallocate(a, 1000);
  void* b = f.alloc->allocate(900);
  EXPECT_EQ(a, b);
  EXPECT_EQ(f.log.raw.size(), 1u);
  EXPECT_EQ(f.alloc->stats().raw_allocations, 1);
  f.alloc->deallocate(b, 900);
}

TEST(CachingAllocator, SmallRequestsShareOneSegmentAndLargeOnesGetTheirOwn) {
  Fixture f;
  std::vector<void*> small;
  for (int i = 0; i < 8; ++i)
    small.push_back(f.alloc->allocate(100 * 1024));
  EXPECT_EQ(f.log.raw.size(), 1u);
  EXPECT_EQ(f.log.raw.begin()->second, CachingAllocator::kSmallSegment);
  for (size_t i = 1; i < small.size(); ++i)
    EXPECT_EQ(static_cast<char*>(small[i]) - static_cast<char*>(small[i - 1]), 100 * 1024);
  void* medium = f.alloc->allocate(3 * kMiB);  // from a 20 MiB segment
  void* big = f.alloc->allocate(33 * kMiB);    // a segment of its own, rounded to 2 MiB
  std::multiset<size_t> sizes;
  for (auto& [p, n] : f.log.raw)
    sizes.insert(n);
  EXPECT_EQ(sizes, (std::multiset<size_t>{CachingAllocator::kSmallSegment,
                                          CachingAllocator::kLargeSegment, 34 * kMiB}));
  // A second medium request is cut from the rest of the first one's segment.
  void* medium2 = f.alloc->allocate(5 * kMiB);
  EXPECT_EQ(static_cast<char*>(medium2) - static_cast<char*>(medium), 3 * kMiB);
  EXPECT_EQ(f.log.raw.size(), 3u);
  for (void* p : small)
    f.alloc->deallocate(p, 100 * 1024);
  f.alloc->deallocate(medium, 3 * kMiB);
  f.alloc->deallocate(medium2, 5 * kMiB);
  f.alloc->deallocate(big, 33 * kMiB);
  EXPECT_EQ(f.alloc->stats().allocated_bytes, 0);
  EXPECT_EQ(f.alloc->stats().reserved_bytes, int64_t(2 + 20 + 34) * int64_t(kMiB));
}

TEST(CachingAllocator, FreedNeighboursMergeBackIntoTheWholeSegment) {
  Fixture f;
  void* a = f.alloc->allocate(512 * 1024);
  void* b = f.alloc->allocate(512 * 1024);
  void* c = f.alloc->allocate(512 * 1024);
  // b merges with nothing, a then takes b, and c merges with both neighbours.
  f.alloc->deallocate(b, 512 * 1024);
  f.alloc->deallocate(a, 512 * 1024);
  f.alloc->deallocate(c, 512 * 1024);
  // The largest small request fits only if the three pieces and the rest became one block.
  void* whole = f.alloc->allocate(CachingAllocator::kSmallRequest);
  EXPECT_EQ(whole, a);
  void* rest = f.alloc->allocate(CachingAllocator::kSmallRequest);
  EXPECT_EQ(static_cast<char*>(rest) - static_cast<char*>(a), int64_t(kMiB));
  EXPECT_EQ(f.log.raw.size(), 1u);
  f.alloc->deallocate(whole, kMiB);
  f.alloc->deallocate(rest, kMiB);
  f.alloc->empty_cache();
  EXPECT_TRUE(f.log.raw.empty()) << "a fully merged segment goes back on empty_cache";
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheStreamTheyBelongTo) {
  Fixture f;
  void* a = f.alloc->allocate(4096, StreamId(2));
  f.alloc->deallocate(a, 4096);
  void* b = f.alloc->allocate(4096, StreamId(1));
  EXPECT_NE(a, b);
  EXPECT_EQ(f.log.raw.size(), 2u);
  void* c = f.alloc->allocate(4096, StreamId(2));
  EXPECT_EQ(a, c);
  f.log.current = 1;
  f.alloc->deallocate(b, 4096);
  void* d = f.alloc->allocate(4096);
  EXPECT_EQ(d, b) << "allocate() orders on the device's current stream";
  f.alloc->deallocate(c, 4096);
  f.alloc->deallocate(d, 4096);
}

TEST(CachingAllocator, BlockUsedOnAnotherStreamWaitsForThatStreamsWork) {
  Fixture f;
  void* a = f.alloc->allocate(4096, StreamId(1));
  f.alloc->record_stream(a, StreamId(7));
  f.alloc->record_stream(a, StreamId(7));  // once is enough
  f.alloc->record_stream(a, StreamId(1));  // its own stream needs no event
  f.alloc->deallocate(a, 4096);
  ASSERT_EQ(f.log.events.size(), 1u);
  EXPECT_EQ(f.log.events[0]->stream, StreamId(7));
  void* b = f.alloc->allocate(4096, StreamId(1));
  EXPECT_NE(a, b) << "reused while stream 7 may still use it";
  f.log.events[0]->done = true;
  void* c = f.alloc->allocate(4096, StreamId(1));
  EXPECT_EQ(a, c) << "reusable once the event completed";
  EXPECT_TRUE(f.log.events.empty()) << "completed events are released";
  EXPECT_EQ(f.log.synchronizes, 0);
  f.alloc->deallocate(b, 4096);
  f.alloc->deallocate(c, 4096);
}

TEST(CachingAllocator, FullDeviceFreesTheCacheAndRetriesThenNamesWhatItHolds) {
  Fixture f;
  f.log.capacity = 64 * kMiB;
  void* a = f.alloc->allocate(30 * kMiB);
  f.alloc->record_stream(a, StreamId(3));
  f.alloc->deallocate(a, 30 * kMiB);  // cached, waiting for an event
  void* b = f.alloc->allocate(40 * kMiB);
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(f.alloc->stats().cache_flushes, 1);
  EXPECT_EQ(f.log.synchronizes, 1) << "pending frees are waited for before memory goes back";
  EXPECT_EQ(f.alloc->stats().reserved_bytes, int64_t(40 * kMiB));
  const std::string msg = tessera::testing::error_of([&] { f.alloc->allocate(30 * kMiB); });
  EXPECT_NE(msg.find("out of memory on cuda:15 allocating 31457280 bytes"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("41943040 bytes reserved, 41943040 in use"), std::string::npos) << msg;
  EXPECT_EQ(f.alloc->stats().allocated_bytes, int64_t(40 * kMiB)) << "a failure loses nothing";
  f.alloc->deallocate(b, 40 * kMiB);
}

TEST(CachingAllocator, TensorBytesAreCountedAsOnTheCpu) {
  Fixture f;
  const Device dev = Device::cuda(15);
  const auto before = tessera::memory_stats(dev);
  void* a = f.alloc->allocate(1000);
  void* b = f.alloc->allocate(3000);
  auto during = tessera::memory_stats(dev);
  EXPECT_EQ(during.current_bytes - before.current_bytes, 4000) << "requested bytes, not blocks";
  EXPECT_EQ(during.num_allocations - before.num_allocations, 2);
  f.alloc->deallocate(a, 1000);
  f.alloc->deallocate(b, 3000);
  EXPECT_EQ(tessera::memory_stats(dev).current_bytes, before.current_bytes);
  EXPECT_EQ(f.alloc->stats().reserved_bytes, int64_t(CachingAllocator::kSmallSegment))
      << "the device memory stays cached";
}

TEST(CachingAllocator, MisuseIsAClearError) {
  Fixture f;
  int on_stack = 0;
  EXPECT_NE(tessera::testing::error_of([&] {
              f.alloc->deallocate(&on_stack, 4);
            }).find("was not handed out by this allocator"),
            std::string::npos);
  void* a = f.alloc->allocate(64);
  f.alloc->deallocate(a, 64);
  EXPECT_NE(
      tessera::testing::error_of([&] { f.alloc->deallocate(a, 64); }).find("or was freed already"),
      std::string::npos);
  EXPECT_NE(
      tessera::testing::error_of([&] { f.alloc->record_stream(a, 1); }).find("is not a live block"),
      std::string::npos);
}

// Random sizes, streams and frees: live blocks never overlap, each keeps what was written into
// it, and the figures add up after every step.
TEST(CachingAllocator, RandomUseKeepsBlocksDisjointAndFiguresExact) {
  Fixture f;
  f.log.capacity = 100 * kMiB;  // small enough that the cache is freed a few times
  std::mt19937 rng(7);
  struct Live {
    char* p;
    size_t n;
    unsigned char fill;
  };
  std::vector<Live> live;
  auto check_and_free = [&](size_t i) {
    const Live l = live[i];
    for (size_t k = 0; k < l.n; k += 97)
      ASSERT_EQ((unsigned char)l.p[k], l.fill);
    ASSERT_EQ((unsigned char)l.p[l.n - 1], l.fill);
    if (rng() % 4 == 0) f.alloc->record_stream(l.p, StreamId(rng() % 3));
    f.alloc->deallocate(l.p, l.n);
    live.erase(live.begin() + int64_t(i));
  };
  for (int step = 0; step < 3000; ++step) {
    if (!live.empty() && (rng() % 2 == 0 || live.size() > 60)) {
      check_and_free(rng() % live.size());
    } else {
      const size_t n = rng() % 8 == 0 ? 1 + rng() % (12 * kMiB) : 1 + rng() % (200 * 1024);
      f.log.current = StreamId(rng() % 3);
      char* p = static_cast<char*>(f.alloc->allocate(n));
      const auto fill = static_cast<unsigned char>(step);
      std::memset(p, fill, n);
      for (const Live& l : live)
        ASSERT_TRUE(p + n <= l.p || l.p + l.n <= p) << "overlap";
      live.push_back({p, n, fill});
    }
    if (step % 50 == 0)
      for (FakeEvent* e : f.log.events)
        e->done = rng() % 2 == 0;
    int64_t raw = 0;
    for (auto& [p, n] : f.log.raw)
      raw += int64_t(n);
    ASSERT_EQ(f.alloc->stats().reserved_bytes, raw);
    ASSERT_EQ(f.alloc->stats().segments, int64_t(f.log.raw.size()));
  }
  while (!live.empty())
    check_and_free(live.size() - 1);
  const auto st = f.alloc->stats();
  EXPECT_GT(st.cache_flushes, 0) << "the run should exercise freeing the cache";
  EXPECT_LT(st.raw_allocations, 100) << "about 1500 allocations should mostly reuse the cache";
  EXPECT_EQ(f.alloc->stats().allocated_bytes, 0);
  f.alloc->empty_cache();
  EXPECT_TRUE(f.log.raw.empty());
  EXPECT_TRUE(f.log.events.empty());
}

}  // namespace

TEST(PinnedMemory, PinMemoryCopiesIntoThePinnedPoolOrSaysWhyItCannot) {
  using namespace tessera;
  const Tensor t = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_FALSE(t.is_pinned());
  if (pinned_allocator() == nullptr) {
    // No GPU here (or no CUDA in this build): nothing can pin, and pinning says so.
    tessera::testing::expect_error([&] { (void)t.pin_memory(); },
                                   {"nothing can pin host memory here", "a GPU"});
  }
  tessera::testing::CountingHostAllocator pool;
  Allocator* before = set_pinned_allocator(&pool);
  {
    const Tensor transposed = t.as_strided({3, 2}, {1, 3}, 0);
    const Tensor p = transposed.pin_memory();
    EXPECT_TRUE(p.is_pinned());
    EXPECT_TRUE(p.is_contiguous());
    EXPECT_EQ(pool.allocations, 1);
    EXPECT_EQ(p.to_vector<float>(), transposed.to_vector<float>());
    EXPECT_TRUE(p.pin_memory().is_same(p)) << "pinned already: itself";
    EXPECT_EQ(pool.allocations, 1);
    const Tensor e = empty({4}, TensorOptions(DType::Int64).pin_memory());
    EXPECT_TRUE(e.is_pinned());
    tessera::testing::expect_error(
        [] { (void)empty({4}, TensorOptions(DType::Float32, Device::cuda(0)).pin_memory()); },
        {"pinned memory is host memory", "cuda:0"});
  }
  set_pinned_allocator(before);
}
