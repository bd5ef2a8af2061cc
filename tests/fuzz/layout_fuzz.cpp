// Coverage-guided fuzz target (libFuzzer, clang) of the mesh and placement parsers and the layout
// rules. An input is up to four lines:
//   MESH            "4x2" or "[[0,2],[1,3]]"
//   SHAPE           "13,2" (parsed here; sizes >= 0)
//   PLACEMENTS      "S(0),_S(0,2)"
//   TARGET          optional: placements to plan a redistribute to (greedy and search)
// e.g. "2x2\n8,2\n_S(0,2),S(0)\nS(0),S(0)" (tests/fuzz/corpus holds the seeds).
//
// What must hold, for any bytes:
//  - every parser and make_spec/compute_layout/plan_redistribute either succeeds or throws
//    kernels::InvalidArgument or kernels::Unsupported with a one-line message; anything else
//    (another exception, a crash, a sanitizer report, a hang) is a finding;
//  - printing round-trips: parse(to_string(x)) == x for meshes and placement lists;
//  - on small problems, every rank's layout equals an independent index-list implementation of
//    PyTorch's rules (torch.chunk, nested left to right, _StridedShard piece by piece), and the
//    ranks together hold every element exactly (number of non-sharding mesh dims' sizes) times;
//  - a plan starts at the source, ends at the target and the search plan costs no more than greedy.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/layout.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "dtensor/plan/planner.h"
#include "dtensor/spec.h"
#include "kernels/error.h"

namespace {

using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::Placements;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "layout_fuzz: %s\n", what.c_str());
  std::abort();
}

// Runs f; the only acceptable exceptions are InvalidArgument and Unsupported (one line each).
template <class F>
bool accepted(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const kernels::InvalidArgument& e) {
    if (std::string_view(e.what()).find('\n') != std::string_view::npos) fail(std::string(what) + ": multi-line message");
  } catch (const kernels::Unsupported& e) {
    if (std::string_view(e.what()).find('\n') != std::string_view::npos) fail(std::string(what) + ": multi-line message");
  } catch (const std::exception& e) {
    fail(std::string(what) + " threw an unexpected exception: " + e.what());
  }
  return false;
}

// torch.chunk of a list into k pieces: ceil-sized, trailing pieces may be empty.
std::vector<int64_t> chunk_of(const std::vector<int64_t>& list, int64_t k, int64_t index) {
  const int64_t n = static_cast<int64_t>(list.size());
  const int64_t c = (n + k - 1) / k;  // small n here: no overflow
  const int64_t begin = std::min(n, index * c), end = std::min(n, (index + 1) * c);
  return {list.begin() + begin, list.begin() + end};
}

// A RaggedShard's boundary i of a list of n (NOTE [ragged view]: floor(n x P_i / U) rounded down
// to a multiple of align; the last boundary is n).
int64_t ragged_boundary(int64_t n, const std::vector<int64_t>& units, int64_t align, size_t i) {
  if (i == units.size()) return n;
  __extension__ typedef __int128 Wide;
  Wide before = 0, total = 0;
  for (size_t j = 0; j < units.size(); ++j) (j < i ? before : total) += units[j];
  total += before;
  const int64_t b = static_cast<int64_t>(Wide{n} * before / total);
  return b - b % align;
}

// The shape layouts use (NOTE [ragged view]): dims before a RaggedShard's dim, then the product
// of the rest.
Dims view_of(const Dims& shape, const Placements& ps) {
  for (const auto& p : ps)
    if (const auto* r = std::get_if<dtensor::RaggedShard>(&p)) {
      Dims view;
      int64_t flat = 1;
      for (int t = 0; t < shape.size(); ++t) (t < r->dim ? view.push_back(shape[t]) : void(flat *= shape[t]));
      view.push_back(flat);
      return view;
    }
  return shape;
}

// The held index lists of the rank at coord, by the definitions (docs/pytorch-semantics.md
// 2.1-2.3), of the view when a mesh dim is ragged.
std::vector<std::vector<int64_t>> reference_layout(const Dims& global_shape, const Dims& mesh_shape,
                                                   const Placements& ps, const Dims& coord) {
  const Dims shape = view_of(global_shape, ps);
  std::vector<std::vector<int64_t>> held(shape.size());
  for (int t = 0; t < shape.size(); ++t)
    for (int64_t i = 0; i < shape[t]; ++i) held[t].push_back(i);
  for (int m = 0; m < mesh_shape.size(); ++m) {
    if (const auto* s = std::get_if<dtensor::Shard>(&ps[m])) {
      held[s->dim] = chunk_of(held[s->dim], mesh_shape[m], coord[m]);
    } else if (const auto* s = std::get_if<dtensor::StridedShard>(&ps[m])) {
      std::vector<int64_t> out;
      for (int64_t j = 0; j < s->split_factor; ++j) {
        const std::vector<int64_t> piece = chunk_of(held[s->dim], s->split_factor, j);
        if (piece.empty()) break;
        const std::vector<int64_t> sub = chunk_of(piece, mesh_shape[m], coord[m]);
        out.insert(out.end(), sub.begin(), sub.end());
      }
      held[s->dim] = std::move(out);
    } else if (const auto* r = std::get_if<dtensor::RaggedShard>(&ps[m])) {
      std::vector<int64_t>& list = held[shape.size() - 1];
      const int64_t n = static_cast<int64_t>(list.size());
      const size_t c = static_cast<size_t>(coord[m]);
      list = {list.begin() + ragged_boundary(n, r->units, r->align, c),
              list.begin() + ragged_boundary(n, r->units, r->align, c + 1)};
    }
  }
  return held;
}

void check_layouts(const dtensor::DTensorSpec& spec) {
  const DeviceMesh& mesh = *spec.mesh;
  const Dims shape = view_of(spec.shape, spec.placements);
  int64_t copies = 1;  // how many ranks hold each element
  for (int m = 0; m < mesh.ndim(); ++m)
    if (dtensor::is_replicate(spec.placements[m]) || dtensor::is_partial(spec.placements[m])) copies *= mesh.size(m);
  std::map<std::vector<int64_t>, int64_t> count;
  for (int rank : mesh.ranks()) {
    const Dims coord = *mesh.coord_of(rank);
    const dtensor::ShardLayout l = *spec.layout(rank);
    const auto want = reference_layout(spec.shape, mesh.shape(), spec.placements, coord);
    if (l.local_shape.size() != shape.size()) fail("layout has the wrong number of dims: " + dtensor::to_string(spec));
    for (int t = 0; t < shape.size(); ++t) {
      if (l.indices(t) != want[t]) fail("layout differs from the reference: " + dtensor::to_string(spec));
      if (l.local_shape[t] != static_cast<int64_t>(want[t].size())) fail("local_shape differs: " + dtensor::to_string(spec));
      // NOTE [sentinel offset]: a sharded dim's offset is its first held index, or the global
      // size when the rank holds none of it; an unsharded dim's offset is 0.
      bool sharded = false;
      for (int m = 0; m < mesh.ndim(); ++m)
        sharded = sharded || dtensor::shard_dim(spec.placements[m]) == t ||
                  (dtensor::is_ragged(spec.placements[m]) && t == shape.size() - 1);
      const int64_t offset = !sharded ? 0 : want[t].empty() ? shape[t] : want[t].front();
      if (l.global_offset[t] != offset) fail("global_offset differs: " + dtensor::to_string(spec));
    }
    // Count every held element (the Cartesian product of the per-dim lists).
    std::vector<size_t> at(shape.size(), 0);
    bool empty = false;
    for (const auto& w : want) empty = empty || w.empty();
    if (empty) continue;
    for (;;) {
      std::vector<int64_t> idx(shape.size());
      for (size_t t = 0; t < at.size(); ++t) idx[t] = want[t][at[t]];
      ++count[idx];
      size_t t = at.size();
      while (t > 0 && ++at[t - 1] == want[t - 1].size()) at[--t] = 0;
      if (t == 0) break;
    }
  }
  const int64_t numel = shape.product();
  if (numel > 0 && static_cast<int64_t>(count.size()) != numel) fail("some element is held by no rank: " + dtensor::to_string(spec));
  for (const auto& [idx, c] : count)
    if (c != copies) fail("an element is held " + std::to_string(c) + " times, not " + std::to_string(copies));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> lines(1);
  for (char c : text) {
    if (c == '\n') lines.emplace_back();
    else lines.back() += c;
  }
  lines.resize(4);

  std::shared_ptr<const DeviceMesh> mesh;
  accepted("DeviceMesh::parse", [&] { mesh = std::make_shared<const DeviceMesh>(DeviceMesh::parse(lines[0])); });
  Placements placements, target;
  const bool have_placements = accepted("parse_placements", [&] { placements = dtensor::parse_placements(lines[2]); });
  const bool have_target = !lines[3].empty() && accepted("parse_placements", [&] { target = dtensor::parse_placements(lines[3]); });
  if (have_placements && dtensor::parse_placements(dtensor::to_string(placements)) != placements)
    fail("placements do not round-trip: " + dtensor::to_string(placements));
  if (mesh && mesh->size() <= 4096 && !(DeviceMesh::parse(dtensor::to_string(*mesh)) == *mesh))
    fail("mesh does not round-trip: " + dtensor::to_string(*mesh));
  Dims shape;
  if (!mesh || !have_placements || !accepted("parse_shape", [&] { shape = kernels::parse_shape(lines[1]); })) return 0;

  dtensor::DTensorSpec spec;
  if (!accepted("make_spec", [&] { spec = dtensor::make_spec(mesh, placements, shape, kernels::DType::kF32); })) return 0;
  // Layouts of a few ranks on any problem (exercises the checked arithmetic near int64).
  for (size_t i = 0; i < mesh->ranks().size() && i < 4; ++i)
    accepted("compute_layout", [&] { (void)spec.layout(mesh->ranks()[i]); });
  int64_t numel = 0;
  accepted("numel", [&] { numel = shape.product(); });
  bool small = mesh->size() <= 32 && numel <= 2048;
  for (int64_t s : shape) small = small && s <= 2048;  // the reference lists every index of a dim
  bool layouts_ok = false;
  if (small) layouts_ok = accepted("layouts", [&] { check_layouts(spec); });
  if (!have_target || !small || !layouts_ok) return 0;
  accepted("plan_redistribute", [&] {
    const dtensor::Plan greedy = dtensor::plan_redistribute(spec, target, dtensor::PlannerKind::kGreedy);
    const dtensor::Plan search = dtensor::plan_redistribute(spec, target, dtensor::PlannerKind::kSearch);
    const Placements dst = dtensor::normalize_placements(target, mesh->ndim(), shape.size());
    for (const dtensor::Plan* p : {&greedy, &search})
      if (p->states.front() != spec.placements || p->states.back() != dst || p->states.size() != p->steps.size() + 1)
        fail("malformed plan " + dtensor::to_string(*p));
    if (search.cost_us > greedy.cost_us * (1 + 1e-9) + 1e-9) fail("search costs more than greedy");
  });
  return 0;
}
