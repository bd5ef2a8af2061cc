#include "kernels/allocator.h"

#include <bit>
#include <new>
#include <string>

#include "kernels/cuda/cuda_ops.h"
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

CachingAllocator::~CachingAllocator() { release_cached(); }

size_t CachingAllocator::block_size(size_t nbytes) const {
  if (nbytes < options_.min_block) return nbytes;
  const size_t step = std::max<size_t>(std::bit_floor(nbytes) / 8, 64);
  return (nbytes + step - 1) / step * step;
}

void* CachingAllocator::allocate(size_t nbytes, Device device) {
  const size_t size = block_size(nbytes);
  if (size < options_.min_block) return system_allocate(size, device);
  {
    std::lock_guard lk(mu_);
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
  try {
    return system_allocate(size, device);
  } catch (const Error&) {
    release_cached();  // out of memory: give the cache back and try once more
    return system_allocate(size, device);
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
  const size_t size = block_size(nbytes);
  std::vector<std::pair<Key, void*>> evicted;
  bool cached = false;
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
  {
    std::lock_guard lk(mu_);
    blocks.swap(free_);
    age_.clear();
    stats_.cached_bytes = 0;
  }
  for (const auto& [key, entry] : blocks)
    system_deallocate(entry.second, std::get<2>(key),
                      Device{static_cast<DeviceType>(std::get<0>(key)), std::get<1>(key)});
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

}  // namespace kernels
