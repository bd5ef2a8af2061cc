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
#include "kernels/stream.h"
#include "kernels/tensor.h"
#include "kernels/trace.h"

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
  // Work queued on `stream` after this returns runs after this rank's part of the call. Default
  // (the local and mpi backends, whose results are in host-visible memory once wait() returns):
  // wait(timeout). nccl: device-side, no host wait, when `stream` is on the communicator's GPU
  // (the stream waits for the call's event); otherwise wait(timeout). Throws as wait().
  //   work->wait_on(Stream::legacy(Device::cuda(0)), 60s);  // kernels after it see the result
  virtual void wait_on(const kernels::Stream& stream, Milliseconds timeout) {
    (void)stream;
    wait(timeout);
  }
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
  // Tracing: arranges for fn to run once, on whichever thread finishes the call (completed or
  // failed), at once when it has finished already; false where the backend cannot tell (the
  // tracer then takes the moment a caller first sees it finished). fn must not block or throw.
  virtual bool on_finish(std::function<void()> fn) {
    (void)fn;
    return false;
  }
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

// NOTE [call contract] Every collective is described once, as a Call: the public methods of
// Communicator build it, detail::validate() checks it -- the same checks and messages on every
// backend -- and only then does the backend see it (Communicator::issue). A backend adds only
// the limits of its transport (check_backend: the device it moves, mpi's int counts).
//
// Aliasing, the same on every backend (validate() refuses anything else with InvalidArgument
// naming both element ranges, before the call is posted):
//  - Input and output share no byte, or are exactly the collective's in-place form:
//      all_gather       input is this rank's slice of output: output[rank*n, (rank+1)*n)
//      reduce_scatter   output is this rank's slice of input
//      all_reduce       input and output are the same elements (same first byte, same numel)
//      all_to_all(_v)   the same elements (the backend stages the input before it writes)
//      scatter          at the root, output is the root's slice of input
//      broadcast        one buffer, always in place
//    Any other overlap (an all_gather input that overlaps the output elsewhere than in this
//    rank's slice, half of an all_reduce buffer shifted by one element, ...) is refused: other
//    members read the input while this rank writes the output, so no backend could honour it
//    without a copy that the caller did not ask for.
//  - send_recv: a receive buffer shares no element with any other buffer of the call (send or
//    receive); sends may overlap each other (they are only read). Strided views are compared
//    element by element (disjoint column blocks of one result do not overlap), except views of
//    different dtypes, or of more than 65536 elements together that are not boxes of one
//    row-major tensor: those are compared by their byte spans.
//
//   Tensor out = Tensor::empty({8}, DType::kF32);                 // 4 ranks, 2 elements each
//   comm.all_gather(out.narrow(0, 2 * comm.rank(), 2), out);       // in place: allowed
//   comm.all_gather(out.narrow(0, 1, 2), out);                     // InvalidArgument on every rank
struct Call {
  CollectiveKind kind = CollectiveKind::kBarrier;
  // all_gather, reduce_scatter, all_reduce, all_to_all(_v): the buffers. broadcast: both are the
  // buffer. scatter: input is the root's (validate() drops it on the other members).
  Tensor input, output;
  Reduction reduction;  // reduce_scatter, all_reduce
  int root = -1;        // broadcast, scatter
  // all_to_all_v counts and send_recv ops: the caller's, valid until the call returns (backends
  // copy what they keep).
  std::span<const int64_t> send_counts, recv_counts;
  std::span<const P2POp> ops;
  // Set by validate(): input and output overlap, in the collective's in-place form.
  bool in_place = false;

  // What a RecordingCommunicator logs (counts of this member; send_recv: totals and op count).
  CollectiveCall summary() const;
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
  void wait(const WorkPtr& work) {
    if (tracer_ == nullptr) return work->wait(timeout_);
    traced_wait(work);
  }

  // Tracing (kernels/trace.h; off while null: one branch per call, no allocation). Each
  // collective becomes an event from issue to completion on lane "comm <name()>" of process
  // global_rank(), with its kind, bytes, group and label as arguments; wait(work) an event on lane
  // "waits". Splits made after this inherit the tracer. REQUIRES: the tracer outlives the
  // communicator and its splits.
  void set_tracer(kernels::Tracer* tracer) { tracer_ = tracer; }
  kernels::Tracer* tracer() const { return tracer_; }
  int global_rank() const { return ranks_[static_cast<size_t>(rank_)]; }
  // The "label" argument of the next calls' events (e.g. the placement transition a redistribute
  // step makes); TraceLabel sets it for a scope.
  const std::string& trace_label() const { return trace_label_; }
  void set_trace_label(std::string label) { trace_label_ = std::move(label); }

  // The collectives (NOTE [call contract] for the checks and the aliasing rules). All buffers are
  // contiguous (send_recv: see p2p_views), one dtype per call, on a device the backend moves.
  // output = concat over members (group order) of input; output.numel() == size() * input.numel().
  WorkPtr all_gather(const Tensor& input, const Tensor& output) {
    return submit({.kind = CollectiveKind::kAllGather, .input = input, .output = output});
  }
  // output = reduce over members of slice rank() of input; input.numel() == size() * output.numel().
  WorkPtr reduce_scatter(const Tensor& input, const Tensor& output, Reduction r) {
    return submit({.kind = CollectiveKind::kReduceScatter, .input = input, .output = output, .reduction = r});
  }
  // output = reduce over members of input (same numel).
  WorkPtr all_reduce(const Tensor& input, const Tensor& output, Reduction r) {
    return submit({.kind = CollectiveKind::kAllReduce, .input = input, .output = output, .reduction = r});
  }
  // Equal splits: slice j of input goes to member j, and slice i of output comes from member i.
  WorkPtr all_to_all(const Tensor& input, const Tensor& output) {
    return submit({.kind = CollectiveKind::kAllToAll, .input = input, .output = output});
  }
  // Per-member element counts (send_counts[j] to member j, recv_counts[i] from member i), packed
  // back to back in member order. Counts may be zero; they must agree pairwise across members.
  WorkPtr all_to_all_v(const Tensor& input, std::span<const int64_t> send_counts, const Tensor& output,
                       std::span<const int64_t> recv_counts) {
    return submit({.kind = CollectiveKind::kAllToAllV, .input = input, .output = output,
                   .send_counts = send_counts, .recv_counts = recv_counts});
  }
  // buffer on every member = buffer of member `root`.
  WorkPtr broadcast(const Tensor& buffer, int root) {
    return submit({.kind = CollectiveKind::kBroadcast, .input = buffer, .output = buffer, .root = root});
  }
  // output on member i = slice i of root's input (input is ignored on the other members and may
  // be undefined there).
  WorkPtr scatter(const Tensor& input, const Tensor& output, int root) {
    return submit({.kind = CollectiveKind::kScatter, .input = input, .output = output, .root = root});
  }
  WorkPtr barrier() { return submit({.kind = CollectiveKind::kBarrier}); }
  // A batch of sends and receives exchanged as one operation (any permutation of data between
  // members). Each send must be matched by the peer's receive of the same numel and dtype, in
  // order per (sender, receiver) pair; elements pair up in row-major order of each buffer.
  // Where p2p_views() is true the buffers may be any strided views (non-negative strides; a
  // send and its receive may differ in shape), so callers move sub-blocks of tensors without
  // packing them; otherwise they must be contiguous.
  WorkPtr send_recv(std::span<const P2POp> ops) {
    return submit({.kind = CollectiveKind::kSendRecv, .ops = ops});
  }
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
  // communicator. nccl: fn runs at once on the calling thread after the device's compute stream
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

  // The backend's part of a collective. REQUIRES: `call` passed detail::validate() and
  // check_backend() on this communicator.
  virtual WorkPtr issue(const Call& call) = 0;
  // The limits of the backend's transport beyond the contract (the device kind it moves, count
  // limits); throws InvalidArgument or Unsupported naming the value. Runs after validate().
  virtual void check_backend(const Call& call) const { (void)call; }

 private:
  WorkPtr submit(Call call);
  WorkPtr traced_issue(const Call& call);
  void traced_wait(const WorkPtr& work);

  int rank_;
  std::vector<int> ranks_;
  std::string name_;
  Milliseconds timeout_;
  kernels::Tracer* tracer_ = nullptr;
  std::string trace_label_;
};

// Sets comm's trace label to make() for a scope, and back after; make() runs only while comm is
// traced, so an untraced call site allocates nothing.
//   const TraceLabel label(comm, [&] { return fmt::format("{} -> {}", before, after); });
class TraceLabel {
 public:
  template <class Make>
  TraceLabel(Communicator& comm, Make&& make) : comm_(comm.tracer() != nullptr ? &comm : nullptr) {
    if (comm_ != nullptr) {
      previous_ = comm_->trace_label();
      comm_->set_trace_label(make());
    }
  }
  ~TraceLabel() {
    if (comm_ != nullptr) comm_->set_trace_label(std::move(previous_));
  }
  TraceLabel(const TraceLabel&) = delete;
  TraceLabel& operator=(const TraceLabel&) = delete;

 private:
  Communicator* comm_;
  std::string previous_;
};

// Issues `call` on `comm` through the public method of its kind (so `comm` validates it again):
// what a decorator that wraps another communicator forwards from its issue().
WorkPtr forward(Communicator& comm, const Call& call);

namespace detail {
// NOTE [call contract]: checks `call` as made on `comm` and fills in what it implies (in_place;
// scatter's input dropped on non-roots). Throws InvalidArgument naming the call, the group and
// the value, and what was expected:
//  - buffers defined, contiguous (send_recv views where comm.p2p_views(): non-negative strides),
//    input and output of one dtype and device kind; fp8 (e4m3, e5m2) moves as bytes in every
//    collective but all_reduce and reduce_scatter, which refuse it naming the op and the dtype;
//  - counts: all_gather output = size x input, reduce_scatter input = size x output, all_reduce
//    equal, all_to_all equal and divisible by size, scatter (root) input = size x output,
//    all_to_all_v one count per member, >= 0, summing to the buffer;
//  - roots and peers in 0..size-1; a pre-multiplier only with sum;
//  - the aliasing rules.
void validate(Call& call, const Communicator& comm);
// True when the byte ranges of two tensors (views with non-negative strides) overlap.
bool overlaps(const Tensor& a, const Tensor& b);
// True when a and b address a common element (NOTE [call contract], send_recv: exact but for
// large non-box views and mixed dtypes, which fall back to overlaps(a, b)).
bool shares_elements(const Tensor& a, const Tensor& b);
}  // namespace detail

}  // namespace collectives
