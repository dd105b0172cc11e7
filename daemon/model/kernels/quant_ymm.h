/* The 256-bit tiers' kernels (quant_avxvnni.c, quant_avx2.c): quant_avx512.c's walk over a
 * group, 8 rows (one half of the group's 16) at a time. The includer defines
 *   block_dot(c, n, x): the 8 rows' int32 sums of n code vectors c (4 inputs each) times the
 *     activations x (bcast4 of each 4 in turn);
 *   OFFSET_CODES: nonzero when block_dot takes TL_Q8 codes as signed (u - 128), so that the
 *     offset's share m + 128 d replaces m.
 */
#ifndef TETHER_QUANT_YMM_H
#define TETHER_QUANT_YMM_H
#include <immintrin.h>
#include <string.h>

#include "quant.h"

#define INLINE static inline __attribute__((always_inline))
#define YMR 4 /* rows per pass: 16 ymm registers hold 8 codes, d, m and these sums */

INLINE __m256i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

INLINE __m256i block_dot(const __m256i* c, int n, const int8_t* x, int type);

INLINE void half_tile(const tl_qact* a, int64_t m0, const int mr, const uint8_t* g, int64_t nb,
                      float* out, int64_t ldo, const int type, const int two, const int h) {
  const int n = type == TL_Q8_16 ? 4 : 8;
  const int64_t bs = 4 * n, rec = tl_record_bytes(type), ldq = a->ldq, lds = a->lds;
  const int8_t* xq = a->q + m0 * ldq;
  const float *dx = a->dx + m0 * lds, *sx = a->s + m0 * lds;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[YMR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++, g += rec) {
    if (h == 0)
      for (int64_t l = 0; l < rec; l += 64) _mm_prefetch((const char*)g + a->prefetch + l, _MM_HINT_T1);
    __m256i c[8];
    if (type == TL_Q4) {
      for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_load_si256((const __m256i*)(g + 64 * j + 32 * h));
        c[2 * j] = _mm256_and_si256(v, low);
        c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < n; j++) c[j] = _mm256_load_si256((const __m256i*)(g + 64 * j + 32 * h));
    }
    const uint8_t* scales = g + rec - 4 * QG + 16 * h;
    __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)scales));
    __m256 m = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(scales + 2 * QG)));
    if (OFFSET_CODES && type != TL_Q4) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.0f), m);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      int64_t at = r * ldq + b * bs;
      __m256i s = block_dot(c, n, xq + at, type);
      if (two)
        s = _mm256_add_epi32(_mm256_slli_epi32(s, 8), block_dot(c, n, a->q2 + m0 * ldq + at, type));
      __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx[r * lds + b]));
      acc[r] = _mm256_fmadd_ps(f, d, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * lds + b]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + ldo * r + 8 * h, acc[r]);
}

INLINE void tile(const tl_qact* a, int64_t m0, const int mr, const uint8_t* g, int64_t nb,
                 float* out, int64_t ldo, const int type, const int two) {
  half_tile(a, m0, mr, g, nb, out, ldo, type, two, 0);
  half_tile(a, m0, mr, g, nb, out, ldo, type, two, 1);
}

/* A unit, group after group, YMR rows at a time. */
#define ROWS2(TYPE, TWO)                                                          \
  for (int r0 = 0; r0 < mr; r0 += YMR) {                                          \
    int rows = mr - r0 < YMR ? mr - r0 : YMR;                                     \
    for (int k = 0; k < 2; k++) {                                                 \
      const uint8_t* gk = g + k * nb * tl_record_bytes(TYPE);                     \
      float* o = out + ldo * r0 + QG * k;                                         \
      switch (rows) {                                                             \
        case 4: tile(a, m0 + r0, 4, gk, nb, o, ldo, TYPE, TWO); break;            \
        case 3: tile(a, m0 + r0, 3, gk, nb, o, ldo, TYPE, TWO); break;            \
        case 2: tile(a, m0 + r0, 2, gk, nb, o, ldo, TYPE, TWO); break;            \
        default: tile(a, m0 + r0, 1, gk, nb, o, ldo, TYPE, TWO); break;           \
      }                                                                           \
    }                                                                             \
  }

#endif
