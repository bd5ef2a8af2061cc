// Failure collector for rank threads: Catch2 assertions are not thread-safe, so the threads of a
// local world record failures here and the test thread reports them after the run.
//
//   testing_support::Checks checks;
//   collectives::run_ranks(4, [&](Communicator& world) { checks.check(ok, "what went wrong"); });
//   checks.report();  // one FAIL_CHECK per recorded failure (the first 30)
#pragma once

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace testing_support {

class Checks {
 public:
  void check(bool ok, const std::string& what) {
    if (!ok) add(what);
  }
  void add(std::string what) {
    std::lock_guard lk(mu_);
    if (failures_.size() < 30) failures_.push_back(std::move(what));
  }
  // f() must throw E whose message contains `contains`.
  template <class E, class F>
  void throws(F f, const std::string& contains, const std::string& what) {
    try {
      f();
      add(what + ": no exception");
    } catch (const E& e) {
      if (std::string(e.what()).find(contains) == std::string::npos)
        add(fmt::format("{}: message '{}' lacks '{}'", what, e.what(), contains));
    }
  }
  // On the test thread, after the ranks have joined.
  void report() {
    for (const std::string& f : failures_) FAIL_CHECK(f);
    CHECK(failures_.empty());
  }

 private:
  std::mutex mu_;
  std::vector<std::string> failures_;
};

}  // namespace testing_support
