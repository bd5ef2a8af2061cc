// fully_shard's contiguous (zero-copy) layout (issue 28): the layout arithmetic, training parity
// with the padded layout (bit for bit in f32) on 1..5 ranks with uneven sizes and ranks whose
// range is empty, mp bf16, meta parameters + materialize, no-sync accumulation, tied weights,
// explicit unshard / reshard / prefetch, copy_bytes of both layouts, and the refusals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/contiguous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/lowp.h"
#include "nn/memory.h"
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
  int64_t replicate = 1;    // > 1: HSDP on (dp_replicate, dp_shard)
  bool no_all_reduce = false;  // HSDP: set_requires_all_reduce(false) before the last microbatch
  double divide_factor = 0;    // > 0: set_gradient_divide_factor
  int k = 0;                   // > 0: reshard_after_forward = k
  std::vector<std::string> freeze;  // requires_grad = false for parameters whose name contains one
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
  int64_t reduce_bytes = 0, all_gather_bytes = 0, all_reduces = 0;  // the same
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

DeviceMesh dp_mesh(int64_t replicate, int64_t dp) {
  if (replicate > 1) return DeviceMesh::from_shape(Dims{replicate, dp}, {"dp_replicate", "dp_shard"});
  return DeviceMesh::from_shape(Dims{dp}, {"dp_shard"});
}

Result train(const Run& r, testing_support::Checks& checks) {
  const DeviceMesh mesh = dp_mesh(r.replicate, r.dp);
  const int nd = mesh.ndim();
  Result result;
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    std::vector<dtensor::Unflattening> unflatten;
    if (r.k > 0) unflatten.push_back(fsdp::reshard_unflattening(mesh, nd - 1, r.k));
    auto comms = MeshComms::create(mesh, world, {}, nullptr, unflatten);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small(r.tie));
    if (!r.meta) nn::materialize(model, 5);
    for (const auto& [name, p] : model.named_parameters())
      for (const std::string& f : r.freeze)
        if (name.find(f) != std::string::npos) p->requires_grad = false;
    fsdp::FullyShardOptions o;
    o.layout = r.layout;
    if (r.k > 0) o.reshard_after_forward = fsdp::ReshardAfterForward::to(r.k);
    if (r.bf16) {
      o.mp_policy.param_dtype = DType::kBF16;
      o.mp_policy.reduce_dtype = DType::kF32;
    }
    fsdp::FSDPModule& root = shard(model, comms, o);
    if (r.divide_factor > 0)
      for (fsdp::FSDPModule* g : groups(model)) g->set_gradient_divide_factor(r.divide_factor);
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
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements(nd, dtensor::Replicate{}), {}, DType::kF64),
                        Tensor::full({}, 1.0 / r.accum, DType::kF64));
    const nn::GPTConfig cfg = small(r.tie);
    const Placements batch_sharded(nd, dtensor::Shard{0});
    for (int step = 0; step < r.steps; ++step) {
      double step_loss = 0;
      for (int m = 0; m < r.accum; ++m) {
        if (r.no_all_reduce) root.set_requires_all_reduce(m + 1 == r.accum);
        else root.set_requires_gradient_sync(m + 1 == r.accum);
        if (r.keep_unsharded) root.set_reshard_after_backward(m + 1 == r.accum);
        const int64_t first = step * r.batch + m * micro;
        const DTensor x = dtensor::distribute_tensor(batch_ids(step, first, micro, cfg.max_seq, cfg.vocab, 0), comms,
                                                     batch_sharded, std::nullopt);
        const DTensor y = dtensor::distribute_tensor(batch_ids(step, first, micro, cfg.max_seq, cfg.vocab, 1), comms,
                                                     batch_sharded, std::nullopt);
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
      for (fsdp::FSDPModule* g : groups(model)) {
        result.copy_bytes += g->stats().copy_bytes;
        result.reduce_bytes += g->stats().reduce_bytes;
        result.all_gather_bytes += g->stats().all_gather_bytes;
        result.all_reduces += g->stats().all_reduces;
      }
  });
  return result;
}

// Losses and final parameters bit for bit (tol 0) or within a relative tolerance (per element;
// l2: the parameters' relative L2 difference instead); initial values always bit for bit.
// The run `r` and the same run under the padded layout (without r's `after` hook): {r's, padded's}.
std::pair<Result, Result> with_padded(const Run& r) {
  Run p = r;
  p.layout = fsdp::Layout::kPadded;
  p.after = nullptr;
  testing_support::Checks checks;
  Result a = train(r, checks), b = train(p, checks);
  checks.report();
  return {std::move(a), std::move(b)};
}

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
    const auto [a, b] = with_padded(r);
    check_same(a, b, 0.0);
    ++ran;
  }
  SECTION("clip_grad_norm_ sums the RaggedShard gradients' squares over dp") {
    Run r;
    r.dp = 3;
    r.clip = true;
    const auto [a, b] = with_padded(r);
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
      const auto [a, b] = with_padded(r);
      // Not bit for bit: the second microbatch's matmul gradients accumulate inside the kernel
      // (its sum starts from the first's value) where the padded layout adds two finished
      // products; the same sums, rounded in another order.
      check_same(a, b, 1e-6, /*l2=*/true);
    }
    ++ran;
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: HSDP 2x2 and 2x3 equal padded HSDP bit for bit in f32, no more bytes on the wire",
          "[fsdp][contiguous][hsdp]") {
  int ran = 0;
  for (int64_t dp : {2, 3}) {
    DYNAMIC_SECTION("HSDP 2x" << dp) {
      testing_support::Checks checks;
      Run r;
      r.replicate = 2;
      r.dp = dp;
      r.after = [dp](nn::GPT& model, fsdp::FSDPModule&, std::shared_ptr<MeshComms> comms, testing_support::Checks& c) {
        // [R, Rg(overlaps)]: every replica holds the same 1-D range of the shard dim's rank.
        int ragged = 0;
        for (const auto& [name, p] : model.named_parameters()) {
          const Placements& pl = p->placements();
          c.check(pl.size() == 2 && dtensor::is_replicate(pl[0]) && dtensor::is_ragged(pl[1]),
                  name + ": placements " + dtensor::to_string(pl) + ", expected [R, Rg]");
          if (pl.size() != 2 || !dtensor::is_ragged(pl[1])) continue;
          ++ragged;
          const auto& rg = std::get<dtensor::RaggedShard>(pl[1]);
          c.check(static_cast<int64_t>(rg.units.size()) == dp, name + ": units over dp_shard");
          c.check(p->data().to_local().numel() == rg.units[comms->coord()[1]], name + ": local is the shard rank's range");
        }
        c.check(ragged == static_cast<int>(model.named_parameters().size()), "every parameter is [R, Rg]");
      };
      const Result got = train(r, checks);
      checks.report();
      Run p = r;
      p.layout = fsdp::Layout::kPadded;
      p.after = nullptr;
      const Result want = train(p, checks);
      check_same(got, want, 0.0);
      CHECK(got.copy_bytes == 0);
      CHECK(want.copy_bytes > 0);
      // The same collectives (one all-gather per unshard, RS + AR per gradient sync), no more
      // bytes: the ragged ranges carry no per-parameter padding.
      INFO("reduce bytes " << got.reduce_bytes << " vs padded " << want.reduce_bytes << "; all-gather bytes "
                           << got.all_gather_bytes << " vs " << want.all_gather_bytes);
      CHECK(got.all_reduces == want.all_reduces);
      CHECK(got.all_reduces > 0);
      CHECK(got.reduce_bytes <= want.reduce_bytes);
      CHECK(got.all_gather_bytes <= want.all_gather_bytes);
      CHECK(got.reduce_bytes > 0);
      ++ran;
    }
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: HSDP accumulation without sync or all-reduce, gradient divide factor",
          "[fsdp][contiguous][hsdp]") {
  int ran = 0;
  SECTION("2x3, set_requires_gradient_sync(false) over 2 microbatches") {
    Run r;
    r.replicate = 2;
    r.dp = 3;
    r.accum = 2;
    const auto [a, b] = with_padded(r);
    // As without HSDP: the second microbatch accumulates inside the matmul kernels.
    check_same(a, b, 1e-6, /*l2=*/true);
    ++ran;
  }
  SECTION("2x3, set_requires_all_reduce(false): [P,P] -> [P,Rg], summed, then all-reduced once") {
    Run r;
    r.replicate = 2;
    r.dp = 3;
    r.accum = 2;
    r.no_all_reduce = true;
    const auto [a, b] = with_padded(r);
    check_same(a, b, 0.0);  // every microbatch reduce-scatters its own gradients: the same sums
    CHECK(a.copy_bytes == 0);
    CHECK(a.all_reduces == b.all_reduces);
    ++ran;
  }
  SECTION("2x3, set_requires_all_reduce(false) with frozen parameters (a shorter gradient buffer)") {
    Run r;
    r.replicate = 2;
    r.dp = 3;
    r.accum = 2;
    r.no_all_reduce = true;
    r.freeze = {"pos_emb", "blocks.0.ln1", "mlp.fc2.bias"};
    const auto [a, b] = with_padded(r);
    check_same(a, b, 0.0);
    for (const auto& [name, t] : a.params)
      if (name.find("pos_emb") != std::string::npos) {
        INFO(name);
        CHECK(t.to_vector() == a.initial.at(name).to_vector());  // frozen: unchanged
      }
    ++ran;
  }
  SECTION("2x2, set_gradient_divide_factor(3)") {
    Run r;
    r.replicate = 2;
    r.dp = 2;
    r.divide_factor = 3;
    Run p = r;
    p.layout = fsdp::Layout::kPadded;
    Run plain = r;
    plain.divide_factor = 0;
    testing_support::Checks checks;
    const Result a = train(r, checks), b = train(p, checks), c = train(plain, checks);
    checks.report();
    check_same(a, b, 0.0);
    // The first step's gradients (the same parameters) are the plain sums divided by 3.
    REQUIRE(!a.norms.empty());
    INFO("gradient norm " << a.norms[0] << " with the factor, " << c.norms[0] << " without");
    CHECK(std::abs(3 * a.norms[0] - c.norms[0]) <= 1e-6 * c.norms[0]);
    ++ran;
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: reshard_after_forward = k equals padded with k bit for bit, FSDP and HSDP",
          "[fsdp][contiguous][k]") {
  struct Config {
    int64_t replicate, dp;
    int k;
  };
  int ran = 0;
  for (const Config& cfg : {Config{1, 4, 2}, Config{1, 6, 3}, Config{2, 4, 2}}) {
    DYNAMIC_SECTION(cfg.replicate << "x" << cfg.dp << " k " << cfg.k) {
      Run r;
      r.replicate = cfg.replicate;
      r.dp = cfg.dp;
      r.k = cfg.k;
      r.after = [cfg](nn::GPT& model, fsdp::FSDPModule&, std::shared_ptr<MeshComms>, testing_support::Checks& c) {
        // A non-root group keeps ~1/k of its unsharded flat buffer between forward and backward.
        fsdp::FSDPModule* block = fsdp::state(model.blocks()[0]);
        const int64_t flat = block->sharded_bytes();  // this rank's dp range: ~1/dp of the buffer
        const int64_t kept = block->resharded_k_bytes();
        c.check(kept > 0 && kept >= flat && kept <= (cfg.dp / cfg.k) * flat + 64,
                "k buffer " + std::to_string(kept) + " bytes against a dp shard of " + std::to_string(flat));
      };
      testing_support::Checks checks;
      const Result got = train(r, checks);
      checks.report();
      Run p = r;
      p.layout = fsdp::Layout::kPadded;
      p.after = nullptr;
      const Result want = train(p, checks);
      Run full = r;
      full.k = 0;
      full.after = nullptr;
      const Result no_k = train(full, checks);
      check_same(got, want, 0.0);
      check_same(got, no_k, 0.0);
      CHECK(got.copy_bytes == 0);
      INFO("all-gather bytes " << got.all_gather_bytes << " vs padded " << want.all_gather_bytes << ", without k "
                               << no_k.all_gather_bytes);
      CHECK(got.all_gather_bytes <= want.all_gather_bytes);
      CHECK(got.all_gather_bytes < no_k.all_gather_bytes);  // backward gathers over k ranks only
      ++ran;
    }
  }
  CHECK(ran == 1);
}

TEST_CASE("fsdp contiguous: mp bf16 copies only the casts; equals padded bit for bit", "[fsdp][contiguous]") {
  int ran = 0;
  for (const auto& [replicate, dp] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {1, 5}, {2, 2}}) {
    DYNAMIC_SECTION(replicate << "x" << dp) {
      Run r;
      r.replicate = replicate;
      r.dp = dp;
      r.bf16 = true;
      r.after = [](nn::GPT& model, fsdp::FSDPModule&, std::shared_ptr<MeshComms>, testing_support::Checks& c) {
        // Each unshard casts this rank's f32 shard to bf16 once (2 bytes per element held), each
        // gradient reduction casts the bf16 gradient buffer to the f32 reduce-scatter input once.
        for (fsdp::FSDPModule* g : groups(model)) {
          const int64_t held = g->sharded_bytes() / 4;  // f32 elements of this rank's shard
          const int64_t expected =
              g->stats().all_gathers * held * 2 + g->stats().reduce_scatters * g->reduce_scatter_input_bytes();
          c.check(g->stats().reduce_scatters > 0 && g->stats().copy_bytes == expected,
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
      // Both layouts' gradients are bf16 values cast once to f32 and summed in the same order.
      check_same(got, want, 0.0);
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
  refused(Dims{2, 2, 2}, {"dp_replicate", "dp_shard", "tp"}, none, "FSDP x TP");
  refused(Dims{2, 2}, {"dp_shard", "tp"}, none, "FSDP x TP");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.all_gather_extension_fn = [](const std::string&, const nn::Parameter&) { return std::shared_ptr<fsdp::AllGatherExtension>(); };
  }, "all-gather extensions (all_gather_extension_fn) yet: an extension encodes each parameter's padded shard");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.mesh_fn = [](const std::string&, const nn::Parameter&) { return std::optional<fsdp::ParamMesh>(); };
  }, "mesh_fn");
  refused(Dims{2}, {"dp_shard"}, [](fsdp::FullyShardOptions& o) {
    o.shard_placement_fn = [](const std::string&, const nn::Parameter&) { return std::optional<int>(); };
  }, "shard_placement_fn");
  checks.report();
  CHECK(cases == 5);
}

namespace {

// Shards a fresh meta GPT (dp ranks, the given layout), materialises it (seed), trains `steps`
// steps with AdamW; then `then(model, opt, comms, world)` on every rank.
// replicate > 1: HSDP on (dp_replicate, dp_shard).
void with_trained(int64_t replicate, int64_t dp, fsdp::Layout layout, uint64_t seed, int steps,
                  const std::function<void(nn::GPT&, nn::AdamW&, std::shared_ptr<MeshComms>, Communicator&)>& then) {
  const DeviceMesh mesh = dp_mesh(replicate, dp);
  const int nd = mesh.ndim();
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
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
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements(nd, dtensor::Replicate{}), {}, DType::kF64),
                        Tensor::full({}, 1.0, DType::kF64));
    const Placements batch_sharded(nd, dtensor::Shard{0});
    for (int step = 0; step < steps; ++step) {
      const DTensor x = dtensor::distribute_tensor(batch_ids(step, step * 6, 6, cfg.max_seq, cfg.vocab, 0), comms,
                                                   batch_sharded, std::nullopt);
      const DTensor y = dtensor::distribute_tensor(batch_ids(step, step * 6, 6, cfg.max_seq, cfg.vocab, 1), comms,
                                                   batch_sharded, std::nullopt);
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
  struct Side {
    int64_t replicate, dp;
    fsdp::Layout layout;
  };
  struct Crossing {
    const char* name;
    Side save, load;
  };
  const fsdp::Layout C = fsdp::Layout::kContiguous, P = fsdp::Layout::kPadded;
  const std::vector<Crossing> crossings = {
      {"contiguous dp 3 -> padded dp 2", {1, 3, C}, {1, 2, P}},
      {"padded dp 3 -> contiguous dp 2", {1, 3, P}, {1, 2, C}},
      {"contiguous HSDP 2x2 -> padded HSDP 2x3", {2, 2, C}, {2, 3, P}},
      {"padded HSDP 2x3 -> contiguous HSDP 2x2", {2, 3, P}, {2, 2, C}},
      {"contiguous HSDP 2x3 -> contiguous dp 4", {2, 3, C}, {1, 4, C}},
  };
  int ran = 0;
  for (const Crossing& cr : crossings) {
    DYNAMIC_SECTION(cr.name) {
      const std::filesystem::path dir =
          std::filesystem::temp_directory_path() / ("fsdp-contiguous-ckpt-" + std::to_string(::getpid()));
      std::filesystem::remove_all(dir);
      testing_support::Checks checks;
      std::map<std::string, Tensor> saved, loaded;
      std::atomic<uint64_t> written{0};
      with_trained(cr.save.replicate, cr.save.dp, cr.save.layout, 5, 2,
                   [&](nn::GPT& model, nn::AdamW& opt, std::shared_ptr<MeshComms>, Communicator& world) {
                     const nn::StateDict sd = full_state(model, opt);
                     written += checkpoint::save(dir.string(), sd, world).bytes_written;
                     nn::for_each_full_tensor(sd, true, [&](const std::string& key, const Tensor& full) {
                       saved[key] = full.clone();
                     });
                   });
      // Another layout, another mesh, other initial values: everything comes from the files.
      with_trained(cr.load.replicate, cr.load.dp, cr.load.layout, 6, 0,
                   [&](nn::GPT& model, nn::AdamW& opt, std::shared_ptr<MeshComms>, Communicator& world) {
                     opt.init_state();
                     nn::StateDict sd = full_state(model, opt);
                     checkpoint::load(dir.string(), sd, world);
                     opt.load_state_dict(sd.sub("optim."));
                     const nn::StateDict after = full_state(model, opt);
                     int ragged = 0;
                     for (const auto& [key, t] : after.tensors)
                       for (const auto& pl : t.placements()) ragged += dtensor::is_ragged(pl) ? 1 : 0;
                     checks.check((ragged > 0) == (cr.load.layout == C), "the loaded state's placements");
                     nn::for_each_full_tensor(after, true, [&](const std::string& key, const Tensor& full) {
                       loaded[key] = full.clone();
                     });
                   });
      std::filesystem::remove_all(dir);
      checks.report();
      REQUIRE(saved.size() == loaded.size());
      CHECK(saved.size() > 30);  // parameters, exp_avg and exp_avg_sq of each
      // Every element written once over all ranks (HSDP's replicas write nothing twice).
      uint64_t state_bytes = 0;
      for (const auto& [key, t] : saved) state_bytes += t.nbytes();
      CHECK(written.load() == state_bytes);
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

namespace {

// One rank's peak bytes (the largest sum live at one time over the mesh's allocator and FSDP's
// unsharded and buffer allocators, fsdp-train's count) during the second training step of a GPT
// under fully_shard (each block, then the root), the worst rank.
struct PeakRun {
  nn::GPTConfig cfg;
  int64_t dp = 4;
  int64_t batch = 8;
  bool bf16 = false;
  fsdp::Layout layout = fsdp::Layout::kContiguous;
};

int64_t step_peak(const PeakRun& r) {
  const DeviceMesh mesh = DeviceMesh::from_shape(Dims{r.dp}, {"dp_shard"});
  std::vector<int64_t> peaks(static_cast<size_t>(r.dp), -1);
  collectives::run_ranks(static_cast<int>(r.dp), [&](Communicator& world) {
    auto total = std::make_shared<nn::TrackingAllocator>();
    auto tracked = [&] {
      return std::make_shared<nn::TrackingAllocator>(std::make_shared<kernels::CachingAllocator>(), total);
    };
    auto comms = MeshComms::create(mesh, world, {}, tracked());
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, r.cfg);
    fsdp::FullyShardOptions o;
    o.layout = r.layout;
    o.unsharded_allocator = tracked();
    o.buffer_allocator = tracked();
    if (r.bf16) {
      o.mp_policy.param_dtype = DType::kBF16;
      o.mp_policy.reduce_dtype = DType::kF32;
    }
    for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms, o);
    fsdp::fully_shard(model, comms, o);
    nn::materialize(model, 5);
    kernels::AdamWOptions ao;
    ao.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), ao);
    nn::CrossEntropyLoss loss_fn;
    auto shared_mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, Placements{dtensor::Replicate{}}, {}, DType::kF64),
                        Tensor::full({}, 1.0, DType::kF64));
    for (int step = 0; step < 2; ++step) {
      if (step == 1) total->reset_peak();  // the first step allocates the optimizer state
      const int64_t first = step * r.batch;
      const DTensor x = dtensor::distribute_tensor(batch_ids(step, first, r.batch, r.cfg.max_seq, r.cfg.vocab, 0), comms,
                                                   Placements{dtensor::Shard{0}}, std::nullopt);
      const DTensor y = dtensor::distribute_tensor(batch_ids(step, first, r.batch, r.cfg.max_seq, r.cfg.vocab, 1), comms,
                                                   Placements{dtensor::Shard{0}}, std::nullopt);
      nn::Ctx ctx, lctx;
      DTensor logits = model.forward(ctx, x);
      DTensor loss = loss_fn.forward(lctx, logits, y);
      model.backward(ctx, loss_fn.backward(lctx, dloss));
      opt.step();
      opt.zero_grad();
    }
    peaks[static_cast<size_t>(world.rank())] = total->peak_bytes();
  });
  return *std::max_element(peaks.begin(), peaks.end());
}

}  // namespace

TEST_CASE("fsdp contiguous: peak memory at most the padded layout's, f32 and bf16", "[fsdp][contiguous]") {
  // The flat gradient input is allocated at its group's first gradient write, after the
  // previous group's reduce-scatter finished (two whole inputs beside a block's activation
  // gradients were the peak), the unsharded parameters are freed before the reduction, and
  // under bf16 the input is bf16 until one cast before the reduce-scatter (an f32 buffer alive
  // through backward was the peak). This model: f32 1,553,792 bytes against padded's 1,660,160
  // (1,734,784 before), bf16 1,232,896 against 1,302,400 (1,453,312 before).
  // Not covered: where the first group in backward peaks inside its own backward (activation
  // gradients large against the model, or padded's other peaks lower), that group holds its whole
  // input there while padded holds only the gradients produced so far, and contiguous is still
  // above (fsdp-bench's default model; fsdp-train's 2 x 32 in f32).
  int ran = 0;
  for (const bool bf16 : {false, true}) {
    PeakRun r;
    r.cfg.vocab = 48;
    r.cfg.dim = 64;
    r.cfg.heads = 4;
    r.cfg.layers = 4;
    r.cfg.max_seq = 16;
    r.batch = 4;
    r.bf16 = bf16;
    const int64_t contiguous = step_peak(r);
    r.layout = fsdp::Layout::kPadded;
    const int64_t padded = step_peak(r);
    INFO((bf16 ? "bf16" : "f32") << ": contiguous peak " << contiguous << " bytes, padded " << padded);
    CHECK(padded > 0);
    CHECK(contiguous <= padded);
    ++ran;
  }
  CHECK(ran == 2);
}
