// Storage: a block of memory on one device, shared by every Tensor viewing it. It can be
// freed and re-allocated in place while keeping its identity, so views taken before a free are
// valid again after the re-allocation (this is how FSDP frees unsharded parameters between
// forward and backward without invalidating the parameter views).
//   auto s = Storage::allocate(64, Device::cpu());  s->free();  s->allocated() == false
//   s->reallocate();  s->allocated() == true;  s->nbytes() == 64   (contents are unspecified)
#pragma once

#include <cstddef>
#include <memory>

#include "kernels/device.h"

namespace kernels {

class Allocator;

class Storage {
 public:
  // Zero bytes allocates nothing but still counts as allocated. With an allocator, every
  // (re)allocation and free of this storage goes through it (kept alive by the storage).
  static std::shared_ptr<Storage> allocate(size_t nbytes, Device device,
                                           std::shared_ptr<Allocator> allocator = nullptr);
  // For allocate() only (make_shared needs a public constructor: one allocation, not two).
  class Key {
    friend class Storage;
    Key() = default;
  };
  Storage(Key, size_t nbytes, Device device, std::shared_ptr<Allocator> allocator);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool allocated() const { return allocated_; }
  // Raw pointer; throws InvalidArgument when the storage is freed.
  void* data() const;

  // Releases the memory; nbytes() is kept so reallocate() restores the same size.
  void free();
  // Allocates nbytes() again after free(); a no-op when already allocated.
  void reallocate();
  // Frees and allocates a new size (contents unspecified).
  void resize(size_t nbytes);

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  bool allocated_ = false;
  std::shared_ptr<Allocator> allocator_;
};

}  // namespace kernels
