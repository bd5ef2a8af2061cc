// A wire dtype for reductions (NOTE [wire dtype] in dtensor/exec/executor.h): a reduction whose
// wire dtype is narrower than its reduce dtype equals, bit for bit, "round each member's
// contribution to the wire, sum in the reduce dtype in member order" (and, for P -> R, round the
// sum to the wire once), on 1..8 local ranks, uneven shapes, S / _S / R targets and 2-D meshes;
// with bf16-representable contributions it equals the plain f32 reduction; plans print the wire
// and count its bytes (bf16: half of f32); bad combinations are refused naming the values.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/plan/reference.h"
#include "kernels/error.h"
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

// Rank `rank`'s contribution at global flat index `flat`: 21 significant bits (not representable
// in bf16 or e5m2), magnitudes 2^-12 .. 2^8 (inside e5m2's normal range). bf16_exact: 8 bits.
float value(int rank, int64_t flat, bool bf16_exact) {
  const uint64_t h = mix64(static_cast<uint64_t>(rank) * 1000003 + static_cast<uint64_t>(flat));
  if (bf16_exact) return static_cast<float>(static_cast<int64_t>(h % 255) - 127) / 2.0f;
  const float v = static_cast<float>(static_cast<int64_t>(h % 2000001) - 1000000) / 4096.0f;
  return v == 0 ? 1.0f : v;
}

float round_to(DType wire, float v) {
  switch (wire) {
    case DType::kBF16: return kernels::bf16_bits_to_float(kernels::float_to_bf16_bits(v));
    case DType::kF16: return kernels::f16_bits_to_float(kernels::float_to_f16_bits(v));
    case DType::kF8E5M2: return kernels::f8e5m2_bits_to_float(kernels::float_to_f8e5m2_bits(v));
    case DType::kF8E4M3: return kernels::f8e4m3_bits_to_float(kernels::float_to_f8e4m3_bits(v));
    default: return v;
  }
}

// The contract, element by element, for a source whose every mesh dim is Partial (every rank
// contributes to every element): the plan's reducing steps in order, each summing its group's
// wire-rounded values in member order in f32 (avg: then times 1/k), a P -> R rounding its sum to
// the wire; a group of one moves nothing and rounds nothing.
float reference(const Plan& plan, const Dims& mesh_shape, DType wire, int64_t flat, bool bf16_exact) {
  const int64_t n = mesh_shape.product();
  std::vector<float> v(n);
  for (int64_t p = 0; p < n; ++p) v[p] = value(static_cast<int>(p), flat, bf16_exact);
  for (const Step& step : plan.steps) {
    const auto* ar = std::get_if<AllReduce>(&step);
    const auto* rs = std::get_if<ReduceScatter>(&step);
    if (!ar && !rs) continue;
    const int m = mesh_dim_of(step);
    const int64_t k = mesh_shape[m];
    if (k == 1) continue;
    const kernels::ReduceOp op = ar ? ar->op : rs->op;
    for (int64_t p = 0; p < n; ++p) {
      Dims c = unravel_index(p, mesh_shape);
      if (c[m] != 0) continue;
      float acc = 0;
      for (int64_t g = 0; g < k; ++g) {
        c[m] = g;
        const float piece = round_to(wire, v[ravel_index(c, mesh_shape)]);
        acc = g == 0 ? piece : acc + piece;
      }
      if (op == kernels::ReduceOp::kAvg) acc = static_cast<float>(static_cast<double>(acc) * (1.0 / static_cast<double>(k)));
      if (ar) acc = round_to(wire, acc);
      for (int64_t g = 0; g < k; ++g) {
        c[m] = g;
        v[ravel_index(c, mesh_shape)] = acc;
      }
    }
  }
  return v[0];
}

// This rank's contribution (every mesh dim Partial: the whole tensor).
Tensor contribution(const Dims& shape, int rank, bool bf16_exact) {
  std::vector<double> vals(shape.product());
  for (size_t flat = 0; flat < vals.size(); ++flat) vals[flat] = value(rank, static_cast<int64_t>(flat), bf16_exact);
  return Tensor::from_vector(vals, shape).to(DType::kF32);
}

struct Case {
  Dims mesh;
  Dims shape;
  const char* src;
  const char* dst;
};

// 1..8 ranks on 1-D meshes (uneven chunks of 13 rows and 5 columns), _S targets, 2-D meshes with
// one and two wire steps.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t k = 1; k <= 8; ++k) {
    out.push_back({{k}, {13, 5}, "P", "S(0)"});
    out.push_back({{k}, {13, 5}, "P", "S(1)"});
    out.push_back({{k}, {13, 5}, "P", "R"});
  }
  out.push_back({{4}, {13, 5}, "P", "_S(0,2)"});
  out.push_back({{4}, {16, 3}, "P(avg)", "S(0)"});
  out.push_back({{4}, {7, 3}, "P(avg)", "R"});
  out.push_back({{2, 2}, {11, 6}, "P,P", "R,S(0)"});
  out.push_back({{2, 3}, {11, 6}, "P,P", "S(0),S(1)"});
  out.push_back({{2, 3}, {5, 7}, "P,P", "R,R"});
  out.push_back({{3, 2}, {9, 4}, "P,P", "_S(0,2),S(0)"});
  return out;
}

}  // namespace

TEST_CASE("a wire-dtype reduction equals wire-rounded contributions summed in f32 in member order",
          "[dtensor][precision][wire]") {
  Checks checks;
  std::atomic<int64_t> ran{0}, differ_plain{0};
  const std::vector<Case> all = cases();
  for (DType wire : {DType::kBF16, DType::kF8E5M2})
    for (const Case& c : all) {
      const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh);
      collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
        auto comms = std::make_shared<const MeshComms>(mesh, world);
        auto m = std::make_shared<const DeviceMesh>(mesh);
        const int r = world.rank();
        const Placements src = parse_placements(c.src), dst = parse_placements(c.dst);
        const DTensorSpec spec = make_spec(m, src, c.shape, DType::kF32);
        const DTensor x(comms, spec, contribution(c.shape, r, false));
        RedistributeOptions opt;
        opt.wire_dtype = wire;
        const std::string what = fmt::format("wire {} mesh {} [{}] -> [{}] rank {}", kernels::to_string(wire),
                                             to_string(mesh), c.src, c.dst, r);
        const Plan plan = plan_transition(make_transition(spec, dst, PlannerKind::kSearch, opt.reduce_policy()));
        const bool moves = mesh.size() > 1;
        checks.check(moves == (to_string(plan).find("wire=") != std::string::npos), what + ": plan " + to_string(plan));
        const DTensor got = x.redistribute(dst, opt);
        const DTensor plain = x.redistribute(dst);  // the cache keys the wire: another plan
        checks.check(got.dtype() == DType::kF32 && got.to_local().shape() == plain.to_local().shape(), what + ": shape");
        const ShardLayout l = *got.spec().layout(r);
        std::vector<std::vector<int64_t>> idx;
        for (int t = 0; t < 2; ++t) idx.push_back(l.indices(t));
        const std::vector<double> g = got.to_local().to_vector(), p = plain.to_local().to_vector();
        int64_t bad = 0, i = 0;
        for (int64_t a : idx[0])
          for (int64_t b : idx[1]) {
            const float want = reference(plan, c.mesh, wire, a * c.shape[1] + b, false);
            if (static_cast<float>(g[i]) != want && bad++ == 0)
              checks.add(fmt::format("{}: element ({},{}) is {} (expected {})", what, a, b, g[i], want));
            if (g[i] != p[i]) ++differ_plain;
            ++i;
          }
        checks.check(i == l.local_shape.product(), what + ": elements visited");
        if (r == 0) ++ran;
      });
    }
  checks.report();
  CHECK(ran == 2 * static_cast<int64_t>(all.size()));
  CHECK(differ_plain > 0);  // the wire rounds: the comparison can tell it from the plain reduction
}

TEST_CASE("with bf16-representable contributions a bf16 wire equals the plain f32 reduction",
          "[dtensor][precision][wire]") {
  Checks checks;
  int64_t ran = 0;
  for (const Case& c : std::vector<Case>{{{4}, {13, 5}, "P", "S(0)"},
                                         {{3}, {13, 5}, "P", "S(1)"},
                                         {{5}, {13, 5}, "P", "R"},
                                         {{2, 2}, {11, 6}, "P,P", "R,S(0)"}}) {
    const DeviceMesh mesh = DeviceMesh::from_shape(c.mesh);
    collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
      auto comms = std::make_shared<const MeshComms>(mesh, world);
      auto m = std::make_shared<const DeviceMesh>(mesh);
      const DTensorSpec spec = make_spec(m, parse_placements(c.src), c.shape, DType::kF32);
      const DTensor x(comms, spec, contribution(c.shape, world.rank(), true));
      RedistributeOptions opt;
      opt.wire_dtype = DType::kBF16;
      const Placements dst = parse_placements(c.dst);
      const Tensor got = x.redistribute(dst, opt).to_local();
      Tensor want = x.redistribute(dst).to_local();
      // A P -> R result is the sum rounded to the wire once (the sums here need more than 8 bits).
      if (std::string(c.dst).find('R') != std::string::npos) want = want.to(DType::kBF16).to(DType::kF32);
      checks.check(kernels::equal(got, want), fmt::format("mesh {} [{}] -> [{}] rank {}: differs from the f32 "
                                                          "reduction", to_string(mesh), c.src, c.dst, world.rank()));
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == 4);
}

TEST_CASE("wire plans: golden strings, wire bytes, the reference traffic", "[dtensor][planner][wire]") {
  struct Golden {
    Dims mesh, shape;
    const char* src;
    const char* dst;
    DType wire;
    const char* steps;
    int64_t bytes, plain_bytes;
  };
  // 8x4 f32 over 4 ranks reduce-scattered: 3 x 8 elements received; 10x3 all-reduced through
  // e5m2: chunks 8,8,7,7, the busiest receives 30 + 2 x 8 elements (a plain one 2 x 3/4 x 30 x 4);
  // 16x4 on 2x4: 3 x 16 elements over tp, then 16 + 0 x 8 over dp (plain: 2 x 1/2 x 16).
  const std::vector<Golden> golden = {
      {{4}, {8, 4}, "P", "S(0)", DType::kBF16, "[P] -RS(0:0,sum,wire=bf16)-> [S(0)]", 48, 96},
      {{4}, {8, 4}, "P", "R", DType::kBF16, "[P] -AR(0,sum,wire=bf16)-> [R]", 96, 192},
      {{4}, {10, 3}, "P", "R", DType::kF8E5M2, "[P] -AR(0,sum,wire=f8e5m2)-> [R]", 46, 180},
      {{4}, {8, 4}, "P(avg)", "_S(0,2)", DType::kBF16, "[P(avg)] -RS(0:_S(0,2),avg,wire=bf16)-> [_S(0,2)]", 48, 96},
      {{2, 4}, {16, 4}, "P,P", "R,S(0)", DType::kBF16,
       "[P,P] -RS(1:0,sum,wire=bf16)-> [P,S(0)] -AR(0,sum,wire=bf16)-> [R,S(0)]", 128, 256},
      {{1, 4}, {8, 4}, "P,P", "R,S(0)", DType::kBF16, "[P,P] -AR(0,sum)-> [R,P] -RS(1:0,sum,wire=bf16)-> [R,S(0)]",
       48, 96},
  };
  int64_t ran = 0;
  for (const Golden& g : golden) {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(g.mesh));
    const DTensorSpec spec = make_spec(mesh, parse_placements(g.src), g.shape, DType::kF32);
    ReducePolicy policy;
    policy.wire_dtype = g.wire;
    const Transition t = make_transition(spec, parse_placements(g.dst), PlannerKind::kSearch, policy);
    const Plan plan = plan_transition(t);
    const Plan plain = plan_transition(make_transition(spec, parse_placements(g.dst)));
    CAPTURE(g.steps);
    CHECK(to_string(plan) == g.steps);
    CHECK(plan.bytes_per_rank() == g.bytes);
    CHECK(plain.bytes_per_rank() == g.plain_bytes);
    // The algebra's traffic equals the rank-by-rank reference's, step by step.
    for (size_t i = 0; i < plan.steps.size(); ++i)
      CHECK(reference_step_traffic(plan.steps[i], plan.states[i], g.shape, g.mesh, DType::kF32).busiest() ==
            plan.step_traffic[i]);
    // The transition (the cache key) differs by the wire alone.
    const Transition no_wire = make_transition(spec, parse_placements(g.dst));
    CHECK_FALSE(t == no_wire);
    CHECK(TransitionHash{}(t) != TransitionHash{}(no_wire));
    ++ran;
  }
  CHECK(ran == static_cast<int64_t>(golden.size()));
  // The same dtype as the reduce dtype is no wire: the plan is the plain one.
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({4}));
  ReducePolicy same;
  same.wire_dtype = DType::kF32;
  CHECK(to_string(plan_transition(make_transition(make_spec(mesh, parse_placements("P"), {8, 4}, DType::kF32),
                                                  parse_placements("S(0)"), PlannerKind::kSearch, same))) ==
        "[P] -RS(0:0,sum)-> [S(0)]");
  // Greedy marks its reductions too.
  ReducePolicy bf16;
  bf16.wire_dtype = DType::kBF16;
  CHECK(to_string(plan_transition(make_transition(make_spec(mesh, parse_placements("P"), {8, 4}, DType::kF32),
                                                  parse_placements("S(1)"), PlannerKind::kGreedy, bf16))) ==
        "[P] -RS(0:1,sum,wire=bf16)-> [S(1)]");
}

TEST_CASE("bad wire dtypes are refused naming the values", "[dtensor][precision][wire]") {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2}));
  const DTensorSpec f32 = make_spec(mesh, parse_placements("P"), {4, 2}, DType::kF32);
  const DTensorSpec bf16 = make_spec(mesh, parse_placements("P"), {4, 2}, DType::kBF16);
  const DTensorSpec i32 = make_spec(mesh, parse_placements("P"), {4, 2}, DType::kI32);
  const DTensorSpec pmax = make_spec(mesh, parse_placements("P(max)"), {4, 2}, DType::kF32);
  struct Bad {
    const DTensorSpec* spec;
    std::optional<DType> reduce;
    DType wire;
    const char* contains;
  };
  const std::vector<Bad> bad = {
      {&f32, std::nullopt, DType::kF64, "wire dtype f64 with reduce dtype f32: the wire must be narrower"},
      {&bf16, std::nullopt, DType::kF16, "wire dtype f16 with reduce dtype bf16: the wire must be narrower"},
      {&f32, DType::kBF16, DType::kBF16, ""},  // the same dtype: no wire, accepted
      {&f32, std::nullopt, DType::kI32, "wire dtype i32 with reduce dtype f32: both must be floating point"},
      {&i32, std::nullopt, DType::kBF16, "wire dtype bf16 with reduce dtype i32: both must be floating point"},
      {&pmax, std::nullopt, DType::kBF16, "sum and avg reductions only, not max"},
  };
  int64_t ran = 0;
  for (const Bad& b : bad) {
    ReducePolicy policy;
    policy.reduce_dtype = b.reduce;
    policy.wire_dtype = b.wire;
    CAPTURE(b.contains);
    if (*b.contains == '\0') {
      CHECK_NOTHROW(make_transition(*b.spec, parse_placements("R"), PlannerKind::kSearch, policy));
    } else {
      CHECK_THROWS_WITH(make_transition(*b.spec, parse_placements("R"), PlannerKind::kSearch, policy),
                        Catch::Matchers::Contains(b.contains));
      CHECK_THROWS_AS(make_transition(*b.spec, parse_placements("R"), PlannerKind::kSearch, policy),
                      kernels::InvalidArgument);
    }
    ++ran;
  }
  CHECK(ran == static_cast<int64_t>(bad.size()));
}
