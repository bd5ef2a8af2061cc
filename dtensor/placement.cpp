#include "dtensor/placement.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>

#include "kernels/dims.h"
#include "kernels/error.h"
#include "kernels/overloaded.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

using kernels::Overloaded;

constexpr std::string_view kNotation =
    "expected S(d), _S(d,split_factor), R, P or P(sum|avg|min|max|prod)";

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad_placement(std::string_view text, std::string_view why = {}) {
  throw InvalidArgument(fmt::format("bad placement '{}'{}: {}", kernels::clip(trim(text), 60),
                                    why.empty() ? "" : fmt::format(" ({})", why), kNotation));
}

// An int argument of a placement; `what` names it in errors ("shard dim", "split factor").
int parse_int(std::string_view whole, std::string_view s, std::string_view what) {
  s = trim(s);
  int value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec == std::errc::result_out_of_range && end == s.data() + s.size())
    bad_placement(whole, fmt::format("{} {} is out of range", what, kernels::clip(s, 40)));
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    bad_placement(whole, fmt::format("{} '{}' is not an integer", what, kernels::clip(s, 40)));
  return value;
}

void check_split_factor(int split_factor, std::string_view whole) {
  if (split_factor < 1)
    throw InvalidArgument(fmt::format("split factor {} in '{}' must be >= 1", split_factor,
                                      kernels::clip(trim(whole), 60)));
  if (split_factor > kMaxSplitFactor)
    throw InvalidArgument(fmt::format("split factor {} in '{}' exceeds the limit of {}", split_factor,
                                      kernels::clip(trim(whole), 60), kMaxSplitFactor));
}

// Splits "a,b" at top-level commas.
std::vector<std::string_view> split_top_level(std::string_view s) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t begin = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '(' || s[i] == '[') ++depth;
    if (s[i] == ')' || s[i] == ']') --depth;
    if (s[i] == ',' && depth == 0) {
      parts.push_back(s.substr(begin, i - begin));
      begin = i + 1;
    }
  }
  parts.push_back(s.substr(begin));
  return parts;
}

}  // namespace

std::optional<int> shard_dim(const Placement& p) {
  if (const auto* s = std::get_if<Shard>(&p)) return s->dim;
  if (const auto* s = std::get_if<StridedShard>(&p)) return s->dim;
  return std::nullopt;
}

Placement normalize(const Placement& p, int tensor_ndim) {
  auto fix_dim = [&](int dim) {
    if (dim < -tensor_ndim || dim >= tensor_ndim)
      throw InvalidArgument(fmt::format(
          "shard dim {} of {} out of range for a {}-d tensor (expected {}..{})", dim,
          to_string(p), tensor_ndim, -tensor_ndim, tensor_ndim - 1));
    return dim < 0 ? dim + tensor_ndim : dim;
  };
  if (const auto* s = std::get_if<Shard>(&p)) return Shard{fix_dim(s->dim)};
  if (const auto* s = std::get_if<StridedShard>(&p)) {
    if (s->split_factor < 1)
      throw InvalidArgument(
          fmt::format("split factor {} of {} must be >= 1", s->split_factor, to_string(p)));
    if (s->split_factor > kMaxSplitFactor)
      throw InvalidArgument(fmt::format("split factor {} of {} exceeds the limit of {}", s->split_factor,
                                        to_string(p), kMaxSplitFactor));
    return StridedShard{fix_dim(s->dim), s->split_factor};
  }
  return p;
}

std::string to_string(const Placement& p) {
  return std::visit(
      Overloaded{
          [](const Shard& s) { return fmt::format("S({})", s.dim); },
          [](const StridedShard& s) { return fmt::format("_S({},{})", s.dim, s.split_factor); },
          [](const Replicate&) { return std::string("R"); },
          [](const Partial& s) {
            return s.op == ReduceOp::kSum ? std::string("P")
                                          : fmt::format("P({})", kernels::to_string(s.op));
          },
      },
      p);
}

std::string to_string(const Placements& ps) {
  std::string out;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (i) out += ',';
    out += to_string(ps[i]);
  }
  return out;
}

Placement parse_placement(std::string_view whole) {
  std::string_view text = trim(whole);
  size_t open = text.find('(');
  std::string_view head = trim(text.substr(0, open));
  std::vector<std::string_view> args;
  if (open != std::string_view::npos) {
    if (text.back() != ')') bad_placement(whole, "missing ')'");
    std::string_view inner = trim(text.substr(open + 1, text.size() - open - 2));
    if (!inner.empty()) args = split_top_level(inner);
  }
  auto want_args = [&](size_t n) {
    if (args.size() != n)
      bad_placement(whole, fmt::format("{} argument{} expected, got {}", n, n == 1 ? "" : "s",
                                       args.size()));
  };
  if (head == "S" || head == "Shard") {
    want_args(1);
    return Shard{parse_int(whole, args[0], "shard dim")};
  }
  if (head == "_S" || head == "SS" || head == "StridedShard" || head == "_StridedShard") {
    want_args(2);
    std::string_view sf = trim(args[1]);
    for (std::string_view key : {"split_factor=", "sf="})
      if (sf.substr(0, key.size()) == key) sf.remove_prefix(key.size());
    StridedShard s{parse_int(whole, args[0], "shard dim"), parse_int(whole, sf, "split factor")};
    check_split_factor(s.split_factor, whole);
    return s;
  }
  if (head == "R" || head == "Replicate") {
    want_args(0);
    return Replicate{};
  }
  if (head == "P" || head == "Partial") {
    if (args.empty()) return Partial{};
    want_args(1);
    std::string_view op = trim(args[0]);
    if (op.substr(0, 10) == "reduce_op=") op.remove_prefix(10);
    try {
      return Partial{kernels::parse_reduce_op(op)};
    } catch (const InvalidArgument&) {
      bad_placement(whole, fmt::format("unknown reduce op '{}'", kernels::clip(op, 40)));
    }
  }
  bad_placement(whole);
}

Placements parse_placements(std::string_view text) {
  std::string_view s = trim(text);
  if (!s.empty() && s.front() == '[') {
    if (s.back() != ']')
      throw InvalidArgument(fmt::format("bad placement list '{}': missing ']'", kernels::clip(text)));
    s = trim(s.substr(1, s.size() - 2));
  }
  Placements out;
  if (s.empty()) return out;
  for (std::string_view part : split_top_level(s)) {
    if (trim(part).empty())
      throw InvalidArgument(fmt::format("bad placement list '{}': empty entry; {}", kernels::clip(text), kNotation));
    if (out.size() == static_cast<size_t>(kernels::kMaxDims))
      throw InvalidArgument(fmt::format("placement list '{}' has more than {} entries (one per mesh dim)",
                                        kernels::clip(text), kernels::kMaxDims));
    out.push_back(parse_placement(part));
  }
  return out;
}

}  // namespace dtensor
