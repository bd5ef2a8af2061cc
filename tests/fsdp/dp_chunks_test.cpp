// fully_shard's layout check without a layout per rank (issue 25 item 2): fsdp::check_dp_chunks
// (placements, mesh shape and global shape only) agrees with the rank-by-rank reference on every
// small mesh and shape of the sweep, valid and refused alike; and fully_shard sets up a meta GPT
// (examples/fsdp-train's default model) as one rank of meshes of 16,384 ranks, fast.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/dtensor.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/placement.h"
#include "fsdp/dp_chunks.h"
#include "fsdp/fully_shard.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"

namespace {

nn::GPTConfig small_gpt() {  // examples/fsdp-train's default model
  nn::GPTConfig cfg;
  cfg.vocab = 64;
  cfg.dim = 64;
  cfg.heads = 4;
  cfg.layers = 2;
  cfg.max_seq = 32;
  cfg.bias = false;
  return cfg;
}

using dtensor::DeviceMesh;
using dtensor::Placements;
using kernels::Dims;

// One member of a world of any size that can be split (fully_shard's setup) but runs no
// collective: setting up one rank of a mesh too big for threads.
class SetupOnlyCommunicator final : public collectives::Communicator {
 public:
  SetupOnlyCommunicator(int rank, std::vector<int> ranks, std::string name)
      : Communicator(rank, std::move(ranks), std::move(name), collectives::kDefaultTimeout) {}
  static std::unique_ptr<SetupOnlyCommunicator> world(int size, int rank) {
    std::vector<int> ranks(static_cast<size_t>(size));
    for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
    return std::make_unique<SetupOnlyCommunicator>(rank, std::move(ranks), "world");
  }
  std::string_view backend() const override { return "setup-only"; }
  void wait_for(const collectives::WorkPtr&) override { refuse("wait_for"); }
  collectives::WorkPtr host_task(std::function<void()>) override { refuse("host_task"); }
  void begin_batch() override { refuse("begin_batch"); }
  collectives::WorkPtr end_batch() override { refuse("end_batch"); }
  std::unique_ptr<collectives::Communicator> split(std::span<const int> group, std::string name) override {
    std::vector<int> ranks;
    int me = -1;
    for (int g : group) {
      if (g == rank()) me = static_cast<int>(ranks.size());
      ranks.push_back(this->ranks()[static_cast<size_t>(g)]);
    }
    if (me < 0) throw std::logic_error("split: this member is not in its group");
    return std::make_unique<SetupOnlyCommunicator>(me, std::move(ranks), std::move(name));
  }

 protected:
  collectives::WorkPtr issue(const collectives::Call&) override { refuse("a collective"); }

 private:
  [[noreturn]] void refuse(const char* what) const {
    throw std::logic_error(std::string("setup-only communicator: ") + what + " issued during setup");
  }
};

std::string str(const Dims& d) { return fmt::format("{}", d); }

std::string text(const std::optional<fsdp::DpChunkVerdict>& v) {
  if (!v) return "valid";
  return (v->kind == fsdp::DpChunkVerdict::kIndivisible ? "indivisible " : "not chunks ") + std::to_string(v->size);
}

}  // namespace

TEST_CASE("dp chunk check: agrees with the rank-by-rank reference on small meshes, valid and refused",
          "[fsdp][dp-chunks]") {
  // Meshes of the fsdp tests (FSDP 1-4, HSDP 2x2, FSDP x TP 2x2 and 3x2, HSDP x TP 2x2x2) and more:
  // tp before dp, tp groups of 3 and 4, two tp dims. dp_dims: the Replicate-only data-parallel dims.
  struct MeshCase {
    Dims shape;
    int shard;                // the dp shard mesh dim
    std::vector<int> tp;      // mesh dims that may shard the tensor
  };
  const std::vector<MeshCase> meshes = {
      {{1}, 0, {}},          {{2}, 0, {}},          {{3}, 0, {}},       {{4}, 0, {}},
      {{2, 2}, 1, {}},       {{2, 2}, 0, {1}},      {{3, 2}, 0, {1}},   {{2, 2, 2}, 1, {2}},
      {{2, 3}, 0, {1}},      {{4, 2}, 0, {1}},      {{3, 4}, 0, {1}},   {{2, 3}, 1, {0}},
      {{2, 2, 3}, 0, {1, 2}}, {{3, 2, 2}, 1, {0, 2}},
  };
  const std::vector<int64_t> sizes = {1, 2, 3, 5, 6, 7, 8, 12, 13, 16, 20, 24, 50, 64};
  int ran = 0, valid = 0, refused = 0, indivisible = 0;
  for (const MeshCase& mc : meshes) {
    const int nd = static_cast<int>(mc.shape.size());
    // Every assignment of Replicate / Shard(0) / Shard(1) to the tp dims.
    int64_t combos = 1;
    for (size_t i = 0; i < mc.tp.size(); ++i) combos *= 3;
    for (int64_t combo = 0; combo < combos; ++combo) {
      Placements u(static_cast<size_t>(nd), dtensor::Replicate{});
      int64_t rest = combo;
      for (int m : mc.tp) {
        const int64_t pick = rest % 3;
        rest /= 3;
        if (pick == 1) u[m] = dtensor::Shard{0};
        if (pick == 2) u[m] = dtensor::Shard{1};
      }
      for (int sd : {0, 1}) {
        // fully_shard's dp placement: StridedShard(sd, sf) when later mesh dims split sd.
        Placements sh = u;
        int64_t sf = 1;
        for (int m = mc.shard + 1; m < nd; ++m)
          if (dtensor::shard_dim(u[m]) == sd) sf *= mc.shape[m];
        if (sf > 1) sh[mc.shard] = dtensor::StridedShard{sd, static_cast<int>(sf)};
        else sh[mc.shard] = dtensor::Shard{sd};
        for (int64_t a : sizes)
          for (int64_t b : {int64_t{3}, int64_t{8}, int64_t{13}}) {
            const Dims shape = sd == 0 ? Dims{a, b} : Dims{b, a};
            const auto fast = fsdp::check_dp_chunks(shape, mc.shape, u, sh, mc.shard, sd);
            const auto ref = fsdp::check_dp_chunks_by_rank(shape, mc.shape, u, sh, mc.shard, sd);
            INFO("mesh " << str(mc.shape) << " " << dtensor::to_string(sh) << " shape " << str(shape)
                         << " sd " << sd << ": fast " << text(fast) << ", reference " << text(ref));
            REQUIRE(fast.has_value() == ref.has_value());
            // The kind agrees where only one kind fails (sd == 0 never checks divisibility).
            if (fast && sd == 0) REQUIRE(fast == ref);
            if (fast && fast->kind == fsdp::DpChunkVerdict::kIndivisible) ++indivisible;
            ++ran;
            (fast ? refused : valid) += 1;
          }
      }
    }
  }
  CHECK(ran == 3696);  // 44 placement lists x 2 shard dims x 14 x 3 shapes
  // The sweep holds both verdicts, and uneven FSDP x TP shapes that must be refused.
  CHECK(valid > 0);
  CHECK(refused > indivisible);
  CHECK(indivisible > 0);
}

TEST_CASE("dp chunk check: the uneven FSDP x TP vocab fsdp-train refuses, and the one it runs", "[fsdp][dp-chunks]") {
  const Placements u = dtensor::parse_placements("R,S(0)");
  const Placements sh = dtensor::parse_placements("_S(0,2),S(0)");
  CHECK(fsdp::check_dp_chunks({50, 16}, {3, 2}, u, sh, 0, 0) == std::nullopt);
  CHECK(fsdp::check_dp_chunks_by_rank({50, 16}, {3, 2}, u, sh, 0, 0) == std::nullopt);
  const auto bad = fsdp::check_dp_chunks({13, 16}, {3, 2}, u, sh, 0, 0);
  REQUIRE(bad.has_value());
  CHECK(*bad == fsdp::DpChunkVerdict{fsdp::DpChunkVerdict::kNotChunks, 13});
  CHECK(fsdp::check_dp_chunks_by_rank({13, 16}, {3, 2}, u, sh, 0, 0) == bad);
}

// Timings are printed (INFO) but not asserted: the figures live in the [bench] case below.
TEST_CASE("dp chunk check: meshes of 2^14 to 2^20 ranks, uneven shapes included",
          "[fsdp][dp-chunks][scale]") {
  struct Case {
    Dims mesh, global;
    std::string u, sh;
    int shard, sd;
    bool valid;
  };
  // valid: the expected verdict where the reference is too slow to run (2^20 ranks).
  const std::vector<Case> cases = {
      {{16384}, {64, 64}, "R", "S(0)", 0, 0, true},
      {{1 << 20}, {50257, 64}, "R", "S(0)", 0, 0, true},
      {{2048, 8}, {64, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      {{2048, 8}, {50304, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      {{131072, 8}, {65536, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      {{64, 256, 8}, {64, 64}, "R,R,S(0)", "R,_S(0,8),S(0)", 1, 0, true},
      {{16384}, {64, 16384}, "R", "S(1)", 0, 1, true},
      {{16384}, {64, 100}, "R", "S(1)", 0, 1, false},  // indivisible Shard(1)
      {{2048, 8}, {13, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      {{2048, 8}, {16390, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      {{512, 32}, {1000, 64}, "R,S(0)", "_S(0,32),S(0)", 0, 0, true},
      {{2048, 8}, {50257, 64}, "R,S(0)", "_S(0,8),S(0)", 0, 0, true},
      // Two tp dims splitting the dim: compared per (dp, tp) coordinate, so a smaller mesh.
      {{4, 16, 16}, {1000, 64}, "R,S(0),S(0)", "_S(0,256),S(0),S(0)", 0, 0, true},
  };
  int ran = 0, compared = 0, refused = 0;
  for (const Case& c : cases) {
    const auto u = dtensor::parse_placements(c.u), sh = dtensor::parse_placements(c.sh);
    const auto t0 = std::chrono::steady_clock::now();
    const auto verdict = fsdp::check_dp_chunks(c.global, c.mesh, u, sh, c.shard, c.sd);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    INFO("mesh " << str(c.mesh) << " " << c.sh << " shape " << str(c.global) << ": " << text(verdict) << " in "
                 << ms << " ms");
    if (c.mesh.product() <= 16384) {
      const auto ref = fsdp::check_dp_chunks_by_rank(c.global, c.mesh, u, sh, c.shard, c.sd);
      INFO("reference: " << text(ref));
      CHECK(verdict.has_value() == ref.has_value());
      ++compared;
    } else {
      CHECK(verdict.has_value() != c.valid);
    }
    refused += verdict.has_value();
    ++ran;
  }
  CHECK(compared == 10);
  CHECK(refused >= 1);
  CHECK(ran == 13);
}

TEST_CASE("fully_shard sets up a meta GPT as one rank of 16,384-rank meshes (FSDP, HSDP, FSDP x TP, HSDP x TP)",
          "[fsdp][dp-chunks][scale]") {
  struct Case {
    std::string what;
    Dims mesh;
    std::vector<std::string> names;
    int tp_dim;
  };
  const std::vector<Case> cases = {
      {"FSDP 16384", {16384}, {"dp_shard"}, -1},
      {"HSDP 2 x 8192", {2, 8192}, {"dp_replicate", "dp_shard"}, -1},
      {"FSDP x TP 4096 x 4", {4096, 4}, {"dp_shard", "tp"}, 1},
      {"HSDP x TP 16 x 256 x 4", {16, 256, 4}, {"dp_replicate", "dp_shard", "tp"}, 2},
  };
  const nn::GPTConfig cfg = small_gpt();
  int ran = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh, c.names);
    for (int rank : {0, static_cast<int>(mesh.size()) - 1}) {
      auto world = SetupOnlyCommunicator::world(static_cast<int>(mesh.size()), rank);
      const auto t0 = std::chrono::steady_clock::now();
      auto comms = dtensor::MeshComms::create(mesh, *world);
      nn::GPT model(nn::ModuleOptions{comms, kernels::DType::kF32, {}}, cfg);
      if (c.tp_dim >= 0) nn::parallelize_module(model, c.tp_dim, nn::gpt_tensor_parallel_plan(cfg, true, true));
      for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms);
      fsdp::FSDPModule& root = fsdp::fully_shard(model, comms);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      INFO("rank " << rank << ": set up in " << ms << " ms");
      CHECK(root.sharded_bytes() >= 0);
      for (const auto& [n, p] : model.named_parameters()) CHECK(p->is_meta());
      ++ran;
    }
  }
  CHECK(ran == 8);
}

TEST_CASE("fully_shard setup time and the layout check, by rank vs from placements, 8 to 16,384 ranks",
          "[.][bench]") {
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const nn::GPTConfig cfg = small_gpt();
  struct Case {
    Dims mesh;
    std::vector<std::string> names;
    int tp_dim, shard_dim;
  };
  const std::vector<Case> cases = {
      {{8}, {"dp_shard"}, -1, 0},          {{64}, {"dp_shard"}, -1, 0},
      {{1024}, {"dp_shard"}, -1, 0},       {{16384}, {"dp_shard"}, -1, 0},
      {{2, 4}, {"dp_shard", "tp"}, 1, 0},  {{16, 4}, {"dp_shard", "tp"}, 1, 0},
      {{256, 4}, {"dp_shard", "tp"}, 1, 0}, {{4096, 4}, {"dp_shard", "tp"}, 1, 0},
  };
  for (const Case& c : cases) {
    const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh, c.names);
    const int world_size = static_cast<int>(mesh.size());
    std::vector<double> setup, fast, by_rank;
    const int reps = world_size >= 4096 ? 3 : 7;
    for (int i = 0; i < reps; ++i) {
      auto world = SetupOnlyCommunicator::world(world_size, 0);
      auto comms = dtensor::MeshComms::create(mesh, *world);
      nn::GPT model(nn::ModuleOptions{comms, kernels::DType::kF32, {}}, cfg);
      if (c.tp_dim >= 0) nn::parallelize_module(model, c.tp_dim, nn::gpt_tensor_parallel_plan(cfg, true, true));
      auto t0 = Clock::now();
      for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms);
      fsdp::fully_shard(model, comms);
      setup.push_back(ms_since(t0));
      // The check alone, per parameter, both ways (the sharded placements back to the tp ones).
      double f = 0, r = 0;
      for (const auto& [n, p] : model.named_parameters()) {
        const Placements sh = p->placements();
        Placements u = sh;
        u[c.shard_dim] = dtensor::Replicate{};
        const int sd = dtensor::shard_dim(sh[c.shard_dim]).value_or(0);
        t0 = Clock::now();
        const auto a = fsdp::check_dp_chunks(p->shape(), c.mesh, u, sh, c.shard_dim, sd);
        f += ms_since(t0);
        t0 = Clock::now();
        const auto b = fsdp::check_dp_chunks_by_rank(p->shape(), c.mesh, u, sh, c.shard_dim, sd);
        r += ms_since(t0);
        CHECK(a.has_value() == b.has_value());
      }
      fast.push_back(f);
      by_rank.push_back(r);
    }
    const double s = median(setup), f = median(fast), r = median(by_rank);
    std::cout << fmt::format(
        "mesh {:<12} setup (new) {:>9.3f} ms; check from placements {:>8.3f} ms, by rank {:>10.3f} ms; "
        "setup with the by-rank check ~{:>10.3f} ms\n",
        str(c.mesh), s, f, r, s - f + r);
  }
}

TEST_CASE("fully_shard refuses the layouts the check refuses, naming the parameter", "[fsdp][dp-chunks]") {
  nn::GPTConfig cfg;
  cfg.vocab = 13;  // 13 rows over tp 2 and dp 3: the dp shards are not chunks of the tp shards
  cfg.dim = 16;
  cfg.heads = 2;
  cfg.layers = 1;
  cfg.max_seq = 8;
  int ran = 0;
  for (int rank : {0, 5}) {
    const DeviceMesh mesh = DeviceMesh::from_shape({3, 2}, {"dp_shard", "tp"});
    auto world = SetupOnlyCommunicator::world(6, rank);
    auto comms = dtensor::MeshComms::create(mesh, *world);
    nn::GPT model(nn::ModuleOptions{comms, kernels::DType::kF32, {}}, cfg);
    nn::parallelize_module(model, 1, nn::gpt_tensor_parallel_plan(cfg, true, true));
    try {
      fsdp::fully_shard(model, comms);
      FAIL("uneven FSDP x TP accepted on rank " << rank);
    } catch (const kernels::Unsupported& e) {
      CHECK_THAT(e.what(), Catch::Contains("the dp shards are not chunks of the tensor-parallel shard") &&
                               Catch::Contains("size 13"));
    }
    ++ran;
  }
  {
    // Shard(1) of 16 columns over 3 dp ranks: indivisible.
    const DeviceMesh mesh = DeviceMesh::from_shape({3}, {"dp_shard"});
    auto world = SetupOnlyCommunicator::world(3, 1);
    auto comms = dtensor::MeshComms::create(mesh, *world);
    cfg.vocab = 12;
    nn::GPT model(nn::ModuleOptions{comms, kernels::DType::kF32, {}}, cfg);
    fsdp::FullyShardOptions o;
    o.shard_placement_fn = [](const std::string&, const nn::Parameter& p) -> std::optional<int> {
      return p.shape().size() == 2 ? std::optional<int>(1) : std::nullopt;
    };
    try {
      fsdp::fully_shard(model, comms, o);
      FAIL("indivisible Shard(1) accepted");
    } catch (const kernels::InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains("Shard(1) over 3 dp ranks needs dim 1") &&
                               Catch::Contains("(size 16 on a tensor-parallel shard) divisible by 3"));
    }
    ++ran;
  }
  CHECK(ran == 3);
}
