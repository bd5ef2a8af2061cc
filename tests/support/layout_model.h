// An independent model of the ownership rules (docs/pytorch-semantics.md 2.1-2.4) on explicit index
// lists, written apart from dtensor/layout.cpp's run-based code so tests can compare the two.
//   model_layout({7}, {3, 2}, [_S(0,2),S(0)], {2, 0}) == {{6}}
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "dtensor/placement.h"
#include "kernels/dims.h"

namespace testing_support {

using Indices = std::vector<int64_t>;

// Piece r of `cur` split over k: torch.chunk (split_factor 0) or the two-level strided split.
inline Indices model_split(const Indices& cur, int64_t k, int64_t r, int split_factor) {
  auto piece = [](int64_t n, int64_t parts, int64_t i) {
    int64_t c = (n + parts - 1) / parts;
    int64_t begin = std::min(n, i * c), end = std::min(n, (i + 1) * c);
    return std::pair<int64_t, int64_t>{begin, end};
  };
  Indices out;
  int64_t n = static_cast<int64_t>(cur.size());
  if (split_factor == 0) {
    auto [b, e] = piece(n, k, r);
    return Indices(cur.begin() + b, cur.begin() + e);
  }
  for (int64_t j = 0; j < split_factor; ++j) {
    auto [pb, pe] = piece(n, split_factor, j);
    auto [sb, se] = piece(pe - pb, k, r);
    out.insert(out.end(), cur.begin() + pb + sb, cur.begin() + pb + se);
  }
  return out;
}

// Per tensor dim, the global indices the rank at `coord` holds, in local order.
inline std::vector<Indices> model_layout(const kernels::Dims& shape, const kernels::Dims& mesh,
                                         const dtensor::Placements& ps, const kernels::Dims& coord) {
  std::vector<Indices> idx(shape.size());
  for (int t = 0; t < shape.size(); ++t) {
    idx[t].resize(shape[t]);
    std::iota(idx[t].begin(), idx[t].end(), 0);
  }
  for (int m = 0; m < mesh.size(); ++m) {
    if (const auto* s = std::get_if<dtensor::Shard>(&ps[m])) idx[s->dim] = model_split(idx[s->dim], mesh[m], coord[m], 0);
    if (const auto* s = std::get_if<dtensor::StridedShard>(&ps[m]))
      idx[s->dim] = model_split(idx[s->dim], mesh[m], coord[m], s->split_factor);
  }
  return idx;
}

// The row-major flat indices of every element the rank holds, sorted.
inline Indices model_elements(const kernels::Dims& shape, const kernels::Dims& mesh,
                              const dtensor::Placements& ps, const kernels::Dims& coord) {
  const std::vector<Indices> idx = model_layout(shape, mesh, ps, coord);
  Indices out = {0};
  for (int t = 0; t < shape.size(); ++t) {
    Indices next;
    for (int64_t base : out)
      for (int64_t i : idx[t]) next.push_back(base * shape[t] + i);
    out = std::move(next);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace testing_support
