#include "contract.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <utility>

#include "kernels/error.h"
#include "kernels/tensor.h"
#include "p2p_views_cases.h"

namespace contract {

using collectives::Communicator;
using collectives::P2POp;
using collectives::ReduceOp;
using collectives::Reduction;
using collectives::WorkPtr;
using kernels::Device;
using kernels::DType;
using kernels::Tensor;
using namespace std::chrono_literals;

void Log::fail(std::string what) {
  if (failures.size() < 12) failures.push_back(std::move(what));
}
void Log::expect(bool ok, std::string_view what) {
  if (!ok) fail(std::string(what));
}

namespace {

// The dtypes every collective takes; the ones that do not reduce also move fp8 (as bytes).
constexpr DType kDTypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                             DType::kI32, DType::kI64, DType::kU8};
constexpr DType kMovedDTypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,    DType::kI32,
                                  DType::kI64, DType::kU8,  DType::kF8E4M3, DType::kF8E5M2};
constexpr int64_t kCounts[] = {0, 1, 7, 1000};

std::string name_of(DType d) { return std::string(kernels::to_string(d)); }
bool is_float(DType d) { return kernels::is_floating_point(d); }

// Element i of member r: -5..5 (0..10 for u8), exact in every dtype.
double value(DType d, int r, int64_t i) {
  const int v = static_cast<int>((r * 7 + i * 3) % 11);
  return d == DType::kU8 ? v : v - 5;
}

Tensor make(Device dev, DType d, int64_t n, const std::function<double(int64_t)>& f) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = f(i);
  return Tensor::from_vector(v, {n}, d, dev);
}
Tensor full(Device dev, DType d, int64_t n, double x) { return Tensor::full({n}, x, d, dev); }

// Every element of t (on any device) against want(i), exactly.
void expect_elements(Log& log, const Tensor& t, int64_t numel, const std::function<double(int64_t)>& want,
                     const std::string& what) {
  if (t.numel() != numel) {
    log.fail(fmt::format("{}: {} elements, expected {}", what, t.numel(), numel));
    return;
  }
  const std::vector<double> got = numel > 0 ? t.to_vector() : std::vector<double>{};
  int bad = 0;
  for (int64_t i = 0; i < numel; ++i) {
    const double w = want(i);
    if (got[static_cast<size_t>(i)] != w && bad++ < 3)
      log.fail(fmt::format("{}: element {} is {}, expected {}", what, i, got[static_cast<size_t>(i)], w));
  }
  log.checked += numel;
}

// fn() must throw InvalidArgument whose message contains `part` (and post nothing).
template <class F>
void expect_invalid(Log& log, F&& fn, const std::string& part, std::string_view what) {
  try {
    fn();
    log.fail(fmt::format("{}: did not throw", what));
  } catch (const kernels::InvalidArgument& e) {
    if (std::string_view(e.what()).find(part) == std::string_view::npos)
      log.fail(fmt::format("{}: message '{}' lacks '{}'", what, e.what(), part));
    else
      ++log.checked;
  } catch (const std::exception& e) {
    log.fail(fmt::format("{}: threw the wrong exception: {}", what, e.what()));
  }
}

// Proves that nothing was posted by the calls before: the next call of every member matches.
void still_in_step(Communicator& comm, Device dev, Log& log, std::string_view after) {
  const int n = comm.size(), r = comm.rank();
  Tensor x = full(dev, DType::kI32, 3, r);
  comm.wait(comm.all_reduce(x, x, ReduceOp::kSum));
  expect_elements(log, x, 3, [&](int64_t) { return n * (n - 1) / 2.0; }, fmt::format("all_reduce after {}", after));
}

// ---- reductions whose results are exact on every backend ----

struct RedCase {
  std::string name;
  Reduction red;
  bool floats_only = false;  // a fractional pre-multiplier: NCCL multiplies in the buffer's type
};
const std::vector<RedCase>& red_cases() {
  static const std::vector<RedCase> cases = {{"sum", ReduceOp::kSum},
                                             {"avg", ReduceOp::kAvg},
                                             {"min", ReduceOp::kMin},
                                             {"max", ReduceOp::kMax},
                                             {"prod", ReduceOp::kProd},
                                             {"premul_sum(3)", Reduction::premul_sum(3)},
                                             {"premul_sum(0.5)", Reduction::premul_sum(0.5), true}};
  return cases;
}

// Input of member r of n at element i: products stay within 8 in magnitude (at most three 2s on
// 8 ranks, -1 only for signed dtypes); the inputs of an average sum to n x an integer (members
// pair up as base + 1 and base - 1), so every backend's average is exact whatever its rounding.
double red_input(DType d, const Reduction& red, int r, int n, int64_t i) {
  switch (red.op) {
    case ReduceOp::kProd:
      if ((r + i) % 3 == 0) return 2;
      if (d != DType::kU8 && (r + 2 * i) % 5 == 0) return -1;
      return 1;
    case ReduceOp::kAvg: {
      const double base = 1 + static_cast<double>((i * 7) % 10);
      if (n % 2 == 1 && r == n - 1) return base;
      return base + (r % 2 == 0 ? 1 : -1);
    }
    default: return value(d, r, i);
  }
}
double red_expected(DType d, const Reduction& red, int n, int64_t i) {
  double acc = 0;
  for (int r = 0; r < n; ++r) {
    const double x = red_input(d, red, r, n, i);
    if (r == 0) {
      acc = red.op == ReduceOp::kSum || red.op == ReduceOp::kAvg ? x * red.pre_multiplier : x;
      continue;
    }
    switch (red.op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += x * red.pre_multiplier; break;
      case ReduceOp::kMin: acc = std::min(acc, x); break;
      case ReduceOp::kMax: acc = std::max(acc, x); break;
      case ReduceOp::kProd: acc *= x; break;
    }
  }
  return red.op == ReduceOp::kAvg ? acc / n : acc;
}

// ---- the cases ----

void all_gather(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (DType d : kMovedDTypes)
    for (int64_t count : kCounts)
      for (bool in_place : {false, true}) {
        Tensor out = full(dev, d, n * count, 99);
        Tensor mine = make(dev, d, count, [&](int64_t i) { return value(d, r, i); });
        Tensor in = mine;
        if (in_place) {
          in = out.narrow(0, r * count, count);
          in.copy_(mine);
        }
        comm.wait(comm.all_gather(in, out));
        expect_elements(
            log, out, n * count, [&](int64_t k) { return value(d, static_cast<int>(k / count), k % count); },
            fmt::format("all_gather {} count {}{}", name_of(d), count, in_place ? " in place" : ""));
      }
  // Multi-dimensional buffers gather in their flat order.
  Tensor out2 = Tensor::zeros({n * 2, 3}, DType::kF32, dev);
  comm.wait(comm.all_gather(Tensor::full({2, 3}, r, DType::kF32, dev), out2));
  expect_elements(log, out2, n * 6, [](int64_t k) { return static_cast<double>(k / 6); }, "all_gather 2-d");
}

void reduce_scatter(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (DType d : kDTypes)
    for (const RedCase& rc : red_cases()) {
      if (rc.floats_only && !is_float(d)) continue;
      for (int64_t count : kCounts)  // per member
        for (bool in_place : {false, true}) {
          const std::string what = fmt::format("reduce_scatter {} {} count {}{}", name_of(d), rc.name, count,
                                               in_place ? " in place" : "");
          auto in_fn = [&](int64_t i) { return red_input(d, rc.red, r, n, i); };
          Tensor in = make(dev, d, n * count, in_fn);
          Tensor out = in_place ? in.narrow(0, r * count, count) : full(dev, d, count, 99);
          comm.wait(comm.reduce_scatter(in, out, rc.red));
          expect_elements(
              log, out, count, [&](int64_t j) { return red_expected(d, rc.red, n, r * count + j); }, what);
          if (!in_place) expect_elements(log, in, n * count, in_fn, what + " (input untouched)");
        }
    }
}

void all_reduce(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (DType d : kDTypes)
    for (const RedCase& rc : red_cases()) {
      if (rc.floats_only && !is_float(d)) continue;
      for (int64_t count : kCounts)
        for (bool in_place : {false, true}) {
          const std::string what =
              fmt::format("all_reduce {} {} count {}{}", name_of(d), rc.name, count, in_place ? " in place" : "");
          auto in_fn = [&](int64_t i) { return red_input(d, rc.red, r, n, i); };
          Tensor in = make(dev, d, count, in_fn);
          Tensor out = in_place ? in : full(dev, d, count, 99);
          comm.wait(comm.all_reduce(in, out, rc.red));
          expect_elements(log, out, count, [&](int64_t i) { return red_expected(d, rc.red, n, i); }, what);
          if (!in_place) expect_elements(log, in, count, in_fn, what + " (input untouched)");
        }
    }
}

void all_to_all(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (DType d : kMovedDTypes)
    for (int64_t count : kCounts)  // per pair
      for (bool in_place : {false, true}) {
        Tensor in = make(dev, d, n * count, [&](int64_t i) { return value(d, r, i); });
        Tensor out = in_place ? in : full(dev, d, n * count, 99);
        comm.wait(comm.all_to_all(in, out));
        // Slice i of the output is slice r of member i's input.
        expect_elements(
            log, out, n * count,
            [&](int64_t k) { return value(d, static_cast<int>(k / count), r * count + k % count); },
            fmt::format("all_to_all {} count {}{}", name_of(d), count, in_place ? " in place" : ""));
      }
}

// Elements member `src` sends to member `dst` under pattern p (zeros included).
int64_t a2av_count(int p, int n, int src, int dst) {
  switch (p) {
    case 0: return (src * 3 + dst * 5 + 1) % 4;         // uneven, with zeros
    case 1: return src == 0 ? 0 : (src + dst) % 3 + 1;  // rank 0 sends nothing
    case 2: return dst == n - 1 ? 0 : 2;                // rank n-1 receives nothing
    case 3: return 0;                                   // nothing at all
    case 4: return src == dst ? 1000 : 1;               // one large block per rank
    case 5: return src == n - 1 ? 7 : 0;                // one sender (gather-like)
    default: return (src + dst) % 3;                    // symmetric: in place works
  }
}
constexpr int kA2avPatterns = 7;

void all_to_all_v(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (int p = 0; p < kA2avPatterns; ++p) {
    std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < n; ++j) {
      send[static_cast<size_t>(j)] = a2av_count(p, n, r, j);
      recv[static_cast<size_t>(j)] = a2av_count(p, n, j, r);
      send_total += send[static_cast<size_t>(j)];
      recv_total += recv[static_cast<size_t>(j)];
    }
    // In place needs equal totals on every member (decided collectively: symmetric patterns).
    bool symmetric = true;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) symmetric = symmetric && a2av_count(p, n, i, j) == a2av_count(p, n, j, i);
    // Expected: member i's block for r, its input at offset sum_{j<r} count(i, j).
    std::vector<int> src_of;
    std::vector<int64_t> index_of;
    for (int i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int j = 0; j < r; ++j) off += a2av_count(p, n, i, j);
      for (int64_t e = 0; e < recv[static_cast<size_t>(i)]; ++e) {
        src_of.push_back(i);
        index_of.push_back(off + e);
      }
    }
    for (DType d : kMovedDTypes)
      for (bool in_place : {false, true}) {
        if (in_place && !symmetric) continue;
        Tensor in = make(dev, d, send_total, [&](int64_t i) { return value(d, r, i); });
        Tensor out = in_place ? in : full(dev, d, recv_total, 99);
        comm.wait(comm.all_to_all_v(in, send, out, recv));
        expect_elements(
            log, out, recv_total,
            [&](int64_t k) { return value(d, src_of[static_cast<size_t>(k)], index_of[static_cast<size_t>(k)]); },
            fmt::format("all_to_all_v pattern {} {}{} (send [{}] recv [{}])", p, name_of(d),
                        in_place ? " in place" : "", fmt::join(send, ","), fmt::join(recv, ",")));
      }
  }
}

// fp8 (e4m3, e5m2) through send_recv (the other collectives that do not reduce take fp8 in their
// dtype sweeps, kMovedDTypes; the reducing ones refuse it: invalid_arguments).
void fp8_send_recv(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (DType d : {DType::kF8E4M3, DType::kF8E5M2}) {
    Tensor got = full(dev, d, 7, 1);
    const std::vector<P2POp> ring = {P2POp::send(make(dev, d, 7, [&](int64_t i) { return value(d, r, i); }), next),
                                     P2POp::recv(got, prev)};
    comm.wait(comm.send_recv(ring));
    expect_elements(log, got, 7, [&](int64_t i) { return value(d, prev, i); }, "send_recv " + name_of(d));
  }
}

void broadcast(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (int root = 0; root < n; ++root)
    for (DType d : kMovedDTypes)
      for (int64_t count : kCounts) {
        Tensor b = make(dev, d, count, [&](int64_t i) { return value(d, r, i); });
        comm.wait(comm.broadcast(b, root));
        expect_elements(log, b, count, [&](int64_t i) { return value(d, root, i); },
                        fmt::format("broadcast root {} {} count {}", root, name_of(d), count));
      }
}

void scatter(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (int root = 0; root < n; ++root)
    for (DType d : kMovedDTypes)
      for (int64_t count : kCounts) {
        const std::string tag = fmt::format("root {} {} count {}", root, name_of(d), count);
        // The input matters only at the root; elsewhere it is undefined or ignored.
        Tensor in = r == root ? make(dev, d, n * count, [&](int64_t i) { return value(d, root, i); })
                    : r % 2   ? Tensor()
                              : full(dev, DType::kF64, 3, 42);
        Tensor out = full(dev, d, count, 99);
        comm.wait(comm.scatter(in, out, root));
        expect_elements(log, out, count, [&](int64_t e) { return value(d, root, r * count + e); }, "scatter " + tag);
        if (r == root)
          expect_elements(log, in, n * count, [&](int64_t i) { return value(d, root, i); },
                          "scatter input untouched " + tag);
      }
  // In place at the root: its output is its own slice of the input.
  for (int root = 0; root < n; ++root) {
    const int64_t count = 5;
    Tensor in = make(dev, DType::kF32, n * count, [&](int64_t i) { return value(DType::kF32, root, i); });
    Tensor out = r == root ? in.narrow(0, root * count, count) : full(dev, DType::kF32, count, 0);
    comm.wait(comm.scatter(r == root ? in : Tensor(), out, root));
    expect_elements(log, out, count, [&](int64_t e) { return value(DType::kF32, root, r * count + e); },
                    fmt::format("scatter in place, root {}", root));
  }
}

void barrier(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size();
  for (int round = 0; round < 5; ++round) {
    comm.wait(comm.barrier());
    Tensor one = full(dev, DType::kI32, 1, 1);
    comm.wait(comm.all_reduce(one, one, ReduceOp::kSum));
    expect_elements(log, one, 1, [&](int64_t) { return n; }, fmt::format("all_reduce after barrier {}", round));
  }
}

double msg_value(int src, int dst, int m, int64_t e) { return static_cast<double>((src * 5 + dst * 3 + m * 7 + e) % 11); }
DType msg_dtype(int src, int dst, int m) { return kDTypes[(src + 2 * dst + m) % 7]; }

// Lengths of the messages src sends dst, in order, under pattern p.
std::vector<int64_t> p2p_plan(int p, int n, int src, int dst) {
  switch (p) {
    case 0: return dst == (src + 1) % n ? std::vector<int64_t>{7} : std::vector<int64_t>{};  // ring shift
    case 1: return dst == (src ^ 1) ? std::vector<int64_t>{5} : std::vector<int64_t>{};      // pairwise swap
    case 2:  // several messages to the same peer, in order
      return dst == (src + 1) % n ? std::vector<int64_t>{3, 0, 1000, 1} : std::vector<int64_t>{};
    case 3: return dst == (src + n - 1) % n ? std::vector<int64_t>{0, 0} : std::vector<int64_t>{};  // empty
    case 4: return src == 0 ? std::vector<int64_t>{dst + 1} : std::vector<int64_t>{};  // one sender, to itself too
    case 5: return {(src + dst) % 3};                                                    // all pairs
    case 6: return dst == n - 1 - src ? std::vector<int64_t>{4} : std::vector<int64_t>{};  // reversal
    default: return {};                                                                  // no ops
  }
}
constexpr int kP2PPatterns = 8;

void send_recv(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (int p = 0; p < kP2PPatterns; ++p) {
    std::vector<P2POp> sends, recvs;
    struct Expect {
      Tensor buf;
      int src, m;
    };
    std::vector<Expect> expects;
    for (int peer = 0; peer < n; ++peer) {
      const auto out = p2p_plan(p, n, r, peer);
      for (int m = 0; m < static_cast<int>(out.size()); ++m)
        sends.push_back(P2POp::send(
            make(dev, msg_dtype(r, peer, m), out[m], [&](int64_t e) { return msg_value(r, peer, m, e); }), peer));
      const auto in = p2p_plan(p, n, peer, r);
      for (int m = 0; m < static_cast<int>(in.size()); ++m) {
        Tensor buf = full(dev, msg_dtype(peer, r, m), in[m], 99);
        recvs.push_back(P2POp::recv(buf, peer));
        expects.push_back({buf, peer, m});
      }
    }
    // Op order within the call does not matter: odd ranks list receives first.
    std::vector<P2POp> ops = r % 2 ? recvs : sends;
    for (const P2POp& op : r % 2 ? sends : recvs) ops.push_back(op);
    comm.wait(comm.send_recv(ops));
    for (const Expect& x : expects)
      expect_elements(log, x.buf, x.buf.numel(), [&](int64_t e) { return msg_value(x.src, r, x.m, e); },
                      fmt::format("send_recv pattern {}: message {} from {}", p, x.m, x.src));
  }
  // Consecutive exchanges in flight together do not mix.
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Tensor s1 = full(dev, DType::kI32, 4, r + 10), s2 = full(dev, DType::kI32, 4, r + 20);
  Tensor r1 = full(dev, DType::kI32, 4, 0), r2 = full(dev, DType::kI32, 4, 0);
  const std::vector<P2POp> first = {P2POp::recv(r1, prev), P2POp::send(s1, next)};
  const std::vector<P2POp> second = {P2POp::recv(r2, prev), P2POp::send(s2, next)};
  WorkPtr w1 = comm.send_recv(first);
  WorkPtr w2 = comm.send_recv(second);
  comm.wait(w2);
  comm.wait(w1);
  expect_elements(log, r1, 4, [&](int64_t) { return prev + 10; }, "first of two exchanges in flight");
  expect_elements(log, r2, 4, [&](int64_t) { return prev + 20; }, "second of two exchanges in flight");
  // Send and receive through disjoint halves of one buffer.
  Tensor buf = make(dev, DType::kBF16, 18, [&](int64_t i) { return i < 9 ? msg_value(r, 0, 0, i) : 99; });
  const std::vector<P2POp> halves = {P2POp::send(buf.narrow(0, 0, 9), next), P2POp::recv(buf.narrow(0, 9, 9), prev)};
  comm.wait(comm.send_recv(halves));
  expect_elements(log, buf, 18, [&](int64_t i) { return i < 9 ? msg_value(r, 0, 0, i) : msg_value(prev, 0, 0, i - 9); },
                  "ring shift between halves of one buffer");
}

// Strided views where p2p_views(): p2p_views_cases.h on the communicator and on a split of it,
// and an all-to-all of column blocks received into one result. Elsewhere they are refused.
void send_recv_views(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n;
  if (!comm.p2p_views()) {
    const Tensor m = Tensor::zeros({4, 4}, DType::kF32, dev);
    const std::vector<P2POp> bad = {P2POp::send(m.narrow(1, 0, 1), next)};
    expect_invalid(log, [&] { comm.send_recv(bad); }, "send/recv tensor must be contiguous", "a strided send");
    still_in_step(comm, dev, log, "a refused strided send");
    return;
  }
  for (std::string& f : p2p_views_cases::run_p2p_view_cases(comm)) log.fail(std::move(f));
  // fp8 moves in a view as in a contiguous buffer: columns 1..2 of a 4 x 4 block to the next member.
  {
    const int prev = (r + n - 1) % n;
    const Tensor src = make(dev, DType::kF8E4M3, 16, [&](int64_t i) { return value(DType::kF8E4M3, r, i); })
                           .view({4, 4});
    Tensor dst = Tensor::zeros({4, 4}, DType::kF8E4M3, dev);
    const std::vector<P2POp> fp8 = {P2POp::send(src.narrow(1, 1, 2), next), P2POp::recv(dst.narrow(1, 1, 2), prev)};
    comm.wait(comm.send_recv(fp8));
    expect_elements(
        log, dst, 16,
        [&](int64_t i) { return i % 4 == 1 || i % 4 == 2 ? value(DType::kF8E4M3, prev, i) : 0.0; }, "fp8 in a view");
  }
  // On a split communicator (group ranks != global ranks): parity groups in descending order.
  std::vector<int> group;
  for (int q = n - 1; q >= 0; --q)
    if (q % 2 == r % 2) group.push_back(q);
  auto sub = comm.split(group, "parity");
  log.expect(sub->p2p_views(), "a split communicator takes views");
  for (std::string& f : p2p_views_cases::run_p2p_view_cases(*sub)) log.fail("parity group: " + f);
  log.checked += 1;
  // Column blocks of a [256, n x 512] f64 matrix to every member, received into the column
  // blocks of one result (receives that share a storage but no element); 4 KiB rows.
  const int64_t rows = 256, w = 512;
  Tensor t = Tensor::empty({rows, n * w}, DType::kF64, dev);
  t.fill_index_([&](std::span<const int64_t> i) { return r * 1e7 + static_cast<double>(i[0] * n * w + i[1]); });
  Tensor out = Tensor::full({rows, n * w}, -1, DType::kF64, dev);
  std::vector<P2POp> ops;
  for (int g = 0; g < n; ++g) {
    ops.push_back(P2POp::recv(out.narrow(1, g * w, w), g));
    ops.push_back(P2POp::send(t.narrow(1, g * w, w), g));
  }
  comm.wait(comm.send_recv(ops));
  expect_elements(
      log, out, rows * n * w,
      [&](int64_t k) {
        const int64_t i = k / (n * w), g = (k % (n * w)) / w, j = k % w;
        return g * 1e7 + static_cast<double>(i * n * w + r * w + j);
      },
      "column blocks of one result");
}

void batch(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  for (int round = 0; round < 2; ++round) {
    Tensor a = make(dev, DType::kF16, 11, [&](int64_t i) { return value(DType::kF16, r, i); });
    Tensor g = full(dev, DType::kI32, 3 * n, 0);
    Tensor g_in = full(dev, DType::kI32, 3, r);
    Tensor s = full(dev, DType::kF64, 4, r);
    Tensor s_out = full(dev, DType::kF64, 4, 0);
    std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    int64_t st = 0, rt = 0;
    for (int j = 0; j < n; ++j) {
      send[static_cast<size_t>(j)] = a2av_count(0, n, r, j);
      recv[static_cast<size_t>(j)] = a2av_count(0, n, j, r);
      st += send[static_cast<size_t>(j)];
      rt += recv[static_cast<size_t>(j)];
    }
    Tensor v_in = make(dev, DType::kU8, st, [&](int64_t i) { return value(DType::kU8, r, i); });
    Tensor v_out = full(dev, DType::kU8, rt, 0);
    Tensor b = full(dev, DType::kBF16, 2, r);
    const std::vector<P2POp> ops = {P2POp::send(s, (r + 1) % n), P2POp::recv(s_out, (r + n - 1) % n)};

    comm.begin_batch();
    const std::vector<WorkPtr> works = {comm.all_reduce(a, a, ReduceOp::kMax), comm.all_gather(g_in, g),
                                        comm.send_recv(ops),                   comm.all_to_all_v(v_in, send, v_out, recv),
                                        comm.broadcast(b, round % n),          comm.barrier()};
    WorkPtr all = comm.end_batch();
    comm.wait(all);
    log.expect(all->completed(), "batch not completed after wait");
    for (size_t k = 0; k < works.size(); ++k)
      log.expect(works[k]->completed(), fmt::format("batched work {} not completed", k));
    all->wait(0ms);

    expect_elements(log, a, 11, [&](int64_t i) {
      double m = value(DType::kF16, 0, i);
      for (int q = 1; q < n; ++q) m = std::max(m, value(DType::kF16, q, i));
      return m;
    }, "batched all_reduce");
    expect_elements(log, g, 3 * n, [](int64_t k) { return static_cast<double>(k / 3); }, "batched all_gather");
    expect_elements(log, s_out, 4, [&](int64_t) { return (r + n - 1) % n; }, "batched send_recv");
    std::vector<double> want;
    for (int i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int j = 0; j < r; ++j) off += a2av_count(0, n, i, j);
      for (int64_t e = 0; e < recv[static_cast<size_t>(i)]; ++e) want.push_back(value(DType::kU8, i, off + e));
    }
    expect_elements(log, v_out, rt, [&](int64_t k) { return want[static_cast<size_t>(k)]; }, "batched all_to_all_v");
    expect_elements(log, b, 2, [&](int64_t) { return round % n; }, "batched broadcast");
  }
  // An empty batch completes at once.
  comm.begin_batch();
  WorkPtr empty = comm.end_batch();
  comm.wait(empty);
  log.expect(empty->completed(), "empty batch not completed");
}

// Several calls in flight, waited in reverse order; completed() after wait(); wait() twice.
void in_flight(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  Tensor a = make(dev, DType::kF32, 7, [&](int64_t i) { return value(DType::kF32, r, i); });
  Tensor g_in = make(dev, DType::kI64, 5, [&](int64_t i) { return value(DType::kI64, r, i); });
  Tensor g_out = full(dev, DType::kI64, 5 * n, 0);
  Tensor b = make(dev, DType::kBF16, 9, [&](int64_t i) { return value(DType::kBF16, r, i); });
  Tensor rs_in = make(dev, DType::kI32, 3 * n, [&](int64_t i) { return value(DType::kI32, r, i); });
  Tensor rs_out = full(dev, DType::kI32, 3, 0);
  Tensor t = make(dev, DType::kU8, 2 * n, [&](int64_t i) { return value(DType::kU8, r, i); });
  const std::vector<WorkPtr> works = {comm.all_reduce(a, a, ReduceOp::kSum),
                                      comm.all_gather(g_in, g_out),
                                      comm.broadcast(b, n - 1),
                                      comm.reduce_scatter(rs_in, rs_out, ReduceOp::kMax),
                                      comm.all_to_all(t, t),
                                      comm.barrier()};
  for (auto it = works.rbegin(); it != works.rend(); ++it) comm.wait(*it);
  for (size_t k = 0; k < works.size(); ++k) {
    log.expect(works[k]->completed(), fmt::format("work {} not completed after wait", k));
    works[k]->wait(0ms);  // a second wait returns at once
  }
  auto fold = [&](DType d, int64_t i, bool maximum) {
    double acc = value(d, 0, i);
    for (int q = 1; q < n; ++q) acc = maximum ? std::max(acc, value(d, q, i)) : acc + value(d, q, i);
    return acc;
  };
  expect_elements(log, a, 7, [&](int64_t i) { return fold(DType::kF32, i, false); }, "all_reduce in flight");
  expect_elements(log, g_out, 5 * n, [&](int64_t k) { return value(DType::kI64, static_cast<int>(k / 5), k % 5); },
                  "all_gather in flight");
  expect_elements(log, b, 9, [&](int64_t i) { return value(DType::kBF16, n - 1, i); }, "broadcast in flight");
  expect_elements(log, rs_out, 3, [&](int64_t j) { return fold(DType::kI32, 3 * r + j, true); },
                  "reduce_scatter in flight");
  expect_elements(log, t, 2 * n, [&](int64_t k) { return value(DType::kU8, static_cast<int>(k / 2), 2 * r + k % 2); },
                  "all_to_all in place in flight");
}

// A Work dropped without wait() completes in its destructor (every member drops it). CPU
// backends only: on nccl nothing orders later work after a call nobody waited for.
void dropped_work(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  Tensor z = full(dev, DType::kI64, 3, r);
  comm.all_reduce(z, z, ReduceOp::kMax).reset();
  expect_elements(log, z, 3, [&](int64_t) { return n - 1; }, "all_reduce of a dropped Work");
}

void split(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  // Halves, the upper half listed first in reverse: [n-1, ..., h], [h-1, ..., 0].
  const int h = (n + 1) / 2;
  std::vector<int> group;
  if (r >= h)
    for (int q = n - 1; q >= h; --q) group.push_back(q);
  else
    for (int q = h - 1; q >= 0; --q) group.push_back(q);
  const collectives::Milliseconds timeout = comm.timeout();
  comm.set_timeout(timeout + 1234ms);
  auto half = comm.split(group, "half");
  comm.set_timeout(timeout);
  log.expect(half->timeout() == timeout + 1234ms, "split inherits the timeout");
  log.expect(half->name() == "half" && half->ranks() == group && half->backend() == comm.backend(),
             "split name, ranks and backend");
  log.expect(half->ranks()[static_cast<size_t>(half->rank())] == r, "split rank");
  Tensor x = full(dev, DType::kF64, 5, r);
  half->wait(half->all_reduce(x, x, ReduceOp::kMax));
  expect_elements(log, x, 5, [&](int64_t) { return group[0]; }, "all_reduce on a half");
  Tensor order = full(dev, DType::kI32, half->size(), -1);
  half->wait(half->all_gather(full(dev, DType::kI32, 1, r), order));
  expect_elements(log, order, half->size(), [&](int64_t k) { return group[static_cast<size_t>(k)]; },
                  "all_gather on a half, in the order asked for");

  // Two communicators of the same members: calls on each are matched separately.
  std::vector<int> all(static_cast<size_t>(n));
  for (int q = 0; q < n; ++q) all[static_cast<size_t>(q)] = q;
  auto a = comm.split(all, "dup a");
  auto b = comm.split(all, "dup b");
  Tensor xa = full(dev, DType::kI32, 4, r), xb = full(dev, DType::kI32, 4, 2 * r);
  Tensor ga = full(dev, DType::kI32, n, -1), ya = full(dev, DType::kF32, 3, 1);
  WorkPtr wa1 = a->all_reduce(xa, xa, ReduceOp::kSum);
  WorkPtr wb1 = b->all_reduce(xb, xb, ReduceOp::kSum);
  WorkPtr wa2 = a->all_gather(full(dev, DType::kI32, 1, r), ga);
  WorkPtr wb2 = b->all_reduce(ya, ya, ReduceOp::kSum);
  b->wait(wb2);
  a->wait(wa2);
  b->wait(wb1);
  a->wait(wa1);
  const double tri = n * (n - 1) / 2.0;
  expect_elements(log, xa, 4, [&](int64_t) { return tri; }, "dup a all_reduce");
  expect_elements(log, xb, 4, [&](int64_t) { return 2 * tri; }, "dup b all_reduce");
  expect_elements(log, ga, n, [](int64_t k) { return static_cast<double>(k); }, "dup a all_gather");
  expect_elements(log, ya, 3, [&](int64_t) { return n; }, "dup b all_reduce 2");

  // A split of a split: each half into singletons.
  auto single = half->split(std::vector<int>{half->rank()}, "single");
  log.expect(single->size() == 1 && single->ranks() == std::vector<int>{r}, "singleton ranks");
  Tensor one = full(dev, DType::kF32, 3, r);
  single->wait(single->all_reduce(one, one, ReduceOp::kProd));
  expect_elements(log, one, 3, [&](int64_t) { return r; }, "all_reduce on a singleton");
}

void large(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  const int64_t count = 300'000;  // MPI splits large reductions: user ops see segments
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI64})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      Tensor x = make(dev, d, count, [&](int64_t i) { return value(d, r, i); });
      comm.wait(comm.all_reduce(x, x, op));
      expect_elements(
          log, x, count,
          [&](int64_t i) {
            double acc = value(d, 0, i);
            for (int q = 1; q < n; ++q) acc = op == ReduceOp::kSum ? acc + value(d, q, i) : std::max(acc, value(d, q, i));
            return acc;
          },
          fmt::format("large all_reduce {} {}", name_of(d), kernels::to_string(op)));
    }
  const int64_t per = int64_t{1} << 16;
  Tensor g = full(dev, DType::kBF16, n * per, 0);
  comm.wait(comm.all_gather(full(dev, DType::kBF16, per, r), g));
  expect_elements(log, g, n * per, [&](int64_t k) { return static_cast<double>(k / per); }, "large all_gather");
}

// Integer averages truncate toward zero, i64 stays exact beyond 2^53, sums wrap (the CPU
// backends' documented arithmetic: kernels/reduce.h).
void integer_arithmetic(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  // Sums -1, -5, 3, 7 (member 0 alone): divided by n toward zero.
  for (DType d : {DType::kI32, DType::kI64}) {
    const std::vector<double> mine = r == 0 ? std::vector<double>{-1, -5, 3, 7} : std::vector<double>{0, 0, 0, 0};
    Tensor x = Tensor::from_vector(mine, {4}, d, dev);
    comm.wait(comm.all_reduce(x, x, ReduceOp::kAvg));
    const double sums[] = {-1, -5, 3, 7};
    expect_elements(log, x, 4, [&](int64_t i) { return std::trunc(sums[i] / n); }, "avg of " + name_of(d));
  }
  // i64 values far beyond 2^53 (double's exact range): members hold big + 2r + 1 + i.
  const int64_t big = int64_t{1} << 58;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
    Tensor s = Tensor::empty({4}, DType::kI64);
    for (int i = 0; i < 4; ++i) s.data<int64_t>()[i] = big + 2 * r + 1 + i;
    Tensor x = s.to(dev);
    comm.wait(comm.all_reduce(x, x, op));
    const Tensor host = x.to(Device{});
    for (int i = 0; i < 4; ++i) {
      // The members add 1, 3, ..., 2n - 1 (+ i): sum n^2 + n i, avg n + i, min 1 + i, max 2n - 1 + i.
      const int64_t want = op == ReduceOp::kSum   ? n * big + int64_t{n} * n + int64_t{n} * i
                           : op == ReduceOp::kAvg ? big + n + i
                           : op == ReduceOp::kMin ? big + 1 + i
                                                  : big + 2 * n - 1 + i;
      const int64_t got = host.data<int64_t>()[i];
      if (got != want)
        log.fail(fmt::format("i64 {} element {}: {}, expected {}", kernels::to_string(op), i, got, want));
      ++log.checked;
    }
  }
  // Integer sums wrap (two's complement).
  Tensor w = Tensor::from_vector({r == 0 ? 2147483647.0 : 1.0}, {1}, DType::kI32, dev);
  comm.wait(comm.all_reduce(w, w, ReduceOp::kSum));
  const int64_t wrapped = (int64_t{2147483647} + n - 1 + (int64_t{1} << 31)) % (int64_t{1} << 32) - (int64_t{1} << 31);
  expect_elements(log, w, 1, [&](int64_t) { return static_cast<double>(wrapped); }, "i32 sum wraps");
  Tensor u = full(dev, DType::kU8, 1, 200);
  comm.wait(comm.all_reduce(u, u, ReduceOp::kSum));
  expect_elements(log, u, 1, [&](int64_t) { return static_cast<double>((200 * n) % 256); }, "u8 sum wraps");
}

// Every argument check of detail::validate, with the same message on every backend; nothing is
// posted (the next call still matches).
void invalid_arguments(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  const std::string g = fmt::format("on group '{}'", comm.name());
  auto zeros = [&](int64_t k, DType d = DType::kF32) { return Tensor::zeros({k}, d, dev); };
  const Tensor f4 = zeros(4), f4n = zeros(4 * n);
  const Reduction sum{ReduceOp::kSum};

  expect_invalid(log, [&] { comm.all_gather(f4, zeros(4 * n + 1)); },
                 fmt::format("all_gather {} of {} ranks: input has 4 elements and output {} (expected output = "
                             "size x input)", g, n, 4 * n + 1),
                 "all_gather counts");
  expect_invalid(log, [&] { comm.reduce_scatter(zeros(4 * n + 2), f4, sum); },
                 fmt::format("input has {} elements and output 4 (expected input = size x output)", 4 * n + 2),
                 "reduce_scatter counts");
  expect_invalid(log, [&] { comm.all_reduce(f4, zeros(5), sum); },
                 "input has 4 elements and output 5 (expected equal counts)", "all_reduce counts");
  expect_invalid(log, [&] { comm.all_to_all(f4, zeros(5)); }, "equal counts divisible by the group size",
                 "all_to_all counts");
  const Tensor strided = Tensor::zeros({4, 3}, DType::kF32, dev).transpose(0, 1);
  expect_invalid(log, [&] { comm.all_reduce(strided, strided, sum); },
                 fmt::format("all_reduce {}: input tensor must be contiguous", g), "strided all_reduce");
  expect_invalid(log, [&] { comm.broadcast(strided, 0); },
                 fmt::format("broadcast {}: buffer tensor must be contiguous", g), "strided broadcast");
  expect_invalid(log, [&] { comm.all_gather(Tensor(), f4n); }, "all_gather " + g + ": input tensor is undefined",
                 "undefined input");
  expect_invalid(log, [&] { comm.all_reduce(f4, zeros(4, DType::kF64), sum); },
                 "input dtype f32 != output dtype f64", "mixed dtypes");
  for (int root : {-1, n}) {
    expect_invalid(log, [&] { comm.broadcast(f4, root); },
                   fmt::format("broadcast {}: root {} out of range 0..{}", g, root, n - 1), "broadcast root");
    expect_invalid(log, [&] { comm.scatter(f4n, f4, root); },
                   fmt::format("scatter {}: root {} out of range 0..{}", g, root, n - 1), "scatter root");
  }
  // Only the root checks the input of a scatter (the others ignore it): the others skip it.
  if (r == 0)
    expect_invalid(log, [&] { comm.scatter(zeros(4 * n + 3), f4, 0); },
                   fmt::format("the root's input has {} elements and output 4 (expected input = size x output)",
                               4 * n + 3),
                   "scatter counts at the root");
  for (int peer : {-1, n}) {
    const std::vector<P2POp> ops = {P2POp::send(f4, peer)};
    expect_invalid(log, [&] { comm.send_recv(ops); },
                   fmt::format("send_recv {}: peer {} out of range 0..{}", g, peer, n - 1), "send_recv peer");
  }
  const std::vector<P2POp> undefined = {P2POp::send(f4, 0), P2POp::recv(Tensor(), 0)};
  expect_invalid(log, [&] { comm.send_recv(undefined); }, "send/recv tensor is undefined", "undefined receive");
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {  // the other collectives move it (kMovedDTypes)
    Tensor x = zeros(3 * n, fp8);
    expect_invalid(log, [&] { comm.all_reduce(x, x, sum); },
                   fmt::format("all_reduce {}: sum of dtype {}: the collectives move fp8 but do not reduce it", g,
                               name_of(fp8)),
                   "fp8 all_reduce");
    expect_invalid(log, [&] { comm.reduce_scatter(x, zeros(3, fp8), ReduceOp::kMax); },
                   fmt::format("reduce_scatter {}: max of dtype {}", g, name_of(fp8)), "fp8 reduce_scatter");
  }
  std::vector<int64_t> ok(static_cast<size_t>(n), 0), too_many(static_cast<size_t>(n) + 1, 0),
      ones(static_cast<size_t>(n), 1), negative(static_cast<size_t>(n), 0);
  ok[0] = 4;
  negative[0] = n > 1 ? 5 : -1;
  if (n > 1) negative[1] = -1;
  expect_invalid(log, [&] { comm.all_to_all_v(f4, too_many, f4, ok); },
                 fmt::format("all_to_all_v {}: {} send counts for {} ranks", g, n + 1, n), "counts per member");
  expect_invalid(log, [&] { comm.all_to_all_v(f4, ok, zeros(n + 1), ones); },
                 fmt::format("receive counts [{}] sum to {} but the buffer has {} elements", fmt::join(ones, ","), n,
                             n + 1),
                 "counts that miss the buffer");
  expect_invalid(log, [&] { comm.all_to_all_v(f4, negative, f4, ok); }, "negative send count -1", "negative count");
  Reduction max_premul{ReduceOp::kMax};
  max_premul.pre_multiplier = 2;
  expect_invalid(log, [&] { comm.all_reduce(f4, f4, max_premul); },
                 "a pre-multiplier (2) needs ReduceOp sum, got max", "pre-multiplier with max");
  Reduction avg_premul{ReduceOp::kAvg};
  avg_premul.pre_multiplier = 0.5;
  expect_invalid(log, [&] { comm.reduce_scatter(f4n, f4, avg_premul); }, "got avg", "pre-multiplier with avg");
  still_in_step(comm, dev, log, "the invalid calls");
}

// The aliasing rules of NOTE [call contract]: the in-place forms run (the data cases above), any
// other overlap is refused the same way everywhere, overlapping sends are fine.
void aliasing(Communicator& comm, Device dev, Log& log) {
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::string g = fmt::format("on group '{}'", comm.name());
  const Reduction sum{ReduceOp::kSum};
  const Tensor base = Tensor::zeros({2 * n + 1}, DType::kF32, dev);
  const Tensor whole = base.narrow(0, 0, 2 * n), shifted_pair = base.narrow(0, 1, 2), shifted = base.narrow(0, 1, 2 * n);
  expect_invalid(log, [&] { comm.all_gather(shifted_pair, whole); },
                 fmt::format("all_gather {}: the input overlaps the output but is not this rank's slice (elements "
                             "[{}, {}) of the output)", g, 2 * r, 2 * r + 2),
                 "all_gather input inside the output, off its slice");
  expect_invalid(log, [&] { comm.reduce_scatter(whole, shifted_pair, sum); },
                 fmt::format("reduce_scatter {}: the output overlaps the input but is not this rank's slice", g),
                 "reduce_scatter output inside the input, off its slice");
  const std::string not_same = "the input overlaps the output but they are not the same elements";
  expect_invalid(log, [&] { comm.all_reduce(whole, shifted, sum); }, "all_reduce " + g + ": " + not_same,
                 "all_reduce buffers shifted by one");
  expect_invalid(log, [&] { comm.all_to_all(whole, shifted); }, "all_to_all " + g + ": " + not_same,
                 "all_to_all buffers shifted by one");
  const std::vector<int64_t> twos(static_cast<size_t>(n), 2);
  expect_invalid(log, [&] { comm.all_to_all_v(whole, twos, shifted, twos); }, "all_to_all_v " + g + ": " + not_same,
                 "all_to_all_v buffers shifted by one");
  if (r == 0)  // only the root checks its input
    expect_invalid(log, [&] { comm.scatter(whole, shifted_pair, 0); },
                   "the root's output overlaps its input but is not its slice (elements [0, 2) of the input)",
                   "scatter output inside the input, off the root's slice");
  const Tensor f8 = Tensor::zeros({8}, DType::kF32, dev);
  const std::vector<P2POp> recv_on_send = {P2POp::send(f8.narrow(0, 0, 4), next), P2POp::recv(f8.narrow(0, 3, 4), prev)};
  expect_invalid(log, [&] { comm.send_recv(recv_on_send); },
                 fmt::format("receive buffer #1 (from peer {}) overlaps send buffer #0 (to peer {})", prev, next),
                 "a receive overlapping a send");
  const std::vector<P2POp> recv_on_recv = {P2POp::recv(f8.narrow(0, 0, 4), prev), P2POp::recv(f8.narrow(0, 2, 4), prev)};
  expect_invalid(log, [&] { comm.send_recv(recv_on_recv); },
                 fmt::format("receive buffer #0 (from peer {}) overlaps receive buffer #1 (from peer {})", prev, prev),
                 "two receives overlapping");
  if (comm.p2p_views()) {
    const Tensor m = Tensor::zeros({4, 6}, DType::kF32, dev);
    const std::vector<P2POp> columns = {P2POp::send(m.narrow(1, 0, 3), next), P2POp::recv(m.narrow(1, 2, 3), prev)};
    expect_invalid(log, [&] { comm.send_recv(columns); }, "receive buffer #1 (from peer", "overlapping column blocks");
    const std::vector<P2POp> transposed = {P2POp::recv(m.transpose(0, 1), next), P2POp::send(m.narrow(0, 1, 2), next)};
    expect_invalid(log, [&] { comm.send_recv(transposed); }, "receive buffer #0 (from peer", "a transposed receive");
    // Every other column: interleaved, sharing no element (compared element by element).
    const std::vector<P2POp> interleaved = {P2POp::recv(m.view({4, 3, 2}).select(2, 0), prev),
                                            P2POp::recv(m.view({4, 3, 2}).select(2, 1), prev)};
    const std::vector<P2POp> to_next = {P2POp::send(full(dev, DType::kF32, 12, r), next),
                                        P2POp::send(full(dev, DType::kF32, 12, r + 100), next)};
    std::vector<P2POp> ops = interleaved;
    ops.insert(ops.end(), to_next.begin(), to_next.end());
    comm.wait(comm.send_recv(ops));
    expect_elements(log, m, 24, [&](int64_t k) { return k % 2 == 0 ? prev : prev + 100; },
                    "receives into interleaved columns of one tensor");
  }
  still_in_step(comm, dev, log, "the refused overlaps");
  // Sends may overlap each other: both read the same buffer.
  const Tensor src = make(dev, DType::kI32, 6, [&](int64_t i) { return r * 10 + i; });
  Tensor got_a = full(dev, DType::kI32, 4, -1), got_b = full(dev, DType::kI32, 4, -1);
  const std::vector<P2POp> overlapping_sends = {P2POp::send(src.narrow(0, 0, 4), next), P2POp::send(src.narrow(0, 2, 4), next),
                                                P2POp::recv(got_a, prev), P2POp::recv(got_b, prev)};
  comm.wait(comm.send_recv(overlapping_sends));
  expect_elements(log, got_a, 4, [&](int64_t i) { return prev * 10 + i; }, "first of two overlapping sends");
  expect_elements(log, got_b, 4, [&](int64_t i) { return prev * 10 + 2 + i; }, "second of two overlapping sends");
}

constexpr Case kCases[] = {
    {"all_gather", all_gather},
    {"reduce_scatter", reduce_scatter},
    {"all_reduce", all_reduce},
    {"all_to_all", all_to_all},
    {"all_to_all_v", all_to_all_v},
    {"broadcast", broadcast},
    {"scatter", scatter},
    {"fp8 send_recv", fp8_send_recv},
    {"barrier", barrier},
    {"send_recv", send_recv},
    {"send_recv views", send_recv_views},
    {"batch", batch},
    {"calls in flight", in_flight},
    {"dropped work", dropped_work, true},
    {"split", split},
    {"large buffers", large},
    {"integer arithmetic", integer_arithmetic, true},
    {"invalid arguments", invalid_arguments},
    {"aliasing", aliasing},
};

}  // namespace

std::span<const Case> cases() { return kCases; }

Log run_case(const Case& c, Communicator& comm, Device device) {
  Log log;
  try {
    c.run(comm, device, log);
  } catch (const std::exception& e) {
    log.fail(fmt::format("{} threw: {}", c.name, e.what()));
  }
  return log;
}

}  // namespace contract
