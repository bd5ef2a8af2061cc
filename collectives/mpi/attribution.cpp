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
        if (!m.progressed) a.missing_stalled.push_back(m.rank);
      }
    } else if (m.completed >= number) {
      continue;  // did its part
    } else if (m.gave_up >= number) {
      a.gave_up.push_back(m.rank);
    } else if (m.progressed) {
      a.waiting.push_back(m.rank);
    } else {
      a.stalled.push_back(m.rank);
    }
  }
  return a;
}

std::string attribution_text(const Attribution& a, std::chrono::milliseconds window,
                             const std::string& mismatch) {
  std::vector<std::string> parts;
  if (!a.missing.empty()) {
    std::string s = ranks_text(a.missing) + " never joined";
    if (!a.missing_stalled.empty())
      s += fmt::format(" ({} made no MPI progress in {} ms)", ranks_text(a.missing_stalled), window.count());
    parts.push_back(std::move(s));
  }
  if (!a.gave_up_earlier.empty())
    parts.push_back(ranks_text(a.gave_up_earlier) + " never joined: they gave up an earlier call on the group");
  if (!a.stalled.empty())
    parts.push_back(fmt::format(
        "{} joined but have not completed it and made no MPI progress in {} ms (stopped, or not calling into MPI)",
        ranks_text(a.stalled), window.count()));
  if (!a.waiting.empty()) parts.push_back(ranks_text(a.waiting) + " have not completed it and are still polling MPI");
  if (!a.gave_up.empty()) parts.push_back(ranks_text(a.gave_up) + " joined but gave it up after their own timeout");
  if (!mismatch.empty()) parts.push_back(mismatch);
  const bool all_joined = a.missing.empty() && a.gave_up_earlier.empty() && a.unanswered.empty();
  const bool inside = !a.stalled.empty() || !a.waiting.empty() || !a.gave_up.empty();
  if (all_joined && !inside) return "every member has completed it (it completed as the wait ran out)";
  // Everyone inside is alive and polling: the members disagree about the call, or wait in a cycle.
  if (all_joined && a.stalled.empty())
    parts.back() += " (MPI does not check that members pass matching counts, dtypes, ops and roots)";
  if (!a.unanswered.empty())
    parts.push_back(ranks_text(a.unanswered) + " did not answer the progress query (state unknown)");
  return fmt::format("{}{}", all_joined ? "every member joined, " : "", fmt::join(parts, "; "));
}

}  // namespace collectives::detail
