// Internal: simplification of strided iteration spaces shared by the CPU copy and the CUDA
// launchers. Host-only plain C++.
//   shape [4,1,6], strides {[6,6,1], [6,6,1]}  ->  shape [24], strides {[1], [1]}
#pragma once

#include <array>
#include <cstdint>

#include "kernels/dims.h"

namespace kernels::detail {

// An iteration space over `shape` with N stride lists (one per operand), in elements.
template <int N>
struct StridedSpace {
  Dims shape;
  std::array<Dims, N> strides;
};

// Drops size-1 dims and merges neighbours that are contiguous with respect to every operand,
// so the innermost loop is as long as possible. Always returns at least one dim (a 0-d or
// all-ones shape becomes [1]). REQUIRES: every stride list has shape.size() entries, numel > 0.
template <int N>
StridedSpace<N> coalesce(const Dims& shape, const std::array<Dims, N>& strides) {
  StridedSpace<N> out;
  for (int d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    const int last = out.shape.size() - 1;
    bool merge = last >= 0;
    for (int k = 0; k < N && merge; ++k) {
      merge = out.strides[k][last] == strides[k][d] * shape[d];
    }
    if (merge) {
      out.shape[last] *= shape[d];
      for (int k = 0; k < N; ++k) out.strides[k][last] = strides[k][d];
    } else {
      out.shape.push_back(shape[d]);
      for (int k = 0; k < N; ++k) out.strides[k].push_back(strides[k][d]);
    }
  }
  if (out.shape.empty()) {
    out.shape.push_back(1);
    for (int k = 0; k < N; ++k) out.strides[k].push_back(1);
  }
  return out;
}

}  // namespace kernels::detail
