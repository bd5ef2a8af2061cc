// Ranks of a local world on a device mesh: the set-up most multi-rank tests start with. Every rank
// is a thread (collectives::run_ranks) holding a MeshComms over the whole mesh; a rank's exception
// aborts the world and is raised again after the join. Assert on the main thread (support/checks.h).
//
//   testing_support::on_mesh({2, 2}, [&](std::shared_ptr<MeshComms> comms, Communicator& world) {
//     ...  // 4 ranks, comms->dim(0) and comms->dim(1) of 2 ranks each
//   }, {"dp", "tp"});
//
// Tests that need a MeshComms with an allocator, flattened or unflattened dims, or a wrapped
// communicator build it themselves.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/mesh.h"
#include "dtensor/mesh_comms.h"

namespace testing_support {

using MeshBody = std::function<void(std::shared_ptr<dtensor::MeshComms> comms, collectives::Communicator& world)>;

// fn(comms, world) on each of mesh.size() ranks.
inline void on_mesh(const dtensor::DeviceMesh& mesh, const MeshBody& fn) {
  collectives::run_ranks(static_cast<int>(mesh.size()),
                         [&](collectives::Communicator& world) { fn(dtensor::MeshComms::create(mesh, world), world); });
}

// The same on DeviceMesh::from_shape(shape, names).
inline void on_mesh(const dtensor::Dims& shape, const MeshBody& fn, std::vector<std::string> names = {}) {
  on_mesh(dtensor::DeviceMesh::from_shape(shape, std::move(names)), fn);
}

}  // namespace testing_support
