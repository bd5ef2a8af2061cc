// collectives-bench: an nccl-tests-style bandwidth benchmark of the Communicator backends (local
// threads, MPI processes, NCCL GPUs), with verifiable seeded data and, in the same run, a
// baseline: a plain memcpy ceiling on the local backend, the raw MPI calls on the mpi backend.
//
//   collectives-bench --backend local --world 4 --sizes 1K:256M
//   mpirun --allow-run-as-root --oversubscribe -np 4 collectives-bench --backend mpi
//
// Definitions (nccl-tests doc/PERFORMANCE.md): S is the size column (the all_gather output, the
// reduce_scatter input, the all_reduce / all_to_all / broadcast buffer, in bytes per rank);
// algbw = S / t, busbw = algbw * factor with factor 2(n-1)/n for all_reduce, (n-1)/n for
// all_gather, reduce_scatter and all_to_all, 1 for broadcast. t is, per iteration, the max over
// ranks of (barrier; issue + wait); the table shows its median, min and max over the iterations.
// See bench/README.md for the columns and the checks.
// Exit status (program/main.h): 0 ok, 1 wrong elements, 2 invalid input (sizes at most 1T, at
// most 4096 of them; --world <= 1024), 3 out of memory, 4 a communication failure or timeout
// (--timeout-ms), each failure one line on stderr naming the value or the rank.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "bench/collectives_bench.h"
#include "program/cli.h"
#include "program/main.h"
#include "collectives/communicator.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/nccl.h"
#include "kernels/device.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "kernels/reduce_op.h"
#include "kernels/tensor.h"

#ifndef BENCH_WITH_MPI
#define BENCH_WITH_MPI 0
#endif
#if BENCH_WITH_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only
#include <mpi.h>
#endif

namespace {

using namespace collectives_bench;
using collectives::Communicator;
using collectives::Milliseconds;
using collectives::Reduction;
using collectives::WorkPtr;
using kernels::Device;
using kernels::DType;
using kernels::ReduceOp;
using kernels::Tensor;
using bench::now_us;
using bench::parse_bytes;
using bench::parse_sizes;
using bench::reduce_over_ranks;
using bench::Stats;
using bench::stats_of;

// ---------------------------------------------------------------------------------------------
// Collectives: geometry and bus factors (nccl-tests)

double bus_factor(Coll c, int n) {
  switch (c) {
    case Coll::kAllReduce: return 2.0 * (n - 1) / n;
    case Coll::kAllGather:
    case Coll::kReduceScatter:
    case Coll::kAllToAll: return static_cast<double>(n - 1) / n;
    case Coll::kBroadcast: return 1.0;
  }
  return 1.0;
}

// Element counts of one call for a requested S (bytes), rounded down as nccl-tests does.
struct Geometry {
  int64_t total = 0;  // elements of S (the count column)
  int64_t chunk = 0;  // per-rank chunk (all_gather input, reduce_scatter output, all_to_all slice)
  int64_t in = 0, out = 0;
};

Geometry geometry(Coll c, int64_t bytes, int n, size_t item) {
  const int64_t e = bytes / static_cast<int64_t>(item);
  Geometry g;
  switch (c) {
    case Coll::kAllGather:
      g.chunk = e / n;
      g.total = g.chunk * n;
      g.in = g.chunk;
      g.out = g.total;
      break;
    case Coll::kReduceScatter:
      g.chunk = e / n;
      g.total = g.chunk * n;
      g.in = g.total;
      g.out = g.chunk;
      break;
    case Coll::kAllToAll:
      g.chunk = e / n;
      g.total = g.chunk * n;
      g.in = g.out = g.total;
      break;
    case Coll::kAllReduce:
    case Coll::kBroadcast:
      g.total = g.in = g.out = e;
      g.chunk = e;
      break;
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// Verifiable data: every rank's input is a periodic pattern of small integers (period kPeriod, a
// prime, so a misplaced chunk never lines up with the right one), seeded per rank. Sums stay
// <= 255, products are powers of two: every reduction is exact in every dtype, in any order.

constexpr int64_t kPeriod = 65521;

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::vector<std::byte> to_bytes(const std::vector<double>& values, DType dtype) {
  Tensor t = Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, dtype);
  std::vector<std::byte> out(t.nbytes());
  std::memcpy(out.data(), t.data_ptr(), out.size());
  return out;
}

double decode(const std::byte* p, DType dtype) {
  switch (dtype) {
    case DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::kF64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return kernels::bf16_bits_to_float(v); }
    case DType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return kernels::f16_bits_to_float(v); }
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    case DType::kU8: return static_cast<double>(static_cast<uint8_t>(*p));
    case DType::kF8E4M3: return kernels::f8e4m3_bits_to_float(static_cast<uint8_t>(*p));
    case DType::kF8E5M2: return kernels::f8e5m2_bits_to_float(static_cast<uint8_t>(*p));
  }
  return 0;
}

// Relative spacing of the dtype's significand (0 for integers).
double epsilon_of(DType dtype) {
  switch (dtype) {
    case DType::kF32: return std::ldexp(1.0, -23);
    case DType::kF64: return std::ldexp(1.0, -52);
    case DType::kBF16: return std::ldexp(1.0, -7);
    case DType::kF16: return std::ldexp(1.0, -10);
    default: return 0;
  }
}

struct Patterns {
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  size_t item = 4;
  int n = 1;
  std::vector<std::vector<std::byte>> input;  // [rank], kPeriod elements
  std::vector<std::byte> reduced;             // op over the ranks, exact (all but avg)
  std::vector<double> reduced_value;          // the same as doubles (avg: sum / n)
};

Patterns make_patterns(DType dtype, ReduceOp op, int n, uint64_t seed) {
  Patterns p;
  p.dtype = dtype;
  p.op = op;
  p.item = kernels::itemsize(dtype);
  p.n = n;
  // Sums of n values below v stay <= 255 (u8, and bf16's 8 significant bits).
  const int64_t v = std::clamp<int64_t>(255 / n + 1, 1, 16);
  std::vector<std::vector<double>> values(n, std::vector<double>(kPeriod));
  for (int r = 0; r < n; ++r)
    for (int64_t k = 0; k < kPeriod; ++k) {
      const uint64_t h = splitmix(seed * 0x100000001b3ull ^ (static_cast<uint64_t>(r) << 40) ^
                                  static_cast<uint64_t>(k));
      values[r][k] = op == ReduceOp::kProd ? 1.0 + static_cast<double>((h & 3) == 0)
                                           : static_cast<double>(h % v);
    }
  p.reduced_value.resize(kPeriod);
  for (int64_t k = 0; k < kPeriod; ++k) {
    double acc = values[0][k];
    for (int r = 1; r < n; ++r) {
      const double x = values[r][k];
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: acc += x; break;
        case ReduceOp::kProd: acc *= x; break;
        case ReduceOp::kMin: acc = std::min(acc, x); break;
        case ReduceOp::kMax: acc = std::max(acc, x); break;
      }
    }
    p.reduced_value[k] = op == ReduceOp::kAvg ? acc / n : acc;
  }
  for (int r = 0; r < n; ++r) p.input.push_back(to_bytes(values[r], dtype));
  if (op != ReduceOp::kAvg) p.reduced = to_bytes(p.reduced_value, dtype);
  return p;
}

// dst[i] = pattern[(phase + i) % kPeriod] for i < count.
void fill_periodic(std::byte* dst, int64_t count, const std::vector<std::byte>& pat, size_t item,
                   int64_t phase) {
  int64_t k = phase % kPeriod;
  for (int64_t i = 0; i < count;) {
    const int64_t len = std::min(count - i, kPeriod - k);
    std::memcpy(dst + i * item, pat.data() + k * item, len * item);
    i += len;
    k = 0;
  }
}

// Elements of got[0, count) that differ (bitwise) from pattern[(phase + i) % kPeriod].
int64_t count_wrong(const std::byte* got, int64_t count, const std::vector<std::byte>& pat,
                    size_t item, int64_t phase) {
  int64_t wrong = 0;
  int64_t k = phase % kPeriod;
  for (int64_t i = 0; i < count;) {
    const int64_t len = std::min(count - i, kPeriod - k);
    const std::byte* a = got + i * item;
    const std::byte* b = pat.data() + k * item;
    if (std::memcmp(a, b, len * item) != 0)
      for (int64_t j = 0; j < len; ++j) wrong += std::memcmp(a + j * item, b + j * item, item) != 0;
    i += len;
    k = 0;
  }
  return wrong;
}

// avg: where the division happens (once at the end, or NCCL's pre-multiplied sum) changes the
// rounding, so floats may be n units in the last place off and integers 1 off (truncation).
int64_t count_wrong_avg(const std::byte* got, int64_t count, const Patterns& p, int64_t phase) {
  const double eps = epsilon_of(p.dtype);
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double want = p.reduced_value[(phase + i) % kPeriod];
    const double have = decode(got + i * p.item, p.dtype);
    const double tol = eps == 0 ? 1.0 : p.n * eps * std::max(std::abs(want), 1e-30);
    wrong += !(std::abs(have - want) <= tol);
  }
  return wrong;
}

// ---------------------------------------------------------------------------------------------
// Buffers (CPU, or CUDA through a host staging copy)

Tensor host_view(const Tensor& t) {
  return t.device().is_cpu() ? t : Tensor::empty(t.shape(), t.dtype(), Device::cpu());
}
void upload(Tensor dst, const Tensor& host) {  // dst: a view of the same storage
  if (!dst.device().is_cpu()) dst.copy_(host);
}
Tensor download(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }
std::byte* bytes_of(const Tensor& t) { return static_cast<std::byte*>(t.data_ptr()); }

void fill_sentinel(const Tensor& t) {
  Tensor h = host_view(t);
  std::memset(h.data_ptr(), 0xFF, h.nbytes());
  upload(t, h);
}

// ---------------------------------------------------------------------------------------------
// Raw MPI calls (the mpi backend's baseline)

#if BENCH_WITH_MPI
struct RawMpi {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  bool user_op = false;
  bool scale_after = false;  // avg: MPI_SUM, then divide by n
  DType dtype = DType::kF32;
  int n = 1;

  static inline DType g_dtype = DType::kF32;
  static inline ReduceOp g_op = ReduceOp::kSum;
  static void user_fn(void* in, void* inout, int* len, MPI_Datatype*) {
    kernels::detail::cpu_reduce_into(inout, in, g_dtype, *len, g_op);
  }

  RawMpi(DType dt, ReduceOp rop, int world) : dtype(dt), n(world) {
    switch (dt) {
      case DType::kF32: type = MPI_FLOAT; break;
      case DType::kF64: type = MPI_DOUBLE; break;
      case DType::kI32: type = MPI_INT32_T; break;
      case DType::kI64: type = MPI_INT64_T; break;
      case DType::kU8: type = MPI_UINT8_T; break;
      default: type = MPI_UINT16_T; user_op = true; break;  // bf16, f16: moved as 16-bit words
    }
    scale_after = rop == ReduceOp::kAvg;
    const ReduceOp eff = scale_after ? ReduceOp::kSum : rop;
    if (user_op) {
      g_dtype = dt;
      g_op = eff;
      MPI_Op_create(&RawMpi::user_fn, 1, &op);
    } else {
      switch (eff) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: op = MPI_SUM; break;
        case ReduceOp::kProd: op = MPI_PROD; break;
        case ReduceOp::kMin: op = MPI_MIN; break;
        case ReduceOp::kMax: op = MPI_MAX; break;
      }
    }
  }
  ~RawMpi() {
    if (user_op) MPI_Op_free(&op);
  }
  RawMpi(const RawMpi&) = delete;
  RawMpi& operator=(const RawMpi&) = delete;

  static int count(int64_t c) {
    if (c > INT32_MAX) throw kernels::Unsupported(fmt::format("raw MPI: count {} exceeds INT_MAX", c));
    return static_cast<int>(c);
  }
  void run(Coll c, const Geometry& g, const Tensor& in, const Tensor& out, int root) const {
    MPI_Comm w = MPI_COMM_WORLD;
    void* ip = in.data_ptr();
    void* op_ = out.data_ptr();
    switch (c) {
      case Coll::kAllGather: MPI_Allgather(ip, count(g.chunk), type, op_, count(g.chunk), type, w); break;
      case Coll::kReduceScatter: MPI_Reduce_scatter_block(ip, op_, count(g.chunk), type, op, w); break;
      case Coll::kAllReduce: MPI_Allreduce(ip, op_, count(g.total), type, op, w); break;
      case Coll::kAllToAll: MPI_Alltoall(ip, count(g.chunk), type, op_, count(g.chunk), type, w); break;
      case Coll::kBroadcast: MPI_Bcast(ip, count(g.total), type, root, w); break;
    }
    if (scale_after && reduces(c)) kernels::detail::cpu_scale(op_, dtype, out.numel(), 1.0 / n);
  }
};
#endif

// What one rank needs to run the sweep.
struct Env {
  Communicator& comm;     // the communicator under test
  Communicator& control;  // CPU communicator for barriers of the baseline and the statistics
  Device device;
  Baseline baseline = Baseline::kNone;
  bool shared_clock = false;  // the ranks read one steady_clock (threads of one process)
  const Patterns& pat;
  const Options& opt;
  std::function<void(const Row&)> on_row;  // rank 0 only: print as we go
  std::function<void(Coll)> on_section;    // rank 0 only
#if BENCH_WITH_MPI
  const RawMpi* raw = nullptr;
#endif
};

WorkPtr issue(Coll c, Communicator& comm, const Tensor& in, const Tensor& out, Reduction red, int root) {
  switch (c) {
    case Coll::kAllGather: return comm.all_gather(in, out);
    case Coll::kReduceScatter: return comm.reduce_scatter(in, out, red);
    case Coll::kAllReduce: return comm.all_reduce(in, out, red);
    case Coll::kAllToAll: return comm.all_to_all(in, out);
    case Coll::kBroadcast: return comm.broadcast(in, root);
  }
  throw kernels::InternalError("issue: bad collective");
}

// Fills this rank's input (broadcast: the root's buffer; the others get the sentinel).
void fill_input(const Env& env, Coll c, const Geometry& g, const Tensor& in) {
  const int r = env.comm.rank();
  Tensor h = host_view(in);
  if (c == Coll::kBroadcast && r != env.opt.root) std::memset(h.data_ptr(), 0xFF, h.nbytes());
  else
    fill_periodic(bytes_of(h), g.in, env.pat.input[c == Coll::kBroadcast ? env.opt.root : r],
                  env.pat.item, 0);
  upload(in, h);
}

// Mismatching elements of `out`, this rank's output on the host.
int64_t check_output_bytes(const Env& env, Coll c, const Geometry& g, const Tensor& out) {
  const Patterns& p = env.pat;
  const int r = env.comm.rank(), n = env.comm.size();
  const size_t item = p.item;
  const std::byte* o = bytes_of(out);
  auto reduced = [&](const std::byte* at, int64_t count, int64_t phase) {
    return p.op == ReduceOp::kAvg ? count_wrong_avg(at, count, p, phase)
                                  : count_wrong(at, count, p.reduced, item, phase);
  };
  int64_t wrong = 0;
  switch (c) {
    case Coll::kAllGather:
      for (int j = 0; j < n; ++j) wrong += count_wrong(o + j * g.chunk * item, g.chunk, p.input[j], item, 0);
      break;
    case Coll::kReduceScatter: wrong = reduced(o, g.chunk, r * g.chunk); break;
    case Coll::kAllReduce: wrong = reduced(o, g.total, 0); break;
    case Coll::kAllToAll:
      for (int i = 0; i < n; ++i)
        wrong += count_wrong(o + i * g.chunk * item, g.chunk, p.input[i], item, r * g.chunk);
      break;
    case Coll::kBroadcast: wrong = count_wrong(o, g.total, p.input[env.opt.root], item, 0); break;
  }
  return wrong;
}

// Mismatching elements of this rank's output.
int64_t check_output(const Env& env, Coll c, const Geometry& g, const Tensor& out_dev) {
  const int r = env.comm.rank();
  const size_t item = env.pat.item;
  const Tensor out = download(out_dev);
  if (env.opt.inject_wrong && r == 0 && out.numel() > 0) {
    Tensor own = out.device().is_cpu() && out.shares_storage_with(out_dev) ? out.clone() : out;
    bytes_of(own)[item - 1] ^= std::byte{0x40};  // exponent / high bit: a different value in every dtype
    return check_output_bytes(env, c, g, own);
  }
  return check_output_bytes(env, c, g, out);
}

// Iterations for size S: --iters, fewer when S * iters exceeds --iter-bytes (at least 5).
std::pair<int, int> iterations(const Options& opt, int64_t bytes) {
  int iters = opt.iters, warmup = opt.warmup;
  if (bytes * static_cast<int64_t>(opt.iters) > opt.iter_bytes) {
    iters = static_cast<int>(std::clamp<int64_t>(opt.iter_bytes / bytes, std::min(opt.iters, 5), opt.iters));
    warmup = std::min(warmup, 1);
  }
  return {iters, warmup};
}

Row run_one(Env& env, Coll c, int64_t requested_bytes) {
  const Options& opt = env.opt;
  Communicator& comm = env.comm;
  const int n = comm.size();
  const size_t item = env.pat.item;
  const Geometry g = geometry(c, requested_bytes, n, item);
  Row row;
  row.coll = c;
  row.count = g.total;
  row.bytes = g.total * static_cast<int64_t>(item);
  std::tie(row.iters, row.warmup) = iterations(opt, row.bytes);
  row.baseline = env.baseline;

  const Reduction red(opt.op);
  Tensor in = Tensor::empty({g.in}, opt.dtype, env.device);
  Tensor out = c == Coll::kBroadcast ? in : Tensor::empty({g.out}, opt.dtype, env.device);
  fill_input(env, c, g, in);
  if (c != Coll::kBroadcast) fill_sentinel(out);

  // memcpy ceiling: this thread copies the bytes its rank receives in the bus model.
  const auto base_bytes = static_cast<size_t>(std::llround(static_cast<double>(row.bytes) * bus_factor(c, n)));
  // Allocated like the collective's buffers (64-byte aligned Tensor storage): glibc's memcpy on
  // this CPU is ~15x slower for small copies whose source and destination are misaligned
  // relative to each other, so std::vector (16-byte aligned) would understate the ceiling.
  Tensor src, dst;
  if (env.baseline == Baseline::kMemcpy) {
    src = Tensor::empty({static_cast<int64_t>(base_bytes)}, DType::kU8);
    dst = Tensor::empty({static_cast<int64_t>(base_bytes)}, DType::kU8);
    std::memset(src.data_ptr(), 1, base_bytes);
    std::memset(dst.data_ptr(), 0, base_bytes);
  }

  // Per timed iteration and rank: the collective's start and end, and the baseline's.
  std::vector<double> t_start, t_end, b_start, b_end;
  const Milliseconds timeout = comm.timeout();
  for (int it = 0; it < row.warmup + row.iters; ++it) {
    const bool timed = it >= row.warmup;
    comm.wait(comm.barrier());
    double t0 = now_us();
    issue(c, comm, in, out, red, opt.root)->wait(timeout);
    double t1 = now_us();
    if (timed) t_start.push_back(t0), t_end.push_back(t1);

    if (env.baseline == Baseline::kMemcpy) {
      env.control.wait(env.control.barrier());
      t0 = now_us();
      std::memcpy(dst.data_ptr(), src.data_ptr(), base_bytes);
      t1 = now_us();
      if (timed) b_start.push_back(t0), b_end.push_back(t1);
    }
#if BENCH_WITH_MPI
    if (env.baseline == Baseline::kMpiRaw) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = now_us();
      env.raw->run(c, g, in, out, opt.root);
      t1 = now_us();
      if (timed) b_start.push_back(t0), b_end.push_back(t1);
    }
#endif
  }
  src = Tensor();
  dst = Tensor();

  // Check in a separate call on reset outputs, so a call that writes nothing is caught.
  double wrong = -1;
  if (opt.check) {
    if (c == Coll::kBroadcast) fill_input(env, c, g, in);
    else fill_sentinel(out);
    comm.wait(comm.barrier());
    comm.wait(issue(c, comm, in, out, red, opt.root));
    wrong = static_cast<double>(check_output(env, c, g, out));
    wrong = reduce_over_ranks(env.control, {wrong}, ReduceOp::kSum)[0];
  }
  row.wrong = static_cast<int64_t>(wrong);

  // Per iteration, one all_reduce(max) over the ranks of: each duration, each end and each
  // start (negated, so the max is the earliest start).
  const size_t k = t_start.size(), kb = b_start.size();
  std::vector<double> v;
  v.reserve(3 * (k + kb));
  for (size_t i = 0; i < k; ++i) v.push_back(t_end[i] - t_start[i]);
  for (size_t i = 0; i < kb; ++i) v.push_back(b_end[i] - b_start[i]);
  v.insert(v.end(), t_end.begin(), t_end.end());
  v.insert(v.end(), b_end.begin(), b_end.end());
  for (double x : t_start) v.push_back(-x);
  for (double x : b_start) v.push_back(-x);
  v = reduce_over_ranks(env.control, v, ReduceOp::kMax);
  std::vector<double> times(k), base_times(kb), spans(k), base_spans(kb);
  for (size_t i = 0; i < k; ++i) {
    times[i] = v[i];
    spans[i] = v[k + kb + i] + v[2 * (k + kb) + i];
  }
  for (size_t i = 0; i < kb; ++i) {
    base_times[i] = v[k + i];
    base_spans[i] = v[2 * k + kb + i] + v[2 * (k + kb) + k + i];
  }
  if (env.shared_clock) row.span = stats_of(spans);
  // The memcpy threads do not wait for one another: with more threads than cores, each one's own
  // time is one copy's, not the time for all N copies. Their ceiling is the span of the N copies
  // (first start to last end; the threads share one clock), which is what the collective's
  // duration measures too, since its members wait for one another.
  if (env.baseline == Baseline::kMemcpy) base_times = base_spans;

  row.time = stats_of(times);
  const double t_s = row.time.median_us * 1e-6;
  row.algbw = t_s > 0 ? static_cast<double>(row.bytes) / t_s / 1e9 : 0;
  row.busbw = row.algbw * bus_factor(c, n);
  if (!base_times.empty()) {
    row.base_time = stats_of(base_times);
    const double b_s = row.base_time.median_us * 1e-6;
    row.base_busbw = b_s > 0 ? static_cast<double>(row.bytes) * bus_factor(c, n) / b_s / 1e9 : 0;
    if (env.baseline == Baseline::kMemcpy) row.ratio = row.base_busbw > 0 ? row.busbw / row.base_busbw : 0;
    else row.ratio = row.base_time.median_us > 0 ? row.time.median_us / row.base_time.median_us : 0;
  }
  return row;
}

std::vector<Row> run_sweep(Env& env) {
  std::vector<Row> rows;
  for (const std::string& name : env.opt.collectives) {
    const Coll c = parse_coll(name);
    if (env.on_section) env.on_section(c);
    for (int64_t s : env.opt.size_list) {
      if (geometry(c, s, env.comm.size(), env.pat.item).total == 0) continue;
      rows.push_back(run_one(env, c, s));
      if (env.on_row) env.on_row(rows.back());
    }
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Backends

int64_t run_local(const Options& opt) {
  const int n = opt.world;
  const Patterns pat = make_patterns(opt.dtype, opt.op, n, opt.seed);
  const Baseline baseline = opt.baseline ? Baseline::kMemcpy : Baseline::kNone;
  const std::string desc = fmt::format("local ({} ranks as threads, {} hardware threads)", n,
                                       std::thread::hardware_concurrency());
  Printer printer(opt, desc, n, baseline);
  printer.header();
  std::vector<Row> rows;
  collectives::run_ranks(
      n,
      [&](Communicator& comm) {
        program::on_rank(comm.rank(), [&] {
          Env env{comm, comm, Device::cpu(), baseline, true, pat, opt, {}, {}};
          if (comm.rank() == 0) {
            env.on_row = [&](const Row& r) { printer.row(r); };
            env.on_section = [&](Coll c) { printer.section(c); };
          }
          std::vector<Row> mine = run_sweep(env);
          if (comm.rank() == 0) rows = std::move(mine);
        });
      },
      Milliseconds{opt.timeout_ms});
  return finish(opt, printer, desc, n, baseline, rows);
}

int64_t run_mpi_rank(const Options& opt, collectives::MpiWorld& mpi) {
  std::unique_ptr<Communicator> comm = mpi.communicator(Milliseconds{opt.timeout_ms});
  const int n = comm->size();
  if (opt.root >= n)
    throw kernels::InvalidArgument(fmt::format("--root {} out of range for {} processes", opt.root, n));
  const Patterns pat = make_patterns(opt.dtype, opt.op, n, opt.seed);
  Baseline baseline = Baseline::kNone;
#if BENCH_WITH_MPI
  std::optional<RawMpi> raw;
  if (opt.baseline) {
    raw.emplace(opt.dtype, opt.op, n);
    baseline = Baseline::kMpiRaw;
  }
#endif
  const std::string desc = fmt::format("mpi ({} processes)", n);
  Printer printer(opt, desc, n, baseline);
  if (comm->rank() == 0) printer.header();
  Env env{*comm, *comm, Device::cpu(), baseline, false, pat, opt, {}, {}};
#if BENCH_WITH_MPI
  if (raw) env.raw = &*raw;
#endif
  if (comm->rank() == 0) {
    env.on_row = [&](const Row& r) { printer.row(r); };
    env.on_section = [&](Coll c) { printer.section(c); };
  }
  std::vector<Row> rows = run_sweep(env);
  int64_t wrong = 0;
  if (comm->rank() == 0) wrong = finish(opt, printer, desc, n, baseline, rows);
  else
    for (const Row& r : rows) wrong += std::max<int64_t>(r.wrong, 0);  // all ranks hold the sums
  return wrong;
}

int64_t run_mpi(const Options& opt, int* argc, char*** argv) {
  // The closing barrier waits --timeout-ms for the other ranks; a failure is printed before it.
  collectives::MpiWorld mpi(argc, argv, Milliseconds{opt.timeout_ms});
  return program::run_as_rank("collectives-bench", mpi.rank(), [&] { return run_mpi_rank(opt, mpi); });
}

int64_t run_nccl(const Options& opt, int* argc, char*** argv) {
  std::optional<Printer> printer;
  auto run = bench::run_nccl_ranks<std::vector<Row>>(
      opt.world, opt.world_given, opt.bootstrap, Milliseconds{opt.timeout_ms}, argc, argv,
      [&](int n, const std::string& desc) {
        printer.emplace(opt, desc, n, Baseline::kNone);
        printer->header();
      },
      [&](Communicator& comm, Communicator& boot, Device device, bool threads) {
        const Patterns pat = make_patterns(opt.dtype, opt.op, boot.size(), opt.seed);
        Env env{comm, boot, device, Baseline::kNone, threads, pat, opt, {}, {}};
        if (boot.rank() == 0) {
          env.on_row = [&](const Row& r) { printer->row(r); };
          env.on_section = [&](Coll c) { printer->section(c); };
        }
        return run_sweep(env);
      });
  if (run.reporting) return finish(opt, *printer, run.desc, run.world, Baseline::kNone, run.result);
  int64_t wrong = 0;
  for (const Row& r : run.result) wrong += std::max<int64_t>(r.wrong, 0);  // every rank holds the sums
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("collectives-bench", [&] {
    Options opt;
    CLI::App app{"collectives-bench: nccl-tests-style bandwidth and correctness sweep of the collective "
                 "backends (see bench/README.md)"};
    app.add_option("--backend", opt.backend, "local (threads), mpi (run under mpirun) or nccl (one GPU per rank)")
        ->check(CLI::IsMember({"local", "mpi", "nccl"}))
        ->capture_default_str();
    app.add_option("--world", opt.world, "ranks (threads) of the local backend; nccl without mpirun: GPUs "
                                         "(default: all)")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    app.add_option("--collectives", opt.collectives, "comma-separated list")
        ->delimiter(',')
        ->check(CLI::IsMember({"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"}))
        ->capture_default_str();
    app.add_option("--sizes", opt.sizes, "S in bytes per rank buffer as nccl-tests defines it: SIZE or MIN:MAX "
                                         "(x2 steps), comma-separated; suffixes K, M, G")
        ->capture_default_str();
    app.add_option("--dtype", opt.dtype_name, "f32, f64, bf16, f16, i32, i64, u8")->capture_default_str();
    app.add_option("--op", opt.op_name, "sum, avg, min, max, prod (reduce_scatter, all_reduce)")->capture_default_str();
    app.add_option("--root", opt.root, "broadcast root")->check(CLI::Range(0, 1023))->capture_default_str();
    app.add_option("--iters", opt.iters, "timed iterations per size")->check(CLI::Range(1, 1000000))->capture_default_str();
    app.add_option("--warmup", opt.warmup, "untimed iterations before them")->check(CLI::Range(0, 1000000))
        ->capture_default_str();
    app.add_option("--iter-bytes", opt.iter_bytes_text,
                   "above size x iters = this, iterations drop to max(5, this / size) and warm-up to 1")
        ->capture_default_str();
    app.add_flag("--check,!--no-check", opt.check, "verify every output (#wrong); exit 1 if any is wrong")
        ->capture_default_str();
    app.add_flag("--baseline,!--no-baseline", opt.baseline,
                 "measure the memcpy ceiling (local) or the raw MPI calls (mpi) in the same run")
        ->capture_default_str();
    app.add_option("--target-min-size", opt.target_min_text, "smallest size counted in the target summary")
        ->capture_default_str();
    app.add_option("--seed", opt.seed, "seed of the verifiable data")
        ->check(program::kUint64)
        ->capture_default_str();
    program::add_timeout(app, opt.timeout_ms);
    app.add_option("--bootstrap", opt.bootstrap, "nccl: auto (mpi under mpirun, else local threads), mpi, local")
        ->check(CLI::IsMember({"auto", "mpi", "local"}))
        ->capture_default_str();
    app.add_option("--json", opt.json_path, "also write the rows and the summary to this JSON file");
    app.add_flag("--inject-wrong", opt.inject_wrong, "corrupt one output element on rank 0 (tests the check)")
        ->group("");  // hidden
    program::parse(app, argc, argv);
    opt.world_given = app.count("--world") > 0;
    opt.command_line = bench::join_args(argc, argv);

    opt.dtype = kernels::parse_dtype(opt.dtype_name);
    if (opt.dtype == DType::kF8E4M3 || opt.dtype == DType::kF8E5M2)
      throw kernels::InvalidArgument(fmt::format("--dtype {}: fp8 is storage-only, collectives do not move it",
                                                 opt.dtype_name));
    opt.op = kernels::parse_reduce_op(opt.op_name);
    opt.size_list = parse_sizes(opt.sizes);
    opt.iter_bytes = parse_bytes(opt.iter_bytes_text);
    opt.target_min = parse_bytes(opt.target_min_text);

    int64_t wrong = 0;
    if (opt.backend == "local") {
      if (opt.root >= opt.world)
        throw kernels::InvalidArgument(fmt::format("--root {} out of range for --world {}", opt.root, opt.world));
      wrong = run_local(opt);
    } else if (opt.backend == "mpi") {
      wrong = run_mpi(opt, &argc, &argv);
    } else {
      wrong = run_nccl(opt, &argc, &argv);
    }
    if (wrong > 0) {
      fmt::print(stderr, "collectives-bench: {} wrong elements\n", wrong);
      return program::kMismatch;
    }
    return program::kOk;
  });
}
