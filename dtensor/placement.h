// Placements: how a tensor is laid out over one mesh dim. A closed variant, compared as in
// PyTorch: StridedShard(d, 1) != Shard(d) (different kinds), Partial compares its op.
//
// Notation (parse_placement / to_string): S(0)  _S(0,2)  R  P  P(avg) P(min) P(max) P(prod).
// The parser also accepts Shard(0), _S(0,sf=2), SS(0,2), Replicate(), Partial(sum) and spaces.
// Shard dims may be negative until normalised against a tensor's ndim.
#pragma once

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
struct Replicate {
  friend bool operator==(const Replicate&, const Replicate&) = default;
};
struct Partial {
  ReduceOp op = ReduceOp::kSum;
  friend bool operator==(const Partial&, const Partial&) = default;
};

using Placement = std::variant<Shard, StridedShard, Replicate, Partial>;
using Placements = std::vector<Placement>;

inline bool is_shard(const Placement& p) { return std::holds_alternative<Shard>(p); }
inline bool is_strided_shard(const Placement& p) { return std::holds_alternative<StridedShard>(p); }
inline bool is_replicate(const Placement& p) { return std::holds_alternative<Replicate>(p); }
inline bool is_partial(const Placement& p) { return std::holds_alternative<Partial>(p); }
// The tensor dim split by a Shard or StridedShard, nullopt otherwise.
std::optional<int> shard_dim(const Placement& p);

// Normalises a negative shard dim against tensor_ndim; throws InvalidArgument when the dim is
// out of range ("shard dim 2 of S(2) out of range for a 2-d tensor (expected -2..1)") or the
// split factor is < 1.
Placement normalize(const Placement& p, int tensor_ndim);

std::string to_string(const Placement& p);
// Comma-separated without spaces: "S(0),R".
std::string to_string(const Placements& ps);
// Throws InvalidArgument naming the text and the accepted notation.
Placement parse_placement(std::string_view text);
// A comma-separated list, optionally in brackets: "S(0),_S(0,2)" or "[R, P(avg)]".
Placements parse_placements(std::string_view text);

}  // namespace dtensor
