#include "nn/transformer.h"

#include <fmt/format.h>

#include "kernels/error.h"
#include "kernels/format.h"
#include "nn/moe.h"

namespace nn {

namespace ops = dtensor::ops;
using kernels::InvalidArgument;

namespace {

// A gradient that flows into one tensor from two uses (a residual, q/k/v sharing an input).
DTensor sum_grads(const DTensor& a, const DTensor& b, const ops::OpOptions& o) {
  return ops::add(a, b, 1.0, o);
}

}  // namespace

// ---- MLP ----

MLP::MLP(const ModuleOptions& options, int64_t dim, int64_t hidden, bool bias,
         kernels::GeluApproximation gelu, double init_std)
    : Module("MLP"), gelu_(gelu) {
  fc1_ = add_module("fc1", std::make_shared<Linear>(options, dim, hidden, bias, Init::normal(0, init_std)));
  fc2_ = add_module("fc2", std::make_shared<Linear>(options, hidden, dim, bias, Init::normal(0, init_std)));
}

DTensor MLP::do_forward(Ctx& ctx, const DTensor& x) {
  DTensor h = fc1_->forward(ctx.child("fc1"), x);
  h = ops::gelu(h, gelu_, ctx.ops(), &ctx.op(0));
  return fc2_->forward(ctx.child("fc2"), h);
}

std::optional<DTensor> MLP::do_backward(Ctx& ctx, const DTensor& dy) {
  DTensor dh = *fc2_->backward(ctx.child("fc2"), dy);
  dh = ops::unary_backward(ctx.op(0), dh, ctx.ops());
  ctx.op(0) = ops::Saved{};  // the activation's input (fc1's output): not needed by fc1's backward
  return fc1_->backward(ctx.child("fc1"), dh);
}

// ---- attention ----

CausalSelfAttention::CausalSelfAttention(const ModuleOptions& options, int64_t dim, int64_t heads, bool bias,
                                         double init_std)
    : Module("CausalSelfAttention"), dim_(dim), heads_(heads) {
  if (heads <= 0 || dim % heads != 0)
    throw InvalidArgument(
        fmt::format("CausalSelfAttention: {} heads do not divide the model dim {}", heads, dim));
  const Init init = Init::normal(0, init_std);
  wq_ = add_module("wq", std::make_shared<Linear>(options, dim, dim, bias, init));
  wk_ = add_module("wk", std::make_shared<Linear>(options, dim, dim, bias, init));
  wv_ = add_module("wv", std::make_shared<Linear>(options, dim, dim, bias, init));
  wo_ = add_module("wo", std::make_shared<Linear>(options, dim, dim, bias, init));
}

DTensor CausalSelfAttention::do_forward(Ctx& ctx, const DTensor& x) {
  if (x.spec().tensor_ndim() != 3 || x.shape()[2] != dim_)
    throw InvalidArgument(
        fmt::format("CausalSelfAttention: input of shape {}, expected [B, T, {}]", x.shape(), dim_));
  const int64_t B = x.shape()[0], T = x.shape()[1], E = dim_ / heads_;
  const ops::OpOptions& o = ctx.ops();
  auto split_heads = [&](Linear& proj, const char* name) {
    DTensor y = proj.forward(ctx.child(name), x);                        // [B, T, D]
    return ops::transpose(ops::view(y, {B, T, heads_, E}, o), 1, 2, o);  // [B, H, T, E]
  };
  DTensor q = split_heads(*wq_, "wq"), k = split_heads(*wk_, "wk"), v = split_heads(*wv_, "wv");
  DTensor a = ops::attention(q, k, v, o, &ctx.op(0));
  DTensor merged = ops::view(ops::transpose(a, 1, 2, o), {B, T, dim_}, o);
  return wo_->forward(ctx.child("wo"), merged);
}

std::optional<DTensor> CausalSelfAttention::do_backward(Ctx& ctx, const DTensor& dy) {
  const int64_t B = dy.shape()[0], T = dy.shape()[1], E = dim_ / heads_;
  const ops::OpOptions& o = ctx.ops();
  // Every tensor dies once the last step that reads it ran (as autograd frees them): wo's input
  // gradient after the attention's backward, q, k, v, its output and statistics then too, each
  // head gradient after its projection's backward.
  ops::Grads g = [&] {
    DTensor dm = *wo_->backward(ctx.child("wo"), dy);
    DTensor da = ops::transpose(ops::view(dm, {B, T, heads_, E}, o), 1, 2, o);
    const ops::GradSink sinks[3] = {};
    return ops::attention_backward(ctx.op(0), da, sinks, o);
  }();
  ctx.op(0) = ops::Saved{};
  auto merge_heads = [&](const DTensor& t) { return ops::view(ops::transpose(t, 1, 2, o), {B, T, dim_}, o); };
  DTensor dx = *wq_->backward(ctx.child("wq"), merge_heads(*g[0]));
  g[0].reset();
  dx = sum_grads(dx, *wk_->backward(ctx.child("wk"), merge_heads(*g[1])), o);
  g[1].reset();
  dx = sum_grads(dx, *wv_->backward(ctx.child("wv"), merge_heads(*g[2])), o);
  return dx;
}

// ---- block ----

std::shared_ptr<Module> make_norm(const ModuleOptions& options, const GPTConfig& config) {
  if (config.norm == NormKind::kRMSNorm)
    return std::make_shared<RMSNorm>(options, config.dim, config.norm_eps);
  return std::make_shared<LayerNorm>(options, config.dim, config.norm_eps);
}

MoEConfig gpt_moe_config(const GPTConfig& config) {
  MoEConfig m = config.moe;
  m.dim = config.dim;
  m.hidden = config.mlp_hidden > 0 ? config.mlp_hidden : 4 * config.dim;
  m.gelu = config.gelu;
  m.init_std = config.init_std;
  return m;
}

bool gpt_block_is_moe(const GPTConfig& config, int64_t i) {
  return config.moe.experts > 0 && config.moe_every >= 1 && (i + 1) % config.moe_every == 0;
}

TransformerBlock::TransformerBlock(const ModuleOptions& options, const GPTConfig& config, bool moe)
    : Module("TransformerBlock") {
  const int64_t hidden = config.mlp_hidden > 0 ? config.mlp_hidden : 4 * config.dim;
  ln1_ = add_module("ln1", make_norm(options, config));
  attn_ = add_module("attn", std::make_shared<CausalSelfAttention>(options, config.dim, config.heads,
                                                                   config.bias, config.init_std));
  ln2_ = add_module("ln2", make_norm(options, config));
  if (moe) {
    ff_name_ = "moe";
    mlp_ = add_module("moe", std::make_shared<MoE>(options, gpt_moe_config(config)));
  } else {
    mlp_ = add_module(
        "mlp", std::make_shared<MLP>(options, config.dim, hidden, config.bias, config.gelu, config.init_std));
  }
}

DTensor TransformerBlock::do_forward(Ctx& ctx, const DTensor& x) {
  const ops::OpOptions& o = ctx.ops();
  DTensor a = attn_->forward(ctx.child("attn"), ln1_->forward(ctx.child("ln1"), x));
  DTensor h = ops::add(x, a, 1.0, o, &ctx.op(0));
  DTensor m = mlp_->forward(ctx.child(ff_name_), ln2_->forward(ctx.child("ln2"), h));
  return ops::add(h, m, 1.0, o, &ctx.op(1));
}

std::optional<DTensor> TransformerBlock::do_backward(Ctx& ctx, const DTensor& dy) {
  const ops::OpOptions& o = ctx.ops();
  const ops::GradSink both[2] = {};
  ops::Grads g1 = ops::add_backward(ctx.op(1), dy, both, o);
  DTensor dh = *ln2_->backward(ctx.child("ln2"), *mlp_->backward(ctx.child(ff_name_), *g1[1]));
  dh = sum_grads(*g1[0], dh, o);
  ops::Grads g0 = ops::add_backward(ctx.op(0), dh, both, o);
  DTensor dx = *ln1_->backward(ctx.child("ln1"), *attn_->backward(ctx.child("attn"), *g0[1]));
  return sum_grads(*g0[0], dx, o);
}

// ---- GPT ----

GPT::GPT(const ModuleOptions& options, const GPTConfig& config) : Module("GPT"), config_(config) {
  if (config.vocab <= 0 || config.dim <= 0 || config.layers < 0 || config.max_seq <= 0)
    throw InvalidArgument(fmt::format("GPT: vocab {}, dim {}, layers {} and max_seq {} must be positive",
                                      config.vocab, config.dim, config.layers, config.max_seq));
  if (config.moe.experts > 0 && config.moe_every < 1)
    throw InvalidArgument(fmt::format("GPT: moe_every {} must be >= 1", config.moe_every));
  const Init init = Init::normal(0, config.init_std);
  tok_emb_ = add_module("tok_emb", std::make_shared<Embedding>(options, config.vocab, config.dim, init));
  if (config.pos_embedding)
    pos_emb_ = add_module("pos_emb", std::make_shared<Embedding>(options, config.max_seq, config.dim, init));
  blocks_ = add_module("blocks", std::make_shared<Sequential>());
  for (int64_t i = 0; i < config.layers; ++i) {
    std::shared_ptr<Module> block = std::make_shared<TransformerBlock>(options, config, gpt_block_is_moe(config, i));
    if (config.checkpoint_blocks) block = std::make_shared<Checkpoint>(block);
    blocks_->append(block);
  }
  ln_f_ = add_module("ln_f", make_norm(options, config));
  lm_head_ = add_module("lm_head", std::make_shared<Linear>(options, config.dim, config.vocab, false, init));
  if (config.tie_embeddings) lm_head_->tie_weight(tok_emb_->weight_ptr());
}

DTensor GPT::do_forward(Ctx& ctx, const DTensor& ids) {
  if (ids.spec().tensor_ndim() != 2)
    throw InvalidArgument(fmt::format("GPT: ids of shape {}, expected [batch, seq]", ids.shape()));
  const int64_t T = ids.shape()[1];
  if (T > config_.max_seq)
    throw InvalidArgument(fmt::format("GPT: sequence length {} exceeds max_seq {}", T, config_.max_seq));
  const ops::OpOptions& o = ctx.ops();
  DTensor h = tok_emb_->forward(ctx.child("tok_emb"), ids);
  if (pos_emb_) {
    // Positions [T], sharded like h's sequence dim (sequence parallel) so the add needs no
    // communication and the table's gradient is a Partial sum, not a gathered one.
    Placements pl(h.placements().size(), dtensor::Replicate{});
    for (size_t m = 0; m < pl.size(); ++m)
      if (h.placements()[m] == dtensor::Placement{dtensor::Shard{1}}) pl[m] = dtensor::Shard{0};
    Tensor positions = Tensor::arange({T}, DType::kI64).to(ids.to_local().device());
    DTensor pos = dtensor::distribute_tensor(positions, h.comms(), pl, std::nullopt);
    DTensor p = pos_emb_->forward(ctx.child("pos_emb"), pos);
    h = ops::add(h, p, 1.0, o, &ctx.op(0));
  }
  h = blocks_->forward(ctx.child("blocks"), h);
  h = ln_f_->forward(ctx.child("ln_f"), h);
  return lm_head_->forward(ctx.child("lm_head"), h);
}

std::optional<DTensor> GPT::do_backward(Ctx& ctx, const DTensor& dy) { return do_backward_owned(ctx, dy); }

// The logits' gradient dies in lm_head's backward, ln_f's in the last block's (as in autograd).
std::optional<DTensor> GPT::do_backward_owned(Ctx& ctx, DTensor dy) {
  const ops::OpOptions& o = ctx.ops();
  DTensor dh = *lm_head_->backward(ctx.child("lm_head"), std::move(dy));
  dh = *ln_f_->backward(ctx.child("ln_f"), std::move(dh));
  dh = *blocks_->backward(ctx.child("blocks"), std::move(dh));
  if (pos_emb_) {
    const ops::GradSink both[2] = {};
    ops::Grads g = ops::add_backward(ctx.op(0), dh, both, o);
    pos_emb_->backward(ctx.child("pos_emb"), *g[1]);
    dh = *g[0];
  }
  tok_emb_->backward(ctx.child("tok_emb"), dh);
  return std::nullopt;
}

// ---- Checkpoint ----

Checkpoint::Checkpoint(std::shared_ptr<Module> inner) : Module("Checkpoint"), inner_(inner) {
  if (!inner_) throw InvalidArgument("Checkpoint: the wrapped module is null");
  add_child("", inner_);  // transparent: no path component in names
}

DTensor Checkpoint::do_forward(Ctx& ctx, const DTensor& x) {
  ctx.tensors = {x};
  Ctx scratch(&ctx.ops());
  scratch.set_recomputing(ctx.recomputing());
  return inner_->forward(scratch, x);  // scratch (every activation) is released here
}

std::optional<DTensor> Checkpoint::do_backward(Ctx& ctx, const DTensor& dy) {
  if (ctx.tensors.empty()) throw InvalidArgument("Checkpoint: backward without a forward on this context");
  Ctx& c = ctx.child("inner");
  c.set_recomputing(true);
  inner_->forward(c, ctx.tensors[0]);
  c.set_recomputing(false);
  return inner_->backward(c, dy);
}

// ---- loss ----

DTensor CrossEntropyLoss::forward(Ctx& ctx, const DTensor& logits, const DTensor& targets) const {
  return ops::cross_entropy(logits, targets, kernels::LossReduction::kMean, ignore_index_, ctx.ops(),
                            &ctx.op(0));
}

DTensor CrossEntropyLoss::backward(Ctx& ctx, const std::optional<DTensor>& dloss) const {
  const ops::Saved& saved = ctx.op(0);
  if (saved.extras.empty())
    throw InvalidArgument("CrossEntropyLoss: backward without a forward on this context");
  DTensor out = [&] {
    if (dloss) return ops::cross_entropy_backward(saved, *dloss, ctx.ops());
    const DTensor& like = saved.extras[0];
    dtensor::DTensorSpec spec = dtensor::make_spec(
        like.spec().mesh, Placements(like.placements().size(), dtensor::Replicate{}), {}, DType::kF64);
    const bool in = like.comms()->in_mesh();
    DTensor one(like.comms(), spec,
                in ? Tensor::full({}, 1.0, DType::kF64) : Tensor::empty({0}, DType::kF64));
    return ops::cross_entropy_backward(saved, one, ctx.ops());
  }();
  ctx.clear();
  return out;
}

int add_lora(GPT& model, int64_t rank, double alpha) {
  for (auto& [name, p] : model.named_parameters()) p->requires_grad = false;
  int n = 0;
  for (auto& [name, m] : model.named_modules()) {
    auto* lin = dynamic_cast<Linear*>(m);
    if (!lin || name.rfind("blocks.", 0) != 0) continue;
    if (name.find(".attn.") == std::string::npos && name.find(".mlp.") == std::string::npos) continue;
    lin->enable_lora(rank, alpha);
    ++n;
  }
  return n;
}

bool is_lora_parameter(const std::string& name) {
  auto ends_with = [&](const char* s) {
    const std::string t(s);
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  return ends_with(".lora_A") || ends_with(".lora_B");
}

}  // namespace nn
