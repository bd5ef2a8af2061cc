// The compute kernels on Tensor (CPU and CUDA): one include for all of kernels/ops/*.h.
//   matmul.h        matmul, matmul_out (batched, strided operands as GEMM flags, alpha/beta)
//   elementwise.h   add, mul, scale, gelu, silu and their backward; broadcast_shapes, expand
//   reduction.h     sum, mean, max (+ argmax backward), sum_to_shape, sum_of_squares
//   softmax.h       softmax, log_softmax and their backward
//   norm.h          rms_norm, layer_norm forward/backward with saved statistics
//   embedding.h     embedding gather and its deterministic scatter-add backward (also sharded)
//   cross_entropy.h fused cross-entropy + dlogits; the vocab-shard pieces for loss parallel
//   attention.h     causal scaled dot-product attention forward/backward
//   chunk_cat.h     chunk_cat / split_copy: many tensors to and from one rank-major flat buffer
//   optim.h         fused AdamW / Adam and SGD (momentum, nesterov) steps
#pragma once

#include "kernels/ops/attention.h"
#include "kernels/ops/chunk_cat.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/matmul.h"
#include "kernels/ops/norm.h"
#include "kernels/ops/optim.h"
#include "kernels/ops/reduction.h"
#include "kernels/ops/softmax.h"
