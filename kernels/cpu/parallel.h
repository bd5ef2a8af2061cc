// Internal: runs tasks 0..n-1 on up to `threads` workers (the caller's own thread and
// threads - 1 new ones, joined before returning); task(i, worker) gets the worker's index
// (0..workers-1) for per-worker scratch. The first exception from any task is rethrown on the
// caller. No pool and no shared state: N callers with threads = 1 each use only their own thread.
//   parallel_tasks(2, 8, [&](int64_t i, int64_t w) { ... });   // w = i % 2
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kernels::detail {

template <class F>
void parallel_tasks(int threads, int64_t n, F&& task) {
  const int64_t workers = std::min<int64_t>(std::max(threads, 1), n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) task(i, int64_t{0});
    return;
  }
  std::exception_ptr error;
  std::mutex mu;
  auto run = [&](int64_t w) {
    try {
      for (int64_t i = w; i < n; i += workers) task(i, w);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) helpers.emplace_back(run, w);
  run(0);
  for (auto& t : helpers) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace kernels::detail
