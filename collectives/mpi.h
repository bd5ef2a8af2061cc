// The mpi backend: one process per rank (launched by mpirun), CPU tensors moved by OpenMPI's
// nonblocking collectives. No MPI header is needed to use it: without MPI in the build
// (meson -Dmpi=disabled, or no MPI found) this header still compiles and MpiWorld's
// constructor throws Unsupported, so callers need no #ifdefs.
//
//   // mpirun -np 4 prog
//   int main(int argc, char** argv) {
//     collectives::MpiWorld mpi(&argc, &argv);               // MPI_Init_thread(MULTIPLE)
//     auto world = mpi.communicator();                        // group "world" [0,1,2,3]
//     Tensor x = Tensor::full({3}, world->rank(), DType::kF32);
//     Tensor all = Tensor::empty({12}, DType::kF32);
//     world->wait(world->all_gather(x, all));                 // [0,0,0,1,1,1,2,2,2,3,3,3]
//   }                                                         // MPI_Finalize
//
// NOTE [mpi progress board] MPI cannot say which members of a communicator have not joined a
// collective, so every rank keeps a small table in an RMA window (MPI_Win_allocate over the
// world, passive target, locked once): per communicator, the number of calls this rank has
// entered, completed and given up after a timeout (written only then), and a description of
// its latest call. A call that times out reads every member's entry (MPI_Rget_accumulate,
// no-op) and sorts the members that hold it up (collectives/mpi/attribution.h): "ranks [3] never
// joined"; "ranks [0,2] joined but have not completed it" (members run several calls at once, so
// one that entered later calls has joined this one too); members that gave it up themselves;
// and, where the latest calls differ, the mismatch. The board cannot tell a stopped member from
// one still polling MPI, so a member that joined and stopped is named among all that joined and
// have not completed. Limits:
//  - On one node OpenMPI serves the window from shared memory (osc/sm): reading never waits for
//    the target. Across nodes, a transport without hardware RMA needs the target to enter MPI to
//    answer; an entry not read within a grace period is reported as unknown, not as missing.
//  - When the MPI library offers no RMA window at all, the communicators still work and a
//    timeout says the missing ranks are unknown.
//  - The table has kMpiBoardSlots slots per process over the MpiWorld's life; each new
//    communicator takes the largest free slot among its members (about one per communicator).
//    Communicators beyond that work without it, and their timeouts cannot name anyone.
//
// After a timeout or an MPI error the communicator is poisoned: MPI cannot cancel a collective
// and the members' call sequences no longer line up, so every later call on it throws
// CommError. Buffers of an abandoned call stay alive (MPI may still write them when a late
// member joins) until the MpiWorld is destroyed.
//
// What MPI does not check: members must pass matching counts, dtypes, ops and roots (as with
// NCCL). A mismatch may fail with an MPI error (a message longer than the receive), hang until
// the timeout (reported with the members' calls from the board), or silently give wrong data.
// With check_calls = true every call first exchanges a description of itself (an extra small
// allgather on a private communicator, blocking when the call starts) and a mismatch fails the
// call on every member before any data moves (wait() throws CommError naming both sides, as the
// local backend does); all_to_all_v counts are checked pairwise
// for groups of up to 256 members. send_recv always checks what each receive got: a message
// longer than its receive fails in MPI, a shorter one throws CommError naming both ranks; a
// dtype mismatch of equal element size goes unnoticed.
//
// Reductions: sum, prod, min and max of f32, f64 and the integers use MPI's built-in ops, except
// that float min and max, and all bf16 and f16 ops, are user-defined ops computing like the
// local backend (in float, rounded to nearest even; NaN propagates through min and max). avg is
// a sum followed by kernels::scale_(1 / size) (integers truncate toward zero), and a
// pre-multiplied sum scales each member's input (rounded to its dtype) before MPI sums it.
// Results can differ from the local backend's in the last bit where MPI adds in another order.
//
// In place: MPI_IN_PLACE counts only when every member passes it, so all_gather and all_reduce
// always run in place (each member first copies its input into its slice of the output, a
// no-op when it is already there); reduce_scatter reduces into a temporary when the output lies
// inside the input; the root of scatter uses MPI_IN_PLACE when its output is its own slice.
//
// Progress (NOTE [call queue] in collectives/call_queue.h): every call is an entry of the
// communicator's in-order queue. A worker thread of the communicator, or a thread waiting on one
// of its Works, starts the calls in order and polls them (MPI_Testall): it yields the core for
// the first 100 ms of a call and then sleeps 20-200 us between polls, so calls complete while the
// caller computes. Calls are started by the worker or a waiter, not on the caller's thread when
// they are made (MPI's nonblocking collectives may copy and reduce as they start). The worker calls MPI from its own thread, so it runs only under
// MPI_THREAD_MULTIPLE, which MpiWorld asks for; when the caller initialised MPI with a lower
// level, that level stands and calls progress only inside wait() and completed() (a rank that
// then never waits on its Works may stall the others).
//
// Threads: one communicator is used by one thread at a time (different communicators may be used
// from different threads), as with NCCL, and communicators are created by one thread at a time.
#pragma once

#include <memory>

#include "collectives/communicator.h"

namespace collectives {

// True when this library was compiled with the mpi backend.
bool mpi_built();

inline constexpr int kMpiBoardSlots = 2048;

namespace detail {
class MpiWorldState;
}

class MpiWorld {
 public:
  // Initialises MPI (MPI_THREAD_MULTIPLE) unless it already is, and then finalises it in the
  // destructor; otherwise leaves MPI running. Collective over MPI_COMM_WORLD. `timeout` bounds
  // the destructor's closing barrier: when some rank never reaches it, MPI resources are
  // leaked and MPI is not finalised (mpirun then reports the exit without finalise) instead of
  // hanging. One MpiWorld per process at a time.
  // Throws Unsupported when this build has no mpi backend.
  explicit MpiWorld(int* argc = nullptr, char*** argv = nullptr,
                    Milliseconds timeout = kDefaultTimeout);
  ~MpiWorld();
  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;

  int rank() const;
  int size() const;
  // A new communicator over all ranks (group "world", ranks 0..size-1, its own MPI_Comm).
  // Collective: every rank calls it, in the same order as its other MpiWorld calls; it fails
  // with CommError naming the ranks that did not join within `timeout`, which is also the new
  // communicator's default wait timeout. check_calls: see the header comment.
  std::unique_ptr<Communicator> communicator(Milliseconds timeout = kDefaultTimeout,
                                             bool check_calls = false);

 private:
  std::shared_ptr<detail::MpiWorldState> state_;
};

}  // namespace collectives
