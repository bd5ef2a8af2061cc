// The layout algebra the planner reasons with instead of per-rank layouts (NOTE [layout
// algebra]): what a placement list does to one tensor dim is a CHAIN of splits, one per mesh dim
// of size > 1 that shards that dim, in mesh-dim order; a rank's index set along the dim depends
// only on its coordinates along the chain's mesh dims.
//
// Example: [_S(0,4),S(0)] on a (2,4) mesh, 16 rows: chain(dim 0) = {mesh dim 0: k 2, sf 4;
// mesh dim 1: k 4, sf 0}; rank (1,2) holds rows {10,11} (pieces of 4 rows, second half of each
// over dp, then quarter 2 of those 8 rows over tp).
//
// NOTE [layout algebra] Planning asks three kinds of questions, each answered without a layout
// per rank:
//  - sizes: how many indices a rank holds under a chain. A split of n over k gives at most three
//    distinct piece sizes along the coordinate (torch.chunk: full pieces, one partial, empties;
//    a StridedShard adds one more set from its last piece), so the coordinates of one mesh dim
//    fall into a few intervals of equal size. for_each_size_class walks the product of those
//    intervals over every mesh dim for a set of chains at once: each class is a box of
//    coordinates in which every chain's local size is constant. Work: the number of classes,
//    bounded by (5 x chains)^mesh_ndim and in practice a few dozen; never the world size.
//  - owners: which coordinates (the piece index at every split) hold each index. owner_runs
//    lists them as runs over an index range, in work proportional to the runs it returns.
//  - equality of owners: whether two chains that differ at one mesh dim m give every index the
//    same owner along the later mesh dims (step validity, NOTE [step validity] in step.h). The
//    chains share the splits before m, so after them both split the same ordered list, whose
//    size takes a few values (the size classes of the common prefix): the check runs once per
//    distinct size. Each side is a few families (a piece of the split at m and an interval of
//    coordinates of equal sub-chunk size): windows of equal width that all hold the same pattern
//    of later owners. A pattern is a few affine segments (a family of the later splits whose
//    windows hold one owner each is one segment, its codes stepping by a constant), so it costs
//    the later splits' families, not their runs. On the overlap of two families both sides repeat
//    with period lcm(widths), so one period decides it; and since codes never decrease along a
//    segment while a varying pattern repeats its codes every window, a segment longer than the
//    other side's window is a mismatch at once. Work: families x segments per period, in
//    practice a few hundred units at any mesh size (tests compare it position by position).
// Everything counts its work in a WorkBudget; past it, planning fails with Unsupported naming
// the transition (never a silently worse route).
#pragma once

#include <boost/container/small_vector.hpp>
#include <boost/container_hash/hash.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/placement.h"
#include "kernels/dims.h"

namespace dtensor {

using kernels::Dims;

// One split of a chain: mesh dim, its size k (> 1), and the StridedShard split factor (0 for a
// plain Shard).
struct Split {
  int mesh_dim = 0;
  int64_t k = 1;
  int64_t sf = 0;
  friend bool operator==(const Split&, const Split&) = default;
};
// Inline up to 4 splits (a chain has one per mesh dim that shards its tensor dim): the planner
// builds chains on every search edge, and a heap allocation each was a third of its time.
using SplitList = boost::container::small_vector<Split, 4>;
inline std::span<const Split> span_of(const SplitList& s) { return {s.data(), s.size()}; }

// The chain of tensor dim t under placements (mesh dims of size 1 split nothing and are left out).
SplitList chain_of(const Placements& placements, const Dims& mesh_shape, int t);

// The number of indices piece c keeps when a list of n is split by s (split_positions' total).
int64_t piece_size(int64_t n, const Split& s, int64_t c);

// The work budget of one planning call (units: see WorkBudget). A search over a mesh of many
// dims can run past it: planning then fails with Unsupported naming the transition.
inline constexpr int64_t kMaxPlanWork = int64_t{1} << 24;

// Planning work, counted in units (a size class, an owner run, a coordinate evaluated); past
// `limit` the next add() throws Unsupported naming what() and the limit.
class WorkBudget {
 public:
  explicit WorkBudget(int64_t limit, std::function<std::string()> what = {}) : left_(limit), limit_(limit), what_(std::move(what)) {}
  void add(int64_t units) {
    left_ -= units;
    if (left_ < 0) fail();
  }
  int64_t used() const { return limit_ - left_; }
  // Owner checks already decided in this planning call (same_later_owners), by their inputs.
  using Key = boost::container::small_vector<int64_t, 24>;
  std::map<Key, bool> owner_checks;
  // The least a rank keeps through a same-dim regroup (traffic.cpp), by its inputs.
  std::map<Key, int64_t> kept_checks;
  // Step traffic in elements (sent, received; -1: moves nothing) already computed in this
  // planning call, by step_key (step.h): the search asks for an exchange's twice (inside the
  // LocalChunk check, then for its cost).
  struct KeyHash {
    size_t operator()(const Key& k) const { return boost::hash_range(k.begin(), k.end()); }
  };
  std::unordered_map<Key, std::pair<int64_t, int64_t>, KeyHash> step_elements;

 private:
  [[noreturn]] void fail() const;
  int64_t left_, limit_;
  std::function<std::string()> what_;
};

// A set of chains over one mesh, each applied to a list of n indices. add() returns the chain's
// index (equal chains share one).
class ChainSet {
 public:
  explicit ChainSet(Dims mesh_shape) : mesh_shape_(std::move(mesh_shape)) {}
  int add(int64_t n, const SplitList& splits);
  size_t size() const { return n_.size(); }
  const Dims& mesh_shape() const { return mesh_shape_; }
  int64_t extent(int chain) const { return n_[chain]; }
  const SplitList& splits(int chain) const { return splits_[chain]; }

 private:
  Dims mesh_shape_;
  boost::container::small_vector<int64_t, 8> n_;
  boost::container::small_vector<SplitList, 8> splits_;
};

// A box of coordinates (per mesh dim [lo, hi)) in which every chain of a set holds `sizes[i]`
// indices.
struct SizeClass {
  std::span<const int64_t> sizes;
  Dims lo, hi;
  int64_t count() const;  // coordinates in the box
};

// Calls f for every size class of the set (NOTE [layout algebra]); the boxes partition the mesh.
void for_each_size_class(const ChainSet& chains, WorkBudget& work, void* f, void (*call)(void*, const SizeClass&));
template <class F>
void for_each_size_class(const ChainSet& chains, WorkBudget& work, F&& f) {
  using Fn = std::remove_reference_t<F>;
  for_each_size_class(chains, work, const_cast<void*>(static_cast<const void*>(&f)),
                      [](void* p, const SizeClass& c) { (*static_cast<Fn*>(p))(c); });
}

// The distinct sizes a chain gives over every coordinate (of a list of n).
std::vector<int64_t> distinct_sizes(int64_t n, std::span<const Split> splits, const Dims& mesh_shape, WorkBudget& work);

// Positions [lo, hi) of a list of n, split by `splits` in order, as runs of equal owner code
// (the piece indices as a mixed-radix number, the first split most significant), adjacent equal
// runs merged. REQUIRES: 0 <= lo <= hi <= n.
struct OwnerRun {
  int64_t begin = 0, end = 0;
  int64_t code = 0;
};
void owner_runs(int64_t n, std::span<const Split> splits, int64_t lo, int64_t hi, std::vector<OwnerRun>& out,
                WorkBudget& work);

// Positions [lo, hi) of a list of n under `splits` as affine owner segments, in increasing
// order: position q of a segment lies in window (q - h) / w (windows of w positions from h) and
// has code code0 + that window's index x step. step 0: one owner; otherwise step is the product
// of the k of the splits after one split, whose piece index the windows step through (no carry
// into earlier splits). Work: about the chain's families, not its runs. REQUIRES: 0 <= lo <= hi <= n.
struct OwnerSegment {
  int64_t lo = 0, hi = 0, h = 0, w = 1, code0 = 0, step = 0;
};
void owner_segments(int64_t n, std::span<const Split> splits, int64_t lo, int64_t hi, std::vector<OwnerSegment>& out,
                    WorkBudget& work);

// The positions of a list of n a chain gives one coordinate (coords[i]: the piece at splits[i]),
// as runs in increasing order.
IndexRuns chain_positions(int64_t n, std::span<const Split> splits, std::span<const int64_t> coords);

// The coordinates c whose pieces under two splits of one list of n overlap (the only coordinates
// that keep anything through a regroup from one split to the other), as sorted disjoint
// intervals [first, second). Work: the split factors' pieces times their size classes.
std::vector<std::pair<int64_t, int64_t>> overlapping_pieces(int64_t n, const Split& a, const Split& b, WorkBudget& work);

// True when every position of a list of n has the same owner code along `later` under the chain
// (a, later) as under (b, later), where a and b are optional splits at one mesh dim before the
// later ones (NOTE [layout algebra]: the equality of owners behind step validity).
bool same_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                       std::span<const Split> later, WorkBudget& work);

// same_later_owners without its per-call cache; `probes` false also skips the few positions
// checked directly first (they decide most unequal pairs before the families are built), so tests
// can check the family comparison alone.
bool compare_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                          std::span<const Split> later, WorkBudget& work, bool probes = true);

}  // namespace dtensor
