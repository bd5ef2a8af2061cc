#include "checkpoint/shared.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "kernels/error.h"

namespace checkpoint::detail {

using kernels::DType;
using kernels::InvalidArgument;
using kernels::Tensor;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- failures carried through an agreement ----

Failure capture(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const kernels::InvalidArgument& x) {
    return {kInvalid, x.what()};
  } catch (const kernels::Unsupported& x) {
    return {kInvalid, x.what()};
  } catch (const kernels::ResourceError& x) {
    return {kResource, x.what()};
  } catch (const std::bad_alloc& x) {
    return {kResource, fmt::format("out of memory: {}", x.what())};
  } catch (const kernels::CommError& x) {
    return {kComm, x.what()};
  } catch (const std::exception& x) {
    return {kOther, x.what()};
  } catch (...) {
    return {kOther, "an exception that is not a std::exception"};
  }
}

[[noreturn]] void raise(int64_t kind, const std::string& message) {
  switch (kind) {
    case kInvalid:
      throw kernels::InvalidArgument(message);
    case kResource:
      throw kernels::ResourceError(message);
    case kComm:
      throw kernels::CommError(message);
    default:
      throw kernels::Error(message);
  }
}

// ---- boxes ----

std::vector<Box> boxes_of(const dtensor::ShardLayout& layout, const Dims& shape) {
  const int nd = static_cast<int>(layout.runs.size());  // the view's dims: shape's, or d + 1
  for (int d = 0; d < nd; ++d)
    if (layout.local_shape[d] == 0) return {};
  const bool ragged = nd < shape.size();
  Dims tail;  // the flattened dims of a ragged view
  for (int d = nd - 1; ragged && d < shape.size(); ++d) tail.push_back(shape[d]);
  std::vector<Box> out;
  Box cur;
  cur.offsets.resize(nd);
  cur.sizes.resize(nd);
  cur.local.resize(nd);
  std::function<void(int)> rec = [&](int d) {
    if (d == nd) {
      out.push_back(cur);
      return;
    }
    if (ragged && d == nd - 1) {
      // The flat dim: each run (one in practice) as boxes of the flattened dims.
      int64_t pos = 0;
      for (const auto& run : layout.runs[d]) {
        for (const dtensor::FlatBox& fb : dtensor::flat_range_boxes(tail, run.start, run.length)) {
          Box b;
          for (int t = 0; t < d; ++t) {
            b.offsets.push_back(cur.offsets[t]);
            b.sizes.push_back(cur.sizes[t]);
          }
          b.local = cur.local;
          for (int t = 0; t < tail.size(); ++t) {
            b.offsets.push_back(fb.offsets[t]);
            b.sizes.push_back(fb.sizes[t]);
          }
          b.local[d] = pos + (fb.flat - run.start);
          out.push_back(std::move(b));
        }
        pos += run.length;
      }
      return;
    }
    int64_t pos = 0;
    for (const auto& run : layout.runs[d]) {
      if (run.length == 0) continue;
      cur.offsets[d] = run.start;
      cur.sizes[d] = run.length;
      cur.local[d] = pos;
      pos += run.length;
      rec(d + 1);
    }
  };
  rec(0);
  return out;
}

Tensor narrow_box(const Tensor& t, const Dims& start, const Dims& sizes) {
  Tensor v = t;
  for (int d = 0; d < sizes.size(); ++d) v = v.narrow(d, start[d], sizes[d]);
  return v;
}

Tensor box_view(const Tensor& local, const Box& b) {
  const int nl = b.local.size();
  if (nl == b.sizes.size()) return narrow_box(local, b.local, b.sizes);
  Tensor v = local;
  Dims shape;
  for (int d = 0; d + 1 < nl; ++d) {
    v = v.narrow(d, b.local[d], b.sizes[d]);
    shape.push_back(b.sizes[d]);
  }
  int64_t n = 1;
  for (int d = nl - 1; d < b.sizes.size(); ++d) {
    n *= b.sizes[d];
    shape.push_back(b.sizes[d]);
  }
  return v.narrow(nl - 1, b.local[nl - 1], n).view(shape);
}

std::string file_name(int rank, int slot, int slots) {
  return fmt::format("shard-{:05}-model-{:05}-of-{:05}.safetensors", rank + 1, slot + 1, slots);
}

// ---- I/O helpers ----

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

kernels::Device comm_device(const nn::StateDict& sd) {
  for (const auto& [k, t] : sd.tensors)
    if (t.to_local().defined()) return t.to_local().device();
  return kernels::Device{};
}

std::vector<int64_t> all_gather_rows(collectives::Communicator& world, const std::vector<int64_t>& row,
                                     kernels::Device device) {
  Tensor in = Tensor::empty({static_cast<int64_t>(row.size())}, DType::kI64);
  std::memcpy(in.data_ptr(), row.data(), row.size() * 8);
  Tensor out = Tensor::empty({static_cast<int64_t>(row.size()) * world.size()}, DType::kI64, device);
  Tensor din = device.is_cpu() ? in : in.to(device);
  world.wait(world.all_gather(din, out));
  Tensor host = out.device().is_cpu() ? out : out.to(kernels::Device{});
  std::vector<int64_t> result(static_cast<size_t>(host.numel()));
  std::memcpy(result.data(), host.data_ptr(), result.size() * 8);
  return result;
}

Failure agree(collectives::Communicator& world, const Failure& mine, kernels::Device device) {
  std::vector<int64_t> kinds = all_gather_rows(world, {mine.kind}, device);
  int first = -1;
  for (int r = 0; r < world.size() && first < 0; ++r)
    if (kinds[static_cast<size_t>(r)] != kOk) first = r;
  if (first < 0) return {};
  std::string failed;
  for (int r = 0; r < world.size(); ++r)
    if (kinds[static_cast<size_t>(r)] != kOk) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  const std::string& error = mine.message;
  int64_t n = world.rank() == first ? static_cast<int64_t>(error.size()) : 0;
  Tensor len = Tensor::full({1}, static_cast<double>(n), DType::kI64);
  Tensor dlen = device.is_cpu() ? len : len.to(device);
  world.wait(world.broadcast(dlen, first));
  n = static_cast<int64_t>((dlen.device().is_cpu() ? dlen : dlen.to(kernels::Device{})).item({0}));
  Tensor text = Tensor::zeros({std::max<int64_t>(n, 1)}, DType::kU8);
  if (world.rank() == first) std::memcpy(text.data_ptr(), error.data(), error.size());
  Tensor dtext = device.is_cpu() ? text : text.to(device);
  world.wait(world.broadcast(dtext, first));
  Tensor host = dtext.device().is_cpu() ? dtext : dtext.to(kernels::Device{});
  const std::string msg(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
  const int64_t kind = kinds[static_cast<size_t>(first)];
  if (world.rank() == first) return {kind, error};
  return {kind, fmt::format("{} (on rank {}; failed on rank(s) {})", msg, first, failed)};
}

}  // namespace checkpoint::detail
