#include <catch2/catch.hpp>

#include "collectives/local.h"
#include "dtensor/mesh_comms.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

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
  collectives::run_ranks(8, [&](Communicator& world) {
    const int rank = world.rank();
    MeshComms comms(mesh, world, {{0, 1}});
    REQUIRE(comms.in_mesh());
    REQUIRE(comms.coord() == *mesh.coord_of(rank));
    for (int d = 0; d < 2; ++d) {
      REQUIRE(comms.dim(d).ranks() == mesh.group(d, rank));
      REQUIRE(comms.dim(d).rank() == comms.coord()[d]);
      REQUIRE(gathered_ranks(comms.dim(d), rank) == mesh.group(d, rank));
    }
    std::vector<int> both{0, 1};
    REQUIRE(gathered_ranks(comms.flattened(both), rank) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
    REQUIRE(comms.dim(1).name() == "mesh dim 1 (tp) [" + std::string(rank < 4 ? "0,1,2,3" : "4,5,6,7") + "]");
    std::vector<int> none{1};
    REQUIRE_THROWS_WITH(comms.flattened(none), Catch::Contains("were not flattened"));
  });
}

TEST_CASE("mesh communicators on explicit arrays and partial worlds", "[dtensor][mesh_comms]") {
  // A permuted mesh: groups follow coordinates, not rank order.
  const DeviceMesh perm = DeviceMesh::parse("[[3,2],[1,0]]");
  collectives::run_ranks(4, [&](Communicator& world) {
    MeshComms comms(perm, world);
    for (int d = 0; d < 2; ++d)
      REQUIRE(gathered_ranks(comms.dim(d), world.rank()) == perm.group(d, world.rank()));
  });
  // A mesh over ranks 1..3 of a 5-rank world: ranks 0 and 4 take part but hold nothing.
  const DeviceMesh small({3}, {3, 1, 2});
  collectives::run_ranks(5, [&](Communicator& world) {
    MeshComms comms(small, world);
    if (world.rank() == 0 || world.rank() == 4) {
      REQUIRE(!comms.in_mesh());
      REQUIRE_THROWS_WITH(comms.dim(0), Catch::Contains("is not in mesh"));
      return;
    }
    REQUIRE(gathered_ranks(comms.dim(0), world.rank()) == std::vector<int>{3, 1, 2});
  });
  REQUIRE_THROWS_WITH(collectives::run_ranks(2, [&](Communicator& world) { MeshComms(small, world); }),
                      Catch::Contains("names rank 3 but the world has 2 ranks"));
}
