// Per-parameter meshes in fully_shard (FullyShardOptions::mesh_fn, fsdp/fully_shard.h): the
// group's parameters split by the mesh they shard over. The parameters on the group's own mesh
// stay with it; each other mesh gets a follower group (its own flat buffer, dp dims and
// reductions) that the leader's hooks drive, so one fully_shard call is still one group to the
// user and to prefetching.
//
//   // params: (block.attn.qkv.weight on dp), (block.moe.experts.w1 on ep_comms), ...
//   std::vector<MeshPart> parts = split_by_mesh(params, comms, options, "TransformerBlock");
//   parts[0].comms == comms (possibly empty params), parts[1].comms == ep_comms, ...
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fully_shard.h"

namespace fsdp::detail {

using NamedParams = std::vector<std::pair<std::string, std::shared_ptr<nn::Parameter>>>;

struct MeshPart {
  std::shared_ptr<const MeshComms> comms;
  std::optional<DataParallelMeshDims> mesh_dims;
  NamedParams params;  // in the order given
};

// REQUIRES: options.mesh_fn set. The first part is `comms` (the group's own mesh, with
// options.mesh_dims); the others follow in order of first appearance. Throws InvalidArgument
// naming the group and parameter for a null ParamMesh comms, a parameter that does not live on
// the mesh mesh_fn names, and one comms given with two different mesh_dims.
std::vector<MeshPart> split_by_mesh(const NamedParams& params, const std::shared_ptr<const MeshComms>& comms,
                                    const FullyShardOptions& options, const std::string& group_name);

}  // namespace fsdp::detail
