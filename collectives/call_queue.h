// Internal to the CPU backends (local, mpi): the in-order queue of a communicator behind
// NOTE [in-order engine] in collectives/communicator.h. Not part of the public interface.
//
//   auto queue = std::make_shared<CallQueue>(CallQueue::Options{});
//   WorkPtr w = queue->push(std::make_shared<MyCall>(...), timeout);  // started at once if it can be
//   w->wait(timeout);                                                 // runs the queue itself
//
// NOTE [call queue] A communicator owns one CallQueue; its entries (QueuedCall) are collective
// calls, host tasks and splits, in call order. At most one thread at a time progresses a queue
// (the holder): the queue's worker thread, or a thread waiting on one of its Works. So a caller
// that waits right away runs its calls itself with no thread hand-off, and calls nobody waits on
// complete anyway. The holder
//  - starts entries strictly in queue order: an entry starts once every earlier entry has
//    started and its dependencies (wait_for) have finished; a host task also waits until every
//    earlier entry has finished;
//  - advances the first unfinished entry (the head) until it completes or fails; later entries
//    complete after it, so calls complete in call order.
// The worker is not woken by a push (a wake-up per call would cost more than a small collective):
// a WorkerTicker (one per world) wakes the worker of a queue whose unfinished calls nobody has
// progressed for ~100 us. So a caller that waits at once runs its calls itself with no thread
// hand-off, and a call nobody waits on starts moving within ~0.1-0.2 ms (~1 ms for the first one
// after a quiet spell). Backend hooks (start, advance) run without the queue's lock,
// and the lock is never held while calling into another queue (dependencies are checked without
// it), so two queues never wait for each other's locks; dependencies point to earlier calls, so
// holders never wait in a cycle either.
// A waiter that runs out of time gives its call up: the call fails with the backend's
// pending_text() (which members never joined), or, for a call that never started, with what it
// waited for, and the queue skips it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"

namespace collectives::detail {

using Clock = std::chrono::steady_clock;

class CallQueue;

// One entry of a CallQueue. Backends derive from it.
class QueuedCall {
 public:
  virtual ~QueuedCall() = default;
  // Issues the call (local: posts its buffers to the group; mpi: the MPI_I* calls). Called once,
  // by the holder, without the queue's lock. Throws on failure (the call fails).
  virtual void start() = 0;
  // Advances the started call; true once it is complete. May block until `until` (a time in the
  // past: never blocks). Throws on failure (the call fails, the queue goes on).
  virtual bool advance(Clock::time_point until) = 0;
  // Where the started call stands, for a timeout: "ranks [3] never joined".
  virtual std::string pending_text() = 0;
  // A waiter gave the started call up with `why` (mpi: the communicator is poisoned).
  virtual void abandon(const std::string& why) { (void)why; }
  // "all_gather on group 'world' [0,1] (call #3)".
  virtual std::string describe() const = 0;
  // Host tasks start only once every earlier entry has finished.
  virtual bool is_host_task() const { return false; }
  // Whether push() may start the call on the caller's thread: only when start() moves no data
  // (local: it only posts the buffers), so a caller overlapping the call with its own work does
  // none of it (MPI's nonblocking collectives may copy or reduce while they are started).
  virtual bool cheap_start() const { return true; }
  // Completed or failed (no lock needed).
  bool has_finished() const { return finished_.load(); }

 private:
  friend class CallQueue;
  enum class State { kQueued, kStarted, kDone, kFailed };
  State state_ = State::kQueued;
  std::atomic<bool> finished_{false};  // state_ is kDone or kFailed (read without the lock)
  std::string error_;
  std::exception_ptr exception_;  // a host task's own exception, rethrown by wait()
  std::vector<WorkPtr> deps_;
};

// Runs a function as a queue entry (Communicator::host_task).
class HostTask final : public QueuedCall {
 public:
  HostTask(std::function<void()> fn, std::string group) : fn_(std::move(fn)), group_(std::move(group)) {}
  void start() override { fn_(); }
  bool advance(Clock::time_point) override { return true; }
  std::string pending_text() override { return "the task is running"; }
  std::string describe() const override { return "host task on " + group_; }
  bool is_host_task() const override { return true; }

 private:
  std::function<void()> fn_;
  std::string group_;
};

// The CPUs the calling thread may run on (Linux; elsewhere: none).
std::vector<int> thread_cpus();
// Member `index` of `count`'s share of `cpus` (NOTE [worker cpus] in collectives/local.cpp): the
// CPUs at positions index, index + count, ... when there are at least `count`, else the one at
// index mod cpus.size(); empty (nothing pinned) for one CPU or one member.
std::vector<int> cpu_share(const std::vector<int>& cpus, int index, int count);

// What the ticker shares with one queue: the queue's worker sleeps on `cv` (with the queue's own
// mutex), and `idle_since` says since when the queue has had unfinished calls nobody progressed.
// Separate from the queue so that the ticker never owns a queue (and never destroys one).
struct WorkerSignal {
  std::condition_variable cv;
  std::atomic<int64_t> idle_since{0};  // ns since the clock's epoch; 0: nothing to do
  std::atomic<bool> alive{true};       // false once the queue shut down
};

// Wakes the workers of queues whose calls nobody has progressed for `wake_after` (NOTE [call
// queue]). One thread per world. It looks at its queues every `slow` while they are busy, every
// `fast` for `linger` after it last had to wake a worker (the program issues calls it does not
// wait for at once), and sleeps while nothing is pending until a queue pokes it. So a program
// that waits for its calls right away costs it ~1k wake-ups a second, and background progress
// starts within ~wake_after + fast once the program works asynchronously (within `slow` for the
// first such call after a quiet spell).
class WorkerTicker {
 public:
  struct Options {
    std::chrono::microseconds wake_after{100};
    std::chrono::microseconds fast{50};
    std::chrono::microseconds slow{1000};
    Milliseconds linger{200};
  };
  WorkerTicker() : WorkerTicker(Options{}) {}
  explicit WorkerTicker(Options options);
  ~WorkerTicker();
  WorkerTicker(const WorkerTicker&) = delete;
  WorkerTicker& operator=(const WorkerTicker&) = delete;
  void add(std::shared_ptr<WorkerSignal> signal);
  // A queue has calls nobody progresses: make sure the ticker looks soon.
  void poke();

 private:
  void main();
  const Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<WorkerSignal>> signals_;  // guarded by mu_
  std::atomic<bool> sleeping_{false};
  bool stop_ = false;
  std::thread thread_;
};

class CallQueue : public std::enable_shared_from_this<CallQueue> {
 public:
  struct Options {
    // Without a ticker (or with worker = false) calls progress only in wait() / completed().
    bool worker = true;
    std::weak_ptr<WorkerTicker> ticker;  // owned by the world
    Milliseconds slice{20};  // longest a holder blocks before re-checking
    // The CPUs the worker may run on (NOTE [worker cpus] in collectives/local.cpp); empty: those
    // of the thread that starts it.
    std::vector<int> worker_cpus;
    // NOTE [batch worker] The worker runs under SCHED_BATCH (Linux; elsewhere: ignored): a fair
    // share of the CPU like any thread, but its wake-up never preempts the running thread (the
    // kernel's rule for the batch and idle policies). Under the default policy, a kick (or the
    // ticker) with no core free woke the worker onto the caller's own core, where it took over at
    // once and, under EEVDF's RUN_TO_PARITY, kept the core for its slice: the caller came back
    // from redistribute_async only after the copy it had handed off (R -> S(0) of 32 MiB: 1.5-2.5
    // ms of issue, the whole copy), so nothing overlapped; mpi with 2 processes, which OpenMPI
    // binds to one core each, showed it on every machine (exposed 0.3-1.0, also on 16 cores).
    // Now the caller goes on to its compute and the worker runs while the caller sleeps or
    // waits, or on a free core. SCHED_IDLE (the local workers' policy before) never preempts
    // either, but runs only when nothing else wants the CPU, so other ranks' spinning waiters
    // starved it. dtensor-bench --overlap, rows within the target, before -> after (alternated
    // runs, commit 25e7c55): 2 vCPUs: local 4 ranks 10 / 10 -> 19 / 22 of 28, local 2 ranks
    // 5 / 8 -> 7 / 6 of 14, mpi 2 processes 6 / 8 -> 12 / 14 of 14, mpi 4 processes 18 / 16 ->
    // 24 / 15 of 28; 16 cores: mpi 2 processes 8 / 8 -> 13 / 14 of 14, local unchanged (noise).
    // A waiter progresses the queue itself under its own policy, so nothing waited on runs as a
    // batch thread.
  };
  explicit CallQueue(Options options)
      : options_(options), with_worker_(options.worker && !options.ticker.expired()) {}
  ~CallQueue();
  CallQueue(const CallQueue&) = delete;
  CallQueue& operator=(const CallQueue&) = delete;

  // Appends `call`, with the dependencies of the wait_for()s since the last push, and returns its
  // Work (whose destructor completes the call if it is still pending, bounded by
  // `default_timeout`). When no other thread progresses the queue, this thread starts the
  // collectives whose start is cheap (QueuedCall::cheap_start: posting them; the call itself
  // when nothing is ahead of it), without blocking, moving data or running host tasks: the
  // caller may be issuing work to overlap with its own, so the data moves on the worker (or in
  // wait()).
  std::shared_ptr<Work> push(std::shared_ptr<QueuedCall> call, Milliseconds default_timeout);
  void add_dependency(WorkPtr work);
  // Wakes the worker now when calls are pending and nobody progresses them (Communicator::kick).
  void kick();
  // Completes every entry (bounded by `timeout`) when `drain`, then fails the rest with `why`,
  // calls on_close (to wake a holder blocked in the backend) and stops the worker. Later pushes
  // fail at once.
  void shutdown(bool drain, Milliseconds timeout, const std::string& why,
                const std::function<void()>& on_close = nullptr);

  // For the Works of the queue.
  bool settle(const std::shared_ptr<QueuedCall>& call, Clock::time_point deadline);
  void wait(const std::shared_ptr<QueuedCall>& call, Milliseconds timeout);
  bool poll(const std::shared_ptr<QueuedCall>& call);
  bool finished(const QueuedCall& call) const;
  std::string status(const std::shared_ptr<QueuedCall>& call) const;
  // Fails a call nobody will wait for (the rest of a failed batch).
  void give_up(const std::shared_ptr<QueuedCall>& call, const std::string& why);

 private:
  using State = QueuedCall::State;
  static bool is_finished(const QueuedCall& c) { return c.state_ == State::kDone || c.state_ == State::kFailed; }
  // Marks c failed; its dependencies move to `released` (drop them without the lock: their
  // destructors may wait). REQUIRES: mu_ held; c unfinished.
  void fail_locked(QueuedCall& c, std::string why, std::vector<WorkPtr>& released);
  bool has_unfinished() const;
  bool has_worker() const { return with_worker_; }
  // REQUIRES: mu_ held. Taking and letting go of the holder role.
  void hold();
  void let_go();
  // Progresses the queue as the holder until stop() or the deadline (at least one pass).
  // REQUIRES: lk holds mu_ and this thread set holding_.
  void run(std::unique_lock<std::mutex>& lk, Clock::time_point deadline, const std::function<bool()>& stop);
  // Starts every entry that may start, in order (on push, only those with a cheap start: no host
  // tasks). REQUIRES: as run(). Returns the first queued entry whose dependencies have not
  // finished, if it is the head (the caller waits for them).
  std::shared_ptr<QueuedCall> start_ready(std::unique_lock<std::mutex>& lk, bool on_push = false);
  void finish(QueuedCall& c, std::exception_ptr error);  // REQUIRES: mu_ held
  void worker_main();
  // "it never started: it waits for ..." for a queued call.
  std::string blocked_text(const std::shared_ptr<QueuedCall>& call) const;

  Options options_;
  const bool with_worker_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // an entry finished, or the holder let go
  const std::shared_ptr<WorkerSignal> signal_ = std::make_shared<WorkerSignal>();  // wakes the worker
  std::deque<std::shared_ptr<QueuedCall>> calls_;  // in call order; finished ones leave from the front
  std::vector<WorkPtr> next_deps_;
  bool holding_ = false;
  bool registered_ = false;  // with the ticker
  bool closed_ = false;
  std::string closed_why_;
  std::thread worker_;
};

// A Work of several calls (a batch of the CPU backends): waits for each in order; when one fails
// the rest are given up (so dropping the batch does not wait for each of them again).
class GroupWork final : public Work {
 public:
  explicit GroupWork(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait(Milliseconds timeout) override;
  bool completed() override;
  bool settle(Milliseconds timeout) override;
  std::string describe() const override;
  void give_up(const std::string& why) override;

 private:
  std::vector<WorkPtr> works_;
};

}  // namespace collectives::detail
