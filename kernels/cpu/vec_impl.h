// Internal: the bodies of the VecOps tables (kernels/cpu/vec.h), included once per ISA variant
// by vec_{sse2,avx2,avx512}.cpp with KERNELS_VEC_NS (this variant's namespace) and `Eigen`
// (Eigen's namespace, renamed) defined. See NOTE [isa variants] in vec.h. Nothing here may be
// an inline function or template of a namespace shared with other translation units.
#pragma once

#if !defined(KERNELS_VEC_NS) || !defined(Eigen)
#error "define KERNELS_VEC_NS and rename Eigen before including vec_impl.h"
#endif

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/vec.h"

namespace kernels::detail::KERNELS_VEC_NS {

template <class T>
using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
template <class T>
using CMap = Eigen::Map<const Arr<T>>;
template <class T>
using MMap = Eigen::Map<Arr<T>>;

// ---- GEMM ----

template <class T, bool kRowA, bool kRowB>
void gemm_impl(const GemmArgs<T>& g) {
  using Stride = Eigen::OuterStride<>;
  using MA =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, kRowA ? Eigen::RowMajor : Eigen::ColMajor>;
  using MB =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, kRowB ? Eigen::RowMajor : Eigen::ColMajor>;
  using MC = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const MA, 0, Stride> a(g.a, g.m, g.k, Stride(kRowA ? g.a_rs : g.a_cs));
  const Eigen::Map<const MB, 0, Stride> b(g.b, g.k, g.n, Stride(kRowB ? g.b_rs : g.b_cs));
  Eigen::Map<MC, 0, Stride> c(g.c, g.m, g.n, Stride(g.c_rs));
  if (g.beta == T(0)) {
    if (g.alpha == T(1)) {
      c.noalias() = a * b;
    } else {
      c.noalias() = (g.alpha * a) * b;
    }
    return;
  }
  if (g.beta != T(1)) c *= g.beta;
  if (g.alpha == T(1)) {
    c.noalias() += a * b;
  } else {
    c.noalias() += (g.alpha * a) * b;
  }
}

template <class T>
void gemm(const GemmArgs<T>& g) {
  if (g.m == 0 || g.n == 0) return;
  // Callers pass k > 0 (k == 0 is a scale of C, done without a product).
  const bool row_a = g.a_cs == 1;
  const bool row_b = g.b_cs == 1;
  if (row_a) {
    row_b ? gemm_impl<T, true, true>(g) : gemm_impl<T, true, false>(g);
  } else {
    row_b ? gemm_impl<T, false, true>(g) : gemm_impl<T, false, false>(g);
  }
}

// ---- element-wise ----

template <class T>
void add(T* out, const T* a, const T* b, T alpha, int64_t n) {
  if (alpha == T(1)) {
    MMap<T>(out, n) = CMap<T>(a, n) + CMap<T>(b, n);
  } else {
    MMap<T>(out, n) = CMap<T>(a, n) + alpha * CMap<T>(b, n);
  }
}

template <class T>
void mul(T* out, const T* a, const T* b, int64_t n) {
  MMap<T>(out, n) = CMap<T>(a, n) * CMap<T>(b, n);
}

template <class T>
void scale(T* out, const T* a, T alpha, int64_t n) {
  MMap<T>(out, n) = alpha * CMap<T>(a, n);
}

template <class T>
void add_scalar_b(T* out, const T* a, T b, T alpha, int64_t n) {
  MMap<T>(out, n) = CMap<T>(a, n) + alpha * b;
}

// sqrt(2 / pi) and 1 / sqrt(2 pi); kKappa is GELU's tanh-form cubic coefficient.
template <class T>
constexpr T kSqrt2OverPi = T(0.7978845608028654);
template <class T>
constexpr T kInvSqrt2Pi = T(0.3989422804014327);
template <class T>
constexpr T kSqrtHalf = T(0.7071067811865476);
template <class T>
constexpr T kKappa = T(0.044715);

template <class T>
void gelu(T* out, const T* x, int64_t n, bool tanh_form) {
  const CMap<T> xa(x, n);
  MMap<T> o(out, n);
  if (tanh_form) {
    o = T(0.5) * xa * (T(1) + (kSqrt2OverPi<T> * (xa + kKappa<T> * xa.cube())).tanh());
  } else {
    o = T(0.5) * xa * (T(1) + (xa * kSqrtHalf<T>).erf());
  }
}

template <class T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n, bool tanh_form) {
  const CMap<T> xa(x, n);
  const CMap<T> g(dy, n);
  MMap<T> o(dx, n);
  if (tanh_form) {
    // d/dx [0.5 x (1 + tanh(u))] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u',
    // u = sqrt(2/pi) (x + kappa x^3), u' = sqrt(2/pi) (1 + 3 kappa x^2).
    constexpr int64_t kChunk = 256;
    alignas(64) T th[kChunk];
    for (int64_t s = 0; s < n; s += kChunk) {
      const int64_t len = n - s < kChunk ? n - s : kChunk;
      const auto xs = xa.segment(s, len);
      MMap<T> t(th, len);
      t = (kSqrt2OverPi<T> * (xs + kKappa<T> * xs.cube())).tanh();
      o.segment(s, len) = g.segment(s, len) * (T(0.5) * (T(1) + t) +
                                               T(0.5) * xs * (T(1) - t.square()) * kSqrt2OverPi<T> *
                                                   (T(1) + T(3) * kKappa<T> * xs.square()));
    }
  } else {
    // d/dx [x Phi(x)] = Phi(x) + x phi(x).
    o = g * (T(0.5) * (T(1) + (xa * kSqrtHalf<T>).erf()) +
             xa * (T(-0.5) * xa.square()).exp() * kInvSqrt2Pi<T>);
  }
}

template <class T>
void silu(T* out, const T* x, int64_t n) {
  const CMap<T> xa(x, n);
  MMap<T>(out, n) = xa / (T(1) + (-xa).exp());
}

template <class T>
void silu_backward(T* dx, const T* dy, const T* x, int64_t n) {
  constexpr int64_t kChunk = 256;
  alignas(64) T sig[kChunk];
  for (int64_t s = 0; s < n; s += kChunk) {
    const int64_t len = n - s < kChunk ? n - s : kChunk;
    const CMap<T> xs(x + s, len);
    MMap<T> sg(sig, len);
    sg = T(1) / (T(1) + (-xs).exp());
    MMap<T>(dx + s, len) = CMap<T>(dy + s, len) * sg * (T(1) + xs * (T(1) - sg));
  }
}

// ---- f64 accumulation ----
// Eigen 3.4 has no vectorised float -> double cast, so .cast<double>().sum() runs one element at
// a time. These loops keep 8 independent f64 partial sums (a fixed order, the same on every ISA)
// in a shape GCC vectorises, conversion included.

template <class T>
double sum_d(const T* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(x[i + k]);
  }
  for (int k = 0; i < n; ++i, ++k) acc[k] += static_cast<double>(x[i]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

template <class T>
double dot_d(const T* x, const T* y, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      acc[k] += static_cast<double>(x[i + k]) * static_cast<double>(y[i + k]);
    }
  }
  for (int k = 0; i < n; ++i, ++k) acc[k] += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// ---- row reductions ----

template <class T>
T max(const T* x, int64_t n) {
  if (n == 0) return -std::numeric_limits<T>::infinity();
  return CMap<T>(x, n).template maxCoeff<Eigen::PropagateNaN>();
}

// Eigen computes the elements before `out`'s first vector-aligned address with scalar exp and
// the rest with its vector exp, which can differ by an ulp. Going through an aligned buffer makes
// the values depend on x and n only: callers pass heap scratch rows whose alignment varies from
// run to run.
template <class T>
double exp_shift_sum(T* out, const T* x, T shift, int64_t n) {
  if (n == 0) return 0.0;
  constexpr int64_t kChunk = 256;
  alignas(64) T buf[kChunk];
  for (int64_t s = 0; s < n; s += kChunk) {
    const int64_t len = n - s < kChunk ? n - s : kChunk;
    MMap<T>(buf, len) = (CMap<T>(x + s, len) - shift).exp();
    std::memcpy(out + s, buf, static_cast<size_t>(len) * sizeof(T));
  }
  return sum_d(out, n);
}

template <class T>
double sum(const T* x, int64_t n) {
  if (n == 0) return 0.0;
  return sum_d(x, n);
}

template <class T>
double sum_squares(const T* x, int64_t n) {
  if (n == 0) return 0.0;
  return dot_d(x, x, n);
}

template <class T>
double dot(const T* x, const T* y, int64_t n) {
  if (n == 0) return 0.0;
  return dot_d(x, y, n);
}

template <class T>
void accumulate(double* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<double>(x[i]);
}

template <class T>
void accumulate_product(double* acc, const T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<double>(x[i]) * static_cast<double>(y[i]);
}

// ---- optimizers (operation order of PyTorch's single-tensor AdamW / SGD, see optim.h) ----

// a * b + c, fused where PyTorch's vectorised CPU kernels fuse it (lerp, addcmul, add with alpha;
// measured against torch 2.15's AVX-512 kernels) and this
// variant has FMA, so the updates match torch's bit for bit on the same ISA whenever possible.
template <class T>
inline T madd(T a, T b, T c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

template <class T>
void adamw(T* p, const T* grad, T* m, T* v, T* vmax, int64_t n, const AdamWCoefficients<T>& c) {
  const T w = c.one_minus_beta1;
  const bool small_weight = w < T(0.5);  // torch's lerp switches formula at 0.5
  for (int64_t i = 0; i < n; ++i) {
    T g = c.maximize ? -grad[i] : grad[i];
    T pi = p[i];
    if (c.l2 != T(0)) g = madd(pi, c.l2, g);  // grad.add(param, alpha=weight_decay)
    pi = pi * c.decay;
    // exp_avg.lerp_(grad, 1 - beta1): torch's vectorised lerp is fma(coeff, end - start, base).
    const T mi = small_weight ? madd(w, g - m[i], m[i]) : madd(w - T(1), g - m[i], g);
    // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2): torch fuses it as fma(value * g, g, self).
    const T vi = madd(c.one_minus_beta2 * g, g, v[i] * c.beta2);
    m[i] = mi;
    v[i] = vi;
    T vd = vi;
    if (c.amsgrad) {
      vd = vmax[i] > vi || vmax[i] != vmax[i] ? vmax[i] : vi;
      vmax[i] = vd;
    }
    const T denom = std::sqrt(vd) / c.bias_correction2_sqrt + c.eps;
    p[i] = pi + (-c.step_size) * mi / denom;  // addcdiv_: self + value * t1 / t2
  }
}

template <class T>
void sgd(T* p, const T* grad, T* buf, int64_t n, const SgdCoefficients<T>& c) {
  // Every `x.add(y, alpha=a)` of torch's SGD is fma(y, a, x) in its vectorised kernels.
  for (int64_t i = 0; i < n; ++i) {
    T g = c.maximize ? -grad[i] : grad[i];
    if (c.weight_decay != T(0)) g = madd(p[i], c.weight_decay, g);
    if (c.has_momentum) {
      const T b = c.first_step ? g : madd(g, c.one_minus_dampening, buf[i] * c.momentum);
      buf[i] = b;
      g = c.nesterov ? madd(b, c.momentum, g) : b;
    }
    p[i] = madd(g, -c.lr, p[i]);
  }
}

// ---- batched rows ----

template <class T>
void norm_forward_rows(const RowsArgs<T>& a) {
  const int64_t len = a.len;
  const double inv = len > 0 ? 1.0 / static_cast<double>(len) : 0.0;
  for (int64_t r = 0; r < a.rows; ++r) {
    const CMap<T> x(a.x + r * a.x_rs, len);
    MMap<T> y(a.out + r * a.out_rs, len);
    // Statistics first (reading x only), then one pass writing y with the same roundings as the
    // per-row path of kernels/cpu/rowwise.cpp: ((x - mean) * rstd) * w + b.
    T mean = T(0);
    double rstd;
    if (a.rms) {
      rstd = 1.0 / std::sqrt(dot_d(x.data(), x.data(), len) * inv + a.eps);
    } else {
      const double m = sum_d(x.data(), len) * inv;
      mean = static_cast<T>(m);
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // sum (x - mean)^2, the difference rounded to T
      int64_t i = 0;
      for (; i + 8 <= len; i += 8) {
        T d[8];
        for (int k = 0; k < 8; ++k) d[k] = x[i + k] - mean;
        for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(d[k]) * static_cast<double>(d[k]);
      }
      for (int k = 0; i < len; ++i, ++k) {
        const double d = static_cast<double>(x[i] - mean);
        acc[k] += d * d;
      }
      const double q =
          ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      rstd = 1.0 / std::sqrt(q * inv + a.eps);
      a.mean[r * a.stat_rs] = static_cast<T>(m);
    }
    a.rstd[r * a.stat_rs] = static_cast<T>(rstd);
    const T rc = static_cast<T>(rstd);
    if (a.w != nullptr && a.b != nullptr) {
      y = ((x - mean) * rc) * CMap<T>(a.w, len) + CMap<T>(a.b, len);
    } else if (a.w != nullptr) {
      y = ((x - mean) * rc) * CMap<T>(a.w, len);
    } else if (a.b != nullptr) {
      y = (x - mean) * rc + CMap<T>(a.b, len);
    } else {
      y = (x - mean) * rc;
    }
  }
}

template <class T>
void norm_backward_rows(const RowsArgs<T>& a) {
  const int64_t len = a.len;
  if (len == 0) return;
  Arr<T> xhat(len), g(len);
  const T inv = static_cast<T>(1.0 / static_cast<double>(len));
  for (int64_t r = 0; r < a.rows; ++r) {
    const CMap<T> x(a.x + r * a.x_rs, len);
    const CMap<T> dy(a.dy + r * a.dy_rs, len);
    const T rstd = a.rstd[r * a.stat_rs];
    if (a.rms) {
      xhat = x * rstd;
    } else {
      xhat = (x - a.mean[r * a.stat_rs]) * rstd;
    }
    if (a.dw != nullptr) {
      accumulate_product(a.dw, dy.data(), xhat.data(), len);
    }
    if (a.db != nullptr) accumulate(a.db, dy.data(), len);
    if (a.out == nullptr) continue;
    if (a.w != nullptr) {
      g = dy * CMap<T>(a.w, len);
    } else {
      g = dy;
    }
    const T c1 = static_cast<T>(dot_d(g.data(), xhat.data(), len)) * inv;
    const T c2 = a.rms ? T(0) : static_cast<T>(sum_d(g.data(), len)) * inv;
    MMap<T>(a.out + r * a.out_rs, len) = (g - c2 - xhat * c1) * rstd;
  }
}

template <class T>
void softmax_rows(const RowsArgs<T>& a) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = a.x + r * a.x_rs;
    T* yr = a.out + r * a.out_rs;
    int64_t valid = a.len;
    if (a.causal_period > 0) valid = std::min<int64_t>(a.len, (a.row0 + r) % a.causal_period + 1);
    const CMap<T> x(xr, valid);
    MMap<T> y(yr, valid);
    if (a.from_lse) {
      const T lse = a.lse[r * a.stat_rs];
      if (lse == kNegInf) {
        y.setZero();
      } else {
        y = (x - lse).exp();
      }
    } else if (valid == 0) {
      if (a.lse != nullptr) a.lse[r * a.stat_rs] = kNegInf;
    } else {
      const T m = x.template maxCoeff<Eigen::PropagateNaN>();
      if (a.log) {
        y = (x - m).exp();  // scratch (in place: x[i] is read before y[i] is written)
        const double s = sum_d(y.data(), valid);
        y = x - static_cast<T>(static_cast<double>(m) + std::log(s));
      } else {
        y = (x - m).exp();  // in place is fine: element i reads x[i] before writing y[i]
        const double s = sum_d(y.data(), valid);
        y *= static_cast<T>(1.0 / s);
        if (a.lse != nullptr)
          a.lse[r * a.stat_rs] = static_cast<T>(static_cast<double>(m) + std::log(s));
      }
    }
    for (int64_t j = valid; j < a.len; ++j) yr[j] = T(0);
  }
}

template <class T>
void softmax_backward_rows(const RowsArgs<T>& a) {
  const int64_t len = a.len;
  for (int64_t r = 0; r < a.rows; ++r) {
    const CMap<T> y(a.x + r * a.x_rs, len);
    const CMap<T> dy(a.dy + r * a.dy_rs, len);
    MMap<T> dx(a.out + r * a.out_rs, len);
    if (a.log) {  // dx = dy - exp(y) * sum(dy)
      const T s = static_cast<T>(sum_d(dy.data(), len));
      dx = dy - y.exp() * s;
    } else {  // dx = y * (dy - sum(dy * y))
      const T d = static_cast<T>(dot_d(dy.data(), y.data(), len));
      dx = y * (dy - d);
    }
  }
}

// ---- bf16 conversions (the bit tricks of kernels/detail/convert.h, restated here so no inline
// function of a shared namespace is instantiated with this variant's -march) ----

template <class T>
void widen_bf16(T* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    dst[i] = static_cast<T>(f);
  }
}

template <class T>
void narrow_bf16(uint16_t* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(src[i]);
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
    dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

template <class T>
VecOps<T> make_ops() {
  VecOps<T> o{};
  o.gemm = &gemm<T>;
  o.add = &add<T>;
  o.mul = &mul<T>;
  o.scale = &scale<T>;
  o.add_scalar_b = &add_scalar_b<T>;
  o.gelu = &gelu<T>;
  o.gelu_backward = &gelu_backward<T>;
  o.silu = &silu<T>;
  o.silu_backward = &silu_backward<T>;
  o.max = &max<T>;
  o.exp_shift_sum = &exp_shift_sum<T>;
  o.sum = &sum<T>;
  o.sum_squares = &sum_squares<T>;
  o.dot = &dot<T>;
  o.accumulate = &accumulate<T>;
  o.accumulate_product = &accumulate_product<T>;
  o.adamw = &adamw<T>;
  o.sgd = &sgd<T>;
  o.norm_forward_rows = &norm_forward_rows<T>;
  o.norm_backward_rows = &norm_backward_rows<T>;
  o.softmax_rows = &softmax_rows<T>;
  o.softmax_backward_rows = &softmax_backward_rows<T>;
  o.gemm_bf16 = nullptr;  // set by vec.cpp where the CPU has AVX512-BF16
  o.widen_bf16 = &widen_bf16<T>;
  o.narrow_bf16 = &narrow_bf16<T>;
  return o;
}

}  // namespace kernels::detail::KERNELS_VEC_NS
