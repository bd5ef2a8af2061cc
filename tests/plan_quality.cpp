// plan-quality: compares the greedy (PyTorch) and search planners over every placement pair of
// S(0), S(1), _S(0,2), R (and P sources) on a mesh, and prints the pairs where search moves
// strictly fewer bytes (busiest rank's received bytes), as a Markdown table.
//   plan-quality --mesh 2x2 --shape 1024,768 [--dtype f32] [--limit 40]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>

#include "dtensor/plan/planner.h"
#include "kernels/error.h"

using namespace dtensor;

int main(int argc, char** argv) {
  CLI::App app{"plan-quality: greedy vs search plans"};
  std::string mesh_text = "2x2", shape_text = "1024,768", dtype_text = "f32";
  size_t limit = 40;
  app.add_option("--mesh", mesh_text);
  app.add_option("--shape", shape_text);
  app.add_option("--dtype", dtype_text);
  app.add_option("--limit", limit, "rows to print (largest savings first)");
  CLI11_PARSE(app, argc, argv);
  try {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(mesh_text));
    Dims shape;
    size_t begin = 0;
    while (begin <= shape_text.size()) {
      size_t end = shape_text.find(',', begin);
      if (end == std::string::npos) end = shape_text.size();
      shape.push_back(std::stoll(shape_text.substr(begin, end - begin)));
      begin = end + 1;
    }
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
    for (const Placements& src : srcs)
      for (const Placements& dst : dsts) {
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
    for (size_t i = 0; i < rows.size() && i < limit; ++i) {
      const Row& r = rows[i];
      fmt::print("| {} | {} | {} ({}) | {} ({}) | {:.2f} | `{}` |\n", r.src, r.dst, r.gb, r.gc, r.sb, r.sc,
                 static_cast<double>(r.sb) / static_cast<double>(r.gb), r.search);
    }
  } catch (const kernels::Error& e) {
    fmt::print(stderr, "plan-quality: {}\n", e.what());
    return 2;
  }
  return 0;
}
