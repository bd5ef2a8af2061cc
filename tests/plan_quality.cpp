// plan-quality: compares the greedy (PyTorch) and search planners over every placement pair of
// S(0), S(1), _S(0,2), R (and P sources) on a mesh, and prints the pairs where search moves
// strictly fewer bytes (busiest rank's received bytes), as a Markdown table.
//   plan-quality --mesh 2x2 --shape 1024,768 [--dtype f32] [--limit 40] [--timeout-ms 600000]
// Limits: meshes of at most 3 dims (the sweep has 20^ndim pairs), shapes of at least 2 dims;
// --timeout-ms bounds the whole sweep (exit 3 naming how far it got).
// Exit status (program/main.h): 0 ok, 2 invalid input, 3 out of memory or time.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <charconv>

#include "dtensor/plan/planner.h"
#include "kernels/error.h"
#include "program/cli.h"
#include "program/main.h"

using namespace dtensor;

namespace {

constexpr int kMaxMeshDims = 3;

Dims parse_shape(const std::string& text) {
  Dims shape;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view part(text.data() + begin, end - begin);
    int64_t v = -1;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (part.empty() || ec != std::errc() || p != part.data() + part.size() || v < 0)
      throw kernels::InvalidArgument(fmt::format("--shape '{}' is malformed at '{}': expected sizes in 0..{} like 1024,768",
                                                 kernels::clip(text), kernels::clip(part, 40), kernels::kInt64Max));
    if (shape.size() == kernels::kMaxDims)
      throw kernels::InvalidArgument(fmt::format("--shape '{}' has more than {} dims", kernels::clip(text), kernels::kMaxDims));
    shape.push_back(v);
    begin = end + 1;
  }
  return shape;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("plan-quality", [&] {
    CLI::App app{"plan-quality: greedy vs search plans"};
    std::string mesh_text = "2x2", shape_text = "1024,768", dtype_text = "f32";
    int64_t limit = 40;
    int64_t timeout_ms = 600'000;
    app.add_option("--mesh", mesh_text, "mesh shape, at most 3 dims (2x2)")->capture_default_str();
    app.add_option("--shape", shape_text, "global shape, at least 2 dims (1024,768)")->capture_default_str();
    app.add_option("--dtype", dtype_text)->capture_default_str();
    app.add_option("--limit", limit, "rows to print (largest savings first)")
        ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}))
        ->capture_default_str();
    program::add_timeout(app, timeout_ms, "wall-clock limit of the whole sweep (exit 3 beyond it)");
    program::parse(app, argc, argv);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);

    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(mesh_text));
    if (mesh->ndim() > kMaxMeshDims)
      throw kernels::InvalidArgument(fmt::format("--mesh '{}' has {} dims: the sweep covers meshes of at most {} "
                                                 "(it plans 20^ndim placement pairs)",
                                                 kernels::clip(mesh_text), mesh->ndim(), kMaxMeshDims));
    const Dims shape = parse_shape(shape_text);
    if (shape.size() < 2)
      throw kernels::InvalidArgument(fmt::format("--shape '{}' has {} dims: the sweep shards tensor dims 0 and 1",
                                                 kernels::clip(shape_text), shape.size()));
    const kernels::DType dtype = kernels::parse_dtype(dtype_text);
    const std::vector<Placement> sources = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}, Partial{}};
    const std::vector<Placement> targets = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}};
    std::vector<Placements> srcs = {{}}, dsts = {{}};
    for (int m = 0; m < mesh->ndim(); ++m) {
      std::vector<Placements> a, b;
      for (const auto& l : srcs)
        for (const auto& o : sources) { a.push_back(l); a.back().push_back(o); }
      for (const auto& l : dsts)
        for (const auto& o : targets) { b.push_back(l); b.back().push_back(o); }
      srcs = std::move(a);
      dsts = std::move(b);
    }
    struct Row { std::string src, dst, greedy, search; int64_t gb, sb; int gc, sc; };
    std::vector<Row> rows;
    int64_t pairs = 0, equal = 0;
    const int64_t total = static_cast<int64_t>(srcs.size() * dsts.size());
    for (const Placements& src : srcs)
      for (const Placements& dst : dsts) {
        if (std::chrono::steady_clock::now() > deadline)
          throw kernels::ResourceError(fmt::format("the sweep ran past --timeout-ms {} after {} of {} pairs",
                                                   timeout_ms, pairs, total));
        DTensorSpec s = make_spec(mesh, src, shape, dtype);
        Plan g = plan_redistribute(s, dst, PlannerKind::kGreedy);
        Plan q = plan_redistribute(s, dst, PlannerKind::kSearch);
        ++pairs;
        if (q.traffic.max_received() < g.traffic.max_received())
          rows.push_back({to_string(src), to_string(dst), to_string(g), to_string(q),
                          g.traffic.max_received(), q.traffic.max_received(), g.collectives(), q.collectives()});
        else
          ++equal;
      }
    std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
      return static_cast<double>(a.sb) / std::max<int64_t>(a.gb, 1) < static_cast<double>(b.sb) / std::max<int64_t>(b.gb, 1);
    });
    fmt::print("mesh {} shape [{}] dtype {}: {} pairs, search moves fewer bytes on {}, the same on {}\n\n",
               mesh_text, shape_text, dtype_text, pairs, rows.size(), equal);
    fmt::print("| src | dst | greedy bytes (colls) | search bytes (colls) | search / greedy | search route |\n");
    fmt::print("|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < rows.size() && i < static_cast<size_t>(limit); ++i) {
      const Row& r = rows[i];
      fmt::print("| {} | {} | {} ({}) | {} ({}) | {:.2f} | `{}` |\n", r.src, r.dst, r.gb, r.gc, r.sb, r.sc,
                 static_cast<double>(r.sb) / static_cast<double>(r.gb), r.search);
    }
    return program::kOk;
  });
}
