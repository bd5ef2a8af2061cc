// Causal (and full) scaled dot-product attention, forward and backward, against f64 loops and
// finite differences: odd shapes, T != S, no keys, no leading dims, every dtype, strided views
// (heads sliced from a fused QKV projection), threads.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/ops/attention.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

struct AttnRef {
  std::vector<double> out, lse, dq, dk, dv;
};

// Per leading index: S = scale q k^T, causal mask (j > i), softmax, out = P v; and the backward.
AttnRef ref_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                      bool causal, double scale) {
  const int64_t t = q.size(-2), e = q.size(-1), s = k.size(-2), ev = v.size(-1);
  int64_t lead = 1;
  for (int d = 0; d < q.ndim() - 2; ++d) lead *= q.size(d);
  const auto qv = q.to_vector(), kv = k.to_vector(), vv = v.to_vector(), gv = dout.to_vector();
  AttnRef r;
  r.out.assign(static_cast<size_t>(lead * t * ev), 0.0);
  r.lse.assign(static_cast<size_t>(lead * t), -INFINITY);
  r.dq.assign(qv.size(), 0.0);
  r.dk.assign(kv.size(), 0.0);
  r.dv.assign(vv.size(), 0.0);
  for (int64_t b = 0; b < lead; ++b) {
    const double* Q = qv.data() + b * t * e;
    const double* K = kv.data() + b * s * e;
    const double* V = vv.data() + b * s * ev;
    const double* G = gv.data() + b * t * ev;
    std::vector<double> P(static_cast<size_t>(t * s), 0.0);
    for (int64_t i = 0; i < t; ++i) {
      const int64_t valid = causal ? std::min(s, i + 1) : s;
      if (valid == 0) continue;
      double m = -INFINITY;
      std::vector<double> row(static_cast<size_t>(valid));
      for (int64_t j = 0; j < valid; ++j) {
        double d = 0;
        for (int64_t l = 0; l < e; ++l) d += Q[i * e + l] * K[j * e + l];
        row[j] = scale * d;
        m = std::max(m, row[j]);
      }
      double z = 0;
      for (int64_t j = 0; j < valid; ++j) z += std::exp(row[j] - m);
      r.lse[static_cast<size_t>(b * t + i)] = m + std::log(z);
      for (int64_t j = 0; j < valid; ++j) P[i * s + j] = std::exp(row[j] - m) / z;
      for (int64_t c = 0; c < ev; ++c) {
        double o = 0;
        for (int64_t j = 0; j < valid; ++j) o += P[i * s + j] * V[j * ev + c];
        r.out[static_cast<size_t>((b * t + i) * ev + c)] = o;
      }
    }
    // Backward.
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> dp(static_cast<size_t>(s), 0.0);
      double dsum = 0;
      for (int64_t j = 0; j < s; ++j) {
        for (int64_t c = 0; c < ev; ++c) dp[j] += G[i * ev + c] * V[j * ev + c];
        dsum += dp[j] * P[i * s + j];
      }
      for (int64_t j = 0; j < s; ++j) {
        const double ds = P[i * s + j] * (dp[j] - dsum) * scale;
        for (int64_t l = 0; l < e; ++l) {
          r.dq[static_cast<size_t>((b * t + i) * e + l)] += ds * K[j * e + l];
          r.dk[static_cast<size_t>((b * s + j) * e + l)] += ds * Q[i * e + l];
        }
        for (int64_t c = 0; c < ev; ++c)
          r.dv[static_cast<size_t>((b * s + j) * ev + c)] += P[i * s + j] * G[i * ev + c];
      }
    }
  }
  return r;
}

}  // namespace

TEST_CASE("attention forward/backward against f64 loops", "[kernels][ops][attention]") {
  struct Case {
    Dims lead;
    int64_t t, s, e, ev;
  };
  const std::vector<Case> cases_list = {
      {{2, 3}, 5, 5, 4, 4}, {{}, 7, 7, 3, 5},  {{3}, 5, 3, 4, 2},     {{2}, 3, 6, 2, 3},
      {{1, 2}, 4, 0, 3, 3}, {{2}, 0, 4, 3, 3}, {{2, 2}, 33, 33, 8, 8}};
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases_list) {
      auto shape = [&](int64_t m, int64_t n) {
        Dims d = c.lead;
        d.push_back(m);
        d.push_back(n);
        return d;
      };
      const Tensor q0 = random_tensor(shape(c.t, c.e), dt, 121, -1.5, 1.5);
      const Tensor k0 = random_tensor(shape(c.s, c.e), dt, 122, -1.5, 1.5);
      const Tensor v0 = random_tensor(shape(c.s, c.ev), dt, 123);
      const Tensor g0 = random_tensor(shape(c.t, c.ev), dt, 124);
      for (bool causal : {true, false}) {
        const double scale = c.e > 0 ? 1 / std::sqrt(static_cast<double>(c.e)) : 1.0;
        const AttnRef ref = ref_attention(q0, k0, v0, g0, causal, scale);
        Tol tol = tol_for(dt, 16);
        const double gt = dt == DType::kF32 ? 2e-5 : (dt == DType::kF64 ? 1e-10 : 0.03);
        for (int layout = 0; layout < kLayouts; ++layout) {
          const Tensor q = relayout(q0, layout), k = relayout(k0, (layout + 1) % kLayouts),
                       v = relayout(v0, (layout + 2) % kLayouts),
                       g = relayout(g0, (layout + 3) % kLayouts);
          INFO("q " << describe(q) << " k " << describe(k) << " causal " << causal);
          const AttentionOutput a =
              attention(q, k, v, {.causal = causal, .num_threads = layout % 2 + 1});
          REQUIRE(a.lse.dtype() == stats_dtype_of(dt));
          check_close(a.out, ref.out, tol.rtol, tol.atol, "out");
          check_close(a.lse, ref.lse, 1e-5, dt == DType::kF64 ? 1e-12 : 1e-5, "lse");
          // The backward from the rounded forward output, into strided f32 gradients.
          Tensor dq = relayout(Tensor::zeros(q0.shape(), DType::kF32), layout);
          Tensor dk = relayout(Tensor::zeros(k0.shape(), DType::kF32), layout);
          Tensor dv = relayout(Tensor::zeros(v0.shape(), DType::kF32), layout);
          attention_backward_out(dq, dk, dv, g, q, k, v, a.out, a.lse, {.causal = causal});
          check_close(dq, ref.dq, 1e-4, gt, "dq");
          check_close(dk, ref.dk, 1e-4, gt, "dk");
          check_close(dv, ref.dv, 1e-4, gt, "dv");
          const AttentionGrads fg =
              attention_backward(g, q, k, v, a.out, a.lse, {.causal = causal});
          REQUIRE(fg.dq.dtype() == dt);
          check_close(fg.dv, ref.dv, 1e-2, gt * 2, "dv functional");
          ++cases;
        }
      }
    }
  }
  REQUIRE(cases == 4 * 7 * 2 * kLayouts);
}

TEST_CASE("attention on heads sliced from a fused QKV projection", "[kernels][ops][attention]") {
  const int64_t b = 2, t = 6, h = 3, e = 4;
  const Tensor qkv = random_tensor({b, t, 3, h, e}, DType::kF32, 131);
  const Tensor q = qkv.select(2, 0).transpose(1, 2), k = qkv.select(2, 1).transpose(1, 2),
               v = qkv.select(2, 2).transpose(1, 2);  // [B, H, T, E] strided views
  const Tensor g = random_tensor({b, h, t, e}, DType::kF32, 132);
  const AttnRef ref = ref_attention(q.contiguous(), k.contiguous(), v.contiguous(), g, true, 0.5);
  const AttentionOutput a = attention(q, k, v, {.scale = 0.5});
  check_close(a.out, ref.out, 1e-5, 1e-6, "out");
  Tensor dqkv = Tensor::zeros({b, t, 3, h, e}, DType::kF32);
  attention_backward_out(dqkv.select(2, 0).transpose(1, 2), dqkv.select(2, 1).transpose(1, 2),
                         dqkv.select(2, 2).transpose(1, 2), g, q, k, v, a.out, a.lse,
                         {.scale = 0.5});
  check_close(dqkv.select(2, 0).transpose(1, 2), ref.dq, 1e-4, 1e-5, "dq slice");
  check_close(dqkv.select(2, 1).transpose(1, 2), ref.dk, 1e-4, 1e-5, "dk slice");
  check_close(dqkv.select(2, 2).transpose(1, 2), ref.dv, 1e-4, 1e-5, "dv slice");
}

TEST_CASE("attention backward matches finite differences (f64)", "[kernels][ops][attention]") {
  const Tensor q = random_tensor({2, 4, 3}, DType::kF64, 141),
               k = random_tensor({2, 5, 3}, DType::kF64, 142),
               v = random_tensor({2, 5, 2}, DType::kF64, 143),
               r = random_tensor({2, 4, 2}, DType::kF64, 144);
  for (bool causal : {true, false}) {
    const AttentionOptions o{.causal = causal};
    const AttentionOutput a = attention(q, k, v, o);
    const AttentionGrads g = attention_backward(r, q, k, v, a.out, a.lse, o);
    auto fd = [&](const Tensor& x, const std::function<Tensor(const Tensor&)>& f) {
      std::vector<double> out;
      const auto base = x.to_vector(), rv = r.to_vector();
      for (size_t i = 0; i < base.size(); ++i) {
        double vals[2];
        for (int sgn = 0; sgn < 2; ++sgn) {
          auto p = base;
          p[i] += sgn == 0 ? 1e-6 : -1e-6;
          const auto o2 = f(Tensor::from_vector(p, x.shape(), DType::kF64)).to_vector();
          double s = 0;
          for (size_t j = 0; j < o2.size(); ++j) s += o2[j] * rv[j];
          vals[sgn] = s;
        }
        out.push_back((vals[0] - vals[1]) / 2e-6);
      }
      return out;
    };
    check_close(g.dq, fd(q, [&](const Tensor& x) { return attention(x, k, v, o).out; }), 1e-6, 1e-8,
                "dq fd");
    check_close(g.dk, fd(k, [&](const Tensor& x) { return attention(q, x, v, o).out; }), 1e-6, 1e-8,
                "dk fd");
    check_close(g.dv, fd(v, [&](const Tensor& x) { return attention(q, k, x, o).out; }), 1e-6, 1e-8,
                "dv fd");
  }
}

TEST_CASE("attention rejects bad arguments", "[kernels][ops][attention]") {
  const Tensor q = Tensor::zeros({2, 4, 3}, DType::kF32);
  REQUIRE_THROWS_WITH(attention(q, Tensor::zeros({2, 4, 2}, DType::kF32), q),
                      Contains("do not fit [..., T, E], [..., S, E], [..., S, Ev]"));
  REQUIRE_THROWS_WITH(attention(q, q, Tensor::zeros({2, 4, 3}, DType::kBF16)),
                      Contains("v has dtype bf16 but q has f32"));
  REQUIRE_THROWS_WITH(attention(q, q, Tensor::zeros({4, 3}, DType::kF32)),
                      Contains("same number of dims"));
  const AttentionOutput a = attention(q, q, q);
  REQUIRE_THROWS_WITH(attention_backward(q, q, q, q, a.out, a.lse.to(DType::kF64)),
                      Contains("lse has dtype f64, expected f32"));
  Tensor d = Tensor::zeros({2, 4, 3}, DType::kF32);
  REQUIRE_THROWS_WITH(
      attention_backward_out(d, d, Tensor::zeros({2, 4, 3}, DType::kF32), q, q, q, q, a.out, a.lse),
      Contains("dq overlaps dk"));
}
