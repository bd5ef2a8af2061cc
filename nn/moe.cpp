#include "nn/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "dtensor/layout.h"
#include "dtensor/row_exchange.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/elementwise.h"
#include "kernels/ops/matmul.h"

namespace nn {

namespace ops = dtensor::ops;
using dtensor::Partial;
using dtensor::Replicate;
using dtensor::Shard;
using kernels::InvalidArgument;

namespace {

constexpr const char* kSavedKey = "moe";
constexpr const char* kStatsKey = "moe.stats";

std::vector<double> local_values(const DTensor& t) { return t.to_local().contiguous().to_vector(); }

// The experts compute in f64 for f64 parameters, else in f32 (vectorised GEMMs and GELU).
DType expert_dtype(const Parameter& w) { return w.dtype() == DType::kF64 ? DType::kF64 : DType::kF32; }

// A parameter's local shard as a contiguous CPU tensor of `dtype`.
Tensor local_as(const DTensor& t, DType dtype) {
  Tensor l = t.to_local();
  if (!l.device().is_cpu()) l = l.to(kernels::Device{});
  return l.dtype() == dtype ? l.contiguous() : l.to(dtype).contiguous();
}

// Rows [m, width] of `rows` (received order, `stride` apart) gathered into grouped order, as a
// tensor of `dtype` (f32 or f64).
Tensor gather_rows(const double* rows, int64_t width, int64_t stride, const std::vector<int64_t>& perm,
                   DType dtype) {
  const auto m = static_cast<int64_t>(perm.size());
  Tensor out = Tensor::empty({m, width}, dtype);
  auto fill = [&](auto* o) {
    for (int64_t j = 0; j < m; ++j) std::copy_n(rows + perm[j] * stride, width, o + j * width);
  };
  if (dtype == DType::kF64) fill(out.data<double>());
  else fill(out.data<float>());
  return out;
}

// Grouped rows [m, width] (contiguous f32 or f64) back into received order, in f64.
std::vector<double> scatter_rows(const Tensor& grouped, const std::vector<int64_t>& perm) {
  const int64_t width = grouped.size(1);
  std::vector<double> out(perm.size() * static_cast<size_t>(width));
  auto put = [&](const auto* g) {
    for (size_t j = 0; j < perm.size(); ++j) std::copy_n(g + j * width, width, out.data() + perm[j] * width);
  };
  if (grouped.dtype() == DType::kF64) put(grouped.data<double>());
  else put(grouped.data<float>());
  return out;
}

// Host values as a tensor on `device` (the exchanges and results live where the input does).
Tensor make(const std::vector<double>& v, const Dims& shape, DType dtype, kernels::Device device) {
  Tensor t = Tensor::from_vector(v, shape, dtype);
  return device.is_cpu() ? t : t.to(device);
}

// What the forward keeps for the backward.
struct Saved {
  int64_t n = 0;                  // local tokens
  std::vector<double> x;          // [n, D]
  std::vector<double> s;          // [n, E] scores
  std::vector<int64_t> sel;       // [n, k] experts
  std::vector<double> g;          // [n, k] weights
  std::vector<char> kept;         // [n, k] within capacity
  std::vector<int64_t> order;     // kept assignments (t * k + j) in dispatch order
  std::vector<int64_t> send_rows, recv_rows;  // per EP member (one entry without EP)
  // The rows at the experts, grouped by local expert: grouped row j is received row perm[j];
  // expert e's rows are [off[e], off[e + 1]).
  std::vector<int64_t> perm, off;
  Tensor xg;                      // [m, D] (expert_dtype)
  Tensor hg;                      // [m, H / tp]: the pre-activations of this rank's slice
  std::vector<double> y;          // [order.size(), D]: expert outputs back at the tokens
  std::vector<double> f;          // [E] fraction of assignments
  int64_t n_global = 0;
  std::optional<DTensor> x_like;  // x (its spec, for dx)
};

// A parameter container ("router", "experts"): the MoE computes with its parameters itself.
class Holder : public Module {
 public:
  explicit Holder(std::string type) : Module(std::move(type)) {}
  std::shared_ptr<Parameter> add(std::string name, std::shared_ptr<Parameter> p) {
    return add_parameter(std::move(name), std::move(p));
  }
  void replace(const std::string& name, std::shared_ptr<Parameter> p) { replace_parameter(name, std::move(p)); }

 protected:
  DTensor do_forward(Ctx&, const DTensor&) override {
    throw InvalidArgument(fmt::format("{}: part of an MoE, not called on its own", type()));
  }
  std::optional<DTensor> do_backward(Ctx&, const DTensor&) override {
    throw InvalidArgument(fmt::format("{}: part of an MoE, not called on its own", type()));
  }
};

}  // namespace

// x's spec with Partial(sum) on the tensor-parallel dim (x's own spec without one).
dtensor::DTensorSpec MoE::partial_on_tp(const DTensor& x) const {
  if (!tp_dim_ || x.spec().mesh->shape()[*tp_dim_] == 1) return x.spec();
  Placements pl = x.placements();
  pl[*tp_dim_] = Partial{};
  return dtensor::make_spec(x.spec().mesh, pl, x.shape(), x.dtype());
}

MoE::MoE(const ModuleOptions& options, const MoEConfig& config) : Module("MoE"), config_(config) {
  if (!options.comms) throw InvalidArgument("MoE: ModuleOptions::comms is null");
  if (config.dim <= 0 || config.experts <= 0 || config.top_k < 1 || config.top_k > config.experts)
    throw InvalidArgument(fmt::format("MoE: dim {} and experts {} must be positive and top_k {} in 1..experts",
                                      config.dim, config.experts, config.top_k));
  if (config.capacity_factor < 0 || config.aux_loss_coef < 0)
    throw InvalidArgument(fmt::format("MoE: capacity factor {} and aux loss coefficient {} must be >= 0",
                                      config.capacity_factor, config.aux_loss_coef));
  if (config_.hidden <= 0) config_.hidden = kernels::checked_mul(4, config.dim, "MoE hidden size");
  const Init init = Init::normal(0, config.init_std);
  const int64_t E = config.experts, D = config.dim, H = config_.hidden;
  auto router = add_module("router", std::make_shared<Holder>("MoERouter"));
  auto experts = add_module("experts", std::make_shared<Holder>("GroupedExperts"));
  router_ = router->add("weight", std::make_shared<Parameter>(options.comms, Dims{E, D}, options.dtype,
                                                                       init, std::nullopt, options.device));
  w1_ = experts->add("w1", std::make_shared<Parameter>(options.comms, Dims{E, D, H}, options.dtype, init,
                                                                std::nullopt, options.device));
  w2_ = experts->add("w2", std::make_shared<Parameter>(options.comms, Dims{E, H, D}, options.dtype, init,
                                                                std::nullopt, options.device));
  if (config.shared_expert)
    shared_ = add_module("shared", std::make_shared<MLP>(options, D, H, false, config.gelu, config.init_std));
}

void MoE::set_expert_parallel(int mesh_dim) {
  const dtensor::DeviceMesh& mesh = w1_->comms()->mesh();
  if (mesh_dim < 0 || mesh_dim >= mesh.ndim())
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: mesh dim {} of a {}-d mesh", mesh_dim, mesh.ndim()));
  const int64_t ep = mesh.shape()[mesh_dim];
  if (config_.experts % ep != 0)
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: {} experts do not split over {} ranks "
                                      "(expected the EP size to divide the expert count)",
                                      config_.experts, ep));
  if (tp_dim_ == mesh_dim)
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: mesh dim {} is the tensor-parallel dim", mesh_dim));
  for (Parameter* p : {w1_.get(), w2_.get()}) {
    Placements pl = p->placements();
    pl[mesh_dim] = Shard{0};
    p->set_placements(pl);
  }
  ep_dim_ = mesh_dim;
}

void MoE::set_aux_grad_scale(double scale) {
  if (!std::isfinite(scale) || scale < 0)
    throw InvalidArgument(fmt::format("MoE::set_aux_grad_scale: {} (expected a finite scale >= 0)", scale));
  aux_grad_scale_ = scale;
}

void MoE::set_tensor_parallel(int mesh_dim) {
  if (ep_source_dim_)
    throw InvalidArgument("MoE::set_tensor_parallel: the experts are on a mesh carved from dp (EP from dp); the "
                          "experts' hidden dim over tp is not supported there (give EP its own mesh dim beside tp)");
  const dtensor::DeviceMesh& mesh = w1_->comms()->mesh();
  if (mesh_dim < 0 || mesh_dim >= mesh.ndim())
    throw InvalidArgument(fmt::format("MoE::set_tensor_parallel: mesh dim {} of a {}-d mesh", mesh_dim, mesh.ndim()));
  if (ep_dim_ == mesh_dim)
    throw InvalidArgument(fmt::format("MoE::set_tensor_parallel: mesh dim {} is the expert-parallel dim", mesh_dim));
  const int64_t tp = mesh.shape()[mesh_dim];
  if (config_.hidden % tp != 0)
    throw InvalidArgument(fmt::format("MoE::set_tensor_parallel: the experts' hidden size {} does not split over {} "
                                      "ranks (expected the tp size to divide it)",
                                      config_.hidden, tp));
  Placements p1 = w1_->placements(), p2 = w2_->placements();
  p1[mesh_dim] = Shard{2};
  p2[mesh_dim] = Shard{1};
  w1_->set_placements(p1);
  w2_->set_placements(p2);
  tp_dim_ = mesh_dim;
}

void MoE::set_expert_parallel(std::shared_ptr<const MeshComms> comms, int mesh_dim) {
  if (!comms) throw InvalidArgument("MoE::set_expert_parallel: null mesh");
  const dtensor::DeviceMesh& own = router_->comms()->mesh();
  const dtensor::DeviceMesh& mesh = comms->mesh();
  if (mesh_dim < 1 || mesh_dim >= mesh.ndim() || mesh.ndim() != own.ndim() + 1 ||
      mesh.shape()[mesh_dim - 1] * mesh.shape()[mesh_dim] != own.shape()[mesh_dim - 1])
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: mesh {} with ep dim {} is not the module's mesh {} "
                                      "with dim {} unflattened into (dp_mod_ep, ep)",
                                      dtensor::to_string(mesh), mesh_dim, dtensor::to_string(own), mesh_dim - 1));
  std::vector<std::string> names;
  if (mesh.has_names()) names = {mesh.names()[mesh_dim - 1], mesh.names()[mesh_dim]};
  if (!(own.unflatten(mesh_dim - 1, Dims{mesh.shape()[mesh_dim - 1], mesh.shape()[mesh_dim]}, names) == mesh))
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: mesh {} does not hold the ranks of {} unflattened "
                                      "at dim {}", dtensor::to_string(mesh), dtensor::to_string(own), mesh_dim - 1));
  if (tp_dim_)
    throw InvalidArgument("MoE::set_expert_parallel(comms, dim): EP carved from dp with the experts' hidden dim over "
                          "tp is not supported (give EP its own mesh dim beside tp)");
  if (!w1_->is_meta() || !w2_->is_meta())
    throw InvalidArgument("MoE::set_expert_parallel(comms, dim): call on a meta module (before materialize)");
  if (config_.experts % mesh.shape()[mesh_dim] != 0)
    throw InvalidArgument(fmt::format("MoE::set_expert_parallel: {} experts do not split over {} ranks "
                                      "(expected the EP size to divide the expert count)",
                                      config_.experts, mesh.shape()[mesh_dim]));
  Placements pl(mesh.ndim(), Replicate{});
  pl[mesh_dim] = Shard{0};
  Module* experts = nullptr;
  for (const auto& [n, c] : children())
    if (n == "experts") experts = c.get();
  for (auto* w : {&w1_, &w2_}) {
    const std::string name = w == &w1_ ? "w1" : "w2";
    auto moved = std::make_shared<Parameter>(comms, (*w)->shape(), (*w)->dtype(), (*w)->init(), pl, (*w)->device());
    moved->requires_grad = (*w)->requires_grad;
    static_cast<Holder*>(experts)->replace(name, moved);
    *w = moved;
  }
  ep_dim_ = mesh_dim;
  ep_source_dim_ = mesh_dim - 1;
}

int MoE::source_dim(int j) const {
  if (!ep_source_dim_ || j <= *ep_source_dim_) return j;
  return j == *ep_dim_ ? *ep_source_dim_ : j - 1;
}

DTensor MoE::do_forward(Ctx& ctx, const DTensor& x) {
  const int64_t D = config_.dim, H = config_.hidden, E = config_.experts, K = config_.top_k;
  const int nd = x.spec().tensor_ndim();
  if (nd < 1 || x.shape()[nd - 1] != D)
    throw InvalidArgument(fmt::format("MoE: input of shape {} (expected [..., {}])", x.shape(), D));
  const Placements& xp = x.placements();
  const dtensor::DeviceMesh& mesh = *x.spec().mesh;
  std::vector<int> token_dims;  // mesh dims that split the tokens
  for (int m = 0; m < static_cast<int>(xp.size()); ++m) {
    if (dtensor::is_partial(xp[m]) || dtensor::is_strided_shard(xp[m]) ||
        (dtensor::is_shard(xp[m]) && std::get<Shard>(xp[m]).dim == nd - 1))
      throw InvalidArgument(fmt::format("MoE: input placements {} (expected Replicate or Shard of a token dim "
                                        "on every mesh dim)", dtensor::to_string(xp)));
    if (dtensor::is_shard(xp[m]) && mesh.shape()[m] > 1) token_dims.push_back(m);
  }
  const MeshComms& ecomms = ep_source_dim_ ? *w1_->comms() : *x.comms();  // the experts' mesh
  if (ep_dim_ && ecomms.mesh().shape()[*ep_dim_] > 1 &&
      std::find(token_dims.begin(), token_dims.end(), source_dim(*ep_dim_)) == token_dims.end())
    throw InvalidArgument(fmt::format("MoE: expert parallel over mesh dim {} needs the tokens split over it "
                                      "(input placements {})", source_dim(*ep_dim_), dtensor::to_string(xp)));
  if (ep_source_dim_ && !(*x.spec().mesh == router_->comms()->mesh()))
    throw InvalidArgument(fmt::format("MoE: input on mesh {}, expected the module's mesh {}", dtensor::to_string(mesh),
                                      dtensor::to_string(router_->comms()->mesh())));
  const int64_t ep = ep_dim_ ? ecomms.mesh().shape()[*ep_dim_] : 1;
  const int64_t El = E / ep;
  const int64_t tp = tp_dim_ ? mesh.shape()[*tp_dim_] : 1;
  if (tp > 1 && !dtensor::is_replicate(xp[*tp_dim_]))
    throw InvalidArgument(fmt::format("MoE: tensor parallel over mesh dim {} needs the input Replicate there "
                                      "(input placements {}; nn::MoETensorParallel's hook makes it so)",
                                      *tp_dim_, dtensor::to_string(xp)));
  const int64_t Hl = H / tp;  // this rank's slice of each expert's hidden dim

  auto sv = std::make_shared<Saved>();
  Saved& S = *sv;
  S.x = local_values(x);
  S.n = static_cast<int64_t>(S.x.size()) / D;
  S.x_like = x;
  const int64_t n = S.n;
  const std::vector<double> wr = local_values(router_->data());

  // Router scores and top-k.
  S.s.assign(n * E, 0.0);
  S.sel.assign(n * K, 0);
  S.g.assign(n * K, 0.0);
  S.kept.assign(n * K, 1);
  std::vector<double> stat(2 * E + 1, 0.0);  // assignments per expert, score sums, tokens
  std::vector<int64_t> idx(E);
  for (int64_t t = 0; t < n; ++t) {
    double* s = &S.s[t * E];
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += S.x[t * D + d] * wr[e * D + d];
      s[e] = acc;
    }
    if (config_.score == RouterScore::kSoftmax) {
      const double mx = *std::max_element(s, s + E);
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += (s[e] = std::exp(s[e] - mx));
      for (int64_t e = 0; e < E; ++e) s[e] /= z;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-s[e]));
    }
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    double sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += s[idx[j]];
    for (int64_t j = 0; j < K; ++j) {
      S.sel[t * K + j] = idx[j];
      S.g[t * K + j] = config_.renormalize ? s[idx[j]] / sum : s[idx[j]];
      stat[idx[j]] += 1;
    }
    for (int64_t e = 0; e < E; ++e) stat[E + e] += s[e];
    stat[2 * E] += 1;
  }
  // Rows an expert keeps of `assigned` from a rank routing `tokens` tokens (capacity drops).
  const auto capacity = [&](int64_t tokens) {
    return static_cast<int64_t>(
        std::ceil(config_.capacity_factor * static_cast<double>(tokens * K) / static_cast<double>(E)));
  };
  const auto kept_rows = [&](double assigned, double tokens) {
    const auto a = static_cast<int64_t>(std::llround(assigned));
    return config_.capacity_factor > 0 ? std::min(a, capacity(static_cast<int64_t>(std::llround(tokens)))) : a;
  };
  if (config_.capacity_factor > 0) {
    const int64_t cap = capacity(n);
    std::vector<int64_t> used(E, 0);
    int64_t dropped = 0;
    for (int64_t a = 0; a < n * K; ++a)
      if (used[S.sel[a]]++ >= cap) {
        S.kept[a] = 0;
        ++dropped;
      }
    ctx.values["moe.dropped"] = dropped;
  }

  // Global routing statistics: every token-splitting rank's row, all-gathered (S(0) over the
  // token dims -> Replicate), summed here in row order. The rows also give the dispatch's receive
  // counts (below), so the dispatch needs no count exchange of its own.
  const int64_t W = 2 * E + 1;
  std::vector<double> rows = stat;  // [R, W]: R token-splitting ranks
  Placements gp(mesh.ndim(), Replicate{});
  int64_t R = 1;
  if (!token_dims.empty()) {
    for (int m : token_dims) {
      gp[m] = Shard{0};
      R *= mesh.shape()[m];
    }
    DTensor part(x.comms(), dtensor::make_spec(x.spec().mesh, gp, Dims{R, W}, DType::kF64),
                 make(stat, {1, W}, DType::kF64, x.to_local().device()));
    rows = part.redistribute(Placements(mesh.ndim(), Replicate{}), {ctx.ops().choose.planner}).to_local().to_vector();
    std::fill(stat.begin(), stat.end(), 0.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < W; ++j) stat[j] += rows[r * W + j];
  }
  S.n_global = static_cast<int64_t>(std::llround(stat[2 * E]));
  MoEStats stats;
  S.f.assign(E, 0.0);
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    stats.tokens_per_expert.push_back(static_cast<int64_t>(std::llround(stat[e])));
    if (S.n_global > 0) {
      S.f[e] = stat[e] / static_cast<double>(S.n_global * K);
      aux += S.f[e] * stat[E + e] / static_cast<double>(S.n_global);
    }
  }
  stats.aux_loss = config_.aux_loss_coef * static_cast<double>(E) * aux;
  {
    std::vector<double> per_rank(ep, 0.0);
    const int64_t groups = ep > 1 ? ep : E;
    per_rank.assign(groups, 0.0);
    for (int64_t e = 0; e < E; ++e) per_rank[ep > 1 ? e / El : e] += stat[e];
    const double mean = std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / static_cast<double>(groups);
    stats.imbalance = mean > 0 ? *std::max_element(per_rank.begin(), per_rank.end()) / mean : 1.0;
  }
  if (auto it = ctx.values.find("moe.dropped"); it != ctx.values.end())
    stats.dropped = std::any_cast<int64_t>(it->second);

  // Dispatch order: by destination rank, then expert, then token and slot.
  std::vector<std::vector<int64_t>> by_expert(E);
  for (int64_t a = 0; a < n * K; ++a)
    if (S.kept[a]) by_expert[S.sel[a]].push_back(a);
  S.send_rows.assign(ep, 0);
  std::vector<double> send;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t a : by_expert[e]) {
      S.order.push_back(a);
      S.send_rows[e / El] += 1;
      const int64_t t = a / K;
      send.insert(send.end(), S.x.begin() + t * D, S.x.begin() + (t + 1) * D);
      send.push_back(static_cast<double>(e % El));
    }
  const int64_t sent = static_cast<int64_t>(S.order.size());
  // The rows travel in the experts' dtype: x (and the local expert index, exact below 2^24) and
  // every exchanged gradient are rounded to it at the experts anyway.
  const DType cdt = expert_dtype(*w1_);
  std::vector<double> recv_x;  // [m, D + 1]: rows at the experts, last column the local expert
  if (ep > 1) {
    // Member p of my EP group (my coordinates with the EP one set to p; the same tp coordinate)
    // sends me the rows it kept for my local experts. Its statistics row is at its offset in the
    // gathered [R, W].
    const int src = source_dim(*ep_dim_);
    const int64_t me = ecomms.coord()[*ep_dim_];
    S.recv_rows.assign(ep, 0);
    for (int64_t p = 0; p < ep; ++p) {
      Dims c = x.comms()->coord();
      c[src] = c[src] / ep * ep + p;  // carved: the source dim unflattens row-major to (dp, ep)
      const int64_t r = dtensor::compute_layout(Dims{R, W}, mesh.shape(), gp, c).global_offset[0];
      for (int64_t e = me * El; e < (me + 1) * El; ++e)
        S.recv_rows[p] += kept_rows(rows[r * W + e], rows[r * W + 2 * E]);
    }
    if (S.recv_rows[me] != S.send_rows[me])
      throw kernels::InternalError(fmt::format("MoE: {} rows kept for my own experts, the statistics say {}",
                                               S.send_rows[me], S.recv_rows[me]));
    recv_x = dtensor::exchange_rows_known(ecomms, *ep_dim_, make(send, {sent, D + 1}, cdt, x.to_local().device()),
                                          S.send_rows, S.recv_rows, "moe dispatch")
                 .wait()
                 .to_vector();
  } else {
    S.recv_rows = S.send_rows;
    recv_x = std::move(send);
  }

  // The experts, on the rows they received: grouped by local expert (a counting sort), one GEMM
  // per expert and projection (kernels::matmul, in expert_dtype).
  const int64_t m = static_cast<int64_t>(recv_x.size()) / (D + 1);
  S.off.assign(El + 1, 0);
  for (int64_t i = 0; i < m; ++i) ++S.off[static_cast<int64_t>(recv_x[i * (D + 1) + D]) + 1];
  for (int64_t e = 0; e < El; ++e) S.off[e + 1] += S.off[e];
  S.perm.assign(m, 0);
  {
    std::vector<int64_t> next(S.off.begin(), S.off.end() - 1);
    for (int64_t i = 0; i < m; ++i) S.perm[next[static_cast<int64_t>(recv_x[i * (D + 1) + D])]++] = i;
  }
  S.xg = gather_rows(recv_x.data(), D, D + 1, S.perm, cdt);
  S.hg = Tensor::empty({m, Hl}, cdt);
  const Tensor W1 = local_as(w1_->data(), cdt), W2 = local_as(w2_->data(), cdt);  // [El, D, Hl], [El, Hl, D]
  const kernels::MatmulOptions mm{.num_threads = ctx.ops().num_threads};
  Tensor yg = Tensor::empty({m, D}, cdt);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t c = S.off[e + 1] - S.off[e];
    if (c == 0) continue;
    const Tensor he = S.hg.narrow(0, S.off[e], c);
    kernels::matmul_out(he, S.xg.narrow(0, S.off[e], c), W1.select(0, e), mm);
    kernels::matmul_out(yg.narrow(0, S.off[e], c), kernels::gelu(he, config_.gelu), W2.select(0, e), mm);
  }
  std::vector<double> out_rows = scatter_rows(yg, S.perm);
  if (ep > 1) {
    S.y = dtensor::exchange_rows_known(ecomms, *ep_dim_, make(out_rows, {m, D}, cdt, x.to_local().device()),
                                       S.recv_rows, S.send_rows, "moe combine")
              .wait()
              .to_vector();
  } else {
    S.y = std::move(out_rows);
  }

  // Combine.
  std::vector<double> out(n * D, 0.0);
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a_ = S.order[i], t = a_ / K;
    for (int64_t d = 0; d < D; ++d) out[t * D + d] += S.g[a_] * S.y[i * D + d];
  }
  // Under tensor parallelism each rank summed its slice of the hidden dim: Partial there.
  DTensor y(x.comms(), partial_on_tp(x), make(out, x.to_local().shape(), x.dtype(), x.to_local().device()));
  if (shared_) y = ops::add(y, shared_->forward(ctx.child("shared"), x), 1.0, ctx.ops());
  ctx.values[kStatsKey] = stats;
  ctx.values[kSavedKey] = sv;
  return y;
}

std::optional<DTensor> MoE::do_backward(Ctx& ctx, const DTensor& dy) {
  auto it = ctx.values.find(kSavedKey);
  if (it == ctx.values.end()) throw InvalidArgument("MoE: backward without a forward on this context");
  const Saved& S = *std::any_cast<std::shared_ptr<Saved>>(it->second);
  const int64_t D = config_.dim, H = config_.hidden, E = config_.experts, K = config_.top_k, n = S.n;
  const DTensor& x = *S.x_like;
  const dtensor::DeviceMesh& mesh = *x.spec().mesh;
  const MeshComms& ecomms = ep_source_dim_ ? *w1_->comms() : *x.comms();  // the experts' mesh
  const int64_t ep = ep_dim_ ? ecomms.mesh().shape()[*ep_dim_] : 1;
  const int64_t tp = tp_dim_ ? mesh.shape()[*tp_dim_] : 1;
  const int64_t Hl = H / tp;
  const std::vector<double> dY = local_values(dy.placements() == x.placements() ? dy : dy.redistribute(x.placements(), {ctx.ops().choose.planner}));
  if (static_cast<int64_t>(dY.size()) != n * D)
    throw InvalidArgument(fmt::format("MoE: output gradient of shape {} for an input of shape {}", dy.shape(),
                                      x.shape()));
  const std::vector<double> wr = local_values(router_->data());

  // Output gradients to the experts; the weights' gradients.
  const DType cdt = expert_dtype(*w1_);
  const int64_t sent = static_cast<int64_t>(S.order.size());
  std::vector<double> dg(n * K, 0.0), dsend(sent * D);
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a = S.order[i], t = a / K;
    double acc = 0;
    for (int64_t d = 0; d < D; ++d) {
      acc += dY[t * D + d] * S.y[i * D + d];
      dsend[i * D + d] = S.g[a] * dY[t * D + d];
    }
    dg[a] = acc;
  }
  const auto m = static_cast<int64_t>(S.perm.size());
  std::vector<double> drecv =
      ep > 1 ? dtensor::exchange_rows_known(ecomms, *ep_dim_, make(dsend, {sent, D}, cdt, x.to_local().device()),
                                            S.send_rows, S.recv_rows, "moe combine backward")
                   .wait()
                   .to_vector()
             : std::move(dsend);
  const int64_t El = E / ep;
  // Per local expert e (rows X, pre-activations Hp, output gradients G):
  //   dW2 = gelu(Hp)^T G,  dHp = (G W2^T) * gelu'(Hp),  dW1 = X^T dHp,  dX = dHp W1^T.
  const Tensor W1 = local_as(w1_->data(), cdt), W2 = local_as(w2_->data(), cdt);
  const kernels::MatmulOptions mm{.num_threads = ctx.ops().num_threads};
  const Tensor gg = gather_rows(drecv.data(), D, D, S.perm, cdt);
  Tensor dw1 = Tensor::zeros({El, D, Hl}, cdt), dw2 = Tensor::zeros({El, Hl, D}, cdt);
  Tensor dxg = Tensor::empty({m, D}, cdt);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t c = S.off[e + 1] - S.off[e];
    if (c == 0) continue;
    const Tensor he = S.hg.narrow(0, S.off[e], c), ge = gg.narrow(0, S.off[e], c);
    kernels::matmul_out(dw2.select(0, e), kernels::gelu(he, config_.gelu).transpose(0, 1), ge, mm);
    const Tensor dh = kernels::gelu_backward(kernels::matmul(ge, W2.select(0, e).transpose(0, 1), mm), he, config_.gelu);
    kernels::matmul_out(dw1.select(0, e), S.xg.narrow(0, S.off[e], c).transpose(0, 1), dh, mm);
    kernels::matmul_out(dxg.narrow(0, S.off[e], c), dh, W1.select(0, e).transpose(0, 1), mm);
  }
  std::vector<double> dxr = scatter_rows(dxg, S.perm);
  std::vector<double> dxback =
      ep > 1 ? dtensor::exchange_rows_known(ecomms, *ep_dim_, make(dxr, {m, D}, cdt, x.to_local().device()),
                                            S.recv_rows, S.send_rows, "moe dispatch backward")
                   .wait()
                   .to_vector()
             : std::move(dxr);
  std::vector<double> dx(n * D, 0.0);
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t t = S.order[i] / K;
    for (int64_t d = 0; d < D; ++d) dx[t * D + d] += dxback[i * D + d];
  }

  // Router: weights -> scores (+ the aux loss) -> logits -> router weight and input. Under
  // tensor parallelism dg is this rank's partial sum (S.y is): the aux term goes in once.
  std::vector<double> dwr(E * D, 0.0), ds(E), dl(E);
  const bool aux_here = tp == 1 || x.comms()->dim(*tp_dim_).rank() == 0;
  const double aux_scale = S.n_global > 0 && aux_here ? aux_grad_scale_ * config_.aux_loss_coef *
                                                             static_cast<double>(E) / static_cast<double>(S.n_global)
                                                       : 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const double* s = &S.s[t * E];
    for (int64_t e = 0; e < E; ++e) ds[e] = aux_scale * S.f[e];
    if (config_.renormalize) {
      double sum = 0, gdg = 0;
      for (int64_t j = 0; j < K; ++j) {
        sum += s[S.sel[t * K + j]];
        gdg += S.g[t * K + j] * dg[t * K + j];
      }
      for (int64_t j = 0; j < K; ++j) ds[S.sel[t * K + j]] += (dg[t * K + j] - gdg) / sum;
    } else {
      for (int64_t j = 0; j < K; ++j) ds[S.sel[t * K + j]] += dg[t * K + j];
    }
    if (config_.score == RouterScore::kSoftmax) {
      double sds = 0;
      for (int64_t e = 0; e < E; ++e) sds += s[e] * ds[e];
      for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (ds[e] - sds);
    } else {
      for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (1.0 - s[e]);
    }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) {
        dwr[e * D + d] += dl[e] * S.x[t * D + d];
        dx[t * D + d] += dl[e] * wr[e * D + d];
      }
  }

  // Parameter gradients: Partial(sum) over the token-splitting dims, S(0) on the EP dim; on the
  // TP dim the experts' slices (their own placements) and the router's partial sums.
  auto grad_placements = [&](const Parameter& p, bool expert) {
    Placements pl(mesh.ndim(), Replicate{});
    for (int md = 0; md < mesh.ndim(); ++md)
      if (dtensor::is_shard(x.placements()[md]) && mesh.shape()[md] > 1) pl[md] = Partial{};
    if (expert && ep_dim_) pl[*ep_dim_] = Shard{0};
    if (tp > 1) pl[*tp_dim_] = expert ? p.placements()[*tp_dim_] : dtensor::Placement{Partial{}};
    return pl;
  };
  auto sink = [&](Parameter& p, Tensor g, bool expert) {
    if (!p.requires_grad) return;
    const kernels::Device device = p.data().to_local().device();
    if (!device.is_cpu()) g = g.to(device);
    if (expert && ep_source_dim_) {  // carved EP: the experts' mesh, Partial where its source dim splits tokens
      const dtensor::DeviceMesh& em = ecomms.mesh();
      Placements pl(em.ndim(), Replicate{});
      for (int j = 0; j < em.ndim(); ++j)
        if (dtensor::is_shard(x.placements()[source_dim(j)]) && em.shape()[j] > 1) pl[j] = Partial{};
      pl[*ep_dim_] = Shard{0};
      DTensor gd(p.comms(), dtensor::make_spec(std::shared_ptr<const dtensor::DeviceMesh>(p.comms(), &em), pl,
                                               p.shape(), g.dtype()),
                 g);
      ops::sink_grad(p.grad_sink(), gd, ctx.ops());
      return;
    }
    DTensor gd(x.comms(), dtensor::make_spec(x.spec().mesh, grad_placements(p, expert), p.shape(), g.dtype()), g);
    ops::sink_grad(p.grad_sink(), gd, ctx.ops());
  };
  sink(*router_, Tensor::from_vector(dwr, router_->shape(), DType::kF64), false);
  sink(*w1_, dw1, true);
  sink(*w2_, dw2, true);

  DTensor out(x.comms(), partial_on_tp(x), make(dx, x.to_local().shape(), x.dtype(), x.to_local().device()));
  if (shared_) out = ops::add(out, *shared_->backward(ctx.child("shared"), dy), 1.0, ctx.ops());
  return out;
}

std::optional<MoEStats> moe_stats(const Ctx& ctx) {
  auto it = ctx.values.find(kStatsKey);
  if (it == ctx.values.end()) return std::nullopt;
  return std::any_cast<MoEStats>(it->second);
}

namespace {
void walk(const Ctx& ctx, double& aux, double& imbalance) {
  if (auto s = moe_stats(ctx)) {
    aux += s->aux_loss;
    imbalance = std::max(imbalance, s->imbalance);
  }
  ctx.for_each_child([&](const std::string&, const Ctx& c) { walk(c, aux, imbalance); });
}
}  // namespace

double moe_aux_loss(const Ctx& ctx) {
  double aux = 0, imb = 0;
  walk(ctx, aux, imb);
  return aux;
}

double moe_max_imbalance(const Ctx& ctx) {
  double aux = 0, imb = 0;
  walk(ctx, aux, imb);
  return imb;
}

}  // namespace nn
