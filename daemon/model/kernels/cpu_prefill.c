/* Prefill attention over the paged KV cache: a chunk's queries over every key it sees (the
 * cached prefix and its own, causal, inside a sliding window where the model has one), read
 * where they lie. Built into one library with cpu_kernels.c (cpu.py).
 *
 * One work item is a KV head and a tile of the chunk's queries: the G query heads sharing the
 * KV head times QT tokens make R rows, held transposed ([d][R]: the rows are the vector lanes).
 * Scores, the online softmax and the output then all run lane-wise over rows: a key tile's
 * scores S^T[t][r] and the output O^T[j][r] are register-blocked FMAs of a broadcast key or
 * value element into row vectors, and a row's running max and sum are vectors too, where
 * rows-as-lanes needs no horizontal reduction. Torch's CPU flash kernel, which this replaces
 * for the kernels' models, ran the SmolLM2 chunks at 40-80 GFLOP/s on one thread and skips no
 * masked key of a causal chunk shorter than its key split.
 */
#include "cpu_kernels.h"

#define KT 16 /* keys a tile: scores [KT][R] */
#define KG 8  /* keys (scores) or head elements (output) a microkernel holds at a time */
#define RW 3  /* row vectors a microkernel holds at a time: KG x RW accumulators */
#define HIDDEN (-1e30f) /* a row's max before it has seen a key: finite, so exp(m - m') works */

/* st[t][r] = sum_j kf[t][j] qt[j][r] for the KT keys, rows [rv, rv + W) vectors. */
INLINE void scores(const float* kf, const float* qt, int64_t d, int64_t R, int64_t rv,
                   const int W, float* st) {
  for (int t0 = 0; t0 < KT; t0 += KG) {
    fvec acc[KG][RW];
    for (int t = 0; t < KG; t++)
      for (int w = 0; w < W; w++) acc[t][w] = splat(0.0f);
    for (int64_t j = 0; j < d; j++) {
      fvec q[RW];
      for (int w = 0; w < W; w++) memcpy(&q[w], qt + j * R + (rv + w) * VL, sizeof(fvec));
      for (int t = 0; t < KG; t++) {
        fvec k = splat(kf[(t0 + t) * d + j]);
        for (int w = 0; w < W; w++) acc[t][w] += k * q[w];
      }
    }
    for (int t = 0; t < KG; t++)
      for (int w = 0; w < W; w++) memcpy(st + (t0 + t) * R + (rv + w) * VL, &acc[t][w], sizeof(fvec));
  }
}

/* ot[j][r] = ot[j][r] corr[r] + sum_t vf[t][j] p[t][r], rows [rv, rv + W) vectors. */
INLINE void values(const float* vf, const float* p, const float* corr, int64_t d, int64_t R,
                   int64_t rv, const int W, float* ot) {
  fvec c[RW];
  for (int w = 0; w < W; w++) memcpy(&c[w], corr + (rv + w) * VL, sizeof(fvec));
  for (int64_t j0 = 0; j0 < d; j0 += KG) {
    fvec acc[KG][RW];
    for (int j = 0; j < KG; j++)
      for (int w = 0; w < W; w++) {
        memcpy(&acc[j][w], ot + (j0 + j) * R + (rv + w) * VL, sizeof(fvec));
        acc[j][w] *= c[w];
      }
    for (int t = 0; t < KT; t++) {
      fvec pt[RW];
      for (int w = 0; w < W; w++) memcpy(&pt[w], p + t * R + (rv + w) * VL, sizeof(fvec));
      for (int j = 0; j < KG; j++) {
        fvec v = splat(vf[t * d + j0 + j]);
        for (int w = 0; w < W; w++) acc[j][w] += v * pt[w];
      }
    }
    for (int j = 0; j < KG; j++)
      for (int w = 0; w < W; w++) memcpy(ot + (j0 + j) * R + (rv + w) * VL, &acc[j][w], sizeof(fvec));
  }
}

/* A row group of W vectors at a time, W a constant in each call (the accumulators registers). */
#define BY_GROUPS(CALL)                                  \
  for (int64_t rv = 0; rv < RV; rv += RW) {              \
    switch (RV - rv < RW ? RV - rv : RW) {               \
      case 1: CALL(1); break;                            \
      case 2: CALL(2); break;                            \
      default: CALL(RW); break;                          \
    }                                                    \
  }

/* Keys [k0, k0 + nt) of one KV head into kf / vf as float32 ([KT][d], rows past nt zero). */
static void load_tile(const void* cache, int type, const int64_t* block_ids, int64_t KVH,
                      int64_t g, int64_t bs, int64_t d, int64_t k0, int64_t nt, float* out) {
  int64_t base = ((block_ids[k0 / bs] * KVH + g) * bs + k0 % bs) * d;
  for (int64_t i = 0; i < nt * d; i += VL) {
    fvec v = loadv(cache, base + i, type);
    memcpy(out + i, &v, sizeof v);
  }
  memset(out + nt * d, 0, sizeof(float) * (KT - nt) * d);
}

/* One item: query tokens [i0, i0 + qt) of the chunk (positions p0 + i), KV head g. */
static void item(const float* q, int64_t ldq, int64_t i0, int64_t qt, int64_t p0,
                 const void* k_cache, const void* v_cache, int type, const int64_t* block_ids,
                 int64_t H, int64_t KVH, int64_t g, int64_t d, int64_t bs, float scale,
                 int64_t window, float* out, int64_t R, float* work) {
  const int64_t G = H / KVH, RV = R / VL;
  float *qt_ = work, *ot = qt_ + d * R, *st = ot + d * R, *kf = st + KT * R, *vf = kf + KT * d;
  float *m = vf + KT * d, *l = m + R, *corr = l + R, *pos = corr + R;
  for (int64_t r = 0; r < R; r++) { /* rows past the tile's: zero queries at its last token */
    int64_t i = r / G < qt ? r / G : qt - 1, h = g * G + r % G;
    for (int64_t j = 0; j < d; j++)
      qt_[j * R + r] = r / G < qt ? q[(i0 + i) * ldq + h * d + j] * scale : 0.0f;
    pos[r] = (float)(p0 + i0 + i);
    m[r] = HIDDEN, l[r] = 0.0f;
  }
  memset(ot, 0, sizeof(float) * d * R);
  const int64_t first = p0 + i0, last = p0 + i0 + qt - 1; /* the tile's positions */
  int64_t lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
  for (int64_t k0 = lo; k0 <= last;) {
    int64_t nt = bs - k0 % bs, left = last + 1 - k0;
    nt = nt < KT ? nt : KT;
    nt = nt < left ? nt : left;
    load_tile(k_cache, type, block_ids, KVH, g, bs, d, k0, nt, kf);
    load_tile(v_cache, type, block_ids, KVH, g, bs, d, k0, nt, vf);
#define SCORES(W) scores(kf, qt_, d, R, rv, W, st)
    BY_GROUPS(SCORES)
#undef SCORES
    /* Keys a row cannot see: past its position (the causal diagonal), before its window, or
     * past the tile's keys. Only tiles that hold one pay the compare. */
    int masked = nt < KT || k0 + nt - 1 > first || (window > 0 && k0 <= last - window);
    for (int64_t rv = 0; rv < RV; rv++) {
      fvec mx, pr, sum = splat(0.0f), s[KT];
      memcpy(&mx, m + rv * VL, sizeof mx);
      memcpy(&pr, pos + rv * VL, sizeof pr);
      fvec m_old = mx;
      ivec seen[KT];
      for (int t = 0; t < KT; t++) {
        memcpy(&s[t], st + t * R + rv * VL, sizeof(fvec));
        if (masked) {
          fvec key = splat((float)(k0 + t));
          seen[t] = (key <= pr) & (t < nt ? -1 : 0);
          if (window > 0) seen[t] &= key > pr - (float)window;
          ivec bits;
          memcpy(&bits, &s[t], sizeof bits);
          bits = (bits & seen[t]) | (~seen[t] & (ivec)splat(HIDDEN));
          memcpy(&s[t], &bits, sizeof bits);
        }
        mx = vmax(mx, s[t]);
      }
      for (int t = 0; t < KT; t++) {
        fvec p = vexp(s[t] - mx);
        if (masked) {
          ivec bits;
          memcpy(&bits, &p, sizeof bits);
          bits &= seen[t];
          memcpy(&p, &bits, sizeof bits);
        }
        sum += p;
        memcpy(st + t * R + rv * VL, &p, sizeof p);
      }
      fvec c = vexp(m_old - mx), lv;
      memcpy(&lv, l + rv * VL, sizeof lv);
      lv = lv * c + sum;
      memcpy(l + rv * VL, &lv, sizeof lv);
      memcpy(m + rv * VL, &mx, sizeof mx);
      memcpy(corr + rv * VL, &c, sizeof c);
    }
#define VALUES(W) values(vf, st, corr, d, R, rv, W, ot)
    BY_GROUPS(VALUES)
#undef VALUES
    k0 += nt;
  }
  for (int64_t r = 0; r < G * qt; r++) {
    float inv = 1.0f / l[r];
    float* o = out + ((i0 + r / G) * H + g * G + r % G) * d;
    for (int64_t j = 0; j < d; j++) o[j] = ot[j * R + r] * inv;
  }
}

/* Prefill attention of one chunk of M tokens, the last M of context_len in the cache (which
 * holds the chunk's keys and values already). q [M, H, d] (token stride ldq, head stride d);
 * caches [blocks, KVH, bs, d] of `type`; block_ids [ceil(context_len / bs)]; out [M, H, d];
 * d % 16 == 0. Query i sees keys [0, p0 + i] (p0 = context_len - M), only the last `window`
 * of them when window > 0. */
void tl_prefill_attention(const float* q, int64_t ldq, int64_t M, const void* k_cache,
                          const void* v_cache, int type, const int64_t* block_ids,
                          int64_t context_len, int64_t H, int64_t KVH, int64_t d, int64_t bs,
                          float scale, int64_t window, float* out) {
  const int64_t G = H / KVH, p0 = context_len - M;
  int64_t QT = RW * VL / G > 1 ? RW * VL / G : 1, R = (QT * G + VL - 1) / VL * VL;
  int64_t tiles = (M + QT - 1) / QT;
  size_t floats = 2 * d * R + KT * R + 2 * KT * d + 4 * R;
#pragma omp parallel
  {
    float* work = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    /* The last tiles see the most keys: they go first, the short ones fill in behind. */
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles * KVH; it++) {
      int64_t tile = tiles - 1 - it / KVH, g = it % KVH, i0 = tile * QT;
      item(q, ldq, i0, M - i0 < QT ? M - i0 : QT, p0, k_cache, v_cache, type, block_ids, H, KVH,
           g, d, bs, scale, window, out, R, work);
    }
    free(work);
  }
}
