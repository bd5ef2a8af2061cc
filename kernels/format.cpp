// Tensor printing follows torch/_tensor_str.py (PRINT_OPTS defaults: precision 4, threshold 1000,
// edgeitems 3, linewidth 80) so that printed tensors can be compared with PyTorch's by eye.
#include "kernels/format.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace kernels {
namespace {

constexpr int kPrecision = 4;
constexpr int64_t kThreshold = 1000;
constexpr int64_t kEdgeItems = 3;
constexpr int kLineWidth = 80;

// Host copy of the values, row-major, as int64 (integer dtypes) or double (floating dtypes).
struct HostValues {
  bool floating = true;
  std::vector<double> f;
  std::vector<int64_t> i;
  Dims shape;
  Dims strides;  // contiguous
};

// The flat indices of the elements printed: along each dim, all of them, or the first and last
// kEdgeItems when summarising a dim longer than 2 * kEdgeItems (get_summarized_data).
void visible_indices(const HostValues& v, bool summarize, int dim, int64_t offset,
                     std::vector<int64_t>& out) {
  if (dim == v.shape.size()) {
    out.push_back(offset);
    return;
  }
  const int64_t n = v.shape[dim];
  for (int64_t k = 0; k < n; ++k) {
    if (summarize && n > 2 * kEdgeItems && k == kEdgeItems) k = n - kEdgeItems;
    visible_indices(v, summarize, dim + 1, offset + k * v.strides[dim], out);
  }
}

// PyTorch's _Formatter: one width and one style (integer-valued, fixed or scientific) for all
// elements, chosen from the nonzero finite values.
class ValueFormatter {
 public:
  ValueFormatter(const HostValues& v, const std::vector<int64_t>& visible) : floating_(v.floating) {
    if (!floating_) {
      for (int64_t k : visible) max_width_ = std::max(max_width_, fmt::format("{}", v.i[k]).size());
      return;
    }
    std::vector<double> vals;
    for (int64_t k : visible) {
      const double x = v.f[k];
      if (std::isfinite(x) && x != 0) vals.push_back(x);
    }
    if (vals.empty()) return;
    double lo = std::abs(vals[0]);
    double hi = lo;
    for (double x : vals) {
      lo = std::min(lo, std::abs(x));
      hi = std::max(hi, std::abs(x));
      if (x != std::ceil(x)) int_mode_ = false;
    }
    if (int_mode_) {
      if (hi / lo > 1000.0 || hi > 1.0e8) {
        sci_mode_ = true;
        for (double x : vals)
          max_width_ = std::max(max_width_, fmt::format("{:.{}e}", x, kPrecision).size());
      } else {
        for (double x : vals)
          max_width_ = std::max(max_width_, fmt::format("{:.0f}", x).size() + 1);
      }
    } else {
      sci_mode_ = hi / lo > 1000.0 || hi > 1.0e8 || lo < 1.0e-4;
      for (double x : vals) {
        const std::string s = sci_mode_ ? fmt::format("{:.{}e}", x, kPrecision)
                                        : fmt::format("{:.{}f}", x, kPrecision);
        max_width_ = std::max(max_width_, s.size());
      }
    }
  }

  size_t width() const { return max_width_; }

  std::string format(const HostValues& v, int64_t k) const {
    std::string s;
    if (!floating_) {
      s = fmt::format("{}", v.i[k]);
    } else {
      const double x = v.f[k];
      if (std::isnan(x)) {
        s = "nan";  // Python prints every NaN without a sign
      } else if (sci_mode_) {
        s = fmt::format("{:.{}e}", x, kPrecision);
      } else if (int_mode_) {
        s = fmt::format("{:.0f}", x);
        if (std::isfinite(x)) s += '.';
      } else {
        s = fmt::format("{:.{}f}", x, kPrecision);
      }
    }
    if (s.size() < max_width_) s.insert(0, max_width_ - s.size(), ' ');
    return s;
  }

 private:
  bool floating_;
  bool int_mode_ = true;
  bool sci_mode_ = false;
  size_t max_width_ = 1;
};

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k) out += sep;
    out += parts[k];
  }
  return out;
}

// _tensor_str_with_formatter for the sub-tensor at (dim, offset).
std::string render(const HostValues& v, const ValueFormatter& f, bool summarize, int dim,
                   int64_t offset, int indent) {
  const int ndim = v.shape.size();
  if (ndim == 0) return f.format(v, offset);
  const int64_t n = v.shape[dim];
  const bool cut = summarize && n > 2 * kEdgeItems;
  if (dim == ndim - 1) {  // _vector_str
    const size_t element_length = f.width() + 2;
    const size_t per_line =
        std::max<size_t>(1, static_cast<size_t>(kLineWidth - indent) / element_length);
    std::vector<std::string> data;
    for (int64_t k = 0; k < n; ++k) {
      if (cut && k == kEdgeItems) {
        data.push_back(" ...");
        k = n - kEdgeItems;
      }
      data.push_back(f.format(v, offset + k * v.strides[dim]));
    }
    std::vector<std::string> lines;
    for (size_t k = 0; k < data.size(); k += per_line) {
      const auto last = std::min(data.size(), k + per_line);
      lines.push_back(join({data.begin() + static_cast<std::ptrdiff_t>(k),
                            data.begin() + static_cast<std::ptrdiff_t>(last)},
                           ", "));
    }
    std::string out = "[";
    out += join(lines, ",\n" + std::string(static_cast<size_t>(indent) + 1, ' '));
    out += ']';
    return out;
  }
  std::vector<std::string> slices;
  for (int64_t k = 0; k < n; ++k) {
    if (cut && k == kEdgeItems) {
      slices.push_back("...");
      k = n - kEdgeItems;
    }
    slices.push_back(render(v, f, summarize, dim + 1, offset + k * v.strides[dim], indent + 1));
  }
  const std::string sep = "," + std::string(static_cast<size_t>(ndim - dim - 1), '\n') +
                          std::string(static_cast<size_t>(indent) + 1, ' ');
  std::string out = "[";
  out += join(slices, sep);
  out += ']';
  return out;
}

// _add_suffixes: ", suffix" on the same line while it fits in kLineWidth, else on a new line.
std::string add_suffixes(std::string text, const std::vector<std::string>& suffixes, int indent) {
  const size_t newline = text.rfind('\n');
  const int64_t from = newline == std::string::npos ? -1 : static_cast<int64_t>(newline);
  int64_t last_line_len = static_cast<int64_t>(text.size()) - from + 1;
  for (const std::string& suffix : suffixes) {
    const auto len = static_cast<int64_t>(suffix.size());
    if (last_line_len + len + 2 > kLineWidth) {
      text += ",\n" + std::string(static_cast<size_t>(indent), ' ') + suffix;
      last_line_len = indent + len;
    } else {
      text += ", " + suffix;
      last_line_len += len + 2;
    }
  }
  return text + ")";
}

}  // namespace

std::string to_string(const Dims& dims) {
  std::string out = "[";
  for (int d = 0; d < dims.size(); ++d) {
    if (d) out += ',';
    out += std::to_string(dims[d]);
  }
  return out + "]";
}

std::string to_string(const Tensor& tensor) {
  if (!tensor.defined()) return "tensor(undefined)";
  const std::string prefix = "tensor(";
  const int indent = static_cast<int>(prefix.size());
  std::vector<std::string> suffixes;
  std::string body;
  if (!tensor.storage()->allocated()) {
    body = "<freed storage>";
    suffixes.push_back("size=" + to_string(tensor.shape()));
  } else if (tensor.numel() == 0) {
    body = "[]";
    if (tensor.ndim() != 1) suffixes.push_back("size=" + to_string(tensor.shape()));
  } else {
    HostValues v;
    v.floating = is_floating_point(tensor.dtype());
    v.shape = tensor.shape();
    v.strides = Tensor::contiguous_strides(v.shape);
    Tensor host = Tensor::empty(v.shape, v.floating ? DType::kF64 : DType::kI64);
    host.copy_(tensor);
    if (v.floating) {
      const double* p = host.data<double>();
      v.f.assign(p, p + host.numel());
    } else {
      const int64_t* p = host.data<int64_t>();
      v.i.assign(p, p + host.numel());
    }
    const bool summarize = tensor.numel() > kThreshold;
    std::vector<int64_t> visible;
    visible_indices(v, summarize, 0, 0, visible);
    const ValueFormatter f(v, visible);
    body = render(v, f, summarize, 0, 0, indent);
  }
  suffixes.push_back(fmt::format("dtype={}", tensor.dtype()));
  if (!tensor.device().is_cpu()) suffixes.push_back(fmt::format("device={}", tensor.device()));
  return add_suffixes(prefix + body, suffixes, indent);
}

}  // namespace kernels
