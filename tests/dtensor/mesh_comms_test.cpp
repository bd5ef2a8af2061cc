// MeshComms: one communicator per mesh dim (and per requested flattening), ordered by
// coordinate, on explicit and permuted meshes and meshes over part of the world. Rank threads
// record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

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
  // A permuted mesh: groups follow coordinates, not rank order.
  const DeviceMesh perm = DeviceMesh::parse("[[3,2],[1,0]]");
  Checks checks;
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
