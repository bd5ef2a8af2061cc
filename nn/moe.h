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
// gradient (d aux / d s_te = coef * E * f_e / N_global) is added in backward: backward returns
// d(outer loss + aux), the usual "loss + coef * aux".
//
// Expert parallelism: set_expert_parallel(mesh_dim) shards experts.w1/w2 S(0) over that mesh dim
// (E divisible by its size); the input's tokens must be split over it (x Shard on a token dim).
// Each assignment's row goes to the rank holding its expert and the result comes back by
// all-to-all-v over that dim (dtensor/row_exchange.h: counts, then rows); backward sends the
// output gradients the same way and the input gradients back. Routing is per token, so EP gives
// one rank's routing, outputs and gradients (up to summation order).
//
// The expert computation runs on local CPU tensors in f64 (parameters and activations of any
// floating dtype are converted). REQUIRES: x [..., dim] placed R or Shard(d < last) on every mesh
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

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;

 private:
  MoEConfig config_;
  std::shared_ptr<Parameter> router_, w1_, w2_;
  std::shared_ptr<MLP> shared_;
  std::optional<int> ep_dim_;         // on the experts' mesh
  std::optional<int> ep_source_dim_;  // carved EP: the module's mesh dim split into (dp_mod_ep, ep)
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
