// Attention as a composition of the other kernels (so CPU and CUDA share it): per group of
// (batch, head) matrices, S = scale q k^T into a scratch of the stats dtype, a causal softmax row
// kernel that also yields the log-sum-exp, then out = P v. The backward recomputes P from the
// saved lse, then dv = P^T dout, dP = dout v^T, dS = softmax_backward(dP, P) (its row sum
// sum_j P_ij dP_ij equals dout_i . out_i), dq = scale dS k, dk = scale dS^T q.
// Groups are sized so a [g, T, S] scratch stays near kScratchElements (cache-sized on the CPU).
#include "kernels/ops/attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/row_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"
#include "kernels/ops/matmul.h"
#include "kernels/ops/softmax.h"

namespace kernels {
namespace {

constexpr int64_t kScratchElements = int64_t{1} << 19;  // 2 MiB of f32

struct Shapes {
  Dims lead;  // leading dims (identical for q, k, v)
  int64_t t, s, e, ev;
};

Shapes check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  detail::check_floating(op, q, "q");
  detail::check_floating(op, k, "k");
  detail::check_floating(op, v, "v");
  detail::check_same_dtype(op, {{"q", q}, {"k", k}, {"v", v}});
  detail::check_same_device(op, {{"q", q}, {"k", k}, {"v", v}});
  if (q.ndim() < 2 || k.ndim() != q.ndim() || v.ndim() != q.ndim()) {
    throw InvalidArgument(fmt::format(
        "{}: q {}, k {}, v {}: expected [..., T, E], [..., S, E], [..., S, Ev] with the same "
        "number of dims (at least 2)",
        op, q.shape(), k.shape(), v.shape()));
  }
  Shapes s;
  s.lead = q.shape();
  s.lead.pop_back();
  s.lead.pop_back();
  s.t = q.size(-2), s.e = q.size(-1), s.s = k.size(-2), s.ev = v.size(-1);
  Dims kl = k.shape(), vl = v.shape();
  kl.pop_back(), kl.pop_back(), vl.pop_back(), vl.pop_back();
  if (!(kl == s.lead) || !(vl == s.lead) || k.size(-1) != s.e || v.size(-2) != s.s) {
    throw InvalidArgument(fmt::format(
        "{}: q {}, k {}, v {} do not fit [..., T, E], [..., S, E], [..., S, Ev] with identical "
        "leading dims",
        op, q.shape(), k.shape(), v.shape()));
  }
  return s;
}

double scale_of(const AttentionOptions& o, int64_t e) {
  if (o.scale.has_value()) return *o.scale;
  return e > 0 ? 1.0 / std::sqrt(static_cast<double>(e)) : 1.0;
}

// Views t as [outer..., last lead dim, M, N] and calls fn(group views [g, M, N]) over every
// outer index and every group of the last lead dim; `tensors` share the leading dims.
void for_each_group(const Dims& lead, int64_t group, std::vector<Tensor> tensors,
                    const std::function<void(const std::vector<Tensor>&)>& fn) {
  if (lead.empty()) {
    for (Tensor& t : tensors) t = t.defined() ? t.unsqueeze(0) : t;
    fn(tensors);
    return;
  }
  const int nl = lead.size();
  int64_t outer = 1;
  for (int d = 0; d < nl - 1; ++d) outer *= lead[d];
  const int64_t last = lead[nl - 1];
  for (int64_t o = 0; o < outer; ++o) {
    std::vector<Tensor> sel = tensors;
    int64_t rest = o;
    for (int d = nl - 2; d >= 0; --d) {
      const int64_t i = rest % lead[d];
      rest /= lead[d];
      for (Tensor& t : sel) {
        if (t.defined()) t = t.select(d, i);  // highest dim first: lower dims keep their index
      }
    }
    for (int64_t h = 0; h < last; h += group) {
      const int64_t g = std::min(group, last - h);
      std::vector<Tensor> part = sel;
      for (Tensor& t : part) {
        if (t.defined()) t = t.narrow(0, h, g);
      }
      fn(part);
    }
  }
}

Tensor compute_copy(const Tensor& t, DType compute) {
  return t.dtype() == compute ? t : t.to(compute);
}

// On a GPU, a product of two bf16 (or two f16) operands into the f32 scores runs on the tensor
// cores with f32 accumulation straight from the inputs: the same products (exact in f32) as
// after a cast to f32, without the cast's copies. The CPU keeps its f32 path.
bool tensor_core_scores(const Tensor& a, const Tensor& b, DType compute) {
  return a.device().is_cuda() && a.dtype() == b.dtype() && a.dtype() != compute &&
         (a.dtype() == DType::kBF16 || a.dtype() == DType::kF16);
}

// In place on scores [g, T, S]: the causal (or full) softmax with lse out, or (from_lse) the
// probabilities recomputed from the saved lse.
void softmax_rows(const Tensor& scores, const Tensor& lse, int64_t t, bool causal, bool from_lse) {
  detail::SoftmaxPlan p;
  p.outer_shape = scores.shape();
  p.outer_shape.pop_back();
  p.len = scores.size(-1);
  p.x = detail::as_rows(scores, scores.ndim() - 1);
  p.out = p.x;
  p.causal_period = causal ? t : 0;
  p.lse.data = lse.data_ptr();
  p.lse.dtype = lse.dtype();
  p.lse.outer_strides = lse.strides();
  p.from_lse = from_lse;
  if (scores.device().is_cuda()) {
    detail::cuda_softmax(p, scores.device().index);
  } else {
    detail::cpu_softmax(p);
  }
}

}  // namespace

AttentionOutput attention(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionOptions& options) {
  const Shapes s = check_qkv("attention", q, k, v);
  Dims out_shape = s.lead, lse_shape = s.lead;
  out_shape.push_back(s.t);
  out_shape.push_back(s.ev);
  lse_shape.push_back(s.t);
  AttentionOutput r{Tensor::empty(out_shape, q.dtype(), q.device()),
                    Tensor::empty(lse_shape, detail::stats_dtype(q.dtype()), q.device())};
  attention_out(r.out, r.lse, q, k, v, options);
  return r;
}

void attention_out(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, const AttentionOptions& options) {
  constexpr const char* kOp = "attention";
  const Shapes s = check_qkv(kOp, q, k, v);
  const DType compute = detail::stats_dtype(q.dtype());
  Dims out_shape = s.lead, lse_shape = s.lead;
  out_shape.push_back(s.t);
  out_shape.push_back(s.ev);
  lse_shape.push_back(s.t);
  detail::check_floating(kOp, out, "out");
  detail::check_shape(kOp, out, "out", out_shape);
  detail::check_writable(kOp, out, "out");
  detail::check_defined(kOp, lse, "lse");
  detail::check_shape(kOp, lse, "lse", lse_shape);
  detail::check_dtype(kOp, lse, "lse", compute);
  detail::check_writable(kOp, lse, "lse");
  detail::check_same_device(kOp, {{"q", q}, {"out", out}, {"lse", lse}});
  for (const Tensor* in : {&q, &k, &v}) {
    if (detail::may_overlap(out, *in) || detail::may_overlap(lse, *in)) {
      throw InvalidArgument(fmt::format("{}: out or lse overlaps q, k or v", kOp));
    }
  }
  if (options.num_threads < 1) {
    throw InvalidArgument(
        fmt::format("{}: num_threads is {}, expected 1 or more", kOp, options.num_threads));
  }
  if (lse.numel() == 0) return;  // no query rows
  if (s.s == 0) {                // no keys: out 0, lse -inf (NOTE in attention.h)
    Tensor(out).fill_(0.0);
    Tensor(lse).fill_(-std::numeric_limits<double>::infinity());
    return;
  }
  const double scale = scale_of(options, s.e);
  const MatmulOptions mm{.num_threads = options.num_threads};
  const int64_t group = std::max<int64_t>(1, kScratchElements / std::max<int64_t>(1, s.t * s.s));
  const bool lowp = tensor_core_scores(q, k, compute);
  for_each_group(s.lead, group, {q, k, v, out, lse}, [&](const std::vector<Tensor>& g) {
    const Tensor qg = lowp ? g[0] : compute_copy(g[0], compute), kg = lowp ? g[1] : compute_copy(g[1], compute),
                 vg = compute_copy(g[2], compute);
    const int64_t n = qg.size(0);
    Tensor scores = Tensor::empty({n, s.t, s.s}, compute, q.device());
    matmul_out(scores, qg, kg.transpose(1, 2),
               {.alpha = scale, .num_threads = options.num_threads});
    softmax_rows(scores, g[4], s.t, options.causal, false);
    if (g[3].dtype() == compute) {
      matmul_out(g[3], scores, vg, mm);
    } else {
      Tensor tmp = Tensor::empty(g[3].shape(), compute, q.device());
      matmul_out(tmp, scores, vg, mm);
      Tensor(g[3]).copy_(tmp);
    }
  });
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const AttentionOptions& options) {
  check_qkv("attention_backward", q, k, v);
  AttentionGrads g{Tensor::empty(q.shape(), q.dtype(), q.device()),
                   Tensor::empty(k.shape(), k.dtype(), k.device()),
                   Tensor::empty(v.shape(), v.dtype(), v.device())};
  attention_backward_out(g.dq, g.dk, g.dv, dout, q, k, v, out, lse, options);
  return g;
}

void attention_backward_out(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const AttentionOptions& options) {
  constexpr const char* kOp = "attention_backward";
  const Shapes s = check_qkv(kOp, q, k, v);
  const DType compute = detail::stats_dtype(q.dtype());
  Dims out_shape = s.lead, lse_shape = s.lead;
  out_shape.push_back(s.t);
  out_shape.push_back(s.ev);
  lse_shape.push_back(s.t);
  detail::check_floating(kOp, dout, "dout");
  detail::check_shape(kOp, dout, "dout", out_shape);
  detail::check_floating(kOp, out, "out");
  detail::check_shape(kOp, out, "out", out_shape);
  detail::check_defined(kOp, lse, "lse");
  detail::check_shape(kOp, lse, "lse", lse_shape);
  detail::check_dtype(kOp, lse, "lse", compute);
  const detail::Named grads[] = {{"dq", dq}, {"dk", dk}, {"dv", dv}};
  const Dims* shapes[] = {&q.shape(), &k.shape(), &v.shape()};
  for (int i = 0; i < 3; ++i) {
    detail::check_floating(kOp, grads[i].t, grads[i].name);
    detail::check_shape(kOp, grads[i].t, grads[i].name, *shapes[i]);
    detail::check_writable(kOp, grads[i].t, grads[i].name);
    for (const Tensor* in : {&q, &k, &v, &dout, &out, &lse}) {
      if (detail::may_overlap(grads[i].t, *in)) {
        throw InvalidArgument(fmt::format("{}: {} overlaps an input", kOp, grads[i].name));
      }
    }
    for (int j = i + 1; j < 3; ++j) {
      if (detail::may_overlap(grads[i].t, grads[j].t)) {
        throw InvalidArgument(fmt::format("{}: {} overlaps {}", kOp, grads[i].name, grads[j].name));
      }
    }
  }
  detail::check_same_device(
      kOp,
      {{"q", q}, {"dout", dout}, {"out", out}, {"lse", lse}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
  if (options.num_threads < 1) {
    throw InvalidArgument(
        fmt::format("{}: num_threads is {}, expected 1 or more", kOp, options.num_threads));
  }
  (void)out;  // the backward needs only lse; out is checked for shape as PyTorch's API passes it
  const double scale = scale_of(options, s.e);
  const MatmulOptions mm{.num_threads = options.num_threads};
  const int64_t group = std::max<int64_t>(1, kScratchElements / std::max<int64_t>(1, s.t * s.s));
  // Writes src (compute dtype) into dst, or computes straight into dst when dtypes agree.
  auto product_into = [&](const Tensor& dst, const Tensor& a, const Tensor& b, double alpha) {
    if (dst.numel() == 0) return;
    if (dst.dtype() == compute) {
      matmul_out(dst, a, b, {.alpha = alpha, .num_threads = options.num_threads});
      return;
    }
    Tensor tmp = Tensor::empty(dst.shape(), compute, dst.device());
    matmul_out(tmp, a, b, {.alpha = alpha, .num_threads = options.num_threads});
    Tensor(dst).copy_(tmp);
  };
  for_each_group(
      s.lead, group, {q, k, v, dout, lse, dq, dk, dv}, [&](const std::vector<Tensor>& g) {
        const Tensor qg = compute_copy(g[0], compute), kg = compute_copy(g[1], compute),
                     dog = compute_copy(g[3], compute);
        const int64_t n = qg.size(0);
        Tensor p = Tensor::empty({n, s.t, s.s}, compute, q.device());
        const bool qk_lowp = tensor_core_scores(g[0], g[1], compute);
        matmul_out(p, qk_lowp ? g[0] : qg, (qk_lowp ? g[1] : kg).transpose(1, 2),
                   {.alpha = scale, .num_threads = options.num_threads});
        softmax_rows(p, g[4], s.t, options.causal, true);
        product_into(g[7], p.transpose(1, 2), dog, 1.0);  // dv = P^T dout
        Tensor dp = Tensor::empty({n, s.t, s.s}, compute, q.device());
        const bool dv_lowp = tensor_core_scores(g[3], g[2], compute);
        matmul_out(dp, dv_lowp ? g[3] : dog, (dv_lowp ? g[2] : compute_copy(g[2], compute)).transpose(1, 2),
                   mm);                                     // dP = dout v^T
        softmax_backward_out(dp, dp, p, -1);                // dS, in place
        product_into(g[5], dp, kg, scale);                  // dq = scale dS k
        product_into(g[6], dp.transpose(1, 2), qg, scale);  // dk = scale dS^T q
      });
}

}  // namespace kernels
