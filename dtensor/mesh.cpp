#include "dtensor/mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace dtensor {

using kernels::InvalidArgument;

namespace {

// Flattens a nested JSON array into (shape, values); throws on ragged or non-integer input and
// on ranks outside 0..INT_MAX (read as 64-bit first, so 4294967297 is named, not wrapped to 1).
void flatten_json(const nlohmann::json& j, int depth, Dims& shape, std::vector<int>& out,
                  std::string_view text) {
  if (j.is_array()) {
    if (depth == shape.size()) {
      if (j.empty()) throw InvalidArgument(fmt::format("mesh '{}' has an empty dim", kernels::clip(text)));
      if (depth == kernels::kMaxDims)
        throw InvalidArgument(fmt::format("mesh '{}' has more than {} dims", kernels::clip(text), kernels::kMaxDims));
      shape.push_back(static_cast<int64_t>(j.size()));
    } else if (shape[depth] != static_cast<int64_t>(j.size())) {
      throw InvalidArgument(fmt::format("mesh '{}' is ragged: dim {} has sizes {} and {}", kernels::clip(text),
                                        depth, shape[depth], j.size()));
    }
    for (const auto& e : j) flatten_json(e, depth + 1, shape, out, text);
    return;
  }
  if (!j.is_number_integer() || depth != shape.size())
    throw InvalidArgument(fmt::format(
        "mesh '{}' must be a rectangular nested array of integer ranks, found '{}'", kernels::clip(text),
        kernels::clip(j.dump(), 40)));
  const bool too_big = j.is_number_unsigned() ? j.get<uint64_t>() > static_cast<uint64_t>(kMaxRank)
                                              : j.get<int64_t>() > kMaxRank;
  if (too_big || j.get<int64_t>() < 0)
    throw InvalidArgument(fmt::format("mesh '{}' holds rank {}: ranks must be in 0..{}", kernels::clip(text),
                                      j.dump(), kMaxRank));
  if (out.size() >= static_cast<size_t>(kMaxMeshRanks))
    throw InvalidArgument(fmt::format("mesh '{}' holds more than {} ranks (the limit of a mesh)",
                                      kernels::clip(text), kMaxMeshRanks));
  out.push_back(static_cast<int>(j.get<int64_t>()));
}

// The rank count of a mesh shape: checked against int64 overflow and kMaxMeshRanks.
int64_t mesh_size(const Dims& shape) {
  const int64_t n = shape.product();
  if (n > kMaxMeshRanks)
    throw InvalidArgument(fmt::format("mesh shape {} has {} ranks, more than the limit of {}",
                                      fmt::join(shape, "x"), n, kMaxMeshRanks));
  return n;
}

}  // namespace

DeviceMesh DeviceMesh::from_shape(const Dims& shape, std::vector<std::string> names) {
  for (int64_t s : shape) {
    if (s < 1) throw InvalidArgument(fmt::format("mesh shape {} has a dim of size {} (expected >= 1)",
                                                 fmt::join(shape, "x"), s));
  }
  const int64_t n = mesh_size(shape);
  std::vector<int> ranks(n);
  for (int64_t i = 0; i < n; ++i) ranks[i] = static_cast<int>(i);
  return DeviceMesh(shape, std::move(ranks), std::move(names));
}

DeviceMesh DeviceMesh::parse(std::string_view text, std::vector<std::string> names) {
  std::string_view s = text;
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  if (!s.empty() && s.front() == '[') {
    nlohmann::json j = nlohmann::json::parse(s, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded())
      throw InvalidArgument(fmt::format("mesh '{}' is not a valid nested array of ranks", kernels::clip(text)));
    Dims shape;
    std::vector<int> ranks;
    flatten_json(j, 0, shape, ranks, text);
    return DeviceMesh(shape, std::move(ranks), std::move(names));
  }
  Dims shape;
  size_t begin = 0;
  while (begin <= s.size()) {
    size_t end = s.find_first_of("x,", begin);
    if (end == std::string_view::npos) end = s.size();
    std::string_view part = s.substr(begin, end - begin);
    int64_t v = 0;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    const bool out_of_range = ec == std::errc::result_out_of_range;
    if (part.empty() || (ec != std::errc() && !out_of_range) || p != part.data() + part.size() ||
        (!out_of_range && v < 1))
      throw InvalidArgument(fmt::format(
          "mesh '{}' is malformed at '{}': expected a shape like 4x2 (sizes >= 1) or a nested "
          "rank array like [[0,2],[1,3]]", kernels::clip(text), kernels::clip(part, 40)));
    if (out_of_range || v > kMaxMeshRanks)
      throw InvalidArgument(fmt::format("mesh '{}': size {} is out of range (a mesh holds at most {} ranks)",
                                        kernels::clip(text), kernels::clip(part, 40), kMaxMeshRanks));
    if (shape.size() == kernels::kMaxDims)
      throw InvalidArgument(fmt::format("mesh '{}' has more than {} dims", kernels::clip(text), kernels::kMaxDims));
    shape.push_back(v);
    begin = end + 1;
  }
  return from_shape(shape, std::move(names));
}

DeviceMesh::DeviceMesh(const Dims& shape, std::vector<int> ranks, std::vector<std::string> names)
    : shape_(shape), ranks_(std::move(ranks)), names_(std::move(names)) {
  if (shape_.empty()) throw InvalidArgument("a mesh needs at least one dim");
  for (int64_t s : shape_)
    if (s < 1)
      throw InvalidArgument(fmt::format("mesh shape [{}] has a dim of size {} (expected >= 1)",
                                        fmt::join(shape_, ","), s));
  if (static_cast<int64_t>(ranks_.size()) != mesh_size(shape_))
    throw InvalidArgument(fmt::format("mesh shape [{}] needs {} ranks, got {}",
                                      fmt::join(shape_, ","), shape_.product(), ranks_.size()));
  for (int r : ranks_)
    if (r < 0) throw InvalidArgument(fmt::format("mesh rank {} is negative (expected >= 0)", r));
  position_.reserve(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) position_.push_back({ranks_[i], static_cast<int64_t>(i)});
  std::sort(position_.begin(), position_.end());
  for (size_t i = 1; i < position_.size(); ++i)
    if (position_[i].first == position_[i - 1].first)
      throw InvalidArgument(fmt::format("mesh rank {} appears more than once in [{}]", position_[i].first,
                                        kernels::clip(fmt::format("{}", fmt::join(ranks_, ",")))));
  if (!names_.empty()) {
    if (static_cast<int>(names_.size()) != ndim())
      throw InvalidArgument(fmt::format("{} mesh dim names ({}) for a {}-d mesh (expected {})",
                                        names_.size(), fmt::join(names_, ","), ndim(), ndim()));
    std::set<std::string> seen;
    for (const auto& n : names_) {
      if (n.empty()) throw InvalidArgument("mesh dim names must not be empty");
      if (!seen.insert(n).second)
        throw InvalidArgument(fmt::format("duplicate mesh dim name '{}' in ({})", n,
                                          fmt::join(names_, ",")));
    }
  }
}

int DeviceMesh::check_mesh_dim(int mesh_dim) const {
  if (mesh_dim < 0 || mesh_dim >= ndim())
    throw InvalidArgument(fmt::format("mesh dim {} out of range for a {}-d mesh (expected 0..{})",
                                      mesh_dim, ndim(), ndim() - 1));
  return mesh_dim;
}

int64_t DeviceMesh::size(int mesh_dim) const { return shape_[check_mesh_dim(mesh_dim)]; }

int DeviceMesh::mesh_dim(std::string_view name) const {
  for (int d = 0; d < static_cast<int>(names_.size()); ++d)
    if (names_[d] == name) return d;
  throw InvalidArgument(fmt::format("unknown mesh dim name '{}' (mesh dims are named: {})", name,
                                    names_.empty() ? std::string("none")
                                                   : fmt::format("{}", fmt::join(names_, ","))));
}

int64_t DeviceMesh::flat_index(int rank) const {
  auto it = std::lower_bound(position_.begin(), position_.end(), std::pair<int, int64_t>{rank, -1});
  return it != position_.end() && it->first == rank ? it->second : -1;
}

int DeviceMesh::rank_at(const Dims& coord) const {
  if (coord.size() != ndim())
    throw InvalidArgument(fmt::format("coordinate [{}] has {} entries for a {}-d mesh",
                                      fmt::join(coord, ","), coord.size(), ndim()));
  for (int d = 0; d < ndim(); ++d)
    if (coord[d] < 0 || coord[d] >= shape_[d])
      throw InvalidArgument(fmt::format("coordinate [{}] outside mesh shape [{}]",
                                        fmt::join(coord, ","), fmt::join(shape_, ",")));
  return ranks_[ravel_index(coord, shape_)];
}

std::optional<Dims> DeviceMesh::coord_of(int rank) const {
  int64_t flat = flat_index(rank);
  if (flat < 0) return std::nullopt;
  return unravel_index(flat, shape_);
}

std::vector<int> DeviceMesh::group(int mesh_dim, int rank) const {
  check_mesh_dim(mesh_dim);
  std::optional<Dims> coord = coord_of(rank);
  if (!coord) throw InvalidArgument(fmt::format("rank {} is not in mesh {}", rank, kernels::clip(to_string(*this))));
  std::vector<int> out;
  for (int64_t i = 0; i < shape_[mesh_dim]; ++i) {
    (*coord)[mesh_dim] = i;
    out.push_back(ranks_[ravel_index(*coord, shape_)]);
  }
  return out;
}

std::vector<std::vector<int>> DeviceMesh::groups(int mesh_dim) const {
  check_mesh_dim(mesh_dim);
  Dims rest = shape_;
  rest[mesh_dim] = 1;
  std::vector<std::vector<int>> out;
  for (int64_t g = 0; g < rest.product(); ++g)
    out.push_back(group(mesh_dim, ranks_[ravel_index(unravel_index(g, rest), shape_)]));
  return out;
}

DeviceMesh DeviceMesh::slice(std::span<const std::string> names, int rank) const {
  if (names_.empty())
    throw InvalidArgument("cannot slice a mesh by name: its dims have no names");
  std::vector<int> dims;
  for (const auto& n : names) {
    int d = mesh_dim(n);
    if (!dims.empty() && d <= dims.back())
      throw InvalidArgument(fmt::format(
          "slice names ({}) must follow the mesh dim order ({})", fmt::join(names, ","),
          fmt::join(names_, ",")));
    dims.push_back(d);
  }
  return slice_dims(dims, rank);
}

DeviceMesh DeviceMesh::slice_dims(std::span<const int> mesh_dims, int rank) const {
  if (mesh_dims.empty()) throw InvalidArgument("slice needs at least one mesh dim");
  std::optional<Dims> coord = coord_of(rank);
  if (!coord) throw InvalidArgument(fmt::format("rank {} is not in mesh {}", rank, kernels::clip(to_string(*this))));
  Dims sub_shape;
  std::vector<std::string> sub_names;
  for (size_t i = 0; i < mesh_dims.size(); ++i) {
    int d = check_mesh_dim(mesh_dims[i]);
    if (i && d <= mesh_dims[i - 1])
      throw InvalidArgument(fmt::format("slice mesh dims [{}] must be distinct and ascending",
                                        fmt::join(mesh_dims, ",")));
    sub_shape.push_back(shape_[d]);
    if (!names_.empty()) sub_names.push_back(names_[d]);
  }
  std::vector<int> sub_ranks;
  for (int64_t i = 0; i < sub_shape.product(); ++i) {
    Dims sub = unravel_index(i, sub_shape);
    for (size_t j = 0; j < mesh_dims.size(); ++j) (*coord)[mesh_dims[j]] = sub[j];
    sub_ranks.push_back(ranks_[ravel_index(*coord, shape_)]);
  }
  return DeviceMesh(sub_shape, std::move(sub_ranks), std::move(sub_names));
}

DeviceMesh DeviceMesh::flatten(std::span<const int> mesh_dims, std::string name) const {
  if (mesh_dims.empty()) throw InvalidArgument("flatten needs at least one mesh dim");
  for (size_t i = 0; i < mesh_dims.size(); ++i) {
    check_mesh_dim(mesh_dims[i]);
    if (i && mesh_dims[i] <= mesh_dims[i - 1])
      throw InvalidArgument(fmt::format("flatten mesh dims [{}] must be distinct and ascending",
                                        fmt::join(mesh_dims, ",")));
  }
  if (names_.empty() && !name.empty())
    throw InvalidArgument(fmt::format(
        "cannot name the flattened dim '{}': the mesh dims have no names", name));
  auto merged = [&](int d) {
    return std::find(mesh_dims.begin(), mesh_dims.end(), d) != mesh_dims.end();
  };
  // New dim order: unmerged dims keep their order; the merged dim sits at mesh_dims[0].
  Dims new_shape;
  std::vector<std::string> new_names;
  std::vector<std::string> merged_names;
  for (int d = 0; d < ndim(); ++d) {
    if (merged(d)) {
      if (!names_.empty()) merged_names.push_back(names_[d]);
      if (d != mesh_dims[0]) continue;
      int64_t k = 1;
      for (int md : mesh_dims) k *= shape_[md];
      new_shape.push_back(k);
      new_names.emplace_back();  // filled below
    } else {
      new_shape.push_back(shape_[d]);
      if (!names_.empty()) new_names.push_back(names_[d]);
    }
  }
  if (!names_.empty()) {
    std::string joined = name.empty() ? fmt::format("{}", fmt::join(merged_names, "_")) : name;
    for (auto& n : new_names)
      if (n.empty()) n = joined;
  } else {
    new_names.clear();
  }
  // Enumerate the new mesh row-major and map each coordinate back to the old one.
  Dims merged_shape;
  for (int md : mesh_dims) merged_shape.push_back(shape_[md]);
  std::vector<int> new_ranks;
  Dims old = Dims::filled(ndim(), 0);
  for (int64_t i = 0; i < new_shape.product(); ++i) {
    Dims c = unravel_index(i, new_shape);
    int j = 0;
    for (int d = 0; d < ndim(); ++d) {
      if (merged(d)) {
        if (d != mesh_dims[0]) continue;
        Dims m = unravel_index(c[j++], merged_shape);
        for (size_t t = 0; t < mesh_dims.size(); ++t) old[mesh_dims[t]] = m[t];
      } else {
        old[d] = c[j++];
      }
    }
    new_ranks.push_back(ranks_[ravel_index(old, shape_)]);
  }
  return DeviceMesh(new_shape, std::move(new_ranks), std::move(new_names));
}

DeviceMesh DeviceMesh::flatten(std::string name) const {
  std::vector<int> all(ndim());
  for (int d = 0; d < ndim(); ++d) all[d] = d;
  return flatten(all, std::move(name));
}

DeviceMesh DeviceMesh::unflatten(int mesh_dim, const Dims& sizes, std::vector<std::string> names) const {
  check_mesh_dim(mesh_dim);
  if (sizes.size() == 0)
    throw InvalidArgument(fmt::format("unflatten of mesh dim {} needs at least one size", mesh_dim));
  int64_t product = 1;
  for (int64_t s : sizes) {
    if (s < 1)
      throw InvalidArgument(fmt::format("unflatten sizes [{}] have a size {} (expected >= 1)",
                                        fmt::join(sizes, ","), s));
    product *= s;
  }
  if (product != shape_[mesh_dim])
    throw InvalidArgument(fmt::format("unflatten sizes [{}] multiply to {}, but mesh dim {} has size {}",
                                      fmt::join(sizes, ","), product, mesh_dim, shape_[mesh_dim]));
  if (names_.empty() && !names.empty())
    throw InvalidArgument(fmt::format("cannot name the unflattened dims ({}): the mesh dims have no names",
                                      fmt::join(names, ",")));
  if (!names_.empty() && static_cast<int>(names.size()) != sizes.size())
    throw InvalidArgument(fmt::format("unflatten of mesh dim '{}' into [{}] needs {} names, got {} ({})",
                                      names_[mesh_dim], fmt::join(sizes, ","), sizes.size(), names.size(),
                                      fmt::join(names, ",")));
  Dims new_shape;
  std::vector<std::string> new_names;
  for (int d = 0; d < ndim(); ++d) {
    if (d != mesh_dim) {
      new_shape.push_back(shape_[d]);
      if (!names_.empty()) new_names.push_back(names_[d]);
      continue;
    }
    for (int i = 0; i < sizes.size(); ++i) new_shape.push_back(sizes[i]);
    new_names.insert(new_names.end(), names.begin(), names.end());
  }
  // Row-major over the new dims is row-major over the old one: the rank array is unchanged
  // (the constructor checks the names for duplicates).
  return DeviceMesh(new_shape, ranks_, std::move(new_names));
}

DeviceMesh DeviceMesh::unflatten(std::string_view name, const Dims& sizes, std::vector<std::string> names) const {
  return unflatten(mesh_dim(name), sizes, std::move(names));
}

Dims unravel_index(int64_t flat, const Dims& shape) {
  Dims coord = Dims::filled(shape.size(), 0);
  for (int d = shape.size() - 1; d >= 0; --d) {
    coord[d] = flat % shape[d];
    flat /= shape[d];
  }
  return coord;
}

int64_t ravel_index(const Dims& coord, const Dims& shape) {
  int64_t flat = 0;
  for (int d = 0; d < shape.size(); ++d) flat = flat * shape[d] + coord[d];
  return flat;
}

std::string to_string(const DeviceMesh& mesh) {
  // Nested brackets over the row-major rank list.
  std::string out;
  const Dims& shape = mesh.shape();
  int64_t n = mesh.size();
  for (int64_t i = 0; i < n; ++i) {
    int64_t stride = 1;
    for (int d = shape.size() - 1; d >= 0; --d) {
      stride *= shape[d];
      if (i % stride == 0) out += '[';
    }
    out += fmt::format("{}", mesh.ranks()[i]);
    stride = 1;
    for (int d = shape.size() - 1; d >= 0; --d) {
      stride *= shape[d];
      if ((i + 1) % stride == 0) out += ']';
    }
    if (i + 1 < n) out += ',';
  }
  if (mesh.has_names()) out += fmt::format(" ({})", fmt::join(mesh.names(), ","));
  return out;
}

}  // namespace dtensor
