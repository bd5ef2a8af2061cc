// Redistributes in flight (NOTE [deferred plans] in dtensor/exec/executor.h) on the local
// backend: many multi-step transitions issued at once on a 2x4 mesh with rank-dependent timing
// and raw collectives interleaved, waited in any order, every rank's result checked against the
// global-index values; a RecordingCommunicator proves that every member of every group issued
// the same call sequence. Also: the FSDP pattern (the next group's all-gather in flight while a
// reduce-scatter is issued on the same group), polling with ready(), timeouts of in-flight
// transitions naming the missing ranks, and one rank's exception failing the others fast.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/error.h"
#include "support/checks.h"
#include "support/dtensor_data.h"
#include "support/recording_communicator.h"

using namespace dtensor;
using namespace std::chrono_literals;
using collectives::Communicator;
using kernels::DType;
using testing_support::Checks;
using testing_support::check_local;
using testing_support::make_local;
using testing_support::Recorder;
using testing_support::RecordingCommunicator;

namespace {

struct Transition {
  const char* src;
  const char* dst;
};

// Multi-step plans (each crossing both mesh dims) and single collectives on a (2, 4) mesh.
const std::vector<Transition> kTransitions = {
    {"S(0),S(1)", "S(1),S(0)"}, {"_S(0,4),S(0)", "S(0),S(0)"}, {"S(0),S(0)", "R,R"},      {"P,S(0)", "R,S(0)"},
    {"P,P", "S(0),R"},          {"S(1),S(0)", "S(0),S(1)"},    {"R,S(0)", "S(0),R"},      {"S(0),R", "R,S(1)"},
    {"S(0),S(0)", "_S(0,4),S(0)"}, {"P,R", "S(1),S(0)"},
};

DTensor source(const std::shared_ptr<const MeshComms>& comms, const Placements& src, const Dims& shape, int rank) {
  auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
  const DTensorSpec spec = make_spec(mesh, src, shape, DType::kF32);
  return DTensor(comms, spec, make_local(spec, rank));
}

}  // namespace

TEST_CASE("redistributes in flight: many at once, any timing, the same calls on every rank", "[dtensor][async]") {
  const DeviceMesh mesh = DeviceMesh::from_shape({2, 4});
  const std::vector<Dims> shapes = {{13, 9}, {8, 12}};
  Checks checks;
  Recorder rec;
  std::atomic<int64_t> checked{0};
  collectives::run_ranks(8, [&](Communicator& world) {
    RecordingCommunicator recorded(world, rec);
    auto comms = std::make_shared<const MeshComms>(mesh, recorded);
    const int r = world.rank();
    std::vector<RedistributeHandle> handles;
    std::vector<DTensorSpec> wants;
    Tensor extra = Tensor::full({16}, r, DType::kF64);
    std::vector<collectives::WorkPtr> raws;
    for (const Dims& shape : shapes)
      for (size_t t = 0; t < kTransitions.size(); ++t) {
        const DTensor x = source(comms, parse_placements(kTransitions[t].src), shape, r);
        handles.push_back(redistribute_async(x, parse_placements(kTransitions[t].dst)));
        wants.push_back(make_spec(std::make_shared<const DeviceMesh>(mesh), parse_placements(kTransitions[t].dst), shape,
                                  DType::kF32));
        // Timing differs between ranks, and raw collectives are issued on the mesh groups while
        // the redistributes are in flight.
        if ((r + static_cast<int>(t)) % 3 == 0) std::this_thread::sleep_for(1ms);
        if (t % 4 == 1) {
          // In place on one tensor, over both mesh dims in turn: each waits for the previous.
          Communicator& c = comms->dim(static_cast<int>(t / 4) % 2);
          if (!raws.empty()) c.wait_for(raws.back());
          raws.push_back(c.all_reduce(extra, extra, collectives::ReduceOp::kMax));
        }
      }
    for (size_t i = handles.size(); i-- > 0;) {
      const DTensor y = handles[i].wait(60s);
      const std::string err = check_local(wants[i], r, y.to_local());
      checks.check(err.empty(), fmt::format("rank {} transition {} ({}): {}", r, i % kTransitions.size(),
                                            kTransitions[i % kTransitions.size()].dst, err));
      ++checked;
    }
    for (const auto& w : raws) w->wait(60s);
    checks.check(extra.item({0}) == 7, fmt::format("rank {}: the raw all_reduces gave {}", r, extra.item({0})));
  });
  checks.report();
  CHECK(checked == 8 * static_cast<int64_t>(shapes.size() * kTransitions.size()));
  CHECK(rec.check_same_calls() == "");
  CHECK(rec.calls() > 2 * kTransitions.size());
  CHECK(rec.groups() == 4 + 2);  // 4 groups of mesh dim 0, 2 of mesh dim 1 (the world only split)
}

TEST_CASE("the recorder tells different call sequences apart", "[dtensor][async]") {
  collectives::CollectiveCall ag;
  ag.kind = collectives::CollectiveKind::kAllGather;
  ag.in_count = 4;
  ag.out_count = 8;
  collectives::CollectiveCall ag2 = ag;
  ag2.out_count = 12;
  Recorder same, different, shorter;
  for (int r = 0; r < 2; ++r) {
    same.add("g", r, ag);
    different.add("g", r, r == 0 ? ag : ag2);
    shorter.add("g", r, ag);
    if (r == 0) shorter.add("g", r, ag);
  }
  CHECK(same.check_same_calls() == "");
  CHECK_THAT(different.check_same_calls(), Catch::Contains("call #0 is all_gather(f32, 4 -> 12 elements) on rank 1"));
  CHECK_THAT(shorter.check_same_calls(), Catch::Contains("rank 1 made 1 calls, rank 0 made 2"));
}

TEST_CASE("FSDP pattern: the next all-gather in flight while a reduce-scatter is issued on the same group",
          "[dtensor][async]") {
  Checks checks;
  int64_t rounds = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), world);
    const int r = world.rank();
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const Dims shape{64, 5};
    const DTensorSpec sharded = make_spec(mesh, parse_placements("S(0)"), shape, DType::kF32);
    const DTensorSpec partial = make_spec(mesh, parse_placements("P"), shape, DType::kF32);
    const DTensorSpec full = make_spec(mesh, parse_placements("R"), shape, DType::kF32);
    const DTensor params(comms, sharded, make_local(sharded, r));
    const DTensor grads(comms, partial, make_local(partial, r));
    RedistributeHandle next = redistribute_async(params, parse_placements("R"));  // prefetch group 0
    for (int group = 0; group < 4; ++group) {
      const DTensor unsharded = next.wait(60s);
      if (group + 1 < 4) next = redistribute_async(params, parse_placements("R"));  // prefetch the next group
      RedistributeHandle reduce = redistribute_async(grads, parse_placements("S(0)"));
      const std::string e1 = check_local(full, r, unsharded.to_local());
      const std::string e2 = check_local(sharded, r, reduce.wait(60s).to_local());
      checks.check(e1.empty() && e2.empty(), fmt::format("rank {} group {}: {} {}", r, group, e1, e2));
      if (r == 0) ++rounds;
    }
  });
  checks.report();
  CHECK(rounds == 4);
}

TEST_CASE("ready() completes a redistribute nobody waits for", "[dtensor][async]") {
  Checks checks;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2, 2}), world);
    const DTensor x = source(comms, parse_placements("S(0),S(1)"), {9, 7}, world.rank());
    RedistributeHandle h = redistribute_async(x, parse_placements("S(1),S(0)"));
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!h.ready() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(100us);
    checks.check(h.ready(), "never ready");
    const DTensor y = h.wait(0ms);  // ready: returns with no time to wait
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const std::string err =
        check_local(make_spec(mesh, parse_placements("S(1),S(0)"), {9, 7}, DType::kF32), world.rank(), y.to_local());
    checks.check(err.empty(), err);
  });
  checks.report();
}

TEST_CASE("an in-flight redistribute that a rank never joins times out naming it", "[dtensor][async]") {
  // (S(0),S(1)) -> (S(1),S(0)) on (2, 4): an all-gather on mesh dim 0, then an exchange on mesh
  // dim 1. Rank 5 issues nothing. Ranks 0, 2, 3 (row 0) give up after 300 ms on the dim-1
  // exchange, which rank 1 never joined (it waits for its all-gather with rank 5); rank 1 gives up
  // later (it starts waiting at 400 ms), on the all-gather, naming rank 5.
  std::vector<std::string> messages(8);
  std::atomic<int> through{0};
  collectives::run_ranks(
      8,
      [&](Communicator& world) {
        auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2, 4}), world);
        const int r = world.rank();
        if (r == 5) {  // alive, never joining, until the others are through (however slow the machine)
          const auto deadline = std::chrono::steady_clock::now() + 30s;
          while (through.load() < 7 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
          return;
        }
        const DTensor x = source(comms, parse_placements("S(0),S(1)"), {8, 8}, r);
        RedistributeHandle h = redistribute_async(x, parse_placements("S(1),S(0)"));
        if (r == 1) std::this_thread::sleep_for(400ms);
        try {
          h.wait(300ms);
        } catch (const kernels::CommError& e) {
          messages[r] = e.what();
        }
        ++through;
      },
      30s);
  INFO(messages[1] << "\n" << messages[0]);
  CHECK_THAT(messages[1], Catch::Contains("redistribute timed out after 300 ms: all_gather on group 'mesh dim 0 [1,5]' "
                                          "[1,5] (call #0): ranks [5] never joined"));
  // Each of them gives up on its own, or fails first because another one gave up (then the
  // message carries that one's reason): either way it names rank 1.
  for (int r : {0, 2, 3})
    CHECK_THAT(messages[r], Catch::Contains("send_recv on group 'mesh dim 1 [0,1,2,3]' [0,1,2,3] (call #0)") &&
                                Catch::Contains("redistribute timed out after 300 ms") &&
                                Catch::Contains("ranks [1] never joined"));
}

TEST_CASE("one rank's exception fails the others' in-flight redistributes fast", "[dtensor][async]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    collectives::run_ranks(
        8,
        [&](Communicator& world) {
          world.set_timeout(60s);
          auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2, 4}), world);
          if (world.rank() == 6) throw std::runtime_error("rank 6 failed on purpose");
          const DTensor x = source(comms, parse_placements("S(0),S(1)"), {8, 8}, world.rank());
          redistribute_async(x, parse_placements("S(1),S(0)")).wait(60s);
        },
        60s);
  } catch (const std::exception& e) {
    what = e.what();
  }
  CHECK(what == "rank 6 failed on purpose");
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);  // far below the 60 s timeouts
}
