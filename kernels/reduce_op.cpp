#include "kernels/reduce_op.h"

#include <string>

#include "kernels/error.h"

namespace kernels {

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProd: return "prod";
  }
  throw InternalError("to_string: invalid ReduceOp value " + std::to_string(static_cast<int>(op)));
}

ReduceOp parse_reduce_op(std::string_view text) {
  constexpr ReduceOp kAll[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                               ReduceOp::kProd};
  for (ReduceOp op : kAll) {
    if (to_string(op) == text) return op;
  }
  if (text == "product") return ReduceOp::kProd;
  throw InvalidArgument("unknown reduce op '" + std::string(text) +
                        "': expected one of sum, avg, min, max, prod (or product)");
}

}  // namespace kernels
