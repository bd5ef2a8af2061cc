// Sharding rules of the DTensor ops, kept as data: for each op, the ways it can run on ONE mesh
// dim (a placement per input -> a placement per output, and the placement each input's gradient
// takes). An N-D mesh applies one rule per mesh dim (batch sharded over dp, TP over another).
// Inputs that fit no rule on some mesh dims are redistributed, per choose_strategy, to the
// rule combination whose redistribution the planner prices lowest.
//
// Example: einsum_rules("mk,kn->mn") (a matmul) holds, in order of preference,
//   S(0),R -> S(0)        grads S(0),P(sum)
//   R,S(1) -> S(1)        grads P(sum),S(1)
//   S(1),S(0) -> P(sum)   grads S(1),S(0)
//   R,R -> R              grads R,R
//   P(sum),R -> P(sum)    grads R,P(sum)
//   R,P(sum) -> P(sum)    grads P(sum),R
// and on a 2x2 (dp, tp) mesh, a:[S(0),S(1)] @ b:[R,S(0)] matches rule 0 on mesh dim 0 and rule 2
// on mesh dim 1: the output is [S(0),P(sum)], with no communication.
//
// NOTE [gradient transpose] A gradient takes the transpose of its input's placement: S(d) stays
// S(d), P becomes R (every part of a sum receives the whole gradient), and R becomes R or, when
// the op spread the input over a sharded result, P(sum) (each rank holds the part of the
// gradient its shard produced). Rule::grads states which, per rule; the ops' backward functions
// produce exactly these placements (tested for every rule).
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/plan/cache.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"

namespace dtensor::ops {

struct Rule {
  std::vector<Placement> inputs;   // one per input
  std::vector<Placement> outputs;  // one per output
  std::vector<Placement> grads;    // one per input (non-differentiable inputs: R)
  // The op itself reduces over this mesh dim (loss parallel: cross-entropy on vocab-sharded
  // logits all-reduces row statistics instead of gathering the logits).
  bool communicates = false;
  friend bool operator==(const Rule&, const Rule&) = default;
};

struct RuleSet {
  std::string op;           // "einsum(mk,kn->mn)"
  std::vector<Rule> rules;  // in order of preference: equal costs pick the first
  int inputs = 0, outputs = 0;
};

// "S(0),R -> S(0) | grads S(0),P" (with " | reduces" for a communicating rule).
std::string to_string(const Rule& rule);
// The op name, then one rule per line.
std::string to_string(const RuleSet& rules);

// ---- rule tables: pure functions of the operands' ranks (and shapes where noted) ----

// Two-operand einsum over single-letter labels, "bmk,bkn->bmn". A label in both inputs and the
// output is a batch dim (S,S -> S), in one input and the output a free dim (S,R -> S or R,S -> S),
// in both inputs only a contraction (S,S -> P(sum)). Plus R,R -> R, P,R -> P and R,P -> P.
// REQUIRES: every output label appears in an input and every input label in the other input
// or the output (no label summed out of a single operand); throws InvalidArgument otherwise.
RuleSet einsum_rules(std::string_view equation);

enum class Pointwise { kAdd, kMul };
// a (ndim a_ndim) op b (ndim b_ndim <= a_ndim, right-aligned broadcast, e.g. a bias [n] on
// [b,t,n]): S(d),S(d - offset) -> S(d) for dims both have, S(d),R -> S(d) for broadcast dims
// (b's gradient is then P(sum)), R,R -> R; add: P,P -> P; mul: P,R -> P and R,P -> P.
RuleSet binary_rules(Pointwise op, int a_ndim, int b_ndim);
// A unary element-wise op (gelu, silu, scale): S(d) -> S(d), R -> R; `linear` ops (scale)
// also keep P(sum).
RuleSet unary_rules(std::string_view op, int ndim, bool linear);
// NOTE [ragged ops] A RaggedShard (a flat-buffer placement: FSDP's sharded parameters and
// gradients) is kept by the element-wise ops (unary, add, mul) whose inputs all have the output's
// shape: every rank holds the same range of each, so the op runs on the pieces. `rules` plus,
// for each RaggedShard an input holds, the rule Rg,..,Rg -> Rg (grads Rg); `rules` unchanged
// for a broadcast. Every other op refuses a ragged input, naming it (ops.cpp: prepare).
//   with_ragged_rules(unary_rules("gelu", 2, false), {[Rg(0,[1,2],4)] of [9,4]}) adds
//   "Rg(0,[1,2],4) -> Rg(0,[1,2],4) | grads Rg(0,[1,2],4)".
RuleSet with_ragged_rules(RuleSet rules, std::span<const DTensorSpec> inputs);
// Sum over `dims` (keepdim = false): a reduced S(d) gives P(sum), a kept S(d) moves to its new
// index; R -> R, P -> P.
RuleSet sum_rules(int ndim, std::span<const int> dims);
// Softmax over the last dim: S(d) for d < last, R.
RuleSet softmax_rules(int ndim);
// Norm over the last dim of x with `params` weights of shape [last] (0, 1 or 2: weight, bias):
// outputs (y, statistics...) with `stats` statistics of x's leading shape; x S(d < last) with
// R params -> S(d) everywhere (param gradients P(sum)), all R -> all R.
RuleSet norm_rules(int ndim, int params, int stats);
// embedding(weight [V, D], ids of ndim ids_ndim) -> [..., D]: R,R -> R; R,S(d) -> S(d);
// S(1),R -> S(last) (colwise); S(0),R -> P(sum) (rowwise: ids outside this rank's vocab rows
// read zeros; PyTorch's _MaskPartial).
RuleSet embedding_rules(int ids_ndim);
// cross_entropy(logits [..., V] of ndim ndim, targets [...]) -> loss (scalar): R,R -> R;
// S(d < last),S(d) -> P(sum); S(last),R -> R (loss parallel, communicating).
RuleSet cross_entropy_rules(int ndim);
// attention(q, k, v [B, H, T, Dh]) -> (out [B, H, T, Dh], lse [B, H, T]): S(0) or S(1) on all
// three (batch or heads), R.
RuleSet attention_rules();
// transpose(d0, d1): every placement follows its dim; R -> R, P -> P.
RuleSet transpose_rules(int ndim, int d0, int d1);
// view from `from` to `to` (splits and merges of adjacent dims): S(d) -> S(d') when the shard
// falls on whole blocks of the new dims for the given input placements on the mesh (the
// sharded extent divides evenly into the mesh sizes that shard it times the inner block), R,
// P -> P. Throws InvalidArgument when the shapes differ in element count or the view is no
// combination of splits and merges.
RuleSet view_rules(const Dims& from, const Dims& to, const Dims& mesh_shape, const Placements& input);

// ---- choosing rules for a whole mesh ----

struct Strategy {
  std::vector<int> rule;            // per mesh dim: index into RuleSet::rules
  std::vector<Placements> inputs;   // per input: the placements the op runs on
  std::vector<Placements> outputs;  // per output
  std::vector<Placements> grads;    // per input: its gradient's placements
  std::vector<char> redistributed;  // per input: differs from the placements given
  double cost_us = 0;               // of the redistributes, by the planner's cost model
};

struct ChooseOptions {
  PlannerKind planner = PlannerKind::kSearch;
  CostModel cost;
};

// Keeps, on every mesh dim where the inputs fit a rule, the first such rule; on the other mesh
// dims it tries every rule (except those needing a Partial input that is not already that
// Partial: redistribute cannot create one) and keeps the combination whose redistributes the
// planner prices lowest (equal costs: earlier rules first). Throws Unsupported naming the op
// and the input placements when no combination can be reached.
// `plans` memoises the plans priced (a MeshComms' cache). Pure apart from that cache.
Strategy choose_strategy(const RuleSet& rules, std::span<const DTensorSpec> inputs, PlanCache& plans,
                         const ChooseOptions& options = {});

}  // namespace dtensor::ops
