// MeshComms: one communicator per mesh dim, ordered by coordinate. The rank threads record their
// failures in testing_support::Checks (Catch2 assertions are not thread-safe); the test thread
// reports them after the join.
#include <catch2/catch.hpp>

#include <atomic>

#include "collectives/local.h"
#include "dtensor/mesh_comms.h"
#include "kernels/error.h"
#include "kernels/tensor.h"
#include "support/checks.h"

using namespace dtensor;
using collectives::Communicator;
using kernels::DType;
using kernels::Tensor;

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
  testing_support::Checks checks;
  std::atomic<int> ran{0};
  collectives::run_ranks(8, [&](Communicator& world) {
    const int rank = world.rank();
    MeshComms comms(mesh, world, {{0, 1}});
    checks.check(comms.in_mesh(), fmt::format("rank {}: in_mesh", rank));
    checks.check(comms.coord() == *mesh.coord_of(rank), fmt::format("rank {}: coord", rank));
    for (int d = 0; d < 2; ++d) {
      checks.check(comms.dim(d).ranks() == mesh.group(d, rank), fmt::format("rank {} dim {}: ranks", rank, d));
      checks.check(comms.dim(d).rank() == comms.coord()[d], fmt::format("rank {} dim {}: group rank", rank, d));
      checks.check(gathered_ranks(comms.dim(d), rank) == mesh.group(d, rank),
                   fmt::format("rank {} dim {}: gathered ranks", rank, d));
    }
    std::vector<int> both{0, 1};
    checks.check(gathered_ranks(comms.flattened(both), rank) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7},
                 fmt::format("rank {}: flattened", rank));
    checks.check(comms.dim(1).name() == "mesh dim 1 (tp) [" + std::string(rank < 4 ? "0,1,2,3" : "4,5,6,7") + "]",
                 fmt::format("rank {}: name '{}'", rank, comms.dim(1).name()));
    std::vector<int> none{1};
    checks.throws<kernels::Error>([&] { (void)comms.flattened(none); }, "were not flattened",
                                  fmt::format("rank {}: flattened(none)", rank));
    ++ran;
  });
  checks.report();
  CHECK(ran == 8);
}

TEST_CASE("mesh communicators on explicit arrays and partial worlds", "[dtensor][mesh_comms]") {
  // A permuted mesh: groups follow coordinates, not rank order.
  const DeviceMesh perm = DeviceMesh::parse("[[3,2],[1,0]]");
  testing_support::Checks checks;
  std::atomic<int> ran{0};
  collectives::run_ranks(4, [&](Communicator& world) {
    MeshComms comms(perm, world);
    for (int d = 0; d < 2; ++d)
      checks.check(gathered_ranks(comms.dim(d), world.rank()) == perm.group(d, world.rank()),
                   fmt::format("rank {} dim {}: gathered ranks", world.rank(), d));
    ++ran;
  });
  // A mesh over ranks 1..3 of a 5-rank world: ranks 0 and 4 take part but hold nothing.
  const DeviceMesh small({3}, {3, 1, 2});
  collectives::run_ranks(5, [&](Communicator& world) {
    MeshComms comms(small, world);
    ++ran;
    if (world.rank() == 0 || world.rank() == 4) {
      checks.check(!comms.in_mesh(), fmt::format("rank {}: in_mesh", world.rank()));
      checks.throws<kernels::Error>([&] { (void)comms.dim(0); }, "is not in mesh",
                                    fmt::format("rank {}: dim(0)", world.rank()));
      return;
    }
    checks.check(gathered_ranks(comms.dim(0), world.rank()) == std::vector<int>{3, 1, 2},
                 fmt::format("rank {}: gathered ranks", world.rank()));
  });
  checks.report();
  CHECK(ran == 9);
  REQUIRE_THROWS_WITH(collectives::run_ranks(2, [&](Communicator& world) { MeshComms(small, world); }),
                      Catch::Contains("names rank 3 but the world has 2 ranks"));
}
