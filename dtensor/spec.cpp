#include "dtensor/spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>

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
      // Mixed Partial ops are rejected, except sum with avg (docs/pytorch-semantics.md 2.5).
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
  if (const int r = ragged_mesh_dim(spec.placements); r >= 0) {
    const auto& ragged = std::get<RaggedShard>(spec.placements[r]);
    if (static_cast<int64_t>(ragged.units.size()) != mesh->size(r))
      throw InvalidArgument(fmt::format("{} on mesh dim {} has {} units for {} ranks (expected one per rank)",
                                        to_string(spec.placements[r]), r, ragged.units.size(), mesh->size(r)));
    ragged_view(shape, spec.placements);  // refuses what does not compose (NOTE [ragged view])
  }
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
    if (mesh->shape()[m] > 1 && (shard_dim(placements[m]) == tensor_dim ||
                                 ragged_dim(placements[m]).value_or(tensor_dim + 1) <= tensor_dim))
      return true;
  return false;
}

bool operator==(const DTensorSpec& a, const DTensorSpec& b) {
  bool same_mesh = a.mesh == b.mesh || (a.mesh && b.mesh && *a.mesh == *b.mesh);
  return same_mesh && a.placements == b.placements && a.shape == b.shape &&
         a.stride == b.stride && a.dtype == b.dtype;
}

namespace {

// The ranks a rank's Partial value reduces over (its group along every Partial mesh dim), as a
// sorted list, and the op (nullopt when there is no Partial mesh dim of size > 1). Mixed sum
// and avg report avg only when every Partial dim is avg.
struct PartialGroup {
  std::vector<int> ranks;
  std::optional<ReduceOp> op;
  bool mixed = false;
};

PartialGroup partial_group(const DeviceMesh& mesh, const Placements& ps, int rank) {
  PartialGroup g;
  Dims coord = *mesh.coord_of(rank);
  std::vector<int> dims;
  for (int m = 0; m < mesh.ndim(); ++m)
    if (const auto* p = std::get_if<Partial>(&ps[m]); p && mesh.size(m) > 1) {
      dims.push_back(m);
      if (g.op && *g.op != p->op) g.mixed = true;
      g.op = p->op;
    }
  Dims sub;
  for (int m : dims) sub.push_back(mesh.size(m));
  for (int64_t i = 0; i < sub.product(); ++i) {
    Dims c = unravel_index(i, sub);
    for (size_t j = 0; j < dims.size(); ++j) coord[dims[j]] = c[j];
    g.ranks.push_back(mesh.rank_at(coord));
  }
  std::sort(g.ranks.begin(), g.ranks.end());
  return g;
}

}  // namespace

std::string view_mismatch(const DTensorSpec& spec, const DeviceMesh& mesh, const Placements& placements_in) {
  std::vector<int> a = spec.mesh->ranks(), b = mesh.ranks();
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  if (a != b)
    return fmt::format("mesh {} holds ranks [{}], mesh {} holds [{}]", to_string(*spec.mesh), fmt::join(a, ","),
                       to_string(mesh), fmt::join(b, ","));
  const Placements placements = normalize_placements(placements_in, mesh.ndim(), spec.tensor_ndim());
  for (int rank : a) {
    const ShardLayout x = *layout_of_rank(spec.shape, *spec.mesh, spec.placements, rank);
    const ShardLayout y = *layout_of_rank(spec.shape, mesh, placements, rank);
    if (!(x.local_shape == y.local_shape) || x.runs != y.runs)
      return fmt::format("rank {} holds [{}] of shape [{}] under [{}] but [{}] under [{}]", rank,
                         fmt::join(x.local_shape, ","), fmt::join(spec.shape, ","), to_string(spec.placements),
                         fmt::join(y.local_shape, ","), to_string(placements));
    const PartialGroup p = partial_group(*spec.mesh, spec.placements, rank);
    const PartialGroup q = partial_group(mesh, placements, rank);
    if (p.mixed || q.mixed)
      return fmt::format("[{}] and [{}]: a view of mixed Partial ops is not supported", to_string(spec.placements),
                         to_string(placements));
    if (p.ranks != q.ranks || p.op != q.op)
      return fmt::format("rank {} reduces over ranks [{}] ({}) under [{}] but over [{}] ({}) under [{}]", rank,
                         fmt::join(p.ranks, ","), p.op ? kernels::to_string(*p.op) : "no Partial",
                         to_string(spec.placements), fmt::join(q.ranks, ","),
                         q.op ? kernels::to_string(*q.op) : "no Partial", to_string(placements));
  }
  return "";
}

std::optional<Placements> equivalent_placements(const DTensorSpec& spec, const DeviceMesh& mesh) {
  if (ragged_mesh_dim(spec.placements) >= 0) return std::nullopt;  // ragged views are not searched
  std::vector<Placement> options = {Replicate{}};
  for (const Placement& p : spec.placements)
    if (is_partial(p) && std::find(options.begin(), options.end(), p) == options.end()) options.push_back(p);
  // Split factors: products of contiguous runs of mesh sizes (what a shard order encodes).
  std::vector<int> factors;
  for (int i = 0; i < mesh.ndim(); ++i)
    for (int j = i, f = 1; j < mesh.ndim(); ++j) {
      f *= static_cast<int>(mesh.size(j));
      if (f > 1 && std::find(factors.begin(), factors.end(), f) == factors.end()) factors.push_back(f);
    }
  for (int t = 0; t < spec.tensor_ndim(); ++t) {
    options.push_back(Shard{t});
    for (int f : factors) options.push_back(StridedShard{t, f});
  }
  std::vector<int> ranks = mesh.ranks();
  std::vector<ShardLayout> target;
  for (int rank : ranks) {
    std::optional<ShardLayout> l = layout_of_rank(spec.shape, *spec.mesh, spec.placements, rank);
    if (!l) return std::nullopt;  // the meshes hold different ranks
    target.push_back(*l);
  }
  // Depth-first over mesh dims. Later mesh dims only narrow a rank's layout, so a prefix (later
  // dims Replicate) under which some rank no longer holds its whole target is pruned.
  Placements current(mesh.ndim(), Replicate{});
  std::optional<Placements> found;
  std::function<void(int)> visit = [&](int m) {
    if (found) return;
    if (m == mesh.ndim()) {
      try {
        if (view_mismatch(spec, mesh, current).empty()) found = current;
      } catch (const kernels::InvalidArgument&) {  // e.g. mixed Partial ops: not a candidate
      }
      return;
    }
    for (const Placement& p : options) {
      current[m] = p;
      bool possible = true;
      for (size_t i = 0; i < ranks.size() && possible; ++i) {
        const ShardLayout l = *layout_of_rank(spec.shape, mesh, current, ranks[i]);
        possible = common_elements(l, target[i]) == target[i].local_shape.product();
      }
      if (possible) visit(m + 1);
      if (found) return;
    }
    current[m] = Replicate{};
  };
  visit(0);
  return found;
}

std::string to_string(const DTensorSpec& spec) {
  return fmt::format("DTensorSpec(mesh={}, placements=[{}], shape=[{}], dtype={})",
                     to_string(*spec.mesh), to_string(spec.placements),
                     fmt::join(spec.shape, ","), kernels::to_string(spec.dtype));
}

}  // namespace dtensor
