/* Int4 weight-only matmul and expansion over PyTorch's CPU int4 pack (aten._convert_weight_to_int4pack_for_cpu).
 *
 * Layout: packed uint8 [N_pad / 64][K][32]; byte (b, k, j) holds row 64 b + j in its low nibble and row
 * 64 b + 32 + j in its high one. scales_and_zeros [K / G][N_pad][2] (activation dtype): w = (q - 8) * s + z.
 *
 * aten's op re-expands the weights for every activation row, so its cost grows with the batch. Here each
 * 64 x 32 weight tile is expanded once into float32 (in L1) and used for all M rows: the batched-decode kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <string.h>

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
        for (int j = 0; j < 32; j++) {
            tile[kk][j] = (float)(p[j] & 15) * s[j] + z[j];
            tile[kk][j + 32] = (float)(p[j] >> 4) * s[j + 32] + z[j + 32];
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
    float *xf = (float *)malloc(sizeof(float) * M * K);
    for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, i, is_bf16);
    const int64_t nb = N_pad / 64;
#pragma omp parallel
    {
        float *acc = (float *)malloc(sizeof(float) * M * 64);
        float tile[32][64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            memset(acc, 0, sizeof(float) * M * 64);
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                expand_tile(packed, sz, is_bf16, K, G, N_pad, b, k0, tile);
                tile_fma(tile, xf + k0, K, M, acc);
            }
            const int64_t n0 = 64 * b;
            const int64_t cnt = n_out - n0 < 64 ? n_out - n0 : 64;
            for (int64_t m = 0; m < M; m++) {
                if (is_bf16) {
                    uint16_t *o = (uint16_t *)out + m * n_out + n0;
                    for (int64_t j = 0; j < cnt; j++) o[j] = f32_to_bf16(acc[m * 64 + j]);
                } else {
                    float *o = (float *)out + m * n_out + n0;
                    for (int64_t j = 0; j < cnt; j++) o[j] = acc[m * 64 + j];
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
#endif
