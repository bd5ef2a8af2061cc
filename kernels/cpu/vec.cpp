// Chooses the VecOps table for the running CPU (NOTE [isa variants] in vec.h). The variants are
// compiled in when kernels/meson.build defines KERNELS_VEC_AVX2 / KERNELS_VEC_AVX512 (x86-64
// with a compiler that accepts the -march levels).
#include "kernels/cpu/vec.h"

namespace kernels::detail {

#if !defined(KERNELS_VEC_AVX2)
const VecOps<float>* vec_f32_avx2() { return nullptr; }
#endif
#if !defined(KERNELS_VEC_AVX512)
const VecOps<float>* vec_f32_avx512() { return nullptr; }
#endif
#if !defined(KERNELS_VEC_AVX512BF16)
GemmBf16Fn vec_gemm_bf16_avx512() { return nullptr; }
#endif

namespace {

bool cpu_has(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  switch (isa) {
    case Isa::kBaseline:
      return true;
    // x86-64-v3 and v4 as GCC defines them (-march=x86-64-v3 / -v4 may use every one of these).
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe") &&
             __builtin_cpu_supports("lzcnt");
    case Isa::kAvx512:
      return cpu_has(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd");
  }
  return false;
#else
  return isa == Isa::kBaseline;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

const VecOps<float>* f32_table(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return &vec_f32_baseline();
    case Isa::kAvx2:
      return vec_f32_avx2();
    case Isa::kAvx512:
      return vec_f32_avx512();
  }
  return nullptr;
}

}  // namespace

std::string_view to_string(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return "baseline";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

const VecKernels* vec_kernels_for(Isa isa) {
  // One table per ISA, built on first use (the function pointers of each variant).
  struct Tables {
    VecKernels t[3];
    bool ok[3];
  };
  static const Tables tables = [] {
    Tables ts{};
    for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
      const int i = static_cast<int>(isa);
      const VecOps<float>* f32 = cpu_has(isa) ? f32_table(isa) : nullptr;
      ts.ok[i] = f32 != nullptr;
      if (f32 != nullptr) ts.t[i] = VecKernels{isa, *f32, vec_f64_baseline()};
      if (f32 != nullptr && isa == Isa::kAvx512 && cpu_has_avx512_bf16()) {
        ts.t[i].f32.gemm_bf16 = vec_gemm_bf16_avx512();
      }
    }
    return ts;
  }();
  const int i = static_cast<int>(isa);
  return tables.ok[i] ? &tables.t[i] : nullptr;
}

const VecKernels& vec_kernels() {
  static const VecKernels* best = [] {
    // The widest variant the CPU has. Measured here (bench/RESULTS.md "Kernels"): Eigen's
    // AVX-512 GEMM about equals its AVX2 one, and the transcendental maps (GELU, SiLU, exp) run up
    // to 2x faster with AVX-512.
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kBaseline}) {
      if (const VecKernels* k = vec_kernels_for(isa)) return k;
    }
    return vec_kernels_for(Isa::kBaseline);
  }();
  return *best;
}

}  // namespace kernels::detail
