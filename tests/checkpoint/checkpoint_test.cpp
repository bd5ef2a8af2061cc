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
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "kernels/format.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "support/checks.h"

namespace fs = std::filesystem;
using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

namespace {

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / fmt::format("ckpt-test-{}-{}-{}", tag, ::getpid(), counter()++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str(const std::string& sub = "") const { return (sub.empty() ? path : path / sub).string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// One layout: a mesh shape and the placements of 2-D tensors (1-D tensors get the same with
// dim-1 shards replaced by Replicate).
struct Layout {
  std::string name;
  Dims mesh;
  std::string placements2d;
  std::string placements1d;
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> l = {
      {"fsdp4", {4}, "S(0)", "S(0)"},
      {"tp4-col", {4}, "S(1)", "R"},
      {"fsdp3", {3}, "S(0)", "S(0)"},
      {"one", {1}, "R", "R"},
      {"hsdp2x2", {2, 2}, "R,S(0)", "R,S(0)"},
      {"fsdp-x-tp-rowwise", {2, 2}, "S(0),S(1)", "S(0),R"},
      {"fsdp-x-tp-strided", {2, 2}, "_S(0,2),S(0)", "_S(0,2),S(0)"},
      {"nested-uneven", {2, 2}, "S(0),S(0)", "S(0),S(0)"},
      {"replicate3", {3}, "R", "R"},
      {"strided4", {4}, "_S(0,2)", "_S(0,2)"},
  };
  return l;
}

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

void run_on(const Dims& mesh_shape, const std::function<void(std::shared_ptr<MeshComms>, Communicator&)>& fn) {
  const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
  collectives::run_ranks(static_cast<int>(mesh.size()),
                         [&](Communicator& world) { fn(std::make_shared<MeshComms>(mesh, world), world); });
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

void save_layout(const Layout& l, const std::string& dir, uint64_t salt) {
  run_on(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    checkpoint::save(dir, make_sd(l, comms, salt), world);
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
  TempDir tmp("reshard");
  const auto& ls = layouts();
  for (size_t s = 0; s < ls.size(); ++s) save_layout(ls[s], tmp.str(ls[s].name), s + 1);
  int pairs = 0;
  testing_support::Checks checks;
  for (size_t s = 0; s < ls.size(); ++s)
    for (const Layout& dst : ls) {
      run_on(dst.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        nn::StateDict target = make_sd(dst, comms, 999);  // other values: must all be overwritten
        const nn::StateDict expected = make_sd(dst, comms, s + 1);
        const checkpoint::LoadStats st = checkpoint::load(tmp.str(ls[s].name), target, world);
        for (size_t i = 0; i < target.tensors.size(); ++i)
          checks.check(same_local(target.tensors[i].second, expected.tensors[i].second),
                       fmt::format("{} -> {}: rank {} '{}' differs", ls[s].name, dst.name, world.rank(),
                                   target.tensors[i].first));
        checks.check(st.bytes_read == st.bytes_needed,
                     fmt::format("{} -> {}: rank {} read {} bytes for {} needed", ls[s].name, dst.name, world.rank(),
                                 st.bytes_read, st.bytes_needed));
        checks.check(target.int_value("train.step") == int64_t(s + 1) && target.double_value("lr") == 0.5 &&
                         std::get<std::string>(target.values.at("name")) == "run-" + std::to_string(s + 1),
                     fmt::format("{} -> {}: values", ls[s].name, dst.name));
      });
      ++pairs;
    }
  checks.report();
  CHECK(pairs == static_cast<int>(ls.size() * ls.size()));
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
  run_on({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
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
    run_on(t.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
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
    run_on(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
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
  run_on({4}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict target = make_sd(fsdp4, comms, 42);
    target.tensors.pop_back();
    checkpoint::LoadOptions o;
    o.strict = false;
    checkpoint::load(tmp.str("good"), target, world, o);
  });
  // A Partial tensor cannot be saved.
  run_on({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
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
  run_on(l.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
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
  run_on({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
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
  run_on({2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
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
