#include "dtensor/exec/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/error.h"
#include "kernels/reduce.h"

namespace dtensor {

using collectives::Communicator;
using collectives::P2POp;
using kernels::InternalError;
using kernels::InvalidArgument;

namespace {

// The increasing runs common to a and b.
IndexRuns intersect(const IndexRuns& a, const IndexRuns& b) {
  IndexRuns out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].start, b[j].start);
    const int64_t hi = std::min(a[i].start + a[i].length, b[j].start + b[j].length);
    if (lo < hi) out.push_back({lo, hi - lo});
    if (a[i].start + a[i].length < b[j].start + b[j].length) ++i;
    else ++j;
  }
  return out;
}

// Positions, in the local order of `held`, of the global indices `subset` (subset ⊆ held).
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

// A Cartesian product of per-dim position runs inside some local tensor.
struct Block {
  std::vector<IndexRuns> pos;
  Dims shape;
  int64_t numel() const { return shape.product(); }
};

Block block_in(const ShardLayout& holder, const std::vector<IndexRuns>& global_sets) {
  Block b;
  for (size_t t = 0; t < global_sets.size(); ++t) {
    b.pos.push_back(positions_of(holder.runs[t], global_sets[t]));
    int64_t n = 0;
    for (const IndexRun& r : global_sets[t]) n += r.length;
    b.shape.push_back(n);
  }
  return b;
}

std::vector<IndexRuns> intersect_layouts(const ShardLayout& a, const ShardLayout& b) {
  std::vector<IndexRuns> out;
  for (size_t t = 0; t < a.runs.size(); ++t) out.push_back(intersect(a.runs[t], b.runs[t]));
  return out;
}

// Calls f(sub_of_local, sub_of_packed) for every rectangular piece of the block, where
// `packed` is a tensor of the block's shape holding its elements in row-major order.
template <class F>
void for_each_piece(const Tensor& local, const Block& b, const Tensor& packed, F f) {
  const int nd = static_cast<int>(b.pos.size());
  if (b.numel() == 0) return;
  if (nd == 0) return f(local, packed);
  std::vector<size_t> idx(nd, 0);
  std::vector<int64_t> at(nd, 0);  // start of the current run inside the packed block
  for (;;) {
    Tensor src = local, dst = packed;
    for (int t = 0; t < nd; ++t) {
      const IndexRun& run = b.pos[t][idx[t]];
      src = src.narrow(t, run.start, run.length);
      dst = dst.narrow(t, at[t], run.length);
    }
    f(src, dst);
    int t = nd - 1;
    for (; t >= 0; --t) {
      at[t] += b.pos[t][idx[t]].length;
      if (++idx[t] < b.pos[t].size()) break;
      idx[t] = 0;
      at[t] = 0;
    }
    if (t < 0) return;
  }
}

// flat[offset : offset + numel] <- block of local (row-major).
void pack(const Tensor& local, const Block& b, const Tensor& flat, int64_t offset) {
  if (b.numel() == 0) return;
  Tensor packed = flat.narrow(0, offset, b.numel()).view(b.shape);
  for_each_piece(local, b, packed, [](const Tensor& src, Tensor dst) { dst.copy_(src); });
}

void unpack(const Tensor& flat, int64_t offset, const Tensor& local, const Block& b) {
  if (b.numel() == 0) return;
  Tensor packed = flat.narrow(0, offset, b.numel()).view(b.shape);
  for_each_piece(local, b, packed, [](Tensor dst, const Tensor& src) { dst.copy_(src); });
}

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

// Local position of global index `g` in a held run list (g must be held).
int64_t position_of(const IndexRuns& held, int64_t g) {
  int64_t base = 0;
  for (const IndexRun& r : held) {
    if (g < r.start + r.length) return base + (g - r.start);
    base += r.length;
  }
  throw InternalError(fmt::format("position_of: index {} is not held", g));
}

// Calls f(view_in_a, view_in_b) for every rectangular piece of the global set `set` (runs per
// tensor dim), where the views narrow tensor a (laid out by `la`) and tensor b (by `lb`). The
// pieces follow the global runs in row-major order, so two ranks enumerating the same set get
// the same sequence of piece shapes whatever their own local orders.
template <class F>
void for_each_global_piece(const std::vector<IndexRuns>& set, const Tensor& a, const ShardLayout& la,
                           const Tensor& b, const ShardLayout& lb, F f) {
  const int nd = static_cast<int>(set.size());
  for (const IndexRuns& runs : set)
    if (runs.empty()) return;
  std::vector<size_t> idx(nd, 0);
  for (;;) {
    Tensor va = a, vb = b;
    for (int t = 0; t < nd; ++t) {
      const IndexRun& run = set[t][idx[t]];
      if (va.defined()) va = va.narrow(t, position_of(la.runs[t], run.start), run.length);
      if (vb.defined()) vb = vb.narrow(t, position_of(lb.runs[t], run.start), run.length);
    }
    f(va, vb);
    int t = nd - 1;
    for (; t >= 0; --t) {
      if (++idx[t] < set[t].size()) break;
      idx[t] = 0;
    }
    if (t < 0) return;
  }
}

Dims coord_with(Dims coord, int m, int64_t g) {
  coord[m] = g;
  return coord;
}

// One tensor of a batch during a step.
struct Item {
  const DTensorSpec* spec;
  Tensor local;
};

class StepRunner {
 public:
  StepRunner(const MeshComms& comms, const Placements& before, const Step& step)
      : comms_(comms), before_(before), after_(apply_step(step, before)), step_(step),
        m_(mesh_dim_of(step)), k_(comms.mesh().size(m_)), r_(comms.coord()[m_]) {}

  std::vector<Tensor> run(const std::vector<Item>& items) {
    if (k_ == 1) {  // a size-1 group holds everything already: relabel only
      std::vector<Tensor> out;
      for (const Item& it : items) out.push_back(it.local);
      return out;
    }
    return std::visit(
        [&](const auto& s) -> std::vector<Tensor> { return this->run_step(s, items); }, step_);
  }

 private:
  ShardLayout layout(const Item& it, const Placements& ps, int64_t g) const {
    return compute_layout(it.spec->shape, comms_.mesh().shape(), ps, coord_with(comms_.coord(), m_, g));
  }
  Communicator& comm() const { return comms_.dim(m_); }
  kernels::Device device(const std::vector<Item>& items) const { return items[0].local.device(); }
  kernels::DType dtype(const std::vector<Item>& items) const { return items[0].spec->dtype; }

  std::vector<Tensor> run_step(const AllGather& s, const std::vector<Item>& items) {
    // Even split of the leading dim with contiguous locals: gather straight into the result.
    bool direct = true;
    for (const Item& it : items) {
      const ShardLayout full = layout(it, after_, r_);
      direct = direct && s.tensor_dim == 0 && full.local_shape[0] % k_ == 0 && it.local.is_contiguous();
    }
    // A valid step that is not plain (a later mesh dim shards the dim too) gathers pieces that
    // are not the result's chunks in coordinate order: only the exchange places them.
    direct = direct && is_plain_step(step_, before_, comms_.mesh().shape());
    if (!direct) return exchange(items);
    std::vector<Tensor> out;
    if (items.size() == 1) {
      const ShardLayout full = layout(items[0], after_, r_);
      out.push_back(Tensor::empty(full.local_shape, dtype(items), device(items), comms_.allocator()));
      Tensor in = items[0].local.view({items[0].local.numel()});
      comm().wait(comm().all_gather(in, out[0].view({out[0].numel()})));
      return out;
    }
    int64_t total = 0;
    for (const Item& it : items) total += it.local.numel();
    Tensor send = Tensor::empty({total}, dtype(items), device(items), comms_.allocator());
    Tensor recv = Tensor::empty({k_ * total}, dtype(items), device(items), comms_.allocator());
    int64_t off = 0;
    for (const Item& it : items) {  // copy-in
      send.narrow(0, off, it.local.numel()).copy_(it.local.view({it.local.numel()}));
      off += it.local.numel();
    }
    comm().wait(comm().all_gather(send, recv));
    off = 0;
    for (const Item& it : items) {  // copy-out: member g's piece of tensor i
      const ShardLayout full = layout(it, after_, r_);
      Tensor o = Tensor::empty(full.local_shape, dtype(items), device(items), comms_.allocator());
      Tensor flat = o.view({o.numel()});
      const int64_t n = it.local.numel();
      for (int64_t g = 0; g < k_; ++g) flat.narrow(0, g * n, n).copy_(recv.narrow(0, g * total + off, n));
      off += n;
      out.push_back(o);
    }
    return out;
  }
  std::vector<Tensor> run_step(const StridedAllGather&, const std::vector<Item>& items) { return exchange(items); }
  std::vector<Tensor> run_step(const AllToAll&, const std::vector<Item>& items) { return exchange(items); }
  std::vector<Tensor> run_step(const Regroup&, const std::vector<Item>& items) { return exchange(items); }

  std::vector<Tensor> run_step(const LocalChunk&, const std::vector<Item>& items) {
    std::vector<Tensor> out;
    for (const Item& it : items) {
      const ShardLayout pre = layout(it, before_, r_), post = layout(it, after_, r_);
      Block b = block_in(pre, intersect_layouts(pre, post));
      Tensor o = Tensor::empty(post.local_shape, it.spec->dtype, it.local.device(), comms_.allocator());
      pack(it.local, b, o.view({o.numel()}), 0);
      out.push_back(o);
    }
    return out;
  }

  std::vector<Tensor> run_step(const LocalPartial& s, const std::vector<Item>& items) {
    if (s.op == ReduceOp::kProd)
      throw kernels::Unsupported("Replicate -> P(prod) has no partition (PyTorch rejects it too)");
    std::vector<Tensor> out;
    for (const Item& it : items) {
      Tensor o = it.local.clone();
      if (s.op == ReduceOp::kSum) kernels::scale_(o, 1.0 / static_cast<double>(k_));
      out.push_back(o);
    }
    return out;
  }

  // S(d) -> P(sum): zeros of the group's extent, this rank's shard at its place (what it holds of
  // the new layout; NOTE [step validity] makes every element of it held by one member).
  std::vector<Tensor> run_step(const LocalEmbed&, const std::vector<Item>& items) {
    std::vector<Tensor> out;
    for (const Item& it : items) {
      const ShardLayout pre = layout(it, before_, r_), post = layout(it, after_, r_);
      const std::vector<IndexRuns> mine = intersect_layouts(pre, post);
      Tensor o = Tensor::zeros(post.local_shape, it.spec->dtype, it.local.device());
      Block from = block_in(pre, mine), to = block_in(post, mine);
      if (from.numel() > 0) {
        Tensor tmp = Tensor::empty({from.numel()}, it.spec->dtype, it.local.device(), comms_.allocator());
        pack(it.local, from, tmp, 0);
        unpack(tmp, 0, o, to);
      }
      out.push_back(o);
    }
    return out;
  }

  std::vector<Tensor> run_step(const AllReduce& s, const std::vector<Item>& items) {
    int64_t total = 0;
    for (const Item& it : items) total += it.local.numel();
    Tensor in, out;
    if (items.size() == 1 && items[0].local.is_contiguous()) {
      in = items[0].local.view({total});
    } else {
      in = Tensor::empty({total}, dtype(items), device(items), comms_.allocator());
      int64_t off = 0;
      for (const Item& it : items) {
        in.narrow(0, off, it.local.numel()).copy_(it.local.contiguous().view({it.local.numel()}));
        off += it.local.numel();
      }
    }
    out = Tensor::empty({total}, dtype(items), device(items), comms_.allocator());
    comm().wait(comm().all_reduce(in, out, s.op));
    std::vector<Tensor> result;
    int64_t off = 0;
    for (const Item& it : items) {  // views of the one result buffer
      result.push_back(out.narrow(0, off, it.local.numel()).view(it.local.shape()));
      off += it.local.numel();
    }
    return result;
  }

  std::vector<Tensor> run_step(const ReduceScatter& s, const std::vector<Item>& items) {
    // Pack, per destination member, each tensor's block of that member's chunk.
    std::vector<std::vector<Block>> blocks(k_);  // [g][i]
    std::vector<int64_t> seg(k_, 0);
    for (int64_t g = 0; g < k_; ++g)
      for (const Item& it : items) {
        const ShardLayout pre = layout(it, before_, r_), post_g = layout(it, after_, g);
        blocks[g].push_back(block_in(pre, intersect_layouts(pre, post_g)));
        seg[g] += blocks[g].back().numel();
      }
    int64_t total = 0;
    std::vector<int64_t> seg_off(k_, 0);
    for (int64_t g = 0; g < k_; ++g) {
      seg_off[g] = total;
      total += seg[g];
    }
    const bool even = std::all_of(seg.begin(), seg.end(), [&](int64_t n) { return n == seg[0]; });
    if (even && items.size() == 1 && items[0].local.is_contiguous()) {
      // Member chunks that are consecutive flat ranges of the local tensor (a leading-dim split):
      // reduce-scatter straight from it into the result, nothing packed.
      bool in_order = true;
      for (int64_t g = 0; g < k_ && in_order; ++g)
        in_order = flat_start(blocks[g][0], items[0].local.shape()) == seg_off[g];
      const ShardLayout post = layout(items[0], after_, r_);
      if (in_order && post.local_shape.product() == seg[r_]) {
        Tensor o = Tensor::empty(post.local_shape, dtype(items), device(items), comms_.allocator());
        comm().wait(comm().reduce_scatter(items[0].local.view({items[0].local.numel()}), o.view({o.numel()}), s.op));
        return {o};
      }
    }
    Tensor send = Tensor::empty({total}, dtype(items), device(items), comms_.allocator());
    for (int64_t g = 0; g < k_; ++g)
      for (size_t i = 0, off = seg_off[g]; i < items.size(); off += blocks[g][i].numel(), ++i)
        pack(items[i].local, blocks[g][i], send, static_cast<int64_t>(off));
    Tensor mine = Tensor::empty({seg[r_]}, dtype(items), device(items), comms_.allocator());
    if (even) {
      comm().wait(comm().reduce_scatter(send, mine, s.op));
    } else {
      // Uneven chunks: exchange exactly, then reduce in member order (no padding on the wire).
      std::vector<Tensor> got(k_);
      std::vector<P2POp> ops;
      for (int64_t g = 0; g < k_; ++g) {
        if (g == r_) continue;
        got[g] = Tensor::empty({seg[r_]}, dtype(items), device(items), comms_.allocator());
        ops.push_back(P2POp::send(send.narrow(0, seg_off[g], seg[g]), static_cast<int>(g)));
        ops.push_back(P2POp::recv(got[g], static_cast<int>(g)));
      }
      comm().wait(comm().send_recv(ops));
      got[r_] = send.narrow(0, seg_off[r_], seg[r_]);
      mine.copy_(got[0]);
      for (int64_t g = 1; g < k_; ++g) kernels::reduce_into(mine, got[g], s.op);
      if (s.op == ReduceOp::kAvg) kernels::scale_(mine, 1.0 / static_cast<double>(k_));
    }
    std::vector<Tensor> out;
    int64_t off = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const ShardLayout post = layout(items[i], after_, r_);
      Tensor o = Tensor::empty(post.local_shape, dtype(items), device(items), comms_.allocator());
      Block whole = block_in(post, post.runs);
      unpack(mine, off, o, whole);
      off += whole.numel();
      out.push_back(o);
    }
    return out;
  }

  // NOTE [exchange] in executor.h.
  std::vector<Tensor> exchange(const std::vector<Item>& items) {
    return comm().p2p_views() ? exchange_views(items) : exchange_packed(items);
  }

  // The communicator moves strided views: every piece goes from this rank's local tensor
  // straight into the peer's result (one copy per element, nothing packed).
  std::vector<Tensor> exchange_views(const std::vector<Item>& items) {
    std::vector<Tensor> out;
    std::vector<P2POp> ops;
    std::vector<std::pair<Tensor, Tensor>> keep;  // (from, to): what this rank keeps
    for (const Item& it : items) {
      const ShardLayout pre_r = layout(it, before_, r_), post_r = layout(it, after_, r_);
      Tensor o = Tensor::empty(post_r.local_shape, it.spec->dtype, it.local.device(), comms_.allocator());
      out.push_back(o);
      for (int64_t g = 0; g < k_; ++g) {
        const int peer = static_cast<int>(g);
        if (g == r_) {
          for_each_global_piece(intersect_layouts(pre_r, post_r), it.local, pre_r, o, post_r,
                                [&](const Tensor& src, const Tensor& dst) { keep.emplace_back(src, dst); });
          continue;
        }
        const ShardLayout pre_g = layout(it, before_, g), post_g = layout(it, after_, g);
        for_each_global_piece(intersect_layouts(pre_r, post_g), it.local, pre_r, Tensor(), post_g,
                              [&](const Tensor& src, const Tensor&) {
                                for (Tensor& part : split_view(src)) ops.push_back(P2POp::send(part, peer));
                              });
        for_each_global_piece(intersect_layouts(pre_g, post_r), Tensor(), pre_g, o, post_r,
                              [&](const Tensor&, const Tensor& dst) {
                                for (Tensor& part : split_view(dst)) ops.push_back(P2POp::recv(part, peer));
                              });
      }
    }
    // Copy what stays here while the peers move the rest (the pieces are disjoint from every
    // send and receive buffer: the sends read other parts of the source, receives fill other
    // parts of the result).
    collectives::WorkPtr work = comm().send_recv(ops);
    for (auto& [src, dst] : keep) dst.copy_(src);
    comm().wait(work);
    return out;
  }

  // A piece above the communicator's p2p_view_max_bytes as several messages, split along its
  // first dim of size > 1. Sender and receiver hold pieces of equal shape (see
  // for_each_global_piece), so both split alike; the rule must look at the shape only (one
  // side's piece may be contiguous where the other's is strided).
  std::vector<Tensor> split_view(const Tensor& piece) const {
    const int64_t limit = comm().p2p_view_max_bytes();
    if (limit <= 0 || static_cast<int64_t>(piece.nbytes()) <= limit) return {piece};
    int d = 0;
    while (d + 1 < piece.ndim() && piece.size(d) == 1) ++d;
    const int64_t row_bytes = static_cast<int64_t>(piece.nbytes()) / piece.size(d);
    const int64_t rows = std::max<int64_t>(1, limit / std::max<int64_t>(row_bytes, 1));
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < piece.size(d); i += rows) parts.push_back(piece.narrow(d, i, std::min(rows, piece.size(d) - i)));
    return parts;
  }

  // Packed: per peer one contiguous send and one receive buffer (backends without views).
  std::vector<Tensor> exchange_packed(const std::vector<Item>& items) {
    const size_t n_items = items.size();
    std::vector<std::vector<Block>> send_blocks(k_), recv_blocks(k_);  // [g][i]
    std::vector<int64_t> send_n(k_, 0), recv_n(k_, 0);
    std::vector<Tensor> out;
    for (const Item& it : items) {
      const ShardLayout pre_r = layout(it, before_, r_), post_r = layout(it, after_, r_);
      out.push_back(Tensor::empty(post_r.local_shape, it.spec->dtype, it.local.device(), comms_.allocator()));
      for (int64_t g = 0; g < k_; ++g) {
        const ShardLayout pre_g = g == r_ ? pre_r : layout(it, before_, g);
        const ShardLayout post_g = g == r_ ? post_r : layout(it, after_, g);
        send_blocks[g].push_back(block_in(pre_r, intersect_layouts(pre_r, post_g)));
        recv_blocks[g].push_back(block_in(post_r, intersect_layouts(pre_g, post_r)));
        send_n[g] += send_blocks[g].back().numel();
        recv_n[g] += recv_blocks[g].back().numel();
      }
    }
    // What this rank keeps moves locally.
    for (size_t i = 0; i < n_items; ++i) {
      const Block& keep_src = send_blocks[r_][i];
      const Block& keep_dst = recv_blocks[r_][i];
      if (keep_src.numel() == 0) continue;
      Tensor tmp = Tensor::empty({keep_src.numel()}, items[i].spec->dtype, items[i].local.device(), comms_.allocator());
      pack(items[i].local, keep_src, tmp, 0);
      unpack(tmp, 0, out[i], keep_dst);
    }
    std::vector<Tensor> send_buf(k_), recv_buf(k_);
    std::vector<P2POp> ops;
    for (int64_t g = 0; g < k_; ++g) {
      if (g == r_) continue;
      send_buf[g] = Tensor::empty({send_n[g]}, dtype(items), device(items), comms_.allocator());
      recv_buf[g] = Tensor::empty({recv_n[g]}, dtype(items), device(items), comms_.allocator());
      for (size_t i = 0, off = 0; i < n_items; off += send_blocks[g][i].numel(), ++i)
        pack(items[i].local, send_blocks[g][i], send_buf[g], static_cast<int64_t>(off));
      if (send_n[g] > 0) ops.push_back(P2POp::send(send_buf[g], static_cast<int>(g)));
      if (recv_n[g] > 0) ops.push_back(P2POp::recv(recv_buf[g], static_cast<int>(g)));
    }
    comm().wait(comm().send_recv(ops));
    for (int64_t g = 0; g < k_; ++g) {
      if (g == r_) continue;
      for (size_t i = 0, off = 0; i < n_items; off += recv_blocks[g][i].numel(), ++i)
        unpack(recv_buf[g], static_cast<int64_t>(off), out[i], recv_blocks[g][i]);
    }
    return out;
  }

  const MeshComms& comms_;
  const Placements& before_;
  const Placements after_;
  const Step& step_;
  const int m_;
  const int64_t k_;
  const int64_t r_;
};

}  // namespace

std::vector<Tensor> execute_batch(const Plan& plan, std::span<const DTensorSpec> specs,
                                  std::span<const Tensor> locals, const MeshComms& comms) {
  if (specs.size() != locals.size())
    throw InvalidArgument(fmt::format("execute_batch: {} specs for {} local tensors", specs.size(),
                                      locals.size()));
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    const DTensorSpec& s = specs[i];
    if (s.placements != plan.src)
      throw InvalidArgument(fmt::format("execute: tensor {} has placements [{}], the plan starts at [{}]",
                                        i, to_string(s.placements), to_string(plan.src)));
    if (!(*s.mesh == comms.mesh()))
      throw InvalidArgument(fmt::format("execute: tensor {} is on mesh {}, the communicators on {}", i,
                                        to_string(*s.mesh), to_string(comms.mesh())));
    if (s.dtype != specs[0].dtype || locals[i].dtype() != s.dtype)
      throw InvalidArgument(fmt::format("execute: tensor {} has dtype {} (batch dtype {})", i,
                                        kernels::to_string(locals[i].dtype()),
                                        kernels::to_string(specs[0].dtype)));
    items.push_back({&s, locals[i]});
  }
  if (!comms.in_mesh() || items.empty()) return {locals.begin(), locals.end()};
  for (Item& it : items) {
    const ShardLayout l = *it.spec->layout(comms.rank());
    if (!(it.local.shape() == l.local_shape))
      throw InvalidArgument(fmt::format(
          "execute: local tensor of shape [{}] but rank {} holds [{}] of {}",
          fmt::join(it.local.shape(), ","), comms.rank(), fmt::join(l.local_shape, ","),
          to_string(*it.spec)));
  }
  // NOTE [step validity]: a step valid for one global shape may not be for another.
  for (size_t i = 0; i < items.size(); ++i)
    if (!plan.valid_for(items[i].spec->shape))
      throw InvalidArgument(fmt::format("execute: tensor {} has global shape [{}], which the plan {} was not "
                                        "made for (plan it for this shape)",
                                        i, fmt::join(items[i].spec->shape, ","), to_string(plan)));
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Placements& before = plan.states[i];
    std::vector<Tensor> next = StepRunner(comms, before, plan.steps[i]).run(items);
    for (size_t j = 0; j < items.size(); ++j) items[j].local = next[j];
  }
  std::vector<Tensor> out;
  for (const Item& it : items) out.push_back(it.local);
  return out;
}

Tensor execute(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms) {
  return execute_batch(plan, std::span<const DTensorSpec>(&src, 1), std::span<const Tensor>(&local, 1),
                       comms)[0];
}

}  // namespace dtensor
