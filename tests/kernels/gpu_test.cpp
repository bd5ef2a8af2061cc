// CUDA tensors on a GPU: every CUDA path is compared with the CPU result bit for bit. A program of
// its own (tests/support/gpu_test_main.cpp): without a usable GPU it reports skipped (exit 77).
// The clean refusals without a GPU are checked in cuda_absent_test.cpp.
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <memory>
#include <span>

#include "kernels/allocator.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/detail/stream_pool.h"
#include "kernels/format.h"
#include "kernels/stream.h"
#include "kernels/tensor.h"

using namespace kernels;
using Catch::Contains;

namespace {

// Bitwise equality of two tensors' elements (same dtype), through contiguous host copies.
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor ha = a.to(Device::cpu()).contiguous();
  const Tensor hb = b.to(Device::cpu()).contiguous();
  return std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

// Values that exercise rounding, ties, overflow, subnormals and NaN in every format.
Tensor awkward_values() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v = {0.0,   -0.0,  1.0,    -1.0,    0.1,     1.0 / 3, 2.5,  -2.5,
                           464.0, 470.0, 480.0,  61440.0, 65504.0, 65520.0, 1e10, -1e10,
                           1e-7,  1e-40, 300.7,  -300.7,  nan,     inf,     -inf, 1.0 + 1.0 / 256,
                           255.0, 256.0, -129.0, 3e38};
  while (v.size() < 32) v.push_back(static_cast<double>(v.size()) * 0.37 - 5);
  return Tensor::from_vector(v, {4, 8}, DType::kF64);
}

}  // namespace

TEST_CASE("CUDA device index checks", "[kernels][gpu]") {
  const int n = cuda_device_count();
  REQUIRE_THROWS_AS(Tensor::empty({2}, DType::kF32, Device::cuda(n)), Unsupported);
  REQUIRE_THROWS_WITH(Tensor::empty({2}, DType::kF32, Device::cuda(n)),
                      Contains("cuda:" + std::to_string(n) + " requested"));
  REQUIRE_THROWS_AS(Tensor::empty({2}, DType::kF32, Device::cuda(-1)), InvalidArgument);
}

TEST_CASE("CUDA storage, factories and element access", "[kernels][gpu]") {
  const Device gpu = Device::cuda(0);
  Tensor t = Tensor::arange({3, 4}, DType::kF32, gpu);
  CHECK(t.device() == gpu);
  CHECK(t.storage()->device() == gpu);
  CHECK(t.to_vector() == Tensor::arange({3, 4}, DType::kF32).to_vector());
  CHECK(t.item({2, 3}) == 11.0);
  t.set_item({0, 1}, -5);
  CHECK(t.item({0, 1}) == -5.0);
  CHECK(Tensor::zeros({5}, DType::kBF16, gpu).to_vector() == std::vector<double>(5, 0.0));
  CHECK(Tensor::full({2, 2}, 1.5, DType::kF16, gpu).to_vector() == std::vector<double>(4, 1.5));
  CHECK(Tensor::from_vector({1, 2, 3}, {3}, DType::kI64, gpu).item({2}) == 3.0);
  CHECK(fmt::format("{}", Tensor::arange({2}, DType::kF32, gpu)) ==
        "tensor([0., 1.], dtype=f32, device=cuda:0)");
  Tensor zero = Tensor::empty({0}, DType::kF32, gpu);
  CHECK(zero.numel() == 0);
  CHECK(zero.clone().device() == gpu);

  // Free and reallocate keep views valid.
  Tensor v = t.narrow(1, 1, 2);
  t.storage()->free();
  REQUIRE_THROWS_WITH(v.item({0, 0}), Contains("storage is freed (48 bytes on cuda:0)"));
  t.storage()->reallocate();
  t.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(10 * i[0] + i[1]); });
  CHECK(v.to_vector() == std::vector<double>{1, 2, 11, 12, 21, 22});
}

TEST_CASE("CUDA copies match the CPU bit for bit", "[kernels][gpu]") {
  const Device gpu = Device::cuda(0);
  for (DType src_dtype : kAllDTypes) {
    const Tensor host_src = awkward_values().to(src_dtype);
    const Tensor dev_src = host_src.to(gpu);
    REQUIRE(same_bits(dev_src, host_src));
    for (DType dst_dtype : kAllDTypes) {
      INFO(to_string(src_dtype) << " -> " << to_string(dst_dtype));
      const Tensor expected = host_src.to(dst_dtype);
      // Device-side cast, contiguous.
      CHECK(same_bits(dev_src.to(dst_dtype), expected));
      // Device-side cast, strided source and destination.
      const Tensor expected_t = host_src.transpose(0, 1).to(dst_dtype);
      Tensor big = Tensor::zeros({8, 6}, dst_dtype, gpu);
      Tensor dst = big.narrow(1, 1, 4);  // [8,4] strided
      dst.copy_(dev_src.transpose(0, 1));
      CHECK(same_bits(dst, expected_t));
      // Host -> device with a cast and a strided destination, and device -> host with a cast.
      Tensor dst2 = Tensor::zeros({8, 6}, dst_dtype, gpu).narrow(1, 2, 4);
      dst2.copy_(host_src.transpose(0, 1));
      CHECK(same_bits(dst2, expected_t));
      Tensor host_dst = Tensor::zeros({4, 10}, dst_dtype).narrow(1, 1, 8);
      host_dst.copy_(dev_src);
      CHECK(same_bits(host_dst, expected));
    }
  }
}

TEST_CASE("CUDA fills and views", "[kernels][gpu]") {
  const Device gpu = Device::cuda(0);
  for (DType dtype : kAllDTypes) {
    INFO(to_string(dtype));
    Tensor d = Tensor::zeros({5, 7}, dtype, gpu);
    Tensor h = Tensor::zeros({5, 7}, dtype);
    d.narrow(0, 1, 3).select(1, 2).fill_(-2.75);
    h.narrow(0, 1, 3).select(1, 2).fill_(-2.75);
    CHECK(same_bits(d, h));
    d.transpose(0, 1).fill_index_([](std::span<const int64_t> i) { return i[0] * 1.5 - i[1]; });
    h.transpose(0, 1).fill_index_([](std::span<const int64_t> i) { return i[0] * 1.5 - i[1]; });
    CHECK(same_bits(d, h));
    CHECK(equal(d, h));
    CHECK(allclose(d, h));
    CHECK(same_bits(d.reshape({35}), h.reshape({35})));
    CHECK(same_bits(d.transpose(0, 1).reshape({35}), h.transpose(0, 1).reshape({35})));
  }
  // Overlapping device copy.
  Tensor s = Tensor::arange({10}, DType::kI32, gpu);
  s.narrow(0, 1, 9).copy_(s.narrow(0, 0, 9));
  CHECK(s.to_vector() == std::vector<double>{0, 0, 1, 2, 3, 4, 5, 6, 7, 8});
  // A larger copy spanning many blocks.
  Tensor big = Tensor::arange({64, 1000, 3}, DType::kF32, gpu).permute({2, 0, 1});
  CHECK(same_bits(big.contiguous(),
                  Tensor::arange({64, 1000, 3}, DType::kF32).permute({2, 0, 1}).contiguous()));
  if (cuda_device_count() > 1) {
    Tensor other = Tensor::arange({3, 3}, DType::kF64, gpu).to(Device::cuda(1));
    CHECK(other.device() == Device::cuda(1));
    CHECK(equal(other, Tensor::arange({3, 3}, DType::kF64)));
    Tensor back = Tensor::zeros({3, 3}, DType::kF32, gpu);
    back.copy_(other.transpose(0, 1));
    CHECK(equal(back, Tensor::arange({3, 3}, DType::kF32).transpose(0, 1)));
  }
}

// Streams and events (kernels/stream.h) and the stream-aware block pool over real CUDA events
// (kernels/detail/stream_pool.h, NOTE [stream-aware reuse]).
TEST_CASE("CUDA streams and events order copies across streams", "[kernels][gpu][stream]") {
  const Device gpu = Device::cuda(0);
  const int64_t n = int64_t{1} << 24;  // 64 MiB of f32: long enough to be in flight
  Tensor a = Tensor::empty({n}, DType::kF32);
  a.fill_index_([](std::span<const int64_t> i) { return static_cast<double>(i[0] % 1021); });
  const Tensor ga = a.to(gpu);
  Tensor b = Tensor::empty({n}, DType::kF32, gpu), c = Tensor::empty({n}, DType::kF32, gpu);
  const Stream s1 = Stream::create(gpu), s2 = Stream::create(gpu);
  REQUIRE(s1.id() != 0);
  REQUIRE(s1.id() != s2.id());
  REQUIRE(Stream::compute(gpu).id() != 0);
  REQUIRE(Stream::compute(gpu) == Stream::compute(gpu));
  int rounds = 0;
  for (int r = 0; r < 3; ++r, ++rounds) {
    c.fill_(-1.0);
    Stream::compute(gpu).synchronize();  // the fill (compute stream) is done before s1 and s2 run
    detail::cuda_memcpy_async(b.data_ptr(), ga.data_ptr(), a.nbytes(), reinterpret_cast<void*>(s1.id()), 0);
    const Event e = Event::record(s1);
    s2.wait(e);  // without it the second copy could read b before the first wrote it
    detail::cuda_memcpy_async(c.data_ptr(), b.data_ptr(), a.nbytes(), reinterpret_cast<void*>(s2.id()), 0);
    const Event done = Event::record(s2);
    done.synchronize();
    CHECK(done.query());
    CHECK(e.query());
    CHECK(same_bits(c, ga));
  }
  REQUIRE(rounds == 3);
  // The compute stream waits for an event of a stream of one's own.
  detail::cuda_memcpy_async(b.data_ptr(), ga.data_ptr(), a.nbytes(), reinterpret_cast<void*>(s1.id()), 0);
  Stream::compute(gpu).wait(Event::record(s1));
  c.copy_(b);  // a kernel on the compute stream
  CHECK(same_bits(c, ga));
  CHECK_THROWS_AS(Stream::create(Device::cuda(1 << 20)), Unsupported);
}

TEST_CASE("stream-aware block pool over CUDA events", "[kernels][gpu][stream]") {
  const Device gpu = Device::cuda(0);
  const int64_t n = int64_t{1} << 24;
  const Tensor src = Tensor::full({n}, 3.0, DType::kF32, gpu);
  void* block = detail::cuda_malloc(src.nbytes(), 0);
  const Stream s1 = Stream::create(gpu), s2 = Stream::create(gpu);
  s1.wait(Event::record(Stream::compute(gpu)));  // src's fill ran on the compute stream
  auto ops = detail::cuda_event_ops(0);
  {
    detail::StreamBlockPool pool(*ops, {});
    int rounds = 0;
    for (int r = 0; r < 3; ++r, ++rounds) {
      // The block's last use: a copy into it queued on s1.
      detail::cuda_memcpy_async(block, src.data_ptr(), src.nbytes(), reinterpret_cast<void*>(s1.id()), 0);
      REQUIRE(pool.give({block, src.nbytes()}, s1.id()).empty());
      CHECK(pool.take(src.nbytes(), s1.id()) == block);  // s1 orders it: no wait
      REQUIRE(pool.give({block, src.nbytes()}, s1.id()).empty());
      s1.synchronize();  // now the freeing stream's event has completed
      CHECK(pool.take(src.nbytes(), s2.id()) == block);
    }
    REQUIRE(rounds == 3);
    CHECK(pool.stats().pending_events == 0);
    CHECK(pool.stats().reused == 6);
  }
  detail::cuda_free(block, 0);
}

TEST_CASE("CachingAllocator: CUDA blocks, small ones too, reused by stream", "[kernels][gpu][stream]") {
  const Device gpu = Device::cuda(0);
  CachingAllocator cache;
  int sizes = 0;
  for (size_t nbytes : {size_t{1000}, size_t{4} << 20}) {  // a small and a large block
    ++sizes;
    void* p = cache.allocate(nbytes, gpu);  // the compute stream
    cache.deallocate(p, nbytes, gpu);
    CHECK(cache.allocate(nbytes, gpu) == p);  // same stream: at once
    const Stream side = Stream::create(gpu);
    cache.deallocate(p, nbytes, gpu);
    Stream::compute(gpu).synchronize();  // the compute stream passed the free
    CHECK(cache.allocate_on(nbytes, side) == p);
    cache.deallocate_on(p, nbytes, side);
    side.synchronize();
    CHECK(cache.allocate(nbytes, gpu) == p);
    cache.deallocate(p, nbytes, gpu);
  }
  REQUIRE(sizes == 2);
  CHECK(cache.stats().hits == 6);
  CHECK(cache.stats().in_use_bytes == 0);
  CHECK(cache.stats().cached_bytes == CachingAllocator::rounded_size(1000) + CachingAllocator::rounded_size(4 << 20));
  // Tensors through the cache: the values survive reuse across streams.
  auto shared = std::make_shared<CachingAllocator>();
  for (int r = 0; r < 3; ++r) {
    Tensor a = Tensor::empty({1 << 16}, DType::kF32, gpu, shared);
    a.fill_(r + 2.0);
    CHECK(a.to(Device::cpu()).item({123}) == r + 2.0);
  }
  CHECK(shared->stats().hits == 2);
  cache.release_cached();
  CHECK(cache.stats().cached_bytes == 0);
}
