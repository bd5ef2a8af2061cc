// The mpi backend (see collectives/mpi.h). The only includer of mpi.h; compiled only when Meson
// finds MPI (collectives/mpi_absent.cpp stands in otherwise).
#include "collectives/mpi.h"

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
#include <climits>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "collectives/call_queue.h"
#include "kernels/error.h"
#include "kernels/reduce.h"

namespace collectives {

using kernels::CommError;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

bool mpi_built() { return true; }

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// ---- small helpers ----

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

void mpi_check(int rc, const char* fn) {
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

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    // bf16 and f16 move as opaque 16-bit words; their reductions are user-defined ops.
    case DType::kBF16:
    case DType::kF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8: return MPI_UINT8_T;
    case DType::kF8E4M3:
    case DType::kF8E5M2: break;  // rejected earlier by detail::check_tensor
  }
  throw kernels::InternalError(
      fmt::format("mpi backend: no MPI datatype for {}", kernels::to_string(dtype)));
}

// How a send_recv buffer goes to MPI: `count` elements of `type`. A strided view becomes one
// derived datatype (nested hvectors over its dims, innermost first, after dropping size-1 dims
// and merging dims that are contiguous with each other), so MPI copies the elements straight
// from / into the view, in row-major order, with no pack buffer. `owned` types are freed after
// posting (MPI keeps them alive until the operation completes).
struct ViewType {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int count = 0;
  bool owned = false;
};

ViewType view_type(const Tensor& t) {
  const MPI_Datatype base = mpi_type(t.dtype());
  if (t.numel() == 0 || t.is_contiguous()) return {base, static_cast<int>(t.numel()), false};
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride in elements), outer to inner
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.size(d) == 1) continue;
    if (!dims.empty() && dims.back().second == t.stride(d) * t.size(d)) {
      dims.back() = {dims.back().first * t.size(d), t.stride(d)};  // merge with the outer dim
      continue;
    }
    dims.emplace_back(t.size(d), t.stride(d));
  }
  const auto item = static_cast<MPI_Aint>(kernels::itemsize(t.dtype()));
  MPI_Datatype cur = MPI_DATATYPE_NULL;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    const int n = static_cast<int>(it->first);
    MPI_Datatype next = MPI_DATATYPE_NULL;
    if (cur == MPI_DATATYPE_NULL && it->second == 1) mpi_check(MPI_Type_contiguous(n, base, &next), "MPI_Type_contiguous");
    else
      mpi_check(MPI_Type_create_hvector(n, 1, static_cast<MPI_Aint>(it->second) * item,
                                        cur == MPI_DATATYPE_NULL ? base : cur, &next),
                "MPI_Type_create_hvector");
    if (cur != MPI_DATATYPE_NULL) MPI_Type_free(&cur);
    cur = next;
  }
  mpi_check(MPI_Type_commit(&cur), "MPI_Type_commit");
  return {cur, 1, true};
}

// A user-defined reduction: inout[i] = in[i] (op) inout[i], computed like the local backend
// (narrow floats in float, rounded to nearest even; NaN propagates through min and max).
// One function per (dtype, op), so the callback need not tell bf16 from f16 by the datatype.
template <DType D, kernels::ReduceOp R>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  kernels::detail::cpu_reduce_into(inout, in, D, *len, R);
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
static_assert(kDescWord + CallDesc::kWords == kEnteredWord);
using BoardEntry = std::array<int64_t, kSlotWords>;

}  // namespace

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

namespace {

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
    fail(p_->comm->timeout_message(seq_, desc_, timeout), true);
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

std::string join_ranks(const std::vector<int>& v) { return fmt::format("[{}]", fmt::join(v, ",")); }

}  // namespace

// ---- MpiWorldState ----

MpiWorldState::MpiWorldState(int* argc, char*** argv, Milliseconds timeout) : timeout_(timeout) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw CommError("MpiWorld: MPI was already finalised in this process");
  if (!initialized) {
    int provided = 0;
    mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
  }
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  thread_multiple = level == MPI_THREAD_MULTIPLE;
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int* tag_ub_attr = nullptr;
  int has_tag_ub = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub_attr, &has_tag_ub) == MPI_SUCCESS &&
      has_tag_ub && tag_ub_attr)
    tag_ub = *tag_ub_attr;

  for (auto& row : user_ops_) row.fill(MPI_OP_NULL);
  auto make = [&](DType d, kernels::ReduceOp r, MPI_User_function* fn) {
    mpi_check(
        MPI_Op_create(fn, /*commute=*/1, &user_ops_[static_cast<int>(d)][static_cast<int>(r)]),
        "MPI_Op_create");
  };
  using R = kernels::ReduceOp;
  make(DType::kBF16, R::kSum, &user_reduce<DType::kBF16, R::kSum>);
  make(DType::kBF16, R::kProd, &user_reduce<DType::kBF16, R::kProd>);
  make(DType::kBF16, R::kMin, &user_reduce<DType::kBF16, R::kMin>);
  make(DType::kBF16, R::kMax, &user_reduce<DType::kBF16, R::kMax>);
  make(DType::kF16, R::kSum, &user_reduce<DType::kF16, R::kSum>);
  make(DType::kF16, R::kProd, &user_reduce<DType::kF16, R::kProd>);
  make(DType::kF16, R::kMin, &user_reduce<DType::kF16, R::kMin>);
  make(DType::kF16, R::kMax, &user_reduce<DType::kF16, R::kMax>);
  // MPI's built-in MIN/MAX do not say what happens to NaN; these propagate it like the others.
  make(DType::kF32, R::kMin, &user_reduce<DType::kF32, R::kMin>);
  make(DType::kF32, R::kMax, &user_reduce<DType::kF32, R::kMax>);
  make(DType::kF64, R::kMin, &user_reduce<DType::kF64, R::kMin>);
  make(DType::kF64, R::kMax, &user_reduce<DType::kF64, R::kMax>);

  // The progress board (NOTE [mpi progress board]). Every rank must agree whether it exists.
  void* base = nullptr;
  const MPI_Aint bytes = static_cast<MPI_Aint>(kMpiBoardSlots) * kSlotWords * sizeof(int64_t);
  const int rc = MPI_Win_allocate(bytes, sizeof(int64_t), MPI_INFO_NULL, comm, &base, &win_);
  int ok = rc == MPI_SUCCESS;
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  if (ok) {
    std::memset(base, 0, static_cast<size_t>(bytes));
    MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN);
    mpi_check(MPI_Win_lock_all(0, win_), "MPI_Win_lock_all");
    MPI_Win_sync(win_);
  } else {
    board_error_ = rc != MPI_SUCCESS
                       ? fmt::format("MPI_Win_allocate failed: {}", mpi_error_string(rc))
                       : std::string("MPI_Win_allocate failed on another rank");
    win_ = MPI_WIN_NULL;  // a window made on this rank alone is leaked: freeing it is collective
  }
  mpi_check(MPI_Barrier(comm), "MPI_Barrier");
}

MPI_Op MpiWorldState::op_for(DType dtype, kernels::ReduceOp op) const {
  using R = kernels::ReduceOp;
  const R r = op == R::kAvg ? R::kSum : op;
  const MPI_Op user = user_ops_[static_cast<int>(dtype)][static_cast<int>(r)];
  if (user != MPI_OP_NULL) return user;
  switch (r) {
    case R::kSum:
    case R::kAvg: return MPI_SUM;
    case R::kProd: return MPI_PROD;
    case R::kMin: return MPI_MIN;
    case R::kMax: return MPI_MAX;
  }
  return MPI_SUM;
}

void MpiWorldState::board_put(int slot, int word, const int64_t* values, int count, MPI_Op op) {
  if (!board_ok() || slot >= kMpiBoardSlots) return;
  // An accumulate (element-wise atomic) rather than a plain store, so that concurrent remote
  // reads are well defined; the flush completes it before `values` goes out of scope.
  MPI_Accumulate(values, count, MPI_INT64_T, rank, static_cast<MPI_Aint>(slot) * kSlotWords + word,
                 count, MPI_INT64_T, op, win_);
  MPI_Win_flush(rank, win_);
}

std::vector<std::optional<BoardEntry>> MpiWorldState::board_read(
    int slot, const std::vector<int>& world_ranks, Milliseconds grace) {
  const size_t n = world_ranks.size();
  std::vector<std::optional<BoardEntry>> out(n);
  if (!board_ok() || slot >= kMpiBoardSlots) return out;
  auto p = std::make_shared<Pending>();
  auto entries = std::make_shared<std::vector<BoardEntry>>(n);
  p->keep.blobs.push_back(entries);
  p->requests.assign(n, MPI_REQUEST_NULL);
  for (size_t i = 0; i < n; ++i)
    MPI_Rget_accumulate(nullptr, 0, MPI_INT64_T, (*entries)[i].data(), kSlotWords, MPI_INT64_T,
                        world_ranks[i], static_cast<MPI_Aint>(slot) * kSlotWords, kSlotWords,
                        MPI_INT64_T, MPI_NO_OP, win_, &p->requests[i]);
  std::vector<char> done(n, 0);
  const auto deadline = Clock::now() + grace;
  for (Pacer pacer;; pacer.pause()) {
    size_t left = 0;
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      int flag = 0;
      if (p->requests[i] == MPI_REQUEST_NULL ||
          MPI_Test(&p->requests[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        done[i] = 2;  // failed: unknown
        continue;
      }
      if (flag) {
        done[i] = 1;
        out[i] = (*entries)[i];
      } else {
        ++left;
      }
    }
    if (left == 0) return out;
    if (Clock::now() >= deadline) break;
  }
  bury(p);  // reads still in flight write into `entries`
  return out;
}

void MpiWorldState::shutdown() noexcept {
  if (closed_) return;
  bool in_step = false;
  try {
    if (!mgmt->poisoned()) {
      CallDesc d;
      d.kind = kCloseCall;
      const uint64_t seq = mgmt->next_seq++;
      board_enter(0, seq, d);
      MpiRequests work(mgmt, seq, d, timeout_);
      post_request(work.requests(), "MPI_Ibarrier",
                   [&](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
      work.wait(timeout_);
      in_step = true;
    }
  } catch (...) {  // NOLINT: reported by mpirun (no MPI_Finalize), never thrown from a destructor
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && in_step) {
    for (auto& row : user_ops_)
      for (MPI_Op& op : row)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    if (win_ != MPI_WIN_NULL) {
      MPI_Win_unlock_all(win_);
      MPI_Win_free(&win_);
    }
    MPI_Comm_free(&comm);
    if (owns_mpi_) MPI_Finalize();
    MPI_Finalized(&finalized);
  }
  std::vector<std::shared_ptr<Pending>> graveyard;
  {
    std::lock_guard lk(mu_);
    closed_ = true;
    graveyard.swap(graveyard_);
  }
  if (!finalized) {
    // MPI keeps running (it is not ours, or a rank never closed): buffers of calls MPI has not
    // finished must outlive this object, so they are leaked on purpose.
    std::vector<std::shared_ptr<Pending>> unfinished;
    for (auto& p : graveyard) {
      int flag = 0;
      if (MPI_Testall(static_cast<int>(p->requests.size()), p->requests.data(), &flag,
                      MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
          !flag)
        unfinished.push_back(p);
    }
    if (!unfinished.empty()) new std::vector<std::shared_ptr<Pending>>(std::move(unfinished));
  }
  graveyard.clear();
  mgmt.reset();
}

// ---- CommState ----

std::string CommState::pending_text(uint64_t seq, const CallDesc& mine, Milliseconds grace) {
  std::string text;
  if (!world->board_ok())
    return text + "the ranks that never joined are unknown (" + world->board_error() + ")";
  if (slot >= kMpiBoardSlots)
    return text + fmt::format(
                      "the ranks that never joined are unknown (more than {} communicators: "
                      "no progress board slot for this one)",
                      kMpiBoardSlots);
  const auto entries = world->board_read(slot, ranks, grace);
  const int64_t number = static_cast<int64_t>(seq) + 1;
  std::vector<int> missing, unanswered, inside;
  std::string mismatch;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!entries[i]) {
      unanswered.push_back(ranks[i]);
      continue;
    }
    const BoardEntry& e = *entries[i];
    if (e[kEnteredWord] < number) {
      missing.push_back(ranks[i]);
    } else if (e[kEnteredWord] == number) {
      if (e[kCompletedWord] < number) inside.push_back(ranks[i]);
      const CallDesc theirs = CallDesc::unpack(&e[kDescWord]);
      if (mismatch.empty() && !(theirs == mine))
        mismatch = fmt::format("; collective mismatch: rank {} called {} but rank {} called {}",
                               ranks[static_cast<size_t>(rank)], mine.describe(), ranks[i],
                               theirs.describe());
    }
  }
  if (!missing.empty()) {
    text += fmt::format("ranks {} never joined", join_ranks(missing));
  } else if (unanswered.size() < ranks.size()) {
    text += fmt::format(
        "every member joined, ranks {} have not completed it{} (MPI does not check "
        "that members pass matching counts, dtypes, ops and roots; a member that "
        "stopped calling into MPI also stalls the others)",
        join_ranks(inside), mismatch);
  }
  if (!unanswered.empty())
    text += fmt::format("{}ranks {} did not answer the progress query (state unknown)",
                        missing.empty() && unanswered.size() == ranks.size() ? "" : "; ",
                        join_ranks(unanswered));
  return text;
}

namespace {

void check_agreement(const std::shared_ptr<CommState>& st_, Milliseconds timeout, uint64_t seq,
                     const CallDesc& d, std::span<const int64_t> send_counts,
                     std::span<const int64_t> recv_counts);

// One call of an MPI communicator as an entry of its queue (NOTE [call queue]): start() enters it
// on the progress board, checks agreement (check_calls) and issues the MPI_I* calls; advance()
// polls them (MPI_Testall), pacing itself like a waiter.
class MpiCall final : public QueuedCall {
 public:
  using Issue = std::function<MpiRequests::Finish(std::vector<MPI_Request>&, Keep&)>;

  MpiCall(std::shared_ptr<CommState> st, CallDesc d, std::vector<Tensor> buffers, Issue issue, bool check_calls,
          std::span<const int64_t> send_counts, std::span<const int64_t> recv_counts, Milliseconds timeout)
      : st_(std::move(st)), d_(d), buffers_(std::move(buffers)), issue_(std::move(issue)), check_calls_(check_calls),
        send_counts_(send_counts.begin(), send_counts.end()), recv_counts_(recv_counts.begin(), recv_counts.end()),
        timeout_(timeout) {}

  void start() override {
    CommState& c = *st_;
    if (std::string why = c.unusable(d_); !why.empty()) throw CommError(why);
    const uint64_t seq = c.next_seq++;
    seq_.store(static_cast<int64_t>(seq));
    c.world->board_enter(c.slot, seq, d_);
    if (check_calls_) check_agreement(st_, timeout_, seq, d_, send_counts_, recv_counts_);
    auto req = std::make_shared<MpiRequests>(st_, seq, d_, timeout_);
    req->keep().tensors = std::move(buffers_);
    try {
      req->set_finish(issue_(req->requests(), req->keep()));
    } catch (const CommError& e) {
      // Members are out of step now (this rank issued nothing, or part of a batch of messages).
      std::string why = fmt::format("{} on {} (call #{}) failed: {}", d_.describe(), c.group(), seq, e.what());
      c.set_poison(why);
      req_ = std::move(req);
      throw CommError(why);
    }
    issue_ = nullptr;
    req_ = std::move(req);
    started_at_ = Clock::now();
  }

  bool advance(Clock::time_point until) override {
    if (req_->poll()) return true;
    // MPI advances nonblocking calls only inside MPI calls (and every round of a collective
    // needs every member to poll), so the holder keeps polling: yielding the core between polls
    // for the first 100 ms of the call (another rank on this core may be the one needed; MPI's
    // own blocking waits spin the whole time), then sleeping 20 us doubling to 200 us between
    // polls, so a long wait for a late member costs little CPU.
    if (Clock::now() - started_at_ < std::chrono::milliseconds(100)) {
      sched_yield();
    } else if (Clock::now() < until) {
      std::this_thread::sleep_for(std::min<Clock::duration>(sleep_, until - Clock::now()));
      sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(200));
    }
    return false;
  }

  // MPI_I* calls may copy or reduce before they return, and check_calls exchanges: never on the
  // caller's push.
  bool cheap_start() const override { return false; }

  std::string pending_text() override {
    const int64_t seq = seq_.load();
    if (seq < 0) return "it is being issued";
    return st_->pending_text(static_cast<uint64_t>(seq), d_, std::min(timeout_, Milliseconds{2000}));
  }

  void abandon(const std::string& why) override {
    // MPI cannot cancel a collective: the communicator is unusable from now on.
    st_->set_poison(why);
  }

  std::string describe() const override {
    const int64_t seq = seq_.load();
    return seq < 0 ? fmt::format("{} on {}", d_.name(), st_->group())
                   : fmt::format("{} on {} (call #{})", d_.name(), st_->group(), seq);
  }

 private:
  std::shared_ptr<CommState> st_;
  CallDesc d_;
  std::vector<Tensor> buffers_;
  Issue issue_;
  bool check_calls_;
  std::vector<int64_t> send_counts_, recv_counts_;
  Milliseconds timeout_;
  std::atomic<int64_t> seq_{-1};
  std::shared_ptr<MpiRequests> req_;  // its destructor keeps unfinished buffers for MPI
  Clock::time_point started_at_;
  std::chrono::microseconds sleep_{20};
};

// ---- MpiCommunicator ----

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<CommState> st, Milliseconds timeout, bool check_calls)
      : Communicator(st->rank, st->ranks, st->name, timeout),
        st_(std::move(st)),
        check_calls_(check_calls),
        queue_(std::make_shared<CallQueue>(CallQueue::Options{.worker = st_->worker, .ticker = st_->world->ticker})) {}
  ~MpiCommunicator() override {
    // Pending calls complete first, bounded by the timeout (MPI may not touch freed buffers),
    // unless the thread unwinds an exception or the group already failed.
    const bool drain = std::uncaught_exceptions() == 0 && !st_->poisoned() && !st_->world->closed();
    queue_->shutdown(drain, timeout(), "abandoned: the communicator was destroyed");
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  std::string_view backend() const override { return "mpi"; }

  WorkPtr all_gather(const Tensor& input, const Tensor& output) override {
    constexpr auto kind = CollectiveKind::kAllGather;
    check_buffers(kind, *this, input, output);
    check_cpu(kind, {input, output});
    const int count = int_count(kind, input.numel(), "the input");
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel());
    const size_t item = kernels::itemsize(output.dtype());
    // MPI_IN_PLACE is valid only when every member passes it, so every member works in place:
    // its own slice of the output is filled first (a no-op when the input is that slice).
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep&) {
      char* slice = static_cast<char*>(output.data_ptr()) + static_cast<size_t>(rank()) * count * item;
      if (count > 0 && input.data_ptr() != slice)
        std::memmove(slice, input.data_ptr(), count * item);
      post_request(reqs, "MPI_Iallgather", [&](MPI_Request* r) {
        return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, output.data_ptr(), count,
                              mpi_type(output.dtype()), st_->comm, r);
      });
    });
  }

  WorkPtr reduce_scatter(const Tensor& input, const Tensor& output, Reduction r) override {
    constexpr auto kind = CollectiveKind::kReduceScatter;
    check_buffers(kind, *this, input, output);
    check_reduction(kind, input, r);
    check_cpu(kind, {input, output});
    const int count = int_count(kind, output.numel(), "the output");
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel(), r);
    const MPI_Op op = st_->world->op_for(output.dtype(), r.op);
    const int n = size();
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep& keep) {
      // The in-place form of MPI_Reduce_scatter_block wants the whole input in the receive
      // buffer on every member, so an output inside the input gets a temporary instead.
      Tensor send = input;
      if (r.pre_multiplier != 1.0) {
        send = input.clone();
        kernels::scale_(send, r.pre_multiplier);
      }
      Tensor recv =
          overlaps(output, send) ? Tensor::empty({output.numel()}, output.dtype()) : output;
      keep.tensors.push_back(send);
      keep.tensors.push_back(recv);
      post_request(reqs, "MPI_Ireduce_scatter_block", [&](MPI_Request* r) {
        return MPI_Ireduce_scatter_block(send.data_ptr(), recv.data_ptr(), count,
                                         mpi_type(output.dtype()), op, st_->comm, r);
      });
      return finish_reduce(output, recv, r.op, n);
    });
  }

  WorkPtr all_reduce(const Tensor& input, const Tensor& output, Reduction r) override {
    constexpr auto kind = CollectiveKind::kAllReduce;
    check_buffers(kind, *this, input, output);
    check_reduction(kind, input, r);
    check_cpu(kind, {input, output});
    const int count = int_count(kind, output.numel(), "the buffer");
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel(), r);
    const MPI_Op op = st_->world->op_for(output.dtype(), r.op);
    const int n = size();
    // Out of place on every member (MPI_IN_PLACE must be passed by all or none, and OpenMPI's
    // nonblocking in-place all-reduce measured 1.1-1.5x slower): an input that is (or overlaps)
    // the output, or needs a pre-multiplier, goes through a copy first.
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep& keep) {
      Tensor send = input;
      if (count > 0 && (r.pre_multiplier != 1.0 || overlaps(input, output))) send = input.clone();
      if (r.pre_multiplier != 1.0) kernels::scale_(send, r.pre_multiplier);
      keep.tensors.push_back(send);
      post_request(reqs, "MPI_Iallreduce", [&](MPI_Request* r) {
        // An empty call is empty on every member, so all of them pass MPI_IN_PLACE then.
        return MPI_Iallreduce(count > 0 ? send.data_ptr() : MPI_IN_PLACE, output.data_ptr(), count,
                              mpi_type(output.dtype()), op, st_->comm, r);
      });
      return finish_reduce(output, output, r.op, n);
    });
  }

  WorkPtr all_to_all(const Tensor& input, const Tensor& output) override {
    constexpr auto kind = CollectiveKind::kAllToAll;
    check_buffers(kind, *this, input, output);
    check_cpu(kind, {input, output});
    const int count = int_count(kind, input.numel() / size(), "a member's slice");
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel());
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep& keep) {
      const Tensor send = overlaps(input, output) ? input.clone() : input;
      keep.tensors.push_back(send);
      const MPI_Datatype t = mpi_type(output.dtype());
      post_request(reqs, "MPI_Ialltoall", [&](MPI_Request* r) {
        return MPI_Ialltoall(send.data_ptr(), count, t, output.data_ptr(), count, t, st_->comm, r);
      });
    });
  }

  WorkPtr all_to_all_v(const Tensor& input, std::span<const int64_t> send_counts,
                       const Tensor& output, std::span<const int64_t> recv_counts) override {
    constexpr auto kind = CollectiveKind::kAllToAllV;
    check_buffers(kind, *this, input, output);
    check_cpu(kind, {input, output});
    auto layout = [&](std::span<const int64_t> counts, const Tensor& t, const char* what) {
      std::vector<int> c(counts.size()), displs(counts.size());
      int64_t total = 0;
      for (size_t j = 0; j < counts.size(); ++j) {
        // MPI-3 counts and displacements are int.
        if (counts[j] > INT_MAX || total > INT_MAX)
          throw Unsupported(fmt::format(
              "all_to_all_v on group '{}': {} count {} (or the offset {} of member {}) exceeds "
              "the mpi backend's limit of {} elements (MPI counts and displacements are int); "
              "split the exchange",
              name(), what, counts[j], total, j, INT_MAX));
        c[j] = static_cast<int>(counts[j]);
        displs[j] = static_cast<int>(total);
        total += counts[j];
      }
      check_counts(*this, counts, t, what);  // after the int limits, which are the mpi-specific part
      return std::pair{std::move(c), std::move(displs)};
    };
    auto send_layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>(
        layout(send_counts, input, "send"));
    auto recv_layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>(
        layout(recv_counts, output, "receive"));
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel());
    return launch(
        d, {input, output},
        [=, this](std::vector<MPI_Request>& reqs, Keep& keep) {
          const Tensor send = overlaps(input, output) ? input.clone() : input;
          keep.tensors.push_back(send);
          keep.blobs.push_back(send_layout);  // MPI may read the count arrays until completion
          keep.blobs.push_back(recv_layout);
          const MPI_Datatype t = mpi_type(output.dtype());
          post_request(reqs, "MPI_Ialltoallv", [&](MPI_Request* r) {
            return MPI_Ialltoallv(send.data_ptr(), send_layout->first.data(),
                                  send_layout->second.data(), t, output.data_ptr(),
                                  recv_layout->first.data(), recv_layout->second.data(), t,
                                  st_->comm, r);
          });
        },
        send_counts, recv_counts);
  }

  WorkPtr broadcast(const Tensor& buffer, int root) override {
    constexpr auto kind = CollectiveKind::kBroadcast;
    check_tensor(kind, *this, buffer, "buffer");
    check_cpu(kind, {buffer});
    check_root(kind, root);
    const int count = int_count(kind, buffer.numel(), "the buffer");
    CallDesc d = desc(kind, buffer.dtype(), buffer.numel(), buffer.numel());
    d.root = root;
    return launch(d, {buffer}, [=, this](std::vector<MPI_Request>& reqs, Keep&) {
      post_request(reqs, "MPI_Ibcast", [&](MPI_Request* r) {
        return MPI_Ibcast(buffer.data_ptr(), count, mpi_type(buffer.dtype()), root, st_->comm, r);
      });
    });
  }

  WorkPtr scatter(const Tensor& input, const Tensor& output, int root) override {
    constexpr auto kind = CollectiveKind::kScatter;
    check_root(kind, root);
    const bool at_root = rank() == root;
    if (at_root) {
      check_buffers(kind, *this, input, output);
      check_cpu(kind, {input, output});
      if (input.numel() != size() * output.numel())
        throw InvalidArgument(fmt::format(
            "scatter on group '{}' of {} ranks: root input has {} elements and output {} "
            "(expected input = size x output)",
            name(), size(), input.numel(), output.numel()));
    } else {
      check_tensor(kind, *this, output, "output");
      check_cpu(kind, {output});
    }
    const int count = int_count(kind, output.numel(), "the output");
    CallDesc d = desc(kind, output.dtype(), at_root ? input.numel() : 0, output.numel());
    d.root = root;
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep& keep) {
      const MPI_Datatype t = mpi_type(output.dtype());
      void* recv = output.data_ptr();
      const void* send = nullptr;
      if (at_root) {
        const size_t item = kernels::itemsize(output.dtype());
        const char* slice =
            static_cast<const char*>(input.data_ptr()) + static_cast<size_t>(root) * count * item;
        if (count > 0 && slice == output.data_ptr()) {
          recv = MPI_IN_PLACE;  // allowed at the root alone
          send = input.data_ptr();
        } else {
          const Tensor s = overlaps(input, output) ? input.clone() : input;
          keep.tensors.push_back(s);
          send = s.data_ptr();
        }
      }
      post_request(reqs, "MPI_Iscatter", [&](MPI_Request* r) {
        return MPI_Iscatter(send, count, t, recv, count, t, root, st_->comm, r);
      });
    });
  }

  // Strided send_recv buffers travel as derived datatypes (view_type). OpenMPI's shared-memory
  // transport moves a strided message of a few MiB 3-4x slower than a contiguous one (measured,
  // OpenMPI 4.1, 4 processes), while messages up to ~1 MiB go at the contiguous speed.
  bool p2p_views() const override { return true; }
  int64_t p2p_view_max_bytes() const override { return int64_t{1} << 20; }

  WorkPtr barrier() override {
    CallDesc d;
    d.kind = static_cast<int>(CollectiveKind::kBarrier);
    return launch(d, {}, [this](std::vector<MPI_Request>& reqs, Keep&) {
      post_request(reqs, "MPI_Ibarrier",
                   [&](MPI_Request* r) { return MPI_Ibarrier(st_->comm, r); });
    });
  }

  WorkPtr send_recv(std::span<const P2POp> ops) override {
    constexpr auto kind = CollectiveKind::kSendRecv;
    for (const P2POp& op : ops) {
      check_p2p_tensor(*this, op.buffer);
      check_cpu(kind, {op.buffer});
      if (op.peer < 0 || op.peer >= size())
        throw InvalidArgument(fmt::format("send_recv on group '{}': peer {} out of range 0..{}",
                                          name(), op.peer, size() - 1));
      int_count(kind, op.buffer.numel(), "a buffer");
    }
    CallDesc d;
    d.kind = static_cast<int>(kind);
    d.in_count = static_cast<int64_t>(ops.size());
    std::vector<P2POp> mine(ops.begin(), ops.end());
    std::vector<Tensor> buffers;
    for (const P2POp& op : mine) buffers.push_back(op.buffer);
    return launch(d, std::move(buffers), [this, mine](std::vector<MPI_Request>& reqs, Keep&) {
      // Every member calls send_recv in the same order, so the call number is the same on both
      // sides of each message: as the tag it keeps consecutive exchanges apart. MPI delivers
      // messages with one (source, tag) in order, so the k-th send to a peer meets its k-th
      // receive from us.
      const uint64_t seq = st_->next_seq - 1;  // start() numbered this call already
      const int tag = static_cast<int>(seq % (static_cast<uint64_t>(st_->world->tag_ub) + 1));
      for (const P2POp& op : mine) {
        ViewType v = view_type(op.buffer);
        const std::unique_ptr<ViewType, void (*)(ViewType*)> free_type(
            &v, [](ViewType* p) { if (p->owned) MPI_Type_free(&p->type); });
        void* data = op.buffer.numel() > 0 ? op.buffer.data_ptr() : nullptr;
        if (op.kind == P2POp::Kind::kSend)
          post_request(reqs, "MPI_Isend", [&](MPI_Request* r) {
            return MPI_Isend(data, v.count, v.type, op.peer, tag, st_->comm, r);
          });
        else
          post_request(reqs, "MPI_Irecv", [&](MPI_Request* r) {
            return MPI_Irecv(data, v.count, v.type, op.peer, tag, st_->comm, r);
          });
      }
      // A receive longer than its send fails in MPI (truncation); a shorter one is caught here.
      return MpiRequests::Finish([this, mine](std::span<MPI_Status> statuses) {
        std::vector<int> nth(static_cast<size_t>(size()), 0);
        for (size_t i = 0; i < mine.size(); ++i) {
          const P2POp& op = mine[i];
          if (op.kind != P2POp::Kind::kRecv) continue;
          const int k = nth[static_cast<size_t>(op.peer)]++;
          int got = 0;
          MPI_Get_count(&statuses[i], mpi_type(op.buffer.dtype()), &got);
          if (got != op.buffer.numel())
            throw CommError(fmt::format(
                "send_recv mismatch on group '{}': receive #{} of rank {} from rank {} got {} "
                "elements but its buffer has {}",
                name(), k, ranks()[static_cast<size_t>(rank())],
                ranks()[static_cast<size_t>(op.peer)], got, op.buffer.numel()));
        }
      });
    });
  }

  void begin_batch() override {
    if (batching_)
      throw InvalidArgument(fmt::format("begin_batch on group '{}': already in a batch", name()));
    batching_ = true;
  }
  WorkPtr end_batch() override {
    if (!batching_)
      throw InvalidArgument(fmt::format("end_batch on group '{}': no batch begun", name()));
    batching_ = false;
    return std::make_shared<GroupWork>(std::exchange(batch_, {}));
  }

  void wait_for(const WorkPtr& work) override { queue_->add_dependency(work); }
  void kick() override { queue_->kick(); }
  WorkPtr host_task(std::function<void()> fn) override {
    if (batching_)
      throw InvalidArgument(fmt::format("host_task on group '{}': not allowed inside a batch", name()));
    if (!fn) throw InvalidArgument(fmt::format("host_task on group '{}': the function is empty", name()));
    return queue_->push(std::make_shared<HostTask>(std::move(fn), st_->group()), timeout());
  }

  std::unique_ptr<Communicator> split(std::span<const int> group, std::string new_name) override;

 private:
  // issue(requests, keep) posts the MPI calls; it may return a Finish to run on completion.
  using Issue = std::function<MpiRequests::Finish(std::vector<MPI_Request>&, Keep&)>;

  template <class F>
  WorkPtr launch(const CallDesc& d, std::vector<Tensor> buffers, F&& issue,
                 std::span<const int64_t> send_counts = {},
                 std::span<const int64_t> recv_counts = {}) {
    Issue fn;
    if constexpr (std::is_void_v<std::invoke_result_t<F, std::vector<MPI_Request>&, Keep&>>)
      fn = [f = std::forward<F>(issue)](std::vector<MPI_Request>& r, Keep& k) {
        f(r, k);
        return MpiRequests::Finish{};
      };
    else
      fn = std::forward<F>(issue);
    // A communicator known to be unusable refuses at once (a call already queued learns it when
    // it starts).
    if (std::string why = st_->unusable(d); !why.empty()) throw CommError(why);
    WorkPtr work = queue_->push(std::make_shared<MpiCall>(st_, d, std::move(buffers), std::move(fn),
                                                          check_calls_ && d.kind != kSplitCall, send_counts,
                                                          recv_counts, timeout()),
                                timeout());
    if (batching_) batch_.push_back(work);
    return work;
  }

  CallDesc desc(CollectiveKind kind, DType dtype, int64_t in, int64_t out, Reduction r = {}) const {
    CallDesc d;
    d.kind = static_cast<int>(kind);
    d.dtype = static_cast<int>(dtype);
    d.in_count = in;
    d.out_count = out;
    if (kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce) {
      d.op = static_cast<int>(r.op);
      d.premul = r.pre_multiplier;
    }
    return d;
  }
  void check_cpu(CollectiveKind kind, std::initializer_list<Tensor> tensors) const {
    for (const Tensor& t : tensors)
      if (t.defined() && !t.device().is_cpu())
        throw InvalidArgument(fmt::format(
            "{} on group '{}': the mpi backend moves CPU tensors; use the nccl backend for {}",
            to_string(kind), name(), kernels::to_string(t.device())));
  }
  int int_count(CollectiveKind kind, int64_t n, const char* what) const {
    if (n > INT_MAX)
      throw Unsupported(fmt::format(
          "{} on group '{}': {} has {} elements, over the mpi backend's limit of {} per member "
          "(MPI counts are int); split the call",
          to_string(kind), name(), what, n, INT_MAX));
    return static_cast<int>(n);
  }
  void check_root(CollectiveKind kind, int root) const {
    if (root < 0 || root >= size())
      throw InvalidArgument(fmt::format("{} on group '{}': root {} out of range 0..{}",
                                        to_string(kind), name(), root, size() - 1));
  }
  static MpiRequests::Finish finish_reduce(const Tensor& output, const Tensor& result,
                                       kernels::ReduceOp op, int n) {
    if (result.shares_storage_with(output) && result.data_ptr() == output.data_ptr() &&
        op != kernels::ReduceOp::kAvg)
      return {};
    return [output, result, op, n](std::span<MPI_Status>) {
      if (result.data_ptr() != output.data_ptr() && output.numel() > 0)
        std::memmove(output.data_ptr(), result.data_ptr(), output.nbytes());
      // avg = sum / size, with kernels::scale_'s rounding (integers truncate toward zero), as the
      // local backend does.
      if (op == kernels::ReduceOp::kAvg) kernels::scale_(output, 1.0 / n);
    };
  }

  std::shared_ptr<CommState> st_;
  bool check_calls_;
  std::shared_ptr<CallQueue> queue_;
  bool batching_ = false;
  std::vector<WorkPtr> batch_;
};

// check_calls: every member exchanges its call's description (on a private communicator, so
// the data calls keep their order) and all compare them the same way; a mismatch throws on
// every member, before any data moves, with the local backend's wording.
void check_agreement(const std::shared_ptr<CommState>& st_, Milliseconds timeout, uint64_t seq,
                     const CallDesc& d, std::span<const int64_t> send_counts,
                     std::span<const int64_t> recv_counts) {
  const int n = static_cast<int>(st_->ranks.size());
  const std::string& name = st_->name;
  const int pairs = n <= 256 ? 2 * n : 0;  // all_to_all_v counts, checked pairwise
  const int words = CallDesc::kWords + pairs;
  auto buf = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(words) * (n + 1), 0);
  const std::array<int64_t, CallDesc::kWords> mine = d.pack();
  std::copy(mine.begin(), mine.end(), buf->begin());
  if (pairs && !send_counts.empty()) {
    std::copy(send_counts.begin(), send_counts.end(), buf->begin() + CallDesc::kWords);
    std::copy(recv_counts.begin(), recv_counts.end(), buf->begin() + CallDesc::kWords + n);
  }
  MpiRequests work(st_, seq, d, timeout, /*marks_completion=*/false);
  work.keep().blobs.push_back(buf);
  try {
    post_request(work.requests(), "MPI_Iallgather", [&](MPI_Request* r) {
      return MPI_Iallgather(buf->data(), words, MPI_INT64_T, buf->data() + words, words,
                            MPI_INT64_T, st_->check_comm, r);
    });
  } catch (const CommError& e) {
    std::string why =
        fmt::format("{} on {} (call #{}) failed: {}", d.describe(), st_->group(), seq, e.what());
    st_->set_poison(why);
    throw CommError(why);
  }
  work.wait(timeout);

  auto at = [&](int i) { return buf->data() + static_cast<ptrdiff_t>(words) * (i + 1); };
  std::vector<CallDesc> calls;
  for (int i = 0; i < n; ++i) calls.push_back(CallDesc::unpack(at(i)));
  std::string mismatch;
  const CallDesc& c0 = calls[0];
  auto differ = [&](int i, const char* what) {
    return fmt::format(
        "collective mismatch on group '{}' ({}): rank {} called {} but rank {} "
        "called {}",
        name, what, st_->ranks[0], c0.describe(), st_->ranks[static_cast<size_t>(i)],
        calls[static_cast<size_t>(i)].describe());
  };
  for (int i = 1; i < n && mismatch.empty(); ++i) {
    const CallDesc& c = calls[static_cast<size_t>(i)];
    if (c.kind != c0.kind)
      mismatch = differ(i, "different collectives");
    else if (c.is(CollectiveKind::kBarrier) || c.is(CollectiveKind::kSendRecv))
      continue;
    else if (c.dtype != c0.dtype)
      mismatch = differ(i, "different dtypes");
    else if (c.root != c0.root)
      mismatch = differ(i, "different roots");
    else if (c.op != c0.op || c.premul != c0.premul)
      mismatch = differ(i, "different reductions");
    else if ((c.is(CollectiveKind::kBroadcast) || c.is(CollectiveKind::kScatter))
                 ? c.out_count != c0.out_count
                 : !c.is(CollectiveKind::kAllToAllV) && c.in_count != c0.in_count)
      mismatch = differ(i, "different counts");
  }
  if (mismatch.empty() && c0.is(CollectiveKind::kAllToAllV) && pairs) {
    for (int i = 0; i < n && mismatch.empty(); ++i)
      for (int j = 0; j < n && mismatch.empty(); ++j) {
        const int64_t sent = at(i)[CallDesc::kWords + j];
        const int64_t expected = at(j)[CallDesc::kWords + n + i];
        if (sent != expected)
          mismatch = fmt::format(
              "all_to_all_v count mismatch on group '{}': rank {} sends {} elements to rank {}, "
              "which expects {}",
              name, st_->ranks[static_cast<size_t>(i)], sent, st_->ranks[static_cast<size_t>(j)],
              expected);
      }
  }
  if (!mismatch.empty()) {
    st_->set_poison(mismatch);
    throw CommError(mismatch);
  }
}

// FNV-1a over a member list (split agreement).
int64_t hash_group(std::span<const int> group) {
  uint64_t h = 1469598103934665603ull;
  for (int m : group) {
    h ^= static_cast<uint32_t>(m);
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}

// NOTE [mpi split] MPI_Comm_split blocks with no timeout, so the members first exchange
// (color, key, group size, group hash, free board slot) with a tracked MPI_Iallgather: a missing
// member then fails the call within the timeout, naming it, and every member checks the groups
// from the same data, so they all throw or all go on to MPI_Comm_split together. color = the
// group's first member and key = the position in the group give the order asked for. The new
// communicator's board slot is the largest free slot among its members.
std::unique_ptr<Communicator> MpiCommunicator::split(std::span<const int> group,
                                                     std::string new_name) {
  if (batching_)
    throw InvalidArgument(fmt::format("split on group '{}': not allowed inside a batch", name()));
  const int n = size();
  if (new_name.empty()) new_name = "split";
  // Validity is shared with the others through the exchange (color -1, key = reason).
  enum Invalid : int64_t { kEmpty = 1, kOutOfRange, kDuplicate, kWithoutMe };
  int64_t color = -1, key = 0;
  {
    std::vector<char> seen(static_cast<size_t>(n), 0);
    const auto self = std::find(group.begin(), group.end(), rank());
    if (group.empty()) key = kEmpty;
    for (int m : group) {
      if (m < 0 || m >= n) {
        key = kOutOfRange;
        break;
      }
      if (seen[static_cast<size_t>(m)]++) {
        key = kDuplicate;
        break;
      }
    }
    if (key == 0 && self == group.end()) key = kWithoutMe;
    if (key == 0) {
      color = group[0];
      key = self - group.begin();
    }
  }
  const int64_t proposal = st_->world->slot_proposal();
  auto buf = std::make_shared<std::vector<int64_t>>(5 * static_cast<size_t>(n + 1), 0);
  (*buf)[0] = color;
  (*buf)[1] = key;
  (*buf)[2] = static_cast<int64_t>(group.size());
  (*buf)[3] = hash_group(group);
  (*buf)[4] = proposal;
  CallDesc d;
  d.kind = kSplitCall;
  d.in_count = static_cast<int64_t>(group.size());
  auto work = launch(d, {}, [&](std::vector<MPI_Request>& reqs, Keep& keep) {
    keep.blobs.push_back(buf);
    post_request(reqs, "MPI_Iallgather", [&](MPI_Request* r) {
      return MPI_Iallgather(buf->data(), 5, MPI_INT64_T, buf->data() + 5, 5, MPI_INT64_T, st_->comm,
                            r);
    });
  });
  work->wait(timeout());

  auto field = [&](int i, int f) {
    return (*buf)[5 * static_cast<size_t>(i + 1) + static_cast<size_t>(f)];
  };
  std::string bad;
  for (int i = 0; i < n && bad.empty(); ++i) {
    if (field(i, 0) >= 0) continue;
    static constexpr const char* kWhy[] = {"", "an empty group", "a member out of range",
                                           "a member twice", "a group without itself"};
    bad = fmt::format("split of group '{}': rank {} passed {} (group ranks 0..{}{})", name(),
                      ranks()[static_cast<size_t>(i)], kWhy[std::clamp<int64_t>(field(i, 1), 0, 4)],
                      n - 1, i == rank() ? fmt::format(", got [{}]", fmt::join(group, ",")) : "");
  }
  // For each new group (by color): one size and hash, keys 0..size-1 each once, color = key 0.
  for (int i = 0; i < n && bad.empty(); ++i) {
    const int64_t c = field(i, 0);
    std::vector<int> members;
    std::vector<char> keys(static_cast<size_t>(n), 0);
    bool ok = field(static_cast<int>(c), 0) == c && field(static_cast<int>(c), 1) == 0;
    for (int j = 0; j < n; ++j) {
      if (field(j, 0) != c) continue;
      members.push_back(j);
      const int64_t k = field(j, 1);
      ok = ok && field(j, 2) == field(i, 2) && field(j, 3) == field(i, 3) && k >= 0 && k < n &&
           !keys[static_cast<size_t>(k)]++;
    }
    ok = ok && static_cast<int64_t>(members.size()) == field(i, 2);
    if (!ok) {
      std::vector<int> global;
      for (int j : members) global.push_back(ranks()[static_cast<size_t>(j)]);
      bad = fmt::format(
          "split of group '{}': ranks {} pass groups starting with member {} that do "
          "not agree (every member of a new group must pass the same list, and "
          "groups must be disjoint)",
          name(), join_ranks(global), c);
    }
  }
  if (!bad.empty()) throw CommError(bad);  // thrown by every member alike: no poison needed

  int64_t slot = 0;
  std::vector<int> new_ranks(group.size());
  for (int j = 0; j < n; ++j)
    if (field(j, 0) == color) {
      slot = std::max(slot, field(j, 4));
      new_ranks[static_cast<size_t>(field(j, 1))] = ranks()[static_cast<size_t>(j)];
    }
  st_->world->take_slot(slot);
  MPI_Comm comm = MPI_COMM_NULL, check = MPI_COMM_NULL;
  try {
    mpi_check(MPI_Comm_split(st_->comm, static_cast<int>(color), static_cast<int>(key), &comm),
              "MPI_Comm_split");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (check_calls_) mpi_check(MPI_Comm_dup(comm, &check), "MPI_Comm_dup");
  } catch (const CommError& e) {
    std::string why = fmt::format("split on {} failed: {}", st_->group(), e.what());
    st_->set_poison(why);
    throw CommError(why);
  }
  auto st =
      std::make_shared<CommState>(st_->world, comm, static_cast<int>(key), std::move(new_ranks),
                                  std::move(new_name), static_cast<int>(slot), true);
  st->check_comm = check;
  st->worker = st->world->thread_multiple;
  return std::make_unique<MpiCommunicator>(std::move(st), timeout(), check_calls_);
}

}  // namespace
}  // namespace detail

// ---- MpiWorld ----

MpiWorld::MpiWorld(int* argc, char*** argv, Milliseconds timeout)
    : state_(std::make_shared<detail::MpiWorldState>(argc, argv, timeout)) {
  std::vector<int> all(static_cast<size_t>(state_->size));
  for (int i = 0; i < state_->size; ++i) all[static_cast<size_t>(i)] = i;
  state_->mgmt = std::make_shared<detail::CommState>(state_, state_->comm, state_->rank, all,
                                                     "world", 0, false);
}

MpiWorld::~MpiWorld() { state_->shutdown(); }

int MpiWorld::rank() const { return state_->rank; }
int MpiWorld::size() const { return state_->size; }

std::unique_ptr<Communicator> MpiWorld::communicator(Milliseconds timeout, bool check_calls) {
  using namespace detail;
  auto& mgmt = state_->mgmt;
  CallDesc d;
  d.kind = kCreateCall;
  if (std::string why = mgmt->unusable(d); !why.empty()) throw CommError(why);
  const uint64_t seq = mgmt->next_seq++;
  state_->board_enter(0, seq, d);

  // Agree on a board slot (the largest free one) with a tracked exchange; once it completes,
  // every rank is here, so the blocking MPI_Comm_dup below cannot wait forever.
  auto slot = std::make_shared<std::array<int64_t, 2>>();
  (*slot)[0] = state_->slot_proposal();
  {
    MpiRequests work(mgmt, seq, d, timeout);
    work.keep().blobs.push_back(slot);
    post_request(work.requests(), "MPI_Iallreduce", [&](MPI_Request* r) {
      return MPI_Iallreduce(slot->data(), slot->data() + 1, 1, MPI_INT64_T, MPI_MAX, state_->comm,
                            r);
    });
    work.wait(timeout);
  }
  state_->take_slot((*slot)[1]);
  MPI_Comm comm = MPI_COMM_NULL, check = MPI_COMM_NULL;
  mpi_check(MPI_Comm_dup(state_->comm, &comm), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (check_calls) mpi_check(MPI_Comm_dup(comm, &check), "MPI_Comm_dup");
  auto st = std::make_shared<CommState>(state_, comm, state_->rank, mgmt->ranks, "world",
                                        static_cast<int>((*slot)[1]), true);
  st->check_comm = check;
  st->worker = state_->thread_multiple;
  return std::make_unique<MpiCommunicator>(std::move(st), timeout, check_calls);
}

}  // namespace collectives
