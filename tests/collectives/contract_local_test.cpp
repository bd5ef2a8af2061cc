// The contract suite (contract.h) on the local backend: every case on 1, 2, 3, 4 and 8 ranks (about
// one in N under --sample N, as the TSan tree runs it).
// Rank threads record into their contract::Log; the main thread checks the logs.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <vector>

#include "collectives/local.h"
#include "contract.h"
#include "support/catch2_runner.h"

namespace {

using namespace std::chrono_literals;

TEST_CASE("contract: every case on the local backend, 1 to 8 ranks", "[collectives][local][contract]") {
  const int n = GENERATE(1, 2, 3, 4, 8);
  int64_t index = 0, ran = 0;
  for (const contract::Case& c : contract::cases()) {
    if (!test_support::sampled(index++, n)) continue;  // --sample: a different sample per n
    std::vector<contract::Log> logs(static_cast<size_t>(n));
    collectives::run_ranks(
        n,
        [&](collectives::Communicator& world) {
          logs[static_cast<size_t>(world.rank())] = contract::run_case(c, world, kernels::Device{});
        },
        60s);
    for (int r = 0; r < n; ++r) {
      const contract::Log& log = logs[static_cast<size_t>(r)];
      INFO(c.name << " on " << n << " ranks, rank " << r << ":\n" << fmt::format("{}", fmt::join(log.failures, "\n")));
      CHECK(log.failures.empty());
      CHECK(log.checked > 0);
    }
    ++ran;
  }
  CHECK(ran == test_support::sampled_count(static_cast<int64_t>(contract::cases().size()), n));
}

}  // namespace
