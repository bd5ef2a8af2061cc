// Basic layers with explicit backward: Linear, Embedding, RMSNorm, LayerNorm.
//
//   ModuleOptions mo{comms, DType::kF32};
//   Linear fc(mo, /*in=*/64, /*out=*/256);          // weight [256, 64], bias [256], meta
//   materialize(fc, /*seed=*/1);                       // or after parallelize_module: sharded
//   Ctx ctx;
//   DTensor y = fc.forward(ctx, x);                    // x [..., 64] -> y [..., 256]
//   DTensor dx = *fc.backward(ctx, dy);                // fc.weight().grad() now holds dW
//
// Every layer computes through dtensor::ops, so a layer whose parameters are sharded (tensor
// parallelism) runs on local shards with the ops' rules; see nn/tensor_parallel.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "nn/module.h"

namespace nn {

// y = x @ weight^T + bias; weight [out, in] (PyTorch's layout).
class Linear : public Module {
 public:
  Linear(const ModuleOptions& options, int64_t in_features, int64_t out_features, bool bias = true,
         Init weight_init = Init::normal(0.0, 0.02));
  Parameter& weight() const { return *weight_; }
  Parameter* bias() const { return bias_.get(); }
  const std::shared_ptr<Parameter>& weight_ptr() const { return weight_; }
  // Ties the weight to another parameter of the same shape (e.g. an embedding table).
  void tie_weight(std::shared_ptr<Parameter> weight);
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  // RowwiseParallel: a Partial product on `mesh_dim` is reduced to `placement` (R or S(d)) before
  // the bias is added (the backward maps the gradient back).
  void set_output_reduction(int mesh_dim, dtensor::Placement placement);

  // LoRA (Hu et al. 2021; PEFT's defaults): adds parameters lora_A [rank, in] and lora_B
  // [out, rank] (the weight's dtype, comms and device; meta) and computes
  //   y = x W^T + b + (alpha / rank) (x A^T) B^T
  // with A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_(a = sqrt(5))) and B = 0, so the output
  // starts as the base layer's. Example: in 4, out 3, rank 2, alpha 4: scale 2, A [2, 4], B [3, 2].
  // REQUIRES: rank >= 1, alpha > 0, called once, before sharding or materialising (InvalidArgument
  // otherwise); no output reduction (RowwiseParallel): forward refuses it (Unsupported).
  void enable_lora(int64_t rank, double alpha);
  Parameter* lora_A() const { return lora_a_.get(); }
  Parameter* lora_B() const { return lora_b_.get(); }
  double lora_scale() const { return lora_scale_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  int64_t in_, out_;
  std::shared_ptr<Parameter> weight_, bias_, lora_a_, lora_b_;
  double lora_scale_ = 0.0;
  std::optional<std::pair<int, dtensor::Placement>> reduce_;
};

// A lookup table [num_embeddings, dim]: ids (i64/i32) [...] -> [..., dim].
class Embedding : public Module {
 public:
  Embedding(const ModuleOptions& options, int64_t num_embeddings, int64_t dim,
            Init init = Init::normal(0.0, 0.02));
  Parameter& weight() const { return *weight_; }
  const std::shared_ptr<Parameter>& weight_ptr() const { return weight_; }
  int64_t num_embeddings() const { return num_; }
  int64_t dim() const { return dim_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& ids) override;
  // Returns no input gradient (ids have none).
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  int64_t num_, dim_;
  std::shared_ptr<Parameter> weight_;
};

// y = x / sqrt(mean(x^2) + eps) * weight over the last dim (PyTorch's nn.RMSNorm).
class RMSNorm : public Module {
 public:
  RMSNorm(const ModuleOptions& options, int64_t dim, double eps = 1e-6, bool elementwise_affine = true);
  Parameter* weight() const { return weight_.get(); }
  double eps() const { return eps_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  double eps_;
  std::shared_ptr<Parameter> weight_;
};

// y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (PyTorch's nn.LayerNorm).
class LayerNorm : public Module {
 public:
  LayerNorm(const ModuleOptions& options, int64_t dim, double eps = 1e-5, bool elementwise_affine = true,
            bool bias = true);
  Parameter* weight() const { return weight_.get(); }
  Parameter* bias() const { return bias_.get(); }
  double eps() const { return eps_; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  double eps_;
  std::shared_ptr<Parameter> weight_, bias_;
};

}  // namespace nn
