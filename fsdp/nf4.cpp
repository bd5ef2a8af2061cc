#include "fsdp/nf4.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/checked.h"
#include "kernels/error.h"

namespace fsdp {

using kernels::Dims;
using kernels::DType;
using kernels::Tensor;

uint8_t nf4_code(float v) {
  for (size_t i = 0; i + 1 < kNf4Levels.size(); ++i)
    if (v <= (kNf4Levels[i] + kNf4Levels[i + 1]) * 0.5f) return static_cast<uint8_t>(i);
  return static_cast<uint8_t>(kNf4Levels.size() - 1);
}

Nf4Tensor nf4_quantize(const Tensor& full) {
  if (!kernels::is_floating_point(full.dtype()) || full.numel() == 0)
    throw kernels::InvalidArgument(fmt::format("nf4_quantize: a {} tensor of {} elements; expected a floating "
                                               "tensor with at least one element",
                                               kernels::to_string(full.dtype()), full.numel()));
  Tensor host = full.device().is_cpu() ? full : full.to(kernels::Device{});
  const Tensor x = host.dtype() == DType::kF32 ? host.contiguous() : host.to(DType::kF32);
  const float* px = x.data<float>();
  const int64_t n = x.numel();
  const int64_t nb = kernels::checked_ceil_div(n, kNf4Block, "nf4 blocks");
  const int64_t ns = kernels::checked_ceil_div(nb, kNf4ScalerBlock, "nf4 scaler blocks");
  std::vector<float> absmax(static_cast<size_t>(nb), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    float& m = absmax[static_cast<size_t>(i / kNf4Block)];
    m = std::max(m, std::fabs(px[i]));
  }
  Nf4Tensor q;
  q.shape = full.shape();
  q.codes = Tensor::zeros(Dims{(n + 1) / 2}, DType::kU8);
  uint8_t* pc = q.codes.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const float a = absmax[static_cast<size_t>(i / kNf4Block)];
    const uint8_t c = nf4_code(a == 0.0f ? 0.0f : px[i] / a);
    pc[i / 2] = static_cast<uint8_t>(pc[i / 2] | (i % 2 == 0 ? c << 4 : c));
  }
  double sum = 0;
  for (float a : absmax) sum += a;
  q.mean = static_cast<float>(sum / static_cast<double>(nb));
  q.scalers = Tensor::zeros(Dims{nb}, DType::kU8);
  q.factors = Tensor::zeros(Dims{ns}, DType::kF32);
  uint8_t* ps = q.scalers.data<uint8_t>();
  float* pf = q.factors.data<float>();
  for (int64_t k = 0; k < ns; ++k) {
    const int64_t b0 = k * kNf4ScalerBlock, b1 = std::min(nb, b0 + kNf4ScalerBlock);
    float m = 0.0f;
    for (int64_t b = b0; b < b1; ++b) m = std::max(m, std::fabs(absmax[static_cast<size_t>(b)] - q.mean));
    const float factor = m > 0.0f ? 128.0f / m : 0.0f;
    pf[k] = factor;
    for (int64_t b = b0; b < b1; ++b) {
      const float v = factor == 0.0f ? 0.0f
                                     : std::clamp(std::nearbyint((absmax[static_cast<size_t>(b)] - q.mean) * factor),
                                                  -128.0f, 127.0f);
      ps[b] = static_cast<uint8_t>(static_cast<int8_t>(v));
    }
  }
  return q;
}

Tensor nf4_dequantize(const Nf4Tensor& q, DType out_dtype) {
  const int64_t n = q.shape.product();
  const int64_t nb = kernels::checked_ceil_div(n, kNf4Block, "nf4 blocks");
  const int64_t ns = kernels::checked_ceil_div(nb, kNf4ScalerBlock, "nf4 scaler blocks");
  if (q.codes.numel() != (n + 1) / 2 || q.scalers.numel() != nb || q.factors.numel() != ns ||
      q.codes.dtype() != DType::kU8 || q.scalers.dtype() != DType::kU8 || q.factors.dtype() != DType::kF32)
    throw kernels::InvalidArgument(fmt::format(
        "nf4_dequantize: {} codes, {} scalers, {} factors for {} elements; expected u8 {}, u8 {}, f32 {}",
        q.codes.numel(), q.scalers.numel(), q.factors.numel(), n, (n + 1) / 2, nb, ns));
  const Tensor codes = q.codes.contiguous(), scalers = q.scalers.contiguous(), factors = q.factors.contiguous();
  const uint8_t* pc = codes.data<uint8_t>();
  const uint8_t* ps = scalers.data<uint8_t>();
  const float* pf = factors.data<float>();
  std::vector<float> absmax(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) {
    const float f = pf[b / kNf4ScalerBlock];
    absmax[static_cast<size_t>(b)] =
        f == 0.0f ? q.mean : static_cast<float>(static_cast<int8_t>(ps[b])) / f + q.mean;
  }
  Tensor y = Tensor::empty(q.shape, DType::kF32);
  float* py = y.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = i % 2 == 0 ? pc[i / 2] >> 4 : pc[i / 2] & 0x0F;
    py[i] = kNf4Levels[c] * absmax[static_cast<size_t>(i / kNf4Block)];
  }
  if (out_dtype == DType::kF32) return y;
  Tensor out = Tensor::empty(q.shape, out_dtype);
  out.copy_(y);
  return out;
}

}  // namespace fsdp
