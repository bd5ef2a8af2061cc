// Checkpoints of low-precision parameters (fsdp/lowp_checkpoint.h, issue 27): fp8 e4m3 codes
// (per-tensor or row-wise scales) saved as safetensors F8_E4M3 with a "._scale" companion, int8
// blocks as U8 (two's complement) codes with block scales, NF4 as U8 codes with its
// double-quantised scales; saved under FSDP 4 and FSDP x TP, loaded under other layouts and one
// rank, the codes are bit-identical to one rank's quantisation of the full tensor and the
// dequantised tensor equals fsdp::fake_quantize() bit for bit. Element values are a function of
// the global index.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "fsdp/lowp_checkpoint.h"
#include "support/checks.h"

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
  collectives::run_ranks(static_cast<int>(save.shape.product()), [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape(save.shape, save.dims), world);
    const DTensor x = dtensor::distribute_tensor(w, comms, dtensor::parse_placements(save.placements), std::nullopt);
    nn::StateDict sd = fsdp::quantize_for_checkpoint("w", x, q);
    checkpoint::save(dir, sd, world);
  });
  std::pair<Tensor, Tensor> out;
  collectives::run_ranks(static_cast<int>(load.shape.product()), [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape(load.shape, load.dims), world);
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
  collectives::run_ranks(3, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({3}, {"tp"}), world);
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

}  // namespace
