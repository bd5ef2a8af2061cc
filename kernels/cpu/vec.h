// Internal: the CPU primitives that decide the speed of the compute kernels (GEMM, activations,
// row reductions, optimizer updates), on contiguous arrays of f32 or f64. The f32 table is
// compiled three times, for baseline x86-64 (SSE2), x86-64-v3 (AVX2 + FMA) and x86-64-v4
// (AVX-512), and the best one the running CPU supports is chosen once (vec_kernels()); the f64
// table exists once (f64 serves the finite-difference checks, not speed). Everything strided,
// narrow (bf16/f16) or shaped lives in the callers (kernels/cpu/*.cpp), which convert to these
// contiguous forms chunk by chunk.
//
// NOTE [isa variants] vec_impl.h is included by vec_sse2.cpp, vec_avx2.cpp and vec_avx512.cpp,
// each compiled with its own -march. To keep the linker from merging an AVX-512 instantiation of
// an inline function into baseline code (the One Definition Rule assumes identical definitions),
// each variant renames Eigen's namespace (#define Eigen ...) and puts its own code in a namespace
// of its own; the test `kernels-vec-isolation` checks that the variant archives define no
// shared weak symbol.
//
//   const VecKernels& v = vec_kernels();            // e.g. the AVX2 table on this machine
//   v.f32.add(out, a, b, 1.0f, n);                   // out[i] = a[i] + 1 * b[i]
#pragma once

#include <cstdint>
#include <string_view>

namespace kernels::detail {

enum class Isa { kBaseline, kAvx2, kAvx512 };
std::string_view to_string(Isa isa);

// C = alpha * A @ B + beta * C with A [m, k], B [k, n], C [m, n] given by element strides
// (row stride, column stride). REQUIRES: one of a_rs/a_cs is 1, one of b_rs/b_cs is 1, c_cs is
// 1 (callers transpose the problem for a column-major C), no overlap of C with A or B.
// beta == 0 ignores C's old contents (NaN included).
template <class T>
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  T alpha = 1, beta = 0;
  const T* a = nullptr;
  int64_t a_rs = 0, a_cs = 1;
  const T* b = nullptr;
  int64_t b_rs = 0, b_cs = 1;
  T* c = nullptr;
  int64_t c_rs = 0;
};

// C [m, n] (f32, row stride c_rs, column stride 1) = alpha * A @ B + beta * C for bf16 A [m, k]
// and B [k, n] (raw bits) with any element strides; f32 accumulation. beta == 0 ignores C.
struct GemmBf16Args {
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1, beta = 0;
  const uint16_t* a = nullptr;
  int64_t a_rs = 0, a_cs = 1;
  const uint16_t* b = nullptr;
  int64_t b_rs = 0, b_cs = 1;
  float* c = nullptr;
  int64_t c_rs = 0;
};
using GemmBf16Fn = void (*)(const GemmBf16Args&);

// Hyper-parameters of one optimizer step in the compute type, as PyTorch's single-tensor code
// rounds them (Python floats, then the tensor's dtype at each op).
template <class T>
struct AdamWCoefficients {
  T decay;  // 1 - lr * weight_decay (decoupled), or 1
  T l2;     // weight_decay (coupled, Adam), or 0
  T one_minus_beta1;
  T beta2;
  T one_minus_beta2;
  T step_size;  // lr / (1 - beta1^t)
  T bias_correction2_sqrt;
  T eps;
  bool amsgrad;
  bool maximize;
};
template <class T>
struct SgdCoefficients {
  T lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize, first_step, has_momentum;
};

// Many rows of `len` contiguous elements at a fixed row stride (the common case of the row
// kernels: [..., D] activations, [g, T, S] attention scores), processed in one call so the per-row
// cost is a few instructions rather than a chain of calls. Statistics (mean, rstd, lse) are one
// value per row at stat_rs apart. Which fields are read depends on the function (VecOps below).
template <class T>
struct RowsArgs {
  int64_t rows = 0, len = 0;
  const T* x = nullptr;  // input rows (softmax backward: the saved output y)
  int64_t x_rs = 0;
  const T* dy = nullptr;  // backward: incoming gradient rows
  int64_t dy_rs = 0;
  T* out = nullptr;  // y, or dx (may be null in the norm backward)
  int64_t out_rs = 0;
  const T* w = nullptr;  // [len] weight / bias (norms; null: absent)
  const T* b = nullptr;
  T* mean = nullptr;  // norm statistics (forward writes, backward reads)
  T* rstd = nullptr;
  T* lse = nullptr;  // softmax: row log-sum-exp (attention)
  int64_t stat_rs = 0;
  double* dw = nullptr;  // [len] f64 accumulators of the parameter gradients (backward)
  double* db = nullptr;
  double eps = 0;
  bool rms = false;
  bool log = false;           // log_softmax
  int64_t causal_period = 0;  // softmax: row r sees columns <= (row0 + r) % causal_period
  int64_t row0 = 0;
  bool from_lse = false;  // softmax: out = exp(x - lse) on the visible columns
};

// Every pointer is to n contiguous elements; `out` may be the same array as an input (never a
// partial overlap).
template <class T>
struct VecOps {
  void (*gemm)(const GemmArgs<T>& args);
  // out = a + alpha * b;  out = a * b;  out = alpha * a
  void (*add)(T* out, const T* a, const T* b, T alpha, int64_t n);
  void (*mul)(T* out, const T* a, const T* b, int64_t n);
  void (*scale)(T* out, const T* a, T alpha, int64_t n);
  // out = a + alpha * b with b one value (broadcast)
  void (*add_scalar_b)(T* out, const T* a, T b, T alpha, int64_t n);
  // GELU (tanh form when tanh) and its backward dx = dy * gelu'(x); SiLU likewise.
  void (*gelu)(T* out, const T* x, int64_t n, bool tanh);
  void (*gelu_backward)(T* dx, const T* dy, const T* x, int64_t n, bool tanh);
  void (*silu)(T* out, const T* x, int64_t n);
  void (*silu_backward)(T* dx, const T* dy, const T* x, int64_t n);
  // Largest element, NaN if any is NaN; -inf for n == 0.
  T (*max)(const T* x, int64_t n);
  // out = exp(x - shift) (out may be x); returns the sum of out in double. Bit-identical
  // wherever out lies (its alignment included).
  double (*exp_shift_sum)(T* out, const T* x, T shift, int64_t n);
  // sum x, sum x^2, sum x*y, accumulated in double.
  double (*sum)(const T* x, int64_t n);
  double (*sum_squares)(const T* x, int64_t n);
  double (*dot)(const T* x, const T* y, int64_t n);
  // acc[i] += x[i] (acc in double: the column sums of the row reductions)
  void (*accumulate)(double* acc, const T* x, int64_t n);
  // acc[i] += x[i] * y[i] (double acc)
  void (*accumulate_product)(double* acc, const T* x, const T* y, int64_t n);
  // One optimizer step over n elements; grad in T (callers widen bf16 gradients first);
  // state pointers that an option does not use may be null.
  void (*adamw)(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, T* max_exp_avg_sq, int64_t n,
                const AdamWCoefficients<T>& c);
  void (*sgd)(T* param, const T* grad, T* momentum_buffer, int64_t n, const SgdCoefficients<T>& c);
  // Batched rows (RowsArgs): RMSNorm / LayerNorm forward (out, mean, rstd) and backward (out = dx
  // when non-null; dw / db accumulate), softmax / log-softmax forward (with the attention fields)
  // and backward. `out` must not alias x except where the kernel says so (softmax: may).
  void (*norm_forward_rows)(const RowsArgs<T>& a);
  void (*norm_backward_rows)(const RowsArgs<T>& a);
  void (*softmax_rows)(const RowsArgs<T>& a);
  void (*softmax_backward_rows)(const RowsArgs<T>& a);
  // bf16 <-> T conversions of n contiguous values (bf16 as raw bits), rounding to nearest even
  // with NaN kept NaN: bit-identical to kernels/detail/convert.h's, vectorised.
  // A native bf16 GEMM (AVX512-BF16), or nullptr: matmul then widens bf16 blocks to f32.
  GemmBf16Fn gemm_bf16;
  void (*widen_bf16)(T* dst, const uint16_t* src, int64_t n);
  void (*narrow_bf16)(uint16_t* dst, const T* src, int64_t n);
};

struct VecKernels {
  Isa isa;
  VecOps<float> f32;
  VecOps<double> f64;
};

// The table for the best ISA this CPU supports (decided once per process).
const VecKernels& vec_kernels();
// A specific table, or nullptr when this build or this CPU lacks it (for benchmarks and tests).
const VecKernels* vec_kernels_for(Isa isa);

template <class T>
const VecOps<T>& vec_ops() {
  if constexpr (sizeof(T) == 4) {
    return vec_kernels().f32;
  } else {
    return vec_kernels().f64;
  }
}

// Per-variant getters (vec_sse2.cpp, vec_avx2.cpp, vec_avx512.cpp).
const VecOps<float>& vec_f32_baseline();
const VecOps<double>& vec_f64_baseline();
const VecOps<float>* vec_f32_avx2();    // nullptr when not compiled in
const VecOps<float>* vec_f32_avx512();  // nullptr when not compiled in
GemmBf16Fn vec_gemm_bf16_avx512();      // nullptr when not compiled in

}  // namespace kernels::detail
