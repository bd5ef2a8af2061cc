// dtensor-check: command-line checks of the runtime's contracts.
//   dtensor-check layout --mesh 4x2 --shape 13,2 --placements 'S(0),S(0)' [--names dp,tp]
//     one JSON object per rank, in rank order:
//     {"rank":0,"coord":[0,0],"local_shape":[2,2],"global_offset":[0,0],"indices":[[0,1],[0,1]]}
//   dtensor-check demo
//     a tour of the layout rules on a few meshes (the README's main job for now).
// Exit status: 0 success, 2 invalid input (one line on stderr naming the bad value).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "dtensor/spec.h"
#include "kernels/error.h"

namespace {

using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::Placements;

Dims parse_shape(const std::string& text) {
  Dims shape;
  if (text.empty()) return shape;  // a 0-d tensor
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find_first_of(",x", begin);
    if (end == std::string::npos) end = text.size();
    std::string_view part(text.data() + begin, end - begin);
    int64_t v = -1;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (part.empty() || ec != std::errc() || p != part.data() + part.size() || v < 0)
      throw kernels::InvalidArgument(fmt::format(
          "shape '{}' is malformed at '{}': expected comma-separated sizes >= 0 like 13,2", text,
          part));
    shape.push_back(v);
    begin = end + 1;
  }
  return shape;
}

std::vector<std::string> parse_names(const std::string& text) {
  std::vector<std::string> names;
  if (text.empty()) return names;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    names.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return names;
}

struct LayoutArgs {
  std::string mesh, shape, placements, names;
};

struct Problem {
  std::shared_ptr<const DeviceMesh> mesh;
  dtensor::DTensorSpec spec;
};

Problem make_problem(const LayoutArgs& a) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(a.mesh, parse_names(a.names)));
  Dims shape = parse_shape(a.shape);
  Placements placements = dtensor::parse_placements(a.placements);
  return {mesh, dtensor::make_spec(mesh, placements, shape, kernels::DType::kF32)};
}

void print_layout(const Problem& p) {
  std::vector<int> ranks = p.mesh->ranks();
  std::sort(ranks.begin(), ranks.end());
  for (int rank : ranks) {
    dtensor::ShardLayout layout = *p.spec.layout(rank);
    nlohmann::ordered_json j;
    j["rank"] = rank;
    j["coord"] = p.mesh->coord_of(rank)->vec();
    j["local_shape"] = layout.local_shape.vec();
    j["global_offset"] = layout.global_offset.vec();
    nlohmann::ordered_json indices = nlohmann::ordered_json::array();
    for (int t = 0; t < p.spec.tensor_ndim(); ++t) indices.push_back(layout.indices(t));
    j["indices"] = std::move(indices);
    fmt::print("{}\n", j.dump());
  }
}

// Compact index list: "0-3,8-11".
std::string runs_text(const dtensor::IndexRuns& runs) {
  if (runs.empty()) return "-";
  std::string out;
  for (const auto& r : runs) {
    if (!out.empty()) out += ',';
    out += r.length == 1 ? fmt::format("{}", r.start)
                         : fmt::format("{}-{}", r.start, r.start + r.length - 1);
  }
  return out;
}

void demo_case(const char* mesh, const char* names, const char* shape, const char* placements,
               const char* note) {
  Problem p = make_problem({mesh, shape, placements, names});
  fmt::print("\nmesh {}  shape [{}]  placements [{}]\n  {}\n", dtensor::to_string(*p.mesh),
             fmt::join(p.spec.shape, ","), dtensor::to_string(p.spec.placements), note);
  fmt::print("  {:>4}  {:<9} {:<11} {:<13} {}\n", "rank", "coord", "local", "offset",
             "held indices per tensor dim");
  for (int rank : p.mesh->ranks()) {
    dtensor::ShardLayout l = *p.spec.layout(rank);
    std::vector<std::string> held;
    for (int t = 0; t < p.spec.tensor_ndim(); ++t) held.push_back(runs_text(l.runs[t]));
    fmt::print("  {:>4}  {:<9} {:<11} {:<13} {}\n", rank,
               fmt::format("({})", fmt::join(*p.mesh->coord_of(rank), ",")),
               fmt::format("[{}]", fmt::join(l.local_shape, ",")),
               fmt::format("[{}]", fmt::join(l.global_offset, ",")),
               fmt::format("{}", fmt::join(held, " x ")));
  }
  // Ownership grid for 2-D tensors: which rank holds each element (like visualize_sharding).
  if (p.spec.tensor_ndim() == 2 && p.spec.shape[0] <= 16 && p.spec.shape[1] <= 16) {
    std::vector<std::vector<std::string>> owner(p.spec.shape[0],
                                                std::vector<std::string>(p.spec.shape[1]));
    for (int rank : p.mesh->ranks()) {
      dtensor::ShardLayout l = *p.spec.layout(rank);
      for (int64_t i : l.indices(0))
        for (int64_t j : l.indices(1)) {
          auto& cell = owner[i][j];
          cell += cell.empty() ? fmt::format("{}", rank) : fmt::format("/{}", rank);
        }
    }
    fmt::print("  owners of each element:\n");
    for (const auto& row : owner) {
      fmt::print("   ");
      for (const auto& cell : row) fmt::print(" {:>5}", cell);
      fmt::print("\n");
    }
  }
}

void demo() {
  fmt::print("dtensor-check demo: which elements each rank holds, exactly as PyTorch DTensor.\n");
  demo_case("4", "", "9", "S(0)", "torch.chunk rule: 9 over 4 is 3,3,3,0 (not 3,2,2,2); the empty shard reports offset 9");
  demo_case("2x2", "dp,tp", "6,4", "S(0),S(1)", "two tensor dims sharded on two mesh dims");
  demo_case("4x2", "dp,tp", "13,2", "S(0),S(0)", "nested uneven sharding, left to right over mesh dims");
  demo_case("2x2", "dp,tp", "8,2", "_S(0,2),S(0)", "StridedShard: FSDP over TP, the tp coordinate picks the half");
  demo_case("3x2", "dp,tp", "7,2", "_S(0,2),S(0)", "uneven StridedShard with a first mesh dim of 3 (dtensor-semantics.md 2.3)");
  demo_case("[[0,2],[1,3]]", "dp,tp", "4,4", "R,S(1)", "an explicit rank array: groups follow coordinates, not rank order");
  demo_case("2x2", "", "4,4", "P,S(0)", "Partial holds the full local shape on every rank of its group");
  fmt::print("\nTry: build/tests/dtensor-check layout --mesh 4x2 --shape 13,2 --placements 'S(0),S(0)'\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtensor-check: contract checks of the DTensor runtime"};
  app.require_subcommand(1);
  LayoutArgs args;
  CLI::App* layout = app.add_subcommand("layout", "per-rank local shape, global offset and held indices");
  layout->add_option("--mesh", args.mesh, "mesh shape (4x2) or explicit rank array ([[0,2],[1,3]])")->required();
  layout->add_option("--shape", args.shape, "global tensor shape, comma-separated (13,2)")->required();
  layout->add_option("--placements", args.placements, "one placement per mesh dim: S(d), _S(d,sf), R, P, P(op)")->required();
  layout->add_option("--names", args.names, "mesh dim names, comma-separated (dp,tp)");
  app.add_subcommand("demo", "a tour of the layout rules on a few meshes");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return 0;
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "dtensor-check: {}\n", e.what());
    return 2;
  }
  try {
    if (layout->parsed()) print_layout(make_problem(args));
    else demo();
  } catch (const kernels::InvalidArgument& e) {
    fmt::print(stderr, "dtensor-check: {}\n", e.what());
    return 2;
  } catch (const kernels::Unsupported& e) {
    fmt::print(stderr, "dtensor-check: {}\n", e.what());
    return 2;
  }
  return 0;
}
