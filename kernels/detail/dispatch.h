// Internal: run a generic callable with a value-initialised object of the C++ type of a DType.
//   dispatch_dtype(DType::kBF16, [](auto tag) { using T = decltype(tag); ... });   // T == BFloat16
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/dtype.h"
#include "kernels/error.h"

namespace kernels::detail {

template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return std::forward<F>(f)(float{});
    case DType::kF64: return std::forward<F>(f)(double{});
    case DType::kBF16: return std::forward<F>(f)(BFloat16{});
    case DType::kF16: return std::forward<F>(f)(Half{});
    case DType::kI32: return std::forward<F>(f)(int32_t{});
    case DType::kI64: return std::forward<F>(f)(int64_t{});
    case DType::kU8: return std::forward<F>(f)(uint8_t{});
    case DType::kF8E4M3: return std::forward<F>(f)(Float8E4M3{});
    case DType::kF8E5M2: return std::forward<F>(f)(Float8E5M2{});
  }
  throw InternalError("dispatch_dtype: invalid dtype value " +
                      std::to_string(static_cast<int>(dtype)));
}

}  // namespace kernels::detail
