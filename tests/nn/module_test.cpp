// Module mechanics: names, hooks, per-call contexts, checkpointing, meta initialisation, caller
// gradient buffers, and an FSDP-style parameter swap through the four hook points.
#include <catch2/catch.hpp>

#include <atomic>

#include "nn/layers.h"
#include "nn/memory.h"
#include "nn/transformer.h"
#include "nn_support.h"
#include "support/checks.h"

using namespace nn;
using namespace nn_test;

namespace {

std::vector<std::string> names(const Module& m) {
  std::vector<std::string> out;
  for (const auto& [n, p] : m.named_parameters()) out.push_back(n);
  return out;
}

GPTConfig tiny() {
  GPTConfig c;
  c.vocab = 11;
  c.dim = 8;
  c.heads = 2;
  c.layers = 2;
  c.max_seq = 6;
  return c;
}

}  // namespace

TEST_CASE("module: fully qualified names, tying and transparent checkpoint wrappers", "[nn][module]") {
  on_mesh({1}, [](std::shared_ptr<MeshComms> comms, Communicator&) {
    GPTConfig cfg = tiny();
    cfg.layers = 1;
    GPT model(ModuleOptions{comms}, cfg);
    const std::vector<std::string> want = {"tok_emb.weight",
                                           "pos_emb.weight",
                                           "blocks.0.ln1.weight",
                                           "blocks.0.ln1.bias",
                                           "blocks.0.attn.wq.weight",
                                           "blocks.0.attn.wk.weight",
                                           "blocks.0.attn.wv.weight",
                                           "blocks.0.attn.wo.weight",
                                           "blocks.0.ln2.weight",
                                           "blocks.0.ln2.bias",
                                           "blocks.0.mlp.fc1.weight",
                                           "blocks.0.mlp.fc2.weight",
                                           "ln_f.weight",
                                           "ln_f.bias",
                                           "lm_head.weight"};
    CHECK(names(model) == want);
    CHECK(model.module("blocks.0.attn").type() == "CausalSelfAttention");
    CHECK(&model.parameter("lm_head.weight") == &model.lm_head().weight());
    CHECK_THROWS_WITH(model.module("blocks.7"), Catch::Contains("no submodule named 'blocks.7'"));
    // Tied: one parameter, listed once under its first name.
    cfg.tie_embeddings = true;
    cfg.checkpoint_blocks = true;
    GPT tied(ModuleOptions{comms}, cfg);
    std::vector<std::string> tied_want = want;
    tied_want.pop_back();
    CHECK(names(tied) == tied_want);  // checkpoint wrappers add no path component
    CHECK(&tied.lm_head().weight() == &tied.tok_emb().weight());
    CHECK(tied.module("blocks.0").type() == "TransformerBlock");
  });
}

TEST_CASE("module: hooks run in order and may replace tensors; ctx is released by backward", "[nn][module]") {
  testing_support::Checks checks;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    Linear l(ModuleOptions{comms, DType::kF64}, 3, 2);
    materialize(l, 1);
    std::vector<std::string> log;
    l.register_forward_pre_hook([&](Module& m, Ctx&, DTensor& x) {
      log.push_back("pre_forward " + m.type());
      x = dtensor::ops::scale(x, 2.0);  // the module sees 2x
    });
    l.register_forward_hook([&](Module&, Ctx&, DTensor&) { log.push_back("post_forward"); });
    const int removed = l.register_forward_hook([&](Module&, Ctx&, DTensor&) { log.push_back("removed"); });
    l.register_backward_pre_hook([&](Module&, Ctx& ctx, DTensor&) {
      log.push_back(ctx.recomputing() ? "recomputing?" : "pre_backward");
    });
    l.register_backward_hook([&](Module&, Ctx&, std::optional<DTensor>& dx) {
      log.push_back("post_backward");
      *dx = dtensor::ops::scale(*dx, 2.0);  // the chain rule of the pre-forward scaling
    });
    checks.check(l.remove_hook(removed) && !l.remove_hook(removed), "remove_hook");
    DTensor x = replicated(values({4, 3}, 1), comms);
    Ctx ctx;
    DTensor y = l.forward(ctx, x);
    checks.check(!ctx.empty(), "forward saved nothing");
    Ctx plain;
    Linear& ref = l;
    (void)ref;
    DTensor dx = *l.backward(ctx, replicated(values({4, 2}, 2), comms));
    checks.check(ctx.empty(), "backward did not release the context");
    checks.check(log == std::vector<std::string>{"pre_forward Linear", "post_forward", "pre_backward",
                                                 "post_backward"},
                 "hook order");
    // y == (2x) W^T: the hook replaced the input.
    const std::vector<double> xv = x.full_tensor().to_vector(),
                              w = l.weight().data().full_tensor().to_vector(),
                              b = l.bias()->data().full_tensor().to_vector(),
                              yv = y.full_tensor().to_vector();
    double want = b[1];
    for (int k = 0; k < 3; ++k) want += 2 * xv[3 + k] * w[3 + k];
    checks.check(std::abs(yv[3] - want) < 1e-12, "the pre-forward hook's input was used");
  });
  checks.report();
}

TEST_CASE("module: several microbatches in flight and checkpointing keep nothing in the module",
          "[nn][module]") {
  testing_support::Checks checks;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    GPTConfig cfg = tiny();
    auto block = std::make_shared<TransformerBlock>(ModuleOptions{comms, DType::kF64}, cfg);
    materialize(*block, 1);
    DTensor x1 = replicated(values({2, 5, 8}, 1), comms), x2 = replicated(values({2, 5, 8}, 2), comms);
    DTensor r = replicated(values({2, 5, 8}, 3), comms);
    // Two forwards, then the backwards in reverse order: gradients add up to the sum of the two
    // separate runs.
    Ctx c1, c2;
    block->forward(c1, x1);
    block->forward(c2, x2);
    DTensor d2 = *block->backward(c2, r);
    DTensor d1 = *block->backward(c1, r);
    std::vector<Tensor> both;
    for (auto& [n, p] : block->named_parameters()) both.push_back(p->grad()->full_tensor().clone());
    std::vector<Tensor> sep(both.size());
    for (const DTensor* x : {&x1, &x2}) {
      block->zero_grad();
      Ctx c;
      block->forward(c, *x);
      block->backward(c, r);
      size_t i = 0;
      for (auto& [n, p] : block->named_parameters()) {
        Tensor g = p->grad()->full_tensor();
        sep[i] = sep[i].defined() ? kernels::add(sep[i], g) : g.clone();
        ++i;
      }
    }
    for (size_t i = 0; i < both.size(); ++i)
      checks.check(max_abs_diff(both[i], sep[i]) < 1e-12,
                   fmt::format("interleaved microbatches: parameter {}", i));
    // Checkpoint: after forward only the input is kept; the recompute runs the forward hooks with
    // ctx.recomputing().
    Checkpoint ck(block);
    int recomputes = 0, forwards = 0;
    block->register_forward_pre_hook([&](Module&, Ctx& ctx, DTensor&) {
      ++forwards;
      if (ctx.recomputing()) ++recomputes;
    });
    Ctx c;
    DTensor y = ck.forward(c, x1);
    checks.check(c.tensors.size() == 1 && !c.has_child("inner"), "checkpoint kept activations");
    block->zero_grad();
    DTensor dx = *ck.backward(c, r);
    checks.check(forwards == 2 && recomputes == 1,
                 fmt::format("{} forwards, {} recomputes", forwards, recomputes));
    checks.check(max_abs_diff(dx.full_tensor(), d1.full_tensor()) < 1e-12, "checkpointed input gradient");
    checks.check(c.empty(), "checkpoint context released");
  });
  checks.report();
}

TEST_CASE("module: meta parameters materialise sharded, identical to the full initialisation",
          "[nn][module][init]") {
  // The full values on one rank.
  std::vector<std::pair<std::string, Tensor>> full;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    GPT model(ModuleOptions{comms}, tiny());
    CHECK(model.parameter("tok_emb.weight").is_meta());
    CHECK_THROWS_WITH(model.parameter("tok_emb.weight").data(), Catch::Contains("still meta"));
    materialize(model, 42);
    for (auto& [n, p] : model.named_parameters()) full.emplace_back(n, p->data().full_tensor().clone());
  });
  // The same seed under several shardings: every shard holds its slice of the same values.
  testing_support::Checks checks;
  // _S: a shard of several index runs (each rank's values are found through them, not a list).
  int layouts = 0;
  for (const char* pl : {"S(0)", "S(1)", "R", "_S(0,2)", "_S(1,2)"}) {
    ++layouts;
    on_mesh({3}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
      GPT model(ModuleOptions{comms}, tiny());
      size_t i = 0;
      for (auto& [n, p] : model.named_parameters()) {
        std::string placement = pl;
        if (p->shape().size() == 1 && placement == "S(1)") placement = "S(0)";
        if (p->shape().size() == 1 && placement == "_S(1,2)") placement = "_S(0,2)";
        p->set_placements(dtensor::parse_placements(placement));
        checks.check(p->is_meta(), n + " materialised by set_placements");
        ++i;
      }
      materialize(model, 42);
      i = 0;
      for (auto& [n, p] : model.named_parameters()) {
        checks.check(full[i].first == n, "names differ");
        checks.check(max_abs_diff(p->data().full_tensor(), full[i].second) == 0,
                     fmt::format("{} under {} differs from the full initialisation", n, pl));
        ++i;
      }
    });
  }
  checks.report();
  CHECK(layouts == 5);
  // Init values: normal(0, 0.02) has about the right spread; a different seed differs.
  const std::vector<double> v = full[0].second.to_vector();
  double s2 = 0;
  for (double x : v) s2 += x * x;
  CHECK(std::sqrt(s2 / v.size()) == Approx(0.02).epsilon(0.3));
  CHECK(Init::normal(0, 1).value(1, "a", 5) != Init::normal(0, 1).value(2, "a", 5));
  CHECK(Init::normal(0, 1).value(1, "a", 5) != Init::normal(0, 1).value(1, "b", 5));
}

TEST_CASE("module: a parameter too large for the allocator is refused naming the bytes, before anything is built",
          "[nn][module][init]") {
  // [48, 3037000500] f32 split over 2 ranks: about 291552048000 bytes per shard. Listing the
  // held indices of dim 1 alone would take 12 GB per rank; the check comes first.
  testing_support::Checks checks;
  kernels::CachingAllocator::Options o;
  o.limit_bytes = size_t{1} << 20;
  auto allocator = std::make_shared<kernels::CachingAllocator>(o);
  std::atomic<int> ran{0};
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2}), world,
                                             std::vector<std::vector<int>>{}, allocator);
    for (const char* pl : {"S(1)", "_S(1,4)"}) {
      Parameter p(comms, Dims{48, 3037000500}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements(pl));
      const Dims local = dtensor::compute_layout({48, 3037000500}, {2}, p.placements(), {world.rank()}).local_shape;
      checks.throws<kernels::ResourceError>([&] { p.materialize(1, "tok_emb.weight"); },
                                            fmt::format("needs {} bytes", local.product() * 4),
                                            fmt::format("{}: a shard past the allocator's limit", pl));
      checks.check(p.is_meta(), "still meta after the refusal");
    }
    // Within the limit it materialises.
    Parameter small(comms, Dims{48, 64}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements("S(1)"));
    small.materialize(1, "small");
    checks.check(small.data().to_local().numel() == 48 * 32, "a small shard materialises");
    ++ran;
  });
  checks.report();
  CHECK(ran == 2);
}

TEST_CASE("module: gradients written into caller buffers; an FSDP-style swap through the hooks",
          "[nn][module]") {
  // Reference gradients on one rank.
  std::vector<Tensor> want;
  Tensor xfull = values({6, 3, 8}, 1), rfull = values({6, 3, 8}, 2);
  auto build = [](std::shared_ptr<MeshComms> comms) {
    GPTConfig cfg = tiny();
    auto b = std::make_shared<TransformerBlock>(ModuleOptions{comms, DType::kF64}, cfg);
    materialize(*b, 3);
    return b;
  };
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    auto b = build(comms);
    Ctx c;
    b->forward(c, replicated(xfull, comms));
    b->backward(c, replicated(rfull, comms));
    for (auto& [n, p] : b->named_parameters()) want.push_back(p->grad()->full_tensor().clone());
  });
  testing_support::Checks checks;
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    auto b = build(comms);
    // Data parallel over 2 ranks: the batch is sharded, parameters live sharded S(0) outside
    // forward/backward (FSDP's picture) and are gathered by the hooks.
    for (auto& [n, p] : b->named_parameters()) p->set_placements(dtensor::parse_placements("S(0)"));
    std::vector<DTensor> sharded;
    for (auto& [n, p] : b->named_parameters()) sharded.push_back(p->data());
    auto gather = [&](Module& m, Ctx&) {
      size_t i = 0;
      for (auto& [n, p] : m.named_parameters())
        p->set_data(sharded[i++].redistribute(dtensor::parse_placements("R")));
    };
    auto reshard = [&](Module& m) {
      size_t i = 0;
      for (auto& [n, p] : m.named_parameters()) p->set_data(sharded[i++]);
    };
    b->register_forward_pre_hook([&](Module& m, Ctx& c, DTensor&) { gather(m, c); });
    b->register_forward_hook([&](Module& m, Ctx&, DTensor&) { reshard(m); });
    b->register_backward_pre_hook([&](Module& m, Ctx& c, DTensor&) { gather(m, c); });
    // Gradients go to caller buffers (P(sum): each rank's part of the batch), then are
    // reduce-scattered to the sharded layout, as FSDP's post-backward does.
    std::vector<std::optional<DTensor>> bufs;
    for (auto& [n, p] : b->named_parameters()) {
      DTensor buf(
          comms,
          dtensor::make_spec(p->data().spec().mesh, dtensor::parse_placements("P"), p->shape(), DType::kF64),
          Tensor::full(p->shape(), 123.0, DType::kF64));  // garbage: overwritten, not added to
      bufs.emplace_back(buf);
      p->set_grad_buffer(buf, /*accumulate=*/false);
    }
    b->register_backward_hook([&](Module& m, Ctx&, std::optional<DTensor>&) {
      size_t i = 0;
      for (auto& [n, p] : m.named_parameters()) {
        checks.check(p->grad()->to_local().data_ptr() == bufs[i]->to_local().data_ptr(),
                     n + ": buffer replaced");
        p->grad() = p->grad()->redistribute(dtensor::parse_placements("S(0)"));
        p->set_data(sharded[i++]);
      }
    });
    Ctx c;
    b->forward(c, place(xfull, comms, "S(0)"));
    for (auto& [n, p] : b->named_parameters())
      checks.check(p->placements() == dtensor::parse_placements("S(0)"), n + " not resharded after forward");
    b->backward(c, place(rfull, comms, "S(0)"));
    size_t i = 0;
    for (auto& [n, p] : b->named_parameters()) {
      checks.check(to_string(p->grad()->placements()) == "S(0)", n + " gradient placements");
      checks.check(max_abs_diff(p->grad()->full_tensor(), want[i]) < 1e-12,
                   n + ": gradient differs from one rank's");
      ++i;
    }
  });
  checks.report();
}

TEST_CASE("module: a lazy gradient buffer is made at the first gradient write, once", "[nn][module]") {
  testing_support::Checks checks;
  int ran = 0;
  on_mesh({1}, [&](std::shared_ptr<MeshComms> comms, Communicator&) {
    Parameter p(comms, Dims{2, 3}, DType::kF32, Init::ones());
    p.materialize(1, "w");
    const auto spec = dtensor::make_spec(p.data().spec().mesh, dtensor::parse_placements("P"), p.shape(), DType::kF32);
    Tensor storage = Tensor::full({2, 3}, 7.0, DType::kF32);
    int made = 0;
    p.set_grad_buffer_lazy([&] {
      ++made;
      return DTensor(comms, spec, storage);
    });
    checks.check(!p.grad() && p.grad_unwritten() && made == 0, "armed: no buffer, unwritten, nothing made");
    const dtensor::ops::GradSink first = p.grad_sink();
    checks.check(made == 1 && p.grad() && p.grad()->to_local().data_ptr() == storage.data_ptr(), "made at the first write");
    checks.check(!first.accumulate && first.into == &p.grad(), "the first write goes over the buffer");
    const dtensor::ops::GradSink second = p.grad_sink();
    checks.check(made == 1 && second.accumulate, "later writes add into the same buffer");
    // zero_grad drops an armed maker unused; a maker of the wrong shape is refused at the write.
    p.set_grad_buffer_lazy([&] {
      ++made;
      return DTensor(comms, spec, storage);
    });
    p.zero_grad();
    const dtensor::ops::GradSink after = p.grad_sink();
    checks.check(made == 1 && !p.grad() && after.accumulate, "zero_grad dropped the maker");
    const auto wrong = dtensor::make_spec(p.data().spec().mesh, dtensor::parse_placements("P"), Dims{3, 2}, DType::kF32);
    p.set_grad_buffer_lazy([&] { return DTensor(comms, wrong, Tensor::zeros({3, 2}, DType::kF32)); });
    checks.throws<kernels::InvalidArgument>([&] { p.grad_sink(); }, "a buffer of shape [3,2] for a parameter of shape [2,3]",
                                            "wrong shape");
    ++ran;
  });
  checks.report();
  CHECK(ran == 1);
}

TEST_CASE("module: a materialize target receives the shard in place; to_empty allocates without values",
          "[nn][module][init]") {
  testing_support::Checks checks;
  int ran = 0;
  on_mesh({2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
    // The reference: a plain materialisation under S(1).
    Parameter plain(comms, Dims{5, 6}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements("S(1)"));
    plain.materialize(7, "w");
    // The same parameter writing into a caller's buffer (a strided view, as FSDP's Shard(1) slot).
    Tensor buffer = Tensor::zeros({5, 8}, DType::kF32);
    Tensor view = buffer.narrow(1, 0, 3);
    Parameter p(comms, Dims{5, 6}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements("S(1)"));
    p.set_materialize_target([view] { return view; });
    p.materialize(7, "w");
    checks.check(p.data().to_local().shares_storage_with(buffer), "not written into the target");
    checks.check(max_abs_diff(p.data().to_local(), plain.data().to_local()) == 0, "target values differ");
    checks.check(buffer.narrow(1, 3, 5).to_vector() == std::vector<double>(25, 0.0), "wrote outside the target");
    // A target of the wrong shape is refused naming the parameter and both shapes.
    Parameter q(comms, Dims{5, 6}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements("S(0)"));
    q.set_materialize_target([] { return Tensor::zeros({1, 6}, DType::kF32); });
    checks.throws<kernels::InvalidArgument>([&] { q.materialize(7, "blocks.0.w"); },
                                            "'blocks.0.w' (f32 [5,6] under S(0)): the materialize target is f32 [1,6]",
                                            "wrong target shape");
    // to_empty: the shard from the mesh's allocator, no values, once.
    auto mem = std::make_shared<TrackingAllocator>();
    auto counted = std::make_shared<MeshComms>(comms->mesh(), world, std::vector<std::vector<int>>{}, mem);
    Parameter e(counted, Dims{4, 6}, DType::kF32, Init::normal(0, 1), dtensor::parse_placements("S(0)"));
    e.to_empty("e");
    checks.check(!e.is_meta() && e.data().to_local().numel() == 12 && mem->live_bytes() == 48, "to_empty");
    e.to_empty("e");
    checks.check(mem->peak_bytes() == 48, "to_empty twice allocated again");
    if (world.rank() == 0) ++ran;
  });
  checks.report();
  CHECK(ran == 1);
}
