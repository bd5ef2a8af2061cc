#include "collectives/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/error.h"

namespace collectives {

using kernels::InvalidArgument;

std::string_view to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kAllToAllV: return "all_to_all_v";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kSendRecv: return "send_recv";
  }
  return "unknown";
}

std::string to_string(const CollectiveCall& c) {
  std::string what = fmt::format("{}(", to_string(c.kind));
  switch (c.kind) {
    case CollectiveKind::kBarrier: break;
    case CollectiveKind::kSendRecv:
      what += fmt::format("{} ops, {}, {} -> {} elements", c.ops, kernels::to_string(c.dtype), c.in_count, c.out_count);
      break;
    default:
      what += fmt::format("{}, {} -> {} elements", kernels::to_string(c.dtype), c.in_count, c.out_count);
  }
  if (c.kind == CollectiveKind::kBroadcast || c.kind == CollectiveKind::kScatter) what += fmt::format(", root {}", c.root);
  if (c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllReduce) {
    what += fmt::format(", {}", kernels::to_string(c.op));
    if (c.pre_multiplier != 1.0) what += fmt::format(" x {}", c.pre_multiplier);
  }
  return what + ")";
}

namespace detail {

namespace {
bool is_supported(kernels::DType dtype) {
  using kernels::DType;
  return dtype != DType::kF8E4M3 && dtype != DType::kF8E5M2;
}

// Defined, contiguous unless strided views are allowed (then non-negative strides), a moved dtype.
void check_buffer(CollectiveKind kind, const Communicator& comm, const Tensor& t, const char* role,
                  bool views) {
  if (!t.defined())
    throw InvalidArgument(fmt::format("{} on group '{}': {} tensor is undefined", to_string(kind),
                                      comm.name(), role));
  if (!views && !t.is_contiguous())
    throw InvalidArgument(fmt::format("{} on group '{}': {} tensor must be contiguous",
                                      to_string(kind), comm.name(), role));
  for (int d = 0; views && d < t.ndim(); ++d)
    if (t.stride(d) < 0)
      throw InvalidArgument(fmt::format("{} on group '{}': {} tensor has negative stride {} in dim {}",
                                        to_string(kind), comm.name(), role, t.stride(d), d));
  if (!is_supported(t.dtype()))
    throw InvalidArgument(fmt::format(
        "{} on group '{}': dtype {} is not supported by the collectives (expected f32, f64, "
        "bf16, f16, i32, i64 or u8)",
        to_string(kind), comm.name(), kernels::to_string(t.dtype())));
}
}  // namespace

void check_tensor(CollectiveKind kind, const Communicator& comm, const Tensor& t, const char* role) {
  check_buffer(kind, comm, t, role, false);
}

void check_p2p_tensor(const Communicator& comm, const Tensor& t) {
  check_buffer(CollectiveKind::kSendRecv, comm, t, "send/recv", comm.p2p_views());
}

void check_buffers(CollectiveKind kind, const Communicator& comm, const Tensor& input,
                   const Tensor& output) {
  check_tensor(kind, comm, input, "input");
  check_tensor(kind, comm, output, "output");
  if (input.dtype() != output.dtype())
    throw InvalidArgument(fmt::format("{} on group '{}': input dtype {} != output dtype {}",
                                      to_string(kind), comm.name(),
                                      kernels::to_string(input.dtype()),
                                      kernels::to_string(output.dtype())));
  if (input.device().type != output.device().type)
    throw InvalidArgument(fmt::format("{} on group '{}': input on {} but output on {}",
                                      to_string(kind), comm.name(),
                                      kernels::to_string(input.device()),
                                      kernels::to_string(output.device())));
  const int64_t n = comm.size(), in = input.numel(), out = output.numel();
  auto want = [&](bool ok, const char* rule) {
    if (!ok)
      throw InvalidArgument(fmt::format(
          "{} on group '{}' of {} ranks: input has {} elements and output {} (expected {})",
          to_string(kind), comm.name(), n, in, out, rule));
  };
  switch (kind) {
    case CollectiveKind::kAllGather: want(out == n * in, "output = size x input"); break;
    case CollectiveKind::kReduceScatter: want(in == n * out, "input = size x output"); break;
    case CollectiveKind::kAllReduce: want(in == out, "equal counts"); break;
    case CollectiveKind::kAllToAll:
      want(in == out && in % n == 0, "equal counts divisible by the group size");
      break;
    default: break;
  }
}

void check_reduction(CollectiveKind kind, const Tensor& t, Reduction r) {
  if (r.pre_multiplier != 1.0 && r.op != ReduceOp::kSum)
    throw InvalidArgument(fmt::format("{}: a pre-multiplier ({}) needs ReduceOp sum, got {}",
                                      to_string(kind), r.pre_multiplier, kernels::to_string(r.op)));
  (void)t;
}

void check_counts(const Communicator& comm, std::span<const int64_t> counts, const Tensor& t,
                  const char* what) {
  if (static_cast<int>(counts.size()) != comm.size())
    throw InvalidArgument(fmt::format("all_to_all_v on group '{}': {} {} counts for {} ranks",
                                      comm.name(), counts.size(), what, comm.size()));
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c < 0)
      throw InvalidArgument(
          fmt::format("all_to_all_v on group '{}': negative {} count {}", comm.name(), what, c));
    total += c;
  }
  if (total != t.numel())
    throw InvalidArgument(fmt::format(
        "all_to_all_v on group '{}': {} counts [{}] sum to {} but the buffer has {} elements",
        comm.name(), what, fmt::join(counts, ","), total, t.numel()));
}

namespace {
// Bytes from a view's first element to one past its last (non-negative strides).
int64_t span_bytes(const Tensor& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(kernels::itemsize(t.dtype()));
}
}  // namespace

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.shares_storage_with(b)) return false;
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + span_bytes(b) && pb < pa + span_bytes(a);
}

}  // namespace detail
}  // namespace collectives
