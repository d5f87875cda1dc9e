/* bf16 linear layers on Intel AMX tiles (AMX-TILE + AMX-BF16): out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Why: at decode batch sizes oneDNN's packed bf16 matmul streams the weights at ~10-14 GB/s on this CPU; the
 * loop below reaches ~17-20 GB/s over a whole SmolLM2 step and ~35-42 GB/s on the LM head; at prefill sizes it
 * matches oneDNN on a quiet host and beats it when one core is slowed (measured, see below and
 * pagedllm/layers/packed_linear.py). Instruction semantics: Intel Architecture
 * Instruction Set Extensions Programming Reference, ch. 3 (TILELOADD, TDPBF16PS, LDTILECFG).
 *
 * Packed layout (amx_pack): N is cut into groups of 32 output columns (two 16-column tiles), K into blocks of 32.
 * For group g and K block kb, 2 KB are stored contiguously: for tile j in {0, 1}, a 16 x 32 bf16 "B" tile in the
 * pair-interleaved (VNNI) form TDPBF16PS reads: P[g][kb][j][r][2c + p] = W[32 g + 16 j + c][32 kb + 2 r + p].
 * One group's K blocks follow each other, so each thread streams its weights sequentially.
 *
 * Compute: work units of (up to UNIT_WEIGHT_BYTES of weight groups) x (up to UNIT_ROWS rows of x), both held in L2,
 * taken dynamically by the threads; within a unit every row block runs through the unit's groups, so at prefill sizes
 * the weights come from memory once per row chunk and the row blocks from L1/L2 (measured at 2,048 rows over the four
 * SmolLM2 layer shapes, 2 threads, quiet host: 7.5 ms vs 9.8 ms for the previous order (threads splitting the
 * groups statically, 256 rows at a time) and 7.6-8.7 ms for oneDNN's packed matmul; with a competing process on one
 * core 8.3-10.9 ms vs 10.5-12.6 ms for oneDNN). Rows go in
 * blocks of 32 (two "A" tiles of 16 rows); four fp32 accumulator tiles (2 row tiles x 2 column tiles), summed over
 * K in fp32 by TDPBF16PS, then + bias (fp32) and one rounding to bf16 (round to nearest even). Tiles: 0-3
 * accumulators, 4-5 x rows, 6-7 weights. Measured on this CPU (a VM, one core, operands in L1): TDPBF16PS back to
 * back ~6.4 ns (2.5 TFLOP/s); with this 2 x 2 blocking's four tile loads per four products ~10.6 ns a product
 * (1.5 TFLOP/s), the ceiling of this loop. A tile costs the same at 1 or 16 rows, so at decode sizes the weight
 * stream sets the speed.
 * Requires N % 32 == 0 and K % 32 == 0 (the caller checks).
 *
 * Gated MLPs (gate_up_proj, W = [gate; up], each I rows): packed with each group's two tiles holding 16 gate rows
 * and the 16 matching up rows (amx_linear_bf16 mode 1 writes them back as [gate | up]; mode 2 writes
 * silu(gate) * up [M, I] directly, with the roundings of the unfused path: gate and up to bf16, silu(gate) to bf16,
 * the product to bf16, so the result equals gate_up -> silu_mul bit for bit).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h" /* silu16, round16_bf16, store16_bf16_bits: as in cpu_ops.c silu_mul */
#include "amx.h"
#include "pagedllm_kernels.h"

/* Weight K blocks (2 KB each) prefetched ahead of the one being multiplied, into L2 (T1): an L1 prefetch holds a line
 * fill buffer until its line arrives, and with ~16 of them per core the weight stream stalls once the products take
 * a while (decode batches of 16-64 rows). SmolLM2's four layer shapes x 30 layers, 2 threads (Xeon, AMX, medians of
 * interleaved runs): T0 -> T1 at 1 row 7.0-8.1 -> 6.9-7.3 ms, 16 rows 8.0-8.3 -> 7.6-8.1, 32 rows 9.0-9.5 ->
 * 8.6-8.7, 64 rows 15.3-15.8 -> 13.4-13.8; 2,048 rows unchanged; 4 to 12 blocks ahead measured the same. */
#define PREFETCH_BLOCKS 8
#define UNIT_WEIGHT_BYTES (288 * 1024) /* weights of one work unit (at most), bytes */
#define UNIT_ROWS 256                   /* rows of x of one work unit: 256 x K bf16 stays in L2 (K <= 2048) */

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
    amx_load_tilecfg(&cfg);
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

/* One output block: rows [mb, mb + 32) (fewer at the end: m0 + m1 rows) x group g's 32 columns, summed over all of K,
 * then emitted. `pf`: prefetch the weights ahead (the first pass over them). cur: the loaded tile configuration. */
static inline void out_block(const uint16_t *x, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                             void *out, int mode, int64_t mb, int64_t mend, int64_t g, int pf, int cur[2]) {
    const int64_t KB = K / 32;
    const int64_t ldo = mode == 2 ? N / 2 : N; /* output row stride, elements */
    const int64_t esz = mode == 3 ? 4 : 2;      /* output element size, bytes */
    const int64_t left = mend - mb;
    const int m0 = left > 16 ? 16 : (int)left;
    const int m1 = left > 32 ? 16 : (left > 16 ? (int)(left - 16) : 0);
    if (m0 != cur[0] || m1 != cur[1]) { /* only around a partial last row block */
        config_tiles(m0, m1);
        cur[0] = m0;
        cur[1] = m1;
    }
    const uint16_t *xb = x + mb * K, *xb1 = xb + 16 * K, *pg = P + g * KB * 1024;
    const float *b0 = bias ? bias + 32 * g : NULL, *b1 = bias ? bias + 32 * g + 16 : NULL;
    float acc[2][16 * 16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    if (m1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    /* Loads interleaved with the products that read them (tiles aren't renamed, so a load waits for the last product
     * reading its tile; this order lets the next loads overlap the products). */
    for (int64_t kb = 0; kb < KB; kb++) {
        const uint16_t *pb = pg + kb * 1024;
        if (pf)
            for (int l = 0; l < 32; l++)
                _mm_prefetch((const char *)(pb + PREFETCH_BLOCKS * 1024) + 64 * l, _MM_HINT_T1);
        _tile_loadd(4, xb + 32 * kb, K * 2);
        _tile_loadd(6, pb, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, pb + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (m1) {
            _tile_loadd(5, xb1 + 32 * kb, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    char *ob = (char *)out + mb * ldo * esz;
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    emit(acc[0], acc[1], m0, b0, b1, ob, N, g, mode);
    if (m1) {
        _tile_stored(2, acc[0], 64);
        _tile_stored(3, acc[1], 64);
        emit(acc[0], acc[1], m1, b0, b1, ob + 16 * ldo * esz, N, g, mode);
    }
}

/* x [M, K] bf16 (row stride K), P packed by amx_pack, bias [N] fp32 (in packed row order) or NULL -> out bf16:
 * mode 0: [M, N]; mode 1 (gated packing): [M, N] as [gate | up]; mode 2 (gated packing): silu(gate) * up [M, N/2];
 * mode 3: [M, N] float32 (`out` points to float32 memory). */
void amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                     void *out, int mode) {
    const int64_t KB = K / 32, G = N / 32;
    const int nthr = omp_get_max_threads();
    /* Work units: (chunk of groups, chunk of rows), taken dynamically (below). */
    const int64_t nmc = (M + UNIT_ROWS - 1) / UNIT_ROWS;
    /* Groups per unit: their weights fit in L2; at decode sizes (one row chunk) one contiguous share per thread, so
     * that each thread streams its weights sequentially (dynamic units measured ~5% slower there). */
    int64_t gcu = nmc == 1 ? (G + nthr - 1) / nthr : UNIT_WEIGHT_BYTES / (KB * 2048);
    if (gcu < 1) gcu = 1;
    const int64_t ngc = (G + gcu - 1) / gcu;
#pragma omp parallel
    {
        int cur[2] = {-1, -1};
        /* Dynamic: the two vCPUs of this VM run at different speeds from one moment to the next (measured 460-1245
         * GFLOP/s per core on the same matmul), and a static split waits for the slower one. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < ngc * nmc; u++) {
            const int64_t g0 = (u / nmc) * gcu, g1 = g0 + gcu < G ? g0 + gcu : G;
            const int64_t mlo = (u % nmc) * UNIT_ROWS, mhi = mlo + UNIT_ROWS < M ? mlo + UNIT_ROWS : M;
            if (nmc == 1) /* a group's weights stay in L1 while the few row blocks pass (measured best at 256 rows) */
                for (int64_t g = g0; g < g1; g++)
                    for (int64_t mb = mlo; mb < mhi; mb += 32)
                        out_block(x, K, P, N, bias, out, mode, mb, mhi, g, mb == mlo, cur);
            else /* a row block stays in L1 while the unit's groups pass (measured best at 2,048 rows) */
                for (int64_t mb = mlo; mb < mhi; mb += 32)
                    for (int64_t g = g0; g < g1; g++)
                        out_block(x, K, P, N, bias, out, mode, mb, mhi, g, mb == mlo, cur);
        }
        if (cur[0] >= 0) _tile_release();
    }
}
