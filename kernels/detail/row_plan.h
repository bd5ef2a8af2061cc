// Internal: row-wise kernels (softmax, RMSNorm / LayerNorm, cross-entropy) as raw pointers and
// element strides, built by the kernels/ops front ends and run by the CPU or CUDA back end.
// A "row" is the 1-D slice along the normalised / softmax / vocab dim; rows are enumerated
// row-major over outer_shape. Plain C++.
//   softmax over dim 1 of x [4, 5, 6]: outer_shape [4, 6], len 5, row stride x.stride(1)
#pragma once

#include <cstdint>

#include "kernels/dims.h"
#include "kernels/dtype.h"

namespace kernels::detail {

// A tensor seen as rows: element j of row o is at data + offset(o, outer_strides) + j * stride.
struct RowTensor {
  void* data = nullptr;  // null: absent
  DType dtype = DType::kF32;
  Dims outer_strides;
  int64_t stride = 1;
  bool defined() const { return data != nullptr; }
};

// A per-row value (a statistic): element o at data + offset(o, outer_strides).
using RowValues = RowTensor;

// A [len] vector along the row (weight, bias and their gradients).
struct ColTensor {
  void* data = nullptr;  // null: absent
  DType dtype = DType::kF32;
  int64_t stride = 1;
  bool defined() const { return data != nullptr; }
};

struct SoftmaxPlan {
  Dims outer_shape;
  int64_t len = 0;
  bool log = false;       // log_softmax
  bool backward = false;  // dx from (dy, y) instead of y from x
  RowTensor x;            // forward input, or the saved output y for the backward
  RowTensor dy;           // backward only
  RowTensor out;          // y, or dx
  // Attention (forward, not log): causal_period > 0 masks column j of row o when
  // j > o % causal_period (the row's query index); masked entries of y are 0. lse (optional)
  // receives the row's log-sum-exp over its unmasked columns (-inf when none).
  int64_t causal_period = 0;
  RowValues lse;
  // Attention backward: y = exp(x - lse) on unmasked columns (0 elsewhere), lse read from `lse`.
  bool from_lse = false;
};

struct NormPlan {
  Dims outer_shape;
  int64_t len = 0;
  bool rms = false;
  double eps = 0;
  RowTensor x;
  RowTensor y;               // forward output
  RowValues mean, rstd;      // forward writes them (mean only for LayerNorm); backward reads
  ColTensor weight, bias;    // optional
  RowTensor dy, dx;          // backward (dx optional)
  ColTensor dweight, dbias;  // backward (optional)
  bool accumulate = false;   // dweight / dbias +=
};

enum class CrossEntropyMode {
  kFused,     // row losses (+ dlogits) of full-vocab logits
  kStats,     // this shard's max, sum_exp, target logit per row
  kBackward,  // this shard's dlogits from the global max and sum_exp
};

// Cross-entropy over logits rows [n, len = V_local] holding vocab columns
// [vocab_start, vocab_start + len) of vocab_size.
struct CrossEntropyPlan {
  CrossEntropyMode mode = CrossEntropyMode::kFused;
  int64_t n = 0, len = 0;
  int64_t vocab_start = 0, vocab_size = 0;
  int64_t ignore_index = -100;
  RowTensor logits;
  const void* targets = nullptr;
  DType targets_dtype = DType::kI64;
  int64_t targets_stride = 1;
  // The fused form: per-row losses (stats dtype, contiguous [n]) and dlogits (optional), with
  // dlogits = (softmax - onehot) * grad_scale_per_row on non-ignored rows, 0 on ignored rows.
  void* row_losses = nullptr;
  RowTensor dlogits;
  double grad_scale = 1.0;
  // Shard statistics out (contiguous [n] each, stats dtype): max, sum_exp, target logit.
  void* stat_max = nullptr;
  void* stat_sum_exp = nullptr;
  void* stat_target = nullptr;
  // Shard backward in: the global statistics (contiguous [n] each, stats dtype).
  const void* global_max = nullptr;
  const void* global_sum_exp = nullptr;
};

// Embedding lookup / scatter-add over the positions of ids (row-major over ids_shape).
// Table row r holds global id row_start + r. Forward: out row p = table row (id - row_start),
// or zeros when outside [0, rows). Backward: for p in increasing order, dw row (id - row_start)
// += dy row p (skipping ids outside the shard and padding_idx); dw is a contiguous [rows, D]
// accumulator of dw_dtype (f32 or f64), zeroed or pre-filled by the caller.
struct EmbeddingPlan {
  const void* ids = nullptr;
  DType ids_dtype = DType::kI64;
  Dims ids_shape, ids_strides;
  int64_t dim = 0;
  int64_t row_start = 0, rows = 0, num_embeddings = 0;
  bool has_padding = false;
  int64_t padding_idx = 0;  // global id
  RowTensor table;          // outer_strides {stride(0)}, stride(1)
  RowTensor out;            // outer_strides: out's strides over ids_shape
  RowTensor dy;             // outer_strides: dy's strides over ids_shape
  void* dw = nullptr;
  DType dw_dtype = DType::kF32;
};

}  // namespace kernels::detail
