// softmax / log_softmax, RMSNorm / LayerNorm and cross-entropy (fused and vocab-sharded) against
// f64 references, plus finite-difference checks of every backward in f64.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/cpu/vec.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/norm.h"
#include "kernels/ops/reduction.h"
#include "kernels/ops/softmax.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

// Calls fn(row values, write-back) for every row of a contiguous row-major `shape` along `dim`.
void for_rows(const Dims& shape, int dim, std::vector<double>& data,
              const std::function<void(std::vector<double>&)>& fn) {
  int64_t inner = 1;
  for (int d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t len = shape[dim];
  const int64_t outer = len * inner == 0 ? 0 : static_cast<int64_t>(data.size()) / (len * inner);
  std::vector<double> row(static_cast<size_t>(len));
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      for (int64_t j = 0; j < len; ++j)
        row[j] = data[static_cast<size_t>((o * len + j) * inner + i)];
      fn(row);
      for (int64_t j = 0; j < len; ++j)
        data[static_cast<size_t>((o * len + j) * inner + i)] = row[j];
    }
  }
}

std::vector<double> ref_softmax(const Tensor& x, int dim, bool log) {
  std::vector<double> v = x.to_vector();
  for_rows(x.shape(), dim, v, [&](std::vector<double>& r) {
    double m = -INFINITY;
    for (double e : r) m = std::max(m, e);
    double s = 0;
    for (double e : r) s += std::exp(e - m);
    for (double& e : r) e = log ? e - m - std::log(s) : std::exp(e - m) / s;
  });
  return v;
}

// Central finite differences of f(x) = sum(out(x) * r) with respect to x (f64, contiguous).
std::vector<double> numeric_grad(const Tensor& x, const std::function<Tensor(const Tensor&)>& out,
                                 const Tensor& r, double h = 1e-6) {
  std::vector<double> g;
  const std::vector<double> base = x.to_vector();
  const std::vector<double> rv = r.to_vector();
  auto f = [&](const std::vector<double>& xv) {
    const auto o = out(Tensor::from_vector(xv, x.shape(), DType::kF64)).to_vector();
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i) s += o[i] * rv[i];
    return s;
  };
  for (size_t i = 0; i < base.size(); ++i) {
    std::vector<double> p = base, m = base;
    p[i] += h;
    m[i] -= h;
    g.push_back((f(p) - f(m)) / (2 * h));
  }
  return g;
}

}  // namespace

TEST_CASE("softmax and log_softmax: every dim, dtype and layout", "[kernels][ops][softmax]") {
  const std::vector<Dims> shapes = {{7}, {5, 13}, {3, 0, 4}, {2, 3, 37}, {2, 700}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Dims& shape : shapes) {
      const Tensor x0 = random_tensor(shape, dt, 21, -8, 8);
      const Tensor dy0 = random_tensor(shape, dt, 22);
      for (int dim = 0; dim < shape.size(); ++dim) {
        for (bool log : {false, true}) {
          const auto y_ref = ref_softmax(x0, dim, log);
          // Backward reference from the rounded forward output y (what the kernel gets).
          const Tensor y0 = Tensor::from_vector(y_ref, shape, dt);
          std::vector<double> yv = y0.to_vector(), dyv = dy0.to_vector(), dx_ref = dyv;
          {
            std::vector<double> ycopy = yv;
            // Rows of y and dy walked together: pack pairs through an index trick.
            int64_t inner = 1;
            for (int d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
            const int64_t len = shape[dim];
            const int64_t outer =
                len * inner == 0 ? 0 : static_cast<int64_t>(yv.size()) / (len * inner);
            for (int64_t o = 0; o < outer; ++o) {
              for (int64_t i = 0; i < inner; ++i) {
                auto at = [&](int64_t j) { return static_cast<size_t>((o * len + j) * inner + i); };
                double s = 0;
                for (int64_t j = 0; j < len; ++j) s += log ? dyv[at(j)] : dyv[at(j)] * yv[at(j)];
                for (int64_t j = 0; j < len; ++j) {
                  dx_ref[at(j)] =
                      log ? dyv[at(j)] - std::exp(yv[at(j)]) * s : yv[at(j)] * (dyv[at(j)] - s);
                }
              }
            }
          }
          Tol tol = tol_for(dt, 4);
          if (log && dt != DType::kF64)
            tol.atol = std::max(tol.atol, dt == DType::kF32 ? 1e-5 : 0.05);
          for (int layout = 0; layout < kLayouts; ++layout) {
            const Tensor x = relayout(x0, layout);
            INFO(describe(x) << " dim " << dim << (log ? " log" : ""));
            check_close(log ? log_softmax(x, dim) : softmax(x, dim), y_ref, tol.rtol, tol.atol,
                        "forward");
            Tensor out = relayout(Tensor::zeros(shape, dt), (layout + 1) % kLayouts);
            log ? log_softmax_out(out, x, dim - static_cast<int>(shape.size()))
                : softmax_out(out, x, dim);
            check_close(out, y_ref, tol.rtol, tol.atol, "forward out");
            const Tensor y = relayout(y0, layout), dy = relayout(dy0, (layout + 2) % kLayouts);
            const Tol btol{tol.rtol, tol.atol * 4 + (dt == DType::kF32 ? 2e-6 : 0)};
            check_close(log ? log_softmax_backward(dy, y, dim) : softmax_backward(dy, y, dim),
                        dx_ref, btol.rtol, btol.atol, "backward");
            Tensor inplace = relayout(dy0, layout);  // dx over dy
            log ? log_softmax_backward_out(inplace, inplace, y, dim)
                : softmax_backward_out(inplace, inplace, y, dim);
            check_close(inplace, dx_ref, btol.rtol, btol.atol, "backward in place");
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 4 * (1 + 2 + 3 + 3 + 2) * 2 * kLayouts);
  // Stability and edge rows.
  const Tensor big = Tensor::from_vector({1000, 1000, -1000}, {1, 3});
  check_close(softmax(big, 1), {0.5, 0.5, 0.0}, 1e-6, 1e-7, "large logits");
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor masked = Tensor::from_vector({0, -inf, -inf, -inf}, {2, 2});
  const Tensor y = softmax(masked, 1);
  CHECK(y.item({0, 0}) == 1.0);
  CHECK(y.item({0, 1}) == 0.0);
  CHECK(std::isnan(y.item({1, 0})));  // a fully masked row is NaN, as PyTorch
}

TEST_CASE("softmax backward matches finite differences (f64)", "[kernels][ops][softmax]") {
  const Tensor x = random_tensor({3, 6}, DType::kF64, 31, -2, 2);
  const Tensor r = random_tensor({3, 6}, DType::kF64, 32);
  for (bool log : {false, true}) {
    auto fwd = [&](const Tensor& t) { return log ? log_softmax(t, 1) : softmax(t, 1); };
    const Tensor y = fwd(x);
    const Tensor dx = log ? log_softmax_backward(r, y, 1) : softmax_backward(r, y, 1);
    check_close(dx, numeric_grad(x, fwd, r), 1e-6, 1e-8, log ? "log_softmax fd" : "softmax fd");
  }
}

namespace {

struct NormRef {
  std::vector<double> y, mean, rstd, dx, dw, db;
};

// f64 reference of the forward and (from the exact statistics) the backward.
NormRef ref_norm(bool rms, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                 double eps) {
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? x.numel() : x.numel() / d;
  const auto xv = x.to_vector(), dyv = dy.to_vector();
  const auto wv = w.defined() ? w.to_vector() : std::vector<double>(static_cast<size_t>(d), 1.0);
  const auto bv = b.defined() ? b.to_vector() : std::vector<double>(static_cast<size_t>(d), 0.0);
  NormRef r;
  r.y.resize(xv.size());
  r.dx.resize(xv.size());
  r.dw.assign(static_cast<size_t>(d), 0.0);
  r.db.assign(static_cast<size_t>(d), 0.0);
  for (int64_t i = 0; i < (d == 0 ? 0 : rows); ++i) {
    const double* xr = &xv[static_cast<size_t>(i * d)];
    const double* g = &dyv[static_cast<size_t>(i * d)];
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t j = 0; j < d; ++j) mean += xr[j];
      mean /= d;
    }
    for (int64_t j = 0; j < d; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    var /= d;
    const double rstd = 1 / std::sqrt(var + eps);
    r.mean.push_back(mean);
    r.rstd.push_back(rstd);
    double c1 = 0, c2 = 0;
    std::vector<double> xhat(static_cast<size_t>(d));
    for (int64_t j = 0; j < d; ++j) {
      xhat[j] = (xr[j] - mean) * rstd;
      r.y[static_cast<size_t>(i * d + j)] = xhat[j] * wv[j] + bv[j];
      r.dw[j] += g[j] * xhat[j];
      r.db[j] += g[j];
      c1 += g[j] * wv[j] * xhat[j];
      c2 += g[j] * wv[j];
    }
    c1 /= d, c2 /= d;
    for (int64_t j = 0; j < d; ++j)
      r.dx[static_cast<size_t>(i * d + j)] = rstd * (g[j] * wv[j] - (rms ? 0 : c2) - xhat[j] * c1);
  }
  return r;
}

}  // namespace

TEST_CASE("RMSNorm and LayerNorm forward/backward: dtypes, layouts, affine or not",
          "[kernels][ops][norm]") {
  const std::vector<Dims> shapes = {{5, 13}, {2, 3, 37}, {0, 8}, {4, 1}, {1, 300}, {9}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Dims& shape : shapes) {
      const int64_t d = shape.back();
      for (bool rms : {true, false}) {
        for (int affine = 0; affine < 3; ++affine) {  // 0: none, 1: weight, 2: weight + bias
          if (rms && affine == 2) continue;
          const Tensor x0 = random_tensor(shape, dt, 41, -2, 3);
          const Tensor w = affine >= 1 ? random_tensor({d}, dt, 42, 0.5, 1.5) : Tensor();
          const Tensor b = affine == 2 ? random_tensor({d}, dt, 43) : Tensor();
          const Tensor dy0 = random_tensor(shape, dt, 44);
          const double eps = 1e-5;
          const NormRef ref = ref_norm(rms, x0, w, b, dy0, eps);
          const Tol tol = tol_for(dt, 8);
          const double gtol = dt == DType::kF32 ? 1e-4 : tol.atol * 4;
          for (int layout = 0; layout < kLayouts; ++layout) {
            const Tensor x = relayout(x0, layout), dy = relayout(dy0, (layout + 1) % kLayouts);
            INFO(describe(x) << (rms ? " rms" : " layer") << " affine " << affine);
            Tensor y, mean, rstd;
            if (rms) {
              RmsNormOutput f = rms_norm(x, w, eps);
              y = f.y, rstd = f.rstd;
            } else {
              LayerNormOutput f = layer_norm(x, w, b, eps);
              y = f.y, mean = f.mean, rstd = f.rstd;
              check_close(mean, ref.mean, 1e-6, 1e-6, "mean");
            }
            REQUIRE(rstd.dtype() == stats_dtype_of(dt));
            check_close(rstd, ref.rstd, dt == DType::kF64 ? 1e-12 : 1e-6, 0, "rstd");
            check_close(y, ref.y, tol.rtol, tol.atol, "y");
            // Backward into strided outs with accumulation of the parameter gradients.
            Tensor dx = relayout(Tensor::zeros(shape, dt), (layout + 2) % kLayouts);
            Tensor dw =
                affine >= 1 ? relayout(Tensor::full({d}, 1.0, DType::kF32), layout) : Tensor();
            Tensor db =
                affine == 2 ? relayout(Tensor::full({d}, 1.0, DType::kF32), layout) : Tensor();
            if (rms) {
              rms_norm_backward_out(dx, dw, dy, x, w, rstd, /*accumulate=*/true);
            } else {
              layer_norm_backward_out(dx, dw, db, dy, x, w, mean, rstd, /*accumulate=*/true);
            }
            check_close(dx, ref.dx, tol.rtol * 4, gtol, "dx");
            auto plus1 = [](std::vector<double> v) {
              for (double& e : v) e += 1;
              return v;
            };
            if (dw.defined())
              check_close(dw, plus1(ref.dw), 1e-4, gtol * 10, "dweight (accumulated)");
            if (db.defined())
              check_close(db, plus1(ref.db), 1e-4, gtol * 10, "dbias (accumulated)");
            // The functional backward.
            if (rms) {
              RmsNormGrads g = rms_norm_backward(dy, x, w, rstd);
              check_close(g.dx, ref.dx, tol.rtol * 4, gtol, "dx functional");
              REQUIRE(g.dweight.defined() == w.defined());
              if (w.defined())
                check_close(g.dweight, ref.dw, 1e-2, gtol * 10 + (dt == DType::kBF16 ? 0.05 : 0),
                            "dweight functional");
            } else {
              LayerNormGrads g = layer_norm_backward(dy, x, w, b, mean, rstd);
              check_close(g.dx, ref.dx, tol.rtol * 4, gtol, "dx functional");
              REQUIRE(g.dbias.defined() == b.defined());
            }
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 4 * 6 * 5 * kLayouts);
}

TEST_CASE("norm backward matches finite differences (f64)", "[kernels][ops][norm]") {
  const Tensor x = random_tensor({3, 7}, DType::kF64, 51, -2, 2);
  const Tensor w = random_tensor({7}, DType::kF64, 52, 0.5, 1.5);
  const Tensor b = random_tensor({7}, DType::kF64, 53);
  const Tensor r = random_tensor({3, 7}, DType::kF64, 54);
  const double eps = 1e-3;
  {
    const RmsNormOutput f = rms_norm(x, w, eps);
    const RmsNormGrads g = rms_norm_backward(r, x, w, f.rstd);
    check_close(g.dx,
                numeric_grad(
                    x, [&](const Tensor& t) { return rms_norm(t, w, eps).y; }, r),
                1e-6, 1e-8, "rms dx");
    check_close(g.dweight,
                numeric_grad(
                    w, [&](const Tensor& t) { return rms_norm(x, t, eps).y; }, r),
                1e-6, 1e-8, "rms dw");
  }
  {
    const LayerNormOutput f = layer_norm(x, w, b, eps);
    const LayerNormGrads g = layer_norm_backward(r, x, w, b, f.mean, f.rstd);
    check_close(g.dx,
                numeric_grad(
                    x, [&](const Tensor& t) { return layer_norm(t, w, b, eps).y; }, r),
                1e-6, 1e-8, "ln dx");
    check_close(g.dweight,
                numeric_grad(
                    w, [&](const Tensor& t) { return layer_norm(x, t, b, eps).y; }, r),
                1e-6, 1e-8, "ln dw");
    check_close(g.dbias,
                numeric_grad(
                    b, [&](const Tensor& t) { return layer_norm(x, w, t, eps).y; }, r),
                1e-6, 1e-8, "ln db");
  }
}

TEST_CASE("norms reject bad arguments", "[kernels][ops][norm]") {
  const Tensor x = Tensor::zeros({3, 4}, DType::kF32);
  REQUIRE_THROWS_WITH(rms_norm(x, Tensor::zeros({5}, DType::kF32), 1e-6),
                      Contains("weight has shape [5], expected [4]"));
  REQUIRE_THROWS_WITH(rms_norm(x, Tensor(), -1.0), Contains("eps is -1"));
  REQUIRE_THROWS_WITH(rms_norm_backward(x, x, Tensor(), Tensor::zeros({3}, DType::kBF16)),
                      Contains("rstd has dtype bf16, expected f32"));
  REQUIRE_THROWS_WITH(layer_norm_backward(x, x, Tensor(), Tensor(), Tensor::zeros({4}, DType::kF32),
                                          Tensor::zeros({3}, DType::kF32)),
                      Contains("mean has shape [4], expected [3]"));
  REQUIRE_THROWS_WITH(rms_norm(Tensor::zeros({}, DType::kF32), Tensor(), 1e-6),
                      Contains("x is 0-d"));
  Tensor y = x.clone();
  REQUIRE_THROWS_WITH(rms_norm_out(y, y.select(1, 0), x, Tensor(), 1e-6),
                      Contains("y overlaps rstd"));
}

namespace {

struct CeRef {
  std::vector<double> row_loss, dlogits;
  double loss_sum = 0;
  int64_t count = 0;
};

CeRef ref_ce(const Tensor& logits, const std::vector<int64_t>& targets, int64_t ignore,
             double g_mean_scale) {
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto x = logits.to_vector();
  CeRef r;
  r.row_loss.assign(static_cast<size_t>(n), 0.0);
  r.dlogits.assign(x.size(), 0.0);
  for (int64_t i = 0; i < n; ++i)
    if (targets[i] != ignore) ++r.count;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] == ignore) continue;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, x[i * v + j]);
    for (int64_t j = 0; j < v; ++j) s += std::exp(x[i * v + j] - m);
    r.row_loss[i] = std::log(s) + m - x[i * v + targets[i]];
    r.loss_sum += r.row_loss[i];
    for (int64_t j = 0; j < v; ++j)
      r.dlogits[i * v + j] =
          (std::exp(x[i * v + j] - m) / s - (j == targets[i] ? 1 : 0)) * g_mean_scale;
  }
  return r;
}

}  // namespace

TEST_CASE("cross_entropy: fused loss and dlogits, reductions, ignore_index",
          "[kernels][ops][cross_entropy]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (auto [n, v] :
         std::vector<std::pair<int64_t, int64_t>>{{6, 11}, {1, 1}, {0, 5}, {17, 257}}) {
      std::vector<int64_t> t;
      for (int64_t i = 0; i < n; ++i) t.push_back(i % 4 == 1 ? -100 : (i * 7 + 3) % v);
      std::vector<double> td(t.begin(), t.end());
      const Tensor logits0 = random_tensor({n, v}, dt, 61, -5, 5);
      for (DType tdt : {DType::kI64, DType::kI32}) {
        const Tensor targets = relayout(Tensor::from_vector(td, {n}, tdt), 2);
        const CeRef base = ref_ce(logits0, t, -100, 1.0);
        for (LossReduction red :
             {LossReduction::kMean, LossReduction::kSum, LossReduction::kNone}) {
          const double g =
              red == LossReduction::kMean ? 0.5 / std::max<int64_t>(base.count, 1) : 0.5;
          const CeRef ref = ref_ce(logits0, t, -100, g);
          for (int layout = 0; layout < kLayouts; ++layout) {
            const Tensor logits = relayout(logits0, layout);
            INFO(describe(logits) << " reduction " << static_cast<int>(red));
            const CrossEntropyOutput out =
                cross_entropy(logits, targets, {.reduction = red, .grad_scale = 0.5});
            REQUIRE(out.loss.dtype() == stats_dtype_of(dt));
            const double tl = dt == DType::kF64 ? 1e-12 : 1e-5;
            if (red == LossReduction::kNone) {
              check_close(out.loss, ref.row_loss, tl, tl, "row losses");
            } else if (red == LossReduction::kSum) {
              check_close(out.loss, {ref.loss_sum}, tl, tl * n, "sum loss");
            } else {
              check_close(out.loss, {ref.count == 0 ? NAN : ref.loss_sum / ref.count}, tl, tl,
                          "mean loss");
            }
            const Tol tol = tol_for(dt);
            check_close(out.dlogits, ref.dlogits, tol.rtol, tol.atol + 1e-7, "dlogits");
            // Into a strided f32 dlogits.
            Tensor d = relayout(Tensor::zeros({n, v}, DType::kF32), (layout + 1) % kLayouts);
            Tensor loss = Tensor::empty(out.loss.shape(), out.loss.dtype());
            cross_entropy_out(loss, d, logits, targets, {.reduction = red, .grad_scale = 0.5});
            check_close(d, ref.dlogits, 1e-5, 1e-7, "dlogits out");
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 4 * 4 * 2 * 3 * kLayouts);
  // All rows ignored: the mean is NaN (0/0), as PyTorch; the gradient is zero.
  const CrossEntropyOutput all =
      cross_entropy(Tensor::zeros({2, 3}, DType::kF32), Tensor::full({2}, -100, DType::kI64));
  CHECK(std::isnan(all.loss.item({})));
  CHECK(all.dlogits.to_vector() == std::vector<double>(6, 0.0));
  // A custom ignore_index, and the range check naming the row.
  CHECK(cross_entropy(Tensor::zeros({2, 3}, DType::kF32),
                      Tensor::from_vector({7, 0}, {2}, DType::kI64), {.ignore_index = 7})
            .loss.item({}) == Approx(std::log(3.0)));
  REQUIRE_THROWS_WITH(
      cross_entropy(Tensor::zeros({2, 3}, DType::kF32),
                    Tensor::from_vector({1, 3}, {2}, DType::kI64)),
      Contains("target 3 at row 1 is out of range (expected 0..2 or ignore_index -100)"));
  REQUIRE_THROWS_WITH(
      cross_entropy(Tensor::zeros({2, 3, 1}, DType::kF32), Tensor::zeros({2}, DType::kI64)),
      Contains("expected 2 dims [N, V]"));
  REQUIRE_THROWS_WITH(
      cross_entropy(Tensor::zeros({2, 3}, DType::kF32), Tensor::zeros({2}, DType::kF32)),
      Contains("targets has dtype f32, expected i64 or i32"));
}

TEST_CASE("cross_entropy on vocab shards equals the full loss", "[kernels][ops][cross_entropy]") {
  int cases = 0;
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
    const int64_t n = 9, v = 23;
    std::vector<double> td;
    for (int64_t i = 0; i < n; ++i) td.push_back(i == 4 ? -100 : (i * 5 + 2) % v);
    const Tensor targets = Tensor::from_vector(td, {n}, DType::kI64);
    const Tensor logits = random_tensor({n, v}, dt, 71, -6, 6);
    for (LossReduction red : {LossReduction::kMean, LossReduction::kSum, LossReduction::kNone}) {
      const CrossEntropyOptions opts{.reduction = red, .grad_scale = 2.0};
      const CrossEntropyOutput full = cross_entropy(logits, targets, opts);
      // Uneven shards, one of them empty: [0, 9), [9, 9), [9, 16), [16, 23).
      const std::vector<std::pair<int64_t, int64_t>> shards = {{0, 9}, {9, 0}, {9, 7}, {16, 7}};
      std::vector<CrossEntropyRowStats> stats;
      Tensor gmax = Tensor::full({n}, -INFINITY, stats_dtype_of(dt));
      for (auto [start, len] : shards) {
        stats.push_back(cross_entropy_shard_stats(logits.narrow(1, start, len), targets, start, v));
        // all_reduce(max)
        const auto m = stats.back().max.to_vector();
        for (int64_t i = 0; i < n; ++i) gmax.set_item({i}, std::max(gmax.item({i}), m[i]));
      }
      Tensor gsum = Tensor::zeros({n}, stats_dtype_of(dt)),
             gtarget = Tensor::zeros({n}, stats_dtype_of(dt));
      for (auto& s : stats) {
        rescale_sum_exp_(s.sum_exp, s.max, gmax);
        add_out(gsum, gsum, s.sum_exp);  // all_reduce(sum)
        add_out(gtarget, gtarget, s.target_logit);
      }
      const Tensor loss = cross_entropy_loss_from_stats(gmax, gsum, gtarget, targets, opts);
      const double tl = dt == DType::kF64 ? 1e-12 : 1e-5;
      check_close(loss, full.loss, tl, tl, "sharded loss");
      Tensor dlogits = Tensor::zeros({n, v}, dt);
      for (auto [start, len] : shards) {
        cross_entropy_shard_backward_out(dlogits.narrow(1, start, len),
                                         logits.narrow(1, start, len), targets, start, gmax, gsum,
                                         opts);
      }
      const Tol tol = tol_for(dt);
      check_close(dlogits, full.dlogits, tol.rtol, tol.atol + 1e-7, "sharded dlogits");
      ++cases;
    }
  }
  REQUIRE(cases == 3 * 3);
  // The empty shard's statistics.
  const CrossEntropyRowStats e = cross_entropy_shard_stats(Tensor::zeros({2, 0}, DType::kF32),
                                                           Tensor::zeros({2}, DType::kI64), 3, 3);
  CHECK(e.max.to_vector() == std::vector<double>(2, -INFINITY));
  CHECK(e.sum_exp.to_vector() == std::vector<double>(2, 0.0));
  REQUIRE_THROWS_WITH(cross_entropy_shard_stats(Tensor::zeros({2, 4}, DType::kF32),
                                                Tensor::zeros({2}, DType::kI64), 3, 6),
                      Contains("the shard holds columns [3, 7) but the vocab has 6"));
}

namespace {

// exp_shift_sum with `out` at each element offset of a 64-byte line (and in place): every value
// and the sum must be bit-identical to those of an aligned `out`. Returns the placements checked.
template <class T>
int exp_shift_sum_placements(const detail::VecOps<T>& v) {
  constexpr int64_t kN = 1000, kLine = 64 / sizeof(T);
  std::vector<T> x(kN);
  for (int64_t i = 0; i < kN; ++i) x[i] = static_cast<T>(-20.0 + 0.0371 * static_cast<double>((i * 389) % kN));
  const T shift = v.max(x.data(), kN);
  struct alignas(64) Line {
    T v[kLine];
  };
  std::vector<Line> ref_buf(kN / kLine + 2), buf(kN / kLine + 2);
  T* ref = ref_buf[0].v;
  const double ref_sum = v.exp_shift_sum(ref, x.data(), shift, kN);
  int checked = 0;
  for (int64_t off = 0; off < kLine; ++off) {
    for (bool in_place : {false, true}) {
      T* out = buf[0].v + off;
      if (in_place) std::memcpy(out, x.data(), kN * sizeof(T));
      const double s = v.exp_shift_sum(out, in_place ? out : x.data(), shift, kN);
      INFO("offset " << off << " elements, in place " << in_place);
      CHECK(std::memcmp(&s, &ref_sum, sizeof s) == 0);
      CHECK(std::memcmp(out, ref, kN * sizeof(T)) == 0);
      ++checked;
    }
  }
  return checked;
}

}  // namespace

// cross_entropy's scratch row is heap memory whose alignment varies from run to run (with rank
// threads it depends on timing): the loss must not depend on it.
TEST_CASE("exp_shift_sum does not depend on the alignment of out", "[kernels][ops][cross_entropy]") {
  int tables = 0, checked = 0;
  for (detail::Isa isa : {detail::Isa::kBaseline, detail::Isa::kAvx2, detail::Isa::kAvx512}) {
    const detail::VecKernels* k = detail::vec_kernels_for(isa);
    if (k == nullptr) continue;
    INFO("isa " << detail::to_string(isa));
    ++tables;
    checked += exp_shift_sum_placements(k->f32);
    checked += exp_shift_sum_placements(k->f64);
  }
  REQUIRE(tables >= 1);
  REQUIRE(checked == tables * 2 * (16 + 8));
}

TEST_CASE("cross_entropy dlogits matches finite differences (f64)",
          "[kernels][ops][cross_entropy]") {
  const Tensor logits = random_tensor({4, 5}, DType::kF64, 81, -2, 2);
  const Tensor targets = Tensor::from_vector({1, -100, 4, 0}, {4}, DType::kI64);
  const CrossEntropyOutput out = cross_entropy(logits, targets);
  const Tensor one = Tensor::full({}, 1.0, DType::kF64);
  check_close(
      out.dlogits,
      numeric_grad(
          logits, [&](const Tensor& t) { return cross_entropy(t, targets, {}, false).loss; }, one),
      1e-6, 1e-9, "fd");
}
