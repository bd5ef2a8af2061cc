// All-gather extensions (fsdp/all_gather_extension.h) and the built-in fp8 / int8 ones
// (fsdp/lowp.h): the codecs against their formulas, the contract (mixed dtypes in one all-gather,
// pre/post once per unshard, errors), and sharding independence: the dequantised weights of a GPT
// are bit-identical under FSDP 1..5 (uneven), HSDP and FSDP x TP, and equal fake_quantize() of the
// full tensor; gradients reach the f32 sharded parameters straight through; the NF4 codec against
// its formulas. Element values are a function of the global index (Init::value).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "fsdp/lowp.h"
#include "fsdp/nf4.h"
#include "nn/optim.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using fsdp::QuantConfig;
using fsdp::QuantKind;
using kernels::DType;
using kernels::Tensor;

TEST_CASE("[lowp] int8 block codec: the worked example, ties to even, block scales", "[lowp]") {
  const Tensor x = Tensor::from_vector({127, -3.5, 0.5, 2.5}, {4});
  CHECK(fsdp::fake_quantize(x, {QuantKind::kInt8Block, 256}, DType::kF32).to_vector() ==
        std::vector<double>{127, -4, 0, 2});
  // Two blocks of 4: each has its own scale (absmax / 127); every code within [-127, 127] and
  // every value within half a step of x.
  const int64_t n = 8;
  Tensor y = Tensor::empty({n}, DType::kF32);
  y.fill_index_([](std::span<const int64_t> i) { return i[0] < 4 ? 0.1 * (i[0] + 1) : -25.4 * (i[0] - 3); });
  const auto got = fsdp::fake_quantize(y, {QuantKind::kInt8Block, 4}, DType::kF32).to_vector();
  const auto want = y.to_vector();
  REQUIRE(got.size() == static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double s = (i < 4 ? 0.4 : 101.6) / 127;
    INFO("element " << i);
    CHECK(std::abs(got[i] - want[i]) <= s / 2 + 1e-5);
    CHECK(std::abs(std::round(got[i] / s) - got[i] / s) < 1e-3);  // a multiple of its block's scale
  }
  CHECK(got[3] == Approx(0.4f));  // the absmax maps to +-127 steps: itself
  CHECK(got[7] == Approx(-101.6f));
  CHECK(fsdp::quantize_value(QuantKind::kInt8Block, 1.0f, 0.0f) == 0);  // an all-zero block
  CHECK(fsdp::quant_groups({QuantKind::kInt8Block, 256}, Dims{3, 200}) == 3);
  CHECK_THROWS_AS(fsdp::quant_groups({QuantKind::kInt8Block, 0}, Dims{4}), kernels::InvalidArgument);
}

TEST_CASE("[lowp] fp8 e4m3 codec: per-tensor and row-wise scales", "[lowp]") {
  // amax 2: scale 224. 2 -> 448 -> 2; 1 -> 224 -> 1; 0.3 -> 67.2 -> e4m3 64 (spacing 8 in
  // [64, 128)) -> 64 / 224; -0.001 -> -0.224 -> e4m3 -0.21875 (spacing 1/64 in [1/8, 1/4)).
  const Tensor x = Tensor::from_vector({2, 1, 0.3, -0.001}, {4});
  const auto got = fsdp::fake_quantize(x, {QuantKind::kFp8Tensor}, DType::kF32).to_vector();
  REQUIRE(got.size() == 4);
  CHECK(got[0] == 2.0);
  CHECK(got[1] == 1.0);
  CHECK(got[2] == static_cast<double>(64.0f / 224.0f));
  CHECK(got[3] == static_cast<double>(-0.21875f / 224.0f));
  CHECK(fsdp::quant_scale(QuantKind::kFp8Tensor, 2.0f) == 224.0f);
  CHECK(fsdp::quant_scale(QuantKind::kFp8Tensor, 0.0f) == 448.0f / 1e-12f);  // eps, no division by 0
  // Saturation, never NaN: a value past amax (stale scale) clamps to 448.
  CHECK(fsdp::dequantize_value(QuantKind::kFp8Tensor, fsdp::quantize_value(QuantKind::kFp8Tensor, 5.0f, 224.0f),
                               224.0f) == 2.0f);
  // Row-wise: rows [4, 1] and [0.5, 0.25] get scales 112 and 896: both rows exact.
  const Tensor r = Tensor::from_vector({4, 1, 0.5, 0.25}, {2, 2});
  CHECK(fsdp::fake_quantize(r, {QuantKind::kFp8Rowwise}, DType::kF32).to_vector() ==
        std::vector<double>{4, 1, 0.5, 0.25});
  CHECK(fsdp::quant_groups({QuantKind::kFp8Rowwise}, Dims{6, 5}) == 6);
  CHECK(fsdp::quant_wire_dtype(QuantKind::kFp8Tensor) == DType::kF8E4M3);
  CHECK(fsdp::quant_wire_dtype(QuantKind::kInt8Block) == DType::kU8);
}

// ---- sharding independence ----

nn::GPTConfig small() {
  nn::GPTConfig c;
  c.vocab = 16;
  c.dim = 24;  // fc1 [96, 24]: 2304 elements; over 5 dp ranks rows 20,20,20,20,16: blocks cut by shards
  c.heads = 2;
  c.layers = 1;
  c.max_seq = 8;
  return c;
}

struct Layout {
  Dims mesh;
  std::vector<std::string> names;
  int tp_dim = -1;
};

bool quantised(const std::string&, const nn::Parameter& p) { return p.shape().size() == 2; }

// The dequantised (bf16) weights of the block after an unshard, full tensors, rank 0's.
std::map<std::string, Tensor> unsharded_weights(const Layout& l, const QuantConfig& q, testing_support::Checks& checks) {
  const DeviceMesh mesh = DeviceMesh::from_shape(l.mesh, l.names);
  std::map<std::string, Tensor> out;
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    if (l.tp_dim >= 0) nn::parallelize_module(model, l.tp_dim, nn::gpt_tensor_parallel_plan(small(), true, true));
    fsdp::FullyShardOptions o;
    o.mp_policy.param_dtype = DType::kBF16;
    auto ext = fsdp::make_quantized_all_gather(q);
    o.all_gather_extension_fn = [&](const std::string& name, const nn::Parameter& p) {
      return quantised(name, p) ? ext : nullptr;
    };
    fsdp::FSDPModule& block = fsdp::fully_shard(model.blocks()[0], comms, o);
    fsdp::fully_shard(model, comms, {});
    nn::materialize(model, 11);
    block.unshard();
    checks.check(block.stats().all_gathers == 1, "one all-gather per unshard");
    checks.check(block.stats().extension_bytes >= 0, "extension bytes counted");
    for (const auto& [name, p] : model.blocks()[0].named_parameters()) {
      if (!quantised(name, *p)) continue;
      checks.check(p->dtype() == DType::kBF16, name + ": the compute tensor is not bf16");
      Tensor full = p->data().full_tensor();
      if (world.rank() == 0) out[name] = full.clone();
    }
    block.reshard();
  });
  return out;
}

std::map<std::string, Tensor> reference_weights(const QuantConfig& q) {
  std::map<std::string, Tensor> out;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({1}, {"tp"}), world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    nn::materialize(model, 11);
    for (const auto& [name, p] : model.blocks()[0].named_parameters())
      if (quantised(name, *p)) out[name] = fsdp::fake_quantize(p->data().to_local(), q, DType::kBF16);
  });
  return out;
}

TEST_CASE("[lowp] dequantised weights are bit-identical under FSDP 1..5, HSDP and FSDP x TP", "[lowp]") {
  const std::vector<Layout> layouts = {
      {{1}, {"dp_shard"}},
      {{2}, {"dp_shard"}},
      {{3}, {"dp_shard"}},
      {{5}, {"dp_shard"}},
      {{2, 2}, {"dp_replicate", "dp_shard"}},
      {{2, 2}, {"dp_shard", "tp"}, 1},
      {{3, 2}, {"dp_shard", "tp"}, 1},
  };
  const std::vector<QuantConfig> configs = {
      {QuantKind::kFp8Tensor}, {QuantKind::kFp8Rowwise}, {QuantKind::kInt8Block, 256}, {QuantKind::kInt8Block, 7}};
  int compared = 0;
  for (const QuantConfig& q : configs) {
    const auto ref = reference_weights(q);
    REQUIRE(ref.size() == 6);  // attn q, k, v, proj; mlp fc1, fc2
    for (const Layout& l : layouts) {
      INFO(fsdp::to_string(q) << " on mesh " << l.names.size() << "-d " << l.mesh.product());
      testing_support::Checks checks;
      const auto got = unsharded_weights(l, q, checks);
      checks.report();
      REQUIRE(got.size() == ref.size());
      for (const auto& [name, t] : ref) {
        INFO(name);
        REQUIRE(got.count(name) == 1);
        CHECK(kernels::equal(got.at(name), t));
        ++compared;
      }
    }
  }
  CHECK(compared == 6 * 7 * 4);
}

TEST_CASE("[lowp] a block cut by a shard boundary: per-shard scales would differ", "[lowp]") {
  // fc1 [96, 24] over 5 dp ranks: rank 0 holds rows 0..19 (flat 0..479): block 1 (256..511)
  // spans ranks 0 and 1. Quantising each shard on its own gives other values than the global
  // blocks (so the bit-identity test above can fail); the global ones are what FSDP produces.
  Tensor w = Tensor::empty({96, 24}, DType::kF32);
  w.fill_index_([](std::span<const int64_t> i) {
    const int64_t f = i[0] * 24 + i[1];
    return std::sin(0.37 * static_cast<double>(f)) * (f == 500 ? 9.0 : 1.0);  // block 1's amax on rank 1
  });
  const QuantConfig q{QuantKind::kInt8Block, 256};
  const Tensor global = fsdp::fake_quantize(w, q, DType::kF32);
  const Tensor shard0 = fsdp::fake_quantize(w.narrow(0, 0, 20).contiguous(), q, DType::kF32);
  CHECK(20 * 24 % 256 != 0);  // the shard boundary cuts a block
  CHECK_FALSE(kernels::equal(shard0, global.narrow(0, 0, 20).contiguous()));
}

// ---- the contract ----

// Gathers two inputs of different dtypes: the shard as f32 times 2, and 3 bytes naming the rank;
// post checks every rank's bytes and halves.
struct TwoInputs : fsdp::AllGatherExtension {
  int pre = 0, post = 0;
  bool bytes_ok = true;
  std::string name() const override { return "two-inputs"; }
  std::vector<fsdp::GatherInput> gather_inputs(const fsdp::AllGatherContext& c) const override {
    return {{DType::kF32, Dims{c.padded_shape.product()}}, {DType::kU8, Dims{3}}};
  }
  fsdp::PreAllGatherResult pre_all_gather(const Tensor& shard, const fsdp::AllGatherContext& c) override {
    ++pre;
    fsdp::PreAllGatherResult r;
    Tensor twice = shard.contiguous().view({shard.numel()}).to(DType::kF32);
    std::vector<double> v = twice.to_vector();
    for (double& e : v) e *= 2;
    r.inputs.push_back(Tensor::from_vector(v, {shard.numel()}, DType::kF32));
    r.inputs.push_back(Tensor::full({3}, static_cast<double>(c.dp_coord), DType::kU8));
    r.metadata = std::string("meta");
    return r;
  }
  void post_all_gather(const std::vector<Tensor>& g, const std::any& meta, DType, Tensor& out,
                       const fsdp::AllGatherContext& c) override {
    ++post;
    bytes_ok = bytes_ok && std::any_cast<std::string>(meta) == "meta" && g.size() == 2;
    const auto b = g[1].to_vector();
    for (size_t i = 0; i < b.size(); ++i) bytes_ok = bytes_ok && b[i] == static_cast<double>(i / 3);
    const int64_t piece = c.padded_shape.product();
    for (size_t d = 0; d < c.chunks.size(); ++d) {
      if (c.chunks[d].size == 0) continue;
      Dims shape = c.padded_shape;
      Tensor rows = g[0].narrow(0, static_cast<int64_t>(d) * piece, piece).view(shape).narrow(c.shard_dim, 0,
                                                                                            c.chunks[d].size);
      std::vector<double> v = rows.contiguous().to_vector();
      for (double& e : v) e /= 2;
      Dims rs = shape;
      rs[c.shard_dim] = c.chunks[d].size;
      out.narrow(c.shard_dim, c.chunks[d].offset, c.chunks[d].size).copy_(Tensor::from_vector(v, rs, DType::kF32));
    }
  }
};

TEST_CASE("[lowp] contract: mixed dtypes in one all-gather per group, pre and post once each", "[lowp]") {
  for (const int dp : {2, 3}) {
    INFO("dp " << dp);
    testing_support::Checks checks;
    std::map<std::string, Tensor> got, want;
    collectives::run_ranks(dp, [&](Communicator& world) {
      auto comms = MeshComms::create(DeviceMesh::from_shape({dp}, {"dp_shard"}), world);
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
      auto ext = std::make_shared<TwoInputs>();
      fsdp::FullyShardOptions o;
      o.all_gather_extension_fn = [&](const std::string& name, const nn::Parameter& p) {
        return quantised(name, p) ? ext : nullptr;
      };
      fsdp::FSDPModule& block = fsdp::fully_shard(model.blocks()[0], comms, o);
      fsdp::fully_shard(model, comms, {});
      nn::materialize(model, 11);
      for (int round = 0; round < 2; ++round) {
        block.unshard();
        for (const auto& [name, p] : model.blocks()[0].named_parameters()) {
          Tensor full = p->data().full_tensor();
          if (world.rank() == 0 && round == 1) got[name] = full.clone();
        }
        block.reshard();
      }
      checks.check(block.stats().all_gathers == 2, "one all-gather per unshard");
      checks.check(ext->pre == 12 && ext->post == 12, "pre/post once per extended parameter and unshard");
      checks.check(ext->bytes_ok, "the u8 input of every rank arrived in rank order");
      checks.check(block.stats().all_gather_bytes > 0, "all-gather bytes counted");
    });
    checks.report();
    // The reference: the same model unsharded on one rank.
    collectives::run_ranks(1, [&](Communicator& world) {
      auto comms = MeshComms::create(DeviceMesh::from_shape({1}, {"tp"}), world);
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
      nn::materialize(model, 11);
      for (const auto& [name, p] : model.blocks()[0].named_parameters()) want[name] = p->data().to_local().clone();
    });
    REQUIRE(got.size() == want.size());
    REQUIRE(got.size() >= 10);  // 6 weights (extended) and the norms (plain) in one group
    for (const auto& [name, t] : want) {
      INFO(name);
      CHECK(kernels::equal(got.at(name), t));
    }
  }
}

TEST_CASE("[lowp] contract errors name the parameter", "[lowp]") {
  testing_support::Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({2}, {"dp_shard"}), world);
    {
      // A wrong dtype returned by pre_all_gather is refused naming the parameter.
      struct Wrong final : TwoInputs {
        fsdp::PreAllGatherResult pre_all_gather(const Tensor& shard, const fsdp::AllGatherContext& c) override {
          fsdp::PreAllGatherResult r = TwoInputs::pre_all_gather(shard, c);
          r.inputs[1] = r.inputs[1].to(DType::kF32);
          return r;
        }
      };
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
      fsdp::FullyShardOptions o;
      auto ext = std::make_shared<Wrong>();
      o.all_gather_extension_fn = [&](const std::string& name, const nn::Parameter& p) {
        return name == "mlp.fc1.weight" && p.shape().size() == 2 ? ext : nullptr;
      };
      fsdp::FSDPModule& block = fsdp::fully_shard(model.blocks()[0], comms, o);
      nn::materialize(model, 11);
      checks.throws<kernels::InvalidArgument>([&] { block.unshard(); }, "mlp.fc1.weight", "wrong dtype");
    }
  });
  checks.report();
}

TEST_CASE("[lowp] reshard_after_forward k with an extension is refused", "[lowp]") {
  testing_support::Checks checks;
  const DeviceMesh mesh = DeviceMesh::from_shape({4}, {"dp_shard"});
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = MeshComms::create(mesh, world, {}, nullptr, {fsdp::reshard_unflattening(mesh, 0, 2)});
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    fsdp::FullyShardOptions o;
    o.all_gather_extension_fn = [](const std::string& name, const nn::Parameter& p) {
      return quantised(name, p) ? fsdp::make_quantized_all_gather({QuantKind::kFp8Tensor}) : nullptr;
    };
    o.reshard_after_forward = fsdp::ReshardAfterForward::to(2);
    checks.throws<kernels::Unsupported>([&] { fsdp::fully_shard(model.blocks()[0], comms, o); },
                                        "reshard_after_forward = 2", "k with extensions");
  });
  checks.report();
}

// ---- NF4 (codec only) ----

TEST_CASE("[lowp] nf4 codes: every level maps to itself, a midpoint to the lower level", "[lowp]") {
  int n = 0;
  for (size_t i = 0; i < fsdp::kNf4Levels.size(); ++i, ++n) {
    CHECK(fsdp::nf4_code(fsdp::kNf4Levels[i]) == i);
    if (i + 1 < fsdp::kNf4Levels.size()) {
      const float mid = (fsdp::kNf4Levels[i] + fsdp::kNf4Levels[i + 1]) * 0.5f;
      CHECK(fsdp::nf4_code(mid) == i);
      CHECK(fsdp::nf4_code(std::nextafter(mid, 2.0f)) == i + 1);
    }
  }
  CHECK(n == 16);
}

TEST_CASE("[lowp] nf4: one block round-trips exactly, nibble order, sizes", "[lowp]") {
  // 64 elements level[i % 16] * 2: absmax 2, one block, so the double-quantised absmax is the
  // mean (2) itself: exact.
  Tensor w = Tensor::empty({4, 16}, DType::kF32);
  w.fill_index_([](std::span<const int64_t> i) { return 2.0 * fsdp::kNf4Levels[static_cast<size_t>(i[1])]; });
  const fsdp::Nf4Tensor q = fsdp::nf4_quantize(w);
  CHECK(q.codes.numel() == 32);
  CHECK(q.scalers.numel() == 1);
  CHECK(q.factors.numel() == 1);
  CHECK(q.mean == 2.0f);
  CHECK(q.codes.to_vector()[0] == 0x01);  // element 0 (code 0) high, element 1 (code 1) low
  CHECK(q.codes.to_vector()[7] == 0xEF);  // elements 14, 15
  CHECK(kernels::equal(fsdp::nf4_dequantize(q, DType::kF32), w));
  // An odd count: 5 elements in 3 bytes.
  CHECK(fsdp::nf4_quantize(Tensor::from_vector({1, -1, 0.5, 0, 0.25}, {5})).codes.numel() == 3);
  CHECK_THROWS_AS(fsdp::nf4_quantize(Tensor::empty({0}, DType::kF32)), kernels::InvalidArgument);
}

TEST_CASE("[lowp] nf4 with double-quantised scales: error bounds and 4.127 bits per weight", "[lowp]") {
  // 300 blocks of 64 (two scaler blocks: 256 + 44), values a function of the global index.
  const int64_t n = 300 * 64;
  Tensor w = Tensor::empty({n / 96, 96}, DType::kF32);
  w.fill_index_([](std::span<const int64_t> i) {
    const int64_t f = i[0] * 96 + i[1];
    return std::sin(0.013 * static_cast<double>(f)) * (1.0 + static_cast<double>(f % 977) / 977.0);
  });
  const fsdp::Nf4Tensor q = fsdp::nf4_quantize(w);
  REQUIRE(q.scalers.numel() == 300);
  REQUIRE(q.factors.numel() == 2);
  const auto x = w.to_vector(), y = fsdp::nf4_dequantize(q, DType::kF32).to_vector();
  REQUIRE(x.size() == y.size());
  // Per block: the absmax, its double-quantised value (within half a step of 1 / factor), and
  // every element within half the widest level gap of it (plus the absmax error).
  float widest = 0;
  for (size_t i = 0; i + 1 < fsdp::kNf4Levels.size(); ++i)
    widest = std::max(widest, fsdp::kNf4Levels[i + 1] - fsdp::kNf4Levels[i]);
  int blocks = 0;
  for (int64_t b = 0; b < 300; ++b, ++blocks) {
    double amax = 0;
    for (int64_t i = b * 64; i < (b + 1) * 64; ++i) amax = std::max(amax, std::abs(x[static_cast<size_t>(i)]));
    const double factor = q.factors.to_vector()[static_cast<size_t>(b / 256)];
    REQUIRE(factor > 0);
    const double amax_err = 0.5 / factor + 1e-6;
    for (int64_t i = b * 64; i < (b + 1) * 64; ++i) {
      INFO("element " << i);
      CHECK(std::abs(y[static_cast<size_t>(i)] - x[static_cast<size_t>(i)]) <= widest / 2 * amax + amax_err);
    }
  }
  CHECK(blocks == 300);
  const double bits = 8.0 * static_cast<double>(q.codes.nbytes() + q.scalers.nbytes() + q.factors.nbytes() + 4) / n;
  CHECK(bits == Approx(4.127).epsilon(0.001));
}

// ---- gradients: straight-through to the high-precision sharded parameter ----

// One forward/backward of the GPT on 4 sequences; the full gradients (rank 0's) and the full
// parameters after it. fsdp: FSDP over 2 ranks with the int8 extension (f32 compute, so the
// comparison is tight); otherwise one rank computing with fake_quantize()d weights.
std::map<std::string, Tensor> grads_of(bool fsdp_run, std::map<std::string, Tensor>* params_after) {
  std::map<std::string, Tensor> out;
  const int ranks = fsdp_run ? 2 : 1;
  const QuantConfig q{QuantKind::kInt8Block, 256};
  collectives::run_ranks(ranks, [&](Communicator& world) {
    const DeviceMesh mesh = DeviceMesh::from_shape({ranks}, {fsdp_run ? "dp_shard" : "tp"});
    auto comms = MeshComms::create(mesh, world);
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, small());
    if (fsdp_run) {
      fsdp::FullyShardOptions o;
      auto ext = fsdp::make_quantized_all_gather(q);
      o.all_gather_extension_fn = [&](const std::string& name, const nn::Parameter& p) {
        return quantised(name, p) ? ext : nullptr;
      };
      fsdp::fully_shard(model.blocks()[0], comms, o);
      fsdp::fully_shard(model, comms, {});
    }
    nn::materialize(model, 11);
    if (!fsdp_run)
      for (const auto& [name, p] : model.blocks()[0].named_parameters())
        if (quantised(name, *p)) {
          Tensor local = p->data().to_local();
          local.copy_(fsdp::fake_quantize(local, q, DType::kF32));
        }
    Tensor ids = Tensor::empty({4, 8}, DType::kI64), tgt = Tensor::empty({4, 8}, DType::kI64);
    ids.fill_index_([](std::span<const int64_t> i) { return static_cast<double>((i[0] * 7 + i[1] * 3) % 16); });
    tgt.fill_index_([](std::span<const int64_t> i) { return static_cast<double>((i[0] * 5 + i[1] * 11 + 1) % 16); });
    const dtensor::Placements pl{dtensor::Shard{0}};
    const DTensor x = dtensor::distribute_tensor(ids, comms, fsdp_run ? pl : dtensor::Placements{dtensor::Replicate{}},
                                                 std::nullopt);
    const DTensor y = dtensor::distribute_tensor(tgt, comms, fsdp_run ? pl : dtensor::Placements{dtensor::Replicate{}},
                                                 std::nullopt);
    auto shared_mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, {dtensor::Replicate{}}, {}, DType::kF64),
                        Tensor::full({}, 1.0, DType::kF64));
    nn::CrossEntropyLoss loss_fn;
    nn::Ctx ctx, lctx;
    DTensor logits = model.forward(ctx, x);
    loss_fn.forward(lctx, logits, y);
    model.backward(ctx, loss_fn.backward(lctx, dloss));
    const auto params = model.named_parameters();
    nn::reduce_gradients(params);
    for (const auto& [name, p] : params) {
      if (!p->grad()) continue;
      Tensor g = p->grad()->full_tensor();
      Tensor v = p->data().full_tensor();
      if (world.rank() == 0) {
        out[name] = g.clone();
        if (params_after) (*params_after)[name] = v.clone();
      }
    }
  });
  return out;
}

TEST_CASE("[lowp] gradients flow straight through to the f32 sharded parameters", "[lowp]") {
  std::map<std::string, Tensor> after;
  const auto got = grads_of(true, &after);
  const auto want = grads_of(false, nullptr);
  REQUIRE(got.size() == want.size());
  REQUIRE(got.size() > 10);
  double num = 0, den = 0;
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    const auto a = got.at(name).to_vector(), b = t.to_vector();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
  }
  CHECK(den > 0);
  CHECK(std::sqrt(num / den) <= 1e-5);
  // The sharded parameters stay the f32 master values (not quantised): a quantised weight
  // differs from its fake_quantize().
  const Tensor& w = after.at("blocks.0.mlp.fc1.weight");
  CHECK(w.dtype() == DType::kF32);
  CHECK_FALSE(kernels::equal(w, fsdp::fake_quantize(w, {QuantKind::kInt8Block, 256}, DType::kF32)));
}

}  // namespace
