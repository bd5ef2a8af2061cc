// collectives-bench's report (collectives_bench.h): the text tables on stdout, the summary and
// the --json file.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/collectives_bench.h"

namespace collectives_bench {

using bench::human_bytes;
using bench::load_average;
using bench::median;
using json = nlohmann::ordered_json;

namespace {

std::string verdict(const Summary& s) {
  if (s.rows == 0) return "n/a (no size in range)";
  return fmt::format("{} ({}/{} sizes)", s.met == s.rows ? "met" : "MISSED", s.met, s.rows);
}

json stats_json(const Stats& s) {
  return json{{"median", s.median_us}, {"min", s.min_us}, {"max", s.max_us}};
}

}  // namespace

void Printer::header() const {
  fmt::print("# collectives-bench  backend: {}  world: {}  dtype: {}  op: {}  root: {}\n", desc_, world_,
             kernels::to_string(opt_.dtype), kernels::to_string(opt_.op), opt_.root);
  fmt::print("# iters: {} (fewer when size x iters > {}, at least {}), warmup: {}, check: {}, seed: {}\n",
             opt_.iters, human_bytes(opt_.iter_bytes), std::min(opt_.iters, 5), opt_.warmup,
             opt_.check ? "on" : "off", opt_.seed);
  fmt::print("# time: per iteration the max over ranks of (barrier; issue + wait); median/min/max over "
             "the iterations\n");
  fmt::print("# algbw = size / time; busbw = algbw x (2(n-1)/n all_reduce, (n-1)/n all_gather, "
             "reduce_scatter, all_to_all, 1 broadcast)\n");
  if (baseline_ == Baseline::kMemcpy)
    fmt::print("# memcpy: the same {} threads each memcpy size x busbw-factor bytes concurrently, in the same "
               "iterations; its time is first start to last end; ratio = busbw / memcpy busbw\n", world_);
  if (baseline_ == Baseline::kMpiRaw)
    fmt::print("# raw: MPI_Allgather / MPI_Reduce_scatter_block / MPI_Allreduce / MPI_Alltoall / MPI_Bcast "
               "on the same buffers (same iterations); ratio = ours / raw time\n");
  fmt::print("# command: {}\n", opt_.command_line);
  fmt::print("# load average at start: {}\n", load_average());
  std::fflush(stdout);
}

void Printer::section(Coll c) const {
  fmt::print("#\n# {}\n", coll_name(c));
  std::string base;
  if (baseline_ == Baseline::kMemcpy) base = fmt::format("  {:>10}  {:>8}  {:>6}", "memcpy_us", "memcpy", "ratio");
  if (baseline_ == Baseline::kMpiRaw) base = fmt::format("  {:>10}  {:>8}  {:>6}", "raw_us", "raw", "ratio");
  fmt::print("# {:>10}  {:>11}  {:>5}  {:>5}  {:>4}  {:>5}  {:>10}  {:>10}  {:>10}  {:>7}  {:>7}  {:>6}{}\n",
             "size", "count", "type", "redop", "root", "iters", "time_us", "min_us", "max_us", "algbw",
             "busbw", "#wrong", base);
  std::string base_units;
  if (baseline_ != Baseline::kNone) base_units = fmt::format("  {:>10}  {:>8}  {:>6}", "(median)", "(GB/s)", "");
  fmt::print("# {:>10}  {:>11}  {:>5}  {:>5}  {:>4}  {:>5}  {:>10}  {:>10}  {:>10}  {:>7}  {:>7}  {:>6}{}\n",
             "(B)", "(elements)", "", "", "", "", "(median)", "", "", "(GB/s)", "(GB/s)", "", base_units);
  std::fflush(stdout);
}

void Printer::row(const Row& r) const {
  std::string base;
  if (r.baseline != Baseline::kNone)
    base = fmt::format("  {:>10.1f}  {:>8.2f}  {:>6.2f}", r.base_time.median_us, r.base_busbw, r.ratio);
  fmt::print("  {:>10}  {:>11}  {:>5}  {:>5}  {:>4}  {:>5}  {:>10.1f}  {:>10.1f}  {:>10.1f}  {:>7.2f}  {:>7.2f}  "
             "{:>6}{}\n",
             r.bytes, r.count, kernels::to_string(opt_.dtype),
             reduces(r.coll) ? std::string(kernels::to_string(opt_.op)) : std::string("none"),
             r.coll == Coll::kBroadcast ? opt_.root : -1, r.iters, r.time.median_us, r.time.min_us,
             r.time.max_us, r.algbw, r.busbw, r.wrong < 0 ? std::string("N/A") : std::to_string(r.wrong), base);
  std::fflush(stdout);
}

Summary Printer::summarise(Coll c, const std::vector<Row>& rows) const {
  Summary s;
  s.coll = c;
  std::vector<double> ratios;
  for (const Row& r : rows)
    if (r.coll == c && r.bytes >= opt_.target_min && r.baseline != Baseline::kNone) ratios.push_back(r.ratio);
  s.rows = static_cast<int>(ratios.size());
  if (baseline_ == Baseline::kMemcpy) {
    s.has_target = c == Coll::kAllGather || c == Coll::kReduceScatter;
    s.target = 0.60;
    for (double x : ratios) s.met += x >= s.target;
    s.median = median(ratios);
    s.worst = ratios.empty() ? 0 : *std::min_element(ratios.begin(), ratios.end());
    s.text = fmt::format("{}: busbw / memcpy busbw at size >= {}: median {:.2f}, worst {:.2f} over {} sizes",
                         coll_name(c), human_bytes(opt_.target_min), s.median, s.worst, s.rows);
    if (s.has_target)
      s.text += fmt::format("; target >= {:.2f}: {}", s.target, verdict(s));
  } else if (baseline_ == Baseline::kMpiRaw) {
    s.has_target = true;
    s.target = 1.10;
    for (double x : ratios) s.met += x <= s.target;
    s.median = median(ratios);
    s.worst = ratios.empty() ? 0 : *std::max_element(ratios.begin(), ratios.end());
    std::vector<double> all;
    for (const Row& r : rows)
      if (r.coll == c) all.push_back(r.ratio);
    s.text = fmt::format("{}: ours / raw MPI time at size >= {}: median {:.2f}, worst {:.2f} over {} sizes "
                         "(all sizes: median {:.2f}); target <= {:.2f}: {}",
                         coll_name(c), human_bytes(opt_.target_min), s.median, s.worst, s.rows, median(all),
                         s.target, verdict(s));
  } else {
    std::vector<double> bw;
    for (const Row& r : rows)
      if (r.coll == c && r.bytes >= opt_.target_min) bw.push_back(r.busbw);
    s.rows = static_cast<int>(bw.size());
    s.median = median(bw);
    s.text = fmt::format("{}: median busbw at size >= {}: {:.2f} GB/s over {} sizes (no baseline)",
                         coll_name(c), human_bytes(opt_.target_min), s.median, s.rows);
  }
  return s;
}

void Printer::footer(const std::vector<Row>& rows, const std::vector<Summary>& sums) const {
  double bw = 0;
  int64_t wrong = 0;
  for (const Row& r : rows) {
    bw += r.busbw;
    wrong += std::max<int64_t>(r.wrong, 0);
  }
  fmt::print("#\n# Summary (targets are reported, not enforced)\n");
  for (const Summary& s : sums) fmt::print("#   {}\n", s.text);
  fmt::print("# Avg bus bandwidth: {:.3f} GB/s over {} rows\n", rows.empty() ? 0 : bw / rows.size(), rows.size());
  fmt::print("# load average at end: {}\n", load_average());
  fmt::print("# #wrong total: {}{}\n", wrong, opt_.check ? "" : " (check off)");
  std::fflush(stdout);
}
void write_json(const Options& opt, const std::string& desc, int world, Baseline baseline,
                const std::vector<Row>& rows, const std::vector<Summary>& sums) {
  json j;
  j["bench"] = "collectives-bench";
  j["command"] = opt.command_line;
  j["backend"] = opt.backend;
  j["backend_detail"] = desc;
  j["world"] = world;
  j["dtype"] = kernels::to_string(opt.dtype);
  j["op"] = kernels::to_string(opt.op);
  j["root"] = opt.root;
  j["iters"] = opt.iters;
  j["warmup"] = opt.warmup;
  j["iter_bytes"] = opt.iter_bytes;
  j["check"] = opt.check;
  j["seed"] = opt.seed;
  j["hardware_concurrency"] = std::thread::hardware_concurrency();
  j["load_average_end"] = load_average();
  j["baseline"] = baseline == Baseline::kMemcpy ? "memcpy" : baseline == Baseline::kMpiRaw ? "mpi_raw" : "none";
  json arr = json::array();
  for (const Row& r : rows) {
    json o;
    o["collective"] = coll_name(r.coll);
    o["size"] = r.bytes;
    o["count"] = r.count;
    o["dtype"] = kernels::to_string(opt.dtype);
    o["redop"] = reduces(r.coll) ? std::string(kernels::to_string(opt.op)) : std::string("none");
    o["root"] = r.coll == Coll::kBroadcast ? opt.root : -1;
    o["iters"] = r.iters;
    o["warmup"] = r.warmup;
    o["time_us"] = stats_json(r.time);
    if (r.span.median_us > 0) o["span_us"] = stats_json(r.span);
    o["algbw_gbps"] = r.algbw;
    o["busbw_gbps"] = r.busbw;
    o["wrong"] = r.wrong < 0 ? json(nullptr) : json(r.wrong);
    if (r.baseline != Baseline::kNone) {
      json b;
      b["kind"] = r.baseline == Baseline::kMemcpy ? "memcpy" : "mpi_raw";
      b["time_us"] = stats_json(r.base_time);
      b["busbw_gbps"] = r.base_busbw;
      b[r.baseline == Baseline::kMemcpy ? "busbw_ratio" : "time_ratio"] = r.ratio;
      o["baseline"] = b;
    }
    arr.push_back(o);
  }
  j["rows"] = arr;
  json s = json::array();
  for (const Summary& x : sums) {
    json o;
    o["collective"] = coll_name(x.coll);
    o["sizes_at_or_above"] = opt.target_min;
    o["rows"] = x.rows;
    o["median"] = x.median;
    if (baseline != Baseline::kNone) o["worst"] = x.worst;
    if (x.has_target) {
      o["target"] = x.target;
      o["met_rows"] = x.met;
      o["met"] = x.rows > 0 && x.met == x.rows;
    }
    o["text"] = x.text;
    s.push_back(o);
  }
  j["summary"] = s;
  std::ofstream f(opt.json_path);
  if (!f) throw kernels::InvalidArgument(fmt::format("--json: cannot write '{}'", opt.json_path));
  f << j.dump(2) << "\n";
}

int64_t finish(const Options& opt, const Printer& printer, const std::string& desc, int world, Baseline baseline,
               const std::vector<Row>& rows) {
  std::vector<Summary> sums;
  for (const std::string& name : opt.collectives) sums.push_back(printer.summarise(parse_coll(name), rows));
  printer.footer(rows, sums);
  if (!opt.json_path.empty()) write_json(opt, desc, world, baseline, rows, sums);
  int64_t wrong = 0;
  for (const Row& r : rows) wrong += std::max<int64_t>(r.wrong, 0);
  return wrong;
}

}  // namespace collectives_bench
