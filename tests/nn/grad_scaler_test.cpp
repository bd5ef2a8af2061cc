// GradScaler (nn/grad_scaler.h): PyTorch's constants and update rule; over sharded gradients an
// inf or NaN on any one rank (a shard, or a replica clip_grad_norm_'s norm does not count) skips
// the step on every rank and backs the scale off; a clean step unscales and clips in one pass.
//
// Rank threads record into Checks / vectors; Catch2 asserts on the test thread only.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <mutex>

#include "kernels/ops/elementwise.h"
#include "nn/grad_scaler.h"
#include "nn_support.h"
#include "support/checks.h"

using namespace nn;
using namespace nn_test;

TEST_CASE("grad scaler: PyTorch's constants and update rule", "[nn][optim][scaler]") {
  GradScaler s;
  CHECK(s.scale() == 65536.0);
  CHECK(s.options().growth_factor == 2.0);
  CHECK(s.options().backoff_factor == 0.5);
  CHECK(s.options().growth_interval == 2000);
  s.update(true);
  CHECK(s.scale() == 32768.0);
  int64_t clean = 0;
  for (; clean < 1999; ++clean) s.update(false);
  CHECK(s.scale() == 32768.0);
  CHECK(s.growth_tracker() == 1999);
  s.update(false);
  ++clean;
  CHECK(clean == 2000);
  CHECK(s.scale() == 65536.0);
  CHECK(s.growth_tracker() == 0);
  s.update(false);
  s.update(true);  // an overflow restarts the count
  CHECK(s.growth_tracker() == 0);
  CHECK(s.scale() == 32768.0);
  CHECK_THROWS_WITH(GradScaler(GradScalerOptions{.init_scale = 0}), Catch::Contains("init_scale 0"));
  CHECK_THROWS_WITH(GradScaler(GradScalerOptions{.growth_factor = 1}), Catch::Contains("growth_factor 1"));
  CHECK_THROWS_WITH(GradScaler(GradScalerOptions{.backoff_factor = 1}), Catch::Contains("backoff_factor 1"));
  CHECK_THROWS_WITH(GradScaler(GradScalerOptions{.growth_interval = 0}), Catch::Contains("growth_interval 0"));
}

TEST_CASE("grad scaler: an inf on one rank skips the step on every rank", "[nn][optim][scaler]") {
  // 2x2 mesh: a gradient sharded over both dims, one replicated. Cases: clean; an inf in rank 2's
  // shard; a NaN in rank 3's copy of the replicated gradient (clip_grad_norm_ counts replicas on
  // coordinate 0 only, so its norm alone would not see it).
  struct Seen {
    bool stepped;
    double scale_after, norm;
    bool untouched;  // the gradients left as they were
  };
  std::mutex mu;
  std::vector<std::vector<Seen>> seen(3);
  std::atomic<int> norm_misses_replica{0};
  testing_support::Checks checks;
  for (int c = 0; c < 3; ++c) {
    on_mesh({2, 2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      auto a = std::make_shared<Parameter>(comms, Dims{6, 4}, DType::kF32, Init::zeros(),
                                           dtensor::parse_placements("S(0),S(1)"));
      auto b = std::make_shared<Parameter>(comms, Dims{3}, DType::kF32, Init::zeros(), dtensor::parse_placements("R,R"));
      NamedParameters params{{"a", a}, {"b", b}};
      double want = 0;
      for (auto& [n, p] : params) {
        p->materialize(0, n);
        Tensor full = values(p->shape(), static_cast<int>(n[0]), DType::kF32);
        for (double v : full.to_vector()) want += v * v;
        kernels::scale_out(full, full, 1024.0);  // the loss scale the gradients carry
        p->grad() = dtensor::distribute_tensor(full, comms, p->placements(), std::nullopt);
      }
      if (c == 1 && world.rank() == 2) Tensor(a->grad()->to_local()).set_item({0, 0}, INFINITY);
      if (c == 2 && world.rank() == 3) Tensor(b->grad()->to_local()).set_item({1}, NAN);
      if (c == 2 && std::isfinite(clip_grad_norm_(params, 0.0))) ++norm_misses_replica;
      const Tensor before = a->grad()->to_local().clone();
      GradScaler scaler(GradScalerOptions{.init_scale = 1024.0});
      const ScaledStep s = scaler.unscale_clip_(params, 0.0);
      const bool untouched = kernels::equal(a->grad()->to_local(), before);
      if (c == 0) {
        // Unscaled: the gradients are the values again (1024 is a power of two: exact).
        const Tensor full = values(a->shape(), 'a', DType::kF32);
        checks.check(kernels::equal(a->grad()->full_tensor(), full), "clean: not unscaled");
        checks.check(std::abs(s.norm - std::sqrt(want)) < 1e-3 * std::sqrt(want), "clean: the unscaled norm");
      }
      std::lock_guard lk(mu);
      seen[c].push_back({s.stepped, scaler.scale(), s.norm, untouched});
    });
  }
  checks.report();
  int64_t ranks = 0;
  for (int c = 0; c < 3; ++c) {
    CAPTURE(c);
    REQUIRE(seen[c].size() == 4);
    for (const Seen& s : seen[c]) {
      CHECK(s.stepped == (c == 0));
      CHECK(s.scale_after == (c == 0 ? 1024.0 : 512.0));
      CHECK(s.untouched == (c != 0));
      ++ranks;
    }
  }
  CHECK(ranks == 12);
  CHECK(norm_misses_replica > 0);  // the NaN on a replica: only the flag catches it
}
