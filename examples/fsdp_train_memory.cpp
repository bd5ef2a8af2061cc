// fsdp-train's memory checks: the machine, the estimate, --memory-limit and --estimate.
#include "examples/fsdp_train_args.h"
#include "examples/fsdp_train_lowp.h"

namespace fsdp_train {

namespace {

// A lower bound of the bytes one process's ranks hold of the model: every f32 parameter once
// (no gradients, optimizer state or activations), split over `ranks_here` of `ranks` ranks. In
// floating point, so a model past int64 is still a figure to report.
long double parameter_bytes_lower_bound(const Args& a, int64_t ranks, int64_t ranks_here) {
  const long double V = a.vocab, D = a.dim, L = a.layers, Q = a.seq, H = 4 * D;
  const long double elements = V * D /* tok_emb */ + Q * D /* pos_emb */ +
                               L * (4 * D * D + 2 * D * H + 4 * D) /* attention, MLP, two LayerNorms */ +
                               2 * D /* final norm */ + D * V /* lm_head */;
  return 4 * elements * static_cast<long double>(ranks_here) / static_cast<long double>(ranks);
}

}  // namespace

// Refuses (ResourceError, exit 3, naming the bytes) a model whose parameters alone exceed the
// memory the machine has available, before anything is allocated.
void check_model_fits(const Args& a, int64_t ranks, int64_t ranks_here) {
  const long double need = parameter_bytes_lower_bound(a, ranks, ranks_here);
  const int64_t available = kernels::machine_available_bytes(kernels::Device{});
  if (available >= 0 && need > static_cast<long double>(available))
    throw kernels::ResourceError(fmt::format(
        "the model (--vocab {} --dim {} --layers {} --seq {}) needs at least {:.0f} bytes ({:.1f} GiB) of f32 "
        "parameters in this process, but the machine has {} bytes ({:.1f} GiB) available",
        a.vocab, a.dim, a.layers, a.seq, need, static_cast<double>(need / (1 << 30)), available,
        static_cast<double>(available) / (1 << 30)));
}

namespace {

// What fsdp::estimate_memory assumes about this run (the parallel one).
fsdp::MemoryConfig memory_config(const Args& a) {
  fsdp::MemoryConfig c;
  c.fsdp = a.fsdp;
  c.dp_replicate = a.fsdp ? a.dp_replicate : 1;
  c.dp_shard = a.fsdp ? a.dp_shard : 1;
  c.tp = a.tp;
  c.sequence_parallel = a.sequence_parallel;
  const std::string& r = a.reshard_after_forward;
  if (r == "true") c.options.reshard_after_forward = fsdp::ReshardAfterForward::yes();
  else if (r == "false") c.options.reshard_after_forward = fsdp::ReshardAfterForward::no();
  else if (r != "auto") c.options.reshard_after_forward = fsdp::ReshardAfterForward::to(std::stoi(r));
  if (a.mp != "fp32" && a.fsdp) {
    c.options.mp_policy.param_dtype = a.mp == "fp16" ? DType::kF16 : DType::kBF16;
    c.options.mp_policy.reduce_dtype = DType::kF32;
  }
  if (a.fsdp) c.options.mp_policy.reduce_wire = reduce_wire(a);
  if (a.fsdp) {
    c.quantized_weights =
        a.qlora > 0 ? std::optional<fsdp::QuantConfig>(fsdp_train::kQloraBase) : fsdp_train::parse_all_gather(a.all_gather);
  }
  c.lora_rank = a.qlora;
  c.options.offload_policy.offload_to_cpu = a.offload;
  c.prefetch = a.prefetch;
  if (a.fsdp_layout == "contiguous") c.options.layout = fsdp::Layout::kContiguous;  // refused: not modelled
  c.no_sync = a.no_sync;
  c.optimizer_states = a.optimizer == "adamw" ? 2 : 1;  // AdamW's two moments; SGD's momentum
  c.device = a.backend == "nccl" ? kernels::Device::cuda(0) : kernels::Device{};
  c.batch = {a.batch, a.seq, a.grad_accum};
  return c;
}

fsdp::MemoryEstimate estimate(const Args& a) { return fsdp::estimate_memory(model_config(a), memory_config(a)); }

}  // namespace

// The estimate of this run, for --estimate / --memory-limit (whose errors are the run's) and for
// the JSON line (where a configuration the estimate does not model is null, and the run goes on
// to report its own error, if any).
std::optional<fsdp::MemoryEstimate> estimate_run(const Args& a) {
  if (a.estimate || a.memory_limit > 0) return estimate(a);
  try {
    return estimate(a);
  } catch (const kernels::InvalidArgument&) {
    return std::nullopt;
  }
}

// --memory-limit: refuses (ResourceError, exit 3) a run whose estimated peak (in the caching
// allocator's block sizes, what the limit counts) exceeds the limit, before anything is
// allocated, naming both and the cheapest knob that would fit: reshard_after_forward, then
// activation checkpointing, then offload (a separate device only), then more dp ranks.
void check_memory_limit(const Args& a, const fsdp::MemoryEstimate& e) {
  if (a.memory_limit <= 0 || e.peak_blocks <= a.memory_limit) return;
  std::vector<std::pair<std::string, Args>> knobs;
  if (a.fsdp && a.reshard_after_forward != "true" && a.dp_shard > 1) {
    Args b = a;
    b.reshard_after_forward = "true";
    knobs.emplace_back("--reshard-after-forward true", b);
  }
  if (!a.activation_checkpointing) {
    Args b = a;
    b.activation_checkpointing = true;
    knobs.emplace_back("--activation-checkpointing", b);
  }
  if (a.fsdp && !a.offload && a.backend == "nccl") {
    Args b = a;
    b.offload = true;
    knobs.emplace_back("--offload", b);
  }
  const int64_t max_ranks =
      a.backend == "mpi" ? int64_t{dtensor::kMaxMeshRanks} : int64_t{collectives::kMaxLocalRanks};
  for (int64_t n = int64_t{a.dp_shard} * 2; n * a.dp_replicate * a.tp <= max_ranks; n *= 2) {
    Args b = a;
    b.fsdp = true;
    b.dp_shard = static_cast<int>(n);
    if (b.reshard_after_forward != "auto" && b.reshard_after_forward != "true" && b.reshard_after_forward != "false")
      b.reshard_after_forward = "auto";
    knobs.emplace_back(fmt::format("more dp ranks: --dp-shard {}", n), b);
  }
  std::string hint = "no single knob fits (tried --reshard-after-forward true, --activation-checkpointing and up to "
                     "the most dp ranks)";
  for (const auto& [what, b] : knobs) {
    const fsdp::MemoryEstimate k = estimate(b);
    if (k.peak_blocks <= a.memory_limit) {
      hint = fmt::format("the cheapest knob that fits: {} (estimate {} bytes)", what, k.peak_blocks);
      break;
    }
  }
  throw kernels::ResourceError(fmt::format(
      "--memory-limit {}: the estimated peak is {} bytes per rank ({} requested; at {}), over the limit; nothing was "
      "allocated; {}",
      a.memory_limit, e.peak_blocks, e.peak, e.peak_at, hint));
}

// --estimate: one JSON line (per rank, the worst rank) and no training.
int print_estimate(const Args& a, const fsdp::MemoryEstimate& e) {
  std::string json = e.to_json();
  if (a.memory_limit > 0) {
    json.pop_back();
    json += fmt::format(",\"memory_limit\":{},\"fits\":{}}}", a.memory_limit,
                        e.peak_blocks <= a.memory_limit ? "true" : "false");
  }
  fmt::print("{}\n", json);
  std::fflush(stdout);
  return program::kOk;
}

}  // namespace fsdp_train
