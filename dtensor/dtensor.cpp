#include "dtensor/dtensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "dtensor/exec/executor.h"
#include "dtensor/plan/cache.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/hash.h"
#include "kernels/reduce.h"

namespace dtensor {

using collectives::Communicator;
using collectives::P2POp;
using kernels::Device;
using kernels::InvalidArgument;
using kernels::mix64;
using kernels::Unsupported;

namespace {

void check_comms(const std::shared_ptr<const MeshComms>& comms, const char* where) {
  if (!comms) throw InvalidArgument(fmt::format("{}: the mesh communicators are null", where));
}

// The communicators' mesh as a spec mesh, without a copy (aliases, and keeps alive, comms).
std::shared_ptr<const DeviceMesh> mesh_of(const std::shared_ptr<const MeshComms>& comms) {
  return std::shared_ptr<const DeviceMesh>(comms, &comms->mesh());
}

Tensor empty_outside(DType dtype) { return Tensor::empty({0}, dtype); }

// The caller's placements after the plan (a plan on a RaggedShard view runs on the view's).
Placements result_placements(const Plan& plan) { return plan.on_view() ? plan.user_dst : plan.dst; }

std::string shape_text(const Dims& dims) { return fmt::format("[{}]", fmt::join(dims, ",")); }

// Compact index list: "0-3,8-11"; "-" when nothing is held.
std::string runs_text(const IndexRuns& runs) {
  if (runs.empty()) return "-";
  std::string out;
  for (const IndexRun& r : runs) {
    if (!out.empty()) out += ',';
    out += r.length == 1 ? fmt::format("{}", r.start)
                         : fmt::format("{}-{}", r.start, r.start + r.length - 1);
  }
  return out;
}

// The positions `runs` of dim d of t, in order: a view when they form one run, else a copy.
Tensor take_positions(const Tensor& t, int d, const IndexRuns& runs) {
  if (runs.empty()) return t.narrow(d, 0, 0);
  if (runs.size() == 1) return t.narrow(d, runs[0].start, runs[0].length);
  Dims shape = t.shape();
  shape[d] = 0;
  for (const IndexRun& r : runs) shape[d] += r.length;
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  int64_t at = 0;
  for (const IndexRun& r : runs) {
    out.narrow(d, at, r.length).copy_(t.narrow(d, r.start, r.length));
    at += r.length;
  }
  return out;
}

int split_factor_of(const Placement& p) {
  const auto* s = std::get_if<StridedShard>(&p);
  return s ? s->split_factor : 0;  // 0: a plain Shard for split_positions
}

// distribute_tensor's Shard / StridedShard step on mesh dim m: group member src sends every
// member its piece of `current` (exact sizes, no padding).
Tensor scatter_dim(const Tensor& current, const Placement& p, int m, int src, const MeshComms& comms) {
  Communicator& comm = comms.dim(m);
  const int d = *shard_dim(p);
  const int sf = split_factor_of(p);
  const int64_t k = comm.size(), r = comm.rank(), n = current.size(d);
  auto piece_shape = [&](int64_t g) {
    Dims shape = current.shape();
    shape[d] = 0;
    for (const IndexRun& run : split_positions(n, k, g, sf)) shape[d] += run.length;
    return shape;
  };
  Tensor mine = Tensor::empty(piece_shape(r), current.dtype(), current.device());
  if (sf == 0 && d == 0 && n % k == 0) {
    // Equal pieces, each contiguous in the row-major buffer: one scatter.
    Tensor in = r == src ? current.contiguous().view({current.numel()}) : Tensor();
    comm.wait(comm.scatter(in, mine.view({mine.numel()}), src));
    return mine;
  }
  std::vector<P2POp> ops;
  if (r == src) {
    for (int64_t g = 0; g < k; ++g) {
      Tensor piece = take_positions(current, d, split_positions(n, k, g, sf));
      if (g == r) mine.copy_(piece);
      else if (piece.numel() > 0) ops.push_back(P2POp::send(piece.contiguous(), static_cast<int>(g)));
    }
  } else if (mine.numel() > 0) {
    ops.push_back(P2POp::recv(mine, src));
  }
  comm.wait(comm.send_recv(ops));
  return mine;
}

// distribute_tensor's step on mesh dim m (from Replicate to p). `input` is the caller's tensor,
// which is never written.
Tensor distribute_dim(const Tensor& current, const Tensor& input, const Placement& p, int m,
                      std::optional<int> src, const MeshComms& comms) {
  const int64_t k = comms.mesh().size(m);
  if (k == 1) return current;
  if (shard_dim(p)) {
    if (src) return scatter_dim(current, p, m, *src, comms);
    const IndexRuns runs =
        split_positions(current.size(*shard_dim(p)), k, comms.coord()[m], split_factor_of(p));
    return take_positions(current, *shard_dim(p), runs);
  }
  Tensor out = current;
  if (src) {
    Communicator& comm = comms.dim(m);
    out = comm.rank() == *src ? current.contiguous()
                              : Tensor::empty(current.shape(), current.dtype(), current.device());
    comm.wait(comm.broadcast(out, *src));  // the root's buffer is only read
  }
  if (const auto* partial = std::get_if<Partial>(&p); partial && partial->op == ReduceOp::kSum) {
    // NOTE R -> P(sum) partition (docs/pytorch-semantics.md 2.5): x / k, so the group's sum is x.
    if (!out.is_contiguous() || out.shares_storage_with(input)) out = out.clone();
    kernels::scale_(out, 1.0 / static_cast<double>(k));
  }
  return out;
}

void reject_partial(const Placements& placements, const char* factory) {
  for (size_t m = 0; m < placements.size(); ++m)
    if (is_partial(placements[m]))
      throw InvalidArgument(fmt::format(
          "{}: placement {} on mesh dim {} is not supported: factories take Shard, StridedShard "
          "and Replicate placements only (a Partial value has no meaning without a reduction)",
          factory, to_string(placements[m]), m));
}

// A factory's DTensor: the spec, and fill(local, layout) on ranks of the mesh.
template <class Fill>
DTensor make_factory(const char* name, const Dims& shape, DType dtype,
                     std::shared_ptr<const MeshComms> comms, const Placements& placements, Fill fill) {
  check_comms(comms, name);
  DTensorSpec spec = make_spec(mesh_of(comms), placements, shape, dtype);
  reject_partial(spec.placements, name);
  if (!comms->in_mesh()) return DTensor(comms, spec, empty_outside(dtype));
  const ShardLayout layout = *spec.layout(comms->rank());
  return DTensor(comms, spec, fill(layout));
}

// Significand bits of a floating dtype: rand draws multiples of 2^-bits, exact in the dtype, so
// the cast never rounds up to 1.
int uniform_bits(DType dtype) {
  switch (dtype) {
    case DType::kF64: return 53;
    case DType::kF32: return 24;
    case DType::kF16: return 11;
    case DType::kBF16: return 8;
    case DType::kF8E4M3: return 4;
    case DType::kF8E5M2: return 3;
    default: return 0;
  }
}

// from_local's run_check record of one rank (int64): dtype, tensor ndim, local shape, global
// shape, global stride (kMaxDims each), then 3 entries per mesh dim for its placement.
constexpr int kPlacementFields = 3;
int record_size(int mesh_ndim) { return 2 + 3 * kernels::kMaxDims + kPlacementFields * mesh_ndim; }

struct Record {
  DType dtype;
  Dims local_shape, shape, stride;
  std::vector<int64_t> placements;
};

std::vector<int64_t> encode(const Record& r, int mesh_ndim) {
  std::vector<int64_t> out(record_size(mesh_ndim), 0);
  out[0] = static_cast<int64_t>(r.dtype);
  out[1] = r.shape.size();
  for (int i = 0; i < r.local_shape.size(); ++i) out[2 + i] = r.local_shape[i];
  for (int i = 0; i < r.shape.size(); ++i) out[2 + kernels::kMaxDims + i] = r.shape[i];
  for (int i = 0; i < r.stride.size(); ++i) out[2 + 2 * kernels::kMaxDims + i] = r.stride[i];
  std::copy(r.placements.begin(), r.placements.end(), out.begin() + 2 + 3 * kernels::kMaxDims);
  return out;
}

Record decode(const int64_t* p, int mesh_ndim) {
  Record r;
  r.dtype = static_cast<DType>(p[0]);
  const int ndim = static_cast<int>(p[1]);
  for (int i = 0; i < ndim; ++i) {
    r.local_shape.push_back(p[2 + i]);
    r.shape.push_back(p[2 + kernels::kMaxDims + i]);
    r.stride.push_back(p[2 + 2 * kernels::kMaxDims + i]);
  }
  r.placements.assign(p + 2 + 3 * kernels::kMaxDims, p + record_size(mesh_ndim));
  return r;
}

std::vector<int64_t> placement_fields(const Placements& ps) {
  std::vector<int64_t> out;
  for (const Placement& p : ps) {
    out.push_back(static_cast<int64_t>(p.index()));
    out.push_back(shard_dim(p).value_or(-1));
    if (const auto* s = std::get_if<StridedShard>(&p)) out.push_back(s->split_factor);
    else if (const auto* q = std::get_if<Partial>(&p)) out.push_back(static_cast<int64_t>(q->op));
    else out.push_back(0);
  }
  return out;
}

// Every mesh rank's record, indexed by row-major mesh position: all-gathers along the last mesh
// dim first, so after the gather along mesh dim 0 the buffer is in row-major coordinate order.
std::vector<Record> gather_records(const Record& mine, const MeshComms& comms) {
  const int mesh_ndim = comms.mesh().ndim();
  const std::vector<int64_t> fields = encode(mine, mesh_ndim);
  Tensor buf = Tensor::empty({static_cast<int64_t>(fields.size())}, DType::kI64);
  std::copy(fields.begin(), fields.end(), buf.data<int64_t>());
  for (int m = mesh_ndim - 1; m >= 0; --m) {
    Communicator& comm = comms.dim(m);
    Tensor next = Tensor::empty({comm.size() * buf.numel()}, DType::kI64);
    comm.wait(comm.all_gather(buf, next));
    buf = next;
  }
  std::vector<Record> out;
  for (int64_t p = 0; p < comms.mesh().size(); ++p)
    out.push_back(decode(buf.data<int64_t>() + p * record_size(mesh_ndim), mesh_ndim));
  return out;
}

// from_local's run_check: the same (dtype, global shape, stride, placements) everywhere, and
// torch.chunk local shapes. Every rank sees every record, so all ranks throw the same error.
void check_agreement(const Record& mine, const MeshComms& comms, const Placements& placements) {
  const DeviceMesh& mesh = comms.mesh();
  const std::vector<Record> records = gather_records(mine, comms);
  std::vector<std::pair<int, size_t>> by_rank;  // (rank, mesh position), in rank order
  for (size_t p = 0; p < records.size(); ++p) by_rank.emplace_back(mesh.ranks()[p], p);
  std::sort(by_rank.begin(), by_rank.end());
  const int ref_rank = by_rank[0].first;
  const Record& ref = records[by_rank[0].second];
  for (const auto& [rank, pos] : by_rank) {
    const Record& r = records[pos];
    auto disagree = [&](const char* what, const std::string& got, const std::string& want) {
      return InvalidArgument(
          fmt::format("from_local(run_check): rank {} disagrees with rank {} on the {}: {} vs {}", rank,
                      ref_rank, what, got, want));
    };
    if (r.dtype != ref.dtype)
      throw disagree("dtype", std::string(kernels::to_string(r.dtype)),
                     std::string(kernels::to_string(ref.dtype)));
    if (!(r.shape == ref.shape))
      throw disagree("global shape", shape_text(r.shape), shape_text(ref.shape));
    if (!(r.stride == ref.stride))
      throw disagree("global stride", shape_text(r.stride), shape_text(ref.stride));
    if (r.placements != ref.placements) throw disagree("placements", "(differ)", to_string(placements));
  }
  for (const auto& [rank, pos] : by_rank) {
    const Dims want = compute_layout(ref.shape, mesh.shape(), placements, *mesh.coord_of(rank)).local_shape;
    if (!(records[pos].local_shape == want))
      throw InvalidArgument(fmt::format(
          "from_local(run_check): rank {} has local shape {} but its torch.chunk shard of global "
          "shape {} under [{}] is {} (uneven shards must follow torch.chunk; PyTorch #144109)",
          rank, shape_text(records[pos].local_shape), shape_text(ref.shape), to_string(placements),
          shape_text(want)));
  }
}

}  // namespace

// ---- DTensor ----

DTensor::DTensor(std::shared_ptr<const MeshComms> comms, DTensorSpec spec, Tensor local)
    : comms_(std::move(comms)), spec_(std::move(spec)), local_(std::move(local)) {
  check_comms(comms_, "DTensor");
  if (!spec_.mesh || !(*spec_.mesh == comms_->mesh()))
    throw InvalidArgument(fmt::format("DTensor: the spec's mesh {} is not the communicators' mesh {}",
                                      spec_.mesh ? to_string(*spec_.mesh) : "(null)",
                                      to_string(comms_->mesh())));
  spec_.placements = normalize_placements(spec_.placements, spec_.mesh->ndim(), spec_.tensor_ndim());
  if (spec_.stride.size() != spec_.shape.size())
    throw InvalidArgument(fmt::format("DTensor: stride {} has {} entries for shape {}",
                                      shape_text(spec_.stride), spec_.stride.size(),
                                      shape_text(spec_.shape)));
  if (!comms_->in_mesh()) {
    if (local_.defined() && local_.numel() != 0)
      throw InvalidArgument(
          fmt::format("DTensor: rank {} is not in mesh {} and must hold an empty local "
                      "tensor, not one of shape {}",
                      comms_->rank(), to_string(comms_->mesh()), shape_text(local_.shape())));
    local_ = empty_outside(spec_.dtype);
    return;
  }
  if (!local_.defined())
    throw InvalidArgument(fmt::format("DTensor: the local tensor of rank {} is undefined", comms_->rank()));
  if (local_.dtype() != spec_.dtype)
    throw InvalidArgument(fmt::format("DTensor: local dtype {} differs from the spec's dtype {}",
                                      kernels::to_string(local_.dtype()), kernels::to_string(spec_.dtype)));
  const ShardLayout layout = *spec_.layout(comms_->rank());
  if (!(local_.shape() == layout.local_shape))
    throw InvalidArgument(fmt::format("DTensor: rank {} holds a local tensor of shape {} but {} gives it {}",
                                      comms_->rank(), shape_text(local_.shape()), to_string(spec_),
                                      shape_text(layout.local_shape)));
}

const Plan& DTensor::plan_to(const Placements& placements, const RedistributeOptions& options) const {
  return comms_->plans().plan(make_transition(spec_, placements, options.planner, options.reduce_policy()));
}

DTensor DTensor::redistribute(const Placements& placements, const RedistributeOptions& options) const {
  if (placements == spec_.placements && options.divide_factor == 1.0) return *this;  // shares the local tensor
  const Transition t = make_transition(spec_, placements, options.planner, options.reduce_policy());
  const PlacementList& target = t.tensor_shape.empty() ? t.dst : t.user_dst;  // NOTE [ragged plans]
  if (std::equal(target.begin(), target.end(), spec_.placements.begin(), spec_.placements.end()) &&
      options.divide_factor == 1.0)
    return *this;
  const PlanCache::Found found = comms_->plans().find(t);  // planned once, on the first call
  ExecHandle h = issue_cached(t, *found.plan, found.recipe, spec_, local_, *comms_);
  DTensorSpec out = spec_;
  out.placements = result_placements(*found.plan);
  Tensor result = h.wait()[0];
  return DTensor(Trusted{}, comms_, std::move(out), std::move(result));
}

DTensor DTensor::redistribute(const Placements& placements, const Tensor& out,
                              const RedistributeOptions& options) const {
  RedistributeHandle h = redistribute_async(*this, placements, options, out);
  return h.wait();
}

DTensor DTensor::view_on(std::shared_ptr<const MeshComms> comms, const Placements& placements) const {
  check_comms(comms, "view_on");
  const std::string why = view_mismatch(spec_, comms->mesh(), placements);
  if (!why.empty())
    throw InvalidArgument(fmt::format("view_on: [{}] on {} is not the same data as [{}] on {}: {}",
                                      to_string(placements), to_string(comms->mesh()), to_string(spec_.placements),
                                      to_string(comms_->mesh()), why));
  DTensorSpec out = spec_;
  out.mesh = mesh_of(comms);
  out.placements = normalize_placements(placements, comms->mesh().ndim(), spec_.tensor_ndim());
  return DTensor(std::move(comms), std::move(out), local_);
}

DTensor DTensor::view_on(std::shared_ptr<const MeshComms> comms) const {
  check_comms(comms, "view_on");
  std::optional<Placements> ps = equivalent_placements(spec_, comms->mesh());
  if (!ps)
    throw InvalidArgument(fmt::format("view_on: no placements on {} hold the same data as [{}] on {} (shape [{}])",
                                      to_string(comms->mesh()), to_string(spec_.placements),
                                      to_string(comms_->mesh()), fmt::join(spec_.shape, ",")));
  return view_on(std::move(comms), *ps);
}

Tensor DTensor::full_tensor() const {
  return redistribute(Placements(spec_.placements.size(), Replicate{})).to_local();
}

std::string DTensor::ownership() const { return ownership_text(spec_); }

std::string ownership_text(const DTensorSpec& spec) {
  const DeviceMesh& mesh = *spec.mesh;
  std::vector<int> ranks = mesh.ranks();
  std::sort(ranks.begin(), ranks.end());
  std::string out = fmt::format("{:>4}  {:<9} {:<11} {:<13} {}\n", "rank", "coord", "local", "offset",
                                "held indices per tensor dim");
  for (int rank : ranks) {
    const ShardLayout l = *spec.layout(rank);
    std::vector<std::string> held;
    for (int t = 0; t < spec.tensor_ndim(); ++t) held.push_back(runs_text(l.runs[t]));
    out += fmt::format("{:>4}  {:<9} {:<11} {:<13} {}\n", rank,
                       fmt::format("({})", fmt::join(*mesh.coord_of(rank), ",")),
                       shape_text(l.local_shape), shape_text(l.global_offset), fmt::join(held, " x "));
  }
  // Owner grid for small 1-D and 2-D tensors (PyTorch's visualize_sharding): a 1-D tensor is one row.
  const int nd = spec.tensor_ndim();
  if (nd < 1 || nd > 2 || spec.shape.product() == 0) return out;
  const int64_t rows = nd == 2 ? spec.shape[0] : 1, cols = spec.shape[nd - 1];
  if (rows > 16 || cols > 16) return out;
  std::vector<std::vector<std::string>> owner(rows, std::vector<std::string>(cols));
  for (int rank : ranks) {
    const ShardLayout l = *spec.layout(rank);
    const std::vector<int64_t> is = nd == 2 ? l.indices(0) : std::vector<int64_t>{0};
    for (int64_t i : is)
      for (int64_t j : l.indices(nd - 1)) {
        std::string& cell = owner[i][j];
        cell += cell.empty() ? fmt::format("{}", rank) : fmt::format("/{}", rank);
      }
  }
  size_t width = 1;
  for (const auto& row : owner)
    for (const auto& cell : row) width = std::max(width, cell.size());
  out += "owners of each element:\n";
  for (const auto& row : owner) {
    std::string line;
    for (const auto& cell : row) line += fmt::format(" {:>{}}", cell, width);
    out += line + "\n";
  }
  return out;
}

// ---- construction ----

DTensor distribute_tensor(const Tensor& tensor, std::shared_ptr<const MeshComms> comms,
                          const Placements& placements, std::optional<int> src_data_rank) {
  check_comms(comms, "distribute_tensor");
  if (!tensor.defined()) throw InvalidArgument("distribute_tensor: the tensor is undefined");
  const DeviceMesh& mesh = comms->mesh();
  DTensorSpec spec = make_spec(mesh_of(comms), placements, tensor.shape(), tensor.dtype());
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (src_data_rank && (*src_data_rank < 0 || *src_data_rank >= mesh.size(m)))
      throw InvalidArgument(fmt::format(
          "distribute_tensor: src_data_rank {} is out of range for mesh dim {} of size {} (it is a "
          "group rank, applied on every mesh dim)",
          *src_data_rank, m, mesh.size(m)));
    if (const auto* p = std::get_if<Partial>(&spec.placements[m]); p && p->op == ReduceOp::kProd)
      throw Unsupported(fmt::format(
          "distribute_tensor: {} on mesh dim {}: a replicated value has no P(prod) partition "
          "(PyTorch rejects it too)",
          to_string(spec.placements[m]), m));
    const auto* p = std::get_if<Partial>(&spec.placements[m]);
    if (p && p->op == ReduceOp::kSum && mesh.size(m) > 1 && !kernels::is_floating_point(tensor.dtype()))
      throw Unsupported(fmt::format(
          "distribute_tensor: {} on mesh dim {} of size {}: the partition x / {} of integer ({}) values "
          "would truncate (use a floating dtype)",
          to_string(spec.placements[m]), m, mesh.size(m), mesh.size(m), kernels::to_string(tensor.dtype())));
  }
  if (const int r = ragged_mesh_dim(spec.placements); r >= 0) {
    // Replicated over the ragged mesh dim first, then cut to the ranges (a local chunk).
    Placements replicated = spec.placements;
    replicated[r] = Replicate{};
    return distribute_tensor(tensor, comms, replicated, src_data_rank).redistribute(spec.placements);
  }
  if (!comms->in_mesh()) return DTensor(comms, std::move(spec), empty_outside(tensor.dtype()));
  Tensor current = tensor;
  for (int m = 0; m < mesh.ndim(); ++m)
    current = distribute_dim(current, tensor, spec.placements[m], m, src_data_rank, *comms);
  // The result never aliases the caller's tensor.
  if (current.shares_storage_with(tensor) || !current.is_contiguous()) current = current.clone();
  return DTensor(comms, std::move(spec), std::move(current));
}

DTensor from_local(const Tensor& local, std::shared_ptr<const MeshComms> comms,
                   const Placements& placements, std::optional<Dims> shape,
                   std::optional<Dims> stride, bool run_check) {
  check_comms(comms, "from_local");
  if (!local.defined()) throw InvalidArgument("from_local: the local tensor is undefined");
  if (stride && !shape)
    throw InvalidArgument(fmt::format("from_local: stride {} given without a shape (give both, or the "
                                      "shape alone for a row-major stride)",
                                      shape_text(*stride)));
  const DeviceMesh& mesh = comms->mesh();
  if (shape && comms->in_mesh() && shape->size() != local.ndim())
    throw InvalidArgument(
        fmt::format("from_local: global shape {} has {} dims but the local tensor {} has {}",
                    shape_text(*shape), shape->size(), shape_text(local.shape()), local.ndim()));
  const int tensor_ndim = shape ? shape->size() : local.ndim();
  const Placements ps = normalize_placements(placements, mesh.ndim(), tensor_ndim);
  DTensorSpec spec;
  if (shape) {
    spec = make_spec(mesh_of(comms), ps, *shape, local.dtype(), stride);
  } else {
    // Even sharding assumed (PyTorch's compute_global_tensor_info): each Shard(d) mesh dim of
    // size k multiplies global[d] by k and every stride[i] >= stride[d] (i != d) by k.
    Dims global_shape = local.shape(), global_stride = local.strides();
    for (int m = 0; m < mesh.ndim(); ++m) {
      const std::optional<int> d = shard_dim(ps[m]);
      if (!d) continue;
      const int64_t k = mesh.size(m);
      global_shape[*d] *= k;
      const int64_t sd = global_stride[*d];
      for (int i = 0; i < global_stride.size(); ++i)
        if (i != *d && global_stride[i] >= sd) global_stride[i] *= k;
    }
    spec = make_spec(mesh_of(comms), ps, global_shape, local.dtype(), global_stride);
  }
  if (!comms->in_mesh()) return DTensor(comms, std::move(spec), empty_outside(local.dtype()));
  if (run_check)
    check_agreement(
        {local.dtype(), local.shape(), spec.shape, spec.stride, placement_fields(spec.placements)}, *comms,
        spec.placements);
  return DTensor(comms, std::move(spec), local);
}

struct RedistributeHandle::Pending {
  ExecHandle exec;
};

RedistributeHandle::RedistributeHandle() = default;
RedistributeHandle::RedistributeHandle(RedistributeHandle&&) noexcept = default;
RedistributeHandle& RedistributeHandle::operator=(RedistributeHandle&&) noexcept = default;
RedistributeHandle::~RedistributeHandle() = default;

bool RedistributeHandle::ready() { return !pending_ || pending_->exec.ready(); }

RedistributeHandle redistribute_async(const DTensor& tensor, const Placements& placements,
                                      const RedistributeOptions& options, const Tensor& out) {
  RedistributeHandle h;
  h.comms_ = tensor.comms();
  h.spec_ = tensor.spec();
  if (out.defined()) h.spec_.dtype = out.dtype();
  // Plans (and validates) here, so bad input throws on the caller, not from wait().
  const Transition t = make_transition(tensor.spec(), placements, options.planner, options.reduce_policy(),
                                       out.defined() ? std::optional(out.dtype()) : std::nullopt);
  const PlanCache::Found found = h.comms_->plans().find(t);
  h.spec_.placements = result_placements(*found.plan);
  h.pending_ = std::make_unique<RedistributeHandle::Pending>();
  h.pending_->exec = issue_cached(t, *found.plan, found.recipe, tensor.spec(), tensor.to_local(), *h.comms_, out,
                                  /*background=*/true);
  h.pending_->exec.kick();  // the caller overlaps it with other work: progress starts now
  return h;
}

DTensor RedistributeHandle::wait(collectives::Milliseconds timeout) {
  if (!comms_ || !pending_) throw InvalidArgument("RedistributeHandle::wait: the handle holds no redistribute");
  return DTensor(DTensor::Trusted{}, comms_, spec_, pending_->exec.wait(timeout)[0]);
}

DTensor RedistributeHandle::wait() {
  if (!comms_ || !pending_) throw InvalidArgument("RedistributeHandle::wait: the handle holds no redistribute");
  return DTensor(DTensor::Trusted{}, comms_, spec_, pending_->exec.wait()[0]);
}

std::vector<DTensor> redistribute_batch(std::span<const DTensor> tensors, const Placements& placements,
                                        const RedistributeOptions& options, std::span<const Tensor> outs) {
  if (tensors.empty()) return {};
  if (!outs.empty() && outs.size() != tensors.size())
    throw InvalidArgument(fmt::format("redistribute_batch: {} out tensors for {} tensors (give one per tensor, or none)",
                                      outs.size(), tensors.size()));
  const DTensor& first = tensors[0];
  std::vector<Placements> dsts;
  size_t largest = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DTensor& t = tensors[i];
    if (!(t.device_mesh() == first.device_mesh()))
      throw Unsupported(fmt::format(
          "redistribute_batch: tensor {} is on mesh {} but tensor 0 on mesh {}: cross-mesh "
          "redistribute is not supported",
          i, to_string(t.device_mesh()), to_string(first.device_mesh())));
    if (t.placements() != first.placements())
      throw InvalidArgument(
          fmt::format("redistribute_batch: tensor {} has placements [{}] but tensor 0 has [{}]", i,
                      to_string(t.placements()), to_string(first.placements())));
    if (t.dtype() != first.dtype())
      throw InvalidArgument(fmt::format("redistribute_batch: tensor {} has dtype {} but tensor 0 has {}", i,
                                        kernels::to_string(t.dtype()), kernels::to_string(first.dtype())));
    // Negative shard dims normalise per tensor ndim; the batch needs one target.
    dsts.push_back(normalize_placements(placements, t.device_mesh().ndim(), t.spec().tensor_ndim()));
    if (dsts[i] != dsts[0])
      throw InvalidArgument(fmt::format(
          "redistribute_batch: target [{}] means [{}] for tensor {} but [{}] for tensor 0",
          to_string(placements), to_string(dsts[i]), i, to_string(dsts[0])));
    if (t.spec().shape.product() > tensors[largest].spec().shape.product()) largest = i;
  }
  const Placements& dst = dsts[0];
  if (dst == first.placements() && outs.empty() && options.divide_factor == 1.0) return {tensors.begin(), tensors.end()};
  if (ragged_mesh_dim(dst) >= 0 || ragged_mesh_dim(first.placements()) >= 0) {
    // NOTE [ragged plans]: a plan on a RaggedShard view is made per shape, so the batch moves
    // tensor by tensor, every redistribute issued before the first is waited for.
    std::vector<RedistributeHandle> pending;
    for (size_t i = 0; i < tensors.size(); ++i)
      pending.push_back(redistribute_async(tensors[i], dst, options, outs.empty() ? Tensor() : outs[i]));
    std::vector<DTensor> out;
    for (RedistributeHandle& h : pending) out.push_back(h.wait());
    return out;
  }
  // One plan for the batch, costed for its largest tensor and valid for every shape in it
  // (NOTE [step validity]: validity can depend on the shape when sizes are uneven).
  std::vector<Dims> shapes;
  for (const DTensor& t : tensors) shapes.push_back(t.spec().shape);
  const Plan& plan = first.comms()->plans().plan(make_transition(tensors[largest].spec(), dst, options.planner,
                                                                 options.reduce_policy(), std::nullopt, {}, false, shapes));
  std::vector<DTensorSpec> specs;
  std::vector<Tensor> locals;
  for (const DTensor& t : tensors) {
    specs.push_back(t.spec());
    locals.push_back(t.to_local());
  }
  const MeshComms& comms = *first.comms();
  std::vector<Tensor> moved = comms.in_mesh() ? execute_batch(plan, specs, locals, comms, options.reduce_policy(), outs)
                                              : (outs.empty() ? locals : std::vector<Tensor>(outs.begin(), outs.end()));
  std::vector<DTensor> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    DTensorSpec s = specs[i];
    s.placements = dst;
    if (!outs.empty()) s.dtype = outs[i].dtype();
    out.push_back(DTensor(DTensor::Trusted{}, first.comms(), std::move(s), std::move(moved[i])));
  }
  return out;
}

// ---- factories ----

DTensor empty(const Dims& shape, DType dtype, std::shared_ptr<const MeshComms> comms,
              const Placements& placements, Device device) {
  return make_factory("empty", shape, dtype, std::move(comms), placements,
                      [&](const ShardLayout& l) { return Tensor::empty(l.local_shape, dtype, device); });
}

DTensor zeros(const Dims& shape, DType dtype, std::shared_ptr<const MeshComms> comms,
              const Placements& placements, Device device) {
  return make_factory("zeros", shape, dtype, std::move(comms), placements,
                      [&](const ShardLayout& l) { return Tensor::zeros(l.local_shape, dtype, device); });
}

DTensor ones(const Dims& shape, DType dtype, std::shared_ptr<const MeshComms> comms,
             const Placements& placements, Device device) {
  return make_factory("ones", shape, dtype, std::move(comms), placements,
                      [&](const ShardLayout& l) { return Tensor::full(l.local_shape, 1.0, dtype, device); });
}

DTensor full(const Dims& shape, double value, DType dtype, std::shared_ptr<const MeshComms> comms,
             const Placements& placements, Device device) {
  return make_factory("full", shape, dtype, std::move(comms), placements,
                      [&](const ShardLayout& l) { return Tensor::full(l.local_shape, value, dtype, device); });
}

DTensor rand(const Dims& shape, uint64_t seed, DType dtype, std::shared_ptr<const MeshComms> comms,
             const Placements& placements, Device device) {
  const int bits = uniform_bits(dtype);
  if (bits == 0)
    throw InvalidArgument(
        fmt::format("rand: dtype {} is not a floating-point type", kernels::to_string(dtype)));
  // NOTE [rand] value(i) = top `bits` bits of mix64(mix64(seed) ^ i) / 2^bits for the row-major
  // global flat index i: a counter-based draw, so every sharding holds the same global tensor.
  const uint64_t key = mix64(seed);
  const double scale = std::ldexp(1.0, -bits);
  return make_factory("rand", shape, dtype, std::move(comms), placements, [&](const ShardLayout& l) {
    // A RaggedShard's layout is of the flattened view, whose row-major flat index is the tensor's.
    const Dims dims = ragged_mesh_dim(placements) >= 0 ? ragged_view(shape, placements) : shape;
    Tensor out = Tensor::empty(l.local_shape, dtype);
    std::vector<HeldIndices> held;  // no index lists: memory in the number of runs
    for (int t = 0; t < dims.size(); ++t) held.emplace_back(l.runs[t]);
    out.fill_index_([&](std::span<const int64_t> local) {
      uint64_t flat = 0;
      for (int t = 0; t < dims.size(); ++t)
        flat = flat * static_cast<uint64_t>(dims[t]) + static_cast<uint64_t>(held[t][local[t]]);
      return static_cast<double>(mix64(key ^ flat) >> (64 - bits)) * scale;
    });
    return device.is_cpu() ? out : out.to(device);  // drawn on the host, like the CPU values
  });
}

std::string to_string(const DTensor& t) {
  return fmt::format("DTensor(shape={}, dtype={}, mesh={}, placements=[{}], local={})", shape_text(t.shape()),
                     kernels::to_string(t.dtype()), to_string(t.device_mesh()), to_string(t.placements()),
                     kernels::to_string(t.to_local()));
}

}  // namespace dtensor
