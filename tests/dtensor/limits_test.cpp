// The documented limits of dtensor/ and its arithmetic near int64's limit: layouts of huge
// tensors are exact (no ceil_div overflow), mesh ranks are read as 64-bit, split factors and
// meshes are bounded by name, planning costs the same on any mesh and its byte counts never
// wrap.
#include <catch2/catch.hpp>

#include <chrono>

#include "dtensor/layout.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/checked.h"
#include "kernels/error.h"

using namespace dtensor;
using kernels::InvalidArgument;
using kernels::kInt64Max;
using kernels::Unsupported;

namespace {
std::shared_ptr<const DeviceMesh> mesh_of(const char* text) {
  return std::make_shared<const DeviceMesh>(DeviceMesh::parse(text));
}
}  // namespace

TEST_CASE("chunk is exact for extents near INT64_MAX", "[dtensor][limits][layout]") {
  // ceil(INT64_MAX / 2) = 2^62; piece 1 starts there and holds the rest.
  CHECK(chunk(kInt64Max, 2, 0) == Chunk{0, int64_t{1} << 62});
  CHECK(chunk(kInt64Max, 2, 1) == Chunk{int64_t{1} << 62, kInt64Max - (int64_t{1} << 62)});
  CHECK(chunk(kInt64Max, 3, 2) == Chunk{2 * (kInt64Max / 3 + 1), kInt64Max - 2 * (kInt64Max / 3 + 1)});
  // An empty trailing piece reports offset n, as PyTorch.
  CHECK(chunk(9, 4, 3) == Chunk{9, 0});
  const Dims shape{kInt64Max / 4};  // f32: the largest byte count int64 holds
  const ShardLayout l0 = compute_layout(shape, Dims{2}, {Shard{0}}, Dims{0});
  const ShardLayout l1 = compute_layout(shape, Dims{2}, {Shard{0}}, Dims{1});
  CHECK(l0.local_shape[0] + l1.local_shape[0] == shape[0]);
  CHECK(l1.global_offset[0] == l0.local_shape[0]);
  CHECK(l0.global_offset[0] == 0);
}

TEST_CASE("strided splits do work bounded by their non-empty pieces", "[dtensor][limits][layout]") {
  // Before: one loop turn per split factor (2^31 turns for _S(0,2147483647)). Now the largest
  // allowed factor on a small extent is immediate and matches the definition: with one element
  // per piece, coordinate 0 of 2 keeps every element.
  const auto start = std::chrono::steady_clock::now();
  const ShardLayout l = compute_layout(Dims{8}, Dims{2}, {StridedShard{0, kMaxSplitFactor}}, Dims{0});
  CHECK(l.local_shape[0] == 8);
  CHECK(compute_layout(Dims{8}, Dims{2}, {StridedShard{0, kMaxSplitFactor}}, Dims{1}).local_shape[0] == 0);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));  // a hang guard, not a timing
  // Small cases still follow the piece-by-piece definition (docs/pytorch-semantics.md 2.3).
  CHECK(split_positions(10, 2, 1, 3) == IndexRuns{{2, 2}, {6, 2}, {9, 1}});
  CHECK(split_positions(10, 2, 0, 7) == IndexRuns{{0, 1}, {2, 1}, {4, 1}, {6, 1}, {8, 1}});
}

TEST_CASE("placement parsing bounds dims and split factors by name", "[dtensor][limits][placement]") {
  REQUIRE_THROWS_WITH(parse_placement("S(99999999999)"), Catch::Contains("shard dim 99999999999 is out of range"));
  REQUIRE_THROWS_WITH(parse_placement("_S(0,2147483647)"),
                      Catch::Contains("split factor 2147483647") && Catch::Contains("limit of 1048576"));
  REQUIRE_THROWS_WITH(parse_placement("_S(0,99999999999)"), Catch::Contains("split factor 99999999999 is out of range"));
  CHECK(parse_placement("_S(0,1048576)") == Placement{StridedShard{0, kMaxSplitFactor}});
  REQUIRE_THROWS_WITH(normalize(StridedShard{0, kMaxSplitFactor + 1}, 1), Catch::Contains("exceeds the limit"));
  REQUIRE_THROWS_WITH(parse_placements("R,R,R,R,R,R,R,R,R"), Catch::Contains("more than 8 entries"));
  const std::string long_text(50000, 'R');
  std::string message;
  try {
    parse_placements(long_text);
  } catch (const InvalidArgument& e) {
    message = e.what();
  }
  CHECK(message.find("(50000 chars)") != std::string::npos);
  CHECK(message.size() < 400);
}

TEST_CASE("mesh ranks are read as 64-bit and bounded", "[dtensor][limits][mesh]") {
  REQUIRE_THROWS_WITH(DeviceMesh::parse("[0,4294967297]"), Catch::Contains("holds rank 4294967297"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("[0,18446744073709551615]"), Catch::Contains("18446744073709551615"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("[0,-1]"), Catch::Contains("rank -1"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("3037000500x3037000500"), Catch::Contains("3037000500"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("1024x1025"), Catch::Contains("1049600 ranks, more than the limit of 1048576"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("99999999999999999999"), Catch::Contains("is out of range"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("[[[[[[[[[0]]]]]]]]]"), Catch::Contains("more than 8 dims"));
  REQUIRE_THROWS_WITH(DeviceMesh::parse("2x2x2x2x2x2x2x2x2"), Catch::Contains("more than 8 dims"));
  CHECK(DeviceMesh::parse("[0,2147483647]").ranks() == std::vector<int>{0, 2147483647});
  CHECK(DeviceMesh::parse("1024x1024").size() == kMaxMeshRanks);
}

TEST_CASE("specs whose byte count overflows are refused", "[dtensor][limits][spec]") {
  auto mesh = mesh_of("2");
  CHECK(make_spec(mesh, {Shard{0}}, {kInt64Max}, kernels::DType::kU8).shape[0] == kInt64Max);
  REQUIRE_THROWS_WITH(make_spec(mesh, {Shard{0}}, {kInt64Max}, kernels::DType::kF32),
                      Catch::Contains("byte count overflows int64"));
  REQUIRE_THROWS_WITH(make_spec(mesh, {Shard{0}}, {int64_t{1} << 32, int64_t{1} << 32}, kernels::DType::kU8),
                      Catch::Contains("[4294967296,4294967296]"));
}

TEST_CASE("planner byte counts near int64 are exact or refused", "[dtensor][limits][planner]") {
  // All-gather of an f64 tensor of INT64_MAX / 8 elements on 2 ranks: each receives the other's
  // half, c = 2^59 elements, exactly (before: summed in int64 and compared in a wrapped model).
  const int64_t n = kInt64Max / 8;
  auto mesh2 = mesh_of("2");
  const Plan ag = plan_redistribute(make_spec(mesh2, {Shard{0}}, {n}, kernels::DType::kF64), {Replicate{}},
                                    PlannerKind::kGreedy);
  CHECK(ag.traffic.max_received() == (int64_t{1} << 59) * 8);
  // An all-reduce over 4 of the same tensor moves 2 x 3/4 of it: more than int64 bytes.
  REQUIRE_THROWS_WITH(plan_redistribute(make_spec(mesh_of("4"), {Partial{}}, {n}, kernels::DType::kF64),
                                        {Replicate{}}, PlannerKind::kGreedy),
                      Catch::Contains("overflows int64 bytes"));
}

TEST_CASE("planning does not grow with the mesh", "[dtensor][limits][planner]") {
  // 8192, 100000 and 2^20 ranks plan like 8 (the layout algebra: NOTE [planning cost] in planner.h).
  for (const char* m : {"8192", "100000", "1048576"}) {
    const Plan ag = plan_redistribute(make_spec(mesh_of(m), {Shard{0}}, {8}, kernels::DType::kF32), {Replicate{}},
                                      PlannerKind::kSearch);
    INFO(m << ": " << to_string(ag));
    CHECK(ag.collectives() == 1);
    CHECK(ag.traffic.max_received() == 8 * 4);  // 8 elements, one on each of ranks 0..7: the others receive all
  }
}
