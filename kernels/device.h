// Where a tensor's storage lives. CUDA devices exist only when the library was built with CUDA
// (meson option `cuda`) and a GPU is present at run time; asking for one otherwise raises
// Unsupported with the reason.
//   Device{} is the CPU;  Device::cuda(0) is the first GPU;  to_string(Device::cuda(1)) == "cuda:1"
#pragma once

#include <string>

namespace kernels {

enum class DeviceType { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device&, const Device&) = default;
};

std::string to_string(const Device& device);

// True when this library was compiled with the CUDA kernels.
bool cuda_built();
// Number of usable GPUs; 0 when not built with CUDA, when there is no driver or no GPU.
int cuda_device_count();

}  // namespace kernels
