// The mesh layouts the checkpoint tests save and load under (checkpoint_test.cpp,
// save_plan_test.cpp).
#pragma once

#include <string>
#include <vector>

#include "kernels/dims.h"

namespace checkpoint_tests {

// One layout: a mesh shape and the placements of 2-D tensors (1-D tensors get the same with
// dim-1 shards replaced by Replicate).
struct Layout {
  std::string name;
  kernels::Dims mesh;
  std::string placements2d;
  std::string placements1d;
};

inline const std::vector<Layout>& layouts() {
  static const std::vector<Layout> l = {
      {"fsdp4", {4}, "S(0)", "S(0)"},
      {"tp4-col", {4}, "S(1)", "R"},
      {"fsdp3", {3}, "S(0)", "S(0)"},
      {"one", {1}, "R", "R"},
      {"hsdp2x2", {2, 2}, "R,S(0)", "R,S(0)"},
      {"fsdp-x-tp-rowwise", {2, 2}, "S(0),S(1)", "S(0),R"},
      {"fsdp-x-tp-strided", {2, 2}, "_S(0,2),S(0)", "_S(0,2),S(0)"},
      {"nested-uneven", {2, 2}, "S(0),S(0)", "S(0),S(0)"},
      {"replicate3", {3}, "R", "R"},
      {"strided4", {4}, "_S(0,2)", "_S(0,2)"},
  };
  return l;
}

}  // namespace checkpoint_tests
