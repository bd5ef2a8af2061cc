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

#include <string>
#include <vector>

namespace test_support {

struct Catch2Run {
  std::string process_name;              // replaces argv[0] in Catch2's reports when not empty
  std::vector<std::string> extra_specs;  // test specs appended to the command line's, e.g. "~[gpu2]"
};

// Applies the command line, then runs the session; returns Catch2's status (the number of
// failed test cases, capped at 255) or its command-line error status.
int run_catch2(int argc, char** argv, const Catch2Run& run = {});

}  // namespace test_support
