// kernels-bench: speed of the compute kernels (kernels/ops/*.h) on the shapes of a small GPT:
// GEMM GFLOP/s per ISA variant (the baseline SSE2 build of Eigen, AVX2+FMA, AVX-512) and through
// the public matmul (f32 and bf16, 1 or N threads), GB/s of the element-wise and row kernels,
// attention and optimizer throughput. Medians over --iters runs after --warmup. bench/README.md
// has the commands; bench/torch_kernels.py times PyTorch on the same shapes.
//
// Exit status: 0; 1 when --check finds a GEMM variant that disagrees with the reference; 2 on
// bad options.
#include <dlfcn.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cpu/vec.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"

using kernels::DType;
using kernels::Tensor;
using kernels::detail::Isa;

namespace {

struct Options {
  int64_t rows = 2048;  // B * T
  std::vector<int64_t> dims = {64, 128, 256, 512};
  int iters = 20;
  int warmup = 3;
  std::string isa = "all";
  std::vector<int> threads = {1, 2};
  int64_t vocab = 8192;
  int64_t seq = 256;
  std::string json;
  bool check = true;
  std::string only;      // comma list of sections
  std::string openblas;  // path of a libopenblas.so to time cblas_sgemm beside Eigen
  int64_t copy_dim = 1024;  // fsdp-copy: the transformer block's dim
  int64_t copy_world = 4;   // fsdp-copy: ranks
  std::vector<int> copy_threads = {1, 2, 4};
};

// cblas_sgemm, looked up at run time so the build needs no BLAS (bench/README.md "OpenBLAS").
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
SgemmFn load_sgemm(const std::string& path) {
  if (path.empty()) return nullptr;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) throw kernels::InvalidArgument(fmt::format("--openblas: {}", dlerror()));
  auto fn = reinterpret_cast<SgemmFn>(dlsym(h, "cblas_sgemm"));
  if (fn == nullptr)
    throw kernels::InvalidArgument(fmt::format("--openblas: {} has no cblas_sgemm", path));
  // A serial OpenBLAS is the fair comparison (one thread per rank); the threaded one would
  // use every core: set OPENBLAS_NUM_THREADS=1 when timing it.
  return fn;
}

using program::median;

// Median seconds of fn over iters runs after warmup runs.
double time_it(const Options& o, const std::function<void()>& fn) {
  for (int i = 0; i < o.warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < o.iters; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return median(t);
}

Tensor filled(const kernels::Dims& shape, DType dtype, double scale = 1.0) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = static_cast<float>(scale * std::sin(0.37 * static_cast<double>(i)));
  return dtype == DType::kF32 ? t : t.to(dtype);
}

struct Recorder {
  nlohmann::json rows = nlohmann::json::array();
  void add(nlohmann::json r) { rows.push_back(std::move(r)); }
};

std::vector<Isa> isas(const Options& o) {
  std::vector<Isa> out;
  for (Isa i : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    if (kernels::detail::vec_kernels_for(i) == nullptr) continue;
    const std::string name(kernels::detail::to_string(i));
    if (o.isa == "all" || o.isa == name ||
        (o.isa == "best" && &kernels::detail::vec_kernels() == kernels::detail::vec_kernels_for(i)))
      out.push_back(i);
  }
  return out;
}

struct GemmShape {
  std::string name;
  int64_t m, n, k;
  bool trans_a, trans_b;  // a stored [k, m] / b stored [n, k]
};

std::vector<GemmShape> gemm_shapes(int64_t r, int64_t d) {
  return {{"qkv x[R,D]@W[D,3D]", r, 3 * d, d, false, false},
          {"mlp-up x[R,D]@W[D,4D]", r, 4 * d, d, false, false},
          {"mlp-down h[R,4D]@W[4D,D]", r, d, 4 * d, false, false},
          {"dX dY[R,4D]@W^T", r, d, 4 * d, false, true},
          {"dW X^T[D,R]@dY[R,4D]", d, 4 * d, r, true, false}};
}

int run_gemm(const Options& o, Recorder& rec) {
  int bad = 0;
  fmt::print("\n== GEMM (f32 unless noted; R = {} rows; GFLOP/s = 2mnk / median time)\n", o.rows);
  fmt::print("{:<26} {:>5} {:>6} {:>6} {:>6}  {:<22} {:>7} {:>10} {:>9}\n", "shape", "D", "m", "n",
             "k", "variant", "threads", "median_us", "GFLOP/s");
  for (int64_t d : o.dims) {
    for (const GemmShape& s : gemm_shapes(o.rows, d)) {
      const Tensor a_store =
          filled(s.trans_a ? kernels::Dims{s.k, s.m} : kernels::Dims{s.m, s.k}, DType::kF32, 0.5);
      const Tensor b_store =
          filled(s.trans_b ? kernels::Dims{s.n, s.k} : kernels::Dims{s.k, s.n}, DType::kF32, 0.5);
      const Tensor a = s.trans_a ? a_store.transpose(0, 1) : a_store;
      const Tensor b = s.trans_b ? b_store.transpose(0, 1) : b_store;
      const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
      auto report = [&](const std::string& variant, int threads, double sec) {
        const double gf = flops / sec / 1e9;
        fmt::print("{:<26} {:>5} {:>6} {:>6} {:>6}  {:<22} {:>7} {:>10.1f} {:>9.1f}\n", s.name, d,
                   s.m, s.n, s.k, variant, threads, sec * 1e6, gf);
        rec.add({{"section", "gemm"},
                 {"shape", s.name},
                 {"D", d},
                 {"m", s.m},
                 {"n", s.n},
                 {"k", s.k},
                 {"variant", variant},
                 {"threads", threads},
                 {"median_us", sec * 1e6},
                 {"gflops", gf}});
      };
      Tensor ref;
      for (Isa isa : isas(o)) {
        const auto* k = kernels::detail::vec_kernels_for(isa);
        Tensor c = Tensor::zeros({s.m, s.n}, DType::kF32);
        kernels::detail::GemmArgs<float> g;
        g.m = s.m, g.n = s.n, g.k = s.k;
        g.a = a.data<float>(), g.a_rs = a.stride(0), g.a_cs = a.stride(1);
        g.b = b.data<float>(), g.b_rs = b.stride(0), g.b_cs = b.stride(1);
        g.c = c.data<float>(), g.c_rs = s.n;
        report(fmt::format("eigen-{}", kernels::detail::to_string(isa)), 1,
               time_it(o, [&] { k->f32.gemm(g); }));
        if (o.check) {
          if (!ref.defined()) {
            ref = Tensor::zeros({s.m, s.n}, DType::kF64);
            kernels::matmul_out(ref, a.to(DType::kF64), b.to(DType::kF64));
          }
          if (!kernels::allclose(c.to(DType::kF64), ref, 1e-4, 1e-3)) {
            fmt::print("MISMATCH: {} D={} variant {}\n", s.name, d,
                       kernels::detail::to_string(isa));
            ++bad;
          }
        }
      }
      if (SgemmFn sgemm = load_sgemm(o.openblas)) {
        Tensor c = Tensor::empty({s.m, s.n}, DType::kF32);
        // Row-major (101); A / B stored [k, m] / [n, k] when transposed (112, else 111).
        report("openblas sgemm", 1, time_it(o, [&] {
                 sgemm(101, s.trans_a ? 112 : 111, s.trans_b ? 112 : 111, static_cast<int>(s.m),
                       static_cast<int>(s.n), static_cast<int>(s.k), 1.0f, a_store.data<float>(),
                       static_cast<int>(s.trans_a ? s.m : s.k), b_store.data<float>(),
                       static_cast<int>(s.trans_b ? s.k : s.n), 0.0f, c.data<float>(),
                       static_cast<int>(s.n));
               }));
      }
      for (int threads : o.threads) {
        Tensor c = Tensor::empty({s.m, s.n}, DType::kF32);
        report("matmul f32", threads,
               time_it(o, [&] { kernels::matmul_out(c, a, b, {.num_threads = threads}); }));
      }
      const Tensor ah = a.to(DType::kBF16), bh = b.to(DType::kBF16);
      Tensor ch = Tensor::empty({s.m, s.n}, DType::kBF16);
      report("matmul bf16", 1, time_it(o, [&] { kernels::matmul_out(ch, ah, bh); }));
    }
  }
  return bad;
}

void run_elementwise(const Options& o, Recorder& rec) {
  const int64_t d = o.dims.back();
  const int64_t n = o.rows * 4 * d;  // the MLP activation [R, 4D]
  fmt::print(
      "\n== element-wise, f32, n = {} ([R, 4D] with D = {}); GB/s = bytes read + written / time\n",
      n, d);
  fmt::print("{:<22} {:<12} {:>10} {:>8}\n", "op", "variant", "median_us", "GB/s");
  const Tensor x = filled({n}, DType::kF32, 3.0), y = filled({n}, DType::kF32, 1.0);
  Tensor out = Tensor::empty({n}, DType::kF32);
  auto report = [&](const std::string& op, const std::string& variant, double bytes, double sec) {
    fmt::print("{:<22} {:<12} {:>10.1f} {:>8.2f}\n", op, variant, sec * 1e6, bytes / sec / 1e9);
    rec.add({{"section", "elementwise"},
             {"op", op},
             {"variant", variant},
             {"n", n},
             {"median_us", sec * 1e6},
             {"gbps", bytes / sec / 1e9}});
  };
  const double f = 4.0 * static_cast<double>(n);
  for (Isa isa : isas(o)) {
    const auto& v = kernels::detail::vec_kernels_for(isa)->f32;
    const std::string name(kernels::detail::to_string(isa));
    const float* px = x.data<float>();
    const float* py = y.data<float>();
    float* po = out.data<float>();
    report("add", name, 3 * f, time_it(o, [&] { v.add(po, px, py, 1.0f, n); }));
    report("gelu (erf)", name, 2 * f, time_it(o, [&] { v.gelu(po, px, n, false); }));
    report("gelu (tanh)", name, 2 * f, time_it(o, [&] { v.gelu(po, px, n, true); }));
    report("gelu_backward (erf)", name, 3 * f,
           time_it(o, [&] { v.gelu_backward(po, py, px, n, false); }));
    report("silu", name, 2 * f, time_it(o, [&] { v.silu(po, px, n); }));
  }
  report("add (api)", "best", 3 * f, time_it(o, [&] { kernels::add_out(out, x, y); }));
  report("gelu (api)", "best", 2 * f, time_it(o, [&] { kernels::gelu_out(out, x); }));
  const Tensor xb = x.to(DType::kBF16);
  Tensor ob = Tensor::empty({n}, DType::kBF16);
  report("gelu bf16 (api)", "best", f, time_it(o, [&] { kernels::gelu_out(ob, xb); }));
}

void run_rows(const Options& o, Recorder& rec) {
  fmt::print("\n== row kernels (public API, best ISA); GB/s = bytes read + written / time\n");
  fmt::print("{:<34} {:>10} {:>8}\n", "op", "median_us", "GB/s");
  auto report = [&](const std::string& op, double bytes, double sec) {
    fmt::print("{:<34} {:>10.1f} {:>8.2f}\n", op, sec * 1e6, bytes / sec / 1e9);
    rec.add(
        {{"section", "rows"}, {"op", op}, {"median_us", sec * 1e6}, {"gbps", bytes / sec / 1e9}});
  };
  for (int64_t d : o.dims) {
    const Tensor x = filled({o.rows, d}, DType::kF32, 2.0), w = filled({d}, DType::kF32, 1.0);
    const Tensor b = filled({d}, DType::kF32, 0.1), dy = filled({o.rows, d}, DType::kF32, 1.0);
    const double f = 4.0 * static_cast<double>(o.rows * d);
    Tensor y = Tensor::empty({o.rows, d}, DType::kF32), rstd = Tensor::empty({o.rows}, DType::kF32),
           mean = Tensor::empty({o.rows}, DType::kF32),
           dx = Tensor::empty({o.rows, d}, DType::kF32), dw = Tensor::empty({d}, DType::kF32),
           db = Tensor::empty({d}, DType::kF32);
    const std::string shape = fmt::format("[{},{}]", o.rows, d);
    report("rms_norm " + shape, 2 * f,
           time_it(o, [&] { kernels::rms_norm_out(y, rstd, x, w, 1e-6); }));
    report("rms_norm_backward " + shape, 3 * f,
           time_it(o, [&] { kernels::rms_norm_backward_out(dx, dw, dy, x, w, rstd); }));
    report("layer_norm " + shape, 2 * f,
           time_it(o, [&] { kernels::layer_norm_out(y, mean, rstd, x, w, b, 1e-5); }));
    report("layer_norm_backward " + shape, 3 * f,
           time_it(o, [&] { kernels::layer_norm_backward_out(dx, dw, db, dy, x, w, mean, rstd); }));
    report("softmax " + shape, 2 * f, time_it(o, [&] { kernels::softmax_out(y, x, -1); }));
  }
  {
    const Tensor logits = filled({o.rows, o.vocab}, DType::kF32, 4.0);
    std::vector<double> t;
    for (int64_t i = 0; i < o.rows; ++i) t.push_back(static_cast<double>((i * 7919) % o.vocab));
    const Tensor targets = Tensor::from_vector(t, {o.rows}, DType::kI64);
    Tensor loss = Tensor::empty({}, DType::kF32),
           dl = Tensor::empty({o.rows, o.vocab}, DType::kF32);
    report(fmt::format("cross_entropy+dlogits [{},{}]", o.rows, o.vocab),
           8.0 * static_cast<double>(logits.numel()),
           time_it(o, [&] { kernels::cross_entropy_out(loss, dl, logits, targets); }));
  }
  {
    const int64_t n = 12 * o.dims.back() * o.dims.back() * 4;  // ~ the params of 4 blocks
    Tensor p = filled({n}, DType::kF32), g = filled({n}, DType::kF32, 0.01),
           m = Tensor::zeros({n}, DType::kF32), v = Tensor::zeros({n}, DType::kF32);
    int64_t step = 0;
    report(fmt::format("adamw_step n={}", n), 4.0 * 7 * static_cast<double>(n),
           time_it(o, [&] { kernels::adamw_step(p, g, m, v, Tensor(), ++step, {}); }));
    Tensor gb = g.to(DType::kBF16);
    report(fmt::format("adamw_step bf16 grad n={}", n), 4.0 * 6.5 * static_cast<double>(n),
           time_it(o, [&] { kernels::adamw_step(p, gb, m, v, Tensor(), ++step, {}); }));
  }
}

void run_attention(const Options& o, Recorder& rec) {
  fmt::print(
      "\n== causal attention, f32, [B, H, T, 64] from R = B*T rows; GFLOP/s counts 4 B H T^2 E "
      "(fwd)\n");
  fmt::print("{:<30} {:>8} {:>10} {:>9}\n", "case", "threads", "median_us", "GFLOP/s");
  for (int64_t d : o.dims) {
    const int64_t e = 64, h = std::max<int64_t>(1, d / e), t = o.seq,
                  bsz = std::max<int64_t>(1, o.rows / t);
    const Tensor qkv = filled({bsz, t, 3, h, e}, DType::kF32, 0.5);
    const Tensor q = qkv.select(2, 0).transpose(1, 2), k = qkv.select(2, 1).transpose(1, 2),
                 v = qkv.select(2, 2).transpose(1, 2);
    const double flops = 4.0 * static_cast<double>(bsz * h * t * t * e);
    for (int threads : o.threads) {
      kernels::AttentionOutput a;
      const double fwd =
          time_it(o, [&] { a = kernels::attention(q, k, v, {.num_threads = threads}); });
      const Tensor dout = filled({bsz, h, t, e}, DType::kF32);
      const double bwd = time_it(o, [&] {
        kernels::attention_backward(dout, q, k, v, a.out, a.lse, {.num_threads = threads});
      });
      const std::string name = fmt::format("B{} H{} T{} E{}", bsz, h, t, e);
      fmt::print("{:<30} {:>8} {:>10.1f} {:>9.1f}\n", name + " fwd", threads, fwd * 1e6,
                 flops / fwd / 1e9);
      fmt::print("{:<30} {:>8} {:>10.1f} {:>9.1f}\n", name + " bwd", threads, bwd * 1e6,
                 2 * flops / bwd / 1e9);
      rec.add({{"section", "attention"},
               {"case", name},
               {"threads", threads},
               {"fwd_us", fwd * 1e6},
               {"bwd_us", bwd * 1e6},
               {"fwd_gflops", flops / fwd / 1e9},
               {"bwd_gflops", 2 * flops / bwd / 1e9}});
    }
  }
}

// FSDP's copies for one group on one rank: copy-in (the unsharded gradients chunk-cat into the
// reduce-scatter input, cast to the reduce dtype, zero padding), copy-out (the all-gather output
// split-copied into the unsharded parameters) and the shard's param_dtype cast, per-parameter
// strided copy_ (what fsdp did before: a zero fill, then one copy_ per parameter and rank) vs the
// fused chunk_cat / split_copy on 1 or more threads. The group is a transformer block of dim D
// (LayerNorms, q/k/v/o, MLP 4D, biases) over --copy-world ranks.
void run_fsdp_copy(const Options& o, Recorder& rec) {
  const int64_t d = o.copy_dim, world = o.copy_world;
  std::vector<kernels::Dims> shapes = {{d}, {d}};  // norm1 weight, bias
  for (int i = 0; i < 4; ++i) {                    // wq, wk, wv, wo
    shapes.push_back({d, d});
    shapes.push_back({d});
  }
  shapes.push_back({d});  // norm2
  shapes.push_back({d});
  shapes.push_back({4 * d, d});  // fc1
  shapes.push_back({4 * d});
  shapes.push_back({d, 4 * d});  // fc2
  shapes.push_back({d});
  const kernels::ChunkCatLayout layout(shapes, world);
  int64_t numel = 0;
  for (const auto& s : shapes) numel += s.product();
  fmt::print("\n== fsdp copies: transformer block D = {} ({} parameters, {} elements) over {} ranks; one rank's copies\n",
             d, shapes.size(), numel, world);
  fmt::print("{:<10} {:<12} {:<14} {:>11} {:>8} {:>9}\n", "copy", "dtypes", "variant", "median_us", "GB/s", "vs old");
  auto make = [&](DType dt) {
    std::vector<Tensor> v;
    for (size_t i = 0; i < shapes.size(); ++i) v.push_back(filled(shapes[i], dt, 0.5 + static_cast<double>(i)));
    return v;
  };
  auto bytes_of = [&](DType a, DType b, int64_t n) {
    return static_cast<double>(n) * static_cast<double>(kernels::itemsize(a) + kernels::itemsize(b));
  };
  auto piece = [&](const Tensor& flat, size_t i, int64_t c) {
    return flat.narrow(0, c * layout.chunk_numel() + layout.offset(i), layout.padded_shape(i).product())
        .view(layout.padded_shape(i))
        .narrow(0, 0, layout.piece_size(i, c));
  };
  auto report = [&](const std::string& copy, const std::string& dts, const std::string& variant, double bytes,
                    double sec, double old) {
    fmt::print("{:<10} {:<12} {:<14} {:>11.1f} {:>8.2f} {:>9.2f}\n", copy, dts, variant, sec * 1e6,
               bytes / sec / 1e9, old / sec);
    rec.add({{"section", "fsdp-copy"}, {"copy", copy}, {"dtypes", dts}, {"variant", variant}, {"dim", d},
             {"world", world}, {"median_us", sec * 1e6}, {"gbps", bytes / sec / 1e9}, {"speedup_vs_old", old / sec}});
  };
  auto name = [](DType a, DType b) {
    return fmt::format("{}->{}", kernels::to_string(a), kernels::to_string(b));
  };
  const std::vector<int> thread_list = o.copy_threads;
  for (auto [src, dst] : {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kF32, DType::kBF16},
                          std::pair{DType::kBF16, DType::kF32}}) {
    const std::vector<Tensor> grads = make(src);
    Tensor in = Tensor::empty({layout.numel()}, dst);
    const double bytes = bytes_of(src, dst, numel);
    const double old = time_it(o, [&] {
      in.fill_(0.0);
      for (size_t i = 0; i < shapes.size(); ++i)
        for (int64_t c = 0; c < world; ++c)
          if (layout.piece_size(i, c) > 0)
            piece(in, i, c).copy_(grads[i].narrow(0, layout.piece_offset(i, c), layout.piece_size(i, c)));
    });
    report("copy-in", name(src, dst), "per-param", bytes, old, old);
    for (int t : thread_list)
      report("copy-in", name(src, dst), fmt::format("chunk_cat t={}", t), bytes,
             time_it(o, [&] { kernels::chunk_cat(in, grads, layout, t); }), old);
  }
  for (auto [src, dst] : {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16}}) {
    const Tensor flat = filled({layout.numel()}, src, 0.25);
    std::vector<Tensor> params = make(dst);
    const double bytes = bytes_of(src, dst, numel);
    const double old = time_it(o, [&] {
      for (size_t i = 0; i < shapes.size(); ++i)
        for (int64_t c = 0; c < world; ++c)
          if (layout.piece_size(i, c) > 0)
            params[i].narrow(0, layout.piece_offset(i, c), layout.piece_size(i, c)).copy_(piece(flat, i, c));
    });
    report("copy-out", name(src, dst), "per-param", bytes, old, old);
    for (int t : thread_list)
      report("copy-out", name(src, dst), fmt::format("split_copy t={}", t), bytes,
             time_it(o, [&] { kernels::split_copy(params, flat, layout, t); }), old);
  }
  {
    const int64_t p = layout.chunk_numel();
    const Tensor shard = filled({p}, DType::kF32, 0.75);
    Tensor cast = Tensor::empty({p}, DType::kBF16);
    const kernels::ChunkCatLayout one({{p}}, 1);
    const double bytes = bytes_of(DType::kF32, DType::kBF16, p);
    const double old = time_it(o, [&] { cast.copy_(shard); });
    report("shard-cast", "f32->bf16", "copy_", bytes, old, old);
    for (int t : thread_list)
      report("shard-cast", "f32->bf16", fmt::format("chunk_cat t={}", t), bytes,
             time_it(o, [&] { kernels::chunk_cat(cast, {shard}, one, t); }), old);
  }
}

bool wants(const Options& o, const std::string& section) {
  return o.only.empty() || ("," + o.only + ",").find("," + section + ",") != std::string::npos;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("kernels-bench", [&] {
    Options o;
    CLI::App app{"kernels-bench: speed of the compute kernels (bench/README.md)"};
    app.add_option("--rows", o.rows, "rows of the activations (B * T)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
        ->capture_default_str();
    app.add_option("--dims", o.dims, "model dims D")
        ->delimiter(',')
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
    app.add_option("--iters", o.iters, "timed runs per case (median reported)")
        ->check(CLI::Range(1, 1'000'000))
        ->capture_default_str();
    app.add_option("--warmup", o.warmup, "untimed runs first")->check(CLI::Range(0, 1'000'000))->capture_default_str();
    app.add_option("--isa", o.isa, "GEMM / element-wise variants: all, best, baseline, avx2, avx512")
        ->check(CLI::IsMember({"all", "best", "baseline", "avx2", "avx512"}))
        ->capture_default_str();
    app.add_option("--threads", o.threads, "num_threads values for matmul / attention")
        ->delimiter(',')
        ->check(CLI::Range(1, 1024));
    app.add_option("--vocab", o.vocab, "vocab of the cross-entropy case")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
        ->capture_default_str();
    app.add_option("--seq", o.seq, "sequence length T of the attention case")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
        ->capture_default_str();
    app.add_option("--only", o.only, "comma list of sections: gemm, elementwise, rows, attention, fsdp-copy");
    app.add_option("--copy-dim", o.copy_dim, "fsdp-copy: dim D of the transformer block")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 14))
        ->capture_default_str();
    app.add_option("--copy-world", o.copy_world, "fsdp-copy: ranks the group is sharded over")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 12))
        ->capture_default_str();
    app.add_option("--copy-threads", o.copy_threads, "fsdp-copy: thread counts of the fused kernels")
        ->delimiter(',')
        ->check(CLI::Range(1, 64));
    app.add_option("--json", o.json, "also write every row as JSON to this file");
    app.add_option("--openblas", o.openblas, "libopenblas.so to time cblas_sgemm beside Eigen (gemm)");
    app.add_flag("!--no-check", o.check, "skip the check of each GEMM variant against f64");
    program::parse(app, argc, argv);
    if (o.dims.empty()) throw kernels::InvalidArgument("--dims is empty: expected model dims like 64,128");
    for (size_t b = 0; b <= o.only.size();) {
      size_t e = o.only.find(',', b);
      if (e == std::string::npos) e = o.only.size();
      const std::string section = o.only.substr(b, e - b);
      if (!o.only.empty() && section != "gemm" && section != "elementwise" && section != "rows" &&
          section != "attention" && section != "fsdp-copy")
        throw kernels::InvalidArgument(fmt::format(
            "--only '{}': unknown section '{}', expected gemm, elementwise, rows, attention or fsdp-copy",
            kernels::clip(o.only), kernels::clip(section, 40)));
      b = e + 1;
    }
    fmt::print("kernels-bench: CPU ISA in use {}, rows {}, dims {}, iters {} (median)\n",
               kernels::detail::to_string(kernels::detail::vec_kernels().isa), o.rows, fmt::join(o.dims, ","),
               o.iters);
    Recorder rec;
    int bad = 0;
    if (wants(o, "gemm")) bad += run_gemm(o, rec);
    if (wants(o, "elementwise")) run_elementwise(o, rec);
    if (wants(o, "rows")) run_rows(o, rec);
    if (wants(o, "attention")) run_attention(o, rec);
    if (wants(o, "fsdp-copy")) run_fsdp_copy(o, rec);
    if (!o.json.empty()) {
      std::ofstream f(o.json);
      f << nlohmann::json{{"isa", std::string(kernels::detail::to_string(kernels::detail::vec_kernels().isa))},
                          {"rows", rec.rows}}
               .dump(1)
        << "\n";
      if (!f) throw kernels::InvalidArgument(fmt::format("--json {}: cannot write the file", kernels::clip(o.json)));
    }
    if (bad > 0) {
      fmt::print(stderr, "kernels-bench: {} GEMM variant(s) disagree with the f64 reference\n", bad);
      return program::kMismatch;
    }
    return program::kOk;
  });
}
