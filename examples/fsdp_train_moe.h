// fsdp-train's mixture of experts: --moe-experts E --moe-top-k K [--moe-every N] [--moe-shared]
// put nn::MoE blocks in the GPT (blocks i with (i + 1) % N == 0), and --ep R shards the experts
// over an "ep" mesh dim of R ranks that also splits the batch (tokens reach their experts by
// all-to-all-v; nn/moe.h). With --dp-shard / --dp-replicate the mesh is (dp..., ep): the dense
// parameters get FSDP over dp (Replicate over ep), the experts stay outside FSDP.
// --ep-from-dp carves the ep ranks out of --dp-shard instead (no extra ranks): the mesh stays
// (dp_replicate, dp_shard), the experts live on its unflattening (dp_replicate, dp_mod_ep =
// dp_shard / ep, ep), S(0) over ep, and FSDP shards them over dp_mod_ep (replicated over
// dp_replicate) beside the dense parameters over dp_shard: one group per block, one flat buffer
// per mesh (fsdp/fully_shard.h, per-parameter meshes).
//   fsdp-train --dp-replicate 2 --dp-shard 2 --ep 2 --ep-from-dp --moe-experts 4 --check-parity
// The progress line gains the aux loss (summed over MoE blocks,
// averaged over microbatches) and the token imbalance (max tokens per expert rank over the mean;
// without EP, per expert), worst over blocks and microbatches.
//
//   fsdp-train --moe-experts 8 --moe-top-k 2 --ep 4 --check-parity
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "nn/moe.h"
#include "nn/transformer.h"

namespace fsdp_train {

struct MoEArgs {
  int64_t experts = 0;  // 0: dense MLPs
  int64_t top_k = 2;
  int64_t every = 1;
  bool shared = false;
  int ep = 1;
  bool ep_from_dp = false;  // ep carved out of --dp-shard
};

// The ranks --ep adds to the mesh (none when carved from --dp-shard).
inline int ep_mesh_ranks(const MoEArgs& m) { return m.ep_from_dp ? 1 : m.ep; }

inline void add_moe_options(CLI::App& app, MoEArgs& m) {
  app.add_option("--moe-experts", m.experts, "mixture of experts: experts per MoE block (0: dense MLPs)");
  app.add_option("--moe-top-k", m.top_k, "experts per token (default 2)");
  app.add_option("--moe-every", m.every, "every N-th block is an MoE block (default 1: all)");
  app.add_flag("--moe-shared", m.shared, "a shared expert every token goes through");
  app.add_option("--ep", m.ep, "expert-parallel ranks (experts S(0) over an ep mesh dim that splits the batch)");
  app.add_flag("--ep-from-dp", m.ep_from_dp,
               "carve the --ep ranks out of --dp-shard (experts FSDP over dp_shard / ep, no extra ranks)");
}

// InvalidArgument (exit 2) naming the flag; combinations not built yet are named as such.
inline void validate_moe(const MoEArgs& m, int tp, int64_t batch, int grad_accum, bool estimated, bool fsdp,
                         int dp_shard) {
  auto bad = [](const std::string& what) { throw kernels::InvalidArgument(what); };
  if (m.ep_from_dp && (!fsdp || m.ep < 2 || dp_shard % m.ep != 0))
    bad(fmt::format("--ep-from-dp with --ep {} and --dp-shard {}: expected --ep >= 2 dividing --dp-shard (FSDP)",
                    m.ep, dp_shard));
  if (m.experts < 0) bad(fmt::format("--moe-experts {}: expected >= 0 (0: dense MLPs)", m.experts));
  if (m.ep < 1) bad(fmt::format("--ep {}: expected >= 1", m.ep));
  if (m.experts == 0) {
    if (m.ep > 1 || m.shared) bad("--ep and --moe-shared need --moe-experts");
    return;
  }
  if (estimated)
    bad("--estimate / --memory-limit with --moe-experts: the memory estimate does not model MoE blocks yet");
  if (m.top_k < 1 || m.top_k > m.experts)
    bad(fmt::format("--moe-top-k {}: expected 1..--moe-experts ({})", m.top_k, m.experts));
  if (m.every < 1) bad(fmt::format("--moe-every {}: expected >= 1", m.every));
  if (m.experts % m.ep != 0)
    bad(fmt::format("--ep {} does not divide --moe-experts {} (each EP rank holds the same number of experts)",
                    m.ep, m.experts));
  if (tp > 1) bad(fmt::format("--moe-experts with --tp {}: MoE blocks under tensor parallelism are not supported", tp));
  if ((batch / grad_accum) % m.ep != 0)
    bad(fmt::format("--ep {} does not divide the microbatch (--batch {} / --grad-accum {}): the ep ranks split "
                    "the sequences",
                    m.ep, batch, grad_accum));
}

inline void apply_moe(nn::GPTConfig& c, const MoEArgs& m) {
  c.moe.experts = m.experts;
  c.moe.top_k = m.top_k;
  c.moe.shared_expert = m.shared;
  c.moe_every = m.every;
}

// The expert weights under `module` (FSDP leaves them out under EP beside dp: they stay S(0)
// over ep and Replicate over dp, their gradients reduced over dp by nn::reduce_gradients; with
// --ep-from-dp FSDP shards them on their own mesh instead: set_carved_expert_parallel).
inline std::vector<std::shared_ptr<nn::Parameter>> expert_parameters(nn::Module& module) {
  std::vector<std::shared_ptr<nn::Parameter>> out;
  for (auto& [name, p] : module.named_parameters())
    if (name.find("experts.") != std::string::npos) out.push_back(p);
  return out;
}

// Shards every MoE block's experts over mesh dim `ep_dim`; returns how many blocks.
inline int set_expert_parallel(nn::Module& model, int ep_dim) {
  int n = 0;
  for (auto& [name, mod] : model.named_modules())
    if (auto* moe = dynamic_cast<nn::MoE*>(mod)) {
      moe->set_expert_parallel(ep_dim);
      ++n;
    }
  return n;
}

// --ep-from-dp: every MoE block's experts onto `ep_comms` (the model's mesh with dp_shard
// unflattened into (dp_mod_ep, ep)), S(0) over its dim ep_dim; returns how many blocks.
inline int set_carved_expert_parallel(nn::Module& model, const std::shared_ptr<const dtensor::MeshComms>& ep_comms,
                                      int ep_dim) {
  int n = 0;
  for (auto& [name, mod] : model.named_modules())
    if (auto* moe = dynamic_cast<nn::MoE*>(mod)) {
      moe->set_expert_parallel(ep_comms, ep_dim);
      ++n;
    }
  return n;
}

// --dump-init's "moe" entry: what a PyTorch rebuild of the MoE blocks needs (nn/moe.h's maths).
inline nlohmann::json moe_metadata(const nn::GPTConfig& c) {
  return {{"experts", c.moe.experts},
          {"top_k", c.moe.top_k},
          {"every", c.moe_every},
          {"shared_expert", c.moe.shared_expert},
          {"score", c.moe.score == nn::RouterScore::kSoftmax ? "softmax" : "sigmoid"},
          {"renormalize", c.moe.renormalize},
          {"capacity_factor", c.moe.capacity_factor},
          {"aux_loss_coef", c.moe.aux_loss_coef}};
}

// The step's MoE figures for the progress line.
struct MoEStep {
  double aux = 0, imbalance = 0;
  void add(const nn::Ctx& ctx, int microbatches) {
    aux += nn::moe_aux_loss(ctx) / microbatches;
    imbalance = std::max(imbalance, nn::moe_max_imbalance(ctx));
  }
  std::string text() const { return fmt::format(" aux_loss {:.9g} imbalance {:.4f}", aux, imbalance); }
};

}  // namespace fsdp_train
