// fmt support for the kernels types, plus their string forms. The formatters forward to the
// to_string functions (compiled once, in format.cpp) and accept string format specs ({:>20}).
//   fmt::format("{}", Dims{4, 3}) == "[4,3]"
//   fmt::format("{}", Tensor::arange({2, 2}, DType::kF32))
//       == "tensor([[0., 1.],\n        [2., 3.]], dtype=f32)"
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "kernels/device.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"
#include "kernels/reduce_op.h"
#include "kernels/tensor.h"

namespace kernels {

// "[4,3]"; "[]" for an empty list.
std::string to_string(const Dims& dims);
// PyTorch's layout: values with 4 decimals (or "0." style when every value is integral, or
// scientific when the range calls for it), 80-column rows, more than 1000 elements summarised
// with "..." and 3 items at each edge of every dim; then ", dtype=f32" and, off the CPU,
// ", device=cuda:0". An undefined tensor prints as "tensor(undefined)"; a tensor whose storage
// is freed prints its metadata only.
std::string to_string(const Tensor& tensor);

namespace detail {
template <class T>
struct ToStringFormatter : fmt::formatter<std::string_view> {
  template <class FormatContext>
  auto format(const T& value, FormatContext& ctx) const -> decltype(ctx.out()) {
    const auto text = to_string(value);
    return fmt::formatter<std::string_view>::format(std::string_view(text), ctx);
  }
};
}  // namespace detail

}  // namespace kernels

template <>
struct fmt::formatter<kernels::Dims> : kernels::detail::ToStringFormatter<kernels::Dims> {};
template <>
struct fmt::formatter<kernels::DType> : kernels::detail::ToStringFormatter<kernels::DType> {};
template <>
struct fmt::formatter<kernels::Device> : kernels::detail::ToStringFormatter<kernels::Device> {};
template <>
struct fmt::formatter<kernels::ReduceOp> : kernels::detail::ToStringFormatter<kernels::ReduceOp> {};
template <>
struct fmt::formatter<kernels::Tensor> : kernels::detail::ToStringFormatter<kernels::Tensor> {};
