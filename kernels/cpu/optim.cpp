// CPU optimizer steps: rows of the coalesced strided space of (param, grad, states); unit-stride
// rows of the param dtype go straight to the VecOps loop, others through chunk buffers.
#include <algorithm>
#include <array>
#include <cstdint>

#include "kernels/cpu/compute.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vec.h"

namespace kernels::detail {
namespace {

template <class T>
void step_impl(const OptimPlan& p) {
  const VecOps<T>& v = vec_ops<T>();
  constexpr DType kT = dtype_of_v<T>;
  AdamWCoefficients<T> ac{};
  SgdCoefficients<T> sc{};
  if (p.adamw) {
    ac = {static_cast<T>(p.decay),
          static_cast<T>(p.l2),
          static_cast<T>(p.one_minus_beta1),
          static_cast<T>(p.beta2),
          static_cast<T>(p.one_minus_beta2),
          static_cast<T>(p.step_size),
          static_cast<T>(p.bias_correction2_sqrt),
          static_cast<T>(p.eps),
          p.amsgrad,
          p.maximize};
  } else {
    sc = {static_cast<T>(p.lr),
          static_cast<T>(p.momentum),
          static_cast<T>(p.one_minus_dampening),
          static_cast<T>(p.weight_decay),
          p.nesterov,
          p.maximize,
          p.first_step,
          p.state[0] != nullptr};
  }
  const int nstate = p.adamw ? (p.amsgrad ? 3 : 2) : (p.state[0] != nullptr ? 1 : 0);
  const Dims& s0 = nstate > 0 ? p.state_strides[0] : p.param_strides;
  const Dims& s1 = nstate > 1 ? p.state_strides[1] : p.param_strides;
  const Dims& s2 = nstate > 2 ? p.state_strides[2] : p.param_strides;
  const auto space = coalesce<5>(p.shape, {p.param_strides, p.grad_strides, s0, s1, s2});
  std::array<int64_t, 5> inner{};
  for (int k = 0; k < 5; ++k) inner[k] = space.strides[k].back();
  bool direct = p.grad_dtype == kT;
  for (int k = 0; k < 2 + nstate; ++k) direct = direct && inner[k] == 1;
  T* param = static_cast<T*>(p.param);
  T* st[3] = {static_cast<T*>(p.state[0]), static_cast<T*>(p.state[1]),
              static_cast<T*>(p.state[2])};
  auto run = [&](T* pp, const T* g, T* a, T* b, T* c, int64_t n) {
    if (p.adamw) {
      v.adamw(pp, g, a, b, c, n, ac);
    } else {
      v.sgd(pp, g, a, n, sc);
    }
  };
  if (direct) {
    for_each_row<5>(space, [&](const std::array<int64_t, 5>& off, int64_t n) {
      run(param + off[0], static_cast<const T*>(at(p.grad, kT, off[1])),
          nstate > 0 ? st[0] + off[2] : nullptr, nstate > 1 ? st[1] + off[3] : nullptr,
          nstate > 2 ? st[2] + off[4] : nullptr, n);
    });
    return;
  }
  constexpr int64_t kChunk = 256;
  alignas(64) T buf[5][kChunk];
  for_each_row<5>(space, [&](const std::array<int64_t, 5>& off, int64_t n) {
    for (int64_t s = 0; s < n; s += kChunk) {
      const int64_t len = std::min(kChunk, n - s);
      load_row<T>(buf[0], param + off[0] + s * inner[0], kT, inner[0], len);
      load_row<T>(buf[1], at(p.grad, p.grad_dtype, off[1] + s * inner[1]), p.grad_dtype, inner[1],
                  len);
      for (int k = 0; k < nstate; ++k)
        load_row<T>(buf[2 + k], st[k] + off[2 + k] + s * inner[2 + k], kT, inner[2 + k], len);
      run(buf[0], buf[1], buf[2], buf[3], buf[4], len);
      store_row<T>(param + off[0] + s * inner[0], kT, inner[0], buf[0], len);
      for (int k = 0; k < nstate; ++k)
        store_row<T>(st[k] + off[2 + k] + s * inner[2 + k], kT, inner[2 + k], buf[2 + k], len);
    }
  });
}

}  // namespace

void cpu_optimizer_step(const OptimPlan& p) {
  if (p.shape.product() == 0) return;
  if (p.dtype == DType::kF64) {
    step_impl<double>(p);
  } else {
    step_impl<float>(p);
  }
}

}  // namespace kernels::detail
