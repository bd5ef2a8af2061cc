// Internal to the nccl backend (collectives/nccl/nccl_communicator.cpp): the state one NCCL
// communicator owns (CommState: stream, events, pending Completions, failure and teardown, NOTE
// [nccl call life]), its Works, and the helpers around them. Not installed. Like nccl_check.h it
// includes no CUDA or NCCL header (the layering rule): the including .cpp includes them first.
#pragma once

#if !defined(__CUDA_RUNTIME_H__) || !defined(NCCL_H_)
#error "include <cuda_runtime.h> and <nccl.h> before collectives/nccl/state.h"
#endif

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/nccl/nccl_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/device_guard.h"
#include "kernels/dtype.h"
#include "kernels/error.h"

namespace collectives::detail {

using kernels::CommError;
using kernels::Device;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

using Clock = std::chrono::steady_clock;

inline std::string device_name(int device) { return kernels::to_string(Device::cuda(device)); }

// now + timeout, saturating (a huge timeout means "no deadline"); a negative timeout is 0.
inline Clock::time_point deadline_after(Milliseconds timeout) {
  const Clock::time_point now = Clock::now();
  if (timeout <= Milliseconds{0}) return now;
  if (timeout >= std::chrono::duration_cast<Milliseconds>(Clock::time_point::max() - now))
    return Clock::time_point::max();
  return now + timeout;
}

// Calls done() until it returns true (-> true) or the deadline has passed (-> false). Spins with
// yields first (NCCL operations often complete within microseconds), then sleeps with a back-off
// up to 1 ms. done() is always called at least once, and once more after the last sleep.
template <class Done>
bool poll_until(Clock::time_point deadline, Done&& done) {
  for (int i = 0;; ++i) {
    if (done()) return true;
    if (Clock::now() >= deadline) return false;
    if (i < 64) {
      std::this_thread::yield();
    } else {
      const int shift = std::min(i - 64, 7);
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 8 << shift)));
    }
  }
}

// kernels::detail::DeviceGuard for the scope, a failure reported as a CommError with `context`.
template <class Context>
kernels::detail::DeviceGuard device_guard(int device, const Context& context) {
  try {
    return kernels::detail::DeviceGuard(device);
  } catch (const kernels::InvalidArgument&) {
    throw;
  } catch (const kernels::Unsupported&) {
    throw;
  } catch (const kernels::Error& e) {
    throw CommError(fmt::format("{} ({})", e.what(), context_text(context)));
  }
}

// Best effort, for destructors: never throws; failures are ignored.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) noexcept {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != device &&
        cudaSetDevice(device) == cudaSuccess)
      previous_ = current;
    (void)cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
    (void)cudaGetLastError();
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // NOTE [nccl timeouts]: no NCCL call may block the host
  return config;
}

inline ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8:
    // fp8 moves as opaque bytes; reducing collectives refuse it (detail::validate).
    case DType::kF8E4M3:
    case DType::kF8E5M2: return ncclUint8;
  }
  throw kernels::InternalError(
      fmt::format("nccl backend: dtype {} reached nccl_dtype", kernels::to_string(dtype)));
}

inline ncclRedOp_t builtin_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProd: return ncclProd;
  }
  throw kernels::InternalError("nccl backend: unknown ReduceOp");
}

// The host scalar of a pre-multiplied sum, in the buffer's dtype (NCCL multiplies in that type).
struct PremulScalar {
  alignas(8) unsigned char bytes[8] = {};
};

inline float to_float(double m) {
  if (std::isnan(m)) return std::numeric_limits<float>::quiet_NaN();
  if (m > std::numeric_limits<float>::max()) return std::numeric_limits<float>::infinity();
  if (m < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(m);
}

// nullopt for a plain reduction. Throws Unsupported when an integer dtype cannot hold the
// multiplier exactly (NCCL would multiply by a truncated integer).
inline std::optional<PremulScalar> premul_scalar(CollectiveKind kind, const std::string& group,
                                          DType dtype, const Reduction& r) {
  if (r.pre_multiplier == 1.0) return std::nullopt;
  const double m = r.pre_multiplier;
  PremulScalar s;
  auto put = [&s](auto value) {
    static_assert(sizeof(value) <= sizeof(s.bytes));
    std::memcpy(s.bytes, &value, sizeof(value));
  };
  auto integral_in = [m](double lo, double hi) {
    return std::isfinite(m) && m == std::trunc(m) && m >= lo && m <= hi;
  };
  auto not_integral = [&]() {
    return Unsupported(fmt::format(
        "{} on group '{}': a pre-multiplier of {} cannot be applied to {} by NCCL (it multiplies "
        "in the buffer's integer type: use an integral multiplier within its range, or a "
        "floating-point dtype)",
        to_string(kind), group, m, kernels::to_string(dtype)));
  };
  switch (dtype) {
    case DType::kF64: put(m); break;
    case DType::kF32: put(to_float(m)); break;
    case DType::kBF16: put(kernels::float_to_bf16_bits(to_float(m))); break;
    case DType::kF16: put(kernels::float_to_f16_bits(to_float(m))); break;
    case DType::kI32:
      if (!integral_in(-2147483648.0, 2147483647.0)) throw not_integral();
      put(static_cast<int32_t>(m));
      break;
    case DType::kI64:
      // [-2^63, 2^63): the largest double below 2^63 is 2^63 - 1024.
      if (!integral_in(-9223372036854775808.0, 9223372036854774784.0)) throw not_integral();
      put(static_cast<int64_t>(m));
      break;
    case DType::kU8:
      if (!integral_in(0.0, 255.0)) throw not_integral();
      put(static_cast<uint8_t>(m));
      break;
    case DType::kF8E4M3:
    case DType::kF8E5M2:  // reducing collectives refuse fp8 (detail::validate)
      throw kernels::InternalError(fmt::format("nccl backend: a reduction scalar of dtype {}", kernels::to_string(dtype)));
  }
  return s;
}

inline char* bytes_of(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }


// One call, or one batch of calls, as the Works see it. Guarded by CommState::mu.
struct Completion {
  enum class State {
    kOpen,        // a batch still being filled (begin_batch .. end_batch)
    kEnqueueing,  // NCCL returned ncclInProgress: the operation is not on the stream yet
    kEnqueued,    // on the stream; `done` recorded after it
    kDone,
    kFailed,
  };
  State state = State::kOpen;
  bool batch = false;
  std::vector<std::pair<uint64_t, CollectiveKind>> calls;  // (call number, kind)
  int device = 0;
  cudaEvent_t done = nullptr;
  std::vector<Tensor> keep_alive;    // buffers NCCL reads or writes, staged copies
  std::vector<ncclRedOp_t> red_ops;  // pre-multiplied sums, destroyed once enqueued
  std::string error;                 // kFailed: the CommError message
  bool host_task = false;            // a host_task(): `done` is recorded on the compute stream
  std::exception_ptr exception;      // a host task's own exception, rethrown by wait()

  Completion() = default;
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  ~Completion() {
    if (done != nullptr) {
      // A recorded event may be destroyed before it completes: CUDA releases it afterwards.
      QuietDeviceGuard guard(device);
      (void)cudaEventDestroy(done);
    }
  }

  bool final() const { return state == State::kDone || state == State::kFailed; }

  // "all_reduce (call #3)" or "batch of 2 calls (#3 all_gather, #4 all_reduce)".
  std::string describe() const {
    if (host_task) return fmt::format("host task (call #{})", calls.empty() ? 0 : calls[0].first);
    if (!batch && calls.size() == 1)
      return fmt::format("{} (call #{})", to_string(calls[0].second), calls[0].first);
    std::vector<std::string> parts;
    for (const auto& [number, kind] : calls)
      parts.push_back(fmt::format("#{} {}", number, to_string(kind)));
    return fmt::format("batch of {} calls ({})", calls.size(), fmt::join(parts, ", "));
  }
};

class CommState;

// NCCL groups are per thread (NOTE [nccl batches]): the communicator whose batch is open on this
// thread, if any. Compared, never dereferenced.
inline thread_local const CommState* t_open_batch = nullptr;

// Everything one NCCL communicator owns; shared by the NcclCommunicator and its Works, so the
// last of them tears it down. Every member is guarded by `mu`.
class CommState {
 public:
  CommState(ncclComm_t nccl_comm, int cuda_device, int group_rank, std::vector<int> global_ranks,
            std::string group_name, Milliseconds timeout)
      : comm(nccl_comm),
        device(cuda_device),
        rank(group_rank),
        ranks(std::move(global_ranks)),
        name(std::move(group_name)),
        teardown_timeout(timeout) {}
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;
  ~CommState() { teardown(); }

  // Creates the stream and the ordering event. REQUIRES: called once, right after construction.
  void create_resources() {
    std::lock_guard lk(mu);
    const auto guard = device_guard(device, where());
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags", where());
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags",
               where());
    compute = static_cast<cudaStream_t>(kernels::detail::cuda_compute_stream(device));
  }

  // "group 'world' [0,1] (rank 0 of 2, cuda:0)"
  std::string where() const {
    return fmt::format("group '{}' [{}] (rank {} of {}, {})", name, fmt::join(ranks, ","), rank,
                       ranks.size(), device_name(device));
  }
  auto context(const Completion& c) const {
    return [this, &c] { return fmt::format("{} on {}", c.describe(), where()); };
  }

  void require_usable(std::string_view call) const {
    if (broken)
      throw CommError(
          fmt::format("{} on {}: the NCCL communicator is unusable after an earlier "
                      "failure: {}",
                      call, where(), broken_reason));
  }

  // Calls on another communicator while this thread has a batch open would join NCCL's group.
  void require_no_foreign_batch(std::string_view call) const {
    if (t_open_batch != nullptr && t_open_batch != this)
      throw InvalidArgument(fmt::format(
          "{} on {}: this thread has a batch open on another NCCL communicator (NCCL groups are "
          "per thread): call end_batch() on it first",
          call, where()));
    if (batch != nullptr && batch_thread != std::this_thread::get_id())
      throw InvalidArgument(fmt::format(
          "{} on {}: a batch is open on this communicator in another thread (NCCL groups are per "
          "thread: a batch is filled and ended by the thread that began it)",
          call, where()));
  }

  std::shared_ptr<Completion> make_completion(bool is_batch) {
    auto c = std::make_shared<Completion>();
    c->batch = is_batch;
    c->device = device;
    cuda_check(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "cudaEventCreateWithFlags", where());
    return c;
  }

  // The communicator's stream waits for everything queued so far on the compute stream (where
  // the kernels layer produced the inputs). REQUIRES: `device` current.
  void order_after_default_stream(const Completion& c) {
    cuda_check(cudaEventRecord(ready, compute), "cudaEventRecord(compute stream)", context(c));
    cuda_check(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent", context(c));
  }

  // After the NCCL call(s) of c returned `r` (ncclSuccess or ncclInProgress).
  void launched(const std::shared_ptr<Completion>& c, ncclResult_t r) {
    c->state = Completion::State::kEnqueueing;
    in_flight.push_back(c);
    if (r == ncclSuccess) {
      finish_enqueue(*c);
    } else {
      pending = c;
    }
  }

  // REQUIRES: c is kEnqueueing and NCCL reported ncclSuccess; `device` current.
  void finish_enqueue(Completion& c) {
    std::vector<ncclRedOp_t> ops = std::exchange(c.red_ops, {});
    for (ncclRedOp_t op : ops)
      nccl_check(ncclRedOpDestroy(op, comm), "ncclRedOpDestroy", context(c));
    cuda_check(cudaEventRecord(c.done, stream), "cudaEventRecord", context(c));
    c.state = Completion::State::kEnqueued;
    if (pending.get() == &c) pending.reset();
  }

  // Advances c without blocking; true once it is final. Failures abort the communicator and fail
  // c. REQUIRES: `device` current.
  bool step(Completion& c) {
    if (c.final()) return true;
    if (c.state == Completion::State::kOpen) return false;
    if (comm == nullptr) {
      fail(c, fmt::format("{} on {}: the NCCL communicator was aborted: {}", c.describe(), where(),
                          broken_reason));
      return true;
    }
    try {
      if (c.state == Completion::State::kEnqueueing) {
        const ncclResult_t async = async_error(c);
        if (async == ncclInProgress) return false;
        if (async != ncclSuccess) {
          fail(c, async_failure(c, async));
          return true;
        }
        finish_enqueue(c);
      }
      const cudaError_t e = cudaEventQuery(c.done);
      if (e == cudaSuccess) {
        c.state = Completion::State::kDone;
        c.keep_alive.clear();
        return true;
      }
      if (e != cudaErrorNotReady) cuda_check(e, "cudaEventQuery", context(c));
      (void)cudaGetLastError();  // cudaErrorNotReady is recorded as the last error: clear it
      const ncclResult_t async = async_error(c);
      if (async != ncclSuccess && async != ncclInProgress) {
        fail(c, async_failure(c, async));
        return true;
      }
      return false;
    } catch (const std::exception& e) {
      fail(c, e.what());
      return true;
    }
  }

  ncclResult_t async_error(const Completion& c) {
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError", context(c));
    return async;
  }

  std::string async_failure(const Completion& c, ncclResult_t async) const {
    return fmt::format(
        "{} on {} failed: NCCL reported an asynchronous error: {}; the NCCL "
        "communicator was aborted",
        c.describe(), where(), nccl_async_error_text(async));
  }

  std::string timeout_failure(const Completion& c, Milliseconds timeout) const {
    return fmt::format(
        "{} on {} timed out after {} ms{}: some ranks did not join it or did not finish it "
        "(NCCL cannot tell which: ranks that have not joined are unknown to NCCL); the NCCL "
        "communicator was aborted",
        c.describe(), where(), timeout.count(),
        c.state == Completion::State::kEnqueueing ? " while NCCL was still enqueueing it" : "");
  }

  // Finishes the enqueue of the previous call (NCCL allows no call before); when it fails or
  // does not finish by the deadline, fails it (the communicator is then broken: callers check
  // require_usable). REQUIRES: `device` current.
  void settle_pending(Clock::time_point deadline, Milliseconds timeout) {
    if (pending == nullptr) return;
    std::shared_ptr<Completion> c = pending;
    if (!poll_until(deadline,
                    [&] { return step(*c) || c->state != Completion::State::kEnqueueing; }))
      fail(*c, timeout_failure(*c, timeout));
  }

  // Drops the completions whose events have completed (in stream order). REQUIRES: device current.
  void reap() {
    while (!in_flight.empty()) {
      Completion& c = *in_flight.front();
      if (c.state == Completion::State::kEnqueued) {
        const cudaError_t e = cudaEventQuery(c.done);
        if (e != cudaSuccess) {
          (void)cudaGetLastError();  // not ready (or an error wait() will report)
          return;
        }
        c.state = Completion::State::kDone;
        c.keep_alive.clear();
      }
      if (!c.final()) return;
      in_flight.pop_front();
    }
  }

  // Fails c with `reason`, aborts the NCCL communicator (its kernels stop) and fails every other
  // pending completion. Never throws.
  void fail(Completion& c, const std::string& reason) noexcept {
    try {
      if (!c.final()) {
        c.state = Completion::State::kFailed;
        c.error = reason;
      }
      c.red_ops.clear();  // freed with the communicator
      if (!broken) {
        broken = true;
        broken_reason = reason;
      }
      abort_comm();
      auto abandon = [&](Completion& other) {
        if (other.final()) return;
        other.state = Completion::State::kFailed;
        other.error = fmt::format(
            "{} on {} abandoned: the NCCL communicator was aborted after "
            "a failure: {}",
            other.describe(), where(), broken_reason);
        other.red_ops.clear();
      };
      for (auto& other : in_flight) abandon(*other);
      if (batch != nullptr) abandon(*batch);
      in_flight.clear();
      pending.reset();
    } catch (...) {  // NOLINT: fmt/allocation failures; the state is already marked broken
    }
  }

  // Closes this thread's NCCL group of an open batch (NCCL requires balanced groups), then
  // aborts. A batch open on another thread cannot be closed from here: the abort then waits for
  // end_batch() on that thread (aborting first would leave a freed communicator in its group).
  void abort_comm() noexcept {
    if (comm == nullptr) return;
    if (group_open) {
      if (batch_thread != std::this_thread::get_id()) return;
      (void)ncclGroupEnd();
      group_open = false;
      if (t_open_batch == this) t_open_batch = nullptr;
    }
    QuietDeviceGuard guard(device);
    (void)ncclCommAbort(comm);
    comm = nullptr;
  }

  std::mutex mu;
  ncclComm_t comm = nullptr;  // null once aborted or destroyed
  const int device;
  const int rank;
  const std::vector<int> ranks;  // global ranks, in group order
  const std::string name;
  Milliseconds teardown_timeout;
  cudaStream_t stream = nullptr;
  cudaStream_t compute = nullptr;  // the kernels layer's stream on `device` (not owned)
  cudaEvent_t ready = nullptr;
  bool broken = false;
  std::string broken_reason;
  uint64_t next_call = 0;
  std::deque<std::shared_ptr<Completion>> in_flight;  // issued, not known complete, in order
  std::shared_ptr<Completion> pending;                // the one still kEnqueueing, if any
  std::shared_ptr<Completion> batch;                  // the open batch, if any
  bool group_open = false;                            // begin_batch's ncclGroupStart unmatched
  std::thread::id batch_thread;
  Tensor barrier_buffer;  // one int32 on the device, all-reduced by barrier()

 private:
  // NOTE [nccl teardown]. Never throws.
  void teardown() noexcept {
    std::lock_guard lk(mu);
    QuietDeviceGuard guard(device);
    try {
      if (comm != nullptr) {
        // An unfinished batch (its calls never reached NCCL) or no stream: abort.
        bool clean = batch == nullptr && stream != nullptr;
        if (clean) {
          const Clock::time_point deadline = deadline_after(teardown_timeout);
          if (pending != nullptr) settle_pending(deadline, teardown_timeout);
          clean = comm != nullptr && poll_until(deadline, [&] {
                    if (comm == nullptr) return true;
                    const cudaError_t e = cudaStreamQuery(stream);
                    if (e == cudaSuccess) return true;
                    (void)cudaGetLastError();
                    if (e != cudaErrorNotReady) return true;  // sticky error: checked below
                    ncclResult_t async = ncclSuccess;
                    return ncclCommGetAsyncError(comm, &async) != ncclSuccess ||
                           (async != ncclSuccess && async != ncclInProgress);
                  });
          if (clean && comm != nullptr) {
            ncclResult_t async = ncclInProgress;
            clean = cudaStreamQuery(stream) == cudaSuccess &&
                    ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess;
            (void)cudaGetLastError();
          }
        }
        if (comm != nullptr) {
          if (clean) {
            (void)ncclCommDestroy(comm);
            comm = nullptr;
          } else {
            abort_comm();
            if (comm != nullptr) {  // a batch open on another thread: abort regardless
              (void)ncclCommAbort(comm);
              comm = nullptr;
            }
          }
        }
      }
    } catch (...) {  // NOLINT: destructors never throw
      if (comm != nullptr) (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    if (t_open_batch == this) t_open_batch = nullptr;
    // Buffers go only after NCCL is done with them (destroyed, or aborted: its kernels stopped).
    in_flight.clear();
    pending.reset();
    batch.reset();
    barrier_buffer = Tensor();
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);  // released once its work is done
    (void)cudaGetLastError();
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<CommState> state, std::shared_ptr<Completion> completion)
      : state_(std::move(state)), completion_(std::move(completion)) {}

  void wait(Milliseconds timeout) override {
    CommState& s = *state_;
    Completion& c = *completion_;
    std::unique_lock lk(s.mu);
    if (!advance(lk, deadline_after(timeout))) s.fail(c, s.timeout_failure(c, timeout));
    if (c.state == Completion::State::kFailed) {
      if (c.exception) std::rethrow_exception(c.exception);
      throw CommError(c.error);
    }
  }

  // Device-side when `stream` is on this communicator's GPU and the call's event is recorded
  // (a failed call has none: wait() then throws); otherwise the host waits.
  void wait_on(const kernels::Stream& stream, Milliseconds timeout) override {
    if (stream.device().is_cuda() && same_device(stream.device().index)) {
      (void)completed();  // finishes its enqueue when NCCL reported it in progress
      if (cudaEvent_t ev = recorded_event()) {
        CommState& s = *state_;
        std::lock_guard lk(s.mu);
        const auto guard = device_guard(s.device, s.where());
        cudaStream_t st = reinterpret_cast<cudaStream_t>(stream.id());  // a CUDA stream's id is its handle
        cuda_check(cudaStreamWaitEvent(st, ev, 0), "cudaStreamWaitEvent", s.where());
        return;
      }
    }
    wait(timeout);
  }

  bool settle(Milliseconds timeout) override {
    std::unique_lock lk(state_->mu);
    return advance(lk, deadline_after(timeout));
  }

  bool completed() override {
    CommState& s = *state_;
    Completion& c = *completion_;
    std::lock_guard lk(s.mu);
    if (c.final()) return true;
    if (c.state == Completion::State::kOpen) return false;
    try {
      const auto guard = device_guard(s.device, s.context(c));
      return s.step(c);
    } catch (const std::exception& e) {
      s.fail(c, e.what());
      return true;
    }
  }

  std::string describe() const override {
    std::lock_guard lk(state_->mu);
    return fmt::format("{} on {}", completion_->describe(), state_->where());
  }

  // As a timed-out wait(): NCCL cannot cancel one call, so the communicator is aborted.
  void give_up(const std::string& why) override {
    std::lock_guard lk(state_->mu);
    if (!completion_->final() && completion_->state != Completion::State::kOpen) state_->fail(*completion_, why);
  }

  // The completion's event, once recorded on a stream (for wait_for); null otherwise.
  cudaEvent_t recorded_event() const {
    std::lock_guard lk(state_->mu);
    const Completion& c = *completion_;
    return c.state == Completion::State::kEnqueued || c.state == Completion::State::kDone ? c.done : nullptr;
  }
  bool same_device(int device) const { return state_->device == device; }

 private:
  // Polls until the completion is final or the deadline; true when final. REQUIRES: lk holds mu.
  bool advance(std::unique_lock<std::mutex>&, Clock::time_point deadline) {
    CommState& s = *state_;
    Completion& c = *completion_;
    if (c.state == Completion::State::kOpen)
      throw InvalidArgument(
          fmt::format("wait on {} on {}: the batch is still open (call "
                      "end_batch() first)",
                      c.describe(), s.where()));
    if (c.final()) return true;
    try {
      const auto guard = device_guard(s.device, s.context(c));
      return poll_until(deadline, [&] { return s.step(c); });
    } catch (const std::exception& e) {  // the device guard failed
      s.fail(c, e.what());
      return true;
    }
  }

  std::shared_ptr<CommState> state_;
  std::shared_ptr<Completion> completion_;
};

// Runs issue() between ncclGroupStart and ncclGroupEnd; the group is closed even when issue()
// throws. Returns ncclGroupEnd's result (ncclInProgress on a non-blocking communicator).
template <class Context, class Issue>
ncclResult_t grouped(const Context& context, Issue&& issue) {
  nccl_check(ncclGroupStart(), "ncclGroupStart", context);
  try {
    issue();
  } catch (...) {
    (void)ncclGroupEnd();
    throw;
  }
  return nccl_check(ncclGroupEnd(), "ncclGroupEnd", context, InProgress::kAccept);
}

}  // namespace collectives::detail
