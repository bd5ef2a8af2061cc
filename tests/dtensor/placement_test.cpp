#include <catch2/catch.hpp>

#include "dtensor/placement.h"
#include "dtensor/spec.h"
#include "kernels/error.h"

using namespace dtensor;
using Catch::Contains;

TEST_CASE("placement equality follows PyTorch", "[dtensor][placement]") {
  CHECK(Placement{Shard{0}} == Placement{Shard{0}});
  CHECK(Placement{Shard{0}} != Placement{Shard{1}});
  CHECK(Placement{StridedShard{0, 1}} != Placement{Shard{0}});  // distinct kinds
  CHECK(Placement{StridedShard{0, 2}} == Placement{StridedShard{0, 2}});
  CHECK(Placement{StridedShard{0, 2}} != Placement{StridedShard{0, 3}});
  CHECK(Placement{Replicate{}} == Placement{Replicate{}});
  CHECK(Placement{Partial{}} == Placement{Partial{ReduceOp::kSum}});
  CHECK(Placement{Partial{ReduceOp::kAvg}} != Placement{Partial{ReduceOp::kSum}});
  CHECK(!is_shard(StridedShard{0, 2}));
  CHECK(shard_dim(StridedShard{1, 2}) == 1);
  CHECK(shard_dim(Shard{2}) == 2);
  CHECK(!shard_dim(Replicate{}));
  CHECK(!shard_dim(Partial{}));
}

TEST_CASE("placement notation parses and formats", "[dtensor][placement]") {
  struct Case { const char* text; Placement p; const char* canonical; };
  Case cases[] = {
      {"S(0)", Shard{0}, "S(0)"},
      {" S( -1 ) ", Shard{-1}, "S(-1)"},
      {"Shard(2)", Shard{2}, "S(2)"},
      {"_S(0,2)", StridedShard{0, 2}, "_S(0,2)"},
      {"_S(1, sf=3)", StridedShard{1, 3}, "_S(1,3)"},
      {"_S(1,split_factor=4)", StridedShard{1, 4}, "_S(1,4)"},
      {"SS(0,2)", StridedShard{0, 2}, "_S(0,2)"},
      {"R", Replicate{}, "R"},
      {"Replicate()", Replicate{}, "R"},
      {"P", Partial{}, "P"},
      {"P(sum)", Partial{}, "P"},
      {"P(avg)", Partial{ReduceOp::kAvg}, "P(avg)"},
      {"P(min)", Partial{ReduceOp::kMin}, "P(min)"},
      {"P(max)", Partial{ReduceOp::kMax}, "P(max)"},
      {"P(prod)", Partial{ReduceOp::kProd}, "P(prod)"},
      {"Partial(product)", Partial{ReduceOp::kProd}, "P(prod)"},
  };
  for (const Case& c : cases) {
    INFO(c.text);
    CHECK(parse_placement(c.text) == c.p);
    CHECK(to_string(c.p) == c.canonical);
    CHECK(parse_placement(to_string(c.p)) == c.p);
  }
  CHECK(parse_placements("S(0),_S(0,2)") == Placements{Shard{0}, StridedShard{0, 2}});
  CHECK(parse_placements("[R, P(avg), S(1)]") ==
        Placements{Replicate{}, Partial{ReduceOp::kAvg}, Shard{1}});
  CHECK(to_string(Placements{Shard{0}, Replicate{}, Partial{}}) == "S(0),R,P");
}

TEST_CASE("bad placement notation is rejected with the offending text", "[dtensor][placement]") {
  using kernels::InvalidArgument;
  CHECK_THROWS_WITH(parse_placement("X(0)"), Contains("'X(0)'"));
  CHECK_THROWS_WITH(parse_placement("S"), Contains("'S'") && Contains("1 argument expected"));
  CHECK_THROWS_WITH(parse_placement("S(a)"), Contains("'a' is not an integer"));
  CHECK_THROWS_WITH(parse_placement("S(0"), Contains("missing ')'"));
  CHECK_THROWS_WITH(parse_placement("S(0,1)"), Contains("1 argument expected, got 2"));
  CHECK_THROWS_WITH(parse_placement("_S(0)"), Contains("2 arguments expected"));
  CHECK_THROWS_WITH(parse_placement("_S(0,0)"), Contains("split factor 0") && Contains(">= 1"));
  CHECK_THROWS_WITH(parse_placement("_S(0,-2)"), Contains("split factor -2"));
  CHECK_THROWS_WITH(parse_placement("P(mean)"), Contains("unknown reduce op 'mean'"));
  CHECK_THROWS_WITH(parse_placement("R(0)"), Contains("0 arguments expected"));
  CHECK_THROWS_WITH(parse_placements("S(0),,R"), Contains("empty entry"));
  CHECK_THROWS_WITH(parse_placements("[S(0)"), Contains("missing ']'"));
  CHECK_THROWS_AS(parse_placement(""), InvalidArgument);
}

TEST_CASE("shard dims normalise against the tensor ndim", "[dtensor][placement]") {
  CHECK(normalize(Shard{-1}, 3) == Placement{Shard{2}});
  CHECK(normalize(Shard{-3}, 3) == Placement{Shard{0}});
  CHECK(normalize(StridedShard{-2, 2}, 2) == Placement{StridedShard{0, 2}});
  CHECK(normalize(Replicate{}, 0) == Placement{Replicate{}});
  CHECK_THROWS_WITH(normalize(Shard{2}, 2),
                    Contains("shard dim 2 of S(2) out of range for a 2-d tensor (expected -2..1)"));
  CHECK_THROWS_WITH(normalize(Shard{-3}, 2), Contains("shard dim -3"));
  CHECK_THROWS_WITH(normalize(Shard{0}, 0), Contains("0-d tensor"));
  CHECK_THROWS_WITH(normalize(StridedShard{0, 0}, 2), Contains("split factor 0"));
}

TEST_CASE("make_spec validates and normalises", "[dtensor][spec]") {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  DTensorSpec spec = make_spec(mesh, parse_placements("S(-1),R"), {8, 6}, kernels::DType::kF32);
  CHECK(spec.placements == Placements{Shard{1}, Replicate{}});
  CHECK(spec.stride == Dims{6, 1});
  CHECK(make_spec(mesh, parse_placements("R,R"), {0, 3}, kernels::DType::kF32).stride == Dims{3, 1});
  CHECK(spec.is_sharded(1));
  CHECK(!spec.is_sharded(0));
  CHECK(to_string(spec) == "DTensorSpec(mesh=[[0,1],[2,3]], placements=[S(1),R], shape=[8,6], dtype=f32)");
  CHECK(spec == make_spec(std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2})),
                          parse_placements("S(1),R"), {8, 6}, kernels::DType::kF32));

  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("S(0)"), {8, 6}, kernels::DType::kF32),
                    Contains("1 placements (S(0)) for a 2-d mesh (expected 2)"));
  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("S(2),R"), {8, 6}, kernels::DType::kF32),
                    Contains("shard dim 2"));
  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("P(max),P(sum)"), {8}, kernels::DType::kF32),
                    Contains("mix Partial ops max and sum"));
  CHECK_NOTHROW(make_spec(mesh, parse_placements("P(sum),P(avg)"), {8}, kernels::DType::kF32));
  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("R,R"), {8, -1}, kernels::DType::kF32),
                    Contains("negative size -1"));
  CHECK_THROWS_WITH(make_spec(mesh, parse_placements("R,R"), {8, 2}, kernels::DType::kF32, Dims{1}),
                    Contains("stride [1] has 1 entries for shape [8,2]"));
}
