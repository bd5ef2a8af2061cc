// Stubs: the API of kernels/ops/cross_entropy.h, implementations to follow.
#include "kernels/ops/cross_entropy.h"

#include "kernels/error.h"

namespace kernels {

CrossEntropyOutput cross_entropy(const Tensor&, const Tensor&, const CrossEntropyOptions&, bool) {
  throw Unsupported("cross_entropy: not implemented yet");
}
void cross_entropy_out(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const CrossEntropyOptions&) {
  throw Unsupported("cross_entropy_out: not implemented yet");
}
CrossEntropyRowStats cross_entropy_shard_stats(const Tensor&, const Tensor&, int64_t, int64_t, int64_t) {
  throw Unsupported("cross_entropy_shard_stats: not implemented yet");
}
void rescale_sum_exp_(const Tensor&, const Tensor&, const Tensor&) {
  throw Unsupported("rescale_sum_exp_: not implemented yet");
}
Tensor cross_entropy_loss_from_stats(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const CrossEntropyOptions&) {
  throw Unsupported("cross_entropy_loss_from_stats: not implemented yet");
}
void cross_entropy_shard_backward_out(const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&, const CrossEntropyOptions&) {
  throw Unsupported("cross_entropy_shard_backward_out: not implemented yet");
}

}  // namespace kernels
