/* The quantized linears (layout: quant.h): the kernel tier chosen at start by CPUID, the
 * activations quantized per block, the walk over units of 32 rows, and the fallback that
 * dequantizes one unit at a time into a float32 block and runs cpu_kernels.c's walk over it
 * (the generic tier, and row counts where that measured faster).
 *
 * Built with the library's native flags; the tiers' kernels are built with their own
 * (cpu.py) and only called when the CPU has their instructions.
 */
#include "cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define TL_X86 1
#endif

enum { TIER_GENERIC, TIER_AVX2, TIER_AVXVNNI, TIER_AVX512, TIERS };
static const char* const tier_names[TIERS] = {"generic", "avx2", "avx-vnni", "avx512-vnni"};
static int tier = -1;
/* Calls of at least this many rows take the dequantizing walk (set per tier; see cpu.py). */
static int64_t dequant_rows = INT64_MAX;
/* What a call's rows count as against a weight's two_term_rows while a step sets it (0: the
 * call's own rows): a step's sequences, so that a speculative verify's 1 + k rows of one
 * sequence take the precision its one-row decode takes, and greedy output is the same with
 * drafts. */
static int64_t step_rows = 0;
/* How far ahead the kernels prefetch the weights they stream, in records: 64 (20 KB of TL_Q4)
 * read 18 GB per CPU-second on one thread against 11 with none and 14.6 with 8, the real
 * model's 120 linears at one row taking turns in one process. The prefetches go to L2 (T1),
 * as the float32 and bf16 walks' do: into L1 (T0), a 35 MB int4 weight at one row read
 * 12.4 GB/s on one Zen 4 thread, into L2 21.8 (int8: 10.9 -> 18.2); 32 to 512 records ahead
 * read alike there, 16 much less. */
static int64_t prefetch_records = 64;

static const tl_quant_tier* tier_table(int t) {
#if defined(TL_X86)
  if (t == TIER_AVX2) return &tl_tier_avx2;
  if (t == TIER_AVXVNNI) return &tl_tier_avxvnni;
  if (t == TIER_AVX512) return &tl_tier_avx512;
#endif
  (void)t;
  return NULL;
}

static int has_tier(int t) {
  if (t == TIER_GENERIC) return 1;
  if (!tier_table(t)) return 0; /* not built (cpu.py) */
#if defined(TL_X86)
  __builtin_cpu_init();
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (t == TIER_AVX2) return avx2;
  if (t == TIER_AVXVNNI) return avx2 && __builtin_cpu_supports("avxvnni");
  if (t == TIER_AVX512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return 0;
}

/* Use tier `want` (the best this CPU has when negative); returns the tier in use, or -1 when
 * the CPU lacks `want` (the tier is then unchanged). */
int tl_quant_select(int want) {
  if (want >= TIERS) return -1;
  if (want < 0) {
    for (want = TIERS - 1; !has_tier(want); want--) {
    }
  } else if (!has_tier(want)) {
    return -1;
  }
  tier = want;
  return tier;
}

const char* tl_quant_tier_name(int t) { return t >= 0 && t < TIERS ? tier_names[t] : "?"; }

void tl_quant_set_dequant_rows(int64_t rows) { dequant_rows = rows; }

void tl_quant_set_step_rows(int64_t rows) { step_rows = rows; }

int64_t tl_counted_rows(int64_t M) { return step_rows > 0 ? step_rows : M; }

void tl_quant_set_prefetch(int64_t records) { prefetch_records = records; }

/* ---- float16 and one unit's weights as float32 ------------------------------------------ */

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else { /* zero or subnormal: man x 2^-24 */
    float v = (float)man * 5.9604645e-8f;
    return sign ? -v : v;
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

/* A record as float32 rows: out[i * ldo + r] = w of input i, row r (< 16). The loops run
 * over the 16 rows innermost, so that they vectorise. */
static void dequant_record(const uint8_t* rec, int type, float* out, int64_t ldo) {
  int64_t bs = tl_block_size(type), scales = tl_record_bytes(type) - 4 * QG;
  float d[QG], m[QG];
  for (int r = 0; r < QG; r++) {
    uint16_t hd, hm;
    memcpy(&hd, rec + scales + 2 * r, 2);
    memcpy(&hm, rec + scales + 2 * QG + 2 * r, 2);
    d[r] = half_to_float(hd);
    m[r] = half_to_float(hm);
  }
  if (type == TL_Q4) {
    for (int c = 0; c < 4; c++)
      for (int t = 0; t < 4; t++) {
        const uint8_t* v = rec + c * 64 + t;
        float* lo = out + (8 * c + t) * ldo;
        float* hi = lo + 4 * ldo;
        for (int r = 0; r < QG; r++) {
          lo[r] = d[r] * (float)(v[4 * r] & 0x0F) + m[r];
          hi[r] = d[r] * (float)(v[4 * r] >> 4) + m[r];
        }
      }
    return;
  }
  for (int i = 0; i < bs; i++) {
    const uint8_t* v = rec + (i / 4) * 64 + i % 4;
    for (int r = 0; r < QG; r++) out[i * ldo + r] = d[r] * (float)v[4 * r] + m[r];
  }
}

static int64_t group_records(const tl_weights* W) {
  int64_t bs = tl_block_size(W->type);
  return (W->n_in + bs - 1) / bs;
}

/* Unit u as cpu_kernels.c's float32 block [K][32] (out holds the padded K's rows). */
static void dequant_unit(const tl_weights* W, int64_t u, float* out) {
  int64_t nb = group_records(W), rec = tl_record_bytes(W->type), bs = tl_block_size(W->type);
  const uint8_t* w = (const uint8_t*)W->w + u * 2 * nb * rec;
  for (int g = 0; g < 2; g++)
    for (int64_t b = 0; b < nb; b++)
      dequant_record(w + (g * nb + b) * rec, W->type, out + b * bs * QU + g * QG, QU);
}

/* Rows ids[0, n) of the weight (not gated) as float32, out [n][n_in]. */
void tl_quant_rows(const tl_weights* W, const int64_t* ids, int64_t n, float* out) {
  int64_t nb = group_records(W), rec = tl_record_bytes(W->type), bs = tl_block_size(W->type);
  float block[32 * QG];
  for (int64_t j = 0; j < n; j++) {
    int64_t id = ids[j], r = id % QG, group = id / QG; /* groups lie back to back */
    for (int64_t b = 0; b < nb; b++) {
      dequant_record((const uint8_t*)W->w + (group * nb + b) * rec, W->type, block, QG);
      for (int64_t i = 0; i < bs && b * bs + i < W->n_in; i++)
        out[j * W->n_in + b * bs + i] = block[i * QG + r];
    }
  }
}

/* ---- the linear --------------------------------------------------------------------------- */

/* Activation rows quantized per block of bs (quant.h); inputs past K are zeros. With q2,
 * two terms: dx is then the second term's scale, the first's / 256. Plain comparisons, not
 * fmaxf / fminf, which GCC calls (NaN rules) where these loops should vectorise: at one row
 * those calls were 3.5% of a token. */
static void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t bs,
                          int8_t* q, int8_t* q2, float* dx, float* s, int64_t ldq,
                          int64_t lds) {
  TL_ROWS(m, M, {
    for (int64_t b = 0; b < lds; b++) {
      float xb[32] = {0}; /* the block, zeros past K */
      int64_t n = K - b * bs < bs ? K - b * bs : bs;
      memcpy(xb, x + m * ldx + b * bs, sizeof(float) * n);
      float amax = 0.0f;
      for (int64_t i = 0; i < bs; i++) {
        float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
      }
      float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = q + m * ldq + b * bs;
      int sum = 0, sum2 = 0;
      float e[32];
      for (int64_t i = 0; i < bs; i++) {
        float v = rintf(xb[i] * id);
        qb[i] = (int8_t)v;
        sum += (int)v;
        e[i] = (xb[i] * id - v) * 256.0f; /* the rounding error, in steps of d / 256 */
      }
      if (q2) {
        int8_t* rb = q2 + m * ldq + b * bs;
        for (int64_t i = 0; i < bs; i++) {
          float v = rintf(e[i] < -127.0f ? -127.0f : e[i] > 127.0f ? 127.0f : e[i]);
          rb[i] = (int8_t)v;
          sum2 += (int)v;
        }
        d /= 256.0f;
        sum = 256 * sum + sum2;
      }
      dx[m * lds + b] = d;
      s[m * lds + b] = d * (float)sum;
    }
  });
}

static void dequant_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W,
                           float* y, int64_t ldy, int mode, const float* res, int64_t ldr) {
#pragma omp parallel
  {
    float* block = aligned_alloc(64, sizeof(float) * QU * group_records(W) * tl_block_size(W->type));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < W->blocks; u++) {
      dequant_unit(W, u, block);
      tl_walk_f32(x, ldx, M, W, u, block, y, ldy, mode, res, ldr);
    }
    free(block);
  }
}

void tl_quant_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                     int64_t ldy, int mode, const float* res, int64_t ldr) {
  if (tier < 0) tl_quant_select(-1);
  const tl_quant_tier* t = tier_table(tier);
  tl_unit_fn fn = !t ? NULL : W->type == TL_Q4 ? t->q4 : W->type == TL_Q8 ? t->q8 : t->q8_16;
  if (!fn || M >= dequant_rows) {
    dequant_linear(x, ldx, M, W, y, ldy, mode, res, ldr);
    return;
  }
  int64_t bs = tl_block_size(W->type), nb = group_records(W), ldq = nb * bs;
  int64_t group = nb * tl_record_bytes(W->type);
  int two = tl_counted_rows(M) <= W->two_term_rows;
  int8_t* q = malloc(M * ldq * (two ? 2 : 1));
  float* scales = malloc(sizeof(float) * 2 * M * nb);
  int8_t* q2 = two ? q + M * ldq : NULL;
  quantize_rows(x, ldx, M, W->n_in, bs, q, q2, scales, scales + M * nb, ldq, nb);
  tl_qact a = {q, q2, scales, scales + M * nb, ldq, nb, prefetch_records * tl_record_bytes(W->type)};
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < W->blocks; u++) {
    const uint8_t* wu = (const uint8_t*)W->w + u * 2 * group;
    for (int64_t m0 = 0; m0 < M; m0 += QMR) {
      int mt = M - m0 < QMR ? (int)(M - m0) : QMR;
      float sums[QMR * QU];
      fn(&a, m0, mt, wu, nb, sums, QU);
      tl_emit(W, u, sums, mt, y + m0 * ldy, ldy, mode, res + m0 * ldr, ldr);
    }
  }
  free(q);
  free(scales);
}
