// Catch2's implementation, compiled once per build tree (tests/support/catch2_runner.cpp, at -O0)
// and shared by every test program's main(): the plain one (catch2_main.cpp), the [gpu] one
// (gpu_test_main.cpp) and the mpi one (tests/collectives/mpi_test_main.cpp). A main() that
// needs its own set-up does it and then calls run_catch2:
//
//   int main(int argc, char** argv) {
//     if (kernels::cuda_device_count() == 0) return 77;              // skipped
//     return test_support::run_catch2(argc, argv, {.extra_specs = {"~[gpu2]"}});
//   }
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace test_support {

struct Catch2Run {
  std::string process_name;              // replaces argv[0] in Catch2's reports when not empty
  std::vector<std::string> extra_specs;  // test specs appended to the command line's, e.g. "~[gpu2]"
};

// Applies the command line, then runs the session; returns Catch2's status (the number of
// failed test cases, capped at 255) or its command-line error status. Besides Catch2's own
// options it takes `--sample N` (N >= 1, default 1): the sweeps over thousands of cases run about
// one case in N (sampled() below). The release tree runs every case; the sanitizer trees, where
// a case costs 10-40x, run a sample of the same sweeps (tests/dtensor/meson.build).
int run_catch2(int argc, char** argv, const Catch2Run& run = {});

// The N of `--sample N` (1 when not given).
int sample_stride();

// Whether case number `index` of a sweep runs under `--sample N`: about one in N, chosen by a
// hash of (index, salt) so that the sample does not fall into step with the sweep's own period
// (every N-th pair of a 12-pair table would keep the same few pairs); the same on every rank and
// every run. A sweep repeated per mesh or rank count passes that as the salt to vary its sample.
inline bool sampled(int64_t index, int64_t salt = 0) {
  if (sample_stride() == 1) return true;
  uint64_t x = static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(salt) + 1;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finaliser
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x % static_cast<uint64_t>(sample_stride()) == 0;
}

// How many of the cases numbered 0..total-1 pass sampled(index, salt).
inline int64_t sampled_count(int64_t total, int64_t salt = 0) {
  int64_t n = 0;
  for (int64_t i = 0; i < total; ++i) n += sampled(i, salt) ? 1 : 0;
  return n;
}

}  // namespace test_support
