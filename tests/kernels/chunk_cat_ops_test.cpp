// chunk_cat / split_copy (kernels/ops/chunk_cat.h) against the per-tensor, per-chunk strided
// copy_ reference (what FSDP did before): byte-identical outputs for uneven shapes, padding,
// empty tensors, splits along dims > 0, mixed dtypes (f32 -> bf16, bf16 -> f32, f64), strided
// inputs and outputs, one or several threads; plus the argument checks.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "kernels/error.h"
#include "kernels/ops/chunk_cat.h"
#include "ops_testing.h"

namespace {

using kernels::ChunkCatLayout;
using kernels::Dims;
using kernels::DType;
using kernels::Tensor;
using ops_testing::random_tensor;
using ops_testing::relayout;

// The slot of tensor i in chunk c of a flat buffer, narrowed to the piece.
Tensor piece_view(const Tensor& flat, const ChunkCatLayout& l, size_t i, int64_t c) {
  return flat.narrow(0, c * l.chunk_numel() + l.offset(i), l.padded_shape(i).product())
      .view(l.padded_shape(i))
      .narrow(l.dim(i), 0, l.piece_size(i, c));
}

Tensor reference_chunk_cat(const std::vector<Tensor>& in, const ChunkCatLayout& l, DType dtype) {
  Tensor out = Tensor::zeros(Dims{l.numel()}, dtype);
  for (int64_t c = 0; c < l.chunks(); ++c)
    for (size_t i = 0; i < l.size(); ++i)
      if (in[i].defined() && l.piece_size(i, c) > 0)
        piece_view(out, l, i, c).copy_(in[i].narrow(l.dim(i), l.piece_offset(i, c), l.piece_size(i, c)));
  return out;
}

void reference_split_copy(const std::vector<Tensor>& out, const Tensor& flat, const ChunkCatLayout& l) {
  for (int64_t c = 0; c < l.chunks(); ++c)
    for (size_t i = 0; i < l.size(); ++i)
      if (out[i].defined() && l.piece_size(i, c) > 0)
        out[i].narrow(l.dim(i), l.piece_offset(i, c), l.piece_size(i, c)).copy_(piece_view(flat, l, i, c));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || !(a.shape() == b.shape())) return false;
  if (a.numel() == 0) return true;  // (no storage to compare; memcmp must not see a null pointer)
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.numel()) * kernels::itemsize(x.dtype())) == 0;
}

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF64};

struct Case {
  std::vector<Dims> shapes;
  std::vector<int> dims;
  int64_t chunks = 1;
  std::vector<DType> dtypes;
  std::vector<int> layouts;
  DType flat_dtype = DType::kF32;
};

Case random_case(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  Case k;
  k.chunks = pick(1, 5);
  const int64_t n = pick(0, 6);
  for (int64_t i = 0; i < n; ++i) {
    Dims s;
    const int64_t nd = pick(1, 3);
    for (int64_t d = 0; d < nd; ++d) s.push_back(pick(0, 4) == 0 ? pick(0, 2) : pick(1, 13));
    k.shapes.push_back(s);
    k.dims.push_back(static_cast<int>(pick(0, nd - 1)));
    k.dtypes.push_back(kDTypes[pick(0, 2)]);
    k.layouts.push_back(static_cast<int>(pick(0, ops_testing::kLayouts - 1)));
  }
  k.flat_dtype = kDTypes[pick(0, 2)];
  return k;
}

}  // namespace

TEST_CASE("chunk_cat and split_copy match the per-piece copies byte for byte", "[chunk_cat]") {
  int cases = 0;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    std::mt19937_64 rng(seed);
    const Case k = random_case(rng);
    const ChunkCatLayout l(k.shapes, k.dims, k.chunks);
    std::vector<Tensor> in;
    for (size_t i = 0; i < k.shapes.size(); ++i)
      in.push_back(relayout(random_tensor(k.shapes[i], k.dtypes[i], seed * 31 + i, -3, 3), k.layouts[i]));
    if (!in.empty() && seed % 7 == 0) in[seed % in.size()] = Tensor();  // a missing gradient: zeros
    const int threads = static_cast<int>(seed % 4) + 1;
    INFO("seed " << seed << " chunks " << k.chunks << " tensors " << k.shapes.size() << " threads " << threads);

    Tensor out = Tensor::full(Dims{l.numel()}, 7.25, k.flat_dtype);  // junk where padding goes
    kernels::chunk_cat(out, in, l, threads);
    const Tensor ref = reference_chunk_cat(in, l, k.flat_dtype);
    REQUIRE(same_bytes(out, ref));

    // split_copy back into outputs of other dtypes and layouts (one left undefined: skipped).
    std::vector<Tensor> got, want;
    for (size_t i = 0; i < k.shapes.size(); ++i) {
      const DType dt = kDTypes[(i + seed) % 3];
      got.push_back(relayout(Tensor::full(k.shapes[i], -1.5, dt), k.layouts[(i + 1) % k.layouts.size()]));
      want.push_back(Tensor::full(k.shapes[i], -1.5, dt));
    }
    if (!got.empty() && seed % 5 == 0) got[0] = want[0] = Tensor();
    kernels::split_copy(got, out, l, threads);
    reference_split_copy(want, ref, l);
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i].defined()) REQUIRE(same_bytes(got[i], want[i]));
    ++cases;
  }
  REQUIRE(cases == 300);
}

TEST_CASE("chunk_cat: an FSDP group (uneven rows, empty parameter, f32 -> bf16) and its round trip", "[chunk_cat]") {
  // 4 ranks; [10,6] -> rank 3 gets 1 row of 3; [3] -> rank 3 empty; [0,5] empty everywhere.
  const std::vector<Dims> shapes{{10, 6}, {3}, {0, 5}, {8, 4}};
  const ChunkCatLayout l(shapes, 4);
  REQUIRE(l.chunk_numel() == 3 * 6 + 1 + 0 + 2 * 4);
  REQUIRE(l.piece_size(0, 3) == 1);
  REQUIRE(l.piece_size(1, 3) == 0);
  REQUIRE(l.piece_offset(1, 3) == 3);
  std::vector<Tensor> params;
  for (size_t i = 0; i < shapes.size(); ++i) params.push_back(random_tensor(shapes[i], DType::kF32, 40 + i));
  Tensor flat = Tensor::empty(Dims{l.numel()}, DType::kBF16);
  kernels::chunk_cat(flat, params, l);
  REQUIRE(same_bytes(flat, reference_chunk_cat(params, l, DType::kBF16)));
  // Padding: rank 3's slot of parameter 0 holds row 9 then two zero rows.
  const std::vector<double> v = flat.to_vector();
  for (int64_t j = 6; j < 18; ++j) REQUIRE(v[static_cast<size_t>(3 * l.chunk_numel() + j)] == 0.0);
  // bf16 -> f32 back: equals the bf16-rounded parameters.
  std::vector<Tensor> back;
  for (const Dims& s : shapes) back.push_back(Tensor::empty(s, DType::kF32));
  kernels::split_copy(back, flat, l);
  for (size_t i = 0; i < shapes.size(); ++i) REQUIRE(same_bytes(back[i], params[i].to(DType::kBF16).to(DType::kF32)));
}

TEST_CASE("chunk_cat: large buffers split over threads give the single-thread bytes", "[chunk_cat]") {
  const std::vector<Dims> shapes{{1023, 517}, {517}, {2049, 129}, {7, 3}};
  const std::vector<int> dims{0, 0, 1, 0};
  const ChunkCatLayout l(shapes, dims, 3);
  std::vector<Tensor> in;
  for (size_t i = 0; i < shapes.size(); ++i) in.push_back(random_tensor(shapes[i], DType::kF32, 7 + i));
  in[2] = relayout(in[2], 1);
  Tensor one = Tensor::empty(Dims{l.numel()}, DType::kBF16), four = Tensor::empty(Dims{l.numel()}, DType::kBF16);
  kernels::chunk_cat(one, in, l, 1);
  kernels::chunk_cat(four, in, l, 4);
  REQUIRE(same_bytes(one, four));
  REQUIRE(same_bytes(one, reference_chunk_cat(in, l, DType::kBF16)));
  std::vector<Tensor> a, b;
  for (const Dims& s : shapes) {
    a.push_back(Tensor::empty(s, DType::kF32));
    b.push_back(Tensor::empty(s, DType::kF32));
  }
  kernels::split_copy(a, one, l, 1);
  kernels::split_copy(b, one, l, 0);  // automatic: above kParallelCopyBytes
  for (size_t i = 0; i < shapes.size(); ++i) REQUIRE(same_bytes(a[i], b[i]));
}

TEST_CASE("chunk_cat / split_copy reject bad arguments naming them", "[chunk_cat]") {
  using Catch::Matchers::Contains;
  const ChunkCatLayout l({{4, 2}}, 2);
  const Tensor x = Tensor::zeros(Dims{4, 2}, DType::kF32);
  REQUIRE_THROWS_WITH(ChunkCatLayout({{4}}, 0), Contains("0 chunks"));
  REQUIRE_THROWS_WITH(ChunkCatLayout({{4}}, std::vector<int>{1}, 2), Contains("dim 1 for tensor 0"));
  REQUIRE_THROWS_WITH(ChunkCatLayout({{4}}, std::vector<int>{}, 2), Contains("1 shapes but 0 dims"));
  REQUIRE_THROWS_WITH(ChunkCatLayout({Dims{}}, 2), Contains("0-d"));
  REQUIRE_THROWS_WITH(kernels::chunk_cat(Tensor::zeros(Dims{7}, DType::kF32), {x}, l), Contains("expected a contiguous [8]"));
  REQUIRE_THROWS_WITH(kernels::chunk_cat(Tensor::zeros(Dims{8}, DType::kF32), {x, x}, l), Contains("2 inputs"));
  REQUIRE_THROWS_WITH(kernels::chunk_cat(Tensor::zeros(Dims{8}, DType::kF32), {Tensor::zeros(Dims{2, 4}, DType::kF32)}, l),
                      Contains("input 0 has shape [2,4], expected the layout's [4,2]"));
  Tensor flat = Tensor::zeros(Dims{16}, DType::kF32);
  REQUIRE_THROWS_WITH(kernels::chunk_cat(flat.narrow(0, 0, 8), {flat.narrow(0, 4, 8).view(Dims{4, 2})}, l),
                      Contains("input 0 overlaps"));
  REQUIRE_NOTHROW(kernels::chunk_cat(flat.narrow(0, 0, 8), {flat.narrow(0, 8, 8).view(Dims{4, 2})}, l));
  REQUIRE_THROWS_WITH(kernels::split_copy({flat.narrow(0, 4, 8).view(Dims{4, 2})}, flat.narrow(0, 0, 8), l),
                      Contains("output 0 overlaps"));
  REQUIRE_THROWS_WITH(kernels::split_copy({}, flat.narrow(0, 0, 8), l), Contains("0 outputs"));
  REQUIRE_THROWS_WITH(kernels::split_copy({x}, flat.view(Dims{2, 8}), l), Contains("flat has shape [2,8]"));
}
