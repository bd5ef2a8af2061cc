// Stubs: the API of kernels/ops/embedding.h, implementations to follow.
#include "kernels/ops/embedding.h"

#include "kernels/error.h"

namespace kernels {

Tensor embedding(const Tensor&, const Tensor&, const EmbeddingOptions&) {
  throw Unsupported("embedding: not implemented yet");
}
void embedding_out(const Tensor&, const Tensor&, const Tensor&, const EmbeddingOptions&) {
  throw Unsupported("embedding_out: not implemented yet");
}
Tensor embedding_backward(const Tensor&, const Tensor&, int64_t, const EmbeddingOptions&) {
  throw Unsupported("embedding_backward: not implemented yet");
}
void embedding_backward_out(const Tensor&, const Tensor&, const Tensor&, const EmbeddingOptions&, bool) {
  throw Unsupported("embedding_backward_out: not implemented yet");
}

}  // namespace kernels
