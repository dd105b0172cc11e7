/* The read floor of a decode token (loadtest/read_floor.py): each of its weights summed as
 * float32 vectors, in the order a token reads them, one OpenMP region a weight split between the
 * threads as the kernels split a linear. No products, no activations, no Python between the
 * weights: what a token's reads alone cost when they come a weight at a time.
 */
#include <stdint.h>
#include <omp.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static float sum_bytes(const char* p, int64_t n) {
  v16 a = {0}, b = {0}, c = {0}, d = {0};
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    v16 w, x, y, z;
    memcpy(&w, p + i, 64);
    memcpy(&x, p + i + 64, 64);
    memcpy(&y, p + i + 128, 64);
    memcpy(&z, p + i + 192, 64);
    a += w, b += x, c += y, d += z;
  }
  a += b + c + d;
  float s = 0.0f;
  for (int k = 0; k < 16; k++) s += a[k];
  for (; i < n; i++) s += (float)p[i];
  return s;
}

/* Reads weights[0..n) of bytes[i] each; the sum only keeps the reads from being dropped. */
float tl_read_floor(const void* const* weights, const int64_t* bytes, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const char* p = weights[i];
    int64_t size = bytes[i];
#pragma omp parallel reduction(+ : total)
    {
      int t = omp_get_thread_num(), threads = omp_get_num_threads();
      int64_t lo = size * t / threads / 256 * 256;
      int64_t hi = t + 1 == threads ? size : size * (t + 1) / threads / 256 * 256;
      total += sum_bytes(p + lo, hi - lo);
    }
  }
  return total;
}
