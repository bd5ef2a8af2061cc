// Internal: the CUDA primitives behind kernels/stream.h and a StreamBlockPool over real events,
// as plain C++ declarations. Implemented by cuda_stream.cu (CUDA builds) or
// cuda_stream_absent.cpp (every primitive throws Unsupported; the no-throw ones do nothing).
// Handles are cudaStream_t / cudaEvent_t; a null stream is the legacy default stream.
#pragma once

#include <cstddef>
#include <memory>

#include "kernels/detail/stream_pool.h"

namespace kernels::detail {

void* cuda_stream_create(int device);  // non-blocking towards the legacy default stream
void cuda_stream_destroy(void* stream, int device) noexcept;
void cuda_stream_synchronize(void* stream, int device);
void* cuda_event_create(int device);  // timing disabled
void cuda_event_destroy(void* event, int device) noexcept;
void cuda_event_record(void* event, void* stream, int device);
bool cuda_event_query(void* event, int device);
void cuda_event_synchronize(void* event, int device);
void cuda_stream_wait_event(void* stream, void* event, int device);
// The stream the kernels layer runs everything on for `device` (NOTE [cuda ordering] in
// cuda_ops.h): a cudaStream_t, created on first use, never destroyed.
void* cuda_compute_stream(int device);
// The kernels layer's copy stream for `device` (kernels/stream.h Stream::copy): created on first
// use, non-blocking, never destroyed, like the compute stream.
void* cuda_copy_stream(int device);
// Queues a device-to-device copy of nbytes on `stream` (no host wait).
void cuda_memcpy_async(void* dst, const void* src, size_t nbytes, void* stream, int device);
// Queues a copy of nbytes between host and `device` memory (either direction: cudaMemcpyDefault)
// on `stream` (no host wait; with host memory that is not page-locked CUDA stages it and the call
// returns once the source has been read).
void cuda_memcpy_async_host(void* dst, const void* src, size_t nbytes, void* stream, int device);
// Page-locked host memory usable by every device (cudaHostAlloc, portable), and its release.
void* cuda_host_alloc(size_t nbytes);
void cuda_host_free(void* p) noexcept;
// EventOps over CUDA events on `device` (released events are recorded again, not destroyed; not
// thread-safe): StreamId is the cudaStream_t's value (0: legacy).
std::unique_ptr<EventOps> cuda_event_ops(int device);

}  // namespace kernels::detail
