#include "kernels/cpu/copy.h"

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/detail/convert.h"
#include "kernels/detail/dispatch.h"
#include "kernels/detail/layout.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vec.h"
#include "kernels/error.h"

namespace kernels::detail {
namespace {

using CastRow = void (*)(char* dst, int64_t dst_stride, const char* src, int64_t src_stride,
                         int64_t n);

template <class D, class S>
void cast_row(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t n) {
  D* d = reinterpret_cast<D*>(dst);
  const S* s = reinterpret_cast<const S*>(src);
  if (dst_stride == 1 && src_stride == 1) {
    for (int64_t i = 0; i < n; ++i) d[i] = cast_value<D>(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i * dst_stride] = cast_value<D>(s[i * src_stride]);
  }
}

// The 9x9 table of row kernels (only the inner loop is instantiated per pair).
CastRow select_cast_row(DType dst, DType src) {
  return dispatch_dtype(dst, [src](auto dst_tag) {
    return dispatch_dtype(src, [](auto src_tag) -> CastRow {
      return &cast_row<decltype(dst_tag), decltype(src_tag)>;
    });
  });
}

template <class W>
void fill_row(char* dst, int64_t stride, int64_t n, W value) {
  W* d = reinterpret_cast<W*>(dst);
  if (stride == 1) {
    std::fill_n(d, n, value);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i * stride] = value;
  }
}

template <class W>
void fill_words(char* dst, const StridedSpace<1>& space, W value) {
  for_each_row<1>(space, [&](const std::array<int64_t, 1>& off, int64_t n) {
    fill_row<W>(dst + off[0] * static_cast<int64_t>(sizeof(W)), space.strides[0].back(), n, value);
  });
}

template <class T>
bool allclose_impl(const T* a, const T* b, int64_t n, double rtol, double atol, bool equal_nan) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  // Chunks keep the temporaries small and let a mismatch stop the scan early.
  constexpr int64_t kChunk = 4096;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    const auto x = Eigen::Map<const Array>(a + start, len).template cast<double>();
    const auto y = Eigen::Map<const Array>(b + start, len).template cast<double>();
    const auto close =
        (x == y) || (x.isFinite() && y.isFinite() && (x - y).abs() <= atol + rtol * y.abs());
    const bool ok = equal_nan ? (close || (x.isNaN() && y.isNaN())).all() : close.all();
    if (!ok) return false;
  }
  return true;
}

template <class T>
bool equal_float(const T* a, const T* b, int64_t n) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  return (Eigen::Map<const Array>(a, n) == Eigen::Map<const Array>(b, n)).all();
}

// The last two dims are a transpose of each other: one operand is unit-stride along the last
// dim and the other along the second-to-last, both large enough for tiling to pay off.
bool is_transposed_pair(const StridedSpace<2>& space) {
  const int nd = space.shape.size();
  const auto& ds = space.strides[0];
  const auto& ss = space.strides[1];
  const bool crossed = (ds[nd - 1] == 1 && ss[nd - 2] == 1) || (ss[nd - 1] == 1 && ds[nd - 2] == 1);
  return crossed && space.shape[nd - 1] >= 16 && space.shape[nd - 2] >= 16;
}

// Copies the last two dims in kTile x kTile blocks so both operands stay in cache; the outer
// dims are walked as rows of length 1 of a reduced space.
void copy_tiled(const StridedSpace<2>& space, CastRow row, char* d, int64_t dsize, const char* s,
                int64_t ssize) {
  constexpr int64_t kTile = 32;
  const int nd = space.shape.size();
  const int64_t rows = space.shape[nd - 2];
  const int64_t cols = space.shape[nd - 1];
  const int64_t d0 = space.strides[0][nd - 2], d1 = space.strides[0][nd - 1];
  const int64_t s0 = space.strides[1][nd - 2], s1 = space.strides[1][nd - 1];
  StridedSpace<2> outer;
  for (int k = 0; k < nd - 2; ++k) {
    outer.shape.push_back(space.shape[k]);
    outer.strides[0].push_back(space.strides[0][k]);
    outer.strides[1].push_back(space.strides[1][k]);
  }
  outer.shape.push_back(1);
  outer.strides[0].push_back(1);
  outer.strides[1].push_back(1);
  for_each_row<2>(outer, [&](const std::array<int64_t, 2>& off, int64_t) {
    for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
      const int64_t i1 = std::min(rows, i0 + kTile);
      for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
        const int64_t n = std::min(cols - j0, kTile);
        for (int64_t i = i0; i < i1; ++i) {
          row(d + (off[0] + i * d0 + j0 * d1) * dsize, d1, s + (off[1] + i * s0 + j0 * s1) * ssize,
              s1, n);
        }
      }
    }
  });
}

}  // namespace

void cpu_copy_cast(void* dst, DType dst_dtype, const Dims& dst_strides, const void* src,
                   DType src_dtype, const Dims& src_strides, const Dims& shape) {
  if (shape.product() == 0) return;
  const auto space = coalesce<2>(shape, {dst_strides, src_strides});
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t dsize = static_cast<int64_t>(itemsize(dst_dtype));
  const int64_t ssize = static_cast<int64_t>(itemsize(src_dtype));

  // A single contiguous run of one dtype is a memcpy. Contiguous casts take cast_row's unit-stride
  // loop, which the compiler vectorises for f32 <-> f64 / bf16; Eigen's cast<>() is no faster
  // there (the copy is memory-bound) and would keep NaN payloads, unlike NOTE [cast rules].
  if (dst_dtype == src_dtype && space.shape.size() == 1 && space.strides[0][0] == 1 &&
      space.strides[1][0] == 1) {
    std::memcpy(d, s, static_cast<size_t>(space.shape[0] * dsize));
    return;
  }

  const CastRow row = select_cast_row(dst_dtype, src_dtype);
  const int nd = space.shape.size();
  const int64_t dst_inner = space.strides[0].back();
  const int64_t src_inner = space.strides[1].back();
  // Rows of one dtype, unit stride on both sides (sub-blocks of row-major tensors): memcpy per
  // row, as fast as a flat copy once rows are a few hundred bytes.
  if (dst_dtype == src_dtype && dst_inner == 1 && src_inner == 1) {
    for_each_row<2>(space, [&](const std::array<int64_t, 2>& off, int64_t n) {
      std::memcpy(d + off[0] * dsize, s + off[1] * ssize, static_cast<size_t>(n * dsize));
    });
    return;
  }
  // f32 <-> bf16 rows, unit stride on both sides (FSDP's mixed-precision copies): the ISA-
  // dispatched conversions of vec.h, bit-identical to cast_value (the same rounding and NaN
  // rule); this file is compiled for the baseline ISA, where cast_row runs near scalar speed.
  const bool f32_bf16 = (dst_dtype == DType::kBF16 && src_dtype == DType::kF32) ||
                        (dst_dtype == DType::kF32 && src_dtype == DType::kBF16);
  if (f32_bf16 && dst_inner == 1 && src_inner == 1) {
    const VecOps<float>& ops = vec_ops<float>();
    for_each_row<2>(space, [&](const std::array<int64_t, 2>& off, int64_t n) {
      if (dst_dtype == DType::kBF16) {
        ops.narrow_bf16(reinterpret_cast<uint16_t*>(d + off[0] * dsize), reinterpret_cast<const float*>(s + off[1] * ssize), n);
      } else {
        ops.widen_bf16(reinterpret_cast<float*>(d + off[0] * dsize), reinterpret_cast<const uint16_t*>(s + off[1] * ssize), n);
      }
    });
    return;
  }
  if (nd >= 2 && is_transposed_pair(space)) {
    copy_tiled(space, row, d, dsize, s, ssize);
    return;
  }
  for_each_row<2>(space, [&](const std::array<int64_t, 2>& off, int64_t n) {
    row(d + off[0] * dsize, dst_inner, s + off[1] * ssize, src_inner, n);
  });
}

void cpu_fill(void* dst, size_t itemsize, const Dims& strides, const Dims& shape,
              uint64_t pattern) {
  if (shape.product() == 0) return;
  const auto space = coalesce<1>(shape, {strides});
  char* d = static_cast<char*>(dst);
  switch (itemsize) {
    case 1: fill_words<uint8_t>(d, space, static_cast<uint8_t>(pattern)); break;
    case 2: fill_words<uint16_t>(d, space, static_cast<uint16_t>(pattern)); break;
    case 4: fill_words<uint32_t>(d, space, static_cast<uint32_t>(pattern)); break;
    case 8: fill_words<uint64_t>(d, space, pattern); break;
    default: throw InternalError("cpu_fill: bad itemsize " + std::to_string(itemsize));
  }
}

namespace {

void run_item(const CopyItem& it) {
  if (it.shape.product() == 0) return;
  if (it.src == nullptr) {
    cpu_fill(it.dst, itemsize(it.dst_dtype), it.dst_strides, it.shape, 0);
  } else {
    cpu_copy_cast(it.dst, it.dst_dtype, it.dst_strides, it.src, it.src_dtype, it.src_strides,
                  it.shape);
  }
}

int64_t item_bytes(const CopyItem& it) {
  const int64_t per = static_cast<int64_t>(itemsize(it.dst_dtype)) +
                      (it.src ? static_cast<int64_t>(itemsize(it.src_dtype)) : 0);
  return it.shape.product() * per;
}

// Pieces of `it` (coalesced, split along its outermost dim) of about `grain` bytes or more.
void split_item(const CopyItem& it, int64_t grain, std::vector<CopyItem>& out) {
  const bool fill = it.src == nullptr;
  const auto space = coalesce<2>(it.shape, {it.dst_strides, fill ? it.dst_strides : it.src_strides});
  const int64_t rows = space.shape[0];
  const int64_t row_bytes = item_bytes(it) / std::max<int64_t>(rows, 1);
  const int64_t step = std::max<int64_t>(1, grain / std::max<int64_t>(row_bytes, 1));
  const int64_t dsize = static_cast<int64_t>(itemsize(it.dst_dtype));
  const int64_t ssize = static_cast<int64_t>(itemsize(it.src_dtype));
  for (int64_t r = 0; r < rows; r += step) {
    CopyItem p = it;
    p.shape = space.shape;
    p.shape[0] = std::min(step, rows - r);
    p.dst_strides = space.strides[0];
    p.dst = static_cast<char*>(it.dst) + r * space.strides[0][0] * dsize;
    if (!fill) {
      p.src_strides = space.strides[1];
      p.src = static_cast<const char*>(it.src) + r * space.strides[1][0] * ssize;
    }
    out.push_back(p);
  }
}

}  // namespace

void cpu_copy_batch(const std::vector<CopyItem>& items, int threads) {
  int64_t total = 0;
  for (const CopyItem& it : items) total += item_bytes(it);
  if (threads <= 1 || total == 0) {
    for (const CopyItem& it : items) run_item(it);
    return;
  }
  // Four pieces per worker at most per item keeps the split cheap; workers then take contiguous
  // runs of pieces of about total / threads bytes each (neighbouring pieces share cache lines).
  const int64_t grain = std::max<int64_t>(total / (4 * threads), 64 * 1024);
  std::vector<CopyItem> pieces;
  pieces.reserve(items.size() + static_cast<size_t>(4 * threads));
  for (const CopyItem& it : items)
    if (it.shape.product() > 0) split_item(it, grain, pieces);
  std::vector<size_t> start(static_cast<size_t>(threads) + 1, pieces.size());
  start[0] = 0;
  int64_t acc = 0;
  int w = 1;
  for (size_t i = 0; i < pieces.size() && w < threads; ++i) {
    acc += item_bytes(pieces[i]);
    while (w < threads && acc >= total * w / threads) start[static_cast<size_t>(w++)] = i + 1;
  }
  parallel_tasks(threads, threads, [&](int64_t t, int64_t) {
    for (size_t i = start[static_cast<size_t>(t)]; i < start[static_cast<size_t>(t) + 1]; ++i) run_item(pieces[i]);
  });
}

uint64_t encode_value(double value, DType dtype) {
  return dispatch_dtype(dtype, [value](auto tag) {
    using T = decltype(tag);
    const T converted = narrow_to<T>(value);
    uint64_t bits = 0;
    std::memcpy(&bits, &converted, sizeof(T));
    return bits;
  });
}

double load_as_double(const void* element, DType dtype) {
  return dispatch_dtype(dtype, [element](auto tag) {
    using T = decltype(tag);
    T v;
    std::memcpy(&v, element, sizeof(T));
    return to_double(v);
  });
}

void store_from_double(void* element, DType dtype, double value) {
  const uint64_t bits = encode_value(value, dtype);
  std::memcpy(element, &bits, itemsize(dtype));
}

bool cpu_equal(const void* a, const void* b, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      return equal_float(static_cast<const float*>(a), static_cast<const float*>(b), n);
    case DType::kF64:
      return equal_float(static_cast<const double*>(a), static_cast<const double*>(b), n);
    case DType::kI32:
    case DType::kI64:
    case DType::kU8: return std::memcmp(a, b, static_cast<size_t>(n) * itemsize(dtype)) == 0;
    default:
      return dispatch_dtype(dtype, [a, b, n](auto tag) {
        using T = decltype(tag);
        const T* x = static_cast<const T*>(a);
        const T* y = static_cast<const T*>(b);
        for (int64_t i = 0; i < n; ++i) {
          if (!(widen(x[i]) == widen(y[i]))) return false;
        }
        return true;
      });
  }
}

bool cpu_allclose(const void* a, const void* b, DType dtype, int64_t n, double rtol, double atol,
                  bool equal_nan) {
  if (dtype == DType::kF32) {
    return allclose_impl(static_cast<const float*>(a), static_cast<const float*>(b), n, rtol, atol,
                         equal_nan);
  }
  if (dtype == DType::kF64) {
    return allclose_impl(static_cast<const double*>(a), static_cast<const double*>(b), n, rtol,
                         atol, equal_nan);
  }
  throw InternalError("cpu_allclose: dtype must be f32 or f64, got " +
                      std::string(to_string(dtype)));
}

}  // namespace kernels::detail
