#include "dtensor/exec/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "dtensor/plan/chain.h"
#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InternalError;

namespace {

// ---- index arithmetic ----

// The increasing runs common to a and b, into out (cleared first).
void intersect(const IndexRuns& a, const IndexRuns& b, IndexRuns& out) {
  out.clear();
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].start, b[j].start);
    const int64_t hi = std::min(a[i].start + a[i].length, b[j].start + b[j].length);
    if (lo < hi) out.push_back({lo, hi - lo});
    if (a[i].start + a[i].length < b[j].start + b[j].length) ++i;
    else ++j;
  }
}

// Positions, in the local order of `held`, of the global indices `subset` (subset within held).
IndexRuns positions_of(const IndexRuns& held, const IndexRuns& subset) {
  IndexRuns out;
  int64_t base = 0;  // local position of held[i].start
  size_t i = 0;
  for (const IndexRun& s : subset) {
    while (held[i].start + held[i].length <= s.start) base += held[i++].length;
    const int64_t pos = base + (s.start - held[i].start);
    if (!out.empty() && out.back().start + out.back().length == pos) out.back().length += s.length;
    else out.push_back({pos, s.length});
  }
  return out;
}

// Local positions of each run of `subset` (not merged: one entry per run) in `held`.
void run_positions(const IndexRuns& held, const IndexRuns& subset, std::vector<int64_t>& out) {
  out.clear();
  int64_t base = 0;
  size_t i = 0;
  for (const IndexRun& s : subset) {
    while (held[i].start + held[i].length <= s.start) base += held[i++].length;
    out.push_back(base + (s.start - held[i].start));
  }
}

int64_t total(const IndexRuns& runs) {
  int64_t n = 0;
  for (const IndexRun& r : runs) n += r.length;
  return n;
}

// A piece above the communicator's p2p_view_max_bytes as several messages, split along its first
// dim of size > 1. Sender and receiver hold pieces of equal shape, so both split alike; the rule
// looks at the shape only (one side's piece may be contiguous where the other's is strided).
void split_view(const View& v, int64_t itemsize, int64_t limit, bool send, int peer,
                std::vector<StepSchedule::Message>& out) {
  const int64_t bytes = v.numel() * itemsize;
  if (limit <= 0 || bytes <= limit || v.length.size() == 0) {
    out.push_back({send, peer, v});
    return;
  }
  int d = 0;
  while (d + 1 < v.length.size() && v.length[d] == 1) ++d;
  const int64_t row_bytes = bytes / v.length[d];
  const int64_t rows = std::max<int64_t>(1, limit / std::max<int64_t>(row_bytes, 1));
  for (int64_t i = 0; i < v.length[d]; i += rows) {
    View p = v;
    p.start[d] += i;
    p.length[d] = std::min(rows, v.length[d] - i);
    out.push_back({send, peer, p});
  }
}

// The layouts of this rank's peers along one mesh dim: they differ from its own only along the
// tensor dim that mesh dim shards, so a peer's layout is its own with that dim recomputed (one
// chain of splits with the peer's coordinate at m).
class PeerLayouts {
 public:
  PeerLayouts(const Dims& shape, const Dims& mesh_shape, const Placements& ps, const Dims& coord, int m)
      : own_(compute_layout(shape, mesh_shape, ps, coord)), peer_(own_), coord_(coord), m_(m) {
    if (mesh_shape[m] <= 1) return;
    if (const auto* rg = std::get_if<RaggedShard>(&ps[m])) {
      // NOTE [ragged plans]: the view's last dim, cut by this mesh dim alone; peer by peer.
      bounds_ = ragged_boundaries(shape[shape.size() - 1], rg->units, rg->align);
      t_ = shape.size() - 1;
      n_ = shape[t_];
      count_ = mesh_shape[m];
      return;
    }
    const std::optional<int> t = shard_dim(ps[m]);
    if (!t) return;
    t_ = *t;
    n_ = shape[t_];
    chain_ = chain_of(ps, mesh_shape, t_);
    // Peers past the last non-empty piece of the split at m hold nothing along t.
    int64_t prefix = n_;
    size_t at = 0;
    std::vector<int64_t> coord_at;
    for (const Split& s : chain_) {
      if (s.mesh_dim == m) {
        split_ = s;
        break;
      }
      prefix = piece_size(prefix, s, coord[s.mesh_dim]);
      coord_at.push_back(coord[s.mesh_dim]);
      ++at;
    }
    translate_range(prefix, chain_positions(n_, span_of(chain_).first(at), std::span<const int64_t>(coord_at)));
    count_ = 0;
    const int64_t longest = split_.sf == 0 ? prefix : (prefix == 0 ? 0 : kernels::checked_ceil_div(prefix, split_.sf, "piece"));
    const int64_t last = split_.sf == 0 || prefix == 0 ? 0 : prefix - (prefix / longest) * longest;
    for (int64_t l : {longest, last})
      if (l > 0) count_ = std::max(count_, kernels::checked_ceil_div(l, kernels::checked_ceil_div(l, split_.k, "piece"), "piece"));
  }
  const ShardLayout& own() const { return own_; }
  // The tensor dim the peers' layouts differ in (-1: none, every peer's layout is this rank's).
  int dim() const { return t_; }
  // Peers [first, end) whose index sets along dim() are translates: peer first + i holds peer
  // first's indices plus i x step (NOTE [peer runs]). Empty when none are known to be.
  struct Translates {
    int64_t first = 0, end = 0, step = 0;
  };
  const Translates& translates() const { return translates_; }
  // Peers [0, nonempty()) may hold something along the split dim; the others hold nothing.
  int64_t nonempty() const { return t_ < 0 ? std::numeric_limits<int64_t>::max() : count_; }
  // The layout of the peer at coordinate g along m (valid until the next call).
  const ShardLayout& peer(int64_t g) {
    if (t_ < 0) return own_;
    if (!bounds_.empty()) {
      const int64_t lo = bounds_[g], size = bounds_[g + 1] - lo;
      peer_.runs[t_].clear();
      if (size > 0) peer_.runs[t_].push_back({lo, size});
      peer_.local_shape[t_] = size;
      return peer_;
    }
    coords_.clear();
    for (const Split& s : chain_) coords_.push_back(s.mesh_dim == m_ ? g : coord_[s.mesh_dim]);
    peer_.runs[t_] = chain_positions(n_, span_of(chain_), coords_);
    peer_.local_shape[t_] = total(peer_.runs[t_]);
    return peer_;
  }

 private:
  ShardLayout own_, peer_;
  Dims coord_;
  int m_;
  int t_ = -1;
  int64_t n_ = 0, count_ = 0;
  SplitList chain_;
  Split split_;
  std::vector<int64_t> coords_;
  Translates translates_;
  std::vector<int64_t> bounds_;  // a RaggedShard at m: its boundaries (ragged_boundaries)

  // The full pieces of the split at m of a contiguous prefix list: torch.chunk's pieces of size
  // c = ceil(L / k) start at g x c, so peers [0, L / c) hold translates (the later splits cut
  // every one alike); a strided split does so where every one of its blocks gives equal full
  // pieces. A prefix of several runs (a strided split before m) is left to peer-by-peer.
  void translate_range(int64_t L, const IndexRuns& prefix_runs) {
    if (L == 0 || prefix_runs.size() != 1) return;
    using kernels::checked_ceil_div;
    if (split_.sf == 0) {
      const int64_t c = checked_ceil_div(L, split_.k, "piece");
      translates_ = {0, std::min(split_.k, L / c), c};
      return;
    }
    const int64_t piece = checked_ceil_div(L, split_.sf, "piece");
    const int64_t blocks = checked_ceil_div(L, piece, "piece");
    const int64_t last = L - (blocks - 1) * piece;
    const int64_t cp = checked_ceil_div(piece, split_.k, "piece");
    int64_t full = piece / cp;
    if (last != piece) {
      if (checked_ceil_div(last, split_.k, "piece") != cp) return;
      full = std::min(full, last / cp);
    }
    translates_ = {0, std::min(split_.k, full), cp};
  }
};

// A stretch of peers [lo, hi) on one side of an exchange: translate (every peer's pieces are the
// first one's moved by (g - lo) x step along dim) or not (peer by peer).
struct Stretch {
  int64_t lo = 0, hi = 0;
  bool translate = false;
  int dim = 0;
  int64_t step = 0;
};

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t ceil_div_signed(int64_t a, int64_t b) { return -floor_div(-a, b); }

// The stretches of peers [0, k) whose index sets along peers.dim() meet `held` (this rank's runs
// along that dim) alike: a translate peer's pieces are translates of its neighbour's when its
// whole span lies in one run of `held` (positions move with it) or in one gap (nothing in
// common); the peers in between go peer by peer (a few at each run's ends).
std::vector<Stretch> stretches(PeerLayouts& peers, const IndexRuns& held, int64_t k) {
  const int t = peers.dim();
  if (t < 0) return {{0, k, true, 0, 0}};
  std::vector<Stretch> regions;  // translate stretches, increasing
  const PeerLayouts::Translates tr = peers.translates();
  if (tr.end > tr.first) {
    const IndexRuns y = peers.peer(tr.first).runs[t];
    if (y.empty()) {
      regions.push_back({tr.first, tr.end, true, t, 0});
    } else {
      const int64_t lo0 = y.front().start, hi0 = y.back().start + y.back().length, d = tr.step, n = tr.end - tr.first;
      // Peer first + i spans [lo0 + i d, hi0 + i d): within [a, b) for i in
      // [ceil((a - lo0) / d), floor((b - hi0) / d)] (no bound: -inf / +inf).
      auto region = [&](std::optional<int64_t> a, std::optional<int64_t> b, bool inside) {
        const int64_t i0 = std::max<int64_t>(a ? ceil_div_signed(*a - lo0, d) : 0, 0);
        const int64_t i1 = std::min<int64_t>(b ? floor_div(*b - hi0, d) : n - 1, n - 1);
        if (i1 >= i0) regions.push_back({tr.first + i0, tr.first + i1 + 1, true, t, inside ? d : 0});
      };
      std::optional<int64_t> prev;
      for (const IndexRun& r : held) {
        region(prev, r.start, false);
        region(r.start, r.start + r.length, true);
        prev = r.start + r.length;
      }
      region(prev, std::nullopt, false);
    }
  }
  // Peer by peer between the regions and up to the last peer that may hold something; nothing
  // from there on (one translate stretch of empty pieces).
  const int64_t empty_from = std::max(tr.end, std::min(peers.nonempty(), k));
  std::vector<Stretch> out;
  int64_t at = 0;
  for (const Stretch& r : regions) {
    if (at < r.lo) out.push_back({at, r.lo, false, t, 0});
    out.push_back(r);
    at = r.hi;
  }
  if (at < empty_from) out.push_back({at, empty_from, false, t, 0});
  at = std::max(at, empty_from);
  if (at < k) out.push_back({at, k, true, t, 0});
  return out;
}

// Calls f(lo, hi, a, b) for the common refinement of two stretch lists over [0, k).
template <class F>
void for_each_common(const std::vector<Stretch>& x, const std::vector<Stretch>& y, F f) {
  size_t i = 0, j = 0;
  int64_t lo = 0;
  while (i < x.size() && j < y.size()) {
    const int64_t hi = std::min(x[i].hi, y[j].hi);
    if (hi > lo) f(lo, hi, x[i], y[j]);
    lo = hi;
    if (x[i].hi == hi) ++i;
    if (y[j].hi == hi) ++j;
  }
}

// Calls f(view) for every rectangular piece of the global set `set` (runs per tensor dim), in
// the positions of `held`. The pieces follow the global runs in row-major order, so two ranks
// enumerating the same set get the same sequence of piece shapes whatever their local orders.
template <class F>
void for_each_piece_in(const std::vector<IndexRuns>& set, const ShardLayout& held, std::vector<std::vector<int64_t>>& pos,
                       F f) {
  const int nd = static_cast<int>(set.size());
  for (const IndexRuns& runs : set)
    if (runs.empty()) return;
  pos.resize(nd);
  for (int t = 0; t < nd; ++t) run_positions(held.runs[t], set[t], pos[t]);
  std::vector<size_t> idx(nd, 0);
  View v;
  v.start = Dims::filled(nd, 0);
  v.length = Dims::filled(nd, 0);
  for (;;) {
    for (int t = 0; t < nd; ++t) {
      v.start[t] = pos[t][idx[t]];
      v.length[t] = set[t][idx[t]].length;
    }
    f(v);
    int t = nd - 1;
    for (; t >= 0; --t) {
      if (++idx[t] < set[t].size()) break;
      idx[t] = 0;
    }
    if (t < 0) return;
  }
}

// The members' chunks of a plain reduce-scatter to S(t) in closed form (no per-member data):
// along t, member g's chunk is piece g of this rank's list; flat when the pieces are equal and
// every dim before t has length 1.
bool closed_form_flat(const Dims& pre_shape, int t, int64_t k) {
  if (pre_shape.product() == 0) return true;
  if (pre_shape[t] % k != 0) return false;
  for (int d = 0; d < t; ++d)
    if (pre_shape[d] != 1) return false;
  return true;
}

}  // namespace

// ---- the copies around collectives ----

Tensor flat(const Tensor& t) { return t.as_strided(Dims{t.numel()}, Dims{1}, t.storage_offset()); }

Tensor at(const Tensor& base, const View& v) {
  int64_t offset = base.storage_offset();
  for (int d = 0; d < v.start.size(); ++d) offset += v.start[d] * base.stride(d);
  return base.as_strided(v.length, base.strides(), offset);
}

std::vector<IndexRuns> intersect_layouts(const ShardLayout& a, const ShardLayout& b) {
  std::vector<IndexRuns> out(a.runs.size());
  for (size_t t = 0; t < a.runs.size(); ++t) intersect(a.runs[t], b.runs[t], out[t]);
  return out;
}

Block block_in(const ShardLayout& holder, const std::vector<IndexRuns>& global_sets) {
  Block b;
  for (size_t t = 0; t < global_sets.size(); ++t) {
    b.pos.push_back(positions_of(holder.runs[t], global_sets[t]));
    b.shape.push_back(total(global_sets[t]));
  }
  return b;
}

namespace {

// Calls f(sub_of_local, sub_of_packed) for every rectangular piece of the block, where `packed`
// is a tensor of the block's shape holding its elements in row-major order.
template <class F>
void for_each_block_piece(const Tensor& local, const Block& b, const Tensor& packed, F f) {
  const int nd = static_cast<int>(b.pos.size());
  if (b.numel() == 0) return;
  if (nd == 0) return f(local, packed);
  std::vector<size_t> idx(nd, 0);
  std::vector<int64_t> at_(nd, 0);  // start of the current run inside the packed block
  for (;;) {
    Tensor src = local, dst = packed;
    for (int t = 0; t < nd; ++t) {
      const IndexRun& run = b.pos[t][idx[t]];
      src = src.narrow(t, run.start, run.length);
      dst = dst.narrow(t, at_[t], run.length);
    }
    f(src, dst);
    int t = nd - 1;
    for (; t >= 0; --t) {
      at_[t] += b.pos[t][idx[t]].length;
      if (++idx[t] < b.pos[t].size()) break;
      idx[t] = 0;
      at_[t] = 0;
    }
    if (t < 0) return;
  }
}

}  // namespace

// The block as one flat range of a contiguous tensor of `shape`: its start, or -1 when the block
// is not one range (a block is one range when every dim has one run, the dims after the first
// partial one are whole and the dims before it have length 1).
int64_t flat_start(const Block& b, const Dims& shape) {
  const int nd = static_cast<int>(b.pos.size());
  int64_t start = 0, stride = 1;
  bool inner_whole = true;  // every dim after the current one is whole
  for (int t = nd - 1; t >= 0; --t) {
    if (b.pos[t].size() != 1) return b.numel() == 0 ? 0 : -1;
    const IndexRun& run = b.pos[t][0];
    if (!inner_whole && run.length != 1) return -1;
    start += run.start * stride;
    inner_whole = inner_whole && run.start == 0 && run.length == shape[t];
    stride *= shape[t];
  }
  return start;
}


void pack(const Tensor& local, const Block& b, const Tensor& flat, int64_t offset) {
  if (b.numel() == 0) return;
  Tensor packed = flat.narrow(0, offset, b.numel()).view(b.shape);
  for_each_block_piece(local, b, packed, [](const Tensor& src, Tensor dst) { dst.copy_(src); });
}

void unpack(const Tensor& flat, int64_t offset, const Tensor& local, const Block& b) {
  if (b.numel() == 0) return;
  Tensor packed = flat.narrow(0, offset, b.numel()).view(b.shape);
  for_each_block_piece(local, b, packed, [](Tensor dst, const Tensor& src) { dst.copy_(src); });
}

namespace {

int64_t block_bytes(const Block& b) {
  int64_t n = static_cast<int64_t>(sizeof(Block));
  for (const IndexRuns& r : b.pos) n += static_cast<int64_t>(sizeof(IndexRuns) + r.size() * sizeof(IndexRun));
  return n;
}

}  // namespace

Block PeerBlocks::at(int64_t g) const {
  auto it = std::upper_bound(runs.begin(), runs.end(), g, [](int64_t x, const BlockRun& b) { return x < b.first; });
  if (it == runs.begin() || g >= std::prev(it)->first + std::prev(it)->count)
    throw InternalError(fmt::format("schedule: peer {} is in no run of {} peers", g, peers));
  const BlockRun& b = *std::prev(it);
  Block out = b.block;
  const int64_t shift = (g - b.first) * b.step;
  if (shift != 0)
    for (IndexRun& run : out.pos[b.dim]) run.start += shift;
  return out;
}

void PeerBlocks::add_numels(std::span<int64_t> out) const {
  for (const BlockRun& b : runs) {
    const int64_t n = b.block.numel();
    for (int64_t i = 0; i < b.count; ++i) out[b.first + i] += n;
  }
}

int64_t PeerBlocks::bytes() const {
  int64_t n = 0;
  for (const BlockRun& b : runs) n += static_cast<int64_t>(sizeof(BlockRun) - sizeof(Block)) + block_bytes(b.block);
  return n;
}

std::vector<StepSchedule::Message> StepSchedule::messages() const {
  std::vector<Message> out;
  for_each_message([&](const Message& msg) { out.push_back(msg); });
  return out;
}

int64_t StepSchedule::bytes() const {
  int64_t n = static_cast<int64_t>(sizeof(StepSchedule));
  for (const MessageRun& run : message_runs) n += static_cast<int64_t>(sizeof(MessageRun) + run.pieces.size() * sizeof(Piece));
  for (const PeerBlocks* bs : {&send_blocks, &recv_blocks, &chunk_blocks}) n += bs->bytes();
  return n + block_bytes(post_whole) + block_bytes(keep);
}

RankContext RankContext::of(const MeshComms& comms) {
  RankContext rc{comms.mesh().shape(), comms.coord(), comms.rank(), {}, {}};
  for (int m = 0; m < comms.mesh().ndim(); ++m) {
    rc.views.push_back(comms.dim(m).p2p_views());
    rc.view_max_bytes.push_back(comms.dim(m).p2p_view_max_bytes());
  }
  return rc;
}

namespace {

// Per peer g, the block (in `mine`'s positions) of what `fixed` and peer g's layout under
// `peers` have in common, as runs (NOTE [peer runs]).
PeerBlocks peer_blocks(PeerLayouts& peers, const ShardLayout& fixed, const ShardLayout& mine, int64_t k, int64_t r) {
  PeerBlocks out;
  out.peers = k;
  for (const Stretch& st : stretches(peers, fixed.runs[std::max(peers.dim(), 0)], k))
    for (int64_t g = st.lo; g < st.hi; g = st.translate ? st.hi : g + 1) {
      const ShardLayout& other = g == r ? peers.own() : peers.peer(g);
      out.runs.push_back({g, st.translate ? st.hi - st.lo : 1, block_in(mine, intersect_layouts(fixed, other)), st.dim, st.step});
    }
  return out;
}

}  // namespace

std::shared_ptr<const StepSchedule> make_schedule(const RankContext& rc, const Dims& shape, const Placements& before,
                                                  const Placements& after, int m, Path path, kernels::DType moved,
                                                  bool per_member) {
  auto s = std::make_shared<StepSchedule>();
  const Dims& mesh_shape = rc.mesh_shape;
  const Dims& coord = rc.coord;
  const int64_t k = mesh_shape[m], r = coord[m];
  const int64_t itemsize = static_cast<int64_t>(kernels::itemsize(moved));
  PeerLayouts pre(shape, mesh_shape, before, coord, m), post(shape, mesh_shape, after, coord, m);
  const ShardLayout& pre_r = pre.own();
  const ShardLayout& post_r = post.own();
  s->post_shape = post_r.local_shape;
  std::vector<IndexRuns> set(shape.size());
  switch (path) {
    case Path::kViews: {
      const int64_t limit = rc.view_max_bytes[m];
      std::vector<std::vector<int64_t>> pos;
      std::vector<StepSchedule::Message> split;
      // Peer g's pieces (NOTE [exchange]): what g holds after that this rank holds now, then what
      // this rank holds after that g holds now.
      auto pieces_of = [&](int64_t g, const Stretch& sends, const Stretch& recvs, std::vector<StepSchedule::Piece>& out) {
        const int peer = static_cast<int>(g);
        auto add = [&](const Stretch& st, bool send) {
          return [&, send](const View& v) {
            split.clear();
            split_view(v, itemsize, limit, send, peer, split);
            for (const StepSchedule::Message& msg : split) out.push_back({send, msg.view, st.dim, st.step});
          };
        };
        const ShardLayout& post_g = g == r ? post_r : post.peer(g);
        for (int t = 0; t < shape.size(); ++t) intersect(pre_r.runs[t], post_g.runs[t], set[t]);
        for_each_piece_in(set, pre_r, pos, add(sends, true));
        const ShardLayout& pre_g = g == r ? pre_r : pre.peer(g);
        for (int t = 0; t < shape.size(); ++t) intersect(pre_g.runs[t], post_r.runs[t], set[t]);
        for_each_piece_in(set, post_r, pos, add(recvs, false));
      };
      const std::vector<Stretch> sends = stretches(post, pre_r.runs[std::max(post.dim(), 0)], k);
      const std::vector<Stretch> recvs = stretches(pre, post_r.runs[std::max(pre.dim(), 0)], k);
      for_each_common(sends, recvs, [&](int64_t lo, int64_t hi, const Stretch& a, const Stretch& b) {
        const bool translate = a.translate && b.translate;
        for (int64_t g = lo; g < hi; g = translate ? hi : g + 1) {
          StepSchedule::MessageRun run{g, translate ? hi - lo : 1, {}};
          pieces_of(g, a, b, run.pieces);
          if (!run.pieces.empty()) s->message_runs.push_back(std::move(run));
        }
      });
      break;
    }
    case Path::kPacked:
      s->send_blocks = peer_blocks(post, pre_r, pre_r, k, r);
      s->recv_blocks = peer_blocks(pre, post_r, post_r, k, r);
      break;
    case Path::kReduceScatter: {
      s->post_whole = block_in(post_r, post_r.runs);
      const std::optional<int> t = shard_dim(after[m]);
      bool plain = is_shard(after[m]);
      for (int d = m + 1; d < mesh_shape.size() && plain; ++d)
        plain = !(mesh_shape[d] > 1 && shard_dim(before[d]) == t);
      if (plain && !per_member) {
        s->flat = s->even = closed_form_flat(pre_r.local_shape, *t, k);
        if (s->flat) break;
      }
      s->per_member = true;
      s->chunk_blocks = peer_blocks(post, pre_r, pre_r, k, r);
      // Every member in some run: equal sizes when every run's blocks have one size.
      const std::vector<BlockRun>& runs = s->chunk_blocks.runs;
      const int64_t n0 = runs.front().block.numel();
      s->even = std::all_of(runs.begin(), runs.end(), [&](const BlockRun& b) { return b.block.numel() == n0; });
      s->flat = s->even && post_r.local_shape.product() == n0;
      // Flat: member g's block is the flat range [g n0, (g + 1) n0) of the input; along a run
      // the start moves by step x (the input's stride along dim).
      for (const BlockRun& b : runs) {
        if (!s->flat || n0 == 0) break;
        int64_t stride = 1;
        for (int d = b.dim + 1; d < pre_r.local_shape.size(); ++d) stride *= pre_r.local_shape[d];
        s->flat = flat_start(b.block, pre_r.local_shape) == b.first * n0 && (b.count == 1 || b.step * stride == n0);
      }
      break;
    }
    case Path::kLocalChunk:
      s->keep = block_in(pre_r, intersect_layouts(pre_r, post_r));
      break;
    case Path::kAllGather:
    case Path::kCount:
      break;
  }
  // An exchange on one group must deliver every element of this rank's result: a step whose
  // data comes from outside the group would leave holes, so it is refused loudly.
  if (path == Path::kViews || path == Path::kPacked) {
    int64_t received = 0;
    for (const StepSchedule::MessageRun& run : s->message_runs)
      for (const StepSchedule::Piece& p : run.pieces)
        if (!p.send) received += run.count * p.view.numel();
    for (const BlockRun& b : s->recv_blocks.runs) received += b.count * b.block.numel();
    if (received != s->post_shape.product())
      throw InternalError(fmt::format(
          "execute: the step [{}] -> [{}] on mesh dim {} is not one exchange on its group: rank {} would receive "
          "{} of the {} elements it holds after it",
          to_string(before), to_string(after), m, rc.rank, received, s->post_shape.product()));
  }
  return s;
}

}  // namespace dtensor
