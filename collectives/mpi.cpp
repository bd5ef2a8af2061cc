// The mpi backend (see collectives/mpi.h): MpiCommunicator, its calls, split and MpiWorld.
// Compiled only when Meson finds MPI (collectives/mpi_absent.cpp stands in otherwise); the world,
// its progress board and the polling of requests are in collectives/mpi/world.{h,cpp}.
#include "collectives/mpi.h"

#include <climits>
#include <cstring>
#include <utility>

#include "collectives/mpi/world.h"
#include "kernels/reduce.h"

namespace collectives {

using kernels::CommError;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

bool mpi_built() { return true; }

namespace detail {
namespace {

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
    if (const int64_t seq = seq_.load(); seq >= 0) st_->mark_gave_up(static_cast<uint64_t>(seq));
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

  WorkPtr run_all_gather(const Tensor& input, const Tensor& output) {
    constexpr auto kind = CollectiveKind::kAllGather;
    const int count = static_cast<int>(input.numel());
    CallDesc d = desc(kind, output.dtype(), input.numel(), output.numel());
    const size_t item = kernels::itemsize(output.dtype());
    // MPI_IN_PLACE is valid only when every member passes it, so every member works in place:
    // its own slice of the output is filled first (nothing to do when the input is that slice;
    // otherwise the two are disjoint, NOTE [call contract]).
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep&) {
      char* slice = static_cast<char*>(output.data_ptr()) + static_cast<size_t>(rank()) * count * item;
      if (count > 0 && input.data_ptr() != slice) std::memcpy(slice, input.data_ptr(), count * item);
      post_request(reqs, "MPI_Iallgather", [&](MPI_Request* r) {
        return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, output.data_ptr(), count,
                              mpi_type(output.dtype()), st_->comm, r);
      });
    });
  }

  WorkPtr run_reduce_scatter(const Tensor& input, const Tensor& output, Reduction r) {
    const CallDesc d = desc(CollectiveKind::kReduceScatter, output.dtype(), input.numel(), output.numel(), r);
    const int count = static_cast<int>(output.numel()), n = size();
    const MPI_Op op = st_->world->op_for(output.dtype(), r.op);
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

  WorkPtr run_all_reduce(const Tensor& input, const Tensor& output, Reduction r) {
    const int count = static_cast<int>(output.numel()), n = size();
    const MPI_Op op = st_->world->op_for(output.dtype(), r.op);
    const CallDesc d = desc(CollectiveKind::kAllReduce, output.dtype(), input.numel(), output.numel(), r);
    // Out of place on every member (MPI_IN_PLACE must be passed by all or none, and OpenMPI's
    // nonblocking in-place all-reduce measured 1.1-1.5x slower): an input that is the output,
    // or needs a pre-multiplier, goes through a copy first.
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

  WorkPtr run_all_to_all(const Tensor& input, const Tensor& output) {
    constexpr auto kind = CollectiveKind::kAllToAll;
    const int count = static_cast<int>(input.numel() / size());
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

  WorkPtr run_all_to_all_v(const Tensor& input, std::span<const int64_t> send_counts,
                       const Tensor& output, std::span<const int64_t> recv_counts) {
    constexpr auto kind = CollectiveKind::kAllToAllV;
    // Counts and displacements as MPI's ints (check_backend made sure they fit).
    auto layout = [](std::span<const int64_t> counts) {
      std::vector<int> c(counts.size()), displs(counts.size());
      int64_t total = 0;
      for (size_t j = 0; j < counts.size(); ++j) {
        c[j] = static_cast<int>(counts[j]);
        displs[j] = static_cast<int>(total);
        total += counts[j];
      }
      return std::pair{std::move(c), std::move(displs)};
    };
    auto send_layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>(
        layout(send_counts));
    auto recv_layout = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>(
        layout(recv_counts));
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

  WorkPtr run_broadcast(const Tensor& buffer, int root) {
    constexpr auto kind = CollectiveKind::kBroadcast;
    const int count = static_cast<int>(buffer.numel());
    CallDesc d = desc(kind, buffer.dtype(), buffer.numel(), buffer.numel());
    d.root = root;
    return launch(d, {buffer}, [=, this](std::vector<MPI_Request>& reqs, Keep&) {
      post_request(reqs, "MPI_Ibcast", [&](MPI_Request* r) {
        return MPI_Ibcast(buffer.data_ptr(), count, mpi_type(buffer.dtype()), root, st_->comm, r);
      });
    });
  }

  WorkPtr run_scatter(const Tensor& input, const Tensor& output, int root) {
    constexpr auto kind = CollectiveKind::kScatter;
    const bool at_root = rank() == root;
    const int count = static_cast<int>(output.numel());
    CallDesc d = desc(kind, output.dtype(), at_root ? input.numel() : 0, output.numel());
    d.root = root;
    return launch(d, {input, output}, [=, this](std::vector<MPI_Request>& reqs, Keep&) {
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
          send = input.data_ptr();  // disjoint from the output (NOTE [call contract])
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

  WorkPtr run_barrier() {
    CallDesc d;
    d.kind = static_cast<int>(CollectiveKind::kBarrier);
    return launch(d, {}, [this](std::vector<MPI_Request>& reqs, Keep&) {
      post_request(reqs, "MPI_Ibarrier",
                   [&](MPI_Request* r) { return MPI_Ibarrier(st_->comm, r); });
    });
  }

  WorkPtr run_send_recv(std::span<const P2POp> ops) {
    constexpr auto kind = CollectiveKind::kSendRecv;
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
  // NOTE [call contract]: the mpi backend's own limits. CPU tensors only; MPI counts and
  // displacements are int.
  void check_backend(const Call& c) const override {
    auto cpu = [&](const Tensor& t) {
      if (t.defined() && !t.device().is_cpu())
        throw InvalidArgument(fmt::format(
            "{} on group '{}': the mpi backend moves CPU tensors; use the nccl backend for {}",
            to_string(c.kind), name(), kernels::to_string(t.device())));
    };
    auto fits = [&](int64_t n, const char* what) {
      if (n > INT_MAX)
        throw Unsupported(fmt::format(
            "{} on group '{}': {} has {} elements, over the mpi backend's limit of {} per member "
            "(MPI counts are int); split the call",
            to_string(c.kind), name(), what, n, INT_MAX));
    };
    cpu(c.input);
    cpu(c.output);
    for (const P2POp& op : c.ops) {
      cpu(op.buffer);
      fits(op.buffer.numel(), "a buffer");
    }
    switch (c.kind) {
      case CollectiveKind::kAllGather: fits(c.input.numel(), "the input"); break;
      case CollectiveKind::kAllToAll: fits(c.input.numel() / size(), "a member's slice"); break;
      case CollectiveKind::kAllToAllV:
        for (auto [counts, what] : {std::pair{c.send_counts, "send"}, std::pair{c.recv_counts, "receive"}}) {
          int64_t total = 0;
          for (size_t j = 0; j < counts.size(); ++j) {
            if (counts[j] > INT_MAX || total > INT_MAX)
              throw Unsupported(fmt::format(
                  "all_to_all_v on group '{}': {} count {} (or the offset {} of member {}) exceeds "
                  "the mpi backend's limit of {} elements (MPI counts and displacements are int); "
                  "split the exchange",
                  name(), what, counts[j], total, j, INT_MAX));
            total += counts[j];
          }
        }
        break;
      case CollectiveKind::kBroadcast: fits(c.output.numel(), "the buffer"); break;
      case CollectiveKind::kBarrier:
      case CollectiveKind::kSendRecv: break;
      default: fits(c.output.numel(), "the output"); break;
    }
  }

  WorkPtr issue(const Call& c) override {
    switch (c.kind) {
      case CollectiveKind::kAllGather: return run_all_gather(c.input, c.output);
      case CollectiveKind::kReduceScatter: return run_reduce_scatter(c.input, c.output, c.reduction);
      case CollectiveKind::kAllReduce: return run_all_reduce(c.input, c.output, c.reduction);
      case CollectiveKind::kAllToAll: return run_all_to_all(c.input, c.output);
      case CollectiveKind::kAllToAllV: return run_all_to_all_v(c.input, c.send_counts, c.output, c.recv_counts);
      case CollectiveKind::kBroadcast: return run_broadcast(c.output, c.root);
      case CollectiveKind::kScatter: return run_scatter(c.input, c.output, c.root);
      case CollectiveKind::kBarrier: return run_barrier();
      case CollectiveKind::kSendRecv: return run_send_recv(c.ops);
    }
    throw kernels::InternalError("mpi backend: unknown collective kind");
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
  auto child = std::make_unique<MpiCommunicator>(std::move(st), timeout(), check_calls_);
  child->set_tracer(tracer());
  return child;
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
