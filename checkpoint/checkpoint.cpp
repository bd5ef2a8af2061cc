#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <unordered_map>

#include "checkpoint/internal.h"
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

namespace {

constexpr const char* kTmpSuffix = ".tmp";
constexpr const char* kWriterKey = "dtensor_runtime";  // our files' __metadata__ marker

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- failures carried through an agreement ----

// The exit class of a failure (program/main.h's table), carried to every rank so that each
// rethrows the class the failing rank met: a full disk on rank 3 is a ResourceError everywhere.
enum Kind : int64_t { kOk = 0, kOther = 1, kInvalid = 2, kResource = 3, kComm = 4 };

struct Failure {
  int64_t kind = kOk;
  std::string message;
};

Failure capture(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const kernels::InvalidArgument& x) {
    return {kInvalid, x.what()};
  } catch (const kernels::Unsupported& x) {
    return {kInvalid, x.what()};
  } catch (const kernels::ResourceError& x) {
    return {kResource, x.what()};
  } catch (const std::bad_alloc& x) {
    return {kResource, fmt::format("out of memory: {}", x.what())};
  } catch (const kernels::CommError& x) {
    return {kComm, x.what()};
  } catch (const std::exception& x) {
    return {kOther, x.what()};
  } catch (...) {
    return {kOther, "an exception that is not a std::exception"};
  }
}

[[noreturn]] void raise(int64_t kind, const std::string& message) {
  switch (kind) {
    case kInvalid:
      throw kernels::InvalidArgument(message);
    case kResource:
      throw kernels::ResourceError(message);
    case kComm:
      throw kernels::CommError(message);
    default:
      throw kernels::Error(message);
  }
}

// ---- boxes ----

// A box of a rank's shard: global offsets and sizes, and where it starts in the local tensor.
struct Box {
  Dims offsets, sizes, local;
};

// The boxes of one rank's layout: the product over tensor dims of the runs of held indices
// (each run is contiguous in global coordinates and in local order).
std::vector<Box> boxes_of(const dtensor::ShardLayout& layout, const Dims& shape) {
  const int nd = shape.size();
  for (int d = 0; d < nd; ++d)
    if (layout.local_shape[d] == 0) return {};
  std::vector<Box> out;
  Box cur;
  cur.offsets.resize(nd);
  cur.sizes.resize(nd);
  cur.local.resize(nd);
  std::function<void(int)> rec = [&](int d) {
    if (d == nd) {
      out.push_back(cur);
      return;
    }
    int64_t pos = 0;
    for (const auto& run : layout.runs[d]) {
      if (run.length == 0) continue;
      cur.offsets[d] = run.start;
      cur.sizes[d] = run.length;
      cur.local[d] = pos;
      pos += run.length;
      rec(d + 1);
    }
  };
  rec(0);
  return out;
}

Tensor narrow_box(const Tensor& t, const Dims& start, const Dims& sizes) {
  Tensor v = t;
  for (int d = 0; d < sizes.size(); ++d) v = v.narrow(d, start[d], sizes[d]);
  return v;
}

std::string file_name(int rank, int slot, int slots) {
  return fmt::format("shard-{:05}-model-{:05}-of-{:05}.safetensors", rank + 1, slot + 1, slots);
}

// ---- save plan (a pure function of the specs: every rank computes the same) ----

struct PlannedChunk {
  size_t key = 0;
  Box box;           // box.local: in the owner's local tensor
  int owner = 0;     // world rank
  int slot = 0;      // file index of the owner
  uint64_t nbytes = 0;
  Dims block_shape;  // empty: no block checksums (detail::choose_block_shape)
  int64_t blocks = 0;
};

struct FilePlan {
  std::string name;
  int owner = 0;
  std::vector<size_t> chunks;     // indices into SavePlan::chunks, in file order
  std::vector<uint64_t> offsets;  // absolute byte offset of each chunk
  std::string header;             // the 8-byte length is written before it
  uint64_t size = 0;
};

struct SavePlan {
  std::vector<PlannedChunk> chunks;
  std::vector<FilePlan> files;
  uint64_t hash = 0;  // of the keys, shapes, dtypes, placements and meshes
};

void check_saveable(const std::string& key, const DTensor& t) {
  for (size_t m = 0; m < t.placements().size(); ++m)
    if (dtensor::is_partial(t.placements()[m]) && t.device_mesh().size(static_cast<int>(m)) > 1)
      throw InvalidArgument(fmt::format(
          "checkpoint: '{}' is {} on mesh dim {}: a Partial tensor has no saved value; reduce it first", key,
          dtensor::to_string(t.placements()[m]), m));
  if (!nn::safetensors_dtype_name(t.dtype()))
    throw InvalidArgument(
        fmt::format("checkpoint: '{}' has dtype {}, which safetensors cannot hold", key, kernels::to_string(t.dtype())));
}

SavePlan make_save_plan(const nn::StateDict& sd, int world_size, uint64_t block_bytes) {
  SavePlan plan;
  std::vector<uint64_t> load(world_size, 0);
  std::map<std::pair<int, size_t>, int> slots_used;  // (owner, key) -> chunks so far
  std::map<int, int> slots_of;                        // owner -> files
  std::string desc = fmt::format("block_bytes={};", block_bytes);
  std::set<std::string> seen;
  for (size_t k = 0; k < sd.tensors.size(); ++k) {
    const auto& [key, t] = sd.tensors[k];
    if (!seen.insert(key).second) throw InvalidArgument(fmt::format("checkpoint: key '{}' appears twice", key));
    check_saveable(key, t);
    const auto& spec = t.spec();
    desc += fmt::format("{}|{}|{}|{}|{};", key, spec.shape, kernels::to_string(spec.dtype),
                        dtensor::to_string(spec.placements), dtensor::to_string(*spec.mesh));
    const uint64_t item = kernels::itemsize(spec.dtype);
    // Distinct boxes in the order of the first holder (mesh order), with their holders.
    std::vector<std::pair<Box, std::vector<int>>> distinct;
    std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, size_t> index;
    for (int r : spec.mesh->ranks()) {
      if (r >= world_size)
        throw InvalidArgument(fmt::format("checkpoint: '{}' lives on rank {} but the world has {} ranks", key, r,
                                          world_size));
      auto layout = spec.layout(r);
      for (Box& b : boxes_of(*layout, spec.shape)) {
        auto id = std::make_pair(std::vector<int64_t>(b.offsets.begin(), b.offsets.end()),
                                 std::vector<int64_t>(b.sizes.begin(), b.sizes.end()));
        auto it = index.find(id);
        if (it == index.end()) {
          index.emplace(id, distinct.size());
          distinct.push_back({std::move(b), {r}});
        } else {
          distinct[it->second].second.push_back(r);
        }
      }
    }
    if (distinct.empty()) {
      // An empty tensor: one empty chunk (its shape is the global shape), so readers know it.
      Box b;
      b.offsets = Dims::filled(spec.shape.size(), 0);
      b.sizes = spec.shape;
      b.local = Dims::filled(spec.shape.size(), 0);
      distinct.push_back({b, {spec.mesh->ranks().front()}});
    }
    for (auto& [box, holders] : distinct) {
      int owner = holders.front();
      for (int h : holders)
        if (load[h] < load[owner]) owner = h;
      PlannedChunk c;
      c.key = k;
      c.box = box;
      c.owner = owner;
      c.nbytes = static_cast<uint64_t>(box.sizes.product()) * item;
      c.block_shape = detail::choose_block_shape(box.sizes, item, block_bytes);
      if (!c.block_shape.empty()) c.blocks = detail::block_range(box.offsets, box.sizes, c.block_shape).total();
      // box.local is right for every holder: ranks holding the same box differ only in mesh dims
      // that replicate the tensor, so their whole layouts (and local positions) are equal.
      load[owner] += c.nbytes;
      c.slot = slots_used[{owner, k}]++;
      slots_of[owner] = std::max(slots_of[owner], c.slot + 1);
      plan.chunks.push_back(std::move(c));
    }
  }
  plan.hash = xxh64(desc.data(), desc.size());
  // Files: per owner (ascending), per slot; chunks in key order.
  std::map<std::pair<int, int>, size_t> file_index;
  for (const auto& [owner, slots] : slots_of)
    for (int s = 0; s < slots; ++s) {
      file_index[{owner, s}] = plan.files.size();
      FilePlan f;
      f.name = file_name(owner, s, slots);
      f.owner = owner;
      plan.files.push_back(std::move(f));
    }
  for (size_t i = 0; i < plan.chunks.size(); ++i)
    plan.files[file_index[{plan.chunks[i].owner, plan.chunks[i].slot}]].chunks.push_back(i);
  for (FilePlan& f : plan.files) {
    Json header = Json::object();
    Json sharding = Json::object();
    for (size_t ci : f.chunks) {
      const PlannedChunk& c = plan.chunks[ci];
      sharding[sd.tensors[c.key].first] = {{"saved_offsets", std::vector<int64_t>(c.box.offsets.begin(), c.box.offsets.end())}};
    }
    header["__metadata__"] = {{"DCP_SHARDING_INFO", sharding.dump()},
                              {"DCP_VERSION", "1.0"},
                              {"format", "pt"},
                              {kWriterKey, "1"}};
    uint64_t off = 0;
    for (size_t ci : f.chunks) {
      const PlannedChunk& c = plan.chunks[ci];
      const auto& t = sd.tensors[c.key].second;
      header[sd.tensors[c.key].first] = {{"dtype", nn::safetensors_dtype_name(t.dtype())},
                                         {"shape", std::vector<int64_t>(c.box.sizes.begin(), c.box.sizes.end())},
                                         {"data_offsets", {off, off + c.nbytes}}};
      f.offsets.push_back(off);
      off += c.nbytes;
    }
    f.header = header.dump();
    while (f.header.size() % 8 != 0) f.header += ' ';
    const uint64_t base = 8 + f.header.size();
    for (uint64_t& o : f.offsets) o += base;
    f.size = base + off;
  }
  return plan;
}


// ---- I/O helpers ----

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The world communicator's device (nccl moves device memory only).
kernels::Device comm_device(const nn::StateDict& sd) {
  for (const auto& [k, t] : sd.tensors)
    if (t.to_local().defined()) return t.to_local().device();
  return kernels::Device{};
}

// Gathers one int64 row per rank (all the same length) over world.
std::vector<int64_t> all_gather_rows(collectives::Communicator& world, const std::vector<int64_t>& row,
                                     kernels::Device device) {
  Tensor in = Tensor::empty({static_cast<int64_t>(row.size())}, DType::kI64);
  std::memcpy(in.data_ptr(), row.data(), row.size() * 8);
  Tensor out = Tensor::empty({static_cast<int64_t>(row.size()) * world.size()}, DType::kI64, device);
  Tensor din = device.is_cpu() ? in : in.to(device);
  world.wait(world.all_gather(din, out));
  Tensor host = out.device().is_cpu() ? out : out.to(kernels::Device{});
  std::vector<int64_t> result(static_cast<size_t>(host.numel()));
  std::memcpy(result.data(), host.data_ptr(), result.size() * 8);
  return result;
}

// Agreement after a phase that may fail on some ranks: every rank learns whether any failed,
// the class of the first failure and its message (so every rank's exception names the key and
// the cause). Returns kind kOk when all succeeded. Collective over world.
Failure agree(collectives::Communicator& world, const Failure& mine, kernels::Device device) {
  std::vector<int64_t> kinds = all_gather_rows(world, {mine.kind}, device);
  int first = -1;
  for (int r = 0; r < world.size() && first < 0; ++r)
    if (kinds[static_cast<size_t>(r)] != kOk) first = r;
  if (first < 0) return {};
  std::string failed;
  for (int r = 0; r < world.size(); ++r)
    if (kinds[static_cast<size_t>(r)] != kOk) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  const std::string& error = mine.message;
  int64_t n = world.rank() == first ? static_cast<int64_t>(error.size()) : 0;
  Tensor len = Tensor::full({1}, static_cast<double>(n), DType::kI64);
  Tensor dlen = device.is_cpu() ? len : len.to(device);
  world.wait(world.broadcast(dlen, first));
  n = static_cast<int64_t>((dlen.device().is_cpu() ? dlen : dlen.to(kernels::Device{})).item({0}));
  Tensor text = Tensor::zeros({std::max<int64_t>(n, 1)}, DType::kU8);
  if (world.rank() == first) std::memcpy(text.data_ptr(), error.data(), error.size());
  Tensor dtext = device.is_cpu() ? text : text.to(device);
  world.wait(world.broadcast(dtext, first));
  Tensor host = dtext.device().is_cpu() ? dtext : dtext.to(kernels::Device{});
  const std::string msg(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
  const int64_t kind = kinds[static_cast<size_t>(first)];
  if (world.rank() == first) return {kind, error};
  return {kind, fmt::format("{} (on rank {}; failed on rank(s) {})", msg, first, failed)};
}

Json value_to_json(const nn::StateValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) return *d;
  return std::get<std::string>(v);
}

std::string hex64(uint64_t h) { return fmt::format("{:016x}", h); }

// Rank 0's preparation of the directory: created, the old commit and data files removed (from
// here on the directory is incomplete until the new commit).
void prepare_directory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) kernels::throw_file_error(ec.value(), fmt::format("checkpoint: cannot create directory '{}'", dir));
  if (!fs::is_directory(dir, ec))
    throw InvalidArgument(fmt::format("checkpoint: cannot create directory '{}': a file of that name exists", dir));
  auto remove = [&](const fs::path& p) {
    if (!fs::remove(p, ec) && ec && ec != std::errc::no_such_file_or_directory)
      kernels::throw_file_error(ec.value(), fmt::format("checkpoint: cannot remove '{}'", p.string()));
  };
  remove(fs::path(dir) / kMetadataFile);
  remove(fs::path(dir) / (std::string(kMetadataFile) + kTmpSuffix));
  std::vector<fs::path> old;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".safetensors" || (p.extension() == kTmpSuffix && p.stem().extension() == ".safetensors"))
      old.push_back(p);  // data files, and those of a save killed midway
  }
  if (ec) kernels::throw_file_error(ec.value(), fmt::format("checkpoint: cannot list '{}'", dir));
  for (const fs::path& p : old) remove(p);
}

}  // namespace

// ---- save ----

struct SaveHandle::State {
  std::string dir;
  collectives::Communicator* world = nullptr;
  kernels::Device device;
  SaveOptions options;
  SavePlan plan;
  std::vector<std::string> keys;
  std::vector<std::pair<std::string, std::pair<Dims, DType>>> tensor_info;
  std::map<std::string, nn::StateValue> values;
  std::vector<Tensor> staged;                     // per plan chunk this rank owns (else undefined)
  std::vector<uint64_t> checksums;                // per plan chunk (everyone's after the gather)
  std::vector<std::vector<uint64_t>> block_sums;  // per plan chunk: its blocks' (likewise)
  std::thread writer;
  std::atomic<bool> done{false};
  Failure error;  // the writer's failure
  SaveStats stats;
  bool waited = false;
  std::shared_ptr<StagingCache> cache;  // released (not busy) when the writer is joined
  ~State() {
    if (writer.joinable()) writer.join();
    release_cache();
  }
  void release_cache() {
    if (!cache) return;
    std::lock_guard lk(cache->mu);
    cache->busy = false;
    cache.reset();
  }
};

SaveHandle::SaveHandle() = default;
SaveHandle::SaveHandle(SaveHandle&&) noexcept = default;
SaveHandle& SaveHandle::operator=(SaveHandle&&) noexcept = default;
SaveHandle::~SaveHandle() {
  if (state_ && state_->writer.joinable()) state_->writer.join();
  if (state_) state_->release_cache();
}

bool SaveHandle::ready() const { return !state_ || state_->done.load(); }

struct SaveAccess {
  static void set(SaveHandle& h, std::unique_ptr<SaveHandle::State> s) { h.state_ = std::move(s); }
};

namespace {
SaveHandle start_save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
                      const SaveOptions& options, bool copy);
}

SaveHandle async_save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
                      const SaveOptions& options) {
  return start_save(dir, sd, world, options, true);
}

SaveStats save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
               const SaveOptions& options) {
  // The caller is blocked until the commit: contiguous host shards are written from where they
  // are (no staging copy, no extra memory).
  return start_save(dir, sd, world, options, false).wait();
}

namespace {

// This rank's files, written by the background thread (no communication).
void write_files(SaveHandle::State& s, int rank) {
  for (const FilePlan& f : s.plan.files) {
    if (f.owner != rank) continue;
    // Written under a temporary name and renamed once whole: a save killed midway leaves no
    // truncated .safetensors file (one without the metadata file would read as a foreign
    // checkpoint with a broken file instead of as an incomplete save).
    const std::string final_path = (fs::path(s.dir) / f.name).string();
    const std::string path = final_path + kTmpSuffix;
    kernels::File fd = kernels::File::create(path);
    const uint64_t n = f.header.size();
    fd.write_at(&n, 8, 0);
    fd.write_at(f.header.data(), n, 8);
    for (size_t j = 0; j < f.chunks.size(); ++j) {
      const Tensor& t = s.staged[f.chunks[j]];
      if (t.nbytes() > 0) fd.write_at(t.data_ptr(), t.nbytes(), f.offsets[j]);
      s.stats.bytes_written += t.nbytes();
      s.staged[f.chunks[j]] = Tensor();  // free the staged copy as soon as it is written
    }
    if (s.options.fsync) fd.sync();
    fd.close();
    kernels::rename_file(path, final_path);
    ++s.stats.files;
  }
  if (s.options.fsync) sync_dir(s.dir);
}

SaveHandle start_save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
                      const SaveOptions& options, bool copy) {
  const auto t0 = std::chrono::steady_clock::now();
  auto st = std::make_unique<SaveHandle::State>();
  st->dir = dir;
  st->world = &world;
  st->device = comm_device(sd);
  st->options = options;
  st->values = sd.values;
  const int rank = world.rank();
  Failure error;
  try {
    st->plan = make_save_plan(sd, world.size(), options.block_bytes);
    for (const auto& [k, t] : sd.tensors) st->tensor_info.push_back({k, {t.shape(), t.dtype()}});
    const auto& chunks = st->plan.chunks;
    st->staged.resize(chunks.size());
    st->checksums.assign(chunks.size(), 0);
    st->block_sums.assign(chunks.size(), {});
    StagingCache* cache = copy ? options.staging.get() : nullptr;
    size_t used = 0;
    if (cache) {
      std::lock_guard lk(cache->mu);
      if (cache->busy)
        throw InvalidArgument(fmt::format(
            "checkpoint: save to '{}': its staging cache is still used by a save not yet waited for", dir));
      cache->busy = true;
      st->cache = options.staging;
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      const PlannedChunk& c = chunks[i];
      if (c.owner != rank) continue;
      const Tensor& local = sd.tensors[c.key].second.to_local();
      Tensor view = c.nbytes == 0 ? Tensor::empty(c.box.sizes, local.dtype()) : narrow_box(local, c.box.local, c.box.sizes);
      // async: a copy, the caller may change its tensors as soon as we return.
      Tensor host;
      if (copy && cache) {
        if (used < cache->buffers.size() && cache->buffers[used].shape() == view.shape() &&
            cache->buffers[used].dtype() == view.dtype()) {
          host = cache->buffers[used];
        } else {
          host = Tensor::empty(view.shape(), view.dtype());
          if (used < cache->buffers.size()) cache->buffers[used] = host;
          else cache->buffers.push_back(host);
        }
        ++used;
        host.copy_(view);
      } else {
        host = !view.device().is_cpu()         ? view.to(kernels::Device{}).contiguous()
               : copy || !view.is_contiguous() ? view.clone()
                                               : view;
      }
      st->checksums[i] = xxh64(host.nbytes() ? host.data_ptr() : nullptr, host.nbytes());
      if (c.blocks > 0) {
        std::vector<uint64_t>& sums = st->block_sums[i];
        sums.reserve(static_cast<size_t>(c.blocks));
        detail::hash_blocks(host.data_ptr(), c.box.offsets, c.box.sizes, kernels::itemsize(host.dtype()),
                            c.box.offsets, c.box.sizes, c.block_shape,
                            detail::block_range(c.box.offsets, c.box.sizes, c.block_shape),
                            [&](const Dims&, uint64_t h) { sums.push_back(h); });
      }
      st->staged[i] = std::move(host);
    }
    if (rank == 0) prepare_directory(dir);
  } catch (...) {
    error = capture(std::current_exception());
  }
  // One gather: status, plan hash, and this rank's chunk and block checksums (the commit needs
  // them all); also the barrier after rank 0 cleared the directory. Row of rank r: its chunks'
  // checksums, then their blocks', in plan order (a pure function of the plan: every rank
  // knows every row's layout).
  std::vector<int64_t> per_rank(world.size(), 0);
  for (const auto& c : st->plan.chunks) per_rank[c.owner] += 1 + c.blocks;
  const int64_t most = *std::max_element(per_rank.begin(), per_rank.end());
  // Every rank must use the same row length: the plan's, or 0 chunks when planning failed
  // (then the hash differs as well and everyone raises).
  std::vector<int64_t> row(2 + static_cast<size_t>(most), 0);
  row[0] = error.kind;
  row[1] = static_cast<int64_t>(st->plan.hash);
  {
    size_t j = 2;
    for (size_t i = 0; i < st->plan.chunks.size(); ++i)
      if (st->plan.chunks[i].owner == rank) row[j++] = static_cast<int64_t>(st->checksums[i]);
    for (size_t i = 0; i < st->plan.chunks.size(); ++i)
      if (st->plan.chunks[i].owner == rank)
        for (uint64_t h : st->block_sums[i]) row[j++] = static_cast<int64_t>(h);
  }
  // Row lengths must agree before the gather: agree on the maximum first.
  std::vector<int64_t> lengths = all_gather_rows(world, {static_cast<int64_t>(row.size())}, st->device);
  const int64_t width = *std::max_element(lengths.begin(), lengths.end());
  row.resize(static_cast<size_t>(width), 0);
  std::vector<int64_t> all = all_gather_rows(world, row, st->device);
  const Failure agreed = agree(world, error, st->device);
  if (agreed.kind != kOk) raise(agreed.kind, agreed.message);
  for (int r = 0; r < world.size(); ++r)
    if (all[static_cast<size_t>(r) * width + 1] != static_cast<int64_t>(st->plan.hash))
      throw InvalidArgument(fmt::format(
          "checkpoint: save to '{}': rank {} passed a different state dict (keys, shapes, dtypes, placements, "
          "meshes or block_bytes) than rank {}",
          dir, r, rank));
  {
    std::vector<size_t> next(world.size(), 2);
    for (size_t i = 0; i < st->plan.chunks.size(); ++i) {
      const int o = st->plan.chunks[i].owner;
      st->checksums[i] = static_cast<uint64_t>(all[static_cast<size_t>(o) * width + next[o]++]);
    }
    for (size_t i = 0; i < st->plan.chunks.size(); ++i) {
      const int o = st->plan.chunks[i].owner;
      auto& sums = st->block_sums[i];
      sums.resize(static_cast<size_t>(st->plan.chunks[i].blocks));
      for (uint64_t& h : sums) h = static_cast<uint64_t>(all[static_cast<size_t>(o) * width + next[o]++]);
    }
  }
  st->stats.stage_seconds = seconds_since(t0);
  // The background writer: this rank's files, no communication.
  SaveHandle::State* s = st.get();
  s->writer = std::thread([s, rank] {
    const auto t1 = std::chrono::steady_clock::now();
    try {
      write_files(*s, rank);
    } catch (...) {
      s->error = capture(std::current_exception());
    }
    s->stats.write_seconds = seconds_since(t1);
    s->done = true;
  });
  SaveHandle h;
  SaveAccess::set(h, std::move(st));
  return h;
}

// checkpoint.json (README "On disk").
std::string metadata_text(const SaveHandle::State& s, int world_size) {
  Json meta = Json::object();
  meta["format"] = "dtensor-runtime-checkpoint";
  meta["version"] = 1;
  meta["world_size"] = world_size;
  meta["checksum"] = "xxh64";
  Json tensors = Json::object();
  for (const auto& [k, info] : s.tensor_info)
    tensors[k] = {{"shape", std::vector<int64_t>(info.first.begin(), info.first.end())},
                  {"dtype", nn::safetensors_dtype_name(info.second)},
                  {"chunks", Json::array()}};
  for (const FilePlan& f : s.plan.files)
    for (size_t j = 0; j < f.chunks.size(); ++j) {
      const PlannedChunk& c = s.plan.chunks[f.chunks[j]];
      Json chunk = {{"offsets", std::vector<int64_t>(c.box.offsets.begin(), c.box.offsets.end())},
                    {"sizes", std::vector<int64_t>(c.box.sizes.begin(), c.box.sizes.end())},
                    {"file", f.name},
                    {"byte_offset", f.offsets[j]},
                    {"nbytes", c.nbytes},
                    {"xxh64", hex64(s.checksums[f.chunks[j]])}};
      if (c.blocks > 0) {
        std::string blocks;
        blocks.reserve(static_cast<size_t>(c.blocks) * 16);
        for (uint64_t h : s.block_sums[f.chunks[j]]) blocks += hex64(h);
        chunk["block_shape"] = std::vector<int64_t>(c.block_shape.begin(), c.block_shape.end());
        chunk["block_xxh64"] = std::move(blocks);
      }
      tensors[s.tensor_info[c.key].first]["chunks"].push_back(std::move(chunk));
    }
  meta["tensors"] = std::move(tensors);
  Json files = Json::object();
  for (const FilePlan& f : s.plan.files) files[f.name] = f.size;
  meta["files"] = std::move(files);
  Json values = Json::object();
  for (const auto& [k, v] : s.values) values[k] = value_to_json(v);
  meta["values"] = std::move(values);
  return meta.dump(1);
}

}  // namespace

SaveStats SaveHandle::wait() {
  if (!state_) throw InvalidArgument("checkpoint: wait() on an empty SaveHandle");
  State& s = *state_;
  if (s.waited) throw InvalidArgument(fmt::format("checkpoint: the save to '{}' was already waited for", s.dir));
  s.waited = true;
  if (s.writer.joinable()) s.writer.join();
  s.release_cache();
  collectives::Communicator& world = *s.world;
  const int rank = world.rank();
  const Failure agreed = agree(world, s.error, s.device);
  if (agreed.kind != kOk) raise(agreed.kind, agreed.message + " (the checkpoint was not committed)");
  Failure commit_error;
  if (rank == 0) {
    try {
      const std::string text = metadata_text(s, world.size());
      const std::string final_path = (fs::path(s.dir) / kMetadataFile).string();
      const std::string tmp = final_path + kTmpSuffix;
      kernels::File fd = kernels::File::create(tmp);
      fd.write_at(text.data(), text.size(), 0);
      if (s.options.fsync) fd.sync();
      fd.close();
      kernels::rename_file(tmp, final_path);
      if (s.options.fsync) sync_dir(s.dir);
    } catch (...) {
      commit_error = capture(std::current_exception());
    }
  }
  const Failure committed = agree(world, commit_error, s.device);
  if (committed.kind != kOk) raise(committed.kind, committed.message + " (the checkpoint was not committed)");
  return s.stats;
}

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
      for (int d = 0; d < at.size(); ++d) at[d] = b.local[d] + lo[d] - b.offsets[d];
      Tensor region_dst = narrow_box(dst, at, sz);
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
