// Exhaustive properties of the ownership rules over small meshes, every tensor-dim size 0..9 and
// every placement list drawn from S/_S/R/P, checked against an independent index-list model.
#include <catch2/catch.hpp>

#include <map>
#include <numeric>

#include "support/layout_model.h"

#include "dtensor/layout.h"
#include "dtensor/spec.h"

using namespace dtensor;

namespace {

using testing_support::Indices;
using testing_support::model_layout;

// Every placement list over `mesh_ndim` mesh dims for a tensor of `tensor_ndim` dims.
std::vector<Placements> all_placement_lists(int mesh_ndim, int tensor_ndim) {
  std::vector<Placement> options = {Replicate{}, Partial{}};
  for (int t = 0; t < tensor_ndim; ++t) {
    options.push_back(Shard{t});
    for (int sf = 1; sf <= 3; ++sf) options.push_back(StridedShard{t, sf});
  }
  std::vector<Placements> lists = {{}};
  for (int m = 0; m < mesh_ndim; ++m) {
    std::vector<Placements> next;
    for (const auto& l : lists)
      for (const auto& o : options) {
        next.push_back(l);
        next.back().push_back(o);
      }
    lists = std::move(next);
  }
  return lists;
}

}  // namespace

TEST_CASE("exhaustive layout properties", "[dtensor][layout][exhaustive]") {
  const std::vector<Dims> meshes = {{1}, {4}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}, {3, 2, 2}};
  int64_t checked = 0;
  for (const Dims& mesh : meshes) {
    // 1-D tensors of size 0..9 everywhere; 2-D tensors (sizes 0..9 x 0..9, thinned on the two
    // 3-D meshes to keep the run short) exercise independence of tensor dims.
    for (int tensor_ndim : {1, 2}) {
      std::vector<Dims> shapes;
      for (int64_t a = 0; a <= 9; ++a) {
        if (tensor_ndim == 1) shapes.push_back({a});
        else
          for (int64_t b = 0; b <= 9; ++b)
            if (mesh.size() < 3 || (a + b) % 3 == 0 || a < 2 || b < 2) shapes.push_back({a, b});
      }
      for (const Placements& ps : all_placement_lists(mesh.size(), tensor_ndim)) {
        for (const Dims& shape : shapes) {
          const int64_t nranks = mesh.product();
          // Element -> number of holders, for the coverage property.
          std::map<std::pair<int64_t, int64_t>, int> holders;
          for (int64_t r = 0; r < nranks; ++r) {
            Dims coord = unravel_index(r, mesh);
            ShardLayout l = compute_layout(shape, mesh, ps, coord);
            std::vector<Indices> model = model_layout(shape, mesh, ps, coord);
            for (int t = 0; t < tensor_ndim; ++t) {
              Indices got = l.indices(t);
              bool sharded = false;
              for (const Placement& p : ps) sharded |= shard_dim(p) == t;
              // Same indices as the model; local shape = count; offset = first or sentinel.
              if (got != model[t] || l.local_shape[t] != static_cast<int64_t>(got.size()) ||
                  l.global_offset[t] != (!sharded ? 0 : got.empty() ? shape[t] : got[0])) {
                FAIL_CHECK("mesh [" << mesh[0] << "..] ndim " << mesh.size() << " placements "
                           << to_string(ps) << " shape[" << t << "]=" << shape[t] << " rank " << r);
              }
              // Runs are maximal (adjacent runs merged).
              const IndexRuns& runs = l.runs[t];
              for (size_t i = 1; i < runs.size(); ++i)
                if (runs[i - 1].start + runs[i - 1].length == runs[i].start)
                  FAIL_CHECK("unmerged runs for " << to_string(ps));
            }
            Indices i0 = l.indices(0);
            Indices i1 = tensor_ndim == 2 ? l.indices(1) : Indices{0};
            for (int64_t a : i0)
              for (int64_t b : i1) ++holders[{a, b}];
            ++checked;
          }
          // Within each mesh-dim group the held indices partition the group's extent: every
          // element is held exactly once per sharding mesh dim, so the number of holders is the
          // product of the sizes of the non-sharding mesh dims.
          int expected = 1;
          for (int m = 0; m < mesh.size(); ++m)
            if (!shard_dim(ps[m])) expected *= static_cast<int>(mesh[m]);
          int64_t elements = shape[0] * (tensor_ndim == 2 ? shape[1] : 1);
          if (static_cast<int64_t>(holders.size()) != elements)
            FAIL_CHECK("coverage: " << to_string(ps) << " holds " << holders.size() << " of "
                                    << elements << " elements");
          for (const auto& [element, count] : holders)
            if (count != expected) {
              FAIL_CHECK("element held " << count << " times, expected " << expected << " for "
                                         << to_string(ps));
              break;
            }
        }
      }
    }
  }
  INFO(checked << " rank layouts checked");
  CHECK(checked > 100000);
}

TEST_CASE("group partition: each mesh dim splits exactly what its group jointly holds",
          "[dtensor][layout][exhaustive]") {
  // For mesh dim m, the members of a group (coords equal except at m) hold, under the
  // placements up to m, a partition of what they held under the placements up to m-1.
  const std::vector<Dims> meshes = {{4}, {2, 2}, {2, 3}, {3, 2}, {2, 2, 2}, {3, 2, 2}};
  for (const Dims& mesh : meshes)
    for (const Placements& ps : all_placement_lists(mesh.size(), 1))
      for (int64_t n = 0; n <= 9; ++n)
        for (int m = 0; m < mesh.size(); ++m) {
          Placements before(ps.begin(), ps.begin() + m), upto(ps.begin(), ps.begin() + m + 1);
          Dims sub_mesh(std::span<const int64_t>(mesh.data(), m + 1));
          before.push_back(Replicate{});
          for (int64_t flat = 0; flat < sub_mesh.product(); ++flat) {
            Dims coord = unravel_index(flat, sub_mesh);
            if (coord[m] != 0) continue;  // one representative per group
            Indices whole = compute_layout({n}, sub_mesh, before, coord).indices(0);
            Indices parts;
            for (int64_t c = 0; c < mesh[m]; ++c) {
              coord[m] = c;
              Indices p = compute_layout({n}, sub_mesh, upto, coord).indices(0);
              if (!shard_dim(ps[m])) CHECK(p == whole);
              else parts.insert(parts.end(), p.begin(), p.end());
            }
            if (shard_dim(ps[m])) {
              std::sort(parts.begin(), parts.end());
              Indices sorted_whole = whole;
              std::sort(sorted_whole.begin(), sorted_whole.end());
              if (parts != sorted_whole) FAIL_CHECK("partition broken for " << to_string(ps) << " n=" << n);
            }
          }
        }
}
