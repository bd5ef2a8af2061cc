// Tracing across processes (kernels/trace.h): an mpi job's ranks each record into their own
// Tracer; gather_trace brings every rank's events to world rank 0 for one file.
//
//   kernels::Tracer tracer;
//   world->set_tracer(&tracer);
//   ... train ...
//   std::optional<kernels::File> file = collectives::create_trace_file(*world, "step.json");  // before the work
//   world->set_tracer(&tracer);
//   ... train ...
//   collectives::write_trace(*world, tracer, file);   // every rank calls it; rank 0 writes
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "kernels/trace.h"

namespace collectives {

// Collective over `world`: every member calls it (with the tracer of its process). Returns every
// member's events (in member order) on member 0, nothing on the others. Two all_gathers (the
// sizes, then the encoded events padded to the largest); each process's own events are taken
// before the gather (which is itself recorded, after).
std::vector<kernels::TraceEvent> gather_trace(Communicator& world, const kernels::Tracer& tracer);

// Collective over `world`: member 0 creates `path` (kernels::File::create); every member learns
// whether it could, and all throw InvalidArgument when not (member 0 with File::create's message,
// which names the path and why; the others naming the path). Returns the file on member 0.
std::optional<kernels::File> create_trace_file(Communicator& world, const std::string& path);

// Collective over `world`: detaches the tracer from `world`, gathers every member's events and
// writes them into `file` on member 0 (kernels::write_chrome_trace).
void write_trace(Communicator& world, const kernels::Tracer& tracer, std::optional<kernels::File>& file);

}  // namespace collectives
