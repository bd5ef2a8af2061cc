// fully_shard's internals: one parameter group's state and steps (Group), its parameters
// (Slot) and what the groups under one root share (Runtime). Included by fsdp/fully_shard.cpp
// and fsdp/contiguous.cpp only; not a public header.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/layout.h"
#include "fsdp/byte_pack.h"
#include "fsdp/contiguous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/offload.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/chunk_cat.h"
#include "kernels/ops/elementwise.h"
#include "kernels/storage.h"
#include "kernels/trace.h"

namespace fsdp {

using dtensor::DTensorSpec;
using dtensor::Placement;
using dtensor::Placements;
using kernels::Dims;
using kernels::InvalidArgument;
using kernels::Storage;
using kernels::Tensor;
using kernels::Unsupported;

inline Placements filled(int n, Placement p) { return Placements(static_cast<size_t>(n), p); }

inline std::shared_ptr<const dtensor::DeviceMesh> mesh_ptr(const std::shared_ptr<const MeshComms>& c) {
  return std::shared_ptr<const dtensor::DeviceMesh>(c, &c->mesh());
}

// The groups under one root share this: the forward order (for implicit prefetch), the
// reductions in flight (bounded: at most two reduce-scatter inputs alive) and the depth.
struct Runtime {
  Group* root = nullptr;
  std::vector<Group*> groups;
  std::vector<Group*> order;    // pre-forward order of the last complete forward
  std::vector<Group*> current;  // being recorded
  std::vector<Group*> pending;  // groups with a reduction in flight, oldest first
  int prefetch_depth = 1;
};

// One parameter of a group.
struct Slot {
  std::string name;
  std::shared_ptr<nn::Parameter> param;
  DTensorSpec unsharded_spec;  // on the full mesh, orig dtype (dp dims Replicate)
  DTensorSpec sharded_spec;
  Dims local_shape;   // the unsharded local (tensor-parallel) shape
  int shard_dim = 0;  // tensor dim split over the dp shard dim
  Dims padded_shape;  // local_shape with shard_dim -> ceil(n / dp)
  int64_t offset = 0, padded_numel = 0;
  std::vector<dtensor::Chunk> chunks;  // per dp shard coordinate
  std::optional<DTensor> sharded;      // view into the sharded flat buffer
  int64_t unsharded_offset = 0;        // in elements of the unsharded parameter storage
  // Contiguous layout: offset is the global flat offset (unsharded_offset the same), padded_numel
  // the parameter's numel; this rank's overlap with it is [local_begin, + local_numel) of its shard.
  int64_t local_begin = 0, local_numel = 0;
  DTensorSpec grad_spec;  // contiguous: its gradient buffer's spec (dp dims Partial, reduce dtype)
  Tensor accum;                        // no-sync: the unsharded gradient so far (reduce dtype)
  bool released = false;  // quantize_frozen: no master; its extension keeps its gathered inputs
};

class Group {
 public:
  enum class State { kSharded, kUnsharding, kUnsharded, kResharded };

  std::string name;
  std::vector<nn::Module*> modules;
  std::shared_ptr<const MeshComms> comms, dp_comms, k_comms;
  std::vector<int> dp_dims;  // mesh dims of the full mesh that are data parallel, ascending
  int shard_mesh_dim = 0;
  std::optional<int> rep_mesh_dim;
  int dp_index = 0;  // the shard dim's index in dp_comms' mesh
  int64_t dp = 1;
  int64_t my_coord = 0;
  FullyShardOptions opts;
  ReshardAfterForward reshard_mode;
  DType orig_dtype = DType::kF32, param_dtype = DType::kF32, reduce_dtype = DType::kF32;
  std::optional<DType> reduce_wire;  // MixedPrecisionPolicy::reduce_wire
  kernels::Device compute_device, storage_device;
  std::shared_ptr<kernels::Allocator> unsharded_alloc, buffer_alloc;
  std::vector<Slot> slots;
  int64_t slot_numel = 0;  // P: one rank's flat elements
  int64_t flat_numel = 0;  // the flat buffer's global elements (padded: dp * P)
  // Layout::kContiguous (fsdp/contiguous.h): the parameter-major layout and this rank's range;
  // unset: padded.
  std::optional<detail::ContiguousLayout> clayout;
  Tensor grad_in;           // contiguous: the flat input the gradients are written into (ensure_grad_in)
  bool grad_in_accumulating = false;  // it holds earlier no-sync microbatches' sums
  // The trainable prefix: parameters with requires_grad come first in the slots, so gradients
  // (reduce-scatter, sharded gradient buffer) cover only the first grad_numel of the P
  // elements; frozen parameters (QLoRA's base weights) send and keep no gradient bytes.
  int64_t grad_numel = 0;
  int64_t grad_flat_numel = 0;  // the gradient flat buffer's global elements (padded: dp * grad_numel)
  size_t grad_slots = 0;
  kernels::ChunkCatLayout grad_layout;
  kernels::ChunkCatLayout layout;  // the slots, rank-major: chunk_cat / split_copy copies
  int64_t unsharded_numel = 0;
  // With all-gather extensions: one ByteSlot per slot and the bytes of one rank's u8 buffer
  // (fsdp/byte_pack.h); empty otherwise.
  std::vector<detail::ByteSlot> bslots;
  int64_t rank_bytes = 0;
  std::optional<DTensor> sharded_flat;
  std::shared_ptr<Storage> flat_storage, param_storage;
  Tensor grad_flat;    // sharded gradients (orig dtype, storage device)
  Tensor partial_acc;  // HSDP without all-reduce: the [P,S(0)] partial sum so far
  State state = State::kSharded;
  std::optional<dtensor::RedistributeHandle> ag_handle;
  Tensor ag_input;
  std::optional<DTensor> k_buffer;
  struct Pending {
    dtensor::RedistributeHandle handle;
    Tensor input, out;
    bool to_partial = false;       // RS only (HSDP without all-reduce)
    bool all_reduce_after = false;  // add the partial sum, then all-reduce over the replicate dim
    bool into_grad = false;         // out is grad_flat itself
  };
  std::optional<Pending> pending;

  bool requires_gradient_sync = true, reshard_after_backward = true, requires_all_reduce = true;
  bool is_last_backward = true;
  double divide_factor = 1.0;
  bool has_sharded_grad = false;
  std::optional<std::vector<Group*>> fwd_prefetch, bwd_prefetch;
  size_t fwd_pre = 0, fwd_post = 0, bwd_pre = 0, bwd_post = 0;
  std::shared_ptr<Runtime> rt;
  GroupStats stats;
  std::string note;
  // Offload with copies on the copy stream (fsdp/offload.h); null: offload copies, if any, are
  // synchronous.
  std::unique_ptr<detail::OffloadCopies> offload;
  // Per-parameter meshes (fsdp/param_mesh.h): one follower per other mesh, registered on no
  // module; this group's unshard, reshard and gradient steps run theirs first.
  std::vector<std::shared_ptr<Group>> followers;
  bool is_follower = false;

  bool is_root() const { return rt && rt->root == this; }
  bool byte_mode() const { return !bslots.empty(); }
  bool hsdp() const { return rep_mesh_dim.has_value(); }
  int dp_ndim() const { return static_cast<int>(dp_dims.size()); }

  bool contiguous() const { return clayout.has_value(); }
  Placements flat_sharded_placements() const {
    Placements p = filled(dp_ndim(), dtensor::Replicate{});
    p[dp_index] = contiguous() ? clayout->flat_placement() : Placement{dtensor::Shard{0}};
    return p;
  }
  Placements grad_flat_sharded_placements() const {
    Placements p = filled(dp_ndim(), dtensor::Replicate{});
    p[dp_index] = contiguous() ? clayout->grad_flat_placement() : Placement{dtensor::Shard{0}};
    return p;
  }
  DTensorSpec flat_spec(const Placements& p, DType dtype) const {
    return dtensor::make_spec(mesh_ptr(dp_comms), p, Dims{flat_numel}, dtype);
  }
  DTensorSpec grad_flat_spec(const Placements& p, DType dtype) const {
    return dtensor::make_spec(mesh_ptr(dp_comms), p, Dims{grad_flat_numel}, dtype);
  }

  bool reshards_after_forward() const {
    switch (reshard_mode.kind) {
      case ReshardAfterForward::Kind::kAuto: return !is_root();
      case ReshardAfterForward::Kind::kTrue: return true;
      case ReshardAfterForward::Kind::kFalse: return false;
      case ReshardAfterForward::Kind::kInt: return true;
    }
    return true;
  }
  bool reshard_to_k() const { return reshard_mode.kind == ReshardAfterForward::Kind::kInt && k_comms; }

  // ---- storage ----
  Tensor flat_view() {
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
  void ensure_param_storage() {
    if (contiguous()) return;  // the parameters are views of the all-gather output
    if (!param_storage)
      param_storage = Storage::allocate(static_cast<size_t>(unsharded_numel) * kernels::itemsize(param_dtype),
                                        compute_device, unsharded_alloc);
    else
      param_storage->reallocate();
  }
  Tensor unsharded_local(const Slot& s) const {
    return Tensor::from_storage(contiguous() ? flat_storage : param_storage, param_dtype, s.local_shape, Tensor::contiguous_strides(s.local_shape),
                                s.unsharded_offset);
  }
  DTensor sharded_grad_view(const Slot& s) const {
    if (contiguous()) return DTensor(comms, s.sharded_spec, grad_flat.narrow(0, s.local_begin, s.local_numel));
    Tensor l = grad_flat.narrow(0, s.offset, s.padded_numel)
                   .view(s.padded_shape)
                   .narrow(s.shard_dim, 0, s.chunks[my_coord].size);
    return DTensor(comms, s.sharded_spec, l);
  }

  // ---- unshard / reshard ----
  // Every parameter materialised (nn::materialize, or a loader's to_empty): an unshard of a
  // group still (partly) meta is refused naming the parameter.
  void require_materialized() const {
    for (const Slot& s : slots)
      if (!s.sharded && !s.released)
        throw InvalidArgument(fmt::format(
            "FSDP group '{}': parameter '{}' is still meta: materialize the model (nn::materialize) or load its "
            "weights before forward",
            name, s.name));
  }

  // Where the sharded parameters and gradients live: pinned host memory under offload's copy
  // engine, else the mesh's allocator.
  std::shared_ptr<kernels::Allocator> state_alloc() const {
    std::shared_ptr<kernels::Allocator> a = offload ? offload->engine()->host_allocator() : nullptr;
    return a ? a : comms->allocator();
  }
  // Offload: the sharded parameters host -> device on the copy stream (issued ahead by
  // copy_ahead, or by the unshard itself), then the all-gather input in the parameter dtype.
  void start_copy_in() {
    for (auto& f : followers) f->start_copy_in();
    if (!offload || offload->has_copy_in() || byte_mode() || state != State::kSharded) return;
    for (const Slot& s : slots)
      if (!s.sharded) return;  // still meta: the unshard refuses
    const Tensor& local = flat_shard();
    offload->copy_in(Tensor::empty(local.shape(), orig_dtype, compute_device, buffer_alloc), local);
  }
  Tensor copied_in() {
    start_copy_in();
    Tensor t = offload->take_copy_in();
    if (t.dtype() == param_dtype) return t;
    Tensor c = Tensor::empty(t.shape(), param_dtype, compute_device, buffer_alloc);
    c.copy_(t);
    return c;
  }

  // The sharded flat buffer, allocated (zero: the padding stays zero) on first use.
  const Tensor& flat_shard() {
    if (!sharded_flat) {
      Tensor flat = Tensor::empty(Dims{slot_numel}, orig_dtype, storage_device, state_alloc());
      flat.fill_(0.0);
      sharded_flat = DTensor(dp_comms, flat_spec(flat_sharded_placements(), orig_dtype), flat);
    }
    return sharded_flat->to_local();
  }
  // Slot i's shard inside the flat buffer: [c.size] rows of its padded slot along the shard dim.
  Tensor shard_view(const Slot& s) {
    if (contiguous()) return flat_shard().narrow(0, s.local_begin, s.local_numel);
    const dtensor::Chunk& c = s.chunks[my_coord];
    return flat_shard().narrow(0, s.offset, s.padded_numel).view(s.padded_shape).narrow(s.shard_dim, 0, c.size);
  }
  // Where nn's materialize / to_empty write a meta parameter of this group: its view in the flat
  // buffer (which the first call allocates), from then on the sharded parameter.
  Tensor materialize_target(size_t i) {
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

  // The communicators' tracer (kernels/trace.h; null: not traced) and this rank's process in it.
  kernels::Tracer* tracer() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).tracer() : nullptr; }
  int trace_pid() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).global_rank() : 0; }

  void issue_unshard() {
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

  void wait_unshard() {
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

  void reshard() {
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

  void release_master(const Slot& s) const {
    s.param->release_data();
    s.param->set_placements(s.sharded_spec.placements);
    s.param->set_dtype(orig_dtype);
  }

  // fsdp::quantize_frozen: each frozen parameter whose extension keeps its inputs runs its
  // (collective) pre_all_gather once, then the flat buffer is re-laid out without it. Returns the
  // bytes released.
  int64_t quantize_frozen() {
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

  // reshard_after_forward = k: the k buffer's placements on k_comms, R but over the k ranks:
  // padded S(0) of the rank-major buffer, contiguous Rg(0,[1,...,1],align) of the parameter-major
  // one (a range of whole parameters' elements, like the dp shards).
  Placements k_placements() const {
    const int kn = k_comms->mesh().ndim();
    Placements to = filled(kn, dtensor::Replicate{});
    const int64_t k = k_comms->mesh().size(kn - 1);
    to[kn - 1] = contiguous() ? Placement{dtensor::RaggedShard{0, std::vector<int64_t>(static_cast<size_t>(k), 1), clayout->align}}
                              : Placement{dtensor::Shard{0}};
    return to;
  }
  // This rank's elements of the k buffer.
  int64_t k_numel() const {
    return dtensor::make_spec(mesh_ptr(k_comms), k_placements(), Dims{flat_numel}, param_dtype)
        .layout(k_comms->rank())
        ->local_shape.product();
  }
  // Post-forward with k: the unsharded flat buffer (padded: the parameters packed rank-major
  // first, the all-gather layout; contiguous: the all-gather output the parameters are views
  // of), viewed on (.., dp / k, k) and moved R -> S(0) / Rg over the k ranks (a local slice),
  // kept until backward.
  void reshard_to_k_buffer() {
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

  void prefetch(const std::vector<Group*>& targets) {
    for (Group* g : targets)
      if (g->state == State::kSharded || g->state == State::kResharded) {
        g->issue_unshard();
        ++g->stats.prefetches;
      }
  }
  // Offload: the copy-in of the group one past the implicit prefetch (NOTE [offload ordering]).
  void copy_ahead(bool forward) const {
    if (!rt) return;
    const auto& order = rt->order;
    auto it = std::find(order.begin(), order.end(), this);
    if (it == order.end()) return;
    const ptrdiff_t q = (it - order.begin()) + (forward ? 1 : -1) * (std::max(rt->prefetch_depth, 0) + 1);
    if (q >= 0 && q < static_cast<ptrdiff_t>(order.size())) order[q]->start_copy_in();
  }
  std::vector<Group*> implicit_targets(bool forward) const {
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

  // ---- gradients ----
  // A parameter frozen at fully_shard (after the trainable prefix) has no gradient storage.
  void check_frozen(size_t i) const {
    const Slot& s = slots[i];
    if (i >= grad_slots && (s.param->requires_grad || s.param->grad()))
      throw InvalidArgument(fmt::format(
          "FSDP group '{}': parameter '{}' was frozen (requires_grad false) at fully_shard but now {}; set "
          "requires_grad before fully_shard",
          name, s.name, s.param->grad() ? "holds a gradient" : "requires a gradient"));
  }
  void stash_grads() {
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
  // zero: false when a reduction writes every element next.
  void allocate_grad_flat(bool zero = true) {
    grad_flat = Tensor::empty(Dims{grad_numel}, orig_dtype, storage_device, state_alloc());
    if (zero) grad_flat.fill_(0.0);
  }
  // Drops the sharded gradients' flat buffer once no parameter holds a view of it (the
  // optimizer's zero_grad(set_to_none) released them): as in PyTorch, a step's forward and
  // backward do not carry the last step's gradients. The next reduction allocates it again.
  // Offloaded gradients (host memory, maybe pinned: slow to allocate) stay.
  void release_unused_grad_flat() {
    for (auto& f : followers) f->release_unused_grad_flat();
    if (!grad_flat.defined() || !(storage_device == compute_device)) return;
    for (const Slot& s : slots) {
      const auto& g = s.param->grad();
      if (g && g->to_local().shares_storage_with(grad_flat)) return;
    }
    grad_flat = Tensor();
    has_sharded_grad = false;
  }
  void install_grads() {
    for (size_t i = 0; i < grad_slots; ++i)
      if (slots[i].param->requires_grad) slots[i].param->grad() = sharded_grad_view(slots[i]);
  }

  // The unsharded gradient of s as the local tensor of its placements on the non-dp dims, dp
  // dims Partial (a Replicate dp dim counts on coordinate 0 only). Undefined when absent.
  Tensor take_grad(Slot& s) {
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

  // ---- gradients, contiguous layout (fsdp/contiguous.cpp) ----
  // Before backward: every trainable parameter's gradient buffer is its view of the flat
  // reduce-scatter input (Partial over dp), so backward writes the gradient there; the input is
  // allocated at the group's first gradient write.
  void set_grad_buffers();
  // The flat gradient input, allocated (after the reduction in flight finishes) if not yet.
  void ensure_grad_in();
  // Slot i's gradient: its view of grad_in, Partial over dp.
  DTensor grad_in_view(size_t i) const;
  // After backward: the flat input P -> the sharded gradients (or kept, without gradient sync).
  void post_backward_contiguous();

  void post_backward() {
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

  // The flat P input -> the sharded gradient flat buffer (or a temporary), asynchronously.
  void issue_reduce(const DTensor& flat_in, const Tensor& in) {
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

  // Finishes every reduction in flight on this tree, oldest first.
  void finish_pending_reductions() {
    while (!rt->pending.empty()) {
      Group* g = rt->pending.front();
      rt->pending.erase(rt->pending.begin());
      g->finish_reduce();
    }
  }
  void finish_reduce() {
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

  // ---- hooks ----
  void lazy_init();
  void on_pre_forward(nn::Ctx& ctx, DTensor& input);
  void on_post_forward(nn::Ctx& ctx, DTensor& output);
  void on_pre_backward(nn::Ctx& ctx, DTensor& grad_output);
  void on_post_backward(nn::Ctx& ctx, std::optional<DTensor>& grad_input);
  void finalize_backward();
};

// Layout::kContiguous at fully_shard: the group's slots re-laid out parameter-major
// (fsdp/contiguous.h), each sharded parameter Rg(0,[its overlaps],1) of its global shape.
void lay_out_contiguous(Group& g);

}  // namespace fsdp
