// send_recv with strided views (Communicator::p2p_views()), shared by the local and mpi backend
// tests: column blocks of row-major tensors exchanged between every pair of ranks, strided sends
// into contiguous receives of another shape and back, 3-d views with two non-contiguous dims
// (and dims that merge), size-1 dims, several messages per peer in order, zero-numel views and
// disjoint row blocks of one buffer. Element values are a function of (sender, flat index of the
// sender's base tensor), distinct within a message and exact in every dtype.
//
// run_p2p_view_cases is collective over comm (every member calls it, in the same order as the
// other calls) and uses no test-framework assertions (it runs on rank threads of the local
// backend): it returns a description of each wrong element or unexpected state, empty when all
// is well.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace p2p_views_cases {

using collectives::Communicator;
using collectives::P2POp;
using kernels::Dims;
using kernels::DType;
using kernels::Tensor;

inline constexpr DType kDTypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                                    DType::kI32, DType::kI64, DType::kU8};
inline constexpr double kSentinel = 255;  // never a message value (those are < 251)

// Value of element `flat` (row-major index in the sender's base tensor) sent by `rank`: 0..250,
// distinct for flat < 251 (7 is invertible mod 251), exact in every dtype (bf16: integers <= 256).
inline double value(int rank, int64_t flat) { return static_cast<double>((rank * 37 + flat * 7) % 251); }

inline int64_t flat_index(const Dims& shape, std::span<const int64_t> idx) {
  int64_t flat = 0;
  for (int d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
  return flat;
}

// A base tensor of `rank`'s values.
inline Tensor base_of(int rank, const Dims& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  t.fill_index_([&](std::span<const int64_t> i) { return value(rank, flat_index(shape, i)); });
  return t;
}

// Row-major flat indices (in its base of `base_shape`) of the elements of view(base).
inline std::vector<int64_t> view_indices(const Dims& base_shape,
                                         const std::function<Tensor(const Tensor&)>& view) {
  Tensor idx = Tensor::arange(base_shape, DType::kI64);
  std::vector<int64_t> out;
  for (double v : view(idx).to_vector()) out.push_back(static_cast<int64_t>(v));
  return out;
}

class Failures {
 public:
  Failures(const Communicator& comm) : rank_(comm.rank()) {}  // NOLINT
  void expect(bool ok, const std::string& what) {
    if (!ok) add(what);
  }
  // got (any shape) holds, in row-major order, rank `from`'s elements at flat indices `want`.
  void expect_message(const Tensor& got, int from, const std::vector<int64_t>& want, const std::string& what) {
    const std::vector<double> g = got.to_vector();
    if (g.size() != want.size()) return add(fmt::format("{}: {} elements, expected {}", what, g.size(), want.size()));
    for (size_t e = 0; e < g.size(); ++e)
      if (g[e] != value(from, want[e]))
        return add(fmt::format("{}: element {} is {}, expected {} (rank {}'s element {})", what, e, g[e],
                               value(from, want[e]), from, want[e]));
  }
  // Elements of `base` outside view(base) still hold kSentinel.
  void expect_untouched(const Tensor& base, const std::function<Tensor(const Tensor&)>& view,
                        const std::string& what) {
    Tensor mask = Tensor::zeros(base.shape(), DType::kU8);
    view(mask).fill_(1);
    const std::vector<double> m = mask.to_vector(), b = base.to_vector();
    for (size_t e = 0; e < b.size(); ++e)
      if (m[e] == 0 && b[e] != kSentinel)
        return add(fmt::format("{}: element {} outside the receive view was overwritten with {}", what, e, b[e]));
  }
  std::vector<std::string> take() { return std::move(list_); }

 private:
  void add(const std::string& what) {
    if (list_.size() < 12) list_.push_back(fmt::format("rank {}: {}", rank_, what));
  }
  int rank_;
  std::vector<std::string> list_;
};

using View = std::function<Tensor(const Tensor&)>;

inline std::vector<std::string> run_p2p_view_cases(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Failures fail(comm);
  fail.expect(comm.p2p_views(), "p2p_views() is false");

  // Column blocks: rank r sends its columns [off + g*w, off + (g+1)*w) to every g (itself too)
  // and receives g's block into its columns [off + g*w, ...) of a separate output.
  for (DType dtype : kDTypes) {
    const int64_t rows = 5, w = 3, off = 1;
    const Dims shape{rows, off + n * w + 1};
    const Tensor t = base_of(r, shape, dtype);
    Tensor out = Tensor::full(shape, kSentinel, dtype);
    std::vector<P2POp> ops;
    for (int g = 0; g < n; ++g) {
      ops.push_back(P2POp::send(t.narrow(1, off + g * w, w), g));
      ops.push_back(P2POp::recv(out.narrow(1, off + g * w, w), g));
    }
    comm.wait(comm.send_recv(ops));
    for (int g = 0; g < n; ++g)
      fail.expect_message(out.narrow(1, off + g * w, w), g,
                          view_indices(shape, [&](const Tensor& b) { return b.narrow(1, off + r * w, w); }),
                          fmt::format("column block from rank {} ({})", g, kernels::to_string(dtype)));
    fail.expect_untouched(out, [&](const Tensor& b) { return b.narrow(1, off, n * w); },
                          fmt::format("column blocks ({})", kernels::to_string(dtype)));
  }

  // Strided send -> contiguous receive of another shape, and contiguous send -> strided receive
  // (a transposed view: no unit stride at all) of another shape, in one call.
  {
    const Dims shape{6, 7};
    const View block = [](const Tensor& b) { return b.narrow(0, 1, 3).narrow(1, 2, 4); };  // [3,4]
    const Tensor t = base_of(r, shape, DType::kF32);
    const Tensor flat_src = base_of(r, {12}, DType::kF32);
    Tensor packed = Tensor::full({2, 6}, kSentinel, DType::kF32);
    Tensor big = Tensor::full({3, 5}, kSentinel, DType::kF32);
    const View transposed = [](const Tensor& b) { return b.narrow(1, 1, 4).transpose(0, 1); };  // [4,3]
    const std::vector<P2POp> ops = {P2POp::send(block(t), next), P2POp::recv(packed, prev),
                                    P2POp::send(flat_src, prev), P2POp::recv(transposed(big), next)};
    comm.wait(comm.send_recv(ops));
    fail.expect_message(packed, prev, view_indices(shape, block), "strided [3,4] -> contiguous [2,6]");
    fail.expect_message(transposed(big), next, view_indices({12}, [](const Tensor& b) { return b; }),
                        "contiguous [12] -> transposed [4,3]");
    fail.expect_untouched(big, transposed, "contiguous -> transposed");
  }

  // 3-d views: two non-contiguous dims into a view of another shape; dims that merge into a
  // permuted view whose innermost stride is not 1; a size-1 middle dim into a 1-d strided view.
  // Several messages to one peer pair up in order.
  {
    const Dims a_shape{4, 5, 6}, c_shape{3, 4, 6}, d_shape{4, 8, 6};
    const View a_view = [](const Tensor& b) { return b.narrow(0, 1, 2).narrow(1, 1, 3).narrow(2, 2, 3); };  // [2,3,3]
    const View a_recv = [](const Tensor& b) { return b.narrow(1, 1, 2).narrow(2, 1, 3); };  // [3,2,3] of [3,4,5]
    const View c_view = [](const Tensor& b) { return b.narrow(2, 0, 4); };  // [3,4,4], strides [24,6,1]: dims 0,1 merge
    const View c_recv = [](const Tensor& b) {  // [4,4,3] of [6,3,8], strides [1,24,8]
      return b.permute({2, 0, 1}).narrow(0, 2, 4).narrow(1, 1, 4);
    };
    const View d_view = [](const Tensor& b) { return b.narrow(1, 3, 1).narrow(2, 1, 4); };  // [4,1,4]
    const View d_recv = [](const Tensor& b) { return b.select(1, 1); };                   // [16] of [16,3], stride 3
    const Tensor a = base_of(r, a_shape, DType::kI64), c = base_of(r, c_shape, DType::kI64),
                 d = base_of(r, d_shape, DType::kI64);
    Tensor a_out = Tensor::full({3, 4, 5}, kSentinel, DType::kI64);
    Tensor c_out = Tensor::full({6, 3, 8}, kSentinel, DType::kI64);
    Tensor d_out = Tensor::full({16, 3}, kSentinel, DType::kI64);
    const std::vector<P2POp> ops = {
        P2POp::send(a_view(a), next),     P2POp::send(c_view(c), next),     P2POp::send(d_view(d), next),
        P2POp::recv(a_recv(a_out), prev), P2POp::recv(c_recv(c_out), prev), P2POp::recv(d_recv(d_out), prev)};
    comm.wait(comm.send_recv(ops));
    fail.expect_message(a_recv(a_out), prev, view_indices(a_shape, a_view), "3-d [2,3,3] -> [3,2,3]");
    fail.expect_untouched(a_out, a_recv, "3-d [2,3,3] -> [3,2,3]");
    fail.expect_message(c_recv(c_out), prev, view_indices(c_shape, c_view), "3-d merging [3,4,4] -> permuted [4,4,3]");
    fail.expect_untouched(c_out, c_recv, "3-d merging [3,4,4] -> permuted [4,4,3]");
    fail.expect_message(d_recv(d_out), prev, view_indices(d_shape, d_view), "size-1 dim [4,1,4] -> [16] stride 3");
    fail.expect_untouched(d_out, d_recv, "size-1 dim [4,1,4] -> [16] stride 3");
  }

  // Zero-numel views (strided bases) travel as empty messages; a later message to the same peer
  // still pairs with its receive.
  {
    const Tensor t = base_of(r, {4, 6}, DType::kBF16);
    Tensor out = Tensor::full({4, 6}, kSentinel, DType::kBF16);
    const std::vector<P2POp> ops = {P2POp::send(t.narrow(1, 2, 0), next), P2POp::send(t.narrow(0, 1, 2).narrow(1, 0, 0), next),
                                    P2POp::send(t.narrow(1, 4, 2), next), P2POp::recv(out.narrow(0, 2, 0), prev),
                                    P2POp::recv(out.narrow(1, 0, 0).narrow(0, 0, 3), prev),
                                    P2POp::recv(out.narrow(1, 1, 2), prev)};
    comm.wait(comm.send_recv(ops));
    fail.expect_message(out.narrow(1, 1, 2), prev, view_indices({4, 6}, [](const Tensor& b) { return b.narrow(1, 4, 2); }),
                        "message after two empty ones");
    fail.expect_untouched(out, [](const Tensor& b) { return b.narrow(1, 1, 2); }, "empty views");
  }

  // Send and receive through disjoint row blocks of one buffer (not interleaved).
  {
    const Dims shape{6, 5};
    Tensor buf = base_of(r, shape, DType::kI32);
    const View top = [](const Tensor& b) { return b.narrow(0, 0, 2).narrow(1, 1, 3); };
    const View bottom = [](const Tensor& b) { return b.narrow(0, 3, 2).narrow(1, 1, 3); };
    const std::vector<P2POp> ops = {P2POp::recv(bottom(buf), prev), P2POp::send(top(buf), next)};
    comm.wait(comm.send_recv(ops));
    fail.expect_message(bottom(buf), prev, view_indices(shape, top), "row block of one buffer");
    fail.expect_message(top(buf), r, view_indices(shape, top), "send block unchanged");
  }
  return fail.take();
}

}  // namespace p2p_views_cases
