// Tracing (kernels/trace.h, collectives/trace.h) on the local backend: every collective is one
// event from issue to completion with its bytes, group and label, on each rank; splits inherit the
// tracer; wait() is traced; an untraced communicator records nothing; the Chrome trace text and
// the encode/decode round trip. Rank threads record into Checks; the main thread asserts.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "collectives/trace.h"
#include "kernels/error.h"
#include "kernels/trace.h"
#include "support/checks.h"

namespace {

using collectives::Communicator;
using kernels::DType;
using kernels::Tensor;
using kernels::TraceEvent;

int64_t number(const TraceEvent& e, const std::string& key) {
  for (const auto& [k, v] : e.numbers)
    if (k == key) return v;
  return -1;
}
std::string text(const TraceEvent& e, const std::string& key) {
  for (const auto& [k, v] : e.args)
    if (k == key) return v;
  return "";
}

TEST_CASE("a traced local world records each collective from issue to completion", "[trace]") {
  constexpr int kRanks = 4, kCalls = 3;
  kernels::Tracer tracer;
  testing_support::Checks checks;
  const int64_t before = kernels::Tracer::now_ns();
  collectives::run_ranks(kRanks, [&](Communicator& world) {
    world.set_tracer(&tracer);
    const int r = world.rank();
    // A pair group split off the traced world: it inherits the tracer.
    const std::vector<int> pair = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    std::unique_ptr<Communicator> sub = world.split(pair, fmt::format("pair {}", r / 2));
    checks.check(sub->tracer() == &tracer, fmt::format("rank {}: the split lost the tracer", r));
    for (int i = 0; i < kCalls; ++i) {
      Tensor in = Tensor::full({8}, r + i, DType::kF32), out = Tensor::empty({8 * kRanks}, DType::kF32);
      const collectives::TraceLabel label(world, [&] { return fmt::format("S(0) -> R step {}", i); });
      world.wait(world.all_gather(in, out));
      for (int j = 0; j < 8 * kRanks; ++j)
        checks.check(out.data<float>()[j] == static_cast<float>(j / 8 + i), fmt::format("rank {} element {}", r, j));
    }
    checks.check(world.trace_label().empty(), fmt::format("rank {}: the label outlived its scope", r));
    Tensor x = Tensor::full({5}, 1.0, DType::kF64);
    sub->all_reduce(x, x, collectives::ReduceOp::kSum)->wait(collectives::kDefaultTimeout);  // not through wait()
    checks.check(x.data<double>()[0] == 2.0, fmt::format("rank {}: all_reduce gave {}", r, x.data<double>()[0]));
  });
  checks.report();
  const int64_t after = kernels::Tracer::now_ns();
  const std::vector<TraceEvent> events = tracer.events();
  std::map<int, int> gathers, reduces, waits, splits;
  for (const TraceEvent& e : events) {
    INFO(e.name << " on " << e.lane << " of rank " << e.pid);
    CHECK(e.ts_ns >= before);
    CHECK(e.dur_ns >= 0);
    CHECK(e.ts_ns + e.dur_ns <= after);
    if (e.name == "all_gather") {
      ++gathers[e.pid];
      CHECK(e.lane == "comm world");
      CHECK(number(e, "bytes") == 8 * kRanks * 4);
      CHECK(number(e, "in_bytes") == 8 * 4);
      CHECK(number(e, "group_size") == kRanks);
      CHECK(text(e, "ranks") == "[0,1,2,3]");
      CHECK_THAT(text(e, "label"), Catch::StartsWith("S(0) -> R step "));
    } else if (e.name == "all_reduce") {
      ++reduces[e.pid];
      CHECK(e.lane == fmt::format("comm pair {}", e.pid / 2));
      CHECK(number(e, "bytes") == 5 * 8);
      CHECK(text(e, "label").empty());
    } else if (e.name == "wait") {
      ++waits[e.pid];
      CHECK(e.lane == "waits");
    } else if (e.name == "barrier") {
      ++splits[e.pid];  // split's agreement is not a submitted call: none expected
    }
  }
  CHECK(splits.empty());
  for (int r = 0; r < kRanks; ++r) {
    CHECK(gathers[r] == kCalls);
    CHECK(reduces[r] == 1);
    CHECK(waits[r] == kCalls);  // world.wait() only
  }
  CHECK(events.size() == static_cast<size_t>(kRanks * (2 * kCalls + 1)));
}

TEST_CASE("an untraced communicator records nothing and a cleared tracer stops", "[trace]") {
  kernels::Tracer tracer;
  collectives::run_ranks(2, [&](Communicator& world) {
    Tensor x = Tensor::full({3}, 1.0, DType::kF32);
    world.wait(world.all_reduce(x, x, collectives::ReduceOp::kSum));
    world.set_tracer(&tracer);
    world.wait(world.all_reduce(x, x, collectives::ReduceOp::kSum));
    world.set_tracer(nullptr);
    world.wait(world.all_reduce(x, x, collectives::ReduceOp::kSum));
  });
  const std::vector<TraceEvent> events = tracer.events();
  CHECK(std::count_if(events.begin(), events.end(), [](const TraceEvent& e) { return e.name == "all_reduce"; }) == 2);
  CHECK(events.size() == 4);  // one all_reduce and one wait per rank
}

TEST_CASE("gather_trace brings every rank's events to rank 0", "[trace]") {
  // Each rank its own tracer, as the processes of an mpi job.
  std::vector<kernels::Tracer> tracers(3);
  std::vector<std::vector<TraceEvent>> got(3);
  collectives::run_ranks(3, [&](Communicator& world) {
    const int r = world.rank();
    for (int i = 0; i <= r; ++i) {
      const kernels::TraceSpan span(&tracers[static_cast<size_t>(r)], r, "compute", "work");
    }
    got[static_cast<size_t>(r)] = collectives::gather_trace(world, tracers[static_cast<size_t>(r)]);
  });
  CHECK(got[1].empty());
  CHECK(got[2].empty());
  REQUIRE(got[0].size() == 1 + 2 + 3);
  std::map<int, int> per_rank;
  for (const TraceEvent& e : got[0]) {
    CHECK(e.name == "work");
    CHECK(e.lane == "compute");
    ++per_rank[e.pid];
  }
  CHECK(per_rank == std::map<int, int>{{0, 1}, {1, 2}, {2, 3}});
}

TEST_CASE("the Chrome trace text names ranks and lanes", "[trace]") {
  std::vector<TraceEvent> events = {
      {.name = "all_gather", .category = "collective", .lane = "comm world", .pid = 1, .ts_ns = 5000, .dur_ns = 2500,
       .args = {{"label", "S(0) -> R"}}, .numbers = {{"bytes", 64}}},
      {.name = "forward", .category = "compute", .lane = "compute", .pid = 0, .ts_ns = 3000, .dur_ns = 1000},
      {.name = "wait", .category = "waits", .lane = "waits", .pid = 1, .ts_ns = 4000, .dur_ns = -5},
  };
  const nlohmann::json doc = nlohmann::json::parse(kernels::chrome_trace_json(events));
  std::map<std::string, std::string> names;  // "pid/tid" -> name
  std::vector<nlohmann::json> xs;
  for (const nlohmann::json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "M" && (e.at("name") == "process_name" || e.at("name") == "thread_name"))
      names[fmt::format("{}/{}", e.at("pid").get<int>(), e.at("name") == "process_name" ? -1 : e.at("tid").get<int>())] =
          e.at("args").at("name");
    if (e.at("ph") == "X") xs.push_back(e);
  }
  CHECK(names["0/-1"] == "rank 0");
  CHECK(names["1/-1"] == "rank 1");
  CHECK(names["0/1"] == "compute");
  CHECK(names["1/1"] == "waits");  // lanes: compute, waits, copies, then the rest
  CHECK(names["1/2"] == "comm world");
  REQUIRE(xs.size() == 3);
  CHECK(xs[0].at("name") == "forward");  // in start order, times in us from the first event
  CHECK(xs[0].at("ts").get<double>() == 0.0);
  CHECK(xs[1].at("name") == "wait");
  CHECK(xs[1].at("dur").get<double>() == 0.0);  // never negative
  CHECK(xs[2].at("ts").get<double>() == 2.0);
  CHECK(xs[2].at("dur").get<double>() == 2.5);
  CHECK(xs[2].at("args").at("bytes") == 64);
  CHECK(xs[2].at("args").at("label") == "S(0) -> R");
  // encode / decode round trip, and decode refuses other text.
  const std::vector<TraceEvent> back = kernels::decode_trace(kernels::encode_trace(events));
  REQUIRE(back.size() == 3);
  CHECK(back[0].name == "all_gather");
  CHECK(back[0].numbers == events[0].numbers);
  CHECK(back[0].args == events[0].args);
  CHECK(back[2].dur_ns == -5);
  CHECK_THROWS_AS(kernels::decode_trace("{\"a\": 1}"), kernels::InvalidArgument);
  CHECK_THROWS_AS(kernels::decode_trace("[[1,2]]"), kernels::InvalidArgument);
}

}  // namespace
