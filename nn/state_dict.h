// StateDict: what a module or an optimizer saves and restores: sharded DTensors keyed by fully
// qualified name, plus non-tensor values (an optimizer's step, a trainer's data position).
//
//   nn::StateDict sd = model.state_dict();          // {"tok_emb.weight": DTensor [S(0)], ...}
//   sd.merge(opt.state_dict(), "optim.");           // "optim.state.tok_emb.weight.exp_avg", ...
//   sd.values["train.step"] = int64_t{100};
//   checkpoint::save(dir, sd, world);               // checkpoint/ (the layer above)
//   ...
//   model.load_state_dict(sd);                      // no communication when placements match
//
// The DTensors of a module's state dict ARE its parameters (same local storage): a loader that
// writes into sd.tensors in place restores the module without a copy. Getting a state dict
// never communicates. A full (unsharded) view is gathered one tensor at a time
// (for_each_full_tensor), so the memory it needs is one tensor, never the whole model.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "dtensor/dtensor.h"

namespace nn {

using StateValue = std::variant<int64_t, double, std::string>;

struct StateDict {
  std::vector<std::pair<std::string, dtensor::DTensor>> tensors;
  std::map<std::string, StateValue> values;

  // The tensor of `key`, or nullptr.
  const dtensor::DTensor* find(std::string_view key) const;
  dtensor::DTensor* find(std::string_view key);
  // Appends other's entries with `prefix` prepended to every key. Throws InvalidArgument for a
  // key that already exists.
  void merge(const StateDict& other, const std::string& prefix = "");
  // The entries whose key starts with `prefix`, with the prefix removed (tensors share storage).
  StateDict sub(const std::string& prefix) const;
  // A value as an integer / a double (an integer value converts; a string does not). Throws
  // InvalidArgument naming the key when absent or of another kind.
  int64_t int_value(const std::string& key) const;
  double double_value(const std::string& key) const;
};

// Calls fn(key, full) for every tensor of `sd`, in order, with the whole (unsharded) tensor on
// the host: gathered over its mesh (collective: every rank of the meshes must call this with
// the same state dict), one tensor at a time, freed before the next. rank0_only: fn runs on the
// mesh's first rank only (the others still take part in the gathers).
void for_each_full_tensor(const StateDict& sd, bool rank0_only,
                          const std::function<void(const std::string&, const kernels::Tensor&)>& fn);

// Copies `src` into `dst` (same global shape): locally when placements and mesh match (no
// communication), else through a redistribute of src to dst's placements (collective over the
// mesh). Any dtypes (cast). Throws InvalidArgument naming `key` for a shape mismatch.
void copy_into(const std::string& key, const dtensor::DTensor& dst, const dtensor::DTensor& src);

}  // namespace nn
