// main() of the GPU test programs (test cases tagged [gpu]): without a usable GPU (or, built with
// GPU_TEST_NEEDS_NCCL, without NCCL in the build) the program runs nothing and exits 77, which
// Meson counts as skipped (tools/test_summary.py reports it, never as passed). Test cases tagged
// [gpu2] need two GPUs: on a machine with one they are left out, and the program says so.
#include <cstdio>

#include "kernels/device.h"
#include "tests/support/catch2_runner.h"
#ifdef GPU_TEST_NEEDS_NCCL
#include "collectives/nccl.h"
#endif

int main(int argc, char** argv) {
  const int gpus = kernels::cuda_device_count();
  const char* missing = gpus > 0                 ? nullptr
                        : kernels::cuda_built() ? "built with CUDA but no GPU is usable on this machine"
                                                : "this build has no CUDA (configure with -Dcuda=enabled)";
#ifdef GPU_TEST_NEEDS_NCCL
  if (!missing && !collectives::nccl_built()) missing = "this build has no NCCL";
#endif
  if (missing) {
    std::printf("skipped: %s\n", missing);
    return 77;
  }
  test_support::Catch2Run run;
  if (gpus < 2) {
    std::printf("one GPU: the test cases tagged [gpu2] (they need two) are left out\n");
    run.extra_specs.push_back("~[gpu2]");
  }
  return test_support::run_catch2(argc, argv, run);
}
