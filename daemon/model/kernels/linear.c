/* The one entry of every linear the CPU kernels run, whatever its weights' type: quantized blocks
 * go to quant.c, bfloat16 ones of enough rows to bf16.c where the CPU has bf16 products, the
 * rest (float32, and bfloat16 below that) to cpu_kernels.c's walk. Kept apart from them so that
 * each of the three is called from here and none calls another back.
 */
#include "cpu_kernels.h"

/* y [M, ldy] = x [M, n_in] (row stride ldx) W^T; with add, y = res + x W^T (res may be y).
 * No rows (a prefill chunk whose logits nobody samples) is no work: the kernels' shares of a
 * block are counted per walk, and no rows make no walk. */
void tl_linear_add(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
                   int64_t ldy, int add, const float* res, int64_t ldr) {
  if (M <= 0) return;
  int mode = add ? TL_ADD : W->mode;
  if (W->type >= TL_Q4)
    tl_quant_linear(x, ldx, M, W, y, ldy, mode, res, ldr);
  else if (!(W->type == TL_BF16 && tl_bf16_linear(x, ldx, M, W, y, ldy, mode, res, ldr)))
    tl_float_linear(x, ldx, M, W, y, ldy, mode, res, ldr);
}

void tl_linear(const float* x, int64_t ldx, int64_t M, const tl_weights* W, float* y,
               int64_t ldy) {
  tl_linear_add(x, ldx, M, W, y, ldy, 0, NULL, 0);
}
