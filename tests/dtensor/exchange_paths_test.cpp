// The executor's data paths on the local backend: exchanges through strided views (the CPU
// backends' p2p_views) and through packed per-peer buffers (exchange_packed, the path NCCL takes:
// forced here by testing_support::NoViewsCommunicator), and the reduce-scatter that runs straight
// from the local tensor when member chunks are consecutive flat ranges. Redistribute pairs over
// S / _S / R / P on meshes {4}, {2,2}, {3,2}, {2,2,2} (uneven and empty shapes, both planners) are
// checked on every rank against the global-index values; the paths are compared with each other
// DTensor by DTensor; and MeshComms' caching allocator is shown to serve repeated redistributes.
//
// Catch2 assertions are not thread-safe: rank threads record failures in a Checks object and
// the test thread reports them.
#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/exec/executor.h"
#include "kernels/allocator.h"
#include "support/dtensor_data.h"
#include "support/no_views_communicator.h"
#include "support/placement_lists.h"
#include "support/catch2_runner.h"
#include "support/checks.h"
#include "support/redistribute_check.h"

using namespace dtensor;
using collectives::CollectiveKind;
using collectives::Communicator;
using kernels::DType;
using testing_support::check_redistributed;
using testing_support::Checks;
using testing_support::make_local;
using testing_support::NoViewsCommunicator;

namespace {

constexpr collectives::Milliseconds kTimeout{30'000};


std::string describe(const DTensorSpec& src, const Placements& dst, PlannerKind planner) {
  return fmt::format("mesh {} shape [{}] {} [{}] -> [{}] ({})", to_string(*src.mesh), fmt::join(src.shape, ","),
                     kernels::to_string(src.dtype), to_string(src.placements), to_string(dst), to_string(planner));
}

// Every pair (i-th src, j-th dst) with (i * dsts + j) % stride == 0, on every shape, with both
// planners, through MeshComms over a NoViewsCommunicator-wrapped local world: every rank's
// result is checked against the global-index values. Returns the cases run (counted once).
int64_t run_packed_pairs(const Dims& mesh_shape, const std::vector<Dims>& shapes, const std::vector<Placements>& srcs,
                         const std::vector<Placements>& dsts, int stride, Checks& failures) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh_shape));
  std::mutex mu;
  int64_t cases = 0, exchanges = 0;
  PlanCache cache;  // plans are rank-independent
  collectives::run_ranks(static_cast<int>(mesh->size()), [&](Communicator& world) {
    int64_t send_recvs = 0;
    NoViewsCommunicator packed(world, [&](CollectiveKind kind, std::span<const Tensor>) {
      if (kind == CollectiveKind::kSendRecv) ++send_recvs;  // this rank's thread only
    });
    MeshComms comms(*mesh, packed);
    for (int d = 0; d < mesh->ndim(); ++d) {
      failures.check(!comms.dim(d).p2p_views(), "a mesh-dim group of the wrapped world takes views");
      failures.check(comms.dim(d).backend() == "local", "the wrapped group is not the local backend's");
    }
    int64_t index = 0;  // the same on every rank: they skip the same cases under --sample
    for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch})
      for (const Dims& shape : shapes)
        for (size_t i = 0; i < srcs.size(); ++i)
          for (size_t j = 0; j < dsts.size(); ++j) {
            if ((i * dsts.size() + j) % stride != 0) continue;
            if (!test_support::sampled(index++)) continue;
            const DTensorSpec s = make_spec(mesh, srcs[i], shape, DType::kF32);
            const DTensorSpec d = make_spec(mesh, dsts[j], shape, DType::kF32);
            const Plan& plan = cache.get(s, dsts[j], planner);
            const Tensor out = execute(plan, s, make_local(s, world.rank()), comms);
            const std::string err = check_redistributed(d, out, comms);
            if (!err.empty())
              failures.add(fmt::format("{} rank {}: {}; plan {}", describe(s, dsts[j], planner), world.rank(), err,
                                       to_string(plan)));
            if (world.rank() == 0) {
              std::lock_guard lk(mu);
              ++cases;
            }
          }
    std::lock_guard lk(mu);
    exchanges += send_recvs;
  }, kTimeout);
  failures.check(exchanges > 0, fmt::format("mesh {}: no send_recv reached the wrapped communicators",
                                            to_string(*mesh)));
  return cases;
}

// Rank threads of a mesh with two MeshComms on each rank: `views` over the local world and
// `packed` over the same world wrapped in a NoViewsCommunicator whose observer records the data
// pointers of the reduce_scatter inputs this rank passes.
struct TwoPaths {
  std::shared_ptr<const MeshComms> views, packed;
  std::shared_ptr<std::vector<const void*>> rs_inputs;
};

void on_two_paths(const Dims& mesh_shape, const std::function<void(Communicator&, const TwoPaths&)>& body) {
  const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    TwoPaths p;
    p.rs_inputs = std::make_shared<std::vector<const void*>>();
    auto rs = p.rs_inputs;
    NoViewsCommunicator wrapped(world, [rs](CollectiveKind kind, std::span<const Tensor> buffers) {
      if (kind == CollectiveKind::kReduceScatter) rs->push_back(buffers[0].numel() ? buffers[0].data_ptr() : nullptr);
    });
    p.views = std::make_shared<const MeshComms>(mesh, world);
    p.packed = std::make_shared<const MeshComms>(mesh, wrapped);
    body(world, p);
  }, kTimeout);
}

}  // namespace

TEST_CASE("NoViewsCommunicator forwards every call, refuses views and wraps its splits", "[dtensor][packed]") {
  Checks failures;
  collectives::run_ranks(4, [&](Communicator& world) {
    std::vector<CollectiveKind> seen;
    NoViewsCommunicator c(world, [&](CollectiveKind kind, std::span<const Tensor>) { seen.push_back(kind); });
    const int r = c.rank(), n = c.size();
    failures.check(r == world.rank() && c.ranks() == world.ranks() && c.name() == world.name() &&
                       c.backend() == "local" && c.timeout() == world.timeout() && &c.inner() == &world,
                   "identity not forwarded");
    failures.check(world.p2p_views() && !c.p2p_views(), "p2p_views not overridden");
    Tensor x = Tensor::full({3}, r + 1, DType::kF32), all = Tensor::zeros({3 * n}, DType::kF32);
    c.wait(c.all_reduce(x, x, collectives::ReduceOp::kSum));
    c.wait(c.all_gather(x, all));
    failures.check(x.item({0}) == 10 && all.item({3 * n - 1}) == 10, "all_reduce / all_gather results");
    Tensor rs = Tensor::zeros({3}, DType::kF32);
    c.wait(c.reduce_scatter(Tensor::full({3 * n}, 1, DType::kF32), rs, collectives::ReduceOp::kSum));
    failures.check(rs.item({2}) == n, "reduce_scatter result");
    Tensor b = Tensor::full({2}, r, DType::kI64);
    c.begin_batch();
    c.broadcast(b, 2);
    c.wait(c.end_batch());
    failures.check(b.item({1}) == 2, "batched broadcast result");
    Tensor a2a = Tensor::zeros({n}, DType::kI32);
    c.wait(c.all_to_all(Tensor::full({n}, r, DType::kI32), a2a));
    failures.check(a2a.item({3}) == 3, "all_to_all result");
    Tensor sc = Tensor::zeros({1}, DType::kI32);
    c.wait(c.scatter(Tensor::arange({n}, DType::kI32), sc, 0));
    failures.check(sc.item({0}) == r, "scatter result");
    std::vector<int64_t> counts(static_cast<size_t>(n), 1);
    Tensor v_out = Tensor::zeros({n}, DType::kI32);
    c.wait(c.all_to_all_v(Tensor::full({n}, r, DType::kI32), counts, v_out, counts));
    failures.check(v_out.item({1}) == 1, "all_to_all_v result");
    c.wait(c.barrier());
    // send_recv: contiguous buffers pass; a strided one is refused before anything is posted.
    const Tensor m = Tensor::full({4, 4}, r, DType::kF32);
    Tensor got = Tensor::zeros({4}, DType::kF32);
    const std::vector<collectives::P2POp> bad = {collectives::P2POp::send(m.narrow(1, 0, 1), (r + 1) % n)};
    try {
      c.send_recv(bad);
      failures.add("a strided send_recv buffer was accepted");
    } catch (const kernels::InvalidArgument& e) {
      failures.check(std::string(e.what()).find("send/recv tensor must be contiguous") != std::string::npos, e.what());
    }
    const std::vector<collectives::P2POp> ok = {collectives::P2POp::send(m.narrow(0, 1, 1), (r + 1) % n),
                                                collectives::P2POp::recv(got, (r + n - 1) % n)};
    c.wait(c.send_recv(ok));
    failures.check(got.item({3}) == (r + n - 1) % n, "send_recv result");
    const std::vector<CollectiveKind> want = {
        CollectiveKind::kAllReduce, CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kBroadcast,
        CollectiveKind::kAllToAll,  CollectiveKind::kScatter,   CollectiveKind::kAllToAllV,     CollectiveKind::kBarrier,
        CollectiveKind::kSendRecv};
    failures.check(seen == want, "the observer did not see every call once, in order");
    // split wraps the new group (and shares the observer); a timeout set on the wrapper is inherited.
    c.set_timeout(collectives::Milliseconds{12'345});
    const std::vector<int> pair = {std::max(r, r ^ 1), std::min(r, r ^ 1)};  // {1,0} and {3,2}
    auto sub = c.split(pair, "pair");
    failures.check(dynamic_cast<NoViewsCommunicator*>(sub.get()) != nullptr && !sub->p2p_views(), "split is not wrapped");
    failures.check(sub->name() == "pair" && sub->ranks() == pair && sub->rank() == (r % 2 == 0 ? 1 : 0) &&
                       sub->timeout() == collectives::Milliseconds{12'345},
                   "split identity or timeout");
    sub->wait(sub->barrier());
    failures.check(seen.size() == want.size() + 1 && seen.back() == CollectiveKind::kBarrier, "split lost the observer");
  }, kTimeout);
  failures.report();
}

TEST_CASE("packed exchange path: S/R/P pairs through a communicator without strided views",
          "[dtensor][redistribute][packed]") {
  const std::vector<Placement> src_options = {Replicate{}, Shard{0}, Shard{1}, Partial{}};
  const std::vector<Placement> dst_options = {Replicate{}, Shard{0}, Shard{1}};
  const std::vector<Dims> shapes = {{5, 7}, {8, 3}, {1, 9}, {0, 4}};
  Checks failures;
  int64_t cases = 0;
  for (const Dims& mesh : std::vector<Dims>{{4}, {2, 2}, {3, 2}})
    cases += run_packed_pairs(mesh, shapes, testing_support::placement_lists(mesh.size(), src_options),
                              testing_support::placement_lists(mesh.size(), dst_options), 1, failures);
  // {2,2,2}: every third of the 64 x 27 pairs.
  cases += run_packed_pairs({2, 2, 2}, shapes, testing_support::placement_lists(3, src_options),
                            testing_support::placement_lists(3, dst_options), 3, failures);
  INFO(cases << " cases");
  failures.report();
  CHECK(cases > 4000 / test_support::sample_stride());
}

TEST_CASE("packed exchange path: StridedShard pairs, uneven, with a first mesh dim of 3",
          "[dtensor][redistribute][packed][strided]") {
  const std::vector<Placement> options = {Replicate{}, Shard{0}, StridedShard{0, 2}, StridedShard{0, 3}, Shard{1}};
  Checks failures;
  int64_t cases = 0;
  for (const Dims& mesh : std::vector<Dims>{{3, 2}, {2, 2}, {4}})
    cases += run_packed_pairs(mesh, {{7, 2}, {8, 3}, {13, 1}}, testing_support::placement_lists(mesh.size(), options),
                              testing_support::placement_lists(mesh.size(), options), mesh.size() == 1 ? 1 : 2, failures);
  INFO(cases << " cases");
  failures.report();
  CHECK(cases > 1500 / test_support::sample_stride());
}

TEST_CASE("packed exchange path: batched redistribute (several tensors per buffer)", "[dtensor][redistribute][packed][batch]") {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  std::atomic<int64_t> checked{0};
  for (const char* pair : {"S(0),S(0)|R,R", "P,S(0)|S(0),R", "R,R|S(1),S(0)", "S(0),S(1)|S(1),S(0)", "_S(0,2),S(0)|S(1),R"}) {
    const std::string text(pair);
    const Placements src = parse_placements(text.substr(0, text.find('|')));
    const Placements dst = parse_placements(text.substr(text.find('|') + 1));
    Checks failures;
    collectives::run_ranks(4, [&](Communicator& world) {
      NoViewsCommunicator packed(world);
      MeshComms comms(*mesh, packed);
      std::vector<DTensorSpec> specs, dsts;
      std::vector<Tensor> locals;
      for (const Dims& shape : std::vector<Dims>{{8, 4}, {5, 3}, {1, 6}, {0, 2}, {12, 12}}) {
        specs.push_back(make_spec(mesh, src, shape, DType::kF32));
        dsts.push_back(make_spec(mesh, dst, shape, DType::kF32));
        locals.push_back(make_local(specs.back(), world.rank()));
      }
      for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch}) {
        std::vector<Dims> shapes;  // one plan valid for every shape of the batch
        for (const DTensorSpec& spec : specs) shapes.push_back(spec.shape);
        const Plan plan = plan_redistribute(specs[0], dst, planner, {}, false, shapes);
        const std::vector<Tensor> out = execute_batch(plan, specs, locals, comms);
        for (size_t i = 0; i < out.size(); ++i) {
          const std::string err = testing_support::check_local(dsts[i], world.rank(), out[i]);
          if (!err.empty()) failures.add(fmt::format("{} tensor {} rank {}: {}", describe(specs[i], dst, planner), i, world.rank(), err));
          ++checked;
        }
      }
    }, kTimeout);
    INFO(text);
    failures.report();
  }
  CHECK(checked == 5 * 4 * 2 * 5);  // pairs x ranks x planners x tensors
}

TEST_CASE("views path and packed path give identical DTensors", "[dtensor][redistribute][packed]") {
  struct Case {
    Dims mesh;
    Dims shape;
    DType dtype;
    const char* src;
    const char* dst;
  };
  const std::vector<Case> cases = {
      {{4}, {9, 10}, DType::kF32, "S(0)", "S(1)"},
      {{4}, {13, 6}, DType::kBF16, "S(1)", "_S(0,2)"},
      {{4}, {3, 5}, DType::kI64, "_S(0,2)", "S(1)"},
      {{2, 2}, {7, 5}, DType::kBF16, "S(0),S(1)", "S(1),S(0)"},
      {{2, 2}, {6, 9}, DType::kF32, "R,S(0)", "S(1),R"},
      {{2, 2}, {8, 6}, DType::kF64, "_S(0,2),S(0)", "S(0),S(1)"},
      {{3, 2}, {13, 4}, DType::kI64, "S(0),S(0)", "S(1),S(0)"},
      {{3, 2}, {0, 4}, DType::kF32, "S(1),R", "R,S(0)"},
      {{3, 2}, {5, 11}, DType::kU8, "P,S(1)", "S(1),S(0)"},
      {{2, 2, 2}, {6, 7}, DType::kF64, "S(0),S(1),S(0)", "S(1),S(0),R"},
      {{2, 2, 2}, {9, 1}, DType::kI32, "S(0),S(0),S(0)", "R,S(0),R"},
  };
  std::atomic<int64_t> compared{0};
  for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch})
    for (const Case& c : cases) {
      Checks failures;
      const Placements src = parse_placements(c.src), dst = parse_placements(c.dst);
      on_two_paths(c.mesh, [&](Communicator& world, const TwoPaths& p) {
        if (world.rank() == 0) ++compared;
        for (int d = 0; d < p.views->mesh().ndim(); ++d) failures.check(p.views->dim(d).p2p_views(), "views group without views");
        auto mesh = std::make_shared<const DeviceMesh>(p.views->mesh());
        const DTensorSpec spec = make_spec(mesh, src, c.shape, c.dtype);
        // Contiguous locals on the views path; on the packed path the same values in a strided
        // view (columns of a wider buffer), so pieces of a strided local get packed too.
        const Tensor local = make_local(spec, world.rank());
        Tensor wide = Tensor::zeros({local.size(0), local.size(1) + 3}, c.dtype);
        Tensor strided = wide.narrow(1, 2, local.size(1));
        strided.copy_(local);
        const DTensor a = DTensor(p.views, spec, local).redistribute(dst, {planner});
        const DTensor b = DTensor(p.packed, spec, strided).redistribute(dst, {planner});
        const std::string what = fmt::format("{} rank {}", describe(spec, dst, planner), world.rank());
        failures.check(a.to_local().shape() == b.to_local().shape(), what + ": local shapes differ");
        if (a.to_local().shape() == b.to_local().shape())
          failures.check(kernels::equal(a.to_local(), b.to_local()), what + ": local tensors differ");
        failures.check(!a.to_local().shares_storage_with(local), what + ": the result aliases the input");
        failures.check(!b.to_local().shares_storage_with(wide), what + ": the packed result aliases the input");
        const std::string err = check_redistributed(make_spec(mesh, dst, c.shape, c.dtype), a.to_local(), *p.views);
        if (!err.empty()) failures.add(what + ": " + err);
      });
      failures.report();
    }
  CHECK(compared == 2 * static_cast<int64_t>(cases.size()));
}

TEST_CASE("reduce-scatter fast path: no packing, same result as other routes", "[dtensor][redistribute][packed]") {
  struct Case {
    Dims mesh;
    Dims shape;
    DType dtype;
    const char* src;
    const char* dst;
    bool fast;  // member chunks are consecutive flat ranges of the local tensor
  };
  const std::vector<Case> cases = {
      {{4}, {8, 3}, DType::kF32, "P", "S(0)", true},
      {{4}, {12, 5}, DType::kI64, "P(max)", "S(0)", true},
      {{4}, {4, 3, 2}, DType::kBF16, "P", "S(0)", true},
      {{2, 2}, {8, 3}, DType::kF32, "S(0),P", "S(0),S(0)", true},
      {{2, 2}, {8, 6}, DType::kF64, "R,P", "R,S(0)", true},
      {{4}, {8, 4}, DType::kF32, "P", "S(1)", false},      // column chunks: packed
      {{4}, {7, 3}, DType::kF32, "P", "S(0)", false},      // uneven: exchange and local reduce
      {{3, 2}, {6, 4}, DType::kI32, "P,R", "_S(0,2),R", false},
  };
  std::atomic<int64_t> compared{0};
  for (const Case& c : cases) {
    Checks failures;
    const Placements src = parse_placements(c.src), dst = parse_placements(c.dst);
    Placements via_r = src;  // the same target through Replicate first: all_reduce, then a local chunk
    for (Placement& pl : via_r)
      if (is_partial(pl)) pl = Replicate{};
    on_two_paths(c.mesh, [&](Communicator& world, const TwoPaths& p) {
      auto mesh = std::make_shared<const DeviceMesh>(p.views->mesh());
      const DTensorSpec spec = make_spec(mesh, src, c.shape, c.dtype);
      const Tensor local = make_local(spec, world.rank());
      const std::string what = fmt::format("{} rank {}", describe(spec, dst, PlannerKind::kSearch), world.rank());
      if (world.rank() == 0) ++compared;
      const DTensor x_packed(p.packed, spec, local);
      const size_t before = p.rs_inputs->size();
      const DTensor direct = x_packed.redistribute(dst);
      const DTensor views = DTensor(p.views, spec, local).redistribute(dst);
      const DTensor routed = DTensor(p.views, spec, local).redistribute(via_r).redistribute(dst);
      for (const DTensor* other : {&views, &routed}) {
        const bool same_shape = direct.to_local().shape() == other->to_local().shape();
        failures.check(same_shape && kernels::equal(direct.to_local(), other->to_local()),
                       what + (other == &views ? ": differs from the views path" : ": differs from the route through R"));
      }
      const std::string err = check_redistributed(make_spec(mesh, dst, c.shape, c.dtype), direct.to_local(), *p.packed);
      if (!err.empty()) failures.add(what + ": " + err);
      // The fast path hands the local tensor itself to reduce_scatter; the others pack first.
      const std::vector<const void*>& rs = *p.rs_inputs;
      if (c.fast) {
        failures.check(rs.size() == before + 1 && rs.back() == local.data_ptr(),
                       what + ": reduce_scatter did not run straight from the local tensor");
      } else {
        for (size_t k = before; k < rs.size(); ++k)
          failures.check(rs[k] != local.data_ptr(), what + ": reduce_scatter ran from the local tensor");
      }
    });
    failures.report();
  }
  CHECK(compared == static_cast<int64_t>(cases.size()));
}

TEST_CASE("MeshComms' caching allocator serves repeated redistributes", "[dtensor][redistribute][allocator]") {
  const DeviceMesh mesh = DeviceMesh::from_shape({4});
  const Dims shape{1024, 1024};  // 4 MiB of f32: 1 MiB per rank
  auto shared = std::make_shared<kernels::CachingAllocator>();
  Checks failures;
  collectives::run_ranks(4, [&](Communicator& world) {
    NoViewsCommunicator wrapped(world);
    for (bool packed : {false, true}) {
      auto comms = std::make_shared<const MeshComms>(mesh, packed ? static_cast<Communicator&>(wrapped) : world);
      auto cache = std::dynamic_pointer_cast<kernels::CachingAllocator>(comms->allocator());
      const std::string what = fmt::format("{} path, rank {}", packed ? "packed" : "views", world.rank());
      failures.check(cache != nullptr, what + ": the default allocator is not a CachingAllocator");
      if (!cache) return;
      auto m = std::make_shared<const DeviceMesh>(mesh);
      const DTensorSpec spec = make_spec(m, parse_placements("S(0)"), shape, DType::kF32);
      const DTensor x(comms, spec, make_local(spec, world.rank()));
      {
        const DTensor y = x.redistribute(parse_placements("S(1)"));
        const std::string err = check_redistributed(make_spec(m, parse_placements("S(1)"), shape, DType::kF32), y.to_local(), *comms);
        if (!err.empty()) failures.add(what + ": " + err);
      }
      const kernels::CachingAllocator::Stats first = cache->stats();
      failures.check(first.misses > 0, what + ": the first redistribute took nothing from the allocator");
      // The local backend keeps a call's buffers until the last member has left the call, so a
      // rank may start its next redistribute before its blocks of the previous one are back: the
      // second run may miss where the first allocated. Blocks of run k-2 are surely back when run
      // k allocates (every member joined run k-1, so all left run k-2), so the cache holds at most
      // two runs' worth: over three runs, misses <= 2 x the first run's, hits >= the first's misses.
      for (int run = 0; run < 2; ++run) {
        const DTensor y = x.redistribute(parse_placements("S(1)"));
      }
      const kernels::CachingAllocator::Stats third = cache->stats();
      failures.check(third.hits >= first.misses, fmt::format("{}: {} cache hits over three runs (first run: {} misses)",
                                                             what, third.hits, first.misses));
      failures.check(third.misses <= 2 * first.misses,
                     fmt::format("{}: {} misses over three runs (first run: {})", what, third.misses, first.misses));
    }
    // One allocator shared by every rank's MeshComms (rank threads allocate concurrently).
    auto comms = std::make_shared<const MeshComms>(mesh, world, std::vector<std::vector<int>>{}, shared);
    failures.check(comms->allocator() == shared, "the allocator passed to MeshComms is not the one it uses");
    auto m = std::make_shared<const DeviceMesh>(mesh);
    const DTensorSpec spec = make_spec(m, parse_placements("S(1)"), shape, DType::kF32);
    const DTensor x(comms, spec, make_local(spec, world.rank()));
    // 12 allocations of one size. When a rank allocates in run k, every block of runs <= k-2 is
    // back (see above), so a miss needs all of <= 7 live blocks in use: at most 8 misses.
    for (int i = 0; i < 3; ++i) {
      const DTensor y = x.redistribute(parse_placements("S(0)"));
      const std::string err = check_redistributed(make_spec(m, parse_placements("S(0)"), shape, DType::kF32), y.to_local(), *comms);
      if (!err.empty()) failures.add(fmt::format("shared allocator, rank {}: {}", world.rank(), err));
    }
  }, kTimeout);
  failures.report();
  INFO("shared: " << shared->stats().hits << " hits, " << shared->stats().misses << " misses");
  CHECK(shared->stats().misses >= 4);
  CHECK(shared->stats().hits >= 4);
}
