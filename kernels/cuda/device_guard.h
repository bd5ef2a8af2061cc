// Internal to kernels/cuda and collectives/nccl: makes a CUDA device current for a scope and
// then restores the one that was. Plain C++ (headers include no CUDA header: the layering rule,
// tests/lint/layering_test.py); implemented in cuda_ops.cu, so only code compiled in CUDA builds
// may use it.
//
//   {
//     kernels::detail::DeviceGuard guard(device);   // cudaSetDevice(device) unless current
//     ... launches and allocations go to `device` ...
//   }                                               // the previous device is current again
#pragma once

namespace kernels::detail {

class DeviceGuard {
 public:
  // Throws InvalidArgument / Unsupported for a device that cannot be used (cuda_check_device),
  // kernels::Error naming the CUDA error when it cannot be made current.
  explicit DeviceGuard(int device);
  ~DeviceGuard();  // never throws
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // the device to restore; -1: it was already current
};

}  // namespace kernels::detail
