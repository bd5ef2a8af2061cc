// The nccl backend without a usable GPU (or without NCCL in the build): creating a communicator
// fails cleanly, on every rank, naming the group and the reason, before anything is sent.
#include <catch2/catch.hpp>

#include <vector>

#include "collectives/local.h"
#include "collectives/nccl.h"
#include "kernels/device.h"
#include "kernels/error.h"

using namespace collectives;
using Catch::Contains;

namespace {
bool have_gpu() { return kernels::cuda_device_count() > 0; }
}  // namespace

TEST_CASE("nccl without a GPU or without NCCL refuses cleanly", "[collectives][nccl]") {
  if (have_gpu() && nccl_built()) {
    SUCCEED("a GPU is present and NCCL is built: see the GPU tests");
    return;
  }
  const std::string reason = nccl_built() ? "no GPU is usable" : "this build has no NCCL";
  for (int size : {1, 2}) {
    REQUIRE_THROWS_AS(
        run_ranks(size, [](Communicator& world) { nccl_communicator(world, world.rank()); }),
        kernels::Unsupported);
    REQUIRE_THROWS_WITH(
        run_ranks(size, [](Communicator& world) { nccl_communicator(world, world.rank()); }),
        Contains("nccl_communicator on group 'world'") && Contains(reason));
  }
  const std::vector<int> one = {0};
  REQUIRE_THROWS_AS(nccl_communicators_all(one), kernels::Unsupported);
  REQUIRE_THROWS_WITH(nccl_communicators_all(one),
                      Contains("nccl_communicators_all") && Contains(reason));
  if (nccl_built()) {
    // Argument errors come before the GPU probe.
    REQUIRE_THROWS_AS(nccl_communicators_all(std::vector<int>{}), kernels::InvalidArgument);
    REQUIRE_THROWS_WITH(nccl_communicators_all(std::vector<int>{0, 0}),
                        Contains("cuda:0 appears twice"));
    REQUIRE_THROWS_AS(nccl_communicators_all(std::vector<int>{-1}), kernels::InvalidArgument);
    REQUIRE_THROWS_AS(run_ranks(1, [](Communicator& world) { nccl_communicator(world, -1); }),
                      kernels::InvalidArgument);
  }
}

