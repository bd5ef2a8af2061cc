// Checkpoints of RaggedShard DTensors (checkpoint/README.md, "Ragged shards"): a rank's flat range
// is saved as boxes of the tensor's dims (a partial first row, full rows, a partial last row) and
// loads bit-identically under S(0), R, one rank, _S, other units and alignments, HSDP [R, Rg] and
// Rg with an S on another mesh dim, and the reverse; replicated ranges are written once; an
// FSDP-like state dict (parameters packed parameter-major into one flat buffer, balanced 1-D
// ranges per rank, each parameter's units its overlaps) loads in place into the buffer's views.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <mutex>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/layout.h"
#include "kernels/format.h"
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
using testing_support::on_mesh;

namespace {

struct TempDir : testing_support::TempDir {
  explicit TempDir(const std::string& tag) : testing_support::TempDir("ckpt-ragged", tag) {}
};

// Element value of tensor `key` at global flat index i: exact in f32 and bf16.
double value(DType dtype, uint64_t salt, size_t key, int64_t i) {
  if (dtype == DType::kBF16) return static_cast<double>((i * 7 + static_cast<int64_t>(salt + key)) % 256);
  return static_cast<double>(i % 4099) * 0.25 + static_cast<double>(key * 1000 + salt);
}

// A DTensor of `placements` whose elements are value(dtype, salt, key, global flat index).
DTensor make_tensor(const std::shared_ptr<MeshComms>& comms, const Dims& shape, DType dtype, const Placements& ps,
                    uint64_t salt, size_t key) {
  auto mesh = std::make_shared<DeviceMesh>(comms->mesh());
  const dtensor::DTensorSpec spec = dtensor::make_spec(mesh, ps, shape, dtype);
  const Dims view = dtensor::ragged_view(shape, spec.placements);  // the layout's dims
  const dtensor::ShardLayout l = *spec.layout(comms->rank());
  std::vector<dtensor::HeldIndices> held;
  for (int t = 0; t < view.size(); ++t) held.emplace_back(l.runs[t]);
  Tensor local = Tensor::empty(l.local_shape, dtype);
  local.fill_index_([&](std::span<const int64_t> at) {
    int64_t flat = 0;  // the view's row-major flat index is the tensor's
    for (int t = 0; t < view.size(); ++t) flat = flat * view[t] + held[t][at[t]];
    return value(dtype, salt, key, flat);
  });
  return DTensor(comms, spec, local);
}

struct TensorCase {
  std::string key;
  Dims shape;
  DType dtype;
};

// 2-D and 3-D tensors whose ranges start and end mid-row, a 1-D one and a bf16 one.
const std::vector<TensorCase>& tensor_cases() {
  static const std::vector<TensorCase> t = {
      {"w2d", {7, 5}, DType::kF32},
      {"w3d", {3, 4, 5}, DType::kF32},
      {"bias", {11}, DType::kF32},
      {"emb.bf16", {6, 10}, DType::kBF16},
  };
  return t;
}

// A layout: a mesh and the placements of an n-d tensor.
struct Layout {
  std::string name;
  Dims mesh;
  std::function<std::string(int ndim)> placements;
};

const std::vector<Layout>& layouts() {
  auto same = [](const char* p) { return [p](int) { return std::string(p); }; };
  static const std::vector<Layout> l = {
      {"rg4-zeros", {4}, same("Rg(0,[1,2,0,1],1)")},
      {"rg4-align4", {4}, same("Rg(0,[3,1,1,2],4)")},
      {"rg3", {3}, same("Rg(0,[1,1,1],1)")},
      {"rg2-align3", {2}, same("Rg(0,[2,3],3)")},
      {"rg1", {1}, same("Rg(0,[1],1)")},
      {"hsdp-R-rg", {2, 2}, same("R,Rg(0,[1,3],2)")},
      {"rg-then-S", {2, 2}, same("Rg(0,[2,1],1),S(0)")},
      {"S0-then-rg1", {2, 2},
       [](int nd) { return std::string(nd >= 2 ? "S(0),Rg(1,[1,2],1)" : "S(0),R"); }},
      {"rg-last-dim", {3}, [](int nd) { return fmt::format("Rg({},[0,1,1],1)", nd - 1); }},
      {"fsdp4", {4}, same("S(0)")},
      {"replicate3", {3}, same("R")},
      {"one", {1}, same("R")},
      {"tp2-last", {2}, [](int nd) { return fmt::format("S({})", nd - 1); }},
      {"strided4", {4}, same("_S(0,2)")},
  };
  return l;
}

nn::StateDict make_sd(const Layout& l, const std::shared_ptr<MeshComms>& comms, uint64_t salt) {
  nn::StateDict sd;
  for (size_t k = 0; k < tensor_cases().size(); ++k) {
    const TensorCase& c = tensor_cases()[k];
    const Placements ps = dtensor::parse_placements(l.placements(c.shape.size()));
    sd.tensors.emplace_back(c.key, make_tensor(comms, c.shape, c.dtype, ps, salt, k));
  }
  return sd;
}

bool same_bits(const Tensor& x, const Tensor& y) {
  if (!(x.shape() == y.shape()) || x.dtype() != y.dtype()) return false;
  const Tensor cx = x.contiguous(), cy = y.contiguous();
  return cx.nbytes() == 0 || std::memcmp(cx.data_ptr(), cy.data_ptr(), cx.nbytes()) == 0;
}

}  // namespace

TEST_CASE("checkpoint: RaggedShard saves load under every layout and the reverse, bit-identically",
          "[checkpoint][ragged]") {
  TempDir tmp("matrix");
  const auto& ls = layouts();
  checkpoint::SaveOptions blocks;
  blocks.block_bytes = 32;  // partial reads verify blocks
  for (size_t s = 0; s < ls.size(); ++s)
    on_mesh(ls[s].mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      checkpoint::save(tmp.str(ls[s].name), make_sd(ls[s], comms, s + 1), world, blocks);
    });
  testing_support::Checks checks;
  int pairs = 0;
  for (size_t s = 0; s < ls.size(); ++s)
    for (const Layout& dst : ls) {
      on_mesh(dst.mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        const nn::StateDict expected = make_sd(dst, comms, s + 1);
        for (checkpoint::Verify v : {checkpoint::Verify::kNone, checkpoint::Verify::kRead}) {
          nn::StateDict target = make_sd(dst, comms, 999);  // other values: all must be overwritten
          checkpoint::LoadOptions o;
          o.verify = v;
          const checkpoint::LoadStats st = checkpoint::load(tmp.str(ls[s].name), target, world, o);
          for (size_t i = 0; i < target.tensors.size(); ++i)
            checks.check(same_bits(target.tensors[i].second.to_local(), expected.tensors[i].second.to_local()),
                         fmt::format("{} -> {}: rank {} '{}' differs", ls[s].name, dst.name, world.rank(),
                                     target.tensors[i].first));
          if (v == checkpoint::Verify::kNone)
            checks.check(st.bytes_read == st.bytes_needed,
                         fmt::format("{} -> {}: rank {} read {} bytes for {} needed", ls[s].name, dst.name,
                                     world.rank(), st.bytes_read, st.bytes_needed));
        }
      });
      ++pairs;
    }
  checks.report();
  CHECK(pairs == static_cast<int>(ls.size() * ls.size()));
}

TEST_CASE("checkpoint: a ragged range is saved as boxes of the tensor's dims, replicas once",
          "[checkpoint][ragged]") {
  // [3,4,5] (60 elements) under Rg(0,[7,45,8],1): ranges [0,7) [7,52) [52,60). Rank 1's is the
  // worked example of dtensor::flat_range_boxes: 5 boxes; ranks 0 and 2 hold 2 each.
  TempDir tmp("disk");
  const Dims shape = {3, 4, 5};
  for (const auto& [mesh, ps] : std::vector<std::pair<Dims, std::string>>{{{3}, "Rg(0,[7,45,8],1)"},
                                                                           {{2, 3}, "R,Rg(0,[7,45,8],1)"}}) {
    const std::string dir = tmp.str(fmt::format("{}", mesh.product()));
    on_mesh(mesh, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::StateDict sd;
      sd.tensors.emplace_back("x", make_tensor(comms, shape, DType::kF32, dtensor::parse_placements(ps), 1, 0));
      checkpoint::save(dir, sd, world);
    });
    const checkpoint::Metadata md = checkpoint::read_metadata(dir);
    const checkpoint::TensorInfo* ti = md.find("x");
    REQUIRE(ti != nullptr);
    using V = std::vector<int64_t>;
    auto v = [](const Dims& d) { return V(d.begin(), d.end()); };
    std::vector<std::pair<V, V>> got, want;
    for (const checkpoint::ChunkInfo& c : ti->chunks) got.push_back({v(c.offsets), v(c.sizes)});
    for (auto [a, n] : {std::pair<int64_t, int64_t>{0, 7}, {7, 45}, {52, 8}})
      for (const dtensor::FlatBox& b : dtensor::flat_range_boxes(shape, a, n))
        want.push_back({v(b.offsets), v(b.sizes)});
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    CHECK(want.size() == 9);
    CHECK(got == want);  // with two replicas: still each box once
    // On 3 ranks the middle one writes its 5 boxes into 5 files (one chunk per key per file); with
    // two replicas the greedy splits each rank's boxes between them.
    int five = 0;
    for (const auto& [name, size] : md.file_sizes) five += name.find("-of-00005") != std::string::npos;
    CHECK(five == (mesh.product() == 3 ? 5 : 0));
  }
}

TEST_CASE("checkpoint: an FSDP-like packed state dict of ragged parameters crosses layouts in place",
          "[checkpoint][ragged]") {
  // Parameters packed parameter-major into one flat buffer, cut into balanced 1-D ranges over
  // k ranks; parameter p is Rg(0, its overlaps with the k ranges, 1): its local tensor is its
  // overlap with the rank's range, a view of the rank's flat buffer.
  const std::vector<Dims> shapes = {{5, 3}, {7}, {4, 6}, {2, 3, 4}, {9}, {3, 1, 5}};
  int64_t total = 0;
  std::vector<int64_t> start;
  for (const Dims& s : shapes) {
    start.push_back(total);
    total += s.product();
  }
  struct Packed {
    nn::StateDict sd;
    Tensor buffer;  // the rank's flat range of the packed parameters
    int64_t lo = 0;
  };
  auto packed = [&](const std::shared_ptr<MeshComms>& comms, int k, uint64_t salt) {
    const std::vector<int64_t> bounds = dtensor::ragged_boundaries(total, std::vector<int64_t>(k, 1), 1);
    const int r = comms->rank();
    Packed out;
    out.lo = bounds[r];
    out.buffer = Tensor::empty({bounds[r + 1] - bounds[r]}, DType::kF32);
    auto mesh = std::make_shared<DeviceMesh>(comms->mesh());
    for (size_t p = 0; p < shapes.size(); ++p) {
      const int64_t n = shapes[p].product();
      std::vector<int64_t> units;
      for (int i = 0; i < k; ++i)
        units.push_back(std::max<int64_t>(0, std::min(start[p] + n, bounds[i + 1]) - std::max(start[p], bounds[i])));
      const Placements ps = {dtensor::RaggedShard{0, units, 1}};
      const int64_t a = std::max(start[p], bounds[r]), b = std::min(start[p] + n, bounds[r + 1]);
      Tensor view = out.buffer.narrow(0, std::min(a - bounds[r], out.buffer.numel()), std::max<int64_t>(b - a, 0));
      // Values: parameter p's element i at its global flat index (checked through the buffer).
      const DTensor src = make_tensor(comms, shapes[p], DType::kF32, ps, salt, p);
      view.copy_(src.to_local());
      out.sd.tensors.emplace_back(fmt::format("p{}", p), DTensor(comms, src.spec(), view));
    }
    return out;
  };
  auto buffer_ok = [&](const Packed& pk, uint64_t salt) {
    std::vector<double> v = pk.buffer.to_vector();
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t g = pk.lo + static_cast<int64_t>(i);
      size_t p = 0;
      while (p + 1 < start.size() && start[p + 1] <= g) ++p;
      if (v[i] != value(DType::kF32, salt, p, g - start[p])) return false;
    }
    return true;
  };
  TempDir tmp("fsdp");
  testing_support::Checks checks;
  int loads = 0;
  for (int k_save : {3, 4}) {
    const std::string dir = tmp.str(fmt::format("k{}", k_save));
    on_mesh({k_save}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      checkpoint::save(dir, packed(comms, k_save, 7).sd, world);
    });
    // Into other packings (the buffers' views, in place), and into S(0) / R targets.
    for (int k_load : {1, 2, 3, 4}) {
      on_mesh({k_load}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        Packed target = packed(comms, k_load, 99);
        checkpoint::load(dir, target.sd, world);
        checks.check(buffer_ok(target, 7), fmt::format("k {} -> {}: rank {}'s buffer", k_save, k_load, world.rank()));
      });
      ++loads;
    }
    for (const char* ps : {"S(0)", "R"}) {
      on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
        nn::StateDict target, expected;
        for (size_t p = 0; p < shapes.size(); ++p) {
          target.tensors.emplace_back(fmt::format("p{}", p), make_tensor(comms, shapes[p], DType::kF32,
                                                                         dtensor::parse_placements(ps), 99, p));
          expected.tensors.emplace_back(fmt::format("p{}", p), make_tensor(comms, shapes[p], DType::kF32,
                                                                           dtensor::parse_placements(ps), 7, p));
        }
        checkpoint::load(dir, target, world);
        for (size_t p = 0; p < shapes.size(); ++p)
          checks.check(same_bits(target.tensors[p].second.to_local(), expected.tensors[p].second.to_local()),
                       fmt::format("k {} -> {} p{}: rank {} differs", k_save, ps, p, world.rank()));
      });
      ++loads;
    }
  }
  checks.report();
  CHECK(loads == 2 * (4 + 2));
}

TEST_CASE("checkpoint: a ragged target of another shape is refused naming the key and shapes",
          "[checkpoint][ragged]") {
  TempDir tmp("shape");
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    nn::StateDict sd;
    sd.tensors.emplace_back("w", make_tensor(comms, {7, 5}, DType::kF32, dtensor::parse_placements("Rg(0,[1,2],1)"),
                                             1, 0));
    checkpoint::save(tmp.str("c"), sd, world);
  });
  testing_support::Checks checks;
  int ran = 0;
  for (const Dims& other : {Dims{5, 7}, Dims{35}, Dims{7, 5, 1}}) {
    on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
      nn::StateDict target;
      target.tensors.emplace_back(
          "w", make_tensor(comms, other, DType::kF32, dtensor::parse_placements("Rg(0,[1,2],1)"), 2, 0));
      const Tensor before = target.tensors[0].second.to_local().clone();
      checks.throws<kernels::InvalidArgument>(
          [&] { checkpoint::load(tmp.str("c"), target, world); },
          fmt::format("'w' was saved with shape {}, the target has shape {}", Dims{7, 5}, other),
          fmt::format("target {}", other));
      checks.check(same_bits(before, target.tensors[0].second.to_local()), "the refused load changed the target");
    });
    ++ran;
  }
  checks.report();
  CHECK(ran == 3);
}
