// The memory check before a transition allocates (NOTE [memory limit] in kernels/allocator.h):
// the bytes the executor allocates for a redistribute on this rank, computed once per recipe, and
// a gauge comparing them with what the mesh's allocator can still hand out, raising a
// ResourceError naming both numbers before any buffer exists.
//
//   const int64_t need = transition_bytes(plan, specs, comms, dtypes, caller_outs);  // once
//   comms.exec_cache().memory_gauge().check(need, comms.allocator().get(), device, comms.rank(),
//                                           [&] { return std::string("S(0) -> R of f32[4096]"); });
//   // throws, e.g.: "S(0) -> R of f32[4096] needs 16384 bytes of buffers on rank 0 (cpu), but the
//   // allocator's limit of 8192 bytes has 8192 bytes left"
//
// What counts (per rank; an upper bound of what issue() allocates, from the local shapes): for
// every communicating step, the step's result for every tensor of the batch in the dtype it
// produces (the reduce dtype inside a reduction), and its staging buffers in the dtype it moves:
// the input copy and the reduced buffer of an all-reduce, the packed input and the reduced chunk
// of a reduce-scatter (plus one chunk per peer when the chunks are uneven), the send and receive
// buffers of an exchange without strided views or of a batched all-gather. The caller's `out`
// buffers are not counted (they exist already), nor is the input.
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
#include <span>
#include <string>

#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/allocator.h"
#include "kernels/dtype.h"

namespace dtensor {

class MeshComms;

// The dtypes one step works in (NOTE [reduce policy] in executor.h): it reads `in`, moves and
// reduces in `work`, produces `out`; scaled: a post-scale follows the reduction.
struct StepDTypes {
  kernels::DType in = kernels::DType::kF32, out = kernels::DType::kF32, work = kernels::DType::kF32;
  bool scaled = false;
};

// The bytes issuing `plan` for the tensors `specs` (one batch, one dtype) allocates on this rank
// (what counts: above), saturating at INT64_MAX. caller_outs: the final step writes into the
// caller's tensors, whose bytes do not count. REQUIRES: dtypes.size() == plan.steps.size(),
// comms in the mesh.
int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const MeshComms& comms,
                         std::span<const StepDTypes> dtypes, bool caller_outs);

// NOTE [memory gauge]. Thread-safe; one per MeshComms (ExecCache::memory_gauge).
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
