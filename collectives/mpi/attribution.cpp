// Who holds up a timed-out mpi call (see collectives/mpi/attribution.h).
#include "collectives/mpi/attribution.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace collectives::detail {

namespace {
std::string ranks_text(const std::vector<int>& v) { return fmt::format("ranks [{}]", fmt::join(v, ",")); }
}  // namespace

Attribution attribute(int64_t number, std::span<const MemberRecord> members) {
  Attribution a;
  for (const MemberRecord& m : members) {
    if (!m.answered) {
      a.unanswered.push_back(m.rank);
    } else if (m.entered < number) {
      if (m.gave_up > 0) {
        a.gave_up_earlier.push_back(m.rank);  // poisoned: it will never enter this call
      } else {
        a.missing.push_back(m.rank);
      }
    } else if (m.completed >= number) {
      continue;  // did its part
    } else if (m.gave_up >= number) {
      a.gave_up.push_back(m.rank);
    } else {
      a.inside.push_back(m.rank);
    }
  }
  return a;
}

std::string attribution_text(const Attribution& a, const std::string& mismatch) {
  std::vector<std::string> parts;
  if (!a.missing.empty()) parts.push_back(ranks_text(a.missing) + " never joined");
  if (!a.gave_up_earlier.empty())
    parts.push_back(ranks_text(a.gave_up_earlier) + " never joined: they gave up an earlier call on the group");
  // The board cannot tell a stopped member from one waiting for it: name them all, say why.
  if (!a.inside.empty())
    parts.push_back(ranks_text(a.inside) +
                    " joined but have not completed it (a member that stopped calling into MPI stalls the others; "
                    "MPI does not check that members pass matching counts, dtypes, ops and roots)");
  if (!a.gave_up.empty()) parts.push_back(ranks_text(a.gave_up) + " joined but gave it up after their own timeout");
  if (!mismatch.empty()) parts.push_back(mismatch);
  if (!a.unanswered.empty())
    parts.push_back(ranks_text(a.unanswered) + " did not answer the progress query (state unknown)");
  const bool all_joined = a.missing.empty() && a.gave_up_earlier.empty() && a.unanswered.empty();
  if (all_joined && a.inside.empty() && a.gave_up.empty())
    return "every member has completed it (it completed as the wait ran out)";
  return fmt::format("{}{}", all_joined ? "every member joined, " : "", fmt::join(parts, "; "));
}

}  // namespace collectives::detail
