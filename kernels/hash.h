// mix64: splitmix64's finaliser, a bijective 64-bit mix. The library's reproducible values come
// from it (nn::Init's uniform and normal draws, DTensor rand, fsdp-train's token batches), each
// a function of (seed, index) alone, so any rank computes any element without a stream of draws.
//
//   mix64(0) == 0xE220A8397B1DCDAF       // splitmix64's first output from state 0
//   uint64_t key = mix64(seed);          // then mix64(key ^ i) for element i
#pragma once

#include <cstdint>

namespace kernels {

constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace kernels
