// main() of the mpi backend's test (tests/collectives/mpi_test.cpp), run by mpirun: every rank
// starts MPI, makes the world communicator and runs the same Catch2 session, so the ranks issue
// the same sequence of collectives. Kept apart so Catch2's implementation compiles once at -O0.
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>

#include <catch2/catch.hpp>

#include "collectives/mpi.h"

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
  Catch::Session session;
  session.configData().processName = fmt::format("mpi_test rank {} of {}", mpi.rank(), mpi.size());
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const int failed = session.run();
  mpi_test::world = nullptr;
  world.reset();
  return failed;
}
