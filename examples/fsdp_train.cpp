// fsdp-train: trains the small GPT (nn/transformer.h) on synthetic data with a learnable pattern,
// with FSDP over --dp-shard ranks, HSDP over --dp-replicate x --dp-shard, and tensor parallelism
// over --tp ranks (mesh (dp_replicate, dp_shard, tp), trivial dims left out), on any backend,
// and optionally checks it against the same training on one rank without parallelism.
//
//   fsdp-train --backend local --dp-shard 4 --check-parity
//   fsdp-train --backend local --dp-replicate 2 --dp-shard 2 --tp 2 --mp bf16 --check-parity
//   mpirun -np 4 fsdp-train --backend mpi --dp-shard 4 --check-parity
//   fsdp-train --moe-experts 8 --moe-top-k 2 --ep 4 --check-parity   (examples/fsdp_train_moe.h)
//   fsdp-train --moe-experts 4 --dp-replicate 2 --dp-shard 2 --ep 2 --ep-from-dp --check-parity
//     (--ep-from-dp: EP carved out of --dp-shard; the experts FSDP over dp_shard / ep on the mesh
//     (dp_replicate, dp_mod_ep, ep), the dense parameters over dp_shard, in one group per block)
//
// FSDP (fsdp::fully_shard; applied when --dp-shard or --dp-replicate is given): every
// transformer block is one group, the root (embeddings, final norm, head) another; the batch is
// split over the dp dims. --reshard-after-forward true|false|K (default: FSDP2's automatic,
// blocks reshard, the root not), --offload (sharded state on the CPU; on a GPU in pinned memory with
// copies on the copy stream, fsdp/offload.h, unless --no-pin-memory), --no-sync (with
// --grad-accum: gradients reduced on the last microbatch only), --prefetch 0|1|2 (implicit
// prefetch depth in forward and backward; default 1). --mp bf16 under FSDP is the
// MixedPrecisionPolicy (bf16 parameters, f32 reduction, f32 sharded master weights).
// --all-gather fp8|int8 (with --mp bf16) gathers the blocks' linear weights as fp8 / int8 codes
// (examples/fsdp_train_lowp.h); the one-rank reference computes with the same dequantised weights.
// --qlora RANK (with --mp bf16; --lora-alpha, default 16): QLoRA, LoRA adapters of that rank on
// every attention and MLP projection, everything else frozen, the frozen linear weights gathered
// as NF4 (fsdp/lowp.h); only the adapters get gradients and optimizer state. Under FSDP the frozen
// NF4 weights are stored as their codes and scales only (fsdp::quantize_frozen after init): the
// checkpoints hold them as NF4 entries, --check-parity compares them dequantised.
// --reduce-wire bf16|e5m2 (FSDP only): the gradient reductions move that dtype and sum it in f32
// (MixedPrecisionPolicy::reduce_wire; NOTE [wire dtype] in dtensor/exec/executor.h).
// --mp fp16: as bf16 with fp16 parameters and nn::GradScaler (a skipped step on every rank when
// any rank's gradient overflows; a line "  loss_scale S skipped_steps N" after each progress
// line); --inject-overflow K puts an inf into the last rank's gradient at step K.
//
// Output: one progress line per --log-every steps on rank 0 (the step's wall time in ms too),
//   step 3/30 loss 3.91234567 ms 6.21 tokens/s 41234 peak_bytes 1234567 param_bytes 123 grad_bytes 45
//   optim_bytes 90 buffer_bytes 67 all_gather_bytes 89 reduce_bytes 8192 fsdp_copy_bytes 0
// (rank 0's peaks: parameters = sharded plus unsharded, gradients = sharded, optimizer state,
// buffers = FSDP's reduce-scatter inputs and casts; the bytes rank 0's unshards sent this step;
// reduce_bytes: what the step's gradient reductions moved per rank, from their plans; 0 without
// FSDP; fsdp_copy_bytes: rank 0's bytes FSDP copied around its collectives this step, copy-in,
// copy-out and dtype casts, fsdp::GroupStats::copy_bytes)
// and, last, one JSON object:
//   {"steps":30,"first_loss":4.16,"last_loss":0.93,"parity":"ok","max_rel_loss_diff":2e-7,
//    "max_param_diff":3e-8,"tokens_per_s":41234,"peak_bytes":1234567,...,"all_gather_bytes":89,
//    "reduce_bytes":8192,"fsdp_copy_bytes":0}
// (reduce_bytes, fsdp_copy_bytes: the progress lines' averaged over the steps run; null without FSDP)
// --fsdp-layout padded|contiguous (default padded): fsdp::Layout; contiguous copies nothing in
// f32 (fsdp_copy_bytes 0) and only the dtype casts under --mp bf16 (fsdp/README.md).
// parity: "skipped" without --check-parity (then the two diffs are null); max_rel_loss_diff is the
// largest |loss - loss_ref| / |loss_ref| over the steps, max_param_diff the relative L2
// difference of all final parameters flattened together; limits in parity_limits() (1e-5 and
// 1e-5; bf16 / fp16 or a bf16 wire: 2e-2 and 5e-2; an e5m2 wire: 2^-3 and 2^-3).
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
#include "examples/fsdp_train_args.h"

namespace {

using namespace fsdp_train;

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

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{}", v) : "null"; }

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

// --check-parity's limits (loss, parameters). fp32 with exact reductions: 1e-5, only the order
// of sums differs. bf16 / fp16 compute, or a bf16 reduce wire (8 significant bits): 2e-2, 5e-2.
// An e5m2 reduce wire keeps 3 significant bits: every gradient piece a rank sends is rounded by
// up to 2^-3 relative (bf16: 2^-8), a deterministic error no scale removes (the per-sender
// power-of-two scale only keeps values in range). The limit is that unit roundoff, 2^-3, on both:
// over 30-100 steps of the dim-256 model (FSDP 2 / 3 / 4, HSDP 2x2, fp32 and bf16 compute) the
// largest differences were 6.7e-2 (losses) and 7.1e-2 (parameters), bench/RESULTS.md (W4).
std::pair<double, double> parity_limits(const Args& a) {
  if (a.reduce_wire == "e5m2") return {0.125, 0.125};
  if (a.mp != "fp32" || !a.reduce_wire.empty()) return {2e-2, 5e-2};
  return {1e-5, 1e-5};
}

// --check-parity: the same training on one rank without parallelism, compared with `got`.
Outcome check_parity(const Args& a, RunResult got) {
  Outcome o;
  const auto [loss_tol, param_tol] = parity_limits(a);
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
      "\"estimated_peak_bytes\":{},\"estimated_peak_block_bytes\":{},\"all_gather_bytes\":{},\"reduce_bytes\":{},"
      "\"fsdp_copy_bytes\":{}}}\n",
      a.steps, json_number(got.losses.front()), json_number(got.losses.back()), o.parity,
      o.cmp ? json_number(o.cmp->max_rel_loss_diff) : "null", o.cmp ? json_number(o.cmp->max_param_diff) : "null",
      json_number(std::round(got.tokens_per_s)), got.peak_bytes, got.peak_block_bytes,
      o.estimate ? std::to_string(o.estimate->peak) : "null", o.estimate ? std::to_string(o.estimate->peak_blocks) : "null",
      got.all_gather_bytes ? std::to_string(*got.all_gather_bytes) : "null",
      got.reduce_bytes ? std::to_string(*got.reduce_bytes) : "null",
      got.copy_bytes ? std::to_string(*got.copy_bytes) : "null");
  std::fflush(stdout);
  return o.parity == "fail" ? program::kMismatch : program::kOk;
}

// One process of an mpi job (under program::run_as_rank: invalid input is printed by rank 0
// only, any other failure at once by the rank it happened on).
int run_mpi_rank(const Args& a, collectives::MpiWorld& mpi) {
  validate(a);
  // validated: no overflow
  const int64_t ranks = int64_t{a.dp_replicate} * a.dp_shard * a.tp * fsdp_train::ep_mesh_ranks(a.moe);
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
  app.add_flag("--no-pin-memory", a.no_pin_memory,
               "with --offload: ordinary host memory and synchronous copies (default on a GPU: pinned, copy stream)");
  app.add_flag("--no-sync", a.no_sync, "with --grad-accum: reduce gradients on the last microbatch only");
  app.add_option("--fsdp-layout", a.fsdp_layout,
                 "padded | contiguous: FSDP's flat buffers (contiguous: parameter-major, RaggedShard over dp, no "
                 "copy-in / copy-out; FSDP on --dp-shard only)");
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
  // validated: at most kMaxLocalRanks
  const int mesh_ranks = a.dp_replicate * a.dp_shard * a.tp * fsdp_train::ep_mesh_ranks(a.moe);
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
