// Planner: PyTorch's greedy collective counts (dtensor-semantics.md 4.2 and 6.2), symbolic
// apply == dst for every pair, search never worse than greedy, traffic vs the lower bound.
#include <catch2/catch.hpp>

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
  CHECK_THROWS_WITH(plan("S(0),S(1)", "R,P"), Contains("a shard cannot become Partial"));
  CHECK_THROWS_WITH(plan("S(0),P(prod)", "R,P(sum)"), Contains("changes the reduce op"));
  CHECK_THROWS_AS(plan("P(sum),R", "P(avg),R"), kernels::Unsupported);
  CHECK_THROWS_WITH(plan("P(max),P(sum)", "R,R"), Contains("mix Partial ops"));
  CHECK_NOTHROW(plan("P(sum),P(avg)", "R,R"));
  // The internal R -> P partition (distribute_tensor) is allowed on request.
  CHECK(to_string(plan_redistribute(spec_of({4}, {8}, "R"), parse_placements("P(avg)"),
                                    PlannerKind::kGreedy, {}, true)) == "[R] -partial(0,avg)-> [P(avg)]");
}
