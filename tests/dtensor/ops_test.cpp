// Every rule of every DTensor op, on meshes of 1, 2 and 2x2 local ranks (every combination of
// one rule per mesh dim), against the same op on the full tensor (a 1-rank mesh), uneven shapes
// included: the output's placements are the rule's, its value the full op's; the backward's
// gradients have the rule's transposed placements and the full backward's values.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <functional>
#include <memory>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/ops/ops.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/matmul.h"
#include "kernels/tensor.h"
#include "support/checks.h"

using namespace dtensor;
using namespace dtensor::ops;
using collectives::Communicator;
using kernels::DType;
using kernels::Tensor;

namespace {

enum class Kind { kFloat, kIds, kTargets };

struct Input {
  Dims shape;
  Kind kind = Kind::kFloat;
  int64_t classes = 0;  // ids and targets: values in [0, classes)
};

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  std::function<RuleSet(const std::vector<DTensorSpec>&)> rules;
  // The op's output (first) from the inputs; fills saved.
  std::function<DTensor(const std::vector<DTensor>&, const OpOptions&, Saved&)> forward;
  // The gradients of the inputs for dy (nullopt for ids / targets).
  std::function<Grads(const Saved&, const DTensor&, const OpOptions&)> backward;
};

// Deterministic full input values: floats in [-1, 1) as a function of the global index; ids
// and targets in [0, classes) (targets: every 7th is ignore_index -100).
Tensor full_input(const Input& in, int salt) {
  const int64_t n = in.shape.product();
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t h = (i + 1) * 7919 + salt * 104729;
    if (in.kind == Kind::kFloat)
      v[i] = static_cast<double>(h % 193) / 96.5 - 1.0;
    else if (in.kind == Kind::kTargets && i % 7 == 3)
      v[i] = -100;
    else
      v[i] = static_cast<double>(h % in.classes);
  }
  return Tensor::from_vector(v, in.shape, in.kind == Kind::kFloat ? DType::kF64 : DType::kI64);
}

Tensor full_dy(const Dims& shape) {
  Input in{shape};
  return full_input(in, 99);
}

// The placement the upstream gradient of an output takes (NOTE [gradient transpose]).
Placements transposed(const Placements& out) {
  Placements t = out;
  for (auto& p : t)
    if (is_partial(p)) p = Replicate{};
  return t;
}

std::string combo_text(const std::vector<int>& rule) {
  std::string s;
  for (int r : rule) s += fmt::format("{}{}", s.empty() ? "" : ",", r);
  return "[" + s + "]";
}

struct Reference {
  Tensor out;
  std::vector<std::optional<Tensor>> grads;
};

// The op on the full tensors (a mesh of one rank).
Reference reference(const OpCase& c) {
  Reference ref;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({1}), world);
    std::vector<DTensor> in;
    for (size_t i = 0; i < c.inputs.size(); ++i)
      in.push_back(
          distribute_tensor(full_input(c.inputs[i], static_cast<int>(i)), comms, parse_placements("R")));
    Saved saved;
    DTensor out = c.forward(in, {}, saved);
    ref.out = out.full_tensor().clone();
    DTensor dy = distribute_tensor(full_dy(out.shape()), comms, parse_placements("R"));
    Grads g = c.backward(saved, dy, {});
    for (auto& t : g) ref.grads.push_back(t ? std::optional<Tensor>(t->full_tensor().clone()) : std::nullopt);
  });
  return ref;
}

// Runs every combination of one rule per mesh dim on a mesh of mesh_shape; returns the count.
int run_case(const OpCase& c, const Reference& ref, const Dims& mesh_shape, testing_support::Checks& checks) {
  const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
  // The rule set for these shapes (rules depend on shapes, e.g. views, but not on placements
  // except view's divisibility, which we pass as all-R and check per combination below).
  std::vector<DTensorSpec> specs;
  auto mesh_ptr = std::make_shared<const DeviceMesh>(mesh);
  for (const Input& in : c.inputs)
    specs.push_back(make_spec(mesh_ptr, Placements(mesh.ndim(), Replicate{}), in.shape,
                              in.kind == Kind::kFloat ? DType::kF64 : DType::kI64));
  const RuleSet rules = c.rules(specs);
  const int nr = static_cast<int>(rules.rules.size());
  std::vector<std::vector<int>> combos;
  std::vector<int> at(mesh.ndim(), 0);
  while (true) {
    combos.push_back(at);
    int m = 0;
    for (; m < mesh.ndim(); ++m) {
      if (++at[m] < nr) break;
      at[m] = 0;
    }
    if (m == mesh.ndim()) break;
  }
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(mesh, world);
    for (const std::vector<int>& combo : combos) {
      const std::string what = fmt::format("{} on mesh {} rules {}", c.name, mesh_shape, combo_text(combo));
      std::vector<Placements> in_pl(c.inputs.size(), Placements(mesh.ndim()));
      Placements out_pl(mesh.ndim());
      std::vector<Placements> grad_pl(c.inputs.size(), Placements(mesh.ndim()));
      for (int m = 0; m < mesh.ndim(); ++m) {
        const Rule& r = rules.rules[combo[m]];
        for (size_t i = 0; i < c.inputs.size(); ++i) {
          in_pl[i][m] = r.inputs[i];
          grad_pl[i][m] = r.grads[i];
        }
        out_pl[m] = r.outputs[0];
      }
      try {
        std::vector<DTensor> in;
        for (size_t i = 0; i < c.inputs.size(); ++i)
          in.push_back(
              distribute_tensor(full_input(c.inputs[i], static_cast<int>(i)), comms, in_pl[i], std::nullopt));
        // A view whose placements the divisibility rules reject is not a rule combination.
        RedistributeLog log;
        OpOptions o;
        o.log = &log;
        Saved saved;
        DTensor out = c.forward(in, o, saved);
        checks.check(log.size() == 0,
                     what + ": an implicit redistribute: " + (log.size() ? to_string(log.events()[0]) : ""));
        checks.check(out.placements() == out_pl,
                     fmt::format("{}: output placements [{}], the rule says [{}]", what,
                                 to_string(out.placements()), to_string(out_pl)));
        const Tensor got = out.full_tensor();
        checks.check(kernels::allclose(got, ref.out, 1e-9, 1e-11), what + ": wrong output");
        DTensor dy =
            distribute_tensor(full_dy(out.shape()), comms, transposed(out.placements()), std::nullopt);
        Grads g = c.backward(saved, dy, o);
        checks.check(log.size() == 0, what + ": an implicit redistribute in backward");
        for (size_t i = 0; i < g.size() && i < ref.grads.size(); ++i) {
          if (!g[i] || !ref.grads[i]) {
            checks.check(!g[i] == !ref.grads[i],
                         fmt::format("{}: gradient {} present on one side only", what, i));
            continue;
          }
          checks.check(g[i]->placements() == grad_pl[i],
                       fmt::format("{}: gradient {} placements [{}], the rule says [{}]", what, i,
                                   to_string(g[i]->placements()), to_string(grad_pl[i])));
          checks.check(kernels::allclose(g[i]->full_tensor(), *ref.grads[i], 1e-9, 1e-11),
                       fmt::format("{}: wrong gradient {}", what, i));
        }
      } catch (const kernels::Error& e) {
        checks.add(what + ": " + e.what());
      }
    }
  });
  return static_cast<int>(combos.size());
}

void check_case(const OpCase& c, int expected_rules) {
  INFO(c.name);
  const Reference ref = reference(c);
  testing_support::Checks checks;
  int ran = 0;
  for (const Dims& mesh : {Dims{1}, Dims{2}, Dims{2, 2}}) ran += run_case(c, ref, mesh, checks);
  // 1 + 2 + 4 ranks: r + r + r^2 combinations.
  CHECK(ran == 2 * expected_rules + expected_rules * expected_rules);
  checks.report();
}

GradSink ret() { return GradSink{}; }

OpCase einsum_case(const std::string& eq, Dims a, Dims b) {
  OpCase c;
  c.name = "einsum(" + eq + ")";
  c.inputs = {{a}, {b}};
  c.rules = [eq](const auto&) { return einsum_rules(eq); };
  c.forward = [eq](const auto& in, const OpOptions& o, Saved& s) { return einsum(eq, in[0], in[1], o, &s); };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    const GradSink sinks[] = {ret(), ret()};
    return einsum_backward(s, dy, sinks, o);
  };
  return c;
}

OpCase binary_case(Pointwise op, Dims a, Dims b) {
  OpCase c;
  c.name = fmt::format("{}({}, {})", op == Pointwise::kAdd ? "add" : "mul", a, b);
  c.inputs = {{a}, {b}};
  c.rules = [op](const auto& s) { return binary_rules(op, s[0].tensor_ndim(), s[1].tensor_ndim()); };
  c.forward = [op](const auto& in, const OpOptions& o, Saved& s) {
    return op == Pointwise::kAdd ? add(in[0], in[1], 0.75, o, &s) : mul(in[0], in[1], o, &s);
  };
  c.backward = [op](const Saved& s, const DTensor& dy, const OpOptions& o) {
    const GradSink sinks[] = {ret(), ret()};
    return op == Pointwise::kAdd ? add_backward(s, dy, sinks, o) : mul_backward(s, dy, sinks, o);
  };
  return c;
}

OpCase unary_case(const std::string& name, Dims shape,
                  std::function<DTensor(const DTensor&, const OpOptions&, Saved*)> f, bool linear) {
  OpCase c;
  c.name = name;
  c.inputs = {{shape}};
  c.rules = [name, linear](const auto& s) { return unary_rules(name, s[0].tensor_ndim(), linear); };
  c.forward = [f](const auto& in, const OpOptions& o, Saved& s) { return f(in[0], o, &s); };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    return Grads{unary_backward(s, dy, o)};
  };
  return c;
}

}  // namespace

TEST_CASE("ops: einsum contractions, every rule", "[ops]") {
  check_case(einsum_case("mk,kn->mn", {7, 5}, {5, 3}), 6);
  check_case(einsum_case("bmk,bkn->bmn", {3, 5, 4}, {3, 4, 3}), 7);
  check_case(einsum_case("btk,nk->btn", {3, 5, 6}, {7, 6}), 7);     // a Linear
  check_case(einsum_case("btn,btk->nk", {3, 5, 7}, {3, 5, 6}), 7);  // its weight gradient
}

TEST_CASE("ops: matmul spells einsum", "[ops]") {
  OpCase c = einsum_case("mk,kn->mn", {5, 4}, {4, 3});
  c.forward = [](const auto& in, const OpOptions& o, Saved& s) { return matmul(in[0], in[1], o, &s); };
  check_case(c, 6);
}

TEST_CASE("ops: element-wise, every rule", "[ops]") {
  check_case(binary_case(Pointwise::kAdd, {5, 6}, {5, 6}), 4);
  check_case(binary_case(Pointwise::kAdd, {3, 5, 6}, {6}), 5);
  check_case(binary_case(Pointwise::kAdd, {3, 5, 6}, {5, 6}), 5);
  check_case(binary_case(Pointwise::kMul, {5, 6}, {5, 6}), 5);
  check_case(binary_case(Pointwise::kMul, {3, 5}, {5}), 5);
  check_case(unary_case(
                 "scale", {5, 3},
                 [](const DTensor& x, const OpOptions& o, Saved* s) { return scale(x, -1.5, o, s); }, true),
             4);
  check_case(unary_case(
                 "gelu", {5, 3},
                 [](const DTensor& x, const OpOptions& o, Saved* s) {
                   return gelu(x, GeluApproximation::kTanh, o, s);
                 },
                 false),
             3);
  check_case(unary_case(
                 "gelu", {3, 5},
                 [](const DTensor& x, const OpOptions& o, Saved* s) {
                   return gelu(x, GeluApproximation::kNone, o, s);
                 },
                 false),
             3);
  check_case(unary_case(
                 "silu", {5, 3}, [](const DTensor& x, const OpOptions& o, Saved* s) { return silu(x, o, s); },
                 false),
             3);
}

TEST_CASE("ops: sum and softmax, every rule", "[ops]") {
  for (const Dims& dims : {Dims{1}, Dims{0, 2}}) {
    OpCase c;
    c.name = fmt::format("sum({})", dims);
    c.inputs = {{{3, 5, 6}}};
    c.rules = [dims](const auto&) {
      std::vector<int> d(dims.begin(), dims.end());
      return sum_rules(3, d);
    };
    c.forward = [dims](const auto& in, const OpOptions& o, Saved& s) { return sum(in[0], dims, o, &s); };
    c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
      return Grads{sum_backward(s, dy, o)};
    };
    check_case(c, 5);
  }
  OpCase c;
  c.name = "softmax";
  c.inputs = {{{3, 5, 7}}};
  c.rules = [](const auto&) { return softmax_rules(3); };
  c.forward = [](const auto& in, const OpOptions& o, Saved& s) { return softmax(in[0], o, &s); };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    return Grads{softmax_backward(s, dy, o)};
  };
  check_case(c, 3);
}

TEST_CASE("ops: norms, every rule", "[ops]") {
  for (int params : {0, 1, 2}) {
    for (bool layer : {false, true}) {
      if (!layer && params == 2) continue;
      OpCase c;
      c.name = fmt::format("{}(params {})", layer ? "layer_norm" : "rms_norm", params);
      c.inputs = {{{3, 5, 6}}};
      for (int i = 0; i < params; ++i) c.inputs.push_back({{6}});
      c.rules = [params, layer](const auto&) { return norm_rules(3, params, layer ? 2 : 1); };
      c.forward = [params, layer](const auto& in, const OpOptions& o, Saved& s) {
        const DTensor* w = params > 0 ? &in[1] : nullptr;
        const DTensor* b = params > 1 ? &in[2] : nullptr;
        return layer ? layer_norm(in[0], w, b, 1e-5, o, &s) : rms_norm(in[0], w, 1e-6, o, &s);
      };
      c.backward = [params](const Saved& s, const DTensor& dy, const OpOptions& o) {
        std::vector<GradSink> sinks(1 + params);
        return norm_backward(s, dy, sinks, o);
      };
      check_case(c, 3);
    }
  }
}

TEST_CASE("ops: embedding, every rule", "[ops]") {
  OpCase c;
  c.name = "embedding";
  c.inputs = {{{11, 6}}, {{3, 5}, Kind::kIds, 11}};
  c.rules = [](const auto&) { return embedding_rules(2); };
  c.forward = [](const auto& in, const OpOptions& o, Saved& s) { return embedding(in[0], in[1], o, &s); };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    const GradSink sinks[] = {ret()};
    Grads g = embedding_backward(s, dy, sinks, o);
    return Grads{g[0]};
  };
  check_case(c, 5);
}

TEST_CASE("ops: cross-entropy (loss parallel included), every rule", "[ops]") {
  OpCase c;
  c.name = "cross_entropy";
  c.inputs = {{{3, 5, 7}}, {{3, 5}, Kind::kTargets, 7}};
  c.rules = [](const auto&) { return cross_entropy_rules(3); };
  c.forward = [](const auto& in, const OpOptions& o, Saved& s) {
    return cross_entropy(in[0], in[1], kernels::LossReduction::kMean, -100, o, &s);
  };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    return Grads{cross_entropy_backward(s, dy, o)};
  };
  check_case(c, 4);
}

TEST_CASE("ops: causal attention, every rule", "[ops]") {
  OpCase c;
  c.name = "attention";
  c.inputs = {{{2, 3, 5, 4}}, {{2, 3, 5, 4}}, {{2, 3, 5, 4}}};
  c.rules = [](const auto&) { return attention_rules(); };
  c.forward = [](const auto& in, const OpOptions& o, Saved& s) {
    return attention(in[0], in[1], in[2], o, &s);
  };
  c.backward = [](const Saved& s, const DTensor& dy, const OpOptions& o) {
    const GradSink sinks[] = {ret(), ret(), ret()};
    return attention_backward(s, dy, sinks, o);
  };
  check_case(c, 3);
}

TEST_CASE("ops: transpose and view, every rule", "[ops]") {
  OpCase t;
  t.name = "transpose";
  t.inputs = {{{3, 5, 6}}};
  t.rules = [](const auto&) { return transpose_rules(3, 1, 2); };
  t.forward = [](const auto& in, const OpOptions& o, Saved&) { return transpose(in[0], 1, 2, o); };
  t.backward = [](const Saved&, const DTensor& dy, const OpOptions& o) {
    return Grads{transpose(dy, 1, 2, o)};
  };
  check_case(t, 5);
  // [3, 5, 8] -> [3, 5, 4, 2]: dims 0 and 1 unchanged, dim 2 split into 4 heads of 2 (4 splits
  // evenly over 2 and 2x2 ranks).
  OpCase v;
  v.name = "view split";
  v.inputs = {{{3, 5, 8}}};
  v.rules = [](const auto& s) { return view_rules(s[0].shape, {3, 5, 4, 2}, {4}, s[0].placements); };
  v.forward = [](const auto& in, const OpOptions& o, Saved&) { return view(in[0], {3, 5, 4, 2}, o); };
  v.backward = [](const Saved&, const DTensor& dy, const OpOptions& o) {
    return Grads{view(dy, {3, 5, 8}, o)};
  };
  check_case(v, 5);
}

TEST_CASE("ops: inputs that fit no rule are redistributed, logged, and their gradients mapped back",
          "[ops]") {
  testing_support::Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2}), world);
    Tensor fa = full_input({{6, 5}}, 0), fb = full_input({{5, 3}}, 1);
    DTensor a = distribute_tensor(fa, comms, parse_placements("S(1)"), std::nullopt);
    DTensor b = distribute_tensor(fb, comms, parse_placements("S(1)"), std::nullopt);
    RedistributeLog log;
    OpOptions o;
    o.log = &log;
    Saved saved;
    DTensor y = einsum("mk,kn->mn", a, b, o, &saved);
    // a S(1) fits the contraction rule; b S(1) must become S(0): one implicit move, logged.
    checks.check(log.size() == 1, fmt::format("{} implicit redistributes logged, expected 1", log.size()));
    if (log.size() == 1) {
      checks.check(to_string(log.events()[0].from) == "S(1)" && to_string(log.events()[0].to) == "S(0)",
                   "logged " + to_string(log.events()[0]));
      checks.check(log.events()[0].route.find("S(1)") != std::string::npos, "the route names the plan");
    }
    checks.check(to_string(y.placements()) == "P", "output " + to_string(y.placements()));
    Tensor want;
    collectives::run_ranks(1, [&](Communicator& w1) {
      auto c1 = std::make_shared<MeshComms>(DeviceMesh::from_shape({1}), w1);
      want = einsum("mk,kn->mn", distribute_tensor(fa, c1, parse_placements("R")),
                    distribute_tensor(fb, c1, parse_placements("R")))
                 .full_tensor()
                 .clone();
    });
    checks.check(kernels::allclose(y.full_tensor(), want, 1e-12, 1e-12), "implicit: wrong value");
    // The gradient of b comes back in b's own placements (S(1)), not the used S(0).
    DTensor dy = distribute_tensor(full_dy(y.shape()), comms, parse_placements("R"), std::nullopt);
    const GradSink sinks[] = {GradSink{}, GradSink{}};
    Grads g = einsum_backward(saved, dy, sinks, o);
    checks.check(to_string(g[1]->placements()) == "S(1)", "b's gradient " + to_string(g[1]->placements()));
    checks.check(log.events().back().backward, "the gradient's move is logged as backward");
    // forbid_implicit refuses, naming the input and the placements.
    OpOptions strict;
    strict.forbid_implicit = true;
    checks.throws<kernels::Unsupported>([&] { einsum("mk,kn->mn", a, b, strict); }, "forbidden",
                                        "forbid_implicit");
  });
  checks.report();
}

TEST_CASE("ops: gradients land in caller buffers (accumulate, overwrite, other placements, dtype)", "[ops]") {
  testing_support::Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2}), world);
    // x S(0) (batch), w R: the weight gradient is P(sum).
    DTensor x = distribute_tensor(full_input({{4, 3, 5}}, 0), comms, parse_placements("S(0)"), std::nullopt);
    DTensor w = distribute_tensor(full_input({{6, 5}}, 1), comms, parse_placements("R"), std::nullopt);
    Saved saved;
    DTensor y = einsum("btk,nk->btn", x, w, {}, &saved);
    DTensor dy = distribute_tensor(full_dy(y.shape()), comms, parse_placements("S(0)"), std::nullopt);
    const GradSink only_w[] = {GradSink{false}, GradSink{}};
    const Tensor dw = einsum_backward(saved, dy, only_w, {})[1]->full_tensor().clone();
    // A P(sum) buffer of the same placements: written in place (same storage), then added to.
    std::optional<DTensor> buf =
        DTensor(comms, make_spec(w.spec().mesh, parse_placements("P"), {6, 5}, DType::kF64),
                Tensor::zeros({6, 5}, DType::kF64));
    const void* before = buf->to_local().data_ptr();
    const GradSink into[] = {GradSink{false}, GradSink{true, &buf, false}};
    einsum_backward(saved, dy, into, {});
    checks.check(buf->to_local().data_ptr() == before, "the buffer's storage was replaced");
    checks.check(kernels::allclose(buf->full_tensor(), dw, 1e-12, 1e-12), "overwrite into a P buffer");
    const GradSink add[] = {GradSink{false}, GradSink{true, &buf, true}};
    einsum_backward(saved, dy, add, {});
    checks.check(kernels::allclose(buf->full_tensor(), kernels::scale(dw, 2.0), 1e-12, 1e-12), "accumulate");
    // An R buffer in f32: the P gradient is reduced into it and cast.
    std::optional<DTensor> rbuf = zeros({6, 5}, DType::kF32, comms, parse_placements("R"));
    const GradSink cast[] = {GradSink{false}, GradSink{true, &rbuf, true}};
    einsum_backward(saved, dy, cast, {});
    checks.check(kernels::allclose(rbuf->full_tensor(), dw, 1e-6, 1e-6), "into an R f32 buffer");
    // bf16 compute into an f32 buffer of the same placements (FSDP's mixed precision): written in
    // place, rounded once.
    {
      DTensor xb(comms, make_spec(x.spec().mesh, x.placements(), x.shape(), DType::kBF16), x.to_local().to(DType::kBF16));
      DTensor wb(comms, make_spec(w.spec().mesh, w.placements(), w.shape(), DType::kBF16), w.to_local().to(DType::kBF16));
      Saved sb;
      DTensor yb = einsum("btk,nk->btn", xb, wb, {}, &sb);
      DTensor dyb(comms, make_spec(dy.spec().mesh, dy.placements(), dy.shape(), DType::kBF16), dy.to_local().to(DType::kBF16));
      std::optional<DTensor> f32buf = DTensor(
          comms, make_spec(w.spec().mesh, parse_placements("P"), {6, 5}, DType::kF32), Tensor::zeros({6, 5}, DType::kF32));
      const void* p32 = f32buf->to_local().data_ptr();
      const GradSink mixed[] = {GradSink{false}, GradSink{true, &f32buf, false}};
      einsum_backward(sb, dyb, mixed, {});
      checks.check(f32buf->to_local().data_ptr() == p32 && f32buf->dtype() == DType::kF32, "bf16 -> f32 buffer in place");
      checks.check(kernels::allclose(f32buf->full_tensor(), dw, 3e-2, 3e-2), "bf16 gradient into an f32 buffer");
    }
    // An empty optional receives the gradient.
    std::optional<DTensor> none;
    const GradSink fresh[] = {GradSink{false}, GradSink{true, &none, true}};
    einsum_backward(saved, dy, fresh, {});
    checks.check(none.has_value() && to_string(none->placements()) == "P", "fresh sink");
  });
  checks.report();
}

TEST_CASE("ops: a Linear weight gradient ([..z],[..y] -> [y,z]) is written as the transposed product", "[ops]") {
  // einsum writes the transposed product straight into the gradient (matmul_out on the [z, y]
  // view of it: C^T = B^T A^T) instead of into a temporary copied transposed afterwards. Shapes
  // around Eigen's tile edges and its small-product path; overwrite into a fresh output and
  // accumulate into a caller's buffer (a Linear's sink).
  const std::vector<std::array<int64_t, 3>> shapes = {{256, 512, 1536}, {256, 2048, 512}, {7, 5, 3},  {100, 49, 50},
                                                      {33, 17, 130},    {64, 96, 4},      {3, 200, 1}};
  testing_support::Checks checks;
  int ran = 0;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({1}), world);
    for (const auto& [t, z, y] : shapes) {
      const std::string what = fmt::format("[{}, {}] x [{}, {}]", 2 * t, z, 2 * t, y);
      const Tensor xf = full_input({{2, t, z}}, 3).to(DType::kF32), dyf = full_input({{2, t, y}}, 4).to(DType::kF32);
      const Tensor want = kernels::matmul(xf.view({2 * t, z}).transpose(0, 1), dyf.view({2 * t, y})).transpose(0, 1).contiguous();
      const DTensor x = distribute_tensor(xf, comms, parse_placements("R"), std::nullopt);
      const DTensor w = distribute_tensor(Tensor::zeros({y, z}, DType::kF32), comms, parse_placements("R"), std::nullopt);
      Saved saved;
      const DTensor out = einsum("abz,yz->aby", x, w, {}, &saved);
      const DTensor dy = distribute_tensor(dyf, comms, parse_placements("R"), std::nullopt);
      checks.check(kernels::allclose(einsum("abz,aby->yz", x, dy, {}).to_local(), want, 1e-5, 1e-5), what + ": overwrite");
      std::optional<DTensor> buf = DTensor(comms, w.spec(), want.clone());
      const void* before = buf->to_local().data_ptr();
      const GradSink add[] = {GradSink{false}, GradSink{true, &buf, true}};
      einsum_backward(saved, dy, add, {});
      checks.check(buf->to_local().data_ptr() == before, what + ": the buffer's storage was replaced");
      checks.check(kernels::allclose(buf->to_local(), kernels::scale(want, 2.0), 1e-5, 1e-5), what + ": accumulate");
      ++ran;
    }
  });
  checks.report();
  CHECK(ran == static_cast<int>(shapes.size()));
}
