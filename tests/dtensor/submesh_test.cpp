// Sub-meshes without new communicators: a DTensor re-viewed on an equivalent mesh (flattening /
// unflattening) with no communication, and FSDP's reshard_after_forward=k done purely as
// placement transitions on a dp mesh and its unflattening, on local ranks.
#include <catch2/catch.hpp>

#include "support/checks.h"
#include "support/dtensor_data.h"
#include "support/redistribute_check.h"

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/error.h"

using namespace dtensor;
using collectives::Communicator;
using testing_support::Checks;

namespace {

DTensorSpec spec_on(const std::shared_ptr<const MeshComms>& comms, const char* placements, const Dims& shape) {
  return make_spec(std::shared_ptr<const DeviceMesh>(comms, &comms->mesh()), parse_placements(placements), shape,
                   DType::kF32);
}

// The DTensor of the global-index values (dtensor_data.h) under `placements`, built locally.
DTensor make(const std::shared_ptr<const MeshComms>& comms, const char* placements, const Dims& shape) {
  const DTensorSpec spec = spec_on(comms, placements, shape);
  return DTensor(comms, spec, testing_support::make_local(spec, comms->rank()));
}

std::string check(const DTensor& t) {
  return testing_support::check_redistributed(t.spec(), t.to_local(), *t.comms());
}

}  // namespace

TEST_CASE("view_on: the same data on a flattening / unflattening, no communication", "[dtensor][submesh]") {
  Checks checks;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto dp = MeshComms::create(DeviceMesh::from_shape({4}, {"dp"}), world, {}, nullptr, {{0, {2, 2}, {"a", "b"}}});
    auto two = dp->unflatten(0, {2, 2}, {"a", "b"});
    const int rank = world.rank();
    auto same = [&](const DTensor& x, const DTensor& y, const std::string& what) {
      checks.check(x.to_local().shares_storage_with(y.to_local()), what + ": shares the local tensor");
      checks.check(y.device_mesh() == two->mesh() || y.device_mesh() == dp->mesh(), what + ": mesh");
      const std::string err = check(y);
      if (!err.empty()) checks.add(fmt::format("{} rank {}: {}", what, rank, err));
    };
    // R <-> (R,R); S(0) <-> (S(0),S(0)) where the sizes divide; P <-> (P,P).
    const DTensor r = make(dp, "R", {5, 3});
    same(r, r.view_on(two, parse_placements("R,R")), "R -> (R,R)");
    const DTensor s = make(dp, "S(0)", {8, 3});
    const DTensor s2 = s.view_on(two);
    checks.check(s2.placements() == parse_placements("S(0),S(0)"), "S(0) is found as (S(0),S(0))");
    same(s, s2, "S(0) -> (S(0),S(0))");
    same(s2, s2.view_on(dp, parse_placements("S(0)")), "(S(0),S(0)) -> S(0)");
    const DTensor p = make(dp, "P", {5, 3});
    same(p, p.view_on(two, parse_placements("P,P")), "P -> (P,P)");
    // A strided layout: (S(0),S(0)) on (2,2) is S(0) on 4; (_S(0,2),S(0)) is no 1-D Shard.
    const DTensor t = make(two, "S(1),S(0)", {8, 4});
    checks.check(!equivalent_placements(t.spec(), dp->mesh()).has_value(), "(S(1),S(0)) has no 1-D view");
    // Anything else is a clear error naming the first rank whose data differs.
    const DTensor uneven = make(dp, "S(0)", {5, 3});  // flat 2,2,1,0 vs nested 2,1,1,1
    checks.throws<kernels::InvalidArgument>([&] { uneven.view_on(two, parse_placements("S(0),S(0)")); },
                                            "rank 1 holds [2,3] of shape [5,3] under [S(0)] but [1,3]",
                                            "uneven S(0) -> (S(0),S(0))");
    checks.throws<kernels::InvalidArgument>([&] { uneven.view_on(two); }, "no placements on", "no equivalent");
    checks.throws<kernels::InvalidArgument>([&] { s.view_on(two, parse_placements("R,S(0)")); }, "rank 0 holds",
                                            "S(0) -> (R,S(0))");
    checks.throws<kernels::InvalidArgument>([&] { p.view_on(two, parse_placements("P,R")); },
                                            "reduces over ranks [0,1,2,3] (sum) under [P] but over", "P -> (P,R)");
    checks.throws<kernels::InvalidArgument>([&] { p.view_on(two, parse_placements("P(avg),P(avg)")); },
                                            "(sum) under [P] but over [0,1,2,3] (avg)", "P(sum) -> P(avg)");
  });
  checks.report();
  // A mesh over other ranks is no view.
  collectives::run_ranks(4, [&](Communicator& world) {
    auto all = MeshComms::create(DeviceMesh::from_shape({4}), world);
    auto some = MeshComms::create(DeviceMesh({2}, {0, 1}), world);
    const DTensor r = make(all, "R", {4});
    checks.throws<kernels::InvalidArgument>([&] { r.view_on(some, parse_placements("R")); },
                                            "holds ranks [0,1,2,3], mesh [0,1] holds [0,1]", "other ranks");
  });
  checks.report();
}

TEST_CASE("reshard_after_forward=k as placement transitions on a mesh and its unflattening",
          "[dtensor][submesh][redistribute]") {
  // dp = 8 ranks; k = 4: after forward a parameter stays sharded over groups of 4 consecutive
  // ranks (replicated across the 2 groups), and backward all-gathers over those 4 only.
  for (const Dims& shape : std::vector<Dims>{{16, 3}, {13, 3}, {3, 5}}) {
    Checks checks;
    std::vector<std::string> routes(8);
    collectives::run_ranks(8, [&](Communicator& world) {
      const int rank = world.rank();
      auto dp = MeshComms::create(DeviceMesh::from_shape({8}, {"dp"}), world, {}, nullptr,
                                  {{0, {2, 4}, {"rep", "shard"}}});
      auto two = dp->unflatten(0, {2, 4}, {"rep", "shard"});
      auto expect = [&](const DTensor& t, const std::string& what) {
        const std::string err = check(t);
        if (!err.empty()) checks.add(fmt::format("shape [{}] {} rank {}: {}", fmt::join(shape, ","), what, rank, err));
      };
      const DTensor param = make(dp, "S(0)", shape);
      // Forward: unshard over all 8 (one all-gather).
      const DTensor full = param.redistribute(parse_placements("R"));
      expect(full, "unshard");
      checks.check(param.plan_to(parse_placements("R")).collectives() == 1, "unshard: one collective");
      // After forward: R on dp -> S(0) over the groups of 4, no communication.
      const DTensor kept = full.view_on(two, parse_placements("R,R")).redistribute(parse_placements("R,S(0)"));
      expect(kept, "reshard to k-rank groups");
      checks.check(full.view_on(two).plan_to(parse_placements("R,S(0)")).collectives() == 0, "reshard: local");
      // Backward: one all-gather over the 4 ranks of the group, exactly the bytes each rank lacks.
      const Plan& back = kept.plan_to(parse_placements("R,R"));
      checks.check(back.collectives() == 1 && back.steps.size() == 1 && mesh_dim_of(back.steps[0]) == 1,
                   "backward unshard: one all-gather on the shard dim (4 ranks)");
      checks.check(back.traffic.received == lower_bound_traffic(kept.spec(), back.dst).received,
                   "backward unshard: the lower bound per rank");
      const DTensor again = kept.redistribute(parse_placements("R,R")).view_on(dp, parse_placements("R"));
      expect(again, "backward unshard");
      // After backward: back to the full shard (local), and the gradient's reduce-scatter over 8.
      expect(again.redistribute(parse_placements("S(0)")), "reshard to dp");
      const DTensor grad = make(dp, "P", shape);
      expect(grad.redistribute(parse_placements("S(0)")), "gradient reduce-scatter");
      if (rank == 0) routes[0] = to_string(back);
    });
    INFO("backward route " << routes[0]);
    checks.report();
  }
}
