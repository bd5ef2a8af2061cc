// [gpu] The CUDA compute kernels against the CPU ones, op by op, on strided views and every
// floating dtype. Without a usable GPU (or in a build without CUDA) the program reports skipped:
// its main (tests/support/gpu_test_main.cpp) exits 77, which Meson counts as SKIP, never as a pass.
#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;

namespace {

const Device kGpu = Device::cuda(0);

Tensor gpu(const Tensor& t) { return t.defined() ? t.to(kGpu) : t; }
Tensor host(const Tensor& t) { return t.defined() ? t.to(Device::cpu()) : t; }

// The same values in layout `kind` on the GPU.
Tensor gpu_layout(const Tensor& t, int kind) { return relayout(gpu(t), kind); }

void same(const Tensor& g, const Tensor& c, double rtol, double atol, const std::string& what) {
  REQUIRE(g.device() == kGpu);
  check_close(host(g), host(c), rtol, atol, what);
}

Tol gpu_tol(DType dt) {
  switch (dt) {
    case DType::kF64:
      return {1e-10, 1e-10};
    case DType::kF32:
      return {1e-4, 1e-5};
    default:
      return {2e-2, 2e-2};
  }
}

}  // namespace

TEST_CASE("CUDA matmul matches the CPU", "[kernels][ops][gpu]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = gpu_tol(dt);
    for (auto [a_shape, b_shape] : std::vector<std::pair<Dims, Dims>>{{{33, 17}, {17, 9}},
                                                                      {{2, 3, 5, 4}, {3, 4, 6}},
                                                                      {{4, 7, 16}, {16, 9}},
                                                                      // one strided-batched call
                                                                      {{3, 2, 9, 8}, {3, 2, 8, 5}},
                                                                      {{1, 1}, {1, 1}}}) {
      const Tensor a = random_tensor(a_shape, dt, 1), b = random_tensor(b_shape, dt, 2);
      const Tensor ref = matmul(a, b);
      for (int la = 0; la < kLayouts; ++la) {
        for (int lb = 0; lb < kLayouts; ++lb) {
          INFO(to_string(dt) << " layouts " << la << "," << lb);
          same(matmul(gpu_layout(a, la), gpu_layout(b, lb)), ref, tol.rtol, tol.atol, "matmul");
          ++cases;
        }
      }
      // Accumulate into a transposed f32 out (bf16/f16 inputs) or an out of a's dtype.
      const DType out_dt = dt == DType::kBF16 || dt == DType::kF16 ? DType::kF32 : dt;
      const Tensor c0 = random_tensor(ref.shape(), out_dt, 3);
      Tensor cc = c0.clone(), cg = gpu_layout(c0, 1);
      matmul_out(cc, a, b, {.alpha = 0.5, .beta = 1.0});
      matmul_out(cg, gpu(a), gpu(b), {.alpha = 0.5, .beta = 1.0});
      same(cg, cc, tol.rtol, tol.atol, "matmul_out beta 1");
    }
  }
  REQUIRE(cases == 4 * 5 * kLayouts * kLayouts);
  // Broadcast rows (stride 0: below cuBLAS's minimum leading dimension, so copied first).
  const Tensor row = random_tensor({1, 6}, DType::kF32, 4),
               w = random_tensor({6, 5}, DType::kF32, 5);
  same(matmul(expand(gpu(row), {7, 6}), gpu(w)), matmul(expand(row, {7, 6}), w), 1e-5, 1e-6,
       "expanded rows");
}

TEST_CASE("CUDA element-wise ops match the CPU", "[kernels][ops][gpu]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = gpu_tol(dt);
    const Tensor x = random_tensor({7, 33}, dt, 4, -5, 5), y = random_tensor({7, 33}, dt, 5);
    const Tensor bias = random_tensor({33}, dt, 6);
    const std::vector<
        std::pair<std::string, std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>>>
        ops = {
            {"add",
             [](const Tensor& a, const Tensor& b, const Tensor&) { return add(a, b, -0.5); }},
            {"add bias", [](const Tensor& a, const Tensor&, const Tensor& c) { return add(a, c); }},
            {"mul", [](const Tensor& a, const Tensor& b, const Tensor&) { return mul(a, b); }},
            {"scale", [](const Tensor& a, const Tensor&, const Tensor&) { return scale(a, 3.0); }},
            {"gelu", [](const Tensor& a, const Tensor&, const Tensor&) { return gelu(a); }},
            {"gelu tanh", [](const Tensor& a, const Tensor&,
                             const Tensor&) { return gelu(a, GeluApproximation::kTanh); }},
            {"gelu_backward",
             [](const Tensor& a, const Tensor& b, const Tensor&) { return gelu_backward(b, a); }},
            {"gelu_backward tanh",
             [](const Tensor& a, const Tensor& b, const Tensor&) {
               return gelu_backward(b, a, GeluApproximation::kTanh);
             }},
            {"silu", [](const Tensor& a, const Tensor&, const Tensor&) { return silu(a); }},
            {"silu_backward",
             [](const Tensor& a, const Tensor& b, const Tensor&) { return silu_backward(b, a); }},
        };
    for (const auto& [name, fn] : ops) {
      const Tensor ref = fn(x, y, bias);
      for (int layout = 0; layout < kLayouts; ++layout) {
        INFO(name << " " << to_string(dt) << " layout " << layout);
        same(fn(gpu_layout(x, layout), gpu_layout(y, (layout + 1) % kLayouts), gpu(bias)), ref,
             tol.rtol, tol.atol + (dt == DType::kF32 ? 1e-5 : 0), name);
        ++cases;
      }
    }
    // In place and mixed dtypes: an f32 accumulator += a bf16 gradient.
    Tensor acc_c = Tensor::zeros({7, 33}, DType::kF32), acc_g = gpu(acc_c);
    add_out(acc_c, acc_c, x);
    add_out(acc_g, acc_g, gpu(x));
    same(acc_g, acc_c, 1e-6, 1e-6, "mixed in-place add");
  }
  REQUIRE(cases == 4 * 10 * kLayouts);
}

TEST_CASE("CUDA reductions match the CPU", "[kernels][ops][gpu]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = gpu_tol(dt);
    const Tensor x = random_tensor({4, 5, 6}, dt, 7);
    for (int layout = 0; layout < kLayouts; ++layout) {
      const Tensor g = gpu_layout(x, layout);
      for (const Dims& dims : std::vector<Dims>{{0}, {1}, {2}, {0, 2}, {0, 1, 2}}) {
        same(sum(g, dims), sum(x, dims), tol.rtol, tol.atol, "sum");
        same(mean(g, dims, true), mean(x, dims, true), tol.rtol, tol.atol, "mean");
        ++cases;
      }
      for (int dim = 0; dim < 3; ++dim) {
        const MaxResult c = max(x, dim), r = max(g, dim);
        same(r.values, c.values, 0, 0, "max values");
        same(r.indices, c.indices, 0, 0, "max indices");
        const Tensor dy = random_tensor(c.values.shape(), dt, 8);
        same(max_backward(gpu(dy), r.indices, dim, x.shape()),
             max_backward(dy, c.indices, dim, x.shape()), 0, 0, "max_backward");
      }
      same(sum_of_squares(g), sum_of_squares(x), 1e-12, 0, "sum_of_squares");
      same(sum_to_shape(g, {5, 1}), sum_to_shape(x, {5, 1}), tol.rtol, tol.atol, "sum_to_shape");
      Tensor acc_c = Tensor::full({6}, 1.0, DType::kF32), acc_g = gpu(acc_c);
      sum_out(acc_c, x, {0, 1}, false, true);
      sum_out(acc_g, g, {0, 1}, false, true);
      same(acc_g, acc_c, 1e-6, 1e-6, "sum_out accumulate");
    }
  }
  REQUIRE(cases == 4 * kLayouts * 5);
}

TEST_CASE("CUDA softmax, norms and cross-entropy match the CPU", "[kernels][ops][gpu]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = gpu_tol(dt);
    const Tensor x = random_tensor({9, 300}, dt, 9, -4, 4), dy = random_tensor({9, 300}, dt, 10);
    const Tensor w = random_tensor({300}, dt, 11, 0.5, 1.5), b = random_tensor({300}, dt, 12);
    for (int layout = 0; layout < kLayouts; ++layout) {
      const Tensor gx = gpu_layout(x, layout), gdy = gpu_layout(dy, (layout + 1) % kLayouts);
      INFO(to_string(dt) << " layout " << layout);
      for (int dim : {0, 1}) {
        const Tensor y = softmax(x, dim), gy = softmax(gx, dim);
        same(gy, y, tol.rtol, tol.atol, "softmax");
        same(softmax_backward(gdy, gy, dim), softmax_backward(dy, y, dim), tol.rtol, tol.atol,
             "softmax_backward");
        const Tensor ly = log_softmax(x, dim), gly = log_softmax(gx, dim);
        same(gly, ly, tol.rtol, tol.atol * 4, "log_softmax");
        same(log_softmax_backward(gdy, gly, dim), log_softmax_backward(dy, ly, dim), tol.rtol,
             tol.atol * 4, "log_softmax_backward");
      }
      const RmsNormOutput r = rms_norm(x, w, 1e-6), gr = rms_norm(gx, gpu(w), 1e-6);
      same(gr.y, r.y, tol.rtol, tol.atol, "rms_norm y");
      same(gr.rstd, r.rstd, 1e-5, 1e-6, "rms_norm rstd");
      const RmsNormGrads rg = rms_norm_backward(dy, x, w, r.rstd),
                         grg = rms_norm_backward(gdy, gx, gpu(w), gr.rstd);
      same(grg.dx, rg.dx, tol.rtol, tol.atol * 4, "rms dx");
      same(grg.dweight, rg.dweight, tol.rtol, tol.atol * 10, "rms dweight");
      const LayerNormOutput l = layer_norm(x, w, b, 1e-5),
                            gl = layer_norm(gx, gpu(w), gpu(b), 1e-5);
      same(gl.y, l.y, tol.rtol, tol.atol, "layer_norm y");
      same(gl.mean, l.mean, 1e-5, 1e-6, "layer_norm mean");
      const LayerNormGrads lg = layer_norm_backward(dy, x, w, b, l.mean, l.rstd),
                           glg = layer_norm_backward(gdy, gx, gpu(w), gpu(b), gl.mean, gl.rstd);
      same(glg.dx, lg.dx, tol.rtol, tol.atol * 4, "ln dx");
      same(glg.dweight, lg.dweight, tol.rtol, tol.atol * 10, "ln dweight");
      same(glg.dbias, lg.dbias, tol.rtol, tol.atol * 10, "ln dbias");
      // Cross-entropy, fused and on two vocab shards.
      std::vector<double> t;
      for (int i = 0; i < 9; ++i) t.push_back(i == 3 ? -100 : (i * 37) % 300);
      const Tensor targets = Tensor::from_vector(t, {9}, DType::kI64);
      const CrossEntropyOutput ce = cross_entropy(x, targets),
                               gce = cross_entropy(gx, gpu(targets));
      same(gce.loss, ce.loss, 1e-5, 1e-6, "ce loss");
      same(gce.dlogits, ce.dlogits, tol.rtol, tol.atol * 0.01, "ce dlogits");
      const CrossEntropyRowStats s = cross_entropy_shard_stats(x.narrow(1, 100, 150), targets, 100,
                                                               300),
                                 gs = cross_entropy_shard_stats(gx.narrow(1, 100, 150),
                                                                gpu(targets), 100, 300);
      same(gs.max, s.max, 0, 0, "shard max");
      same(gs.sum_exp, s.sum_exp, 1e-5, 0, "shard sum_exp");
      same(gs.target_logit, s.target_logit, 0, 0, "shard target logit");
      const Tensor gmax = Tensor::full({9}, 5.0, s.max.dtype());
      rescale_sum_exp_(s.sum_exp, s.max, gmax);
      rescale_sum_exp_(gs.sum_exp, gs.max, gpu(gmax));
      same(gs.sum_exp, s.sum_exp, 1e-5, 1e-12, "rescaled sum_exp");
      Tensor dl = Tensor::zeros({9, 150}, DType::kF32), gdl = gpu(dl);
      cross_entropy_shard_backward_out(dl, x.narrow(1, 100, 150), targets, 100, gmax, s.sum_exp);
      cross_entropy_shard_backward_out(gdl, gx.narrow(1, 100, 150), gpu(targets), 100, gpu(gmax),
                                       gs.sum_exp);
      same(gdl, dl, 1e-4, 1e-7, "shard dlogits");
      ++cases;
    }
  }
  REQUIRE(cases == 4 * kLayouts);
}

TEST_CASE("CUDA embedding, attention and optimizer steps match the CPU", "[kernels][ops][gpu]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    const Tol tol = gpu_tol(dt);
    // Embedding: the backward is deterministic on both and sums in f32 in position order, so an
    // f32 gradient is bitwise identical.
    const Tensor table = random_tensor({11, 40}, dt, 13);
    std::vector<double> idv;
    for (int i = 0; i < 500; ++i) idv.push_back((i * 7) % 11);
    const Tensor ids = Tensor::from_vector(idv, {20, 25}, DType::kI64);
    const Tensor dy = random_tensor({20, 25, 40}, dt, 14);
    same(embedding(gpu(table), gpu(ids)), embedding(table, ids), 0, 0, "embedding");
    Tensor dw = Tensor::zeros({11, 40}, DType::kF32), gdw = gpu(dw);
    embedding_backward_out(dw, dy, ids, {.padding_idx = 3});
    embedding_backward_out(gdw, gpu(dy), gpu(ids), {.padding_idx = 3});
    same(gdw, dw, dt == DType::kF64 ? 1e-12 : 1e-6, 1e-6, "embedding_backward");
    // Attention.
    const Tensor q = random_tensor({2, 3, 17, 8}, dt, 15), k = random_tensor({2, 3, 17, 8}, dt, 16),
                 v = random_tensor({2, 3, 17, 8}, dt, 17), g = random_tensor({2, 3, 17, 8}, dt, 18);
    for (bool causal : {true, false}) {
      const AttentionOutput a = attention(q, k, v, {.causal = causal});
      const AttentionOutput ga =
          attention(gpu_layout(q, 1), gpu_layout(k, 2), gpu_layout(v, 3), {.causal = causal});
      same(ga.out, a.out, tol.rtol, tol.atol, "attention out");
      same(ga.lse, a.lse, 1e-5, 1e-5, "attention lse");
      const AttentionGrads c = attention_backward(g, q, k, v, a.out, a.lse, {.causal = causal});
      const AttentionGrads r =
          attention_backward(gpu(g), gpu(q), gpu(k), gpu(v), ga.out, ga.lse, {.causal = causal});
      same(r.dq, c.dq, tol.rtol, tol.atol * 4, "dq");
      same(r.dk, c.dk, tol.rtol, tol.atol * 4, "dk");
      same(r.dv, c.dv, tol.rtol, tol.atol * 4, "dv");
    }
    ++cases;
  }
  for (DType pdt : {DType::kF32, DType::kF64}) {
    for (DType gdt : {DType::kF32, DType::kBF16}) {
      const Tensor p0 = random_tensor({257}, pdt, 19), g = random_tensor({257}, gdt, 20);
      Tensor pc = p0.clone(), mc = Tensor::zeros({257}, pdt), vc = Tensor::zeros({257}, pdt),
             xc = Tensor::zeros({257}, pdt);
      Tensor pg = gpu_layout(p0, 2), mg = gpu(mc), vg = gpu(vc), xg = gpu(xc);
      const AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1, .amsgrad = true};
      for (int64_t step = 1; step <= 3; ++step) {
        adamw_step(pc, g, mc, vc, xc, step, o);
        adamw_step(pg, gpu(g), mg, vg, xg, step, o);
      }
      same(pg, pc, 1e-6, 1e-7, "adamw");
      Tensor sc = p0.clone(), bc = Tensor::zeros({257}, pdt), sg = gpu(sc), bg = gpu(bc);
      const SgdOptions so{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true};
      for (int step = 1; step <= 3; ++step) {
        sgd_step(sc, g, bc, step == 1, so);
        sgd_step(sg, gpu(g), bg, step == 1, so);
      }
      same(sg, sc, 1e-6, 1e-7, "sgd");
      ++cases;
    }
  }
  REQUIRE(cases == 4 + 4);
}

TEST_CASE("CUDA chunk_cat / split_copy give the CPU bytes", "[kernels][ops][gpu][chunk_cat]") {
  // Uneven rows (padding), an empty tensor, a split along dim 1, strided inputs, f32 -> bf16
  // and bf16 -> f32, an absent input (zeros) and an absent output (skipped).
  const std::vector<Dims> shapes{{10, 6}, {3}, {0, 5}, {4, 8}, {7, 3, 2}};
  const std::vector<int> dims{0, 0, 0, 1, 0};
  int cases = 0;
  for (int64_t chunks : {1, 3, 4}) {
    const ChunkCatLayout l(shapes, dims, chunks);
    for (auto [src, dst] : {std::pair{DType::kF32, DType::kBF16}, std::pair{DType::kBF16, DType::kF32},
                            std::pair{DType::kF32, DType::kF32}}) {
      INFO("chunks " << chunks << " " << to_string(src) << " -> " << to_string(dst));
      std::vector<Tensor> cpu_in, gpu_in;
      for (size_t i = 0; i < shapes.size(); ++i) {
        cpu_in.push_back(relayout(random_tensor(shapes[i], src, 50 + i), static_cast<int>(i % kLayouts)));
        gpu_in.push_back(gpu_layout(cpu_in.back(), static_cast<int>(i % kLayouts)));
      }
      cpu_in[1] = gpu_in[1] = Tensor();
      Tensor c = Tensor::full(Dims{l.numel()}, 3.0, dst), g = Tensor::full(Dims{l.numel()}, 3.0, dst, kGpu);
      chunk_cat(c, cpu_in, l);
      chunk_cat(g, gpu_in, l);
      const Tensor gh = host(g);
      REQUIRE(std::memcmp(gh.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()) * itemsize(dst)) == 0);
      std::vector<Tensor> cpu_out, gpu_out;
      for (size_t i = 0; i < shapes.size(); ++i) {
        cpu_out.push_back(Tensor::full(shapes[i], -2.0, src));
        gpu_out.push_back(gpu_layout(cpu_out.back(), static_cast<int>((i + 1) % kLayouts)));
      }
      cpu_out[0] = gpu_out[0] = Tensor();
      split_copy(cpu_out, c, l);
      split_copy(gpu_out, g, l);
      for (size_t i = 1; i < shapes.size(); ++i) {
        if (shapes[i].product() == 0) continue;
        const Tensor a = host(gpu_out[i]).contiguous(), b = cpu_out[i].contiguous();
        REQUIRE(std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(b.numel()) * itemsize(src)) == 0);
      }
      ++cases;
    }
  }
  REQUIRE(cases == 9);
}
