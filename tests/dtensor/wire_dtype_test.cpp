// A wire dtype for reductions (NOTE [wire dtype] in dtensor/exec/executor.h): a reduction whose
// wire dtype is narrower than its reduce dtype equals, bit for bit, "round each member's
// contribution to the wire (fp8: at the sender's power-of-two scale), sum in the reduce dtype in
// member order" (and, for P -> R, round the sum to the wire once), modelled rank by rank here, on
// 1..8 local ranks, uneven shapes, S / _S / R targets and 2-D meshes;
// with bf16-representable contributions it equals the plain f32 reduction; plans print the wire
// and count its bytes (bf16: half of f32); bad combinations are refused naming the values.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
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
// in bf16 or e5m2), magnitudes spread log-uniformly over 2^-40 .. 1: many below e5m2's smallest
// subnormal (2^-16), so a plain cast would lose what the sender's scale keeps. bf16_exact: 8 bits.
float value(int rank, int64_t flat, bool bf16_exact) {
  const uint64_t h = mix64(static_cast<uint64_t>(rank) * 1000003 + static_cast<uint64_t>(flat));
  if (bf16_exact) return static_cast<float>(static_cast<int64_t>(h % 255) - 127) / 2.0f;
  const int ex = static_cast<int>((h >> 40) % 21);  // log-uniform magnitudes
  const float v = std::ldexp(static_cast<float>(static_cast<int64_t>(h % 2000001) - 1000000) / 1048576.0f, -ex);
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

// The power of two an fp8 sender scales by (NOTE [wire dtype]): the largest 2^e, |e| <= 120, with
// amax x 2^e <= the format's max; 1 for other wires or when every value is zero.
double pow2_scale(const std::vector<float>& v, DType wire) {
  if (wire != DType::kF8E5M2 && wire != DType::kF8E4M3) return 1.0;
  double amax = 0;
  for (float x : v)
    if (std::isfinite(x)) amax = std::max(amax, static_cast<double>(std::fabs(x)));
  if (amax == 0) return 1.0;
  const double top = wire == DType::kF8E5M2 ? 57344.0 : 448.0;
  int e = 0;
  while (e > -120 && std::ldexp(amax, e) > top) --e;
  while (e < 120 && std::ldexp(amax, e + 1) <= top) ++e;
  return std::ldexp(1.0, e);
}

// A sender's piece as it arrives: scaled, rounded to the wire, unscaled (exact powers of two).
float piece(float v, double s, DType wire) {
  return static_cast<float>(static_cast<double>(round_to(wire, static_cast<float>(v * s))) / s);
}

// The contract, rank by rank (an independent model of NOTE [wire dtype]): every rank's local
// values (row-major over its layout) through the plan's steps. A reduction on mesh dim m sums, for
// each element, its group's pieces in member order in f32 (avg: then times 1/k); P -> R cuts the
// flat local tensor into k chunks (the first N % k one longer) and rounds each chunk's sums to the
// wire with its owner's scale. A data-moving step copies each element from the member of the
// group that holds it. A group of one moves nothing and rounds nothing. 2-D tensors.
struct Model {
  Dims shape, mesh;
  DType wire;
  std::vector<std::vector<int64_t>> flat;  // per rank: the global flat index of each local element
  std::vector<std::vector<float>> val;

  std::vector<int64_t> indices(const Placements& pl, int64_t rank) const {
    const ShardLayout l = compute_layout(shape, mesh, pl, unravel_index(rank, mesh));
    std::vector<int64_t> out;
    for (int64_t a : l.indices(0))
      for (int64_t b : l.indices(1)) out.push_back(a * shape[1] + b);
    return out;
  }
  // Member g of rank p's group along m.
  int64_t member(int64_t p, int m, int64_t g) const {
    Dims c = unravel_index(p, mesh);
    c[m] = g;
    return ravel_index(c, mesh);
  }

  Model(const Plan& plan, Dims shape_, Dims mesh_, DType wire_, bool bf16_exact)
      : shape(std::move(shape_)), mesh(std::move(mesh_)), wire(wire_) {
    const int64_t n = mesh.product();
    for (int64_t p = 0; p < n; ++p) {
      flat.push_back(indices(plan.states[0], p));
      val.emplace_back();
      for (int64_t x : flat[p]) val[p].push_back(value(static_cast<int>(p), x, bf16_exact));
    }
    for (size_t i = 0; i < plan.steps.size(); ++i) step(plan.steps[i], plan.states[i + 1]);
  }

  void step(const Step& s, const Placements& after) {
    const int64_t n = mesh.product();
    const int m = mesh_dim_of(s);
    const int64_t k = mesh[m];
    const auto* ar = std::get_if<AllReduce>(&s);
    const auto* rs = std::get_if<ReduceScatter>(&s);
    std::vector<std::vector<int64_t>> nflat(n);
    std::vector<std::vector<float>> nval(n);
    std::vector<double> scale(n);
    for (int64_t p = 0; p < n; ++p) scale[p] = pow2_scale(val[p], wire);
    auto held = [&](int64_t q, int64_t x) {
      const auto it = std::find(flat[q].begin(), flat[q].end(), x);
      return it == flat[q].end() ? -1 : it - flat[q].begin();
    };
    for (int64_t p = 0; p < n; ++p) {
      nflat[p] = indices(after, p);
      if ((!ar && !rs) || k == 1) {  // data movement (or nothing moves): the holder's value
        for (int64_t x : nflat[p])
          for (int64_t g = 0; g < k; ++g)
            if (const int64_t at = held(member(p, m, g), x); at >= 0) {
              nval[p].push_back(val[member(p, m, g)][at]);
              break;
            }
        continue;
      }
      const kernels::ReduceOp op = ar ? ar->op : rs->op;
      auto sum_at = [&](int64_t pos) {  // every member holds the same index set (a Partial dim)
        float acc = 0;
        for (int64_t g = 0; g < k; ++g) {
          const int64_t q = member(p, m, g);
          const float pc = piece(val[q][pos], scale[q], wire);
          acc = g == 0 ? pc : acc + pc;
        }
        if (op == kernels::ReduceOp::kAvg)
          acc = static_cast<float>(static_cast<double>(acc) * (1.0 / static_cast<double>(k)));
        return acc;
      };
      if (rs) {
        for (int64_t x : nflat[p]) nval[p].push_back(sum_at(held(p, x)));
        continue;
      }
      const int64_t len = static_cast<int64_t>(flat[p].size());
      std::vector<float> sums(len);
      for (int64_t pos = 0; pos < len; ++pos) sums[pos] = sum_at(pos);
      for (int64_t g = 0, o = 0; g < k; ++g) {
        const int64_t cnt = len / k + (g < len % k ? 1 : 0);
        const std::vector<float> chunk(sums.begin() + o, sums.begin() + o + cnt);
        const double s2 = pow2_scale(chunk, wire);
        for (float v : chunk) nval[p].push_back(piece(v, s2, wire));
        o += cnt;
      }
    }
    flat = std::move(nflat);
    val = std::move(nval);
  }
};

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
        const Model model(plan, c.shape, c.mesh, wire, false);
        const ShardLayout l = *got.spec().layout(r);
        const std::vector<double> g = got.to_local().to_vector(), p = plain.to_local().to_vector();
        checks.check(model.val[r].size() == g.size(), what + ": the model's element count");
        int64_t bad = 0, i = 0;
        for (; i < static_cast<int64_t>(std::min(g.size(), model.val[r].size())); ++i) {
          const float want = model.val[r][i];
          if (static_cast<float>(g[i]) != want && bad++ == 0)
            checks.add(fmt::format("{}: element {} (global flat {}) is {} (expected {})", what, i, model.flat[r][i],
                                   g[i], want));
          if (g[i] != p[i]) ++differ_plain;
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

TEST_CASE("a batch through a bf16 wire equals each tensor's own wire reduction", "[dtensor][precision][wire]") {
  // redistribute_batch packs the tensors of a step together: chunks and pieces change, the sums
  // (and a P -> R's rounding of each sum to bf16) do not.
  Checks checks;
  int64_t ran = 0;
  for (const char* dst : {"S(0)", "R"}) {
    collectives::run_ranks(3, [&](Communicator& world) {
      auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({3}), world);
      auto m = std::make_shared<const DeviceMesh>(comms->mesh());
      std::vector<DTensor> xs;
      for (const Dims& shape : {Dims{13, 5}, Dims{7, 5}, Dims{2, 5}})
        xs.emplace_back(comms, make_spec(m, parse_placements("P"), shape, DType::kF32),
                        contribution(shape, world.rank(), false));
      RedistributeOptions opt;
      opt.wire_dtype = DType::kBF16;
      const std::vector<DTensor> batch = redistribute_batch(xs, parse_placements(dst), opt);
      checks.check(batch.size() == xs.size(), "batch size");
      for (size_t i = 0; i < std::min(batch.size(), xs.size()); ++i)
        checks.check(kernels::equal(batch[i].to_local(), xs[i].redistribute(parse_placements(dst), opt).to_local()),
                     fmt::format("-> {} tensor {} rank {}: the batch differs", dst, i, world.rank()));
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == 2);
}

TEST_CASE("an fp8 wire's per-sender scale keeps values far outside e5m2's range", "[dtensor][precision][wire]") {
  // Contributions of 1e-9 .. 1e-6 (a plain e5m2 cast flushes everything below 2^-17 to zero) and
  // of 1e6 .. 1e9 (above 57344: a plain cast gives inf): every sum comes back finite, non-zero,
  // within e5m2's rounding (2^-3 relative per piece) of the f32 sum.
  Checks checks;
  int64_t ran = 0;
  for (double magnitude : {1e-9, 1e6}) {
    collectives::run_ranks(4, [&](Communicator& world) {
      auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), world);
      auto m = std::make_shared<const DeviceMesh>(comms->mesh());
      const Dims shape{13, 5};
      const DTensorSpec spec = make_spec(m, parse_placements("P"), shape, DType::kF32);
      std::vector<double> v(shape.product());
      for (size_t i = 0; i < v.size(); ++i) v[i] = magnitude * (1.0 + static_cast<double>((i * 7 + world.rank()) % 1000));
      const DTensor x(comms, spec, Tensor::from_vector(v, shape));
      RedistributeOptions opt;
      opt.wire_dtype = DType::kF8E5M2;
      for (const char* dst : {"S(0)", "R"}) {
        const std::vector<double> got = x.redistribute(parse_placements(dst), opt).to_local().to_vector();
        const std::vector<double> want = x.redistribute(parse_placements(dst)).to_local().to_vector();
        int64_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i)
          if (!std::isfinite(got[i]) || got[i] == 0 || std::fabs(got[i] - want[i]) > 0.25 * std::fabs(want[i])) ++bad;
        checks.check(bad == 0 && !got.empty(), fmt::format("magnitude {} -> {} rank {}: {} of {} sums lost", magnitude,
                                                           dst, world.rank(), bad, got.size()));
      }
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == 2);
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
  // e5m2: chunks 8,8,7,7, the busiest receives 30 + 2 x 8 elements and 2 x 3 scales of 4 bytes
  // (a plain one 2 x 3/4 x 30 x 4);
  // 16x4 on 2x4: 3 x 16 elements over tp, then 16 + 0 x 8 over dp (plain: 2 x 1/2 x 16).
  const std::vector<Golden> golden = {
      {{4}, {8, 4}, "P", "S(0)", DType::kBF16, "[P] -RS(0:0,sum,wire=bf16)-> [S(0)]", 48, 96},
      {{4}, {8, 4}, "P", "R", DType::kBF16, "[P] -AR(0,sum,wire=bf16)-> [R]", 96, 192},
      {{4}, {10, 3}, "P", "R", DType::kF8E5M2, "[P] -AR(0,sum,wire=f8e5m2)-> [R]", 46 + 24, 180},
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
