// CPU batched GEMM: Eigen products on strided maps (kernels/cpu/vec.h picks the ISA variant).
// bf16 / f16 operands are widened exactly to f32 blocks first (their products accumulate in f32)
// and the f32 result rounds once into a narrow output.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

int64_t batch_offset(int64_t linear, const Dims& shape, const Dims& strides) {
  int64_t off = 0;
  for (int d = shape.size() - 1; d >= 0; --d) {
    off += (linear % shape[d]) * strides[d];
    linear /= shape[d];
  }
  return off;
}

// dst (contiguous row-major rows x cols, f32) = widened src (strided rows x cols of dtype).
void widen_block(float* dst, const void* src, DType dtype, int64_t rows, int64_t cols, int64_t rs,
                 int64_t cs) {
  if (dtype == DType::kBF16 && cs == 1) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < rows; ++i)
      vec_ops<float>().widen_bf16(dst + i * cols, s + i * rs, cols);
    return;
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using S = decltype(tag);
    if constexpr (std::is_same_v<compute_t<S>, float>) {
      const S* s = static_cast<const S*>(src);
      for (int64_t i = 0; i < rows; ++i) {
        float* d = dst + i * cols;
        const S* r = s + i * rs;
        if (cs == 1) {
          for (int64_t j = 0; j < cols; ++j) d[j] = cast_value<float>(r[j]);
        } else {
          for (int64_t j = 0; j < cols; ++j) d[j] = cast_value<float>(r[j * cs]);
        }
      }
    } else {
      throw InternalError("widen_block: unexpected dtype");
    }
  });
}

// dst (strided rows x cols of dtype) = rounded src (contiguous row-major, f32).
void narrow_block(void* dst, DType dtype, int64_t rs, int64_t cs, const float* src, int64_t rows,
                  int64_t cols) {
  if (dtype == DType::kBF16 && cs == 1) {
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < rows; ++i)
      vec_ops<float>().narrow_bf16(d + i * rs, src + i * cols, cols);
    return;
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using D = decltype(tag);
    if constexpr (std::is_same_v<compute_t<D>, float> || std::is_same_v<D, double>) {
      D* d = static_cast<D*>(dst);
      for (int64_t i = 0; i < rows; ++i) {
        const float* s = src + i * cols;
        D* r = d + i * rs;
        for (int64_t j = 0; j < cols; ++j) r[j * cs] = cast_value<D>(s[j]);
      }
    } else {
      throw InternalError("narrow_block: unexpected dtype");
    }
  });
}

// One product on one thread, in the compute type T of the operands' dtype. C may be column-major
// (transposed problem) or row-major.
template <class T>
void gemm_one(const VecOps<T>& ops, int64_t m, int64_t n, int64_t k, T alpha, T beta, const T* a,
              int64_t a_rs, int64_t a_cs, const T* b, int64_t b_rs, int64_t b_cs, T* c,
              int64_t c_rs, int64_t c_cs) {
  GemmArgs<T> g;
  g.k = k;
  g.alpha = alpha;
  g.beta = beta;
  if (c_cs == 1) {
    g.m = m, g.n = n;
    g.a = a, g.a_rs = a_rs, g.a_cs = a_cs;
    g.b = b, g.b_rs = b_rs, g.b_cs = b_cs;
    g.c = c, g.c_rs = c_rs;
  } else {
    // C column-major: C^T [n, m] is row-major with row stride c_cs, and C^T = B^T A^T.
    g.m = n, g.n = m;
    g.a = b, g.a_rs = b_cs, g.a_cs = b_rs;
    g.b = a, g.b_rs = a_cs, g.b_cs = a_rs;
    g.c = c, g.c_rs = c_cs;
  }
  ops.gemm(g);
}

// The native bf16 product (AVX512-BF16) into an f32 C that may be column-major.
void gemm_bf16_one(GemmBf16Fn fn, int64_t m, int64_t n, int64_t k, float alpha, float beta,
                   const uint16_t* a, int64_t a_rs, int64_t a_cs, const uint16_t* b, int64_t b_rs,
                   int64_t b_cs, float* c, int64_t c_rs, int64_t c_cs) {
  GemmBf16Args g;
  g.k = k, g.alpha = alpha, g.beta = beta;
  if (c_cs == 1) {
    g.m = m, g.n = n;
    g.a = a, g.a_rs = a_rs, g.a_cs = a_cs;
    g.b = b, g.b_rs = b_rs, g.b_cs = b_cs;
    g.c = c, g.c_rs = c_rs;
  } else {  // C^T = B^T A^T, as gemm_one
    g.m = n, g.n = m;
    g.a = b, g.a_rs = b_cs, g.a_cs = b_rs;
    g.b = a, g.b_rs = a_cs, g.b_cs = a_rs;
    g.c = c, g.c_rs = c_cs;
  }
  fn(g);
}

// A task: one batch entry, rows [m0, m1) and columns [n0, n1) of it.
struct Task {
  int64_t batch;
  int64_t m0, m1, n0, n1;
};

// Splits the batch x rows x columns space into tasks for `threads` threads: whole products
// when there are enough of them, else row blocks (or column blocks for short, wide products).
std::vector<Task> make_tasks(const GemmPlan& p, int64_t batches, int threads) {
  std::vector<Task> tasks;
  const double flops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) *
                       static_cast<double>(p.k) * static_cast<double>(batches);
  // Starting a thread costs tens of microseconds: split only products worth several of those.
  if (threads <= 1 || flops < 8e6 || batches >= threads) {
    tasks.reserve(static_cast<size_t>(batches));
    for (int64_t i = 0; i < batches; ++i) tasks.push_back({i, 0, p.m, 0, p.n});
    return tasks;
  }
  const bool split_rows = p.m >= p.n || p.m >= 64 * threads;
  const int64_t extent = split_rows ? p.m : p.n;
  // Blocks of whole multiples of 8 so every part keeps the GEMM kernel's register tiling.
  const int64_t parts = std::min<int64_t>(threads, std::max<int64_t>(1, extent / 8));
  const int64_t block = (extent + parts - 1) / parts;
  for (int64_t i = 0; i < batches; ++i) {
    for (int64_t s = 0; s < extent; s += block) {
      const int64_t e = std::min(extent, s + block);
      tasks.push_back(split_rows ? Task{i, s, e, 0, p.n} : Task{i, 0, p.m, s, e});
    }
  }
  return tasks;
}

template <class T>
void run_direct(const GemmPlan& p, const std::vector<Task>& tasks, int threads) {
  const VecOps<T>& ops = vec_ops<T>();
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* c = static_cast<T*>(p.c);
  parallel_tasks(threads, static_cast<int64_t>(tasks.size()), [&](int64_t t, int64_t) {
    const Task& task = tasks[static_cast<size_t>(t)];
    const T* ai = a + batch_offset(task.batch, p.batch_shape, p.a_batch_strides) + task.m0 * p.a_rs;
    const T* bi = b + batch_offset(task.batch, p.batch_shape, p.b_batch_strides) + task.n0 * p.b_cs;
    T* ci = c + batch_offset(task.batch, p.batch_shape, p.c_batch_strides) + task.m0 * p.c_rs +
            task.n0 * p.c_cs;
    gemm_one<T>(ops, task.m1 - task.m0, task.n1 - task.n0, p.k, static_cast<T>(p.alpha),
                static_cast<T>(p.beta), ai, p.a_rs, p.a_cs, bi, p.b_rs, p.b_cs, ci, p.c_rs, p.c_cs);
  });
}

// bf16 / f16 inputs (and any output dtype): f32 blocks per task.
void run_widened(const GemmPlan& p, const std::vector<Task>& tasks, int threads,
                 bool use_native_bf16) {
  const VecOps<float>& ops = vec_ops<float>();
  const size_t in_size = itemsize(p.dtype);
  const size_t out_size = itemsize(p.out_dtype);
  const auto* a = static_cast<const char*>(p.a);
  const auto* b = static_cast<const char*>(p.b);
  auto* c = static_cast<char*>(p.c);
  const int64_t workers =
      std::min<int64_t>(std::max(threads, 1), static_cast<int64_t>(tasks.size()));
  // Per worker: widened A, B and an f32 C; B is reused while consecutive tasks share it (a
  // weight broadcast over the batch).
  struct Scratch {
    std::vector<float> a, b, c;
    const char* b_src = nullptr;
    int64_t b_n0 = -1, b_n1 = -1;
  };
  std::vector<Scratch> scratch(static_cast<size_t>(std::max<int64_t>(workers, 1)));
  const GemmBf16Fn native = p.dtype == DType::kBF16 && use_native_bf16 ? ops.gemm_bf16 : nullptr;
  parallel_tasks(threads, static_cast<int64_t>(tasks.size()), [&](int64_t t, int64_t worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const Task& task = tasks[static_cast<size_t>(t)];
    const int64_t rows = task.m1 - task.m0, cols = task.n1 - task.n0;
    if (native) {  // bf16 operands straight from their strided storage
      const auto* ai = reinterpret_cast<const uint16_t*>(
          a + (batch_offset(task.batch, p.batch_shape, p.a_batch_strides) + task.m0 * p.a_rs) * 2);
      const auto* bi = reinterpret_cast<const uint16_t*>(
          b + (batch_offset(task.batch, p.batch_shape, p.b_batch_strides) + task.n0 * p.b_cs) * 2);
      char* ci = c + (batch_offset(task.batch, p.batch_shape, p.c_batch_strides) +
                      task.m0 * p.c_rs + task.n0 * p.c_cs) *
                         static_cast<int64_t>(out_size);
      const auto alpha = static_cast<float>(p.alpha), beta = static_cast<float>(p.beta);
      if (p.out_dtype == DType::kF32) {
        gemm_bf16_one(native, rows, cols, p.k, alpha, beta, ai, p.a_rs, p.a_cs, bi, p.b_rs, p.b_cs,
                      reinterpret_cast<float*>(ci), p.c_rs, p.c_cs);
        return;
      }
      s.c.resize(static_cast<size_t>(rows * cols));
      if (beta != 0.0f) widen_block(s.c.data(), ci, p.out_dtype, rows, cols, p.c_rs, p.c_cs);
      gemm_bf16_one(native, rows, cols, p.k, alpha, beta, ai, p.a_rs, p.a_cs, bi, p.b_rs, p.b_cs,
                    s.c.data(), cols, 1);
      narrow_block(ci, p.out_dtype, p.c_rs, p.c_cs, s.c.data(), rows, cols);
      return;
    }
    const char* ai =
        a + (batch_offset(task.batch, p.batch_shape, p.a_batch_strides) + task.m0 * p.a_rs) *
                static_cast<int64_t>(in_size);
    const char* bi =
        b + (batch_offset(task.batch, p.batch_shape, p.b_batch_strides) + task.n0 * p.b_cs) *
                static_cast<int64_t>(in_size);
    char* ci = c + (batch_offset(task.batch, p.batch_shape, p.c_batch_strides) + task.m0 * p.c_rs +
                    task.n0 * p.c_cs) *
                       static_cast<int64_t>(out_size);
    s.a.resize(static_cast<size_t>(rows * p.k));
    widen_block(s.a.data(), ai, p.dtype, rows, p.k, p.a_rs, p.a_cs);
    if (bi != s.b_src || task.n0 != s.b_n0 || task.n1 != s.b_n1) {
      s.b.resize(static_cast<size_t>(p.k * cols));
      widen_block(s.b.data(), bi, p.dtype, p.k, cols, p.b_rs, p.b_cs);
      s.b_src = bi, s.b_n0 = task.n0, s.b_n1 = task.n1;
    }
    const auto alpha = static_cast<float>(p.alpha);
    const auto beta = static_cast<float>(p.beta);
    if (p.out_dtype == DType::kF32) {
      gemm_one<float>(ops, rows, cols, p.k, alpha, beta, s.a.data(), p.k, 1, s.b.data(), cols, 1,
                      reinterpret_cast<float*>(ci), p.c_rs, p.c_cs);
      return;
    }
    s.c.resize(static_cast<size_t>(rows * cols));
    if (beta != 0.0f) widen_block(s.c.data(), ci, p.out_dtype, rows, cols, p.c_rs, p.c_cs);
    gemm_one<float>(ops, rows, cols, p.k, alpha, beta, s.a.data(), p.k, 1, s.b.data(), cols, 1,
                    s.c.data(), cols, 1);
    narrow_block(ci, p.out_dtype, p.c_rs, p.c_cs, s.c.data(), rows, cols);
  });
}

}  // namespace

void cpu_gemm(const GemmPlan& p, int num_threads) {
  const int64_t batches = p.batch_shape.product();
  if (batches == 0 || p.m == 0 || p.n == 0) return;
  const std::vector<Task> tasks = make_tasks(p, batches, num_threads);
  if (p.dtype == DType::kF32 && p.out_dtype == DType::kF32) {
    run_direct<float>(p, tasks, num_threads);
  } else if (p.dtype == DType::kF64 && p.out_dtype == DType::kF64) {
    run_direct<double>(p, tasks, num_threads);
  } else if (p.dtype == DType::kBF16 || p.dtype == DType::kF16) {
    run_widened(p, tasks, num_threads, true);
  } else {
    throw InternalError("cpu_gemm: unexpected dtypes");
  }
}

}  // namespace kernels::detail
