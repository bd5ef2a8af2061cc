// The coverage check of a tensor's chunks (internal.h), in O(n log n) for the layouts DTensors
// give.
//
// After bounds and volume checks (every chunk inside the shape; the non-empty chunks' volumes
// add up to the tensor's), the chunks tile the tensor iff they do not overlap. That is checked
// by guillotine cuts: in a region (first: the whole tensor) sort its chunks by their offset in a
// dim and sweep, keeping the furthest end seen; an offset at or past it is a straight cut no
// chunk crosses (and an offset past it a gap: an error naming it). Chunks between cuts tile the
// slab between them iff the region is tiled, so each slab is checked the same way, trying the
// dims in order. A region holding one chunk must be exactly that chunk. A grid of chunks (any
// product of per-dim runs, the layouts of every placement) splits within nd levels: O(nd^2 n log n).
// Chunks that no straight cut separates (a pinwheel, never written by a DTensor layout) are
// compared pairwise, at most kMaxIrregular of them; a total sorting budget bounds adversarial
// layouts (each cut peeling one chunk): beyond either the checkpoint is refused by name rather
// than checked for minutes.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "checkpoint/internal.h"
#include "kernels/checked.h"
#include "kernels/format.h"

namespace checkpoint::detail {

namespace {

constexpr size_t kMaxIrregular = 2048;

struct Region {
  Dims lo, hi;  // global [lo, hi) per dim
  size_t begin = 0, end = 0;  // its chunks: order[begin, end)
};

}  // namespace

void check_coverage(const std::string& dir, const std::string& key, const TensorInfo& ti) {
  const int nd = ti.shape.size();
  const auto& chunks = ti.chunks;
  auto fail = [&](const std::string& what) {
    throw kernels::InvalidArgument(fmt::format("checkpoint: '{}': {}", dir, what));
  };
  const int64_t total = kernels::checked_product(std::span<const int64_t>(ti.shape.begin(), ti.shape.end()),
                                                 fmt::format("checkpoint: '{}': the element count of '{}'", dir, key));
  std::vector<uint32_t> order;  // the non-empty chunks
  int64_t sum = 0;
  bool over = false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkInfo& c = chunks[i];
    if (c.offsets.size() != nd || c.sizes.size() != nd)
      fail(fmt::format("a chunk of '{}' at {} size {} has not the {} dims of its shape {}", key, c.offsets, c.sizes,
                       nd, ti.shape));
    for (int d = 0; d < nd; ++d)  // offset + size <= shape, without forming the sum
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.sizes[d] > ti.shape[d] || c.offsets[d] > ti.shape[d] - c.sizes[d])
        fail(fmt::format("a chunk of '{}' at {} size {} lies outside its shape {}", key, c.offsets, c.sizes,
                         ti.shape));
    const int64_t vol = c.sizes.product();  // <= total: inside the shape
    if (vol == 0) continue;
    if (vol > total - sum) over = true;  // overlaps: found below, naming them
    else sum += vol;
    if (order.size() == UINT32_MAX) fail(fmt::format("'{}' has more than {} chunks", key, UINT32_MAX));
    order.push_back(static_cast<uint32_t>(i));
  }
  if (!over && sum != total)
    fail(fmt::format("the chunks of '{}' cover {} of its {} elements (missing data files?)", key, sum, total));
  if (order.empty()) return;  // an empty tensor

  const size_t n = order.size();
  const uint64_t budget = 8 * static_cast<uint64_t>(nd + 1) * static_cast<uint64_t>(nd + 1) * n + (uint64_t{1} << 22);
  uint64_t work = 0;
  auto lo = [&](uint32_t i, int d) { return chunks[i].offsets[d]; };
  auto hi = [&](uint32_t i, int d) { return chunks[i].offsets[d] + chunks[i].sizes[d]; };
  auto gap = [&](const Region& r, int d, int64_t a, int64_t b) {
    Dims off = r.lo, size = r.hi;
    for (int k = 0; k < nd; ++k) size[k] = r.hi[k] - r.lo[k];
    off[d] = a;
    size[d] = b - a;
    fail(fmt::format("no chunk of '{}' holds its elements at {} size {} (the chunks overlap or miss data)", key, off,
                     size));
  };
  std::vector<Region> stack;
  stack.push_back({Dims::filled(nd, 0), ti.shape, 0, n});
  while (!stack.empty()) {
    const Region r = stack.back();
    stack.pop_back();
    const size_t m = r.end - r.begin;
    if (m == 1) {
      const ChunkInfo& c = chunks[order[r.begin]];
      for (int d = 0; d < nd; ++d)
        if (c.offsets[d] != r.lo[d] || hi(order[r.begin], d) != r.hi[d]) {
          Dims size = r.hi;
          for (int k = 0; k < nd; ++k) size[k] = r.hi[k] - r.lo[k];
          fail(fmt::format("the chunks of '{}' leave part of its elements at {} size {} empty: only the chunk at {} "
                           "size {} lies there (the chunks overlap or miss data)",
                           key, r.lo, size, c.offsets, c.sizes));
        }
      continue;
    }
    bool split = false;
    for (int d = 0; d < nd && !split; ++d) {
      work += m;
      if (work > budget)
        fail(fmt::format("the {} chunks of '{}' are too irregular to check in bounded time (more than {} sorting "
                         "steps); a DTensor layout never gives such chunks",
                         n, key, budget));
      auto first = order.begin() + static_cast<std::ptrdiff_t>(r.begin);
      auto last = order.begin() + static_cast<std::ptrdiff_t>(r.end);
      std::sort(first, last, [&](uint32_t a, uint32_t b) { return lo(a, d) < lo(b, d); });
      if (lo(order[r.begin], d) > r.lo[d]) gap(r, d, r.lo[d], lo(order[r.begin], d));
      std::vector<Region> groups;
      size_t start = r.begin;
      int64_t group_lo = lo(order[r.begin], d), reach = hi(order[r.begin], d);
      for (size_t k = r.begin + 1; k < r.end; ++k) {
        const uint32_t b = order[k];
        if (lo(b, d) >= reach) {  // a straight cut at `reach`
          if (lo(b, d) > reach) gap(r, d, reach, lo(b, d));
          Region g = r;
          g.lo[d] = group_lo;
          g.hi[d] = reach;
          g.begin = start;
          g.end = k;
          groups.push_back(g);
          start = k;
          group_lo = lo(b, d);
        }
        reach = std::max(reach, hi(b, d));
      }
      if (reach < r.hi[d]) gap(r, d, reach, r.hi[d]);
      if (groups.empty()) continue;  // no cut in dim d
      Region g = r;
      g.lo[d] = group_lo;
      g.hi[d] = reach;
      g.begin = start;
      groups.push_back(g);
      stack.insert(stack.end(), groups.begin(), groups.end());
      split = true;
    }
    if (split) continue;
    // No straight cut separates these chunks: disjoint pairwise (the volumes then fill the region).
    if (m > kMaxIrregular)
      fail(fmt::format("{} chunks of '{}' are not separated by any straight cut (more than {}); a DTensor layout "
                       "never gives such chunks",
                       m, key, kMaxIrregular));
    for (size_t a = r.begin; a < r.end; ++a)
      for (size_t b = a + 1; b < r.end; ++b) {
        bool overlap = true;
        for (int d = 0; d < nd && overlap; ++d)
          overlap = std::max(lo(order[a], d), lo(order[b], d)) < std::min(hi(order[a], d), hi(order[b], d));
        if (overlap)
          fail(fmt::format("chunks of '{}' at {} and {} overlap", key, chunks[order[a]].offsets,
                           chunks[order[b]].offsets));
      }
  }
  if (over)  // unreachable: overlapping chunks fail above
    fail(fmt::format("the chunks of '{}' hold more than its {} elements (they overlap)", key, total));
}

}  // namespace checkpoint::detail
