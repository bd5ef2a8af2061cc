#include "dtensor/mesh_comms.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

std::string dim_label(const DeviceMesh& mesh, int mesh_dim) {
  return mesh.has_names() ? fmt::format("mesh dim {} ({})", mesh_dim, mesh.names()[mesh_dim])
                          : fmt::format("mesh dim {}", mesh_dim);
}

bool contains(std::span<const int> dims, int d) { return std::find(dims.begin(), dims.end(), d) != dims.end(); }

}  // namespace

MeshComms::MeshComms(const DeviceMesh& mesh, collectives::Communicator& world,
                     const std::vector<std::vector<int>>& flatten,
                     std::shared_ptr<kernels::Allocator> allocator, const std::vector<Unflattening>& unflatten)
    : mesh_(mesh), rank_(world.ranks()[world.rank()]),
      allocator_(allocator ? std::move(allocator) : std::make_shared<kernels::CachingAllocator>()) {
  for (int r : mesh.ranks())
    if (r >= world.size())
      throw InvalidArgument(fmt::format("mesh {} names rank {} but the world has {} ranks",
                                        to_string(mesh), r, world.size()));
  std::optional<Dims> coord = mesh.coord_of(rank_);
  auto split = [&](const std::vector<int>& group, std::string label) -> CommPtr {
    // Ranks outside the mesh split into singletons so the split stays collective over the world.
    std::vector<int> mine = coord ? group : std::vector<int>{world.rank()};
    CommPtr comm = world.split(mine, coord ? fmt::format("{} [{}]", label, fmt::join(group, ","))
                                           : std::string("outside mesh"));
    return coord ? comm : nullptr;
  };
  for (int d = 0; d < mesh.ndim(); ++d) {
    std::vector<int> group = coord ? mesh.group(d, rank_) : std::vector<int>{};
    CommPtr comm = split(group, dim_label(mesh, d));
    if (coord) dims_.push_back(std::move(comm));
  }
  for (const std::vector<int>& dims : flatten) {
    DeviceMesh flat = mesh.flatten(dims);  // validates dims
    std::vector<int> group = coord ? flat.group(dims[0], rank_) : std::vector<int>{};
    std::string label = mesh.has_names() ? fmt::format("flattened {}", flat.names()[dims[0]])
                                         : fmt::format("flattened mesh dims {}", fmt::join(dims, ","));
    flat_.emplace_back(dims, split(group, label));
  }
  for (const Unflattening& u : unflatten) {
    const DeviceMesh split_mesh = mesh.unflatten(u.mesh_dim, u.sizes, u.names);  // validates
    Split s{u.mesh_dim, u.sizes, {}};
    for (int i = 0; i < u.sizes.size(); ++i) {
      const int d = u.mesh_dim + i;
      std::vector<int> group = coord ? split_mesh.group(d, rank_) : std::vector<int>{};
      s.comms.push_back(split(group, fmt::format("unflattened {}", dim_label(split_mesh, d))));
    }
    unflat_.push_back(std::move(s));
  }
  if (coord) coord_ = *coord;
}

MeshComms::MeshComms(Derived, DeviceMesh mesh, int rank, std::shared_ptr<kernels::Allocator> allocator)
    : mesh_(std::move(mesh)), rank_(rank), allocator_(std::move(allocator)) {
  if (std::optional<Dims> c = mesh_.coord_of(rank_)) coord_ = *c;
}

collectives::Communicator& MeshComms::dim(int mesh_dim) const {
  if (!in_mesh())
    throw InvalidArgument(fmt::format("rank {} is not in mesh {}", rank_, to_string(mesh_)));
  if (mesh_dim < 0 || mesh_dim >= mesh_.ndim())
    throw InvalidArgument(fmt::format("mesh dim {} out of range for a {}-d mesh", mesh_dim, mesh_.ndim()));
  return *dims_[mesh_dim];
}

collectives::Communicator& MeshComms::flattened(std::span<const int> mesh_dims) const {
  if (!in_mesh())
    throw InvalidArgument(fmt::format("rank {} is not in mesh {}", rank_, to_string(mesh_)));
  for (const auto& [dims, comm] : flat_)
    if (std::equal(dims.begin(), dims.end(), mesh_dims.begin(), mesh_dims.end())) return *comm;
  throw InvalidArgument(fmt::format(
      "mesh dims [{}] were not flattened when the mesh communicators were created",
      fmt::join(mesh_dims, ",")));
}

std::shared_ptr<const MeshComms> MeshComms::slice(std::span<const std::string> names) const {
  if (!mesh_.has_names()) throw InvalidArgument("cannot slice a mesh by name: its dims have no names");
  std::vector<int> dims;
  for (const std::string& n : names) dims.push_back(mesh_.mesh_dim(n));
  return slice_dims(dims);
}

std::shared_ptr<const MeshComms> MeshComms::slice_dims(std::span<const int> mesh_dims) const {
  if (!in_mesh())
    throw InvalidArgument(fmt::format("rank {} is not in mesh {}: it has no sub-mesh to slice", rank_,
                                      to_string(mesh_)));
  std::shared_ptr<MeshComms> out(new MeshComms(Derived{}, mesh_.slice_dims(mesh_dims, rank_), rank_, allocator_));
  auto position = [&](int d) {
    return static_cast<int>(std::find(mesh_dims.begin(), mesh_dims.end(), d) - mesh_dims.begin());
  };
  for (int d : mesh_dims) out->dims_.push_back(dims_[d]);
  for (const auto& [dims, comm] : flat_) {
    if (!std::all_of(dims.begin(), dims.end(), [&](int d) { return contains(mesh_dims, d); })) continue;
    std::vector<int> kept;
    for (int d : dims) kept.push_back(position(d));
    out->flat_.emplace_back(std::move(kept), comm);
  }
  for (const Split& s : unflat_)
    if (contains(mesh_dims, s.mesh_dim)) out->unflat_.push_back({position(s.mesh_dim), s.sizes, s.comms});
  return out;
}

std::shared_ptr<const MeshComms> MeshComms::flatten(std::span<const int> mesh_dims, std::string name) const {
  DeviceMesh flat = mesh_.flatten(mesh_dims, std::move(name));  // validates
  const std::vector<int> merged(mesh_dims.begin(), mesh_dims.end());
  auto requested = std::find_if(flat_.begin(), flat_.end(), [&](const auto& f) { return f.first == merged; });
  if (requested == flat_.end())
    throw InvalidArgument(fmt::format(
        "cannot view mesh {} with dims [{}] flattened: that flattening was not requested when the mesh "
        "communicators were created (pass it in `flatten`)",
        to_string(mesh_), fmt::join(merged, ",")));
  std::shared_ptr<MeshComms> out(new MeshComms(Derived{}, std::move(flat), rank_, allocator_));
  // Index of each old dim in the flattened mesh (-1 for merged dims after the first).
  std::vector<int> new_index(mesh_.ndim(), -1);
  for (int d = 0, p = 0; d < mesh_.ndim(); ++d) {
    if (contains(mesh_dims, d) && d != mesh_dims[0]) continue;
    new_index[d] = p++;
  }
  if (in_mesh())
    for (int d = 0; d < mesh_.ndim(); ++d) {
      if (contains(mesh_dims, d) && d != mesh_dims[0]) continue;
      out->dims_.push_back(d == mesh_dims[0] ? requested->second : dims_[d]);
    }
  for (const auto& [dims, comm] : flat_) {  // flattenings of the other dims carry over
    if (std::any_of(dims.begin(), dims.end(), [&](int d) { return contains(mesh_dims, d); })) continue;
    std::vector<int> moved;
    for (int d : dims) moved.push_back(new_index[d]);
    out->flat_.emplace_back(std::move(moved), comm);
  }
  for (const Split& s : unflat_)
    if (!contains(mesh_dims, s.mesh_dim)) out->unflat_.push_back({new_index[s.mesh_dim], s.sizes, s.comms});
  // Adjacent dims can be split back: the merged dim unflattens into the original communicators.
  if (merged.back() - merged.front() + 1 == static_cast<int>(merged.size())) {
    Split back{new_index[merged.front()], {}, {}};
    for (int d : merged) {
      back.sizes.push_back(mesh_.size(d));
      if (in_mesh()) back.comms.push_back(dims_[d]);
    }
    out->unflat_.push_back(std::move(back));
  }
  return out;
}

std::shared_ptr<const MeshComms> MeshComms::unflatten(int mesh_dim, const Dims& sizes,
                                                      std::vector<std::string> names) const {
  DeviceMesh split_mesh = mesh_.unflatten(mesh_dim, sizes, std::move(names));  // validates
  auto requested = std::find_if(unflat_.begin(), unflat_.end(),
                                [&](const Split& s) { return s.mesh_dim == mesh_dim && s.sizes == sizes; });
  if (requested == unflat_.end())
    throw InvalidArgument(fmt::format(
        "cannot view mesh {} with dim {} unflattened into [{}]: that unflattening was not requested when "
        "the mesh communicators were created (pass it in `unflatten`)",
        to_string(mesh_), mesh_dim, fmt::join(sizes, ",")));
  std::shared_ptr<MeshComms> out(new MeshComms(Derived{}, std::move(split_mesh), rank_, allocator_));
  const int extra = static_cast<int>(sizes.size()) - 1;
  auto moved = [&](int d) { return d > mesh_dim ? d + extra : d; };
  if (in_mesh())
    for (int d = 0; d < mesh_.ndim(); ++d) {
      if (d != mesh_dim) out->dims_.push_back(dims_[d]);
      else out->dims_.insert(out->dims_.end(), requested->comms.begin(), requested->comms.end());
    }
  for (const auto& [dims, comm] : flat_) {  // flattenings that do not involve the split dim
    if (contains(dims, mesh_dim)) continue;
    std::vector<int> m;
    for (int d : dims) m.push_back(moved(d));
    out->flat_.emplace_back(std::move(m), comm);
  }
  // The new dims flatten back into the split dim's communicator.
  std::vector<int> news;
  for (int i = 0; i <= extra; ++i) news.push_back(mesh_dim + i);
  out->flat_.emplace_back(std::move(news), in_mesh() ? dims_[mesh_dim] : nullptr);
  for (const Split& s : unflat_)
    if (&s != &*requested && s.mesh_dim != mesh_dim) out->unflat_.push_back({moved(s.mesh_dim), s.sizes, s.comms});
  return out;
}

}  // namespace dtensor
