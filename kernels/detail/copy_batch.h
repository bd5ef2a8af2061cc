// Internal: one strided copy (with cast) or zero fill of a batch, the unit of work behind
// kernels::chunk_cat / split_copy (kernels/ops/chunk_cat.h). A batch runs in one call on the CPU
// (cpu_copy_batch, over a few threads when large) or one kernel launch on CUDA
// (cuda_copy_batch). Pointers point at element [0,...,0]; strides are in elements.
//   CopyItem{dst, kBF16, {1}, src, kF32, {1}, {n}}   // dst[i] = bf16(src[i]), i < n
//   CopyItem{dst, kF32, {1}, nullptr, kF32, {}, {n}}  // dst[i] = +0
#pragma once

#include <cstdint>

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

struct CopyItem {
  void* dst = nullptr;
  DType dst_dtype = DType::kF32;
  Dims dst_strides;
  const void* src = nullptr;  // nullptr: fill with zero bits (+0 in every dtype)
  DType src_dtype = DType::kF32;
  Dims src_strides;  // ignored for a fill
  Dims shape;
};

}  // namespace kernels::detail
