// The memory check before a transition allocates (NOTE [memory limit] in kernels/allocator.h,
// dtensor/exec/memory_check.h): the bytes a transition needs per rank (the allocator's side is in
// tests/kernels/allocator_test.cpp); a redistribute needing more than the allocator
// has fails on every rank with a ResourceError naming the bytes needed and available, before
// allocating anything (both the cached issue_cached path and the plan path); one that fits runs and
// is right; one larger than the machine (a 0-stride input: nothing big is allocated) fails
// through the default path with the machine's figure, not the OOM killer; the gauge re-reads for
// any transition above half its last figure.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/exec/executor.h"
#include "dtensor/exec/memory_check.h"
#include "kernels/allocator.h"
#include "kernels/error.h"
#include "support/checks.h"
#include "support/dtensor_data.h"

using namespace dtensor;
using collectives::Communicator;
using kernels::DType;
using testing_support::Checks;

namespace {

// A CachingAllocator with a limit that counts the allocations made through it.
class CountingAllocator final : public kernels::Allocator {
 public:
  explicit CountingAllocator(size_t limit) : inner(options(limit)) {}
  void* allocate(size_t nbytes, kernels::Device device) override {
    ++count;
    return inner.allocate(nbytes, device);
  }
  void deallocate(void* p, size_t nbytes, kernels::Device device) noexcept override {
    inner.deallocate(p, nbytes, device);
  }
  int64_t available_bytes(kernels::Device device) const override { return inner.available_bytes(device); }
  int64_t limit_bytes() const override { return inner.limit_bytes(); }
  static kernels::CachingAllocator::Options options(size_t limit) {
    kernels::CachingAllocator::Options o;
    o.limit_bytes = limit;
    return o;
  }
  std::atomic<int64_t> count{0};
  kernels::CachingAllocator inner;
};

// Reports a fixed figure and counts how often it was asked.
class FixedAllocator final : public kernels::Allocator {
 public:
  explicit FixedAllocator(int64_t available) : available(available) {}
  void* allocate(size_t nbytes, kernels::Device device) override { return kernels::system_allocate(nbytes, device); }
  void deallocate(void* p, size_t nbytes, kernels::Device device) noexcept override {
    kernels::system_deallocate(p, nbytes, device);
  }
  int64_t available_bytes(kernels::Device) const override {
    ++reads;
    return available;
  }
  int64_t available;
  mutable std::atomic<int64_t> reads{0};
};

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

}  // namespace

namespace {

// The DTensor path: the transition's plan from the communicators' cache, then the executor with
// this rank's recipe for it.
ExecHandle issue_cached_to(const DTensorSpec& spec, const Placements& dst, const Tensor& local, const MeshComms& comms) {
  const Transition t = make_transition(spec, dst, PlannerKind::kGreedy);
  const PlanCache::Found found = comms.plans().find(t);
  return issue_cached(t, *found.plan, found.recipe, spec, local, comms);
}

}  // namespace

TEST_CASE("transition_bytes: HSDP's all-reduce after the reduce-scatter counts nothing (in place)",
          "[dtensor][memory][hsdp]") {
  Checks checks;
  int ran = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
    MeshComms comms(*mesh, world);
    const auto spec = make_spec(mesh, parse_placements("P,P"), {4000}, DType::kF32);
    const Plan plan = plan_redistribute(spec, parse_placements("R,S(0)"), PlannerKind::kSearch);
    const StepDTypes f32{DType::kF32, DType::kF32, DType::kF32, false};
    const std::vector<StepDTypes> dtypes(plan.steps.size(), f32);
    const DTensorSpec* specs[] = {&spec};
    checks.check(plan.steps.size() == 2 && std::holds_alternative<ReduceScatter>(plan.steps[0]) &&
                     std::holds_alternative<AllReduce>(plan.steps[1]),
                 fmt::format("{}: expected a reduce-scatter, then an all-reduce", to_string(plan)));
    // The reduce-scatter's packed input (16000) and reduced chunk (8000); its result (8000)
    // unless it is the caller's out; the all-reduce: nothing.
    const int64_t with_out = transition_bytes(plan, specs, comms, dtypes, true);
    const int64_t without = transition_bytes(plan, specs, comms, dtypes, false);
    checks.check(with_out == 24000, fmt::format("[P,P] -> [R,S(0)] into out: {} bytes, expected 24000", with_out));
    checks.check(without == 32000, fmt::format("[P,P] -> [R,S(0)]: {} bytes, expected 32000", without));
    if (comms.rank() == 0) ++ran;
  });
  checks.report();
  CHECK(ran == 1);
}

TEST_CASE("transition_bytes counts results and staging in the steps' dtypes, not the caller's out",
          "[dtensor][memory]") {
  Checks checks;
  int ran = 0;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse("2"));
    MeshComms comms(*mesh, world);
    const auto spec = make_spec(mesh, parse_placements("S(0)"), {2048}, DType::kF32);
    const Plan gather = plan_redistribute(spec, parse_placements("R"), PlannerKind::kGreedy);
    const DTensorSpec* specs[] = {&spec, &spec};
    const StepDTypes f32{DType::kF32, DType::kF32, DType::kF32, false};
    // All-gather through views (local backend): the result only, 2048 f32 elements.
    checks.check(transition_bytes(gather, std::span(specs, 1), comms, std::span(&f32, 1), false) == 8192,
                 "S(0)->R of f32[2048]: 8192 bytes");
    checks.check(transition_bytes(gather, std::span(specs, 1), comms, std::span(&f32, 1), true) == 0,
                 "S(0)->R into out: nothing");
    // A batch of two all-gathers: the results plus the flat send and receive buffers.
    checks.check(transition_bytes(gather, std::span(specs, 2), comms, std::span(&f32, 1), false) ==
                     2 * 8192 + (2 * 4096 + 2 * 8192),
                 "S(0)->R of two f32[2048]");
    // P(sum) -> R of bf16 reduced in f32: the f32 input copy and reduced buffer, the bf16 result.
    const auto partial = make_spec(mesh, parse_placements("P"), {1000}, DType::kBF16);
    const Plan reduce = plan_redistribute(partial, parse_placements("R"), PlannerKind::kGreedy);
    const StepDTypes mixed{DType::kBF16, DType::kBF16, DType::kF32, false};
    const DTensorSpec* p[] = {&partial};
    const int64_t got = transition_bytes(reduce, p, comms, std::span(&mixed, 1), false);
    checks.check(got == 4000 + 4000 + 2000, fmt::format("P->R bf16 in f32: {} bytes", got));
    if (comms.rank() == 0) ++ran;
  });
  checks.report();
  CHECK(ran == 1);
}

TEST_CASE("a redistribute past the allocator's limit fails on every rank naming both numbers, allocating nothing",
          "[dtensor][memory]") {
  Checks checks;
  std::atomic<int> refused{0}, fitted{0};
  collectives::run_ranks(2, [&](Communicator& world) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse("2"));
    const auto spec = make_spec(mesh, parse_placements("S(0)"), {2048}, DType::kF32);
    const int rank = world.rank();
    const Tensor local = testing_support::make_local(spec, rank);
    const Plan plan = plan_redistribute(spec, parse_placements("R"), PlannerKind::kGreedy);
    {
      // 8192 bytes needed, 4096 allowed: the cached path (issue_to) and the plan path (issue).
      auto alloc = std::make_shared<CountingAllocator>(4096);
      MeshComms comms(*mesh, world, {}, alloc);
      for (int path = 0; path < 2; ++path) {
        try {
          if (path == 0) (void)issue_cached_to(spec, parse_placements("R"), local, comms);
          else (void)issue(plan, spec, local, comms);
          checks.add(fmt::format("rank {} path {}: no ResourceError", rank, path));
        } catch (const kernels::ResourceError& e) {
          const std::string m = e.what();
          checks.check(m.find("8192 bytes") != std::string::npos && m.find("4096 bytes") != std::string::npos &&
                           m.find("[S(0)] -> [R]") != std::string::npos &&
                           m.find(fmt::format("rank {}", rank)) != std::string::npos,
                       fmt::format("rank {} path {}: message '{}'", rank, path, m));
          ++refused;
        } catch (...) {
          checks.add(fmt::format("rank {} path {}: {}", rank, path, message_of(std::current_exception())));
        }
      }
      checks.check(alloc->count == 0, fmt::format("rank {}: {} allocations before the refusal", rank, alloc->count.load()));
      checks.check(alloc->inner.stats().in_use_bytes == 0, "bytes left in use");
    }
    {
      // 8192 bytes fit in 16384 (room for the first call's result, which the communicator may
      // still hold while the second is checked): runs, right values.
      auto alloc = std::make_shared<CountingAllocator>(16384);
      MeshComms comms(*mesh, world, {}, alloc);
      DTensorSpec dst = spec;
      dst.placements = parse_placements("R");
      for (int path = 0; path < 2; ++path) {
        try {
          const Tensor out = path == 0 ? issue_cached_to(spec, parse_placements("R"), local, comms).wait()[0]
                                       : execute(plan, spec, local, comms);
          const std::string err = testing_support::check_local(dst, rank, out);
          checks.check(err.empty(), fmt::format("rank {} path {}: {}", rank, path, err));
          checks.check(alloc->count > 0, "the result came from the allocator");
          ++fitted;
        } catch (...) {
          checks.add(fmt::format("rank {} path {}: {}", rank, path, message_of(std::current_exception())));
        }
      }
    }
  });
  checks.report();
  CHECK(refused == 4);
  CHECK(fitted == 4);
}

TEST_CASE("a redistribute larger than the machine fails with the machine's figure, not the OOM killer",
          "[dtensor][memory]") {
  Checks checks;
  std::atomic<int> refused{0};
  // f32[2^40] S(0) -> R: every rank would hold 4 TiB. The input is a 0-stride view of one
  // element, so nothing big exists.
  const int64_t n = int64_t{1} << 40;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse("2"));
    MeshComms comms(*mesh, world);  // the default allocator: the machine's memory
    const auto spec = make_spec(mesh, parse_placements("S(0)"), {n}, DType::kF32);
    const Tensor local = Tensor::zeros({1}, DType::kF32).as_strided({n / 2}, {0}, 0);
    try {
      (void)issue_cached_to(spec, parse_placements("R"), local, comms);
      checks.add("no ResourceError");
    } catch (const kernels::ResourceError& e) {
      const std::string m = e.what();
      checks.check(m.find(std::to_string(n * 4) + " bytes") != std::string::npos &&
                       m.find("the machine has") != std::string::npos,
                   fmt::format("message '{}'", m));
      ++refused;
    } catch (...) {
      checks.add(message_of(std::current_exception()));
    }
  });
  checks.report();
  CHECK(refused == 2);
}

TEST_CASE("the memory gauge: a need above half the last figure reads afresh; past it, an error naming both",
          "[dtensor][memory]") {
  MemoryGauge gauge;
  FixedAllocator alloc(1000);
  const kernels::Device cpu{};
  auto what = [] { return std::string("the transition"); };
  gauge.check(0, &alloc, cpu, 0, what);
  CHECK(alloc.reads == 0);  // nothing needed, nothing read
  gauge.check(600, &alloc, cpu, 0, what);
  CHECK(alloc.reads == 1);
  gauge.check(600, &alloc, cpu, 0, what);  // above half of 1000: fresh
  CHECK(alloc.reads == 2);
  alloc.available = 500;
  try {
    gauge.check(501, &alloc, cpu, 3, what);  // above half of 1000: fresh, 500 left
    FAIL("no ResourceError");
  } catch (const kernels::ResourceError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("the transition needs 501 bytes") &&
                                          Catch::Contains("rank 3") && Catch::Contains("500 bytes available"));
  }
  CHECK(alloc.reads == 3);
  // A small need after a read passes; each one lowers the figure the next is compared with,
  // so a run of them reads afresh at the latest when they add up to half the figure.
  alloc.available = 1000;
  gauge.check(1000, &alloc, cpu, 0, what);
  const int64_t before = alloc.reads;
  for (int i = 0; i < 20; ++i) gauge.check(100, &alloc, cpu, 0, what);
  CHECK(alloc.reads - before >= 2);  // 1000 read, then 900, 800, ... trusted down to 100 left
}
