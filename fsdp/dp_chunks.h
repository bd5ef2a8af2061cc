// Whether FSDP's dp shards are chunks of each tensor-parallel shard, for every rank, decided from
// the placements, the mesh shape and the global shape alone (never a layout per rank).
//
// fully_shard keeps, per parameter, the tensor-parallel local tensor (the placements without the
// dp split, `unsharded`) and gives dp rank c chunk c of it along dim sd (torch.chunk over the dp
// group). The sharded DTensor (`sharded`: Shard(sd), or StridedShard(sd, sf) when later mesh dims
// also split sd) must hold exactly those positions on every rank.
//
//   // FSDP x TP on a (3, 2) mesh, 50 rows: tp shards of 25 rows, dp chunks 9/8/8 of each: valid
//   check_dp_chunks({50, 16}, {3, 2}, parse_placements("R,S(0)"), parse_placements("_S(0,2),S(0)"), 0, 0)
//       == std::nullopt
//
// How: along sd a placement list is a chain of splits (dtensor/plan/chain.h). With E the splits
// before the dp mesh dim and L those after it, every rank's index list is E's list (of a few
// distinct sizes m) split further, so the check runs once per distinct m:
//  - nothing to do when the dp split is the last (torch.chunk of the tp list by definition) or
//    the tp pieces are even (m divisible by sf: chunk c of each tp piece is what the strided
//    split takes);
//  - one tp split (the FSDP x TP case): by piece sizes alone, O(dp);
//  - otherwise (several mesh dims after dp split sd) positions are compared per dp piece and per
//    coordinate of L's mesh dims: O(dp x their group), bounded by dtensor::kMaxPlanWork.
// Replicate dims and dims splitting other tensor dims never count.
#pragma once

#include <cstdint>
#include <optional>

#include "dtensor/placement.h"
#include "kernels/dims.h"

namespace fsdp {

struct DpChunkVerdict {
  enum Kind { kIndivisible, kNotChunks };
  // kIndivisible: sd > 0 and a tensor-parallel shard's dim sd (size `size`) is not a multiple of
  // dp. kNotChunks: the dp shards are not chunks of the tp shard (`size`: the global dim sd).
  Kind kind = kNotChunks;
  int64_t size = 0;
  friend bool operator==(const DpChunkVerdict&, const DpChunkVerdict&) = default;
};

// nullopt when the layout is valid on every rank. Every rank reaches the same verdict (it depends
// on global data only). Throws Unsupported when the check needs more than dtensor::kMaxPlanWork
// units (an uneven dim over a huge tensor-parallel group).
// REQUIRES: sharded equals unsharded except at shard_mesh_dim, where unsharded is Replicate;
// 0 <= sd < global_shape.size(); placements normalised.
std::optional<DpChunkVerdict> check_dp_chunks(const kernels::Dims& global_shape, const kernels::Dims& mesh_shape,
                                              const dtensor::Placements& unsharded,
                                              const dtensor::Placements& sharded, int shard_mesh_dim, int sd);

// The same verdict computed rank by rank (two layouts per mesh coordinate): the reference the
// tests compare check_dp_chunks against on small meshes. When a rank fails both ways the first
// failing rank's first failure wins, so only validity is comparable, not always the kind.
std::optional<DpChunkVerdict> check_dp_chunks_by_rank(const kernels::Dims& global_shape,
                                                      const kernels::Dims& mesh_shape,
                                                      const dtensor::Placements& unsharded,
                                                      const dtensor::Placements& sharded, int shard_mesh_dim, int sd);

}  // namespace fsdp
