// Every (src, dst) pair over {R, S(0), S(1), P} x {R, S(0), S(1)} per mesh dim on meshes {4},
// {2,2}, {2,3}, {3,2}, {2,2,2} with uneven shapes, both planners, every rank's data checked on the
// local backend; StridedShard pairs incl. the uneven first-mesh-dim-3 case; batched redistribute.
#include <catch2/catch.hpp>

#include "support/placement_lists.h"
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "collectives/local.h"
#include "dtensor/exec/executor.h"
#include "kernels/error.h"
#include "support/catch2_runner.h"
#include "support/checks.h"
#include "support/dtensor_data.h"

using namespace dtensor;
using collectives::Communicator;
using testing_support::check_local;
using testing_support::make_local;

namespace {

struct Outcome {
  int64_t cases = 0;
  std::vector<std::string> failures;
};

// Runs every pair on one mesh; returns failures (collected on rank 0's thread).
void run_pairs(const Dims& mesh_shape, const std::vector<Dims>& shapes,
               const std::vector<Placements>& srcs, const std::vector<Placements>& dsts,
               PlannerKind planner, kernels::DType dtype, Outcome& outcome) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh_shape));
  std::mutex mu;
  PlanCache cache;  // shared by the rank threads: plans are rank-independent
  collectives::run_ranks(static_cast<int>(mesh->size()), [&](Communicator& world) {
    MeshComms comms(*mesh, world);
    int64_t index = 0;  // the same on every rank: they skip the same cases under --sample
    for (const Dims& shape : shapes)
      for (const Placements& src : srcs)
        for (const Placements& dst : dsts) {
          if (!test_support::sampled(index++)) continue;
          DTensorSpec s = make_spec(mesh, src, shape, dtype);
          DTensorSpec d = make_spec(mesh, dst, shape, dtype);
          const Plan& plan = cache.get(s, dst, planner);
          Tensor out = execute(plan, s, make_local(s, world.rank()), comms);
          std::string err = check_local(d, world.rank(), out);
          std::lock_guard lk(mu);
          if (world.rank() == 0) ++outcome.cases;
          if (!err.empty() && outcome.failures.size() < 20)
            outcome.failures.push_back(fmt::format("mesh {} shape [{}] [{}] -> [{}] rank {} ({}): {}; plan {}",
                                                   to_string(*mesh), fmt::join(shape, ","), to_string(src),
                                                   to_string(dst), world.rank(), to_string(planner), err,
                                                   to_string(plan)));
        }
  });
}

}  // namespace

TEST_CASE("exhaustive redistribute over R/S(0)/S(1)/P on small meshes", "[dtensor][redistribute]") {
  const std::vector<Placement> src_options = {Replicate{}, Shard{0}, Shard{1}, Partial{}};
  const std::vector<Placement> dst_options = {Replicate{}, Shard{0}, Shard{1}};
  const std::vector<Dims> meshes = {{4}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}};
  const std::vector<Dims> shapes = {{5, 7}, {8, 3}, {1, 9}, {0, 4}};
  for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch}) {
    Outcome outcome;
    for (const Dims& mesh : meshes)
      run_pairs(mesh, shapes, testing_support::placement_lists(mesh.size(), src_options), testing_support::placement_lists(mesh.size(), dst_options),
                planner, kernels::DType::kF32, outcome);
    INFO(outcome.cases << " cases with planner " << to_string(planner));
    for (const auto& f : outcome.failures) FAIL_CHECK(f);
    CHECK(outcome.cases > 1000 / test_support::sample_stride());
  }
}

TEST_CASE("StridedShard transitions, uneven and with a first mesh dim of 3", "[dtensor][redistribute][strided]") {
  const std::vector<Placement> options = {Replicate{}, Shard{0}, StridedShard{0, 2}, StridedShard{0, 3}, Shard{1}};
  for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch}) {
    Outcome outcome;
    for (const Dims& mesh : std::vector<Dims>{{3, 2}, {2, 2}, {4}})
      run_pairs(mesh, {{7, 2}, {8, 3}, {13, 1}}, testing_support::placement_lists(mesh.size(), options), testing_support::placement_lists(mesh.size(), options),
                planner, kernels::DType::kF32, outcome);
    INFO(outcome.cases << " cases with planner " << to_string(planner));
    for (const auto& f : outcome.failures) FAIL_CHECK(f);
    // 3 shapes x (25 x 25 pairs on each 2-D mesh, 5 x 5 on {4}), sampled per mesh.
    CHECK(outcome.cases == 2 * test_support::sampled_count(3 * 25 * 25) + test_support::sampled_count(3 * 5 * 5));
  }
}

TEST_CASE("other dtypes and Partial ops", "[dtensor][redistribute]") {
  Outcome outcome;
  std::vector<Placements> srcs;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd})
    for (const Placement& other : std::vector<Placement>{Replicate{}, Shard{0}, Partial{op}})
      srcs.push_back({Partial{op}, other});
  for (kernels::DType dtype : {kernels::DType::kF64, kernels::DType::kBF16, kernels::DType::kI32,
                               kernels::DType::kI64, kernels::DType::kF16})
    run_pairs({2, 3}, {{5, 3}}, srcs, testing_support::placement_lists(2, {Replicate{}, Shard{0}, Shard{1}}), PlannerKind::kGreedy,
              dtype, outcome);
  for (const auto& f : outcome.failures) FAIL_CHECK(f);
  CHECK(outcome.cases == 5 * test_support::sampled_count(15 * 9));  // dtypes x (sources x targets)
}

TEST_CASE("batched redistribute: one collective per step for many tensors", "[dtensor][redistribute][batch]") {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  testing_support::Checks checks;
  int64_t checked = 0;
  std::mutex mu;
  const std::vector<const char*> pairs = {"S(0),S(0)|R,R", "P,S(0)|S(0),R", "R,R|S(1),S(0)", "S(0),S(1)|S(1),S(0)", "P,P|R,R"};
  for (const char* pair : pairs) {
    std::string text(pair);
    const Placements src = parse_placements(text.substr(0, text.find('|')));
    const Placements dst = parse_placements(text.substr(text.find('|') + 1));
    collectives::run_ranks(4, [&](Communicator& world) {
      MeshComms comms(*mesh, world);
      std::vector<DTensorSpec> specs, dsts;
      std::vector<Tensor> locals;
      for (const Dims& shape : std::vector<Dims>{{8, 4}, {5, 3}, {1, 6}, {0, 2}, {12, 12}}) {
        specs.push_back(make_spec(mesh, src, shape, kernels::DType::kF32));
        dsts.push_back(make_spec(mesh, dst, shape, kernels::DType::kF32));
        locals.push_back(make_local(specs.back(), world.rank()));
      }
      Plan plan = plan_redistribute(specs[0], dst, PlannerKind::kGreedy);
      std::vector<Tensor> out = execute_batch(plan, specs, locals, comms);
      for (size_t i = 0; i < out.size(); ++i) {
        const std::string err = check_local(dsts[i], world.rank(), out[i]);
        checks.check(err.empty(), fmt::format("{} tensor {} rank {}: {}", text, i, world.rank(), err));
        std::lock_guard lk(mu);
        ++checked;
      }
    });
  }
  checks.report();
  CHECK(checked == static_cast<int64_t>(pairs.size()) * 4 * 5);
}
