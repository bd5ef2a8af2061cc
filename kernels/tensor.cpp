#include "kernels/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "kernels/checked.h"
#include "kernels/cpu/copy.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/format.h"

namespace kernels {
namespace {

// `positions` valid dims of a tensor with `ndim` dims (positions == ndim + 1 for unsqueeze).
int wrap_dim(const char* op, int64_t dim, int ndim, int positions) {
  if (positions == 0) {
    throw InvalidArgument(
        fmt::format("{}: dim {} out of range for a 0-d tensor (it has no dims)", op, dim));
  }
  if (dim < -positions || dim >= positions) {
    throw InvalidArgument(fmt::format("{}: dim {} out of range for a {}-d tensor (expected {}..{})",
                                      op, dim, ndim, -positions, positions - 1));
  }
  return static_cast<int>(dim < 0 ? dim + positions : dim);
}

int wrap_dim(const char* op, int64_t dim, int ndim) { return wrap_dim(op, dim, ndim, ndim); }

void check_defined(const char* op, const Tensor& t, const char* which = "tensor") {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} is undefined", op, which));
}

void check_sizes(const char* op, const Dims& shape) {
  for (int64_t s : shape) {
    if (s < 0) throw InvalidArgument(fmt::format("{}: negative size {} in shape {}", op, s, shape));
  }
}

// Offset (in elements) of the last addressed element relative to the first; REQUIRES numel > 0.
int64_t extent(const Dims& shape, const Dims& strides) {
  int64_t e = 0;
  for (int d = 0; d < shape.size(); ++d)
    e = checked_add(e, checked_mul(shape[d] - 1, strides[d], "view extent"), "view extent");
  return e;
}

// Rejects views that address memory outside the storage (or use negative strides / offsets).
void check_in_storage(const char* op, const Storage& storage, DType dtype, const Dims& shape,
                      const Dims& strides, int64_t offset) {
  if (shape.size() != strides.size()) {
    throw InvalidArgument(fmt::format("{}: shape {} has {} dims but strides {} has {}", op, shape,
                                      shape.size(), strides, strides.size()));
  }
  check_sizes(op, shape);
  for (int64_t s : strides) {
    if (s < 0) {
      throw InvalidArgument(
          fmt::format("{}: negative stride {} in strides {} (negative strides are not supported)",
                      op, s, strides));
    }
  }
  if (offset < 0) throw InvalidArgument(fmt::format("{}: negative storage offset {}", op, offset));
  if (shape.product() == 0) return;
  const int64_t end = checked_bytes(
      checked_add(checked_add(offset, extent(shape, strides), "view end"), 1, "view end"), itemsize(dtype),
      "view end in bytes");
  if (end > static_cast<int64_t>(storage.nbytes())) {
    throw InvalidArgument(fmt::format(
        "{}: shape {} with strides {} and offset {} ({}) needs {} bytes but the storage has {}", op,
        shape, strides, offset, dtype, end, storage.nbytes()));
  }
}

// Resolves a single -1 entry and checks the element count.
Dims infer_shape(const char* op, const Dims& shape, int64_t numel) {
  int inferred = -1;
  int64_t known = 1;
  for (int d = 0; d < shape.size(); ++d) {
    if (shape[d] == -1) {
      if (inferred >= 0) {
        throw InvalidArgument(fmt::format(
            "{}: shape {} has more than one -1 (only one size can be inferred)", op, shape));
      }
      inferred = d;
    } else if (shape[d] < 0) {
      throw InvalidArgument(fmt::format(
          "{}: invalid size {} in shape {} (expected >= 0, or -1 once)", op, shape[d], shape));
    } else {
      known = checked_mul(known, shape[d], "element count of the new shape");
    }
  }
  Dims out = shape;
  if (inferred >= 0) {
    if (known == 0 || numel % known != 0) {
      throw InvalidArgument(
          fmt::format("{}: shape {} is invalid for a tensor of {} elements", op, shape, numel));
    }
    out[inferred] = numel / known;
  } else if (known != numel) {
    throw InvalidArgument(
        fmt::format("{}: shape {} has {} elements, tensor has {}", op, shape, known, numel));
  }
  return out;
}

// Strides that let `new_shape` view the elements of (old_shape, old_strides) in row-major order
// without a copy, or nullopt. This is PyTorch's rule (computeStride in TensorUtils.cpp): each run
// of old dims that is contiguous in memory ("chunk") must be split or merged exactly by the new
// dims; size-1 dims may go anywhere.
//   [4,3] strides [3,1] -> [12]: [1];  [4,3] strides [1,4] (a transpose) -> [12]: nullopt
std::optional<Dims> view_strides(const Dims& old_shape, const Dims& old_strides,
                                 const Dims& new_shape) {
  Dims new_strides = Dims::filled(new_shape.size(), 1);
  if (old_shape.empty()) return new_strides;
  const int64_t numel = old_shape.product();
  if (numel == 0 && old_shape == new_shape) return old_strides;
  if (numel == 0) {
    for (int d = new_shape.size() - 1; d >= 0; --d) {
      new_strides[d] = d == new_shape.size() - 1
                           ? 1
                           : std::max<int64_t>(new_shape[d + 1], 1) * new_strides[d + 1];
    }
    return new_strides;
  }
  int view_d = new_shape.size() - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int tensor_d = old_shape.size() - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    // A chunk ends at dim 0 or where the next-outer dim is not contiguous with this one.
    if (tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                          old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

// Whether the element ranges addressed by two views of the same storage intersect.
bool ranges_overlap(const Tensor& a, const Tensor& b) {
  const auto range = [](const Tensor& t) {
    const int64_t size = static_cast<int64_t>(itemsize(t.dtype()));
    const int64_t begin = t.storage_offset() * size;
    return std::pair{begin, begin + (extent(t.shape(), t.strides()) + 1) * size};
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a0 < b1 && b0 < a1;
}

// `t` itself when it already is a contiguous CPU tensor of `dtype`, else a converted copy.
Tensor host_contiguous(const Tensor& t, DType dtype) {
  if (t.device().is_cpu() && t.dtype() == dtype && t.is_contiguous()) return t;
  Tensor h = Tensor::empty(t.shape(), dtype);
  h.copy_(t);
  return h;
}

// Copies between different devices (at least one CUDA), staging through host memory.
void copy_across_devices(Tensor& dst, const Tensor& src) {
  const Device dd = dst.device();
  const Device sd = src.device();
  const bool same_dtype = dst.dtype() == src.dtype();
  if (dd.is_cuda() && sd.is_cuda()) {  // different GPUs
    if (same_dtype && dst.is_contiguous() && src.is_contiguous()) {
      detail::cuda_memcpy(dst.data_ptr(), dd, src.data_ptr(), sd, dst.nbytes());
    } else {
      dst.copy_(src.to(Device::cpu()));
    }
    return;
  }
  if (sd.is_cuda()) {  // GPU -> CPU
    const Tensor packed = src.contiguous();
    if (same_dtype && dst.is_contiguous()) {
      detail::cuda_memcpy(dst.data_ptr(), dd, packed.data_ptr(), sd, dst.nbytes());
      return;
    }
    Tensor host = Tensor::empty(src.shape(), src.dtype());
    detail::cuda_memcpy(host.data_ptr(), host.device(), packed.data_ptr(), sd, host.nbytes());
    dst.copy_(host);
    return;
  }
  // CPU -> GPU: cast on the host, then one transfer.
  const Tensor host = host_contiguous(src, dst.dtype());
  if (dst.is_contiguous()) {
    detail::cuda_memcpy(dst.data_ptr(), dd, host.data_ptr(), sd, dst.nbytes());
    return;
  }
  Tensor staged = Tensor::empty(dst.shape(), dst.dtype(), dd);
  detail::cuda_memcpy(staged.data_ptr(), dd, host.data_ptr(), sd, staged.nbytes());
  dst.copy_(staged);
}

}  // namespace

// ---- factories ----

Dims Tensor::contiguous_strides(const Dims& shape) {
  Dims strides = Dims::filled(shape.size(), 1);
  for (int d = shape.size() - 2; d >= 0; --d) {
    strides[d] = checked_mul(strides[d + 1], std::max<int64_t>(shape[d + 1], 1), "contiguous stride");
  }
  return strides;
}

Tensor Tensor::empty(const Dims& shape, DType dtype, Device device) { return empty(shape, dtype, device, nullptr); }

Tensor Tensor::empty(const Dims& shape, DType dtype, Device device, std::shared_ptr<Allocator> allocator) {
  check_sizes("empty", shape);
  Tensor t;
  t.strides_ = contiguous_strides(shape);  // first: throws before allocating when they overflow
  const int64_t numel = shape.product();
  const auto item = static_cast<int64_t>(itemsize(dtype));
  if (numel > kInt64Max / item)
    throw InvalidArgument(fmt::format("empty: shape {} ({} elements of {}) needs more than {} bytes", shape,
                                      numel, dtype, kInt64Max));
  t.storage_ = Storage::allocate(static_cast<size_t>(numel * item), device, std::move(allocator));
  t.dtype_ = dtype;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::zeros(const Dims& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}

Tensor Tensor::full(const Dims& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::arange(const Dims& shape, DType dtype, Device device) {
  Tensor index = empty(shape, DType::kI64);
  int64_t* p = index.data<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) p[i] = i;
  if (dtype == DType::kI64 && device.is_cpu()) return index;
  Tensor t = empty(shape, dtype, device);
  t.copy_(index);
  return t;
}

Tensor Tensor::from_vector(const std::vector<double>& values, const Dims& shape, DType dtype,
                           Device device) {
  check_sizes("from_vector", shape);
  if (static_cast<int64_t>(values.size()) != shape.product()) {
    throw InvalidArgument(fmt::format("from_vector: {} values for shape {} ({} elements)",
                                      values.size(), shape, shape.product()));
  }
  Tensor host = empty(shape, DType::kF64);
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(double));
  Tensor t = empty(shape, dtype, device);
  t.copy_(host);
  return t;
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, DType dtype, const Dims& shape,
                            const Dims& strides, int64_t storage_offset) {
  if (storage == nullptr) throw InvalidArgument("from_storage: storage is null");
  check_in_storage("from_storage", *storage, dtype, shape, strides, storage_offset);
  Tensor t;
  t.storage_ = std::move(storage);
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = strides;
  t.offset_ = storage_offset;
  return t;
}

// ---- metadata ----

Device Tensor::device() const { return storage_ ? storage_->device() : Device{}; }

int64_t Tensor::size(int dim) const { return shape_[wrap_dim("size", dim, ndim())]; }

int64_t Tensor::stride(int dim) const { return strides_[wrap_dim("stride", dim, ndim())]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim() - 1; d >= 0; --d) {
    if (shape_[d] == 1) continue;
    if (strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

void* Tensor::data_ptr() const {
  check_defined("data_ptr", *this);
  char* base = static_cast<char*>(storage_->data());
  if (base == nullptr) return nullptr;  // zero-byte storage
  return base + offset_ * static_cast<int64_t>(itemsize(dtype_));
}

void Tensor::check_dtype(DType expected) const {
  if (dtype_ != expected) {
    throw InvalidArgument(
        fmt::format("data<T>: tensor has dtype {}, requested {}", dtype_, expected));
  }
}

// ---- views ----

Tensor Tensor::narrow(int dim, int64_t start, int64_t length) const {
  check_defined("narrow", *this);
  const int d = wrap_dim("narrow", dim, ndim());
  const int64_t size = shape_[d];
  if (start < -size || start > size) {
    throw InvalidArgument(
        fmt::format("narrow: start {} out of range for dim {} of size {} (expected {}..{})", start,
                    d, size, -size, size));
  }
  if (start < 0) start += size;
  if (length < 0) throw InvalidArgument(fmt::format("narrow: negative length {}", length));
  if (start + length > size) {
    throw InvalidArgument(fmt::format("narrow: start {} + length {} exceeds size {} of dim {}",
                                      start, length, size, d));
  }
  Tensor t = *this;
  t.shape_[d] = length;
  t.offset_ += start * strides_[d];
  return t;
}

Tensor Tensor::select(int dim, int64_t index) const {
  check_defined("select", *this);
  const int d = wrap_dim("select", dim, ndim());
  const int64_t size = shape_[d];
  if (index < -size || index >= size) {
    throw InvalidArgument(
        fmt::format("select: index {} out of range for dim {} of size {} (expected {}..{})", index,
                    d, size, -size, size - 1));
  }
  if (index < 0) index += size;
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(d);
  t.strides_.erase(d);
  return t;
}

Tensor Tensor::view(const Dims& shape) const {
  check_defined("view", *this);
  const Dims resolved = infer_shape("view", shape, numel());
  const auto strides = view_strides(shape_, strides_, resolved);
  if (!strides) {
    throw InvalidArgument(fmt::format(
        "view: size {} is not compatible with the tensor's size {} and strides {}; use reshape",
        resolved, shape_, strides_));
  }
  Tensor t = *this;
  t.shape_ = resolved;
  t.strides_ = *strides;
  return t;
}

Tensor Tensor::reshape(const Dims& shape) const {
  check_defined("reshape", *this);
  const Dims resolved = infer_shape("reshape", shape, numel());
  if (const auto strides = view_strides(shape_, strides_, resolved)) {
    Tensor t = *this;
    t.shape_ = resolved;
    t.strides_ = *strides;
    return t;
  }
  Tensor t = clone();
  t.shape_ = resolved;
  t.strides_ = contiguous_strides(resolved);
  return t;
}

Tensor Tensor::permute(const Dims& order) const {
  check_defined("permute", *this);
  if (order.size() != ndim()) {
    throw InvalidArgument(fmt::format("permute: order {} has {} entries, tensor has {} dims", order,
                                      order.size(), ndim()));
  }
  Tensor t = *this;
  bool seen[kMaxDims] = {};
  for (int i = 0; i < order.size(); ++i) {
    const int64_t o = order[i];
    const int64_t d = o < 0 ? o + ndim() : o;
    if (d < 0 || d >= ndim() || seen[d]) {
      throw InvalidArgument(
          fmt::format("permute: order {} is not a permutation of 0..{}", order, ndim() - 1));
    }
    seen[d] = true;
    t.shape_[i] = shape_[static_cast<int>(d)];
    t.strides_[i] = strides_[static_cast<int>(d)];
  }
  return t;
}

Tensor Tensor::transpose(int dim0, int dim1) const {
  check_defined("transpose", *this);
  const int a = wrap_dim("transpose", dim0, ndim());
  const int b = wrap_dim("transpose", dim1, ndim());
  Tensor t = *this;
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  return t;
}

Tensor Tensor::flatten(int start_dim, int end_dim) const {
  check_defined("flatten", *this);
  if (ndim() == 0) {
    wrap_dim("flatten", start_dim, 0, 1);
    wrap_dim("flatten", end_dim, 0, 1);
    return reshape({1});
  }
  const int s = wrap_dim("flatten", start_dim, ndim());
  const int e = wrap_dim("flatten", end_dim, ndim());
  if (s > e) {
    throw InvalidArgument(
        fmt::format("flatten: start_dim {} comes after end_dim {} (for a {}-d tensor)", start_dim,
                    end_dim, ndim()));
  }
  Dims shape;
  for (int d = 0; d < s; ++d) shape.push_back(shape_[d]);
  int64_t merged = 1;
  for (int d = s; d <= e; ++d) merged = checked_mul(merged, shape_[d], "flattened size");
  shape.push_back(merged);
  for (int d = e + 1; d < ndim(); ++d) shape.push_back(shape_[d]);
  return reshape(shape);
}

Tensor Tensor::unsqueeze(int dim) const {
  check_defined("unsqueeze", *this);
  const int d = wrap_dim("unsqueeze", dim, ndim(), ndim() + 1);
  if (ndim() == kMaxDims) {
    throw InvalidArgument(
        fmt::format("unsqueeze: a {}-d tensor cannot get another dim (at most {} are supported)",
                    ndim(), kMaxDims));
  }
  Tensor t = *this;
  t.shape_.insert(d, 1);
  t.strides_.insert(d, d == ndim() ? 1 : checked_mul(shape_[d], strides_[d], "unsqueezed stride"));
  return t;
}

Tensor Tensor::as_strided(const Dims& shape, const Dims& strides, int64_t storage_offset) const {
  check_defined("as_strided", *this);
  check_in_storage("as_strided", *storage_, dtype_, shape, strides, storage_offset);
  Tensor t = *this;
  t.shape_ = shape;
  t.strides_ = strides;
  t.offset_ = storage_offset;
  return t;
}

// ---- copies ----

Tensor Tensor::contiguous() const {
  check_defined("contiguous", *this);
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::clone() const {
  check_defined("clone", *this);
  Tensor t = empty(shape_, dtype_, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  check_defined("to", *this);
  Tensor t = empty(shape_, dtype, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  check_defined("to", *this);
  Tensor t = empty(shape_, dtype_, device);
  t.copy_(*this);
  return t;
}

void Tensor::copy_(const Tensor& src) {
  check_defined("copy_", *this, "destination");
  check_defined("copy_", src, "source");
  if (src.shape_ != shape_) {
    throw InvalidArgument(fmt::format("copy_: source shape {} does not match destination shape {}",
                                      src.shape_, shape_));
  }
  if (numel() == 0) return;
  const Tensor* from = &src;
  Tensor staged;
  if (src.storage_ == storage_ && ranges_overlap(src, *this)) {
    if (src.dtype_ == dtype_ && src.offset_ == offset_ && src.strides_ == strides_) {
      storage_->data();  // same elements: nothing to copy, but a freed storage still throws
      return;
    }
    staged = src.clone();  // overlapping views: read everything before writing
    from = &staged;
  }
  const Device dd = device();
  const Device sd = from->device();
  if (dd.is_cpu() && sd.is_cpu()) {
    detail::cpu_copy_cast(data_ptr(), dtype_, strides_, from->data_ptr(), from->dtype_,
                          from->strides_, shape_);
  } else if (dd == sd) {
    detail::cuda_copy_cast(data_ptr(), dtype_, strides_, from->data_ptr(), from->dtype_,
                           from->strides_, shape_, dd.index);
  } else {
    copy_across_devices(*this, *from);
  }
}

// ---- fills ----

void Tensor::fill_(double value) {
  check_defined("fill_", *this);
  const uint64_t pattern = detail::encode_value(value, dtype_);
  if (numel() == 0) return;
  if (device().is_cpu()) {
    detail::cpu_fill(data_ptr(), itemsize(dtype_), strides_, shape_, pattern);
  } else {
    detail::cuda_fill(data_ptr(), itemsize(dtype_), strides_, shape_, pattern, device().index);
  }
}

void Tensor::fill_index_(const std::function<double(std::span<const int64_t>)>& fn) {
  check_defined("fill_index_", *this);
  if (!device().is_cpu()) {
    Tensor host = empty(shape_, dtype_);
    host.fill_index_(fn);
    copy_(host);
    return;
  }
  if (numel() == 0) return;
  char* base = static_cast<char*>(data_ptr());
  const int64_t size = static_cast<int64_t>(itemsize(dtype_));
  Dims index = Dims::filled(ndim(), 0);
  int64_t offset = 0;  // element offset of `index`, kept in step with it
  for (;;) {
    detail::store_from_double(base + offset * size, dtype_,
                              fn(std::span<const int64_t>(index.data(), index.size())));
    int d = ndim() - 1;
    for (; d >= 0; --d) {
      if (++index[d] < shape_[d]) {
        offset += strides_[d];
        break;
      }
      offset -= strides_[d] * (shape_[d] - 1);
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// ---- element access ----

namespace {

// Element offset of `index` in t, with negative entries counted from the end.
int64_t element_offset(const char* op, const Tensor& t, std::span<const int64_t> index) {
  check_defined(op, t);
  if (static_cast<int>(index.size()) != t.ndim()) {
    throw InvalidArgument(fmt::format("{}: index has {} entries, tensor has {} dims (shape {})", op,
                                      index.size(), t.ndim(), t.shape()));
  }
  int64_t offset = t.storage_offset();
  for (int d = 0; d < t.ndim(); ++d) {
    const int64_t size = t.shape()[d];
    int64_t i = index[d];
    if (i < -size || i >= size) {
      throw InvalidArgument(
          fmt::format("{}: index {} out of range for dim {} of size {} (expected {}..{})", op, i, d,
                      size, -size, size - 1));
    }
    if (i < 0) i += size;
    offset += i * t.strides()[d];
  }
  return offset;
}

}  // namespace

double Tensor::item(std::initializer_list<int64_t> index) const {
  return item(std::span<const int64_t>(index.begin(), index.size()));
}

double Tensor::item(std::span<const int64_t> index) const {
  const int64_t offset = element_offset("item", *this, index);
  const size_t size = itemsize(dtype_);
  const char* element =
      static_cast<const char*>(storage_->data()) + offset * static_cast<int64_t>(size);
  if (device().is_cpu()) return detail::load_as_double(element, dtype_);
  unsigned char buffer[8];
  detail::cuda_memcpy(buffer, Device::cpu(), element, device(), size);
  return detail::load_as_double(buffer, dtype_);
}

void Tensor::set_item(std::initializer_list<int64_t> index, double value) {
  const int64_t offset =
      element_offset("set_item", *this, std::span<const int64_t>(index.begin(), index.size()));
  const size_t size = itemsize(dtype_);
  char* element = static_cast<char*>(storage_->data()) + offset * static_cast<int64_t>(size);
  if (device().is_cpu()) {
    detail::store_from_double(element, dtype_, value);
    return;
  }
  unsigned char buffer[8];
  detail::store_from_double(buffer, dtype_, value);
  detail::cuda_memcpy(element, device(), buffer, Device::cpu(), size);
}

std::vector<double> Tensor::to_vector() const {
  check_defined("to_vector", *this);
  const Tensor host = host_contiguous(*this, DType::kF64);
  const double* p = static_cast<const double*>(host.data_ptr());
  return std::vector<double>(p, p + numel());
}

// ---- comparisons ----

bool equal(const Tensor& a, const Tensor& b, bool allow_dtype_mismatch) {
  check_defined("equal", a, "first tensor");
  check_defined("equal", b, "second tensor");
  if (a.dtype() != b.dtype() && !allow_dtype_mismatch) {
    throw InvalidArgument(fmt::format(
        "equal: dtypes {} and {} differ; pass allow_dtype_mismatch = true to compare values",
        a.dtype(), b.dtype()));
  }
  if (a.shape() != b.shape()) return false;
  if (a.numel() == 0) return true;
  DType common = a.dtype();
  if (a.dtype() != b.dtype()) {
    common = (!is_floating_point(a.dtype()) && !is_floating_point(b.dtype())) ? DType::kI64
                                                                              : DType::kF64;
  }
  const Tensor ha = host_contiguous(a, common);
  const Tensor hb = host_contiguous(b, common);
  return detail::cpu_equal(ha.data_ptr(), hb.data_ptr(), common, a.numel());
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol, bool equal_nan) {
  check_defined("allclose", a, "first tensor");
  check_defined("allclose", b, "second tensor");
  if (a.shape() != b.shape()) {
    throw InvalidArgument(fmt::format("allclose: shapes {} and {} differ", a.shape(), b.shape()));
  }
  if (!(rtol >= 0) || !(atol >= 0)) {
    throw InvalidArgument(
        fmt::format("allclose: rtol {} and atol {} must be non-negative", rtol, atol));
  }
  if (a.numel() == 0) return true;
  // Every dtype except f64 and the integers is exact in float.
  const auto exact_in_float = [](DType d) { return is_floating_point(d) && d != DType::kF64; };
  const DType common =
      exact_in_float(a.dtype()) && exact_in_float(b.dtype()) ? DType::kF32 : DType::kF64;
  const Tensor ha = host_contiguous(a, common);
  const Tensor hb = host_contiguous(b, common);
  return detail::cpu_allclose(ha.data_ptr(), hb.data_ptr(), common, a.numel(), rtol, atol,
                              equal_nan);
}

}  // namespace kernels
