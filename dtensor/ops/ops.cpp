#include "dtensor/ops/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops.h"

namespace dtensor::ops {

using kernels::InternalError;
using kernels::InvalidArgument;
using kernels::Unsupported;

std::string to_string(const RedistributeEvent& e) {
  return fmt::format("{}{}: input {} [{}] -> [{}] via {}", e.op, e.backward ? " (backward)" : "", e.input,
                     to_string(e.from), to_string(e.to), e.route);
}

void RedistributeLog::record(RedistributeEvent event) {
  if (sink) sink(event);
  events_.push_back(std::move(event));
}

namespace {

const Placement kR = Replicate{};
const Placement kP = Partial{ReduceOp::kSum};

bool in_mesh(const DTensor& t) { return t.comms()->in_mesh(); }

// A fresh local tensor for `spec` on this rank (from the mesh's allocator).
Tensor alloc_local(const DTensor& like, const DTensorSpec& spec) {
  if (!in_mesh(like)) return Tensor::empty({0}, spec.dtype);
  return Tensor::empty(spec.layout(like.comms()->rank())->local_shape, spec.dtype, like.to_local().device(),
                       like.comms()->allocator());
}

DTensorSpec spec_like(const DTensor& like, const Placements& placements, const Dims& shape, DType dtype) {
  return make_spec(like.spec().mesh, placements, shape, dtype);
}

DTensor wrap(const DTensor& like, const DTensorSpec& spec, Tensor local) {
  if (!in_mesh(like)) return DTensor(like.comms(), spec, Tensor::empty({0}, spec.dtype));
  return DTensor(like.comms(), spec, std::move(local));
}

// A new output DTensor (spec and freshly allocated local).
std::pair<DTensorSpec, Tensor> new_output(const DTensor& like, const Placements& placements,
                                          const Dims& shape, DType dtype) {
  DTensorSpec spec = spec_like(like, placements, shape, dtype);
  Tensor local = alloc_local(like, spec);
  return {std::move(spec), std::move(local)};
}

DTensor moved(const DTensor& t, const Placements& to, const OpOptions& options, std::string_view op,
              int input, bool backward) {
  if (t.placements() == to) return t;
  if (options.forbid_implicit)
    throw Unsupported(fmt::format(
        "{}{}: input {} has placements [{}], which fit no rule; the cheapest is [{}] and implicit "
        "redistributes are forbidden (OpOptions::forbid_implicit)",
        op, backward ? " (backward)" : "", input, to_string(t.placements()), to_string(to)));
  RedistributeOptions ro{options.choose.planner};
  if (options.log)
    options.log->record({std::string(op), input, t.placements(), to, to_string(t.plan_to(to, ro)), backward});
  return t.redistribute(to, ro);
}

std::vector<DTensor> prepare(const RuleSet& rules, std::initializer_list<const DTensor*> inputs,
                             const OpOptions& options, Strategy& st) {
  std::vector<DTensorSpec> specs;
  for (const DTensor* t : inputs) specs.push_back(t->spec());
  // NOTE [ragged ops] (rules.h): a RaggedShard input only where a rule takes it as it is.
  for (size_t i = 0; i < specs.size(); ++i) {
    const int r = ragged_mesh_dim(specs[i].placements);
    if (r < 0) continue;
    const Placement& p = specs[i].placements[r];
    if (std::none_of(rules.rules.begin(), rules.rules.end(), [&](const Rule& rule) { return rule.inputs[i] == p; }))
      throw Unsupported(fmt::format(
          "{}: input {} has placements [{}]: no rule of {} takes the RaggedShard {} (only element-wise ops on "
          "inputs of one shape keep it; redistribute it to S or R first)",
          rules.op, i, to_string(specs[i].placements), rules.op, to_string(p)));
  }
  st = choose_strategy(rules, specs, (*inputs.begin())->comms()->plans(), options.choose);
  std::vector<DTensor> used;
  int i = 0;
  for (const DTensor* t : inputs) {
    used.push_back(moved(*t, st.inputs[i], options, rules.op, i, false));
    ++i;
  }
  return used;
}

void save(Saved* saved, std::string op, const Strategy& st, std::initializer_list<const DTensor*> given) {
  if (!saved) return;
  saved->op = std::move(op);
  saved->strategy = st;
  saved->given.clear();
  for (const DTensor* t : given) saved->given.push_back(t->placements());
  saved->inputs.clear();
  saved->extras.clear();
  saved->scalars.clear();
}

// NOTE [gradient transpose] for an output of placements `out`: the placements the upstream
// gradient must have for the backward to produce exactly the rule's gradient placements.
Placements transposed_output(const Placements& out, const Placements& dy) {
  Placements want(out.size());
  for (size_t m = 0; m < out.size(); ++m) {
    if (is_partial(out[m]))
      want[m] = kR;
    else if (is_replicate(out[m]))
      want[m] = dy[m] == kP ? kP : kR;
    else
      want[m] = out[m];
  }
  return want;
}

DTensor dy_for(const DTensor& dy, const Placements& out, const OpOptions& options, std::string_view op) {
  return moved(dy, transposed_output(out, dy.placements()), options, op, 0, true);
}

// The gradient placements of the inputs when dy arrives as `dy`: the rule's, except that a
// P(sum) upstream gradient of a replicated output makes every gradient on that mesh dim P(sum)
// (every backward is linear in dy).
std::vector<Placements> grad_placements(const Strategy& st, const Placements& dy) {
  std::vector<Placements> g = st.grads;
  for (size_t m = 0; m < dy.size(); ++m)
    if (is_partial(dy[m]) && is_replicate(st.outputs[0][m]))
      for (auto& p : g) p[m] = kP;
  return g;
}

void check_grad_shape(const DTensor& g, const DTensor& dst, std::string_view op) {
  if (!(g.shape() == dst.shape()))
    throw InvalidArgument(fmt::format("{}: a gradient of shape {} cannot go into a buffer of shape {}", op,
                                      g.shape(), dst.shape()));
}

// Where an op may write gradient i straight into the sink: the sink holds a tensor of the
// gradient's placements, shape and a floating dtype, and the input was not redistributed
// implicitly. Returns the local tensor to write (undefined when not direct) and whether to add.
// `computed` is the dtype the kernel computes in: the sink may hold it, or f32 for bf16/f16 (the
// kernels round once into an f32 gradient buffer).
Tensor direct_target(const GradSink& sink, const Placements& want, const Dims& shape, bool redistributed,
                     DType computed, bool& accumulate) {
  if (!sink.needed || sink.into == nullptr || !sink.into->has_value() || redistributed) return Tensor();
  const DTensor& dst = **sink.into;
  const bool narrow = computed == DType::kBF16 || computed == DType::kF16;
  const bool dtype_ok = dst.dtype() == computed || (narrow && dst.dtype() == DType::kF32);
  if (!(dst.placements() == want) || !(dst.shape() == shape) || !dtype_ok) return Tensor();
  accumulate = sink.accumulate;
  return dst.to_local();
}

}  // namespace

// ---- gradient plumbing ----

DTensor grad_to(const DTensor& grad, const Placements& given, const OpOptions& options, std::string_view op) {
  Placements want(given.size());
  for (size_t m = 0; m < given.size(); ++m) {
    if (is_partial(given[m]))
      want[m] = kR;
    else if (is_replicate(given[m]))
      want[m] = grad.placements()[m] == kP ? kP : kR;
    else
      want[m] = given[m];
  }
  return moved(grad, want, options, op, 0, true);
}

std::optional<DTensor> sink_grad(const GradSink& sink, DTensor g, const OpOptions& options) {
  if (!sink.needed) return std::nullopt;
  if (sink.into == nullptr) return g;
  if (!sink.into->has_value()) {
    *sink.into = std::move(g);
    return std::nullopt;
  }
  DTensor& dst = **sink.into;
  check_grad_shape(g, dst, "sink_grad");
  if (!(g.placements() == dst.placements())) {
    if (options.forbid_implicit)
      throw Unsupported(
          fmt::format("sink_grad: a gradient of placements [{}] must move to its buffer's [{}] and implicit "
                      "redistributes are forbidden",
                      to_string(g.placements()), to_string(dst.placements())));
    g = moved(g, dst.placements(), options, "sink_grad", 0, true);
  }
  if (!in_mesh(dst)) return std::nullopt;
  Tensor src = g.to_local();
  if (src.dtype() != dst.dtype()) src = src.to(dst.dtype());
  if (sink.accumulate)
    kernels::add_out(dst.to_local(), dst.to_local(), src);
  else {
    Tensor d = dst.to_local();
    d.copy_(src);
  }
  return std::nullopt;
}

// ---- einsum ----

namespace {

struct Equation {
  std::string a, b, c;
};

Equation parse_equation(std::string_view eq) {
  const size_t comma = eq.find(','), arrow = eq.find("->");
  return {std::string(eq.substr(0, comma)), std::string(eq.substr(comma + 1, arrow - comma - 1)),
          std::string(eq.substr(arrow + 2))};
}

bool has(const std::string& s, char l) { return s.find(l) != std::string::npos; }

// out (contiguous, shape in c's label order) = (or +=) the product of la and lb.
void einsum_local(const Equation& e, const Tensor& la, const Tensor& lb, const Tensor& out, bool accumulate,
                  int num_threads) {
  std::string batch, m, n, k;
  for (char l : e.c) {
    if (has(e.a, l) && has(e.b, l))
      batch += l;
    else if (has(e.a, l))
      m += l;
    else
      n += l;
  }
  for (char l : e.a)
    if (has(e.b, l) && !has(e.c, l)) k += l;
  auto size_of = [&](char l) -> int64_t {
    if (has(e.a, l)) return la.size(static_cast<int>(e.a.find(l)));
    return lb.size(static_cast<int>(e.b.find(l)));
  };
  for (char l : e.a)
    if (has(e.b, l) && la.size(static_cast<int>(e.a.find(l))) != lb.size(static_cast<int>(e.b.find(l))))
      throw InternalError(fmt::format("einsum {},{}->{}: local extents of '{}' differ ({} vs {})", e.a, e.b,
                                      e.c, l, la.size(static_cast<int>(e.a.find(l))),
                                      lb.size(static_cast<int>(e.b.find(l)))));
  auto product = [&](const std::string& ls) {
    int64_t p = 1;
    for (char l : ls) p *= size_of(l);
    return p;
  };
  const int64_t B = product(batch), M = product(m), N = product(n), K = product(k);
  if (out.numel() == 0) return;
  if (K == 0) {
    Tensor o = out;
    if (!accumulate) o.fill_(0.0);
    return;
  }
  auto order = [](const std::string& from, const std::string& labels) {
    Dims perm;
    for (char l : labels) perm.push_back(static_cast<int64_t>(from.find(l)));
    return perm;
  };
  Tensor A = la.permute(order(e.a, batch + m + k)), Bm = lb.permute(order(e.b, batch + k + n));
  A = batch.empty() ? A.reshape({M, K}) : A.reshape({B, M, K});
  Bm = batch.empty() ? Bm.reshape({K, N}) : Bm.reshape({B, K, N});
  const std::string natural = batch + m + n;
  kernels::MatmulOptions mo;
  mo.beta = accumulate ? 1.0 : 0.0;
  mo.num_threads = num_threads;
  if (natural == e.c && out.is_contiguous()) {
    kernels::matmul_out(batch.empty() ? out.view({M, N}) : out.view({B, M, N}), A, Bm, mo);
    return;
  }
  // One label per group: out in natural order is a (batch of) matrix view, e.g. a Linear weight's
  // gradient "..z,..y->yz" is the transposed [z, y] product; matmul_out writes it in place (a
  // transposed C is the product B^T A^T), with no temporary and no permuted copy.
  if (m.size() == 1 && n.size() == 1 && batch.size() <= 1) {
    kernels::matmul_out(out.permute(order(e.c, natural)), A, Bm, mo);
    return;
  }
  // Output labels in another order: the product in natural order, then a permuted copy.
  Dims natural_shape;
  for (char l : natural) natural_shape.push_back(size_of(l));
  Tensor r = kernels::matmul(A, Bm, {.num_threads = num_threads}).view(natural_shape);
  Tensor permuted = r.permute(order(natural, e.c));
  Tensor o = out;
  if (accumulate)
    kernels::add_out(out, out, permuted);
  else
    o.copy_(permuted);
}

Dims einsum_shape(const Equation& e, const Dims& a, const Dims& b) {
  if (static_cast<int>(e.a.size()) != a.size() || static_cast<int>(e.b.size()) != b.size())
    throw InvalidArgument(
        fmt::format("einsum {},{}->{}: operands of shapes {} and {} do not have {} and {} dims", e.a, e.b,
                    e.c, a, b, e.a.size(), e.b.size()));
  for (size_t i = 0; i < e.a.size(); ++i) {
    const size_t j = e.b.find(e.a[i]);
    if (j != std::string::npos && a[static_cast<int>(i)] != b[static_cast<int>(j)])
      throw InvalidArgument(fmt::format(
          "einsum {},{}->{}: label '{}' has size {} in the first operand {} and {} in the second {}", e.a,
          e.b, e.c, e.a[i], a[static_cast<int>(i)], a, b[static_cast<int>(j)], b));
  }
  Dims out;
  for (char l : e.c)
    out.push_back(has(e.a, l) ? a[static_cast<int>(e.a.find(l))] : b[static_cast<int>(e.b.find(l))]);
  return out;
}

// The einsum, written into *sink's tensor when it fits (see direct_target), else a new DTensor.
DTensor einsum_into(std::string_view equation, const DTensor& a, const DTensor& b, const OpOptions& options,
                    Saved* saved, const GradSink* sink, bool* wrote_sink = nullptr) {
  const RuleSet rules = einsum_rules(equation);
  const Equation e = parse_equation(equation);
  const Dims shape = einsum_shape(e, a.shape(), b.shape());
  if (a.dtype() != b.dtype())
    throw InvalidArgument(
        fmt::format("einsum {}: operands have dtypes {} and {}", equation, a.dtype(), b.dtype()));
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&a, &b}, options, st);
  save(saved, "einsum", st, {&a, &b});
  if (saved) {
    saved->equation = std::string(equation);
    saved->inputs = used;
  }
  bool accumulate = false;
  Tensor target = sink ? direct_target(*sink, st.outputs[0], shape, false, a.dtype(), accumulate) : Tensor();
  if (target.defined()) {
    if (in_mesh(a))
      einsum_local(e, used[0].to_local(), used[1].to_local(), target, accumulate, options.num_threads);
    if (wrote_sink) *wrote_sink = true;
    return **sink->into;
  }
  auto [spec, local] = new_output(a, st.outputs[0], shape, a.dtype());
  if (in_mesh(a)) einsum_local(e, used[0].to_local(), used[1].to_local(), local, false, options.num_threads);
  return wrap(a, spec, std::move(local));
}

}  // namespace

DTensor einsum(std::string_view equation, const DTensor& a, const DTensor& b, const OpOptions& options,
               Saved* saved) {
  return einsum_into(equation, a, b, options, saved, nullptr);
}

Grads einsum_backward(const Saved& saved, const DTensor& dy_in, std::span<const GradSink> sinks,
                      const OpOptions& options) {
  if (sinks.size() != 2) throw InvalidArgument("einsum_backward: two gradient sinks (a, b) are needed");
  const Equation e = parse_equation(saved.equation);
  const std::string op = "einsum(" + saved.equation + ") backward";
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, op);
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  Grads out(2);
  const DTensor& a = saved.inputs[0];
  const DTensor& b = saved.inputs[1];
  for (int i = 0; i < 2; ++i) {
    const GradSink& sink = sinks[i];
    if (!sink.needed) continue;
    const std::string eq = i == 0 ? e.c + "," + e.b + "->" + e.a : e.a + "," + e.c + "->" + e.b;
    const bool implicit = saved.strategy.redistributed[i];
    GradSink direct = sink;
    if (implicit) direct.into = nullptr;
    bool wrote = false;
    DTensor g = i == 0 ? einsum_into(eq, dy, b, options, nullptr, &direct, &wrote)
                       : einsum_into(eq, a, dy, options, nullptr, &direct, &wrote);
    if (!(g.placements() == gp[i]))
      throw InternalError(fmt::format("{}: gradient {} came out [{}], the rule says [{}]", op, i,
                                      to_string(g.placements()), to_string(gp[i])));
    if (wrote) continue;  // written into the sink's own tensor
    if (implicit) g = grad_to(g, saved.given[i], options, op);
    out[i] = sink_grad(sink, std::move(g), options);
  }
  return out;
}

DTensor matmul(const DTensor& a, const DTensor& b, const OpOptions& options, Saved* saved) {
  const int an = a.spec().tensor_ndim(), bn = b.spec().tensor_ndim();
  if (an < 2 || bn < 2 || (bn != 2 && bn != an))
    throw InvalidArgument(fmt::format(
        "matmul: a has {} dims and b {}; supported: a [..., M, K] with b [K, N] or b [..., K, N] of a's rank",
        an, bn));
  static constexpr char kLabels[] = "abcdefgh";
  std::string batch(kLabels, kLabels + (an - 2));
  const std::string eq =
      bn == 2 ? batch + "mk,kn->" + batch + "mn" : batch + "mk," + batch + "kn->" + batch + "mn";
  return einsum(eq, a, b, options, saved);
}

// ---- element-wise ----

namespace {

void check_broadcast(const DTensor& a, const DTensor& b, std::string_view op) {
  const Dims& as = a.shape();
  const Dims& bs = b.shape();
  bool ok = bs.size() <= as.size();
  for (int i = 0; ok && i < bs.size(); ++i) ok = bs[i] == as[as.size() - bs.size() + i];
  if (!ok)
    throw InvalidArgument(fmt::format(
        "{}: the second operand's shape {} must equal the trailing dims of the first's {} (right-aligned "
        "broadcast without size-1 stretching)",
        op, bs, as));
  if (a.dtype() != b.dtype())
    throw InvalidArgument(fmt::format("{}: operands have dtypes {} and {}", op, a.dtype(), b.dtype()));
}

}  // namespace

DTensor add(const DTensor& a, const DTensor& b, double alpha, const OpOptions& options, Saved* saved) {
  check_broadcast(a, b, "add");
  const DTensorSpec specs[] = {a.spec(), b.spec()};
  const RuleSet rules =
      with_ragged_rules(binary_rules(Pointwise::kAdd, a.spec().tensor_ndim(), b.spec().tensor_ndim()), specs);
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&a, &b}, options, st);
  save(saved, "add", st, {&a, &b});
  if (saved) {  // alpha and b's global shape: the backward reads no data, so none is kept
    saved->scalars = {alpha};
    for (int64_t d : used[1].shape()) saved->scalars.push_back(static_cast<double>(d));
  }
  auto [spec, local] = new_output(a, st.outputs[0], a.shape(), a.dtype());
  if (in_mesh(a)) kernels::add_out(local, used[0].to_local(), used[1].to_local(), alpha);
  return wrap(a, spec, std::move(local));
}

Grads add_backward(const Saved& saved, const DTensor& dy_in, std::span<const GradSink> sinks,
                   const OpOptions& options) {
  if (sinks.size() != 2) throw InvalidArgument("add_backward: two gradient sinks (a, b) are needed");
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, "add backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const double alpha = saved.scalars[0];
  Dims b_shape;
  for (size_t i = 1; i < saved.scalars.size(); ++i) b_shape.push_back(static_cast<int64_t>(saved.scalars[i]));
  Grads out(2);
  if (sinks[0].needed) {
    DTensor g(dy.comms(), spec_like(dy, gp[0], dy.shape(), dy.dtype()), dy.to_local());
    if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, "add backward");
    out[0] = sink_grad(sinks[0], std::move(g), options);
  }
  if (sinks[1].needed) {
    const int lead = dy.spec().tensor_ndim() - static_cast<int>(b_shape.size());
    Dims dims;
    for (int d = 0; d < lead; ++d) dims.push_back(d);
    bool accumulate = false;
    Tensor target =
        direct_target(sinks[1], gp[1], b_shape, saved.strategy.redistributed[1], dy.dtype(), accumulate);
    if (lead == 0 && alpha == 1.0 && !target.defined()) {
      // Same shapes: b's gradient is dy itself (shared, as a's).
      DTensor g(dy.comms(), spec_like(dy, gp[1], dy.shape(), dy.dtype()), dy.to_local());
      if (saved.strategy.redistributed[1]) g = grad_to(g, saved.given[1], options, "add backward");
      out[1] = sink_grad(sinks[1], std::move(g), options);
    } else if (target.defined() && alpha == 1.0) {
      if (in_mesh(dy)) kernels::sum_out(target, dy.to_local(), dims, false, accumulate);
    } else {
      auto [spec, local] = new_output(dy, gp[1], b_shape, dy.dtype());
      if (in_mesh(dy)) {
        kernels::sum_out(local, dy.to_local(), dims);
        if (alpha != 1.0) kernels::scale_out(local, local, alpha);
      }
      DTensor g = wrap(dy, spec, std::move(local));
      if (saved.strategy.redistributed[1]) g = grad_to(g, saved.given[1], options, "add backward");
      out[1] = sink_grad(sinks[1], std::move(g), options);
    }
  }
  return out;
}

DTensor mul(const DTensor& a, const DTensor& b, const OpOptions& options, Saved* saved) {
  check_broadcast(a, b, "mul");
  const DTensorSpec specs[] = {a.spec(), b.spec()};
  const RuleSet rules =
      with_ragged_rules(binary_rules(Pointwise::kMul, a.spec().tensor_ndim(), b.spec().tensor_ndim()), specs);
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&a, &b}, options, st);
  save(saved, "mul", st, {&a, &b});
  if (saved) saved->inputs = used;
  auto [spec, local] = new_output(a, st.outputs[0], a.shape(), a.dtype());
  if (in_mesh(a)) kernels::mul_out(local, used[0].to_local(), used[1].to_local());
  return wrap(a, spec, std::move(local));
}

Grads mul_backward(const Saved& saved, const DTensor& dy_in, std::span<const GradSink> sinks,
                   const OpOptions& options) {
  if (sinks.size() != 2) throw InvalidArgument("mul_backward: two gradient sinks (a, b) are needed");
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, "mul backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const DTensor& a = saved.inputs[0];
  const DTensor& b = saved.inputs[1];
  Grads out(2);
  for (int i = 0; i < 2; ++i) {
    if (!sinks[i].needed) continue;
    const DTensor& shape_of = i == 0 ? a : b;
    auto [spec, local] = new_output(dy, gp[i], shape_of.shape(), dy.dtype());
    if (in_mesh(dy)) {
      if (i == 0) {
        kernels::mul_out(local, dy.to_local(), b.to_local());
      } else {
        Tensor prod = kernels::mul(dy.to_local(), a.to_local());
        local.copy_(kernels::sum_to_shape(prod, local.shape()));
      }
    }
    DTensor g = wrap(dy, spec, std::move(local));
    if (saved.strategy.redistributed[i]) g = grad_to(g, saved.given[i], options, "mul backward");
    out[i] = sink_grad(sinks[i], std::move(g), options);
  }
  return out;
}

namespace {

enum class Unary { kScale, kGelu, kSilu };

DTensor unary(Unary kind, const DTensor& x, double param, const OpOptions& options, Saved* saved) {
  static constexpr const char* kNames[] = {"scale", "gelu", "silu"};
  const char* name = kNames[static_cast<int>(kind)];
  const RuleSet rules =
      with_ragged_rules(unary_rules(name, x.spec().tensor_ndim(), kind == Unary::kScale), std::span(&x.spec(), 1));
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&x}, options, st);
  save(saved, name, st, {&x});
  if (saved) {
    saved->scalars = {static_cast<double>(kind), param};
    if (kind != Unary::kScale) saved->inputs = used;
  }
  auto [spec, local] = new_output(x, st.outputs[0], x.shape(), x.dtype());
  if (in_mesh(x)) {
    const Tensor& lx = used[0].to_local();
    switch (kind) {
      case Unary::kScale:
        kernels::scale_out(local, lx, param);
        break;
      case Unary::kGelu:
        kernels::gelu_out(local, lx, static_cast<GeluApproximation>(static_cast<int>(param)));
        break;
      case Unary::kSilu:
        kernels::silu_out(local, lx);
        break;
    }
  }
  return wrap(x, spec, std::move(local));
}

}  // namespace

DTensor scale(const DTensor& x, double alpha, const OpOptions& options, Saved* saved) {
  return unary(Unary::kScale, x, alpha, options, saved);
}
DTensor gelu(const DTensor& x, GeluApproximation approximation, const OpOptions& options, Saved* saved) {
  return unary(Unary::kGelu, x, static_cast<double>(static_cast<int>(approximation)), options, saved);
}
DTensor silu(const DTensor& x, const OpOptions& options, Saved* saved) {
  return unary(Unary::kSilu, x, 0.0, options, saved);
}

DTensor unary_backward(const Saved& saved, const DTensor& dy_in, const OpOptions& options) {
  const std::string op = saved.op + " backward";
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, op);
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const auto kind = static_cast<Unary>(static_cast<int>(saved.scalars[0]));
  auto [spec, local] = new_output(dy, gp[0], dy.shape(), dy.dtype());
  if (in_mesh(dy)) {
    switch (kind) {
      case Unary::kScale:
        kernels::scale_out(local, dy.to_local(), saved.scalars[1]);
        break;
      case Unary::kGelu:
        kernels::gelu_backward_out(local, dy.to_local(), saved.inputs[0].to_local(),
                                   static_cast<GeluApproximation>(static_cast<int>(saved.scalars[1])));
        break;
      case Unary::kSilu:
        kernels::silu_backward_out(local, dy.to_local(), saved.inputs[0].to_local());
        break;
    }
  }
  DTensor g = wrap(dy, spec, std::move(local));
  if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, op);
  return g;
}

// ---- reductions and softmax ----

DTensor sum(const DTensor& x, const Dims& dims, const OpOptions& options, Saved* saved) {
  const int nd = x.spec().tensor_ndim();
  std::vector<int> ds;
  for (int64_t d : dims) ds.push_back(static_cast<int>(d));
  const RuleSet rules = sum_rules(nd, ds);
  std::vector<char> reduced(nd, 0);
  Dims norm;
  for (int d : ds) {
    reduced[d < 0 ? d + nd : d] = 1;
    norm.push_back(d < 0 ? d + nd : d);
  }
  Dims shape;
  for (int d = 0; d < nd; ++d)
    if (!reduced[d]) shape.push_back(x.shape()[d]);
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&x}, options, st);
  save(saved, "sum", st, {&x});
  if (saved) {
    saved->extras = {used[0]};  // shape only
    saved->scalars.assign(norm.begin(), norm.end());
  }
  auto [spec, local] = new_output(x, st.outputs[0], shape, x.dtype());
  if (in_mesh(x)) kernels::sum_out(local, used[0].to_local(), norm);
  return wrap(x, spec, std::move(local));
}

DTensor sum_backward(const Saved& saved, const DTensor& dy_in, const OpOptions& options) {
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, "sum backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const DTensor& x = saved.extras[0];
  auto [spec, local] = new_output(dy, gp[0], x.shape(), dy.dtype());
  if (in_mesh(dy)) {
    Tensor v = dy.to_local();
    std::vector<int> dims(saved.scalars.begin(), saved.scalars.end());
    std::sort(dims.begin(), dims.end());
    for (int d : dims) v = v.unsqueeze(d);
    local.copy_(kernels::expand(v, local.shape()));
  }
  DTensor g = wrap(dy, spec, std::move(local));
  if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, "sum backward");
  return g;
}

DTensor softmax(const DTensor& x, const OpOptions& options, Saved* saved) {
  const RuleSet rules = softmax_rules(x.spec().tensor_ndim());
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&x}, options, st);
  save(saved, "softmax", st, {&x});
  auto [spec, local] = new_output(x, st.outputs[0], x.shape(), x.dtype());
  if (in_mesh(x)) kernels::softmax_out(local, used[0].to_local(), -1);
  DTensor y = wrap(x, spec, std::move(local));
  if (saved) saved->extras = {y};
  return y;
}

DTensor softmax_backward(const Saved& saved, const DTensor& dy_in, const OpOptions& options) {
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, "softmax backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const DTensor& y = saved.extras[0];
  auto [spec, local] = new_output(dy, gp[0], y.shape(), dy.dtype());
  if (in_mesh(dy)) kernels::softmax_backward_out(local, dy.to_local(), y.to_local(), -1);
  DTensor g = wrap(dy, spec, std::move(local));
  if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, "softmax backward");
  return g;
}

// ---- norms ----

namespace {

DType stats_dtype(DType x) { return x == DType::kF64 ? DType::kF64 : DType::kF32; }

void check_norm_param(const DTensor& x, const DTensor* p, const char* what, std::string_view op) {
  if (!p) return;
  const int64_t d = x.shape()[x.spec().tensor_ndim() - 1];
  if (!(p->shape() == Dims{d}))
    throw InvalidArgument(fmt::format("{}: the {} has shape {}, expected [{}] (the last dim of x {})", op,
                                      what, p->shape(), d, x.shape()));
}

DTensor norm_forward(bool layer, const DTensor& x, const DTensor* w, const DTensor* b, double eps,
                     const OpOptions& options, Saved* saved) {
  const char* name = layer ? "layer_norm" : "rms_norm";
  if (x.spec().tensor_ndim() < 1) throw InvalidArgument(fmt::format("{}: x needs at least one dim", name));
  check_norm_param(x, w, "weight", name);
  check_norm_param(x, b, "bias", name);
  const int params = (w ? 1 : 0) + (b ? 1 : 0);
  const int stats = layer ? 2 : 1;
  const RuleSet rules = norm_rules(x.spec().tensor_ndim(), params, stats);
  Strategy st;
  std::vector<DTensor> used;
  if (w && b)
    used = prepare(rules, {&x, w, b}, options, st);
  else if (w)
    used = prepare(rules, {&x, w}, options, st);
  else if (b)
    used = prepare(rules, {&x, b}, options, st);
  else
    used = prepare(rules, {&x}, options, st);
  if (saved) {
    save(saved, name, st, {&x});
    if (w) saved->given.push_back(w->placements());
    if (b) saved->given.push_back(b->placements());
    saved->inputs = used;
    saved->scalars = {layer ? 1.0 : 0.0, w ? 1.0 : 0.0, b ? 1.0 : 0.0, eps};
  }
  Dims stat_shape = x.shape();
  stat_shape.pop_back();
  auto [spec, local] = new_output(x, st.outputs[0], x.shape(), x.dtype());
  auto [rspec, rstd] = new_output(x, st.outputs[1], stat_shape, stats_dtype(x.dtype()));
  DTensorSpec mspec = rspec;
  Tensor mean;
  if (layer) {
    auto mo = new_output(x, st.outputs[2], stat_shape, stats_dtype(x.dtype()));
    mspec = mo.first;
    mean = mo.second;
  }
  if (in_mesh(x)) {
    const Tensor lw = w ? used[1].to_local() : Tensor();
    const Tensor lb = b ? used[w ? 2 : 1].to_local() : Tensor();
    if (layer)
      kernels::layer_norm_out(local, mean, rstd, used[0].to_local(), lw, lb, eps);
    else
      kernels::rms_norm_out(local, rstd, used[0].to_local(), lw, eps);
  }
  if (saved) {
    saved->extras = {wrap(x, rspec, rstd)};
    if (layer) saved->extras.push_back(wrap(x, mspec, mean));
  }
  return wrap(x, spec, std::move(local));
}

}  // namespace

DTensor rms_norm(const DTensor& x, const DTensor* weight, double eps, const OpOptions& options,
                 Saved* saved) {
  return norm_forward(false, x, weight, nullptr, eps, options, saved);
}

DTensor layer_norm(const DTensor& x, const DTensor* weight, const DTensor* bias, double eps,
                   const OpOptions& options, Saved* saved) {
  return norm_forward(true, x, weight, bias, eps, options, saved);
}

Grads norm_backward(const Saved& saved, const DTensor& dy_in, std::span<const GradSink> sinks,
                    const OpOptions& options) {
  const bool layer = saved.scalars[0] != 0, has_w = saved.scalars[1] != 0, has_b = saved.scalars[2] != 0;
  const size_t n_in = 1 + (has_w ? 1 : 0) + (has_b ? 1 : 0);
  const std::string op = saved.op + " backward";
  if (sinks.size() != n_in)
    throw InvalidArgument(
        fmt::format("{}: {} gradient sinks given, the forward had {} inputs", op, sinks.size(), n_in));
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, op);
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const DTensor& x = saved.inputs[0];
  const DTensor* w = has_w ? &saved.inputs[1] : nullptr;
  const DTensor* b = has_b ? &saved.inputs[has_w ? 2 : 1] : nullptr;
  // Targets: the sink's own tensor when it fits, else new locals.
  struct Target {
    Tensor local;
    DTensorSpec spec;
    bool direct = false, accumulate = false;
  };
  std::vector<Target> targets(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    if (!sinks[i].needed) continue;
    const DTensor& in = saved.inputs[i];
    if (i > 0) {
      bool acc = false;
      Tensor t = direct_target(sinks[i], gp[i], in.shape(), saved.strategy.redistributed[i], dy.dtype(), acc);
      if (t.defined()) {
        targets[i].local = t;
        targets[i].direct = true;
        targets[i].accumulate = acc;
        continue;
      }
    }
    auto [spec, local] = new_output(dy, gp[i], in.shape(), i == 0 ? dy.dtype() : in.dtype());
    targets[i].local = local;
    targets[i].spec = spec;
  }
  if (in_mesh(dy)) {
    const Tensor& lw = w ? w->to_local() : Tensor();
    const Tensor& dw = w ? targets[1].local : Tensor();
    const Tensor& db = b ? targets[has_w ? 2 : 1].local : Tensor();
    // One accumulate flag serves both parameter gradients: split the call when they differ.
    const bool acc_w = w && targets[1].direct && targets[1].accumulate;
    const bool acc_b = b && targets[has_w ? 2 : 1].direct && targets[has_w ? 2 : 1].accumulate;
    if (layer) {
      const Tensor& mean = saved.extras[1].to_local();
      const Tensor& rstd = saved.extras[0].to_local();
      if (!w || !b || acc_w == acc_b) {
        kernels::layer_norm_backward_out(targets[0].local, dw, db, dy.to_local(), x.to_local(), lw, mean,
                                         rstd, acc_w || acc_b);
      } else {
        kernels::layer_norm_backward_out(targets[0].local, dw, Tensor(), dy.to_local(), x.to_local(), lw,
                                         mean, rstd, acc_w);
        kernels::layer_norm_backward_out(Tensor(), Tensor(), db, dy.to_local(), x.to_local(), lw, mean, rstd,
                                         acc_b);
      }
    } else {
      kernels::rms_norm_backward_out(targets[0].local, dw, dy.to_local(), x.to_local(), lw,
                                     saved.extras[0].to_local(), acc_w);
    }
  }
  Grads out(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    if (!sinks[i].needed || targets[i].direct) continue;
    DTensor g = wrap(dy, targets[i].spec, targets[i].local);
    if (saved.strategy.redistributed[i]) g = grad_to(g, saved.given[i], options, op);
    out[i] = sink_grad(sinks[i], std::move(g), options);
  }
  return out;
}

// ---- embedding ----

namespace {

// The global index of the first row this rank holds of a dim-0 sharded table (0 when the table
// is not sharded on dim 0).
int64_t row_start(const DTensor& w) {
  if (!in_mesh(w) || !w.spec().is_sharded(0)) return 0;
  return w.spec().layout(w.comms()->rank())->global_offset[0];
}

void check_ids(const DTensor& ids, std::string_view op) {
  if (ids.dtype() != DType::kI64 && ids.dtype() != DType::kI32)
    throw InvalidArgument(fmt::format("{}: ids have dtype {}, expected i64 or i32", op, ids.dtype()));
}

}  // namespace

DTensor embedding(const DTensor& weight, const DTensor& ids, const OpOptions& options, Saved* saved) {
  check_ids(ids, "embedding");
  if (weight.spec().tensor_ndim() != 2)
    throw InvalidArgument(
        fmt::format("embedding: the weight has shape {}, expected [num_embeddings, dim]", weight.shape()));
  const RuleSet rules = embedding_rules(ids.spec().tensor_ndim());
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&weight, &ids}, options, st);
  save(saved, "embedding", st, {&weight, &ids});
  if (saved) saved->inputs = used;
  Dims shape = ids.shape();
  shape.push_back(weight.shape()[1]);
  auto [spec, local] = new_output(weight, st.outputs[0], shape, weight.dtype());
  if (in_mesh(weight)) {
    kernels::EmbeddingOptions eo;
    eo.row_start = row_start(used[0]);
    eo.num_embeddings = weight.shape()[0];
    kernels::embedding_out(local, used[0].to_local(), used[1].to_local(), eo);
  }
  return wrap(weight, spec, std::move(local));
}

Grads embedding_backward(const Saved& saved, const DTensor& dy_in, std::span<const GradSink> sinks,
                         const OpOptions& options) {
  if (sinks.size() != 1)
    throw InvalidArgument("embedding_backward: one gradient sink (the weight) is needed");
  Grads out(2);
  if (!sinks[0].needed) return out;
  const DTensor dy = dy_for(dy_in, saved.strategy.outputs[0], options, "embedding backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dy.placements());
  const DTensor& w = saved.inputs[0];
  const DTensor& ids = saved.inputs[1];
  kernels::EmbeddingOptions eo;
  eo.row_start = row_start(w);
  eo.num_embeddings = w.shape()[0];
  bool accumulate = false;
  Tensor target =
      direct_target(sinks[0], gp[0], w.shape(), saved.strategy.redistributed[0], dy.dtype(), accumulate);
  if (target.defined()) {
    if (in_mesh(dy)) kernels::embedding_backward_out(target, dy.to_local(), ids.to_local(), eo, accumulate);
    return out;
  }
  auto [spec, local] = new_output(dy, gp[0], w.shape(), dy.dtype());
  if (in_mesh(dy)) kernels::embedding_backward_out(local, dy.to_local(), ids.to_local(), eo, false);
  DTensor g = wrap(dy, spec, std::move(local));
  if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, "embedding backward");
  out[0] = sink_grad(sinks[0], std::move(g), options);
  return out;
}

// ---- cross-entropy ----

namespace {

// A DTensor of `shape` with this rank's `local`, Partial(op) on the given mesh dims, and on the
// others the logits' placement of the same (row) dim or R.
DTensor row_stat(const DTensor& like, const Placements& logits_pl, const std::vector<char>& vocab_dims,
                 ReduceOp op, const Dims& shape, int dim_offset, Tensor local) {
  Placements pl(logits_pl.size());
  for (size_t m = 0; m < pl.size(); ++m) {
    if (vocab_dims[m])
      pl[m] = Partial{op};
    else if (const auto* s = std::get_if<Shard>(&logits_pl[m]))
      pl[m] = Shard{s->dim + dim_offset};
    else
      pl[m] = kR;
  }
  return wrap(like, spec_like(like, pl, shape, local.dtype()), std::move(local));
}

}  // namespace

DTensor cross_entropy(const DTensor& logits, const DTensor& targets, kernels::LossReduction reduction,
                      int64_t ignore_index, const OpOptions& options, Saved* saved) {
  check_ids(targets, "cross_entropy");
  const int nd = logits.spec().tensor_ndim();
  Dims row_shape = logits.shape();
  row_shape.pop_back();
  if (nd < 1 || !(targets.shape() == row_shape))
    throw InvalidArgument(
        fmt::format("cross_entropy: targets have shape {}, expected {} (logits {} without the class dim)",
                    targets.shape(), row_shape, logits.shape()));
  if (reduction == kernels::LossReduction::kNone)
    throw Unsupported("cross_entropy: reduction none is not supported on DTensors (use mean or sum)");
  const RuleSet rules = cross_entropy_rules(nd);
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&logits, &targets}, options, st);
  save(saved, "cross_entropy", st, {&logits, &targets});
  const DTensor& lg = used[0];
  const DTensor& tg = used[1];
  const DeviceMesh& mesh = logits.device_mesh();
  const int mesh_ndim = mesh.ndim();
  std::vector<char> vocab_dims(mesh_ndim, 0), row_dims(mesh_ndim, 0);
  bool vocab_sharded = false, rows_sharded = false;
  for (int m = 0; m < mesh_ndim; ++m) {
    if (mesh.size(m) == 1) continue;
    if (st.rule[m] >= 0 && rules.rules[st.rule[m]].communicates)
      vocab_dims[m] = vocab_sharded = true;
    else if (is_shard(st.inputs[0][m]))
      row_dims[m] = rows_sharded = true;
  }
  const DType sdt = stats_dtype(logits.dtype());
  const kernels::Device device = logits.to_local().device();
  const int64_t V = logits.shape()[nd - 1];
  const int64_t rows_local =
      in_mesh(lg) ? lg.to_local().numel() / std::max<int64_t>(lg.to_local().size(-1), 1) : 0;
  Tensor lg2 = in_mesh(lg) ? lg.to_local().reshape({rows_local, lg.to_local().size(-1)}) : Tensor();
  Tensor tg1 = in_mesh(tg) ? tg.to_local().reshape({rows_local}) : Tensor();

  // Divisor of the mean: the number of non-ignored rows over the whole (row-sharded) batch.
  double count = 1.0;
  if (reduction == kernels::LossReduction::kMean) {
    Tensor c = Tensor::zeros({1}, DType::kF64);
    if (in_mesh(tg)) {
      int64_t n = 0;
      const Tensor host = tg1.device().is_cpu() ? tg1 : tg1.to(kernels::Device{});
      const Tensor t64 = host.dtype() == DType::kI64 ? host.contiguous() : host.to(DType::kI64);
      const int64_t* p = t64.data<int64_t>();
      for (int64_t i = 0; i < t64.numel(); ++i) n += p[i] != ignore_index;
      c.data<double>()[0] = static_cast<double>(n);
    }
    if (rows_sharded) {
      Placements pl(mesh_ndim, kR);
      for (int m = 0; m < mesh_ndim; ++m)
        if (row_dims[m]) pl[m] = kP;
      DTensor cd = wrap(lg, spec_like(lg, pl, {1}, DType::kF64), c.to(device));
      c = cd.redistribute(Placements(mesh_ndim, kR)).to_local().to(kernels::Device{});
    }
    count = in_mesh(tg) ? c.data<double>()[0] : 1.0;
  }
  const double loss_scale = reduction == kernels::LossReduction::kMean ? 1.0 / count : 1.0;
  kernels::CrossEntropyOptions co;
  co.ignore_index = ignore_index;
  co.reduction = kernels::LossReduction::kSum;
  co.grad_scale = loss_scale;

  Tensor loss_local = Tensor::empty({}, sdt, device);
  Tensor dlogits_local = alloc_local(lg, lg.spec());
  if (!vocab_sharded) {
    if (in_mesh(lg)) {
      kernels::cross_entropy_out(loss_local, dlogits_local.reshape({rows_local, lg2.size(1)}), lg2, tg1, co);
      if (dlogits_local.numel() > 0 && !dlogits_local.is_contiguous())
        throw InternalError("cross_entropy: dlogits buffer is not contiguous");
    }
  } else {
    // Loss parallel: the row statistics of this rank's vocab columns, reduced over the vocab's
    // mesh dims (max, then the rescaled sums and the target logits in one all-reduce).
    const int64_t vocab_start = in_mesh(lg) ? lg.spec().layout(lg.comms()->rank())->global_offset[nd - 1] : 0;
    kernels::CrossEntropyRowStats s;
    if (in_mesh(lg)) {
      s = kernels::cross_entropy_shard_stats(lg2, tg1, std::min(vocab_start, V), V, ignore_index);
    } else {
      s.max = Tensor::empty({0}, sdt, device);
      s.sum_exp = Tensor::empty({0}, sdt, device);
      s.target_logit = Tensor::empty({0}, sdt, device);
    }
    Dims local_rows = in_mesh(lg) ? lg.to_local().shape() : Dims{0};
    local_rows.pop_back();
    Tensor mx = in_mesh(lg) ? s.max.reshape(local_rows) : s.max;
    // Reduce the max over the vocab dims to R there.
    Placements stat_pl(mesh_ndim);
    for (int m = 0; m < mesh_ndim; ++m) {
      if (vocab_dims[m])
        stat_pl[m] = kR;
      else if (const auto* sh = std::get_if<Shard>(&st.inputs[0][m]))
        stat_pl[m] = *sh;
      else
        stat_pl[m] = kR;
    }
    DTensor max_p = row_stat(lg, st.inputs[0], vocab_dims, ReduceOp::kMax, row_shape, 0, mx.contiguous());
    Tensor global_max = max_p.redistribute(stat_pl).to_local();
    Tensor gmax1 = in_mesh(lg) ? global_max.reshape({rows_local}) : global_max;
    if (in_mesh(lg)) kernels::rescale_sum_exp_(s.sum_exp, s.max, gmax1);
    // [2, rows...]: sum_exp and target_logit, summed over the vocab dims in one transition.
    Dims pair_local = local_rows;
    pair_local.insert(0, 2);
    Tensor pair = Tensor::empty(pair_local, sdt, device);
    if (in_mesh(lg)) {
      pair.select(0, 0).copy_(s.sum_exp.reshape(local_rows));
      pair.select(0, 1).copy_(s.target_logit.reshape(local_rows));
    }
    Dims pair_shape = row_shape;
    pair_shape.insert(0, 2);
    Placements pair_dst(mesh_ndim);
    for (int m = 0; m < mesh_ndim; ++m) {
      if (const auto* sh = std::get_if<Shard>(&stat_pl[m]))
        pair_dst[m] = Shard{sh->dim + 1};
      else
        pair_dst[m] = kR;
    }
    DTensor pair_p = row_stat(lg, st.inputs[0], vocab_dims, ReduceOp::kSum, pair_shape, 1, pair);
    Tensor summed = pair_p.redistribute(pair_dst).to_local();
    if (in_mesh(lg)) {
      Tensor gsum = summed.select(0, 0).reshape({rows_local});
      Tensor gtarget = summed.select(0, 1).reshape({rows_local});
      Tensor l = kernels::cross_entropy_loss_from_stats(gmax1, gsum, gtarget, tg1, co);
      loss_local.copy_(l);
      kernels::cross_entropy_shard_backward_out(dlogits_local.reshape({rows_local, lg2.size(1)}), lg2, tg1,
                                                std::min(vocab_start, V), gmax1, gsum, co);
    }
  }
  if (in_mesh(lg) && loss_scale != 1.0) kernels::scale_out(loss_local, loss_local, loss_scale);
  if (saved) saved->extras = {wrap(lg, lg.spec(), dlogits_local)};
  const DTensorSpec loss_spec = spec_like(lg, st.outputs[0], {}, sdt);
  return wrap(lg, loss_spec, loss_local);
}

DTensor cross_entropy_backward(const Saved& saved, const DTensor& dloss_in, const OpOptions& options) {
  // The loss is a scalar: a Partial upstream gradient is reduced (it is one number).
  const DTensor dloss = moved(dloss_in, Placements(dloss_in.placements().size(), kR), options,
                              "cross_entropy backward", 0, true);
  const DTensor& dl = saved.extras[0];
  DTensor g = dl;
  const double scale_by = in_mesh(dloss) ? dloss.to_local().item({}) : 1.0;
  if (scale_by != 1.0) {
    auto [spec, local] = new_output(dl, dl.placements(), dl.shape(), dl.dtype());
    if (in_mesh(dl)) kernels::scale_out(local, dl.to_local(), scale_by);
    g = wrap(dl, spec, std::move(local));
  }
  if (saved.strategy.redistributed[0]) g = grad_to(g, saved.given[0], options, "cross_entropy backward");
  return g;
}

// ---- attention ----

DTensor attention(const DTensor& q, const DTensor& k, const DTensor& v, const OpOptions& options,
                  Saved* saved) {
  for (const DTensor* t : {&q, &k, &v})
    if (t->spec().tensor_ndim() != 4)
      throw InvalidArgument(fmt::format("attention: q, k, v must be [B, H, T, E]; got shape {}", t->shape()));
  if (!(q.shape() == k.shape()) || !(q.shape() == v.shape()))
    throw InvalidArgument(
        fmt::format("attention: q {}, k {} and v {} must have one shape", q.shape(), k.shape(), v.shape()));
  const RuleSet rules = attention_rules();
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&q, &k, &v}, options, st);
  save(saved, "attention", st, {&q, &k, &v});
  Dims lse_shape = q.shape();
  lse_shape.pop_back();
  auto [spec, local] = new_output(q, st.outputs[0], q.shape(), q.dtype());
  auto [lspec, lse] = new_output(q, st.outputs[1], lse_shape, stats_dtype(q.dtype()));
  kernels::AttentionOptions ao;
  ao.causal = true;
  ao.num_threads = options.num_threads;
  if (in_mesh(q))
    kernels::attention_out(local, lse, used[0].to_local(), used[1].to_local(), used[2].to_local(), ao);
  DTensor out = wrap(q, spec, std::move(local));
  if (saved) {
    saved->inputs = used;
    saved->extras = {out, wrap(q, lspec, lse)};
  }
  return out;
}

Grads attention_backward(const Saved& saved, const DTensor& dout_in, std::span<const GradSink> sinks,
                         const OpOptions& options) {
  if (sinks.size() != 3)
    throw InvalidArgument("attention_backward: three gradient sinks (q, k, v) are needed");
  const DTensor dout = dy_for(dout_in, saved.strategy.outputs[0], options, "attention backward");
  const std::vector<Placements> gp = grad_placements(saved.strategy, dout.placements());
  std::vector<std::pair<DTensorSpec, Tensor>> g;
  for (int i = 0; i < 3; ++i) g.push_back(new_output(dout, gp[i], saved.inputs[i].shape(), dout.dtype()));
  kernels::AttentionOptions ao;
  ao.causal = true;
  ao.num_threads = options.num_threads;
  if (in_mesh(dout))
    kernels::attention_backward_out(g[0].second, g[1].second, g[2].second, dout.to_local(),
                                    saved.inputs[0].to_local(), saved.inputs[1].to_local(),
                                    saved.inputs[2].to_local(), saved.extras[0].to_local(),
                                    saved.extras[1].to_local(), ao);
  Grads out(3);
  for (int i = 0; i < 3; ++i) {
    if (!sinks[i].needed) continue;
    DTensor t = wrap(dout, g[i].first, g[i].second);
    if (saved.strategy.redistributed[i]) t = grad_to(t, saved.given[i], options, "attention backward");
    out[i] = sink_grad(sinks[i], std::move(t), options);
  }
  return out;
}

// ---- views ----

DTensor transpose(const DTensor& x, int d0, int d1, const OpOptions& options) {
  const int nd = x.spec().tensor_ndim();
  const RuleSet rules = transpose_rules(nd, d0, d1);
  if (d0 < 0) d0 += nd;
  if (d1 < 0) d1 += nd;
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&x}, options, st);
  Dims shape = x.shape();
  std::swap(shape[d0], shape[d1]);
  const DTensorSpec spec = spec_like(x, st.outputs[0], shape, x.dtype());
  return wrap(x, spec, in_mesh(x) ? used[0].to_local().transpose(d0, d1) : Tensor());
}

DTensor view(const DTensor& x, const Dims& shape, const OpOptions& options) {
  const RuleSet rules = view_rules(x.shape(), shape, x.device_mesh().shape(), x.placements());
  Strategy st;
  std::vector<DTensor> used = prepare(rules, {&x}, options, st);
  const DTensorSpec spec = spec_like(x, st.outputs[0], shape, x.dtype());
  if (!in_mesh(x)) return wrap(x, spec, Tensor());
  const Dims local_shape = spec.layout(x.comms()->rank())->local_shape;
  if (local_shape.product() != used[0].to_local().numel())
    throw InternalError(fmt::format("view {} -> {}: local shard {} cannot become {} under [{}]", x.shape(),
                                    shape, used[0].to_local().shape(), local_shape,
                                    to_string(st.outputs[0])));
  return wrap(x, spec, used[0].to_local().reshape(local_shape));
}

}  // namespace dtensor::ops
