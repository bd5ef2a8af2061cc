// Offload that overlaps (fsdp/offload.h), on the CPU: the rules of NOTE [offload ordering] over a
// deferred copy engine, a fake whose copies run only when something waits for them (the compute
// stream, device-side, or the host) and whose destinations hold NaN until then. A copy that the
// runtime forgot to wait for leaves NaN where the all-gather or the optimizer reads, so FSDP
// training over it equals training without offload only if every copy is waited on in time.
#include <catch2/catch.hpp>

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

TEST_CASE("fsdp offload: training over the deferred engine equals training without offload", "[fsdp][offload]") {
  struct Case {
    const char* what;
    int ranks;
    int depth;
    bool bf16;
  };
  const std::vector<Case> cases = {{"FSDP 2", 2, 1, false},
                                   {"FSDP 2, no prefetch", 2, 0, false},
                                   {"FSDP 4, prefetch 2", 4, 2, false},
                                   {"FSDP 2, bf16 parameters, f32 reduction", 2, 1, true}};
  int ran = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    offload_test::Run plain;
    plain.ranks = c.ranks;
    plain.prefetch_depth = c.depth;
    if (c.bf16) {
      plain.options.mp_policy.param_dtype = DType::kBF16;
      plain.options.mp_policy.reduce_dtype = DType::kF32;
    }
    offload_test::Run off = plain;
    off.options.offload_policy.offload_to_cpu = true;
    std::vector<std::shared_ptr<DeferredEngine>> engines(static_cast<size_t>(c.ranks));
    for (auto& e : engines) e = std::make_shared<DeferredEngine>();
    off.per_rank = [&](int rank, fsdp::FullyShardOptions& o) { o.offload_policy.copy_engine = engines[static_cast<size_t>(rank)]; };
    off.after_shard = [&](int rank, nn::GPT& model) {
      DeferredEngine* e = engines[static_cast<size_t>(rank)].get();
      auto tick = [e](nn::Module&, nn::Ctx&, dtensor::DTensor&) { ++e->phase; };
      model.register_forward_pre_hook(tick);
      for (const auto& [name, block] : model.blocks().children()) block->register_forward_pre_hook(tick);
    };
    const offload_test::Result want = offload_test::train(plain);
    const offload_test::Result got = offload_test::train(off);
    REQUIRE(got.losses.size() == 3);
    REQUIRE(want.losses.size() == 3);
    for (size_t i = 0; i < want.losses.size(); ++i) {
      INFO("step " << i);
      CHECK(got.losses[i] == want.losses[i]);  // same arithmetic: bit for bit
    }
    CHECK(want.losses.front() != want.losses.back());  // it trained
    CHECK(offload_test::max_param_diff(got, want) == 0.0);
    CHECK(got.note.empty());  // an engine was given: honoured
    for (const auto& e : engines) {
      // 4 groups (3 blocks and the root), 3 steps: a copy-in per unshard (forward 4, backward 3:
      // the root stays unsharded in between), each used, and a copy-out per group.
      CHECK(e->issued == 3 * (7 + 4));
      CHECK(e->compute_waits == 3 * 7);
      CHECK(e->host_waits >= 3 * 4);
      // From the second step on (the forward order is known), a copy-in is issued a module ahead
      // of its wait at least once per forward.
      CHECK(e->waited_later >= 2);
      CHECK(e->live() == 0);  // everything waited on and released by the end of each backward
      CHECK(e->bad_releases == 0);
      CHECK(e->unknown == 0);
    }
    ++ran;
  }
  CHECK(ran == 4);
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
