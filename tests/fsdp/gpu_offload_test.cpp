// [gpu] Offload that overlaps on a CUDA device (fsdp/offload.h): FSDP 2 on the local backend, both
// ranks on cuda:0, trains to the same losses with OffloadPolicy{offload_to_cpu, pin_memory} as
// with synchronous offload (bit for bit: the same arithmetic, only the copies move) and as
// without offload (the optimizer then steps on the GPU instead of the host: within 1e-5); the
// sharded state is in pinned host memory and every copy ran on the device's copy stream (an
// event recorded there per copy; the compute stream waited for each copy-in, the host for the
// rest). The contiguous layout (Layout::kContiguous) with pinned offload, on 5 ranks some of
// which hold empty ranges, equals its synchronous offload bit for bit and padded pinned offload
// within 1e-5. Exits 77 (skipped) without a GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include "fsdp/offload.h"
#include "kernels/stream.h"
#include "offload_train.h"

using kernels::Device;

TEST_CASE("fsdp offload [gpu]: pinned, overlapped offload trains like synchronous offload and no offload",
          "[gpu][fsdp][offload]") {
  const Device gpu = Device::cuda(0);
  offload_test::Run plain;
  plain.device = gpu;
  plain.ranks = 2;
  plain.steps = 4;

  offload_test::Run sync = plain;  // offload, copies synchronous from ordinary memory
  sync.options.offload_policy.offload_to_cpu = true;
  sync.options.offload_policy.pin_memory = false;

  offload_test::Run pinned = plain;
  pinned.options.offload_policy.offload_to_cpu = true;
  std::vector<std::shared_ptr<fsdp::StreamCopyEngine>> engines;
  for (int r = 0; r < plain.ranks; ++r) engines.push_back(std::make_shared<fsdp::StreamCopyEngine>(gpu));
  pinned.per_rank = [&](int rank, fsdp::FullyShardOptions& o) {
    o.offload_policy.copy_engine = engines[static_cast<size_t>(rank)];
  };
  int64_t sharded_on_cpu = 0, sharded_total = 0;
  pinned.after_shard = [&](int rank, nn::GPT& model) {
    if (rank != 0) return;
    for (const auto& [name, p] : model.named_parameters()) {
      ++sharded_total;
      if (p->data().to_local().device().is_cpu()) ++sharded_on_cpu;
    }
  };

  const offload_test::Result want = offload_test::train(plain);
  const offload_test::Result got_sync = offload_test::train(sync);
  const offload_test::Result got = offload_test::train(pinned);

  REQUIRE(want.losses.size() == 4);
  REQUIRE(got.losses.size() == 4);
  REQUIRE(got_sync.losses.size() == 4);
  CHECK(want.losses.front() != want.losses.back());  // it trained
  int compared = 0;
  for (size_t i = 0; i < want.losses.size(); ++i, ++compared) {
    INFO("step " << i << ": pinned " << got.losses[i] << ", synchronous " << got_sync.losses[i] << ", no offload "
                 << want.losses[i]);
    CHECK(got.losses[i] == got_sync.losses[i]);
    CHECK(std::abs(got.losses[i] - want.losses[i]) <= 1e-5 * std::abs(want.losses[i]));
  }
  CHECK(compared == 4);
  CHECK(offload_test::max_param_diff(got, got_sync) == 0.0);
  CHECK(offload_test::max_param_diff(got, want) <= 1e-5);
  CHECK(got.note.empty());  // pin_memory honoured

  CHECK(sharded_total > 10);
  CHECK(sharded_on_cpu == sharded_total);
  for (const auto& e : engines) {
    const fsdp::StreamCopyEngine::Stats s = e->stats();
    CHECK(s.copy_stream != 0);
    CHECK(s.copy_stream != s.compute_stream);
    CHECK(s.copy_stream == kernels::Stream::copy(gpu).id());
    // 4 groups, 4 steps: a copy-in per unshard (forward 4, backward 3) and a copy-out per group.
    CHECK(s.host_to_device == 4 * 7);
    CHECK(s.device_to_host == 4 * 4);
    CHECK(s.copy_stream_events == s.host_to_device + s.device_to_host);
    CHECK(s.compute_waits == s.host_to_device);
    CHECK(s.host_waits >= 1);
    auto pinned_alloc = std::dynamic_pointer_cast<kernels::PinnedHostAllocator>(e->host_allocator());
    REQUIRE(pinned_alloc);
    // The training has ended and the model is gone: every pinned block was given back.
    CHECK(pinned_alloc->allocated_bytes() == 0);
  }
}

TEST_CASE("fsdp offload [gpu]: the contiguous layout's pinned offload trains like its synchronous offload and padded's",
          "[gpu][fsdp][offload][contiguous]") {
  const Device gpu = Device::cuda(0);
  offload_test::Run sync;  // contiguous, offload, copies synchronous from ordinary memory
  sync.device = gpu;
  sync.ranks = 5;
  sync.steps = 4;
  sync.batch = 10;
  sync.norm_groups = true;  // 10 groups; LayerNorms of 8 + 8 elements: some ranks' ranges are empty
  sync.cfg.dim = 8;
  sync.options.layout = fsdp::Layout::kContiguous;
  sync.options.offload_policy.offload_to_cpu = true;
  sync.options.offload_policy.pin_memory = false;
  auto pinned_run = [&](fsdp::Layout layout, std::vector<std::shared_ptr<fsdp::StreamCopyEngine>>& engines) {
    offload_test::Run r = sync;
    r.options.layout = layout;
    r.options.offload_policy.pin_memory = true;
    for (int i = 0; i < r.ranks; ++i) engines.push_back(std::make_shared<fsdp::StreamCopyEngine>(gpu));
    r.per_rank = [&engines](int rank, fsdp::FullyShardOptions& o) {
      o.offload_policy.copy_engine = engines[static_cast<size_t>(rank)];
    };
    return offload_test::train(r);
  };
  std::vector<std::shared_ptr<fsdp::StreamCopyEngine>> engines, padded_engines;
  const offload_test::Result got_sync = offload_test::train(sync);
  const offload_test::Result got = pinned_run(fsdp::Layout::kContiguous, engines);
  const offload_test::Result padded = pinned_run(fsdp::Layout::kPadded, padded_engines);
  REQUIRE(got.losses.size() == 4);
  REQUIRE(got_sync.losses.size() == 4);
  REQUIRE(padded.losses.size() == 4);
  CHECK(got.losses.front() != got.losses.back());  // it trained
  int compared = 0;
  for (size_t i = 0; i < got.losses.size(); ++i, ++compared) {
    INFO("step " << i << ": pinned " << got.losses[i] << ", synchronous " << got_sync.losses[i] << ", padded pinned "
                 << padded.losses[i]);
    CHECK(got.losses[i] == got_sync.losses[i]);  // only the copies moved
    CHECK(std::abs(got.losses[i] - padded.losses[i]) <= 1e-5 * std::abs(padded.losses[i]));
  }
  CHECK(compared == 4);
  CHECK(offload_test::max_param_diff(got, got_sync) == 0.0);
  CHECK(offload_test::max_param_diff(got, padded) <= 1e-5);
  CHECK(got.copy_bytes == 0);  // f32: the layout copies nothing around its collectives
  for (size_t r = 0; r < engines.size(); ++r) {
    // One copy per group and unshard (forward 10, backward 9), one per group's sharded gradient
    // (empty ones included): as many as padded's.
    const fsdp::StreamCopyEngine::Stats s = engines[r]->stats(), p = padded_engines[r]->stats();
    CHECK(s.host_to_device == 4 * 19);
    CHECK(s.device_to_host == 4 * 10);
    CHECK(s.host_to_device == p.host_to_device);
    CHECK(s.device_to_host == p.device_to_host);
    CHECK(s.compute_waits == s.host_to_device);
  }
}

TEST_CASE("fsdp offload [gpu]: copy_async moves pinned host memory on the copy stream", "[gpu][fsdp][offload]") {
  const Device gpu = Device::cuda(0);
  auto pinned = std::make_shared<kernels::PinnedHostAllocator>();
  const int64_t n = 1 << 20;
  kernels::Tensor host = kernels::Tensor::empty({n}, kernels::DType::kF32, Device::cpu(), pinned);
  CHECK(pinned->allocated_bytes() == n * 4);
  for (int64_t i = 0; i < n; ++i) host.data<float>()[i] = static_cast<float>(i % 1000);
  const kernels::Tensor dev = kernels::Tensor::empty({n}, kernels::DType::kF32, gpu);
  const kernels::Stream cs = kernels::Stream::copy(gpu);
  kernels::Event e = kernels::copy_async(dev, host, cs);
  kernels::Stream::compute(gpu).wait(e);
  kernels::Tensor back = kernels::Tensor::empty({n}, kernels::DType::kF32, Device::cpu(), pinned);
  cs.wait(kernels::Event::record(kernels::Stream::compute(gpu)));
  kernels::copy_async(back, dev, cs).synchronize();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += back.data<float>()[i] != static_cast<float>(i % 1000);
  CHECK(bad == 0);
}
