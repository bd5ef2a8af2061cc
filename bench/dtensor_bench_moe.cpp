// dtensor-bench --moe-dispatch: expert parallelism's token dispatch and combine
// (dtensor/row_exchange.h, what nn::MoE calls) against the raw all_to_all_v of the same bytes.
//
// Per size S (bytes of rows each rank sends) on a 1-D mesh of --world local ranks: rows of
// --moe-width f32 elements, rank r sending (1 + (r + j) % 3) shares of its rows to member j
// (uneven, as routing is). One iteration:
//   ours: dispatch = exchange_rows_known (the rows by all_to_all_v into a fresh result, the
//         receive counts known) and combine = exchange_rows_known back, as the MoE forward does:
//         it reads the receive counts off its all-gathered routing statistics, so the count
//         exchange is not part of the dispatch (its cost sits in that all-gather, not timed here);
//   raw:  the same two all_to_all_v calls with the counts known and the buffers preallocated.
// Times are per iteration, the max over ranks; medians over --iters (the two alternate which
// runs first). ratio = the median over iterations of ours / raw of the same iteration (run back
// to back, so a change in the machine's load hits both; the ratio of the medians is printed
// too); the summary holds sizes >= --target-min-size per rank against --target (1.10).
// Every rank checks once per size that the rows arrived from the right sources and came back
// unchanged (exit 1 otherwise).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/dtensor_bench.h"
#include "collectives/local.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/row_exchange.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "kernels/tensor.h"
#include "program/main.h"

namespace dtensor_bench {

namespace {

using collectives::Communicator;
using kernels::Tensor;

struct MoERow {
  int64_t bytes = 0;  // bytes of rows each rank sends
  int64_t rows = 0;   // rows each rank sends
  Stats dispatch, combine, total, raw_dispatch, raw_combine, raw_total;
  double ratio = 0;            // median over iterations of total / raw_total
  double ratio_of_medians = 0;  // median total / median raw_total
  int64_t wrong = 0;
};

// Rows rank r sends to each of n members when it sends `rows` in all.
std::vector<int64_t> send_counts(int r, int n, int64_t rows) {
  std::vector<int64_t> w(n), c(n);
  int64_t sum = 0;
  for (int j = 0; j < n; ++j) sum += (w[j] = 1 + (r + j) % 3);
  int64_t given = 0;
  for (int j = 0; j < n; ++j) given += (c[j] = rows * w[j] / sum);
  c[n - 1] += rows - given;
  return c;
}

// Element c of row i that rank r sends: a function of (r, i, c), exact in f32.
double value(int r, int64_t i, int64_t c) { return static_cast<double>((r * 7 + i * 3 + c) % 1021); }

MoERow run_size(Communicator& world, const dtensor::MeshComms& comms, const Options& opt, int64_t bytes) {
  const int n = world.size(), me = world.rank();
  const int64_t width = opt.moe_width;
  const int64_t row_bytes = kernels::checked_mul(width, 4, "row bytes");
  const int64_t rows = std::max<int64_t>(n, bytes / row_bytes);
  std::vector<std::vector<int64_t>> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = send_counts(r, n, rows);
  std::vector<int64_t> recv(n);
  for (int j = 0; j < n; ++j) recv[j] = counts[j][me];
  std::vector<double> v(static_cast<size_t>(kernels::checked_mul(rows, width, "elements")));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < width; ++c) v[i * width + c] = value(me, i, c);
  const Tensor send = Tensor::from_vector(v, {rows, width}, kernels::DType::kF32);

  // Raw buffers and element counts, made once.
  int64_t in_rows = 0;
  for (int64_t c : recv) in_rows += c;
  const Tensor raw_mid = Tensor::empty({in_rows * width}, kernels::DType::kF32);
  const Tensor raw_back = Tensor::empty({rows * width}, kernels::DType::kF32);
  std::vector<int64_t> send_el, recv_el;
  for (int64_t c : counts[me]) send_el.push_back(c * width);
  for (int64_t c : recv) recv_el.push_back(c * width);
  const Tensor flat = send.view({rows * width});
  Communicator& group = comms.dim(0);

  std::vector<double> d, cb, rd, rc;
  auto ours = [&](bool timed) {
    world.wait(world.barrier());
    const double t0 = bench::now_us();
    const Tensor mid = dtensor::exchange_rows_known(comms, 0, send, counts[me], recv, "moe dispatch").wait();
    const double t1 = bench::now_us();
    const Tensor back = dtensor::exchange_rows_known(comms, 0, mid, recv, counts[me], "moe combine").wait();
    const double t2 = bench::now_us();
    if (timed) {
      d.push_back(t1 - t0);
      cb.push_back(t2 - t1);
    }
  };  // the results are released outside the timed region
  auto raw = [&](bool timed) {
    world.wait(world.barrier());
    const double r0 = bench::now_us();
    group.wait(group.all_to_all_v(flat, send_el, raw_mid, recv_el));
    const double r1 = bench::now_us();
    group.wait(group.all_to_all_v(raw_mid, recv_el, raw_back, send_el));
    const double r2 = bench::now_us();
    if (timed) {
      rd.push_back(r1 - r0);
      rc.push_back(r2 - r1);
    }
  };
  // The two alternate which goes first, so a drift in the machine's load hits both alike.
  for (int it = 0; it < opt.warmup + opt.iters; ++it) {
    const bool timed = it >= opt.warmup;
    if (it % 2 == 0) {
      ours(timed);
      raw(timed);
    } else {
      raw(timed);
      ours(timed);
    }
  }

  MoERow row;
  row.rows = rows;
  if (opt.check) {
    const Tensor mid = dtensor::exchange_rows_known(comms, 0, send, counts[me], recv, "moe dispatch").wait();
    const Tensor back = dtensor::exchange_rows_known(comms, 0, mid, recv, counts[me], "moe combine").wait();
    bool ok = back.to_vector() == v;
    const std::vector<double> got = mid.to_vector();
    int64_t at = 0;
    for (int j = 0; j < n && ok; ++j) {
      int64_t first = 0;  // source j's first row for this rank
      for (int k = 0; k < me; ++k) first += counts[j][k];
      for (int64_t i = 0; i < recv[j] && ok; ++i, ++at)
        for (int64_t c = 0; c < width && ok; ++c) ok = got[at * width + c] == value(j, first + i, c);
    }
    row.wrong = static_cast<int64_t>(bench::reduce_over_ranks(world, {ok ? 0.0 : 1.0}, kernels::ReduceOp::kSum)[0]);
  }
  auto sum = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> s(a.size());
    for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
    return s;
  };
  // One all_reduce(max) over the ranks of every iteration's times.
  std::vector<double> all = d;
  for (const auto* part : {&cb, &rd, &rc}) all.insert(all.end(), part->begin(), part->end());
  const std::vector<double> mine_total = sum(d, cb), raw_total = sum(rd, rc);
  all.insert(all.end(), mine_total.begin(), mine_total.end());
  all.insert(all.end(), raw_total.begin(), raw_total.end());
  all = bench::reduce_over_ranks(world, all, kernels::ReduceOp::kMax);
  const auto k = static_cast<long>(opt.iters);
  auto part = [&](int i) { return bench::stats_of({all.begin() + i * k, all.begin() + (i + 1) * k}); };
  row.dispatch = part(0);
  row.combine = part(1);
  row.raw_dispatch = part(2);
  row.raw_combine = part(3);
  row.total = part(4);
  row.raw_total = part(5);
  row.ratio_of_medians = row.raw_total.median_us > 0 ? row.total.median_us / row.raw_total.median_us : 0;
  std::vector<double> ratios;
  for (long i = 0; i < k; ++i)
    if (all[5 * k + i] > 0) ratios.push_back(all[4 * k + i] / all[5 * k + i]);
  row.ratio = ratios.empty() ? 0 : program::median(ratios);
  row.bytes = rows * row_bytes;
  return row;
}

}  // namespace

int64_t run_moe_dispatch(const Options& opt) {
  const int n = opt.world;
  fmt::print("# dtensor-bench --moe-dispatch: local ({} ranks as threads, {} hardware threads), rows of {} f32, "
             "iters {}, warmup {}\n",
             n, std::thread::hardware_concurrency(), opt.moe_width, opt.iters, opt.warmup);
  fmt::print("# ours: exchange_rows_known there and back (receive counts known, as nn::MoE has them from its "
             "routing statistics' all-gather, which is not timed); raw: the "
             "two all_to_all_v on preallocated buffers, counts known. us: median over iters of the max over ranks; "
             "ratio: median of the per-iteration ours/raw; ratio_med: of the medians\n");
  fmt::print("{:>10} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>7} {:>9} {:>5}\n", "bytes/rank", "rows",
             "dispatch_us", "raw_disp_us", "combine_us", "raw_comb_us", "total_us", "raw_total_us", "ratio",
             "ratio_med", "ok");
  std::vector<MoERow> rows;
  collectives::run_ranks(
      n,
      [&](Communicator& world) {
        program::on_rank(world.rank(), [&] {
          const dtensor::MeshComms comms(dtensor::DeviceMesh::from_shape({n}), world);
          for (int64_t s : opt.size_list) {
            MoERow r = run_size(world, comms, opt, s);
            if (world.rank() != 0) continue;
            fmt::print(
                "{:>10} {:>8} {:>12.1f} {:>12.1f} {:>12.1f} {:>12.1f} {:>12.1f} {:>12.1f} {:>7.3f} {:>9.3f} {:>5}\n",
                bench::human_bytes(r.bytes), r.rows, r.dispatch.median_us, r.raw_dispatch.median_us, r.combine.median_us,
                r.raw_combine.median_us, r.total.median_us, r.raw_total.median_us, r.ratio, r.ratio_of_medians,
                opt.check ? (r.wrong == 0 ? "yes" : "NO") : "-");
            std::fflush(stdout);
            rows.push_back(r);
          }
        });
      },
      collectives::Milliseconds{opt.timeout_ms});
  int64_t wrong = 0, counted = 0, met = 0;
  double worst = 0;
  for (const MoERow& r : rows) {
    wrong += r.wrong;
    if (r.bytes < opt.target_min) continue;
    ++counted;
    worst = std::max(worst, r.ratio);
    if (r.ratio <= opt.target) ++met;
  }
  fmt::print("# summary: {} of {} sizes >= {} per rank meet ratio <= {:.2f} (worst {:.3f})\n", met, counted,
             bench::human_bytes(opt.target_min), opt.target, worst);
  return wrong;
}

}  // namespace dtensor_bench
