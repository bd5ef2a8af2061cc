// Pieces shared by the benchmarks (collectives-bench, dtensor-bench): size parsing and printing,
// timing statistics, a max/sum over ranks, and the process environment a benchmark reports.
// Benchmarks are programs, not library code, so reading the environment here is allowed.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

#include "collectives/communicator.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/nccl.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/reduce_op.h"
#include "kernels/tensor.h"
#include "program/main.h"
#include "program/stats.h"

namespace bench {

// The largest size a benchmark accepts: 1 TiB per buffer (a larger one could never be
// allocated; it is refused by name before anything runs).
inline constexpr int64_t kMaxBenchBytes = int64_t{1} << 40;
// The most sizes one --sizes list may name.
inline constexpr size_t kMaxBenchSizes = 4096;

// "4096", "4K", "4KB", "4KiB", "256M", "1G" (binary multiples), at most kMaxBenchBytes.
inline int64_t parse_bytes(std::string_view text) {
  const std::string t(text);
  const std::string shown = kernels::clip(t, 40);
  if (t.empty()) throw kernels::InvalidArgument("empty size");
  size_t end = 0;
  while (end < t.size() && std::isdigit(static_cast<unsigned char>(t[end]))) ++end;
  if (end == 0) throw kernels::InvalidArgument(fmt::format("size '{}' does not start with a number", shown));
  std::string suffix = t.substr(end);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (suffix.empty() || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB") shift = 10;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB") shift = 20;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB") shift = 30;
  else
    throw kernels::InvalidArgument(
        fmt::format("size '{}': unknown suffix '{}' (use K, M or G)", shown, kernels::clip(suffix, 20)));
  // Digits beyond what the limit allows are refused before any arithmetic (no wrap, no stoll).
  int64_t value = 0;
  for (size_t i = 0; i < end; ++i) {
    value = value * 10 + (t[i] - '0');
    if (value > (kMaxBenchBytes >> shift))
      throw kernels::InvalidArgument(fmt::format("size '{}' exceeds the limit of {} bytes (1T)", shown, kMaxBenchBytes));
  }
  return value << shift;
}

// Comma-separated items, each SIZE or MIN:MAX (doubling from MIN while <= MAX); at most
// kMaxBenchSizes sizes.
inline std::vector<int64_t> parse_sizes(std::string_view text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      out.push_back(parse_bytes(item));
    } else {
      const int64_t lo = parse_bytes(item.substr(0, colon)), hi = parse_bytes(item.substr(colon + 1));
      if (lo <= 0 || hi < lo)
        throw kernels::InvalidArgument(fmt::format("sizes '{}': need 0 < MIN <= MAX", kernels::clip(item, 60)));
      // s <= hi <= kMaxBenchBytes: doubling never overflows.
      for (int64_t s = lo; s <= hi; s *= 2) out.push_back(s);
    }
    if (out.size() > kMaxBenchSizes)
      throw kernels::InvalidArgument(
          fmt::format("--sizes '{}' names more than {} sizes", kernels::clip(text, 60), kMaxBenchSizes));
  }
  if (out.empty()) throw kernels::InvalidArgument(fmt::format("--sizes '{}' names no size", kernels::clip(text, 60)));
  return out;
}

// 1048576 -> "1M", 1536 -> "1536".
inline std::string human_bytes(int64_t b) {
  if (b >= (int64_t{1} << 30) && b % (int64_t{1} << 30) == 0) return fmt::format("{}G", b >> 30);
  if (b >= (int64_t{1} << 20) && b % (int64_t{1} << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= 1024 && b % 1024 == 0) return fmt::format("{}K", b >> 10);
  return fmt::format("{}", b);
}

inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using program::median;

struct Stats {
  double median_us = 0, min_us = 0, max_us = 0;
};
inline Stats stats_of(const std::vector<double>& t) {
  if (t.empty()) return {};
  return {median(t), *std::min_element(t.begin(), t.end()), *std::max_element(t.begin(), t.end())};
}

// Element-wise op over the ranks of `control` (a CPU communicator); every rank gets the result.
inline std::vector<double> reduce_over_ranks(collectives::Communicator& control, const std::vector<double>& v,
                                             kernels::ReduceOp op) {
  if (v.empty()) return v;
  kernels::Tensor t = kernels::Tensor::empty({static_cast<int64_t>(v.size())}, kernels::DType::kF64);
  std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(double));
  control.wait(control.all_reduce(t, t, op));
  std::vector<double> out(v.size());
  std::memcpy(out.data(), t.data_ptr(), v.size() * sizeof(double));
  return out;
}

inline std::string load_average() {
  std::ifstream f("/proc/loadavg");
  double a = 0, b = 0, c = 0;
  if (!(f >> a >> b >> c)) return "unknown";
  return fmt::format("{:.2f} {:.2f} {:.2f}", a, b, c);
}

// CPUs this process may run on (its affinity mask; mpirun may bind a process to one core).
inline int affinity_cpus() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

inline bool under_mpirun() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

inline int local_rank_from_env() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

// What run_nccl_ranks returns on each process.
template <class R>
struct NcclRun {
  bool reporting = false;  // this process holds rank 0 (it printed the header and reports)
  int world = 0;
  std::string desc;        // "nccl (4 processes, one GPU each, bootstrap mpi)"
  R result;                // rank 0's result on the reporting process, this rank's elsewhere
};

// The ranks of a benchmark on the nccl backend. Under mpirun (bootstrap "auto") or with "mpi":
// one process per rank, GPU = local rank mod the visible GPUs, bootstrapped over mpi. Otherwise
// one thread per GPU of this process (`world` of them when world_given, else all) bootstrapped
// over the local backend. header(n, desc) runs once on the reporting process before the ranks;
// rank(nccl, boot, device, threads) runs on every rank (threads: the ranks are threads sharing
// one clock) and returns its result R.
template <class R, class Header, class Rank>
NcclRun<R> run_nccl_ranks(int world, bool world_given, const std::string& bootstrap,
                          collectives::Milliseconds timeout, int* argc, char*** argv, Header header,
                          Rank rank) {
  using collectives::Communicator;
  if (!collectives::nccl_built())
    throw kernels::Unsupported("--backend nccl: this build has no NCCL (configure with CUDA and NCCL found)");
  const int gpus = kernels::cuda_device_count();
  if (gpus == 0) throw kernels::Unsupported("--backend nccl: no GPU visible");
  NcclRun<R> run;
  if (bootstrap == "mpi" || (bootstrap == "auto" && under_mpirun())) {
    collectives::MpiWorld mpi(argc, argv, timeout);
    std::unique_ptr<Communicator> boot = mpi.communicator(timeout);
    const int device = local_rank_from_env() % gpus;
    std::unique_ptr<Communicator> comm = collectives::nccl_communicator(*boot, device, timeout);
    run.reporting = boot->rank() == 0;
    run.world = boot->size();
    run.desc = fmt::format("nccl ({} processes, one GPU each, bootstrap mpi)", run.world);
    if (run.reporting) header(run.world, run.desc);
    run.result = rank(*comm, *boot, kernels::Device::cuda(device), false);
    return run;
  }
  run.reporting = true;
  run.world = world_given ? world : gpus;
  if (run.world > gpus)
    throw kernels::InvalidArgument(fmt::format("--backend nccl --world {}: only {} GPUs visible", run.world, gpus));
  run.desc = fmt::format("nccl ({} GPUs, one thread each, bootstrap local)", run.world);
  header(run.world, run.desc);
  collectives::run_ranks(
      run.world,
      [&](Communicator& boot) {
        program::on_rank(boot.rank(), [&] {
          std::unique_ptr<Communicator> comm = collectives::nccl_communicator(boot, boot.rank(), timeout);
          R mine = rank(*comm, boot, kernels::Device::cuda(boot.rank()), true);
          if (boot.rank() == 0) run.result = std::move(mine);
        });
      },
      timeout);
  return run;
}

inline std::string join_args(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) {
    if (i) s += ' ';
    s += argv[i];
  }
  return s;
}

}  // namespace bench
