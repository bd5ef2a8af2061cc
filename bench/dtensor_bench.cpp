// dtensor-bench: nccl-tests-style sweep of placement transitions. For each transition and global
// tensor size it times DTensor::redistribute (cached plan, the real API call) and, in the same
// iterations, the raw collective: the engine's own collective(s) on preallocated buffers of the
// same bytes, without the DTensor layer. overhead = ours / raw.
//
//   dtensor-bench --backend local --world 8                       # the default suite, 1K:256M
//   dtensor-bench --backend local --world 4 --mesh 2x2 --from 'S(0),S(1)' --to 'S(1),S(0)'
//   mpirun --allow-run-as-root --oversubscribe -np 4 dtensor-bench --backend mpi --sizes 1K:64M
//   dtensor-bench --host-cost                                       # framework cost per call, 1-8 ranks
//   dtensor-bench --world 2 --from "S(0)" --to R --sizes 64K --trace t.json  # a Chrome trace
//   dtensor-bench --moe-dispatch --world 4 --sizes 64K:16M        # MoE dispatch/combine vs all_to_all_v
//
// Definitions (bench/README.md has the full table):
//   bytes       the global tensor (a Partial source: every rank holds a full-size partial)
//   time        per iteration, the max over ranks of (barrier; redistribute); median, min, max
//   algbw       bytes / time
//   busbw       lower_bound_bytes / time: what the busiest rank must receive at least, per second
//               (nccl-tests' bus bandwidth for the single-collective transitions)
//   recv/rank   bytes the plan makes the busiest rank receive; lower_bnd: the least any plan can
//   raw         per communicating step of the plan, the canonical collective on that mesh dim's
//               group (all_gather, all_to_all, reduce_scatter, all_reduce) on buffers sized by
//               the largest local shard before the step, run back to back
// Exit status (program/main.h): 0 ok, 1 a rank's result did not match, 2 invalid input (sizes at
// most 1T, at most 4096 of them; --world <= 1024), 3 out of memory, 4 a communication failure or
// timeout (--timeout-ms), each failure one line on stderr naming the value or the rank.
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/dtensor_bench.h"
#include "program/cli.h"
#include "program/main.h"
#include "collectives/communicator.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/nccl.h"
#include "collectives/trace.h"
#include "dtensor/dtensor.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/plan/planner.h"
#include "kernels/device.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "kernels/tensor.h"
#include "kernels/trace.h"

namespace {

using namespace dtensor_bench;
using bench::human_bytes;
using bench::stats_of;
using collectives::Communicator;
using collectives::Milliseconds;
using dtensor::DeviceMesh;
using dtensor::DTensor;
using kernels::Device;
using kernels::ReduceOp;
using kernels::Tensor;

// ---------------------------------------------------------------------------------------------
// Transitions (Case: dtensor_bench.h)

// The mesh a suite uses for placement lists of `ndim` mesh dims on `world` ranks, or nullopt
// when the world does not factor that way (2-D: (2, n/2), n even >= 4; 3-D: (2, 2, n/4),
// n % 4 == 0 and n >= 8).
std::optional<Dims> suite_mesh(int ndim, int world) {
  if (ndim == 1) return Dims{world};
  if (ndim == 2 && world >= 4 && world % 2 == 0) return Dims{2, world / 2};
  if (ndim == 3 && world >= 8 && world % 4 == 0) return Dims{2, 2, world / 4};
  return std::nullopt;
}

Case make_case(const Dims& mesh_shape, std::string src, std::string dst) {
  Case c{mesh_shape, dtensor::parse_placements(src), dtensor::parse_placements(dst), "", ""};
  if (c.src.size() != static_cast<size_t>(mesh_shape.size()) || c.dst.size() != static_cast<size_t>(mesh_shape.size()))
    throw kernels::InvalidArgument(fmt::format("transition {}->{}: {} and {} placements for a mesh of {} dims ({})",
                                               src, dst, c.src.size(), c.dst.size(), mesh_shape.size(),
                                               mesh_text(mesh_shape)));
  c.src_text = dtensor::to_string(c.src);
  c.dst_text = dtensor::to_string(c.dst);
  return c;
}

// A RaggedShard over k ranks: units 1,2,0,1,2,0,... (uneven, one empty range in three) with
// alignment `align`, or all 1 with align 1 (a rebalance's target).
std::string ragged_units(int64_t k, int64_t align) {
  std::vector<int64_t> units;
  for (int64_t i = 0; i < k; ++i) units.push_back(align == 1 ? 1 : (i % 3 == 2 ? 0 : i % 3 + 1));
  return fmt::format("Rg(0,[{}],{})", fmt::join(units, ","), align);
}

// The representative set (docs/pytorch-semantics.md sections 3 and 6.2): every single-mesh-dim
// collective, the StridedShard pair, and 2-D / 3-D pairs of PyTorch's redistribute tests.
// "single" keeps the 1-D entries only.
std::vector<Case> suite_cases(const Options& opt, int world) {
  std::optional<Dims> given;
  if (!opt.mesh_text.empty()) {
    const DeviceMesh mesh = DeviceMesh::parse(opt.mesh_text);
    if (mesh.size() > world)
      throw kernels::InvalidArgument(fmt::format("--mesh {} has {} ranks, the world has {}",
                                                 kernels::clip(opt.mesh_text), mesh.size(), world));
    given = mesh.shape();
  }
  auto mesh_for = [&](int ndim) -> std::optional<Dims> {
    if (given) return given->size() == ndim ? given : std::nullopt;
    return suite_mesh(ndim, world);
  };
  std::vector<Case> out;
  if (!opt.from.empty() || !opt.to.empty()) {
    if (opt.from.empty() || opt.to.empty()) throw kernels::InvalidArgument("--from and --to go together");
    const int ndim = static_cast<int>(dtensor::parse_placements(opt.from).size());
    const std::optional<Dims> m = mesh_for(ndim);
    if (!m)
      throw kernels::InvalidArgument(fmt::format(
          "--from '{}' has {} placements: give --mesh with {} dims{}", opt.from, ndim, ndim,
          given ? fmt::format(" (--mesh {} has {})", opt.mesh_text, given->size()) : ""));
    out.push_back(make_case(*m, opt.from, opt.to));
    return out;
  }
  if (opt.suite != "default" && opt.suite != "single")
    throw kernels::InvalidArgument(fmt::format("--suite '{}': expected default or single", opt.suite));
  if (auto m = mesh_for(1)) {
    for (auto [s, d] : {std::pair{"S(0)", "R"}, {"R", "S(0)"}, {"P", "R"}, {"P", "S(0)"}, {"S(0)", "S(1)"}})
      out.push_back(make_case(*m, s, d));
    // RaggedShard (FSDP's flat buffers): unshard, gradient reduce-scatter, rebalance.
    const std::string u = ragged_units((*m)[0], 4), v = ragged_units((*m)[0], 1);
    for (auto [s, d] : {std::pair{u, std::string("R")}, {"P", u}, {u, v}}) out.push_back(make_case(*m, s, d));
  }
  if (opt.suite == "single") return out;
  if (auto m = mesh_for(2)) {
    const std::string strided = fmt::format("_S(0,{}),S(0)", (*m)[1]);
    out.push_back(make_case(*m, "S(0),S(0)", strided));
    out.push_back(make_case(*m, strided, "S(0),S(0)"));
    out.push_back(make_case(*m, "S(0),R", "R,R"));        // FSDP unshard on the dp dim (2-D)
    out.push_back(make_case(*m, "P,S(0)", "R,S(0)"));     // HSDP: reduce across replicas
    out.push_back(make_case(*m, "P,P", "R," + ragged_units((*m)[1], 4)));  // HSDP's flat gradient reduce
    out.push_back(make_case(*m, "S(0),S(1)", "S(0),S(0)"));
    out.push_back(make_case(*m, "S(0),S(1)", "S(1),S(0)"));
    out.push_back(make_case(*m, "S(0),S(0)", "S(1),S(1)"));
  }
  if (auto m = mesh_for(3)) {
    out.push_back(make_case(*m, "S(0),S(0),S(0)", "S(1),S(1),S(1)"));
    out.push_back(make_case(*m, "S(0),S(1),S(0)", "S(1),S(0),S(0)"));
    out.push_back(make_case(*m, "S(0),S(1),S(2)", "S(2),S(1),S(0)"));
    out.push_back(make_case(*m, "S(1),S(0),S(0)", "R,S(0),S(0)"));
  }
  if (out.empty())
    throw kernels::InvalidArgument(fmt::format("--suite {} has no transition for --mesh {}", opt.suite, opt.mesh_text));
  return out;
}

int max_shard_dim(const Placements& ps) {
  int d = -1;
  for (const dtensor::Placement& p : ps) {
    if (const auto* s = std::get_if<dtensor::Shard>(&p)) d = std::max(d, s->dim);
    if (const auto* s = std::get_if<dtensor::StridedShard>(&p)) d = std::max(d, s->dim);
  }
  return d;
}

// A global shape of about `bytes` for a transition: as many dims as it shards (at least 2),
// power-of-two trailing dims as equal as possible, the leading dim taking the rest.
Dims shape_for(const Case& c, int64_t bytes, DType dtype) {
  const int ndim = std::max({2, max_shard_dim(c.src) + 1, max_shard_dim(c.dst) + 1});
  const int64_t numel = std::max<int64_t>(1, bytes / static_cast<int64_t>(kernels::itemsize(dtype)));
  const int log2n = static_cast<int>(std::floor(std::log2(static_cast<double>(numel))));
  const int64_t trailing = int64_t{1} << (log2n / ndim);
  Dims shape;
  int64_t rest = numel;
  for (int d = 1; d < ndim; ++d) rest /= trailing;
  shape.push_back(std::max<int64_t>(rest, 1));
  for (int d = 1; d < ndim; ++d) shape.push_back(trailing);
  return shape;
}

// ---------------------------------------------------------------------------------------------
// The raw collectives of a plan

// The canonical collective of each communicating step, sized by the largest local shard of
// any rank before the step (the padded buffers PyTorch and a hand-written trainer would use).
std::vector<RawOp> raw_ops(const dtensor::Plan& plan, const dtensor::DTensorSpec& src) {
  std::vector<RawOp> ops;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    if (!plan.communicating[i]) continue;
    const dtensor::Step& step = plan.steps[i];
    const int m = dtensor::mesh_dim_of(step);
    const int64_t k = src.mesh->size(m);
    int64_t largest = 0;
    for (int rank : src.mesh->ranks())
      largest = std::max(largest, dtensor::compute_layout(src.shape, src.mesh->shape(), plan.states[i],
                                                          *src.mesh->coord_of(rank))
                                      .local_shape.product());
    const int64_t padded = (largest + k - 1) / k * k;
    RawOp op{RawKind::kAllGather, m, k, largest, k * largest};
    std::visit(
        [&](const auto& s) {
          using T = std::decay_t<decltype(s)>;
          if constexpr (std::is_same_v<T, dtensor::AllToAll> || std::is_same_v<T, dtensor::Regroup>)
            op = {RawKind::kAllToAll, m, k, padded, padded};
          else if constexpr (std::is_same_v<T, dtensor::ReduceScatter>)
            op = {RawKind::kReduceScatter, m, k, padded, padded / k};
          else if constexpr (std::is_same_v<T, dtensor::AllReduce>)
            op = {RawKind::kAllReduce, m, k, largest, largest};
        },
        step);
    ops.push_back(op);
  }
  return ops;
}

struct RawBuffers {
  std::vector<std::pair<Tensor, Tensor>> io;
};

RawBuffers allocate_raw(const std::vector<RawOp>& ops, DType dtype, Device device) {
  RawBuffers b;
  for (const RawOp& op : ops) {
    Tensor in = Tensor::zeros({op.in}, dtype, device);
    Tensor out = Tensor::zeros({op.out}, dtype, device);
    b.io.emplace_back(in, out);
  }
  return b;
}

void run_raw(const std::vector<RawOp>& ops, RawBuffers& b, const dtensor::MeshComms& comms) {
  for (size_t i = 0; i < ops.size(); ++i) {
    Communicator& c = comms.dim(ops[i].mesh_dim);
    const auto& [in, out] = b.io[i];
    switch (ops[i].kind) {
      case RawKind::kAllGather: c.wait(c.all_gather(in, out)); break;
      case RawKind::kAllToAll: c.wait(c.all_to_all(in, out)); break;
      case RawKind::kReduceScatter: c.wait(c.reduce_scatter(in, out, ReduceOp::kSum)); break;
      case RawKind::kAllReduce: c.wait(c.all_reduce(in, out, ReduceOp::kSum)); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Source tensors and the check

bool has_partial(const Case& c) { return std::any_of(c.src.begin(), c.src.end(), dtensor::is_partial); }

// The product of the sizes of the P(sum) mesh dims: what a partial sum must be divided by.
int64_t partial_group(const Case& c) {
  int64_t k = 1;
  for (size_t m = 0; m < c.src.size(); ++m)
    if (const auto* p = std::get_if<dtensor::Partial>(&c.src[m]); p && p->op == ReduceOp::kSum)
      k *= c.mesh_shape[m];
  return k;
}

// Values are a function of (seed, global index) (dtensor::rand). A Partial source holds the
// value on every rank, divided by the group size for P(sum) (avg, min and max of equal values
// are the value), so the reduced tensor is the same values.
DTensor make_source(const Case& c, const Dims& shape, DType dtype, Device device,
                    const std::shared_ptr<const dtensor::MeshComms>& comms) {
  constexpr uint64_t kSeed = 5;
  Placements no_partial = c.src;
  for (auto& p : no_partial)
    if (dtensor::is_partial(p)) p = dtensor::Replicate{};
  DTensor base = dtensor::rand(shape, kSeed, dtype, comms, no_partial);
  Tensor local = base.to_local();
  if (!device.is_cpu()) local = local.to(device);
  if (partial_group(c) > 1) kernels::scale_(local, 1.0 / static_cast<double>(partial_group(c)));
  if (!device.is_cpu() || has_partial(c)) return dtensor::from_local(local, comms, c.src, shape, base.stride());
  return base;
}

// True when this rank's shard of `got` is the expected shard of the same global values.
bool check_result(const Case& c, const DTensor& got, const std::shared_ptr<const dtensor::MeshComms>& comms) {
  if (!comms->in_mesh()) return true;
  const DTensor want = dtensor::rand(got.shape(), 5, got.dtype(), comms, c.dst);
  Tensor mine = got.to_local();
  if (!mine.device().is_cpu()) mine = mine.to(Device::cpu());
  if (!has_partial(c)) return kernels::equal(mine, want.to_local());  // moved, never rounded
  const bool low = got.dtype() == DType::kBF16 || got.dtype() == DType::kF16;
  return kernels::allclose(mine, want.to_local(), low ? 2e-2 : 1e-5, low ? 1e-2 : 1e-6);
}

// ---------------------------------------------------------------------------------------------
// One row

// What a rank needs to run the sweep: the world (barriers, statistics) and the communicators
// of each mesh it meets, created in suite order on every rank.
struct Env {
  Communicator& world;
  Device device;
  const Options& opt;
  std::map<std::string, std::shared_ptr<const dtensor::MeshComms>> meshes;
  std::function<void(const Case&)> on_case;  // reporting rank only
  std::function<void(const Row&)> on_row;

  std::shared_ptr<const dtensor::MeshComms> comms_for(const Dims& shape) {
    const std::string key = mesh_text(shape);
    auto it = meshes.find(key);
    if (it != meshes.end()) return it->second;
    const DeviceMesh mesh = DeviceMesh::from_shape(shape);
    if (mesh.size() > world.size())
      throw kernels::InvalidArgument(fmt::format("mesh {} needs {} ranks, the world has {}", key,
                                                 mesh.size(), world.size()));
    auto comms = std::make_shared<const dtensor::MeshComms>(mesh, world);
    meshes.emplace(key, comms);
    return comms;
  }
};

Row run_one(Env& env, const Case& c, int64_t requested_bytes) {
  const Options& opt = env.opt;
  auto comms = env.comms_for(c.mesh_shape);
  const Dims shape = shape_for(c, requested_bytes, opt.dtype);
  const int64_t item = static_cast<int64_t>(kernels::itemsize(opt.dtype));
  const dtensor::RedistributeOptions ropt{opt.planner};

  DTensor x = make_source(c, shape, opt.dtype, env.device, comms);
  const dtensor::Plan& plan = x.plan_to(c.dst, ropt);
  const dtensor::DTensorSpec& spec = x.spec();

  Row row;
  row.transition = c.name();
  row.src = c.src_text;
  row.dst = c.dst_text;
  row.mesh = mesh_text(c.mesh_shape);
  row.mesh_shape = c.mesh_shape;
  row.shape = shape;
  row.bytes = shape.product() * item;
  row.route = dtensor::to_string(plan);
  row.collectives = plan.collectives();
  row.single_mesh_dim = single_mesh_dim(c);
  for (int rank : spec.mesh->ranks())
    row.local_bytes = std::max(row.local_bytes, spec.layout(rank)->local_shape.product() * item);
  row.bytes_per_rank = plan.traffic.max_received();
  row.lower_bound = dtensor::lower_bound_traffic(spec, plan.on_view() ? plan.user_dst : plan.dst).max_received();
  row.raw_ops = raw_ops(plan, spec);
  row.has_raw = !row.raw_ops.empty();
  for (const RawOp& op : row.raw_ops)
    row.raw_text += fmt::format("{}{}({})", row.raw_text.empty() ? "" : " + ", raw_name(op.kind), op.mesh_dim);
  row.iters = opt.iters;
  row.warmup = opt.warmup;

  RawBuffers raw = allocate_raw(row.raw_ops, opt.dtype, env.device);
  std::vector<double> ours, base;
  Communicator& world = env.world;
  // --trace: each measured call as a span on the rank's "compute" lane.
  kernels::Tracer* const tracer = world.tracer();
  const std::string ours_name = tracer != nullptr ? "redistribute " + row.transition : std::string();
  const std::string raw_name = tracer != nullptr ? "raw " + row.raw_text : std::string();
  for (int it = 0; it < opt.warmup + opt.iters; ++it) {
    const bool timed = it >= opt.warmup;
    world.wait(world.barrier());
    double t0 = bench::now_us(), t1 = 0;
    {
      const kernels::TraceSpan span(tracer, world.global_rank(), "compute", ours_name);
      const DTensor y = x.redistribute(c.dst, ropt);
      t1 = bench::now_us();
    }  // the result is released outside the timed region
    if (timed) ours.push_back(t1 - t0);
    if (row.has_raw && comms->in_mesh()) {
      world.wait(world.barrier());
      t0 = bench::now_us();
      const kernels::TraceSpan span(tracer, world.global_rank(), "compute", raw_name);
      run_raw(row.raw_ops, raw, *comms);
      t1 = bench::now_us();
      if (timed) base.push_back(t1 - t0);
    } else if (row.has_raw) {
      world.wait(world.barrier());
      if (timed) base.push_back(0);
    }
  }
  raw = RawBuffers();

  if (opt.check) {
    const bool ok = check_result(c, x.redistribute(c.dst, ropt), comms);
    row.wrong = static_cast<int64_t>(bench::reduce_over_ranks(world, {ok ? 0.0 : 1.0}, ReduceOp::kSum)[0]);
  }

  // One all_reduce(max) over the ranks of every iteration's times.
  std::vector<double> v = ours;
  v.insert(v.end(), base.begin(), base.end());
  v = bench::reduce_over_ranks(world, v, ReduceOp::kMax);
  row.time = stats_of({v.begin(), v.begin() + static_cast<long>(ours.size())});
  if (row.has_raw) {
    row.raw = stats_of({v.begin() + static_cast<long>(ours.size()), v.end()});
    row.overhead = row.raw.median_us > 0 ? row.time.median_us / row.raw.median_us : 0;
  }
  const double t_s = row.time.median_us * 1e-6;
  row.algbw = t_s > 0 ? static_cast<double>(row.bytes) / t_s / 1e9 : 0;
  row.busbw = t_s > 0 ? static_cast<double>(row.lower_bound) / t_s / 1e9 : 0;
  return row;
}

std::vector<Row> run_sweep(Env& env, const std::vector<Case>& cases) {
  std::vector<Row> rows;
  for (const Case& c : cases) {
    if (env.on_case) env.on_case(c);
    for (int64_t s : env.opt.size_list) {
      rows.push_back(run_one(env, c, s));
      if (env.on_row) env.on_row(rows.back());
    }
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Host cost: a cached-plan S(0) -> R of a tiny tensor on N local ranks, which really communicates
// (one all_gather), against the same all_gather called directly on preallocated buffers of the
// same bytes, in the same run. framework = redistribute - raw: what the DTensor layer (plan
// lookup, issue, result DTensor) costs on top of the engine.

// The tiny global tensor of --host-cost on n ranks: 8x4 f32 (128 bytes) when n divides 8, else
// (2n)x4, so every rank holds whole equal rows and the all_gather runs straight into the result.
Dims host_shape(int n) { return Dims{8 % n == 0 ? 8 : 2 * n, 4}; }

HostRow run_host_cost(Env& env) {
  const Options& opt = env.opt;
  Communicator& world = env.world;
  const int n = world.size();
  const Case c = make_case({n}, "S(0)", "R");
  auto comms = env.comms_for(c.mesh_shape);
  const Dims shape = host_shape(n);
  const dtensor::RedistributeOptions ropt{opt.planner};
  DTensor x = make_source(c, shape, opt.dtype, env.device, comms);
  (void)x.plan_to(c.dst, ropt);  // cached from here on
  HostRow r;
  r.transition = c.name();
  r.mesh = mesh_text(c.mesh_shape);
  r.world = n;
  r.shape = shape;
  r.bytes = shape.product() * static_cast<int64_t>(kernels::itemsize(opt.dtype));
  r.calls = opt.host_calls;
  r.repeats = std::max(opt.iters, 1);
  Communicator& group = comms->dim(0);
  const Tensor in = x.to_local().contiguous().view({x.to_local().numel()});
  const Tensor out = Tensor::empty({in.numel() * n}, opt.dtype, env.device);
  std::vector<double> ours, raw;
  for (int rep = 0; rep < opt.warmup + r.repeats; ++rep) {
    const bool timed = rep >= opt.warmup;
    world.wait(world.barrier());
    double t0 = bench::now_us();
    for (int i = 0; i < r.calls; ++i) {
      DTensor y = x.redistribute(c.dst, ropt);
      if (y.to_local().numel() < 0) std::abort();  // keeps the call observable
    }
    double t1 = bench::now_us();
    if (timed) ours.push_back((t1 - t0) / r.calls);
    world.wait(world.barrier());
    t0 = bench::now_us();
    for (int i = 0; i < r.calls; ++i) group.wait(group.all_gather(in, out));
    t1 = bench::now_us();
    if (timed) raw.push_back((t1 - t0) / r.calls);
  }
  if (opt.check) {
    const bool ok = check_result(c, x.redistribute(c.dst, ropt), comms);
    if (bench::reduce_over_ranks(world, {ok ? 0.0 : 1.0}, ReduceOp::kSum)[0] > 0)
      throw kernels::InternalError("--host-cost: the redistributed tensor is wrong on some rank");
  }
  std::vector<double> v = ours;
  v.insert(v.end(), raw.begin(), raw.end());
  v = bench::reduce_over_ranks(world, v, ReduceOp::kMax);
  r.per_call = stats_of({v.begin(), v.begin() + static_cast<long>(ours.size())});
  r.raw = stats_of({v.begin() + static_cast<long>(ours.size()), v.end()});
  r.framework_us = r.per_call.median_us - r.raw.median_us;
  return r;
}

// ---------------------------------------------------------------------------------------------
// Overlap: per transition and size, the transition alone (issued with redistribute_async and
// waited at once), a stand-in for compute alone (a sleep of the transition's median time: it uses
// no CPU, as GPU kernels or a wait for data would not), and both: the transition issued
// asynchronously, the compute, then the wait. exposed = (overlapped - compute) / comm: the share
// of the transition the compute did not hide (0 when fully hidden, 1 when not at all).

// Sets the calling thread's timer slack to 1 ns for its lifetime (Linux; elsewhere: nothing), so
// the compute stand-in's sleeps last what they are asked (NOTE [overlap conditions]).
class TimerSlack {
 public:
  TimerSlack() {
#ifdef __linux__
    const int old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (old > 0 && prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0) == 0) old_ = old;
#endif
  }
  ~TimerSlack() {
#ifdef __linux__
    if (old_ > 0) (void)prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_), 0, 0, 0);
#endif
  }
  TimerSlack(const TimerSlack&) = delete;
  TimerSlack& operator=(const TimerSlack&) = delete;

 private:
  int old_ = 0;
};

OverlapRow run_overlap_one(Env& env, const Case& c, int64_t requested_bytes) {
  const Options& opt = env.opt;
  auto comms = env.comms_for(c.mesh_shape);
  const Dims shape = shape_for(c, requested_bytes, opt.dtype);
  const int64_t item = static_cast<int64_t>(kernels::itemsize(opt.dtype));
  const dtensor::RedistributeOptions ropt{opt.planner};
  DTensor x = make_source(c, shape, opt.dtype, env.device, comms);
  const dtensor::Plan& plan = x.plan_to(c.dst, ropt);
  OverlapRow row;
  row.transition = c.name();
  row.src = c.src_text;
  row.dst = c.dst_text;
  row.mesh = mesh_text(c.mesh_shape);
  row.mesh_shape = c.mesh_shape;
  row.shape = shape;
  row.bytes = shape.product() * item;
  row.route = dtensor::to_string(plan);
  row.collectives = plan.collectives();
  row.iters = opt.iters;
  for (int rank : x.spec().mesh->ranks())
    row.local_bytes = std::max(row.local_bytes, x.spec().layout(rank)->local_shape.product() * item);
  Communicator& world = env.world;
  auto timed = [&](const std::function<void()>& body) {
    world.wait(world.barrier());
    const double t0 = bench::now_us();
    body();
    return bench::now_us() - t0;
  };
  auto transition = [&] { (void)dtensor::redistribute_async(x, c.dst, ropt).wait(); };
  auto sleep_us = [](double us) { std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(us)); };
  // NOTE [overlap conditions] The overlapped transition always follows an idle spell (the
  // compute stand-in sleeps), and on the machine of RESULTS.md a copy that follows an idle
  // spell runs up to 1.3x (after 0.3 ms) to 3x (after 1 ms) slower than one right after another
  // (power management of the idle vCPUs): timed back to back, `comm` was the warm time and
  // `exposed` charged the cold start to the overlap. So `comm` is timed after an idle spell of
  // the compute's length too: first the transition back to back (its median, max over ranks:
  // the first guess of the compute's length), then after such spells (their median is the
  // compute's length, the same on every rank), then iters times: the compute alone, the
  // transition alone and both overlapped, the latter two each right after a compute-long spell.
  // The compute's length follows the transition through that loop: it is the median of the
  // latest `iters` after-idle transitions (max over ranks; the calibration ones, then the loop's
  // own), so a machine whose speed drifts between the calibration and the loop (runs on our
  // shared VMs moved by 20-60% within a row) does not leave `compute` shorter or longer than
  // `comm`, which `exposed` would count as exposure or hide.
  // The sleeps run with a timer slack of 1 ns (TimerSlack): with Linux's default 50 us, a sleep
  // overran by a median 66 us on our 2-vCPU VM (28 us with 1 ns: the timer's own wake-up), so at
  // the rows where comm < 1 ms the compute was up to 2x the transition it stood in for, and
  // `exposed` there counted the overrun as hidden transition (local 2 ranks: 9-11 of 14 rows
  // within 0.10 before, 6-8 after; recorded in commit bd305d9).
  const TimerSlack precise_sleeps;  // NOTE [overlap conditions]: the sleeps last what they are asked
  for (int it = 0; it < opt.warmup; ++it) (void)timed(transition);
  std::vector<double> warm;
  for (int it = 0; it < opt.iters; ++it) warm.push_back(timed(transition));
  const double guess = bench::median(bench::reduce_over_ranks(world, warm, ReduceOp::kMax));  // same on every rank
  std::vector<double> after_idle;
  for (int it = 0; it < opt.iters; ++it) {
    sleep_us(guess);
    after_idle.push_back(timed(transition));
  }
  std::deque<double> recent;  // the latest after-idle transitions, max over ranks (same on every rank)
  for (double v : bench::reduce_over_ranks(world, after_idle, ReduceOp::kMax)) recent.push_back(v);
  double compute_target = bench::median({recent.begin(), recent.end()});
  const auto compute = [&] { sleep_us(compute_target); };
  std::vector<double> comm, alone, both, issue;
  for (int it = 0; it < opt.iters; ++it) {
    alone.push_back(timed(compute));  // also the idle spell before comm
    comm.push_back(timed(transition));
    recent.pop_front();
    recent.push_back(bench::reduce_over_ranks(world, {comm.back()}, ReduceOp::kMax)[0]);
    sleep_us(compute_target);
    both.push_back(timed([&] {
      const double t = bench::now_us();
      dtensor::RedistributeHandle h = dtensor::redistribute_async(x, c.dst, ropt);
      issue.push_back(bench::now_us() - t);
      compute();
      (void)h.wait();
    }));
    compute_target = bench::median({recent.begin(), recent.end()});
  }
  if (opt.check) {
    dtensor::RedistributeHandle h = dtensor::redistribute_async(x, c.dst, ropt);
    compute();
    const bool ok = check_result(c, h.wait(), comms);
    row.wrong = static_cast<int64_t>(bench::reduce_over_ranks(world, {ok ? 0.0 : 1.0}, ReduceOp::kSum)[0]);
  }
  std::vector<double> v = alone;
  v.insert(v.end(), both.begin(), both.end());
  v.insert(v.end(), comm.begin(), comm.end());
  v.insert(v.end(), issue.begin(), issue.end());
  v = bench::reduce_over_ranks(world, v, ReduceOp::kMax);
  const auto n = static_cast<long>(alone.size());
  row.compute = stats_of({v.begin(), v.begin() + n});
  row.overlapped = stats_of({v.begin() + n, v.begin() + 2 * n});
  row.comm = stats_of({v.begin() + 2 * n, v.begin() + 3 * n});
  row.issue = stats_of({v.begin() + 3 * n, v.end()});
  row.comm_warm_us = guess;
  row.exposed = row.comm.median_us > 0 ? (row.overlapped.median_us - row.compute.median_us) / row.comm.median_us : 0;
  return row;
}

// ---------------------------------------------------------------------------------------------
// Backends: every rank runs the same sweep; the reporting rank prints and writes the JSON.

struct Result {
  std::vector<Row> rows;
  std::vector<HostRow> host;
  std::vector<OverlapRow> overlap;
  int64_t wrong() const {
    int64_t w = 0;
    for (const Row& r : rows) w += std::max<int64_t>(r.wrong, 0);
    for (const OverlapRow& r : overlap) w += std::max<int64_t>(r.wrong, 0);
    return w;
  }
};

Result run_rank(Env& env, Printer* printer, const std::vector<Case>& cases) {
  Result res;
  if (env.opt.overlap) {
    for (const Case& c : cases) {
      if (printer) printer->overlap_section(c);
      for (int64_t size : env.opt.size_list) {
        res.overlap.push_back(run_overlap_one(env, c, size));
        if (printer) printer->overlap_row(res.overlap.back());
      }
    }
    return res;
  }
  if (printer) {
    env.on_case = [printer](const Case& c) { printer->section(c); };
    env.on_row = [printer](const Row& r) { printer->row(r); };
  }
  res.rows = run_sweep(env, cases);
  return res;
}

void print_header(const Options& opt, const Printer& printer) {
  if (opt.overlap) printer.overlap_header();
  else printer.header();
}

int64_t finish(const Options& opt, const Printer& printer, const std::string& desc, int world, const Result& res) {
  if (opt.overlap) printer.overlap_footer(res.overlap);
  else printer.footer(res.rows);
  if (!opt.json_path.empty()) write_json(opt, desc, world, res.rows, res.host, res.overlap);
  return res.wrong();
}

// --host-cost: one local world per N (1, 2, 4, 8, or the --world given).
void run_host_costs(const Options& opt) {
  const std::vector<int> worlds = opt.world_given ? std::vector<int>{opt.world} : std::vector<int>{1, 2, 4, 8};
  Printer printer(opt, "local", worlds.back());
  printer.host_header();
  std::vector<HostRow> rows;
  for (int n : worlds) {
    HostRow row;
    collectives::run_ranks(
        n,
        [&](Communicator& world) {
          Env env{world, Device::cpu(), opt, {}, {}, {}};
          HostRow mine = run_host_cost(env);
          if (world.rank() == 0) row = std::move(mine);
        },
        Milliseconds{opt.timeout_ms});
    printer.host_row(row);
    rows.push_back(row);
  }
  printer.host_footer(rows);
  if (!opt.json_path.empty())
    write_json(opt, fmt::format("local (ranks as threads, {} hardware threads)", std::thread::hardware_concurrency()),
               worlds.back(), {}, rows);
}

// --trace's file, made before any rank starts: a path that cannot be written is exit 2 naming it.
kernels::File create_trace_file(const std::string& path) {
  try {
    return kernels::File::create(path);
  } catch (const kernels::InvalidArgument& e) {
    throw kernels::InvalidArgument(fmt::format("--trace {}: {}", path, e.what()));
  }
}

int64_t run_local(const Options& opt) {
  const int n = opt.world;
  kernels::Tracer tracer;
  std::optional<kernels::File> trace_file;
  if (!opt.trace_path.empty()) trace_file = create_trace_file(opt.trace_path);
  const std::vector<Case> cases = suite_cases(opt, n);
  const std::string desc = fmt::format("local ({} ranks as threads, {} hardware threads)", n,
                                       std::thread::hardware_concurrency());
  Printer printer(opt, desc, n);
  print_header(opt, printer);
  Result res;
  collectives::run_ranks(
      n,
      [&](Communicator& world) {
        program::on_rank(world.rank(), [&] {
          if (trace_file) world.set_tracer(&tracer);
          Env env{world, Device::cpu(), opt, {}, {}, {}};
          Result mine = run_rank(env, world.rank() == 0 ? &printer : nullptr, cases);
          if (world.rank() == 0) res = std::move(mine);
        });
      },
      Milliseconds{opt.timeout_ms});
  if (trace_file) kernels::write_chrome_trace(*trace_file, tracer.events());
  return finish(opt, printer, desc, n, res);
}

int64_t run_mpi_rank(const Options& opt, collectives::MpiWorld& mpi) {
  std::unique_ptr<Communicator> world = mpi.communicator(Milliseconds{opt.timeout_ms});
  kernels::Tracer tracer;
  std::optional<kernels::File> trace_file;
  if (!opt.trace_path.empty()) {
    try {
      trace_file = collectives::create_trace_file(*world, opt.trace_path);
    } catch (const kernels::InvalidArgument& e) {
      throw kernels::InvalidArgument(fmt::format("--trace {}: {}", opt.trace_path, e.what()));
    }
    world->set_tracer(&tracer);
  }
  const int n = world->size();
  const std::vector<Case> cases = suite_cases(opt, n);
  // NOTE [one core per process] Each process's worker progresses its calls on the CPUs of the
  // process's affinity mask. OpenMPI binds each process to one core when np <= 2 (by default; to
  // sockets beyond): caller and worker then share that core, and the worker moves data only while
  // the caller sleeps or waits (as the --overlap stand-in does, and as a thread driving a GPU
  // mostly does), never while the caller computes on the CPU. Before the workers ran under
  // SCHED_BATCH (NOTE [batch worker] in collectives/call_queue.h) the worker took the core at the
  // hand-off and nothing overlapped at all there (exposed 0.3-1.0 with 2 processes, also on a
  // 16-core machine). The header says how many CPUs each process may use.
  const double mine = bench::affinity_cpus();
  const std::vector<double> cpus = bench::reduce_over_ranks(*world, {mine, -mine}, ReduceOp::kMin);  // min, -max
  const int min_cpus = static_cast<int>(cpus[0]), max_cpus = static_cast<int>(-cpus[1]);
  const std::string desc =
      min_cpus == max_cpus ? fmt::format("mpi ({} processes, {} CPU{} each by affinity)", n, min_cpus, min_cpus == 1 ? "" : "s")
                           : fmt::format("mpi ({} processes, {}-{} CPUs each by affinity)", n, min_cpus, max_cpus);
  Printer printer(opt, desc, n);
  if (world->rank() == 0) print_header(opt, printer);
  if (world->rank() == 0 && opt.overlap && min_cpus < 2)
    fmt::print("# note: a process may run on one CPU only (its affinity): its worker shares it with the caller and "
               "moves data only while the caller sleeps or waits (NOTE [one core per process]); OpenMPI binds each "
               "of np <= 2 processes to one core, --bind-to none gives them every core\n");
  Env env{*world, Device::cpu(), opt, {}, {}, {}};
  Result res = run_rank(env, world->rank() == 0 ? &printer : nullptr, cases);
  if (!opt.trace_path.empty()) collectives::write_trace(*world, tracer, trace_file);
  if (world->rank() == 0) return finish(opt, printer, desc, n, res);
  return res.wrong();  // every rank holds the sums
}

int64_t run_mpi(const Options& opt, int* argc, char*** argv) {
  // The closing barrier waits --timeout-ms for the other ranks; a failure is printed before it.
  collectives::MpiWorld mpi(argc, argv, Milliseconds{opt.timeout_ms});
  return program::run_as_rank("dtensor-bench", mpi.rank(), [&] { return run_mpi_rank(opt, mpi); });
}

int64_t run_nccl(const Options& opt, int* argc, char*** argv) {
  std::optional<Printer> printer;
  auto run = bench::run_nccl_ranks<Result>(
      opt.world, opt.world_given, opt.bootstrap, Milliseconds{opt.timeout_ms}, argc, argv,
      [&](int n, const std::string& desc) {
        printer.emplace(opt, desc, n);
        print_header(opt, *printer);
      },
      [&](Communicator& world, Communicator& boot, Device device, bool) {
        const std::vector<Case> mine = suite_cases(opt, boot.size());
        Env env{world, device, opt, {}, {}, {}};
        return run_rank(env, boot.rank() == 0 ? &*printer : nullptr, mine);
      });
  if (run.reporting) return finish(opt, *printer, run.desc, run.world, run.result);
  return run.result.wrong();  // every rank holds the sums
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("dtensor-bench", [&] {
    Options opt;
    CLI::App app{"dtensor-bench: time every placement transition against the raw collective (see bench/README.md)"};
    app.add_option("--backend", opt.backend, "local (threads), mpi (run under mpirun) or nccl (one GPU per rank)")
        ->check(CLI::IsMember({"local", "mpi", "nccl"}))
        ->capture_default_str();
    app.add_option("--world", opt.world, "ranks (threads) of the local backend; nccl without mpirun: GPUs")
        ->check(CLI::Range(1, 1024))
        ->capture_default_str();
    app.add_option("--mesh", opt.mesh_text, "mesh shape (8, 2x4); default: [world], (2, world/2), (2, 2, world/4) "
                                            "for 1-, 2- and 3-D placement lists");
    app.add_option("--from", opt.from, "source placements, one per mesh dim (S(0),R); with --to, instead of a suite");
    app.add_option("--to", opt.to, "target placements");
    app.add_option("--suite", opt.suite, "default (1-D, strided, 2-D and 3-D pairs) or single (1-D only)")
        ->capture_default_str();
    app.add_option("--sizes", opt.sizes, "global tensor bytes: SIZE or MIN:MAX (x2 steps), comma-separated; K, M, G")
        ->capture_default_str();
    app.add_option("--dtype", opt.dtype_name, "f32, f64, bf16, f16, i32, i64, u8")->capture_default_str();
    app.add_option("--planner", opt.planner_name, "search or greedy (PyTorch's route)")->capture_default_str();
    app.add_option("--iters", opt.iters, "timed iterations per size (the median is reported)")
        ->check(CLI::Range(1, 1000000))
        ->capture_default_str();
    app.add_option("--warmup", opt.warmup, "untimed iterations before them")->check(CLI::Range(0, 1000000))
        ->capture_default_str();
    app.add_flag("--check,!--no-check", opt.check, "check every rank's result once per size; exit 1 on a mismatch")
        ->capture_default_str();
    app.add_flag("--host-cost", opt.host_cost, "host cost of a cached-plan S(0)->R of a tiny tensor vs the raw "
                                               "all_gather, on 1, 2, 4 and 8 local ranks (or --world)");
    app.add_flag("--moe-dispatch", opt.moe_dispatch, "MoE token dispatch + combine (dtensor/row_exchange.h) vs the "
                                                   "raw all_to_all_v of the same bytes, local ranks; sizes: bytes "
                                                   "each rank sends (default 64K:16M)");
    app.add_option("--moe-width", opt.moe_width, "--moe-dispatch: f32 elements per row (a token's hidden size)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
        ->capture_default_str();
    app.add_option("--host-calls", opt.host_calls, "calls per timed repeat of --host-cost")
        ->check(CLI::Range(1, 100000000))
        ->capture_default_str();
    app.add_flag("--overlap", opt.overlap, "per transition and size: the transition alone, a compute stand-in (sleep) "
                                         "alone, and both overlapped (redistribute_async, compute, wait); default "
                                         "sizes 256K:64M");
    app.add_option("--overlap-min-size", opt.overlap_min_text, "smallest local shard counted in the --overlap summary")
        ->capture_default_str();
    app.add_option("--target", opt.target, "overhead target of the summary")
        ->check(CLI::Range(0.0, 1e6))
        ->capture_default_str();
    app.add_option("--target-min-size", opt.target_min_text, "smallest local shard counted in the summary")
        ->capture_default_str();
    program::add_timeout(app, opt.timeout_ms);
    app.add_option("--bootstrap", opt.bootstrap, "nccl: auto (mpi under mpirun, else local threads), mpi, local")
        ->check(CLI::IsMember({"auto", "mpi", "local"}))
        ->capture_default_str();
    app.add_option("--json", opt.json_path, "also write every figure as a JSON list of records");
    app.add_option("--trace", opt.trace_path,
                   "write a Chrome trace (ui.perfetto.dev) of the sweep to FILE: per rank the measured calls, "
                   "each collective with its bytes and transition, the waits (local and mpi)");
    program::parse(app, argc, argv);
    opt.world_given = app.count("--world") > 0;
    opt.command_line = bench::join_args(argc, argv);

    opt.dtype = kernels::parse_dtype(opt.dtype_name);
    if (opt.dtype == DType::kF8E4M3 || opt.dtype == DType::kF8E5M2)
      throw kernels::InvalidArgument(fmt::format("--dtype {}: fp8 is storage-only, collectives do not move it",
                                                 opt.dtype_name));
    opt.planner = dtensor::parse_planner(opt.planner_name);
    if (opt.overlap && app.count("--sizes") == 0) opt.sizes = "256K:64M";
    if (opt.moe_dispatch && app.count("--sizes") == 0) opt.sizes = "64K:16M";
    if (opt.moe_dispatch && (opt.overlap || opt.host_cost || opt.backend != "local" || !opt.trace_path.empty()))
      throw kernels::InvalidArgument("--moe-dispatch runs alone on the local backend (not with --overlap, "
                                     "--host-cost, --trace or another --backend)");
    opt.size_list = bench::parse_sizes(opt.sizes);
    opt.overlap_min = bench::parse_bytes(opt.overlap_min_text);
    if (opt.overlap && opt.host_cost) throw kernels::InvalidArgument("--overlap and --host-cost go one at a time");
    opt.target_min = bench::parse_bytes(opt.target_min_text);
    if (!opt.trace_path.empty() && (opt.host_cost || opt.backend == "nccl"))
      throw kernels::InvalidArgument(fmt::format("--trace {}: traces the sweep on the local and mpi backends, not {}",
                                                 opt.trace_path, opt.host_cost ? "--host-cost" : "--backend nccl"));
    if (opt.host_cost && opt.backend != "local")
      throw kernels::InvalidArgument(fmt::format("--host-cost runs on the local backend, not {}", opt.backend));

    int64_t wrong = 0;
    if (opt.host_cost) run_host_costs(opt);
    else if (opt.moe_dispatch) wrong = run_moe_dispatch(opt);
    else if (opt.backend == "local") wrong = run_local(opt);
    else if (opt.backend == "mpi") wrong = run_mpi(opt, &argc, &argv);
    else wrong = run_nccl(opt, &argc, &argv);
    if (wrong > 0) {
      fmt::print(stderr, "dtensor-bench: {} rank results did not match the expected shard\n", wrong);
      return program::kMismatch;
    }
    return program::kOk;
  });
}
