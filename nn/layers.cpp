#include "nn/layers.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/error.h"
#include "kernels/format.h"

namespace nn {

namespace ops = dtensor::ops;
using kernels::InvalidArgument;

namespace {

void check_options(const ModuleOptions& o, const char* what) {
  if (!o.comms) throw InvalidArgument(fmt::format("{}: ModuleOptions::comms is null", what));
}

// "abz,yz->aby" for an input of ndim n: batch labels, then z (in) and y (out).
std::string linear_equation(int ndim) {
  static constexpr char kBatch[] = "abcdefgh";
  const std::string batch(kBatch, kBatch + (ndim - 1));
  return batch + "z,yz->" + batch + "y";
}

}  // namespace

// ---- Linear ----

Linear::Linear(const ModuleOptions& options, int64_t in_features, int64_t out_features, bool bias,
               Init weight_init)
    : Module("Linear"), in_(in_features), out_(out_features) {
  check_options(options, "Linear");
  if (in_features < 0 || out_features < 0)
    throw InvalidArgument(fmt::format("Linear: features ({}, {}) must be >= 0", in_features, out_features));
  weight_ = add_parameter(
      "weight", std::make_shared<Parameter>(options.comms, Dims{out_features, in_features}, options.dtype,
                                            weight_init, std::nullopt, options.device));
  if (bias)
    bias_ =
        add_parameter("bias", std::make_shared<Parameter>(options.comms, Dims{out_features}, options.dtype,
                                                          Init::zeros(), std::nullopt, options.device));
}

void Linear::tie_weight(std::shared_ptr<Parameter> weight) {
  if (!weight || !(weight->shape() == weight_->shape()))
    throw InvalidArgument(fmt::format("Linear::tie_weight: a parameter of shape {} for a weight of shape {}",
                                      weight ? weight->shape() : Dims{}, weight_->shape()));
  replace_parameter("weight", weight);
  weight_ = std::move(weight);
}

void Linear::set_output_reduction(int mesh_dim, dtensor::Placement placement) {
  if (dtensor::is_partial(placement))
    throw InvalidArgument("Linear::set_output_reduction: the target must be Replicate or Shard, not Partial");
  reduce_ = std::make_pair(mesh_dim, placement);
}

void Linear::enable_lora(int64_t rank, double alpha) {
  if (rank < 1 || !(alpha > 0) || !std::isfinite(alpha))
    throw InvalidArgument(fmt::format("Linear::enable_lora: rank {}, alpha {}; expected rank >= 1 and alpha > 0", rank,
                                      alpha));
  if (lora_a_) throw InvalidArgument("Linear::enable_lora: LoRA is already enabled on this layer");
  if (!weight_->is_meta())
    throw InvalidArgument("Linear::enable_lora: the layer is materialised; enable LoRA on the meta model first");
  const double bound = in_ > 0 ? 1.0 / std::sqrt(static_cast<double>(in_)) : 0.0;
  lora_a_ = add_parameter("lora_A", std::make_shared<Parameter>(weight_->comms(), Dims{rank, in_}, weight_->dtype(),
                                                                Init::uniform(-bound, bound), std::nullopt,
                                                                weight_->device()));
  lora_b_ = add_parameter("lora_B", std::make_shared<Parameter>(weight_->comms(), Dims{out_, rank}, weight_->dtype(),
                                                                Init::zeros(), std::nullopt, weight_->device()));
  lora_scale_ = alpha / static_cast<double>(rank);
}

DTensor Linear::do_forward(Ctx& ctx, const DTensor& x) {
  const int nd = x.spec().tensor_ndim();
  if (nd < 1 || x.shape()[nd - 1] != in_)
    throw InvalidArgument(
        fmt::format("Linear({}, {}): input of shape {} (expected [..., {}])", in_, out_, x.shape(), in_));
  DTensor y = ops::einsum(linear_equation(nd), x, weight_->data(), ctx.ops(), &ctx.op(0));
  if (reduce_ && dtensor::is_partial(y.placements()[reduce_->first])) {
    Placements to = y.placements();
    to[reduce_->first] = reduce_->second;
    ctx.values["reduced_from"] = y.placements();
    y = y.redistribute(to, {ctx.ops().choose.planner});
  }
  if (bias_) y = ops::add(y, bias_->data(), 1.0, ctx.ops(), &ctx.op(1));
  if (lora_a_) {
    if (reduce_)
      throw kernels::Unsupported("Linear: LoRA on a RowwiseParallel layer (an output reduction) is not supported");
    const std::string eq = linear_equation(nd);
    const DTensor h = ops::einsum(eq, x, lora_a_->data(), ctx.ops(), &ctx.op(2));  // [..., rank]
    const DTensor l = ops::einsum(eq, h, lora_b_->data(), ctx.ops(), &ctx.op(3));  // [..., out]
    y = ops::add(y, l, lora_scale_, ctx.ops(), &ctx.op(4));
  }
  return y;
}

std::optional<DTensor> Linear::do_backward(Ctx& ctx, const DTensor& dy_in) {
  DTensor dy = dy_in;
  std::optional<DTensor> dx_lora;
  if (lora_a_) {
    // y = base + s * l: dl = s * dy; l = h B^T; h = x A^T.
    const ops::GradSink add_sinks[] = {ops::GradSink{}, ops::GradSink{}};
    ops::Grads g = ops::add_backward(ctx.op(4), dy, add_sinks, ctx.ops());
    dy = *g[0];
    const ops::GradSink b_sinks[] = {ops::GradSink{}, lora_b_->grad_sink()};
    const DTensor dh = *ops::einsum_backward(ctx.op(3), *g[1], b_sinks, ctx.ops())[0];
    const ops::GradSink a_sinks[] = {ops::GradSink{}, lora_a_->grad_sink()};
    dx_lora = ops::einsum_backward(ctx.op(2), dh, a_sinks, ctx.ops())[0];
  }
  if (bias_) {
    const ops::GradSink sinks[] = {ops::GradSink{}, bias_->grad_sink()};
    dy = *ops::add_backward(ctx.op(1), dy, sinks, ctx.ops())[0];
  }
  if (ctx.values.count("reduced_from")) {
    // The transpose of the forward's reduction (P -> R: nothing; P -> S(d): all-gather): part
    // of the RowwiseParallel style, not an implicit redistribute.
    Placements to = dy.placements();
    to[reduce_->first] = dtensor::Replicate{};
    if (!(to == dy.placements())) dy = dy.redistribute(to, {ctx.ops().choose.planner});
  }
  const ops::GradSink sinks[] = {ops::GradSink{}, weight_->grad_sink()};
  std::optional<DTensor> dx = ops::einsum_backward(ctx.op(0), dy, sinks, ctx.ops())[0];
  if (dx_lora) dx = ops::add(*dx, *dx_lora, 1.0, ctx.ops());
  return dx;
}

// ---- Embedding ----

Embedding::Embedding(const ModuleOptions& options, int64_t num_embeddings, int64_t dim, Init init)
    : Module("Embedding"), num_(num_embeddings), dim_(dim) {
  check_options(options, "Embedding");
  weight_ =
      add_parameter("weight", std::make_shared<Parameter>(options.comms, Dims{num_embeddings, dim},
                                                          options.dtype, init, std::nullopt, options.device));
}

DTensor Embedding::do_forward(Ctx& ctx, const DTensor& ids) {
  return ops::embedding(weight_->data(), ids, ctx.ops(), &ctx.op(0));
}

std::optional<DTensor> Embedding::do_backward(Ctx& ctx, const DTensor& dy) {
  const ops::GradSink sinks[] = {weight_->grad_sink()};
  ops::embedding_backward(ctx.op(0), dy, sinks, ctx.ops());
  return std::nullopt;
}

// ---- norms ----

RMSNorm::RMSNorm(const ModuleOptions& options, int64_t dim, double eps, bool elementwise_affine)
    : Module("RMSNorm"), eps_(eps) {
  check_options(options, "RMSNorm");
  if (elementwise_affine)
    weight_ =
        add_parameter("weight", std::make_shared<Parameter>(options.comms, Dims{dim}, options.dtype,
                                                            Init::ones(), std::nullopt, options.device));
}

DTensor RMSNorm::do_forward(Ctx& ctx, const DTensor& x) {
  return ops::rms_norm(x, weight_ ? &weight_->data() : nullptr, eps_, ctx.ops(), &ctx.op(0));
}

std::optional<DTensor> RMSNorm::do_backward(Ctx& ctx, const DTensor& dy) {
  std::vector<ops::GradSink> sinks{ops::GradSink{}};
  if (weight_) sinks.push_back(weight_->grad_sink());
  return ops::norm_backward(ctx.op(0), dy, sinks, ctx.ops())[0];
}

LayerNorm::LayerNorm(const ModuleOptions& options, int64_t dim, double eps, bool elementwise_affine,
                     bool bias)
    : Module("LayerNorm"), eps_(eps) {
  check_options(options, "LayerNorm");
  if (elementwise_affine) {
    weight_ =
        add_parameter("weight", std::make_shared<Parameter>(options.comms, Dims{dim}, options.dtype,
                                                            Init::ones(), std::nullopt, options.device));
    if (bias)
      bias_ = add_parameter("bias", std::make_shared<Parameter>(options.comms, Dims{dim}, options.dtype,
                                                                Init::zeros(), std::nullopt, options.device));
  }
}

DTensor LayerNorm::do_forward(Ctx& ctx, const DTensor& x) {
  return ops::layer_norm(x, weight_ ? &weight_->data() : nullptr, bias_ ? &bias_->data() : nullptr, eps_,
                         ctx.ops(), &ctx.op(0));
}

std::optional<DTensor> LayerNorm::do_backward(Ctx& ctx, const DTensor& dy) {
  std::vector<ops::GradSink> sinks{ops::GradSink{}};
  if (weight_) sinks.push_back(weight_->grad_sink());
  if (bias_) sinks.push_back(bias_->grad_sink());
  return ops::norm_backward(ctx.op(0), dy, sinks, ctx.ops())[0];
}

}  // namespace nn
