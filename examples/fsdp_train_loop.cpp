// fsdp-train's training loop: the mesh, the model sharded and initialised, the steps, the
// checkpoints (examples/fsdp_train.cpp documents the flags and the output).
#include "examples/fsdp_train_args.h"
#include "fsdp/lowp_checkpoint.h"

namespace fsdp_train {

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
  // --ep-from-dp: the experts' mesh, dp_shard unflattened into (dp_mod_ep, ep) at creation.
  const bool carved = use_fsdp && a.moe.ep_from_dp;
  const dtensor::Unflattening ep_split{plan.shard_dim, Dims{a.dp_shard / a.moe.ep, a.moe.ep}, {"dp_mod_ep", "ep"}};
  if (carved) unflatten.push_back(ep_split);
  auto comms = std::make_shared<dtensor::MeshComms>(mesh, world, std::vector<std::vector<int>>{}, memory, unflatten);
  const std::shared_ptr<const dtensor::MeshComms> ep_comms =
      carved ? comms->unflatten(ep_split.mesh_dim, ep_split.sizes, ep_split.names) : nullptr;
  const nn::GPTConfig cfg = model_config(a);
  // Built on meta (shapes, dtypes, placements: nothing allocated), parallelised, and under FSDP
  // sharded before it is initialised (or loaded): every rank only ever allocates its shards.
  nn::GPT model(nn::ModuleOptions{comms, DType::kF32, device}, cfg);
  if (a.qlora > 0) nn::add_lora(model, a.qlora, a.lora_alpha);  // on meta, before sharding
  if (tp > 1) nn::parallelize_module(model, plan.tp_dim, nn::gpt_tensor_parallel_plan(cfg, a.sequence_parallel, true));
  if (plan.ep_dim >= 0) fsdp_train::set_expert_parallel(model, plan.ep_dim);
  if (carved) fsdp_train::set_carved_expert_parallel(model, ep_comms, plan.shard_dim + 1);
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
  // Each quantised weight's extension: --qlora's frozen NF4 weights live in theirs after
  // fsdp::quantize_frozen (the parameter is meta between unshards).
  std::map<const nn::Parameter*, std::shared_ptr<fsdp::AllGatherExtension>> extensions;
  auto stored_ext = [&](const nn::Parameter& p) -> const fsdp::AllGatherExtension& {
    const auto it = extensions.find(&p);
    if (it == extensions.end()) throw kernels::InternalError("fsdp-train: a released parameter without its extension");
    return *it->second;
  };
  auto buffer_mem = std::make_shared<nn::TrackingAllocator>(cache, total_mem);
  fsdp::FSDPModule* root = nullptr;
  std::vector<fsdp::FSDPModule*> groups;  // every group (blocks, then the root)
  auto reduce_total = [&] {
    int64_t n = 0;
    for (const fsdp::FSDPModule* g : groups) n += g->stats().reduce_bytes;
    return n;
  };
  auto copy_total = [&] {
    int64_t n = 0;
    for (const fsdp::FSDPModule* g : groups) n += g->stats().copy_bytes;
    return n;
  };
  if (use_fsdp) {
    fsdp::FullyShardOptions o;
    o.layout = a.fsdp_layout == "contiguous" ? fsdp::Layout::kContiguous : fsdp::Layout::kPadded;
    if (a.reshard_after_forward == "true") o.reshard_after_forward = fsdp::ReshardAfterForward::yes();
    else if (a.reshard_after_forward == "false") o.reshard_after_forward = fsdp::ReshardAfterForward::no();
    else if (reshard_k > 0) o.reshard_after_forward = fsdp::ReshardAfterForward::to(reshard_k);
    if (bf16) {
      o.mp_policy.param_dtype = low_dtype;
      o.mp_policy.reduce_dtype = DType::kF32;
    }
    o.mp_policy.reduce_wire = reduce_wire(a);
    o.offload_policy.offload_to_cpu = a.offload;
    o.offload_policy.pin_memory = !a.no_pin_memory;
    o.unsharded_allocator = unsharded_mem;
    o.buffer_allocator = buffer_mem;
    std::vector<fsdp::FSDPModule*> blocks;
    if (quant)
      o.all_gather_extension_fn = [fn = fsdp_train::extension_fn(*quant), &extensions](const std::string& n,
                                                                                       const nn::Parameter& p) {
        auto e = fn(n, p);
        if (e) extensions[&p] = e;
        return e;
      };
    for (const auto& [name, block] : model.blocks().children()) {
      fsdp::FullyShardOptions bo = o;
      if (plan.ep_dim >= 0) bo.ignored_params = fsdp_train::expert_parameters(*block);
      if (carved)  // the experts: FSDP over dp_mod_ep (and HSDP's dp_replicate) on their own mesh
        bo.mesh_fn = [ep_comms, rep = plan.rep_dim, shard = plan.shard_dim](
                         const std::string&, const nn::Parameter& p) -> std::optional<fsdp::ParamMesh> {
          if (p.comms() != ep_comms) return std::nullopt;
          return fsdp::ParamMesh{
              ep_comms, fsdp::DataParallelMeshDims{rep >= 0 ? std::optional<int>(rep) : std::nullopt, shard}};
        };
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
  // --qlora: the frozen base quantised once (collective) and kept as NF4 codes only.
  if (use_fsdp && a.qlora > 0) fsdp::quantize_frozen(model);

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
    for (const auto& [name, p] : master)
      if (p->is_meta()) sd.merge(fsdp::stored_nf4_state_dict(name, stored_ext(*p)));  // codes + scales
      else sd.tensors.emplace_back(name, p->data());
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
  for (const auto& [name, p] : master)
    param_bytes += p->is_meta() ? fsdp::stored_nf4(stored_ext(*p))->bytes()
                                : static_cast<int64_t>(p->data().to_local().nbytes());
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
  const int64_t copy_start = copy_total();
  for (int step = first_step; step < a.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t ag_bytes_before = fsdp_train::all_gather_bytes(groups);
    const int64_t reduce_before = reduce_total();
    const int64_t copy_before = copy_total();
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
      // The logits die with the loss's forward (it keeps their gradient, not them), as in PyTorch.
      const DTensor loss = loss_fn.forward(lctx, model.forward(ctx, ids), targets);
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
      if (a.moe.experts > 0) fsdp_train::set_moe_aux_grad_scale(model, seed);
      // Taken over by backward: the logits' gradient dies once lm_head's backward read it.
      model.backward(ctx, loss_fn.backward(lctx, as_dtensor(Tensor::full({}, seed, DType::kF64))));
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
          "optim_bytes {} buffer_bytes {} all_gather_bytes {} reduce_bytes {} fsdp_copy_bytes {}{}\n",
          step + 1, a.steps, step_loss, seconds * 1e3, static_cast<double>(a.batch * a.seq) / seconds,
          total_mem->peak_bytes(), param_bytes + unsharded_mem->peak_bytes(), grad_bytes, optim_bytes, buffer_mem->peak_bytes(),
          fsdp_train::all_gather_bytes(groups) - ag_bytes_before, reduce_total() - reduce_before,
          copy_total() - copy_before,
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
    result.copy_bytes = (copy_total() - copy_start) / static_cast<int64_t>(result.losses.size());
  }
  result.tokens_per_s = med > 0 ? static_cast<double>(a.batch * a.seq) / med : 0;
  // The training's peak, before the full parameters are gathered for the parity check.
  const int64_t training_peak = total_mem->peak_bytes();
  const int64_t training_peak_blocks = static_cast<int64_t>(cache->stats().peak_in_use_bytes);
  // --qlora: a frozen NF4 weight is reported as its dequantised value (the FSDP runs store only
  // the codes; one rank fake-quantises its master the same way, bit for bit).
  for (const auto& [name, p] : master) {
    Tensor full = (p->is_meta() ? fsdp::stored_nf4_dequantize(stored_ext(*p), DType::kF32) : p->data())
                      .full_tensor()
                      .to(kernels::Device{});
    if (a.qlora > 0 && !p->is_meta() && !p->requires_grad && fsdp_train::quantised_weight(name, *p))
      full = fsdp::fake_quantize(full, fsdp_train::kQloraBase, DType::kF32);
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

}  // namespace fsdp_train
