// fsdp-bench: FSDP / HSDP training steps of the small GPT split into what they cost, with
// prefetch 0, 1 and 2 measured in one run (rounds interleaved, medians over repeats):
//   step      forward + backward under fully_shard (unshard, prefetch, reduce-scatter included)
//   compute   the same forward + backward on replicated parameters with the same local batch
//             (no communication at all)
//   comm      the group transitions alone, in sequence: per group two unshards (forward and
//             backward all-gather + split-copy) and one flat gradient reduction (P -> S(0), HSDP
//             P,P -> R,S(0))
//   exposed   (step - compute) / comm: the share of communication not hidden behind compute
//   peak      rank 0's peak bytes (mesh + FSDP allocators)
// and, with --host-cost, FSDP's host time per group per step: (FSDP step - plain step) / groups
// on a one-rank mesh (collectives trivial) with a tiny model of many blocks.
//
//   fsdp-bench --backend local --dp-shard 4
//   fsdp-bench --backend local --dp-replicate 2 --dp-shard 2
//   mpirun -np 4 fsdp-bench --backend mpi --dp-shard 4
//   fsdp-bench --host-cost
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
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "collectives/mpi.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/error.h"
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
using kernels::DType;
using kernels::Tensor;

struct Args {
  std::string backend = "local";
  int dp_replicate = 1, dp_shard = 4;
  int64_t layers = 4, dim = 256, heads = 4, vocab = 512, seq = 64, batch = 16;
  int iters = 5, warmup = 1, threads = 0;
  std::vector<int> prefetch{0, 1, 2};
  bool host_cost = false;
  int host_layers = 32;
  std::string json;
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

struct Row {
  int prefetch;
  double step_ms, compute_ms, comm_ms, exposed;
  int64_t peak_bytes;
};

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
  // The three kinds count into `total`, whose peak is the largest sum live at one time.
  auto total = std::make_shared<nn::TrackingAllocator>();
  auto tracked = [&] { return std::make_shared<nn::TrackingAllocator>(std::make_shared<kernels::CachingAllocator>(), total); };
  auto mem = tracked(), unsharded = tracked(), buffers = tracked();
  auto comms = dtensor::MeshComms::create(mesh, world, {}, mem);
  const nn::GPTConfig cfg = config(a, a.layers, a.dim, a.heads);
  nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
  nn::materialize(model, 1);
  nn::GPT plain(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);  // replicated: compute alone
  nn::materialize(plain, 1);
  dtensor::ops::OpOptions ops;
  ops.num_threads = threads;
  nn::CrossEntropyLoss loss_fn;
  const Placements batch_pl(mesh.ndim(), dtensor::Shard{0});
  Tensor ids = Tensor::empty({a.batch, a.seq}, DType::kI64), tgt = Tensor::empty({a.batch, a.seq}, DType::kI64);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    ids.data<int64_t>()[i] = (i * 7 + 3) % a.vocab;
    tgt.data<int64_t>()[i] = (i * 5 + 1) % a.vocab;
  }
  const DTensor x = dtensor::distribute_tensor(ids, comms, batch_pl, std::nullopt);
  const DTensor y = dtensor::distribute_tensor(tgt, comms, batch_pl, std::nullopt);
  auto run_step = [&](nn::GPT& m) {
    nn::Ctx ctx(&ops), lctx(&ops);
    DTensor loss = loss_fn.forward(lctx, m.forward(ctx, x), y);
    m.backward(ctx, loss_fn.backward(lctx));
    m.zero_grad();
  };
  auto step = [&] { run_step(model); };
  auto compute_only = [&] { run_step(plain); };
  auto timed = [&](const std::function<void()>& fn) {
    world.wait(world.barrier());
    const double t0 = now();
    fn();
    world.wait(world.barrier());
    return now() - t0;
  };
  // Compute alone: replicated parameters, the local batch, no reduction.
  for (int i = 0; i < a.warmup; ++i) compute_only();
  std::vector<double> compute;

  fsdp::FullyShardOptions o;
  o.unsharded_allocator = unsharded;
  o.buffer_allocator = buffers;
  std::vector<fsdp::FSDPModule*> groups;
  for (const auto& [n, b] : model.blocks().children()) groups.push_back(&fsdp::fully_shard(*b, comms, o));
  fsdp::FSDPModule& root = fsdp::fully_shard(model, comms, o);
  groups.push_back(&root);
  // Communication alone: per group two unshards and one flat gradient reduction.
  std::vector<int> dp_dims;
  for (int d = 0; d < mesh.ndim(); ++d) dp_dims.push_back(d);
  auto dp = comms->slice_dims(dp_dims);
  auto dp_mesh = std::shared_ptr<const dtensor::DeviceMesh>(dp, &dp->mesh());
  Placements all_p(mesh.ndim(), dtensor::Partial{}), target(mesh.ndim(), dtensor::Replicate{});
  target.back() = dtensor::Shard{0};
  std::vector<DTensor> grads;
  for (fsdp::FSDPModule* g : groups) {
    const int64_t n = g->reduce_scatter_input_bytes() / 4;
    grads.emplace_back(dp, dtensor::make_spec(dp_mesh, all_p, Dims{n}, DType::kF32), Tensor::zeros({n}, DType::kF32));
  }
  auto comm_only = [&] {
    for (size_t i = 0; i < groups.size(); ++i) {
      for (int r = 0; r < 2; ++r) {
        groups[i]->unshard();
        groups[i]->reshard();
      }
      grads[i].redistribute(target);
    }
  };
  for (int i = 0; i < a.warmup; ++i) comm_only();
  std::vector<double> comm;

  auto set_prefetch = [&](int depth) {
    root.set_prefetch_depth(depth >= 1 ? 1 : 0);
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
  std::vector<std::vector<double>> steps(a.prefetch.size());
  std::vector<int64_t> peaks(a.prefetch.size(), 0);
  for (size_t k = 0; k < a.prefetch.size(); ++k) {  // warm every mode once
    set_prefetch(a.prefetch[k]);
    for (int i = 0; i < a.warmup + 1; ++i) step();  // + 1: the forward order is recorded
  }
  // Rounds interleave every measurement, so load drift hits all alike.
  for (int i = 0; i < a.iters; ++i) {
    compute.push_back(timed(compute_only));
    comm.push_back(timed(comm_only));
    for (size_t k = 0; k < a.prefetch.size(); ++k) {
      set_prefetch(a.prefetch[k]);
      step();  // the first step of a mode records its order
      total->reset_peak();
      steps[k].push_back(timed(step));
      peaks[k] = std::max(peaks[k], total->peak_bytes());
    }
  }
  std::vector<Row> rows;
  const double c = median(compute), m = median(comm);
  for (size_t k = 0; k < a.prefetch.size(); ++k) {
    const double s = median(steps[k]);
    rows.push_back({a.prefetch[k], s * 1e3, c * 1e3, m * 1e3, m > 0 ? (s - c) / m : 0, peaks[k]});
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
  app.add_flag("--host-cost", a.host_cost, "also FSDP's host time per group per step (one rank)");
  app.add_option("--host-layers", a.host_layers, "blocks of the host-cost model");
  app.add_option("--json", a.json, "also write the JSON lines here");
  program::parse(app, argc, argv);  // --help: exit 0; a bad option: one line, exit 2
  for (int p : a.prefetch)
    if (p < 0 || p > 2) throw kernels::InvalidArgument(fmt::format("--prefetch {}: expected 0, 1 or 2", p));
  if (a.backend != "local" && a.backend != "mpi")
    throw kernels::InvalidArgument(fmt::format("--backend {}: expected local or mpi", a.backend));
  const int world_size = a.dp_replicate * a.dp_shard;
  std::vector<Row> rows;
  int rank = 0;
  std::unique_ptr<collectives::MpiWorld> mpi;
  if (a.backend == "mpi") {
    mpi = std::make_unique<collectives::MpiWorld>(&argc, &argv);
    auto w = mpi->communicator();
    rank = w->rank();
    if (w->size() != world_size)
      throw kernels::InvalidArgument(fmt::format("mpirun started {} processes for {} x {} ranks", w->size(),
                                                 a.dp_replicate, a.dp_shard));
    rows = measure(*w, a, a.threads > 0 ? a.threads : 1);
  } else {
    const int hw = std::max(1u, std::thread::hardware_concurrency());
    collectives::run_ranks(world_size, [&](Communicator& w) {
      auto r = measure(w, a, a.threads > 0 ? a.threads : std::max(1, hw / world_size));
      if (w.rank() == 0) rows = r;
    });
  }
  if (rank != 0) return 0;
  const std::string mode = a.dp_replicate > 1 ? fmt::format("HSDP {}x{}", a.dp_replicate, a.dp_shard)
                                              : fmt::format("FSDP {}", a.dp_shard);
  fmt::print("{} on {} ({} blocks, dim {}, batch {} x {})\n\n", mode, a.backend, a.layers, a.dim, a.batch, a.seq);
  fmt::print("| prefetch | step ms | compute ms | comm ms | exposed | peak bytes |\n|---|---|---|---|---|---|\n");
  std::string lines;
  for (const Row& r : rows) {
    fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} | {:.3f} | {} |\n", r.prefetch, r.step_ms, r.compute_ms, r.comm_ms,
               r.exposed, r.peak_bytes);
    nlohmann::json j = {{"mode", mode},          {"backend", a.backend},   {"prefetch", r.prefetch},
                        {"step_ms", r.step_ms},  {"compute_ms", r.compute_ms}, {"comm_ms", r.comm_ms},
                        {"exposed", r.exposed},  {"peak_bytes", r.peak_bytes}};
    lines += j.dump() + "\n";
  }
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
