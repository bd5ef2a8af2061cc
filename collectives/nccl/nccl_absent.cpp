// Built when the library is configured without CUDA or without NCCL: the factories of
// collectives/nccl.h refuse with Unsupported, before any communication.
#include <fmt/format.h>

#include "collectives/nccl.h"
#include "kernels/error.h"

namespace collectives {

namespace {

constexpr const char* kNoNccl =
    "this build has no NCCL (configure with -Dcuda=enabled on a machine with the CUDA toolkit and "
    "NCCL, e.g. under /usr/local/cuda)";

}  // namespace

bool nccl_built() { return false; }

std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device, Milliseconds) {
  throw kernels::Unsupported(
      fmt::format("nccl_communicator on group '{}' (rank {} of {}, cuda:{}): {}", bootstrap.name(),
                  bootstrap.rank(), bootstrap.size(), device, kNoNccl));
}

std::vector<std::unique_ptr<Communicator>> nccl_communicators_all(std::span<const int>,
                                                                  Milliseconds) {
  throw kernels::Unsupported(fmt::format("nccl_communicators_all: {}", kNoNccl));
}

}  // namespace collectives
