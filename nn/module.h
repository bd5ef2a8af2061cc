// Module: named parameters and children with fully qualified names, an explicit forward and
// backward, and four hook points (pre/post forward, pre/post backward).
//
//   Ctx ctx(&op_options);                     // what this call saves lives here
//   DTensor logits = model.forward(ctx, ids);
//   ...                                        // loss and its gradient dlogits
//   model.backward(ctx, dlogits);              // parameter gradients land in Parameter::grad();
//                                              // ctx is released as each module finishes
//   model.named_parameters()[3].first == "blocks.0.attn.wq.weight"
//
// Ctx: a tree of per-call records. A module's forward saves into its own node and asks for
// child nodes for the submodules it calls; its backward reads the same nodes. Nothing of a call
// lives in the module, so several microbatches (one Ctx each) or a recomputation can be in
// flight. Module::backward releases the node when it returns (activations are freed as the
// backward walks down).
//
// Hooks run in registration order, around do_forward / do_backward, as plain calls (the SPMD
// order is static: every rank calls them in the same order):
//   pre_forward(module, ctx, input&)     may replace the input (e.g. redistribute it)
//   post_forward(module, ctx, output&)   may replace the output
//   pre_backward(module, ctx, grad_output&)
//   post_backward(module, ctx, grad_input&)  grad_input is empty when the input needs none (ids)
// FSDP attaches here: all-gather and swap unsharded parameters in pre_forward (Parameter::
// set_data), free them in post_forward, re-gather in pre_backward, reduce-scatter gradients in
// post_backward. ctx.recomputing() tells hooks a forward is an activation-checkpoint recompute.
#pragma once

#include <any>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtensor/ops/ops.h"
#include "nn/parameter.h"
#include "nn/state_dict.h"

namespace nn {

class Ctx {
 public:
  Ctx() = default;
  // options: the DTensor op options every module of this call uses (not owned).
  explicit Ctx(const dtensor::ops::OpOptions* options) : options_(options) {}
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;

  const dtensor::ops::OpOptions& ops() const;
  // The node of a submodule call, created on first use (children share the op options).
  Ctx& child(std::string_view key);
  bool has_child(std::string_view key) const { return children_.count(std::string(key)) > 0; }
  // fn(key, node) for every child node, in key order.
  template <class F>
  void for_each_child(F&& fn) const {
    for (const auto& [key, node] : children_) fn(key, *node);
  }

  // Op records (ops::Saved) in call order: op(i) grows the list as needed.
  dtensor::ops::Saved& op(size_t i);
  // Tensors and values a module keeps for its backward.
  std::vector<DTensor> tensors;
  std::map<std::string, std::any> values;

  bool recomputing() const { return recomputing_; }
  void set_recomputing(bool r);
  // Releases everything saved here and below.
  void clear();
  // True when nothing is saved here or below (the memory tests use it).
  bool empty() const;

 private:
  const dtensor::ops::OpOptions* options_ = nullptr;
  dtensor::ops::OpOptions default_options_;
  bool recomputing_ = false;
  std::deque<dtensor::ops::Saved> ops_;  // deque: op(i) references stay valid as it grows
  std::map<std::string, std::unique_ptr<Ctx>> children_;
};

class Module;
using ForwardPreHook = std::function<void(Module&, Ctx&, DTensor& input)>;
using ForwardHook = std::function<void(Module&, Ctx&, DTensor& output)>;
using BackwardPreHook = std::function<void(Module&, Ctx&, DTensor& grad_output)>;
using BackwardHook = std::function<void(Module&, Ctx&, std::optional<DTensor>& grad_input)>;

class Module {
 public:
  explicit Module(std::string type) : type_(std::move(type)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // "Linear", "TransformerBlock", ...
  const std::string& type() const { return type_; }

  DTensor forward(Ctx& ctx, const DTensor& input);
  // The input's gradient (nullopt when the input has none, e.g. token ids); parameter
  // gradients go to their Parameter. Releases ctx.
  std::optional<DTensor> backward(Ctx& ctx, const DTensor& grad_output);
  // The same, taking grad_output over: a module that reads it only early in its backward (GPT:
  // the logits' gradient, Sequential: its last child's) frees it then, as autograd does.
  //   model.backward(ctx, loss_fn.backward(lctx, seed));   // the logits' gradient dies early
  std::optional<DTensor> backward(Ctx& ctx, DTensor&& grad_output);

  // ---- names ----
  // Every parameter once (the first name of a tied one), in registration order, depth first:
  // "tok_emb.weight", "blocks.0.ln1.weight", ...
  std::vector<std::pair<std::string, std::shared_ptr<Parameter>>> named_parameters() const;
  // This module ("") and every descendant, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules();
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const { return children_; }
  // The parameters registered on this module itself (not its children), tied ones included.
  const std::vector<std::pair<std::string, std::shared_ptr<Parameter>>>& own_parameters() const { return params_; }
  // Throws InvalidArgument naming the path when absent. A transparent wrapper (Checkpoint) and
  // its module share a name: the wrapped module is returned.
  Module& module(std::string_view fqn);
  Parameter& parameter(std::string_view fqn);

  // ---- hooks ----
  int register_forward_pre_hook(ForwardPreHook hook);
  int register_forward_hook(ForwardHook hook);
  int register_backward_pre_hook(BackwardPreHook hook);
  int register_backward_hook(BackwardHook hook);
  // Removes a hook by the id its register call returned (false when unknown).
  bool remove_hook(int id);

  // An opaque slot per key for a layer built on top of nn (FSDP keeps its parameter group under
  // "fsdp": PyTorch's fully_shard.state(module)). nn never reads it.
  std::shared_ptr<void>& extension(const std::string& key) { return extensions_[key]; }
  std::shared_ptr<void> find_extension(const std::string& key) const {
    auto it = extensions_.find(key);
    return it == extensions_.end() ? nullptr : it->second;
  }

  // ---- state dict ----
  // Every parameter's DTensor keyed by its fully qualified name (named_parameters order),
  // sharded as it is; the tensors share the parameters' storage. No communication.
  // REQUIRES: every parameter materialised.
  StateDict state_dict() const;
  // Copies sd's tensors into the parameters (nn::copy_into: local when placements match, else a
  // redistribute). Everything is checked before anything is written: a missing key, an
  // unexpected one (strict), or a shape mismatch throws InvalidArgument naming the key and
  // leaves every parameter unchanged.
  void load_state_dict(const StateDict& sd, bool strict = true);

  // Sets requires_grad on every parameter.
  void requires_grad_(bool requires_grad);
  void zero_grad(bool set_to_none = true);

 protected:
  virtual DTensor do_forward(Ctx& ctx, const DTensor& input) = 0;
  virtual std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) = 0;
  // backward's work on a gradient this call owns (by default do_backward on it): an override
  // may drop it once read.
  virtual std::optional<DTensor> do_backward_owned(Ctx& ctx, DTensor grad_output) {
    return do_backward(ctx, grad_output);
  }

  std::shared_ptr<Parameter> add_parameter(std::string name, std::shared_ptr<Parameter> parameter);
  // Replaces a registered parameter (weight tying).
  void replace_parameter(std::string_view name, std::shared_ptr<Parameter> parameter);
  template <class M>
  std::shared_ptr<M> add_module(std::string name, std::shared_ptr<M> module) {
    add_child(std::move(name), module);
    return module;
  }
  void add_child(std::string name, std::shared_ptr<Module> module);

 private:
  template <class F>
  struct Hooks {
    std::vector<std::pair<int, F>> list;
  };
  std::string type_;
  std::vector<std::pair<std::string, std::shared_ptr<Parameter>>> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  Hooks<ForwardPreHook> pre_forward_;
  Hooks<ForwardHook> post_forward_;
  Hooks<BackwardPreHook> pre_backward_;
  Hooks<BackwardHook> post_backward_;
  int next_hook_id_ = 1;
  std::map<std::string, std::shared_ptr<void>> extensions_;
};

// Children run in order (PyTorch's nn.Sequential; as a plain container, its ModuleList):
// names "0", "1", ...
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  void append(std::shared_ptr<Module> module);
  size_t size() const { return children().size(); }
  Module& operator[](size_t i) const { return *children()[i].second; }

 protected:
  DTensor do_forward(Ctx& ctx, const DTensor& input) override;
  std::optional<DTensor> do_backward(Ctx& ctx, const DTensor& grad_output) override;
  std::optional<DTensor> do_backward_owned(Ctx& ctx, DTensor grad_output) override;
};

// Allocates every meta parameter of `module` (its shard under the parameter's placements) with
// values init(seed, fully qualified name, global index). Already materialised parameters are
// left alone unless `reinit`. The values depend on neither the order nor the mesh: building on
// meta, sharding (parallelize_module, fsdp::fully_shard) and then materialising gives every
// element the value materialising first and sharding after gives it, bit for bit; only each
// rank's shard is ever allocated (FSDP: straight into the group's flat buffer).
void materialize(Module& module, uint64_t seed, bool reinit = false);
// Allocates every meta parameter's shard without values (PyTorch's to_empty), for a loader that
// writes every element next (checkpoint::load_pretrained).
void to_empty(Module& module);

// What the modules' constructors need: the mesh the parameters live on and their dtype.
struct ModuleOptions {
  std::shared_ptr<const MeshComms> comms;
  DType dtype = DType::kF32;
  kernels::Device device;  // where parameters are materialised
};

}  // namespace nn
