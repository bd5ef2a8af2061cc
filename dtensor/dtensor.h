// DTensor: a global tensor distributed over a DeviceMesh: this rank's local shard, the global
// spec (mesh, placements, shape, stride, dtype) and the mesh communicators that move it.
// PyTorch names and semantics (docs/pytorch-semantics.md section 5; the path of a redistribute:
// docs/architecture.md section 3).
//
//   auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2, 2}), world);
//   DTensor x = distribute_tensor(full, comms, parse_placements("S(0),R"));  // scatter + broadcast
//   DTensor y = x.redistribute(parse_placements("R,S(1)"));                  // planned, cached
//   Tensor whole = y.full_tensor();                                          // == full
//   RedistributeHandle h = redistribute_async(x, parse_placements("R,R"), {}, unsharded);
//   ...                                                                      // compute meanwhile
//   DTensor z = h.wait();                     // z.to_local() is `unsharded`, filled in place
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/plan/planner.h"
#include "dtensor/plan/transition.h"
#include "dtensor/spec.h"
#include "kernels/tensor.h"

namespace dtensor {

using kernels::Tensor;

struct RedistributeOptions {
  // search by default: never costlier than greedy under the cost model (same data either way);
  // greedy reproduces PyTorch's collective sequence exactly.
  PlannerKind planner = PlannerKind::kSearch;
  // One precision policy for every reduction of the transition (NOTE [reduce policy] in
  // dtensor/exec/executor.h): the dtype the Partial reductions compute in (nullopt: the
  // tensor's), the factor their result is divided by (FSDP's gradient divide factor; P(sum)
  // only), and FSDP2's force-sum mode (sum on the wire, divide after).
  std::optional<kernels::DType> reduce_dtype;
  double divide_factor = 1.0;
  bool force_sum = false;
  // What the reductions move (NOTE [wire dtype] in dtensor/exec/executor.h): a floating dtype
  // narrower than the reduce dtype (bf16 or f8e5m2 with f32) travels instead of it and is summed
  // locally in the reduce dtype; nullopt moves the reduce dtype.
  std::optional<kernels::DType> wire_dtype;

  ReducePolicy reduce_policy() const { return {reduce_dtype, divide_factor, force_sum, wire_dtype}; }
};

class DTensor {
 public:
  // REQUIRES: local has the shape spec.layout(comms->rank()) gives (checked), spec.mesh is the
  // communicators' mesh. Ranks outside the mesh hold an empty local tensor.
  DTensor(std::shared_ptr<const MeshComms> comms, DTensorSpec spec, Tensor local);

  const DTensorSpec& spec() const { return spec_; }
  const Placements& placements() const { return spec_.placements; }
  const Dims& shape() const { return spec_.shape; }   // global
  const Dims& stride() const { return spec_.stride; } // global
  kernels::DType dtype() const { return spec_.dtype; }
  const DeviceMesh& device_mesh() const { return comms_->mesh(); }
  const std::shared_ptr<const MeshComms>& comms() const { return comms_; }

  // This rank's shard (a view, no communication).
  const Tensor& to_local() const { return local_; }
  // Collective over the mesh. Equal placements return a DTensor sharing the local tensor.
  // Throws Unsupported for a new Partial target (except S(d) -> P(sum), a local zero-fill as in
  // PyTorch 2.15), _S -> P, P(a) -> P(b) (see plan_redistribute).
  DTensor redistribute(const Placements& placements, const RedistributeOptions& options = {}) const;
  // The same, into the caller's tensor: `out` must have this rank's local shape under the
  // target; any strides and any dtype (the result is cast to it: with a reduce dtype equal to
  // out's, the reduction lands in out uncast). Its storage may have been freed and re-allocated
  // in place (kernels/storage.h); it must be allocated now. The returned DTensor's local tensor
  // is `out` (dtype out's). Where the collective allows, nothing is copied or allocated: S(0) -> R
  // all-gathers straight into a contiguous out, P -> S(0) reduce-scatters straight from the local
  // tensor into out, exchanges receive their pieces in place (NOTE [exchange]).
  DTensor redistribute(const Placements& placements, const Tensor& out, const RedistributeOptions& options = {}) const;
  // The same tensor on another mesh over the same ranks (a flattening, an unflattening, a slice
  // view that covers the mesh: see MeshComms::flatten / unflatten) with no communication: the
  // local tensor is shared. Allowed exactly when NOTE [mesh view] (spec.h) holds; otherwise
  // InvalidArgument naming the first rank whose data would differ. Without placements, the
  // first equivalent placement list (equivalent_placements) is taken.
  //   dp (1-D, 8 ranks) [R]  ->  dp->unflatten(0, {2,4}) [R,R]  -> redistribute [R,S(0)]: the
  //   post-forward reshard of FSDP's reshard_after_forward=4 (back: [R,S(0)] -> [R,R] is one
  //   all-gather over 4 ranks, then view_on(dp, [R])).
  DTensor view_on(std::shared_ptr<const MeshComms> comms, const Placements& placements) const;
  DTensor view_on(std::shared_ptr<const MeshComms> comms) const;
  // redistribute to all-Replicate, then the local tensor (collective over the mesh).
  Tensor full_tensor() const;
  // The plan redistribute would run (cached in the communicators' PlanCache; the reference
  // stays valid while they live).
  const Plan& plan_to(const Placements& placements, const RedistributeOptions& options = {}) const;

  // Per-rank ownership, like PyTorch's visualize_sharding: one line per rank with its coordinate,
  // local shape, offsets and held index ranges; for 1-D and 2-D tensors also a grid of owners.
  std::string ownership() const;

 private:
  friend class RedistributeHandle;
  friend std::vector<DTensor> redistribute_batch(std::span<const DTensor>, const Placements&,
                                                 const RedistributeOptions&, std::span<const Tensor>);
  struct Trusted {};
  // For results the executor produced: the local shape is right by construction.
  DTensor(Trusted, std::shared_ptr<const MeshComms> comms, DTensorSpec spec, Tensor local)
      : comms_(std::move(comms)), spec_(std::move(spec)), local_(std::move(local)) {}

  std::shared_ptr<const MeshComms> comms_;
  DTensorSpec spec_;
  Tensor local_;
};

// A redistribute in flight (redistribute_async): every collective of the plan is issued; the
// calls progress without the caller (NOTE [in-order engine] in collectives/communicator.h).
// Destroying a pending handle completes it first (bounded by the communicators' timeout).
//   RedistributeHandle h = redistribute_async(x, parse_placements("R"));
//   while (!h.ready()) do_something_else();   // or just h.wait()
//   DTensor y = h.wait();
class RedistributeHandle {
 public:
  RedistributeHandle();
  RedistributeHandle(RedistributeHandle&&) noexcept;
  RedistributeHandle& operator=(RedistributeHandle&&) noexcept;
  ~RedistributeHandle();
  // Non-blocking: true once wait() returns at once.
  bool ready();
  // Blocks until the transition has completed on this rank, within `timeout`, and returns the
  // result. Throws CommError naming the collective, its group and the ranks that never joined
  // (the transition is then given up), or the first failure of another kind.
  DTensor wait(collectives::Milliseconds timeout);
  DTensor wait();

 private:
  friend RedistributeHandle redistribute_async(const DTensor&, const Placements&, const RedistributeOptions&,
                                               const Tensor&);
  struct Pending;  // the executor's handle of the calls in flight (dtensor.cpp)
  std::unique_ptr<Pending> pending_;
  std::shared_ptr<const MeshComms> comms_;
  DTensorSpec spec_;  // the result's
};

// PyTorch's distribute_tensor: placements applied left to right over mesh dims: Shard /
// StridedShard scatter from group rank src_data_rank, Replicate broadcasts from it, Partial
// broadcasts then partitions (sum: / group size). With src_data_rank == nullopt every rank
// splits its own copy locally (no communication). Collective over the mesh.
DTensor distribute_tensor(const Tensor& tensor, std::shared_ptr<const MeshComms> comms,
                          const Placements& placements, std::optional<int> src_data_rank = 0);

// PyTorch's DTensor.from_local. Without shape/stride the global shape assumes even sharding
// (global[d] = local[d] * k per Shard(d) / StridedShard(d) mesh dim, stride as PyTorch); give
// both for uneven shards (shape alone takes the row-major stride; stride alone is rejected).
// run_check gathers every rank's (dtype, local shape, global shape, stride, placements) and throws
// InvalidArgument naming the first disagreeing rank, or a local shape that is not the torch.chunk
// shard of the global shape.
DTensor from_local(const Tensor& local, std::shared_ptr<const MeshComms> comms,
                   const Placements& placements, std::optional<Dims> shape = std::nullopt,
                   std::optional<Dims> stride = std::nullopt, bool run_check = false);

// Asynchronous redistribute (PyTorch's async_op=True): every step is issued at once, in the
// communicators' order (NOTE [deferred plans] in dtensor/exec/executor.h), so any number may be
// in flight on one mesh, and other collectives may be issued meanwhile; they complete in issue
// order. Bad input throws here, not from wait(). `out` as for DTensor::redistribute.
// Collective over the mesh.
RedistributeHandle redistribute_async(const DTensor& tensor, const Placements& placements,
                                      const RedistributeOptions& options = {}, const Tensor& out = {});

// Batched redistribute: every tensor on the same mesh, with the same placements and dtype,
// moves to `placements` with one collective per step (flat buffers). outs, when given (one per
// tensor), receive the results as in DTensor::redistribute. Collective over the mesh. With a
// RaggedShard on either side the tensors move one by one (a ragged plan is made per shape; all
// are issued before the first is waited for).
std::vector<DTensor> redistribute_batch(std::span<const DTensor> tensors, const Placements& placements,
                                        const RedistributeOptions& options = {}, std::span<const Tensor> outs = {});

// Factories: each rank allocates only its local shard, on `device` (the mesh's device type in
// PyTorch's factories; here given, CPU by default, e.g. a parameter's to_local().device()).
DTensor empty(const Dims& shape, kernels::DType dtype, std::shared_ptr<const MeshComms> comms,
              const Placements& placements, kernels::Device device = {});
DTensor zeros(const Dims& shape, kernels::DType dtype, std::shared_ptr<const MeshComms> comms,
              const Placements& placements, kernels::Device device = {});
DTensor ones(const Dims& shape, kernels::DType dtype, std::shared_ptr<const MeshComms> comms,
             const Placements& placements, kernels::Device device = {});
DTensor full(const Dims& shape, double value, kernels::DType dtype,
             std::shared_ptr<const MeshComms> comms, const Placements& placements, kernels::Device device = {});
// Uniform [0, 1) values that are a function of (seed, global index) only, so every sharding of
// the same (shape, seed) holds the same global tensor. Partial placements are rejected.
DTensor rand(const Dims& shape, uint64_t seed, kernels::DType dtype,
             std::shared_ptr<const MeshComms> comms, const Placements& placements, kernels::Device device = {});

// The text of DTensor::ownership() for any spec (pure; no communication), e.g. for tools:
//   rank  coord     local       offset        held indices per tensor dim
//      0  (0)       [3]         [0]           0-2
//   ...
//   owners of each element:
//    0 0 0 1 1 1 2 2 2
std::string ownership_text(const DTensorSpec& spec);

// "DTensor(shape=[8,6], dtype=f32, mesh=[[0,1],[2,3]], placements=[S(0),R], local=tensor(...))".
std::string to_string(const DTensor& t);

}  // namespace dtensor
