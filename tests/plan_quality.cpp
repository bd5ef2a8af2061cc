// plan-quality: how good the plans are, as Markdown tables.
//  - fsdp: every transition FSDP, HSDP, FSDP x TP and HSDP x TP use (unshard, reshard, gradient
//    reduce-scatter, replica all-reduce, reshard_after_forward=k), even and uneven, on 8 ranks:
//    the search plan's route, its collectives against the mesh dims the transition must cross,
//    the bytes its busiest rank receives against the lower bound (ratio), and greedy's.
//  - pairs: every placement pair of S(0), S(1), _S(0,2), R (and P sources) on a mesh where the
//    search planner moves strictly fewer bytes than PyTorch's greedy planner.
//   plan-quality [--table fsdp|pairs|all] [--size-mib 32] [--mesh 2x2 --shape 1024,768] [--dtype f32]
//   plan-quality --check     exit 1 unless every FSDP row plans one collective per crossed mesh
//                            dim and its even rows receive exactly the lower bound
// Limits of the pairs table: meshes of at most 3 dims (the sweep has 20^ndim pairs), shapes of
// at least 2 dims; --timeout-ms bounds the whole sweep (exit 3 naming how far it got).
// Exit status (program/main.h): 0 ok, 1 a broken promise (--check), 2 invalid input, 3 out of
// memory or time.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>

#include "dtensor/plan/planner.h"
#include "kernels/error.h"
#include "program/cli.h"
#include "program/main.h"

using namespace dtensor;

namespace {

constexpr int kMaxMeshDims = 3;

Dims parse_shape(const std::string& text) { return kernels::parse_shape(text, "--shape"); }

// Mesh dims whose placement must change with communication: not a size-1 dim, not equal, and
// not a purely local change (R -> S/_S/P, S(d) -> P(sum)).
int dims_to_cross(const DeviceMesh& mesh, const Placements& src, const Placements& dst) {
  int n = 0;
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (mesh.size(m) == 1 || src[m] == dst[m] || is_replicate(src[m])) continue;
    if (is_shard(src[m]) && dst[m] == Placement{Partial{ReduceOp::kSum}}) continue;
    ++n;
  }
  return n;
}

struct FsdpRow {
  std::string family, what, mesh, src, dst;
};

// The transitions, on 8 ranks. Column-parallel TP shards dim 0 (FSDP's _S(0,tp) on dp), row-
// parallel TP dim 1 (FSDP's plain S(0) on dp).
std::vector<FsdpRow> fsdp_rows() {
  return {
      {"FSDP", "unshard", "8", "S(0)", "R"},
      {"FSDP", "reshard", "8", "R", "S(0)"},
      {"FSDP", "gradient reduce-scatter", "8", "P", "S(0)"},
      {"FSDP, reshard_after_forward=4", "after forward: to groups of 4", "2x4", "R,R", "R,S(0)"},
      {"FSDP, reshard_after_forward=4", "backward unshard (over 4)", "2x4", "R,S(0)", "R,R"},
      {"HSDP (2 replicas x 4)", "unshard", "2x4", "R,S(0)", "R,R"},
      {"HSDP (2 replicas x 4)", "reshard", "2x4", "R,R", "R,S(0)"},
      {"HSDP (2 replicas x 4)", "gradient reduce-scatter + all-reduce", "2x4", "P,P", "R,S(0)"},
      {"HSDP (2 replicas x 4)", "replica all-reduce", "2x4", "P,S(0)", "R,S(0)"},
      {"FSDP x TP (dp 2, tp 4), colwise", "unshard", "2x4", "_S(0,4),S(0)", "R,S(0)"},
      {"FSDP x TP (dp 2, tp 4), colwise", "reshard", "2x4", "R,S(0)", "_S(0,4),S(0)"},
      {"FSDP x TP (dp 2, tp 4), colwise", "gradient reduce-scatter", "2x4", "P,S(0)", "_S(0,4),S(0)"},
      {"FSDP x TP (dp 2, tp 4), rowwise", "unshard", "2x4", "S(0),S(1)", "R,S(1)"},
      {"FSDP x TP (dp 2, tp 4), rowwise", "gradient reduce-scatter", "2x4", "P,S(1)", "S(0),S(1)"},
      {"FSDP x TP (dp 4, tp 2), colwise", "unshard", "4x2", "_S(0,2),S(0)", "R,S(0)"},
      {"FSDP x TP (dp 4, tp 2), colwise", "reshard", "4x2", "R,S(0)", "_S(0,2),S(0)"},
      {"FSDP x TP (dp 4, tp 2), colwise", "gradient reduce-scatter", "4x2", "P,S(0)", "_S(0,2),S(0)"},
      {"HSDP x TP (2 x dp 2 x tp 2)", "unshard", "2x2x2", "R,_S(0,2),S(0)", "R,R,S(0)"},
      {"HSDP x TP (2 x dp 2 x tp 2)", "reshard", "2x2x2", "R,R,S(0)", "R,_S(0,2),S(0)"},
      {"HSDP x TP (2 x dp 2 x tp 2)", "gradient reduce-scatter + all-reduce", "2x2x2", "P,P,S(0)",
       "R,_S(0,2),S(0)"},
      {"HSDP x TP (2 x dp 2 x tp 2)", "replica all-reduce", "2x2x2", "P,_S(0,2),S(0)", "R,_S(0,2),S(0)"},
  };
}

// got / bound; a transition that needs nothing and moves nothing has ratio 1.
std::string ratio(int64_t got, int64_t bound, int digits) {
  if (bound == 0) return got == 0 ? fmt::format("{:.{}f}", 1.0, digits) : "inf";
  return fmt::format("{:.{}f}", static_cast<double>(got) / static_cast<double>(bound), digits);
}

// Prints the FSDP table for an even and an uneven shape of about size_mib; returns the number
// of rows that break the promise (one collective per crossed dim; the bound on even shapes).
int fsdp_table(double size_mib, kernels::DType dtype) {
  const int64_t item = static_cast<int64_t>(kernels::itemsize(dtype));
  const int64_t cols = 2048;
  const int64_t rows = std::max<int64_t>(16, static_cast<int64_t>(size_mib * 1024 * 1024 / item / cols) / 16 * 16);
  int bad = 0;
  fmt::print("FSDP / HSDP / FSDP x TP / HSDP x TP transitions on 8 ranks, {} ({:.1f} MiB even; the uneven "
             "shape has 3 more rows, so no mesh dim divides it)\n\n",
             kernels::to_string(dtype), static_cast<double>(rows * cols * item) / (1 << 20));
  fmt::print("| family | transition | mesh | shape | src -> dst | search route | colls / dims crossed | "
             "busiest rank receives | lower bound | ratio | greedy colls | greedy ratio |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const FsdpRow& r : fsdp_rows())
    for (const Dims& shape : {Dims{rows, cols}, Dims{rows + 3, cols}}) {
      auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(r.mesh));
      const DTensorSpec spec = make_spec(mesh, parse_placements(r.src), shape, dtype);
      const Placements dst = parse_placements(r.dst);
      const Plan q = plan_redistribute(spec, dst, PlannerKind::kSearch);
      const Plan g = plan_redistribute(spec, dst, PlannerKind::kGreedy);
      const int64_t bound = lower_bound_traffic(spec, dst).max_received();
      const int crossed = dims_to_cross(*mesh, spec.placements, dst);
      const bool even = shape[0] == rows;
      const std::string qr = ratio(q.traffic.max_received(), bound, 4), gr = ratio(g.traffic.max_received(), bound, 2);
      // Uneven reductions cannot reach the mesh-wide bound (the owner of the largest chunk
      // receives k-1 copies of it); the other uneven rows must.
      const bool uneven_reduction = !even && r.src.find('P') != std::string::npos;
      if (q.collectives() != crossed || (!uneven_reduction && q.traffic.max_received() != bound)) ++bad;
      fmt::print("| {} | {} | {} | {}x{} | [{}] -> [{}] | `{}` | {} / {} | {} | {} | {} | {} | {} |\n",
                 r.family, r.what, r.mesh, shape[0], shape[1], r.src, r.dst, to_string(q), q.collectives(), crossed,
                 q.traffic.max_received(), bound, qr, g.collectives(), gr);
    }
  fmt::print("\n");
  return bad;
}

void pairs_table(const std::string& mesh_text, const std::string& shape_text, kernels::DType dtype, size_t limit,
                 int64_t timeout_ms, std::chrono::steady_clock::time_point deadline) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(mesh_text));
  const Dims shape = parse_shape(shape_text);
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
             mesh_text, shape_text, kernels::to_string(dtype), pairs, rows.size(), equal);
  fmt::print("| src | dst | greedy bytes (colls) | search bytes (colls) | search / greedy | search route |\n");
  fmt::print("|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < rows.size() && i < limit; ++i) {
    const Row& r = rows[i];
    fmt::print("| {} | {} | {} ({}) | {} ({}) | {:.2f} | `{}` |\n", r.src, r.dst, r.gb, r.gc, r.sb, r.sc,
               static_cast<double>(r.sb) / static_cast<double>(r.gb), r.search);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("plan-quality", [&] {
    CLI::App app{"plan-quality: plans against the lower bound and against PyTorch's greedy planner"};
    std::string table = "all", mesh_text = "2x2", shape_text = "1024,768", dtype_text = "f32";
    double size_mib = 32;
    int64_t limit = 40;
    int64_t timeout_ms = 600'000;
    bool check = false;
    app.add_option("--table", table, "fsdp, pairs or all")->check(CLI::IsMember({"fsdp", "pairs", "all"}))
        ->capture_default_str();
    app.add_option("--size-mib", size_mib, "FSDP table: tensor size (even shape)")
        ->check(CLI::Range(1e-3, 1e6))
        ->capture_default_str();
    app.add_option("--mesh", mesh_text, "pairs table: mesh shape, at most 3 dims")->capture_default_str();
    app.add_option("--shape", shape_text, "pairs table: global shape, at least 2 dims")->capture_default_str();
    app.add_option("--dtype", dtype_text)->capture_default_str();
    app.add_option("--limit", limit, "pairs table: rows to print (largest savings first)")
        ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}))
        ->capture_default_str();
    app.add_flag("--check", check, "exit 1 unless every FSDP row keeps its promise");
    program::add_timeout(app, timeout_ms, "wall-clock limit of the pairs sweep (exit 3 beyond it)");
    program::parse(app, argc, argv);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    const kernels::DType dtype = kernels::parse_dtype(dtype_text);
    const bool pairs = table != "fsdp" && !check;
    if (pairs) {  // the pairs table's input is checked before the FSDP table prints
      const DeviceMesh mesh = DeviceMesh::parse(mesh_text);
      if (mesh.ndim() > kMaxMeshDims)
        throw kernels::InvalidArgument(fmt::format("--mesh '{}' has {} dims: the sweep covers meshes of at most {} "
                                                   "(it plans 20^ndim placement pairs)",
                                                   kernels::clip(mesh_text), mesh.ndim(), kMaxMeshDims));
      const Dims shape = parse_shape(shape_text);
      if (shape.size() < 2)
        throw kernels::InvalidArgument(fmt::format("--shape '{}' has {} dims: the sweep shards tensor dims 0 and 1",
                                                   kernels::clip(shape_text), shape.size()));
    }
    int bad = 0;
    if (table != "pairs" || check) bad = fsdp_table(size_mib, dtype);
    if (pairs) pairs_table(mesh_text, shape_text, dtype, static_cast<size_t>(limit), timeout_ms, deadline);
    if (check && bad > 0) {
      fmt::print(stderr, "plan-quality: {} FSDP rows break their promise\n", bad);
      return program::kMismatch;
    }
    return program::kOk;
  });
}
