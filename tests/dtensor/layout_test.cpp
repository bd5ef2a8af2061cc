// The chunk table of docs/pytorch-semantics.md 2.1, the worked examples of 2.2-2.4 and the
// conformance cases of 6.1 (PyTorch's test_utils.py cases, reproduced from their asserted values).
#include <catch2/catch.hpp>

#include "dtensor/layout.h"
#include "dtensor/spec.h"
#include "kernels/error.h"

using namespace dtensor;
using Catch::Contains;

namespace {

using Indices = std::vector<int64_t>;

ShardLayout at(const Dims& shape, const Dims& mesh, const char* placements, const Dims& coord) {
  return compute_layout(shape, mesh, normalize_placements(parse_placements(placements), mesh.size(),
                                                          shape.size()),
                        coord);
}

// Local size and offset of dim 0.
std::pair<int64_t, int64_t> rows(const Dims& shape, const Dims& mesh, const char* placements,
                                 const Dims& coord) {
  ShardLayout l = at(shape, mesh, placements, coord);
  return {l.local_shape[0], l.global_offset[0]};
}

Indices iota(int64_t begin, int64_t end) {
  Indices v;
  for (int64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST_CASE("chunk rule table (torch.chunk, trailing empties)", "[dtensor][layout]") {
  struct Row { int64_t n, k; std::vector<int64_t> sizes; };
  std::vector<Row> table = {
      {16, 4, {4, 4, 4, 4}}, {17, 4, {5, 5, 5, 2}}, {15, 4, {4, 4, 4, 3}}, {9, 4, {3, 3, 3, 0}},
      {10, 4, {3, 3, 3, 1}}, {13, 4, {4, 4, 4, 1}}, {7, 4, {2, 2, 2, 1}},  {6, 4, {2, 2, 2, 0}},
      {5, 4, {2, 2, 1, 0}},  {3, 4, {1, 1, 1, 0}},  {2, 4, {1, 1, 0, 0}},  {1, 4, {1, 0, 0, 0}},
      {0, 4, {0, 0, 0, 0}},  {8, 16, {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0}},
  };
  for (const Row& row : table) {
    INFO("n=" << row.n << " k=" << row.k);
    int64_t expected_offset = 0;
    for (int64_t r = 0; r < row.k; ++r) {
      Chunk c = chunk(row.n, row.k, r);
      CHECK(c.size == row.sizes[r]);
      if (c.size > 0) CHECK(c.offset == expected_offset);
      expected_offset += c.size;
    }
  }
  // Closed form for empty pieces: a piece starting past the end reports offset n, one starting
  // exactly at the end reports that start (also n).
  CHECK(chunk(5, 4, 3) == Chunk{5, 0});  // c = 2, start 6 > 5
  CHECK(chunk(6, 4, 3) == Chunk{6, 0});  // start 6 == n
  CHECK(chunk(1, 4, 3) == Chunk{1, 0});
  CHECK(chunk(0, 4, 2) == Chunk{0, 0});
  // _split_tensor pad sizes (6.1 case 15): on 8 ranks, pad = 0 for idx < size else 1; size 0 -> 0.
  for (int64_t n = 0; n < 8; ++n)
    for (int64_t r = 0; r < 8; ++r) {
      int64_t full = (n + 7) / 8;
      CHECK(full - chunk(n, 8, r).size == (n == 0 ? 0 : (r < n ? 0 : 1)));
    }
}

TEST_CASE("nested uneven sharding, left to right (2.2)", "[dtensor][layout]") {
  // 13 rows, mesh (4,2), (S0,S0).
  struct Row { Dims coord; int64_t size, offset; };
  std::vector<Row> table = {{{0, 0}, 2, 0}, {{0, 1}, 2, 2}, {{1, 0}, 2, 4},  {{1, 1}, 2, 6},
                            {{2, 0}, 2, 8}, {{2, 1}, 2, 10}, {{3, 0}, 1, 12}, {{3, 1}, 0, 13}};
  for (const Row& row : table) {
    ShardLayout l = at({13}, {4, 2}, "S(0),S(0)", row.coord);
    CHECK(l.local_shape[0] == row.size);
    CHECK(l.global_offset[0] == row.offset);
    CHECK(l.indices(0) == iota(row.offset, row.offset + row.size));
  }
  // 5 rows on (2,2): 2,1,1,1 (not the flat 2,2,1,0).
  CHECK(at({5}, {2, 2}, "S(0),S(0)", {0, 0}).indices(0) == Indices{0, 1});
  CHECK(at({5}, {2, 2}, "S(0),S(0)", {0, 1}).indices(0) == Indices{2});
  CHECK(at({5}, {2, 2}, "S(0),S(0)", {1, 0}).indices(0) == Indices{3});
  CHECK(at({5}, {2, 2}, "S(0),S(0)", {1, 1}).indices(0) == Indices{4});
  // Sentinel in the middle of the tensor (2.4): 4 rows, mesh (4,2), coord (0,1) -> offset 4.
  CHECK(rows({4, 3}, {4, 2}, "S(0),S(0)", {0, 1}) == std::pair<int64_t, int64_t>{0, 4});
  // Unsharded dims report offset 0 even when empty.
  ShardLayout l = at({0, 3}, {2}, "S(1)", {1});
  CHECK(l.local_shape == Dims{0, 1});
  CHECK(l.global_offset == Dims{0, 2});
}

TEST_CASE("StridedShard split rule (2.3)", "[dtensor][layout][strided]") {
  auto held = [](int64_t n, int64_t k, int sf) {
    std::vector<Indices> out;
    for (int64_t r = 0; r < k; ++r) {
      Indices v;
      for (const IndexRun& run : split_positions(n, k, r, sf))
        for (int64_t i = 0; i < run.length; ++i) v.push_back(run.start + i);
      out.push_back(v);
    }
    return out;
  };
  CHECK(held(9, 4, 2) == std::vector<Indices>{{0, 1, 5}, {2, 3, 6}, {4, 7}, {8}});
  CHECK(held(5, 2, 2) == std::vector<Indices>{{0, 1, 3}, {2, 4}});
  CHECK(held(6, 8, 2) == std::vector<Indices>{{0, 3}, {1, 4}, {2, 5}, {}, {}, {}, {}, {}});
  CHECK(held(8, 2, 3) == std::vector<Indices>{{0, 1, 3, 4, 6}, {2, 5, 7}});
  // 6.1 case 17: 1-D mesh of 4, arange(8).
  CHECK(held(8, 4, 1) == std::vector<Indices>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(held(8, 4, 2) == std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});

  // 8 rows, mesh (2,2), (_S(0,2), S0): (0,0)=0,1 (0,1)=4,5 (1,0)=2,3 (1,1)=6,7.
  CHECK(at({8}, {2, 2}, "_S(0,2),S(0)", {0, 0}).indices(0) == Indices{0, 1});
  CHECK(at({8}, {2, 2}, "_S(0,2),S(0)", {0, 1}).indices(0) == Indices{4, 5});
  CHECK(at({8}, {2, 2}, "_S(0,2),S(0)", {1, 0}).indices(0) == Indices{2, 3});
  CHECK(at({8}, {2, 2}, "_S(0,2),S(0)", {1, 1}).indices(0) == Indices{6, 7});
  CHECK(at({8}, {2, 2}, "_S(0,2),S(0)", {0, 1}).global_offset[0] == 4);
  // (S0, _S(0,2)) on 8 rows.
  CHECK(at({8}, {2, 2}, "S(0),_S(0,2)", {0, 0}).indices(0) == Indices{0, 2});
  CHECK(at({8}, {2, 2}, "S(0),_S(0,2)", {0, 1}).indices(0) == Indices{1, 3});
  CHECK(at({8}, {2, 2}, "S(0),_S(0,2)", {1, 0}).indices(0) == Indices{4, 6});
  CHECK(at({8}, {2, 2}, "S(0),_S(0,2)", {1, 1}).indices(0) == Indices{5, 7});
  CHECK(!at({8}, {2, 2}, "S(0),_S(0,2)", {1, 1}).contiguous(0));
  // _S(d,1) holds the same data as S(d).
  for (int64_t n = 0; n < 12; ++n)
    for (int64_t r = 0; r < 4; ++r)
      CHECK(at({n}, {4}, "_S(0,1)", {r}).runs == at({n}, {4}, "S(0)", {r}).runs);
  // Hazard case (6.3): 7 rows, mesh (3,2), (_S(0,2), S0): the split rule, not the order rule.
  std::vector<std::pair<Dims, Indices>> hazard = {{{0, 0}, {0, 1}}, {{0, 1}, {4}}, {{1, 0}, {2, 3}},
                                                  {{1, 1}, {5}},    {{2, 0}, {6}}, {{2, 1}, {}}};
  for (const auto& [coord, expected] : hazard)
    CHECK(at({7}, {3, 2}, "_S(0,2),S(0)", coord).indices(0) == expected);
  CHECK(rows({7}, {3, 2}, "_S(0,2),S(0)", {2, 1}) == std::pair<int64_t, int64_t>{0, 7});
}

TEST_CASE("HeldIndices and slice_runs agree with the index list, without building it",
          "[dtensor][layout][strided]") {
  // Every layout of small shapes on meshes (4) and (2,3) under shard, strided and nested
  // placements: position i of HeldIndices is indices()[i], and every slice of the runs lists the
  // same indices as that slice of the list.
  int layouts = 0;
  int64_t slices = 0, want_slices = 0;
  for (const char* pl : {"S(0)", "_S(0,2)", "_S(0,3)"})
    for (int64_t n = 0; n <= 13; ++n)
      for (int64_t r = 0; r < 4; ++r) {
        const ShardLayout l = at({n}, {4}, pl, {r});
        const Indices want = l.indices(0);
        const HeldIndices h(l.runs[0]);
        REQUIRE(h.size() == static_cast<int64_t>(want.size()));
        for (int64_t i = 0; i < h.size(); ++i) CHECK(h[i] == want[i]);
        ++layouts;
        want_slices += (h.size() + 1) * (h.size() + 2) / 2;
        for (int64_t off = 0; off <= h.size(); ++off)
          for (int64_t len = 0; off + len <= h.size(); ++len) {
            Indices got;
            for (const IndexRun& run : slice_runs(l.runs[0], off, len))
              for (int64_t i = 0; i < run.length; ++i) got.push_back(run.start + i);
            CHECK(got == Indices(want.begin() + off, want.begin() + off + len));
            ++slices;
          }
      }
  for (const char* pl : {"S(0),_S(0,2)", "_S(0,2),S(0)", "S(0),S(0)"})
    for (int64_t a = 0; a < 2; ++a)
      for (int64_t b = 0; b < 3; ++b) {
        const ShardLayout l = at({17}, {2, 3}, pl, {a, b});
        const Indices want = l.indices(0);
        const HeldIndices h(l.runs[0]);
        REQUIRE(h.size() == static_cast<int64_t>(want.size()));
        for (int64_t i = 0; i < h.size(); ++i) CHECK(h[i] == want[i]);
        ++layouts;
      }
  CHECK(layouts == 3 * 14 * 4 + 3 * 6);
  CHECK(slices == want_slices);
  CHECK(slices > 900);
  // The worked examples of the header.
  CHECK(slice_runs({{0, 4}, {8, 4}}, 2, 4) == IndexRuns{{2, 2}, {8, 2}});
  const HeldIndices h(IndexRuns{{0, 2}, {6, 2}});
  CHECK(h.size() == 4);
  CHECK(h[2] == 6);
  // A huge dim costs nothing: one run of 2^62 indices.
  const HeldIndices big(IndexRuns{{5, int64_t{1} << 62}});
  CHECK(big[(int64_t{1} << 62) - 1] == (int64_t{1} << 62) + 4);
  CHECK(slice_runs({{5, int64_t{1} << 62}}, int64_t{1} << 61, 3) == IndexRuns{{(int64_t{1} << 61) + 5, 3}});
  CHECK_THROWS_AS(slice_runs({{0, 4}}, 3, 2), kernels::InvalidArgument);
  CHECK_THROWS_AS(slice_runs({{0, 4}}, -1, 1), kernels::InvalidArgument);
}

TEST_CASE("PyTorch test_utils conformance cases (6.1)", "[dtensor][layout][conformance]") {
  using P = std::pair<int64_t, int64_t>;
  SECTION("1: (4096,4096) on (30,8) [_S(0,8), S0]") {
    for (int64_t dp = 0; dp < 30; ++dp)
      for (int64_t tp = 0; tp < 8; ++tp) {
        P got = rows({4096, 4096}, {30, 8}, "_S(0,8),S(0)", {dp, tp});
        if (dp < 28) CHECK(got == P{18, tp * 512 + 18 * dp});
        if (dp == 28) CHECK(got == P{8, tp * 512 + 18 * dp});
        if (dp == 29) CHECK(got == P{0, 4096});
      }
  }
  SECTION("2: (18,2) on (4,2) [S0,S0]") {
    for (int64_t dp = 0; dp < 3; ++dp) {
      CHECK(rows({18, 2}, {4, 2}, "S(0),S(0)", {dp, 0}) == P{3, 5 * dp});
      CHECK(rows({18, 2}, {4, 2}, "S(0),S(0)", {dp, 1}) == P{2, 5 * dp + 3});
    }
    CHECK(rows({18, 2}, {4, 2}, "S(0),S(0)", {3, 0}) == P{2, 15});
    CHECK(rows({18, 2}, {4, 2}, "S(0),S(0)", {3, 1}) == P{1, 17});
  }
  SECTION("3: (13,2) on (4,2) [S0,S0]") {
    for (int64_t dp = 0; dp < 3; ++dp) {
      CHECK(rows({13, 2}, {4, 2}, "S(0),S(0)", {dp, 0}) == P{2, 4 * dp});
      CHECK(rows({13, 2}, {4, 2}, "S(0),S(0)", {dp, 1}) == P{2, 4 * dp + 2});
    }
    CHECK(rows({13, 2}, {4, 2}, "S(0),S(0)", {3, 0}) == P{1, 12});
    CHECK(rows({13, 2}, {4, 2}, "S(0),S(0)", {3, 1}) == P{0, 13});
  }
  SECTION("4: (18,2) on (4,2) [_S(0,2),S0]") {
    for (int64_t dp = 0; dp < 3; ++dp)
      for (int64_t tp = 0; tp < 2; ++tp)
        CHECK(rows({18, 2}, {4, 2}, "_S(0,2),S(0)", {dp, tp}) == P{3, tp * 9 + 3 * dp});
    CHECK(rows({18, 2}, {4, 2}, "_S(0,2),S(0)", {3, 0}) == P{0, 18});
    CHECK(rows({18, 2}, {4, 2}, "_S(0,2),S(0)", {3, 1}) == P{0, 18});
  }
  SECTION("5: (39,2) on (4,2) [_S(0,3),_S(0,4)]") {
    for (int64_t dp = 0; dp < 3; ++dp) {
      CHECK(rows({39, 2}, {4, 2}, "_S(0,3),_S(0,4)", {dp, 0}) == P{8, 4 * dp});
      CHECK(rows({39, 2}, {4, 2}, "_S(0,3),_S(0,4)", {dp, 1}) == P{4, 4 * dp + 2});
    }
    CHECK(rows({39, 2}, {4, 2}, "_S(0,3),_S(0,4)", {3, 0}) == P{3, 12});
    CHECK(rows({39, 2}, {4, 2}, "_S(0,3),_S(0,4)", {3, 1}) == P{0, 39});
  }
  SECTION("6: (18,2) on (4,2) [S0,_S(0,2)]") {
    for (int64_t dp = 0; dp < 3; ++dp) {
      CHECK(rows({18, 2}, {4, 2}, "S(0),_S(0,2)", {dp, 0}) == P{3, 5 * dp});
      CHECK(rows({18, 2}, {4, 2}, "S(0),_S(0,2)", {dp, 1}) == P{2, 5 * dp + 2});
    }
    CHECK(rows({18, 2}, {4, 2}, "S(0),_S(0,2)", {3, 0}) == P{2, 15});
    CHECK(rows({18, 2}, {4, 2}, "S(0),_S(0,2)", {3, 1}) == P{1, 16});
  }
  SECTION("7: (39,2) on (4,2,3) [S0,_S(0,2),S0]") {
    const char* pl = "S(0),_S(0,2),S(0)";
    for (int64_t m0 = 0; m0 < 3; ++m0) {
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 0, 0}) == P{2, 10 * m0});
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 0, 1}) == P{2, 10 * m0 + 2});
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 0, 2}) == P{2, 10 * m0 + 6});
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 1, 0}) == P{2, 10 * m0 + 3});
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 1, 1}) == P{2, 10 * m0 + 8});
      CHECK(rows({39, 2}, {4, 2, 3}, pl, {m0, 1, 2}) == P{0, 39});
    }
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 0, 0}) == P{2, 30});
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 0, 1}) == P{2, 32});
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 0, 2}) == P{1, 36});
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 1, 0}) == P{2, 33});
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 1, 1}) == P{2, 37});
    CHECK(rows({39, 2}, {4, 2, 3}, pl, {3, 1, 2}) == P{0, 39});
  }
  SECTION("8: (15,5) on (4,2) [_S(0,2),S0], ranks row-major") {
    std::vector<int64_t> sizes = {2, 2, 2, 2, 2, 2, 2, 1}, offsets = {0, 8, 2, 10, 4, 12, 6, 14};
    for (int64_t r = 0; r < 8; ++r) {
      ShardLayout l = at({15, 5}, {4, 2}, "_S(0,2),S(0)", {r / 2, r % 2});
      CHECK(l.local_shape == Dims{sizes[r], 5});
      CHECK(l.global_offset == Dims{offsets[r], 0});
    }
  }
  SECTION("9: (16,16) on (2,2,2) [_S(0,2),S0,S0]") {
    for (int64_t m0 = 0; m0 < 2; ++m0)
      for (int64_t m1 = 0; m1 < 2; ++m1)
        for (int64_t m2 = 0; m2 < 2; ++m2) {
          ShardLayout l = at({16, 16}, {2, 2, 2}, "_S(0,2),S(0),S(0)", {m0, m1, m2});
          CHECK(l.local_shape == Dims{2, 16});
          CHECK(l.global_offset == Dims{4 * m0 + 8 * m1 + 2 * m2, 0});
        }
  }
  SECTION("10: (16,16) on (1,2,2,2)") {
    for (int64_t m1 = 0; m1 < 2; ++m1)
      for (int64_t m2 = 0; m2 < 2; ++m2)
        for (int64_t m3 = 0; m3 < 2; ++m3) {
          Dims c{0, m1, m2, m3};
          ShardLayout a = at({16, 16}, {1, 2, 2, 2}, "_S(0,2),_S(1,2),S(0),S(1)", c);
          CHECK(a.local_shape == Dims{8, 4});
          CHECK(a.global_offset == Dims{8 * m2, 8 * m3 + 4 * m1});
          ShardLayout b = at({16, 16}, {1, 2, 2, 2}, "_S(0,2),_S(1,2),S(0),S(0)", c);
          CHECK(b.local_shape == Dims{4, 8});
          CHECK(b.global_offset == Dims{8 * m2 + 4 * m3, 4 * m1});
        }
  }
  SECTION("11: FSDP+TP even, (2W,2) on (W/2,2) [_S(0,2),S0]") {
    for (int64_t w : {2, 4, 8, 16})
      for (int64_t dp = 0; dp < w / 2; ++dp)
        for (int64_t tp = 0; tp < 2; ++tp) {
          ShardLayout l = at({2 * w, 2}, {w / 2, 2}, "_S(0,2),S(0)", {dp, tp});
          int64_t shard = tp * (w / 2) + dp;
          CHECK(l.indices(0) == iota(2 * shard, 2 * shard + 2));
        }
  }
  SECTION("12: HSDP+TP, (8,2) on (R,2,2) [R,_S(0,2),S0]") {
    for (int64_t rep : {1, 2, 3})
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t dp = 0; dp < 2; ++dp)
          for (int64_t tp = 0; tp < 2; ++tp) {
            int64_t shard = tp * 2 + dp;
            CHECK(at({8, 2}, {rep, 2, 2}, "R,_S(0,2),S(0)", {r, dp, tp}).indices(0) ==
                  iota(2 * shard, 2 * shard + 2));
          }
  }
  SECTION("13: 1-D, sizes 0..2W+1 on W ranks [S0]: (offset, size) slices the global tensor") {
    for (int64_t w = 1; w <= 8; ++w)
      for (int64_t n = 0; n <= 2 * w + 1; ++n) {
        int64_t covered = 0;
        for (int64_t r = 0; r < w; ++r) {
          ShardLayout l = at({n, 3}, {w}, "S(0)", {r});
          if (l.local_shape[0] > 0) {
            CHECK(l.indices(0) == iota(l.global_offset[0], l.global_offset[0] + l.local_shape[0]));
            CHECK(l.global_offset[0] == covered);
          } else {
            CHECK(l.global_offset[0] == n);
          }
          covered += l.local_shape[0];
        }
        CHECK(covered == n);
      }
  }
  SECTION("14: mesh (2,4), pairs from {S0,S1,R}^2, shape (d0, 64/d0)") {
    const char* ps[] = {"S(0)", "S(1)", "R"};
    for (const char* a : ps)
      for (const char* b : ps)
        for (int64_t d0 = 1; d0 <= 8; ++d0) {
          std::string pl = std::string(a) + "," + b;
          Dims shape{d0, 64 / d0};
          for (int64_t c0 = 0; c0 < 2; ++c0)
            for (int64_t c1 = 0; c1 < 4; ++c1) {
              ShardLayout l = at(shape, {2, 4}, pl.c_str(), {c0, c1});
              for (int t = 0; t < 2; ++t)
                if (l.local_shape[t] > 0)
                  CHECK(l.indices(t) ==
                        iota(l.global_offset[t], l.global_offset[t] + l.local_shape[t]));
            }
        }
  }
  SECTION("18: arange(8).reshape(2,4) on (2,2) [_S(1,2),S1]") {
    CHECK(at({2, 4}, {2, 2}, "_S(1,2),S(1)", {0, 0}).indices(1) == Indices{0});
    CHECK(at({2, 4}, {2, 2}, "_S(1,2),S(1)", {0, 1}).indices(1) == Indices{2});
    CHECK(at({2, 4}, {2, 2}, "_S(1,2),S(1)", {1, 0}).indices(1) == Indices{1});
    CHECK(at({2, 4}, {2, 2}, "_S(1,2),S(1)", {1, 1}).indices(1) == Indices{3});
  }
  SECTION("19: uneven strided [_S(1,2),S1] on (W/2,2) covers every column once") {
    for (int64_t w : {2, 4, 8})
      for (int64_t n : {2, 3, 5, 11}) {
        std::vector<int> seen(n, 0);
        for (int64_t dp = 0; dp < w / 2; ++dp)
          for (int64_t tp = 0; tp < 2; ++tp)
            for (int64_t i : at({3, n}, {w / 2, 2}, "_S(1,2),S(1)", {dp, tp}).indices(1)) ++seen[i];
        CHECK(seen == std::vector<int>(n, 1));
      }
  }
}

TEST_CASE("layout of ranks outside the mesh and invalid arguments", "[dtensor][layout]") {
  DeviceMesh mesh({2}, {3, 5});
  CHECK(!layout_of_rank({4}, mesh, {Shard{0}}, 0));
  CHECK(layout_of_rank({4}, mesh, {Shard{0}}, 5)->indices(0) == Indices{2, 3});
  CHECK_THROWS_WITH(compute_layout({4}, {2}, {Shard{0}, Shard{0}}, {0}),
                    Contains("2 placements (S(0),S(0)) for a 1-d mesh"));
  CHECK_THROWS_WITH(compute_layout({4}, {2}, {Shard{1}}, {0}), Contains("shard dim 1"));
  CHECK_THROWS_WITH(compute_layout({4}, {2}, {StridedShard{0, 0}}, {0}), Contains("split factor 0"));
  CHECK_THROWS_WITH(compute_layout({4}, {2}, {Shard{0}}, {2}), Contains("outside mesh shape"));
}
