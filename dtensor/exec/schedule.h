// Step schedules: what one rank does for one step of a plan (NOTE [exchange] in executor.h),
// computed from its own coordinate only, in work proportional to its group (the peers it
// exchanges with), never to the world: the layouts of its peers differ from its own only along
// the tensor dims the step's mesh dim splits, and only from that split on, so each peer costs one
// split of the common prefix, and runs of peers whose pieces are translates of one another are
// computed once (NOTE [peer runs]), so a 1-D exchange over 2^20 ranks is a few runs; peers whose
// piece is empty (the trailing ones of an uneven split) are one run of nothing. Internal to
// dtensor/exec/.
//
//   auto s = make_schedule(rc, spec.shape, before, after, m, Path::kViews, DType::kF32);
//   s->for_each_message([&](const StepSchedule::Message& msg) { ... });  // sends and receives
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/placement.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace dtensor {

using kernels::Tensor;

// A rectangular sub-block of a local tensor: per dim, start and length (in positions).
struct View {
  Dims start, length;
  int64_t numel() const { return length.product(); }
};

// A Cartesian product of per-dim position runs inside some local tensor.
struct Block {
  std::vector<IndexRuns> pos;
  Dims shape;
  int64_t numel() const { return shape.product(); }
};

// What a schedule needs of this rank: the mesh shape, its coordinate and rank, and per mesh dim
// whether its communicator takes strided views and above which size it splits them
// (Communicator::p2p_views, p2p_view_max_bytes). Built from a MeshComms, or from a coordinate
// alone (dtensor-check plan: any rank of any mesh, no communicators).
struct RankContext {
  Dims mesh_shape, coord;
  int rank = 0;
  std::vector<char> views;
  std::vector<int64_t> view_max_bytes;
  static RankContext of(const MeshComms& comms);
};

// How a step runs on this rank (executor.h): an exchange through strided views or packed
// buffers, a reduce-scatter, a local chunk, or an all-gather straight into the result.
enum class Path : int { kViews, kPacked, kReduceScatter, kLocalChunk, kAllGather, kCount };

// Per-peer blocks in compact form (NOTE [peer runs]): a run of consecutive peers whose blocks are
// translates of one another is one entry. Peers in no run have an empty block.
//   runs = {{first 0, count 4, block rows [0,2), dim 0, step 2}}: peer 3's block is rows [6,8).
struct BlockRun {
  int64_t first = 0, count = 0;
  Block block;  // the block of peer `first`
  int dim = 0;  // peer first + i: block's positions along dim moved by i x step
  int64_t step = 0;
};
struct PeerBlocks {
  int64_t peers = 0;
  std::vector<BlockRun> runs;  // increasing `first`, disjoint
  // Peer g's block (expanded; allocates). REQUIRES: 0 <= g < peers.
  Block at(int64_t g) const;
  // out[g] += peer g's numel, for every peer. REQUIRES: out.size() == peers.
  void add_numels(std::span<int64_t> out) const;
  int64_t bytes() const;
};

struct StepSchedule {
  Dims post_shape;  // this rank's local shape after the step
  // Exchange through views: this rank's sends (views of its input) and receives (views of its
  // result), in the order both sides enumerate them; peer == this rank for what it keeps.
  struct Message {
    bool send = false;
    int peer = 0;
    View view;
  };
  // NOTE [peer runs] The messages as runs of consecutive peers: peer first + i sends and receives
  // `pieces` in order, each view's start along its dim moved by i x step. Where a peer's layout
  // along the split tensor dim is a translate of its neighbour's (full torch.chunk pieces of one
  // contiguous list) and this rank's side holds all or none of it, the peers' pieces are
  // translates too, so a 1-D all-to-all over 65,536 ranks is one run, not 131,072 messages.
  struct Piece {
    bool send = false;
    View view;
    int dim = 0;
    int64_t step = 0;
  };
  struct MessageRun {
    int64_t first = 0, count = 0;
    std::vector<Piece> pieces;
  };
  std::vector<MessageRun> message_runs;
  // Calls f(const Message&) for every message in order (expanding the runs).
  template <class F>
  void for_each_message(F f) const {
    Message msg;
    for (const MessageRun& run : message_runs)
      for (int64_t i = 0; i < run.count; ++i)
        for (const Piece& p : run.pieces) {
          msg.send = p.send;
          msg.peer = static_cast<int>(run.first + i);
          msg.view = p.view;
          if (p.step != 0) msg.view.start[p.dim] += i * p.step;
          f(static_cast<const Message&>(msg));
        }
  }
  std::vector<Message> messages() const;  // expanded (tests)
  // Packed exchange: per peer g, the block of the input sent to g and of the result received from
  // g (g == this rank: what it keeps).
  PeerBlocks send_blocks, recv_blocks;
  // Reduce-scatter: flat: the members' chunks are consecutive equal flat ranges of the input in
  // member order (reduce-scatter straight from it; nothing per member is kept). Otherwise per
  // member g: the block of g's chunk in this rank's input; even: equal sizes.
  PeerBlocks chunk_blocks;
  bool even = false, flat = false, per_member = false;
  Block post_whole;  // every element of the result (unpacking a flat result)
  // Local chunk: the block of the input this rank keeps.
  Block keep;
  // Bytes this schedule holds (dtensor-check plan's schedule_bytes).
  int64_t bytes() const;
};

// This rank's schedule of the step on mesh dim m from `before` to `after` for a tensor of
// `shape` moving elements of `moved` (NOTE [exchange]). per_member: a reduce-scatter keeps its
// members' blocks even when its chunks are flat (a batch, or an input that is not contiguous).
std::shared_ptr<const StepSchedule> make_schedule(const RankContext& rc, const Dims& shape, const Placements& before,
                                                  const Placements& after, int m, Path path, kernels::DType moved,
                                                  bool per_member = false);

// ---- the copies around collectives ----

// A contiguous tensor as 1-D, without view()'s shape inference.
Tensor flat(const Tensor& t);
// The view of `base` (any strides) that `v` selects.
Tensor at(const Tensor& base, const View& v);
// The positions (in `holder`'s local order) of the global index sets.
Block block_in(const ShardLayout& holder, const std::vector<IndexRuns>& global_sets);
// Per tensor dim, the global indices two layouts have in common.
std::vector<IndexRuns> intersect_layouts(const ShardLayout& a, const ShardLayout& b);
// The block as one flat range of a contiguous tensor of `shape`: its start (0 when empty), or -1
// when it is not one range.
int64_t flat_start(const Block& b, const Dims& shape);
// flat[offset : offset + numel] <- block of local (row-major), cast to flat's dtype.
void pack(const Tensor& local, const Block& b, const Tensor& flat, int64_t offset);
void unpack(const Tensor& flat, int64_t offset, const Tensor& local, const Block& b);

}  // namespace dtensor
