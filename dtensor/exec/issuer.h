// Issuing a plan on this rank (NOTE [deferred plans] in executor.h): the Issuer walks the steps
// and enqueues each one's calls and copies on the communicators. Internal to dtensor/exec/.
#pragma once

#include <span>

#include "dtensor/exec/executor.h"
#include "dtensor/exec/recipe.h"

namespace dtensor {

// One tensor of a batch: its spec and its local tensor at the current step (allocated at issue,
// produced by the calls issued so far).
struct Item {
  const DTensorSpec* spec;
  Tensor local;
};

// A batch (schedules computed for this call). REQUIRES: checked by issue_batch.
ExecHandle issue_items(const MeshComms& comms, const Plan& plan, std::span<const Item> items, TensorList outs,
                       const ReducePolicy& policy);
// One tensor with its recipe. background: NOTE [background copies].
ExecHandle issue_with_recipe(const MeshComms& comms, const Plan& plan, const Recipe& recipe, Item item, Tensor out,
                             bool background);

}  // namespace dtensor
