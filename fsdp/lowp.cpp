#include "fsdp/lowp.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "dtensor/dtensor.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/format.h"

namespace fsdp {

using kernels::Dims;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Tensor;

std::string to_string(const QuantConfig& c) {
  switch (c.kind) {
    case QuantKind::kFp8Tensor: return "fp8";
    case QuantKind::kFp8Rowwise: return "fp8-rowwise";
    case QuantKind::kInt8Block: return c.block == 256 ? "int8" : fmt::format("int8-block{}", c.block);
  }
  return "?";
}

int64_t quant_groups(const QuantConfig& c, const Dims& shape) {
  if (shape.size() == 0) throw InvalidArgument("quantisation of a 0-d tensor: expected at least one dim");
  const int64_t n = kernels::checked_product(shape, "quantised elements");
  switch (c.kind) {
    case QuantKind::kFp8Tensor: return 1;
    case QuantKind::kFp8Rowwise: return shape[shape.size() - 1] == 0 ? 0 : n / shape[shape.size() - 1];
    case QuantKind::kInt8Block:
      if (c.block < 1) throw InvalidArgument(fmt::format("int8 block size {}: expected >= 1", c.block));
      return kernels::checked_ceil_div(n, c.block, "quantisation blocks");
  }
  return 1;
}

float quant_scale(QuantKind kind, float amax) {
  if (kind == QuantKind::kInt8Block) return amax / kInt8Max;
  return kFp8E4M3Max / std::max(amax, kFp8AmaxEps);
}

uint8_t quantize_value(QuantKind kind, float x, float scale) {
  if (kind == QuantKind::kInt8Block) {
    if (scale == 0.0f) return 0;
    const float q = std::clamp(std::nearbyint(x / scale), -kInt8Max, kInt8Max);  // FE_TONEAREST: ties to even
    return static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  return kernels::float_to_f8e4m3_bits(std::clamp(x * scale, -kFp8E4M3Max, kFp8E4M3Max));
}

float dequantize_value(QuantKind kind, uint8_t code, float scale) {
  if (kind == QuantKind::kInt8Block) return static_cast<float>(static_cast<int8_t>(code)) * scale;
  return kernels::f8e4m3_bits_to_float(code) / scale;
}

DType quant_wire_dtype(QuantKind kind) { return kind == QuantKind::kInt8Block ? DType::kU8 : DType::kF8E4M3; }

namespace {

Tensor host_f32(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : t.to(kernels::Device{});
  if (h.dtype() != DType::kF32) return h.to(DType::kF32);
  return h.contiguous();
}

// Visits every element of a box of shape `box`: fn(a, g) with a = sum_d A[d][i_d] and
// g = sum_d G[d][i_d] (per-dim offset tables, each of box[d] entries).
template <class F>
void walk(const Dims& box, const std::vector<std::vector<int64_t>>& A, const std::vector<std::vector<int64_t>>& G,
          F&& fn) {
  const int nd = box.size();
  for (int d = 0; d < nd; ++d)
    if (box[d] == 0) return;
  std::vector<int64_t> i(static_cast<size_t>(nd), 0);
  const auto& al = A[static_cast<size_t>(nd - 1)];
  const auto& gl = G[static_cast<size_t>(nd - 1)];
  const int64_t last = box[nd - 1];
  while (true) {
    int64_t a0 = 0, g0 = 0;
    for (int d = 0; d + 1 < nd; ++d) {
      a0 += A[static_cast<size_t>(d)][static_cast<size_t>(i[static_cast<size_t>(d)])];
      g0 += G[static_cast<size_t>(d)][static_cast<size_t>(i[static_cast<size_t>(d)])];
    }
    for (int64_t j = 0; j < last; ++j) fn(a0 + al[static_cast<size_t>(j)], g0 + gl[static_cast<size_t>(j)]);
    int d = nd - 2;
    for (; d >= 0; --d) {
      if (++i[static_cast<size_t>(d)] < box[d]) break;
      i[static_cast<size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

// Offset tables of a layout: A[d][i] = (i + off[d]) * astride[d], G[d][i] = held_d[i + off[d]] * gstride[d].
void tables(const Dims& box, const Dims& off, const Dims& astride, const dtensor::ShardLayout& layout,
            const Dims& gstride, std::vector<std::vector<int64_t>>& A, std::vector<std::vector<int64_t>>& G) {
  const int nd = box.size();
  A.assign(static_cast<size_t>(nd), {});
  G.assign(static_cast<size_t>(nd), {});
  for (int d = 0; d < nd; ++d) {
    const dtensor::HeldIndices held(layout.runs[static_cast<size_t>(d)]);
    auto& a = A[static_cast<size_t>(d)];
    auto& g = G[static_cast<size_t>(d)];
    a.resize(static_cast<size_t>(box[d]));
    g.resize(static_cast<size_t>(box[d]));
    for (int64_t i = 0; i < box[d]; ++i) {
      a[static_cast<size_t>(i)] = (i + off[d]) * astride[d];
      g[static_cast<size_t>(i)] = held[i + off[d]] * gstride[d];
    }
  }
}

// dequantize_value() through a table of the 256 decoded codes (and, for one scale, of the 256
// results): the same float operations, so the same bits.
class Dequantizer {
 public:
  Dequantizer(QuantKind kind, const float* scales, int64_t groups) : kind_(kind), scales_(scales) {
    for (int c = 0; c < 256; ++c)
      decoded_[static_cast<size_t>(c)] = kind == QuantKind::kInt8Block
                                             ? static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c)))
                                             : kernels::f8e4m3_bits_to_float(static_cast<uint8_t>(c));
    one_ = groups == 1;
    if (one_)
      for (int c = 0; c < 256; ++c) single_[static_cast<size_t>(c)] = apply(decoded_[static_cast<size_t>(c)], scales[0]);
  }
  float operator()(uint8_t code, int64_t group) const {
    return one_ ? single_[code] : apply(decoded_[code], scales_[group]);
  }

 private:
  float apply(float q, float s) const { return kind_ == QuantKind::kInt8Block ? q * s : q / s; }
  QuantKind kind_;
  const float* scales_;
  bool one_ = false;
  std::array<float, 256> decoded_{}, single_{};
};

struct Scales {
  Tensor values;  // [G] f32, host
};

class QuantizedAllGather final : public AllGatherExtension {
 public:
  explicit QuantizedAllGather(QuantConfig c) : c_(c) {
    if (c_.kind == QuantKind::kInt8Block && c_.block < 1)
      throw InvalidArgument(fmt::format("int8 block size {}: expected >= 1", c_.block));
  }
  std::string name() const override { return to_string(c_); }

  std::vector<GatherInput> gather_inputs(const AllGatherContext& ctx) const override {
    if (!kernels::is_floating_point(ctx.sharded_spec.dtype))
      throw InvalidArgument(fmt::format("{} all-gather of parameter '{}': it is {}; expected a floating dtype", name(),
                                        ctx.name, kernels::to_string(ctx.sharded_spec.dtype)));
    return {GatherInput{quant_wire_dtype(c_.kind), Dims{ctx.padded_shape.product()}}};
  }

  PreAllGatherResult pre_all_gather(const Tensor& shard, const AllGatherContext& ctx) override {
    const Dims& gshape = ctx.sharded_spec.shape;
    const int64_t G = quant_groups(c_, gshape);
    const int64_t last = gshape[gshape.size() - 1];
    const Tensor x = host_f32(shard);
    const float* px = x.data<float>();
    const auto layout = ctx.sharded_spec.layout(ctx.comms->rank());
    if (!layout) throw kernels::InternalError(fmt::format("{}: this rank is not in the mesh", ctx.name));
    Dims box = ctx.padded_shape;
    box[ctx.shard_dim] = ctx.chunks[static_cast<size_t>(ctx.dp_coord)].size;
    std::vector<std::vector<int64_t>> A, Gt;
    tables(box, Dims::filled(box.size(), 0), Tensor::contiguous_strides(ctx.padded_shape), *layout,
           Tensor::contiguous_strides(gshape), A, Gt);
    // Partial amax of every group this rank touches (0 elsewhere: the identity of max of |x|).
    Tensor amax = Tensor::zeros(Dims{G}, DType::kF32);
    float* pa = amax.data<float>();
    walk(box, A, Gt, [&](int64_t a, int64_t f) {
      float& m = pa[quant_group(c_, f, last)];
      m = std::max(m, std::fabs(px[a]));
    });
    // max over the weight mesh: every dim but HSDP's replicate one (copies, not pieces).
    const auto& mesh = ctx.comms->mesh();
    dtensor::Placements partial(static_cast<size_t>(mesh.ndim()), dtensor::Partial{dtensor::ReduceOp::kMax});
    if (ctx.replicate_mesh_dim) partial[static_cast<size_t>(*ctx.replicate_mesh_dim)] = dtensor::Replicate{};
    const auto mesh_ptr = std::shared_ptr<const dtensor::DeviceMesh>(ctx.comms, &mesh);
    const dtensor::DTensor part(ctx.comms, dtensor::make_spec(mesh_ptr, partial, Dims{G}, DType::kF32), amax.to(shard.device()));
    const dtensor::Placements all_r(static_cast<size_t>(mesh.ndim()), dtensor::Replicate{});
    PreAllGatherResult r;
    r.communicated_bytes = part.plan_to(all_r).bytes_per_rank();
    Tensor global_amax = host_f32(part.redistribute(all_r).to_local());
    Scales scales{Tensor::empty(Dims{G}, DType::kF32)};
    const float* pg = global_amax.data<float>();
    float* ps = scales.values.data<float>();
    for (int64_t g = 0; g < G; ++g) ps[g] = quant_scale(c_.kind, pg[g]);
    // Codes of the padded shard (padding rows: code 0, i.e. +0).
    Tensor codes = Tensor::zeros(Dims{ctx.padded_shape.product()}, DType::kU8);
    uint8_t* pq = codes.data<uint8_t>();
    walk(box, A, Gt, [&](int64_t a, int64_t f) { pq[a] = quantize_value(c_.kind, px[a], ps[quant_group(c_, f, last)]); });
    const DType wire = quant_wire_dtype(c_.kind);
    Tensor q = Tensor::from_storage(codes.storage(), wire, codes.shape(), codes.strides());
    r.inputs.push_back(shard.device().is_cpu() ? q : q.to(shard.device()));
    r.metadata = std::move(scales);
    return r;
  }

  void post_all_gather(const std::vector<Tensor>& gathered, const std::any& metadata, DType /*param_dtype*/,
                       Tensor& out, const AllGatherContext& ctx) override {
    const Scales* scales = std::any_cast<Scales>(&metadata);
    if (!scales || gathered.size() != 1)
      throw kernels::InternalError(fmt::format("{} all-gather of '{}': unexpected metadata or inputs", name(), ctx.name));
    const Tensor g0 = gathered[0].device().is_cpu() ? gathered[0] : gathered[0].to(kernels::Device{});
    const uint8_t* pq = static_cast<const uint8_t*>(g0.data_ptr());
    const float* ps = scales->values.data<float>();
    const Dequantizer deq(c_.kind, ps, scales->values.numel());
    const Dims& gshape = ctx.unsharded_spec.shape;
    const int64_t last = gshape[gshape.size() - 1];
    const auto layout = ctx.unsharded_spec.layout(ctx.comms->rank());
    if (!layout) throw kernels::InternalError(fmt::format("{}: this rank is not in the mesh", ctx.name));
    Tensor y = Tensor::empty(ctx.local_shape, DType::kF32);
    float* py = y.data<float>();
    const Dims ostride = Tensor::contiguous_strides(ctx.local_shape);
    const int64_t piece = ctx.padded_shape.product();
    const Dims pstride = Tensor::contiguous_strides(ctx.padded_shape);
    for (size_t d = 0; d < ctx.chunks.size(); ++d) {
      const dtensor::Chunk& ch = ctx.chunks[d];
      if (ch.size == 0) continue;
      Dims box = ctx.padded_shape;
      box[ctx.shard_dim] = ch.size;
      Dims off = Dims::filled(box.size(), 0);
      off[ctx.shard_dim] = ch.offset;
      // Per element: its output position, its code's position in rank d's padded piece (the
      // same multi-index, less off) and its global flat index.
      std::vector<std::vector<int64_t>> A, Gt, P, unused;
      tables(box, off, ostride, *layout, Tensor::contiguous_strides(gshape), A, Gt);
      tables(box, Dims::filled(box.size(), 0), pstride, *layout, Dims::filled(box.size(), 0), P, unused);
      const int64_t base = static_cast<int64_t>(d) * piece;
      walk3(box, A, P, Gt, [&](int64_t o, int64_t p, int64_t f) {
        py[o] = deq(pq[base + p], quant_group(c_, f, last));
      });
    }
    out.copy_(y);  // rounds to the param dtype (nearest even)
  }

 private:
  // walk() over three tables at once.
  template <class F>
  static void walk3(const Dims& box, const std::vector<std::vector<int64_t>>& A,
                    const std::vector<std::vector<int64_t>>& B, const std::vector<std::vector<int64_t>>& C, F&& fn) {
    const int nd = box.size();
    for (int d = 0; d < nd; ++d)
      if (box[d] == 0) return;
    std::vector<size_t> i(static_cast<size_t>(nd), 0);
    const size_t L = static_cast<size_t>(nd - 1);
    while (true) {
      int64_t a0 = 0, b0 = 0, c0 = 0;
      for (size_t d = 0; d < L; ++d) {
        a0 += A[d][i[d]];
        b0 += B[d][i[d]];
        c0 += C[d][i[d]];
      }
      for (size_t j = 0; j < static_cast<size_t>(box[nd - 1]); ++j) fn(a0 + A[L][j], b0 + B[L][j], c0 + C[L][j]);
      int d = nd - 2;
      for (; d >= 0; --d) {
        if (static_cast<int64_t>(++i[static_cast<size_t>(d)]) < box[d]) break;
        i[static_cast<size_t>(d)] = 0;
      }
      if (d < 0) return;
    }
  }

  QuantConfig c_;
};

}  // namespace

Tensor fake_quantize(const Tensor& full, const QuantConfig& c, DType out_dtype) {
  const Dims& shape = full.shape();
  const int64_t G = quant_groups(c, shape);
  const int64_t last = shape[shape.size() - 1];
  const Tensor x = host_f32(full);
  const float* px = x.data<float>();
  const int64_t n = x.numel();
  std::vector<float> amax(static_cast<size_t>(G), 0.0f);
  for (int64_t f = 0; f < n; ++f) {
    float& m = amax[static_cast<size_t>(quant_group(c, f, last))];
    m = std::max(m, std::fabs(px[f]));
  }
  for (float& a : amax) a = quant_scale(c.kind, a);
  Tensor y = Tensor::empty(shape, DType::kF32);
  float* py = y.data<float>();
  for (int64_t f = 0; f < n; ++f) {
    const float s = amax[static_cast<size_t>(quant_group(c, f, last))];
    py[f] = dequantize_value(c.kind, quantize_value(c.kind, px[f], s), s);
  }
  Tensor out = Tensor::empty(shape, out_dtype, full.device());
  out.copy_(y);
  return out;
}

std::shared_ptr<AllGatherExtension> make_quantized_all_gather(const QuantConfig& config) {
  return std::make_shared<QuantizedAllGather>(config);
}

}  // namespace fsdp
