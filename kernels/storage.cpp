#include "kernels/storage.h"

#include <new>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/error.h"

namespace kernels {
namespace {

constexpr std::align_val_t kCpuAlignment{64};

void* allocate_bytes(size_t nbytes, Device device) {
  if (nbytes == 0) return nullptr;
  if (device.is_cuda()) return detail::cuda_malloc(nbytes, device.index);
  // Round up so the block is a whole number of cache lines (aligned_alloc's rule, kept here too).
  const size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = ::operator new(rounded, kCpuAlignment, std::nothrow);
  if (p == nullptr) {
    throw Error("cannot allocate " + std::to_string(nbytes) + " bytes on cpu: out of memory");
  }
  return p;
}

void free_bytes(void* p, Device device) noexcept {
  if (p == nullptr) return;
  if (device.is_cuda()) {
    detail::cuda_free(p, device.index);
  } else {
    ::operator delete(p, kCpuAlignment);
  }
}

}  // namespace

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {}

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device) {
  if (device.is_cuda()) detail::cuda_check_device(device.index);  // even for zero bytes
  std::shared_ptr<Storage> s(new Storage(nbytes, device));
  s->reallocate();
  return s;
}

Storage::~Storage() { free_bytes(data_, device_); }

void* Storage::data() const {
  if (!allocated_) {
    throw InvalidArgument("storage is freed (" + std::to_string(nbytes_) + " bytes on " +
                          to_string(device_) + "): reallocate it before use");
  }
  return data_;
}

void Storage::free() {
  free_bytes(data_, device_);
  data_ = nullptr;
  allocated_ = false;
}

void Storage::reallocate() {
  if (allocated_) return;
  data_ = allocate_bytes(nbytes_, device_);
  allocated_ = true;
}

void Storage::resize(size_t nbytes) {
  free();
  nbytes_ = nbytes;
  reallocate();
}

}  // namespace kernels
