#include <catch2/catch.hpp>

#include "dtensor/mesh.h"
#include "kernels/error.h"

using namespace dtensor;
using Catch::Contains;

TEST_CASE("row-major mesh: coordinates and ranks", "[dtensor][mesh]") {
  DeviceMesh mesh = DeviceMesh::from_shape({2, 4}, {"dp", "tp"});
  CHECK(mesh.ndim() == 2);
  CHECK(mesh.size() == 8);
  CHECK(mesh.size(1) == 4);
  CHECK(mesh.coord_of(6) == Dims{1, 2});
  CHECK(mesh.rank_at({1, 2}) == 6);
  CHECK(!mesh.coord_of(8));
  CHECK(mesh.mesh_dim("tp") == 1);
  for (int r = 0; r < 8; ++r) CHECK(mesh.rank_at(*mesh.coord_of(r)) == r);
  CHECK(to_string(mesh) == "[[0,1,2,3],[4,5,6,7]] (dp,tp)");
}

TEST_CASE("mesh dim groups are ordered by coordinate", "[dtensor][mesh]") {
  DeviceMesh mesh = DeviceMesh::from_shape({2, 4});
  CHECK(mesh.groups(0) == std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(mesh.groups(1) == std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(mesh.group(0, 6) == std::vector<int>{2, 6});
  CHECK(mesh.group(1, 6) == std::vector<int>{4, 5, 6, 7});
  // Explicit (permuted) arrays: groups follow coordinates, not rank order.
  DeviceMesh perm({2, 2}, {3, 2, 1, 0});
  CHECK(perm.coord_of(3) == Dims{0, 0});
  CHECK(perm.group(0, 2) == std::vector<int>{2, 0});
  CHECK(perm.group(1, 1) == std::vector<int>{1, 0});
  // Every rank's group along every dim contains it at index coord[dim].
  DeviceMesh m3 = DeviceMesh::from_shape({3, 2, 2});
  for (int r = 0; r < 12; ++r)
    for (int d = 0; d < 3; ++d) CHECK(m3.group(d, r)[(*m3.coord_of(r))[d]] == r);
}

TEST_CASE("parse: shapes and explicit rank arrays", "[dtensor][mesh]") {
  CHECK(DeviceMesh::parse("4x2") == DeviceMesh::from_shape({4, 2}));
  CHECK(DeviceMesh::parse("8") == DeviceMesh::from_shape({8}));
  CHECK(DeviceMesh::parse("2x2x2", {"a", "b", "c"}).names() == std::vector<std::string>{"a", "b", "c"});
  DeviceMesh m = DeviceMesh::parse("[[0,2],[1,3]]");
  CHECK(m.shape() == Dims{2, 2});
  CHECK(m.ranks() == std::vector<int>{0, 2, 1, 3});
  CHECK(DeviceMesh::parse("[5,7]").shape() == Dims{2});
  CHECK_THROWS_WITH(DeviceMesh::parse("4xx2"), Contains("'4xx2' is malformed at ''"));
  CHECK_THROWS_WITH(DeviceMesh::parse("4x0"), Contains("malformed at '0'"));
  CHECK_THROWS_WITH(DeviceMesh::parse("abc"), Contains("'abc'"));
  CHECK_THROWS_WITH(DeviceMesh::parse("[[0,1],[2]]"), Contains("ragged"));
  CHECK_THROWS_WITH(DeviceMesh::parse("[[0,1],[2,"), Contains("not a valid nested array"));
  CHECK_THROWS_WITH(DeviceMesh::parse("[[0,1],[2,\"x\"]]"), Contains("integer ranks"));
  CHECK_THROWS_WITH(DeviceMesh::parse("[[]]"), Contains("empty dim"));
}

TEST_CASE("invalid meshes are rejected with the offending value", "[dtensor][mesh]") {
  CHECK_THROWS_WITH(DeviceMesh({2, 2}, {0, 1, 2}), Contains("needs 4 ranks, got 3"));
  CHECK_THROWS_WITH(DeviceMesh({2, 2}, {0, 1, 1, 3}), Contains("rank 1 appears more than once"));
  CHECK_THROWS_WITH(DeviceMesh({2}, {0, -1}), Contains("rank -1 is negative"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2, 2}, {"dp", "dp"}), Contains("duplicate mesh dim name 'dp'"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2, 2}, {"dp"}), Contains("1 mesh dim names (dp) for a 2-d mesh"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2, 2}, {"dp", ""}), Contains("must not be empty"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2, 0}), Contains("size 0"));
  DeviceMesh mesh = DeviceMesh::from_shape({2, 2}, {"dp", "tp"});
  CHECK_THROWS_WITH(mesh.mesh_dim("cp"), Contains("unknown mesh dim name 'cp' (mesh dims are named: dp,tp)"));
  CHECK_THROWS_WITH(mesh.size(2), Contains("mesh dim 2 out of range for a 2-d mesh"));
  CHECK_THROWS_WITH(mesh.group(0, 9), Contains("rank 9 is not in mesh"));
  CHECK_THROWS_WITH(mesh.rank_at({0, 2}), Contains("outside mesh shape"));
  CHECK_THROWS_WITH(mesh.rank_at({0}), Contains("1 entries for a 2-d mesh"));
}

TEST_CASE("slicing keeps named dims and fixes the others at the caller", "[dtensor][mesh]") {
  DeviceMesh mesh = DeviceMesh::from_shape({2, 2, 2}, {"dp", "cp", "tp"});
  std::vector<std::string> tp{"tp"}, dp_tp{"dp", "tp"}, tp_dp{"tp", "dp"}, all{"dp", "cp", "tp"};
  CHECK(mesh.slice(tp, 6) == DeviceMesh({2}, {6, 7}, {"tp"}));
  CHECK(mesh.slice(dp_tp, 3) == DeviceMesh({2, 2}, {2, 3, 6, 7}, {"dp", "tp"}));
  CHECK(mesh.slice(all, 5) == mesh);
  CHECK_THROWS_WITH(mesh.slice(tp_dp, 0), Contains("must follow the mesh dim order"));
  std::vector<std::string> bad{"pp"};
  CHECK_THROWS_WITH(mesh.slice(bad, 0), Contains("unknown mesh dim name 'pp'"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2}).slice(tp, 0), Contains("no names"));
}

TEST_CASE("flatten is row-major over the merged dims", "[dtensor][mesh]") {
  DeviceMesh mesh = DeviceMesh::from_shape({2, 2, 2}, {"dp", "cp", "tp"});
  // docs/pytorch-semantics.md 1.4: mesh["dp","cp"]._flatten() gives [0,2,4,6] and [1,3,5,7].
  std::vector<std::string> dp_cp{"dp", "cp"};
  CHECK(mesh.slice(dp_cp, 2).flatten() == DeviceMesh({4}, {0, 2, 4, 6}, {"dp_cp"}));
  CHECK(mesh.slice(dp_cp, 5).flatten() == DeviceMesh({4}, {1, 3, 5, 7}, {"dp_cp"}));
  // Flatten dims in place: the merged dim sits at the first merged position.
  std::vector<int> d01{0, 1}, d02{0, 2}, d12{1, 2};
  DeviceMesh f01 = mesh.flatten(d01);
  CHECK(f01.shape() == Dims{4, 2});
  CHECK(f01.names() == std::vector<std::string>{"dp_cp", "tp"});
  CHECK(f01.groups(0) == std::vector<std::vector<int>>{{0, 2, 4, 6}, {1, 3, 5, 7}});
  DeviceMesh f02 = mesh.flatten(d02, "dp_tp_custom");
  CHECK(f02.shape() == Dims{4, 2});
  CHECK(f02.names() == std::vector<std::string>{"dp_tp_custom", "cp"});
  CHECK(f02.groups(0) == std::vector<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(mesh.flatten(d12).groups(1) == std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(mesh.flatten() == DeviceMesh({8}, {0, 1, 2, 3, 4, 5, 6, 7}, {"dp_cp_tp"}));
  // Explicit arrays keep their ranks.
  CHECK(DeviceMesh::parse("[[3,2],[1,0]]").flatten() == DeviceMesh({4}, {3, 2, 1, 0}));
  std::vector<int> bad{1, 0};
  CHECK_THROWS_WITH(mesh.flatten(bad), Contains("distinct and ascending"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({2, 2}).flatten("x"), Contains("no names"));
}

TEST_CASE("unflatten: one dim into several, row-major (PyTorch's _unflatten)", "[dtensor][mesh]") {
  const DeviceMesh dp = DeviceMesh::from_shape({8}, {"dp"});
  const DeviceMesh two = dp.unflatten(0, {2, 4}, {"rep", "shard"});
  CHECK(two == DeviceMesh::from_shape({2, 4}, {"rep", "shard"}));
  CHECK(two.group(1, 6) == std::vector<int>{4, 5, 6, 7});  // the shard groups: consecutive ranks
  CHECK(two.group(0, 6) == std::vector<int>{2, 6});
  CHECK(dp.unflatten("dp", {2, 2, 2}, {"a", "b", "c"}).shape() == Dims{2, 2, 2});
  // Flattening the new dims gives the mesh back (names are joined).
  const std::vector<int> both{0, 1};
  CHECK(two.flatten(both).ranks() == dp.ranks());
  CHECK(two.flatten(both).names() == std::vector<std::string>{"rep_shard"});
  // A middle dim of a 3-D mesh, on an explicit (permuted) rank array: ranks keep their order.
  const DeviceMesh perm({2, 4}, {7, 6, 5, 4, 3, 2, 1, 0});
  const DeviceMesh split = perm.unflatten(1, {2, 2});
  CHECK(split.shape() == Dims{2, 2, 2});
  CHECK(split.ranks() == perm.ranks());
  for (int r = 0; r < 8; ++r) {
    const Dims c = *split.coord_of(r), p = *perm.coord_of(r);
    CHECK(c[0] == p[0]);
    CHECK(c[1] * 2 + c[2] == p[1]);
  }
  // Errors name the bad value.
  CHECK_THROWS_WITH(dp.unflatten(0, {3, 3}, {"a", "b"}), Contains("multiply to 9, but mesh dim 0 has size 8"));
  CHECK_THROWS_WITH(dp.unflatten(0, {2, 4}, {"a"}), Contains("needs 2 names, got 1"));
  CHECK_THROWS_WITH(dp.unflatten(0, {2, 4}, {"a", "a"}), Contains("duplicate mesh dim name 'a'"));
  CHECK_THROWS_WITH(dp.unflatten(1, {2, 4}, {"a", "b"}), Contains("mesh dim 1 out of range"));
  CHECK_THROWS_WITH(DeviceMesh::from_shape({4}).unflatten(0, {2, 2}, {"a", "b"}), Contains("have no names"));
  CHECK_THROWS_WITH(dp.unflatten(0, {0, 8}, {"a", "b"}), Contains("have a size 0"));
}
