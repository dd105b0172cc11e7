/* A decoder layer around its attention, for the CPU kernels: RMSNorm, per-head q/k norms and
 * RoPE, then a whole layer's calls (attention in, attention out and MLP, a layer of decodes in
 * one call). The matrix products are cpu_kernels.c's (tl_linear_add), which sends quantized and
 * bf16 weights on to their own files; built and loaded with it by cpu.py. cpu_forward.c calls
 * tl_layer_decode for each layer of a decode-only batch.
 */
#include "cpu_layer.h"

/* ---- RMSNorm and RoPE -------------------------------------------------------------------- */

/* y = w * (x / sqrt(mean(x^2) + eps)) over one row of K, as the reference implementation
 * orders it; y may be x. */
INLINE void norm_row(const float* x, int64_t K, const float* w, float eps, float* y) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < K; k++) ss += x[k] * x[k];
  float r = 1.0f / sqrtf(ss / (float)K + eps);
#pragma omp simd
  for (int64_t k = 0; k < K; k++) y[k] = w[k] * (x[k] * r);
}

static void rmsnorm(const float* x, int64_t M, int64_t K, const float* w, float eps, float* y) {
  TL_ROWS(m, M, { norm_row(x + m * K, K, w, eps, y + m * K); });
}

/* In place: each of the `heads` heads of d values in each row of x [T, ldx] (Qwen3's and
 * Gemma 3's q/k norms). */
static void head_norms(float* x, int64_t T, int64_t ldx, int64_t heads, int64_t d,
                       const float* w, float eps) {
  TL_ROWS(t, T, {
    for (int64_t h = 0; h < heads; h++) {
      float* head = x + t * ldx + h * d;
      norm_row(head, d, w, eps, head);
    }
  });
}

/* In place, rotate-half layout: the first `heads` heads of each row of x [T, ldx], head_dim d;
 * cos/sin [T, d/2]. */
static void rope(float* x, int64_t T, int64_t ldx, int64_t heads, int64_t d, const float* cos_,
             const float* sin_) {
  int64_t half = d / 2;
  TL_ROWS(t, T, {
    const float* c = cos_ + t * half;
    const float* s = sin_ + t * half;
    for (int64_t h = 0; h < heads; h++) {
      float* x1 = x + t * ldx + h * d;
      float* x2 = x1 + half;
      _Pragma("omp simd")
      for (int64_t i = 0; i < half; i++) {
        float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  });
}

void tl_rmsnorm(const float* x, int64_t M, int64_t K, const float* w, float eps, float* y) {
  rmsnorm(x, M, K, w, eps, y);
}

/* ---- a decoder layer around its attention ----------------------------------------------- */

/* qkv [M, (H + 2 KVH) d] = rope(norm(x) Wqkv^T), the q and k heads normed first when the layer
 * has q/k norms, no rope when cos_ is NULL (a layer without RoPE); K and V rows then go to the
 * cache rows write_rows[t * KVH + head] (cache viewed as [-1, d], of cache_type). */
void tl_layer_attn_in(const tl_layer* L, const float* x, int64_t M, const float* cos_,
                      const float* sin_, const int64_t* write_rows, void* k_cache,
                      void* v_cache, int cache_type, float* qkv) {
  int64_t H = L->heads, KVH = L->kv_heads, d = L->head_dim, width = (H + 2 * KVH) * d;
  float* h = malloc(sizeof(float) * M * L->hidden);
  rmsnorm(x, M, L->hidden, L->input_norm, L->eps, h);
  tl_linear_add(h, L->hidden, M, &L->qkv, qkv, width, 0, NULL, 0);
  free(h);
  if (L->q_norm) head_norms(qkv, M, width, H, d, L->q_norm, L->eps);
  if (L->k_norm) head_norms(qkv + H * d, M, width, KVH, d, L->k_norm, L->eps);
  if (cos_) rope(qkv, M, width, H + KVH, d, cos_, sin_);
  for (int64_t t = 0; t < M; t++)
    for (int64_t j = 0; j < KVH; j++) {
      const float* k = qkv + t * width + (H + j) * d;
      const float* v = k + KVH * d;
      int64_t row = write_rows[t * KVH + j] * d;
      if (cache_type == TL_F32) {
        memcpy((float*)k_cache + row, k, sizeof(float) * d);
        memcpy((float*)v_cache + row, v, sizeof(float) * d);
      } else {
        for (int64_t i = 0; i < d; i++) {
          ((uint16_t*)k_cache)[row + i] = to_bf16(k[i]);
          ((uint16_t*)v_cache)[row + i] = to_bf16(v[i]);
        }
      }
    }
}

/* x [M, hidden] += in [M, W->n_in] W^T, normed by `norm` first unless it is NULL. */
static void branch_add(const float* in, int64_t M, const tl_weights* W, const float* norm,
                       float eps, float* x) {
  int64_t hidden = W->n_out;
  if (!norm) {
    tl_linear_add(in, W->n_in, M, W, x, hidden, 1, x, hidden);
    return;
  }
  float* out = malloc(sizeof(float) * M * hidden);
  tl_linear_add(in, W->n_in, M, W, out, hidden, 0, NULL, 0);
  rmsnorm(out, M, hidden, norm, eps, out);
  for (int64_t i = 0; i < M * hidden; i++) x[i] += out[i];
  free(out);
}

/* x [M, hidden] in place: x += attn Wo^T; x += down(act(gate) * up) of norm(x); each branch's
 * output normed first where the layer has those norms. */
void tl_layer_attn_out_mlp(const tl_layer* L, float* x, int64_t M, const float* attn) {
  int64_t hidden = L->hidden, inter = L->gate_up.n_out;
  branch_add(attn, M, &L->o, L->attn_out_norm, L->eps, x);
  float* h = malloc(sizeof(float) * M * hidden);
  float* act = malloc(sizeof(float) * M * inter);
  rmsnorm(x, M, hidden, L->post_attention_norm, L->eps, h);
  tl_linear_add(h, hidden, M, &L->gate_up, act, inter, 0, NULL, 0);
  branch_add(act, M, &L->down, L->mlp_out_norm, L->eps, x);
  free(h);
  free(act);
}

/* A layer of decodes only (one token a sequence, the batch's rows in order), in one call:
 * tl_layer_attn_in, decode attention over the paged cache into attn [M, H d], then
 * tl_layer_attn_out_mlp. At one stream the Python and ctypes between three calls a layer
 * were ~10% of a token. */
void tl_layer_decode(const tl_layer* L, float* x, int64_t M, const float* cos_,
                     const float* sin_, const int64_t* write_rows, void* k_cache, void* v_cache,
                     int cache_type, const int64_t* tables, int64_t max_blocks,
                     const int64_t* lens, int64_t block_size, float scale, int64_t window,
                     float* qkv, float* attn) {
  int64_t H = L->heads, KVH = L->kv_heads, d = L->head_dim;
  tl_layer_attn_in(L, x, M, cos_, sin_, write_rows, k_cache, v_cache, cache_type, qkv);
  tl_decode_attention(qkv, (H + 2 * KVH) * d, k_cache, v_cache, cache_type, tables, max_blocks,
                      lens, M, H, KVH, d, block_size, scale, window, attn);
  tl_layer_attn_out_mlp(L, x, M, attn);
}
