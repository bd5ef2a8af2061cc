#include "kernels/allocator.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/detail/stream_pool.h"
#include "kernels/error.h"

namespace kernels {

namespace {
constexpr std::align_val_t kCpuAlignment{64};
}  // namespace

void* system_allocate(size_t nbytes, Device device) {
  if (device.is_cuda()) return detail::cuda_malloc(nbytes, device.index);
  // Round up so the block is a whole number of cache lines (aligned_alloc's rule, kept here too).
  const size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = ::operator new(rounded, kCpuAlignment, std::nothrow);
  if (p == nullptr) throw ResourceError("cannot allocate " + std::to_string(nbytes) + " bytes on cpu: out of memory");
  return p;
}

void system_deallocate(void* p, size_t, Device device) noexcept {
  if (p == nullptr) return;
  if (device.is_cuda()) detail::cuda_free(p, device.index);
  else ::operator delete(p, kCpuAlignment);
}

namespace {

// MemAvailable of /proc/meminfo in bytes, or -1 (no /proc, or a kernel older than 3.14).
int64_t proc_mem_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t bytes = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    long long kib = 0;
    if (std::strncmp(line, "MemAvailable:", 13) == 0 && std::sscanf(line + 13, "%lld", &kib) == 1 && kib >= 0) {
      bytes = kib > std::numeric_limits<int64_t>::max() / 1024 ? std::numeric_limits<int64_t>::max()
                                                                : static_cast<int64_t>(kib) * 1024;
      break;
    }
  }
  std::fclose(f);
  return bytes;
}

}  // namespace

int64_t machine_available_bytes(Device device) {
  if (device.is_cuda()) return detail::cuda_available_bytes(device.index);
  if (const int64_t b = proc_mem_available(); b >= 0) return b;
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages < 0 || page <= 0) return -1;
  return static_cast<int64_t>(pages) > std::numeric_limits<int64_t>::max() / page
             ? std::numeric_limits<int64_t>::max()
             : static_cast<int64_t>(pages) * page;
}

int64_t Allocator::available_bytes(Device device) const { return machine_available_bytes(device); }

struct CachingAllocator::CudaPool {
  std::unique_ptr<detail::EventOps> events;  // declared first: outlives the pool
  std::unique_ptr<detail::StreamBlockPool> pool;
};

CachingAllocator::CachingAllocator() : CachingAllocator(Options{}) {}
CachingAllocator::CachingAllocator(Options options) : options_(options) {}
CachingAllocator::~CachingAllocator() { release_cached(); }

CachingAllocator::CudaPool& CachingAllocator::cuda_pool_locked(int device) {
  std::unique_ptr<CudaPool>& slot = cuda_[device];
  if (!slot) {
    auto p = std::make_unique<CudaPool>();
    p->events = detail::cuda_event_ops(device);
    p->pool = std::make_unique<detail::StreamBlockPool>(
        *p->events, detail::StreamBlockPool::Options{.small_limit = options_.min_block,
                                                     .max_small_bytes = options_.max_small_cached_bytes,
                                                     .max_cached_bytes = options_.max_cached_bytes});
    slot = std::move(p);
  }
  return *slot;
}

void* CachingAllocator::allocate_on(size_t nbytes, const Stream& stream) {
  const Device device = stream.device();
  if (!device.is_cuda()) return allocate(nbytes, device);
  const size_t size = block_size(nbytes);
  bool make_room = false;
  {
    std::lock_guard lk(mu_);
    detail::StreamBlockPool& pool = *cuda_pool_locked(device.index).pool;
    reserve_locked(size, device, nbytes);  // throws past the limit
    const size_t before = pool.stats().cached_bytes;
    if (void* p = pool.take(size, stream.id())) {
      stats_.cached_bytes -= before - pool.stats().cached_bytes;
      ++stats_.hits;
      return p;
    }
    ++stats_.misses;
    make_room = options_.limit_bytes > 0 && stats_.in_use_bytes + stats_.cached_bytes > options_.limit_bytes;
  }
  if (make_room) release_cached();
  try {
    try {
      return system_allocate(size, device);
    } catch (const Error&) {
      release_cached();  // out of memory: give the cache back and try once more
      return system_allocate(size, device);
    }
  } catch (...) {
    std::lock_guard lk(mu_);
    in_use_locked(device) -= size;
    stats_.in_use_bytes -= size;
    throw;
  }
}

void CachingAllocator::deallocate_on(void* p, size_t nbytes, const Stream& stream,
                                     std::span<const Stream> also_used_on) noexcept {
  if (p == nullptr) return;
  const Device device = stream.device();
  if (!device.is_cuda()) return deallocate(p, nbytes, device);
  const size_t size = block_size(nbytes);
  std::vector<detail::StreamBlockPool::Block> to_free;
  {
    std::lock_guard lk(mu_);
    in_use_locked(device) -= size;
    stats_.in_use_bytes -= size;
    try {
      detail::StreamBlockPool& pool = *cuda_pool_locked(device.index).pool;
      std::vector<detail::StreamId> others;
      for (const Stream& s : also_used_on)
        if (s.device() == device) others.push_back(s.id());
      const size_t before = pool.stats().cached_bytes;
      to_free = pool.give({p, size}, stream.id(), others);
      stats_.cached_bytes = stats_.cached_bytes + pool.stats().cached_bytes - before;
    } catch (...) {  // no event or no room for the entry: the block goes back (cudaFree waits)
      to_free = {{p, size}};
    }
  }
  for (const auto& b : to_free) system_deallocate(b.ptr, b.size, device);
}

int64_t CachingAllocator::available_bytes(Device device) const {
  size_t in_use = 0, cached = 0;
  {
    std::lock_guard lk(mu_);
    const auto it = in_use_.find({static_cast<int>(device.type), device.index});
    if (it != in_use_.end()) in_use = it->second;
    cached = stats_.cached_bytes;
  }
  if (options_.limit_bytes > 0)
    return in_use >= options_.limit_bytes ? 0 : static_cast<int64_t>(options_.limit_bytes - in_use);
  const int64_t machine = machine_available_bytes(device);
  if (machine < 0) return -1;
  const auto extra = static_cast<int64_t>(std::min<size_t>(cached, std::numeric_limits<int64_t>::max() / 2));
  return machine > std::numeric_limits<int64_t>::max() - extra ? std::numeric_limits<int64_t>::max() : machine + extra;
}

void CachingAllocator::reserve_locked(size_t size, Device device, size_t requested) {
  size_t& in_use = in_use_locked(device);
  if (options_.limit_bytes > 0 && (size > options_.limit_bytes || in_use > options_.limit_bytes - size))
    throw ResourceError("cannot allocate " + std::to_string(requested) + " bytes on " + to_string(device) +
                        ": the allocator's limit is " + std::to_string(options_.limit_bytes) + " bytes and " +
                        std::to_string(in_use) + " are in use");
  in_use += size;
  stats_.in_use_bytes += size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
}

size_t CachingAllocator::rounded_size(size_t nbytes) {
  if (nbytes == 0) return 0;
  const size_t step = std::max<size_t>(std::bit_floor(nbytes) / 8, 64);
  return (nbytes + step - 1) / step * step;
}

// Small classes in order: 64, 128, ..., 448 (multiples of 64 below 512), then from 512 up eight
// per power of two b: b, b + b/8, ..., b + 7b/8.
int CachingAllocator::small_class(size_t size, Device device) const {
  if (!device.is_cpu() || size == 0 || size >= options_.min_block || options_.max_small_cached_bytes == 0) return -1;
  if (size < 512) return static_cast<int>(size / 64) - 1;
  const size_t b = std::bit_floor(size);
  return 7 + (std::countr_zero(b) - 9) * 8 + static_cast<int>((size - b) / (b / 8));
}

void* CachingAllocator::allocate(size_t nbytes, Device device) {
  if (device.is_cuda()) {
    detail::cuda_check_device(device.index);  // the usual refusal without CUDA or that GPU
    return allocate_on(nbytes, Stream::compute(device));
  }
  const size_t size = block_size(nbytes);
  bool make_room = false;
  const int cls = small_class(size, device);
  {
    std::lock_guard lk(mu_);
    reserve_locked(size, device, nbytes);  // throws past the limit
    if (cls >= 0) {
      if (static_cast<size_t>(cls) < small_.size() && !small_[cls].empty()) {
        void* p = small_[cls].back();
        small_[cls].pop_back();
        small_cached_bytes_ -= size;
        stats_.cached_bytes -= size;
        ++stats_.hits;
        return p;
      }
      ++stats_.misses;
    } else if (size >= options_.min_block) {
      auto it = free_.find(Key{static_cast<int>(device.type), device.index, size});
      if (it != free_.end()) {
        void* p = it->second.second;
        age_.erase(it->second.first);
        free_.erase(it);
        stats_.cached_bytes -= size;
        ++stats_.hits;
        return p;
      }
      ++stats_.misses;
    }
    // Under a limit, the blocks in use and the cached ones stay within it: the cache makes room.
    make_room = options_.limit_bytes > 0 && stats_.in_use_bytes + stats_.cached_bytes > options_.limit_bytes;
  }
  if (make_room) release_cached();
  try {
    try {
      return system_allocate(size, device);
    } catch (const Error&) {
      if (size < options_.min_block) throw;
      release_cached();  // out of memory: give the cache back and try once more
      return system_allocate(size, device);
    }
  } catch (...) {
    std::lock_guard lk(mu_);
    in_use_locked(device) -= size;
    stats_.in_use_bytes -= size;
    throw;
  }
}

void CachingAllocator::evict_oldest_locked(std::vector<std::pair<Key, void*>>& out) {
  const auto oldest = age_.begin();
  auto [lo, hi] = free_.equal_range(oldest->second);
  for (auto it = lo; it != hi; ++it)
    if (it->second.first == oldest->first) {
      out.emplace_back(it->first, it->second.second);
      stats_.cached_bytes -= std::get<2>(it->first);
      free_.erase(it);
      break;
    }
  age_.erase(oldest);
}

void CachingAllocator::deallocate(void* p, size_t nbytes, Device device) noexcept {
  if (p == nullptr) return;
  if (device.is_cuda()) {
    Stream compute;
    try {
      compute = Stream::compute(device);
    } catch (...) {  // cannot happen for a block this device gave; give it back uncached
      system_deallocate(p, block_size(nbytes), device);
      return;
    }
    return deallocate_on(p, nbytes, compute);
  }
  const size_t size = block_size(nbytes);
  std::vector<std::pair<Key, void*>> evicted;
  bool cached = false;
  const int cls = small_class(size, device);
  {
    std::lock_guard lk(mu_);
    in_use_locked(device) -= size;
    stats_.in_use_bytes -= size;
    if (cls >= 0 && small_cached_bytes_ + size <= options_.max_small_cached_bytes) {
      try {
        if (small_.size() <= static_cast<size_t>(cls)) small_.resize(static_cast<size_t>(cls) + 1);
        small_[cls].push_back(p);
        small_cached_bytes_ += size;
        stats_.cached_bytes += size;
        return;
      } catch (const std::bad_alloc&) {  // no room for the list entry: the block goes back
      }
    }
  }
  if (size >= options_.min_block && size <= options_.max_cached_bytes) {
    std::lock_guard lk(mu_);
    // Recently freed sizes are the likeliest to come back: make room by giving back the oldest.
    while (stats_.cached_bytes + size > options_.max_cached_bytes && !age_.empty()) evict_oldest_locked(evicted);
    const Key key{static_cast<int>(device.type), device.index, size};
    free_.emplace(key, std::pair{clock_, p});
    age_.emplace(clock_++, key);
    stats_.cached_bytes += size;
    cached = true;
  }
  for (const auto& [key, q] : evicted)
    system_deallocate(q, std::get<2>(key), Device{static_cast<DeviceType>(std::get<0>(key)), std::get<1>(key)});
  if (!cached) system_deallocate(p, size, device);
}

void CachingAllocator::release_cached() {
  std::multimap<Key, std::pair<uint64_t, void*>> blocks;
  std::vector<std::vector<void*>> small;
  std::vector<std::pair<int, detail::StreamBlockPool::Block>> cuda_blocks;
  {
    std::lock_guard lk(mu_);
    for (auto& [device, pool] : cuda_)
      for (const auto& b : pool->pool->drain()) cuda_blocks.emplace_back(device, b);
    blocks.swap(free_);
    small.swap(small_);
    age_.clear();
    stats_.cached_bytes = 0;
    small_cached_bytes_ = 0;
  }
  for (const auto& [key, entry] : blocks)
    system_deallocate(entry.second, std::get<2>(key),
                      Device{static_cast<DeviceType>(std::get<0>(key)), std::get<1>(key)});
  // cudaFree waits for the device, so blocks still used by queued work are freed safely.
  for (const auto& [device, b] : cuda_blocks) system_deallocate(b.ptr, b.size, Device::cuda(device));
  // Small lists hold CPU blocks only, which system_deallocate frees without their size.
  for (const std::vector<void*>& list : small)
    for (void* q : list) system_deallocate(q, 0, Device::cpu());
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lk(mu_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
}

}  // namespace kernels
