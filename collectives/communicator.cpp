#include "collectives/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <optional>

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

CollectiveCall Call::summary() const {
  CollectiveCall c;
  c.kind = kind;
  if (kind == CollectiveKind::kSendRecv) {
    c.ops = static_cast<int>(ops.size());
    for (const P2POp& op : ops) {
      if (op.buffer.defined()) c.dtype = op.buffer.dtype();
      (op.kind == P2POp::Kind::kSend ? c.in_count : c.out_count) += op.buffer.defined() ? op.buffer.numel() : 0;
    }
    return c;
  }
  c.dtype = output.defined() ? output.dtype() : input.defined() ? input.dtype() : kernels::DType::kF32;
  // A scatter's input counts only at the root: every member logs the same call.
  c.in_count = input.defined() && kind != CollectiveKind::kScatter ? input.numel() : 0;
  c.out_count = output.defined() ? output.numel() : 0;
  c.op = reduction.op;
  c.pre_multiplier = reduction.pre_multiplier;
  c.root = root;
  return c;
}

WorkPtr Communicator::submit(Call call) {
  detail::validate(call, *this);
  check_backend(call);
  if (tracer_ == nullptr) return issue(call);
  return traced_issue(call);
}

namespace {

// A Work whose backend cannot report its end (Work::on_finish): the end is the first moment a
// caller sees it finished.
class TracedWork final : public Work {
 public:
  TracedWork(WorkPtr inner, std::function<void()> done) : inner_(std::move(inner)), done_(std::move(done)) {}
  ~TracedWork() override { seen(); }
  void wait(Milliseconds timeout) override {
    try {
      inner_->wait(timeout);
    } catch (...) {
      seen();
      throw;
    }
    seen();
  }
  bool completed() override { return inner_->completed() && (seen(), true); }
  bool settle(Milliseconds timeout) override { return inner_->settle(timeout) && (seen(), true); }
  std::string describe() const override { return inner_->describe(); }
  void give_up(const std::string& why) override { inner_->give_up(why); }

 private:
  void seen() {
    if (done_) std::exchange(done_, nullptr)();
  }
  WorkPtr inner_;
  std::function<void()> done_;
};

}  // namespace

WorkPtr Communicator::traced_issue(const Call& call) {
  const CollectiveCall sum = call.summary();
  auto event = std::make_shared<kernels::TraceEvent>();
  event->name = std::string(to_string(call.kind));
  event->category = "collective";
  event->lane = "comm " + name_;
  event->pid = global_rank();
  event->args = {{"call", to_string(sum)}, {"group", name_}, {"ranks", fmt::format("[{}]", fmt::join(ranks_, ","))}};
  if (!trace_label_.empty()) event->args.emplace_back("label", trace_label_);
  const int64_t item = static_cast<int64_t>(kernels::itemsize(sum.dtype));
  event->numbers = {{"bytes", std::max(sum.in_count, sum.out_count) * item},
                    {"in_bytes", sum.in_count * item},
                    {"out_bytes", sum.out_count * item},
                    {"group_size", size()}};
  event->ts_ns = kernels::Tracer::now_ns();
  WorkPtr work = issue(call);
  std::function<void()> done = [tracer = tracer_, event] {
    event->dur_ns = kernels::Tracer::now_ns() - event->ts_ns;
    tracer->record(std::move(*event));
  };
  if (work->on_finish(done)) return work;
  return std::make_shared<TracedWork>(std::move(work), std::move(done));
}

void Communicator::traced_wait(const WorkPtr& work) {
  const int64_t start = kernels::Tracer::now_ns();
  auto record = [&] {
    tracer_->record({.name = "wait",
                     .category = "waits",
                     .lane = "waits",
                     .pid = global_rank(),
                     .ts_ns = start,
                     .dur_ns = kernels::Tracer::now_ns() - start,
                     .args = {{"on", work->describe()}}});
  };
  try {
    work->wait(timeout_);
  } catch (...) {
    record();
    throw;
  }
  record();
}

WorkPtr forward(Communicator& comm, const Call& c) {
  switch (c.kind) {
    case CollectiveKind::kAllGather: return comm.all_gather(c.input, c.output);
    case CollectiveKind::kReduceScatter: return comm.reduce_scatter(c.input, c.output, c.reduction);
    case CollectiveKind::kAllReduce: return comm.all_reduce(c.input, c.output, c.reduction);
    case CollectiveKind::kAllToAll: return comm.all_to_all(c.input, c.output);
    case CollectiveKind::kAllToAllV: return comm.all_to_all_v(c.input, c.send_counts, c.output, c.recv_counts);
    case CollectiveKind::kBroadcast: return comm.broadcast(c.output, c.root);
    case CollectiveKind::kScatter: return comm.scatter(c.input, c.output, c.root);
    case CollectiveKind::kBarrier: return comm.barrier();
    case CollectiveKind::kSendRecv: return comm.send_recv(c.ops);
  }
  throw kernels::InternalError(fmt::format("forward: unknown collective kind {}", static_cast<int>(c.kind)));
}

namespace detail {

namespace {

// fp8 (e4m3, e5m2) is moved as bytes by every collective that does not reduce; the reducing
// ones refuse it (no backend sums 8-bit floats: reduce in a wider dtype).
bool is_fp8(kernels::DType dtype) {
  using kernels::DType;
  return dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2;
}

// "all_gather on group 'world'"
std::string where(CollectiveKind kind, const Communicator& comm) {
  return fmt::format("{} on group '{}'", to_string(kind), comm.name());
}

// Defined, contiguous unless strided views are allowed (then non-negative strides), a moved dtype.
void check_buffer(CollectiveKind kind, const Communicator& comm, const Tensor& t, const char* role,
                  bool views = false) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} tensor is undefined", where(kind, comm), role));
  if (!views && !t.is_contiguous())
    throw InvalidArgument(fmt::format("{}: {} tensor must be contiguous (strides [{}] for shape [{}])",
                                      where(kind, comm), role, fmt::join(t.strides(), ","),
                                      fmt::join(t.shape(), ",")));
  for (int d = 0; views && d < t.ndim(); ++d)
    if (t.stride(d) < 0)
      throw InvalidArgument(fmt::format("{}: {} tensor has negative stride {} in dim {}", where(kind, comm), role,
                                        t.stride(d), d));
}

void check_pair(CollectiveKind kind, const Communicator& comm, const Tensor& input, const Tensor& output) {
  check_buffer(kind, comm, input, "input");
  check_buffer(kind, comm, output, "output");
  if (input.dtype() != output.dtype())
    throw InvalidArgument(fmt::format("{}: input dtype {} != output dtype {}", where(kind, comm),
                                      kernels::to_string(input.dtype()), kernels::to_string(output.dtype())));
  if (input.device().type != output.device().type)
    throw InvalidArgument(fmt::format("{}: input on {} but output on {}", where(kind, comm),
                                      kernels::to_string(input.device()), kernels::to_string(output.device())));
}

// "the input, elements [4, 8) of its storage"
std::string range_text(const Tensor& t, const char* role) {
  return fmt::format("the {} (elements [{}, {}) of its storage)", role, t.storage_offset(),
                     t.storage_offset() + t.numel());
}

// True when `part` is exactly elements [k * part.numel(), (k + 1) * part.numel()) of `whole`.
// REQUIRES: same dtype, both contiguous.
bool is_slice(const Tensor& whole, const Tensor& part, int64_t k) {
  return part.numel() > 0 && part.shares_storage_with(whole) &&
         static_cast<const char*>(part.data_ptr()) ==
             static_cast<const char*>(whole.data_ptr()) + k * static_cast<int64_t>(part.nbytes());
}
bool same_elements(const Tensor& a, const Tensor& b) {
  return a.numel() > 0 && a.numel() == b.numel() && a.shares_storage_with(b) && a.data_ptr() == b.data_ptr();
}

// The aliasing rules of NOTE [call contract] for input / output pairs.
void check_aliasing(Call& c, const Communicator& comm) {
  const Tensor& in = c.input;
  const Tensor& out = c.output;
  switch (c.kind) {
    case CollectiveKind::kAllGather:
      c.in_place = is_slice(out, in, comm.rank());
      if (!c.in_place && overlaps(in, out))
        throw InvalidArgument(fmt::format(
            "{}: the input overlaps the output but is not this rank's slice (elements [{}, {}) of the output): "
            "{} against {}",
            where(c.kind, comm), comm.rank() * in.numel(), (comm.rank() + 1) * in.numel(), range_text(in, "input"),
            range_text(out, "output")));
      return;
    case CollectiveKind::kReduceScatter:
      c.in_place = is_slice(in, out, comm.rank());
      if (!c.in_place && overlaps(in, out))
        throw InvalidArgument(fmt::format(
            "{}: the output overlaps the input but is not this rank's slice (elements [{}, {}) of the input): "
            "{} against {}",
            where(c.kind, comm), comm.rank() * out.numel(), (comm.rank() + 1) * out.numel(),
            range_text(out, "output"), range_text(in, "input")));
      return;
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kAllToAllV:
      c.in_place = same_elements(in, out);
      if (!c.in_place && overlaps(in, out))
        throw InvalidArgument(fmt::format(
            "{}: the input overlaps the output but they are not the same elements (in place: pass one buffer "
            "as both): {} against {}",
            where(c.kind, comm), range_text(in, "input"), range_text(out, "output")));
      return;
    case CollectiveKind::kScatter:
      if (comm.rank() != c.root) return;
      c.in_place = is_slice(in, out, c.root);
      if (!c.in_place && overlaps(in, out))
        throw InvalidArgument(fmt::format(
            "{}: the root's output overlaps its input but is not its slice (elements [{}, {}) of the input): "
            "{} against {}",
            where(c.kind, comm), c.root * out.numel(), (c.root + 1) * out.numel(), range_text(out, "output"),
            range_text(in, "input")));
      return;
    case CollectiveKind::kBroadcast: c.in_place = true; return;
    default: return;
  }
}

void check_counts(const Communicator& comm, std::span<const int64_t> counts, const Tensor& t, const char* what) {
  if (static_cast<int>(counts.size()) != comm.size())
    throw InvalidArgument(fmt::format("all_to_all_v on group '{}': {} {} counts for {} ranks", comm.name(),
                                      counts.size(), what, comm.size()));
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c < 0) throw InvalidArgument(fmt::format("all_to_all_v on group '{}': negative {} count {}", comm.name(), what, c));
    if (__builtin_add_overflow(total, c, &total))
      throw InvalidArgument(fmt::format("all_to_all_v on group '{}': {} counts [{}] overflow int64", comm.name(), what,
                                        fmt::join(counts, ",")));
  }
  if (total != t.numel())
    throw InvalidArgument(fmt::format("all_to_all_v on group '{}': {} counts [{}] sum to {} but the buffer has {} elements",
                                      comm.name(), what, fmt::join(counts, ","), total, t.numel()));
}

void check_rank(CollectiveKind kind, const Communicator& comm, int r, const char* what) {
  if (r < 0 || r >= comm.size())
    throw InvalidArgument(fmt::format("{}: {} {} out of range 0..{}", where(kind, comm), what, r, comm.size() - 1));
}

void check_send_recv(const Call& c, const Communicator& comm) {
  const auto ops = c.ops;
  for (const P2POp& op : ops) {
    check_buffer(c.kind, comm, op.buffer, "send/recv", comm.p2p_views());
    check_rank(c.kind, comm, op.peer, "peer");
  }
  // Peers read the send buffers while this rank fills its receive buffers, and receives may be
  // written at the same time.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind != P2POp::Kind::kRecv) continue;
    for (size_t j = 0; j < ops.size(); ++j)
      if (j != i && (j > i || ops[j].kind == P2POp::Kind::kSend) && shares_elements(ops[i].buffer, ops[j].buffer))
        throw InvalidArgument(fmt::format(
            "send_recv on group '{}': receive buffer #{} (from peer {}) overlaps {} buffer #{} ({} peer {})",
            comm.name(), i, ops[i].peer, ops[j].kind == P2POp::Kind::kSend ? "send" : "receive", j,
            ops[j].kind == P2POp::Kind::kSend ? "to" : "from", ops[j].peer));
  }
}

}  // namespace

void validate(Call& c, const Communicator& comm) {
  const CollectiveKind kind = c.kind;
  const int64_t n = comm.size();
  auto want = [&](bool ok, const char* rule) {
    if (!ok)
      throw InvalidArgument(fmt::format("{} of {} ranks: input has {} elements and output {} (expected {})",
                                        where(kind, comm), n, c.input.numel(), c.output.numel(), rule));
  };
  switch (kind) {
    case CollectiveKind::kAllGather:
      check_pair(kind, comm, c.input, c.output);
      want(c.output.numel() == n * c.input.numel(), "output = size x input");
      break;
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllReduce: {
      check_pair(kind, comm, c.input, c.output);
      if (kind == CollectiveKind::kReduceScatter)
        want(c.input.numel() == n * c.output.numel(), "input = size x output");
      else
        want(c.input.numel() == c.output.numel(), "equal counts");
      const Reduction r = c.reduction;
      if (is_fp8(c.input.dtype()))
        throw InvalidArgument(fmt::format(
            "{}: {} of dtype {}: the collectives move fp8 but do not reduce it (expected f32, f64, bf16, f16, "
            "i32, i64 or u8; reduce in a wider dtype)",
            where(kind, comm), kernels::to_string(r.op), kernels::to_string(c.input.dtype())));
      if (r.pre_multiplier != 1.0 && r.op != ReduceOp::kSum)
        throw InvalidArgument(fmt::format("{}: a pre-multiplier ({}) needs ReduceOp sum, got {}", where(kind, comm),
                                          r.pre_multiplier, kernels::to_string(r.op)));
      if (!std::isfinite(r.pre_multiplier))
        throw InvalidArgument(fmt::format("{}: the pre-multiplier {} is not finite", where(kind, comm), r.pre_multiplier));
      break;
    }
    case CollectiveKind::kAllToAll:
      check_pair(kind, comm, c.input, c.output);
      want(c.input.numel() == c.output.numel() && c.input.numel() % n == 0, "equal counts divisible by the group size");
      break;
    case CollectiveKind::kAllToAllV:
      check_pair(kind, comm, c.input, c.output);
      check_counts(comm, c.send_counts, c.input, "send");
      check_counts(comm, c.recv_counts, c.output, "receive");
      break;
    case CollectiveKind::kBroadcast:
      check_buffer(kind, comm, c.output, "buffer");
      check_rank(kind, comm, c.root, "root");
      break;
    case CollectiveKind::kScatter:
      check_rank(kind, comm, c.root, "root");
      if (comm.rank() != c.root) {
        c.input = Tensor();  // ignored on the other members
        check_buffer(kind, comm, c.output, "output");
        break;
      }
      check_pair(kind, comm, c.input, c.output);
      if (c.input.numel() != n * c.output.numel())
        throw InvalidArgument(fmt::format(
            "{} of {} ranks: the root's input has {} elements and output {} (expected input = size x output)",
            where(kind, comm), n, c.input.numel(), c.output.numel()));
      break;
    case CollectiveKind::kBarrier: break;
    case CollectiveKind::kSendRecv: check_send_recv(c, comm); break;
  }
  check_aliasing(c, comm);
}

namespace {
// Bytes from a view's first element to one past its last (non-negative strides).
int64_t span_bytes(const Tensor& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(kernels::itemsize(t.dtype()));
}

// A view as a box of a dense base tensor: per dim (by decreasing stride) the first index and
// the extent, plus the offset's remainder below the smallest stride. Empty when the view is not
// such a box (strides not each a multiple of the next, or a box that runs past its base row).
// Views of one base that share its strides (narrow, as_strided with the base's strides) are
// boxes of it whatever its dim order (a transposed base sorts back to row-major).
struct Box {
  kernels::Dims first, extent;
  int64_t remainder = 0;
};
std::optional<Box> box_of(const Tensor& t) {
  const int nd = t.ndim();
  std::array<int, kernels::kMaxDims> order{};
  for (int d = 0; d < nd; ++d) order[d] = d;
  std::stable_sort(order.begin(), order.begin() + nd, [&](int x, int y) { return t.stride(x) > t.stride(y); });
  Box b;
  int64_t rem = t.storage_offset();
  for (int k = 0; k < nd; ++k) {
    const int d = order[k];
    const int64_t s = t.stride(d);
    if (s < 1 || (k + 1 < nd && (t.stride(order[k + 1]) < 1 || s % t.stride(order[k + 1]) != 0))) return std::nullopt;
    const int64_t first = rem / s;
    rem %= s;
    // The base's extent along this stride is the next larger stride / this one (unbounded for
    // the largest).
    if (k > 0 && first + t.size(d) > t.stride(order[k - 1]) / s) return std::nullopt;
    b.first.push_back(first);
    b.extent.push_back(t.size(d));
  }
  b.remainder = rem;
  return b;
}
}  // namespace

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.shares_storage_with(b)) return false;
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + span_bytes(b) && pb < pa + span_bytes(a);
}

namespace {
// The element offsets (in the storage) of a view, sorted.
std::vector<int64_t> element_offsets(const Tensor& t) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(t.numel()));
  const int nd = t.ndim();
  std::vector<int64_t> index(static_cast<size_t>(nd), 0);
  int64_t off = t.storage_offset();
  for (int64_t k = 0; k < t.numel(); ++k) {
    out.push_back(off);
    for (int d = nd - 1; d >= 0; --d) {
      if (++index[d] < t.size(d)) {
        off += t.stride(d);
        break;
      }
      off -= (t.size(d) - 1) * t.stride(d);
      index[d] = 0;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Views this small are compared element by element when they are not boxes of one tensor.
constexpr int64_t kEnumerateElements = 1 << 16;
}  // namespace

bool shares_elements(const Tensor& a, const Tensor& b) {
  if (!overlaps(a, b)) return false;
  if (a.is_contiguous() && b.is_contiguous()) return true;
  if (a.dtype() != b.dtype()) return true;  // not comparable element by element: by byte spans
  if (a.strides() == b.strides()) {
    const std::optional<Box> ba = box_of(a), bb = box_of(b);
    if (ba && bb) {
      if (ba->remainder != bb->remainder) return false;  // interleaved below the innermost stride
      for (int d = 0; d < ba->first.size(); ++d)
        if (ba->first[d] + ba->extent[d] <= bb->first[d] || bb->first[d] + bb->extent[d] <= ba->first[d]) return false;
      return true;
    }
  }
  if (a.numel() + b.numel() > kEnumerateElements) return true;  // by byte spans
  const std::vector<int64_t> ea = element_offsets(a), eb = element_offsets(b);
  std::vector<int64_t> common;
  std::set_intersection(ea.begin(), ea.end(), eb.begin(), eb.end(), std::back_inserter(common));
  return !common.empty();
}

}  // namespace detail
}  // namespace collectives
