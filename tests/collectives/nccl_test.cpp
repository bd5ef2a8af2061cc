// The nccl backend on GPUs, a program of its own (tests/support/gpu_test_main.cpp): without a GPU or
// without NCCL it reports skipped (exit 77); the clean refusals are checked in
// nccl_refusal_test.cpp. With GPUs: world 1 runs every collective on one GPU; with 2 or more, one thread per GPU
// is bootstrapped over the local backend and runs every collective x dtype x op; each rank checks
// its own result against a CPU computation of the expected values (each rank's inputs are a
// function of (rank, index), so no gather is needed). Plus nccl_communicators_all and a timeout.
//
// Rank threads do not use Catch2 assertions (Catch2 v2 is not thread-safe): they throw
// std::runtime_error, and run_ranks re-raises the first failure on the test thread.
#include "collectives/nccl.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "contract.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/stream.h"
#include "kernels/tensor.h"

using namespace collectives;
using Catch::Contains;
using kernels::Device;
using kernels::DType;

namespace {

// Timeout of the NCCL communicators in the functional tests (creation and every wait).
constexpr Milliseconds kNcclTimeout{60'000};

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Runs fn() and requires it to throw E whose message contains `part`.
template <class E>
void expect_throws(const std::function<void()>& fn, const std::string& part,
                   const std::string& what) {
  try {
    fn();
  } catch (const E& e) {
    expect(std::string(e.what()).find(part) != std::string::npos,
           fmt::format("{}: message '{}' lacks '{}'", what, e.what(), part));
    return;
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: threw the wrong exception: {}", what, e.what()));
  }
  throw std::runtime_error(fmt::format("{}: did not throw", what));
}

constexpr DType kDTypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                             DType::kI32, DType::kI64, DType::kU8};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kProd};

bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kF64 || d == DType::kBF16 || d == DType::kF16;
}

// Values moved without arithmetic, exact in every dtype: integers 0..199.
double moved(int rank, int64_t i) { return static_cast<double>((rank * 37 + i * 11) % 200); }

// Input of `rank` (of n) at element i of a reduction: small integers whose sums, products, minima,
// maxima and means are exact in every dtype (and non-negative for u8). For avg, the contributions
// at an element sum to n * base, so even integer averages are exact.
double reduce_input(ReduceOp op, DType dtype, int rank, int n, int64_t i) {
  const bool u8 = dtype == DType::kU8;
  switch (op) {
    case ReduceOp::kProd: {
      const double v = 1.0 + static_cast<double>((rank + i) % 2);
      return !u8 && rank == 0 && i % 3 == 0 ? -v : v;
    }
    case ReduceOp::kAvg: {
      const double base = 1.0 + static_cast<double>((i * 7) % 10);
      if (n % 2 == 1 && rank == n - 1) return base;
      return base + (rank % 2 == 0 ? 1.0 : -1.0);
    }
    default: {
      const double v = static_cast<double>((rank * 3 + i * 7) % 11);
      return u8 ? v : v - 5.0;
    }
  }
}

// The reduction over ranks 0..n-1 of reduce_input at element i (pre_multiplier: a sum of x * m).
double reduce_expected(ReduceOp op, double pre_multiplier, DType dtype, int n, int64_t i) {
  double acc = reduce_input(op, dtype, 0, n, i) * pre_multiplier;
  for (int r = 1; r < n; ++r) {
    const double x = reduce_input(op, dtype, r, n, i) * pre_multiplier;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += x; break;
      case ReduceOp::kMin: acc = std::min(acc, x); break;
      case ReduceOp::kMax: acc = std::max(acc, x); break;
      case ReduceOp::kProd: acc *= x; break;
    }
  }
  if (op == ReduceOp::kAvg) acc /= n;
  if (dtype == DType::kU8) acc = static_cast<double>(static_cast<int64_t>(acc) & 0xff);  // wraps
  return acc;
}

std::vector<double> values(int64_t count, const std::function<double(int64_t)>& f) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = f(i);
  return v;
}

Tensor on_gpu(const std::vector<double>& v, DType dtype, int device) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}, dtype, Device::cuda(device));
}

// Compares a CUDA result with the expected values: exactly, or (inexact: averages of narrow
// floats, which NCCL computes as a sum pre-multiplied by 1/n) within the dtype's precision.
void expect_values(const Tensor& result, const std::vector<double>& want, bool inexact,
                   const std::string& what) {
  const Tensor got = result.to(Device::cpu());
  const Tensor expected =
      Tensor::from_vector(want, {static_cast<int64_t>(want.size())}, result.dtype());
  bool ok = false;
  if (!inexact) {
    ok = kernels::equal(got, expected);
  } else {
    double rtol = 1e-12, atol = 1e-12;
    switch (result.dtype()) {
      case DType::kBF16:
        rtol = 2e-2;
        atol = 5e-2;
        break;
      case DType::kF16:
        rtol = 4e-3;
        atol = 1e-2;
        break;
      case DType::kF32:
        rtol = 1e-5;
        atol = 1e-5;
        break;
      default: break;
    }
    ok = kernels::allclose(got, expected, rtol, atol);
  }
  expect(ok, fmt::format("{}: got [{}], expected [{}]", what, fmt::join(got.to_vector(), ","),
                         fmt::join(want, ",")));
}

// Every collective of `comm` (an NCCL communicator on `device`) for one dtype.
void check_dtype(Communicator& comm, int device, DType dtype) {
  const int n = comm.size(), r = comm.rank();
  const std::string tag = fmt::format("rank {} of {}, {}", r, n, kernels::to_string(dtype));
  constexpr int64_t c = 5;

  // all_gather, out of place and in place (input = this rank's slice of the output).
  {
    Tensor in = on_gpu(values(c, [&](int64_t i) { return moved(r, i); }), dtype, device);
    Tensor out = Tensor::empty({n * c}, dtype, Device::cuda(device));
    comm.wait(comm.all_gather(in, out));
    const auto want =
        values(n * c, [&](int64_t k) { return moved(static_cast<int>(k / c), k % c); });
    expect_values(out, want, false, "all_gather " + tag);
    Tensor full = Tensor::zeros({n * c}, dtype, Device::cuda(device));
    full.narrow(0, r * c, c).copy_(in);
    comm.wait(comm.all_gather(full.narrow(0, r * c, c), full));
    expect_values(full, want, false, "all_gather in place " + tag);
  }

  // Reductions: every op, plus a pre-multiplied sum (0.5 for floats, 2 for integers).
  const double premul = is_float(dtype) ? 0.5 : 2.0;
  std::vector<std::pair<Reduction, std::string>> reductions;
  for (ReduceOp op : kOps)
    reductions.emplace_back(Reduction(op), std::string(kernels::to_string(op)));
  reductions.emplace_back(Reduction::premul_sum(premul), fmt::format("premul_sum x {}", premul));
  for (const auto& [reduction, name] : reductions) {
    const ReduceOp op = reduction.op;
    const double m = reduction.pre_multiplier;
    const bool inexact = op == ReduceOp::kAvg && is_float(dtype);
    // all_reduce out of place, then in place.
    Tensor in = on_gpu(values(c, [&](int64_t i) { return reduce_input(op, dtype, r, n, i); }),
                       dtype, device);
    Tensor out = Tensor::empty({c}, dtype, Device::cuda(device));
    comm.wait(comm.all_reduce(in, out, reduction));
    const auto want = values(c, [&](int64_t i) { return reduce_expected(op, m, dtype, n, i); });
    expect_values(out, want, inexact, fmt::format("all_reduce {} {}", name, tag));
    comm.wait(comm.all_reduce(in, in, reduction));
    expect_values(in, want, inexact, fmt::format("all_reduce in place {} {}", name, tag));
    // reduce_scatter: this rank gets the reduction of slice r.
    Tensor big = on_gpu(values(n * c, [&](int64_t k) { return reduce_input(op, dtype, r, n, k); }),
                        dtype, device);
    Tensor part = Tensor::empty({c}, dtype, Device::cuda(device));
    comm.wait(comm.reduce_scatter(big, part, reduction));
    const auto want_part =
        values(c, [&](int64_t i) { return reduce_expected(op, m, dtype, n, r * c + i); });
    expect_values(part, want_part, inexact, fmt::format("reduce_scatter {} {}", name, tag));
    // In place: the output is this rank's slice of the input.
    comm.wait(comm.reduce_scatter(big, big.narrow(0, r * c, c), reduction));
    expect_values(big.narrow(0, r * c, c), want_part, inexact,
                  fmt::format("reduce_scatter in place {} {}", name, tag));
  }

  // all_reduce whose output overlaps its input without being the same buffer (staged).
  {
    Tensor buf = on_gpu(
        values(c + 1, [&](int64_t i) { return reduce_input(ReduceOp::kSum, dtype, r, n, i); }),
        dtype, device);
    comm.wait(comm.all_reduce(buf.narrow(0, 0, c), buf.narrow(0, 1, c), ReduceOp::kSum));
    const auto want =
        values(c, [&](int64_t i) { return reduce_expected(ReduceOp::kSum, 1.0, dtype, n, i); });
    expect_values(buf.narrow(0, 1, c), want, false, "all_reduce overlapping " + tag);
  }

  // all_to_all: slice j of the input goes to member j.
  {
    Tensor in = on_gpu(values(n * c, [&](int64_t k) { return moved(r, k); }), dtype, device);
    Tensor out = Tensor::empty({n * c}, dtype, Device::cuda(device));
    comm.wait(comm.all_to_all(in, out));
    expect_values(
        out,
        values(n * c, [&](int64_t k) { return moved(static_cast<int>(k / c), r * c + k % c); }),
        false, "all_to_all " + tag);
  }

  // all_to_all_v: member r sends (r + j) % 3 elements to member j (some counts are zero).
  {
    auto count = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
    std::vector<int64_t> send_counts(n), recv_counts(n);
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < n; ++j) {
      send_counts[j] = count(r, j);
      recv_counts[j] = count(j, r);
      send_total += send_counts[j];
      recv_total += recv_counts[j];
    }
    std::vector<double> want;
    for (int j = 0; j < n; ++j) {
      int64_t offset = 0;  // where j's block for r starts in j's input
      for (int p = 0; p < r; ++p) offset += count(j, p);
      for (int64_t t = 0; t < count(j, r); ++t) want.push_back(moved(j, offset + t));
    }
    Tensor in = on_gpu(values(send_total, [&](int64_t k) { return moved(r, k); }), dtype, device);
    Tensor out = Tensor::empty({recv_total}, dtype, Device::cuda(device));
    comm.wait(comm.all_to_all_v(in, send_counts, out, recv_counts));
    expect_values(out, want, false, "all_to_all_v " + tag);
  }

  // broadcast and scatter from every root.
  for (int root = 0; root < n; ++root) {
    Tensor buf = on_gpu(values(c, [&](int64_t i) { return r == root ? moved(root, i) : 0.0; }),
                        dtype, device);
    comm.wait(comm.broadcast(buf, root));
    expect_values(buf, values(c, [&](int64_t i) { return moved(root, i); }), false,
                  fmt::format("broadcast from {} {}", root, tag));

    const auto want = values(c, [&](int64_t i) { return moved(root, r * c + i); });
    Tensor src =
        r == root ? on_gpu(values(n * c, [&](int64_t k) { return moved(root, k); }), dtype, device)
                  : Tensor();
    Tensor out = Tensor::empty({c}, dtype, Device::cuda(device));
    comm.wait(comm.scatter(src, out, root));
    expect_values(out, want, false, fmt::format("scatter from {} {}", root, tag));
    // The root's output may be its own slice of the input.
    Tensor dst =
        r == root ? src.narrow(0, root * c, c) : Tensor::empty({c}, dtype, Device::cuda(device));
    comm.wait(comm.scatter(src, dst, root));
    expect_values(dst, want, false, fmt::format("scatter in place from {} {}", root, tag));
  }

  // send_recv around the ring (to itself when n == 1).
  {
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor send = on_gpu(values(c, [&](int64_t i) { return moved(r, i); }), dtype, device);
    Tensor recv = Tensor::empty({c}, dtype, Device::cuda(device));
    const std::vector<P2POp> ops = {P2POp::send(send, next), P2POp::recv(recv, prev)};
    comm.wait(comm.send_recv(ops));
    expect_values(recv, values(c, [&](int64_t i) { return moved(prev, i); }), false,
                  "send_recv " + tag);
    // NCCL moves contiguous buffers only (the executor packs for it): a view is refused before
    // anything is posted.
    expect(!comm.p2p_views(), "nccl claims strided send_recv views " + tag);
    Tensor wide = Tensor::zeros({c, 2}, dtype, Device::cuda(device));
    const std::vector<P2POp> strided = {P2POp::send(wide.narrow(1, 0, 1), next), P2POp::recv(recv, prev)};
    expect_throws<kernels::InvalidArgument>([&] { comm.send_recv(strided); }, "must be contiguous",
                                            "strided send_recv " + tag);
  }

  // A batch: the calls' Works complete together with end_batch()'s.
  {
    Tensor in = on_gpu(values(c, [&](int64_t i) { return moved(r, i); }), dtype, device);
    Tensor gathered = Tensor::empty({n * c}, dtype, Device::cuda(device));
    Tensor summed =
        on_gpu(values(c, [&](int64_t i) { return reduce_input(ReduceOp::kSum, dtype, r, n, i); }),
               dtype, device);
    comm.begin_batch();
    WorkPtr w1 = comm.all_gather(in, gathered);
    WorkPtr w2 = comm.all_reduce(summed, summed, ReduceOp::kSum);
    expect_throws<kernels::InvalidArgument>([&] { w1->wait(kNcclTimeout); }, "still open",
                                            "wait inside a batch " + tag);
    WorkPtr all = comm.end_batch();
    comm.wait(all);
    w1->wait(kNcclTimeout);
    w2->wait(kNcclTimeout);
    expect(w1->completed() && w2->completed() && all->completed(), "batch completed() " + tag);
    expect_values(gathered,
                  values(n * c, [&](int64_t k) { return moved(static_cast<int>(k / c), k % c); }),
                  false, "batched all_gather " + tag);
    expect_values(
        summed,
        values(c, [&](int64_t i) { return reduce_expected(ReduceOp::kSum, 1.0, dtype, n, i); }),
        false, "batched all_reduce " + tag);
  }
}

// Everything on an NCCL communicator made over `world` (a local-backend world, one thread per
// rank), with device = world rank.
void check_all(Communicator& world) {
  const int device = world.rank();
  std::unique_ptr<Communicator> comm = nccl_communicator(world, device, kNcclTimeout);
  const int n = comm->size(), r = comm->rank();
  expect(comm->backend() == "nccl" && n == world.size() && r == world.rank() &&
             comm->name() == world.name() && comm->ranks() == world.ranks(),
         "communicator identity");

  // Argument errors leave the communicator usable.
  Tensor cpu = Tensor::zeros({4}, DType::kF32);
  expect_throws<kernels::InvalidArgument>([&] { comm->all_reduce(cpu, cpu, ReduceOp::kSum); },
                                          fmt::format("uses cuda:{}", device), "CPU tensor");
  if (n == 1 && kernels::cuda_device_count() > 1) {
    // Only with one rank: freeing memory on a GPU synchronises it, which would wait for another
    // rank's pending collective there (and that one waits for this rank).
    const int other = device + 1;
    Tensor elsewhere = Tensor::zeros({4}, DType::kF32, Device::cuda(other));
    expect_throws<kernels::InvalidArgument>(
        [&] { comm->all_reduce(elsewhere, elsewhere, ReduceOp::kSum); },
        fmt::format("is on cuda:{}", other), "tensor on another GPU");
  }
  Tensor ints = Tensor::zeros({4}, DType::kI32, Device::cuda(device));
  expect_throws<kernels::Unsupported>(
      [&] { comm->all_reduce(ints, ints, Reduction::premul_sum(0.5)); }, "pre-multiplier",
      "fractional pre-multiplier on i32");

  for (DType dtype : kDTypes) check_dtype(*comm, device, dtype);

  comm->wait(comm->barrier());

  // split: members of the same parity, in descending order of rank.
  std::vector<int> group;
  for (int m = n - 1; m >= 0; --m)
    if (m % 2 == r % 2) group.push_back(m);
  std::unique_ptr<Communicator> sub = comm->split(group, "parity");
  const int index = static_cast<int>(std::find(group.begin(), group.end(), r) - group.begin());
  expect(sub->size() == static_cast<int>(group.size()) && sub->rank() == index &&
             sub->name() == "parity" && sub->ranks() == group,
         fmt::format("split identity: rank {} of [{}]", sub->rank(), fmt::join(sub->ranks(), ",")));
  Tensor me = Tensor::full({1}, r, DType::kI32, Device::cuda(device));
  Tensor order = Tensor::empty({sub->size()}, DType::kI32, Device::cuda(device));
  sub->wait(sub->all_gather(me, order));
  std::vector<double> want(group.begin(), group.end());
  expect_values(order, want, false, "split order");
  sub->wait(sub->barrier());
  comm->wait(comm->barrier());
}

// Runs fn(i) on n threads and re-raises the first exception.
void run_threads(int n, const std::function<void(int)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard lk(mu);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace

TEST_CASE("nccl world of one GPU: every collective, dtype and op", "[collectives][nccl][gpu]") {
  REQUIRE_NOTHROW(run_ranks(1, check_all));
}

TEST_CASE("nccl one thread per GPU over a local bootstrap: every collective, dtype and op",
          "[collectives][nccl][gpu][gpu2]") {
  const int gpus = kernels::cuda_device_count();
  REQUIRE_NOTHROW(run_ranks(std::min(gpus, 8), check_all));
}

// The contract suite (contract.h), the cases the nccl backend promises (not the CPU backends'
// integer arithmetic nor dropped Works), on one thread per GPU (up to 8) over a local bootstrap.
TEST_CASE("nccl: contract, one thread per GPU", "[collectives][nccl][gpu][contract]") {
  const int n = std::min(kernels::cuda_device_count(), 8);
  std::vector<const contract::Case*> cases;
  for (const contract::Case& c : contract::cases())
    if (!c.cpu_only) cases.push_back(&c);
  std::vector<std::vector<contract::Log>> logs(static_cast<size_t>(n));
  REQUIRE_NOTHROW(run_ranks(n, [&](Communicator& world) {
    const int device = world.rank();
    std::unique_ptr<Communicator> comm = nccl_communicator(world, device, kNcclTimeout);
    for (const contract::Case* c : cases)
      logs[static_cast<size_t>(device)].push_back(contract::run_case(*c, *comm, Device::cuda(device)));
  }));
  for (int r = 0; r < n; ++r) {
    REQUIRE(logs[static_cast<size_t>(r)].size() == cases.size());
    for (size_t k = 0; k < cases.size(); ++k) {
      const contract::Log& log = logs[static_cast<size_t>(r)][k];
      INFO(cases[k]->name << " on rank " << r << " of " << n << ":\n" << fmt::format("{}", fmt::join(log.failures, "\n")));
      CHECK(log.failures.empty());
      CHECK(log.checked > 0);
    }
  }
}

TEST_CASE("nccl_communicators_all: one communicator per GPU of the process",
          "[collectives][nccl][gpu]") {
  const int n = std::min(kernels::cuda_device_count(), 8);
  std::vector<int> devices(n);
  for (int i = 0; i < n; ++i) devices[i] = i;
  std::vector<std::unique_ptr<Communicator>> comms = nccl_communicators_all(devices, kNcclTimeout);
  REQUIRE(static_cast<int>(comms.size()) == n);
  for (int i = 0; i < n; ++i) {
    REQUIRE(comms[i]->rank() == i);
    REQUIRE(comms[i]->size() == n);
    REQUIRE(comms[i]->name() == "world");
  }
  REQUIRE_NOTHROW(run_threads(n, [&](int i) {
    Communicator& comm = *comms[i];
    Tensor x = Tensor::full({8}, i + 1, DType::kF32, Device::cuda(i));
    comm.wait(comm.all_reduce(x, x, ReduceOp::kSum));
    expect_values(x, std::vector<double>(8, n * (n + 1) / 2.0), false, fmt::format("rank {}", i));
  }));
  comms.clear();  // destroyed one after the other from this thread (NCCL joins them itself)
}

TEST_CASE("nccl: a rank that skips a collective makes the others fail within the timeout",
          "[collectives][nccl][gpu][gpu2]") {
  constexpr Milliseconds kWait{300};  // deliberate timeouts stay at most 300 ms
  REQUIRE_NOTHROW(run_ranks(2, [&](Communicator& world) {
    const int device = world.rank();
    auto comm = nccl_communicator(world, device, Milliseconds{5000});
    Tensor x = Tensor::full({1024}, 1.0, DType::kF32, Device::cuda(device));
    comm->wait(comm->all_reduce(x, x, ReduceOp::kSum));  // call #0: both ranks are connected
    if (world.rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      WorkPtr work = comm->all_reduce(x, x, ReduceOp::kSum);  // call #1: rank 1 never joins
      std::string message;
      try {
        work->wait(kWait);
      } catch (const kernels::CommError& e) {
        message = e.what();
      }
      const auto elapsed = std::chrono::steady_clock::now() - start;
      expect(!message.empty(), "no CommError on rank 0");
      for (const char* part : {"all_reduce (call #1)", "group 'world'", "timed out after 300 ms",
                               "unknown to NCCL", "aborted"})
        expect(message.find(part) != std::string::npos,
               fmt::format("message '{}' lacks '{}'", message, part));
      expect(elapsed >= kWait && elapsed < kWait + std::chrono::seconds(30),
             fmt::format("failed after {} ms",
                         std::chrono::duration_cast<Milliseconds>(elapsed).count()));
      // The communicator is broken from now on.
      expect_throws<kernels::CommError>([&] { comm->barrier(); }, "unusable", "call after abort");
      expect(work->completed(), "completed() after the failure");
    }
    world.wait(world.barrier());  // rank 1 waits here until rank 0 has failed and aborted
    if (world.rank() == 1) {
      // Rank 0 aborted, so rank 1 cannot complete a collective it has never started: rank 1
      // times out and aborts in turn (NCCL's teardown expects every rank of a node to destroy or
      // abort its communicator). Its first all_reduce pairs with rank 0's aborted call #1 and
      // might still complete from data rank 0 sent before its kernel stopped; the second cannot.
      bool failed = false;
      for (int attempt = 0; attempt < 2 && !failed; ++attempt) {
        try {
          comm->all_reduce(x, x, ReduceOp::kSum)->wait(kWait);
        } catch (const kernels::CommError&) {
          failed = true;
        }
      }
      expect(failed, "rank 1's all_reduce with an aborted rank 0 did not fail");
    }
  }));
}

TEST_CASE("nccl: a stream waits for a call's Work without the host waiting", "[collectives][nccl][gpu][stream]") {
  const kernels::Device gpu = kernels::Device::cuda(0);
  const int64_t n = int64_t{1} << 22;
  int rounds = 0;
  collectives::run_ranks(1, [&](Communicator& world) {
    std::unique_ptr<Communicator> comm = nccl_communicator(world, 0, kNcclTimeout);
    Tensor x = Tensor::empty({n}, DType::kF32);
    x.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(i[0] % 977); });
    const Tensor gx = x.to(gpu);
    Tensor y = Tensor::empty({n}, DType::kF32, gpu), z = Tensor::empty({n}, DType::kF32, gpu);
    const kernels::Stream s = kernels::Stream::create(gpu);
    for (int r = 0; r < 3; ++r, ++rounds) {
      z.fill_(-1.0);
      kernels::Stream::compute(gpu).synchronize();
      WorkPtr w = comm->all_reduce(gx, y, kernels::ReduceOp::kSum);
      w->wait_on(s, kNcclTimeout);  // device-side: s runs the copy after the all_reduce
      kernels::detail::cuda_memcpy_async(z.data_ptr(), y.data_ptr(), y.nbytes(), reinterpret_cast<void*>(s.id()), 0);
      s.synchronize();
      if (!kernels::equal(z.to(kernels::Device::cpu()), x)) throw std::runtime_error("z != x after wait_on");
      w->wait(kNcclTimeout);
    }
  });
  REQUIRE(rounds == 3);
}
