#include "dtensor/plan/traffic.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <optional>

#include "dtensor/plan/transition.h"
#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

__extension__ typedef __int128 Wide;  // __extension__: no -Wpedantic warning

// A byte count computed in 128 bits, narrowed with a check: an InvalidArgument naming the
// tensor, never a wrap.
int64_t to_bytes(Wide v, const Dims& shape, DType dtype) {
  if (v > kernels::kInt64Max || v < 0)
    throw InvalidArgument(fmt::format("the traffic of a redistribute of shape [{}] ({}) overflows int64 bytes",
                                      fmt::join(shape, ","), kernels::to_string(dtype)));
  return static_cast<int64_t>(v);
}

// How one step's per-rank bytes follow from chain sizes (NOTE [traffic by size classes]).
struct Term {
  enum Kind { kNone, kGather, kPair, kSameDim, kAllReduce, kReduceScatter } kind = kNone;
  int64_t k = 1;
  int64_t item = 4;       // bytes per element moved: the step's wire dtype, else the tensor's
  bool wire_ar = false;   // P -> R through a wire dtype: exchange of chunks + all-gather
  int64_t scale_bytes = 0;  // an fp8 wire's scales: 4 bytes to and from each peer per exchange
  std::vector<int> a;  // chain of every tensor dim before the step
  int t = -1, t2 = -1;  // gather, reduce-scatter, same-dim regroup: t; pair: from t to t2
  int b = -1, b2 = -1;  // their chains after
  // Same-dim regroup: the common prefix's chain, the two splits at the step's mesh dim, the
  // later splits, and the mesh dims of (split, later) in order.
  int prefix = -1;
  SplitList ca, cb;
  std::vector<int> dims;
};

// A step's bytes per element moved and its fp8 scales' bytes (Term's item and scale_bytes).
struct WireBytes {
  int64_t item = 4, scale = 0;
  bool wire_ar = false;
};
WireBytes wire_bytes(const Step& step, const Dims& mesh, DType dtype) {
  WireBytes out;
  const int64_t k = mesh[mesh_dim_of(step)];
  std::optional<DType> wire;
  if (const auto* a = std::get_if<AllReduce>(&step)) wire = a->wire;
  if (const auto* r = std::get_if<ReduceScatter>(&step)) wire = r->wire;
  out.item = static_cast<int64_t>(kernels::itemsize(wire.value_or(dtype)));
  out.wire_ar = wire.has_value() && std::holds_alternative<AllReduce>(step);
  if (wire && (*wire == DType::kF8E4M3 || *wire == DType::kF8E5M2)) out.scale = 4 * (k - 1) * (out.wire_ar ? 2 : 1);
  return out;
}

Term make_term(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh, ChainSet& set,
               DType dtype) {
  Term term;
  const int m = mesh_dim_of(step);
  term.k = mesh[m];
  const WireBytes wb = wire_bytes(step, mesh, dtype);
  term.item = wb.item;
  term.wire_ar = wb.wire_ar;
  term.scale_bytes = wb.scale;
  if (!communicates(step) || term.k == 1) return term;
  for (int t = 0; t < shape.size(); ++t) term.a.push_back(set.add(shape[t], chain_of(before, mesh, t)));
  const Placements after = apply_step(step, before);
  auto after_chain = [&](int t) { return set.add(shape[t], chain_of(after, mesh, t)); };
  std::visit(
      [&](const auto& s) {
        using T = std::decay_t<decltype(s)>;
        if constexpr (std::is_same_v<T, AllReduce>) {
          term.kind = Term::kAllReduce;
        } else if constexpr (std::is_same_v<T, ReduceScatter>) {
          term.kind = Term::kReduceScatter;
          term.t = s.tensor_dim;
        } else if constexpr (std::is_same_v<T, AllGather> || std::is_same_v<T, StridedAllGather>) {
          term.kind = Term::kGather;
          term.t = s.tensor_dim;
        } else if constexpr (std::is_same_v<T, AllToAll>) {
          term.kind = Term::kPair;
          term.t = s.from_dim;
          term.t2 = s.to_dim;
        } else if constexpr (std::is_same_v<T, Regroup>) {
          term.t = *shard_dim(s.from);
          term.t2 = *shard_dim(s.to);
          term.kind = term.t == term.t2 ? Term::kSameDim : Term::kPair;
        }
      },
      step);
  if (term.t >= 0) term.b = after_chain(term.t);
  if (term.t2 >= 0) term.b2 = after_chain(term.t2);
  if (term.kind == Term::kSameDim) {
    SplitList prefix;
    for (const Split& s : chain_of(before, mesh, term.t)) {
      if (s.mesh_dim < m) prefix.push_back(s);
      else term.ca.push_back(s);
    }
    for (const Split& s : chain_of(after, mesh, term.t))
      if (s.mesh_dim >= m) term.cb.push_back(s);
    term.prefix = set.add(shape[term.t], prefix);
    for (const Split& s : term.ca) term.dims.push_back(s.mesh_dim);
  }
  return term;
}

struct Bytes {
  Wide sent = 0, received = 0;
};

Wide product_except(const Term& term, std::span<const int64_t> sizes, int skip1, int skip2) {
  Wide p = 1;
  for (int t = 0; t < static_cast<int>(term.a.size()); ++t)
    if (t != skip1 && t != skip2) p *= sizes[term.a[t]];
  return p;
}

// The elements (not bytes) a rank in this size class moves, for every term but same-dim regroups.
Bytes class_elements(const Term& term, std::span<const int64_t> s) {
  Bytes out;
  switch (term.kind) {
    case Term::kNone:
    case Term::kSameDim:
      break;
    case Term::kGather: {
      const Wide others = product_except(term, s, term.t, -1);
      out.received = (Wide{s[term.b]} - s[term.a[term.t]]) * others;
      out.sent = Wide{term.k - 1} * s[term.a[term.t]] * others;
      break;
    }
    case Term::kPair: {
      const Wide others = product_except(term, s, term.t, term.t2);
      out.received = Wide{s[term.b2]} * (Wide{s[term.b]} - s[term.a[term.t]]) * others;
      out.sent = Wide{s[term.a[term.t]]} * (Wide{s[term.a[term.t2]]} - s[term.b2]) * others;
      break;
    }
    case Term::kAllReduce: {
      const Wide n = product_except(term, s, -1, -1);
      // Through a wire: member g gets chunk g of ceil/floor(n/k) elements from the k-1 others and
      // sends its reduced chunk to them: n + (k-2) x chunk, the largest chunk the busiest.
      if (term.wire_ar) out.sent = out.received = n + Wide{term.k - 2} * ((n + term.k - 1) / term.k);
      else out.sent = out.received = (Wide{2} * (term.k - 1) * n + term.k - 1) / term.k;
      break;
    }
    case Term::kReduceScatter: {
      const Wide others = product_except(term, s, term.t, -1);
      const Wide after = Wide{s[term.b]} * others;
      out.received = Wide{term.k - 1} * after;
      out.sent = Wide{s[term.a[term.t]]} * others - after;
      break;
    }
  }
  out.sent = out.sent * term.item + term.scale_bytes;
  out.received = out.received * term.item + term.scale_bytes;
  return out;
}

int64_t common(const IndexRuns& x, const IndexRuns& y) {
  int64_t n = 0;
  size_t i = 0, j = 0;
  while (i < x.size() && j < y.size()) {
    const int64_t lo = std::max(x[i].start, y[j].start);
    const int64_t hi = std::min(x[i].start + x[i].length, y[j].start + y[j].length);
    if (lo < hi) n += hi - lo;
    if (x[i].start + x[i].length < y[j].start + y[j].length) ++i;
    else ++j;
  }
  return n;
}

// A same-dim regroup at one coordinate (coord: the full mesh coordinate).
Bytes same_dim_elements(const Term& term, std::span<const int64_t> s, const Dims& coord) {
  std::vector<int64_t> c;
  for (int d : term.dims) c.push_back(coord[d]);
  const int64_t n = s[term.prefix];
  const int64_t kept = common(chain_positions(n, span_of(term.ca), c), chain_positions(n, span_of(term.cb), c));
  const Wide others = product_except(term, s, term.t, -1);
  return {(Wide{s[term.a[term.t]]} - kept) * others * term.item, (Wide{s[term.b]} - kept) * others * term.item};
}

// Calls f(coord) for every coordinate of `dims` inside the class's box (others at lo).
template <class F>
void for_each_coordinate(const SizeClass& cls, const std::vector<int>& dims, WorkBudget& work, F f) {
  Dims coord = cls.lo;
  for (;;) {
    work.add(1);
    f(coord);
    size_t i = dims.size();
    while (i > 0) {
      const int d = dims[i - 1];
      if (++coord[d] < cls.hi[d]) break;
      coord[d] = cls.lo[d];
      --i;
    }
    if (i == 0) return;
  }
}

IndexRuns intersect_runs(const IndexRuns& x, const IndexRuns& y) {
  IndexRuns out;
  size_t i = 0, j = 0;
  while (i < x.size() && j < y.size()) {
    const int64_t lo = std::max(x[i].start, y[j].start);
    const int64_t hi = std::min(x[i].start + x[i].length, y[j].start + y[j].length);
    if (lo < hi) out.push_back({lo, hi - lo});
    if (x[i].start + x[i].length < y[j].start + y[j].length) ++i;
    else ++j;
  }
  return out;
}

// Per later owner (through b's list: the owners agree) the kept positions, owner run by owner run:
// the reference least_kept_in_box is checked against (tests), and its fallback.
int64_t least_kept_by_runs(int64_t list, std::span<const Split> later, const IndexRuns& pb, const IndexRuns& both,
                           std::span<const int64_t> lo, std::span<const int64_t> hi, int64_t box, WorkBudget& work) {
  // Counted in place per coordinate of the box when it is small, else as (code, count) pairs.
  constexpr int64_t kDenseBox = int64_t{1} << 16;
  std::vector<int64_t> dense(box <= kDenseBox ? static_cast<size_t>(box) : 0, 0);
  std::vector<std::pair<int64_t, int64_t>> per_owner;
  int64_t base = 0;
  size_t j = 0;
  std::vector<OwnerRun> runs;
  for (const IndexRun& r : both) {
    while (pb[j].start + pb[j].length <= r.start) base += pb[j++].length;
    const int64_t pos = base + (r.start - pb[j].start);
    runs.clear();
    owner_runs(list, later, pos, pos + r.length, runs, work);
    for (const OwnerRun& o : runs) {
      // Inside the box along every later split?
      int64_t code = o.code, index = 0, stride = 1;
      bool inside = true;
      for (size_t i = later.size(); i-- > 0;) {
        const int64_t digit = code % later[i].k;
        code /= later[i].k;
        inside = inside && digit >= lo[i] && digit < hi[i];
        index += (digit - lo[i]) * stride;
        stride *= hi[i] - lo[i];
      }
      if (!inside) continue;
      if (dense.empty()) per_owner.push_back({o.code, o.end - o.begin});
      else dense[static_cast<size_t>(index)] += o.end - o.begin;
    }
  }
  if (!dense.empty()) return *std::min_element(dense.begin(), dense.end());  // 0: an owner keeps none
  std::sort(per_owner.begin(), per_owner.end());
  int64_t owners = 0, least = kernels::kInt64Max;
  for (size_t i = 0; i < per_owner.size();) {
    int64_t count = 0;
    const int64_t code = per_owner[i].first;
    for (; i < per_owner.size() && per_owner[i].first == code; ++i) count += per_owner[i].second;
    ++owners;
    least = std::min(least, count);
  }
  return owners < box ? 0 : least;
}

// The same from owner segments (owner_segments): each whole-window segment gives w positions to
// every owner of a slice of the box (one later split's piece index over an interval, the others
// fixed), a clipped window one owner. Slices that cover fewer owners than the box leave one with
// none; pairwise disjoint slices that cover it give each owner one slice's count. nullopt when
// slices overlap (or are too many to compare): the caller counts by runs.
std::optional<int64_t> least_by_slices(int64_t list, std::span<const Split> later, const IndexRuns& pb,
                                       const IndexRuns& both, std::span<const int64_t> lo, std::span<const int64_t> hi,
                                       int64_t box, WorkBudget& work) {
  const size_t levels = later.size();
  std::vector<int64_t> rest(levels, 1);  // rest[i]: the product of the k after split i
  for (size_t i = levels - 1; i-- > 0;) rest[i] = kernels::checked_mul(rest[i + 1], later[i + 1].k, "owner code");
  // A box of owners: per later split the piece indices [u[i], v[i]).
  struct Slice {
    boost::container::small_vector<int64_t, 4> u, v;
    int64_t count;
  };
  std::vector<Slice> slices;
  constexpr size_t kMaxSlices = 128;
  int64_t covered = 0;
  // The slice of owners code, code + step, ... (count windows) at `level`, each keeping `count`.
  auto add = [&](int64_t code, int level, int64_t windows, int64_t count) {
    Slice s{boost::container::small_vector<int64_t, 4>(levels), boost::container::small_vector<int64_t, 4>(levels), count};
    for (size_t i = levels; i-- > 0;) {
      s.u[i] = code % later[i].k;
      s.v[i] = s.u[i] + 1;
      code /= later[i].k;
    }
    if (level >= 0) {
      if (s.u[static_cast<size_t>(level)] + windows > later[static_cast<size_t>(level)].k) return false;  // a carry
      s.v[static_cast<size_t>(level)] = s.u[static_cast<size_t>(level)] + windows;
    }
    int64_t size = 1;
    for (size_t i = 0; i < levels; ++i) {
      s.u[i] = std::max(s.u[i], lo[i]);
      s.v[i] = std::min(s.v[i], hi[i]);
      if (s.u[i] >= s.v[i]) return true;  // outside the box
      size *= s.v[i] - s.u[i];
    }
    covered += size;
    // Adjacent to the last slice along one split, equal along the others, same count: one box.
    if (!slices.empty() && slices.back().count == count) {
      Slice& b = slices.back();
      int differ = -1, differing = 0;
      for (size_t i = 0; i < levels; ++i)
        if (b.u[i] != s.u[i] || b.v[i] != s.v[i]) differ = static_cast<int>(i), ++differing;
      if (differing == 1 && b.v[static_cast<size_t>(differ)] == s.u[static_cast<size_t>(differ)]) {
        b.v[static_cast<size_t>(differ)] = s.v[static_cast<size_t>(differ)];
        return true;
      }
    }
    slices.push_back(std::move(s));
    return slices.size() <= kMaxSlices;
  };
  int64_t base = 0;
  size_t j = 0;
  std::vector<OwnerSegment> segs;
  for (const IndexRun& r : both) {
    while (pb[j].start + pb[j].length <= r.start) base += pb[j++].length;
    const int64_t pos = base + (r.start - pb[j].start);
    segs.clear();
    owner_segments(list, later, pos, pos + r.length, segs, work);
    for (const OwnerSegment& g : segs) {
      if (g.step == 0) {
        if (!add(g.code0, -1, 1, g.hi - g.lo)) return std::nullopt;
        continue;
      }
      int level = -1;
      for (size_t i = 0; i < levels; ++i)
        if (rest[i] == g.step) level = static_cast<int>(i);
      if (level < 0) return std::nullopt;
      int64_t i0 = (g.lo - g.h) / g.w, i1 = (g.hi - 1 - g.h) / g.w;  // windows i0..i1
      if (g.lo > g.h + i0 * g.w) {  // clipped first window
        if (!add(g.code0 + i0 * g.step, -1, 1, std::min(g.hi, g.h + (i0 + 1) * g.w) - g.lo)) return std::nullopt;
        ++i0;
      }
      if (i1 >= i0 && g.hi < g.h + (i1 + 1) * g.w) {  // clipped last window
        if (!add(g.code0 + i1 * g.step, -1, 1, g.hi - (g.h + i1 * g.w))) return std::nullopt;
        --i1;
      }
      if (i1 >= i0 && !add(g.code0 + i0 * g.step, level, i1 - i0 + 1, g.w)) return std::nullopt;
    }
  }
  if (covered < box) return 0;  // some owner of the box keeps nothing
  work.add(static_cast<int64_t>(slices.size() * slices.size()));
  auto meets = [&](const Slice& x, const Slice& y) {
    for (size_t i = 0; i < levels; ++i)
      if (std::max(x.u[i], y.u[i]) >= std::min(x.v[i], y.v[i])) return false;
    return true;
  };
  int64_t least = kernels::kInt64Max;
  for (size_t x = 0; x < slices.size(); ++x) {
    least = std::min(least, slices[x].count);
    for (size_t y = x + 1; y < slices.size(); ++y)
      if (meets(slices[x], slices[y])) return std::nullopt;
  }
  return least;  // disjoint, inside the box, covering as many owners as it has: every owner once
}

}  // namespace

int64_t least_kept_in_box(int64_t n, std::span<const Split> ca, std::span<const Split> cb, int64_t c,
                          std::span<const int64_t> lo, std::span<const int64_t> hi, WorkBudget& work, bool by_runs) {
  const std::span<const Split> later = cb.subspan(1);
  const int64_t ci[] = {c};
  const IndexRuns pa = chain_positions(n, ca.first(1), ci);
  const IndexRuns pb = chain_positions(n, cb.first(1), ci);
  const IndexRuns both = intersect_runs(pa, pb);
  work.add(1 + static_cast<int64_t>(pa.size() + pb.size()));
  int64_t kept = 0;
  for (const IndexRun& r : both) kept += r.length;
  if (later.empty()) return kept;
  int64_t box = 1;
  for (size_t i = 0; i < later.size(); ++i) box *= hi[i] - lo[i];
  if (kept < box) return 0;  // fewer kept positions than later coordinates
  const int64_t list = piece_size(n, cb.front(), c);
  if (!by_runs)
    if (const auto least = least_by_slices(list, later, pb, both, lo, hi, box, work)) return *least;
  return least_kept_by_runs(list, later, pb, both, lo, hi, box, work);
}

namespace {

// The least a rank at coordinate c of the step's mesh dim keeps through a valid same-dim
// regroup, over the later coordinates of the class: the positions both splits give c, counted per
// later owner (0 as soon as some later coordinate of the class gets none).
Wide least_kept(const Term& term, int64_t n, int64_t c, const SizeClass& cls, WorkBudget& work) {
  std::vector<int64_t> lo, hi;  // the class's box along the later splits
  for (size_t i = 1; i < term.dims.size(); ++i) {
    lo.push_back(cls.lo[term.dims[i]]);
    hi.push_back(cls.hi[term.dims[i]]);
  }
  return least_kept_in_box(n, span_of(term.ca), span_of(term.cb), c, lo, hi, work);
}

Traffic busiest(const std::vector<Term>& terms, const ChainSet& set, const Dims& shape, DType dtype, WorkBudget& work) {
  std::vector<int> same_dims;
  std::vector<const Term*> same;
  bool any_term = false;
  for (const Term& term : terms) {
    any_term = any_term || term.kind != Term::kNone;
    if (term.kind != Term::kSameDim) continue;
    same.push_back(&term);
    same_dims.insert(same_dims.end(), term.dims.begin(), term.dims.end());
  }
  if (!any_term) return {};
  std::sort(same_dims.begin(), same_dims.end());
  same_dims.erase(std::unique(same_dims.begin(), same_dims.end()), same_dims.end());
  Wide sent = 0, received = 0;
  auto take = [&](const Bytes& b) {
    sent = std::max(sent, b.sent);
    received = std::max(received, b.received);
  };
  // One same-dim regroup (every single step, and most routes): a rank keeps nothing unless its
  // coordinate's pieces overlap (overlapping_pieces), so off those few coordinates its size class
  // decides; on them it is evaluated per coordinate.
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> overlaps;  // per prefix size
  for_each_size_class(set, work, [&](const SizeClass& cls) {
    Bytes fixed;
    for (const Term& term : terms) {
      const Bytes b = class_elements(term, cls.sizes);
      fixed.sent += b.sent;
      fixed.received += b.received;
    }
    if (same.empty()) return take(fixed);
    if (same.size() > 1) {
      for_each_coordinate(cls, same_dims, work, [&](const Dims& coord) {
        Bytes total = fixed;
        for (const Term* term : same) {
          const Bytes b = same_dim_elements(*term, cls.sizes, coord);
          total.sent += b.sent;
          total.received += b.received;
        }
        take(total);
      });
      return;
    }
    // In this class every rank holds |before_t| and |after_t| along t; what it keeps is the
    // overlap of its pieces at the step's mesh dim restricted to its later owners (the step is
    // valid: the later owners agree), so the busiest rank is the one keeping least.
    const Term& term = *same.front();
    const int m = term.dims.front();
    const int64_t n = cls.sizes[term.prefix];
    auto it = overlaps.find(n);
    if (it == overlaps.end()) it = overlaps.emplace(n, overlapping_pieces(n, term.ca.front(), term.cb.front(), work)).first;
    int64_t covered = 0;
    for (const auto& [first, last] : it->second)
      covered += std::max<int64_t>(0, std::min(last, cls.hi[m]) - std::max(first, cls.lo[m]));
    Wide least = 0;  // the least a rank of the class keeps
    if (covered == cls.hi[m] - cls.lo[m]) {
      // The same regroup recurs across a search's edges: its least, by everything it reads.
      // Symmetric in the two chains (the step is valid: the later owners agree, so each owner
      // keeps the same positions either way): one key for both orders.
      WorkBudget::Key key = {n}, ka, kb;
      for (auto [chain, k] : {std::pair{&term.ca, &ka}, std::pair{&term.cb, &kb}}) {
        k->push_back(static_cast<int64_t>(chain->size()));
        for (const Split& sp : *chain) k->insert(k->end(), {sp.mesh_dim, sp.k, sp.sf});
      }
      if (kb < ka) std::swap(ka, kb);
      key.insert(key.end(), ka.begin(), ka.end());
      key.insert(key.end(), kb.begin(), kb.end());
      for (int d : term.dims) key.insert(key.end(), {d, cls.lo[d], cls.hi[d]});
      if (auto hit = work.kept_checks.find(key); hit != work.kept_checks.end()) {
        least = hit->second;
      } else {
        least = -1;
        for (int64_t c = cls.lo[m]; c < cls.hi[m] && least != 0; ++c) {
          const Wide kept = least_kept(term, n, c, cls, work);
          least = least < 0 ? kept : std::min(least, kept);
        }
        work.kept_checks.emplace(std::move(key), static_cast<int64_t>(least));
      }
    }
    const Wide others = product_except(term, cls.sizes, term.t, -1);
    take({fixed.sent + (Wide{cls.sizes[term.a[term.t]]} - least) * others * term.item,
          fixed.received + (Wide{cls.sizes[term.b]} - least) * others * term.item});
  });
  return {to_bytes(sent, shape, dtype), to_bytes(received, shape, dtype)};
}

// ---- NOTE [ragged plans] (transition.h) ----
// A step on the ragged (last) dim d of a view, no other mesh dim splitting d: the rank at
// coordinate c of the step's mesh dim moves, along d, what its pieces before and after say,
// times its sizes along dims < d, which other mesh dims split independently of c. So the
// busiest rank is the busiest coordinate times the largest size of every other dim: O(k) work.

// The pieces of a list of n under p on a group of k, in O(k): a RaggedShard's ranges, S chunks,
// all of it (R, P).
class Pieces {
 public:
  Pieces(const Placement& p, int64_t n, int64_t k) : n_(n), k_(k), shard_(is_shard(p)) {
    if (const auto* r = std::get_if<RaggedShard>(&p)) bounds_ = ragged_boundaries(n, r->units, r->align);
  }
  Chunk operator[](int64_t c) const {
    if (!bounds_.empty()) return {bounds_[c], bounds_[c + 1] - bounds_[c]};
    if (shard_) return chunk(n_, k_, c);
    return {0, n_};
  }

 private:
  int64_t n_, k_;
  bool shard_;
  std::vector<int64_t> bounds_;
};
int64_t overlap(const Chunk& a, const Chunk& b) {
  return std::max<int64_t>(0, std::min(a.offset + a.size, b.offset + b.size) - std::max(a.offset, b.offset));
}
// The largest size any rank holds of the dims before the ragged one.
Wide largest_other_sizes(const Placements& ps, const Dims& shape, const Dims& mesh, WorkBudget& work) {
  Wide out = 1;
  for (int t = 0; t + 1 < shape.size(); ++t) {
    const std::vector<int64_t> sizes = distinct_sizes(shape[t], span_of(chain_of(ps, mesh, t)), mesh, work);
    out *= sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  }
  return out;
}

// What the busiest rank at each coordinate c of the ragged mesh dim r sends and receives in the
// step, in bytes: a step on r moves pieces of the ragged dim; an all-reduce on another mesh dim
// (HSDP's replicate dim) reduces c's piece. Every rank's bytes grow with its sizes along dims < d,
// which the step leaves alone, so the busiest rank at c holds the largest of them.
struct CoordBytes {
  std::vector<Wide> sent, received;
};
CoordBytes ragged_coord_bytes(const Step& step, const Placements& before, int r, const Dims& shape, const Dims& mesh,
                              DType dtype, WorkBudget& work) {
  const int64_t kr = mesh[r];
  CoordBytes out{std::vector<Wide>(kr, 0), std::vector<Wide>(kr, 0)};
  const int m = mesh_dim_of(step);
  const int64_t k = mesh[m];
  if (!communicates(step) || k == 1) return out;
  const WireBytes wb = wire_bytes(step, mesh, dtype);
  const int64_t n = shape[shape.size() - 1];
  const Wide others = largest_other_sizes(before, shape, mesh, work);
  work.add(kr);
  const Placements after = apply_step(step, before);
  const Pieces pa(before[r], n, kr), pb(after[r], n, kr);
  for (int64_t c = 0; c < kr; ++c) {
    const Chunk a = pa[c], b = pb[c];
    Wide sent = 0, received = 0;
    if (m != r) {  // an all-reduce of c's piece over k members (class_elements' model)
      const Wide e = Wide{a.size} * others;
      sent = received = wb.wire_ar ? e + Wide{k - 2} * ((e + k - 1) / k) : (Wide{2} * (k - 1) * e + k - 1) / k;
    } else if (std::holds_alternative<ReduceScatter>(step)) {
      // every member's contribution to c's range in, c's to every other out
      received = Wide{k - 1} * b.size * others;
      sent = (Wide{n} - b.size) * others;
    } else {  // an exchange: what c holds after and not before in; out, its piece to every peer
      // that holds it after (all of them for R, else the one piece of a partition holding it)
      const int64_t kept = overlap(a, b);
      received = (Wide{b.size} - kept) * others;
      sent = (is_replicate(after[m]) ? Wide{k - 1} * a.size : Wide{a.size} - kept) * others;
    }
    out.sent[c] = sent * wb.item + wb.scale;
    out.received[c] = received * wb.item + wb.scale;
  }
  return out;
}

// The ragged mesh dim of a route, -1 when none of its states has one.
int ragged_mesh_dim_of(std::span<const Placements> states) {
  for (const Placements& ps : states)
    if (const int r = ragged_mesh_dim(ps); r >= 0) return r;
  return -1;
}

std::optional<Traffic> ragged_step_traffic(const Step& step, const Placements& before, const Dims& shape,
                                           const Dims& mesh, DType dtype, WorkBudget& work) {
  const Placements after = apply_step(step, before);
  const int r = std::max(ragged_mesh_dim(before), ragged_mesh_dim(after));
  if (r < 0) return std::nullopt;
  const CoordBytes b = ragged_coord_bytes(step, before, r, shape, mesh, dtype, work);
  Wide sent = 0, received = 0;
  for (size_t c = 0; c < b.sent.size(); ++c) {
    sent = std::max(sent, b.sent[c]);
    received = std::max(received, b.received[c]);
  }
  return Traffic{to_bytes(sent, shape, dtype), to_bytes(received, shape, dtype)};
}

}  // namespace

Traffic step_traffic(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape,
                     DType dtype, WorkBudget& work) {
  if (std::optional<Traffic> r = ragged_step_traffic(step, before, global_shape, mesh_shape, dtype, work)) return *r;
  ChainSet set(mesh_shape);
  WorkBudget::Key key;
  if (!step_key(1, step, before, global_shape, mesh_shape, key)) {
    std::vector<Term> terms;
    terms.push_back(make_term(step, before, global_shape, mesh_shape, set, dtype));
    return busiest(terms, set, global_shape, dtype, work);
  }
  // One term: every rank moves elements x item + scale bytes, so the busiest rank's elements
  // (memoised per planning call, whatever the dtype: the LocalChunk check asks in u8, the search
  // then in the tensor's) give its bytes.
  const WireBytes wb = wire_bytes(step, mesh_shape, dtype);
  auto it = work.step_elements.find(key);
  if (it == work.step_elements.end()) {
    std::pair<int64_t, int64_t> elements{-1, -1};
    std::vector<Term> terms;
    terms.push_back(make_term(step, before, global_shape, mesh_shape, set, dtype));
    if (terms.front().kind != Term::kNone) {
      terms.front().item = 1;
      terms.front().scale_bytes = 0;
      const Traffic e = busiest(terms, set, global_shape, dtype, work);
      elements = {e.sent, e.received};
    }
    it = work.step_elements.emplace(key, elements).first;
  }
  const auto [sent, received] = it->second;
  if (sent < 0) return {};  // moves nothing
  return {to_bytes(Wide{sent} * wb.item + wb.scale, global_shape, dtype),
          to_bytes(Wide{received} * wb.item + wb.scale, global_shape, dtype)};
}

Traffic route_traffic(std::span<const Step> steps, std::span<const Placements> states, const Dims& global_shape,
                      const Dims& mesh_shape, DType dtype, WorkBudget& work) {
  if (const int r = ragged_mesh_dim_of(states); r >= 0) {
    // NOTE [ragged plans]: every step's bytes depend on the ragged coordinate c alone (the
    // others' sizes at their largest), so the busiest rank's route is the busiest c's sum.
    std::vector<Wide> sent(mesh_shape[r], 0), received(mesh_shape[r], 0);
    for (size_t i = 0; i < steps.size(); ++i) {
      const CoordBytes b = ragged_coord_bytes(steps[i], states[i], r, global_shape, mesh_shape, dtype, work);
      for (size_t c = 0; c < sent.size(); ++c) {
        sent[c] += b.sent[c];
        received[c] += b.received[c];
      }
    }
    Traffic out;
    for (size_t c = 0; c < sent.size(); ++c) {
      out.sent = std::max(out.sent, to_bytes(sent[c], global_shape, dtype));
      out.received = std::max(out.received, to_bytes(received[c], global_shape, dtype));
    }
    return out;
  }
  ChainSet set(mesh_shape);
  std::vector<Term> terms;
  for (size_t i = 0; i < steps.size(); ++i) terms.push_back(make_term(steps[i], states[i], global_shape, mesh_shape, set, dtype));
  return busiest(terms, set, global_shape, dtype, work);
}

namespace {

// lower_bound_traffic on the view of a RaggedShard transition (NOTE [ragged plans]).
Traffic ragged_lower_bound(const DTensorSpec& src, const RaggedMapping& v) {
  const Dims& mesh = src.mesh->shape();
  const Dims& shape = v.view;
  const int64_t item = static_cast<int64_t>(kernels::itemsize(src.dtype));
  const int r = std::max(ragged_mesh_dim(v.src), ragged_mesh_dim(v.dst));
  const int64_t k = mesh[r], n = shape[shape.size() - 1];
  WorkBudget work(kMaxPlanWork, [&] { return fmt::format("the lower bound of [{}] -> [{}]", to_string(v.src), to_string(v.dst)); });
  work.add(k);
  const Wide others = largest_other_sizes(v.src, shape, mesh, work);
  Wide largest_after = 0, received = 0;
  const Pieces pa(v.src[r], n, k), pb(v.dst[r], n, k);
  for (int64_t c = 0; c < k; ++c) {
    const Chunk a = pa[c], b = pb[c];
    largest_after = std::max(largest_after, Wide{b.size});
    received = std::max(received, Wide{b.size} - overlap(a, b));
  }
  // Partial mesh dims reduced (the ragged one's P -> Rg, others' P -> R) and kept.
  Wide contributions = 1, classes = 1;
  for (int q = 0; q < mesh.size(); ++q) {
    if (!is_partial(v.src[q])) continue;
    if (is_partial(v.dst[q])) classes *= mesh[q];
    else contributions *= mesh[q];
  }
  if (contributions == 1) return {0, to_bytes(received * others * item, shape, src.dtype)};
  // A reduction of C contributions (planner.h's model): the mesh receives at least
  // numel x (C - 2) x the kept-Partial classes + every rank's new local size; the busiest rank
  // at least the average and at least its own new local size.
  Wide numel = 1, held_after = 1;
  for (int64_t s : shape) numel *= s;
  held_after = numel;
  for (int q = 0; q < mesh.size(); ++q)
    if (!split_dim(v.dst[q])) held_after *= mesh[q];
  Wide world = 1;
  for (int64_t s : mesh) world *= s;
  const Wide total = numel * (contributions - 2) * classes + held_after;
  const Wide average = (total + world - 1) / world;
  return {0, to_bytes(std::max(average, largest_after * others) * item, shape, src.dtype)};
}

}  // namespace

Traffic lower_bound_traffic(const DTensorSpec& src, const Placements& dst_in) {
  if (std::optional<RaggedMapping> v = map_ragged_transition(
          src.mesh->shape(), src.shape, src.placements, normalize_placements(dst_in, src.mesh->ndim(), src.tensor_ndim())))
    return ragged_lower_bound(src, *v);
  const DeviceMesh& mesh = *src.mesh;
  const Dims& mesh_shape = mesh.shape();
  const Dims& shape = src.shape;
  const int64_t item = static_cast<int64_t>(kernels::itemsize(src.dtype));
  const Placements& from = src.placements;
  // What must be held after: a new Partial (a zero-fill) needs nothing beyond its source.
  Placements dst = normalize_placements(dst_in, mesh.ndim(), src.tensor_ndim());
  int64_t contributions = 1, classes = 1;
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (is_partial(dst[m]) && !is_partial(from[m])) dst[m] = from[m];
    if (!is_partial(from[m]) || mesh.size(m) == 1) continue;
    if (from[m] == dst[m]) classes *= mesh.size(m);  // a kept Partial: separate values
    else contributions *= mesh.size(m);              // reduced
  }
  WorkBudget work(kMaxPlanWork, [&] {
    return fmt::format("the lower bound of [{}] -> [{}] on mesh [{}]", to_string(from), to_string(dst),
                       fmt::join(mesh_shape, ","));
  });
  ChainSet set(mesh_shape);
  const int ndim = src.tensor_ndim();
  std::vector<int> after(ndim), kept(ndim);
  for (int t = 0; t < ndim; ++t) after[t] = set.add(shape[t], chain_of(dst, mesh_shape, t));
  if (contributions > 1) {
    // Partial mesh dims reduced: each element's C contributions merge with C-1 transfers and
    // reach its D holders with D-1 more (planner.h); the busiest rank at least the average.
    Wide held_after = 1;  // every rank's new local size, summed: numel x the replication
    for (int64_t n : shape) held_after *= n;
    for (int m = 0; m < mesh.ndim(); ++m)
      if (!shard_dim(dst[m])) held_after *= mesh.size(m);
    Wide numel = 1;
    for (int64_t n : shape) numel *= n;
    const Wide total = numel * (contributions - 2) * classes + held_after;
    const Wide average = (total + mesh.size() - 1) / mesh.size();
    Wide largest = 0;
    for_each_size_class(set, work, [&](const SizeClass& c) {
      Wide held = 1;
      for (int t = 0; t < ndim; ++t) held *= c.sizes[after[t]];
      largest = std::max(largest, held);
    });
    return {0, to_bytes(std::max(average, largest) * item, shape, src.dtype)};
  }
  // No reduction: what a rank holds after and not before. Per tensor dim, when one chain's
  // pieces nest in the other's, the overlap is the smaller one's size; otherwise it is counted
  // per coordinate of the mesh dims where the chains differ.
  struct Explicit {
    int t, prefix;
    SplitList a, b;
    std::vector<int> a_dims, b_dims;
  };
  std::vector<Explicit> explicit_dims;
  std::vector<int> explicit_mesh_dims;
  for (int t = 0; t < ndim; ++t) {
    const SplitList a = chain_of(from, mesh_shape, t), b = chain_of(dst, mesh_shape, t);
    const int before = set.add(shape[t], a);
    size_t common_len = 0;
    while (common_len < a.size() && common_len < b.size() && a[common_len] == b[common_len]) ++common_len;
    const SplitList prefix(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(common_len));
    const std::span<const Split> ra(a.data() + common_len, a.size() - common_len), rb(b.data() + common_len, b.size() - common_len);
    auto nests = [&](std::span<const Split> longer, std::span<const Split> shorter) {
      if (shorter.empty()) return true;
      if (longer.size() != shorter.size() + 1 || !std::equal(shorter.begin(), shorter.end(), longer.begin() + 1))
        return false;
      for (int64_t n : distinct_sizes(shape[t], span_of(prefix), mesh_shape, work))
        if (!same_later_owners(n, longer.front(), std::nullopt, shorter, work)) return false;
      return true;
    };
    if (nests(ra, rb)) {
      kept[t] = before;  // before's pieces lie inside after's
    } else if (nests(rb, ra)) {
      kept[t] = after[t];
    } else {
      kept[t] = -1;
      Explicit e{t, set.add(shape[t], prefix), SplitList(ra.begin(), ra.end()), SplitList(rb.begin(), rb.end()), {}, {}};
      for (const Split& s : e.a) e.a_dims.push_back(s.mesh_dim);
      for (const Split& s : e.b) e.b_dims.push_back(s.mesh_dim);
      explicit_mesh_dims.insert(explicit_mesh_dims.end(), e.a_dims.begin(), e.a_dims.end());
      explicit_mesh_dims.insert(explicit_mesh_dims.end(), e.b_dims.begin(), e.b_dims.end());
      explicit_dims.push_back(std::move(e));
    }
  }
  std::sort(explicit_mesh_dims.begin(), explicit_mesh_dims.end());
  explicit_mesh_dims.erase(std::unique(explicit_mesh_dims.begin(), explicit_mesh_dims.end()), explicit_mesh_dims.end());
  Wide received = 0;
  for_each_size_class(set, work, [&](const SizeClass& c) {
    Wide need = 1, fixed = 1;
    for (int t = 0; t < ndim; ++t) {
      need *= c.sizes[after[t]];
      if (kept[t] >= 0) fixed *= c.sizes[kept[t]];
    }
    if (explicit_dims.empty()) {
      received = std::max(received, need - fixed);
      return;
    }
    for_each_coordinate(c, explicit_mesh_dims, work, [&](const Dims& coord) {
      Wide overlap = fixed;
      for (const Explicit& e : explicit_dims) {
        std::vector<int64_t> ca, cb;
        for (int d : e.a_dims) ca.push_back(coord[d]);
        for (int d : e.b_dims) cb.push_back(coord[d]);
        const int64_t n = c.sizes[e.prefix];
        overlap *= common(chain_positions(n, span_of(e.a), ca), chain_positions(n, span_of(e.b), cb));
      }
      received = std::max(received, need - overlap);
    });
  });
  return {0, to_bytes(received * item, shape, src.dtype)};
}

}  // namespace dtensor
