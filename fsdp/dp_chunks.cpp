#include "fsdp/dp_chunks.h"

#include <fmt/format.h>

#include <vector>

#include "dtensor/layout.h"
#include "dtensor/plan/chain.h"
#include "dtensor/mesh.h"
#include "kernels/checked.h"
#include "kernels/format.h"

namespace fsdp {

using dtensor::Split;
using kernels::Dims;

namespace {

// A sequence of sizes as runs (size, count): counts > 0, adjacent sizes distinct.
using SizeRuns = std::vector<std::pair<int64_t, int64_t>>;
void push(SizeRuns& runs, int64_t size, int64_t count) {
  if (count <= 0) return;
  if (!runs.empty() && runs.back().first == size) runs.back().second += count;
  else runs.emplace_back(size, count);
}
// The torch.chunk piece sizes of n into k, mapped by f, as runs: ceil(n/k)-sized pieces, one
// partial piece, then empties.
template <class F>
SizeRuns piece_runs(int64_t n, int64_t k, F&& f) {
  SizeRuns runs;
  const int64_t piece = n == 0 ? 0 : (n + k - 1) / k;
  const int64_t full = piece == 0 ? 0 : n / piece, rem = n - full * piece;
  push(runs, f(piece), full);
  push(runs, f(rem), rem > 0 ? 1 : 0);
  push(runs, f(0), k - full - (rem > 0 ? 1 : 0));
  return runs;
}

// NOTE: the strided dp split of a list of m (factor sf) keeps, of each of its sf torch.chunk
// pieces, sub-chunk c over dp, in piece order; the tp split (k = sf) then cuts that kept list by
// torch.chunk. Rank (c, j) holds chunk c of tp piece j exactly when the tp split's piece sizes
// of the kept list are the sub-chunk sizes, piece by piece (both lists are the same positions in
// the same order, so equal sizes mean equal pieces).
bool chunk_sizes_match(int64_t m, int64_t sf, int64_t dp, int64_t c) {
  const SizeRuns kept = piece_runs(m, sf, [&](int64_t p) { return dtensor::chunk(p, dp, c).size; });
  int64_t total = 0;
  for (const auto& [size, count] : kept) total += size * count;
  return kept == piece_runs(total, sf, [](int64_t p) { return p; });
}

}  // namespace

std::optional<DpChunkVerdict> check_dp_chunks(const Dims& global_shape, const Dims& mesh_shape,
                                              const dtensor::Placements& unsharded,
                                              const dtensor::Placements& sharded, int shard_mesh_dim, int sd) {
  const int64_t dp = mesh_shape[shard_mesh_dim];
  const int64_t n = global_shape[sd];
  dtensor::WorkBudget work(dtensor::kMaxPlanWork, [&] {
    return fmt::format("fully_shard's dp chunk check of {} over mesh {} (dim {} of size {})",
                       dtensor::to_string(sharded), mesh_shape, sd, n);
  });
  const dtensor::SplitList tp = dtensor::chain_of(unsharded, mesh_shape, sd);
  if (sd > 0)
    for (int64_t size : dtensor::distinct_sizes(n, dtensor::span_of(tp), mesh_shape, work))
      if (size % dp != 0) return DpChunkVerdict{DpChunkVerdict::kIndivisible, size};
  if (dp == 1) return std::nullopt;
  const dtensor::SplitList all = dtensor::chain_of(sharded, mesh_shape, sd);
  dtensor::SplitList before, later;
  std::optional<Split> at;
  for (const Split& s : all) {
    if (s.mesh_dim < shard_mesh_dim) before.push_back(s);
    else if (s.mesh_dim == shard_mesh_dim) at = s;
    else later.push_back(s);
  }
  if (!at) return DpChunkVerdict{DpChunkVerdict::kNotChunks, n};  // (unreachable: dp > 1 splits sd)
  // A plain split after every other split of sd takes torch.chunk pieces of the tp list: valid.
  if (later.empty() && at->sf == 0) return std::nullopt;
  int64_t tp_group = 1;
  bool plain_later = true;
  for (const Split& s : later) {
    tp_group = kernels::checked_mul(tp_group, s.k, "tensor-parallel group size");
    plain_later = plain_later && s.sf == 0;
  }
  const int64_t sf = at->sf == 0 ? 1 : at->sf;
  std::vector<int64_t> coords(later.size() + 1);
  dtensor::SplitList with_dp;
  with_dp.push_back(*at);
  with_dp.insert(with_dp.end(), later.begin(), later.end());
  for (int64_t m : dtensor::distinct_sizes(n, dtensor::span_of(before), mesh_shape, work)) {
    // Even tp pieces: the strided split takes chunk c of each, which the later splits hand out whole.
    if (plain_later && sf == tp_group && m % sf == 0) continue;
    if (plain_later && later.size() == 1 && later[0].k == sf) {
      // One tp split of the same factor: by sizes alone, O(dp) (NOTE in chunk_sizes_match).
      work.add(dp);
      for (int64_t c = 0; c < dp; ++c)
        if (!chunk_sizes_match(m, sf, dp, c)) return DpChunkVerdict{DpChunkVerdict::kNotChunks, n};
      continue;
    }
    for (int64_t t = 0; t < tp_group; ++t) {
      int64_t rest = t;
      for (size_t i = later.size(); i-- > 0;) {
        coords[i + 1] = rest % later[i].k;
        rest /= later[i].k;
      }
      const std::span<const int64_t> later_coords(coords.data() + 1, later.size());
      const dtensor::IndexRuns local = dtensor::chain_positions(m, dtensor::span_of(later), later_coords);
      int64_t local_size = 0;
      for (const dtensor::IndexRun& r : local) local_size += r.length;
      work.add(kernels::checked_mul(dp, static_cast<int64_t>(local.size()) + 1, "check work"));
      for (int64_t c = 0; c < dp; ++c) {
        coords[0] = c;
        const dtensor::Chunk piece = dtensor::chunk(local_size, dp, c);
        if (dtensor::chain_positions(m, dtensor::span_of(with_dp), coords) != dtensor::slice_runs(local, piece.offset, piece.size))
          return DpChunkVerdict{DpChunkVerdict::kNotChunks, n};
      }
    }
  }
  return std::nullopt;
}

std::optional<DpChunkVerdict> check_dp_chunks_by_rank(const Dims& global_shape, const Dims& mesh_shape,
                                                      const dtensor::Placements& unsharded,
                                                      const dtensor::Placements& sharded, int shard_mesh_dim, int sd) {
  const int64_t dp = mesh_shape[shard_mesh_dim];
  const int64_t total = mesh_shape.product();
  for (int64_t r = 0; r < total; ++r) {
    const Dims coord = dtensor::unravel_index(r, mesh_shape);
    const dtensor::ShardLayout u = dtensor::compute_layout(global_shape, mesh_shape, unsharded, coord);
    const dtensor::ShardLayout sh = dtensor::compute_layout(global_shape, mesh_shape, sharded, coord);
    const int64_t n = u.local_shape[sd];
    if (sd > 0 && n % dp != 0) return DpChunkVerdict{DpChunkVerdict::kIndivisible, n};
    const dtensor::Chunk c = dtensor::chunk(n, dp, coord[shard_mesh_dim]);
    if (!(sh.local_shape[sd] == c.size && sh.runs[sd] == dtensor::slice_runs(u.runs[sd], c.offset, c.size)))
      return DpChunkVerdict{DpChunkVerdict::kNotChunks, global_shape[sd]};
  }
  return std::nullopt;
}

}  // namespace fsdp
