// The local backend's own behaviour (collectives/local.h); what every backend must do is in the
// contract suite (contract.h, run on this backend by contract_local_test.cpp), its failures
// (timeouts, mismatches between ranks, exceptions in run_ranks) in local_failure_test.cpp. Here:
// small calls in one rendezvous, the barrier's ordering, completion by polling, splits of a 2x4
// grid and the local-only argument errors. Rank threads record, the main thread checks (NOTE
// [rank-side checks] in local_test.h).
#include "local_test.h"

namespace {

using namespace local_test;

// ---- small calls in one rendezvous (NOTE [eager small calls] in collectives/local.cpp) ----

// Below 8 KiB a member copies what the others read from it when it posts, and leaves as soon as
// it has its result: its buffers must be free (and its result final) at once, whatever the others
// are still doing. Sizes straddle the threshold, so both protocols, and members of one call using
// different ones, are checked.
TEST_CASE("small calls: inputs reusable at once, both protocols mixed in one call", "[collectives][local]") {
  const int n = GENERATE(2, 3, 4, 8);
  auto logs = run_logged(n, [](Communicator& world, RankLog& log) {
    const int n = world.size(), r = world.rank();
    int cases = 0;
    // all_gather and all_reduce around the threshold (f32: 2048 elements = 8 KiB), in place and
    // not, the input overwritten right after each wait while slower members may still read it.
    for (int64_t count : {int64_t{2047}, int64_t{2048}, int64_t{2049}, int64_t{5000}})
      for (int it = 0; it < 6; ++it) {
        if (r == n - 1 && it % 3 == 0) std::this_thread::sleep_for(1ms);  // a late member
        const auto v = [&](int m, int64_t i) { return static_cast<double>((m * 5 + i * 3 + it) % 13); };
        Tensor in = filled(count, DType::kF32, [&](int64_t i) { return v(r, i); });
        Tensor out = Tensor::full({n * count}, 99, DType::kF32);
        world.wait(world.all_gather(in, out));
        in.fill_(-1);
        expect_elements(
            log, out, n * count, [&](int64_t k) { return v(static_cast<int>(k / count), k % count); },
            fmt::format("all_gather count {} iteration {} on {} ranks", count, it, n));
        Tensor acc = filled(count, DType::kF32, [&](int64_t i) { return v(r, i); });
        world.wait(world.all_reduce(acc, acc, ReduceOp::kSum));  // in place
        expect_elements(
            log, acc, count,
            [&](int64_t i) {
              double sum = 0;
              for (int m = 0; m < n; ++m) sum += v(m, i);
              return sum;
            },
            fmt::format("all_reduce in place count {} iteration {} on {} ranks", count, it, n));
        Tensor rs_in = filled(n * count, DType::kF32, [&](int64_t i) { return v(r, i); });
        Tensor rs_out = Tensor::full({count}, 99, DType::kF32);
        world.wait(world.reduce_scatter(rs_in, rs_out, ReduceOp::kSum));
        rs_in.fill_(-1);
        expect_elements(
            log, rs_out, count,
            [&](int64_t i) {
              double sum = 0;
              for (int m = 0; m < n; ++m) sum += v(m, r * count + i);
              return sum;
            },
            fmt::format("reduce_scatter count {} iteration {} on {} ranks", count, it, n));
        ++cases;
      }
    // all_to_all_v where rank 0 sends 4000 f32 (16 KiB: two-phase) to every peer and the others
    // send 3 (eager): every member of one call reads a mix of copies and live buffers.
    const auto cnt = [](int from) { return from == 0 ? int64_t{4000} : int64_t{3}; };
    for (int it = 0; it < 4; ++it) {
      std::vector<int64_t> send(n, cnt(r)), recv(n);
      for (int j = 0; j < n; ++j) recv[j] = cnt(j);
      int64_t recv_total = 0;
      for (int64_t c : recv) recv_total += c;
      Tensor in = filled(n * cnt(r), DType::kF32, [&](int64_t i) { return value(DType::kF32, r + it, i); });
      Tensor out = Tensor::full({recv_total}, 99, DType::kF32);
      world.wait(world.all_to_all_v(in, send, out, recv));
      in.fill_(-1);
      std::vector<double> want;
      for (int j = 0; j < n; ++j)
        for (int64_t e = 0; e < cnt(j); ++e) want.push_back(value(DType::kF32, j + it, r * cnt(j) + e));
      expect_elements(
          log, out, recv_total, [&](int64_t k) { return want[k]; },
          fmt::format("all_to_all_v mixed sizes iteration {} on {} ranks", it, n));
      ++cases;
    }
    // Strided send views (copied contiguous when posted) to the next rank, received strided.
    {
      Tensor src = filled(64, DType::kF32, [&](int64_t i) { return value(DType::kF32, r, i); }).view({8, 8});
      Tensor dst = Tensor::full({8, 8}, 99, DType::kF32);
      const int to = (r + 1) % n, from = (r + n - 1) % n;
      const std::vector<P2POp> ops = {{P2POp::Kind::kSend, src.narrow(1, 2, 3), to},
                                      {P2POp::Kind::kRecv, dst.narrow(1, 4, 3), from}};
      world.wait(world.send_recv(ops));
      src.fill_(-1);
      expect_elements(
          log, dst, 64,
          [&](int64_t k) {
            const int64_t row = k / 8, col = k % 8;
            return col >= 4 && col < 7 ? value(DType::kF32, from, row * 8 + col - 2) : 99.0;
          },
          fmt::format("send_recv strided views on {} ranks", n));
      ++cases;
    }
    log.expect(cases == 4 * 6 + 4 + 1, fmt::format("ran {} cases", cases));
  });
  CHECK(check_logs(logs) > 0);
}

// ---- barrier ----


TEST_CASE("barrier: nobody leaves before everybody arrived", "[collectives][local]") {
  const int n = GENERATE(1, 2, 3, 4, 8);
  std::atomic<int> arrived{0};
  auto logs = run_logged(n, [&](Communicator& world, RankLog& log) {
    for (int round = 1; round <= 20; ++round) {
      if ((world.rank() + round) % 3 == 0) std::this_thread::sleep_for(200us);  // stragglers
      arrived.fetch_add(1);
      world.wait(world.barrier());
      const int seen = arrived.load();
      log.expect(seen >= round * world.size(),
                 fmt::format("round {}: left the barrier after {} arrivals", round, seen));
      world.wait(world.barrier());  // nobody starts round + 1 before everybody checked round
    }
  });
  check_logs(logs);
  CHECK(arrived.load() == 20 * n);
}

// ---- completed() ----


TEST_CASE("completed() makes progress without wait() and never blocks", "[collectives][local]") {
  const int n = GENERATE(1, 2, 3, 4);
  std::atomic<int> posted{0};
  auto logs = run_logged(n, [&](Communicator& world, RankLog& log) {
    const int r = world.rank();
    Tensor x = Tensor::full({6}, r + 1, DType::kF64);
    WorkPtr w;
    if (r == 0) {
      w = world.all_reduce(x, x, ReduceOp::kSum);
      if (world.size() > 1) log.expect(!w->completed(), "completed() before the others joined");
      posted.store(1);
    } else {
      log.expect(eventually([&] { return posted.load() == 1; }), "rank 0 never posted");
      w = world.all_reduce(x, x, ReduceOp::kSum);
    }
    // Every rank only polls: the call must still complete, with the result in place.
    log.expect(eventually([&] { return w->completed(); }), "completed() never became true");
    const int n = world.size();
    expect_elements(
        log, x, 6, [&](int64_t) { return n * (n + 1) / 2.0; }, "all_reduce completed by polling");
    try {
      w->wait(0ms);  // no time to wait: returns only if the call is complete
    } catch (const std::exception& e) {
      log.fail(fmt::format("wait(0ms) after completed(): {}", e.what()));
    }
  });
  check_logs(logs);
}

TEST_CASE("wait_on a stream: the CPU stream waits on the host", "[collectives][local]") {
  const int n = GENERATE(1, 3);
  auto logs = run_logged(n, [&](Communicator& world, RankLog& log) {
    Tensor x = Tensor::full({5}, world.rank() + 1, DType::kF64);
    WorkPtr w = world.all_reduce(x, x, ReduceOp::kSum);
    w->wait_on(kernels::Stream(), 30'000ms);
    log.expect(w->completed(), "completed() after wait_on");
    const int size = world.size();
    expect_elements(log, x, 5, [&](int64_t) { return size * (size + 1) / 2.0; }, "all_reduce after wait_on");
  });
  check_logs(logs);
}


// ---- split ----

TEST_CASE("split: rows and columns of a 2x4 grid, nested splits, non-sorted groups", "[collectives][local]") {
  auto logs = run_logged(8, [](Communicator& world, RankLog& log) {
    const int g = world.rank(), row = g / 4, col = g % 4;
    // Mesh-dim style groups, ordered by coordinate: dim 0 = columns [c, c+4], dim 1 = rows.
    const std::vector<int> col_group = {col, col + 4},
                           row_group = {4 * row, 4 * row + 1, 4 * row + 2, 4 * row + 3};
    auto cols = world.split(col_group, fmt::format("mesh dim 0 [{}]", fmt::join(col_group, ",")));
    auto rows = world.split(row_group, fmt::format("mesh dim 1 [{}]", fmt::join(row_group, ",")));
    log.expect(cols->size() == 2 && cols->rank() == row && cols->ranks() == col_group, "column communicator");
    log.expect(rows->size() == 4 && rows->rank() == col && rows->ranks() == row_group, "row communicator");
    log.expect(rows->name() == fmt::format("mesh dim 1 [{}]", fmt::join(row_group, ",")),
               "row name: " + rows->name());
    log.expect(rows->backend() == "local", "backend name");

    // Collectives on both, interleaved, waited in reverse.
    Tensor rsum = Tensor::full({3}, g, DType::kI64);
    Tensor cgather = Tensor::empty({2 * 2}, DType::kF32);
    Tensor wsum = Tensor::full({2}, 1, DType::kI32);
    auto w1 = rows->all_reduce(rsum, rsum, ReduceOp::kSum);
    auto w2 = cols->all_gather(Tensor::full({2}, g, DType::kF32), cgather);
    auto w3 = world.all_reduce(wsum, wsum, ReduceOp::kSum);
    w3->wait(10s);
    w2->wait(10s);
    w1->wait(10s);
    expect_elements(
        log, rsum, 3, [&](int64_t) { return 16 * row + 6; }, "row all_reduce");
    expect_elements(
        log, cgather, 4, [&](int64_t k) { return col + 4 * (k / 2); }, "column all_gather");
    expect_elements(
        log, wsum, 2, [](int64_t) { return 8; }, "world all_reduce");

    // Non-sorted groups: the new group's order is the order given.
    const std::vector<int> odd_even = g % 2 ? std::vector<int>{7, 5, 3, 1} : std::vector<int>{6, 0, 4, 2};
    auto parity = world.split(odd_even, g % 2 ? "odd" : "even");
    const int prank = static_cast<int>(std::find(odd_even.begin(), odd_even.end(), g) - odd_even.begin());
    log.expect(parity->rank() == prank && parity->ranks() == odd_even, "parity communicator");
    Tensor pg = Tensor::empty({4}, DType::kI32);
    parity->wait(parity->all_gather(Tensor::full({1}, g, DType::kI32), pg));
    expect_elements(
        log, pg, 4, [&](int64_t k) { return odd_even[k]; }, "all_gather on a non-sorted group");
    Tensor pb = Tensor::full({1}, g, DType::kI32);
    parity->wait(parity->broadcast(pb, 0));
    expect_elements(
        log, pb, 1, [&](int64_t) { return odd_even[0]; }, "broadcast from member 0 of a non-sorted group");

    // Nested: each row (group ranks 0..3) splits into pairs, listed in reverse order.
    const int rr = rows->rank();
    const std::vector<int> pair = rr < 2 ? std::vector<int>{1, 0} : std::vector<int>{3, 2};
    auto pairs = rows->split(pair, "pair");
    const std::vector<int> pair_global = {row_group[pair[0]], row_group[pair[1]]};
    log.expect(pairs->ranks() == pair_global && pairs->size() == 2, "nested split ranks");
    Tensor pp = Tensor::empty({2}, DType::kI64);
    pairs->wait(pairs->all_gather(Tensor::full({1}, g, DType::kI64), pp));
    expect_elements(
        log, pp, 2, [&](int64_t k) { return pair_global[k]; }, "all_gather on a nested split");
    // Splitting a split again, into singletons.
    auto single = pairs->split(std::vector<int>{pairs->rank()}, "single");
    Tensor one = Tensor::full({3}, g, DType::kF32);
    single->wait(single->all_reduce(one, one, ReduceOp::kProd));
    expect_elements(
        log, one, 3, [&](int64_t) { return g; }, "all_reduce on a singleton");
    log.expect(single->ranks() == std::vector<int>{g}, "singleton ranks");
  });
  check_logs(logs);
}

// Matches an exception whose message contains `text`.
class MessageContains : public Catch::MatcherBase<std::exception> {
 public:
  explicit MessageContains(std::string text) : text_(std::move(text)) {}
  bool match(const std::exception& e) const override {
    return std::string(e.what()).find(text_) != std::string::npos;
  }
  std::string describe() const override { return "message contains \"" + text_ + "\""; }

 private:
  std::string text_;
};
#define CHECK_INVALID(expr, matcher) CHECK_THROWS_MATCHES(expr, InvalidArgument, matcher)

// ---- invalid arguments (thrown by the caller's thread before anything is posted) ----

TEST_CASE("a local world of more than kMaxLocalRanks ranks (or none) is refused naming the size",
          "[collectives][local]") {
  // One thread per rank: 1025 would start 1025 threads whose every collective waits on all.
  std::atomic<int> started{0};
  for (int size : {kMaxLocalRanks + 1, 2000, 0, -1}) {
    INFO(size);
    CHECK_INVALID(run_ranks(size, [&](Communicator&) { ++started; }), MessageContains(std::to_string(size)));
    CHECK_INVALID(LocalWorld(size), MessageContains("at most 1024"));
  }
  CHECK(started == 0);
  run_ranks(kMaxLocalRanks, [&](Communicator&) { ++started; });  // the limit itself is allowed
  CHECK(started == kMaxLocalRanks);
}

// The checks every backend shares (counts, dtypes, roots, peers, aliasing) are in the contract
// suite (contract.cpp, "invalid arguments" and "aliasing"); these are the local backend's own.
TEST_CASE("invalid batch, split and world arguments throw InvalidArgument naming the value, before anything is posted",
          "[collectives][local]") {
  LocalWorld world(3, 5s);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 3; ++r) comms.push_back(world.communicator(r));
  Communicator& c = *comms[0];
  CHECK_INVALID(c.end_batch(), MessageContains("end_batch on group 'world': no batch begun"));
  c.begin_batch();
  CHECK_INVALID(c.begin_batch(), MessageContains("already in a batch"));
  CHECK_INVALID(c.split(std::vector<int>{0}, "x"), MessageContains("not allowed inside a batch"));
  c.end_batch()->wait(0ms);                                                       // an empty batch
  CHECK_INVALID(c.split(std::vector<int>{1, 2}, "x"), MessageContains("[1,2]"));  // does not contain rank 0
  CHECK_INVALID(c.split(std::vector<int>{0, 3}, "x"), MessageContains("3"));      // out of range
  CHECK_INVALID(c.split(std::vector<int>{0, 1, 0}, "x"), MessageContains("[0,1,0]"));  // duplicate
  CHECK_INVALID(LocalWorld(0), MessageContains("size 0"));
  CHECK_INVALID(world.communicator(3), MessageContains("rank 3 out of range"));

  // Nothing was posted: the first call of every rank still matches.
  std::vector<RankLog> logs(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      try {
        Tensor x = Tensor::full({3}, r, DType::kI32);
        comms[r]->wait(comms[r]->all_reduce(x, x, ReduceOp::kSum));
        expect_elements(
            logs[r], x, 3, [](int64_t) { return 3; }, "all_reduce after the invalid calls");
      } catch (const std::exception& e) {
        logs[r].fail(e.what());
      }
    });
  for (auto& t : threads) t.join();
  check_logs(logs);
}

}  // namespace
