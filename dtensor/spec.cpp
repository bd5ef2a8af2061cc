#include "dtensor/spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

Placements normalize_placements(const Placements& placements, int mesh_ndim, int tensor_ndim) {
  if (static_cast<int>(placements.size()) != mesh_ndim)
    throw InvalidArgument(fmt::format("{} placements ({}) for a {}-d mesh (expected {})",
                                      placements.size(), to_string(placements), mesh_ndim,
                                      mesh_ndim));
  Placements out;
  out.reserve(placements.size());
  std::optional<ReduceOp> partial_op;
  for (const Placement& p : placements) {
    out.push_back(normalize(p, tensor_ndim));
    if (const auto* partial = std::get_if<Partial>(&p)) {
      // Mixed Partial ops are rejected, except sum with avg (dtensor-semantics.md 2.5).
      auto linear = [](ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAvg; };
      if (partial_op && *partial_op != partial->op && !(linear(*partial_op) && linear(partial->op)))
        throw InvalidArgument(fmt::format(
            "placements {} mix Partial ops {} and {}: only sum and avg may be mixed",
            to_string(placements), kernels::to_string(*partial_op), kernels::to_string(partial->op)));
      partial_op = partial->op;
    }
  }
  return out;
}

DTensorSpec make_spec(std::shared_ptr<const DeviceMesh> mesh, const Placements& placements,
                      const Dims& shape, DType dtype, std::optional<Dims> stride) {
  if (!mesh) throw InvalidArgument("make_spec: mesh is null");
  for (int64_t s : shape)
    if (s < 0)
      throw InvalidArgument(fmt::format("shape [{}] has a negative size {}", fmt::join(shape, ","), s));
  // Element and byte counts must fit int64, so every per-rank count and traffic figure below
  // the global one does too.
  const int64_t numel = shape.product();
  if (numel > kernels::kInt64Max / static_cast<int64_t>(kernels::itemsize(dtype)))
    throw InvalidArgument(fmt::format("shape [{}] of {} holds {} elements: its byte count overflows int64",
                                      fmt::join(shape, ","), kernels::to_string(dtype), numel));
  DTensorSpec spec;
  spec.placements = normalize_placements(placements, mesh->ndim(), shape.size());
  spec.mesh = std::move(mesh);
  spec.shape = shape;
  spec.dtype = dtype;
  if (stride) {
    if (stride->size() != shape.size())
      throw InvalidArgument(fmt::format("stride [{}] has {} entries for shape [{}]",
                                        fmt::join(*stride, ","), stride->size(),
                                        fmt::join(shape, ",")));
    spec.stride = *stride;
  } else {
    spec.stride = Dims::filled(shape.size(), 1);
    for (int d = shape.size() - 2; d >= 0; --d)
      spec.stride[d] = kernels::checked_mul(spec.stride[d + 1], std::max<int64_t>(shape[d + 1], 1),
                                            "row-major stride of the global shape");
  }
  return spec;
}

std::optional<ShardLayout> DTensorSpec::layout(int rank) const {
  return layout_of_rank(shape, *mesh, placements, rank);
}

bool DTensorSpec::is_sharded(int tensor_dim) const {
  for (int m = 0; m < mesh->ndim(); ++m)
    if (shard_dim(placements[m]) == tensor_dim && mesh->shape()[m] > 1) return true;
  return false;
}

bool operator==(const DTensorSpec& a, const DTensorSpec& b) {
  bool same_mesh = a.mesh == b.mesh || (a.mesh && b.mesh && *a.mesh == *b.mesh);
  return same_mesh && a.placements == b.placements && a.shape == b.shape &&
         a.stride == b.stride && a.dtype == b.dtype;
}

std::string to_string(const DTensorSpec& spec) {
  return fmt::format("DTensorSpec(mesh={}, placements=[{}], shape=[{}], dtype={})",
                     to_string(*spec.mesh), to_string(spec.placements),
                     fmt::join(spec.shape, ","), kernels::to_string(spec.dtype));
}

}  // namespace dtensor
