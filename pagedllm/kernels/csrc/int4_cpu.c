/* Int4 weight-only matmul and expansion over PyTorch's CPU int4 pack (aten._convert_weight_to_int4pack_for_cpu).
 *
 * Layout: packed uint8 [N_pad / 64][K][32]; byte (b, k, j) holds row 64 b + j in its low nibble and row
 * 64 b + 32 + j in its high one. scales_and_zeros [K / G][N_pad][2] (activation dtype): w = (q - 8) * s + z.
 *
 * aten's op re-expands the weights for every activation row, so its cost grows with the batch. Here each
 * 64 x 32 weight tile is expanded once into float32 (in L1) and used for all M rows: the batched-decode kernel.
 * Decode rows in bf16 instead run on integer dot products over the codes (int4_gemv_bf16), and the per-row int8
 * LM head likewise (int8_logits_vnni): vpdpbusd with AVX512-VNNI/VBMI/BF16, vpmaddwd with AVX2 + FMA, the same
 * integers and float operations, so the same bits; both at the end of this file.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <string.h>

#include <omp.h>

#include "pagedllm_kernels.h"
#include "prefetch.h"
#include "simd.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* How far ahead of the codes being multiplied the decode kernels prefetch (int4_gemv_bf16's loops, both builds), in
 * input features (x 32 bytes): KernelConfig.int4_prefetch_bytes, set from Python when the library loads. Measured
 * (AMD EPYC Zen 5, 2 threads, one row, weights from memory, builds interleaved, medians of 12): SmolLM2's 120 int4
 * layer matmuls of a step 1.35-1.40 ms at 2 KB, 1.29-1.35 at 4 KB, 1.24-1.28 at 6 KB, 1.28-1.30 at 8 KB, 1.40-1.47
 * at 1 KB; the AVX2 build 1.67 -> 1.53 ms (2 -> 6 KB). On the Xeon (AMX) it was first tuned on, 2 KB was ~10% over
 * none, and the K-quant kernel's distance there was best at 2 KB (kquant_cpu.c, KQ_PREFETCH). */
static int64_t g_pf_features = 64;
void int4_set_prefetch_bytes(int64_t bytes) { g_pf_features = bytes < 32 ? 1 : bytes / 32; }

#if defined(__AVX512F__) || defined(__AVX2__)
/* The scales and zeros are [K / G][N_pad][2]: a block's 64 columns take 256 bytes per group, N_pad * 4 bytes apart,
 * a stream of n_groups pages that the hardware prefetcher does not follow. Per group g of block b: group g's 256
 * bytes of block b + SZ_AHEAD (a whole block's work ahead: ~1 us at decode sizes, well past the memory's latency),
 * and group g + 1's of block b (which covers a thread's first blocks). Measured against group g + 1's alone (AMD
 * EPYC Zen 5, 2 threads, one row, weights from memory, the two builds interleaved, medians of 12): SmolLM2's 120
 * int4 layer matmuls of a step 1.58-1.64 -> 1.49-1.51 ms, and 1.76-1.77 -> 1.56-1.60 ms in another hour; a 49152 x
 * 576 matrix 0.89-1.00 -> 0.83-0.86 ms, and no difference in the other hour. SZ_AHEAD 2: the same as 1. */
#define SZ_AHEAD 1
static inline __attribute__((always_inline)) void prefetch_scales(const uint16_t *sz, int64_t g, int64_t n_groups,
                                                                  int64_t N_pad, int64_t b) {
    if (64 * (b + SZ_AHEAD) < N_pad)
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char *)(sz + (g * N_pad + 64 * (b + SZ_AHEAD)) * 2 + 32 * i), _MM_HINT_T0);
    if (g + 1 < n_groups)
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char *)(sz + ((g + 1) * N_pad + 64 * b) * 2 + 32 * i), _MM_HINT_T0);
}
#endif

static inline float load_act(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The 32 x 64 float tile (k-major: tile[kk][j] = w[64 b + j][k0 + kk]) of block b, columns k0..k0+31. */
static inline void expand_tile(const uint8_t *packed, const void *sz, int is_bf16, int64_t K, int64_t G,
                               int64_t N_pad, int64_t b, int64_t k0, float tile[32][64]) {
    float s[64], z[64];
    const int64_t g = k0 / G;
    for (int j = 0; j < 64; j++) {
        const int64_t idx = (g * N_pad + 64 * b + j) * 2;
        s[j] = load_act(sz, idx, is_bf16);
        z[j] = load_act(sz, idx + 1, is_bf16) - 8.0f * s[j];
    }
    for (int kk = 0; kk < 32; kk++) {
        const uint8_t *p = packed + (b * K + k0 + kk) * 32;
        int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j < 32; j += 8) { /* the same float operation (one FMA: exact product, one rounding) per weight */
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + j)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
            _mm256_store_ps(tile[kk] + j, _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + j), _mm256_loadu_ps(z + j)));
            _mm256_store_ps(tile[kk] + j + 32, _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + j + 32), _mm256_loadu_ps(z + j + 32)));
        }
#endif
        for (; j < 32; j++) {
            tile[kk][j] = fmaf((float)(p[j] & 15), s[j], z[j]);
            tile[kk][j + 32] = fmaf((float)(p[j] >> 4), s[j + 32], z[j + 32]);
        }
    }
}

/* acc[m][0..63] += sum_kk x[m][kk] * tile[kk][0..63] for the 32 columns of the tile (x row stride ldx). */
static inline void tile_fma(const float tile[32][64], const float *xf, int64_t ldx, int64_t M, float *acc) {
    int64_t m = 0;
#ifdef __AVX512F__
    for (; m + 4 <= M; m += 4) { /* 4 rows x 64 outputs: 16 accumulators, each tile load feeds 4 FMAs */
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) a[r][i] = _mm512_loadu_ps(acc + (m + r) * 64 + 16 * i);
        for (int kk = 0; kk < 32; kk++) {
            const __m512 w0 = _mm512_load_ps(tile[kk]), w1 = _mm512_load_ps(tile[kk] + 16);
            const __m512 w2 = _mm512_load_ps(tile[kk] + 32), w3 = _mm512_load_ps(tile[kk] + 48);
            for (int r = 0; r < 4; r++) {
                const __m512 xv = _mm512_set1_ps(xf[(m + r) * ldx + kk]);
                a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
                a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + (m + r) * 64 + 16 * i, a[r][i]);
    }
    for (; m < M; m++) {
        __m512 a0 = _mm512_loadu_ps(acc + m * 64), a1 = _mm512_loadu_ps(acc + m * 64 + 16);
        __m512 a2 = _mm512_loadu_ps(acc + m * 64 + 32), a3 = _mm512_loadu_ps(acc + m * 64 + 48);
        for (int kk = 0; kk < 32; kk++) {
            const __m512 xv = _mm512_set1_ps(xf[m * ldx + kk]);
            a0 = _mm512_fmadd_ps(xv, _mm512_load_ps(tile[kk]), a0);
            a1 = _mm512_fmadd_ps(xv, _mm512_load_ps(tile[kk] + 16), a1);
            a2 = _mm512_fmadd_ps(xv, _mm512_load_ps(tile[kk] + 32), a2);
            a3 = _mm512_fmadd_ps(xv, _mm512_load_ps(tile[kk] + 48), a3);
        }
        _mm512_storeu_ps(acc + m * 64, a0);
        _mm512_storeu_ps(acc + m * 64 + 16, a1);
        _mm512_storeu_ps(acc + m * 64 + 32, a2);
        _mm512_storeu_ps(acc + m * 64 + 48, a3);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* 2 rows x 32 outputs per pass (8 accumulators, 4 tile vectors, a broadcast: 13 of the 16 ymm registers), each
     * output's FMAs in kk order as in the one-row pass below, so a row's bits don't depend on M */
    for (; m + 2 <= M; m += 2)
        for (int h = 0; h < 64; h += 32) {
            __m256 a[2][4];
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 4; i++) a[r][i] = _mm256_loadu_ps(acc + (m + r) * 64 + h + 8 * i);
            for (int kk = 0; kk < 32; kk++) {
                const __m256 w0 = _mm256_load_ps(tile[kk] + h), w1 = _mm256_load_ps(tile[kk] + h + 8);
                const __m256 w2 = _mm256_load_ps(tile[kk] + h + 16), w3 = _mm256_load_ps(tile[kk] + h + 24);
                for (int r = 0; r < 2; r++) {
                    const __m256 xv = _mm256_broadcast_ss(xf + (m + r) * ldx + kk);
                    a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
                    a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
                    a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
                }
            }
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + (m + r) * 64 + h + 8 * i, a[r][i]);
        }
    for (; m < M; m++)
        for (int h = 0; h < 64; h += 32) {
            __m256 a[4];
            for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(acc + m * 64 + h + 8 * i);
            for (int kk = 0; kk < 32; kk++) {
                const __m256 xv = _mm256_broadcast_ss(xf + m * ldx + kk);
                for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(xv, _mm256_load_ps(tile[kk] + h + 8 * i), a[i]);
            }
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + m * 64 + h + 8 * i, a[i]);
        }
#endif
    for (; m < M; m++)
        for (int kk = 0; kk < 32; kk++) {
            const float xv = xf[m * ldx + kk];
            for (int j = 0; j < 64; j++) acc[m * 64 + j] += xv * tile[kk][j];
        }
}

/* out[M][n_out] = x[M][K] @ w.T (x, out in bf16 if is_bf16 else float32; K % 32 == 0, G % 32 == 0). */
void int4_gemm(const void *x, int64_t M, int64_t K, const uint8_t *packed, const void *sz, int64_t G,
               int64_t N_pad, int64_t n_out, void *out, int is_bf16) {
    /* x in float32, k-tile major: xf[k / 32][m][k % 32], so a tile's 32 inputs of consecutive rows are contiguous
     * (rows K floats apart put 64 rows' slices in a few L1 sets when K is a multiple of 1536: half speed) */
    float *xf = (float *)malloc(sizeof(float) * M * K);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[(k / 32) * M * 32 + m * 32 + k % 32] = load_act(x, m * K + k, is_bf16);
    const int64_t nb = N_pad / 64;
    /* rows in chunks of GEMM_ROWS: a chunk's accumulators (16 KB) stay in L1 over the whole K (with all M rows at
     * once, 512 rows' 128 KB went to L2 and back every 32 inputs: ~2x slower); each tile is expanded once a chunk */
    enum { GEMM_ROWS = 64 };
#pragma omp parallel
    {
        float *acc = (float *)malloc(sizeof(float) * GEMM_ROWS * 64);
        float tile[32][64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t n0 = 64 * b;
            const int64_t cnt = n_out - n0 < 64 ? n_out - n0 : 64;
            for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
                const int64_t mr = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
                memset(acc, 0, sizeof(float) * mr * 64);
                for (int64_t k0 = 0; k0 < K; k0 += 32) {
                    expand_tile(packed, sz, is_bf16, K, G, N_pad, b, k0, tile);
                    tile_fma(tile, xf + (k0 / 32) * M * 32 + m0 * 32, 32, mr, acc);
                }
                for (int64_t m = 0; m < mr; m++) {
                    if (is_bf16) {
                        uint16_t *o = (uint16_t *)out + (m0 + m) * n_out + n0;
                        for (int64_t j = 0; j < cnt; j++) o[j] = f32_to_bf16(acc[m * 64 + j]);
                    } else {
                        float *o = (float *)out + (m0 + m) * n_out + n0;
                        for (int64_t j = 0; j < cnt; j++) o[j] = acc[m * 64 + j];
                    }
                }
            }
        }
        free(acc);
    }
    free(xf);
}

/* w[N_pad][K] (bf16 if is_bf16 else float32), the weight in the activation dtype. */
void int4_expand(const uint8_t *packed, const void *sz, int64_t K, int64_t G, int64_t N_pad, void *w, int is_bf16) {
    const int64_t nb = N_pad / 64;
#pragma omp parallel
    {
        float tile[32][64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                expand_tile(packed, sz, is_bf16, K, G, N_pad, b, k0, tile);
                for (int j = 0; j < 64; j++) {
                    const int64_t row = (64 * b + j) * K + k0;
                    if (is_bf16) {
                        uint16_t *o = (uint16_t *)w + row;
                        for (int kk = 0; kk < 32; kk++) o[kk] = f32_to_bf16(tile[kk][j]);
                    } else {
                        float *o = (float *)w + row;
                        for (int kk = 0; kk < 32; kk++) o[kk] = tile[kk][j];
                    }
                }
            }
        }
    }
}

/* Blocks b0 .. b1 - 1 (64 rows each) of the pack, expanded (int4_expand's values: one FMA, rounded once to bf16)
 * straight into P in the packed layout of a bf16 linear kernel over those 64 (b1 - b0) rows alone: layout 0
 * amx_pack's (amx_linear.c), 1 dpbf16_pack's (dpbf16_linear.c); both hold, per 16-row tile and group of 32 inputs,
 * 16 pair-rows of 16 rows x 2 inputs (the layouts kq_dequant_packed_bf16 writes). Layout 2: amx_pack's gated
 * packing of a SwiGLU gate_up pack (rows [gate; up], N_pad = 2 I, I % 64 == 0): blocks b0 .. b1 - 1 of the gate
 * half with the same blocks of the up half (I / 64 blocks on), 2 x 64 (b1 - b0) rows, each 32-row group holding 16
 * gate rows then the 16 matching up rows, for amx_linear_bf16 mode 2 (silu(gate) * up). Layout 3: the same rows in
 * the same order (16 gate rows, their 16 up rows, ...) in dpbf16_pack's layout, for dpbf16_linear_bf16 mode 2: gate
 * tile t of block b0 + bl (16-row chunk j = 4 bl + t) is vector 2 (j % 2) of output block j / 2, its up tile the next
 * vector. Feeds prefill rows to the packed bf16 GEMM without a dense copy of the weight. Returns 0, or -1 for a bad
 * layout, block range or K. */
int int4_dequant_packed_bf16(const uint8_t *packed, const void *sz, int is_bf16, int64_t K, int64_t G, int64_t N_pad,
                             int64_t b0, int64_t b1, int layout, uint16_t *P) {
    const int gated = layout == 2 || layout == 3;
    const int64_t n_src = gated ? N_pad / 2 : N_pad; /* rows the block range indexes */
    if (layout < 0 || layout > 3 || b0 < 0 || b1 <= b0 || 64 * b1 > n_src || K % 32 || G % 32 ||
        (gated && N_pad % 128))
        return -1;
    const int64_t KB = K / 32, halves = gated ? 2 : 1;
#pragma omp parallel
    {
        float tile[32][64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < halves * (b1 - b0) * KB; i++) {
            const int64_t half = i / ((b1 - b0) * KB), bl = i / KB % (b1 - b0), gi = i % KB; /* block, inputs */
            expand_tile(packed, sz, is_bf16, K, G, N_pad, b0 + bl + half * (N_pad / 128), 32 * gi, tile);
            for (int t = 0; t < 4; t++) { /* the block's 16-row tiles */
                const int64_t tl = 4 * bl + t;
                uint16_t *dst = layout == 2   ? P + (tl * KB + gi) * 1024 + half * 512
                                : layout == 3 ? P + 64 * (tl / 2) * K + ((16 * gi) * 4 + 2 * (tl % 2) + half) * 32
                                : layout == 0 ? P + ((tl / 2) * KB + gi) * 1024 + (tl % 2) * 512
                                              : P + 64 * bl * K + ((16 * gi) * 4 + t) * 32;
                const int64_t rstride = layout == 1 || layout == 3 ? 128 : 32;
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        dst[r * rstride + 2 * c] = f32_to_bf16(tile[2 * r][16 * t + c]);
                        dst[r * rstride + 2 * c + 1] = f32_to_bf16(tile[2 * r + 1][16 * t + c]);
                    }
            }
        }
    }
    return 0;
}

/* Per-row int8 weights (aten._weight_int8pack_mm's layout: q [N][K] int8, scale [N] in the activation dtype),
 * same tiling: out[M][N] = x[M][K] @ (q * scale[:, None]).T; K % 32 == 0. */
void int8_gemm(const void *x, int64_t M, int64_t K, const int8_t *q, const void *scale, int64_t N, void *out,
               int is_bf16) {
    float *xf = (float *)malloc(sizeof(float) * M * K);
    for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, i, is_bf16);
    const int64_t nb = (N + 63) / 64;
#pragma omp parallel
    {
        float *acc = (float *)malloc(sizeof(float) * M * 64);
        float tile[32][64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t n0 = 64 * b;
            const int64_t cnt = N - n0 < 64 ? N - n0 : 64;
            memset(acc, 0, sizeof(float) * M * 64);
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                for (int j = 0; j < 64; j++) {
                    if (j < cnt) {
                        const float s = load_act(scale, n0 + j, is_bf16);
                        const int8_t *row = q + (n0 + j) * K + k0;
                        for (int kk = 0; kk < 32; kk++) tile[kk][j] = (float)row[kk] * s;
                    } else {
                        for (int kk = 0; kk < 32; kk++) tile[kk][j] = 0.0f;
                    }
                }
                tile_fma(tile, xf + k0, K, M, acc);
            }
            for (int64_t m = 0; m < M; m++) {
                if (is_bf16) {
                    uint16_t *o = (uint16_t *)out + m * N + n0;
                    for (int64_t j = 0; j < cnt; j++) o[j] = f32_to_bf16(acc[m * 64 + j]);
                } else {
                    float *o = (float *)out + m * N + n0;
                    for (int64_t j = 0; j < cnt; j++) o[j] = acc[m * 64 + j];
                }
            }
        }
        free(acc);
    }
    free(xf);
}

#ifdef __AVX512F__
/* Per-row int8 weights as logits: out[M][N] (float32) = scale[n] * sum_k x[m][k] q[n][k], with float32 row scales
 * and float32 sums (no rounding to the activation dtype before the scale). 4 weight rows x up to 4 activation rows
 * per register tile; K % 16 == 0. Rows of the weight are read once for every 4 activation rows. */
void int8_logits(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *out,
                 int is_bf16) {
    float *xf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * K + 16));
    for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, i, is_bf16);
    const int64_t nblk = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t nend = (blk + 1) * 16 < N ? (blk + 1) * 16 : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
            for (int64_t n = blk * 16; n < nend; n += 4) {
                const int nr = nend - n < 4 ? (int)(nend - n) : 4;
                __m512 acc[4][4];
                for (int a = 0; a < 4; a++)
                    for (int c = 0; c < 4; c++) acc[a][c] = _mm512_setzero_ps();
                for (int64_t k = 0; k < K; k += 16) {
                    __m512 w[4];
                    for (int c = 0; c < 4; c++)
                        w[c] = c < nr ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128((const __m128i *)(q + (n + c) * K + k))))
                                      : _mm512_setzero_ps();
                    for (int a = 0; a < mr; a++) {
                        const __m512 xv = _mm512_load_ps(xf + (m0 + a) * K + k);
                        for (int c = 0; c < 4; c++) acc[a][c] = _mm512_fmadd_ps(xv, w[c], acc[a][c]);
                    }
                }
                for (int a = 0; a < mr; a++)
                    for (int c = 0; c < nr; c++)
                        out[(m0 + a) * N + n + c] = _mm512_reduce_add_ps(acc[a][c]) * scale[n + c];
            }
        }
    }
    free(xf);
}
#else
/* Without AVX-512: the same float32 sums in 16 interleaved partial sums (as the 16 lanes above), then the scale. */
void int8_logits(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *out,
                 int is_bf16) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, i, is_bf16);
#pragma omp parallel for schedule(static) if (N > 64)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = xf + m * K;
            float acc[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16; l++) acc[l] += xm[k + l] * (float)qn[k + l];
            float t = 0.0f;
            for (int l = 0; l < 16; l++) t += acc[l];
            out[m * N + n] = t * scale[n];
        }
    }
    free(xf);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define GEMV_VNNI 1 /* vpdpbusd on u8 codes x the activations' two s8 halves */
#define GEMV_MR 2   /* activation rows sharing each expanded weight vector */
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMV_AVX2 1 /* vpmaddwd on the codes widened to 16 bits x the 15-bit activations: the same integers */
#define GEMV_MR 1
#endif

#ifdef GEMV_VNNI
/* Int4 matmul for a few bf16 activation rows on integer dot products (vpdpbusd: 64 u8 x s8 products per instruction).
 *
 * Each activation row is quantized per weight group to 15 bits, x ~= xs * xq with xq = 128 * hi + lo
 * (hi in [-128, 127], lo in [0, 127], both s8), so the codes (u8) dot both halves exactly in int32. The 15-bit
 * rounding is about 2^-15 of the group's largest |x|, far below the bf16 rounding of the output (2^-9).
 * A byte permute (vpermt2b) gathers 4 consecutive input features of one weight row into each 32-bit lane, as
 * vpdpbusd wants them. Per group: sum_k w x = xs * (s * sum_k q xq + (z - 8 s) * sum_k xq), as w = (q - 8) s + z.
 * Up to 2 activation rows share each expanded weight vector (more rows loop in chunks of 2).
 * Prefill rows may take 8-bit activations instead (int4_gemv_bf16_a8): xq = 128 q, q = rint(127 x / max|x|) per
 * group, so lo = 0 and LO = 0 skips its vpdpbusd (half the integer work); the epilogue is the same. */
#define PF_FEATURES g_pf_features /* see int4_set_prefetch_bytes */

/* The codes of features k .. k + 3 of block b (pb: its pack) for the block's 64 weight rows: w[i] lane r holds the 4
 * codes of row 16 i + r (rows 0..31: low nibbles, 32..63: high), as vpdpbusd (and an AMX-INT8 B tile row) reads them:
 * lane r of rows 0..15 = bytes (a[r], a[32 + r], b[r], b[32 + r]) of (a, b) = features (k, k + 1), (k + 2, k + 3). */
static inline __attribute__((always_inline)) void expand_codes(const uint8_t *pb, int64_t k, __m512i w[4]) {
    const __m512i idx0 = _mm512_set_epi8(
        111, 79, 47, 15, 110, 78, 46, 14, 109, 77, 45, 13, 108, 76, 44, 12, 107, 75, 43, 11, 106, 74, 42, 10,
        105, 73, 41, 9, 104, 72, 40, 8, 103, 71, 39, 7, 102, 70, 38, 6, 101, 69, 37, 5, 100, 68, 36, 4,
        99, 67, 35, 3, 98, 66, 34, 2, 97, 65, 33, 1, 96, 64, 32, 0);
    const __m512i idx1 = _mm512_add_epi8(idx0, _mm512_set1_epi8(16)); /* rows 16..31 */
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    WEIGHT_PREFETCH(pb + (k + PF_FEATURES) * 32, 3);
    WEIGHT_PREFETCH(pb + (k + PF_FEATURES + 2) * 32, 3);
    const __m512i va = _mm512_loadu_si512((const void *)(pb + k * 32));       /* features k, k + 1 */
    const __m512i vb = _mm512_loadu_si512((const void *)(pb + (k + 2) * 32)); /* features k + 2, k + 3 */
    const __m512i la = _mm512_and_si512(va, m0f), lb = _mm512_and_si512(vb, m0f);
    const __m512i ha = _mm512_and_si512(_mm512_srli_epi16(va, 4), m0f);
    const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(vb, 4), m0f);
    w[0] = _mm512_permutex2var_epi8(la, idx0, lb);
    w[1] = _mm512_permutex2var_epi8(la, idx1, lb);
    w[2] = _mm512_permutex2var_epi8(ha, idx0, hb);
    w[3] = _mm512_permutex2var_epi8(ha, idx1, hb);
}
static inline __attribute__((always_inline)) void gemv_block(
    const int MR, const int8_t *xhi, const int8_t *xlo, int64_t K, const float *xscale, const float *xsum,
    int64_t n_groups, const uint8_t *packed, const uint16_t *sz, int64_t G, int64_t N_pad, int64_t b, int64_t n_out,
    void *out, const int F32, const int LO) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    float y[2][64] __attribute__((aligned(64))) = {{0}};
    const uint8_t *pb = packed + b * K * 32;
    for (int64_t g = 0; g < n_groups; g++) {
        __m512i ah[2][4], al[2][4];
#pragma GCC unroll 2
        for (int r = 0; r < MR; r++)
            for (int i = 0; i < 4; i++) ah[r][i] = al[r][i] = _mm512_setzero_si512();
        prefetch_scales(sz, g, n_groups, N_pad, b); /* see prefetch_scales */
        for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
            __m512i w[4];
            expand_codes(pb, k, w);
#pragma GCC unroll 2
            for (int r = 0; r < MR; r++) {
                int32_t qh, ql = 0;
                memcpy(&qh, xhi + r * K + k, 4);
                if (LO) memcpy(&ql, xlo + r * K + k, 4);
                const __m512i xh = _mm512_set1_epi32(qh), xl = _mm512_set1_epi32(ql);
                for (int i = 0; i < 4; i++) {
                    ah[r][i] = _mm512_dpbusd_epi32(ah[r][i], w[i], xh);
                    if (LO) al[r][i] = _mm512_dpbusd_epi32(al[r][i], w[i], xl); /* 8-bit rows: lo = 0 */
                }
            }
        }
        const uint16_t *szg = sz + (g * N_pad + 64 * b) * 2; /* 64 (s, z) bf16 pairs: dword = s | z << 16 */
        for (int i = 0; i < 4; i++) {
            const __m512i p = _mm512_loadu_si512((const void *)(szg + 32 * i));
            const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
            const __m512 zc = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s,
                                               _mm512_castsi512_ps(_mm512_and_si512(p, hi_mask)));
#pragma GCC unroll 2
            for (int r = 0; r < MR; r++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[r][i], 7), al[r][i]));
                __m512 acc = _mm512_fmadd_ps(zc, _mm512_set1_ps(xsum[r * n_groups + g]), _mm512_load_ps(y[r] + 16 * i));
                acc = _mm512_fmadd_ps(s, _mm512_mul_ps(dot, _mm512_set1_ps(xscale[r * n_groups + g])), acc);
                _mm512_store_ps(y[r] + 16 * i, acc);
            }
        }
    }
    const int64_t n0 = 64 * b;
#pragma GCC unroll 2
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 4; i++) {
            const int64_t cnt = n_out - n0 - 16 * i;
            if (cnt <= 0) break;
            const __mmask16 mask = cnt >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1);
            if (F32) /* the same float32 sums, unrounded (logits) */
                _mm512_mask_storeu_ps((float *)out + r * n_out + n0 + 16 * i, mask, _mm512_load_ps(y[r] + 16 * i));
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + r * n_out + n0 + 16 * i, mask,
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(y[r] + 16 * i)));
        }
}

#endif /* GEMV_VNNI */

#if defined(GEMV_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* The VNNI kernel's integers on AMX-INT8 tiles (TDPBSUD: s8 activations x u8 codes, exact int32 sums; Intel
 * Architecture Instruction Set Extensions Programming Reference, ch. 3), for calls of at least GEMV_AMX_MIN_ROWS rows.
 *
 * Why: with 15-bit activations a row's group costs two vpdpbusd per 64 products, and gemv_block expands each weight
 * vector for 2 rows at a time, so a batched decode step is bound by those instructions, not by the weight stream
 * (SmolLM2 int4 at 32 rows: ~2x the bf16 model's step). Here a 64-column block's codes of one group are expanded
 * once into four B tiles (vpermt2b gives exactly the tiles' rows: 4 features of 16 columns) and serve every row;
 * one TDPBSUD does 16 rows x 16 columns x up to 64 features.
 * Same bits as gemv_block: the same int32 sums (exact, in any order) per (row, group, column) and the same float32
 * epilogue, in the same order (tested). Tiles: 0-3 sums (hi and lo halves x two 16-column tiles), 4-5 the rows'
 * hi and lo bytes, 6-7 codes. The process must hold the AMX tile state: int4_gemv_use_amx(1) is called from Python
 * only once the AMX library has asked for it. */
#include "amx.h"
#define GEMV_AMX 1
#define GEMV_AMX_MIN_ROWS 8
static int g_int4_amx = 0;
int int4_gemv_use_amx(int on) {
    g_int4_amx = on;
    return on ? GEMV_AMX_MIN_ROWS : 0;
}

static inline void amx_int4_config(int rows, int kc) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = (uint8_t)rows; cfg.colsb[t] = 64; }
    for (int t = 4; t < 6; t++) { cfg.rows[t] = (uint8_t)rows; cfg.colsb[t] = (uint16_t)kc; }
    for (int t = 6; t < 8; t++) { cfg.rows[t] = (uint8_t)(kc / 4); cfg.colsb[t] = 64; }
    amx_load_tilecfg(&cfg);
}

/* Block b (64 columns) for all M rows: out[m][64 b ..] (bf16, or float32 if F32). kc: features per tile product
 * (32 or 64, dividing G). wt: 4 * G * 16 bytes; y: M * 64 floats; cb: 4 * 256 int32; all 64-byte aligned. */
static void amx_block(int64_t M, const int8_t *xhi, const int8_t *xlo, int64_t K, const float *xscale,
                      const float *xsum, int64_t n_groups, const uint8_t *packed, const uint16_t *sz, int64_t G,
                      int64_t N_pad, int64_t b, int64_t n_out, void *out, const int F32, const int LO, int kc,
                      uint8_t *wt, float *y, int32_t *cb, int *cur_rows) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    const uint8_t *pb = packed + b * K * 32;
    const int64_t nchunk = G / kc, trows = kc / 4; /* tile products a group; B tile rows */
    for (int64_t i = 0; i < M * 64; i += 16) _mm512_store_ps(y + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < n_groups; g++) {
        /* the group's codes as B tiles: wt[c][q] (chunk c, column quarter q) = trows rows of 64 bytes */
        for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
            __m512i w[4];
            expand_codes(pb, k, w);
            const int64_t kk = k - g * G, c = kk / kc, r = kk % kc / 4;
            uint8_t *dst = wt + c * 4 * trows * 64 + r * 64;
            for (int i = 0; i < 4; i++) _mm512_store_si512((void *)(dst + i * trows * 64), w[i]);
        }
        amx_fence(); /* the tile loads below read wt */
        const uint16_t *szg = sz + (g * N_pad + 64 * b) * 2;
        __m512 s[4], zc[4];
        for (int i = 0; i < 4; i++) {
            const __m512i p = _mm512_loadu_si512((const void *)(szg + 32 * i));
            s[i] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
            zc[i] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[i], _mm512_castsi512_ps(_mm512_and_si512(p, hi_mask)));
        }
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
            if (rows != *cur_rows) {
                amx_int4_config(rows, kc);
                *cur_rows = rows;
            }
            for (int h = 0; h < 2; h++) { /* column quarters 2h, 2h + 1 */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < nchunk; c++) {
                    const int64_t k0 = g * G + c * kc;
                    const uint8_t *w0 = wt + (c * 4 + 2 * h) * trows * 64;
                    _tile_loadd(4, xhi + m0 * K + k0, K);
                    _tile_loadd(6, w0, 64);
                    _tile_dpbsud(0, 4, 6);
                    _tile_loadd(7, w0 + trows * 64, 64);
                    _tile_dpbsud(1, 4, 7);
                    if (LO) {
                        _tile_loadd(5, xlo + m0 * K + k0, K);
                        _tile_dpbsud(2, 5, 6);
                        _tile_dpbsud(3, 5, 7);
                    }
                }
                _tile_stored(0, cb, 64);
                _tile_stored(1, cb + 256, 64);
                if (LO) {
                    _tile_stored(2, cb + 512, 64);
                    _tile_stored(3, cb + 768, 64);
                }
                for (int r = 0; r < rows; r++) {
                    const int64_t m = m0 + r;
                    const __m512 xsb = _mm512_set1_ps(xsum[m * n_groups + g]);
                    const __m512 xcb = _mm512_set1_ps(xscale[m * n_groups + g]);
                    for (int j = 0; j < 2; j++) {
                        const int i = 2 * h + j;
                        __m512i dv = _mm512_slli_epi32(_mm512_load_si512((const void *)(cb + j * 256 + r * 16)), 7);
                        if (LO) /* 8-bit rows: lo = 0 */
                            dv = _mm512_add_epi32(dv, _mm512_load_si512((const void *)(cb + 512 + j * 256 + r * 16)));
                        const __m512 dot = _mm512_cvtepi32_ps(dv);
                        float *yp = y + m * 64 + 16 * i;
                        __m512 acc = _mm512_fmadd_ps(zc[i], xsb, _mm512_load_ps(yp));
                        acc = _mm512_fmadd_ps(s[i], _mm512_mul_ps(dot, xcb), acc);
                        _mm512_store_ps(yp, acc);
                    }
                }
            }
        }
    }
    const int64_t n0 = 64 * b;
    for (int64_t m = 0; m < M; m++)
        for (int i = 0; i < 4; i++) {
            const int64_t cnt = n_out - n0 - 16 * i;
            if (cnt <= 0) break;
            const __mmask16 mask = cnt >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1);
            if (F32)
                _mm512_mask_storeu_ps((float *)out + m * n_out + n0 + 16 * i, mask, _mm512_load_ps(y + m * 64 + 16 * i));
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + m * n_out + n0 + 16 * i, mask,
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(y + m * 64 + 16 * i)));
        }
}
#else
int int4_gemv_use_amx(int on) { /* no AMX-INT8 in this build */
    (void)on;
    return 0;
}
#endif

#ifdef GEMV_AVX2
/* The AVX2 form of the VNNI kernel above, with the same integers and the same float32 operations in the same order,
 * so both builds give the same bits. Without a byte permute across lanes or a u8 x s8 dot into int32 that can't
 * saturate, each activation row keeps its 15-bit xq whole (int16) and the codes are widened to 16 bits: two byte
 * unpacks pair features (k, k + 1) of one weight row per 16-bit lane pair, an unpack with zero makes a 32-bit lane
 * per row (row order 0-3 | 16-19, 4-7 | 20-23, ... per vector, put back in order once per group), and vpmaddwd
 * against the broadcast pair (xq[k], xq[k + 1]) adds both products exactly in int32. The low nibble (rows 0..31)
 * is a mask of that lane, the high one (rows 32..63) a shift. Per group sum_k q xq equals the VNNI kernel's
 * 128 sum_k q hi + sum_k q lo, as xq = 128 hi + lo. One activation row: gemv_block (16 ymm registers); more rows:
 * gemv_block_rows, which widens each group's codes once into an L1 buffer that all of them read. */
#define PF_FEATURES g_pf_features /* see int4_set_prefetch_bytes */

/* The 8 vectors of 16-bit codes of features (k, k + 1) of block pb: w[i] low nibbles, w[4 + i] high ones. */
static inline __attribute__((always_inline)) void widen_pair(const uint8_t *pb, int64_t k, __m256i w[8]) {
    const __m256i zero = _mm256_setzero_si256(), lo4 = _mm256_set1_epi16(0x0F);
    WEIGHT_PREFETCH(pb + (k + PF_FEATURES) * 32, 3);
    const __m256i f0 = _mm256_loadu_si256((const __m256i *)(pb + k * 32));       /* feature k, rows 0..31 */
    const __m256i f1 = _mm256_loadu_si256((const __m256i *)(pb + (k + 1) * 32)); /* feature k + 1 */
    const __m256i ulo = _mm256_unpacklo_epi8(f0, f1), uhi = _mm256_unpackhi_epi8(f0, f1);
    const __m256i r[4] = {_mm256_unpacklo_epi8(ulo, zero), _mm256_unpackhi_epi8(ulo, zero),
                          _mm256_unpacklo_epi8(uhi, zero), _mm256_unpackhi_epi8(uhi, zero)};
    for (int i = 0; i < 4; i++) {
        w[i] = _mm256_and_si256(r[i], lo4);
        w[4 + i] = _mm256_srli_epi16(r[i], 4);
    }
}

/* y[0..63] += group g's float32 epilogue of one row: its int32 sums acc (lane order of widen_pair), the group's
 * (s, z) pairs szg, the row's scale xscale and xscale * sum(xq) xsum. The one place these float operations are
 * written, so every path gives the same bits. */
static inline __attribute__((always_inline)) void group_epilogue(const __m256i acc[8], const uint16_t *szg,
                                                                 float xscale, float xsum, float *y) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i *a = acc + 4 * h;
        const __m256i d[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x20),
                              _mm256_permute2x128_si256(a[0], a[1], 0x31), _mm256_permute2x128_si256(a[2], a[3], 0x31)};
        for (int i = 0; i < 4; i++) { /* rows 32 h + 8 i .. + 7 */
            const int o = 32 * h + 8 * i;
            const __m256i p = _mm256_loadu_si256((const __m256i *)(szg + 2 * o));
            const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
            const __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s,
                                               _mm256_castsi256_ps(_mm256_and_si256(p, hi_mask)));
            const __m256 dot = _mm256_cvtepi32_ps(d[i]);
            __m256 v = _mm256_fmadd_ps(zc, _mm256_set1_ps(xsum), _mm256_load_ps(y + o));
            v = _mm256_fmadd_ps(s, _mm256_mul_ps(dot, _mm256_set1_ps(xscale)), v);
            _mm256_store_ps(y + o, v);
        }
    }
}

/* Row y's 64 sums into out (the block's outputs n0..; float32, or bf16 rounded to nearest even as vcvtneps2bf16). */
static inline void store_block_row(const float *y, int64_t n0, int64_t n_out, void *out, const int F32) {
    const int64_t cnt = n_out - n0 < 64 ? n_out - n0 : 64;
    if (F32) { /* the same float32 sums, unrounded (logits) */
        memcpy((float *)out + n0, y, sizeof(float) * (size_t)cnt);
        return;
    }
    uint16_t *o = (uint16_t *)out + n0;
    for (int64_t j = 0; j < cnt; j++) o[j] = f32_to_bf16(y[j]);
}

static inline __attribute__((always_inline)) void gemv_block(
    const int MR, const int16_t *xq, int64_t K, const float *xscale, const float *xsum, int64_t n_groups,
    const uint8_t *packed, const uint16_t *sz, int64_t G, int64_t N_pad, int64_t b, int64_t n_out, void *out,
    const int F32, const int LO) {
    (void)MR;
    (void)LO; /* 8-bit rows hold xq = 128 q in int16: the same vpmaddwd */
    float y[64] __attribute__((aligned(32))) = {0};
    const uint8_t *pb = packed + b * K * 32;
    for (int64_t g = 0; g < n_groups; g++) {
        __m256i acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
        prefetch_scales(sz, g, n_groups, N_pad, b); /* see prefetch_scales */
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
            __m256i w[8];
            widen_pair(pb, k, w);
            int32_t xp;
            memcpy(&xp, xq + k, 4);
            const __m256i xv = _mm256_set1_epi32(xp);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w[i], xv));
        }
        group_epilogue(acc, sz + (g * N_pad + 64 * b) * 2, xscale[g], xsum[g], y);
    }
    store_block_row(y, 64 * b, n_out, out, F32);
}

/* Rows sharing one widening of each group's codes (decode batches): widening is ~half of gemv_block's vector
 * operations, and rows of a batch need the same 16-bit codes. The buffer holds one group (G / 2 feature pairs x 8
 * vectors: 4 KB at G = 32, 32 KB at the largest G, 256); y one 64-float row per activation row. M <= GEMV_AVX2_ROWS. */
#define GEMV_AVX2_ROWS 16
static void gemv_block_rows(int64_t M, const int16_t *xq, int64_t K, const float *xscale, const float *xsum,
                            int64_t n_groups, const uint8_t *packed, const uint16_t *sz, int64_t G, int64_t N_pad,
                            int64_t b, int64_t n_out, void *out, const int F32) {
    __m256i wbuf[256 / 2 * 8];
    float y[GEMV_AVX2_ROWS][64] __attribute__((aligned(32)));
    const uint8_t *pb = packed + b * K * 32;
    memset(y, 0, sizeof(float) * 64 * (size_t)M);
    for (int64_t g = 0; g < n_groups; g++) {
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) widen_pair(pb, k, wbuf + (k - g * G) / 2 * 8);
        const uint16_t *szg = sz + (g * N_pad + 64 * b) * 2;
        for (int64_t r = 0; r < M; r++) {
            const int16_t *xr = xq + r * K + g * G;
            __m256i acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
            for (int64_t p = 0; p < G / 2; p++) {
                int32_t xp;
                memcpy(&xp, xr + 2 * p, 4);
                const __m256i xv = _mm256_set1_epi32(xp);
                const __m256i *w = wbuf + p * 8;
                for (int i = 0; i < 8; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w[i], xv));
            }
            group_epilogue(acc, szg, xscale[r * n_groups + g], xsum[r * n_groups + g], y[r]);
        }
    }
    const int64_t esz = F32 ? 4 : 2;
    for (int64_t r = 0; r < M; r++) store_block_row(y[r], 64 * b, n_out, (char *)out + r * n_out * esz, F32);
}
#endif /* GEMV_AVX2 */

#if defined(GEMV_VNNI) || defined(GEMV_AVX2)
/* out[M][n_out] (bf16, or float32 if F32) = x[M][K] (bf16) @ w.T over the CPU int4 pack with bf16
 * scales_and_zeros; K % G == 0, G % 4 == 0. Each row's arithmetic is the same whatever M is (batch invariant). */
static void gemv_rows(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t G,
                      int64_t N_pad, int64_t n_out, void *out, const int F32, const int A8) {
    const int64_t esz = F32 ? 4 : 2;
    const int64_t n_groups = K / G;
    /* VNNI: hi [M][K] then lo [M][K] (int8); AVX2: xq [M][K] (int16) */
    int8_t *xq = (int8_t *)malloc((size_t)(2 * M * K));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(2 * M * n_groups)); /* scale, then scale * sum(xq) */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < n_groups; g++) {
            const uint16_t *xg = x + m * K + g * G;
            /* 8 lanes at a time (G % 32 == 0): the scalar definition's operations exactly (max of |x|, one float32
             * multiply, round to nearest even as lrintf, an exact int32 sum), so both builds' codes are equal */
            __m256 vmax = _mm256_setzero_ps();
            for (int64_t k = 0; k < G; k += 8)
                vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8_bf16(xg + k), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))));
            float lanes[8];
            _mm256_storeu_ps(lanes, vmax);
            float amax = 0.0f;
            for (int l = 0; l < 8; l++) amax = amax > lanes[l] ? amax : lanes[l];
            /* a group below 2^-100 counts as zero: 16383 / amax would overflow to inf from ~2^-113 (NaN codes).
             * A8: q = rint(127 x / amax), xq = 128 q (|xq| <= 16256), scale amax / 16256: xs xq = q amax / 127 */
            const float qmax = A8 ? 127.0f : 16383.0f;
            const float scale = amax / (A8 ? 16256.0f : 16383.0f), inv = amax >= 0x1p-100f ? qmax / amax : 0.0f;
            __m256i vsum = _mm256_setzero_si256();
            for (int64_t k = 0; k < G; k += 8) {
                /* |q| <= 16383 */
                __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16(xg + k), _mm256_set1_ps(inv)));
                if (A8) q = _mm256_slli_epi32(q, 7);
                vsum = _mm256_add_epi32(vsum, q);
                const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
#ifdef GEMV_VNNI
                const __m128i hi = _mm_srai_epi16(q16, 7), lo = _mm_and_si128(q16, _mm_set1_epi16(127)); /* floor(q / 128), q mod 128 */
                _mm_storel_epi64((__m128i *)(xq + m * K + g * G + k), _mm_packs_epi16(hi, hi));
                _mm_storel_epi64((__m128i *)(xq + M * K + m * K + g * G + k), _mm_packs_epi16(lo, lo));
#else
                _mm_storeu_si128((__m128i *)((int16_t *)xq + m * K + g * G + k), q16);
#endif
            }
            int32_t sums[8], sum = 0;
            _mm256_storeu_si256((__m256i *)sums, vsum);
            for (int l = 0; l < 8; l++) sum += sums[l];
            xs[m * n_groups + g] = scale;
            xs[M * n_groups + m * n_groups + g] = scale * (float)sum;
        }
    const int64_t nb = N_pad / 64;
#ifdef GEMV_AVX2
    if (M >= 2) { /* work units: (block, chunk of <= GEMV_AVX2_ROWS rows), chunks of equal size */
        const int64_t nc = (M + GEMV_AVX2_ROWS - 1) / GEMV_AVX2_ROWS, rows = (M + nc - 1) / nc;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < nb * nc; t++) {
            const int64_t m0 = (t % nc) * rows, mr = M - m0 < rows ? M - m0 : rows;
            const int16_t *xr = (const int16_t *)xq + m0 * K;
            const float *sc = xs + m0 * n_groups, *sm = xs + M * n_groups + m0 * n_groups;
            char *o = (char *)out + m0 * n_out * esz;
            if (F32)
                gemv_block_rows(mr, xr, K, sc, sm, n_groups, packed, sz, G, N_pad, t / nc, n_out, o, 1);
            else
                gemv_block_rows(mr, xr, K, sc, sm, n_groups, packed, sz, G, N_pad, t / nc, n_out, o, 0);
        }
        free(xq);
        free(xs);
        return;
    }
#endif
#ifdef GEMV_AMX
    if (g_int4_amx && M >= GEMV_AMX_MIN_ROWS && G % 32 == 0) { /* the same sums on AMX tiles (amx_block) */
        const int kc = G % 64 == 0 ? 64 : 32;
        /* work units: (block, chunk of rows in 16s); rows are cut only to even out the threads' shares of a few
         * blocks (SmolLM2's 576 columns: 9 blocks, 5 and 4 on 2 threads), as each chunk expands the codes again */
        const int nthr = omp_get_max_threads();
        const int64_t mb = (M + 15) / 16;
        int64_t nrc = 1;
        while (nrc < mb && (nb * nrc) % nthr != 0 && nb * nrc < 8 * nthr) nrc++;
        const int64_t rows_per = (mb + nrc - 1) / nrc * 16;
#pragma omp parallel
        {
            uint8_t *wt = (uint8_t *)aligned_alloc(64, (size_t)(4 * G * 16));
            float *y = (float *)aligned_alloc(64, sizeof(float) * (size_t)(rows_per * 64));
            int32_t *cb = (int32_t *)aligned_alloc(64, sizeof(int32_t) * 1024);
            int cur_rows = -1;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < nb * nrc; u++) {
                const int64_t b = u / nrc, m0 = (u % nrc) * rows_per;
                if (m0 >= M) continue;
                const int64_t mr = M - m0 < rows_per ? M - m0 : rows_per;
                amx_block(mr, xq + m0 * K, xq + M * K + m0 * K, K, xs + m0 * n_groups, xs + M * n_groups + m0 * n_groups,
                          n_groups, packed, sz, G, N_pad, b, n_out, (char *)out + m0 * n_out * (F32 ? 4 : 2), F32,
                          !A8, kc, wt, y, cb, &cur_rows);
            }
            if (cur_rows >= 0) _tile_release();
            free(wt);
            free(y);
            free(cb);
        }
        free(xq);
        free(xs);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (nb > 1)
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t m0 = 0; m0 < M; m0 += GEMV_MR) {
#ifdef GEMV_VNNI
#define XQ_ARGS xq + m0 * K, xq + M * K + m0 * K
#else
#define XQ_ARGS (const int16_t *)xq + m0 * K
#endif
            const float *sc = xs + m0 * n_groups, *sm = xs + M * n_groups + m0 * n_groups;
            char *o = (char *)out + m0 * n_out * esz;
            if (F32 && M - m0 >= 2)
                gemv_block(GEMV_MR, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 1, 1);
            else if (F32)
                gemv_block(1, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 1, 1);
            else if (A8 && M - m0 >= 2)
                gemv_block(GEMV_MR, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 0, 0);
            else if (A8)
                gemv_block(1, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 0, 0);
            else if (M - m0 >= 2)
                gemv_block(GEMV_MR, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 0, 1);
            else
                gemv_block(1, XQ_ARGS, K, sc, sm, n_groups, packed, sz, G, N_pad, b, n_out, o, 0, 1);
#undef XQ_ARGS
        }
    }
    free(xq);
    free(xs);
}

void int4_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t G,
                    int64_t N_pad, int64_t n_out, uint16_t *out) {
    gemv_rows(x, M, K, packed, sz, G, N_pad, n_out, out, 0, 0);
}

/* int4_gemv_bf16 on 8-bit activations (prefill rows): per group q = rint(127 x / max|x|), error <= max|x| / 254 per
 * element (llama.cpp's Q8_0 activations), the VNNI build skipping the low half; both builds give the same bits. */
void int4_gemv_bf16_a8(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t G,
                       int64_t N_pad, int64_t n_out, uint16_t *out) {
    gemv_rows(x, M, K, packed, sz, G, N_pad, n_out, out, 0, 1);
}

void int4_gemv_bf16_f32(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz,
                        int64_t G, int64_t N_pad, int64_t n_out, float *out) {
    gemv_rows(x, M, K, packed, sz, G, N_pad, n_out, out, 1, 0);
}

#ifdef GEMV_VNNI
/* Per-row int8 weights as logits on integer dot products: out[M][N] (float32) = scale[n] * sum_k x[m][k] q[n][k].
 * Each activation row is quantized to 22 bits (xq = round(x / xs), |xq| < 2^21, xs = max|x| / (2^21 - 1)) and
 * split into three s8 parts, xq = 2^14 a + 2^7 b + c (a in [-128, 127], b, c in [0, 127]); the weights enter
 * vpdpbusd as u8 (q + 128), so sum_k q xq = 2^14 A + 2^7 B + C - 128 sum_k xq, exact in int64. The only rounding
 * before the float32 scales is the 22-bit one (2^-22 of the row's largest |x|). K % 64 == 0. */
void int8_logits_vnni(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                      float *out, int is_bf16) {
    int8_t *parts = (int8_t *)aligned_alloc(64, (size_t)(3 * M * K)); /* [M][3][K]: a, b, c */
    double *row_scale = (double *)malloc(sizeof(double) * (size_t)M);
    int64_t *row_sum = (int64_t *)malloc(sizeof(int64_t) * (size_t)M);
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load_act(x, m * K + k, is_bf16)));
        const float inv = amax > 0.0f ? 2097151.0f / amax : 0.0f;
        int64_t sum = 0;
        for (int64_t k = 0; k < K; k++) {
            const int32_t v = (int32_t)lrintf(load_act(x, m * K + k, is_bf16) * inv);
            parts[(m * 3 + 0) * K + k] = (int8_t)(v >> 14);
            parts[(m * 3 + 1) * K + k] = (int8_t)((v >> 7) & 127);
            parts[(m * 3 + 2) * K + k] = (int8_t)(v & 127);
            sum += v;
        }
        row_scale[m] = amax / 2097151.0;
        row_sum[m] = sum;
    }
    const int64_t nblk = (N + 3) / 4;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t n0 = blk * 4;
        const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
        if (blk + 2 < nblk) /* the stream of weight rows two blocks ahead */
            for (int64_t off = 0; off < 4 * K; off += 64) _mm_prefetch((const char *)(q + (n0 + 8) * K + off), _MM_HINT_T0);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *pa = parts + m * 3 * K;
            __m512i acc[4][3];
            for (int c = 0; c < 4; c++) acc[c][0] = acc[c][1] = acc[c][2] = _mm512_setzero_si512();
            for (int64_t k = 0; k < K; k += 64) {
                const __m512i xa = _mm512_load_si512((const void *)(pa + k));
                const __m512i xb = _mm512_load_si512((const void *)(pa + K + k));
                const __m512i xc = _mm512_load_si512((const void *)(pa + 2 * K + k));
                for (int c = 0; c < 4; c++) {
                    if (c >= nr) break;
                    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + (n0 + c) * K + k)), flip);
                    acc[c][0] = _mm512_dpbusd_epi32(acc[c][0], w, xa);
                    acc[c][1] = _mm512_dpbusd_epi32(acc[c][1], w, xb);
                    acc[c][2] = _mm512_dpbusd_epi32(acc[c][2], w, xc);
                }
            }
            for (int c = 0; c < nr; c++) {
                const int64_t dot = (int64_t)_mm512_reduce_add_epi32(acc[c][0]) * 16384 +
                                    (int64_t)_mm512_reduce_add_epi32(acc[c][1]) * 128 +
                                    (int64_t)_mm512_reduce_add_epi32(acc[c][2]) - 128 * row_sum[m];
                out[m * N + n0 + c] = (float)((double)dot * row_scale[m]) * scale[n0 + c];
            }
        }
    }
    free(parts);
    free(row_scale);
    free(row_sum);
}

#else /* GEMV_AVX2 */
/* The AVX2 form of int8_logits_vnni, with the same bits: the same 22-bit xq split in two int16 parts instead,
 * xq = 2^11 a + b (a = xq >> 11, |a| <= 1024; b in [0, 2047]), the int8 codes widened to int16 and vpmaddwd into
 * int32 (|partial sums| < 2^31 for K < 2^15), so sum_k q xq = 2^11 A + B exactly in int64, then the same float32
 * and float64 operations. K % 16 == 0. */
void int8_logits_vnni(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                      float *out, int is_bf16) {
    int16_t *parts = (int16_t *)aligned_alloc(32, (size_t)(4 * M * K + 32)); /* [M][2][K]: a, b */
    double *row_scale = (double *)malloc(sizeof(double) * (size_t)M);
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load_act(x, m * K + k, is_bf16)));
        const float inv = amax > 0.0f ? 2097151.0f / amax : 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const int32_t v = (int32_t)lrintf(load_act(x, m * K + k, is_bf16) * inv);
            parts[(m * 2 + 0) * K + k] = (int16_t)(v >> 11);
            parts[(m * 2 + 1) * K + k] = (int16_t)(v & 2047);
        }
        row_scale[m] = amax / 2097151.0;
    }
    const int64_t nblk = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (nblk > 1)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t n0 = blk * 4;
        const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
        if (blk + 2 < nblk) /* the stream of weight rows two blocks ahead */
            for (int64_t off = 0; off < 4 * K; off += 64) _mm_prefetch((const char *)(q + (n0 + 8) * K + off), _MM_HINT_T0);
        for (int64_t m = 0; m < M; m++) {
            const int16_t *pa = parts + m * 2 * K;
            __m256i acc[4][2];
            for (int c = 0; c < 4; c++) acc[c][0] = acc[c][1] = _mm256_setzero_si256();
            for (int64_t k = 0; k < K; k += 16) {
                const __m256i xa = _mm256_loadu_si256((const __m256i *)(pa + k));
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(pa + K + k));
                for (int c = 0; c < 4; c++) {
                    if (c >= nr) break;
                    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + (n0 + c) * K + k)));
                    acc[c][0] = _mm256_add_epi32(acc[c][0], _mm256_madd_epi16(w, xa));
                    acc[c][1] = _mm256_add_epi32(acc[c][1], _mm256_madd_epi16(w, xb));
                }
            }
            for (int c = 0; c < nr; c++) {
                int32_t la[8], lb[8];
                _mm256_storeu_si256((__m256i *)la, acc[c][0]);
                _mm256_storeu_si256((__m256i *)lb, acc[c][1]);
                int64_t A = 0, B = 0;
                for (int l = 0; l < 8; l++) A += la[l], B += lb[l];
                const int64_t dot = A * 2048 + B;
                out[m * N + n0 + c] = (float)((double)dot * row_scale[m]) * scale[n0 + c];
            }
        }
    }
    free(parts);
    free(row_scale);
}
#endif

int int4_gemv_bf16_supported(void) { return 1; }
#else
int int4_gemv_bf16_supported(void) { return 0; }
#endif
