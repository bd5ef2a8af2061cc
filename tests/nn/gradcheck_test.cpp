// Every layer's backward against central finite differences, in f64, on a mesh of one rank:
// the loss sum(forward(x) * r) for a fixed r, differentiated in every parameter (all elements of
// small ones, 40 spread over large ones) and in the input. Frozen parameters (requires_grad
// false: LoRA's base weights) must get no gradient.
#include <catch2/catch.hpp>

#include "nn/layers.h"
#include "nn/moe.h"
#include "nn/transformer.h"
#include "nn_support.h"
#include "support/checks.h"

using namespace nn;
using namespace nn_test;

namespace {

constexpr double kEps = 1e-6;

double dot(const DTensor& y, const Tensor& r) {
  const std::vector<double> a = y.full_tensor().to_vector(), b = r.to_vector();
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<int64_t> sample(int64_t n) {
  std::vector<int64_t> out;
  if (n <= 40) {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
  } else {
    for (int64_t k = 0; k < 40; ++k) out.push_back(k * n / 40 + (k % 3));
  }
  return out;
}

void compare(double numeric, double analytic, const std::string& what, testing_support::Checks& checks,
             int& count) {
  ++count;
  const double tol = 1e-7 + 1e-5 * std::max(std::abs(numeric), std::abs(analytic));
  checks.check(std::abs(numeric - analytic) <= tol,
               fmt::format("{}: finite difference {:.10g}, backward {:.10g}", what, numeric, analytic));
}

// loss(): the scalar at the current parameter and input values (no gradients);
// analytic(): runs forward + backward, leaving parameter gradients, returns the input gradient.
struct Problem {
  std::function<double()> loss;
  std::function<std::optional<DTensor>()> analytic;
  DTensor* input = nullptr;  // perturbed for the input gradient (nullptr: none)
};

// Returns the number of elements checked.
int gradcheck(Module& m, const Problem& pb, const std::string& what, testing_support::Checks& checks) {
  m.zero_grad();
  const std::optional<DTensor> dx = pb.analytic();
  int count = 0;
  auto perturb = [&](const Tensor& local, int64_t i) {
    double* d = local.data<double>();
    const double keep = d[i];
    d[i] = keep + kEps;
    const double up = pb.loss();
    d[i] = keep - kEps;
    const double down = pb.loss();
    d[i] = keep;
    return (up - down) / (2 * kEps);
  };
  for (auto& [name, p] : m.named_parameters()) {
    if (!p->requires_grad) {
      if (p->grad()) checks.add(fmt::format("{}: frozen {} got a gradient", what, name));
      continue;
    }
    if (!p->grad()) {
      checks.add(fmt::format("{}: no gradient for {}", what, name));
      continue;
    }
    const Tensor local = p->data().to_local();
    const std::vector<double> g = p->grad()->full_tensor().to_vector();
    for (int64_t i : sample(local.numel()))
      compare(perturb(local, i), g[i], fmt::format("{} d/d{}[{}]", what, name, i), checks, count);
  }
  if (pb.input) {
    if (!dx) {
      checks.add(what + ": no input gradient");
    } else {
      const Tensor local = pb.input->to_local();
      const std::vector<double> g = dx->full_tensor().to_vector();
      for (int64_t i : sample(local.numel()))
        compare(perturb(local, i), g[i], fmt::format("{} d/dx[{}]", what, i), checks, count);
    }
  }
  return count;
}

// The module's forward on x, against r of the output's shape.
Problem module_problem(Module& m, DTensor& x, int salt, bool input_grad = true) {
  Problem pb;
  auto r = std::make_shared<Tensor>();
  {
    Ctx ctx;
    *r = values(m.forward(ctx, x).shape(), salt);
  }
  pb.loss = [&m, &x, r] {
    Ctx ctx;
    return dot(m.forward(ctx, x), *r);
  };
  pb.analytic = [&m, &x, r] {
    Ctx ctx;
    DTensor y = m.forward(ctx, x);
    return m.backward(ctx, replicated(*r, y.comms()));
  };
  if (input_grad) pb.input = &x;
  return pb;
}

ModuleOptions f64(const std::shared_ptr<MeshComms>& comms) { return ModuleOptions{comms, DType::kF64}; }

void run_check(const std::string& what, int expected_min,
               const std::function<int(std::shared_ptr<MeshComms>, testing_support::Checks&)>& body) {
  testing_support::Checks checks;
  int count = 0;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) { count = body(comms, checks); });
  INFO(what);
  CHECK(count >= expected_min);
  checks.report();
}

}  // namespace

TEST_CASE("gradcheck: Linear, with and without bias", "[nn][gradcheck]") {
  for (bool bias : {true, false})
    run_check(fmt::format("Linear bias={}", bias), bias ? 35 + 7 + 30 : 35 + 30,
              [&](auto comms, auto& checks) {
                Linear l(f64(comms), 5, 7, bias);
                materialize(l, 1);
                randomize(l, 3);
                DTensor x = replicated(values({2, 3, 5}, 7), comms);
                return gradcheck(l, module_problem(l, x, 11), "Linear", checks);
              });
}

TEST_CASE("gradcheck: Linear with LoRA adapters and a frozen base weight", "[nn][gradcheck][lora]") {
  // lora_A 3x5 + lora_B 7x3 + bias 7 + input 30 elements.
  run_check("Linear LoRA", 15 + 21 + 7 + 30, [](auto comms, auto& checks) {
    Linear l(f64(comms), 5, 7, true);
    l.enable_lora(3, 6.0);
    l.weight().requires_grad = false;
    materialize(l, 1);
    randomize(l, 3);  // B != 0, so A's gradient is not trivially zero
    checks.check(l.lora_scale() == 2.0, "scale alpha / rank");
    DTensor x = replicated(values({2, 3, 5}, 7), comms);
    return gradcheck(l, module_problem(l, x, 11), "Linear LoRA", checks);
  });
}

TEST_CASE("LoRA: init (A uniform within 1/sqrt(in), B zero) leaves the GPT's output unchanged", "[nn][lora]") {
  testing_support::Checks checks;
  int layers = 0;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    GPTConfig cfg;
    cfg.vocab = 11;
    cfg.dim = 8;
    cfg.heads = 2;
    cfg.layers = 2;
    cfg.max_seq = 6;
    GPT base(f64(comms), cfg), lora(f64(comms), cfg);
    layers = add_lora(lora, 4, 8.0);
    materialize(base, 1);
    materialize(lora, 1);
    for (auto& [name, p] : lora.named_parameters()) {
      checks.check(p->requires_grad == is_lora_parameter(name), name + ": only adapters train");
      if (name.size() > 7 && name.compare(name.size() - 7, 7, ".lora_A") == 0) {
        for (double v : p->data().full_tensor().to_vector())
          checks.check(std::abs(v) <= 1.0 / std::sqrt(static_cast<double>(p->shape()[1])), name + " within bound");
      }
      if (name.size() > 7 && name.compare(name.size() - 7, 7, ".lora_B") == 0)
        for (double v : p->data().full_tensor().to_vector()) checks.check(v == 0.0, name + " starts at zero");
    }
    checks.check(lora.parameter("blocks.1.mlp.fc2.lora_B").shape() == Dims{8, 4}, "fc2.lora_B [out, rank]");
    checks.check(lora.parameter("blocks.0.attn.wq.lora_A").shape() == Dims{4, 8}, "wq.lora_A [rank, in]");
    DTensor x = replicated(ids({2, 5}, 11, 1), comms);
    Ctx c1, c2;
    checks.check(kernels::equal(base.forward(c1, x).full_tensor(), lora.forward(c2, x).full_tensor()),
                 "B = 0: the logits equal the base model's");
    Linear l(f64(comms), 4, 3);
    l.enable_lora(2, 1.0);
    bool twice = false, bad = false;
    try { l.enable_lora(2, 1.0); } catch (const kernels::InvalidArgument&) { twice = true; }
    Linear m(f64(comms), 4, 3);
    try { m.enable_lora(0, 1.0); } catch (const kernels::InvalidArgument&) { bad = true; }
    checks.check(twice && bad, "a second enable_lora and rank 0 are refused");
  });
  checks.report();
  CHECK(layers == 12);  // 2 blocks x (wq, wk, wv, wo, fc1, fc2)
}

TEST_CASE("gradcheck: GPT with LoRA adapters (frozen base)", "[nn][gradcheck][lora]") {
  run_check("GPT LoRA", 300, [&](auto comms, auto& checks) {
    GPTConfig cfg;
    cfg.vocab = 11;
    cfg.dim = 8;
    cfg.heads = 2;
    cfg.layers = 2;
    cfg.max_seq = 6;
    GPT model(f64(comms), cfg);
    add_lora(model, 2, 4.0);
    materialize(model, 1);
    randomize(model, 5);
    DTensor x = replicated(ids({2, 5}, 11, 1), comms);
    DTensor targets = replicated(ids({2, 5}, 11, 2), comms);
    CrossEntropyLoss ce;
    Problem pb;
    pb.loss = [&] {
      Ctx ctx, lctx;
      return ce.forward(lctx, model.forward(ctx, x), targets).full_tensor().item({});
    };
    pb.analytic = [&]() -> std::optional<DTensor> {
      Ctx ctx, lctx;
      DTensor logits = model.forward(ctx, x);
      ce.forward(lctx, logits, targets);
      model.backward(ctx, ce.backward(lctx));
      return std::nullopt;
    };
    return gradcheck(model, pb, "GPT LoRA", checks);
  });
}

TEST_CASE("gradcheck: Embedding", "[nn][gradcheck]") {
  run_check("Embedding", 36, [](auto comms, auto& checks) {
    Embedding e(f64(comms), 9, 4);
    materialize(e, 1);
    DTensor x = replicated(ids({3, 5}, 9, 1), comms);
    return gradcheck(e, module_problem(e, x, 5, false), "Embedding", checks);
  });
}

TEST_CASE("gradcheck: RMSNorm and LayerNorm", "[nn][gradcheck]") {
  run_check("RMSNorm", 6 + 40, [](auto comms, auto& checks) {
    RMSNorm n(f64(comms), 6, 1e-6);
    materialize(n, 1);
    randomize(n, 2, 1.0);
    DTensor x = replicated(values({2, 4, 6}, 3), comms);
    return gradcheck(n, module_problem(n, x, 4), "RMSNorm", checks);
  });
  run_check("LayerNorm", 12 + 40, [](auto comms, auto& checks) {
    LayerNorm n(f64(comms), 6, 1e-5);
    materialize(n, 1);
    randomize(n, 2, 1.0);
    DTensor x = replicated(values({2, 4, 6}, 3), comms);
    return gradcheck(n, module_problem(n, x, 4), "LayerNorm", checks);
  });
  run_check("LayerNorm without affine", 40, [](auto comms, auto& checks) {
    LayerNorm n(f64(comms), 6, 1e-5, false);
    DTensor x = replicated(values({2, 4, 6}, 3), comms);
    return gradcheck(n, module_problem(n, x, 4), "LayerNorm(no affine)", checks);
  });
}

TEST_CASE("gradcheck: MLP (both GELU forms), attention, block", "[nn][gradcheck]") {
  for (auto approx : {kernels::GeluApproximation::kTanh, kernels::GeluApproximation::kNone})
    run_check("MLP", 80, [&](auto comms, auto& checks) {
      MLP m(f64(comms), 6, 10, true, approx);
      materialize(m, 1);
      randomize(m, 5);
      DTensor x = replicated(values({2, 3, 6}, 3), comms);
      return gradcheck(m, module_problem(m, x, 4), "MLP", checks);
    });
  run_check("CausalSelfAttention", 160, [](auto comms, auto& checks) {
    CausalSelfAttention a(f64(comms), 8, 2, true);
    materialize(a, 1);
    randomize(a, 5);
    DTensor x = replicated(values({2, 5, 8}, 3), comms);
    return gradcheck(a, module_problem(a, x, 4), "attention", checks);
  });
  for (NormKind norm : {NormKind::kLayerNorm, NormKind::kRMSNorm})
    run_check("TransformerBlock", 200, [&](auto comms, auto& checks) {
      GPTConfig cfg;
      cfg.dim = 8;
      cfg.heads = 2;
      cfg.norm = norm;
      cfg.bias = true;
      TransformerBlock b(f64(comms), cfg);
      materialize(b, 1);
      randomize(b, 5);
      DTensor x = replicated(values({2, 5, 8}, 3), comms);
      return gradcheck(b, module_problem(b, x, 4), "block", checks);
    });
}

TEST_CASE("gradcheck: checkpointed block equals the plain block's gradients", "[nn][gradcheck]") {
  run_check("Checkpoint", 200, [](auto comms, auto& checks) {
    GPTConfig cfg;
    cfg.dim = 8;
    cfg.heads = 2;
    auto inner = std::make_shared<TransformerBlock>(f64(comms), cfg);
    Checkpoint c(inner);
    materialize(c, 1);
    randomize(c, 5);
    DTensor x = replicated(values({2, 5, 8}, 3), comms);
    return gradcheck(c, module_problem(c, x, 4), "checkpoint(block)", checks);
  });
}

TEST_CASE("gradcheck: GPT with the cross-entropy loss", "[nn][gradcheck]") {
  for (bool tie : {false, true})
    run_check(fmt::format("GPT tie={}", tie), 300, [&](auto comms, auto& checks) {
      GPTConfig cfg;
      cfg.vocab = 11;
      cfg.dim = 8;
      cfg.heads = 2;
      cfg.layers = 2;
      cfg.max_seq = 6;
      cfg.tie_embeddings = tie;
      cfg.checkpoint_blocks = tie;  // one of the two runs recomputes its blocks
      GPT model(f64(comms), cfg);
      materialize(model, 1);
      randomize(model, 5);
      DTensor x = replicated(ids({2, 5}, 11, 1), comms);
      Tensor tfull = ids({2, 5}, 11, 2);
      tfull.set_item({1, 2}, -100);  // an ignored position
      DTensor targets = replicated(tfull, comms);
      CrossEntropyLoss ce;
      Problem pb;
      pb.loss = [&] {
        Ctx ctx, lctx;
        return ce.forward(lctx, model.forward(ctx, x), targets).full_tensor().item({});
      };
      pb.analytic = [&]() -> std::optional<DTensor> {
        Ctx ctx, lctx;
        DTensor logits = model.forward(ctx, x);
        ce.forward(lctx, logits, targets);
        model.backward(ctx, ce.backward(lctx));
        return std::nullopt;
      };
      return gradcheck(model, pb, "GPT", checks);
    });
}

// The MoE's backward returns d(outer loss + aux): the finite differences differentiate the same
// sum. Top-k and capacity are piecewise constant; the values keep every score gap far above kEps.
TEST_CASE("gradcheck: MoE (scores, renormalisation, capacity, shared expert) and a GPT of MoE blocks",
          "[nn][gradcheck][moe]") {
  struct Case {
    RouterScore score;
    bool renormalize;
    double capacity;
    bool shared;
    int64_t top_k;
  };
  const Case cases[] = {{RouterScore::kSoftmax, true, 0.0, false, 2},
                        {RouterScore::kSigmoid, true, 0.0, true, 2},
                        {RouterScore::kSoftmax, false, 0.0, false, 1},
                        {RouterScore::kSigmoid, false, 1.0, false, 2}};
  int ran = 0;
  for (const Case& c : cases) {
    ++ran;
    run_check(fmt::format("MoE case {}", ran), 24 + 40 + 40 + 40 + (c.shared ? 30 + 30 : 0), [&](auto comms, auto& checks) {
      MoEConfig cfg{.dim = 6, .hidden = 5, .experts = 4, .top_k = c.top_k, .score = c.score,
                    .renormalize = c.renormalize, .capacity_factor = c.capacity, .aux_loss_coef = 0.5,
                    .shared_expert = c.shared};
      MoE m(f64(comms), cfg);
      materialize(m, 1);
      randomize(m, 5, 1.0);
      DTensor x = replicated(values({2, 5, 6}, 3), comms);
      const Tensor r = values({2, 5, 6}, 4);
      Problem pb;
      pb.loss = [&] {
        Ctx ctx;
        const double main = dot(m.forward(ctx, x), r);
        return main + moe_aux_loss(ctx);
      };
      pb.analytic = [&] {
        Ctx ctx;
        m.forward(ctx, x);
        return m.backward(ctx, replicated(r, comms));
      };
      pb.input = &x;
      return gradcheck(m, pb, "MoE", checks);
    });
  }
  CHECK(ran == 4);
  run_check("GPT with MoE blocks", 300, [&](auto comms, auto& checks) {
    GPTConfig cfg;
    cfg.vocab = 11;
    cfg.dim = 8;
    cfg.heads = 2;
    cfg.layers = 2;
    cfg.max_seq = 6;
    cfg.moe.experts = 4;
    cfg.moe.top_k = 2;
    cfg.moe.aux_loss_coef = 0.5;
    cfg.moe_every = 2;  // block 1 only
    GPT model(f64(comms), cfg);
    materialize(model, 1);
    randomize(model, 5);
    checks.check(model.named_parameters().size() > 0 &&
                     model.module("blocks.1.moe").type() == "MoE" && model.module("blocks.0.mlp").type() == "MLP",
                 "moe_every 2 makes block 1 (only) an MoE block");
    DTensor x = replicated(ids({2, 5}, 11, 1), comms);
    DTensor targets = replicated(ids({2, 5}, 11, 2), comms);
    CrossEntropyLoss ce;
    Problem pb;
    pb.loss = [&] {
      Ctx ctx, lctx;
      const double l = ce.forward(lctx, model.forward(ctx, x), targets).full_tensor().item({});
      return l + moe_aux_loss(ctx);
    };
    pb.analytic = [&]() -> std::optional<DTensor> {
      Ctx ctx, lctx;
      DTensor logits = model.forward(ctx, x);
      ce.forward(lctx, logits, targets);
      model.backward(ctx, ce.backward(lctx));
      return std::nullopt;
    };
    return gradcheck(model, pb, "GPT(MoE)", checks);
  });
}
