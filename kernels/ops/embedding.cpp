#include "kernels/ops/embedding.h"

#include <fmt/format.h>

#include <vector>

#include "kernels/cpu/compute.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/detail/row_plan.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {
namespace {

using detail::EmbeddingPlan;

Dims out_shape(const Tensor& ids, int64_t d) {
  Dims s = ids.shape();
  s.push_back(d);
  return s;
}

// Fills the shard / range / padding fields; `rows` is the table (shard) height.
EmbeddingPlan make_plan(const char* op, const Tensor& ids, int64_t rows, int64_t d,
                        const EmbeddingOptions& o) {
  if (o.row_start < 0) {
    throw InvalidArgument(fmt::format("{}: row_start is {}, expected >= 0", op, o.row_start));
  }
  const int64_t total = o.num_embeddings < 0 ? o.row_start + rows : o.num_embeddings;
  if (o.row_start + rows > total) {
    throw InvalidArgument(fmt::format(
        "{}: the table holds rows [{}, {}) but num_embeddings is {} (expected row_start + rows <= "
        "num_embeddings)",
        op, o.row_start, o.row_start + rows, total));
  }
  EmbeddingPlan p;
  p.ids_dtype = ids.dtype();
  p.ids_shape = ids.shape();
  p.ids_strides = ids.strides();
  if (ids.numel() > 0) p.ids = ids.data_ptr();
  p.dim = d;
  p.row_start = o.row_start;
  p.rows = rows;
  p.num_embeddings = total;
  if (o.padding_idx.has_value()) {
    int64_t pad = *o.padding_idx;
    if (pad < -total || pad >= total) {
      throw InvalidArgument(
          fmt::format("{}: padding_idx {} out of range for {} embeddings", op, pad, total));
    }
    if (pad < 0) pad += total;
    p.has_padding = true;
    p.padding_idx = pad;
  }
  return p;
}

// The range check of ids on the host: for CUDA ids (the CPU kernels check inline), and for
// CPU ids when no kernel runs (empty rows).
void check_ids_on_host(const char* op, const Tensor& ids, int64_t total, bool force) {
  if (!force && !ids.device().is_cuda()) return;
  const std::vector<double> v = ids.to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    const auto id = static_cast<int64_t>(v[i]);
    if (id < 0 || id >= total) {
      throw InvalidArgument(fmt::format("{}: id {} at position {} is out of range (expected 0..{})",
                                        op, id, i, total - 1));
    }
  }
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids, const EmbeddingOptions& options) {
  detail::check_floating("embedding", weight, "weight");
  detail::check_index("embedding", ids, "ids");
  if (weight.ndim() != 2) {
    throw InvalidArgument(
        fmt::format("embedding: weight has shape {}, expected [rows, D]", weight.shape()));
  }
  Tensor out = Tensor::empty(out_shape(ids, weight.size(1)), weight.dtype(), weight.device());
  embedding_out(out, weight, ids, options);
  return out;
}

void embedding_out(const Tensor& out, const Tensor& weight, const Tensor& ids,
                   const EmbeddingOptions& options) {
  constexpr const char* kOp = "embedding";
  detail::check_floating(kOp, weight, "weight");
  detail::check_index(kOp, ids, "ids");
  detail::check_floating(kOp, out, "out");
  if (weight.ndim() != 2) {
    throw InvalidArgument(
        fmt::format("{}: weight has shape {}, expected [rows, D]", kOp, weight.shape()));
  }
  detail::check_same_device(kOp, {{"weight", weight}, {"ids", ids}, {"out", out}});
  const int64_t d = weight.size(1);
  detail::check_shape(kOp, out, "out", out_shape(ids, d));
  detail::check_writable(kOp, out, "out");
  if (detail::may_overlap(out, weight) || detail::may_overlap(out, ids)) {
    throw InvalidArgument(fmt::format("{}: out overlaps weight or ids", kOp));
  }
  EmbeddingPlan p = make_plan(kOp, ids, weight.size(0), d, options);
  check_ids_on_host(kOp, ids, p.num_embeddings, out.numel() == 0);
  if (out.numel() == 0) return;
  if (weight.numel() > 0) {
    p.table.data = weight.data_ptr();
    p.table.dtype = weight.dtype();
    p.table.outer_strides = Dims{weight.stride(0)};
    p.table.stride = weight.stride(1);
  }
  p.out = detail::as_rows(out, out.ndim() - 1);
  if (out.device().is_cuda()) {
    detail::cuda_embedding_forward(p, out.device().index);
  } else {
    detail::cpu_embedding_forward(p);
  }
}

Tensor embedding_backward(const Tensor& dy, const Tensor& ids, int64_t rows,
                          const EmbeddingOptions& options) {
  detail::check_floating("embedding_backward", dy, "dy");
  if (rows < 0) {
    throw InvalidArgument(fmt::format("embedding_backward: rows is {}, expected >= 0", rows));
  }
  if (dy.ndim() < 1) {
    throw InvalidArgument("embedding_backward: dy is 0-d, expected ids.shape + [D]");
  }
  Tensor dw = Tensor::empty({rows, dy.size(-1)}, dy.dtype(), dy.device());
  embedding_backward_out(dw, dy, ids, options, false);
  return dw;
}

void embedding_backward_out(const Tensor& dweight, const Tensor& dy, const Tensor& ids,
                            const EmbeddingOptions& options, bool accumulate) {
  constexpr const char* kOp = "embedding_backward";
  detail::check_floating(kOp, dweight, "dweight");
  detail::check_floating(kOp, dy, "dy");
  detail::check_index(kOp, ids, "ids");
  detail::check_same_device(kOp, {{"dweight", dweight}, {"dy", dy}, {"ids", ids}});
  if (dweight.ndim() != 2) {
    throw InvalidArgument(
        fmt::format("{}: dweight has shape {}, expected [rows, D]", kOp, dweight.shape()));
  }
  const int64_t d = dweight.size(1);
  detail::check_shape(kOp, dy, "dy", out_shape(ids, d));
  detail::check_writable(kOp, dweight, "dweight");
  if (detail::may_overlap(dweight, dy) || detail::may_overlap(dweight, ids)) {
    throw InvalidArgument(fmt::format("{}: dweight overlaps dy or ids", kOp));
  }
  EmbeddingPlan p = make_plan(kOp, ids, dweight.size(0), d, options);
  check_ids_on_host(kOp, ids, p.num_embeddings, dy.numel() == 0);
  // The kernels add into a contiguous accumulator of the compute type: dweight itself when it is
  // one, else a temporary (widened from dweight when accumulating) rounded into dweight once.
  const DType acc_dtype = dweight.dtype() == DType::kF64 ? DType::kF64 : DType::kF32;
  const bool direct = dweight.dtype() == acc_dtype && dweight.is_contiguous();
  Tensor acc = direct ? dweight : Tensor::empty(dweight.shape(), acc_dtype, dweight.device());
  if (accumulate) {
    if (!direct) acc.copy_(dweight);
  } else {
    acc.fill_(0.0);
  }
  if (dy.numel() > 0) {
    p.dy = detail::as_rows(dy, dy.ndim() - 1);
    if (acc.numel() > 0) p.dw = acc.data_ptr();  // else a shard of 0 rows: nothing lands here
    p.dw_dtype = acc_dtype;
    if (dweight.device().is_cuda()) {
      detail::cuda_embedding_backward(p, dweight.device().index);
    } else {
      detail::cpu_embedding_backward(p);
    }
  }
  if (!direct) Tensor(dweight).copy_(acc);
}

}  // namespace kernels
