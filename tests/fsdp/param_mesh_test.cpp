// Per-parameter meshes in fully_shard (FullyShardOptions::mesh_fn): a GPT with MoE blocks whose
// experts live on the dp mesh unflattened into (dp_mod_ep, ep) (expert parallelism carved from
// dp_shard), FSDP over dp_mod_ep beside the dense parameters over dp_shard, trains like one rank
// (losses, parameters, clip_grad_norm_'s norm across the two meshes); the group counts one
// all-gather and one reduction per mesh; a checkpoint saved under that layout loads bit-exactly
// on one rank and under EP 2 without FSDP; bad mesh_fn answers are refused naming the parameter.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/error.h"
#include "nn/moe.h"
#include "nn/optim.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

nn::GPTConfig moe_gpt() {
  nn::GPTConfig c;
  c.vocab = 16;
  c.dim = 16;
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 8;
  c.moe.experts = 4;
  c.moe.top_k = 2;
  return c;
}

Tensor batch_ids(int step, int64_t rows, int64_t seq, int64_t vocab, int shift) {
  Tensor t = Tensor::empty({rows, seq}, DType::kI64);
  int64_t* p = t.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < seq; ++i) p[r * seq + i] = (r * 7 + step * 13 + i * (3 + shift)) % vocab;
  return t;
}

// A layout: the dp mesh, and for carved EP the dp_shard dim split into (dp_mod_ep, ep).
struct Layout {
  Dims mesh{1};
  std::vector<std::string> names{"tp"};
  int shard_dim = -1;  // -1: no FSDP, no carving
  int64_t ep = 1;
  bool shard_first = false;  // fully_shard on meta, then materialise
};

struct Result {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> params;  // full values (rank 0)
  int64_t all_gathers = 0, reduce_scatters = 0;  // block 0's group, rank 0
  std::string expert_placements;                 // blocks.0's experts.w1, rank 0
};

constexpr int kSteps = 3;
constexpr int64_t kBatch = 8;

// Trains kSteps; with save_dir, rank threads then save the parameters there.
Result train(const Layout& L, testing_support::Checks& checks, const std::string& save_dir = "") {
  const DeviceMesh mesh = DeviceMesh::from_shape(L.mesh, L.names);
  const bool fsdp = L.shard_dim >= 0;
  const nn::GPTConfig cfg = moe_gpt();
  Result result;
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    std::vector<dtensor::Unflattening> un;
    dtensor::Unflattening split{L.shard_dim, Dims{L.mesh[L.shard_dim >= 0 ? L.shard_dim : 0] / L.ep, L.ep},
                                {"dp_mod_ep", "ep"}};
    if (fsdp) un.push_back(split);
    auto comms = MeshComms::create(mesh, world, {}, nullptr, un);
    std::shared_ptr<const MeshComms> ep_comms = fsdp ? comms->unflatten(split.mesh_dim, split.sizes, split.names) : nullptr;
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
    if (fsdp)
      for (auto& [name, m] : model.named_modules())
        if (auto* moe = dynamic_cast<nn::MoE*>(m)) moe->set_expert_parallel(ep_comms, L.shard_dim + 1);
    if (!L.shard_first) nn::materialize(model, 5);
    fsdp::FSDPModule* block0 = nullptr;
    if (fsdp) {
      fsdp::FullyShardOptions o;
      std::optional<int> rep;
      if (L.shard_dim > 0) rep = 0;
      o.mesh_fn = [&](const std::string&, const nn::Parameter& p) -> std::optional<fsdp::ParamMesh> {
        if (p.comms() != ep_comms) return std::nullopt;
        return fsdp::ParamMesh{ep_comms, fsdp::DataParallelMeshDims{rep, L.shard_dim}};
      };
      for (const auto& [name, block] : model.blocks().children()) {
        fsdp::FSDPModule& g = fsdp::fully_shard(*block, comms, o);
        if (!block0) block0 = &g;
      }
      fsdp::fully_shard(model, comms);
      int experts = 0;
      for (const std::string& n : block0->parameter_names()) experts += n.find("experts.") != std::string::npos;
      checks.check(experts == 2, fmt::format("block 0's group names {} expert parameters, expected 2", experts));
    }
    if (L.shard_first) nn::materialize(model, 5);
    kernels::AdamWOptions ao;
    ao.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), ao);
    Placements batch_pl(mesh.ndim(), dtensor::Replicate{});
    if (fsdp)
      for (int d = 0; d < mesh.ndim(); ++d) batch_pl[d] = dtensor::Shard{0};
    nn::CrossEntropyLoss loss_fn;
    auto shared_mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements(mesh.ndim(), dtensor::Replicate{}), {}, DType::kF64),
                        Tensor::full({}, 1.0, DType::kF64));
    for (int step = 0; step < kSteps; ++step) {
      const DTensor x = dtensor::distribute_tensor(batch_ids(step, kBatch, cfg.max_seq, cfg.vocab, 0), comms, batch_pl,
                                                   std::nullopt);
      const DTensor y = dtensor::distribute_tensor(batch_ids(step, kBatch, cfg.max_seq, cfg.vocab, 1), comms, batch_pl,
                                                   std::nullopt);
      nn::Ctx ctx, lctx;
      DTensor loss = loss_fn.forward(lctx, model.forward(ctx, x), y);
      const double l = loss.full_tensor().item({});
      model.backward(ctx, loss_fn.backward(lctx, dloss));
      const auto params = model.named_parameters();
      nn::reduce_gradients(params);
      const double norm = nn::clip_grad_norm_(params, 0.5);  // clips: the norm is larger
      opt.step();
      opt.zero_grad();
      if (world.rank() == 0) {
        result.losses.push_back(l);
        result.norms.push_back(norm);
      }
    }
    if (world.rank() == 0 && block0) {
      result.all_gathers = block0->stats().all_gathers;
      result.reduce_scatters = block0->stats().reduce_scatters;
    }
    for (const auto& [name, p] : model.named_parameters()) {
      if (world.rank() == 0 && name == "blocks.0.moe.experts.w1")
        result.expert_placements = dtensor::to_string(p->placements()) + " on " + dtensor::to_string(p->data().device_mesh());
      Tensor full = p->data().full_tensor();
      if (world.rank() == 0) result.params[name] = full.clone();
    }
    if (!save_dir.empty()) {
      nn::StateDict sd;
      for (const auto& [name, p] : model.named_parameters()) sd.tensors.emplace_back(name, p->data());
      checkpoint::save(save_dir, sd, world);
    }
  });
  return result;
}

void check_parity(const Result& got, const Result& ref) {
  REQUIRE(got.losses.size() == static_cast<size_t>(kSteps));
  REQUIRE(ref.losses.size() == static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) {
    INFO("step " << i);
    CHECK(std::abs(got.losses[i] - ref.losses[i]) <= 1e-6 * std::abs(ref.losses[i]));
    CHECK(std::abs(got.norms[i] - ref.norms[i]) <= 1e-6 * ref.norms[i]);
    CHECK(ref.norms[i] > 0.5);  // clipping acted
  }
  REQUIRE(got.params.size() == ref.params.size());
  double num = 0, den = 0;
  int compared = 0;
  for (const auto& [name, t] : ref.params) {
    auto it = got.params.find(name);
    REQUIRE(it != got.params.end());
    const auto a = it->second.to_vector(), b = t.to_vector();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    ++compared;
  }
  CHECK(compared > 10);
  CHECK(std::sqrt(num / den) <= 1e-5);
  CHECK(ref.losses.front() != ref.losses.back());
}

// Loads `dir` into a freshly initialised model of layout L (no FSDP; experts S(0) over mesh dim
// ep_dim when >= 0) and returns rank 0's full values.
std::map<std::string, Tensor> load_into(const std::string& dir, const Dims& shape, int ep_dim) {
  const DeviceMesh mesh = DeviceMesh::from_shape(shape);
  std::map<std::string, Tensor> out;
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, moe_gpt());
    if (ep_dim >= 0)
      for (auto& [name, m] : model.named_modules())
        if (auto* moe = dynamic_cast<nn::MoE*>(m)) moe->set_expert_parallel(ep_dim);
    nn::materialize(model, 99);  // other values: the load must overwrite them all
    nn::StateDict sd;
    for (const auto& [name, p] : model.named_parameters()) sd.tensors.emplace_back(name, p->data());
    checkpoint::load(dir, sd, world);
    for (const auto& [name, p] : model.named_parameters()) {
      Tensor full = p->data().full_tensor();
      if (world.rank() == 0) out[name] = full.clone();
    }
  });
  return out;
}

}  // namespace

TEST_CASE("fully_shard: experts on a carved (dp_mod_ep, ep) mesh beside dense FSDP train like one rank",
          "[fsdp][param_mesh]") {
  testing_support::Checks none;
  const Result ref = train(Layout{}, none);
  struct Case {
    const char* what;
    Layout layout;
    const char* placements;
  };
  const std::vector<Case> cases = {
      {"dp_shard 4, ep 2 carved, shard first", {Dims{4}, {"dp_shard"}, 0, 2, true},
       "_S(0,2),S(0) on [[0,1],[2,3]] (dp_mod_ep,ep)"},
      {"HSDP 2 x (dp_shard 2, ep 2 carved)", {Dims{2, 2}, {"dp_replicate", "dp_shard"}, 1, 2, false},
       "R,_S(0,2),S(0) on [[[0,1]],[[2,3]]] (dp_replicate,dp_mod_ep,ep)"},
  };
  int ran = 0;
  for (const Case& c : cases) {
    SECTION(c.what) {
      testing_support::Checks checks;
      const Result got = train(c.layout, checks);
      checks.report();
      check_parity(got, ref);
      CHECK(got.expert_placements == c.placements);
      // Per step: forward and backward unshard, one reduction, each on both meshes.
      CHECK(got.all_gathers == 2 * 2 * kSteps);
      CHECK(got.reduce_scatters == 2 * kSteps);
      ++ran;
    }
  }
  CHECK(ran == 1);  // one section per run
}

TEST_CASE("checkpoint: saved under carved EP 2 with FSDP, loads bit-exactly on one rank and under EP 2",
          "[fsdp][param_mesh][checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("param-mesh-ckpt-{}", ::getpid());
  fs::remove_all(dir);
  testing_support::Checks checks;
  const Result saved = train(Layout{Dims{4}, {"dp_shard"}, 0, 2, false}, checks, dir.string());
  checks.report();
  struct Target {
    const char* what;
    Dims mesh;
    int ep_dim;
  };
  int compared = 0;
  for (const Target& t : {Target{"one rank", Dims{1}, -1}, Target{"EP 2", Dims{2}, 0}}) {
    INFO(t.what);
    const auto got = load_into(dir.string(), t.mesh, t.ep_dim);
    REQUIRE(got.size() == saved.params.size());
    for (const auto& [name, want] : saved.params) {
      INFO(name);
      REQUIRE(got.count(name) == 1);
      CHECK(got.at(name).to_vector() == want.to_vector());  // bit-exact (f32 -> f64 is exact)
      ++compared;
    }
  }
  CHECK(compared == 2 * static_cast<int>(saved.params.size()));
  fs::remove_all(dir);
}

TEST_CASE("fully_shard: mesh_fn answers that do not fit are refused naming the parameter", "[fsdp][param_mesh]") {
  testing_support::Checks checks;
  int ran = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    const DeviceMesh mesh = DeviceMesh::from_shape({4}, {"dp_shard"});
    auto comms = MeshComms::create(mesh, world, {}, nullptr, {{0, Dims{2, 2}, {"dp_mod_ep", "ep"}}});
    auto ep_comms = comms->unflatten(0, Dims{2, 2}, {"dp_mod_ep", "ep"});
    auto build = [&] {
      auto m = std::make_shared<nn::GPT>(nn::ModuleOptions{comms, DType::kF32, {}}, moe_gpt());
      for (auto& [name, mod] : m->named_modules())
        if (auto* moe = dynamic_cast<nn::MoE*>(mod)) moe->set_expert_parallel(ep_comms, 1);
      return m;
    };
    {  // a dense parameter sent to the experts' mesh
      auto model = build();
      fsdp::FullyShardOptions o;
      o.mesh_fn = [&](const std::string& n, const nn::Parameter&) -> std::optional<fsdp::ParamMesh> {
        if (n.find("attn") == std::string::npos) return std::nullopt;
        return fsdp::ParamMesh{ep_comms, fsdp::DataParallelMeshDims{std::nullopt, 0}};
      };
      checks.throws<kernels::InvalidArgument>([&] { fsdp::fully_shard(model->blocks()[0], comms, o); },
                                              "but it lives on", "dense parameter on the experts' mesh");
    }
    {  // one mesh, two sets of dp dims
      auto model = build();
      fsdp::FullyShardOptions o;
      o.mesh_fn = [&](const std::string& n, const nn::Parameter& p) -> std::optional<fsdp::ParamMesh> {
        if (p.comms() != ep_comms) return std::nullopt;
        return fsdp::ParamMesh{ep_comms, fsdp::DataParallelMeshDims{std::nullopt, n.find("w1") != std::string::npos ? 0 : 1}};
      };
      checks.throws<kernels::InvalidArgument>([&] { fsdp::fully_shard(model->blocks()[0], comms, o); },
                                              "one set of dims per mesh", "two sets of dims");
    }
    {  // experts on their mesh without mesh_fn: the group's mesh check names them
      auto model = build();
      checks.throws<kernels::InvalidArgument>([&] { fsdp::fully_shard(model->blocks()[0], comms); },
                                              "experts.w1' lives on mesh", "no mesh_fn");
    }
    {  // MoE: a mesh that is not the module's mesh unflattened
      auto model = std::make_shared<nn::GPT>(nn::ModuleOptions{comms, DType::kF32, {}}, moe_gpt());
      checks.throws<kernels::InvalidArgument>(
          [&] {
            for (auto& [name, mod] : model->named_modules())
              if (auto* moe = dynamic_cast<nn::MoE*>(mod)) moe->set_expert_parallel(comms, 0);
          },
          "is not the module's mesh", "MoE on a mesh that is not carved");
    }
    if (world.rank() == 0) ran = 4;
  });
  checks.report();
  CHECK(ran == 4);
}
