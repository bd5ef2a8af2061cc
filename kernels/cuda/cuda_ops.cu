// CUDA implementations of the primitives in cuda_ops.h. No fmt here (nvcc 13 cannot compile
// fmt 9): messages are built with std::string.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/device_guard.h"
#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/detail/layout.h"
#include "kernels/device.h"
#include "kernels/error.h"

namespace kernels {
namespace {

struct Probe {
  int count = 0;
  std::string reason;  // why count is 0
};

// cudaGetDeviceCount fails with cudaErrorNoDevice (100) on a host with a driver and no GPU,
// and cudaErrorInsufficientDriver (35) without a driver; it then leaves the count unwritten.
const Probe& probe() {
  static const Probe result = [] {
    Probe p;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      p.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + ": " +
                 cudaGetErrorString(err);
      (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
      n = 0;
    } else if (n == 0) {
      p.reason = "cudaGetDeviceCount found no GPU";
    }
    p.count = n;
    return p;
  }();
  return result;
}

std::string device_name(int device) { return "cuda:" + std::to_string(device); }

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(what + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

// ---- kernels ----

struct Layout2 {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t stride[2][kMaxDims];  // [0] destination, [1] source
};

__device__ __forceinline__ void offsets_of(const Layout2& l, int64_t i, int64_t& dst,
                                           int64_t& src) {
  dst = 0;
  src = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    const int64_t idx = i % l.shape[d];
    i /= l.shape[d];
    dst += idx * l.stride[0][d];
    src += idx * l.stride[1][d];
  }
}

template <class V>
__device__ void store_as(char* p, DType dtype, V v) {
  using detail::narrow_to;
  switch (dtype) {
    case DType::kF32: *reinterpret_cast<float*>(p) = narrow_to<float>(v); return;
    case DType::kF64: *reinterpret_cast<double*>(p) = narrow_to<double>(v); return;
    case DType::kBF16: *reinterpret_cast<BFloat16*>(p) = narrow_to<BFloat16>(v); return;
    case DType::kF16: *reinterpret_cast<Half*>(p) = narrow_to<Half>(v); return;
    case DType::kI32: *reinterpret_cast<int32_t*>(p) = narrow_to<int32_t>(v); return;
    case DType::kI64: *reinterpret_cast<int64_t*>(p) = narrow_to<int64_t>(v); return;
    case DType::kU8: *reinterpret_cast<uint8_t*>(p) = narrow_to<uint8_t>(v); return;
    case DType::kF8E4M3: *reinterpret_cast<Float8E4M3*>(p) = narrow_to<Float8E4M3>(v); return;
    case DType::kF8E5M2: *reinterpret_cast<Float8E5M2*>(p) = narrow_to<Float8E5M2>(v); return;
  }
}

template <class S>
__device__ __forceinline__ S load(const char* p) {
  return *reinterpret_cast<const S*>(p);
}

// The source and destination dtypes are uniform across the grid, so the switches do not diverge.
__global__ void cast_kernel(char* dst, DType dst_dtype, int dst_size, const char* src,
                            DType src_dtype, int src_size, Layout2 l, int64_t n) {
  using detail::widen;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t d_off, s_off;
    offsets_of(l, i, d_off, s_off);
    char* d = dst + d_off * dst_size;
    const char* s = src + s_off * src_size;
    switch (src_dtype) {
      case DType::kF32: store_as(d, dst_dtype, widen(load<float>(s))); break;
      case DType::kF64: store_as(d, dst_dtype, widen(load<double>(s))); break;
      case DType::kBF16: store_as(d, dst_dtype, widen(load<BFloat16>(s))); break;
      case DType::kF16: store_as(d, dst_dtype, widen(load<Half>(s))); break;
      case DType::kI32: store_as(d, dst_dtype, widen(load<int32_t>(s))); break;
      case DType::kI64: store_as(d, dst_dtype, widen(load<int64_t>(s))); break;
      case DType::kU8: store_as(d, dst_dtype, widen(load<uint8_t>(s))); break;
      case DType::kF8E4M3: store_as(d, dst_dtype, widen(load<Float8E4M3>(s))); break;
      case DType::kF8E5M2: store_as(d, dst_dtype, widen(load<Float8E5M2>(s))); break;
    }
  }
}

// Same dtype: moves words of W bytes unchanged (NaN payloads kept, like the CPU memcpy path).
template <class W>
__global__ void move_kernel(W* dst, const W* src, Layout2 l, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t d_off, s_off;
    offsets_of(l, i, d_off, s_off);
    dst[d_off] = src[s_off];
  }
}

template <class W>
__global__ void fill_kernel(W* dst, W value, Layout2 l, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t d_off, unused;
    offsets_of(l, i, d_off, unused);
    dst[d_off] = value;
  }
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::min<int64_t>(blocks, 65535));
}

Layout2 make_layout(const Dims& shape, const Dims& dst_strides, const Dims& src_strides) {
  const auto space = detail::coalesce<2>(shape, {dst_strides, src_strides});
  Layout2 l{};
  l.ndim = space.shape.size();
  for (int d = 0; d < l.ndim; ++d) {
    l.shape[d] = space.shape[d];
    l.stride[0][d] = space.strides[0][d];
    l.stride[1][d] = space.strides[1][d];
  }
  return l;
}

// NOTE [compute stream] The kernels layer queues all its work on one stream per device, created
// non-blocking on first use (so it never waits for, nor holds up, the legacy default stream or
// the communicators' streams) and kept until the process exits, as the cuBLAS handles are. One
// stream per device keeps every kernel and copy in issue order across the threads that use the
// device, exactly as the legacy default stream did.
cudaStream_t compute_stream(int device) {
  static auto* const streams = new std::pair<std::mutex, std::map<int, cudaStream_t>>();  // never freed
  std::lock_guard lk(streams->first);
  auto it = streams->second.find(device);
  if (it != streams->second.end()) return it->second;
  int previous = -1;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  if (previous != device) check(cudaSetDevice(device), "cudaSetDevice(" + device_name(device) + ")");
  cudaStream_t s = nullptr;
  const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (previous != device) (void)cudaSetDevice(previous);
  check(err, "cudaStreamCreateWithFlags (the compute stream of " + device_name(device) + ")");
  streams->second.emplace(device, s);
  return s;
}

void check_launch(const char* kernel, int device) {
  check(cudaGetLastError(), std::string("launching ") + kernel + " on " + device_name(device));
}

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() { return probe().count; }

namespace detail {

void cuda_check_device(int device) {
  if (device < 0) {
    throw InvalidArgument("invalid CUDA device index " + std::to_string(device) +
                          ": expected 0 or more");
  }
  const Probe& p = probe();
  if (p.count == 0) {
    throw Unsupported(device_name(device) + " requested but no GPU is usable (" + p.reason + ")");
  }
  if (device >= p.count) {
    throw Unsupported(device_name(device) + " requested but only " + std::to_string(p.count) +
                      " GPU(s) are visible (expected cuda:0..cuda:" + std::to_string(p.count - 1) +
                      ")");
  }
}

DeviceGuard::DeviceGuard(int device) {
  cuda_check_device(device);
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ == device) {
    previous_ = -1;
    return;
  }
  check(cudaSetDevice(device), "cudaSetDevice(" + device_name(device) + ")");
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

void* cuda_malloc(size_t nbytes, int device) {
  DeviceGuard guard(device);  // checks the device
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, nbytes);
  if (err == cudaErrorMemoryAllocation) {  // out of device memory: a resource error, not a bug
    (void)cudaGetLastError();
    throw ResourceError("cannot allocate " + std::to_string(nbytes) + " bytes on " + device_name(device) +
                        ": out of memory (cudaErrorMemoryAllocation)");
  }
  check(err, "cudaMalloc of " + std::to_string(nbytes) + " bytes on " + device_name(device));
  return ptr;
}

void cuda_free(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device) (void)cudaSetDevice(device);
  (void)cudaFree(ptr);
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

int64_t cuda_available_bytes(int device) noexcept {
  int count = 0;
  if (device < 0 || cudaGetDeviceCount(&count) != cudaSuccess || device >= count) {
    (void)cudaGetLastError();
    return -1;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device) (void)cudaSetDevice(device);
  size_t free_bytes = 0, total = 0;
  const bool ok = cudaMemGetInfo(&free_bytes, &total) == cudaSuccess;
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
  return ok ? static_cast<int64_t>(free_bytes) : -1;
}

void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  DeviceGuard guard(device);  // checks the device
  const std::string what =
      "cudaMemcpyAsync of " + std::to_string(nbytes) + " bytes " + to_string(src_device) + " -> " + to_string(dst_device);
  // Between two GPUs: the source's queued work first (it runs on its own compute stream).
  const bool two_gpus = dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index;
  if (two_gpus) {
    DeviceGuard src_guard(src_device.index);
    check(cudaStreamSynchronize(compute_stream(src_device.index)), what + " (waiting for the source)");
  }
  const cudaStream_t s = compute_stream(device);
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s), what);
  // A copy that involves the host, or another GPU, is complete on return; device-to-device
  // copies on one GPU are ordered by its compute stream like any kernel.
  if (dst_device.is_cpu() || src_device.is_cpu() || two_gpus) check(cudaStreamSynchronize(s), what);
}

void cuda_copy_cast(void* dst, DType dst_dtype, const Dims& dst_strides, const void* src,
                    DType src_dtype, const Dims& src_strides, const Dims& shape, int device) {
  const int64_t n = shape.product();
  if (n == 0) return;
  DeviceGuard guard(device);  // checks the device
  const Layout2 l = make_layout(shape, dst_strides, src_strides);
  const unsigned blocks = blocks_for(n);
  if (dst_dtype == src_dtype) {
    switch (itemsize(dst_dtype)) {
      case 1:
        move_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint8_t*>(dst),
                                          static_cast<const uint8_t*>(src), l, n);
        break;
      case 2:
        move_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint16_t*>(dst),
                                          static_cast<const uint16_t*>(src), l, n);
        break;
      case 4:
        move_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint32_t*>(dst),
                                          static_cast<const uint32_t*>(src), l, n);
        break;
      default:
        move_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint64_t*>(dst),
                                          static_cast<const uint64_t*>(src), l, n);
        break;
    }
    check_launch("move_kernel", device);
    return;
  }
  cast_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(
      static_cast<char*>(dst), dst_dtype, static_cast<int>(itemsize(dst_dtype)),
      static_cast<const char*>(src), src_dtype, static_cast<int>(itemsize(src_dtype)), l, n);
  check_launch("cast_kernel", device);
}

void cuda_fill(void* dst, size_t itemsize, const Dims& strides, const Dims& shape, uint64_t pattern,
               int device) {
  const int64_t n = shape.product();
  if (n == 0) return;
  DeviceGuard guard(device);  // checks the device
  const Layout2 l = make_layout(shape, strides, strides);
  const unsigned blocks = blocks_for(n);
  switch (itemsize) {
    case 1:
      fill_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint8_t*>(dst), static_cast<uint8_t>(pattern),
                                        l, n);
      break;
    case 2:
      fill_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint16_t*>(dst), static_cast<uint16_t>(pattern),
                                        l, n);
      break;
    case 4:
      fill_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint32_t*>(dst), static_cast<uint32_t>(pattern),
                                        l, n);
      break;
    default: fill_kernel<<<blocks, kThreads, 0, compute_stream(device)>>>(static_cast<uint64_t*>(dst), pattern, l, n); break;
  }
  check_launch("fill_kernel", device);
}

}  // namespace detail
}  // namespace kernels

// ---- reductions (same arithmetic as kernels/cpu/reduce.cpp) ----
namespace kernels {
namespace {

template <class T>
__global__ void reduce_kernel(T* acc, const T* src, int64_t n, ReduceOp op, double src_scale) {
  using C = detail::compute_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const C a = detail::cast_value<C>(acc[i]), b = detail::cast_value<C>(src[i]);
    C r = a;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        if (src_scale == 1.0) {
          r = static_cast<C>(a + b);
        } else if constexpr (std::is_floating_point_v<C>) {
          r = static_cast<C>(a + b * static_cast<C>(src_scale));
        } else {
          r = static_cast<C>(a + detail::cast_value<C>(static_cast<double>(b) * src_scale));
        }
        break;
      case ReduceOp::kProd: r = static_cast<C>(a * b); break;
      case ReduceOp::kMin: r = (b < a || b != b) ? b : a; break;
      case ReduceOp::kMax: r = (b > a || b != b) ? b : a; break;
    }
    acc[i] = detail::cast_value<T>(r);
  }
}

template <class T>
__global__ void scale_kernel(T* data, int64_t n, double factor) {
  using C = detail::compute_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    if constexpr (std::is_floating_point_v<C>)
      data[i] = detail::cast_value<T>(static_cast<C>(detail::cast_value<C>(data[i]) * static_cast<C>(factor)));
    else
      data[i] = detail::cast_value<T>(static_cast<double>(data[i]) * factor);
  }
}

}  // namespace

namespace detail {

void cuda_reduce_into(void* acc, const void* src, DType dtype, int64_t n, ReduceOp op,
                      double src_scale, int device) {
  DeviceGuard guard(device);  // checks the device
  detail::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    reduce_kernel<T><<<blocks_for(n), kThreads, 0, compute_stream(device)>>>(static_cast<T*>(acc), static_cast<const T*>(src), n, op,
                                                  src_scale);
  });
  check_launch("reduce_kernel", device);
}

void cuda_scale(void* data, DType dtype, int64_t n, double factor, int device) {
  DeviceGuard guard(device);  // checks the device
  detail::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<blocks_for(n), kThreads, 0, compute_stream(device)>>>(static_cast<T*>(data), n, factor);
  });
  check_launch("scale_kernel", device);
}

}  // namespace detail
}  // namespace kernels

// ---- batched copies (chunk_cat / split_copy) ----
namespace kernels {
namespace {

struct BatchItem {
  char* dst;
  const char* src;  // nullptr: zero fill
  DType dst_dtype, src_dtype;
  int dst_size, src_size;
  int64_t start;  // first element of this item in the batch's index space
  Layout2 l;
};

// Element i of the batch: the item whose [start, start + numel) holds i (binary search over a
// few dozen items, cached), then the same conversion as cast_kernel / move_kernel / fill_kernel.
__global__ void batch_kernel(const BatchItem* items, int count, int64_t n) {
  using detail::widen;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (items[mid].start <= i) lo = mid;
      else hi = mid - 1;
    }
    const BatchItem& it = items[lo];
    int64_t d_off, s_off;
    offsets_of(it.l, i - it.start, d_off, s_off);
    char* d = it.dst + d_off * it.dst_size;
    if (it.src == nullptr) {
      switch (it.dst_size) {
        case 1: *reinterpret_cast<uint8_t*>(d) = 0; break;
        case 2: *reinterpret_cast<uint16_t*>(d) = 0; break;
        case 4: *reinterpret_cast<uint32_t*>(d) = 0; break;
        default: *reinterpret_cast<uint64_t*>(d) = 0; break;
      }
      continue;
    }
    const char* s = it.src + s_off * it.src_size;
    if (it.dst_dtype == it.src_dtype) {
      switch (it.dst_size) {
        case 1: *reinterpret_cast<uint8_t*>(d) = load<uint8_t>(s); break;
        case 2: *reinterpret_cast<uint16_t*>(d) = load<uint16_t>(s); break;
        case 4: *reinterpret_cast<uint32_t*>(d) = load<uint32_t>(s); break;
        default: *reinterpret_cast<uint64_t*>(d) = load<uint64_t>(s); break;
      }
      continue;
    }
    switch (it.src_dtype) {
      case DType::kF32: store_as(d, it.dst_dtype, widen(load<float>(s))); break;
      case DType::kF64: store_as(d, it.dst_dtype, widen(load<double>(s))); break;
      case DType::kBF16: store_as(d, it.dst_dtype, widen(load<BFloat16>(s))); break;
      case DType::kF16: store_as(d, it.dst_dtype, widen(load<Half>(s))); break;
      case DType::kI32: store_as(d, it.dst_dtype, widen(load<int32_t>(s))); break;
      case DType::kI64: store_as(d, it.dst_dtype, widen(load<int64_t>(s))); break;
      case DType::kU8: store_as(d, it.dst_dtype, widen(load<uint8_t>(s))); break;
      case DType::kF8E4M3: store_as(d, it.dst_dtype, widen(load<Float8E4M3>(s))); break;
      case DType::kF8E5M2: store_as(d, it.dst_dtype, widen(load<Float8E5M2>(s))); break;
    }
  }
}

}  // namespace

namespace detail {

void cuda_copy_batch(const std::vector<CopyItem>& items, int device) {
  std::vector<BatchItem> batch;
  batch.reserve(items.size());
  int64_t n = 0;
  for (const CopyItem& it : items) {
    const int64_t numel = it.shape.product();
    if (numel == 0) continue;
    BatchItem b{};
    b.dst = static_cast<char*>(it.dst);
    b.src = static_cast<const char*>(it.src);
    b.dst_dtype = it.dst_dtype;
    b.src_dtype = it.src ? it.src_dtype : it.dst_dtype;
    b.dst_size = static_cast<int>(itemsize(b.dst_dtype));
    b.src_size = static_cast<int>(itemsize(b.src_dtype));
    b.start = n;
    b.l = make_layout(it.shape, it.dst_strides, it.src ? it.src_strides : it.dst_strides);
    batch.push_back(b);
    n += numel;
  }
  if (n == 0) return;
  DeviceGuard guard(device);  // checks the device
  // The descriptors travel in stream-ordered memory on the compute stream (NOTE [cuda
  // ordering]): allocated, filled, used and freed in order without a device-wide sync.
  const size_t bytes = batch.size() * sizeof(BatchItem);
  void* table = nullptr;
  const cudaStream_t s = compute_stream(device);
  check(cudaMallocAsync(&table, bytes, s), "cudaMallocAsync of the copy batch table");
  check(cudaMemcpyAsync(table, batch.data(), bytes, cudaMemcpyHostToDevice, s), "copying the copy batch table");
  batch_kernel<<<blocks_for(n), kThreads, 0, compute_stream(device)>>>(static_cast<const BatchItem*>(table), static_cast<int>(batch.size()),
                                            n);
  check_launch("batch_kernel", device);
  check(cudaFreeAsync(table, s), "cudaFreeAsync of the copy batch table");
}

void* cuda_compute_stream(int device) {
  cuda_check_device(device);
  return compute_stream(device);
}

}  // namespace detail
}  // namespace kernels
