// The replay behind fsdp::estimate_memory (memory_estimate.h): counted buffers allocated and
// freed in the order one steady-state training step allocates and frees them. Each function
// below names the code it follows; a handle (Sim::H) is one allocation, freed when its last
// holder lets go, as the DTensors it stands for are.
#include "fsdp/memory_estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/byte_pack.h"
#include "fsdp/nf4.h"
#include "kernels/allocator.h"
#include "kernels/checked.h"
#include "kernels/error.h"

namespace fsdp {

using kernels::InvalidArgument;

namespace {

enum Kind { kParams, kGrads, kOptim, kUnsharded, kReduce, kActivations, kTransitions, kKinds };

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Live bytes per kind and in total, and the largest total seen (where, too).
class Sim {
 public:
  struct Buf {
    Sim* sim;
    Kind kind;
    int64_t bytes, blocks;
    bool host;
    ~Buf() { sim->release(*this); }
  };
  using H = std::shared_ptr<Buf>;

  explicit Sim(bool host_separate) : host_separate_(host_separate) {}

  // One allocation of `bytes` (none for 0 bytes: an empty Storage allocates nothing).
  H alloc(Kind kind, int64_t bytes) {
    if (bytes <= 0) return nullptr;
    const bool host = host_separate_ && (kind == kParams || kind == kGrads || kind == kOptim);
    const auto blocks = static_cast<int64_t>(kernels::CachingAllocator::rounded_size(static_cast<size_t>(bytes)));
    H b(new Buf{this, kind, bytes, blocks, host});  // constructed once: its destructor releases
    if (host) {
      host_live_ += bytes;
      host_peak_ = std::max(host_peak_, host_live_);
      return b;
    }
    live_[kind] += bytes;
    max_[kind] = std::max(max_[kind], live_[kind]);
    total_ += bytes;
    blocks_ += b->blocks;
    if (total_ > peak_) {
      peak_ = total_;
      peak_at_ = where_;
    }
    peak_blocks_ = std::max(peak_blocks_, blocks_);
    return b;
  }
  // Allocated and freed at once (a redistribute's staging): counts toward the peak only.
  void transient(Kind kind, int64_t bytes) { H h = alloc(kind, bytes); }
  void at(std::string where) { where_ = std::move(where); }

  MemoryEstimate result() const {
    MemoryEstimate e;
    e.sharded_parameters = max_[kParams];
    e.gradients = max_[kGrads];
    e.optimizer_state = max_[kOptim];
    e.unsharded = max_[kUnsharded];
    e.reduce_scatter = max_[kReduce];
    e.activations = max_[kActivations];
    e.transitions = max_[kTransitions];
    e.peak = peak_;
    e.peak_blocks = peak_blocks_;
    e.host = host_peak_;
    e.peak_at = peak_at_;
    return e;
  }

 private:
  void release(const Buf& b) {
    if (b.host) {
      host_live_ -= b.bytes;
      return;
    }
    live_[b.kind] -= b.bytes;
    total_ -= b.bytes;
    blocks_ -= b.blocks;
  }

  bool host_separate_;
  std::array<int64_t, kKinds> live_{}, max_{};
  int64_t total_ = 0, peak_ = 0, blocks_ = 0, peak_blocks_ = 0, host_live_ = 0, host_peak_ = 0;
  std::string where_, peak_at_;
};
using H = Sim::H;

// ---- the model's shapes on the worst rank ----

struct Param {
  std::string name;
  int64_t rows = 0, inner = 1;  // the tensor-parallel local shape, flattened after dim 0
  bool frozen = false;     // no gradient, no optimizer state (LoRA's base)
  bool quantized = false;  // gathered through the all-gather extension
  int64_t numel() const { return rows * inner; }
};

struct Shapes {
  int64_t V, D, heads, L, hidden, max_seq;
  int64_t tp, b, T, Tt;  // tp size, rows per rank, sequence, sequence per tp rank (sequence parallel)
  int64_t Dt, Ht, Hdt, Vt;  // colwise-local widths
  bool sp;               // sequence parallel (tp > 1)
  int64_t s, f;          // compute and statistics itemsizes
  bool layer_norm, bias, pos, tie, ckpt;
  int64_t r = 0;         // LoRA rank (0: none; every parameter but the adapters frozen)
  bool quant = false;    // the blocks' linear weights gathered through an extension
};

std::vector<Param> norm_params(const Shapes& m, const std::string& prefix) {
  const bool frozen = m.r > 0;
  std::vector<Param> out{{prefix + ".weight", m.D, 1, frozen}};
  if (m.layer_norm) out.push_back({prefix + ".bias", m.D, 1, frozen});
  return out;
}

// A block's parameters in registration order (nn/transformer.cpp), tensor-parallel local; with
// LoRA the adapters follow each projection's weight (and bias), as Linear::enable_lora adds them.
std::vector<Param> block_params(const Shapes& m) {
  std::vector<Param> out = norm_params(m, "ln1");
  const bool frozen = m.r > 0;
  auto linear = [&](const std::string& name, int64_t rows, int64_t in) {
    out.push_back({name + ".weight", rows, in, frozen, m.quant});
    if (m.bias) out.push_back({name + ".bias", rows, 1, frozen});
    if (m.r > 0) {
      out.push_back({name + ".lora_A", m.r, in});
      out.push_back({name + ".lora_B", rows, m.r});
    }
  };
  for (const char* n : {"wq", "wk", "wv"}) linear(std::string("attn.") + n, m.Dt, m.D);
  linear("attn.wo", m.D, m.Dt);
  for (const Param& p : norm_params(m, "ln2")) out.push_back(p);
  linear("mlp.fc1", m.Hdt, m.D);
  linear("mlp.fc2", m.D, m.Hdt);
  return out;
}

std::vector<Param> root_params(const Shapes& m) {
  const int64_t vocab_rows = m.tp > 1 ? ceil_div(m.V, m.tp) : m.V;
  const bool frozen = m.r > 0;
  std::vector<Param> out{{"tok_emb.weight", vocab_rows, m.D, frozen}};
  if (m.pos) out.push_back({"pos_emb.weight", m.max_seq, m.D, frozen});
  for (const Param& p : norm_params(m, "ln_f")) out.push_back(p);
  if (!m.tie) out.push_back({"lm_head.weight", m.Vt, m.D, frozen});
  return out;
}

// ---- FSDP's runtime on byte counts (fully_shard.cpp's Group) ----

struct Group {
  std::string name;
  std::vector<Param> params;
  int64_t P = 0, U = 0;  // one rank's flat elements (padded), the unsharded elements
  int64_t G = 0;         // the trainable prefix of P: what gradients and reductions cover
  // With an extension in the group: one rank's packed u8 buffer (fsdp/byte_pack.h) and each
  // quantised weight's code bytes per rank; rank_bytes 0 otherwise.
  int64_t rank_bytes = 0;
  std::vector<int64_t> code_bytes;
  enum class State { kSharded, kUnsharding, kUnsharded, kResharded } state = State::kSharded;
  H flat, unsharded, ag_input, k_buffer;
  H rs_input, rs_output, rs_staging;
  H grad_flat;             // the sharded gradients (from the first reduction of the step on)
  std::vector<H> rs_wire;  // a wire reduction's exchange buffers
  bool pending = false, into_grad = true, has_sharded_grad = false;
  std::vector<H> grads, accum;  // unsharded gradients (per parameter), no-sync accumulation
  std::vector<H> persistent;    // flat shard, flat gradient, optimizer state
  bool root = false;
};

class Replay {
 public:
  Replay(const Shapes& m, const MemoryConfig& c, Sim& sim) : m_(m), c_(c), sim_(sim) {
    const auto& mp = c.options.mp_policy;
    master_ = kernels::DType::kF32;
    param_ = mp.param_dtype.value_or(master_);
    reduce_ = mp.reduce_dtype.value_or(param_);
    if (mp.reduce_wire && *mp.reduce_wire != reduce_ && c.fsdp) {
      wire_ = true;
      ws_ = static_cast<int64_t>(kernels::itemsize(*mp.reduce_wire));
      wire_scaled_ = *mp.reduce_wire == kernels::DType::kF8E4M3 || *mp.reduce_wire == kernels::DType::kF8E5M2;
    }
    ms_ = static_cast<int64_t>(kernels::itemsize(master_));
    ps_ = static_cast<int64_t>(kernels::itemsize(param_));
    rs_ = static_cast<int64_t>(kernels::itemsize(reduce_));
    dp_ = c.dp_shard;
    hsdp_ = c.dp_replicate > 1;
    offload_separate_ = c.options.offload_policy.offload_to_cpu && !c.device.is_cpu();
    const auto kind = c.options.reshard_after_forward.kind;
    k_ = kind == ReshardAfterForward::Kind::kInt ? c.options.reshard_after_forward.k : 0;
    if (k_ == 1) k_ = 0, block_keeps_ = true;
    if (k_ > 0 && k_ == dp_) k_ = 0;
    if (kind == ReshardAfterForward::Kind::kFalse) block_keeps_ = true;
    root_reshards_ = kind == ReshardAfterForward::Kind::kTrue;
  }

  void run() {
    setup();
    for (int micro = 0; micro < c_.batch.grad_accum; ++micro) {
      micro_ = micro;
      last_micro_ = micro + 1 == c_.batch.grad_accum;
      step();
    }
  }

 private:
  // ---- setup: the persistent state ----
  void setup() {
    auto add_group = [&](std::string name, std::vector<Param> params, bool root) {
      Group g;
      g.name = std::move(name);
      g.params = std::move(params);
      g.root = root;
      for (const Param& p : g.params) {
        if (!stored_nf4(p)) g.P += padded(p);
        g.U += p.numel();
        if (!p.frozen) g.G += padded(p);
      }
      // fully_shard packs a group with an extension by bytes, every piece aligned.
      const bool ext =
          c_.fsdp && std::any_of(g.params.begin(), g.params.end(), [](const Param& p) { return p.quantized; });
      if (ext)
        for (const Param& p : g.params) {
          const int64_t bytes = p.quantized ? quant_code_bytes(padded(p)) : padded(p) * ps_;
          g.rank_bytes += ceil_div(bytes, detail::kPieceAlign) * detail::kPieceAlign;
          if (p.quantized) g.code_bytes.push_back(bytes);
        }
      groups_.push_back(std::move(g));
    };
    add_group("root", root_params(m_), true);
    for (int64_t i = 0; i < m_.L; ++i) add_group(fmt::format("blocks.{}", i), block_params(m_), false);
    for (Group& g : groups_) {
      if (c_.fsdp) {
        g.persistent.push_back(sim_.alloc(kParams, g.P * ms_));
        // fsdp::quantize_frozen: each frozen NF4 weight as its codes and double-quantised scales
        // (fsdp/lowp.h's StoredNf4: four allocations), not in the flat buffer.
        for (const Param& p : g.params)
          if (stored_nf4(p)) {
            const int64_t blocks = ceil_div(p.numel(), kNf4Block);
            for (int64_t bytes : {(padded(p) + 1) / 2, blocks, 4 * ceil_div(blocks, kNf4ScalerBlock), int64_t{4}})
              g.persistent.push_back(sim_.alloc(kParams, bytes));
          }
        // The sharded gradients' flat buffer: kept over the steps when offloaded (host memory);
        // otherwise freed by zero_grad and allocated by the group's first reduction of a step.
        if (offload_separate_) g.persistent.push_back(sim_.alloc(kGrads, g.G * ms_));
        for (const Param& p : g.params)
          if (!p.frozen)
            for (int s = 0; s < c_.optimizer_states; ++s) g.persistent.push_back(sim_.alloc(kOptim, padded(p) * ms_));
      } else {
        for (const Param& p : g.params) {
          g.persistent.push_back(sim_.alloc(kParams, p.numel() * ms_));
          if (!p.frozen)
            for (int s = 0; s < c_.optimizer_states; ++s) g.persistent.push_back(sim_.alloc(kOptim, p.numel() * ms_));
        }
      }
    }
    root_ = &groups_[0];
  }

  // A frozen NF4 weight with static scales: fsdp-train stores it as NF4 (fsdp::quantize_frozen).
  bool stored_nf4(const Param& p) const {
    return c_.fsdp && p.quantized && p.frozen && c_.quantized_weights->kind == QuantKind::kNf4 &&
           c_.quantized_weights->static_scales;
  }
  int64_t padded(const Param& p) const { return c_.fsdp ? ceil_div(p.rows, dp_) * p.inner : p.numel(); }
  // Bytes of n codes on the wire (fsdp/lowp.h): one each, nf4 two per byte.
  int64_t quant_code_bytes(int64_t n) const {
    return c_.quantized_weights->kind == QuantKind::kNf4 ? (n + 1) / 2 : n;
  }

  // ---- FSDP group transitions ----
  void issue_unshard(Group& g) {
    if (g.state == Group::State::kUnsharding || g.state == Group::State::kUnsharded) return;
    if (g.rank_bytes > 0) {
      // Extensions: every piece packed by bytes into one u8 buffer per rank, gathered into dp of
      // them (fully_shard.cpp's byte mode; no k buffer with extensions).
      g.flat = sim_.alloc(kUnsharded, dp_ * g.rank_bytes);
      g.ag_input = sim_.alloc(kReduce, g.rank_bytes);
      g.state = Group::State::kUnsharding;
      return;
    }
    g.flat = sim_.alloc(kUnsharded, dp_ * g.P * ps_);
    if (g.state == Group::State::kResharded) {
      // The all-gather from the k slice over the k ranks, into the flat output.
    } else if (param_ != master_ || offload_separate_) {
      g.ag_input = sim_.alloc(kReduce, g.P * ps_);  // the shard cast to param_dtype (or moved to the device)
    }
    g.state = Group::State::kUnsharding;
  }
  void wait_unshard(Group& g) {
    if (g.state == Group::State::kUnsharded) return;
    issue_unshard(g);
    g.ag_input.reset();
    g.k_buffer.reset();
    g.unsharded = sim_.alloc(kUnsharded, g.U * ps_);
    // Extensions' unpacking: each quantised weight's codes of every rank copied together, one
    // weight at a time, then dequantised into its unsharded parameter (host scratch not counted).
    for (int64_t b : g.code_bytes) sim_.transient(kTransitions, dp_ * b);
    g.flat.reset();
    g.state = Group::State::kUnsharded;
  }
  void reshard(Group& g) {
    g.ag_input.reset();
    g.unsharded.reset();
    g.flat.reset();
    g.k_buffer.reset();
    g.state = Group::State::kSharded;
  }
  void reshard_to_k(Group& g) {
    g.flat = sim_.alloc(kUnsharded, dp_ * g.P * ps_);
    H kept = sim_.alloc(kUnsharded, dp_ * g.P / k_ * ps_);
    reshard(g);
    g.k_buffer = kept;
    g.state = Group::State::kResharded;
  }
  void prefetch(const std::vector<Group*>& targets) {
    for (Group* t : targets)
      if (t->state == Group::State::kSharded || t->state == Group::State::kResharded) issue_unshard(*t);
  }
  // The groups a group prefetches (fsdp-train's settings; the order of a finished forward).
  std::vector<Group*> targets(size_t i, bool forward) {
    std::vector<Group*> out;
    const auto n = static_cast<ptrdiff_t>(groups_.size());
    const auto pos = static_cast<ptrdiff_t>(i);
    if (c_.prefetch == 2 && i > 0) {  // explicit lists on the blocks: two blocks ahead
      for (ptrdiff_t j = 1; j <= 2; ++j) {
        const ptrdiff_t q = forward ? pos + j : pos - j;
        if (q >= 1 && q < n) out.push_back(&groups_[static_cast<size_t>(q)]);
      }
      return out;
    }
    if (c_.prefetch >= 1) {
      const ptrdiff_t q = forward ? pos + 1 : pos - 1;
      if (q >= 0 && q < n) out.push_back(&groups_[static_cast<size_t>(q)]);
    }
    return out;
  }
  bool reshards_after_forward(const Group& g) const {
    if (g.root) return root_reshards_;
    return !block_keeps_;
  }

  void pre_forward(size_t i) {
    if (!c_.fsdp || !hooks_) return;
    Group& g = groups_[i];
    sim_.at("forward: " + g.name + " unshard");
    wait_unshard(g);
    prefetch(targets(i, true));
  }
  void post_forward(size_t i) {
    if (!c_.fsdp || !hooks_) return;
    Group& g = groups_[i];
    if (!reshards_after_forward(g)) return;
    if (k_ > 0 && !g.root) reshard_to_k(g);
    else reshard(g);
  }
  void pre_backward(size_t i) {
    if (!c_.fsdp || !hooks_) return;
    Group& g = groups_[i];
    sim_.at("backward: " + g.name + " unshard");
    g.has_sharded_grad = micro_ > 0 && !c_.no_sync;
    wait_unshard(g);
    prefetch(targets(i, false));
  }
  // The unsharded gradient of one parameter, written by its op in backward.
  void grad_of(size_t i, const Param& p) {
    if (p.frozen) return;
    Group& g = groups_[i];
    if (c_.fsdp) g.grads.push_back(sim_.alloc(kUnsharded, p.numel() * ps_));
    else if (micro_ == 0) g.persistent.push_back(sim_.alloc(kGrads, p.numel() * ms_));
  }
  void allocate_grad_flat(Group& g) {
    if (!g.grad_flat && !offload_separate_) g.grad_flat = sim_.alloc(kGrads, g.G * ms_);
  }
  void finish_reduce(Group& g) {
    if (!g.pending) return;
    g.pending = false;
    allocate_grad_flat(g);
    g.rs_input.reset();
    g.rs_output.reset();
    g.rs_staging.reset();
    g.rs_wire.clear();
    g.has_sharded_grad = true;
  }
  void finish_pending() {
    for (Group* p : pending_) finish_reduce(*p);
    pending_.clear();
  }
  void post_backward(size_t i) {
    Group& g = groups_[i];
    if (!c_.fsdp || !hooks_) return;
    sim_.at("backward: " + g.name + " reduce-scatter");
    const bool sync = !c_.no_sync || last_micro_;
    if (!sync) {
      // No sync: the unsharded gradients accumulate in the reduce dtype.
      if (g.accum.empty())
        for (const Param& p : g.params)
          if (!p.frozen) g.accum.push_back(sim_.alloc(kUnsharded, p.numel() * rs_));
      g.grads.clear();
      reshard(g);
      return;
    }
    finish_pending();
    // The accumulated gradients take the new ones in (added in place) and replace them.
    if (!g.accum.empty()) g.grads.clear();
    if (g.G == 0) {  // every parameter frozen: no reduction
      g.grads.clear();
      g.accum.clear();
      reshard(g);
      return;
    }
    reshard(g);  // before the copy-in (FSDP2's order)
    g.rs_input = sim_.alloc(kReduce, dp_ * g.G * rs_);
    g.grads.clear();
    g.accum.clear();
    g.into_grad = !g.has_sharded_grad;
    if (!g.into_grad) g.rs_output = sim_.alloc(kReduce, g.G * rs_);
    else allocate_grad_flat(g);
    reduce_transition(g);
    g.pending = true;
    pending_.push_back(&g);
  }
  void finalize_backward() {
    if (!c_.fsdp) return;
    finish_pending();
    for (Group& g : groups_)
      if (g.state != Group::State::kSharded) reshard(g);
  }
  // The buffers inside the gradient reduction (the executor's, dtensor/exec), alive until the
  // reduction is waited for: none on top of FSDP's input and output for a flat reduce-scatter
  // (the input is in the reduce dtype already); HSDP's all-reduce of the shard over the
  // replicate dim runs in place on FSDP's output (dtensor/exec/memory_check.h).
  // A wire dtype narrower than the reduce dtype makes the reduce-scatter an exchange
  // (dtensor/exec/issuer.cpp's wire_reduce_scatter): the input packed into the wire (staged in
  // the reduce dtype first for an fp8 wire's scale), the dp - 1 pieces received, the sum; for
  // fp8 one f32 scale slot per member.
  void reduce_transition(Group& g) {
    if (wire_) {
      const int64_t total = dp_ * g.G;
      g.rs_staging = sim_.alloc(kTransitions, total * ws_);
      if (wire_scaled_) g.rs_wire.push_back(sim_.alloc(kTransitions, total * rs_));
      if (wire_scaled_)
        for (int64_t i = 0; i < dp_; ++i) g.rs_wire.push_back(sim_.alloc(kTransitions, 4));
      for (int64_t i = 1; i < dp_; ++i) g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * ws_));
      g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * rs_));
      if (!hsdp_) return;
      // HSDP: the reduce-scatter's result, then the all-reduce over the replicate dim through the
      // wire (wire_all_reduce): the shard packed and gathered, the pieces received and the sum of
      // this member's chunk.
      const int64_t kr = c_.dp_replicate, chunk = ceil_div(g.G, kr);
      g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * rs_));
      g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * ws_));
      g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * ws_));
      if (wire_scaled_) {
        g.rs_wire.push_back(sim_.alloc(kTransitions, g.G * rs_));
        for (int64_t i = 0; i < 2 * kr; ++i) g.rs_wire.push_back(sim_.alloc(kTransitions, 4));
      }
      for (int64_t i = 1; i < kr; ++i) g.rs_wire.push_back(sim_.alloc(kTransitions, chunk * ws_));
      g.rs_wire.push_back(sim_.alloc(kTransitions, chunk * rs_));
      return;
    }
  }

  // ---- tensor parallelism's redistributes on the activations ----
  // S(1) -> R over tp of a [b, T, width] tensor: the gathered tensor (the executor gathers
  // straight into it).
  H gather_seq(int64_t width) { return sim_.alloc(kActivations, m_.b * m_.T * width * m_.s); }
  // P -> S(1) over tp: the reduced sequence shard; meanwhile the executor holds the input packed
  // chunk by chunk (dim 1 is not contiguous) and the reduced chunk before it is copied out.
  H scatter_seq(int64_t width) {
    H out = sim_.alloc(kActivations, m_.b * m_.Tt * width * m_.s);
    sim_.transient(kTransitions, m_.b * m_.T * width * m_.s + m_.b * m_.Tt * width * m_.s);
    return out;
  }
  // P -> R over tp (no sequence parallelism): a reduced copy.
  H reduce_full(int64_t width) { return sim_.alloc(kActivations, m_.b * m_.T * width * m_.s); }

  H act(int64_t elements) { return sim_.alloc(kActivations, elements * m_.s); }
  H stat(int64_t elements) { return sim_.alloc(kActivations, elements * m_.f); }

  // ---- one block (TransformerBlock: forward and backward) ----
  struct BlockSaved {
    H x;                 // the input (ln1 keeps it)
    H l1s, l1m;          // ln1's statistics
    H l1g;               // wq / wk / wv's input: ln1's output (gathered over tp)
    H q, k, v, o, lse;   // attention's inputs, output and log-sum-exp
    H a;                 // the attention's output (do_forward's local: the add keeps only shapes)
    H h, l2s, l2m, l2g;  // after the first residual; ln2's statistics; fc1's input
    H f1, g, f2;         // mlp: fc1's output (gelu keeps it), gelu's (fc2 keeps it), fc2's (a local)
    std::vector<H> lora; // each LoRA projection's h = x A^T and l = h B^T
  };

  // LoRA on a projection of `out` features (nn/layers.cpp's Linear): h = x A^T (kept for
  // backward), l = h B^T (a local: the add keeps only its shape), then y + s l as a new tensor
  // (the caller drops the base y).
  H lora_forward(H y, int64_t out, BlockSaved& s) {
    if (m_.r == 0) return y;
    const int64_t n = m_.b * m_.T;
    s.lora.push_back(act(n * m_.r));
    H l = act(n * out);
    return act(n * out);
  }
  // Its backward before the base's: dl = s dy, dh (lora_B's gradient), dx_lora (lora_A's),
  // returned: alive until the base's input gradient is summed with it (lora_input_grad).
  H lora_backward(const std::function<void(const std::string&)>& grad, const std::string& name, int64_t in,
                  int64_t out) {
    if (m_.r == 0) return nullptr;
    const int64_t n = m_.b * m_.T;
    H dl = act(n * out);
    H dh = act(n * m_.r);
    grad(name + ".lora_B");
    dl.reset();
    H dx = act(n * in);
    grad(name + ".lora_A");
    return dx;
  }
  H lora_input_grad(H dx, H& dx_lora, int64_t in) {
    if (!dx_lora) return dx;
    H sum = act(m_.b * m_.T * in);
    dx_lora.reset();
    return sum;
  }

  // A row-wise layer's output over tp: the partial sum, reduced (P -> S(1) or P -> R); no tp:
  // the output itself.
  H rowwise_output(int64_t width) {
    if (m_.tp == 1) return act(m_.b * m_.T * width);
    H partial = act(m_.b * m_.T * width);
    return m_.sp ? scatter_seq(width) : reduce_full(width);
  }
  // The input gradient of a column-wise layer (a partial sum over tp) moved back to the input's
  // placement: P -> S(1) (sequence parallel) or P -> R.
  H colwise_input_grad(H partial, int64_t width) {
    if (m_.tp == 1) return partial;
    return m_.sp ? scatter_seq(width) : reduce_full(width);
  }

  H block_forward(size_t gi, H x, BlockSaved& s) {
    pre_forward(gi);
    sim_.at("forward: " + groups_[gi].name);
    const int64_t nt = m_.b * m_.Tt;  // tokens of a sequence-sharded tensor
    const int64_t n = m_.b * m_.T;
    s.x = x;
    {
      H l1 = act(nt * m_.D);  // alive until the attention returns (a temporary of the statement)
      s.l1s = stat(nt);
      if (m_.layer_norm) s.l1m = stat(nt);
      s.l1g = m_.sp ? gather_seq(m_.D) : l1;
      s.q = lora_forward(act(n * m_.Dt), m_.Dt, s);
      s.k = lora_forward(act(n * m_.Dt), m_.Dt, s);
      s.v = lora_forward(act(n * m_.Dt), m_.Dt, s);
      s.o = act(n * m_.Dt);
      s.lse = stat(n * m_.Ht);
      s.a = lora_forward(rowwise_output(m_.D), m_.D, s);  // wo: the merged heads are a host copy (not counted)
    }
    s.h = act(nt * m_.D);
    {
      H l2 = act(nt * m_.D);
      s.l2s = stat(nt);
      if (m_.layer_norm) s.l2m = stat(nt);
      s.l2g = m_.sp ? gather_seq(m_.D) : l2;
      s.f1 = lora_forward(act(n * m_.Hdt), m_.Hdt, s);
      s.g = act(n * m_.Hdt);
      s.f2 = lora_forward(rowwise_output(m_.D), m_.D, s);
    }
    H y = act(nt * m_.D);
    s.a.reset();  // do_forward's locals: the residual adds keep only shapes
    s.f2.reset();
    post_forward(gi);
    return y;
  }

  // Returns the input's gradient (the caller keeps the incoming one alive until then).
  // incoming: the gradient the block took over (dies before its post-backward); null inside a
  // Checkpoint wrapper (the wrapper's post-backward comes after).
  H block_backward(size_t gi, BlockSaved& s, H* incoming = nullptr) {
    pre_backward(gi);
    sim_.at("backward: " + groups_[gi].name);
    const int64_t nt = m_.b * m_.Tt;
    const int64_t n = m_.b * m_.T;
    const auto params = block_params(m_);
    const std::function<void(const std::string&)> grad = [&](const std::string& name) {
      for (const Param& p : params)
        if (p.name == name) grad_of(gi, p);
    };
    H dh;
    {
      // mlp: fc2 (its gradient gathered over tp first), gelu, fc1.
      H dl2;
      {
        H dyg = m_.sp ? gather_seq(m_.D) : nullptr;
        H lx = lora_backward(grad, "mlp.fc2", m_.Hdt, m_.D);
        H dg = act(n * m_.Hdt);
        grad("mlp.fc2.weight");
        if (m_.bias) grad("mlp.fc2.bias");
        dg = lora_input_grad(dg, lx, m_.Hdt);
        dyg.reset();
        s.g.reset();
        H df1 = act(n * m_.Hdt);
        dg.reset();
        s.f1.reset();  // MLP::do_backward drops gelu's input once gelu's backward ran
        lx = lora_backward(grad, "mlp.fc1", m_.D, m_.Hdt);
        dl2 = act(n * m_.D);
        grad("mlp.fc1.weight");
        if (m_.bias) grad("mlp.fc1.bias");
        dl2 = lora_input_grad(dl2, lx, m_.D);
        s.l2g.reset();
      }
      dl2 = colwise_input_grad(dl2, m_.D);
      s.f1.reset();
      dh = act(nt * m_.D);  // ln2
      grad("ln2.weight");
      if (m_.layer_norm) grad("ln2.bias");
      s.h.reset();
      s.l2s.reset();
      s.l2m.reset();
    }
    dh = act(nt * m_.D);  // the residual's two gradients summed
    H dx;
    {
      H dattn;
      {
        // attention: wo (its gradient gathered over tp), attention, wq / wk / wv summed.
        H dyg = m_.sp ? gather_seq(m_.D) : nullptr;
        H lx = lora_backward(grad, "attn.wo", m_.Dt, m_.D);
        H dm = act(n * m_.Dt);
        grad("attn.wo.weight");
        if (m_.bias) grad("attn.wo.bias");
        dm = lora_input_grad(dm, lx, m_.Dt);
        dyg.reset();
        H dq = act(n * m_.Dt), dk = act(n * m_.Dt), dv = act(n * m_.Dt);
        // CausalSelfAttention::do_backward drops wo's input gradient and the attention's saved
        // tensors here, each head gradient after its projection's backward.
        dm.reset();
        s.q.reset();
        s.k.reset();
        s.v.reset();
        s.o.reset();
        s.lse.reset();
        lx = lora_backward(grad, "attn.wq", m_.D, m_.Dt);
        H acc = act(n * m_.D);
        grad("attn.wq.weight");
        if (m_.bias) grad("attn.wq.bias");
        acc = lora_input_grad(acc, lx, m_.D);
        dq.reset();
        for (const char* w : {"attn.wk", "attn.wv"}) {
          lx = lora_backward(grad, w, m_.D, m_.Dt);
          H part = act(n * m_.D);
          grad(std::string(w) + ".weight");
          if (m_.bias) grad(std::string(w) + ".bias");
          part = lora_input_grad(part, lx, m_.D);
          if (std::string(w) == "attn.wv") s.l1g.reset();  // wv kept the last reference to its input
          acc = act(n * m_.D);
          if (std::string(w) == "attn.wk") dk.reset();
        }
        dattn = acc;
      }
      dattn = colwise_input_grad(dattn, m_.D);
      s.q.reset();
      s.k.reset();
      s.v.reset();
      s.o.reset();
      s.lse.reset();
      s.l1g.reset();
      dx = act(nt * m_.D);  // ln1
      grad("ln1.weight");
      if (m_.layer_norm) grad("ln1.bias");
      s.x.reset();
      s.l1s.reset();
      s.l1m.reset();
    }
    H out = act(nt * m_.D);  // the residual's two gradients summed
    dx.reset();
    dh.reset();
    if (incoming) incoming->reset();
    post_backward(gi);
    s.a.reset();
    s.f2.reset();
    s.lora.clear();
    return out;
  }

  // ---- one microbatch of the GPT (GPT::do_forward / do_backward, the loss) ----
  void step() {
    const int64_t nt = m_.b * m_.Tt;
    const int64_t n = m_.b * m_.T;
    const auto rparams = root_params(m_);
    auto root_grad = [&](const std::string& name) {
      for (const Param& p : rparams)
        if (p.name == name) grad_of(0, p);
    };
    // Forward.
    pre_forward(0);
    sim_.at("forward: root");
    H x;
    H pos_out;
    {
      H emb = rowwise_output(m_.D);  // tok_emb (row-wise over tp: a partial sum, reduced)
      if (m_.pos) {
        pos_out = act(m_.Tt * m_.D);  // do_forward's local (the add keeps only shapes)
        x = act(nt * m_.D);
      } else {
        x = emb;
      }
    }
    std::vector<BlockSaved> saved(static_cast<size_t>(m_.L));
    std::vector<H> ckpt_inputs(static_cast<size_t>(m_.L));
    for (int64_t i = 0; i < m_.L; ++i) {
      const size_t gi = static_cast<size_t>(i) + 1;
      if (m_.ckpt) {
        // Checkpoint: the block runs on a scratch context freed on return; its input stays.
        pre_forward(gi);
        ckpt_inputs[static_cast<size_t>(i)] = x;
        H y;
        {
          BlockSaved scratch;
          y = block_inner(gi, [&] { return block_forward(gi, x, scratch); });
        }
        post_forward(gi);
        x = y;
      } else {
        x = block_forward(gi, x, saved[static_cast<size_t>(i)]);
      }
    }
    sim_.at("forward: root (head)");
    H last = x;  // ln_f keeps its input
    H lfs = stat(nt), lfm = m_.layer_norm ? stat(nt) : nullptr;
    H lfg;  // lm_head's input (gathered over tp)
    H logits;
    {
      H lf = act(nt * m_.D);  // GPT::do_forward's local until it returns
      lfg = m_.sp ? gather_seq(m_.D) : lf;
      x.reset();
      logits = act(n * m_.Vt);
    }
    pos_out.reset();
    post_forward(0);
    // The loss keeps the logits' gradient; the logits die with its forward (fsdp-train).
    sim_.at("loss");
    H dlogits = act(n * m_.Vt);
    logits.reset();
    if (c_.batch.grad_accum > 1) dlogits = act(n * m_.Vt);  // scaled by 1 / grad_accum
    // Backward.
    pre_backward(0);
    sim_.at("backward: root (head)");
    H dh;
    {
      H dx = act(n * m_.D);  // lm_head's input gradient (a partial sum over tp)
      root_grad("lm_head.weight");
      lfg.reset();
      dx = colwise_input_grad(dx, m_.D);
      dlogits.reset();  // taken over by GPT::backward: it dies with lm_head's backward
      dh = act(nt * m_.D);  // ln_f
      root_grad("ln_f.weight");
      if (m_.layer_norm) root_grad("ln_f.bias");
      last.reset();
      lfs.reset();
      lfm.reset();
    }
    // Each block takes its incoming gradient over (Module::backward's rvalue form): it dies before
    // the block's post-backward.
    for (int64_t i = m_.L - 1; i >= 0; --i) {
      const size_t gi = static_cast<size_t>(i) + 1;
      if (m_.ckpt) {
        pre_backward(gi);
        H in = ckpt_inputs[static_cast<size_t>(i)];
        ckpt_inputs[static_cast<size_t>(i)].reset();
        H dx;
        {
          BlockSaved s;
          block_inner(gi, [&] { return block_forward(gi, in, s); });  // the recompute (output dropped)
          dx = block_inner(gi, [&] { return block_backward(gi, s); });
        }
        dh.reset();
        post_backward(gi);
        dh = dx;
      } else {
        dh = block_backward(gi, saved[static_cast<size_t>(i)], &dh);
      }
    }
    sim_.at("backward: root (embeddings)");
    if (m_.pos) {
      H dpos = act(m_.Tt * m_.D);
      root_grad("pos_emb.weight");
    }
    {
      H dyg;
      if (m_.tp > 1) dyg = m_.sp ? gather_seq(m_.D) : nullptr;
      root_grad("tok_emb.weight");
    }
    post_backward(0);
    pos_out.reset();
    finalize_backward();
    dh.reset();
    dlogits.reset();
    logits.reset();
  }

  // A block without FSDP hooks (the Checkpoint wrapper carries them).
  H block_inner(size_t, const std::function<H()>& f) {
    const bool hooks = hooks_;
    hooks_ = false;
    H out = f();
    hooks_ = hooks;
    return out;
  }

  Shapes m_;
  MemoryConfig c_;
  Sim& sim_;
  kernels::DType master_, param_, reduce_;
  int64_t ms_ = 4, ps_ = 4, rs_ = 4, ws_ = 4;  // master, param, reduce and wire itemsizes
  bool wire_ = false, wire_scaled_ = false;
  int64_t dp_ = 1;
  int k_ = 0;
  bool hsdp_ = false, offload_separate_ = false, block_keeps_ = false, root_reshards_ = false;
  std::vector<Group> groups_;
  Group* root_ = nullptr;
  std::vector<Group*> pending_;
  int micro_ = 0;
  bool last_micro_ = true;
  bool hooks_ = true;  // false inside a Checkpoint wrapper (its hooks run around it)
};

void check_config(const nn::GPTConfig& g, const MemoryConfig& c) {
  auto bad = [](const std::string& what) { throw InvalidArgument("estimate_memory: " + what); };
  if (c.fsdp && c.options.layout == Layout::kContiguous)
    bad("layout contiguous is not modelled (its gradient buffers live through backward); estimate the padded "
        "layout");
  if (c.dp_replicate < 1 || c.dp_shard < 1 || c.tp < 1)
    bad(fmt::format("mesh sizes dp_replicate {} dp_shard {} tp {}: expected >= 1", c.dp_replicate, c.dp_shard, c.tp));
  if (c.batch.batch < 1 || c.batch.seq < 1 || c.batch.grad_accum < 1 || c.batch.batch % c.batch.grad_accum != 0)
    bad(fmt::format("batch {} seq {} grad_accum {}: expected >= 1 with grad_accum dividing batch", c.batch.batch,
                    c.batch.seq, c.batch.grad_accum));
  if (g.vocab < 1 || g.dim < 1 || g.heads < 1 || g.layers < 0 || g.dim % g.heads != 0)
    bad(fmt::format("model vocab {} dim {} heads {} layers {}: expected positive sizes, heads dividing dim", g.vocab,
                    g.dim, g.heads, g.layers));
  if (g.heads % c.tp != 0)
    bad(fmt::format("{} heads do not split evenly over the {} ranks of tp", g.heads, c.tp));
  if (c.prefetch < 0 || c.prefetch > 2) bad(fmt::format("prefetch {}: expected 0, 1 or 2", c.prefetch));
  if (c.optimizer_states < 0) bad(fmt::format("optimizer_states {}: expected >= 0", c.optimizer_states));
  if (c.lora_rank < 0) bad(fmt::format("lora_rank {}: expected >= 0 (0: no LoRA)", c.lora_rank));
  if (c.lora_rank > 0 && c.tp > 1)
    bad(fmt::format("lora_rank {} with tp {}: LoRA under tensor parallelism is not modelled", c.lora_rank, c.tp));
  if (c.quantized_weights && c.fsdp && c.options.reshard_after_forward.kind == ReshardAfterForward::Kind::kInt &&
      c.options.reshard_after_forward.k != 1 && c.options.reshard_after_forward.k != c.dp_shard)
    bad(fmt::format("quantized_weights with reshard_after_forward = {}: fully_shard refuses extensions with a k buffer",
                    c.options.reshard_after_forward.k));
  if (c.options.reshard_after_forward.kind == ReshardAfterForward::Kind::kInt) {
    const int k = c.options.reshard_after_forward.k;
    if (k < 1 || c.dp_shard % k != 0)
      bad(fmt::format("reshard_after_forward = {}: expected a divisor of dp_shard {}", k, c.dp_shard));
  }
}

}  // namespace

std::string MemoryEstimate::to_json() const {
  return fmt::format(
      "{{\"sharded_parameters\":{},\"gradients\":{},\"optimizer_state\":{},\"unsharded\":{},\"reduce_scatter\":{},"
      "\"activations\":{},\"transitions\":{},\"peak\":{},\"peak_blocks\":{},\"host\":{},\"peak_at\":\"{}\"}}",
      sharded_parameters, gradients, optimizer_state, unsharded, reduce_scatter, activations, transitions, peak,
      peak_blocks, host, peak_at);
}

MemoryEstimate estimate_memory(const nn::GPTConfig& g, const MemoryConfig& c) {
  check_config(g, c);
  Shapes m;
  m.V = g.vocab;
  m.D = g.dim;
  m.heads = g.heads;
  m.L = g.layers;
  m.hidden = g.mlp_hidden > 0 ? g.mlp_hidden : 4 * g.dim;
  m.max_seq = g.max_seq;
  m.tp = c.tp;
  const int64_t micro = c.batch.batch / c.batch.grad_accum;
  m.b = ceil_div(ceil_div(micro, c.dp_replicate), c.fsdp ? c.dp_shard : 1);
  m.T = c.batch.seq;
  m.sp = c.tp > 1 && c.sequence_parallel;
  m.Tt = m.sp ? ceil_div(m.T, c.tp) : m.T;
  m.Dt = ceil_div(m.D, c.tp);
  m.Ht = g.heads / c.tp;
  m.Hdt = ceil_div(m.hidden, c.tp);
  m.Vt = ceil_div(m.V, c.tp);
  const kernels::DType compute = c.options.mp_policy.param_dtype.value_or(kernels::DType::kF32);
  m.s = static_cast<int64_t>(kernels::itemsize(compute));
  m.f = 4;
  m.layer_norm = g.norm == nn::NormKind::kLayerNorm;
  m.bias = g.bias;
  m.pos = g.pos_embedding;
  m.tie = g.tie_embeddings;
  m.ckpt = g.checkpoint_blocks;
  m.r = c.lora_rank;
  m.quant = c.quantized_weights.has_value();
  Sim sim(c.options.offload_policy.offload_to_cpu && !c.device.is_cpu());
  Replay(m, c, sim).run();
  return sim.result();
}

MemoryEstimate estimate_memory(const nn::GPT& model, const MemoryConfig& config) {
  MemoryConfig c = config;
  const auto params = model.named_parameters();
  if (!params.empty()) {
    const dtensor::DeviceMesh& mesh = params.front().second->comms()->mesh();
    c.dp_replicate = c.dp_shard = c.tp = 1;
    if (mesh.has_names())
      for (int d = 0; d < mesh.ndim(); ++d) {
        const std::string& n = mesh.names()[d];
        if (n == "dp_replicate") c.dp_replicate = mesh.size(d);
        else if (n == "dp_shard") c.dp_shard = mesh.size(d);
        else if (n == "tp") c.tp = mesh.size(d);
      }
  }
  return estimate_memory(model.config(), c);
}

}  // namespace fsdp
