// DTensorSpec: the global description of a distributed tensor (mesh, one placement per mesh
// dim, global shape and stride, dtype). Constructed through make_spec, which validates and
// normalises, so every spec in the program is well formed.
//   auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
//   auto spec = make_spec(mesh, parse_placements("S(-1),R"), {8, 6}, DType::kF32);
//   spec.placements == {Shard{1}, Replicate{}};  spec.stride == {6, 1}
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "kernels/dtype.h"

namespace dtensor {

using kernels::DType;

struct DTensorSpec {
  std::shared_ptr<const DeviceMesh> mesh;
  Placements placements;
  Dims shape;   // global
  Dims stride;  // global, row-major unless given
  DType dtype = DType::kF32;

  int tensor_ndim() const { return shape.size(); }
  // The layout of `rank` (nullopt when it is not in the mesh).
  std::optional<ShardLayout> layout(int rank) const;
  // True when some mesh dim of size > 1 shards tensor_dim (even or uneven).
  bool is_sharded(int tensor_dim) const;
  friend bool operator==(const DTensorSpec& a, const DTensorSpec& b);
};

// Validates and normalises: placements.size() == mesh ndim, shard dims in range (negative dims
// normalised), split factors >= 1, Partial ops not mixed except sum with avg, shape entries
// >= 0. stride defaults to row-major. Throws InvalidArgument naming the offending value.
DTensorSpec make_spec(std::shared_ptr<const DeviceMesh> mesh, const Placements& placements,
                      const Dims& shape, DType dtype, std::optional<Dims> stride = std::nullopt);

// Normalises and validates placements for a mesh ndim and tensor ndim (see make_spec).
Placements normalize_placements(const Placements& placements, int mesh_ndim, int tensor_ndim);

// NOTE [mesh view] A tensor may be re-viewed on another mesh over the same ranks (a flattening,
// an unflattening, a permuted equivalent) with no communication exactly when every rank holds
// the same elements in the same local order under both, and Partial values reduce over the
// same ranks with the same op. Examples on ranks 0..3 (1-D dp mesh of 4 vs its (2,2)
// unflattening): [R] == [R,R]; [P] == [P,P]; [S(0)] == [S(0),S(0)] when the sizes divide
// (8 rows: 2 each either way) but not for 5 rows (flat 2,2,1,0 vs nested 2,1,1,1).
// Empty when `placements` on `mesh` is such a view of spec, else why not (the first rank whose
// layout differs, or the Partial groups that differ).
std::string view_mismatch(const DTensorSpec& spec, const DeviceMesh& mesh, const Placements& placements);
// Placements on `mesh` that view spec as NOTE [mesh view] allows, or nullopt. Tries, per mesh
// dim, R, the source's Partial op, S(t) and _S(t, sf) for the split factors that products of
// the mesh sizes give, first match in that order; nullopt for a RaggedShard spec (not searched).
std::optional<Placements> equivalent_placements(const DTensorSpec& spec, const DeviceMesh& mesh);

// "DTensorSpec(mesh=[[0,1],[2,3]], placements=[S(0),R], shape=[8,6], dtype=f32)".
std::string to_string(const DTensorSpec& spec);

}  // namespace dtensor
