// Small statistics for the numbers programs report (step times, bandwidths).
//
//   program::median({3, 1, 2})     == 2
//   program::median({4, 1, 3, 2})  == 2.5   (the mean of the two middle values)
//   program::median({})            == 0
#pragma once

#include <algorithm>
#include <vector>

namespace program {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace program
