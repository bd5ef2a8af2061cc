// NOTE [in-order engine] on the local backend: calls progress without the caller waiting, start in
// call order, and wait_for / host_task chain calls across communicators at issue time; chains
// issued in the same order on every rank complete in any timing; timeouts of calls held up by a
// dependency name what they wait for; host-task exceptions stay with their Work; one rank's
// failure fails the others' deferred calls fast.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/call_queue.h"
#include "collectives/local.h"
#include "kernels/error.h"
#include "kernels/tensor.h"
#include "support/checks.h"

using namespace collectives;
using namespace std::chrono_literals;
using kernels::CommError;
using kernels::DType;
using testing_support::Checks;

namespace {

// Rows {c, c+4} (dim 0) and {4r..4r+3} (dim 1) of a 2x4 grid of 8 ranks, like a (dp, tp) mesh.
struct Grid {
  std::unique_ptr<Communicator> dp, tp;
};
Grid grid(Communicator& world) {
  const int g = world.rank();
  const std::vector<int> col = {g % 4, g % 4 + 4}, row = {g / 4 * 4, g / 4 * 4 + 1, g / 4 * 4 + 2, g / 4 * 4 + 3};
  Grid out;
  out.dp = world.split(col, fmt::format("dp {}", g % 4));
  out.tp = world.split(row, fmt::format("tp {}", g / 4));
  return out;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("engine: a chain across two communicators is issued at once and completes in any timing",
          "[collectives][engine]") {
  // Each rank issues two chains, each: all_gather on dp -> (tp waits for it) host task that sums
  // the gathered values into a tp buffer -> all_reduce on tp. Rank timing differs on purpose
  // (odd ranks sleep before issuing, even ranks after): the chains still meet in the same order.
  Checks checks;
  int ran = 0;
  std::mutex mu;
  collectives::run_ranks(8, [&](Communicator& world) {
    Grid g = grid(world);
    const int r = world.rank();
    if (r % 2) std::this_thread::sleep_for(20ms);
    std::vector<std::string> order;  // host tasks run on the queue's holder, one at a time
    std::vector<Tensor> results;
    std::vector<WorkPtr> lasts;
    for (int chain = 0; chain < 2; ++chain) {
      Tensor mine = Tensor::full({3}, r + 10 * chain, DType::kF32);
      Tensor gathered = Tensor::empty({6}, DType::kF32);
      Tensor partial = Tensor::empty({1}, DType::kF32);
      WorkPtr ag = g.dp->all_gather(mine, gathered);
      g.tp->wait_for(ag);
      g.tp->host_task([=, &order]() mutable {
        double sum = 0;
        for (double v : gathered.to_vector()) sum += v;
        partial.fill_(sum);
        order.push_back(fmt::format("chain {}", chain));
      });
      lasts.push_back(g.tp->all_reduce(partial, partial, ReduceOp::kSum));
      results.push_back(partial);
    }
    if (r % 2 == 0) std::this_thread::sleep_for(20ms);
    for (const WorkPtr& w : lasts) g.tp->wait(w);
    // Chain c on row t: every member's gathered column {c, c+4} sums to 3 * ((c + 10k) + (c + 4 + 10k)),
    // and the row sums its 4 columns.
    const int row0 = r / 4 * 4;
    (void)row0;
    for (int chain = 0; chain < 2; ++chain) {
      double want = 0;
      for (int col = 0; col < 4; ++col) want += 3.0 * ((col + 10 * chain) + (col + 4 + 10 * chain));
      checks.check(results[chain].item({0}) == want,
                   fmt::format("rank {} chain {}: {} != {}", r, chain, results[chain].item({0}), want));
    }
    checks.check(order == std::vector<std::string>{"chain 0", "chain 1"}, fmt::format("rank {}: host tasks out of order", r));
    std::lock_guard lk(mu);
    ++ran;
  });
  checks.report();
  CHECK(ran == 8);
}

TEST_CASE("engine: calls progress with no thread waiting, and complete in call order", "[collectives][engine]") {
  Checks checks;
  std::atomic<int> finished{0};
  collectives::run_ranks(4, [&](Communicator& world) {
    const int r = world.rank(), n = world.size();
    std::vector<Tensor> xs;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 6; ++k) {
      xs.push_back(Tensor::full({1000}, r + k, DType::kF64));
      works.push_back(world.all_reduce(xs.back(), xs.back(), ReduceOp::kSum));
    }
    // Rank 0 neither waits nor polls until every other rank has waited for all six: only the
    // worker of rank 0's communicator can have taken part for it.
    if (r == 0) {
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      while (finished.load() < n - 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      checks.check(finished.load() == n - 1, "the others did not complete without rank 0 waiting");
    }
    world.wait(works.back());
    // The last one complete means every earlier one is.
    for (size_t k = 0; k < works.size(); ++k) {
      checks.check(works[k]->completed(), fmt::format("rank {}: call {} not complete after the last one", r, k));
      checks.check(xs[k].item({999}) == n * (n - 1) / 2.0 + n * static_cast<double>(k),
                   fmt::format("rank {}: call {} gave {}", r, k, xs[k].item({999})));
    }
    if (r != 0) ++finished;
  });
  checks.report();
}

TEST_CASE("engine: the local worker progresses kicked calls under SCHED_BATCH (NOTE [batch worker])",
          "[collectives][engine]") {
#ifndef SCHED_BATCH
  SKIP("no SCHED_BATCH on this system");
#else
  Checks checks;
  std::atomic<int> ran{0};
  collectives::run_ranks(2, [&](Communicator& world) {
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<bool> done{false};
    std::atomic<int> policy{-1};
    std::thread::id runner;
    WorkPtr w = world.host_task([&] {
      runner = std::this_thread::get_id();
      policy = sched_getscheduler(0);
      done = true;
    });
    world.kick();
    // Neither wait nor poll: only the worker can run the task.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!done.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    world.wait(w);
    checks.check(done.load(), fmt::format("rank {}: the kicked host task did not run without a wait", world.rank()));
    checks.check(runner != caller, fmt::format("rank {}: the caller ran the task", world.rank()));
    checks.check(policy.load() == SCHED_BATCH,
                 fmt::format("rank {}: the worker's policy is {}, not SCHED_BATCH ({})", world.rank(), policy.load(),
                             SCHED_BATCH));
    ++ran;
  });
  checks.report();
  CHECK(ran.load() == 2);
#endif
}

TEST_CASE("engine: each rank's local workers run on their own share of the process's CPUs (NOTE [worker cpus])",
          "[collectives][engine]") {
#ifndef __linux__
  SKIP("CPU affinity is Linux-only here");
#else
  const std::vector<int> process = collectives::detail::thread_cpus();
  REQUIRE(!process.empty());
  const int n = static_cast<int>(process.size());
  int worlds = 0;
  for (int size : {1, 2, 3, 5}) {
    std::mutex mu;
    std::vector<std::vector<int>> world_cpus(static_cast<size_t>(size)), split_cpus(static_cast<size_t>(size));
    std::vector<int> caller_cpu_counts(static_cast<size_t>(size), 0);
    collectives::run_ranks(size, [&](Communicator& world) {
      const int r = world.rank();
      auto worker_cpus = [&](Communicator& comm) {
        std::vector<int> seen;
        std::atomic<bool> done{false};
        const std::thread::id caller = std::this_thread::get_id();
        std::thread::id runner;
        WorkPtr w = comm.host_task([&] {
          seen = collectives::detail::thread_cpus();
          runner = std::this_thread::get_id();
          done = true;
        });
        comm.kick();
        // Neither wait nor poll until the task ran: only the worker can run it.
        const auto deadline = std::chrono::steady_clock::now() + 30s;
        while (!done.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
        comm.wait(w);
        if (runner == caller) seen.clear();  // reported as an empty share
        return seen;
      };
      std::vector<int> mine = worker_cpus(world);
      // A communicator of a subgroup, in which this rank has another group rank: still its share.
      std::vector<int> reversed(static_cast<size_t>(size));
      for (int i = 0; i < size; ++i) reversed[static_cast<size_t>(i)] = size - 1 - i;
      auto sub = world.split(reversed, "reversed");
      std::vector<int> sub_mine = worker_cpus(*sub);
      std::lock_guard lk(mu);
      world_cpus[static_cast<size_t>(r)] = std::move(mine);
      split_cpus[static_cast<size_t>(r)] = std::move(sub_mine);
      caller_cpu_counts[static_cast<size_t>(r)] = static_cast<int>(collectives::detail::thread_cpus().size());
    });
    INFO("world of " << size << " ranks, process CPUs " << fmt::format("{}", fmt::join(process, ",")));
    std::vector<int> uses(static_cast<size_t>(CPU_SETSIZE), 0);
    for (int r = 0; r < size; ++r) {
      const std::vector<int>& m = world_cpus[static_cast<size_t>(r)];
      INFO("rank " << r << " worker CPUs " << fmt::format("{}", fmt::join(m, ",")));
      CHECK(caller_cpu_counts[static_cast<size_t>(r)] == n);  // callers are never pinned
      CHECK(split_cpus[static_cast<size_t>(r)] == m);
      CHECK(!m.empty());
      for (int cpu : m) {
        CHECK(std::find(process.begin(), process.end(), cpu) != process.end());
        ++uses[static_cast<size_t>(cpu)];
      }
      if (size == 1 || n == 1) CHECK(m == process);
      else if (size > n) CHECK(m.size() == 1);
    }
    if (size > 1 && n > 1) {
      // Every CPU of the process is used, each by the same number of workers within one
      // (disjoint shares when there are at least as many CPUs as ranks).
      int lo = size, hi = 0;
      for (int cpu : process) {
        lo = std::min(lo, uses[static_cast<size_t>(cpu)]);
        hi = std::max(hi, uses[static_cast<size_t>(cpu)]);
      }
      CHECK(lo >= 1);
      CHECK(hi - lo <= 1);
      if (size <= n) CHECK(hi == 1);
    }
    ++worlds;
  }
  CHECK(worlds == 4);
#endif
}

TEST_CASE("engine: host tasks run after every earlier call, their exceptions stay with their Work",
          "[collectives][engine]") {
  Checks checks;
  collectives::run_ranks(3, [&](Communicator& world) {
    const int r = world.rank();
    Tensor x = Tensor::full({4}, r + 1, DType::kI64);
    WorkPtr reduce = world.all_reduce(x, x, ReduceOp::kSum);
    std::vector<int64_t> seen;
    WorkPtr task = world.host_task([&] { seen.push_back(static_cast<int64_t>(x.item({0}))); });
    WorkPtr bad = world.host_task([] { throw kernels::InvalidArgument("a host task failed on purpose"); });
    Tensor y = Tensor::full({2}, 1, DType::kI64);
    WorkPtr after = world.all_reduce(y, y, ReduceOp::kSum);  // runs although the task before it failed
    world.wait(after);
    checks.check(reduce->completed() && task->completed() && bad->completed(), "earlier entries not finished");
    checks.check(seen == std::vector<int64_t>{6}, fmt::format("rank {}: the host task saw {}", r, seen.empty() ? -1 : seen[0]));
    checks.check(y.item({1}) == 3, "the call after a failed host task");
    try {
      bad->wait(1s);
      checks.add("the failed host task's wait() did not throw");
    } catch (const kernels::InvalidArgument& e) {
      checks.check(std::string(e.what()) == "a host task failed on purpose", e.what());
    } catch (const std::exception& e) {
      checks.add(std::string("wrong exception type: ") + e.what());
    }
    checks.throws<kernels::InvalidArgument>([&] { world.host_task(nullptr); }, "the function is empty", "empty host task");
    world.begin_batch();
    checks.throws<kernels::InvalidArgument>([&] { world.host_task([] {}); }, "not allowed inside a batch", "host task in a batch");
    world.wait(world.end_batch());
  });
  checks.report();
}

TEST_CASE("engine: a call held up by a dependency times out naming what it waits for", "[collectives][engine]") {
  // Rank 5 (dp group {1,5}) never joins the dp all_gather; rank 1's tp call depends on it. Rank
  // 1's wait on the tp call says it never started and names the dp call and the missing rank.
  Checks checks;
  std::vector<std::string> messages(8);
  std::atomic<bool> rank1_done{false};
  collectives::run_ranks(
      8,
      [&](Communicator& world) {
        Grid g = grid(world);
        const int r = world.rank();
        if (r == 5) {  // alive, never joining, until rank 1 is through (however slow the machine)
          const auto deadline = std::chrono::steady_clock::now() + 30s;
          while (!rank1_done.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
          return;
        }
        if (r != 1) return;
        Tensor mine = Tensor::full({2}, r, DType::kF32), all = Tensor::empty({4}, DType::kF32);
        WorkPtr ag = g.dp->all_gather(mine, all);
        g.tp->wait_for(ag);
        Tensor x = Tensor::zeros({2}, DType::kF32);
        WorkPtr ar = g.tp->all_reduce(x, x, ReduceOp::kSum);
        const auto t0 = std::chrono::steady_clock::now();
        messages[r] = message_of([&] { ar->wait(200ms); });
        // Exact: wait() takes its deadline when entered and gives up no earlier (nobody else
        // waits on this call to give it up sooner); the upper bound leaves 5 s to get a core.
        const auto took = std::chrono::steady_clock::now() - t0;
        checks.check(took >= 200ms && took < 200ms + 5s,
                     fmt::format("gave up after {} ms", std::chrono::duration_cast<Milliseconds>(took).count()));
        messages[r] += " | " + message_of([&] { ag->wait(100ms); });
        rank1_done.store(true);
      },
      30s);
  checks.report();
  INFO(messages[1]);
  CHECK_THAT(messages[1], Catch::Contains("all_reduce on group 'tp 0' [0,1,2,3]") &&
                              Catch::Contains("timed out after 200 ms: it never started: it waits for all_gather on "
                                              "group 'dp 1' [1,5]") &&
                              Catch::Contains("ranks [5] never joined"));
  CHECK_THAT(messages[1], Catch::Contains("| all_gather on group 'dp 1' [1,5] (call #0) timed out after 100 ms: ranks [5] never joined"));
}

TEST_CASE("engine: one rank's exception fails the others' deferred calls fast", "[collectives][engine]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    collectives::run_ranks(
        8,
        [&](Communicator& world) {
          Grid g = grid(world);
          world.set_timeout(60s);
          if (world.rank() == 6) throw std::runtime_error("rank 6 gave up");
          Tensor mine = Tensor::full({2}, 1, DType::kF32), all = Tensor::empty({4}, DType::kF32);
          WorkPtr ag = g.dp->all_gather(mine, all);
          g.tp->wait_for(ag);
          Tensor x = Tensor::zeros({2}, DType::kF32);
          g.tp->wait(g.tp->all_reduce(x, x, ReduceOp::kSum));
        },
        60s);
  } catch (const std::exception& e) {
    what = e.what();
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(what == "rank 6 gave up");
  CHECK(ms < 20'000);  // far below the 60 s timeouts
}

TEST_CASE("engine: wait_for a failed call still runs the next one (the members stay in step)", "[collectives][engine]") {
  Checks checks;
  collectives::run_ranks(3, [&](Communicator& world) {
    auto other = world.split(std::vector<int>{0, 1, 2}, "other");
    const int r = world.rank();
    // A mismatch fails the call on every member alike.
    Tensor a = Tensor::zeros({r == 0 ? 2 : 3}, DType::kF32);
    WorkPtr bad = world.all_reduce(a, a, ReduceOp::kSum);
    other->wait_for(bad);
    Tensor y = Tensor::full({2}, 1, DType::kF32);
    WorkPtr next = other->all_reduce(y, y, ReduceOp::kSum);
    checks.throws<CommError>([&] { bad->wait(10s); }, "collective mismatch", "mismatched call");
    other->wait(next);
    checks.check(y.item({0}) == 3, "the call after a failed dependency");
  });
  checks.report();
}
