// The nccl backend (collectives/nccl.h): NcclCommunicator, its Works and the factories.
// Compiled only when CUDA and NCCL are found; nccl_absent.cpp stands in otherwise. Plain C++
// (g++ with the CUDA include folder): no kernels are launched here.
//
// NOTE [nccl call life] Every call goes through NcclCommunicator::issue(), under CommState::mu:
//  1. arguments are checked (InvalidArgument, nothing touched yet); an input that overlaps the
//     output in a way NCCL cannot do in place is first copied (on the legacy default stream);
//  2. the previous call's enqueue is finished (a non-blocking communicator may still be setting
//     it up: NCCL forbids the next call until ncclCommGetAsyncError says ncclSuccess);
//  3. the communicator's stream waits for the legacy default stream (NOTE [nccl streams]);
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
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/nccl.h"
#include "collectives/nccl/nccl_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/dtype.h"
#include "kernels/error.h"

namespace collectives {

using kernels::CommError;
using kernels::Device;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

bool nccl_built() { return true; }

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string device_name(int device) { return kernels::to_string(Device::cuda(device)); }

// now + timeout, saturating (a huge timeout means "no deadline"); a negative timeout is 0.
Clock::time_point deadline_after(Milliseconds timeout) {
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

// Makes `device` current for the scope and restores the previous one.
class DeviceGuard {
 public:
  template <class Context>
  DeviceGuard(int device, const Context& context) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice", context);
    if (previous_ != device) {
      cuda_check(cudaSetDevice(device), "cudaSetDevice", context);
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

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

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // NOTE [nccl timeouts]: no NCCL call may block the host
  return config;
}

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
    case DType::kF8E4M3:
    case DType::kF8E5M2: break;  // storage-only: rejected by check_tensor before we get here
  }
  throw kernels::InternalError(
      fmt::format("nccl backend: dtype {} reached nccl_dtype", kernels::to_string(dtype)));
}

ncclRedOp_t builtin_op(ReduceOp op) {
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

float to_float(double m) {
  if (std::isnan(m)) return std::numeric_limits<float>::quiet_NaN();
  if (m > std::numeric_limits<float>::max()) return std::numeric_limits<float>::infinity();
  if (m < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(m);
}

// nullopt for a plain reduction. Throws Unsupported when an integer dtype cannot hold the
// multiplier exactly (NCCL would multiply by a truncated integer).
std::optional<PremulScalar> premul_scalar(CollectiveKind kind, const std::string& group,
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
    case DType::kF8E5M2: (void)nccl_dtype(dtype); break;  // throws
  }
  return s;
}

char* bytes_of(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }
std::uintptr_t address_of(const Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr());
}


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
  bool host_task = false;            // a host_task(): `done` is recorded on the legacy stream
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
thread_local const CommState* t_open_batch = nullptr;

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
    DeviceGuard guard(device, where());
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags", where());
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags",
               where());
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

  // The communicator's stream waits for everything queued so far on the legacy default stream.
  // REQUIRES: `device` current.
  void order_after_default_stream(const Completion& c) {
    cuda_check(cudaEventRecord(ready, cudaStreamLegacy), "cudaEventRecord(legacy default stream)",
               context(c));
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
      DeviceGuard guard(s.device, s.context(c));
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
      DeviceGuard guard(s.device, s.context(c));
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

  WorkPtr all_gather(const Tensor& input, const Tensor& output) override {
    constexpr auto kind = CollectiveKind::kAllGather;
    check_buffers(kind, *this, input, output);
    check_device(kind, input, "input");
    check_device(kind, output, "output");
    const size_t count = static_cast<size_t>(input.numel());
    const ncclDataType_t dtype = nccl_dtype(input.dtype());
    // In place when input is this rank's slice of output; any other overlap is staged.
    const bool in_place =
        count > 0 && address_of(input) == address_of(output) + rank() * input.nbytes();
    const Tensor send = !in_place && overlaps(input, output) ? input.clone() : input;
    const void* send_ptr = send.data_ptr();
    void* recv_ptr = output.data_ptr();
    return issue(kind, {send, output}, [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      return nccl_check(ncclAllGather(send_ptr, recv_ptr, count, dtype, comm(), stream()),
                        "ncclAllGather", state_->context(c), InProgress::kAccept);
    });
  }

  WorkPtr reduce_scatter(const Tensor& input, const Tensor& output, Reduction r) override {
    constexpr auto kind = CollectiveKind::kReduceScatter;
    check_buffers(kind, *this, input, output);
    check_reduction(kind, input, r);
    check_device(kind, input, "input");
    check_device(kind, output, "output");
    const size_t count = static_cast<size_t>(output.numel());
    const ncclDataType_t dtype = nccl_dtype(output.dtype());
    const std::optional<PremulScalar> premul = premul_scalar(kind, name(), output.dtype(), r);
    // In place when output is this rank's slice of input; any other overlap is staged.
    const bool in_place =
        count > 0 && address_of(output) == address_of(input) + rank() * output.nbytes();
    const Tensor send = !in_place && overlaps(input, output) ? input.clone() : input;
    const void* send_ptr = send.data_ptr();
    void* recv_ptr = output.data_ptr();
    return issue(kind, {send, output}, [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      const ncclRedOp_t op = reduction_op(c, r, premul, dtype);
      return nccl_check(ncclReduceScatter(send_ptr, recv_ptr, count, dtype, op, comm(), stream()),
                        "ncclReduceScatter", state_->context(c), InProgress::kAccept);
    });
  }

  WorkPtr all_reduce(const Tensor& input, const Tensor& output, Reduction r) override {
    constexpr auto kind = CollectiveKind::kAllReduce;
    check_buffers(kind, *this, input, output);
    check_reduction(kind, input, r);
    check_device(kind, input, "input");
    check_device(kind, output, "output");
    return all_reduce_checked(kind, input, output, r);
  }

  WorkPtr all_to_all(const Tensor& input, const Tensor& output) override {
    constexpr auto kind = CollectiveKind::kAllToAll;
    check_buffers(kind, *this, input, output);
    check_device(kind, input, "input");
    check_device(kind, output, "output");
    const int64_t per_peer = input.numel() / size();
    std::vector<int64_t> counts(size(), per_peer);
    return exchange(kind, input, counts, output, counts);
  }

  WorkPtr all_to_all_v(const Tensor& input, std::span<const int64_t> send_counts,
                       const Tensor& output, std::span<const int64_t> recv_counts) override {
    constexpr auto kind = CollectiveKind::kAllToAllV;
    check_buffers(kind, *this, input, output);
    check_device(kind, input, "input");
    check_device(kind, output, "output");
    check_counts(*this, send_counts, input, "send");
    check_counts(*this, recv_counts, output, "receive");
    return exchange(kind, input, std::vector<int64_t>(send_counts.begin(), send_counts.end()),
                    output, std::vector<int64_t>(recv_counts.begin(), recv_counts.end()));
  }

  WorkPtr broadcast(const Tensor& buffer, int root) override {
    constexpr auto kind = CollectiveKind::kBroadcast;
    check_tensor(kind, *this, buffer, "buffer");
    check_device(kind, buffer, "buffer");
    check_root(kind, root);
    const size_t count = static_cast<size_t>(buffer.numel());
    const ncclDataType_t dtype = nccl_dtype(buffer.dtype());
    void* ptr = buffer.data_ptr();
    return issue(kind, {buffer}, [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      return nccl_check(ncclBroadcast(ptr, ptr, count, dtype, root, comm(), stream()),
                        "ncclBroadcast", state_->context(c), InProgress::kAccept);
    });
  }

  WorkPtr scatter(const Tensor& input, const Tensor& output, int root) override {
    constexpr auto kind = CollectiveKind::kScatter;
    check_tensor(kind, *this, output, "output");
    check_device(kind, output, "output");
    check_root(kind, root);
    const bool is_root = rank() == root;
    const size_t count = static_cast<size_t>(output.numel());
    const ncclDataType_t dtype = nccl_dtype(output.dtype());
    Tensor send;
    bool in_place = false;
    if (is_root) {
      check_buffers(kind, *this, input, output);
      check_device(kind, input, "input");
      if (input.numel() != static_cast<int64_t>(size()) * output.numel())
        throw InvalidArgument(fmt::format(
            "scatter on group '{}' of {} ranks: root {} has {} input elements for {} output "
            "elements (expected input = size x output)",
            name(), size(), root, input.numel(), output.numel()));
      in_place = count > 0 && address_of(output) == address_of(input) + rank() * output.nbytes();
      send = !in_place && overlaps(input, output) ? input.clone() : input;
    }
    std::vector<Tensor> keep{output};
    if (send.defined()) keep.push_back(send);
    void* recv_ptr = output.data_ptr();
    char* send_base = send.defined() ? bytes_of(send) : nullptr;
    return issue(kind, std::move(keep), [&](Completion& c) {
      if (count == 0) return ncclSuccess;
      const auto context = state_->context(c);
      const size_t slice = output.nbytes();
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

  WorkPtr barrier() override {
    constexpr auto kind = CollectiveKind::kBarrier;
    Tensor buffer;
    {
      std::lock_guard lk(state_->mu);
      buffer = state_->barrier_buffer;
    }
    return all_reduce_checked(kind, buffer, buffer, Reduction(ReduceOp::kSum));
  }

  WorkPtr send_recv(std::span<const P2POp> ops) override {
    constexpr auto kind = CollectiveKind::kSendRecv;
    std::vector<Tensor> keep;
    for (const P2POp& op : ops) {
      const bool is_send = op.kind == P2POp::Kind::kSend;
      check_tensor(kind, *this, op.buffer, is_send ? "send" : "receive");
      check_device(kind, op.buffer, is_send ? "send" : "receive");
      if (op.peer < 0 || op.peer >= size())
        throw InvalidArgument(fmt::format("send_recv on group '{}': peer {} out of range 0..{}",
                                          name(), op.peer, size() - 1));
      keep.push_back(op.buffer);
    }
    // A receive buffer may not overlap any other buffer of the batch: NCCL runs them concurrently.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind != P2POp::Kind::kRecv) continue;
      for (size_t j = 0; j < ops.size(); ++j)
        if (j != i && overlaps(ops[i].buffer, ops[j].buffer))
          throw InvalidArgument(fmt::format(
              "send_recv on group '{}': the receive buffer of op {} (from peer {}) overlaps the "
              "buffer of op {} ({} peer {}); NCCL runs them concurrently",
              name(), i, ops[i].peer, j,
              ops[j].kind == P2POp::Kind::kSend ? "send to" : "receive from", ops[j].peer));
    }
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
    return issue(kind, std::move(keep), [&](Completion& c) {
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
          DeviceGuard guard(s.device, s.where());
          cuda_check(cudaStreamWaitEvent(s.stream, ev, 0), "cudaStreamWaitEvent", s.where());
          return;
        }
      }
    }
    if (!work->settle(timeout()))
      throw CommError(fmt::format("wait_for on {}: {} did not finish within {} ms", state_->where(),
                                  work->describe(), timeout().count()));
  }

  // Runs fn now on this thread, after making the legacy default stream (where the kernels layer
  // runs its copies) wait for everything queued on this communicator's stream; the Work
  // completes when what fn queued on the default stream has run.
  WorkPtr host_task(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument(fmt::format("host_task on group '{}': the function is empty", name()));
    CommState& s = *state_;
    std::shared_ptr<Completion> c;
    {
      std::lock_guard lk(s.mu);
      if (s.batch != nullptr)
        throw InvalidArgument(fmt::format("host_task on group '{}': not allowed inside a batch", name()));
      s.require_usable("host_task");
      DeviceGuard guard(s.device, s.where());
      s.settle_pending(deadline_after(timeout()), timeout());
      s.require_usable("host_task");
      s.reap();
      c = s.make_completion(/*is_batch=*/false);
      c->host_task = true;
      c->calls.emplace_back(s.next_call++, CollectiveKind::kBarrier);
      cuda_check(cudaEventRecord(s.ready, s.stream), "cudaEventRecord", s.context(*c));
      cuda_check(cudaStreamWaitEvent(cudaStreamLegacy, s.ready, 0), "cudaStreamWaitEvent(legacy default stream)",
                 s.context(*c));
    }
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lk(s.mu);
    DeviceGuard guard(s.device, s.where());
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
    cuda_check(cudaEventRecord(c->done, cudaStreamLegacy), "cudaEventRecord(legacy default stream)", s.context(*c));
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
    DeviceGuard guard(s.device, s.where());
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
      DeviceGuard guard(s.device, s.context(*c));
      s.order_after_default_stream(*c);
    } catch (...) {
      (void)ncclGroupEnd();  // keep NCCL's groups balanced on this thread
      s.fail(*c, fmt::format("{} on {}: could not order it after the default stream", c->describe(),
                             s.where()));
      throw CommError(c->error);
    }
    try {
      DeviceGuard guard(s.device, s.context(*c));
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

  void check_device(CollectiveKind kind, const Tensor& t, const char* role) const {
    if (t.device() != Device::cuda(state_->device))
      throw InvalidArgument(
          fmt::format("{} on group '{}': {} tensor is on {} but this NCCL communicator uses {}",
                      to_string(kind), name(), role, kernels::to_string(t.device()),
                      device_name(state_->device)));
  }

  void check_root(CollectiveKind kind, int root) const {
    if (root < 0 || root >= size())
      throw InvalidArgument(fmt::format("{} on group '{}': root {} out of range 0..{}",
                                        to_string(kind), name(), root, size() - 1));
  }

  // REQUIRES: input and output checked (or the barrier buffer).
  WorkPtr all_reduce_checked(CollectiveKind kind, const Tensor& input, const Tensor& output,
                             const Reduction& r) {
    const size_t count = static_cast<size_t>(output.numel());
    const ncclDataType_t dtype = nccl_dtype(output.dtype());
    const std::optional<PremulScalar> premul = premul_scalar(kind, name(), output.dtype(), r);
    // In place when both are the same buffer; any other overlap is staged.
    const bool in_place = address_of(input) == address_of(output);
    const Tensor send = !in_place && overlaps(input, output) ? input.clone() : input;
    const void* send_ptr = send.data_ptr();
    void* recv_ptr = output.data_ptr();
    return issue(kind, {send, output}, [&](Completion& c) {
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
    const Tensor send = overlaps(input, output) ? input.clone() : input;
    char* send_base = bytes_of(send);
    char* recv_base = bytes_of(output);
    return issue(kind, {send, output}, [&](Completion& c) {
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
  WorkPtr issue(CollectiveKind kind, std::vector<Tensor> keep_alive, Enqueue&& enqueue) {
    CommState& s = *state_;
    std::lock_guard lk(s.mu);
    s.require_no_foreign_batch(to_string(kind));
    s.require_usable(to_string(kind));
    DeviceGuard guard(s.device, s.where());
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
    DeviceGuard guard(s.device, s.where());
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
  return make_communicator(child, s.device, key, std::move(global), std::move(new_name), timeout());
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
    DeviceGuard guard(device, where);
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
