// Test data for redistribute checks: element values are a function of the global index, so every
// rank checks its own shard with no gather; Partial sources get per-rank integer contributions
// whose reduction over the Partial mesh dims is exactly that value.
//
// Values are `flat % modulus + 1` (flat = row-major global index). The default modulus 61 suits
// small tensors in every dtype; exact_modulus(dtype, mesh size) gives the largest modulus for
// which every value, every contribution and every partial reduction stays exact in the dtype
// (e.g. 32 for bf16 on 8 ranks, 31 for u8 on 8 ranks, 2^24/32 for f32 on 8 ranks).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dtensor/spec.h"
#include "kernels/tensor.h"

namespace testing_support {

using dtensor::Dims;
using dtensor::DTensorSpec;
using kernels::Tensor;

inline constexpr int64_t kDefaultModulus = 61;

// The value of global element `index`: row-major flat index modulo `modulus`, plus 1.
inline double global_value(const Dims& shape, std::span<const int64_t> index,
                           int64_t modulus = kDefaultModulus) {
  int64_t flat = 0;
  for (int d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return static_cast<double>(flat % modulus + 1);
}

// The largest modulus for which make_local/check_local stay exact in `dtype` on a mesh of
// `mesh_size` ranks (K <= mesh_size contributions: an average needs K * value, a min value + K).
inline int64_t exact_modulus(kernels::DType dtype, int64_t mesh_size) {
  const int64_t n = std::max<int64_t>(mesh_size, 1);
  int64_t m = kDefaultModulus;
  switch (dtype) {
    case kernels::DType::kF32: m = (int64_t{1} << 24) / (4 * n); break;
    case kernels::DType::kF64:
    case kernels::DType::kI64: m = (int64_t{1} << 50) / (4 * n); break;
    case kernels::DType::kI32: m = (int64_t{1} << 30) / (4 * n); break;
    case kernels::DType::kF16: m = 2048 / n; break;
    case kernels::DType::kBF16: m = 256 / n; break;
    case kernels::DType::kU8: m = 255 / n; break;
    default: m = 8; break;  // fp8 storage types: small integers only
  }
  return std::max<int64_t>(m, 1);
}

// The local shard of `rank` under spec, with Partial contributions for Partial mesh dims.
// Sum/avg (mixable): contributions sum to value * (product of the avg dims' sizes). u8 gets
// non-negative contributions only (unsigned arithmetic must not wrap).
inline Tensor make_local(const DTensorSpec& spec, int rank, int64_t modulus = kDefaultModulus) {
  const dtensor::ShardLayout l = *spec.layout(rank);
  const Dims coord = *spec.mesh->coord_of(rank);
  // Flat index q of this rank among the K ranks of its Partial mesh dims, and the op.
  int64_t q = 0, K = 1, K_avg = 1;
  std::optional<kernels::ReduceOp> op;
  for (int m = 0; m < spec.mesh->ndim(); ++m)
    if (const auto* p = std::get_if<dtensor::Partial>(&spec.placements[m])) {
      q = q * spec.mesh->size(m) + coord[m];
      K *= spec.mesh->size(m);
      if (p->op == kernels::ReduceOp::kAvg) K_avg *= spec.mesh->size(m);
      op = p->op;  // ops mix only as sum with avg: then every op here is linear
    }
  const bool unsigned_type = spec.dtype == kernels::DType::kU8;
  Tensor out = Tensor::empty(l.local_shape, spec.dtype);  // first: a ResourceError names its bytes
  std::vector<std::vector<int64_t>> idx;
  for (int t = 0; t < spec.tensor_ndim(); ++t) idx.push_back(l.indices(t));
  out.fill_index_([&](std::span<const int64_t> local) {
    Dims global = Dims::filled(spec.tensor_ndim(), 0);
    for (int t = 0; t < spec.tensor_ndim(); ++t) global[t] = idx[t][local[t]];
    const double v =
        global_value(spec.shape, std::span<const int64_t>(global.data(), global.size()), modulus);
    if (!op || K == 1) return v;
    const double s = static_cast<double>(global[0] % 3 + 1);
    switch (*op) {
      case kernels::ReduceOp::kSum:
      case kernels::ReduceOp::kAvg: {
        // Every partial reduction (sums, and averages dividing exactly, in any order of the
        // mesh dims) stays an integer: rank 0 holds total - (K-1)s, the others s.
        const double total = v * static_cast<double>(K_avg);
        const double step = unsigned_type ? (total >= static_cast<double>(K - 1) ? 1.0 : 0.0) : s;
        return q == 0 ? total - static_cast<double>(K - 1) * step : step;
      }
      case kernels::ReduceOp::kMin: return v + static_cast<double>(q);
      case kernels::ReduceOp::kMax:
        if (unsigned_type) return q == 0 ? v : std::max(0.0, v - static_cast<double>(q));
        return v - static_cast<double>(q);
      case kernels::ReduceOp::kProd: return q == 0 ? v : 1.0;
    }
    return v;
  });
  return out;
}

// The relative error an average may leave in the result of a redistribute from `src`: 0 (exact)
// except for f32/f64 with a P(avg) mesh dim whose size is not a power of two, where reducing
// k * value and scaling by the rounded 1/k (as NCCL's premultiplied average does) may land one
// ulp away. bf16/f16 results round back to the exact integer.
inline double avg_tolerance(const DTensorSpec& src) {
  if (src.dtype != kernels::DType::kF32 && src.dtype != kernels::DType::kF64) return 0;
  for (int m = 0; m < src.mesh->ndim(); ++m) {
    const auto* p = std::get_if<dtensor::Partial>(&src.placements[m]);
    const int64_t k = src.mesh->size(m);
    if (p && p->op == kernels::ReduceOp::kAvg && (k & (k - 1)) != 0)
      return src.dtype == kernels::DType::kF32 ? 1e-6 : 1e-14;
  }
  return 0;
}

// Empty when `local` holds exactly the global values of its shard under spec (which must have
// no Partial placement), else a description of the first wrong element. rel_tol > 0 allows
// |got - want| <= rel_tol * |want| (see avg_tolerance).
inline std::string check_local(const DTensorSpec& spec, int rank, const Tensor& local,
                               int64_t modulus = kDefaultModulus, double rel_tol = 0) {
  const dtensor::ShardLayout l = *spec.layout(rank);
  if (!(local.shape() == l.local_shape)) return "wrong local shape";
  std::vector<std::vector<int64_t>> idx;
  for (int t = 0; t < spec.tensor_ndim(); ++t) idx.push_back(l.indices(t));
  std::vector<double> got = local.to_vector();
  Dims pos = Dims::filled(spec.tensor_ndim(), 0);
  for (size_t e = 0; e < got.size(); ++e) {
    Dims global = Dims::filled(spec.tensor_ndim(), 0);
    for (int t = 0; t < spec.tensor_ndim(); ++t) global[t] = idx[t][pos[t]];
    const double want =
        global_value(spec.shape, std::span<const int64_t>(global.data(), global.size()), modulus);
    if (got[e] != want && !(rel_tol > 0 && std::abs(got[e] - want) <= rel_tol * std::abs(want))) {
      char text[128];
      std::snprintf(text, sizeof text, "element %zu is %.17g, expected %.17g", e, got[e], want);
      return text;
    }
    for (int t = spec.tensor_ndim() - 1; t >= 0; --t) {
      if (++pos[t] < l.local_shape[t]) break;
      pos[t] = 0;
    }
  }
  return {};
}

}  // namespace testing_support
