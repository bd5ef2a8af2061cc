// Who a timed-out mpi call names (collectives/mpi/attribution.h), without mpirun: the records are
// what the progress board would hold. The case that made fsdp-train-stop-kill-mpi flaky: every
// member had already entered later calls (FSDP issues all-gathers ahead), so a check for "latest
// call == this one" named nobody ("ranks [] have not completed it").
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include "collectives/mpi/attribution.h"

namespace {

using collectives::detail::attribute;
using collectives::detail::Attribution;
using collectives::detail::attribution_text;
using collectives::detail::MemberRecord;
using namespace std::chrono_literals;

std::string text_for(int64_t number, const std::vector<MemberRecord>& m, const std::string& mismatch = "") {
  return attribution_text(attribute(number, m), 500ms, mismatch);
}

TEST_CASE("mpi attribution: a stopped member that entered later calls is named as stalled", "[mpi][attribution]") {
  // Call #7 (number 8) timed out; every member entered #9 already; rank 2 is stopped.
  const std::vector<MemberRecord> m = {
      {0, 10, 7, 0, true}, {1, 10, 7, 0, true}, {2, 10, 7, 0, false}, {3, 10, 7, 0, true}};
  const Attribution a = attribute(8, m);
  CHECK(a.stalled == std::vector<int>{2});
  CHECK(a.waiting == std::vector<int>{0, 1, 3});
  CHECK(a.missing.empty());
  CHECK(text_for(8, m) ==
        "every member joined, ranks [2] joined but have not completed it and made no MPI progress in 500 ms "
        "(stopped, or not calling into MPI); ranks [0,1,3] have not completed it and are still polling MPI");
}

TEST_CASE("mpi attribution: the header's worked example", "[mpi][attribution]") {
  const std::vector<MemberRecord> m = {
      {0, 8, 7, 0, true}, {1, 9, 7, 0, true}, {2, 10, 7, 0, false}, {3, 8, 7, 0, true}};
  CHECK(text_for(8, m) ==
        "every member joined, ranks [2] joined but have not completed it and made no MPI progress in 500 ms "
        "(stopped, or not calling into MPI); ranks [0,1,3] have not completed it and are still polling MPI");
}

TEST_CASE("mpi attribution: members that never joined, stalled or not", "[mpi][attribution]") {
  // Rank 2 stopped before entering call #3; rank 0 is blocked in an earlier call but polls.
  const std::vector<MemberRecord> m = {
      {0, 3, 2, 0, true}, {1, 4, 2, 0, true}, {2, 3, 3, 0, false}, {3, 4, 2, 0, true}};
  const Attribution a = attribute(4, m);
  CHECK(a.missing == std::vector<int>{0, 2});
  CHECK(a.missing_stalled == std::vector<int>{2});
  CHECK(text_for(4, m) ==
        "ranks [0,2] never joined (ranks [2] made no MPI progress in 500 ms); "
        "ranks [1,3] have not completed it and are still polling MPI");
}

TEST_CASE("mpi attribution: members that gave up are not taken for stalled ones", "[mpi][attribution]") {
  // Rank 1 gave call #3 up itself; rank 3 gave up #2 and will never enter #3; rank 2 stopped.
  const std::vector<MemberRecord> m = {
      {0, 4, 3, 0, true}, {1, 4, 3, 4, false}, {2, 4, 3, 0, false}, {3, 3, 2, 3, false}};
  const Attribution a = attribute(4, m);
  CHECK(a.gave_up == std::vector<int>{1});
  CHECK(a.gave_up_earlier == std::vector<int>{3});
  CHECK(a.stalled == std::vector<int>{2});
  CHECK(text_for(4, m) ==
        "ranks [3] never joined: they gave up an earlier call on the group; ranks [2] joined but have not "
        "completed it and made no MPI progress in 500 ms (stopped, or not calling into MPI); ranks [0] have not "
        "completed it and are still polling MPI; ranks [1] joined but gave it up after their own timeout");
}

TEST_CASE("mpi attribution: live members that disagree are named with the mismatch", "[mpi][attribution]") {
  // Rank 0 completed its part; rank 1 (the caller) waits for a message that never comes.
  const std::vector<MemberRecord> m = {{0, 1, 1, 0, true}, {1, 1, 0, 0, true}};
  CHECK(text_for(1, m, "collective mismatch: rank 1 called a but rank 0 called b") ==
        "every member joined, ranks [1] have not completed it and are still polling MPI; collective mismatch: "
        "rank 1 called a but rank 0 called b (MPI does not check that members pass matching counts, dtypes, "
        "ops and roots)");
}

TEST_CASE("mpi attribution: unreadable entries and a call that completed meanwhile", "[mpi][attribution]") {
  MemberRecord lost{1, 0, 0, 0, false, false};
  CHECK(text_for(3, {{0, 3, 2, 0, true}, lost}) ==
        "ranks [0] have not completed it and are still polling MPI; ranks [1] did not answer the progress "
        "query (state unknown)");
  lost.rank = 0;
  MemberRecord lost1 = lost;
  lost1.rank = 1;
  CHECK(text_for(3, {lost, lost1}) == "ranks [0,1] did not answer the progress query (state unknown)");
  CHECK(text_for(3, {{0, 3, 3, 0, true}, {1, 4, 3, 0, false}}) ==
        "every member has completed it (it completed as the wait ran out)");
}

TEST_CASE("mpi attribution: every state combination names someone, or says the call completed", "[mpi][attribution]") {
  // Each of 3 members in one of 7 states relative to call number 5: never entered (polling or
  // not), entered 5 or a later call without completing it (polling or not), completed, gave up.
  const std::vector<MemberRecord> states = {
      {0, 4, 3, 0, true}, {0, 4, 3, 0, false}, {0, 5, 4, 0, true}, {0, 7, 4, 0, false},
      {0, 6, 5, 0, false}, {0, 5, 4, 5, false}, {0, 4, 3, 0, false, false}};
  const std::regex empty_list(R"(ranks \[\])");
  const std::regex named(R"(ranks \[[0-9]+(,[0-9]+)*\])");
  int cases = 0, completed = 0;
  for (const MemberRecord& a : states)
    for (const MemberRecord& b : states)
      for (const MemberRecord& c : states) {
        std::vector<MemberRecord> m = {a, b, c};
        for (int i = 0; i < 3; ++i) m[i].rank = i;
        const std::string t = text_for(5, m);
        INFO(t);
        CHECK_FALSE(std::regex_search(t, empty_list));
        const bool all_done = a.completed >= 5 && b.completed >= 5 && c.completed >= 5 && a.answered && b.answered &&
                              c.answered;
        if (all_done) {
          ++completed;
          CHECK(t == "every member has completed it (it completed as the wait ran out)");
        } else {
          CHECK(std::regex_search(t, named));
        }
        // A member that joined, has not completed and made no progress is always named stalled.
        const Attribution at = attribute(5, m);
        for (int i = 0; i < 3; ++i)
          if (m[i].answered && m[i].entered >= 5 && m[i].completed < 5 && m[i].gave_up < 5 && !m[i].progressed) {
            CHECK(std::find(at.stalled.begin(), at.stalled.end(), i) != at.stalled.end());
            CHECK(t.find("joined but have not completed it and made no MPI progress") != std::string::npos);
          }
        ++cases;
      }
  CHECK(cases == 7 * 7 * 7);
  CHECK(completed == 1);
}

}  // namespace
