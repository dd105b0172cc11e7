/* Every layer of a decode-only batch in one call: the layer stack of a decode tick, where a
 * call a layer from Python (cpu_modules.py) cost ~15 us a layer, ~0.4 ms of a ~3.7 ms token
 * of the 30-layer SmolLM2 at one stream. What differs between the layers is in one step each;
 * what the batch shares (its rows, block tables, context lengths) is passed once.
 */
#include "cpu_layer.h"

/* One layer's step of the stack; mirrored by ctypes in cpu.py. rope indexes the cos/sin
 * tables of the call (a model has one per distinct RoPE), -1 for a layer without RoPE. */
typedef struct {
  const tl_layer* layer;
  void* k_cache;
  void* v_cache;
  int64_t rope;
  float scale;
  int64_t window;
} tl_decode_step;

/* x [M, hidden] in place through steps[0..n): each a tl_layer_decode over the paged cache;
 * qkv and attn are its scratch rows, reused layer after layer. */
void tl_forward_decode(const tl_decode_step* steps, int64_t n, float* x, int64_t M,
                       const float* const* cos_, const float* const* sin_,
                       const int64_t* write_rows, int cache_type, const int64_t* tables,
                       int64_t max_blocks, const int64_t* lens, int64_t block_size, float* qkv,
                       float* attn) {
  for (int64_t i = 0; i < n; i++) {
    const tl_decode_step* s = steps + i;
    const float* c = s->rope >= 0 ? cos_[s->rope] : NULL;
    const float* si = s->rope >= 0 ? sin_[s->rope] : NULL;
    tl_layer_decode(s->layer, x, M, c, si, write_rows, s->k_cache, s->v_cache, cache_type,
                    tables, max_blocks, lens, block_size, s->scale, s->window, qkv, attn);
  }
}
