// Checkpoints of low-precision parameters (fsdp/lowp_checkpoint.h, issue 27): fp8 e4m3 codes
// (per-tensor or row-wise scales) saved as safetensors F8_E4M3 with a "._scale" companion, int8
// blocks as U8 (two's complement) codes with block scales, NF4 as U8 codes with its
// double-quantised scales; saved under FSDP 4 and FSDP x TP, loaded under other layouts and one
// rank, the codes are bit-identical to one rank's quantisation of the full tensor and the
// dequantised tensor equals fsdp::fake_quantize() bit for bit. Element values are a function of
// the global index.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "fsdp/fully_shard.h"
#include "fsdp/lowp_checkpoint.h"
#include "nn/transformer.h"
#include "support/checks.h"
#include "support/local_mesh.h"

namespace {

namespace fs = std::filesystem;
using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using fsdp::QuantConfig;
using fsdp::QuantKind;
using kernels::DType;
using kernels::Tensor;
using testing_support::on_mesh;

// [20, 24]: 480 elements, 7.5 blocks of 64 (FSDP 3 and uneven shards cut blocks); magnitudes
// vary by row so the blocks' absmax differ.
Tensor weight() {
  Tensor w = Tensor::empty({20, 24}, DType::kF32);
  w.fill_index_([](std::span<const int64_t> i) {
    const int64_t f = i[0] * 24 + i[1];
    return std::sin(0.61 * static_cast<double>(f)) * (0.05 + 0.1 * static_cast<double>(i[0] % 7));
  });
  return w;
}

struct Mesh {
  std::string name;
  Dims shape;
  std::vector<std::string> dims;
  std::string placements;
};

// Saves `w` quantised under `save`, loads under `load`; returns rank 0's full dequantised tensor
// and full codes (as u8).
std::pair<Tensor, Tensor> round_trip(const QuantConfig& q, const Mesh& save, const Mesh& load, const std::string& dir,
                                     testing_support::Checks& checks) {
  const Tensor w = weight();
  on_mesh(DeviceMesh::from_shape(save.shape, save.dims), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    const DTensor x = dtensor::distribute_tensor(w, comms, dtensor::parse_placements(save.placements), std::nullopt);
    nn::StateDict sd = fsdp::quantize_for_checkpoint("w", x, q);
    checkpoint::save(dir, sd, world);
  });
  std::pair<Tensor, Tensor> out;
  on_mesh(DeviceMesh::from_shape(load.shape, load.dims), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    const DTensor like = dtensor::distribute_tensor(Tensor::zeros({20, 24}, DType::kF32), comms,
                                                    dtensor::parse_placements(load.placements), std::nullopt);
    nn::StateDict t = fsdp::quantized_checkpoint_template("w", like, q);
    checkpoint::load(dir, t, world);
    const DTensor deq = fsdp::dequantize_from_checkpoint(t, "w", like, DType::kF32);
    checks.check(deq.placements() == like.placements(), "dequantised with the target's placements");
    Tensor full = deq.full_tensor();
    const DTensor& codes = *t.find("w");
    Tensor c = codes.full_tensor();
    if (world.rank() == 0) {
      out.first = full.clone();
      out.second = Tensor::from_storage(c.clone().storage(), DType::kU8, c.shape(), c.strides());
    }
  });
  return out;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("lowp-ckpt-" + tag + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

TEST_CASE("lowp checkpoint: fp8, fp8 row-wise, int8 and nf4 round-trip and reshard bit-exactly", "[checkpoint][lowp]") {
  const std::vector<Mesh> saves = {
      {"fsdp4", {4}, {"dp_shard"}, "S(0)"},
      {"fsdp-x-tp", {2, 2}, {"dp_shard", "tp"}, "S(0),S(1)"},
      {"fsdp-x-tp-strided", {2, 2}, {"dp_shard", "tp"}, "_S(0,2),S(0)"},
  };
  const std::vector<Mesh> loads = {
      {"one", {1}, {"dp_shard"}, "R"},
      {"fsdp3", {3}, {"dp_shard"}, "S(0)"},
      {"hsdp", {2, 2}, {"dp_replicate", "dp_shard"}, "R,S(0)"},
  };
  int compared = 0;
  // int8 blocks of 64: 7.5 blocks, cut by FSDP 3's and 4's shards (and by tp's column split).
  for (const QuantConfig q : {QuantConfig{QuantKind::kFp8Tensor}, QuantConfig{QuantKind::kFp8Rowwise},
                              QuantConfig{QuantKind::kInt8Block, 64}, QuantConfig{QuantKind::kNf4}}) {
    const Tensor want = fsdp::fake_quantize(weight(), q, DType::kF32);
    Tensor one_codes;
    for (const Mesh& s : saves)
      for (const Mesh& l : loads) {
        INFO(fsdp::to_string(q) << ": saved under " << s.name << ", loaded under " << l.name);
        TempDir dir(fsdp::to_string(q) + s.name + l.name);
        testing_support::Checks checks;
        const auto [got, codes] = round_trip(q, s, l, dir.path.string(), checks);
        checks.report();
        REQUIRE(got.defined());
        CHECK(kernels::equal(got, want));
        if (!one_codes.defined()) one_codes = codes;
        CHECK(kernels::equal(codes, one_codes));  // the same bytes whatever the layout
        // The file format: the codes' safetensors dtype and the companion scales.
        std::ifstream in(dir.path / "checkpoint.json");
        const auto j = nlohmann::json::parse(in);
        const bool bytes = q.kind == QuantKind::kNf4 || q.kind == QuantKind::kInt8Block;
        CHECK(j["tensors"]["w"]["dtype"] == (bytes ? "U8" : "F8_E4M3"));
        CHECK(j["tensors"].contains("w._scale"));
        CHECK(j["tensors"]["w"]["shape"] == std::vector<int64_t>{20, q.kind == QuantKind::kNf4 ? 12 : 24});
        const std::map<QuantKind, std::pair<std::string, std::vector<int64_t>>> kinds = {
            {QuantKind::kFp8Tensor, {"\"fp8-e4m3\"", {1}}},
            {QuantKind::kFp8Rowwise, {"\"fp8-e4m3-rowwise\"", {20, 1}}},
            {QuantKind::kInt8Block, {"\"int8\"", {8}}},
            {QuantKind::kNf4, {"\"nf4\"", {8}}}};
        CHECK(j.dump().find(kinds.at(q.kind).first) != std::string::npos);
        CHECK(j["tensors"]["w._scale"]["shape"] == kinds.at(q.kind).second);
        ++compared;
      }
  }
  CHECK(compared == 4 * 3 * 3);
}

TEST_CASE("lowp checkpoint: refusals name the tensor (nf4 byte cut by a split, int8 block, bad entries)",
          "[checkpoint][lowp]") {
  // [4, 9] over tp 3 on the last dim: 3 columns each, so rank 0 holds 0..2 and byte 1 (columns 2,
  // 3) would straddle ranks 0 and 1.
  testing_support::Checks checks;
  on_mesh(DeviceMesh::from_shape({3}, {"tp"}), [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    Tensor w = Tensor::empty({4, 9}, DType::kF32);
    w.fill_index_([](std::span<const int64_t> i) { return 0.1 * static_cast<double>(i[0] * 9 + i[1]); });
    const DTensor x = dtensor::distribute_tensor(w, comms, dtensor::parse_placements("S(1)"), std::nullopt);
    bool refused = false;
    try {
      fsdp::quantize_for_checkpoint("blocks.0.mlp.fc2.weight", x, {QuantKind::kNf4});
    } catch (const kernels::Unsupported& e) {
      refused = std::string(e.what()).find("blocks.0.mlp.fc2.weight") != std::string::npos;
    }
    checks.check(refused, "nf4 with an odd last-dim split is refused naming the tensor");
    std::string int8;
    try {
      fsdp::quantize_for_checkpoint("w", x, {QuantKind::kInt8Block, 0});
    } catch (const kernels::InvalidArgument& e) {
      int8 = e.what();
    }
    checks.check(int8.find("'w'") != std::string::npos && int8.find("block size 0") != std::string::npos,
                 "an int8 block of 0 is refused naming the tensor: '" + int8 + "'");
    // int8 needs its block size: a missing "w._block" is named.
    nn::StateDict i8 = fsdp::quantized_checkpoint_template("w", x, {QuantKind::kInt8Block, 4});
    i8.values.erase("w._block");
    std::string no_block;
    try {
      fsdp::dequantize_from_checkpoint(i8, "w", x, DType::kF32);
    } catch (const kernels::InvalidArgument& e) {
      no_block = e.what();
    }
    checks.check(no_block.find("w._block") != std::string::npos, "a missing int8 block named: '" + no_block + "'");
    // A loaded entry that is not what it should be: InvalidArgument naming the key.
    nn::StateDict t = fsdp::quantized_checkpoint_template("w", x, {QuantKind::kFp8Tensor});
    std::string bad_kind, bad_scale;
    t.values["w._quant"] = int64_t{3};
    try {
      fsdp::dequantize_from_checkpoint(t, "w", x, DType::kF32);
    } catch (const kernels::InvalidArgument& e) {
      bad_kind = e.what();
    }
    t.values["w._quant"] = std::string("fp8-e4m3");
    t.tensors.pop_back();  // w._scale
    try {
      fsdp::dequantize_from_checkpoint(t, "w", x, DType::kF32);
    } catch (const kernels::InvalidArgument& e) {
      bad_scale = e.what();
    }
    checks.check(bad_kind.find("w._quant") != std::string::npos, "a wrong _quant value named: '" + bad_kind + "'");
    checks.check(bad_scale.find("w._scale") != std::string::npos && bad_scale.find("missing") != std::string::npos,
                 "a missing scale named: '" + bad_scale + "'");
  });
  checks.report();
}

// QLoRA's frozen base stored as NF4 (fsdp::quantize_frozen): on FSDP 3 (dim 24, LoRA rank 2) the
// six frozen linear weights' f32 masters leave the flat buffer (exactly their padded bytes), the
// parameters are meta between unshards, each weight keeps only its codes and scales, an unshard
// gives fake_quantize() of the master it was quantised from, and a checkpoint of the stored
// codes loads back into them bit-exactly (the stored codes zeroed in between).
TEST_CASE("lowp checkpoint: frozen NF4 weights stored as codes only; save and load into them", "[checkpoint][lowp][qlora]") {
  testing_support::Checks checks;
  TempDir dir("frozen-nf4");
  int weights_checked = 0;
  on_mesh(DeviceMesh::from_shape({3}, {"dp_shard"}), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::GPTConfig cfg;
    cfg.vocab = 16;
    cfg.dim = 24;  // wq..wo [24, 24], fc1 [96, 24], fc2 [24, 96]: 8, 8, 32, 8 rows per rank
    cfg.heads = 2;
    cfg.layers = 1;
    cfg.max_seq = 8;
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
    nn::add_lora(model, 2, 4.0);
    std::map<std::string, std::shared_ptr<fsdp::AllGatherExtension>> ext;
    fsdp::FullyShardOptions o;
    o.all_gather_extension_fn = [&](const std::string& name, const nn::Parameter& p) {
      const bool base = !p.requires_grad && p.shape().size() == 2 &&
                        (name.find("attn.") != std::string::npos || name.find("mlp.") != std::string::npos);
      return base ? (ext[name] = fsdp::make_quantized_all_gather({QuantKind::kNf4, 256, true})) : nullptr;
    };
    fsdp::FSDPModule& block = fsdp::fully_shard(model.blocks()[0], comms, o);
    fsdp::fully_shard(model, comms, {});
    nn::materialize(model, 11);
    nn::Module& b0 = model.blocks()[0];
    std::map<std::string, Tensor> want;  // fake_quantize of each full master
    int64_t padded_bytes = 0;
    for (const auto& [name, e] : ext) {
      const nn::Parameter& p = b0.parameter(name);
      want[name] = fsdp::fake_quantize(p.data().full_tensor(), {QuantKind::kNf4}, DType::kF32);
      padded_bytes += (p.shape()[0] + 2) / 3 * p.shape()[1] * 4;
    }
    checks.check(ext.size() == 6, "six frozen linear weights");
    const int64_t before = block.sharded_bytes();
    const int64_t released = fsdp::quantize_frozen(model);
    checks.check(released == padded_bytes, fmt::format("released {} bytes, expected {}", released, padded_bytes));
    checks.check(block.sharded_bytes() == before - released, "the flat buffer lost exactly those bytes");
    checks.check(fsdp::quantize_frozen(model) == 0, "a second call has nothing to quantise");
    for (const auto& [name, e] : ext) {
      const nn::Parameter& p = b0.parameter(name);
      checks.check(p.is_meta(), name + ": no master between unshards");
      const fsdp::StoredNf4* st = fsdp::stored_nf4(*e);
      const int64_t n = p.shape()[0] * p.shape()[1], padded = (p.shape()[0] + 2) / 3 * p.shape()[1];
      const int64_t blocks = (n + 63) / 64;
      checks.check(st && st->bytes() == (padded + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4,
                   name + ": codes and double-quantised scales only");
    }
    auto unsharded_equal = [&](const std::string& what) {
      block.unshard();
      for (const auto& [name, e] : ext) {
        const Tensor got = b0.parameter(name).data().to_local();
        checks.check(kernels::equal(got, want.at(name)), name + ": " + what);
        if (world.rank() == 0) ++weights_checked;
      }
      block.reshard();
      for (const auto& [name, e] : ext) checks.check(b0.parameter(name).is_meta(), name + ": meta after reshard");
    };
    unsharded_equal("unshard of the stored codes == fake_quantize(master)");
    for (const auto& [name, e] : ext)
      checks.check(kernels::equal(fsdp::stored_nf4_dequantize(*e, DType::kF32).full_tensor(), want.at(name)),
                   name + ": stored_nf4_dequantize == fake_quantize(master)");
    nn::StateDict sd;
    for (const auto& [name, e] : ext) sd.merge(fsdp::stored_nf4_state_dict(name, *e));
    checkpoint::save(dir.path.string(), sd, world);
    for (const auto& [name, e] : ext) {
      const fsdp::StoredNf4* st = fsdp::stored_nf4(*e);
      for (Tensor t : {st->codes, st->scalers, st->factors, st->mean}) t.fill_(0.0);
    }
    nn::StateDict back;
    for (const auto& [name, e] : ext) back.merge(fsdp::stored_nf4_state_dict(name, *e));
    checkpoint::load(dir.path.string(), back, world);
    unsharded_equal("unshard after loading the codes back");
    std::string refused;
    try {
      nn::materialize(model, 11);
    } catch (const kernels::InvalidArgument& e) {
      refused = e.what();
    }
    checks.check(refused.find("quantize_frozen") != std::string::npos,
                 "materialising a stored weight again is refused: '" + refused + "'");
  });
  checks.report();
  CHECK(weights_checked == 2 * 6);
}

}  // namespace
