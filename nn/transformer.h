// A small GPT: token (+ learned position) embedding, pre-norm Transformer blocks (causal
// self-attention and a GELU MLP, each with a residual), a final norm and the LM head.
//
//   GPTConfig cfg{.vocab = 64, .dim = 32, .heads = 4, .layers = 2, .max_seq = 16};
//   GPT model(ModuleOptions{comms}, cfg);
//   materialize(model, /*seed=*/0);
//   Ctx ctx;
//   DTensor logits = model.forward(ctx, ids);      // ids [B, T] i64 -> logits [B, T, vocab]
//   model.backward(ctx, dlogits);
//
// Parameter names (PyTorch-style FQNs): tok_emb.weight, pos_emb.weight,
// blocks.<i>.ln1.{weight,bias}, blocks.<i>.attn.{wq,wk,wv,wo}.{weight,bias},
// blocks.<i>.ln2.*, blocks.<i>.mlp.{fc1,fc2}.{weight,bias} (MoE blocks: blocks.<i>.moe.{router.weight,
// experts.w1,experts.w2} and blocks.<i>.moe.shared.{fc1,fc2}.weight), ln_f.*, lm_head.weight.
// bench/torch_train_compare.py builds the same model in PyTorch from these names.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "nn/layers.h"
#include "nn/moe_config.h"

namespace nn {

enum class NormKind { kLayerNorm, kRMSNorm };

struct GPTConfig {
  int64_t vocab = 64;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t max_seq = 32;    // rows of the position table
  int64_t mlp_hidden = 0;  // 0: 4 * dim
  NormKind norm = NormKind::kLayerNorm;
  double norm_eps = 1e-5;
  bool bias = false;            // Linear biases (LayerNorm keeps its own bias)
  bool pos_embedding = true;    // learned absolute positions
  bool tie_embeddings = false;  // lm_head.weight is tok_emb.weight
  kernels::GeluApproximation gelu = kernels::GeluApproximation::kTanh;
  bool checkpoint_blocks = false;  // activation checkpointing around every block
  double init_std = 0.02;
  // Mixture of experts (nn/moe.h) in place of the MLP of blocks i with (i + 1) % moe_every == 0
  // when moe.experts > 0 (moe_every 1: every block; 2: blocks 1, 3, ...).
  MoEConfig moe;
  int64_t moe_every = 1;
};

// x -> fc2(gelu(fc1(x))).
class MLP : public Module {
 public:
  MLP(const ModuleOptions& options, int64_t dim, int64_t hidden, bool bias, kernels::GeluApproximation gelu,
      double init_std = 0.02);
  Linear& fc1() const { return *fc1_; }
  Linear& fc2() const { return *fc2_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  std::shared_ptr<Linear> fc1_, fc2_;
  kernels::GeluApproximation gelu_;
};

// Causal multi-head self-attention over x [B, T, D] with separate q, k, v projections (so each
// can be column-sharded over tp: every rank then holds whole heads) and an output projection.
class CausalSelfAttention : public Module {
 public:
  // REQUIRES: heads divides dim (InvalidArgument naming both otherwise).
  CausalSelfAttention(const ModuleOptions& options, int64_t dim, int64_t heads, bool bias,
                      double init_std = 0.02);
  int64_t heads() const { return heads_; }
  int64_t dim() const { return dim_; }
  Linear& wq() const { return *wq_; }
  Linear& wk() const { return *wk_; }
  Linear& wv() const { return *wv_; }
  Linear& wo() const { return *wo_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  int64_t dim_, heads_;
  std::shared_ptr<Linear> wq_, wk_, wv_, wo_;
};

// Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.)).
class TransformerBlock : public Module {
 public:
  // moe: the feed-forward part is an nn::MoE ("moe") instead of the MLP ("mlp").
  TransformerBlock(const ModuleOptions& options, const GPTConfig& config, bool moe = false);
  Module& feed_forward() const { return *mlp_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  std::shared_ptr<Module> ln1_, ln2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<Module> mlp_;
  const char* ff_name_ = "mlp";
};

// The MoEConfig of a GPT's MoE blocks (dim, hidden, gelu and init_std from the GPT's config).
MoEConfig gpt_moe_config(const GPTConfig& config);
// Whether block i of a GPT is an MoE block.
bool gpt_block_is_moe(const GPTConfig& config, int64_t i);

std::shared_ptr<Module> make_norm(const ModuleOptions& options, const GPTConfig& config);

class GPT : public Module {
 public:
  GPT(const ModuleOptions& options, const GPTConfig& config);
  const GPTConfig& config() const { return config_; }
  Embedding& tok_emb() const { return *tok_emb_; }
  Sequential& blocks() const { return *blocks_; }
  Linear& lm_head() const { return *lm_head_; }

 protected:
  // ids [B, T] (i64) -> logits [B, T, vocab].
  DTensor do_forward(Ctx& ctx, const DTensor& ids) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;
  std::optional<DTensor> do_backward_owned(Ctx& ctx, DTensor grad_output) override;

 private:
  GPTConfig config_;
  std::shared_ptr<Embedding> tok_emb_, pos_emb_;
  std::shared_ptr<Sequential> blocks_;
  std::shared_ptr<Module> ln_f_;
  std::shared_ptr<Linear> lm_head_;
};

// QLoRA / LoRA fine-tuning: enables LoRA (Linear::enable_lora) on every attention projection
// (wq, wk, wv, wo) and MLP projection (fc1, fc2) of every block and freezes every other
// parameter (requires_grad = false: no gradient, no optimizer state). Returns how many layers
// got adapters (6 per block). REQUIRES: the model still meta (before sharding / materialising).
//   nn::GPT model(mo, cfg);
//   nn::add_lora(model, /*rank=*/8, /*alpha=*/16);   // blocks.0.attn.wq.lora_A, ..., lora_B
int add_lora(GPT& model, int64_t rank, double alpha);
// True for a LoRA adapter's parameter name (ends in ".lora_A" or ".lora_B").
bool is_lora_parameter(const std::string& name);

// Activation checkpointing: runs the wrapped module's forward without keeping anything but the
// input, and re-runs that forward (ctx.recomputing() is true for its hooks) right before its
// backward. Transparent in names: parameters keep the wrapped module's FQNs.
class Checkpoint : public Module {
 public:
  explicit Checkpoint(std::shared_ptr<Module> inner);
  Module& inner() const { return *inner_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  std::shared_ptr<Module> inner_;
};

// Mean cross-entropy of logits [..., V] against targets [...] (loss parallel on vocab-sharded
// logits, see dtensor::ops::cross_entropy). Not a Module: two inputs, no parameters.
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(int64_t ignore_index = -100) : ignore_index_(ignore_index) {}
  // A 0-d DTensor (Replicate, or Partial(sum) over mesh dims that split the rows).
  DTensor forward(Ctx& ctx, const DTensor& logits, const DTensor& targets) const;
  // The logits' gradient for an upstream gradient of 1 (or `dloss`). Releases ctx.
  DTensor backward(Ctx& ctx, const std::optional<DTensor>& dloss = std::nullopt) const;

 private:
  int64_t ignore_index_;
};

}  // namespace nn
