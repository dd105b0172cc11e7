/* Decode attention over the paged KV cache, read where it lies. Built into one library with
 * cpu_kernels.c (cpu.py).
 */
#include "cpu_kernels.h"

INLINE float hsum(fvec v) {
  float t[VL], out = 0.0f;
  memcpy(t, &v, sizeof t);
  for (int i = 0; i < VL; i++) out += t[i];
  return out;
}

/* One (sequence, KV head) of decode attention; head_dim = VL * nv. q holds the G query heads
 * sharing the KV head, out their outputs. Keys and values are read once each, block by block
 * from the block table, with an online softmax: no gathered or padded copy. Keys before
 * `first` (a sliding window's start; 0 without one) are not read. */
INLINE void decode_one(const float* q, const void* k_cache, const void* v_cache, int type,
                       const int64_t* table, int64_t len, int64_t first, int64_t G, int64_t nv,
                       int64_t KVH, int64_t g, int64_t bs, float scale, float* out) {
  int64_t d = nv * VL, esize = type == TL_F32 ? 4 : 2;
  fvec qv[G * nv], acc[G * nv];
  float mx[G], sum[G], p[G][(bs + 15) / 16 * 16];
  for (int64_t i = 0; i < G * nv; i++) {
    memcpy(&qv[i], q + i * VL, sizeof(fvec));
    qv[i] *= scale;
    acc[i] = splat(0.0f);
  }
  for (int64_t h = 0; h < G; h++) mx[h] = -INFINITY, sum[h] = 0.0f;
  for (int64_t start = first / bs * bs; start < len; start += bs) {
    int64_t nt = len - start < bs ? len - start : bs;
    int64_t lo = first > start ? first - start : 0; /* the window's first token in this block */
    int64_t base = (table[start / bs] * KVH + g) * bs * d; /* this head's [bs, d] tile */
    /* Tiles lie in scattered pages, where the hardware prefetcher starts cold: fetch the
     * next tile's lines while this one is worked on, a token's worth per token. */
    const char* next_k = NULL;
    const char* next_v = NULL;
    if (start + bs < len) {
      int64_t next = (table[start / bs + 1] * KVH + g) * bs * d * esize;
      next_k = (const char*)k_cache + next;
      next_v = (const char*)v_cache + next;
    }
    for (int64_t t = 0; t < lo; t++)
      for (int64_t h = 0; h < G; h++) p[h][t] = -INFINITY;
    for (int64_t t = lo; t < nt; t++) {
      if (next_k)
        for (int64_t off = t * d * esize; off < (t + 1) * d * esize; off += 64) {
          __builtin_prefetch(next_k + off, 0, 2);
          __builtin_prefetch(next_v + off, 0, 2);
        }
      fvec kv[nv];
      for (int64_t j = 0; j < nv; j++) kv[j] = loadv(k_cache, base + t * d + j * VL, type);
      for (int64_t h = 0; h < G; h++) {
        fvec dot = qv[h * nv] * kv[0];
        for (int64_t j = 1; j < nv; j++) dot += qv[h * nv + j] * kv[j];
        p[h][t] = hsum(dot);
      }
    }
    for (int64_t h = 0; h < G; h++) {
      float bm = mx[h];
      for (int64_t t = 0; t < nt; t++) bm = p[h][t] > bm ? p[h][t] : bm;
      float corr = expf(mx[h] - bm);
      mx[h] = bm;
      for (int64_t t0 = 0; t0 < nt; t0 += VL) { /* p rows are padded to 16 >= VL */
        fvec sv;
        memcpy(&sv, &p[h][t0], sizeof sv);
        sv = vexp(sv - bm);
        memcpy(&p[h][t0], &sv, sizeof sv);
      }
      for (int64_t t = 0; t < lo; t++) p[h][t] = 0.0f; /* vexp clamps: exp(-inf) is not 0 */
      float block_sum = 0.0f;
      for (int64_t t = 0; t < nt; t++) block_sum += p[h][t];
      sum[h] = sum[h] * corr + block_sum;
      for (int64_t j = 0; j < nv; j++) acc[h * nv + j] *= corr;
    }
    for (int64_t t = lo; t < nt; t++) {
      fvec vv[nv];
      for (int64_t j = 0; j < nv; j++) vv[j] = loadv(v_cache, base + t * d + j * VL, type);
      for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < nv; j++) acc[h * nv + j] += vv[j] * p[h][t];
    }
  }
  for (int64_t h = 0; h < G; h++) {
    fvec inv = splat(1.0f / sum[h]);
    for (int64_t j = 0; j < nv; j++) {
      fvec o = acc[h * nv + j] * inv;
      memcpy(out + h * d + j * VL, &o, sizeof o);
    }
  }
}

/* Decode attention, one query token per sequence. q [D, H, d] (row stride ldq); caches
 * [blocks, KVH, bs, d] of `type`; block_tables [D, max_blocks]; out [D, H, d]; d % VL == 0
 * (the caller checks d % 16, the widest VL). window > 0: each query sees only the last
 * `window` keys. */
void tl_decode_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                         int type, const int64_t* block_tables, int64_t max_blocks,
                         const int64_t* context_lens, int64_t D, int64_t H, int64_t KVH,
                         int64_t d, int64_t bs, float scale, int64_t window, float* out) {
  int64_t G = H / KVH;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < D * KVH; item++) {
    int64_t s = item / KVH, g = item % KVH, len = context_lens[s];
    int64_t first = window > 0 && len > window ? len - window : 0;
    const float* qg = q + s * ldq + g * G * d;
    float* og = out + (s * H + g * G) * d;
    const int64_t* table = block_tables + s * max_blocks;
    if (type == TL_F32)
      decode_one(qg, k_cache, v_cache, TL_F32, table, len, first, G, d / VL, KVH, g, bs, scale,
                 og);
    else
      decode_one(qg, k_cache, v_cache, TL_BF16, table, len, first, G, d / VL, KVH, g, bs, scale,
                 og);
  }
}
