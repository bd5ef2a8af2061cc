// Allocators for Storage. The default (no allocator) takes every block from the system and gives
// it back on free. A CachingAllocator keeps freed blocks and hands them out again, so a loop that
// allocates the same sizes every iteration (redistribute outputs, exchange buffers, FSDP's
// unsharded parameters) stops paying for fresh pages: on Linux a block above glibc's mmap
// threshold (at most 32 MiB) is new memory on every malloc, and touching it page-faults and
// zeroes every 4 KiB page (measured: 3-7x the time of the copy into it). Small CPU blocks (below
// `min_block`) are kept too, in a free list per size class: a 64-byte aligned malloc and free
// cost about as much as the rest of a cached redistribute of a tiny tensor.
//
//   auto cache = std::make_shared<CachingAllocator>();
//   Tensor a = Tensor::empty({1 << 24}, DType::kF32, Device::cpu(), cache);
//   a = Tensor();                                           // the block returns to the cache
//   Tensor b = Tensor::empty({1 << 24}, DType::kF32, Device::cpu(), cache);  // same block
//
// A Storage keeps its allocator alive (shared_ptr), so tensors may outlive whoever made the cache.
//
// NOTE [memory limit] Every allocator reports the bytes it can still hand out (available_bytes),
// which the executor compares with what a transition needs before allocating any of its buffers
// (dtensor/exec/memory_check.h), so a redistribute too large for the machine fails with a
// ResourceError naming both numbers instead of being OOM-killed halfway. By default that is the
// machine's figure: MemAvailable of /proc/meminfo on the CPU (sysconf's free pages where there is
// no /proc), cudaMemGetInfo's free bytes on a GPU (unknown, -1, in a build without CUDA: no
// check). A CachingAllocator may be given a limit instead:
//
//   CachingAllocator::Options o;
//   o.limit_bytes = size_t{4} << 30;                        // 4 GiB for what this cache serves
//   auto cache = std::make_shared<CachingAllocator>(o);
//   cache->available_bytes(Device::cpu());                   // 4 GiB minus the blocks in use
//
// and then refuses (ResourceError) any allocation that would take its blocks in use past it.
// Thread-safe. Blocks are cached per device. CUDA blocks, small ones included, are stream-aware
// (NOTE [stream-aware reuse] in kernels/detail/stream_pool.h): allocate / deallocate use the
// device's compute stream, where the kernels run (kernels/stream.h); allocate_on / deallocate_on
// name another stream. A block freed on one stream is handed out on another only once an event
// recorded on the freeing stream (and on the other streams it was used on) has completed.
//
//   Stream side = Stream::create(Device::cuda(0));
//   void* p = cache->allocate_on(1 << 20, side);   // used by work queued on `side`
//   cache->deallocate_on(p, 1 << 20, side);        // reused on `side` at once, on the compute
//                                                  // stream once `side` has passed this point
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/device.h"
#include "kernels/stream.h"

namespace kernels {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // A block of at least nbytes (nbytes > 0), 64-byte aligned on the CPU. Throws Error when out
  // of memory.
  virtual void* allocate(size_t nbytes, Device device) = 0;
  // Returns a block from allocate() with the same nbytes and device.
  virtual void deallocate(void* p, size_t nbytes, Device device) noexcept = 0;
  // The bytes allocate() can still hand out on `device` (NOTE [memory limit]), or -1 when
  // unknown. Default: the machine's figure (machine_available_bytes). Cheap enough to call per
  // transition only for allocators with a limit: the machine's figure reads /proc (microseconds).
  virtual int64_t available_bytes(Device device) const;
  // The configured limit on the bytes in use (0: none, the machine's memory is the limit).
  virtual int64_t limit_bytes() const { return 0; }
};

// The memory the machine can still give on `device` now: MemAvailable from /proc/meminfo for the
// CPU (fallback: free physical pages from sysconf), cudaMemGetInfo's free bytes for a CUDA
// device; -1 when unknown (no CUDA in this build, no GPU, nothing readable).
int64_t machine_available_bytes(Device device);

// The system allocator (what a Storage without an allocator uses).
void* system_allocate(size_t nbytes, Device device);
void system_deallocate(void* p, size_t nbytes, Device device) noexcept;

class CachingAllocator final : public Allocator {
 public:
  struct Options {
    size_t max_cached_bytes = size_t{1} << 30;  // free blocks kept; beyond it the oldest go back
    size_t min_block = size_t{256} << 10;       // smaller blocks: the per-class lists below
    // Free CPU blocks below min_block kept in per-class lists (never evicted by age: past this
    // many bytes a freed small block goes back to the system). 0: small blocks bypass the cache.
    // Other devices' small blocks always bypass it.
    size_t max_small_cached_bytes = size_t{16} << 20;
    // The most bytes in use (handed out and not yet freed) per device; an allocation past it
    // throws ResourceError naming the request, the limit and what is in use. Cached free blocks
    // do not count (they are given back to make room). 0: no limit but the machine's.
    size_t limit_bytes = 0;
  };
  struct Stats {
    size_t cached_bytes = 0;  // free blocks held now (small ones included)
    int64_t hits = 0;         // allocations served from the cache
    int64_t misses = 0;       // allocations of cacheable size that went to the system
    size_t in_use_bytes = 0;  // blocks handed out and not freed, every device (block sizes)
    size_t peak_in_use_bytes = 0;  // the most in_use_bytes since creation or reset_peak()
  };

  CachingAllocator();
  explicit CachingAllocator(Options options);
  ~CachingAllocator() override;  // gives every cached block back
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(size_t nbytes, Device device) override;
  void deallocate(void* p, size_t nbytes, Device device) noexcept override;
  // On `stream`'s device, for work queued on `stream` (CPU: allocate / deallocate). A block
  // given back is reusable on `stream` at once and elsewhere after the events above;
  // `also_used_on` names the other streams that used it.
  void* allocate_on(size_t nbytes, const Stream& stream);
  void deallocate_on(void* p, size_t nbytes, const Stream& stream,
                     std::span<const Stream> also_used_on = {}) noexcept;

  // With a limit: the limit minus the bytes in use on `device` (cached free blocks are
  // available). Without: the machine's available bytes plus the cached free blocks (-1 unknown).
  int64_t available_bytes(Device device) const override;
  int64_t limit_bytes() const override { return static_cast<int64_t>(options_.limit_bytes); }

  // Gives every cached free block back to the system (PyTorch's empty_cache).
  void release_cached();
  Stats stats() const;
  // peak_in_use_bytes = in_use_bytes now (a trainer measures one phase's peak).
  void reset_peak();

  // The size a request is served with: nbytes rounded up to an eighth of its power of two
  // (at most 12.5% more from 512 bytes up; the step is at least 64 bytes, so below 512 bytes a
  // multiple of 64), so nearby sizes share blocks. 0 stays 0. The same for every instance
  // (rounded_size), so a planner can count what a limit will see:
  //   rounded_size(1000) == 1024, rounded_size(100) == 128, rounded_size(1 << 20) == 1 << 20
  size_t block_size(size_t nbytes) const { return rounded_size(nbytes); }
  static size_t rounded_size(size_t nbytes);

 private:
  using Key = std::tuple<int, int, size_t>;  // device type, device index, block size
  void evict_oldest_locked(std::vector<std::pair<Key, void*>>& out);
  // The free list of a small CPU block size (a block_size below min_block), or -1 when such
  // blocks are not cached.
  int small_class(size_t size, Device device) const;
  // Counts size bytes in use on device, refusing past the limit (REQUIRES: mu_ held).
  void reserve_locked(size_t size, Device device, size_t requested);
  size_t& in_use_locked(Device device) { return in_use_[{static_cast<int>(device.type), device.index}]; }

  Options options_;
  mutable std::mutex mu_;
  std::multimap<Key, std::pair<uint64_t, void*>> free_;  // block -> (when it was freed, pointer)
  std::map<uint64_t, Key> age_;                           // oldest free block first
  uint64_t clock_ = 0;
  Stats stats_;
  std::map<std::pair<int, int>, size_t> in_use_;  // (device type, index) -> bytes handed out
  std::vector<std::vector<void*>> small_;          // per small_class: free CPU blocks
  size_t small_cached_bytes_ = 0;
  // Per CUDA device index: its stream-aware pool, created on first use (kernels/detail/stream_pool.h).
  struct CudaPool;
  std::map<int, std::unique_ptr<CudaPool>> cuda_;
  CudaPool& cuda_pool_locked(int device);
};

}  // namespace kernels
