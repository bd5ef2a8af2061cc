// The local backend's failures: timeouts (NOTE [timeout bounds]), mismatches between ranks,
// a rank throwing inside run_ranks or returning without joining. Rank threads record, the main
// thread checks (NOTE [rank-side checks] in local_test.h).
#include "local_test.h"

namespace {

using namespace local_test;

// ---- failures: timeouts ----

// NOTE [timeout bounds] What the tests below may assert about the time a timed-out wait takes,
// on a loaded machine under sanitizers:
//  - At least the timeout, measured from the FIRST waiting member (exact): wait(timeout) takes
//    its deadline when it is entered and gives the call up no earlier; the member that gives up
//    first fails the members still waiting for it at once ("ranks [0] gave the call up: ...",
//    LocalCall::abandon). So a member that began waiting later can fail before its own begin +
//    timeout, never before the first member's. Spans hold absolute times for this.
//  - At most the timeout + kLate from its own begin: past its deadline a thread still has to get
//    a core. kLate is far below what a missed deadline would take instead (the 20-60 s timeouts
//    of run_ranks and of the other waits), so the bound still proves a timely failure.
//  - The error names exactly the absent ranks: absent ranks stay until the present ones are
//    through however slow the machine (Away), and present ranks wait until their call is posted
//    (posted) and then for each other (meet) before any of them starts waiting for the call.

// A rank that is alive but never joins: it stays until the `present` ranks are through (each
// holds a Through while it runs), so it outlives their timeouts however slow the machine, for at
// most 60 s. (A rank that returns instead is reported at once: "a rank that returns without
// joining".)
class Away {
 public:
  explicit Away(int present) : left_(present) {}
  class Through {
   public:
    explicit Through(Away& away) : away_(away) {}
    Through(const Through&) = delete;
    Through& operator=(const Through&) = delete;
    ~Through() { away_.left_.fetch_sub(1); }

   private:
    Away& away_;
  };
  void stay() { (void)eventually([&] { return left_.load() <= 0; }, 60s); }

 private:
  std::atomic<int> left_;
};

// Present ranks call this before they wait for a call, the `round`-th time: it returns once all
// `ranks` of them are there.
void meet(std::atomic<int>& arrived, int ranks, int round = 1) {
  arrived.fetch_add(1);
  (void)eventually([&] { return arrived.load() >= ranks * round; }, 30s);
}

// Returns once w's call is posted to its group (it then has a call number), without progressing
// it; at most 30 s. A call issued while the communicator's worker holds the queue (it is woken
// when a waiter lets go of a call it is about to give up) is posted only once that worker runs,
// which on a loaded machine under TSan took over 100 ms: the peers then named this rank among
// those that never joined, and its later calls paired with their earlier ones.
void posted(const WorkPtr& w) {
  (void)eventually([&] { return w->describe().find("(call #") != std::string::npos; }, 30s);
}

// Issues `kind` on world (buffers sized for it) and returns the Work.
WorkPtr issue(Communicator& c, CollectiveKind kind) {
  const int n = c.size();
  Tensor x = Tensor::zeros({2 * n}, DType::kF32);
  switch (kind) {
    case CollectiveKind::kAllGather: return c.all_gather(x.narrow(0, 2 * c.rank(), 2), x);
    case CollectiveKind::kReduceScatter:
      return c.reduce_scatter(x, Tensor::zeros({2}, DType::kF32), ReduceOp::kSum);
    case CollectiveKind::kAllReduce: return c.all_reduce(x, x, ReduceOp::kSum);
    case CollectiveKind::kAllToAll: return c.all_to_all(x, Tensor::zeros({2 * n}, DType::kF32));
    case CollectiveKind::kAllToAllV: {
      std::vector<int64_t> counts(n, 2);
      return c.all_to_all_v(x, counts, Tensor::zeros({2 * n}, DType::kF32), counts);
    }
    case CollectiveKind::kBroadcast: return c.broadcast(x, 0);
    case CollectiveKind::kScatter: return c.scatter(x, Tensor::zeros({2}, DType::kF32), 0);
    case CollectiveKind::kBarrier: return c.barrier();
    case CollectiveKind::kSendRecv: {
      const P2POp ops[] = {P2POp::send(x, (c.rank() + 1) % n),
                           P2POp::recv(Tensor::zeros({2 * n}, DType::kF32), (c.rank() + n - 1) % n)};
      return c.send_recv(ops);
    }
  }
  return nullptr;
}

constexpr CollectiveKind kKinds[] = {
    CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
    CollectiveKind::kAllToAll,  CollectiveKind::kAllToAllV,     CollectiveKind::kBroadcast,
    CollectiveKind::kScatter,   CollectiveKind::kBarrier,       CollectiveKind::kSendRecv};

// Waits on w with `timeout`, expecting a CommError; records its message and the wait's span.
void expect_comm_error(RankLog& log, const WorkPtr& w, Milliseconds timeout, std::string_view what) {
  timed(log, [&] { expect_throw<CommError>(log, [&] { w->wait(timeout); }, what); });
}

// Main thread: rank r's error k contains every fragment.
void check_error(const std::vector<RankLog>& logs, int r, size_t k, const std::vector<std::string>& fragments) {
  INFO("rank " << r << ", error " << k);
  REQUIRE(logs[r].errors.size() > k);
  const std::string& msg = logs[r].errors[k];
  for (const auto& f : fragments) CHECK_THAT(msg, Contains(f));
}

// Main thread: span k of each of `ranks` is a wait with `timeout` for one call they are all
// members of, which timed out: it ended no earlier than the first of them began + timeout, and
// within kLate of its own begin + timeout (NOTE [timeout bounds]).
void check_timed_out(const std::vector<RankLog>& logs, const std::vector<int>& ranks, size_t k,
                     Milliseconds timeout) {
  Clock::time_point first = Clock::time_point::max();
  for (int r : ranks) {
    INFO("rank " << r << ", span " << k);
    REQUIRE(logs[r].spans.size() > k);
    first = std::min(first, logs[r].spans[k].begin);
  }
  for (int r : ranks) {
    const Span& s = logs[r].spans[k];
    INFO("rank " << r << ", span " << k << ": began " << Ms(s.begin - first).count()
                 << " ms after the first waiting member");
    CHECK(Ms(s.end - first) >= timeout);
    CHECK(s.took() < timeout + kLate);
  }
}

// Main thread: span k of rank r took less than `limit`, well below the timeout a wait for
// something that should not be waited for would take.
void check_within(const std::vector<RankLog>& logs, int r, size_t k, Milliseconds limit) {
  INFO("rank " << r << ", span " << k);
  REQUIRE(logs[r].spans.size() > k);
  CHECK(logs[r].spans[k].took() < limit);
}

TEST_CASE("timeout: a rank that never joins fails the others in time, naming collective, group and ranks",
          "[collectives][local]") {
  SECTION("world of 3, rank 2 never joins an all_reduce") {
    Away away(2);
    std::atomic<int> issued{0};
    auto logs = run_logged(3, [&](Communicator& world, RankLog& log) {
      if (world.rank() == 2) return away.stay();
      const Away::Through through(away);
      Tensor x = Tensor::zeros({4}, DType::kF32);
      WorkPtr w = world.all_reduce(x, x, ReduceOp::kSum);
      posted(w);
      meet(issued, 2);
      expect_comm_error(log, w, 200ms, "all_reduce");
    });
    check_logs(logs);
    for (int r : {0, 1}) check_error(logs, r, 0, {"all_reduce", "group 'world'", "ranks [2] never joined", "200 ms"});
    check_timed_out(logs, {0, 1}, 0, 200ms);
  }
  SECTION("world of 8, ranks 3 and 6 never join; every collective kind") {
    const std::vector<int> present = {0, 1, 2, 4, 5, 7};
    Away away(static_cast<int>(present.size()));
    std::atomic<int> issued{0};
    auto logs = run_logged(8, [&](Communicator& world, RankLog& log) {
      if (world.rank() == 3 || world.rank() == 6) return away.stay();
      const Away::Through through(away);
      int round = 0;
      for (CollectiveKind kind : kKinds) {
        WorkPtr w = issue(world, kind);
        posted(w);
        meet(issued, static_cast<int>(present.size()), ++round);
        expect_comm_error(log, w, 100ms, to_string(kind));
      }
    });
    check_logs(logs);
    for (int r : present)
      for (size_t k = 0; k < std::size(kKinds); ++k)
        check_error(logs, r, k,
                    {std::string(to_string(kKinds[k])) + " on group 'world'", "ranks [3,6] never joined"});
    for (size_t k = 0; k < std::size(kKinds); ++k) check_timed_out(logs, present, k, 100ms);
  }
  SECTION("a column of a 2x4 grid: the error names the group and the missing global rank") {
    Away away(7);
    auto logs = run_logged(8, [&](Communicator& world, RankLog& log) {
      const int g = world.rank();
      const std::vector<int> col = {g % 4, g % 4 + 4};
      auto cols = world.split(col, fmt::format("col {}", g % 4));
      if (g == 5) return away.stay();
      const Away::Through through(away);
      Tensor x = Tensor::full({1}, g, DType::kI32);
      if (g != 1) {  // the other columns are complete (the inherited 60 s timeout: no pair is that late)
        cols->wait(cols->all_reduce(x, x, ReduceOp::kSum));
        expect_elements(
            log, x, 1, [&](int64_t) { return 2 * (g % 4) + 4; }, "col all_reduce");
        return;
      }
      cols->set_timeout(150ms);
      timed(log, [&] {
        expect_throw<CommError>(
            log, [&] { cols->wait(cols->all_reduce(x, x, ReduceOp::kSum)); }, "col all_reduce");
      });
    });
    check_logs(logs);
    check_error(logs, 1, 0, {"all_reduce on group 'col 1' [1,5]", "ranks [5] never joined", "150 ms"});
    check_timed_out(logs, {1}, 0, 150ms);
    for (int r : {0, 2, 3, 4, 6, 7}) CHECK(logs[r].errors.empty());
  }
  SECTION("a rank that joins but never waits does not hold the others up: its worker does its part") {
    std::atomic<int> done{0};
    auto logs = run_logged(3, [&](Communicator& world, RankLog& log) {
      Tensor x = Tensor::full({4}, 1, DType::kF32);
      WorkPtr w = world.all_reduce(x, x, ReduceOp::kSum);
      if (world.rank() == 2) {
        // Neither wait() nor completed() until the others are through: only the worker of this
        // rank's communicator can have read this rank's part for them.
        log.expect(eventually([&] { return done.load() == 2; }, 30s), "ranks 0 and 1 did not complete without rank 2");
      } else {
        try {
          w->wait(30s);
        } catch (const std::exception& e) {
          log.fail(fmt::format("all_reduce: {}", e.what()));
        }
        ++done;
      }
      world.wait(w);
      expect_elements(
          log, x, 4, [](int64_t) { return 3; }, "all_reduce");
    });
    check_logs(logs);
  }
}

TEST_CASE("timeout: dropped Works and batches stay bounded by the communicator's timeout",
          "[collectives][local]") {
  // The world's own timeout (run_logged's 20 s) is what a wait that should not happen would take.
  SECTION("a Work destroyed without wait()") {
    Away away(2);
    const auto t0 = Clock::now();
    auto logs = run_logged(
        3,
        [&](Communicator& world, RankLog& log) {
          if (world.rank() == 2) return away.stay();
          const Away::Through through(away);
          world.set_timeout(200ms);
          Tensor x = Tensor::zeros({4}, DType::kF32);
          // Completes (or fails) in the destructor, with the communicator's timeout.
          timed(log, [&] { world.all_reduce(x, x, ReduceOp::kSum).reset(); });
        },
        20s);
    check_logs(logs);
    check_timed_out(logs, {0, 1}, 0, 200ms);
    CHECK(Ms(Clock::now() - t0) < 200ms + kLate);
  }
  SECTION("a batch with a missing rank fails in time, and dropping it afterwards does not block") {
    Away away(2);
    std::atomic<int> issued{0};
    const auto t0 = Clock::now();
    auto logs = run_logged(
        3,
        [&](Communicator& world, RankLog& log) {
          if (world.rank() == 1) return away.stay();
          const Away::Through through(away);
          Tensor x = Tensor::zeros({4}, DType::kF32), y = Tensor::zeros({12}, DType::kF32);
          world.begin_batch();
          world.all_reduce(x, x, ReduceOp::kSum);
          world.all_gather(x, y);
          world.barrier();
          WorkPtr batch = world.end_batch();
          posted(batch);  // its first call (the one that times out)
          meet(issued, 2);
          expect_comm_error(log, batch, 200ms, "batch");
          log.expect(batch->completed(), "a failed batch reports completed()");
          expect_throw<CommError>(
              log, [&] { batch->wait(10ms); }, "second wait of a failed batch");
          timed(log, [&] { batch.reset(); });
        },
        20s);
    check_logs(logs);
    for (int r : {0, 2}) {
      check_error(logs, r, 0, {"all_reduce on group 'world'", "ranks [1] never joined"});
      CHECK(logs[r].errors.at(1) == logs[r].errors.at(0));
      check_within(logs, r, 1, kLate);
    }
    check_timed_out(logs, {0, 2}, 0, 200ms);
    CHECK(Ms(Clock::now() - t0) < 200ms + kLate);
  }
  SECTION("wait() twice after a timeout throws the same error at once; completed() is true") {
    Away away(1);
    auto logs = run_logged(2, [&](Communicator& world, RankLog& log) {
      if (world.rank() == 1) return away.stay();
      const Away::Through through(away);
      WorkPtr w = world.barrier();
      expect_comm_error(log, w, 100ms, "barrier");
      log.expect(w->completed(), "completed() after a failure");
      expect_comm_error(log, w, 30s, "barrier again");
    });
    check_logs(logs);
    check_error(logs, 0, 0, {"barrier on group 'world'", "ranks [1] never joined"});
    CHECK(logs[0].errors.at(1) == logs[0].errors.at(0));
    check_timed_out(logs, {0}, 0, 100ms);
    check_within(logs, 0, 1, kLate);  // not its 30 s
  }
  SECTION("a split that some ranks never join") {
    Away away(2);
    std::atomic<int> ready{0};
    auto logs = run_logged(3, [&](Communicator& world, RankLog& log) {
      if (world.rank() == 0) return away.stay();
      const Away::Through through(away);
      world.set_timeout(150ms);
      const std::vector<int> group = {world.rank()};
      meet(ready, 2);  // a split posts and waits in one call (posted at once: a new world's queue is idle)
      timed(log, [&] {
        expect_throw<CommError>(
            log, [&] { world.split(group, "lonely"); }, "split");
      });
    });
    check_logs(logs);
    for (int r : {1, 2}) check_error(logs, r, 0, {"split", "group 'world'", "ranks [0] never joined"});
    check_timed_out(logs, {1, 2}, 0, 150ms);
  }
}

// ---- failures: mismatches between ranks ----

// Runs `call` on 3 ranks (each issues its own variant), expects the same CommError on every rank
// containing every fragment, at once (not after the 30 s timeout); then checks the communicator
// still works.
void check_mismatch(const std::function<WorkPtr(Communicator&)>& call,
                    const std::vector<std::string>& fragments) {
  auto logs = run_logged(3, [&](Communicator& world, RankLog& log) {
    expect_comm_error(log, call(world), 30s, "mismatched call");
    Tensor x = Tensor::full({2}, 1, DType::kF32);
    world.wait(world.all_reduce(x, x, ReduceOp::kSum));  // later calls still match
    expect_elements(
        log, x, 2, [](int64_t) { return 3; }, "all_reduce after a mismatch");
  });
  check_logs(logs);
  for (int r = 0; r < 3; ++r) {
    check_error(logs, r, 0, fragments);
    check_within(logs, r, 0, kLate);
    CHECK(logs[r].errors.at(0) == logs[0].errors.at(0));
  }
}

TEST_CASE("mismatch: count, dtype, collective, root, op, counts and send/recv disagreements",
          "[collectives][local]") {
  SECTION("count") {
    check_mismatch(
        [](Communicator& c) {
          Tensor x = Tensor::zeros({c.rank() == 2 ? 5 : 4}, DType::kF32);
          return c.all_reduce(x, x, ReduceOp::kSum);
        },
        {"collective mismatch on group 'world' (different counts)",
         "rank 0 called all_reduce(f32, 4 -> 4 elements, sum)",
         "rank 2 called all_reduce(f32, 5 -> 5 elements, sum)"});
  }
  SECTION("count of an all_gather") {
    check_mismatch(
        [](Communicator& c) {
          const int64_t k = c.rank() == 1 ? 2 : 3;
          return c.all_gather(Tensor::zeros({k}, DType::kI64), Tensor::zeros({3 * k}, DType::kI64));
        },
        {"different counts", "all_gather(i64, 3 -> 9 elements)",
         "rank 1 called all_gather(i64, 2 -> 6 elements)"});
  }
  SECTION("dtype") {
    check_mismatch(
        [](Communicator& c) {
          Tensor x = Tensor::zeros({4}, c.rank() == 2 ? DType::kBF16 : DType::kF32);
          return c.all_reduce(x, x, ReduceOp::kSum);
        },
        {"different dtypes", "all_reduce(f32, 4 -> 4 elements, sum)",
         "all_reduce(bf16, 4 -> 4 elements, sum)"});
  }
  SECTION("different collectives") {
    check_mismatch(
        [](Communicator& c) {
          Tensor x = Tensor::zeros({3}, DType::kF32);
          return c.rank() == 2 ? c.all_gather(x.narrow(0, 2, 1), x) : c.all_reduce(x, x, ReduceOp::kSum);
        },
        {"different collectives", "all_reduce(f32, 3 -> 3 elements, sum)",
         "rank 2 called all_gather(f32, 1 -> 3 elements)"});
  }
  SECTION("roots") {
    check_mismatch(
        [](Communicator& c) { return c.broadcast(Tensor::zeros({2}, DType::kU8), c.rank() == 2 ? 1 : 0); },
        {"different roots", "broadcast(u8, 2 -> 2 elements, root 0)",
         "broadcast(u8, 2 -> 2 elements, root 1)"});
  }
  SECTION("scatter roots") {
    check_mismatch(
        [](Communicator& c) {
          return c.scatter(Tensor::zeros({6}, DType::kF32), Tensor::zeros({2}, DType::kF32),
                           c.rank() == 1 ? 1 : 0);
        },
        {"different roots", "root 0", "root 1"});
  }
  SECTION("ops") {
    check_mismatch(
        [](Communicator& c) {
          Tensor x = Tensor::zeros({2}, DType::kI32);
          return c.reduce_scatter(Tensor::zeros({6}, DType::kI32), x,
                                  c.rank() == 2 ? ReduceOp::kMax : ReduceOp::kSum);
        },
        {"different reductions", "reduce_scatter(i32, 6 -> 2 elements, sum)",
         "reduce_scatter(i32, 6 -> 2 elements, max)"});
  }
  SECTION("pre-multipliers") {
    check_mismatch(
        [](Communicator& c) {
          Tensor x = Tensor::zeros({2}, DType::kF32);
          return c.all_reduce(x, x, c.rank() == 2 ? Reduction::premul_sum(0.5) : Reduction(ReduceOp::kSum));
        },
        {"different reductions", "all_reduce(f32, 2 -> 2 elements, sum)",
         "all_reduce(f32, 2 -> 2 elements, sum x 0.5)"});
  }
  SECTION("all_to_all_v counts that disagree") {
    check_mismatch(
        [](Communicator& c) {
          // Everybody sends 1 to everybody, but rank 1 expects 2 from rank 0 (and 0 from rank 2).
          std::vector<int64_t> send = {1, 1, 1}, recv = c.rank() == 1 ? std::vector<int64_t>{2, 1, 0}
                                                                      : std::vector<int64_t>{1, 1, 1};
          return c.all_to_all_v(Tensor::zeros({3}, DType::kF32), send, Tensor::zeros({3}, DType::kF32), recv);
        },
        {"all_to_all_v count mismatch on group 'world'",
         "rank 0 sends 1 elements to rank 1, which expects 2"});
  }
  SECTION("send without a matching receive") {
    check_mismatch(
        [](Communicator& c) {
          std::vector<P2POp> ops;
          if (c.rank() == 0) ops.push_back(P2POp::send(Tensor::zeros({4}, DType::kF32), 1));
          return c.send_recv(ops);
        },
        {"send_recv mismatch on group 'world'", "rank 0 posts 1 sends to rank 1, which posts 0 receives"});
  }
  SECTION("send and receive of different sizes and dtypes") {
    check_mismatch(
        [](Communicator& c) {
          std::vector<P2POp> ops;
          if (c.rank() == 0) ops.push_back(P2POp::send(Tensor::zeros({4}, DType::kF32), 2));
          if (c.rank() == 2) ops.push_back(P2POp::recv(Tensor::zeros({5}, DType::kF32), 0));
          return c.send_recv(ops);
        },
        {"send_recv mismatch", "send #0 from rank 0 to rank 2 has 4 f32 elements, the receive has 5 f32"});
    check_mismatch(
        [](Communicator& c) {
          std::vector<P2POp> ops;
          if (c.rank() == 1) ops.push_back(P2POp::send(Tensor::zeros({4}, DType::kF32), 2));
          if (c.rank() == 2) ops.push_back(P2POp::recv(Tensor::zeros({4}, DType::kI32), 1));
          return c.send_recv(ops);
        },
        {"send #0 from rank 1 to rank 2 has 4 f32 elements, the receive has 4 i32"});
    // Strided views: numel and dtype still have to match (shapes need not).
    check_mismatch(
        [](Communicator& c) {
          std::vector<P2POp> ops;
          const Tensor base = Tensor::zeros({4, 5}, DType::kF32);
          if (c.rank() == 0) ops.push_back(P2POp::send(base.narrow(1, 1, 3).narrow(0, 0, 2), 1));
          if (c.rank() == 1) ops.push_back(P2POp::recv(base.narrow(1, 0, 1), 0));
          return c.send_recv(ops);
        },
        {"send #0 from rank 0 to rank 1 has 6 f32 elements, the receive has 4 f32"});
    check_mismatch(
        [](Communicator& c) {
          std::vector<P2POp> ops;
          if (c.rank() == 2) ops.push_back(P2POp::send(Tensor::zeros({3, 4}, DType::kBF16).narrow(1, 0, 2), 0));
          if (c.rank() == 0) ops.push_back(P2POp::recv(Tensor::zeros({2, 6}, DType::kF16).narrow(1, 1, 3), 2));
          return c.send_recv(ops);
        },
        {"send #0 from rank 2 to rank 0 has 6 bf16 elements, the receive has 6 f16"});
  }
  SECTION("a split on some ranks, a barrier on the others") {
    for (int odd : {0, 2}) {
      INFO("the barrier is on rank " << odd);
      auto logs = run_logged(3, [&](Communicator& world, RankLog& log) {
        world.set_timeout(30s);
        if (world.rank() == odd) {
          expect_comm_error(log, world.barrier(), 30s, "barrier");
        } else {
          const std::vector<int> group = odd == 0 ? std::vector<int>{1, 2} : std::vector<int>{0, 1};
          timed(log, [&] {
            expect_throw<CommError>(
                log, [&] { world.split(group, "pair"); }, "split");
          });
        }
      });
      check_logs(logs);
      for (int r = 0; r < 3; ++r) {
        check_error(logs, r, 0, {"different collectives", "barrier()", "split("});
        check_within(logs, r, 0, kLate);  // at once, not after the 30 s timeout
      }
    }
  }
  SECTION("split groups that disagree") {
    auto logs = run_logged(3, [](Communicator& world, RankLog& log) {
      const std::vector<int> group = world.rank() == 2 ? std::vector<int>{2} : std::vector<int>{0, 1, 2};
      expect_throw<CommError>(
          log, [&] { world.split(group, "g"); }, "split");
    });
    check_logs(logs);
    for (int r = 0; r < 3; ++r) check_error(logs, r, 0, {"split of group 'world'", "passed group [0,1,2]"});
  }
}

// ---- failures: a rank throwing inside run_ranks ----

struct RankFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST_CASE("run_ranks: one rank's exception is re-raised promptly, the others never deadlock",
          "[collectives][local]") {
  SECTION("others blocked in wait() with a long timeout are woken") {
    std::vector<std::string> seen(4);
    const auto t0 = Clock::now();
    REQUIRE_THROWS_MATCHES(run_ranks(
                               4,
                               [&](Communicator& world) {
                                 Tensor x = Tensor::zeros({8}, DType::kF32);
                                 if (world.rank() == 1) {
                                   std::this_thread::sleep_for(50ms);
                                   throw RankFailure("rank 1 gave up");
                                 }
                                 try {
                                   world.wait(world.all_reduce(x, x, ReduceOp::kSum));
                                 } catch (const CommError& e) {
                                   seen[world.rank()] = e.what();
                                   throw;
                                 }
                               },
                               60s),
                           RankFailure, Catch::Matchers::Message("rank 1 gave up"));
    CHECK(Ms(Clock::now() - t0) < kLate);  // not the 60 s timeouts
    for (int r : {0, 2, 3})
      CHECK_THAT(seen[r], Contains("all_reduce on group 'world' abandoned: rank 1 failed: rank 1 gave up"));
  }
  SECTION("a rank that throws first thing; the others run several calls, a split and a batch") {
    const auto t0 = Clock::now();
    REQUIRE_THROWS_MATCHES(run_ranks(
                               8,
                               [](Communicator& world) {
                                 if (world.rank() == 5) throw std::logic_error("bad config on rank 5");
                                 const std::vector<int> g = {world.rank()};
                                 Tensor x = Tensor::zeros({2}, DType::kF32);
                                 auto w1 = world.all_reduce(x, x, ReduceOp::kSum);
                                 world.begin_batch();
                                 world.barrier();
                                 world.broadcast(x, 0);
                                 auto batch = world.end_batch();
                                 world.wait(batch);
                                 world.split(g, "x");
                               },
                               60s),
                           std::logic_error, Catch::Matchers::Message("bad config on rank 5"));
    CHECK(Ms(Clock::now() - t0) < kLate);  // not the 60 s timeouts
  }
  SECTION("others blocked in a sub-group, and in a dropped Work's destructor") {
    const auto t0 = Clock::now();
    REQUIRE_THROWS_MATCHES(
        run_ranks(
            4,
            [](Communicator& world) {
              const int r = world.rank();
              const std::vector<int> g = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
              auto sub = world.split(g, "pair");
              Tensor x = Tensor::zeros({2}, DType::kF32);
              if (r == 3) {
                std::this_thread::sleep_for(30ms);
                throw std::runtime_error("rank 3 out of memory");
              }
              if (r == 2) sub->wait(sub->all_reduce(x, x, ReduceOp::kSum));  // partner 3 never comes
              world.all_reduce(x, x, ReduceOp::kSum).reset();                // the destructor waits for 2, 3
              world.wait(world.barrier());
            },
            60s),
        std::runtime_error, Catch::Matchers::Message("rank 3 out of memory"));
    CHECK(Ms(Clock::now() - t0) < kLate);  // not the 60 s timeouts
  }
  SECTION("exceptions of any type, thrown from several ranks") {
    REQUIRE_THROWS_AS(run_ranks(
                          3,
                          [](Communicator& world) {
                            if (world.rank() == 2) throw 42;
                            world.wait(world.barrier());
                          },
                          60s),
                      int);
    // Every rank throws the same type: one of them is re-raised.
    REQUIRE_THROWS_WITH(run_ranks(3,
                                  [](Communicator& world) {
                                    throw InvalidArgument(fmt::format("rank {} failed", world.rank()));
                                  }),
                        Catch::Matchers::Matches("rank [012] failed"));
  }
  SECTION("no exception: run_ranks returns normally, even when ranks finish at different times") {
    std::atomic<int> done{0};
    REQUIRE_NOTHROW(run_ranks(3, [&](Communicator& world) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * world.rank()));
      world.wait(world.barrier());
      done.fetch_add(1);
    }));
    CHECK(done.load() == 3);
  }
}

}  // namespace

TEST_CASE("a rank that returns without joining fails the others at once", "[collectives][local]") {
  const auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(collectives::run_ranks(
                          3,
                          [](Communicator& world) {
                            if (world.rank() == 1) return;  // never joins
                            Tensor x = Tensor::zeros({4}, kernels::DType::kF32);
                            world.wait(world.all_reduce(x, x, ReduceOp::kSum));
                          },
                          Milliseconds{60'000}),
                      Catch::Contains("ranks [1] returned without joining it"));
  CHECK(std::chrono::steady_clock::now() - start < kLate);  // not the 60 s timeout
}
