// dtensor-bench's report (dtensor_bench.h): the text tables on stdout and the --json file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/dtensor_bench.h"
#include "kernels/error.h"

namespace dtensor_bench {

using bench::human_bytes;
using json = nlohmann::ordered_json;

std::string_view raw_name(RawKind k) {
  switch (k) {
    case RawKind::kAllGather: return "all_gather";
    case RawKind::kAllToAll: return "all_to_all";
    case RawKind::kReduceScatter: return "reduce_scatter";
    case RawKind::kAllReduce: return "all_reduce";
  }
  return "?";
}

void Printer::header() const {
  fmt::print("# dtensor-bench  backend: {}  world: {}  dtype: {}  planner: {}\n", desc_, world_,
             kernels::to_string(opt_.dtype), dtensor::to_string(opt_.planner));
  fmt::print("# iters: {}, warmup: {}, check: {}\n", opt_.iters, opt_.warmup, opt_.check ? "on" : "off");
  fmt::print("# bytes: the global tensor; time: per iteration the max over ranks of (barrier; redistribute), "
             "median/min/max over the iterations\n");
  fmt::print("# algbw = bytes / time; busbw = lower_bnd / time; recv/rank: bytes the plan makes the busiest "
             "rank receive; lower_bnd: the least any plan can\n");
  fmt::print("# raw: the plan's collectives called directly on preallocated buffers (same iterations); "
             "overhead = time / raw\n");
  fmt::print("# command: {}\n", opt_.command_line);
  fmt::print("# load average at start: {}\n", bench::load_average());
  std::fflush(stdout);
}

void Printer::section(const Case& c) {
  route_.clear();
  fmt::print("#\n# {}  on mesh {}{}\n", c.name(), mesh_text(c.mesh_shape),
             single_mesh_dim(c) ? "  (single mesh dim)" : "");
  fmt::print("# {:>10}  {:>16}  {:>5}  {:>10}  {:>10}  {:>10}  {:>7}  {:>7}  {:>10}  {:>10}  {:>10}  {:>8}  {:>6}\n",
             "bytes", "shape", "iters", "time_us", "min_us", "max_us", "algbw", "busbw", "recv/rank",
             "lower_bnd", "raw_us", "overhead", "#wrong");
  std::fflush(stdout);
}

void Printer::row(const Row& r) {
  if (r.route != route_) {
    route_ = r.route;
    fmt::print("#   route: {}{}\n", r.route, r.raw_text.empty() ? "" : fmt::format("   raw: {}", r.raw_text));
  }
  fmt::print("  {:>10}  {:>16}  {:>5}  {:>10.1f}  {:>10.1f}  {:>10.1f}  {:>7.2f}  {:>7.2f}  {:>10}  {:>10}  {:>10}  "
             "{:>8}  {:>6}\n",
             r.bytes, fmt::format("{}", fmt::join(r.shape, "x")), r.iters, r.time.median_us, r.time.min_us,
             r.time.max_us, r.algbw, r.busbw, r.bytes_per_rank, r.lower_bound,
             r.has_raw ? fmt::format("{:.1f}", r.raw.median_us) : "-",
             r.has_raw ? fmt::format("{:.2f}", r.overhead) : "-", r.wrong < 0 ? "N/A" : std::to_string(r.wrong));
  std::fflush(stdout);
}

void Printer::footer(const std::vector<Row>& rows) const {
  fmt::print("#\n# Summary: overhead (ours / raw) of single-mesh-dim transitions with a local shard >= {} "
             "(target <= {:.2f}; reported, not enforced)\n",
             human_bytes(opt_.target_min), opt_.target);
  std::map<std::string, std::vector<double>> by;
  std::vector<std::string> order;
  for (const Row& r : rows) {
    if (!r.single_mesh_dim || !r.has_raw || r.local_bytes < opt_.target_min) continue;
    const std::string key = r.transition + " on " + r.mesh;
    if (!by.count(key)) order.push_back(key);
    by[key].push_back(r.overhead);
  }
  int met = 0, total = 0;
  for (const std::string& k : order) {
    const auto& v = by[k];
    const int ok = static_cast<int>(std::count_if(v.begin(), v.end(), [&](double x) { return x <= opt_.target; }));
    met += ok;
    total += static_cast<int>(v.size());
    fmt::print("#   {:<32} median {:.2f}  worst {:.2f}  met {}/{}\n", k, bench::median(v),
               *std::max_element(v.begin(), v.end()), ok, v.size());
  }
  if (total == 0) fmt::print("#   (no size in range)\n");
  else fmt::print("#   overall: {} of {} sizes within {:.2f}\n", met, total, opt_.target);
  int64_t wrong = 0;
  for (const Row& r : rows) wrong += std::max<int64_t>(r.wrong, 0);
  fmt::print("# load average at end: {}\n", bench::load_average());
  fmt::print("# #wrong total: {}{}\n", wrong, opt_.check ? "" : " (check off)");
  std::fflush(stdout);
}

void Printer::host_header() const {
  fmt::print("# dtensor-bench --host-cost  backend: local (ranks as threads, {} hardware threads)  dtype: {}  "
             "planner: {}\n",
             std::thread::hardware_concurrency(), kernels::to_string(opt_.dtype), dtensor::to_string(opt_.planner));
  fmt::print("# per repeat: a barrier, then {} cached-plan S(0)->R redistributes of the tiny tensor on every rank; "
             "then a barrier and {} all_gathers of the same bytes on preallocated buffers (raw)\n",
             opt_.host_calls, opt_.host_calls);
  fmt::print("# us per call: the max over ranks per repeat, median (min, max) over {} repeats after {} warm-up "
             "ones; framework = redistribute - raw\n",
             std::max(opt_.iters, 1), opt_.warmup);
  fmt::print("# command: {}\n", opt_.command_line);
  fmt::print("# load average at start: {}\n", bench::load_average());
  fmt::print("# {:>5}  {:<10}  {:>6}  {:>15}  {:>10}  {:>10}  {:>10}  {:>12}\n", "world", "transition", "shape",
             "redistribute_us", "min", "max", "raw_us", "framework_us");
  std::fflush(stdout);
}

void Printer::host_row(const HostRow& r) const {
  fmt::print("  {:>5}  {:<10}  {:>6}  {:>15.3f}  {:>10.3f}  {:>10.3f}  {:>10.3f}  {:>12.3f}\n", r.world, r.transition,
             fmt::format("{}", fmt::join(r.shape, "x")), r.per_call.median_us, r.per_call.min_us, r.per_call.max_us,
             r.raw.median_us, r.framework_us);
  std::fflush(stdout);
}

void Printer::host_footer(const std::vector<HostRow>& rows) const {
  for (const HostRow& r : rows)
    if (r.world == 2 || r.world == 4)
      fmt::print("# world {}: framework {:.3f} us per call (target <= 2 us: {})\n", r.world, r.framework_us,
                 r.framework_us <= 2.0 ? "met" : "missed");
  fmt::print("# load average at end: {}\n", bench::load_average());
  std::fflush(stdout);
}

void Printer::overlap_header() const {
  fmt::print("# dtensor-bench --overlap  backend: {}  world: {}  dtype: {}  planner: {}\n", desc_, world_,
             kernels::to_string(opt_.dtype), dtensor::to_string(opt_.planner));
  fmt::print("# per size: {} warm-up transitions, {} transitions back to back (comm_warm), {} after an idle spell of "
             "comm_warm's median; then {} x (compute: a sleep of the latter's median, no CPU; comm: redistribute_async "
             "+ wait; overlapped: redistribute_async, the compute, wait), comm and overlapped after a compute-long "
             "idle spell\n",
             opt_.warmup, opt_.iters, opt_.iters, opt_.iters);
  fmt::print("#   each after a barrier, max over ranks, medians; exposed = (overlapped - compute) / comm "
             "(NOTE [overlap conditions])\n");
  fmt::print("# command: {}\n", opt_.command_line);
  fmt::print("# load average at start: {}\n", bench::load_average());
  std::fflush(stdout);
}

void Printer::overlap_section(const Case& c) {
  route_.clear();
  fmt::print("#\n# {}  on mesh {}\n", c.name(), mesh_text(c.mesh_shape));
  fmt::print("# {:>10}  {:>11}  {:>16}  {:>12}  {:>10}  {:>10}  {:>13}  {:>8}  {:>8}  {:>6}\n", "bytes", "local_bytes",
             "shape", "comm_warm_us", "comm_us", "compute_us", "overlapped_us", "issue_us", "exposed", "#wrong");
  std::fflush(stdout);
}

void Printer::overlap_row(const OverlapRow& r) {
  if (r.route != route_) {
    route_ = r.route;
    fmt::print("#   route: {}\n", r.route);
  }
  fmt::print("  {:>10}  {:>11}  {:>16}  {:>12.1f}  {:>10.1f}  {:>10.1f}  {:>13.1f}  {:>8.1f}  {:>8.3f}  {:>6}\n",
             r.bytes, r.local_bytes, fmt::format("{}", fmt::join(r.shape, "x")), r.comm_warm_us, r.comm.median_us,
             r.compute.median_us, r.overlapped.median_us, r.issue.median_us, r.exposed,
             r.wrong < 0 ? "N/A" : std::to_string(r.wrong));
  std::fflush(stdout);
}

void Printer::overlap_footer(const std::vector<OverlapRow>& rows) const {
  fmt::print("#\n# Summary: exposed at a local shard >= {} (target <= 0.10; reported, not enforced)\n",
             human_bytes(opt_.overlap_min));
  int met = 0, total = 0;
  double worst = 0;
  for (const OverlapRow& r : rows) {
    if (r.local_bytes < opt_.overlap_min || r.collectives == 0) continue;
    ++total;
    met += r.exposed <= 0.10;
    worst = std::max(worst, r.exposed);
  }
  if (total == 0) fmt::print("#   (no size in range)\n");
  else fmt::print("#   {} of {} rows within 0.10; worst {:.3f}\n", met, total, worst);
  int64_t wrong = 0;
  for (const OverlapRow& r : rows) wrong += std::max<int64_t>(r.wrong, 0);
  fmt::print("# load average at end: {}\n", bench::load_average());
  fmt::print("# #wrong total: {}{}\n", wrong, opt_.check ? "" : " (check off)");
  std::fflush(stdout);
}
void write_json(const Options& opt, const std::string& desc, int world, const std::vector<Row>& rows,
                const std::vector<HostRow>& host, const std::vector<OverlapRow>& overlap) {
  json arr = json::array();
  auto common = [&](json& o) {
    o["backend"] = opt.backend;
    o["backend_detail"] = desc;
    o["world"] = world;
    o["dtype"] = kernels::to_string(opt.dtype);
    o["planner"] = dtensor::to_string(opt.planner);
    o["command"] = opt.command_line;
  };
  const int64_t item = static_cast<int64_t>(kernels::itemsize(opt.dtype));
  for (const Row& r : rows) {
    json o;
    o["kind"] = "transition";
    o["transition"] = r.transition;
    o["src"] = r.src;
    o["dst"] = r.dst;
    o["mesh"] = r.mesh;
    o["mesh_shape"] = r.mesh_shape.vec();
    common(o);
    o["bytes"] = r.bytes;
    o["shape"] = r.shape.vec();
    o["local_bytes"] = r.local_bytes;
    o["route"] = r.route;
    o["collectives"] = r.collectives;
    o["single_mesh_dim"] = r.single_mesh_dim;
    o["iters"] = r.iters;
    o["warmup"] = r.warmup;
    o["time_us"] = r.time.median_us;
    o["time_min_us"] = r.time.min_us;
    o["time_max_us"] = r.time.max_us;
    o["raw_time_us"] = r.has_raw ? json(r.raw.median_us) : json(nullptr);
    o["raw_min_us"] = r.has_raw ? json(r.raw.min_us) : json(nullptr);
    o["raw_max_us"] = r.has_raw ? json(r.raw.max_us) : json(nullptr);
    json ops = json::array();
    for (const RawOp& op : r.raw_ops)
      ops.push_back({{"op", raw_name(op.kind)}, {"mesh_dim", op.mesh_dim}, {"group_size", op.group},
                     {"bytes_in", op.in * item}, {"bytes_out", op.out * item}});
    o["raw_ops"] = ops;
    o["overhead"] = r.has_raw ? json(r.overhead) : json(nullptr);
    o["algbw_gbps"] = r.algbw;
    o["busbw_gbps"] = r.busbw;
    o["bytes_per_rank"] = r.bytes_per_rank;
    o["lower_bound_bytes"] = r.lower_bound;
    o["wrong"] = r.wrong < 0 ? json(nullptr) : json(r.wrong);
    arr.push_back(o);
  }
  for (const HostRow& r : host) {
    json o;
    o["kind"] = "host";
    o["transition"] = r.transition;
    o["mesh"] = r.mesh;
    common(o);
    o["world"] = r.world;
    o["bytes"] = r.bytes;
    o["shape"] = r.shape.vec();
    o["calls"] = r.calls;
    o["iters"] = r.repeats;
    o["redistribute_us"] = r.per_call.median_us;
    o["raw_us"] = r.raw.median_us;
    o["framework_us"] = r.framework_us;
    o["time_us"] = r.per_call.median_us;
    o["time_min_us"] = r.per_call.min_us;
    o["time_max_us"] = r.per_call.max_us;
    o["raw_time_us"] = r.raw.median_us;
    o["raw_min_us"] = r.raw.min_us;
    o["raw_max_us"] = r.raw.max_us;
    o["overhead"] = r.raw.median_us > 0 ? json(r.per_call.median_us / r.raw.median_us) : json(nullptr);
    o["bytes_per_rank"] = 0;
    o["lower_bound_bytes"] = 0;
    arr.push_back(o);
  }
  for (const OverlapRow& r : overlap) {
    json o;
    o["kind"] = "overlap";
    o["transition"] = r.transition;
    o["src"] = r.src;
    o["dst"] = r.dst;
    o["mesh"] = r.mesh;
    o["mesh_shape"] = r.mesh_shape.vec();
    common(o);
    o["bytes"] = r.bytes;
    o["local_bytes"] = r.local_bytes;
    o["shape"] = r.shape.vec();
    o["route"] = r.route;
    o["collectives"] = r.collectives;
    o["iters"] = r.iters;
    o["warmup"] = opt.warmup;
    o["comm_us"] = r.comm.median_us;
    o["comm_warm_us"] = r.comm_warm_us;
    o["compute_us"] = r.compute.median_us;
    o["overlapped_us"] = r.overlapped.median_us;
    o["issue_us"] = r.issue.median_us;
    o["exposed"] = r.exposed;
    o["comm_min_us"] = r.comm.min_us;
    o["comm_max_us"] = r.comm.max_us;
    o["overlapped_min_us"] = r.overlapped.min_us;
    o["overlapped_max_us"] = r.overlapped.max_us;
    o["wrong"] = r.wrong < 0 ? json(nullptr) : json(r.wrong);
    arr.push_back(o);
  }
  std::ofstream f(opt.json_path);
  if (!f) throw kernels::InvalidArgument(fmt::format("--json: cannot write '{}'", opt.json_path));
  f << arr.dump(1) << "\n";
}

}  // namespace dtensor_bench
