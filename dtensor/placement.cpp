#include "dtensor/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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
    "expected S(d), _S(d,split_factor), R, P, P(sum|avg|min|max|prod) or Rg(d,[u0,u1,...],align)";

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad_placement(std::string_view text, std::string_view why = {}) {
  throw InvalidArgument(fmt::format("bad placement '{}'{}: {}", kernels::clip(trim(text), 60),
                                    why.empty() ? "" : fmt::format(" ({})", why), kNotation));
}

// An integer argument of a placement (int: dims and split factors; int64_t: RaggedShard units and
// alignment); `what` names it in errors ("shard dim", "split factor").
template <typename T>
T parse_integer(std::string_view whole, std::string_view s, std::string_view what) {
  s = trim(s);
  T value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec == std::errc::result_out_of_range && end == s.data() + s.size())
    bad_placement(whole, fmt::format("{} {} is out of range", what, kernels::clip(s, 40)));
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    bad_placement(whole, fmt::format("{} '{}' is not an integer", what, kernels::clip(s, 40)));
  return value;
}
int parse_int(std::string_view whole, std::string_view s, std::string_view what) {
  return parse_integer<int>(whole, s, what);
}
int64_t parse_i64(std::string_view whole, std::string_view s, std::string_view what) {
  return parse_integer<int64_t>(whole, s, what);
}

std::string_view drop_key(std::string_view s, std::string_view key) {
  s = trim(s);
  if (s.substr(0, key.size()) == key) s.remove_prefix(key.size());
  return trim(s);
}

void check_ragged(const RaggedShard& r, std::string_view whole) {
  const std::string text(kernels::clip(trim(whole), 60));
  if (r.units.empty()) throw InvalidArgument(fmt::format("RaggedShard '{}' has no units (expected one per rank)", text));
  if (static_cast<int64_t>(r.units.size()) > kMaxRaggedUnits)
    throw InvalidArgument(fmt::format("RaggedShard '{}' has {} units, more than the limit of {}", text,
                                      r.units.size(), kMaxRaggedUnits));
  int64_t sum = 0;
  for (size_t i = 0; i < r.units.size(); ++i) {
    if (r.units[i] < 0 || r.units[i] > kMaxRaggedValue)
      throw InvalidArgument(fmt::format("unit {} (index {}) of RaggedShard '{}' must be in 0..{}", r.units[i], i,
                                        text, kMaxRaggedValue));
    sum += r.units[i];  // <= 2^20 x 2^40: no overflow
  }
  if (sum == 0) throw InvalidArgument(fmt::format("the units of RaggedShard '{}' sum to 0 (expected > 0)", text));
  if (r.align < 1 || r.align > kMaxRaggedValue)
    throw InvalidArgument(
        fmt::format("alignment {} of RaggedShard '{}' must be in 1..{}", r.align, text, kMaxRaggedValue));
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

std::optional<int> ragged_dim(const Placement& p) {
  if (const auto* r = std::get_if<RaggedShard>(&p)) return r->dim;
  return std::nullopt;
}

int ragged_mesh_dim(const Placements& ps) {
  int found = -1;
  for (size_t m = 0; m < ps.size(); ++m) {
    if (!is_ragged(ps[m])) continue;
    if (found >= 0)
      throw kernels::Unsupported(fmt::format(
          "placements [{}] have RaggedShards on mesh dims {} and {}: at most one mesh dim may be ragged",
          to_string(ps), found, m));
    found = static_cast<int>(m);
  }
  return found;
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
  if (const auto* r = std::get_if<RaggedShard>(&p)) {
    check_ragged(*r, to_string(p));
    RaggedShard out = *r;
    out.dim = fix_dim(r->dim);
    return out;
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
          [](const RaggedShard& s) { return fmt::format("Rg({},[{}],{})", s.dim, fmt::join(s.units, ","), s.align); },
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
  if (head == "Rg" || head == "RaggedShard") {
    if (args.size() != 2 && args.size() != 3)
      bad_placement(whole, fmt::format("2 or 3 arguments expected, got {}", args.size()));
    RaggedShard r;
    r.dim = parse_int(whole, args[0], "ragged dim");
    std::string_view units = drop_key(args[1], "units=");
    if (units.size() < 2 || units.front() != '[' || units.back() != ']')
      bad_placement(whole, "units must be a bracketed list [u0,u1,...]");
    units = trim(units.substr(1, units.size() - 2));
    if (!units.empty())
      for (std::string_view u : split_top_level(units)) {
        if (static_cast<int64_t>(r.units.size()) == kMaxRaggedUnits)
          bad_placement(whole, fmt::format("more than {} units", kMaxRaggedUnits));
        r.units.push_back(parse_i64(whole, u, "unit"));
      }
    if (args.size() == 3) r.align = parse_i64(whole, drop_key(args[2], "align="), "alignment");
    check_ragged(r, whole);
    return r;
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
