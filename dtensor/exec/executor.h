// Executes a Plan on this rank's local tensors through its MeshComms: one function per Step
// kind; it decides how (buffers, which collective), never what.
//
// NOTE [exchange] Every data-movement step among S/_S/R placements of one mesh dim is an
// exchange on that mesh dim's group: member r sends member g the elements it holds that g holds
// after the step (per tensor dim, the intersection of index sets), packed in increasing global
// order, and g unpacks them in the same order. Uneven and strided shards need no padding: the
// counts are exact, so the bytes moved equal what must move. Even all-gathers along the leading
// dim use all_gather directly into the result, and Partial steps use all_reduce /
// reduce_scatter (padding-free: uneven reduce-scatters become an exchange plus a local reduce).
//
// Batched form: several tensors with the same placements, mesh and dtype (shapes may differ)
// move with ONE collective per step through flat buffers (copy-in, collective, copy-out).
#pragma once

#include <span>
#include <vector>

#include "dtensor/mesh_comms.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/tensor.h"

namespace dtensor {

using kernels::Tensor;

// REQUIRES: local is this rank's shard of src (local shape from src.layout(rank)); the plan
// starts at src.placements. Returns the new local tensor (the input is never modified).
Tensor execute(const Plan& plan, const DTensorSpec& src, const Tensor& local,
               const MeshComms& comms);

// Batched: specs[i] / locals[i] describe tensor i; all specs have plan.src placements, the same
// mesh and dtype. One collective per communicating step for the whole batch.
std::vector<Tensor> execute_batch(const Plan& plan, std::span<const DTensorSpec> specs,
                                  std::span<const Tensor> locals, const MeshComms& comms);

}  // namespace dtensor
