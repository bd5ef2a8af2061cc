// The sharding rule tables (pure data) and the strategy choice over N-D meshes.
#include <catch2/catch.hpp>

#include "dtensor/ops/rules.h"
#include "kernels/error.h"

using namespace dtensor;
using namespace dtensor::ops;

namespace {

DTensorSpec spec(const Dims& mesh_shape, const char* placements, const Dims& shape) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh_shape));
  return make_spec(mesh, parse_placements(placements), shape, DType::kF32);
}

}  // namespace

TEST_CASE("einsum rules of a matmul", "[ops][rules]") {
  const RuleSet rs = einsum_rules("mk,kn->mn");
  CHECK(to_string(rs) ==
        "einsum(mk,kn->mn)\n"
        "  S(0),R -> S(0) | grads S(0),P\n"
        "  R,S(1) -> S(1) | grads P,S(1)\n"
        "  S(1),S(0) -> P | grads S(1),S(0)\n"
        "  R,R -> R | grads R,R\n"
        "  P,R -> P | grads R,P\n"
        "  R,P -> P | grads P,R\n");
}

TEST_CASE("einsum rules: batch, free and contracted labels", "[ops][rules]") {
  const RuleSet rs = einsum_rules("btn,btk->nk");  // a Linear's weight gradient
  // n and k are free, b and t contracted: no batch rule.
  REQUIRE(rs.rules.size() == 7);
  CHECK(to_string(rs.rules[0]) == "S(2),R -> S(0) | grads S(2),P");
  CHECK(to_string(rs.rules[1]) == "R,S(2) -> S(1) | grads P,S(2)");
  CHECK(to_string(rs.rules[2]) == "S(0),S(0) -> P | grads S(0),S(0)");
  CHECK(to_string(rs.rules[3]) == "S(1),S(1) -> P | grads S(1),S(1)");
  const RuleSet bmm = einsum_rules("bmk,bkn->bmn");
  bool has_batch = false;
  for (const Rule& r : bmm.rules)
    has_batch = has_batch || to_string(r) == "S(0),S(0) -> S(0) | grads S(0),S(0)";
  CHECK(has_batch);
}

TEST_CASE("einsum rules reject malformed equations", "[ops][rules]") {
  CHECK_THROWS_WITH(einsum_rules("mk,kn"), Catch::Contains("is not of the form"));
  CHECK_THROWS_WITH(einsum_rules("mm,kn->mn"), Catch::Contains("repeats"));
  CHECK_THROWS_WITH(einsum_rules("mk,kn->mq"), Catch::Contains("'q'"));
  CHECK_THROWS_WITH(einsum_rules("mkz,kn->mn"), Catch::Contains("first operand only"));
}

TEST_CASE("element-wise, reduction, norm, embedding, loss and view rules", "[ops][rules]") {
  CHECK(to_string(binary_rules(Pointwise::kAdd, 3, 1)) ==
        "add(a:3d, b:1d)\n"
        "  S(0),R -> S(0) | grads S(0),P\n"
        "  S(1),R -> S(1) | grads S(1),P\n"
        "  S(2),S(0) -> S(2) | grads S(2),S(0)\n"
        "  R,R -> R | grads R,R\n"
        "  P,P -> P | grads R,R\n");
  CHECK(to_string(binary_rules(Pointwise::kMul, 1, 1)) ==
        "mul(a:1d, b:1d)\n"
        "  S(0),S(0) -> S(0) | grads S(0),S(0)\n"
        "  R,R -> R | grads R,R\n"
        "  P,R -> P | grads R,P\n"
        "  R,P -> P | grads P,R\n");
  CHECK_THROWS_AS(binary_rules(Pointwise::kAdd, 1, 2), kernels::InvalidArgument);
  CHECK(to_string(unary_rules("gelu", 2, false)) ==
        "gelu(2d)\n  S(0) -> S(0) | grads S(0)\n  S(1) -> S(1) | grads S(1)\n  R -> R | grads R\n");
  CHECK(unary_rules("scale", 2, true).rules.back() == Rule{{Partial{}}, {Partial{}}, {Replicate{}}});
  const int dims[] = {1};
  CHECK(to_string(sum_rules(3, dims)) ==
        "sum(3d, 1 dims)\n"
        "  S(0) -> S(0) | grads S(0)\n"
        "  S(1) -> P | grads S(1)\n"
        "  S(2) -> S(1) | grads S(2)\n"
        "  R -> R | grads R\n"
        "  P -> P | grads R\n");
  CHECK(to_string(softmax_rules(2)) ==
        "softmax(2d, last dim)\n  S(0) -> S(0) | grads S(0)\n  R -> R | grads R\n");
  CHECK(to_string(norm_rules(3, 2, 2)) ==
        "norm(3d, 2 params, 2 stats)\n"
        "  S(0),R,R -> S(0),S(0),S(0) | grads S(0),P,P\n"
        "  S(1),R,R -> S(1),S(1),S(1) | grads S(1),P,P\n"
        "  R,R,R -> R,R,R | grads R,R,R\n");
  CHECK(to_string(embedding_rules(2)) ==
        "embedding(ids 2d)\n"
        "  R,S(0) -> S(0) | grads P,R\n"
        "  R,S(1) -> S(1) | grads P,R\n"
        "  S(1),R -> S(2) | grads S(1),R\n"
        "  S(0),R -> P | grads S(0),R\n"
        "  R,R -> R | grads R,R\n");
  CHECK(to_string(cross_entropy_rules(3)) ==
        "cross_entropy(logits 3d)\n"
        "  S(0),S(0) -> P | grads S(0),S(0)\n"
        "  S(1),S(1) -> P | grads S(1),S(1)\n"
        "  S(2),R -> R | grads S(2),R | reduces\n"
        "  R,R -> R | grads R,R\n");
  CHECK(attention_rules().rules.size() == 3);
  CHECK(to_string(transpose_rules(3, 1, 2)) ==
        "transpose(3d, 1, 2)\n"
        "  S(0) -> S(0) | grads S(0)\n"
        "  S(1) -> S(2) | grads S(1)\n"
        "  S(2) -> S(1) | grads S(2)\n"
        "  R -> R | grads R\n"
        "  P -> P | grads R\n");
}

TEST_CASE("view rules: a shard survives a split or merge only on whole blocks", "[ops][rules]") {
  // [B=2, T=6, D=8] -> [2, 6, H=4, E=2] on a mesh of 2 with S(2): 4 heads split evenly.
  RuleSet split = view_rules({2, 6, 8}, {2, 6, 4, 2}, {2}, parse_placements("S(2)"));
  bool has = false;
  for (const Rule& r : split.rules) has = has || to_string(r) == "S(2) -> S(2) | grads S(2)";
  CHECK(has);
  // 3 heads over 2 ranks: no rule for S(2) (the view would cut a head).
  RuleSet uneven = view_rules({2, 6, 6}, {2, 6, 3, 2}, {2}, parse_placements("S(2)"));
  for (const Rule& r : uneven.rules) CHECK(to_string(r) != "S(2) -> S(2) | grads S(2)");
  // merge [2, 6, 4, 2] -> [2, 6, 8]: S(2) (heads) maps to S(2); S(3) has no rule.
  RuleSet merge = view_rules({2, 6, 4, 2}, {2, 6, 8}, {2}, parse_placements("S(3)"));
  for (const Rule& r : merge.rules) CHECK(to_string(r) != "S(3) -> S(2) | grads S(3)");
  CHECK_THROWS_WITH(view_rules({2, 3}, {3, 2}, {2}, parse_placements("R")),
                    Catch::Contains("not a combination of splitting"));
  CHECK_THROWS_WITH(view_rules({2, 3}, {7}, {2}, parse_placements("R")), Catch::Contains("elements"));
  // Size-1 dims dropped or added.
  CHECK_NOTHROW(view_rules({4, 1}, {4}, {2}, parse_placements("S(0)")));
  CHECK_NOTHROW(view_rules({4}, {1, 4}, {2}, parse_placements("S(0)")));
}

TEST_CASE("choose_strategy keeps fitting rules per mesh dim", "[ops][strategy]") {
  PlanCache plans;
  const RuleSet rs = einsum_rules("btk,nk->btn");
  // dp x tp: batch over mesh dim 0, weight rows over mesh dim 1 (colwise).
  const DTensorSpec in[] = {spec({2, 2}, "S(0),R", {4, 3, 8}), spec({2, 2}, "R,S(0)", {6, 8})};
  const Strategy st = choose_strategy(rs, in, plans);
  CHECK(to_string(st.outputs[0]) == "S(0),S(2)");
  CHECK(to_string(st.grads[0]) == "S(0),P");
  CHECK(to_string(st.grads[1]) == "P,S(0)");
  CHECK(st.redistributed == std::vector<char>{0, 0});
  CHECK(st.cost_us == 0);
  // Rowwise: x S(-1) with w S(1) contracts over tp: a Partial output.
  const DTensorSpec row[] = {spec({2, 2}, "S(0),S(2)", {4, 3, 8}), spec({2, 2}, "R,S(1)", {6, 8})};
  CHECK(to_string(choose_strategy(rs, row, plans).outputs[0]) == "S(0),P");
  // A 1-D mesh and a 3-D mesh.
  const DTensorSpec one[] = {spec({4}, "R", {4, 3, 8}), spec({4}, "S(0)", {6, 8})};
  CHECK(to_string(choose_strategy(rs, one, plans).outputs[0]) == "S(2)");
  const DTensorSpec three[] = {spec({2, 2, 2}, "S(0),S(1),R", {4, 6, 8}),
                               spec({2, 2, 2}, "R,R,S(1)", {6, 8})};
  CHECK(to_string(choose_strategy(rs, three, plans).outputs[0]) == "S(0),S(1),P");
}

TEST_CASE("choose_strategy redistributes by the cheapest plan", "[ops][strategy]") {
  PlanCache plans;
  const RuleSet rs = einsum_rules("mk,kn->mn");
  // a S(1) with b R fits no rule: chunking b to S(0) is free, gathering a is not.
  const DTensorSpec in[] = {spec({2}, "S(1)", {8, 6}), spec({2}, "R", {6, 4})};
  Strategy st = choose_strategy(rs, in, plans);
  CHECK(to_string(st.inputs[1]) == "S(0)");
  CHECK(to_string(st.outputs[0]) == "P");
  CHECK(st.redistributed == std::vector<char>{0, 1});
  CHECK(st.cost_us == 0);
  // a S(0), b S(0): the row rule keeps a and gathers the small b, cheaper than moving a to
  // S(1) (an all-to-all of the larger operand) for the contraction rule.
  const DTensorSpec both[] = {spec({2}, "S(0)", {8, 6}), spec({2}, "S(0)", {6, 4})};
  st = choose_strategy(rs, both, plans);
  CHECK(st.cost_us > 0);
  CHECK((to_string(st.inputs[0]) + "|" + to_string(st.inputs[1])) == "S(0)|R");
  // Partial inputs: P @ P fits nothing; a Partial is never created, so one of them is reduced.
  const DTensorSpec pp[] = {spec({2}, "P", {8, 6}), spec({2}, "P", {6, 4})};
  st = choose_strategy(rs, pp, plans);
  CHECK(to_string(st.outputs[0]) == "P");
  CHECK(st.redistributed[0] + st.redistributed[1] == 1);
  // Only the mismatched mesh dim moves.
  const DTensorSpec mixed[] = {spec({2, 2}, "S(0),S(1)", {8, 6}), spec({2, 2}, "R,R", {6, 4})};
  st = choose_strategy(rs, mixed, plans);
  CHECK(to_string(st.inputs[0]) == "S(0),S(1)");
  CHECK(to_string(st.inputs[1]) == "R,S(0)");
  CHECK(to_string(st.outputs[0]) == "S(0),P");
}

TEST_CASE("choose_strategy: nothing reachable", "[ops][strategy]") {
  PlanCache plans;
  // softmax of a Partial: reducing is the only way (P -> S(0) is cheaper than P -> R).
  const RuleSet rs = softmax_rules(2);
  const DTensorSpec in[] = {spec({2}, "P", {8, 6})};
  const Strategy st = choose_strategy(rs, in, plans);
  CHECK(to_string(st.inputs[0]) == "S(0)");
  // An op with a rule set whose every rule needs a Partial the input does not have.
  RuleSet only_p;
  only_p.op = "only_p";
  only_p.inputs = 1;
  only_p.outputs = 1;
  only_p.rules.push_back({{Partial{}}, {Partial{}}, {Replicate{}}});
  const DTensorSpec r[] = {spec({2}, "R", {4})};
  CHECK_THROWS_AS(choose_strategy(only_p, r, plans), kernels::Unsupported);
  const DTensorSpec two[] = {spec({2}, "R", {4}), spec({2}, "R", {4})};
  CHECK_THROWS_WITH(choose_strategy(only_p, two, plans), Catch::Contains("2 inputs given, the op takes 1"));
}
