// main of kernels_gpu_ops_test: runs the [gpu] comparisons when a GPU is usable, otherwise
// reports why and exits 77, Meson's "skipped" (a GPU test without a GPU never counts as passed).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "kernels/device.h"

int main(int argc, char** argv) {
  if (kernels::cuda_device_count() == 0) {
    std::printf("skipped: %s\n", kernels::cuda_built()
                                     ? "built with CUDA but no GPU is usable on this machine"
                                     : "this build has no CUDA (configure with -Dcuda=enabled)");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
