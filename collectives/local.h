// The local backend: N ranks as threads of one process, exchanging CPU (or CUDA) buffers through
// shared memory. The embedded default and the test harness.
//
//   run_ranks(4, [](Communicator& world) {
//     Tensor x = Tensor::full({3}, world.rank(), DType::kF32);
//     Tensor all = Tensor::empty({12}, DType::kF32);
//     world.wait(world.all_gather(x, all));      // all == [0,0,0,1,1,1,2,2,2,3,3,3]
//   });
//
// NOTE [local rendezvous] A call is an entry of the communicator's in-order queue (NOTE [call
// queue] in collectives/call_queue.h); the call returns at once. When the call starts it posts
// this rank's buffers to a slot shared by the group (slots are matched by call order); the
// queue's holder (the communicator's worker thread, or a thread waiting on one of its Works) then
// waits until every member posted, checks that the calls agree (kind, dtype, counts, op, root),
// and pulls what this rank needs from the others' buffers. Members leave a slot together, so no
// buffer is reused while another member still reads it, and a call completes whether or not
// anyone waits on it. Small calls (up to 8 KiB read by others) copy their inputs into buffers
// the slot holds when posted, and each member leaves as soon as it has its result: one
// rendezvous per call instead of two (NOTE [eager small calls] in local.cpp). A member that never posts makes the others' waits time out naming it; a
// waiter that times out gives its call up (the later calls of the communicator still run).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "collectives/communicator.h"

namespace collectives {

namespace detail {
class LocalWorldState;
}

// The most ranks of one local world: each rank is a thread (run_ranks), and every call of the
// world's communicator waits on all of them, so more would only exhaust threads or time out.
inline constexpr int kMaxLocalRanks = 1024;

class LocalWorld {
 public:
  // Throws InvalidArgument for a size outside 1..kMaxLocalRanks, naming it.
  explicit LocalWorld(int size, Milliseconds timeout = kDefaultTimeout);
  ~LocalWorld();
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  int size() const;
  // The world communicator of `rank` (group "world", ranks 0..size-1). Each rank takes its own,
  // once, and uses it from its own thread.
  std::unique_ptr<Communicator> communicator(int rank);
  // Marks the world failed: every member blocked in (or later entering) wait() throws a
  // CommError naming `rank` and `reason` instead of waiting for it.
  void abort(int rank, const std::string& reason);
  // Records that `rank` will post nothing more: members waiting for it to join a call fail at
  // once with a CommError naming it instead of waiting out the timeout.
  void mark_returned(int rank);

 private:
  std::shared_ptr<detail::LocalWorldState> state_;
};

// Runs fn(world communicator) on `size` threads, one per rank, and joins them. When a rank
// throws, the world is aborted so the others fail fast instead of waiting for it, and after the
// join the first exception thrown (in time) is re-raised here. A size outside 1..kMaxLocalRanks
// is an InvalidArgument naming it, before any thread starts.
void run_ranks(int size, const std::function<void(Communicator& world)>& fn,
               Milliseconds timeout = Milliseconds{120'000});

}  // namespace collectives
