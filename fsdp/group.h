// fully_shard's internals: one parameter group's state and steps (Group), its parameters
// (Slot) and what the groups under one root share (Runtime). Included by fsdp/fully_shard.cpp
// and fsdp/contiguous.cpp only; not a public header. Longer method bodies: fsdp/group.cpp.
#pragma once

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
#include "kernels/ops/chunk_cat.h"
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

  bool reshards_after_forward() const;
  bool reshard_to_k() const { return reshard_mode.kind == ReshardAfterForward::Kind::kInt && k_comms; }

  // ---- storage ----
  Tensor flat_view();
  void ensure_param_storage();
  Tensor unsharded_local(const Slot& s) const {
    return Tensor::from_storage(contiguous() ? flat_storage : param_storage, param_dtype, s.local_shape, Tensor::contiguous_strides(s.local_shape),
                                s.unsharded_offset);
  }
  DTensor sharded_grad_view(const Slot& s) const;

  // ---- unshard / reshard ----
  // Every parameter materialised (nn::materialize, or a loader's to_empty): an unshard of a
  // group still (partly) meta is refused naming the parameter.
  void require_materialized() const;

  // Where the sharded parameters and gradients live: pinned host memory under offload's copy
  // engine, else the mesh's allocator.
  std::shared_ptr<kernels::Allocator> state_alloc() const {
    std::shared_ptr<kernels::Allocator> a = offload ? offload->engine()->host_allocator() : nullptr;
    return a ? a : comms->allocator();
  }
  // Offload: the sharded parameters host -> device on the copy stream (issued ahead by
  // copy_ahead, or by the unshard itself), then the all-gather input in the parameter dtype.
  void start_copy_in();
  Tensor copied_in();

  // The sharded flat buffer, allocated (zero: the padding stays zero) on first use.
  const Tensor& flat_shard();
  // Slot i's shard inside the flat buffer: [c.size] rows of its padded slot along the shard dim.
  Tensor shard_view(const Slot& s) {
    if (contiguous()) return flat_shard().narrow(0, s.local_begin, s.local_numel);
    const dtensor::Chunk& c = s.chunks[my_coord];
    return flat_shard().narrow(0, s.offset, s.padded_numel).view(s.padded_shape).narrow(s.shard_dim, 0, c.size);
  }
  // Where nn's materialize / to_empty write a meta parameter of this group: its view in the flat
  // buffer (which the first call allocates), from then on the sharded parameter.
  Tensor materialize_target(size_t i);

  // The communicators' tracer (kernels/trace.h; null: not traced) and this rank's process in it.
  kernels::Tracer* tracer() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).tracer() : nullptr; }
  int trace_pid() const { return dp_comms->mesh().ndim() > 0 ? dp_comms->dim(0).global_rank() : 0; }

  void issue_unshard();
  void wait_unshard();
  void reshard();

  void release_master(const Slot& s) const {
    s.param->release_data();
    s.param->set_placements(s.sharded_spec.placements);
    s.param->set_dtype(orig_dtype);
  }

  // fsdp::quantize_frozen: each frozen parameter whose extension keeps its inputs runs its
  // (collective) pre_all_gather once, then the flat buffer is re-laid out without it. Returns the
  // bytes released.
  int64_t quantize_frozen();

  // reshard_after_forward = k: the k buffer's placements on k_comms, R but over the k ranks:
  // padded S(0) of the rank-major buffer, contiguous Rg(0,[1,...,1],align) of the parameter-major
  // one (a range of whole parameters' elements, like the dp shards).
  Placements k_placements() const;
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
  void reshard_to_k_buffer();

  void prefetch(const std::vector<Group*>& targets);
  // Offload: the copy-in of the group one past the implicit prefetch (NOTE [offload ordering]).
  void copy_ahead(bool forward) const;
  std::vector<Group*> implicit_targets(bool forward) const;

  // ---- gradients ----
  // A parameter frozen at fully_shard (after the trainable prefix) has no gradient storage.
  void check_frozen(size_t i) const;
  void stash_grads();
  // zero: false when a reduction writes every element next.
  void allocate_grad_flat(bool zero = true) {
    grad_flat = Tensor::empty(Dims{grad_numel}, orig_dtype, storage_device, state_alloc());
    if (zero) grad_flat.fill_(0.0);
  }
  // Drops the sharded gradients' flat buffer once no parameter holds a view of it (the
  // optimizer's zero_grad(set_to_none) released them): as in PyTorch, a step's forward and
  // backward do not carry the last step's gradients. The next reduction allocates it again.
  // Offloaded gradients (host memory, maybe pinned: slow to allocate) stay.
  void release_unused_grad_flat();
  void install_grads() {
    for (size_t i = 0; i < grad_slots; ++i)
      if (slots[i].param->requires_grad) slots[i].param->grad() = sharded_grad_view(slots[i]);
  }

  // The unsharded gradient of s as the local tensor of its placements on the non-dp dims, dp
  // dims Partial (a Replicate dp dim counts on coordinate 0 only). Undefined when absent.
  Tensor take_grad(Slot& s);

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

  void post_backward();

  // The flat P input -> the sharded gradient flat buffer (or a temporary), asynchronously.
  void issue_reduce(const DTensor& flat_in, const Tensor& in);

  // Finishes every reduction in flight on this tree, oldest first.
  void finish_pending_reductions();
  void finish_reduce();

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
