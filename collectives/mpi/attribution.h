// Internal to the mpi backend: who holds up a timed-out call, from two reads of the members'
// progress board entries (NOTE [mpi progress board] in collectives/mpi.h). Pure functions over
// plain records, with no MPI, so that they are tested without mpirun
// (tests/collectives/mpi_attribution_test.cpp).
//
//   // call #7 (number 8) timed out on rank 0; rank 2 entered #9 but completed only #6 and its
//   // heartbeat did not move between the reads; rank 1 and 3 are polling
//   Attribution a = attribute(8, {{0, 8, 7, 0, true}, {1, 9, 7, 0, true}, {2, 10, 7, 0, false},
//                                 {3, 8, 7, 0, true}});
//   attribution_text(a, 500ms, "") ==
//       "every member joined, ranks [2] joined but have not completed it and made no MPI progress "
//       "in 500 ms (stopped, or not calling into MPI); ranks [0,1,3] have not completed it and "
//       "are still polling MPI"
#pragma once

#include <chrono>
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
  bool progressed = false;    // its MPI heartbeat moved between the two reads (the caller: true)
  bool answered = true;       // false: the entry could not be read; the other fields mean nothing
};

// Members by what holds the call up, each list in group order. A member that completed the call
// is in none of them.
struct Attribution {
  std::vector<int> missing;          // never entered the call ...
  std::vector<int> missing_stalled;  // ... and of those, made no MPI progress either
  std::vector<int> gave_up_earlier;  // never entered it: gave up an earlier call on the group
  std::vector<int> stalled;          // entered it (or a later call), not completed, no progress
  std::vector<int> waiting;          // entered it, not completed, still polling MPI
  std::vector<int> gave_up;          // entered it and gave it up after their own timeout
  std::vector<int> unanswered;       // entry unreadable: state unknown
};

// REQUIRES: number >= 1 (the timed-out call's number: call #k -> k + 1).
// A member that entered a later call has entered this one too (calls start in order), so
// "joined" is entered >= number, whatever the member's latest call.
Attribution attribute(int64_t number, std::span<const MemberRecord> members);

// The timeout line's tail: "ranks [3] never joined", "every member joined, ranks [2] joined but
// have not completed it and made no MPI progress in 500 ms (...)", ... `window` is the time
// between the two reads; `mismatch` ("collective mismatch: ...") or empty. Names every member
// that holds the call up; names nobody only when every member completed the call.
std::string attribution_text(const Attribution& a, std::chrono::milliseconds window,
                             const std::string& mismatch);

}  // namespace collectives::detail
