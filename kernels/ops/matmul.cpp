#include "kernels/ops/matmul.h"

#include <fmt/format.h>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/gemm_plan.h"
#include "kernels/detail/layout.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"
#include "kernels/ops/elementwise.h"

namespace kernels {
namespace {

using detail::GemmPlan;

// The GEMM strides of a [rows, cols] matrix with strides (rs, cs): size-1 dims take the stride
// that makes the other one the inner dim. False when neither stride is 1 (a copy is needed).
bool gemm_strides(int64_t rows, int64_t cols, int64_t& rs, int64_t& cs) {
  if (cols == 1) cs = 1;
  if (rows == 1 && cs != 1) rs = 1;
  return rs == 1 || cs == 1;
}

// cuBLAS also needs the leading dimension to cover a stored column (Eigen reads any stride, so
// the CPU takes broadcast rows with stride 0 as they are).
bool blas_leading_dim_ok(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs == 1) return rows == 1 || rs >= cols;
  return cols == 1 || cs >= rows;
}

// Strides of t's batch dims (all but the last two) aligned to batch_shape, 0 where t is
// broadcast (missing or size-1 dims).
Dims batch_strides(const Tensor& t, const Dims& batch_shape) {
  const int nb = batch_shape.size();
  const int tb = t.ndim() - 2;
  Dims out = Dims::filled(nb, 0);
  for (int d = 0; d < tb; ++d) {
    const int o = nb - tb + d;
    out[o] = t.size(d) == 1 ? 0 : t.stride(d);
  }
  return out;
}

Dims batch_dims(const Tensor& t) {
  Dims d = t.shape();
  d.pop_back();
  d.pop_back();
  return d;
}

// When b is the same matrix for every batch entry and a's and c's batch dims are contiguous
// continuations of their rows, the whole batch is one product of batch * m rows.
void fold_batch_into_rows(GemmPlan& p) {
  if (p.batch_shape.empty() || p.a_cs != 1 || p.c_cs != 1) return;
  for (int64_t s : p.b_batch_strides) {
    if (s != 0) return;
  }
  Dims shape = p.batch_shape;
  Dims a_strides = p.a_batch_strides, c_strides = p.c_batch_strides;
  shape.push_back(p.m);
  a_strides.push_back(p.a_rs);
  c_strides.push_back(p.c_rs);
  if (shape.product() == 0) return;
  const auto space = detail::coalesce<2>(shape, {a_strides, c_strides});
  if (space.shape.size() != 1) return;
  p.m = space.shape[0];
  p.a_rs = space.strides[0][0];
  p.c_rs = space.strides[1][0];
  p.batch_shape = {};
  p.a_batch_strides = {};
  p.b_batch_strides = {};
  p.c_batch_strides = {};
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, const MatmulOptions& options) {
  detail::check_floating("matmul", a, "a");
  detail::check_floating("matmul", b, "b");
  if (options.beta != 0.0) {
    throw InvalidArgument(fmt::format(
        "matmul: beta is {} but the functional form has no output to accumulate into (use "
        "matmul_out)",
        options.beta));
  }
  if (a.ndim() < 2 || b.ndim() < 2) {
    throw InvalidArgument(
        fmt::format("matmul: operands need at least 2 dims, got a {} and b {} (unsqueeze a vector)",
                    a.shape(), b.shape()));
  }
  Dims shape = broadcast_shapes(batch_dims(a), batch_dims(b));
  shape.push_back(a.size(-2));
  shape.push_back(b.size(-1));
  Tensor out = Tensor::empty(shape, a.dtype(), a.device());
  matmul_out(out, a, b, options);
  return out;
}

void matmul_out(const Tensor& out, const Tensor& a_in, const Tensor& b_in,
                const MatmulOptions& options) {
  constexpr const char* kOp = "matmul_out";
  detail::check_floating(kOp, a_in, "a");
  detail::check_floating(kOp, b_in, "b");
  detail::check_floating(kOp, out, "out");
  detail::check_same_dtype(kOp, {{"a", a_in}, {"b", b_in}});
  detail::check_same_device(kOp, {{"a", a_in}, {"b", b_in}, {"out", out}});
  if (a_in.ndim() < 2 || b_in.ndim() < 2) {
    throw InvalidArgument(
        fmt::format("{}: operands need at least 2 dims, got a {} and b {} (unsqueeze a vector)",
                    kOp, a_in.shape(), b_in.shape()));
  }
  const int64_t m = a_in.size(-2), k = a_in.size(-1), n = b_in.size(-1);
  if (b_in.size(-2) != k) {
    throw InvalidArgument(
        fmt::format("{}: a {} @ b {}: a has {} columns but b has {} rows (expected equal)", kOp,
                    a_in.shape(), b_in.shape(), k, b_in.size(-2)));
  }
  const Dims batch = broadcast_shapes(batch_dims(a_in), batch_dims(b_in));
  Dims out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  detail::check_shape(kOp, out, "out", out_shape);
  const DType dt = a_in.dtype();
  const bool narrow = dt == DType::kBF16 || dt == DType::kF16;
  if (out.dtype() != dt && !(narrow && out.dtype() == DType::kF32)) {
    throw InvalidArgument(fmt::format("{}: out has dtype {}, expected {}{}", kOp, out.dtype(), dt,
                                      narrow ? " or f32" : ""));
  }
  detail::check_writable(kOp, out, "out");
  if (detail::may_overlap(out, a_in) || detail::may_overlap(out, b_in)) {
    throw InvalidArgument(
        fmt::format("{}: out overlaps an operand (expected separate storage)", kOp));
  }
  if (options.num_threads < 1) {
    throw InvalidArgument(
        fmt::format("{}: num_threads is {}, expected 1 or more", kOp, options.num_threads));
  }
  if (out.numel() == 0) return;
  if (k == 0) {  // an empty sum: out = beta * out
    if (options.beta == 0.0) {
      Tensor(out).fill_(0.0);
    } else if (options.beta != 1.0) {
      scale_out(out, out, options.beta);
    }
    return;
  }

  // Operands whose matrices have no unit stride are copied once (NOTE in matmul.h).
  const bool cuda = out.device().is_cuda();
  Tensor a = a_in, b = b_in;
  int64_t a_rs = a.stride(-2), a_cs = a.stride(-1);
  if (!gemm_strides(m, k, a_rs, a_cs) || (cuda && !blas_leading_dim_ok(m, k, a_rs, a_cs))) {
    a = a.contiguous();
    a_rs = k, a_cs = 1;
  }
  int64_t b_rs = b.stride(-2), b_cs = b.stride(-1);
  if (!gemm_strides(k, n, b_rs, b_cs) || (cuda && !blas_leading_dim_ok(k, n, b_rs, b_cs))) {
    b = b.contiguous();
    b_rs = n, b_cs = 1;
  }
  Tensor c = out;
  int64_t c_rs = c.stride(-2), c_cs = c.stride(-1);
  const bool c_direct =
      gemm_strides(m, n, c_rs, c_cs) && (!cuda || blas_leading_dim_ok(m, n, c_rs, c_cs));
  if (!c_direct) {
    c = options.beta != 0.0 ? out.clone() : Tensor::empty(out.shape(), out.dtype(), out.device());
    c_rs = n, c_cs = 1;
  }

  GemmPlan p;
  p.dtype = dt;
  p.out_dtype = out.dtype();
  p.m = m, p.n = n, p.k = k;
  p.alpha = options.alpha, p.beta = options.beta;
  p.a = a.data_ptr(), p.a_rs = a_rs, p.a_cs = a_cs;
  p.b = b.data_ptr(), p.b_rs = b_rs, p.b_cs = b_cs;
  p.c = c.data_ptr(), p.c_rs = c_rs, p.c_cs = c_cs;
  p.batch_shape = batch;
  p.a_batch_strides = batch_strides(a, batch);
  p.b_batch_strides = batch_strides(b, batch);
  p.c_batch_strides = batch_strides(c, batch);
  fold_batch_into_rows(p);

  if (cuda) {
    detail::cuda_gemm(p, out.device().index);
  } else {
    detail::cpu_gemm(p, options.num_threads);
  }
  if (!c_direct) Tensor(out).copy_(c);
}

}  // namespace kernels
