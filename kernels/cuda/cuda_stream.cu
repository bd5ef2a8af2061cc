// CUDA implementations of kernels/cuda/cuda_stream.h. No fmt here (nvcc 13 cannot compile fmt 9).
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/device_guard.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(std::string(what) + " on cuda:" + std::to_string(device) + " failed: " + cudaGetErrorName(err) +
                ": " + cudaGetErrorString(err));
  }
}

cudaStream_t as_stream(void* s) { return s == nullptr ? cudaStreamLegacy : static_cast<cudaStream_t>(s); }

// Released events are kept and recorded again (a record is cheap, a create is not): a caching
// allocator records one per block it gets back. Not thread-safe: its owner serialises calls.
class CudaEventOps final : public EventOps {
 public:
  explicit CudaEventOps(int device) : device_(device) {}
  ~CudaEventOps() override {
    for (void* ev : spare_) cuda_event_destroy(ev, device_);
  }
  EventId record(StreamId stream) override {
    void* ev = nullptr;
    if (spare_.empty()) {
      ev = cuda_event_create(device_);
    } else {
      ev = spare_.back();
      spare_.pop_back();
    }
    try {
      cuda_event_record(ev, reinterpret_cast<void*>(stream), device_);
    } catch (...) {
      cuda_event_destroy(ev, device_);
      throw;
    }
    return reinterpret_cast<EventId>(ev);
  }
  bool done(EventId event) override { return cuda_event_query(reinterpret_cast<void*>(event), device_); }
  void release(EventId event) noexcept override {
    void* ev = reinterpret_cast<void*>(event);
    try {
      if (spare_.size() < kMaxSpare) {
        spare_.push_back(ev);
        return;
      }
    } catch (...) {  // no room in the list: destroy it
    }
    cuda_event_destroy(ev, device_);
  }

 private:
  static constexpr size_t kMaxSpare = 4096;
  int device_;
  std::vector<void*> spare_;
};

}  // namespace

void* cuda_stream_create(int device) {
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", device);
  return s;
}

void cuda_stream_destroy(void* stream, int device) noexcept {
  if (stream == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device) (void)cudaSetDevice(device);
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

void cuda_stream_synchronize(void* stream, int device) {
  DeviceGuard guard(device);
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize", device);
}

void* cuda_event_create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", device);
  return e;
}

void cuda_event_destroy(void* event, int) noexcept {
  if (event == nullptr) return;
  (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));  // any device may destroy it
  (void)cudaGetLastError();
}

void cuda_event_record(void* event, void* stream, int device) {
  DeviceGuard guard(device);
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)), "cudaEventRecord", device);
}

bool cuda_event_query(void* event, int device) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery", device);
  return true;
}

void cuda_event_synchronize(void* event, int device) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize", device);
}

void cuda_stream_wait_event(void* stream, void* event, int device) {
  DeviceGuard guard(device);
  check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent", device);
}

void* cuda_copy_stream(int device) {
  cuda_check_device(device);
  static auto* const streams = new std::pair<std::mutex, std::map<int, void*>>();  // never freed
  std::lock_guard lk(streams->first);
  auto it = streams->second.find(device);
  if (it != streams->second.end()) return it->second;
  void* s = cuda_stream_create(device);
  streams->second.emplace(device, s);
  return s;
}

void cuda_memcpy_async_host(void* dst, const void* src, size_t nbytes, void* stream, int device) {
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, as_stream(stream)), "cudaMemcpyAsync (host)", device);
}

void* cuda_host_alloc(size_t nbytes) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, nbytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw ResourceError("cudaHostAlloc of " + std::to_string(nbytes) + " bytes of pinned host memory failed: " +
                        cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return p;
}

void cuda_host_free(void* p) noexcept {
  if (p == nullptr) return;
  (void)cudaFreeHost(p);
  (void)cudaGetLastError();
}

void cuda_memcpy_async(void* dst, const void* src, size_t nbytes, void* stream, int device) {
  DeviceGuard guard(device);
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, as_stream(stream)), "cudaMemcpyAsync", device);
}

std::unique_ptr<EventOps> cuda_event_ops(int device) {
  cuda_check_device(device);
  return std::make_unique<CudaEventOps>(device);
}

}  // namespace kernels::detail
