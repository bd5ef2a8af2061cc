// lowp-checkpoint-export: writes the fp8 and NF4 checkpoints of one deterministic weight, saved
// under FSDP over --world ranks (fsdp/lowp_checkpoint.h), and the reference values, for
// bench/torch_lowp_checkpoint.py (PyTorch loads the fp8 one as torch.float8_e4m3fn).
//   lowp-checkpoint-export --dir /tmp/lowp-ck --world 4
//   -> /tmp/lowp-ck/fp8/ (w: F8_E4M3, w._scale), /tmp/lowp-ck/nf4/ (w: U8 + scales),
//      /tmp/lowp-ck/reference.safetensors: w (f32), fp8 and nf4 (fsdp::fake_quantize, f32)
// w[i, j] = sin(0.37 * f) * (0.1 + (i % 5)), f = i * cols + j.
#include <CLI/CLI.hpp>

#include <cmath>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "fsdp/lowp_checkpoint.h"
#include "nn/safetensors.h"
#include "program/cli.h"
#include "program/main.h"

int main(int argc, char** argv) {
  return program::run("lowp-checkpoint-export", [&]() -> int {
    std::string dir;
    int world = 4;
    int64_t rows = 64, cols = 96;
    CLI::App app("lowp-checkpoint-export: fp8 / nf4 checkpoints of one weight, and its reference values");
    app.add_option("--dir", dir, "output directory (created; fp8/, nf4/, reference.safetensors)")->required();
    app.add_option("--world", world, "FSDP ranks the checkpoints are saved from")->check(CLI::Range(1, 64));
    app.add_option("--rows", rows, "rows of the weight")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
    app.add_option("--cols", cols, "columns (even: nf4 packs pairs)")->check(CLI::Range(int64_t{2}, int64_t{1} << 16));
    program::parse(app, argc, argv);
    if (cols % 2 != 0) throw kernels::InvalidArgument("--cols " + std::to_string(cols) + ": expected an even count");
    std::filesystem::create_directories(dir);
    kernels::Tensor w = kernels::Tensor::empty({rows, cols}, kernels::DType::kF32);
    w.fill_index_([&](std::span<const int64_t> i) {
      return std::sin(0.37 * static_cast<double>(i[0] * cols + i[1])) * (0.1 + static_cast<double>(i[0] % 5));
    });
    const fsdp::QuantConfig fp8{fsdp::QuantKind::kFp8Tensor}, nf4{fsdp::QuantKind::kNf4};
    collectives::run_ranks(world, [&](collectives::Communicator& c) {
      auto comms = dtensor::MeshComms::create(dtensor::DeviceMesh::from_shape({world}, {"dp_shard"}), c);
      const dtensor::DTensor x = dtensor::distribute_tensor(w, comms, dtensor::parse_placements("S(0)"), std::nullopt);
      checkpoint::save(dir + "/fp8", fsdp::quantize_for_checkpoint("w", x, fp8), c);
      checkpoint::save(dir + "/nf4", fsdp::quantize_for_checkpoint("w", x, nf4), c);
    });
    nn::save_safetensors(dir + "/reference.safetensors",
                         {{"w", w},
                          {"fp8", fsdp::fake_quantize(w, fp8, kernels::DType::kF32)},
                          {"nf4", fsdp::fake_quantize(w, nf4, kernels::DType::kF32)}},
                         {{"format", "pt"}});
    return program::kOk;
  });
}
