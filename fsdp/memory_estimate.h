// fsdp::estimate_memory: how many bytes one rank's mesh allocator will hold while training a GPT
// (nn/transformer.h) under FSDP, HSDP, FSDP x TP or HSDP x TP, per kind and at the peak, before
// anything is allocated (the model may be meta, the mesh need not exist).
//
//   fsdp::MemoryConfig c;                 // fsdp-train's grouping: every block, then the root
//   c.dp_shard = 4;
//   c.batch = {.batch = 8, .seq = 32};
//   fsdp::MemoryEstimate e = fsdp::estimate_memory(cfg, c);
//   e.peak;                               // the most bytes alive at once on the worst rank
//   e.to_json();                          // {"sharded_parameters": ..., "peak": ..., ...}
//
// How: a replay of one steady-state training step (the second and later: gradients and optimizer
// state exist) on byte counts instead of tensors. It walks the same forward and backward as
// nn::GPT (every op's outputs and what its backward keeps, tensor parallelism's redistributes
// and their buffers) and FSDP's runtime (unshard, prefetch, reshard, reduce-scatter, at most two
// reductions in flight), allocating and freeing counted buffers in the order the real step does,
// and records the largest sum alive. What it counts is what goes through the mesh's allocator
// (and FSDP's unsharded / buffer allocators): parameters, gradients, optimizer state, op
// outputs, FSDP's buffers and the redistribute buffers; kernel-internal scratch and host copies
// (tensors made by kernels::Tensor::to / contiguous) are outside it, as they are outside a
// trainer's limit. Sizes are per rank; uneven splits count the largest shard (the worst rank).
// Low precision (issue 27) is replayed too: an all-gather extension's packed codes and its
// dequantising copies, LoRA adapters and the frozen parameters they leave (no gradient, no
// reduction, no optimizer state), and a reduce wire's exchange (send, received pieces, sum).
// The replay follows the code paths of this repository's ops and executor: when those change,
// tests/fsdp/estimate_test.cpp (the estimate within 5% of the measured peak for every FSDP test
// configuration) says so.
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/fully_shard.h"
#include "fsdp/lowp.h"
#include "nn/transformer.h"

namespace fsdp {

struct BatchShape {
  int64_t batch = 8;   // global sequences per optimizer step
  int64_t seq = 32;    // tokens per sequence
  int grad_accum = 1;  // microbatches per step (batch / grad_accum sequences each)
};

// The run being estimated.
struct MemoryConfig {
  int64_t dp_replicate = 1, dp_shard = 1, tp = 1;  // mesh sizes
  bool fsdp = true;  // fully_shard on every block, then the root (false: tensor parallelism only)
  bool sequence_parallel = true;  // the tp plan is nn::gpt_tensor_parallel_plan(cfg, sp, true)
  // reshard_after_forward, mp_policy (reduce_wire too), offload_policy are read; allocators,
  // hooks and all_gather_extension_fn are not (quantized_weights says what the extension is).
  FullyShardOptions options;
  // fsdp-train's --all-gather fp8|int8 and --qlora: the blocks' attention and MLP linear weights
  // are all-gathered through fsdp/lowp.h's extension of this kind (the root's parameters as
  // usual): the group's gathered buffer holds their codes, and each unshard dequantises them
  // through one gathered copy per weight. The codes static_scales caches live outside the mesh's
  // allocator (not counted).
  std::optional<QuantConfig> quantized_weights;
  // nn::add_lora's rank (fsdp-train's --qlora; 0: none): adapters lora_A [r, in], lora_B [out, r]
  // on every block's wq, wk, wv, wo, fc1, fc2, and every other parameter frozen: frozen
  // parameters have no gradient (neither unsharded nor sharded, no reduction) and no optimizer
  // state.
  int64_t lora_rank = 0;
  // Prefetch as fsdp-train's --prefetch: 0 none, 1 FSDP2's implicit one group ahead, 2 explicit
  // lists two blocks ahead in forward and backward.
  int prefetch = 1;
  bool no_sync = false;  // with grad_accum > 1: gradients reduced on the last microbatch only
  int optimizer_states = 2;  // per parameter: AdamW 2 (exp_avg, exp_avg_sq), SGD with momentum 1
  // The compute device: with offload to the CPU on a CUDA device, the sharded state is counted in
  // MemoryEstimate::host, not the device peak (on the CPU both are one memory).
  kernels::Device device;
  BatchShape batch;
};

// Bytes per rank (the worst rank). The kinds are each one's largest amount alive at once;
// `peak` is the largest sum alive at one time (at most the sum of the kinds: they peak at
// different moments).
struct MemoryEstimate {
  int64_t sharded_parameters = 0;  // FSDP's flat shard buffers (padded), master dtype
  int64_t gradients = 0;           // sharded gradients (the flat gradient buffers); unsharded
                                   // parameter gradients of the groups in backward are in `unsharded`
  int64_t optimizer_state = 0;
  int64_t unsharded = 0;       // unsharded parameters, their all-gather outputs and gradients
                               // (current + prefetched + root groups, the k slices)
  int64_t reduce_scatter = 0;  // reduce-scatter inputs and outputs in flight, casts of shards,
                               // the extensions' packed inputs
  int64_t activations = 0;     // op outputs saved for backward and the activation gradients
  int64_t transitions = 0;     // buffers inside redistributes (staging, gathered copies, a wire
                               // reduction's exchange) and the extensions' gathered copies
  int64_t peak = 0;            // bytes requested
  // The peak in kernels::CachingAllocator block sizes (each request rounded up: what its
  // limit_bytes counts).
  int64_t peak_blocks = 0;
  int64_t host = 0;            // offloaded state on the host when the compute device is a GPU
  std::string peak_at;         // where in the step the peak happens ("backward: blocks.3 ...")

  std::string to_json() const;
};

// REQUIRES: the sizes >= 1, batch.batch divisible by grad_accum, heads divisible by tp.
// Throws InvalidArgument naming the value otherwise.
MemoryEstimate estimate_memory(const nn::GPTConfig& model, const MemoryConfig& config);

// The same for a built model (meta or materialised): its config, and the sizes of its mesh's
// dims named dp_replicate, dp_shard and tp (what config says about them is replaced).
MemoryEstimate estimate_memory(const nn::GPT& model, const MemoryConfig& config);

}  // namespace fsdp
