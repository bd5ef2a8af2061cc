// fully_shard: FSDP, HSDP and FSDP x TP over nn modules, as DTensor placement transitions
// (docs/architecture.md section 4; PyTorch FSDP2's fully_shard, docs/pytorch-semantics.md
// section 7).
//
//   // mesh (dp_shard=4), or (dp_replicate=2, dp_shard=2) for HSDP, or (dp_shard, tp) after
//   // parallelize_module(model, /*tp mesh dim=*/1, plan): the model's parameters live on this
//   // mesh, Replicate over the data-parallel dims.
//   for (auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms);
//   fsdp::FSDPModule& root = fsdp::fully_shard(model, comms);      // bottom-up; root last
//   nn::AdamW opt(model.named_parameters(), {...});                  // sees the sharded parameters
//   DTensor logits = model.forward(ctx, ids);   // ids sharded S(0) over the dp dims
//   model.backward(ctx, dlogits);               // gradients arrive sharded, reduced
//   opt.step();
//
// Each call owns one parameter group: every parameter of the module(s) not owned by an earlier
// (nested) call. In placement terms, per group:
//   sharded parameter  = the unsharded placements with the dp placements set: Shard(d) on the
//                        dp shard dim (StridedShard(0, k) when later mesh dims also split dim 0),
//                        Replicate on the replicate dim; a view into one flat, padded buffer that
//                        is itself a DTensor [S(0)] (HSDP: [R,S(0)]) on the dp sub-mesh;
//   unshard            = that buffer S(0) -> R into the group's unsharded storage (freed and
//                        re-allocated in place), then a split-copy into the parameters;
//   gradient sync      = the gradients chunk-cat into a flat P buffer (cast to reduce_dtype),
//                        P -> S(0) (HSDP: [P,P] -> [R,S(0)]) with the precision policy;
//   reshard_after_forward = k: the unsharded buffer viewed on the dp sub-mesh unflattened to
//                        (.., dp_shard / k, k) and moved R -> S(0) over the last dim.
// That is the default, padded layout; Layout::kContiguous (below) makes the flat buffer
// parameter-major and RaggedShard, so unshard and gradient sync copy nothing.
// fsdp/ issues no collective itself: every byte moves through dtensor redistribute.
//
// Gradients: the model's loss is a DTensor (the global mean over the dp-sharded batch), so its
// parameter gradients are Partial(sum) of the true gradient; the reduction is a plain sum
// (divide factor 1; FSDP2's 1/N average of per-rank means is the same number).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/mesh_comms.h"
#include "fsdp/all_gather_extension.h"
#include "kernels/allocator.h"
#include "nn/module.h"

namespace fsdp {

using dtensor::DTensor;
using dtensor::MeshComms;
using kernels::DType;

// FSDP2's MixedPrecisionPolicy: the unsharded parameters (and so the all-gather) in
// param_dtype, gradients reduced in reduce_dtype, floating outputs cast to output_dtype,
// floating inputs cast to param_dtype. The optimizer sees the sharded parameters in their
// original dtype (the master weights).
// reduce_wire: what the gradient reductions (the reduce-scatter, HSDP's all-reduce) move when it
// is narrower than reduce_dtype, e.g. bf16 or f8e5m2 with reduce_dtype f32: summed locally in
// reduce_dtype (NOTE [wire dtype] in dtensor/exec/executor.h). fully_shard refuses a wire that is
// not a floating dtype narrower than the reduce dtype.
struct MixedPrecisionPolicy {
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  std::optional<DType> reduce_wire;
  std::optional<DType> output_dtype;
  bool cast_forward_inputs = true;
};

// FSDP2's CPUOffloadPolicy: sharded parameters, gradients (and so the optimizer state) live on
// the CPU; each unshard copies the shard to the compute device first and each reduction copies
// the sharded gradient back.
// pin_memory (on a CUDA compute device): the sharded parameters and gradients in pinned host
// memory, the copies issued ahead on the device's copy stream so they overlap compute
// (fsdp/offload.h, NOTE [offload ordering]). On a CPU compute device it is a no-op that
// FSDPModule::note() says once: the two memories are one. copy_engine: tests only, an engine for
// the copies to use instead (also on the CPU); null: the default.
class CopyEngine;
struct OffloadPolicy {
  bool offload_to_cpu = false;
  bool pin_memory = true;
  std::shared_ptr<CopyEngine> copy_engine;
};

// True / False / int k / automatic (FSDP2's None: the root keeps its parameters, other groups
// reshard). k must divide the dp shard size; 1 means false and the shard size true.
struct ReshardAfterForward {
  enum class Kind { kAuto, kTrue, kFalse, kInt };
  Kind kind = Kind::kAuto;
  int k = 0;
  static ReshardAfterForward automatic() { return {}; }
  static ReshardAfterForward yes() { return {Kind::kTrue, 0}; }
  static ReshardAfterForward no() { return {Kind::kFalse, 0}; }
  static ReshardAfterForward to(int k) { return {Kind::kInt, k}; }
};

// Which mesh dims of the parameters' mesh are data parallel. Unset: the dims named
// "dp_replicate" / "dp_shard" when the mesh has them; otherwise a 1-D mesh is FSDP over dim 0 and
// a 2-D mesh HSDP (replicate 0, shard 1). Other mesh dims (tp) keep their placements.
struct DataParallelMeshDims {
  std::optional<int> replicate;
  int shard = 0;
};

// Per parameter (its name relative to the module given to fully_shard): the tensor dim to shard
// over dp, or nullopt for dim 0 (FSDP2's shard_placement_fn returning Shard(d) / None). A dim
// > 0 must divide evenly by the dp shard size.
using ShardPlacementFn = std::function<std::optional<int>(const std::string& name, const nn::Parameter&)>;

// Per-parameter meshes (expert parallelism carved from dp; torchtitan's dense parameters FSDP
// over dp_shard, experts FSDP over dp_shard / ep): a parameter that lives on another mesh than
// the one given to fully_shard names it here, with that mesh's data-parallel dims. The group
// keeps one flat buffer per mesh (fsdp/param_mesh.h): per mesh one all-gather per unshard and
// one gradient reduction per backward, issued together; every FSDPModule setting applies to all.
// Dims of that mesh outside mesh_dims (ep) keep the parameter's placements, like tp.
//   // world mesh (dp_shard=4); experts on its unflattening (dp_mod_ep=2, ep=2), S(0) over ep:
//   auto ep_comms = comms->unflatten(0, {2, 2}, {"dp_mod_ep", "ep"});  // requested at creation
//   moe.set_expert_parallel(ep_comms, /*ep mesh dim=*/1);             // meta: rehomes w1, w2
//   fsdp::FullyShardOptions o;
//   o.mesh_fn = [&](const std::string& name, const nn::Parameter& p) -> std::optional<fsdp::ParamMesh> {
//     if (p.comms() != ep_comms) return std::nullopt;   // dense: the group's mesh (dp_shard)
//     return fsdp::ParamMesh{ep_comms, fsdp::DataParallelMeshDims{std::nullopt, 0}};  // FSDP over dp_mod_ep
//   };
//   fsdp::fully_shard(block, comms, o);   // dense S(0) over 4 ranks, experts _S(0,2),S(0) on (dp_mod_ep, ep)
// Gradient reduction: each mesh's flat gradient is a plain sum over its dp dims (divide factor
// 1). The loss is the global mean, so a dense gradient is Partial(sum) over every dp rank; an
// expert gradient on an ep rank already sums the tokens its ep group sent it (the all-to-all),
// so it is Partial(sum) over the remaining dp dims (dp_mod_ep, dp_replicate) and their sum is
// the one-rank gradient: no factor of ep. set_gradient_divide_factor(f) divides every mesh's sum.
// REQUIRES: the parameter lives on `comms` (its data's or meta spec's mesh is comms->mesh()),
// the same ParamMesh (by comms pointer) for every parameter on one mesh, mesh_dims valid for it.
// reshard_after_forward = k applies to the group's own mesh; the other meshes reshard fully.
struct ParamMesh {
  std::shared_ptr<const MeshComms> comms;
  std::optional<DataParallelMeshDims> mesh_dims;  // unset: by name, as for the group's mesh
};
// Per parameter (name relative to the module): its mesh, or nullopt for the mesh given to fully_shard.
using ParamMeshFn = std::function<std::optional<ParamMesh>(const std::string& name, const nn::Parameter&)>;

// How a group's shards are laid out (issue 28).
//   kPadded:     each parameter split along its dim over dp with padding, so the all-gathered
//                buffer is rank-major: unshard copies each rank's piece out into the parameters
//                and gradient sync copies the gradients into the flat reduce-scatter input.
//   kContiguous: the group's parameters parameter-major in one buffer (each aligned), that
//                buffer RaggedShard over dp with ranges balanced by bytes: the unsharded
//                parameters are views of the all-gather output and backward writes gradients
//                into the views of the reduce-scatter input, so neither copy happens
//                (fsdp/contiguous.h; fsdp/README.md "The contiguous layout").
// Example (kContiguous, f32, dp 3): a group of w [2,5] (10 elements), b [6] and g [3] (frozen).
// Offsets are rounded up to 16 bytes of the narrowest of the param / reduce / original dtypes
// (here 4 elements): w at 0, b at 12, g at 20, ending at 23; N = 24 (rounded up to blocks of
// dp x 4 = 12, so every rank holds 8). The flat buffer is Rg(0,[1,1,1],4): rank ranges [0,8)
// [8,16) [16,24). Sharded parameters (their own global shape):
//   w: Rg(0,[8,2,0],1)  rank 0 holds w's flat [0,8), rank 1 [8,10), rank 2 nothing
//   b: Rg(0,[0,4,2],1)  g: Rg(0,[0,0,3],1)
// unshard: flat Rg -> R into one N-element buffer (param dtype); w, b, g are views at 0, 12, 20.
// gradient sync: w and b (the trainable prefix, Ng = 18) are backward's gradient buffers at 0
// and 12 of an 18-element P buffer (gap [10,12) zero); P -> Rg(0,[8,8,2],1) into the sharded
// gradient buffer whose views are the sharded parameters' grads.
// HSDP: the flat buffer is [R, Rg(0,[1,...,1],align)] over (dp_replicate, dp_shard), each
// parameter [R, Rg(overlaps)], and gradient sync [P,P] -> [R,Rg] (reduce-scatter over dp_shard,
// all-reduce over dp_replicate: padded HSDP's collectives, reduce dtype and divide factor).
// reshard_after_forward = k: after forward the unsharded buffer becomes Rg(0,[1,...,1],align)
// over the k ranks (a local slice), gathered back over those k ranks for backward.
// With offload_policy.offload_to_cpu the flat shard and the sharded gradient buffer live on the
// host: one copy of the shard in before the all-gather, one of the gradient out after the
// reduce-scatter; w, b, g's sharded views are views of the host shard.
// Refused for now (Unsupported naming the option; use kPadded): other mesh dims (FSDP x TP),
// all-gather extensions, mesh_fn, shard_placement_fn, parameters without elements.
enum class Layout { kPadded, kContiguous };

struct FullyShardOptions {
  std::optional<DataParallelMeshDims> mesh_dims;
  Layout layout = Layout::kPadded;
  ParamMeshFn mesh_fn;  // per-parameter meshes (above); unset: every parameter on the given mesh
  ReshardAfterForward reshard_after_forward;
  ShardPlacementFn shard_placement_fn;
  // Per parameter, an all-gather extension (fsdp/all_gather_extension.h; e.g. fp8 or int8
  // codes on the wire: fsdp/lowp.h) or nullptr. A group with one packs every parameter's
  // gathered tensors by bytes into one u8 buffer: still one all-gather per unshard.
  AllGatherExtensionFn all_gather_extension_fn;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  std::vector<std::shared_ptr<nn::Parameter>> ignored_params;  // neither sharded nor reduced
  // Where the transient storage comes from (default: the mesh's allocator): the unsharded
  // parameters and their all-gather output (unsharded_allocator), the reduce-scatter inputs and
  // casts (buffer_allocator). Tests and fsdp-train count them apart with nn::TrackingAllocator.
  std::shared_ptr<kernels::Allocator> unsharded_allocator;
  std::shared_ptr<kernels::Allocator> buffer_allocator;
  // CPU threads of one chunk_cat / split_copy (copy-in, copy-out, the param_dtype cast of the
  // shard): 1 keeps every copy on the calling thread (the local backend already runs one thread
  // per rank, mpi one process), 0 picks by size (kernels/ops/chunk_cat.h). CUDA copies are one
  // kernel launch whatever this says.
  int copy_threads = 1;
};

// The sub-mesh unflattening reshard_after_forward = k needs, to pass to MeshComms at creation
// (communicators are never split lazily): shard mesh dim -> (size / k, k).
dtensor::Unflattening reshard_unflattening(const dtensor::DeviceMesh& mesh, int shard_mesh_dim, int k);

class Group;
class FSDPModule;

// A pending unshard(async = true); wait() is also called by the next pre-forward.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(Group* group) : group_(group) {}
  Group* group_ = nullptr;
};

// Counters of one group (tests and benchmarks read them).
struct GroupStats {
  int64_t all_gathers = 0;       // S(0) -> R unshards issued (from the sharded or the k buffer)
  int64_t reduce_scatters = 0;   // P -> S(0) gradient reductions issued
  int64_t all_reduces = 0;       // HSDP replicate reductions (inside or after the reduce-scatter)
  int64_t prefetches = 0;        // unshards issued ahead by prefetch
  int64_t all_gather_bytes = 0;  // this rank's bytes sent by the unshard plans (bytes_per_rank)
  int64_t extension_bytes = 0;   // this rank's bytes sent by the extensions' own collectives
  int64_t reduce_bytes = 0;      // bytes the gradient reductions' plans moved (busiest rank)
  // This rank's bytes FSDP copied around its collectives (read + written once each counted as
  // the bytes written): copy-out after the all-gather, copy-in before the reduction, and the
  // dtype casts (param_dtype of the shard, reduce_dtype of the gradients). kContiguous in f32: 0.
  int64_t copy_bytes = 0;
};

// The FSDP state of one fully_shard call (FSDP2's FSDPModule methods).
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<Group> group) : group_(std::move(group)) {}

  // All-gather this group now (async: returns at once; the pre-forward waits).
  UnshardHandle unshard(bool async_op = false);
  // Frees the unsharded parameters (the parameters become the sharded views again).
  void reshard();
  // With recurse, for this group and every group nested in its modules.
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  // false keeps the unsharded parameters after a backward without gradient sync, so the next
  // microbatch's forward needs no all-gather (FSDP2's ZeRO-2-like accumulation); a backward that
  // synchronises gradients always reshards (the optimizer steps the sharded parameters next).
  void set_reshard_after_backward(bool reshard, bool recurse = true);
  void set_reshard_after_forward(ReshardAfterForward mode, bool recurse = true);
  // HSDP: false reduces over the shard dim only (P -> [P,S(0)]) and keeps the partial sum until
  // a backward with true all-reduces it over the replicate dim.
  void set_requires_all_reduce(bool all_reduce, bool recurse = true);
  // Explicit prefetch lists (issued right after this group's unshard); an empty list restores
  // the implicit order.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule*>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule*>& modules);
  void set_gradient_divide_factor(double factor);
  void set_is_last_backward(bool last);
  // Implicit prefetch depth for the tree under this root (0: none; 1: FSDP2's one group ahead
  // in forward and backward; 2: two ahead). Explicit lists take precedence.
  void set_prefetch_depth(int depth);

  const std::string& name() const;
  // The parameters this group owns (names relative to the module given to fully_shard).
  std::vector<std::string> parameter_names() const;
  bool is_unsharded() const;
  // Bytes of one rank: unsharded parameters plus the all-gather output (param dtype), the flat
  // reduce-scatter input (reduce dtype), the sharded flat buffer (original dtype).
  int64_t unsharded_bytes() const;
  int64_t reduce_scatter_input_bytes() const;
  int64_t sharded_bytes() const;
  // Bytes of the reshard_after_forward = k buffer kept between forward and backward (0 unless k).
  int64_t resharded_k_bytes() const;
  bool reshards_after_forward() const;
  bool is_root() const;
  // With per-parameter meshes: sums over the group's meshes (so are the byte counts above).
  const GroupStats& stats() const;
  // How the options were honoured where it differs from what they ask (empty otherwise), e.g.
  // "offload_policy.pin_memory is a no-op here" on a CPU compute device; a trainer prints it once.
  const std::string& note() const;
  Group& group() const { return *group_; }

 private:
  std::shared_ptr<Group> group_;
  mutable GroupStats merged_stats_;  // stats() with per-parameter meshes
};

// Shards `module` (or the modules of one group) over the data-parallel dims of `mesh`, which
// must be the mesh its parameters live on. Collective-free. Throws InvalidArgument naming the
// module and parameter for: a module already sharded, a parameter shared with an earlier group
// outside that group's modules (tie it in the common ancestor's group), a parameter already
// sharded over dp (fully_shard goes bottom-up), a wrong mesh, a non-Replicate dp placement,
// mixed dtypes in one group, an uneven Shard(d > 0), a bad k.
// Meta parameters (shape, dtype, placements only) are accepted and allocate nothing: each
// records its sharded placements and, as its materialize target, its view of the group's flat
// buffer; nn::materialize (or a loader's nn::to_empty) then allocates the buffer and writes
// only this rank's shard into it (no full tensor on any rank), with the values materialising
// before sharding gives, bit for bit. A group with a parameter still meta refuses to unshard,
// naming it. Parameters with requires_grad false at this call are frozen: the group's
// reduce-scatter and sharded gradients leave them out (QLoRA's base weights); turning
// requires_grad on later is refused at the next backward, naming the parameter.
//   nn::GPT model(nn::ModuleOptions{comms}, cfg);         // meta
//   for (auto& [n, b] : model.blocks().children()) fsdp::fully_shard(*b, comms);
//   fsdp::fully_shard(model, comms);
//   nn::materialize(model, seed);                         // each rank: its shards only
FSDPModule& fully_shard(nn::Module& module, std::shared_ptr<const MeshComms> mesh,
                        const FullyShardOptions& options = {});
FSDPModule& fully_shard(const std::vector<nn::Module*>& modules, std::shared_ptr<const MeshComms> mesh,
                        const FullyShardOptions& options = {});
// The FSDP state of a module given to fully_shard, nullptr otherwise.
FSDPModule* state(nn::Module& module);

// QLoRA: every frozen parameter (requires_grad false at fully_shard) whose all-gather extension
// keeps its inputs (AllGatherExtension::keeps_inputs: NF4 with QuantConfig::static_scales) is
// quantised now and then stored only as its extension's codes and scales (fsdp/lowp.h's
// StoredNf4, in the mesh's allocator): its group's flat buffer is re-laid out once without its
// f32 master, and the parameter is meta between unshards (its value: fsdp/lowp_checkpoint.h's
// stored_nf4_state_dict / stored_nf4_dequantize). Collective: every rank calls it on the same
// module, sharded, after materialise or load (the scales need every rank's block absmax).
// Returns this rank's master bytes released (0 when there is nothing to quantise).
//   nn::materialize(model, seed);
//   fsdp::quantize_frozen(model);   // --qlora 8, dim 256, 2 blocks, FSDP 4: 1,572,864 bytes
int64_t quantize_frozen(nn::Module& module);

}  // namespace fsdp
