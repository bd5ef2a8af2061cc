#include "collectives/local.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>
#include <utility>

#include "collectives/call_queue.h"
#include "kernels/error.h"
#include "kernels/reduce.h"

namespace collectives {

using kernels::CommError;
using kernels::DType;
using kernels::InvalidArgument;

namespace detail {

class LocalGroup;

// Shared by every rank of one LocalWorld. Each group has its own lock and condition variable;
// the world keeps a list of its groups so that aborting it, or a rank returning, wakes every waiter.
class LocalWorldState {
 public:
  LocalWorldState(int size_, Milliseconds timeout_)
      : size(size_), timeout(timeout_), exited(std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(size_))) {}
  const int size;
  const Milliseconds timeout;
  std::atomic<bool> aborted{false};
  std::unique_ptr<std::atomic<bool>[]> exited;  // by world rank: its run_ranks function returned

  std::mutex mu;  // guards the members below
  int aborted_rank = -1;
  std::string abort_reason;
  uint64_t next_group_id = 0;
  std::weak_ptr<LocalGroup> world_group;
  std::vector<std::weak_ptr<LocalGroup>> groups;
  // Wakes the workers of the world's communicators (NOTE [call queue]).
  const std::shared_ptr<WorkerTicker> ticker = std::make_shared<WorkerTicker>();
  const std::vector<int> cpus = thread_cpus();  // the CPUs of the thread that made the world

  // NOTE [worker cpus] Each rank's communicator workers run on their own share of the process's
  // CPUs: with n CPUs and `size` ranks, rank r gets the CPUs at positions r, r + size, ... of
  // the process's affinity mask (n >= size), or the one at r mod n (n < size: every CPU gets
  // the same number of workers, within one). Left to the scheduler, two ranks' workers, woken by
  // their callers' hand-offs while every CPU was busy, were queued on the same CPU and stayed
  // there while the other one went idle (a task that has just run is not pulled to an idle
  // CPU), so their copies ran one after the other: a transition in the background took 2x its
  // time alone (perf sched: a worker's start after a hand-off p90 128 us against p50 13 us),
  // and since each wake-up goes back to the CPU the worker last ran on, whole rows of
  // `dtensor-bench --overlap` were hit. With the shares (2 vCPUs, alternated, rows within
  // exposed 0.10): 2 ranks 9 / 9 / 9 -> 11 / 10 / 12 of 14, 4 ranks 19 / 20 / 22 -> 22 / 22 / 24
  // of 28; fsdp-bench, where the callers compute on every CPU: step unchanged (2 ranks, prefetch
  // 1: 159.0 against 162.0 ms, medians of 5; 4 ranks: 174.1 against 174.6 ms, medians of 4).
  // Callers are never pinned, and a world of one rank or a process with one CPU pins nothing.
  // The mpi backend does not do this: there it made fsdp-bench's step 2-5% slower with 4
  // processes on 2 vCPUs (measured in commit 10addfc).
  std::vector<int> worker_cpus(int world_rank) const { return cpu_share(cpus, world_rank, size); }

  // Wakes every waiter of every group (after aborted / exited changed).
  void wake_all();
  std::string abort_text() {
    std::lock_guard lk(mu);
    return fmt::format("rank {} failed: {}", aborted_rank, abort_reason);
  }
};

// One member's posted call.
struct PostedCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  DType dtype = DType::kF32;
  Tensor input, output;  // flat 1-D views
  Reduction reduction;
  int root = -1;
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<P2POp> ops;
  std::vector<int> split_group;  // group ranks of the parent
  std::string split_name;
  bool posted = false;
  // NOTE [eager small calls]: the input (send buffers) was copied into buffers the slot owns when
  // the call was posted, so the member may leave once it has read what it needs.
  bool eager = false;

  // "split" for a split (which travels as a barrier), else the collective's name.
  std::string_view name() const { return split_name.empty() ? to_string(kind) : "split"; }

  std::string describe() const {
    if (!split_name.empty())
      return fmt::format("split(group [{}], '{}')", fmt::join(split_group, ","), split_name);
    std::string what = fmt::format("{}(", to_string(kind));
    switch (kind) {
      case CollectiveKind::kBarrier: break;
      case CollectiveKind::kSendRecv: what += fmt::format("{} ops", ops.size()); break;
      default:
        if (split_name.empty())
          what += fmt::format("{}, {} -> {} elements", kernels::to_string(dtype),
                              input.defined() ? input.numel() : 0, output.numel());
    }
    if (kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kScatter)
      what += fmt::format(", root {}", root);
    if (kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce) {
      what += fmt::format(", {}", kernels::to_string(reduction.op));
      if (reduction.pre_multiplier != 1.0) what += fmt::format(" x {}", reduction.pre_multiplier);
    }
    return what + ")";
  }
};

struct Slot {
  std::vector<PostedCall> calls;  // by group rank
  // Written under the group's lock, also read without it by members spinning before they sleep.
  std::atomic<int> arrived{0};
  std::atomic<int> phase_done{0};  // members past the read phase
  std::vector<char> read_done;  // by group rank
  int left = 0;        // members that finished
  bool checked = false;
  std::string mismatch;
  std::vector<Tensor> partial;               // all_reduce: member i's reduced chunk
  std::shared_ptr<LocalGroup> split_result;  // unused by non-split calls
  std::vector<std::shared_ptr<LocalGroup>> split_groups;
  std::vector<int> gave_up;  // global ranks whose waiter gave the call up after posting it
  std::string gave_up_why;   // the first of their reasons

  // Back to a fresh slot of the same group size, keeping the vectors' storage.
  void reset() {
    for (PostedCall& c : calls) c = PostedCall{};
    arrived.store(0);
    phase_done.store(0);
    std::fill(read_done.begin(), read_done.end(), 0);
    left = 0;
    checked = false;
    mismatch.clear();
    partial.clear();
    split_result.reset();
    split_groups.clear();
    gave_up.clear();
    gave_up_why.clear();
  }
};

class LocalGroup {
 public:
  LocalGroup(std::shared_ptr<LocalWorldState> world_, std::vector<int> ranks_, std::string name_, uint64_t id_)
      : world(std::move(world_)), ranks(std::move(ranks_)), name(std::move(name_)), id(id_) {}
  const std::shared_ptr<LocalWorldState> world;
  const std::vector<int> ranks;  // global ranks in group order
  const std::string name;
  const uint64_t id;
  std::mutex mu;                   // guards slots and the Slot contents
  std::condition_variable cv;      // a slot changed phase, or the world changed (abort, exit)
  std::map<uint64_t, Slot> slots;
  // Slots of finished calls, kept for the next ones: a slot is made by the first member to post
  // and retired by the last one out, so allocating and freeing them would free on one member's
  // thread what another's allocated, every call (malloc arena lock contention among the ranks).
  std::vector<std::map<uint64_t, Slot>::node_type> spare;

  // The slot of call seq, made (or recycled) when absent. REQUIRES: mu held.
  Slot& slot(uint64_t seq) {
    const auto it = slots.find(seq);
    if (it != slots.end()) return it->second;
    if (spare.empty()) return slots[seq];
    std::map<uint64_t, Slot>::node_type node = std::move(spare.back());
    spare.pop_back();
    node.key() = seq;
    return slots.insert(std::move(node)).position->second;
  }
  // Call seq is over for every member. REQUIRES: mu held.
  void retire(uint64_t seq) {
    std::map<uint64_t, Slot>::node_type node = slots.extract(seq);
    if (spare.size() >= 4) return;
    node.mapped().reset();
    spare.push_back(std::move(node));
  }
  // all_reduce scratch per member, reused across calls (each member touches only its own entry;
  // a previous call's readers still hold a reference, so reuse waits until they let go).
  std::vector<Tensor> scratch = std::vector<Tensor>(ranks.size());
};

std::shared_ptr<LocalGroup> make_group(const std::shared_ptr<LocalWorldState>& world, std::vector<int> ranks,
                                       std::string name) {
  std::lock_guard lk(world->mu);
  auto g = std::make_shared<LocalGroup>(world, std::move(ranks), std::move(name), world->next_group_id++);
  std::erase_if(world->groups, [](const std::weak_ptr<LocalGroup>& w) { return w.expired(); });
  world->groups.push_back(g);
  return g;
}

void LocalWorldState::wake_all() {
  std::vector<std::shared_ptr<LocalGroup>> live;
  {
    std::lock_guard lk(mu);
    for (const auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (const auto& g : live) {
    std::lock_guard lk(g->mu);  // a waiter between its check and its sleep still sees the change
    g->cv.notify_all();
  }
}

std::string group_text(const LocalGroup& g) { return fmt::format("group '{}' [{}]", g.name, fmt::join(g.ranks, ",")); }

// One member's view of a group: what its calls share.
struct LocalMember {
  LocalMember(std::shared_ptr<LocalGroup> g, int r) : group(std::move(g)), rank(r) {}
  const std::shared_ptr<LocalGroup> group;
  const int rank;
  uint64_t next_seq = 0;           // touched only by the queue's holder (one thread at a time)
  std::atomic<bool> closing{false};  // the communicator is being destroyed
  // NOTE [eager small calls]: the copies of this member's small inputs, reused once no slot
  // holds them any more (the holder's thread only; the last member out of a slot drops its
  // reference, so a buffer is never freed on another thread).
  std::vector<Tensor> stage_pool;
  static constexpr size_t kStagePool = 8;
  // A flat buffer of at least n elements of dtype that no slot holds.
  Tensor stage_buffer(kernels::DType dtype, int64_t n) {
    for (Tensor& t : stage_pool)
      if (t.storage().use_count() == 1 && t.dtype() == dtype && t.numel() >= n) {
        // use_count() is a relaxed load: order the last reader's accesses (before it dropped its
        // reference) before the copy about to overwrite the buffer.
        std::atomic_thread_fence(std::memory_order_acquire);
        return t.narrow(0, 0, n);
      }
    Tensor t = Tensor::empty({std::max<int64_t>(n, 64)}, dtype);
    if (stage_pool.size() < kStagePool) {
      stage_pool.push_back(t);
    } else {
      for (Tensor& old : stage_pool)
        if (old.storage().use_count() == 1) {
          old = t;
          break;
        }
    }
    return t.narrow(0, 0, n);
  }
};

namespace {

using Clock = std::chrono::steady_clock;

int64_t elems(const Tensor& t) { return t.defined() ? t.numel() : 0; }

// Takes a group's lock, trying for a short while before sleeping. Its critical sections last a
// few hundred ns, every member of a call takes it several times, and std::mutex goes to a futex
// sleep at the first contention: a sleep and a wake-up syscall cost microseconds (more with
// ranks as threads on fewer cores), more than a small collective itself.
std::unique_lock<std::mutex> lock_spinning(std::mutex& mu) {
  for (int i = 0; i < 64; ++i) {
    if (mu.try_lock()) return std::unique_lock<std::mutex>(mu, std::adopt_lock);
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  return std::unique_lock<std::mutex>(mu);
}
// lk.lock(), the same way. REQUIRES: lk does not own its mutex.
void relock(std::unique_lock<std::mutex>& lk) { lk = lock_spinning(*lk.mutex()); }

Tensor flat(const Tensor& t) { return t.defined() ? t.view({t.numel()}) : t; }

// dst[dst_off : dst_off+n] = src[src_off : src_off+n] (flat contiguous tensors, same dtype).
void copy_elems(const Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t n) {
  if (n == 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    const size_t item = kernels::itemsize(dst.dtype());
    std::memcpy(static_cast<char*>(dst.data_ptr()) + dst_off * item,
                static_cast<const char*>(src.data_ptr()) + src_off * item, n * item);
    return;
  }
  dst.narrow(0, dst_off, n).copy_(src.narrow(0, src_off, n));
}

// A matched receive <- send (same numel; views of one shape, or contiguous on one side).
void copy_p2p(Tensor dst, const Tensor& src) {
  if (dst.is_contiguous() && src.is_contiguous()) return copy_elems(dst, 0, src, 0, dst.numel());
  if (dst.shape() == src.shape()) return dst.copy_(src);
  if (dst.is_contiguous()) return dst.view(src.shape()).copy_(src);
  dst.copy_(src.reshape(dst.shape()));  // a view when src is contiguous
}

// Start and length of member r's chunk of n elements (torch.chunk rule).
std::pair<int64_t, int64_t> chunk_of(int64_t n, int64_t k, int64_t r) {
  const int64_t c = (n + k - 1) / k;
  const int64_t begin = std::min(n, r * c), end = std::min(n, (r + 1) * c);
  return {begin, end - begin};
}

std::string check_calls(const std::vector<PostedCall>& calls, const LocalGroup& g) {
  const int n = static_cast<int>(calls.size());
  const PostedCall& c0 = calls[0];
  auto differ = [&](int i, const char* what) {
    return fmt::format("collective mismatch on group '{}' ({}): rank {} called {} but rank {} "
                       "called {}",
                       g.name, what, g.ranks[0], c0.describe(), g.ranks[i], calls[i].describe());
  };
  for (int i = 1; i < n; ++i) {
    const PostedCall& c = calls[i];
    if (c.kind != c0.kind || c.split_name.empty() != c0.split_name.empty())
      return differ(i, "different collectives");
    if (c.kind == CollectiveKind::kBarrier || c.kind == CollectiveKind::kSendRecv) continue;
    if (!c.split_name.empty() || !c0.split_name.empty()) continue;
    if (c.dtype != c0.dtype) return differ(i, "different dtypes");
    if (c.root != c0.root) return differ(i, "different roots");
    if (c.reduction.op != c0.reduction.op || c.reduction.pre_multiplier != c0.reduction.pre_multiplier)
      return differ(i, "different reductions");
    switch (c.kind) {
      case CollectiveKind::kAllGather:
      case CollectiveKind::kReduceScatter:
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kAllToAll:
        if (elems(c.input) != elems(c0.input)) return differ(i, "different counts");
        break;
      case CollectiveKind::kBroadcast:
      case CollectiveKind::kScatter:
        if (elems(c.output) != elems(c0.output)) return differ(i, "different counts");
        break;
      default: break;
    }
  }
  if (c0.kind == CollectiveKind::kScatter && elems(calls[c0.root].input) != n * elems(c0.output))
    return fmt::format("scatter on group '{}': root {} has {} input elements for {} x {}", g.name,
                       g.ranks[c0.root], elems(calls[c0.root].input), n, elems(c0.output));
  if (c0.kind == CollectiveKind::kAllToAllV) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j)
        if (calls[i].send_counts[j] != calls[j].recv_counts[i])
          return fmt::format(
              "all_to_all_v count mismatch on group '{}': rank {} sends {} elements to rank {}, "
              "which expects {}",
              g.name, g.ranks[i], calls[i].send_counts[j], g.ranks[j], calls[j].recv_counts[i]);
  }
  if (c0.kind == CollectiveKind::kSendRecv) {
    // Per ordered pair (i -> j): the k-th send matches the k-th receive, same numel, dtype and
    // device kind. One pass over the ops (this runs under the world lock on every exchange).
    struct End {
      int from, to, k;
      const Tensor* buffer;
      bool operator<(const End& o) const { return std::tie(from, to, k) < std::tie(o.from, o.to, o.k); }
    };
    std::vector<End> sends, recvs;
    std::vector<int> n_send(static_cast<size_t>(n) * n, 0), n_recv(static_cast<size_t>(n) * n, 0);
    for (int i = 0; i < n; ++i)
      for (const P2POp& op : calls[i].ops) {
        if (op.kind == P2POp::Kind::kSend) sends.push_back({i, op.peer, n_send[i * n + op.peer]++, &op.buffer});
        else recvs.push_back({op.peer, i, n_recv[op.peer * n + i]++, &op.buffer});
      }
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j)
        if (n_send[i * n + j] != n_recv[i * n + j])
          return fmt::format("send_recv mismatch on group '{}': rank {} posts {} sends to rank {}, "
                             "which posts {} receives from it",
                             g.name, g.ranks[i], n_send[i * n + j], g.ranks[j], n_recv[i * n + j]);
    std::sort(sends.begin(), sends.end());
    std::sort(recvs.begin(), recvs.end());
    for (size_t e = 0; e < sends.size(); ++e) {
      const Tensor& a = *sends[e].buffer;
      const Tensor& b = *recvs[e].buffer;
      if (a.numel() != b.numel() || a.dtype() != b.dtype() || a.device().type != b.device().type)
        return fmt::format(
            "send_recv mismatch on group '{}': send #{} from rank {} to rank {} has {} {} "
            "elements, the receive has {} {}",
            g.name, sends[e].k, g.ranks[sends[e].from], g.ranks[sends[e].to], a.numel(),
            kernels::to_string(a.dtype()), b.numel(), kernels::to_string(b.dtype()));
    }
  }
  if (!c0.split_name.empty()) {
    for (int i = 0; i < n; ++i) {
      const auto& gi = calls[i].split_group;
      if (std::find(gi.begin(), gi.end(), i) == gi.end())
        return fmt::format("split of group '{}': rank {} passed group [{}], which does not contain it",
                           g.name, g.ranks[i], fmt::join(gi, ","));
      for (int m : gi)
        if (m < 0 || m >= n || calls[m].split_group != gi)
          return fmt::format("split of group '{}': rank {} passed group [{}] but member {} passed [{}]",
                             g.name, g.ranks[i], fmt::join(gi, ","), m,
                             m >= 0 && m < n ? fmt::format("{}", fmt::join(calls[m].split_group, ","))
                                             : std::string("nothing (out of range)"));
    }
  }
  return {};
}

// One call of a member (NOTE [local rendezvous]) as an entry of its communicator's queue.
class LocalCall final : public QueuedCall {
 public:
  LocalCall(std::shared_ptr<LocalMember> member, PostedCall call)
      : m_(std::move(member)), g_(m_->group), rank_(m_->rank), name_(call.name()), call_(std::move(call)) {}

  void start() override {
    const size_t n = g_->ranks.size();
    stage_eagerly(call_, *m_, static_cast<int>(n));  // before the lock: the copy needs no one else
    const std::unique_lock lk = lock_spinning(g_->mu);
    const uint64_t seq = m_->next_seq++;
    Slot& slot = g_->slot(seq);
    if (slot.calls.empty()) {
      slot.calls.resize(n);
      slot.read_done.resize(n);
    }
    call_.posted = true;
    slot.calls[rank_] = std::move(call_);
    seq_.store(static_cast<int64_t>(seq));
    if (++slot.arrived == static_cast<int>(n)) g_->cv.notify_all();
  }

  // The two phases of NOTE [local rendezvous]; resumable: stops (returning false) where it would
  // have to wait past `until`, and the next call continues from there.
  bool advance(Clock::time_point until) override {
    const int n = static_cast<int>(g_->ranks.size());
    const uint64_t seq = static_cast<uint64_t>(seq_.load());
    std::unique_lock lk = lock_spinning(g_->mu);
    Slot& slot = g_->slots.at(seq);
    if (!read_done_) {
      if (!reach(lk, slot, [&] { return slot.arrived.load() == n; }, true, until)) return false;
      if (!slot.checked) {
        slot.mismatch = check_calls(slot.calls, *g_);
        slot.checked = true;
      }
      if (!slot.mismatch.empty()) throw CommError(slot.mismatch);
      const PostedCall& call = slot.calls[rank_];
      if (!call.split_name.empty()) {
        make_split_group(slot);
        split_result_ = slot.split_groups[rank_];
      }
      lk.unlock();

      staged_ = read_phase(slot);  // reads other members' buffers

      relock(lk);
      slot.read_done[rank_] = 1;
      read_done_ = true;
      if (++slot.phase_done == n) g_->cv.notify_all();  // only the last one can satisfy a waiter
      // NOTE [eager small calls]: nobody reads this member's buffers any more and it has its
      // result: it leaves without waiting for the others' reads (one rendezvous per call).
      if (leaves_early(slot)) {
        std::vector<Tensor> drop = leave(slot, seq);
        lk.unlock();
        return true;
      }
    }
    if (!reach(lk, slot, [&] { return slot.phase_done.load() == n; }, false, until)) return false;
    lk.unlock();

    write_phase(slot, staged_);  // only touches this rank's output and slot-owned partials
    staged_ = Tensor();

    relock(lk);
    std::vector<Tensor> drop = leave(slot, seq);
    lk.unlock();
    return true;
  }

  // A waiter gave the posted call up: the members still waiting for this rank fail at once.
  void abandon(const std::string& why) override {
    const int64_t seq = seq_.load();
    if (seq < 0) return;
    std::lock_guard lk(g_->mu);
    const auto it = g_->slots.find(static_cast<uint64_t>(seq));
    if (it == g_->slots.end()) return;
    Slot& slot = it->second;
    if (slot.gave_up.empty()) slot.gave_up_why = why;
    slot.gave_up.push_back(g_->ranks[rank_]);
    g_->cv.notify_all();
  }

  std::string pending_text() override {
    const int64_t seq = seq_.load();
    std::lock_guard lk(g_->mu);
    const auto it = seq < 0 ? g_->slots.end() : g_->slots.find(static_cast<uint64_t>(seq));
    if (it == g_->slots.end()) return seq < 0 ? "it is being posted" : "it has just completed";
    const Slot& slot = it->second;
    const int n = static_cast<int>(g_->ranks.size());
    std::vector<int> missing, gone;
    if (slot.arrived < n) {
      for (int i = 0; i < n; ++i)
        if (!slot.calls[i].posted) {
          missing.push_back(g_->ranks[i]);
          if (g_->world->exited[g_->ranks[i]].load()) gone.push_back(g_->ranks[i]);
        }
      if (!gone.empty()) return fmt::format("ranks [{}] returned without joining it", fmt::join(gone, ","));
      return fmt::format("ranks [{}] never joined", fmt::join(missing, ","));
    }
    for (int i = 0; i < n; ++i)
      if (!slot.read_done[i]) missing.push_back(g_->ranks[i]);
    // The last read can end between the waiter's deadline and this look: nobody holds it up.
    if (missing.empty()) return "every member has done its part (it was completing as the wait ran out)";
    return fmt::format("ranks [{}] joined but have not completed it (their earlier calls on the group, or "
                       "calls this one waits for, hold them up)",
                       fmt::join(missing, ","));
  }

  std::string describe() const override {
    const int64_t seq = seq_.load();
    return seq < 0 ? fmt::format("{} on {}", name_, group_text(*g_))
                   : fmt::format("{} on {} (call #{})", name_, group_text(*g_), seq);
  }

  std::shared_ptr<LocalGroup> split_result() const { return split_result_; }

 private:
  // Waits until pred() holds or `until` (true when it holds). Throws CommError when the world was
  // aborted, or, while joining, when a member that has not posted returned from run_ranks.
  template <class Pred>
  bool reach(std::unique_lock<std::mutex>& lk, Slot& slot, Pred pred, bool joining, Clock::time_point until) {
    LocalWorldState& w = *g_->world;
    auto member_gone = [&] {
      if (!joining) return false;
      for (size_t i = 0; i < slot.calls.size(); ++i)
        if (!slot.calls[i].posted && w.exited[g_->ranks[i]].load()) return true;
      return false;
    };
    auto stop = [&] { return w.aborted.load() || member_gone() || m_->closing.load() || !slot.gave_up.empty(); };
    if (!pred() && !stop() && Clock::now() < until) {
      // Yield a few times before sleeping: with more ranks than cores the member being waited
      // for usually needs this core, and a condition-variable sleep costs far more than a yield.
      // The spin reads only atomics, without the group's lock: members re-taking the lock after
      // every yield made it the hottest lock of a small call (futex sleeps and wake-ups).
      lk.unlock();
      for (int spin = 0; spin < 64; ++spin) {
        std::this_thread::yield();
        if (pred() || w.aborted.load(std::memory_order_relaxed) || m_->closing.load(std::memory_order_relaxed)) break;
      }
      relock(lk);
      g_->cv.wait_until(lk, until, [&] { return pred() || stop(); });
    }
    if (pred()) return true;
    if (w.aborted.load()) {
      lk.unlock();
      throw CommError(fmt::format("{} on group '{}' abandoned: {}", name_, g_->name, w.abort_text()));
    }
    if (!slot.gave_up.empty())
      throw CommError(fmt::format("{} on {} (call #{}): ranks [{}] gave the call up: {}", name_, group_text(*g_), seq_.load(),
                                  fmt::join(slot.gave_up, ","), slot.gave_up_why));
    if (member_gone()) {
      std::vector<int> gone;
      for (size_t i = 0; i < slot.calls.size(); ++i)
        if (!slot.calls[i].posted && w.exited[g_->ranks[i]].load()) gone.push_back(g_->ranks[i]);
      throw CommError(fmt::format("{} on {} (call #{}): ranks [{}] returned without joining it", name_, group_text(*g_),
                                  seq_.load(), fmt::join(gone, ",")));
    }
    return false;
  }

  // Builds (once per group) the sub-group objects of a split.
  void make_split_group(Slot& slot) {
    if (!slot.split_groups.empty()) return;
    const int n = static_cast<int>(slot.calls.size());
    slot.split_groups.resize(n);
    for (int i = 0; i < n; ++i) {
      if (slot.split_groups[i]) continue;
      std::vector<int> global;
      for (int m : slot.calls[i].split_group) global.push_back(g_->ranks[m]);
      auto g = make_group(g_->world, global, slot.calls[i].split_name);
      for (int m : slot.calls[i].split_group) slot.split_groups[m] = g;
    }
  }

  // Reads from the other members; returns data to write into this rank's output later when the
  // output may alias a buffer the others are still reading.
  Tensor read_phase(Slot& slot) {
    const int n = static_cast<int>(slot.calls.size());
    const int r = rank_;
    const PostedCall& me = slot.calls[r];
    switch (me.kind) {
      case CollectiveKind::kAllGather: {
        const int64_t cnt = me.input.numel();
        for (int i = 0; i < n; ++i)
          if (i != r || !overlaps(me.output, me.input)) copy_elems(me.output, i * cnt, slot.calls[i].input, 0, cnt);
        return {};
      }
      case CollectiveKind::kReduceScatter: {
        const int64_t cnt = me.output.numel();
        Tensor acc = overlaps(me.output, me.input) ? Tensor::empty({cnt}, me.dtype, me.output.device()) : me.output;
        reduce_chunk(slot, acc, r * cnt, cnt);
        return acc.shares_storage_with(me.output) ? Tensor() : acc;
      }
      case CollectiveKind::kAllReduce: {
        if (all_eager(slot)) {
          // Every input is a copy the slot owns: reduce all of it straight into the output (n x
          // the reads of a chunk, no second rendezvous to share the chunks).
          reduce_chunk(slot, me.output, 0, me.output.numel());
          return {};
        }
        auto [begin, len] = chunk_of(me.input.numel(), n, r);
        Tensor& cache = g_->scratch[r];
        if (!cache.defined() || cache.storage().use_count() > 1 || cache.numel() < len ||
            cache.dtype() != me.dtype || !(cache.device() == me.output.device()))
          cache = Tensor::empty({std::max<int64_t>(len, 1)}, me.dtype, me.output.device());
        Tensor acc = cache.narrow(0, 0, len);
        reduce_chunk(slot, acc, begin, len);
        std::lock_guard lk(g_->mu);
        if (slot.partial.empty()) slot.partial.resize(n);
        slot.partial[r] = acc;
        return {};
      }
      case CollectiveKind::kAllToAll:
      case CollectiveKind::kAllToAllV: {
        const bool v = me.kind == CollectiveKind::kAllToAllV;
        const int64_t cnt = v ? 0 : me.input.numel() / n;
        Tensor dst = overlaps(me.output, me.input)
                         ? Tensor::empty({me.output.numel()}, me.dtype, me.output.device())
                         : me.output;
        int64_t recv_off = 0;
        for (int i = 0; i < n; ++i) {
          const PostedCall& src = slot.calls[i];
          const int64_t send_off =
              v ? std::accumulate(src.send_counts.begin(), src.send_counts.begin() + r, int64_t{0})
                : r * cnt;
          const int64_t len = v ? me.recv_counts[i] : cnt;
          copy_elems(dst, recv_off, src.input, send_off, len);
          recv_off += len;
        }
        return dst.shares_storage_with(me.output) ? Tensor() : dst;
      }
      case CollectiveKind::kBroadcast:
        if (r != me.root) copy_elems(me.output, 0, slot.calls[me.root].input, 0, me.output.numel());
        return {};
      case CollectiveKind::kScatter: {
        const int64_t cnt = me.output.numel();
        // In place at the root (output = its slice of the input): nothing to move.
        if (r != me.root || !overlaps(me.output, me.input))
          copy_elems(me.output, 0, slot.calls[me.root].input, r * cnt, cnt);
        return {};
      }
      case CollectiveKind::kSendRecv: {
        // The k-th receive from p takes the k-th send from p to r.
        std::vector<int> taken(n, 0);
        for (const P2POp& op : me.ops) {
          if (op.kind != P2POp::Kind::kRecv) continue;
          int k = taken[op.peer]++;
          for (const P2POp& s : slot.calls[op.peer].ops)
            if (s.kind == P2POp::Kind::kSend && s.peer == r && k-- == 0) {
              copy_p2p(op.buffer, s.buffer);
              break;
            }
        }
        return {};
      }
      case CollectiveKind::kBarrier: return {};
    }
    return {};
  }

  // This member is done with the slot: the last one out erases it. The references the slot holds
  // to this member's own buffers (nobody reads them any more) are returned, to be dropped by the
  // caller after it lets go of the lock: the last reference to a result may be among them, and
  // freeing it belongs on this member's thread, not on whichever member happens to leave last
  // (a cross-thread free takes the owner's allocator lock and malloc arena lock, under the group
  // lock: the futex storms of the 2-rank host cost). REQUIRES: the group's lock held.
  std::vector<Tensor> leave(Slot& slot, uint64_t seq) {
    std::vector<Tensor> drop;
    PostedCall& me = slot.calls[rank_];
    drop.push_back(std::move(me.output));
    if (!me.eager) drop.push_back(std::move(me.input));  // an eager input is a copy others may still read
    for (P2POp& op : me.ops)
      if (!me.eager || op.kind == P2POp::Kind::kRecv) drop.push_back(std::move(op.buffer));
    if (++slot.left == static_cast<int>(slot.calls.size())) g_->retire(seq);
    return drop;
  }

  // After its read phase: whether this member is done (its result is written, and the others
  // read only copies the slot owns).
  bool leaves_early(const Slot& slot) const {
    const PostedCall& me = slot.calls[rank_];
    return me.eager && !staged_.defined() && (me.kind != CollectiveKind::kAllReduce || all_eager(slot));
  }
  static bool all_eager(const Slot& slot) {
    return std::all_of(slot.calls.begin(), slot.calls.end(), [](const PostedCall& c) { return c.eager; });
  }

  // NOTE [eager small calls] Below kEagerBytes a rendezvous costs far more than copying the
  // input: with more ranks than cores each one is a round of context switches. So a small call
  // copies what the others read from this member (its input, the root's buffer, its send
  // buffers) into tensors the slot owns when it is posted; the member then leaves as soon as it
  // has read what it needs, instead of waiting until every other member has read its buffers.
  // An all_reduce then reduces the whole buffer on every member (no exchange of reduced chunks).
  // Members decide for themselves (the flag travels with the call), so a mix is still correct:
  // a member that did not copy waits for the others' reads as before.
  static constexpr int64_t kEagerBytes = 8 << 10;
  static void stage_eagerly(PostedCall& c, LocalMember& m, int n) {
    const int rank = m.rank;
    if (!c.split_name.empty()) return;  // a split builds groups in the rendezvous: keep it plain
    auto on_cpu = [](const Tensor& t) { return !t.defined() || t.device().is_cpu(); };
    auto bytes = [](const Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(kernels::itemsize(t.dtype())) : 0; };
    auto copy_of = [&m](const Tensor& t) {
      Tensor s = m.stage_buffer(t.dtype(), t.numel());
      if (t.is_contiguous()) {
        copy_elems(s, 0, flat(t), 0, t.numel());
        return t.ndim() == 1 ? s : s.view(t.shape());
      }
      s = s.view(t.shape());
      s.copy_(t);
      return s;
    };
    switch (c.kind) {
      case CollectiveKind::kBarrier: c.eager = true; return;
      case CollectiveKind::kSendRecv: {
        int64_t total = 0;
        for (const P2POp& op : c.ops) {
          if (!on_cpu(op.buffer)) return;
          if (op.kind == P2POp::Kind::kSend) total += bytes(op.buffer);
        }
        if (total > kEagerBytes) return;
        for (P2POp& op : c.ops)
          if (op.kind == P2POp::Kind::kSend) op.buffer = copy_of(op.buffer);
        c.eager = true;
        return;
      }
      case CollectiveKind::kAllReduce:
        if (bytes(c.input) * n > 8 * kEagerBytes) return;  // every member reduces all of it
        break;
      default: break;
    }
    if (!on_cpu(c.input) || !on_cpu(c.output) || bytes(c.input) > kEagerBytes) return;
    // Nobody reads a broadcast non-root's buffer (its input is its output): nothing to copy.
    const bool read_by_others = c.input.defined() && (c.kind != CollectiveKind::kBroadcast || c.root == rank);
    if (read_by_others) c.input = copy_of(c.input);
    c.eager = true;
  }

  // acc = reduction over members of input[begin, begin+len), in group order.
  void reduce_chunk(const Slot& slot, const Tensor& acc, int64_t begin, int64_t len) {
    const PostedCall& me = slot.calls[rank_];
    const int n = static_cast<int>(slot.calls.size());
    const Reduction red = me.reduction;
    copy_elems(acc, 0, slot.calls[0].input, begin, len);
    if (red.pre_multiplier != 1.0) kernels::scale_(acc, red.pre_multiplier);
    for (int i = 1; i < n; ++i)
      kernels::reduce_into(acc, slot.calls[i].input.narrow(0, begin, len), red.op, red.pre_multiplier);
    if (red.op == ReduceOp::kAvg) kernels::scale_(acc, 1.0 / n);
  }

  void write_phase(Slot& slot, const Tensor& staged) {
    const PostedCall& me = slot.calls[rank_];
    if (staged.defined()) copy_elems(me.output, 0, staged, 0, me.output.numel());
    if (me.kind == CollectiveKind::kAllReduce && !all_eager(slot)) {
      const int n = static_cast<int>(slot.calls.size());
      for (int i = 0; i < n; ++i) {
        auto [begin, len] = chunk_of(me.output.numel(), n, i);
        copy_elems(me.output, begin, slot.partial[i], 0, len);
      }
    }
  }

  const std::shared_ptr<LocalMember> m_;
  const std::shared_ptr<LocalGroup> g_;
  const int rank_;
  const std::string name_;
  PostedCall call_;                 // moved into the slot by start()
  std::atomic<int64_t> seq_{-1};    // the slot, once posted
  bool read_done_ = false;          // this rank's read phase is over
  Tensor staged_;                   // what read_phase() left for write_phase()
  std::shared_ptr<LocalGroup> split_result_;
};

}  // namespace

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank, Milliseconds timeout)
      : Communicator(rank, group->ranks, group->name, timeout),
        member_(std::make_shared<LocalMember>(std::move(group), rank)),
        queue_(std::make_shared<CallQueue>(CallQueue::Options{
            .ticker = member_->group->world->ticker,
            .worker_cpus = member_->group->world->worker_cpus(member_->group->ranks[static_cast<size_t>(rank)])})) {}
  ~LocalCommunicator() override;
  LocalCommunicator(const LocalCommunicator&) = delete;
  LocalCommunicator& operator=(const LocalCommunicator&) = delete;

  std::string_view backend() const override { return "local"; }

  // The receiver copies straight from the sender's view: no packing on either side.
  bool p2p_views() const override { return true; }

  void wait_for(const WorkPtr& work) override { queue_->add_dependency(work); }
  void kick() override { queue_->kick(); }
  WorkPtr host_task(std::function<void()> fn) override {
    if (batching_)
      throw InvalidArgument(fmt::format("host_task on group '{}': not allowed inside a batch", name()));
    if (!fn) throw InvalidArgument(fmt::format("host_task on group '{}': the function is empty", name()));
    return queue_->push(std::make_shared<HostTask>(std::move(fn), group_text(*member_->group)), timeout());
  }

  void begin_batch() override {
    if (batching_) throw InvalidArgument(fmt::format("begin_batch on group '{}': already in a batch", name()));
    batching_ = true;
  }
  WorkPtr end_batch() override;

  std::unique_ptr<Communicator> split(std::span<const int> group, std::string new_name) override;

 private:
  // NOTE [call contract]: `c` was validated; the rendezvous needs flat views (send_recv buffers
  // stay views).
  WorkPtr issue(const Call& c) override {
    PostedCall p;
    p.kind = c.kind;
    p.dtype = c.output.defined() ? c.output.dtype() : kernels::DType::kF32;
    p.input = flat(c.input);
    p.output = flat(c.output);
    p.reduction = c.reduction;
    p.root = c.root;
    p.send_counts.assign(c.send_counts.begin(), c.send_counts.end());
    p.recv_counts.assign(c.recv_counts.begin(), c.recv_counts.end());
    for (const P2POp& op : c.ops)
      p.ops.push_back({op.kind, op.buffer.is_contiguous() ? flat(op.buffer) : op.buffer, op.peer});
    return post(std::move(p));
  }
  WorkPtr post(PostedCall call) {
    WorkPtr work = queue_->push(std::make_shared<LocalCall>(member_, std::move(call)), timeout());
    if (batching_) batch_.push_back(work);
    return work;
  }

  std::shared_ptr<LocalMember> member_;
  std::shared_ptr<CallQueue> queue_;
  bool batching_ = false;
  std::vector<WorkPtr> batch_;
};

LocalCommunicator::~LocalCommunicator() {
  // Pending calls complete first (the peers expect this rank in them), bounded by the timeout,
  // unless the thread unwinds an exception (run_ranks then aborts the world) or the world failed.
  const bool unwinding = std::uncaught_exceptions() > 0;
  const bool drain = !unwinding && !member_->group->world->aborted.load();
  queue_->shutdown(drain, timeout(),
                   unwinding ? "abandoned: the communicator was destroyed while its thread unwound an exception"
                             : "abandoned: the communicator was destroyed",
                   [m = member_] {
                     m->closing.store(true);
                     std::lock_guard lk(m->group->mu);
                     m->group->cv.notify_all();
                   });
}

WorkPtr LocalCommunicator::end_batch() {
  if (!batching_) throw InvalidArgument(fmt::format("end_batch on group '{}': no batch begun", name()));
  batching_ = false;
  return std::make_shared<GroupWork>(std::exchange(batch_, {}));
}

std::unique_ptr<Communicator> LocalCommunicator::split(std::span<const int> group,
                                                       std::string new_name) {
  if (batching_) throw InvalidArgument(fmt::format("split on group '{}': not allowed inside a batch", name()));
  std::vector<int> sorted(group.begin(), group.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int m = sorted[i];
    if (m < 0 || m >= size() || (i > 0 && sorted[i - 1] == m))
      throw InvalidArgument(fmt::format(
          "split on group '{}': group [{}] {} member {} (expected distinct group ranks 0..{})",
          name(), fmt::join(group, ","), m < 0 || m >= size() ? "has out-of-range" : "repeats", m,
          size() - 1));
  }
  if (!std::binary_search(sorted.begin(), sorted.end(), rank()))
    throw InvalidArgument(fmt::format("split on group '{}': group [{}] does not contain this rank ({})",
                                      name(), fmt::join(group, ","), rank()));
  PostedCall c;
  c.kind = CollectiveKind::kBarrier;
  c.split_group.assign(group.begin(), group.end());
  c.split_name = new_name.empty() ? std::string("split") : std::move(new_name);
  auto call = std::make_shared<LocalCall>(member_, std::move(c));
  queue_->push(call, timeout())->wait(timeout());
  std::shared_ptr<LocalGroup> g = call->split_result();
  const auto it = std::find(g->ranks.begin(), g->ranks.end(), ranks()[rank()]);
  auto child = std::make_unique<LocalCommunicator>(g, static_cast<int>(it - g->ranks.begin()), timeout());
  child->set_tracer(tracer());
  return child;
}

}  // namespace detail

LocalWorld::LocalWorld(int size, Milliseconds timeout) {
  if (size < 1 || size > kMaxLocalRanks)
    throw InvalidArgument(fmt::format(
        "LocalWorld: size {} is outside 1..{} (the local backend runs one thread per rank, at most {})", size,
        kMaxLocalRanks, kMaxLocalRanks));
  state_ = std::make_shared<detail::LocalWorldState>(size, timeout);
}

LocalWorld::~LocalWorld() = default;

int LocalWorld::size() const { return state_->size; }

std::unique_ptr<Communicator> LocalWorld::communicator(int rank) {
  if (rank < 0 || rank >= state_->size)
    throw InvalidArgument(fmt::format("LocalWorld: rank {} out of range 0..{}", rank, state_->size - 1));
  std::shared_ptr<detail::LocalGroup> world;
  {
    std::lock_guard lk(state_->mu);
    world = state_->world_group.lock();
  }
  if (!world) {
    std::vector<int> ranks(state_->size);
    std::iota(ranks.begin(), ranks.end(), 0);
    auto made = detail::make_group(state_, ranks, "world");
    std::lock_guard lk(state_->mu);
    world = state_->world_group.lock();
    if (!world) state_->world_group = world = made;
  }
  return std::make_unique<detail::LocalCommunicator>(world, rank, state_->timeout);
}

void LocalWorld::mark_returned(int rank) {
  state_->exited[rank].store(true);
  state_->wake_all();
}

void LocalWorld::abort(int rank, const std::string& reason) {
  {
    std::lock_guard lk(state_->mu);
    if (!state_->aborted.load()) {
      state_->aborted_rank = rank;
      state_->abort_reason = reason;
      state_->aborted.store(true);
    }
  }
  state_->wake_all();
}

void run_ranks(int size, const std::function<void(Communicator& world)>& fn, Milliseconds timeout) {
  LocalWorld world(size, timeout);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        {
          // The communicator completes its pending calls when destroyed: before this rank is
          // recorded as returned (after which peers stop waiting for its calls).
          std::unique_ptr<Communicator> comm = world.communicator(r);
          fn(*comm);
        }
        world.mark_returned(r);
      } catch (...) {
        std::string what = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        {
          std::lock_guard lk(mu);
          if (!first) first = std::current_exception();
        }
        world.abort(r, what);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace collectives
