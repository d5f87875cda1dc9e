/* bf16 linear layers on Intel AMX tiles (AMX-TILE + AMX-BF16): out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Why: at decode batch sizes oneDNN's packed bf16 matmul streams the weights at ~10-14 GB/s on this CPU; the
 * loop below reaches ~17-20 GB/s over a whole SmolLM2 step and ~35-42 GB/s on the LM head, and matches oneDNN
 * at prefill sizes (measured, see pagedllm/layers/packed_linear.py). Instruction semantics: Intel Architecture
 * Instruction Set Extensions Programming Reference, ch. 3 (TILELOADD, TDPBF16PS, LDTILECFG).
 *
 * Packed layout (amx_pack): N is cut into groups of 32 output columns (two 16-column tiles), K into blocks of 32.
 * For group g and K block kb, 2 KB are stored contiguously: for tile j in {0, 1}, a 16 x 32 bf16 "B" tile in the
 * pair-interleaved (VNNI) form TDPBF16PS reads: P[g][kb][j][r][2c + p] = W[32 g + 16 j + c][32 kb + 2 r + p].
 * One group's K blocks follow each other, so each thread streams its weights sequentially.
 *
 * Compute: rows of x are taken ROW_CHUNK at a time (so that chunk stays in L2 while every weight group passes by);
 * the threads split the groups. Per group, rows in blocks of 32 (two "A" tiles of 16 rows); four fp32 accumulator
 * tiles (2 row tiles x 2 column tiles), summed over K in fp32 by TDPBF16PS, then + bias (fp32) and one rounding to
 * bf16 (round to nearest even). Tiles: 0-3 accumulators, 4-5 x rows, 6-7 weights. Measured on this CPU (a VM):
 * TDPBF16PS ~15 ns and a 16-row tile load ~10 ns whatever the row count, and they don't overlap, so small batches
 * cost about the same as one row and the weight stream sets the speed.
 * Requires N % 32 == 0 and K % 32 == 0 (the caller checks).
 *
 * Gated MLPs (gate_up_proj, W = [gate; up], each I rows): packed with each group's two tiles holding 16 gate rows
 * and the 16 matching up rows (amx_linear_bf16 mode 1 writes them back as [gate | up]; mode 2 writes
 * silu(gate) * up [M, I] directly, with the roundings of the unfused path: gate and up to bf16, silu(gate) to bf16,
 * the product to bf16, so the result equals gate_up -> silu_mul bit for bit).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../../attention/csrc/simd.h" /* silu16, round16_bf16, store16_bf16_bits: as in csrc/cpu_ops.c silu_mul */
#include "amx.h"

#define PREFETCH_BLOCKS 8 /* weight K blocks (2 KB each) prefetched ahead of the one being multiplied */
#define ROW_CHUNK 256     /* rows of x per pass over the weights: 256 x K bf16 stays in L2 (K <= 4096) */

int amx_supported(void) { return amx_request_tiles(); }

/* W [N, K] bf16 row-major -> P (N * K bf16) in the layout above. */
void amx_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *P) {
    const int64_t KB = K / 32, G = N / 32;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *dst = P + (g * KB + kb) * 1024;
            for (int j = 0; j < 2; j++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        const uint16_t *src = W + (32 * g + 16 * j + c) * K + 32 * kb + 2 * r;
                        dst[(j * 16 + r) * 32 + 2 * c] = src[0];
                        dst[(j * 16 + r) * 32 + 2 * c + 1] = src[1];
                    }
        }
}

/* Loads a tile configuration for row tiles of m0 and m1 rows (m1 = 0: one row tile in use). */
static inline void config_tiles(int m0, int m1) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(m1 ? m1 : 1);
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
}

/* rows x 16 fp32 (row stride 16) + bias -> bf16 out (row stride ldo). */
static inline void store_rows(const float *acc, int rows, const float *bias, uint16_t *out, int64_t ldo) {
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + 16 * r), b);
        _mm256_storeu_si256((__m256i *)(out + r * ldo), store16_bf16_bits(v));
    }
}

/* The 16 x 16 results of one group's two column tiles (acc0, acc1; fp32, row stride 16) for `rows` rows. */
static inline void emit(const float *acc0, const float *acc1, int rows, const float *b0, const float *b1,
                        void *outv, int64_t N, int64_t g, int mode) {
    uint16_t *out = (uint16_t *)outv;
    if (mode == 3) { /* plain layout, float32 out (the fp32 sums + bias, not rounded; e.g. logits) */
        const __m512 bv0 = b0 ? _mm512_loadu_ps(b0) : _mm512_setzero_ps();
        const __m512 bv1 = b1 ? _mm512_loadu_ps(b1) : _mm512_setzero_ps();
        float *of = (float *)out + 32 * g;
        for (int r = 0; r < rows; r++) {
            _mm512_storeu_ps(of + r * N, _mm512_add_ps(_mm512_load_ps(acc0 + 16 * r), bv0));
            _mm512_storeu_ps(of + r * N + 16, _mm512_add_ps(_mm512_load_ps(acc1 + 16 * r), bv1));
        }
    } else if (mode == 0) { /* plain: the group's 32 consecutive columns */
        store_rows(acc0, rows, b0, out + 32 * g, N);
        store_rows(acc1, rows, b1, out + 32 * g + 16, N);
    } else if (mode == 1) { /* gated layout, [gate | up] */
        store_rows(acc0, rows, b0, out + 16 * g, N);
        store_rows(acc1, rows, b1, out + N / 2 + 16 * g, N);
    } else { /* gated layout, silu(gate) * up into [M, N / 2] */
        const __m512 bg = b0 ? _mm512_loadu_ps(b0) : _mm512_setzero_ps();
        const __m512 bu = b1 ? _mm512_loadu_ps(b1) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 gv = round16_bf16(_mm512_add_ps(_mm512_load_ps(acc0 + 16 * r), bg));
            const __m512 uv = round16_bf16(_mm512_add_ps(_mm512_load_ps(acc1 + 16 * r), bu));
            const __m512 s = round16_bf16(silu16(gv));
            _mm256_storeu_si256((__m256i *)(out + r * (N / 2) + 16 * g), store16_bf16_bits(_mm512_mul_ps(s, uv)));
        }
    }
}

/* x [M, K] bf16 (row stride K), P packed by amx_pack, bias [N] fp32 (in packed row order) or NULL -> out bf16:
 * mode 0: [M, N]; mode 1 (gated packing): [M, N] as [gate | up]; mode 2 (gated packing): silu(gate) * up [M, N/2];
 * mode 3: [M, N] float32 (`out` points to float32 memory). */
void amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                     void *out, int mode) {
    const int64_t KB = K / 32, G = N / 32;
    const int64_t ldo = mode == 2 ? N / 2 : N;     /* output row stride, elements */
    const int64_t esz = mode == 3 ? 4 : 2;          /* output element size, bytes */
#pragma omp parallel
    {
        float acc[2][16 * 16] __attribute__((aligned(64)));
        int cur0 = -1, cur1 = -1;
        for (int64_t mc = 0; mc < M; mc += ROW_CHUNK) {
            const int64_t mend = M - mc > ROW_CHUNK ? mc + ROW_CHUNK : M;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < G; g++) {
                const uint16_t *pg = P + g * KB * 1024;
                const int64_t n0 = 32 * g;
                const float *b0 = bias ? bias + n0 : NULL, *b1 = bias ? bias + n0 + 16 : NULL;
                for (int64_t mb = mc; mb < mend; mb += 32) {
                    const int64_t left = mend - mb;
                    const int m0 = left > 16 ? 16 : (int)left;
                    const int m1 = left > 32 ? 16 : (left > 16 ? (int)(left - 16) : 0);
                    if (m0 != cur0 || m1 != cur1) { /* only at the first and the last row block */
                        config_tiles(m0, m1);
                        cur0 = m0;
                        cur1 = m1;
                    }
                    const uint16_t *xb = x + mb * K;
                    _tile_zero(0);
                    _tile_zero(1);
                    if (m1) {
                        _tile_zero(2);
                        _tile_zero(3);
                    }
                    for (int64_t kb = 0; kb < KB; kb++) {
                        const uint16_t *pb = pg + kb * 1024;
                        if (mb == mc) /* the first row block brings the weights in; later ones find them in L1/L2 */
                            for (int l = 0; l < 32; l++)
                                _mm_prefetch((const char *)(pb + PREFETCH_BLOCKS * 1024) + 64 * l, _MM_HINT_T0);
                        _tile_loadd(4, xb + 32 * kb, K * 2);
                        _tile_loadd(6, pb, 64);
                        _tile_loadd(7, pb + 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (m1) {
                            _tile_loadd(5, xb + 16 * K + 32 * kb, K * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, acc[0], 64);
                    _tile_stored(1, acc[1], 64);
                    char *ob = (char *)out + mb * ldo * esz;
                    emit(acc[0], acc[1], m0, b0, b1, ob, N, g, mode);
                    if (m1) {
                        _tile_stored(2, acc[0], 64);
                        _tile_stored(3, acc[1], 64);
                        emit(acc[0], acc[1], m1, b0, b1, ob + 16 * ldo * esz, N, g, mode);
                    }
                }
            }
        }
        if (cur0 >= 0) _tile_release();
    }
}
