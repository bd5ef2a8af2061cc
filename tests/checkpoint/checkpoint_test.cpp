// Distributed checkpoints: every saved layout loads bit-identically under every other (meshes
// of 1..4 ranks; Shard, uneven, nested, StridedShard, Replicate, HSDP, FSDP x TP), reading
// exactly the bytes the new shards need; module and optimizer state round trips across
// tensor-parallel degrees and FSDP-like placements; corruption, truncation, incomplete and
// incompatible checkpoints fail naming the key and change nothing; async save snapshots;
// export to consolidated safetensors.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal.h"
#include "kernels/file_io.h"
#include "collectives/local.h"
#include "kernels/format.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "layouts.h"
#include "support/checks.h"
#include "support/local_mesh.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;
using checkpoint_tests::Layout;
using checkpoint_tests::layouts;
using testing_support::on_mesh;

namespace {

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir : testing_support::TempDir {
  explicit TempDir(const std::string& tag) : testing_support::TempDir("ckpt-test", tag) {}
};

struct TensorCase {
  std::string key;
  Dims shape;
  DType dtype;
};

const std::vector<TensorCase>& tensor_cases() {
  static const std::vector<TensorCase> t = {
      {"blocks.0.w", {13, 7}, DType::kF32},   // uneven everywhere
      {"blocks.0.v", {16, 12}, DType::kF32},  // even
      {"emb.bf16", {9, 6}, DType::kBF16},
      {"bias", {5}, DType::kF32},
      {"ids", {10}, DType::kI64},
  };
  return t;
}

// The state dict of layout `l` on `comms`: element values a function of (key, global index).
nn::StateDict make_sd(const Layout& l, const std::shared_ptr<const MeshComms>& comms, uint64_t salt) {
  nn::StateDict sd;
  uint64_t i = 0;
  for (const TensorCase& c : tensor_cases()) {
    const Placements p = dtensor::parse_placements(c.shape.size() == 2 ? l.placements2d : l.placements1d);
    DTensor t = dtensor::rand(c.shape, salt * 100 + i++, DType::kF32, comms, p);
    if (c.dtype != DType::kF32) {
      // Casts of the same global values: exact for bf16's rounding and integers alike.
      Tensor local = t.to_local().to(DType::kF64);
      std::vector<double> v = local.to_vector();
      for (double& x : v) x = c.dtype == DType::kI64 ? std::floor(x * 1e6) : x;
      dtensor::DTensorSpec spec = t.spec();
      spec.dtype = c.dtype;
      t = DTensor(comms, spec, Tensor::from_vector(v, local.shape(), c.dtype));
    }
    sd.tensors.emplace_back(c.key, t);
  }
  sd.values["train.step"] = int64_t{int64_t(salt)};
  sd.values["lr"] = 0.5;
  sd.values["name"] = std::string("run-") + std::to_string(salt);
  return sd;
}

bool same_local(const DTensor& a, const DTensor& b) {
  const Tensor& x = a.to_local();
  const Tensor& y = b.to_local();
  if (!(x.shape() == y.shape()) || x.dtype() != y.dtype()) return false;
  const Tensor cx = x.contiguous(), cy = y.contiguous();
  return cx.nbytes() == 0 || std::memcmp(cx.data_ptr(), cy.data_ptr(), cx.nbytes()) == 0;
}

// The GPT of the module tests: one layer, 16 wide.
nn::GPTConfig tiny_gpt() {
  nn::GPTConfig cfg;
  cfg.vocab = 16;
  cfg.dim = 16;
  cfg.heads = 4;
  cfg.layers = 1;
  cfg.max_seq = 8;
  return cfg;
}

void save_layout(const Layout& l, const std::string& dir, uint64_t salt, checkpoint::SaveOptions options = {}) {
  on_mesh(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    checkpoint::save(dir, make_sd(l, comms, salt), world, options);
  });
}

}  // namespace

TEST_CASE("checkpoint: xxh64 matches the reference values", "[checkpoint]") {
  CHECK(checkpoint::xxh64("", 0) == 0xEF46DB3751D8E999ull);
  CHECK(checkpoint::xxh64("a", 1) == 0xD24EC4F1A98C6E5Bull);
  const std::string s = "Nobody inspects the spammish repetition";
  CHECK(checkpoint::xxh64(s.data(), s.size()) == 0xFBCEA83C8A378BF1ull);
}

TEST_CASE("checkpoint: every layout loads bit-identically under every other, reading only what it needs",
          "[checkpoint]") {
  // Blocks of 32 bytes (8 f32, 4 i64): the test tensors (a few hundred bytes) have block
  // checksums, so resharded loads verify partial reads by blocks.
  TempDir tmp("reshard");
  const auto& ls = layouts();
  checkpoint::SaveOptions blocks;
  blocks.block_bytes = 32;
  for (size_t s = 0; s < ls.size(); ++s) save_layout(ls[s], tmp.str(ls[s].name), s + 1, blocks);
  int pairs = 0;
  testing_support::Checks checks;
  std::mutex mu;
  uint64_t read = 0, needed = 0;
  for (size_t s = 0; s < ls.size(); ++s)
    for (const Layout& dst : ls) {
      on_mesh(dst.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        const nn::StateDict expected = make_sd(dst, comms, s + 1);
        // kNone reads exactly the bytes needed; the default (kRead) reads whole blocks, checked.
        for (checkpoint::Verify v : {checkpoint::Verify::kNone, checkpoint::Verify::kRead}) {
          nn::StateDict target = make_sd(dst, comms, 999);  // other values: must all be overwritten
          checkpoint::LoadOptions o;
          o.verify = v;
          const checkpoint::LoadStats st = checkpoint::load(tmp.str(ls[s].name), target, world, o);
          for (size_t i = 0; i < target.tensors.size(); ++i)
            checks.check(same_local(target.tensors[i].second, expected.tensors[i].second),
                         fmt::format("{} -> {}: rank {} '{}' differs", ls[s].name, dst.name, world.rank(),
                                     target.tensors[i].first));
          if (v == checkpoint::Verify::kNone) {
            checks.check(st.bytes_read == st.bytes_needed,
                         fmt::format("{} -> {}: rank {} read {} bytes for {} needed (kNone)", ls[s].name, dst.name,
                                     world.rank(), st.bytes_read, st.bytes_needed));
          } else {
            checks.check(st.bytes_read >= st.bytes_needed,
                         fmt::format("{} -> {}: rank {} read {} bytes for {} needed", ls[s].name, dst.name,
                                     world.rank(), st.bytes_read, st.bytes_needed));
            std::lock_guard lk(mu);
            read += st.bytes_read;
            needed += st.bytes_needed;
          }
          checks.check(target.int_value("train.step") == int64_t(s + 1) && target.double_value("lr") == 0.5 &&
                           std::get<std::string>(target.values.at("name")) == "run-" + std::to_string(s + 1),
                       fmt::format("{} -> {}: values", ls[s].name, dst.name));
        }
      });
      ++pairs;
    }
  checks.report();
  CHECK(pairs == static_cast<int>(ls.size() * ls.size()));
  // The blocks' margin over the 100 pairs (each tensor a few rows of blocks: a coarse grid).
  const double ratio = static_cast<double>(read) / static_cast<double>(needed);
  fmt::print("reshard matrix with 32-byte blocks: bytes read / needed = {:.3f} ({} / {})\n", ratio, read, needed);
  CHECK(ratio < 1.6);
}

TEST_CASE("checkpoint: the layout on disk (one chunk per key per file, replicas written once, strided shards "
          "as several boxes)",
          "[checkpoint]") {
  TempDir tmp("layout");
  const Layout hsdp = layouts()[4];     // R,S(0) on 2x2: two replicas of each shard
  const Layout strided = layouts()[9];  // _S(0,2) over 4: each rank holds two row blocks
  save_layout(hsdp, tmp.str("hsdp"), 1);
  save_layout(strided, tmp.str("strided"), 1);
  const checkpoint::Metadata a = checkpoint::read_metadata(tmp.str("hsdp"));
  const checkpoint::Metadata b = checkpoint::read_metadata(tmp.str("strided"));
  // HSDP: a 16-row tensor is saved as 2 chunks (not 4), and the writes are spread: both
  // replica groups write.
  const auto* v = a.find("blocks.0.v");
  REQUIRE(v);
  CHECK(v->chunks.size() == 2);
  std::set<std::string> writers;
  for (const auto& [k, t] : a.tensors)
    for (const auto& c : t.chunks) writers.insert(c.file.substr(0, 11));
  CHECK(writers.size() == 4);  // all four ranks wrote something
  // Strided: 16 rows over 4 ranks, each rank's rows are 2 boxes of 2 -> 8 chunks, in 2 files per rank.
  const auto* sv = b.find("blocks.0.v");
  REQUIRE(sv);
  CHECK(sv->chunks.size() == 8);
  for (const auto& c : sv->chunks) CHECK(c.sizes == Dims{2, 12});
  std::set<std::string> files;
  for (const auto& c : sv->chunks) files.insert(c.file);
  CHECK(files.size() == 8);  // one chunk per key per file
  CHECK(fs::exists(tmp.path / "strided" / "shard-00001-model-00002-of-00002.safetensors"));
  // Every file is a valid safetensors file whose entries PyTorch's reader maps by saved_offsets.
  int checked = 0;
  for (const auto& e : fs::directory_iterator(tmp.path / "strided")) {
    if (e.path().extension() != ".safetensors") continue;
    std::map<std::string, std::string> meta;
    nn::NamedTensors ts = nn::load_safetensors(e.path().string(), &meta);
    CHECK(meta.count("DCP_SHARDING_INFO") == 1);
    CHECK(meta["format"] == "pt");
    CHECK(!ts.empty());
    ++checked;
  }
  CHECK(checked == 8);
}

TEST_CASE("checkpoint: module and optimizer state round trip across tensor-parallel and FSDP-like layouts",
          "[checkpoint]") {
  const nn::GPTConfig cfg = tiny_gpt();
  TempDir tmp("module");
  std::map<std::string, std::vector<double>> saved;  // full values of params and state (rank 0)
  std::mutex mu;
  // Source: TP over 2 ranks, two AdamW steps.
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
    nn::parallelize_module(model, 0, nn::gpt_tensor_parallel_plan(cfg, true, true));
    nn::materialize(model, 3);
    kernels::AdamWOptions o;
    o.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), o);
    nn::CrossEntropyLoss loss_fn;
    const auto mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    for (int step = 0; step < 2; ++step) {
      Tensor ids = Tensor::empty({2, 8}, DType::kI64), tg = Tensor::empty({2, 8}, DType::kI64);
      for (int64_t i = 0; i < 16; ++i) {
        ids.data<int64_t>()[i] = (i * 5 + step) % 16;
        tg.data<int64_t>()[i] = (i * 3 + 1) % 16;
      }
      auto rep = [&](const Tensor& t) {
        return DTensor(comms, dtensor::make_spec(mesh, dtensor::parse_placements("R"), t.shape(), t.dtype()), t);
      };
      nn::Ctx ctx, lctx;
      DTensor logits = model.forward(ctx, rep(ids));
      loss_fn.forward(lctx, logits, rep(tg));
      model.backward(ctx, loss_fn.backward(lctx, rep(Tensor::full({}, 1.0, DType::kF64))));
      nn::reduce_gradients(model.named_parameters());
      opt.step();
      opt.zero_grad();
    }
    nn::StateDict sd = model.state_dict();
    sd.merge(opt.state_dict(), "optim.");
    sd.values["train.step"] = int64_t{2};
    checkpoint::save(tmp.str("tp2"), sd, world);
    nn::for_each_full_tensor(sd, true, [&](const std::string& k, const Tensor& t) {
      std::lock_guard lk(mu);
      saved[k] = t.to_vector();
    });
  });
  const size_t n_params = [&] {
    size_t n = 0;
    for (const auto& [k, v] : saved) n += k.rfind("optim.", 0) != 0;
    return n;
  }();
  REQUIRE(n_params > 5);
  REQUIRE(saved.size() == 3 * n_params);  // params, exp_avg, exp_avg_sq

  struct Target {
    std::string name;
    Dims mesh;
    int tp;             // 0: no TP; parameters moved to `fsdp` placements instead
    std::string fsdp;   // placements for every parameter when tp == 0
  };
  const std::vector<Target> targets = {{"tp4", {4}, 4, ""},
                                       {"one", {1}, 1, ""},
                                       {"fsdp3", {3}, 0, "S(0)"},
                                       {"hsdp2x2", {2, 2}, 0, "R,S(0)"}};
  testing_support::Checks checks;
  int ran = 0;
  for (const Target& t : targets) {
    on_mesh(t.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::GPT model(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
      if (t.tp > 1) nn::parallelize_module(model, 0, nn::gpt_tensor_parallel_plan(cfg, true, true));
      if (t.tp == 0)
        for (auto& [n, p] : model.named_parameters())
          p->set_placements(dtensor::parse_placements(t.fsdp));
      nn::materialize(model, 77);  // other weights: the load must replace them
      kernels::AdamWOptions o;
      nn::AdamW opt(model.named_parameters(), o);
      opt.init_state();
      nn::StateDict target = model.state_dict();
      target.merge(opt.state_dict(), "optim.");
      checkpoint::load(tmp.str("tp2"), target, world);
      opt.load_state_dict(target.sub("optim."));
      checks.check(target.int_value("train.step") == 2, t.name + ": train.step");
      for (const auto& [n, p] : model.named_parameters())
        checks.check(opt.step_count(n) == 2, fmt::format("{}: step of {} is {}", t.name, n, opt.step_count(n)));
      nn::StateDict after = model.state_dict();
      after.merge(opt.state_dict(), "optim.");
      int compared = 0;
      nn::for_each_full_tensor(after, true, [&](const std::string& k, const Tensor& full) {
        auto it = saved.find(k);
        checks.check(it != saved.end() && it->second == full.to_vector(),
                     fmt::format("{}: '{}' is not bit-identical after the round trip", t.name, k));
        ++compared;
      });
      if (comms->coord() == Dims::filled(t.mesh.size(), 0))
        checks.check(compared == static_cast<int>(saved.size()),
                     fmt::format("{}: compared {} of {}", t.name, compared, saved.size()));
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == 4);
}

TEST_CASE("checkpoint: corrupt, truncated, incomplete and incompatible checkpoints fail naming the key and change "
          "nothing",
          "[checkpoint]") {
  TempDir tmp("safety");
  const Layout fsdp4 = layouts()[0];
  save_layout(fsdp4, tmp.str("good"), 5);
  auto copy_dir = [&](const std::string& name) {
    fs::copy(tmp.path / "good", tmp.path / name, fs::copy_options::recursive);
    return tmp.str(name);
  };
  const checkpoint::Metadata md = checkpoint::read_metadata(tmp.str("good"));
  const checkpoint::ChunkInfo w_chunk = md.find("blocks.0.w")->chunks.at(1);  // rank 1's rows of w

  // Expects the load into layout `l` to throw with every string of `needles` in the message, and
  // every tensor unchanged on every rank.
  testing_support::Checks checks;
  int cases = 0;
  auto expect_failure = [&](const std::string& dir, const Layout& l, std::vector<std::string> needles,
                            checkpoint::LoadOptions options = {},
                            std::function<void(nn::StateDict&)> edit = nullptr) {
    ++cases;
    on_mesh(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::StateDict target = make_sd(l, comms, 42);
      if (edit) edit(target);
      std::vector<Tensor> before;
      for (const auto& [k, t] : target.tensors) before.push_back(t.to_local().clone());
      try {
        checkpoint::load(dir, target, world, options);
        checks.add(fmt::format("{}: rank {}: no exception", dir, world.rank()));
      } catch (const kernels::InvalidArgument& e) {
        // The rank that met the problem names it; the others say which rank failed.
        const std::string msg = e.what();
        const bool names = std::all_of(needles.begin(), needles.end(),
                                       [&](const std::string& n) { return msg.find(n) != std::string::npos; });
        checks.check(names || msg.find("failed on rank") != std::string::npos,
                     fmt::format("{}: rank {}: message '{}' lacks '{}'", dir, world.rank(), msg, needles.front()));
      }
      for (size_t i = 0; i < before.size(); ++i) {
        const Tensor now = target.tensors[i].second.to_local().contiguous();
        checks.check(before[i].nbytes() == 0 ||
                         std::memcmp(before[i].data_ptr(), now.data_ptr(), before[i].nbytes()) == 0,
                     fmt::format("{}: rank {}: '{}' changed by a failed load", dir, world.rank(),
                                 target.tensors[i].first));
      }
    });
  };

  // A flipped byte inside rank 1's chunk of w: the checksum names the key; only rank 1 (and in
  // fsdp3, ranks overlapping it) meets it, the others learn it failed, nothing changes anywhere.
  {
    const std::string dir = copy_dir("corrupt");
    std::fstream f(fs::path(dir) / w_chunk.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(w_chunk.byte_offset + 5));
    char c = 0;
    f.seekg(static_cast<std::streamoff>(w_chunk.byte_offset + 5));
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(w_chunk.byte_offset + 5));
    f.write(&c, 1);
    f.close();
    expect_failure(dir, fsdp4, {"checksum", "blocks.0.w"});
    checkpoint::LoadOptions all;
    all.verify = checkpoint::Verify::kAll;
    expect_failure(dir, layouts()[2], {"checksum", "blocks.0.w"}, all);  // resharded: partial chunks
  }
  // A truncated data file: caught from the metadata's file sizes before reading.
  {
    const std::string dir = copy_dir("truncated");
    fs::resize_file(fs::path(dir) / w_chunk.file, w_chunk.byte_offset + 4);
    expect_failure(dir, fsdp4, {"blocks.0", w_chunk.file});
  }
  // Incomplete: the save never committed.
  {
    const std::string dir = copy_dir("incomplete");
    fs::remove(fs::path(dir) / checkpoint::kMetadataFile);
    expect_failure(dir, fsdp4, {"incomplete"});
    CHECK_THROWS_WITH(checkpoint::read_metadata(dir), Catch::Contains("incomplete"));
  }
  // Incompatible targets.
  expect_failure(tmp.str("good"), fsdp4, {"blocks.0.v", "shape"}, {}, [](nn::StateDict& sd) {
    DTensor& v = *sd.find("blocks.0.v");
    v = dtensor::zeros(Dims{16, 11}, DType::kF32, v.comms(), v.placements());
  });
  expect_failure(tmp.str("good"), fsdp4, {"blocks.0.v", "F32"}, {}, [](nn::StateDict& sd) {
    DTensor& v = *sd.find("blocks.0.v");
    v = dtensor::zeros(v.shape(), DType::kF64, v.comms(), v.placements());
  });
  expect_failure(tmp.str("good"), fsdp4, {"blocks.0.extra", "missing"}, {}, [](nn::StateDict& sd) {
    DTensor v = *sd.find("blocks.0.v");
    sd.tensors.emplace_back("blocks.0.extra", v);
  });
  expect_failure(tmp.str("good"), fsdp4, {"bias", "unexpected"}, {}, [](nn::StateDict& sd) {
    sd.tensors.erase(std::remove_if(sd.tensors.begin(), sd.tensors.end(), [](auto& e) { return e.first == "bias"; }),
                     sd.tensors.end());
  });
  expect_failure(tmp.str("nonexistent"), fsdp4, {"not a directory"});
  checks.report();
  CHECK(cases == 9);

  // Non-strict: the unexpected key is skipped.
  on_mesh({4}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict target = make_sd(fsdp4, comms, 42);
    target.tensors.pop_back();
    checkpoint::LoadOptions o;
    o.strict = false;
    checkpoint::load(tmp.str("good"), target, world, o);
  });
  // A Partial tensor cannot be saved.
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict sd;
    const auto mesh = std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
    sd.tensors.emplace_back("p", DTensor(comms, dtensor::make_spec(mesh, dtensor::parse_placements("P"), Dims{4}, DType::kF32),
                                         Tensor::zeros({4}, DType::kF32)));
    checks.throws<kernels::InvalidArgument>([&] { checkpoint::save(tmp.str("partial"), sd, world); }, "Partial",
                                            "partial save");
  });
  checks.report();
}

TEST_CASE("checkpoint: async save snapshots the state; training may change it before wait()", "[checkpoint]") {
  TempDir tmp("async");
  const Layout l = layouts()[5];
  testing_support::Checks checks;
  on_mesh(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict sd = make_sd(l, comms, 7);
    checkpoint::SaveHandle h = checkpoint::async_save(tmp.str("a"), sd, world);
    for (auto& [k, t] : sd.tensors) {
      Tensor local = t.to_local();
      local.fill_(0.0);  // "training" overwrites the parameters
    }
    checks.check(h.wait().files >= 1, fmt::format("async: rank {} wrote no file", world.rank()));
    // A staging cache: reused by the next saves (same buffers), refused while a save uses it.
    checkpoint::SaveOptions o;
    o.staging = std::make_shared<checkpoint::StagingCache>();
    nn::StateDict second = make_sd(l, comms, 9);
    checkpoint::SaveHandle h1 = checkpoint::async_save(tmp.str("b"), second, world, o);
    checks.throws<kernels::InvalidArgument>([&] { checkpoint::async_save(tmp.str("c"), second, world, o); },
                                            "staging cache", "a busy staging cache");
    h1.wait();
    std::vector<const void*> first_buffers;
    for (const Tensor& b : o.staging->buffers) first_buffers.push_back(b.data_ptr());
    checks.check(!first_buffers.empty(), "the staging cache holds buffers");
    checkpoint::async_save(tmp.str("b"), make_sd(l, comms, 10), world, o).wait();
    for (size_t i = 0; i < first_buffers.size() && i < o.staging->buffers.size(); ++i)
      checks.check(o.staging->buffers[i].data_ptr() == first_buffers[i], "the staging buffers were reused");
    for (auto [sub, salt] : {std::pair{"a", 7}, std::pair{"b", 10}}) {
      nn::StateDict target = make_sd(l, comms, 8);
      checkpoint::load(tmp.str(sub), target, world);
      const nn::StateDict expected = make_sd(l, comms, salt);
      for (size_t i = 0; i < target.tensors.size(); ++i)
        checks.check(same_local(target.tensors[i].second, expected.tensors[i].second),
                     fmt::format("async {}: rank {} '{}' is not the state at save time", sub, world.rank(),
                                 target.tensors[i].first));
    }
  });
  checks.report();
}

TEST_CASE("checkpoint: export writes consolidated safetensors (one file, or several with the HF index)",
          "[checkpoint]") {
  TempDir tmp("export");
  const Layout l = layouts()[9];
  save_layout(l, tmp.str("ck"), 3);
  std::map<std::string, Tensor> full;
  std::mutex mu;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    for (const auto& [k, t] : make_sd(layouts()[3], comms, 3).tensors) {
      std::lock_guard lk(mu);
      full[k] = t.to_local().clone();
    }
  });
  auto files = checkpoint::export_safetensors(tmp.str("ck"), tmp.str("one"));
  REQUIRE(files.size() == 1);
  nn::NamedTensors ts = nn::load_safetensors(files[0]);
  REQUIRE(ts.size() == full.size());
  for (const auto& [k, t] : ts) {
    const Tensor& e = full.at(k);
    CHECK(t.dtype() == e.dtype());
    CHECK(t.shape() == e.shape());
    CHECK(std::memcmp(t.data_ptr(), e.data_ptr(), e.nbytes()) == 0);
  }
  checkpoint::ExportOptions o;
  o.prefix = "blocks.0.";
  o.max_file_bytes = 400;
  files = checkpoint::export_safetensors(tmp.str("ck"), tmp.str("many"), o);
  REQUIRE(files.size() == 3);  // w (364 B) and v (768 B) in two files, plus the index
  CHECK(fs::path(files.back()).filename() == "model.safetensors.index.json");
  std::ifstream in(files.back());
  const auto index = nlohmann::json::parse(in);
  CHECK(index["weight_map"]["w"] == "model-00001-of-00002.safetensors");
  CHECK(index["weight_map"]["v"] == "model-00002-of-00002.safetensors");
  CHECK(nn::load_safetensors(files[1])[0].first == "v");
}

TEST_CASE("state dicts: Module / Optimizer load_state_dict check everything before writing", "[checkpoint][nn]") {
  const nn::GPTConfig cfg = tiny_gpt();
  testing_support::Checks checks;
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    nn::GPT a(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);
    nn::parallelize_module(a, 0, nn::gpt_tensor_parallel_plan(cfg, true, true));
    nn::materialize(a, 1);
    nn::GPT b(nn::ModuleOptions{comms, DType::kF32, {}}, cfg);  // replicated: other placements
    nn::materialize(b, 2);
    auto fulls = [](const nn::Module& m) {
      std::vector<std::vector<double>> out;
      nn::for_each_full_tensor(m.state_dict(), false, [&](const std::string&, const Tensor& t) {
        out.push_back(t.to_vector());
      });
      return out;
    };
    const auto before = fulls(b);
    // A missing key, an unexpected one, a wrong shape: refused, nothing written.
    nn::StateDict sd = a.state_dict();
    nn::StateDict missing = sd;
    missing.tensors.pop_back();
    checks.throws<kernels::InvalidArgument>([&] { b.load_state_dict(missing); }, sd.tensors.back().first,
                                            "missing key");
    nn::StateDict extra = sd;
    extra.tensors.emplace_back("blocks.9.w", sd.tensors[0].second);
    checks.throws<kernels::InvalidArgument>([&] { b.load_state_dict(extra); }, "unexpected key 'blocks.9.w'",
                                            "unexpected key");
    nn::StateDict wrong = sd;
    wrong.tensors[1].second = dtensor::zeros(Dims{3, 3}, DType::kF32, comms, dtensor::parse_placements("R"));
    checks.throws<kernels::InvalidArgument>([&] { b.load_state_dict(wrong); }, sd.tensors[1].first, "shape");
    checks.check(fulls(b) == before, "a refused load_state_dict changed parameters");
    b.load_state_dict(extra, /*strict=*/false);  // redistributes TP shards onto replicated parameters
    checks.check(fulls(b) == fulls(a), "load_state_dict across placements differs");
    // Optimizer: state keyed by name; a step without its tensors is refused.
    nn::AdamW opt(b.named_parameters(), kernels::AdamWOptions{});
    nn::StateDict osd;
    osd.values["state.tok_emb.weight.step"] = int64_t{3};
    checks.throws<kernels::InvalidArgument>([&] { opt.load_state_dict(osd); }, "state.tok_emb.weight.exp_avg",
                                            "optimizer missing tensor");
    osd.values.erase("state.tok_emb.weight.step");
    osd.values["state.nope.step"] = int64_t{1};
    checks.throws<kernels::InvalidArgument>([&] { opt.load_state_dict(osd); }, "unexpected key 'state.nope.step'",
                                            "optimizer unexpected key");
    checks.check(opt.state_dict().tensors.empty() && opt.state_dict().values.empty(),
                 "a refused optimizer load created state");
  });
  checks.report();
}

// ---- issue 32: verified partial reads, hostile metadata, many chunks, files and write errors ----

namespace {

// A full tensor whose element i is f(key, i) (exact in f32), distributed with `placements`.
DTensor indexed(const std::shared_ptr<MeshComms>& comms, const Dims& shape, int key, const std::string& placements) {
  Tensor full = Tensor::empty(shape, DType::kF32);
  float* p = full.data<float>();
  for (int64_t i = 0; i < shape.product(); ++i) p[i] = static_cast<float>((i % 4096) * 0.25 + key);
  return dtensor::distribute_tensor(full, comms, dtensor::parse_placements(placements), std::nullopt);
}

nlohmann::ordered_json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::ordered_json::parse(in);
}

void write_json(const fs::path& p, const nlohmann::ordered_json& j) {
  std::ofstream out(p, std::ios::trunc);
  out << j.dump(1);
}

// Flips one bit of the byte at `byte` of the file.
void flip_byte(const fs::path& file, uint64_t byte) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  char c = 0;
  f.seekg(static_cast<std::streamoff>(byte));
  f.read(&c, 1);
  c ^= 0x08;
  f.seekp(static_cast<std::streamoff>(byte));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("checkpoint: block shapes and block boxes", "[checkpoint]") {
  using checkpoint::detail::choose_block_shape;
  CHECK(choose_block_shape({4096, 4096}, 4, 65536) == Dims{128, 128});
  CHECK(choose_block_shape({1366, 4096}, 4, 65536) == Dims{128, 128});
  CHECK(choose_block_shape({512, 512}, 4, 65536) == Dims{32, 32});
  CHECK(choose_block_shape({100000}, 4, 65536) == Dims{1024});
  CHECK(choose_block_shape({1024}, 4, 65536).empty());
  CHECK(choose_block_shape({4096, 4096}, 4, 0).empty());
  CHECK(choose_block_shape({0, 4096}, 4, 65536).empty());
  CHECK(choose_block_shape({3, 5}, 8, 4) == Dims{1, 1});  // a block smaller than an element: one element
  // The grid is anchored at the origin: a chunk at rows [100, 300) with 128-row blocks meets
  // blocks 0..2, the first clipped to [100, 128), the last to [256, 300).
  const auto r = checkpoint::detail::block_range({100, 0}, {200, 64}, {128, 64});
  CHECK(r.first == Dims{0, 0});
  CHECK(r.count == Dims{3, 1});
  Dims off, size;
  checkpoint::detail::block_box({0, 0}, {100, 0}, {200, 64}, {128, 64}, off, size);
  CHECK((off == Dims{100, 0} && size == Dims{28, 64}));
  checkpoint::detail::block_box({2, 0}, {100, 0}, {200, 64}, {128, 64}, off, size);
  CHECK((off == Dims{256, 0} && size == Dims{44, 64}));
  // Runs of a box inside a buffer (the file reads and the block hashes both use them).
  std::vector<std::pair<int64_t, int64_t>> runs;
  checkpoint::detail::for_each_run({4, 6}, {1, 2}, {2, 3}, [&](int64_t e, int64_t n) { runs.emplace_back(e, n); });
  CHECK(runs == std::vector<std::pair<int64_t, int64_t>>{{8, 3}, {14, 3}});
  runs.clear();
  checkpoint::detail::for_each_run({4, 6}, {1, 0}, {2, 6}, [&](int64_t e, int64_t n) { runs.emplace_back(e, n); });
  CHECK(runs == std::vector<std::pair<int64_t, int64_t>>{{6, 12}});
}

TEST_CASE("checkpoint: a resharded load verifies the blocks it reads (default options), reading close to what it "
          "needs; older checkpoints without blocks read whole chunks",
          "[checkpoint]") {
  // One rank saves w [256, 64] and v [96, 40] (f32, 64 KiB and 15 KiB) with 4 KiB blocks: w's
  // blocks are [32, 32], and so are v's (clipped to its 40 columns).
  TempDir tmp("blocks");
  checkpoint::SaveOptions so;
  so.block_bytes = 4096;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict sd;
    sd.tensors.emplace_back("w", indexed(comms, {256, 64}, 1, "R"));
    sd.tensors.emplace_back("v", indexed(comms, {96, 40}, 2, "R"));
    checkpoint::save(tmp.str("good"), sd, world, so);
  });
  const checkpoint::Metadata md = checkpoint::read_metadata(tmp.str("good"));
  REQUIRE(md.find("w")->chunks.size() == 1);
  const checkpoint::ChunkInfo w = md.find("w")->chunks[0];
  CHECK(w.block_shape == Dims{32, 32});
  CHECK(w.block_checksums.size() == 16);
  CHECK(md.find("v")->chunks[0].block_shape == Dims{32, 32});

  struct Target {
    std::string name;
    Dims mesh;
    std::string placements;
  };
  const std::vector<Target> targets = {{"fsdp3", {3}, "S(0)"}, {"tp2-rowwise", {2}, "S(1)"},
                                       {"fsdp2xtp2", {2, 2}, "S(0),S(1)"}, {"fsdp4", {4}, "S(0)"}};
  testing_support::Checks checks;
  std::mutex mu;
  // Loads `dir` under each target: bit-identical (or, when needles are given, refused on every
  // rank naming them with nothing changed); returns bytes read / needed over all targets.
  auto load_all = [&](const std::string& dir, const std::vector<std::string>& needles, const std::string& tag) {
    uint64_t read = 0, needed = 0;
    int loads = 0;
    for (const Target& t : targets) {
      on_mesh(t.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        nn::StateDict target, expected;
        target.tensors.emplace_back("w", dtensor::zeros(Dims{256, 64}, DType::kF32, comms,
                                                        dtensor::parse_placements(t.placements)));
        target.tensors.emplace_back("v", dtensor::zeros(Dims{96, 40}, DType::kF32, comms,
                                                        dtensor::parse_placements(t.placements)));
        expected.tensors.emplace_back("w", indexed(comms, {256, 64}, 1, t.placements));
        expected.tensors.emplace_back("v", indexed(comms, {96, 40}, 2, t.placements));
        try {
          const checkpoint::LoadStats st = checkpoint::load(dir, target, world);
          checks.check(needles.empty(), fmt::format("{} -> {}: rank {}: no exception", tag, t.name, world.rank()));
          for (size_t i = 0; i < 2; ++i)
            checks.check(same_local(target.tensors[i].second, expected.tensors[i].second),
                         fmt::format("{} -> {}: rank {} '{}' differs", tag, t.name, world.rank(),
                                     target.tensors[i].first));
          std::lock_guard lk(mu);
          read += st.bytes_read;
          needed += st.bytes_needed;
        } catch (const kernels::InvalidArgument& e) {
          const std::string msg = e.what();
          bool names = !needles.empty();
          for (const std::string& n : needles) names = names && msg.find(n) != std::string::npos;
          checks.check(names || (!needles.empty() && msg.find("failed on rank") != std::string::npos),
                       fmt::format("{} -> {}: rank {}: '{}'", tag, t.name, world.rank(), msg));
          for (const auto& [k, v] : target.tensors)
            checks.check([&] {
                           const std::vector<double> x = v.to_local().to_vector();
                           return std::all_of(x.begin(), x.end(), [](double e) { return e == 0.0; });
                         }(),
                         fmt::format("{} -> {}: rank {}: '{}' changed by a failed load", tag, t.name, world.rank(), k));
        }
      });
      ++loads;
    }
    CHECK(loads == static_cast<int>(targets.size()));
    return needed ? static_cast<double>(read) / static_cast<double>(needed) : 0.0;
  };
  const double ratio = load_all(tmp.str("good"), {}, "good");
  fmt::print("block-verified reshard of a one-rank save (4 KiB blocks): bytes read / needed = {:.3f}\n", ratio);
  CHECK(ratio > 1.0);   // blocks the boxes cut are read whole...
  CHECK(ratio < 1.25);  // ...but not the whole chunks (kAll: 2 to 4 here)

  // One flipped byte, in element (200, 50) of w: every resharded load meets it (it is inside a
  // block some rank reads) and fails on every rank, naming the key and the block.
  auto copy_dir = [&](const std::string& name) {
    fs::copy(tmp.path / "good", tmp.path / name, fs::copy_options::recursive);
    return tmp.path / name;
  };
  const fs::path bad = copy_dir("bad");
  flip_byte(bad / w.file, w.byte_offset + (200 * 64 + 50) * 4 + 1);
  load_all(bad.string(), {"checksum mismatch", "'w'", "block at [192,32] size [32,32]"}, "corrupt");

  // An older checkpoint (no block checksums): a partial read reads the whole chunk to check it.
  const fs::path old = copy_dir("old");
  nlohmann::ordered_json j = read_json(old / "checkpoint.json");
  for (auto& [k, t] : j["tensors"].items())
    for (auto& c : t["chunks"]) {
      c.erase("block_shape");
      c.erase("block_xxh64");
    }
  write_json(old / "checkpoint.json", j);
  CHECK(checkpoint::read_metadata(old.string()).find("w")->chunks[0].block_checksums.empty());
  const double old_ratio = load_all(old.string(), {}, "old");
  CHECK(old_ratio > 1.9);  // every rank reads both chunks whole
  flip_byte(old / w.file, w.byte_offset + (200 * 64 + 50) * 4 + 1);
  load_all(old.string(), {"checksum mismatch", "'w'"}, "old corrupt");
  checks.report();
}

TEST_CASE("checkpoint: hostile checkpoint.json values fail naming the file, the tensor and the field", "[checkpoint]") {
  TempDir tmp("hostile");
  const Layout one = layouts()[3];
  save_layout(one, tmp.str("good"), 4);
  struct Case {
    std::string name;
    std::function<void(nlohmann::ordered_json&)> edit;
    std::vector<std::string> needles;
  };
  auto chunk0 = [](nlohmann::ordered_json& j) -> nlohmann::ordered_json& { return j["tensors"]["blocks.0.w"]["chunks"][0]; };
  const std::vector<Case> cases = {
      // The offset of issue 32: offset + size overflows int64; once passed the coverage check.
      {"offset-max", [&](auto& j) { chunk0(j)["offsets"][0] = int64_t{9223372036854775807}; },
       {"blocks.0.w", "lies outside its shape"}},
      {"offset-negative", [&](auto& j) { chunk0(j)["offsets"][0] = -1; }, {"blocks.0.w", "chunk 0", "'offsets' is -1"}},
      {"size-u64", [&](auto& j) { chunk0(j)["sizes"][0] = uint64_t{18446744073709551615ull}; },
       {"blocks.0.w", "'sizes' is 18446744073709551615"}},
      {"byte-offset-overflow", [&](auto& j) { chunk0(j)["byte_offset"] = int64_t{9223372036854775807}; },
       {"blocks.0.w", "byte_offset + nbytes"}},
      {"past-file-end", [&](auto& j) { chunk0(j)["byte_offset"] = 1000000; }, {"blocks.0.w", "past the end"}},
      {"nbytes", [&](auto& j) { chunk0(j)["nbytes"] = 4; }, {"blocks.0.w", "'nbytes' is 4"}},
      {"xxh64-malformed", [&](auto& j) { chunk0(j)["xxh64"] = "zz"; }, {"blocks.0.w", "'xxh64' is \"zz\""}},
      {"xxh64-number", [&](auto& j) { chunk0(j)["xxh64"] = 12; }, {"blocks.0.w", "'xxh64' is 12"}},
      {"xxh64-long", [&](auto& j) { chunk0(j)["xxh64"] = "00112233445566778"; }, {"blocks.0.w", "'xxh64'"}},
      {"shape-overflow", [&](auto& j) { j["tensors"]["blocks.0.w"]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; },
       {"blocks.0.w", "element count overflows"}},
      {"file-escape", [&](auto& j) { chunk0(j)["file"] = "../checkpoint.json"; }, {"blocks.0.w", "not a plain file name"}},
      {"file-unlisted", [&](auto& j) { chunk0(j)["file"] = "other.safetensors"; }, {"blocks.0.w", "not listed"}},
      {"file-size-negative", [&](auto& j) { j["files"].begin().value() = -5; }, {"'size' is -5"}},
      {"block-count", [&](auto& j) { chunk0(j)["block_shape"] = {1, 1}; chunk0(j)["block_xxh64"] = "00"; },
       {"blocks.0.w", "'block_xxh64' holds 2 characters"}},
      {"block-zero", [&](auto& j) { chunk0(j)["block_shape"] = {0, 1}; chunk0(j)["block_xxh64"] = ""; },
       {"blocks.0.w", "'block_shape' is 0"}},
      {"value-u64", [&](auto& j) { j["values"]["train.step"] = uint64_t{18446744073709551615ull}; },
       {"train.step", "18446744073709551615"}},
      {"value-object", [&](auto& j) { j["values"]["train.step"] = nlohmann::ordered_json::object(); }, {"train.step"}},
      {"tensors-array", [&](auto& j) { j["tensors"] = nlohmann::ordered_json::array(); }, {"'tensors' is []"}},
      {"dtype", [&](auto& j) { j["tensors"]["blocks.0.w"]["dtype"] = "F128"; }, {"blocks.0.w", "F128"}},
  };
  testing_support::Checks checks;
  int ran = 0;
  for (const Case& c : cases) {
    fs::copy(tmp.path / "good", tmp.path / c.name, fs::copy_options::recursive);
    const fs::path meta = tmp.path / c.name / "checkpoint.json";
    nlohmann::ordered_json j = read_json(meta);
    c.edit(j);
    write_json(meta, j);
    on_mesh(one.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::StateDict target = make_sd(one, comms, 42);
      try {
        checkpoint::load(tmp.str(c.name), target, world);
        checks.add(c.name + ": no exception");
      } catch (const kernels::InvalidArgument& e) {
        const std::string msg = e.what();
        for (const std::string& n : c.needles)
          checks.check(msg.find(n) != std::string::npos, fmt::format("{}: '{}' lacks '{}'", c.name, msg, n));
      }
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == static_cast<int>(cases.size()));
}

TEST_CASE("checkpoint: the coverage check of 300,000 chunks is O(n log n) and still finds overlaps and gaps",
          "[checkpoint]") {
  using checkpoint::ChunkInfo;
  using checkpoint::TensorInfo;
  auto chunk = [](Dims off, Dims size) {
    ChunkInfo c;
    c.offsets = off;
    c.sizes = size;
    return c;
  };
  // A grid of 500 x 600 chunks of [2, 3] over [1000, 1800], listed in a scrambled order.
  TensorInfo grid;
  grid.shape = {1000, 1800};
  for (int64_t k = 0; k < 300000; ++k) {
    const int64_t i = (k * 7919) % 300000;  // 7919 is prime to 300000: a permutation
    grid.chunks.push_back(chunk({(i / 600) * 2, (i % 600) * 3}, {2, 3}));
  }
  REQUIRE(grid.chunks.size() == 300000);
  checkpoint::detail::check_coverage("grid", "g", grid);
  // Issue 32's case: one key, 300,000 empty chunks (and the one holding the data).
  TensorInfo empties;
  empties.shape = {64, 8};
  empties.chunks.push_back(chunk({0, 0}, {64, 8}));
  for (int64_t k = 0; k < 300000; ++k) empties.chunks.push_back(chunk({k % 64, 0}, {0, 8}));
  checkpoint::detail::check_coverage("empties", "e", empties);
  // 300,000 row chunks of a 1-D-split tensor (FSDP over many ranks).
  TensorInfo rows;
  rows.shape = {300000, 4};
  for (int64_t k = 299999; k >= 0; --k) rows.chunks.push_back(chunk({k, 0}, {1, 4}));
  checkpoint::detail::check_coverage("rows", "r", rows);
  // Broken grids (each edit undone after its check): a chunk moved onto its neighbour (an
  // overlap and a gap), an extra chunk, one moved out of the shape, one with an overflowing
  // offset, one missing.
  int broken = 0;
  auto expect = [&](const TensorInfo& ti, const std::string& needle) {
    CHECK_THROWS_WITH(checkpoint::detail::check_coverage("grid", "g", ti), Catch::Contains(needle));
    ++broken;
  };
  const ChunkInfo saved = grid.chunks[12345];
  grid.chunks[12345].offsets = grid.chunks[12346].offsets;
  expect(grid, "chunks of 'g' at [892,1122] and [892,1122] overlap");
  grid.chunks[12345] = saved;
  grid.chunks.push_back(chunk({10, 10}, {1, 1}));
  expect(grid, "'g'");
  grid.chunks.pop_back();
  const ChunkInfo saved7 = grid.chunks[7];
  grid.chunks[7].offsets[1] = 1799;
  expect(grid, "lies outside its shape");
  grid.chunks[7].offsets[1] = int64_t{9223372036854775807};
  expect(grid, "lies outside its shape");
  grid.chunks[7].offsets = saved7.offsets;
  grid.chunks[7].sizes = {0, 3};  // an empty chunk: the grid misses 6 elements
  expect(grid, "cover 1799994 of its 1800000 elements");
  // Chunks no straight cut separates (a pinwheel tiling of [3, 3]) are compared pairwise.
  TensorInfo pinwheel;
  pinwheel.shape = {3, 3};
  pinwheel.chunks = {chunk({0, 0}, {2, 1}), chunk({0, 1}, {1, 2}), chunk({1, 2}, {2, 1}), chunk({2, 0}, {1, 2}),
                     chunk({1, 1}, {1, 1})};
  checkpoint::detail::check_coverage("pinwheel", "p", pinwheel);
  pinwheel.chunks[4] = chunk({0, 0}, {1, 1});  // overlaps the first, leaves the centre empty
  expect(pinwheel, "overlap");
  CHECK(broken == 6);
}

TEST_CASE("checkpoint: only regular files are opened; write errors map to the exit classes", "[checkpoint]") {
  TempDir tmp("files");
  const Layout one = layouts()[3];
  save_layout(one, tmp.str("good"), 2);
  int cases = 0;
  auto refused = [&](const std::string& dir, const std::string& needle) {
    try {
      checkpoint::read_metadata(dir);
      FAIL_CHECK(dir + ": no exception");
    } catch (const kernels::InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains(needle));
    }
    ++cases;
  };
  // A FIFO as checkpoint.json: refused at once (opening it would block until a writer came).
  fs::copy(tmp.path / "good", tmp.path / "fifo", fs::copy_options::recursive);
  fs::remove(tmp.path / "fifo" / "checkpoint.json");
  REQUIRE(::mkfifo((tmp.path / "fifo" / "checkpoint.json").c_str(), 0644) == 0);
  refused(tmp.str("fifo"), "checkpoint.json' is a FIFO, not a regular file");
  // A directory as checkpoint.json; a symlink loop as the checkpoint directory.
  fs::create_directories(tmp.path / "dir" / "checkpoint.json");
  refused(tmp.str("dir"), "checkpoint.json' is a directory");
  fs::create_symlink(tmp.path / "loop", tmp.path / "loop");
  refused(tmp.str("loop"), "Too many levels of symbolic links");
  // A FIFO as a data file when the metadata lists no files: the load refuses it by name.
  {
    fs::copy(tmp.path / "good", tmp.path / "fifo-data", fs::copy_options::recursive);
    const fs::path meta = tmp.path / "fifo-data" / "checkpoint.json";
    nlohmann::ordered_json j = read_json(meta);
    j.erase("files");
    write_json(meta, j);
    const std::string file = j["tensors"]["blocks.0.w"]["chunks"][0]["file"];
    fs::remove(tmp.path / "fifo-data" / file);
    REQUIRE(::mkfifo((tmp.path / "fifo-data" / file).c_str(), 0644) == 0);
    testing_support::Checks checks;
    on_mesh(one.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::StateDict target = make_sd(one, comms, 42);
      checks.throws<kernels::InvalidArgument>([&] { checkpoint::load(tmp.str("fifo-data"), target, world); },
                                              file + "': it is a FIFO", "a FIFO data file");
    });
    checks.report();
    ++cases;
  }
  // Writes: a full device is a ResourceError naming the path and the bytes.
  {
    kernels::File f = kernels::File::create("/dev/full");
    const std::vector<char> data(4096, 'x');
    CHECK_THROWS_AS(f.write_at(data.data(), data.size(), 0), kernels::ResourceError);
    CHECK_THROWS_WITH(f.write_at(data.data(), data.size(), 0),
                      "writing 4096 bytes at byte 0 of '/dev/full' failed: No space left on device");
    ++cases;
  }
  {
    const nn::NamedTensors ts = {{"x", Tensor::zeros({64}, DType::kF32)}};
    CHECK_THROWS_AS(nn::save_safetensors("/dev/full", ts), kernels::ResourceError);
    CHECK_THROWS_AS(nn::save_safetensors(tmp.str("missing/x.safetensors"), ts), kernels::InvalidArgument);
    CHECK_THROWS_WITH(nn::save_safetensors(tmp.str("missing/x.safetensors"), ts),
                      Catch::Contains("missing/x.safetensors") && Catch::Contains("No such file or directory"));
    ++cases;
  }
  // Export into a directory whose output file leads to a full device; export under a file.
  fs::create_directories(tmp.path / "out");
  fs::create_symlink("/dev/full", tmp.path / "out" / "model.safetensors");
  CHECK_THROWS_AS(checkpoint::export_safetensors(tmp.str("good"), tmp.str("out")), kernels::ResourceError);
  CHECK_THROWS_WITH(checkpoint::export_safetensors(tmp.str("good"), tmp.str("out")),
                    Catch::Contains("model.safetensors") && Catch::Contains("bytes at byte") &&
                        Catch::Contains("No space left on device"));
  std::ofstream(tmp.path / "plain-file") << "x";
  CHECK_THROWS_AS(checkpoint::export_safetensors(tmp.str("good"), tmp.str("plain-file/out")), kernels::InvalidArgument);
  cases += 2;
  // A save under a regular file (not a directory): InvalidArgument on every rank, naming it.
  {
    testing_support::Checks checks;
    on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      checks.throws<kernels::InvalidArgument>(
          [&] { checkpoint::save(tmp.str("plain-file/ck"), make_sd(layouts()[0], comms, 1), world); },
          "plain-file/ck", "save under a file");
    });
    checks.report();
    ++cases;
  }
  CHECK(cases == 9);
}
