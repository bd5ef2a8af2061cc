#include "kernels/trace.h"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "kernels/error.h"

namespace kernels {

namespace {

int lane_rank(const std::string& lane) {
  if (lane == "compute") return 0;
  if (lane == "waits") return 1;
  if (lane == "copies") return 2;
  return 3;
}

nlohmann::json args_of(const TraceEvent& e) {
  nlohmann::json args = nlohmann::json::object();
  for (const auto& [k, v] : e.args) args[k] = v;
  for (const auto& [k, v] : e.numbers) args[k] = v;
  return args;
}

}  // namespace

std::string chrome_trace_json(std::span<const TraceEvent> events) {
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const TraceEvent& e : events) origin = std::min(origin, e.ts_ns);
  // tid per (pid, lane): lanes in lane_rank order, then by name.
  std::map<std::tuple<int, int, std::string>, int> tids;
  for (const TraceEvent& e : events) tids.emplace(std::tuple{e.pid, lane_rank(e.lane), e.lane}, 0);
  nlohmann::json out = nlohmann::json::array();
  int last_pid = std::numeric_limits<int>::min(), next = 0;
  for (auto& [key, tid] : tids) {
    const auto& [pid, order, lane] = key;
    if (pid != last_pid) {
      out.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0},
                     {"args", {{"name", "rank " + std::to_string(pid)}}}});
      out.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"tid", 0},
                     {"args", {{"sort_index", pid}}}});
      last_pid = pid;
      next = 1;
    }
    tid = next++;
    out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", lane}}}});
    out.push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid}, {"tid", tid},
                   {"args", {{"sort_index", tid}}}});
  }
  // Per lane in start order, so a viewer nests them as they happened.
  std::vector<const TraceEvent*> sorted;
  sorted.reserve(events.size());
  for (const TraceEvent& e : events) sorted.push_back(&e);
  std::stable_sort(sorted.begin(), sorted.end(), [](const TraceEvent* a, const TraceEvent* b) { return a->ts_ns < b->ts_ns; });
  for (const TraceEvent* e : sorted) {
    out.push_back({{"ph", "X"}, {"name", e->name}, {"cat", e->category}, {"pid", e->pid},
                   {"tid", tids.at(std::tuple{e->pid, lane_rank(e->lane), e->lane})},
                   {"ts", static_cast<double>(e->ts_ns - origin) / 1000.0},
                   {"dur", static_cast<double>(std::max<int64_t>(0, e->dur_ns)) / 1000.0}, {"args", args_of(*e)}});
  }
  return nlohmann::json{{"traceEvents", std::move(out)}, {"displayTimeUnit", "ms"}}.dump();
}

void write_chrome_trace(File& file, std::span<const TraceEvent> events) {
  const std::string text = chrome_trace_json(events);
  file.write_at(text.data(), text.size(), 0);
  file.close();
}

std::string encode_trace(std::span<const TraceEvent> events) {
  nlohmann::json out = nlohmann::json::array();
  for (const TraceEvent& e : events)
    out.push_back({e.name, e.category, e.lane, e.pid, e.ts_ns, e.dur_ns, e.args, e.numbers});
  return out.dump();
}

std::vector<TraceEvent> decode_trace(std::string_view text) {
  std::vector<TraceEvent> events;
  try {
    const nlohmann::json in = nlohmann::json::parse(text);
    for (const nlohmann::json& j : in) {
      TraceEvent e;
      j.at(0).get_to(e.name);
      j.at(1).get_to(e.category);
      j.at(2).get_to(e.lane);
      j.at(3).get_to(e.pid);
      j.at(4).get_to(e.ts_ns);
      j.at(5).get_to(e.dur_ns);
      j.at(6).get_to(e.args);
      j.at(7).get_to(e.numbers);
      events.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(std::string("trace events: not what encode_trace writes: ") + e.what());
  }
  return events;
}

}  // namespace kernels
