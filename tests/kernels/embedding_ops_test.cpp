// embedding gather and its deterministic scatter-add backward, full and row-sharded tables,
// padding_idx, every dtype and layout, empty cases.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "kernels/ops/elementwise.h"
#include "kernels/ops/embedding.h"
#include "ops_testing.h"

using namespace kernels;
using namespace ops_testing;
using Catch::Contains;

namespace {

std::vector<int64_t> make_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i)
    ids.push_back(static_cast<int64_t>(hash_uniform(seed, i, 0, vocab)));
  return ids;
}

}  // namespace

TEST_CASE("embedding forward and backward against loops", "[kernels][ops][embedding]") {
  int cases = 0;
  for (DType dt : float_dtypes()) {
    for (auto [vocab, d] :
         std::vector<std::pair<int64_t, int64_t>>{{11, 7}, {5, 1}, {3, 0}, {40, 33}}) {
      for (const Dims& ids_shape : std::vector<Dims>{{6}, {2, 9}, {0}, {3, 1, 4}}) {
        const auto ids_v = make_ids(ids_shape.product(), vocab, 91 + d);
        const std::vector<double> ids_d(ids_v.begin(), ids_v.end());
        const Tensor table0 = random_tensor({vocab, d}, dt, 92);
        Dims out_shape = ids_shape;
        out_shape.push_back(d);
        const Tensor dy0 = random_tensor(out_shape, dt, 93);
        const auto tv = table0.to_vector(), dyv = dy0.to_vector();
        std::vector<double> y_ref, dw_ref(static_cast<size_t>(vocab * d), 0.0), dw_pad = dw_ref;
        const int64_t pad = vocab / 2;
        for (size_t p = 0; p < ids_v.size(); ++p) {
          for (int64_t j = 0; j < d; ++j) {
            y_ref.push_back(tv[static_cast<size_t>(ids_v[p] * d + j)]);
            dw_ref[static_cast<size_t>(ids_v[p] * d + j)] += dyv[p * d + j];
            if (ids_v[p] != pad) dw_pad[static_cast<size_t>(ids_v[p] * d + j)] += dyv[p * d + j];
          }
        }
        const Tol tol = tol_for(dt, 4);
        for (DType idt : {DType::kI64, DType::kI32}) {
          for (int layout = 0; layout < kLayouts; ++layout) {
            const Tensor table = relayout(table0, layout);
            const Tensor ids = relayout(Tensor::from_vector(ids_d, ids_shape, idt), layout);
            const Tensor dy = relayout(dy0, (layout + 1) % kLayouts);
            INFO(describe(table) << " ids " << describe(ids));
            check_close(embedding(table, ids), y_ref, 0, 0, "forward");
            Tensor out = relayout(Tensor::zeros(out_shape, DType::kF32), layout);
            embedding_out(out, table, ids);
            check_close(out, y_ref, dt == DType::kF64 ? 1e-7 : 0, 0, "forward into f32");
            check_close(embedding_backward(dy, ids, vocab), dw_ref, tol.rtol, tol.atol, "backward");
            check_close(embedding_backward(dy, ids, vocab, {.padding_idx = pad - vocab}), dw_pad,
                        tol.rtol, tol.atol, "backward, padding_idx");
            // Accumulating into a strided f32 gradient (twice: doubles the sums).
            Tensor dw = relayout(Tensor::zeros({vocab, d}, DType::kF32), (layout + 2) % kLayouts);
            embedding_backward_out(dw, dy, ids, {}, true);
            embedding_backward_out(dw, dy, ids, {}, true);
            std::vector<double> twice = dw_ref;
            for (double& e : twice) e *= 2;
            check_close(dw, twice, 1e-5, 1e-6, "backward accumulate");
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 4 * 4 * 4 * 2 * kLayouts);
}

TEST_CASE("embedding on row shards sums to the full lookup", "[kernels][ops][embedding]") {
  const int64_t vocab = 13, d = 5;
  const Tensor table = random_tensor({vocab, d}, DType::kF32, 101);
  const auto ids_v = make_ids(20, vocab, 102);
  const Tensor ids =
      Tensor::from_vector(std::vector<double>(ids_v.begin(), ids_v.end()), {4, 5}, DType::kI64);
  const Tensor dy = random_tensor({4, 5, d}, DType::kF32, 103);
  const Tensor full = embedding(table, ids);
  const Tensor full_dw = embedding_backward(dy, ids, vocab);
  Tensor sum = Tensor::zeros({4, 5, d}, DType::kF32);
  int shards = 0;
  // Uneven shards, one empty: [0,5) [5,5) [5,10) [10,13)
  for (auto [start, rows] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 0}, {5, 5}, {10, 3}}) {
    const EmbeddingOptions o{.row_start = start, .num_embeddings = vocab};
    add_out(sum, sum, embedding(table.narrow(0, start, rows), ids, o));
    const Tensor dw = embedding_backward(dy, ids, rows, o);
    check_close(dw, full_dw.narrow(0, start, rows), 0, 0, "shard backward = rows of the full one");
    ++shards;
  }
  REQUIRE(shards == 4);
  check_close(sum, full, 0, 0, "partial lookups sum to the full lookup");
}

TEST_CASE("embedding backward is deterministic and rejects bad ids", "[kernels][ops][embedding]") {
  // Many repeats of a few ids: bitwise identical results on every run.
  const auto ids_v = make_ids(5000, 3, 111);
  const Tensor ids =
      Tensor::from_vector(std::vector<double>(ids_v.begin(), ids_v.end()), {5000}, DType::kI64);
  const Tensor dy = random_tensor({5000, 8}, DType::kF32, 112);
  const Tensor a = embedding_backward(dy, ids, 3), b = embedding_backward(dy, ids, 3);
  REQUIRE(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
  const Tensor table = Tensor::zeros({4, 2}, DType::kF32);
  REQUIRE_THROWS_WITH(embedding(table, Tensor::from_vector({1, 4}, {2}, DType::kI64)),
                      Contains("id 4 at position 1 is out of range (expected 0..3)"));
  REQUIRE_THROWS_WITH(embedding(table, Tensor::from_vector({-1}, {1}, DType::kI32)),
                      Contains("id -1 at position 0"));
  REQUIRE_THROWS_WITH(
      embedding(Tensor::zeros({4, 0}, DType::kF32), Tensor::from_vector({9}, {1}, DType::kI64)),
      Contains("id 9 at position 0"));
  REQUIRE_THROWS_WITH(embedding(table, Tensor::zeros({2}, DType::kF32)),
                      Contains("ids has dtype f32"));
  REQUIRE_THROWS_WITH(
      embedding(table, Tensor::zeros({2}, DType::kI64), {.row_start = 2, .num_embeddings = 5}),
      Contains("the table holds rows [2, 6) but num_embeddings is 5"));
  REQUIRE_THROWS_WITH(embedding_backward(Tensor::zeros({2, 3}, DType::kF32),
                                         Tensor::zeros({2}, DType::kI64), 4, {.padding_idx = 4}),
                      Contains("padding_idx 4 out of range for 4 embeddings"));
  REQUIRE_THROWS_WITH(
      embedding_backward_out(Tensor::zeros({4, 3}, DType::kF32), Tensor::zeros({2, 2}, DType::kF32),
                             Tensor::zeros({2}, DType::kI64)),
      Contains("dy has shape [2,2], expected [2,3]"));
}
