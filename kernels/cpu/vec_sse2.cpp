// The baseline variant of the VecOps tables (compiled with the project's default flags: SSE2 on
// x86-64), plus the only f64 table. NOTE [isa variants] in vec.h.
#define KERNELS_VEC_NS vec_baseline
#define Eigen KernelsEigenBaseline
#include "kernels/cpu/vec_impl.h"

namespace kernels::detail {

const VecOps<float>& vec_f32_baseline() {
  static const VecOps<float> ops = vec_baseline::make_ops<float>();
  return ops;
}

const VecOps<double>& vec_f64_baseline() {
  static const VecOps<double> ops = vec_baseline::make_ops<double>();
  return ops;
}

}  // namespace kernels::detail
