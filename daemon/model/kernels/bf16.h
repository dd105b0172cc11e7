/* bfloat16 weights with bfloat16 products (`--dtype bfloat16`, many rows): a block of 32 rows
 * is packed at load in pairs of inputs, P[K2][32][2] (cpu.py's pack; K2 padded to
 * cpu_kernels.h's PAIR_STEP), so that one 32-bit lane holds two inputs of one row: the operand
 * of AVX512_BF16's vdpbf16ps (2 products a lane, twice float32's FMA) and of AMX's tdpbf16ps,
 * read in place. bf16.c picks a tier at start (bf16_avx512.c, bf16_amx.c) and sends the calls
 * of enough rows to it; fewer rows, or a CPU with neither, keep cpu_kernels.c's walk (float32
 * products of the same pairs, each half a float32 after a shift or a mask).
 */
#ifndef TETHER_BF16_H
#define TETHER_BF16_H
#include <stdint.h>

/* out[r * 32 + i] = sums of activation rows r < mr (bf16, x[r * ldx + 2 kp + {0, 1}]) with
 * the block's 32 rows, over k2 pairs of inputs; mr <= the tier's rows (the AMX tier reads all
 * of its 16 rows: x must hold them). Step kp also prefetches lines 2 kp and 2 kp + 1 at pf
 * into L2, those below `lines` (a share of the next block: cpu_kernels.c's walks do the same). */
typedef void (*tl_bf16_fn)(const uint16_t* x, int64_t ldx, int mr, const uint16_t* pairs,
                           int64_t k2, float* out, const char* pf, int64_t lines);

typedef struct {
  const char* name;
  tl_bf16_fn tile;
  int rows;     /* activation rows per call */
  int k2_step;  /* pairs of inputs the tier walks at a time: PAIR_STEP must be a multiple */
  int (*init)(void); /* per thread, before its first call; 0 when it cannot run */
} tl_bf16_tier;

/* Weak: cpu.py leaves out a tier its compiler cannot build. */
extern const tl_bf16_tier tl_bf16_avx512 __attribute__((weak));
extern const tl_bf16_tier tl_bf16_amx __attribute__((weak));

#endif
