#include "dtensor/exec/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>

#include "dtensor/exec/exec_cache.h"
#include "dtensor/exec/memory_check.h"
#include "kernels/error.h"
#include "kernels/reduce.h"

namespace dtensor {

using collectives::Communicator;
using collectives::P2POp;
using collectives::Reduction;
using collectives::WorkPtr;
using kernels::DType;
using kernels::InternalError;
using kernels::InvalidArgument;

namespace {

// ---- index arithmetic ----

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

std::vector<IndexRuns> intersect_layouts(const ShardLayout& a, const ShardLayout& b) {
  std::vector<IndexRuns> out;
  for (size_t t = 0; t < a.runs.size(); ++t) out.push_back(intersect(a.runs[t], b.runs[t]));
  return out;
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

// Local position of global index `g` in a held run list (g must be held).
int64_t position_of(const IndexRuns& held, int64_t g) {
  int64_t base = 0;
  for (const IndexRun& r : held) {
    if (g < r.start + r.length) return base + (g - r.start);
    base += r.length;
  }
  throw InternalError(fmt::format("position_of: index {} is not held", g));
}

Dims coord_with(Dims coord, int m, int64_t g) {
  coord[m] = g;
  return coord;
}

// A rectangular sub-block of a local tensor: per dim, start and length (in positions).
struct View {
  Dims start, length;
  int64_t numel() const { return length.product(); }
};

// A contiguous tensor as 1-D, without view()'s shape inference.
Tensor flat(const Tensor& t) { return t.as_strided(Dims{t.numel()}, Dims{1}, t.storage_offset()); }

// The view of `base` (any strides) that `v` selects.
Tensor at(const Tensor& base, const View& v) {
  int64_t offset = base.storage_offset();
  for (int d = 0; d < v.start.size(); ++d) offset += v.start[d] * base.stride(d);
  return base.as_strided(v.length, base.strides(), offset);
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

// Calls f(sub_of_local, sub_of_packed) for every rectangular piece of the block, where `packed`
// is a tensor of the block's shape holding its elements in row-major order.
template <class F>
void for_each_piece(const Tensor& local, const Block& b, const Tensor& packed, F f) {
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

// flat[offset : offset + numel] <- block of local (row-major), cast to flat's dtype.
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

// Calls f(view in a, view in b) for every rectangular piece of the global set `set` (runs per
// tensor dim), positions taken in a's layout `la` and b's layout `lb`. The pieces follow the
// global runs in row-major order, so two ranks enumerating the same set get the same sequence of
// piece shapes whatever their own local orders.
template <class F>
void for_each_global_piece(const std::vector<IndexRuns>& set, const ShardLayout& la, const ShardLayout& lb, F f) {
  const int nd = static_cast<int>(set.size());
  for (const IndexRuns& runs : set)
    if (runs.empty()) return;
  std::vector<size_t> idx(nd, 0);
  for (;;) {
    View va, vb;
    for (int t = 0; t < nd; ++t) {
      const IndexRun& run = set[t][idx[t]];
      va.start.push_back(position_of(la.runs[t], run.start));
      vb.start.push_back(position_of(lb.runs[t], run.start));
      va.length.push_back(run.length);
      vb.length.push_back(run.length);
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

// A piece above the communicator's p2p_view_max_bytes as several messages, split along its first
// dim of size > 1. Sender and receiver hold pieces of equal shape, so both split alike; the rule
// looks at the shape only (one side's piece may be contiguous where the other's is strided).
std::vector<View> split_view(const View& v, int64_t itemsize, int64_t limit) {
  const int64_t bytes = v.numel() * itemsize;
  if (limit <= 0 || bytes <= limit || v.length.size() == 0) return {v};
  int d = 0;
  while (d + 1 < v.length.size() && v.length[d] == 1) ++d;
  const int64_t row_bytes = bytes / v.length[d];
  const int64_t rows = std::max<int64_t>(1, limit / std::max<int64_t>(row_bytes, 1));
  std::vector<View> parts;
  for (int64_t i = 0; i < v.length[d]; i += rows) {
    View p = v;
    p.start[d] += i;
    p.length[d] = std::min(rows, v.length[d] - i);
    parts.push_back(p);
  }
  return parts;
}

}  // namespace

// ---- step schedules (NOTE [exchange]) ----

// Per step: the dtypes in and out, and for reducing steps the reduction and a post-scale.
struct ExecStep {
  DType in = DType::kF32, out = DType::kF32, work = DType::kF32;  // work: what the step moves / reduces in
  Reduction reduction;
  double post_scale = 1.0;
};

enum class Path : int { kViews, kPacked, kReduceScatter, kLocalChunk, kAllGather, kCount };

// What one step needs for one tensor on this rank, computed once (exec_cache.h).
struct StepSchedule {
  Dims post_shape;  // this rank's local shape after the step
  // Exchange through views: this rank's sends (views of its input) and receives (views of its
  // result), in the order both sides enumerate them; peer == this rank for what it keeps.
  struct Message {
    bool send = false;
    int peer = 0;
    View view;
  };
  std::vector<Message> messages;
  // Packed exchange: per peer g, the block of the input sent to g and of the result received from
  // g (g == this rank: what it keeps), and their sizes.
  std::vector<Block> send_blocks, recv_blocks;
  std::vector<int64_t> send_n, recv_n;
  // Reduce-scatter: per member g, the block of g's chunk in this rank's input, its size and
  // offset in the packed send buffer; even: equal sizes; flat: the chunks are consecutive flat
  // ranges of the input in member order (reduce-scatter straight from it).
  std::vector<Block> chunk_blocks;
  std::vector<int64_t> seg, seg_off;
  bool even = false, flat = false;
  Block post_whole;  // every element of the result (unpacking a flat result)
  // Local chunk: the block of the input this rank keeps.
  Block keep;
  // All-gather along the leading dim with equal pieces: straight into the result.
  bool gather_direct = false;
};

// Everything a redistribute of one tensor needs on this rank, computed once (exec_cache.h): one
// look-up per call instead of a plan look-up, layouts and a schedule look-up per step.
struct Recipe {
  Plan plan;
  Dims src_local, dst_local;  // this rank's local shapes before and after
  std::vector<ExecStep> steps;
  struct PerStep {
    Placements after;
    bool plain = false;  // is_plain_step(the step, its placements before, the mesh)
    std::array<std::shared_ptr<const StepSchedule>, static_cast<size_t>(Path::kCount)> by_path;
  };
  std::vector<PerStep> per_step;
  // The bytes issuing allocates on this rank without an out, and with one (memory_check.h).
  int64_t bytes = 0, bytes_with_out = 0;
};

namespace {

void encode(ExecCache::Key& key, const Placements& ps) {
  key.push_back(static_cast<int64_t>(ps.size()));
  for (const Placement& p : ps) {
    key.push_back(static_cast<int64_t>(p.index()));
    key.push_back(shard_dim(p).value_or(-1));
    if (const auto* s = std::get_if<StridedShard>(&p)) key.push_back(s->split_factor);
    else if (const auto* q = std::get_if<Partial>(&p)) key.push_back(static_cast<int64_t>(q->op));
    else key.push_back(0);
  }
}


// The schedule of a step for one tensor (NOTE [exchange]), from the cache or computed.
std::shared_ptr<const StepSchedule> schedule_for(const MeshComms& comms, const DTensorSpec& spec,
                                                 const Placements& before, const Placements& after, int m,
                                                 Path path, DType moved) {
  Communicator& comm = comms.dim(m);
  const int64_t itemsize = static_cast<int64_t>(kernels::itemsize(moved));
  const int64_t limit = path == Path::kViews ? comm.p2p_view_max_bytes() : 0;
  ExecCache::Key key;
  key.reserve(64);
  key.push_back(static_cast<int64_t>(path));
  key.push_back(m);
  key.push_back(itemsize);
  key.push_back(limit);
  key.push_back(spec.shape.size());
  for (int64_t s : spec.shape) key.push_back(s);
  for (int64_t c : comms.coord()) key.push_back(c);
  encode(key, before);
  encode(key, after);
  ExecCache& cache = comms.exec_cache();
  if (auto hit = cache.find(key)) return hit;

  auto s = std::make_shared<StepSchedule>();
  const Dims& mesh_shape = comms.mesh().shape();
  const Dims& coord = comms.coord();
  const int64_t k = mesh_shape[m], r = coord[m];
  auto layout = [&](const Placements& ps, int64_t g) {
    return compute_layout(spec.shape, mesh_shape, ps, coord_with(coord, m, g));
  };
  const ShardLayout pre_r = layout(before, r), post_r = layout(after, r);
  s->post_shape = post_r.local_shape;
  switch (path) {
    case Path::kViews:
      for (int64_t g = 0; g < k; ++g) {
        const int peer = static_cast<int>(g);
        const ShardLayout pre_g = g == r ? pre_r : layout(before, g), post_g = g == r ? post_r : layout(after, g);
        for_each_global_piece(intersect_layouts(pre_r, post_g), pre_r, post_g, [&](const View& mine, const View&) {
          for (const View& part : split_view(mine, itemsize, limit)) s->messages.push_back({true, peer, part});
        });
        for_each_global_piece(intersect_layouts(pre_g, post_r), pre_g, post_r, [&](const View&, const View& mine) {
          for (const View& part : split_view(mine, itemsize, limit)) s->messages.push_back({false, peer, part});
        });
      }
      break;
    case Path::kPacked:
      for (int64_t g = 0; g < k; ++g) {
        const ShardLayout pre_g = g == r ? pre_r : layout(before, g), post_g = g == r ? post_r : layout(after, g);
        s->send_blocks.push_back(block_in(pre_r, intersect_layouts(pre_r, post_g)));
        s->recv_blocks.push_back(block_in(post_r, intersect_layouts(pre_g, post_r)));
        s->send_n.push_back(s->send_blocks.back().numel());
        s->recv_n.push_back(s->recv_blocks.back().numel());
      }
      break;
    case Path::kReduceScatter: {
      int64_t total = 0;
      for (int64_t g = 0; g < k; ++g) {
        s->chunk_blocks.push_back(block_in(pre_r, intersect_layouts(pre_r, layout(after, g))));
        s->seg.push_back(s->chunk_blocks.back().numel());
        s->seg_off.push_back(total);
        total += s->seg.back();
      }
      s->even = std::all_of(s->seg.begin(), s->seg.end(), [&](int64_t n) { return n == s->seg[0]; });
      s->flat = s->even && post_r.local_shape.product() == s->seg[r];
      for (int64_t g = 0; g < k && s->flat; ++g)
        s->flat = flat_start(s->chunk_blocks[g], pre_r.local_shape) == s->seg_off[g];
      s->post_whole = block_in(post_r, post_r.runs);
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
    for (const StepSchedule::Message& msg : s->messages)
      if (!msg.send) received += msg.view.numel();
    for (int64_t n : s->recv_n) received += n;
    if (received != s->post_shape.product())
      throw InternalError(fmt::format(
          "execute: the step [{}] -> [{}] on mesh dim {} is not one exchange on its group: rank {} would receive "
          "{} of the {} elements it holds after it",
          to_string(before), to_string(after), m, comms.rank(), received, s->post_shape.product()));
  }
  cache.insert(std::move(key), s);
  return s;
}

// ---- the reduce policy (NOTE [reduce policy]) ----

bool is_reducing(const Step& step) {
  return std::holds_alternative<AllReduce>(step) || std::holds_alternative<ReduceScatter>(step);
}
ReduceOp op_of(const Step& step) {
  if (const auto* a = std::get_if<AllReduce>(&step)) return a->op;
  return std::get<ReduceScatter>(step).op;
}

std::vector<ExecStep> plan_dtypes(const Plan& plan, const DeviceMesh& mesh, DType input, DType output,
                                  const ReducePolicy& policy) {
  const size_t n = plan.steps.size();
  std::vector<size_t> reducing;
  for (size_t i = 0; i < n; ++i)
    if (is_reducing(plan.steps[i])) reducing.push_back(i);
  const DType red = policy.reduce_dtype.value_or(input);
  if (policy.divide_factor <= 0 || !std::isfinite(policy.divide_factor))
    throw InvalidArgument(fmt::format("redistribute: divide_factor {} (expected a positive finite number)",
                                      policy.divide_factor));
  if (policy.reduce_dtype && (red == DType::kF8E4M3 || red == DType::kF8E5M2))
    throw InvalidArgument(fmt::format("redistribute: reduce dtype {} is storage-only (use f32, bf16, f16 or f64)",
                                      kernels::to_string(red)));
  const bool divides = policy.divide_factor != 1.0 || policy.force_sum;
  if (policy.divide_factor != 1.0 && !kernels::is_floating_point(red))
    throw InvalidArgument(fmt::format("redistribute: divide_factor {} needs a floating-point reduce dtype, not {}",
                                      policy.divide_factor, kernels::to_string(red)));
  if (policy.divide_factor != 1.0 && reducing.empty())
    throw InvalidArgument(fmt::format(
        "redistribute [{}] -> [{}]: divide_factor {} needs a reduction, and the transition reduces nothing",
        to_string(plan.src), to_string(plan.dst), policy.divide_factor));
  for (size_t i : reducing)
    if (divides && op_of(plan.steps[i]) != ReduceOp::kSum)
      throw InvalidArgument(fmt::format(
          "redistribute [{}] -> [{}]: a divide factor ({}) or force_sum applies to P(sum); step {} reduces "
          "with {}",
          to_string(plan.src), to_string(plan.dst), policy.divide_factor, to_string(plan.steps[i]),
          kernels::to_string(op_of(plan.steps[i]))));
  std::vector<ExecStep> out(n);
  const size_t first = reducing.empty() ? n : reducing.front(), last = reducing.empty() ? n : reducing.back();
  for (size_t i = 0; i < n; ++i) {
    ExecStep& p = out[i];
    if (reducing.empty() || i < first) p.in = p.out = p.work = input;
    else if (i > last) p.in = p.out = p.work = output;
    else {
      p.in = i == first ? input : red;
      p.out = i == last ? output : red;
      p.work = red;
    }
    if (is_reducing(plan.steps[i])) p.reduction = Reduction(op_of(plan.steps[i]));
  }
  if (reducing.empty() || !divides) return out;
  const double f = policy.divide_factor;
  double k_all = 1;
  for (size_t i : reducing) k_all *= static_cast<double>(mesh.size(mesh_dim_of(plan.steps[i])));
  const double k_first = static_cast<double>(mesh.size(mesh_dim_of(plan.steps[first])));
  const bool overflow_risk = red != DType::kF32 && red != DType::kBF16;
  if (!overflow_risk && !policy.force_sum) {
    if (f == k_all) {
      for (size_t i : reducing) out[i].reduction = Reduction(ReduceOp::kAvg);
    } else if (f == k_first) {
      out[first].reduction = Reduction(ReduceOp::kAvg);
    } else {
      out[first].reduction = Reduction::premul_sum(1.0 / f);
    }
    return out;
  }
  double pre = 1;
  if (overflow_risk) {
    // FSDP2's pre-divide: p doubles while p divides f and f / p > p.
    const auto divides_f = [&](double p) { return std::fmod(f, p) == 0; };
    while (divides_f(pre) && f / pre > pre) pre *= 2;
  }
  if (pre != 1) out[first].reduction = Reduction::premul_sum(1.0 / pre);
  out[last].post_scale = pre / f;
  return out;
}

// ---- issuing ----

// One tensor of a batch: its spec and its local tensor at the current step (allocated at issue,
// produced by the calls issued so far).
struct Item {
  const DTensorSpec* spec;
  Tensor local;
};

bool same_view(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shares_storage_with(b) && a.dtype() == b.dtype() &&
         a.storage_offset() == b.storage_offset() && a.shape() == b.shape() && a.strides() == b.strides();
}

// The bytes a transition allocates (memory_check.h), from the executor's step dtypes.
int64_t batch_bytes(const MeshComms& comms, const Plan& plan, std::span<const Item> items,
                    const std::vector<ExecStep>& steps, bool outs) {
  std::vector<const DTensorSpec*> specs;
  std::vector<StepDTypes> dtypes;
  for (const Item& it : items) specs.push_back(it.spec);
  for (const ExecStep& p : steps) dtypes.push_back({p.in, p.out, p.work, p.post_scale != 1.0});
  return transition_bytes(plan, specs, comms, dtypes, outs);
}

class Issuer {
 public:
  // A batch: schedules per tensor from the step cache.
  Issuer(const MeshComms& comms, const Plan& plan, std::span<const Item> items, TensorList outs,
         const ReducePolicy& policy)
      : comms_(comms), plan_(plan), items_(items.begin(), items.end()), outs_(std::move(outs)) {
    const DType input = items_[0].spec->dtype;
    const DType output = outs_.empty() || !outs_[0].defined() ? input : outs_[0].dtype();
    own_steps_ = plan_dtypes(plan, comms.mesh(), input, output, policy);
    steps_ = &own_steps_;
  }
  // One tensor, everything from its recipe. background: NOTE [background copies].
  Issuer(const MeshComms& comms, const Recipe& recipe, Item item, Tensor out, bool background)
      : comms_(comms), plan_(recipe.plan), recipe_(&recipe), items_{item}, background_(background) {
    if (out.defined()) outs_.push_back(std::move(out));
    steps_ = &recipe.steps;
  }

  ExecHandle run() {
    check_memory();
    works_.reserve(plan_.steps.size());
    for (size_t i = 0; i < plan_.steps.size(); ++i) {
      const Placements& before = plan_.states[i];
      const Step& step = plan_.steps[i];
      if (recipe_ == nullptr) {
        own_after_ = apply_step(step, before);
        after_ = &own_after_;
      } else {
        after_ = &recipe_->per_step[i].after;
      }
      step_ = i;
      before_ = &before;
      m_ = mesh_dim_of(step);
      k_ = comms_.mesh().size(m_);
      r_ = comms_.coord()[m_];
      const collectives::TraceLabel label(comm(), [&] {  // the trace's "label": the transition
        return fmt::format("{} -> {} on mesh dim {} ({})", to_string(before), to_string(*after_), m_, to_string(step));
      });
      const bool final_step = i + 1 == plan_.steps.size();
      dests_.clear();  // only the final step may write into the caller's outs
      if (final_step && !outs_.empty()) {
        dests_.assign(items_.size(), Tensor());
        for (size_t j = 0; j < items_.size(); ++j)
          if (outs_[j].dtype() == sp().out) dests_[j] = outs_[j];
      }
      TensorList next = k_ == 1 ? single(step) : std::visit([&](const auto& s) { return this->run_step(s); }, step);
      for (size_t j = 0; j < items_.size(); ++j) items_[j].local = std::move(next[j]);
    }
    // The results into the caller's tensors where no step wrote them there.
    TensorList results;
    results.reserve(items_.size());
    for (size_t j = 0; j < items_.size(); ++j) {
      if (outs_.empty() || same_view(items_[j].local, outs_[j])) {
        results.push_back(std::move(items_[j].local));
        continue;
      }
      local([src = items_[j].local, dst = outs_[j]]() mutable { dst.copy_(src); });
      results.push_back(outs_[j]);
    }
    return ExecHandle(std::move(works_), std::move(results),
                      comms_.mesh().ndim() > 0 ? comms_.dim(0).timeout() : collectives::kDefaultTimeout, std::move(used_));
  }

 private:
  // ---- where the data is produced ----

  // Runs fn once the data it reads is there: at once when nothing is pending (in the background:
  // as a host task of the current step's communicator, NOTE [background copies]), else as a host
  // task of the communicator producing it (NOTE [deferred plans]).
  void local(std::function<void()> fn) {
    if (stream_ == nullptr && !background_) {
      fn();
      return;
    }
    Communicator& c = stream_ != nullptr ? *stream_ : on(comm());
    call(c.host_task(std::move(fn)));
  }
  // The communicator of the current step; its next call waits for the data still in flight on
  // another communicator.
  Communicator& on(Communicator& c) {
    if (stream_ != nullptr && stream_ != &c) c.wait_for(last_);
    stream_ = &c;
    if (used_.empty() || (used_.back() != &c && std::find(used_.begin(), used_.end(), &c) == used_.end())) {
      used_.push_back(&c);
    }
    return c;
  }
  void call(WorkPtr w) {
    last_ = w;
    works_.push_back(std::move(w));
  }

  Communicator& comm() const { return comms_.dim(m_); }
  bool plain_step() const {
    return recipe_ != nullptr ? recipe_->per_step[step_].plain
                              : is_plain_step(plan_.steps[step_], *before_, comms_.mesh().shape());
  }
  const ExecStep& sp() const { return (*steps_)[step_]; }

  // Refuses, before any buffer is allocated, a transition the allocator cannot serve
  // (NOTE [memory limit] in kernels/allocator.h); a recipe knows its bytes already.
  void check_memory() const {
    const bool outs = !outs_.empty();
    const int64_t need = recipe_ != nullptr ? (outs ? recipe_->bytes_with_out : recipe_->bytes)
                                            : batch_bytes(comms_, plan_, {items_.data(), items_.size()}, *steps_, outs);
    comms_.exec_cache().memory_gauge().check(need, comms_.allocator().get(), device(), comms_.rank(), [&] {
      return fmt::format("redistribute [{}] -> [{}] of {} [{}]{}", to_string(plan_.src), to_string(plan_.dst),
                         kernels::to_string(items_[0].spec->dtype), fmt::join(items_[0].spec->shape, ","),
                         items_.size() > 1 ? fmt::format(" (and {} more tensors)", items_.size() - 1) : "");
    });
  }
  kernels::Device device() const { return items_[0].local.device(); }
  Tensor alloc(const Dims& shape, DType dtype) const {
    return Tensor::empty(shape, dtype, device(), comms_.allocator());
  }
  // The step's result for item j: the caller's out when it fits (the final step writes straight
  // into it), else a new tensor.
  Tensor result(size_t j, const Dims& shape, DType dtype, bool need_contiguous) const {
    if (j >= dests_.size()) return alloc(shape, dtype);
    const Tensor& d = dests_[j];
    if (d.defined() && d.dtype() == dtype && d.shape() == shape && (!need_contiguous || d.is_contiguous())) return d;
    return alloc(shape, dtype);
  }
  std::shared_ptr<const StepSchedule> sched(size_t j, Path path) const {
    if (recipe_ != nullptr)
      if (const auto& s = recipe_->per_step[step_].by_path[static_cast<size_t>(path)]) return s;
    return schedule_for(comms_, *items_[j].spec, *before_, *after_, m_, path, sp().work);
  }

  // ---- steps on a group of one: nothing moves ----
  TensorList single(const Step& step) {
    TensorList out;
    const ExecStep& p = sp();
    const bool transform = is_reducing(step) && (p.in != p.out || p.reduction.pre_multiplier != 1.0 || p.post_scale != 1.0);
    for (size_t j = 0; j < items_.size(); ++j) {
      if (!transform) {
        out.push_back(items_[j].local);
        continue;
      }
      // The reduction over one member: the value itself, pre- and post-scaled, in the reduce dtype.
      Tensor src = items_[j].local;
      Tensor acc = alloc(src.shape(), p.work);
      Tensor dst = p.out == p.work ? acc : result(j, src.shape(), p.out, false);
      const double scale = p.reduction.pre_multiplier * p.post_scale;
      local([=]() mutable {
        acc.copy_(src);
        if (scale != 1.0) kernels::scale_(acc, scale);
        if (!same_view(dst, acc)) dst.copy_(acc);
      });
      out.push_back(dst);
    }
    return out;
  }

  // ---- all-gather ----
  TensorList run_step(const AllGather& s) {
    // A valid step that is not plain (a later mesh dim shards the dim too) gathers pieces that
    // are not the result's chunks in coordinate order: only the exchange places them.
    bool direct = s.tensor_dim == 0 && plain_step();
    if (items_.size() == 1 && direct) {
      // Straight from the local tensor into the result (the caller's out when contiguous).
      const std::shared_ptr<const StepSchedule> sc = sched(0, Path::kAllGather);
      if (sc->post_shape[0] % k_ == 0 && items_[0].local.is_contiguous()) {
        Tensor out = result(0, sc->post_shape, sp().work, true);
        call(on(comm()).all_gather(items_[0].local, out));  // contiguous: collectives go by numel
        return {std::move(out)};
      }
      return exchange();
    }
    std::vector<std::shared_ptr<const StepSchedule>> scheds;
    for (size_t j = 0; j < items_.size() && direct; ++j) {
      scheds.push_back(sched(j, Path::kAllGather));
      direct = scheds.back()->post_shape[0] % k_ == 0 && items_[j].local.is_contiguous();
    }
    if (!direct) return exchange();
    const DType dt = sp().work;
    Communicator& c = on(comm());
    int64_t total = 0;
    for (const Item& it : items_) total += it.local.numel();
    Tensor send = alloc({total}, dt), recv = alloc({k_ * total}, dt);
    TensorList outs;
    for (size_t j = 0; j < items_.size(); ++j) outs.push_back(result(j, scheds[j]->post_shape, dt, false));
    TensorList ins;
    for (const Item& it : items_) ins.push_back(it.local);
    local([=] {  // copy-in
      int64_t off = 0;
      for (const Tensor& in : ins) {
        send.narrow(0, off, in.numel()).copy_(in.view({in.numel()}));
        off += in.numel();
      }
    });
    call(c.all_gather(send, recv));
    const int64_t k = k_;
    local([=] {  // copy-out: member g's piece of tensor i
      int64_t off = 0;
      for (size_t j = 0; j < ins.size(); ++j) {
        const int64_t n = ins[j].numel();
        Tensor o = outs[j].contiguous();
        Tensor flat = o.view({o.numel()});
        for (int64_t g = 0; g < k; ++g) flat.narrow(0, g * n, n).copy_(recv.narrow(0, g * total + off, n));
        if (!same_view(o, outs[j])) Tensor(outs[j]).copy_(o);
        off += n;
      }
    });
    return outs;
  }
  TensorList run_step(const StridedAllGather&) { return exchange(); }
  TensorList run_step(const AllToAll&) { return exchange(); }
  TensorList run_step(const Regroup&) { return exchange(); }

  // ---- local steps ----
  TensorList run_step(const LocalChunk&) {
    TensorList out;
    for (size_t j = 0; j < items_.size(); ++j) {
      auto sc = sched(j, Path::kLocalChunk);
      Tensor o = result(j, sc->post_shape, sp().out, false);
      local([src = items_[j].local, o, sc]() mutable {
        Tensor packed = o.is_contiguous() ? o : Tensor::empty(o.shape(), o.dtype(), o.device());
        pack(src, sc->keep, packed.view({packed.numel()}), 0);
        if (!same_view(packed, o)) o.copy_(packed);
      });
      out.push_back(o);
    }
    return out;
  }

  // S(d) -> P(sum): zeros of the group's extent, this rank's shard at its place (what it holds of
  // the new layout; NOTE [step validity] makes every element of it held by one member).
  TensorList run_step(const LocalEmbed&) {
    TensorList out;
    for (size_t j = 0; j < items_.size(); ++j) {
      const DTensorSpec& spec = *items_[j].spec;
      const ShardLayout pre = compute_layout(spec.shape, comms_.mesh().shape(), *before_, comms_.coord());
      const ShardLayout post = compute_layout(spec.shape, comms_.mesh().shape(), *after_, comms_.coord());
      const std::vector<IndexRuns> mine = intersect_layouts(pre, post);
      auto blocks = std::make_shared<std::pair<Block, Block>>(block_in(pre, mine), block_in(post, mine));
      Tensor o = result(j, post.local_shape, sp().out, false);
      local([src = items_[j].local, o, blocks]() mutable {
        o.fill_(0);
        if (blocks->first.numel() == 0) return;
        Tensor tmp = Tensor::empty({blocks->first.numel()}, src.dtype(), src.device());
        pack(src, blocks->first, tmp, 0);
        unpack(tmp, 0, o, blocks->second);
      });
      out.push_back(o);
    }
    return out;
  }

  TensorList run_step(const LocalPartial& s) {
    if (s.op == ReduceOp::kProd)
      throw kernels::Unsupported("Replicate -> P(prod) has no partition (PyTorch rejects it too)");
    TensorList out;
    const double scale = s.op == ReduceOp::kSum ? 1.0 / static_cast<double>(k_) : 1.0;
    for (size_t j = 0; j < items_.size(); ++j) {
      Tensor o = result(j, items_[j].local.shape(), sp().out, false);
      local([src = items_[j].local, o, scale]() mutable {
        o.copy_(src);
        if (scale != 1.0) kernels::scale_(o, scale);
      });
      out.push_back(o);
    }
    return out;
  }

  // ---- reductions ----

  // acc (the reduced data, work dtype) -> post-scale -> dst (out dtype). REQUIRES: in a task.
  static void finish_reduced(const Tensor& acc, double post_scale, Tensor dst) {
    if (post_scale != 1.0) kernels::scale_(acc, post_scale);
    if (!same_view(acc, dst)) dst.copy_(acc);
  }

  TensorList run_step(const AllReduce&) {
    const ExecStep p = sp();
    Communicator& c = on(comm());
    int64_t total = 0;
    for (const Item& it : items_) total += it.local.numel();
    const bool single = items_.size() == 1;
    // Input: the local tensor itself when it is contiguous and already in the reduce dtype, else
    // a copy (cast fused).
    Tensor in;
    TensorList ins;
    for (const Item& it : items_) ins.push_back(it.local);
    if (single && ins[0].is_contiguous() && p.in == p.work) {
      in = ins[0].view({total});
    } else {
      in = alloc({total}, p.work);
      local([=] {
        int64_t off = 0;
        for (const Tensor& t : ins) {
          in.narrow(0, off, t.numel()).view(t.shape()).copy_(t);
          off += t.numel();
        }
      });
    }
    // Output: straight into the result (the caller's out when it fits) when no cast or scale
    // follows, else one buffer (results are views of it, or casts).
    const bool into_out = single && p.out == p.work && p.post_scale == 1.0;
    Tensor direct = into_out ? result(0, ins[0].shape(), p.out, true) : Tensor();
    Tensor buf = into_out ? direct.view({total}) : alloc({total}, p.work);
    call(c.all_reduce(in, buf, p.reduction));
    TensorList outs;
    if (into_out) return {direct};
    if (p.out == p.work && p.post_scale == 1.0 && dests_all_empty()) {
      int64_t off = 0;
      for (const Tensor& t : ins) {
        outs.push_back(buf.narrow(0, off, t.numel()).view(t.shape()));
        off += t.numel();
      }
      return outs;
    }
    for (size_t j = 0; j < ins.size(); ++j) outs.push_back(result(j, ins[j].shape(), p.out, false));
    local([=] {
      if (p.post_scale != 1.0) kernels::scale_(buf, p.post_scale);
      int64_t off = 0;
      for (size_t j = 0; j < ins.size(); ++j) {
        Tensor(outs[j]).copy_(buf.narrow(0, off, ins[j].numel()).view(ins[j].shape()));
        off += ins[j].numel();
      }
    });
    return outs;
  }

  bool dests_all_empty() const {
    return std::all_of(dests_.begin(), dests_.end(), [](const Tensor& t) { return !t.defined(); });
  }

  TensorList run_step(const ReduceScatter&) {
    const ExecStep p = sp();
    const int64_t k = k_, r = r_;
    std::vector<std::shared_ptr<const StepSchedule>> sc;
    for (size_t j = 0; j < items_.size(); ++j) sc.push_back(sched(j, Path::kReduceScatter));
    TensorList ins;
    for (const Item& it : items_) ins.push_back(it.local);
    Communicator& c = on(comm());
    // Member chunks that are consecutive flat ranges of one contiguous input: reduce-scatter
    // straight from it (a cast copy first when the reduce dtype differs) into the result.
    if (items_.size() == 1 && sc[0]->flat && ins[0].is_contiguous()) {
      Tensor in = flat(ins[0]);
      if (p.in != p.work) {
        Tensor cast = alloc({ins[0].numel()}, p.work);
        local([=]() mutable { cast.copy_(in); });
        in = cast;
      }
      Tensor o = result(0, sc[0]->post_shape, p.out, true);
      const bool into_out = o.dtype() == p.work;
      Tensor acc = into_out ? o : alloc(sc[0]->post_shape, p.work);
      call(c.reduce_scatter(in, flat(acc), p.reduction));
      if (!into_out || p.post_scale != 1.0) local([=] { finish_reduced(acc, p.post_scale, o); });
      return {o};
    }
    // Pack, per destination member, each tensor's block of that member's chunk (cast fused).
    std::vector<int64_t> seg(k, 0), seg_off(k, 0);
    int64_t total = 0;
    for (int64_t g = 0; g < k; ++g) {
      seg_off[g] = total;
      for (const auto& s : sc) seg[g] += s->seg[g];
      total += seg[g];
    }
    const bool even = std::all_of(seg.begin(), seg.end(), [&](int64_t n) { return n == seg[0]; });
    Tensor send = alloc({total}, p.work);
    local([=] {
      for (int64_t g = 0; g < k; ++g) {
        int64_t off = seg_off[g];
        for (size_t j = 0; j < ins.size(); ++j) {
          pack(ins[j], sc[j]->chunk_blocks[g], send, off);
          off += sc[j]->seg[g];
        }
      }
    });
    Tensor mine = alloc({seg[r]}, p.work);
    if (even) {
      call(c.reduce_scatter(send, mine, p.reduction));
    } else {
      // Uneven chunks: exchange exactly, then reduce in member order (no padding on the wire).
      TensorList got(k);
      std::vector<P2POp> ops;
      for (int64_t g = 0; g < k; ++g) {
        if (g == r) continue;
        got[g] = alloc({seg[r]}, p.work);
        if (seg[g] > 0) ops.push_back(P2POp::send(send.narrow(0, seg_off[g], seg[g]), static_cast<int>(g)));
        if (seg[r] > 0) ops.push_back(P2POp::recv(got[g], static_cast<int>(g)));
      }
      call(c.send_recv(ops));
      const Reduction red = p.reduction;
      local([=]() mutable {
        got[r] = send.narrow(0, seg_off[r], seg[r]);
        const double m = red.pre_multiplier;
        mine.copy_(got[0]);
        if (m != 1.0) kernels::scale_(mine, m);
        for (int64_t g = 1; g < k; ++g) kernels::reduce_into(mine, got[g], red.op, m);
        if (red.op == ReduceOp::kAvg) kernels::scale_(mine, 1.0 / static_cast<double>(k));
      });
    }
    TensorList outs;
    for (size_t j = 0; j < items_.size(); ++j) outs.push_back(result(j, sc[j]->post_shape, p.out, false));
    local([=] {
      if (p.post_scale != 1.0) kernels::scale_(mine, p.post_scale);
      int64_t off = 0;
      for (size_t j = 0; j < outs.size(); ++j) {
        unpack(mine, off, outs[j], sc[j]->post_whole);  // cast fused
        off += sc[j]->post_whole.numel();
      }
    });
    return outs;
  }

  // ---- exchanges (NOTE [exchange]) ----
  TensorList exchange() { return comm().p2p_views() ? exchange_views() : exchange_packed(); }

  // Every piece goes from this rank's input straight into the peer's result (what this rank
  // keeps too, as a message to itself): one copy per element, nothing packed, all by the backend.
  TensorList exchange_views() {
    const DType dt = sp().work;
    TensorList out;
    std::vector<P2POp> ops;
    for (size_t j = 0; j < items_.size(); ++j) {
      auto sc = sched(j, Path::kViews);
      Tensor o = result(j, sc->post_shape, dt, false);
      if (o.ndim() > 0)
        for (int d = 0; d < o.ndim(); ++d)
          if (o.stride(d) < 0) o = alloc(sc->post_shape, dt);  // views need non-negative strides
      out.push_back(o);
      for (const StepSchedule::Message& msg : sc->messages)
        ops.push_back(msg.send ? P2POp::send(at(items_[j].local, msg.view), msg.peer)
                               : P2POp::recv(at(o, msg.view), msg.peer));
    }
    call(on(comm()).send_recv(ops));
    return out;
  }

  // Per peer one contiguous send and one receive buffer (backends without views).
  TensorList exchange_packed() {
    const DType dt = sp().work;
    const int64_t k = k_, r = r_;
    std::vector<std::shared_ptr<const StepSchedule>> sc;
    TensorList out, ins;
    std::vector<int64_t> send_n(k, 0), recv_n(k, 0);
    for (size_t j = 0; j < items_.size(); ++j) {
      sc.push_back(sched(j, Path::kPacked));
      out.push_back(result(j, sc.back()->post_shape, dt, false));
      ins.push_back(items_[j].local);
      for (int64_t g = 0; g < k; ++g) {
        send_n[g] += sc.back()->send_n[g];
        recv_n[g] += sc.back()->recv_n[g];
      }
    }
    TensorList send_buf(k), recv_buf(k);
    std::vector<P2POp> ops;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      send_buf[g] = alloc({send_n[g]}, dt);
      recv_buf[g] = alloc({recv_n[g]}, dt);
      if (send_n[g] > 0) ops.push_back(P2POp::send(send_buf[g], static_cast<int>(g)));
      if (recv_n[g] > 0) ops.push_back(P2POp::recv(recv_buf[g], static_cast<int>(g)));
    }
    Communicator& c = on(comm());
    local([=] {  // pack every peer's pieces, and move what this rank keeps
      for (int64_t g = 0; g < k; ++g) {
        if (g == r) {
          for (size_t j = 0; j < ins.size(); ++j) {
            const Block& from = sc[j]->send_blocks[g];
            if (from.numel() == 0) continue;
            Tensor tmp = Tensor::empty({from.numel()}, ins[j].dtype(), ins[j].device());
            pack(ins[j], from, tmp, 0);
            unpack(tmp, 0, out[j], sc[j]->recv_blocks[g]);
          }
          continue;
        }
        int64_t off = 0;
        for (size_t j = 0; j < ins.size(); ++j) {
          pack(ins[j], sc[j]->send_blocks[g], send_buf[g], off);
          off += sc[j]->send_n[g];
        }
      }
    });
    call(c.send_recv(ops));
    local([=] {  // unpack
      for (int64_t g = 0; g < k; ++g) {
        if (g == r) continue;
        int64_t off = 0;
        for (size_t j = 0; j < out.size(); ++j) {
          unpack(recv_buf[g], off, out[j], sc[j]->recv_blocks[g]);
          off += sc[j]->recv_n[g];
        }
      }
    });
    return out;
  }

  const MeshComms& comms_;
  const Plan& plan_;
  const Recipe* recipe_ = nullptr;
  boost::container::small_vector<Item, 1> items_;
  bool background_ = false;
  TensorList outs_;
  std::vector<ExecStep> own_steps_;
  const std::vector<ExecStep>* steps_ = nullptr;
  // The current step.
  size_t step_ = 0;
  const Placements* before_ = nullptr;
  const Placements* after_ = nullptr;
  Placements own_after_;
  int m_ = 0;
  int64_t k_ = 1, r_ = 0;
  TensorList dests_;  // per item: the caller's out when this step may write into it (empty: none)
  // Where the data is: the communicator whose queue produces it (null: ready now) and its last call.
  Communicator* stream_ = nullptr;
  WorkPtr last_;
  WorkList works_;
  CommList used_;
};

std::string shape_text(const Dims& d) { return fmt::format("[{}]", fmt::join(d, ",")); }

std::shared_ptr<const Recipe> make_recipe(const MeshComms& comms, const Plan& plan, const DTensorSpec& spec,
                                          DType output, const ReducePolicy& policy) {
  // NOTE [step validity]: a step valid for one global shape may not be for another.
  if (!plan.valid_for(spec.shape))
    throw InvalidArgument(fmt::format("execute: global shape {} is not one the plan {} was made for (plan it for this shape)",
                                      shape_text(spec.shape), to_string(plan)));
  auto r = std::make_shared<Recipe>();
  r->plan = plan;
  r->steps = plan_dtypes(plan, comms.mesh(), spec.dtype, output, policy);
  r->src_local = compute_layout(spec.shape, comms.mesh().shape(), plan.src, comms.coord()).local_shape;
  r->dst_local = compute_layout(spec.shape, comms.mesh().shape(), plan.dst, comms.coord()).local_shape;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Step& step = plan.steps[i];
    const Placements& before = plan.states[i];
    Recipe::PerStep ps;
    ps.after = apply_step(step, before);
    ps.plain = is_plain_step(step, before, comms.mesh().shape());
    const int m = mesh_dim_of(step);
    if (comms.mesh().size(m) > 1) {
      const DType moved = r->steps[i].work;
      auto add = [&](Path path) {
        ps.by_path[static_cast<size_t>(path)] = schedule_for(comms, spec, before, ps.after, m, path, moved);
      };
      const Path exchange = comms.dim(m).p2p_views() ? Path::kViews : Path::kPacked;
      std::visit(
          [&](const auto& s) {
            using T = std::decay_t<decltype(s)>;
            if constexpr (std::is_same_v<T, AllGather>) {
              add(Path::kAllGather);
              add(exchange);
            } else if constexpr (std::is_same_v<T, StridedAllGather> || std::is_same_v<T, AllToAll> ||
                                 std::is_same_v<T, Regroup>) {
              add(exchange);
            } else if constexpr (std::is_same_v<T, ReduceScatter>) {
              add(Path::kReduceScatter);
            } else if constexpr (std::is_same_v<T, LocalChunk>) {
              add(Path::kLocalChunk);
            }
          },
          step);
    }
    r->per_step.push_back(std::move(ps));
  }
  const std::vector<Item> item{{&spec, Tensor()}};
  r->bytes = batch_bytes(comms, plan, item, r->steps, false);
  r->bytes_with_out = batch_bytes(comms, plan, item, r->steps, true);
  return r;
}

// The caller's out against the result's local shape and the input (one tensor).
void check_out(const Tensor& out, const Tensor& local, const Dims& want, int rank, const Placements& dst) {
  if (!(out.shape() == want))
    throw InvalidArgument(fmt::format("redistribute: out tensor has shape {} but rank {} holds {} of the result under [{}]",
                                      shape_text(out.shape()), rank, shape_text(want), to_string(dst)));
  if (out.device().type != local.device().type)
    throw InvalidArgument(fmt::format("redistribute: out tensor is on {} but the local tensor on {}",
                                      kernels::to_string(out.device()), kernels::to_string(local.device())));
  if (out.dtype() == DType::kF8E4M3 || out.dtype() == DType::kF8E5M2)
    throw InvalidArgument(fmt::format("redistribute: out dtype {} is storage-only", kernels::to_string(out.dtype())));
  if (out.numel() > 0) (void)out.data_ptr();  // throws when its storage is freed
  if (out.numel() > 0 && local.numel() > 0 && out.shares_storage_with(local))
    throw InvalidArgument("redistribute: the out tensor shares storage with the input (the input is never written)");
}

}  // namespace

// ---- ExecHandle ----

void ExecHandle::kick() const {
  for (Communicator* c : used_) c->kick();
}

ExecHandle& ExecHandle::operator=(ExecHandle&& other) noexcept {
  if (this != &other) {
    finish_quietly();
    works_ = std::move(other.works_);
    results_ = std::move(other.results_);
    used_ = std::move(other.used_);
    other.works_.clear();  // a moved-from handle waits for nothing
    other.results_.clear();
    other.used_.clear();
    default_timeout_ = other.default_timeout_;
    done_ = other.done_;
    failed_ = other.failed_;
    other.done_ = 0;
  }
  return *this;
}

ExecHandle::~ExecHandle() { finish_quietly(); }

void ExecHandle::finish_quietly() noexcept {
  if (std::uncaught_exceptions() > 0 || failed_) return;
  try {
    for (; done_ < works_.size(); ++done_) works_[done_]->settle(default_timeout_);
  } catch (...) {  // NOLINT: destructors never throw
  }
}

bool ExecHandle::ready() {
  while (done_ < works_.size() && works_[done_]->completed()) ++done_;
  if (done_ < works_.size()) return false;
  return true;
}

std::span<const Tensor> ExecHandle::wait(Milliseconds timeout) {
  if (done_ == works_.size() && !failed_) return results();
  const kernels::TraceSpan span(used_.empty() ? nullptr : used_[0]->tracer(), used_.empty() ? 0 : used_[0]->global_rank(),
                                "waits", "redistribute wait");
  // One call left (a one-collective transition): its own timeout is the whole budget, no clock.
  const auto deadline = done_ + 1 == works_.size() ? std::chrono::steady_clock::time_point{}
                                                   : std::chrono::steady_clock::now() + timeout;
  for (size_t i = done_; i < works_.size(); ++i) {
    const auto left = i == done_ ? timeout
                                 : std::max(Milliseconds{0}, std::chrono::duration_cast<Milliseconds>(
                                                                 deadline - std::chrono::steady_clock::now()));
    if (!works_[i]->settle(left)) {
      // Out of time: name the call that holds the transition up and where it stands (which ranks
      // never joined it, or what it waits for), then give it up.
      const std::string why = fmt::format("redistribute timed out after {} ms: {}", timeout.count(), works_[i]->describe());
      works_[i]->give_up(why);
      failed_ = true;  // the later calls may never finish: do not wait for them again
      throw kernels::CommError(why);
    }
    try {
      works_[i]->wait(Milliseconds{0});  // finished: returns, or rethrows its failure
    } catch (...) {
      failed_ = true;
      throw;
    }
    done_ = i + 1;
  }
  return results();
}

// ---- entry points ----

ExecHandle issue_batch(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                       const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs) {
  if (specs.size() != locals.size())
    throw InvalidArgument(fmt::format("execute_batch: {} specs for {} local tensors", specs.size(), locals.size()));
  if (!outs.empty() && outs.size() != specs.size())
    throw InvalidArgument(fmt::format("execute_batch: {} out tensors for {} tensors (give one per tensor, or none)",
                                      outs.size(), specs.size()));
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    const DTensorSpec& s = specs[i];
    if (s.placements != plan.src)
      throw InvalidArgument(fmt::format("execute: tensor {} has placements [{}], the plan starts at [{}]", i,
                                        to_string(s.placements), to_string(plan.src)));
    if (!(*s.mesh == comms.mesh()))
      throw InvalidArgument(fmt::format("execute: tensor {} is on mesh {}, the communicators on {}", i,
                                        to_string(*s.mesh), to_string(comms.mesh())));
    if (s.dtype != specs[0].dtype || locals[i].dtype() != s.dtype)
      throw InvalidArgument(fmt::format("execute: tensor {} has dtype {} (batch dtype {})", i,
                                        kernels::to_string(locals[i].dtype()), kernels::to_string(specs[0].dtype)));
    items.push_back({&s, locals[i]});
  }
  // NOTE [step validity]: a step valid for one global shape may not be for another.
  for (size_t i = 0; i < items.size(); ++i)
    if (!plan.valid_for(items[i].spec->shape))
      throw InvalidArgument(fmt::format("execute: tensor {} has global shape {}, which the plan {} was not made for "
                                        "(plan it for this shape)",
                                        i, shape_text(items[i].spec->shape), to_string(plan)));
  TensorList out_list(outs.begin(), outs.end());
  if (!comms.in_mesh() || items.empty())
    return ExecHandle({}, out_list.empty() ? TensorList(locals.begin(), locals.end()) : out_list,
                      collectives::kDefaultTimeout);
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const ShardLayout l = *it.spec->layout(comms.rank());
    if (!(it.local.shape() == l.local_shape))
      throw InvalidArgument(fmt::format("execute: local tensor of shape {} but rank {} holds {} of {}",
                                        shape_text(it.local.shape()), comms.rank(), shape_text(l.local_shape),
                                        to_string(*it.spec)));
    if (out_list.empty()) continue;
    const Tensor& o = out_list[i];
    DTensorSpec dst = *it.spec;
    dst.placements = plan.dst;
    const ShardLayout want = *dst.layout(comms.rank());
    if (!o.defined() || !(o.shape() == want.local_shape))
      throw InvalidArgument(fmt::format(
          "execute: out tensor {} has shape {} but rank {} holds {} of the result under [{}]", i,
          o.defined() ? shape_text(o.shape()) : std::string("(undefined)"), comms.rank(),
          shape_text(want.local_shape), to_string(plan.dst)));
    if (o.device().type != it.local.device().type)
      throw InvalidArgument(fmt::format("execute: out tensor {} is on {} but the local tensor on {}", i,
                                        kernels::to_string(o.device()), kernels::to_string(it.local.device())));
    if (o.dtype() != out_list[0].dtype())
      throw InvalidArgument(fmt::format("execute: out tensor {} has dtype {}, out tensor 0 {} (one dtype per batch)",
                                        i, kernels::to_string(o.dtype()), kernels::to_string(out_list[0].dtype())));
    if (o.numel() > 0) (void)o.data_ptr();  // throws when its storage is freed
    for (const Tensor& in : locals)
      if (o.numel() > 0 && in.numel() > 0 && o.shares_storage_with(in))
        throw InvalidArgument(fmt::format("execute: out tensor {} shares storage with an input tensor", i));
  }
  return Issuer(comms, plan, items, std::move(out_list), policy).run();
}

ExecHandle issue(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
                 const ReducePolicy& policy, const Tensor& out) {
  return issue_batch(plan, std::span<const DTensorSpec>(&src, 1), std::span<const Tensor>(&local, 1), comms, policy,
                     out.defined() ? std::span<const Tensor>(&out, 1) : std::span<const Tensor>());
}

ExecHandle issue_to(const DTensorSpec& src, const Placements& dst, PlannerKind planner, const Tensor& local,
                    const MeshComms& comms, const ReducePolicy& policy, const Tensor& out, Placements* normalized,
                    bool background) {
  // The key in a buffer on the stack: a cached call builds no vector.
  std::array<int64_t, 9 + kernels::kMaxDims + 6 * 3 * kernels::kMaxDims> buffer;
  const size_t words = 9 + static_cast<size_t>(src.shape.size()) + 3 * (src.placements.size() + dst.size());
  std::vector<int64_t> heap;
  int64_t* k = words <= buffer.size() ? buffer.data() : (heap.resize(words), heap.data());
  const std::span<const int64_t> key(k, words);
  *k++ = static_cast<int64_t>(src.dtype);
  *k++ = out.defined() ? static_cast<int64_t>(out.dtype()) : -1;
  *k++ = static_cast<int64_t>(planner);
  *k++ = policy.reduce_dtype ? static_cast<int64_t>(*policy.reduce_dtype) : -1;
  *k++ = std::bit_cast<int64_t>(policy.divide_factor);
  *k++ = policy.force_sum;
  *k++ = src.shape.size();
  for (int64_t d : src.shape) *k++ = d;
  for (const Placements* ps : {&src.placements, &dst}) {
    *k++ = static_cast<int64_t>(ps->size());
    for (const Placement& p : *ps) {
      *k++ = static_cast<int64_t>(p.index());
      if (const auto* a = std::get_if<Shard>(&p)) *k++ = a->dim, *k++ = 0;
      else if (const auto* b = std::get_if<StridedShard>(&p)) *k++ = b->dim, *k++ = b->split_factor;
      else if (const auto* c = std::get_if<Partial>(&p)) *k++ = -1, *k++ = static_cast<int64_t>(c->op);
      else *k++ = -1, *k++ = 0;
    }
  }
  ExecCache& cache = comms.exec_cache();
  std::shared_ptr<const Recipe> recipe = cache.find_recipe(key);
  if (!recipe) {
    const Placements target = normalize_placements(dst, src.mesh->ndim(), src.tensor_ndim());
    const Plan& plan = comms.plans().get(src, target, planner);  // validates (Unsupported for S -> P etc.)
    if (!comms.in_mesh()) {
      if (normalized) *normalized = target;
      return ExecHandle({}, {out.defined() ? out : local}, collectives::kDefaultTimeout);
    }
    recipe = make_recipe(comms, plan, src, out.defined() ? out.dtype() : src.dtype, policy);
    cache.insert_recipe(ExecCache::Key(key.begin(), key.end()), recipe);
  }
  if (normalized) *normalized = recipe->plan.dst;
  if (!(local.shape() == recipe->src_local))
    throw InvalidArgument(fmt::format("redistribute: local tensor of shape {} but rank {} holds {} of {}",
                                      shape_text(local.shape()), comms.rank(), shape_text(recipe->src_local),
                                      to_string(src)));
  if (out.defined()) check_out(out, local, recipe->dst_local, comms.rank(), recipe->plan.dst);
  return Issuer(comms, *recipe, Item{&src, local}, out, background).run();
}

std::vector<Tensor> execute_batch(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                                  const MeshComms& comms, const ReducePolicy& policy, std::span<const Tensor> outs) {
  ExecHandle h = issue_batch(plan, specs, locals, comms, policy, outs);
  const std::span<const Tensor> r = h.wait();
  return {r.begin(), r.end()};
}

Tensor execute(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
               const ReducePolicy& policy, const Tensor& out) {
  ExecHandle h = issue(plan, src, local, comms, policy, out);
  return h.wait()[0];
}

}  // namespace dtensor
