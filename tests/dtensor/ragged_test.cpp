// RaggedShard (placement.h, NOTE [ragged view] in layout.h): notation, validation, the range
// rule, layouts of uneven and empty ranges, composition with S / _S / R / P, and the refusals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include "dtensor/layout.h"
#include "dtensor/plan/reference.h"
#include "dtensor/plan/transition.h"
#include "dtensor/spec.h"
#include "kernels/error.h"
#include "kernels/format.h"

using namespace dtensor;
using Catch::Contains;

namespace {

ShardLayout at(const Dims& shape, const Dims& mesh, const char* placements, const Dims& coord) {
  return compute_layout(shape, mesh, normalize_placements(parse_placements(placements), mesh.size(), shape.size()),
                        coord);
}

// Units that vary with the case number, zeros included.
std::vector<int64_t> units_for(int64_t k, int64_t seed) {
  std::vector<int64_t> u;
  for (int64_t i = 0; i < k; ++i) u.push_back((seed * 7 + i * 5) % 4);  // 0..3
  if (std::all_of(u.begin(), u.end(), [](int64_t v) { return v == 0; })) u[k / 2] = 1;
  return u;
}

}  // namespace

TEST_CASE("RaggedShard notation parses, prints and compares", "[dtensor][placement][ragged]") {
  struct Case {
    const char* text;
    RaggedShard p;
    const char* canonical;
  };
  const Case cases[] = {
      {"Rg(0,[1,2,0,1],4)", {0, {1, 2, 0, 1}, 4}, "Rg(0,[1,2,0,1],4)"},
      {" Rg( 1 , [ 3, 1 ] ) ", {1, {3, 1}, 1}, "Rg(1,[3,1],1)"},
      {"RaggedShard(-1, units=[0,5], align=8)", {-1, {0, 5}, 8}, "Rg(-1,[0,5],8)"},
      {"Rg(0,[7])", {0, {7}, 1}, "Rg(0,[7],1)"},
  };
  int ran = 0;
  for (const Case& c : cases) {
    INFO(c.text);
    CHECK(parse_placement(c.text) == Placement{c.p});
    CHECK(to_string(Placement{c.p}) == c.canonical);
    CHECK(parse_placement(to_string(Placement{c.p})) == Placement{c.p});
    ++ran;
  }
  CHECK(ran == 4);
  CHECK(parse_placements("[Rg(0,[1,2],4), S(0)]") == Placements{RaggedShard{0, {1, 2}, 4}, Shard{0}});
  CHECK(to_string(Placements{RaggedShard{0, {1, 2}, 4}, Replicate{}}) == "Rg(0,[1,2],4),R");
  CHECK(Placement{RaggedShard{0, {1, 2}, 4}} != Placement{RaggedShard{0, {2, 1}, 4}});
  CHECK(Placement{RaggedShard{0, {1, 2}, 4}} != Placement{RaggedShard{0, {1, 2}, 2}});
  CHECK(Placement{RaggedShard{0, {1, 1}, 1}} != Placement{Shard{0}});  // distinct kinds
  CHECK(!shard_dim(RaggedShard{1, {1}, 1}));
  CHECK(ragged_dim(RaggedShard{1, {1}, 1}) == 1);
  CHECK(normalize(RaggedShard{-1, {1, 1}, 2}, 3) == Placement{RaggedShard{2, {1, 1}, 2}});

  // The transition hash sees the units and the alignment.
  Transition a;
  a.mesh_shape = {2};
  a.shape = {8};
  a.src.push_back(RaggedShard{0, {1, 1}, 1});
  a.dst.push_back(Replicate{});
  Transition b = a, c = a;
  b.src[0] = RaggedShard{0, {1, 2}, 1};
  c.src[0] = RaggedShard{0, {1, 1}, 2};
  CHECK(TransitionHash{}(a) != TransitionHash{}(b));
  CHECK(TransitionHash{}(a) != TransitionHash{}(c));
  CHECK(!(a == b));
}

TEST_CASE("bad RaggedShards are refused naming the value", "[dtensor][placement][ragged]") {
  CHECK_THROWS_WITH(parse_placement("Rg(0,[],1)"), Contains("has no units"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,[0,0],1)"), Contains("sum to 0"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,[1,-1],1)"), Contains("unit -1 (index 1)"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,[1,2],0)"), Contains("alignment 0"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,1,2)"), Contains("bracketed list"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,[1,x])"), Contains("unit 'x' is not an integer"));
  CHECK_THROWS_WITH(parse_placement("Rg(0)"), Contains("2 or 3 arguments expected, got 1"));
  CHECK_THROWS_WITH(parse_placement("Rg(0,[99999999999999999999])"), Contains("out of range"));
  CHECK_THROWS_WITH(parse_placement("RS(0)"), Contains("'RS(0)'"));  // a step string, not a placement
  CHECK_THROWS_WITH(normalize(RaggedShard{2, {1}, 1}, 2), Contains("shard dim 2 of Rg(2,[1],1) out of range"));
  CHECK_THROWS_WITH(normalize(RaggedShard{0, {0}, 1}, 2), Contains("sum to 0"));

  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("Rg(0,[1,1,1],1),R"), {8}, DType::kF32),
                    Contains("has 3 units for 2 ranks"));
  CHECK_THROWS_AS(make_spec(mesh, parse_placements("Rg(0,[1,1],1),Rg(0,[1,1],1)"), {8}, DType::kF32),
                  kernels::Unsupported);
  struct Refused {
    const char* placements;
    Dims shape;
    const char* why;
  };
  const Refused refused[] = {
      {"Rg(0,[1,1],1),S(1)", {4, 4}, "S(1) on mesh dim 1 does not compose with Rg(0,[1,1],1)"},
      {"S(0),Rg(0,[1,1],1)", {4, 4}, "S(0) on mesh dim 0 does not compose"},
      {"Rg(1,[1,1],1),_S(1,2)", {4, 4}, "_S(1,2) on mesh dim 1 does not compose"},
      {"Rg(0,[1,1],1),_S(0,2)", {8}, "_S(0,2) on mesh dim 1 does not compose"},
  };
  int ran = 0;
  for (const Refused& r : refused) {
    INFO(r.placements);
    CHECK_THROWS_WITH(make_spec(mesh, parse_placements(r.placements), r.shape, DType::kF32), Contains(r.why));
    CHECK_THROWS_AS(compute_layout(r.shape, {2, 2}, parse_placements(r.placements), {0, 0}), kernels::Unsupported);
    ++ran;
  }
  CHECK(ran == 4);
  CHECK_THROWS_WITH(ragged_view({4, 4}, parse_placements("Rg(0,[1,1],1),S(1)")),
                    Contains("allowed: R, P, S(0) on a later mesh dim"));
  CHECK_THROWS_WITH(ragged_view({4, 4}, parse_placements("S(1),Rg(1,[1,1],1)")),
                    Contains("allowed: R, P, S/_S of dims < 1, S(1) on a later mesh dim"));
  CHECK_THROWS_WITH(compute_layout({8}, {2}, {RaggedShard{0, {1}, 1}}, {0}), Contains("1 units for 2 ranks"));
  CHECK_THROWS_WITH(compute_layout({8}, {2}, {RaggedShard{0, {1, 1}, 1}}, {2}), Contains("outside mesh shape"));

  // Transitions are planned on the view (ragged_redistribute_test.cpp); one that moves the
  // RaggedShard to another mesh dim is refused naming both placement lists.
  const DTensorSpec spec = make_spec(mesh, parse_placements("Rg(0,[1,3],4),R"), {10, 3}, DType::kF32);
  CHECK(make_transition(spec, parse_placements("R,R")).shape == Dims{30});
  CHECK_THROWS_WITH(make_transition(spec, parse_placements("R,Rg(0,[1,1],1)")),
                    Contains("[Rg(0,[1,3],4),R] -> [R,Rg(0,[1,1],1)]") && Contains("different mesh dims"));
}

TEST_CASE("ragged_chunk: the worked examples and the range rule", "[dtensor][layout][ragged]") {
  const std::vector<int64_t> units = {1, 2, 0, 1};
  const Chunk expect[] = {{0, 0}, {0, 4}, {4, 0}, {4, 6}};
  for (int64_t i = 0; i < 4; ++i) CHECK(ragged_chunk(10, units, 4, i) == expect[i]);
  CHECK(ragged_chunk(0, units, 4, 3) == Chunk{0, 0});
  CHECK(ragged_chunk(12, {1, 1, 1}, 1, 2) == Chunk{8, 4});

  // Every (n, k, units, align): the pieces tile [0, n) in order, every boundary but the end is a
  // multiple of align, and piece i is within align + 1 of n x units[i] / U.
  int cases = 0;
  for (int64_t k = 1; k <= 8; ++k)
    for (int64_t n : {0, 1, 5, 16, 17, 100})
      for (int64_t align : {1, 3, 4})
        for (int64_t seed = 0; seed < 3; ++seed) {
          const std::vector<int64_t> u = units_for(k, seed);
          int64_t total = 0;
          for (int64_t v : u) total += v;
          int64_t next = 0;
          for (int64_t i = 0; i < k; ++i) {
            INFO("n " << n << " k " << k << " align " << align << " seed " << seed << " piece " << i);
            const Chunk c = ragged_chunk(n, u, align, i);
            CHECK(c.offset == next);
            CHECK(c.size >= 0);
            CHECK(c.offset % align == 0);
            const double ideal = static_cast<double>(n) * static_cast<double>(u[i]) / static_cast<double>(total);
            CHECK(std::abs(static_cast<double>(c.size) - ideal) < static_cast<double>(align + 1));
            next = c.offset + c.size;
          }
          CHECK(next == n);
          ++cases;
        }
  CHECK(cases == 8 * 6 * 3 * 3);
}

TEST_CASE("RaggedShard layouts: uneven and empty ranges of the flattened view",
          "[dtensor][layout][ragged]") {
  // 1-D view of a [10] tensor over 4 ranks: [0,0) [0,4) [4,4) [4,10); empties at the sentinel.
  const Dims mesh = {4};
  const struct {
    int64_t size, offset, start;
  } expect[] = {{0, 10, -1}, {4, 0, 0}, {0, 10, -1}, {6, 4, 4}};
  for (int64_t r = 0; r < 4; ++r) {
    const ShardLayout l = at({10}, mesh, "Rg(0,[1,2,0,1],4)", {r});
    INFO("rank " << r);
    CHECK(l.local_shape == Dims{expect[r].size});
    CHECK(l.global_offset == Dims{expect[r].offset});
    if (expect[r].start >= 0) CHECK(l.runs[0] == IndexRuns{{expect[r].start, expect[r].size}});
    else CHECK(l.runs[0].empty());
  }
  // The flattened dims d..end: [2,3,4] with Rg(1) is the view [2,12]; local shape 2-D.
  const ShardLayout l = at({2, 3, 4}, {2}, "Rg(1,[1,2],1)", {1});
  CHECK(l.local_shape == Dims{2, 8});
  CHECK(l.global_offset == Dims{0, 4});
  CHECK(ragged_view({2, 3, 4}, parse_placements("Rg(1,[1,2],1)")) == Dims{2, 12});
  CHECK(ragged_view({2, 3, 4}, parse_placements("S(0)")) == Dims{2, 3, 4});
  // The header's example: a later S(0) chunks the rank's range.
  const ShardLayout h = at({3, 4}, {2, 2}, "Rg(0,[1,2],1),S(0)", {1, 0});
  CHECK(h.local_shape == Dims{4});
  CHECK(h.global_offset == Dims{4});
  CHECK(h.runs[0] == IndexRuns{{4, 4}});

  auto m = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  const DTensorSpec spec = make_spec(m, parse_placements("S(0),Rg(1,[1,0],1)"), {4, 3, 2}, DType::kF32);
  CHECK(spec.is_sharded(0));
  CHECK(spec.is_sharded(1));
  CHECK(spec.is_sharded(2));
  CHECK(!equivalent_placements(spec, *m));
  CHECK_THROWS_WITH(common_elements(at({4, 3, 2}, {2}, "Rg(1,[1,1],1)", {0}), at({4, 3, 2}, {2}, "R", {0})),
                    Contains("layouts of 2 and 3 dims"));
  const DTensorSpec rows = make_spec(m, parse_placements("R,Rg(1,[1,0],1)"), {4, 3, 2}, DType::kF32);
  CHECK(!rows.is_sharded(0));
}

TEST_CASE("S(0) of [n, r] over k ranks is Rg(0, chunk sizes, r) of its view", "[dtensor][layout][ragged]") {
  int cases = 0;
  for (int64_t k = 1; k <= 8; ++k)
    for (int64_t n = 1; n <= 11; ++n)
      for (int64_t r : {1, 3}) {
        std::vector<int64_t> units;
        for (int64_t i = 0; i < k; ++i) units.push_back(chunk(n, k, i).size);
        const Placements ragged = {RaggedShard{0, units, r}};
        for (int64_t i = 0; i < k; ++i) {
          INFO("n " << n << " k " << k << " r " << r << " rank " << i);
          const ShardLayout s = compute_layout({n, r}, {k}, {Shard{0}}, {i});
          const ShardLayout g = compute_layout({n, r}, {k}, ragged, {i});
          CHECK(g.local_shape == Dims{s.local_shape[0] * r});
          CHECK(g.global_offset == Dims{s.global_offset[0] * r});
        }
        ++cases;
      }
  CHECK(cases == 8 * 11 * 2);
}

TEST_CASE("RaggedShard composes with S, R and P: every element on the ranks that should hold it",
          "[dtensor][layout][ragged]") {
  // Membership by global index, from first principles, against compute_layout (through the
  // reference's mesh_layouts): [S(0), Rg(1, u, a), S(1)] on a (2, k, 2) mesh over [5, 3, 4]:
  // row i on dp rank c0 when it lies in chunk(5, 2, c0); flat index f = j x 4 + l of the view
  // [5, 12] in ragged piece c1, and then in chunk c2 of that piece.
  int cases = 0;
  for (int64_t k = 1; k <= 4; ++k)
    for (int64_t seed = 0; seed < 3; ++seed)
      for (int64_t align : {1, 4}) {
        const std::vector<int64_t> u = units_for(k, seed);
        const Placements ps = {Shard{0}, RaggedShard{1, u, align}, Shard{1}};
        const Dims mesh = {2, k, 2}, shape = {5, 3, 4};
        const std::vector<ShardLayout> layouts = mesh_layouts(shape, mesh, ps);
        REQUIRE(static_cast<int64_t>(layouts.size()) == 4 * k);
        int64_t held = 0;
        for (int64_t p = 0; p < 4 * k; ++p) {
          const Dims c = unravel_index(p, mesh);
          const Chunk rows = chunk(5, 2, c[0]);
          const Chunk piece = ragged_chunk(12, u, align, c[1]);
          const Chunk sub = chunk(piece.size, 2, c[2]);
          const ShardLayout& l = layouts[p];
          INFO("k " << k << " seed " << seed << " align " << align << " rank " << p);
          REQUIRE(l.local_shape.size() == 2);
          CHECK(l.local_shape == Dims{rows.size, sub.size});
          const std::vector<int64_t> flat = l.indices(1);
          for (int64_t f = 0; f < 12; ++f) {
            const bool mine = f >= piece.offset + sub.offset && f < piece.offset + sub.offset + sub.size;
            CHECK(std::count(flat.begin(), flat.end(), f) == (mine ? 1 : 0));
          }
          held += l.local_shape.product();
        }
        CHECK(held == 5 * 12);  // a partition: each element once
        // R and P on another mesh dim hold the same ranges on every member.
        const Placements rp = {Replicate{}, RaggedShard{1, u, align}, Partial{}};
        const std::vector<ShardLayout> lr = mesh_layouts(shape, mesh, rp);
        for (int64_t p = 0; p < 4 * k; ++p) {
          const Dims c = unravel_index(p, mesh);
          CHECK(lr[p].local_shape == Dims{5, ragged_chunk(12, u, align, c[1]).size});
        }
        ++cases;
      }
  CHECK(cases == 4 * 3 * 2);
}

TEST_CASE("flat_range_boxes: a flat range as boxes of the tensor's dims", "[dtensor][layout][ragged]") {
  // The header's worked examples.
  const std::vector<FlatBox> ex = flat_range_boxes({3, 4, 5}, 7, 45);
  const std::vector<FlatBox> want = {{{0, 1, 2}, {1, 1, 3}, 7},
                                     {{0, 2, 0}, {1, 2, 5}, 10},
                                     {{1, 0, 0}, {1, 4, 5}, 20},
                                     {{2, 0, 0}, {1, 2, 5}, 40},
                                     {{2, 2, 0}, {1, 1, 2}, 50}};
  CHECK(ex == want);
  CHECK(flat_range_boxes({4, 6}, 6, 12) == std::vector<FlatBox>{{{1, 0}, {2, 6}, 6}});
  CHECK(flat_range_boxes({4, 6}, 5, 0).empty());
  // Every range of small shapes: boxes in flat order, each contiguous from `flat`, covering the
  // range exactly, at most 2 n - 1 of them (the bound met).
  int cases = 0;
  size_t most = 0;
  for (const Dims& dims : {Dims{7}, Dims{3, 5}, Dims{2, 3, 4}, Dims{3, 2, 2, 3}, Dims{2, 0, 3}}) {
    const int64_t total = dims.product();
    for (int64_t a = 0; a <= total; ++a)
      for (int64_t b = a; b <= total; ++b) {
        ++cases;
        const std::vector<FlatBox> boxes = flat_range_boxes(dims, a, b - a);
        most = std::max(most, boxes.size());
        CHECK(boxes.size() <= static_cast<size_t>(2 * dims.size() - 1));
        int64_t next = a;
        for (const FlatBox& box : boxes) {
          CHECK(box.flat == next);
          // The box's elements in row-major order have consecutive flat indices from box.flat.
          Dims idx = Dims::filled(dims.size(), 0);
          int64_t expect = box.flat, count = box.sizes.product();
          REQUIRE(count > 0);
          for (int64_t e = 0; e < count; ++e) {
            int64_t flat = 0;
            for (int t = 0; t < dims.size(); ++t) flat = flat * dims[t] + box.offsets[t] + idx[t];
            if (flat != expect) FAIL_CHECK(fmt::format("dims {} range [{},{}) box at {}: element {} is {}", dims, a, b,
                                                       box.offsets, e, flat));
            ++expect;
            for (int t = dims.size() - 1; t >= 0 && ++idx[t] == box.sizes[t]; --t) idx[t] = 0;
          }
          next += count;
        }
        CHECK(next == b);
      }
  }
  CHECK(cases == 36 + 136 + 325 + 703 + 1);  // (T + 1)(T + 2) / 2 ranges of T elements
  CHECK(most == 7);
  CHECK_THROWS_WITH(flat_range_boxes({3, 4}, 5, 8), Contains("range [5, 5 + 8) outside the 12 elements of shape [3,4]"));
  CHECK_THROWS_WITH(flat_range_boxes({3, -1}, 0, 0), Contains("negative"));
}
