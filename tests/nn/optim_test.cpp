// Optimizers over sharded parameters equal the same steps on full parameters; their state has
// the parameters' placements; clip_grad_norm_ returns the true global norm (mixtures of sharded
// and replicated gradients, 2-D meshes) and scales like PyTorch; reduce_gradients; safetensors.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "kernels/format.h"
#include "nn/memory.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/tensor_parallel.h"
#include "nn_support.h"
#include "program/main.h"
#include "support/checks.h"

using namespace nn;
using namespace nn_test;

namespace {

GPTConfig config() {
  GPTConfig c;
  c.vocab = 13;
  c.dim = 8;
  c.heads = 4;
  c.layers = 1;
  c.max_seq = 6;
  return c;
}

struct Trained {
  std::vector<Tensor> params;
  std::vector<double> norms;
  std::vector<std::string> state_placements;
};

// Three steps of `optimizer` with clipping at `clip` on the GPT (tp over the last mesh dim).
Trained train(const Dims& mesh_shape, const std::string& optimizer, double clip) {
  Trained out;
  std::mutex mu;
  on_mesh(mesh_shape, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    const GPTConfig cfg = config();
    GPT model(ModuleOptions{comms, DType::kF64}, cfg);
    const int tp_dim = mesh_shape.size() - 1;
    if (mesh_shape.back() > 1) parallelize_module(model, tp_dim, gpt_tensor_parallel_plan(cfg));
    materialize(model, 5);
    const NamedParameters params = model.named_parameters();
    std::unique_ptr<Optimizer> opt;
    if (optimizer == "adamw") {
      kernels::AdamWOptions o;
      o.lr = 1e-2;
      o.weight_decay = 0.1;
      opt = std::make_unique<AdamW>(params, o);
    } else {
      kernels::SgdOptions o;
      o.lr = 0.1;
      o.momentum = 0.9;
      o.nesterov = true;
      o.weight_decay = 0.01;
      opt = std::make_unique<SGD>(params, o);
    }
    const char* data_pl = mesh_shape.size() == 2 ? "S(0),R" : "R";
    std::vector<double> norms;
    for (int step = 0; step < 3; ++step) {
      DTensor x = place(ids({4, 6}, cfg.vocab, step), comms, data_pl);
      DTensor t = place(ids({4, 6}, cfg.vocab, step + 10), comms, data_pl);
      CrossEntropyLoss ce;
      Ctx ctx, lctx;
      ce.forward(lctx, model.forward(ctx, x), t);
      model.backward(ctx, ce.backward(lctx));
      reduce_gradients(params);
      norms.push_back(clip_grad_norm_(params, clip));
      opt->step();
      opt->zero_grad();
    }
    std::vector<Tensor> full;
    for (auto& [n, p] : params) full.push_back(p->data().full_tensor().clone());
    std::vector<std::string> states;
    for (auto& [n, p] : params) {
      const DTensor& s = opt->state(n, optimizer == "adamw" ? "exp_avg" : "momentum_buffer");
      states.push_back(s.placements() == p->placements() ? "same"
                                                         : n + ": " + dtensor::to_string(s.placements()));
    }
    if (world.rank() == 0) {
      std::lock_guard lk(mu);
      out.params = full;
      out.norms = norms;
      out.state_placements = states;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("optim: AdamW and SGD on sharded parameters equal full ones; state is sharded alike",
          "[nn][optim]") {
  for (const std::string opt : {"adamw", "sgd"}) {
    INFO(opt);
    const Trained ref = train({1}, opt, 0.5);
    REQUIRE(ref.norms.size() == 3);
    CHECK(ref.norms[0] > 0.5);  // clipping was active
    for (const Dims& mesh : {Dims{2}, Dims{4}, Dims{2, 2}}) {
      INFO(fmt::format("mesh {}", mesh));
      const Trained got = train(mesh, opt, 0.5);
      REQUIRE(got.params.size() == ref.params.size());
      for (size_t i = 0; i < ref.params.size(); ++i)
        CHECK(max_abs_diff(got.params[i], ref.params[i]) < 1e-12);
      for (int s = 0; s < 3; ++s) CHECK(got.norms[s] == Approx(ref.norms[s]).epsilon(1e-12));
      for (const std::string& s : got.state_placements) CHECK(s == "same");
    }
  }
}

TEST_CASE("optim: clip_grad_norm_ counts every element once, on every rank", "[nn][optim]") {
  testing_support::Checks checks;
  // Gradients with known values: a sharded one S(0) over dim 0, a replicated one, and on the
  // 2x2 mesh one sharded over both dims.
  on_mesh({2, 2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    auto a = std::make_shared<Parameter>(comms, Dims{5, 3}, DType::kF64, Init::zeros(),
                                         dtensor::parse_placements("S(0),R"));
    auto b = std::make_shared<Parameter>(comms, Dims{4}, DType::kF64, Init::zeros(),
                                         dtensor::parse_placements("R,R"));
    auto c = std::make_shared<Parameter>(comms, Dims{7, 2}, DType::kF64, Init::zeros(),
                                         dtensor::parse_placements("S(0),S(1)"));
    NamedParameters params{{"a", a}, {"b", b}, {"c", c}};
    double want = 0;
    for (auto& [n, p] : params) {
      p->materialize(0, n);
      Tensor full = values(p->shape(), static_cast<int>(n[0]));
      for (double v : full.to_vector()) want += v * v;
      p->grad() = dtensor::distribute_tensor(full, comms, p->placements(), std::nullopt);
    }
    want = std::sqrt(want);
    const double norm = clip_grad_norm_(params, 0.0);
    checks.check(std::abs(norm - want) < 1e-12, fmt::format("norm {} vs {}", norm, want));
    // Clipping to half the norm halves every gradient (coefficient max / (norm + 1e-6)).
    const double clipped = clip_grad_norm_(params, want / 2);
    checks.check(std::abs(clipped - want) < 1e-12, "returns the norm before clipping");
    checks.check(std::abs(clip_grad_norm_(params, 0.0) - want / 2 * want / (want + 1e-6)) < 1e-9,
                 "clipped norm");
    // The infinity norm.
    double inf = 0;
    for (auto& [n, p] : params)
      for (double v : p->grad()->full_tensor().to_vector()) inf = std::max(inf, std::abs(v));
    checks.check(std::abs(clip_grad_norm_(params, 0.0, INFINITY) - inf) < 1e-15, "infinity norm");
    // A Partial gradient is refused, naming the parameter.
    b->grad() = DTensor(
        comms, dtensor::make_spec(b->data().spec().mesh, dtensor::parse_placements("P,R"), {4}, DType::kF64),
        Tensor::zeros({4}, DType::kF64));
    checks.throws<kernels::InvalidArgument>([&] { clip_grad_norm_(params, 1.0); },
                                            "gradient of 'b' is still P", "partial gradient");
    checks.throws<kernels::InvalidArgument>([&] { clip_grad_norm_(params, 1.0, 3.0); }, "norm_type 3",
                                            "norm type");
    // An optimizer refuses a gradient that is not in the parameter's placements.
    SGD sgd({{"b", b}}, kernels::SgdOptions{});
    checks.throws<kernels::InvalidArgument>([&] { sgd.step(); }, "reduce the gradients first",
                                            "unreduced gradient");
    // reduce_gradients sums it.
    b->grad() = DTensor(
        comms, dtensor::make_spec(b->data().spec().mesh, dtensor::parse_placements("P,R"), {4}, DType::kF64),
        Tensor::full({4}, 1.5, DType::kF64));
    reduce_gradients(params);
    checks.check(to_string(b->grad()->placements()) == "R,R", "reduced placements");
    checks.check(b->grad()->to_local().to_vector() == std::vector<double>(4, 3.0), "reduced values");
  });
  checks.report();
}

TEST_CASE("optim: clip_grad_norm_ across meshes (FSDP's per-parameter meshes) is the true global norm",
          "[nn][optim]") {
  testing_support::Checks checks;
  int ran = 0;
  // 4 ranks: dense gradients on (dp=4), expert-like ones on its unflattening (dp_mod_ep=2, ep=2).
  const DeviceMesh mesh = DeviceMesh::from_shape({4}, {"dp"});
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world, {}, nullptr, {{0, Dims{2, 2}, {"dp_mod_ep", "ep"}}});
    std::shared_ptr<const MeshComms> ep = comms->unflatten(0, Dims{2, 2}, {"dp_mod_ep", "ep"});
    auto on = [](std::shared_ptr<const MeshComms> c, Dims shape, const char* pl) {
      return std::make_shared<Parameter>(c, shape, DType::kF64, Init::zeros(), dtensor::parse_placements(pl));
    };
    NamedParameters params{{"a", on(comms, {6, 3}, "S(0)")},
                           {"b", on(comms, {4}, "R")},
                           {"c", on(ep, {5, 2}, "S(0),S(0)")},
                           {"d", on(ep, {3, 4}, "R,S(1)")},
                           {"e", on(ep, {2}, "R,R")}};
    double want = 0, inf = 0;
    for (auto& [n, p] : params) {
      p->materialize(0, n);
      Tensor full = values(p->shape(), static_cast<int>(n[0]));
      for (double v : full.to_vector()) {
        want += v * v;
        inf = std::max(inf, std::abs(v));
      }
      p->grad() = dtensor::distribute_tensor(full, p->comms(), p->placements(), std::nullopt);
    }
    want = std::sqrt(want);
    const double norm = clip_grad_norm_(params, 0.0);
    checks.check(std::abs(norm - want) < 1e-12, fmt::format("norm {} vs {}", norm, want));
    checks.check(std::abs(clip_grad_norm_(params, 0.0, INFINITY) - inf) < 1e-15, "infinity norm");
    // Clipping scales the gradients on both meshes.
    clip_grad_norm_(params, want / 2);
    checks.check(std::abs(clip_grad_norm_(params, 0.0) - want / 2 * want / (want + 1e-6)) < 1e-9, "clipped norm");
    const double e0 = values({2}, 'e').to_vector()[0];
    checks.check(std::abs(params[4].second->grad()->to_local().to_vector()[0] - e0 * want / 2 / (want + 1e-6)) < 1e-12,
                 "the experts' mesh gradient was scaled");
    if (world.rank() == 0) ran = 1;
  });
  checks.report();
  CHECK(ran == 1);
}

TEST_CASE("optim: clip_grad_norm_ with error_if_nonfinite stops on a NaN or infinite norm", "[nn][optim]") {
  // One non-finite element on one rank's shard of a sharded gradient: the reduced norm is
  // non-finite on every rank, so every rank throws NonFiniteError (exit 1 in programs) and no
  // gradient is scaled; without the flag the norm is returned as it is.
  for (const double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
    INFO(bad);
    testing_support::Checks checks;
    std::atomic<int> ranks_ran{0};
    on_mesh({2, 2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
      auto a = std::make_shared<Parameter>(comms, Dims{5, 3}, DType::kF32, Init::zeros(),
                                           dtensor::parse_placements("S(0),R"));
      auto b = std::make_shared<Parameter>(comms, Dims{4}, DType::kF32, Init::zeros(),
                                           dtensor::parse_placements("R,R"));
      NamedParameters params{{"a", a}, {"b", b}};
      for (auto& [n, p] : params) {
        p->materialize(0, n);
        Tensor full = values(p->shape(), static_cast<int>(n[0]), DType::kF32);
        if (n == "a") full.set_item({4, 1}, bad);  // global row 4: on the second dp shard only
        p->grad() = dtensor::distribute_tensor(full, comms, p->placements(), std::nullopt);
      }
      const std::vector<double> before_a = a->grad()->to_local().to_vector(),
                                before_b = b->grad()->to_local().to_vector();
      for (const double norm_type : {2.0, double(INFINITY)})
        checks.throws<kernels::NonFiniteError>([&] { clip_grad_norm_(params, 0.5, norm_type, true); }, "non-finite",
                                               fmt::format("norm type {} with error_if_nonfinite", norm_type));
      checks.check(a->grad()->to_local().to_vector().size() == before_a.size(), "a's gradient kept its shape");
      const std::vector<double> after_a = a->grad()->to_local().to_vector();
      for (size_t i = 0; i < after_a.size() && i < before_a.size(); ++i)
        checks.check(after_a[i] == before_a[i] || (std::isnan(after_a[i]) && std::isnan(before_a[i])),
                     fmt::format("a's gradient element {} was changed", i));
      checks.check(b->grad()->to_local().to_vector() == before_b, "b's gradient was scaled");
      // Without the flag: the non-finite norm (PyTorch returns it too); the L2 norm is NaN or inf.
      const double norm = clip_grad_norm_(params, 0.0);
      checks.check(!std::isfinite(norm) && (std::isnan(bad) == std::isnan(norm)),
                   fmt::format("norm without the flag: {}", norm));
      // Finite gradients pass the check and return the norm.
      a->grad() = dtensor::distribute_tensor(values({5, 3}, 1, DType::kF32), comms, a->placements(), std::nullopt);
      checks.check(std::isfinite(clip_grad_norm_(params, 0.0, 2.0, true)), "a finite norm with the flag");
      ranks_ran++;
    });
    checks.report();
    CHECK(ranks_ran == 4);
  }
  // Programs map the error to exit 1 (a wrong result, not invalid input).
  const program::Failure f =
      program::classify(std::make_exception_ptr(kernels::NonFiniteError("the total norm is nan")));
  CHECK(f.status == program::kMismatch);
  CHECK(f.message == "the total norm is nan");
}

TEST_CASE("safetensors: round trip, alignment, metadata, errors", "[nn][safetensors]") {
  const std::string path = "nn_test_roundtrip.safetensors";
  NamedTensors in = {{"a.weight", values({3, 4}, 1, DType::kF32)},
                     {"b", values({5}, 2, DType::kF64)},
                     {"c", values({2, 2}, 3, DType::kBF16)},
                     {"ids", ids({6}, 100, 1)},
                     {"empty", Tensor::empty({0, 3}, DType::kF32)},
                     {"view", values({4, 6}, 4, DType::kF32).narrow(1, 1, 3).transpose(0, 1)}};
  save_safetensors(path, in, {{"format", "pt"}, {"config", "{\"dim\": 4}"}});
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  CHECK(n % 8 == 0);
  std::string header(n, ' ');
  f.read(header.data(), static_cast<std::streamsize>(n));
  CHECK(header.find("\"a.weight\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,48]}") !=
        std::string::npos);
  std::map<std::string, std::string> meta;
  const NamedTensors out = load_safetensors(path, &meta);
  CHECK(meta["config"] == "{\"dim\": 4}");
  REQUIRE(out.size() == in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    CHECK(out[i].first == in[i].first);
    CHECK(out[i].second.dtype() == in[i].second.dtype());
    CHECK(kernels::equal(out[i].second, in[i].second));
  }
  CHECK_THROWS_WITH(save_safetensors(path, {{"x", values({1}, 1)}, {"x", values({1}, 1)}}),
                    Catch::Contains("twice"));
  CHECK_THROWS_WITH(load_safetensors("no/such/file.safetensors"), Catch::Contains("cannot open"));
  {
    std::ofstream bad(path, std::ios::binary);
    const uint64_t len = 4;
    bad.write(reinterpret_cast<const char*>(&len), 8);
    bad << "{{{{";
  }
  CHECK_THROWS_WITH(load_safetensors(path), Catch::Contains("malformed header"));
  std::remove(path.c_str());
}

TEST_CASE("optim: state comes from the mesh's allocator, so a trainer's limit and peak count it", "[nn][optim]") {
  std::atomic<int> ran{0};
  testing_support::Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto mem = std::make_shared<nn::TrackingAllocator>();
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2}), world, std::vector<std::vector<int>>{}, mem);
    auto p = std::make_shared<Parameter>(comms, Dims{10, 4}, DType::kF32, Init::normal(0, 1),
                                         dtensor::parse_placements("S(0)"));
    p->materialize(1, "w");
    const int64_t params = mem->live_bytes();
    nn::AdamW adam({{"w", p}}, {});
    adam.init_state();
    checks.check(params == 80 && mem->live_bytes() == 3 * params,
                 fmt::format("AdamW state: {} bytes live for {} of parameters", mem->live_bytes(), params));
    checks.check(adam.state("w", "exp_avg").to_local().to_vector() == std::vector<double>(20, 0.0), "state not zero");
    ++ran;
  });
  checks.report();
  CHECK(ran == 2);
}

TEST_CASE("optim: RaggedShard parameters (FSDP's flat shards) clip and step like S(0) and R ones", "[nn][optim]") {
  // The same parameters and gradients placed three ways: Rg (units with a zero, align > 1; HSDP's
  // [R,Rg] on 2x2), S(0) and R. clip_grad_norm_ reduces the ragged pieces' squares over the Rg
  // mesh dim (each element counted once); SGD and AdamW steps give the same parameters.
  testing_support::Checks checks;
  int ran = 0;
  std::mutex mu;
  for (const Dims& mesh_shape : {Dims{4}, Dims{2, 2}}) {
    const bool hsdp = mesh_shape.size() == 2;
    const std::vector<std::string> layouts = hsdp ? std::vector<std::string>{"R,Rg(0,[2,1],2)", "R,S(0)", "R,R"}
                                                  : std::vector<std::string>{"Rg(0,[1,0,2,1],2)", "S(0)", "R"};
    on_mesh(mesh_shape, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      std::vector<std::vector<Tensor>> results;
      std::vector<double> norms, inf_norms;
      for (const std::string& layout : layouts) {
        const dtensor::Placements pl = dtensor::parse_placements(layout);
        NamedParameters params;
        for (const auto& [name, shape] : {std::pair<std::string, Dims>{"w", {9, 4}}, {"b", {5}}, {"e", {3, 0}}})
          params.emplace_back(name, std::make_shared<Parameter>(comms, shape, DType::kF64, Init::zeros(), pl));
        for (auto& [n, p] : params) p->materialize(3, n);
        kernels::AdamWOptions ao;
        ao.lr = 1e-2;
        ao.weight_decay = 0.1;
        kernels::SgdOptions so;
        so.lr = 0.1;
        so.momentum = 0.9;
        so.weight_decay = 0.01;
        AdamW adamw(params, ao);
        SGD sgd(params, so);
        for (int step = 0; step < 2; ++step) {
          for (auto& [n, p] : params)
            p->grad() = dtensor::distribute_tensor(values(p->shape(), static_cast<int>(n[0]) + step), comms,
                                                   p->placements(), std::nullopt);
          if (step == 0) inf_norms.push_back(clip_grad_norm_(params, 0.0, INFINITY));
          const double norm = clip_grad_norm_(params, 1.0);  // clipping active: the norm is > 1
          if (step == 0) norms.push_back(norm);
          adamw.step();
          sgd.step();
        }
        std::vector<Tensor> full;
        for (auto& [n, p] : params) {
          checks.check(p->data().placements() == pl && adamw.state(n, "exp_avg").placements() == pl,
                       layout + ": placements of " + n);
          full.push_back(p->data().full_tensor().clone());
        }
        results.push_back(std::move(full));
      }
      double want = 0;
      for (const auto& [name, shape] : {std::pair<std::string, Dims>{"w", {9, 4}}, {"b", {5}}, {"e", {3, 0}}})
        for (double v : values(shape, static_cast<int>(name[0])).to_vector()) want += v * v;
      for (size_t i = 0; i < layouts.size(); ++i) {
        checks.check(std::abs(norms[i] - std::sqrt(want)) < 1e-12,
                     fmt::format("{}: norm {} vs {}", layouts[i], norms[i], std::sqrt(want)));
        checks.check(inf_norms[i] == inf_norms.back(), fmt::format("{}: inf norm {}", layouts[i], inf_norms[i]));
        for (size_t t = 0; t < results[i].size(); ++t)
          checks.check(max_abs_diff(results[i][t], results.back()[t]) < 1e-12,
                       fmt::format("{}: parameter {} after the steps", layouts[i], t));
      }
      std::lock_guard lk(mu);
      if (world.rank() == 0) ++ran;
    });
  }
  checks.report();
  CHECK(ran == 2);
}
