// The mpi backend (collectives/mpi.h), run by mpirun with 1 to 4 processes (main() is in
// mpi_test_main.cpp). Every rank runs the same test cases in the same order and checks its own
// output.
//
// Covered: the contract suite (contract.h: every collective, dtype, reduction and count, in and
// out of place, views, batches, splits, argument errors and aliasing), then what is the mpi
// backend's own: its CPU-only and int-count limits, a receive longer than its message,
// check_calls mismatches, splits that disagree, a straggler that never joins (the timeout names
// it, the group is poisoned, and the straggler still completes later), a member stopped
// (SIGSTOP) after entering several calls (named among those that joined), a split that a rank never joins,
// NaN in min / max, and the in-order engine (calls complete while a rank makes no MPI call at
// all; chains across communicators through wait_for and host tasks, issued at once; a call held
// up by a dependency names what it waits for).
#include "collectives/mpi.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <catch2/catch.hpp>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <thread>

#include <unistd.h>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "contract.h"

namespace mpi_test {
extern collectives::MpiWorld* mpi;
extern collectives::Communicator* world;
}  // namespace mpi_test

namespace {

using namespace collectives;
using namespace std::chrono_literals;
using Catch::Contains;
using kernels::CommError;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Unsupported;

Communicator& W() { return *mpi_test::world; }

Tensor filled(DType dt, int64_t n, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dt);
  if (n > 0) t.fill_index_([&](std::span<const int64_t> idx) { return f(idx[0]); });
  return t;
}

// Element-wise equality with the first difference in the failure message.
void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE(got.numel() == want.numel());
  const std::vector<double> g = got.to_vector(), w = want.to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != w[i])
      FAIL(fmt::format("{} on rank {}: element {} is {}, expected {}", what, W().rank(), i, g[i],
                       w[i]));
  SUCCEED();
}
void expect_values(const Tensor& got, const std::function<double(int64_t)>& f,
                   const std::string& what) {
  expect_equal(got, filled(got.dtype(), got.numel(), f), what);
}

TEST_CASE("mpi: world", "[mpi]") {
  REQUIRE(mpi_built());
  REQUIRE(W().backend() == "mpi");
  REQUIRE(W().name() == "world");
  REQUIRE(W().rank() == mpi_test::mpi->rank());
  REQUIRE(W().size() == mpi_test::mpi->size());
  std::vector<int> all(static_cast<size_t>(W().size()));
  std::iota(all.begin(), all.end(), 0);
  REQUIRE(W().ranks() == all);
  W().wait(W().barrier());
  W().wait(W().barrier());
}

// The contract suite (contract.h): every case, on this world of 1 to 4 processes.
TEST_CASE("mpi: contract", "[mpi][contract]") {
  size_t ran = 0;
  for (const contract::Case& c : contract::cases()) {
    const contract::Log log = contract::run_case(c, W(), kernels::Device{});
    INFO(c.name << " on rank " << W().rank() << " of " << W().size() << ":\n"
                << fmt::format("{}", fmt::join(log.failures, "\n")));
    CHECK(log.failures.empty());
    CHECK(log.checked > 0);
    ++ran;
  }
  CHECK(ran == contract::cases().size());
}

// The rest of send_recv is in the contract suite (contract.h).
TEST_CASE("mpi: a receive longer than what was sent is reported", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  std::vector<P2POp> ops;
  Tensor s = Tensor::full({3}, 1, DType::kF32), r = Tensor::zeros({5}, DType::kF32);
  if (me == 0) ops.push_back(P2POp::send(s, 1));
  if (me == 1) ops.push_back(P2POp::recv(r, 0));
  WorkPtr w = W().send_recv(ops);
  if (me == 1)
    REQUIRE_THROWS_WITH(W().wait(w),
                        Contains("send_recv mismatch on group 'world': receive #0 of rank 1 from "
                                 "rank 0 got 3 elements but its buffer has 5"));
  else
    W().wait(w);
  W().wait(W().barrier());  // the group is still in step
}

// Strided views as derived datatypes: the contract suite's "send_recv views" case; here what
// only MPI reports.
TEST_CASE("mpi: a strided receive longer than the strided send is reported, in elements", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  std::vector<P2POp> short_ops;
  const Tensor base = Tensor::zeros({4, 6}, DType::kI32);
  if (me == 0) short_ops.push_back(P2POp::send(base.narrow(1, 1, 2).narrow(0, 0, 2), 1));  // 4 elements
  if (me == 1) short_ops.push_back(P2POp::recv(base.narrow(1, 2, 3).narrow(0, 1, 2), 0));  // 6
  WorkPtr sw = W().send_recv(short_ops);
  if (me == 1)
    REQUIRE_THROWS_WITH(W().wait(sw), Contains("send_recv mismatch on group 'world': receive #0 of rank 1 from "
                                                "rank 0 got 4 elements but its buffer has 6"));
  else
    W().wait(sw);
  W().wait(W().barrier());
}

TEST_CASE("mpi: works may be dropped unwaited and completed() polls", "[mpi]") {
  const int n = W().size();
  Tensor x = Tensor::full({8}, 1, DType::kF32);
  { W().all_reduce(x, x, ReduceOp::kSum); }  // the Work's destructor completes it
  expect_values(
      x, [&](int64_t) { return n; }, "dropped all_reduce");
  WorkPtr w = W().barrier();
  while (!w->completed()) {
  }
  w->wait(0ms);
}

// Splits in general (order, names, timeouts, nesting) are in the contract suite.
TEST_CASE("mpi: split into the rows and columns of a 2x2 mesh", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n == 4) {  // a 2x2 mesh: rows [0,1] [2,3] and columns [0,2] [1,3]
    std::vector<int> row = me < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    std::vector<int> col = me % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    auto rows = W().split(row, "mesh dim 1");
    auto cols = W().split(col, "mesh dim 0");
    REQUIRE(rows->rank() == me % 2);
    REQUIRE(cols->rank() == me / 2);
    Tensor x = Tensor::full({2}, me, DType::kF32);
    Tensor rs = x.clone(), cs = x.clone();
    rows->wait(rows->all_reduce(rs, rs, ReduceOp::kSum));
    cols->wait(cols->all_reduce(cs, cs, ReduceOp::kSum));
    expect_values(
        rs, [&](int64_t) { return me < 2 ? 1 : 5; }, "row sum");
    expect_values(
        cs, [&](int64_t) { return me % 2 == 0 ? 2 : 4; }, "column sum");
    // Split of a split: each row into singletons.
    std::vector<int> self = {rows->rank()};
    auto single = rows->split(self, "single");
    REQUIRE(single->size() == 1);
    REQUIRE(single->ranks() == std::vector<int>{me});
    single->wait(single->barrier());
  }
}

TEST_CASE("mpi: split with groups that do not agree fails on every member", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  // Rank 0 claims [0,1] but rank 1 claims [1,0]; the others pass themselves.
  std::vector<int> group = me == 0   ? std::vector<int>{0, 1}
                           : me == 1 ? std::vector<int>{1, 0}
                                     : std::vector<int>{me};
  REQUIRE_THROWS_WITH(W().split(group, "bad"),
                      Contains("split of group 'world'") && Contains("do not agree"));
  // A group without the caller.
  std::vector<int> other = me == 0 ? std::vector<int>{1} : std::vector<int>{me};
  REQUIRE_THROWS_WITH(W().split(other, "bad"),
                      Contains("split of group 'world': rank 0 passed a group without itself"));
  W().wait(W().barrier());  // still in step
}

// The argument checks every backend shares are in the contract suite; these are the mpi
// backend's own (Communicator::check_backend), after them.
TEST_CASE("mpi: argument errors of the mpi backend: CPU tensors, int counts", "[mpi]") {
  const int n = W().size();
#if !defined(__SANITIZE_ADDRESS__)
  // An all_to_all_v count over INT_MAX (MPI counts and displacements are int): 2 GiB of u8 that
  // nothing touches (the call is refused before it is posted).
  Tensor in = Tensor::empty({int64_t{INT_MAX} + 2}, DType::kU8), out = Tensor::zeros({0}, DType::kU8);
  std::vector<int64_t> send(static_cast<size_t>(n), 0), recv(static_cast<size_t>(n), 0);
  send[0] = in.numel();
  REQUIRE_THROWS_AS(W().all_to_all_v(in, send, out, recv), Unsupported);
  REQUIRE_THROWS_WITH(W().all_to_all_v(in, send, out, recv), Contains("MPI counts and displacements are int"));
  REQUIRE_THROWS_WITH(W().broadcast(in, 0),
                      Contains(fmt::format("broadcast on group 'world': the buffer has {} elements, over the mpi "
                                           "backend's limit of {} per member", in.numel(), INT_MAX)));
#endif
  if (kernels::cuda_device_count() > 0) {
    Tensor gpu = Tensor::zeros({2}, DType::kF32, kernels::Device::cuda(0));
    REQUIRE_THROWS_WITH(
        W().all_reduce(gpu, gpu, ReduceOp::kSum),
        Contains("the mpi backend moves CPU tensors; use the nccl backend for cuda:0"));
  }
  W().wait(W().barrier());  // nothing above entered a collective
}

TEST_CASE("mpi: check_calls reports mismatched calls on every member", "[mpi]") {
  const int n = W().size(), me = W().rank();
  auto checked = mpi_test::mpi->communicator(30'000ms, /*check_calls=*/true);
  // Matching calls pass.
  Tensor x = Tensor::full({3}, 1, DType::kF32);
  checked->wait(checked->all_reduce(x, x, ReduceOp::kSum));
  expect_values(
      x, [&](int64_t) { return n; }, "checked all_reduce");
  if (n < 2) return;
  // Rank n-1 passes 4 elements, the others 3: nothing moves, every member throws.
  Tensor y = Tensor::zeros({me == n - 1 ? 4 : 3}, DType::kF32);
  REQUIRE_THROWS_WITH(
      checked->wait(checked->all_reduce(y, y, ReduceOp::kSum)),
      Contains(fmt::format(
          "collective mismatch on group 'world' (different counts): rank 0 called all_reduce(f32, "
          "3 -> 3 elements, sum) but rank {} called all_reduce(f32, 4 -> 4 elements, sum)",
          n - 1)));
  REQUIRE_THROWS_WITH(checked->barrier(), Contains("unusable after an earlier failure"));

  auto checked2 = mpi_test::mpi->communicator(30'000ms, true);
  // all_to_all_v: rank 0 sends one element to rank 1, which expects none.
  std::vector<int64_t> send(static_cast<size_t>(n), 0), recv(static_cast<size_t>(n), 0);
  if (me == 0) send[1] = 1;
  Tensor in = Tensor::zeros({me == 0 ? 1 : 0}, DType::kI64), out = Tensor::zeros({0}, DType::kI64);
  REQUIRE_THROWS_WITH(checked2->wait(checked2->all_to_all_v(in, send, out, recv)),
                      Contains("all_to_all_v count mismatch on group 'world': rank 0 sends 1 "
                               "elements to rank 1, which expects 0"));
}

TEST_CASE("mpi: a member that never joins is named after the timeout", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  const int late = n - 1;
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  auto sub = W().split(all, "straggler");
  Tensor x = Tensor::full({4}, me + 1, DType::kF32);
  W().wait(W().barrier());
  if (me != late) {
    WorkPtr w = sub->all_reduce(x, x, ReduceOp::kSum);
    REQUIRE_THROWS_WITH(w->wait(300ms),
                        Contains(fmt::format("all_reduce on group 'straggler' [{}] (call #0) timed "
                                             "out after 300 ms: ranks [{}] never joined",
                                             fmt::join(all, ","), late)));
    REQUIRE_THROWS_WITH(w->wait(300ms), Contains("never joined"));  // the failure sticks
    REQUIRE_THROWS_WITH(sub->barrier(), Contains("all_reduce on group 'straggler'") &&
                                            Contains("unusable after an earlier failure"));
    W().wait(W().barrier());
  } else {
    W().wait(W().barrier());  // the others have seen the timeout
    // Joining late still completes: the others' abandoned call is still posted in MPI and their
    // polling of later world calls drives it.
    sub->wait(sub->all_reduce(x, x, ReduceOp::kSum));
    expect_values(
        x, [&](int64_t) { return n * (n + 1) / 2; }, "late all_reduce");
  }
  W().wait(W().barrier());
}

TEST_CASE("mpi: a member that joined but cannot finish is told apart from a missing one", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  auto fresh = mpi_test::mpi->communicator(30'000ms);
  // Rank 1 waits for a message that rank 0 never sends: everybody joined call #0.
  std::vector<P2POp> ops;
  Tensor r = Tensor::zeros({2}, DType::kF32);
  if (me == 1) ops.push_back(P2POp::recv(r, 0));
  WorkPtr w = fresh->send_recv(ops);
  if (me == 1)
    REQUIRE_THROWS_WITH(
        w->wait(300ms),
        Contains(
            fmt::format("send_recv on group 'world' [{}] (call #0) timed out after 300 ms: every "
                        "member joined, ranks [1] joined but have not completed it (a member that "
                        "stopped calling into MPI stalls the others; MPI does not check that members "
                        "pass matching counts, dtypes, ops and roots); collective mismatch: rank 1 "
                        "called send_recv(1 ops) but rank 0 called send_recv(0 ops)",
                        fmt::join(std::vector<int>(W().ranks()), ","))));
  else
    fresh->wait(w);
  W().wait(W().barrier());
}

namespace {
// The state letter of process `pid` in /proc (R, S, T for stopped, ...), or '?'.
char process_state(int64_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  return close == std::string::npos || close + 2 >= stat.size() ? '?' : stat[close + 2];
}
}  // namespace

TEST_CASE("mpi: a stopped member that entered later calls is named as joined", "[mpi]") {
  // The fsdp-train-stop-kill-mpi flake: a member stops (SIGSTOP) after entering several calls.
  // The others time out on the first and must name it among the members that joined but have not
  // completed it, not "every member joined, ranks [] have not completed it". Barriers: a
  // dissemination barrier of 3 or more members has a round that needs the victim to forward
  // what it receives only after it stopped (with 2, its one message may already be out).
  const int n = W().size(), me = W().rank();
  if (n < 3) return;
  const int victim = n - 1;
  Tensor pids = Tensor::full({1}, static_cast<double>(::getpid()), DType::kI64);
  Tensor all_pids = Tensor::zeros({n}, DType::kI64);
  W().wait(W().all_gather(pids, all_pids));
  const auto victim_pid = static_cast<int64_t>(all_pids.item({victim}));
  std::vector<int> survivors;
  for (int r = 0; r < n; ++r)
    if (r != victim) survivors.push_back(r);
  // The survivors meet on their own group while the victim is stopped.
  auto others = W().split(me == victim ? std::vector<int>{victim} : survivors, me == victim ? "victim" : "survivors");
  auto fresh = mpi_test::mpi->communicator(30'000ms);
  constexpr int kCalls = 3;
  std::vector<WorkPtr> works;
  if (me == victim) {
    for (int k = 0; k < kCalls; ++k) works.push_back(fresh->barrier());
    // Its worker enters all the calls (board, MPI_Ibarrier) well within this; nobody else has
    // posted them, so none completes. Then it stops until rank 0 continues it.
    std::this_thread::sleep_for(200ms);
    ::raise(SIGSTOP);
    for (WorkPtr& w : works) fresh->wait(w);  // the others' abandoned calls are still posted
  } else {
    char state = '?';
    for (int i = 0; i < 1000 && (state = process_state(victim_pid)) != 'T'; ++i) std::this_thread::sleep_for(10ms);
    REQUIRE(state == 'T');
    for (int k = 0; k < kCalls; ++k) works.push_back(fresh->barrier());
    std::string error;
    try {
      works[0]->wait(1000ms);
    } catch (const CommError& e) {
      error = e.what();
    }
    // Some survivors may finish (their rounds of the barrier need nothing more from the victim):
    // at least one must time out, and every one that does names the victim.
    Tensor timed_out = Tensor::full({1}, error.empty() ? 0 : 1, DType::kI32);
    others->wait(others->all_reduce(timed_out, timed_out, ReduceOp::kSum));  // all have read the board
    if (me == 0) ::kill(static_cast<pid_t>(victim_pid), SIGCONT);
    CHECK(timed_out.item({0}) >= 1);
    INFO(error);
    if (!error.empty()) {
      CHECK_THAT(error, Contains("barrier on group 'world'") && Contains("(call #0) timed out after 1000 ms"));
      const std::regex victim_joined(
          fmt::format(R"(ranks \[([0-9]+,)*{}(,[0-9]+)*\] joined but have not completed it \(a member that stopped)",
                      victim));
      CHECK(std::regex_search(error, victim_joined));
    }
    CHECK_THAT(error, !Contains("ranks []"));
  }
  W().wait(W().barrier());
}

TEST_CASE("mpi: min and max propagate NaN", "[mpi]") {
  const int me = W().rank();
  for (DType dt : {DType::kF32, DType::kBF16})
    for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
      Tensor x =
          Tensor::from_vector({me == 0 ? std::nan("") : 1.0, static_cast<double>(me)}, {2}, dt);
      W().wait(W().all_reduce(x, x, op));
      REQUIRE(std::isnan(x.item({0})));
      REQUIRE(x.item({1}) == (op == ReduceOp::kMin ? 0 : W().size() - 1));
    }
}

TEST_CASE("mpi: a split that a member never joins is named after the timeout", "[mpi]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  auto fresh = mpi_test::mpi->communicator(30'000ms);
  fresh->set_timeout(300ms);
  if (me != n - 1) {
    std::vector<int> self = {me};
    REQUIRE_THROWS_WITH(
        fresh->split(self, "never"),
        Contains(fmt::format("split on group 'world' [{}] (call #0) timed out after 300 ms: ranks "
                             "[{}] never joined",
                             fmt::join(std::vector<int>(W().ranks()), ","), n - 1)));
  }
  W().wait(W().barrier());
}

TEST_CASE("mpi engine: calls complete while a rank makes no MPI call at all", "[mpi][engine]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  // A directory name from rank 0 (over MPI, before the test), where the others report through
  // files: rank 0 must not call MPI (which would progress its call) until they are done.
  Tensor token = Tensor::full({1}, me == 0 ? static_cast<double>(::getpid()) : 0, DType::kI64);
  W().wait(W().broadcast(token, 0));
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("dtensor-mpi-engine-{}", static_cast<int64_t>(token.item({0})));
  if (me == 0) std::filesystem::create_directories(dir);
  W().wait(W().barrier());
  auto fresh = mpi_test::mpi->communicator(30'000ms);
  Tensor x = Tensor::full({1 << 16}, me + 1, DType::kF32);
  WorkPtr w = fresh->all_reduce(x, x, ReduceOp::kSum);
  bool others_done = true;
  if (me == 0) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    auto count = [&] {
      return std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator{});
    };
    while (count() < n - 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(2ms);
    others_done = count() == n - 1;
  } else {
    fresh->wait(w);
    std::FILE* f = std::fopen((dir / fmt::format("rank{}", me)).c_str(), "w");
    if (f) std::fclose(f);
  }
  fresh->wait(w);
  expect_values(
      x, [&](int64_t) { return n * (n + 1) / 2; }, "all_reduce");
  W().wait(W().barrier());
  if (me == 0) std::filesystem::remove_all(dir);
  REQUIRE(others_done);
}

TEST_CASE("mpi engine: the worker progresses kicked calls under SCHED_BATCH (NOTE [batch worker])",
          "[mpi][engine]") {
#ifndef SCHED_BATCH
  SKIP("no SCHED_BATCH on this system");
#else
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> done{false};
  std::atomic<int> policy{-1};
  std::thread::id runner;
  WorkPtr w = W().host_task([&] {
    runner = std::this_thread::get_id();
    policy = sched_getscheduler(0);
    done = true;
  });
  W().kick();
  // Neither wait nor poll: only the worker can run the task.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!done.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  W().wait(w);
  CHECK(done.load());
  CHECK(runner != caller);
  CHECK(policy.load() == SCHED_BATCH);
#endif
}

TEST_CASE("mpi engine: chains across communicators issued at once, in any timing", "[mpi][engine]") {
  const int n = W().size(), me = W().rank();
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  auto a = W().split(all, "a");
  auto b = W().split(all, "b");
  if (me % 2) std::this_thread::sleep_for(30ms);
  std::vector<Tensor> results;
  std::vector<WorkPtr> lasts;
  std::vector<int> order;
  for (int chain = 0; chain < 3; ++chain) {
    Tensor mine = Tensor::full({2}, me + 10 * chain, DType::kI64);
    Tensor gathered = Tensor::empty({2 * n}, DType::kI64);
    Tensor sum = Tensor::empty({1}, DType::kI64);
    WorkPtr ag = a->all_gather(mine, gathered);
    b->wait_for(ag);
    b->host_task([=, &order]() mutable {
      double total = 0;
      for (double v : gathered.to_vector()) total += v;
      sum.fill_(total);
      order.push_back(chain);
    });
    lasts.push_back(b->all_reduce(sum, sum, ReduceOp::kMax));
    results.push_back(sum);
  }
  if (me % 2 == 0) std::this_thread::sleep_for(30ms);
  for (const WorkPtr& w : lasts) b->wait(w);
  REQUIRE(order == std::vector<int>{0, 1, 2});
  for (int chain = 0; chain < 3; ++chain)
    REQUIRE(results[static_cast<size_t>(chain)].item({0}) == 2.0 * (n * (n - 1) / 2 + 10 * chain * n));
}

TEST_CASE("mpi engine: a call held up by a dependency times out naming what it waits for", "[mpi][engine]") {
  const int n = W().size(), me = W().rank();
  if (n < 2) return;
  auto a = mpi_test::mpi->communicator(30'000ms);
  auto b = mpi_test::mpi->communicator(30'000ms);
  if (me != n - 1) {
    Tensor x = Tensor::full({2}, 1, DType::kF32);
    WorkPtr first = a->all_reduce(x, x, ReduceOp::kSum);  // rank n-1 never joins
    b->wait_for(first);
    Tensor y = Tensor::full({2}, 1, DType::kF32);
    WorkPtr second = b->all_reduce(y, y, ReduceOp::kSum);
    REQUIRE_THROWS_WITH(second->wait(300ms),
                        Contains("all_reduce on group 'world'") && Contains("timed out after 300 ms: it never started: "
                                                                            "it waits for all_reduce on group 'world'") &&
                            Contains(fmt::format("ranks [{}] never joined", n - 1)));
    REQUIRE_THROWS_WITH(first->wait(300ms), Contains(fmt::format("ranks [{}] never joined", n - 1)));
  }
  W().wait(W().barrier());
}

}  // namespace
