#include "fsdp/group.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/format.h"
#include "kernels/ops/elementwise.h"

namespace fsdp {

bool Group::reshards_after_forward() const {
  switch (reshard_mode.kind) {
    case ReshardAfterForward::Kind::kAuto: return !is_root();
    case ReshardAfterForward::Kind::kTrue: return true;
    case ReshardAfterForward::Kind::kFalse: return false;
    case ReshardAfterForward::Kind::kInt: return true;
  }
  return true;
}

Tensor Group::flat_view() {
  if (byte_mode()) {
    if (!flat_storage) flat_storage = Storage::allocate(static_cast<size_t>(dp * rank_bytes), compute_device, unsharded_alloc);
    else flat_storage->reallocate();
    return Tensor::from_storage(flat_storage, DType::kU8, Dims{dp * rank_bytes},
                                Tensor::contiguous_strides(Dims{dp * rank_bytes}));
  }
  if (!flat_storage)
    flat_storage = Storage::allocate(static_cast<size_t>(flat_numel) * kernels::itemsize(param_dtype),
                                     compute_device, unsharded_alloc);
  else
    flat_storage->reallocate();
  return Tensor::from_storage(flat_storage, param_dtype, Dims{flat_numel}, Tensor::contiguous_strides(Dims{flat_numel}));
}

void Group::ensure_param_storage() {
  if (contiguous()) return;  // the parameters are views of the all-gather output
  if (!param_storage)
    param_storage = Storage::allocate(static_cast<size_t>(unsharded_numel) * kernels::itemsize(param_dtype),
                                      compute_device, unsharded_alloc);
  else
    param_storage->reallocate();
}

DTensor Group::sharded_grad_view(const Slot& s) const {
  if (contiguous()) return DTensor(comms, s.sharded_spec, grad_flat.narrow(0, s.local_begin, s.local_numel));
  Tensor l = grad_flat.narrow(0, s.offset, s.padded_numel)
                 .view(s.padded_shape)
                 .narrow(s.shard_dim, 0, s.chunks[my_coord].size);
  return DTensor(comms, s.sharded_spec, l);
}

void Group::require_materialized() const {
  for (const Slot& s : slots)
    if (!s.sharded && !s.released)
      throw InvalidArgument(fmt::format(
          "FSDP group '{}': parameter '{}' is still meta: materialize the model (nn::materialize) or load its "
          "weights before forward",
          name, s.name));
}

void Group::start_copy_in() {
  for (auto& f : followers) f->start_copy_in();
  if (!offload || offload->has_copy_in() || byte_mode() || state != State::kSharded) return;
  for (const Slot& s : slots)
    if (!s.sharded) return;  // still meta: the unshard refuses
  const Tensor& local = flat_shard();
  offload->copy_in(Tensor::empty(local.shape(), orig_dtype, compute_device, buffer_alloc), local);
}

Tensor Group::copied_in() {
  start_copy_in();
  Tensor t = offload->take_copy_in();
  if (t.dtype() == param_dtype) return t;
  Tensor c = Tensor::empty(t.shape(), param_dtype, compute_device, buffer_alloc);
  c.copy_(t);
  return c;
}

const Tensor& Group::flat_shard() {
  if (!sharded_flat) {
    Tensor flat = Tensor::empty(Dims{slot_numel}, orig_dtype, storage_device, state_alloc());
    flat.fill_(0.0);
    sharded_flat = DTensor(dp_comms, flat_spec(flat_sharded_placements(), orig_dtype), flat);
  }
  return sharded_flat->to_local();
}

Tensor Group::materialize_target(size_t i) {
  if (state != State::kSharded)
    throw InvalidArgument(fmt::format("FSDP group '{}': parameter '{}' materialised while the group is unsharded",
                                      name, slots[i].name));
  Slot& s = slots[i];
  if (s.released)
    throw InvalidArgument(fmt::format("FSDP group '{}': parameter '{}' is stored as its all-gather extension's codes "
                                      "(fsdp::quantize_frozen): its master is gone; load the codes instead",
                                      name, s.name));
  Tensor view = shard_view(s);
  s.sharded = DTensor(comms, s.sharded_spec, view);
  return view;
}

void Group::issue_unshard() {
  for (auto& f : followers) f->issue_unshard();
  if (state == State::kUnsharding || state == State::kUnsharded) return;
  if (state == State::kSharded) require_materialized();
  Tensor out = flat_view();
  if (state == State::kResharded) {
    stats.all_gather_bytes += k_buffer->plan_to(filled(k_comms->mesh().ndim(), dtensor::Replicate{})).bytes_per_rank();
    ag_handle = dtensor::redistribute_async(*k_buffer, filled(k_comms->mesh().ndim(), dtensor::Replicate{}), {}, out);
  } else {
    // Copy-in: the shard on the compute device, in the parameter dtype (so the all-gather
    // moves param_dtype bytes; FSDP2 casts before communicating).
    const Tensor& local = flat_shard();
    DTensor src = *sharded_flat;
    if (byte_mode()) {
      // Every slot's gathered pieces (extensions' or the plain cast shard) packed by bytes.
      ag_input = Tensor::empty(Dims{rank_bytes}, DType::kU8, compute_device, buffer_alloc);
      ag_input.fill_(0.0);
      std::vector<Tensor> padded;
      padded.reserve(slots.size());
      for (const Slot& s : slots)
        padded.push_back(s.released ? Tensor() : local.narrow(0, s.offset, s.padded_numel).view(s.padded_shape));
      const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP copy-in (extensions)");
      stats.extension_bytes += detail::pack(bslots, padded, ag_input);
      stats.copy_bytes += rank_bytes;
      src = DTensor(dp_comms,
                    dtensor::make_spec(mesh_ptr(dp_comms), flat_sharded_placements(), Dims{dp * rank_bytes}, DType::kU8),
                    ag_input);
    } else if (offload) {
      ag_input = copied_in();
      if (param_dtype != orig_dtype) stats.copy_bytes += static_cast<int64_t>(ag_input.nbytes());
      src = DTensor(dp_comms, flat_spec(flat_sharded_placements(), param_dtype), ag_input);
    } else if (local.dtype() != param_dtype || local.device() != compute_device) {
      ag_input = Tensor::empty(local.shape(), param_dtype, compute_device, buffer_alloc);
      const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP copy-in");
      if (local.device() == compute_device)
        kernels::chunk_cat(ag_input, {local}, kernels::ChunkCatLayout({local.shape()}, 1), opts.copy_threads);
      else
        ag_input.copy_(local);  // offload: host -> device (and cast)
      if (param_dtype != orig_dtype) stats.copy_bytes += static_cast<int64_t>(ag_input.nbytes());
      src = DTensor(dp_comms, flat_spec(flat_sharded_placements(), param_dtype), ag_input);
    }
    stats.all_gather_bytes += src.plan_to(filled(dp_ndim(), dtensor::Replicate{})).bytes_per_rank();
    ag_handle = dtensor::redistribute_async(src, filled(dp_ndim(), dtensor::Replicate{}), {}, out);
  }
  ++stats.all_gathers;
  state = State::kUnsharding;
}

void Group::wait_unshard() {
  for (auto& f : followers) f->wait_unshard();
  if (state == State::kUnsharded) return;
  issue_unshard();
  std::optional<kernels::TraceSpan> span(std::in_place, tracer(), trace_pid(), "waits", "FSDP unshard wait");
  DTensor full = ag_handle->wait();
  if (contiguous()) span.reset();
  else span.emplace(tracer(), trace_pid(), "copies", "FSDP copy-out");
  ag_handle.reset();
  ag_input = Tensor();
  k_buffer.reset();
  if (!contiguous()) {  // contiguous: the parameters are views of `full`, nothing to copy
    const Tensor flat = full.to_local();
    ensure_param_storage();
    // Split-copy: every rank's piece of every parameter into its unsharded tensor, one pass.
    std::vector<Tensor> outs;
    outs.reserve(slots.size());
    for (const Slot& s : slots) outs.push_back(unsharded_local(s));
    if (byte_mode()) detail::unpack(bslots, flat, rank_bytes, dp, param_dtype, outs, buffer_alloc);
    else kernels::split_copy(outs, flat, layout, opts.copy_threads);
    stats.copy_bytes += unsharded_numel * static_cast<int64_t>(kernels::itemsize(param_dtype));
    span.reset();
    flat_storage->free();
  }
  for (const Slot& s : slots) {
    DTensorSpec spec = s.unsharded_spec;
    spec.dtype = param_dtype;
    s.param->set_data(DTensor(comms, spec, unsharded_local(s)));
  }
  state = State::kUnsharded;
}

void Group::reshard() {
  for (auto& f : followers) f->reshard();
  if (state == State::kUnsharding) {  // a prefetch nobody used
    ag_handle->wait();
    ag_handle.reset();
    ag_input = Tensor();
  }
  if (offload) offload->drop_copy_in();
  for (const Slot& s : slots) {
    if (s.sharded) s.param->set_data(*s.sharded);
    if (s.released) release_master(s);
  }
  if (param_storage) param_storage->free();
  if (flat_storage) flat_storage->free();
  k_buffer.reset();
  state = State::kSharded;
}

int64_t Group::quantize_frozen() {
  std::vector<size_t> drop;
  for (size_t i = 0; i < bslots.size(); ++i)
    if (!slots[i].released && bslots[i].ext && bslots[i].ext->keeps_inputs() && !slots[i].param->requires_grad)
      drop.push_back(i);
  if (drop.empty()) return 0;
  if (state != State::kSharded)
    throw InvalidArgument(fmt::format("fsdp::quantize_frozen: group '{}' is unsharded; call it between steps", name));
  require_materialized();
  const Tensor old = flat_shard();
  for (size_t i : drop) {
    const Slot& s = slots[i];
    stats.extension_bytes += bslots[i].ext->pre_all_gather(old.narrow(0, s.offset, s.padded_numel).view(s.padded_shape),
                                                           bslots[i].ctx).communicated_bytes;
  }
  for (size_t i : drop) {
    slots[i].released = true;
    slots[i].sharded.reset();
    release_master(slots[i]);
  }
  int64_t kept = 0;
  for (const Slot& s : slots) kept += s.released ? 0 : s.padded_numel;
  Tensor flat = Tensor::empty(Dims{kept}, orig_dtype, storage_device, state_alloc());
  int64_t off = 0;
  for (Slot& s : slots) {
    if (s.released) continue;
    flat.narrow(0, off, s.padded_numel).copy_(old.narrow(0, s.offset, s.padded_numel));
    s.offset = off;
    off += s.padded_numel;
  }
  const int64_t released = (slot_numel - kept) * static_cast<int64_t>(kernels::itemsize(orig_dtype));
  slot_numel = kept;
  flat_numel = dp * kept;
  sharded_flat = DTensor(dp_comms, flat_spec(flat_sharded_placements(), orig_dtype), flat);
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (s.released || !s.sharded) continue;
    s.sharded = DTensor(comms, s.sharded_spec, shard_view(s));
    s.param->set_data(*s.sharded);
  }
  return released;
}

Placements Group::k_placements() const {
  const int kn = k_comms->mesh().ndim();
  Placements to = filled(kn, dtensor::Replicate{});
  const int64_t k = k_comms->mesh().size(kn - 1);
  to[kn - 1] = contiguous() ? Placement{dtensor::RaggedShard{0, std::vector<int64_t>(static_cast<size_t>(k), 1), clayout->align}}
                            : Placement{dtensor::Shard{0}};
  return to;
}

void Group::reshard_to_k_buffer() {
  const Tensor flat = flat_view();
  if (!contiguous()) {
    std::vector<Tensor> ins;
    ins.reserve(slots.size());
    for (const Slot& s : slots) ins.push_back(unsharded_local(s));
    kernels::chunk_cat(flat, ins, layout, opts.copy_threads);
  }
  DTensor whole(dp_comms, flat_spec(filled(dp_ndim(), dtensor::Replicate{}), param_dtype), flat);
  const int kn = k_comms->mesh().ndim();
  DTensor on_k = whole.view_on(k_comms, filled(kn, dtensor::Replicate{}));
  Tensor out = Tensor::empty(Dims{k_numel()}, param_dtype, compute_device, unsharded_alloc);
  DTensor kept = on_k.redistribute(k_placements(), out);
  reshard();
  k_buffer = kept;
  state = State::kResharded;
}

void Group::prefetch(const std::vector<Group*>& targets) {
  for (Group* g : targets)
    if (g->state == State::kSharded || g->state == State::kResharded) {
      g->issue_unshard();
      ++g->stats.prefetches;
    }
}

void Group::copy_ahead(bool forward) const {
  if (!rt) return;
  const auto& order = rt->order;
  auto it = std::find(order.begin(), order.end(), this);
  if (it == order.end()) return;
  const ptrdiff_t q = (it - order.begin()) + (forward ? 1 : -1) * (std::max(rt->prefetch_depth, 0) + 1);
  if (q >= 0 && q < static_cast<ptrdiff_t>(order.size())) order[q]->start_copy_in();
}

std::vector<Group*> Group::implicit_targets(bool forward) const {
  std::vector<Group*> out;
  if (!rt || rt->prefetch_depth <= 0) return out;
  const auto& order = rt->order;
  auto it = std::find(order.begin(), order.end(), this);
  if (it == order.end()) return out;
  const ptrdiff_t pos = it - order.begin();
  for (int i = 1; i <= rt->prefetch_depth; ++i) {
    const ptrdiff_t q = forward ? pos + i : pos - i;
    if (q < 0 || q >= static_cast<ptrdiff_t>(order.size())) break;
    out.push_back(order[q]);
  }
  return out;
}

void Group::check_frozen(size_t i) const {
  const Slot& s = slots[i];
  if (i >= grad_slots && (s.param->requires_grad || s.param->grad()))
    throw InvalidArgument(fmt::format(
        "FSDP group '{}': parameter '{}' was frozen (requires_grad false) at fully_shard but now {}; set "
        "requires_grad before fully_shard",
        name, s.name, s.param->grad() ? "holds a gradient" : "requires a gradient"));
}

void Group::stash_grads() {
  for (auto& f : followers) f->stash_grads();
  has_sharded_grad = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    check_frozen(i);
    Slot& s = slots[i];
    auto& g = s.param->grad();
    if (!g) continue;
    if (!grad_flat.defined()) allocate_grad_flat();
    DTensor view = sharded_grad_view(s);
    if (g->to_local().data_ptr() != view.to_local().data_ptr() || !(g->placements() == s.sharded_spec.placements)) {
      if (!(g->placements() == s.sharded_spec.placements) || !(g->shape() == s.sharded_spec.shape))
        throw InvalidArgument(fmt::format(
            "FSDP group '{}': parameter '{}' holds a gradient with placements {} before backward; expected "
            "its sharded placements {} (or none)",
            name, s.name, dtensor::to_string(g->placements()), dtensor::to_string(s.sharded_spec.placements)));
      Tensor v = view.to_local();
      v.copy_(g->to_local());
    }
    has_sharded_grad = true;
    g.reset();
  }
}

void Group::release_unused_grad_flat() {
  for (auto& f : followers) f->release_unused_grad_flat();
  if (!grad_flat.defined() || !(storage_device == compute_device)) return;
  for (const Slot& s : slots) {
    const auto& g = s.param->grad();
    if (g && g->to_local().shares_storage_with(grad_flat)) return;
  }
  grad_flat = Tensor();
  has_sharded_grad = false;
}

Tensor Group::take_grad(Slot& s) {
  auto& g = s.param->grad();
  if (!g) return Tensor();
  DTensor gd = *g;
  g.reset();
  Placements want = gd.placements();
  bool move = false, zero = false;
  for (int m = 0; m < static_cast<int>(want.size()); ++m) {
    const bool is_dp = std::find(dp_dims.begin(), dp_dims.end(), m) != dp_dims.end();
    if (is_dp) {
      if (dtensor::is_replicate(want[m])) {
        if (comms->coord()[m] != 0) zero = true;
      } else if (!dtensor::is_partial(want[m])) {
        throw InvalidArgument(fmt::format(
            "FSDP group '{}': the gradient of '{}' is {} on data-parallel mesh dim {}; expected Partial "
            "(the batch split over dp) or Replicate",
            name, s.name, dtensor::to_string(want[m]), m));
      }
    } else if (!(want[m] == s.unsharded_spec.placements[m])) {
      want[m] = s.unsharded_spec.placements[m];
      move = true;
    }
  }
  if (move) gd = gd.redistribute(want);  // e.g. a sequence-parallel norm's P on tp -> R
  Tensor l = gd.to_local();
  if (zero) {
    Tensor z = Tensor::empty(l.shape(), l.dtype(), l.device());
    z.fill_(0.0);
    return z;
  }
  return l;
}

void Group::post_backward() {
  if (contiguous()) {
    post_backward_contiguous();
    return;
  }
  std::vector<Tensor> grads(slots.size());
  // Whether to reduce is decided by requires_grad (the same on every rank), never by which
  // gradients this rank happens to hold: a rank without one contributes zeros.
  bool any = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    check_frozen(i);
    grads[i] = take_grad(slots[i]);
    any = any || slots[i].param->requires_grad;
  }
  if (!requires_gradient_sync) {
    // No sync: unsharded gradients accumulate (in the reduce dtype) until a synchronising
    // backward reduces their sum once.
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!grads[i].defined()) continue;
      Slot& s = slots[i];
      if (!s.accum.defined()) {
        s.accum = Tensor::empty(s.local_shape, reduce_dtype, compute_device, buffer_alloc);
        s.accum.copy_(grads[i]);
      } else {
        kernels::add_out(s.accum, s.accum, grads[i].dtype() == reduce_dtype ? grads[i] : grads[i].to(reduce_dtype));
      }
    }
    if (has_sharded_grad) install_grads();
    if (reshard_after_backward) reshard();
    return;
  }
  if (!any) {
    if (has_sharded_grad) install_grads();
    reshard();  // a synchronising backward: the optimizer steps the sharded parameters next
    return;
  }
  // Keep at most two reduce-scatter inputs alive: finish the older reductions first (a
  // follower leaves that to its leader, which just did it: its own reduction overlaps too).
  if (rt && !is_follower)
    finish_pending_reductions();
  // Chunk-cat copy-in: one pass over every gradient and rank, the cast to the reduce dtype
  // and the zero padding (and zeros for a gradient this rank lacks) fused into it.
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (!s.accum.defined()) continue;
    Tensor& g = grads[i];
    if (g.defined()) kernels::add_out(s.accum, s.accum, g.dtype() == reduce_dtype ? g : g.to(reduce_dtype));
    g = s.accum;
    s.accum = Tensor();
  }
  for (size_t i = 0; i < slots.size(); ++i)
    if (grads[i].defined() && !(grads[i].shape() == slots[i].local_shape))
      throw InvalidArgument(fmt::format("FSDP group '{}': the gradient of '{}' has local shape {}, expected {}", name,
                                        slots[i].name, kernels::to_string(grads[i].shape()),
                                        kernels::to_string(slots[i].local_shape)));
  // Resharded before the copy-in, as FSDP2 does: the unsharded parameters are not alive
  // beside both the gradients and the reduce-scatter input.
  reshard();  // a synchronising backward: the optimizer steps the sharded parameters next
  Tensor in = Tensor::empty(Dims{dp * grad_numel}, reduce_dtype, compute_device, buffer_alloc);
  grads.resize(grad_slots);  // the frozen slots (after the prefix) hold no gradient
  {
    const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP gradient copy-in");
    kernels::chunk_cat(in, grads, grad_layout, opts.copy_threads);
    stats.copy_bytes += static_cast<int64_t>(in.nbytes());
  }
  grads.clear();
  DTensor flat_in(dp_comms, grad_flat_spec(filled(dp_ndim(), dtensor::Partial{}), reduce_dtype), in);
  issue_reduce(flat_in, in);
}

void Group::issue_reduce(const DTensor& flat_in, const Tensor& in) {
  Pending p;
  p.to_partial = hsdp() && !requires_all_reduce;
  p.all_reduce_after = hsdp() && requires_all_reduce && partial_acc.defined();
  Placements target = grad_flat_sharded_placements();
  if (p.to_partial || p.all_reduce_after) {
    for (int m = 0; m < dp_ndim(); ++m)
      if (m != dp_index) target[m] = dtensor::Partial{};
  }
  dtensor::RedistributeOptions ro;
  ro.reduce_dtype = reduce_dtype;
  ro.divide_factor = divide_factor;
  ro.wire_dtype = reduce_wire;
  p.into_grad = !has_sharded_grad && !p.to_partial && !p.all_reduce_after && storage_device == compute_device && !offload;
  if (p.into_grad) {
    if (!grad_flat.defined()) allocate_grad_flat(/*zero=*/false);
    p.out = grad_flat;
  } else {
    p.out = Tensor::empty(Dims{grad_numel}, reduce_dtype, compute_device, buffer_alloc);
  }
  p.input = in;
  p.handle = dtensor::redistribute_async(flat_in, target, ro, p.out);
  stats.reduce_bytes += flat_in.plan_to(target, ro).bytes_per_rank();
  ++stats.reduce_scatters;
  if (hsdp() && !p.to_partial && !p.all_reduce_after) ++stats.all_reduces;
  pending = std::move(p);
  if (rt) rt->pending.push_back(this);
}

void Group::finish_pending_reductions() {
  while (!rt->pending.empty()) {
    Group* g = rt->pending.front();
    rt->pending.erase(rt->pending.begin());
    g->finish_reduce();
  }
}

void Group::finish_reduce() {
  if (!pending) return;
  Pending p = std::move(*pending);
  pending.reset();
  {
    const kernels::TraceSpan span(tracer(), trace_pid(), "waits", "FSDP reduce-scatter wait");
    p.handle.wait();
  }
  p.input = Tensor();
  if (p.to_partial) {
    if (!partial_acc.defined()) partial_acc = p.out;
    else kernels::add_out(partial_acc, partial_acc, p.out);
    if (has_sharded_grad) install_grads();
    return;
  }
  Tensor result = p.out;
  if (p.all_reduce_after) {
    kernels::add_out(result, result, partial_acc);
    partial_acc = Tensor();
    Placements from = grad_flat_sharded_placements();
    for (int m = 0; m < dp_ndim(); ++m)
      if (m != dp_index) from[m] = dtensor::Partial{};
    DTensor part(dp_comms, grad_flat_spec(from, reduce_dtype), result);
    dtensor::RedistributeOptions ro;
    ro.reduce_dtype = reduce_dtype;
    ro.wire_dtype = reduce_wire;
    result = part.redistribute(grad_flat_sharded_placements(), ro).to_local();
    stats.reduce_bytes += part.plan_to(grad_flat_sharded_placements(), ro).bytes_per_rank();
    ++stats.all_reduces;
  }
  if (!p.into_grad) {
    if (!grad_flat.defined()) allocate_grad_flat();
    if (has_sharded_grad) {
      Tensor r = result;
      if (r.dtype() != orig_dtype || r.device() != storage_device) {
        Tensor c = Tensor::empty(r.shape(), orig_dtype, storage_device);
        c.copy_(r);
        r = c;
      }
      kernels::add_out(grad_flat, grad_flat, r);
    } else if (offload) {  // the cast on the device, the move on the copy stream
      Tensor r = result;
      if (r.dtype() != orig_dtype) {
        r = Tensor::empty(result.shape(), orig_dtype, compute_device, buffer_alloc);
        r.copy_(result);
      }
      offload->copy_out(grad_flat, r);
    } else {
      grad_flat.copy_(result);  // cast and device move (offload: to the CPU)
      if (result.dtype() != orig_dtype) stats.copy_bytes += static_cast<int64_t>(grad_flat.nbytes());
    }
  }
  has_sharded_grad = true;
  install_grads();
}

}  // namespace fsdp
