#include "dtensor/ops/rules.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "kernels/error.h"

namespace dtensor::ops {

using kernels::InvalidArgument;
using kernels::Unsupported;

namespace {

const Placement kR = Replicate{};
const Placement kP = Partial{ReduceOp::kSum};
Placement S(int d) { return Shard{d}; }

std::string join(const std::vector<Placement>& ps) {
  std::string out;
  for (const Placement& p : ps) {
    if (!out.empty()) out += ',';
    out += to_string(p);
  }
  return out;
}

}  // namespace

std::string to_string(const Rule& rule) {
  return fmt::format("{} -> {} | grads {}{}", join(rule.inputs), join(rule.outputs), join(rule.grads),
                     rule.communicates ? " | reduces" : "");
}

std::string to_string(const RuleSet& rules) {
  std::string out = rules.op + "\n";
  for (const Rule& r : rules.rules) out += "  " + to_string(r) + "\n";
  return out;
}

// ---- einsum ----

RuleSet einsum_rules(std::string_view equation) {
  const size_t comma = equation.find(','), arrow = equation.find("->");
  if (comma == std::string_view::npos || arrow == std::string_view::npos || arrow < comma)
    throw InvalidArgument(fmt::format("einsum: equation '{}' is not of the form 'ab,bc->ac'", equation));
  const std::string_view a = equation.substr(0, comma), b = equation.substr(comma + 1, arrow - comma - 1),
                         c = equation.substr(arrow + 2);
  auto check_labels = [&](std::string_view labels, const char* which) {
    for (size_t i = 0; i < labels.size(); ++i) {
      if (!((labels[i] >= 'a' && labels[i] <= 'z') || (labels[i] >= 'A' && labels[i] <= 'Z')))
        throw InvalidArgument(
            fmt::format("einsum: '{}' in the {} of '{}' is not a letter", labels[i], which, equation));
      if (labels.find(labels[i], i + 1) != std::string_view::npos)
        throw InvalidArgument(fmt::format("einsum: label '{}' repeats in the {} of '{}' (no diagonals)",
                                          labels[i], which, equation));
    }
  };
  check_labels(a, "first operand");
  check_labels(b, "second operand");
  check_labels(c, "output");
  for (char l : c)
    if (a.find(l) == std::string_view::npos && b.find(l) == std::string_view::npos)
      throw InvalidArgument(fmt::format("einsum: output label '{}' of '{}' is in no operand", l, equation));
  for (char l : a)
    if (b.find(l) == std::string_view::npos && c.find(l) == std::string_view::npos)
      throw InvalidArgument(fmt::format(
          "einsum: label '{}' of '{}' appears in the first operand only (sum it out first)", l, equation));
  for (char l : b)
    if (a.find(l) == std::string_view::npos && c.find(l) == std::string_view::npos)
      throw InvalidArgument(fmt::format(
          "einsum: label '{}' of '{}' appears in the second operand only (sum it out first)", l, equation));

  RuleSet rs;
  rs.op = fmt::format("einsum({})", equation);
  rs.inputs = 2;
  rs.outputs = 1;
  auto pos = [](std::string_view s, char l) { return static_cast<int>(s.find(l)); };
  // Free dims of a, then free dims of b, then batch dims, then contractions: the first rules
  // are the ones data-parallel and tensor-parallel layers hit.
  for (char l : a)
    if (b.find(l) == std::string_view::npos)
      rs.rules.push_back({{S(pos(a, l)), kR}, {S(pos(c, l))}, {S(pos(a, l)), kP}});
  for (char l : b)
    if (a.find(l) == std::string_view::npos)
      rs.rules.push_back({{kR, S(pos(b, l))}, {S(pos(c, l))}, {kP, S(pos(b, l))}});
  for (char l : a)
    if (b.find(l) != std::string_view::npos && c.find(l) != std::string_view::npos)
      rs.rules.push_back({{S(pos(a, l)), S(pos(b, l))}, {S(pos(c, l))}, {S(pos(a, l)), S(pos(b, l))}});
  for (char l : a)
    if (b.find(l) != std::string_view::npos && c.find(l) == std::string_view::npos)
      rs.rules.push_back({{S(pos(a, l)), S(pos(b, l))}, {kP}, {S(pos(a, l)), S(pos(b, l))}});
  rs.rules.push_back({{kR, kR}, {kR}, {kR, kR}});
  rs.rules.push_back({{kP, kR}, {kP}, {kR, kP}});
  rs.rules.push_back({{kR, kP}, {kP}, {kP, kR}});
  return rs;
}

// ---- element-wise ----

RuleSet binary_rules(Pointwise op, int a_ndim, int b_ndim) {
  if (b_ndim > a_ndim || b_ndim < 0)
    throw InvalidArgument(fmt::format(
        "binary op: the second operand has {} dims and the first {}: it must broadcast into the first "
        "(right-aligned, at most as many dims)",
        b_ndim, a_ndim));
  RuleSet rs;
  rs.op = fmt::format("{}(a:{}d, b:{}d)", op == Pointwise::kAdd ? "add" : "mul", a_ndim, b_ndim);
  rs.inputs = 2;
  rs.outputs = 1;
  const int offset = a_ndim - b_ndim;
  for (int d = 0; d < a_ndim; ++d) {
    if (d < offset)
      rs.rules.push_back({{S(d), kR}, {S(d)}, {S(d), kP}});
    else
      rs.rules.push_back({{S(d), S(d - offset)}, {S(d)}, {S(d), S(d - offset)}});
  }
  rs.rules.push_back({{kR, kR}, {kR}, {kR, kR}});
  if (op == Pointwise::kAdd) {
    rs.rules.push_back({{kP, kP}, {kP}, {kR, kR}});
  } else {
    rs.rules.push_back({{kP, kR}, {kP}, {kR, kP}});
    rs.rules.push_back({{kR, kP}, {kP}, {kP, kR}});
  }
  return rs;
}

RuleSet unary_rules(std::string_view op, int ndim, bool linear) {
  RuleSet rs;
  rs.op = fmt::format("{}({}d)", op, ndim);
  rs.inputs = 1;
  rs.outputs = 1;
  for (int d = 0; d < ndim; ++d) rs.rules.push_back({{S(d)}, {S(d)}, {S(d)}});
  rs.rules.push_back({{kR}, {kR}, {kR}});
  if (linear) rs.rules.push_back({{kP}, {kP}, {kR}});
  return rs;
}

RuleSet with_ragged_rules(RuleSet rules, std::span<const DTensorSpec> inputs) {
  if (inputs.empty() || rules.outputs != 1 || static_cast<int>(inputs.size()) != rules.inputs) return rules;
  for (const DTensorSpec& s : inputs)
    if (!(s.shape == inputs[0].shape)) return rules;  // a broadcast: the pieces would not line up
  const int n = static_cast<int>(inputs.size());
  for (const DTensorSpec& s : inputs)
    for (const Placement& p : s.placements) {
      if (!is_ragged(p)) continue;
      Rule r{std::vector<Placement>(n, p), {p}, std::vector<Placement>(n, p)};
      if (std::find(rules.rules.begin(), rules.rules.end(), r) == rules.rules.end()) rules.rules.push_back(std::move(r));
    }
  return rules;
}

RuleSet sum_rules(int ndim, std::span<const int> dims) {
  std::vector<char> reduced(ndim, 0);
  for (int d : dims) {
    const int nd = d < 0 ? d + ndim : d;
    if (nd < 0 || nd >= ndim)
      throw InvalidArgument(fmt::format("sum: dim {} out of range for a {}-d tensor", d, ndim));
    if (reduced[nd]) throw InvalidArgument(fmt::format("sum: dim {} is listed twice", d));
    reduced[nd] = 1;
  }
  RuleSet rs;
  rs.op = fmt::format("sum({}d, {} dims)", ndim, dims.size());
  rs.inputs = 1;
  rs.outputs = 1;
  int kept = 0;
  for (int d = 0; d < ndim; ++d) {
    if (reduced[d])
      rs.rules.push_back({{S(d)}, {kP}, {S(d)}});
    else
      rs.rules.push_back({{S(d)}, {S(kept++)}, {S(d)}});
  }
  rs.rules.push_back({{kR}, {kR}, {kR}});
  rs.rules.push_back({{kP}, {kP}, {kR}});
  return rs;
}

RuleSet softmax_rules(int ndim) {
  RuleSet rs;
  rs.op = fmt::format("softmax({}d, last dim)", ndim);
  rs.inputs = 1;
  rs.outputs = 1;
  for (int d = 0; d + 1 < ndim; ++d) rs.rules.push_back({{S(d)}, {S(d)}, {S(d)}});
  rs.rules.push_back({{kR}, {kR}, {kR}});
  return rs;
}

RuleSet norm_rules(int ndim, int params, int stats) {
  RuleSet rs;
  rs.op = fmt::format("norm({}d, {} params, {} stats)", ndim, params, stats);
  rs.inputs = 1 + params;
  rs.outputs = 1 + stats;
  for (int d = 0; d + 1 < ndim; ++d) {
    Rule r;
    r.inputs.push_back(S(d));
    r.grads.push_back(S(d));
    for (int i = 0; i < params; ++i) {
      r.inputs.push_back(kR);
      r.grads.push_back(kP);
    }
    r.outputs.assign(1 + stats, S(d));
    rs.rules.push_back(r);
  }
  rs.rules.push_back({std::vector<Placement>(1 + params, kR), std::vector<Placement>(1 + stats, kR),
                      std::vector<Placement>(1 + params, kR)});
  return rs;
}

RuleSet embedding_rules(int ids_ndim) {
  RuleSet rs;
  rs.op = fmt::format("embedding(ids {}d)", ids_ndim);
  rs.inputs = 2;
  rs.outputs = 1;
  for (int d = 0; d < ids_ndim; ++d) rs.rules.push_back({{kR, S(d)}, {S(d)}, {kP, kR}});
  rs.rules.push_back({{S(1), kR}, {S(ids_ndim)}, {S(1), kR}});
  rs.rules.push_back({{S(0), kR}, {kP}, {S(0), kR}});
  rs.rules.push_back({{kR, kR}, {kR}, {kR, kR}});
  return rs;
}

RuleSet cross_entropy_rules(int ndim) {
  if (ndim < 1) throw InvalidArgument("cross_entropy: logits need at least one dim (the classes)");
  RuleSet rs;
  rs.op = fmt::format("cross_entropy(logits {}d)", ndim);
  rs.inputs = 2;
  rs.outputs = 1;
  for (int d = 0; d + 1 < ndim; ++d) rs.rules.push_back({{S(d), S(d)}, {kP}, {S(d), S(d)}});
  Rule vocab{{S(ndim - 1), kR}, {kR}, {S(ndim - 1), kR}};
  vocab.communicates = true;
  rs.rules.push_back(vocab);
  rs.rules.push_back({{kR, kR}, {kR}, {kR, kR}});
  return rs;
}

RuleSet attention_rules() {
  RuleSet rs;
  rs.op = "attention(q,k,v [B,H,T,Dh], causal)";
  rs.inputs = 3;
  rs.outputs = 2;
  for (int d : {0, 1}) rs.rules.push_back({{S(d), S(d), S(d)}, {S(d), S(d)}, {S(d), S(d), S(d)}});
  rs.rules.push_back({{kR, kR, kR}, {kR, kR}, {kR, kR, kR}});
  return rs;
}

RuleSet transpose_rules(int ndim, int d0, int d1) {
  if (d0 < 0) d0 += ndim;
  if (d1 < 0) d1 += ndim;
  if (d0 < 0 || d0 >= ndim || d1 < 0 || d1 >= ndim)
    throw InvalidArgument(
        fmt::format("transpose: dims ({}, {}) out of range for a {}-d tensor", d0, d1, ndim));
  RuleSet rs;
  rs.op = fmt::format("transpose({}d, {}, {})", ndim, d0, d1);
  rs.inputs = 1;
  rs.outputs = 1;
  for (int d = 0; d < ndim; ++d) {
    const int to = d == d0 ? d1 : d == d1 ? d0 : d;
    rs.rules.push_back({{S(d)}, {S(to)}, {S(d)}});
  }
  rs.rules.push_back({{kR}, {kR}, {kR}});
  rs.rules.push_back({{kP}, {kP}, {kR}});
  return rs;
}

// ---- view ----

namespace {

// One group of a view: input dims [in_begin, in_end) hold the same elements as output dims
// [out_begin, out_end) (a split when one input dim, a merge when one output dim).
struct ViewGroup {
  int in_begin, in_end, out_begin, out_end;
};

std::vector<ViewGroup> view_groups(const Dims& from, const Dims& to) {
  if (from.product() != to.product())
    throw InvalidArgument(fmt::format("view: shape [{}] has {} elements, [{}] has {}", fmt::join(from, ","),
                                      from.product(), fmt::join(to, ","), to.product()));
  std::vector<ViewGroup> groups;
  int i = 0, j = 0;
  while (i < from.size() || j < to.size()) {
    // Dims of size 1 form their own groups where both sides have one.
    if (i < from.size() && j < to.size() && from[i] == to[j]) {
      groups.push_back({i, i + 1, j, j + 1});
      ++i;
      ++j;
      continue;
    }
    const int i0 = i, j0 = j;
    int64_t pi = i < from.size() ? from[i++] : 1, pj = j < to.size() ? to[j++] : 1;
    while (pi != pj) {
      if (pi < pj && i < from.size())
        pi *= from[i++];
      else if (pj < pi && j < to.size())
        pj *= to[j++];
      else
        break;
    }
    if (pi != pj || (i - i0 > 1 && j - j0 > 1))
      throw InvalidArgument(fmt::format(
          "view: [{}] -> [{}] is not a combination of splitting one dim and merging adjacent dims",
          fmt::join(from, ","), fmt::join(to, ",")));
    groups.push_back({i0, i, j0, j});
  }
  return groups;
}

}  // namespace

RuleSet view_rules(const Dims& from, const Dims& to, const Dims& mesh_shape, const Placements& input) {
  const std::vector<ViewGroup> groups = view_groups(from, to);
  RuleSet rs;
  rs.op = fmt::format("view([{}] -> [{}])", fmt::join(from, ","), fmt::join(to, ","));
  rs.inputs = 1;
  rs.outputs = 1;
  for (const ViewGroup& g : groups) {
    if (g.in_end == g.in_begin || g.out_end == g.out_begin) continue;  // a dropped or added size-1 dim
    // The mesh sizes sharding the group's first input dim (only it may be sharded: a shard of a
    // later dim of a merge is no block of the merged dim).
    int64_t mesh_product = 1;
    for (int m = 0; m < static_cast<int>(input.size()) && m < mesh_shape.size(); ++m)
      if (const auto* s = std::get_if<Shard>(&input[m]); s && s->dim == g.in_begin)
        mesh_product *= mesh_shape[m];
    if (g.in_end - g.in_begin == 1 && g.out_end - g.out_begin == 1) {
      rs.rules.push_back({{S(g.in_begin)}, {S(g.out_begin)}, {S(g.in_begin)}});
    } else if (g.in_end - g.in_begin == 1) {
      // Split of one dim n into (a, inner...): a shard of n falls on whole rows of the first
      // new dim when n divides evenly into mesh_product pieces of whole inner blocks.
      if (to[g.out_begin] % mesh_product == 0)
        rs.rules.push_back({{S(g.in_begin)}, {S(g.out_begin)}, {S(g.in_begin)}});
    } else {
      // Merge of (a, inner...) into one dim: a shard of a is a block of the merged dim when a
      // divides evenly over the mesh dims that shard it.
      if (from[g.in_begin] % mesh_product == 0)
        rs.rules.push_back({{S(g.in_begin)}, {S(g.out_begin)}, {S(g.in_begin)}});
    }
  }
  rs.rules.push_back({{kR}, {kR}, {kR}});
  rs.rules.push_back({{kP}, {kP}, {kR}});
  return rs;
}

// ---- strategy ----

namespace {

bool fits(const Rule& rule, std::span<const DTensorSpec> inputs, int m) {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!(rule.inputs[i] == inputs[i].placements[m])) return false;
  return true;
}

// A rule reachable on mesh dim m: redistribute never creates a Partial.
bool reachable(const Rule& rule, std::span<const DTensorSpec> inputs, int m) {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (is_partial(rule.inputs[i]) && !(rule.inputs[i] == inputs[i].placements[m])) return false;
  return true;
}

std::string inputs_text(std::span<const DTensorSpec> inputs) {
  std::string out;
  for (size_t i = 0; i < inputs.size(); ++i)
    out += fmt::format("{}[{}]", i ? ", " : "", to_string(inputs[i].placements));
  return out;
}

}  // namespace

Strategy choose_strategy(const RuleSet& rules, std::span<const DTensorSpec> inputs, PlanCache& plans,
                         const ChooseOptions& options) {
  if (static_cast<int>(inputs.size()) != rules.inputs)
    throw InvalidArgument(
        fmt::format("{}: {} inputs given, the op takes {}", rules.op, inputs.size(), rules.inputs));
  if (rules.rules.empty()) throw kernels::InternalError(fmt::format("{}: no rules", rules.op));
  const int mesh_ndim = inputs[0].mesh->ndim();
  for (const DTensorSpec& s : inputs)
    if (!(*s.mesh == *inputs[0].mesh))
      throw InvalidArgument(fmt::format("{}: inputs live on different meshes ({} and {}); ops need one mesh",
                                        rules.op, to_string(*inputs[0].mesh), to_string(*s.mesh)));

  std::vector<int> chosen(mesh_ndim, -1);
  std::vector<int> open;  // mesh dims no rule fits
  for (int m = 0; m < mesh_ndim; ++m) {
    for (size_t r = 0; r < rules.rules.size() && chosen[m] < 0; ++r)
      if (fits(rules.rules[r], inputs, m)) chosen[m] = static_cast<int>(r);
    if (chosen[m] < 0) open.push_back(m);
  }

  auto placements_for = [&](const std::vector<int>& choice, auto member, size_t index) {
    Placements out(mesh_ndim);
    for (int m = 0; m < mesh_ndim; ++m) out[m] = (rules.rules[choice[m]].*member)[index];
    return out;
  };

  double best_cost = 0;
  if (!open.empty()) {
    std::vector<std::vector<int>> candidates(open.size());
    for (size_t o = 0; o < open.size(); ++o)
      for (size_t r = 0; r < rules.rules.size(); ++r)
        if (reachable(rules.rules[r], inputs, open[o])) candidates[o].push_back(static_cast<int>(r));
    std::vector<int> best;
    best_cost = std::numeric_limits<double>::infinity();
    std::vector<size_t> at(open.size(), 0);
    bool any_empty = false;
    for (const auto& c : candidates) any_empty = any_empty || c.empty();
    while (!any_empty) {
      std::vector<int> choice = chosen;
      for (size_t o = 0; o < open.size(); ++o) choice[open[o]] = candidates[o][at[o]];
      double cost = 0;
      bool ok = true;
      for (size_t i = 0; i < inputs.size() && ok; ++i) {
        const Placements want = placements_for(choice, &Rule::inputs, i);
        if (want == inputs[i].placements) continue;
        try {
          cost += plans.get(inputs[i], want, options.planner, options.cost).cost_us;
        } catch (const kernels::Error&) {
          ok = false;
        }
      }
      if (ok && cost < best_cost) {
        best_cost = cost;
        best = choice;
      }
      size_t o = 0;  // advance the odometer, first open mesh dim fastest
      for (; o < open.size(); ++o) {
        if (++at[o] < candidates[o].size()) break;
        at[o] = 0;
      }
      if (o == open.size()) break;
    }
    if (best.empty())
      throw Unsupported(fmt::format("{}: no rule can be reached from input placements {}\n{}", rules.op,
                                    inputs_text(inputs), to_string(rules)));
    chosen = best;
  }

  Strategy st;
  st.rule = chosen;
  st.cost_us = best_cost;
  for (size_t i = 0; i < inputs.size(); ++i) {
    st.inputs.push_back(placements_for(chosen, &Rule::inputs, i));
    st.grads.push_back(placements_for(chosen, &Rule::grads, i));
    st.redistributed.push_back(!(st.inputs.back() == inputs[i].placements));
  }
  for (int o = 0; o < rules.outputs; ++o) st.outputs.push_back(placements_for(chosen, &Rule::outputs, o));
  return st;
}

}  // namespace dtensor::ops
