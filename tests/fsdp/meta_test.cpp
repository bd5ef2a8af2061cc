// Shard first (issue 26): fully_shard on a meta model records the sharded layout and allocates
// nothing; nn::materialize then writes each rank's shards straight into the groups' flat buffers.
// The values equal init-then-shard bit for bit on every layout fsdp-train supports, no rank ever
// holds more than its shards, and a group still meta refuses to run, naming the parameter.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/error.h"
#include "nn/memory.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using kernels::DType;
using kernels::Tensor;

struct Layout {
  std::string what;
  Dims mesh;
  std::vector<std::string> names;
  int tp_dim = -1;
  nn::GPTConfig cfg;
  fsdp::FullyShardOptions options;
};

nn::GPTConfig small(int64_t vocab = 20) {
  nn::GPTConfig c;
  c.vocab = vocab;
  c.dim = 16;
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 8;
  c.bias = true;  // biases too: 1-d parameters of every kind
  return c;
}

// Every layout fsdp-train builds (FSDP, uneven FSDP, HSDP, FSDP x TP including the uneven vocab
// case CI runs, HSDP x TP), with the options that change where shards live (offload, bf16
// parameters, reshard_after_forward k), plus Shard(1) by shard_placement_fn and tied weights.
std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (int64_t dp : {1, 2, 3, 4}) out.push_back({"FSDP " + std::to_string(dp), {dp}, {"dp_shard"}, -1, small(), {}});
  out.push_back({"HSDP 2x2", {2, 2}, {"dp_replicate", "dp_shard"}, -1, small(), {}});
  out.push_back({"FSDP x TP 2x2", {2, 2}, {"dp_shard", "tp"}, 1, small(), {}});
  out.push_back({"FSDP x TP 3x2 uneven vocab 50", {3, 2}, {"dp_shard", "tp"}, 1, small(50), {}});
  out.push_back({"HSDP x TP 2x2x2", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"}, 2, small(), {}});
  Layout off{"FSDP 2 offload, bf16 parameters", {2}, {"dp_shard"}, -1, small(), {}};
  off.options.offload_policy.offload_to_cpu = true;
  off.options.mp_policy.param_dtype = DType::kBF16;
  out.push_back(off);
  Layout dim1{"FSDP 2 Shard(1)", {2}, {"dp_shard"}, -1, small(), {}};
  dim1.options.shard_placement_fn = [](const std::string&, const nn::Parameter& p) -> std::optional<int> {
    if (p.shape().size() == 2) return 1;
    return std::nullopt;
  };
  out.push_back(dim1);
  Layout tied{"FSDP 3 tied embeddings", {3}, {"dp_shard"}, -1, small(), {}};
  tied.cfg.tie_embeddings = true;
  out.push_back(tied);
  return out;
}

void shard(nn::GPT& model, const std::shared_ptr<MeshComms>& comms, const fsdp::FullyShardOptions& o) {
  for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms, o);
  fsdp::fully_shard(model, comms, o);
}

// This rank's shard of every parameter, as bytes, with its placements.
std::vector<std::pair<std::string, std::vector<unsigned char>>> shards(nn::GPT& model) {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> out;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor t = p->data().to_local().contiguous();
    std::vector<unsigned char> bytes(t.nbytes());
    if (!bytes.empty()) std::memcpy(bytes.data(), t.data_ptr(), bytes.size());
    out.emplace_back(name + " " + dtensor::to_string(p->placements()), std::move(bytes));
  }
  return out;
}

}  // namespace

TEST_CASE("fsdp meta: shard-then-materialise equals materialise-then-shard bit for bit on every layout",
          "[fsdp][meta]") {
  int ran = 0;
  for (const Layout& l : layouts()) {
    INFO(l.what);
    testing_support::Checks checks;
    const DeviceMesh mesh = DeviceMesh::from_shape(l.mesh, l.names);
    collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
      // init-then-shard (today's order)
      auto c1 = MeshComms::create(mesh, world);
      nn::GPT a(nn::ModuleOptions{c1, DType::kF32, {}}, l.cfg);
      if (l.tp_dim >= 0) nn::parallelize_module(a, l.tp_dim, nn::gpt_tensor_parallel_plan(l.cfg, true, true));
      nn::materialize(a, 5);
      shard(a, c1, l.options);
      // shard-then-init, counting every byte the mesh allocates
      auto mem = std::make_shared<nn::TrackingAllocator>();
      auto c2 = MeshComms::create(mesh, world, {}, mem);
      nn::GPT b(nn::ModuleOptions{c2, DType::kF32, {}}, l.cfg);
      if (l.tp_dim >= 0) nn::parallelize_module(b, l.tp_dim, nn::gpt_tensor_parallel_plan(l.cfg, true, true));
      shard(b, c2, l.options);
      checks.check(mem->peak_bytes() == 0, l.what + ": fully_shard of a meta model allocated " +
                                               std::to_string(mem->peak_bytes()) + " bytes");
      for (const auto& [n, p] : b.named_parameters()) checks.check(p->is_meta(), n + " is not meta after fully_shard");
      nn::materialize(b, 5);
      // Only the flat shard buffers were ever allocated: no full tensor, no replicated copy.
      int64_t flats = 0;
      for (auto& [n, m] : b.named_modules())
        if (fsdp::FSDPModule* st = fsdp::state(*m)) flats += st->sharded_bytes();
      checks.check(mem->peak_bytes() == flats && mem->live_bytes() == flats,
                   l.what + ": materialising allocated a peak of " + std::to_string(mem->peak_bytes()) +
                       " bytes; the flat shard buffers are " + std::to_string(flats));
      const auto x = shards(a), y = shards(b);
      checks.check(x.size() == y.size() && x.size() > 10, l.what + ": parameter counts differ");
      for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
        checks.check(x[i].first == y[i].first, l.what + ": " + x[i].first + " vs " + y[i].first);
        checks.check(x[i].second == y[i].second, l.what + ": the shard of " + x[i].first + " differs");
      }
      // The parameters are views of their group's flat buffer.
      auto ps = b.blocks()[0].named_parameters();
      for (const auto& [n, p] : ps)
        checks.check(p->data().to_local().shares_storage_with(ps[0].second->data().to_local()),
                     n + " is not a view of its group's flat buffer");
    });
    checks.report();
    ++ran;
  }
  CHECK(ran == static_cast<int>(layouts().size()));
}

TEST_CASE("fsdp meta: a group with a meta parameter refuses to run, naming it; materialise then trains",
          "[fsdp][meta]") {
  testing_support::Checks checks;
  std::vector<double> losses;  // rank 0's, asserted below
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({2}, {"dp_shard"}), world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    shard(model, comms, {});
    const Tensor ids = Tensor::full({4, 8}, 3.0, DType::kI64);
    const DTensor x = dtensor::distribute_tensor(ids, comms, dtensor::parse_placements("S(0)"), std::nullopt);
    nn::Ctx ctx;
    checks.throws<kernels::InvalidArgument>([&] { model.forward(ctx, x); }, "is still meta",
                                            "forward of a meta FSDP model");
    checks.throws<kernels::InvalidArgument>([&] { fsdp::state(model.blocks()[1])->unshard(); },
                                            "parameter 'ln1.weight' is still meta", "unshard of a meta group");
    // Materialising one block alone (its own parameters) leaves the others meta: still refused.
    nn::materialize(model.blocks()[0], 5);
    checks.throws<kernels::InvalidArgument>([&] { fsdp::state(model.blocks()[1])->unshard(); }, "still meta",
                                            "unshard of the other, still meta group");
    nn::materialize(model, 5);
    nn::Ctx ctx2, lctx;
    nn::CrossEntropyLoss loss_fn;
    const DTensor logits = model.forward(ctx2, x);
    const DTensor loss = loss_fn.forward(lctx, logits, x);
    const double v = loss.full_tensor().item({});
    model.backward(ctx2, loss_fn.backward(lctx));
    if (world.rank() == 0) losses.push_back(v);
  });
  checks.report();
  REQUIRE(losses.size() == 1);
  CHECK(std::isfinite(losses[0]));
}

TEST_CASE("fsdp meta: the note says once that pin_memory is a no-op on the CPU", "[fsdp][meta]") {
  std::string note, plain;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({1}, {"dp_shard"}), world);
    nn::GPT a(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    fsdp::FullyShardOptions o;
    o.offload_policy.offload_to_cpu = true;
    note = fsdp::fully_shard(a, comms, o).note();
    nn::GPT b(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    plain = fsdp::fully_shard(b, comms, {}).note();
  });
  CHECK_THAT(note, Catch::Matchers::Contains("pin_memory is a no-op here"));
  CHECK(plain.empty());
}
