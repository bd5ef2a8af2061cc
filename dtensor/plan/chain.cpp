#include "dtensor/plan/chain.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return kernels::checked_ceil_div(a, b, "chunk size"); }

// The piece lengths of a split of a list of n: one piece of n (Shard), or `full` pieces of
// `length` and one of `last` (StridedShard; last may be 0).
struct Pieces {
  int64_t length = 0, full = 0, last = 0;
};

Pieces pieces_of(int64_t n, const Split& s) {
  if (s.sf == 0) return {n, n > 0 ? 1 : 0, 0};
  if (n == 0) return {};
  const int64_t length = ceil_div(n, s.sf);
  const int64_t full = n / length;
  return {length, full, n - full * length};
}

// Coordinates in (0, k) where chunk(length, k, c).size changes.
void chunk_breakpoints(int64_t length, int64_t k, std::vector<int64_t>& out) {
  if (length <= 0) return;
  const int64_t cs = ceil_div(length, k);
  const int64_t q = length / cs;
  for (int64_t c : {q, q + 1})
    if (c > 0 && c < k) out.push_back(c);
}

void breakpoints(int64_t n, const Split& s, std::vector<int64_t>& out) {
  const Pieces p = pieces_of(n, s);
  chunk_breakpoints(p.length, s.k, out);
  chunk_breakpoints(p.last, s.k, out);
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
  if (s.sf == 0) return chunk(n, s.k, c).size;
  const Pieces p = pieces_of(n, s);
  if (p.full == 0 && p.last == 0) return 0;
  int64_t size = p.full * chunk(p.length, s.k, c).size;
  if (p.last > 0) size += chunk(p.last, s.k, c).size;
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

void for_each_size_class(const ChainSet& chains, WorkBudget& work, const std::function<void(const SizeClass&)>& f) {
  const Dims& mesh = chains.mesh_shape();
  const int ndim = mesh.size();
  const size_t n = chains.size();
  // at[d]: the chains splitting at mesh dim d, with the split.
  std::vector<std::vector<std::pair<size_t, Split>>> at(ndim);
  for (size_t i = 0; i < n; ++i)
    for (const Split& s : chains.splits(static_cast<int>(i))) at[s.mesh_dim].push_back({i, s});
  std::vector<int64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) sizes[i] = chains.extent(static_cast<int>(i));
  SizeClass cls{sizes, Dims::filled(ndim, 0), mesh};
  std::vector<int64_t> points;
  std::function<void(int)> rec = [&](int d) {
    if (d == ndim) {
      work.add(1);
      f(cls);
      return;
    }
    if (at[d].empty()) {
      cls.lo[d] = 0;
      cls.hi[d] = mesh[d];
      return rec(d + 1);
    }
    points.assign({0, mesh[d]});
    for (const auto& [i, s] : at[d]) breakpoints(sizes[i], s, points);
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    const std::vector<int64_t> cuts = points;  // `points` is reused deeper
    std::vector<int64_t> saved;
    for (const auto& [i, s] : at[d]) saved.push_back(sizes[i]);
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      for (size_t x = 0; x < at[d].size(); ++x) sizes[at[d][x].first] = piece_size(saved[x], at[d][x].second, cuts[j]);
      cls.lo[d] = cuts[j];
      cls.hi[d] = cuts[j + 1];
      rec(d + 1);
    }
    for (size_t x = 0; x < at[d].size(); ++x) sizes[at[d][x].first] = saved[x];
  };
  rec(0);
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
  const int64_t piece_count = pc.full + (pc.last > 0 ? 1 : 0);
  for (int64_t p = lo / pc.length; p < piece_count && p * pc.length < hi; ++p) {
    const int64_t start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, s.k);
    const int64_t a = std::max(lo, start) - start, b = std::min(hi, start + length) - start;
    for (int64_t c = a / cs; c < s.k && c * cs < b; ++c) {
      const Chunk sub = chunk(length, s.k, c);
      const int64_t x = std::max(a, sub.offset), z = std::min(b, sub.offset + sub.size);
      if (z <= x) continue;
      // Earlier pieces are full: this sub-chunk starts at p x (a full piece's sub-chunk c) in c's list.
      const int64_t before = s.sf == 0 ? 0 : p * chunk(pc.length, s.k, c).size;
      const int64_t shift = start + sub.offset - before;  // parent position = local + shift
      owner_rec(piece_size(n, s, c), splits, level + 1, x - sub.offset + before, z - sub.offset + before,
                code * s.k + c, delta + shift, out, work);
    }
  }
}

// G is constant and equal to v on [x, y) (G: runs covering [0, w), codes merged).
bool constant_on(const std::vector<OwnerRun>& g, int64_t x, int64_t y, int64_t v) {
  if (y <= x) return true;
  auto it = std::upper_bound(g.begin(), g.end(), x, [](int64_t pos, const OwnerRun& r) { return pos < r.end; });
  return it != g.end() && it->begin <= x && it->end >= y && it->code == v;
}

// Every window j < count of H on [h0 + j w, h0 + (j+1) w) equals G (runs of [0, w)).
bool windows_match(const std::vector<OwnerRun>& h, int64_t h0, int64_t w, int64_t count, const std::vector<OwnerRun>& g,
                   WorkBudget& work) {
  const int64_t h1 = h0 + count * w;
  auto it = std::upper_bound(h.begin(), h.end(), h0, [](int64_t pos, const OwnerRun& r) { return pos < r.end; });
  for (; it != h.end() && it->begin < h1; ++it) {
    work.add(1);
    const int64_t u0 = std::max(it->begin, h0) - h0, u1 = std::min(it->end, h1) - h0;
    const int64_t j0 = u0 / w, j1 = (u1 - 1) / w;
    if (j0 == j1) {
      if (!constant_on(g, u0 - j0 * w, u1 - j0 * w, it->code)) return false;
      continue;
    }
    if (!constant_on(g, u0 - j0 * w, w, it->code)) return false;
    if (j1 - j0 >= 2 && !constant_on(g, 0, w, it->code)) return false;
    if (!constant_on(g, 0, u1 - j1 * w, it->code)) return false;
  }
  return true;
}

// The windows of a split of a list of n, grouped in families: per piece p and coordinate
// interval [c0, c0 + count) of equal sub-chunk sizes w > 0, the sub-chunks of the family tile the
// hull [h0, h0 + count x w) of positions, and each starts at position `before` of its
// coordinate's list (of `list` positions): the same for the whole family (NOTE [layout algebra]).
struct Family {
  int64_t h0, w, count, before, list, c0;
};

std::vector<Family> families(int64_t n, const Split& a) {
  std::vector<int64_t> cuts = {0, a.k};
  breakpoints(n, a, cuts);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  const Pieces pc = pieces_of(n, a);
  const int64_t piece_count = pc.full + (pc.last > 0 ? 1 : 0);
  std::vector<Family> out;
  for (int64_t p = 0; p < piece_count; ++p) {
    const int64_t start = p * pc.length;
    const int64_t length = p < pc.full ? pc.length : pc.last;
    const int64_t cs = ceil_div(length, a.k);
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t c0 = cuts[j];
      const int64_t w = chunk(length, a.k, c0).size;
      if (w == 0) continue;
      const int64_t before = a.sf == 0 ? 0 : p * chunk(pc.length, a.k, c0).size;
      out.push_back({start + c0 * cs, w, cuts[j + 1] - c0, before, piece_size(n, a, c0), c0});
    }
  }
  return out;
}

// The later owners of one window of a family, as runs of [0, w).
void window_runs(const Family& f, std::span<const Split> later, std::vector<OwnerRun>& g, WorkBudget& work) {
  g.clear();
  owner_runs(f.list, later, f.before, f.before + f.w, g, work);
  for (OwnerRun& r : g) r.begin -= f.before, r.end -= f.before;
}

// The owners along `later` of every position of a list of n split by (a, later): a family whose
// windows hold one owner each is one run over its hull; others are expanded window by window.
void later_runs(int64_t n, const Split& a, std::span<const Split> later, std::vector<OwnerRun>& out, WorkBudget& work) {
  std::vector<OwnerRun> g;
  for (const Family& f : families(n, a)) {
    work.add(1);
    window_runs(f, later, g, work);
    if (g.size() == 1) {
      emit(out, f.h0, f.h0 + f.count * f.w, g[0].code);
      continue;
    }
    work.add(f.count * static_cast<int64_t>(g.size()));
    for (int64_t j = 0; j < f.count; ++j)
      for (const OwnerRun& r : g) emit(out, f.h0 + j * f.w + r.begin, f.h0 + j * f.w + r.end, r.code);
  }
}

// (a, later) against the owner runs h of another chain over the same list (every position's
// later owner): the window check of NOTE [layout algebra].
bool split_matches(int64_t n, const Split& a, std::span<const Split> later, const std::vector<OwnerRun>& h,
                   WorkBudget& work) {
  std::vector<OwnerRun> g;
  for (const Family& f : families(n, a)) {
    window_runs(f, later, g, work);
    if (!windows_match(h, f.h0, f.w, f.count, g, work)) return false;
  }
  return true;
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

bool compare_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                          std::span<const Split> later, WorkBudget& work);

bool same_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                       std::span<const Split> later, WorkBudget& work) {
  if (later.empty() || n == 0 || (!a && !b)) return true;
  std::vector<int64_t> key = {n};
  for (const std::optional<Split>& s : {a, b})
    if (s) key.insert(key.end(), {s->k, s->sf});
    else key.push_back(-1);
  for (const Split& s : later) key.insert(key.end(), {s.k, s.sf});
  if (auto it = work.owner_checks.find(key); it != work.owner_checks.end()) return it->second;
  const bool same = compare_later_owners(n, a, b, later, work);
  work.owner_checks.emplace(std::move(key), same);
  return same;
}

// The later owners of (x, later) and (y, later) compared position by position over [0, end):
// 1 equal, 0 a mismatch. Codes drop the digit of the split at the mesh dim.
int compare_prefix(int64_t end, int64_t n, const std::optional<Split>& x, const std::optional<Split>& y,
                   std::span<const Split> later, WorkBudget& work, size_t& runs) {
  int64_t k_later = 1;
  for (const Split& s : later) k_later *= s.k;
  SplitList cx, cy;
  if (x) cx.push_back(*x);
  if (y) cy.push_back(*y);
  cx.insert(cx.end(), later.begin(), later.end());
  cy.insert(cy.end(), later.begin(), later.end());
  std::vector<OwnerRun> rx, ry;
  owner_runs(n, cx, 0, end, rx, work);
  owner_runs(n, cy, 0, end, ry, work);
  runs = rx.size() + ry.size();
  size_t i = 0, j = 0;
  while (i < rx.size() && j < ry.size()) {
    if (rx[i].code % k_later != ry[j].code % k_later) return 0;
    if (rx[i].end < ry[j].end) ++i;
    else if (ry[j].end < rx[i].end) ++j;
    else ++i, ++j;
  }
  return 1;
}

bool compare_later_owners(int64_t n, const std::optional<Split>& a, const std::optional<Split>& b,
                          std::span<const Split> later, WorkBudget& work) {
  // A mismatch, when there is one, usually shows in the first positions: compare prefixes of
  // growing length position by position first (a short list is decided there entirely).
  for (int64_t end = std::min<int64_t>(n, 64);; end = std::min(n, end * 4)) {
    size_t runs = 0;
    if (compare_prefix(end, n, a, b, later, work, runs) == 0) return false;
    if (end == n) return true;
    if (runs > 512) break;
  }
  std::vector<OwnerRun> h;
  if (a && b) {
    later_runs(n, *b, later, h, work);  // both split at the mesh dim: b's side as runs
    return split_matches(n, *a, later, h, work);
  }
  owner_runs(n, later, 0, n, h, work);  // the side without a split at the mesh dim
  return split_matches(n, a ? *a : *b, later, h, work);
}

}  // namespace dtensor
