// The nccl backend (collectives/nccl.h): NcclCommunicator and the factories; the state one NCCL
// communicator owns and its Works are in collectives/nccl/state.h. Compiled only when CUDA and
// NCCL are found; nccl_absent.cpp stands in otherwise. Plain C++ (g++ with the CUDA include
// folder): no kernels are launched here.
//
// NOTE [nccl call life] Every call goes through NcclCommunicator::enqueue_call(), under CommState::mu:
//  1. arguments were checked by detail::validate and check_backend (InvalidArgument, nothing
//     touched yet); an all_to_all in place has its input copied first (on the compute stream);
//  2. the previous call's enqueue is finished (a non-blocking communicator may still be setting
//     it up: NCCL forbids the next call until ncclCommGetAsyncError says ncclSuccess);
//  3. the communicator's stream waits for the compute stream (NOTE [nccl streams]);
//  4. the NCCL calls are made; ncclInProgress means NCCL finishes the enqueue in the background;
//  5. once enqueued (at once, or when polled later), the pre-multiplied-sum operators are
//     destroyed and the Completion's event is recorded on the stream.
// A Completion is shared by the Works of one call, or of every call of a batch. Completions stay
// in CommState::in_flight, holding their buffers, until their event has completed, so a dropped
// Work never frees a buffer NCCL still uses. Any NCCL or CUDA failure, or a timeout, aborts the
// NCCL communicator (CommState::fail) and fails every pending Completion with the reason.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/nccl.h"
#include "collectives/nccl/nccl_check.h"
#include "collectives/nccl/state.h"

namespace collectives {

using kernels::CommError;
using kernels::Device;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

bool nccl_built() { return true; }

namespace detail {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<CommState> state, Milliseconds timeout)
      : Communicator(state->rank, state->ranks, state->name, timeout), state_(std::move(state)) {}

  ~NcclCommunicator() override {
    try {
      CommState& s = *state_;
      std::lock_guard lk(s.mu);
      s.teardown_timeout = timeout();
      // A batch left open on this thread: close NCCL's group, then abort the communicator (the
      // batch's calls never ran).
      if (s.batch != nullptr && s.group_open && s.batch_thread == std::this_thread::get_id())
        s.fail(*s.batch, fmt::format("{} on {}: the communicator was destroyed with the batch "
                                     "open",
                                     s.batch->describe(), s.where()));
    } catch (...) {  // NOLINT: destructors never throw
    }
  }

  std::string_view backend() const override { return "nccl"; }

  // NOTE [call contract]: the nccl backend moves tensors on its own device only.
  void check_backend(const Call& c) const override {
    auto on_device = [&](const Tensor& t, const char* role) {
      if (t.defined() && t.device() != Device::cuda(state_->device))
        throw InvalidArgument(
            fmt::format("{} on group '{}': {} tensor is on {} but this NCCL communicator uses {}",
                        to_string(c.kind), name(), role, kernels::to_string(t.device()),
                        device_name(state_->device)));
    };
    on_device(c.input, c.kind == CollectiveKind::kBroadcast ? "buffer" : "input");
    on_device(c.output, c.kind == CollectiveKind::kBroadcast ? "buffer" : "output");
    for (const P2POp& op : c.ops) on_device(op.buffer, op.kind == P2POp::Kind::kSend ? "send" : "receive");
    // NCCL multiplies in the buffer's type: an integer buffer takes only integral multipliers.
    if (c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllReduce)
      (void)premul_scalar(c.kind, name(), c.output.dtype(), c.reduction);
  }

  WorkPtr issue(const Call& c) override {
    switch (c.kind) {
      case CollectiveKind::kAllGather: return run_all_gather(c);
      case CollectiveKind::kReduceScatter: return run_reduce_scatter(c);
      case CollectiveKind::kAllReduce: return all_reduce_checked(c.kind, c.input, c.output, c.reduction);
      case CollectiveKind::kAllToAll: {
        std::vector<int64_t> counts(size(), c.input.numel() / size());
        return exchange(c.kind, c.input, counts, c.output, counts);
      }
      case CollectiveKind::kAllToAllV:
        return exchange(c.kind, c.input, std::vector<int64_t>(c.send_counts.begin(), c.send_counts.end()), c.output,
                        std::vector<int64_t>(c.recv_counts.begin(), c.recv_counts.end()));
      case CollectiveKind::kBroadcast: return run_broadcast(c.output, c.root);
      case CollectiveKind::kScatter: return run_scatter(c);
      case CollectiveKind::kBarrier: {
        Tensor buffer;
        {
          std::lock_guard lk(state_->mu);
          buffer = state_->barrier_buffer;
        }
        return all_reduce_checked(c.kind, buffer, buffer, Reduction(ReduceOp::kSum));
      }
      case CollectiveKind::kSendRecv: return run_send_recv(c.ops);
    }
    throw kernels::InternalError("nccl backend: unknown collective kind");
  }

  // In place when the input is this rank's slice of the output (c.in_place); otherwise the two
  // are disjoint (NOTE [call contract]).
  WorkPtr run_all_gather(const Call& c) {
    const size_t count = static_cast<size_t>(c.input.numel());
    const ncclDataType_t dtype = nccl_dtype(c.input.dtype());
    const void* send_ptr = c.input.data_ptr();
    void* recv_ptr = c.output.data_ptr();
    return enqueue_call(c.kind, {c.input, c.output}, [&](Completion& done) {
      if (count == 0) return ncclSuccess;
      return nccl_check(ncclAllGather(send_ptr, recv_ptr, count, dtype, comm(), stream()),
                        "ncclAllGather", state_->context(done), InProgress::kAccept);
    });
  }

  // In place when the output is this rank's slice of the input; otherwise disjoint.
  WorkPtr run_reduce_scatter(const Call& c) {
    const size_t count = static_cast<size_t>(c.output.numel());
    const ncclDataType_t dtype = nccl_dtype(c.output.dtype());
    const Reduction r = c.reduction;
    const std::optional<PremulScalar> premul = premul_scalar(c.kind, name(), c.output.dtype(), r);
    const void* send_ptr = c.input.data_ptr();
    void* recv_ptr = c.output.data_ptr();
    return enqueue_call(c.kind, {c.input, c.output}, [&](Completion& done) {
      if (count == 0) return ncclSuccess;
      const ncclRedOp_t op = reduction_op(done, r, premul, dtype);
      return nccl_check(ncclReduceScatter(send_ptr, recv_ptr, count, dtype, op, comm(), stream()),
                        "ncclReduceScatter", state_->context(done), InProgress::kAccept);
    });
  }

  WorkPtr run_broadcast(const Tensor& buffer, int root) {
    constexpr auto kind = CollectiveKind::kBroadcast;
    const size_t count = static_cast<size_t>(buffer.numel());
    const ncclDataType_t dtype = nccl_dtype(buffer.dtype());
    void* ptr = buffer.data_ptr();
    return enqueue_call(kind, {buffer}, [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      return nccl_check(ncclBroadcast(ptr, ptr, count, dtype, root, comm(), stream()),
                        "ncclBroadcast", state_->context(c), InProgress::kAccept);
    });
  }

  // At the root the output is its slice of the input (c.in_place) or disjoint from it.
  WorkPtr run_scatter(const Call& c) {
    const int root = c.root;
    const bool is_root = rank() == root;
    const bool in_place = c.in_place;
    const size_t count = static_cast<size_t>(c.output.numel());
    const ncclDataType_t dtype = nccl_dtype(c.output.dtype());
    std::vector<Tensor> keep{c.output};
    if (is_root) keep.push_back(c.input);
    void* recv_ptr = c.output.data_ptr();
    char* send_base = is_root ? bytes_of(c.input) : nullptr;
    return enqueue_call(c.kind, std::move(keep), [&](Completion& done) {
      if (count == 0) return ncclSuccess;
      const auto context = state_->context(done);
      const size_t slice = c.output.nbytes();
      return grouped(context, [&] {
        if (!is_root) {
          nccl_check(ncclRecv(recv_ptr, count, dtype, root, comm(), stream()), "ncclRecv", context,
                     InProgress::kAccept);
          return;
        }
        for (int peer = 0; peer < size(); ++peer) {
          if (peer == rank()) {
            if (in_place) continue;  // the root's slice is already its output
            nccl_check(ncclRecv(recv_ptr, count, dtype, peer, comm(), stream()), "ncclRecv",
                       context, InProgress::kAccept);
          }
          nccl_check(ncclSend(send_base + static_cast<size_t>(peer) * slice, count, dtype, peer,
                              comm(), stream()),
                     "ncclSend", context, InProgress::kAccept);
        }
      });
    });
  }

  // NCCL runs the sends and receives of one call concurrently: validate() made sure no receive
  // buffer overlaps another buffer of the call.
  WorkPtr run_send_recv(std::span<const P2POp> ops) {
    constexpr auto kind = CollectiveKind::kSendRecv;
    std::vector<Tensor> keep;
    for (const P2POp& op : ops) keep.push_back(op.buffer);
    struct Resolved {
      bool is_send;
      void* ptr;
      size_t count;
      ncclDataType_t dtype;
      int peer;
    };
    std::vector<Resolved> resolved;
    for (const P2POp& op : ops)
      if (op.buffer.numel() > 0)
        resolved.push_back({op.kind == P2POp::Kind::kSend, op.buffer.data_ptr(),
                            static_cast<size_t>(op.buffer.numel()), nccl_dtype(op.buffer.dtype()),
                            op.peer});
    return enqueue_call(kind, std::move(keep), [&](Completion& c) {
      if (resolved.empty()) return ncclSuccess;
      const auto context = state_->context(c);
      return grouped(context, [&] {
        for (const Resolved& op : resolved) {
          if (op.is_send) {
            nccl_check(ncclSend(op.ptr, op.count, op.dtype, op.peer, comm(), stream()), "ncclSend",
                       context, InProgress::kAccept);
          } else {
            nccl_check(ncclRecv(op.ptr, op.count, op.dtype, op.peer, comm(), stream()), "ncclRecv",
                       context, InProgress::kAccept);
          }
        }
      });
    });
  }

  // NOTE [in-order engine] on NCCL: a dependency on an NCCL Work of this device becomes
  // cudaStreamWaitEvent on this communicator's stream (nothing waits on the host); any other
  // Work is waited for on the host here (bounded by the timeout) before the call returns.
  void wait_for(const WorkPtr& work) override {
    if (!work) return;
    if (auto* w = dynamic_cast<NcclWork*>(work.get())) {
      CommState& s = *state_;
      if (w->same_device(s.device)) {
        (void)w->completed();  // finishes its enqueue when NCCL reported it in progress
        if (cudaEvent_t ev = w->recorded_event()) {
          std::lock_guard lk(s.mu);
          s.require_usable("wait_for");
          const auto guard = device_guard(s.device, s.where());
          cuda_check(cudaStreamWaitEvent(s.stream, ev, 0), "cudaStreamWaitEvent", s.where());
          return;
        }
      }
    }
    if (!work->settle(timeout()))
      throw CommError(fmt::format("wait_for on {}: {} did not finish within {} ms", state_->where(),
                                  work->describe(), timeout().count()));
  }

  // Runs fn now on this thread, after making the compute stream (where the kernels layer runs
  // its copies) wait for everything queued on this communicator's stream; the Work completes
  // when what fn queued on the compute stream has run.
  WorkPtr host_task(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument(fmt::format("host_task on group '{}': the function is empty", name()));
    CommState& s = *state_;
    std::shared_ptr<Completion> c;
    {
      std::lock_guard lk(s.mu);
      if (s.batch != nullptr)
        throw InvalidArgument(fmt::format("host_task on group '{}': not allowed inside a batch", name()));
      s.require_usable("host_task");
      const auto guard = device_guard(s.device, s.where());
      s.settle_pending(deadline_after(timeout()), timeout());
      s.require_usable("host_task");
      s.reap();
      c = s.make_completion(/*is_batch=*/false);
      c->host_task = true;
      c->calls.emplace_back(s.next_call++, CollectiveKind::kBarrier);
      cuda_check(cudaEventRecord(s.ready, s.stream), "cudaEventRecord", s.context(*c));
      cuda_check(cudaStreamWaitEvent(s.compute, s.ready, 0), "cudaStreamWaitEvent(compute stream)",
                 s.context(*c));
    }
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lk(s.mu);
    const auto guard = device_guard(s.device, s.where());
    if (error) {
      c->state = Completion::State::kFailed;
      c->exception = error;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        c->error = e.what();
      } catch (...) {
        c->error = "unknown exception";
      }
      return std::make_shared<NcclWork>(state_, std::move(c));
    }
    cuda_check(cudaEventRecord(c->done, s.compute), "cudaEventRecord(compute stream)", s.context(*c));
    c->state = Completion::State::kEnqueued;
    s.in_flight.push_back(c);
    return std::make_shared<NcclWork>(state_, std::move(c));
  }

  // NOTE [nccl batches] begin_batch() opens an NCCL group (ncclGroupStart) on this thread; the
  // calls up to end_batch() are queued in it and share one Completion, whose event end_batch()
  // records after ncclGroupEnd. NCCL groups are per thread, so the batch is filled and ended on
  // the thread that began it, and no other NCCL communicator may be used from that thread
  // meanwhile (it would silently join the group).
  void begin_batch() override {
    CommState& s = *state_;
    std::lock_guard lk(s.mu);
    if (s.batch != nullptr)
      throw InvalidArgument(fmt::format("begin_batch on group '{}': already in a batch", name()));
    s.require_no_foreign_batch("begin_batch");
    s.require_usable("begin_batch");
    const auto guard = device_guard(s.device, s.where());
    s.settle_pending(deadline_after(timeout()), timeout());
    s.require_usable("begin_batch");
    s.reap();
    std::shared_ptr<Completion> c = s.make_completion(/*is_batch=*/true);
    nccl_check(ncclGroupStart(), "ncclGroupStart", s.where());
    s.batch = std::move(c);
    s.group_open = true;
    s.batch_thread = std::this_thread::get_id();
    t_open_batch = &s;
  }

  WorkPtr end_batch() override {
    CommState& s = *state_;
    std::lock_guard lk(s.mu);
    if (s.batch == nullptr)
      throw InvalidArgument(fmt::format("end_batch on group '{}': no batch begun", name()));
    if (s.batch_thread != std::this_thread::get_id())
      throw InvalidArgument(
          fmt::format("end_batch on group '{}': the batch was begun on another "
                      "thread (NCCL groups are per thread)",
                      name()));
    std::shared_ptr<Completion> c = std::exchange(s.batch, nullptr);
    if (t_open_batch == &s) t_open_batch = nullptr;
    if (!s.group_open) {  // failed (and closed) while open
      s.abort_comm();     // in case the failure happened on another thread
      throw CommError(c->error.empty() ? fmt::format("end_batch on {}: the batch failed: {}",
                                                     s.where(), s.broken_reason)
                                       : c->error);
    }
    s.group_open = false;
    try {
      const auto guard = device_guard(s.device, s.context(*c));
      s.order_after_default_stream(*c);
    } catch (...) {
      (void)ncclGroupEnd();  // keep NCCL's groups balanced on this thread
      s.fail(*c, fmt::format("{} on {}: could not order it after the default stream", c->describe(),
                             s.where()));
      throw CommError(c->error);
    }
    try {
      const auto guard = device_guard(s.device, s.context(*c));
      const ncclResult_t r =
          nccl_check(ncclGroupEnd(), "ncclGroupEnd", s.context(*c), InProgress::kAccept);
      s.launched(c, r);
    } catch (const std::exception& e) {
      s.fail(*c, e.what());
      throw CommError(c->error);
    }
    return std::make_shared<NcclWork>(state_, std::move(c));
  }

  std::unique_ptr<Communicator> split(std::span<const int> group, std::string new_name) override;

 private:
  ncclComm_t comm() const { return state_->comm; }
  cudaStream_t stream() const { return state_->stream; }

  // REQUIRES: input and output validated (or the barrier buffer): the same elements (in place)
  // or disjoint.
  WorkPtr all_reduce_checked(CollectiveKind kind, const Tensor& input, const Tensor& output,
                             const Reduction& r) {
    const size_t count = static_cast<size_t>(output.numel());
    const ncclDataType_t dtype = nccl_dtype(output.dtype());
    const std::optional<PremulScalar> premul = premul_scalar(kind, name(), output.dtype(), r);
    const void* send_ptr = input.data_ptr();  // NCCL works in place when it is the output
    void* recv_ptr = output.data_ptr();
    return enqueue_call(kind, {input, output}, [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      const ncclRedOp_t op = reduction_op(c, r, premul, dtype);
      return nccl_check(ncclAllReduce(send_ptr, recv_ptr, count, dtype, op, comm(), stream()),
                        "ncclAllReduce", state_->context(c), InProgress::kAccept);
    });
  }

  // all_to_all(_v) as ncclSend/ncclRecv pairs in one group (counts in elements, packed in
  // member order). REQUIRES: counts checked.
  WorkPtr exchange(CollectiveKind kind, const Tensor& input, std::vector<int64_t> send_counts,
                   const Tensor& output, std::vector<int64_t> recv_counts) {
    const ncclDataType_t dtype = nccl_dtype(output.dtype());
    const size_t item = kernels::itemsize(output.dtype());
    // In place (the same elements, NOTE [call contract]): the input is staged first, since
    // the sends and receives run concurrently.
    const Tensor send = overlaps(input, output) ? input.clone() : input;
    char* send_base = bytes_of(send);
    char* recv_base = bytes_of(output);
    return enqueue_call(kind, {send, output}, [&](Completion& c) {
      if (input.numel() == 0 && output.numel() == 0) return ncclSuccess;
      const auto context = state_->context(c);
      return grouped(context, [&] {
        size_t send_offset = 0, recv_offset = 0;
        for (int peer = 0; peer < size(); ++peer) {
          const size_t send_count = static_cast<size_t>(send_counts[peer]);
          const size_t recv_count = static_cast<size_t>(recv_counts[peer]);
          if (send_count > 0)
            nccl_check(
                ncclSend(send_base + send_offset * item, send_count, dtype, peer, comm(), stream()),
                "ncclSend", context, InProgress::kAccept);
          if (recv_count > 0)
            nccl_check(
                ncclRecv(recv_base + recv_offset * item, recv_count, dtype, peer, comm(), stream()),
                "ncclRecv", context, InProgress::kAccept);
          send_offset += send_count;
          recv_offset += recv_count;
        }
      });
    });
  }

  // The NCCL operator of `r`; a pre-multiplied sum is created here (its scalar is read at once,
  // ncclScalarHostImmediate) and destroyed once the call is enqueued.
  ncclRedOp_t reduction_op(Completion& c, const Reduction& r,
                           const std::optional<PremulScalar>& premul, ncclDataType_t dtype) {
    if (!premul) return builtin_op(r.op);
    PremulScalar scalar = *premul;
    ncclRedOp_t op{};
    nccl_check(ncclRedOpCreatePreMulSum(&op, scalar.bytes, dtype, ncclScalarHostImmediate, comm()),
               "ncclRedOpCreatePreMulSum", state_->context(c));
    c.red_ops.push_back(op);
    return op;
  }

  // NOTE [nccl call life]. `enqueue` makes the NCCL calls and returns the outermost result
  // (ncclSuccess or ncclInProgress); it throws CommError on a failure.
  template <class Enqueue>
  WorkPtr enqueue_call(CollectiveKind kind, std::vector<Tensor> keep_alive, Enqueue&& enqueue) {
    CommState& s = *state_;
    std::lock_guard lk(s.mu);
    s.require_no_foreign_batch(to_string(kind));
    s.require_usable(to_string(kind));
    const auto guard = device_guard(s.device, s.where());
    const bool batched = s.batch != nullptr;
    if (!batched) {
      s.settle_pending(deadline_after(timeout()), timeout());
      s.require_usable(to_string(kind));
    }
    s.reap();
    std::shared_ptr<Completion> c = batched ? s.batch : s.make_completion(/*is_batch=*/false);
    c->calls.emplace_back(s.next_call++, kind);
    for (Tensor& t : keep_alive) c->keep_alive.push_back(std::move(t));
    try {
      s.order_after_default_stream(*c);
      const ncclResult_t r = enqueue(*c);
      if (!batched) s.launched(c, r);
    } catch (const std::exception& e) {
      s.fail(*c, fmt::format("{} on {}: {}", c->describe(), s.where(), e.what()));
      throw CommError(c->error);
    }
    return std::make_shared<NcclWork>(state_, std::move(c));
  }

  std::shared_ptr<CommState> state_;
};

// Polls until `comm` has finished its asynchronous initialisation. Returns an empty string on
// success, otherwise the reason (the caller aborts `comm`).
std::string wait_initialised(ncclComm_t comm, Clock::time_point deadline, Milliseconds timeout,
                             const std::string& what) {
  ncclResult_t async = ncclInProgress;
  std::string error;
  const bool settled = poll_until(deadline, [&] {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) {
      error = nccl_error(r, "ncclCommGetAsyncError", what).what();
      return true;
    }
    return async != ncclInProgress;
  });
  if (!error.empty()) return error;
  if (!settled)
    return fmt::format(
        "{} did not complete within {} ms: some members did not join (NCCL cannot "
        "tell which: ranks that have not joined are unknown to NCCL)",
        what, timeout.count());
  if (async != ncclSuccess) return fmt::format("{} failed: {}", what, nccl_async_error_text(async));
  return {};
}

// Wraps an initialised NCCL communicator (owned from here on, even when this throws).
std::unique_ptr<Communicator> make_communicator(ncclComm_t comm, int device, int rank,
                                                std::vector<int> ranks, std::string name,
                                                Milliseconds timeout) {
  auto state =
      std::make_shared<CommState>(comm, device, rank, std::move(ranks), std::move(name), timeout);
  state->create_resources();
  Tensor buffer = Tensor::zeros({1}, DType::kI32, Device::cuda(device));
  {
    std::lock_guard lk(state->mu);
    state->barrier_buffer = std::move(buffer);
  }
  return std::make_unique<NcclCommunicator>(std::move(state), timeout);
}

std::unique_ptr<Communicator> NcclCommunicator::split(std::span<const int> group,
                                                      std::string new_name) {
  const std::string call =
      fmt::format("split of group '{}' into [{}]", name(), fmt::join(group, ","));
  if (group.empty())
    throw InvalidArgument(
        fmt::format("{}: the group is empty (expected the members of this "
                    "rank's new group, including rank {})",
                    call, rank()));
  std::vector<int> sorted(group.begin(), group.end());
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0 || sorted.back() >= size())
    throw InvalidArgument(fmt::format("{}: members must be group ranks 0..{}", call, size() - 1));
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw InvalidArgument(fmt::format("{}: a member appears twice", call));
  const auto self = std::find(group.begin(), group.end(), rank());
  if (self == group.end())
    throw InvalidArgument(
        fmt::format("{}: the group does not contain this rank ({})", call, rank()));
  // Groups are disjoint, so their smallest members tell them apart; the key orders the new ranks
  // as asked (NCCL sorts by key).
  const int color = sorted.front();
  const int key = static_cast<int>(self - group.begin());
  std::vector<int> global;
  for (int m : group) global.push_back(ranks()[m]);
  if (new_name.empty()) new_name = "split";

  CommState& s = *state_;
  ncclComm_t child = nullptr;
  {
    std::lock_guard lk(s.mu);
    if (s.batch != nullptr)
      throw InvalidArgument(fmt::format("{}: not allowed inside a batch", call));
    s.require_no_foreign_batch("split");
    s.require_usable("split");
    const auto guard = device_guard(s.device, s.where());
    s.settle_pending(deadline_after(timeout()), timeout());
    s.require_usable("split");
    s.reap();
    const uint64_t number = s.next_call++;
    const std::string what = fmt::format("{} (call #{}) on {}", call, number, s.where());
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t r = ncclCommSplit(s.comm, color, key, &child, &config);
    auto fail_parent = [&](const std::string& reason) {
      Completion c;  // stands for the split in fail()
      c.calls.emplace_back(number, CollectiveKind::kBarrier);
      s.fail(c, reason);
      // The parent's abort stops (and joins) the split; a child it produced is aborted too.
      if (child != nullptr) (void)ncclCommAbort(child);
      throw CommError(reason);
    };
    if (r != ncclSuccess && r != ncclInProgress)
      fail_parent(nccl_error(r, "ncclCommSplit", what).what());
    // The split runs as an asynchronous job of the parent: *child is written when it ends.
    const Clock::time_point deadline = deadline_after(timeout());
    const std::string error =
        wait_initialised(s.comm, deadline, timeout(), "ncclCommSplit " + what);
    if (!error.empty()) fail_parent(error);
    if (child == nullptr)
      throw CommError(fmt::format("{}: ncclCommSplit returned no communicator", what));
    const std::string child_error =
        wait_initialised(child, deadline, timeout(), "ncclCommSplit (new communicator) " + what);
    if (!child_error.empty()) {
      (void)ncclCommAbort(child);
      throw CommError(child_error);
    }
    int count = 0, child_rank = -1;
    const ncclResult_t rc = ncclCommCount(child, &count);
    const ncclResult_t rr = ncclCommUserRank(child, &child_rank);
    if (rc != ncclSuccess || rr != ncclSuccess || count != static_cast<int>(group.size()) ||
        child_rank != key) {
      (void)ncclCommAbort(child);
      throw CommError(fmt::format(
          "{}: NCCL made a group of {} ranks with this rank at {}, expected {} ranks with this "
          "rank at {}: the members passed inconsistent groups",
          what, count, child_rank, group.size(), key));
    }
  }
  std::unique_ptr<Communicator> made = make_communicator(child, s.device, key, std::move(global), std::move(new_name), timeout());
  made->set_tracer(tracer());
  return made;
}

enum Readiness : int32_t { kReady = 1, kNoGpu = 0, kBadArgument = -1, kFailed = -2 };

}  // namespace
}  // namespace detail

std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device,
                                                Milliseconds timeout) {
  using namespace detail;
  const int n = bootstrap.size(), rank = bootstrap.rank();
  const std::string where = fmt::format("nccl_communicator on group '{}' (rank {} of {}, {})",
                                        bootstrap.name(), rank, n, device_name(device));
  // 1. Can this member take part? Member 0 also creates the id.
  Readiness readiness = kReady;
  std::string reason;
  ncclUniqueId id{};
  try {
    kernels::detail::cuda_check_device(device);
    if (rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", where);
  } catch (const Unsupported& e) {
    readiness = kNoGpu;
    reason = e.what();
  } catch (const InvalidArgument& e) {
    readiness = kBadArgument;
    reason = e.what();
  } catch (const std::exception& e) {
    readiness = kFailed;
    reason = e.what();
  }
  // 2. All members learn who cannot, so they fail together (CPU all_gather over the bootstrap).
  Tensor mine = Tensor::full({1}, static_cast<double>(readiness), DType::kI32);
  Tensor all = Tensor::empty({n}, DType::kI32);
  bootstrap.wait(bootstrap.all_gather(mine, all));
  switch (readiness) {
    case kReady: break;
    case kNoGpu: throw Unsupported(fmt::format("{}: {}", where, reason));
    case kBadArgument: throw InvalidArgument(fmt::format("{}: {}", where, reason));
    case kFailed: throw CommError(fmt::format("{}: {}", where, reason));
  }
  std::vector<int> not_ready;
  bool only_no_gpu = true;
  const int32_t* flags = all.data<int32_t>();
  for (int i = 0; i < n; ++i) {
    if (flags[i] == kReady) continue;
    not_ready.push_back(bootstrap.ranks()[i]);
    only_no_gpu = only_no_gpu && flags[i] == kNoGpu;
  }
  if (!not_ready.empty()) {
    const std::string message = fmt::format(
        "{}: ranks [{}] cannot take part ({}; see their errors): no NCCL communicator was created",
        where, fmt::join(not_ready, ","), only_no_gpu ? "no usable GPU" : "they failed");
    if (only_no_gpu) throw Unsupported(message);
    throw CommError(message);
  }
  // 3. Share the id.
  static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
  Tensor id_bytes = Tensor::empty({NCCL_UNIQUE_ID_BYTES}, DType::kU8);
  if (rank == 0) std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
  bootstrap.wait(bootstrap.broadcast(id_bytes, 0));
  std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));
  // 4. Join (non-blocking: polled until the deadline).
  ncclComm_t comm = nullptr;
  {
    const auto guard = device_guard(device, where);
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t r = ncclCommInitRankConfig(&comm, n, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr) (void)ncclCommAbort(comm);
      throw nccl_error(r, "ncclCommInitRankConfig", where);
    }
    if (comm == nullptr)
      throw CommError(fmt::format("{}: ncclCommInitRankConfig returned no communicator", where));
    const std::string error =
        wait_initialised(comm, deadline_after(timeout), timeout, "ncclCommInitRankConfig " + where);
    if (!error.empty()) {
      (void)ncclCommAbort(comm);
      throw CommError(error);
    }
  }
  return make_communicator(comm, device, rank, bootstrap.ranks(), bootstrap.name(), timeout);
}

std::vector<std::unique_ptr<Communicator>> nccl_communicators_all(std::span<const int> devices,
                                                                  Milliseconds timeout) {
  using namespace detail;
  const int n = static_cast<int>(devices.size());
  const std::string where =
      fmt::format("nccl_communicators_all on devices [{}]", fmt::join(devices, ","));
  if (n == 0)
    throw InvalidArgument(
        "nccl_communicators_all: no devices given (expected one CUDA device index "
        "per rank)");
  for (int i = 0; i < n; ++i) {
    if (devices[i] < 0)
      throw InvalidArgument(
          fmt::format("{}: invalid CUDA device index {} (expected 0 or more)", where, devices[i]));
    for (int j = 0; j < i; ++j)
      if (devices[j] == devices[i])
        throw InvalidArgument(fmt::format("{}: {} appears twice (NCCL needs one GPU per rank)",
                                          where, device_name(devices[i])));
  }
  for (int d : devices) {
    try {
      kernels::detail::cuda_check_device(d);
    } catch (const Unsupported& e) {
      throw Unsupported(fmt::format("{}: {}", where, e.what()));
    }
  }
  ncclUniqueId id{};
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", where);
  // What ncclCommInitAll does, with a configuration: one ncclCommInitRankConfig per device in
  // one group, each with its device current.
  std::vector<ncclComm_t> comms(n, nullptr);
  auto abort_all = [&] {
    for (ncclComm_t& c : comms)
      if (c != nullptr) (void)ncclCommAbort(c);
    comms.assign(n, nullptr);
  };
  {
    ncclConfig_t config = nonblocking_config();
    int previous = 0;
    cuda_check(cudaGetDevice(&previous), "cudaGetDevice", where);
    std::string error;
    const ncclResult_t started = ncclGroupStart();
    if (started != ncclSuccess) throw nccl_error(started, "ncclGroupStart", where);
    for (int i = 0; i < n && error.empty(); ++i) {
      const cudaError_t e = cudaSetDevice(devices[i]);
      if (e != cudaSuccess) {
        try {
          cuda_check(e, "cudaSetDevice", where);
        } catch (const CommError& failure) {
          error = failure.what();
        }
        break;
      }
      const ncclResult_t r = ncclCommInitRankConfig(&comms[i], n, id, i, &config);
      if (r != ncclSuccess && r != ncclInProgress)
        error =
            nccl_error(r, "ncclCommInitRankConfig", fmt::format("{}, rank {}", where, i)).what();
    }
    const ncclResult_t ended = ncclGroupEnd();
    (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
    if (error.empty() && ended != ncclSuccess && ended != ncclInProgress)
      error = nccl_error(ended, "ncclGroupEnd", where).what();
    const Clock::time_point deadline = deadline_after(timeout);
    for (int i = 0; i < n && error.empty(); ++i) {
      if (comms[i] == nullptr) {
        error = fmt::format("{}: ncclCommInitRankConfig returned no communicator for rank {}",
                            where, i);
        break;
      }
      error = wait_initialised(comms[i], deadline, timeout,
                               fmt::format("ncclCommInitRankConfig {}, rank {}", where, i));
    }
    if (!error.empty()) {
      abort_all();
      throw CommError(error);
    }
  }
  // Each communicator owns its NCCL communicator from here; those not yet wrapped are aborted if
  // wrapping one fails.
  std::vector<std::unique_ptr<Communicator>> result;
  std::vector<int> ranks(n);
  for (int i = 0; i < n; ++i) ranks[i] = i;
  try {
    for (int i = 0; i < n; ++i) {
      ncclComm_t comm = std::exchange(comms[i], nullptr);
      result.push_back(make_communicator(comm, devices[i], i, ranks, "world", timeout));
    }
  } catch (...) {
    abort_all();
    throw;
  }
  return result;
}

}  // namespace collectives
