// Test data for redistribute checks: element values are a function of the global index, so every
// rank checks its own shard with no gather; Partial sources get per-rank integer contributions
// whose reduction over the Partial mesh dims is exactly that value.
#pragma once

#include <cmath>
#include <string>

#include "dtensor/spec.h"
#include "kernels/tensor.h"

namespace testing_support {

using dtensor::Dims;
using dtensor::DTensorSpec;
using kernels::Tensor;

// The value of global element `index` (row-major flat index + 1, exact in every dtype up to 256
// elements for the 8-bit types... callers keep sizes small for u8/bf16).
inline double global_value(const Dims& shape, std::span<const int64_t> index) {
  int64_t flat = 0;
  for (int d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return static_cast<double>(flat % 61 + 1);
}

// The local shard of `rank` under spec, with Partial contributions for Partial mesh dims.
inline Tensor make_local(const DTensorSpec& spec, int rank) {
  const dtensor::ShardLayout l = *spec.layout(rank);
  const Dims coord = *spec.mesh->coord_of(rank);
  // Flat index q of this rank among the K ranks of its Partial mesh dims, and the op.
  int64_t q = 0, K = 1;
  std::optional<kernels::ReduceOp> op;
  for (int m = 0; m < spec.mesh->ndim(); ++m)
    if (const auto* p = std::get_if<dtensor::Partial>(&spec.placements[m])) {
      q = q * spec.mesh->size(m) + coord[m];
      K *= spec.mesh->size(m);
      op = p->op;
    }
  std::vector<std::vector<int64_t>> idx;
  for (int t = 0; t < spec.tensor_ndim(); ++t) idx.push_back(l.indices(t));
  Tensor out = Tensor::empty(l.local_shape, spec.dtype);
  out.fill_index_([&](std::span<const int64_t> local) {
    Dims global = Dims::filled(spec.tensor_ndim(), 0);
    for (int t = 0; t < spec.tensor_ndim(); ++t) global[t] = idx[t][local[t]];
    const double v = global_value(spec.shape, std::span<const int64_t>(global.data(), global.size()));
    if (!op || K == 1) return v;
    const double s = static_cast<double>(global[0] % 3 + 1);
    switch (*op) {
      case kernels::ReduceOp::kSum: return q == 0 ? v - (K - 1) * s : s;
      case kernels::ReduceOp::kAvg: return q == 0 ? K * v - (K - 1) * s : s;
      case kernels::ReduceOp::kMin: return v + q;
      case kernels::ReduceOp::kMax: return v - q;
      case kernels::ReduceOp::kProd: return q == 0 ? v : 1.0;
    }
    return v;
  });
  return out;
}

// Empty when `local` holds exactly the global values of its shard under spec (which must have
// no Partial placement), else a description of the first wrong element.
inline std::string check_local(const DTensorSpec& spec, int rank, const Tensor& local) {
  const dtensor::ShardLayout l = *spec.layout(rank);
  if (!(local.shape() == l.local_shape)) return "wrong local shape";
  std::vector<std::vector<int64_t>> idx;
  for (int t = 0; t < spec.tensor_ndim(); ++t) idx.push_back(l.indices(t));
  std::vector<double> got = local.to_vector();
  Dims pos = Dims::filled(spec.tensor_ndim(), 0);
  for (size_t e = 0; e < got.size(); ++e) {
    Dims global = Dims::filled(spec.tensor_ndim(), 0);
    for (int t = 0; t < spec.tensor_ndim(); ++t) global[t] = idx[t][pos[t]];
    const double want = global_value(spec.shape, std::span<const int64_t>(global.data(), global.size()));
    if (got[e] != want) return "element " + std::to_string(e) + " is " + std::to_string(got[e]) +
                               ", expected " + std::to_string(want);
    for (int t = spec.tensor_ndim() - 1; t >= 0; --t) {
      if (++pos[t] < l.local_shape[t]) break;
      pos[t] = 0;
    }
  }
  return {};
}

}  // namespace testing_support
