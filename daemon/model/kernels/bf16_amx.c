/* bfloat16 products on AMX tiles (bf16.h), UNTESTED: written for CPUs with AMX-BF16 (Intel
 * Sapphire Rapids and later), which the machine this was written on lacks, so it has never
 * run. Kept small and fenced: the tier is chosen only when CPUID reports amx_tile and
 * amx_bf16 and the kernel grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, which Linux
 * asks for before a process may touch it); else bf16.c uses AVX512_BF16 or the float32 walk.
 *
 * One call: 16 activation rows x the block's 32 rows, 16 pairs of inputs (32 bf16) a step:
 * A = 16 rows x 64 bytes of x, B0 / B1 = 16 pairs x the block's rows 0-15 / 16-31 (64 bytes
 * of each 128-byte pair row), C0 / C1 += A B. */
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static void tile16(const uint16_t* x, int64_t ldx, int mr, const uint16_t* pairs, int64_t k2,
                   float* out, const char* pf, int64_t lines) {
  (void)mr, (void)pf, (void)lines; /* x holds 16 rows; the sums of rows past mr are left unread */
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kp = 0; kp < k2; kp += 16) {
    _tile_loadd(2, x + 2 * kp, ldx * 2);
    _tile_loadd(3, pairs + kp * 64, 128);
    _tile_loadd(4, pairs + kp * 64 + 32, 128);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, out, 128);
  _tile_stored(1, out + 16, 128);
}

/* The tile state, asked of the kernel once per process, configured once per thread. */
static int ready(void) {
  static int granted = -1;
  static __thread int configured;
  if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  if (granted && !configured) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    configured = 1;
  }
  return granted;
}

const tl_bf16_tier tl_bf16_amx = {"amx-bf16", tile16, 16, 16, ready};
