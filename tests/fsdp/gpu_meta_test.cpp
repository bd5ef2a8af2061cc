// [gpu] Shard first on a CUDA device (issue 26): a meta GPT whose parameters live on cuda:0 is
// sharded (FSDP 2, FSDP x TP 2x2) and then materialised; every rank's shard is written straight
// into its group's flat buffer in device memory (the only device bytes the mesh allocates), and
// equals, bit for bit, the shard of the same model materialised on the CPU before sharding.
// Exits 77 (skipped) without a GPU.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/device.h"
#include "nn/memory.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::MeshComms;
using kernels::Device;
using kernels::DType;
using kernels::Tensor;

nn::GPTConfig small() {
  nn::GPTConfig c;
  c.vocab = 20;
  c.dim = 16;
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 8;
  c.bias = true;
  return c;
}

void shard(nn::GPT& model, const std::shared_ptr<MeshComms>& comms) {
  for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms);
  fsdp::fully_shard(model, comms);
}

// This rank's shard of every parameter as bytes (copied to the host), named with its device.
std::vector<std::pair<std::string, std::vector<unsigned char>>> shards(nn::GPT& model) {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> out;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor t = p->data().to_local().to(Device{}).contiguous();
    std::vector<unsigned char> bytes(t.nbytes());
    if (!bytes.empty()) std::memcpy(bytes.data(), t.data_ptr(), bytes.size());
    out.emplace_back(name, std::move(bytes));
  }
  return out;
}

}  // namespace

TEST_CASE("fsdp meta [gpu]: shard then materialise on CUDA equals the CPU's init-then-shard", "[gpu][fsdp][meta]") {
  struct Case {
    std::string what;
    Dims mesh;
    std::vector<std::string> names;
    int tp_dim;
  };
  const std::vector<Case> cases = {{"FSDP 2", {2}, {"dp_shard"}, -1},
                                   {"FSDP x TP 2x2", {2, 2}, {"dp_shard", "tp"}, 1}};
  const nn::GPTConfig cfg = small();
  int ran = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    testing_support::Checks checks;
    const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh, c.names);
    collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
      // The reference: materialised on the CPU, then sharded.
      auto c1 = MeshComms::create(mesh, world);
      nn::GPT a(nn::ModuleOptions{c1, DType::kF32, {}}, cfg);
      if (c.tp_dim >= 0) nn::parallelize_module(a, c.tp_dim, nn::gpt_tensor_parallel_plan(cfg, true, true));
      nn::materialize(a, 5);
      shard(a, c1);
      // On cuda:0, meta until after fully_shard; the mesh's allocator counts every device byte.
      auto mem = std::make_shared<nn::TrackingAllocator>();
      auto c2 = MeshComms::create(mesh, world, {}, mem);
      nn::GPT b(nn::ModuleOptions{c2, DType::kF32, Device::cuda(0)}, cfg);
      if (c.tp_dim >= 0) nn::parallelize_module(b, c.tp_dim, nn::gpt_tensor_parallel_plan(cfg, true, true));
      shard(b, c2);
      checks.check(mem->peak_bytes() == 0, c.what + ": fully_shard of a meta model allocated");
      nn::materialize(b, 5);
      int64_t flats = 0;
      for (auto& [n, m] : b.named_modules())
        if (fsdp::FSDPModule* st = fsdp::state(*m)) flats += st->sharded_bytes();
      checks.check(flats > 0 && mem->peak_bytes() == flats,
                   c.what + ": materialising on CUDA allocated a peak of " + std::to_string(mem->peak_bytes()) +
                       " bytes; the flat shard buffers are " + std::to_string(flats));
      for (const auto& [n, p] : b.named_parameters())
        checks.check(p->data().to_local().device() == Device::cuda(0), n + " is not on cuda:0");
      const auto x = shards(a), y = shards(b);
      checks.check(x.size() == y.size() && x.size() > 10, c.what + ": parameter counts differ");
      for (size_t i = 0; i < x.size() && i < y.size(); ++i)
        checks.check(x[i].first == y[i].first && x[i].second == y[i].second,
                     c.what + ": the shard of " + x[i].first + " differs from the CPU's");
    });
    checks.report();
    ++ran;
  }
  CHECK(ran == 2);
}
