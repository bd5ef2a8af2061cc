// TrackingAllocator: counts the bytes live through it (and their high-water mark) in front of
// another allocator (a CachingAllocator by default), so a trainer can report the peak memory of
// its tensors: give it to MeshComms, and parameters, op outputs and redistribute buffers of that
// mesh are allocated through it.
//
//   auto mem = std::make_shared<TrackingAllocator>();
//   auto comms = std::make_shared<MeshComms>(mesh, world, {}, mem);
//   ... train ...
//   mem->peak_bytes();       // the largest sum of live tensor bytes seen
//   mem->reset_peak();       // peak = live now
// Several trackers (one per kind of memory: parameters, buffers, ...) can also count into one
// `total` tracker, whose peak is the largest sum live AT ONE TIME over all of them (the sum of
// their own peaks overstates it: they peak at different moments):
//   auto total = std::make_shared<TrackingAllocator>();
//   auto params = std::make_shared<TrackingAllocator>(std::make_shared<kernels::CachingAllocator>(), total);
//   auto buffers = std::make_shared<TrackingAllocator>(std::make_shared<kernels::CachingAllocator>(), total);
//   total->peak_bytes();     // <= params->peak_bytes() + buffers->peak_bytes()
// Thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/allocator.h"

namespace nn {

class TrackingAllocator final : public kernels::Allocator {
 public:
  explicit TrackingAllocator(
      std::shared_ptr<kernels::Allocator> inner = std::make_shared<kernels::CachingAllocator>(),
      std::shared_ptr<TrackingAllocator> total = nullptr)
      : inner_(std::move(inner)), total_(std::move(total)) {}

  void* allocate(size_t nbytes, kernels::Device device) override {
    void* p = inner_->allocate(nbytes, device);
    add(static_cast<int64_t>(nbytes));
    return p;
  }
  void deallocate(void* p, size_t nbytes, kernels::Device device) noexcept override {
    add(-static_cast<int64_t>(nbytes));
    inner_->deallocate(p, nbytes, device);
  }

  // The inner allocator's figures (its limit, when it has one: NOTE [memory limit]).
  int64_t available_bytes(kernels::Device device) const override { return inner_->available_bytes(device); }
  int64_t limit_bytes() const override { return inner_->limit_bytes(); }

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  void add(int64_t delta) noexcept {
    const int64_t now = live_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    if (total_) total_->add(delta);
  }

  std::shared_ptr<kernels::Allocator> inner_;
  std::shared_ptr<TrackingAllocator> total_;  // also counts into it (may be null)
  std::atomic<int64_t> live_{0}, peak_{0};
};

}  // namespace nn
