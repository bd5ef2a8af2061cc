// fsdp-train's flags checked, its mesh, data and model (examples/fsdp_train.cpp documents them).
#include "examples/fsdp_train_args.h"

#include "kernels/hash.h"

namespace fsdp_train {

MeshPlan mesh_plan(const Args& a, bool parallel) {
  MeshPlan m;
  std::vector<int64_t> sizes;
  auto add = [&](int64_t size, const char* name) {
    sizes.push_back(size);
    m.names.push_back(name);
    return static_cast<int>(sizes.size()) - 1;
  };
  if (parallel && a.fsdp && a.dp_replicate > 1) m.rep_dim = add(a.dp_replicate, "dp_replicate");
  if (parallel && a.fsdp) m.shard_dim = add(a.dp_shard, "dp_shard");
  if (parallel && a.moe.ep > 1 && !a.moe.ep_from_dp) m.ep_dim = add(a.moe.ep, "ep");
  if (!parallel || !a.fsdp || a.tp > 1) m.tp_dim = add(parallel ? a.tp : 1, "tp");
  m.shape = Dims::filled(static_cast<int>(sizes.size()), 1);
  for (size_t i = 0; i < sizes.size(); ++i) m.shape[static_cast<int>(i)] = sizes[i];
  return m;
}

// Inputs and targets [rows, seq] of samples first_sample .. first_sample + rows - 1.
std::pair<Tensor, Tensor> make_batch(const Args& a, int step, int64_t first_sample, int64_t rows) {
  Tensor ids = Tensor::empty({rows, a.seq}, DType::kI64), targets = Tensor::empty({rows, a.seq}, DType::kI64);
  int64_t* pi = ids.data<int64_t>();
  int64_t* pt = targets.data<int64_t>();
  const uint64_t V = static_cast<uint64_t>(a.vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t g = static_cast<uint64_t>(first_sample + r);
    uint64_t t =
        kernels::mix64(a.seed * 0x100000001B3ull + static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull + g) % V;
    for (int64_t i = 0; i < a.seq; ++i) {
      pi[r * a.seq + i] = static_cast<int64_t>(t);
      t = (5 * t + 3) % V;
      pt[r * a.seq + i] = static_cast<int64_t>(t);
    }
  }
  return {ids, targets};
}

nn::GPTConfig model_config(const Args& a) {
  nn::GPTConfig c;
  c.vocab = a.vocab;
  c.dim = a.dim;
  c.heads = a.heads;
  c.layers = a.layers;
  c.max_seq = a.seq;
  c.norm = nn::NormKind::kLayerNorm;
  c.bias = false;
  c.pos_embedding = true;
  c.gelu = kernels::GeluApproximation::kTanh;
  c.checkpoint_blocks = a.activation_checkpointing;
  fsdp_train::apply_moe(c, a.moe);
  return c;
}

// --reduce-wire: MixedPrecisionPolicy::reduce_wire (validate() checked the text).
std::optional<DType> reduce_wire(const Args& a) {
  if (a.reduce_wire.empty()) return std::nullopt;
  return a.reduce_wire == "bf16" ? DType::kBF16 : DType::kF8E5M2;
}

// Checked before any rank starts: the flags (exit 2 naming the value), the mesh's rank count
// against the documented limits, and the model's parameters against the machine's memory.
void validate(const Args& a) {
  auto bad = [](const std::string& what) { throw kernels::InvalidArgument(what); };
  if (a.backend != "local" && a.backend != "mpi" && a.backend != "nccl")
    bad(fmt::format("--backend {}: expected local, mpi or nccl", a.backend));
  if (a.dp_replicate < 1) bad(fmt::format("--dp-replicate {}: expected >= 1", a.dp_replicate));
  if (a.dp_shard < 1) bad(fmt::format("--dp-shard {}: expected >= 1", a.dp_shard));
  if (a.tp < 1) bad(fmt::format("--tp {}: expected >= 1", a.tp));
  if (a.world < 0) bad(fmt::format("--world {}: expected >= 1 (or 0: the mesh's ranks)", a.world));
  // The rank count in checked arithmetic (65536 x 65536 must not wrap to 0), then the limits.
  const int64_t ranks = kernels::checked_mul(
      kernels::checked_mul(
          kernels::checked_mul(a.dp_replicate, a.dp_shard, "mesh ranks (--dp-replicate x --dp-shard)"), a.tp,
          "mesh ranks (--dp-replicate x --dp-shard x --tp)"),
      fsdp_train::ep_mesh_ranks(a.moe), "mesh ranks (x --ep)");
  const std::string mesh_text =
      fmt::format("--dp-replicate {} x --dp-shard {} x --tp {} = {} ranks", a.dp_replicate, a.dp_shard, a.tp, ranks);
  if (ranks > dtensor::kMaxMeshRanks)
    bad(fmt::format("{}: a mesh holds at most {} ranks (2^20)", mesh_text, dtensor::kMaxMeshRanks));
  if (a.backend != "mpi" && std::max<int64_t>(ranks, a.world) > collectives::kMaxLocalRanks)
    bad(fmt::format("{}: --backend {} runs one thread per rank, at most {}",
                    ranks > collectives::kMaxLocalRanks ? mesh_text : fmt::format("--world {}", a.world), a.backend,
                    collectives::kMaxLocalRanks));
  if (a.prefetch < 0 || a.prefetch > 2) bad(fmt::format("--prefetch {}: expected 0, 1 or 2", a.prefetch));
  const std::string& r = a.reshard_after_forward;
  if (r != "auto" && r != "true" && r != "false") {
    int k = 0;
    try {
      size_t used = 0;
      k = std::stoi(r, &used);
      if (used != r.size()) k = 0;
    } catch (const std::exception&) {
      k = 0;
    }
    if (k < 1 || a.dp_shard % k != 0)
      bad(fmt::format("--reshard-after-forward {}: expected true, false or a divisor K of --dp-shard {}", r,
                      a.dp_shard));
  }
  if (a.fsdp_layout != "padded" && a.fsdp_layout != "contiguous")
    bad(fmt::format("--fsdp-layout {}: expected padded or contiguous", kernels::clip(a.fsdp_layout, 40)));
  if (a.fsdp_layout == "contiguous") {
    if (!a.fsdp) bad("--fsdp-layout contiguous needs FSDP (--dp-shard)");
    // What fsdp::Layout::kContiguous does not support yet (fully_shard refuses it too).
    const char* with = a.tp > 1             ? "--tp (FSDP x TP)"
                       : a.offload            ? "--offload"
                       : !a.all_gather.empty() ? "--all-gather"
                       : a.qlora > 0          ? "--qlora"
                       : a.moe.ep > 1         ? "--ep"
                       : a.estimate || a.memory_limit > 0 ? "--estimate / --memory-limit (the estimate models the padded layout)"
                           : nullptr;
    if (with) bad(fmt::format("--fsdp-layout contiguous does not support {} yet; use --fsdp-layout padded", with));
  }
  if (a.no_pin_memory && !a.offload) bad("--no-pin-memory needs --offload");
  if ((a.offload || a.no_sync || r != "auto") && !a.fsdp)
    bad("--offload, --no-sync and --reshard-after-forward need FSDP (--dp-shard / --dp-replicate)");
  for (auto [v, n] : {std::pair{a.layers, "--layers"},
                      {a.dim, "--dim"},
                      {a.heads, "--heads"},
                      {a.vocab, "--vocab"},
                      {a.seq, "--seq"},
                      {a.batch, "--batch"}})
    if (v < 1 && !(v == 0 && std::string(n) == "--layers")) bad(fmt::format("{} {}: expected >= 1", n, v));
  if (a.steps < 1) bad(fmt::format("--steps {}: expected >= 1", a.steps));
  if (a.dim % a.heads != 0) bad(fmt::format("--heads {} does not divide --dim {}", a.heads, a.dim));
  if (a.grad_accum < 1 || a.batch % a.grad_accum != 0)
    bad(fmt::format("--grad-accum {} must divide --batch {} (microbatches of equal size)", a.grad_accum,
                    a.batch));
  fsdp_train::validate_moe(a.moe, a.tp, a.dim, a.batch, a.grad_accum, a.estimate || a.memory_limit > 0, a.fsdp,
                           a.dp_shard);
  // Sample and token indices of the data (step * batch + g, batch * seq tokens per step).
  kernels::checked_mul(a.steps, a.batch, "samples (--steps x --batch)");
  kernels::checked_mul(a.batch, a.seq, "tokens per step (--batch x --seq)");
  if (a.mp != "fp32" && a.mp != "bf16" && a.mp != "fp16")
    bad(fmt::format("--mp {}: expected fp32, bf16 or fp16", kernels::clip(a.mp, 40)));
  if (a.inject_overflow != 0 && (a.mp != "fp16" || a.inject_overflow < 1 || a.inject_overflow > a.steps))
    bad(fmt::format("--inject-overflow {}: expected a step 1..--steps ({}) with --mp fp16 (the loss scaler skips "
                    "it)",
                    a.inject_overflow, a.steps));
  if (!a.reduce_wire.empty()) {
    if (a.reduce_wire != "bf16" && a.reduce_wire != "e5m2")
      bad(fmt::format("--reduce-wire {}: expected bf16 or e5m2", kernels::clip(a.reduce_wire, 40)));
    // FSDP reduces gradients in f32 under --mp fp32 and bf16 alike; without FSDP nothing is reduced.
    if (!a.fsdp)
      bad(fmt::format("--reduce-wire {}: needs FSDP's gradient reductions (--dp-shard or --dp-replicate), whose "
                      "reduce dtype (f32) it must be narrower than",
                      a.reduce_wire));
  }
  if (!a.all_gather.empty()) {
    fsdp_train::parse_all_gather(a.all_gather);  // InvalidArgument naming the value
    if (a.mp != "bf16")
      bad(fmt::format("--all-gather {} needs --mp bf16 (the weights are dequantised to bf16 for compute); got --mp {}",
                      a.all_gather, a.mp));
    if (!a.fsdp) bad(fmt::format("--all-gather {} needs FSDP (--dp-shard / --dp-replicate)", a.all_gather));
    if (r != "auto" && r != "true" && r != "false" && r != "1" && r != std::to_string(a.dp_shard))
      bad(fmt::format("--all-gather {} with --reshard-after-forward {}: expected true or false (the K buffer "
                      "would hold bf16 weights, not the codes)",
                      a.all_gather, r));
  }
  if (const auto why = fsdp_train::qlora_refusal({a.qlora, a.lora_alpha, a.mp, a.all_gather, a.tp, a.dim, r, a.dp_shard}))
    bad(*why);
  if (a.log_every < 1) bad(fmt::format("--log-every {}: expected >= 1", a.log_every));
  if (a.optimizer != "adamw" && a.optimizer != "sgd")
    bad(fmt::format("--optimizer {}: expected adamw or sgd", a.optimizer));
  if (!(a.lr > 0) || !std::isfinite(a.lr)) bad(fmt::format("--lr {}: expected a finite value > 0", a.lr));
  if (!(a.weight_decay >= 0) || !std::isfinite(a.weight_decay))
    bad(fmt::format("--weight-decay {}: expected a finite value >= 0", a.weight_decay));
  if (!(a.clip >= 0) || !std::isfinite(a.clip))
    bad(fmt::format("--clip {}: expected a finite value >= 0 (0: no clipping)", a.clip));
  if (a.threads < 0 || a.threads > kMaxThreads)
    bad(fmt::format("--threads {}: expected 0..{} (0: cores / ranks)", a.threads, kMaxThreads));
  if (a.memory_limit < 0) bad(fmt::format("--memory-limit {}: expected bytes >= 1", a.memory_limit));
  if (a.init_before_shard && !a.fsdp)
    bad("--init-before-shard needs FSDP (--dp-shard / --dp-replicate): without it there is nothing to shard first");
  if (!a.init_from.empty() && !a.resume_from.empty())
    bad("--init-from and --resume-from exclude each other (a resumed run takes its weights from the checkpoint)");
  if (a.save_every < 0) bad(fmt::format("--save-every {}: expected >= 0", a.save_every));
  if ((a.save_every > 0 || a.async_save) && a.save_dir.empty())
    bad("--save-every / --async-save need --save-dir");
}

}  // namespace fsdp_train
