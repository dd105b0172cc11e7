/* CPU kernels for tether's forward pass: a weight-streaming matrix product, with the variants
 * some model families need (GELU-tanh and the other gate modes); RMSNorm, RoPE and a layer's
 * calls are cpu_layer.c's, decode attention over the paged KV cache cpu_attention.c's.
 *
 * Why hand-written: at batch 1 a decode tick is one read of every weight, so the matrix product
 * must stream weights at the memory's speed. Measured on the project's machine, MKL's fp32 GEMV
 * reaches under half of it and oneDNN's prepacked path little more; torch.compile's generated
 * code gets closer but costs about a minute of compilation on a cold cache. Weights here are
 * packed once into blocks of 32 output rows laid out [N/32][K][32] (bfloat16 ones in pairs of
 * inputs, [N/32][K/2][32][2], as bf16.h's products read them too), so each thread reads one
 * contiguous stream and needs no horizontal sums.
 *
 * Built at daemon start by daemon/model/kernels/cpu.py (gcc -O3 -march=native -fopenmp, cached by a
 * hash of this file and the CPU) and loaded after torch, so its OpenMP regions run on torch's
 * own libgomp thread pool and follow torch.set_num_threads.
 *
 * Activations are float32 throughout; weights are float32 or bfloat16 here, quantized ones
 * in quant.c; the KV cache is float32 or bfloat16.
 */
#include "cpu_kernels.h"

/* ---- linear: y = x W^T (+ bias), W packed [N/32][K][32] ---------------------------------- */

/* Rows [0, mt) of a block over all of K; step k < lines also prefetches line k at pf into L2
 * (a slice of the next block, for the walks of more than CM rows). */
INLINE void tile(const float* x, int64_t ldx, int mt, int64_t K, const void* w, int type,
                 const char* pf, int64_t lines, fvec acc[][NV]) {
  for (int m = 0; m < MT; m++)
    for (int j = 0; j < NV; j++) acc[m][j] = splat(0.0f);
  for (int64_t k = 0; k < K; k++) {
    if (k < lines) __builtin_prefetch(pf + k * 64, 0, 2);
    fvec wv[NV];
    for (int j = 0; j < NV; j++) wv[j] = loadw(w, k, j * VL, type);
    for (int m = 0; m < mt; m++) {
      fvec xv = splat(x[m * ldx + k]);
      for (int j = 0; j < NV; j++) acc[m][j] += wv[j] * xv;
    }
  }
}

/* The same sums as `tile` (same order over k), TV vectors of the block at a time. */
INLINE void half_tile(const float* x, int64_t ldx, int mt, int64_t K, const void* w, int type,
                      const char* pf, int64_t lines, fvec acc[][NV]) {
  for (int h = 0; h < NV; h += TV) {
    fvec a[HT][TV];
    for (int m = 0; m < mt; m++)
      for (int j = 0; j < TV; j++) a[m][j] = splat(0.0f);
    for (int64_t k = 0; k < K; k++) {
      if (h == 0 && k < lines) __builtin_prefetch(pf + k * 64, 0, 2);
      fvec wv[TV];
      for (int j = 0; j < TV; j++) wv[j] = loadw(w, k, (h + j) * VL, type);
      for (int m = 0; m < mt; m++) {
        fvec xv = splat(x[m * ldx + k]);
        for (int j = 0; j < TV; j++) a[m][j] += wv[j] * xv;
      }
    }
    for (int m = 0; m < mt; m++)
      for (int j = 0; j < TV; j++) acc[m][h + j] = a[m][j];
  }
}

/* Part of a block's sums: acc[m][h, h + tv) += x[m][k] w[k] over k in [k0, k1), in `tile`'s
 * order over k. Step k also prefetches lines [(k - k0) per_k, (k - k0 + 1) per_k) of the
 * `lines` at pf (a slice of the next chunk, or of the next block: blocks lie back to back). */
INLINE void part_tile(const float* x, int64_t ldx, int mt, int64_t k0, int64_t k1, const void* w,
                      int type, int h, int tv, const char* pf, int64_t lines, int64_t per_k,
                      fvec acc[][NV]) {
  fvec a[HT][NV];
  for (int m = 0; m < mt; m++)
    for (int j = 0; j < tv; j++) a[m][j] = acc[m][h + j];
  for (int64_t k = k0; k < k1; k++) {
    for (int64_t l = (k - k0) * per_k; l < lines && l < (k - k0 + 1) * per_k; l++)
      __builtin_prefetch(pf + l * 64, 0, 2);
    fvec wv[NV];
    for (int j = 0; j < tv; j++) wv[j] = loadw(w, k, (h + j) * VL, type);
    for (int m = 0; m < mt; m++) {
      fvec xv = splat(x[m * ldx + k]);
      for (int j = 0; j < tv; j++) a[m][j] += wv[j] * xv;
    }
  }
  for (int m = 0; m < mt; m++)
    for (int j = 0; j < tv; j++) acc[m][h + j] = a[m][j];
}

/* Constant row count and type per call, so each case compiles to a fully unrolled tile. */
#define TILE_TYPES(FN, ROWS)                                          \
  if (type == TL_F32) FN(x, ldx, ROWS, K, w, TL_F32, pf, lines, acc); \
  else FN(x, ldx, ROWS, K, w, TL_BF16, pf, lines, acc);               \
  return;

INLINE void tile_any(const float* x, int64_t ldx, int mt, int64_t K, const void* w, int type,
                     const char* pf, int64_t lines, fvec acc[][NV]) {
  switch (mt) {
#if MT >= 8
    case 8: TILE_TYPES(tile, 8)
    case 7: TILE_TYPES(tile, 7)
    case 6: TILE_TYPES(tile, 6)
    case 5: TILE_TYPES(tile, 5)
    case 4: TILE_TYPES(tile, 4)
    case 3: TILE_TYPES(tile, 3)
#endif
    case 2: TILE_TYPES(tile, 2)
    default: TILE_TYPES(tile, 1)
  }
}

INLINE void half_tile_any(const float* x, int64_t ldx, int mt, int64_t K, const void* w,
                          int type, const char* pf, int64_t lines, fvec acc[][NV]) {
  switch (mt) {
#if HT >= 6
    case 6: TILE_TYPES(half_tile, 6)
    case 5: TILE_TYPES(half_tile, 5)
    case 4: TILE_TYPES(half_tile, 4)
    case 3: TILE_TYPES(half_tile, 3)
#endif
    case 2: TILE_TYPES(half_tile, 2)
    default: TILE_TYPES(half_tile, 1)
  }
}

#define PART(ROWS, TVV, TYPE) \
  part_tile(x, ldx, ROWS, k0, k1, w, TYPE, h, TVV, pf, lines, per_k, acc)
#define PART_TYPES(ROWS, TVV)                  \
  if (type == TL_F32) PART(ROWS, TVV, TL_F32); \
  else PART(ROWS, TVV, TL_BF16);               \
  return;

INLINE void part_tile_any(const float* x, int64_t ldx, int mt, int64_t k0, int64_t k1,
                          const void* w, int type, int h, int tv, const char* pf, int64_t lines,
                          int64_t per_k, fvec acc[][NV]) {
#if WM > 0
  if (tv == NV) switch (mt) { /* whole-block tiles of WR = 3 rows */
    case 3: PART_TYPES(3, NV)
    case 2: PART_TYPES(2, NV)
    default: PART_TYPES(1, NV)
  }
#else
  (void)tv; /* TV == NV */
#endif
  switch (mt) {
#if HT >= 8
    case 8: PART_TYPES(8, TV)
    case 7: PART_TYPES(7, TV)
#endif
#if HT >= 6
    case 6: PART_TYPES(6, TV)
    case 5: PART_TYPES(5, TV)
    case 4: PART_TYPES(4, TV)
    case 3: PART_TYPES(3, TV)
#endif
    case 2: PART_TYPES(2, TV)
    default: PART_TYPES(1, TV)
  }
}
#undef PART_TYPES
#undef PART
#undef TILE_TYPES

/* The walks of more than CM rows, kept out of line: inlined beside block_rows' tiles, GCC
 * compiled them 5-10% slower (64 and 512 rows, the same kernels alternating in one process). */
static __attribute__((noinline)) void big_tile(const float* x, int64_t ldx, int mt, int64_t K,
                                               const void* w, int type, const char* pf,
                                               int64_t lines, fvec acc[][NV]) {
  half_tile_any(x, ldx, mt, K, w, type, pf, lines, acc);
}

/* y[0, n) = the first n floats of v's nv vectors, plus res[0, n) unless res is NULL. All nv
 * vectors go straight to y; fewer floats (a weight's last block) go through a buffer, whose
 * loop GCC makes a call to memcpy with every vector register spilled around it. */
INLINE void store_vectors(float* y, int64_t n, const fvec* v, int nv, const float* res) {
  if (n == (int64_t)nv * VL) {
    for (int j = 0; j < nv; j++) {
      fvec o = v[j];
      if (res) o += loadv(res, j * VL, TL_F32);
      memcpy(y + j * VL, &o, sizeof o);
    }
    return;
  }
  float tmp[NB];
  memcpy(tmp, v, sizeof(fvec) * nv);
  for (int64_t i = 0; i < n; i++) y[i] = (res ? res[i] : 0.0f) + tmp[i];
}

/* Rows [0, mr) of one block, in groups of at most HT rows (WR while mr <= WM), balanced (8 rows
 * are 3 + 3 + 2, 16 are 6 + 5 + 5), each walking the block KC k at a time: a chunk's weights
 * come from memory once and stay in L1 for every group and vector pair, and each pass over a
 * chunk prefetches its share of the next, so that memory streams while the FMAs run. Walking
 * the whole block group after group (the block from L2 after the first) left memory idle
 * during the later walks: 8 rows cost 2x one row's tick, for ~13 ms of FMAs in a ~28 ms tick. */
INLINE void block_rows(const float* x, int64_t ldx, int mr, int64_t K, const char* wb, int type,
                       fvec acc[][NV]) {
  int64_t row = NB * (type == TL_F32 ? 4 : 2);
  int wide = mr <= WM, ht = wide ? WR : HT, tv = wide ? NV : TV;
  int groups = (mr + ht - 1) / ht, passes = groups * (NV / tv);
  int64_t lines = (KC * row / 64 + passes - 1) / passes; /* of the next chunk, per pass */
  for (int m = 0; m < mr; m++)
    for (int j = 0; j < NV; j++) acc[m][j] = splat(0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    int64_t k1 = K - k0 < KC ? K : k0 + KC;
    int64_t per_k = (lines + (k1 - k0) - 1) / (k1 - k0);
    for (int g = 0, m = 0, p = 0; g < groups; g++) {
      int mt = mr / groups + (g < mr % groups);
      for (int h = 0; h < NV; h += tv, p++)
        part_tile_any(x + m * ldx, ldx, mt, k0, k1, wb, type, h, tv,
                      wb + (k0 + KC) * row + p * lines * 64, lines, per_k, acc + m);
      m += mt;
    }
  }
}

/* Rows [0, mt) of block b's sums, acc[m][0..32): scaled, biased and stored (or gated) into
 * the rows of y from y (with TL_ADD, res + the sums). */
INLINE void emit(const tl_weights* W, int64_t b, const fvec acc[][NV], int64_t mt, float* y,
                 int64_t ldy, int mode, const float* res, int64_t ldr) {
  const float *scale = W->scale, *bias = W->bias;
  int64_t n_out = W->n_out;
  fvec sc[NV], bi[NV];
  for (int j = 0; j < NV; j++) {
    sc[j] = scale ? loadv(scale, b * NB + j * VL, TL_F32) : splat(1.0f);
    bi[j] = bias ? loadv(bias, b * NB + j * VL, TL_F32) : splat(0.0f);
  }
  for (int64_t m = 0; m < mt; m++) {
    fvec v[NV];
    for (int j = 0; j < NV; j++) v[j] = acc[m][j] * sc[j] + bi[j];
    float* yrow = y + m * ldy;
    if (mode >= TL_SILU_MUL) { /* vectors [0, NV/2): gates; [NV/2, NV): their ups */
      fvec out[NV / 2];
      for (int j = 0; j < NV / 2; j++) out[j] = gate_act(v[j], mode) * v[j + NV / 2];
      int64_t n0 = b * (NB / 2);
      store_vectors(yrow + n0, n_out - n0 < NB / 2 ? n_out - n0 : NB / 2, out, NV / 2, NULL);
    } else {
      int64_t n0 = b * NB;
      store_vectors(yrow + n0, n_out - n0 < NB ? n_out - n0 : NB, v, NV,
                    mode == TL_ADD ? res + m * ldr + n0 : NULL);
    }
  }
}

/* Every row of block b (its weights at wb, of `type`) into y: up to MT rows stream the block
 * once in a whole-block tile (batch 1's weight-streaming path); up to CM, where memory and
 * FMAs take about as long, block_rows; more rows are compute-bound and walk the block HT rows
 * at a time, TV vectors at a time, each walk prefetching its share (`lines`) of the next. */
INLINE void walk_block(const float* x, int64_t ldx, int64_t M, const tl_weights* W, int64_t b,
                       const char* wb, int type, int64_t lines, float* y, int64_t ldy, int mode,
                       const float* res, int64_t ldr) {
  int64_t K = W->n_in;
  int rows = M <= MT ? MT : M <= CM ? CM : HT; /* rows per walk over a block */
  int64_t block = tl_block_bytes(type, K);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    int mt = M - m0 < rows ? (int)(M - m0) : rows;
    fvec acc[CM][NV];
    const char* pf = wb + block + m0 / rows * lines * 64;
    if (rows == CM) block_rows(x + m0 * ldx, ldx, mt, K, wb, type, acc);
    else if (rows > MT) big_tile(x + m0 * ldx, ldx, mt, K, wb, type, pf, lines, acc);
    else tile_any(x + m0 * ldx, ldx, mt, K, wb, type, pf, lines, acc); /* and HT == MT's */
    emit(W, b, acc, mt, y + m0 * ldy, ldy, mode, res + m0 * ldr, ldr);
  }
}

/* y [M, ldy] = x [M, n_in] (row stride ldx) W^T for float32 and bfloat16 weights, `mode` as
 * tl_emit takes it (TL_ADD: y = res + x W^T, res may be y); linear.c sends the other types on.
 * Walking more than CM rows chunk by chunk too was as fast at its best but slower at the median
 * on this shared machine. */
void tl_float_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                     int64_t ldy, int mode, const float* res, int64_t ldr) {
  int type = W->type;
  int64_t K = W->n_in, num_blocks = W->blocks;
  int rows = M <= MT ? MT : M <= CM ? CM : HT;
  int64_t block = tl_block_bytes(type, K);
  /* More than CM rows walk each block several times, bf16 blocks of at most MT rows once:
   * each walk prefetches its share of the next block's lines (at most one a k), so that the
   * next block's first walk finds it in L2 (bf16 once: 1.0-1.18x at 1-3 rows; the half of a
   * float32 block that one walk could cover gained nothing). */
  int64_t walks = (M + rows - 1) / rows, prefetch = M > CM || (M <= MT && type == TL_BF16);
  int64_t lines = prefetch ? (block / 64 + walks - 1) / walks : 0;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < num_blocks; b++)
    walk_block(x, ldx, M, W, b, (const char*)W->w + b * block, type, lines, y, ldy, mode, res,
               ldr);
}

void tl_walk_f32(const float* x, int64_t ldx, int64_t M, const tl_weights* W, int64_t b,
                 const float* wb, float* y, int64_t ldy, int mode, const float* res,
                 int64_t ldr) {
  walk_block(x, ldx, M, W, b, (const char*)wb, TL_F32, 0, y, ldy, mode, res, ldr);
}

void tl_emit(const tl_weights* W, int64_t b, const float* sums, int64_t mt, float* y,
             int64_t ldy, int mode, const float* res, int64_t ldr) {
  fvec acc[QMR][NV];
  for (int64_t m = 0; m < mt; m++) /* fixed-size copies: vector loads, not a memmove call */
    for (int j = 0; j < NV; j++) memcpy(&acc[m][j], sums + m * NB + j * VL, sizeof(fvec));
  emit(W, b, acc, mt, y, ldy, mode, res, ldr);
}
