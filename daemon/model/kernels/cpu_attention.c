/* Decode attention over the paged KV cache, read where it lies. Built into one library with
 * cpu_kernels.c (cpu.py).
 */
#include <omp.h>

#include "cpu_kernels.h"

/* The largest of v's lanes (take_max), else their sum. */
INLINE float lanes(fvec v, int take_max) {
#if defined(__AVX512F__)
  __m512 r;
  memcpy(&r, &v, sizeof r);
  return take_max ? _mm512_reduce_max_ps(r) : _mm512_reduce_add_ps(r);
#else
  float out = take_max ? v[0] : 0.0f;
  for (int i = take_max; i < VL; i++) out = take_max ? (v[i] > out ? v[i] : out) : out + v[i];
  return out;
#endif
}

/* out[i] = the sum of v[i]'s lanes, i < VL: a tree that halves the vectors at each level, each
 * sum carrying the lanes of two (9 instructions for 8 sums on AVX2, 45 for 16 on AVX-512), where
 * one sum at a time took a store and VL dependent scalar adds each. */
INLINE void hsums(const fvec v[VL], float* out) {
#if defined(__AVX512F__)
  __m512 r[16], s[8], t[4], u[2];
  memcpy(r, v, sizeof r);
  for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i]'s and v[2i+1]'s partials, alternating */
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                         _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[4i .. 4i+3]'s partials */
    __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++) /* 128-bit lanes: v[8i .. 8i+3] twice, then v[8i+4 .. 8i+7] twice */
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                      _mm512_shuffle_f32x4(u[0], u[1], 0xdd)));
#elif defined(__AVX2__)
  __m256 r[8];
  memcpy(r, v, sizeof r);
  __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                                      _mm256_permute2f128_ps(b0, b1, 0x31)));
#else
  for (int i = 0; i < VL; i++) {
    out[i] = 0.0f;
    for (int j = 0; j < VL; j++) out[i] += v[i][j];
  }
#endif
}

/* p[h][t] = q_h . k_t for the tile's tokens [0, nt), VL at a time (rows of p padded to 16).
 * Two tokens at a time, each head a chain of FMAs over the head's vectors: 2 G chains in
 * flight, where one dot at a time waited on its own chain (G is a constant where decode_one
 * is called, so the chains are registers). */
INLINE void tile_scores(const fvec* qv, const void* k_cache, int type, int64_t base, int64_t nt,
                        int64_t G, int64_t nv, int64_t pw, const char* const next[2],
                        float* p) {
  int64_t d = nv * VL, row = d * (type == TL_F32 ? 4 : 2);
  for (int64_t t0 = 0; t0 < nt; t0 += VL) {
    fvec dots[G][VL];
    for (int i = 0; i < VL; i += 2) {
      const int64_t ta = t0 + i, tb = ta + 1 < nt ? ta + 1 : ta; /* tb: past the end, again ta */
      fvec da[G], db[G];
      for (int64_t h = 0; h < G; h++) da[h] = db[h] = splat(0.0f);
      if (next[0]) /* the next tile's keys and values, two tokens' worth per two tokens */
        for (int64_t off = ta * row; off < (ta + 2) * row; off += 64) {
          __builtin_prefetch(next[0] + off, 0, 2);
          __builtin_prefetch(next[1] + off, 0, 2);
        }
      if (ta < nt)
        for (int64_t j = 0; j < nv; j++) {
          fvec ka = loadv(k_cache, base + ta * d + j * VL, type);
          fvec kb = loadv(k_cache, base + tb * d + j * VL, type);
          for (int64_t h = 0; h < G; h++) {
            da[h] += qv[h * nv + j] * ka;
            db[h] += qv[h * nv + j] * kb;
          }
        }
      for (int64_t h = 0; h < G; h++) dots[h][i] = da[h], dots[h][i + 1] = db[h];
    }
    for (int64_t h = 0; h < G; h++) hsums(dots[h], p + h * pw + t0);
  }
}

/* acc[h] += sum over t in [lo, nt) of p[h][t] v_t, two vectors of the head at a time: their
 * 2 G accumulators stay in registers over the tile's tokens. */
INLINE void tile_values(const void* v_cache, int type, int64_t base, int64_t lo, int64_t nt,
                        int64_t G, int64_t nv, int64_t pw, const float* p, fvec* acc) {
  int64_t d = nv * VL;
  for (int64_t j = 0; j < nv; j += 2) {
    int64_t j1 = j + 1 < nv ? j + 1 : j; /* an odd last vector: summed twice, kept once */
    fvec a0[G], a1[G];
    for (int64_t h = 0; h < G; h++) a0[h] = acc[h * nv + j], a1[h] = acc[h * nv + j1];
    for (int64_t t = lo; t < nt; t++) {
      fvec v0 = loadv(v_cache, base + t * d + j * VL, type);
      fvec v1 = loadv(v_cache, base + t * d + j1 * VL, type);
      for (int64_t h = 0; h < G; h++) {
        fvec pt = splat(p[h * pw + t]);
        a0[h] += v0 * pt;
        a1[h] += v1 * pt;
      }
    }
    for (int64_t h = 0; h < G; h++) acc[h * nv + j1] = a1[h], acc[h * nv + j] = a0[h];
  }
}

/* One (sequence, KV head) of decode attention over the keys [from, len); head_dim = VL * nv.
 * q holds the G query heads sharing the KV head. Keys and values are read once each, block by
 * block from the block table, with an online softmax: no gathered or padded copy. Keys before
 * `first` (a sliding window's start; 0 without one) take no part; `from` is a block's first
 * key or at most `first`. Without ml, out gets the G outputs; with it, a part of the keys'
 * unnormalised sums (out [G][d]) and each head's running max and sum (ml [2][G]) for
 * merge_parts. */
INLINE void decode_one(const float* q, const void* k_cache, const void* v_cache, int type,
                       const int64_t* table, int64_t from, int64_t len, int64_t first,
                       int64_t G, int64_t nv, int64_t KVH, int64_t g, int64_t bs, float scale,
                       float* out, float* ml) {
  int64_t d = nv * VL, esize = type == TL_F32 ? 4 : 2, pw = (bs + 15) / 16 * 16;
  fvec qv[G * nv], acc[G * nv];
  float mx[G], sum[G], p[G * pw];
  for (int64_t i = 0; i < G * nv; i++) {
    memcpy(&qv[i], q + i * VL, sizeof(fvec));
    qv[i] *= scale;
    acc[i] = splat(0.0f);
  }
  for (int64_t h = 0; h < G; h++) mx[h] = -INFINITY, sum[h] = 0.0f;
  if (from < first) from = first;
  for (int64_t start = from / bs * bs; start < len; start += bs) {
    int64_t nt = len - start < bs ? len - start : bs;
    int64_t lo = first > start ? first - start : 0; /* the window's first token in this block */
    int64_t base = (table[start / bs] * KVH + g) * bs * d; /* this head's [bs, d] tile */
    /* Tiles lie in scattered pages, where the hardware prefetcher starts cold: fetch the
     * next tile's lines while this one is worked on (tile_scores). */
    const char* next[2] = {NULL, NULL};
    if (start + bs < len) {
      int64_t at = (table[start / bs + 1] * KVH + g) * bs * d * esize;
      next[0] = (const char*)k_cache + at;
      next[1] = (const char*)v_cache + at;
    }
    tile_scores(qv, k_cache, type, base, nt, G, nv, pw, next, p);
    for (int64_t h = 0; h < G; h++) { /* the online softmax, VL scores at a time */
      float* ph = p + h * pw;
      for (int64_t t = 0; t < lo; t++) ph[t] = -INFINITY;
      for (int64_t t = nt; t < pw; t++) ph[t] = -INFINITY; /* padding */
      fvec m = splat(mx[h]), sv, total = splat(0.0f);
      for (int64_t t0 = 0; t0 < pw; t0 += VL) {
        memcpy(&sv, &ph[t0], sizeof sv);
        m = vmax(m, sv);
      }
      float bm = lanes(m, 1), corr = expf(mx[h] - bm);
      mx[h] = bm;
      /* vexp clamps: a lane at -inf gives exp(-87), ~1.6e-38, not 0. Against a sum of at
       * least 1 (the lane at the running max gives 1) that is below float's resolution, and
       * tile_values reads only the lanes in [lo, nt). */
      for (int64_t t0 = 0; t0 < pw; t0 += VL) {
        memcpy(&sv, &ph[t0], sizeof sv);
        sv = vexp(sv - bm);
        memcpy(&ph[t0], &sv, sizeof sv);
        total += sv;
      }
      sum[h] = sum[h] * corr + lanes(total, 0);
      for (int64_t j = 0; j < nv; j++) acc[h * nv + j] *= corr;
    }
    tile_values(v_cache, type, base, lo, nt, G, nv, pw, p, acc);
  }
  if (ml) {
    memcpy(out, acc, sizeof(fvec) * G * nv);
    memcpy(ml, mx, sizeof(float) * G);
    memcpy(ml + G, sum, sizeof(float) * G);
    return;
  }
  for (int64_t h = 0; h < G; h++) {
    fvec inv = splat(1.0f / sum[h]);
    for (int64_t j = 0; j < nv; j++) {
      fvec o = acc[h * nv + j] * inv;
      memcpy(out + h * d + j * VL, &o, sizeof o);
    }
  }
}

/* decode_one with G a constant for the common group sizes, so tile_values' accumulators
 * are registers. */
#define DECODE(GC) decode_one(qg, k_cache, v_cache, TYPE, table, from, to, first, GC, nv, KVH, \
                              g, bs, scale, og, ml)
#define GROUPS                                 \
  switch (G) {                                 \
    case 1: DECODE(1); break;                  \
    case 2: DECODE(2); break;                  \
    case 3: DECODE(3); break;                  \
    case 4: DECODE(4); break;                  \
    case 8: DECODE(8); break;                  \
    default: DECODE(G);                        \
  }

/* Long contexts over few (sequence, KV head) items: with fewer items than threads, or a
 * few more, some threads idle while the others read whole contexts (at one stream, 3 KV heads
 * on 2 threads). Such items are split into parts of at least PART_BLOCKS blocks, to about
 * PART_ITEMS work items a thread; each part's sums are merged after (merge_parts). */
#define PART_BLOCKS 4
#define PART_ITEMS 8

/* How many parts each item is cut into (1: none, as on one thread), from the longest
 * context. */
static int64_t decode_parts(int64_t items, const int64_t* context_lens, int64_t D, int64_t bs) {
  int64_t threads = omp_get_max_threads(), want = PART_ITEMS * threads;
  if (threads == 1 || items >= want) return 1;
  int64_t longest = 0;
  for (int64_t s = 0; s < D; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
  int64_t parts = (want + items - 1) / items, most = (longest + bs - 1) / bs / PART_BLOCKS;
  return parts < most ? parts : most > 1 ? most : 1;
}

/* The keys [*from, *to) of part p of parts of a context of len keys from `first`: whole
 * blocks, at least PART_BLOCKS of them; an empty range past the context's end. */
static void part_range(int64_t p, int64_t parts, int64_t len, int64_t first, int64_t bs,
                       int64_t* from, int64_t* to) {
  int64_t b0 = first / bs, blocks = (len + bs - 1) / bs - b0;
  int64_t per = (blocks + parts - 1) / parts;
  per = per < PART_BLOCKS ? PART_BLOCKS : per;
  int64_t lo = (b0 + p * per) * bs, hi = lo + per * bs;
  *from = lo < len ? lo : len;
  *to = hi < len ? hi : len;
}

/* out [G][d] of one item from its parts' records, `stride` floats apart: a part's sums
 * [G][d], then its max and sum per head [2][G] (a sum of 0: an empty part). Each part's share
 * is rescaled to the largest max. */
static void merge_parts(const float* part, int64_t parts, int64_t stride, int64_t G, int64_t d,
                        float* out) {
  for (int64_t h = 0; h < G; h++) {
    float m = -INFINITY, total = 0.0f, *o = out + h * d;
    for (int64_t p = 0; p < parts; p++) {
      const float* ml = part + p * stride + G * d;
      if (ml[G + h] > 0.0f && ml[h] > m) m = ml[h];
    }
    for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
      const float *sums = part + p * stride + h * d, *ml = part + p * stride + G * d;
      if (!(ml[G + h] > 0.0f)) continue;
      float w = expf(ml[h] - m);
      total += w * ml[G + h];
      for (int64_t i = 0; i < d; i++) o[i] += w * sums[i];
    }
    float inv = 1.0f / total;
    for (int64_t i = 0; i < d; i++) o[i] *= inv;
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
  int64_t G = H / KVH, nv = d / VL, items = D * KVH;
  int64_t parts = decode_parts(items, context_lens, D, bs);
  /* With parts: each work item's sums [G][d], then its max and sum [2][G]. */
  int64_t stride = G * (d + 2);
  float* scratch = parts > 1 ? malloc(sizeof(float) * items * parts * stride) : NULL;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t w = 0; w < items * parts; w++) {
    int64_t item = w / parts, s = item / KVH, g = item % KVH, len = context_lens[s];
    int64_t first = window > 0 && len > window ? len - window : 0, from = 0, to = len;
    const float* qg = q + s * ldq + g * G * d;
    float *og = out + (s * H + g * G) * d, *ml = NULL;
    const int64_t* table = block_tables + s * max_blocks;
    if (scratch) {
      part_range(w % parts, parts, len, first, bs, &from, &to);
      og = scratch + w * stride;
      ml = og + G * d;
      if (from >= to) { /* past the context: an empty part */
        for (int64_t h = 0; h < G; h++) ml[G + h] = 0.0f;
        continue;
      }
    }
    if (type == TL_F32) {
#define TYPE TL_F32
      GROUPS
#undef TYPE
    } else {
#define TYPE TL_BF16
      GROUPS
#undef TYPE
    }
  }
  if (!scratch) return;
  for (int64_t item = 0; item < items; item++)
    merge_parts(scratch + item * parts * stride, parts, stride, G, d,
                out + ((item / KVH) * H + (item % KVH) * G) * d);
  free(scratch);
}
#undef GROUPS
#undef DECODE
