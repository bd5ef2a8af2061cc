// Element ownership: which global indices each rank holds, exactly as PyTorch DTensor
// (docs/pytorch-semantics.md 2.1-2.4). Pure functions of (global shape, mesh shape, placements,
// coord).
//
// NOTE [chunk rule] An extent of n split over k follows torch.chunk: pieces of c = ceil(n/k),
// trailing pieces may be empty (9 over 4 -> 3,3,3,0, never 3,2,2,2).
// NOTE [nested sharding] Placements apply left to right over mesh dims; each Shard splits what
// the earlier mesh dims left of that tensor dim (5 rows on (2,2) [S(0),S(0)] -> 2,1,1,1).
// NOTE [sentinel offset] A rank holding nothing of a sharded dim reports offset = global size.
// NOTE [ragged view] With a RaggedShard(d) (placement.h), layouts are of the view
// [s_0, ..., s_{d-1}, s_d x ... x s_{n-1}] (ragged_view): d + 1 dims, the last one the flattened
// index. It composes where every rank's set stays a product of ranges: R and P anywhere, S/_S of
// dims < d anywhere, and S(d) on a LATER mesh dim (it chunks the rank's range, torch.chunk of
// elements). Anything else is refused (Unsupported, naming both placements).
//
// Example: shape (13,2), mesh (4,2), [S(0),S(0)], coord (3,1): local_shape (0,2),
//   global_offset (13,0), indices {[], [0,1]}.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dtensor/mesh.h"
#include "dtensor/placement.h"

namespace dtensor {

// A rank's layout holds at most this many index runs per tensor dim (one per non-empty
// StridedShard piece, multiplied by nested StridedShards); beyond it compute_layout throws
// Unsupported naming the placements, instead of exhausting memory.
inline constexpr int64_t kMaxIndexRuns = int64_t{1} << 22;

// One piece of torch.chunk: [offset, offset + size).
struct Chunk {
  int64_t offset = 0;
  int64_t size = 0;
  friend bool operator==(const Chunk&, const Chunk&) = default;
};
// Piece `index` of n split into k by the chunk rule. offset follows PyTorch's closed form: an
// empty piece that starts past the end reports offset n. REQUIRES: n >= 0, k >= 1, 0 <= index < k.
Chunk chunk(int64_t n, int64_t k, int64_t index);

// Piece `index` of a list of n cut by a RaggedShard's units and alignment: with U the units' sum
// and P_i the sum of units[0..i), boundary i is floor(floor(n x P_i / U) / align) x align for
// i < k and n for i == k; piece i is [boundary i, boundary i+1). Empty pieces report their
// boundary (compute_layout turns them into the sentinel offset).
//   ragged_chunk(10, {1,2,0,1}, 4, i): {0,0} {0,4} {4,0} {4,6}
//   ragged_chunk(n x r, chunk sizes of n over k, r, i) == S(0)'s rows of [n, r] times r
// REQUIRES: n >= 0, units valid (normalize), 0 <= index < units.size().
Chunk ragged_chunk(int64_t n, const std::vector<int64_t>& units, int64_t align, int64_t index);
// Every boundary at once, in O(units): out[i] is piece i's start, out[units.size()] == n
// (ragged_chunk's piece i is [out[i], out[i+1])). Same REQUIRES.
std::vector<int64_t> ragged_boundaries(int64_t n, const std::vector<int64_t>& units, int64_t align);

// The shape layouts use for `placements` (NOTE [ragged view]): global_shape itself without a
// RaggedShard. Throws Unsupported for several ragged mesh dims or a placement that does not
// compose with the RaggedShard, InvalidArgument for a ragged dim out of range or an overflow.
Dims ragged_view(const Dims& global_shape, const Placements& placements);

// A box (global offsets and sizes per dim) that is one contiguous range of a row-major
// flattening; `flat` is the flat index of its first element.
struct FlatBox {
  Dims offsets, sizes;
  int64_t flat = 0;
  friend bool operator==(const FlatBox&, const FlatBox&) = default;
};
// The boxes of the flat range [start, start + length) of a row-major tensor of shape `dims`, in
// flat order: a partial first row, the full rows, a partial last row, each partial row split the
// same way one dim further in. At most 2 x dims.size() - 1 boxes (one when the range is whole
// rows), each contiguous in the flattening; none for an empty range. This is how a RaggedShard's
// 1-D range (NOTE [ragged view]) becomes boxes of the tensor's own dims (checkpoints: DCP chunks).
//   flat_range_boxes({3,4,5}, 7, 45): [7, 52) from (0,1,2) to (2,2,1) inclusive:
//     offsets (0,1,2) sizes (1,1,3) flat 7     the rest of row (0,1)
//     offsets (0,2,0) sizes (1,2,5) flat 10    the rest of plane 0
//     offsets (1,0,0) sizes (1,4,5) flat 20    plane 1 whole
//     offsets (2,0,0) sizes (1,2,5) flat 40    plane 2 up to row (2,2)
//     offsets (2,2,0) sizes (1,1,2) flat 50    row (2,2) up to column 2
//   flat_range_boxes({4,6}, 6, 12): one box, offsets (1,0) sizes (2,6) flat 6
// REQUIRES: dims non-negative with a product that fits int64, 0 <= start, 0 <= length,
// start + length <= the product (InvalidArgument naming the range and shape otherwise).
std::vector<FlatBox> flat_range_boxes(const Dims& dims, int64_t start, int64_t length);

// A run of consecutive global indices [start, start + length).
struct IndexRun {
  int64_t start = 0;
  int64_t length = 0;
  friend bool operator==(const IndexRun&, const IndexRun&) = default;
};
using IndexRuns = std::vector<IndexRun>;

// What one rank holds of a tensor: per tensor dim, the global indices in local order as runs.
struct ShardLayout {
  Dims local_shape;
  Dims global_offset;
  std::vector<IndexRuns> runs;  // one list per tensor dim, adjacent runs merged

  // Every held global index of tensor_dim, in local order: local_shape[tensor_dim] int64, so
  // for tools, tests and small tensors only. Library code walks `runs` or uses HeldIndices, which
  // take memory in the number of runs, never in the size of the dim.
  std::vector<int64_t> indices(int tensor_dim) const;
  // True when tensor_dim is held as one contiguous range (or not at all).
  bool contiguous(int tensor_dim) const { return runs[tensor_dim].size() <= 1; }
};

// The layout of the rank at `coord` of a mesh of shape `mesh_shape` (of ragged_view(global_shape,
// placements) when a mesh dim is ragged: one unit per coordinate of it).
// REQUIRES: placements normalised (non-negative shard dims < global_shape.size()), one per mesh
// dim, split factors >= 1, coord inside mesh_shape. Throws InvalidArgument otherwise.
//   Example: shape (3,4), mesh (2,2), [Rg(0,[1,2],1),S(0)], coord (1,0): the view is (12),
//   rank (1,*) holds [4,12), tp rank 0 its first half: local_shape (4), offset (4), runs {[4,8)}.
ShardLayout compute_layout(const Dims& global_shape, const Dims& mesh_shape,
                           const Placements& placements, const Dims& coord);

// The layout of global `rank`, or nullopt when the rank is not in the mesh (PyTorch: shape (0,)).
std::optional<ShardLayout> layout_of_rank(const Dims& global_shape, const DeviceMesh& mesh,
                                          const Placements& placements, int rank);

// Elements two layouts of the same tensor have in common (per tensor dim, the intersection of
// the held index sets; the product over dims). Throws InvalidArgument when their dims differ.
int64_t common_elements(const ShardLayout& a, const ShardLayout& b);

// Positions [offset, offset + size) of the index list `runs` describes (local order), as runs:
// a slice of a layout's held indices without listing them.
//   slice_runs({{0,4},{8,4}}, 2, 4) == {{2,2},{8,2}}
// REQUIRES: 0 <= offset, 0 <= size, offset + size <= the runs' total length (InvalidArgument).
IndexRuns slice_runs(const IndexRuns& runs, int64_t offset, int64_t size);

// Local position -> global index of one tensor dim, in O(log runs) and memory in the number of
// runs (ShardLayout::indices would list every index):
//   HeldIndices h(IndexRuns{{0,2},{6,2}});   // local positions 0,1,2,3 hold 0,1,6,7
//   h.size() == 4; h[2] == 6
class HeldIndices {
 public:
  explicit HeldIndices(IndexRuns runs);
  int64_t size() const { return size_; }
  // REQUIRES: 0 <= pos < size() (unchecked).
  int64_t operator[](int64_t pos) const {
    if (runs_.size() == 1) return runs_[0].start + pos;
    const size_t i = run_of(pos);
    return runs_[i].start + (pos - first_[i]);
  }

 private:
  size_t run_of(int64_t pos) const;
  IndexRuns runs_;
  std::vector<int64_t> first_;  // the local position of each run's first index
  int64_t size_ = 0;
};

// The index-list form of one split, for tests and tools: the positions (0..n-1 of the current
// extent) that piece `index` keeps under Shard (split_factor == 0) or StridedShard.
IndexRuns split_positions(int64_t n, int64_t k, int64_t index, int split_factor);

}  // namespace dtensor
