#include "kernels/dims.h"

#include <fmt/format.h>

#include <charconv>

namespace kernels {

Dims parse_shape(std::string_view text, std::string_view what) {
  Dims shape;
  if (text.empty()) return shape;  // a 0-d tensor
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find_first_of(",x", begin);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view part = text.substr(begin, end - begin);
    int64_t v = -1;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (ec == std::errc::result_out_of_range && p == part.data() + part.size())
      throw InvalidArgument(fmt::format("{} '{}': size {} is out of range (at most {})", what, clip(text),
                                        clip(part, 40), kInt64Max));
    if (part.empty() || ec != std::errc() || p != part.data() + part.size() || v < 0)
      throw InvalidArgument(fmt::format(
          "{} '{}' is malformed at '{}': expected comma-separated sizes >= 0 like 13,2 (or 13x2)", what,
          clip(text), clip(part, 40)));
    if (shape.size() == kMaxDims)
      throw InvalidArgument(fmt::format("{} '{}' has more than {} dims", what, clip(text), kMaxDims));
    shape.push_back(v);
    begin = end + 1;
  }
  return shape;
}

}  // namespace kernels
