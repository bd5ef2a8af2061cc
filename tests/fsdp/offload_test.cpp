// Offload that overlaps (fsdp/offload.h), on the CPU: the rules of NOTE [offload ordering] over a
// deferred copy engine, a fake whose copies run only when something waits for them (the compute
// stream, device-side, or the host) and whose destinations hold NaN until then. A copy that the
// runtime forgot to wait for leaves NaN where the all-gather or the optimizer reads, so FSDP
// training over it equals training without offload only if every copy is waited on in time.
// Both layouts; the contiguous one (Layout::kContiguous) copies one flat shard in per unshard and
// one flat sharded gradient out per reduce-scatter, and its sharded parameters view the host
// buffer the copy-in reads (the optimizer steps them there).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "fsdp/offload.h"
#include "kernels/error.h"
#include "support/checks.h"
#include "offload_train.h"

namespace {

using kernels::DType;
using kernels::Tensor;
using Ticket = fsdp::CopyEngine::Ticket;

class DeferredEngine final : public fsdp::CopyEngine {
 public:
  Ticket copy(const Tensor& dst, const Tensor& src) override {
    std::lock_guard lk(mu_);
    if (!(dst.shape() == src.shape()) || dst.dtype() != src.dtype()) throw kernels::InvalidArgument("fake: mismatch");
    Tensor d = dst;
    d.fill_(std::numeric_limits<double>::quiet_NaN());  // what a reader sees before the copy runs
    copies_[next_] = {dst, src, false, phase};
    history_.push_back({dst, src});
    ++issued;
    return next_++;
  }
  void compute_wait(Ticket t) override {
    std::lock_guard lk(mu_);
    if (at(t).phase < phase) ++waited_later;
    run(t);
    ++compute_waits;
  }
  void host_wait(Ticket t) override {
    std::lock_guard lk(mu_);
    run(t);
    ++host_waits;
  }
  bool done(Ticket t) override {
    std::lock_guard lk(mu_);
    return at(t).ran;
  }
  void release(Ticket t) noexcept override {
    std::lock_guard lk(mu_);
    if (copies_.erase(t) == 0) ++bad_releases;
  }
  std::shared_ptr<kernels::Allocator> host_allocator() override { return nullptr; }
  size_t live() {
    std::lock_guard lk(mu_);
    return copies_.size();
  }
  // The copies issued so far whose source (destination) shares t's storage: with offload, a
  // sharded parameter views the buffer a copy-in reads, a sharded gradient the one a copy-out
  // writes. (The history keeps every buffer alive, so no storage is reused under these checks.)
  int64_t copies_from(const Tensor& t) {
    std::lock_guard lk(mu_);
    return std::count_if(history_.begin(), history_.end(), [&](const auto& c) { return c.second.shares_storage_with(t); });
  }
  int64_t copies_to(const Tensor& t) {
    std::lock_guard lk(mu_);
    return std::count_if(history_.begin(), history_.end(), [&](const auto& c) { return c.first.shares_storage_with(t); });
  }
  int64_t issued = 0, compute_waits = 0, host_waits = 0, bad_releases = 0, unknown = 0;
  // Advanced by a forward pre-hook of every module (after FSDP's): a copy-in waited on in a later
  // phase than it was issued was issued ahead, overlapping a module's compute.
  int64_t phase = 0, waited_later = 0;

 private:
  struct Copy {
    Tensor dst, src;
    bool ran = false;
    int64_t phase = 0;
  };
  Copy& at(Ticket t) {
    auto it = copies_.find(t);
    if (it == copies_.end()) {
      ++unknown;
      throw kernels::InternalError("fake: unknown ticket");
    }
    return it->second;
  }
  void run(Ticket t) {
    Copy& c = at(t);
    if (c.ran) return;
    Tensor d = c.dst;
    d.copy_(c.src);
    c.ran = true;
  }
  std::mutex mu_;
  std::map<Ticket, Copy> copies_;
  std::vector<std::pair<Tensor, Tensor>> history_;  // (dst, src) of every copy issued
  Ticket next_ = 1;
};

Tensor iota(int64_t n, double base) {
  Tensor t = Tensor::empty({n}, DType::kF32);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(base + static_cast<double>(i));
  return t;
}
bool equals_iota(const Tensor& t, double base) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.data<float>()[i] != static_cast<float>(base + static_cast<double>(i))) return false;
  return true;
}

}  // namespace

TEST_CASE("fsdp offload: a copy-in is read only after the compute stream waits for it", "[fsdp][offload]") {
  auto engine = std::make_shared<DeferredEngine>();
  fsdp::detail::OffloadCopies copies(engine);
  const Tensor host = iota(64, 3);
  const Tensor dev = Tensor::empty({64}, DType::kF32);
  CHECK_THROWS_AS(copies.take_copy_in(), kernels::InternalError);  // nothing copied in
  copies.copy_in(dev, host);
  CHECK(copies.has_copy_in());
  CHECK(std::isnan(dev.data<float>()[5]));  // queued, not run
  CHECK_THROWS_AS(copies.copy_in(dev, host), kernels::InternalError);  // one pending per group
  CHECK(engine->compute_waits == 0);
  const Tensor got = copies.take_copy_in();
  CHECK(engine->compute_waits == 1);
  CHECK(got.data_ptr() == dev.data_ptr());
  CHECK(equals_iota(got, 3));
  CHECK(!copies.has_copy_in());
  CHECK(copies.stats().copies_in == 1);
  // Done copies are released at the next copy (their buffers with them).
  CHECK(copies.stats().in_flight == 1);
  copies.copy_out(Tensor::empty({64}, DType::kF32), iota(64, 0));
  CHECK(copies.stats().in_flight == 1);
  copies.drain();
  CHECK(copies.stats().in_flight == 0);
  CHECK(engine->live() == 0);
  CHECK(engine->bad_releases == 0);
}

TEST_CASE("fsdp offload: a copy-out is visible to the host only after drain", "[fsdp][offload]") {
  auto engine = std::make_shared<DeferredEngine>();
  fsdp::detail::OffloadCopies copies(engine);
  Tensor grad = Tensor::empty({32}, DType::kF32);
  grad.fill_(0.0);
  copies.copy_out(grad, iota(32, 100));  // the source is held by `copies`
  CHECK(std::isnan(grad.data<float>()[0]));
  CHECK(copies.stats().in_flight == 1);
  copies.drain();
  CHECK(engine->host_waits == 1);
  CHECK(equals_iota(grad, 100));
  CHECK(copies.stats().in_flight == 0);
  CHECK(engine->live() == 0);
}

TEST_CASE("fsdp offload: a copy-in issued ahead and never used is dropped, waited on and released", "[fsdp][offload]") {
  auto engine = std::make_shared<DeferredEngine>();
  {
    fsdp::detail::OffloadCopies copies(engine);
    copies.copy_in(Tensor::empty({8}, DType::kF32), iota(8, 0));
    copies.drain();  // the end of backward: the parameters change next
    CHECK(!copies.has_copy_in());
    CHECK(copies.stats().dropped == 1);
    CHECK(engine->host_waits == 1);
    CHECK(engine->live() == 0);
    // Destruction waits for what is still in flight.
    copies.copy_out(Tensor::empty({8}, DType::kF32), iota(8, 0));
    copies.drop_copy_in();  // none pending: nothing happens
    CHECK(copies.stats().dropped == 1);
  }
  CHECK(engine->host_waits == 2);
  CHECK(engine->live() == 0);
  CHECK(engine->unknown == 0);
}

namespace {

// One training run with offload over a DeferredEngine per rank (its phase advanced by every
// module's forward pre-hook), and what the rank threads saw after each step's backward.
struct Offloaded {
  offload_test::Result result;
  std::vector<std::shared_ptr<DeferredEngine>> engines;
  // Per rank, over the steps: parameters and gradients seen, and those whose storage is a buffer
  // some copy read (copy-in source) or wrote (copy-out destination).
  std::vector<int64_t> params, params_copied_in, grads, grads_copied_out;
  std::vector<int64_t> empty;  // parameters of which this rank holds no element
};

Offloaded train_offloaded(offload_test::Run run) {
  Offloaded out;
  const auto n = static_cast<size_t>(run.ranks);
  out.engines.resize(n);
  for (auto& e : out.engines) e = std::make_shared<DeferredEngine>();
  out.params.assign(n, 0);
  out.params_copied_in.assign(n, 0);
  out.grads.assign(n, 0);
  out.grads_copied_out.assign(n, 0);
  out.empty.assign(n, 0);
  run.options.offload_policy.offload_to_cpu = true;
  run.per_rank = [&](int rank, fsdp::FullyShardOptions& o) { o.offload_policy.copy_engine = out.engines[static_cast<size_t>(rank)]; };
  run.after_shard = [&](int rank, nn::GPT& model) {
    DeferredEngine* e = out.engines[static_cast<size_t>(rank)].get();
    auto tick = [e](nn::Module&, nn::Ctx&, dtensor::DTensor&) { ++e->phase; };
    model.register_forward_pre_hook(tick);
    for (const auto& [name, block] : model.blocks().children()) block->register_forward_pre_hook(tick);
  };
  run.after_backward = [&](int rank, nn::GPT& model) {  // each rank writes its own entries
    const auto r = static_cast<size_t>(rank);
    DeferredEngine& e = *out.engines[r];
    for (const auto& [name, p] : model.named_parameters()) {
      ++out.params[r];
      if (p->data().to_local().numel() == 0) ++out.empty[r];
      if (e.copies_from(p->data().to_local()) > 0) ++out.params_copied_in[r];
      if (!p->grad()) continue;
      ++out.grads[r];
      if (e.copies_to(p->grad()->to_local()) > 0) ++out.grads_copied_out[r];
    }
  };
  out.result = offload_test::train(run);
  return out;
}

}  // namespace

TEST_CASE("fsdp offload: training over the deferred engine equals training without offload", "[fsdp][offload]") {
  struct Case {
    const char* what;
    fsdp::Layout layout;
    int ranks;
    int depth;
    bool bf16;
    int accum = 1;
    bool norm_groups = false;  // 10 groups instead of 4 (contiguous: some ranks hold no LayerNorm)
    int64_t replicate = 1;     // > 1: HSDP (replicate, ranks / replicate)
    int k = 0;                 // > 0: reshard_after_forward = k
  };
  using fsdp::Layout;
  const std::vector<Case> cases = {
      {"FSDP 2", Layout::kPadded, 2, 1, false},
      {"FSDP 2, no prefetch", Layout::kPadded, 2, 0, false},
      {"FSDP 4, prefetch 2", Layout::kPadded, 4, 2, false},
      {"FSDP 2, bf16 parameters, f32 reduction", Layout::kPadded, 2, 1, true},
      {"contiguous FSDP 2", Layout::kContiguous, 2, 1, false},
      {"contiguous FSDP 3, no prefetch", Layout::kContiguous, 3, 0, false},
      {"contiguous FSDP 4, prefetch 2", Layout::kContiguous, 4, 2, false},
      {"contiguous FSDP 5, LayerNorm groups (empty ranges), dim 8", Layout::kContiguous, 5, 1, false, 1, true},
      {"contiguous FSDP 2, bf16 parameters, f32 reduction", Layout::kContiguous, 2, 1, true},
      {"contiguous FSDP 3, 2 microbatches without sync", Layout::kContiguous, 3, 1, false, 2},
      {"contiguous HSDP 2x3", Layout::kContiguous, 6, 1, false, 1, false, 2},
      {"contiguous FSDP 4, reshard_after_forward = 2", Layout::kContiguous, 4, 1, false, 1, false, 1, 2},
      {"contiguous HSDP 2x4, reshard_after_forward = 2", Layout::kContiguous, 8, 1, false, 1, false, 2, 2}};
  int ran = 0, against_padded = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    offload_test::Run plain;
    plain.ranks = c.ranks;
    plain.prefetch_depth = c.depth;
    plain.options.layout = c.layout;
    plain.accum = c.accum;
    plain.norm_groups = c.norm_groups;
    plain.replicate = c.replicate;
    if (c.k > 0) plain.options.reshard_after_forward = fsdp::ReshardAfterForward::to(c.k);
    if (c.norm_groups) {
      plain.cfg.dim = 8;  // LayerNorms of 8 + 8 elements: 4 alignment units over 5 ranks
      plain.batch = 10;
    }
    if (c.bf16) {
      plain.options.mp_policy.param_dtype = DType::kBF16;
      plain.options.mp_policy.reduce_dtype = DType::kF32;
    }
    const offload_test::Result want = offload_test::train(plain);
    const Offloaded off = train_offloaded(plain);
    const offload_test::Result& got = off.result;
    REQUIRE(got.losses.size() == 3);
    REQUIRE(want.losses.size() == 3);
    for (size_t i = 0; i < want.losses.size(); ++i) {
      INFO("step " << i);
      CHECK(got.losses[i] == want.losses[i]);  // same arithmetic: bit for bit
    }
    CHECK(want.losses.front() != want.losses.back());  // it trained
    CHECK(offload_test::max_param_diff(got, want) == 0.0);
    CHECK(got.note.empty());  // an engine was given: honoured
    // The moves between host and device are not FSDP copies: offload copies what the layout does
    // (contiguous in f32: nothing).
    CHECK(got.copy_bytes == want.copy_bytes);
    if (c.layout == Layout::kContiguous) CHECK((got.copy_bytes == 0) == !c.bf16);
    else CHECK(got.copy_bytes > 0);  // copy-in and copy-out around every collective
    if (c.layout == Layout::kContiguous && !c.bf16 && c.accum == 1) {
      // In f32 the contiguous layout's arithmetic is the padded layout's: so is its offload's.
      offload_test::Run padded = plain;
      padded.options.layout = Layout::kPadded;
      const Offloaded ref = train_offloaded(padded);
      REQUIRE(ref.result.losses.size() == 3);
      for (size_t i = 0; i < got.losses.size(); ++i) CHECK(got.losses[i] == ref.result.losses[i]);
      CHECK(offload_test::max_param_diff(got, ref.result) == 0.0);
      ++against_padded;
    }
    // Per step a copy-in per unshard from the shard (per microbatch: every group in forward, every
    // group but the root in backward: the root stays unsharded in between; with k, backward
    // gathers the k buffers instead, none copied in), each used, and one copy-out per group (of
    // its whole sharded gradient, after its reduce-scatter).
    const int64_t groups = c.norm_groups ? 10 : 4;
    const int64_t copies_in = 3 * c.accum * (c.k > 0 ? groups : 2 * groups - 1);
    const int64_t trainable = static_cast<int64_t>(want.params.size());
    int64_t empty = 0;
    for (size_t r = 0; r < off.engines.size(); ++r) {
      INFO("rank " << r);
      const DeferredEngine& e = *off.engines[r];
      CHECK(e.issued == copies_in + 3 * groups);
      CHECK(e.compute_waits == copies_in);
      CHECK(e.host_waits >= 3 * groups);
      // From the second step on (the forward order is known), a copy-in is issued a module ahead
      // of its wait at least once per forward.
      CHECK(e.waited_later >= 2);
      CHECK(off.engines[r]->live() == 0);  // everything waited on and released by the end of each backward
      CHECK(e.bad_releases == 0);
      CHECK(e.unknown == 0);
      // The sharded parameters view the host buffers the copy-ins read (the optimizer steps them
      // there), and their gradients the host buffers the copy-outs wrote.
      CHECK(off.params[r] == 3 * trainable);
      CHECK(off.params_copied_in[r] == off.params[r]);
      CHECK(off.grads[r] == 3 * trainable);
      CHECK(off.grads_copied_out[r] == off.grads[r]);
      empty += off.empty[r];
    }
    if (c.norm_groups) CHECK(empty > 0);  // some rank's range held none of some LayerNorm
    ++ran;
  }
  CHECK(ran == 13);
  CHECK(against_padded == 7);
}

TEST_CASE("fsdp offload: experts on a carved mesh (follower groups) over the deferred engine equal no offload",
          "[fsdp][offload]") {
  offload_test::Run plain;
  plain.ranks = 4;
  plain.ep = 2;
  plain.cfg.layers = 2;
  plain.cfg.moe.experts = 4;
  plain.cfg.moe.top_k = 2;
  offload_test::Run off = plain;
  off.options.offload_policy.offload_to_cpu = true;
  std::vector<std::shared_ptr<DeferredEngine>> engines(4);
  for (auto& e : engines) e = std::make_shared<DeferredEngine>();
  off.per_rank = [&](int rank, fsdp::FullyShardOptions& o) { o.offload_policy.copy_engine = engines[static_cast<size_t>(rank)]; };
  const offload_test::Result want = offload_test::train(plain);
  const offload_test::Result got = offload_test::train(off);
  REQUIRE(want.losses.size() == 3);
  REQUIRE(got.losses.size() == 3);
  int compared = 0;
  for (size_t i = 0; i < want.losses.size(); ++i, ++compared) CHECK(got.losses[i] == want.losses[i]);
  CHECK(compared == 3);
  CHECK(want.losses.front() != want.losses.back());
  CHECK(offload_test::max_param_diff(got, want) == 0.0);
  for (const auto& e : engines) {
    // 5 groups: per block a dense group and its expert follower, and the root. Per step a copy-out
    // each and a copy-in per unshard: forward 5, backward 4 (the root stays unsharded).
    CHECK(e->issued == 3 * (5 + 9));
    CHECK(e->compute_waits == 3 * 9);
    CHECK(e->live() == 0);
    CHECK(e->bad_releases == 0);
  }
}
