/* bfloat16 products on AVX512_BF16 (bf16.h): vdpbf16ps adds two products of bf16 pairs into
 * each float32 lane, the lanes a block's rows, the activation pair broadcast. Up to 12 rows
 * of activations at a time: 24 accumulators and the block's two weight vectors in registers.
 * Built with its own flags (cpu.py), called where CPUID says (bf16.c). */
#include <immintrin.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))
#define ROWS 12

INLINE __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

INLINE void tile(const uint16_t* x, int64_t ldx, const int mr, const uint16_t* pairs,
                 int64_t k2, float* out, const char* pf, int64_t lines) {
  __m512 acc[ROWS][2];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k2; kp++) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(pairs + kp * 64);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(pairs + kp * 64 + 32);
    if (2 * kp < lines) {
      _mm_prefetch(pf + 128 * kp, _MM_HINT_T1);
      _mm_prefetch(pf + 128 * kp + 64, _MM_HINT_T1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      __m512bh xv = bcast_pair(x + r * ldx + 2 * kp);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_ps(out + 32 * r, acc[r][0]);
    _mm512_storeu_ps(out + 32 * r + 16, acc[r][1]);
  }
}

static void rows(const uint16_t* x, int64_t ldx, int mr, const uint16_t* pairs, int64_t k2,
                 float* out, const char* pf, int64_t lines) {
  switch (mr) {
    case 12: tile(x, ldx, 12, pairs, k2, out, pf, lines); break;
    case 11: tile(x, ldx, 11, pairs, k2, out, pf, lines); break;
    case 10: tile(x, ldx, 10, pairs, k2, out, pf, lines); break;
    case 9: tile(x, ldx, 9, pairs, k2, out, pf, lines); break;
    case 8: tile(x, ldx, 8, pairs, k2, out, pf, lines); break;
    case 7: tile(x, ldx, 7, pairs, k2, out, pf, lines); break;
    case 6: tile(x, ldx, 6, pairs, k2, out, pf, lines); break;
    case 5: tile(x, ldx, 5, pairs, k2, out, pf, lines); break;
    case 4: tile(x, ldx, 4, pairs, k2, out, pf, lines); break;
    case 3: tile(x, ldx, 3, pairs, k2, out, pf, lines); break;
    case 2: tile(x, ldx, 2, pairs, k2, out, pf, lines); break;
    default: tile(x, ldx, 1, pairs, k2, out, pf, lines); break;
  }
}

static int ready(void) { return 1; }

const tl_bf16_tier tl_bf16_avx512 = {"avx512-bf16", rows, ROWS, 1, ready};
