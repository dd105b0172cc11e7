/* The quantized linears' kernels on AVX-512 VNNI (quant.h): vpdpbusd multiplies 4 unsigned
 * codes of each of a group's 16 rows by 4 int8 activations broadcast to every lane, so one
 * instruction is 64 multiply-adds and the group's rows never need a horizontal sum. Built with
 * its own flags (cpu.py) and called only where CPUID says the CPU has them (quant.c).
 */
#include <immintrin.h>
#include <string.h>

#include "quant.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* sum(codes x 4 activations) over a block's n vectors, added to s, in two chains. */
INLINE __m512i block_dot(__m512i s, const __m512i* c, int n, const int8_t* x) {
  __m512i s1 = _mm512_setzero_si512();
  for (int j = 0; j < n; j += 2) {
    s = _mm512_dpbusd_epi32(s, c[j], bcast4(x + 4 * j));
    s1 = _mm512_dpbusd_epi32(s1, c[j + 1], bcast4(x + 4 * j + 4));
  }
  return _mm512_add_epi32(s, s1);
}

/* Rows [0, mr) against ng groups (one, or a unit's two: more independent sums for the
 * weight-streaming row counts); a record's codes are loaded (and for TL_Q4 split into
 * nibbles) once for all mr rows; with `two`, activations of two terms (quant.h). */
INLINE void tile(const tl_qact* a, int64_t m0, const int mr, const uint8_t* g, int64_t nb,
                 float* out, int64_t ldo, const int type, const int two, const int ng) {
  const int n = type == TL_Q8_16 ? 4 : 8; /* code vectors per record */
  const int64_t bs = 4 * n, rec = tl_record_bytes(type), ldq = a->ldq, lds = a->lds;
  const int8_t* xq = a->q + m0 * ldq;
  const float *dx = a->dx + m0 * lds, *sx = a->s + m0 * lds;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[QMR][2];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
    for (int k = 0; k < ng; k++) acc[r][k] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, g += rec) {
    __m512i c[2][8];
    __m512 d[2], m[2];
    for (int k = 0; k < ng; k++) {
      const uint8_t* gk = g + k * nb * rec;
      for (int64_t l = 0; l < rec; l += 64) _mm_prefetch((const char*)gk + a->prefetch + l, _MM_HINT_T1);
      if (type == TL_Q4) {
        for (int j = 0; j < 4; j++) {
          __m512i v = _mm512_load_si512(gk + 64 * j);
          c[k][2 * j] = _mm512_and_si512(v, low);
          c[k][2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < n; j++) c[k][j] = _mm512_load_si512(gk + 64 * j);
      }
      const uint8_t* scales = gk + rec - 4 * QG;
      d[k] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)scales));
      m[k] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(scales + 2 * QG)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      int64_t at = r * ldq + b * bs;
      __m512 dxr = _mm512_set1_ps(dx[r * lds + b]), sxr = _mm512_set1_ps(sx[r * lds + b]);
      for (int k = 0; k < ng; k++) {
        __m512i s = block_dot(_mm512_setzero_si512(), c[k], n, xq + at);
        if (two) s = block_dot(_mm512_slli_epi32(s, 8), c[k], n, a->q2 + m0 * ldq + at);
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), dxr);
        acc[r][k] = _mm512_fmadd_ps(f, d[k], acc[r][k]);
        acc[r][k] = _mm512_fmadd_ps(m[k], sxr, acc[r][k]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
    for (int k = 0; k < ng; k++) _mm512_storeu_ps(out + ldo * r + QG * k, acc[r][k]);
}

/* A unit: up to 2 rows walk both its groups at once, more rows one group after the other
 * (the registers hold 8 rows' sums, or 2 rows' of two groups). A constant row count per call,
 * so that each case compiles to an unrolled tile. */
#define GROUPS(R, TYPE, TWO)                                                        \
  tile(a, m0, R, g, nb, out, ldo, TYPE, TWO, 1);                                  \
  tile(a, m0, R, g + nb * tl_record_bytes(TYPE), nb, out + QG, ldo, TYPE, TWO, 1); \
  break;
#define ROWS2(TYPE, TWO)                                        \
  switch (mr) {                                                 \
    case 8: GROUPS(8, TYPE, TWO)                                \
    case 7: GROUPS(7, TYPE, TWO)                                \
    case 6: GROUPS(6, TYPE, TWO)                                \
    case 5: GROUPS(5, TYPE, TWO)                                \
    case 4: GROUPS(4, TYPE, TWO)                                \
    case 3: GROUPS(3, TYPE, TWO)                                \
    case 2: tile(a, m0, 2, g, nb, out, ldo, TYPE, TWO, 2); break; \
    default: tile(a, m0, 1, g, nb, out, ldo, TYPE, TWO, 2); break; \
  }

TL_DEFINE_TIER(tl_tier_avx512, "avx512-vnni")
