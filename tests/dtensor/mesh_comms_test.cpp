// MeshComms: one communicator per mesh dim (and per requested flattening), ordered by
// coordinate, on explicit and permuted meshes and meshes over part of the world. Rank threads
// record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "support/checks.h"

#include "collectives/local.h"
#include "dtensor/mesh_comms.h"
#include "kernels/error.h"
#include "kernels/tensor.h"
#include "support/checks.h"

using namespace dtensor;
using collectives::Communicator;
using kernels::DType;
using kernels::Tensor;
using testing_support::Checks;

namespace {

// All-gathers every member's global rank over comm; returns them in group order.
std::vector<int> gathered_ranks(Communicator& comm, int global_rank) {
  Tensor mine = Tensor::full({1}, global_rank, DType::kI32);
  Tensor all = Tensor::empty({comm.size()}, DType::kI32);
  comm.wait(comm.all_gather(mine, all));
  std::vector<int> out;
  for (double v : all.to_vector()) out.push_back(static_cast<int>(v));
  return out;
}

}  // namespace

TEST_CASE("mesh communicators: one per mesh dim, ordered by coordinate", "[dtensor][mesh_comms]") {
  const DeviceMesh mesh = DeviceMesh::from_shape({2, 4}, {"dp", "tp"});
  Checks checks;
  collectives::run_ranks(8, [&](Communicator& world) {
    const int rank = world.rank();
    MeshComms comms(mesh, world, {{0, 1}});
    checks.check(comms.in_mesh(), fmt::format("rank {} not in the mesh", rank));
    checks.check(comms.coord() == *mesh.coord_of(rank), fmt::format("rank {}: coordinate", rank));
    for (int d = 0; d < 2; ++d) {
      checks.check(comms.dim(d).ranks() == mesh.group(d, rank), fmt::format("rank {} dim {}: ranks()", rank, d));
      checks.check(comms.dim(d).rank() == comms.coord()[d], fmt::format("rank {} dim {}: rank()", rank, d));
      const std::vector<int> got = gathered_ranks(comms.dim(d), rank);
      checks.check(got == mesh.group(d, rank),
                   fmt::format("rank {} dim {}: the group gathered [{}]", rank, d, fmt::join(got, ",")));
    }
    std::vector<int> both{0, 1};
    checks.check(gathered_ranks(comms.flattened(both), rank) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7},
                 fmt::format("rank {}: the flattened group", rank));
    checks.check(comms.dim(1).name() == "mesh dim 1 (tp) [" + std::string(rank < 4 ? "0,1,2,3" : "4,5,6,7") + "]",
                 fmt::format("rank {}: name '{}'", rank, comms.dim(1).name()));
    std::vector<int> none{1};
    checks.throws<kernels::InvalidArgument>([&] { comms.flattened(none); }, "were not flattened",
                                            "a flattening not requested");
  });
  checks.report();
}

TEST_CASE("mesh communicators on explicit arrays and partial worlds", "[dtensor][mesh_comms]") {
  Checks checks;
  // A permuted mesh: groups follow coordinates, not rank order.
  const DeviceMesh perm = DeviceMesh::parse("[[3,2],[1,0]]");
  collectives::run_ranks(4, [&](Communicator& world) {
    MeshComms comms(perm, world);
    for (int d = 0; d < 2; ++d)
      checks.check(gathered_ranks(comms.dim(d), world.rank()) == perm.group(d, world.rank()),
                   fmt::format("permuted mesh, rank {} dim {}", world.rank(), d));
  });
  // A mesh over ranks 1..3 of a 5-rank world: ranks 0 and 4 take part but hold nothing.
  const DeviceMesh small({3}, {3, 1, 2});
  collectives::run_ranks(5, [&](Communicator& world) {
    MeshComms comms(small, world);
    if (world.rank() == 0 || world.rank() == 4) {
      checks.check(!comms.in_mesh(), fmt::format("rank {} is in the mesh", world.rank()));
      checks.throws<kernels::InvalidArgument>([&] { comms.dim(0); }, "is not in mesh", "dim() outside the mesh");
      return;
    }
    checks.check(gathered_ranks(comms.dim(0), world.rank()) == std::vector<int>{3, 1, 2},
                 fmt::format("partial world, rank {}", world.rank()));
  });
  checks.report();
  REQUIRE_THROWS_WITH(collectives::run_ranks(2, [&](Communicator& world) { MeshComms(small, world); }),
                      Catch::Contains("names rank 3 but the world has 2 ranks"));
}

TEST_CASE("derived meshes share the parent's communicators", "[dtensor][mesh_comms]") {
  // A 1-D dp mesh of 8 with its (2,4) unflattening requested up front (FSDP's
  // reshard_after_forward=4: shard groups of 4 consecutive ranks), and a 2-D mesh with a slice
  // and a flattening.
  const DeviceMesh dp = DeviceMesh::from_shape({8}, {"dp"});
  testing_support::Checks checks;
  collectives::run_ranks(8, [&](Communicator& world) {
    const int rank = world.rank();
    auto comms = MeshComms::create(dp, world, {}, nullptr, {{0, {2, 4}, {"rep", "shard"}}});
    auto two = comms->unflatten(0, {2, 4}, {"rep", "shard"});
    checks.check(two->mesh() == DeviceMesh::from_shape({2, 4}, {"rep", "shard"}), "unflattened mesh");
    checks.check(two->coord() == *two->mesh().coord_of(rank), "unflattened coordinate");
    checks.check(two->allocator() == comms->allocator(), "shared allocator");
    for (int d = 0; d < 2; ++d) {
      checks.check(two->dim(d).ranks() == two->mesh().group(d, rank), fmt::format("dim {} group", d));
      checks.check(gathered_ranks(two->dim(d), rank) == two->mesh().group(d, rank), fmt::format("dim {} gather", d));
    }
    const std::vector<int> both{0, 1};
    checks.check(&two->flattened(both) == &comms->dim(0), "the new dims flatten into the parent's communicator");
    auto back = two->flatten(both, "dp");
    checks.check(back->mesh() == dp, "flatten back gives the 1-D mesh");
    checks.check(&back->dim(0) == &comms->dim(0), "and its communicator");
    auto again = back->unflatten(0, {2, 4}, {"rep", "shard"});
    checks.check(&again->dim(1) == &two->dim(1), "unflattening the flattening reuses the split communicators");
    const std::vector<std::string> shard{"shard"};
    auto sub = two->slice(shard);
    checks.check(sub->mesh().ranks() == two->mesh().group(1, rank), "slice holds this rank's shard group");
    checks.check(&sub->dim(0) == &two->dim(1), "slice reuses the communicator");
    checks.check(gathered_ranks(sub->dim(0), rank) == two->mesh().group(1, rank), "slice gather");
    checks.throws<kernels::InvalidArgument>([&] { comms->unflatten(0, {4, 2}, {"a", "b"}); },
                                            "was not requested when the mesh communicators were created",
                                            "an unflattening not requested");
    checks.throws<kernels::InvalidArgument>([&] { two->flatten(std::vector<int>{1}); }, "was not requested",
                                            "a flattening not requested");
  });
  checks.report();
  const DeviceMesh mesh = DeviceMesh::from_shape({2, 2, 2}, {"rep", "dp", "tp"});
  collectives::run_ranks(8, [&](Communicator& world) {
    const int rank = world.rank();
    MeshComms comms(mesh, world, {{0, 1}});
    const std::vector<std::string> names{"rep", "dp"};
    auto hsdp = comms.slice(names);  // the (rep, dp) mesh of this rank's tp coordinate
    checks.check(hsdp->mesh() == mesh.slice(names, rank), "2-D slice");
    checks.check(&hsdp->dim(0) == &comms.dim(0) && &hsdp->dim(1) == &comms.dim(1), "2-D slice communicators");
    const std::vector<int> both{0, 1};
    checks.check(&hsdp->flattened(both) == &comms.flattened(both), "the flattening carries over to the slice");
    auto flat = comms.flatten(both);  // (rep_dp, tp)
    checks.check(flat->mesh() == mesh.flatten(both), "flattened mesh");
    checks.check(&flat->dim(0) == &comms.flattened(both) && &flat->dim(1) == &comms.dim(2), "flattened communicators");
    checks.check(gathered_ranks(flat->dim(0), rank) == flat->mesh().group(0, rank), "flattened gather");
  });
  checks.report();
}
