// CUDA tensors without a GPU (or without CUDA in the build): asking for one fails cleanly with
// Unsupported, naming the device and the reason. With a GPU, tests/kernels/gpu_test.cpp runs.
#include <catch2/catch.hpp>

#include "kernels/storage.h"
#include "kernels/tensor.h"

using namespace kernels;
using Catch::Contains;

namespace {
bool have_gpu() { return cuda_device_count() > 0; }
}  // namespace

TEST_CASE("CUDA tensors without a GPU raise Unsupported", "[kernels][cuda]") {
  if (have_gpu()) {
    SUCCEED("a GPU is present");
    return;
  }
  REQUIRE_THROWS_AS(Tensor::empty({2}, DType::kF32, Device::cuda(0)), Unsupported);
  REQUIRE_THROWS_AS(Storage::allocate(16, Device::cuda(0)), Unsupported);
  REQUIRE_THROWS_AS(Tensor::arange({3}, DType::kF32).to(Device::cuda(0)), Unsupported);
  if (cuda_built()) {
    // Built with CUDA on a machine without a (usable) GPU: the message names the device and
    // what the CUDA runtime said.
    REQUIRE_THROWS_WITH(
        Tensor::empty({2}, DType::kF32, Device::cuda(0)),
        Contains("cuda:0 requested but no GPU is usable") && Contains("cudaGetDeviceCount"));
  } else {
    REQUIRE_THROWS_WITH(Tensor::empty({2}, DType::kF32, Device::cuda(0)),
                        Contains("this build has no CUDA (configure with -Dcuda=enabled)"));
  }
}

