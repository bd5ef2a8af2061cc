// Every placement list over a mesh: the Cartesian product of per-mesh-dim options.
#pragma once

#include <vector>

#include "dtensor/placement.h"

namespace testing_support {

inline std::vector<dtensor::Placements> placement_lists(int mesh_ndim,
                                                        const std::vector<dtensor::Placement>& options) {
  std::vector<dtensor::Placements> out = {{}};
  for (int m = 0; m < mesh_ndim; ++m) {
    std::vector<dtensor::Placements> next;
    for (const auto& l : out)
      for (const auto& o : options) {
        next.push_back(l);
        next.back().push_back(o);
      }
    out = std::move(next);
  }
  return out;
}

}  // namespace testing_support
