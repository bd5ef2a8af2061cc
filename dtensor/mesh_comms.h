// MeshComms: the communicators of one rank on a DeviceMesh, one per mesh dim (and one per
// requested flattening of several dims), built once at creation by splitting a world
// communicator, never lazily inside a transition.
//
// Example: mesh [[0,1,2,3],[4,5,6,7]] (dp,tp) on an 8-rank world, rank 6:
//   MeshComms comms(mesh, world);          // collective over the world
//   comms.dim(0).ranks() == {2,6}          // group rank 1 == coord[0]
//   comms.dim(1).ranks() == {4,5,6,7}      // group rank 2 == coord[1]
// With flatten = {{0,1}}: comms.flattened({0,1}).ranks() == {0..7} in row-major coordinate order.
// A world rank outside the mesh still takes part in the creation and holds no communicators.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/exec/exec_cache.h"
#include "dtensor/mesh.h"
#include "dtensor/plan/planner.h"
#include "kernels/allocator.h"

namespace dtensor {

class MeshComms {
 public:
  // REQUIRES: world's group rank i is global rank i (a world communicator) and every mesh rank
  // is < world.size(). Every world rank must call this with the same mesh and flatten list.
  // `allocator` serves the buffers and results of redistribute on this mesh; by default a new
  // kernels::CachingAllocator, so repeated transitions reuse their blocks (pass one allocator
  // to several MeshComms to share a cache).
  MeshComms(const DeviceMesh& mesh, collectives::Communicator& world,
            const std::vector<std::vector<int>>& flatten = {},
            std::shared_ptr<kernels::Allocator> allocator = nullptr);

  const DeviceMesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }
  // False when this rank is not in the mesh (then dim() and flattened() throw).
  bool in_mesh() const { return !dims_.empty(); }
  const Dims& coord() const { return coord_; }
  collectives::Communicator& dim(int mesh_dim) const;
  // The communicator of a flattening requested at creation (mesh dims ascending).
  collectives::Communicator& flattened(std::span<const int> mesh_dims) const;
  // Redistribute plans of tensors on this mesh, memoised (plans are rank-independent data).
  PlanCache& plans() const { return plans_; }
  const std::shared_ptr<kernels::Allocator>& allocator() const { return allocator_; }
  // The executor's per-rank step schedules for these communicators (dtensor/exec/exec_cache.h).
  ExecCache& exec_cache() const { return *exec_cache_; }

 private:
  DeviceMesh mesh_;
  int rank_;
  Dims coord_;
  std::vector<std::unique_ptr<collectives::Communicator>> dims_;
  std::vector<std::pair<std::vector<int>, std::unique_ptr<collectives::Communicator>>> flat_;
  mutable PlanCache plans_;
  std::shared_ptr<kernels::Allocator> allocator_;
  std::shared_ptr<ExecCache> exec_cache_ = std::make_shared<ExecCache>();
};

}  // namespace dtensor
