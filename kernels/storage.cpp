#include "kernels/storage.h"

#include <new>
#include <string>

#include "kernels/allocator.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/error.h"

namespace kernels {

Storage::Storage(Key, size_t nbytes, Device device, std::shared_ptr<Allocator> allocator)
    : nbytes_(nbytes), device_(device), allocator_(std::move(allocator)) {}

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device, std::shared_ptr<Allocator> allocator) {
  if (device.is_cuda()) detail::cuda_check_device(device.index);  // even for zero bytes
  auto s = std::make_shared<Storage>(Key{}, nbytes, device, std::move(allocator));
  s->reallocate();
  return s;
}

Storage::~Storage() { release(); }

void Storage::release() noexcept {
  if (data_ == nullptr) return;
  if (allocator_) allocator_->deallocate(data_, nbytes_, device_);
  else system_deallocate(data_, nbytes_, device_);
  data_ = nullptr;
}

void* Storage::data() const {
  if (!allocated_) {
    throw InvalidArgument("storage is freed (" + std::to_string(nbytes_) + " bytes on " +
                          to_string(device_) + "): reallocate it before use");
  }
  return data_;
}

void Storage::free() {
  release();
  allocated_ = false;
}

void Storage::reallocate() {
  if (allocated_) return;
  if (nbytes_ > 0) data_ = allocator_ ? allocator_->allocate(nbytes_, device_) : system_allocate(nbytes_, device_);
  allocated_ = true;
}

void Storage::resize(size_t nbytes) {
  free();
  nbytes_ = nbytes;
  reallocate();
}

}  // namespace kernels
