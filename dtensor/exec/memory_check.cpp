#include "dtensor/exec/memory_check.h"

#include <fmt/format.h>

#include <time.h>

#include <chrono>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh_comms.h"
#include "kernels/error.h"

namespace dtensor {

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// a + b * c for non-negative numbers, saturating at INT64_MAX (the point is "more than there is").
int64_t add_bytes(int64_t a, int64_t b, int64_t c) {
  if (b == 0 || c == 0) return a;
  if (b > kMax / c) return kMax;
  const int64_t bc = b * c;
  return a > kMax - bc ? kMax : a + bc;
}

int64_t size_of(kernels::DType d) { return static_cast<int64_t>(kernels::itemsize(d)); }

std::string bytes_text(int64_t b) {
  if (b < (int64_t{1} << 20)) return fmt::format("{} bytes", b);
  if (b < (int64_t{1} << 30)) return fmt::format("{} bytes ({:.1f} MiB)", b, static_cast<double>(b) / (1 << 20));
  return fmt::format("{} bytes ({:.1f} GiB)", b, static_cast<double>(b) / (int64_t{1} << 30));
}

// A monotonic time in ns for the gauge's 100 ms freshness: the coarse clock where there is one
// (a few ms of resolution, read from the vDSO page without a timer read: a fine clock read was
// a tenth of a cached tiny redistribute's host cost on our VMs).
int64_t now_ns() {
#ifdef CLOCK_MONOTONIC_COARSE
  timespec ts{};
  if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0) return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
#endif
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int64_t transition_bytes(const Plan& plan, std::span<const DTensorSpec* const> specs, const MeshComms& comms,
                         std::span<const StepDTypes> dtypes, bool caller_outs) {
  const size_t n = plan.steps.size();
  if (n == 0 || specs.empty()) return 0;
  const Dims& mesh_shape = comms.mesh().shape();
  const Dims& coord = comms.coord();
  // Local element counts of the batch before and after every step (summed over the tensors).
  std::vector<int64_t> numel(n + 1, 0);
  for (const DTensorSpec* spec : specs)
    for (size_t i = 0; i <= n; ++i) {
      const int64_t e = compute_layout(spec->shape, mesh_shape, plan.states[i], coord).local_shape.product();
      numel[i] = numel[i] > kMax - e ? kMax : numel[i] + e;
    }
  const bool batch = specs.size() > 1;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const Step& step = plan.steps[i];
    const StepDTypes& d = dtypes[i];
    const int m = mesh_dim_of(step);
    const int64_t k = mesh_shape[m];
    const int64_t pre = numel[i], post = numel[i + 1];
    const int64_t in_sz = size_of(d.in), out_sz = size_of(d.out), work_sz = size_of(d.work);
    const bool reducing = std::holds_alternative<AllReduce>(step) || std::holds_alternative<ReduceScatter>(step);
    // The caller's out holds the final result when its dtype is the step's (the executor writes
    // straight into it then, else it allocates the result and copies at the end).
    const bool result_is_out = caller_outs && i + 1 == n;
    if (k == 1) {
      // Nothing moves; a reduction over one member that casts or scales makes a new tensor.
      if (reducing && (d.in != d.out || d.work != d.out || d.scaled)) {
        total = add_bytes(total, pre, work_sz);
        if (!result_is_out) total = add_bytes(total, post, out_sz);
      }
      continue;
    }
    std::visit(
        [&](const auto& s) {
          using T = std::decay_t<decltype(s)>;
          if constexpr (std::is_same_v<T, AllReduce>) {
            if (d.in != d.work || batch) total = add_bytes(total, pre, work_sz);  // the input copy
            const bool into_result = !batch && d.out == d.work && !d.scaled;
            total = add_bytes(total, post, work_sz);  // the reduced buffer (the result when into_result)
            if (!into_result && !result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, ReduceScatter>) {
            total = add_bytes(total, pre, work_sz);   // the packed (or cast) input
            total = add_bytes(total, post, work_sz);  // the reduced chunk
            if (pre != k * post) total = add_bytes(total, k - 1, add_bytes(0, post, work_sz));  // uneven: per peer
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, LocalChunk> || std::is_same_v<T, LocalPartial>) {
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else if constexpr (std::is_same_v<T, LocalEmbed>) {
            total = add_bytes(total, pre, in_sz);  // the packed shard
            if (!result_is_out) total = add_bytes(total, post, out_sz);
          } else {  // data movement: all-gathers, all-to-alls, regroups (NOTE [exchange])
            const bool staged = !comms.dim(m).p2p_views() || (std::is_same_v<T, AllGather> && batch);
            if (staged) total = add_bytes(add_bytes(total, pre, work_sz), post, work_sz);
            if (!result_is_out) total = add_bytes(total, post, work_sz);
          }
        },
        step);
  }
  return total;
}

bool MemoryGauge::trusted(int64_t needed, kernels::Device device) {
  const int i = device.is_cuda() ? 1 : 0;
  const int64_t at = read_at_ns_[i].load(std::memory_order_relaxed);
  if (at == 0 || now_ns() - at > kFreshNs) return false;
  const int64_t known = known_[i].load(std::memory_order_relaxed);
  if (known < 0) return true;  // unknown (no figure to check against), and read recently
  if (needed > known / 2) return false;
  known_[i].fetch_sub(needed, std::memory_order_relaxed);  // stays >= 0: needed <= known / 2
  return true;
}

int64_t MemoryGauge::read(int64_t needed, const kernels::Allocator* allocator, kernels::Device device) {
  const int64_t available =
      allocator != nullptr ? allocator->available_bytes(device) : kernels::machine_available_bytes(device);
  const int i = device.is_cuda() ? 1 : 0;
  known_[i].store(available < 0 ? -1 : available >= needed ? available - needed : available, std::memory_order_relaxed);
  read_at_ns_[i].store(now_ns(), std::memory_order_relaxed);
  return available;
}

void MemoryGauge::fail(int64_t needed, int64_t available, const kernels::Allocator* allocator, kernels::Device device,
                       int rank, const std::string& what) {
  const int64_t limit = allocator != nullptr ? allocator->limit_bytes() : 0;
  const std::string source =
      limit > 0 ? fmt::format("the allocator's limit of {} has {} left", bytes_text(limit), bytes_text(available))
                : fmt::format("{} has {} available", device.is_cuda() ? kernels::to_string(device) : "the machine",
                              bytes_text(available));
  throw kernels::ResourceError(fmt::format("{} needs {} of buffers on rank {} ({}), but {}", what, bytes_text(needed),
                                           rank, kernels::to_string(device), source));
}

}  // namespace dtensor
