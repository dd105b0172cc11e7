/* bfloat16 weights with bfloat16 products (bf16.h): the tier chosen at start by CPUID, the
 * activations rounded to bf16, each block of 32 rows (packed in pairs at load) walked by the
 * tier for every row of the call, then cpu_kernels.c's scale / bias / mode step. Built with
 * the library's native flags; the tiers with their own (cpu.py).
 */
#include "bf16.h"

#include "cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define TL_X86 1
#endif

enum { BF16_NONE, BF16_AVX512, BF16_AMX, BF16_TIERS };
static const char* const bf16_names[BF16_TIERS] = {"none", "avx512-bf16", "amx-bf16"};
static int bf16_tier = -1;
/* Calls of at least this many rows (tl_counted_rows: a chunk of drafts counts as one) take
 * the bf16 products; fewer stream the weights through float32 FMAs (memory, not products,
 * bounds them, and their activations stay float32). SmolLM2 in bf16, 2 threads, decode ticks
 * of 4 / 8 rows: 7.7 / 9.8 ms at 4 against 10.6 / 14.5 ms at 12 (docs/benchmarks.md). */
static int64_t bf16_rows = 4;

static const tl_bf16_tier* bf16_table(int t) {
#if defined(TL_X86)
  if (t == BF16_AVX512) return &tl_bf16_avx512;
  if (t == BF16_AMX) return &tl_bf16_amx;
#endif
  (void)t;
  return NULL;
}

static int has_bf16_tier(int t) {
  if (t == BF16_NONE) return 1;
  const tl_bf16_tier* table = bf16_table(t);
  if (!table || PAIR_STEP % table->k2_step) return 0; /* the packed pairs' padding */
#if defined(TL_X86)
  __builtin_cpu_init();
  if (t == BF16_AVX512 && !__builtin_cpu_supports("avx512bf16")) return 0;
  if (t == BF16_AMX && !(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")))
    return 0;
  return table->init(); /* AMX: the kernel must grant the tile state */
#else
  return 0;
#endif
}

/* As tl_quant_select, for the bf16 products (0: none, float32 FMAs at every row count). */
int tl_bf16_select(int want) {
  if (want >= BF16_TIERS) return -1;
  if (want < 0) {
    for (want = BF16_TIERS - 1; !has_bf16_tier(want); want--) {
    }
  } else if (!has_bf16_tier(want)) {
    return -1;
  }
  bf16_tier = want;
  return bf16_tier;
}

const char* tl_bf16_tier_name(int t) { return t >= 0 && t < BF16_TIERS ? bf16_names[t] : "?"; }

void tl_bf16_set_rows(int64_t rows) { bf16_rows = rows; }

int tl_bf16_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                   int64_t ldy, int mode, const float* res, int64_t ldr) {
  if (bf16_tier < 0) tl_bf16_select(-1);
  const tl_bf16_tier* t = bf16_table(bf16_tier);
  if (!t || tl_counted_rows(M) < bf16_rows) return 0;
  int64_t K = W->n_in, k2 = tl_pairs(K); /* a multiple of every tier's k2_step */
  int64_t ldb = 2 * k2, Mp = (M + t->rows - 1) / t->rows * t->rows;
  uint16_t* xb = malloc(Mp * ldb * sizeof(uint16_t));
  /* Each walk over a block prefetches its share of the next block's lines (blocks lie back
   * to back), so that memory streams while the products run. */
  int64_t block = k2 * 2 * NB * sizeof(uint16_t), walks = Mp / t->rows;
  int64_t lines = (block / 64 + walks - 1) / walks;
#pragma omp parallel
  {
    float* sums = malloc(sizeof(float) * NB * t->rows);
    t->init();
    /* The activations as bf16, rows past M and inputs past K zeros, rounded by all the
     * threads: on the calling thread alone, the other waited. */
#pragma omp for schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
      uint16_t* row = xb + m * ldb;
      int64_t k = 0;
      if (m < M)
        for (; k < K; k++) row[k] = to_bf16(x[m * ldx + k]);
      for (; k < ldb; k++) row[k] = 0;
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < W->blocks; b++) {
      const char* wb = (const char*)W->w + b * block;
      for (int64_t m0 = 0; m0 < M; m0 += t->rows) {
        int mt = M - m0 < t->rows ? (int)(M - m0) : t->rows;
        t->tile(xb + m0 * ldb, ldb, mt, (const uint16_t*)wb, k2, sums,
                wb + block + m0 / t->rows * lines * 64, lines);
        for (int r = 0; r < mt; r += QMR) /* tl_emit takes QMR rows at most */
          tl_emit(W, b, sums + r * NB, mt - r < QMR ? mt - r : QMR, y + (m0 + r) * ldy, ldy,
                  mode, res + (m0 + r) * ldr, ldr);
      }
    }
    free(sums);
  }
  free(xb);
  return 1;
}
