// The local backend's tests (local_test.cpp, local_failure_test.cpp): what rank threads record
// and how the main thread checks it.
//
// NOTE [rank-side checks] Catch2 v2 assertions are not thread-safe, so rank threads never assert:
// each records what it saw in its own RankLog (failures, expected error messages, timings), and
// the main thread checks every log once run_ranks has joined. Element values are small integers
// (a function of rank and index), exact in every dtype, so each output element of each rank is
// compared for equality with its formula (averages of floats within one rounding).
#pragma once

#include "collectives/local.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/error.h"

namespace local_test {

using namespace collectives;
using namespace std::chrono_literals;
using kernels::CommError;
using kernels::DType;
using kernels::InvalidArgument;
using Clock = std::chrono::steady_clock;
using Catch::Contains;

using Ms = std::chrono::duration<double, std::milli>;
// How late a thread may get a core on a loaded machine under sanitizers (NOTE [timeout bounds] in
// local_failure_test.cpp): bounds on what must happen at once allow it, and stay far below the
// timeout a hang would take.
inline constexpr Milliseconds kLate = 5s;

// ---- per-rank logs (NOTE [rank-side checks]) ----

// A measured interval, in absolute times: bounds may compare the ranks' spans.
struct Span {
  Clock::time_point begin, end;
  Ms took() const { return end - begin; }
};

struct RankLog {
  int64_t elements = 0;               // output elements compared with their formula
  std::vector<std::string> failures;  // the first few
  std::vector<std::string> errors;    // messages of the expected exceptions, in order
  std::vector<Span> spans;            // measured intervals, in order
  void fail(std::string what) {
    if (failures.size() < 12) failures.push_back(std::move(what));
  }
  void expect(bool ok, std::string_view what) {
    if (!ok) fail(std::string(what));
  }
};

// Runs fn and records its span in the log.
template <class F>
void timed(RankLog& log, F&& fn) {
  const Clock::time_point begin = Clock::now();
  fn();
  log.spans.push_back({begin, Clock::now()});
}

using RankFn = std::function<void(Communicator&, RankLog&)>;

inline std::vector<RankLog> run_logged(int n, const RankFn& fn, Milliseconds timeout = 60s) {
  std::vector<RankLog> logs(n);
  run_ranks(
      n, [&](Communicator& world) { fn(world, logs[world.rank()]); }, timeout);
  return logs;
}

// Main thread only: no rank recorded a failure. Returns the elements verified on all ranks.
inline int64_t check_logs(const std::vector<RankLog>& logs) {
  int64_t elements = 0;
  for (size_t r = 0; r < logs.size(); ++r) {
    INFO("rank " << r << ":\n" << fmt::format("{}", fmt::join(logs[r].failures, "\n")));
    CHECK(logs[r].failures.empty());
    elements += logs[r].elements;
  }
  return elements;
}

inline Tensor filled(int64_t n, DType d, const std::function<double(int64_t)>& f) {
  Tensor t = Tensor::empty({n}, d);
  t.fill_index_([&](std::span<const int64_t> i) { return f(i[0]); });
  return t;
}

// Every element of t against want(i): exactly, or within rtol * max(1, |want|) when rtol > 0.
inline void expect_elements(RankLog& log, const Tensor& t, int64_t numel, const std::function<double(int64_t)>& want,
                     const std::string& what, double rtol = 0) {
  if (t.numel() != numel) {
    log.fail(fmt::format("{}: {} elements, expected {}", what, t.numel(), numel));
    return;
  }
  const std::vector<double> got = t.to_vector();
  int bad = 0;
  for (int64_t i = 0; i < numel; ++i) {
    const double w = want(i);
    const bool ok = rtol == 0 ? got[i] == w : std::abs(got[i] - w) <= rtol * std::max(1.0, std::abs(w));
    if (!ok && bad++ < 3) log.fail(fmt::format("{}: element {} is {}, expected {}", what, i, got[i], w));
  }
  log.elements += numel;
}

// Runs fn, which must throw E; records and returns the message.
template <class E, class F>
std::string expect_throw(RankLog& log, F&& fn, std::string_view what) {
  try {
    fn();
  } catch (const E& e) {
    log.errors.emplace_back(e.what());
    return e.what();
  } catch (const std::exception& e) {
    log.fail(fmt::format("{}: threw the wrong exception type: {}", what, e.what()));
    return {};
  }
  log.fail(fmt::format("{}: did not throw", what));
  return {};
}

// Spins (bounded) until pred() holds; false on the deadline.
template <class Pred>
bool eventually(Pred pred, Milliseconds limit = 5s) {
  const auto deadline = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// ---- element formulas ----

// Element i of rank r: small integers, exact in every dtype; negative only for signed dtypes.
inline double value(DType d, int r, int64_t i) {
  const int v = static_cast<int>((r * 7 + i * 3) % 11);
  return d == DType::kU8 ? v : v - 5;
}

}  // namespace local_test
