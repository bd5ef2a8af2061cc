// Tracing across processes (kernels/trace.h): an mpi job's ranks each record into their own
// Tracer; gather_trace brings every rank's events to world rank 0 for one file.
//
//   kernels::Tracer tracer;
//   world->set_tracer(&tracer);
//   ... train ...
//   std::vector<kernels::TraceEvent> all = collectives::gather_trace(*world, tracer);  // every rank calls it
//   if (world->rank() == 0) kernels::write_chrome_trace(file, all);
#pragma once

#include <vector>

#include "collectives/communicator.h"
#include "kernels/trace.h"

namespace collectives {

// Collective over `world`: every member calls it (with the tracer of its process). Returns every
// member's events (in member order) on member 0, nothing on the others. Two all_gathers (the
// sizes, then the encoded events padded to the largest); each process's own events are taken
// before the gather (which is itself recorded, after).
std::vector<kernels::TraceEvent> gather_trace(Communicator& world, const kernels::Tracer& tracer);

}  // namespace collectives
