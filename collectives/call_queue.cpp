#include "collectives/call_queue.h"

#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <utility>

#include "kernels/error.h"

namespace collectives::detail {

using kernels::CommError;

namespace {

// now + timeout, saturating (a huge timeout means "no deadline").
Clock::time_point deadline_after(Milliseconds timeout) {
  const Clock::time_point now = Clock::now();
  if (timeout <= Milliseconds{0}) return now;
  if (timeout >= std::chrono::duration_cast<Milliseconds>(Clock::time_point::max() - now)) return Clock::time_point::max();
  return now + timeout;
}

Milliseconds remaining(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return Milliseconds{0};
  if (deadline == Clock::time_point::max()) return Milliseconds::max();
  return std::chrono::duration_cast<Milliseconds>(deadline - now) + Milliseconds{1};
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// The Work of one queue entry.
class QueueWork final : public Work {
 public:
  QueueWork(std::shared_ptr<CallQueue> queue, std::shared_ptr<QueuedCall> call, Milliseconds default_timeout)
      : queue_(std::move(queue)), call_(std::move(call)), default_timeout_(default_timeout) {}
  ~QueueWork() override {
    // A dropped Work still completes its call (the caller may reuse the buffers after this), but
    // not while the thread unwinds: run_ranks then aborts the world.
    if (std::uncaught_exceptions() == 0 && !call_->has_finished()) {
      try {
        queue_->wait(call_, default_timeout_);
      } catch (...) {  // NOLINT: destructors never throw
      }
    }
  }
  void wait(Milliseconds timeout) override { queue_->wait(call_, timeout); }
  bool completed() override { return queue_->poll(call_); }
  bool settle(Milliseconds timeout) override { return queue_->settle(call_, deadline_after(timeout)); }
  std::string describe() const override { return queue_->status(call_); }
  void give_up(const std::string& why) override { queue_->give_up(call_, why); }
  bool on_finish(std::function<void()> fn) override {
    queue_->on_finish(call_, std::move(fn));
    return true;
  }
  bool has_finished() const { return call_->has_finished(); }

 private:
  std::shared_ptr<CallQueue> queue_;
  std::shared_ptr<QueuedCall> call_;
  Milliseconds default_timeout_;
};

// Whether a dependency has finished, without advancing it (a call of another of this process's
// queues is only looked at: checking must not move its data on this thread).
bool dep_finished(const WorkPtr& w) {
  if (const auto* q = dynamic_cast<const QueueWork*>(w.get())) return q->has_finished();
  return w->completed();
}

}  // namespace

CallQueue::~CallQueue() {
  {
    std::lock_guard lk(mu_);
    closed_ = true;
  }
  signal_->alive.store(false);
  signal_->cv.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool CallQueue::has_unfinished() const {
  return std::any_of(calls_.begin(), calls_.end(), [](const auto& c) { return !is_finished(*c); });
}

std::shared_ptr<Work> CallQueue::push(std::shared_ptr<QueuedCall> call, Milliseconds default_timeout) {
  std::unique_lock lk(mu_);
  if (closed_) throw CommError(fmt::format("{}: {}", call->describe(), closed_why_));
  call->deps_ = std::exchange(next_deps_, {});
  calls_.push_back(call);
  auto work = std::make_shared<QueueWork>(shared_from_this(), call, default_timeout);
  if (has_worker() && !registered_) {
    registered_ = true;
    if (auto ticker = options_.ticker.lock()) ticker->add(signal_);
    worker_ = std::thread([this] { worker_main(); });
  }
  if (!holding_) {
    hold();
    (void)start_ready(lk, /*on_push=*/true);
    while (!calls_.empty() && is_finished(*calls_.front())) calls_.pop_front();
    let_go();
  }
  return work;
}

void CallQueue::hold() {
  holding_ = true;
  signal_->idle_since.store(0);
}

void CallQueue::let_go() {
  holding_ = false;
  cv_.notify_all();
  if (!has_worker()) return;
  if (has_unfinished() && !closed_) {
    signal_->idle_since.store(
        std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count()));
    if (auto ticker = options_.ticker.lock()) ticker->poke();
  } else {
    signal_->idle_since.store(0);
  }
}

void CallQueue::kick() {
  std::lock_guard lk(mu_);
  if (has_worker() && !holding_ && has_unfinished()) signal_->cv.notify_one();
}

void CallQueue::add_dependency(WorkPtr work) {
  if (!work) return;
  std::lock_guard lk(mu_);
  next_deps_.push_back(std::move(work));
}

void CallQueue::finish(QueuedCall& c, std::exception_ptr error) {
  if (is_finished(c)) return;  // given up meanwhile: that verdict stands
  if (error) {
    c.state_ = State::kFailed;
    c.error_ = what_of(error);
    c.exception_ = c.is_host_task() ? error : nullptr;
  } else {
    c.state_ = State::kDone;
  }
  c.finished_.store(true);
  if (c.on_finish_) std::exchange(c.on_finish_, nullptr)();
  cv_.notify_all();
}

void CallQueue::on_finish(const std::shared_ptr<QueuedCall>& call, std::function<void()> fn) {
  std::unique_lock lk(mu_);
  if (!is_finished(*call)) {
    call->on_finish_ = std::move(fn);
    return;
  }
  lk.unlock();
  fn();
}

void CallQueue::fail_locked(QueuedCall& c, std::string why, std::vector<WorkPtr>& released) {
  c.state_ = State::kFailed;
  c.error_ = std::move(why);
  c.finished_.store(true);
  if (c.on_finish_) std::exchange(c.on_finish_, nullptr)();
  for (WorkPtr& d : c.deps_) released.push_back(std::move(d));
  c.deps_.clear();
  cv_.notify_all();
}

std::shared_ptr<QueuedCall> CallQueue::start_ready(std::unique_lock<std::mutex>& lk, bool on_push) {
  for (;;) {
    // The first entry not yet started; every entry before it has started (or finished).
    size_t i = 0;
    bool earlier_finished = true;
    while (i < calls_.size() && calls_[i]->state_ != State::kQueued) {
      earlier_finished = earlier_finished && is_finished(*calls_[i]);
      ++i;
    }
    if (i == calls_.size()) return nullptr;
    std::shared_ptr<QueuedCall> c = calls_[i];
    if (c->is_host_task() && (!earlier_finished || on_push)) return nullptr;
    if (on_push && !c->cheap_start()) return nullptr;
    // Dependencies are checked without this queue's lock (they may belong to other queues); the
    // references taken here are dropped before it is locked again, so no Work of another queue
    // is ever destroyed under it.
    bool ready = true;
    {
      std::vector<WorkPtr> deps = c->deps_;
      lk.unlock();
      for (const WorkPtr& d : deps)
        if (!dep_finished(d)) {
          ready = false;
          break;
        }
    }
    lk.lock();
    if (c->state_ != State::kQueued) continue;  // given up meanwhile
    if (!ready) return c == calls_.front() ? c : nullptr;
    std::vector<WorkPtr> done_deps = std::exchange(c->deps_, {});
    c->state_ = State::kStarted;
    lk.unlock();
    done_deps.clear();
    std::exception_ptr error;
    try {
      c->start();
    } catch (...) {
      error = std::current_exception();
    }
    lk.lock();
    if (error) finish(*c, error);
  }
}

void CallQueue::run(std::unique_lock<std::mutex>& lk, Clock::time_point deadline, const std::function<bool()>& stop) {
  for (bool first = true;; first = false) {
    while (!calls_.empty() && is_finished(*calls_.front())) calls_.pop_front();
    if (calls_.empty() || stop()) return;
    const Clock::time_point now = Clock::now();
    if (!first && now >= deadline) return;
    const Clock::time_point until = std::min(deadline, now + options_.slice);
    std::shared_ptr<QueuedCall> blocked = start_ready(lk);
    while (!calls_.empty() && is_finished(*calls_.front())) calls_.pop_front();
    if (calls_.empty() || stop()) return;
    std::shared_ptr<QueuedCall> head = calls_.front();
    if (head->state_ == State::kStarted) {
      lk.unlock();
      std::exception_ptr error;
      bool done = false;
      try {
        done = head->advance(until);
      } catch (...) {
        error = std::current_exception();
      }
      lk.lock();
      if (error || done) finish(*head, error);
    } else if (blocked && blocked == head && until > Clock::now()) {
      // The head waits for calls of other communicators: help them along for a while.
      std::vector<WorkPtr> deps = head->deps_;
      lk.unlock();
      for (const WorkPtr& d : deps) {
        const Clock::time_point t = Clock::now();
        if (t >= until || !d->settle(std::chrono::duration_cast<Milliseconds>(until - t) + Milliseconds{1})) break;
      }
      deps.clear();
      lk.lock();
    }
  }
}

bool CallQueue::settle(const std::shared_ptr<QueuedCall>& call, Clock::time_point deadline) {
  std::unique_lock lk(mu_);
  for (;;) {
    if (is_finished(*call)) return true;
    if (Clock::now() >= deadline) return false;
    if (!holding_) {
      hold();
      run(lk, deadline, [&] { return is_finished(*call); });
      let_go();
      continue;
    }
    cv_.wait_until(lk, deadline, [&] { return is_finished(*call) || !holding_; });
  }
}

bool CallQueue::poll(const std::shared_ptr<QueuedCall>& call) {
  std::unique_lock lk(mu_);
  if (!is_finished(*call) && !holding_) {
    hold();
    run(lk, Clock::now(), [&] { return is_finished(*call); });
    let_go();
  }
  return is_finished(*call);
}

bool CallQueue::finished(const QueuedCall& call) const {
  std::lock_guard lk(mu_);
  return is_finished(call);
}

std::string CallQueue::blocked_text(const std::shared_ptr<QueuedCall>& call) const {
  std::shared_ptr<QueuedCall> earlier;
  {
    std::lock_guard lk(mu_);
    for (const auto& c : calls_) {
      if (c == call) break;
      if (!is_finished(*c)) {
        earlier = c;
        break;
      }
    }
  }
  if (!earlier) return "it never started";
  // pending_text() may take time (mpi reads the progress board): not under the lock.
  return "it never started: an earlier call on this communicator has not finished: " + earlier->describe() +
         (finished(*earlier) ? std::string(" (finished since)") : ": " + earlier->pending_text());
}

std::string CallQueue::status(const std::shared_ptr<QueuedCall>& call) const {
  std::unique_lock lk(mu_);
  const State s = call->state_;
  if (s == State::kDone) return call->describe() + " (completed)";
  if (s == State::kFailed) return call->describe() + " (failed: " + call->error_ + ")";
  if (s == State::kStarted) {
    lk.unlock();
    return call->describe() + ": " + call->pending_text();
  }
  // Dependencies' completed() may take their queues' locks: not under this one.
  std::vector<WorkPtr> deps = call->deps_;
  lk.unlock();
  for (const WorkPtr& d : deps)
    if (!d->completed()) return call->describe() + ": it never started: it waits for " + d->describe();
  return call->describe() + ": it has not started yet";
}

void CallQueue::wait(const std::shared_ptr<QueuedCall>& call, Milliseconds timeout) {
  const bool done = settle(call, deadline_after(timeout));
  std::unique_lock lk(mu_);
  if (done || is_finished(*call)) {
    if (call->state_ == State::kFailed) {
      if (call->exception_) std::rethrow_exception(call->exception_);
      throw CommError(call->error_);
    }
    return;
  }
  // Out of time: give the call up.
  const bool started = call->state_ == State::kStarted;
  std::vector<WorkPtr> deps = call->deps_;
  lk.unlock();
  std::string why;
  if (started) {
    why = call->pending_text();
  } else {
    for (const WorkPtr& d : deps)
      if (why.empty() && !d->completed()) why = "it never started: it waits for " + d->describe();
    if (why.empty()) why = blocked_text(call);
  }
  const std::string text = fmt::format("{} timed out after {} ms: {}", call->describe(), timeout.count(), why);
  std::vector<WorkPtr> released;
  lk.lock();
  if (!is_finished(*call)) fail_locked(*call, text, released);
  const bool failed_here = call->error_ == text;
  const bool ok = call->state_ == State::kDone;
  const std::exception_ptr own = call->exception_;
  const std::string error = call->error_;
  lk.unlock();
  released.clear();
  if (ok) return;  // completed just now
  if (failed_here && started) call->abandon(text);
  if (own) std::rethrow_exception(own);
  throw CommError(error);
}

void CallQueue::give_up(const std::shared_ptr<QueuedCall>& call, const std::string& why) {
  std::vector<WorkPtr> released;
  std::unique_lock lk(mu_);
  if (is_finished(*call)) return;
  const bool started = call->state_ == State::kStarted;
  fail_locked(*call, why, released);
  lk.unlock();
  released.clear();
  if (started) call->abandon(why);
}

void CallQueue::worker_main() {
#ifdef SCHED_BATCH
  {  // NOTE [batch worker]; a refusal leaves the default policy
    sched_param sp{};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
  }
#endif
#ifdef __linux__
  if (!options_.worker_cpus.empty()) {  // a refusal leaves the inherited mask
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : options_.worker_cpus)
      if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
#endif
  std::unique_lock lk(mu_);
  for (;;) {
    // Woken by the ticker (or shutdown); after a slice of its own it goes on at once.
    signal_->cv.wait(lk, [&] { return closed_ || (!holding_ && has_unfinished()); });
    if (closed_) return;
    hold();
    run(lk, Clock::now() + options_.slice, [&] { return closed_; });
    let_go();
  }
}

void CallQueue::shutdown(bool drain, Milliseconds timeout, const std::string& why,
                         const std::function<void()>& on_close) {
  if (drain) {
    std::vector<std::shared_ptr<QueuedCall>> pending;
    {
      std::lock_guard lk(mu_);
      pending.assign(calls_.begin(), calls_.end());
    }
    const Clock::time_point deadline = deadline_after(timeout);
    for (const auto& c : pending)
      if (!settle(c, deadline)) break;
  }
  std::vector<std::shared_ptr<QueuedCall>> abandoned;
  std::vector<WorkPtr> deps;  // released outside the lock (their destructors may wait)
  {
    std::lock_guard lk(mu_);
    if (!closed_) closed_why_ = why;
    closed_ = true;
    for (const auto& c : calls_) {
      if (is_finished(*c)) continue;
      if (c->state_ == State::kStarted) abandoned.push_back(c);
      fail_locked(*c, c->describe() + ": " + why, deps);
    }
    for (WorkPtr& d : next_deps_) deps.push_back(std::move(d));
    next_deps_.clear();
    cv_.notify_all();
  }
  signal_->alive.store(false);
  signal_->idle_since.store(0);
  signal_->cv.notify_all();
  if (on_close) on_close();
  for (const auto& c : abandoned) c->abandon(why);
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

// ---- WorkerTicker ----

WorkerTicker::WorkerTicker(Options options) : options_(options), thread_([this] { main(); }) {}

WorkerTicker::~WorkerTicker() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkerTicker::add(std::shared_ptr<WorkerSignal> signal) {
  std::lock_guard lk(mu_);
  std::erase_if(signals_, [](const std::shared_ptr<WorkerSignal>& q) { return !q->alive.load(); });
  signals_.push_back(std::move(signal));
}

void WorkerTicker::poke() {
  if (!sleeping_.load()) return;
  std::lock_guard lk(mu_);
  sleeping_.store(false);
  cv_.notify_one();
}

namespace {
// How long the queue has had calls nobody progresses (negative: none); wakes its worker once
// that is at least `wake_after`.
std::chrono::nanoseconds tick(WorkerSignal& q, Clock::time_point now, std::chrono::microseconds wake_after) {
  const int64_t since = q.idle_since.load();
  if (since == 0 || !q.alive.load()) return std::chrono::nanoseconds{-1};
  const std::chrono::nanoseconds idle{std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count() - since};
  if (idle >= wake_after) q.cv.notify_one();  // without the queue's lock: a lost wake-up is repeated at the next tick
  return idle;
}
}  // namespace

void WorkerTicker::main() {
  std::unique_lock lk(mu_);
  Clock::time_point last_woke = Clock::time_point::min();  // last time a worker had to be woken
  Clock::time_point last_pending = Clock::now();           // last time some queue had calls pending
  while (!stop_) {
    std::erase_if(signals_, [](const std::shared_ptr<WorkerSignal>& q) { return !q->alive.load(); });
    const Clock::time_point now = Clock::now();
    bool pending = false, woke = false, soon = false;
    for (const auto& q : signals_) {
      const std::chrono::nanoseconds idle = tick(*q, now, options_.wake_after);
      if (idle.count() < 0) continue;
      pending = true;
      woke = woke || idle >= options_.wake_after;
      soon = soon || idle < options_.wake_after;  // look again when it is due
    }
    if (woke) last_woke = now;
    if (pending) last_pending = now;
    if (pending || now - last_pending < options_.linger) {
      const bool fast = soon || (last_woke != Clock::time_point::min() && now - last_woke < options_.linger);
      cv_.wait_for(lk, fast ? options_.fast : options_.slow, [&] { return stop_; });
      continue;
    }
    // Quiet: sleep until poked. A queue that gets calls nobody progresses right before sleeping_
    // is set either sees sleeping_ and pokes, or is seen by this second look (both sides use
    // sequentially consistent atomics: idle_since, then sleeping_).
    sleeping_.store(true);
    bool missed = false;
    for (const auto& q : signals_) missed = tick(*q, Clock::now(), options_.wake_after).count() >= 0 || missed;
    if (missed) sleeping_.store(false);
    cv_.wait(lk, [&] { return stop_ || !sleeping_.load(); });
    last_pending = Clock::now();
  }
}

std::vector<int> thread_cpus() {
  std::vector<int> cpus;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
#endif
  return cpus;
}

std::vector<int> cpu_share(const std::vector<int>& cpus, int index, int count) {
  const int n = static_cast<int>(cpus.size());
  if (n <= 1 || count <= 1 || index < 0) return {};
  if (count >= n) return {cpus[static_cast<size_t>(index % n)]};
  std::vector<int> mine;
  for (int k = index % count; k < n; k += count) mine.push_back(cpus[static_cast<size_t>(k)]);
  return mine;
}

// ---- GroupWork ----

void GroupWork::wait(Milliseconds timeout) {
  const Clock::time_point deadline = deadline_after(timeout);
  for (size_t k = 0; k < works_.size(); ++k) {
    try {
      works_[k]->wait(remaining(deadline));
    } catch (const std::exception& e) {
      for (size_t j = k + 1; j < works_.size(); ++j)
        works_[j]->give_up(fmt::format("abandoned: an earlier call of the same batch failed: {}", e.what()));
      throw;
    }
  }
}

bool GroupWork::completed() {
  bool done = true;
  for (auto& w : works_) done = w->completed() && done;  // each call makes progress
  return done;
}

bool GroupWork::settle(Milliseconds timeout) {
  const Clock::time_point deadline = deadline_after(timeout);
  for (auto& w : works_)
    if (!w->settle(remaining(deadline))) return false;
  return true;
}

void GroupWork::give_up(const std::string& why) {
  for (auto& w : works_) w->give_up(why);
}

std::string GroupWork::describe() const {
  for (const auto& w : works_)
    if (!w->completed()) return "a batch waiting for " + w->describe();
  return fmt::format("a batch of {} calls (completed)", works_.size());
}

}  // namespace collectives::detail
