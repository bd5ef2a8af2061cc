// Internal to the mpi backend: who holds up a timed-out call, from one read of the members'
// progress board entries (NOTE [mpi progress board] in collectives/mpi.h). Pure functions over
// plain records, with no MPI, so that they are tested without mpirun
// (tests/collectives/mpi_attribution_test.cpp).
//
//   // call #7 (number 8) timed out on rank 0; rank 2 entered #9 but completed only #6 (a
//   // stopped member can be several calls ahead); ranks 1 and 3 entered #7, #8 and have not
//   // completed #7 either
//   Attribution a = attribute(8, {{0, 8, 7, 0}, {1, 9, 7, 0}, {2, 10, 7, 0}, {3, 8, 7, 0}});
//   attribution_text(a, "") ==
//       "every member joined, ranks [0,1,2,3] joined but have not completed it (a member that "
//       "stopped calling into MPI stalls the others; MPI does not check that members pass "
//       "matching counts, dtypes, ops and roots)"
//   // The board says what each member entered, completed and gave up, not whether it still polls
//   // MPI: a stopped member and one waiting for it look the same here, so neither is singled out.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace collectives::detail {

// One member's entry as read for a timed-out call. Numbers count calls: call #k entered,
// completed or given up makes the word k + 1 (words only grow).
struct MemberRecord {
  int rank = 0;               // world rank
  int64_t entered = 0;        // calls entered on the communicator
  int64_t completed = 0;      // highest call completed, plus one
  int64_t gave_up = 0;        // highest call given up after a timeout here, plus one
  bool answered = true;       // false: the entry could not be read; the other fields mean nothing
};

// Members by what holds the call up, each list in group order. A member that completed the call
// is in none of them.
struct Attribution {
  std::vector<int> missing;          // never entered the call
  std::vector<int> gave_up_earlier;  // never entered it: gave up an earlier call on the group
  std::vector<int> inside;           // entered it (or a later call), not completed, not given up
  std::vector<int> gave_up;          // entered it and gave it up after their own timeout
  std::vector<int> unanswered;       // entry unreadable: state unknown
};

// REQUIRES: number >= 1 (the timed-out call's number: call #k -> k + 1).
// A member that entered a later call has entered this one too (calls start in order), so
// "joined" is entered >= number, whatever the member's latest call.
Attribution attribute(int64_t number, std::span<const MemberRecord> members);

// The timeout line's tail: "ranks [3] never joined", "every member joined, ranks [0,1,2,3] joined
// but have not completed it (...)", ... `mismatch` ("collective mismatch: ...") or empty. Names
// every member that holds the call up; names nobody only when every member completed the call.
std::string attribution_text(const Attribution& a, const std::string& mismatch);

}  // namespace collectives::detail
