// Who a timed-out mpi call names (collectives/mpi/attribution.h), without mpirun: the records are
// what the progress board would hold. The case that made fsdp-train-stop-kill-mpi flaky: every
// member had already entered later calls (FSDP issues all-gathers ahead), so a check for "latest
// call == this one" named nobody ("ranks [] have not completed it").
#include <catch2/catch.hpp>

#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include "collectives/mpi/attribution.h"

namespace {

using collectives::detail::attribute;
using collectives::detail::Attribution;
using collectives::detail::attribution_text;
using collectives::detail::MemberRecord;

std::string text_for(int64_t number, const std::vector<MemberRecord>& m, const std::string& mismatch = "") {
  return attribution_text(attribute(number, m), mismatch);
}

const std::string kWhy =
    " (a member that stopped calling into MPI stalls the others; MPI does not check that members pass matching "
    "counts, dtypes, ops and roots)";

TEST_CASE("mpi attribution: a stopped member that entered later calls is named as joined", "[mpi][attribution]") {
  // Call #7 (number 8) timed out; every member entered #9 already; rank 2 is stopped (the board
  // cannot tell it from the others).
  const std::vector<MemberRecord> m = {{0, 10, 7, 0}, {1, 10, 7, 0}, {2, 10, 7, 0}, {3, 10, 7, 0}};
  const Attribution a = attribute(8, m);
  CHECK(a.inside == std::vector<int>{0, 1, 2, 3});
  CHECK(a.missing.empty());
  CHECK(text_for(8, m) == "every member joined, ranks [0,1,2,3] joined but have not completed it" + kWhy);
}

TEST_CASE("mpi attribution: the header's worked example", "[mpi][attribution]") {
  const std::vector<MemberRecord> m = {{0, 8, 7, 0}, {1, 9, 7, 0}, {2, 10, 7, 0}, {3, 8, 7, 0}};
  CHECK(text_for(8, m) ==
        "every member joined, ranks [0,1,2,3] joined but have not completed it (a member that stopped calling into "
        "MPI stalls the others; MPI does not check that members pass matching counts, dtypes, ops and roots)");
}

TEST_CASE("mpi attribution: members that never joined", "[mpi][attribution]") {
  // Ranks 0 and 2 have not entered call #3 (number 4); ranks 1 and 3 wait in it.
  const std::vector<MemberRecord> m = {{0, 3, 2, 0}, {1, 4, 2, 0}, {2, 3, 3, 0}, {3, 4, 2, 0}};
  const Attribution a = attribute(4, m);
  CHECK(a.missing == std::vector<int>{0, 2});
  CHECK(a.inside == std::vector<int>{1, 3});
  CHECK(text_for(4, m) == "ranks [0,2] never joined; ranks [1,3] joined but have not completed it" + kWhy);
}

TEST_CASE("mpi attribution: members that gave up are named apart", "[mpi][attribution]") {
  // Rank 1 gave call #3 up itself; rank 3 gave up #2 and will never enter #3; ranks 0, 2 wait.
  const std::vector<MemberRecord> m = {{0, 4, 3, 0}, {1, 4, 3, 4}, {2, 4, 3, 0}, {3, 3, 2, 3}};
  const Attribution a = attribute(4, m);
  CHECK(a.gave_up == std::vector<int>{1});
  CHECK(a.gave_up_earlier == std::vector<int>{3});
  CHECK(a.inside == std::vector<int>{0, 2});
  CHECK(text_for(4, m) == "ranks [3] never joined: they gave up an earlier call on the group; ranks [0,2] joined "
                          "but have not completed it" +
                              kWhy + "; ranks [1] joined but gave it up after their own timeout");
}

TEST_CASE("mpi attribution: members that disagree are named with the mismatch", "[mpi][attribution]") {
  // Rank 0 completed its part; rank 1 (the caller) waits for a message that never comes.
  const std::vector<MemberRecord> m = {{0, 1, 1, 0}, {1, 1, 0, 0}};
  CHECK(text_for(1, m, "collective mismatch: rank 1 called a but rank 0 called b") ==
        "every member joined, ranks [1] joined but have not completed it" + kWhy +
            "; collective mismatch: rank 1 called a but rank 0 called b");
}

TEST_CASE("mpi attribution: unreadable entries and a call that completed meanwhile", "[mpi][attribution]") {
  MemberRecord lost{1, 0, 0, 0, false};
  CHECK(text_for(3, {{0, 3, 2, 0}, lost}) == "ranks [0] joined but have not completed it" + kWhy +
                                                 "; ranks [1] did not answer the progress query (state unknown)");
  lost.rank = 0;
  MemberRecord lost1 = lost;
  lost1.rank = 1;
  CHECK(text_for(3, {lost, lost1}) == "ranks [0,1] did not answer the progress query (state unknown)");
  CHECK(text_for(3, {{0, 3, 3, 0}, {1, 4, 3, 0}}) == "every member has completed it (it completed as the wait ran out)");
}

TEST_CASE("mpi attribution: every state combination names someone, or says the call completed", "[mpi][attribution]") {
  // Each of 3 members in one of 7 states relative to call number 5: never entered; entered 5,
  // or a later call, without completing it; completed; gave it up; gave up an earlier call;
  // unreadable.
  const std::vector<MemberRecord> states = {{0, 4, 3, 0},  {0, 5, 4, 0},  {0, 7, 4, 0},
                                            {0, 6, 5, 0},  {0, 5, 4, 5},  {0, 4, 3, 4},
                                            {0, 4, 3, 0, false}};
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
        CHECK(t.find("progress in") == std::string::npos);  // nothing here knows about MPI progress
        const bool all_done = a.completed >= 5 && b.completed >= 5 && c.completed >= 5 && a.answered && b.answered &&
                              c.answered;
        if (all_done) {
          ++completed;
          CHECK(t == "every member has completed it (it completed as the wait ran out)");
        } else {
          CHECK(std::regex_search(t, named));
        }
        // A member that joined (this call or a later one), has not completed and has not given up
        // is always named among those that joined but have not completed it.
        const Attribution at = attribute(5, m);
        for (int i = 0; i < 3; ++i)
          if (m[i].answered && m[i].entered >= 5 && m[i].completed < 5 && m[i].gave_up < 5) {
            CHECK(std::find(at.inside.begin(), at.inside.end(), i) != at.inside.end());
            CHECK(t.find("joined but have not completed it") != std::string::npos);
          }
        ++cases;
      }
  CHECK(cases == 7 * 7 * 7);
  CHECK(completed == 1);
}

}  // namespace
