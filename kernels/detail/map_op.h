// Internal: the element-wise maps shared by the CPU and CUDA back ends (kernels/ops/elementwise.h).
//   kAdd: a + alpha b   kMul: a b   kScale: alpha a   k*Backward: (dy, x) -> dx
#pragma once

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

// A strided input of a map, already broadcast to the output's shape (stride 0 on stretched dims).
struct MapOperand {
  const void* data;
  DType dtype;
  Dims strides;
};

enum class MapOp {
  kAdd,
  kMul,
  kScale,
  kGelu,
  kGeluTanh,
  kGeluBackward,
  kGeluTanhBackward,
  kSilu,
  kSiluBackward,
};

}  // namespace kernels::detail
