// The contiguous (zero-copy) FSDP layout's arithmetic (issue 28; Layout::kContiguous in
// fsdp/fully_shard.h): where each parameter sits in its group's flat buffer, which range of that
// buffer each dp rank holds, and each parameter's RaggedShard placement. Pure functions.
//
// A group's parameters are laid out parameter-major, each at an offset rounded up to `align`
// elements; the flat buffer's N elements (the last parameter's end rounded up to whole blocks of
// dp x align) are Rg(0,[1,...,1],align) over the dp ranks: N / dp elements each, so by bytes too
// (one dtype per group), and the collectives take their equal-count forms. Parameter i is
// Rg(0,[its overlap with each rank's range],1) of its own global shape.
//
//   three parameters of 10, 6 and 3 elements, align 4, dp 3:
//     offsets 0, 12, 20 (10 -> 12 and 18 -> 20 rounded up), end 23, N = 24 (blocks of 12)
//     rank ranges (ragged_boundaries(24, [1,1,1], 4)): [0,8) [8,16) [16,24)
//     parameter 0 [0,10):  Rg(0,[8,2,0],1)   parameter 1 [12,18): Rg(0,[0,4,2],1)
//     parameter 2 [20,23): Rg(0,[0,0,3],1)   (the gaps [10,12), [18,20) and [23,24) stay zero)
// With frozen parameters last, the gradient buffer covers the trainable prefix [0, Ng) (Ng = N
// when every parameter is trainable): the same rank ranges clipped to Ng, as
// Rg(0,[clipped sizes],1).
#pragma once

#include <cstdint>
#include <vector>

#include "dtensor/placement.h"
#include "kernels/dtype.h"

namespace fsdp::detail {

struct ContiguousLayout {
  int64_t align = 1;
  int64_t numel = 0;       // N: the flat buffer's elements (a multiple of dp x align)
  int64_t grad_numel = 0;  // Ng: the end of the trainable prefix, N when all are (0: none)
  std::vector<int64_t> offsets, numels;  // per parameter
  std::vector<int64_t> bounds;           // dp + 1 rank boundaries of [0, N)

  int64_t dp() const { return static_cast<int64_t>(bounds.size()) - 1; }
  int64_t begin(int64_t rank) const { return bounds[rank]; }
  int64_t size(int64_t rank) const { return bounds[rank + 1] - bounds[rank]; }
  // The same ranges clipped to the gradient prefix.
  int64_t grad_begin(int64_t rank) const;
  int64_t grad_size(int64_t rank) const;
  // Parameter i's overlap with rank r's range: [start, start + size) in flat elements.
  int64_t overlap_start(size_t i, int64_t rank) const;
  int64_t overlap_size(size_t i, int64_t rank) const;

  dtensor::Placement flat_placement() const;       // Rg(0,[1,...,1],align)
  dtensor::Placement grad_flat_placement() const;  // Rg(0,[clipped sizes],1); REQUIRES grad_numel > 0
  dtensor::Placement param_placement(size_t i) const;  // Rg(0,[overlaps],1)
};

// The alignment in elements: 16 bytes of the narrowest of the group's dtypes (original, param,
// reduce), so every parameter's view starts 16-byte aligned in each of the three buffers (the
// vector width of the CPU kernels and what CUDA's 128-bit loads want).
int64_t contiguous_align(kernels::DType orig, kernels::DType param, kernels::DType reduce);

// REQUIRES: every numel >= 1, the trainable ones first (`trainable` of them), dp >= 1, align >= 1.
// Throws InvalidArgument on overflow.
ContiguousLayout lay_out_contiguous(const std::vector<int64_t>& numels, size_t trainable, int64_t dp, int64_t align);

}  // namespace fsdp::detail
