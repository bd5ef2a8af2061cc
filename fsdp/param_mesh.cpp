#include "fsdp/param_mesh.h"

#include <fmt/format.h>

#include "kernels/error.h"

namespace fsdp::detail {

namespace {

bool same_dims(const std::optional<DataParallelMeshDims>& a, const std::optional<DataParallelMeshDims>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a || (a->shard == b->shard && a->replicate == b->replicate);
}

std::string dims_text(const std::optional<DataParallelMeshDims>& d) {
  if (!d) return "by name";
  return fmt::format("shard {} replicate {}", d->shard, d->replicate ? std::to_string(*d->replicate) : "none");
}

}  // namespace

std::vector<MeshPart> split_by_mesh(const NamedParams& params, const std::shared_ptr<const MeshComms>& comms,
                                    const FullyShardOptions& options, const std::string& group_name) {
  std::vector<MeshPart> parts;
  parts.push_back(MeshPart{comms, options.mesh_dims, {}});
  for (const auto& [name, p] : params) {
    std::optional<ParamMesh> pm = options.mesh_fn(name, *p);
    size_t at = 0;
    if (pm && pm->comms != comms) {
      if (!pm->comms)
        throw kernels::InvalidArgument(
            fmt::format("fully_shard({}): mesh_fn gave parameter '{}' a null mesh", group_name, name));
      if (!(p->comms()->mesh() == pm->comms->mesh()))
        throw kernels::InvalidArgument(fmt::format(
            "fully_shard({}): mesh_fn puts parameter '{}' on mesh {}, but it lives on {} (move it there first, "
            "e.g. nn::MoE::set_expert_parallel(comms, dim))",
            group_name, name, dtensor::to_string(pm->comms->mesh()), dtensor::to_string(p->comms()->mesh())));
      at = parts.size();
      for (size_t i = 1; i < parts.size(); ++i)
        if (parts[i].comms == pm->comms) at = i;
      if (at == parts.size()) parts.push_back(MeshPart{pm->comms, pm->mesh_dims, {}});
      else if (!same_dims(parts[at].mesh_dims, pm->mesh_dims))
        throw kernels::InvalidArgument(fmt::format(
            "fully_shard({}): mesh_fn gives parameter '{}' the mesh {} with data-parallel dims ({}), an earlier "
            "parameter the same mesh with ({}): one set of dims per mesh",
            group_name, name, dtensor::to_string(pm->comms->mesh()), dims_text(pm->mesh_dims),
            dims_text(parts[at].mesh_dims)));
    }
    parts[at].params.emplace_back(name, p);
  }
  return parts;
}

}  // namespace fsdp::detail
