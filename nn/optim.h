// Optimizers over DTensor parameters, gradient reduction and clipping.
//
//   auto params = model.named_parameters();
//   AdamW opt(params, {.lr = 1e-3, .weight_decay = 0.1});
//   model.backward(ctx, dlogits);
//   reduce_gradients(params);                      // Partial gradients -> the parameters' placements
//   double norm = clip_grad_norm_(params, 1.0);    // the true global norm, on every rank
//   opt.step();                                    // each rank steps its own shard (fused kernel)
//   opt.zero_grad();
//
// Each optimizer keeps its state as DTensors of the parameter's placements (created on the
// first step), so a sharded parameter has sharded state and a step needs no communication. A
// gradient must have the parameter's placements by then (reduce_gradients, or FSDP's
// reduce-scatter); otherwise step() throws InvalidArgument naming the parameter.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops/optim.h"
#include "nn/module.h"

namespace nn {

using NamedParameters = std::vector<std::pair<std::string, std::shared_ptr<Parameter>>>;

class Optimizer {
 public:
  explicit Optimizer(NamedParameters params);
  virtual ~Optimizer() = default;
  // Steps every parameter that has a gradient and requires_grad (a frozen parameter, e.g. an NF4
  // base weight under QLoRA, gets no state, here or in init_state()).
  virtual void step() = 0;
  void zero_grad(bool set_to_none = true);
  const NamedParameters& parameters() const { return params_; }
  // A state tensor of parameter `name` ("exp_avg", "exp_avg_sq", "momentum_buffer"); throws
  // InvalidArgument when absent.
  const DTensor& state(std::string_view name, std::string_view key) const;
  // The step count of parameter `name` (0 before its first step).
  int64_t step_count(std::string_view name) const;

  // ---- state dict (PyTorch's flattened optimizer state dict, keyed by parameter name) ----
  // "state.<fqn>.<key>" -> the state DTensor (the parameter's placements; shares storage), and
  // values["state.<fqn>.step"] = the step, for every parameter that has state. No communication.
  StateDict state_dict() const;
  // Restores the state of every parameter: a parameter with "state.<fqn>.step" in sd gets that
  // step and each of its state tensors (state_keys(), all required); one without has no state.
  // The step may also come as a one-element tensor "state.<fqn>.step" (PyTorch saves it so).
  // Everything is checked first: a missing tensor, an unexpected key (strict) or a shape
  // mismatch throws InvalidArgument naming the key and changes nothing.
  void load_state_dict(const StateDict& sd, bool strict = true);
  // Creates every state tensor (zeros) a step would, with step 0, so that state_dict() lists the
  // full structure (a load target before the first step; PyTorch's _init_optim_state).
  void init_state();
  // The state tensors one parameter has once stepped ("exp_avg", "exp_avg_sq", ...).
  virtual std::vector<std::string> state_keys() const = 0;

 protected:
  struct State {
    std::vector<std::pair<std::string, DTensor>> tensors;
    int64_t step = 0;
  };
  // The gradient of params_[i], checked against the parameter (placements, shape, mesh).
  const DTensor* checked_grad(size_t i) const;
  DTensor& state_tensor(size_t i, const std::string& key);  // zeros like the parameter on first use
  NamedParameters params_;
  std::vector<State> state_;
};

class SGD : public Optimizer {
 public:
  SGD(NamedParameters params, kernels::SgdOptions options);
  void step() override;
  std::vector<std::string> state_keys() const override;
  kernels::SgdOptions options;
};

class AdamW : public Optimizer {
 public:
  AdamW(NamedParameters params, kernels::AdamWOptions options);
  void step() override;
  std::vector<std::string> state_keys() const override;
  kernels::AdamWOptions options;
};

// Frozen parameters (requires_grad false) are skipped here and by clip_grad_norm_.
// Redistributes every gradient whose placements differ from its parameter's (Partial sums over
// the batch-splitting or sequence-parallel mesh dims) to the parameter's placements; gradients
// moving alike are batched into one collective per step. Collective over the mesh.
void reduce_gradients(const NamedParameters& params);

// Scales the gradients so their global norm is at most max_norm (PyTorch's clip_grad_norm_:
// coefficient max_norm / (norm + 1e-6), clamped to 1) and returns the global norm before
// clipping, identical on every rank. The norm covers every element of every gradient once:
// each rank sums the squares of its shards (a replicated gradient counts on one rank per
// replica group) and ONE reduction over the mesh dims that shard a gradient makes the total.
// norm_type: 2 or infinity. max_norm <= 0 only measures. Throws InvalidArgument for a gradient
// still Partial (reduce it first). A NaN or infinite norm is returned (and, as in PyTorch, an
// infinite one scales the gradients by 0); with error_if_nonfinite it throws
// kernels::NonFiniteError instead, before any gradient is scaled (on every rank: the norm is the
// same everywhere; programs exit 1), the check for a diverged training:
//   try { clip_grad_norm_(params, 1.0, 2.0, /*error_if_nonfinite=*/true); }
//   catch (const kernels::NonFiniteError& e) { /* stop: "... the total norm of order 2 ... is nan" */ }
// Collective.
double clip_grad_norm_(const NamedParameters& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace nn
