// checkpoint-tool: inspect, verify and export checkpoints (checkpoint/checkpoint.h), and write a
// demonstration checkpoint under any layout (for the PyTorch exchange script and by hand).
//
//   checkpoint-tool info DIR                      tensors (shape, dtype, chunks), files, values
//   checkpoint-tool export DIR OUT [--prefix P] [--max-file-bytes N]
//                                                 consolidated Hugging Face safetensors
//   checkpoint-tool demo DIR --mesh 2,2 --placements "_S(0,2),S(0)" [--placements-1d "R,S(0)"]
//       saves tensors "demo.a" [13,10], "demo.b" [16,8] (2-D placements) and "demo.c" [7]
//       (1-D placements; default the 2-D ones) on a local world of the mesh's size; element i
//       (row-major flat index) of tensor k is (i % 1000) * 0.5 + k (exact in f32).
//
// Exit status: 0 ok, 2 invalid input (a bad or corrupt checkpoint: the message names the key and
// the file; a path that is not a regular file, cannot be read or cannot be written), 3 out of
// space or quota while writing (the message names the path and the bytes).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/format.h"
#include "program/cli.h"
#include "program/main.h"

namespace {

int info(const std::string& dir) {
  const checkpoint::Metadata md = checkpoint::read_metadata(dir);
  nlohmann::ordered_json out;
  out["foreign"] = md.foreign;
  for (const auto& [k, t] : md.tensors) {
    nlohmann::ordered_json chunks = nlohmann::ordered_json::array();
    for (const auto& c : t.chunks)
      chunks.push_back({{"offsets", std::vector<int64_t>(c.offsets.begin(), c.offsets.end())},
                        {"sizes", std::vector<int64_t>(c.sizes.begin(), c.sizes.end())},
                        {"file", c.file}});
    out["tensors"][k] = {{"shape", std::vector<int64_t>(t.shape.begin(), t.shape.end())},
                         {"dtype", std::string(kernels::to_string(t.dtype))},
                         {"chunks", chunks}};
  }
  for (const auto& [k, v] : md.values) {
    if (const auto* i = std::get_if<int64_t>(&v)) out["values"][k] = *i;
    else if (const auto* d = std::get_if<double>(&v)) out["values"][k] = *d;
    else out["values"][k] = std::get<std::string>(v);
  }
  fmt::print("{}\n", out.dump(1));
  return 0;
}

// Runs a subcommand; a filesystem or JSON error the library did not already wrap still leaves
// with the contract's status (program/main.h would report it as an internal error, 1).
template <class F>
int wrapped(F&& f) {
  try {
    return f();
  } catch (const std::filesystem::filesystem_error& e) {
    kernels::throw_file_error(e.code().value(), fmt::format("checkpoint-tool: '{}'", e.path1().string()));
  } catch (const nlohmann::json::exception& e) {
    throw kernels::InvalidArgument(fmt::format("malformed JSON: {}", e.what()));
  }
}

int demo(const std::string& dir, const std::string& mesh_text, const std::string& p2, std::string p1) {
  // "2,2" or "2x2" (DeviceMesh::parse checks every number and names a malformed one).
  std::string shape_text = mesh_text;
  std::replace(shape_text.begin(), shape_text.end(), ',', 'x');
  const dtensor::Placements two_d = dtensor::parse_placements(p2);
  dtensor::Placements one_d = p1.empty() ? two_d : dtensor::parse_placements(p1);
  if (p1.empty())  // the 1-D tensor takes the 2-D placements with shards of dim >= 1 replicated
    for (dtensor::Placement& p : one_d)
      if (auto d = dtensor::shard_dim(p); d && *d >= 1) p = dtensor::Replicate{};
  const dtensor::DeviceMesh mesh = dtensor::DeviceMesh::from_shape(dtensor::DeviceMesh::parse(shape_text).shape());
  if (mesh.size() > 64)
    throw kernels::InvalidArgument(
        fmt::format("--mesh {}: {} ranks; the demo runs one thread per rank, at most 64", mesh_text, mesh.size()));
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](collectives::Communicator& world) {
    auto comms = std::make_shared<dtensor::MeshComms>(mesh, world);
    nn::StateDict sd;
    const std::vector<std::pair<std::string, dtensor::Dims>> tensors = {
        {"demo.a", {13, 10}}, {"demo.b", {16, 8}}, {"demo.c", {7}}};
    int k = 0;
    for (const auto& [name, shape] : tensors) {
      kernels::Tensor full = kernels::Tensor::empty(shape, kernels::DType::kF32);
      float* p = full.data<float>();
      for (int64_t i = 0; i < shape.product(); ++i) p[i] = static_cast<float>((i % 1000) * 0.5 + k);
      sd.tensors.emplace_back(name, dtensor::distribute_tensor(full, comms,
                                                               shape.size() == 2 ? two_d : one_d,
                                                               std::nullopt));
      ++k;
    }
    sd.values["demo.mesh"] = mesh_text;
    checkpoint::save(dir, sd, world);
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("checkpoint-tool", [&]() -> int {
  CLI::App app("checkpoint-tool: inspect, export and demonstrate distributed checkpoints");
  app.require_subcommand(1);
  std::string dir, out, prefix, mesh = "2,2", placements = "S(0),S(1)", placements1;
  uint64_t max_file_bytes = 0;
  auto* info_cmd = app.add_subcommand("info", "print a checkpoint's tensors, chunks and values");
  info_cmd->add_option("dir", dir)->required();
  auto* export_cmd = app.add_subcommand("export", "write consolidated Hugging Face safetensors");
  export_cmd->add_option("dir", dir)->required();
  export_cmd->add_option("out", out)->required();
  export_cmd->add_option("--prefix", prefix, "only keys with this prefix (removed in the output)");
  export_cmd->add_option("--max-file-bytes", max_file_bytes, "split into files of at most this size (0: one)");
  auto* demo_cmd = app.add_subcommand("demo", "save a demonstration checkpoint under a layout");
  demo_cmd->add_option("dir", dir)->required();
  demo_cmd->add_option("--mesh", mesh, "mesh shape, e.g. 2,2");
  demo_cmd->add_option("--placements", placements, "placements of the 2-D tensors");
  demo_cmd->add_option("--placements-1d", placements1, "placements of the 1-D tensor (default: --placements)");
  program::parse(app, argc, argv);
  return wrapped([&] {
    if (*info_cmd) return info(dir);
    if (*export_cmd) {
      checkpoint::ExportOptions o;
      o.prefix = prefix;
      o.max_file_bytes = max_file_bytes;
      for (const std::string& f : checkpoint::export_safetensors(dir, out, o)) fmt::print("{}\n", f);
      return 0;
    }
    return demo(dir, mesh, placements, placements1);
  });
  });
}
