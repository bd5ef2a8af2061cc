// read_metadata: checkpoint.json, or the headers of a directory PyTorch / Hugging Face wrote.
// Everything read is hostile until checked: every integer is range-checked (kernels/checked.h),
// every JSON value's type is checked before use, only regular files are opened (a FIFO would
// block), and every error names the file, the tensor and the field.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <span>

#include "checkpoint/internal.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/format.h"
#include "nn/safetensors.h"

namespace checkpoint {

namespace fs = std::filesystem;
using kernels::InvalidArgument;
using Json = nlohmann::ordered_json;

namespace {

constexpr const char* kWriterKey = "dtensor_runtime";  // our files' __metadata__ marker (shared.h)
constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

[[noreturn]] void malformed(const std::string& where, const std::string& what) {
  throw InvalidArgument(fmt::format("checkpoint: {}: {}", where, what));
}

// ---- typed JSON access (J: nlohmann::json or ordered_json) ----

template <class J>
const J& field(const J& obj, const char* name, const std::string& where) {
  if (!obj.is_object()) malformed(where, fmt::format("is {} (expected a JSON object)", kernels::clip(obj.dump())));
  const auto it = obj.find(name);
  if (it == obj.end()) malformed(where, fmt::format("'{}' is missing", name));
  return *it;
}

// An integer in [lo, hi]; unsigned values above int64 and non-integers are refused.
template <class J>
int64_t as_int(const J& v, const char* name, const std::string& where, int64_t lo = 0,
               int64_t hi = kernels::kInt64Max) {
  bool ok = false;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    ok = v.template get<uint64_t>() <= static_cast<uint64_t>(hi);
    x = static_cast<int64_t>(std::min<uint64_t>(v.template get<uint64_t>(), static_cast<uint64_t>(kernels::kInt64Max)));
  } else if (v.is_number_integer()) {
    x = v.template get<int64_t>();
    ok = true;
  }
  if (!ok || x < lo || x > hi)
    malformed(where, fmt::format("'{}' is {} (expected an integer in {}..{})", name, kernels::clip(v.dump()), lo, hi));
  return x;
}

template <class J>
std::string as_string(const J& v, const char* name, const std::string& where) {
  if (!v.is_string()) malformed(where, fmt::format("'{}' is {} (expected a string)", name, kernels::clip(v.dump())));
  return v.template get<std::string>();
}

// A list of at most kMaxDims integers >= lo.
template <class J>
Dims as_dims(const J& v, const char* name, const std::string& where, int64_t lo = 0) {
  if (!v.is_array() || v.size() > static_cast<size_t>(kernels::kMaxDims))
    malformed(where, fmt::format("'{}' is {} (expected a list of at most {} integers)", name, kernels::clip(v.dump()),
                                 kernels::kMaxDims));
  Dims d;
  for (const auto& x : v) d.push_back(as_int(x, name, where, lo));
  return d;
}

DType as_dtype(const std::string& s, const std::string& where) {
  try {
    return nn::parse_safetensors_dtype(s);
  } catch (const InvalidArgument& e) {
    malformed(where, e.what());
  }
}

// 1 to 16 hex digits.
uint64_t as_hex64(const std::string& s, const char* name, const std::string& where) {
  uint64_t x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x, 16);
  if (s.empty() || s.size() > 16 || ec != std::errc() || end != s.data() + s.size())
    malformed(where, fmt::format("'{}' is \"{}\" (expected 1 to 16 hex digits)", name, kernels::clip(s)));
  return x;
}

// Data file names are plain names inside the directory (no path can lead out of it).
void check_file_name(const std::string& name, const std::string& where) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos)
    malformed(where, fmt::format("data file name '{}' is not a plain file name", kernels::clip(name)));
}

int64_t element_count(const Dims& shape, const std::string& where) {
  return kernels::checked_product(std::span<const int64_t>(shape.begin(), shape.end()),
                                  "checkpoint: " + where + ": the element count");
}

// stat() of a path that must be a regular file: false when it does not exist; InvalidArgument
// when it is something else or cannot be reached.
bool regular_file_exists(const std::string& path, uint64_t* size = nullptr) {
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0) {
    if (errno == ENOENT) return false;
    kernels::throw_file_error(errno, fmt::format("checkpoint: cannot access '{}'", path));
  }
  if (!S_ISREG(sb.st_mode))
    throw InvalidArgument(
        fmt::format("checkpoint: '{}' is {}, not a regular file", path, kernels::file_type_name(sb.st_mode)));
  if (size) *size = static_cast<uint64_t>(sb.st_size);
  return true;
}

// ---- checkpoint.json ----

// files: the sizes of 'files', or nullptr when the metadata has none.
ChunkInfo parse_chunk(const Json& c, const TensorInfo& ti, const std::map<std::string, uint64_t>* files,
                      const std::string& where) {
  ChunkInfo ci;
  const int nd = ti.shape.size();
  ci.offsets = as_dims(field(c, "offsets", where), "offsets", where);
  ci.sizes = as_dims(field(c, "sizes", where), "sizes", where);
  if (ci.offsets.size() != nd || ci.sizes.size() != nd)
    malformed(where, fmt::format("offsets {} and sizes {} do not have the {} dims of the shape {}", ci.offsets, ci.sizes,
                                 nd, ti.shape));
  for (int d = 0; d < nd; ++d)  // offset + size <= shape, without forming the sum
    if (ci.sizes[d] > ti.shape[d] || ci.offsets[d] > ti.shape[d] - ci.sizes[d])
      malformed(where, fmt::format("the chunk at {} size {} lies outside its shape {}", ci.offsets, ci.sizes, ti.shape));
  ci.file = as_string(field(c, "file", where), "file", where);
  check_file_name(ci.file, where);
  ci.byte_offset = static_cast<uint64_t>(as_int(field(c, "byte_offset", where), "byte_offset", where));
  ci.nbytes = static_cast<uint64_t>(as_int(field(c, "nbytes", where), "nbytes", where));
  const int64_t bytes = kernels::checked_bytes(element_count(ci.sizes, where), kernels::itemsize(ti.dtype),
                                               "checkpoint: " + where + ": the byte count");
  if (ci.nbytes != static_cast<uint64_t>(bytes))
    malformed(where, fmt::format("'nbytes' is {}, but sizes {} of {} hold {} bytes", ci.nbytes, ci.sizes,
                                 kernels::to_string(ti.dtype), bytes));
  const uint64_t end = static_cast<uint64_t>(
      kernels::checked_add(static_cast<int64_t>(ci.byte_offset), bytes, "checkpoint: " + where + ": byte_offset + nbytes"));
  if (files) {
    const auto f = files->find(ci.file);
    if (f == files->end()) malformed(where, fmt::format("data file '{}' is not listed in 'files'", ci.file));
    if (end > f->second)
      malformed(where, fmt::format("bytes [{}, {}) lie past the end of '{}' ({} bytes)", ci.byte_offset, end, ci.file,
                                   f->second));
  }
  if (c.contains("xxh64")) ci.checksum = as_hex64(as_string(c["xxh64"], "xxh64", where), "xxh64", where);
  if (c.contains("block_shape") || c.contains("block_xxh64")) {
    ci.block_shape = as_dims(field(c, "block_shape", where), "block_shape", where, 1);
    if (ci.block_shape.size() != nd)
      malformed(where, fmt::format("'block_shape' {} does not have the {} dims of the shape", ci.block_shape, nd));
    const std::string hex = as_string(field(c, "block_xxh64", where), "block_xxh64", where);
    int64_t blocks = 0;
    if (ci.sizes.product() > 0)
      blocks = kernels::checked_product(
          std::span<const int64_t>(detail::block_range(ci.offsets, ci.sizes, ci.block_shape).count.begin(), nd),
          "checkpoint: " + where + ": the block count");
    if (blocks == 0 || hex.size() / 16 != static_cast<uint64_t>(blocks) || hex.size() % 16 != 0)
      malformed(where, fmt::format("'block_xxh64' holds {} characters; block_shape {} cuts sizes {} at offsets {} into "
                                   "{} blocks of 16 hex digits",
                                   hex.size(), ci.block_shape, ci.sizes, ci.offsets, blocks));
    ci.block_checksums.resize(static_cast<size_t>(blocks));
    for (size_t b = 0; b < ci.block_checksums.size(); ++b)
      ci.block_checksums[b] = as_hex64(hex.substr(16 * b, 16), "block_xxh64", where);
  }
  return ci;
}

Metadata parse_ours(const std::string& dir, const std::string& meta_path, const Json& j) {
  Metadata md;
  const std::string top = fmt::format("'{}'", meta_path);
  if (!j.is_object() || !j.contains("format") || j["format"] != "dtensor-runtime-checkpoint")
    throw InvalidArgument(fmt::format("checkpoint: '{}' is not a dtensor-runtime checkpoint metadata file", meta_path));
  if (j.contains("files")) {
    const Json& files = j["files"];
    if (!files.is_object()) malformed(top, fmt::format("'files' is {} (expected an object)", kernels::clip(files.dump())));
    for (auto it = files.begin(); it != files.end(); ++it) {
      const std::string where = fmt::format("'{}': file '{}'", meta_path, kernels::clip(it.key()));
      check_file_name(it.key(), where);
      md.file_sizes[it.key()] = static_cast<uint64_t>(as_int(*it, "size", where));
    }
  }
  const Json& tensors = field(j, "tensors", top);
  if (!tensors.is_object()) malformed(top, fmt::format("'tensors' is {} (expected an object)", kernels::clip(tensors.dump())));
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string where = fmt::format("'{}': tensor '{}'", meta_path, kernels::clip(it.key()));
    TensorInfo ti;
    ti.shape = as_dims(field(*it, "shape", where), "shape", where);
    element_count(ti.shape, where);
    ti.dtype = as_dtype(as_string(field(*it, "dtype", where), "dtype", where), where);
    const Json& chunks = field(*it, "chunks", where);
    if (!chunks.is_array()) malformed(where, "'chunks' is not a list");
    ti.chunks.reserve(chunks.size());
    size_t i = 0;
    for (const auto& c : chunks)
      ti.chunks.push_back(parse_chunk(c, ti, j.contains("files") ? &md.file_sizes : nullptr,
                                      fmt::format("{} chunk {}", where, i++)));
    md.tensors.emplace_back(it.key(), std::move(ti));
  }
  if (j.contains("values")) {
    const Json& values = j["values"];
    if (!values.is_object()) malformed(top, "'values' is not an object");
    for (auto it = values.begin(); it != values.end(); ++it) {
      if (it->is_number_integer())
        md.values[it.key()] = as_int(*it, "value", fmt::format("'{}': value '{}'", meta_path, it.key()),
                                     std::numeric_limits<int64_t>::min());
      else if (it->is_number())
        md.values[it.key()] = it->get<double>();
      else if (it->is_string())
        md.values[it.key()] = it->get<std::string>();
      else
        malformed(top, fmt::format("value '{}' is {} (expected an integer, a number or a string)",
                                   kernels::clip(it.key()), kernels::clip(it->dump())));
    }
  }
  // Every data file present, a regular file, with the size the commit recorded (a truncated or
  // replaced file is caught before any read).
  for (const auto& [name, size] : md.file_sizes) {
    uint64_t got = 0;
    const bool exists = regular_file_exists((fs::path(dir) / name).string(), &got);
    if (!exists || got != size) {
      std::string key;
      for (const auto& [k, t] : md.tensors)
        if (std::any_of(t.chunks.begin(), t.chunks.end(), [&](const ChunkInfo& c) { return c.file == name; }))
          key += fmt::format("{}'{}'", key.empty() ? "" : ", ", k);
      throw InvalidArgument(fmt::format("checkpoint: '{}': data file '{}' (holding {}) is {}; the metadata says {} "
                                        "bytes",
                                        dir, name, key.empty() ? "no chunk" : kernels::clip(key, 200),
                                        exists ? fmt::format("{} bytes", got) : "missing", size));
    }
  }
  return md;
}

// ---- directories PyTorch / Hugging Face wrote ----

struct SafetensorsHeader {
  nlohmann::json header;
  uint64_t data_start = 0;
  uint64_t file_size = 0;
};

SafetensorsHeader read_header(const std::string& path) {
  const kernels::File f = kernels::File::open_read(path);
  SafetensorsHeader h;
  h.file_size = f.size();
  uint64_t n = 0;
  if (h.file_size < 8) throw InvalidArgument(fmt::format("checkpoint: '{}' is too short for a safetensors file", path));
  f.read_at(&n, 8, 0, "the header length");
  if (n > kMaxHeader || n > h.file_size - 8)
    throw InvalidArgument(fmt::format("checkpoint: '{}' has an invalid safetensors header length {}", path, n));
  std::string text(n, '\0');
  f.read_at(text.data(), n, 8, "the header");
  try {
    h.header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' has a malformed safetensors header: {}", path, e.what()));
  }
  if (!h.header.is_object())
    throw InvalidArgument(fmt::format("checkpoint: '{}' has a safetensors header that is {} (expected a JSON object)",
                                      path, kernels::clip(h.header.dump())));
  h.data_start = 8 + n;
  return h;
}

void read_foreign_file(const std::string& dir, const fs::path& p, Metadata& md, std::map<std::string, size_t>& index) {
  const std::string path = p.string();
  SafetensorsHeader h = read_header(path);
  nlohmann::json sharding = nlohmann::json::object();
  if (h.header.contains("__metadata__")) {
    const auto& m = h.header["__metadata__"];
    const std::string where = fmt::format("'{}': __metadata__", path);
    if (!m.is_object()) malformed(where, "is not a JSON object");
    if (m.contains(kWriterKey))
      throw InvalidArgument(fmt::format(
          "checkpoint: '{}' is incomplete: it has data files but no {} (the save did not finish; load the "
          "previous checkpoint)",
          dir, kMetadataFile));
    if (m.contains("DCP_SHARDING_INFO")) {
      const std::string text = as_string(m["DCP_SHARDING_INFO"], "DCP_SHARDING_INFO", where);
      try {
        sharding = nlohmann::json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        malformed(where, fmt::format("DCP_SHARDING_INFO is not JSON: {}", e.what()));
      }
      if (!sharding.is_object()) malformed(where, "DCP_SHARDING_INFO is not a JSON object");
    }
  }
  const uint64_t data_bytes = h.file_size - h.data_start;
  for (auto it = h.header.begin(); it != h.header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& key = it.key();
    const std::string where = fmt::format("'{}': tensor '{}'", path, kernels::clip(key));
    ChunkInfo c;
    c.file = p.filename().string();
    const DType dt = as_dtype(as_string(field(*it, "dtype", where), "dtype", where), where);
    c.sizes = as_dims(field(*it, "shape", where), "shape", where);
    c.offsets = sharding.contains(key) ? as_dims(field(sharding[key], "saved_offsets", where + " DCP_SHARDING_INFO"),
                                                 "saved_offsets", where)
                                       : Dims::filled(c.sizes.size(), 0);
    if (c.offsets.size() != c.sizes.size())
      malformed(where, fmt::format("saved_offsets {} do not match its shape {}", c.offsets, c.sizes));
    const auto& span = field(*it, "data_offsets", where);
    if (!span.is_array() || span.size() != 2)
      malformed(where, fmt::format("'data_offsets' is {} (expected [begin, end])", kernels::clip(span.dump())));
    const int64_t b = as_int(span[0], "data_offsets", where), e = as_int(span[1], "data_offsets", where);
    const int64_t bytes = kernels::checked_bytes(element_count(c.sizes, where), kernels::itemsize(dt),
                                                 "checkpoint: " + where + ": the byte count");
    if (e < b || static_cast<uint64_t>(e) > data_bytes || e - b != bytes)
      malformed(where, fmt::format("data offsets [{}, {}] do not fit its shape {} ({} bytes) or the file ({} data "
                                   "bytes)",
                                   b, e, c.sizes, bytes, data_bytes));
    c.byte_offset = h.data_start + static_cast<uint64_t>(b);
    c.nbytes = static_cast<uint64_t>(bytes);
    auto found = index.find(key);
    if (found == index.end()) {
      found = index.emplace(key, md.tensors.size()).first;
      TensorInfo ti;
      ti.dtype = dt;
      ti.shape = Dims::filled(c.sizes.size(), 0);
      md.tensors.emplace_back(key, std::move(ti));
    }
    TensorInfo& ti = md.tensors[found->second].second;
    if (ti.dtype != dt || ti.shape.size() != c.sizes.size())
      throw InvalidArgument(fmt::format("checkpoint: '{}' has chunks of different dtypes or ranks in '{}'", key, dir));
    for (int d = 0; d < c.sizes.size(); ++d)
      ti.shape[d] = std::max(ti.shape[d], kernels::checked_add(c.offsets[d], c.sizes[d],
                                                               "checkpoint: " + where + ": saved_offsets + shape"));
    element_count(ti.shape, where);
    ti.chunks.push_back(std::move(c));
  }
}

}  // namespace

namespace {

// A Hugging Face index (model.safetensors.index.json): {"metadata": {...}, "weight_map": {name:
// file}}; the files it names are read (each once) and must hold exactly the tensors it lists.
Metadata read_index(const std::string& path) {
  const std::string text = kernels::read_regular_file(path, kMaxMetadataBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' is not a safetensors index (not JSON: {})", path, e.what()));
  }
  const std::string where = fmt::format("'{}'", path);
  const auto& map = field(j, "weight_map", where);
  if (!map.is_object()) malformed(where, "'weight_map' is not a JSON object");
  Metadata md;
  md.foreign = true;
  md.dir = fs::path(path).parent_path().string();
  if (md.dir.empty()) md.dir = ".";
  std::map<std::string, std::string> wanted;  // tensor -> file
  std::set<std::string> files;
  for (auto it = map.begin(); it != map.end(); ++it) {
    const std::string file = as_string(*it, "weight_map", where + ": weight_map['" + kernels::clip(it.key()) + "']");
    check_file_name(file, where + ": weight_map['" + kernels::clip(it.key()) + "']");
    wanted[it.key()] = file;
    files.insert(file);
  }
  std::map<std::string, size_t> index;
  for (const std::string& f : files) {
    const fs::path p = fs::path(md.dir) / f;
    if (!regular_file_exists(p.string()))
      throw InvalidArgument(fmt::format("checkpoint: '{}' names '{}', which does not exist", path, p.string()));
    try {
      read_foreign_file(md.dir, p, md, index);
    } catch (const nlohmann::json::exception& e) {
      throw InvalidArgument(fmt::format("checkpoint: '{}' has a malformed safetensors header: {}", p.string(), e.what()));
    }
  }
  for (const auto& [key, ti] : md.tensors) {
    const auto w = wanted.find(key);
    for (const ChunkInfo& c : ti.chunks)
      if (w == wanted.end() || w->second != c.file)
        throw InvalidArgument(fmt::format("checkpoint: '{}' holds tensor '{}', which the index '{}' {}",
                                          (fs::path(md.dir) / c.file).string(), key, path,
                                          w == wanted.end() ? "does not list" : "lists in '" + w->second + "'"));
  }
  for (const auto& [key, file] : wanted)
    if (!index.count(key))
      throw InvalidArgument(fmt::format("checkpoint: the index '{}' lists tensor '{}' in '{}', which has no such tensor",
                                        path, key, file));
  return md;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

const TensorInfo* Metadata::find(const std::string& key) const {
  for (const auto& [k, t] : tensors)
    if (k == key) return &t;
  return nullptr;
}

Metadata read_metadata(const std::string& dir) {
  struct stat sb;
  if (::stat(dir.c_str(), &sb) != 0) {
    if (errno == ENOENT) throw InvalidArgument(fmt::format("checkpoint: '{}' is not a directory (it does not exist)", dir));
    kernels::throw_file_error(errno, fmt::format("checkpoint: cannot access '{}'", dir));
  }
  if (S_ISREG(sb.st_mode) && ends_with(dir, ".json")) return read_index(dir);
  if (S_ISREG(sb.st_mode) && ends_with(dir, ".safetensors")) {
    // One consolidated file (model.safetensors): whole tensors, or a PyTorch shard file.
    Metadata md;
    md.foreign = true;
    md.dir = fs::path(dir).parent_path().string();
    if (md.dir.empty()) md.dir = ".";
    std::map<std::string, size_t> index;
    try {
      read_foreign_file(md.dir, fs::path(dir), md, index);
    } catch (const nlohmann::json::exception& e) {
      throw InvalidArgument(fmt::format("checkpoint: '{}' has a malformed safetensors header: {}", dir, e.what()));
    }
    return md;
  }
  if (!S_ISDIR(sb.st_mode))
    throw InvalidArgument(fmt::format(
        "checkpoint: '{}' is not a directory, a .safetensors file or a safetensors index (.json) (it is {})", dir,
        S_ISREG(sb.st_mode) ? "a regular file" : kernels::file_type_name(sb.st_mode)));
  const std::string meta_path = (fs::path(dir) / kMetadataFile).string();
  if (!regular_file_exists(meta_path)) {
    std::vector<fs::path> files;
    std::error_code ec;
    fs::directory_iterator it(dir, ec);
    for (; !ec && it != fs::directory_iterator(); it.increment(ec))
      if (it->path().extension() == ".safetensors") {
        regular_file_exists(it->path().string());  // a FIFO or a directory by that name: refused
        files.push_back(it->path());
      }
    if (ec) kernels::throw_file_error(ec.value(), fmt::format("checkpoint: cannot list '{}'", dir));
    std::sort(files.begin(), files.end());
    if (files.empty())
      throw InvalidArgument(fmt::format(
          "checkpoint: '{}' is not a checkpoint (or an incomplete one): no {} and no .safetensors files", dir,
          kMetadataFile));
    Metadata md;
    md.foreign = true;
    md.dir = dir;
    std::map<std::string, size_t> index;
    for (const fs::path& p : files) {
      try {
        read_foreign_file(dir, p, md, index);
      } catch (const nlohmann::json::exception& e) {  // a type the checks above missed: still named
        throw InvalidArgument(fmt::format("checkpoint: '{}' has a malformed safetensors header: {}", p.string(),
                                          e.what()));
      }
    }
    return md;
  }
  const std::string text = kernels::read_regular_file(meta_path, kMaxMetadataBytes);
  Json j;  // ordered: the tensors keep their save order
  try {
    j = Json::parse(text);
    Metadata md = parse_ours(dir, meta_path, j);
    md.dir = dir;
    return md;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' is malformed: {}", meta_path, e.what()));
  }
}

}  // namespace checkpoint
