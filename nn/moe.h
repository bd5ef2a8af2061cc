// Mixture of experts: a router picks top_k of E experts per token, each expert is a GELU MLP
// (dim -> hidden -> dim), and the token's output is the routed experts' outputs weighted by the
// (renormalised) router scores, plus an optional shared expert that every token goes through.
//
//   MoEConfig cfg{.dim = 32, .hidden = 64, .experts = 8, .top_k = 2};
//   MoE moe(ModuleOptions{comms}, cfg);     // router.weight [8, 32], experts.w1 [8, 32, 64],
//   materialize(moe, 1);                    // experts.w2 [8, 64, 32] (one batched weight each)
//   Ctx ctx;
//   DTensor y = moe.forward(ctx, x);         // x [..., 32] -> y [..., 32]
//   moe_aux_loss(ctx)                        // coef * E * sum_e f_e * P_e of this call
//   moe.backward(ctx, dy);                   // d(loss + aux)/d everything
//
// Routing, per token t with router logits l = x_t Wr^T:
//   s = softmax(l) or sigmoid(l); S = the top_k experts by s (ties: the lower index);
//   g_e = s_e / sum_{S} s (renormalise) or s_e;  y_t = sum_{e in S} g_e * expert_e(x_t).
// Dropless by default: every routed token reaches its expert (tokens per expert vary). A
// capacity factor c > 0 keeps at most ceil(c * N * top_k / E) assignments per expert (N: the
// tokens this rank holds), in token order; a dropped assignment contributes nothing.
// Load-balancing loss (Switch Transformer / GShard): aux = coef * E * sum_e f_e * P_e, f_e the
// fraction of routed assignments (before any drop) that chose e and P_e the mean score of e,
// both over all tokens of the global batch (reduced over the mesh dims that split the tokens,
// through a DTensor redistribute), so it is the same on every rank and equals one rank's. Its
// gradient (d aux / d s_te = coef * E * f_e / N_global) is added in backward, times
// set_aux_grad_scale's factor (default 1): backward returns d(outer loss + scale * aux). A
// trainer whose loss gradient starts from a seed (1 / microbatches, times a loss scale) sets the
// same seed here, so the gradient is that of seed * (loss + aux), as PyTorch's
// ((loss + aux) / microbatches).backward().
//
// Expert parallelism: set_expert_parallel(mesh_dim) shards experts.w1/w2 S(0) over that mesh dim
// (E divisible by its size); the input's tokens must be split over it (x Shard on a token dim).
// Each assignment's row goes to the rank holding its expert and the result comes back by
// all-to-all-v over that dim (dtensor/row_exchange.h, counts known: the routing statistics are an
// all-gather of every token-splitting rank's per-expert counts, from which each rank reads what
// its EP peers send it); backward sends the output gradients the same way and the input
// gradients back. Collectives per forward: that all-gather and two all-to-all-v. Routing is per
// token, so EP gives one rank's routing, outputs and gradients (up to summation order).
//
// Tensor parallelism (torchtitan's layout for grouped experts): set_tensor_parallel(mesh_dim)
// shards each expert's hidden dim over that mesh dim: experts.w1 [E, D, H] S(2) (column-wise),
// experts.w2 [E, H, D] S(1) (row-wise); the router stays Replicate. The input must be Replicate
// on the tp dim (nn::MoETensorParallel's hook all-gathers a sequence-parallel input), so every
// tp rank routes the same tokens, dispatches them over the EP dim among the ranks of its own tp
// coordinate, and computes its slice of the hidden dim: the output is Partial(sum) on the tp
// dim (the hook reduce-scatters it back to sequence shards, or all-reduces it). In backward the
// router's gradients come from those partial outputs (the routing backward is linear in them),
// so the input and router gradients are Partial on the tp dim too; the aux-loss gradient is
// added on tp coordinate 0 only. A shared expert is split the same way (fc1 column-wise, fc2
// row-wise with a Partial output).
//
// The computation runs on local CPU tensors: routing in f64; the experts grouped by expert, one
// GEMM per expert and projection (kernels::matmul), in f64 for f64 parameters and f32 otherwise
// (parameters and activations of any floating dtype are converted). REQUIRES: x [..., dim] placed R or Shard(d < last) on every mesh
// dim (not Partial, not sharded over dim); the expert and router weights Replicate except
// experts.* S(0) on the EP dim.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "nn/moe_config.h"
#include "nn/transformer.h"

namespace nn {

// What one forward routed (every rank sees the same numbers).
struct MoEStats {
  double aux_loss = 0;                  // coef * E * sum f_e P_e
  std::vector<int64_t> tokens_per_expert;  // routed assignments over the global batch
  int64_t dropped = 0;                  // assignments over capacity on this rank
  // max over EP ranks of the assignments its experts got, over the mean (1 without EP: then
  // per expert instead).
  double imbalance = 1.0;
};

class MoE : public Module {
 public:
  // REQUIRES: dim, experts > 0 and 1 <= top_k <= experts (InvalidArgument naming them).
  MoE(const ModuleOptions& options, const MoEConfig& config);
  const MoEConfig& config() const { return config_; }
  Parameter& router() const { return *router_; }
  Parameter& w1() const { return *w1_; }
  Parameter& w2() const { return *w2_; }
  // Experts S(0) over mesh dim `mesh_dim` (call on a meta module, before materialize).
  // REQUIRES: the dim's size divides experts.
  void set_expert_parallel(int mesh_dim);
  // EP carved from a token-splitting (data-parallel) dim: experts.w1/w2 move to `comms`, the
  // module's mesh with dim mesh_dim - 1 unflattened into (mesh_dim - 1, mesh_dim) = (dp_mod_ep,
  // ep) (MeshComms::unflatten), S(0) over mesh_dim. The input stays on the module's mesh with
  // its tokens split over the carved dim; dispatch and combine run over `comms`' ep dim and the
  // expert gradients are Partial over its other token-splitting dims (FSDP's per-parameter
  // meshes shard them over dp_mod_ep: fsdp/fully_shard.h).
  //   auto ep = comms->unflatten(0, {2, 2}, {"dp_mod_ep", "ep"});   // comms: (dp_shard=4)
  //   moe.set_expert_parallel(ep, 1);
  // REQUIRES: a meta module; comms' mesh equal to that unflattening (InvalidArgument naming both
  // meshes otherwise); its ep size divides experts.
  void set_expert_parallel(std::shared_ptr<const MeshComms> comms, int mesh_dim);
  std::optional<int> expert_parallel_dim() const { return ep_dim_; }
  // Experts' hidden dim over mesh dim `mesh_dim` (w1 S(2), w2 S(1); call on a meta module, before
  // materialize; nn::MoETensorParallel calls it). REQUIRES: the dim's size divides the hidden
  // size (InvalidArgument naming both).
  void set_tensor_parallel(int mesh_dim);
  std::optional<int> tensor_parallel_dim() const { return tp_dim_; }
  // The factor on the aux loss's gradient in backward (see above). REQUIRES: finite, >= 0.
  void set_aux_grad_scale(double scale);
  double aux_grad_scale() const { return aux_grad_scale_; }
  MLP* shared_expert() const { return shared_.get(); }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  dtensor::DTensorSpec partial_on_tp(const DTensor& x) const;
  MoEConfig config_;
  std::shared_ptr<Parameter> router_, w1_, w2_;
  std::shared_ptr<MLP> shared_;
  std::optional<int> ep_dim_, tp_dim_;  // ep_dim_: on the experts' mesh
  std::optional<int> ep_source_dim_;     // carved EP: the module's mesh dim split into (dp_mod_ep, ep)
  double aux_grad_scale_ = 1.0;
  // The module-mesh dim an experts'-mesh dim comes from.
  int source_dim(int expert_mesh_dim) const;
};

// The stats of the MoE forward recorded in ctx (nullopt when ctx holds none).
std::optional<MoEStats> moe_stats(const Ctx& ctx);
// Sum of the aux losses of every MoE call recorded in ctx and below (0 when none), and the
// largest imbalance among them.
double moe_aux_loss(const Ctx& ctx);
double moe_max_imbalance(const Ctx& ctx);

}  // namespace nn
