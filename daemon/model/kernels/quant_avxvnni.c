/* The quantized linears' kernels on AVX-VNNI (256-bit vpdpbusd, VEX-encoded: Alder Lake and
 * later, Zen 5), the walk of quant_ymm.h; built with its own flags, called where CPUID says. */
#define OFFSET_CODES 0
#include "quant_ymm.h"

INLINE __m256i block_dot(const __m256i* c, int n, const int8_t* x, int type) {
  (void)type;
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int j = 0; j < n; j += 2) {
    s0 = _mm256_dpbusd_avx_epi32(s0, c[j], bcast4(x + 4 * j));
    s1 = _mm256_dpbusd_avx_epi32(s1, c[j + 1], bcast4(x + 4 * j + 4));
  }
  return _mm256_add_epi32(s0, s1);
}

TL_DEFINE_TIER(tl_tier_avxvnni, "avx-vnni")
