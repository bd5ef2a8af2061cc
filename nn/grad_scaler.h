// GradScaler: PyTorch's dynamic loss scaling for fp16 training (torch.amp.GradScaler), for
// sharded gradients. The loss is multiplied by scale() before backward so small fp16 gradients
// do not flush to zero; before the optimizer step the gradients are checked, unscaled and
// clipped in one pass:
//
//   nn::GradScaler scaler;                                   // scale 2^16
//   backward(loss * scaler.scale());                         // the seed of backward, scaled
//   nn::reduce_gradients(params);                            // (FSDP: its reduce-scatter)
//   const nn::ScaledStep s = scaler.unscale_clip_(params, 1.0);
//   if (s.stepped) opt.step();                               // else every rank skips it
//   opt.zero_grad();
//
// unscale_clip_ (collective over the gradients' mesh):
//  1. found_inf: any NaN or infinity in any gradient element this rank holds (every rank, every
//     replica), made the same on every rank by ONE all-reduce (max) of a flag over every mesh dim
//     (PyTorch issue #132816: a shard's inf must stop every rank's step);
//  2. found: nothing is stepped; the gradients are left as they are; the scale backs off;
//  3. otherwise the global norm of the scaled gradients (clip_grad_norm_'s one reduction) over
//     scale() is the true norm; each gradient is multiplied once by min(1, max_norm / (norm +
//     1e-6)) / scale (max_norm <= 0: no clipping, 1 / scale), which is the unscale and the clip
//     in one pass. A non-finite norm with finite elements (the sum of squares overflowed) is
//     treated as found_inf.
// Then the scale is updated as PyTorch's update(): found_inf multiplies it by backoff_factor
// (0.5) and restarts the count; growth_interval (2000) clean steps in a row multiply it by
// growth_factor (2.0). Worked example: 65536 -> overflow -> 32768 -> 2000 clean steps -> 65536.
#pragma once

#include <cstdint>

#include "nn/optim.h"

namespace nn {

// PyTorch's GradScaler defaults. REQUIRES (checked, InvalidArgument naming the value):
// init_scale finite > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1.
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

struct ScaledStep {
  bool stepped = false;  // false: found_inf on some rank, the step is skipped on every rank
  double norm = 0;       // the unscaled global norm (NaN when skipped)
  double scale = 0;      // the scale the gradients carried (before the update)
};

class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});
  double scale() const { return scale_; }
  int64_t growth_tracker() const { return tracker_; }  // clean steps since the last change
  const GradScalerOptions& options() const { return options_; }

  // Above. REQUIRES: the gradients reduced (no Partial), on one mesh or on meshes over the same
  // ranks (FSDP's per-parameter meshes: the flag reduces over the first one's). Collective.
  ScaledStep unscale_clip_(const NamedParameters& params, double max_norm);
  // PyTorch's update(found_inf) alone (unscale_clip_ calls it).
  void update(bool found_inf);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t tracker_ = 0;
};

}  // namespace nn
