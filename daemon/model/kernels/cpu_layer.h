/* A decoder layer's weights and the calls cpu_layer.c makes of them, for cpu_layer.c and for
 * cpu_forward.c (which runs every layer of a decode-only batch in one call).
 */
#ifndef TETHER_CPU_LAYER_H
#define TETHER_CPU_LAYER_H
#include "cpu_kernels.h"

/* One layer's weights; mirrored by ctypes in cpu.py. The norms are the factors the normalised
 * values are multiplied by (Gemma's 1 + w included). q_norm and k_norm (per head), attn_out_norm
 * and mlp_out_norm (of the branch outputs, before the residual add) are NULL when absent. */
typedef struct {
  int64_t hidden, heads, kv_heads, head_dim;
  float eps;
  const float* input_norm;
  const float* post_attention_norm;
  const float* q_norm;
  const float* k_norm;
  const float* attn_out_norm;
  const float* mlp_out_norm;
  tl_weights qkv, o, gate_up, down;
} tl_layer;

void tl_layer_decode(const tl_layer* L, float* x, int64_t M, const float* cos_,
                     const float* sin_, const int64_t* write_rows, void* k_cache, void* v_cache,
                     int cache_type, const int64_t* tables, int64_t max_blocks,
                     const int64_t* lens, int64_t block_size, float scale, int64_t window,
                     float* qkv, float* attn);

#endif
