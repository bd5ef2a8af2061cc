// Copies with casts between every dtype pair and any strides, fills, and comparisons.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <vector>

#include "kernels/format.h"
#include "kernels/tensor.h"

using namespace kernels;
using Catch::Contains;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// What one element converts to: the value stored by a 0-d tensor of `dtype` filled with x.
double converted(double x, DType dtype) { return Tensor::full({}, x, dtype).item({}); }

// A [4,6] non-contiguous view (strides [1,9], offset 11) of a [7,9] tensor filled with -99.
Tensor strided_source(DType dtype) {
  Tensor base = Tensor::empty({7, 9}, dtype);
  base.fill_(-99);
  Tensor v = base.narrow(0, 1, 6).narrow(1, 2, 4).transpose(0, 1);  // [4,6] strides [1,9]
  v.fill_index_([](std::span<const int64_t> i) {
    const double k = static_cast<double>(i[0] * 6 + i[1]);
    return (k - 10) * 0.75;  // negatives, fractions and ties for the narrow formats
  });
  return v;
}

}  // namespace

TEST_CASE("copy_ between every dtype pair, contiguous and strided", "[kernels][tensor][copy]") {
  for (DType src_dtype : kAllDTypes) {
    for (DType dst_dtype : kAllDTypes) {
      INFO(to_string(src_dtype) << " -> " << to_string(dst_dtype));
      const Tensor strided = strided_source(src_dtype);
      REQUIRE_FALSE(strided.is_contiguous());
      const Tensor packed = strided.contiguous();
      REQUIRE(packed.is_contiguous());
      REQUIRE_FALSE(packed.shares_storage_with(strided));
      const std::vector<double> src_values = strided.to_vector();
      REQUIRE(packed.to_vector() == src_values);

      std::vector<double> expected;
      for (double x : src_values) expected.push_back(converted(x, dst_dtype));

      // contiguous -> contiguous (the memcpy / Eigen / tight-loop paths)
      const Tensor a = packed.to(dst_dtype);
      CHECK(a.dtype() == dst_dtype);
      CHECK(a.to_vector() == expected);
      // strided -> contiguous
      CHECK(strided.to(dst_dtype).to_vector() == expected);
      // strided -> strided destination (a transposed view of a bigger buffer)
      Tensor big = Tensor::zeros({6, 5}, dst_dtype);
      Tensor dst = big.narrow(1, 1, 4).transpose(0, 1);  // [4,6]
      dst.copy_(strided);
      CHECK(dst.to_vector() == expected);
      for (int64_t i = 0; i < 6; ++i) CHECK(big.item({i, 0}) == 0.0);  // untouched column
      // contiguous -> strided destination
      dst.fill_(0);
      dst.copy_(packed);
      CHECK(dst.to_vector() == expected);
    }
  }
}

TEST_CASE("cast semantics", "[kernels][tensor][copy]") {
  SECTION("float -> integer truncates toward zero, saturates, NaN -> 0") {
    Tensor f = Tensor::from_vector({2.7, -2.7, 0.5, -0.5, kNaN, 1e30, -1e30}, {7}, DType::kF64);
    CHECK(f.to(DType::kI64).to_vector() ==
          std::vector<double>{2, -2, 0, 0, 0, 9223372036854775807.0, -9223372036854775808.0});
    CHECK(f.narrow(0, 0, 5).to(DType::kI32).to_vector() == std::vector<double>{2, -2, 0, 0, 0});
  }
  SECTION("to u8 wraps modulo 256 like PyTorch") {
    Tensor f = Tensor::from_vector({-1, 255, 256, 300.9}, {4}, DType::kF32);
    CHECK(f.to(DType::kU8).to_vector() == std::vector<double>{255, 255, 0, 44});
    Tensor i = Tensor::from_vector({-1, 257, 128}, {3}, DType::kI32);
    CHECK(i.to(DType::kU8).to_vector() == std::vector<double>{255, 1, 128});
    CHECK(i.to(DType::kU8).to(DType::kI64).to_vector() == std::vector<double>{255, 1, 128});
  }
  SECTION("integers go to float through double") {
    Tensor i = Tensor::empty({2}, DType::kI64);
    i.data<int64_t>()[0] = 16777217;                // 2^24 + 1: not a float
    i.data<int64_t>()[1] = (int64_t{1} << 53) + 1;  // not a double
    CHECK(i.to(DType::kF32).to_vector() == std::vector<double>{16777216, 9007199254740992.0});
    CHECK(i.to(DType::kF64).data<double>()[1] == 9007199254740992.0);
    Tensor j = i.to(DType::kI32);  // wraps
    CHECK(j.data<int32_t>()[0] == 16777217);
    CHECK(i.clone().data<int64_t>()[1] == (int64_t{1} << 53) + 1);  // same dtype: exact
  }
  SECTION("narrow floats round to nearest even through float") {
    Tensor f = Tensor::from_vector(
        {1.0 + std::ldexp(1.0, -8), 1.0 + 3 * std::ldexp(1.0, -8), 65520.0, 1e-9, -0.0}, {5},
        DType::kF64);
    Tensor b = f.to(DType::kBF16);
    CHECK(b.data<BFloat16>()[0].bits == 0x3F80);
    CHECK(b.data<BFloat16>()[1].bits == 0x3F82);
    Tensor h = f.to(DType::kF16);
    CHECK(h.data<Half>()[2].bits == 0x7C00);
    CHECK(h.data<Half>()[3].bits == 0x0000);
    CHECK(h.data<Half>()[4].bits == 0x8000);
    CHECK(f.to(DType::kF8E4M3).to_vector()[2] != f.to(DType::kF8E4M3).to_vector()[2]);  // NaN
    CHECK(std::isinf(f.to(DType::kF8E5M2).to_vector()[2]));
    // f32 -> f16 -> f32 agrees with the scalar bit functions.
    Tensor r = Tensor::from_vector({0.1, 3.14159, -2e-5, 7e4}, {4}, DType::kF32);
    const Tensor r16 = r.to(DType::kF16);
    const Tensor rb = r.to(DType::kBF16);
    for (int64_t k = 0; k < 4; ++k) {
      const float x = r.data<float>()[k];
      CHECK(r16.data<Half>()[k].bits == float_to_f16_bits(x));
      CHECK(rb.data<BFloat16>()[k].bits == float_to_bf16_bits(x));
    }
  }
  SECTION("f32 <-> bf16 contiguous rows (vectorised) equal the scalar bit functions") {
    // Special values (ties both ways, carries into the exponent, overflow to inf, denormals,
    // NaNs with payloads and signs) then pseudo-random bit patterns; 1037 elements so every
    // vector width sees full blocks and a tail, and an odd offset so loads are unaligned.
    std::vector<uint32_t> bits{0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x7F7FFFFFu, 0x7F7F8000u, 0xFF7F8000u,
                               0x00000001u, 0x80008000u, 0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC12345u,
                               0x7FFFFFFFu, 0x00000000u, 0x80000000u, 0x3F800000u};
    uint64_t z = 12345;
    while (bits.size() < 1037) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      bits.push_back(static_cast<uint32_t>(z >> 32));
    }
    const int64_t n = static_cast<int64_t>(bits.size());
    Tensor f = Tensor::empty({n + 1}, DType::kF32);
    for (int64_t k = 0; k < n; ++k) f.data<float>()[k + 1] = std::bit_cast<float>(bits[static_cast<size_t>(k)]);
    const Tensor src = f.narrow(0, 1, n);
    Tensor b = Tensor::empty({n + 1}, DType::kBF16);
    Tensor bv = b.narrow(0, 1, n);
    bv.copy_(src);
    Tensor back = Tensor::empty({n}, DType::kF32);
    back.copy_(bv);
    int checked = 0;
    for (int64_t k = 0; k < n; ++k) {
      const float x = src.data<float>()[k];
      const uint16_t want = float_to_bf16_bits(x);
      INFO("element " << k << " bits " << bits[static_cast<size_t>(k)]);
      CHECK(bv.data<BFloat16>()[k].bits == want);
      CHECK(std::bit_cast<uint32_t>(back.data<float>()[k]) == std::bit_cast<uint32_t>(bf16_bits_to_float(want)));
      ++checked;
    }
    CHECK(checked == 1037);
  }
  SECTION("f64 <-> f32 round to nearest") {
    Tensor d = Tensor::from_vector({0.1, 1.0 / 3, 1e300}, {3}, DType::kF64);
    const Tensor f = d.to(DType::kF32);
    CHECK(f.data<float>()[0] == 0.1f);
    CHECK(f.data<float>()[1] == static_cast<float>(1.0 / 3));
    CHECK(std::isinf(f.data<float>()[2]));
    CHECK(f.to(DType::kF64).data<double>()[0] == static_cast<double>(0.1f));
  }
  SECTION("NaN across dtypes keeps its sign, not its payload") {
    Tensor f = Tensor::empty({3}, DType::kF32);
    f.data<float>()[0] = std::bit_cast<float>(0x7F800001u);  // signalling, payload 1
    f.data<float>()[1] = std::bit_cast<float>(0xFFC12345u);  // negative, payload
    f.data<float>()[2] = 1.0f;
    {
      const Tensor d = f.to(DType::kF64);
      CHECK(std::bit_cast<uint64_t>(d.data<double>()[0]) == 0x7FF8000000000000ull);
      CHECK(std::bit_cast<uint64_t>(d.data<double>()[1]) == 0xFFF8000000000000ull);
      const Tensor back = d.to(DType::kF32);
      CHECK(std::bit_cast<uint32_t>(back.data<float>()[0]) == 0x7FC00000u);
      CHECK(std::bit_cast<uint32_t>(back.data<float>()[1]) == 0xFFC00000u);
      CHECK(d.to(DType::kBF16).data<BFloat16>()[1].bits == 0xFFC0);
      CHECK(d.to(DType::kF16).data<Half>()[1].bits == 0xFE00);
      CHECK(d.to(DType::kF8E4M3).data<Float8E4M3>()[1].bits == 0xFF);
      CHECK(d.to(DType::kF8E5M2).data<Float8E5M2>()[0].bits == 0x7F);
      CHECK(d.to(DType::kI32).to_vector()[1] == 0.0);
    }
    // The strided path gives the same bits as the contiguous one.
    Tensor wide = Tensor::zeros({3, 2}, DType::kF64);
    wide.select(1, 0).copy_(f);
    CHECK(std::bit_cast<uint64_t>(wide.data<double>()[2]) == 0xFFF8000000000000ull);
  }
  SECTION("same-dtype copies keep NaN payloads") {
    Tensor b = Tensor::empty({2}, DType::kBF16);
    b.data<BFloat16>()[0].bits = 0x7F81;  // signalling NaN
    b.data<BFloat16>()[1].bits = 0xFFFF;
    Tensor c = b.as_strided({2}, {1}, 0).clone();
    CHECK(c.data<BFloat16>()[0].bits == 0x7F81);
    CHECK(c.data<BFloat16>()[1].bits == 0xFFFF);
    Tensor wide = Tensor::zeros({2, 2}, DType::kBF16);
    wide.select(1, 1).copy_(b);  // strided same-dtype path
    CHECK(wide.data<BFloat16>()[1].bits == 0x7F81);
  }
}

TEST_CASE("contiguous, clone and to", "[kernels][tensor][copy]") {
  Tensor t = Tensor::arange({3, 4}, DType::kF32);
  CHECK(t.contiguous().shares_storage_with(t));
  Tensor c = t.clone();
  CHECK_FALSE(c.shares_storage_with(t));
  CHECK(equal(c, t));
  c.set_item({0, 0}, 5);
  CHECK(t.item({0, 0}) == 0.0);
  Tensor tt = t.transpose(0, 1);
  Tensor tc = tt.contiguous();
  CHECK_FALSE(tc.shares_storage_with(t));
  CHECK(tc.strides() == Dims{3, 1});
  CHECK(equal(tc, tt));
  CHECK(tc.storage_offset() == 0);
  // A view with size-1 dims and odd strides is still contiguous.
  Tensor odd = t.narrow(0, 1, 1).as_strided({1, 4}, {100, 1}, 4);
  CHECK(odd.is_contiguous());
  Tensor moved = t.to(Device::cpu());
  CHECK_FALSE(moved.shares_storage_with(t));
  CHECK(equal(moved, t));
  Tensor same_dtype = t.to(DType::kF32);
  CHECK_FALSE(same_dtype.shares_storage_with(t));
  // Zero-size tensors copy trivially.
  Tensor none = Tensor::empty({0, 3}, DType::kF32);
  CHECK(none.clone().numel() == 0);
  CHECK(none.to(DType::kBF16).shape() == Dims{0, 3});
}

TEST_CASE("copy_ checks shapes and handles overlap", "[kernels][tensor][copy]") {
  Tensor t = Tensor::arange({10}, DType::kI32);
  REQUIRE_THROWS_AS(t.copy_(Tensor::arange({9}, DType::kI32)), InvalidArgument);
  REQUIRE_THROWS_WITH(t.copy_(Tensor::arange({2, 5}, DType::kI32)),
                      "copy_: source shape [2,5] does not match destination shape [10]");
  REQUIRE_THROWS_WITH(t.copy_(Tensor()), "copy_: source is undefined");
  Tensor undefined;
  REQUIRE_THROWS_WITH(undefined.copy_(t), "copy_: destination is undefined");

  // Overlapping views of one storage: the source is read before it is overwritten.
  t.narrow(0, 1, 9).copy_(t.narrow(0, 0, 9));
  CHECK(t.to_vector() == std::vector<double>{0, 0, 1, 2, 3, 4, 5, 6, 7, 8});
  Tensor u = Tensor::arange({10}, DType::kI32);
  u.narrow(0, 0, 9).copy_(u.narrow(0, 1, 9));
  CHECK(u.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 9});
  // Square transpose in place.
  Tensor m = Tensor::arange({3, 3}, DType::kF32);
  m.copy_(m.transpose(0, 1));
  CHECK(m.to_vector() == std::vector<double>{0, 3, 6, 1, 4, 7, 2, 5, 8});
  // Self copy is a no-op.
  m.copy_(m);
  CHECK(m.item({0, 1}) == 3.0);
}

TEST_CASE("fill_ and fill_index_", "[kernels][tensor][fill]") {
  for (DType dtype : kAllDTypes) {
    INFO(to_string(dtype));
    Tensor t = Tensor::zeros({4, 5}, dtype);
    Tensor v = t.narrow(1, 1, 3).narrow(0, 1, 2);  // [2,3] inside [4,5]
    v.fill_(3);
    std::vector<double> expected(20, 0.0);
    for (int i = 1; i < 3; ++i)
      for (int j = 1; j < 4; ++j) expected[static_cast<size_t>(i * 5 + j)] = 3;
    CHECK(t.to_vector() == expected);
    t.fill_(-2.5);
    CHECK(t.item({3, 4}) == converted(-2.5, dtype));

    // Each element set from its own multi-index, through a permuted view.
    Tensor base = Tensor::zeros({3, 4}, dtype);
    Tensor p = base.transpose(0, 1);  // [4,3]
    std::vector<std::vector<int64_t>> visited;
    p.fill_index_([&](std::span<const int64_t> i) {
      visited.emplace_back(i.begin(), i.end());
      return static_cast<double>(10 * i[0] + i[1]);
    });
    REQUIRE(visited.size() == 12);
    CHECK(visited.front() == std::vector<int64_t>{0, 0});
    CHECK(visited[1] == std::vector<int64_t>{0, 1});  // row-major over the view
    CHECK(visited.back() == std::vector<int64_t>{3, 2});
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 4; ++j) {
        CHECK(base.item({i, j}) == converted(static_cast<double>(10 * j + i), dtype));
      }
    }
  }
  Tensor scalar = Tensor::zeros({}, DType::kF32);
  scalar.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(i.size()) + 4; });
  CHECK(scalar.item({}) == 4.0);
  Tensor bcast = Tensor::zeros({3}, DType::kF32).as_strided({2, 3}, {0, 1}, 0);
  bcast.fill_(1.5);
  CHECK(bcast.to_vector() == std::vector<double>(6, 1.5));
}

TEST_CASE("equal", "[kernels][tensor][compare]") {
  Tensor a = Tensor::arange({3, 4}, DType::kF32);
  Tensor b = a.transpose(0, 1).contiguous().transpose(0, 1);  // same values, other strides
  CHECK(b.strides() == Dims{1, 3});
  CHECK(equal(a, b));
  CHECK(equal(a.narrow(1, 1, 2), b.narrow(1, 1, 2)));
  b.set_item({2, 3}, 0.5);
  CHECK_FALSE(equal(a, b));
  CHECK_FALSE(equal(a, a.view({4, 3})));  // shapes differ
  CHECK(equal(Tensor::empty({0}, DType::kF32), Tensor::empty({0}, DType::kF32)));

  Tensor nan = Tensor::from_vector({1, kNaN}, {2});
  CHECK_FALSE(equal(nan, nan));  // NaN != NaN, as torch.equal
  CHECK(equal(Tensor::from_vector({-0.0}, {1}), Tensor::from_vector({0.0}, {1})));

  REQUIRE_THROWS_AS(equal(a, a.to(DType::kBF16)), InvalidArgument);
  REQUIRE_THROWS_WITH(equal(a, a.to(DType::kBF16)), Contains("dtypes f32 and bf16 differ"));
  CHECK(equal(a, a.to(DType::kBF16), true));
  CHECK(equal(a, Tensor::arange({3, 4}, DType::kI64), true));
  CHECK_FALSE(
      equal(Tensor::from_vector({0.5}, {1}), Tensor::from_vector({0}, {1}, DType::kI32), true));
  CHECK(equal(Tensor::arange({5}, DType::kU8), Tensor::arange({5}, DType::kI64), true));

  Tensor big = Tensor::empty({1}, DType::kI64);
  big.data<int64_t>()[0] = (int64_t{1} << 53) + 1;
  Tensor big2 = Tensor::empty({1}, DType::kI64);
  big2.data<int64_t>()[0] = int64_t{1} << 53;
  CHECK_FALSE(equal(big, big2));  // exact for integers
  CHECK(equal(a.to(DType::kF8E5M2), a.to(DType::kF8E5M2)));
  REQUIRE_THROWS_WITH(equal(Tensor(), a), Contains("undefined"));
}

TEST_CASE("allclose", "[kernels][tensor][compare]") {
  Tensor a = Tensor::from_vector({1.0, 2.0, -3.0, 0.0}, {4}, DType::kF64);
  Tensor b = Tensor::from_vector({1.0 + 1e-6, 2.0, -3.0, 1e-9}, {4}, DType::kF64);
  CHECK(allclose(a, b));
  CHECK(allclose(a, a));
  Tensor c = Tensor::from_vector({1.001, 2.0, -3.0, 0.0}, {4}, DType::kF64);
  CHECK_FALSE(allclose(a, c));
  CHECK(allclose(a, c, 1e-2));
  CHECK(allclose(a, c, 0, 0.01));
  // Mixed dtypes and strides.
  Tensor m = Tensor::arange({3, 4}, DType::kF32);
  CHECK(allclose(m, m.to(DType::kBF16)));
  CHECK(allclose(m.transpose(0, 1), m.transpose(0, 1).contiguous().to(DType::kF64)));
  CHECK(allclose(m, m.to(DType::kI32)));
  Tensor tenth = Tensor::full({8}, 0.1, DType::kF32);
  CHECK_FALSE(allclose(tenth, tenth.to(DType::kBF16), 1e-5, 1e-8));
  CHECK(allclose(tenth, tenth.to(DType::kBF16), 1e-2, 0));

  Tensor inf = Tensor::from_vector({kInf, -kInf, 1}, {3});
  CHECK(allclose(inf, inf));
  CHECK_FALSE(allclose(inf, Tensor::from_vector({kInf, kInf, 1}, {3})));
  CHECK_FALSE(allclose(Tensor::from_vector({1}, {1}), Tensor::from_vector({kInf}, {1}), 1.0, 1.0));
  Tensor nan = Tensor::from_vector({1, kNaN}, {2});
  CHECK_FALSE(allclose(nan, nan));
  CHECK(allclose(nan, nan, 1e-5, 1e-8, true));
  CHECK_FALSE(allclose(nan, Tensor::from_vector({1, 2}, {2}), 1e-5, 1e-8, true));
  // Asymmetric like torch: the tolerance scales with |b|.
  Tensor x = Tensor::from_vector({1.0}, {1}, DType::kF64);
  Tensor y = Tensor::from_vector({1.1}, {1}, DType::kF64);
  CHECK(allclose(x, y, 0.095, 0));
  CHECK_FALSE(allclose(y, x, 0.095, 0));

  REQUIRE_THROWS_AS(allclose(a, m), InvalidArgument);
  REQUIRE_THROWS_WITH(allclose(a, m), "allclose: shapes [4] and [3,4] differ");
  REQUIRE_THROWS_WITH(allclose(a, a, -1.0), Contains("rtol -1"));
}

TEST_CASE("large strided copies agree with element-wise reads", "[kernels][tensor][copy]") {
  Tensor base = Tensor::arange({2, 3, 40, 50}, DType::kF32);
  Tensor v = base.permute({3, 1, 0, 2}).narrow(0, 5, 40).narrow(3, 1, 37);  // [40,3,2,37]
  const Tensor out = v.to(DType::kF16);
  REQUIRE(out.is_contiguous());
  int64_t bad = 0;
  for (int64_t a = 0; a < 40; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 2; ++c)
        for (int64_t d = 0; d < 37; ++d) {
          const double expected = converted(base.item({c, b, d + 1, a + 5}), DType::kF16);
          if (out.item({a, b, c, d}) != expected) ++bad;
        }
  CHECK(bad == 0);
  CHECK(equal(v.contiguous(), v));
  CHECK(allclose(out, v, 1e-3, 0));
}

TEST_CASE("transposed copies (tiled path) agree with element-wise reads",
          "[kernels][tensor][copy]") {
  const Tensor m = Tensor::arange({3, 45, 70}, DType::kF32);
  const Tensor mt = m.transpose(1, 2);  // [3,70,45], strides [3150,1,70]
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64, DType::kF8E5M2}) {
    INFO(to_string(dtype));
    const Tensor out = mt.to(dtype);  // contiguous destination, transposed source
    Tensor back = Tensor::zeros({3, 45, 70}, dtype);
    back.transpose(1, 2).copy_(out);  // transposed destination, contiguous source
    int64_t bad = 0;
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t i = 0; i < 70; ++i)
        for (int64_t j = 0; j < 45; ++j) {
          const double expected = converted(m.item({b, j, i}), dtype);
          if (out.item({b, i, j}) != expected) ++bad;
          if (back.item({b, j, i}) != expected) ++bad;
        }
    CHECK(bad == 0);
  }
  // 2-d, with narrow views so that the tiles do not divide the sizes.
  const Tensor big = Tensor::arange({100, 90}, DType::kF64);
  const Tensor src = big.narrow(0, 3, 77).narrow(1, 5, 66).transpose(0, 1);  // [66,77]
  const Tensor out = src.contiguous();
  CHECK(out.item({65, 76}) == big.item({79, 70}));
  CHECK(equal(out, src));
  CHECK(out.transpose(0, 1).contiguous().to_vector() ==
        big.narrow(0, 3, 77).narrow(1, 5, 66).to_vector());
}

namespace {

// Calls f(index) for every multi-index of shape, row-major.
void for_each_index(const Dims& shape, const std::function<void(std::span<const int64_t>)>& f) {
  if (shape.product() == 0) return;
  std::vector<int64_t> idx(static_cast<size_t>(shape.size()), 0);
  for (;;) {
    f(idx);
    int d = shape.size() - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// A copy between views of two base tensors: dst_view(dst_base) <- src_view(src_base).
struct SubBlockCase {
  const char* name;
  Dims src_base, dst_base;
  std::function<Tensor(const Tensor&)> src_view, dst_view;
};

}  // namespace

TEST_CASE("same-dtype copies of sub-blocks (memcpy per row) agree with element-wise reads",
          "[kernels][tensor][copy]") {
  using V = const Tensor&;
  const std::vector<SubBlockCase> cases = {
      {"2-d block -> 2-d block", {37, 53}, {29, 61},
       [](V t) { return t.narrow(0, 3, 20).narrow(1, 5, 31); },
       [](V t) { return t.narrow(0, 7, 20).narrow(1, 29, 31); }},
      {"2-d block -> whole contiguous", {37, 53}, {20, 31},
       [](V t) { return t.narrow(0, 3, 20).narrow(1, 5, 31); }, [](V t) { return t; }},
      {"whole contiguous -> 2-d block", {20, 31}, {37, 53},
       [](V t) { return t; }, [](V t) { return t.narrow(0, 17, 20).narrow(1, 22, 31); }},
      {"3-d, two non-contiguous outer dims", {6, 9, 17}, {5, 7, 13},
       [](V t) { return t.narrow(0, 1, 4).narrow(1, 2, 5).narrow(2, 3, 11); },
       [](V t) { return t.narrow(0, 1, 4).narrow(1, 1, 5).narrow(2, 0, 11); }},
      {"3-d whose outer dims merge", {5, 6, 10}, {3, 6, 8},
       [](V t) { return t.narrow(0, 1, 3).narrow(2, 2, 8); }, [](V t) { return t; }},
      {"3-d with permuted outer dims", {6, 9, 17}, {9, 6, 23},
       [](V t) { return t.permute({1, 0, 2}).narrow(2, 4, 12); },
       [](V t) { return t.narrow(2, 11, 12); }},
      {"rows of one element", {37, 53}, {12, 40},
       [](V t) { return t.narrow(0, 0, 12).narrow(1, 52, 1); }, [](V t) { return t.narrow(1, 3, 1); }},
      {"one row", {37, 53}, {1, 70},
       [](V t) { return t.narrow(0, 36, 1).narrow(1, 2, 50); }, [](V t) { return t.narrow(1, 19, 50); }},
      {"size-1 middle dim", {4, 5, 30}, {4, 1, 26},
       [](V t) { return t.narrow(1, 3, 1).narrow(2, 4, 26); }, [](V t) { return t; }},
      {"empty block", {37, 53}, {37, 53},
       [](V t) { return t.narrow(0, 3, 0).narrow(1, 5, 31); }, [](V t) { return t.narrow(0, 9, 0).narrow(1, 0, 31); }},
  };
  for (DType dtype : kAllDTypes)
    for (const SubBlockCase& c : cases) {
      INFO(c.name << ", " << to_string(dtype));
      Tensor src_base = Tensor::empty(c.src_base, dtype);
      src_base.fill_index_([&](std::span<const int64_t> i) {
        int64_t flat = 0;
        for (size_t d = 0; d < i.size(); ++d) flat = flat * c.src_base[static_cast<int>(d)] + i[d];
        return static_cast<double>((flat * 7) % 97) - 40;  // neighbours differ in every dtype
      });
      Tensor dst_base = Tensor::full(c.dst_base, -99, dtype);
      const Tensor before = dst_base.clone();
      // Which base elements the destination view covers (marked with a fill, not a copy).
      Tensor mask = Tensor::zeros(c.dst_base, DType::kU8);
      c.dst_view(mask).fill_(1);
      const Tensor src = c.src_view(src_base);
      Tensor dst = c.dst_view(dst_base);
      REQUIRE(dst.shape() == src.shape());
      dst.copy_(src);
      int64_t bad = 0;
      for_each_index(src.shape(), [&](std::span<const int64_t> i) {
        if (std::bit_cast<uint64_t>(dst.item(i)) != std::bit_cast<uint64_t>(src.item(i))) ++bad;
      });
      CHECK(bad == 0);
      int64_t clobbered = 0;
      for_each_index(c.dst_base, [&](std::span<const int64_t> i) {
        if (mask.item(i) == 0 && dst_base.item(i) != before.item(i)) ++clobbered;
      });
      CHECK(clobbered == 0);
      // The same block packed into a fresh contiguous tensor.
      CHECK(equal(src.contiguous(), src));
    }
}

TEST_CASE("same-dtype sub-block copies between overlapping views of one tensor", "[kernels][tensor][copy]") {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64, DType::kU8}) {
    INFO(to_string(dtype));
    Tensor t = Tensor::empty({10, 41}, dtype);
    t.fill_index_([](std::span<const int64_t> i) { return static_cast<double>((i[0] * 41 + i[1]) % 101); });
    const Tensor before = t.clone();
    // Shift every row left by one column, then a block down-right by one row and column.
    t.narrow(1, 0, 40).copy_(t.narrow(1, 1, 40));
    int64_t bad = 0;
    for (int64_t r = 0; r < 10; ++r)
      for (int64_t c = 0; c < 41; ++c)
        if (t.item({r, c}) != before.item({r, c < 40 ? c + 1 : c})) ++bad;
    CHECK(bad == 0);
    const Tensor mid = t.clone();
    t.narrow(0, 1, 8).narrow(1, 1, 30).copy_(t.narrow(0, 0, 8).narrow(1, 0, 30));
    for (int64_t r = 0; r < 10; ++r)
      for (int64_t c = 0; c < 41; ++c) {
        const bool moved = r >= 1 && r < 9 && c >= 1 && c < 31;
        if (t.item({r, c}) != (moved ? mid.item({r - 1, c - 1}) : mid.item({r, c}))) ++bad;
      }
    CHECK(bad == 0);
  }
}
