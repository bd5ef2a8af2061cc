#include "checkpoint/save_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/internal.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "nn/safetensors.h"

namespace checkpoint::detail {

namespace {

using kernels::InvalidArgument;
using Json = nlohmann::ordered_json;

void check_saveable(const std::string& key, const dtensor::DTensorSpec& spec) {
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (dtensor::is_partial(spec.placements[m]) && spec.mesh->size(static_cast<int>(m)) > 1)
      throw InvalidArgument(fmt::format(
          "checkpoint: '{}' is {} on mesh dim {}: a Partial tensor has no saved value; reduce it first", key,
          dtensor::to_string(spec.placements[m]), m));
  if (!nn::safetensors_dtype_name(spec.dtype))
    throw InvalidArgument(fmt::format("checkpoint: '{}' has dtype {}, which safetensors cannot hold", key,
                                      kernels::to_string(spec.dtype)));
}

// The description the plan hash covers; checks every key (same on every rank).
std::string describe(const SpecList& specs, uint64_t block_bytes) {
  std::string desc = fmt::format("block_bytes={};", block_bytes);
  std::set<std::string> seen;
  // A mesh as its shape, names and a digest of its rank list (once per mesh object: not a string
  // of every rank per key).
  std::map<const dtensor::DeviceMesh*, std::string> meshes;
  for (const auto& [key, spec] : specs) {
    if (!seen.insert(key).second) throw InvalidArgument(fmt::format("checkpoint: key '{}' appears twice", key));
    check_saveable(key, spec);
    auto [it, added] = meshes.try_emplace(spec.mesh.get());
    if (added) {
      const std::vector<int>& ranks = spec.mesh->ranks();
      it->second = fmt::format("{}/{}/{:016x}", spec.mesh->shape(), fmt::join(spec.mesh->names(), ","),
                               xxh64(ranks.data(), ranks.size() * sizeof(int)));
    }
    desc += fmt::format("{}|{}|{}|{}|{};", key, spec.shape, kernels::to_string(spec.dtype),
                        dtensor::to_string(spec.placements), it->second);
  }
  return desc;
}

PlannedChunk planned(size_t k, const Box& box, int owner, uint64_t item, uint64_t block_bytes) {
  PlannedChunk c;
  c.key = k;
  c.box = box;
  c.owner = owner;
  c.nbytes = static_cast<uint64_t>(box.sizes.product()) * item;
  c.block_shape = choose_block_shape(box.sizes, item, block_bytes);
  if (!c.block_shape.empty()) c.blocks = block_range(box.offsets, box.sizes, c.block_shape).total();
  return c;
}

// The empty chunk of a tensor with an empty dim (its shape is the global shape, so readers know
// it), written by the mesh's first rank.
Box empty_box(const Dims& shape) {
  Box b;
  b.offsets = Dims::filled(shape.size(), 0);
  b.sizes = shape;
  b.local = Dims::filled(shape.size(), 0);
  return b;
}

bool has_empty_dim(const Dims& shape) {
  for (int d = 0; d < shape.size(); ++d)
    if (shape[d] == 0) return true;
  return false;
}

// Slots (chunk c is the c-th of its key its owner writes), then files and their headers.
void plan_files(const SpecList& specs, SavePlan& plan) {
  std::map<std::pair<int, size_t>, int> slots_used;  // (owner, key) -> chunks so far
  std::map<int, int> slots_of;                        // owner -> files
  for (PlannedChunk& c : plan.chunks) {
    c.slot = slots_used[{c.owner, c.key}]++;
    slots_of[c.owner] = std::max(slots_of[c.owner], c.slot + 1);
  }
  std::map<std::pair<int, int>, size_t> file_index;
  for (const auto& [owner, slots] : slots_of)
    for (int s = 0; s < slots; ++s) {
      file_index[{owner, s}] = plan.files.size();
      FilePlan f;
      f.name = file_name(owner, s, slots);
      f.owner = owner;
      f.slot = s;
      plan.files.push_back(std::move(f));
    }
  for (size_t i = 0; i < plan.chunks.size(); ++i)
    plan.files[file_index[{plan.chunks[i].owner, plan.chunks[i].slot}]].chunks.push_back(i);
  for (FilePlan& f : plan.files) {
    Json header = Json::object();
    Json sharding = Json::object();
    for (size_t ci : f.chunks) {
      const PlannedChunk& c = plan.chunks[ci];
      sharding[specs[c.key].first] = {{"saved_offsets", std::vector<int64_t>(c.box.offsets.begin(), c.box.offsets.end())}};
    }
    header["__metadata__"] = {{"DCP_SHARDING_INFO", sharding.dump()},
                              {"DCP_VERSION", "1.0"},
                              {"format", "pt"},
                              {kWriterKey, "1"}};
    uint64_t off = 0;
    for (size_t ci : f.chunks) {
      const PlannedChunk& c = plan.chunks[ci];
      header[specs[c.key].first] = {{"dtype", nn::safetensors_dtype_name(specs[c.key].second.dtype)},
                                    {"shape", std::vector<int64_t>(c.box.sizes.begin(), c.box.sizes.end())},
                                    {"data_offsets", {off, off + c.nbytes}}};
      f.offsets.push_back(off);
      off += c.nbytes;
    }
    f.header = header.dump();
    while (f.header.size() % 8 != 0) f.header += ' ';
    const uint64_t base = 8 + f.header.size();
    for (uint64_t& o : f.offsets) o += base;
    f.size = base + off;
  }
}

// Refuses a mesh naming a rank outside the world (once per distinct mesh).
// Every rank of the mesh is in the world.
void check_ranks(const std::string& key, const dtensor::DeviceMesh& mesh, int world_size) {
  for (int r : mesh.ranks())
    if (r >= world_size)
      throw InvalidArgument(
          fmt::format("checkpoint: '{}' lives on rank {} but the world has {} ranks", key, r, world_size));
}

// The bytes each replica index of one replica group has been given so far (a group: keys on one
// mesh replicated along the same mesh dims; every replica of such a key holds the same boxes of
// every key of the group, so all replicas compute the same loads). take() gives a box to the
// least-loaded index (lowest on ties): the reference's greedy, within the group. Memory: the
// indices given something, never the replica count.
class ReplicaLoads {
 public:
  explicit ReplicaLoads(int64_t replicas) : replicas_(replicas) {}
  int64_t take(uint64_t nbytes) {
    // The candidates: the least-loaded index given something, and the lowest never given one.
    const std::pair<uint64_t, int64_t> fresh{0, fresh_};
    const bool use_fresh =
        fresh_ < replicas_ && (by_load_.empty() || fresh < *by_load_.begin());
    std::pair<uint64_t, int64_t> best = fresh;
    if (use_fresh) {
      ++fresh_;
    } else {
      best = *by_load_.begin();
      by_load_.erase(by_load_.begin());
    }
    by_load_.insert({best.first + nbytes, best.second});
    return best.second;
  }

 private:
  std::set<std::pair<uint64_t, int64_t>> by_load_;
  int64_t replicas_ = 1, fresh_ = 0;
};

}  // namespace

SpecList specs_of(const nn::StateDict& sd) {
  SpecList out;
  out.reserve(sd.tensors.size());
  for (const auto& [k, t] : sd.tensors) out.emplace_back(k, t.spec());
  return out;
}

SavePlan make_local_save_plan(const SpecList& specs, int rank, int world_size, uint64_t block_bytes) {
  SavePlan plan;
  const std::string desc = describe(specs, block_bytes);
  std::vector<const dtensor::DeviceMesh*> meshes;                // distinct by value, each checked once
  std::map<std::pair<size_t, std::vector<int>>, ReplicaLoads> groups;  // (mesh, replicating dims)
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto& [key, spec] = specs[k];
    const dtensor::DeviceMesh& mesh = *spec.mesh;
    // Groups by mesh value (equal meshes held as different objects on different ranks group alike).
    size_t mesh_id = 0;
    while (mesh_id < meshes.size() && !(*meshes[mesh_id] == mesh)) ++mesh_id;
    if (mesh_id == meshes.size()) {
      check_ranks(key, mesh, world_size);
      meshes.push_back(&mesh);
    }
    const uint64_t item = kernels::itemsize(spec.dtype);
    if (has_empty_dim(spec.shape)) {
      if (mesh.ranks().front() == rank) plan.chunks.push_back(planned(k, empty_box(spec.shape), rank, item, block_bytes));
      continue;
    }
    const std::optional<Dims> coord = mesh.coord_of(rank);
    if (!coord) continue;
    // The replicas of this rank's boxes: the ranks that differ from it only along mesh dims that
    // replicate the tensor (a Partial of size 1 as well); this rank's index among them.
    std::vector<int> rep_dims;
    int64_t index = 0;
    for (int m = 0; m < mesh.ndim(); ++m)
      if ((dtensor::is_replicate(spec.placements[m]) || dtensor::is_partial(spec.placements[m])) && mesh.size(m) > 1) {
        rep_dims.push_back(m);
        index = index * mesh.size(m) + (*coord)[m];
      }
    const std::optional<dtensor::ShardLayout> layout = spec.layout(rank);
    const std::vector<Box> boxes = boxes_of(*layout, spec.shape);
    int64_t replicas = 1;
    for (int m : rep_dims) replicas *= mesh.size(m);
    ReplicaLoads& loads = groups.try_emplace({mesh_id, rep_dims}, replicas).first->second;
    for (const Box& box : boxes) {
      PlannedChunk c = planned(k, box, rank, item, block_bytes);
      if (loads.take(c.nbytes) == index) plan.chunks.push_back(std::move(c));
    }
  }
  plan.hash = xxh64(desc.data(), desc.size());
  plan_files(specs, plan);
  return plan;
}

SavePlan make_save_plan_by_rank(const SpecList& specs, int world_size, uint64_t block_bytes) {
  SavePlan plan;
  const std::string desc = describe(specs, block_bytes);
  std::vector<uint64_t> load(world_size, 0);
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto& [key, spec] = specs[k];
    const uint64_t item = kernels::itemsize(spec.dtype);
    // Distinct boxes in the order of the first holder (mesh order), with their holders.
    std::vector<std::pair<Box, std::vector<int>>> distinct;
    std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, size_t> index;
    check_ranks(key, *spec.mesh, world_size);
    for (int r : spec.mesh->ranks()) {
      auto layout = spec.layout(r);
      for (Box& b : boxes_of(*layout, spec.shape)) {
        auto id = std::make_pair(std::vector<int64_t>(b.offsets.begin(), b.offsets.end()),
                                 std::vector<int64_t>(b.sizes.begin(), b.sizes.end()));
        auto it = index.find(id);
        if (it == index.end()) {
          index.emplace(id, distinct.size());
          distinct.push_back({std::move(b), {r}});
        } else {
          distinct[it->second].second.push_back(r);
        }
      }
    }
    if (distinct.empty()) distinct.push_back({empty_box(spec.shape), {spec.mesh->ranks().front()}});
    for (auto& [box, holders] : distinct) {
      int owner = holders.front();
      for (int h : holders)
        if (load[h] < load[owner]) owner = h;
      plan.chunks.push_back(planned(k, box, owner, item, block_bytes));
      load[owner] += plan.chunks.back().nbytes;
    }
  }
  plan.hash = xxh64(desc.data(), desc.size());
  plan_files(specs, plan);
  return plan;
}

}  // namespace checkpoint::detail
