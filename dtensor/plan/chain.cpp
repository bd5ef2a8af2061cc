#include "dtensor/plan/chain.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

namespace {

// The hot loops divide a lot: the checked forms only off the fast path.
inline int64_t ceil_div(int64_t a, int64_t b) {
  if (a < 0 || b < 1) [[unlikely]]
    return kernels::checked_ceil_div(a, b, "chunk size");
  return a / b + (a % b != 0);
}

// dtensor::chunk (layout.h), inline.
inline Chunk chunk_at(int64_t n, int64_t k, int64_t index) {
  if (n < 0 || k < 1) [[unlikely]]
    return chunk(n, k, index);
  const int64_t c = ceil_div(n, k);
  int64_t start = 0;
  if (__builtin_mul_overflow(index, c, &start) || start > n) return {n, 0};
  return {start, std::min(n - start, c)};
}

// The piece lengths of a split of a list of n: one piece of n (Shard), or `full` pieces of
// `length` and one of `last` (StridedShard; last may be 0).
struct Pieces {
  int64_t length = 0, full = 0, last = 0;
  int64_t count() const { return full + (last > 0 ? 1 : 0); }
};

Pieces pieces_of(int64_t n, const Split& s) {
  if (s.sf == 0) return {n, n > 0 ? 1 : 0, 0};
  if (n == 0) return {};
  const int64_t length = ceil_div(n, s.sf);
  const int64_t full = n / length;
  return {length, full, n - full * length};
}

// Coordinates in (0, k) where chunk(length, k, c).size changes.
template <class V>
void chunk_breakpoints(int64_t length, int64_t k, V& out) {
  if (length <= 0) return;
  const int64_t cs = ceil_div(length, k);
  const int64_t q = length / cs;
  for (int64_t c : {q, q + 1})
    if (c > 0 && c < k) out.push_back(c);
}

template <class V>
void breakpoints(int64_t n, const Split& s, V& out) {
  const Pieces p = pieces_of(n, s);
  chunk_breakpoints(p.length, s.k, out);
  chunk_breakpoints(p.last, s.k, out);
}

template <class V>
void sort_unique(V& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

// 0, s.k and the coordinates between where a piece size of a list of n under s changes, sorted.
std::vector<int64_t> coordinate_cuts(int64_t n, const Split& s) {
  std::vector<int64_t> cuts = {0, s.k};
  breakpoints(n, s, cuts);
  sort_unique(cuts);
  return cuts;
}

}  // namespace

void WorkBudget::fail() const {
  throw kernels::Unsupported(fmt::format("{}: planning needs more than its work budget of {} units{}",
                                         what_ ? what_() : std::string("planning"), limit_,
                                         " (a search over many mesh dims, or layouts cut into many runs)"));
}

SplitList chain_of(const Placements& placements, const Dims& mesh_shape, int t) {
  SplitList out;
  for (int m = 0; m < mesh_shape.size() && m < static_cast<int>(placements.size()); ++m) {
    if (mesh_shape[m] <= 1 || shard_dim(placements[m]) != t) continue;
    int64_t sf = 0;
    if (const auto* s = std::get_if<StridedShard>(&placements[m])) sf = s->split_factor;
    out.push_back({m, mesh_shape[m], sf});
  }
  return out;
}

int64_t piece_size(int64_t n, const Split& s, int64_t c) {
  if (s.sf == 0) return chunk_at(n, s.k, c).size;
  const Pieces p = pieces_of(n, s);
  if (p.full == 0 && p.last == 0) return 0;
  int64_t size = p.full * chunk_at(p.length, s.k, c).size;
  if (p.last > 0) size += chunk_at(p.last, s.k, c).size;
  return size;
}

int ChainSet::add(int64_t n, const SplitList& splits) {
  for (size_t i = 0; i < n_.size(); ++i)
    if (n_[i] == n && splits_[i] == splits) return static_cast<int>(i);
  n_.push_back(n);
  splits_.push_back(splits);
  return static_cast<int>(n_.size()) - 1;
}

int64_t SizeClass::count() const {
  int64_t c = 1;
  for (int d = 0; d < lo.size(); ++d) c *= hi[d] - lo[d];
  return c;
}

void for_each_size_class(const ChainSet& chains, WorkBudget& work, void* f, void (*call)(void*, const SizeClass&)) {
  const Dims& mesh = chains.mesh_shape();
  const int ndim = mesh.size();
  const size_t n = chains.size();
  // The chains' splits by mesh dim: at[first[d] .. first[d + 1]) split at mesh dim d.
  struct At {
    size_t chain;
    Split split;
  };
  boost::container::small_vector<At, 16> at;
  boost::container::small_vector<size_t, 8> first(ndim + 1, 0);
  for (int d = 0; d < ndim; ++d) {
    first[d] = at.size();
    for (size_t i = 0; i < n; ++i)
      for (const Split& s : chains.splits(static_cast<int>(i)))
        if (s.mesh_dim == d) at.push_back({i, s});
  }
  first[ndim] = at.size();
  boost::container::small_vector<int64_t, 16> sizes(n);
  for (size_t i = 0; i < n; ++i) sizes[i] = chains.extent(static_cast<int>(i));
  SizeClass cls{{sizes.data(), sizes.size()}, Dims::filled(ndim, 0), mesh};
  auto rec = [&](auto& self, int d) -> void {
    if (d == ndim) {
      work.add(1);
      call(f, cls);
      return;
    }
    if (first[d] == first[d + 1]) {
      cls.lo[d] = 0;
      cls.hi[d] = mesh[d];
      return self(self, d + 1);
    }
    boost::container::small_vector<int64_t, 16> cuts{0, mesh[d]};
    boost::container::small_vector<int64_t, 8> saved;
    for (size_t x = first[d]; x < first[d + 1]; ++x) {
      breakpoints(sizes[at[x].chain], at[x].split, cuts);
      saved.push_back(sizes[at[x].chain]);
    }
    sort_unique(cuts);
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      for (size_t x = first[d]; x < first[d + 1]; ++x)
        sizes[at[x].chain] = piece_size(saved[x - first[d]], at[x].split, cuts[j]);
      cls.lo[d] = cuts[j];
      cls.hi[d] = cuts[j + 1];
      self(self, d + 1);
    }
    for (size_t x = first[d]; x < first[d + 1]; ++x) sizes[at[x].chain] = saved[x - first[d]];
  };
  rec(rec, 0);
}

std::vector<int64_t> distinct_sizes(int64_t n, std::span<const Split> splits, const Dims& mesh_shape, WorkBudget& work) {
  ChainSet set(mesh_shape);
  set.add(n, SplitList(splits.begin(), splits.end()));
  std::vector<int64_t> out;
  for_each_size_class(set, work, [&](const SizeClass& c) { out.push_back(c.sizes[0]); });
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace {

void emit(std::vector<OwnerRun>& out, int64_t begin, int64_t end, int64_t code) {
  if (end <= begin) return;
  if (!out.empty() && out.back().end == begin && out.back().code == code) {
    out.back().end = end;
    return;
  }
  out.push_back({begin, end, code});
}

// Positions [lo, hi) of a list of n at split `level`; position q is y = q + delta.
void owner_rec(int64_t n, std::span<const Split> splits, size_t level, int64_t lo, int64_t hi, int64_t code,
               int64_t delta, std::vector<OwnerRun>& out, WorkBudget& work) {
  if (hi <= lo) return;
  work.add(1);
  if (level == splits.size()) return emit(out, lo + delta, hi + delta, code);
  const Split& s = splits[level];
  const Pieces pc = pieces_of(n, s);
  const int64_t piece_count = pc.count();
  for (int64_t p = lo / pc.length; p < piece_count && p * pc.length < hi; ++p) {
    const int64_t start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, s.k);
    const int64_t a = std::max(lo, start) - start, b = std::min(hi, start + length) - start;
    for (int64_t c = a / cs; c < s.k && c * cs < b; ++c) {
      const Chunk sub = chunk_at(length, s.k, c);
      const int64_t x = std::max(a, sub.offset), z = std::min(b, sub.offset + sub.size);
      if (z <= x) continue;
      // Earlier pieces are full: this sub-chunk starts at p x (a full piece's sub-chunk c) in c's list.
      const int64_t before = s.sf == 0 ? 0 : p * chunk_at(pc.length, s.k, c).size;
      const int64_t shift = start + sub.offset - before;  // parent position = local + shift
      owner_rec(piece_size(n, s, c), splits, level + 1, x - sub.offset + before, z - sub.offset + before,
                code * s.k + c, delta + shift, out, work);
    }
  }
}

// The windows of a split of a list of n, grouped in families: per piece p and coordinate
// interval [c0, c0 + count) of equal sub-chunk sizes w > 0, the sub-chunks of the family tile the
// hull [h0, h0 + count x w) of positions, and each starts at position `before` of its
// coordinate's list (of `list` positions): the same for the whole family (NOTE [layout algebra]).
struct Family {
  int64_t h0, w, count, before, list, c0;
};

std::vector<Family> families(int64_t n, const Split& a) {
  const std::vector<int64_t> cuts = coordinate_cuts(n, a);
  const Pieces pc = pieces_of(n, a);
  const int64_t piece_count = pc.count();
  std::vector<Family> out;
  for (int64_t p = 0; p < piece_count; ++p) {
    const int64_t start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, a.k);
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t c0 = cuts[j];
      const int64_t w = chunk_at(length, a.k, c0).size;
      if (w == 0) continue;
      const int64_t before = a.sf == 0 ? 0 : p * chunk_at(pc.length, a.k, c0).size;
      out.push_back({start + c0 * cs, w, cuts[j + 1] - c0, before, piece_size(n, a, c0), c0});
    }
  }
  return out;
}

int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
int64_t ceil_div_signed(int64_t a, int64_t b) { return -floor_div(-a, b); }

}  // namespace

std::vector<std::pair<int64_t, int64_t>> overlapping_pieces(int64_t n, const Split& a, const Split& b, WorkBudget& work) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<Family> fa = families(n, a), fb = families(n, b);
  work.add(static_cast<int64_t>(fa.size() * fb.size()));
  for (const Family& x : fa)
    for (const Family& y : fb) {
      int64_t lo = std::max(x.c0, y.c0), hi = std::min(x.c0 + x.count, y.c0 + y.count);
      if (lo >= hi) continue;
      // Piece c: [xa + c wa, + wa) and [xb + c wb, + wb); they overlap iff d(c) = (xb - xa) +
      // c (wb - wa) lies in [1 - wb, wa - 1].
      const int64_t xa = x.h0 - x.c0 * x.w, xb = y.h0 - y.c0 * y.w;
      const int64_t d0 = xb - xa, slope = y.w - x.w, dmin = 1 - y.w, dmax = x.w - 1;
      if (slope == 0) {
        if (d0 < dmin || d0 > dmax) continue;
      } else if (slope > 0) {
        lo = std::max(lo, ceil_div_signed(dmin - d0, slope));
        hi = std::min(hi, floor_div(dmax - d0, slope) + 1);
      } else {
        lo = std::max(lo, ceil_div_signed(d0 - dmax, -slope));
        hi = std::min(hi, floor_div(d0 - dmin, -slope) + 1);
      }
      if (lo < hi) out.push_back({lo, hi});
    }
  std::sort(out.begin(), out.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& r : out) {
    if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  return merged;
}

void owner_runs(int64_t n, std::span<const Split> splits, int64_t lo, int64_t hi, std::vector<OwnerRun>& out,
                WorkBudget& work) {
  owner_rec(n, splits, 0, lo, hi, 0, 0, out, work);
}

IndexRuns chain_positions(int64_t n, std::span<const Split> splits, std::span<const int64_t> coords) {
  IndexRuns held;
  if (n > 0) held.push_back({0, n});
  int64_t size = n;
  for (size_t i = 0; i < splits.size(); ++i) {
    IndexRuns next;
    for (const IndexRun& pos : split_positions(size, splits[i].k, coords[i], static_cast<int>(splits[i].sf)))
      for (const IndexRun& r : slice_runs(held, pos.start, pos.length)) {
        if (!next.empty() && next.back().start + next.back().length == r.start) next.back().length += r.length;
        else next.push_back(r);
      }
    held = std::move(next);
    size = 0;
    for (const IndexRun& r : held) size += r.length;
  }
  return held;
}

bool same_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                       std::span<const Split> later, WorkBudget& work) {
  if (later.empty() || n == 0 || (!a && !b)) return true;
  // Symmetric in a and b: one key for both orders.
  using Code = boost::container::small_vector<int64_t, 2>;
  auto code = [](const std::optional<Split>& s) { return s ? Code{s->k, s->sf} : Code{-1}; };
  Code ca = code(a), cb = code(b);
  if (cb < ca) std::swap(ca, cb);
  WorkBudget::Key key = {n};
  key.insert(key.end(), ca.begin(), ca.end());
  key.insert(key.end(), cb.begin(), cb.end());
  for (const Split& s : later) key.insert(key.end(), {s.k, s.sf});
  if (auto it = work.owner_checks.find(key); it != work.owner_checks.end()) return it->second;
  const bool same = compare_later_owners(n, a, b, later, work);
  work.owner_checks.emplace(std::move(key), same);
  return same;
}

namespace {

// Owner codes as affine segments: the positions [lo, hi) lie in windows [h + i w, h + (i+1) w)
// and position q has code code0 + ((q - h) / w) x step (step 0: one code). A family of equal
// sub-chunks whose windows each hold one later owner is one segment (its codes step by the later
// splits' product), so the segments of a chain number about its families, not its runs.
// Two levels (W > 0): outer windows of W positions from h, each cut into inner windows of w
// from its start; code0 + ((q - h) / W) x S + (((q - h) % W) / w) x step. A family whose windows
// each hold one single-level pattern of the next split is one such segment. Codes strictly
// increase at every window edge of either level (S exceeds the inner codes' range).
// Example: 8 pieces of 1024 cut into 256 windows of 4, each window's 4 positions owned by
// coordinates 0..3 of a next split of 8: one segment per piece with W 4, S 8, w 1, step 1.
struct Seg {
  int64_t lo, hi, h, w, code0, step;
  int64_t W = 0, S = 0;
  int64_t at(int64_t q) const {
    if (W == 0) return step == 0 ? code0 : code0 + (q - h) / w * step;
    return code0 + (q - h) / W * S + (q - h) % W / w * step;
  }
  int64_t next_change(int64_t q) const {  // the first window start after q (INT64_MAX: none)
    if (W == 0) return step == 0 ? std::numeric_limits<int64_t>::max() : h + ((q - h) / w + 1) * w;
    const int64_t r = (q - h) % W;
    return q - r + std::min(W, (r / w + 1) * w);
  }
  bool varies() const { return step != 0 || W != 0; }
};

void emit_seg(std::vector<Seg>& out, Seg s) {
  if (s.hi <= s.lo) return;
  if (s.step == 0 && s.W == 0) s.h = s.lo, s.w = s.hi - s.lo;
  if (!out.empty()) {
    Seg& b = out.back();
    if (b.hi == s.lo && !b.varies() && !s.varies() && b.code0 == s.code0) {
      b.hi = s.hi;
      b.w = b.hi - b.lo;
      return;
    }
  }
  out.push_back(s);
}

// The whole windows [h, h + count x W), window i with prefix code0 + i x S, each holding the
// single-level pattern g of [0, W): one segment when g covers its window with inner windows from
// its start (two levels, or one when the inner windows tile the outer ones seamlessly); false
// when the caller must expand the windows one by one.
bool emit_windows(std::vector<Seg>& out, int64_t h, int64_t count, int64_t W, int64_t code0, int64_t S, const Seg& g,
                  bool nest) {
  if (g.W != 0 || g.lo != 0 || g.hi != W) return false;
  if (!g.varies()) {
    emit_seg(out, {h, h + count * W, h, W, code0 + g.code0, S});
    return true;
  }
  if (!nest || g.h > 0 || (-g.h) % g.w != 0) return false;
  const int64_t first = g.at(0), last = g.at(W - 1);
  if (last - first >= S) return false;  // codes would not increase at the outer edges
  if (W % g.w == 0 && S == W / g.w * g.step) emit_seg(out, {h, h + count * W, h, g.w, code0 + first, g.step});
  else if (W <= g.w) emit_seg(out, {h, h + count * W, h, W, code0 + first, S});
  else emit_seg(out, {h, h + count * W, h, g.w, code0 + first, g.step, W, S});
  return true;
}

// Positions [lo, hi) of a list of n under splits[level..] as segments (codes prefixed by `code`,
// positions shifted by delta); two-level segments only when `nest`. REQUIRES: 0 <= lo <= hi <= n.
void affine_rec(int64_t n, std::span<const Split> splits, size_t level, int64_t lo, int64_t hi, int64_t code,
                int64_t delta, std::vector<Seg>& out, WorkBudget& work, bool nest) {
  if (hi <= lo) return;
  work.add(1);
  if (level == splits.size()) return emit_seg(out, {lo + delta, hi + delta, lo + delta, hi - lo, code, 0});
  const Split& s = splits[level];
  int64_t k_rest = 1;
  for (size_t i = level + 1; i < splits.size(); ++i) k_rest = kernels::checked_mul(k_rest, splits[i].k, "owner code");
  const std::vector<int64_t> cuts = coordinate_cuts(n, s);
  const Pieces pc = pieces_of(n, s);
  const int64_t piece_count = pc.count();
  std::vector<Seg> one;
  for (int64_t p = lo / pc.length; p < piece_count && p * pc.length < hi; ++p) {
    const int64_t start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, s.k);
    const int64_t a = std::max(lo, start) - start, b = std::min(hi, start + length) - start;
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t c0 = cuts[j], w = chunk_at(length, s.k, c0).size;
      if (w == 0) continue;
      // Windows c in [c0, c1) at [c cs, c cs + w); w == cs unless the family is one coordinate.
      const int64_t c1 = std::min(cuts[j + 1], c0 + (w == cs ? cuts[j + 1] - c0 : 1));
      const int64_t cl = std::max(c0, a / cs), ch = std::min(c1, ceil_div(b, cs));
      if (cl >= ch) continue;
      const int64_t before = s.sf == 0 ? 0 : p * chunk_at(pc.length, s.k, c0).size;
      const int64_t list = piece_size(n, s, c0);
      auto window = [&](int64_t c) {
        const int64_t x = std::max(a, c * cs), z = std::min(b, c * cs + w);
        if (z > x)
          affine_rec(list, splits, level + 1, x - c * cs + before, z - c * cs + before, code * s.k + c,
                     delta + start + c * cs - before, out, work, nest);
      };
      // Whole windows [cf, cg); the (at most two) clipped ones at the ends one by one.
      const int64_t cf = std::max(cl, ceil_div(a, cs)), cg = std::min(ch, floor_div(b - w, cs) + 1);
      if (cf >= cg) {
        for (int64_t c = cl; c < ch; ++c) window(c);
        continue;
      }
      for (int64_t c = cl; c < cf; ++c) window(c);
      if (cg - cf == 1) {
        window(cf);
      } else {
        one.clear();
        affine_rec(list, splits, level + 1, before, before + w, 0, -before, one, work, nest);
        if (!(one.size() == 1 && emit_windows(out, delta + start + cf * cs, cg - cf, w, (code * s.k + cf) * k_rest,
                                              k_rest, one[0], nest))) {
          work.add((cg - cf) * static_cast<int64_t>(one.size()));
          for (int64_t c = cf; c < cg; ++c) {
            const int64_t off = delta + start + c * cs, prefix = (code * s.k + c) * k_rest;
            for (Seg g : one) {
              g.lo += off, g.hi += off, g.h += off, g.code0 += prefix;
              emit_seg(out, g);
            }
          }
        }
      }
      for (int64_t c = cg; c < ch; ++c) window(c);
    }
  }
}

// One side of the comparison: windows [h0 + j w, + w), j < count, each with the later owners g
// (segments of [0, w)); `varies`: g holds more than one code.
struct Periodic {
  int64_t h0, w, count;
  std::vector<Seg> g;
  bool varies() const { return g.size() > 1 || g[0].varies(); }
};

std::vector<Periodic> side(int64_t n, const std::optional<Split>& x, std::span<const Split> later, WorkBudget& work) {
  std::vector<Periodic> out;
  if (!x) {
    out.push_back({0, n, 1, {}});
    affine_rec(n, later, 0, 0, n, 0, 0, out.back().g, work, /*nest=*/true);
    return out;
  }
  for (const Family& f : families(n, *x)) {
    out.push_back({f.h0, f.w, f.count, {}});
    Periodic& p = out.back();
    affine_rec(f.list, later, 0, f.before, f.before + f.w, 0, -f.before, p.g, work, /*nest=*/true);
    if (!p.varies()) {  // one code over the whole hull
      p.w *= p.count;
      p.count = 1;
      p.g[0].hi = p.g[0].w = p.w;
    }
  }
  return out;
}

// The segments of a periodic side over [lo, hi) (inside its hull), one at a time.
class Cursor {
 public:
  Cursor(const Periodic& p, int64_t lo, int64_t hi) : p_(p), lo_(lo), hi_(hi), j_((lo - p.h0) / p.w) {}
  // The next segment, clipped; false past hi.
  bool next(Seg& out) {
    for (;;) {
      if (k_ == p_.g.size()) ++j_, k_ = 0;
      const int64_t off = p_.h0 + j_ * p_.w;
      if (j_ >= p_.count || off >= hi_) return false;
      const Seg& s = p_.g[k_++];
      out = {std::max(lo_, s.lo + off), std::min(hi_, s.hi + off), s.h + off, s.w, s.code0, s.step, s.W, s.S};
      if (out.hi > out.lo) return true;
    }
  }

 private:
  const Periodic& p_;
  int64_t lo_, hi_, j_;
  size_t k_ = 0;
};

// Two segments with equal codes over [x, r) (both cover it), compared window edge by window edge
// (every edge changes the code) until both have the same windows from there on.
bool equal_on(const Seg& a, const Seg& b, int64_t x, int64_t r, WorkBudget& work) {
  for (;;) {
    if (a.at(x) != b.at(x)) return false;
    const int64_t na = a.next_change(x), nb = b.next_change(x);
    if (na >= r && nb >= r) return true;
    if (na != nb) return false;
    if (a.W == b.W && a.w == b.w && a.step == b.step && a.S == b.S && (a.W == 0 || (a.h - b.h) % a.W == 0))
      return true;  // the same windows from na on, the same steps
    work.add(1);
    x = na;
  }
}

// x and y (overlapping families) with equal codes over [lo, hi). Codes never decrease along a
// segment while a varying family repeats its codes every window, so a segment longer than the
// other side's window (of a family with several windows there) is a mismatch.
bool equal_over(const Periodic& x, const Periodic& y, int64_t lo, int64_t hi, WorkBudget& work) {
  const bool x_repeats = x.varies() && hi - lo > x.w, y_repeats = y.varies() && hi - lo > y.w;
  Cursor cx(x, lo, hi), cy(y, lo, hi);
  Seg a{}, b{};
  bool more = cx.next(a) && cy.next(b);
  while (more) {
    work.add(1);
    if ((y_repeats && a.hi - a.lo > y.w) || (x_repeats && b.hi - b.lo > x.w)) return false;
    const int64_t p = std::max(a.lo, b.lo), r = std::min(a.hi, b.hi);
    if (!equal_on(a, b, p, r, work)) return false;
    const bool step_a = a.hi == r, step_b = b.hi == r;
    if (step_a) more = cx.next(a);
    if (step_b) more = more && cy.next(b);
  }
  return true;
}

}  // namespace

void owner_segments(int64_t n, std::span<const Split> splits, int64_t lo, int64_t hi, std::vector<OwnerSegment>& out,
                    WorkBudget& work) {
  std::vector<Seg> segs;
  affine_rec(n, splits, 0, lo, hi, 0, 0, segs, work, /*nest=*/false);
  for (const Seg& s : segs) out.push_back({s.lo, s.hi, s.h, s.w, s.code0, s.step});
}

namespace {

// The owner code along `later` of position q of a list of n under (x, later), x optional, from
// the position alone. REQUIRES: 0 <= q < n.
int64_t later_code_at(int64_t n, const std::optional<Split>& x, std::span<const Split> later, int64_t q) {
  int64_t code = 0;
  auto descend = [&](const Split& s) {  // q's coordinate at s; n and q become its list's
    const Pieces pc = pieces_of(n, s);
    const int64_t p = q / pc.length, start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, s.k);
    const int64_t c = (q - start) / cs;
    const int64_t before = s.sf == 0 ? 0 : p * chunk_at(pc.length, s.k, c).size;
    q = q - start - c * cs + before;
    n = piece_size(n, s, c);
    return c;
  };
  if (x) descend(*x);
  for (const Split& s : later) code = code * s.k + descend(s);
  return code;
}

}  // namespace

// Both sides as periodic families; on the overlap of two families both owner functions repeat
// with period lcm(wa, wb), so one period decides it (NOTE [layout algebra]).
bool compare_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                          std::span<const Split> later, WorkBudget& work, bool probes) {
  if (later.empty() || n == 0 || (!a && !b)) return true;
  // Most unequal pairs differ near the start or at a piece boundary: a few positions checked
  // directly first, so those never build the families (a match proves nothing; the check follows).
  constexpr int64_t kProbes = 16;
  if (probes) {
    work.add(2 * kProbes);
    for (int64_t i = 0; i < kProbes; ++i)
      for (const int64_t q : {std::min(i, n - 1), i * (n / kProbes)})
        if (later_code_at(n, a, later, q) != later_code_at(n, b, later, q)) return false;
  }
  const std::vector<Periodic> pa = side(n, a, later, work), pb = side(n, b, later, work);
  size_t i = 0, j = 0;
  while (i < pa.size() && j < pb.size()) {
    const Periodic &x = pa[i], &y = pb[j];
    const int64_t xe = x.h0 + x.count * x.w, ye = y.h0 + y.count * y.w;
    const int64_t lo = std::max(x.h0, y.h0), hi = std::min(xe, ye);
    if (lo < hi) {
      const int64_t g = std::gcd(x.w, y.w);
      const int64_t span = x.w / g > (hi - lo) / y.w ? hi - lo : std::min(hi - lo, x.w / g * y.w);
      if (!equal_over(x, y, lo, lo + span, work)) return false;
    }
    if (xe <= ye) ++i;
    if (ye <= xe) ++j;
  }
  return true;
}

}  // namespace dtensor
