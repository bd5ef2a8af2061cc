#include "kernels/ops/common.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "kernels/error.h"
#include "kernels/format.h"

namespace kernels::detail {

void check_defined(const char* op, const Tensor& t, const char* name) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} is undefined", op, name));
}

bool is_compute_float(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBF16 ||
         dtype == DType::kF16;
}

void check_floating(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (!is_compute_float(t.dtype())) {
    throw Unsupported(
        fmt::format("{}: {} has dtype {}, expected f32, f64, bf16 or f16", op, name, t.dtype()));
  }
}

void check_index(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != DType::kI64 && t.dtype() != DType::kI32) {
    throw InvalidArgument(
        fmt::format("{}: {} has dtype {}, expected i64 or i32", op, name, t.dtype()));
  }
}

void check_same_dtype(const char* op, std::initializer_list<Named> ts) {
  const Named* first = nullptr;
  for (const Named& n : ts) {
    if (!n.t.defined()) continue;
    if (first == nullptr) {
      first = &n;
    } else if (n.t.dtype() != first->t.dtype()) {
      throw InvalidArgument(fmt::format("{}: {} has dtype {} but {} has {} (expected the same)", op,
                                        n.name, n.t.dtype(), first->name, first->t.dtype()));
    }
  }
}

void check_same_device(const char* op, std::initializer_list<Named> ts) {
  const Named* first = nullptr;
  for (const Named& n : ts) {
    if (!n.t.defined()) continue;
    if (first == nullptr) {
      first = &n;
    } else if (!(n.t.device() == first->t.device())) {
      throw InvalidArgument(fmt::format("{}: {} is on {} but {} is on {} (expected one device)", op,
                                        n.name, n.t.device(), first->name, first->t.device()));
    }
  }
}

void check_shape(const char* op, const Tensor& t, const char* name, const Dims& expected) {
  if (!(t.shape() == expected)) {
    throw InvalidArgument(
        fmt::format("{}: {} has shape {}, expected {}", op, name, t.shape(), expected));
  }
}

void check_dtype(const char* op, const Tensor& t, const char* name, DType expected) {
  if (t.dtype() != expected) {
    throw InvalidArgument(
        fmt::format("{}: {} has dtype {}, expected {}", op, name, t.dtype(), expected));
  }
}

void check_writable(const char* op, const Tensor& t, const char* name) {
  for (int d = 0; d < t.ndim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      throw InvalidArgument(fmt::format(
          "{}: {} has stride 0 on dim {} of size {} (strides {}): an output must address each "
          "element once",
          op, name, d, t.size(d), t.strides()));
    }
  }
}

int wrap_dim(const char* op, int dim, int ndim) {
  if (ndim == 0 || dim < -ndim || dim >= ndim) {
    throw InvalidArgument(fmt::format("{}: dim {} out of range for a {}-d tensor (expected {}..{})",
                                      op, dim, ndim, -ndim, ndim - 1));
  }
  return dim < 0 ? dim + ndim : dim;
}

namespace {
// [first, last) byte range a view addresses; empty for numel 0.
std::pair<int64_t, int64_t> byte_extent(const Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = t.storage_offset();
  for (int d = 0; d < t.ndim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto size = static_cast<int64_t>(itemsize(t.dtype()));
  return {t.storage_offset() * size, (last + 1) * size};
}
}  // namespace

namespace {

// One term of sum_k x_k w_k with x_k in [lo, hi].
struct Term {
  int64_t w, lo, hi;
};

// Whether d = sum_k x_k w_k has a solution with every x_k in its range, for terms sorted by w
// descending (w > 0); bound[k] = the largest |sum| the terms after k can reach. Each level tries
// only the x that leave a remainder within the bound (one or two for views cut from one
// contiguous tensor); `budget` caps the search, and running out of it answers "yes".
bool representable(int64_t d, const std::vector<Term>& t, const std::vector<int64_t>& bound,
                   size_t k, int& budget) {
  if (k == t.size()) return d == 0;
  if (--budget < 0) return true;
  const Term& term = t[k];
  // x with |d - x w| <= bound[k]:  x in [ceil((d - B) / w), floor((d + B) / w)].
  auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
  const int64_t lo = std::max(term.lo, -floor_div(-(d - bound[k]), term.w));
  const int64_t hi = std::min(term.hi, floor_div(d + bound[k], term.w));
  for (int64_t x = lo; x <= hi; ++x) {
    if (representable(d - x * term.w, t, bound, k + 1, budget)) return true;
    if (budget < 0) return true;
  }
  return false;
}

}  // namespace

bool may_overlap(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || !a.shares_storage_with(b)) return false;
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = byte_extent(a);
  const auto [b0, b1] = byte_extent(b);
  if (!(a0 < b1 && b0 < a1)) return false;
  if (itemsize(a.dtype()) != itemsize(b.dtype())) return true;
  // Same element size: is there an element of a at the address of an element of b?
  // off_a + sum i_k sa_k = off_b + sum j_m sb_m, i.e. sum i_k sa_k - sum j_m sb_m = d.
  std::vector<Term> terms;
  auto add = [&](const Tensor& t, bool negate) {
    for (int k = 0; k < t.ndim(); ++k) {
      const int64_t w = t.stride(k), n = t.size(k);
      if (w == 0 || n == 1) continue;
      terms.push_back(negate ? Term{w, -(n - 1), 0} : Term{w, 0, n - 1});
    }
  };
  add(a, false);
  add(b, true);
  std::sort(terms.begin(), terms.end(), [](const Term& x, const Term& y) { return x.w > y.w; });
  std::vector<int64_t> bound(terms.size(), 0);
  for (size_t k = terms.size(); k-- > 0;) {
    if (k + 1 < terms.size()) {
      const Term& n = terms[k + 1];
      bound[k] = bound[k + 1] + std::max(-n.lo, n.hi) * n.w;
    }
  }
  int budget = 4096;
  return representable(b.storage_offset() - a.storage_offset(), terms, bound, 0, budget);
}

bool same_view(const Tensor& a, const Tensor& b) {
  return a.shares_storage_with(b) && a.storage_offset() == b.storage_offset() &&
         a.shape() == b.shape() && a.strides() == b.strides() && a.dtype() == b.dtype();
}

Dims drop_last(const Dims& shape) {
  Dims out = shape;
  if (!out.empty()) out.pop_back();
  return out;
}

Dims strides_without(const Tensor& t, int dim) {
  Dims s = t.strides();
  s.erase(dim);
  return s;
}

RowTensor as_rows(const Tensor& t, int dim) {
  RowTensor r;
  if (!t.defined() || t.numel() == 0) return r;
  r.data = t.data_ptr();
  r.dtype = t.dtype();
  r.outer_strides = strides_without(t, dim);
  r.stride = t.stride(dim);
  return r;
}

ColTensor as_col(const Tensor& t) {
  ColTensor c;
  if (!t.defined() || t.numel() == 0) return c;
  c.data = t.data_ptr();
  c.dtype = t.dtype();
  c.stride = t.stride(0);
  return c;
}

}  // namespace kernels::detail
