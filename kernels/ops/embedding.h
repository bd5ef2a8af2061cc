// Embedding lookup (a row gather) and its backward (a deterministic scatter-add), for a full
// table or for one shard of a table split by rows (vocab-parallel embedding).
//
//   Tensor table = Tensor::arange({5, 3}, DType::kF32);            // 5 rows of D = 3
//   Tensor ids = Tensor::from_vector({4, 0, 4}, {3}, DType::kI64);
//   Tensor y = embedding(table, ids);                              // rows 4, 0, 4: [3, 3]
//   Tensor dtable = embedding_backward(dy, ids, 5);                // row 4 gets dy[0] + dy[2]
//   // Rows 3..4 of a 5-row table held by this rank: ids outside 3..4 give zero rows here and
//   // the partial results sum to the full lookup across the shards (RowwiseParallel).
//   Tensor y1 = embedding(table.narrow(0, 3, 2), ids, {.row_start = 3, .num_embeddings = 5});
//
// Rules: table (weight) floating, [rows, D], any strided view; ids i64 or i32 of any shape and
// strides; the output is ids.shape + [D] in the table's dtype. Every id must lie in
// [0, num_embeddings) (num_embeddings defaults to the table's row count; InvalidArgument names
// the first offending id and its position). The backward adds rows in increasing position
// order, so it is deterministic (bitwise repeatable, CPU and CUDA), and skips padding_idx like
// nn.Embedding(padding_idx=...). All operands on one device.
#pragma once

#include <cstdint>
#include <optional>

#include "kernels/tensor.h"

namespace kernels {

struct EmbeddingOptions {
  // Global id of the table's first row (this shard's offset); ids outside
  // [row_start, row_start + rows) look up zeros and receive no gradient.
  int64_t row_start = 0;
  // Global number of embeddings, for the range check of ids; -1: row_start + the table's rows.
  int64_t num_embeddings = -1;
  // A global id whose row gets no gradient (nn.Embedding's padding_idx; negative values count
  // from num_embeddings as in PyTorch). The forward still looks it up.
  std::optional<int64_t> padding_idx;
};

Tensor embedding(const Tensor& weight, const Tensor& ids, const EmbeddingOptions& options = {});
// REQUIRES: out has shape ids.shape + [D].
void embedding_out(const Tensor& out, const Tensor& weight, const Tensor& ids,
                   const EmbeddingOptions& options = {});

// d(weight) for a table (shard) of `rows` rows: a new zero-filled [rows, D] tensor of dy's
// dtype with dy's rows added at their ids.
Tensor embedding_backward(const Tensor& dy, const Tensor& ids, int64_t rows,
                          const EmbeddingOptions& options = {});
// dweight [rows, D], any floating dtype and strides; overwritten unless accumulate (+=).
// Sums are formed in f32 (f64 for f64 dweight) per row and rounded once.
void embedding_backward_out(const Tensor& dweight, const Tensor& dy, const Tensor& ids,
                            const EmbeddingOptions& options = {}, bool accumulate = false);

}  // namespace kernels
