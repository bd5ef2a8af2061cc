// Transition: one redistribute as a hashable value (NOTE [transition]): the source (mesh shape,
// global shape, dtype, placements), the normalised target, the planner and its cost model, and
// how reductions compute (ReducePolicy) and what dtype the result takes. Made once per call by
// make_transition, which validates and normalises; the planner (plan_transition, planner.h)
// takes it as its only input, and PlanCache (cache.h) keys plans and the executor's per-rank
// data by it.
//
//   Transition t = make_transition(spec, parse_placements("R,S(-1)"));   // spec: [S(0),R], 2-d
//   to_string(t.dst) == "R,S(1)";  t.planner == PlannerKind::kSearch
//
// NOTE [transition] Normalising the target (negative shard dims) and validating the pair
// (Partial rules) happen here and nowhere else on the way through DTensor::redistribute:
// everything after takes the value as it is. Placement lists hold at most kernels::kMaxDims
// entries inline, so building and hashing a Transition allocates nothing unless extra shapes
// are given (redistribute_batch).
#pragma once

#include <boost/container/static_vector.hpp>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/placement.h"
#include "dtensor/spec.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace dtensor {

enum class PlannerKind { kGreedy, kSearch };
std::string_view to_string(PlannerKind kind);
PlannerKind parse_planner(std::string_view text);  // "greedy" | "search"

// cost(step) = latency_us + max over ranks of the bytes the rank receives / bandwidth.
struct CostModel {
  double latency_us = 10.0;
  double bandwidth_gb_per_s = 20.0;  // 1 GB/s = 1e3 bytes/us
  friend bool operator==(const CostModel&, const CostModel&) = default;
};

// How a plan's reductions compute (NOTE [reduce policy] in dtensor/exec/executor.h).
struct ReducePolicy {
  std::optional<kernels::DType> reduce_dtype;  // nullopt: the tensor's dtype
  double divide_factor = 1.0;                  // the reduced result is divided by it
  bool force_sum = false;                      // FSDP2's force_sum_reduction_for_comms
  // What the reducing steps move (NOTE [wire dtype] in dtensor/exec/executor.h): nullopt, or the
  // reduce dtype itself, moves the reduce dtype; a narrower floating dtype makes every reducing
  // step an exchange of wire-dtype pieces summed locally in the reduce dtype.
  std::optional<kernels::DType> wire_dtype;
  friend bool operator==(const ReducePolicy&, const ReducePolicy&) = default;
};

using PlacementList = boost::container::static_vector<Placement, kernels::kMaxDims>;

struct Transition {
  Dims mesh_shape;
  Dims shape;  // global
  DType dtype = DType::kF32;
  PlacementList src, dst;  // dst normalised against shape's ndim
  PlannerKind planner = PlannerKind::kSearch;
  CostModel cost;
  bool allow_partial_target = false;
  std::vector<Dims> also_valid_for;  // more shapes the plan must be valid for: sorted, unique
  ReducePolicy policy;
  std::optional<DType> out_dtype;  // the result's dtype (nullopt: dtype)
  // NOTE [ragged plans] A transition with a RaggedShard is planned on the flattened view
  // (layout.h, NOTE [ragged view]): shape, src and dst above are the view's, and these hold the
  // caller's global shape and placements (empty without a RaggedShard).
  Dims tensor_shape;
  PlacementList user_src, user_dst;

  Placements source() const { return {src.begin(), src.end()}; }
  Placements target() const { return {dst.begin(), dst.end()}; }
  friend bool operator==(const Transition&, const Transition&) = default;
};

struct TransitionHash {
  size_t operator()(const Transition& t) const;
};

// Validates and normalises. Throws InvalidArgument for malformed placements (mesh ndim, shard
// dims, mixed Partial ops) and Unsupported for what PyTorch also rejects (a StridedShard source
// turning Partial, a Shard turning P(avg/min/max/prod), P(a) -> P(b), a new Partial target from
// Replicate unless allow_partial_target). S(d) -> P(sum) is allowed (PyTorch 2.15: a local
// zero-fill). A wire dtype (policy.wire_dtype) that is not floating point, is wider than the reduce
// dtype, or applies to a Partial other than sum / avg is InvalidArgument naming both. also_valid_for: more global shapes (any ndim) the plan must be valid for (a batch
// moving tensors of several shapes with one plan; the cost is src.shape's).
Transition make_transition(const DTensorSpec& src, const Placements& dst, PlannerKind planner = PlannerKind::kSearch,
                           const ReducePolicy& policy = {}, std::optional<DType> out_dtype = std::nullopt,
                           const CostModel& cost = {}, bool allow_partial_target = false,
                           const std::vector<Dims>& also_valid_for = {});

// NOTE [ragged plans] A RaggedShard transition changes its ragged mesh dim m, from and to R, P
// (source only), S(d) or Rg(d) (d the ragged dim, at least one side ragged), and any other mesh
// dim only P -> R (an all-reduce: HSDP's dp_replicate); no other mesh dim of size > 1 splits
// dims >= d. It is planned on the view [s_0..s_{d-1}, s_d x ... x s_{n-1}], where S(d) over k
// ranks is Rg(d,[torch.chunk row counts],s_{d+1} x ... x s_{n-1}) (exact: the same ranges), one
// step per changed mesh dim, in the cheapest order: Rg -> R an all-gather of exact pieces (AG),
// R -> Rg a local chunk, P -> Rg a reduce-scatter (RS(m:Rg(..),op)), Rg/S(d) -> Rg/S(d) one
// exchange of the overlaps (regroup), P -> R elsewhere an all-reduce of the piece. Executed
// (exec/issuer.cpp): pieces all of one size (FSDP's flat buffers) of a 1-D view make the AG the
// plain all_gather and the RS the plain reduce_scatter; uneven ones an exact send_recv (AG), and
// for the RS the peers' pieces of this rank's range received into buffers and summed in member
// order straight into the result.
//   [S(0)] -> [Rg(0,[1,2,0,1],1)] of f32 [9,4] on mesh [4]: view [36],
//   "[S(0)] as [Rg(0,[3,3,3,0],4)] -regroup(0:Rg(0,[3,3,3,0],4)->Rg(0,[1,2,0,1],1))-> [Rg(0,[1,2,0,1],1)]"
//   [P,P] -> [R,Rg(0,[1,2,0,1],2)] of f32 [9,4] on mesh [2,4] (HSDP's gradient reduce):
//   "[P,P] -RS(1:Rg(0,[1,2,0,1],2),sum)-> [P,Rg(0,[1,2,0,1],2)] -AR(0,sum)-> [R,Rg(0,[1,2,0,1],2)]"
// Anything else with a RaggedShard is Unsupported, naming both placement lists.
struct RaggedMapping {
  Dims view;
  Placements src, dst;
};
// nullopt when neither list has a RaggedShard. REQUIRES: normalised placements, one per mesh dim.
std::optional<RaggedMapping> map_ragged_transition(const Dims& mesh_shape, const Dims& shape, const Placements& src,
                                                   const Placements& dst);

// "[S(0),R] -> [R,S(1)] on mesh [2,2], f32 [8,6]".
std::string to_string(const Transition& t);

}  // namespace dtensor
