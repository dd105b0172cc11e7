/* The CPU kernels' small vector helpers (a broadcast, loads of float32 / bf16 / fp16 elements
 * and of a packed block's weights, the max, bf16 rounding, exp, the gated MLP's activations),
 * over cpu_kernels.h's vector types, and their loop over rows (TL_ROWS); included at its end,
 * never on its own.
 */
#ifndef TETHER_VEC_H
#define TETHER_VEC_H

/* for (int64_t i = 0; i < n; i++) { ... }, the braces' body the macro's last argument: on the
 * OpenMP threads from 16 rows; below that on the calling thread without entering OpenMP at all,
 * where `parallel for if (0)` still forms a team of one (~0.34 us here), seven times a layer at
 * one row. A pragma in the body is written _Pragma("..."). */
#define TL_ROWS(i, n, ...)                                         \
  do {                                                             \
    if ((n) >= 16) {                                               \
      _Pragma("omp parallel for schedule(static)")                 \
      for (int64_t i = 0; i < (n); i++) __VA_ARGS__                \
    } else {                                                       \
      for (int64_t i = 0; i < (n); i++) __VA_ARGS__                \
    }                                                              \
  } while (0)

/* A broadcast (one load when v is in memory); `0 + v` cost an add and a register shuffle per
 * activation in the linears' inner loop. */
INLINE fvec splat(float v) {
#if defined(__AVX512F__)
  __m512 b = _mm512_set1_ps(v);
#elif defined(__AVX2__)
  __m256 b = _mm256_set1_ps(v);
#else
  fvec b = {v, v, v, v};
#endif
  fvec out;
  memcpy(&out, &b, sizeof out);
  return out;
}

/* Lane-wise a > b ? a : b (C has no vector conditional operator). */
INLINE fvec vmax(fvec a, fvec b) {
  ivec pick_a = a > b, ai, bi;
  memcpy(&ai, &a, sizeof ai);
  memcpy(&bi, &b, sizeof bi);
  ivec r = (ai & pick_a) | (bi & ~pick_a);
  fvec out;
  memcpy(&out, &r, sizeof out);
  return out;
}

/* VL elements from base[i], as floats. */
INLINE fvec loadv(const void* base, int64_t i, int type) {
  fvec out;
  if (type == TL_F32) {
    memcpy(&out, (const float*)base + i, sizeof out);
  } else {
#if defined(__AVX512F__)
    /* One widening load and a shift: GCC splits the generic conversion below into two
     * 256-bit halves and an insert on some targets (Zen 4). The decode attention widens
     * every bf16 key and value this way: 6% of its time there. */
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    hvec h;
    memcpy(&h, (const uint16_t*)base + i, sizeof h);
    ivec bits = __builtin_convertvector(h, ivec) << 16;
#endif
    memcpy(&out, &bits, sizeof out);
  }
  return out;
}

/* Input k's weights for outputs [col, col + VL) of a block: float32 [K][32], or bfloat16 in
 * pairs [K2][32][2] (cpu_kernels.h), where a 32-bit lane holds the even input's weight in its
 * low half and the odd one's in its high half: either half is a float32 after a shift or a
 * mask, as cheap as widening a plain bf16 row. */
INLINE fvec loadw(const void* w, int64_t k, int64_t col, int type) {
  if (type == TL_F32) return loadv(w, k * NB + col, TL_F32);
  ivec bits;
  memcpy(&bits, (const uint16_t*)w + (k >> 1) * 2 * NB + 2 * col, sizeof bits);
  bits = (bits << (int)(16 - 16 * (k & 1))) & (int32_t)0xFFFF0000;
  fvec out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

INLINE uint16_t to_bf16(float v) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &v, 4);
  return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* exp, arguments clamped to [-87, 88]; Cephes' polynomial after reduction by ln 2 (about 1 ulp). */
INLINE fvec vexp(fvec x) {
  const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  x = vmax(x, splat(-87.0f));
  x = -vmax(-x, splat(-88.0f));
  fvec n = (x * 1.44269504089f + magic) - magic;
  fvec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  fvec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* The gate of a gated MLP: silu(g) = g sigmoid(g), or GELU's tanh approximation, which is
 * g sigmoid(2u) with u = sqrt(2/pi) (g + 0.044715 g^3) (as 0.5 (1 + tanh u) = sigmoid(2u)). */
INLINE fvec gate_act(fvec g, int mode) {
  if (mode == TL_SILU_MUL) return g / (1.0f + vexp(-g));
  fvec u = 0.7978845608f * (g + 0.044715f * g * g * g);
  return g / (1.0f + vexp(-2.0f * u));
}

#endif
