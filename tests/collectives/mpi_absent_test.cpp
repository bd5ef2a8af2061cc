// A build without MPI (meson -Dmpi=disabled): collectives/mpi.h still compiles and links, and
// creating an MpiWorld says why it cannot work.
#include <catch2/catch.hpp>

#include "collectives/mpi.h"
#include "kernels/error.h"

TEST_CASE("mpi backend absent: MpiWorld throws Unsupported", "[mpi]") {
  REQUIRE_FALSE(collectives::mpi_built());
  REQUIRE_THROWS_AS(collectives::MpiWorld(), kernels::Unsupported);
  REQUIRE_THROWS_WITH(collectives::MpiWorld(),
                      "this build has no MPI backend (configure with -Dmpi=enabled)");
}
