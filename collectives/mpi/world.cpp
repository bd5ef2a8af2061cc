// The mpi backend's world: MPI initialisation and the user-defined reductions, the progress
// board (NOTE [mpi progress board] in collectives/mpi.h) and what a timed-out call reads from it.
#include "collectives/mpi/world.h"

#include <climits>
#include <cstring>

#include "kernels/reduce.h"

namespace collectives::detail {

using kernels::InvalidArgument;
using kernels::Unsupported;

namespace {

// A user-defined reduction: inout[i] = in[i] (op) inout[i], computed like the local backend
// (narrow floats in float, rounded to nearest even; NaN propagates through min and max).
// One function per (dtype, op), so the callback need not tell bf16 from f16 by the datatype.
template <DType D, kernels::ReduceOp R>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  kernels::detail::cpu_reduce_into(inout, in, D, *len, R);
}

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
  if (!world->board_ok())
    return "the ranks that never joined are unknown (" + world->board_error() + ")";
  if (slot >= kMpiBoardSlots)
    return fmt::format(
        "the ranks that never joined are unknown (more than {} communicators: no progress board "
        "slot for this one)",
        kMpiBoardSlots);
  const auto entries = world->board_read(slot, ranks, grace);
  std::vector<MemberRecord> members(ranks.size());
  const int64_t number = static_cast<int64_t>(seq) + 1;
  std::string mismatch;
  for (size_t i = 0; i < ranks.size(); ++i) {
    MemberRecord& m = members[i];
    m.rank = ranks[i];
    const auto& e = entries[i];
    if (!e) {
      m.answered = false;
      continue;
    }
    m.entered = (*e)[kEnteredWord];
    m.completed = (*e)[kCompletedWord];
    m.gave_up = (*e)[kGaveUpWord];
    if (m.entered == number && mismatch.empty()) {
      const CallDesc theirs = CallDesc::unpack(&(*e)[kDescWord]);
      if (!(theirs == mine))
        mismatch = fmt::format("collective mismatch: rank {} called {} but rank {} called {}",
                               ranks[static_cast<size_t>(rank)], mine.describe(), ranks[i], theirs.describe());
    }
  }
  return attribution_text(attribute(number, members), mismatch);
}

}  // namespace collectives::detail
