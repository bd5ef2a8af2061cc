#include "dtensor/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

// ceil(a / b) without forming a + b - 1, which overflows for a near INT64_MAX.
int64_t ceil_div(int64_t a, int64_t b) { return kernels::checked_ceil_div(a, b, "chunk size"); }

// The pieces [begin, end) of positions 0..n-1 kept by `index`, in local order.
void append_range(IndexRuns& out, int64_t begin, int64_t end) {
  if (end <= begin) return;
  if (!out.empty() && out.back().start + out.back().length == begin)
    out.back().length += end - begin;
  else
    out.push_back({begin, end - begin});
}

// Where select_positions stopped: runs[index] starts at local position `pos`. Successive calls
// with increasing positions resume from it, so one split costs O(runs + pieces), not their product.
struct RunCursor {
  size_t index = 0;
  int64_t pos = 0;
};

// Selects positions [begin, end) of the index list described by `runs` (local order).
// REQUIRES: begin >= the end of the previous call with the same cursor.
void select_positions(const IndexRuns& runs, int64_t begin, int64_t end, IndexRuns& out, RunCursor& at) {
  for (; at.index < runs.size(); ++at.index) {
    const IndexRun& run = runs[at.index];
    const int64_t lo = std::max(begin, at.pos), hi = std::min(end, at.pos + run.length);
    if (lo < hi) append_range(out, run.start + (lo - at.pos), run.start + (hi - at.pos));
    if (at.pos + run.length > end) break;  // the next call may need the rest of this run
    at.pos += run.length;
  }
}

}  // namespace

Chunk chunk(int64_t n, int64_t k, int64_t index) {
  // REQUIRES: n >= 0, k >= 1, 0 <= index < k (checked by callers that take user input).
  if (n % k == 0) return {index * (n / k), n / k};
  const int64_t c = ceil_div(n, k);
  // index * c <= n + c may exceed INT64_MAX when n does not (n near INT64_MAX, k small).
  int64_t start = 0;
  if (__builtin_mul_overflow(index, c, &start) || start > n) return {n, 0};
  return {start, std::min(n - start, c)};
}

Chunk ragged_chunk(int64_t n, const std::vector<int64_t>& units, int64_t align, int64_t index) {
  __extension__ typedef __int128 Wide;
  Wide total = 0, before = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    if (static_cast<int64_t>(i) == index) before = total;
    total += units[i];
  }
  const int64_t k = static_cast<int64_t>(units.size());
  auto boundary = [&](int64_t i, Wide prefix) -> int64_t {
    if (i == k) return n;
    const int64_t b = static_cast<int64_t>(Wide{n} * prefix / total);  // <= n
    return b / align * align;
  };
  const int64_t lo = boundary(index, before), hi = boundary(index + 1, before + units[index]);
  return {lo, hi - lo};
}

std::vector<int64_t> ragged_boundaries(int64_t n, const std::vector<int64_t>& units, int64_t align) {
  __extension__ typedef __int128 Wide;
  Wide total = 0;
  for (int64_t u : units) total += u;
  std::vector<int64_t> out;
  out.reserve(units.size() + 1);
  Wide prefix = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    out.push_back(static_cast<int64_t>(Wide{n} * prefix / total) / align * align);
    prefix += units[i];
  }
  out.push_back(n);
  return out;
}

Dims ragged_view(const Dims& global_shape, const Placements& placements) {
  const int r = ragged_mesh_dim(placements);
  if (r < 0) return global_shape;
  const int d = *ragged_dim(placements[r]);
  const int ndim = global_shape.size();
  if (d < 0 || d >= ndim)
    throw InvalidArgument(fmt::format("ragged dim {} of {} out of range for a {}-d tensor", d,
                                      to_string(placements[r]), ndim));
  for (size_t m = 0; m < placements.size(); ++m) {
    const std::optional<int> t = shard_dim(placements[m]);
    if (!t || *t < d) continue;
    if (*t == d && is_shard(placements[m]) && static_cast<int>(m) > r) continue;
    const std::string before = d == 0 ? std::string() : fmt::format("S/_S of dims < {}, ", d);
    throw kernels::Unsupported(fmt::format(
        "placements [{}]: {} on mesh dim {} does not compose with {} on mesh dim {} (the ranks' sets would not "
        "be ranges of the flattened dims {}..{}; allowed: R, P, {}S({}) on a later mesh dim)",
        to_string(placements), to_string(placements[m]), m, to_string(placements[r]), r, d, ndim - 1, before, d));
  }
  Dims view;
  int64_t flat = 1;
  for (int t = 0; t < ndim; ++t) {
    if (t < d) view.push_back(global_shape[t]);
    else flat = kernels::checked_mul(flat, global_shape[t], "the flattened size of a RaggedShard");
  }
  view.push_back(flat);
  return view;
}

std::vector<FlatBox> flat_range_boxes(const Dims& dims, int64_t start, int64_t length) {
  const int n = dims.size();
  // inner[k]: elements of one index of dim k (the product of dims k+1..n-1).
  std::vector<int64_t> inner(static_cast<size_t>(n) + 1, 1);
  for (int k = n - 1; k >= 0; --k) {
    if (dims[k] < 0)
      throw InvalidArgument(fmt::format("flat_range_boxes: shape [{}] has a negative size", fmt::join(dims, ",")));
    inner[static_cast<size_t>(k)] =
        kernels::checked_mul(inner[static_cast<size_t>(k) + 1], dims[k], "flat_range_boxes: the shape's size");
  }
  const int64_t total = inner[0];
  if (start < 0 || length < 0 || start > total || length > total - start)
    throw InvalidArgument(fmt::format("flat_range_boxes: range [{}, {} + {}) outside the {} elements of shape [{}]",
                                      start, start, length, total, fmt::join(dims, ",")));
  std::vector<FlatBox> out;
  if (length == 0) return out;
  if (n == 0) {
    out.push_back({{}, {}, 0});
    return out;
  }
  Dims off = Dims::filled(n, 0);
  auto emit = [&](int k, int64_t first, int64_t count, int64_t flat) {
    FlatBox b;
    for (int t = 0; t < n; ++t) {
      b.offsets.push_back(t < k ? off[t] : t == k ? first : 0);
      b.sizes.push_back(t < k ? 1 : t == k ? count : dims[t]);
    }
    b.flat = flat;
    out.push_back(std::move(b));
  };
  // [a, b) of the sub-tensor of dims k..n-1 at off[0..k), whose first element has flat index base.
  auto rec = [&](auto&& self, int k, int64_t a, int64_t b, int64_t base) -> void {
    if (a >= b) return;
    const int64_t in = inner[static_cast<size_t>(k) + 1];
    int64_t ra = a / in, rb = b / in;
    const int64_t ca = a % in, cb = b % in;
    if (ra == rb) {  // inside one index of dim k
      off[k] = ra;
      self(self, k + 1, ca, cb, base + ra * in);
      return;
    }
    if (ca > 0) {  // the partial first index
      off[k] = ra;
      self(self, k + 1, ca, in, base + ra * in);
      ++ra;
    }
    if (rb > ra) emit(k, ra, rb - ra, base + ra * in);
    if (cb > 0) {  // the partial last index
      off[k] = rb;
      self(self, k + 1, 0, cb, base + rb * in);
    }
  };
  rec(rec, 0, start, start + length, 0);
  return out;
}

IndexRuns split_positions(int64_t n, int64_t k, int64_t index, int split_factor) {
  IndexRuns out;
  if (split_factor == 0) {
    Chunk c = chunk(n, k, index);
    append_range(out, c.offset, c.offset + c.size);
    return out;
  }
  // NOTE [strided split] chunk n into split_factor pieces, chunk each piece into k, and keep
  // sub-piece `index` of every piece, concatenated in piece order (docs/pytorch-semantics.md 2.3).
  // Pieces past the end are empty: the loop stops at the last non-empty one, so the work is
  // bounded by min(split_factor, n) (split factors are bounded by kMaxSplitFactor too).
  const int64_t piece = ceil_div(n, split_factor);
  int64_t begin = 0;
  for (int64_t j = 0; j < split_factor && begin < n; ++j, begin += std::min(piece, n - begin)) {
    const int64_t end = begin + std::min(piece, n - begin);
    Chunk sub = chunk(end - begin, k, index);
    if (sub.size > 0) append_range(out, begin + sub.offset, begin + sub.offset + sub.size);
  }
  return out;
}

std::vector<int64_t> ShardLayout::indices(int tensor_dim) const {
  std::vector<int64_t> out;
  out.reserve(local_shape[tensor_dim]);
  for (const IndexRun& run : runs[tensor_dim])
    for (int64_t i = 0; i < run.length; ++i) out.push_back(run.start + i);
  return out;
}

IndexRuns slice_runs(const IndexRuns& runs, int64_t offset, int64_t size) {
  int64_t total = 0;
  for (const IndexRun& r : runs) total = kernels::checked_add(total, r.length, "index run lengths");
  if (offset < 0 || size < 0 || offset > total || size > total - offset)
    throw InvalidArgument(
        fmt::format("slice_runs: positions [{}, {} + {}) of an index list of {}", offset, offset, size, total));
  IndexRuns out;
  RunCursor at;
  select_positions(runs, offset, offset + size, out, at);
  return out;
}

HeldIndices::HeldIndices(IndexRuns runs) : runs_(std::move(runs)) {
  first_.reserve(runs_.size());
  for (const IndexRun& r : runs_) {
    first_.push_back(size_);
    size_ = kernels::checked_add(size_, r.length, "index run lengths");
  }
}

size_t HeldIndices::run_of(int64_t pos) const {
  // The last run whose first position is <= pos.
  return static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), pos) - first_.begin()) - 1;
}

ShardLayout compute_layout(const Dims& tensor_shape, const Dims& mesh_shape,
                           const Placements& placements, const Dims& coord) {
  if (static_cast<int>(placements.size()) != mesh_shape.size())
    throw InvalidArgument(fmt::format("{} placements ({}) for a {}-d mesh (expected {})",
                                      placements.size(), to_string(placements),
                                      mesh_shape.size(), mesh_shape.size()));
  for (int t = 0; t < tensor_shape.size(); ++t)
    if (tensor_shape[t] < 0)
      throw InvalidArgument(fmt::format("global shape [{}] has a negative size", fmt::join(tensor_shape, ",")));
  const Dims global_shape = ragged_view(tensor_shape, placements);
  const int ndim = global_shape.size();
  if (coord.size() != mesh_shape.size())
    throw InvalidArgument(fmt::format("coordinate [{}] does not match mesh shape [{}]",
                                      fmt::join(coord, ","), fmt::join(mesh_shape, ",")));
  ShardLayout layout;
  layout.runs.resize(ndim);
  std::vector<bool> sharded(ndim, false);
  for (int t = 0; t < ndim; ++t) {
    if (global_shape[t] < 0)
      throw InvalidArgument(fmt::format("global shape [{}] has a negative size",
                                        fmt::join(global_shape, ",")));
    if (global_shape[t] > 0) layout.runs[t].push_back({0, global_shape[t]});
  }
  for (int m = 0; m < mesh_shape.size(); ++m) {
    if (const auto* r = std::get_if<RaggedShard>(&placements[m])) {
      if (static_cast<int64_t>(r->units.size()) != mesh_shape[m])
        throw InvalidArgument(fmt::format("{} on mesh dim {} has {} units for {} ranks (expected one per rank)",
                                          to_string(placements[m]), m, r->units.size(), mesh_shape[m]));
      if (coord[m] < 0 || coord[m] >= mesh_shape[m])
        throw InvalidArgument(fmt::format("coordinate [{}] outside mesh shape [{}]", fmt::join(coord, ","),
                                          fmt::join(mesh_shape, ",")));
      const int t = ndim - 1;  // the flattened dim; nothing before this mesh dim split it
      sharded[t] = true;
      const Chunk c = ragged_chunk(global_shape[t], r->units, r->align, coord[m]);
      layout.runs[t].clear();
      append_range(layout.runs[t], c.offset, c.offset + c.size);
      continue;
    }
    std::optional<int> t = shard_dim(placements[m]);
    if (!t) continue;
    if (*t < 0 || *t >= ndim)
      throw InvalidArgument(fmt::format("shard dim {} of {} out of range for a {}-d tensor",
                                        *t, to_string(placements[m]), ndim));
    if (coord[m] < 0 || coord[m] >= mesh_shape[m])
      throw InvalidArgument(fmt::format("coordinate [{}] outside mesh shape [{}]",
                                        fmt::join(coord, ","), fmt::join(mesh_shape, ",")));
    int split_factor = 0;
    if (const auto* s = std::get_if<StridedShard>(&placements[m])) {
      if (s->split_factor < 1)
        throw InvalidArgument(fmt::format("split factor {} of {} must be >= 1", s->split_factor,
                                          to_string(placements[m])));
      split_factor = s->split_factor;
    }
    sharded[*t] = true;
    IndexRuns& runs = layout.runs[*t];
    int64_t n = 0;
    for (const IndexRun& r : runs) n += r.length;
    IndexRuns kept;
    RunCursor at;
    for (const IndexRun& pos : split_positions(n, mesh_shape[m], coord[m], split_factor))
      select_positions(runs, pos.start, pos.start + pos.length, kept, at);
    if (kept.size() > static_cast<size_t>(kMaxIndexRuns))
      throw kernels::Unsupported(fmt::format(
          "placements [{}] on mesh [{}] cut tensor dim {} of size {} into {} index runs on one rank, "
          "more than the limit of {} (nested split factors multiply)",
          to_string(placements), fmt::join(mesh_shape, ","), *t, global_shape[*t], kept.size(), kMaxIndexRuns));
    runs = std::move(kept);
  }
  for (int t = 0; t < ndim; ++t) {
    int64_t n = 0;
    for (const IndexRun& r : layout.runs[t]) n += r.length;
    layout.local_shape.push_back(n);
    if (!sharded[t])
      layout.global_offset.push_back(0);
    else
      layout.global_offset.push_back(n == 0 ? global_shape[t] : layout.runs[t].front().start);
  }
  return layout;
}

int64_t common_elements(const ShardLayout& a, const ShardLayout& b) {
  // Held indices are increasing in local order (every split keeps an ordered sub-list), so the
  // runs of each dim are sorted and disjoint: a merge walk counts the overlap.
  if (a.runs.size() != b.runs.size())
    throw InvalidArgument(fmt::format("common_elements: layouts of {} and {} dims (a RaggedShard's view against "
                                      "the tensor's shape?)", a.runs.size(), b.runs.size()));
  int64_t n = 1;
  for (size_t t = 0; t < a.runs.size() && n > 0; ++t) {
    const IndexRuns &x = a.runs[t], &y = b.runs[t];
    int64_t count = 0;
    size_t i = 0, j = 0;
    while (i < x.size() && j < y.size()) {
      const int64_t lo = std::max(x[i].start, y[j].start);
      const int64_t hi = std::min(x[i].start + x[i].length, y[j].start + y[j].length);
      if (lo < hi) count += hi - lo;
      if (x[i].start + x[i].length < y[j].start + y[j].length) ++i;
      else ++j;
    }
    n *= count;
  }
  return n;
}

std::optional<ShardLayout> layout_of_rank(const Dims& global_shape, const DeviceMesh& mesh,
                                          const Placements& placements, int rank) {
  std::optional<Dims> coord = mesh.coord_of(rank);
  if (!coord) return std::nullopt;
  return compute_layout(global_shape, mesh.shape(), placements, *coord);
}

}  // namespace dtensor
