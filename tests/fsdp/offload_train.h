// Shared by offload_test.cpp (CPU, fake copy engines) and gpu_offload_test.cpp ([gpu]): FSDP
// training of a small GPT on the local backend, one model per rank, with the losses of every
// step and the final parameters gathered on rank 0.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "kernels/device.h"
#include "nn/memory.h"
#include "nn/moe.h"
#include "nn/optim.h"
#include "nn/transformer.h"

namespace offload_test {

using dtensor::DTensor;
using dtensor::MeshComms;
using kernels::DType;
using kernels::Tensor;

inline nn::GPTConfig tiny() {
  nn::GPTConfig c;
  c.vocab = 16;
  c.dim = 16;
  c.heads = 2;
  c.layers = 3;
  c.max_seq = 8;
  return c;
}

struct Run {
  int ranks = 2;
  int steps = 3;
  int64_t batch = 8;
  int accum = 1;  // microbatches per step, no gradient sync before the last
  // The blocks' LayerNorms in groups of their own (small groups: with the contiguous layout some
  // ranks' ranges are empty).
  bool norm_groups = false;
  int prefetch_depth = 1;
  kernels::Device device;  // where the model computes
  // > 1 (cfg with MoE blocks): the experts on the dp mesh carved into (dp_mod_ep, ep), sharded
  // over dp_mod_ep by follower groups (per-parameter meshes, FullyShardOptions::mesh_fn).
  int64_t ep = 1;
  // > 1: HSDP, the mesh (dp_replicate = replicate, dp_shard = ranks / replicate).
  int64_t replicate = 1;
  nn::GPTConfig cfg = tiny();
  fsdp::FullyShardOptions options;
  // Per rank, before fully_shard: adjusts that rank's options (e.g. its own copy engine).
  std::function<void(int rank, fsdp::FullyShardOptions&)> per_rank;
  // Per rank, after fully_shard (e.g. hooks of its own).
  std::function<void(int rank, nn::GPT&)> after_shard;
  // Per rank, after each step's last backward, before the optimizer step.
  std::function<void(int rank, nn::GPT&)> after_backward;
};

struct Result {
  std::vector<double> losses;
  std::map<std::string, Tensor> params;  // full, on the CPU
  std::string note;
  int64_t copy_bytes = 0;  // rank 0: every group's GroupStats::copy_bytes over the run
};

// Token ids of sample g: a function of (step, g) only.
inline Tensor ids(int step, int64_t first, int64_t rows, int64_t seq, int64_t vocab, int shift) {
  Tensor t = Tensor::empty({rows, seq}, DType::kI64);
  int64_t* p = t.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < seq; ++i) p[r * seq + i] = ((first + r) * 7 + step * 13 + i * (3 + shift)) % vocab;
  return t;
}

inline Result train(const Run& run) {
  const auto mesh = run.replicate > 1 ? dtensor::DeviceMesh::from_shape({run.replicate, run.ranks / run.replicate},
                                                                         {"dp_replicate", "dp_shard"})
                                      : dtensor::DeviceMesh::from_shape({run.ranks}, {"dp_shard"});
  Result result;
  collectives::run_ranks(run.ranks, [&](collectives::Communicator& world) {
    std::vector<dtensor::Unflattening> un;
    if (run.ep > 1) un.push_back({0, dtensor::Dims{run.ranks / run.ep, run.ep}, {"dp_mod_ep", "ep"}});
    const fsdp::ReshardAfterForward& raf = run.options.reshard_after_forward;
    if (raf.kind == fsdp::ReshardAfterForward::Kind::kInt)  // the k ranks' sub-mesh
      un.push_back(fsdp::reshard_unflattening(mesh, mesh.ndim() - 1, raf.k));
    auto comms = MeshComms::create(mesh, world, {}, nullptr, un);
    std::shared_ptr<const MeshComms> ep_comms =
        run.ep > 1 ? comms->unflatten(0, un[0].sizes, un[0].names) : nullptr;
    nn::GPT model(nn::ModuleOptions{comms, DType::kF32, run.device}, run.cfg);
    if (ep_comms)
      for (auto& [name, m] : model.named_modules())
        if (auto* moe = dynamic_cast<nn::MoE*>(m)) moe->set_expert_parallel(ep_comms, 1);
    nn::materialize(model, 11);
    fsdp::FullyShardOptions o = run.options;
    if (run.per_rank) run.per_rank(world.rank(), o);
    fsdp::FullyShardOptions root_o = o;
    if (ep_comms)
      o.mesh_fn = [ep_comms](const std::string&, const nn::Parameter& p) -> std::optional<fsdp::ParamMesh> {
        if (p.comms() != ep_comms) return std::nullopt;
        return fsdp::ParamMesh{ep_comms, fsdp::DataParallelMeshDims{std::nullopt, 0}};
      };
    for (const auto& [name, block] : model.blocks().children()) {
      if (run.norm_groups)
        for (const auto& [cn, child] : block->children())
          if (cn == "ln1" || cn == "ln2") fsdp::fully_shard(*child, comms, o);
      fsdp::fully_shard(*block, comms, o);
    }
    fsdp::FSDPModule& root = fsdp::fully_shard(model, comms, root_o);
    root.set_prefetch_depth(run.prefetch_depth);
    if (run.after_shard) run.after_shard(world.rank(), model);
    kernels::AdamWOptions ao;
    ao.lr = 1e-2;
    nn::AdamW opt(model.named_parameters(), ao);
    const auto nd = static_cast<size_t>(mesh.ndim());
    const dtensor::Placements batch_pl(nd, dtensor::Shard{0});
    nn::CrossEntropyLoss loss_fn;
    auto shared_mesh = std::shared_ptr<const dtensor::DeviceMesh>(comms, &comms->mesh());
    const DTensor dloss(comms, dtensor::make_spec(shared_mesh, dtensor::Placements(nd, dtensor::Replicate{}), {}, DType::kF64),
                        Tensor::full({}, 1.0 / run.accum, DType::kF64, run.device));
    const int64_t micro = run.batch / run.accum;
    for (int step = 0; step < run.steps; ++step) {
      double v = 0;
      for (int m = 0; m < run.accum; ++m) {
        root.set_requires_gradient_sync(m + 1 == run.accum);
        const int64_t first = step * run.batch + m * micro;
        const Tensor x_ids = ids(step, first, micro, run.cfg.max_seq, run.cfg.vocab, 0).to(run.device);
        const Tensor y_ids = ids(step, first, micro, run.cfg.max_seq, run.cfg.vocab, 1).to(run.device);
        const DTensor x = dtensor::distribute_tensor(x_ids, comms, batch_pl, std::nullopt);
        const DTensor y = dtensor::distribute_tensor(y_ids, comms, batch_pl, std::nullopt);
        nn::Ctx ctx, lctx;
        DTensor logits = model.forward(ctx, x);
        DTensor loss = loss_fn.forward(lctx, logits, y);
        v += loss.full_tensor().to(kernels::Device{}).item({}) / run.accum;
        model.backward(ctx, loss_fn.backward(lctx, dloss));
      }
      if (run.after_backward) run.after_backward(world.rank(), model);
      opt.step();
      opt.zero_grad();
      if (world.rank() == 0) result.losses.push_back(v);
    }
    for (const auto& [name, p] : model.named_parameters()) {
      Tensor full = p->data().full_tensor().to(kernels::Device{});
      if (world.rank() == 0) result.params[name] = full.clone();
    }
    if (world.rank() == 0) {
      result.note = root.note();
      for (auto& [name, m] : model.named_modules())
        if (fsdp::FSDPModule* st = fsdp::state(*m)) result.copy_bytes += st->stats().copy_bytes;
    }
  });
  return result;
}

// The largest |a - b| over every parameter element (both runs must name the same parameters).
inline double max_param_diff(const Result& a, const Result& b) {
  double worst = a.params.size() == b.params.size() ? 0.0 : 1e300;
  for (const auto& [name, t] : a.params) {
    auto it = b.params.find(name);
    if (it == b.params.end()) return 1e300;
    const auto x = t.to_vector(), y = it->second.to_vector();
    if (x.size() != y.size()) return 1e300;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
  }
  return worst;
}

}  // namespace offload_test
