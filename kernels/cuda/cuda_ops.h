// Internal: the device-specific primitives behind Storage and Tensor. Plain C++ declarations;
// implemented by cuda_ops.cu (CUDA builds) or cuda_absent.cpp (no CUDA: every primitive throws
// Unsupported). `device` is a CUDA device index; data pointers point at element [0,...,0]; strides
// are in elements.
//
// NOTE [cuda ordering] Every kernel and copy here (cuBLAS included) runs on the device's compute
// stream (one non-blocking stream per device, NOTE [compute stream] in cuda_ops.cu; never the
// legacy default stream), so they are ordered with each other; host-visible results are obtained
// through cuda_memcpy, which waits for them. Other streams order themselves against it with
// events (kernels/stream.h; the nccl backend does). Nothing here synchronises otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include <vector>

#include "kernels/detail/copy_batch.h"
#include "kernels/device.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"
#include "kernels/reduce_op.h"

namespace kernels::detail {

// Throws Unsupported naming the device and the reason when it cannot be used (no CUDA build,
// no driver / GPU, index beyond the visible GPUs), InvalidArgument for a negative index.
void cuda_check_device(int device);
void* cuda_malloc(size_t nbytes, int device);
// Never throws (errors at process exit are ignored).
void cuda_free(void* ptr, int device) noexcept;
// The free bytes of the device (cudaMemGetInfo), or -1 when unknown (no CUDA, no such device).
// Never throws.
int64_t cuda_available_bytes(int device) noexcept;
// Copies nbytes between any two of host and CUDA memory; returns when the copy is complete.
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
// dst[i] = cast(src[i]) for every multi-index i of shape (NOTE [cast rules] in
// kernels/detail/convert.h; bit-identical to the CPU copy). Both operands on `device`.
void cuda_copy_cast(void* dst, DType dst_dtype, const Dims& dst_strides, const void* src,
                    DType src_dtype, const Dims& src_strides, const Dims& shape, int device);
// Every item of the batch (copies with cast, zero fills) in one kernel launch on `device`, each
// element as cuda_copy_cast / cuda_fill would write it. REQUIRES: no item's destination overlaps
// another item's operands; all pointers on `device`.
void cuda_copy_batch(const std::vector<CopyItem>& items, int device);
// Writes the low `itemsize` bytes of `pattern` (little-endian) to every element.
void cuda_fill(void* dst, size_t itemsize, const Dims& strides, const Dims& shape, uint64_t pattern,
               int device);

// acc[i] = op(acc[i], src[i]) and data[i] *= factor over n contiguous elements on `device`, with
// the arithmetic of kernels/cpu/reduce.cpp (narrow floats in float, integers wrapping).
void cuda_reduce_into(void* acc, const void* src, DType dtype, int64_t n, ReduceOp op,
                      double src_scale, int device);
void cuda_scale(void* data, DType dtype, int64_t n, double factor, int device);

}  // namespace kernels::detail
