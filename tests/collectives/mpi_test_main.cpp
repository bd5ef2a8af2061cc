// main() of the mpi backend's test (tests/collectives/mpi_test.cpp), run by mpirun: every rank
// starts MPI, makes the world communicator and runs the same Catch2 session, so the ranks issue
// the same sequence of collectives.
#include <fmt/format.h>

#include "collectives/mpi.h"
#include "tests/support/catch2_runner.h"

namespace mpi_test {
collectives::MpiWorld* mpi = nullptr;
collectives::Communicator* world = nullptr;
}  // namespace mpi_test

int main(int argc, char** argv) {
  // A failing rank leaves the others waiting: they report it after 30 s, well inside Meson's limit.
  const collectives::Milliseconds timeout{30'000};
  collectives::MpiWorld mpi(&argc, &argv, timeout);
  std::unique_ptr<collectives::Communicator> world = mpi.communicator(timeout);
  mpi_test::mpi = &mpi;
  mpi_test::world = world.get();
  const int failed =
      test_support::run_catch2(argc, argv, {fmt::format("mpi_test rank {} of {}", mpi.rank(), mpi.size()), {}});
  mpi_test::world = nullptr;
  world.reset();
  return failed;
}
