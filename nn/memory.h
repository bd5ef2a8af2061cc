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
      std::shared_ptr<kernels::Allocator> inner = std::make_shared<kernels::CachingAllocator>())
      : inner_(std::move(inner)) {}

  void* allocate(size_t nbytes, kernels::Device device) override {
    void* p = inner_->allocate(nbytes, device);
    const int64_t now = live_.fetch_add(static_cast<int64_t>(nbytes)) + static_cast<int64_t>(nbytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return p;
  }
  void deallocate(void* p, size_t nbytes, kernels::Device device) noexcept override {
    live_.fetch_sub(static_cast<int64_t>(nbytes));
    inner_->deallocate(p, nbytes, device);
  }

  // The inner allocator's figures (its limit, when it has one: NOTE [memory limit]).
  int64_t available_bytes(kernels::Device device) const override { return inner_->available_bytes(device); }
  int64_t limit_bytes() const override { return inner_->limit_bytes(); }

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  std::shared_ptr<kernels::Allocator> inner_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

}  // namespace nn
