// Reduction operators shared by the Partial placement, the collectives and the rank-local
// reduce kernels.
#pragma once

#include <string_view>

namespace kernels {

enum class ReduceOp { kSum, kAvg, kMin, kMax, kProd };

// "sum", "avg", "min", "max", "prod" (PyTorch's "product" is accepted by parse_reduce_op).
std::string_view to_string(ReduceOp op);
// Throws InvalidArgument naming the text and the accepted names.
ReduceOp parse_reduce_op(std::string_view text);

}  // namespace kernels
