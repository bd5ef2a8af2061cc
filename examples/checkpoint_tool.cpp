// checkpoint-tool: inspect, verify and export checkpoints (checkpoint/checkpoint.h), and write a
// demonstration checkpoint under any layout (for the PyTorch exchange script and by hand).
//
//   checkpoint-tool info DIR                      tensors (shape, dtype, chunks), files, values
//   checkpoint-tool export DIR OUT [--prefix P] [--max-file-bytes N]
//                                                 consolidated Hugging Face safetensors
//   checkpoint-tool demo DIR --mesh 2,2 --placements "_S(0,2),S(0)" [--placements-1d "R,S(0)"]
//       saves tensors "demo.a" [13,10], "demo.b" [16,8], "demo.d" [3,4,5] (the 2-D placements)
//       and "demo.c" [7] (1-D placements; default the 2-D ones with shards of dims >= 1
//       replicated) on a local world of the mesh's size; element i (row-major flat index) of
//       tensor k (a, b, c, d: 0..3) is (i % 1000) * 0.5 + k (exact in f32). Any placements a
//       checkpoint saves, RaggedShard included: "Rg(0,[1,2,0,1],4)".
//   checkpoint-tool demo-check DIR --mesh 4 --placements "Rg(0,[1,2,0,1],4)" [--placements-1d P]
//       loads DIR (ours, or one PyTorch wrote with those tensors and values) into the demo
//       tensors under that layout and compares every element with its value; prints one JSON
//       line {"elements": N, "mismatches": M}; exit 1 on a mismatch.
//
// Exit status: 0 ok, 1 demo-check found a mismatch, 2 invalid input (a bad or corrupt checkpoint: the message names the key and
// the file; a path that is not a regular file, cannot be read or cannot be written), 3 out of
// space or quota while writing (the message names the path and the bytes).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>
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

struct DemoLayout {
  dtensor::DeviceMesh mesh;
  dtensor::Placements two_d, one_d;
};

DemoLayout demo_layout(const std::string& mesh_text, const std::string& p2, const std::string& p1) {
  // "2,2" or "2x2" (DeviceMesh::parse checks every number and names a malformed one).
  std::string shape_text = mesh_text;
  std::replace(shape_text.begin(), shape_text.end(), ',', 'x');
  const dtensor::Placements two_d = dtensor::parse_placements(p2);
  dtensor::Placements one_d = p1.empty() ? two_d : dtensor::parse_placements(p1);
  if (p1.empty())  // the 1-D tensor takes the 2-D placements with shards of dim >= 1 replicated
    for (dtensor::Placement& p : one_d) {
      const auto d = dtensor::shard_dim(p), r = dtensor::ragged_dim(p);
      if ((d && *d >= 1) || (r && *r >= 1)) p = dtensor::Replicate{};
    }
  dtensor::DeviceMesh mesh = dtensor::DeviceMesh::from_shape(dtensor::DeviceMesh::parse(shape_text).shape());
  if (mesh.size() > 64)
    throw kernels::InvalidArgument(
        fmt::format("--mesh {}: {} ranks; the demo runs one thread per rank, at most 64", mesh_text, mesh.size()));
  return {std::move(mesh), two_d, one_d};
}

// The demo tensors under `l` on this rank; element i of tensor k is (i % 1000) * 0.5 + k, or 0
// when `zero`. Each rank fills its own layout (no communication; any saveable placements).
nn::StateDict demo_state(const DemoLayout& l, const std::shared_ptr<dtensor::MeshComms>& comms, bool zero) {
  const std::vector<std::pair<std::string, dtensor::Dims>> tensors = {
      {"demo.a", {13, 10}}, {"demo.b", {16, 8}}, {"demo.c", {7}}, {"demo.d", {3, 4, 5}}};
  auto mesh = std::make_shared<dtensor::DeviceMesh>(l.mesh);
  nn::StateDict sd;
  int k = 0;
  for (const auto& [name, shape] : tensors) {
    const dtensor::DTensorSpec spec =
        dtensor::make_spec(mesh, shape.size() == 1 ? l.one_d : l.two_d, shape, kernels::DType::kF32);
    const dtensor::Dims view = dtensor::ragged_view(shape, spec.placements);  // the layout's dims
    const dtensor::ShardLayout layout = *spec.layout(comms->rank());
    std::vector<dtensor::HeldIndices> held;
    for (int t = 0; t < view.size(); ++t) held.emplace_back(layout.runs[t]);
    kernels::Tensor local = kernels::Tensor::empty(layout.local_shape, kernels::DType::kF32);
    local.fill_index_([&](std::span<const int64_t> at) {
      int64_t i = 0;  // the view's row-major flat index is the tensor's
      for (int t = 0; t < view.size(); ++t) i = i * view[t] + held[t][at[t]];
      return zero ? 0.0 : (i % 1000) * 0.5 + k;
    });
    sd.tensors.emplace_back(name, dtensor::DTensor(comms, spec, local));
    ++k;
  }
  return sd;
}

int demo(const std::string& dir, const std::string& mesh_text, const std::string& p2, const std::string& p1) {
  const DemoLayout l = demo_layout(mesh_text, p2, p1);
  collectives::run_ranks(static_cast<int>(l.mesh.size()), [&](collectives::Communicator& world) {
    auto comms = std::make_shared<dtensor::MeshComms>(l.mesh, world);
    nn::StateDict sd = demo_state(l, comms, false);
    sd.values["demo.mesh"] = mesh_text;
    checkpoint::save(dir, sd, world);
  });
  return 0;
}

int demo_check(const std::string& dir, const std::string& mesh_text, const std::string& p2, const std::string& p1) {
  const DemoLayout l = demo_layout(mesh_text, p2, p1);
  std::mutex mu;
  int64_t elements = 0, mismatches = 0;
  collectives::run_ranks(static_cast<int>(l.mesh.size()), [&](collectives::Communicator& world) {
    auto comms = std::make_shared<dtensor::MeshComms>(l.mesh, world);
    nn::StateDict sd = demo_state(l, comms, true);
    checkpoint::LoadOptions o;
    o.strict = false;  // a PyTorch directory may hold more
    checkpoint::load(dir, sd, world, o);
    const nn::StateDict want = demo_state(l, comms, false);
    int64_t n = 0, bad = 0;
    for (size_t i = 0; i < sd.tensors.size(); ++i) {
      const std::vector<double> got = sd.tensors[i].second.to_local().to_vector();
      const std::vector<double> exp = want.tensors[i].second.to_local().to_vector();
      n += static_cast<int64_t>(got.size());
      for (size_t e = 0; e < got.size(); ++e) bad += got[e] != exp[e];
    }
    std::lock_guard lk(mu);
    elements += n;
    mismatches += bad;
  });
  fmt::print("{{\"elements\": {}, \"mismatches\": {}}}\n", elements, mismatches);
  return mismatches == 0 ? 0 : 1;
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
  auto* check_cmd = app.add_subcommand("demo-check", "load a checkpoint of the demo tensors under a layout and "
                                                     "compare every element with its value");
  check_cmd->add_option("dir", dir)->required();
  check_cmd->add_option("--mesh", mesh, "mesh shape, e.g. 2,2");
  check_cmd->add_option("--placements", placements, "placements of the 2-D and 3-D tensors");
  check_cmd->add_option("--placements-1d", placements1, "placements of the 1-D tensor (default: --placements)");
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
    if (*check_cmd) return demo_check(dir, mesh, placements, placements1);
    return demo(dir, mesh, placements, placements1);
  });
  });
}
