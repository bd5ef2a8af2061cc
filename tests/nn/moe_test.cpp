// MoE on one rank against a plain per-token reference loop, and expert parallelism (EP 2, EP 4)
// and tensor parallelism (TP 2, EP 2 x TP 2) against one rank: the same routing, outputs, aux
// loss and gradients.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "nn/moe.h"
#include "nn/tensor_parallel.h"
#include "nn_support.h"
#include "support/checks.h"
#include "support/recording_communicator.h"

using namespace nn;
using namespace nn_test;

namespace {

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

// Every token through each expert it picked, one token at a time, from full tensors.
std::vector<double> reference(const MoEConfig& c, const std::vector<double>& x, const std::vector<double>& wr,
                              const std::vector<double>& w1, const std::vector<double>& w2) {
  const int64_t D = c.dim, H = c.hidden, E = c.experts;
  const int64_t n = static_cast<int64_t>(x.size()) / D;
  std::vector<double> y(x.size(), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> s(E);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) s[e] += x[t * D + d] * wr[e * D + d];
    if (c.score == RouterScore::kSoftmax) {
      double z = 0;
      for (double& v : s) z += (v = std::exp(v));
      for (double& v : s) v /= z;
    } else {
      for (double& v : s) v = 1 / (1 + std::exp(-v));
    }
    std::vector<int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    double sum = 0;
    for (int64_t j = 0; j < c.top_k; ++j) sum += s[order[j]];
    for (int64_t j = 0; j < c.top_k; ++j) {
      const int64_t e = order[j];
      const double g = c.renormalize ? s[e] / sum : s[e];
      for (int64_t h = 0; h < H; ++h) {
        double pre = 0;
        for (int64_t d = 0; d < D; ++d) pre += x[t * D + d] * w1[(e * D + d) * H + h];
        const double a = gelu_tanh(pre);
        for (int64_t d = 0; d < D; ++d) y[t * D + d] += g * a * w2[(e * H + h) * D + d];
      }
    }
  }
  return y;
}

std::vector<double> full(const DTensor& t) { return t.full_tensor().to_vector(); }

bool close(const std::vector<double>& a, const std::vector<double>& b, double rtol) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > rtol * std::max(1.0, std::max(std::abs(a[i]), std::abs(b[i])))) return false;
  return true;
}

// One forward + backward of an MoE over a 1-D mesh of `ep` ranks ("ep"; 1: no EP), x [B, T, D]
// S(0) over it. Full tensors of the results, on every rank.
struct Result {
  std::vector<double> y, dx, grouter, gw1, gw2;
  MoEStats stats;
  std::string placements;  // run_tp: of y, dx, w1 and w2
};

Result run(const MoEConfig& cfg, int ep, const Dims& xshape, testing_support::Recorder* rec = nullptr) {
  std::vector<Result> out(ep);
  collectives::run_ranks(ep, [&](Communicator& world) {
    std::unique_ptr<testing_support::RecordingCommunicator> recorded;
    if (rec) recorded = std::make_unique<testing_support::RecordingCommunicator>(world, *rec);
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({ep}, {"ep"}),
                                             rec ? static_cast<Communicator&>(*recorded) : world);
    MoE m(ModuleOptions{comms, DType::kF64}, cfg);
    if (ep > 1) m.set_expert_parallel(0);
    materialize(m, 1);
    randomize(m, 5, 1.0);
    DTensor x = place(values(xshape, 3), comms, "S(0)");
    DTensor dy = place(values(xshape, 4), comms, "S(0)");
    Ctx ctx;
    DTensor y = m.forward(ctx, x);
    Result& r = out[comms->rank()];
    r.stats = *moe_stats(ctx);
    DTensor dx = *m.backward(ctx, dy);
    if (rec) return;  // only the MoE's own collectives are recorded
    r.y = full(y);
    r.dx = full(dx);
    r.grouter = full(*m.router().grad());
    r.gw1 = full(*m.w1().grad());
    r.gw2 = full(*m.w2().grad());
  });
  return out[0];
}

// The same on a 2-D mesh (ep, tp) with nn::MoETensorParallel over tp: x [B, T, D] S(0) over ep
// and S(1) over tp (sequence parallel), the output reduce-scattered back to S(1).
Result run_tp(const MoEConfig& cfg, int ep, int tp, const Dims& xshape) {
  std::vector<Result> out(ep * tp);
  on_mesh(
      {ep, tp},
      [&](std::shared_ptr<MeshComms> comms, Communicator&) {
        MoE m(ModuleOptions{comms, DType::kF64}, cfg);
        if (ep > 1) m.set_expert_parallel(0);
        MoETensorParallel(dtensor::Shard{1}).apply(m, "moe", 1);
        materialize(m, 1);
        randomize(m, 5, 1.0);
        DTensor x = place(values(xshape, 3), comms, "S(0),S(1)");
        DTensor dy = place(values(xshape, 4), comms, "S(0),S(1)");
        Ctx ctx;
        DTensor y = m.forward(ctx, x);
        Result& r = out[comms->rank()];
        r.stats = *moe_stats(ctx);
        DTensor dx = *m.backward(ctx, dy);
        r.y = full(y);
        r.dx = full(dx);
        r.grouter = full(*m.router().grad());
        r.gw1 = full(*m.w1().grad());
        r.gw2 = full(*m.w2().grad());
        r.placements = dtensor::to_string(y.placements()) + " " + dtensor::to_string(dx.placements()) + " " +
                       dtensor::to_string(m.w1().placements()) + " " + dtensor::to_string(m.w2().placements());
      },
      {"ep", "tp"});
  return out[0];
}

}  // namespace

TEST_CASE("MoE: one rank equals a plain per-token loop over every routed expert", "[nn][moe]") {
  int ran = 0;
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (int64_t k : {1, 2, 3}) {
      ++ran;
      MoEConfig cfg{.dim = 6, .hidden = 5, .experts = 4, .top_k = k, .score = score, .renormalize = k != 3};
      testing_support::Checks checks;
      std::vector<double> y, want;
      MoEStats stats;
      on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
        MoE m(ModuleOptions{comms, DType::kF64}, cfg);
        materialize(m, 1);
        randomize(m, 5, 1.0);
        const Tensor xf = values({3, 4, 6}, 3);
        DTensor x = replicated(xf, comms);
        Ctx ctx;
        y = full(m.forward(ctx, x));
        stats = *moe_stats(ctx);
        want = reference(cfg, xf.to_vector(), full(m.router().data()), full(m.w1().data()), full(m.w2().data()));
      });
      INFO(fmt::format("score {} top_k {}", score == RouterScore::kSoftmax ? "softmax" : "sigmoid", k));
      CHECK(close(y, want, 1e-12));
      const auto routed = std::accumulate(stats.tokens_per_expert.begin(), stats.tokens_per_expert.end(), int64_t{0});
      CHECK(routed == 12 * k);  // dropless: every token reaches k experts
      CHECK(stats.dropped == 0);
      checks.report();
    }
  CHECK(ran == 6);
}

TEST_CASE("MoE: a capacity factor drops the assignments over capacity, in token order", "[nn][moe]") {
  MoEStats stats;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    MoE m(ModuleOptions{comms, DType::kF64},
          MoEConfig{.dim = 6, .hidden = 5, .experts = 4, .top_k = 2, .capacity_factor = 0.5});
    materialize(m, 1);
    randomize(m, 5, 1.0);
    Ctx ctx;
    m.forward(ctx, replicated(values({3, 4, 6}, 3), comms));
    stats = *moe_stats(ctx);
  });
  // capacity ceil(0.5 * 12 * 2 / 4) = 3 per expert: what exceeds it is dropped.
  int64_t over = 0;
  for (int64_t c : stats.tokens_per_expert) over += std::max<int64_t>(0, c - 3);
  CHECK(stats.tokens_per_expert.size() == 4);
  CHECK(over > 0);
  CHECK(stats.dropped == over);
}

TEST_CASE("MoE: expert parallelism 2 and 4 equals one rank (routing, outputs, gradients)", "[nn][moe][ep]") {
  // f64 throughout and the same per-token arithmetic on every layout: only the order in which
  // the router/expert gradient partial sums and the routing statistics are added differs, so
  // 1e-12 relative (a few ulps of f64 over sums of <= 48 terms) is the tolerance.
  int ran = 0;
  for (bool shared : {false, true})
    for (int ep : {2, 4}) {
      ++ran;
      MoEConfig cfg{.dim = 6, .hidden = 5, .experts = 8, .top_k = 2, .aux_loss_coef = 0.1,
                    .shared_expert = shared};
      const Dims xshape{4, 3, 6};
      const Result one = run(cfg, 1, xshape), par = run(cfg, ep, xshape);
      INFO(fmt::format("EP {} shared {}", ep, shared));
      CHECK(par.stats.tokens_per_expert == one.stats.tokens_per_expert);
      CHECK(std::abs(par.stats.aux_loss - one.stats.aux_loss) <= 1e-12 * std::abs(one.stats.aux_loss));
      CHECK(par.stats.aux_loss > 0);
      CHECK(close(par.y, one.y, 1e-12));
      CHECK(close(par.dx, one.dx, 1e-12));
      CHECK(close(par.grouter, one.grouter, 1e-12));
      CHECK(close(par.gw1, one.gw1, 1e-12));
      CHECK(close(par.gw2, one.gw2, 1e-12));
      CHECK(one.y.size() == 72);
      CHECK(one.gw1.size() == 8 * 6 * 5);
    }
  CHECK(ran == 4);
}

TEST_CASE("MoE: tensor parallelism (TP 2, TP 4, EP 2 x TP 2) equals one rank", "[nn][moe][tp]") {
  // Each tp rank computes its slice of every expert's hidden dim on the all-gathered tokens; the
  // partial outputs and input/router gradients are summed over tp. f64: 1e-12 relative.
  int ran = 0;
  for (bool shared : {false, true})
    for (auto [ep, tp] : {std::pair{1, 2}, {1, 4}, {2, 2}}) {
      ++ran;
      MoEConfig cfg{.dim = 6, .hidden = 8, .experts = 4, .top_k = 1, .aux_loss_coef = 0.1,
                    .shared_expert = shared};
      const Dims xshape{4, 4, 6};
      const Result one = run(cfg, 1, xshape), par = run_tp(cfg, ep, tp, xshape);
      INFO(fmt::format("EP {} TP {} shared {}", ep, tp, shared));
      CHECK(par.placements == std::string("S(0),S(1) S(0),S(1) ") + (ep > 1 ? "S(0),S(2) S(0),S(1)" : "R,S(2) R,S(1)"));
      CHECK(par.stats.tokens_per_expert == one.stats.tokens_per_expert);
      // Unbalanced routing: a uniform f_e would give the aux loss no gradient through the softmax.
      CHECK(one.stats.tokens_per_expert != std::vector<int64_t>(4, 4));
      CHECK(std::abs(par.stats.aux_loss - one.stats.aux_loss) <= 1e-12 * std::abs(one.stats.aux_loss));
      CHECK(close(par.y, one.y, 1e-12));
      CHECK(close(par.dx, one.dx, 1e-12));
      CHECK(close(par.grouter, one.grouter, 1e-12));
      CHECK(close(par.gw1, one.gw1, 1e-12));
      CHECK(close(par.gw2, one.gw2, 1e-12));
      CHECK(one.y.size() == 96);
      CHECK(par.gw1.size() == 4 * 6 * 8);
    }
  CHECK(ran == 6);
}

TEST_CASE("MoE: set_aux_grad_scale scales the aux loss's gradient with the loss seed", "[nn][moe]") {
  // backward(s * dy) with scale s is s * backward(dy) with scale 1: the gradient of s * (loss + aux).
  // With scale 1 it is not (the aux term would not be scaled): routing is unbalanced here.
  std::vector<std::vector<double>> grads(3);  // dy, scale 1; 0.25 dy, scale 0.25; 0.25 dy, scale 1
  std::vector<int64_t> tokens;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    MoE m(ModuleOptions{comms, DType::kF64}, MoEConfig{.dim = 6, .hidden = 5, .experts = 4, .top_k = 1,
                                                       .aux_loss_coef = 0.1});
    materialize(m, 1);
    randomize(m, 5, 1.0);
    const DTensor x = place(values({4, 3, 6}, 3), comms, "S(0)");
    const std::pair<double, double> cases[] = {{1.0, 1.0}, {0.25, 0.25}, {0.25, 1.0}};  // dy factor, scale
    for (size_t i = 0; i < 3; ++i) {
      m.set_aux_grad_scale(cases[i].second);
      Ctx ctx;
      m.forward(ctx, x);
      tokens = moe_stats(ctx)->tokens_per_expert;
      Tensor dy = values({4, 3, 6}, 4);
      dy = Tensor::from_vector([&] {
        std::vector<double> v = dy.to_vector();
        for (double& e : v) e *= cases[i].first;
        return v;
      }(), dy.shape(), DType::kF64);
      m.router().zero_grad();
      m.backward(ctx, place(dy, comms, "S(0)"));
      grads[i] = full(*m.router().grad());
    }
  });
  std::vector<double> quarter = grads[0];
  for (double& v : quarter) v *= 0.25;
  CHECK(tokens != std::vector<int64_t>(4, 3));
  CHECK(close(grads[1], quarter, 1e-12));
  CHECK_FALSE(close(grads[2], quarter, 1e-6));
  CHECK(grads[0].size() == 24);
}

TEST_CASE("MoE: EP forward + backward is one statistics all_gather and four row exchanges", "[nn][moe][ep]") {
  using collectives::CollectiveKind;
  for (const double cf : {0.0, 1.0}) {  // 1.0: some assignments dropped, the counts must agree
    CAPTURE(cf);
    testing_support::Recorder rec;
    run(MoEConfig{.dim = 6, .hidden = 5, .experts = 8, .top_k = 2, .capacity_factor = cf}, 4, {4, 3, 6}, &rec);
    CHECK(rec.check_same_calls() == "");
    // The routing statistics' all_gather (which also gives the dispatch its receive counts) and
    // all_to_all_v x 2 (dispatch, combine) forward, x 2 backward; no count all_to_all.
    CHECK(rec.calls() == 5);
    CHECK(rec.calls(CollectiveKind::kAllGather) == 1);
    CHECK(rec.calls(CollectiveKind::kAllToAllV) == 4);
    CHECK(rec.calls(CollectiveKind::kAllToAll) == 0);
  }
}

TEST_CASE("MoE: bad configurations and inputs are named", "[nn][moe]") {
  testing_support::Checks checks;
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    const ModuleOptions o{comms, DType::kF64};
    checks.throws<kernels::InvalidArgument>([&] { MoE(o, MoEConfig{.dim = 4, .experts = 3, .top_k = 4}); },
                                            "top_k 4", "top_k > experts");
    MoE m(o, MoEConfig{.dim = 4, .hidden = 3, .experts = 3, .top_k = 1});
    checks.throws<kernels::InvalidArgument>([&] { m.set_expert_parallel(0); }, "3 experts do not split over 2",
                                            "EP not dividing E");
    checks.throws<kernels::InvalidArgument>([&] { m.set_tensor_parallel(0); }, "hidden size 3 does not split over 2",
                                            "TP not dividing H");
    MoE m3(o, MoEConfig{.dim = 4, .hidden = 4, .experts = 4, .top_k = 1});
    MoETensorParallel(dtensor::Replicate{}).apply(m3, "moe", 0);
    materialize(m3, 1);
    Ctx c3;
    m3.forward(c3, place(values({2, 4}, 1), comms, "S(0)"));  // the hook all-gathers the tokens
    checks.throws<kernels::InvalidArgument>(
        [&] { MoETensorParallel(dtensor::Partial{}).apply(m3, "moe", 0); }, "must be Replicate or Shard",
        "Partial output layout");
    MoE m2(o, MoEConfig{.dim = 4, .hidden = 3, .experts = 4, .top_k = 1});
    m2.set_expert_parallel(0);
    checks.throws<kernels::InvalidArgument>([&] { m2.set_tensor_parallel(0); }, "is the expert-parallel dim",
                                            "TP on the EP dim");
    materialize(m2, 1);
    Ctx ctx;
    checks.throws<kernels::InvalidArgument>([&] { m2.forward(ctx, replicated(values({2, 4}, 1), comms)); },
                                            "needs the tokens split over it", "replicated tokens under EP");
    checks.throws<kernels::InvalidArgument>([&] { m2.forward(ctx, place(values({2, 5}, 1), comms, "S(0)")); },
                                            "expected [..., 4]", "wrong width");
    Ctx empty;
    checks.throws<kernels::InvalidArgument>([&] { m2.backward(empty, place(values({2, 4}, 1), comms, "S(0)")); },
                                            "backward without a forward", "backward first");
  });
  checks.report();
}

TEST_CASE("MoE: tensor parallelism and EP carved from dp are refused together, either order", "[nn][moe][tp]") {
  testing_support::Checks checks;
  const DeviceMesh mesh = DeviceMesh::from_shape({4}, {"dp"});
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world, {}, nullptr, {{0, Dims{2, 2}, {"dp_mod_ep", "ep"}}});
    std::shared_ptr<const MeshComms> ep = comms->unflatten(0, Dims{2, 2}, {"dp_mod_ep", "ep"});
    const MoEConfig cfg{.dim = 4, .hidden = 4, .experts = 4, .top_k = 1};
    MoE carved(ModuleOptions{comms, DType::kF64}, cfg);
    carved.set_expert_parallel(ep, 1);
    checks.throws<kernels::InvalidArgument>([&] { carved.set_tensor_parallel(0); }, "carved from dp",
                                            "TP after carved EP");
    MoE split(ModuleOptions{comms, DType::kF64}, cfg);
    split.set_tensor_parallel(0);
    checks.throws<kernels::InvalidArgument>([&] { split.set_expert_parallel(ep, 1); }, "is not supported",
                                            "carved EP after TP");
  });
  checks.report();
}
