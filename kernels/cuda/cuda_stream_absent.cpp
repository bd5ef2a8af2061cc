// Built without CUDA: every stream primitive refuses (the no-throw ones do nothing).
#include "kernels/cuda/cuda_stream.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

[[noreturn]] void no_cuda() {
  throw Unsupported("CUDA stream or event requested but this build has no CUDA (configure with -Dcuda=enabled)");
}

}  // namespace

void* cuda_stream_create(int) { no_cuda(); }
void cuda_stream_destroy(void*, int) noexcept {}
void cuda_stream_synchronize(void*, int) { no_cuda(); }
void* cuda_event_create(int) { no_cuda(); }
void cuda_event_destroy(void*, int) noexcept {}
void cuda_event_record(void*, void*, int) { no_cuda(); }
bool cuda_event_query(void*, int) { no_cuda(); }
void cuda_event_synchronize(void*, int) { no_cuda(); }
void cuda_stream_wait_event(void*, void*, int) { no_cuda(); }
void* cuda_compute_stream(int) { no_cuda(); }
void* cuda_copy_stream(int) { no_cuda(); }
void cuda_memcpy_async(void*, const void*, size_t, void*, int) { no_cuda(); }
void cuda_memcpy_async_host(void*, const void*, size_t, void*, int) { no_cuda(); }
void* cuda_host_alloc(size_t) {
  throw Unsupported("pinned (page-locked) host memory requested but this build has no CUDA (configure with -Dcuda=enabled)");
}
void cuda_host_free(void*) noexcept {}
std::unique_ptr<EventOps> cuda_event_ops(int) { no_cuda(); }

}  // namespace kernels::detail
