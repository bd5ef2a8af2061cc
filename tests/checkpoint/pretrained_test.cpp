// checkpoint::load_pretrained (issue 26): pretrained weights from a consolidated Hugging Face
// safetensors file, an index of several files, or a checkpoint directory, into sharded and still
// meta models (FSDP, uneven FSDP, HSDP, FSDP x TP, one rank): every rank reads exactly its
// shards' bytes, straight into FSDP's flat buffers, converting bf16 into f32; a missing,
// unexpected or mis-shaped key fails on every rank naming it, before anything is allocated.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "fsdp/fully_shard.h"
#include "nn/memory.h"
#include "nn/safetensors.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "support/checks.h"
#include "support/local_mesh.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using kernels::DType;
using kernels::Tensor;
using testing_support::on_mesh;

namespace {

struct TempDir : testing_support::TempDir {
  explicit TempDir(const std::string& tag) : testing_support::TempDir("pretrained-test", tag) {}
};

nn::GPTConfig config() {
  nn::GPTConfig c;
  c.vocab = 22;  // uneven over 3 and 4
  c.dim = 16;
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 8;
  return c;
}

// The model's full initial weights (seed 9) as host tensors, keyed by name.
nn::NamedTensors reference_weights() {
  nn::NamedTensors out;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    nn::GPT m(nn::ModuleOptions{comms, DType::kF32, {}}, config());
    nn::materialize(m, 9);
    for (const auto& [n, p] : m.named_parameters()) out.emplace_back(n, p->data().to_local().clone());
  });
  return out;
}

nn::NamedTensors as_dtype(const nn::NamedTensors& ts, DType d) {
  nn::NamedTensors out;
  for (const auto& [n, t] : ts) out.emplace_back(n, t.to(d));
  return out;
}

struct Layout {
  std::string what;
  Dims mesh;
  std::vector<std::string> names;
  int tp_dim = -1;
  bool fsdp = true;
};

std::vector<Layout> layouts() {
  return {{"one rank", {1}, {"tp"}, -1, false},
          {"FSDP 4", {4}, {"dp_shard"}},
          {"FSDP 3 (uneven)", {3}, {"dp_shard"}},
          {"HSDP 2x2", {2, 2}, {"dp_replicate", "dp_shard"}},
          {"FSDP x TP 2x2", {2, 2}, {"dp_shard", "tp"}, 1},
          {"TP 2 (no FSDP)", {2}, {"tp"}, 0, false}};
}

// A meta model of layout l, sharded, on comms.
std::unique_ptr<nn::GPT> meta_model(const Layout& l, const std::shared_ptr<MeshComms>& comms) {
  auto m = std::make_unique<nn::GPT>(nn::ModuleOptions{comms, DType::kF32, {}}, config());
  if (l.tp_dim >= 0) nn::parallelize_module(*m, l.tp_dim, nn::gpt_tensor_parallel_plan(config(), true, true));
  if (l.fsdp) {
    for (const auto& [name, block] : m->blocks().children()) fsdp::fully_shard(*block, comms);
    fsdp::fully_shard(*m, comms);
  }
  return m;
}

// Loads `path` into layout l and checks every full parameter against `want` bit for bit, that
// every rank read exactly its shards' bytes, and that a meta model allocated nothing but its
// shards (FSDP: the flat buffers) on the way.
void load_and_compare(const Layout& l, const std::string& path, const nn::NamedTensors& want,
                      testing_support::Checks& checks, uint64_t item_bytes) {
  const DeviceMesh mesh = DeviceMesh::from_shape(l.mesh, l.names);
  collectives::run_ranks(static_cast<int>(mesh.size()), [&](Communicator& world) {
    auto mem = std::make_shared<nn::TrackingAllocator>();
    auto comms = MeshComms::create(mesh, world, {}, mem);
    auto m = meta_model(l, comms);
    const checkpoint::LoadStats st = checkpoint::load_pretrained(path, *m, world);
    uint64_t shard_elements = 0;
    int64_t shard_bytes = 0;
    for (const auto& [n, p] : m->named_parameters()) {
      shard_elements += static_cast<uint64_t>(p->data().to_local().numel());
      shard_bytes += static_cast<int64_t>(p->data().to_local().nbytes());
    }
    checks.check(st.bytes_needed == shard_elements * item_bytes,
                 fmt::format("{}: rank {} needed {} bytes, its shards are {} elements", l.what, world.rank(),
                             st.bytes_needed, shard_elements));
    checks.check(st.bytes_read == st.bytes_needed,
                 fmt::format("{}: rank {} read {} bytes for {} needed", l.what, world.rank(), st.bytes_read,
                             st.bytes_needed));
    // Nothing but the shards was allocated (FSDP: the flat buffers, padding included).
    int64_t flats = 0;
    for (auto& [n, mod] : m->named_modules())
      if (fsdp::FSDPModule* s = fsdp::state(*mod)) flats += s->sharded_bytes();
    const int64_t expect = l.fsdp ? flats : shard_bytes;
    checks.check(mem->peak_bytes() == expect, fmt::format("{}: rank {} allocated a peak of {} bytes; its shards are {}",
                                                          l.what, world.rank(), mem->peak_bytes(), expect));
    std::map<std::string, Tensor> got;
    for (const auto& [n, p] : m->named_parameters()) got[n] = p->data().full_tensor();
    int compared = 0;
    for (const auto& [n, t] : want) {
      auto it = got.find(n);
      checks.check(it != got.end(), l.what + ": no parameter " + n);
      if (it == got.end()) continue;
      checks.check(it->second.to_vector() == t.to(DType::kF32).to_vector(), l.what + ": " + n + " differs");
      ++compared;
    }
    checks.check(compared == static_cast<int>(got.size()) && compared > 10, l.what + ": too few compared");
  });
}

// Rewrites the safetensors file `path` with `key` dropped from its __metadata__ (our checkpoint's
// files less our marker are the files PyTorch's DCP writes).
void drop_metadata_key(const fs::path& path, const std::string& key) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  header["__metadata__"].erase(key);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t m = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&m), 8);
  out << text << bytes.substr(8 + n);
}

}  // namespace

TEST_CASE("load_pretrained: a consolidated bf16 safetensors file into meta models of every layout", "[checkpoint]") {
  const nn::NamedTensors ref = reference_weights();
  const nn::NamedTensors bf16 = as_dtype(ref, DType::kBF16);  // the values the f32 parameters must get
  TempDir tmp("file");
  nn::save_safetensors(tmp.str("model.safetensors"), bf16, {{"format", "pt"}});
  int ran = 0;
  for (const Layout& l : layouts()) {
    testing_support::Checks checks;
    load_and_compare(l, tmp.str("model.safetensors"), bf16, checks, 2);
    checks.report();
    ++ran;
  }
  CHECK(ran == static_cast<int>(layouts().size()));
}

TEST_CASE("load_pretrained: an index of two files, and checkpoint directories", "[checkpoint]") {
  const nn::NamedTensors ref = reference_weights();
  SECTION("model.safetensors.index.json") {
    TempDir tmp("index");
    nn::NamedTensors a(ref.begin(), ref.begin() + static_cast<ptrdiff_t>(ref.size() / 2)),
        b(ref.begin() + static_cast<ptrdiff_t>(ref.size() / 2), ref.end());
    nn::save_safetensors(tmp.str("model-00001-of-00002.safetensors"), a);
    nn::save_safetensors(tmp.str("model-00002-of-00002.safetensors"), b);
    nlohmann::json map = nlohmann::json::object();
    for (const auto& [n, t] : a) map[n] = "model-00001-of-00002.safetensors";
    for (const auto& [n, t] : b) map[n] = "model-00002-of-00002.safetensors";
    std::ofstream(tmp.str("model.safetensors.index.json")) << nlohmann::json{{"metadata", {{"total_size", 1}}},
                                                                              {"weight_map", map}}
                                                                                  .dump();
    testing_support::Checks checks;
    for (const Layout& l : {layouts()[1], layouts()[4]})
      load_and_compare(l, tmp.str("model.safetensors.index.json"), ref, checks, 4);
    checks.report();
    // The directory itself reads the same files (a Hugging Face directory).
    testing_support::Checks dir_checks;
    load_and_compare(layouts()[2], tmp.str(), ref, dir_checks, 4);
    dir_checks.report();
  }
  SECTION("our checkpoint directory and PyTorch's (its files alone), saved under TP 2, into meta FSDP 4 and FSDP x TP 2x2") {
    TempDir tmp("ours");
    on_mesh(DeviceMesh::from_shape({2}, {"tp"}), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::GPT m(nn::ModuleOptions{comms, DType::kF32, {}}, config());
      nn::parallelize_module(m, 0, nn::gpt_tensor_parallel_plan(config(), true, true));
      nn::materialize(m, 9);
      checkpoint::SaveOptions so;
      so.block_bytes = 0;  // chunk checksums only: a resharded read verifies whole chunks
      checkpoint::save(tmp.str("ck"), m.state_dict(), world, so);
    });
    // PyTorch's DCP directory: the same safetensors files (DCP_SHARDING_INFO offsets), no
    // checkpoint.json.
    fs::copy(tmp.str("ck"), tmp.str("pt"));
    fs::remove(fs::path(tmp.str("pt")) / checkpoint::kMetadataFile);
    int rewritten = 0;
    for (const auto& e : fs::directory_iterator(tmp.str("pt")))
      if (e.path().extension() == ".safetensors") {
        drop_metadata_key(e.path(), "dtensor_runtime");
        ++rewritten;
      }
    REQUIRE(rewritten >= 2);
    REQUIRE(checkpoint::read_metadata(tmp.str("pt")).foreign);
    testing_support::Checks checks;
    int loaded = 0;
    for (const std::string dir : {"ck", "pt"})
      for (const Layout& l : {layouts()[1], layouts()[4]}) {
        on_mesh(DeviceMesh::from_shape(l.mesh, l.names), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
          auto m = meta_model(l, comms);
          const checkpoint::LoadStats st = checkpoint::load_pretrained(tmp.str(dir), *m, world);
          checks.check(st.bytes_read >= st.bytes_needed && st.bytes_needed > 0,
                       dir + " " + l.what + ": bytes read / needed");
          for (const auto& [n, t] : ref) {
            const Tensor full = m->parameter(n).data().full_tensor();
            checks.check(full.to_vector() == t.to_vector(), dir + " " + l.what + ": " + n + " differs");
          }
        });
        ++loaded;
      }
    checks.report();
    CHECK(loaded == 4);
  }
}

TEST_CASE("load_pretrained: missing, unexpected, mis-shaped and non-floating keys fail naming the key; nothing changes",
          "[checkpoint]") {
  const nn::NamedTensors ref = reference_weights();
  TempDir tmp("bad");
  struct Case {
    std::string what, needle;
    nn::NamedTensors tensors;
  };
  std::vector<Case> cases;
  {
    nn::NamedTensors t(ref.begin(), ref.end() - 1);  // lm_head.weight is last
    cases.push_back({"missing", "'lm_head.weight' (missing key)", t});
  }
  {
    nn::NamedTensors t = ref;
    t.emplace_back("blocks.9.extra", Tensor::zeros({3}, DType::kF32));
    cases.push_back({"unexpected", "'blocks.9.extra', which is no parameter of the model (unexpected key)", t});
  }
  {
    nn::NamedTensors t = ref;
    t[1].second = Tensor::zeros({7, 16}, DType::kF32);  // pos_emb.weight is [8, 16]
    cases.push_back({"mis-shaped", "'pos_emb.weight' was saved with shape [7,16], the target has shape [8,16]", t});
  }
  {
    nn::NamedTensors t = ref;
    t[0].second = Tensor::zeros(t[0].second.shape(), DType::kI64);
    cases.push_back({"integer", "'tok_emb.weight' was saved as I64", t});
  }
  int ran = 0;
  for (const Case& c : cases) {
    const std::string path = tmp.str(c.what + ".safetensors");
    nn::save_safetensors(path, c.tensors);
    testing_support::Checks checks;
    collectives::run_ranks(4, [&](Communicator& world) {
      auto mem = std::make_shared<nn::TrackingAllocator>();
      auto comms = MeshComms::create(DeviceMesh::from_shape({4}, {"dp_shard"}), world, {}, mem);
      auto m = meta_model(layouts()[1], comms);
      checks.throws<kernels::InvalidArgument>([&] { checkpoint::load_pretrained(path, *m, world); }, c.needle,
                                              c.what);
      for (const auto& [n, p] : m->named_parameters()) checks.check(p->is_meta(), c.what + ": " + n + " allocated");
      checks.check(mem->peak_bytes() == 0, c.what + ": bytes were allocated");
      // A materialised model keeps its values.
      nn::materialize(*m, 4);
      const std::vector<double> before = m->parameter("blocks.0.attn.wq.weight").data().to_local().to_vector();
      checks.throws<kernels::InvalidArgument>([&] { checkpoint::load_pretrained(path, *m, world); }, c.needle,
                                              c.what + " (materialised)");
      checks.check(m->parameter("blocks.0.attn.wq.weight").data().to_local().to_vector() == before,
                   c.what + ": a materialised parameter changed");
    });
    checks.report();
    ++ran;
  }
  CHECK(ran == 4);
  // strict = false skips the unexpected key; skip_prefixes skips by prefix.
  testing_support::Checks checks;
  on_mesh(DeviceMesh::from_shape({2}, {"dp_shard"}), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    auto m = meta_model(layouts()[1], comms);
    checkpoint::PretrainedOptions po;
    po.skip_prefixes = {"blocks.9."};
    checkpoint::load_pretrained(tmp.str("unexpected.safetensors"), *m, world, po);
    checks.check(!m->parameter("lm_head.weight").is_meta(), "skip_prefixes: not loaded");
  });
  checks.report();
  // An index naming a tensor in the wrong file, and a path that is none of the sources.
  nn::save_safetensors(tmp.str("a.safetensors"), ref);
  std::ofstream(tmp.str("bad.index.json")) << R"({"weight_map": {"tok_emb.weight": "b.safetensors"}})";
  nn::save_safetensors(tmp.str("b.safetensors"), {{"pos_emb.weight", ref[1].second}});
  std::ofstream(tmp.str("notes.txt")) << "hello";
  std::string index_error, kind_error;
  on_mesh(DeviceMesh::from_shape({1}, {"dp_shard"}), [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    auto m = meta_model(layouts()[1], comms);
    try {
      checkpoint::load_pretrained(tmp.str("bad.index.json"), *m, world);
    } catch (const kernels::InvalidArgument& e) {
      index_error = e.what();
    }
    try {
      checkpoint::load_pretrained(tmp.str("notes.txt"), *m, world);
    } catch (const kernels::InvalidArgument& e) {
      kind_error = e.what();
    }
  });
  CHECK_THAT(index_error, Catch::Matchers::Contains("holds tensor 'pos_emb.weight', which the index"));
  CHECK_THAT(kind_error, Catch::Matchers::Contains("is not a directory, a .safetensors file or a safetensors index"));
}
