// The x86-64-v4 (AVX-512 F/BW/DQ/VL) variant of the f32 VecOps table, compiled with
// -march=x86-64-v4 (kernels/meson.build) and used only when the CPU has those features.
// NOTE [isa variants] in vec.h.
#define KERNELS_VEC_NS vec_avx512
#define Eigen KernelsEigenAvx512
#include "kernels/cpu/vec_impl.h"

namespace kernels::detail {

const VecOps<float>* vec_f32_avx512() {
  static const VecOps<float> ops = vec_avx512::make_ops<float>();
  return &ops;
}

}  // namespace kernels::detail
