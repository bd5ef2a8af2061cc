// MemoryGauge: the check before a transition allocates (NOTE [memory limit] in
// kernels/allocator.h): compares the bytes a redistribute will allocate on this rank with what
// the mesh's allocator can still hand out, raising a ResourceError naming both numbers before
// any buffer exists. The executor computes the bytes (dtensor/exec/memory_check.h).
//
//   comms.memory_gauge().check(need, comms.allocator().get(), device, comms.rank(),
//                              [&] { return std::string("S(0) -> R of f32[4096]"); });
//   // throws, e.g.: "S(0) -> R of f32[4096] needs 16384 bytes of buffers on rank 0 (cpu), but the
//   // allocator's limit of 8192 bytes has 8192 bytes left"
//
// NOTE [memory gauge] Checking must cost next to nothing on the cached redistribute path (a few
// microseconds in all), while the machine's figure reads /proc (microseconds) and a GPU's calls
// cudaMemGetInfo. So the gauge keeps the last figure read, per device kind, for 100 ms, less
// what the transitions it let through since then need; a transition needing at most half of
// that (or any, when the figure is unknown) needs no fresh read. A bigger one reads afresh. The
// figure may be stale by what was freed or taken by others in those 100 ms; an allocator with a
// limit still refuses, at allocation, what would pass it.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "kernels/allocator.h"
#include "kernels/device.h"

namespace dtensor {

// NOTE [memory gauge]. Thread-safe; one per MeshComms (MeshComms::memory_gauge).
class MemoryGauge {
 public:
  static constexpr int64_t kFreshNs = 100'000'000;  // how long a figure read is trusted

  // Throws ResourceError when `needed` bytes exceed what `allocator` (null: the system) can hand
  // out on `device`, naming describe() (the transition), the bytes needed and the bytes
  // available, and the allocator's limit when it has one. Unknown figures pass.
  template <class Describe>
  void check(int64_t needed, const kernels::Allocator* allocator, kernels::Device device, int rank,
             Describe&& describe) {
    if (needed <= 0 || trusted(needed, device)) return;
    const int64_t available = read(needed, allocator, device);
    if (available >= 0 && needed > available) fail(needed, available, allocator, device, rank, describe());
  }

 private:
  bool trusted(int64_t needed, kernels::Device device);
  // Reads the figure; keeps it less `needed` when that fits (the transition will take it).
  int64_t read(int64_t needed, const kernels::Allocator* allocator, kernels::Device device);
  [[noreturn]] static void fail(int64_t needed, int64_t available, const kernels::Allocator* allocator,
                                kernels::Device device, int rank, const std::string& what);

  // Per device kind (0 CPU, 1 CUDA): the last figure read less what passed since (-1: unknown),
  // and when it was read (steady clock, ns; 0: never).
  std::atomic<int64_t> known_[2] = {-1, -1};
  std::atomic<int64_t> read_at_ns_[2] = {0, 0};
};

}  // namespace dtensor
