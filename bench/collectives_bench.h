// collectives-bench's types, shared by its measurement (collectives_bench.cpp) and its report
// (collectives_bench_report.cpp: the text tables on stdout, the summary and the --json file).
// Internal to the program.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/reduce_op.h"

namespace collectives_bench {

using bench::Stats;
using kernels::DType;
using kernels::ReduceOp;

// What the command line asks for (main in collectives_bench.cpp fills it in).
struct Options {
  std::string backend = "local";
  int world = 4;
  bool world_given = false;
  std::vector<std::string> collectives = {"all_gather", "reduce_scatter", "all_reduce",
                                          "all_to_all", "broadcast"};
  std::string sizes = "1K:256M";
  std::string dtype_name = "f32";
  std::string op_name = "sum";
  int root = 0;
  int iters = 20;
  int warmup = 2;
  std::string iter_bytes_text = "1G";
  std::string target_min_text = "4M";
  bool check = true;
  bool baseline = true;
  uint64_t seed = 1;
  int64_t timeout_ms = 300'000;
  std::string bootstrap = "auto";
  std::string json_path;
  bool inject_wrong = false;  // test of the checker: rank 0 corrupts one output element

  // Derived.
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  std::vector<int64_t> size_list;
  int64_t iter_bytes = int64_t{1} << 30;
  int64_t target_min = int64_t{4} << 20;
  std::string command_line;
};

// The collectives the bench times.
enum class Coll { kAllGather, kReduceScatter, kAllReduce, kAllToAll, kBroadcast };

inline Coll parse_coll(std::string_view s) {
  if (s == "all_gather") return Coll::kAllGather;
  if (s == "reduce_scatter") return Coll::kReduceScatter;
  if (s == "all_reduce") return Coll::kAllReduce;
  if (s == "all_to_all") return Coll::kAllToAll;
  if (s == "broadcast") return Coll::kBroadcast;
  throw kernels::InvalidArgument(fmt::format(
      "unknown collective '{}' (all_gather, reduce_scatter, all_reduce, all_to_all, broadcast)", s));
}

inline std::string_view coll_name(Coll c) {
  switch (c) {
    case Coll::kAllGather: return "all_gather";
    case Coll::kReduceScatter: return "reduce_scatter";
    case Coll::kAllReduce: return "all_reduce";
    case Coll::kAllToAll: return "all_to_all";
    case Coll::kBroadcast: return "broadcast";
  }
  return "?";
}

inline bool reduces(Coll c) { return c == Coll::kReduceScatter || c == Coll::kAllReduce; }

// What each row is compared with: nothing, the same threads' memcpy (local), or the raw MPI
// call on the same buffers (mpi).
enum class Baseline { kNone, kMemcpy, kMpiRaw };

// One row of the table: one collective at one size.

struct Row {
  Coll coll = Coll::kAllGather;
  int64_t bytes = 0, count = 0;
  int iters = 0, warmup = 0;
  Stats time;
  Stats span;  // local: first start to last end over the ranks (JSON only)
  double algbw = 0, busbw = 0;
  int64_t wrong = -1;  // -1: not checked
  Baseline baseline = Baseline::kNone;
  Stats base_time;
  double base_busbw = 0;
  double ratio = 0;  // memcpy: busbw / memcpy busbw; mpi: ours / raw time
};

// The summary of one collective over the rows at sizes >= --target-min.
struct Summary {
  Coll coll;
  int rows = 0;           // rows at >= target_min
  double median = 0, worst = 0;
  int met = 0;            // rows meeting the target
  bool has_target = false;
  double target = 0;
  std::string text;
};

// The text report on the reporting rank: a header, per collective a section and its rows, the
// summaries and a footer.
class Printer {
 public:
  Printer(const Options& opt, std::string backend_desc, int world, Baseline baseline)
      : opt_(opt), desc_(std::move(backend_desc)), world_(world), baseline_(baseline) {}
  void header() const;
  void section(Coll c) const;
  void row(const Row& r) const;
  Summary summarise(Coll c, const std::vector<Row>& rows) const;
  void footer(const std::vector<Row>& rows, const std::vector<Summary>& sums) const;

 private:
  const Options& opt_;
  std::string desc_;
  int world_;
  Baseline baseline_;
};

// The --json file: the run's settings, every row, the summaries.
void write_json(const Options& opt, const std::string& desc, int world, Baseline baseline,
                const std::vector<Row>& rows, const std::vector<Summary>& sums);

// Prints the summaries and the footer, writes --json; returns the total #wrong.
int64_t finish(const Options& opt, const Printer& printer, const std::string& desc, int world, Baseline baseline,
               const std::vector<Row>& rows);

}  // namespace collectives_bench
