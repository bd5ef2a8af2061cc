// add / mul / scale / GELU / SiLU and their backward against f64 formulas: every dtype, odd and
// empty shapes, broadcasting, every layout of inputs and outputs, in-place, mixed out dtypes.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kernels/ops/elementwise.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

double gelu_ref(double x, bool tanh_form) {
  if (tanh_form) {
    const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
    return 0.5 * x * (1 + std::tanh(u));
  }
  return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
}
double gelu_grad_ref(double x, bool tanh_form) {
  if (tanh_form) {
    const double c = std::sqrt(2.0 / M_PI);
    const double u = c * (x + 0.044715 * x * x * x);
    const double t = std::tanh(u);
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
  }
  return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
         x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
}
double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

struct Unary {
  std::string name;
  std::function<Tensor(const Tensor&)> fn;
  std::function<void(const Tensor&, const Tensor&)> fn_out;
  std::function<double(double)> ref;
};

struct Backward {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> fn;
  std::function<void(const Tensor&, const Tensor&, const Tensor&)> fn_out;
  std::function<double(double, double)> ref;  // (dy, x) -> dx
};

const std::vector<Dims>& shapes() {
  static const std::vector<Dims> s = {{0}, {7}, {5, 13}, {3, 0, 2}, {2, 3, 37}, {1}, {300}};
  return s;
}

}  // namespace

TEST_CASE("element-wise unary ops: GELU (both forms), SiLU, scale", "[kernels][ops][elementwise]") {
  const std::vector<Unary> ops = {
      {"gelu", [](const Tensor& x) { return gelu(x); },
       [](const Tensor& o, const Tensor& x) { gelu_out(o, x); },
       [](double x) { return gelu_ref(x, false); }},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::kTanh); },
       [](const Tensor& o, const Tensor& x) { gelu_out(o, x, GeluApproximation::kTanh); },
       [](double x) { return gelu_ref(x, true); }},
      {"silu", [](const Tensor& x) { return silu(x); },
       [](const Tensor& o, const Tensor& x) { silu_out(o, x); },
       [](double x) { return x * sigmoid(x); }},
      {"scale", [](const Tensor& x) { return scale(x, -0.75); },
       [](const Tensor& o, const Tensor& x) { scale_out(o, x, -0.75); },
       [](double x) { return -0.75 * x; }},
  };
  int cases = 0;
  for (const Unary& op : ops) {
    for (DType dt : float_dtypes()) {
      for (const Dims& shape : shapes()) {
        const Tensor x0 = random_tensor(shape, dt, 3, -6.0, 6.0);
        std::vector<double> expected;
        for (double v : x0.to_vector()) expected.push_back(op.ref(v));
        Tol tol = tol_for(dt);
        tol.atol = std::max(tol.atol, dt == DType::kF32 ? 3e-6 : 0.0);
        for (int layout = 0; layout < kLayouts; ++layout) {
          const Tensor x = relayout(x0, layout);
          INFO(op.name << " " << describe(x));
          check_close(op.fn(x), expected, tol.rtol, tol.atol, op.name);
          Tensor out = relayout(Tensor::zeros(shape, dt), (layout + 1) % kLayouts);
          op.fn_out(out, x);
          check_close(out, expected, tol.rtol, tol.atol, op.name + " out");
          Tensor inplace = relayout(x0, layout);
          op.fn_out(inplace, inplace);
          check_close(inplace, expected, tol.rtol, tol.atol, op.name + " in place");
          ++cases;
        }
        if (dt == DType::kBF16 || dt == DType::kF16) {  // an f32 out of narrow inputs
          Tensor out = Tensor::zeros(shape, DType::kF32);
          op.fn_out(out, x0);
          check_close(out, expected, 1e-5, 3e-6, op.name + " f32 out");
          ++cases;
        }
      }
    }
  }
  REQUIRE(cases == 4 * (4 * 7 * kLayouts + 2 * 7));
}

TEST_CASE("element-wise backward ops: GELU (both forms) and SiLU", "[kernels][ops][elementwise]") {
  const std::vector<Backward> ops = {
      {"gelu_backward", [](const Tensor& dy, const Tensor& x) { return gelu_backward(dy, x); },
       [](const Tensor& dx, const Tensor& dy, const Tensor& x) { gelu_backward_out(dx, dy, x); },
       [](double dy, double x) { return dy * gelu_grad_ref(x, false); }},
      {"gelu_backward tanh",
       [](const Tensor& dy, const Tensor& x) {
         return gelu_backward(dy, x, GeluApproximation::kTanh);
       },
       [](const Tensor& dx, const Tensor& dy, const Tensor& x) {
         gelu_backward_out(dx, dy, x, GeluApproximation::kTanh);
       },
       [](double dy, double x) { return dy * gelu_grad_ref(x, true); }},
      {"silu_backward", [](const Tensor& dy, const Tensor& x) { return silu_backward(dy, x); },
       [](const Tensor& dx, const Tensor& dy, const Tensor& x) { silu_backward_out(dx, dy, x); },
       [](double dy, double x) {
         const double s = sigmoid(x);
         return dy * s * (1 + x * (1 - s));
       }},
  };
  int cases = 0;
  for (const Backward& op : ops) {
    for (DType dt : float_dtypes()) {
      for (const Dims& shape : shapes()) {
        const Tensor x0 = random_tensor(shape, dt, 4, -6.0, 6.0);
        const Tensor dy0 = random_tensor(shape, dt, 5, -2.0, 2.0);
        std::vector<double> expected;
        const auto xv = x0.to_vector(), dyv = dy0.to_vector();
        for (size_t i = 0; i < xv.size(); ++i) expected.push_back(op.ref(dyv[i], xv[i]));
        Tol tol = tol_for(dt);
        tol.atol = std::max(tol.atol, dt == DType::kF32 ? 6e-6 : 0.0);
        for (int layout = 0; layout < kLayouts; ++layout) {
          const Tensor x = relayout(x0, layout), dy = relayout(dy0, (layout + 2) % kLayouts);
          INFO(op.name << " x " << describe(x) << " dy " << describe(dy));
          check_close(op.fn(dy, x), expected, tol.rtol, tol.atol, op.name);
          Tensor dx = relayout(Tensor::zeros(shape, dt), (layout + 1) % kLayouts);
          op.fn_out(dx, dy, x);
          check_close(dx, expected, tol.rtol, tol.atol, op.name + " out");
          Tensor inplace = relayout(dy0, layout);  // dx written over dy
          op.fn_out(inplace, inplace, x);
          check_close(inplace, expected, tol.rtol, tol.atol, op.name + " in place");
          ++cases;
        }
      }
    }
  }
  REQUIRE(cases == 3 * 4 * 7 * kLayouts);
}

TEST_CASE("element-wise binary ops broadcast: add, mul", "[kernels][ops][elementwise]") {
  struct Case {
    Dims a, b;
  };
  const std::vector<Case> cases_list = {{{4, 5}, {4, 5}}, {{4, 5}, {5}},       {{4, 1}, {1, 5}},
                                        {{3}, {}},        {{2, 3, 4}, {3, 1}}, {{0, 5}, {5}},
                                        {{1}, {6, 1}},    {{2, 1, 130}, {130}}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases_list) {
      const Tensor a0 = random_tensor(c.a, dt, 8), b0 = random_tensor(c.b, dt, 9);
      const Dims shape = broadcast_shapes(c.a, c.b);
      const Tensor ea = expand(a0, shape).contiguous(), eb = expand(b0, shape).contiguous();
      const auto av = ea.to_vector(), bv = eb.to_vector();
      std::vector<double> sum, prod;
      for (size_t i = 0; i < av.size(); ++i) {
        sum.push_back(av[i] - 0.5 * bv[i]);
        prod.push_back(av[i] * bv[i]);
      }
      const Tol tol = tol_for(dt);
      for (int layout = 0; layout < kLayouts; ++layout) {
        const Tensor a = relayout(a0, layout), b = relayout(b0, (layout + 1) % kLayouts);
        INFO(describe(a) << " op " << describe(b));
        check_close(add(a, b, -0.5), sum, tol.rtol, tol.atol, "add");
        check_close(mul(a, b), prod, tol.rtol, tol.atol, "mul");
        Tensor out = relayout(Tensor::zeros(shape, dt), (layout + 3) % kLayouts);
        add_out(out, a, b, -0.5);
        check_close(out, sum, tol.rtol, tol.atol, "add_out");
        mul_out(out, a, b);
        check_close(out, prod, tol.rtol, tol.atol, "mul_out");
        if (c.a == shape) {  // in place: a += -0.5 b
          Tensor acc = relayout(a0, layout);
          add_out(acc, acc, b, -0.5);
          check_close(acc, sum, tol.rtol, tol.atol, "add_out in place");
        }
        ++cases;
      }
    }
  }
  REQUIRE(cases == 4 * 8 * kLayouts);
  // Mixed input dtypes: arithmetic in f64 if either is f64, else f32; promoted result dtype.
  int mixed = 0;
  for (DType da : float_dtypes()) {
    for (DType db : float_dtypes()) {
      const Tensor a = relayout(random_tensor({6, 35}, da, 12), 1);
      const Tensor b = random_tensor({35}, db, 13);
      const auto av = a.to_vector(), bv = expand(b, {6, 35}).contiguous().to_vector();
      std::vector<double> expected;
      for (size_t i = 0; i < av.size(); ++i) expected.push_back(av[i] + 2.0 * bv[i]);
      const Tensor r = add(a, b, 2.0);
      const DType want =
          da == db ? da : (da == DType::kF64 || db == DType::kF64 ? DType::kF64 : DType::kF32);
      REQUIRE(r.dtype() == want);
      const Tol tol = tol_for(want);
      check_close(r, expected, tol.rtol, tol.atol, "mixed add");
      ++mixed;
    }
  }
  REQUIRE(mixed == 16);
  // Gradient accumulation into an f32 buffer from bf16 values.
  Tensor g = Tensor::full({3, 4}, 1.0, DType::kF32);
  add_out(g, g, Tensor::full({3, 4}, 0.5, DType::kBF16));
  REQUIRE(g.to_vector() == std::vector<double>(12, 1.5));
}

TEST_CASE("expand and broadcast_shapes follow torch", "[kernels][ops][elementwise]") {
  REQUIRE(broadcast_shapes({4, 1, 3}, {5, 1}) == Dims{4, 5, 3});
  REQUIRE(broadcast_shapes({}, {2}) == Dims{2});
  REQUIRE(broadcast_shapes({0, 1}, {1, 3}) == Dims{0, 3});
  REQUIRE_THROWS_WITH(broadcast_shapes({4, 3}, {2, 3}),
                      Contains("shapes [4,3] and [2,3] do not broadcast: dim 0"));
  const Tensor t = Tensor::arange({3, 1}, DType::kF32);
  const Tensor e = expand(t, {2, 3, 4});
  REQUIRE(e.shape() == Dims{2, 3, 4});
  REQUIRE(e.strides() == Dims{0, 1, 0});
  REQUIRE(e.item({1, 2, 3}) == 2.0);
  REQUIRE(expand(t, {-1, 5}).shape() == Dims{3, 5});
  REQUIRE_THROWS_WITH(expand(t, {4, 2}), Contains("dim 0 has size 3 (expected 4 or 1)"));
}

TEST_CASE("element-wise ops reject bad arguments", "[kernels][ops][elementwise]") {
  const Tensor a = Tensor::zeros({4, 5}, DType::kF32);
  REQUIRE(add(a, Tensor::zeros({4, 5}, DType::kBF16)).dtype() == DType::kF32);
  REQUIRE(mul(Tensor::zeros({1}, DType::kF16), Tensor::zeros({1}, DType::kBF16)).dtype() ==
          DType::kF32);
  REQUIRE(add(a, Tensor::zeros({1}, DType::kF64)).dtype() == DType::kF64);
  REQUIRE_THROWS_WITH(gelu_backward(a, Tensor::zeros({4, 5}, DType::kBF16)),
                      Contains("x has dtype bf16 but dy has f32"));
  REQUIRE_THROWS_WITH(gelu_backward(a, Tensor::zeros({5}, DType::kF32)),
                      Contains("dy has shape [4,5] but x has [5]"));
  REQUIRE_THROWS_WITH(silu(Tensor::zeros({3}, DType::kI64)),
                      Contains("x has dtype i64, expected f32, f64, bf16 or f16"));
  REQUIRE_THROWS_WITH(add_out(Tensor::zeros({4, 4}, DType::kF32), a, a),
                      Contains("out has shape [4,4], expected [4,5]"));
  // Interleaved views of one buffer that share no element are fine (even <- odd columns).
  Tensor inter = Tensor::arange({3, 8}, DType::kF32);
  Tensor even = inter.as_strided({3, 4}, {8, 2}, 0), odd = inter.as_strided({3, 4}, {8, 2}, 1);
  add_out(even, odd, odd);
  REQUIRE(inter.item({2, 6}) == 2 * 23.0);
  REQUIRE(inter.item({2, 7}) == 23.0);
  REQUIRE_THROWS_WITH(add_out(inter.narrow(1, 0, 4), inter.narrow(1, 2, 4), odd),
                      Contains("out overlaps an input"));
  Tensor big = Tensor::zeros({8}, DType::kF32);
  REQUIRE_THROWS_WITH(add_out(big.narrow(0, 1, 4), big.narrow(0, 0, 4), big.narrow(0, 0, 4)),
                      Contains("out overlaps an input without being the same view"));
  REQUIRE_THROWS_WITH(
      scale_out(expand(Tensor::zeros({1}, DType::kF32), {3}), Tensor::zeros({3}, DType::kF32), 2.0),
      Contains("out has stride 0 on dim 0"));
}
