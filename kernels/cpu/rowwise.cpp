// CPU row-wise kernels: softmax / log-softmax, RMSNorm / LayerNorm and cross-entropy. Each row
// is brought into a contiguous array of the compute type (f32, or f64 for f64 data) when it is
// not one already, processed by the VecOps primitives, and written back rounded once.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cpu/copy.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vec.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

template <class C>
bool is_direct(const RowTensor& t) {
  return t.dtype == dtype_of_v<C> && t.stride == 1;
}

// Row o of t as a contiguous C array: the data itself, or a converted copy in buf.
template <class C>
const C* read_row(const RowTensor& t, int64_t offset, int64_t len, std::vector<C>& buf) {
  if (is_direct<C>(t)) return static_cast<const C*>(at(t.data, t.dtype, offset));
  buf.resize(static_cast<size_t>(len));
  load_row<C>(buf.data(), at(t.data, t.dtype, offset), t.dtype, t.stride, len);
  return buf.data();
}

// Where to compute row o of an output: the data itself, or buf (then write_row stores it).
template <class C>
C* out_row(const RowTensor& t, int64_t offset, int64_t len, std::vector<C>& buf) {
  if (is_direct<C>(t)) return static_cast<C*>(at(t.data, t.dtype, offset));
  buf.resize(static_cast<size_t>(len));
  return buf.data();
}

template <class C>
void write_row(const RowTensor& t, int64_t offset, const C* row, int64_t len) {
  if (is_direct<C>(t)) return;  // computed in place
  store_row<C>(at(t.data, t.dtype, offset), t.dtype, t.stride, row, len);
}

template <class C>
C load_one(const void* base, DType dtype, int64_t offset) {
  C v;
  load_row<C>(&v, at(base, dtype, offset), dtype, 1, 1);
  return v;
}

template <class C>
void store_one(void* base, DType dtype, int64_t offset, C v) {
  store_row<C>(at(base, dtype, offset), dtype, 1, &v, 1);
}

// A [len] column vector widened to C (weights); empty when absent.
template <class C>
std::vector<C> read_col(const ColTensor& c, int64_t len) {
  std::vector<C> v;
  if (!c.defined()) return v;
  v.resize(static_cast<size_t>(len));
  load_row<C>(v.data(), c.data, c.dtype, c.stride, len);
  return v;
}

// When every operand's rows are evenly spaced (the outer dims collapse to one stride, true for
// any contiguous [..., D] tensor) and already contiguous arrays of C, the batched VecOps row
// kernels take the whole tensor in one call; rs receives each operand's row stride.
template <class C, int N>
bool uniform_rows(const Dims& outer_shape, const std::array<const RowTensor*, N>& ts,
                  std::array<int64_t, N>& rs) {
  std::array<Dims, N> strides;
  for (int k = 0; k < N; ++k) {
    const RowTensor* t = ts[k] != nullptr && ts[k]->defined() ? ts[k] : ts[0];
    if (!is_direct<C>(*t)) return false;
    strides[k] = t->outer_strides;
  }
  const auto space = coalesce<N>(outer_shape, strides);
  if (space.shape.size() != 1) return false;
  for (int k = 0; k < N; ++k) rs[k] = space.strides[k][0];
  return true;
}

// Statistics (one value per row) as contiguous-strided arrays of C: dtype C required.
template <class C>
bool direct_stat(const RowValues& t) {
  return !t.defined() || t.dtype == dtype_of_v<C>;
}

// ---- softmax ----

template <class C>
void softmax_impl(const SoftmaxPlan& p) {
  const VecOps<C>& v = vec_ops<C>();
  const int64_t rows = p.outer_shape.product();
  const int64_t len = p.len;
  {
    // Batched: x, dy, out, lse (a statistic: dtype C, its own row stride).
    RowTensor lse_rows = p.lse;
    lse_rows.stride = 1;
    std::array<int64_t, 4> rs{};
    const bool stats_ok = !p.lse.defined() || p.lse.dtype == dtype_of_v<C>;
    if (stats_ok && uniform_rows<C, 4>(p.outer_shape,
                                       {&p.x, p.backward ? &p.dy : nullptr, &p.out,
                                        p.lse.defined() ? &lse_rows : nullptr},
                                       rs)) {
      RowsArgs<C> a;
      a.rows = rows, a.len = len;
      a.x = static_cast<const C*>(p.x.data), a.x_rs = rs[0];
      if (p.backward) a.dy = static_cast<const C*>(p.dy.data), a.dy_rs = rs[1];
      a.out = static_cast<C*>(p.out.data), a.out_rs = rs[2];
      if (p.lse.defined()) a.lse = static_cast<C*>(p.lse.data), a.stat_rs = rs[3];
      a.log = p.log;
      a.causal_period = p.causal_period;
      a.from_lse = p.from_lse;
      if (p.backward) {
        v.softmax_backward_rows(a);
      } else {
        v.softmax_rows(a);
      }
      return;
    }
  }
  std::vector<C> bx, bdy, bo, tmp(static_cast<size_t>(len));
  for (int64_t o = 0; o < rows; ++o) {
    const C* x = read_row<C>(p.x, offset_of(o, p.outer_shape, p.x.outer_strides), len, bx);
    const int64_t out_off = offset_of(o, p.outer_shape, p.out.outer_strides);
    C* out = out_row<C>(p.out, out_off, len, bo);
    if (p.causal_period > 0 || p.from_lse || p.lse.defined()) {
      // Attention rows: the first `valid` columns are visible.
      const int64_t valid =
          p.causal_period > 0 ? std::min<int64_t>(len, o % p.causal_period + 1) : len;
      std::fill(out + valid, out + len, C(0));
      if (p.from_lse) {
        const C lse =
            load_one<C>(p.lse.data, p.lse.dtype, offset_of(o, p.outer_shape, p.lse.outer_strides));
        if (lse == -std::numeric_limits<C>::infinity()) {
          std::fill(out, out + valid, C(0));
        } else {
          v.exp_shift_sum(out, x, lse, valid);
        }
      } else {
        const C m = v.max(x, valid);
        const double s = v.exp_shift_sum(tmp.data(), x, m, valid);
        v.scale(out, tmp.data(), static_cast<C>(1.0 / s), valid);
        if (p.lse.defined()) {
          const double lse = valid == 0 ? -std::numeric_limits<double>::infinity()
                                        : static_cast<double>(m) + std::log(s);
          store_one<double>(p.lse.data, p.lse.dtype,
                            offset_of(o, p.outer_shape, p.lse.outer_strides), lse);
        }
      }
    } else if (!p.backward) {
      const C m = v.max(x, len);
      const double s = v.exp_shift_sum(tmp.data(), x, m, len);
      if (p.log) {
        const C shift = static_cast<C>(static_cast<double>(m) + std::log(s));
        v.add_scalar_b(out, x, shift, C(-1), len);
      } else {
        v.scale(out, tmp.data(), static_cast<C>(1.0 / s), len);
      }
    } else {
      const C* dy = read_row<C>(p.dy, offset_of(o, p.outer_shape, p.dy.outer_strides), len, bdy);
      if (p.log) {  // dx = dy - exp(y) * sum(dy)
        const double s = v.sum(dy, len);
        v.exp_shift_sum(tmp.data(), x, C(0), len);
        v.add(out, dy, tmp.data(), static_cast<C>(-s), len);
      } else {  // dx = y * (dy - sum(dy * y))
        const double d = v.dot(dy, x, len);
        v.add_scalar_b(tmp.data(), dy, static_cast<C>(d), C(-1), len);
        v.mul(out, x, tmp.data(), len);
      }
    }
    write_row<C>(p.out, out_off, out, len);
  }
}

// ---- norms ----

template <class C>
void norm_forward_impl(const NormPlan& p) {
  const VecOps<C>& v = vec_ops<C>();
  const int64_t rows = p.outer_shape.product();
  const int64_t len = p.len;
  const std::vector<C> w = read_col<C>(p.weight, len);
  const std::vector<C> b = read_col<C>(p.bias, len);
  {
    RowTensor mean = p.mean, rstd = p.rstd;
    mean.stride = rstd.stride = 1;
    std::array<int64_t, 4> rs{};
    if (len > 0 && direct_stat<C>(p.mean) && direct_stat<C>(p.rstd) &&
        uniform_rows<C, 4>(p.outer_shape, {&p.x, &p.y, &rstd, p.rms ? nullptr : &mean}, rs) &&
        (p.rms || rs[2] == rs[3])) {
      RowsArgs<C> a;
      a.rows = rows, a.len = len;
      a.x = static_cast<const C*>(p.x.data), a.x_rs = rs[0];
      a.out = static_cast<C*>(p.y.data), a.out_rs = rs[1];
      a.rstd = static_cast<C*>(p.rstd.data), a.stat_rs = rs[2];
      if (!p.rms) a.mean = static_cast<C*>(p.mean.data);
      a.w = w.empty() ? nullptr : w.data();
      a.b = b.empty() ? nullptr : b.data();
      a.eps = p.eps;
      a.rms = p.rms;
      v.norm_forward_rows(a);
      return;
    }
  }
  std::vector<C> bx, by, tmp(static_cast<size_t>(len));
  for (int64_t o = 0; o < rows; ++o) {
    const C* x = read_row<C>(p.x, offset_of(o, p.outer_shape, p.x.outer_strides), len, bx);
    const int64_t y_off = offset_of(o, p.outer_shape, p.y.outer_strides);
    C* y = out_row<C>(p.y, y_off, len, by);
    double rstd;
    if (p.rms) {
      const double ms = len > 0 ? v.sum_squares(x, len) / static_cast<double>(len) : 0.0;
      rstd = 1.0 / std::sqrt(ms + p.eps);
      v.scale(tmp.data(), x, static_cast<C>(rstd), len);
    } else {
      const double mean = len > 0 ? v.sum(x, len) / static_cast<double>(len) : 0.0;
      v.add_scalar_b(tmp.data(), x, static_cast<C>(mean), C(-1), len);
      const double var = len > 0 ? v.sum_squares(tmp.data(), len) / static_cast<double>(len) : 0.0;
      rstd = 1.0 / std::sqrt(var + p.eps);
      v.scale(tmp.data(), tmp.data(), static_cast<C>(rstd), len);
      store_one<double>(p.mean.data, p.mean.dtype,
                        offset_of(o, p.outer_shape, p.mean.outer_strides), mean);
    }
    store_one<double>(p.rstd.data, p.rstd.dtype, offset_of(o, p.outer_shape, p.rstd.outer_strides),
                      rstd);
    if (!w.empty()) {
      v.mul(y, tmp.data(), w.data(), len);
    } else {
      std::copy(tmp.begin(), tmp.begin() + len, y);
    }
    if (!b.empty()) v.add(y, y, b.data(), C(1), len);
    write_row<C>(p.y, y_off, y, len);
  }
}

template <class C>
void norm_backward_impl(const NormPlan& p) {
  const VecOps<C>& v = vec_ops<C>();
  const int64_t rows = p.outer_shape.product();
  const int64_t len = p.len;
  const auto n = static_cast<size_t>(len);
  const std::vector<C> w = read_col<C>(p.weight, len);
  std::vector<double> dw_acc(p.dweight.defined() ? n : 0, 0.0);
  std::vector<double> db_acc(p.dbias.defined() ? n : 0, 0.0);
  std::vector<C> bx, bdy, bdx, xhat(n), g(n);
  bool batched = false;
  {
    RowTensor mean = p.mean, rstd = p.rstd;
    mean.stride = rstd.stride = 1;
    std::array<int64_t, 5> rs{};
    if (len > 0 && direct_stat<C>(p.mean) && direct_stat<C>(p.rstd) &&
        uniform_rows<C, 5>(
            p.outer_shape,
            {&p.x, &p.dy, p.dx.defined() ? &p.dx : nullptr, &rstd, p.rms ? nullptr : &mean}, rs) &&
        (p.rms || rs[3] == rs[4])) {
      RowsArgs<C> a;
      a.rows = rows, a.len = len;
      a.x = static_cast<const C*>(p.x.data), a.x_rs = rs[0];
      a.dy = static_cast<const C*>(p.dy.data), a.dy_rs = rs[1];
      if (p.dx.defined()) a.out = static_cast<C*>(p.dx.data), a.out_rs = rs[2];
      a.rstd = static_cast<C*>(p.rstd.data), a.stat_rs = rs[3];
      if (!p.rms) a.mean = static_cast<C*>(p.mean.data);
      a.w = w.empty() ? nullptr : w.data();
      a.dw = dw_acc.empty() ? nullptr : dw_acc.data();
      a.db = db_acc.empty() ? nullptr : db_acc.data();
      a.rms = p.rms;
      v.norm_backward_rows(a);
      batched = true;
    }
  }
  for (int64_t o = 0; o < (batched ? 0 : rows); ++o) {
    const C* x = read_row<C>(p.x, offset_of(o, p.outer_shape, p.x.outer_strides), len, bx);
    const C* dy = read_row<C>(p.dy, offset_of(o, p.outer_shape, p.dy.outer_strides), len, bdy);
    const C rstd =
        load_one<C>(p.rstd.data, p.rstd.dtype, offset_of(o, p.outer_shape, p.rstd.outer_strides));
    if (p.rms) {
      v.scale(xhat.data(), x, rstd, len);
    } else {
      const C mean =
          load_one<C>(p.mean.data, p.mean.dtype, offset_of(o, p.outer_shape, p.mean.outer_strides));
      v.add_scalar_b(xhat.data(), x, mean, C(-1), len);
      v.scale(xhat.data(), xhat.data(), rstd, len);
    }
    if (!dw_acc.empty()) v.accumulate_product(dw_acc.data(), dy, xhat.data(), len);
    if (!db_acc.empty()) v.accumulate(db_acc.data(), dy, len);
    if (!p.dx.defined()) continue;
    // g = dy * w;  rms: dx = rstd (g - xhat mean(g xhat));
    //              layer: dx = rstd (g - mean(g) - xhat mean(g xhat)).
    if (!w.empty()) {
      v.mul(g.data(), dy, w.data(), len);
    } else {
      std::copy(dy, dy + len, g.begin());
    }
    const double inv = len > 0 ? 1.0 / static_cast<double>(len) : 0.0;
    const C c1 = static_cast<C>(v.dot(g.data(), xhat.data(), len) * inv);
    const C c2 = p.rms ? C(0) : static_cast<C>(v.sum(g.data(), len) * inv);
    const int64_t dx_off = offset_of(o, p.outer_shape, p.dx.outer_strides);
    C* dx = out_row<C>(p.dx, dx_off, len, bdx);
    v.add(dx, g.data(), xhat.data(), -c1, len);
    if (!p.rms) v.add_scalar_b(dx, dx, c2, C(-1), len);
    v.scale(dx, dx, rstd, len);
    write_row<C>(p.dx, dx_off, dx, len);
  }
  auto finish = [&](const ColTensor& out, const std::vector<double>& acc) {
    if (!out.defined()) return;
    dispatch_dtype(out.dtype, [&](auto tag) {
      using D = decltype(tag);
      D* d = static_cast<D*>(out.data);
      for (int64_t j = 0; j < len; ++j) {
        D& dst = d[j * out.stride];
        const double r = acc[static_cast<size_t>(j)] + (p.accumulate ? to_double(dst) : 0.0);
        dst = cast_value<D>(r);
      }
    });
  };
  finish(p.dweight, dw_acc);
  finish(p.dbias, db_acc);
}

// ---- cross-entropy ----

int64_t target_at(const CrossEntropyPlan& p, int64_t i) {
  const int64_t off = i * p.targets_stride;
  return p.targets_dtype == DType::kI64 ? static_cast<const int64_t*>(p.targets)[off]
                                        : static_cast<const int32_t*>(p.targets)[off];
}

template <class C>
void cross_entropy_impl(const CrossEntropyPlan& p) {
  const VecOps<C>& v = vec_ops<C>();
  const int64_t len = p.len;
  const Dims outer{p.n};
  std::vector<C> bx, bd, tmp(static_cast<size_t>(len));
  C* losses = static_cast<C*>(p.row_losses);
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t t = target_at(p, i);
    const bool ignored = t == p.ignore_index;
    if (!ignored && (t < 0 || t >= p.vocab_size)) {
      throw InvalidArgument("cross_entropy: target " + std::to_string(t) + " at row " +
                            std::to_string(i) + " is out of range (expected 0.." +
                            std::to_string(p.vocab_size - 1) + " or ignore_index " +
                            std::to_string(p.ignore_index) + ")");
    }
    const int64_t local_t = t - p.vocab_start;
    const bool in_shard = !ignored && local_t >= 0 && local_t < len;
    const C* x = read_row<C>(p.logits, offset_of(i, outer, p.logits.outer_strides), len, bx);
    if (p.mode == CrossEntropyMode::kStats) {
      const C m = v.max(x, len);
      const double s = len > 0 ? v.exp_shift_sum(tmp.data(), x, m, len) : 0.0;
      static_cast<C*>(p.stat_max)[i] = m;
      static_cast<C*>(p.stat_sum_exp)[i] = static_cast<C>(s);
      static_cast<C*>(p.stat_target)[i] = in_shard ? x[local_t] : C(0);
      continue;
    }
    C m;
    double s;
    if (p.mode == CrossEntropyMode::kFused) {
      m = v.max(x, len);
      s = v.exp_shift_sum(tmp.data(), x, m, len);
      losses[i] =
          ignored
              ? C(0)
              : static_cast<C>(std::log(s) + static_cast<double>(m) - static_cast<double>(x[t]));
    } else {
      m = static_cast<const C*>(p.global_max)[i];
      s = static_cast<double>(static_cast<const C*>(p.global_sum_exp)[i]);
      if (!ignored) v.exp_shift_sum(tmp.data(), x, m, len);
    }
    if (!p.dlogits.defined()) continue;
    const int64_t d_off = offset_of(i, outer, p.dlogits.outer_strides);
    C* d = out_row<C>(p.dlogits, d_off, len, bd);
    if (ignored) {
      std::fill(d, d + len, C(0));
    } else {
      const double g = p.grad_scale;
      v.scale(d, tmp.data(), static_cast<C>(g / s), len);
      if (in_shard) d[local_t] = static_cast<C>(static_cast<double>(d[local_t]) - g);
    }
    write_row<C>(p.dlogits, d_off, d, len);
  }
}

}  // namespace

void cpu_softmax(const SoftmaxPlan& p) {
  if (p.outer_shape.product() == 0 || p.len == 0) return;
  if (p.x.dtype == DType::kF64) {
    softmax_impl<double>(p);
  } else {
    softmax_impl<float>(p);
  }
}

void cpu_norm_forward(const NormPlan& p) {
  if (p.outer_shape.product() == 0) return;
  if (p.x.dtype == DType::kF64) {
    norm_forward_impl<double>(p);
  } else {
    norm_forward_impl<float>(p);
  }
}

void cpu_norm_backward(const NormPlan& p) {
  if (p.x.dtype == DType::kF64) {
    norm_backward_impl<double>(p);
  } else {
    norm_backward_impl<float>(p);
  }
}

void cpu_cross_entropy(const CrossEntropyPlan& p) {
  if (p.logits.dtype == DType::kF64) {
    cross_entropy_impl<double>(p);
  } else {
    cross_entropy_impl<float>(p);
  }
}

}  // namespace kernels::detail

// ---- embedding ----

namespace kernels::detail {
namespace {

int64_t id_at(const EmbeddingPlan& p, int64_t pos) {
  const int64_t off = offset_of(pos, p.ids_shape, p.ids_strides);
  return p.ids_dtype == DType::kI64 ? static_cast<const int64_t*>(p.ids)[off]
                                    : static_cast<const int32_t*>(p.ids)[off];
}

void check_id(const EmbeddingPlan& p, int64_t pos, int64_t id) {
  if (id < 0 || id >= p.num_embeddings) {
    throw InvalidArgument("embedding: id " + std::to_string(id) + " at position " +
                          std::to_string(pos) + " is out of range (expected 0.." +
                          std::to_string(p.num_embeddings - 1) + ")");
  }
}

template <class C>
void embedding_backward_impl(const EmbeddingPlan& p, int64_t positions) {
  const VecOps<C>& v = vec_ops<C>();
  C* dw = static_cast<C*>(p.dw);
  std::vector<C> buf;
  for (int64_t pos = 0; pos < positions; ++pos) {
    const int64_t id = id_at(p, pos);
    check_id(p, pos, id);
    const int64_t r = id - p.row_start;
    if (r < 0 || r >= p.rows || (p.has_padding && id == p.padding_idx)) continue;
    const C* g = read_row<C>(p.dy, offset_of(pos, p.ids_shape, p.dy.outer_strides), p.dim, buf);
    C* row = dw + r * p.dim;
    v.add(row, row, g, C(1), p.dim);
  }
}

}  // namespace

void cpu_embedding_forward(const EmbeddingPlan& p) {
  const int64_t positions = p.ids_shape.product();
  const size_t out_size = itemsize(p.out.dtype);
  for (int64_t pos = 0; pos < positions; ++pos) {
    const int64_t id = id_at(p, pos);
    check_id(p, pos, id);
    const int64_t r = id - p.row_start;
    void* dst = at(p.out.data, p.out.dtype, offset_of(pos, p.ids_shape, p.out.outer_strides));
    if (r < 0 || r >= p.rows) {
      if (p.out.stride == 1) {
        std::memset(dst, 0, static_cast<size_t>(p.dim) * out_size);
      } else {
        const uint64_t zero = 0;
        for (int64_t j = 0; j < p.dim; ++j)
          std::memcpy(at(dst, p.out.dtype, j * p.out.stride), &zero, out_size);
      }
      continue;
    }
    const void* src = at(p.table.data, p.table.dtype, r * p.table.outer_strides[0]);
    cpu_copy_cast(dst, p.out.dtype, Dims{p.out.stride}, src, p.table.dtype, Dims{p.table.stride},
                  Dims{p.dim});
  }
}

void cpu_embedding_backward(const EmbeddingPlan& p) {
  const int64_t positions = p.ids_shape.product();
  if (p.dw_dtype == DType::kF64) {
    embedding_backward_impl<double>(p, positions);
  } else {
    embedding_backward_impl<float>(p, positions);
  }
}

}  // namespace kernels::detail
