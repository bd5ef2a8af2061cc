// Tensor parallelism: every style and the GPT plans (sequence parallel or not, loss parallel)
// give one rank's losses and gradients, on tp meshes of 2 and 4 and on a 2x2 (dp, tp) mesh with
// the batch sharded over dp; uneven vocab and MLP shards included; no implicit redistribute
// anywhere in the standard plans; clear errors for bad plans.
#include <catch2/catch.hpp>

#include "nn/optim.h"
#include "nn/tensor_parallel.h"
#include "nn_support.h"
#include "support/checks.h"

using namespace nn;
using namespace nn_test;
using dtensor::Replicate;
using dtensor::Shard;

namespace {

GPTConfig config() {
  GPTConfig c;
  c.vocab = 13;  // uneven over 2 and 4 ranks
  c.dim = 16;
  c.heads = 4;
  c.layers = 2;
  c.max_seq = 8;
  c.mlp_hidden = 22;  // uneven over 4 ranks
  c.bias = true;
  return c;
}

struct Result {
  double loss = 0;
  std::vector<std::pair<std::string, Tensor>> grads;
  std::vector<std::string> implicit;  // implicit redistributes seen
};

// One forward/backward of the GPT on `mesh` (tp over tp_dim; the batch over mesh dim 0 when the
// mesh has two dims) with the given plan; gradients reduced to the parameters' placements.
Result run(const Dims& mesh_shape, int tp_dim, const ParallelPlan* plan, const GPTConfig& cfg) {
  Result res;
  std::mutex mu;
  on_mesh(mesh_shape, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    GPT model(ModuleOptions{comms, DType::kF64}, cfg);
    if (plan) parallelize_module(model, tp_dim, *plan);
    materialize(model, 7);
    const char* data_pl = mesh_shape.size() == 2 ? "S(0),R" : "R";
    DTensor x = place(ids({4, 6}, cfg.vocab, 1), comms, data_pl);
    Tensor t = ids({4, 6}, cfg.vocab, 2);
    t.set_item({3, 5}, -100);
    DTensor targets = place(t, comms, data_pl);
    dtensor::ops::RedistributeLog log;
    dtensor::ops::OpOptions o;
    o.log = &log;
    CrossEntropyLoss ce;
    Ctx ctx(&o), lctx(&o);
    DTensor loss = ce.forward(lctx, model.forward(ctx, x), targets);
    const double lv = loss.full_tensor().item({});
    model.backward(ctx, ce.backward(lctx));
    reduce_gradients(model.named_parameters());
    std::vector<std::pair<std::string, Tensor>> grads;
    for (auto& [n, p] : model.named_parameters()) {
      if (!(p->grad()->placements() == p->placements()))
        throw kernels::InternalError(n + ": gradient not reduced");
      grads.emplace_back(n, p->grad()->full_tensor().clone());
    }
    if (world.rank() == 0) {
      std::lock_guard lk(mu);
      res.loss = lv;
      res.grads = grads;
      for (const auto& e : log.events()) res.implicit.push_back(dtensor::ops::to_string(e));
    }
  });
  return res;
}

void compare(const Result& got, const Result& ref, const std::string& what, testing_support::Checks& checks,
             bool expect_no_implicit = true) {
  checks.check(std::abs(got.loss - ref.loss) <= 1e-12 * std::abs(ref.loss),
               fmt::format("{}: loss {} vs {}", what, got.loss, ref.loss));
  checks.check(got.grads.size() == ref.grads.size(), what + ": parameter count");
  for (size_t i = 0; i < got.grads.size() && i < ref.grads.size(); ++i)
    checks.check(max_abs_diff(got.grads[i].second, ref.grads[i].second) < 1e-12,
                 fmt::format("{}: gradient of {} differs", what, got.grads[i].first));
  if (expect_no_implicit)
    checks.check(got.implicit.empty(),
                 fmt::format("{}: {} implicit redistributes, e.g. {}", what, got.implicit.size(),
                             got.implicit.empty() ? "" : got.implicit[0]));
}

}  // namespace

TEST_CASE("tp: GPT plans equal one rank (tp 2 and 4, sequence parallel or not, 2x2 with dp)", "[nn][tp]") {
  const GPTConfig cfg = config();
  const Result ref = run({1}, 0, nullptr, cfg);
  REQUIRE(ref.grads.size() == 2 + 2 * 16 + 2 + 1);  // biases on
  testing_support::Checks checks;
  int ran = 0;
  for (bool sp : {true, false}) {
    for (bool lp : {true, false}) {
      const ParallelPlan plan = gpt_tensor_parallel_plan(cfg, sp, lp);
      for (int tp : {2, 4}) {
        compare(run({tp}, 0, &plan, cfg), ref, fmt::format("tp {} sp {} loss_parallel {}", tp, sp, lp),
                checks);
        ++ran;
      }
      compare(run({2, 2}, 1, &plan, cfg), ref, fmt::format("dp 2 x tp 2, sp {} loss_parallel {}", sp, lp),
              checks);
      ++ran;
    }
  }
  CHECK(ran == 12);
  checks.report();
}

TEST_CASE("tp: tied embeddings and checkpointed blocks under the plan", "[nn][tp]") {
  GPTConfig cfg = config();
  cfg.tie_embeddings = true;
  cfg.checkpoint_blocks = true;
  const Result ref = run({1}, 0, nullptr, cfg);
  testing_support::Checks checks;
  const ParallelPlan plan = gpt_tensor_parallel_plan(cfg, true, true);
  compare(run({2}, 0, &plan, cfg), ref, "tied + checkpoint, tp 2", checks);
  checks.report();
}

TEST_CASE("tp: the styles on single layers", "[nn][tp]") {
  testing_support::Checks checks;
  // Linear colwise / rowwise with bias, Embedding colwise / rowwise, LayerNorm sequence
  // parallel: output and gradients equal one rank's.
  struct Layer {
    std::string name;
    std::function<std::shared_ptr<Module>(const ModuleOptions&)> make;
    std::shared_ptr<const ParallelStyle> style;
    std::function<DTensor(std::shared_ptr<MeshComms>)> input;
  };
  const std::vector<Layer> layers = {
      {"Linear colwise", [](const ModuleOptions& o) { return std::make_shared<Linear>(o, 6, 7, true); },
       std::make_shared<ColwiseParallel>(),
       [](auto c) {
         return replicated(values({2, 3, 6}, 1), c);
       }},
      {"Linear colwise -> R", [](const ModuleOptions& o) { return std::make_shared<Linear>(o, 6, 7, true); },
       std::make_shared<ColwiseParallel>(Replicate{}),
       [](auto c) {
         return replicated(values({2, 3, 6}, 1), c);
       }},
      {"Linear rowwise", [](const ModuleOptions& o) { return std::make_shared<Linear>(o, 6, 7, true); },
       std::make_shared<RowwiseParallel>(),
       [](auto c) {
         return replicated(values({2, 3, 6}, 1), c);
       }},
      {"Linear rowwise -> S(1)",
       [](const ModuleOptions& o) { return std::make_shared<Linear>(o, 6, 7, true); },
       std::make_shared<RowwiseParallel>(Shard{1}),
       [](auto c) {
         return place(values({2, 3, 6}, 1), c, "S(2)");
       }},
      {"Embedding colwise", [](const ModuleOptions& o) { return std::make_shared<Embedding>(o, 9, 5); },
       std::make_shared<ColwiseParallel>(),
       [](auto c) {
         return replicated(ids({2, 3}, 9, 1), c);
       }},
      {"Embedding rowwise", [](const ModuleOptions& o) { return std::make_shared<Embedding>(o, 9, 5); },
       std::make_shared<RowwiseParallel>(),
       [](auto c) {
         return replicated(ids({2, 3}, 9, 1), c);
       }},
      {"LayerNorm sequence parallel",
       [](const ModuleOptions& o) { return std::make_shared<LayerNorm>(o, 6); },
       std::make_shared<SequenceParallel>(),
       [](auto c) {
         return replicated(values({2, 3, 6}, 1), c);
       }},
  };
  int ran = 0;
  for (const Layer& layer : layers) {
    std::vector<Tensor> want;  // output, then gradients (full)
    std::vector<Tensor> got;
    for (int tp : {1, 2}) {
      std::vector<Tensor> out;
      on_mesh({tp}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        auto m = layer.make(ModuleOptions{comms, DType::kF64});
        if (tp > 1) parallelize_module(*m, 0, {{"", layer.style}});
        materialize(*m, 3);
        randomize(*m, 4);
        Ctx ctx;
        DTensor y = m->forward(ctx, layer.input(comms));
        std::vector<Tensor> mine{y.full_tensor().clone()};
        DTensor dy = replicated(values(y.shape(), 5), comms)
                         .redistribute(dtensor::Placements{dtensor::is_partial(y.placements()[0])
                                                               ? dtensor::Placement{Replicate{}}
                                                               : y.placements()[0]});
        m->backward(ctx, dy);
        reduce_gradients(m->named_parameters());
        for (auto& [n, p] : m->named_parameters()) mine.push_back(p->grad()->full_tensor().clone());
        if (world.rank() == 0) out = mine;
      });
      (tp == 1 ? want : got) = out;
    }
    ++ran;
    checks.check(want.size() == got.size(), layer.name + ": tensor count");
    for (size_t i = 0; i < want.size() && i < got.size(); ++i)
      checks.check(max_abs_diff(want[i], got[i]) < 1e-12,
                   fmt::format("{}: tensor {} differs", layer.name, i));
  }
  CHECK(ran == 7);
  checks.report();
}

TEST_CASE("tp: plan errors name the problem", "[nn][tp]") {
  testing_support::Checks checks;
  on_mesh({4}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    GPTConfig cfg = config();
    cfg.heads = 2;  // 2 heads over 4 ranks
    GPT model(ModuleOptions{comms}, cfg);
    checks.throws<kernels::InvalidArgument>(
        [&] { parallelize_module(model, 0, gpt_tensor_parallel_plan(cfg)); },
        "has 2 heads, which do not split evenly over the 4 ranks", "heads");
    GPT other(ModuleOptions{comms}, config());
    checks.throws<kernels::InvalidArgument>(
        [&] {
          parallelize_module(other, 0, {{"blocks.*.atn.wq", std::make_shared<ColwiseParallel>()}});
        },
        "'blocks.*.atn.wq' (ColwiseParallel(S(-1))) matches no module", "typo");
    checks.throws<kernels::InvalidArgument>(
        [&] {
          parallelize_module(other, 0, {{"blocks.0", std::make_shared<ColwiseParallel>()}});
        },
        "cannot apply to 'blocks.0' (a TransformerBlock)", "wrong module type");
    GPTConfig tied_cfg = config();
    tied_cfg.tie_embeddings = true;
    GPT tied(ModuleOptions{comms}, tied_cfg);
    checks.throws<kernels::InvalidArgument>(
        [&] {
          parallelize_module(tied, 0,
                             {{"tok_emb", std::make_shared<ColwiseParallel>()},
                              {"lm_head", std::make_shared<ColwiseParallel>()}});
        },
        "is shared with", "tied parameter with two placements");
  });
  checks.report();
}
