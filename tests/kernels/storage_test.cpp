// Storage: allocation, alignment, free / reallocate keeping the identity of views.
#include "kernels/storage.h"

#include <catch2/catch.hpp>
#include <cstdint>

#include "kernels/tensor.h"

using namespace kernels;

TEST_CASE("storage allocates aligned CPU memory", "[kernels][storage]") {
  for (size_t n : {1, 3, 64, 100, 4096}) {
    auto s = Storage::allocate(n, Device::cpu());
    CHECK(s->allocated());
    CHECK(s->nbytes() == n);
    CHECK(s->device() == Device::cpu());
    CHECK(reinterpret_cast<uintptr_t>(s->data()) % 64 == 0);
  }
  auto empty = Storage::allocate(0, Device::cpu());
  CHECK(empty->allocated());
  CHECK(empty->nbytes() == 0);
  CHECK(empty->data() == nullptr);
}

TEST_CASE("storage free and reallocate", "[kernels][storage]") {
  auto s = Storage::allocate(64, Device::cpu());
  s->free();
  CHECK_FALSE(s->allocated());
  CHECK(s->nbytes() == 64);
  REQUIRE_THROWS_AS(s->data(), InvalidArgument);
  REQUIRE_THROWS_WITH(s->data(), "storage is freed (64 bytes on cpu): reallocate it before use");
  s->free();  // freeing twice is harmless
  s->reallocate();
  CHECK(s->allocated());
  CHECK(s->nbytes() == 64);
  void* p = s->data();
  s->reallocate();  // no-op when allocated
  CHECK(s->data() == p);
  s->resize(256);
  CHECK(s->allocated());
  CHECK(s->nbytes() == 256);
  s->free();
  s->resize(8);
  CHECK(s->allocated());
  CHECK(s->nbytes() == 8);
}

TEST_CASE("views survive free and reallocate of their storage", "[kernels][storage]") {
  Tensor t = Tensor::arange({4, 6}, DType::kF32);
  Tensor v = t.narrow(1, 2, 3).transpose(0, 1);  // shape [3,4], taken before the free
  t.storage()->free();
  REQUIRE_THROWS_WITH(v.data_ptr(), Catch::Contains("storage is freed (96 bytes on cpu)"));
  REQUIRE_THROWS_WITH(t.data_ptr(), Catch::Contains("reallocate it before use"));
  REQUIRE_THROWS_AS(v.item({0, 0}), InvalidArgument);
  REQUIRE_THROWS_AS(v.to_vector(), InvalidArgument);
  REQUIRE_THROWS_AS(t.fill_(1.0), InvalidArgument);
  // Views can still be taken while freed (metadata only).
  Tensor w = t.select(0, 1);
  CHECK(w.shape() == Dims{6});
  CHECK(w.storage_offset() == 6);

  t.storage()->reallocate();
  t.fill_index_([](std::span<const int64_t> i) { return 100.0 * i[0] + i[1]; });
  CHECK(v.shares_storage_with(t));
  CHECK(v.item({0, 0}) == 2.0);
  CHECK(v.item({2, 3}) == 304.0);
  CHECK(w.to_vector() == std::vector<double>{100, 101, 102, 103, 104, 105});
  v.fill_(-1.0);  // writes through into the reallocated memory
  CHECK(t.item({3, 4}) == -1.0);
  CHECK(t.item({3, 5}) == 305.0);
}
