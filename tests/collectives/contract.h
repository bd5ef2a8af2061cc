// The backend contract (NOTE [call contract] in collectives/communicator.h) as one list of
// cases that every backend runs unchanged:
//   local  contract_local_test.cpp   1, 2, 3, 4 and 8 ranks as threads   (collectives-local)
//   mpi    mpi_test.cpp "mpi: contract"   1-4 processes under mpirun     (collectives-mpi*)
//   nccl   nccl_test.cpp "nccl: contract"   one thread per GPU           (collectives-nccl-gpu, [gpu])
// Every collective x dtype x reduction x count (0, 1, 7, 1000), in place and out of place; uneven
// and empty all_to_all_v and send_recv patterns; strided send_recv views (or their refusal where
// p2p_views() is false); batches, calls in flight waited in any order, splits; large buffers;
// every argument error and aliasing rule, with the same message on every backend and nothing
// posted (the next call still matches).
//
// A case is collective over the communicator (every member runs it, in the same order as the
// other calls) and uses no test framework: it runs on rank threads of the local and nccl tests
// (Catch2 assertions are not thread-safe). It records what it checked and what went wrong in
// a Log, which the runner checks on its main thread. Element values are small integers, a
// function of (rank, global index), exact in every dtype; expected results are computed in
// double, independently of the kernels the backends use.
//
//   for (const contract::Case& c : contract::cases()) {
//     contract::Log log = contract::run_case(c, comm, kernels::Device::cpu());
//     CHECK(log.failures.empty());  CHECK(log.checked > 0);
//   }
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/communicator.h"
#include "kernels/device.h"

namespace contract {

struct Log {
  std::vector<std::string> failures;  // the first 12
  int64_t checked = 0;                // output elements compared with their formula + errors seen
  void fail(std::string what);
  void expect(bool ok, std::string_view what);
};

struct Case {
  std::string_view name;
  void (*run)(collectives::Communicator& comm, kernels::Device device, Log& log);
  // Behaviour the local and mpi backends document and the nccl backend does not promise
  // (integer averages truncated toward zero).
  bool cpu_only = false;
};

std::span<const Case> cases();

// Runs case `c` on comm with its buffers on `device`; an exception becomes a failure (the other
// members may then fail in a later call of theirs, by timeout).
Log run_case(const Case& c, collectives::Communicator& comm, kernels::Device device);

}  // namespace contract
