// Tensor: a strided view (dtype, shape, strides, storage offset, all in elements) of a shared
// Storage on the CPU or a CUDA device. Up to kMaxDims dims. Views share storage; copies do not.
//   Tensor t = Tensor::empty({4, 6}, DType::kF32);       // contiguous, strides {6, 1}
//   Tensor v = t.narrow(1, 2, 3).permute({1, 0});        // shape {3, 4}, strides {1, 6}, offset 2
//   v.fill_(1.0);                                        // writes through to t
//   Tensor c = v.contiguous();                           // new storage, strides {4, 1}
//   Tensor h = c.to(DType::kBF16);                       // round to nearest even
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kernels/device.h"
#include "kernels/dims.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/storage.h"

namespace kernels {

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() == false

  // ---- factories (contiguous, row-major) ----
  static Tensor empty(const Dims& shape, DType dtype, Device device = {});
  // The same, with the storage taken from (and given back to) `allocator` (kernels/allocator.h).
  static Tensor empty(const Dims& shape, DType dtype, Device device, std::shared_ptr<Allocator> allocator);
  static Tensor zeros(const Dims& shape, DType dtype, Device device = {});
  static Tensor full(const Dims& shape, double value, DType dtype, Device device = {});
  // Values 0, 1, 2, ... in row-major order, cast to dtype.
  static Tensor arange(const Dims& shape, DType dtype, Device device = {});
  // Copies host values (converted to dtype) into a new tensor of the given shape.
  static Tensor from_vector(const std::vector<double>& values, const Dims& shape,
                            DType dtype = DType::kF32, Device device = {});
  // A view of existing storage. REQUIRES: every addressed element lies inside the storage.
  static Tensor from_storage(std::shared_ptr<Storage> storage, DType dtype, const Dims& shape,
                             const Dims& strides, int64_t storage_offset = 0);
  static Dims contiguous_strides(const Dims& shape);

  // ---- metadata ----
  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const;
  int ndim() const { return shape_.size(); }
  const Dims& shape() const { return shape_; }
  const Dims& strides() const { return strides_; }
  int64_t size(int dim) const;    // negative dims count from the end
  int64_t stride(int dim) const;
  int64_t storage_offset() const { return offset_; }
  int64_t numel() const { return shape_.product(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemsize(dtype_); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  // True when both view the same Storage object.
  bool shares_storage_with(const Tensor& other) const { return storage_ == other.storage_; }

  // Address of element [0,...,0]; throws InvalidArgument if the storage is freed.
  void* data_ptr() const;
  // Typed pointer; throws InvalidArgument when T does not match dtype().
  template <class T>
  T* data() const {
    check_dtype(dtype_of_v<T>);
    return static_cast<T*>(data_ptr());
  }

  // ---- views (share storage; dims may be negative) ----
  Tensor narrow(int dim, int64_t start, int64_t length) const;
  Tensor select(int dim, int64_t index) const;  // removes dim
  // Same elements, new shape; one entry may be -1. Throws InvalidArgument when the strides
  // cannot express the new shape without a copy (use reshape).
  Tensor view(const Dims& shape) const;
  // view() when possible, otherwise a contiguous copy.
  Tensor reshape(const Dims& shape) const;
  Tensor permute(const Dims& order) const;
  Tensor transpose(int dim0, int dim1) const;
  // Like torch.flatten: reshape semantics (a view when the strides allow it, else a copy).
  Tensor flatten(int start_dim = 0, int end_dim = -1) const;
  Tensor unsqueeze(int dim) const;
  Tensor as_strided(const Dims& shape, const Dims& strides, int64_t storage_offset) const;

  // ---- copies ----
  Tensor contiguous() const;  // *this when already contiguous
  Tensor clone() const;       // always a new contiguous storage
  Tensor to(DType dtype) const;    // new tensor (same device), element-wise cast
  Tensor to(Device device) const;  // new tensor on device (same dtype)
  // Copies src into *this element-wise with cast; shapes must be equal; devices may differ.
  void copy_(const Tensor& src);

  // ---- fills ----
  void fill_(double value);
  // Sets every element to fn(multi-index); the index has ndim() entries, row-major visiting.
  void fill_index_(const std::function<double(std::span<const int64_t>)>& fn);

  // ---- element access (slow; for tests and printing) ----
  double item(std::initializer_list<int64_t> index) const;
  double item(std::span<const int64_t> index) const;
  void set_item(std::initializer_list<int64_t> index, double value);
  // Every element as double, row-major.
  std::vector<double> to_vector() const;

 private:
  void check_dtype(DType expected) const;
  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::kF32;
  Dims shape_;
  Dims strides_;
  int64_t offset_ = 0;
};

// Same shape and element values (values compared after conversion to double; NaN != NaN, as
// torch.equal). dtypes may differ only when allow_dtype_mismatch is set (otherwise
// InvalidArgument); different shapes give false. Integer tensors compare exactly (as int64).
bool equal(const Tensor& a, const Tensor& b, bool allow_dtype_mismatch = false);
// |a - b| <= atol + rtol * |b| element-wise, shapes equal (torch.allclose semantics: infinities
// are close only to themselves, NaN only with equal_nan). Any dtypes; InvalidArgument when the
// shapes differ or a tolerance is negative.
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8,
              bool equal_nan = false);

}  // namespace kernels
