// dtensor::exchange_rows / exchange_rows_known (dtensor/row_exchange.h): variable row counts per
// member of one mesh dim, the rows packed in member order; the counts are checked before any
// collective. nn::MoE is the library's caller (tests/nn/moe_test.cpp covers it end to end).
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "dtensor/row_exchange.h"
#include "kernels/error.h"
#include "support/checks.h"
#include "support/local_mesh.h"

// exchange_rows (the counts exchanged first) is the public form for callers that do not know what
// they receive; nn::MoE knows it and calls exchange_rows_known. The way back is the header's example.
TEST_CASE("exchange_rows: counts first, then rows, packed in member order; back with the counts known",
          "[row_exchange]") {
  // Rank r sends (r + j) % 3 rows to member j; row values are a function of (sender, row).
  std::vector<std::vector<double>> got(3), sent(3), back(3);
  std::vector<std::vector<int64_t>> counts(3);
  testing_support::Checks checks;
  testing_support::on_mesh({3}, [&](std::shared_ptr<dtensor::MeshComms> comms, collectives::Communicator&) {
    const int r = comms->rank();
    std::vector<int64_t> send;
    std::vector<double> rows;
    for (int j = 0; j < 3; ++j) {
      send.push_back((r + j) % 3);
      for (int i = 0; i < (r + j) % 3; ++i) rows.insert(rows.end(), {100.0 * r + 10 * j + i, -1.0 * r});
    }
    const int64_t n = static_cast<int64_t>(rows.size()) / 2;
    const kernels::Tensor x = kernels::Tensor::from_vector(rows, {n, 2}, kernels::DType::kF32);
    dtensor::RowExchange ex = dtensor::exchange_rows(*comms, 0, x, send);
    got[r] = ex.rows.to_vector();
    counts[r] = ex.recv_rows;
    sent[r] = rows;
    back[r] = dtensor::exchange_rows_known(*comms, 0, ex.rows, ex.recv_rows, send).wait().to_vector();
    // Refused on every rank before any collective: one count per member, summing to the rows.
    const std::vector<int64_t> two = {n, 0}, over = {n, 1, 0}, negative = {n + 1, -1, 0};
    checks.throws<kernels::InvalidArgument>([&] { dtensor::exchange_rows(*comms, 0, x, two); },
                                            "2 send row counts for 3 members", "two counts");
    checks.throws<kernels::InvalidArgument>([&] { dtensor::exchange_rows_known(*comms, 0, x, over, over); },
                                            "do not sum to the", "counts over the rows");
    checks.throws<kernels::InvalidArgument>([&] { dtensor::exchange_rows(*comms, 0, x, negative); },
                                            "negative count", "negative count");
  });
  checks.report();
  for (int r = 0; r < 3; ++r) {
    std::vector<double> want;
    std::vector<int64_t> want_counts;
    for (int s = 0; s < 3; ++s) {
      want_counts.push_back((s + r) % 3);
      for (int i = 0; i < (s + r) % 3; ++i) want.insert(want.end(), {100.0 * s + 10 * r + i, -1.0 * s});
    }
    CHECK(counts[r] == want_counts);
    CHECK(got[r] == want);
    CHECK(back[r] == sent[r]);
  }
}
