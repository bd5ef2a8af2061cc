// fully_shard's contiguous (zero-copy) layout (issue 28): the layout arithmetic, training parity
// with the padded layout (bit for bit in f32) on 1..5 ranks with uneven sizes and ranks whose
// range is empty, mp bf16, meta parameters + materialize, no-sync accumulation, tied weights,
// explicit unshard / reshard / prefetch, copy_bytes of both layouts, and the refusals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/contiguous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/lowp.h"
#include "nn/optim.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

nn::GPTConfig small(bool tie) {
  nn::GPTConfig c;
  c.vocab = 16;
  c.dim = 8;  // LayerNorms of 8 + 8 elements: some ranks of 5 hold none of them
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 8;
  c.tie_embeddings = tie;
  return c;
}

Tensor batch_ids(int step, int64_t first, int64_t rows, int64_t seq, int64_t vocab, int shift) {
  Tensor t = Tensor::empty({rows, seq}, DType::kI64);
  int64_t* p = t.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < seq; ++i) p[r * seq + i] = ((first + r) * 7 + step * 13 + i * (3 + shift)) % vocab;
  return t;
}

struct Run {
  int64_t dp = 2;
  fsdp::Layout layout = fsdp::Layout::kContiguous;
  bool tie = false;
  bool meta = true;         // shard on meta, then materialize
  bool bf16 = false;        // mp: bf16 parameters, f32 reduction
  bool clip = false;        // clip_grad_norm_(1.0) before the step
  int accum = 1;            // microbatches; no gradient sync before the last
  bool keep_unsharded = false;  // set_reshard_after_backward(false) between microbatches
  int steps = 3;
  int64_t batch = 10;
  std::function<void(nn::GPT&, fsdp::FSDPModule&, std::shared_ptr<MeshComms>, testing_support::Checks&)> after;
};

struct Result {
  std::vector<double> losses, norms;
  std::map<std::string, Tensor> params;
  std::map<std::string, Tensor> initial;  // the parameters' full values before training
  int64_t copy_bytes = 0;                 // rank 0, every group, the whole run
};

// Blocks' LayerNorms get a group of their own (small groups: empty ranges), then the blocks,
// then the root.
fsdp::FSDPModule& shard(nn::GPT& model, std::shared_ptr<MeshComms> comms, const fsdp::FullyShardOptions& o) {
  for (const auto& [name, block] : model.blocks().children()) {
    for (const auto& [cn, child] : block->children())
      if (cn == "ln1" || cn == "ln2") fsdp::fully_shard(*child, comms, o);
    fsdp::fully_shard(*block, comms, o);
  }
  return fsdp::fully_shard(model, comms, o);
}

std::vector<fsdp::FSDPModule*> groups(nn::GPT& model) {
  std::vector<fsdp::FSDPModule*> out;
  for (auto& [n, m] : model.named_modules())
    if (fsdp::FSDPModule* st = fsdp::state(*m)) out.push_back(st);
  return out;
}

Result train(const Run& r, testing_support::Checks& checks) {
  const DeviceMesh mesh = DeviceMesh::from_shape(Dims{r.dp}, {"dp_shard"});
  Result result;
  collectives::run_ranks(static_cast<int>(r.dp), [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small(r.tie));
    if (!r.meta) nn::materialize(model, 5);
    fsdp::FullyShardOptions o;
    o.layout = r.layout;
    if (r.bf16) {
      o.mp_policy.param_dtype = DType::kBF16;
      o.mp_policy.reduce_dtype = DType::kF32;
    }
    fsdp::FSDPModule& root = shard(model, comms, o);
    if (r.meta) nn::materialize(model, 5);
    for (const auto& [name, p] : model.named_parameters()) {
      Tensor full = p->data().full_tensor();
      if (world.rank() == 0) result.initial[name] = full.clone();
    }
    kernels::AdamWOptions ao;
    ao.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), ao);
    nn::CrossEntropyLoss loss_fn;
    const int64_t micro = r.batch / r.accum;
    auto shared_mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements{dtensor::Replicate{}}, {}, DType::kF64),
                        Tensor::full({}, 1.0 / r.accum, DType::kF64));
    const nn::GPTConfig cfg = small(r.tie);
    for (int step = 0; step < r.steps; ++step) {
      double step_loss = 0;
      for (int m = 0; m < r.accum; ++m) {
        root.set_requires_gradient_sync(m + 1 == r.accum);
        if (r.keep_unsharded) root.set_reshard_after_backward(m + 1 == r.accum);
        const int64_t first = step * r.batch + m * micro;
        const DTensor x = dtensor::distribute_tensor(batch_ids(step, first, micro, cfg.max_seq, cfg.vocab, 0), comms,
                                                     Placements{dtensor::Shard{0}}, std::nullopt);
        const DTensor y = dtensor::distribute_tensor(batch_ids(step, first, micro, cfg.max_seq, cfg.vocab, 1), comms,
                                                     Placements{dtensor::Shard{0}}, std::nullopt);
        nn::Ctx ctx, lctx;
        DTensor logits = model.forward(ctx, x);
        DTensor loss = loss_fn.forward(lctx, logits, y);
        step_loss += loss.full_tensor().item({}) / r.accum;
        model.backward(ctx, loss_fn.backward(lctx, dloss));
      }
      const auto params = model.named_parameters();
      const double norm = r.clip ? nn::clip_grad_norm_(params, 1.0) : nn::clip_grad_norm_(params, 0.0);
      opt.step();
      opt.zero_grad();
      if (world.rank() == 0) {
        result.losses.push_back(step_loss);
        result.norms.push_back(norm);
      }
    }
    if (r.after) r.after(model, root, comms, checks);
    for (const auto& [name, p] : model.named_parameters()) {
      checks.check(!p->is_meta(), name + ": meta after training");
      Tensor full = p->data().full_tensor();
      if (world.rank() == 0) result.params[name] = full.clone();
    }
    if (world.rank() == 0)
      for (fsdp::FSDPModule* g : groups(model)) result.copy_bytes += g->stats().copy_bytes;
  });
  return result;
}

// Losses and final parameters bit for bit (tol 0) or within a relative tolerance (per element;
// l2: the parameters' relative L2 difference instead); initial values always bit for bit.
void check_same(const Result& a, const Result& b, double tol, bool l2 = false) {
  REQUIRE(a.losses.size() == b.losses.size());
  REQUIRE(!a.losses.empty());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    INFO("step " << i << ": " << a.losses[i] << " vs " << b.losses[i]);
    CHECK(std::abs(a.losses[i] - b.losses[i]) <= tol * std::abs(b.losses[i]));
  }
  CHECK(a.losses.front() != a.losses.back());  // it trained
  REQUIRE(a.params.size() == b.params.size());
  REQUIRE(a.initial.size() == b.initial.size());
  int compared = 0;
  double num = 0, den = 0;
  for (const bool initial : {false, true}) {
    const auto& mine = initial ? a.initial : a.params;
    const auto& other = initial ? b.initial : b.params;
    for (const auto& [name, t] : mine) {
      auto it = other.find(name);
      REQUIRE(it != other.end());
      const auto x = t.to_vector(), y = it->second.to_vector();
      REQUIRE(x.size() == y.size());
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        worst = std::max(worst, std::abs(x[i] - y[i]) / std::max(1e-3, std::abs(y[i])));
        if (!initial) {
          num += (x[i] - y[i]) * (x[i] - y[i]);
          den += y[i] * y[i];
        }
      }
      INFO((initial ? "initial " : "final ") << name << ": worst relative difference " << worst);
      CHECK(worst <= (initial ? 0.0 : l2 ? 1e300 : tol));
      ++compared;
    }
  }
  CHECK(compared > 20);
  if (l2) CHECK(std::sqrt(num / den) <= tol);
}

}  // namespace

TEST_CASE("fsdp contiguous: offsets, rank ranges and RaggedShard units (the header's example)", "[fsdp][contiguous]") {
  const fsdp::detail::ContiguousLayout l = fsdp::detail::lay_out_contiguous({10, 6, 3}, 2, 3, 4);
  CHECK(l.offsets == std::vector<int64_t>{0, 12, 20});
  CHECK(l.numel == 24);  // 23 rounded up to blocks of dp x align = 12: equal ranges
  CHECK(l.grad_numel == 18);
  CHECK(l.bounds == std::vector<int64_t>{0, 8, 16, 24});
  CHECK(dtensor::to_string(l.flat_placement()) == dtensor::to_string(dtensor::Placement{dtensor::RaggedShard{0, {1, 1, 1}, 4}}));
  CHECK(std::get<dtensor::RaggedShard>(l.param_placement(0)).units == std::vector<int64_t>{8, 2, 0});
  CHECK(std::get<dtensor::RaggedShard>(l.param_placement(1)).units == std::vector<int64_t>{0, 4, 2});
  CHECK(std::get<dtensor::RaggedShard>(l.param_placement(2)).units == std::vector<int64_t>{0, 0, 3});
  CHECK(std::get<dtensor::RaggedShard>(l.grad_flat_placement()).units == std::vector<int64_t>{8, 8, 2});
  // Every parameter trainable: the gradient ranges are the flat buffer's (equal, tail included).
  const fsdp::detail::ContiguousLayout t = fsdp::detail::lay_out_contiguous({10, 6, 3}, 3, 3, 4);
  CHECK(t.grad_numel == 24);
  CHECK(std::get<dtensor::RaggedShard>(t.grad_flat_placement()).units == std::vector<int64_t>{8, 8, 8});
  // Ranks with empty parameter overlaps: 8 elements over 5 ranks in blocks of 4 (N = 20).
  const fsdp::detail::ContiguousLayout e = fsdp::detail::lay_out_contiguous({8}, 1, 5, 4);
  CHECK(e.bounds == std::vector<int64_t>{0, 4, 8, 12, 16, 20});
  CHECK(std::get<dtensor::RaggedShard>(e.param_placement(0)).units == std::vector<int64_t>{4, 4, 0, 0, 0});
  // Equal ranges for any sizes, dp and alignment: N is the end rounded up to dp x align.
  int cases = 0;
  for (int64_t dp = 1; dp <= 6; ++dp)
    for (int64_t align : {1, 4, 8})
      for (const std::vector<int64_t>& numels : {std::vector<int64_t>{1}, {7, 3}, {512, 1536, 513}, {1000, 1, 1}}) {
        const fsdp::detail::ContiguousLayout c = fsdp::detail::lay_out_contiguous(numels, numels.size(), dp, align);
        const int64_t end = c.offsets.back() + numels.back();
        CHECK(c.numel % (dp * align) == 0);
        CHECK((c.numel >= end && c.numel - end < dp * align));
        for (int64_t r = 0; r < dp; ++r) CHECK((c.size(r) == c.numel / dp && c.grad_size(r) == c.size(r)));
        ++cases;
      }
  CHECK(cases == 6 * 3 * 4);
  CHECK(fsdp::detail::contiguous_align(DType::kF32, DType::kF32, DType::kF32) == 4);
  CHECK(fsdp::detail::contiguous_align(DType::kF32, DType::kBF16, DType::kF32) == 8);
}

TEST_CASE("fsdp contiguous: training equals the padded layout bit for bit in f32 on 1..5 ranks", "[fsdp][contiguous]") {
  int ran = 0;
  for (int64_t dp : {1, 2, 3, 4, 5}) {
    DYNAMIC_SECTION("dp " << dp) {
      testing_support::Checks checks;
      Run r;
      r.dp = dp;
      r.after = [dp](nn::GPT& model, fsdp::FSDPModule& root, std::shared_ptr<MeshComms> comms,
                     testing_support::Checks& c) {
        // Sharded parameters are RaggedShard 1-D views of their group's flat shard.
        int ragged = 0;
        for (const auto& [name, p] : model.named_parameters()) {
          if (!dtensor::is_ragged(p->placements()[0])) continue;
          ++ragged;
          const auto& rg = std::get<dtensor::RaggedShard>(p->placements()[0]);
          int64_t sum = 0;
          for (int64_t u : rg.units) sum += u;
          c.check(sum == p->numel() && static_cast<int64_t>(rg.units.size()) == dp, name + ": units");
          c.check(p->data().to_local().ndim() == 1 && p->data().to_local().numel() == rg.units[comms->coord()[0]],
                  name + ": local is this rank's 1-D range");
        }
        c.check(ragged == static_cast<int>(model.named_parameters().size()), "every parameter is ragged");
        // Unsharded parameters are views of the all-gather output: consecutive, 16-byte aligned.
        fsdp::FSDPModule* block = fsdp::state(model.blocks()[0]);
        block->unshard();
        c.check(block->is_unsharded(), "unshard()");
        std::vector<std::pair<std::string, std::shared_ptr<nn::Parameter>>> ps;
        const auto own = block->parameter_names();
        for (const auto& [name, p] : model.blocks()[0].named_parameters())
          if (std::find(own.begin(), own.end(), name) != own.end()) ps.emplace_back(name, p);
        c.check(ps.size() == own.size() && ps.size() >= 6, "the block's own parameters: " + std::to_string(ps.size()));
        const auto* base = static_cast<const char*>(ps.front().second->data().to_local().data_ptr());
        for (const auto& [name, p] : ps) {
          const auto* at = static_cast<const char*>(p->data().to_local().data_ptr());
          c.check(p->data().to_local().shares_storage_with(ps.front().second->data().to_local()),
                  name + ": not a view of the group's unsharded buffer");
          c.check((at - base) % 16 == 0, name + ": not 16-byte aligned in the buffer");
        }
        block->reshard();
        c.check(!block->is_unsharded() && !root.is_unsharded(), "reshard()");
        c.check(root.stats().copy_bytes == 0, "f32 contiguous copies nothing");
        c.check(block->stats().prefetches > 0, "implicit prefetch ran");
      };
      const Result got = train(r, checks);
      checks.report();
      Run p = r;
      p.layout = fsdp::Layout::kPadded;
      p.after = nullptr;
      testing_support::Checks none;
      const Result want = train(p, none);
      none.report();
      check_same(got, want, 0.0);
      CHECK(got.copy_bytes == 0);
      CHECK(want.copy_bytes > 0);
      ++ran;
    }
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: materialise before sharding, tied weights, clipping, no-sync accumulation",
          "[fsdp][contiguous]") {
  int ran = 0;
  SECTION("materialised before fully_shard: the same values as meta + materialize") {
    Run r;
    r.dp = 3;
    r.meta = false;
    Run m = r;
    m.meta = true;
    testing_support::Checks checks;
    const Result a = train(r, checks), b = train(m, checks);
    checks.report();
    check_same(a, b, 0.0);
    ++ran;
  }
  SECTION("tied embeddings, dp 4") {
    Run r;
    r.dp = 4;
    r.tie = true;
    Run p = r;
    p.layout = fsdp::Layout::kPadded;
    testing_support::Checks checks;
    const Result a = train(r, checks), b = train(p, checks);
    checks.report();
    check_same(a, b, 0.0);
    ++ran;
  }
  SECTION("clip_grad_norm_ sums the RaggedShard gradients' squares over dp") {
    Run r;
    r.dp = 3;
    r.clip = true;
    Run p = r;
    p.layout = fsdp::Layout::kPadded;
    testing_support::Checks checks;
    const Result a = train(r, checks), b = train(p, checks);
    checks.report();
    REQUIRE(a.norms.size() == 3);
    for (size_t i = 0; i < a.norms.size(); ++i) {
      INFO("norm " << a.norms[i] << " vs padded " << b.norms[i]);
      CHECK(std::abs(a.norms[i] - b.norms[i]) <= 1e-12 * b.norms[i]);
      CHECK(a.norms[i] > 0.1);
    }
    // The per-rank sums of squares are split differently: the norm may differ in the last bit.
    check_same(a, b, 1e-6);
    ++ran;
  }
  SECTION("no-sync accumulation over 2 microbatches, resharding or keeping the parameters") {
    for (bool keep : {false, true}) {
      Run r;
      r.dp = 3;
      r.accum = 2;
      r.keep_unsharded = keep;
      Run p = r;
      p.layout = fsdp::Layout::kPadded;
      testing_support::Checks checks;
      const Result a = train(r, checks), b = train(p, checks);
      checks.report();
      // Not bit for bit: the second microbatch's matmul gradients accumulate inside the kernel
      // (its sum starts from the first's value) where the padded layout adds two finished
      // products; the same sums, rounded in another order.
      check_same(a, b, 1e-6, /*l2=*/true);
    }
    ++ran;
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: mp bf16 copies only the casts; within bf16 rounding of padded", "[fsdp][contiguous]") {
  int ran = 0;
  for (int64_t dp : {2, 5}) {
    DYNAMIC_SECTION("dp " << dp) {
      Run r;
      r.dp = dp;
      r.bf16 = true;
      r.after = [](nn::GPT& model, fsdp::FSDPModule&, std::shared_ptr<MeshComms>, testing_support::Checks& c) {
        // Each unshard casts this rank's f32 shard to bf16 once: 2 bytes per element held.
        for (fsdp::FSDPModule* g : groups(model)) {
          const int64_t held = g->sharded_bytes() / 4;  // f32 elements of this rank's shard
          c.check(g->stats().copy_bytes == g->stats().all_gathers * held * 2,
                  g->name() + ": copy_bytes " + std::to_string(g->stats().copy_bytes) + ", expected the casts only");
        }
      };
      testing_support::Checks checks;
      const Result got = train(r, checks);
      checks.report();
      Run p = r;
      p.layout = fsdp::Layout::kPadded;
      p.after = nullptr;
      const Result want = train(p, checks);
      CHECK(got.copy_bytes > 0);
      CHECK(got.copy_bytes < want.copy_bytes);
      // Gradients: the contiguous layout's matmuls round once into the f32 buffer, the padded
      // one's round to bf16 first, so the two agree to bf16 rounding, not bit for bit.
      check_same(got, want, 1e-2, /*l2=*/true);
      ++ran;
    }
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: refuses what it does not support yet, naming the option", "[fsdp][contiguous]") {
  testing_support::Checks checks;
  int cases = 0;
  auto refused = [&](Dims mesh_shape, std::vector<std::string> names, std::function<void(fsdp::FullyShardOptions&)> set,
                     const std::string& contains, std::vector<dtensor::Unflattening> unflatten = {}) {
    ++cases;
    const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape, names);
    collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
      auto comms = MeshComms::create(mesh, world, {}, nullptr, unflatten);
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small(false));
      fsdp::FullyShardOptions o;
      o.layout = fsdp::Layout::kContiguous;
      set(o);
      checks.throws<kernels::Unsupported>([&] { fsdp::fully_shard(model.blocks()[0], comms, o); }, contains, contains);
      checks.check(fsdp::state(model.blocks()[0]) == nullptr, contains + ": the module was left sharded");
    });
  };
  auto none = [](fsdp::FullyShardOptions&) {};
  refused(Dims{2, 2}, {"dp_replicate", "dp_shard"}, none, "HSDP");
  refused(Dims{2, 2}, {"dp_shard", "tp"}, none, "FSDP x TP");
  refused(Dims{4}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) { o.reshard_after_forward = fsdp::ReshardAfterForward::to(2); },
          "reshard_after_forward = 2", {fsdp::reshard_unflattening(DeviceMesh::from_shape(Dims{4}, {"dp_shard"}), 0, 2)});
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) { o.offload_policy.offload_to_cpu = true; }, "offload");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.all_gather_extension_fn = [](const std::string&, const nn::Parameter&) { return std::shared_ptr<fsdp::AllGatherExtension>(); };
  }, "all_gather_extension_fn");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.mesh_fn = [](const std::string&, const nn::Parameter&) { return std::optional<fsdp::ParamMesh>(); };
  }, "mesh_fn");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.shard_placement_fn = [](const std::string&, const nn::Parameter&) { return std::optional<int>(); };
  }, "shard_placement_fn");
  checks.report();
  CHECK(cases == 7);
}

namespace {

// Shards a fresh meta GPT (dp ranks, the given layout), materialises it (seed), trains `steps`
// steps with AdamW; then `then(model, opt, comms, world)` on every rank.
void with_trained(int64_t dp, fsdp::Layout layout, uint64_t seed, int steps,
                  const std::function<void(nn::GPT&, nn::AdamW&, std::shared_ptr<MeshComms>, Communicator&)>& then) {
  const DeviceMesh mesh = DeviceMesh::from_shape(Dims{dp}, {"dp_shard"});
  collectives::run_ranks(static_cast<int>(dp), [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world);
    const nn::GPTConfig cfg = small(true);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
    fsdp::FullyShardOptions o;
    o.layout = layout;
    shard(model, comms, o);
    nn::materialize(model, seed);
    kernels::AdamWOptions ao;
    ao.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), ao);
    nn::CrossEntropyLoss loss_fn;
    auto shared_mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements{dtensor::Replicate{}}, {}, DType::kF64),
                        Tensor::full({}, 1.0, DType::kF64));
    for (int step = 0; step < steps; ++step) {
      const DTensor x = dtensor::distribute_tensor(batch_ids(step, step * 6, 6, cfg.max_seq, cfg.vocab, 0), comms,
                                                   Placements{dtensor::Shard{0}}, std::nullopt);
      const DTensor y = dtensor::distribute_tensor(batch_ids(step, step * 6, 6, cfg.max_seq, cfg.vocab, 1), comms,
                                                   Placements{dtensor::Shard{0}}, std::nullopt);
      nn::Ctx ctx, lctx;
      DTensor loss = loss_fn.forward(lctx, model.forward(ctx, x), y);
      model.backward(ctx, loss_fn.backward(lctx, dloss));
      opt.step();
      opt.zero_grad();
    }
    then(model, opt, comms, world);
  });
}

nn::StateDict full_state(nn::GPT& model, nn::AdamW& opt) {
  nn::StateDict sd = model.state_dict();
  sd.merge(opt.state_dict(), "optim.");
  return sd;
}

}  // namespace

TEST_CASE("fsdp contiguous: a checkpoint saved under one layout loads under the other bit for bit",
          "[fsdp][contiguous][checkpoint]") {
  int ran = 0;
  for (const bool from_contiguous : {true, false}) {
    DYNAMIC_SECTION((from_contiguous ? "contiguous dp 3 -> padded dp 2" : "padded dp 3 -> contiguous dp 2")) {
      const fsdp::Layout save_layout = from_contiguous ? fsdp::Layout::kContiguous : fsdp::Layout::kPadded;
      const fsdp::Layout load_layout = from_contiguous ? fsdp::Layout::kPadded : fsdp::Layout::kContiguous;
      const std::filesystem::path dir =
          std::filesystem::temp_directory_path() / ("fsdp-contiguous-ckpt-" + std::to_string(::getpid()));
      std::filesystem::remove_all(dir);
      testing_support::Checks checks;
      std::map<std::string, Tensor> saved, loaded;
      with_trained(3, save_layout, 5, 2, [&](nn::GPT& model, nn::AdamW& opt, std::shared_ptr<MeshComms>, Communicator& world) {
        const nn::StateDict sd = full_state(model, opt);
        checkpoint::save(dir.string(), sd, world);
        nn::for_each_full_tensor(sd, true, [&](const std::string& key, const Tensor& full) { saved[key] = full.clone(); });
      });
      // Another layout, another dp size, other initial values: everything comes from the files.
      with_trained(2, load_layout, 6, 0, [&](nn::GPT& model, nn::AdamW& opt, std::shared_ptr<MeshComms>, Communicator& world) {
        opt.init_state();
        nn::StateDict sd = full_state(model, opt);
        checkpoint::load(dir.string(), sd, world);
        opt.load_state_dict(sd.sub("optim."));
        const nn::StateDict after = full_state(model, opt);
        int ragged = 0;
        for (const auto& [key, t] : after.tensors) ragged += dtensor::is_ragged(t.placements()[0]) ? 1 : 0;
        checks.check((ragged > 0) == (load_layout == fsdp::Layout::kContiguous), "the loaded state's placements");
        nn::for_each_full_tensor(after, true, [&](const std::string& key, const Tensor& full) { loaded[key] = full.clone(); });
      });
      std::filesystem::remove_all(dir);
      checks.report();
      REQUIRE(saved.size() == loaded.size());
      CHECK(saved.size() > 30);  // parameters, exp_avg and exp_avg_sq of each
      int compared = 0;
      for (const auto& [key, t] : saved) {
        auto it = loaded.find(key);
        REQUIRE(it != loaded.end());
        INFO(key);
        CHECK(t.to_vector() == it->second.to_vector());
        ++compared;
      }
      CHECK(compared == static_cast<int>(saved.size()));
      ++ran;
    }
  }
  CHECK(ran == 1);
}
