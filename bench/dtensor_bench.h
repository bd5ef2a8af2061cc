// dtensor-bench's types, shared by its measurement (dtensor_bench.cpp) and its report
// (dtensor_bench_report.cpp: the text tables on stdout and the --json file). Internal to the
// program.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "dtensor/placement.h"
#include "dtensor/plan/planner.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace dtensor_bench {

using bench::Stats;
using dtensor::Placements;
using kernels::Dims;
using kernels::DType;

// What the command line asks for (main in dtensor_bench.cpp fills it in).
struct Options {
  std::string backend = "local";
  int world = 8;
  bool world_given = false;
  std::string mesh_text;  // empty: per suite entry, derived from the world size
  std::string from, to;   // one transition instead of a suite
  std::string suite = "default";
  std::string sizes = "1K:256M";
  std::string dtype_name = "f32";
  std::string planner_name = "search";
  int iters = 20;
  int warmup = 3;
  bool check = true;
  bool host_cost = false;
  bool moe_dispatch = false;  // --moe-dispatch (dtensor_bench_moe.cpp)
  int64_t moe_width = 512;
  int host_calls = 2000;
  bool overlap = false;
  std::string overlap_min_text = "4M";
  double target = 1.10;
  std::string target_min_text = "1M";
  int64_t timeout_ms = 300'000;
  std::string bootstrap = "auto";
  std::string json_path;
  std::string trace_path;  // --trace: a Chrome trace of the run; empty: none

  DType dtype = DType::kF32;
  dtensor::PlannerKind planner = dtensor::PlannerKind::kSearch;
  std::vector<int64_t> size_list;
  int64_t target_min = int64_t{1} << 20;
  int64_t overlap_min = int64_t{4} << 20;
  std::string command_line;
};

// A placement transition on a mesh.
struct Case {
  Dims mesh_shape;
  Placements src, dst;
  std::string src_text, dst_text;
  std::string name() const { return src_text + "->" + dst_text; }
};

inline std::string mesh_text(const Dims& shape) { return fmt::format("{}", fmt::join(shape, "x")); }

// The raw collectives of a plan: the canonical collective of each communicating step.
enum class RawKind { kAllGather, kAllToAll, kReduceScatter, kAllReduce };
std::string_view raw_name(RawKind k);  // "all_gather", ...

struct RawOp {
  RawKind kind;
  int mesh_dim;
  int64_t group = 1;
  int64_t in = 0, out = 0;  // elements per rank
};

// One transition at one size (the sweep).
struct Row {
  std::string transition, src, dst, mesh, route, raw_text;
  Dims mesh_shape, shape;
  bool single_mesh_dim = false;
  int64_t bytes = 0, local_bytes = 0;
  int collectives = 0;
  int iters = 0, warmup = 0;
  Stats time, raw;
  bool has_raw = false;
  double overhead = 0, algbw = 0, busbw = 0;
  int64_t bytes_per_rank = 0, lower_bound = 0;
  std::vector<RawOp> raw_ops;
  int64_t wrong = -1;  // ranks whose shard did not match; -1: not checked
};

// True when the transition changes the placement of exactly one mesh dim.
inline bool single_mesh_dim(const Case& c) {
  int changed = 0;
  for (size_t m = 0; m < c.src.size(); ++m) changed += !(c.src[m] == c.dst[m]);
  return changed == 1;
}

// One world size of --host-cost (dtensor_bench.cpp: run_host_cost).
struct HostRow {
  std::string transition, mesh;
  int world = 1;
  Dims shape;
  int64_t bytes = 0;
  int calls = 0, repeats = 0;
  Stats per_call;  // microseconds per redistribute (max over ranks per repeat)
  Stats raw;       // microseconds per raw all_gather
  double framework_us = 0;  // per_call.median_us - raw.median_us
};

// One transition at one size of --overlap (dtensor_bench.cpp: run_overlap_one).
struct OverlapRow {
  std::string transition, src, dst, mesh, route;
  Dims mesh_shape, shape;
  int64_t bytes = 0, local_bytes = 0;
  int collectives = 0, iters = 0;
  Stats comm, compute, overlapped;
  Stats issue;  // redistribute_async's return in the overlapped runs: the caller's own share of the overlap
  double comm_warm_us = 0;  // the transition back to back (no idle spell before it)
  double exposed = 0;
  int64_t wrong = -1;
};

// The text report on stdout: a header, per case a section and its rows, a footer with the
// summary against the targets; host-cost and overlap variants of each.
class Printer {
 public:
  Printer(const Options& opt, std::string desc, int world) : opt_(opt), desc_(std::move(desc)), world_(world) {}
  void header() const;
  void section(const Case& c);
  void row(const Row& r);
  // Targets: overhead <= target for single-mesh-dim transitions with >= target_min per rank.
  void footer(const std::vector<Row>& rows) const;
  void host_header() const;
  void host_row(const HostRow& r) const;
  void host_footer(const std::vector<HostRow>& rows) const;
  void overlap_header() const;
  void overlap_section(const Case& c);
  void overlap_row(const OverlapRow& r);
  void overlap_footer(const std::vector<OverlapRow>& rows) const;

 private:
  const Options& opt_;
  std::string desc_;
  int world_;
  std::string route_;
};

// --moe-dispatch: MoE token dispatch / combine against the raw all_to_all_v (dtensor_bench_moe.cpp);
// returns how many ranks' results were wrong.
int64_t run_moe_dispatch(const Options& opt);

// The --json file: one object per row of each kind ("transition", "host", "overlap").
void write_json(const Options& opt, const std::string& desc, int world, const std::vector<Row>& rows,
                const std::vector<HostRow>& host, const std::vector<OverlapRow>& overlap = {});

}  // namespace dtensor_bench
