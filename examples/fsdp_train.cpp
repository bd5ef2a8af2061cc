// fsdp-train: trains the small GPT (nn/transformer.h) on synthetic data with a learnable pattern,
// with FSDP over --dp-shard ranks, HSDP over --dp-replicate x --dp-shard, and tensor parallelism
// over --tp ranks (mesh (dp_replicate, dp_shard, tp), trivial dims left out), on any backend,
// and optionally checks it against the same training on one rank without parallelism.
//
//   fsdp-train --backend local --dp-shard 4 --check-parity
//   fsdp-train --backend local --dp-replicate 2 --dp-shard 2 --tp 2 --mp bf16 --check-parity
//   mpirun -np 4 fsdp-train --backend mpi --dp-shard 4 --check-parity
//   fsdp-train --moe-experts 8 --moe-top-k 2 --ep 4 --check-parity   (examples/fsdp_train_moe.h)
//
// FSDP (fsdp::fully_shard; applied when --dp-shard or --dp-replicate is given): every
// transformer block is one group, the root (embeddings, final norm, head) another; the batch is
// split over the dp dims. --reshard-after-forward true|false|K (default: FSDP2's automatic,
// blocks reshard, the root not), --offload (sharded state on the CPU), --no-sync (with
// --grad-accum: gradients reduced on the last microbatch only), --prefetch 0|1|2 (implicit
// prefetch depth in forward and backward; default 1). --mp bf16 under FSDP is the
// MixedPrecisionPolicy (bf16 parameters, f32 reduction, f32 sharded master weights).
// --all-gather fp8|int8 (with --mp bf16) gathers the blocks' linear weights as fp8 / int8 codes
// (examples/fsdp_train_lowp.h); the one-rank reference computes with the same dequantised weights.
// --qlora RANK (with --mp bf16; --lora-alpha, default 16): QLoRA, LoRA adapters of that rank on
// every attention and MLP projection, everything else frozen, the frozen linear weights gathered
// as NF4 (fsdp/lowp.h); only the adapters get gradients and optimizer state.
// --reduce-wire bf16|e5m2 (FSDP only): the gradient reductions move that dtype and sum it in f32
// (MixedPrecisionPolicy::reduce_wire; NOTE [wire dtype] in dtensor/exec/executor.h).
// --mp fp16: as bf16 with fp16 parameters and nn::GradScaler (a skipped step on every rank when
// any rank's gradient overflows; a line "  loss_scale S skipped_steps N" after each progress
// line); --inject-overflow K puts an inf into the last rank's gradient at step K.
//
// Output: one progress line per --log-every steps on rank 0 (the step's wall time in ms too),
//   step 3/30 loss 3.91234567 ms 6.21 tokens/s 41234 peak_bytes 1234567 param_bytes 123 grad_bytes 45
//   optim_bytes 90 buffer_bytes 67 all_gather_bytes 89 reduce_bytes 8192
// (rank 0's peaks: parameters = sharded plus unsharded, gradients = sharded, optimizer state,
// buffers = FSDP's reduce-scatter inputs and casts; the bytes rank 0's unshards sent this step;
// reduce_bytes: what the step's gradient reductions moved per rank, from their plans; 0 without
// FSDP)
// and, last, one JSON object:
//   {"steps":30,"first_loss":4.16,"last_loss":0.93,"parity":"ok","max_rel_loss_diff":2e-7,
//    "max_param_diff":3e-8,"tokens_per_s":41234,"peak_bytes":1234567,...,"all_gather_bytes":89,
//    "reduce_bytes":8192}
// (reduce_bytes: the progress lines' reduce_bytes averaged over the steps run)
// parity: "skipped" without --check-parity (then the two diffs are null); max_rel_loss_diff is the
// largest |loss - loss_ref| / |loss_ref| over the steps (limit 1e-5; bf16: 2e-2), max_param_diff
// the relative L2 difference of all final parameters flattened together (limit 1e-5; bf16: 5e-2).
// --mp bf16: bf16 parameters and activations for compute, f32 statistics, f32 master weights
// stepped by the optimizer, gradients reduced in f32; the reference run does the same. tokens_per_s: tokens
// of one step over the median step time; peak_bytes: the largest live tensor bytes of one
// rank's mesh allocator (parameters, gradients, optimizer state, activations, buffers), the
// maximum over ranks.
//
// Data: sample g (global index step * batch + position in the batch, the same under every
// layout) is the sequence t[0] = mix64(seed * 0x100000001B3 + step * 0x9E3779B97F4A7C15 + g) % V,
// t[i+1] = (5 t[i] + 3) % V; inputs t[0..seq-1], targets t[1..seq] (a pattern the model learns;
// bench/torch_train_compare.py generates the same batches).
//
// Checkpoints (checkpoint/checkpoint.h): --save-dir D writes D/step-00000010 (every --save-every
// steps, and after the last step) with the parameters (the f32 master weights) keyed by fully
// qualified name, the optimizer state under "optim." and the values train.step / train.seed /
// train.samples; --async-save writes in the background while training goes on (the next save
// or the end of training waits for it). --resume-from D loads such a checkpoint under the
// current mesh (any --tp: resharded on load) and continues at its step up to --steps; the data
// of a step depends only on (seed, step), so the losses continue the uninterrupted run's
// (with --check-parity the reference is the uninterrupted single-rank run, compared on the
// steps run). Directories PyTorch wrote with dcp.save + HuggingFaceStorageWriter load too
// (keys as above; PyTorch's one-element step tensors become the steps).
//
//   fsdp-train --tp 2 --steps 20 --save-dir ck --save-every 10
//   fsdp-train --tp 4 --steps 20 --resume-from ck/step-00000010 --check-parity
//
// --trace FILE writes a Chrome trace of the run (open it in ui.perfetto.dev): per rank, lane
// "compute" holds each step with its forward, backward and optimizer spans, one "comm <group>"
// lane per communicator each collective from issue to completion (arguments: bytes, group, the
// placement transition a redistribute step makes), lane "waits" the waits on collectives and
// redistributes. Under mpirun rank 0 gathers every rank's events and writes the one file.
//
//   fsdp-train --dp-shard 2 --steps 2 --trace step.json
//
// A non-finite loss or gradient norm stops the run at that step (exit 1, one line naming the step
// and the value). --timeout-ms bounds every wait (a collective, the mpi closing barrier); under
// mpirun a failure is printed at once by the rank it happened on (invalid input by rank 0 only).
//
// Exit status: 0 ok, 1 parity mismatch or a diverged run, 2 invalid input, 3 out of resources,
// 4 communication failure.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
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
#include "examples/fsdp_train_lowp.h"
#include "examples/fsdp_train_moe.h"
#include "program/cli.h"
#include "program/main.h"
#include "program/stats.h"

namespace {

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
  bool offload = false;
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
const CLI::Validator kPositiveInt64(
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
  if (parallel && a.moe.ep > 1) m.ep_dim = add(a.moe.ep, "ep");
  if (!parallel || !a.fsdp || a.tp > 1) m.tp_dim = add(parallel ? a.tp : 1, "tp");
  m.shape = Dims::filled(static_cast<int>(sizes.size()), 1);
  for (size_t i = 0; i < sizes.size(); ++i) m.shape[static_cast<int>(i)] = sizes[i];
  return m;
}

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
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
        mix64(a.seed * 0x100000001B3ull + static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull + g) % V;
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

struct RunResult {
  int first_step = 0;  // the step training started at (a resumed run: the checkpoint's)
  std::vector<double> losses;
  std::map<std::string, Tensor> params;  // full values (rank 0)
  double tokens_per_s = 0;
  int64_t peak_bytes = 0;
  int64_t peak_block_bytes = 0;  // the same in the caching allocator's block sizes (what a limit counts)
  std::optional<int64_t> all_gather_bytes;  // per step, this rank's unshards (FSDP only)
  std::optional<int64_t> reduce_bytes;  // per step: what the gradient reductions' plans moved (FSDP only)
};

// --reduce-wire: MixedPrecisionPolicy::reduce_wire (validate() checked the text).
std::optional<DType> reduce_wire(const Args& a) {
  if (a.reduce_wire.empty()) return std::nullopt;
  return a.reduce_wire == "bf16" ? DType::kBF16 : DType::kF8E5M2;
}

using program::median;

// Trains on `world` (every rank of it calls this) with tensor parallelism over `tp` ranks.
// print: rank 0 prints the progress lines.
RunResult train(Communicator& world, const Args& a, bool parallel, bool print, int threads, kernels::Device device) {
  const MeshPlan plan = mesh_plan(a, parallel);
  const int tp = parallel ? a.tp : 1;
  const bool use_fsdp = parallel && a.fsdp;
  const dtensor::DeviceMesh mesh = dtensor::DeviceMesh::from_shape(plan.shape, plan.names);
  // One caching allocator per rank serves everything of the mesh (with --memory-limit, its
  // limit caps every allocation: parameters, gradients, optimizer state, activations, FSDP's
  // buffers, redistribute buffers); trackers in front of it count the kinds apart, and every
  // tracker counts into `total`: peak_bytes is the largest sum live at one time.
  kernels::CachingAllocator::Options cache_options;
  if (parallel && a.memory_limit > 0) cache_options.limit_bytes = static_cast<size_t>(a.memory_limit);
  auto cache = std::make_shared<kernels::CachingAllocator>(cache_options);
  auto total_mem = std::make_shared<nn::TrackingAllocator>();
  auto memory = std::make_shared<nn::TrackingAllocator>(cache, total_mem);
  // reshard_after_forward = K needs the dp_shard dim split (dp_shard / K, K) at creation.
  std::vector<dtensor::Unflattening> unflatten;
  int reshard_k = 0;
  if (use_fsdp && a.reshard_after_forward != "auto" && a.reshard_after_forward != "true" &&
      a.reshard_after_forward != "false") {
    reshard_k = std::stoi(a.reshard_after_forward);
    if (reshard_k > 1 && reshard_k < a.dp_shard) unflatten.push_back(fsdp::reshard_unflattening(mesh, plan.shard_dim, reshard_k));
  }
  auto comms = std::make_shared<dtensor::MeshComms>(mesh, world, std::vector<std::vector<int>>{}, memory, unflatten);
  const nn::GPTConfig cfg = model_config(a);
  // Built on meta (shapes, dtypes, placements: nothing allocated), parallelised, and under FSDP
  // sharded before it is initialised (or loaded): every rank only ever allocates its shards.
  nn::GPT model(nn::ModuleOptions{comms, DType::kF32, device}, cfg);
  if (a.qlora > 0) nn::add_lora(model, a.qlora, a.lora_alpha);  // on meta, before sharding
  if (tp > 1) nn::parallelize_module(model, plan.tp_dim, nn::gpt_tensor_parallel_plan(cfg, a.sequence_parallel, true));
  if (plan.ep_dim >= 0) fsdp_train::set_expert_parallel(model, plan.ep_dim);
  const nn::NamedParameters params = model.named_parameters();
  const bool rank0 = world.rank() == 0;
  kernels::Tracer* const tracer = world.tracer();  // null: not traced
  const int me = world.global_rank();
  // --mp bf16 | fp16: low-precision compute parameters (fp16 with a GradScaler).
  const bool bf16 = a.mp != "fp32";
  const DType low_dtype = a.mp == "fp16" ? DType::kF16 : DType::kBF16;
  const std::optional<fsdp::QuantConfig> quant =
      a.qlora > 0 ? std::optional<fsdp::QuantConfig>(fsdp_train::kQloraBase)
                  : fsdp_train::parse_all_gather(a.all_gather);
  auto initialise = [&] {
    if (a.init_from.empty()) {
      nn::materialize(model, a.seed);
      return;
    }
    checkpoint::PretrainedOptions po;
    po.skip_prefixes = {"optim."};  // fsdp-train's own checkpoints hold the optimizer state there
    const checkpoint::LoadStats st = checkpoint::load_pretrained(a.init_from, model, world, po);
    // Bytes read and needed over every rank (each reads only its shards' bytes).
    Tensor sums = Tensor::full({2}, 0.0, DType::kF64);
    sums.set_item({0}, static_cast<double>(st.bytes_read));
    sums.set_item({1}, static_cast<double>(st.bytes_needed));
    Tensor dsums = sums.to(device);
    world.wait(world.all_reduce(dsums, dsums, collectives::Reduction(collectives::ReduceOp::kSum)));
    sums = dsums.to(kernels::Device{});
    if (print && rank0) {
      const double read = sums.item({0}), needed = sums.item({1});
      fmt::print("init_from {} bytes_read {:.0f} bytes_needed {:.0f} read/needed {:.2f}\n", a.init_from, read, needed,
                 needed > 0 ? read / needed : 1.0);
      std::fflush(stdout);
    }
  };
  const bool shard_first = use_fsdp && !a.init_before_shard;
  if (!shard_first) initialise();

  auto dump_init = [&] {
    if (a.dump_init.empty() || !print) return;
    nn::NamedTensors full;
    for (const auto& [name, p] : params)
      full.emplace_back(name, p->data().full_tensor().to(kernels::Device{}));
    if (rank0) {
      nlohmann::json meta = {{"vocab", a.vocab},
                             {"dim", a.dim},
                             {"heads", a.heads},
                             {"layers", a.layers},
                             {"seq", a.seq},
                             {"norm", "layer"},
                             {"norm_eps", cfg.norm_eps},
                             {"bias", cfg.bias},
                             {"gelu", "tanh"},
                             {"pos_embedding", cfg.pos_embedding},
                             {"tie_embeddings", cfg.tie_embeddings},
                             {"mlp_hidden", 4 * a.dim}};
      if (cfg.moe.experts > 0) meta["moe"] = fsdp_train::moe_metadata(cfg);
      nn::save_safetensors(a.dump_init, full, {{"format", "pt"}, {"config", meta.dump()}});
    }
  };
  if (!shard_first) dump_init();

  // FSDP: one group per transformer block, then the root (bottom-up).
  auto unsharded_mem = std::make_shared<nn::TrackingAllocator>(cache, total_mem);
  auto buffer_mem = std::make_shared<nn::TrackingAllocator>(cache, total_mem);
  fsdp::FSDPModule* root = nullptr;
  std::vector<fsdp::FSDPModule*> groups;  // every group (blocks, then the root)
  auto reduce_total = [&] {
    int64_t n = 0;
    for (const fsdp::FSDPModule* g : groups) n += g->stats().reduce_bytes;
    return n;
  };
  if (use_fsdp) {
    fsdp::FullyShardOptions o;
    if (a.reshard_after_forward == "true") o.reshard_after_forward = fsdp::ReshardAfterForward::yes();
    else if (a.reshard_after_forward == "false") o.reshard_after_forward = fsdp::ReshardAfterForward::no();
    else if (reshard_k > 0) o.reshard_after_forward = fsdp::ReshardAfterForward::to(reshard_k);
    if (bf16) {
      o.mp_policy.param_dtype = low_dtype;
      o.mp_policy.reduce_dtype = DType::kF32;
    }
    o.mp_policy.reduce_wire = reduce_wire(a);
    o.offload_policy.offload_to_cpu = a.offload;
    o.unsharded_allocator = unsharded_mem;
    o.buffer_allocator = buffer_mem;
    std::vector<fsdp::FSDPModule*> blocks;
    if (quant) o.all_gather_extension_fn = fsdp_train::extension_fn(*quant);
    for (const auto& [name, block] : model.blocks().children()) {
      fsdp::FullyShardOptions bo = o;
      if (plan.ep_dim >= 0) bo.ignored_params = fsdp_train::expert_parameters(*block);
      blocks.push_back(&fsdp::fully_shard(*block, comms, bo));
    }
    fsdp::FullyShardOptions ro = o;
    ro.all_gather_extension_fn = nullptr;  // embeddings, lm_head and the final norm stay bf16
    if (reshard_k > 0) ro.reshard_after_forward = fsdp::ReshardAfterForward::automatic();  // the root keeps its own
    root = &fsdp::fully_shard(model, comms, ro);
    root->set_prefetch_depth(a.prefetch >= 1 ? 1 : 0);
    groups = blocks;
    groups.push_back(root);
    if (a.prefetch == 2)  // explicit lists two groups ahead
      for (size_t i = 0; i < blocks.size(); ++i) {
        std::vector<fsdp::FSDPModule*> fwd, bwd;
        for (size_t j = i + 1; j <= i + 2 && j < blocks.size(); ++j) fwd.push_back(blocks[j]);
        for (size_t j = 1; j <= 2 && j <= i; ++j) bwd.push_back(blocks[i - j]);
        blocks[i]->set_modules_to_forward_prefetch(fwd);
        blocks[i]->set_modules_to_backward_prefetch(bwd);
      }
    if (print && rank0 && !root->note().empty()) {  // once per run
      fmt::print("note: {}\n", root->note());
      std::fflush(stdout);
    }
  }
  if (shard_first) {
    initialise();  // straight into every group's flat buffer
    dump_init();
  }

  // --mp bf16: the model computes with bf16 parameters (and so bf16 activations; norms, softmax,
  // attention and the loss keep f32 statistics); the optimizer steps f32 master copies with the
  // gradients cast to f32 before they are reduced, then the bf16 parameters are refreshed.
  nn::NamedParameters master = params;
  if (bf16 && !use_fsdp) {
    master.clear();
    for (const auto& [name, p] : params) {
      auto m =
          std::make_shared<nn::Parameter>(comms, p->shape(), DType::kF32, p->init(), p->placements(), device);
      m->set_data(p->data());
      m->requires_grad = p->requires_grad;  // --qlora: the frozen base stays frozen
      master.emplace_back(name, m);
      p->set_dtype(low_dtype);
      fsdp_train::set_compute(name, *p, p->data().to_local(), m->data().to_local(), quant);
    }
  }
  auto cast = [](const DTensor& d, DType dtype) {
    dtensor::DTensorSpec spec = d.spec();
    spec.dtype = dtype;
    return DTensor(d.comms(), spec, d.to_local().to(dtype));
  };
  std::unique_ptr<nn::Optimizer> opt;
  if (a.optimizer == "adamw") {
    kernels::AdamWOptions o;
    o.lr = a.lr;
    o.weight_decay = a.weight_decay;
    opt = std::make_unique<nn::AdamW>(master, o);
  } else {
    kernels::SgdOptions o;
    o.lr = a.lr;
    o.momentum = 0.9;
    o.weight_decay = a.weight_decay;
    opt = std::make_unique<nn::SGD>(master, o);
  }
  // The checkpointed state: the master weights keyed by name, the optimizer's under "optim.".
  auto state_dict = [&] {
    nn::StateDict sd;
    for (const auto& [name, p] : master) sd.tensors.emplace_back(name, p->data());
    sd.merge(opt->state_dict(), "optim.");
    return sd;
  };
  int first_step = 0;
  if (!a.resume_from.empty()) {
    opt->init_state();
    nn::StateDict sd = state_dict();
    checkpoint::load(a.resume_from, sd, world);
    opt->load_state_dict(sd.sub("optim."));
    // The step to continue at, range-checked before it indexes anything: 0..--steps.
    const bool ours = sd.values.count("train.step") > 0;
    // A checkpoint PyTorch wrote: the optimizer's step is the training step.
    const int64_t stored = ours ? sd.int_value("train.step") : opt->step_count(master.front().first);
    if (stored < 0 || stored > a.steps)
      throw kernels::InvalidArgument(fmt::format(
          "--resume-from {}: {} {} is out of range (expected 0..{}, --steps {})", a.resume_from,
          ours ? "train.step" : "the optimizer's step", stored, a.steps, a.steps));
    first_step = static_cast<int>(stored);
    if (sd.values.count("train.seed") && static_cast<uint64_t>(sd.int_value("train.seed")) != a.seed)
      throw kernels::InvalidArgument(fmt::format("--resume-from {}: the checkpoint was trained with --seed {}, not {}",
                                                 a.resume_from, sd.int_value("train.seed"), a.seed));
    if (first_step >= a.steps)
      throw kernels::InvalidArgument(fmt::format(
          "--resume-from {}: the checkpoint is at step {}; --steps {} leaves nothing to train", a.resume_from,
          first_step, a.steps));
    if (bf16)
      for (size_t i = 0; i < params.size(); ++i) {
        if (use_fsdp) continue;  // the parameters are the master weights
        fsdp_train::set_compute(params[i].first, *params[i].second, params[i].second->data().to_local(),
                                master[i].second->data().to_local(), quant);
      }
    if (print && rank0) {
      fmt::print("resumed from {} at step {}\n", a.resume_from, first_step);
      std::fflush(stdout);
    }
  }
  std::optional<checkpoint::SaveHandle> pending;
  checkpoint::SaveOptions save_options;
  save_options.staging = std::make_shared<checkpoint::StagingCache>();  // reused by every async save
  auto save = [&](int steps_done) {
    if (pending) pending->wait();
    pending.reset();
    nn::StateDict sd = state_dict();
    sd.values["train.step"] = int64_t{steps_done};
    sd.values["train.seed"] = static_cast<int64_t>(a.seed);
    sd.values["train.samples"] = static_cast<int64_t>(steps_done) * a.batch;
    const std::string dir = fmt::format("{}/step-{:08}", a.save_dir, steps_done);
    pending = checkpoint::async_save(dir, sd, world, save_options);
    if (!a.async_save) {
      pending->wait();
      pending.reset();
    }
  };
  dtensor::ops::OpOptions ops;
  ops.num_threads = threads;
  dtensor::ops::RedistributeLog implicit;
  if (a.log_implicit && print && rank0) {
    implicit.sink = [](const dtensor::ops::RedistributeEvent& e) {
      std::fprintf(stderr, "implicit redistribute: %s\n", dtensor::ops::to_string(e).c_str());
    };
    ops.log = &implicit;
  }
  nn::CrossEntropyLoss loss_fn;
  const int64_t micro = a.batch / a.grad_accum;
  const Placements replicated(mesh.ndim(), dtensor::Replicate{});
  auto shared_mesh = std::shared_ptr<const dtensor::DeviceMesh>(comms, &comms->mesh());
  auto as_dtensor = [&](const Tensor& full) {
    return DTensor(comms, dtensor::make_spec(shared_mesh, replicated, full.shape(), full.dtype()),
                   full.to(device));
  };
  // The batch: split over the dp dims (each rank keeps its rows; no communication).
  Placements batch_placements = replicated;
  if (plan.rep_dim >= 0) batch_placements[plan.rep_dim] = dtensor::Shard{0};
  if (plan.shard_dim >= 0) batch_placements[plan.shard_dim] = dtensor::Shard{0};
  if (plan.ep_dim >= 0) batch_placements[plan.ep_dim] = dtensor::Shard{0};
  auto as_batch = [&](const Tensor& full) {
    return dtensor::distribute_tensor(full.to(device), comms, batch_placements, std::nullopt);
  };
  int64_t param_bytes = 0, grad_bytes = 0, optim_bytes = 0;
  for (const auto& [name, p] : master) param_bytes += static_cast<int64_t>(p->data().to_local().nbytes());
  if (bf16 && !use_fsdp)
    for (const auto& [name, p] : params) param_bytes += static_cast<int64_t>(p->data().to_local().nbytes());
  // --mp fp16: the loss is scaled for backward (nn::GradScaler, PyTorch's constants); a step whose
  // gradients hold an inf or NaN on any rank is skipped on every rank and the scale backs off.
  std::optional<nn::GradScaler> scaler;
  if (a.mp == "fp16") scaler.emplace();
  int skipped_steps = 0;

  RunResult result;
  result.first_step = first_step;
  std::vector<double> step_seconds;
  total_mem->reset_peak();  // the training's peak: initialisation and --dump-init left out
  const int64_t ag_bytes_start = fsdp_train::all_gather_bytes(groups);
  cache->reset_peak();
  const int64_t reduce_start = reduce_total();
  for (int step = first_step; step < a.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t ag_bytes_before = fsdp_train::all_gather_bytes(groups);
    const int64_t reduce_before = reduce_total();
    const std::string step_name = tracer != nullptr ? fmt::format("step {}", step + 1) : std::string();
    const kernels::TraceSpan step_span(tracer, me, "compute", step_name);
    double step_loss = 0;
    fsdp_train::MoEStep moe_step;
    for (int m = 0; m < a.grad_accum; ++m) {
      auto [ids_full, targets_full] =
          make_batch(a, step, static_cast<int64_t>(step) * a.batch + m * micro, micro);
      const DTensor ids = as_batch(ids_full), targets = as_batch(targets_full);
      if (root && a.no_sync) root->set_requires_gradient_sync(m + 1 == a.grad_accum);
      nn::Ctx ctx(&ops), lctx(&ops);
      std::optional<kernels::TraceSpan> span(std::in_place, tracer, me, "compute", "forward");
      DTensor logits = model.forward(ctx, ids);
      DTensor loss = loss_fn.forward(lctx, logits, targets);
      const double micro_loss = loss.full_tensor().to(kernels::Device{}).item({});
      span.reset();
      // The same value on every rank (a replicated scalar): every rank stops at the same step.
      if (!std::isfinite(micro_loss))
        throw Diverged(fmt::format("step {}/{}: the loss is {}{}; the training diverged (try a smaller --lr)",
                                   step + 1, a.steps, micro_loss,
                                   a.grad_accum > 1 ? fmt::format(" in microbatch {}", m + 1) : ""));
      step_loss += micro_loss / a.grad_accum;
      if (a.moe.experts > 0) moe_step.add(ctx, a.grad_accum);
      span.emplace(tracer, me, "compute", "backward");
      const double seed = (scaler ? scaler->scale() : 1.0) / a.grad_accum;
      DTensor dlogits = loss_fn.backward(lctx, as_dtensor(Tensor::full({}, seed, DType::kF64)));
      model.backward(ctx, dlogits);
    }
    std::optional<kernels::TraceSpan> optimizer_span(std::in_place, tracer, me, "compute", "optimizer");
    if (bf16 && !use_fsdp)
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].second->grad()) master[i].second->grad() = cast(*params[i].second->grad(), DType::kF32);
        params[i].second->zero_grad();
      }
    nn::reduce_gradients(master);
    if (a.inject_overflow == step + 1 && world.rank() + 1 == world.size())  // the last rank only
      for (const auto& [name, p] : master)
        if (p->grad() && p->grad()->to_local().numel() > 0) {
          Tensor g = p->grad()->to_local();
          g.view({g.numel()}).narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
          break;
        }
    // Clipping (or, with --clip 0, only measuring) the global norm stops a diverged run: the norm
    // is the same on every rank. With the scaler a non-finite gradient skips the step instead.
    bool stepping = true;
    const double loss_scale = scaler ? scaler->scale() : 1.0;
    if (scaler) {
      stepping = scaler->unscale_clip_(master, a.clip).stepped;
      if (!stepping) ++skipped_steps;
    } else {
      try {
        nn::clip_grad_norm_(master, a.clip, 2.0, /*error_if_nonfinite=*/true);
      } catch (const kernels::NonFiniteError& e) {
        throw Diverged(fmt::format("step {}/{}: the gradient norm is not finite ({}); the training diverged (try a "
                                   "smaller --lr)",
                                   step + 1, a.steps, e.what()));
      }
    }
    int64_t gb = 0;
    for (const auto& [name, p] : master)
      if (p->grad()) gb += static_cast<int64_t>(p->grad()->to_local().nbytes());
    grad_bytes = std::max(grad_bytes, gb);
    if (stepping) opt->step();
    if (step == 0)
      for (const auto& [name, p] : master)
        for (const char* key : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) try {
            optim_bytes += static_cast<int64_t>(opt->state(name, key).to_local().nbytes());
          } catch (const kernels::InvalidArgument&) {
          }
    opt->zero_grad();
    optimizer_span.reset();
    if (bf16 && !use_fsdp)
      for (size_t i = 0; i < params.size(); ++i) {
        fsdp_train::set_compute(params[i].first, *params[i].second, params[i].second->data().to_local(),
                                master[i].second->data().to_local(), quant);  // rounds to bf16
      }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    step_seconds.push_back(seconds);
    result.losses.push_back(step_loss);
    if (print && rank0 && ((step + 1) % a.log_every == 0 || step + 1 == a.steps)) {
      fmt::print(
          "step {}/{} loss {:.9g} ms {:.3f} tokens/s {:.0f} peak_bytes {} param_bytes {} grad_bytes {} "
          "optim_bytes {} buffer_bytes {} all_gather_bytes {} reduce_bytes {}{}\n",
          step + 1, a.steps, step_loss, seconds * 1e3, static_cast<double>(a.batch * a.seq) / seconds,
          total_mem->peak_bytes(), param_bytes + unsharded_mem->peak_bytes(), grad_bytes, optim_bytes, buffer_mem->peak_bytes(),
          fsdp_train::all_gather_bytes(groups) - ag_bytes_before, reduce_total() - reduce_before,
          a.moe.experts > 0 ? moe_step.text() : "");
      if (scaler) fmt::print("  loss_scale {} skipped_steps {}\n", loss_scale, skipped_steps);
      std::fflush(stdout);
    }
    if (!a.save_dir.empty() && ((a.save_every > 0 && (step + 1) % a.save_every == 0) || step + 1 == a.steps))
      save(step + 1);
  }
  if (pending) pending->wait();
  pending.reset();
  // Steady state: leave out the first step (allocations, plan caches) when there are others.
  std::vector<double> steady(step_seconds.begin() + (step_seconds.size() > 1 ? 1 : 0), step_seconds.end());
  const double med = median(steady);
  if (use_fsdp && !result.losses.empty()) {
    result.all_gather_bytes =
        (fsdp_train::all_gather_bytes(groups) - ag_bytes_start) / static_cast<int64_t>(result.losses.size());
    result.reduce_bytes = (reduce_total() - reduce_start) / static_cast<int64_t>(result.losses.size());
  }
  result.tokens_per_s = med > 0 ? static_cast<double>(a.batch * a.seq) / med : 0;
  // The training's peak, before the full parameters are gathered for the parity check.
  const int64_t training_peak = total_mem->peak_bytes();
  const int64_t training_peak_blocks = static_cast<int64_t>(cache->stats().peak_in_use_bytes);
  for (const auto& [name, p] : master) {
    Tensor full = p->data().full_tensor().to(kernels::Device{});
    if (rank0) result.params[name] = full.clone();
  }
  // On the backend's device (the nccl backend moves CUDA tensors only).
  Tensor peak = Tensor::full({2}, static_cast<double>(training_peak), DType::kF64);
  peak.set_item({1}, static_cast<double>(training_peak_blocks));
  Tensor dpeak = peak.to(device);
  world.wait(world.all_reduce(dpeak, dpeak, collectives::Reduction(collectives::ReduceOp::kMax)));
  peak = dpeak.to(kernels::Device{});
  result.peak_bytes = static_cast<int64_t>(peak.item({0}));
  result.peak_block_bytes = static_cast<int64_t>(peak.item({1}));
  return result;
}

struct Parity {
  double max_rel_loss_diff = 0, max_param_diff = 0;
  bool ok = true;
  std::string worst;  // where the largest parameter difference is
};

Parity compare(const RunResult& got, const RunResult& ref, double loss_tol, double param_tol) {
  Parity p;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    const double r = ref.losses[got.first_step + i];
    const double rel = std::abs(got.losses[i] - r) / std::max(std::abs(r), 1e-30);
    p.max_rel_loss_diff = std::max(p.max_rel_loss_diff, rel);
  }
  // Parameters: the relative L2 difference of all of them flattened together,
  // ||theta - theta_ref|| / ||theta_ref||. Elementwise limits are not meaningful under Adam: an
  // element whose gradient is a sum that cancels to rounding noise (|g| near eps) takes a step of
  // a different size in any other reduction order (observed: one element of 16k moving by 5e-5
  // while every loss agrees to 2e-7); the parameters as a whole must agree.
  double num = 0, den = 0, worst = -1;
  for (const auto& [name, t] : ref.params) {
    auto it = got.params.find(name);
    if (it == got.params.end()) {
      p.ok = false;
      p.worst = name + " is missing";
      continue;
    }
    const std::vector<double> a = it->second.to_vector(), b = t.to_vector();
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      const double d = std::abs(a[i] - b[i]);
      num += d * d;
      den += b[i] * b[i];
      if (d > worst) {
        worst = d;
        p.worst = fmt::format("largest element difference {} at {}[{}]: {} vs one rank's {}", d, name, i,
                              a[i], b[i]);
      }
    }
  }
  p.max_param_diff = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  p.ok = p.ok && p.max_rel_loss_diff <= loss_tol && p.max_param_diff <= param_tol;
  return p;
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
      a.moe.ep, "mesh ranks (x --ep)");
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
  fsdp_train::validate_moe(a.moe, a.tp, a.batch, a.grad_accum, a.estimate || a.memory_limit > 0);
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

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{}", v) : "null"; }

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
  c.options.offload_policy.offload_to_cpu = a.offload;
  c.prefetch = a.prefetch;
  c.no_sync = a.no_sync;
  c.optimizer_states = a.optimizer == "adamw" ? 2 : 1;  // AdamW's two moments; SGD's momentum
  c.device = a.backend == "nccl" ? kernels::Device::cuda(0) : kernels::Device{};
  c.batch = {a.batch, a.seq, a.grad_accum};
  return c;
}

fsdp::MemoryEstimate estimate(const Args& a) { return fsdp::estimate_memory(model_config(a), memory_config(a)); }

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

// True when the command line asks for the mpi backend (read before parsing succeeded, so that a
// malformed flag under mpirun is reported by rank 0 only).
bool mpi_requested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--backend=mpi" || (arg == "--backend" && i + 1 < argc && std::string(argv[i + 1]) == "mpi"))
      return true;
  }
  return false;
}

// One rank's part on the local backend: a failure that is the same on every rank (invalid input,
// a diverged loss) leaves as it is, any other names the rank (program::on_rank).
template <class F>
void as_local_rank(int rank, F&& f) {
  try {
    f();
  } catch (const kernels::InvalidArgument&) {
    throw;
  } catch (const kernels::Unsupported&) {
    throw;
  } catch (const Diverged&) {
    throw;
  } catch (...) {
    throw program::RankError(rank, std::current_exception());
  }
}

struct Outcome {
  std::optional<RunResult> got;  // rank 0's
  std::string parity = "skipped";
  std::optional<Parity> cmp;
  std::optional<fsdp::MemoryEstimate> estimate;  // of the parallel run (none when it could not be made)
};

// --check-parity: the same training on one rank without parallelism, compared with `got`.
Outcome check_parity(const Args& a, RunResult got) {
  Outcome o;
  const double loss_tol = a.mp != "fp32" ? 2e-2 : 1e-5, param_tol = a.mp != "fp32" ? 5e-2 : 1e-5;
  std::optional<RunResult> ref;
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  Args single = a;
  single.dump_init.clear();
  single.save_dir.clear();
  single.resume_from.clear();
  single.save_every = 0;
  single.async_save = false;
  single.memory_limit = 0;
  collectives::run_ranks(
      1,
      [&](Communicator& w) {
        ref = train(w, single, false, false, a.threads > 0 ? a.threads : hw, kernels::Device{});
      },
      Milliseconds{a.timeout_ms});
  o.cmp = compare(got, *ref, loss_tol, param_tol);
  if (!o.cmp->ok)
    std::fprintf(stderr,
                 "fsdp-train: parity failed: max relative loss difference %g (limit %g), parameters' "
                 "relative L2 difference %g (limit %g); %s\n",
                 o.cmp->max_rel_loss_diff, loss_tol, o.cmp->max_param_diff, param_tol, o.cmp->worst.c_str());
  o.parity = o.cmp->ok ? "ok" : "fail";
  o.got = std::move(got);
  return o;
}

// Rank 0's last line; the exit status.
int finish(const Args& a, const Outcome& o) {
  const RunResult& got = *o.got;
  fmt::print(
      "{{\"steps\":{},\"first_loss\":{},\"last_loss\":{},\"parity\":\"{}\",\"max_rel_loss_diff\":{},"
      "\"max_param_diff\":{},\"tokens_per_s\":{},\"peak_bytes\":{},\"peak_block_bytes\":{},"
      "\"estimated_peak_bytes\":{},\"estimated_peak_block_bytes\":{},\"all_gather_bytes\":{},\"reduce_bytes\":{}}}\n",
      a.steps, json_number(got.losses.front()), json_number(got.losses.back()), o.parity,
      o.cmp ? json_number(o.cmp->max_rel_loss_diff) : "null", o.cmp ? json_number(o.cmp->max_param_diff) : "null",
      json_number(std::round(got.tokens_per_s)), got.peak_bytes, got.peak_block_bytes,
      o.estimate ? std::to_string(o.estimate->peak) : "null", o.estimate ? std::to_string(o.estimate->peak_blocks) : "null",
      got.all_gather_bytes ? std::to_string(*got.all_gather_bytes) : "null",
      got.reduce_bytes ? std::to_string(*got.reduce_bytes) : "null");
  std::fflush(stdout);
  return o.parity == "fail" ? program::kMismatch : program::kOk;
}

// One process of an mpi job (under program::run_as_rank: invalid input is printed by rank 0
// only, any other failure at once by the rank it happened on).
int run_mpi_rank(const Args& a, collectives::MpiWorld& mpi) {
  validate(a);
  const int64_t ranks = int64_t{a.dp_replicate} * a.dp_shard * a.tp * a.moe.ep;  // validated: no overflow
  if (a.world != 0 && a.world != mpi.size())
    throw kernels::InvalidArgument(fmt::format("--world {} but mpirun started {} processes", a.world, mpi.size()));
  if (mpi.size() != ranks)
    throw kernels::InvalidArgument(
        fmt::format("mpirun started {} processes for a mesh of {} ranks (--dp-replicate {} --dp-shard {} --tp {})",
                    mpi.size(), ranks, a.dp_replicate, a.dp_shard, a.tp));
  check_model_fits(a, ranks, 1);
  const std::optional<fsdp::MemoryEstimate> est = estimate_run(a);
  if (a.estimate) return mpi.rank() == 0 ? print_estimate(a, *est) : program::kOk;
  try {
    if (est) check_memory_limit(a, *est);
  } catch (const kernels::ResourceError&) {  // the same on every rank: rank 0 says it
    if (mpi.rank() == 0) program::report("fsdp-train", program::classify(std::current_exception()));
    throw program::Exit{program::kResource};
  }
  const Milliseconds timeout{a.timeout_ms};
  const std::unique_ptr<Communicator> world = mpi.communicator(timeout);
  const int threads = a.threads > 0 ? a.threads : 1;
  kernels::Tracer tracer;
  std::optional<kernels::File> trace_file;
  if (!a.trace.empty()) {
    try {
      trace_file = collectives::create_trace_file(*world, a.trace);
    } catch (const kernels::InvalidArgument& e) {
      throw kernels::InvalidArgument(fmt::format("--trace {}: {}", a.trace, e.what()));
    }
    world->set_tracer(&tracer);
  }
  const auto t0 = std::chrono::steady_clock::now();
  RunResult got;
  try {
    got = train(*world, a, true, true, threads, kernels::Device{});
    if (!a.trace.empty()) collectives::write_trace(*world, tracer, trace_file);
  } catch (const Diverged&) {  // the same on every rank: rank 0 says it (before the closing barrier)
    if (mpi.rank() == 0) program::report("fsdp-train", program::classify(std::current_exception()));
    throw program::Exit{program::kMismatch};
  }
  if (!a.check_parity) return mpi.rank() == 0 ? finish(a, Outcome{std::move(got), "skipped", std::nullopt, est}) : 0;
  // Rank 0 trains the reference alone; the others wait for its verdict, as long as the reference
  // may take (the same work on one rank: bounded by world x the parallel run, twice over) plus
  // the timeout, so a small --timeout-ms does not fail a healthy check.
  const auto trained = std::chrono::steady_clock::now() - t0;
  const auto reference_wait =
      timeout + std::chrono::duration_cast<Milliseconds>(2 * static_cast<int64_t>(mpi.size()) * trained);
  std::optional<Outcome> o;
  int verdict = 1;
  if (mpi.rank() == 0) {
    o = check_parity(a, std::move(got));
    o->estimate = est;
    verdict = o->parity == "ok" ? 1 : 0;
  }
  Tensor v = Tensor::full({1}, verdict, DType::kI32);
  world->broadcast(v, 0)->wait(reference_wait);
  if (mpi.rank() == 0) return finish(a, *o);
  return static_cast<int>(v.item({0})) ? program::kOk : program::kMismatch;
}

int run(int argc, char** argv) {
  Args a;
  CLI::App app(
      "fsdp-train: a small GPT trained with FSDP / HSDP / tensor parallelism, checked against one rank");
  app.add_option("--backend", a.backend, "local | mpi | nccl");
  app.add_option("--world", a.world, "ranks (local: threads); default the product of the mesh dims");
  auto* dp_rep_opt = app.add_option("--dp-replicate", a.dp_replicate, "HSDP replicas (with --dp-shard)");
  auto* dp_shard_opt = app.add_option("--dp-shard", a.dp_shard, "FSDP shards (fully_shard over this many ranks)");
  app.add_option("--reshard-after-forward", a.reshard_after_forward,
                 "true | false | K (a divisor of --dp-shard); default: blocks reshard, the root not");
  app.add_flag("--offload", a.offload, "FSDP CPU offload of the sharded parameters, gradients, optimizer state");
  app.add_flag("--no-sync", a.no_sync, "with --grad-accum: reduce gradients on the last microbatch only");
  app.add_option("--prefetch", a.prefetch, "FSDP prefetch depth 0 | 1 | 2 (forward and backward)");
  app.add_option("--reduce-wire", a.reduce_wire, "bf16 | e5m2: what FSDP's gradient reductions move (summed in f32)");
  app.add_option("--tp", a.tp, "tensor-parallel ranks");
  fsdp_train::add_moe_options(app, a.moe);
  app.add_option("--layers", a.layers, "transformer blocks");
  app.add_option("--dim", a.dim, "model dim");
  app.add_option("--heads", a.heads, "attention heads");
  app.add_option("--vocab", a.vocab, "vocabulary size");
  app.add_option("--seq", a.seq, "sequence length");
  app.add_option("--batch", a.batch, "global batch per step (sequences)");
  app.add_option("--steps", a.steps, "optimizer steps");
  app.add_option("--lr", a.lr, "learning rate");
  app.add_option("--seed", a.seed, "seed of the initial weights and the data (0..2^64-1)")->check(program::kUint64);
  app.add_option("--mp", a.mp, "fp32 | bf16 | fp16 (with a loss scaler)");
  app.add_option("--inject-overflow", a.inject_overflow,
                 "--mp fp16: an inf in the last rank's gradient at this step (the scaler must skip it everywhere)");
  app.add_option("--all-gather", a.all_gather,
                 "fp8 | int8: all-gather the blocks' linear weights as fp8 e4m3 or int8 blocks (needs --mp bf16)");
  app.add_option("--qlora", a.qlora,
                 "RANK: QLoRA, LoRA adapters of this rank on the blocks' projections, the frozen base as NF4 (needs "
                 "--mp bf16)");
  app.add_option("--lora-alpha", a.lora_alpha, "LoRA alpha (scale alpha / rank; default 16)");
  app.add_option("--grad-accum", a.grad_accum, "microbatches per step");
  app.add_flag("--check-parity", a.check_parity,
               "also train on one rank and compare every loss and the final parameters");
  app.add_option("--dump-init", a.dump_init, "write the initial parameters to this safetensors file");
  app.add_option("--log-every", a.log_every, "progress line every N steps");
  app.add_option("--optimizer", a.optimizer, "adamw | sgd (momentum 0.9)");
  app.add_option("--weight-decay", a.weight_decay, "weight decay");
  app.add_option("--clip", a.clip, "gradient norm clipping (0: off; the norm is still checked to be finite)");
  app.add_option("--sequence-parallel", a.sequence_parallel,
                 "norms on sequence shards under --tp (true|false)");
  app.add_option("--threads", a.threads, "CPU threads per rank for matmul/attention (0: cores / ranks; at most 1024)");
  app.add_option("--save-dir", a.save_dir, "write checkpoints to DIR/step-NNNNNNNN (after the last step at least)");
  app.add_option("--save-every", a.save_every, "also checkpoint every N steps (0: only at the end)");
  app.add_flag("--async-save", a.async_save, "write checkpoints in the background while training continues");
  app.add_option("--resume-from", a.resume_from,
                 "continue from a checkpoint directory (any mesh; PyTorch HF safetensors directories too)");
  app.add_flag("--init-before-shard", a.init_before_shard,
               "FSDP: initialise the whole model, then shard it (default: shard the meta model, then initialise "
               "each rank's shards)");
  app.add_option("--init-from", a.init_from,
                 "load the initial weights (each rank its shards' bytes): model.safetensors, "
                 "model.safetensors.index.json or a checkpoint directory (ours, PyTorch's)");
  app.add_option("--trace", a.trace, "write a Chrome trace of the run to FILE (ui.perfetto.dev)");
  app.add_flag("--estimate", a.estimate, "print the estimated memory per rank as JSON and exit (no training)");
  app.add_option("--memory-limit", a.memory_limit,
                 "cap every allocation of each rank at BYTES; a run whose estimate exceeds it is refused (exit 3)")
      ->check(kPositiveInt64);
  app.add_flag("--activation-checkpointing", a.activation_checkpointing,
               "recompute every block's activations in backward instead of keeping them");
  app.add_flag("--log-implicit", a.log_implicit,
               "print every implicit redistribute of a DTensor op (rank 0, stderr)");
  program::add_timeout(app, a.timeout_ms);
  try {
    program::parse(app, argc, argv);  // --help: exit 0; a bad option: one line, exit 2
  } catch (const kernels::InvalidArgument&) {
    if (!mpi_requested(argc, argv)) throw;
    // Under mpirun every process parsed the same command line: rank 0 alone reports it, before
    // the closing barrier (after it the others' exits may end the job first).
    const std::exception_ptr error = std::current_exception();
    std::optional<collectives::MpiWorld> mpi;
    try {
      mpi.emplace(&argc, &argv, Milliseconds{program::kDefaultTimeoutMs});
    } catch (const kernels::Error&) {
    }
    if (!mpi) throw;
    return program::run_as_rank("fsdp-train", mpi->rank(), [&]() -> int { std::rethrow_exception(error); });
  }
  a.fsdp = dp_rep_opt->count() > 0 || dp_shard_opt->count() > 0;

  if (a.backend == "mpi") {
    // The closing barrier (MpiWorld's destructor) waits --timeout-ms for the other ranks; a
    // failure is printed before it.
    collectives::MpiWorld mpi(&argc, &argv, Milliseconds{a.timeout_ms});
    return program::run_as_rank("fsdp-train", mpi.rank(), [&] { return run_mpi_rank(a, mpi); });
  }
  validate(a);
  const int mesh_ranks = a.dp_replicate * a.dp_shard * a.tp * a.moe.ep;  // validated: at most kMaxLocalRanks
  const int world = a.world != 0 ? a.world : mesh_ranks;
  if (world != mesh_ranks)
    throw kernels::InvalidArgument(
        fmt::format("--world {} but the mesh (--dp-replicate {} --dp-shard {} --tp {}) has {} ranks", world,
                    a.dp_replicate, a.dp_shard, a.tp, mesh_ranks));
  const bool nccl = a.backend == "nccl";
  if (nccl) {
    if (!collectives::nccl_built())
      throw kernels::Unsupported("--backend nccl: this build has no NCCL (configure with CUDA)");
    if (kernels::cuda_device_count() < world)
      throw kernels::Unsupported(fmt::format("--backend nccl: {} ranks need {} GPUs, {} visible", world, world,
                                             kernels::cuda_device_count()));
  } else {
    check_model_fits(a, world, world);  // every rank is a thread of this process
  }
  const std::optional<fsdp::MemoryEstimate> est = estimate_run(a);
  if (a.estimate) return print_estimate(a, *est);
  if (est) check_memory_limit(a, *est);  // before any rank starts: nothing is allocated
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads = a.threads > 0 ? a.threads : std::max(1, hw / world);
  // --trace: the file is made before the ranks start (a path that cannot be written: exit 2).
  kernels::Tracer tracer;
  std::optional<kernels::File> trace_file;
  if (!a.trace.empty()) try {
      trace_file = kernels::File::create(a.trace);
    } catch (const kernels::InvalidArgument& e) {
      throw kernels::InvalidArgument(fmt::format("--trace {}: {}", a.trace, e.what()));
    }
  std::optional<RunResult> got;
  collectives::run_ranks(
      world,
      [&](Communicator& w) {
        as_local_rank(w.rank(), [&] {
          std::unique_ptr<Communicator> gpu;
          if (trace_file) w.set_tracer(&tracer);
          if (nccl) gpu = collectives::nccl_communicator(w, w.rank(), Milliseconds{a.timeout_ms});
          if (gpu && trace_file) gpu->set_tracer(&tracer);
          RunResult r = train(gpu ? *gpu : w, a, true, true, threads,
                              nccl ? kernels::Device::cuda(w.rank()) : kernels::Device{});
          if (w.rank() == 0) got = std::move(r);
        });
      },
      Milliseconds{a.timeout_ms});
  if (trace_file) kernels::write_chrome_trace(*trace_file, tracer.events());
  if (!a.check_parity) return finish(a, Outcome{std::move(got), "skipped", std::nullopt, est});
  Outcome o = check_parity(a, std::move(*got));
  o.estimate = est;
  return finish(a, o);
}

}  // namespace

int main(int argc, char** argv) {
  // Every exception leaves with its documented status and one line (program/main.h).
  return program::run("fsdp-train", [&] { return run(argc, argv); });
}
