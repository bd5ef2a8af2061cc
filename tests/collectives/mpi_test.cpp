// The mpi backend (collectives/mpi.h), run by mpirun with 1 to 4 processes (main() is in
// mpi_test_main.cpp). Every rank runs the same test cases in the same order and checks its own
// output. Element values are small integers, a function of (rank, index), exact in every dtype,
// and expected reductions are folded with the same kernels the local backend uses
// (kernels::reduce_into / scale_), so results must match element for element.
//
// Covered: every collective x dtypes x ops, zero and uneven counts, in place and out of place,
// batches, concurrent send_recv exchanges, strided send_recv views as derived datatypes
// (p2p_views_cases.h, shared with the local test), split into sub-groups (2x2 on 4 ranks) in a
// chosen order, argument errors, check_calls mismatches, a receive shorter than its buffer, a
// straggler that never joins (the timeout names it, the group is poisoned, and the straggler
// still completes later), a split that a rank never joins, and the in-order engine (calls
// complete while a rank makes no MPI call at all; chains across communicators through wait_for
// and host tasks, issued at once; a call held up by a dependency names what it waits for).
#include "collectives/mpi.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <catch2/catch.hpp>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include <unistd.h>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "p2p_views_cases.h"

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

constexpr DType kCore[] = {DType::kF32, DType::kBF16, DType::kI64, DType::kU8};
constexpr DType kAll[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                          DType::kI32, DType::kI64, DType::kU8};

std::string str(DType d) { return std::string(kernels::to_string(d)); }

// A small integer, exact in every dtype; prod inputs stay in {1, 2} so products stay small.
double value(DType dt, int rank, int64_t i, ReduceOp op = ReduceOp::kSum) {
  if (op == ReduceOp::kProd) return 1 + (rank + i) % 2;
  const int64_t v = (rank * 7 + i * 3) % 11;
  return dt == DType::kU8 ? static_cast<double>(v) : static_cast<double>(v - 5);
}

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

// The reduction over members of value(dt, r, offset + i), folded like the local backend.
Tensor expected_reduction(DType dt, int64_t n, int64_t offset, Reduction red, int members) {
  auto input = [&](int r) {
    return filled(dt, n, [&](int64_t i) { return value(dt, r, offset + i, red.op); });
  };
  Tensor acc = input(0);
  if (red.pre_multiplier != 1.0) kernels::scale_(acc, red.pre_multiplier);
  for (int r = 1; r < members; ++r) kernels::reduce_into(acc, input(r), red.op, red.pre_multiplier);
  if (red.op == ReduceOp::kAvg) kernels::scale_(acc, 1.0 / members);
  return acc;
}

std::vector<Reduction> reductions() {
  return {ReduceOp::kSum, ReduceOp::kAvg,  ReduceOp::kMin,
          ReduceOp::kMax, ReduceOp::kProd, Reduction::premul_sum(0.5)};
}
std::string str(Reduction r) {
  return r.pre_multiplier != 1.0 ? fmt::format("premul_sum({})", r.pre_multiplier)
                                 : std::string(kernels::to_string(r.op));
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

TEST_CASE("mpi: all_gather", "[mpi]") {
  const int n = W().size(), me = W().rank();
  for (DType dt : kAll)
    for (int64_t count : {0, 1, 5, 1000})
      for (bool in_place : {false, true}) {
        const std::string what =
            fmt::format("all_gather {} x{}{}", str(dt), count, in_place ? " in place" : "");
        Tensor out = Tensor::full({n * count}, 99, dt);
        Tensor in = filled(dt, count, [&](int64_t i) { return value(dt, me, i); });
        if (in_place) {
          out.narrow(0, me * count, count).copy_(in);
          in = out.narrow(0, me * count, count);
        }
        W().wait(W().all_gather(in, out));
        expect_values(
            out,
            [&](int64_t k) {
              return value(dt, static_cast<int>(k / std::max<int64_t>(count, 1)),
                           k % std::max<int64_t>(count, 1));
            },
            what);
      }
}

TEST_CASE("mpi: all_gather into a 2-d output", "[mpi]") {
  const int n = W().size(), me = W().rank();
  Tensor out = Tensor::zeros({n, 3}, DType::kF32);
  Tensor in = Tensor::full({3}, me + 1, DType::kF32);
  W().wait(W().all_gather(in, out));
  for (int r = 0; r < n; ++r)
    for (int64_t c = 0; c < 3; ++c) REQUIRE(out.item({r, c}) == r + 1);
}

TEST_CASE("mpi: all_reduce", "[mpi]") {
  const int n = W().size(), me = W().rank();
  for (DType dt : kAll)
    for (const Reduction& red : reductions())
      for (int64_t count : {0, 13})
        for (bool in_place : {false, true}) {
          const std::string what = fmt::format("all_reduce {} {} x{}{}", str(dt), str(red), count,
                                               in_place ? " in place" : "");
          Tensor in = filled(dt, count, [&](int64_t i) { return value(dt, me, i, red.op); });
          Tensor out = in_place ? in : Tensor::full({count}, 77, dt);
          W().wait(W().all_reduce(in, out, red));
          expect_equal(out, expected_reduction(dt, count, 0, red, n), what);
          if (!in_place)
            expect_values(
                in, [&](int64_t i) { return value(dt, me, i, red.op); }, what + " (input kept)");
        }
}

TEST_CASE("mpi: all_reduce of large buffers (MPI splits them; user ops see segments)", "[mpi]") {
  const int n = W().size(), me = W().rank();
  const int64_t count = 300'000;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI64})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      Tensor x = filled(dt, count, [&](int64_t i) { return value(dt, me, i, op); });
      W().wait(W().all_reduce(x, x, op));
      expect_equal(x, expected_reduction(dt, count, 0, op, n),
                   fmt::format("large all_reduce {} {}", str(dt), kernels::to_string(op)));
    }
}

TEST_CASE("mpi: all_reduce avg truncates integers toward zero like the local backend", "[mpi]") {
  const int n = W().size(), me = W().rank();
  // Sums -1, -5, 3, 7: with 3 or 4 members these do not divide evenly.
  Tensor x = Tensor::from_vector(
      {me == 0 ? -1.0 : 0.0, me == 0 ? -5.0 : 0.0, me == 0 ? 3.0 : 0.0, me == 0 ? 7.0 : 0.0}, {4},
      DType::kI64);
  W().wait(W().all_reduce(x, x, ReduceOp::kAvg));
  auto trunc = [n](double s) { return static_cast<double>(static_cast<int64_t>(s * (1.0 / n))); };
  REQUIRE(x.to_vector() == std::vector<double>{trunc(-1), trunc(-5), trunc(3), trunc(7)});
}

TEST_CASE("mpi: reduce_scatter", "[mpi]") {
  const int n = W().size(), me = W().rank();
  for (DType dt : kCore)
    for (const Reduction& red : reductions())
      for (int64_t count : {0, 1, 7})
        for (bool in_place : {false, true}) {
          const std::string what = fmt::format("reduce_scatter {} {} x{}{}", str(dt), str(red),
                                               count, in_place ? " in place" : "");
          Tensor in = filled(dt, n * count, [&](int64_t i) { return value(dt, me, i, red.op); });
          Tensor out = in_place ? in.narrow(0, me * count, count) : Tensor::full({count}, 77, dt);
          W().wait(W().reduce_scatter(in, out, red));
          expect_equal(out, expected_reduction(dt, count, me * count, red, n), what);
          // The rest of the input is untouched (the in-place form reduces into a temporary).
          for (int r = 0; r < n; ++r)
            if (r != me || !in_place)
              expect_values(
                  in.narrow(0, r * count, count),
                  [&](int64_t i) { return value(dt, me, r * count + i, red.op); },
                  what + " (input kept)");
        }
}

TEST_CASE("mpi: all_to_all", "[mpi]") {
  const int n = W().size(), me = W().rank();
  for (DType dt : kCore)
    for (int64_t c : {0, 3})
      for (bool in_place : {false, true}) {
        const std::string what =
            fmt::format("all_to_all {} x{}{}", str(dt), c, in_place ? " in place" : "");
        // Element k of the slice for member j, sent by member r: r*16 + j*4 + k.
        Tensor in = filled(dt, n * c, [&](int64_t i) { return me * 16 + (i / c) * 4 + i % c; });
        Tensor out = in_place ? in : Tensor::full({n * c}, 99, dt);
        W().wait(W().all_to_all(in, out));
        expect_values(
            out, [&](int64_t i) { return (i / c) * 16 + me * 4 + i % c; }, what);
      }
}

TEST_CASE("mpi: all_to_all_v with uneven and zero counts", "[mpi]") {
  const int n = W().size(), me = W().rank();
  auto count = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 3); };
  for (DType dt : kCore)
    for (bool in_place : {false, true}) {
      std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
      std::vector<double> in_values, out_values;
      for (int j = 0; j < n; ++j) {
        send[static_cast<size_t>(j)] = count(me, j);
        recv[static_cast<size_t>(j)] = count(j, me);
        for (int64_t k = 0; k < count(me, j); ++k)
          in_values.push_back(me * 16 + j * 4 + static_cast<double>(k));
        for (int64_t k = 0; k < count(j, me); ++k)
          out_values.push_back(j * 16 + me * 4 + static_cast<double>(k));
      }
      const auto total_in = static_cast<int64_t>(in_values.size()),
                 total_out = static_cast<int64_t>(out_values.size());
      Tensor in = Tensor::from_vector(in_values, {total_in}, dt);
      // In place: one buffer big enough for both directions, viewed twice.
      Tensor out = Tensor::full({total_out}, 99, dt);
      if (in_place && total_in == total_out) out = in;
      W().wait(W().all_to_all_v(in, send, out, recv));
      expect_equal(out, Tensor::from_vector(out_values, {total_out}, dt),
                   fmt::format("all_to_all_v {}{}", str(dt), in_place ? " in place" : ""));
    }
  // Argument errors are local: they throw before anything is sent, on every rank alike.
  Tensor in = Tensor::zeros({2}, DType::kF32), out = Tensor::zeros({2}, DType::kF32);
  std::vector<int64_t> wrong_size(static_cast<size_t>(n) + 1, 0);
  std::vector<int64_t> ok(static_cast<size_t>(n), 0);
  ok[0] = 2;
  REQUIRE_THROWS_AS(W().all_to_all_v(in, wrong_size, out, ok), InvalidArgument);
  std::vector<int64_t> huge = ok;
  huge[0] = int64_t{3} << 31;
  REQUIRE_THROWS_AS(W().all_to_all_v(in, huge, out, ok), Unsupported);
  REQUIRE_THROWS_WITH(W().all_to_all_v(in, huge, out, ok),
                      Contains("MPI counts and displacements are int"));
}

TEST_CASE("mpi: broadcast", "[mpi]") {
  const int n = W().size(), me = W().rank();
  for (int root = 0; root < n; ++root)
    for (DType dt : kCore)
      for (int64_t count : {0, 5}) {
        Tensor buf = me == root ? filled(dt, count, [&](int64_t i) { return value(dt, root, i); })
                                : Tensor::full({count}, 99, dt);
        W().wait(W().broadcast(buf, root));
        expect_values(
            buf, [&](int64_t i) { return value(dt, root, i); },
            fmt::format("broadcast {} x{} from {}", str(dt), count, root));
      }
}

TEST_CASE("mpi: scatter", "[mpi]") {
  const int n = W().size(), me = W().rank();
  const int64_t c = 4;
  for (int root = 0; root < n; ++root)
    for (DType dt : kCore)
      for (bool in_place : {false, true}) {
        Tensor in = me == root ? filled(dt, n * c, [&](int64_t i) { return value(dt, root, i); })
                               : Tensor();
        Tensor out = in_place && me == root ? in.narrow(0, root * c, c) : Tensor::full({c}, 99, dt);
        W().wait(W().scatter(in, out, root));
        expect_values(
            out, [&](int64_t i) { return value(dt, root, me * c + i); },
            fmt::format("scatter {} from {}{}", str(dt), root, in_place ? " in place" : ""));
      }
}

TEST_CASE("mpi: send_recv", "[mpi]") {
  const int n = W().size(), me = W().rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  SECTION("ring: two messages per neighbour, received in order") {
    Tensor a = Tensor::full({3}, me, DType::kF32), b = Tensor::full({5}, me + 100, DType::kI64);
    Tensor ra = Tensor::zeros({3}, DType::kF32), rb = Tensor::zeros({5}, DType::kI64);
    std::vector<P2POp> ops = {P2POp::send(a, next), P2POp::send(b, next), P2POp::recv(ra, prev),
                              P2POp::recv(rb, prev)};
    W().wait(W().send_recv(ops));
    expect_values(
        ra, [&](int64_t) { return prev; }, "ring first message");
    expect_values(
        rb, [&](int64_t) { return prev + 100; }, "ring second message");
  }
  SECTION("consecutive exchanges in flight together do not mix") {
    Tensor s1 = Tensor::full({4}, me + 10, DType::kI32),
           s2 = Tensor::full({4}, me + 20, DType::kI32);
    Tensor r1 = Tensor::zeros({4}, DType::kI32), r2 = Tensor::zeros({4}, DType::kI32);
    std::vector<P2POp> first = {P2POp::recv(r1, prev), P2POp::send(s1, next)};
    std::vector<P2POp> second = {P2POp::recv(r2, prev), P2POp::send(s2, next)};
    WorkPtr w1 = W().send_recv(first);
    WorkPtr w2 = W().send_recv(second);
    W().wait(w2);
    W().wait(w1);
    expect_values(
        r1, [&](int64_t) { return prev + 10; }, "first exchange");
    expect_values(
        r2, [&](int64_t) { return prev + 20; }, "second exchange");
  }
  SECTION("members with no ops still call; rank 0 sends to itself and to everyone") {
    std::vector<Tensor> sends, recvs;
    std::vector<P2POp> ops;
    Tensor mine = Tensor::zeros({2}, DType::kBF16);
    if (me == 0)
      for (int j = 0; j < n; ++j) {
        sends.push_back(Tensor::full({2}, j + 1, DType::kBF16));
        ops.push_back(P2POp::send(sends.back(), j));
      }
    ops.push_back(P2POp::recv(mine, 0));
    W().wait(W().send_recv(ops));
    expect_values(
        mine, [&](int64_t) { return me + 1; }, "from rank 0");
    std::vector<P2POp> none;
    W().wait(W().send_recv(none));
  }
  SECTION("a receive longer than what was sent is reported") {
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
}

TEST_CASE("mpi: send_recv with strided views (derived datatypes)", "[mpi]") {
  const int n = W().size(), me = W().rank();
  REQUIRE(W().p2p_views());
  std::vector<std::string> failures = p2p_views_cases::run_p2p_view_cases(W());
  for (const std::string& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());

  // On a split communicator (group ranks != world ranks): parity groups in descending order.
  std::vector<int> group;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) group.push_back(r);
  auto sub = W().split(group, "parity");
  REQUIRE(sub->p2p_views());
  failures = p2p_views_cases::run_p2p_view_cases(*sub);
  for (const std::string& f : failures) FAIL_CHECK("parity group: " + f);
  CHECK(failures.empty());

  // Large column blocks (an all-to-all of a [256, n x 512] f64 matrix by columns): each message
  // is 256 rows of 4 KiB, far above MPI's eager limit.
  const int64_t rows = 256, w = 512;
  Tensor t = Tensor::empty({rows, n * w}, DType::kF64);
  t.fill_index_([&](std::span<const int64_t> i) { return me * 1e7 + static_cast<double>(i[0] * n * w + i[1]); });
  Tensor out = Tensor::full({rows, n * w}, -1, DType::kF64);
  std::vector<P2POp> ops;
  for (int g = 0; g < n; ++g) {
    ops.push_back(P2POp::recv(out.narrow(1, g * w, w), g));
    ops.push_back(P2POp::send(t.narrow(1, g * w, w), g));
  }
  W().wait(W().send_recv(ops));
  int64_t bad = 0;
  const std::vector<double> got = out.to_vector();
  for (int64_t i = 0; i < rows; ++i)
    for (int g = 0; g < n; ++g)
      for (int64_t j = 0; j < w; ++j)
        if (got[static_cast<size_t>(i * n * w + g * w + j)] != g * 1e7 + static_cast<double>(i * n * w + me * w + j)) ++bad;
  CHECK(bad == 0);

  // A strided receive longer than the strided send is reported, counted in elements.
  if (n >= 2) {
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

  // Refused before anything is posted: fp8 in a view. (Negative strides cannot be built.)
  std::vector<P2POp> fp8 = {P2POp::send(Tensor::zeros({4, 4}, DType::kF8E4M3).narrow(1, 1, 2), 0)};
  REQUIRE_THROWS_WITH(W().send_recv(fp8), Contains("send_recv on group 'world': dtype f8e4m3 is not supported"));
  REQUIRE_THROWS_AS(t.as_strided({4}, {-1}, 3), InvalidArgument);
  W().wait(W().barrier());
}

TEST_CASE("mpi: batch", "[mpi]") {
  const int n = W().size(), me = W().rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  Tensor g_in = Tensor::full({2}, me, DType::kI64), g_out = Tensor::zeros({2 * n}, DType::kI64);
  Tensor sum = Tensor::full({3}, me + 1, DType::kBF16);
  Tensor bc = Tensor::full({4}, me == 0 ? 42 : 0, DType::kU8);
  Tensor s = Tensor::full({1}, me, DType::kF32), r = Tensor::zeros({1}, DType::kF32);
  std::vector<P2POp> ops = {P2POp::send(s, next), P2POp::recv(r, prev)};
  W().begin_batch();
  WorkPtr w1 = W().all_gather(g_in, g_out);
  W().all_reduce(sum, sum, ReduceOp::kSum);
  W().broadcast(bc, 0);
  W().send_recv(ops);
  REQUIRE_THROWS_AS(W().begin_batch(), InvalidArgument);
  WorkPtr all = W().end_batch();
  W().wait(all);
  REQUIRE(all->completed());
  REQUIRE(w1->completed());
  expect_values(
      g_out, [](int64_t i) { return i / 2; }, "batched all_gather");
  expect_values(
      sum, [&](int64_t) { return n * (n + 1) / 2; }, "batched all_reduce");
  expect_values(
      bc, [](int64_t) { return 42; }, "batched broadcast");
  expect_values(
      r, [&](int64_t) { return prev; }, "batched send_recv");
  REQUIRE_THROWS_AS(W().end_batch(), InvalidArgument);
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

TEST_CASE("mpi: split into sub-groups in the order asked for", "[mpi]") {
  const int n = W().size(), me = W().rank();
  W().set_timeout(20'000ms);
  // Even ranks and odd ranks, each group listed in descending order.
  std::vector<int> group;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) group.push_back(r);
  auto sub = W().split(group, "parity");
  REQUIRE(sub->name() == "parity");
  REQUIRE(sub->ranks() == group);
  REQUIRE(sub->ranks()[static_cast<size_t>(sub->rank())] == me);
  REQUIRE(sub->timeout() == 20'000ms);
  REQUIRE(sub->backend() == "mpi");
  Tensor out = Tensor::zeros({sub->size()}, DType::kI32);
  sub->wait(sub->all_gather(Tensor::full({1}, me, DType::kI32), out));
  expect_values(
      out, [&](int64_t i) { return group[static_cast<size_t>(i)]; }, "all_gather in group order");
  W().set_timeout(30'000ms);

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

TEST_CASE("mpi: argument errors", "[mpi]") {
  const int n = W().size();
  Tensor f8 = Tensor::zeros({n}, DType::kF8E4M3);
  REQUIRE_THROWS_WITH(W().all_gather(Tensor::zeros({1}, DType::kF8E4M3), f8),
                      Contains("dtype f8e4m3 is not supported"));
  REQUIRE_THROWS_AS(
      W().all_gather(Tensor::zeros({2}, DType::kF32), Tensor::zeros({2 * n + 1}, DType::kF32)),
      InvalidArgument);
  REQUIRE_THROWS_AS(W().all_reduce(Tensor::zeros({2}, DType::kF32), Tensor::zeros({2}, DType::kI32),
                                   ReduceOp::kSum),
                    InvalidArgument);
  REQUIRE_THROWS_WITH(W().broadcast(Tensor::zeros({2}, DType::kF32), n),
                      Contains("root " + std::to_string(n) + " out of range"));
  Reduction bad = Reduction::premul_sum(2.0);
  bad.op = ReduceOp::kMax;
  REQUIRE_THROWS_AS(
      W().all_reduce(Tensor::zeros({2}, DType::kF32), Tensor::zeros({2}, DType::kF32), bad),
      InvalidArgument);
  std::vector<P2POp> ops = {P2POp::send(Tensor::zeros({1}, DType::kF32), n)};
  REQUIRE_THROWS_AS(W().send_recv(ops), InvalidArgument);
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
                        "member joined, ranks [1] have not completed it; collective mismatch: rank "
                        "1 called send_recv(1 ops) but rank 0 called send_recv(0 ops)",
                        fmt::join(std::vector<int>(W().ranks()), ","))));
  else
    fresh->wait(w);
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
