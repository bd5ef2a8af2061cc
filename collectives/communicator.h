// Communicator: one group of ranks and the collectives it runs. One interface, three backends:
// local (ranks are threads of one process; collectives/local.h), mpi (collectives/mpi.h) and
// nccl (collectives/nccl.h). Buffers are Tensors on the CPU or a CUDA device.
//
// Every call is asynchronous and returns a Work at once; the call makes progress without the
// caller (local and mpi: a worker thread of the communicator, or a thread waiting on one of its
// Works; nccl: the communicator's CUDA stream). wait() blocks until this rank's part is done:
//   auto work = comm.all_gather(shard, full);   // issue
//   work->wait();                                // full now holds every rank's shard in group order
// Calls are matched across ranks by their order on the communicator (as NCCL does): every member
// must issue the same sequence of collectives with matching counts, dtypes, ops and roots.
// A member that never joins makes the others fail in wait() with a CommError naming the
// collective, the group and the missing ranks, within the timeout.
//
// NOTE [in-order engine] Each communicator is an in-order queue, like a CUDA stream: calls start
// in the order they were made (so they reach the group in program order, the same on every rank),
// and two kinds of entries order work across communicators of one rank:
//  - wait_for(work): the next call made on this communicator starts only once `work` (of any
//    communicator) has finished; later calls start after that one (cudaStreamWaitEvent);
//  - host_task(fn): fn runs on the communicator's progress once every earlier call has finished
//    (copies into and out of collective buffers: cudaLaunchHostFunc).
// So a caller issues a whole chain (step 2 on one group consuming step 1's result of another)
// at once, and each call takes its place in its communicator's order at that moment, not when
// its input is ready: chains issued in the same order on every rank can never interleave
// differently on different ranks (see NOTE [deferred plans] in dtensor/exec/executor.h). A call
// waiting for a dependency holds up the later calls of its communicator only (never another
// communicator's), and dependencies always point to calls made earlier, so nothing waits in a
// cycle. Calls made on one communicator complete in order on the CPU backends.
//
// Group rank vs global rank: rank() is this member's index in the group; ranks()[i] is the
// global rank of member i. Mesh-dim groups are ordered by mesh coordinate (dtensor/mesh.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/reduce_op.h"
#include "kernels/tensor.h"

namespace collectives {

using kernels::ReduceOp;
using kernels::Tensor;
using Milliseconds = std::chrono::milliseconds;

// Default timeout of a communicator's wait(): long enough for any healthy collective, short
// enough that a missing rank is reported rather than hanging a job.
inline constexpr Milliseconds kDefaultTimeout{300'000};

// The reduction of a reducing collective. pre_multiplier scales every input before a sum
// (NCCL's ncclRedOpCreatePreMulSum; FSDP's gradient divide factor): result = sum_i(x_i * m).
// REQUIRES: pre_multiplier != 1 only with ReduceOp::kSum.
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  double pre_multiplier = 1.0;
  Reduction() = default;
  Reduction(ReduceOp op_) : op(op_) {}  // NOLINT: implicit, so all_reduce(x, x, ReduceOp::kMax) reads well
  static Reduction premul_sum(double m) {
    Reduction r;
    r.pre_multiplier = m;
    return r;
  }
};

enum class CollectiveKind {
  kAllGather, kReduceScatter, kAllReduce, kAllToAll, kAllToAllV, kBroadcast, kScatter, kBarrier,
  kSendRecv,
};
std::string_view to_string(CollectiveKind kind);

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until this rank's part of the call (or batch) is complete. Throws CommError on a
  // timeout (naming the collective, the group and the ranks that never joined; the call is then
  // given up), on a mismatch between ranks, or when another rank failed; a host task rethrows
  // its exception.
  virtual void wait(Milliseconds timeout) = 0;
  // Non-blocking (it may advance the call a little): true once wait() would return at once.
  virtual bool completed() = 0;
  // Blocks until the call has finished (completed, or failed: wait() then throws) or `timeout`
  // has passed, and says whether it finished. Unlike wait(), running out of time does not give
  // the call up: engines chain calls with it (Communicator::wait_for).
  virtual bool settle(Milliseconds timeout) = 0;
  // "all_gather on group 'world' [0,1] (call #3)"; while the call waits for something, what
  // ("ranks [1] never joined"), so a call that depends on it can say why it never started.
  virtual std::string describe() const { return "a call"; }
  // Fails a pending call with `why` as a timed-out wait() would (the caller stops waiting for
  // it; the members waiting for this rank in it learn why). No effect once it has finished.
  virtual void give_up(const std::string& why) = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// One side of a point-to-point transfer inside send_recv(). `peer` is a group rank.
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  Tensor buffer;
  int peer = 0;
  static P2POp send(Tensor t, int peer) { return {Kind::kSend, std::move(t), peer}; }
  static P2POp recv(Tensor t, int peer) { return {Kind::kRecv, std::move(t), peer}; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }
  // Human-readable group name used in errors, e.g. "world" or "mesh dim 1 (tp) [4,5,6,7]".
  const std::string& name() const { return name_; }
  virtual std::string_view backend() const = 0;
  // Default timeout of wait() without an argument.
  Milliseconds timeout() const { return timeout_; }
  void set_timeout(Milliseconds t) { timeout_ = t; }
  void wait(const WorkPtr& work) { work->wait(timeout_); }

  // All buffers are contiguous, on this communicator's device kind, one dtype per call.
  // output = concat over members (group order) of input; output.numel() == size() * input.numel().
  // In place when input is this rank's slice of output.
  virtual WorkPtr all_gather(const Tensor& input, const Tensor& output) = 0;
  // output = reduce over members of slice rank() of input; input.numel() == size() * output.numel().
  // In place when output is this rank's slice of input.
  virtual WorkPtr reduce_scatter(const Tensor& input, const Tensor& output, Reduction r) = 0;
  // output = reduce over members of input (same numel); in place when both are the same tensor.
  virtual WorkPtr all_reduce(const Tensor& input, const Tensor& output, Reduction r) = 0;
  // Equal splits: slice j of input goes to member j, and slice i of output comes from member i.
  virtual WorkPtr all_to_all(const Tensor& input, const Tensor& output) = 0;
  // Per-member element counts (send_counts[j] to member j, recv_counts[i] from member i), packed
  // back to back in member order. Counts may be zero; they must agree pairwise across members.
  virtual WorkPtr all_to_all_v(const Tensor& input, std::span<const int64_t> send_counts,
                               const Tensor& output, std::span<const int64_t> recv_counts) = 0;
  // buffer on every member = buffer of member `root`.
  virtual WorkPtr broadcast(const Tensor& buffer, int root) = 0;
  // output on member i = slice i of root's input (input is ignored on the other members and may
  // be undefined there).
  virtual WorkPtr scatter(const Tensor& input, const Tensor& output, int root) = 0;
  virtual WorkPtr barrier() = 0;
  // A batch of sends and receives exchanged as one operation (any permutation of data between
  // members). Each send must be matched by the peer's receive of the same numel and dtype, in
  // order per (sender, receiver) pair; elements pair up in row-major order of each buffer.
  // Where p2p_views() is true the buffers may be any strided views (non-negative strides; a
  // send and its receive may differ in shape), so callers move sub-blocks of tensors without
  // packing them; otherwise they must be contiguous.
  virtual WorkPtr send_recv(std::span<const P2POp> ops) = 0;
  // Whether send_recv takes strided views (local: copied view to view; mpi: derived datatypes).
  virtual bool p2p_views() const { return false; }
  // The largest non-contiguous message the backend moves at full speed (0: no limit). Callers
  // split bigger strided views into several messages (both sides split their equal shapes alike).
  virtual int64_t p2p_view_max_bytes() const { return 0; }

  // NOTE [in-order engine]. The next call (collective, host task or split) starts only once
  // `work` has finished; a failed `work` does not stop it (the members' sequences must stay in
  // step: the caller learns of the failure from `work`). A null work is ignored.
  virtual void wait_for(const WorkPtr& work) = 0;
  // NOTE [in-order engine]. Runs fn once every earlier call on this communicator has finished;
  // later calls start after fn returned. An exception from fn fails the returned Work (wait()
  // rethrows it) and nothing else. fn runs on whichever thread progresses the communicator (its
  // worker, or one waiting on it), never at the same time as another entry of this
  // communicator. nccl: fn runs at once on the calling thread after the legacy default stream
  // was made to wait for this communicator's stream, so fn must only enqueue device work (the
  // kernels layer's copies do).
  virtual WorkPtr host_task(std::function<void()> fn) = 0;

  // A hint that the caller will not wait for its pending calls soon (it issued them to overlap
  // them with other work): the communicator's worker starts on them now, instead of after the
  // short delay that lets a caller who waits at once run its calls itself (NOTE [call queue] in
  // collectives/call_queue.h). Calls progress either way. No effect on nccl (the GPU runs them).
  virtual void kick() {}

  // Batching (NCCL group semantics): calls between begin_batch() and end_batch() are issued as
  // one operation; their Works complete together, and end_batch() returns a Work for all of them.
  virtual void begin_batch() = 0;
  virtual WorkPtr end_batch() = 0;

  // Collective over this communicator: every member calls it with the group it belongs to (group
  // ranks of *this* communicator, in the new group's order; groups are disjoint). Returns the
  // new communicator; it inherits the timeout. `name` names the new group in errors.
  virtual std::unique_ptr<Communicator> split(std::span<const int> group, std::string name) = 0;

 protected:
  Communicator(int rank, std::vector<int> ranks, std::string name, Milliseconds timeout)
      : rank_(rank), ranks_(std::move(ranks)), name_(std::move(name)), timeout_(timeout) {}

 private:
  int rank_;
  std::vector<int> ranks_;
  std::string name_;
  Milliseconds timeout_;
};

// Checks shared by the backends; each throws InvalidArgument naming the call and the value.
// One collective call as a value: what a RecordingCommunicator logs and what the backends
// compare across members. For send_recv, in_count / out_count are the elements sent / received
// in total and `ops` the number of sends and receives.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  kernels::DType dtype = kernels::DType::kF32;
  int64_t in_count = 0, out_count = 0;
  ReduceOp op = ReduceOp::kSum;
  double pre_multiplier = 1.0;
  int root = -1;
  int ops = 0;
  bool operator==(const CollectiveCall&) const = default;
};
// "all_gather(f32, 4 -> 16 elements)", "reduce_scatter(bf16, 16 -> 4 elements, sum x 0.25)",
// "send_recv(3 ops, f32, 12 -> 8 elements)", "barrier()".
std::string to_string(const CollectiveCall& call);

namespace detail {
// Defined, contiguous, and of a dtype the collectives move (fp8 is storage-only).
void check_tensor(CollectiveKind kind, const Communicator& comm, const Tensor& t, const char* role);
// A send_recv buffer: as check_tensor, but a strided view is allowed when comm.p2p_views().
void check_p2p_tensor(const Communicator& comm, const Tensor& t);
void check_buffers(CollectiveKind kind, const Communicator& comm, const Tensor& input,
                   const Tensor& output);
void check_reduction(CollectiveKind kind, const Tensor& t, Reduction r);
// all_to_all_v counts: one per member, >= 0, summing to the buffer's numel.
void check_counts(const Communicator& comm, std::span<const int64_t> counts, const Tensor& t,
                  const char* what);
// True when the byte ranges of two tensors (on the same device) overlap.
bool overlaps(const Tensor& a, const Tensor& b);
}  // namespace detail

}  // namespace collectives
