#include "fsdp/lowp.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <variant>
#include <vector>

#include "dtensor/dtensor.h"
#include "fsdp/lowp_checkpoint.h"
#include "fsdp/nf4.h"
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
    case QuantKind::kNf4: return "nf4";
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
    case QuantKind::kNf4: return kernels::checked_ceil_div(n, kNf4Block, "nf4 blocks");
  }
  return 1;
}

float quant_scale(QuantKind kind, float amax) {
  if (kind == QuantKind::kInt8Block) return amax / kInt8Max;
  return kFp8E4M3Max / std::max(amax, kFp8AmaxEps);
}

uint8_t quantize_value(QuantKind kind, float x, float scale) {
  if (kind == QuantKind::kNf4) return nf4_code(x, scale);
  if (kind == QuantKind::kInt8Block) {
    if (scale == 0.0f) return 0;
    const float q = std::clamp(std::nearbyint(x / scale), -kInt8Max, kInt8Max);  // FE_TONEAREST: ties to even
    return static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  return kernels::float_to_f8e4m3_bits(std::clamp(x * scale, -kFp8E4M3Max, kFp8E4M3Max));
}

float dequantize_value(QuantKind kind, uint8_t code, float scale) {
  if (kind == QuantKind::kNf4) return kNf4Levels[code & 0x0F] * scale;
  if (kind == QuantKind::kInt8Block) return static_cast<float>(static_cast<int8_t>(code)) * scale;
  return kernels::f8e4m3_bits_to_float(code) / scale;
}

DType quant_wire_dtype(QuantKind kind) {
  return kind == QuantKind::kFp8Tensor || kind == QuantKind::kFp8Rowwise ? DType::kF8E4M3 : DType::kU8;
}

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
                                         : kind == QuantKind::kNf4 ? kNf4Levels[static_cast<size_t>(c & 0x0F)]
                                                                   : kernels::f8e4m3_bits_to_float(static_cast<uint8_t>(c));
    one_ = groups == 1;
    if (one_)
      for (int c = 0; c < 256; ++c) single_[static_cast<size_t>(c)] = apply(decoded_[static_cast<size_t>(c)], scales[0]);
  }
  float operator()(uint8_t code, int64_t group) const {
    return one_ ? single_[code] : apply(decoded_[code], scales_[group]);
  }

 private:
  float apply(float q, float s) const {
    return kind_ == QuantKind::kInt8Block || kind_ == QuantKind::kNf4 ? q * s : q / s;
  }
  QuantKind kind_;
  const float* scales_;
  bool one_ = false;
  std::array<float, 256> decoded_{}, single_{};
};

struct Scales {
  Tensor values;  // [G] f32, host: what dequantisation multiplies or divides by
};

// Bytes of n codes on the wire: one each, or two per byte (nf4).
int64_t code_bytes(QuantKind kind, int64_t n) { return kind == QuantKind::kNf4 ? (n + 1) / 2 : n; }

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
    return {GatherInput{quant_wire_dtype(c_.kind), Dims{code_bytes(c_.kind, ctx.padded_shape.product())}}};
  }

  PreAllGatherResult pre_all_gather(const Tensor& shard, const AllGatherContext& ctx) override {
    if (c_.static_scales && cached_codes_.defined()) {  // a frozen weight: the first unshard's
      PreAllGatherResult r;
      r.inputs.push_back(cached_codes_);
      r.metadata = cached_scales_;
      return r;
    }
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
    PreAllGatherResult r;
    // Partial amax of every group this rank touches (0 elsewhere: the identity of max of |x|).
    Tensor amax = Tensor::zeros(Dims{G}, DType::kF32);
    float* pa = amax.data<float>();
    walk(box, A, Gt, [&](int64_t a, int64_t f) {
      float& m = pa[quant_group(c_, f, last)];
      m = std::max(m, std::fabs(px[a]));
    });
    const Tensor global_amax = all_reduce_amax(amax, shard.device(), ctx, r.communicated_bytes);
    Scales scales{Tensor::empty(Dims{G}, DType::kF32)};
    const float* pg = global_amax.data<float>();
    float* ps = scales.values.data<float>();
    if (c_.kind == QuantKind::kNf4) {
      const std::vector<float> dq = nf4_dequantized_absmax(std::vector<float>(pg, pg + G));
      std::copy(dq.begin(), dq.end(), ps);
    } else {
      for (int64_t g = 0; g < G; ++g) ps[g] = quant_scale(c_.kind, pg[g]);
    }
    // Codes of the padded shard (padding: code 0; nf4: two per byte, element 2j high).
    const int64_t padded = ctx.padded_shape.product();
    Tensor codes = Tensor::zeros(Dims{code_bytes(c_.kind, padded)}, DType::kU8);
    uint8_t* pq = codes.data<uint8_t>();
    if (c_.kind == QuantKind::kNf4) {
      walk(box, A, Gt, [&](int64_t a, int64_t f) {
        const uint8_t c = nf4_code(px[a], pg[f / kNf4Block]);
        pq[a / 2] = static_cast<uint8_t>(pq[a / 2] | (a % 2 == 0 ? c << 4 : c));
      });
    } else {
      walk(box, A, Gt, [&](int64_t a, int64_t f) { pq[a] = quantize_value(c_.kind, px[a], ps[quant_group(c_, f, last)]); });
    }
    const DType wire = quant_wire_dtype(c_.kind);
    Tensor q = Tensor::from_storage(codes.storage(), wire, codes.shape(), codes.strides());
    r.inputs.push_back(shard.device().is_cpu() ? q : q.to(shard.device()));
    if (c_.static_scales) {
      cached_codes_ = r.inputs[0];
      cached_scales_ = scales;
    }
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
      const int64_t base = static_cast<int64_t>(d) * code_bytes(c_.kind, piece);
      if (c_.kind == QuantKind::kNf4) {
        walk3(box, A, P, Gt, [&](int64_t o, int64_t p, int64_t f) {
          const uint8_t b = pq[base + p / 2];
          py[o] = deq(p % 2 == 0 ? b >> 4 : b & 0x0F, f / kNf4Block);
        });
      } else {
        walk3(box, A, P, Gt, [&](int64_t o, int64_t p, int64_t f) {
          py[o] = deq(pq[base + p], quant_group(c_, f, last));
        });
      }
    }
    out.copy_(y);  // rounds to the param dtype (nearest even)
  }

 private:
  // max over the weight mesh: every dim but HSDP's replicate one (copies, not pieces).
  static Tensor all_reduce_amax(const Tensor& amax, kernels::Device device, const AllGatherContext& ctx,
                                int64_t& communicated_bytes) {
    const auto& mesh = ctx.comms->mesh();
    dtensor::Placements partial(static_cast<size_t>(mesh.ndim()), dtensor::Partial{dtensor::ReduceOp::kMax});
    if (ctx.replicate_mesh_dim) partial[static_cast<size_t>(*ctx.replicate_mesh_dim)] = dtensor::Replicate{};
    const auto mesh_ptr = std::shared_ptr<const dtensor::DeviceMesh>(ctx.comms, &mesh);
    const dtensor::DTensor part(ctx.comms, dtensor::make_spec(mesh_ptr, partial, amax.shape(), DType::kF32),
                                amax.to(device));
    const dtensor::Placements all_r(static_cast<size_t>(mesh.ndim()), dtensor::Replicate{});
    communicated_bytes = part.plan_to(all_r).bytes_per_rank();
    return host_f32(part.redistribute(all_r).to_local());
  }

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
  // static_scales: the codes and scales of the first unshard (the gathered input is only read).
  Tensor cached_codes_;
  Scales cached_scales_;
};

}  // namespace

Tensor fake_quantize(const Tensor& full, const QuantConfig& c, DType out_dtype) {
  if (c.kind == QuantKind::kNf4) {
    Tensor out = Tensor::empty(full.shape(), out_dtype, full.device());
    out.copy_(nf4_dequantize(nf4_quantize(full), DType::kF32));
    return out;
  }
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

// ---- checkpoints of low-precision parameters (fsdp/lowp_checkpoint.h) ----

namespace {

using dtensor::DTensor;
using dtensor::DTensorSpec;

void check_checkpoint_kind(const std::string& name, const QuantConfig& q) {
  if (q.kind == QuantKind::kInt8Block && q.block < 1)
    throw InvalidArgument(fmt::format("low-precision checkpoint of '{}': int8 block size {}; expected >= 1", name, q.block));
}

// The "<name>._quant" value of each kind.
std::string checkpoint_kind_name(QuantKind kind) {
  switch (kind) {
    case QuantKind::kFp8Tensor: return "fp8-e4m3";
    case QuantKind::kFp8Rowwise: return "fp8-e4m3-rowwise";
    case QuantKind::kInt8Block: return "int8";
    case QuantKind::kNf4: return "nf4";
  }
  return "";
}

// "<name>._scale"'s shape (fp8, int8): [1] per tensor, x's shape with the last dim 1 per row (it
// broadcasts against the codes), [G] per int8 block.
Dims scale_shape(const QuantConfig& q, const Dims& x) {
  if (q.kind == QuantKind::kFp8Rowwise) {
    Dims s = x;
    s[s.size() - 1] = 1;
    return s;
  }
  return Dims{quant_groups(q, x)};
}

DTensorSpec replicated_spec(const DTensorSpec& like, Dims shape, DType dtype) {
  return dtensor::make_spec(like.mesh, dtensor::Placements(like.placements.size(), dtensor::Replicate{}),
                            std::move(shape), dtype);
}

// The codes entry's spec: x's placements; nf4 packs the last dim in pairs.
DTensorSpec codes_spec(const DTensorSpec& x, QuantKind kind) {
  Dims shape = x.shape;
  if (kind == QuantKind::kNf4) shape[shape.size() - 1] = (shape[shape.size() - 1] + 1) / 2;
  return dtensor::make_spec(x.mesh, x.placements, shape, quant_wire_dtype(kind));
}

// nf4: this rank's held last-dim indices must pair up (2j, 2j + 1) and the packed spec must hold
// exactly their halves, so a byte never straddles two ranks.
void check_pairs(const std::string& name, const DTensorSpec& x, const dtensor::ShardLayout& lx,
                 const dtensor::ShardLayout& lc) {
  const int d = x.tensor_ndim() - 1;
  const dtensor::HeldIndices hx(lx.runs[static_cast<size_t>(d)]), hc(lc.runs[static_cast<size_t>(d)]);
  const int64_t n = x.shape[d];
  bool ok = hc.size() == (hx.size() + 1) / 2;
  for (int64_t p = 0; ok && p < hx.size(); p += 2) {
    ok = hx[p] % 2 == 0 && hc[p / 2] == hx[p] / 2;
    if (ok && p + 1 < hx.size()) ok = hx[p + 1] == hx[p] + 1;
    else if (ok) ok = hx[p] + 1 == n;  // a lone last element: the end of the dim
  }
  if (!ok)
    throw kernels::Unsupported(fmt::format(
        "nf4 checkpoint of '{}': placements {} split its last dim ({}) between an even and an odd index; two "
        "codes share a byte, so each rank must hold whole pairs (save it with the last dim unsplit or split evenly)",
        name, dtensor::to_string(x.placements), n));
}


// The max of every rank's `amax` over the whole mesh (a Replicate dim holds copies: max is
// unchanged by them).
Tensor mesh_max(const DTensor& like, const Tensor& amax) {
  const auto& mesh = like.comms()->mesh();
  const dtensor::Placements partial(static_cast<size_t>(mesh.ndim()), dtensor::Partial{dtensor::ReduceOp::kMax});
  const DTensor part(like.comms(), dtensor::make_spec(like.spec().mesh, partial, amax.shape(), DType::kF32),
                     amax.to(like.to_local().device()));
  return host_f32(part.redistribute(dtensor::Placements(static_cast<size_t>(mesh.ndim()), dtensor::Replicate{})).to_local());
}

// Copies src into an entry's local tensor (a view of the same storage).
void fill(nn::StateDict& sd, const std::string& key, const Tensor& src) {
  Tensor local = sd.find(key)->to_local();
  local.copy_(src);
}

Tensor local_empty(const DTensor& like, const DTensorSpec& spec) {
  const auto layout = spec.layout(like.comms()->rank());
  return Tensor::empty(layout ? layout->local_shape : Dims::filled(spec.tensor_ndim(), 0), spec.dtype,
                       like.to_local().device());
}

const dtensor::ShardLayout& layout_of(const DTensorSpec& spec, const DTensor& like, std::optional<dtensor::ShardLayout>& keep) {
  keep = spec.layout(like.comms()->rank());
  if (!keep) throw kernels::InternalError("low-precision checkpoint: this rank is not in the mesh");
  return *keep;
}

const DTensor& entry(const nn::StateDict& sd, const std::string& key, const Dims& shape, DType dtype) {
  const DTensor* t = sd.find(key);
  if (!t || !(t->shape() == shape) || t->dtype() != dtype)
    throw InvalidArgument(fmt::format("low-precision checkpoint: entry '{}' is {}; expected {} {}", key,
                                      t ? fmt::format("{} {}", kernels::to_string(t->dtype()), kernels::to_string(t->shape()))
                                        : std::string("missing"),
                                      kernels::to_string(dtype), kernels::to_string(shape)));
  return *t;
}

}  // namespace

nn::StateDict quantized_checkpoint_template(const std::string& name, const DTensor& like, const QuantConfig& q) {
  check_checkpoint_kind(name, q);
  const DTensorSpec& x = like.spec();
  nn::StateDict sd;
  const DTensorSpec cs = codes_spec(x, q.kind);
  sd.tensors.emplace_back(name, DTensor(like.comms(), cs, local_empty(like, cs)));
  sd.values[name + "._quant"] = checkpoint_kind_name(q.kind);
  auto rep = [&](const std::string& key, Dims shape, DType dtype) {
    const DTensorSpec rs = replicated_spec(x, std::move(shape), dtype);
    sd.tensors.emplace_back(key, DTensor(like.comms(), rs, local_empty(like, rs)));
  };
  if (q.kind != QuantKind::kNf4) {
    rep(name + "._scale", scale_shape(q, x.shape), DType::kF32);
    if (q.kind == QuantKind::kInt8Block) sd.values[name + "._block"] = q.block;
  } else {
    const int64_t nb = quant_groups(q, x.shape);
    rep(name + "._scale", Dims{nb}, DType::kU8);
    rep(name + "._scale_factor", Dims{kernels::checked_ceil_div(nb, kNf4ScalerBlock, "nf4 scaler blocks")}, DType::kF32);
    rep(name + "._scale_mean", Dims{1}, DType::kF32);
  }
  return sd;
}

nn::StateDict quantize_for_checkpoint(const std::string& name, const DTensor& xd, const QuantConfig& q) {
  check_checkpoint_kind(name, q);
  const DTensorSpec& x = xd.spec();
  if (!kernels::is_floating_point(x.dtype) || x.tensor_ndim() < 1 || x.shape.product() == 0)
    throw InvalidArgument(fmt::format("low-precision checkpoint of '{}': a {} tensor of shape {}; expected a floating "
                                      "tensor with at least one element",
                                      name, kernels::to_string(x.dtype), kernels::to_string(x.shape)));
  nn::StateDict sd = quantized_checkpoint_template(name, xd, q);
  std::optional<dtensor::ShardLayout> keep_x, keep_c;
  const dtensor::ShardLayout& lx = layout_of(x, xd, keep_x);
  const DTensorSpec cs = codes_spec(x, q.kind);
  if (q.kind == QuantKind::kNf4) check_pairs(name, x, lx, layout_of(cs, xd, keep_c));
  const Tensor xl = host_f32(xd.to_local());
  const float* px = xl.data<float>();
  const Dims& box = lx.local_shape;
  std::vector<std::vector<int64_t>> A, Gt;
  tables(box, Dims::filled(box.size(), 0), Tensor::contiguous_strides(box), lx, Tensor::contiguous_strides(x.shape), A,
         Gt);
  const int64_t G = quant_groups(q, x.shape);
  Tensor amax = Tensor::zeros(Dims{G}, DType::kF32);
  float* pa = amax.data<float>();
  const int64_t last = x.shape[x.tensor_ndim() - 1];
  walk(box, A, Gt, [&](int64_t a, int64_t f) {
    float& m = pa[quant_group(q, f, last)];
    m = std::max(m, std::fabs(px[a]));
  });
  const Tensor global = mesh_max(xd, amax);
  const float* pg = global.data<float>();
  const DTensor& codes = *sd.find(name);
  Tensor cl = Tensor::zeros(codes.to_local().shape(), DType::kU8);
  uint8_t* pc = cl.data<uint8_t>();
  if (q.kind != QuantKind::kNf4) {
    Tensor sc = Tensor::empty(Dims{G}, DType::kF32);
    float* ps = sc.data<float>();
    for (int64_t g = 0; g < G; ++g) ps[g] = quant_scale(q.kind, pg[g]);
    walk(box, A, Gt, [&](int64_t a, int64_t f) { pc[a] = quantize_value(q.kind, px[a], ps[quant_group(q, f, last)]); });
    fill(sd, name + "._scale", sc.view(scale_shape(q, x.shape)));
  } else {
    // Local element a = (row r, last-dim position j) -> byte r * ceil(L / 2) + j / 2.
    const int64_t L = box[box.size() - 1], Lp = (L + 1) / 2;
    walk(box, A, Gt, [&](int64_t a, int64_t f) {
      const uint8_t c = nf4_code(px[a], pg[f / kNf4Block]);
      const int64_t byte = (a / L) * Lp + (a % L) / 2;
      pc[byte] = static_cast<uint8_t>(pc[byte] | ((a % L) % 2 == 0 ? c << 4 : c));
    });
    const Nf4Scales ns = nf4_double_quantize(std::vector<float>(pg, pg + G));
    fill(sd, name + "._scale", ns.scalers);
    fill(sd, name + "._scale_factor", ns.factors);
    fill(sd, name + "._scale_mean", Tensor::full({1}, static_cast<double>(ns.mean), DType::kF32));
  }
  fill(sd, name, Tensor::from_storage(cl.storage(), codes.dtype(), cl.shape(), cl.strides()));
  return sd;
}

DTensor dequantize_from_checkpoint(const nn::StateDict& sd, const std::string& name, const DTensor& like, DType out) {
  const DTensorSpec& x = like.spec();
  const auto it = sd.values.find(name + "._quant");
  const std::string* text = it == sd.values.end() ? nullptr : std::get_if<std::string>(&it->second);
  const std::string kind = text ? *text : "";
  QuantConfig q;
  bool known = false;
  for (QuantKind k : {QuantKind::kFp8Tensor, QuantKind::kFp8Rowwise, QuantKind::kInt8Block, QuantKind::kNf4})
    if (kind == checkpoint_kind_name(k)) {
      q.kind = k;
      known = true;
    }
  if (!known)
    throw InvalidArgument(fmt::format(
        "low-precision checkpoint: '{}._quant' is '{}'; expected fp8-e4m3, fp8-e4m3-rowwise, int8 or nf4", name, kind));
  if (q.kind == QuantKind::kInt8Block) {
    const auto b = sd.values.find(name + "._block");
    const int64_t* block = b == sd.values.end() ? nullptr : std::get_if<int64_t>(&b->second);
    if (!block || *block < 1)
      throw InvalidArgument(fmt::format("low-precision checkpoint: '{}._block' is {}; expected the int8 block size >= 1",
                                        name, block ? std::to_string(*block) : std::string("missing or not an integer")));
    q.block = *block;
  }
  const DTensorSpec cs = codes_spec(x, q.kind);
  const DTensor& codes = entry(sd, name, cs.shape, cs.dtype);
  if (!(codes.placements() == x.placements))
    throw InvalidArgument(fmt::format("low-precision checkpoint: '{}' is {}; expected {} (the target's placements)",
                                      name, dtensor::to_string(codes.placements()), dtensor::to_string(x.placements)));
  std::optional<dtensor::ShardLayout> keep_x;
  const dtensor::ShardLayout& lx = layout_of(x, like, keep_x);
  const Tensor cl = codes.to_local().device().is_cpu() ? codes.to_local().contiguous()
                                                         : codes.to_local().to(kernels::Device{});
  const uint8_t* pc = static_cast<const uint8_t*>(cl.data_ptr());
  const Dims& box = lx.local_shape;
  std::vector<std::vector<int64_t>> A, Gt;
  tables(box, Dims::filled(box.size(), 0), Tensor::contiguous_strides(box), lx, Tensor::contiguous_strides(x.shape), A,
         Gt);
  Tensor y = Tensor::empty(box, DType::kF32);
  float* py = y.data<float>();
  if (q.kind != QuantKind::kNf4) {
    const Tensor sc =
        host_f32(entry(sd, name + "._scale", scale_shape(q, x.shape), DType::kF32).to_local()).contiguous();
    const float* ps = sc.data<float>();
    const int64_t last = x.shape[x.tensor_ndim() - 1];
    walk(box, A, Gt, [&](int64_t a, int64_t f) { py[a] = dequantize_value(q.kind, pc[a], ps[quant_group(q, f, last)]); });
  } else {
    const int64_t nb = quant_groups(q, x.shape);
    const Tensor scalers = entry(sd, name + "._scale", Dims{nb}, DType::kU8).to_local().to(kernels::Device{}).contiguous();
    const Tensor factors = host_f32(
        entry(sd, name + "._scale_factor", Dims{kernels::checked_ceil_div(nb, kNf4ScalerBlock, "nf4 scaler blocks")},
              DType::kF32)
            .to_local());
    const float mean = host_f32(entry(sd, name + "._scale_mean", Dims{1}, DType::kF32).to_local()).data<float>()[0];
    const uint8_t* ps = scalers.data<uint8_t>();
    const float* pf = factors.data<float>();
    const int64_t L = box[box.size() - 1], Lp = (L + 1) / 2;
    walk(box, A, Gt, [&](int64_t a, int64_t f) {
      const int64_t b = f / kNf4Block;
      const uint8_t byte = pc[(a / L) * Lp + (a % L) / 2];
      const uint8_t c = (a % L) % 2 == 0 ? byte >> 4 : byte & 0x0F;
      py[a] = kNf4Levels[c] * nf4_block_scale(ps[b], pf[b / kNf4ScalerBlock], mean);
    });
  }
  dtensor::DTensorSpec os = x;
  os.dtype = out;
  Tensor o = Tensor::empty(box, out, like.to_local().device());
  o.copy_(y);
  return DTensor(like.comms(), os, o);
}

}  // namespace fsdp
