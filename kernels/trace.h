// A recorder of what a step did, for a Chrome trace (chrome://tracing, ui.perfetto.dev): complete
// events {name, category, process = global rank, lane, start, duration, arguments}. Nothing is
// global: a program makes one Tracer and hands it to what it wants traced (a Communicator's
// set_tracer, which its splits inherit; its own TraceSpans). Everything traced takes a Tracer*
// that may be null: then it costs one branch and allocates nothing.
//
//   kernels::Tracer tracer;
//   {
//     kernels::TraceSpan span(&tracer, /*pid=*/rank, "compute", "forward");
//     model.forward(x);
//   }                                       // one event: "forward" on lane "compute" of rank
//   std::string json = kernels::chrome_trace_json(tracer.events());
//
// Lanes become the threads of a rank's process in the viewer, in this order: "compute",
// "waits", "copies", then the rest (the communicators' "comm <group>" lanes) by name.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/file_io.h"

namespace kernels {

struct TraceEvent {
  std::string name, category, lane;
  int pid = 0;          // the global rank
  int64_t ts_ns = 0;    // start: steady_clock nanoseconds since its epoch (shared by the
  int64_t dur_ns = 0;   // processes of one machine, so mpi ranks line up)
  std::vector<std::pair<std::string, std::string>> args;   // text arguments
  std::vector<std::pair<std::string, int64_t>> numbers;    // numeric arguments ("bytes")
};

// Thread-safe: the ranks of a local world (threads) share one.
class Tracer {
 public:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void record(TraceEvent e) {
    std::lock_guard lk(mu_);
    events_.push_back(std::move(e));
  }
  std::vector<TraceEvent> events() const {
    std::lock_guard lk(mu_);
    return events_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
};

// Records [construction, destruction) as one event. REQUIRES: the views outlive the span.
class TraceSpan {
 public:
  TraceSpan(Tracer* tracer, int pid, std::string_view lane, std::string_view name)
      : tracer_(tracer), pid_(pid), lane_(lane), name_(name), start_ns_(tracer != nullptr ? Tracer::now_ns() : 0) {}
  ~TraceSpan() {
    if (tracer_ == nullptr) return;
    try {
      tracer_->record({.name = std::string(name_), .category = std::string(lane_), .lane = std::string(lane_),
                       .pid = pid_, .ts_ns = start_ns_, .dur_ns = Tracer::now_ns() - start_ns_});
    } catch (...) {  // NOLINT: a destructor never throws; losing one event is harmless
    }
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  int pid_;
  std::string_view lane_, name_;
  int64_t start_ns_;
};

// The Chrome trace file's text: {"traceEvents": [...]}, one "X" (complete) event per event, with
// times in microseconds from the earliest event, and "M" (metadata) events naming each process
// "rank N" and each lane.
std::string chrome_trace_json(std::span<const TraceEvent> events);
// Writes chrome_trace_json(events) to `file` (made with File::create early, so that a path that
// cannot be written fails before the work: InvalidArgument naming it) and closes it.
void write_chrome_trace(File& file, std::span<const TraceEvent> events);
// Events to text and back (to gather them from other processes). decode throws InvalidArgument
// on text that encode did not make.
std::string encode_trace(std::span<const TraceEvent> events);
std::vector<TraceEvent> decode_trace(std::string_view text);

}  // namespace kernels
