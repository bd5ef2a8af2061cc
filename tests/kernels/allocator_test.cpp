// Allocators (kernels/allocator.h): CachingAllocator's size classes, hits and misses, the cap on
// cached bytes, release_cached, alignment, thread safety; Storage and Tensor::empty through an
// allocator (the storage keeps it alive; free / reallocate / resize go through it); a limit on the
// bytes in use (NOTE [memory limit]) and the bytes available.
#include "kernels/allocator.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/error.h"
#include "kernels/storage.h"
#include "kernels/tensor.h"

using namespace kernels;

namespace {

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;

bool aligned64(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// An Allocator that records what goes through it (and takes its blocks from the system).
class RecordingAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device device) override {
    sizes.push_back(nbytes);
    ++allocations;
    return system_allocate(nbytes, device);
  }
  void deallocate(void* p, size_t nbytes, Device device) noexcept override {
    freed_sizes.push_back(nbytes);
    ++deallocations;
    system_deallocate(p, nbytes, device);
  }
  int allocations = 0, deallocations = 0;
  std::vector<size_t> sizes, freed_sizes;
};

}  // namespace

TEST_CASE("caching allocator: block sizes round up to an eighth of the power of two", "[kernels][allocator]") {
  CachingAllocator cache;  // min_block 256 KiB
  // Below 512 bytes: multiples of 64; from there the same eighths as above min_block.
  CHECK(cache.block_size(0) == 0);
  CHECK(cache.block_size(1) == 64);
  CHECK(cache.block_size(63) == 64);
  CHECK(cache.block_size(64) == 64);
  CHECK(cache.block_size(100) == 128);
  CHECK(cache.block_size(449) == 512);
  CHECK(cache.block_size(513) == 576);
  CHECK(cache.block_size(4 * KiB + 1) == 4 * KiB + 512);
  CHECK(cache.block_size(256 * KiB - 1) == 256 * KiB);
  CHECK(cache.block_size(256 * KiB) == 256 * KiB);
  CHECK(cache.block_size(256 * KiB + 1) == 256 * KiB + 32 * KiB);
  CHECK(cache.block_size(MiB) == MiB);
  CHECK(cache.block_size(MiB + 1) == MiB + 128 * KiB);
  CHECK(cache.block_size(MiB + 128 * KiB) == MiB + 128 * KiB);
  CHECK(cache.block_size(MiB + 128 * KiB + 1) == MiB + 256 * KiB);
  CHECK(cache.block_size(2 * MiB - 1) == 2 * MiB);
  CHECK(cache.block_size(3 * MiB + 7) == 3 * MiB + 256 * KiB);
  CHECK(cache.block_size(96 * MiB) == 96 * MiB);
  CHECK(cache.block_size(96 * MiB + 1) == 104 * MiB);  // steps of 8 MiB between 64 and 128 MiB
  CHECK(cache.block_size(100 * MiB) == 104 * MiB);
  // Never more than 12.5% above the request from 512 bytes up, never below it.
  for (size_t n = 512; n < 64 * MiB; n = n * 5 / 4 + 97) {
    INFO(n);
    CHECK(cache.block_size(n) >= n);
    CHECK(cache.block_size(n) <= n + n / 8);
    CHECK(cache.block_size(cache.block_size(n)) == cache.block_size(n));  // a class is a fixed point
  }
  CachingAllocator small({.max_cached_bytes = MiB, .min_block = 1000});
  CHECK(small.block_size(999) == 1024);
  CHECK(small.block_size(1000) == 1024);  // step 64 below 1 KiB
  CHECK(small.block_size(1025) == 1152);
}

TEST_CASE("caching allocator: a freed block is handed out again; sizes of one class share it",
          "[kernels][allocator]") {
  CachingAllocator cache;
  const Device cpu = Device::cpu();
  void* p = cache.allocate(MiB, cpu);
  REQUIRE(p != nullptr);
  CHECK(cache.stats().misses == 1);
  CHECK(cache.stats().hits == 0);
  CHECK(cache.stats().cached_bytes == 0);
  std::memset(p, 0x5a, MiB);  // the whole block is usable
  cache.deallocate(p, MiB, cpu);
  CHECK(cache.stats().cached_bytes == MiB);
  void* q = cache.allocate(MiB, cpu);
  CHECK(q == p);
  CHECK(cache.stats().hits == 1);
  CHECK(cache.stats().misses == 1);
  CHECK(cache.stats().cached_bytes == 0);
  cache.deallocate(q, MiB, cpu);

  // 1 MiB + 1 and 1 MiB + 100 KiB are both served with 1 MiB + 128 KiB.
  void* a = cache.allocate(MiB + 1, cpu);
  CHECK(a != p);  // another class: a miss
  CHECK(cache.stats().misses == 2);
  std::memset(a, 1, MiB + 128 * KiB);  // the rounded size is usable
  cache.deallocate(a, MiB + 1, cpu);
  CHECK(cache.stats().cached_bytes == MiB + MiB + 128 * KiB);
  void* b = cache.allocate(MiB + 100 * KiB, cpu);
  CHECK(b == a);
  CHECK(cache.stats().hits == 2);
  cache.deallocate(b, MiB + 100 * KiB, cpu);

  // Two live blocks of one class: the second is a miss, and both are cached when freed.
  void* c1 = cache.allocate(MiB, cpu);  // the cached one
  void* c2 = cache.allocate(MiB, cpu);
  CHECK(c1 == p);
  CHECK(c2 != c1);
  CHECK(cache.stats().hits == 3);
  CHECK(cache.stats().misses == 3);
  cache.deallocate(c1, MiB, cpu);
  cache.deallocate(c2, MiB, cpu);
  CHECK(cache.stats().cached_bytes == 2 * MiB + MiB + 128 * KiB);

  // Small requests (below min_block) are cached too, in a list per class: 1000 and 1020 bytes
  // are both 1 KiB blocks.
  void* s = cache.allocate(1000, cpu);
  CHECK(cache.stats().misses == 4);
  std::memset(s, 3, KiB);
  cache.deallocate(s, 1000, cpu);
  CHECK(cache.stats().cached_bytes == 2 * MiB + MiB + 128 * KiB + KiB);
  void* s2 = cache.allocate(1020, cpu);
  CHECK(s2 == s);
  void* s3 = cache.allocate(1000, cpu);  // the list is empty: a miss
  CHECK(s3 != s2);
  CHECK(cache.stats().hits == 4);
  CHECK(cache.stats().misses == 5);
  void* t = cache.allocate(100, cpu);  // another class (128 bytes)
  CHECK(cache.stats().misses == 6);
  cache.deallocate(s2, 1020, cpu);
  cache.deallocate(s3, 1000, cpu);
  cache.deallocate(t, 100, cpu);
  CHECK(cache.stats().cached_bytes == 2 * MiB + MiB + 128 * KiB + 2 * KiB + 128);
  void* t2 = cache.allocate(128, cpu);
  CHECK(t2 == t);
  CHECK(cache.stats().hits == 5);
  cache.deallocate(t2, 128, cpu);
  cache.release_cached();
  CHECK(cache.stats().cached_bytes == 0);
  CHECK(cache.stats().in_use_bytes == 0);
}

TEST_CASE("caching allocator: small blocks are cached up to max_small_cached_bytes, CPU only",
          "[kernels][allocator]") {
  CachingAllocator cache({.max_cached_bytes = MiB, .min_block = 64 * KiB, .max_small_cached_bytes = 8 * KiB});
  const Device cpu = Device::cpu();
  std::vector<void*> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(cache.allocate(2 * KiB, cpu));
  for (void* p : blocks) cache.deallocate(p, 2 * KiB, cpu);
  CHECK(cache.stats().cached_bytes == 8 * KiB);  // four kept, the fifth went back
  blocks.clear();
  for (int i = 0; i < 5; ++i) blocks.push_back(cache.allocate(2 * KiB, cpu));
  CHECK(cache.stats().hits == 4);
  CHECK(cache.stats().misses == 6);
  for (void* p : blocks) CHECK(aligned64(p));
  for (void* p : blocks) cache.deallocate(p, 2 * KiB, cpu);
  // Every class from 64 bytes to just below min_block round-trips through its own list.
  CachingAllocator lists({.min_block = 64 * KiB});
  int classes = 0;
  for (size_t n = 1; lists.block_size(n) < 64 * KiB; n = lists.block_size(n) + 1) {
    void* p = lists.allocate(n, cpu);
    std::memset(p, 1, lists.block_size(n));
    lists.deallocate(p, n, cpu);
    CHECK(lists.allocate(lists.block_size(n), cpu) == p);
    lists.deallocate(p, lists.block_size(n), cpu);
    ++classes;
  }
  CHECK(lists.stats().hits == classes);
  CHECK(lists.stats().misses == classes);
  CHECK(classes == 7 + 7 * 8);  // 64..448, then eight per power of two from 512 to 32 KiB
  // No small cache: every small request goes to the system.
  CachingAllocator none({.max_small_cached_bytes = 0});
  none.deallocate(none.allocate(100, cpu), 100, cpu);
  none.deallocate(none.allocate(100, cpu), 100, cpu);
  CHECK(none.stats().hits == 0);
  CHECK(none.stats().misses == 0);
  CHECK(none.stats().cached_bytes == 0);
}

TEST_CASE("caching allocator: max_cached_bytes caps the cache; release_cached empties it",
          "[kernels][allocator]") {
  CachingAllocator cache({.max_cached_bytes = 2 * MiB + 512 * KiB, .min_block = 256 * KiB});
  const Device cpu = Device::cpu();
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(cache.allocate(MiB, cpu));
  CHECK(cache.stats().misses == 4);
  for (void* p : blocks) {
    cache.deallocate(p, MiB, cpu);
    CHECK(cache.stats().cached_bytes <= 2 * MiB + 512 * KiB);
  }
  CHECK(cache.stats().cached_bytes == 2 * MiB);  // two blocks kept, two went back
  // A smaller block still fits under the cap.
  void* small = cache.allocate(256 * KiB, cpu);
  CHECK(cache.stats().misses == 5);
  cache.deallocate(small, 256 * KiB, cpu);
  CHECK(cache.stats().cached_bytes == 2 * MiB + 256 * KiB);
  // Four again: two hits (the cached blocks), two misses.
  blocks.clear();
  for (int i = 0; i < 4; ++i) blocks.push_back(cache.allocate(MiB, cpu));
  CHECK(cache.stats().hits == 2);
  CHECK(cache.stats().misses == 7);
  CHECK(cache.stats().cached_bytes == 256 * KiB);
  for (void* p : blocks) cache.deallocate(p, MiB, cpu);
  // Over the cap the oldest free blocks go back first (the 256 KiB one, then the first 1 MiB),
  // so the two most recently freed 1 MiB blocks stay.
  CHECK(cache.stats().cached_bytes == 2 * MiB);

  cache.release_cached();
  CHECK(cache.stats().cached_bytes == 0);
  CHECK(cache.stats().hits == 2);  // the counters are kept
  void* again = cache.allocate(MiB, cpu);
  CHECK(cache.stats().misses == 8);  // nothing left to hit
  CHECK(cache.stats().hits == 2);
  cache.deallocate(again, MiB, cpu);
  cache.release_cached();
  cache.release_cached();  // twice is harmless
  CHECK(cache.stats().cached_bytes == 0);

  // A zero cap caches nothing.
  CachingAllocator none({.max_cached_bytes = 0, .min_block = 256 * KiB});
  void* p = none.allocate(MiB, cpu);
  none.deallocate(p, MiB, cpu);
  CHECK(none.stats().cached_bytes == 0);
  none.deallocate(none.allocate(MiB, cpu), MiB, cpu);
  CHECK(none.stats().hits == 0);
  CHECK(none.stats().misses == 2);
}

TEST_CASE("caching allocator: blocks are 64-byte aligned, cached or not", "[kernels][allocator]") {
  auto cache = std::make_shared<CachingAllocator>();
  const Device cpu = Device::cpu();
  for (size_t n : {size_t{1}, size_t{3}, size_t{100}, 256 * KiB - 1, 256 * KiB, MiB + 1, 3 * MiB + 7}) {
    INFO(n);
    void* p = cache->allocate(n, cpu);
    CHECK(aligned64(p));
    cache->deallocate(p, n, cpu);
    void* q = cache->allocate(n, cpu);  // from the cache when cacheable
    CHECK(aligned64(q));
    cache->deallocate(q, n, cpu);
    void* s = system_allocate(n, cpu);
    CHECK(aligned64(s));
    system_deallocate(s, n, cpu);
  }
  system_deallocate(nullptr, 8, cpu);  // null is ignored
  cache->deallocate(nullptr, MiB, cpu);
  // 1 and 3 bytes share the 64-byte block, 100 bytes a 128-byte one; 256 KiB - 1 and 256 KiB one.
  CHECK(cache->stats().cached_bytes == 64 + 128 + 256 * KiB + MiB + 128 * KiB + 3 * MiB + 256 * KiB);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kU8, DType::kI64}) {
    Tensor t = Tensor::empty({513, 129}, dtype, cpu, cache);
    CHECK(aligned64(t.data_ptr()));
  }
}

TEST_CASE("storage through an allocator: free, reallocate and resize go through it", "[kernels][allocator][storage]") {
  auto rec = std::make_shared<RecordingAllocator>();
  {
    auto s = Storage::allocate(1000, Device::cpu(), rec);
    CHECK(rec->allocations == 1);
    CHECK(rec->sizes.back() == 1000);
    CHECK(aligned64(s->data()));
    s->free();
    CHECK_FALSE(s->allocated());
    CHECK(rec->deallocations == 1);
    CHECK(rec->freed_sizes.back() == 1000);
    s->free();  // twice: nothing more is given back
    CHECK(rec->deallocations == 1);
    s->reallocate();
    CHECK(rec->allocations == 2);
    s->reallocate();  // no-op when allocated
    CHECK(rec->allocations == 2);
    s->resize(64);
    CHECK(rec->deallocations == 2);
    CHECK(rec->freed_sizes.back() == 1000);
    CHECK(rec->allocations == 3);
    CHECK(rec->sizes.back() == 64);
    // Zero bytes never reach the allocator, but count as allocated.
    auto z = Storage::allocate(0, Device::cpu(), rec);
    CHECK(z->allocated());
    CHECK(z->data() == nullptr);
    z->free();
    z->reallocate();
    CHECK(rec->allocations == 3);
  }
  CHECK(rec->deallocations == 3);  // the 64-byte block, at destruction
  CHECK(rec->freed_sizes.back() == 64);
  CHECK(rec.use_count() == 1);  // the storages released the allocator

  // Through a cache: free() returns the block, reallocate() takes the same one back.
  auto cache = std::make_shared<CachingAllocator>();
  Tensor t = Tensor::empty({512, 512}, DType::kF32, Device::cpu(), cache);  // 1 MiB
  void* p = t.data_ptr();
  Tensor v = t.narrow(1, 3, 5);
  t.storage()->free();
  CHECK(cache->stats().cached_bytes == MiB);
  REQUIRE_THROWS_AS(v.data_ptr(), InvalidArgument);
  t.storage()->reallocate();
  CHECK(t.data_ptr() == p);
  CHECK(cache->stats().hits == 1);
  CHECK(cache->stats().misses == 1);
  t.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(i[0] * 3 + i[1] % 7); });
  CHECK(v.item({10, 2}) == 30 + 5);  // views work again after the reallocation
  t.storage()->resize(2 * MiB);  // the 1 MiB block goes back, a 2 MiB one is new
  CHECK(cache->stats().cached_bytes == MiB);
  CHECK(cache->stats().misses == 2);
}

TEST_CASE("a tensor from a cache outlives the last user reference to the cache", "[kernels][allocator]") {
  auto cache = std::make_shared<CachingAllocator>();
  std::weak_ptr<CachingAllocator> weak = cache;
  Tensor t = Tensor::empty({1 << 18}, DType::kF32, Device::cpu(), cache);  // 1 MiB
  Tensor view = t.narrow(0, 10, 100);
  Tensor small = Tensor::empty({3}, DType::kI64, Device::cpu(), cache);  // below min_block
  cache.reset();
  REQUIRE_FALSE(weak.expired());  // the storages keep it alive
  t.fill_(2.5);
  small.fill_(7);
  CHECK(view.item({99}) == 2.5);
  CHECK(small.item({2}) == 7);
  t = Tensor();
  REQUIRE_FALSE(weak.expired());  // view still holds the storage
  CHECK(weak.lock()->stats().cached_bytes == 0);
  view = Tensor();
  REQUIRE_FALSE(weak.expired());  // small still holds it
  CHECK(weak.lock()->stats().cached_bytes == MiB);  // the 1 MiB block went back to the cache
  small = Tensor();
  CHECK(weak.expired());  // the cache (and its cached block) are gone
}

TEST_CASE("caching allocator: concurrent allocate / free from several threads", "[kernels][allocator]") {
  constexpr size_t kCap = 16 * MiB;
  CachingAllocator cache({.max_cached_bytes = kCap, .min_block = 256 * KiB});
  constexpr int kThreads = 4, kIters = 300;
  const size_t sizes[] = {300 * KiB, MiB, MiB + 1, 1536 * KiB, 1000};
  std::atomic<int64_t> cacheable{0};
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<std::pair<void*, size_t>> live;
      for (int i = 0; i < kIters; ++i) {
        const size_t n = sizes[(i * 7 + t * 3) % 5];
        void* p = cache.allocate(n, Device::cpu());
        ++cacheable;  // every size is (small ones in their lists)
        // Stamp the block; if another thread were handed it too, its stamp would change.
        const auto stamp = static_cast<unsigned char>(t * 16 + i % 16);
        std::memset(p, stamp, 64);
        static_cast<unsigned char*>(p)[n - 1] = stamp;
        live.emplace_back(p, n);
        if (live.size() > 3 || i % 3 == 0) {  // keep a few blocks live, free the oldest
          auto [q, m] = live.front();
          const auto* bytes = static_cast<unsigned char*>(q);
          if (bytes[0] != bytes[63] || bytes[0] != bytes[m - 1]) ++corrupted;
          cache.deallocate(q, m, Device::cpu());
          live.erase(live.begin());
        }
      }
      for (auto [q, m] : live) cache.deallocate(q, m, Device::cpu());
    });
  for (auto& th : threads) th.join();
  const CachingAllocator::Stats s = cache.stats();
  CHECK(corrupted.load() == 0);
  CHECK(s.hits + s.misses == cacheable.load());
  CHECK(s.hits > 0);
  CHECK(s.cached_bytes > 0);
  CHECK(s.cached_bytes <= kCap + CachingAllocator::Options{}.max_small_cached_bytes);
  // Every block is free again: allocating each cached class back hits until the cache is empty.
  cache.release_cached();
  CHECK(cache.stats().cached_bytes == 0);
}

TEST_CASE("caching allocator: a freed block that does not fit evicts the oldest free blocks",
          "[kernels][allocator]") {
  constexpr size_t MiB = size_t{1} << 20;
  CachingAllocator cache({.max_cached_bytes = 3 * MiB, .min_block = 256 * 1024});
  const kernels::Device cpu = kernels::Device::cpu();
  void* a = cache.allocate(MiB, cpu);
  void* b = cache.allocate(MiB, cpu);
  void* c = cache.allocate(2 * MiB, cpu);
  cache.deallocate(a, MiB, cpu);      // oldest
  cache.deallocate(b, MiB, cpu);
  cache.deallocate(c, 2 * MiB, cpu);  // 4 MiB > 3 MiB: a goes back to the system
  CHECK(cache.stats().cached_bytes == 3 * MiB);
  const int64_t hits = cache.stats().hits;
  void* c2 = cache.allocate(2 * MiB, cpu);
  void* b2 = cache.allocate(MiB, cpu);
  CHECK(c2 == c);  // the newest sizes are served from the cache
  CHECK(b2 == b);
  CHECK(cache.stats().hits == hits + 2);
  void* a2 = cache.allocate(MiB, cpu);  // a was evicted: a miss
  CHECK(cache.stats().hits == hits + 2);
  CHECK(cache.stats().cached_bytes == 0);
  for (auto [p, n] : {std::pair{c2, 2 * MiB}, {b2, MiB}, {a2, MiB}}) system_deallocate(p, n, cpu);
  // A block larger than the cap is never cached and evicts nothing.
  void* d = cache.allocate(MiB, cpu);
  cache.deallocate(d, MiB, cpu);
  void* huge = cache.allocate(4 * MiB, cpu);
  cache.deallocate(huge, 4 * MiB, cpu);
  CHECK(cache.stats().cached_bytes == MiB);
}

TEST_CASE("caching allocator: a limit on the bytes in use refuses past it; available_bytes", "[kernels][allocator]") {
  CachingAllocator::Options o;
  o.limit_bytes = size_t{1} << 20;
  o.min_block = size_t{64} << 10;
  CachingAllocator a(o);
  const Device cpu{};
  CHECK(a.limit_bytes() == int64_t{1} << 20);
  CHECK(a.available_bytes(cpu) == int64_t{1} << 20);
  void* big = a.allocate(size_t{512} << 10, cpu);  // cacheable
  void* small = a.allocate(1000, cpu);             // below min_block: still counted (a 1 KiB block)
  CHECK(a.stats().in_use_bytes == (size_t{512} << 10) + 1024);
  CHECK(a.available_bytes(cpu) == (int64_t{512} << 10) - 1024);
  try {
    (void)a.allocate(size_t{600} << 10, cpu);
    FAIL("an allocation past the limit was served");
  } catch (const ResourceError& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::Contains(std::to_string(size_t{600} << 10)) && Catch::Contains("1048576") &&
                      Catch::Contains(std::to_string((size_t{512} << 10) + 1024)));
  }
  CHECK(a.stats().in_use_bytes == (size_t{512} << 10) + 1024);  // the refused request left no trace
  a.deallocate(big, size_t{512} << 10, cpu);
  CHECK(a.stats().cached_bytes == size_t{512} << 10);
  CHECK(a.available_bytes(cpu) == (int64_t{1} << 20) - 1024);  // cached blocks are available
  // The cache makes room: a different size past (in use + cached) fits once the cache is given back.
  void* other = a.allocate(size_t{768} << 10, cpu);
  CHECK(a.stats().cached_bytes == 0);
  CHECK(a.available_bytes(cpu) == (int64_t{256} << 10) - 1024);
  a.deallocate(other, size_t{768} << 10, cpu);
  a.deallocate(small, 1000, cpu);
  CHECK(a.stats().in_use_bytes == 0);
  CHECK(a.available_bytes(cpu) == int64_t{1} << 20);

  // Without a limit: the machine's figure (plus the cache), which this machine has.
  CachingAllocator unlimited;
  CHECK(unlimited.limit_bytes() == 0);
  CHECK(unlimited.available_bytes(cpu) > 0);
  CHECK(machine_available_bytes(cpu) > 0);
}
