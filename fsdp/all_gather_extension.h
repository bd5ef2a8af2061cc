// All-gather extensions (FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather): a parameter may
// change what its unshard gathers (e.g. fp8 or int8 codes instead of bf16) and how the gathered
// bytes become the unsharded compute tensor. The sharded parameter stays the high-precision
// master: the optimizer steps it, and the gradient of the compute tensor is reduced into it as
// if the compute tensor were the parameter (straight-through).
//
// Contract, per unshard of a group with at least one extended parameter:
//   1. pre_all_gather(padded shard, ctx) on every rank -> tensors to gather + metadata; it may
//      run collectives of its own through dtensor (e.g. an amax all-reduce over ctx.comms).
//   2. Every gathered tensor of every parameter of the group (extended or not, any dtypes) is
//      packed by bytes into the group's one flat u8 buffer and all-gathered ONCE (S(0) -> R).
//   3. post_all_gather(gathered, metadata, param_dtype, out, ctx) writes the unsharded compute
//      tensor into `out` (the group's unsharded parameter storage: the same buffer every step).
//
// Worked example (a parameter [10, 4] f32 on 4 dp ranks, an fp8 extension, param_dtype bf16):
//   chunks rows 3,3,3,1; padded_shape [3, 4]; gather_inputs(ctx) == {{f8e4m3, [12]}};
//   pre_all_gather(shard [3, 4] (rank 3: 1 row + 2 zero rows), ctx) -> {{q [12] f8e4m3}, scale};
//   the group's buffer carries 12 bytes per rank for it (plus its other parameters' pieces);
//   post_all_gather({q_all [48] f8e4m3}, scale, bf16, out [10, 4] bf16, ctx) dequantises rank
//   d's rows 0..chunks[d].size - 1 into out rows chunks[d].offset ...
//
// Given to fully_shard per parameter by FullyShardOptions::all_gather_extension_fn. Not combined
// with reshard_after_forward = k (refused: the k buffer holds compute-dtype parameters), nor with
// Layout::kContiguous (refused: its shards are flat ranges that may split a row, not padded
// chunks along a tensor dim; fsdp/README.md).
#pragma once

#include <any>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/layout.h"
#include "dtensor/mesh_comms.h"
#include "nn/parameter.h"

namespace fsdp {

// What an extension knows of its parameter (fixed at fully_shard; the same on every rank except
// dp_coord).
struct AllGatherContext {
  std::string name;                                 // relative to the module given to fully_shard
  std::shared_ptr<const dtensor::MeshComms> comms;  // the parameter's (full) mesh
  dtensor::DTensorSpec sharded_spec;                // orig dtype, dp dims sharded
  dtensor::DTensorSpec unsharded_spec;              // orig dtype, dp dims Replicate
  std::optional<int> replicate_mesh_dim;            // HSDP: its ranks hold copies, not pieces
  int shard_mesh_dim = 0;
  int shard_dim = 0;                                // tensor dim split over dp
  kernels::Dims local_shape;                        // the unsharded local (tensor-parallel) shape
  kernels::Dims padded_shape;                       // local_shape with shard_dim -> ceil(n / dp)
  std::vector<dtensor::Chunk> chunks;               // per dp shard coordinate, along shard_dim
  int64_t dp_coord = 0;                             // this rank's
};

// One tensor pre_all_gather returns, per rank: the same dtype and shape on every rank.
struct GatherInput {
  kernels::DType dtype = kernels::DType::kU8;
  kernels::Dims shape;
};

struct PreAllGatherResult {
  std::vector<kernels::Tensor> inputs;  // as gather_inputs(ctx) says: dtype and shape, in order
  std::any metadata;                    // handed to post_all_gather of the same unshard
  int64_t communicated_bytes = 0;       // bytes this rank sent in the extension's own collectives
};

class AllGatherExtension {
 public:
  virtual ~AllGatherExtension() = default;
  virtual std::string name() const = 0;
  // The tensors pre_all_gather returns (sizes the group's buffer at fully_shard).
  // REQUIRES: a function of ctx's global fields only (every rank gets the same answer).
  virtual std::vector<GatherInput> gather_inputs(const AllGatherContext& ctx) const = 0;
  // REQUIRES: shard is this rank's padded shard, shape ctx.padded_shape, the parameter's orig
  // dtype, rows >= chunks[dp_coord].size along shard_dim zero. Called on every rank of the mesh
  // in the same order (it may run collectives over ctx.comms).
  virtual PreAllGatherResult pre_all_gather(const kernels::Tensor& shard, const AllGatherContext& ctx) = 0;
  // gathered[j]: input j of every dp rank concatenated along dim 0, rank-major (shape
  // {dp * shape[0], shape[1..]}). REQUIRES: out has ctx.local_shape and param_dtype; it is
  // overwritten entirely.
  virtual void post_all_gather(const std::vector<kernels::Tensor>& gathered, const std::any& metadata,
                               kernels::DType param_dtype, kernels::Tensor& out, const AllGatherContext& ctx) = 0;
  // True when the extension keeps what its first pre_all_gather returned (a frozen weight's
  // codes and scales) and every later call returns that and ignores `shard` (then undefined):
  // fsdp::quantize_frozen may release such a frozen parameter's sharded master.
  virtual bool keeps_inputs() const { return false; }
};

// Per parameter (name relative to the module given to fully_shard): its extension, or nullptr to
// gather it as usual.
using AllGatherExtensionFn =
    std::function<std::shared_ptr<AllGatherExtension>(const std::string& name, const nn::Parameter&)>;

}  // namespace fsdp
