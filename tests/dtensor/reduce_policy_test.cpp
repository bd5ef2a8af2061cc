// One precision policy for every reduction (NOTE [reduce policy] in dtensor/exec/executor.h):
// bf16 / f16 data reduced in f32 equals the f32 reduction of the same values rounded once, on
// every reducing path (reduce_scatter straight from the input, packed, uneven = exchange + local
// reduce, all_reduce, two reducing steps); FSDP2's divide rules: f = group size reproduces
// P(avg) bit for bit, another f is a pre-multiplied sum, f16 pre-divides by ~sqrt(f) so a sum that
// overflows f16 does not, force_sum divides after; bad policies are refused.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "support/checks.h"

using namespace dtensor;
using collectives::Communicator;
using kernels::DType;
using testing_support::Checks;

namespace {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// This rank's contribution to a Partial tensor (or its shard): a function of (seed, rank,
// global index) with 2-3 significant decimal digits, so sums round differently in bf16 / f16
// and in f32. `value` replaces the random draw when given.
Tensor contribution(const DTensorSpec& spec, int rank, uint64_t seed, std::optional<double> value = std::nullopt) {
  const ShardLayout l = *spec.layout(rank);
  std::vector<std::vector<int64_t>> idx;
  for (int t = 0; t < spec.tensor_ndim(); ++t) idx.push_back(l.indices(t));
  Tensor t = Tensor::empty(l.local_shape, DType::kF64);
  t.fill_index_([&](std::span<const int64_t> local) {
    if (value) return *value;
    uint64_t flat = 0;
    for (int d = 0; d < spec.tensor_ndim(); ++d) flat = flat * spec.shape[d] + idx[d][local[d]];
    const uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(rank) * 1000003 + flat));
    return static_cast<double>(static_cast<int64_t>(h % 20001) - 10000) / 64.0;
  });
  return t.to(spec.dtype);
}

struct Case {
  Dims mesh;
  Dims shape;
  const char* src;
  const char* dst;
};

// Every reducing path of the executor: reduce_scatter straight from the input, packed (column
// chunks), uneven (exchange + local reduce), all_reduce, and plans with two reducing steps.
const std::vector<Case> kCases = {
    {{4}, {64, 6}, "P", "S(0)"},           {{4}, {10, 8}, "P", "S(1)"},         {{4}, {13, 5}, "P", "S(0)"},
    {{4}, {9, 7}, "P", "R"},               {{2, 2}, {16, 6}, "P,P", "R,S(0)"},  {{2, 2}, {16, 6}, "P,S(0)", "R,S(0)"},
    {{2, 2}, {11, 6}, "P,P", "S(0),S(1)"}, {{2, 2}, {8, 4}, "P,P", "R,R"},
};

}  // namespace

TEST_CASE("bf16 and f16 reduced in f32 equal the f32 reduction rounded once", "[dtensor][precision]") {
  std::atomic<int64_t> differ_native{0}, cases{0};
  Checks checks;
  for (DType low : {DType::kBF16, DType::kF16})
    for (const Case& c : kCases) {
      const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh);
      collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
        auto comms = std::make_shared<const MeshComms>(mesh, world);
        auto m = std::make_shared<const DeviceMesh>(mesh);
        const int r = world.rank();
        const Placements src = parse_placements(c.src), dst = parse_placements(c.dst);
        const DTensorSpec lo_spec = make_spec(m, src, c.shape, low);
        const DTensorSpec f32_spec = make_spec(m, src, c.shape, DType::kF32);
        const Tensor lo_local = contribution(lo_spec, r, 7);
        const DTensor lo(comms, lo_spec, lo_local);
        const DTensor hi(comms, f32_spec, lo_local.to(DType::kF32));  // the same values, exactly
        RedistributeOptions in_f32;
        in_f32.reduce_dtype = DType::kF32;
        const DTensor got = lo.redistribute(dst, in_f32);
        const Tensor want = hi.redistribute(dst).to_local().to(low);  // f32 reduction, rounded once
        const std::string what = fmt::format("{} {} [{}] -> [{}] rank {}", kernels::to_string(low), to_string(mesh),
                                             c.src, c.dst, r);
        checks.check(got.dtype() == low, what + ": result dtype");
        checks.check(kernels::equal(got.to_local(), want), what + ": differs from the f32 reduction rounded once");
        // The same reduction in the low dtype itself rounds at every step: it differs somewhere,
        // so the comparison above can tell the two apart.
        const Tensor native = lo.redistribute(dst).to_local();
        if (!kernels::equal(native, want)) ++differ_native;
        if (r == 0) ++cases;
      });
    }
  checks.report();
  CHECK(cases == 2 * static_cast<int64_t>(kCases.size()));
  CHECK(differ_native > 0);
}

TEST_CASE("FSDP2 divide rules: f = group size reproduces P(avg) bit for bit", "[dtensor][precision]") {
  Checks checks;
  int64_t cases = 0;
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const Case& c : std::vector<Case>{{{4}, {64, 6}, "P", "S(0)"},
                                           {{4}, {13, 5}, "P", "S(0)"},
                                           {{4}, {9, 7}, "P", "R"},
                                           {{2, 2}, {16, 6}, "P,P", "R,S(0)"},
                                           {{2, 2}, {8, 4}, "P,P", "R,R"}}) {
      const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh);
      collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
        auto comms = std::make_shared<const MeshComms>(mesh, world);
        auto m = std::make_shared<const DeviceMesh>(mesh);
        const int r = world.rank();
        Placements sum = parse_placements(c.src), avg = sum;
        for (Placement& p : avg) p = Partial{kernels::ReduceOp::kAvg};
        const DTensorSpec s_sum = make_spec(m, sum, c.shape, dt), s_avg = make_spec(m, avg, c.shape, dt);
        const Tensor local = contribution(s_sum, r, 11);
        RedistributeOptions mean;
        mean.divide_factor = static_cast<double>(mesh.size());  // K: every reducing step averages
        const Tensor a = DTensor(comms, s_sum, local).redistribute(parse_placements(c.dst), mean).to_local();
        const Tensor b = DTensor(comms, s_avg, local).redistribute(parse_placements(c.dst)).to_local();
        checks.check(kernels::equal(a, b), fmt::format("{} [{}] -> [{}] rank {}: P(sum) / {} differs from P(avg)",
                                                       kernels::to_string(dt), c.src, c.dst, r, mesh.size()));
        if (r == 0) ++cases;
      });
    }
  checks.report();
  CHECK(cases == 10);
}

TEST_CASE("FSDP2 divide rules: another factor is a pre-multiplied sum; f16 pre- and post-divides; force_sum",
          "[dtensor][precision]") {
  Checks checks;
  // f = 3 on 4 ranks, f32: the reduce-scatter is premul_sum(1/3), as the raw collective computes it.
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), world);
    auto m = std::make_shared<const DeviceMesh>(comms->mesh());
    const DTensorSpec spec = make_spec(m, parse_placements("P"), {64, 6}, DType::kF32);
    const Tensor local = contribution(spec, world.rank(), 13);
    RedistributeOptions third;
    third.divide_factor = 3;
    const Tensor got = DTensor(comms, spec, local).redistribute(parse_placements("S(0)"), third).to_local();
    Tensor raw = Tensor::empty({16, 6}, DType::kF32);
    comms->dim(0).wait(comms->dim(0).reduce_scatter(local.view({64 * 6}), raw.view({16 * 6}),
                                                    collectives::Reduction::premul_sum(1.0 / 3)));
    checks.check(kernels::equal(got, raw), "f = 3: not the pre-multiplied sum");
    // force_sum, f32: sum, then divide by f after.
    RedistributeOptions forced = third;
    forced.force_sum = true;
    const Tensor sum_then = DTensor(comms, spec, local).redistribute(parse_placements("S(0)")).to_local();
    kernels::scale_(sum_then, 1.0 / 3);
    checks.check(kernels::equal(DTensor(comms, spec, local).redistribute(parse_placements("S(0)"), forced).to_local(), sum_then),
                 "force_sum: not the sum divided after");
  });
  // f16 on 8 ranks, f = 8: pre-divide by 4, sum, post-divide by 2. 16384 on every rank sums to
  // 131072, beyond f16's 65504: summed plainly it overflows; with the rule the partial sums are
  // multiples of 4096 up to 32768, exact, and the mean comes out exact.
  collectives::run_ranks(8, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({8}), world);
    auto m = std::make_shared<const DeviceMesh>(comms->mesh());
    const DTensorSpec spec = make_spec(m, parse_placements("P"), {16, 4}, DType::kF16);
    const Tensor local = contribution(spec, world.rank(), 0, 16384.0);
    RedistributeOptions mean;
    mean.divide_factor = 8;
    const Tensor got = DTensor(comms, spec, local).redistribute(parse_placements("S(0)"), mean).to_local();
    checks.check(got.to_vector() == std::vector<double>(8, 16384.0),
                 fmt::format("f16, f = 8: {} (expected 16384)", got.to_vector()[0]));
    const Tensor plain = DTensor(comms, spec, local).redistribute(parse_placements("S(0)")).to_local();
    checks.check(std::isinf(plain.to_vector()[0]), "the plain f16 sum did not overflow: the case shows nothing");
  });
  checks.report();
}

TEST_CASE("bad reduce policies are refused", "[dtensor][precision]") {
  Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2}), world);
    auto m = std::make_shared<const DeviceMesh>(comms->mesh());
    const DTensorSpec pmax = make_spec(m, parse_placements("P(max)"), {4, 2}, DType::kF32);
    const DTensorSpec shard = make_spec(m, parse_placements("S(0)"), {4, 2}, DType::kF32);
    const DTensorSpec pint = make_spec(m, parse_placements("P"), {4, 2}, DType::kI32);
    RedistributeOptions half;
    half.divide_factor = 2;
    checks.throws<kernels::InvalidArgument>(
        [&] { DTensor(comms, pmax, Tensor::zeros({4, 2}, DType::kF32)).redistribute(parse_placements("R"), half); },
        "applies to P(sum)", "divide with P(max)");
    checks.throws<kernels::InvalidArgument>(
        [&] { DTensor(comms, shard, Tensor::zeros({2, 2}, DType::kF32)).redistribute(parse_placements("R"), half); },
        "reduces nothing", "divide without a reduction");
    checks.throws<kernels::InvalidArgument>(
        [&] { DTensor(comms, pint, Tensor::zeros({4, 2}, DType::kI32)).redistribute(parse_placements("R"), half); },
        "needs a floating-point reduce dtype", "divide in integers");
    RedistributeOptions zero;
    zero.divide_factor = 0;
    checks.throws<kernels::InvalidArgument>(
        [&] { DTensor(comms, pint, Tensor::zeros({4, 2}, DType::kI32)).redistribute(parse_placements("R"), zero); },
        "divide_factor 0", "zero divide factor");
  });
  checks.report();
}
