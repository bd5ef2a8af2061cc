#include "dtensor/mesh_comms.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

std::string dim_label(const DeviceMesh& mesh, int mesh_dim) {
  return mesh.has_names() ? fmt::format("mesh dim {} ({})", mesh_dim, mesh.names()[mesh_dim])
                          : fmt::format("mesh dim {}", mesh_dim);
}

}  // namespace

MeshComms::MeshComms(const DeviceMesh& mesh, collectives::Communicator& world,
                     const std::vector<std::vector<int>>& flatten,
                     std::shared_ptr<kernels::Allocator> allocator)
    : mesh_(mesh), rank_(world.ranks()[world.rank()]),
      allocator_(allocator ? std::move(allocator) : std::make_shared<kernels::CachingAllocator>()) {
  for (int r : mesh.ranks())
    if (r >= world.size())
      throw InvalidArgument(fmt::format("mesh {} names rank {} but the world has {} ranks",
                                        to_string(mesh), r, world.size()));
  std::optional<Dims> coord = mesh.coord_of(rank_);
  auto split = [&](const std::vector<int>& group, std::string label) {
    // Ranks outside the mesh split into singletons so the split stays collective over the world.
    std::vector<int> mine = coord ? group : std::vector<int>{world.rank()};
    return world.split(mine, coord ? fmt::format("{} [{}]", label, fmt::join(group, ","))
                                   : std::string("outside mesh"));
  };
  for (int d = 0; d < mesh.ndim(); ++d) {
    std::vector<int> group = coord ? mesh.group(d, rank_) : std::vector<int>{};
    auto comm = split(group, dim_label(mesh, d));
    if (coord) dims_.push_back(std::move(comm));
  }
  for (const std::vector<int>& dims : flatten) {
    DeviceMesh flat = mesh.flatten(dims);  // validates dims
    std::vector<int> group = coord ? flat.group(dims[0], rank_) : std::vector<int>{};
    std::string label = mesh.has_names() ? fmt::format("flattened {}", flat.names()[dims[0]])
                                         : fmt::format("flattened mesh dims {}", fmt::join(dims, ","));
    auto comm = split(group, label);
    if (coord) flat_.emplace_back(dims, std::move(comm));
  }
  if (coord) coord_ = *coord;
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

}  // namespace dtensor
