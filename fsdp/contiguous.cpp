#include "fsdp/contiguous.h"

#include <algorithm>

#include "dtensor/layout.h"
#include "kernels/checked.h"

namespace fsdp::detail {

int64_t ContiguousLayout::grad_begin(int64_t rank) const { return std::min(bounds[rank], grad_numel); }
int64_t ContiguousLayout::grad_size(int64_t rank) const {
  return std::min(bounds[rank + 1], grad_numel) - grad_begin(rank);
}
int64_t ContiguousLayout::overlap_start(size_t i, int64_t rank) const {
  return std::clamp(offsets[i], bounds[rank], bounds[rank + 1]);
}
int64_t ContiguousLayout::overlap_size(size_t i, int64_t rank) const {
  const int64_t end = std::clamp(offsets[i] + numels[i], bounds[rank], bounds[rank + 1]);
  return end - overlap_start(i, rank);
}

dtensor::Placement ContiguousLayout::flat_placement() const {
  return dtensor::RaggedShard{0, std::vector<int64_t>(static_cast<size_t>(dp()), 1), align};
}
dtensor::Placement ContiguousLayout::grad_flat_placement() const {
  std::vector<int64_t> units;
  for (int64_t r = 0; r < dp(); ++r) units.push_back(grad_size(r));
  return dtensor::RaggedShard{0, std::move(units), 1};
}
dtensor::Placement ContiguousLayout::param_placement(size_t i) const {
  std::vector<int64_t> units;
  for (int64_t r = 0; r < dp(); ++r) units.push_back(overlap_size(i, r));
  return dtensor::RaggedShard{0, std::move(units), 1};
}

int64_t contiguous_align(kernels::DType orig, kernels::DType param, kernels::DType reduce) {
  const int64_t narrowest = static_cast<int64_t>(
      std::min({kernels::itemsize(orig), kernels::itemsize(param), kernels::itemsize(reduce)}));
  return std::max<int64_t>(1, 16 / narrowest);
}

ContiguousLayout lay_out_contiguous(const std::vector<int64_t>& numels, size_t trainable, int64_t dp, int64_t align) {
  ContiguousLayout l;
  l.align = align;
  l.numels = numels;
  int64_t end = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t off = kernels::checked_mul(kernels::checked_ceil_div(end, align, "FSDP flat offset"), align,
                                             "FSDP flat offset");
    l.offsets.push_back(off);
    end = kernels::checked_add(off, numels[i], "FSDP flat buffer elements");
    if (i + 1 == trainable) l.grad_numel = end;
  }
  l.numel = end;
  l.bounds = dtensor::ragged_boundaries(l.numel, std::vector<int64_t>(static_cast<size_t>(dp), 1), align);
  return l;
}

}  // namespace fsdp::detail
