// fsdp-train's parts (examples/fsdp_train.cpp documents the program): its flags, the data and
// the model, the training loop (fsdp_train_loop.cpp) and the memory checks (fsdp_train_memory.cpp).
#pragma once

#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/local.h"
#include "collectives/mpi.h"
#include "collectives/nccl.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/grad_scaler.h"
#include "fsdp/memory_estimate.h"
#include "kernels/allocator.h"
#include "kernels/checked.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/file_io.h"
#include "kernels/trace.h"
#include "checkpoint/checkpoint.h"
#include "collectives/trace.h"
#include "nn/memory.h"
#include "nn/module.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"
#include "examples/fsdp_train_lowp.h"
#include "examples/fsdp_train_moe.h"

namespace fsdp_train {

using collectives::Communicator;
using collectives::Milliseconds;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

struct Args {
  std::string backend = "local";
  int world = 0;  // 0: the product of the mesh dims
  int dp_replicate = 1, dp_shard = 1, tp = 1;
  int64_t layers = 2, dim = 64, heads = 4, vocab = 64, seq = 32, batch = 8;
  int steps = 30;
  double lr = 3e-3;
  uint64_t seed = 0;
  std::string mp = "fp32";
  std::string all_gather;  // --all-gather fp8 | int8 (empty: param dtype)
  int qlora = 0;           // --qlora RANK (0: off)
  double lora_alpha = 16;
  int grad_accum = 1;
  bool check_parity = false;
  std::string dump_init;
  int log_every = 1;
  // Not part of the contract: knobs for experiments.
  std::string optimizer = "adamw";
  double weight_decay = 0.0;
  double clip = 1.0;
  bool sequence_parallel = true;
  int threads = 0;  // 0: hardware threads / ranks of this process
  bool log_implicit = false;
  int64_t timeout_ms = program::kDefaultTimeoutMs;
  // FSDP
  bool fsdp = false;  // --dp-shard or --dp-replicate given
  std::string reshard_after_forward = "auto";
  std::string fsdp_layout = "padded";  // --fsdp-layout padded | contiguous (fsdp::Layout)
  bool offload = false;
  bool no_pin_memory = false;  // --offload with ordinary host memory, synchronous copies
  bool no_sync = false;
  int prefetch = 1;
  std::string reduce_wire;  // --reduce-wire bf16 | e5m2 (empty: the reduce dtype itself)
  int inject_overflow = 0;  // --inject-overflow STEP (1-based; 0: none)
  // checkpoints
  std::string save_dir;
  int save_every = 0;  // 0: only after the last step
  bool async_save = false;
  std::string resume_from;
  // shard first, initialise or load, estimate, limit (issue 26)
  bool init_before_shard = false;
  std::string init_from;
  bool estimate = false;
  int64_t memory_limit = 0;  // bytes per rank; 0: none
  bool activation_checkpointing = false;
  std::string trace;  // Chrome trace file; empty: none
  fsdp_train::MoEArgs moe;  // --moe-* and --ep (examples/fsdp_train_moe.h)
};

// A byte count: 1..2^63-1, parsed exactly (CLI11 alone saturates values past int64).
inline const CLI::Validator kPositiveInt64(
    [](std::string& text) -> std::string {
      int64_t v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < 1)
        return "value " + kernels::clip(text, 40) + " is not an integer in 1..9223372036854775807";
      return "";
    },
    "BYTES");

// --threads: at most this many CPU threads per rank.
constexpr int kMaxThreads = 1024;

// A non-finite loss or gradient norm: the run stops at that step (exit 1, program/main.h).
struct Diverged : kernels::NonFiniteError {
  using kernels::NonFiniteError::NonFiniteError;
};

// The mesh: (dp_replicate, dp_shard, tp) with trivial dims left out (dp_shard stays under FSDP,
// tp stays without FSDP).
struct MeshPlan {
  Dims shape;
  std::vector<std::string> names;
  int tp_dim = -1, shard_dim = -1, rep_dim = -1, ep_dim = -1;
};
MeshPlan mesh_plan(const Args& a, bool parallel);

// Inputs and targets [rows, seq] of samples first_sample .. first_sample + rows - 1.
std::pair<Tensor, Tensor> make_batch(const Args& a, int step, int64_t first_sample, int64_t rows);

nn::GPTConfig model_config(const Args& a);

struct RunResult {
  int first_step = 0;  // the step training started at (a resumed run: the checkpoint's)
  std::vector<double> losses;
  std::map<std::string, Tensor> params;  // full values (rank 0)
  double tokens_per_s = 0;
  int64_t peak_bytes = 0;
  int64_t peak_block_bytes = 0;  // the same in the caching allocator's block sizes (what a limit counts)
  std::optional<int64_t> all_gather_bytes;  // per step, this rank's unshards (FSDP only)
  std::optional<int64_t> reduce_bytes;  // per step: what the gradient reductions' plans moved (FSDP only)
  std::optional<int64_t> copy_bytes;    // per step, this rank: FSDP's copies and casts (GroupStats::copy_bytes)
};

// --reduce-wire: MixedPrecisionPolicy::reduce_wire (validate() checked the text).
std::optional<DType> reduce_wire(const Args& a);

// Checked before any rank starts: the flags (exit 2 naming the value), the mesh's rank count
// against the documented limits, and the model's parameters against the machine's memory.
void validate(const Args& a);

// Trains on `world` (every rank of it calls this) with tensor parallelism over `tp` ranks.
// print: rank 0 prints the progress lines.
RunResult train(Communicator& world, const Args& a, bool parallel, bool print, int threads, kernels::Device device);

// Memory (fsdp_train_memory.cpp): refuses a model whose parameters alone exceed the machine
// (exit 3); the estimate of this run; --memory-limit's refusal; --estimate's JSON line.
void check_model_fits(const Args& a, int64_t ranks, int64_t ranks_here);
std::optional<fsdp::MemoryEstimate> estimate_run(const Args& a);
void check_memory_limit(const Args& a, const fsdp::MemoryEstimate& e);
int print_estimate(const Args& a, const fsdp::MemoryEstimate& e);

}  // namespace fsdp_train
