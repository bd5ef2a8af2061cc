// CPU element-wise maps: rows of a coalesced strided space, computed by the VecOps primitives on
// contiguous arrays of the compute type (f32, or f64 for f64 inputs). Rows that are already
// contiguous arrays of the compute type are passed straight through; others are converted in
// chunks through stack buffers.
#include <algorithm>
#include <array>
#include <cstdint>

#include "kernels/cpu/compute.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vec.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

template <class C>
void apply(const VecOps<C>& v, MapOp op, C alpha, C* out, const C* x0, const C* x1, int64_t n) {
  switch (op) {
    case MapOp::kAdd:
      return v.add(out, x0, x1, alpha, n);
    case MapOp::kMul:
      return v.mul(out, x0, x1, n);
    case MapOp::kScale:
      return v.scale(out, x0, alpha, n);
    case MapOp::kGelu:
      return v.gelu(out, x0, n, false);
    case MapOp::kGeluTanh:
      return v.gelu(out, x0, n, true);
    case MapOp::kGeluBackward:
      return v.gelu_backward(out, x0, x1, n, false);
    case MapOp::kGeluTanhBackward:
      return v.gelu_backward(out, x0, x1, n, true);
    case MapOp::kSilu:
      return v.silu(out, x0, n);
    case MapOp::kSiluBackward:
      return v.silu_backward(out, x0, x1, n);
  }
}

template <class C>
void map_impl(MapOp op, double alpha_d, const Tensor& out, const Tensor* in0, const Tensor* in1) {
  const VecOps<C>& v = vec_ops<C>();
  const C alpha = static_cast<C>(alpha_d);
  constexpr DType kC = dtype_of_v<C>;
  const int nin = in1 != nullptr ? 2 : 1;
  const DType d0 = in0->dtype();
  const DType d1 = in1 != nullptr ? in1->dtype() : d0;
  const DType out_dtype = out.dtype();
  const auto space = coalesce<3>(out.shape(), {out.strides(), in0->strides(),
                                               in1 != nullptr ? in1->strides() : in0->strides()});
  void* po = out.data_ptr();
  const void* p0 = in0->data_ptr();
  const void* p1 = in1 != nullptr ? in1->data_ptr() : nullptr;
  const int64_t so = space.strides[0].back();
  const int64_t s0 = space.strides[1].back();
  const int64_t s1 = space.strides[2].back();

  const bool direct_in = d0 == kC && s0 == 1 && (nin == 1 || (d1 == kC && s1 == 1));
  const bool direct_out = out_dtype == kC && so == 1;
  if (direct_in && direct_out) {
    for_each_row<3>(space, [&](const std::array<int64_t, 3>& off, int64_t n) {
      apply<C>(v, op, alpha, static_cast<C*>(at(po, kC, off[0])),
               static_cast<const C*>(at(p0, kC, off[1])),
               nin == 2 ? static_cast<const C*>(at(p1, kC, off[2])) : nullptr, n);
    });
    return;
  }
  // b broadcast along the row (a bias over rows, a scalar): one value per row.
  if (op == MapOp::kAdd && d0 == kC && d1 == kC && s0 == 1 && s1 == 0 && direct_out) {
    for_each_row<3>(space, [&](const std::array<int64_t, 3>& off, int64_t n) {
      const C b = *static_cast<const C*>(at(p1, kC, off[2]));
      v.add_scalar_b(static_cast<C*>(at(po, kC, off[0])), static_cast<const C*>(at(p0, kC, off[1])),
                     b, alpha, n);
    });
    return;
  }
  constexpr int64_t kChunk = 512;
  alignas(64) C b0[kChunk];
  alignas(64) C b1[kChunk];
  alignas(64) C bo[kChunk];
  for_each_row<3>(space, [&](const std::array<int64_t, 3>& off, int64_t n) {
    for (int64_t s = 0; s < n; s += kChunk) {
      const int64_t len = std::min(kChunk, n - s);
      const C* x0 = b0;
      const C* x1 = nullptr;
      if (d0 == kC && s0 == 1) {
        x0 = static_cast<const C*>(at(p0, kC, off[1] + s));
      } else {
        load_row<C>(b0, at(p0, d0, off[1] + s * s0), d0, s0, len);
      }
      if (nin == 2) {
        if (d1 == kC && s1 == 1) {
          x1 = static_cast<const C*>(at(p1, kC, off[2] + s));
        } else {
          load_row<C>(b1, at(p1, d1, off[2] + s * s1), d1, s1, len);
          x1 = b1;
        }
      }
      if (direct_out) {
        apply<C>(v, op, alpha, static_cast<C*>(at(po, kC, off[0] + s)), x0, x1, len);
      } else {
        apply<C>(v, op, alpha, bo, x0, x1, len);
        store_row<C>(at(po, out_dtype, off[0] + s * so), out_dtype, so, bo, len);
      }
    }
  });
}

}  // namespace

void cpu_map(MapOp op, double alpha, const Tensor& out, const Tensor* in0, const Tensor* in1) {
  if (out.numel() == 0) return;
  if (in0->dtype() == DType::kF64 || (in1 != nullptr && in1->dtype() == DType::kF64)) {
    map_impl<double>(op, alpha, out, in0, in1);
  } else {
    map_impl<float>(op, alpha, out, in0, in1);
  }
}

}  // namespace kernels::detail
