#include "kernels/device.h"

namespace kernels {

std::string to_string(const Device& device) {
  if (device.is_cpu()) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

}  // namespace kernels
