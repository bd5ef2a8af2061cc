// CUDA implementations of the compute kernels declared in cuda_compute.h. Deliberately plain:
// GEMM through cuBLAS; everything else one thread per element, one block per row (row kernels)
// or one thread per column (parameter gradients, the deterministic embedding scatter), with the
// same formulas as the CPU code (kernels/cpu/vec_impl.h, rowwise.cpp). Sums accumulate in f64.
// No fmt here (nvcc 13 cannot compile fmt 9): messages are built with std::string.
// Ordering: NOTE [cuda ordering] in cuda_ops.h (the compute stream, cuBLAS included).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_compute.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/device_guard.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/layout.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

// ---- host-side plumbing ----

std::string device_name(int device) { return "cuda:" + std::to_string(device); }

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(what + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

void check_blas(cublasStatus_t st, const std::string& what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw Error(what + " failed: " + cublasGetStatusName(st) + ": " + cublasGetStatusString(st));
  }
}

void check_launch(const char* kernel, int device) {
  check(cudaGetLastError(), std::string("launching ") + kernel + " on " + device_name(device));
}

// The device's compute stream (NOTE [compute stream] in cuda_ops.cu).
cudaStream_t stream_of(int device) { return static_cast<cudaStream_t>(cuda_compute_stream(device)); }

// One cuBLAS handle per (thread, device), created on first use and destroyed with the thread
// (handles are not meant to be shared between threads that issue work concurrently). Handles use
// the device's compute stream, like every other kernel here.
cublasHandle_t blas_handle(int device) {
  struct Handles {
    std::map<int, cublasHandle_t> by_device;
    ~Handles() {
      for (auto& [d, h] : by_device) (void)cublasDestroy(h);
    }
  };
  thread_local Handles handles;
  auto it = handles.by_device.find(device);
  if (it != handles.by_device.end()) return it->second;
  cublasHandle_t h = nullptr;
  check_blas(cublasCreate(&h), "cublasCreate on " + device_name(device));
  if (const cublasStatus_t st = cublasSetStream(h, stream_of(device)); st != CUBLAS_STATUS_SUCCESS) {
    (void)cublasDestroy(h);
    check_blas(st, "cublasSetStream on " + device_name(device));
  }
  handles.by_device[device] = h;
  return h;
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}
unsigned grid_for_rows(int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 65535)));
}

// A strided index space of up to kMaxDims dims with N stride lists, passed by value to kernels.
template <int N>
struct Layout {
  int nd = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[N][kMaxDims] = {};
};

template <int N>
Layout<N> make_layout(const Dims& shape, const std::array<Dims, N>& strides) {
  Layout<N> l;
  l.nd = shape.size();
  for (int d = 0; d < l.nd; ++d) {
    l.shape[d] = shape[d];
    for (int k = 0; k < N; ++k) l.stride[k][d] = strides[k][d];
  }
  return l;
}

// Element offsets of the i-th element (row-major) in each operand.
template <int N>
__device__ void offsets(const Layout<N>& l, int64_t i, int64_t (&off)[N]) {
  for (int k = 0; k < N; ++k) off[k] = 0;
  for (int d = l.nd - 1; d >= 0; --d) {
    const int64_t idx = i % l.shape[d];
    i /= l.shape[d];
    for (int k = 0; k < N; ++k) off[k] += idx * l.stride[k][d];
  }
}

// ---- typed element access for the floating dtypes ----

template <class C>
__device__ C ld(const void* base, DType dt, int64_t off) {
  switch (dt) {
    case DType::kF32:
      return static_cast<C>(static_cast<const float*>(base)[off]);
    case DType::kF64:
      return static_cast<C>(static_cast<const double*>(base)[off]);
    case DType::kBF16:
      return static_cast<C>(widen(static_cast<const BFloat16*>(base)[off]));
    case DType::kF16:
      return static_cast<C>(widen(static_cast<const Half*>(base)[off]));
    default:
      return C(0);
  }
}

template <class C>
__device__ void st(void* base, DType dt, int64_t off, C v) {
  switch (dt) {
    case DType::kF32:
      static_cast<float*>(base)[off] = narrow_to<float>(v);
      return;
    case DType::kF64:
      static_cast<double*>(base)[off] = narrow_to<double>(v);
      return;
    case DType::kBF16:
      static_cast<BFloat16*>(base)[off] = narrow_to<BFloat16>(v);
      return;
    case DType::kF16:
      static_cast<Half*>(base)[off] = narrow_to<Half>(v);
      return;
    default:
      return;
  }
}

__device__ int64_t ld_index(const void* base, DType dt, int64_t off) {
  return dt == DType::kI64 ? static_cast<const int64_t*>(base)[off]
                           : static_cast<int64_t>(static_cast<const int32_t*>(base)[off]);
}

template <class C>
__device__ C dexp(C x) {
  if constexpr (std::is_same_v<C, float>) {
    return expf(x);
  } else {
    return exp(x);
  }
}
template <class C>
__device__ C derf(C x) {
  if constexpr (std::is_same_v<C, float>) {
    return erff(x);
  } else {
    return erf(x);
  }
}
template <class C>
__device__ C dtanh(C x) {
  if constexpr (std::is_same_v<C, float>) {
    return tanhf(x);
  } else {
    return tanh(x);
  }
}
template <class C>
__device__ C dsqrt(C x) {
  if constexpr (std::is_same_v<C, float>) {
    return sqrtf(x);
  } else {
    return sqrt(x);
  }
}
template <class C>
__device__ C dfma(C a, C b, C c) {
  if constexpr (std::is_same_v<C, float>) {
    return fmaf(a, b, c);
  } else {
    return fma(a, b, c);
  }
}
__device__ bool is_nan(double x) { return x != x; }

// ---- block reductions (blockDim.x == kThreads) ----

__device__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();
  return r;
}

// Max with NaN propagation (any NaN makes the result NaN).
__device__ double block_max(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const double a = shared[threadIdx.x], b = shared[threadIdx.x + s];
      shared[threadIdx.x] = (is_nan(a) || is_nan(b)) ? (a + b) : (b > a ? b : a);
    }
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();
  return r;
}

constexpr double kInf = __builtin_huge_val();

// ---- element-wise maps ----

template <class C>
__device__ C apply_map(MapOp op, C alpha, C a, C b) {
  const C half = C(0.5), one = C(1);
  const C k_sqrt_half = C(0.7071067811865476), k_sqrt_2_pi = C(0.7978845608028654),
          k_inv_sqrt_2pi = C(0.3989422804014327), kappa = C(0.044715);
  switch (op) {
    case MapOp::kAdd:
      return a + alpha * b;
    case MapOp::kMul:
      return a * b;
    case MapOp::kScale:
      return alpha * a;
    case MapOp::kGelu:
      return half * a * (one + derf(a * k_sqrt_half));
    case MapOp::kGeluTanh:
      return half * a * (one + dtanh(k_sqrt_2_pi * (a + kappa * a * a * a)));
    case MapOp::kGeluBackward: {  // a = dy, b = x
      const C cdf = half * (one + derf(b * k_sqrt_half));
      return a * (cdf + b * dexp(C(-0.5) * b * b) * k_inv_sqrt_2pi);
    }
    case MapOp::kGeluTanhBackward: {
      const C t = dtanh(k_sqrt_2_pi * (b + kappa * b * b * b));
      return a * (half * (one + t) +
                  half * b * (one - t * t) * k_sqrt_2_pi * (one + C(3) * kappa * b * b));
    }
    case MapOp::kSilu:
      return a / (one + dexp(-a));
    case MapOp::kSiluBackward: {
      const C s = one / (one + dexp(-b));
      return a * s * (one + b * (one - s));
    }
  }
  return C(0);
}

struct MapArgs {
  void* out;
  DType out_dtype;
  const void* in0;
  DType in0_dtype;
  const void* in1;
  DType in1_dtype;
};

template <class C>
__global__ void map_kernel(MapOp op, C alpha, MapArgs a, Layout<3> l, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[3];
    offsets<3>(l, i, off);
    const C x0 = ld<C>(a.in0, a.in0_dtype, off[1]);
    const C x1 = a.in1 != nullptr ? ld<C>(a.in1, a.in1_dtype, off[2]) : C(0);
    st<C>(a.out, a.out_dtype, off[0], apply_map<C>(op, alpha, x0, x1));
  }
}

// ---- reductions ----

struct ReduceArgs {
  const void* x;
  DType x_dtype;
  void* out;
  DType out_dtype;
  double scale;
  bool accumulate, square;
  int64_t outputs, count;
};

// Layout<2> kept: strides [0] in x, [1] in out; Layout<1> reduced: strides in x.
__global__ void reduce_kernel(ReduceArgs a, Layout<2> kept, Layout<1> reduced) {
  __shared__ double shared[kThreads];
  for (int64_t o = blockIdx.x; o < a.outputs; o += gridDim.x) {
    int64_t ko[2];
    offsets<2>(kept, o, ko);
    double acc = 0;
    for (int64_t r = threadIdx.x; r < a.count; r += blockDim.x) {
      int64_t ro[1];
      offsets<1>(reduced, r, ro);
      const double v = ld<double>(a.x, a.x_dtype, ko[0] + ro[0]);
      acc += a.square ? v * v : v;
    }
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) {
      double res = acc * a.scale;
      if (a.accumulate) res += ld<double>(a.out, a.out_dtype, ko[1]);
      st<double>(a.out, a.out_dtype, ko[1], res);
    }
  }
}

struct DimArgs {
  int64_t outputs, len;
  const void* x;
  DType x_dtype;
  int64_t x_dim_stride;
  void* values;
  int64_t* indices;
  void* dx;
  DType dx_dtype;
  int64_t dx_dim_stride;
  const void* dy;
  DType dy_dtype;
  const int64_t* index;
};

// Layout<1> over outer_shape with x's strides.
__global__ void max_dim_kernel(DimArgs a, Layout<1> l) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < a.outputs;
       o += step) {
    int64_t off[1];
    offsets<1>(l, o, off);
    double best = ld<double>(a.x, a.x_dtype, off[0]);
    int64_t arg = 0;
    if (!is_nan(best)) {
      for (int64_t j = 1; j < a.len; ++j) {
        const double v = ld<double>(a.x, a.x_dtype, off[0] + j * a.x_dim_stride);
        if (is_nan(v)) {
          best = v, arg = j;
          break;
        }
        if (v > best) best = v, arg = j;
      }
    }
    st<double>(a.values, a.x_dtype, o, best);  // exact: best is an element of x
    a.indices[o] = arg;
  }
}

// Layout<3> over outer_shape: strides of dx, dy, index.
__global__ void scatter_dim_kernel(DimArgs a, Layout<3> l) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < a.outputs;
       o += step) {
    int64_t off[3];
    offsets<3>(l, o, off);
    const int64_t j = a.index[off[2]];
    if (j < 0 || j >= a.len) continue;  // the host checked nothing here; out-of-range is dropped
    st<double>(a.dx, a.dx_dtype, off[0] + j * a.dx_dim_stride,
               ld<double>(a.dy, a.dy_dtype, off[1]));
  }
}

// ---- row kernels ----

struct Rows {
  int nd = 0;
  int64_t shape[kMaxDims] = {};
};

struct RowRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t outer[kMaxDims] = {};
  int64_t stride = 1;
};

RowRef row_ref(const RowTensor& t) {
  RowRef r;
  r.data = t.data;
  r.dtype = t.dtype;
  for (int d = 0; d < t.outer_strides.size(); ++d) r.outer[d] = t.outer_strides[d];
  r.stride = t.stride;
  return r;
}

Rows rows_of(const Dims& outer_shape) {
  Rows r;
  r.nd = outer_shape.size();
  for (int d = 0; d < r.nd; ++d) r.shape[d] = outer_shape[d];
  return r;
}

__device__ int64_t row_offset(const Rows& rows, const RowRef& t, int64_t o) {
  int64_t off = 0;
  for (int d = rows.nd - 1; d >= 0; --d) {
    off += (o % rows.shape[d]) * t.outer[d];
    o /= rows.shape[d];
  }
  return off;
}

struct SoftmaxArgs {
  int64_t rows, len, causal_period;
  bool log, backward, from_lse;
  RowRef x, dy, out, lse;
};

// One block per row; C is the compute type (float, or double for f64 data).
template <class C>
__global__ void softmax_kernel(SoftmaxArgs a, Rows shape) {
  __shared__ double shared[kThreads];
  const bool attention = a.causal_period > 0 || a.from_lse || a.lse.data != nullptr;
  for (int64_t o = blockIdx.x; o < a.rows; o += gridDim.x) {
    const int64_t xo = row_offset(shape, a.x, o), oo = row_offset(shape, a.out, o);
    auto x = [&](int64_t j) { return ld<C>(a.x.data, a.x.dtype, xo + j * a.x.stride); };
    auto put = [&](int64_t j, C v) { st<C>(a.out.data, a.out.dtype, oo + j * a.out.stride, v); };
    if (attention) {
      const int64_t visible = o % (a.causal_period > 0 ? a.causal_period : 1) + 1;
      const int64_t valid = a.causal_period > 0 && visible < a.len ? visible : a.len;
      const int64_t lo = a.lse.data != nullptr ? row_offset(shape, a.lse, o) : 0;
      for (int64_t j = valid + threadIdx.x; j < a.len; j += blockDim.x) put(j, C(0));
      if (a.from_lse) {
        const C lse = ld<C>(a.lse.data, a.lse.dtype, lo);
        for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
          put(j, lse == C(-kInf) ? C(0) : dexp(x(j) - lse));
        }
        continue;
      }
      double m = -kInf;
      for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
        const double v = x(j);
        m = (is_nan(m) || is_nan(v)) ? m + v : (v > m ? v : m);
      }
      m = block_max(m, shared);
      const C mc = static_cast<C>(m);
      double s = 0;
      for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += dexp(x(j) - mc);
      s = block_sum(s, shared);
      const C inv = static_cast<C>(1.0 / s);
      // Reads of row j happen before its write by the same thread (in place is safe).
      for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) put(j, dexp(x(j) - mc) * inv);
      if (threadIdx.x == 0 && a.lse.data != nullptr) {
        st<double>(a.lse.data, a.lse.dtype, lo, valid == 0 ? -kInf : m + log(s));
      }
      continue;
    }
    if (!a.backward) {
      double m = -kInf;
      for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
        const double v = x(j);
        m = (is_nan(m) || is_nan(v)) ? m + v : (v > m ? v : m);
      }
      m = block_max(m, shared);
      const C mc = static_cast<C>(m);
      double s = 0;
      for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) s += dexp(x(j) - mc);
      s = block_sum(s, shared);
      if (a.log) {
        const C shift = static_cast<C>(m + log(s));
        for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) put(j, x(j) - shift);
      } else {
        const C inv = static_cast<C>(1.0 / s);
        for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) put(j, dexp(x(j) - mc) * inv);
      }
      continue;
    }
    const int64_t go = row_offset(shape, a.dy, o);
    auto dy = [&](int64_t j) { return ld<C>(a.dy.data, a.dy.dtype, go + j * a.dy.stride); };
    double s = 0;
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      s += a.log ? static_cast<double>(dy(j))
                 : static_cast<double>(dy(j)) * static_cast<double>(x(j));
    }
    s = block_sum(s, shared);  // every thread has read its dy(j) before any write (barrier)
    const C sc = static_cast<C>(s);
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      put(j, a.log ? dy(j) - dexp(x(j)) * sc : x(j) * (dy(j) - sc));
    }
  }
}

struct NormArgs {
  int64_t rows, len;
  bool rms, accumulate;
  double eps;
  RowRef x, y, dy, dx, mean, rstd;
  const void* w;
  DType w_dtype;
  int64_t w_stride;
  const void* b;
  DType b_dtype;
  int64_t b_stride;
  void* dw;
  DType dw_dtype;
  int64_t dw_stride;
  void* db;
  DType db_dtype;
  int64_t db_stride;
};

template <class C>
__global__ void norm_forward_kernel(NormArgs a, Rows shape) {
  __shared__ double shared[kThreads];
  for (int64_t o = blockIdx.x; o < a.rows; o += gridDim.x) {
    const int64_t xo = row_offset(shape, a.x, o), yo = row_offset(shape, a.y, o);
    auto x = [&](int64_t j) {
      return static_cast<double>(ld<C>(a.x.data, a.x.dtype, xo + j * a.x.stride));
    };
    double mean = 0;
    if (!a.rms) {
      double s = 0;
      for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) s += x(j);
      mean = a.len > 0 ? block_sum(s, shared) / static_cast<double>(a.len) : 0.0;
    }
    double q = 0;
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      const C d = static_cast<C>(x(j)) - static_cast<C>(mean);
      q += static_cast<double>(d) * static_cast<double>(d);
    }
    q = block_sum(q, shared);
    const double var = a.len > 0 ? q / static_cast<double>(a.len) : 0.0;
    const double rstd = 1.0 / sqrt(var + a.eps);
    const C rc = static_cast<C>(rstd), mc = static_cast<C>(mean);
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      C v = (static_cast<C>(x(j)) - mc) * rc;
      if (a.w != nullptr) v = v * ld<C>(a.w, a.w_dtype, j * a.w_stride);
      if (a.b != nullptr) v = v + ld<C>(a.b, a.b_dtype, j * a.b_stride);
      st<C>(a.y.data, a.y.dtype, yo + j * a.y.stride, v);
    }
    if (threadIdx.x == 0) {
      st<double>(a.rstd.data, a.rstd.dtype, row_offset(shape, a.rstd, o), rstd);
      if (!a.rms) st<double>(a.mean.data, a.mean.dtype, row_offset(shape, a.mean, o), mean);
    }
  }
}

// dx, one block per row.
template <class C>
__global__ void norm_backward_dx_kernel(NormArgs a, Rows shape) {
  __shared__ double shared[kThreads];
  for (int64_t o = blockIdx.x; o < a.rows; o += gridDim.x) {
    const int64_t xo = row_offset(shape, a.x, o), go = row_offset(shape, a.dy, o),
                  dxo = row_offset(shape, a.dx, o);
    const C rstd = ld<C>(a.rstd.data, a.rstd.dtype, row_offset(shape, a.rstd, o));
    const C mean = a.rms ? C(0) : ld<C>(a.mean.data, a.mean.dtype, row_offset(shape, a.mean, o));
    auto xhat = [&](int64_t j) {
      return (ld<C>(a.x.data, a.x.dtype, xo + j * a.x.stride) - mean) * rstd;
    };
    auto g = [&](int64_t j) {
      C v = ld<C>(a.dy.data, a.dy.dtype, go + j * a.dy.stride);
      return a.w != nullptr ? v * ld<C>(a.w, a.w_dtype, j * a.w_stride) : v;
    };
    double s1 = 0, s2 = 0;
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      s1 += static_cast<double>(g(j)) * static_cast<double>(xhat(j));
      s2 += static_cast<double>(g(j));
    }
    const double inv = 1.0 / static_cast<double>(a.len);
    const C c1 = static_cast<C>(block_sum(s1, shared) * inv);
    const C c2 = a.rms ? C(0) : static_cast<C>(block_sum(s2, shared) * inv);
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      st<C>(a.dx.data, a.dx.dtype, dxo + j * a.dx.stride, (g(j) - c2 - xhat(j) * c1) * rstd);
    }
  }
}

// dweight / dbias: one thread per column, rows in order (deterministic), sums in f64.
template <class C>
__global__ void norm_backward_params_kernel(NormArgs a, Rows shape) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < a.len;
       j += step) {
    double sw = 0, sb = 0;
    for (int64_t o = 0; o < a.rows; ++o) {
      const C rstd = ld<C>(a.rstd.data, a.rstd.dtype, row_offset(shape, a.rstd, o));
      const C mean = a.rms ? C(0) : ld<C>(a.mean.data, a.mean.dtype, row_offset(shape, a.mean, o));
      const C xh =
          (ld<C>(a.x.data, a.x.dtype, row_offset(shape, a.x, o) + j * a.x.stride) - mean) * rstd;
      const C g = ld<C>(a.dy.data, a.dy.dtype, row_offset(shape, a.dy, o) + j * a.dy.stride);
      sw += static_cast<double>(g) * static_cast<double>(xh);
      sb += static_cast<double>(g);
    }
    if (a.dw != nullptr) {
      const double old = a.accumulate ? ld<double>(a.dw, a.dw_dtype, j * a.dw_stride) : 0.0;
      st<double>(a.dw, a.dw_dtype, j * a.dw_stride, old + sw);
    }
    if (a.db != nullptr) {
      const double old = a.accumulate ? ld<double>(a.db, a.db_dtype, j * a.db_stride) : 0.0;
      st<double>(a.db, a.db_dtype, j * a.db_stride, old + sb);
    }
  }
}

struct CeArgs {
  CrossEntropyMode mode;
  int64_t n, len, vocab_start, ignore_index;
  RowRef logits, dlogits;
  const void* targets;
  DType targets_dtype;
  int64_t targets_stride;
  void* row_losses;
  double grad_scale;
  void* stat_max;
  void* stat_sum_exp;
  void* stat_target;
  const void* global_max;
  const void* global_sum_exp;
};

template <class C>
__global__ void cross_entropy_kernel(CeArgs a, Rows shape) {
  __shared__ double shared[kThreads];
  constexpr DType kC = std::is_same_v<C, double> ? DType::kF64 : DType::kF32;
  for (int64_t i = blockIdx.x; i < a.n; i += gridDim.x) {
    const int64_t t = ld_index(a.targets, a.targets_dtype, i * a.targets_stride);
    const bool ignored = t == a.ignore_index;
    const int64_t local_t = t - a.vocab_start;
    const bool in_shard = !ignored && local_t >= 0 && local_t < a.len;
    const int64_t xo = row_offset(shape, a.logits, i);
    auto x = [&](int64_t j) {
      return ld<C>(a.logits.data, a.logits.dtype, xo + j * a.logits.stride);
    };
    // The target logit is read before the barriers below, so an in-place dlogits (the same view
    // as logits) cannot overwrite it first.
    const double xt = (threadIdx.x == 0 && in_shard) ? static_cast<double>(x(local_t)) : 0.0;
    double m, s;
    if (a.mode == CrossEntropyMode::kBackward) {
      m = ld<double>(a.global_max, kC, i);
      s = ld<double>(a.global_sum_exp, kC, i);
    } else {
      m = -kInf;
      for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
        const double v = x(j);
        m = (is_nan(m) || is_nan(v)) ? m + v : (v > m ? v : m);
      }
      m = block_max(m, shared);
      s = 0;
      const C mc = static_cast<C>(m);
      for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) s += dexp(x(j) - mc);
      s = block_sum(s, shared);
    }
    if (a.mode == CrossEntropyMode::kStats) {
      if (threadIdx.x == 0) {
        st<double>(a.stat_max, kC, i, m);
        st<double>(a.stat_sum_exp, kC, i, s);
        st<double>(a.stat_target, kC, i, xt);
      }
      continue;
    }
    if (a.mode == CrossEntropyMode::kFused && threadIdx.x == 0) {
      st<double>(a.row_losses, kC, i, ignored ? 0.0 : log(s) + m - xt);
    }
    if (a.dlogits.data == nullptr) continue;
    const int64_t dof = row_offset(shape, a.dlogits, i);
    const C mc = static_cast<C>(m);
    const C scale = static_cast<C>(a.grad_scale / s);
    for (int64_t j = threadIdx.x; j < a.len; j += blockDim.x) {
      C v = C(0);
      if (!ignored) {
        v = dexp(x(j) - mc) * scale;
        if (j == local_t) v = static_cast<C>(static_cast<double>(v) - a.grad_scale);
      }
      st<C>(a.dlogits.data, a.dlogits.dtype, dof + j * a.dlogits.stride, v);
    }
  }
}

__global__ void rescale_kernel(void* se, int64_t se_s, const void* lm, int64_t lm_s, const void* gm,
                               int64_t gm_s, DType dt, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const double l = ld<double>(lm, dt, i * lm_s);
    const double r =
        l == -kInf ? 0.0 : ld<double>(se, dt, i * se_s) * exp(l - ld<double>(gm, dt, i * gm_s));
    st<double>(se, dt, i * se_s, r);
  }
}

// ---- embedding ----

struct EmbArgs {
  int64_t positions, dim, row_start, rows;
  bool has_padding;
  int64_t padding_idx;
  const void* ids;
  DType ids_dtype;
  RowRef table, out, dy;
  void* dw;
  DType dw_dtype;
};

// Layout<1> over ids_shape with ids' strides; Rows over ids_shape for out / dy.
__global__ void embedding_forward_kernel(EmbArgs a, Layout<1> ids, Rows shape) {
  const int64_t n = a.positions * a.dim;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t p = i / a.dim, j = i % a.dim;
    int64_t io[1];
    offsets<1>(ids, p, io);
    const int64_t r = ld_index(a.ids, a.ids_dtype, io[0]) - a.row_start;
    const double v = (r >= 0 && r < a.rows) ? ld<double>(a.table.data, a.table.dtype,
                                                         r * a.table.outer[0] + j * a.table.stride)
                                            : 0.0;
    st<double>(a.out.data, a.out.dtype, row_offset(shape, a.out, p) + j * a.out.stride, v);
  }
}

// One thread per column j; positions in increasing order: deterministic sums.
template <class C>
__global__ void embedding_backward_kernel(EmbArgs a, Layout<1> ids, Rows shape) {
  C* dw = static_cast<C*>(a.dw);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < a.dim;
       j += step) {
    for (int64_t p = 0; p < a.positions; ++p) {
      int64_t io[1];
      offsets<1>(ids, p, io);
      const int64_t id = ld_index(a.ids, a.ids_dtype, io[0]);
      const int64_t r = id - a.row_start;
      if (r < 0 || r >= a.rows || (a.has_padding && id == a.padding_idx)) continue;
      dw[r * a.dim + j] +=
          ld<C>(a.dy.data, a.dy.dtype, row_offset(shape, a.dy, p) + j * a.dy.stride);
    }
  }
}

// ---- optimizers (kernels/cpu/vec_impl.h's adamw / sgd, fused multiply-adds included) ----

template <class T>
struct OptimArgs {
  bool adamw;
  T* param;
  const void* grad;
  DType grad_dtype;
  T* state[3];
  int nstate;
  T decay, l2, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;
  bool amsgrad, maximize;
  T lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step;
};

// Layout<5>: param, grad, state 0..2.
template <class T>
__global__ void optim_kernel(OptimArgs<T> a, Layout<5> l, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[5];
    offsets<5>(l, i, off);
    T g = ld<T>(a.grad, a.grad_dtype, off[1]);
    if (a.maximize) g = -g;
    T p = a.param[off[0]];
    if (a.adamw) {
      T* m = a.state[0] + off[2];
      T* v = a.state[1] + off[3];
      if (a.l2 != T(0)) g = dfma(p, a.l2, g);
      p = p * a.decay;
      const T w = a.one_minus_beta1;
      const T mi = w < T(0.5) ? dfma(w, g - *m, *m) : dfma(w - T(1), g - *m, g);
      const T vi = dfma(a.one_minus_beta2 * g, g, *v * a.beta2);
      *m = mi;
      *v = vi;
      T vd = vi;
      if (a.amsgrad) {
        T* vmax = a.state[2] + off[4];
        vd = (*vmax > vi || *vmax != *vmax) ? *vmax : vi;
        *vmax = vd;
      }
      const T denom = dsqrt(vd) / a.bc2_sqrt + a.eps;
      a.param[off[0]] = p + (-a.step_size) * mi / denom;
    } else {
      if (a.weight_decay != T(0)) g = dfma(p, a.weight_decay, g);
      if (a.nstate > 0) {
        T* buf = a.state[0] + off[2];
        const T b = a.first_step ? g : dfma(g, a.one_minus_dampening, *buf * a.momentum);
        *buf = b;
        g = a.nesterov ? dfma(b, a.momentum, g) : b;
      }
      a.param[off[0]] = dfma(g, -a.lr, p);
    }
  }
}

template <class T>
void launch_optim(const OptimPlan& p, int device) {
  OptimArgs<T> a{};
  a.adamw = p.adamw;
  a.param = static_cast<T*>(p.param);
  a.grad = p.grad;
  a.grad_dtype = p.grad_dtype;
  a.nstate = p.adamw ? (p.amsgrad ? 3 : 2) : (p.state[0] != nullptr ? 1 : 0);
  for (int k = 0; k < 3; ++k) a.state[k] = static_cast<T*>(p.state[k]);
  a.decay = static_cast<T>(p.decay), a.l2 = static_cast<T>(p.l2);
  a.one_minus_beta1 = static_cast<T>(p.one_minus_beta1), a.beta2 = static_cast<T>(p.beta2);
  a.one_minus_beta2 = static_cast<T>(p.one_minus_beta2), a.step_size = static_cast<T>(p.step_size);
  a.bc2_sqrt = static_cast<T>(p.bias_correction2_sqrt), a.eps = static_cast<T>(p.eps);
  a.amsgrad = p.amsgrad, a.maximize = p.maximize;
  a.lr = static_cast<T>(p.lr), a.momentum = static_cast<T>(p.momentum);
  a.one_minus_dampening = static_cast<T>(p.one_minus_dampening);
  a.weight_decay = static_cast<T>(p.weight_decay);
  a.nesterov = p.nesterov, a.first_step = p.first_step;
  std::array<Dims, 5> strides = {p.param_strides, p.grad_strides, p.param_strides, p.param_strides,
                                 p.param_strides};
  for (int k = 0; k < a.nstate; ++k) strides[2 + k] = p.state_strides[k];
  const int64_t n = p.shape.product();
  optim_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(device)>>>(a, make_layout<5>(p.shape, strides), n);
  check_launch("optim_kernel", device);
}

// ---- GEMM ----

cudaDataType_t blas_type(DType d) {
  switch (d) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kF64:
      return CUDA_R_64F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      throw InternalError("cuda_gemm: unexpected dtype");
  }
}

// When every batch offset of an operand is index * stride over the flattened batch (its batch
// dims collapse into one: attention's [B, H] batches of contiguous or permuted activations,
// or a stride-0 broadcast of the whole batch), sets `stride` and returns true.
bool collapses(const Dims& shape, const Dims& strides, int64_t& stride) {
  bool first = true;
  int64_t outer = 0;  // the stride the next outer dim must have
  stride = 0;
  for (int d = shape.size() - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    if (first) stride = strides[d], first = false;
    else if (strides[d] != outer) return false;
    outer = strides[d] * shape[d];
  }
  return true;
}

}  // namespace

// ---- entry points ----

void cuda_gemm(const GemmPlan& plan, int device) {
  DeviceGuard guard(device);
  GemmPlan p = plan;
  // A column-major C is the row-major C^T = B^T A^T (swap the operands and their strides).
  if (p.c_cs != 1) {
    std::swap(p.m, p.n);
    std::swap(p.a, p.b);
    std::swap(p.a_batch_strides, p.b_batch_strides);
    const int64_t a_rs = p.a_rs, a_cs = p.a_cs;
    p.a_rs = p.b_cs, p.a_cs = p.b_rs;
    p.b_rs = a_cs, p.b_cs = a_rs;
    p.c_rs = p.c_cs, p.c_cs = 1;
  }
  // cuBLAS is column-major: the row-major C [m, n] (ld c_rs) is the column-major C^T [n, m], and
  // C^T = op(B) op(A) where B's memory read column-major is B^T (row-major B: op N, ld b_rs) or
  // B (column-major B: op T, ld b_cs); likewise for A.
  const bool a_row = p.a_cs == 1, b_row = p.b_cs == 1;
  const cublasOperation_t op_a = a_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_b = b_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  // Leading dimensions; cuBLAS wants ld >= the stored column length even for one column.
  int64_t lda = a_row ? p.a_rs : p.a_cs, ldb = b_row ? p.b_rs : p.b_cs, ldc = p.c_rs;
  const int64_t a_len = a_row ? p.k : p.m, b_len = b_row ? p.n : p.k;
  if ((a_row ? p.m : p.k) == 1) lda = std::max(lda, a_len);
  if ((b_row ? p.k : p.n) == 1) ldb = std::max(ldb, b_len);
  if (p.m == 1) ldc = std::max(ldc, p.n);
  lda = std::max<int64_t>(lda, 1), ldb = std::max<int64_t>(ldb, 1), ldc = std::max<int64_t>(ldc, 1);
  if (lda < a_len || ldb < b_len || ldc < p.n) {
    throw InternalError(
        "cuda_gemm: leading dimension below the column length (the front end copies "
        "such operands)");
  }
  const bool f64 = p.dtype == DType::kF64;
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const float alpha_f = static_cast<float>(p.alpha), beta_f = static_cast<float>(p.beta);
  const double alpha_d = p.alpha, beta_d = p.beta;
  const void* alpha = f64 ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = f64 ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  const cudaDataType_t in_t = blas_type(p.dtype), out_t = blas_type(p.out_dtype);
  const int64_t in_size = static_cast<int64_t>(itemsize(p.dtype));
  const int64_t out_size = static_cast<int64_t>(itemsize(p.out_dtype));
  cublasHandle_t h = blas_handle(device);
  const int64_t batches = p.batch_shape.product();
  // bf16 / f16 inputs with f32 accumulation run on the tensor cores (CUBLAS_COMPUTE_32F). A
  // batch whose offsets collapse is one strided-batched call instead of one call per matrix.
  int64_t sa = 0, sb = 0, sc = 0;
  if (batches > 1 && batches <= std::numeric_limits<int>::max() && collapses(p.batch_shape, p.a_batch_strides, sa) &&
      collapses(p.batch_shape, p.b_batch_strides, sb) && collapses(p.batch_shape, p.c_batch_strides, sc)) {
    check_blas(cublasGemmStridedBatchedEx(h, op_b, op_a, static_cast<int>(p.n), static_cast<int>(p.m),
                                          static_cast<int>(p.k), alpha, p.b, in_t, static_cast<int>(ldb), sb, p.a,
                                          in_t, static_cast<int>(lda), sa, beta, p.c, out_t, static_cast<int>(ldc),
                                          sc, static_cast<int>(batches), compute, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx on " + device_name(device));
    return;
  }
  auto one = [&](const void* a, const void* b, void* c) {
    check_blas(cublasGemmEx(h, op_b, op_a, static_cast<int>(p.n), static_cast<int>(p.m),
                            static_cast<int>(p.k), alpha, b, in_t, static_cast<int>(ldb), a, in_t,
                            static_cast<int>(lda), beta, c, out_t, static_cast<int>(ldc), compute,
                            CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx on " + device_name(device));
  };
  for (int64_t i = 0; i < batches; ++i) {
    int64_t ao = 0, bo = 0, co = 0, rest = i;
    for (int d = p.batch_shape.size() - 1; d >= 0; --d) {
      const int64_t idx = rest % p.batch_shape[d];
      rest /= p.batch_shape[d];
      ao += idx * p.a_batch_strides[d];
      bo += idx * p.b_batch_strides[d];
      co += idx * p.c_batch_strides[d];
    }
    one(static_cast<const char*>(p.a) + ao * in_size, static_cast<const char*>(p.b) + bo * in_size,
        static_cast<char*>(p.c) + co * out_size);
  }
}

void cuda_map(MapOp op, double alpha, void* out, DType out_dtype, const Dims& out_strides,
              const Dims& shape, const MapOperand& in0, const MapOperand* in1, int device) {
  const int64_t n = shape.product();
  if (n == 0) return;
  DeviceGuard guard(device);
  const auto space =
      coalesce<3>(shape, {out_strides, in0.strides, in1 != nullptr ? in1->strides : in0.strides});
  Layout<3> l = make_layout<3>(space.shape, space.strides);
  MapArgs a{out,
            out_dtype,
            in0.data,
            in0.dtype,
            in1 != nullptr ? in1->data : nullptr,
            in1 != nullptr ? in1->dtype : in0.dtype};
  const bool f64 = in0.dtype == DType::kF64 || (in1 != nullptr && in1->dtype == DType::kF64);
  if (f64) {
    map_kernel<double><<<blocks_for(n), kThreads, 0, stream_of(device)>>>(op, alpha, a, l, n);
  } else {
    map_kernel<float><<<blocks_for(n), kThreads, 0, stream_of(device)>>>(op, static_cast<float>(alpha), a, l, n);
  }
  check_launch("map_kernel", device);
}

void cuda_reduce(const ReducePlan& p, int device) {
  const int64_t outputs = p.kept_shape.product();
  if (outputs == 0) return;
  DeviceGuard guard(device);
  ReduceArgs a{p.x,         p.x_dtype, p.out,
               p.out_dtype, p.scale,   p.accumulate,
               p.square,    outputs,   p.reduced_shape.product()};
  const Layout<2> kept = make_layout<2>(p.kept_shape, {p.kept_x_strides, p.out_strides});
  const Layout<1> reduced = make_layout<1>(p.reduced_shape, {p.reduced_x_strides});
  reduce_kernel<<<grid_for_rows(outputs), kThreads, 0, stream_of(device)>>>(a, kept, reduced);
  check_launch("reduce_kernel", device);
}

void cuda_max_dim(const DimPlan& p, int device) {
  const int64_t outputs = p.outer_shape.product();
  if (outputs == 0) return;
  DeviceGuard guard(device);
  DimArgs a{};
  a.outputs = outputs, a.len = p.len, a.x = p.x, a.x_dtype = p.x_dtype,
  a.x_dim_stride = p.x_dim_stride;
  a.values = p.values, a.indices = p.indices;
  max_dim_kernel<<<blocks_for(outputs), kThreads, 0, stream_of(device)>>>(
      a, make_layout<1>(p.outer_shape, {p.x_outer_strides}));
  check_launch("max_dim_kernel", device);
}

void cuda_scatter_dim(const DimPlan& p, int device) {
  const int64_t outputs = p.outer_shape.product();
  if (outputs == 0) return;
  DeviceGuard guard(device);
  DimArgs a{};
  a.outputs = outputs, a.len = p.len;
  a.dx = p.dx, a.dx_dtype = p.dx_dtype, a.dx_dim_stride = p.dx_dim_stride;
  a.dy = p.dy, a.dy_dtype = p.dy_dtype, a.index = p.index;
  scatter_dim_kernel<<<blocks_for(outputs), kThreads, 0, stream_of(device)>>>(
      a, make_layout<3>(p.outer_shape,
                        {p.dx_outer_strides, p.dy_outer_strides, p.index_outer_strides}));
  check_launch("scatter_dim_kernel", device);
}

void cuda_softmax(const SoftmaxPlan& p, int device) {
  const int64_t rows = p.outer_shape.product();
  if (rows == 0 || p.len == 0) return;
  DeviceGuard guard(device);
  SoftmaxArgs a{};
  a.rows = rows, a.len = p.len, a.causal_period = p.causal_period;
  a.log = p.log, a.backward = p.backward, a.from_lse = p.from_lse;
  a.x = row_ref(p.x), a.out = row_ref(p.out);
  if (p.backward) a.dy = row_ref(p.dy);
  if (p.lse.defined()) a.lse = row_ref(p.lse);
  if (p.x.dtype == DType::kF64) {
    softmax_kernel<double><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
  } else {
    softmax_kernel<float><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
  }
  check_launch("softmax_kernel", device);
}

namespace {
NormArgs norm_args(const NormPlan& p) {
  NormArgs a{};
  a.rows = p.outer_shape.product(), a.len = p.len, a.rms = p.rms, a.accumulate = p.accumulate;
  a.eps = p.eps;
  a.x = row_ref(p.x), a.y = row_ref(p.y), a.dy = row_ref(p.dy), a.dx = row_ref(p.dx);
  a.mean = row_ref(p.mean), a.rstd = row_ref(p.rstd);
  a.w = p.weight.data, a.w_dtype = p.weight.dtype, a.w_stride = p.weight.stride;
  a.b = p.bias.data, a.b_dtype = p.bias.dtype, a.b_stride = p.bias.stride;
  a.dw = p.dweight.data, a.dw_dtype = p.dweight.dtype, a.dw_stride = p.dweight.stride;
  a.db = p.dbias.data, a.db_dtype = p.dbias.dtype, a.db_stride = p.dbias.stride;
  return a;
}
}  // namespace

void cuda_norm_forward(const NormPlan& p, int device) {
  const int64_t rows = p.outer_shape.product();
  if (rows == 0) return;
  DeviceGuard guard(device);
  const NormArgs a = norm_args(p);
  if (p.x.dtype == DType::kF64) {
    norm_forward_kernel<double><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
  } else {
    norm_forward_kernel<float><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
  }
  check_launch("norm_forward_kernel", device);
}

void cuda_norm_backward(const NormPlan& p, int device) {
  const int64_t rows = p.outer_shape.product();
  if (rows == 0 || p.len == 0) return;
  DeviceGuard guard(device);
  const NormArgs a = norm_args(p);
  const bool f64 = p.x.dtype == DType::kF64;
  if (p.dx.defined()) {
    if (f64) {
      norm_backward_dx_kernel<double><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
    } else {
      norm_backward_dx_kernel<float><<<grid_for_rows(rows), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
    }
    check_launch("norm_backward_dx_kernel", device);
  }
  if (p.dweight.defined() || p.dbias.defined()) {
    if (f64) {
      norm_backward_params_kernel<double>
          <<<blocks_for(p.len), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
    } else {
      norm_backward_params_kernel<float>
          <<<blocks_for(p.len), kThreads, 0, stream_of(device)>>>(a, rows_of(p.outer_shape));
    }
    check_launch("norm_backward_params_kernel", device);
  }
}

void cuda_cross_entropy(const CrossEntropyPlan& p, int device) {
  if (p.n == 0) return;
  DeviceGuard guard(device);
  CeArgs a{};
  a.mode = p.mode, a.n = p.n, a.len = p.len, a.vocab_start = p.vocab_start;
  a.ignore_index = p.ignore_index;
  a.logits = row_ref(p.logits), a.dlogits = row_ref(p.dlogits);
  a.targets = p.targets, a.targets_dtype = p.targets_dtype, a.targets_stride = p.targets_stride;
  a.row_losses = p.row_losses, a.grad_scale = p.grad_scale;
  a.stat_max = p.stat_max, a.stat_sum_exp = p.stat_sum_exp, a.stat_target = p.stat_target;
  a.global_max = p.global_max, a.global_sum_exp = p.global_sum_exp;
  const Rows shape = rows_of(Dims{p.n});
  if (p.logits.dtype == DType::kF64) {
    cross_entropy_kernel<double><<<grid_for_rows(p.n), kThreads, 0, stream_of(device)>>>(a, shape);
  } else {
    cross_entropy_kernel<float><<<grid_for_rows(p.n), kThreads, 0, stream_of(device)>>>(a, shape);
  }
  check_launch("cross_entropy_kernel", device);
}

void cuda_rescale_sum_exp(void* sum_exp, int64_t sum_exp_stride, const void* local_max,
                          int64_t local_max_stride, const void* global_max,
                          int64_t global_max_stride, DType dtype, int64_t n, int device) {
  if (n == 0) return;
  DeviceGuard guard(device);
  rescale_kernel<<<blocks_for(n), kThreads, 0, stream_of(device)>>>(sum_exp, sum_exp_stride, local_max, local_max_stride,
                                              global_max, global_max_stride, dtype, n);
  check_launch("rescale_kernel", device);
}

namespace {
EmbArgs emb_args(const EmbeddingPlan& p) {
  EmbArgs a{};
  a.positions = p.ids_shape.product(), a.dim = p.dim, a.row_start = p.row_start, a.rows = p.rows;
  a.has_padding = p.has_padding, a.padding_idx = p.padding_idx;
  a.ids = p.ids, a.ids_dtype = p.ids_dtype;
  a.table = row_ref(p.table), a.out = row_ref(p.out), a.dy = row_ref(p.dy);
  a.dw = p.dw, a.dw_dtype = p.dw_dtype;
  return a;
}
}  // namespace

void cuda_embedding_forward(const EmbeddingPlan& p, int device) {
  const int64_t n = p.ids_shape.product() * p.dim;
  if (n == 0) return;
  DeviceGuard guard(device);
  embedding_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(device)>>>(
      emb_args(p), make_layout<1>(p.ids_shape, {p.ids_strides}), rows_of(p.ids_shape));
  check_launch("embedding_forward_kernel", device);
}

void cuda_embedding_backward(const EmbeddingPlan& p, int device) {
  if (p.dim == 0 || p.ids_shape.product() == 0 || p.rows == 0) return;
  DeviceGuard guard(device);
  const auto ids = make_layout<1>(p.ids_shape, {p.ids_strides});
  if (p.dw_dtype == DType::kF64) {
    embedding_backward_kernel<double>
        <<<blocks_for(p.dim), kThreads, 0, stream_of(device)>>>(emb_args(p), ids, rows_of(p.ids_shape));
  } else {
    embedding_backward_kernel<float>
        <<<blocks_for(p.dim), kThreads, 0, stream_of(device)>>>(emb_args(p), ids, rows_of(p.ids_shape));
  }
  check_launch("embedding_backward_kernel", device);
}

void cuda_optimizer_step(const OptimPlan& p, int device) {
  if (p.shape.product() == 0) return;
  DeviceGuard guard(device);
  if (p.dtype == DType::kF64) {
    launch_optim<double>(p, device);
  } else {
    launch_optim<float>(p, device);
  }
}

}  // namespace kernels::detail
