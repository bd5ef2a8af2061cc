#include "dtensor/plan/reference.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "kernels/error.h"

namespace dtensor {

namespace {

__extension__ typedef __int128 Wide;

int64_t numel(const ShardLayout& l) { return l.local_shape.product(); }

int64_t to_bytes(Wide v, const Dims& shape, DType dtype) {
  if (v > kernels::kInt64Max || v < 0)
    throw kernels::InvalidArgument(fmt::format("the traffic of a redistribute of shape [{}] ({}) overflows int64 bytes",
                                               fmt::join(shape, ","), kernels::to_string(dtype)));
  return static_cast<int64_t>(v);
}

enum class Movement { kExchange, kReduction, kLocal };

Movement movement_of(const Step& step) {
  if (std::holds_alternative<AllReduce>(step) || std::holds_alternative<ReduceScatter>(step)) return Movement::kReduction;
  if (std::holds_alternative<LocalChunk>(step) || std::holds_alternative<LocalPartial>(step)) return Movement::kLocal;
  return Movement::kExchange;  // AG, _AG, A2A, Regroup, LocalEmbed
}

}  // namespace

Traffic RankTraffic::busiest() const {
  Traffic t;
  for (int64_t v : sent) t.sent = std::max(t.sent, v);
  for (int64_t v : received) t.received = std::max(t.received, v);
  return t;
}

std::vector<ShardLayout> mesh_layouts(const Dims& global_shape, const Dims& mesh_shape, const Placements& placements) {
  std::vector<ShardLayout> out;
  out.reserve(mesh_shape.product());
  for (int64_t p = 0; p < mesh_shape.product(); ++p)
    out.push_back(compute_layout(global_shape, mesh_shape, placements, unravel_index(p, mesh_shape)));
  return out;
}

bool reference_valid_step(const Step& step, const Placements& before, const Dims& global_shape, const Dims& mesh_shape) {
  if (!starts_from(step, before, mesh_shape)) return false;
  const std::vector<ShardLayout> pre = mesh_layouts(global_shape, mesh_shape, before);
  const std::vector<ShardLayout> post = mesh_layouts(global_shape, mesh_shape, apply_step(step, before));
  const int64_t n = mesh_shape.product();
  const int m = mesh_dim_of(step);
  const int64_t k = mesh_shape[m];
  const Movement movement = movement_of(step);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t need = numel(post[p]);
    if (need == 0) continue;
    if (movement != Movement::kExchange || k == 1) {
      // Local: the rank keeps a subset of what it holds. Reduction: the same, because every
      // member of a Partial mesh dim holds the same index set (the group's extent).
      if (common_elements(pre[p], post[p]) != need) return false;
      continue;
    }
    Dims coord = unravel_index(p, mesh_shape);
    int64_t covered = 0;  // the members' sets are disjoint, so the sum counts each element once
    for (int64_t g = 0; g < k; ++g) {
      coord[m] = g;
      covered += common_elements(pre[ravel_index(coord, mesh_shape)], post[p]);
    }
    if (covered != need) return false;
  }
  return true;
}

RankTraffic reference_step_traffic(const Step& step, const Placements& before, const Dims& global_shape,
                                   const Dims& mesh_shape, DType dtype) {
  const int64_t n = mesh_shape.product();
  const int m = mesh_dim_of(step);
  const int64_t k = mesh_shape[m];
  std::optional<DType> wire;
  if (const auto* a = std::get_if<AllReduce>(&step)) wire = a->wire;
  if (const auto* rs = std::get_if<ReduceScatter>(&step)) wire = rs->wire;
  const int64_t item = static_cast<int64_t>(kernels::itemsize(wire.value_or(dtype)));
  const bool fp8 = wire && (*wire == DType::kF8E4M3 || *wire == DType::kF8E5M2);
  RankTraffic t;
  t.sent.assign(n, 0);
  t.received.assign(n, 0);
  if (!communicates(step) || k == 1) return t;
  const std::vector<ShardLayout> pre = mesh_layouts(global_shape, mesh_shape, before);
  const std::vector<ShardLayout> post = mesh_layouts(global_shape, mesh_shape, apply_step(step, before));
  for (int64_t p = 0; p < n; ++p) {
    Dims coord = unravel_index(p, mesh_shape);
    const int64_t r = coord[m];
    if (std::holds_alternative<AllReduce>(step)) {
      const int64_t N = numel(pre[p]);
      if (wire) {  // chunks of the flat tensor: the first N % k members hold one more element
        const Wide chunk = N / k + (r < N % k ? 1 : 0);
        t.sent[p] = t.received[p] =
            to_bytes((Wide{N} - chunk + Wide{k - 1} * chunk) * item + (fp8 ? 8 * (k - 1) : 0), global_shape, dtype);
        continue;
      }
      t.sent[p] = t.received[p] = to_bytes((Wide{2} * (k - 1) * N + k - 1) / k * item, global_shape, dtype);
      continue;
    }
    if (std::holds_alternative<ReduceScatter>(step)) {
      const int64_t scales = fp8 ? 4 * (k - 1) : 0;  // an fp8 wire's per-sender scales
      t.sent[p] = to_bytes(Wide{numel(pre[p]) - numel(post[p])} * item + scales, global_shape, dtype);
      t.received[p] = to_bytes(Wide{k - 1} * numel(post[p]) * item + scales, global_shape, dtype);
      continue;
    }
    Wide sent = 0, received = 0;
    for (int64_t g = 0; g < k; ++g) {
      if (g == r) continue;
      coord[m] = g;
      const int64_t q = ravel_index(coord, mesh_shape);
      sent += Wide{common_elements(pre[p], post[q])} * item;
      received += Wide{common_elements(pre[q], post[p])} * item;
    }
    t.sent[p] = to_bytes(sent, global_shape, dtype);
    t.received[p] = to_bytes(received, global_shape, dtype);
  }
  return t;
}

namespace {

RankTraffic lower_bound_of(const DTensorSpec& src, const Placements& dst_in);

}  // namespace

RankTraffic reference_lower_bound(const DTensorSpec& src, const Placements& dst_in) {
  const Placements dst = normalize_placements(dst_in, src.mesh->ndim(), src.tensor_ndim());
  // NOTE [ragged plans] (transition.h): a RaggedShard transition's bound is of its view.
  if (std::optional<RaggedMapping> v = map_ragged_transition(src.mesh->shape(), src.shape, src.placements, dst)) {
    DTensorSpec view = src;
    view.shape = v->view;
    view.placements = v->src;
    return lower_bound_of(view, v->dst);
  }
  return lower_bound_of(src, dst);
}

namespace {

RankTraffic lower_bound_of(const DTensorSpec& src, const Placements& dst_in) {
  const DeviceMesh& mesh = *src.mesh;
  const int64_t n = mesh.size();
  const int64_t item = static_cast<int64_t>(kernels::itemsize(src.dtype));
  const Placements& from = src.placements;
  Placements dst = normalize_placements(dst_in, mesh.ndim(), src.tensor_ndim());
  int64_t contributions = 1, classes = 1;
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (is_partial(dst[m]) && !is_partial(from[m])) dst[m] = from[m];
    if (!is_partial(from[m]) || mesh.size(m) == 1) continue;
    if (from[m] == dst[m]) classes *= mesh.size(m);
    else contributions *= mesh.size(m);
  }
  RankTraffic t;
  t.sent.assign(n, 0);
  t.received.assign(n, 0);
  const std::vector<ShardLayout> pre = mesh_layouts(src.shape, mesh.shape(), from);
  const std::vector<ShardLayout> post = mesh_layouts(src.shape, mesh.shape(), dst);
  if (contributions == 1) {
    for (int64_t p = 0; p < n; ++p)
      t.received[p] = to_bytes(Wide{numel(post[p]) - common_elements(pre[p], post[p])} * item, src.shape, src.dtype);
    return t;
  }
  Wide held_after = 0;
  for (int64_t p = 0; p < n; ++p) held_after += numel(post[p]);
  const Wide total = Wide{src.shape.product()} * (contributions - 2) * classes + held_after;
  const Wide busiest = (total + n - 1) / n;
  for (int64_t p = 0; p < n; ++p)
    t.received[p] = to_bytes(std::max(busiest, Wide{numel(post[p])}) * item, src.shape, src.dtype);
  return t;
}

}  // namespace

bool ReferenceOracle::valid(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
                            WorkBudget&) const {
  return reference_valid_step(step, before, shape, mesh_shape);
}

Traffic ReferenceOracle::step(const Step& step, const Placements& before, const Dims& shape, const Dims& mesh_shape,
                              DType dtype, WorkBudget&) const {
  return reference_step_traffic(step, before, shape, mesh_shape, dtype).busiest();
}

Traffic ReferenceOracle::route(std::span<const Step> steps, std::span<const Placements> states, const Dims& shape,
                               const Dims& mesh_shape, DType dtype, WorkBudget&) const {
  const int64_t n = mesh_shape.product();
  std::vector<Wide> sent(n, 0), received(n, 0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const RankTraffic t = reference_step_traffic(steps[i], states[i], shape, mesh_shape, dtype);
    for (int64_t p = 0; p < n; ++p) {
      sent[p] += t.sent[p];
      received[p] += t.received[p];
      to_bytes(sent[p], shape, dtype);
      to_bytes(received[p], shape, dtype);
    }
  }
  Traffic out;
  for (int64_t p = 0; p < n; ++p) {
    out.sent = std::max(out.sent, static_cast<int64_t>(sent[p]));
    out.received = std::max(out.received, static_cast<int64_t>(received[p]));
  }
  return out;
}

}  // namespace dtensor
