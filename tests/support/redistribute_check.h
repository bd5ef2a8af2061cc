// Runs one redistribute on this rank and checks its result against the global-index values of
// dtensor_data.h, for any backend (the tensor may live on a GPU). A target that keeps a Partial
// of its source is checked by value: the result is all-reduced over the target's Partial mesh
// dims (with each dim's op) and compared with the expected slice.
//
//   MeshComms comms(*mesh, world);
//   Tensor out = dtensor::execute(plan, src, make_local(src, rank, mod).to(device), comms);
//   std::string err = check_redistributed(dst, out, comms, mod);   // collective over the mesh
#pragma once

#include <string>
#include <variant>

#include "dtensor/mesh_comms.h"
#include "dtensor/spec.h"
#include "dtensor_data.h"
#include "kernels/tensor.h"

namespace testing_support {

inline std::string dims_text(const Dims& d) {
  std::string out;
  for (int64_t x : d) {
    if (!out.empty()) out += ',';
    out += std::to_string(x);
  }
  return out;
}

// spec with every Partial replaced by Replicate: the layout the reduced result must have.
inline DTensorSpec without_partials(const DTensorSpec& spec) {
  dtensor::Placements ps = spec.placements;
  for (auto& p : ps)
    if (dtensor::is_partial(p)) p = dtensor::Replicate{};
  return dtensor::make_spec(spec.mesh, ps, spec.shape, spec.dtype);
}

// Collective over the mesh when dst has a Partial mesh dim of size > 1 (every mesh rank calls it
// for the same dst). Empty when `out` is this rank's exact shard under dst (within rel_tol, see
// avg_tolerance), else the first problem. A wrong shape or dtype is reported without breaking the collective sequence.
inline std::string check_redistributed(const DTensorSpec& dst, const Tensor& out,
                                       const dtensor::MeshComms& comms,
                                       int64_t modulus = kDefaultModulus, double rel_tol = 0) {
  const int rank = comms.rank();
  const dtensor::ShardLayout want = *dst.layout(rank);
  std::string problem;
  Tensor value = out;
  if (!out.defined()) problem = "no result tensor";
  else if (!(out.shape() == want.local_shape))
    problem = "local shape [" + dims_text(out.shape()) + "], expected [" +
              dims_text(want.local_shape) + "]";
  else if (out.dtype() != dst.dtype)
    problem = std::string("dtype ") + std::string(kernels::to_string(out.dtype())) + ", expected " +
              std::string(kernels::to_string(dst.dtype));
  bool has_partial = false;
  for (int m = 0; m < dst.mesh->ndim(); ++m)
    if (dtensor::is_partial(dst.placements[m]) && dst.mesh->size(m) > 1) has_partial = true;
  if (has_partial) {
    // Keep the group's calls matched even when this rank's result is malformed.
    Tensor acc = problem.empty() ? out.contiguous().clone()
                                 : Tensor::zeros(want.local_shape, dst.dtype,
                                                 out.defined() ? out.device() : kernels::Device{});
    for (int m = 0; m < dst.mesh->ndim(); ++m) {
      const auto* p = std::get_if<dtensor::Partial>(&dst.placements[m]);
      if (!p || dst.mesh->size(m) == 1) continue;
      collectives::Communicator& group = comms.dim(m);
      group.wait(group.all_reduce(acc, acc, p->op));
    }
    value = acc;
  }
  if (!problem.empty()) return problem;
  if (!value.device().is_cpu()) value = value.to(kernels::Device{});
  std::string err =
      check_local(has_partial ? without_partials(dst) : dst, rank, value, modulus, rel_tol);
  if (!err.empty() && has_partial) err += " (after reducing the kept Partial mesh dims)";
  return err;
}

}  // namespace testing_support
