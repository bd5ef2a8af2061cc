// MeshComms: the communicators of one rank on a DeviceMesh, one per mesh dim (and one per
// requested flattening of several dims, and per requested unflattening of one dim), built once
// at creation by splitting a world communicator, never lazily inside a transition.
//
// Example: mesh [[0,1,2,3],[4,5,6,7]] (dp,tp) on an 8-rank world, rank 6:
//   MeshComms comms(mesh, world);          // collective over the world
//   comms.dim(0).ranks() == {2,6}          // group rank 1 == coord[0]
//   comms.dim(1).ranks() == {4,5,6,7}      // group rank 2 == coord[1]
// With flatten = {{0,1}}: comms.flattened({0,1}).ranks() == {0..7} in row-major coordinate order.
// A world rank outside the mesh still takes part in the creation and holds no communicators.
//
// Derived meshes share the communicators (no split, no collective; PyTorch's slicing does the
// same), so a sub-mesh view costs nothing and its collectives run on the parent's groups:
//   auto dp = MeshComms::create(DeviceMesh::from_shape({8}, {"dp"}), world, {}, nullptr,
//                               {{0, {2, 4}, {"rep", "shard"}}});   // the unflattening up front
//   auto two_d = dp->unflatten(0, {2, 4}, {"rep", "shard"});  // mesh (2,4); dims split at creation
//   two_d->flattened({0, 1}) is dp->dim(0)                     // the same communicator
//   two_d->slice({"shard"}) is the 1-D mesh of this rank's shard group, on two_d's communicator
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/memory_gauge.h"
#include "dtensor/mesh.h"
#include "dtensor/plan/cache.h"
#include "kernels/allocator.h"

namespace dtensor {

// A mesh dim split into several (DeviceMesh::unflatten), requested when a MeshComms is created.
struct Unflattening {
  int mesh_dim = 0;
  Dims sizes;
  std::vector<std::string> names;  // one per size when the mesh has names
};

class MeshComms {
 public:
  // REQUIRES: world's group rank i is global rank i (a world communicator) and every mesh rank
  // is < world.size(). Every world rank must call this with the same mesh, flatten and
  // unflatten lists. `allocator` serves the buffers and results of redistribute on this mesh;
  // by default a new kernels::CachingAllocator, so repeated transitions reuse their blocks (pass
  // one allocator to several MeshComms to share a cache; derived meshes share their parent's).
  MeshComms(const DeviceMesh& mesh, collectives::Communicator& world,
            const std::vector<std::vector<int>>& flatten = {},
            std::shared_ptr<kernels::Allocator> allocator = nullptr,
            const std::vector<Unflattening>& unflatten = {});
  static std::shared_ptr<MeshComms> create(const DeviceMesh& mesh, collectives::Communicator& world,
                                           const std::vector<std::vector<int>>& flatten = {},
                                           std::shared_ptr<kernels::Allocator> allocator = nullptr,
                                           const std::vector<Unflattening>& unflatten = {}) {
    return std::make_shared<MeshComms>(mesh, world, flatten, std::move(allocator), unflatten);
  }

  const DeviceMesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }
  // False when this rank is not in the mesh (then dim() and flattened() throw).
  bool in_mesh() const { return !dims_.empty(); }
  const Dims& coord() const { return coord_; }
  collectives::Communicator& dim(int mesh_dim) const;
  // The communicator of a flattening requested at creation (mesh dims ascending).
  collectives::Communicator& flattened(std::span<const int> mesh_dims) const;

  // Derived meshes on the same communicators (no split, no communication; any rank may call
  // them alone). Each throws InvalidArgument naming what is missing.
  //  - slice: the sub-mesh holding this rank that keeps the named dims (DeviceMesh::slice);
  //    flattenings and unflattenings among the kept dims carry over.
  //  - flatten: mesh_dims merged into one (DeviceMesh::flatten); the flattening must have been
  //    requested at creation (its communicator is the merged dim's).
  //  - unflatten: one mesh dim split into several (DeviceMesh::unflatten); the unflattening must
  //    have been requested at creation. The result can flatten the new dims back (the parent's
  //    communicator of that dim).
  std::shared_ptr<const MeshComms> slice(std::span<const std::string> names) const;
  std::shared_ptr<const MeshComms> slice_dims(std::span<const int> mesh_dims) const;
  std::shared_ptr<const MeshComms> flatten(std::span<const int> mesh_dims, std::string name = "") const;
  std::shared_ptr<const MeshComms> unflatten(int mesh_dim, const Dims& sizes,
                                             std::vector<std::string> names = {}) const;

  // Redistributes of tensors on this mesh, memoised by Transition: the plans (rank-independent
  // data) and this rank's recipes for running them (dtensor/plan/cache.h).
  PlanCache& plans() const { return plans_; }
  const std::shared_ptr<kernels::Allocator>& allocator() const { return allocator_; }
  // The memory check of transitions on these communicators (NOTE [memory gauge]).
  MemoryGauge& memory_gauge() const { return gauge_; }

 private:
  using CommPtr = std::shared_ptr<collectives::Communicator>;
  struct Split {  // an unflattening and the communicators of its new dims
    int mesh_dim;
    Dims sizes;
    std::vector<CommPtr> comms;
  };
  struct Derived {};
  MeshComms(Derived, DeviceMesh mesh, int rank, std::shared_ptr<kernels::Allocator> allocator);

  DeviceMesh mesh_;
  int rank_;
  Dims coord_;
  std::vector<CommPtr> dims_;
  std::vector<std::pair<std::vector<int>, CommPtr>> flat_;
  std::vector<Split> unflat_;
  mutable PlanCache plans_;
  mutable MemoryGauge gauge_;
  std::shared_ptr<kernels::Allocator> allocator_;
};

}  // namespace dtensor
