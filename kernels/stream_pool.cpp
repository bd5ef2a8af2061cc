#include "kernels/detail/stream_pool.h"

#include <algorithm>

namespace kernels::detail {

StreamBlockPool::~StreamBlockPool() {
  for (auto& [size, e] : free_) release_events(e);
}

void StreamBlockPool::release_events(Entry& e) noexcept {
  for (const auto& [s, ev] : e.events) events_.release(ev);
  stats_.pending_events -= static_cast<int64_t>(e.events.size());
  e.events.clear();
}

bool StreamBlockPool::ready(const Entry& e, StreamId stream) {
  return std::all_of(e.events.begin(), e.events.end(),
                     [&](const auto& se) { return se.first == stream || events_.done(se.second); });
}

void* StreamBlockPool::take(size_t size, StreamId stream) {
  auto [lo, hi] = free_.equal_range(size);
  if (lo == hi) return nullptr;
  // Prefer a block last freed on this stream (no wait at all), else any whose events completed.
  auto pick = hi;
  for (auto it = lo; it != hi && pick == hi; ++it) {
    const auto& ev = it->second.events;
    if (std::all_of(ev.begin(), ev.end(), [&](const auto& se) { return se.first == stream; })) pick = it;
  }
  for (auto it = lo; it != hi && pick == hi; ++it)
    if (ready(it->second, stream)) pick = it;
  if (pick == hi) {
    ++stats_.waited;
    return nullptr;
  }
  void* p = pick->second.ptr;
  release_events(pick->second);
  (size < options_.small_limit ? small_bytes_ : large_bytes_) -= size;
  free_.erase(pick);
  ++stats_.reused;
  return p;
}

std::vector<StreamBlockPool::Block> StreamBlockPool::give(Block block, StreamId stream,
                                                          std::span<const StreamId> also_used_on) {
  std::vector<Block> to_free;
  const bool small = block.size < options_.small_limit;
  if (small ? small_bytes_ + block.size > options_.max_small_bytes : block.size > options_.max_cached_bytes) {
    to_free.push_back(block);
    return to_free;
  }
  Entry e{block.ptr, clock_++, {}};
  e.events.emplace_back(stream, events_.record(stream));
  for (StreamId s : also_used_on)
    if (std::none_of(e.events.begin(), e.events.end(), [&](const auto& se) { return se.first == s; }))
      e.events.emplace_back(s, events_.record(s));
  stats_.pending_events += static_cast<int64_t>(e.events.size());
  free_.emplace(block.size, std::move(e));
  (small ? small_bytes_ : large_bytes_) += block.size;
  while (large_bytes_ > options_.max_cached_bytes) {  // evict the oldest large block
    auto oldest = free_.end();
    for (auto it = free_.lower_bound(options_.small_limit); it != free_.end(); ++it)
      if (oldest == free_.end() || it->second.age < oldest->second.age) oldest = it;
    release_events(oldest->second);
    large_bytes_ -= oldest->first;
    to_free.push_back({oldest->second.ptr, oldest->first});
    free_.erase(oldest);
  }
  return to_free;
}

std::vector<StreamBlockPool::Block> StreamBlockPool::drain() {
  std::vector<Block> out;
  for (auto& [size, e] : free_) {
    release_events(e);
    out.push_back({e.ptr, size});
  }
  free_.clear();
  small_bytes_ = large_bytes_ = 0;
  return out;
}

StreamBlockPool::Stats StreamBlockPool::stats() const {
  Stats s = stats_;
  s.cached_bytes = small_bytes_ + large_bytes_;
  return s;
}

}  // namespace kernels::detail
