// Steps of a redistribute plan: each changes the placement of ONE mesh dim, on the group of
// ranks that differ only in that mesh coordinate. A closed variant, so apply / cost / to_string /
// execute must handle every kind at compile time.
//
// Example: [S(0),S(1)] -> [S(1),S(0)] on a 2x2 mesh, greedy (PyTorch's route):
//   AllGather{1, 1}        [S(0),S(1)] -AG(1)->       [S(0),R]
//   AllToAll{0, 0, 1}      [S(0),R]    -A2A(0:0->1)-> [S(1),R]
//   LocalChunk{1, S(0)}    [S(1),R]    -chunk(1)->    [S(1),S(0)]
//
// NOTE [step validity] A step on mesh dim m runs on each group of ranks that differ only in
// coordinate m, so it is valid exactly when every element a rank holds after the step is held
// by its own group before it:
//  - exchange (S/_S -> R, S, _S; S -> P(sum)): every element of the rank's new layout is held by
//    exactly one member of its group (the members' sets are disjoint: mesh dim m splits them);
//  - reduction (P -> R, S, _S): the new layout lies inside the group's common extent (every
//    member of a Partial mesh dim holds the same index set, so the group reduces it);
//  - local (R -> S, _S, P): the new layout is a subset of the old one.
// A later mesh dim m' > m that shards a tensor dim the step touches splits what m leaves, so
// the condition depends on the layouts (and so on the global shape when sizes are uneven):
//   2x4 (dp,tp), 16 rows: [_S(0,4),S(0)] -_AG(0,sf=4)-> [R,S(0)] is valid (tp rank t holds
//   quarter t; its dp group holds the two eighths of it), [S(0),S(0)] -AG(0)-> [R,S(0)] is not
//   (the dp group of tp rank 1 holds eighths 1 and 5, it needs 2 and 3). 7 rows on a 3x2 mesh:
//   [_S(0,2),S(0)] -_AG(0,sf=2)-> [R,S(0)] is not valid (row 6 sits on tp rank 0, tp rank 1
//   needs it).
// When no later mesh dim of size > 1 shards a touched tensor dim, the step is valid for every
// shape and is the plain collective (pieces are contiguous chunks in coordinate order):
// is_plain_step. Planners only emit valid steps; a Plan records the shapes it was checked for.
#pragma once

#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/placement.h"
#include "dtensor/plan/chain.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace dtensor {

using kernels::Dims;

// How each step runs is the executor's choice (NOTE [exchange] in dtensor/exec/executor.h);
// none pads: every piece moves at its exact size.
// S(d) or Rg(d) -> R: one all_gather straight into the result when d == 0, the step is plain and
// the pieces are equal S(0) chunks; otherwise an exchange (each piece straight to its place in
// the result: an all-gather of exact sizes, the wire carries no padding).
struct AllGather {
  int mesh_dim, tensor_dim;
};
struct StridedAllGather {  // _S(d,sf) -> R: an exchange (each piece straight to its place)
  int mesh_dim, tensor_dim, split_factor;
};
struct AllToAll {          // S(i) -> S(j): an exchange of exactly the elements each peer needs
  int mesh_dim, from_dim, to_dim;
};
// The reducing steps carry the wire dtype the planner gave them (nullopt: they move the reduce
// dtype; NOTE [wire dtype] in dtensor/exec/executor.h): with one, the step is an exchange of
// wire-dtype pieces, a local sum in the reduce dtype and, for P -> R, an all-gather in the wire.
struct AllReduce {         // P(op) -> R
  int mesh_dim;
  ReduceOp op;
  std::optional<kernels::DType> wire = std::nullopt;
};
// P(op) -> S(d) (split_factor 0), _S(d,split_factor) or the RaggedShard `ragged` (of dim d): a
// reduce_scatter (uneven chunks: an exchange, then a local reduce)
struct ReduceScatter {
  int mesh_dim, tensor_dim;
  ReduceOp op;
  int split_factor = 0;
  std::optional<kernels::DType> wire = std::nullopt;
  std::optional<RaggedShard> ragged = std::nullopt;
};
// R -> S(d) or _S(d,sf): keep this rank's piece, no communication. Also from a shard when every
// rank already holds its new layout (e.g. _S(0,1) -> S(0): the same layout; never plain).
struct LocalChunk {
  int mesh_dim;
  Placement to;
};
struct LocalPartial {      // R -> P(op): sum divides by the group size, avg/min/max keep the value
  int mesh_dim;
  ReduceOp op;
};
// S/_S(i) -> S/_S(j) other than a plain S(i) -> S(j), i != j (e.g. _S(0,2) -> S(0), or
// _S(0,2) -> S(1)): each element goes straight from the rank that holds it to the rank that
// needs it (one exchange); what PyTorch does through a full Replicate.
struct Regroup {
  int mesh_dim;
  Placement from, to;
};
// S(d) -> P(sum) (PyTorch 2.15): no communication; the rank's shard is placed at its position in
// a zero tensor of the group's extent, so the group's sum is the tensor.
struct LocalEmbed {
  int mesh_dim, tensor_dim;
};

using Step = std::variant<AllGather, StridedAllGather, AllToAll, AllReduce, ReduceScatter,
                          LocalChunk, LocalPartial, Regroup, LocalEmbed>;

int mesh_dim_of(const Step& step);
bool communicates(const Step& step);
// The placements after the step. REQUIRES: the step starts from placements[mesh_dim].
Placements apply_step(const Step& step, const Placements& placements);
// The placement the step leaves on its mesh dim (apply_step without the copy).
Placement placement_after(const Step& step);
// "AG(1)", "_AG(0,sf=2)", "A2A(0:0->1)", "AR(1,sum)", "RS(0:0,sum)", "RS(0:_S(0,4),sum)", "RS(0:Rg(0,[1,2],1),sum)",
// "RS(0:0,sum,wire=bf16)", "AR(1,avg,wire=f8e5m2)", "chunk(1->S(0))", "partial(1,sum)", "regroup(0:_S(0,2)->S(0))", "embed(0:S(0)->P(sum))".
std::string to_string(const Step& step);

// The single step that moves mesh dim m from `from` to `to` with everything else fixed, or
// nullopt when no primitive does (e.g. S(0) -> P(avg), _S -> P, P(a) -> P(b)). With `direct`
// the steps PyTorch lacks are allowed (Regroup, P -> _S reduce-scatter: the search planner);
// without it only PyTorch's primitives (S(d) -> P(sum) included).
std::optional<Step> step_between(int mesh_dim, const Placement& from, const Placement& to, bool direct);

// True when the step starts from the placement it converts (its kind matches before[mesh_dim])
// and its mesh dim is one of the mesh's.
bool starts_from(const Step& step, const Placements& before, const Dims& mesh_shape);
// The tensor dims the step splits or joins.
std::vector<int> touched_dims(const Step& step);
// The tensor dim a Shard, StridedShard or RaggedShard splits (nullopt for R and P).
std::optional<int> split_dim(const Placement& p);

// NOTE [step validity], decided by the layout algebra (dtensor/plan/chain.h) in work bounded by
// the step's split factors, size classes and later owner runs, never by the number of ranks:
// the step starts from what it converts and moves data only within groups along its mesh dim,
// for a tensor of `global_shape`. Throws Unsupported past the budget (chain.h: WorkBudget).
bool is_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape);
// NOTE [ragged plans] (transition.h): nullopt when neither state has a RaggedShard; otherwise
// whether the step is valid on the view `view_shape`: both states are its layouts, and either the
// step touches the ragged (last) dim and no other mesh dim of size > 1 splits it, or it is an
// all-reduce on another mesh dim (HSDP's dp_replicate).
std::optional<bool> ragged_step_valid(const Step& step, const Placements& before, const Placements& after,
                                      const Dims& view_shape, const Dims& mesh_shape);
bool is_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape,
                   WorkBudget& work);
// The step, its placements before and the shapes as integers, tagged, into `key`: the key of
// the per-call memos in WorkBudget. False when a RaggedShard is involved (its units may be many).
bool step_key(int64_t tag, const Step& step, const Placements& before, const Dims& global_shape,
              const Dims& mesh_shape, WorkBudget::Key& key);
// True when the step starts from what it converts and no later mesh dim of size > 1 shards a
// tensor dim it touches: valid for every global shape, and its pieces are contiguous chunks in
// coordinate order (the classic all_gather / reduce_scatter / all_to_all buffers).
bool is_plain_step(const Step& step, const Placements& before, const Dims& mesh_shape);

}  // namespace dtensor
