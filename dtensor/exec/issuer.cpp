// The Issuer: enqueues every step of a plan on this rank's communicators (NOTE [deferred plans]
// in executor.h), one function per step kind. It decides how (buffers, which collective, casts),
// never what: the plan and the schedules are given.
#include "dtensor/exec/issuer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "dtensor/exec/memory_check.h"
#include "kernels/error.h"
#include "kernels/reduce.h"

namespace dtensor {

using collectives::Communicator;
using collectives::P2POp;
using collectives::Reduction;
using collectives::WorkPtr;
using kernels::DType;

namespace {

// ---- issuing ----

bool same_view(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shares_storage_with(b) && a.dtype() == b.dtype() &&
         a.storage_offset() == b.storage_offset() && a.shape() == b.shape() && a.strides() == b.strides();
}

// NOTE [wire dtype]: an fp8 wire carries each sender's power-of-two scale; bf16 / f16 need none.
bool wire_scaled(DType wire) { return wire == DType::kF8E4M3 || wire == DType::kF8E5M2; }

// The scale an fp8 wire sends `t` (contiguous, any floating dtype) with: the largest power of two
// 2^e, |e| <= 120, with amax(finite |t|) x 2^e <= the wire's largest finite value (e5m2 57344,
// e4m3 448); 1 for another wire, or when t holds no finite non-zero value.
double wire_scale(const Tensor& t, DType wire) {
  if (!wire_scaled(wire) || t.numel() == 0) return 1.0;
  const Tensor h = t.device().is_cpu() && t.dtype() == DType::kF32 ? t : t.to(kernels::Device{}).to(DType::kF32);
  const float* x = h.data<float>();
  float amax = 0;
  for (int64_t i = 0; i < h.numel(); ++i)
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0) return 1.0;
  const double top = wire == DType::kF8E4M3 ? 448.0 : 57344.0;
  int e = std::ilogb(top) - std::ilogb(static_cast<double>(amax));
  if (std::ldexp(static_cast<double>(amax), e) > top) --e;
  return std::ldexp(1.0, std::clamp(e, -120, 120));
}

// The bytes a transition allocates (memory_check.h), from the executor's step dtypes.
int64_t batch_bytes(const MeshComms& comms, const Plan& plan, std::span<const Item> items,
                    const std::vector<ExecStep>& steps, bool outs) {
  std::vector<const DTensorSpec*> specs;
  std::vector<StepDTypes> dtypes;
  for (const Item& it : items) specs.push_back(it.spec);
  for (const ExecStep& p : steps) dtypes.push_back({p.in, p.out, p.work, p.post_scale != 1.0, p.wire});
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
    own_steps_ = plan_dtypes(plan, comms.mesh().shape(), input, output, policy);
    steps_ = &own_steps_;
  }
  // One tensor, everything from its recipe. background: NOTE [background copies].
  Issuer(const MeshComms& comms, const Plan& plan, const Recipe& recipe, Item item, Tensor out, bool background)
      : comms_(comms), plan_(plan), recipe_(&recipe), items_{item}, background_(background) {
    if (out.defined()) outs_.push_back(std::move(out));
    steps_ = &recipe.steps;
  }

  ExecHandle run() {
    check_memory();
    works_.reserve(plan_.steps.size());
    for (const Item& it : items_) inputs_.push_back(it.local);
    // The final step writes into the caller's outs; so does the step before a run of in-place
    // all-reduces (HSDP's reduce-scatter then all-reduce: the all-reduce runs on the out).
    size_t writes_out = plan_.steps.empty() ? 0 : plan_.steps.size() - 1;
    while (writes_out > 0 && items_.size() == 1 && in_place_step(writes_out)) --writes_out;
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
      dests_.clear();  // only the steps from writes_out on may write into the caller's outs
      if (i >= writes_out && !outs_.empty()) {
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
  bool in_place_step(size_t i) const {
    const ExecStep& p = (*steps_)[i];
    const Step& s = plan_.steps[i];
    return all_reduces_in_place(s, comms_.mesh().size(mesh_dim_of(s)), {p.in, p.out, p.work, p.post_scale != 1.0, p.wire});
  }
  // Item j's current tensor is the plan's (an intermediate or the caller's out), not the input.
  bool owned(size_t j) const { return !items_[j].local.shares_storage_with(inputs_[j]); }

  // Refuses, before any buffer is allocated, a transition the allocator cannot serve
  // (NOTE [memory limit] in kernels/allocator.h); a recipe knows its bytes already.
  void check_memory() const {
    const bool outs = !outs_.empty();
    const int64_t need = recipe_ != nullptr ? (outs ? recipe_->bytes_with_out : recipe_->bytes)
                                            : batch_bytes(comms_, plan_, {items_.data(), items_.size()}, *steps_, outs);
    comms_.memory_gauge().check(need, comms_.allocator().get(), device(), comms_.rank(), [&] {
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
    return fits_dest(j, shape, dtype, need_contiguous) ? dests_[j] : alloc(shape, dtype);
  }
  bool fits_dest(size_t j, const Dims& shape, DType dtype, bool need_contiguous) const {
    if (j >= dests_.size()) return false;
    const Tensor& d = dests_[j];
    return d.defined() && d.dtype() == dtype && d.shape() == shape && (!need_contiguous || d.is_contiguous());
  }
  // The recipe's schedule, or (a batch, or a path the recipe did not expect) one computed now.
  std::shared_ptr<const StepSchedule> sched(size_t j, Path path, bool per_member = false) const {
    if (recipe_ != nullptr)
      if (const auto& s = recipe_->per_step[step_].by_path[static_cast<size_t>(path)]; s && (!per_member || s->per_member))
        return s;
    if (!rank_) rank_ = RankContext::of(comms_);
    return make_schedule(*rank_, items_[j].spec->shape, *before_, *after_, m_, path, sp().work, per_member);
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
  // A RaggedShard all-gather whose pieces are all this rank's size, of one flat tensor no other
  // mesh dim shards (FSDP's flat buffer): the pieces in member order ARE the result's equal
  // chunks, so it is the plain all_gather (one collective, no send_recv).
  bool equal_flat_ragged() const {
    const auto* rg = std::get_if<RaggedShard>(&(*before_)[m_]);
    if (rg == nullptr || items_.size() != 1 || items_[0].spec->shape.size() != 1 || !items_[0].local.is_contiguous())
      return false;
    for (int d = 0; d < static_cast<int>(before_->size()); ++d)
      if (d != m_ && !is_replicate((*before_)[d]) && !is_partial((*before_)[d])) return false;
    const std::vector<int64_t> b = ragged_boundaries(items_[0].spec->shape[0], rg->units, rg->align);
    for (size_t g = 0; g + 1 < b.size(); ++g)
      if (b[g + 1] - b[g] != items_[0].local.numel()) return false;
    return true;
  }

  TensorList run_step(const AllGather& s) {
    if (equal_flat_ragged()) {
      Tensor out = result(0, items_[0].spec->shape, sp().work, true);
      call(on(comm()).all_gather(items_[0].local, out));
      return {std::move(out)};
    }
    // A valid step that is not plain (a later mesh dim shards the dim too) gathers pieces that
    // are not the result's chunks in coordinate order: only the exchange places them.
    // Ragged pieces differ in size even when the result divides: the exact exchange.
    bool direct = s.tensor_dim == 0 && is_shard((*before_)[m_]) && plain_step();
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
    if (sp().wire != sp().work) return wire_all_reduce();
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
    const bool whole = single && ins[0].is_contiguous() && p.in == p.work;
    if (whole) {
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
    // Output: straight into the result when no cast or scale follows: the caller's out when it
    // fits, else in place when the input is the plan's (never the caller's input), else new;
    // otherwise one buffer (results are views of it, or casts).
    const bool into_out = single && p.out == p.work && p.post_scale == 1.0;
    Tensor direct;
    if (into_out)
      direct = !fits_dest(0, ins[0].shape(), p.out, true) && whole && owned(0) ? ins[0]
                                                                               : result(0, ins[0].shape(), p.out, true);
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

  // Per member g of the step's group: the elements of g's chunk over every tensor of the batch
  // (seg[g]), where they start in the packed send buffer (seg_off[g]), and the buffer's size.
  struct MemberSegments {
    std::vector<int64_t> seg, seg_off;
    int64_t total = 0;
  };
  MemberSegments member_segments(const std::vector<std::shared_ptr<const StepSchedule>>& sc) const {
    MemberSegments m{std::vector<int64_t>(k_, 0), std::vector<int64_t>(k_, 0), 0};
    for (const auto& s : sc) s->chunk_blocks.add_numels(m.seg);
    for (int64_t g = 0; g < k_; ++g) {
      m.seg_off[g] = m.total;
      m.total += m.seg[g];
    }
    return m;
  }
  // dest[seg_off[g]..] <- each tensor's block of member g's chunk, in batch order (cast fused).
  // REQUIRES: in a task; sc are per-member schedules.
  static void pack_members(const TensorList& ins, const std::vector<std::shared_ptr<const StepSchedule>>& sc,
                           const std::vector<int64_t>& seg, const std::vector<int64_t>& seg_off, Tensor dest) {
    for (size_t g = 0; g < seg.size(); ++g) {
      if (seg[g] == 0) continue;
      int64_t off = seg_off[g];
      for (size_t j = 0; j < ins.size(); ++j) {
        const Block b = sc[j]->chunk_blocks.at(static_cast<int64_t>(g));
        pack(ins[j], b, dest, off);
        off += b.numel();
      }
    }
  }
  // The batch's results from this rank's reduced chunk `mine` (post-scaled, cast fused).
  TensorList unpack_members(const Tensor& mine, const std::vector<std::shared_ptr<const StepSchedule>>& sc,
                            const ExecStep& p) {
    TensorList outs;
    for (size_t j = 0; j < items_.size(); ++j) outs.push_back(result(j, sc[j]->post_shape, p.out, false));
    local([=] {
      if (p.post_scale != 1.0) kernels::scale_(mine, p.post_scale);
      int64_t off = 0;
      for (size_t j = 0; j < outs.size(); ++j) {
        unpack(mine, off, outs[j], sc[j]->post_whole);
        off += sc[j]->post_whole.numel();
      }
    });
    return outs;
  }

  TensorList run_step(const ReduceScatter&) {
    if (sp().wire != sp().work) return wire_reduce_scatter();
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
    for (size_t j = 0; j < items_.size(); ++j)
      if (!sc[j]->per_member) sc[j] = sched(j, Path::kReduceScatter, /*per_member=*/true);
    const MemberSegments ms = member_segments(sc);
    const std::vector<int64_t>& seg = ms.seg, &seg_off = ms.seg_off;
    const int64_t total = ms.total;
    const bool even = std::all_of(seg.begin(), seg.end(), [&](int64_t n) { return n == seg[0]; });
    // Member chunks that are consecutive flat ranges of one contiguous input in the reduce dtype
    // (a ragged reduce-scatter, NOTE [ragged plans]): sent straight from it, nothing packed.
    bool in_place = items_.size() == 1 && ins[0].is_contiguous() && p.in == p.work;
    for (int64_t g = 0; g < k && in_place; ++g)
      in_place = seg[g] == 0 || flat_start(sc[0]->chunk_blocks.at(g), ins[0].shape()) == seg_off[g];
    Tensor send = in_place ? flat(ins[0]) : alloc({total}, p.work);
    if (!in_place) local([=] { pack_members(ins, sc, seg, seg_off, send); });
    // One flat tensor (a ragged reduce-scatter's 1-D view) whose result is contiguous in the work
    // dtype and apart from the input: reduced straight into the result, no copy after.
    Tensor direct;
    if (in_place && p.out == p.work && items_[0].spec->shape.size() == 1 && sc[0]->post_shape.product() == seg[r]) {
      Tensor o = result(0, sc[0]->post_shape, p.out, true);
      if (!o.shares_storage_with(ins[0])) direct = o;
    }
    Tensor mine = direct.defined() ? flat(direct) : alloc({seg[r]}, p.work);
    if (even) {
      call(c.reduce_scatter(send, mine, p.reduction));
    } else {
      // Uneven chunks: exchange exactly, then reduce in member order (no padding on the wire).
      TensorList got = send_pieces(c, send, seg, seg_off, {}, /*scaled=*/false, p.work);
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
    if (direct.defined()) {
      if (p.post_scale != 1.0) local([=] { kernels::scale_(mine, p.post_scale); });
      return {direct};
    }
    return unpack_members(mine, sc, p);
  }

  // ---- reductions through a wire dtype (NOTE [wire dtype] in executor.h) ----

  // acc = the sum in member order of the k wire pieces, each divided by its sender's scale, in
  // acc's dtype (the work dtype), with the reduction's pre-multiplier and avg: the arithmetic of
  // the uneven reduce-scatter. REQUIRES: in a task; pieces[g] holds acc.numel() wire elements.
  static void sum_pieces(const Tensor& acc, const TensorList& pieces, const std::vector<double>& unscale,
                         const Reduction& red) {
    const int64_t k = static_cast<int64_t>(pieces.size());
    if (acc.numel() == 0) return;
    const double m = red.pre_multiplier;
    Tensor(acc).copy_(pieces[0]);  // exact: the wire is narrower
    if (unscale[0] != 1.0) kernels::scale_(acc, unscale[0]);  // a power of two: exact
    if (m != 1.0) kernels::scale_(acc, m);
    Tensor tmp = Tensor::empty(acc.shape(), acc.dtype(), acc.device());
    for (int64_t g = 1; g < k; ++g) {
      tmp.copy_(pieces[g]);
      if (unscale[g] != 1.0) kernels::scale_(tmp, unscale[g]);
      kernels::reduce_into(acc, tmp, red.op, m);
    }
    if (red.op == ReduceOp::kAvg) kernels::scale_(acc, 1.0 / static_cast<double>(k));
  }
  // wire (contiguous) <- work-dtype data, scaled by this sender's power of two for an fp8 wire;
  // returns the scale. REQUIRES: in a task.
  static double to_wire(const Tensor& work, Tensor wire) {
    const double s = wire_scale(work, wire.dtype());
    if (s != 1.0) kernels::scale_(work, s);
    wire.copy_(work);
    return s;
  }
  // The scales travel as one f32 each, next to the payload (one more message per peer).
  static std::vector<double> read_scales(const TensorList& scales) {
    std::vector<double> out;
    for (const Tensor& t : scales) out.push_back(t.defined() ? 1.0 / t.to(kernels::Device{}).item({0}) : 1.0);
    return out;
  }
  Tensor scale_slot() const { return alloc({1}, DType::kF32); }
  // The step's input is wider than its work dtype (f64 reduced in f32): rounded to it first.
  static bool wider_than_work(const ExecStep& p) { return kernels::itemsize(p.in) > kernels::itemsize(p.work); }

  // One send_recv: piece g of `send` (n[g] elements at off[g], in the wire) to member g, and this
  // rank's piece (n[r] elements) from every other member into got[g]; with `scaled` each sender's
  // scale travels beside its piece (scales[g]). got[r] stays empty: the caller's own piece.
  TensorList send_pieces(Communicator& c, const Tensor& send, const std::vector<int64_t>& n,
                         const std::vector<int64_t>& off, const TensorList& scales, bool scaled, DType wire) {
    const int64_t k = k_, r = r_;
    TensorList got(k);
    std::vector<P2POp> ops;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      got[g] = alloc({n[r]}, wire);
      if (n[g] > 0) ops.push_back(P2POp::send(send.narrow(0, off[g], n[g]), static_cast<int>(g)));
      if (n[r] > 0) ops.push_back(P2POp::recv(got[g], static_cast<int>(g)));
      if (scaled) {
        ops.push_back(P2POp::send(scales[r], static_cast<int>(g)));
        ops.push_back(P2POp::recv(scales[g], static_cast<int>(g)));
      }
    }
    call(c.send_recv(ops));
    return got;
  }

  // P -> S/_S: every member's chunk, in the wire, goes to its member (one send_recv); each member
  // sums the k pieces of its chunk in the work dtype.
  TensorList wire_reduce_scatter() {
    const ExecStep p = sp();
    const int64_t k = k_, r = r_;
    const bool scaled = wire_scaled(p.wire);
    std::vector<std::shared_ptr<const StepSchedule>> sc;
    for (size_t j = 0; j < items_.size(); ++j) sc.push_back(sched(j, Path::kReduceScatter, /*per_member=*/true));
    TensorList ins;
    for (const Item& it : items_) ins.push_back(it.local);
    const MemberSegments ms = member_segments(sc);
    const std::vector<int64_t>& seg = ms.seg, &seg_off = ms.seg_off;
    const int64_t total = ms.total;
    Communicator& c = on(comm());
    // Staged in the work dtype when a scale is computed or the input is wider than the work dtype
    // (rounded to it first); otherwise packed straight into the wire (cast fused).
    const bool staged = scaled || wider_than_work(p);
    Tensor send = alloc({total}, p.wire), stage = staged ? alloc({total}, p.work) : send;
    TensorList scales(k);  // f32 [1] per member: the sender's scale (fp8 wires)
    if (scaled)
      for (int64_t g = 0; g < k; ++g) scales[g] = scale_slot();
    local([=] {
      pack_members(ins, sc, seg, seg_off, stage);
      if (!staged) return;
      const double s = to_wire(stage, send);
      if (scaled) Tensor(scales[r]).fill_(s);
    });
    TensorList got = send_pieces(c, send, seg, seg_off, scales, scaled, p.wire);
    Tensor mine = alloc({seg[r]}, p.work);
    const Reduction red = p.reduction;
    local([=]() mutable {
      got[r] = send.narrow(0, seg_off[r], seg[r]);
      sum_pieces(mine, got, read_scales(scales), red);
    });
    return unpack_members(mine, sc, p);
  }

  // P -> R: the tensors flattened into one buffer of N elements, cut into k chunks (the first
  // N % k members hold one element more); chunk g's pieces go to member g in the wire, g sums
  // them in the work dtype (post-scaled), rounds the sum to the wire once and sends it to every
  // member. So every member holds the same values: the sum rounded to the wire.
  TensorList wire_all_reduce() {
    const ExecStep p = sp();
    const int64_t k = k_, r = r_;
    const bool scaled = wire_scaled(p.wire);
    TensorList ins;
    int64_t n = 0;
    for (const Item& it : items_) {
      ins.push_back(it.local);
      n += it.local.numel();
    }
    std::vector<int64_t> cnt(k), off(k);
    for (int64_t g = 0, o = 0; g < k; ++g) {
      cnt[g] = n / k + (g < n % k ? 1 : 0);
      off[g] = o;
      o += cnt[g];
    }
    Communicator& c = on(comm());
    const bool staged = scaled || wider_than_work(p);  // as in wire_reduce_scatter
    Tensor send = alloc({n}, p.wire), gathered = alloc({n}, p.wire), stage = staged ? alloc({n}, p.work) : send;
    TensorList scales(k), sum_scales(k);  // the senders' scales of the two exchanges (fp8 wires)
    if (scaled)
      for (int64_t g = 0; g < k; ++g) {
        scales[g] = scale_slot();
        sum_scales[g] = scale_slot();
      }
    local([=] {
      int64_t o = 0;
      for (const Tensor& t : ins) {
        stage.narrow(0, o, t.numel()).view(t.shape()).copy_(t);  // cast fused
        o += t.numel();
      }
      if (!staged) return;
      const double s = to_wire(stage, send);
      if (scaled) Tensor(scales[r]).fill_(s);
    });
    TensorList got = send_pieces(c, send, cnt, off, scales, scaled, p.wire);
    Tensor acc = alloc({cnt[r]}, p.work);
    const Reduction red = p.reduction;
    const Tensor own = gathered.narrow(0, off[r], cnt[r]);
    local([=]() mutable {
      got[r] = send.narrow(0, off[r], cnt[r]);
      sum_pieces(acc, got, read_scales(scales), red);
      if (p.post_scale != 1.0) kernels::scale_(acc, p.post_scale);
      const double s = to_wire(acc, own);  // the one rounding of the sum to the wire
      if (scaled) Tensor(sum_scales[r]).fill_(s);
    });
    std::vector<P2POp> gather;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      if (cnt[r] > 0) gather.push_back(P2POp::send(own, static_cast<int>(g)));
      if (cnt[g] > 0) gather.push_back(P2POp::recv(gathered.narrow(0, off[g], cnt[g]), static_cast<int>(g)));
      if (scaled) {
        gather.push_back(P2POp::send(sum_scales[r], static_cast<int>(g)));
        gather.push_back(P2POp::recv(sum_scales[g], static_cast<int>(g)));
      }
    }
    call(c.send_recv(gather));
    TensorList outs;
    for (size_t j = 0; j < ins.size(); ++j) outs.push_back(result(j, ins[j].shape(), p.out, false));
    local([=] {
      Tensor full = gathered;
      if (scaled) {  // each member's chunk divided by its scale, in the work dtype (exact)
        full = Tensor::empty({n}, p.work, gathered.device());
        const std::vector<double> unscale = read_scales(sum_scales);
        for (int64_t g = 0; g < k; ++g) {
          Tensor part = full.narrow(0, off[g], cnt[g]);
          part.copy_(gathered.narrow(0, off[g], cnt[g]));
          if (unscale[g] != 1.0 && cnt[g] > 0) kernels::scale_(part, unscale[g]);
        }
      }
      int64_t o = 0;
      for (size_t j = 0; j < ins.size(); ++j) {
        Tensor(outs[j]).copy_(full.narrow(0, o, ins[j].numel()).view(ins[j].shape()));  // cast fused
        o += ins[j].numel();
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
      sc->for_each_message([&](const StepSchedule::Message& msg) {
        ops.push_back(msg.send ? P2POp::send(at(items_[j].local, msg.view), msg.peer)
                               : P2POp::recv(at(o, msg.view), msg.peer));
      });
    }
    call(on(comm()).send_recv(ops));
    return out;
  }

  // One tensor whose every piece is one flat range of the contiguous input and result (a ragged
  // all-gather or regroup, NOTE [ragged plans]): the pieces go straight from the input into the
  // result, nothing packed; nullopt when some piece is not one range.
  std::optional<TensorList> exchange_flat(const std::vector<std::shared_ptr<const StepSchedule>>& sc,
                                          const TensorList& ins, const TensorList& out,
                                          const std::vector<int64_t>& send_n, const std::vector<int64_t>& recv_n) {
    if (ins.size() != 1 || !ins[0].is_contiguous() || !out[0].is_contiguous() || ins[0].dtype() != out[0].dtype())
      return std::nullopt;
    const int64_t k = k_, r = r_;
    std::vector<int64_t> so(k, 0), ro(k, 0);
    for (int64_t g = 0; g < k; ++g) {
      so[g] = flat_start(sc[0]->send_blocks.at(g), ins[0].shape());
      ro[g] = flat_start(sc[0]->recv_blocks.at(g), out[0].shape());
      if (so[g] < 0 || ro[g] < 0) return std::nullopt;
    }
    const Tensor in = flat(ins[0]), o = flat(out[0]);
    std::vector<P2POp> ops;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      if (send_n[g] > 0) ops.push_back(P2POp::send(in.narrow(0, so[g], send_n[g]), static_cast<int>(g)));
      if (recv_n[g] > 0) ops.push_back(P2POp::recv(o.narrow(0, ro[g], recv_n[g]), static_cast<int>(g)));
    }
    Communicator& c = on(comm());
    const int64_t keep = send_n[r];
    if (keep > 0)  // what this rank keeps, from its place in the input to its place in the result
      local([src = in.narrow(0, so[r], keep), dst = o.narrow(0, ro[r], keep)]() mutable { dst.copy_(src); });
    call(c.send_recv(ops));
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
      sc.back()->send_blocks.add_numels(send_n);
      sc.back()->recv_blocks.add_numels(recv_n);
    }
    if (std::optional<TensorList> done = exchange_flat(sc, ins, out, send_n, recv_n)) return *done;
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
            const Block from = sc[j]->send_blocks.at(g);
            if (from.numel() == 0) continue;
            Tensor tmp = Tensor::empty({from.numel()}, ins[j].dtype(), ins[j].device());
            pack(ins[j], from, tmp, 0);
            unpack(tmp, 0, out[j], sc[j]->recv_blocks.at(g));
          }
          continue;
        }
        if (send_n[g] == 0) continue;
        int64_t off = 0;
        for (size_t j = 0; j < ins.size(); ++j) {
          const Block b = sc[j]->send_blocks.at(g);
          pack(ins[j], b, send_buf[g], off);
          off += b.numel();
        }
      }
    });
    call(c.send_recv(ops));
    local([=] {  // unpack
      for (int64_t g = 0; g < k; ++g) {
        if (g == r) continue;
        if (recv_n[g] == 0) continue;
        int64_t off = 0;
        for (size_t j = 0; j < out.size(); ++j) {
          const Block b = sc[j]->recv_blocks.at(g);
          unpack(recv_buf[g], off, out[j], b);
          off += b.numel();
        }
      }
    });
    return out;
  }

  const MeshComms& comms_;
  mutable std::optional<RankContext> rank_;  // for schedules computed at issue
  const Plan& plan_;
  const Recipe* recipe_ = nullptr;
  boost::container::small_vector<Item, 1> items_;
  bool background_ = false;
  TensorList outs_;
  TensorList inputs_;  // per item: the caller's input (never written)
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

}  // namespace

ExecHandle issue_items(const MeshComms& comms, const Plan& plan, std::span<const Item> items, TensorList outs,
                       const ReducePolicy& policy) {
  return Issuer(comms, plan, items, std::move(outs), policy).run();
}

ExecHandle issue_with_recipe(const MeshComms& comms, const Plan& plan, const Recipe& recipe, Item item, Tensor out,
                             bool background) {
  return Issuer(comms, plan, recipe, item, std::move(out), background).run();
}

}  // namespace dtensor
