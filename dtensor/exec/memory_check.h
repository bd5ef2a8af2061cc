// The bytes the executor allocates for a redistribute on this rank, computed once per recipe,
// for the memory check before a transition allocates (MemoryGauge, dtensor/memory_gauge.h):
//
//   const int64_t need = transition_bytes(plan, specs, comms, dtypes, caller_outs);  // once
//   comms.memory_gauge().check(need, comms.allocator().get(), device, comms.rank(), describe);
//
// What counts (per rank; an upper bound of what issue() allocates, from the local shapes): for
// every communicating step, the step's result for every tensor of the batch in the dtype it
// produces (the reduce dtype inside a reduction), and its staging buffers in the dtype it moves:
// the input copy and the reduced buffer of an all-reduce (no buffer when it runs in place, below),
// the packed input and the reduced chunk of a reduce-scatter (plus one chunk per peer when the
// chunks are uneven), the send and receive
// buffers of an exchange without strided views or of a batched all-gather; through a wire dtype
// (NOTE [wire dtype] in executor.h) the input packed in the wire (and staged in the work dtype
// first for an fp8 wire's scale or an input wider than the work dtype),
// every received piece in the wire, the sum and its one-piece staging in the work dtype, and for
// P -> R the gathered result in the wire. The caller's `out`
// buffers are not counted (they exist already), nor is the input.
//
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "dtensor/exec/schedule.h"
#include "dtensor/memory_gauge.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/dtype.h"

namespace dtensor {

// The dtypes one step works in (NOTE [reduce policy] in executor.h): it reads `in`, moves and
// reduces in `work`, produces `out`; scaled: a post-scale follows the reduction.
struct StepDTypes {
  kernels::DType in = kernels::DType::kF32, out = kernels::DType::kF32, work = kernels::DType::kF32;
  bool scaled = false;
  std::optional<kernels::DType> wire;  // a reducing step's narrower wire dtype (NOTE [wire dtype])
};

// A step the executor runs in place on the previous step's result when that is the plan's (an
// intermediate or the caller's out, never the caller's input): an all-reduce over more than one
// member without a cast, a post-scale or a narrower wire. E.g. HSDP's [P,P] -> [R,S(0)]: the
// reduce-scatter over dp_shard writes into the caller's out, the all-reduce over dp_replicate
// reduces it there (as FSDP2 does), no buffer between them.
bool all_reduces_in_place(const Step& step, int64_t group_size, const StepDTypes& d);

// The bytes issuing `plan` for the tensors `specs` (one batch, one dtype) allocates on this rank
// (what counts: above), saturating at INT64_MAX. caller_outs: the final step writes into the
// caller's tensors, whose bytes do not count. REQUIRES: dtypes.size() == plan.steps.size(),
// comms in the mesh.
int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const RankContext& rank,
                         std::span<const StepDTypes> dtypes, bool caller_outs);
int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const MeshComms& comms,
                         std::span<const StepDTypes> dtypes, bool caller_outs);

}  // namespace dtensor
