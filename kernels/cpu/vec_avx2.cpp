// The x86-64-v3 (AVX2 + FMA) variant of the f32 VecOps table, compiled with -march=x86-64-v3
// (kernels/meson.build) and used only when the CPU has those features. NOTE [isa variants].
#define KERNELS_VEC_NS vec_avx2
#define Eigen KernelsEigenAvx2
#include "kernels/cpu/vec_impl.h"

namespace kernels::detail {

const VecOps<float>* vec_f32_avx2() {
  static const VecOps<float> ops = vec_avx2::make_ops<float>();
  return &ops;
}

}  // namespace kernels::detail
