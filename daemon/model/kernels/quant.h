/* Quantized weights for the CPU linears: the layout daemon/model/kernels/quant_pack.py writes,
 * the int8 activations the kernels multiply them by, and the table of kernels one CPU tier
 * provides (quant_avx512.c, quant_avxvnni.c, quant_avx2.c; quant.c picks one at start).
 *
 * A weight is unsigned codes u with a scale d and an offset m per block of BS inputs of each
 * output row, w = d u + m: every GGUF type maps onto this exactly (Q4_0: m = -8 d; Q8_0:
 * u = q + 128, m = -128 d; Q4_K/Q5_K: d and m per 32-block; Q6_K: 16-blocks). Codes of at
 * most 4 bits are stored two to a byte (TL_Q4), wider ones a byte each (TL_Q8, TL_Q8_16).
 *
 * Rows come in units of 32 (the fp32 kernels' blocks: a gated weight's unit is 16 gate rows,
 * then their 16 up rows), a unit is two groups of 16 rows, a group K/BS records, one per
 * block of inputs. A record holds the group's codes for BS inputs, laid out so that one
 * 64-byte load is 4 consecutive inputs of each of the 16 rows (the operand of one vpdpbusd,
 * rows in the 32-bit lanes), then the 16 rows' d and then their m as float16. TL_Q4: chunk c
 * (64 bytes) holds inputs [8c, 8c + 4) in its low nibbles and [8c + 4, 8c + 8) in its high.
 *
 * Activations are quantized per block of BS as llama.cpp does: q = round(x / dx) in
 * [-127, 127], dx = max |x| / 127, and s = dx sum(q) (the offset's share: with it a symmetric
 * type's offset cancels exactly). Then per block sum(w x) ~ d dx sum(u q) + m s.
 */
#ifndef TETHER_QUANT_H
#define TETHER_QUANT_H
#include <stdint.h>

#define QG 16   /* rows per group */
#define QU 32   /* rows per unit (NB of cpu_kernels.h) */
#define QMR 8   /* at most this many activation rows per kernel call */

enum { TL_Q4 = 3, TL_Q8 = 4, TL_Q8_16 = 5 }; /* tl_weights.type, after cpu_kernels.h's */

/* Activations [M] rows quantized per block of bs: q [M][ldq] (ldq = padded K),
 * dx and s [M][lds] (lds = ldq / bs). With q2 (else NULL) each block is two terms,
 * x ~ dx (256 q + q2), q2 the rounding error of the first term quantized again: about 15 bits
 * where one term holds 8, for twice the vpdpbusd (tl_weights.two_term_rows says at how many
 * rows; cpu.py: TWO_TERM_ROWS). */
typedef struct {
  const int8_t* q;
  const int8_t* q2;
  const float* dx;
  const float* s;
  int64_t ldq, lds;
  int64_t prefetch; /* bytes ahead of the record in use that the kernels prefetch */
} tl_qact;

/* out[r * ldo + i] (i < 32) = the sums of activation rows m0 + r (r < mr <= QMR) with the
 * 32 weight rows of one unit (its two groups of nb records each). */
typedef void (*tl_unit_fn)(const tl_qact* a, int64_t m0, int mr, const uint8_t* unit,
                           int64_t nb, float* out, int64_t ldo);

typedef struct {
  const char* name;
  tl_unit_fn q4, q8, q8_16;
} tl_quant_tier;

/* Weak: cpu.py leaves out a tier its compiler cannot build. */
extern const tl_quant_tier tl_tier_avx512 __attribute__((weak));
extern const tl_quant_tier tl_tier_avxvnni __attribute__((weak));
extern const tl_quant_tier tl_tier_avx2 __attribute__((weak));

/* A tier file's three kernels and its table, each kernel `ROWS2(type, two)`: the file's
 * dispatch to its tiles by row count, one- or two-term activations. */
#define TL_ENTRY(FN, TYPE)                                                                    \
  static void FN(const tl_qact* a, int64_t m0, int mr, const uint8_t* g, int64_t nb,         \
                 float* out, int64_t ldo) {                                                   \
    if (a->q2) {                                                                             \
      ROWS2(TYPE, 1)                                                                         \
    } else {                                                                                 \
      ROWS2(TYPE, 0)                                                                         \
    }                                                                                        \
  }
#define TL_DEFINE_TIER(SYMBOL, NAME)                               \
  TL_ENTRY(q4, TL_Q4)                                              \
  TL_ENTRY(q8, TL_Q8)                                              \
  TL_ENTRY(q8_16, TL_Q8_16)                                        \
  const tl_quant_tier SYMBOL = {NAME, q4, q8, q8_16};

static inline int64_t tl_block_size(int type) { return type == TL_Q8_16 ? 16 : 32; }

/* Bytes of one record: codes, then 16 d and 16 m as float16. */
static inline int64_t tl_record_bytes(int type) {
  int64_t bs = tl_block_size(type);
  return QG * bs / (type == TL_Q4 ? 2 : 1) + QG * 4;
}

#endif
