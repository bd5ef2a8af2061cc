// checkpoint-bench: save and load throughput of checkpoint/ as a fraction of the disk's
// sequential bandwidth measured in the same run, the time training is blocked by an
// asynchronous save, and the bytes a resharded load reads against what the new shards need.
//
//   checkpoint-bench --dir /tmp/ckbench --size-mib 512 --world 4 --repeats 3
//
// Per repeat (medians reported): (1) disk baselines: one file of the same size written
// sequentially in 64 MiB pwrites + fsync, then read back cold (page cache dropped for the file
// with posix_fadvise DONTNEED), and the same with `world` threads on `world` files (the
// checkpoint writes one file per rank in parallel); (2) a synchronous save of a state dict of
// --tensors f32 tensors sharded S(0) over `world` ranks (local backend: ranks are threads),
// fsync included; (3) an asynchronous save: the time async_save() blocks the caller, and until
// wait() returns; (4) a load under the same layout, cold; (5) resharded loads (S(0) over world
// -> S(1) over world, -> S(0) over world-1) with their bytes read / bytes needed.
// Output: one line per measurement and, last, one JSON object.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "kernels/error.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The bytes a load read over the bytes it needed, summed over the ranks (collective).
double read_over_needed_all(const checkpoint::LoadStats& st, collectives::Communicator& w) {
  kernels::Tensor b = kernels::Tensor::full({2}, 0, kernels::DType::kF64);
  b.set_item({0}, static_cast<double>(st.bytes_read));
  b.set_item({1}, static_cast<double>(st.bytes_needed));
  w.wait(w.all_reduce(b, b, collectives::Reduction(collectives::ReduceOp::kSum)));
  return b.item({0}) / b.item({1});
}

using program::median;

void drop_cache(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void drop_cache_dir(const fs::path& d) {
  for (const auto& e : fs::recursive_directory_iterator(d))
    if (e.is_regular_file()) drop_cache(e.path());
}

// Writes `bytes` to `path` sequentially in 64 MiB blocks, then fsync.
void write_file(const fs::path& path, const std::vector<char>& block, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw kernels::Error(fmt::format("cannot open {}", path.string()));
  uint64_t off = 0;
  while (off < bytes) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(block.size(), bytes - off));
    if (::pwrite(fd, block.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n))
      throw kernels::Error("short write");
    off += n;
  }
  ::fsync(fd);
  ::close(fd);
}

void read_file(const fs::path& path, std::vector<char>& block) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw kernels::Error(fmt::format("cannot open {}", path.string()));
  uint64_t off = 0;
  for (;;) {
    const ssize_t r = ::pread(fd, block.data(), block.size(), static_cast<off_t>(off));
    if (r <= 0) break;
    off += static_cast<uint64_t>(r);
  }
  ::close(fd);
}

// Runs fn(i) on `n` threads and returns the wall time.
double parallel(int n, const std::function<void(int)>& fn) {
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i) ts.emplace_back(fn, i);
  for (auto& t : ts) t.join();
  return secs(t0);
}

}  // namespace

int main(int argc, char** argv) {
  return program::run("checkpoint-bench", [&]() -> int {
  std::string dir = "/tmp/checkpoint-bench";
  int64_t size_mib = 512;
  int world = 4, repeats = 3, tensors = 16;
  bool fsync = true;
  CLI::App app("checkpoint-bench: checkpoint save/load throughput vs the disk's sequential bandwidth");
  app.add_option("--dir", dir, "scratch directory (removed at the end)");
  app.add_option("--size-mib", size_mib, "state dict size in MiB")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--world", world, "ranks (threads)")->check(CLI::Range(2, 256));
  app.add_option("--repeats", repeats, "repeats (medians)")->check(CLI::Range(1, 1000));
  app.add_option("--tensors", tensors, "tensors in the state dict")->check(CLI::Range(1, 4096));
  app.add_option("--fsync", fsync, "fsync data and metadata (true|false)");
  program::parse(app, argc, argv);
  {
    if (world < 2 || size_mib < 1 || repeats < 1 || tensors < 1)
      throw kernels::InvalidArgument("--world >= 2, --size-mib >= 1, --repeats >= 1, --tensors >= 1");
    const fs::path root(dir);
    fs::remove_all(root);
    fs::create_directories(root);
    // Tensor shape: rows divisible by world * (world - 1) so every layout is even; cols 1024.
    const int64_t cols = 1024;
    const int64_t unit = static_cast<int64_t>(world) * (world - 1);
    int64_t rows = std::max<int64_t>(unit, (size_mib << 20) / 4 / cols / tensors / unit * unit);
    const uint64_t total = static_cast<uint64_t>(rows * cols * 4 * tensors);
    std::vector<char> block(64 << 20, 'x');
    std::map<std::string, std::vector<double>> m;
    checkpoint::SaveOptions so;
    so.fsync = fsync;
    for (int rep = 0; rep < repeats; ++rep) {
      // (1) baselines
      {
        const fs::path f = root / "seq.bin";
        auto t0 = Clock::now();
        write_file(f, block, total);
        m["disk_write_1"].push_back(total / secs(t0));
        drop_cache(f);
        t0 = Clock::now();
        read_file(f, block);
        m["disk_read_1"].push_back(total / secs(t0));
        fs::remove(f);
        std::vector<std::vector<char>> blocks(world, std::vector<char>(16 << 20, 'y'));
        const double tw = parallel(world, [&](int i) {
          write_file(root / fmt::format("par{}.bin", i), blocks[i], total / world);
        });
        m["disk_write_par"].push_back(total / tw);
        for (int i = 0; i < world; ++i) drop_cache(root / fmt::format("par{}.bin", i));
        const double tr = parallel(world, [&](int i) { read_file(root / fmt::format("par{}.bin", i), blocks[i]); });
        m["disk_read_par"].push_back(total / tr);
        for (int i = 0; i < world; ++i) fs::remove(root / fmt::format("par{}.bin", i));
      }
      // (2)-(5) checkpoints
      const fs::path ck = root / "ck", ck_async = root / "ck-async";
      collectives::run_ranks(world, [&](collectives::Communicator& w) {
        auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({world}), w);
        nn::StateDict sd;
        for (int k = 0; k < tensors; ++k)
          sd.tensors.emplace_back(fmt::format("layers.{}.weight", k),
                                  dtensor::full({rows, cols}, 0.25 + k, kernels::DType::kF32, comms,
                                                dtensor::parse_placements("S(0)")));
        auto barrier = [&] { w.wait(w.barrier()); };
        barrier();
        auto t0 = Clock::now();
        checkpoint::save(ck.string(), sd, w, so);
        barrier();
        const double save_s = secs(t0);
        // Async with a staging cache: the first save allocates it (cold), the second reuses it
        // (what every later save of a training run sees).
        checkpoint::SaveOptions ao = so;
        ao.staging = std::make_shared<checkpoint::StagingCache>();
        double blocked_cold = 0, blocked = 0, async_total = 0;
        for (int i = 0; i < 2; ++i) {
          barrier();
          t0 = Clock::now();
          checkpoint::SaveHandle h = checkpoint::async_save(ck_async.string(), sd, w, ao);
          (i == 0 ? blocked_cold : blocked) = secs(t0);
          h.wait();
          barrier();
          if (i == 1) async_total = secs(t0);
        }
        if (w.rank() == 0) drop_cache_dir(ck);
        barrier();
        nn::StateDict target;
        for (int k = 0; k < tensors; ++k)
          target.tensors.emplace_back(fmt::format("layers.{}.weight", k),
                                      dtensor::zeros({rows, cols}, kernels::DType::kF32, comms,
                                                     dtensor::parse_placements("S(0)")));
        t0 = Clock::now();
        checkpoint::load(ck.string(), target, w);
        barrier();
        const double load_s = secs(t0);
        // Resharded: S(0) -> S(1) on the same ranks.
        if (w.rank() == 0) drop_cache_dir(ck);
        nn::StateDict cols_target;
        for (int k = 0; k < tensors; ++k)
          cols_target.tensors.emplace_back(fmt::format("layers.{}.weight", k),
                                           dtensor::zeros({rows, cols}, kernels::DType::kF32, comms,
                                                          dtensor::parse_placements("S(1)")));
        barrier();
        t0 = Clock::now();
        const checkpoint::LoadStats st = checkpoint::load(ck.string(), cols_target, w);
        barrier();
        const double reshard_s = secs(t0);
        const double read_over_needed = read_over_needed_all(st, w);
        if (w.rank() == 0) {
          m["save"].push_back(total / save_s);
          m["async_blocked_s"].push_back(blocked);
          m["async_blocked_first_s"].push_back(blocked_cold);
          m["async_total"].push_back(total / async_total);
          m["sync_save_s"].push_back(save_s);
          m["load"].push_back(total / load_s);
          m["reshard_s0_to_s1"].push_back(total / reshard_s);
          m["reshard_read_over_needed"].push_back(read_over_needed);
        }
      });
      // S(0) over world -> S(0) over world - 1 (a smaller job).
      drop_cache_dir(ck);
      collectives::run_ranks(world - 1, [&](collectives::Communicator& w) {
        auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({world - 1}), w);
        nn::StateDict target;
        for (int k = 0; k < tensors; ++k)
          target.tensors.emplace_back(fmt::format("layers.{}.weight", k),
                                      dtensor::zeros({rows, cols}, kernels::DType::kF32, comms,
                                                     dtensor::parse_placements("S(0)")));
        w.wait(w.barrier());
        auto t0 = Clock::now();
        const checkpoint::LoadStats st = checkpoint::load(ck.string(), target, w);
        w.wait(w.barrier());
        const double s = secs(t0);
        const double read_over_needed = read_over_needed_all(st, w);
        if (w.rank() == 0) {
          m["reshard_world_minus_1"].push_back(total / s);
          m["reshard_smaller_read_over_needed"].push_back(read_over_needed);
        }
      });
      fs::remove_all(ck);
      fs::remove_all(ck_async);
    }
    fs::remove_all(root);
    auto med = [&](const std::string& k) { return median(m[k]); };
    const double gib = 1024.0 * 1024 * 1024;
    const double wbase = std::max(med("disk_write_1"), med("disk_write_par"));
    const double rbase = std::max(med("disk_read_1"), med("disk_read_par"));
    fmt::print("state dict {:.0f} MiB in {} tensors [{}, {}] f32, S(0) over {} ranks; {} repeats (medians); fsync {}\n",
               total / 1048576.0, tensors, rows, cols, world, repeats, fsync);
    fmt::print("disk write: 1 stream {:.2f} GiB/s, {} streams {:.2f} GiB/s\n", med("disk_write_1") / gib, world,
               med("disk_write_par") / gib);
    fmt::print("disk read (cold): 1 stream {:.2f} GiB/s, {} streams {:.2f} GiB/s\n", med("disk_read_1") / gib, world,
               med("disk_read_par") / gib);
    fmt::print("save (sync)      {:.2f} GiB/s = {:.2f} of the better disk write\n", med("save") / gib,
               med("save") / wbase);
    fmt::print("save (async)     {:.2f} GiB/s until committed = {:.2f}; caller blocked {:.3f} s = {:.2f} of a sync "
               "save (first save, cache cold: {:.3f} s)\n",
               med("async_total") / gib, med("async_total") / wbase, med("async_blocked_s"),
               med("async_blocked_s") / med("sync_save_s"), med("async_blocked_first_s"));
    fmt::print("load (same layout, cold) {:.2f} GiB/s = {:.2f} of the better disk read\n", med("load") / gib,
               med("load") / rbase);
    fmt::print("load S(0)x{} -> S(1)x{} (cold) {:.2f} GiB/s; bytes read / needed {:.3f}\n", world, world,
               med("reshard_s0_to_s1") / gib, med("reshard_read_over_needed"));
    fmt::print("load S(0)x{} -> S(0)x{} (cold) {:.2f} GiB/s = {:.2f} of the better disk read; bytes read / needed "
               "{:.3f}\n",
               world, world - 1, med("reshard_world_minus_1") / gib, med("reshard_world_minus_1") / rbase,
               med("reshard_smaller_read_over_needed"));
    nlohmann::ordered_json j;
    j["bytes"] = total;
    j["world"] = world;
    j["repeats"] = repeats;
    for (const auto& [k, v] : m) j[k] = med(k);
    j["save_fraction"] = med("save") / wbase;
    j["async_fraction"] = med("async_total") / wbase;
    j["load_fraction"] = med("load") / rbase;
    j["async_blocked_fraction"] = med("async_blocked_s") / med("sync_save_s");
    fmt::print("{}\n", j.dump());
    return 0;
  }
  });
}
