// Internal to the mpi backend (collectives/mpi.cpp, collectives/mpi/world.cpp): the world's
// state and progress board (NOTE [mpi progress board] in collectives/mpi.h), a communicator's
// shared state, call descriptions and the polling of a call's MPI requests. Not installed; the
// only header that includes <mpi.h>.
#pragma once

#define OMPI_SKIP_MPICXX 1  // C bindings only: OpenMPI's C++ bindings are deprecated and noisy
#define MPICH_SKIP_MPICXX 1
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "collectives/call_queue.h"
#include "collectives/communicator.h"
#include "collectives/mpi.h"
#include "collectives/mpi/attribution.h"
#include "kernels/error.h"

namespace collectives::detail {

using kernels::CommError;
using kernels::DType;
using Clock = std::chrono::steady_clock;

// ---- small helpers ----

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

inline void mpi_check(int rc, const char* fn) {
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", fn, mpi_error_string(rc)));
}

// Runs one MPI_I* call; the request is kept only when the call succeeded (a failed call may
// leave garbage in it, and every kept request is tested later).
template <class F>
void post_request(std::vector<MPI_Request>& reqs, const char* fn, F&& call) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(call(&r), fn);
  reqs.push_back(r);
}

inline MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    // bf16 and f16 move as opaque 16-bit words; their reductions are user-defined ops.
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8:
    // fp8 moves as opaque bytes; reducing collectives refuse it (detail::validate).
    case DType::kF8E4M3:
    case DType::kF8E5M2: return MPI_UINT8_T;
  }
  throw kernels::InternalError(
      fmt::format("mpi backend: no MPI datatype for {}", kernels::to_string(dtype)));
}

// Paces a polling loop. Nonblocking collectives advance only inside MPI calls, so each member
// must keep polling for the others to progress: for the first 2 ms of a wait it polls after
// sched_yield (which hands the core to a runnable rank when 4 ranks share 2 cores), then it
// sleeps between polls, 20 us doubling up to 1 ms, so a long wait for a slow member costs
// little CPU.
class Pacer {
 public:
  void pause() {
    if (Clock::now() - start_ < std::chrono::milliseconds(2)) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  Clock::time_point start_ = Clock::now();
  std::chrono::microseconds sleep_{20};
};

// ---- call descriptions (for errors, the progress board and check_calls) ----

constexpr int kSplitCall = 100;   // Communicator::split
constexpr int kCreateCall = 101;  // MpiWorld::communicator
constexpr int kCloseCall = 102;   // ~MpiWorld's closing barrier

struct CallDesc {
  int kind = 0;  // a CollectiveKind value or one of the k*Call values above
  int dtype = -1;
  int op = -1;
  int root = -1;
  int64_t in_count = 0;  // elements (send_recv: ops; split: size of the new group)
  int64_t out_count = 0;
  double premul = 1.0;

  static constexpr int kWords = 5;
  std::array<int64_t, kWords> pack() const {
    return {kind | (dtype + 1) << 8 | (op + 1) << 16, root, in_count, out_count,
            std::bit_cast<int64_t>(premul)};
  }
  static CallDesc unpack(const int64_t* w) {
    CallDesc d;
    d.kind = static_cast<int>(w[0] & 0xff);
    d.dtype = static_cast<int>((w[0] >> 8) & 0xff) - 1;
    d.op = static_cast<int>((w[0] >> 16) & 0xff) - 1;
    d.root = static_cast<int>(w[1]);
    d.in_count = w[2];
    d.out_count = w[3];
    d.premul = std::bit_cast<double>(w[4]);
    return d;
  }
  bool operator==(const CallDesc&) const = default;

  bool is(CollectiveKind k) const { return kind == static_cast<int>(k); }
  std::string name() const {
    switch (kind) {
      case kSplitCall: return "split";
      case kCreateCall: return "communicator";
      case kCloseCall: return "MpiWorld shutdown barrier";
      default: return std::string(to_string(static_cast<CollectiveKind>(kind)));
    }
  }
  // Same wording as the local backend: "all_gather(f32, 4 -> 16 elements)".
  std::string describe() const {
    std::string what = name() + "(";
    if (kind == kSplitCall) {
      what += fmt::format("group of {}", in_count);
    } else if (is(CollectiveKind::kSendRecv)) {
      what += fmt::format("{} ops", in_count);
    } else if (kind < kSplitCall && !is(CollectiveKind::kBarrier) && dtype >= 0) {
      what += fmt::format("{}, {} -> {} elements", kernels::to_string(static_cast<DType>(dtype)),
                          in_count, out_count);
    }
    if (is(CollectiveKind::kBroadcast) || is(CollectiveKind::kScatter))
      what += fmt::format(", root {}", root);
    if ((is(CollectiveKind::kReduceScatter) || is(CollectiveKind::kAllReduce)) && op >= 0) {
      what += fmt::format(", {}", kernels::to_string(static_cast<kernels::ReduceOp>(op)));
      if (premul != 1.0) what += fmt::format(" x {}", premul);
    }
    return what + ")";
  }
};

// ---- progress board layout: kSlotWords int64 per communicator per rank ----
constexpr int kSlotWords = 8;
constexpr int kDescWord = 0;       // CallDesc of the latest call entered (CallDesc::kWords words)
constexpr int kEnteredWord = 5;    // calls entered on this communicator (call #k entered -> k+1)
constexpr int kCompletedWord = 6;  // highest call number completed here, plus one
constexpr int kGaveUpWord = 7;     // highest call number given up after a timeout here, plus one
static_assert(kDescWord + CallDesc::kWords == kEnteredWord);
using BoardEntry = std::array<int64_t, kSlotWords>;


class CommState;

// Buffers MPI may still read or write while requests are pending.
struct Keep {
  std::vector<Tensor> tensors;
  std::vector<std::shared_ptr<void>> blobs;
};

// One issued call's requests and buffers; moved to the world's graveyard when its Work is
// dropped before MPI is done with them.
struct Pending {
  std::shared_ptr<CommState> comm;
  std::vector<MPI_Request> requests;
  Keep keep;
};

class MpiWorldState {
 public:
  MpiWorldState(int* argc, char*** argv, Milliseconds timeout);
  ~MpiWorldState() = default;

  void shutdown() noexcept;
  bool closed() const { return closed_; }

  // Writes words of this rank's board entry for `slot` (op MPI_REPLACE or MPI_MAX).
  void board_put(int slot, int word, const int64_t* values, int count, MPI_Op op = MPI_REPLACE);
  // Records entering call `seq` (its description and the entered count, in one write).
  void board_enter(int slot, uint64_t seq, const CallDesc& d) {
    std::array<int64_t, CallDesc::kWords + 1> words{};
    const std::array<int64_t, CallDesc::kWords> desc = d.pack();
    std::copy(desc.begin(), desc.end(), words.begin());
    words[kEnteredWord - kDescWord] = static_cast<int64_t>(seq) + 1;
    board_put(slot, kDescWord, words.data(), static_cast<int>(words.size()));
  }
  // Reads the entries for `slot` of the given world ranks; nullopt where no answer came within
  // `grace` (see NOTE [mpi progress board]).
  std::vector<std::optional<BoardEntry>> board_read(int slot, const std::vector<int>& world_ranks,
                                                    Milliseconds grace);
  bool board_ok() const { return board_error_.empty(); }
  const std::string& board_error() const { return board_error_; }

  // Keeps a pending call's buffers alive until MPI is done with them (or finalised).
  void bury(std::shared_ptr<Pending> p) {
    std::lock_guard lk(mu_);
    graveyard_.push_back(std::move(p));
  }

  MPI_Op op_for(DType dtype, kernels::ReduceOp op) const;

  int rank = 0, size = 1;
  bool thread_multiple = false;   // workers may call MPI (NOTE [call queue] in collectives/call_queue.h)
  const std::shared_ptr<WorkerTicker> ticker = std::make_shared<WorkerTicker>();
  MPI_Comm comm = MPI_COMM_NULL;  // private duplicate of MPI_COMM_WORLD
  int tag_ub = 32767;
  std::shared_ptr<CommState> mgmt;  // slot 0: communicator() and the closing barrier

  // Board slots of new communicators: each member proposes its lowest free slot, the group
  // takes the largest proposal, and every member marks the slots up to it used. REQUIRES:
  // communicators are created by one thread at a time.
  int64_t slot_proposal() {
    std::lock_guard lk(mu_);
    return next_slot_;
  }
  void take_slot(int64_t slot) {
    std::lock_guard lk(mu_);
    next_slot_ = std::max(next_slot_, slot + 1);
  }

 private:
  std::mutex mu_;
  int64_t next_slot_ = 1;  // guarded by mu_
  bool owns_mpi_ = false;
  bool closed_ = false;
  Milliseconds timeout_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::string board_error_;
  // User-defined ops by [dtype][ReduceOp]; MPI_OP_NULL where a built-in op serves.
  std::array<std::array<MPI_Op, 5>, 9> user_ops_{};
  std::vector<std::shared_ptr<Pending>> graveyard_;  // guarded by mu_
};

// What a communicator's Works share: the MPI communicator, the group, the call counter and the
// poison flag. Lives as long as any Work or Communicator of the group.
class CommState {
 public:
  CommState(std::shared_ptr<MpiWorldState> world_, MPI_Comm comm_, int rank_,
            std::vector<int> ranks_, std::string name_, int slot_, bool owns_comm_)
      : world(std::move(world_)),
        comm(comm_),
        rank(rank_),
        ranks(std::move(ranks_)),
        name(std::move(name_)),
        slot(slot_),
        owns_comm(owns_comm_) {}
  ~CommState() {
    // MPI_Comm_free after a failure could block or disturb members that are out of step; the
    // handle is leaked then (and after MPI_Finalize there is nothing left to free).
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!owns_comm || finalized || !poisoned()) return;
    if (check_comm != MPI_COMM_NULL) MPI_Comm_free(&check_comm);
    MPI_Comm_free(&comm);
  }
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  std::string group() const { return fmt::format("group '{}' [{}]", name, fmt::join(ranks, ",")); }
  // Why calls on this communicator cannot proceed, or empty.
  std::string unusable(const CallDesc& d) const {
    if (world->closed())
      return fmt::format("{} on group '{}': the MpiWorld was destroyed", d.name(), name);
    if (const std::string why = poison(); !why.empty())
      return fmt::format(
          "{} on group '{}': the communicator is unusable after an earlier failure "
          "({})",
          d.name(), name, why);
    return {};
  }
  // Where call `seq` stands, for a timeout: "ranks [3] never joined" (NOTE [mpi progress board]).
  std::string pending_text(uint64_t seq, const CallDesc& mine, Milliseconds grace);
  // Records giving call `seq` up after a timeout (one board write, only then), so that members
  // still waiting in it name this rank as one that gave it up.
  void mark_gave_up(uint64_t seq) {
    const int64_t number = static_cast<int64_t>(seq) + 1;
    world->board_put(slot, kGaveUpWord, &number, 1, MPI_MAX);
  }
  // The CommError text for call `seq` that did not complete within `timeout`.
  std::string timeout_message(uint64_t seq, const CallDesc& mine, Milliseconds timeout) {
    return fmt::format("{} on {} (call #{}) timed out after {} ms: {}", mine.name(), group(), seq, timeout.count(),
                       pending_text(seq, mine, std::min(timeout, Milliseconds{2000})));
  }
  // The first failure wins; once poisoned every later call throws (see the header comment).
  void set_poison(const std::string& why) {
    std::lock_guard lk(poison_mu_);
    if (poison_.empty()) poison_ = why;
  }
  std::string poison() const {
    std::lock_guard lk(poison_mu_);
    return poison_;
  }
  bool poisoned() const { return !poison().empty(); }

  std::shared_ptr<MpiWorldState> world;
  MPI_Comm comm;
  MPI_Comm check_comm = MPI_COMM_NULL;  // check_calls: descriptions travel here
  const int rank;
  const std::vector<int> ranks;  // world ranks in group order
  const std::string name;
  const int slot;  // progress board slot
  const bool owns_comm;
  uint64_t next_seq = 0;  // touched by one thread at a time (the queue's holder)
  // Progress from a thread other than a waiter's (the communicator's worker) needs
  // MPI_THREAD_MULTIPLE; with a lower level calls progress only in wait() and completed().
  bool worker = true;

 private:
  mutable std::mutex poison_mu_;
  std::string poison_;  // the first failure; non-empty once poisoned
};


// One issued call's MPI requests, polled until complete (for the calls of the queue, and for
// the internal exchanges that wait at once).
class MpiRequests final {
 public:
  using Finish = std::function<void(std::span<MPI_Status>)>;

  MpiRequests(std::shared_ptr<CommState> comm, uint64_t seq, CallDesc desc,
              Milliseconds default_timeout, bool marks_completion = true)
      : p_(std::make_shared<Pending>()),
        seq_(seq),
        desc_(desc),
        default_timeout_(default_timeout),
        marks_completion_(marks_completion) {
    p_->comm = std::move(comm);
  }
  ~MpiRequests() {
    // Complete this rank's part if nobody waited (MPI may not touch freed buffers), unless the
    // rank is unwinding or the group already failed; then keep the buffers for MPI.
    CommState& c = *p_->comm;
    if (state_ == State::kPending && std::uncaught_exceptions() == 0 && c.unusable(desc_).empty()) {
      try {
        wait(default_timeout_);
      } catch (...) {  // NOLINT: destructors never throw
      }
    }
    const bool active = std::any_of(p_->requests.begin(), p_->requests.end(),
                                    [](MPI_Request r) { return r != MPI_REQUEST_NULL; });
    if (state_ != State::kDone && active && !c.world->closed()) c.world->bury(p_);
  }

  std::vector<MPI_Request>& requests() { return p_->requests; }
  Keep& keep() { return p_->keep; }
  void set_finish(Finish f) { finish_ = std::move(f); }
  uint64_t seq() const { return seq_; }

  void wait(Milliseconds timeout) {
    if (poll()) return;
    const auto deadline = Clock::now() + timeout;
    for (Pacer pacer;;) {
      pacer.pause();
      if (poll()) return;
      if (Clock::now() >= deadline) timed_out(timeout);
    }
  }


  // One MPI_Testall; true when done; throws CommError when the call failed.
  bool poll() {
    if (state_ == State::kDone) return true;
    if (state_ == State::kFailed) throw CommError(error_);
    CommState& c = *p_->comm;
    if (c.world->closed()) fail(c.unusable(desc_), false);
    std::vector<MPI_Status> statuses(p_->requests.size());
    int flag = 1;
    if (!p_->requests.empty()) {
      const int rc = MPI_Testall(static_cast<int>(p_->requests.size()), p_->requests.data(), &flag,
                                 statuses.data());
      if (rc != MPI_SUCCESS) {
        std::string why = mpi_error_string(rc);
        if (rc == MPI_ERR_IN_STATUS)
          for (const MPI_Status& s : statuses)
            if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) {
              why = mpi_error_string(s.MPI_ERROR);
              break;
            }
        fail(fmt::format("{} on {} (call #{}) failed in MPI: {}", desc_.describe(), c.group(), seq_,
                         why),
             true);
      }
    }
    if (!flag) {
      // Another call on this group timed out or failed: this one cannot be trusted to finish.
      if (c.poisoned()) fail(c.unusable(desc_), false);
      return false;
    }
    if (finish_) {
      try {
        finish_(statuses);
      } catch (const std::exception& e) {
        fail(e.what(), false);
      }
    }
    if (marks_completion_) {
      const int64_t done = static_cast<int64_t>(seq_) + 1;
      c.world->board_put(c.slot, kCompletedWord, &done, 1, MPI_MAX);
    }
    state_ = State::kDone;
    p_->keep = {};
    return true;
  }

  [[noreturn]] void timed_out(Milliseconds timeout) {
    std::string why = p_->comm->timeout_message(seq_, desc_, timeout);
    p_->comm->mark_gave_up(seq_);
    fail(why, true);
  }
  // A waiter gave the call up: it fails, and the communicator is poisoned (MPI cannot cancel).
  void give_up(const std::string& why) {
    if (state_ != State::kPending) return;
    state_ = State::kFailed;
    error_ = why;
    p_->comm->set_poison(why);
  }

 private:
  enum class State { kPending, kDone, kFailed };

  [[noreturn]] void fail(const std::string& why, bool poison) {
    state_ = State::kFailed;
    error_ = why;
    if (poison) p_->comm->set_poison(why);
    throw CommError(why);
  }

  std::shared_ptr<Pending> p_;
  uint64_t seq_;
  CallDesc desc_;
  Milliseconds default_timeout_;
  bool marks_completion_;
  Finish finish_;
  State state_ = State::kPending;
  std::string error_;
};

inline std::string join_ranks(const std::vector<int>& v) { return fmt::format("[{}]", fmt::join(v, ",")); }


}  // namespace collectives::detail
