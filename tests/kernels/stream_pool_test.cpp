// The stream-aware block cache's rules (kernels/detail/stream_pool.h, NOTE [stream-aware reuse])
// on the CPU, over a fake event backend whose streams complete their work only when the test says
// so: reuse on the freeing stream at once, on another stream only after the freeing stream's
// event, blocks used on several streams, exact sizes, the small-block budget, eviction of large
// blocks oldest first, and every event released.
#include "kernels/detail/stream_pool.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <vector>

#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/async_copy.h"
#include "kernels/stream.h"
#include "kernels/tensor.h"

using kernels::detail::EventId;
using kernels::detail::EventOps;
using kernels::detail::StreamBlockPool;
using kernels::detail::StreamId;

namespace {

// Each stream has a count of work items queued and of items completed; an event recorded on a
// stream completes once the stream has completed everything queued before it.
class FakeEvents final : public EventOps {
 public:
  void enqueue(StreamId s) { ++queued_[s]; }
  void complete(StreamId s) { completed_[s] = queued_[s]; }
  EventId record(StreamId s) override {
    events_[next_] = {s, queued_[s]};
    ++recorded;
    return next_++;
  }
  bool done(EventId e) override {
    const auto it = events_.find(e);
    REQUIRE(it != events_.end());  // never asked about a released event
    return completed_[it->second.first] >= it->second.second;
  }
  void release(EventId e) noexcept override { events_.erase(e); }
  size_t live() const { return events_.size(); }
  int recorded = 0;

 private:
  std::map<StreamId, uint64_t> queued_, completed_;
  std::map<EventId, std::pair<StreamId, uint64_t>> events_;
  EventId next_ = 1;
};

// Distinct fake block addresses (never dereferenced).
void* block(uintptr_t i) { return reinterpret_cast<void*>(i * 4096); }

constexpr size_t KiB = 1024, MiB = KiB * KiB;

}  // namespace

TEST_CASE("stream pool: reuse on the freeing stream at once, elsewhere after its event", "[kernels][stream]") {
  FakeEvents ev;
  StreamBlockPool pool(ev, {});
  ev.enqueue(1);  // the block's last use: work queued on stream 1, not complete
  REQUIRE(pool.give({block(1), 4 * KiB}, 1).empty());
  CHECK(pool.take(4 * KiB, 1) == block(1));  // stream 1 orders it after that work
  REQUIRE(pool.give({block(1), 4 * KiB}, 1).empty());
  CHECK(pool.take(4 * KiB, 2) == nullptr);    // stream 2 must wait for stream 1's event
  CHECK(pool.stats().waited == 1);
  ev.complete(1);
  CHECK(pool.take(4 * KiB, 2) == block(1));
  CHECK(pool.stats().reused == 2);
  CHECK(ev.live() == 0);
  CHECK(pool.stats().pending_events == 0);
  CHECK(pool.stats().cached_bytes == 0);
}

TEST_CASE("stream pool: a block used on several streams waits for each other one", "[kernels][stream]") {
  FakeEvents ev;
  StreamBlockPool pool(ev, {});
  ev.enqueue(1);
  ev.enqueue(3);  // e.g. a collective on stream 3 read the block
  const StreamId also[] = {3, 1, 3};  // repeats and the freeing stream itself: one event each
  REQUIRE(pool.give({block(7), 64 * KiB}, 1, also).empty());
  CHECK(ev.recorded == 2);
  CHECK(pool.take(64 * KiB, 1) == nullptr);  // stream 3's event pending
  CHECK(pool.take(64 * KiB, 3) == nullptr);  // stream 1's event pending
  ev.complete(3);
  CHECK(pool.take(64 * KiB, 2) == nullptr);  // stream 1's still pending
  CHECK(pool.take(64 * KiB, 1) == block(7));
  CHECK(ev.live() == 0);
}

TEST_CASE("stream pool: exact sizes, same-stream blocks first", "[kernels][stream]") {
  FakeEvents ev;
  StreamBlockPool pool(ev, {});
  ev.enqueue(1);
  ev.enqueue(2);
  REQUIRE(pool.give({block(1), 8 * KiB}, 1).empty());
  REQUIRE(pool.give({block(2), 8 * KiB}, 2).empty());
  REQUIRE(pool.give({block(3), 16 * KiB}, 2).empty());
  CHECK(pool.take(4 * KiB, 2) == nullptr);   // no block of that size
  CHECK(pool.stats().waited == 0);           // (nothing of the size: not a wait)
  CHECK(pool.take(8 * KiB, 2) == block(2));  // its own, though block 1 is older
  CHECK(pool.take(8 * KiB, 2) == nullptr);   // block 1 waits for stream 1
  ev.complete(1);
  CHECK(pool.take(8 * KiB, 2) == block(1));
  CHECK(pool.take(16 * KiB, 1) == nullptr);  // stream 2 not complete
  CHECK(pool.stats().cached_bytes == 16 * KiB);
  const auto left = pool.drain();
  REQUIRE(left.size() == 1);
  CHECK(left[0].ptr == block(3));
  CHECK(ev.live() == 0);
}

TEST_CASE("stream pool: small blocks within their budget, large ones evicted oldest first", "[kernels][stream]") {
  FakeEvents ev;
  StreamBlockPool pool(ev, {.small_limit = 1 * MiB, .max_small_bytes = 3 * 256 * KiB, .max_cached_bytes = 8 * MiB});
  int cached_small = 0;
  for (uintptr_t i = 0; i < 5; ++i) {  // 256 KiB each: three fit
    const auto back = pool.give({block(100 + i), 256 * KiB}, 1);
    if (back.empty()) {
      ++cached_small;
    } else {
      REQUIRE(back.size() == 1);
      CHECK(back[0].ptr == block(100 + i));  // the block itself, not cached
    }
  }
  CHECK(cached_small == 3);
  // Large: 3 MiB blocks, at most 8 MiB cached: the third evicts the first, the fourth the second.
  std::vector<void*> evicted;
  for (uintptr_t i = 0; i < 4; ++i)
    for (const auto& b : pool.give({block(200 + i), 3 * MiB}, 1)) evicted.push_back(b.ptr);
  REQUIRE(evicted.size() == 2);
  CHECK(evicted[0] == block(200));
  CHECK(evicted[1] == block(201));
  CHECK(pool.give({block(300), 9 * MiB}, 1).size() == 1);  // above the budget: not cached
  CHECK(pool.stats().cached_bytes == 3 * 256 * KiB + 6 * MiB);
  CHECK(pool.take(3 * MiB, 1) == block(202));  // the oldest left of the size
  CHECK(pool.drain().size() == 4);
  CHECK(ev.live() == 0);
  CHECK(pool.stats().pending_events == 0);
}

TEST_CASE("streams and events on the CPU are no-ops; CUDA ones refuse without a GPU", "[kernels][stream]") {
  using kernels::Device;
  using kernels::Event;
  using kernels::Stream;
  const Stream cpu = Stream::create(Device::cpu());
  CHECK(cpu.id() == 0);
  CHECK(cpu == Stream());
  CHECK(cpu.device() == Device::cpu());
  const Event e = Event::record(cpu);
  CHECK(e.query());
  e.synchronize();
  cpu.wait(e);
  cpu.synchronize();
  CHECK(Event().query());
  if (kernels::cuda_device_count() == 0) {  // CI: no GPU (a CUDA build or not)
    CHECK_THROWS_AS(Stream::create(Device::cuda(0)), kernels::Unsupported);
    CHECK_THROWS_AS(Stream::compute(Device::cuda(0)), kernels::Unsupported);
    CHECK_THROWS_AS(Stream::copy(Device::cuda(0)), kernels::Unsupported);
  }
  CHECK(Stream::copy(Device::cpu()) == Stream());
}

TEST_CASE("copy_async on the CPU copies at once; pinned memory and bad operands are refused", "[kernels][stream]") {
  using kernels::Device;
  using kernels::DType;
  using kernels::Tensor;
  const Tensor src = Tensor::arange({12}, DType::kF32);
  Tensor dst = Tensor::empty({12}, DType::kF32);
  dst.fill_(-1.0);
  const kernels::Event e = kernels::copy_async(dst, src, kernels::Stream::copy(Device::cpu()));
  CHECK(e.query());
  const auto got = dst.to_vector();
  REQUIRE(got.size() == 12);
  int checked = 0;
  for (size_t i = 0; i < got.size(); ++i, ++checked) CHECK(got[i] == static_cast<double>(i));
  CHECK(checked == 12);
  CHECK_THROWS_WITH(kernels::copy_async(Tensor::empty({11}, DType::kF32), src, kernels::Stream()),
                    Catch::Contains("expected the same shape and dtype"));
  CHECK_THROWS_WITH(kernels::copy_async(Tensor::empty({12}, DType::kBF16), src, kernels::Stream()),
                    Catch::Contains("f32"));
  CHECK_THROWS_WITH(kernels::copy_async(Tensor::empty({6, 2}, DType::kF32).transpose(0, 1),
                                        Tensor::empty({2, 6}, DType::kF32), kernels::Stream()),
                    Catch::Contains("expected both contiguous"));
  kernels::PinnedHostAllocator pinned;
  CHECK_THROWS_WITH(pinned.allocate(64, Device::cuda(0)), Catch::Contains("cuda:0: expected the CPU"));
  if (!kernels::cuda_built()) {
    CHECK_THROWS_WITH(pinned.allocate(64, Device::cpu()), Catch::Contains("no CUDA"));
    CHECK(pinned.allocated_bytes() == 0);
  }
}
