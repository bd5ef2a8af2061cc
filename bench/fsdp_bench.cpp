// fsdp-bench: FSDP / HSDP training steps of the small GPT split into what they cost, for each
// FSDP layout (--layouts padded,contiguous: fsdp::Layout) and prefetch 0, 1 and 2 in one run
// (rounds interleaved across layouts and depths, medians over repeats):
//   step      forward + backward under fully_shard (unshard, prefetch, reduce-scatter included)
//   compute   the same forward + backward on replicated parameters with the same local batch
//             (no communication at all)
//   comm      the group transitions alone, in sequence, per layout: per group two unshards and
//             reshards (forward and backward all-gather, plus the padded layout's split-copy)
//             and one flat gradient reduction of the group's reduce-scatter input bytes
//             (P -> S(0), HSDP P,P -> R,S(0)), all through FSDPModule's public API
//   exposed   (step - compute) / comm: the share of communication not hidden behind compute
//   peak      rank 0's peak bytes during the step of the layout's own mesh and FSDP allocators
//             (its model, gradients, activations, FSDP buffers; each layout and the replicated
//             copy live on meshes of their own)
//   copy      bytes FSDP copied around its collectives in one step (sum of GroupStats::copy_bytes)
// and the ratios contiguous / padded of step time (of the medians, and the median of the
// per-round quotients) and peak. A layout fully_shard refuses
// (kernels::Unsupported) is one "skipped: <why>" row. With --host-cost, FSDP's host time per
// group per step: (FSDP step - plain step) / groups on a one-rank mesh (collectives trivial)
// with a tiny model of many blocks.
//
//   fsdp-bench --backend local --dp-shard 4
//   fsdp-bench --backend local --dp-shard 4 --dim 512 --layers 8 --prefetch 1
//   fsdp-bench --backend local --dp-replicate 2 --dp-shard 2
//   mpirun -np 4 fsdp-bench --backend mpi --dp-shard 4
//   fsdp-bench --host-cost
//   fsdp-bench --dp-shard 2 --iters 1 --trace t.json   # a Chrome trace (ui.perfetto.dev): per rank
//       each measured call (compute lane), forward and backward, every collective from issue to
//       completion with its bytes and transition, FSDP's copies and waits
//
// Output: a Markdown table on rank 0 and one JSON object per configuration (--json FILE too).
// Exit status: 0 ok, 2 invalid input, 4 communication failure.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/trace.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/trace.h"
#include "nn/memory.h"
#include "nn/transformer.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"

namespace {

using collectives::Communicator;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::Placements;
using kernels::checked_add;
using kernels::checked_ceil_div;
using kernels::checked_mul;
using kernels::DType;
using kernels::Tensor;

struct Args {
  std::string backend = "local";
  int dp_replicate = 1, dp_shard = 4;
  int64_t layers = 4, dim = 256, heads = 4, vocab = 512, seq = 64, batch = 16;
  int iters = 5, warmup = 1, threads = 0;
  std::vector<int> prefetch{0, 1, 2};
  std::vector<std::string> layout_names{"padded", "contiguous"};
  std::vector<fsdp::Layout> layouts;  // parsed from layout_names
  bool host_cost = false;
  int host_layers = 32;
  std::string json;
  std::string trace;  // --trace FILE; empty: none
};

using program::median;
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

nn::GPTConfig config(const Args& a, int64_t layers, int64_t dim, int64_t heads) {
  nn::GPTConfig c;
  c.vocab = a.vocab;
  c.dim = dim;
  c.heads = heads;
  c.layers = layers;
  c.max_seq = a.seq;
  return c;
}

const char* layout_name(fsdp::Layout l) { return l == fsdp::Layout::kPadded ? "padded" : "contiguous"; }

fsdp::Layout parse_layout(const std::string& s) {
  if (s == "padded") return fsdp::Layout::kPadded;
  if (s == "contiguous") return fsdp::Layout::kContiguous;
  throw kernels::InvalidArgument(fmt::format("--layouts {}: expected padded or contiguous", s));
}

// One row per (layout, prefetch); a layout fully_shard refused has one row with `skipped` set.
struct Row {
  fsdp::Layout layout = fsdp::Layout::kPadded;
  int prefetch = 0;
  double step_ms = 0, compute_ms = 0, comm_ms = 0, exposed = 0;
  int64_t peak_bytes = 0, copy_bytes = 0;
  std::vector<double> rounds;  // the step's time in each round (s), for ratios paired by round
  std::string skipped;  // non-empty: why fully_shard refused this layout (no figures)
};

// Trace names outlive measure(): the tracer keeps views.
const char* step_name(fsdp::Layout l, int prefetch) {
  static constexpr const char* kNames[2][3] = {
      {"FSDP step, padded, prefetch 0", "FSDP step, padded, prefetch 1", "FSDP step, padded, prefetch 2"},
      {"FSDP step, contiguous, prefetch 0", "FSDP step, contiguous, prefetch 1", "FSDP step, contiguous, prefetch 2"}};
  return kNames[l == fsdp::Layout::kPadded ? 0 : 1][prefetch];
}
const char* comm_name(fsdp::Layout l) {
  return l == fsdp::Layout::kPadded ? "communication alone, padded" : "communication alone, contiguous";
}

// Every rank of `world` runs this; rank 0's rows come back.
std::vector<Row> measure(Communicator& world, const Args& a, int threads) {
  std::vector<int64_t> sizes;
  std::vector<std::string> names;
  if (a.dp_replicate > 1) {
    sizes.push_back(a.dp_replicate);
    names.push_back("dp_replicate");
  }
  sizes.push_back(a.dp_shard);
  names.push_back("dp_shard");
  Dims shape = Dims::filled(static_cast<int>(sizes.size()), 1);
  for (size_t i = 0; i < sizes.size(); ++i) shape[static_cast<int>(i)] = sizes[i];
  const dtensor::DeviceMesh mesh = dtensor::DeviceMesh::from_shape(shape, names);
  const nn::GPTConfig cfg = config(a, a.layers, a.dim, a.heads);
  dtensor::ops::OpOptions ops;
  ops.num_threads = threads;
  nn::CrossEntropyLoss loss_fn;
  const Placements batch_pl(mesh.ndim(), dtensor::Shard{0});
  Tensor ids = Tensor::empty({a.batch, a.seq}, DType::kI64), tgt = Tensor::empty({a.batch, a.seq}, DType::kI64);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    ids.data<int64_t>()[i] = (i * 7 + 3) % a.vocab;
    tgt.data<int64_t>()[i] = (i * 5 + 1) % a.vocab;
  }
  kernels::Tracer* const tracer = world.tracer();  // --trace; null: off
  const int me = world.global_rank();
  auto run_step = [&](nn::GPT& m, const DTensor& x, const DTensor& y) {
    nn::Ctx ctx(&ops), lctx(&ops);
    std::optional<kernels::TraceSpan> span(std::in_place, tracer, me, "compute", "forward");
    DTensor loss = loss_fn.forward(lctx, m.forward(ctx, x), y);
    span.emplace(tracer, me, "compute", "backward");
    m.backward(ctx, loss_fn.backward(lctx));
    m.zero_grad();
  };
  auto timed = [&](const char* what, const std::function<void()>& fn) {
    world.wait(world.barrier());
    const double t0 = now();
    const kernels::TraceSpan span(tracer, me, "compute", what);
    fn();
    world.wait(world.barrier());
    return now() - t0;
  };

  // Compute alone: a replicated copy on its own mesh (so no layout's peak counts it), the local
  // batch, no reduction.
  auto plain_comms = dtensor::MeshComms::create(mesh, world);
  nn::GPT plain(nn::ModuleOptions{plain_comms, DType::kF32, {}}, cfg);
  nn::materialize(plain, 1);
  const DTensor px = dtensor::distribute_tensor(ids, plain_comms, batch_pl, std::nullopt);
  const DTensor py = dtensor::distribute_tensor(tgt, plain_comms, batch_pl, std::nullopt);
  auto compute_only = [&] { run_step(plain, px, py); };
  for (int i = 0; i < a.warmup; ++i) compute_only();
  std::vector<double> compute;

  // Per layout: the model under fully_shard on a mesh of its own, whose allocators count only it.
  struct Sharded {
    fsdp::Layout layout = fsdp::Layout::kPadded;
    std::string skipped;
    std::shared_ptr<nn::TrackingAllocator> total;  // the layout's peak: the largest sum live at one time
    std::shared_ptr<dtensor::MeshComms> comms;
    std::unique_ptr<nn::GPT> model;
    std::optional<DTensor> x, y;
    std::vector<fsdp::FSDPModule*> groups;  // blocks, then the root
    std::vector<DTensor> grads;             // communication alone: one flat gradient per group
    std::vector<double> comm;
    std::vector<std::vector<double>> steps;
    std::vector<int64_t> peaks, copies;
  };
  std::vector<Sharded> shards;
  std::vector<int> dp_dims;
  for (int d = 0; d < mesh.ndim(); ++d) dp_dims.push_back(d);
  Placements all_p(mesh.ndim(), dtensor::Partial{}), target(mesh.ndim(), dtensor::Replicate{});
  target.back() = dtensor::Shard{0};
  for (const fsdp::Layout layout : a.layouts) {
    Sharded& s = shards.emplace_back();
    s.layout = layout;
    s.total = std::make_shared<nn::TrackingAllocator>();
    auto tracked = [&] { return std::make_shared<nn::TrackingAllocator>(std::make_shared<kernels::CachingAllocator>(), s.total); };
    // Created on every rank in the same order (MeshComms::create is collective), refused or not.
    s.comms = dtensor::MeshComms::create(mesh, world, {}, tracked());
    s.model = std::make_unique<nn::GPT>(nn::ModuleOptions{s.comms, DType::kF32, {}}, cfg);
    nn::materialize(*s.model, 1);
    fsdp::FullyShardOptions o;
    o.layout = layout;
    o.unsharded_allocator = tracked();
    o.buffer_allocator = tracked();
    try {  // fully_shard is collective-free: every rank refuses alike
      for (const auto& [n, b] : s.model->blocks().children()) s.groups.push_back(&fsdp::fully_shard(*b, s.comms, o));
      s.groups.push_back(&fsdp::fully_shard(*s.model, s.comms, o));
    } catch (const kernels::Unsupported& e) {
      s.skipped = e.what();
      s.groups.clear();
      s.model.reset();
      continue;
    }
    s.x = dtensor::distribute_tensor(ids, s.comms, batch_pl, std::nullopt);
    s.y = dtensor::distribute_tensor(tgt, s.comms, batch_pl, std::nullopt);
    // Communication alone's gradient reduction: the group's reduce-scatter input bytes (f32),
    // rounded up to whole shards, P -> S(0) (HSDP [P,P] -> [R,S(0)]): the bytes of either
    // layout's reduction, through the public API whatever the layout's own placement.
    auto dp = s.comms->slice_dims(dp_dims);
    auto dp_mesh = std::shared_ptr<const dtensor::DeviceMesh>(dp, &dp->mesh());
    for (fsdp::FSDPModule* g : s.groups) {
      const int64_t shard = checked_ceil_div(g->reduce_scatter_input_bytes(), checked_mul(4, a.dp_shard, "flat bytes"),
                                             "flat gradient shard");
      const int64_t n = checked_mul(shard, a.dp_shard, "flat gradient elements");
      s.grads.emplace_back(dp, dtensor::make_spec(dp_mesh, all_p, Dims{n}, DType::kF32), Tensor::zeros({n}, DType::kF32));
    }
    s.steps.resize(a.prefetch.size());
    s.peaks.assign(a.prefetch.size(), 0);
    s.copies.assign(a.prefetch.size(), 0);
  }
  // Communication alone: per group two unshards (forward and backward) and one flat gradient
  // reduction, in sequence.
  auto comm_only = [&](Sharded& s) {
    for (size_t i = 0; i < s.groups.size(); ++i) {
      for (int r = 0; r < 2; ++r) {
        s.groups[i]->unshard();
        s.groups[i]->reshard();
      }
      s.grads[i].redistribute(target);
    }
  };
  auto set_prefetch = [&](Sharded& s, int depth) {
    std::vector<fsdp::FSDPModule*>& groups = s.groups;
    groups.back()->set_prefetch_depth(depth >= 1 ? 1 : 0);
    for (size_t i = 0; i + 1 < groups.size(); ++i) {
      std::vector<fsdp::FSDPModule*> fwd, bwd;  // empty: back to the implicit order
      if (depth == 2) {
        for (size_t j = i + 1; j <= i + 2 && j + 1 < groups.size(); ++j) fwd.push_back(groups[j]);
        for (size_t j = 1; j <= 2 && j <= i; ++j) bwd.push_back(groups[i - j]);
      }
      groups[i]->set_modules_to_forward_prefetch(fwd);
      groups[i]->set_modules_to_backward_prefetch(bwd);
    }
  };
  auto copy_bytes = [](const Sharded& s) {
    int64_t sum = 0;
    for (const fsdp::FSDPModule* g : s.groups) sum = checked_add(sum, g->stats().copy_bytes, "copy bytes");
    return sum;
  };
  for (Sharded& s : shards) {
    if (!s.skipped.empty()) continue;
    for (int i = 0; i < a.warmup; ++i) comm_only(s);
    for (size_t k = 0; k < a.prefetch.size(); ++k) {  // warm every mode once
      set_prefetch(s, a.prefetch[k]);
      for (int i = 0; i < a.warmup + 1; ++i) run_step(*s.model, *s.x, *s.y);  // + 1: the forward order is recorded
    }
  }
  // Rounds interleave every measurement (layouts and prefetch depths), so load drift hits all alike.
  for (int i = 0; i < a.iters; ++i) {
    compute.push_back(timed("compute alone", compute_only));
    for (Sharded& s : shards)
      if (s.skipped.empty()) s.comm.push_back(timed(comm_name(s.layout), [&] { comm_only(s); }));
    for (Sharded& s : shards) {
      if (!s.skipped.empty()) continue;
      for (size_t k = 0; k < a.prefetch.size(); ++k) {
        set_prefetch(s, a.prefetch[k]);
        run_step(*s.model, *s.x, *s.y);  // the first step of a mode records its order
        s.total->reset_peak();
        const int64_t copied = copy_bytes(s);
        s.steps[k].push_back(timed(step_name(s.layout, a.prefetch[k]), [&] { run_step(*s.model, *s.x, *s.y); }));
        s.peaks[k] = std::max(s.peaks[k], s.total->peak_bytes());
        s.copies[k] = copy_bytes(s) - copied;
      }
    }
  }
  std::vector<Row> rows;
  const double c = median(compute);
  for (const Sharded& s : shards) {
    if (!s.skipped.empty()) {
      rows.push_back({.layout = s.layout, .skipped = s.skipped});
      continue;
    }
    const double m = median(s.comm);
    for (size_t k = 0; k < a.prefetch.size(); ++k) {
      const double st = median(s.steps[k]);
      rows.push_back({s.layout, a.prefetch[k], st * 1e3, c * 1e3, m * 1e3, m > 0 ? (st - c) / m : 0, s.peaks[k],
                      s.copies[k], s.steps[k], ""});
    }
  }
  return rows;
}

// (FSDP step - plain step) / groups on one rank, tiny dims, many blocks.
double host_cost_us(const Args& a, int* groups_out) {
  double result = 0;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = dtensor::MeshComms::create(dtensor::DeviceMesh::from_shape({1}, {"dp_shard"}), world);
    Args t = a;
    t.vocab = 32;
    t.seq = 4;
    const nn::GPTConfig cfg = config(t, a.host_layers, 16, 2);
    nn::CrossEntropyLoss loss_fn;
    dtensor::ops::OpOptions ops;
    ops.num_threads = 1;
    Tensor ids = Tensor::zeros({2, t.seq}, DType::kI64);
    auto run = [&](bool sharded) {
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
      nn::materialize(model, 1);
      int groups = 0;
      if (sharded) {
        for (const auto& [n, b] : model.blocks().children()) {
          fsdp::fully_shard(*b, comms);
          ++groups;
        }
        fsdp::fully_shard(model, comms);
        ++groups;
      }
      const Placements pl{dtensor::Shard{0}};
      const DTensor x = dtensor::distribute_tensor(ids, comms, pl, std::nullopt);
      std::vector<double> times;
      for (int i = 0; i < a.warmup + 3 * a.iters; ++i) {
        const double t0 = now();
        nn::Ctx ctx(&ops), lctx(&ops);
        DTensor loss = loss_fn.forward(lctx, model.forward(ctx, x), x);
        model.backward(ctx, loss_fn.backward(lctx));
        model.zero_grad();
        if (i >= a.warmup) times.push_back(now() - t0);
      }
      *groups_out = sharded ? groups : *groups_out;
      return median(times);
    };
    std::vector<double> plain, fsdp_t;
    for (int r = 0; r < 3; ++r) {  // alternate, medians of medians
      plain.push_back(run(false));
      fsdp_t.push_back(run(true));
    }
    result = (median(fsdp_t) - median(plain)) / *groups_out * 1e6;
  });
  return result;
}

int run(int argc, char** argv) {
  Args a;
  CLI::App app("fsdp-bench: FSDP / HSDP step, compute, communication, exposed communication, peak memory");
  app.add_option("--backend", a.backend, "local | mpi");
  app.add_option("--dp-replicate", a.dp_replicate, "HSDP replicas")->check(CLI::Range(1, 1024));
  app.add_option("--dp-shard", a.dp_shard, "FSDP shards")->check(CLI::Range(1, 1024));
  app.add_option("--layers", a.layers, "transformer blocks (one FSDP group each, plus the root)")->check(CLI::Range(1, 4096));
  app.add_option("--dim", a.dim, "model dim")->check(CLI::Range(1, 1 << 16));
  app.add_option("--heads", a.heads, "attention heads")->check(CLI::Range(1, 4096));
  app.add_option("--vocab", a.vocab, "vocabulary")->check(CLI::Range(1, 1 << 24));
  app.add_option("--seq", a.seq, "sequence length")->check(CLI::Range(1, 1 << 16));
  app.add_option("--batch", a.batch, "global batch (sequences)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--iters", a.iters, "timed repeats per mode (medians)")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", a.warmup, "untimed repeats")->check(CLI::Range(0, 1000000));
  app.add_option("--threads", a.threads, "CPU threads per rank (0: cores / ranks)")->check(CLI::Range(0, 1024));
  app.add_option("--prefetch", a.prefetch, "prefetch depths to compare in one run")->delimiter(',');
  app.add_option("--layouts", a.layout_names, "FSDP layouts to compare in one run: padded, contiguous")->delimiter(',');
  app.add_flag("--host-cost", a.host_cost, "also FSDP's host time per group per step (one rank)");
  app.add_option("--host-layers", a.host_layers, "blocks of the host-cost model");
  app.add_option("--json", a.json, "also write the JSON lines here");
  app.add_option("--trace", a.trace, "write a Chrome trace (ui.perfetto.dev) of the measured steps to FILE");
  program::parse(app, argc, argv);  // --help: exit 0; a bad option: one line, exit 2
  for (int p : a.prefetch)
    if (p < 0 || p > 2) throw kernels::InvalidArgument(fmt::format("--prefetch {}: expected 0, 1 or 2", p));
  for (const std::string& l : a.layout_names) {
    const fsdp::Layout layout = parse_layout(l);
    if (std::find(a.layouts.begin(), a.layouts.end(), layout) != a.layouts.end())
      throw kernels::InvalidArgument(fmt::format("--layouts {}: given twice", l));
    a.layouts.push_back(layout);
  }
  if (a.backend != "local" && a.backend != "mpi")
    throw kernels::InvalidArgument(fmt::format("--backend {}: expected local or mpi", a.backend));
  const int world_size = a.dp_replicate * a.dp_shard;
  std::vector<Row> rows;
  int rank = 0;
  std::unique_ptr<collectives::MpiWorld> mpi;
  kernels::Tracer tracer;
  std::optional<kernels::File> trace_file;
  auto trace_error = [&](const kernels::InvalidArgument& e) {
    return kernels::InvalidArgument(fmt::format("--trace {}: {}", a.trace, e.what()));
  };
  if (a.backend == "mpi") {
    mpi = std::make_unique<collectives::MpiWorld>(&argc, &argv);
    auto w = mpi->communicator();
    rank = w->rank();
    if (w->size() != world_size)
      throw kernels::InvalidArgument(fmt::format("mpirun started {} processes for {} x {} ranks", w->size(),
                                                 a.dp_replicate, a.dp_shard));
    if (!a.trace.empty()) {
      try {
        trace_file = collectives::create_trace_file(*w, a.trace);
      } catch (const kernels::InvalidArgument& e) {
        throw trace_error(e);
      }
      w->set_tracer(&tracer);
    }
    rows = measure(*w, a, a.threads > 0 ? a.threads : 1);
    if (!a.trace.empty()) collectives::write_trace(*w, tracer, trace_file);
  } else {
    if (!a.trace.empty()) try {  // before any rank starts
        trace_file = kernels::File::create(a.trace);
      } catch (const kernels::InvalidArgument& e) {
        throw trace_error(e);
      }
    const int hw = std::max(1u, std::thread::hardware_concurrency());
    collectives::run_ranks(world_size, [&](Communicator& w) {
      if (trace_file) w.set_tracer(&tracer);
      auto r = measure(w, a, a.threads > 0 ? a.threads : std::max(1, hw / world_size));
      if (w.rank() == 0) rows = r;
    });
    if (trace_file) kernels::write_chrome_trace(*trace_file, tracer.events());
  }
  if (rank != 0) return 0;
  const std::string mode = a.dp_replicate > 1 ? fmt::format("HSDP {}x{}", a.dp_replicate, a.dp_shard)
                                              : fmt::format("FSDP {}", a.dp_shard);
  fmt::print("{} on {} ({} blocks, dim {}, batch {} x {})\n\n", mode, a.backend, a.layers, a.dim, a.batch, a.seq);
  fmt::print("| layout | prefetch | step ms | compute ms | comm ms | exposed | peak bytes | copy bytes / step |\n"
             "|---|---|---|---|---|---|---|---|\n");
  std::string lines;
  for (const Row& r : rows) {
    const char* layout = layout_name(r.layout);
    if (!r.skipped.empty()) {
      fmt::print("| {} | skipped: {} | | | | | | |\n", layout, r.skipped);
      lines += nlohmann::json{{"mode", mode}, {"backend", a.backend}, {"layout", layout}, {"skipped", r.skipped}}.dump() + "\n";
      continue;
    }
    fmt::print("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.3f} | {} | {} |\n", layout, r.prefetch, r.step_ms, r.compute_ms,
               r.comm_ms, r.exposed, r.peak_bytes, r.copy_bytes);
    nlohmann::json j = {{"mode", mode},          {"backend", a.backend},       {"layout", layout},
                        {"prefetch", r.prefetch}, {"step_ms", r.step_ms},       {"compute_ms", r.compute_ms},
                        {"comm_ms", r.comm_ms},   {"exposed", r.exposed},       {"peak_bytes", r.peak_bytes},
                        {"copy_bytes_per_step", r.copy_bytes}};
    lines += j.dump() + "\n";
  }
  // contiguous / padded at each prefetch depth both measured.
  std::string ratios;
  for (const Row& p : rows)
    for (const Row& c : rows)
      if (p.skipped.empty() && c.skipped.empty() && p.layout == fsdp::Layout::kPadded &&
          c.layout == fsdp::Layout::kContiguous && p.prefetch == c.prefetch && p.step_ms > 0 && p.peak_bytes > 0) {
        const double step = c.step_ms / p.step_ms, peak = static_cast<double>(c.peak_bytes) / p.peak_bytes;
        // Paired: the median over rounds of the two steps' quotient in the same round (load drift cancels).
        std::vector<double> per_round;
        for (size_t i = 0; i < p.rounds.size() && i < c.rounds.size(); ++i)
          if (p.rounds[i] > 0) per_round.push_back(c.rounds[i] / p.rounds[i]);
        const double paired = median(per_round);
        ratios += fmt::format("contiguous / padded, prefetch {}: step time {:.3f} (paired by round {:.3f}), peak memory {:.3f}\n",
                              p.prefetch, step, paired, peak);
        lines += nlohmann::json{{"mode", mode},
                                {"backend", a.backend},
                                {"ratio", "contiguous/padded"},
                                {"prefetch", p.prefetch},
                                {"step_ratio", step},
                                {"step_ratio_paired", paired},
                                {"peak_ratio", peak}}
                     .dump() +
                 "\n";
      }
  if (!ratios.empty()) fmt::print("\n{}", ratios);
  if (a.host_cost) {
    int groups = 0;
    const double us = host_cost_us(a, &groups);
    fmt::print("\nhost time per group per step: {:.1f} us ({} groups, one rank, dim 16)\n", us, groups);
    lines += nlohmann::json{{"host_us_per_group_step", us}, {"groups", groups}}.dump() + "\n";
  }
  fmt::print("\n{}", lines);
  if (!a.json.empty()) std::ofstream(a.json) << lines;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Every exception leaves with its documented status and one line (program/main.h).
  return program::run("fsdp-bench", [&] { return run(argc, argv); });
}
