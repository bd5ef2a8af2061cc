#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/error.h"
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
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- xxh64 ----

constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                   P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t xround(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
inline uint64_t xmerge(uint64_t acc, uint64_t v) { return (acc ^ xround(0, v)) * P1 + P4; }

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

SavePlan make_save_plan(const nn::StateDict& sd, int world_size) {
  SavePlan plan;
  std::vector<uint64_t> load(world_size, 0);
  std::map<std::pair<int, size_t>, int> slots_used;  // (owner, key) -> chunks so far
  std::map<int, int> slots_of;                        // owner -> files
  std::string desc;
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

void write_all(int fd, const void* data, uint64_t n, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t w = ::pwrite(fd, p, step, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw kernels::Error(fmt::format("checkpoint: writing '{}' failed: {}", path, std::strerror(errno)));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// Reads exactly n bytes or throws naming the file and `what`.
void read_all(int fd, void* data, uint64_t n, uint64_t offset, const std::string& path, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t r = ::pread(fd, p, step, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw InvalidArgument(fmt::format("checkpoint: reading {} from '{}' failed: {}", what, path, std::strerror(errno)));
    }
    if (r == 0)
      throw InvalidArgument(fmt::format("checkpoint: '{}' ends before {} (truncated file)", path, what));
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

class Fd {
 public:
  Fd(const std::string& path, int flags, mode_t mode = 0644) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd_ < 0)
      throw InvalidArgument(fmt::format("checkpoint: cannot open '{}': {}", path, std::strerror(errno)));
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void sync() {
    if (::fsync(fd_) != 0)
      throw kernels::Error(fmt::format("checkpoint: fsync of '{}' failed: {}", path_, std::strerror(errno)));
  }
  void close_checked() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0)
      throw kernels::Error(fmt::format("checkpoint: closing '{}' failed: {}", path_, std::strerror(errno)));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

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

// Agreement after a phase that may fail on some ranks: every rank learns whether any failed and
// the message of the first that did (so every rank's exception names the key and the cause).
// Returns "" when all succeeded. Collective over world.
std::string agree(collectives::Communicator& world, const std::string& error, kernels::Device device) {
  std::vector<int64_t> flags = all_gather_rows(world, {error.empty() ? 0 : 1}, device);
  int first = -1;
  for (int r = 0; r < world.size() && first < 0; ++r)
    if (flags[static_cast<size_t>(r)] != 0) first = r;
  if (first < 0) return "";
  std::string failed;
  for (int r = 0; r < world.size(); ++r)
    if (flags[static_cast<size_t>(r)] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
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
  if (world.rank() == first) return error;
  return fmt::format("{} (on rank {}; failed on rank(s) {})", msg, first, failed);
}


Json value_to_json(const nn::StateValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) return *d;
  return std::get<std::string>(v);
}

}  // namespace

uint64_t xxh64(const void* data, size_t n, uint64_t seed) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const unsigned char* limit = end - 32;
    do {
      v1 = xround(v1, read64(p));
      v2 = xround(v2, read64(p + 8));
      v3 = xround(v3, read64(p + 16));
      v4 = xround(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = xmerge(h, v1);
    h = xmerge(h, v2);
    h = xmerge(h, v3);
    h = xmerge(h, v4);
  } else {
    h = seed + P5;
  }
  h += static_cast<uint64_t>(n);
  while (p + 8 <= end) {
    h ^= xround(0, read64(p));
    h = rotl(h, 27) * P1 + P4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  while (p < end) {
    h ^= static_cast<uint64_t>(*p) * P5;
    h = rotl(h, 11) * P1;
    ++p;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

const TensorInfo* Metadata::find(const std::string& key) const {
  for (const auto& [k, t] : tensors)
    if (k == key) return &t;
  return nullptr;
}

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
  std::vector<Tensor> staged;             // per plan chunk this rank owns (else undefined)
  std::vector<uint64_t> checksums;        // per plan chunk (rank 0: everyone's after the gather)
  std::thread writer;
  std::atomic<bool> done{false};
  std::string error;  // the writer's failure
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
  std::string error;
  try {
    st->plan = make_save_plan(sd, world.size());
    for (const auto& [k, t] : sd.tensors) st->tensor_info.push_back({k, {t.shape(), t.dtype()}});
    const auto& chunks = st->plan.chunks;
    st->staged.resize(chunks.size());
    st->checksums.assign(chunks.size(), 0);
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
      st->staged[i] = std::move(host);
    }
    if (rank == 0) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      // The old commit goes first: from here on the directory is incomplete until the new one.
      fs::remove(fs::path(dir) / kMetadataFile, ec);
      fs::remove(fs::path(dir) / (std::string(kMetadataFile) + kTmpSuffix), ec);
      if (fs::is_directory(dir))
        for (const auto& e : fs::directory_iterator(dir))
          if (e.path().extension() == ".safetensors" ||
              (e.path().extension() == kTmpSuffix && e.path().stem().extension() == ".safetensors"))
            fs::remove(e.path(), ec);  // data files, and those of a save killed midway
      if (!fs::is_directory(dir)) throw InvalidArgument(fmt::format("checkpoint: cannot create directory '{}'", dir));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // One gather: status, plan hash and this rank's checksums (the commit needs them all); also
  // the barrier after rank 0 cleared the directory.
  int64_t mine = 0;
  for (const auto& c : st->plan.chunks) mine += c.owner == rank;
  int64_t most = 0;
  {
    std::vector<int64_t> counts(world.size(), 0);
    for (const auto& c : st->plan.chunks) ++counts[c.owner];
    for (int64_t n : counts) most = std::max(most, n);
  }
  // Every rank must use the same row length: the plan's, or 0 chunks when planning failed
  // (then the hash differs as well and everyone raises).
  std::vector<int64_t> row(2 + static_cast<size_t>(most), 0);
  row[0] = error.empty() ? 0 : 1;
  row[1] = static_cast<int64_t>(st->plan.hash);
  {
    size_t j = 2;
    for (size_t i = 0; i < st->plan.chunks.size(); ++i)
      if (st->plan.chunks[i].owner == rank) row[j++] = static_cast<int64_t>(st->checksums[i]);
  }
  // Row lengths must agree before the gather: agree on the maximum first.
  std::vector<int64_t> lengths = all_gather_rows(world, {static_cast<int64_t>(row.size())}, st->device);
  const int64_t width = *std::max_element(lengths.begin(), lengths.end());
  row.resize(static_cast<size_t>(width), 0);
  std::vector<int64_t> all = all_gather_rows(world, row, st->device);
  const std::string agreed = agree(world, error, st->device);
  if (!agreed.empty()) throw InvalidArgument(agreed);
  for (int r = 0; r < world.size(); ++r)
    if (all[static_cast<size_t>(r) * width + 1] != static_cast<int64_t>(st->plan.hash))
      throw InvalidArgument(fmt::format(
          "checkpoint: save to '{}': rank {} passed a different state dict (keys, shapes, dtypes, placements or "
          "meshes) than rank {}",
          dir, r, rank));
  {
    std::vector<size_t> next(world.size(), 2);
    for (size_t i = 0; i < st->plan.chunks.size(); ++i) {
      const int o = st->plan.chunks[i].owner;
      st->checksums[i] = static_cast<uint64_t>(all[static_cast<size_t>(o) * width + next[o]++]);
    }
  }
  st->stats.stage_seconds = seconds_since(t0);
  // The background writer: this rank's files, no communication.
  SaveHandle::State* s = st.get();
  s->writer = std::thread([s, rank] {
    const auto t1 = std::chrono::steady_clock::now();
    try {
      for (const FilePlan& f : s->plan.files) {
        if (f.owner != rank) continue;
        // Written under a temporary name and renamed once whole: a save killed midway leaves no
        // truncated .safetensors file (one without the metadata file would read as a foreign
        // checkpoint with a broken file instead of as an incomplete save).
        const std::string final_path = (fs::path(s->dir) / f.name).string();
        const std::string path = final_path + kTmpSuffix;
        Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC);
        const uint64_t n = f.header.size();
        write_all(fd.get(), &n, 8, 0, path);
        write_all(fd.get(), f.header.data(), n, 8, path);
        for (size_t j = 0; j < f.chunks.size(); ++j) {
          const Tensor& t = s->staged[f.chunks[j]];
          if (t.nbytes() > 0) write_all(fd.get(), t.data_ptr(), t.nbytes(), f.offsets[j], path);
          s->stats.bytes_written += t.nbytes();
          s->staged[f.chunks[j]] = Tensor();  // free the staged copy as soon as it is written
        }
        if (s->options.fsync) fd.sync();
        fd.close_checked();
        if (::rename(path.c_str(), final_path.c_str()) != 0)
          throw kernels::Error(fmt::format("checkpoint: renaming '{}' failed: {}", path, std::strerror(errno)));
        ++s->stats.files;
      }
      if (s->options.fsync) sync_dir(s->dir);
    } catch (const std::exception& e) {
      s->error = e.what();
    }
    s->stats.write_seconds = seconds_since(t1);
    s->done = true;
  });
  SaveHandle h;
  SaveAccess::set(h, std::move(st));
  return h;
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
  const std::string agreed = agree(world, s.error, s.device);
  if (!agreed.empty()) throw kernels::Error(agreed + " (the checkpoint was not committed)");
  std::string commit_error;
  if (rank == 0) {
    try {
      Json meta = Json::object();
      meta["format"] = "dtensor-runtime-checkpoint";
      meta["version"] = 1;
      meta["world_size"] = world.size();
      meta["checksum"] = "xxh64";
      Json tensors = Json::object();
      for (const auto& [k, info] : s.tensor_info)
        tensors[k] = {{"shape", std::vector<int64_t>(info.first.begin(), info.first.end())},
                      {"dtype", nn::safetensors_dtype_name(info.second)},
                      {"chunks", Json::array()}};
      for (const FilePlan& f : s.plan.files)
        for (size_t j = 0; j < f.chunks.size(); ++j) {
          const PlannedChunk& c = s.plan.chunks[f.chunks[j]];
          tensors[s.tensor_info[c.key].first]["chunks"].push_back(
              {{"offsets", std::vector<int64_t>(c.box.offsets.begin(), c.box.offsets.end())},
               {"sizes", std::vector<int64_t>(c.box.sizes.begin(), c.box.sizes.end())},
               {"file", f.name},
               {"byte_offset", f.offsets[j]},
               {"nbytes", c.nbytes},
               {"xxh64", fmt::format("{:016x}", s.checksums[f.chunks[j]])}});
        }
      meta["tensors"] = std::move(tensors);
      Json files = Json::object();
      for (const FilePlan& f : s.plan.files) files[f.name] = f.size;
      meta["files"] = std::move(files);
      Json values = Json::object();
      for (const auto& [k, v] : s.values) values[k] = value_to_json(v);
      meta["values"] = std::move(values);
      const std::string text = meta.dump(1);
      const std::string final_path = (fs::path(s.dir) / kMetadataFile).string();
      const std::string tmp = final_path + kTmpSuffix;
      {
        Fd fd(tmp, O_WRONLY | O_CREAT | O_TRUNC);
        write_all(fd.get(), text.data(), text.size(), 0, tmp);
        if (s.options.fsync) fd.sync();
        fd.close_checked();
      }
      if (::rename(tmp.c_str(), final_path.c_str()) != 0)
        throw kernels::Error(fmt::format("checkpoint: renaming '{}' failed: {}", tmp, std::strerror(errno)));
      if (s.options.fsync) sync_dir(s.dir);
    } catch (const std::exception& e) {
      commit_error = e.what();
    }
  }
  const std::string committed = agree(world, commit_error, s.device);
  if (!committed.empty()) throw kernels::Error(committed);
  return s.stats;
}



// ---- metadata ----

namespace {

Dims json_dims(const nlohmann::json& j) {
  Dims d;
  for (const auto& v : j) d.push_back(v.get<int64_t>());
  return d;
}

struct SafetensorsHeader {
  nlohmann::json header;
  uint64_t data_start = 0;
  uint64_t file_size = 0;
};

SafetensorsHeader read_header(const std::string& path) {
  Fd fd(path, O_RDONLY);
  struct stat sb;
  if (::fstat(fd.get(), &sb) != 0) throw InvalidArgument(fmt::format("checkpoint: cannot stat '{}'", path));
  SafetensorsHeader h;
  h.file_size = static_cast<uint64_t>(sb.st_size);
  uint64_t n = 0;
  if (h.file_size < 8) throw InvalidArgument(fmt::format("checkpoint: '{}' is too short for a safetensors file", path));
  read_all(fd.get(), &n, 8, 0, path, "the header length");
  if (n > kMaxHeader || 8 + n > h.file_size)
    throw InvalidArgument(fmt::format("checkpoint: '{}' has an invalid safetensors header length {}", path, n));
  std::string text(n, '\0');
  read_all(fd.get(), text.data(), n, 8, path, "the header");
  try {
    h.header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' has a malformed safetensors header: {}", path, e.what()));
  }
  h.data_start = 8 + n;
  return h;
}

Metadata read_foreign(const std::string& dir, const std::vector<fs::path>& files) {
  Metadata md;
  md.foreign = true;
  std::map<std::string, size_t> index;
  for (const fs::path& p : files) {
    SafetensorsHeader h = read_header(p.string());
    nlohmann::json sharding;
    if (h.header.contains("__metadata__")) {
      const auto& m = h.header["__metadata__"];
      if (m.contains(kWriterKey))
        throw InvalidArgument(fmt::format(
            "checkpoint: '{}' is incomplete: it has data files but no {} (the save did not finish; load the "
            "previous checkpoint)",
            dir, kMetadataFile));
      if (m.contains("DCP_SHARDING_INFO")) sharding = nlohmann::json::parse(m["DCP_SHARDING_INFO"].get<std::string>());
    }
    for (auto it = h.header.begin(); it != h.header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      const std::string& key = it.key();
      ChunkInfo c;
      c.file = p.filename().string();
      c.sizes = json_dims((*it)["shape"]);
      c.offsets = sharding.contains(key) ? json_dims(sharding[key]["saved_offsets"])
                                         : Dims::filled(c.sizes.size(), 0);
      const DType dt = nn::parse_safetensors_dtype((*it)["dtype"].get<std::string>());
      const uint64_t b = (*it)["data_offsets"][0].get<uint64_t>(), e = (*it)["data_offsets"][1].get<uint64_t>();
      c.byte_offset = h.data_start + b;
      c.nbytes = e - b;
      if (e < b || h.data_start + e > h.file_size ||
          c.nbytes != static_cast<uint64_t>(c.sizes.product()) * kernels::itemsize(dt))
        throw InvalidArgument(fmt::format("checkpoint: '{}' in '{}' has data offsets [{}, {}] that do not fit its "
                                          "shape {} or the file",
                                          key, p.string(), b, e, c.sizes));
      if (c.offsets.size() != c.sizes.size())
        throw InvalidArgument(fmt::format("checkpoint: '{}' in '{}' has saved_offsets {} for shape {}", key,
                                          p.string(), c.offsets, c.sizes));
      auto found = index.find(key);
      if (found == index.end()) {
        index[key] = md.tensors.size();
        TensorInfo ti;
        ti.dtype = dt;
        ti.shape = Dims::filled(c.sizes.size(), 0);
        md.tensors.emplace_back(key, std::move(ti));
        found = index.find(key);
      }
      TensorInfo& ti = md.tensors[found->second].second;
      if (ti.dtype != dt || ti.shape.size() != c.sizes.size())
        throw InvalidArgument(fmt::format("checkpoint: '{}' has chunks of different dtypes or ranks in '{}'", key, dir));
      for (int d = 0; d < c.sizes.size(); ++d) ti.shape[d] = std::max(ti.shape[d], c.offsets[d] + c.sizes[d]);
      ti.chunks.push_back(std::move(c));
    }
  }
  return md;
}

}  // namespace

Metadata read_metadata(const std::string& dir) {
  if (!fs::is_directory(dir)) throw InvalidArgument(fmt::format("checkpoint: '{}' is not a directory", dir));
  const fs::path meta_path = fs::path(dir) / kMetadataFile;
  if (!fs::exists(meta_path)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    if (files.empty())
      throw InvalidArgument(fmt::format(
          "checkpoint: '{}' is not a checkpoint (or an incomplete one): no {} and no .safetensors files", dir,
          kMetadataFile));
    return read_foreign(dir, files);
  }
  Metadata md;
  Json j;  // ordered: the tensors keep their save order
  try {
    std::ifstream in(meta_path);
    j = Json::parse(in);
    if (j.value("format", "") != "dtensor-runtime-checkpoint")
      throw InvalidArgument(fmt::format("checkpoint: '{}' is not a dtensor-runtime checkpoint metadata file",
                                        meta_path.string()));
    for (auto it = j["files"].begin(); it != j["files"].end(); ++it) md.file_sizes[it.key()] = it->get<uint64_t>();
    for (auto it = j["tensors"].begin(); it != j["tensors"].end(); ++it) {
      TensorInfo ti;
      ti.shape = json_dims((*it)["shape"]);
      ti.dtype = nn::parse_safetensors_dtype((*it)["dtype"].get<std::string>());
      for (const auto& c : (*it)["chunks"]) {
        ChunkInfo ci;
        ci.offsets = json_dims(c["offsets"]);
        ci.sizes = json_dims(c["sizes"]);
        ci.file = c["file"].get<std::string>();
        ci.byte_offset = c["byte_offset"].get<uint64_t>();
        ci.nbytes = c["nbytes"].get<uint64_t>();
        if (c.contains("xxh64")) ci.checksum = std::stoull(c["xxh64"].get<std::string>(), nullptr, 16);
        if (ci.nbytes != static_cast<uint64_t>(ci.sizes.product()) * kernels::itemsize(ti.dtype) ||
            ci.offsets.size() != ti.shape.size() || ci.sizes.size() != ti.shape.size())
          throw InvalidArgument(fmt::format("checkpoint: '{}' lists a chunk of '{}' that does not fit its shape",
                                            meta_path.string(), it.key()));
        ti.chunks.push_back(std::move(ci));
      }
      md.tensors.emplace_back(it.key(), std::move(ti));
    }
    for (auto it = j["values"].begin(); it != j["values"].end(); ++it) {
      if (it->is_number_integer())
        md.values[it.key()] = it->get<int64_t>();
      else if (it->is_number())
        md.values[it.key()] = it->get<double>();
      else
        md.values[it.key()] = it->get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' is malformed: {}", meta_path.string(), e.what()));
  } catch (const std::invalid_argument& e) {
    throw InvalidArgument(fmt::format("checkpoint: '{}' is malformed: {}", meta_path.string(), e.what()));
  }
  // Every data file present with the size the commit recorded (a truncated or replaced file is
  // caught before any read).
  for (const auto& [name, size] : md.file_sizes) {
    std::error_code ec;
    const uint64_t got = fs::file_size(fs::path(dir) / name, ec);
    if (ec || got != size) {
      std::string key;
      for (const auto& [k, t] : md.tensors)
        for (const auto& c : t.chunks)
          if (c.file == name) key += fmt::format("{}'{}'", key.empty() ? "" : ", ", k);
      throw InvalidArgument(fmt::format("checkpoint: '{}': data file '{}' (holding {}) is {}; the "
                                        "metadata says {} bytes",
                                        dir, name, key, ec ? "missing" : fmt::format("{} bytes", got), size));
    }
  }
  return md;
}

// ---- load ----

namespace {

// Checks that a tensor's chunks tile its global shape: inside it, pairwise disjoint, and their
// volumes add up to the whole (so every element is saved exactly once).
void check_coverage(const std::string& dir, const std::string& key, const TensorInfo& ti) {
  const int nd = ti.shape.size();
  int64_t total = 0;
  for (const auto& c : ti.chunks) {
    for (int d = 0; d < nd; ++d)
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] + c.sizes[d] > ti.shape[d])
        throw InvalidArgument(fmt::format("checkpoint: '{}': a chunk of '{}' at {} size {} lies outside its shape {}",
                                          dir, key, c.offsets, c.sizes, ti.shape));
    total += c.sizes.product();
  }
  for (size_t a = 0; a < ti.chunks.size(); ++a)
    for (size_t b = a + 1; b < ti.chunks.size(); ++b) {
      bool overlap = true;
      for (int d = 0; d < nd; ++d) {
        const auto& x = ti.chunks[a];
        const auto& y = ti.chunks[b];
        if (std::max(x.offsets[d], y.offsets[d]) >= std::min(x.offsets[d] + x.sizes[d], y.offsets[d] + y.sizes[d]))
          overlap = false;
      }
      if (overlap && ti.chunks[a].sizes.product() > 0 && ti.chunks[b].sizes.product() > 0)
        throw InvalidArgument(fmt::format("checkpoint: '{}': chunks of '{}' at {} and {} overlap", dir, key,
                                          ti.chunks[a].offsets, ti.chunks[b].offsets));
    }
  if (total != ti.shape.product())
    throw InvalidArgument(fmt::format("checkpoint: '{}': the chunks of '{}' cover {} of its {} elements (missing data "
                                      "files?)",
                                      dir, key, total, ti.shape.product()));
}

struct FileCache {
  std::string dir;
  std::map<std::string, std::unique_ptr<Fd>> open;
  Fd& get(const std::string& name) {
    auto it = open.find(name);
    if (it == open.end())
      it = open.emplace(name, std::make_unique<Fd>((fs::path(dir) / name).string(), O_RDONLY)).first;
    return *it->second;
  }
};

// Reads the part `want` (global offsets/sizes, inside chunk c) of chunk c into a contiguous
// tensor of want's sizes, reading only its bytes (one pread per contiguous run in the file), or
// the whole chunk when verifying it.
// into: where the region goes (want_size, any strides); when it is contiguous the bytes are read
// straight into it (no extra buffer or copy) and it is returned.
Tensor read_region(FileCache& files, const std::string& key, const TensorInfo& ti, const ChunkInfo& c,
                   const Dims& want_off, const Dims& want_size, Verify verify, LoadStats& stats,
                   const Tensor& into = Tensor()) {
  const bool direct = into.defined() && into.is_contiguous() && into.device().is_cpu();
  const int nd = ti.shape.size();
  const uint64_t item = kernels::itemsize(ti.dtype);
  const bool whole = want_size == c.sizes;
  const std::string path = (fs::path(files.dir) / c.file).string();
  Fd& fd = files.get(c.file);
  const std::string what = fmt::format("'{}' chunk at {}", key, c.offsets);
  if (whole || (verify == Verify::kAll && c.checksum)) {
    Tensor buf = whole && direct ? into : Tensor::empty(c.sizes, ti.dtype);
    if (c.nbytes > 0) read_all(fd.get(), buf.data_ptr(), c.nbytes, c.byte_offset, path, what);
    stats.bytes_read += c.nbytes;
    ++stats.reads;
    if (verify != Verify::kNone && c.checksum && xxh64(buf.data_ptr(), c.nbytes) != *c.checksum)
      throw InvalidArgument(fmt::format("checkpoint: checksum mismatch in '{}': {} in '{}' is corrupt", files.dir,
                                        what, c.file));
    if (whole) return buf;
    Dims rel(want_off);
    for (int d = 0; d < nd; ++d) rel[d] = want_off[d] - c.offsets[d];
    return narrow_box(buf, rel, want_size).contiguous();
  }
  // Partial: the innermost dims where want spans the whole chunk form one contiguous run with
  // the next outer dim's extent.
  Tensor out = direct ? into : Tensor::empty(want_size, ti.dtype);
  int inner = nd;  // dims [inner, nd) are whole
  while (inner > 0 && want_size[inner - 1] == c.sizes[inner - 1]) --inner;
  int64_t run_elems = 1;
  for (int d = inner; d < nd; ++d) run_elems *= c.sizes[d];
  int outer_dims = inner;  // dims [0, outer_dims) iterate; dim inner-1 contributes its extent to the run
  if (inner > 0) {
    run_elems *= want_size[inner - 1];
    outer_dims = inner - 1;
  }
  Dims cstride = Tensor::contiguous_strides(c.sizes);
  Dims idx = Dims::filled(outer_dims, 0);
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t total = out.numel();
  for (int64_t done = 0; done < total; done += run_elems) {
    int64_t elem = 0;
    for (int d = 0; d < outer_dims; ++d) elem += (want_off[d] - c.offsets[d] + idx[d]) * cstride[d];
    if (inner > 0) elem += (want_off[inner - 1] - c.offsets[inner - 1]) * cstride[inner - 1];
    read_all(fd.get(), dst, static_cast<uint64_t>(run_elems) * item, c.byte_offset + static_cast<uint64_t>(elem) * item,
             path, what);
    stats.bytes_read += static_cast<uint64_t>(run_elems) * item;
    ++stats.reads;
    dst += run_elems * static_cast<int64_t>(item);
    for (int d = outer_dims - 1; d >= 0; --d) {
      if (++idx[d] < want_size[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace

LoadStats load(const std::string& dir, nn::StateDict& sd, collectives::Communicator& world,
               const LoadOptions& options) {
  LoadStats stats;
  const int rank = world.rank();
  const kernels::Device device = comm_device(sd);
  std::vector<Tensor> staged(sd.tensors.size());
  std::map<std::string, nn::StateValue> values;
  std::string error;
  try {
    const Metadata md = read_metadata(dir);
    std::set<std::string> wanted;
    for (const auto& [key, t] : sd.tensors) {
      wanted.insert(key);
      const TensorInfo* ti = md.find(key);
      if (!ti) throw InvalidArgument(fmt::format("checkpoint: '{}' has no tensor '{}' (missing key)", dir, key));
      if (!(ti->shape == t.shape()))
        throw InvalidArgument(fmt::format("checkpoint: '{}': '{}' was saved with shape {}, the target has shape {}", dir,
                                          key, ti->shape, t.shape()));
      if (ti->dtype != t.dtype())
        throw InvalidArgument(fmt::format("checkpoint: '{}': '{}' was saved as {}, the target is {}", dir, key,
                                          nn::safetensors_dtype_name(ti->dtype) ? nn::safetensors_dtype_name(ti->dtype) : "?",
                                          kernels::to_string(t.dtype())));
      check_coverage(dir, key, *ti);
    }
    values = md.values;
    FileCache files{dir, {}};
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
      const TensorInfo& ti = *md.find(key);
      const Tensor& local = t.to_local();
      Tensor stage = Tensor::empty(local.shape(), t.dtype());
      auto layout = t.spec().layout(t.comms()->rank());
      for (const Box& b : boxes_of(*layout, t.shape())) {
        stats.bytes_needed += static_cast<uint64_t>(b.sizes.product()) * kernels::itemsize(t.dtype());
        for (const ChunkInfo& c : ti.chunks) {
          Dims lo(b.offsets), sz(b.sizes);
          bool any = true;
          for (int d = 0; d < b.offsets.size(); ++d) {
            lo[d] = std::max(b.offsets[d], c.offsets[d]);
            const int64_t hi = std::min(b.offsets[d] + b.sizes[d], c.offsets[d] + c.sizes[d]);
            if (hi <= lo[d]) any = false;
            sz[d] = hi - lo[d];
          }
          if (!any) continue;
          Dims at(lo);
          for (int d = 0; d < at.size(); ++d) at[d] = b.local[d] + lo[d] - b.offsets[d];
          Tensor dst = narrow_box(stage, at, sz);
          Tensor region = read_region(files, key, ti, c, lo, sz, options.verify, stats, dst);
          if (region.data_ptr() != dst.data_ptr()) dst.copy_(region);
        }
      }
      staged[k] = std::move(stage);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Agreement: nothing is written unless every rank read everything.
  const std::string agreed = agree(world, error, device);
  if (!agreed.empty()) throw InvalidArgument(agreed + "; nothing was changed");
  (void)rank;
  for (size_t k = 0; k < sd.tensors.size(); ++k) {
    if (!staged[k].defined()) continue;
    Tensor local = sd.tensors[k].second.to_local();
    local.copy_(staged[k].device() == local.device() ? staged[k] : staged[k].to(local.device()));
  }
  sd.values = std::move(values);
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
    check_coverage(dir, key, ti);
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
  std::vector<std::string> written;
  Json weight_map = Json::object();
  uint64_t total = 0;
  FileCache files{dir, {}};
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
    Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC);
    const uint64_t n = text.size();
    write_all(fd.get(), &n, 8, 0, path);
    write_all(fd.get(), text.data(), n, 8, path);
    uint64_t pos = 8 + n;
    for (size_t i : groups[g]) {
      const Item& it = items[i];
      Tensor full = Tensor::empty(it.ti->shape, it.ti->dtype);
      for (const ChunkInfo& c : it.ti->chunks) {
        if (c.nbytes == 0) continue;
        Tensor part = read_region(files, *it.key, *it.ti, c, c.offsets, c.sizes, Verify::kChunksReadWhole, stats);
        Tensor dst = narrow_box(full, c.offsets, c.sizes);
        dst.copy_(part);
      }
      if (it.nbytes > 0) write_all(fd.get(), full.data_ptr(), it.nbytes, pos, path);
      pos += it.nbytes;
    }
    fd.sync();
    fd.close_checked();
    written.push_back(path);
  }
  if (groups.size() > 1) {
    Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string path = (fs::path(out_dir) / "model.safetensors.index.json").string();
    std::ofstream out(path);
    out << index.dump(2);
    if (!out) throw kernels::Error(fmt::format("checkpoint: writing '{}' failed", path));
    written.push_back(path);
  }
  return written;
}

}  // namespace checkpoint
