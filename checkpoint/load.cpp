// checkpoint::load, load_pretrained and export_safetensors: every rank reads the boxes it needs
// from the files (resharding by box intersection), verified by the chunks' and blocks' checksums.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal.h"
#include "checkpoint/shared.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/format.h"
#include "nn/safetensors.h"

namespace checkpoint {

namespace fs = std::filesystem;
using dtensor::DTensor;
using kernels::InvalidArgument;
using kernels::Tensor;
using Json = nlohmann::ordered_json;
using namespace detail;

// ---- load ----

namespace {

struct FileCache {
  std::string dir;
  std::map<std::string, kernels::File> open;
  const kernels::File& get(const std::string& name) {
    auto it = open.find(name);
    if (it == open.end())  // regular files only: a FIFO never blocks the load
      it = open.emplace(name, kernels::File::open_read((fs::path(dir) / name).string())).first;
    return it->second;
  }
};

// Reads the box `off`/`size` (global, inside chunk c) into `buf` (contiguous, of `size`): one
// pread per contiguous run in the file.
void read_box(FileCache& files, const ChunkInfo& c, uint64_t item, const Dims& off, const Dims& size, void* buf,
              const std::string& what, LoadStats& stats) {
  if (c.nbytes == 0) return;
  const kernels::File& f = files.get(c.file);
  Dims rel(off);
  for (int d = 0; d < rel.size(); ++d) rel[d] = off[d] - c.offsets[d];
  char* dst = static_cast<char*>(buf);
  detail::for_each_run(c.sizes, rel, size, [&](int64_t elem, int64_t n) {
    const uint64_t bytes = static_cast<uint64_t>(n) * item;
    f.read_at(dst, bytes, c.byte_offset + static_cast<uint64_t>(elem) * item, what);
    dst += bytes;
    stats.bytes_read += bytes;
    ++stats.reads;
  });
}

[[noreturn]] void corrupt(const std::string& dir, const std::string& what, const ChunkInfo& c,
                          const std::string& detail = "") {
  throw InvalidArgument(
      fmt::format("checkpoint: checksum mismatch in '{}': {} in '{}' is corrupt{}", dir, what, c.file, detail));
}

// Checks the blocks of chunk c that lie inside the buffer box buf_off/buf_size.
void verify_blocks(const std::string& dir, const ChunkInfo& c, uint64_t item, const void* buf, const Dims& buf_off,
                   const Dims& buf_size, const std::string& what) {
  const detail::BlockRange all = detail::block_range(c.offsets, c.sizes, c.block_shape);
  const detail::BlockRange mine = detail::block_range(buf_off, buf_size, c.block_shape);
  detail::hash_blocks(buf, buf_off, buf_size, item, c.offsets, c.sizes, c.block_shape, mine,
                      [&](const Dims& block, uint64_t h) {
                        int64_t index = 0;
                        for (int d = 0; d < block.size(); ++d)
                          index = index * all.count[d] + (block[d] - all.first[d]);
                        if (h != c.block_checksums[static_cast<size_t>(index)]) {
                          Dims off, size;
                          detail::block_box(block, c.offsets, c.sizes, c.block_shape, off, size);
                          corrupt(dir, what, c, fmt::format(" (the block at {} size {})", off, size));
                        }
                      });
}

// Reads the part `want` (global offsets/sizes, inside chunk c) of chunk c into a contiguous
// tensor of want's sizes, verifying what it reads (LoadOptions::verify):
//   whole chunk                  read whole, its xxh64 checked
//   part, with block checksums   the blocks it overlaps read whole and checked
//   part, chunk checksum only    the chunk read whole and checked (kRead, kAll)
//   kNone, or no checksum        exactly the part's bytes, unchecked
// into: where the region goes (want_size, any strides); when it is contiguous the bytes are read
// straight into it (no extra buffer or copy) and it is returned.
Tensor read_region(FileCache& files, const std::string& key, const TensorInfo& ti, const ChunkInfo& c,
                   const Dims& want_off, const Dims& want_size, Verify verify, LoadStats& stats,
                   const Tensor& into = Tensor()) {
  const bool direct = into.defined() && into.is_contiguous() && into.device().is_cpu() && into.dtype() == ti.dtype;
  const int nd = ti.shape.size();
  const uint64_t item = kernels::itemsize(ti.dtype);
  const std::string what = fmt::format("'{}' chunk at {}", key, c.offsets);
  const bool blocks = !c.block_checksums.empty();
  const bool check = verify != Verify::kNone && (c.checksum || blocks);
  // The box read: the part itself, or grown to whole blocks or to the whole chunk to verify it.
  Dims off(want_off), size(want_size);
  if (check && (verify == Verify::kAll || !blocks)) {
    off = c.offsets;
    size = c.sizes;
  } else if (check) {
    for (int d = 0; d < nd; ++d) {  // inside the chunk: no overflow
      const int64_t b = c.block_shape[d], end = want_off[d] + want_size[d], chunk_end = c.offsets[d] + c.sizes[d];
      off[d] = std::max(c.offsets[d], want_off[d] / b * b);
      const int64_t last = (end - 1) / b;  // the last block the part touches
      size[d] = (chunk_end - last * b > b ? last * b + b : chunk_end) - off[d];
    }
  }
  const bool whole = off == c.offsets && size == c.sizes;
  const bool exact = off == want_off && size == want_size;
  Tensor buf = exact && direct ? into : Tensor::empty(size, ti.dtype);
  read_box(files, c, item, off, size, buf.data_ptr(), what, stats);
  if (check) {
    if (whole && c.checksum) {
      if (xxh64(buf.data_ptr(), c.nbytes) != *c.checksum) corrupt(files.dir, what, c);
    } else {
      verify_blocks(files.dir, c, item, buf.data_ptr(), off, size, what);
    }
  }
  if (exact) return buf;
  Dims rel(want_off);
  for (int d = 0; d < nd; ++d) rel[d] = want_off[d] - off[d];
  return narrow_box(buf, rel, want_size).contiguous();
}

}  // namespace

namespace {

std::string dtype_name(DType d) {
  const char* n = nn::safetensors_dtype_name(d);
  return n ? std::string(n) : std::string(kernels::to_string(d));
}

// What a load target must match: every key stored, the same shape, the same dtype (or, with
// convert, both floating), chunks tiling the tensor. Returns key -> the stored tensor.
std::unordered_map<std::string, const TensorInfo*> check_targets(
    const std::string& dir, const Metadata& md, const std::vector<std::tuple<std::string, Dims, DType>>& targets,
    bool convert) {
  std::unordered_map<std::string, const TensorInfo*> saved, out;
  for (const auto& [key, ti] : md.tensors) saved.emplace(key, &ti);
  for (const auto& [key, shape, dtype] : targets) {
    const auto found = saved.find(key);
    if (found == saved.end())
      throw InvalidArgument(fmt::format("checkpoint: '{}' has no tensor '{}' (missing key)", dir, key));
    const TensorInfo* ti = found->second;
    if (!(ti->shape == shape))
      throw InvalidArgument(fmt::format("checkpoint: '{}': '{}' was saved with shape {}, the target has shape {}", dir,
                                        key, ti->shape, shape));
    const bool convertible = convert && kernels::is_floating_point(ti->dtype) && kernels::is_floating_point(dtype);
    if (ti->dtype != dtype && !convertible)
      throw InvalidArgument(fmt::format("checkpoint: '{}': '{}' was saved as {}, the target is {}{}", dir, key,
                                        dtype_name(ti->dtype), kernels::to_string(dtype),
                                        convert ? " (only floating dtypes convert)" : ""));
    detail::check_coverage(dir, key, *ti);
    out.emplace(key, ti);
  }
  return out;
}

// Reads this rank's shard of t (the stored tensor ti) into dst (t's local shape, any strides,
// device and dtype: a stored dtype that differs is converted by the copy): one read per box of
// the shard and saved chunk it overlaps.
void read_shard(FileCache& files, const std::string& key, const TensorInfo& ti, const DTensor& t, const Tensor& dst,
                Verify verify, LoadStats& stats) {
  auto layout = t.spec().layout(t.comms()->rank());
  for (const Box& b : boxes_of(*layout, t.shape())) {
    stats.bytes_needed += static_cast<uint64_t>(b.sizes.product()) * kernels::itemsize(ti.dtype);
    const Tensor box_dst = box_view(dst, b);  // b.sizes; a ragged box's flat range viewed as a box
    for (const ChunkInfo& c : ti.chunks) {
      Dims lo(b.offsets), sz(b.sizes);
      bool any = true;
      for (int d = 0; d < b.offsets.size() && any; ++d) {
        lo[d] = std::max(b.offsets[d], c.offsets[d]);
        const int64_t hi = std::min(b.offsets[d] + b.sizes[d], c.offsets[d] + c.sizes[d]);
        if (hi <= lo[d]) any = false;
        sz[d] = hi - lo[d];
      }
      if (!any) continue;
      Dims at(lo);
      for (int d = 0; d < at.size(); ++d) at[d] = lo[d] - b.offsets[d];
      Tensor region_dst = narrow_box(box_dst, at, sz);
      Tensor region = read_region(files, key, ti, c, lo, sz, verify, stats, region_dst);
      if (region.data_ptr() != region_dst.data_ptr()) region_dst.copy_(region);
    }
  }
}

}  // namespace

LoadStats load(const std::string& dir, nn::StateDict& sd, collectives::Communicator& world,
               const LoadOptions& options) {
  LoadStats stats;
  const kernels::Device device = comm_device(sd);
  std::vector<Tensor> staged(sd.tensors.size());
  std::map<std::string, nn::StateValue> values;
  Failure error;
  try {
    const Metadata md = read_metadata(dir);
    std::vector<std::tuple<std::string, Dims, DType>> targets;
    std::set<std::string> wanted;
    for (const auto& [key, t] : sd.tensors) {
      targets.emplace_back(key, t.shape(), t.dtype());
      wanted.insert(key);
    }
    const auto saved = check_targets(dir, md, targets, options.convert_dtype);
    values = md.values;
    FileCache files{md.dir, {}};
    for (const auto& [key, ti] : md.tensors) {
      if (wanted.count(key)) continue;
      // PyTorch saves an optimizer's step as a one-element tensor: it becomes a value.
      if (md.foreign && ti.shape.product() == 1 && ti.chunks.size() == 1 && !values.count(key)) {
        const ChunkInfo& c = ti.chunks[0];
        Tensor one = read_region(files, key, ti, c, c.offsets, c.sizes, options.verify, stats);
        values[key] = one.to(DType::kF64).reshape({1}).item({0});
        continue;
      }
      if (options.strict)
        throw InvalidArgument(fmt::format("checkpoint: '{}' has tensor '{}' that the target does not ask for "
                                          "(unexpected key; load with strict = false to skip it)",
                                          dir, key));
    }
    for (size_t k = 0; k < sd.tensors.size(); ++k) {
      const auto& [key, t] = sd.tensors[k];
      if (!t.comms()->in_mesh()) continue;
      Tensor stage = Tensor::empty(t.to_local().shape(), t.dtype());
      read_shard(files, key, *saved.at(key), t, stage, options.verify, stats);
      staged[k] = std::move(stage);
    }
  } catch (...) {
    error = capture(std::current_exception());
  }
  // Agreement: nothing is written unless every rank read everything.
  const Failure agreed = agree(world, error, device);
  if (agreed.kind != kOk) raise(agreed.kind, agreed.message + "; nothing was changed");
  for (size_t k = 0; k < sd.tensors.size(); ++k) {
    if (!staged[k].defined()) continue;
    Tensor local = sd.tensors[k].second.to_local();
    local.copy_(staged[k].device() == local.device() ? staged[k] : staged[k].to(local.device()));
  }
  sd.values = std::move(values);
  return stats;
}

LoadStats load_pretrained(const std::string& path, nn::Module& model, collectives::Communicator& world,
                          const PretrainedOptions& options) {
  LoadStats stats;
  const auto params = model.named_parameters();
  const kernels::Device device = params.empty() ? kernels::Device{} : params.front().second->device();
  auto skipped = [&](const std::string& key) {
    for (const std::string& p : options.skip_prefixes)
      if (key.rfind(p, 0) == 0) return true;
    return false;
  };
  // 1. The checks, before anything is allocated: every rank agrees.
  Metadata md;
  std::unordered_map<std::string, const TensorInfo*> saved;
  Failure error;
  try {
    md = read_metadata(path);
    std::vector<std::tuple<std::string, Dims, DType>> targets;
    std::set<std::string> wanted;
    for (const auto& [name, p] : params) {
      targets.emplace_back(name, p->shape(), p->dtype());
      wanted.insert(name);
    }
    saved = check_targets(path, md, targets, /*convert=*/true);
    if (options.strict)
      for (const auto& [key, ti] : md.tensors)
        if (!wanted.count(key) && !skipped(key))
          throw InvalidArgument(fmt::format(
              "checkpoint: '{}' has tensor '{}', which is no parameter of the model (unexpected key)", path, key));
  } catch (...) {
    error = capture(std::current_exception());
  }
  Failure agreed = agree(world, error, device);
  if (agreed.kind != kOk) raise(agreed.kind, agreed.message + "; nothing was changed");
  // 2. Meta parameters get their shards (FSDP: its flat buffers), read into directly below.
  std::vector<char> fresh(params.size(), 0);
  try {
    for (size_t i = 0; i < params.size(); ++i) fresh[i] = params[i].second->is_meta();
    nn::to_empty(model);
  } catch (...) {
    error = capture(std::current_exception());
  }
  agreed = agree(world, error, device);
  if (agreed.kind != kOk) raise(agreed.kind, agreed.message + "; no value was written");
  // 3. The reads: straight into fresh shards, through staging for materialised ones.
  std::vector<Tensor> staged(params.size());
  try {
    FileCache files{md.dir, {}};
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      const DTensor& t = p->data();
      if (!t.comms()->in_mesh()) continue;
      Tensor dst = fresh[i] ? t.to_local() : Tensor::empty(t.to_local().shape(), t.dtype());
      read_shard(files, name, *saved.at(name), t, dst, options.verify, stats);
      if (!fresh[i]) staged[i] = std::move(dst);
    }
  } catch (...) {
    error = capture(std::current_exception());
  }
  agreed = agree(world, error, device);
  if (agreed.kind != kOk)
    raise(agreed.kind, agreed.message + "; the parameters that were materialised are unchanged (those that were "
                                        "meta hold undefined values)");
  for (size_t i = 0; i < params.size(); ++i) {
    if (!staged[i].defined()) continue;
    Tensor local = params[i].second->data().to_local();
    local.copy_(staged[i].device() == local.device() ? staged[i] : staged[i].to(local.device()));
  }
  return stats;
}

// ---- export ----

std::vector<std::string> export_safetensors(const std::string& dir, const std::string& out_dir,
                                            const ExportOptions& options) {
  const Metadata md = read_metadata(dir);
  struct Item {
    const std::string* key;
    const TensorInfo* ti;
    std::string name;
    uint64_t nbytes;
  };
  std::vector<Item> items;
  for (const auto& [key, ti] : md.tensors) {
    if (key.compare(0, options.prefix.size(), options.prefix) != 0) continue;
    detail::check_coverage(dir, key, ti);
    items.push_back({&key, &ti, options.strip_prefix ? key.substr(options.prefix.size()) : key,
                     static_cast<uint64_t>(ti.shape.product()) * kernels::itemsize(ti.dtype)});
  }
  if (items.empty())
    throw InvalidArgument(fmt::format("checkpoint: export: '{}' has no tensor whose key starts with '{}'", dir,
                                      options.prefix));
  // Group into files.
  std::vector<std::vector<size_t>> groups(1);
  uint64_t in_group = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (options.max_file_bytes > 0 && in_group > 0 && in_group + items[i].nbytes > options.max_file_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(i);
    in_group += items[i].nbytes;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) kernels::throw_file_error(ec.value(), fmt::format("checkpoint: export: cannot create directory '{}'", out_dir));
  std::vector<std::string> written;
  Json weight_map = Json::object();
  uint64_t total = 0;
  FileCache files{md.dir, {}};
  LoadStats stats;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string name = groups.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05}-of-{:05}.safetensors", g + 1, groups.size());
    Json header = Json::object();
    header["__metadata__"] = {{"format", "pt"}};
    uint64_t off = 0;
    for (size_t i : groups[g]) {
      const Item& it = items[i];
      header[it.name] = {{"dtype", nn::safetensors_dtype_name(it.ti->dtype)},
                         {"shape", std::vector<int64_t>(it.ti->shape.begin(), it.ti->shape.end())},
                         {"data_offsets", {off, off + it.nbytes}}};
      off += it.nbytes;
      weight_map[it.name] = name;
      total += it.nbytes;
    }
    std::string text = header.dump();
    while (text.size() % 8 != 0) text += ' ';
    const std::string path = (fs::path(out_dir) / name).string();
    kernels::File fd = kernels::File::create(path);
    const uint64_t n = text.size();
    fd.write_at(&n, 8, 0);
    fd.write_at(text.data(), n, 8);
    uint64_t pos = 8 + n;
    for (size_t i : groups[g]) {
      const Item& it = items[i];
      Tensor full = Tensor::empty(it.ti->shape, it.ti->dtype);
      for (const ChunkInfo& c : it.ti->chunks) {
        if (c.nbytes == 0) continue;
        Tensor part = read_region(files, *it.key, *it.ti, c, c.offsets, c.sizes, Verify::kRead, stats);
        Tensor dst = narrow_box(full, c.offsets, c.sizes);
        dst.copy_(part);
      }
      if (it.nbytes > 0) fd.write_at(full.data_ptr(), it.nbytes, pos);
      pos += it.nbytes;
    }
    fd.sync();
    fd.close();
    written.push_back(path);
  }
  if (groups.size() > 1) {
    Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string path = (fs::path(out_dir) / "model.safetensors.index.json").string();
    const std::string text = index.dump(2);
    kernels::File fd = kernels::File::create(path);
    fd.write_at(text.data(), text.size(), 0);
    fd.sync();
    fd.close();
    written.push_back(path);
  }
  return written;
}

}  // namespace checkpoint
