// Built when the library is configured without CUDA: no devices, every primitive refuses.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/error.h"

namespace kernels {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }

namespace detail {
namespace {

[[noreturn]] void no_cuda() {
  throw Unsupported(
      "CUDA tensor requested but this build has no CUDA (configure with -Dcuda=enabled)");
}

}  // namespace

void cuda_check_device(int) { no_cuda(); }
void* cuda_malloc(size_t, int) { no_cuda(); }
void cuda_free(void*, int) noexcept {}
int64_t cuda_available_bytes(int) noexcept { return -1; }
void cuda_memcpy(void*, Device, const void*, Device, size_t) { no_cuda(); }
void cuda_copy_cast(void*, DType, const Dims&, const void*, DType, const Dims&, const Dims&, int) {
  no_cuda();
}
void cuda_copy_batch(const std::vector<CopyItem>&, int) { no_cuda(); }
void cuda_fill(void*, size_t, const Dims&, const Dims&, uint64_t, int) { no_cuda(); }
void cuda_reduce_into(void*, const void*, DType, int64_t, ReduceOp, double, int) { no_cuda(); }
void cuda_scale(void*, DType, int64_t, double, int) { no_cuda(); }

}  // namespace detail
}  // namespace kernels
