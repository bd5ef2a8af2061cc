// Placements: how a tensor is laid out over one mesh dim. A closed variant, compared as in
// PyTorch: StridedShard(d, 1) != Shard(d) (different kinds), Partial compares its op.
//
// Notation (parse_placement / to_string): S(0)  _S(0,2)  R  P  P(avg) P(min) P(max) P(prod)
// Rg(0,[1,2,0,1],4). The parser also accepts Shard(0), _S(0,sf=2), SS(0,2), Replicate(),
// Partial(sum), RaggedShard(0,units=[1,2],align=4) and spaces.
// Shard dims may be negative until normalised against a tensor's ndim.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kernels/reduce_op.h"

namespace dtensor {

using kernels::ReduceOp;

// The largest StridedShard split factor (parse_placement and normalize reject larger ones by
// name). Split factors are products of mesh dim sizes, so this matches kMaxMeshRanks; a layout
// holds at most one index run per non-empty piece.
inline constexpr int kMaxSplitFactor = 1 << 20;

struct Shard {
  int dim = 0;
  friend bool operator==(const Shard&, const Shard&) = default;
};
// PyTorch's _StridedShard: split the current extent into split_factor pieces, split each piece
// over the mesh dim, and keep the concatenation of this coordinate's sub-pieces
// (docs/pytorch-semantics.md 2.3).
struct StridedShard {
  int dim = 0;
  int split_factor = 1;
  friend bool operator==(const StridedShard&, const StridedShard&) = default;
};
// RaggedShard: the flattening of tensor dims dim..end (of what earlier mesh dims left) cut into
// one contiguous range per coordinate of the mesh dim, range i proportional to units[i] (zeros
// allowed), every boundary but the end a multiple of `align` (ragged_chunk in layout.h). Its
// layouts are of the view [s_0, ..., s_{dim-1}, s_dim x ... x s_{n-1}] (layout.h, NOTE [ragged
// view]); S(0) of an [n, r] tensor over k ranks is Rg(0,[chunk sizes],r) of its view.
//   Rg(0,[1,2,0,1],4) of 10 elements: ranges [0,0) [0,4) [4,4) [4,10).
struct RaggedShard {
  int dim = 0;
  std::vector<int64_t> units;
  int64_t align = 1;
  friend bool operator==(const RaggedShard&, const RaggedShard&) = default;
};
// The most units a RaggedShard takes (one per rank of a mesh dim: kMaxMeshRanks) and the
// largest unit and alignment.
inline constexpr int64_t kMaxRaggedUnits = int64_t{1} << 20;
inline constexpr int64_t kMaxRaggedValue = int64_t{1} << 40;

struct Replicate {
  friend bool operator==(const Replicate&, const Replicate&) = default;
};
struct Partial {
  ReduceOp op = ReduceOp::kSum;
  friend bool operator==(const Partial&, const Partial&) = default;
};

using Placement = std::variant<Shard, StridedShard, Replicate, Partial, RaggedShard>;
using Placements = std::vector<Placement>;

inline bool is_shard(const Placement& p) { return std::holds_alternative<Shard>(p); }
inline bool is_strided_shard(const Placement& p) { return std::holds_alternative<StridedShard>(p); }
inline bool is_replicate(const Placement& p) { return std::holds_alternative<Replicate>(p); }
inline bool is_partial(const Placement& p) { return std::holds_alternative<Partial>(p); }
inline bool is_ragged(const Placement& p) { return std::holds_alternative<RaggedShard>(p); }
// The tensor dim split by a Shard or StridedShard, nullopt otherwise (RaggedShard: ragged_dim).
std::optional<int> shard_dim(const Placement& p);
// The first flattened dim of a RaggedShard, nullopt otherwise.
std::optional<int> ragged_dim(const Placement& p);
// The mesh dim of the RaggedShard in `ps` (-1: none). Throws Unsupported when there are several.
int ragged_mesh_dim(const Placements& ps);

// Normalises a negative shard dim against tensor_ndim; throws InvalidArgument when the dim is
// out of range ("shard dim 2 of S(2) out of range for a 2-d tensor (expected -2..1)"), the
// split factor is < 1, or a RaggedShard's units are negative, sum to 0 or its align is < 1.
Placement normalize(const Placement& p, int tensor_ndim);

std::string to_string(const Placement& p);
// Comma-separated without spaces: "S(0),R".
std::string to_string(const Placements& ps);
// Throws InvalidArgument naming the text and the accepted notation.
Placement parse_placement(std::string_view text);
// A comma-separated list, optionally in brackets: "S(0),_S(0,2)" or "[R, P(avg)]".
Placements parse_placements(std::string_view text);

}  // namespace dtensor
