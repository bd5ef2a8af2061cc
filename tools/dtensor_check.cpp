// dtensor-check: command-line checks of the runtime's contracts.
//   dtensor-check layout --mesh 4x2 --shape 13,2 --placements 'S(0),S(0)' [--names dp,tp] [--runs]
//     one JSON object per rank, in rank order:
//     {"rank":0,"coord":[0,0],"local_shape":[2,2],"global_offset":[0,0],"indices":[[0,1],[0,1]]}
//     --runs prints the held indices as [start,length] runs ("runs":[[[0,2]],[[0,2]]]) instead
//     of every index, which --indices lists only up to kMaxPrintedIndices per rank.
//   dtensor-check demo
//     a tour of the layout rules on a few meshes (the README's main job for now).
//   dtensor-check redistribute --mesh 2x2 --shape 7,5 --from 'S(0),R' --to 'R,S(1)'
//                [--dtype f32] [--backend local|mpi|nccl] [--planner greedy|search] [--names ..]
//                [--device cpu|cuda] [--timeout-ms 60000]
//     distributes a tensor whose values are a function of the global index (Partial sources:
//     per-rank integer contributions whose reduction is that value), redistributes it and checks
//     every rank's local tensor against the expected slice (a Partial kept from the source is
//     reduced over its mesh dims first). First line, the plan (route, communicating steps, bytes
//     sent by the busiest rank):
//     {"plan":"[S(0),R] -AG(0)-> [R,R] -chunk(1->S(1))-> [R,S(1)]","collectives":1,"bytes_per_rank":60}
//     then one line per rank, in rank order: {"rank":0,"local_shape":[7,3],"ok":true}
//     --backend local: one thread per mesh rank (an explicit mesh must use ranks 0..n-1);
//     mpi: one process per rank under mpirun, each prints its own line (rank 0 the plan line;
//     world ranks outside the mesh print nothing); nccl: one GPU and one thread per mesh rank.
//     --device cuda (local backend): every rank's tensors live on GPU 0 (the local backend over
//     CUDA memory); the check copies them back (exit 2 without a usable GPU).
//   dtensor-check plan --mesh 4096x8 --shape 65536,4096 --from '_S(0,8),S(0)' --to 'R,S(0)'
//                [--dtype bf16] [--planner search|greedy] [--wire-dtype bf16|f8e5m2] [--rank R]
//     plans the transition (no communication, any mesh up to the 2^20-rank limit) and prints one
//     JSON object: {"steps":"<route>","collectives":N,"bytes_per_rank":B,"lower_bound_bytes":L,
//     "plan_us":T,"schedule_us":S,"schedule_bytes":M} where B is the bytes the busiest rank
//     receives, L what no plan can go below, T the cold planning time in this process, and S, M
//     the time and memory of the schedule rank R (default: the mesh's first rank) computes
//     from its own coordinate (views backends: local, mpi). --wire-dtype: the reductions move that
//     dtype and sum in --dtype (the steps print it, B counts it; L stays --dtype's bound).
//   dtensor-check fuzz --cases N --seed S [--max-ranks 8] [--backend local|mpi]
//                [--planner greedy|search|both] [--device cpu|cuda] [--timeout-ms 30000]
//     random meshes, shapes, dtypes and placement pairs (invalid ones included: they must raise
//     the right error); last line "fuzz: N cases, N passed, N failed", the first failures
//     before it, each with a `dtensor-check redistribute ...` command line that reproduces it.
// Limits (exit 2 naming the value beyond them): --cases <= 1,000,000; --max-ranks <= 64; one
// thread per rank on the local and nccl backends, so at most 1024 mesh ranks there; the mesh,
// placement and planner limits of dtensor/ (mesh.h, placement.h, layout.h, plan/planner.h).
// --timeout-ms bounds every wait: a collective fails after it naming the ranks it waited for,
// and the mpi print and shutdown barriers wait a bounded multiple of it.
// Exit status (program/main.h): 0 success, 1 a wrong result (redistribute) or a failed case
// (fuzz), 2 invalid input or an unsupported transition, 3 out of memory (or threads), 4 a
// communication failure; each failure is one line on stderr naming the value or the rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/nccl.h"
#include "dtensor/exec/executor.h"
#include "dtensor/dtensor.h"
#include "dtensor/layout.h"
#include "dtensor/mesh.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/placement.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/allocator.h"
#include "kernels/checked.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "program/cli.h"
#include "program/main.h"
#include "support/dtensor_data.h"
#include "support/redistribute_check.h"

namespace {

using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::Placements;

// The local and nccl backends run one thread per mesh rank.
constexpr int64_t kMaxThreadRanks = 1024;
// The layout command lists every held index up to this many per rank (--runs has no limit).
constexpr int64_t kMaxPrintedIndices = 1'000'000;
constexpr int64_t kMaxFuzzCases = 1'000'000;

using kernels::parse_shape;

std::vector<std::string> parse_names(const std::string& text) {
  std::vector<std::string> names;
  if (text.empty()) return names;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    names.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return names;
}

struct LayoutArgs {
  std::string mesh, shape, placements, names;
  bool runs = false;
};

struct Problem {
  std::shared_ptr<const DeviceMesh> mesh;
  dtensor::DTensorSpec spec;
};

Problem make_problem(const LayoutArgs& a) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(a.mesh, parse_names(a.names)));
  Dims shape = parse_shape(a.shape);
  Placements placements = dtensor::parse_placements(a.placements);
  return {mesh, dtensor::make_spec(mesh, placements, shape, kernels::DType::kF32)};
}

void print_layout(const Problem& p, bool runs) {
  std::vector<int> ranks = p.mesh->ranks();
  std::sort(ranks.begin(), ranks.end());
  if (!runs)  // refuse before printing anything
    for (int rank : ranks) {
      const dtensor::ShardLayout layout = *p.spec.layout(rank);
      int64_t held = 0;
      for (int t = 0; t < layout.local_shape.size(); ++t) held = kernels::checked_add(held, layout.local_shape[t], "held indices");
      if (held > kMaxPrintedIndices)
        throw kernels::InvalidArgument(fmt::format(
            "layout: rank {} holds {} indices (local shape [{}]), more than the {} the index lists print; "
            "pass --runs for [start,length] runs",
            rank, held, fmt::join(layout.local_shape, ","), kMaxPrintedIndices));
    }
  for (int rank : ranks) {
    dtensor::ShardLayout layout = *p.spec.layout(rank);
    nlohmann::ordered_json j;
    j["rank"] = rank;
    j["coord"] = p.mesh->coord_of(rank)->vec();
    j["local_shape"] = layout.local_shape.vec();
    j["global_offset"] = layout.global_offset.vec();
    nlohmann::ordered_json indices = nlohmann::ordered_json::array();
    if (runs) {
      for (int t = 0; t < layout.local_shape.size(); ++t) {
        nlohmann::ordered_json dim = nlohmann::ordered_json::array();
        for (const dtensor::IndexRun& r : layout.runs[t]) dim.push_back({r.start, r.length});
        indices.push_back(std::move(dim));
      }
      j["runs"] = std::move(indices);
    } else {
      for (int t = 0; t < layout.local_shape.size(); ++t) indices.push_back(layout.indices(t));
      j["indices"] = std::move(indices);
    }
    fmt::print("{}\n", j.dump());
  }
}

void demo_case(const char* mesh, const char* names, const char* shape, const char* placements,
               const char* note) {
  Problem p = make_problem({mesh, shape, placements, names});
  fmt::print("\nmesh {}  shape [{}]  placements [{}]\n  {}\n", dtensor::to_string(*p.mesh),
             fmt::join(p.spec.shape, ","), dtensor::to_string(p.spec.placements), note);
  // The same table and owner grid as DTensor::ownership(), indented under the heading.
  const std::string text = dtensor::ownership_text(p.spec);
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = text.find('\n', begin);
    fmt::print("  {}\n", std::string_view(text).substr(begin, end - begin));
    begin = end + 1;
  }
}

void demo() {
  fmt::print("dtensor-check demo: which elements each rank holds, exactly as PyTorch DTensor.\n");
  demo_case("4", "", "9", "S(0)", "torch.chunk rule: 9 over 4 is 3,3,3,0 (not 3,2,2,2); the empty shard reports offset 9");
  demo_case("2x2", "dp,tp", "6,4", "S(0),S(1)", "two tensor dims sharded on two mesh dims");
  demo_case("4x2", "dp,tp", "13,2", "S(0),S(0)", "nested uneven sharding, left to right over mesh dims");
  demo_case("2x2", "dp,tp", "8,2", "_S(0,2),S(0)", "StridedShard: FSDP over TP, the tp coordinate picks the half");
  demo_case("3x2", "dp,tp", "7,2", "_S(0,2),S(0)", "uneven StridedShard with a first mesh dim of 3 (docs/pytorch-semantics.md 2.3)");
  demo_case("[[0,2],[1,3]]", "dp,tp", "4,4", "R,S(1)", "an explicit rank array: groups follow coordinates, not rank order");
  demo_case("2x2", "", "4,4", "P,S(0)", "Partial holds the full local shape on every rank of its group");
  fmt::print("\nTry: build/tools/dtensor-check layout --mesh 4x2 --shape 13,2 --placements 'S(0),S(0)'\n");
}

// ---------------------------------------------------------------------------------------------
// plan

struct PlanArgs {
  std::string mesh, shape, from, to, dtype = "f32", planner = "search";
  std::optional<std::string> wire_dtype;
  std::optional<int64_t> rank;
};

kernels::DType parse_cli_dtype(const std::string& text);

int cmd_plan(const PlanArgs& a) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(a.mesh));
  const Dims shape = parse_shape(a.shape);
  const Placements from = dtensor::parse_placements(a.from);
  const Placements to = dtensor::parse_placements(a.to);
  const kernels::DType dtype = parse_cli_dtype(a.dtype);
  const dtensor::PlannerKind planner = dtensor::parse_planner(a.planner);
  const int rank = a.rank ? static_cast<int>(std::clamp<int64_t>(*a.rank, -1, dtensor::kMaxRank)) : mesh->ranks().front();
  if (a.rank && (*a.rank < 0 || *a.rank > dtensor::kMaxRank || !mesh->contains(rank)))
    throw kernels::InvalidArgument(fmt::format("--rank {} is not a rank of mesh '{}'", *a.rank, kernels::clip(a.mesh)));
  const dtensor::DTensorSpec src = dtensor::make_spec(mesh, from, shape, dtype);
  dtensor::ReducePolicy policy;
  if (a.wire_dtype) policy.wire_dtype = kernels::parse_dtype(*a.wire_dtype);
  const dtensor::Transition t = dtensor::make_transition(src, to, planner, policy);
  const auto start = std::chrono::steady_clock::now();
  const dtensor::Plan plan = dtensor::plan_transition(t);
  const double plan_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  const dtensor::ScheduleCost schedule = dtensor::measure_schedule(plan, src, *mesh->coord_of(rank));
  nlohmann::ordered_json j;
  j["steps"] = dtensor::to_string(plan);
  j["collectives"] = plan.collectives();
  j["bytes_per_rank"] = plan.traffic.max_received();
  j["lower_bound_bytes"] = dtensor::lower_bound_traffic(src, plan.on_view() ? plan.user_dst : plan.dst).max_received();
  j["plan_us"] = std::round(plan_us * 10) / 10;
  j["rank"] = rank;
  j["schedule_us"] = std::round(schedule.us * 10) / 10;
  j["schedule_bytes"] = schedule.bytes;
  fmt::print("{}\n", j.dump());
  return program::kOk;
}

// ---------------------------------------------------------------------------------------------
// redistribute

using collectives::Communicator;
using dtensor::DTensorSpec;
using dtensor::MeshComms;
using dtensor::Plan;
using dtensor::PlannerKind;
using kernels::DType;
using kernels::Tensor;
using dtensor::Placement;
using kernels::ReduceOp;
using Millis = collectives::Milliseconds;

enum class Backend { kLocal, kMpi, kNccl };

Backend parse_backend(const std::string& text, bool allow_nccl) {
  if (text == "local") return Backend::kLocal;
  if (text == "mpi") return Backend::kMpi;
  if (text == "nccl" && allow_nccl) return Backend::kNccl;
  throw kernels::InvalidArgument(fmt::format("unknown backend '{}': expected {}", text,
                                             allow_nccl ? "local, mpi or nccl" : "local or mpi"));
}

// --device: where the local backend's ranks keep their tensors ("cuda": all on GPU 0). The nccl
// backend always uses one GPU per rank, mpi the CPU.
kernels::Device parse_device(const std::string& text, Backend backend) {
  if (text == "cpu") {
    if (backend == Backend::kNccl)
      throw kernels::InvalidArgument("--device cpu with --backend nccl: the nccl backend moves CUDA tensors only");
    return kernels::Device::cpu();
  }
  if (text != "cuda")
    throw kernels::InvalidArgument(fmt::format("unknown device '{}': expected cpu or cuda", kernels::clip(text)));
  if (backend == Backend::kMpi)
    throw kernels::InvalidArgument("--device cuda with --backend mpi: use --backend local (one GPU) or nccl");
  if (kernels::cuda_device_count() < 1)
    throw kernels::Unsupported(fmt::format(
        "--device cuda: {}", kernels::cuda_built() ? "no usable GPU on this machine" : "this build has no CUDA"));
  return kernels::Device::cuda(0);
}

constexpr DType kCliDTypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                                DType::kI32, DType::kI64, DType::kU8};

DType parse_cli_dtype(const std::string& text) {
  for (DType d : kCliDTypes)
    if (kernels::to_string(d) == text) return d;
  throw kernels::InvalidArgument(
      fmt::format("unknown dtype '{}': expected f32, f64, bf16, f16, i32, i64 or u8", text));
}

// The --mesh text that rebuilds `mesh`: "2x2" for a row-major arange, else the rank array.
std::string mesh_arg(const DeviceMesh& mesh) {
  const std::vector<int>& ranks = mesh.ranks();
  bool arange = true;
  for (size_t i = 0; i < ranks.size(); ++i) arange = arange && ranks[i] == static_cast<int>(i);
  if (arange) return fmt::format("{}", fmt::join(mesh.shape(), "x"));
  size_t pos = 0;
  std::function<std::string(int)> nest = [&](int d) -> std::string {
    std::vector<std::string> parts;
    for (int64_t i = 0; i < mesh.shape()[d]; ++i)
      parts.push_back(d + 1 == mesh.ndim() ? std::to_string(ranks[pos++]) : nest(d + 1));
    return fmt::format("[{}]", fmt::join(parts, ","));
  };
  return nest(0);
}

// With one thread per mesh rank the world is the mesh: its ranks must be 0..n-1, and there are
// at most kMaxThreadRanks of them.
void require_dense_ranks(const DeviceMesh& mesh, const std::string& text, std::string_view backend) {
  if (mesh.size() > kMaxThreadRanks)
    throw kernels::InvalidArgument(fmt::format(
        "mesh '{}' has {} ranks: --backend {} runs one thread per mesh rank, at most {}", kernels::clip(text),
        mesh.size(), backend, kMaxThreadRanks));
  const int n = static_cast<int>(mesh.size());
  for (int r : mesh.ranks())
    if (r >= n)
      throw kernels::InvalidArgument(fmt::format(
          "mesh '{}' holds rank {}: with --backend {} (one thread per mesh rank) an explicit "
          "mesh must use ranks 0..{}",
          kernels::clip(text), r, backend, n - 1));
}

std::string plan_line(const Plan& plan) {
  nlohmann::ordered_json j;
  j["plan"] = dtensor::to_string(plan);
  j["collectives"] = plan.collectives();
  j["bytes_per_rank"] = plan.bytes_per_rank();
  return j.dump();
}

struct RankResult {
  int rank = -1;
  Dims local_shape;
  std::string error;  // empty: matches
};

std::string rank_line(const RankResult& r) {
  nlohmann::ordered_json j;
  j["rank"] = r.rank;
  j["local_shape"] = r.local_shape.vec();
  j["ok"] = r.error.empty();
  return j.dump();
}

struct RedistributeArgs {
  std::string mesh, shape, from, to, dtype = "f32", backend = "local", planner = "search", names;
  std::string device;  // "" : the backend's (cpu; nccl: cuda)
  int64_t timeout_ms = 60'000;
  int64_t memory_limit = 0;  // bytes the redistribute may allocate per rank (0: the machine's memory)
  int inject_failure = -1;  // test of the failure path: this rank fails before redistributing
};

// Everything a rank needs: rank-independent, built once.
struct Prepared {
  std::shared_ptr<const DeviceMesh> mesh;
  DTensorSpec src, dst;
  // The specs whose layouts name the tensor's global indices: a RaggedShard's flattened view
  // (its flat indices are the tensor's row-major ones), else src and dst themselves.
  DTensorSpec src_data, dst_data;
  Plan plan;
  int64_t modulus = testing_support::kDefaultModulus;
  int64_t memory_limit = 0;
  int inject_failure = -1;

  // The allocator of a rank's MeshComms: the default (the machine's memory), or one capped at
  // --memory-limit (NOTE [memory limit] in kernels/allocator.h).
  std::shared_ptr<kernels::Allocator> allocator() const {
    if (memory_limit <= 0) return nullptr;
    kernels::CachingAllocator::Options o;
    o.limit_bytes = static_cast<size_t>(memory_limit);
    return std::make_shared<kernels::CachingAllocator>(o);
  }
};

Prepared prepare(const RedistributeArgs& a) {
  Prepared p;
  p.mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(a.mesh, parse_names(a.names)));
  const Dims shape = parse_shape(a.shape);
  const Placements from = dtensor::parse_placements(a.from);
  const Placements to = dtensor::parse_placements(a.to);
  const DType dtype = parse_cli_dtype(a.dtype);
  const PlannerKind planner = dtensor::parse_planner(a.planner);
  p.src = dtensor::make_spec(p.mesh, from, shape, dtype);
  p.plan = dtensor::plan_redistribute(p.src, to, planner);
  p.dst = dtensor::make_spec(p.mesh, p.plan.on_view() ? p.plan.user_dst : p.plan.dst, shape, dtype);
  auto data = [&](const DTensorSpec& s) {
    return dtensor::ragged_mesh_dim(s.placements) < 0
               ? s
               : dtensor::make_spec(p.mesh, s.placements, dtensor::ragged_view(shape, s.placements), dtype);
  };
  p.src_data = data(p.src);
  p.dst_data = data(p.dst);
  p.modulus = testing_support::exact_modulus(dtype, p.mesh->size());
  p.inject_failure = a.inject_failure;
  p.memory_limit = a.memory_limit;
  return p;
}

// This rank's part: distribute, redistribute, check (collective over the mesh).
RankResult run_rank(const Prepared& p, const MeshComms& comms, kernels::Device device) {
  const int rank = comms.rank();
  if (rank == p.inject_failure)
    throw kernels::ResourceError("cannot allocate the source shard (injected by --inject-failure)");
  Tensor local = testing_support::make_local(p.src_data, rank, p.modulus);
  if (!device.is_cpu()) local = local.to(device);
  Tensor out = dtensor::execute(p.plan, p.src, local, comms);
  return {rank, out.shape(),
          testing_support::check_redistributed(p.dst_data, out, comms, p.modulus,
                                               testing_support::avg_tolerance(p.src))};
}

// Rank lines on stdout, mismatch details on stderr; 0 when every rank matches.
int report(const std::vector<RankResult>& results) {
  int status = 0;
  for (const RankResult& r : results) {
    fmt::print("{}\n", rank_line(r));
    if (!r.error.empty()) {
      fmt::print(stderr, "dtensor-check: rank {}: {}\n", r.rank, r.error);
      status = 1;
    }
  }
  return status;
}

// One thread per mesh rank; with `nccl`, each drives the GPU of its rank. A rank that throws
// fails the run naming itself (the others' waits end at once, naming it: run_ranks).
std::vector<RankResult> run_threads(const Prepared& p, bool nccl, Millis timeout,
                                    kernels::Device device = {}) {
  const int n = static_cast<int>(p.mesh->size());
  std::vector<RankResult> results(n);
  collectives::run_ranks(
      n,
      [&](Communicator& world) {
        program::on_rank(world.rank(), [&] {
          std::unique_ptr<Communicator> gpu;
          if (nccl) gpu = collectives::nccl_communicator(world, world.rank(), timeout);
          MeshComms comms(*p.mesh, nccl ? *gpu : world, {}, p.allocator());
          results[world.rank()] =
              run_rank(p, comms, nccl ? kernels::Device::cuda(world.rank()) : device);
        });
      },
      timeout);
  return results;
}

// How long the mpi print barriers and status exchanges wait: a rank that failed early reaches
// them while the others may still wait out a collective for up to `timeout`, so they wait a
// bounded multiple of it (never the backend's fixed default).
Millis control_timeout(Millis timeout) { return 2 * timeout + Millis{5'000}; }

// Prints this process's failure at once (its own error, before any other rank's report of it)
// and returns its exit status.
int report_rank_failure(int rank, const std::exception_ptr& e) {
  const program::Failure f = program::classify(std::make_exception_ptr(program::RankError(rank, e)));
  return program::report("dtensor-check", f);
}

int run_mpi(collectives::MpiWorld& mpi, const Prepared& p, const std::string& mesh_text, Millis timeout) {
  for (int r : p.mesh->ranks())
    if (r >= mpi.size())
      throw kernels::InvalidArgument(fmt::format(
          "mesh '{}' holds rank {}, outside the mpi world (size {})", kernels::clip(mesh_text), r, mpi.size()));
  const std::unique_ptr<Communicator> world = mpi.communicator(timeout);
  const std::unique_ptr<Communicator> control = mpi.communicator(control_timeout(timeout));
  std::optional<MeshComms> comms;
  comms.emplace(*p.mesh, *world, std::vector<std::vector<int>>{}, p.allocator());
  if (mpi.rank() == 0) {
    fmt::print("{}\n", plan_line(p.plan));
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  std::optional<RankResult> mine;
  int status = program::kOk;
  if (comms->in_mesh()) {
    try {
      mine = run_rank(p, *comms, kernels::Device{});
    } catch (...) {
      status = report_rank_failure(mpi.rank(), std::current_exception());
    }
  }
  if (mine && !mine->error.empty()) status = program::kMismatch;
  // Lines in rank order: each process prints its own in turn.
  for (int r = 0; r < mpi.size(); ++r) {
    if (r == mpi.rank()) {
      if (mine) fmt::print("{}\n", rank_line(*mine));
      std::fflush(stdout);
      if (mine && !mine->error.empty())
        fmt::print(stderr, "dtensor-check: rank {}: {}\n", mine->rank, kernels::clip(mine->error, 500));
      std::fflush(stderr);
      // mpirun forwards each process's output on its own: give it a moment to keep rank order.
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
    control->wait(control->barrier());
  }
  // Every process exits with the same status: the root cause's (a rank's own failure or a
  // mismatch) before the communication failures it caused on the others.
  auto rank_of = [](int st) { return st == program::kOk ? 0 : st == program::kComm ? 1 : 10 + st; };
  Tensor flag = Tensor::full({1}, rank_of(status), DType::kI32);
  control->wait(control->all_reduce(flag, flag, kernels::ReduceOp::kMax));
  const int worst = static_cast<int>(flag.item({0}));
  return worst == 0 ? program::kOk : worst == 1 ? program::kComm : worst - 10;
}

int cmd_redistribute(const RedistributeArgs& a) {
  const Backend backend = parse_backend(a.backend, /*allow_nccl=*/true);
  const kernels::Device device =
      a.device.empty() ? kernels::Device{} : parse_device(a.device, backend);  // nccl: its own GPUs
  const Millis timeout{a.timeout_ms};
  std::unique_ptr<collectives::MpiWorld> mpi;
  if (backend == Backend::kMpi) {
    try {
      mpi = std::make_unique<collectives::MpiWorld>(nullptr, nullptr, control_timeout(timeout));
    } catch (const kernels::Unsupported& e) {
      throw kernels::Unsupported(fmt::format("--backend mpi: {}", e.what()));
    }
  }
  const bool speaker = !mpi || mpi->rank() == 0;  // under mpirun only rank 0 reports input errors
  if (backend != Backend::kMpi)  // before planning, which is slow on meshes that big
    require_dense_ranks(DeviceMesh::parse(a.mesh), a.mesh, a.backend);
  Prepared p;
  try {
    p = prepare(a);
  } catch (const kernels::Error& e) {  // the same on every rank
    if (speaker) throw;
    throw program::Exit{program::classify(std::current_exception()).status};
  }
  switch (backend) {
    case Backend::kLocal: {
      require_dense_ranks(*p.mesh, a.mesh, "local");
      fmt::print("{}\n", plan_line(p.plan));
      std::fflush(stdout);
      return report(run_threads(p, false, timeout, device));
    }
    case Backend::kNccl: {
      require_dense_ranks(*p.mesh, a.mesh, "nccl");
      const int gpus = kernels::cuda_device_count();
      if (gpus < p.mesh->size())
        throw kernels::Unsupported(fmt::format("the nccl backend needs {} GPUs, found {} (one GPU per mesh rank)",
                                               p.mesh->size(), gpus));
      if (!collectives::nccl_built())
        throw kernels::Unsupported("the nccl backend is not built into this dtensor-check (needs CUDA and NCCL)");
      fmt::print("{}\n", plan_line(p.plan));
      std::fflush(stdout);
      return report(run_threads(p, true, timeout));
    }
    case Backend::kMpi: {
      try {
        return run_mpi(*mpi, p, a.mesh, timeout);
      } catch (const kernels::InvalidArgument&) {  // rank-independent: rank 0 reports it
        if (speaker) throw;
        throw program::Exit{program::kInvalid};
      } catch (const program::Exit&) {
        throw;
      } catch (...) {
        throw program::RankError(mpi->rank(), std::current_exception());
      }
    }
  }
  return program::kMismatch;
}

// ---------------------------------------------------------------------------------------------
// fuzz

// Deterministic across platforms (std distributions are not): every MPI process draws the same.
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}
  int uniform(int lo, int hi) { return lo + static_cast<int>(g_() % static_cast<uint64_t>(hi - lo + 1)); }
  bool percent(int p) { return uniform(0, 99) < p; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (int i = static_cast<int>(v.size()) - 1; i > 0; --i) std::swap(v[i], v[uniform(0, i)]);
  }

 private:
  std::mt19937_64 g_;
};

enum class Outcome { kOk, kInvalidArgument, kUnsupported, kOtherError };

std::string_view outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kOk: return "success";
    case Outcome::kInvalidArgument: return "InvalidArgument";
    case Outcome::kUnsupported: return "Unsupported";
    case Outcome::kOtherError: return "another error";
  }
  return "?";
}

struct FuzzArgs {
  int64_t cases = 100;
  uint64_t seed = 1;
  int max_ranks = 8;
  std::string backend = "local", planner = "both", device = "cpu";
  int show = 10;  // failures printed in full
  int64_t timeout_ms = 30'000;  // per collective (a case's wait)
};

struct FuzzCase {
  size_t mesh = 0;  // index into the mesh pool
  Dims shape;
  Placements src, dst;
  DType dtype = DType::kF32;
  Outcome expect = Outcome::kOk;
  // Planning pass:
  std::optional<DTensorSpec> src_spec, dst_spec;
  std::optional<DTensorSpec> src_data, dst_data;  // a RaggedShard's view (Prepared::src_data)
  std::vector<const Plan*> plans;  // distinct routes to execute
  std::vector<PlannerKind> plan_kinds;
  // The first failure, if any:
  std::string failure;
  PlannerKind failure_planner = PlannerKind::kSearch;
};

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kProd};

ReduceOp random_op(Rng& g) {
  const int c = g.uniform(0, 99);
  return c < 40 ? ReduceOp::kSum : c < 55 ? ReduceOp::kAvg : kOps[g.uniform(2, 4)];
}

// A tensor dim for S/_S: mostly valid (some negative), sometimes out of range.
int random_shard_dim(Rng& g, int nd, int out_of_range_percent) {
  if (g.percent(out_of_range_percent)) return g.percent(50) ? nd + g.uniform(0, 1) : -nd - 1;
  const int d = g.uniform(0, nd - 1);
  return g.percent(12) ? d - nd : d;
}

Placement random_non_partial(Rng& g, int nd, int bad_percent) {
  const int c = g.uniform(0, 99);
  if (c < 30) return dtensor::Replicate{};
  if (c < 75) return dtensor::Shard{random_shard_dim(g, nd, bad_percent)};
  return dtensor::StridedShard{random_shard_dim(g, nd, bad_percent), g.percent(bad_percent) ? 0 : g.uniform(1, 4)};
}

// The error PyTorch raises for (src, dst), computed independently of the runtime.
Outcome expected_outcome(const Placements& src, const Placements& dst, int nd) {
  auto linear = [](ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAvg; };
  auto invalid = [&](const Placements& ps) {
    std::optional<ReduceOp> op;
    for (const Placement& p : ps) {
      if (const auto* s = std::get_if<dtensor::Shard>(&p))
        if (s->dim < -nd || s->dim >= nd) return true;
      if (const auto* s = std::get_if<dtensor::StridedShard>(&p))
        if (s->dim < -nd || s->dim >= nd || s->split_factor < 1) return true;
      if (const auto* s = std::get_if<dtensor::Partial>(&p)) {
        if (op && *op != s->op && !(linear(*op) && linear(s->op))) return true;
        op = s->op;
      }
    }
    return false;
  };
  if (invalid(src) || invalid(dst)) return Outcome::kInvalidArgument;
  auto norm = [&](Placement p) {
    if (auto* s = std::get_if<dtensor::Shard>(&p); s && s->dim < 0) s->dim += nd;
    if (auto* s = std::get_if<dtensor::StridedShard>(&p); s && s->dim < 0) s->dim += nd;
    return p;
  };
  // A Partial target must be the source's own, or (PyTorch 2.15) a plain Shard turning P(sum).
  for (size_t m = 0; m < dst.size(); ++m)
    if (dtensor::is_partial(dst[m]) && norm(src[m]) != dst[m] &&
        !(dtensor::is_shard(src[m]) && dst[m] == Placement{dtensor::Partial{ReduceOp::kSum}}))
      return Outcome::kUnsupported;
  return Outcome::kOk;
}

FuzzCase random_case(Rng& g, size_t mesh_index, const DeviceMesh& mesh) {
  FuzzCase c;
  c.mesh = mesh_index;
  const int nd = g.uniform(1, 3);
  for (int t = 0; t < nd; ++t) {
    const int r = g.uniform(0, 99);
    c.shape.push_back(r < 7 ? 0 : r < 22 ? 1 : r < 88 ? g.uniform(2, 9) : g.uniform(10, 37));
  }
  c.dtype = kCliDTypes[g.uniform(0, 6)];
  const ReduceOp op = random_op(g);
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (g.percent(25)) c.src.push_back(dtensor::Partial{g.percent(8) ? random_op(g) : op});
    else c.src.push_back(random_non_partial(g, nd, 3));
  }
  for (int m = 0; m < mesh.ndim(); ++m) {
    const int r = g.uniform(0, 99);
    if (const auto* p = std::get_if<dtensor::Partial>(&c.src[m])) {
      if (r < 45) c.dst.push_back(*p);  // a kept Partial
      else if (r < 52) c.dst.push_back(dtensor::Partial{kOps[(static_cast<int>(p->op) + g.uniform(1, 4)) % 5]});
      else c.dst.push_back(random_non_partial(g, nd, 2));
    } else {
      c.dst.push_back(r < 5 ? Placement{dtensor::Partial{random_op(g)}} : random_non_partial(g, nd, 2));
    }
  }
  c.expect = expected_outcome(c.src, c.dst, nd);
  return c;
}

// A RaggedShard case (NOTE [ragged plans] in dtensor/plan/transition.h): one mesh dim m moves
// among Rg(d, units with zeros, align), R, P (source) and S(d), the others keep R or S of a dim
// before d, or go P -> R (HSDP's all-reduce over dp_replicate). One case in eight is invalid on
// purpose: Rg -> P (Unsupported) or units that do not match the mesh dim (InvalidArgument).
FuzzCase random_ragged_case(Rng& g, size_t mesh_index, const DeviceMesh& mesh) {
  FuzzCase c;
  c.mesh = mesh_index;
  const int nd = g.uniform(1, 3);
  for (int t = 0; t < nd; ++t) {
    const int r = g.uniform(0, 99);
    c.shape.push_back(r < 7 ? 0 : r < 20 ? 1 : g.uniform(2, 11));
  }
  c.dtype = kCliDTypes[g.uniform(0, 6)];
  const int d = g.uniform(0, nd - 1);
  const int m = g.uniform(0, mesh.ndim() - 1);
  const int64_t k = mesh.size(m);
  auto ragged = [&](int64_t units) {
    dtensor::RaggedShard r{d, {}, g.percent(50) ? 1 : g.uniform(2, 4)};
    for (int64_t i = 0; i < units; ++i) r.units.push_back(g.percent(25) ? 0 : g.uniform(1, 5));
    if (std::all_of(r.units.begin(), r.units.end(), [](int64_t u) { return u == 0; })) r.units[0] = 1;
    return r;
  };
  auto other = [&](bool target) -> Placement {
    const int r = g.uniform(0, 99);
    if (r < 35) return dtensor::Replicate{};
    if (r < 65 && !target) return dtensor::Partial{g.percent(70) ? ReduceOp::kSum : ReduceOp::kAvg};
    return dtensor::Shard{d};
  };
  Placement a = ragged(k), b = ragged(k);
  const int kind = g.uniform(0, 99);
  if (kind < 25) b = other(true);        // Rg -> R / S(d)
  else if (kind < 55) a = other(false);  // R / P / S(d) -> Rg
  // else Rg -> Rg with other units and alignment
  c.expect = Outcome::kOk;
  if (g.percent(12)) {
    if (g.percent(50)) {
      b = dtensor::Partial{};
      a = ragged(k);
      c.expect = Outcome::kUnsupported;
    } else {
      a = ragged(k + 1);
      c.expect = Outcome::kInvalidArgument;
    }
  }
  for (int q = 0; q < mesh.ndim(); ++q) {
    Placement keep = dtensor::Replicate{};
    if (d > 0 && g.percent(40)) keep = dtensor::Shard{g.uniform(0, d - 1)};
    // HSDP's replicate dim: an all-reduce beside the ragged step (P -> R).
    const bool reduce = q != m && g.percent(30);
    c.src.push_back(q == m ? a : reduce ? Placement{dtensor::Partial{g.percent(70) ? ReduceOp::kSum : ReduceOp::kAvg}} : keep);
    c.dst.push_back(q == m ? b : reduce ? Placement{dtensor::Replicate{}} : keep);
  }
  return c;
}

std::shared_ptr<const DeviceMesh> random_mesh(Rng& g, int max_ranks, int world, bool subset) {
  Dims shape;
  for (;;) {
    shape = Dims{};
    const int ndim = g.uniform(1, 3);
    for (int m = 0; m < ndim; ++m) shape.push_back(ndim == 1 ? g.uniform(1, max_ranks) : g.uniform(1, 4));
    if (shape.product() <= max_ranks) break;
  }
  const int n = static_cast<int>(shape.product());
  std::vector<int> ranks(subset ? world : n);
  std::iota(ranks.begin(), ranks.end(), 0);
  if (g.percent(subset ? 50 : 35)) g.shuffle(ranks);  // an explicit rank array
  ranks.resize(n);
  return std::make_shared<const DeviceMesh>(shape, ranks);
}

std::string repro_line(const std::string& prog, const FuzzCase& c, const DeviceMesh& mesh,
                       Backend backend, int world, kernels::Device device) {
  const std::string cmd = fmt::format(
      "{} redistribute --mesh '{}' --shape {} --from '{}' --to '{}' --dtype {} --planner {} --backend {}{}",
      prog, mesh_arg(mesh), fmt::join(c.shape, ","), dtensor::to_string(c.src), dtensor::to_string(c.dst),
      kernels::to_string(c.dtype), dtensor::to_string(c.failure_planner),
      backend == Backend::kMpi ? "mpi" : "local", device.is_cuda() ? " --device cuda" : "");
  if (backend != Backend::kMpi) return cmd;
  return fmt::format("mpirun --allow-run-as-root --oversubscribe -np {} {}", world, cmd);
}

// Validates and plans a case with every requested planner: the error must be the expected one;
// a valid case gets its distinct routes (from the shared cache: plans are rank-independent).
void plan_case(FuzzCase& c, const std::shared_ptr<const DeviceMesh>& mesh,
               const std::vector<PlannerKind>& planners, dtensor::PlanCache& cache) {
  Outcome got = Outcome::kOk;
  std::string message;
  PlannerKind at = planners.front();
  std::vector<const Plan*> plans;
  try {
    c.src_spec = dtensor::make_spec(mesh, c.src, c.shape, c.dtype);
    for (PlannerKind kind : planners) {
      at = kind;
      plans.push_back(&cache.get(*c.src_spec, c.dst, kind));
    }
    const Plan& first = *plans.front();
    c.dst_spec = dtensor::make_spec(mesh, first.on_view() ? first.user_dst : first.dst, c.shape, c.dtype);
    auto data = [&](const DTensorSpec& s) {
      return dtensor::ragged_mesh_dim(s.placements) < 0
                 ? s
                 : dtensor::make_spec(mesh, s.placements, dtensor::ragged_view(c.shape, s.placements), c.dtype);
    };
    c.src_data = data(*c.src_spec);
    c.dst_data = data(*c.dst_spec);
  } catch (const kernels::InvalidArgument& e) {
    got = Outcome::kInvalidArgument;
    message = e.what();
  } catch (const kernels::Unsupported& e) {
    got = Outcome::kUnsupported;
    message = e.what();
  } catch (const std::exception& e) {
    got = Outcome::kOtherError;
    message = e.what();
  }
  c.failure_planner = at;
  if (got != c.expect) {
    c.failure = fmt::format("expected {}, got {}{}{}", outcome_name(c.expect), outcome_name(got),
                            message.empty() ? "" : ": ", message);
    return;
  }
  if (got != Outcome::kOk) {
    if (message.empty() || message.find('\n') != std::string::npos)
      c.failure = fmt::format("{} with a message that is not one line: '{}'", outcome_name(got), message);
    return;
  }
  // Plan invariants.
  for (size_t i = 0; i < plans.size(); ++i) {
    const Plan& p = *plans[i];
    c.failure_planner = planners[i];
    if (p.states.empty() || (p.on_view() ? p.user_src : p.states.front()) != c.src_spec->placements ||
        (p.on_view() ? p.user_dst : p.states.back()) != c.dst_spec->placements ||
        p.states.size() != p.steps.size() + 1 || p.communicating.size() != p.steps.size()) {
      c.failure = fmt::format("malformed plan {}", dtensor::to_string(p));
      return;
    }
  }
  // Traffic: no plan moves less than the lower bound. Checked where the bound is documented
  // (one mesh dim changes) and model-free (no reduction: pure data movement among S/_S/R).
  int changed = 0;
  bool reduces = false;
  for (int m = 0; m < mesh->ndim(); ++m)
    if (mesh->size(m) > 1 && c.src_spec->placements[m] != c.dst_spec->placements[m]) {
      ++changed;
      reduces = reduces || dtensor::is_partial(c.src_spec->placements[m]);
    }
  const dtensor::Traffic bound = changed == 1 && !reduces
                                     ? dtensor::lower_bound_traffic(*c.src_spec, c.dst_spec->placements)
                                     : dtensor::Traffic{};
  for (size_t i = 0; i < plans.size(); ++i)
    if (plans[i]->traffic.max_received() < bound.max_received()) {
      c.failure_planner = planners[i];
      c.failure = fmt::format("plan {} receives {} bytes on its busiest rank, below the lower bound {}",
                              dtensor::to_string(*plans[i]), plans[i]->traffic.max_received(),
                              bound.max_received());
      return;
    }
  if (plans.size() == 2 && plans[1]->cost_us > plans[0]->cost_us * (1 + 1e-9) + 1e-9) {
    c.failure_planner = PlannerKind::kSearch;
    c.failure = fmt::format("search plan costs {} us, more than greedy's {} us: {} vs {}", plans[1]->cost_us,
                            plans[0]->cost_us, dtensor::to_string(*plans[1]), dtensor::to_string(*plans[0]));
    return;
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    bool seen = false;
    for (const Plan* q : c.plans) seen = seen || dtensor::to_string(*q) == dtensor::to_string(*plans[i]);
    if (seen) continue;
    c.plans.push_back(plans[i]);
    c.plan_kinds.push_back(planners[i]);
  }
}

// Runs one valid case on this rank with each of its routes; the first mismatch goes to `fail`.
void run_case(FuzzCase& c, const MeshComms& comms, int64_t modulus, kernels::Device device,
              const std::function<void(FuzzCase&, PlannerKind, std::string)>& fail) {
  const int rank = comms.rank();
  for (size_t i = 0; i < c.plans.size(); ++i) {
    Tensor local = testing_support::make_local(*c.src_data, rank, modulus);
    if (!device.is_cpu()) local = local.to(device);
    Tensor out = dtensor::execute(*c.plans[i], *c.src_spec, local, comms);
    std::string err = testing_support::check_redistributed(
        *c.dst_data, out, comms, modulus, testing_support::avg_tolerance(*c.src_spec));
    if (!err.empty()) fail(c, c.plan_kinds[i], fmt::format("rank {}: {}", rank, err));
  }
}

// Thrown out of a rank thread: the case it was running when something threw.
struct CaseCrash : std::runtime_error {
  CaseCrash(size_t index_, const std::string& what) : std::runtime_error(what), index(index_) {}
  size_t index;
};

int cmd_fuzz(const FuzzArgs& a, const std::string& prog) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<PlannerKind> planners;
  const Backend backend = parse_backend(a.backend, /*allow_nccl=*/false);
  const kernels::Device device = parse_device(a.device, backend);
  if (a.planner == "both") planners = {PlannerKind::kGreedy, PlannerKind::kSearch};
  else if (a.planner == "greedy" || a.planner == "search") planners = {dtensor::parse_planner(a.planner)};
  else
    throw kernels::InvalidArgument(
        fmt::format("unknown planner '{}': expected greedy, search or both", kernels::clip(a.planner)));
  if (a.cases < 0 || a.cases > kMaxFuzzCases)
    throw kernels::InvalidArgument(fmt::format("--cases {} must be in 0..{}", a.cases, kMaxFuzzCases));
  if (a.max_ranks < 1 || a.max_ranks > 64)
    throw kernels::InvalidArgument(fmt::format("--max-ranks {} must be in 1..64", a.max_ranks));
  if (a.show < 0) throw kernels::InvalidArgument(fmt::format("--show {} must be >= 0", a.show));
  const Millis case_timeout{a.timeout_ms};
  std::unique_ptr<collectives::MpiWorld> mpi;
  if (backend == Backend::kMpi) {
    try {
      mpi = std::make_unique<collectives::MpiWorld>(nullptr, nullptr, control_timeout(case_timeout));
    } catch (const kernels::Unsupported& e) {
      throw kernels::Unsupported(fmt::format("--backend mpi: {}", e.what()));
    }
  }
  const int world_size = mpi ? mpi->size() : 0;
  const int my_rank = mpi ? mpi->rank() : 0;
  const int max_ranks = mpi ? std::min(a.max_ranks, world_size) : a.max_ranks;

  // Generate: a pool of meshes, then cases drawing from it (cases on one mesh share its ranks).
  Rng g(a.seed);
  const size_t pool_size = static_cast<size_t>(std::clamp<int64_t>(a.cases / 40, 4, 48));
  std::vector<std::shared_ptr<const DeviceMesh>> meshes;
  for (size_t i = 0; i < pool_size; ++i) meshes.push_back(random_mesh(g, max_ranks, world_size, mpi != nullptr));
  std::vector<FuzzCase> cases;
  cases.reserve(a.cases);
  for (int64_t i = 0; i < a.cases; ++i) {
    const size_t m = static_cast<size_t>(g.uniform(0, static_cast<int>(pool_size) - 1));
    cases.push_back(g.percent(15) ? random_ragged_case(g, m, *meshes[m]) : random_case(g, m, *meshes[m]));
  }

  // Plan every case once (rank-independent), checking the errors of invalid ones.
  dtensor::PlanCache cache;
  std::map<Outcome, int64_t> expected_errors;
  for (FuzzCase& c : cases) {
    plan_case(c, meshes[c.mesh], planners, cache);
    if (c.expect != Outcome::kOk && c.failure.empty()) ++expected_errors[c.expect];
  }
  const auto planned = std::chrono::steady_clock::now();

  // Execute the valid cases, grouped by mesh.
  std::mutex mu;
  auto fail = [&](FuzzCase& c, PlannerKind planner, std::string what) {
    std::lock_guard lk(mu);
    if (!c.failure.empty()) return;
    c.failure = std::move(what);
    c.failure_planner = planner;
  };
  std::vector<std::vector<size_t>> groups(pool_size);
  int64_t executed = 0, routes = 0;
  for (size_t i = 0; i < cases.size(); ++i)
    if (cases[i].failure.empty() && cases[i].expect == Outcome::kOk) {
      groups[cases[i].mesh].push_back(i);
      ++executed;
      routes += static_cast<int64_t>(cases[i].plans.size());
    }
  std::unique_ptr<Communicator> world, control;
  if (mpi) {
    control = mpi->communicator(control_timeout(case_timeout));
    world = mpi->communicator(case_timeout);
  }
  bool broken = false;  // mpi: a rank threw, the call sequences no longer line up
  for (size_t gi = 0; gi < groups.size() && !broken; ++gi) {
    const std::vector<size_t>& group = groups[gi];
    if (group.empty()) continue;
    const DeviceMesh& mesh = *meshes[gi];
    if (mpi) {
      size_t current = 0;
      try {
        MeshComms comms(mesh, *world);
        if (!comms.in_mesh()) continue;
        for (; current < group.size(); ++current) {
          FuzzCase& c = cases[group[current]];
          run_case(c, comms, testing_support::exact_modulus(c.dtype, mesh.size()), device, fail);
        }
      } catch (const std::exception& e) {
        fail(cases[group[std::min(current, group.size() - 1)]], cases[group[std::min(current, group.size() - 1)]].plan_kinds.front(),
             fmt::format("rank {} threw: {}", my_rank, e.what()));
        broken = true;
      }
      continue;
    }
    size_t next = 0;
    while (next < group.size()) {
      try {
        collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& w) {
          size_t i = next;
          try {
            MeshComms comms(mesh, w);
            for (; i < group.size(); ++i) {
              FuzzCase& c = cases[group[i]];
              run_case(c, comms, testing_support::exact_modulus(c.dtype, mesh.size()), device, fail);
            }
          } catch (const std::exception& e) {
            throw CaseCrash(i, fmt::format("rank {} threw: {}", w.rank(), e.what()));
          }
        }, case_timeout);
        next = group.size();
      } catch (const CaseCrash& e) {
        const size_t at = std::min(e.index, group.size() - 1);
        fail(cases[group[at]], cases[group[at]].plan_kinds.front(), e.what());
        next = at + 1;
      } catch (const std::exception& e) {
        fail(cases[group[next]], cases[group[next]].plan_kinds.front(), e.what());
        ++next;
      }
    }
  }

  // Count (mpi: a case fails when it failed on any rank).
  std::vector<char> failed(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) failed[i] = !cases[i].failure.empty();
  if (mpi) {
    for (size_t i = 0; i < cases.size(); ++i)
      if (failed[i]) {  // each rank names its own first failure
        fmt::print(stderr, "dtensor-check fuzz: rank {}: case {}: {}\n", my_rank, i, cases[i].failure);
        break;
      }
    std::fflush(stderr);
    Tensor flags = Tensor::zeros({static_cast<int64_t>(cases.size()) + 1}, DType::kI32);
    for (size_t i = 0; i < cases.size(); ++i)
      if (failed[i]) flags.set_item({static_cast<int64_t>(i)}, 1);
    control->wait(control->all_reduce(flags, flags, kernels::ReduceOp::kMax));
    for (size_t i = 0; i < cases.size(); ++i) failed[i] = flags.item({static_cast<int64_t>(i)}) != 0;
  }
  const int64_t n_failed = std::count(failed.begin(), failed.end(), 1);
  if (my_rank == 0) {
    const double plan_s = std::chrono::duration<double>(planned - start).count();
    const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print("fuzz: seed {}, backend {}{}, planner {}, up to {} ranks, {} meshes: {} cases executed ({} routes), "
               "{} expected errors raised (InvalidArgument {}, Unsupported {}); planned in {:.2f} s, total {:.2f} s\n",
               a.seed, a.backend, device.is_cuda() ? " on cuda" : "", a.planner, max_ranks, pool_size, executed, routes,
               expected_errors[Outcome::kInvalidArgument] + expected_errors[Outcome::kUnsupported],
               expected_errors[Outcome::kInvalidArgument], expected_errors[Outcome::kUnsupported], plan_s, total_s);
    int shown = 0;
    for (size_t i = 0; i < cases.size() && shown < a.show; ++i) {
      if (!failed[i]) continue;
      ++shown;
      const FuzzCase& c = cases[i];
      fmt::print("FAIL case {} ({} planner): {}\n  reproduce: {}\n", i, dtensor::to_string(c.failure_planner),
                 c.failure.empty() ? "failed on another rank (see its stderr)" : c.failure,
                 repro_line(prog, c, *meshes[c.mesh], backend, world_size, device));
    }
    fmt::print("fuzz: {} cases, {} passed, {} failed\n", cases.size(), static_cast<int64_t>(cases.size()) - n_failed,
               n_failed);
    std::fflush(stdout);
  }
  return n_failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("dtensor-check", [&] {
    CLI::App app{"dtensor-check: contract checks of the DTensor runtime"};
    app.require_subcommand(1);
    LayoutArgs args;
    CLI::App* layout = app.add_subcommand("layout", "per-rank local shape, global offset and held indices");
    layout->add_option("--mesh", args.mesh, "mesh shape (4x2) or explicit rank array ([[0,2],[1,3]])")->required();
    layout->add_option("--shape", args.shape, "global tensor shape, comma-separated (13,2)")->required();
    layout->add_option("--placements", args.placements, "one placement per mesh dim: S(d), _S(d,sf), R, P, P(op)")->required();
    layout->add_option("--names", args.names, "mesh dim names, comma-separated (dp,tp)");
    layout->add_flag("--runs", args.runs, "print the held indices as [start,length] runs (any size)");
    app.add_subcommand("demo", "a tour of the layout rules on a few meshes");

    RedistributeArgs rargs;
    CLI::App* redistribute = app.add_subcommand(
        "redistribute", "redistribute a tensor of known values and check every rank's result");
    redistribute->add_option("--mesh", rargs.mesh, "mesh shape (2x2) or explicit rank array ([[0,2],[1,3]])")->required();
    redistribute->add_option("--shape", rargs.shape, "global tensor shape, comma-separated (7,5)")->required();
    redistribute->add_option("--from", rargs.from, "source placements, one per mesh dim (S(0),R)")->required();
    redistribute->add_option("--to", rargs.to, "target placements, one per mesh dim (R,S(1))")->required();
    redistribute->add_option("--dtype", rargs.dtype, "f32 (default), f64, bf16, f16, i32, i64 or u8");
    redistribute->add_option("--backend", rargs.backend, "local (default: one thread per rank), mpi (under mpirun) or nccl (one GPU per rank)");
    redistribute->add_option("--planner", rargs.planner, "search (default) or greedy (PyTorch's)");
    redistribute->add_option("--names", rargs.names, "mesh dim names, comma-separated (dp,tp)");
    redistribute->add_option("--device", rargs.device, "cpu or cuda (local backend: every rank's tensors on GPU 0)");
    program::add_timeout(*redistribute, rargs.timeout_ms);
    redistribute->add_option("--memory-limit", rargs.memory_limit,
                             "bytes the redistribute may allocate per rank (default: the machine's available memory)")
        ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
    redistribute->add_option("--inject-failure", rargs.inject_failure, "this rank fails at once (tests the failure path)")
        ->group("");  // hidden

    PlanArgs pargs;
    CLI::App* plan = app.add_subcommand("plan", "plan a transition on any mesh (no communication): route, bytes, timings");
    plan->add_option("--mesh", pargs.mesh, "mesh shape (4096x8) or explicit rank array")->required();
    plan->add_option("--shape", pargs.shape, "global tensor shape, comma-separated (65536,4096)")->required();
    plan->add_option("--from", pargs.from, "source placements, one per mesh dim")->required();
    plan->add_option("--to", pargs.to, "target placements, one per mesh dim")->required();
    plan->add_option("--dtype", pargs.dtype, "f32 (default), f64, bf16, f16, i32, i64 or u8");
    plan->add_option("--planner", pargs.planner, "search (default) or greedy (PyTorch's)");
    plan->add_option("--wire-dtype", pargs.wire_dtype,
                     "what the reductions move when narrower than --dtype (bf16, f8e5m2; NOTE [wire dtype])");
    plan->add_option("--rank", pargs.rank, "the rank whose schedule is timed (default: the mesh's first)");

    FuzzArgs fargs;
    CLI::App* fuzz = app.add_subcommand("fuzz", "random redistributes (invalid ones included), each checked on every rank");
    fuzz->add_option("--cases", fargs.cases, fmt::format("number of cases (default 100, at most {})", kMaxFuzzCases));
    fuzz->add_option("--seed", fargs.seed, "random seed (default 1)")->check(program::kUint64);
    fuzz->add_option("--max-ranks", fargs.max_ranks, "largest mesh (default 8, at most 64; with mpi at most the world size)");
    fuzz->add_option("--backend", fargs.backend, "local (default) or mpi (under mpirun)");
    fuzz->add_option("--planner", fargs.planner, "greedy, search or both (default)");
    fuzz->add_option("--show", fargs.show, "failures printed with a reproducer (default 10)");
    fuzz->add_option("--device", fargs.device, "cpu (default) or cuda (local backend: every rank's tensors on GPU 0)");
    program::add_timeout(*fuzz, fargs.timeout_ms);
    program::parse(app, argc, argv);

    if (redistribute->parsed()) return cmd_redistribute(rargs);
    if (plan->parsed()) return cmd_plan(pargs);
    if (fuzz->parsed()) return cmd_fuzz(fargs, argv[0]);
    if (layout->parsed()) print_layout(make_problem(args), args.runs);
    else demo();
    return program::kOk;
  });
}
