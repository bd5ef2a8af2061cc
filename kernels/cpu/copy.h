// Internal: CPU element kernels behind Tensor (copy with cast, fill, element access, comparisons).
// Pointers point at element [0,...,0]; strides are in elements; conversions follow
// NOTE [cast rules] in kernels/detail/convert.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <vector>

#include "kernels/detail/copy_batch.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

// dst[i] = cast(src[i]) for every multi-index i of shape. REQUIRES: no partial overlap.
void cpu_copy_cast(void* dst, DType dst_dtype, const Dims& dst_strides, const void* src,
                   DType src_dtype, const Dims& src_strides, const Dims& shape);
// Every item of the batch, as cpu_copy_cast / a zero fill would, on up to `threads` threads
// (the caller's and threads - 1 new ones; items are split along their outer dim so the workers
// get equal bytes). REQUIRES: no item's destination overlaps another item's operands.
void cpu_copy_batch(const std::vector<CopyItem>& items, int threads);
// Writes the low `itemsize` bytes of `pattern` to every element.
void cpu_fill(void* dst, size_t itemsize, const Dims& strides, const Dims& shape, uint64_t pattern);
// The bits of `value` converted to dtype, in the low itemsize(dtype) bytes.
uint64_t encode_value(double value, DType dtype);
double load_as_double(const void* element, DType dtype);
void store_from_double(void* element, DType dtype, double value);

// Contiguous arrays of n elements of one dtype. Floating dtypes compare by value (NaN != NaN,
// -0 == 0); integers compare exactly.
bool cpu_equal(const void* a, const void* b, DType dtype, int64_t n);
// REQUIRES: dtype is kF32 or kF64. torch.isclose semantics: finite values are close when
// |a - b| <= atol + rtol * |b|; infinities only equal themselves; NaN only with equal_nan.
bool cpu_allclose(const void* a, const void* b, DType dtype, int64_t n, double rtol, double atol,
                  bool equal_nan);

}  // namespace kernels::detail
