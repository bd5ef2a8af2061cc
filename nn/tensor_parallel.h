// Tensor parallelism as PyTorch's parallelize_module: a plan maps module names to styles; each
// style shards the module's parameters over one mesh dim (the tp dim; other mesh dims keep their
// placements) and registers hooks that redistribute the module's input and output there.
//
//   ParallelPlan plan = {
//       {"tok_emb", std::make_shared<RowwiseParallel>(Shard{1})},          // vocab-sharded table
//       {"blocks.*.ln1", std::make_shared<SequenceParallel>()},
//       {"blocks.*.attn", std::make_shared<PrepareModuleInput>(Replicate{})},
//       {"blocks.*.attn.wq", std::make_shared<ColwiseParallel>()},          // heads split over tp
//       {"blocks.*.attn.wo", std::make_shared<RowwiseParallel>(Shard{1})},  // reduce-scatter
//       ...
//       {"lm_head", std::make_shared<ColwiseParallel>(Shard{-1})}};        // loss parallel
//   parallelize_module(model, /*tp_mesh_dim=*/1, plan);   // before or after materialize
//
// Styles (placements on the tp mesh dim):
//   ColwiseParallel(output)    Linear weight S(0), bias S(0); Embedding weight S(1). Input
//                              brought to R; output S(-1), redistributed to `output` if another.
//   RowwiseParallel(output)    Linear weight S(1), bias R: input brought to S(-1), the Partial
//                              product reduced to `output` (R: all-reduce; S(1): reduce-scatter
//                              for sequence parallelism) before the bias; Embedding weight S(0)
//                              (each rank looks up its vocab rows), output reduced likewise.
//   SequenceParallel(dim)      a norm's parameters stay R; its input is brought to S(dim) (the
//                              sequence dim), so the norm runs on a slice of the sequence; the
//                              parameter gradients are Partial (reduce_gradients sums them).
//   MoETensorParallel(output)  an nn::MoE (nn/moe.h): router R, experts' hidden dim split (w1
//                              [E, D, H] S(2), w2 [E, H, D] S(1)), a shared expert fc1 S(0) /
//                              fc2 S(1); input brought to R, the Partial output reduced to
//                              `output` (S(1): reduce-scatter for sequence parallelism, R).
//   PrepareModuleInput(desired)/PrepareModuleOutput(desired): only the redistribution, at a
//                              module boundary (attention / MLP: S(1) -> R once for q, k and v).
// Gradients follow the transposes: a hook that moved the input in forward moves its gradient
// back in backward (e.g. PrepareModuleInput S(1) -> R all-gathers in forward and
// reduce-scatters the Partial gradient in backward). A colwise layer whose input was already R
// keeps its input gradient Partial (summed once at the enclosing boundary, not per layer);
// PrepareModuleInput always returns its input gradient in the input's own placement.
//
// Errors (InvalidArgument): a pattern matching no module, a style on a module type it does not
// support, attention whose heads do not divide over the tp dim (naming both numbers), a tied
// parameter given two different placements.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "nn/transformer.h"

namespace nn {

using dtensor::Placement;

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  virtual std::string name() const = 0;
  // REQUIRES: module's parameters live on a mesh with tp_mesh_dim.
  virtual void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const = 0;
};

class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(Placement output_layout = dtensor::Shard{-1}) : output_(output_layout) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  Placement output_;
};

class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(Placement output_layout = dtensor::Replicate{}) : output_(output_layout) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  Placement output_;
};

class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(int sequence_dim = 1) : dim_(sequence_dim) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  int dim_;
};

class PrepareModuleInput : public ParallelStyle {
 public:
  explicit PrepareModuleInput(Placement desired_input_layout) : desired_(desired_input_layout) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  Placement desired_;
};

class PrepareModuleOutput : public ParallelStyle {
 public:
  explicit PrepareModuleOutput(Placement desired_output_layout) : desired_(desired_output_layout) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  Placement desired_;
};

class MoETensorParallel : public ParallelStyle {
 public:
  explicit MoETensorParallel(Placement output_layout = dtensor::Replicate{}) : output_(output_layout) {}
  std::string name() const override;
  void apply(Module& module, std::string_view fqn, int tp_mesh_dim) const override;

 private:
  Placement output_;
};

using ParallelPlan = std::vector<std::pair<std::string, std::shared_ptr<const ParallelStyle>>>;

// Applies every entry to each module whose FQN matches its pattern ('*' matches one name
// component), in plan order.
void parallelize_module(Module& root, int tp_mesh_dim, const ParallelPlan& plan);

// The Megatron / torchtitan plan for GPT: embeddings rowwise, q/k/v and fc1 colwise, wo and fc2
// rowwise, MoE blocks MoETensorParallel; sequence_parallel: norms on sequence shards (reduce-scatter / all-gather at the block
// boundaries instead of all-reduces); loss_parallel: vocab-sharded logits go to the loss.
ParallelPlan gpt_tensor_parallel_plan(const GPTConfig& config, bool sequence_parallel = true,
                                      bool loss_parallel = true);

// The input- and output-moving hooks the styles use, for custom styles: on mesh dim `mesh_dim`,
// the input is brought to `desired` before forward (and its gradient back in backward; `strict`:
// always to the input's own placement, else only when the forward moved it).
void add_input_redistribute(Module& module, int mesh_dim, Placement desired, bool strict);
void add_output_redistribute(Module& module, int mesh_dim, Placement desired);

}  // namespace nn
