#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/error.h"
#include "kernels/reduce.h"

using namespace kernels;

TEST_CASE("reduce_into: every dtype and op, exact small integers", "[kernels][reduce]") {
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};
  for (DType dtype : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kI32, DType::kI64,
                      DType::kU8, DType::kF8E4M3, DType::kF8E5M2})
    for (ReduceOp op : ops) {
      INFO(to_string(dtype) << " " << to_string(op));
      const int64_t n = 37;
      Tensor acc = Tensor::empty({n}, dtype), src = Tensor::empty({n}, dtype);
      acc.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(i[0] % 5); });
      src.fill_index_([](std::span<const int64_t> i) { return static_cast<double>((i[0] * 3) % 4); });
      reduce_into(acc, src, op);
      for (int64_t i = 0; i < n; ++i) {
        const double a = i % 5, b = (i * 3) % 4;
        double want = op == ReduceOp::kMin ? std::min(a, b)
                      : op == ReduceOp::kMax ? std::max(a, b)
                      : op == ReduceOp::kProd ? a * b
                                              : a + b;
        // The exact result rounded once to the dtype (fp8 e5m2 cannot hold 9, say).
        CHECK(acc.item({i}) == Tensor::full({1}, want, dtype).item({0}));
      }
    }
}

TEST_CASE("reduce_into: narrow floats round to nearest even, NaN propagates", "[kernels][reduce]") {
  // bf16 has 8 significant bits: 256 + 1 is a tie between 256 and 258 -> 256 (even).
  Tensor a = Tensor::full({1}, 256, DType::kBF16), b = Tensor::full({1}, 1, DType::kBF16);
  reduce_into(a, b, ReduceOp::kSum);
  CHECK(a.item({0}) == 256);
  Tensor c = Tensor::full({1}, 258, DType::kBF16), d = Tensor::full({1}, 1, DType::kBF16);
  reduce_into(c, d, ReduceOp::kSum);  // 259 is a tie between 258 and 260 -> 260 (even mantissa)
  CHECK(c.item({0}) == 260);
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    Tensor x = Tensor::from_vector({1.0, NAN, 3.0}, {3}), y = Tensor::from_vector({NAN, 2.0, 1.0}, {3});
    reduce_into(x, y, op);
    CHECK(std::isnan(x.item({0})));
    CHECK(std::isnan(x.item({1})));
    CHECK(x.item({2}) == (op == ReduceOp::kMin ? 1.0 : 3.0));
  }
}

TEST_CASE("pre-multiplied sums and scaling", "[kernels][reduce]") {
  Tensor acc = Tensor::from_vector({1, 2, 3}, {3}, DType::kF64);
  Tensor src = Tensor::from_vector({4, 8, 12}, {3}, DType::kF64);
  reduce_into(acc, src, ReduceOp::kSum, 0.25);
  CHECK(acc.to_vector() == std::vector<double>{2, 4, 6});
  scale_(acc, 0.5);
  CHECK(acc.to_vector() == std::vector<double>{1, 2, 3});
  Tensor ints = Tensor::from_vector({7, -7, 5}, {3}, DType::kI32);
  scale_(ints, 0.5);  // truncates toward zero
  CHECK(ints.to_vector() == std::vector<double>{3, -3, 2});
  Tensor h = Tensor::full({2}, 60000, DType::kF16), h2 = Tensor::full({2}, 60000, DType::kF16);
  // A pre-multiplied sum of two inputs as the collectives do it: scale the first, then add the
  // others scaled; 60000 + 60000 would overflow f16 (max 65504), the halves do not.
  scale_(h, 0.5);
  reduce_into(h, h2, ReduceOp::kSum, 0.5);
  CHECK(h.item({0}) == 60000);
}

TEST_CASE("reduce_into rejects mismatched operands", "[kernels][reduce]") {
  Tensor a = Tensor::zeros({4}, DType::kF32);
  CHECK_THROWS_WITH(reduce_into(a, Tensor::zeros({4}, DType::kF64), ReduceOp::kSum),
                    Catch::Contains("f32 on cpu vs f64 on cpu"));
  CHECK_THROWS_AS(reduce_into(a, Tensor::zeros({5}, DType::kF32), ReduceOp::kSum), InvalidArgument);
  CHECK_THROWS_WITH(reduce_into(a, a, ReduceOp::kMax, 2.0), Catch::Contains("pre-multiplier needs a sum"));
  Tensor t = Tensor::zeros({4, 4}, DType::kF32).transpose(0, 1);
  CHECK_THROWS_WITH(reduce_into(t, t, ReduceOp::kSum), Catch::Contains("contiguous"));
  CHECK_THROWS_WITH(scale_(t, 2.0), Catch::Contains("contiguous"));
}

TEST_CASE("reduce_into: bf16 on every code matches float arithmetic rounded once", "[kernels][reduce]") {
  // Long enough for the vectorised path (blocks of 8) and an odd tail; acc takes every bf16 code
  // (zeros, subnormals, infinities, NaNs), src a pseudo-random code, often a neighbour of acc's.
  const int64_t n = 65536 + 7;
  std::vector<uint16_t> a(n), b(n);
  uint64_t x = 88172645463325252ull;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    a[i] = static_cast<uint16_t>(i);
    b[i] = x % 3 == 0 ? static_cast<uint16_t>(a[i] + static_cast<int>(x >> 8) % 5 - 2)
                      : static_cast<uint16_t>(x >> 16);
  }
  struct Case {
    ReduceOp op;
    double scale;
  };
  for (Case c : {Case{ReduceOp::kSum, 1.0}, Case{ReduceOp::kSum, 0.25}, Case{ReduceOp::kProd, 1.0},
                 Case{ReduceOp::kMin, 1.0}, Case{ReduceOp::kMax, 1.0}}) {
    INFO(to_string(c.op) << " x " << c.scale);
    Tensor acc = Tensor::empty({n}, DType::kBF16), src = Tensor::empty({n}, DType::kBF16);
    for (int64_t i = 0; i < n; ++i) {
      acc.data<BFloat16>()[i].bits = a[i];
      src.data<BFloat16>()[i].bits = b[i];
    }
    reduce_into(acc, src, c.op, c.scale);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float fa = bf16_bits_to_float(a[i]), fb = bf16_bits_to_float(b[i]);
      const float m = static_cast<float>(c.scale);
      const float r = c.op == ReduceOp::kSum    ? fa + fb * m
                      : c.op == ReduceOp::kProd ? fa * fb
                      : c.op == ReduceOp::kMin  ? (fb < fa || fb != fb ? fb : fa)
                                                : (fb > fa || fb != fb ? fb : fa);
      const uint16_t want = float_to_bf16_bits(r), got = acc.data<BFloat16>()[i].bits;
      // Which NaN operand propagates is unspecified: any NaN is right where a NaN is expected.
      const bool want_nan = (want & 0x7fff) > 0x7f80, got_nan = (got & 0x7fff) > 0x7f80;
      wrong += want_nan ? !got_nan : got != want;
    }
    CHECK(wrong == 0);
  }
}
