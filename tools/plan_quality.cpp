// plan-quality: how good the plans are, as Markdown tables.
//  - fsdp: every transition FSDP, HSDP, FSDP x TP and HSDP x TP use (unshard, reshard, gradient
//    reduce-scatter, replica all-reduce, reshard_after_forward=k), even and uneven, on 8 ranks:
//    the search plan's route, its collectives against the mesh dims the transition must cross,
//    the bytes its busiest rank receives against the lower bound (ratio), and greedy's.
//  - pairs: every placement pair of S(0), S(1), _S(0,2), R (and P sources) on a mesh where the
//    search planner moves strictly fewer bytes than PyTorch's greedy planner.
//  - fsdp at scale (--check, or --table fsdp-scale): the same families on 2^10, 2^12, 2^14 and
//    2^17 ranks (FSDP over all of them, HSDP 8 x W/8, FSDP x TP W/8 x 8, HSDP x TP 8 x W/64 x 8),
//    even (rows a multiple of the mesh: checked), uneven (3 more rows) and at 2^17 fewer rows
//    than ranks (half): the uneven rows checked against greedy's bytes only.
//  - scale (--scale, a benchmark, not a check): cold plan time, rank-0 schedule time, plan
//    memory and the cached look-up for 1-D meshes of 2^8 to 2^20 ranks, 2-D (dp x tp 8) and 3-D
//    (replicate x shard x tp 8) up to 2^17, medians over --repeats (bench/RESULTS.md).
//  - ragged: RaggedShard transitions (FSDP's flat buffers) on 8 ranks against the lower bound.
//   plan-quality [--table fsdp|fsdp-scale|ragged|pairs|all] [--size-mib 32] [--mesh 2x2 --shape 1024,768] [--dtype f32]
//   plan-quality --check     exit 1 unless every FSDP row on 8 ranks, and every even one at
//                            scale, plans one collective per crossed mesh dim and its even rows
//                            receive exactly the lower bound, no uneven row at scale moves
//                            more than greedy's route, and every RaggedShard row is one
//                            collective at the bound (uneven reduce-scatters: one collective)
//   plan-quality --scale [--repeats 15] [--json FILE]
// Limits of the pairs table: meshes of at most 3 dims (the sweep has 20^ndim pairs), shapes of
// at least 2 dims; --timeout-ms bounds the whole sweep (exit 3 naming how far it got).
// Exit status (program/main.h): 0 ok, 1 a broken promise (--check), 2 invalid input, 3 out of
// memory or time.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtensor/exec/executor.h"
#include "dtensor/plan/cache.h"
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

// The same families on a world of w ranks (a power of two >= 2^8).
std::vector<FsdpRow> fsdp_rows_at(int64_t w) {
  const std::string flat = std::to_string(w), hsdp = fmt::format("8x{}", w / 8), tp = fmt::format("{}x8", w / 8),
                    hsdp_tp = fmt::format("8x{}x8", w / 64);
  return {
      {"FSDP", "unshard", flat, "S(0)", "R"},
      {"FSDP", "reshard", flat, "R", "S(0)"},
      {"FSDP", "gradient reduce-scatter", flat, "P", "S(0)"},
      {"FSDP, reshard_after_forward=8", "after forward: to groups of 8", tp, "R,R", "R,S(0)"},
      {"FSDP, reshard_after_forward=8", "backward unshard (over 8)", tp, "R,S(0)", "R,R"},
      {"HSDP (8 replicas)", "unshard", hsdp, "R,S(0)", "R,R"},
      {"HSDP (8 replicas)", "reshard", hsdp, "R,R", "R,S(0)"},
      {"HSDP (8 replicas)", "gradient reduce-scatter + all-reduce", hsdp, "P,P", "R,S(0)"},
      {"HSDP (8 replicas)", "replica all-reduce", hsdp, "P,S(0)", "R,S(0)"},
      {"FSDP x TP (tp 8), colwise", "unshard", tp, "_S(0,8),S(0)", "R,S(0)"},
      {"FSDP x TP (tp 8), colwise", "reshard", tp, "R,S(0)", "_S(0,8),S(0)"},
      {"FSDP x TP (tp 8), colwise", "gradient reduce-scatter", tp, "P,S(0)", "_S(0,8),S(0)"},
      {"FSDP x TP (tp 8), rowwise", "unshard", tp, "S(0),S(1)", "R,S(1)"},
      {"FSDP x TP (tp 8), rowwise", "gradient reduce-scatter", tp, "P,S(1)", "S(0),S(1)"},
      {"HSDP x TP (8 replicas, tp 8)", "unshard", hsdp_tp, "R,_S(0,8),S(0)", "R,R,S(0)"},
      {"HSDP x TP (8 replicas, tp 8)", "reshard", hsdp_tp, "R,R,S(0)", "R,_S(0,8),S(0)"},
      {"HSDP x TP (8 replicas, tp 8)", "gradient reduce-scatter + all-reduce", hsdp_tp, "P,P,S(0)", "R,_S(0,8),S(0)"},
      {"HSDP x TP (8 replicas, tp 8)", "replica all-reduce", hsdp_tp, "P,_S(0,8),S(0)", "R,_S(0,8),S(0)"},
  };
}

// Prints a table of FSDP rows for an even shape (rows x cols) and an uneven one (3 more rows,
// so no mesh dim divides it); returns the number of rows that break the promise (one collective
// per crossed dim; the bound on even shapes). check_uneven: the uneven rows keep it too (on 8
// ranks they do; at scale an uneven _S(0,8) unshard is no single valid step, NOTE [step
// validity] in dtensor/plan/step.h, so those rows are checked only against greedy's bytes).
int fsdp_rows_table(const std::vector<FsdpRow>& table, int64_t rows, int64_t cols, kernels::DType dtype,
                    bool check_uneven = true, int64_t few_rows = 0) {
  int bad = 0;
  fmt::print("| family | transition | mesh | shape | src -> dst | search route | colls / dims crossed | "
             "busiest rank receives | lower bound | ratio | greedy colls | greedy ratio |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const FsdpRow& r : table)
    for (const Dims& shape : few_rows > 0 ? std::vector<Dims>{{rows, cols}, {rows + 3, cols}, {few_rows, cols}}
                                          : std::vector<Dims>{{rows, cols}, {rows + 3, cols}}) {
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
      if ((even || check_uneven) &&
          (q.collectives() != crossed || (!uneven_reduction && q.traffic.max_received() != bound)))
        ++bad;
      // Uneven rows at scale: no route of one collective per crossed dim reaches the bound there
      // (an uneven _S(0,8) unshard is no single valid step; an uneven reduce-scatter exchanges
      // directly, so the owner of the largest chunk receives k-1 copies of it): the search must
      // still never move more than PyTorch's greedy route.
      if (!even && !check_uneven && q.traffic.max_received() > g.traffic.max_received()) ++bad;
      fmt::print("| {} | {} | {} | {}x{} | [{}] -> [{}] | `{}` | {} / {} | {} | {} | {} | {} | {} |\n",
                 r.family, r.what, r.mesh, shape[0], shape[1], r.src, r.dst, to_string(q), q.collectives(), crossed,
                 q.traffic.max_received(), bound, qr, g.collectives(), gr);
    }
  fmt::print("\n");
  return bad;
}

// Prints the FSDP table for an even and an uneven shape of about size_mib on 8 ranks.
int fsdp_table(double size_mib, kernels::DType dtype) {
  const int64_t item = static_cast<int64_t>(kernels::itemsize(dtype));
  const int64_t cols = 2048;
  const int64_t rows = std::max<int64_t>(16, static_cast<int64_t>(size_mib * 1024 * 1024 / item / cols) / 16 * 16);
  fmt::print("FSDP / HSDP / FSDP x TP / HSDP x TP transitions on 8 ranks, {} ({:.1f} MiB even; the uneven "
             "shape has 3 more rows, so no mesh dim divides it)\n\n",
             kernels::to_string(dtype), static_cast<double>(rows * cols * item) / (1 << 20));
  return fsdp_rows_table(fsdp_rows(), rows, cols, dtype);
}

// The same families on 2^10 to 2^17 ranks: rows 16 per rank (even), cols 1024.
int fsdp_scale_table(kernels::DType dtype) {
  int bad = 0;
  for (int64_t w : {int64_t{1} << 10, int64_t{1} << 12, int64_t{1} << 14, int64_t{1} << 17}) {
    // At 2^17 also fewer rows than ranks (half): every mesh dim splits unevenly, half its chunks empty.
    const int64_t few = w == (int64_t{1} << 17) ? w / 2 : 0;
    fmt::print("FSDP / HSDP / FSDP x TP / HSDP x TP transitions on {} ranks, {} [{} (+3{}), 1024]\n\n", w,
               kernels::to_string(dtype), 16 * w, few > 0 ? fmt::format("; {}", few) : "");
    bad += fsdp_rows_table(fsdp_rows_at(w), 16 * w, 1024, dtype, /*check_uneven=*/false, few);
  }
  return bad;
}

// RaggedShard transitions (NOTE [ragged plans] in dtensor/plan/transition.h) on 8 ranks: FSDP's
// flat-buffer moves (unshard, reshard, gradient reduce-scatter, a rebalance, to and from S(0)),
// with units balanced by made-up parameter sizes (zeros included), align 4, on a 1-D mesh and
// on dp x tp 4x2, and HSDP's on dp_replicate x dp_shard 2x4 (the gradient reduce: a
// reduce-scatter then an all-reduce, like the padded layout's [P,P] -> [R,S(0)], its row for
// comparison). Every row plans one collective per changed mesh dim at most; the exchanges and
// the reductions onto equal ranges receive exactly the lower bound (an uneven reduce-scatter
// cannot: the owner of the largest range receives k-1 copies of it). Returns the rows that break
// this.
int ragged_table(kernels::DType dtype) {
  struct Row {
    std::string what, mesh, src, dst;
  };
  const std::string u8 = "Rg(0,[3,1,4,1,5,9,2,6],4)", v8 = "Rg(0,[2,7,1,8,0,8,1,8],1)", e8 = "Rg(0,[1,1,1,1,1,1,1,1],4)";
  const std::string u4 = "Rg(0,[3,0,4,1],4)", e4 = "Rg(0,[1,1,1,1],4)";
  const std::vector<Row> rows = {
      {"unshard (all-gather of exact ranges)", "8", u8, "R"},
      {"reshard (local chunk)", "8", "R", u8},
      {"gradient reduce-scatter, uneven ranges", "8", "P", u8},
      {"gradient reduce-scatter, equal ranges", "8", "P", e8},
      {"rebalance (other units and align)", "8", u8, v8},
      {"from the padded layout", "8", "S(0)", u8},
      {"to the padded layout", "8", u8, "S(0)"},
      {"dp x tp: unshard over dp", "4x2", u4 + ",R", "R,R"},
      {"dp x tp: reshard over dp", "4x2", "R,R", u4 + ",R"},
      {"dp x tp: rebalance", "4x2", u4 + ",R", "Rg(0,[1,1,1,1],1),R"},
      {"hsdp: gradient reduce, equal ranges", "2x4", "P,P", "R," + e4},
      {"hsdp: gradient reduce, uneven ranges", "2x4", "P,P", "R," + u4},
      {"hsdp: padded layout's gradient reduce", "2x4", "P,P", "R,S(0)"},
      {"hsdp: unshard over dp_shard", "2x4", "R," + u4, "R,R"},
      {"hsdp: accumulate, no all-reduce", "2x4", "P,P", "P," + e4},
      {"hsdp: all-reduce the accumulated shard", "2x4", "P," + u4, "R," + u4},
  };
  int bad = 0;
  const Dims shape{1027, 768};
  fmt::print("RaggedShard transitions, {} [{},{}] (flattened: {} elements)\n\n", kernels::to_string(dtype), shape[0],
             shape[1], shape[0] * shape[1]);
  fmt::print("| transition | mesh | src -> dst | route | colls | busiest rank receives | lower bound | ratio |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(r.mesh));
    const DTensorSpec spec = make_spec(mesh, parse_placements(r.src), shape, dtype);
    const Placements dst = parse_placements(r.dst);
    const Plan q = plan_redistribute(spec, dst, PlannerKind::kSearch);
    const int64_t bound = lower_bound_traffic(spec, dst).max_received();
    const bool even = r.dst == e8 || r.dst.ends_with(e4);
    const bool uneven_reduction = r.src.front() == 'P' && r.src.find("Rg") == std::string::npos && !even;
    int changed = 0;  // one collective per mesh dim that changes (HSDP: reduce-scatter + all-reduce)
    for (size_t m = 0; m < dst.size(); ++m) changed += spec.placements[m] != dst[m] ? 1 : 0;
    if (q.collectives() > changed || (!uneven_reduction && q.traffic.max_received() != bound)) ++bad;
    fmt::print("| {} | {} | [{}] -> [{}] | `{}` | {} | {} | {} | {} |\n", r.what, r.mesh, r.src, r.dst, to_string(q),
               q.collectives(), q.traffic.max_received(), bound, ratio(q.traffic.max_received(), bound, 4));
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

// ---- --scale: the planner's cost at scale (a benchmark; bench/RESULTS.md) ----

struct ScaleRow {
  std::string mesh, what, src, dst;
};

std::vector<ScaleRow> scale_rows() {
  std::vector<ScaleRow> rows;
  for (int e : {8, 10, 11, 12, 14, 16, 17, 18, 20}) {
    const std::string m = std::to_string(int64_t{1} << e);
    rows.push_back({m, "FSDP unshard", "S(0)", "R"});
    rows.push_back({m, "FSDP reshard", "R", "S(0)"});
    rows.push_back({m, "FSDP gradient reduce-scatter", "P", "S(0)"});
    rows.push_back({m, "all-to-all", "S(0)", "S(1)"});
  }
  for (int64_t dp : {16, 128, 256, 512, 2048, 16384}) {
    const std::string m = fmt::format("{}x8", dp);
    rows.push_back({m, "FSDP x TP unshard", "_S(0,8),S(0)", "R,S(0)"});
    rows.push_back({m, "FSDP x TP reshard", "R,S(0)", "_S(0,8),S(0)"});
    rows.push_back({m, "FSDP x TP gradient reduce-scatter", "P,S(0)", "_S(0,8),S(0)"});
    rows.push_back({m, "all-to-all", "S(0),R", "S(1),R"});
  }
  for (const char* m : {"2x16x8", "32x64x8", "8x256x8", "8x2048x8"}) {
    rows.push_back({m, "HSDP x TP unshard", "R,_S(0,8),S(0)", "R,R,S(0)"});
    rows.push_back({m, "HSDP x TP reshard", "R,R,S(0)", "R,_S(0,8),S(0)"});
    rows.push_back({m, "HSDP x TP gradient reduce-scatter + all-reduce", "P,P,S(0)", "R,_S(0,8),S(0)"});
  }
  return rows;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Bytes a plan holds (its vectors included): independent of the mesh size.
int64_t plan_bytes(const Plan& p) {
  int64_t n = sizeof(Plan) + static_cast<int64_t>(p.steps.size() * sizeof(Step) + p.communicating.size() +
                                                 p.step_traffic.size() * sizeof(Traffic) + p.shapes.size() * sizeof(Dims));
  for (const Placements* ps : {&p.src, &p.dst}) n += static_cast<int64_t>(ps->size() * sizeof(Placement));
  for (const Placements& ps : p.states) n += static_cast<int64_t>(sizeof(Placements) + ps.size() * sizeof(Placement));
  return n;
}

void scale_table(int repeats, const std::string& json_path) {
  using Clock = std::chrono::steady_clock;
  auto us_since = [](Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); };
  std::ofstream json_file;
  if (!json_path.empty()) {  // opened first: a bad path fails before the benchmark runs
    json_file.open(json_path);
    if (!json_file) throw kernels::InvalidArgument(fmt::format("--json '{}': cannot open for writing", kernels::clip(json_path)));
  }
  fmt::print("Planning at scale, bf16 [65536, 4096], search planner; medians over {} repeats\n\n", repeats);
  fmt::print("| mesh | ranks | transition | plan | colls | bytes / lower bound | cold plan us | rank-0 schedule us | "
             "schedule bytes | plan bytes | cached look-up ns |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|\n");
  nlohmann::json out = nlohmann::json::array();
  for (const ScaleRow& r : scale_rows()) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(r.mesh));
    const DTensorSpec spec = make_spec(mesh, parse_placements(r.src), {65536, 4096}, kernels::DType::kBF16);
    const Transition t = make_transition(spec, parse_placements(r.dst));
    std::vector<double> plan_us, schedule_us, lookup_ns;
    Plan plan;
    ScheduleCost schedule;
    for (int i = 0; i < repeats; ++i) {
      const auto start = Clock::now();
      plan = plan_transition(t);
      plan_us.push_back(us_since(start));
      schedule = measure_schedule(plan, spec, Dims::filled(mesh->ndim(), 0));
      schedule_us.push_back(schedule.us);
    }
    PlanCache cache;
    (void)cache.find(t);
    const Placements dst = parse_placements(r.dst);
    for (int i = 0; i < repeats; ++i) {
      constexpr int kLookups = 2000;
      const auto start = Clock::now();
      for (int j = 0; j < kLookups; ++j) {
        const Transition again = make_transition(spec, dst);  // the DTensor::redistribute path
        if (cache.find(again).plan == nullptr) throw kernels::InternalError("cached plan missing");
      }
      lookup_ns.push_back(us_since(start) * 1e3 / kLookups);
    }
    const int64_t bound = lower_bound_traffic(spec, plan.dst).max_received();
    fmt::print("| {} | {} | {} [{}] -> [{}] | `{}` | {} | {} / {} | {:.1f} | {:.1f} | {} | {} | {:.0f} |\n", r.mesh,
               mesh->size(), r.what, r.src, r.dst, to_string(plan), plan.collectives(), plan.traffic.max_received(),
               bound, median(plan_us), median(schedule_us), schedule.bytes, plan_bytes(plan), median(lookup_ns));
    std::fflush(stdout);
    out.push_back({{"mesh", r.mesh}, {"ranks", mesh->size()}, {"what", r.what}, {"src", r.src}, {"dst", r.dst},
                   {"plan", to_string(plan)}, {"collectives", plan.collectives()},
                   {"bytes_per_rank", plan.traffic.max_received()}, {"lower_bound_bytes", bound},
                   {"plan_us", median(plan_us)}, {"schedule_us", median(schedule_us)},
                   {"schedule_bytes", schedule.bytes}, {"plan_bytes", plan_bytes(plan)},
                   {"lookup_ns", median(lookup_ns)}});
  }
  if (json_file.is_open()) json_file << out.dump(1) << "\n";
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
    app.add_option("--table", table, "fsdp, fsdp-scale, ragged, pairs or all")
        ->check(CLI::IsMember({"fsdp", "fsdp-scale", "ragged", "pairs", "all"}))
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
    bool scale = false;
    int repeats = 15;
    std::string json_path;
    app.add_flag("--scale", scale, "benchmark: planning cost on meshes of 2^8 to 2^20 ranks");
    app.add_option("--repeats", repeats, "--scale: repeats per row (medians)")->check(CLI::Range(1, 1000));
    app.add_option("--json", json_path, "--scale: also write the rows as JSON");
    program::add_timeout(app, timeout_ms, "wall-clock limit of the pairs sweep (exit 3 beyond it)");
    program::parse(app, argc, argv);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    const kernels::DType dtype = kernels::parse_dtype(dtype_text);
    const bool pairs = table != "fsdp" && table != "ragged" && !check;
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
    if (scale) {
      scale_table(repeats, json_path);
      return program::kOk;
    }
    int bad = 0;
    if ((table != "pairs" && table != "fsdp-scale" && table != "ragged") || check) bad = fsdp_table(size_mib, dtype);
    if (table == "ragged" || table == "all" || check) bad += ragged_table(dtype);
    if (table == "fsdp-scale" || table == "all" || check) bad += fsdp_scale_table(dtype);
    if (pairs) pairs_table(mesh_text, shape_text, dtype, static_cast<size_t>(limit), timeout_ms, deadline);
    if (check && bad > 0) {
      fmt::print(stderr, "plan-quality: {} FSDP or RaggedShard rows break their promise\n", bad);
      return program::kMismatch;
    }
    return program::kOk;
  });
}
