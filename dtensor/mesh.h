// DeviceMesh: an N-D array of global ranks with optional unique dim names. Pure data: the
// communicators of a mesh are built by the collectives layer from this description.
//
// Example: DeviceMesh::from_shape({2, 4}, {"dp", "tp"}) holds [[0,1,2,3],[4,5,6,7]];
//   coord_of(6) == {1, 2};  group(0, 6) == {2, 6};  group(1, 6) == {4, 5, 6, 7};
//   slice({"tp"}, 6) is the 1-D mesh [4,5,6,7] named "tp";
//   flatten() is the 1-D mesh [0..7] named "dp_tp";
//   unflatten(1, {2, 2}, {"a", "b"}) is [[[0,1],[2,3]],[[4,5],[6,7]]] named (dp,a,b).
// A mesh dim's group is the set of ranks that agree on every other coordinate, ordered by their
// coordinate along that dim, so the group-local rank equals coord[mesh_dim]
// (docs/pytorch-semantics.md 1.2; everything here is defined by coordinate, never by rank order).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/dims.h"

namespace dtensor {

using kernels::Dims;

// Limits, checked with an InvalidArgument naming the value: a mesh holds at most kMaxMeshRanks
// ranks (2^20, beyond any cluster; planning and the per-rank layout tables are linear or worse
// in it) and ranks are ints in 0..kMaxRank. Mesh shapes have at most kernels::kMaxDims dims.
inline constexpr int64_t kMaxMeshRanks = int64_t{1} << 20;
inline constexpr int64_t kMaxRank = 2147483647;

class DeviceMesh {
 public:
  // The row-major arange over shape: rank r sits at the row-major unravel of r.
  static DeviceMesh from_shape(const Dims& shape, std::vector<std::string> names = {});
  // Parses "4x2" (row-major shape; "8" is 1-D) or an explicit nested array "[[0,2],[1,3]]".
  // Throws InvalidArgument naming the text and what was expected.
  static DeviceMesh parse(std::string_view text, std::vector<std::string> names = {});

  // An explicit array: ranks in row-major order for the given shape. Ranks must be distinct
  // and >= 0; names, when given, one per dim, unique and non-empty.
  DeviceMesh(const Dims& shape, std::vector<int> ranks, std::vector<std::string> names = {});

  int ndim() const { return shape_.size(); }
  const Dims& shape() const { return shape_; }
  int64_t size(int mesh_dim) const;
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  // Ranks in row-major order of the mesh array.
  const std::vector<int>& ranks() const { return ranks_; }
  const std::vector<std::string>& names() const { return names_; }
  bool has_names() const { return !names_.empty(); }
  // Mesh dim of a name; throws InvalidArgument listing the known names.
  int mesh_dim(std::string_view name) const;

  bool contains(int rank) const { return flat_index(rank) >= 0; }
  int rank_at(const Dims& coord) const;
  // Coordinate of rank; nullopt when the rank is not in the mesh.
  std::optional<Dims> coord_of(int rank) const;
  // The ranks of rank's group along mesh_dim, ordered by coordinate (throws if rank is absent).
  std::vector<int> group(int mesh_dim, int rank) const;
  // All groups along mesh_dim, in row-major order of the remaining coordinates.
  std::vector<std::vector<int>> groups(int mesh_dim) const;

  // The sub-mesh containing `rank` that keeps the named dims (in ascending mesh-dim order, as
  // PyTorch requires) and fixes the others at rank's coordinate. Slicing with all names returns
  // an equal mesh.
  DeviceMesh slice(std::span<const std::string> names, int rank) const;
  DeviceMesh slice_dims(std::span<const int> mesh_dims, int rank) const;

  // Merges the given mesh dims (distinct, ascending; need not be adjacent) into one dim at the
  // position of the first, with coordinate = row-major linearisation over them. The new dim is
  // named `name`, or the merged names joined by '_' when empty (meshes without names stay
  // without names). flatten() merges every dim into a 1-D mesh.
  DeviceMesh flatten(std::span<const int> mesh_dims, std::string name = "") const;
  DeviceMesh flatten(std::string name = "") const;

  // PyTorch's _unflatten(dim, sizes, names): mesh dim `mesh_dim` becomes len(sizes) dims of those
  // sizes (product = its size), row-major: coordinate c of the old dim is the row-major
  // linearisation of the new coordinates, so the rank array is the same, reshaped. A named mesh
  // needs one new, unique name per new dim; an unnamed mesh takes none.
  //   from_shape({8}, {"dp"}).unflatten(0, {2, 4}, {"rep", "shard"}) == from_shape({2, 4}, {"rep", "shard"})
  // flatten() over the new dims gives the original mesh back (names aside).
  DeviceMesh unflatten(int mesh_dim, const Dims& sizes, std::vector<std::string> names = {}) const;
  DeviceMesh unflatten(std::string_view name, const Dims& sizes, std::vector<std::string> names) const;

  friend bool operator==(const DeviceMesh& a, const DeviceMesh& b) {  // O(1) for one object, else O(size)
    return &a == &b || (a.shape_ == b.shape_ && a.ranks_ == b.ranks_ && a.names_ == b.names_);
  }

 private:
  int check_mesh_dim(int mesh_dim) const;
  // Flat (row-major) position of rank in ranks_, or -1.
  int64_t flat_index(int rank) const;

  Dims shape_;
  std::vector<int> ranks_;
  std::vector<std::string> names_;
  std::vector<std::pair<int, int64_t>> position_;  // (rank, flat index), sorted by rank
};

// Row-major index <-> coordinate over a shape (the mesh's and the flatten's linearisation).
//   unravel_index(6, {2,4}) == {1,2};  ravel_index({1,2}, {2,4}) == 6
Dims unravel_index(int64_t flat, const Dims& shape);
int64_t ravel_index(const Dims& coord, const Dims& shape);

// "[[0,1],[2,3]]" followed by " (dp,tp)" when named.
std::string to_string(const DeviceMesh& mesh);

}  // namespace dtensor
