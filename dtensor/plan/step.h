// Steps of a redistribute plan: each changes the placement of ONE mesh dim, on the group of
// ranks that differ only in that mesh coordinate. A closed variant, so apply / cost / to_string /
// execute must handle every kind at compile time.
//
// Example: [S(0),S(1)] -> [S(1),S(0)] on a 2x2 mesh, greedy (PyTorch's route):
//   AllGather{1, 1}        [S(0),S(1)] -AG(1)->       [S(0),R]
//   AllToAll{0, 0, 1}      [S(0),R]    -A2A(0:0->1)-> [S(1),R]
//   LocalChunk{1, S(0)}    [S(1),R]    -chunk(1)->    [S(1),S(0)]
//
// NOTE [step validity] A step on mesh dim m is one group collective (or a local op) only when
// no later mesh dim m' > m shards a tensor dim the step splits or joins: the later dims split
// what mesh dim m leaves, so changing m under them moves data between every rank of the mesh.
// Planners only emit valid steps (is_valid_step); execute() checks it again.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "dtensor/placement.h"
#include "kernels/dims.h"

namespace dtensor {

using kernels::Dims;

struct AllGather {         // S(d) -> R: pad, all-gather along d, narrow
  int mesh_dim, tensor_dim;
};
struct StridedAllGather {  // _S(d,sf) -> R: pad to the largest piece, all-gather, reorder
  int mesh_dim, tensor_dim, split_factor;
};
struct AllToAll {          // S(i) -> S(j): pad both, all-to-all, narrow
  int mesh_dim, from_dim, to_dim;
};
struct AllReduce {         // P(op) -> R
  int mesh_dim;
  ReduceOp op;
};
struct ReduceScatter {     // P(op) -> S(d): pad d, reduce-scatter, narrow
  int mesh_dim, tensor_dim;
  ReduceOp op;
};
struct LocalChunk {        // R -> S(d) or _S(d,sf): keep this rank's piece, no communication
  int mesh_dim;
  Placement to;
};
struct LocalPartial {      // R -> P(op): sum divides by the group size, avg/min/max keep the value
  int mesh_dim;
  ReduceOp op;
};
// S/_S(d) -> S/_S(d) on the same tensor dim (e.g. _S(0,2) -> S(0)): each element goes straight
// from the rank that holds it to the rank that needs it (one all_to_all_v); what PyTorch does
// through a full Replicate.
struct Regroup {
  int mesh_dim;
  Placement from, to;
};

using Step = std::variant<AllGather, StridedAllGather, AllToAll, AllReduce, ReduceScatter,
                          LocalChunk, LocalPartial, Regroup>;

int mesh_dim_of(const Step& step);
bool communicates(const Step& step);
// The placements after the step. REQUIRES: the step starts from placements[mesh_dim].
Placements apply_step(const Step& step, const Placements& placements);
// Placement the step expects on its mesh dim before it runs.
Placement source_of(const Step& step, const Placements& before);
// "AG(1)", "_AG(0,sf=2)", "A2A(0:0->1)", "AR(1,sum)", "RS(0:0,sum)", "chunk(1->S(0))",
// "partial(1,sum)", "regroup(0:_S(0,2)->S(0))".
std::string to_string(const Step& step);

// The single step that moves mesh dim m from `from` to `to` with everything else fixed, or
// nullopt when no primitive does (e.g. S(0) -> P, or _S(0,2) -> S(1)). With `direct` the
// Regroup step is allowed (the search planner); without it only PyTorch's primitives.
std::optional<Step> step_between(int mesh_dim, const Placement& from, const Placement& to, bool direct);

// NOTE [step validity], for placements before the step on a mesh of `mesh_shape` (a later mesh
// dim of size 1 splits nothing, so it never invalidates a step).
bool is_valid_step(const Step& step, const Placements& before, const Dims& mesh_shape);

}  // namespace dtensor
