// sum / mean / max (+ backward) / sum_to_shape / sum_of_squares against f64 loops: every dtype,
// every dim subset of odd and empty shapes, keepdim, every layout, accumulation.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/ops/reduction.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

// Reference sums over the dims in `mask` (bit d set = reduce dim d), row-major over kept dims.
std::vector<double> ref_sum(const Tensor& x, unsigned mask, bool square = false) {
  const Dims shape = x.shape();
  const auto v = x.to_vector();
  Dims kept;
  for (int d = 0; d < shape.size(); ++d)
    if (!(mask >> d & 1)) kept.push_back(shape[d]);
  std::vector<double> out(static_cast<size_t>(kept.product()), 0.0);
  std::vector<int64_t> idx(static_cast<size_t>(shape.size()), 0);
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t rest = static_cast<int64_t>(i);
    for (int d = shape.size() - 1; d >= 0; --d) {
      idx[static_cast<size_t>(d)] = rest % shape[d];
      rest /= shape[d];
    }
    int64_t o = 0;
    for (int d = 0; d < shape.size(); ++d)
      if (!(mask >> d & 1)) o = o * shape[d] + idx[static_cast<size_t>(d)];
    out[static_cast<size_t>(o)] += square ? v[i] * v[i] : v[i];
  }
  return out;
}

Dims mask_dims(unsigned mask, int ndim) {
  Dims d;
  for (int i = 0; i < ndim; ++i)
    if (mask >> i & 1) d.push_back(i - (i % 2 == 1 ? ndim : 0));  // odd dims negative
  return d;
}

Dims out_shape(const Dims& shape, unsigned mask, bool keepdim) {
  Dims s;
  for (int d = 0; d < shape.size(); ++d) {
    if (!(mask >> d & 1))
      s.push_back(shape[d]);
    else if (keepdim)
      s.push_back(1);
  }
  return s;
}

}  // namespace

TEST_CASE("sum and mean over every subset of dims", "[kernels][ops][reduction]") {
  const std::vector<Dims> shapes = {{7}, {5, 13}, {3, 0, 4}, {2, 3, 37}, {4, 1, 3, 5}, {}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Dims& shape : shapes) {
      const Tensor x0 = random_tensor(shape, dt, 17);
      for (unsigned mask = 0; mask < (1u << shape.size()); ++mask) {
        const Dims dims = mask_dims(mask, shape.size());
        const auto sums = ref_sum(x0, mask);
        int64_t count = 1;
        for (int d = 0; d < shape.size(); ++d)
          if (mask >> d & 1) count *= shape[d];
        std::vector<double> means;
        for (double s : sums) means.push_back(count == 0 ? std::nan("") : s / count);
        const Tol tol = tol_for(dt, 10);
        for (int layout = 0; layout < kLayouts; ++layout) {
          const Tensor x = relayout(x0, layout);
          for (bool keepdim : {false, true}) {
            INFO(describe(x) << " dims " << fmt::format("{}", dims) << " keepdim " << keepdim);
            const Tensor s = sum(x, dims, keepdim);
            REQUIRE(s.shape() == out_shape(shape, mask, keepdim));
            REQUIRE(s.dtype() == dt);
            check_close(s, sums, tol.rtol, tol.atol, "sum");
            check_close(mean(x, dims, keepdim), means, tol.rtol, tol.atol, "mean");
            // Into a strided f32 / f64 out, accumulating.
            Tensor out = relayout(
                random_tensor(out_shape(shape, mask, keepdim), stats_dtype_of(dt), 3), layout);
            const auto before = out.to_vector();
            sum_out(out, x, dims, keepdim, /*accumulate=*/true);
            std::vector<double> acc;
            for (size_t i = 0; i < sums.size(); ++i) acc.push_back(before[i] + sums[i]);
            check_close(out, acc, 2e-5, 2e-5, "sum_out accumulate");
            ++cases;
          }
        }
      }
    }
  }
  // subsets: 2 + 4 + 8 + 8 + 16 + 1 = 39 per dtype
  REQUIRE(cases == 4 * 39 * kLayouts * 2);
  CHECK(sum_all(Tensor::arange({3, 4}, DType::kF32)).item({}) == 66.0);
  CHECK(std::isnan(mean(Tensor::zeros({0, 3}, DType::kF32), {0}).item({1})));
  CHECK(sum(Tensor::zeros({0, 3}, DType::kF32), {0}).to_vector() == std::vector<double>{0, 0, 0});
}

TEST_CASE("max with argmax, and its backward", "[kernels][ops][reduction]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Dims& shape : std::vector<Dims>{{7}, {5, 13}, {3, 4, 6}, {2, 0, 3}}) {
      // Few distinct values so ties occur: the first index must win.
      Tensor x0 = random_tensor(shape, DType::kF64, 19, 0, 4);
      x0 = Tensor::from_vector(
          [&] {
            std::vector<double> v = x0.to_vector();
            for (double& e : v) e = std::floor(e);
            return v;
          }(),
          shape, dt);
      for (int dim = 0; dim < shape.size(); ++dim) {
        if (shape[dim] == 0) continue;
        Dims outer = shape;
        outer.erase(dim);
        // Reference: per outer position, first max.
        const auto v = x0.to_vector();
        std::vector<double> values(static_cast<size_t>(outer.product())), indices(values.size());
        std::vector<double> grad(v.size(), 0.0);
        const Tensor dy0 = random_tensor(outer, dt, 20);
        const auto dyv = dy0.to_vector();
        int64_t inner = 1;
        for (int d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
        for (size_t o = 0; o < values.size(); ++o) {
          const int64_t hi = static_cast<int64_t>(o) / inner, lo = static_cast<int64_t>(o) % inner;
          double best = -INFINITY;
          int64_t arg = 0;
          for (int64_t j = 0; j < shape[dim]; ++j) {
            const double e = v[static_cast<size_t>((hi * shape[dim] + j) * inner + lo)];
            if (e > best) best = e, arg = j;
          }
          values[o] = best, indices[o] = static_cast<double>(arg);
          grad[static_cast<size_t>((hi * shape[dim] + arg) * inner + lo)] = dyv[o];
        }
        for (int layout = 0; layout < kLayouts; ++layout) {
          const Tensor x = relayout(x0, layout);
          for (bool keepdim : {false, true}) {
            INFO(describe(x) << " dim " << dim << " keepdim " << keepdim);
            const MaxResult r = max(x, dim - (keepdim ? shape.size() : 0), keepdim);
            check_close(r.values, values, 0, 0, "values");
            REQUIRE(r.indices.dtype() == DType::kI64);
            check_close(r.indices, indices, 0, 0, "indices");
            const Tensor dy =
                keepdim ? relayout(dy0, layout).unsqueeze(dim) : relayout(dy0, layout);
            const Tensor dx = max_backward(dy, r.indices, dim, shape, keepdim);
            REQUIRE(dx.shape() == shape);
            check_close(dx, grad, 0, 0, "max_backward");
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 4 * (1 + 2 + 3 + 2) * kLayouts * 2);
  // NaN propagates with its index.
  const Tensor n = Tensor::from_vector({1, NAN, 5, NAN}, {4});
  const MaxResult r = max(n, 0);
  CHECK(std::isnan(r.values.item({})));
  CHECK(r.indices.item({}) == 1.0);
  REQUIRE_THROWS_WITH(max(Tensor::zeros({3, 0}, DType::kF32), 1),
                      Contains("dim 1 of x [3,0] has size 0"));
  REQUIRE_THROWS_WITH(
      max_backward(Tensor::zeros({2}, DType::kF32), Tensor::full({2}, 5, DType::kI64), 1, {2, 3}),
      Contains("index 5 at position 0 is out of range for a dim of size 3"));
}

TEST_CASE("sum_to_shape reduces a broadcast gradient", "[kernels][ops][reduction]") {
  const Tensor g = random_tensor({4, 2, 3}, DType::kF32, 5);
  const auto v = g.to_vector();
  check_close(sum_to_shape(g, {3}), ref_sum(g, 0b011), 1e-6, 1e-6, "to [3]");
  check_close(sum_to_shape(g, {2, 1}), ref_sum(g, 0b101), 1e-6, 1e-6, "to [2,1]");
  check_close(sum_to_shape(g, {1, 2, 3}), ref_sum(g, 0b001), 1e-6, 1e-6, "to [1,2,3]");
  check_close(sum_to_shape(g, {4, 2, 3}), v, 0, 0, "identity");
  REQUIRE(sum_to_shape(g, {}).shape() == Dims{});
  REQUIRE_THROWS_WITH(sum_to_shape(g, {2}),
                      Contains("shape [2] does not broadcast to x's shape [4,2,3]"));
}

TEST_CASE("sum_of_squares accumulates in f64", "[kernels][ops][reduction]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tensor x0 = random_tensor({33, 17}, dt, 9, -3, 3);
    const double expected = ref_sum(x0, 0b11, true)[0];
    for (int layout = 0; layout < kLayouts; ++layout) {
      const Tensor s = sum_of_squares(relayout(x0, layout));
      REQUIRE(s.dtype() == DType::kF64);
      REQUIRE(s.shape() == Dims{});
      CHECK(std::fabs(s.item({}) - expected) <= 1e-12 * expected);
      ++cases;
    }
  }
  REQUIRE(cases == 4 * kLayouts);
  CHECK(sum_of_squares(Tensor::zeros({0}, DType::kF32)).item({}) == 0.0);
}

TEST_CASE("reductions reject bad arguments", "[kernels][ops][reduction]") {
  const Tensor x = Tensor::zeros({3, 4}, DType::kF32);
  REQUIRE_THROWS_WITH(sum(x, {2}), Contains("dim 2 out of range for a 2-d tensor"));
  REQUIRE_THROWS_WITH(sum(x, {1, -1}), Contains("dim 1 appears more than once"));
  REQUIRE_THROWS_WITH(sum_out(Tensor::zeros({4}, DType::kF32), x, {1}),
                      Contains("out has shape [4], expected [3]"));
  REQUIRE_THROWS_WITH(sum(Tensor::zeros({3}, DType::kI32), {0}), Contains("x has dtype i32"));
}
