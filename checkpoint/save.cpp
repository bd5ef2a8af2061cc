// checkpoint::save and async_save: each rank plans and writes its own chunks (save_plan.h),
// rank 0 commits checkpoint.json from what the ranks report.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal.h"
#include "checkpoint/save_plan.h"
#include "checkpoint/shared.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/format.h"
#include "nn/safetensors.h"

namespace checkpoint {

namespace fs = std::filesystem;
using kernels::InvalidArgument;
using kernels::Tensor;
using Json = nlohmann::ordered_json;
using namespace detail;

namespace {

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

namespace {

// What a rank reports of its files to rank 0, as int64s (rank 0 writes checkpoint.json from it):
//   nfiles, then per file (slot order): size, nchunks, then per chunk: key, ndim, offsets, sizes,
//   byte_offset, nbytes, xxh64, block ndim, block_shape, nblocks, the blocks' xxh64.
struct ReportedChunk {
  size_t key = 0;
  Dims offsets, sizes, block_shape;
  uint64_t byte_offset = 0, nbytes = 0, checksum = 0;
  std::vector<uint64_t> block_sums;
};
struct ReportedFile {
  std::string name;
  uint64_t size = 0;
  std::vector<ReportedChunk> chunks;
};

}  // namespace


struct SaveHandle::State {
  std::string dir;
  collectives::Communicator* world = nullptr;
  kernels::Device device;
  SaveOptions options;
  SavePlan plan;
  std::vector<std::string> keys;
  std::vector<std::pair<std::string, std::pair<Dims, DType>>> tensor_info;
  std::map<std::string, nn::StateValue> values;
  std::vector<Tensor> staged;                     // per chunk of this rank's plan
  std::vector<uint64_t> checksums;                // per chunk of this rank's plan
  std::vector<std::vector<uint64_t>> block_sums;  // per chunk of this rank's plan: its blocks'
  std::vector<ReportedFile> reported;             // rank 0: every rank's files, in rank order
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

void append_report(const SaveHandle::State& s, std::vector<int64_t>& row) {
  auto dims = [&](const Dims& d) { row.insert(row.end(), d.begin(), d.end()); };
  row.push_back(static_cast<int64_t>(s.plan.files.size()));
  for (const FilePlan& f : s.plan.files) {
    row.push_back(static_cast<int64_t>(f.size));
    row.push_back(static_cast<int64_t>(f.chunks.size()));
    for (size_t j = 0; j < f.chunks.size(); ++j) {
      const PlannedChunk& c = s.plan.chunks[f.chunks[j]];
      row.push_back(static_cast<int64_t>(c.key));
      row.push_back(c.box.offsets.size());
      dims(c.box.offsets);
      dims(c.box.sizes);
      row.push_back(static_cast<int64_t>(f.offsets[j]));
      row.push_back(static_cast<int64_t>(c.nbytes));
      row.push_back(static_cast<int64_t>(s.checksums[f.chunks[j]]));
      row.push_back(c.block_shape.size());
      dims(c.block_shape);
      row.push_back(static_cast<int64_t>(s.block_sums[f.chunks[j]].size()));
      for (uint64_t h : s.block_sums[f.chunks[j]]) row.push_back(static_cast<int64_t>(h));
    }
  }
}

// Rank 0: appends rank r's files from its report (append_report's layout) to s.reported.
void read_report(std::span<const int64_t> row, int r, SaveHandle::State& s) {
  size_t at = 0;
  auto next = [&]() -> int64_t {
    if (at >= row.size()) throw kernels::InternalError(fmt::format("checkpoint: rank {}'s report is truncated", r));
    return row[at++];
  };
  auto dims = [&](int64_t n) {
    Dims d;
    d.resize(static_cast<int>(n));
    for (int i = 0; i < d.size(); ++i) d[i] = next();
    return d;
  };
  const int64_t nfiles = next();
  for (int64_t slot = 0; slot < nfiles; ++slot) {
    ReportedFile f;
    f.name = file_name(r, static_cast<int>(slot), static_cast<int>(nfiles));
    f.size = static_cast<uint64_t>(next());
    const int64_t nchunks = next();
    for (int64_t j = 0; j < nchunks; ++j) {
      ReportedChunk c;
      c.key = static_cast<size_t>(next());
      const int64_t nd = next();
      c.offsets = dims(nd);
      c.sizes = dims(nd);
      c.byte_offset = static_cast<uint64_t>(next());
      c.nbytes = static_cast<uint64_t>(next());
      c.checksum = static_cast<uint64_t>(next());
      c.block_shape = dims(next());
      c.block_sums.resize(static_cast<size_t>(next()));
      for (uint64_t& h : c.block_sums) h = static_cast<uint64_t>(next());
      if (c.key >= s.tensor_info.size())
        throw kernels::InternalError(fmt::format("checkpoint: rank {} reported key index {}", r, c.key));
      f.chunks.push_back(std::move(c));
    }
    s.reported.push_back(std::move(f));
  }
}

// This rank's files, written by the background thread (no communication).
void write_files(SaveHandle::State& s, int rank) {
  (void)rank;
  for (const FilePlan& f : s.plan.files) {
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
    st->plan = make_local_save_plan(specs_of(sd), rank, world.size(), options.block_bytes);
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
      const Tensor& local = sd.tensors[c.key].second.to_local();
      Tensor view = c.nbytes == 0 ? Tensor::empty(c.box.sizes, local.dtype()) : box_view(local, c.box);
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
  // One gather: status, plan hash, and this rank's report of its files and chunks (rank 0 writes
  // the commit from the reports, as PyTorch's DCP gathers the local plans); also the barrier after
  // rank 0 cleared the directory. Row of rank r: kind, hash, then report_row's fields.
  std::vector<int64_t> row = {error.kind, static_cast<int64_t>(st->plan.hash)};
  if (error.kind == kOk) append_report(*st, row);
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
  if (rank == 0)
    for (int r = 0; r < world.size(); ++r)
      read_report(std::span<const int64_t>(all).subspan(static_cast<size_t>(r) * width + 2, width - 2), r, *st);
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

// checkpoint.json (README "On disk"): chunks in file order (rank, then slot).
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
  for (const ReportedFile& f : s.reported)
    for (const ReportedChunk& c : f.chunks) {
      Json chunk = {{"offsets", std::vector<int64_t>(c.offsets.begin(), c.offsets.end())},
                    {"sizes", std::vector<int64_t>(c.sizes.begin(), c.sizes.end())},
                    {"file", f.name},
                    {"byte_offset", c.byte_offset},
                    {"nbytes", c.nbytes},
                    {"xxh64", hex64(c.checksum)}};
      if (!c.block_sums.empty()) {
        std::string blocks;
        blocks.reserve(c.block_sums.size() * 16);
        for (uint64_t h : c.block_sums) blocks += hex64(h);
        chunk["block_shape"] = std::vector<int64_t>(c.block_shape.begin(), c.block_shape.end());
        chunk["block_xxh64"] = std::move(blocks);
      }
      tensors[s.tensor_info[c.key].first]["chunks"].push_back(std::move(chunk));
    }
  meta["tensors"] = std::move(tensors);
  Json files = Json::object();
  for (const ReportedFile& f : s.reported) files[f.name] = f.size;
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

}  // namespace checkpoint
