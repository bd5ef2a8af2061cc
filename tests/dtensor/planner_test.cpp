// Planner: PyTorch's greedy collective counts (docs/pytorch-semantics.md 4.2 and 6.2), symbolic
// apply == dst for every pair, search never worse than greedy, traffic vs the lower bound.
#include <catch2/catch.hpp>

#include "support/placement_lists.h"

#include "dtensor/plan/planner.h"
#include "kernels/error.h"

using namespace dtensor;
using Catch::Contains;

namespace {

DTensorSpec spec_of(const Dims& mesh, const Dims& shape, const char* placements,
                    kernels::DType dtype = kernels::DType::kF32) {
  return make_spec(std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh)),
                   parse_placements(placements), shape, dtype);
}

Plan greedy(const Dims& mesh, const Dims& shape, const char* from, const char* to) {
  return plan_redistribute(spec_of(mesh, shape, from), parse_placements(to), PlannerKind::kGreedy);
}

}  // namespace

TEST_CASE("greedy routes match PyTorch's worked plans", "[dtensor][planner]") {
  CHECK(to_string(greedy({2, 2}, {8, 8}, "S(0),S(1)", "S(0),S(0)")) ==
        "[S(0),S(1)] -A2A(1:1->0)-> [S(0),S(0)]");
  CHECK(to_string(greedy({2, 2}, {8, 8}, "S(0),S(1)", "S(1),S(0)")) ==
        "[S(0),S(1)] -AG(1)-> [S(0),R] -A2A(0:0->1)-> [S(1),R] -chunk(1->S(0))-> [S(1),S(0)]");
  CHECK(to_string(greedy({2, 2}, {8, 8}, "S(0),S(0)", "S(1),S(1)")) ==
        "[S(0),S(0)] -AG(1)-> [S(0),R] -A2A(0:0->1)-> [S(1),R] -chunk(1->S(1))-> [S(1),S(1)]");
  CHECK(to_string(greedy({2, 2, 2}, {8, 8, 8}, "S(1),R,S(0)", "R,S(0),S(0)")) ==
        "[S(1),R,S(0)] -AG(2)-> [S(1),R,R] -chunk(1->S(0))-> [S(1),S(0),R] -AG(0)-> [R,S(0),R] "
        "-chunk(2->S(0))-> [R,S(0),S(0)]");
  CHECK(to_string(greedy({2, 2, 2}, {8, 8, 8}, "P,P,S(0)", "S(0),S(0),S(0)")) ==
        "[P,P,S(0)] -AG(2)-> [P,P,R] -AR(1,sum)-> [P,R,R] -RS(0:0,sum)-> [S(0),R,R] "
        "-chunk(1->S(0))-> [S(0),S(0),R] -chunk(2->S(0))-> [S(0),S(0),S(0)]");
  CHECK(to_string(greedy({2, 2, 2}, {8, 8, 8}, "P,P,P", "S(0),S(0),S(1)")) ==
        "[P,P,P] -RS(0:0,sum)-> [S(0),P,P] -RS(1:0,sum)-> [S(0),S(0),P] -RS(2:1,sum)-> [S(0),S(0),S(1)]");
  CHECK(to_string(greedy({4}, {8}, "S(0)", "S(0)")) == "[S(0)]");
}

TEST_CASE("greedy collective counts of PyTorch's test_redistribute (6.2)", "[dtensor][planner]") {
  struct Case { Dims mesh; Dims shape; std::string from, to; int comms; };
  std::vector<Case> cases = {
      {{4}, {13, 3}, "S(0)", "R", 1}, {{4}, {3, 14}, "S(1)", "R", 1}, {{4}, {12, 3}, "R", "S(0)", 0},
      {{4}, {13, 3}, "P", "S(0)", 1}, {{4}, {13, 3}, "P", "R", 1}, {{4}, {8, 5}, "S(0)", "S(1)", 1},
      {{2, 2}, {10, 5}, "S(0),S(1)", "S(0),S(0)", 1}, {{2, 2}, {9, 5}, "S(0),S(1)", "S(1),S(0)", 2},
      {{2, 2}, {3, 5}, "S(0),S(0)", "S(1),S(1)", 2}, {{2, 2}, {8, 8, 8}, "S(0),S(2)", "S(1),S(0)", 2},
      {{2, 2}, {8, 8, 8}, "S(1),S(1)", "S(1),S(2)", 1},
      {{2, 2, 2}, {8, 8, 8}, "S(0),S(0),S(0)", "S(1),S(1),S(1)", 3},
      {{2, 2, 2}, {8, 8, 8}, "S(0),S(1),S(0)", "S(1),S(0),S(0)", 3},
      {{2, 2, 2}, {8, 8, 8}, "S(0),S(1),S(2)", "S(2),S(1),S(0)", 2},
      {{2, 2, 2}, {8, 8, 8}, "S(1),S(0),S(0)", "R,S(0),S(0)", 1},
      {{2, 2, 2}, {8, 8, 8}, "S(1),R,S(0)", "R,S(0),S(0)", 2},
      {{2, 2, 2}, {8, 8, 8}, "S(0),S(0),S(1)", "S(0),S(1),S(2)", 2},
  };
  // Mesh (4,1): any (S0, x) -> (S0, y): no communication on the size-1 dim.
  for (const char* x : {"S(1)", "R", "P"})
    for (const char* y : {"S(0)", "S(1)", "R"})
      cases.push_back({{4, 1}, {8, 8}, std::string("S(0),") + x, std::string("S(0),") + y, 0});
  for (const Case& c : cases) {
    INFO(c.from << " -> " << c.to);
    Plan p = greedy(c.mesh, c.shape, c.from.c_str(), c.to.c_str());
    CHECK(p.collectives() == c.comms);
  }
}

TEST_CASE("Partial rules", "[dtensor][planner]") {
  auto plan = [](const char* from, const char* to) { return greedy({2, 2}, {8, 8}, from, to); };
  CHECK_NOTHROW(plan("P,S(0)", "P,S(0)"));
  CHECK_NOTHROW(plan("P,S(0)", "P,S(1)"));
  CHECK_NOTHROW(plan("S(0),P", "R,P"));
  CHECK_NOTHROW(plan("S(0),P(prod)", "R,P(prod)"));
  CHECK_THROWS_WITH(plan("S(0),R", "S(0),P"), Contains("would create a new Partial"));
  CHECK_THROWS_WITH(plan("S(0),R", "R,P"), Contains("would create a new Partial"));
  // PyTorch 2.15: a Shard may become P(sum) (a local zero-fill); nothing else turns Partial.
  // PyTorch's greedy order (inner mesh dim first): the all-gather then moves the zero-filled
  // columns too; the search gathers first.
  CHECK(to_string(plan("S(0),S(1)", "R,P")) ==
        "[S(0),S(1)] -embed(1:S(1)->P(sum))-> [S(0),P] -AG(0)-> [R,P]");
  CHECK(to_string(plan_redistribute(spec_of({2, 2}, {8, 8}, "S(0),S(1)"), parse_placements("R,P"),
                                    PlannerKind::kSearch)) ==
        "[S(0),S(1)] -AG(0)-> [R,S(1)] -embed(1:S(1)->P(sum))-> [R,P]");
  CHECK_THROWS_WITH(plan("S(0),S(1)", "R,P(avg)"), Contains("only a Shard becomes Partial, and only P(sum)"));
  CHECK_THROWS_WITH(plan("S(0),_S(1,2)", "S(0),P"), Contains("only a Shard becomes Partial"));
  CHECK_THROWS_WITH(plan("S(0),P(prod)", "R,P(sum)"), Contains("changes the reduce op"));
  CHECK_THROWS_AS(plan("P(sum),R", "P(avg),R"), kernels::Unsupported);
  CHECK_THROWS_WITH(plan("P(max),P(sum)", "R,R"), Contains("mix Partial ops"));
  CHECK_NOTHROW(plan("P(sum),P(avg)", "R,R"));
  // The internal R -> P partition (distribute_tensor) is allowed on request.
  CHECK(to_string(plan_redistribute(spec_of({4}, {8}, "R"), parse_placements("P(avg)"),
                                    PlannerKind::kGreedy, {}, true)) == "[R] -partial(0,avg)-> [P(avg)]");
}

namespace {

const std::vector<Placement> kSources = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}, Partial{}};
const std::vector<Placement> kTargets = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}};

}  // namespace

TEST_CASE("every plan reaches its target symbolically; search never costs more than greedy",
          "[dtensor][planner][exhaustive]") {
  int64_t pairs = 0, strictly_better = 0;
  for (const Dims& mesh : std::vector<Dims>{{4}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}})
    for (const Dims& shape : std::vector<Dims>{{7, 5}, {64, 48}})
      for (const Placements& src : testing_support::placement_lists(mesh.size(), kSources))
        for (const Placements& dst : testing_support::placement_lists(mesh.size(), kTargets)) {
          DTensorSpec s = spec_of(mesh, shape, to_string(src).c_str());
          Plan g = plan_redistribute(s, dst, PlannerKind::kGreedy);
          Plan q = plan_redistribute(s, dst, PlannerKind::kSearch);
          for (const Plan* p : {&g, &q}) {
            Placements state = src;
            for (const Step& step : p->steps) {
              REQUIRE(is_valid_step(step, state, shape, mesh));
              state = apply_step(step, state);
            }
            REQUIRE(state == dst);
          }
          INFO(to_string(g) << " vs " << to_string(q));
          REQUIRE(q.cost_us <= g.cost_us + 1e-6);
          strictly_better += q.cost_us < g.cost_us - 1e-6;
          ++pairs;
        }
  INFO(pairs << " pairs, search strictly cheaper on " << strictly_better);
  CHECK(strictly_better > 0);
}

TEST_CASE("single-mesh-dim transitions move exactly the lower bound", "[dtensor][planner][traffic]") {
  // A transition of one mesh dim that one primitive performs (greedy plans it as that step, or
  // as PyTorch's route through Replicate for strided <-> shard): the one-step plan receives
  // exactly what each rank needs (per rank); the search plan is that step or something cheaper.
  int64_t checked = 0;
  for (const Dims& mesh : std::vector<Dims>{{4}, {3}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}})
    for (const Dims& shape : std::vector<Dims>{{7, 5}, {8, 6}, {13, 2}, {0, 3}})
      for (const Placements& src : testing_support::placement_lists(mesh.size(), kSources))
        for (int m = 0; m < mesh.size(); ++m)
          for (const Placement& to : kTargets) {
            std::optional<Step> step = step_between(m, src[m], to, /*direct=*/true);
            if (!step || !is_valid_step(*step, src, shape, mesh)) continue;
            Placements dst = apply_step(*step, src);
            DTensorSpec s = spec_of(mesh, shape, to_string(src).c_str());
            Plan g = plan_redistribute(s, dst, PlannerKind::kGreedy);
            Plan q = plan_redistribute(s, dst, PlannerKind::kSearch);
            Traffic lb = lower_bound_traffic(s, dst);
            INFO(to_string(g) << " / " << to_string(q) << " shape [" << shape[0] << "," << shape[1] << "]");
            REQUIRE(q.cost_us <= g.cost_us + 1e-6);
            // A reduction is uneven when some group's extent (its members' local size) does not
            // divide by k, or when groups hold different amounts.
            const bool reduces = std::holds_alternative<ReduceScatter>(*step) || std::holds_alternative<AllReduce>(*step);
            bool uneven_reduction = false;
            if (reduces) {
              const int64_t first = s.layout(0)->local_shape.product();
              for (int rank : s.mesh->ranks()) {
                const ShardLayout l = *s.layout(rank);
                uneven_reduction |= l.local_shape.product() != first;
                if (const auto* rs = std::get_if<ReduceScatter>(&*step))
                  uneven_reduction |= l.local_shape[rs->tensor_dim] % mesh[m] != 0;
              }
            }
            for (const Plan* p : {&g, &q})
              if (p->steps.size() == 1) {
                if (uneven_reduction) {
                  // The owner of the largest chunk receives (k-1) copies of it, and the mesh-wide
                  // bound averages over groups of different sizes: at or above it.
                  REQUIRE(p->traffic.max_received() >= lb.max_received());
                } else if (reduces) {
                  // Groups holding disjoint data (every other mesh dim shards) meet the bound; with
                  // a replicated mesh dim the groups repeat each other's reduction, which a plan
                  // could avoid (reduce a part per replica, then gather).
                  bool disjoint = true;
                  for (int i = 0; i < mesh.size(); ++i)
                    disjoint = disjoint && (i == m || mesh[i] == 1 || shard_dim(src[i]).has_value());
                  if (disjoint) REQUIRE(p->traffic.max_received() == lb.max_received());
                  else REQUIRE(p->traffic.max_received() >= lb.max_received());
                } else {
                  REQUIRE(p->traffic.received == lb.received);  // per rank, not only the busiest
                }
                ++checked;
              }
          }
  CHECK(checked > 500);
}

TEST_CASE("search moves no more bytes than greedy on multi-dim pairs", "[dtensor][planner][traffic][exhaustive]") {
  // Bandwidth-dominated sizes (the cost model trades bytes for latency only on tiny tensors).
  for (const Dims& mesh : std::vector<Dims>{{2, 2}, {2, 3}, {2, 2, 2}})
    for (const Placements& src : testing_support::placement_lists(mesh.size(), kSources))
      for (const Placements& dst : testing_support::placement_lists(mesh.size(), kTargets)) {
        DTensorSpec s = spec_of(mesh, {1024, 768}, to_string(src).c_str());
        Plan g = plan_redistribute(s, dst, PlannerKind::kGreedy);
        Plan q = plan_redistribute(s, dst, PlannerKind::kSearch);
        INFO(to_string(g) << " vs " << to_string(q));
        REQUIRE(q.traffic.max_received() <= g.traffic.max_received());
      }
}
