/* GGUF K-quant / legacy-quant matmuls over the file's own blocks (no requantization).
 *
 * Weights: W [N][row_bytes] uint8, each row the ggml blocks of K inputs exactly as stored in the GGUF file
 * (block layouts as in the gguf package's quants.py, the reference for every value computed here):
 *   Q8_0 (type 8,  34 B / 32):  f16 d | int8 q[32]                          w = d q
 *   Q5_0 (type 6,  22 B / 32):  f16 d | u32 qh | u8 qs[16]                  w = d (q - 16), q = nibble | bit << 4
 *   Q4_K (type 12, 144 B / 256): f16 d | f16 dmin | u8 scales[12] | qs[128]  w = d sc_j q - dmin m_j (8 x 32)
 *   Q5_K (type 13, 176 B / 256): as Q4_K with qh[32] before qs: bit j of qh[i] is bit 4 of group j's element i
 *   Q6_K (type 14, 210 B / 256): ql[128] | qh[64] | int8 sc[16] | f16 d     w = d sc_i (q - 32) (16 x 16)
 * The blocks are decoded in registers; every dequantized weight value the kernel uses equals gguf's float32 one
 * (d sc, d q, dmin m are exact products; the only rounding in gguf's value, d sc q - dmin m, is not taken here:
 * the two terms are summed separately against the activations).
 *
 * Activations (kq_quantize_act): per row and block of 32 inputs, xs = max|x| / 16256 and xq = rint(x / xs),
 * |xq| <= 16256 = 127 * 128, split xq = 128 hi + lo (hi in [-127, 127], lo in [0, 127], both int8) so each
 * u8 x s8 dot product (vpdpbusd on AVX512-VNNI / AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2) is exact in int32.
 * Rounding error: |x - xs xq| <= 0.504 xs = max|x| / 32256 per element (about 2^-15 of the block's largest |x|),
 * the only approximation besides float32 accumulation; it is far below a bf16 rounding (2^-9).
 *
 * Per group of 32: the 8 int32 lanes of sum(c * xq) (c: the u8 codes) are converted to float and FMA-ed into
 * 8 float32 accumulators with the group's scale (A xs); offsets / mins (w = A c + B) enter through the
 * activations' block sums: B * xs * sum(xq). A row's result is computed with the same operations in the same
 * order whatever M is and whichever other rows share the call (batch invariance), and the scalar path mirrors
 * the vector lanes operation for operation, so every ISA gives the same bits.
 *
 * Plain C ABI, no globals; built with OpenMP (threads over output rows).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pagedllm_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define KQ_Q5_0 6
#define KQ_Q8_0 8
#define KQ_Q4_K 12
#define KQ_Q5_K 13
#define KQ_Q6_K 14
#define KQ_XMAX 16256.0f /* 127 * 128 */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KQ_ISA 3
#define KQ_SIMD 1
#define kq_dp(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define KQ_ISA 2
#define KQ_SIMD 1
#define kq_dp(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif defined(__AVX2__) && defined(__FMA__)
#define KQ_ISA 1
#define KQ_SIMD 1
/* u8 x s8 pairs in int16 do not saturate: |u| <= 128 and |s| <= 127 for every caller (2 * 128 * 127 < 2^15) */
static inline __m256i kq_dp(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#else
#define KQ_ISA 0
#define KQ_SIMD 0
#endif

/* Which code path this build runs: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 scalar. */
int kq_isa(void) { return KQ_ISA; }

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            exp = 113;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Q4_K / Q5_K 6-bit scale and min of group j (gguf's Q4_K.get_scale_min). */
static inline void kq_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- activations ---------------------------------------------------------------------------------------------- */

/* x [M][K] (bf16 if is_bf16 else float32), K % 32 == 0 ->
 * xhi, xlo [M][K] int8; xs [M][K/32] (block scale); xsum32 [M][K/32] = xs * sum of xq over the block;
 * xsum16 [M][K/16] = xs * sum of xq over each half block. */
void kq_quantize_act(const void *x, int64_t M, int64_t K, int is_bf16, int8_t *xhi, int8_t *xlo, float *xs,
                     float *xsum32, float *xsum16) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t m = i / nb, b = i % nb, base = m * K + b * 32;
        float v[32], amax = 0.0f;
        for (int e = 0; e < 32; e++) {
            v[e] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[base + e]) : ((const float *)x)[base + e];
            amax = fmaxf(amax, fabsf(v[e]));
        }
        const float scale = amax / KQ_XMAX, inv = amax > 0.0f ? KQ_XMAX / amax : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int e = 0; e < 32; e++) {
            int32_t q = (int32_t)lrintf(v[e] * inv);
            q = q > 16256 ? 16256 : (q < -16256 ? -16256 : q);
            xhi[base + e] = (int8_t)(q >> 7); /* floor(q / 128) */
            xlo[base + e] = (int8_t)(q & 127);
            if (e < 16) s0 += q; else s1 += q;
        }
        xs[m * nb + b] = scale;
        xsum32[m * nb + b] = scale * (float)(s0 + s1);
        xsum16[(m * nb + b) * 2] = scale * (float)s0;
        xsum16[(m * nb + b) * 2 + 1] = scale * (float)s1;
    }
}

/* ---- per-group weight decode ---------------------------------------------------------------------------------- */

/* One 32-input group of one weight row, decoded: codes c[32] as u8 (Q8_0: |q| with the sign moved onto the
 * activations), scales A (lanes 0-3 use a0, lanes 4-7 a1: Q6_K's 16-element sub-blocks; else a0 == a1),
 * offsets b0, b1 (w = A c + B; b1 != 0 only for Q6_K's second half). */
typedef struct {
    float a0, a1, b0, b1;
    int half; /* b applies per 16-element half (Q6_K) */
} kq_group;

#if KQ_SIMD
typedef struct {
    __m256i c, sgn;
} kq_codes;

static inline __m256i kq_bits_to_bytes(uint32_t bits) { /* bit e of bits -> byte e = 0xFF or 0 */
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}
#endif

/* Decodes group j of the super-block (or block) at blk of type T. Scalar form: codes into c[32], sign flags for
 * Q8_0 into neg[32]. */
static inline __attribute__((always_inline)) void kq_group_scales(const int T, const uint8_t *blk, int j,
                                                                   kq_group *g) {
    g->half = 0;
    g->b1 = 0.0f;
    if (T == KQ_Q8_0) {
        g->a0 = g->a1 = f16_to_f32(blk);
        g->b0 = 0.0f;
    } else if (T == KQ_Q5_0) {
        const float d = f16_to_f32(blk);
        g->a0 = g->a1 = d;
        g->b0 = -16.0f * d;
    } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
        int sc, m;
        kq_scale_min(blk + 4, j, &sc, &m);
        g->a0 = g->a1 = f16_to_f32(blk) * (float)sc;
        g->b0 = -(f16_to_f32(blk + 2) * (float)m);
    } else { /* Q6_K */
        const float d = f16_to_f32(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        g->a0 = d * (float)sc[2 * j];
        g->a1 = d * (float)sc[2 * j + 1];
        g->b0 = -32.0f * g->a0;
        g->b1 = -32.0f * g->a1;
        g->half = 1;
    }
}

static inline __attribute__((always_inline)) void kq_group_codes_scalar(const int T, const uint8_t *blk, int j,
                                                                         uint8_t c[32], int8_t sgn[32]) {
    for (int e = 0; e < 32; e++) sgn[e] = 1;
    if (T == KQ_Q8_0) {
        for (int e = 0; e < 32; e++) {
            const int8_t q = (int8_t)blk[2 + e];
            c[e] = (uint8_t)(q < 0 ? -q : q);
            sgn[e] = q < 0 ? -1 : (q > 0 ? 1 : 0);
        }
    } else if (T == KQ_Q5_0) {
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        for (int e = 0; e < 32; e++) {
            const uint8_t nib = e < 16 ? (blk[6 + e] & 15) : (blk[6 + e - 16] >> 4);
            c[e] = (uint8_t)(nib | (((qh >> e) & 1u) << 4));
        }
    } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
        const uint8_t *qs = blk + (T == KQ_Q4_K ? 16 : 48) + 32 * (j / 2);
        for (int e = 0; e < 32; e++) {
            c[e] = (j & 1) ? (qs[e] >> 4) : (qs[e] & 15);
            if (T == KQ_Q5_K) c[e] |= (uint8_t)(((blk[16 + e] >> j) & 1) << 4);
        }
    } else { /* Q6_K: group j = 4 h + s */
        const int h = j / 4, s = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (s & 1), *qh = blk + 128 + 32 * h;
        for (int e = 0; e < 32; e++) {
            const uint8_t lo = (s >= 2) ? (ql[e] >> 4) : (ql[e] & 15);
            c[e] = (uint8_t)(lo | (((qh[e] >> (2 * s)) & 3) << 4));
        }
    }
}

#if KQ_SIMD
static inline __attribute__((always_inline)) kq_codes kq_group_codes(const int T, const uint8_t *blk, int j) {
    kq_codes r;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (T == KQ_Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        r.c = _mm256_abs_epi8(q); /* -128 -> 0x80 = 128 as u8 */
        r.sgn = q;
        return r;
    }
    r.sgn = _mm256_setzero_si256();
    if (T == KQ_Q5_0) {
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
        const __m256i nib = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        r.c = _mm256_or_si256(nib, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
#else
        r.c = _mm256_or_si256(nib, _mm256_and_si256(kq_bits_to_bytes(qh), _mm256_set1_epi8(16)));
#endif
    } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (T == KQ_Q4_K ? 16 : 48) + 32 * (j / 2)));
        r.c = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4) : _mm256_and_si256(qs, m4);
        if (T == KQ_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
            r.c = _mm256_or_si256(r.c, _mm256_slli_epi16(bit, 4));
        }
    } else { /* Q6_K */
        const int h = j / 4, s = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (s & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = (s >= 2) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), _mm256_set1_epi8(3));
        r.c = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
    }
    return r;
}

/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the order the scalar path repeats */
static inline float kq_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float kq_hsum_scalar(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* ---- the matmul ---------------------------------------------------------------------------------------------- */

typedef struct {
    const int8_t *xhi, *xlo;
    const float *xs, *xsum32, *xsum16;
    int64_t K;
} kq_act;

/* Rows m0 .. m0 + MR - 1 of out (float32 sums before the store) for weight row `row` of type T. */
static inline __attribute__((always_inline)) void kq_row_tile(const int T, const int MR, const uint8_t *row,
                                                              const kq_act *a, int64_t m0, float *res) {
    const int64_t K = a->K, nb32 = K / 32;
    const int qk = (T == KQ_Q8_0 || T == KQ_Q5_0) ? 32 : 256;
    const int bsize = T == KQ_Q8_0 ? 34 : T == KQ_Q5_0 ? 22 : T == KQ_Q4_K ? 144 : T == KQ_Q5_K ? 176 : 210;
    const int ng = qk / 32;
    float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if KQ_SIMD
    __m256 acc[4];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
#else
    float acc[4][8];
    for (int r = 0; r < MR; r++)
        for (int l = 0; l < 8; l++) acc[r][l] = 0.0f;
#endif
    for (int64_t sb = 0; sb < K / qk; sb++) {
        const uint8_t *blk = row + sb * bsize;
        kq_group gs[8];
        for (int j = 0; j < ng; j++) kq_group_scales(T, blk, j, &gs[j]);
        for (int j = 0; j < ng; j++) {
            const int64_t gi = sb * ng + j; /* 32-group index along K */
            const kq_group g = gs[j];
#if KQ_SIMD
            const kq_codes cd = kq_group_codes(T, blk, j);
#else
            uint8_t c[32];
            int8_t sgn[32];
            kq_group_codes_scalar(T, blk, j, c, sgn);
#endif
            for (int r = 0; r < MR; r++) {
                const int64_t m = m0 + r;
                const float xs = a->xs[m * nb32 + gi];
#if KQ_SIMD
                __m256i xh = _mm256_loadu_si256((const __m256i *)(a->xhi + m * K + 32 * gi));
                __m256i xl = _mm256_loadu_si256((const __m256i *)(a->xlo + m * K + 32 * gi));
                if (T == KQ_Q8_0) {
                    xh = _mm256_sign_epi8(xh, cd.sgn);
                    xl = _mm256_sign_epi8(xl, cd.sgn);
                }
                const __m256i dh = kq_dp(_mm256_setzero_si256(), cd.c, xh);
                const __m256i dl = kq_dp(_mm256_setzero_si256(), cd.c, xl);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(dh, 7), dl));
                const __m256 sv = g.half ? _mm256_set_m128(_mm_set1_ps(g.a1 * xs), _mm_set1_ps(g.a0 * xs))
                                         : _mm256_set1_ps(g.a0 * xs);
                acc[r] = _mm256_fmadd_ps(dot, sv, acc[r]);
#else
                const int8_t *xh = a->xhi + m * K + 32 * gi, *xl = a->xlo + m * K + 32 * gi;
                for (int l = 0; l < 8; l++) {
                    int32_t d = 0;
                    for (int e = 4 * l; e < 4 * l + 4; e++) d += (int32_t)c[e] * sgn[e] * (128 * xh[e] + xl[e]);
                    const float sv = (g.half && l >= 4) ? g.a1 * xs : g.a0 * xs;
                    acc[r][l] = fmaf((float)d, sv, acc[r][l]);
                }
#endif
                if (g.half) {
                    sacc[r] = fmaf(g.b0, a->xsum16[m * 2 * nb32 + 2 * gi], sacc[r]);
                    sacc[r] = fmaf(g.b1, a->xsum16[m * 2 * nb32 + 2 * gi + 1], sacc[r]);
                } else if (T != KQ_Q8_0) {
                    sacc[r] = fmaf(g.b0, a->xsum32[m * nb32 + gi], sacc[r]);
                }
            }
        }
    }
    for (int r = 0; r < MR; r++) {
#if KQ_SIMD
        res[r] = kq_hsum(acc[r]) + sacc[r];
#else
        res[r] = kq_hsum_scalar(acc[r]) + sacc[r];
#endif
    }
}

/* Weight rows n0 .. n1 - 1 for all M activation rows. */
static inline __attribute__((always_inline)) void kq_rows_t(const int T, const uint8_t *w, int64_t n0, int64_t n1,
                                                             int64_t row_bytes, const kq_act *a, int64_t M,
                                                             void *out, int64_t ldo, int out_bf16) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float res[4];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = M - m0 < 4 ? M - m0 : 4;
            switch (mr) { /* every row tile computes each of its rows exactly as a tile of one would */
                case 4: kq_row_tile(T, 4, row, a, m0, res); break;
                case 3: kq_row_tile(T, 3, row, a, m0, res); break;
                case 2: kq_row_tile(T, 2, row, a, m0, res); break;
                default: kq_row_tile(T, 1, row, a, m0, res); break;
            }
            for (int64_t r = 0; r < mr; r++) {
                if (out_bf16)
                    ((uint16_t *)out)[(m0 + r) * ldo + n] = f32_to_bf16(res[r]);
                else
                    ((float *)out)[(m0 + r) * ldo + n] = res[r];
            }
        }
    }
}

#define KQ_ROWS_PER_TASK 16

/* out[m][n] (at out + m * ldo + n; float32, or bf16 if out_bf16) = sum_k x[m][k] w[n][k] for the activations
 * prepared by kq_quantize_act. type: ggml type id (6, 8, 12, 13, 14); K % 256 == 0 for the K-quants, K % 32 == 0
 * for the others. Returns 0, or -1 for an unsupported type. */
int kq_matmul(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, const int8_t *xhi,
              const int8_t *xlo, const float *xs, const float *xsum32, const float *xsum16, int64_t M, void *out,
              int64_t ldo, int out_bf16) {
    if (type != KQ_Q8_0 && type != KQ_Q5_0 && type != KQ_Q4_K && type != KQ_Q5_K && type != KQ_Q6_K) return -1;
    const kq_act a = {xhi, xlo, xs, xsum32, xsum16, K};
    const int64_t n_tasks = (N + KQ_ROWS_PER_TASK - 1) / KQ_ROWS_PER_TASK;
    /* the type switch sits inside the parallel loop, so the outlined OpenMP body is specialized per type */
#pragma omp parallel for schedule(static) if (N * M * K >= 1 << 18)
    for (int64_t t = 0; t < n_tasks; t++) {
        const int64_t n0 = t * KQ_ROWS_PER_TASK, n1 = n0 + KQ_ROWS_PER_TASK < N ? n0 + KQ_ROWS_PER_TASK : N;
        switch (type) {
            case KQ_Q8_0: kq_rows_t(KQ_Q8_0, w, n0, n1, row_bytes, &a, M, out, ldo, out_bf16); break;
            case KQ_Q5_0: kq_rows_t(KQ_Q5_0, w, n0, n1, row_bytes, &a, M, out, ldo, out_bf16); break;
            case KQ_Q4_K: kq_rows_t(KQ_Q4_K, w, n0, n1, row_bytes, &a, M, out, ldo, out_bf16); break;
            case KQ_Q5_K: kq_rows_t(KQ_Q5_K, w, n0, n1, row_bytes, &a, M, out, ldo, out_bf16); break;
            default: kq_rows_t(KQ_Q6_K, w, n0, n1, row_bytes, &a, M, out, ldo, out_bf16); break;
        }
    }
    return 0;
}

/* ---- dequantization of whole rows (embedding lookups) ------------------------------------------------------- */

static inline __attribute__((always_inline)) void kq_dequant_row_t(const int T, const uint8_t *row, int64_t K,
                                                                    float *o) {
    const int qk = (T == KQ_Q8_0 || T == KQ_Q5_0) ? 32 : 256;
    const int bsize = T == KQ_Q8_0 ? 34 : T == KQ_Q5_0 ? 22 : T == KQ_Q4_K ? 144 : T == KQ_Q5_K ? 176 : 210;
    for (int64_t sb = 0; sb < K / qk; sb++) {
        const uint8_t *blk = row + sb * bsize;
        for (int j = 0; j < qk / 32; j++) {
            kq_group g;
            uint8_t c[32];
            int8_t sgn[32];
            kq_group_scales(T, blk, j, &g);
            kq_group_codes_scalar(T, blk, j, c, sgn);
            float *oj = o + sb * qk + 32 * j;
            for (int e = 0; e < 32; e++) {
                /* gguf's float32 values: d q, d (q - 16), d sc (q - 32) are exact; d sc q - dmin m rounds once */
                if (T == KQ_Q8_0) oj[e] = g.a0 * (float)((int)c[e] * sgn[e]);
                else if (T == KQ_Q5_0) oj[e] = g.a0 * (float)((int)c[e] - 16);
                else if (T == KQ_Q6_K) oj[e] = (e < 16 ? g.a0 : g.a1) * (float)((int)c[e] - 32);
                else oj[e] = g.a0 * (float)c[e] + g.b0;
            }
        }
    }
}

/* out[i][0..K) (float32, or bf16 if out_bf16) = the dequantized row ids[i] of w. Returns 0, or -1. */
int kq_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *ids, int64_t n,
                    void *out, int out_bf16) {
    if (type != KQ_Q8_0 && type != KQ_Q5_0 && type != KQ_Q4_K && type != KQ_Q5_K && type != KQ_Q6_K) return -1;
#pragma omp parallel for schedule(static) if (n * K >= 1 << 18)
    for (int64_t i = 0; i < n; i++) {
        float buf[4096];
        const uint8_t *row = w + ids[i] * row_bytes;
        float *dst = out_bf16 ? (float *)0 : (float *)out + i * K;
        if (out_bf16) { /* rows are dequantized in chunks of 4096 inputs (a multiple of 256) */
            const int64_t qk = (type == KQ_Q8_0 || type == KQ_Q5_0) ? 32 : 256;
            const int64_t bsize = type == KQ_Q8_0 ? 34 : type == KQ_Q5_0 ? 22 : type == KQ_Q4_K ? 144
                                : type == KQ_Q5_K ? 176 : 210;
            for (int64_t k0 = 0; k0 < K; k0 += 4096) {
                const int64_t kk = K - k0 < 4096 ? K - k0 : 4096;
                const uint8_t *r0 = row + k0 / qk * bsize;
                switch (type) {
                    case KQ_Q8_0: kq_dequant_row_t(KQ_Q8_0, r0, kk, buf); break;
                    case KQ_Q5_0: kq_dequant_row_t(KQ_Q5_0, r0, kk, buf); break;
                    case KQ_Q4_K: kq_dequant_row_t(KQ_Q4_K, r0, kk, buf); break;
                    case KQ_Q5_K: kq_dequant_row_t(KQ_Q5_K, r0, kk, buf); break;
                    default: kq_dequant_row_t(KQ_Q6_K, r0, kk, buf); break;
                }
                uint16_t *ob = (uint16_t *)out + i * K + k0;
                for (int64_t e = 0; e < kk; e++) ob[e] = f32_to_bf16(buf[e]);
            }
        } else {
            switch (type) {
                case KQ_Q8_0: kq_dequant_row_t(KQ_Q8_0, row, K, dst); break;
                case KQ_Q5_0: kq_dequant_row_t(KQ_Q5_0, row, K, dst); break;
                case KQ_Q4_K: kq_dequant_row_t(KQ_Q4_K, row, K, dst); break;
                case KQ_Q5_K: kq_dequant_row_t(KQ_Q5_K, row, K, dst); break;
                default: kq_dequant_row_t(KQ_Q6_K, row, K, dst); break;
            }
        }
    }
    return 0;
}
