// The save plan without other ranks' layouts (issue 25 item 2): every rank's own plan
// (make_local_save_plan), put together, writes exactly the chunks of the whole-world reference
// (make_save_plan_by_rank), each exactly once, with the same hash, on every layout of the
// checkpoint tests and more (HSDP x TP, tp-replicated tensors, empty and 0-d tensors, RaggedShard
// FSDP and HSDP); and the busiest rank writes as much as under the reference where all
// replicated keys share one replica group (within 20% where groups mix).
// A hidden [bench] case times both planners at 8 to 16,384 ranks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/save_plan.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "dtensor/spec.h"
#include "kernels/format.h"
#include "layouts.h"

namespace {

using checkpoint::detail::SavePlan;
using checkpoint::detail::SpecList;
using dtensor::DeviceMesh;
using kernels::Dims;
using kernels::DType;

struct Entry {
  std::string key;
  Dims shape;
  std::string placements;  // per mesh dim
  DType dtype = DType::kF32;
};

SpecList specs(const Dims& mesh_shape, const std::vector<Entry>& entries) {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(mesh_shape));
  SpecList out;
  for (const Entry& e : entries)
    out.emplace_back(e.key, dtensor::make_spec(mesh, dtensor::parse_placements(e.placements), e.shape, e.dtype));
  return out;
}

// (key, offsets, sizes, local) of a chunk: what is written, and from where in the local tensor.
using ChunkId = std::tuple<size_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;
ChunkId id_of(const checkpoint::detail::PlannedChunk& c) {
  return {c.key, {c.box.offsets.begin(), c.box.offsets.end()}, {c.box.sizes.begin(), c.box.sizes.end()},
          {c.box.local.begin(), c.box.local.end()}};
}

struct Compared {
  uint64_t old_max = 0, new_max = 0;  // bytes written by the busiest rank
};

// Every rank's local plan against the reference; fails the test on any difference.
Compared compare(const std::string& what, const SpecList& s, int world) {
  INFO(what);
  const SavePlan ref = checkpoint::detail::make_save_plan_by_rank(s, world, 4096);
  std::map<ChunkId, int> expected, got;
  std::vector<uint64_t> old_bytes(world, 0), new_bytes(world, 0);
  for (const auto& c : ref.chunks) {
    ++expected[id_of(c)];
    old_bytes[c.owner] += c.nbytes;
  }
  for (int r = 0; r < world; ++r) {
    const SavePlan mine = checkpoint::detail::make_local_save_plan(s, r, world, 4096);
    CHECK(mine.hash == ref.hash);
    for (const auto& c : mine.chunks) {
      CHECK(c.owner == r);
      ++got[id_of(c)];
      new_bytes[r] += c.nbytes;
    }
    for (const auto& f : mine.files) CHECK(f.owner == r);
  }
  for (const auto& [id, n] : expected) CHECK(n == 1);
  CHECK(got == expected);  // the same chunks, each written exactly once
  return {*std::max_element(old_bytes.begin(), old_bytes.end()), *std::max_element(new_bytes.begin(), new_bytes.end())};
}

// The checkpoint tests' tensors (tests/checkpoint/checkpoint_test.cpp) under one layout.
std::vector<Entry> checkpoint_test_tensors(const std::string& p2, const std::string& p1) {
  return {{"blocks.0.w", {13, 7}, p2},          {"blocks.0.v", {16, 12}, p2},
          {"emb.bf16", {9, 6}, p2, DType::kBF16}, {"bias", {5}, p1},
          {"ids", {10}, p1, DType::kI64}};
}

// examples/fsdp-train's default model (vocab 64, dim 64, 2 layers, seq 32) and its Adam state.
std::vector<Entry> gpt_tensors(const std::string& rows, const std::string& cols, const std::string& vec) {
  std::vector<Entry> out;
  auto add = [&](const std::string& k, Dims shape, const std::string& p) {
    for (const std::string& prefix : {std::string(""), std::string("optim.exp_avg."), std::string("optim.exp_avg_sq.")})
      out.push_back({prefix + k, shape, p});
  };
  add("wte.weight", {64, 64}, rows);
  add("wpe.weight", {32, 64}, rows);
  for (int l = 0; l < 2; ++l) {
    const std::string b = fmt::format("blocks.{}.", l);
    add(b + "ln1.weight", {64}, vec);
    add(b + "attn.qkv.weight", {192, 64}, rows);
    add(b + "attn.proj.weight", {64, 64}, cols);
    add(b + "ln2.weight", {64}, vec);
    add(b + "mlp.fc.weight", {256, 64}, rows);
    add(b + "mlp.proj.weight", {64, 256}, cols);
  }
  add("ln_f.weight", {64}, vec);
  return out;
}

struct Config {
  std::string what;
  Dims mesh;
  std::vector<Entry> entries;
};

std::vector<Config> configs() {
  std::vector<Config> out;
  std::vector<checkpoint_tests::Layout> layouts = checkpoint_tests::layouts();
  layouts.push_back({"hsdp-x-tp", {2, 2, 2}, "R,S(0),S(1)", "R,S(0),R"});
  layouts.push_back({"hsdp4x2", {4, 2}, "R,S(0)", "R,S(0)"});
  layouts.push_back({"replicate-x-strided", {3, 2, 2}, "R,_S(0,2),S(0)", "R,S(0),R"});
  for (const auto& l : layouts)
    out.push_back({"checkpoint tensors, " + l.name, l.mesh, checkpoint_test_tensors(l.placements2d, l.placements1d)});
  out.push_back({"empty and 0-d tensors, hsdp2x2", {2, 2},
                 {{"empty", {0, 4}, "R,S(0)"}, {"scalar", {}, "R,R"}, {"w", {6, 4}, "R,S(0)"}}});
  out.push_back({"gpt FSDP 8", {8}, gpt_tensors("S(0)", "S(0)", "S(0)")});
  out.push_back({"gpt HSDP 2x4", {2, 4}, gpt_tensors("R,S(0)", "R,S(0)", "R,S(0)")});
  out.push_back({"gpt FSDP x TP 2x4", {2, 4}, gpt_tensors("_S(0,4),S(0)", "S(0),S(1)", "S(0),R")});
  out.push_back({"gpt HSDP x TP 2x2x4", {2, 2, 4}, gpt_tensors("R,_S(0,4),S(0)", "R,S(0),S(1)", "R,S(0),R")});
  // RaggedShard: each rank's range as several boxes (a zero unit: an empty rank).
  out.push_back({"gpt ragged FSDP 4", {4}, gpt_tensors("Rg(0,[1,2,0,3],1)", "Rg(0,[1,2,0,3],1)", "Rg(0,[1,2,0,3],1)")});
  out.push_back({"gpt ragged HSDP 2x4", {2, 4},
                 gpt_tensors("R,Rg(0,[3,1,2,2],4)", "R,Rg(0,[3,1,2,2],4)", "R,Rg(0,[3,1,2,2],4)")});
  return out;
}

}  // namespace

TEST_CASE("save plan: every rank's own plan writes the reference's chunks exactly once", "[checkpoint][save-plan]") {
  // Where every replicated key of a mesh is replicated along the same mesh dims, the local greedy
  // (within a replica group) is the reference's greedy: the same busiest rank. Where tensors with
  // different replica groups mix (tp-replicated vectors beside tp-sharded matrices), the groups
  // balance separately: the observed maxima are within 20% of the reference (smaller in one).
  const std::set<std::string> mixed = {"checkpoint tensors, tp4-col", "checkpoint tensors, fsdp-x-tp-rowwise",
                                       "empty and 0-d tensors, hsdp2x2", "gpt HSDP x TP 2x2x4"};
  int ran = 0, same = 0;
  for (const Config& c : configs()) {
    INFO(c.what);
    const Compared b = compare(c.what, specs(c.mesh, c.entries), static_cast<int>(c.mesh.product()));
    std::cout << fmt::format("{:<40} max bytes written by one rank: reference {:>7}, local {:>7}\n", c.what,
                             b.old_max, b.new_max);
    if (mixed.count(c.what)) {
      CHECK(b.new_max * 5 <= b.old_max * 6);
    } else {
      CHECK(b.new_max == b.old_max);
      ++same;
    }
    ++ran;
  }
  CHECK(ran == 20);
  CHECK(same == 16);
}

TEST_CASE("save plan: a mesh naming a rank outside the world is refused, naming the key", "[checkpoint][save-plan]") {
  const SpecList s = specs({4}, {{"w", {8, 2}, "S(0)"}});
  try {
    checkpoint::detail::make_local_save_plan(s, 0, 2, 4096);
    FAIL("no exception");
  } catch (const kernels::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("'w' lives on rank 2 but the world has 2 ranks"));
  }
}

TEST_CASE("save plan: planning time, reference vs local, 8 to 16,384 ranks", "[.][bench]") {
  using Clock = std::chrono::steady_clock;
  for (const auto& [name, mesh, rows, cols, vec] :
       std::vector<std::tuple<std::string, Dims, std::string, std::string, std::string>>{
           {"FSDP 8", {8}, "S(0)", "S(0)", "S(0)"},
           {"FSDP 64", {64}, "S(0)", "S(0)", "S(0)"},
           {"FSDP 1024", {1024}, "S(0)", "S(0)", "S(0)"},
           {"FSDP 16384", {16384}, "S(0)", "S(0)", "S(0)"},
           {"HSDP x TP 2x2x2", {2, 2, 2}, "R,_S(0,2),S(0)", "R,S(0),S(1)", "R,S(0),R"},
           {"HSDP x TP 2x8x4", {2, 8, 4}, "R,_S(0,4),S(0)", "R,S(0),S(1)", "R,S(0),R"},
           {"HSDP x TP 8x32x4", {8, 32, 4}, "R,_S(0,4),S(0)", "R,S(0),S(1)", "R,S(0),R"},
           {"HSDP x TP 16x256x4", {16, 256, 4}, "R,_S(0,4),S(0)", "R,S(0),S(1)", "R,S(0),R"},
       }) {
    const SpecList s = specs(mesh, gpt_tensors(rows, cols, vec));
    const int world = static_cast<int>(mesh.product());
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::vector<double> old_ms, new_ms;
    const int reps = world >= 1024 ? 3 : 9;
    for (int i = 0; i < reps; ++i) {
      auto t0 = Clock::now();
      const SavePlan ref = checkpoint::detail::make_save_plan_by_rank(s, world, 1 << 20);
      old_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      t0 = Clock::now();
      const SavePlan mine = checkpoint::detail::make_local_save_plan(s, world - 1, world, 1 << 20);
      new_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      CHECK(ref.hash == mine.hash);
    }
    std::cout << fmt::format("{:<22} world {:>6}: reference (every rank's plan) {:>10.3f} ms, local {:>8.3f} ms\n",
                             name, world, median(old_ms), median(new_ms));
  }
}
