// bf16 GEMM with f32 accumulation on AVX512-BF16 (vdpbf16ps: 16 lanes x 2 products per
// instruction, twice the multiply-adds of an f32 FMA), compiled with -march=x86-64-v4
// -mavx512bf16 and used only when the CPU has AVX512-BF16 (kernels/cpu/vec.cpp). No Eigen and
// no standard-library templates here (NOTE [isa variants] in vec.h): plain loops, intrinsics,
// malloc.
//
// C [m, n] (f32, row stride c_rs) = alpha * A [m, k] @ B [k, n] + beta * C, A and B bf16 with
// any element strides. B is packed per block of kKc x kNc into k-pairs ([k/2][kNc][2], so one
// 32-bit lane holds the two bf16 of consecutive k of one column, the layout vdpbf16ps wants),
// A per block of kMr rows into k-pairs ([k/2][kMr] 32-bit pairs, broadcast one at a time). The
// micro-kernel keeps kMr x 32 f32 accumulators in 16 zmm registers. Odd k and tails are zero-
// padded in the packed copies. vdpbf16ps treats bf16 subnormals as zero (as oneDNN's kernels do).
#include <immintrin.h>

#include <cstdint>
#include <new>

#include "kernels/cpu/vec.h"

namespace kernels::detail {
namespace vec_avx512bf16 {
namespace {

constexpr int64_t kMr = 8;    // rows per micro-tile
constexpr int64_t kNr = 32;   // columns per micro-tile (2 zmm)
constexpr int64_t kNc = 256;  // columns per packed B block
constexpr int64_t kKc = 512;  // k per packed block: a B block of kKc x kNc bf16 is 256 KiB (L2)

// Packs B[k, n0:n0+nc] into pairs: out[(kk * ncp + j) * 2 + h] = B[2 kk + h][n0 + j] (0 beyond
// k or nc); ncp = nc rounded up to kNr.
void pack_b(uint16_t* out, const uint16_t* b, int64_t b_rs, int64_t b_cs, int64_t k, int64_t nc,
            int64_t ncp) {
  const int64_t kp = (k + 1) / 2;
  for (int64_t kk = 0; kk < kp; ++kk) {
    uint16_t* row = out + kk * ncp * 2;
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t kr = 2 * kk + h;
      if (kr >= k) {
        for (int64_t j = 0; j < ncp; ++j) row[j * 2 + h] = 0;
        continue;
      }
      const uint16_t* src = b + kr * b_rs;
      for (int64_t j = 0; j < nc; ++j) row[j * 2 + h] = src[j * b_cs];
      for (int64_t j = nc; j < ncp; ++j) row[j * 2 + h] = 0;
    }
  }
}

// Packs A[m0:m0+mr, k] into pairs: out[kk * kMr + r] = (A[r][2 kk], A[r][2 kk + 1]) as 32 bits.
void pack_a(uint32_t* out, const uint16_t* a, int64_t a_rs, int64_t a_cs, int64_t k, int64_t mr) {
  const int64_t kp = (k + 1) / 2;
  for (int64_t kk = 0; kk < kp; ++kk) {
    for (int64_t r = 0; r < kMr; ++r) {
      uint32_t lo = 0, hi = 0;
      if (r < mr) {
        lo = a[r * a_rs + 2 * kk * a_cs];
        if (2 * kk + 1 < k) hi = a[r * a_rs + (2 * kk + 1) * a_cs];
      }
      out[kk * kMr + r] = lo | (hi << 16);
    }
  }
}

// acc[r][0..31] over kp pairs; then C rows r < mr, columns j < nr: alpha * acc + beta * C.
void micro(const uint32_t* pa, const uint16_t* pb, int64_t ncp, int64_t kp, int64_t mr, int64_t nr,
           float alpha, float beta, float* c, int64_t c_rs) {
  __m512 acc[kMr][2];
  for (int64_t r = 0; r < kMr; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp; ++kk) {
    const __m512i b0 = _mm512_loadu_si512(pb + kk * ncp * 2);
    const __m512i b1 = _mm512_loadu_si512(pb + kk * ncp * 2 + 32);
    const uint32_t* ar = pa + kk * kMr;
    for (int64_t r = 0; r < kMr; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(ar[r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)av, (__m512bh)b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)av, (__m512bh)b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t r = 0; r < mr; ++r) {
    float* cr = c + r * c_rs;
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t j0 = h * 16;
      if (j0 >= nr) break;
      const int64_t cnt = nr - j0 < 16 ? nr - j0 : 16;
      const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
      __m512 v = _mm512_mul_ps(acc[r][h], va);
      if (beta != 0.0f) v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, cr + j0), vb, v);
      _mm512_mask_storeu_ps(cr + j0, mask, v);
    }
  }
}

}  // namespace

void gemm_bf16(const GemmBf16Args& g) {
  if (g.m == 0 || g.n == 0) return;
  const int64_t kc_max = g.k < kKc ? g.k : kKc;
  const int64_t kp_max = (kc_max + 1) / 2;
  // One block for both packed copies (operator new throws std::bad_alloc itself: nothing leaks);
  // the A pairs start 64-byte aligned after the B pairs.
  const size_t b_bytes = static_cast<size_t>(kp_max * kNc * 2) * sizeof(uint16_t);
  const size_t a_bytes = static_cast<size_t>(kp_max * kMr) * sizeof(uint32_t);
  void* block = ::operator new(b_bytes + a_bytes + 64);
  auto* pb = static_cast<uint16_t*>(block);
  auto* pa = reinterpret_cast<uint32_t*>(static_cast<char*>(block) + ((b_bytes + 63) / 64) * 64);
  for (int64_t n0 = 0; n0 < g.n; n0 += kNc) {
    const int64_t nc = g.n - n0 < kNc ? g.n - n0 : kNc;
    const int64_t ncp = (nc + kNr - 1) / kNr * kNr;
    // k in blocks; every block after the first adds to C (beta 1). k == 0 still runs one block
    // so C = beta * C.
    for (int64_t k0 = 0; k0 == 0 || k0 < g.k; k0 += kKc) {
      const int64_t kc = g.k - k0 < kKc ? g.k - k0 : kKc;
      const int64_t kp = (kc + 1) / 2;
      const float beta = k0 == 0 ? g.beta : 1.0f;
      pack_b(pb, g.b + k0 * g.b_rs + n0 * g.b_cs, g.b_rs, g.b_cs, kc, nc, ncp);
      for (int64_t m0 = 0; m0 < g.m; m0 += kMr) {
        const int64_t mr = g.m - m0 < kMr ? g.m - m0 : kMr;
        pack_a(pa, g.a + m0 * g.a_rs + k0 * g.a_cs, g.a_rs, g.a_cs, kc, mr);
        for (int64_t j0 = 0; j0 < nc; j0 += kNr) {
          const int64_t nr = nc - j0 < kNr ? nc - j0 : kNr;
          micro(pa, pb + j0 * 2, ncp, kp, mr, nr, g.alpha, beta, g.c + m0 * g.c_rs + n0 + j0,
                g.c_rs);
        }
      }
      if (g.k == 0) break;
    }
  }
  ::operator delete(block);
}

}  // namespace vec_avx512bf16

GemmBf16Fn vec_gemm_bf16_avx512() { return &vec_avx512bf16::gemm_bf16; }

}  // namespace kernels::detail
