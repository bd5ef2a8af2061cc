// matmul / matmul_out against an f64 triple loop: odd and empty shapes, every dtype, every
// operand layout (transposed, padded, reversed views), alpha/beta, broadcast batches, threads.
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/vec.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/matmul.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

// Batch-broadcast reference: out = alpha * a @ b + beta * c0 (c0 may be empty for beta == 0).
std::vector<double> reference(const Tensor& a, const Tensor& b, const Dims& out_shape, double alpha,
                              double beta, const std::vector<double>& c0) {
  const int nd = out_shape.size();
  const int64_t m = out_shape[nd - 2], n = out_shape[nd - 1], k = a.size(-1);
  std::vector<double> av = a.to_vector(), bv = b.to_vector();
  const int64_t batches = out_shape.product() / std::max<int64_t>(m * n, 1);
  std::vector<double> out(static_cast<size_t>(out_shape.product()));
  if (out.empty()) return out;
  Dims batch_shape = out_shape;
  batch_shape.pop_back();
  batch_shape.pop_back();
  auto operand_index = [&](const Tensor& t, int64_t batch) {
    // Row-major index of t's matrix for this broadcast batch index.
    int64_t idx = 0, mul = 1, rest = batch;
    std::vector<int64_t> coord(static_cast<size_t>(batch_shape.size()));
    for (int d = batch_shape.size() - 1; d >= 0; --d) {
      coord[static_cast<size_t>(d)] = rest % batch_shape[d];
      rest /= batch_shape[d];
    }
    const int tb = t.ndim() - 2;
    for (int d = tb - 1; d >= 0; --d) {
      const int od = batch_shape.size() - tb + d;
      const int64_t c = t.size(d) == 1 ? 0 : coord[static_cast<size_t>(od)];
      idx += c * mul;
      mul *= t.size(d);
    }
    return idx;
  };
  for (int64_t bi = 0; bi < batches; ++bi) {
    const int64_t ao = operand_index(a, bi) * m * k;
    const int64_t bo = operand_index(b, bi) * k * n;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l) s += av[ao + i * k + l] * bv[bo + l * n + j];
        const size_t o = static_cast<size_t>(bi * m * n + i * n + j);
        out[o] = alpha * s + (beta != 0 ? beta * c0[o] : 0.0);
      }
    }
  }
  return out;
}

Dims out_shape_of(const Tensor& a, const Tensor& b) {
  Dims ab = a.shape(), bb = b.shape();
  ab.pop_back(), ab.pop_back(), bb.pop_back(), bb.pop_back();
  Dims s = kernels::broadcast_shapes(ab, bb);
  s.push_back(a.size(-2));
  s.push_back(b.size(-1));
  return s;
}

}  // namespace

TEST_CASE("matmul: 2-D products, every dtype, layout and odd or empty shape",
          "[kernels][ops][matmul]") {
  const std::vector<std::array<int64_t, 3>> shapes = {{0, 3, 4},    {3, 4, 0},   {1, 1, 1},
                                                      {5, 7, 3},    {17, 33, 9}, {2, 1, 5},
                                                      {64, 48, 40}, {130, 70, 3}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const auto& s : shapes) {
      const Tensor a0 = random_tensor({s[0], s[1]}, dt, 11 + s[0]);
      const Tensor b0 = random_tensor({s[1], s[2]}, dt, 23 + s[2]);
      const auto expected = reference(a0, b0, {s[0], s[2]}, 1.0, 0.0, {});
      const Tol tol = tol_for(dt, static_cast<double>(s[1]));
      for (int la = 0; la < kLayouts; ++la) {
        for (int lb = 0; lb < kLayouts; ++lb) {
          const Tensor a = relayout(a0, la), b = relayout(b0, lb);
          INFO(describe(a) << " @ " << describe(b));
          check_close(matmul(a, b), expected, tol.rtol, tol.atol, "matmul");
          ++cases;
        }
      }
    }
  }
  REQUIRE(cases == 4 * 8 * 16);
}

TEST_CASE("matmul_out: alpha, beta accumulation and strided outputs", "[kernels][ops][matmul]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const bool narrow = dt == DType::kBF16 || dt == DType::kF16;
    std::vector<DType> out_dtypes = {dt};
    if (narrow) out_dtypes.push_back(DType::kF32);
    for (DType out_dt : out_dtypes) {
      for (auto [alpha, beta] :
           std::vector<std::pair<double, double>>{{1, 0}, {0.5, 1}, {-2, 0.25}}) {
        for (auto k : {int64_t{0}, int64_t{1}, int64_t{19}}) {
          const Tensor a = relayout(random_tensor({13, k}, dt, 5), 1);
          const Tensor b = random_tensor({k, 6}, dt, 6);
          const Tensor c0 = random_tensor({13, 6}, out_dt, 7);
          const auto expected = reference(a, b, {13, 6}, alpha, beta, c0.to_vector());
          const Tol tol = tol_for(out_dt == DType::kF32 && narrow ? DType::kF32 : dt, 19);
          for (int lc = 0; lc < kLayouts; ++lc) {
            Tensor c = relayout(c0, lc);
            if (beta == 0) c.fill_(std::nan(""));  // beta 0 ignores old contents, NaN included
            INFO(describe(c) << " alpha " << alpha << " beta " << beta << " k " << k);
            matmul_out(c, a, b, {.alpha = alpha, .beta = beta});
            check_close(c, expected, tol.rtol, tol.atol, "matmul_out");
            ++cases;
          }
          // An out that is neither row- nor column-major (every other column of a wider tensor).
          Tensor wide = Tensor::zeros({13, 12}, out_dt);
          Tensor c = wide.as_strided({13, 6}, {12, 2}, 0);
          c.copy_(c0);
          matmul_out(c, a, b, {.alpha = alpha, .beta = beta});
          check_close(c, expected, tol.rtol, tol.atol, "matmul_out, strided columns");
          ++cases;
        }
      }
    }
  }
  REQUIRE(cases == (4 + 2) * 3 * 3 * (kLayouts + 1));
}

TEST_CASE("matmul: broadcast batches, folded rows and attention-style views",
          "[kernels][ops][matmul]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = tol_for(dt, 16);
    struct Case {
      Dims a, b;
    };
    const std::vector<Case> cases_list = {
        {{2, 3, 5, 4}, {3, 4, 6}},                          // b broadcast over the leading dim
        {{2, 1, 5, 4}, {1, 3, 4, 6}},                       // both broadcast
        {{4, 7, 16}, {16, 9}},                              // a Linear: rows fold into one GEMM
        {{3, 5, 4}, {4, 6}},          {{0, 5, 4}, {4, 6}},  // empty batch
        {{2, 5, 4}, {2, 4, 6}},       {{1, 1, 4}, {3, 4, 1}}};
    for (const Case& c : cases_list) {
      const Tensor a0 = random_tensor(c.a, dt, 31), b0 = random_tensor(c.b, dt, 32);
      const Dims os = out_shape_of(a0, b0);
      const auto expected = reference(a0, b0, os, 1.0, 0.0, {});
      for (int la = 0; la < kLayouts; ++la) {
        const Tensor a = relayout(a0, la), b = relayout(b0, (la + 1) % kLayouts);
        INFO(describe(a) << " @ " << describe(b));
        check_close(matmul(a, b), expected, tol.rtol, tol.atol, "batched matmul");
        Tensor out = relayout(Tensor::zeros(os, dt), (la + 2) % kLayouts);
        matmul_out(out, a, b);
        check_close(out, expected, tol.rtol, tol.atol, "batched matmul_out");
        ++cases;
      }
    }
    // q @ k^T on heads sliced from a fused [B, T, 3, H, E] projection, and P @ v.
    const Tensor qkv = random_tensor({2, 5, 3, 2, 4}, dt, 77);
    const Tensor q = qkv.select(2, 0).transpose(1, 2), k = qkv.select(2, 1).transpose(1, 2),
                 v = qkv.select(2, 2).transpose(1, 2);  // [B, H, T, E] views
    const Tensor kt = k.transpose(-1, -2);
    check_close(matmul(q, kt), reference(q, kt, {2, 2, 5, 5}, 1.0, 0.0, {}), tol.rtol, tol.atol,
                "q @ k^T");
    const Tensor p = random_tensor({2, 2, 5, 5}, dt, 78);
    check_close(matmul(p, v), reference(p, v, {2, 2, 5, 4}, 1.0, 0.0, {}), tol.rtol, tol.atol,
                "P @ v");
    cases += 2;
  }
  REQUIRE(cases == 4 * (7 * kLayouts + 2));
  // Broadcast rows (stride 0) read in place.
  const Tensor row = random_tensor({1, 6}, DType::kF32, 4),
               w = random_tensor({6, 5}, DType::kF32, 5);
  const Tensor e = expand(row, {7, 6});
  check_close(matmul(e, w), reference(e.contiguous(), w, {7, 5}, 1.0, 0.0, {}), 1e-5, 1e-6,
              "expanded rows");
}

TEST_CASE("matmul: num_threads splits give the same product", "[kernels][ops][matmul]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (auto shape : std::vector<std::array<int64_t, 4>>{
             {1, 300, 64, 40}, {1, 16, 64, 500}, {3, 70, 64, 90}, {5, 33, 17, 21}}) {
      const Tensor a = random_tensor({shape[0], shape[1], shape[2]}, dt, 41);
      const Tensor b = relayout(random_tensor({shape[2], shape[3]}, dt, 42), 1);
      const Tensor c0 = random_tensor({shape[0], shape[1], shape[3]}, dt, 43);
      const auto expected = reference(a, b, c0.shape(), 1.5, 1.0, c0.to_vector());
      const Tol tol = tol_for(dt, 64);
      for (int threads : {1, 2, 3}) {
        Tensor c = c0.clone();
        matmul_out(c, a, b, {.alpha = 1.5, .beta = 1.0, .num_threads = threads});
        check_close(c, expected, tol.rtol, tol.atol, "threads " + std::to_string(threads));
        ++cases;
      }
    }
  }
  REQUIRE(cases == 4 * 4 * 3);
}

TEST_CASE("matmul: every ISA variant of this CPU gives the same product",
          "[kernels][ops][matmul]") {
  using detail::Isa;
  int variants = 0;
  for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    const detail::VecKernels* k = detail::vec_kernels_for(isa);
    if (k == nullptr) continue;
    ++variants;
    const Tensor a = random_tensor({37, 29}, DType::kF32, 1);
    const Tensor b = random_tensor({29, 41}, DType::kF32, 2);
    Tensor c = Tensor::zeros({37, 41}, DType::kF32);
    detail::GemmArgs<float> g;
    g.m = 37, g.n = 41, g.k = 29;
    g.a = a.data<float>(), g.a_rs = 29, g.a_cs = 1;
    g.b = b.data<float>(), g.b_rs = 41, g.b_cs = 1;
    g.c = c.data<float>(), g.c_rs = 41;
    k->f32.gemm(g);
    INFO(detail::to_string(isa));
    check_close(c, reference(a, b, {37, 41}, 1.0, 0.0, {}), 2e-5, 6e-5, "gemm variant");
  }
  REQUIRE(variants >= 1);
}

TEST_CASE("matmul: invalid arguments are named", "[kernels][ops][matmul]") {
  const Tensor a = Tensor::zeros({3, 4}, DType::kF32);
  REQUIRE_THROWS_WITH(matmul(a, Tensor::zeros({5, 2}, DType::kF32)),
                      Contains("a has 4 columns but b has 5 rows"));
  REQUIRE_THROWS_WITH(matmul(a, Tensor::zeros({4, 2}, DType::kF64)),
                      Contains("b has dtype f64 but a has f32"));
  REQUIRE_THROWS_WITH(matmul(a, Tensor::zeros({4}, DType::kF32)), Contains("at least 2 dims"));
  REQUIRE_THROWS_WITH(
      matmul(Tensor::zeros({2, 3, 4}, DType::kF32), Tensor::zeros({3, 4, 2}, DType::kF32)),
      Contains("do not broadcast"));
  REQUIRE_THROWS_WITH(
      matmul(Tensor::zeros({3, 4}, DType::kI32), Tensor::zeros({4, 2}, DType::kI32)),
      Contains("a has dtype i32, expected f32, f64, bf16 or f16"));
  REQUIRE_THROWS_AS(matmul(Tensor::zeros({3, 4}, DType::kI32), Tensor::zeros({4, 2}, DType::kI32)),
                    Unsupported);
  REQUIRE_THROWS_WITH(
      matmul_out(Tensor::zeros({3, 3}, DType::kF32), a, Tensor::zeros({4, 2}, DType::kF32)),
      Contains("out has shape [3,3], expected [3,2]"));
  REQUIRE_THROWS_WITH(
      matmul_out(Tensor::zeros({3, 2}, DType::kF64), a, Tensor::zeros({4, 2}, DType::kF32)),
      Contains("out has dtype f64, expected f32"));
  REQUIRE_THROWS_WITH(
      matmul_out(Tensor::zeros({3, 2}, DType::kF16), Tensor::zeros({3, 4}, DType::kBF16),
                 Tensor::zeros({4, 2}, DType::kBF16)),
      Contains("expected bf16 or f32"));
  Tensor big = Tensor::zeros({4, 4}, DType::kF32);
  REQUIRE_THROWS_WITH(matmul_out(big, big, big), Contains("out overlaps an operand"));
  REQUIRE_THROWS_WITH(matmul(a, Tensor::zeros({4, 2}, DType::kF32), {.beta = 1.0}),
                      Contains("use matmul_out"));
  REQUIRE_THROWS_WITH(matmul_out(Tensor::zeros({3, 2}, DType::kF32), a,
                                 Tensor::zeros({4, 2}, DType::kF32), {.num_threads = 0}),
                      Contains("num_threads is 0"));
}

TEST_CASE("bf16 conversions of every ISA variant match the scalar casts bit for bit",
          "[kernels][ops][matmul]") {
  using detail::Isa;
  // Ties, carries into the exponent, overflow to inf, subnormals, NaN of both signs.
  std::vector<float> values = {0.0f,        -0.0f,         1.0f,           1.00390625f,
                               1.01171875f, 3.3895314e38f, 3.4028235e38f,  1e-40f,
                               -1e-39f,     std::nanf(""), -std::nanf(""), INFINITY,
                               -INFINITY,   0.1f,          -2.5f,          65504.0f};
  for (int i = 0; i < 300; ++i) values.push_back(static_cast<float>(hash_uniform(5, i, -1e6, 1e6)));
  const auto n = static_cast<int64_t>(values.size());
  int variants = 0;
  for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    const detail::VecKernels* k = detail::vec_kernels_for(isa);
    if (k == nullptr) continue;
    ++variants;
    INFO(detail::to_string(isa));
    std::vector<uint16_t> bits(values.size());
    k->f32.narrow_bf16(bits.data(), values.data(), n);
    std::vector<float> back(values.size());
    k->f32.widen_bf16(back.data(), bits.data(), n);
    for (size_t i = 0; i < values.size(); ++i) {
      REQUIRE(bits[i] == float_to_bf16_bits(values[i]));
      const float expected = bf16_bits_to_float(bits[i]);
      REQUIRE(std::memcmp(&back[i], &expected, sizeof(float)) == 0);
    }
  }
  REQUIRE(variants >= 1);
}

TEST_CASE("bf16 products past the native kernel's blocking (k > 512, n > 256, odd tails)",
          "[kernels][ops][matmul]") {
  // On a CPU with AVX512-BF16 these run the native kernel (k blocks of 512, n blocks of 256,
  // 8 x 32 tiles); elsewhere the widened f32 path. Either way: f32 accumulation of exact products.
  const bool native = detail::vec_kernels().f32.gemm_bf16 != nullptr;
  INFO("native bf16 GEMM: " << native);
  int cases = 0;
  for (auto s : std::vector<std::array<int64_t, 3>>{
           {9, 1025, 33}, {17, 3, 300}, {1, 1, 1}, {40, 600, 257}}) {
    const Tensor a0 = random_tensor({s[0], s[1]}, DType::kBF16, 61);
    const Tensor b0 = random_tensor({s[1], s[2]}, DType::kBF16, 62);
    const Tensor c0 = random_tensor({s[0], s[2]}, DType::kF32, 63);
    const auto expected = reference(a0, b0, {s[0], s[2]}, 0.5, 1.0, c0.to_vector());
    for (int la = 0; la < kLayouts; ++la) {
      for (int lc = 0; lc < 2; ++lc) {
        Tensor c = relayout(c0, lc);
        matmul_out(c, relayout(a0, la), relayout(b0, (la + 1) % kLayouts),
                   {.alpha = 0.5, .beta = 1.0});
        check_close(c, expected, 1e-5, 2e-6 * static_cast<double>(s[1]), "bf16 -> f32 out");
        ++cases;
      }
      const Tensor r = matmul(relayout(a0, la), b0);
      check_close(r, reference(a0, b0, {s[0], s[2]}, 1.0, 0.0, {}), 1e-2, 1e-2, "bf16 -> bf16 out");
    }
  }
  REQUIRE(cases == 4 * kLayouts * 2);
}
