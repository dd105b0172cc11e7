/* What the CPU kernels share (linear.c, cpu_kernels.c, cpu_layer.c, cpu_attention.c, quant.c,
 * bf16.c): the machine's vector types, the element types and modes Python passes (mirrored in
 * cpu.py), the entries each file gives the others, and small vector helpers (vec.h).
 */
#ifndef TETHER_CPU_KERNELS_H
#define TETHER_CPU_KERNELS_H
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

/* Vectors of the machine's own width: GCC lowers a wider generic vector badly (through the
 * stack, lane by lane, for AVX2). Up to MT rows of activations (batch 1's weight streaming)
 * walk whole blocks, MT rows times NV vectors per block row of accumulators, sized to the
 * register file (32 zmm / 16 ymm). Up to CM rows walk each block in chunks of KC k
 * (cpu_kernels.c: block_rows) with tiles of up to HT rows times TV vectors, or of WR rows
 * times the whole block while there are at most WM rows; more rows, HT x TV over all of K. */
#if defined(__AVX512F__)
#define VL 16
#define MT 8
#elif defined(__AVX2__)
#define VL 8
#define MT 2
/* 6 rows x 2 vectors: 12 accumulators, each weight load feeding 6 FMAs (a whole block's 4
 * vectors x 2 rows load 128 B of weights per k for 8 FMAs). Up to 8 rows, 3 x 4 vectors: 2 + 2
 * passes of 4 rows x 2 vectors over each chunk kept too few FMAs in flight (8 accumulators
 * against 2 pipes of 4 cycles' latency). */
#define HT 6
#define TV 2
#define WR 3
#define WM 8
#else
#define VL 4
#define MT 2
#endif
#if !defined(HT)
#define HT MT /* no half-block tiles: whole blocks of MT rows */
#define TV NV
#define WR 1
#define WM 0 /* no whole-block tier */
#endif
#define KC 128 /* k per chunk: 16 KB of fp32 weights, in L1 while every row group walks it */
#define CM 16  /* at most this many rows walk a block chunk by chunk (block_rows) */
typedef float fvec __attribute__((vector_size(VL * 4)));
typedef int32_t ivec __attribute__((vector_size(VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2)));

enum { TL_F32 = 0, TL_BF16 = 1 }; /* quantized weights: quant.h's TL_Q4 and on */
enum { TL_STORE = 0, TL_ADD = 1, TL_SILU_MUL = 2, TL_GELU_TANH_MUL = 3 };
#define NB 32       /* output rows per packed block */
#define NV (NB / VL) /* vectors per packed block row */
#define INLINE static inline __attribute__((always_inline))
/* bfloat16 weights are packed in pairs of inputs, [K2][32][2] a block (bf16.h): K2, the pairs
 * of n_in, is padded to a multiple of PAIR_STEP (the widest tier's step) with zero inputs. */
#define PAIR_STEP 16
INLINE int64_t tl_pairs(int64_t K) { return ((K + 1) / 2 + PAIR_STEP - 1) / PAIR_STEP * PAIR_STEP; }
/* Bytes of one packed block of float32 or bfloat16 weights. */
INLINE int64_t tl_block_bytes(int type, int64_t K) {
  return type == TL_F32 ? K * NB * 4 : tl_pairs(K) * 2 * NB * 2;
}

/* A packed weight (daemon/model/kernels/cpu.py: pack; quantized types: quant.h): `blocks`
 * blocks of 32 rows of n_in, n_out rows in use. scale (an output multiplier per row) and bias
 * are in packed row order, or NULL. mode TL_STORE, or TL_SILU_MUL / TL_GELU_TANH_MUL (each block holds 16 gate rows then
 * their 16 up rows; the output is act(gate) * up, n_out columns). Quantized types: calls of at
 * most two_term_rows rows take their activations in two terms (quant.h). Mirrored by ctypes in
 * cpu.py: keep the two in step. */
typedef struct {
  const void* w;
  const float* scale;
  const float* bias;
  int64_t blocks, n_in, n_out;
  int32_t type, mode;
  int64_t two_term_rows;
} tl_weights;

/* The quantized linears (quant.c), the bf16 products (bf16.c: 0 when it leaves the call to
 * cpu_kernels.c), and the pieces of cpu_kernels.c they share: the fp32 walk over one block of
 * 32 rows, and the scale / bias / mode step of a tile's sums [mt][32] (mt <= QMR). */
/* The rows a call counts as when it picks a path by its row count: M, or the step's sequences
 * while a step of drafted chunks runs (tl_quant_set_step_rows), so that a chunk of drafts takes
 * the path of the one row it stands for (quant.c). */
int64_t tl_counted_rows(int64_t M);
void tl_quant_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                     int64_t ldy, int mode, const float* res, int64_t ldr);
int tl_bf16_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                   int64_t ldy, int mode, const float* res, int64_t ldr);
void tl_walk_f32(const float* x, int64_t ldx, int64_t M, const tl_weights* W, int64_t b,
                 const float* wb, float* y, int64_t ldy, int mode, const float* res,
                 int64_t ldr);
void tl_emit(const tl_weights* W, int64_t b, const float* sums, int64_t mt, float* y,
             int64_t ldy, int mode, const float* res, int64_t ldr);

/* linear.c's product y = x W^T, or y = res + x W^T with add, any weight type (cpu_layer.c's
 * layers call it); cpu_kernels.c's for float32 and bfloat16 weights, `mode` as tl_emit's. */
void tl_linear_add(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                   int64_t ldy, int add, const float* res, int64_t ldr);
void tl_float_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                     int64_t ldy, int mode, const float* res, int64_t ldr);

/* cpu_attention.c's decode attention (a decode-only layer calls it from cpu_layer.c). */
void tl_decode_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                         int type, const int64_t* block_tables, int64_t max_blocks,
                         const int64_t* context_lens, int64_t D, int64_t H, int64_t KVH,
                         int64_t d, int64_t bs, float scale, int64_t window, float* out);

#include "vec.h"

#endif
