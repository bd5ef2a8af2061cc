#include "dtensor/memory_gauge.h"

#include <fmt/format.h>

#include <time.h>

#include <chrono>

#include "kernels/error.h"

namespace dtensor {

namespace {

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
