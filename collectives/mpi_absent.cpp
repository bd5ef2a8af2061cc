// Stands in for collectives/mpi.cpp when the build has no MPI (meson -Dmpi=disabled, or MPI not
// found): the API links, and creating an MpiWorld says why it cannot work.
#include "collectives/mpi.h"
#include "kernels/error.h"

namespace collectives {

namespace detail {
class MpiWorldState {};
}  // namespace detail

namespace {
[[noreturn]] void no_mpi() {
  throw kernels::Unsupported("this build has no MPI backend (configure with -Dmpi=enabled)");
}
}  // namespace

bool mpi_built() { return false; }

MpiWorld::MpiWorld(int* /*argc*/, char*** /*argv*/, Milliseconds /*timeout*/) { no_mpi(); }
MpiWorld::~MpiWorld() = default;
int MpiWorld::rank() const { return 0; }
int MpiWorld::size() const { return 1; }
std::unique_ptr<Communicator> MpiWorld::communicator(Milliseconds /*timeout*/,
                                                     bool /*check_calls*/) {
  no_mpi();
}

}  // namespace collectives
