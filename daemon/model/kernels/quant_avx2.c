/* The quantized linears' kernels on AVX2 (the walk of quant_ymm.h): vpmaddubsw multiplies
 * unsigned codes by int8 activations into saturating int16 pairs, vpmaddwd sums those into
 * int32. 4-bit codes: a block's 8 products stay under 8 x 2 x 15 x 127 < 2^15, so they are
 * summed in int16 and widened once. 8-bit codes would saturate, so they are taken as signed
 * (u - 128) with their sign moved onto the activation (|u - 128| x 127 x 2 < 2^15), as
 * llama.cpp does, and the offset's share becomes m + 128 d. */
#define OFFSET_CODES 1
#include "quant_ymm.h"

INLINE __m256i block_dot(const __m256i* c, int n, const int8_t* x, int type) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (type == TL_Q4) {
    __m256i t = _mm256_maddubs_epi16(c[0], bcast4(x));
    for (int j = 1; j < n; j++) t = _mm256_add_epi16(t, _mm256_maddubs_epi16(c[j], bcast4(x + 4 * j)));
    return _mm256_madd_epi16(t, ones);
  }
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < n; j++) {
    __m256i q = _mm256_xor_si256(c[j], flip);
    __m256i t = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(bcast4(x + 4 * j), q));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(t, ones));
  }
  return s;
}

TL_DEFINE_TIER(tl_tier_avx2, "avx2")
