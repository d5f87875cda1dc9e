/* Fused element-wise CPU ops for the decoder layer, in plain C + OpenMP (one pass over memory instead of 4-8 torch
 * ops, each with its own dispatch and OpenMP region).
 *
 * Numerics follow the torch ops they replace (see pagedllm/layers/layernorm.py and activation use in the models):
 *  - add_rms_norm: residual' = round(x + residual) in the storage dtype (as a bf16 ``x + residual``), then
 *    y = round(residual' / sqrt(mean(residual'^2) + eps) * weight) with the norm in float32 and one final rounding
 *    (as ``F.rms_norm`` with a weight upcasts and rounds once). RMSNorm: Zhang & Sennrich 2019.
 *  - silu_mul: y = round(round(silu(gate)) * up), silu in float32 (as ``F.silu(gate) * up`` in bf16).
 * Rows are [T, H] contiguous.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#include "bf16.h"
#include "omp_for.h"
#include "pagedllm_kernels.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"
#endif

#define PAR_MIN_ELEMS 262144

#define DEFINE_RMS(NAME, T, LOAD, STORE, ROUND)                                                               \
void NAME(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows, int64_t H,  \
          float eps) {                                                                                        \
    OMP_FOR_IF(rows * H >= PAR_MIN_ELEMS,                                                                     \
    for (int64_t r = 0; r < rows; ++r) {                                                                      \
        const T* xr = x + r * H;                                                                              \
        T* orow = out + r * H;                                                                                \
        float ss = 0.f;                                                                                       \
        if (residual) {                                                                                       \
            const T* rr = residual + r * H;                                                                   \
            T* ro = residual_out + r * H;                                                                     \
            for (int64_t i = 0; i < H; ++i) {                                                                 \
                const float v = ROUND(LOAD(xr[i]) + LOAD(rr[i]));                                             \
                ro[i] = STORE(v);                                                                             \
                ss += v * v;                                                                                  \
            }                                                                                                 \
            xr = ro;                                                                                          \
        } else {                                                                                              \
            for (int64_t i = 0; i < H; ++i) { const float v = LOAD(xr[i]); ss += v * v; }                    \
        }                                                                                                     \
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);                                                 \
        for (int64_t i = 0; i < H; ++i) orow[i] = STORE(LOAD(xr[i]) * inv * LOAD(weight[i]));                 \
    });                                                                                                       \
}

#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                          \
void NAME(const T* gu, T* out, int64_t rows, int64_t I) {                                                     \
    OMP_FOR_IF(rows * I >= PAR_MIN_ELEMS,                                                                     \
    for (int64_t r = 0; r < rows; ++r) {                                                                      \
        const T* g = gu + r * 2 * I;                                                                          \
        const T* u = g + I;                                                                                   \
        T* o = out + r * I;                                                                                   \
        for (int64_t i = 0; i < I; ++i) {                                                                     \
            const float gv = LOAD(g[i]);                                                                      \
            const float s = ROUND(gv / (1.0f + expf(-gv)));                                                   \
            o[i] = STORE(s * LOAD(u[i]));                                                                     \
        }                                                                                                     \
    });                                                                                                       \
}

DEFINE_RMS(add_rms_norm_f32, float, f32_id, f32_id, f32_id)

/* bf16 RMSNorms: the sum of squares in 16 float32 lanes (lane l adds elements l, l + 16, l + 32, ... in order; the
 * lanes summed at the end in one fixed tree), the same sums on every level (AVX-512: one vector; AVX2: two; scalar: an
 * array), so a row's bits never depend on the ISA nor on the other rows. A single running sum (before) was a chain
 * of H dependent adds; AMD EPYC Zen 5, Gemma 3's 640-wide norm of one decode row (the fused loop's timers, with the
 * libgomp call OMP_FOR_IF removed): 0.7 -> 0.3 us. The order differs from torch's by float32 rounding only. */
static inline float lanes16_total(const float* l) {
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Sum of squares of row x [H] in lanes16 order; with `res`: x' = round(x + res) is written to res_out first and
 * summed instead (the residual add of add_rms_norm). */
static inline float bf16_row_sumsq(const uint16_t* x, const uint16_t* res, uint16_t* res_out, int64_t H) {
    float lanes[16] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= H; i += 16) {
        __m512 v = load16_bf16(x + i);
        if (res) {
            v = round16_bf16(_mm512_add_ps(v, load16_bf16(res + i)));
            _mm256_storeu_si256((__m256i*)(res_out + i), store16_bf16_bits(v));
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    _mm512_storeu_ps(lanes, acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= H; i += 16) {
        __m256 v0 = load8_bf16(x + i), v1 = load8_bf16(x + i + 8);
        if (res) {
            v0 = round8_bf16(_mm256_add_ps(v0, load8_bf16(res + i)));
            v1 = round8_bf16(_mm256_add_ps(v1, load8_bf16(res + i + 8)));
            _mm_storeu_si128((__m128i*)(res_out + i), store8_bf16_bits(v0));
            _mm_storeu_si128((__m128i*)(res_out + i + 8), store8_bf16_bits(v1));
        }
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(v0, v0));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(v1, v1));
    }
    _mm256_storeu_ps(lanes, acc0);
    _mm256_storeu_ps(lanes + 8, acc1);
#endif
    for (; i < H; ++i) {
        float v = bf16_to_f32(x[i]);
        if (res) {
            v = round_bf16(v + bf16_to_f32(res[i]));
            res_out[i] = f32_to_bf16(v);
        }
        lanes[i % 16] += v * v;
    }
    return lanes16_total(lanes);
}

/* out [H] = round(x [H] * inv * w) with w bf16 (wb) or float32 (wf). */
static inline void bf16_row_scale(const uint16_t* x, float inv, const uint16_t* wb, const float* wf, uint16_t* out,
                                  int64_t H) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; i + 16 <= H; i += 16) {
        const __m512 w = wb ? load16_bf16(wb + i) : _mm512_loadu_ps(wf + i);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16_bf16(x + i), iv), w);
        _mm256_storeu_si256((__m256i*)(out + i), store16_bf16_bits(y));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 8 <= H; i += 8) {
        const __m256 w = wb ? load8_bf16(wb + i) : _mm256_loadu_ps(wf + i);
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(load8_bf16(x + i), iv), w);
        _mm_storeu_si128((__m128i*)(out + i), store8_bf16_bits(y));
    }
#endif
    for (; i < H; ++i) out[i] = f32_to_bf16(bf16_to_f32(x[i]) * inv * (wb ? bf16_to_f32(wb[i]) : wf[i]));
}

void add_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, uint16_t* out,
                       uint16_t* residual_out, int64_t rows, int64_t H, float eps) {
    OMP_FOR_IF(rows * H >= PAR_MIN_ELEMS,
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * H;
        const float ss = bf16_row_sumsq(xr, residual ? residual + r * H : NULL,
                                        residual ? residual_out + r * H : NULL, H);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        bf16_row_scale(residual ? residual_out + r * H : xr, inv, weight, NULL, out + r * H, H);
    });
}

/* gelu_tanh_mul: y = round(round(gelu_tanh(gate)) * up) (as ``F.gelu(gate, approximate="tanh") * up`` in bf16: Gemma's
 * GeGLU), gelu in float32 as torch writes it, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), with
 * tanh(u) = 1 - 2 / (1 + exp(2u)) (simd.h gelu_tanh16 / gelu_tanh8). */
static inline float gelu_tanh_scalar(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float t = 1.0f - 2.0f / (1.0f + expf(fminf(u + u, 89.0f)));
    return 0.5f * x * (1.0f + t);
}
static inline float silu_scalar(float g) { return g / (1.0f + expf(-g)); }

/* y = round(round(act(gate)) * up) over rows of gate_up [rows, 2 I] (gate first) -> out [rows, I], bf16; act: 0 silu,
 * 1 gelu_tanh (constant at each call site, so each caller compiles to its own loop). silu16 / silu8 / the scalar
 * silu and the gelu_tanh ones give the same values in their lanes and tail (same polynomial for exp). */
static inline __attribute__((always_inline)) void act_mul_row(const int act, const uint16_t* g, const uint16_t* u,
                                                               uint16_t* o, int64_t I) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= I; i += 16) {
        const __m512 x = load16_bf16(g + i);
        const __m512 s = round16_bf16(act ? gelu_tanh16(x) : silu16(x));
        _mm256_storeu_si256((__m256i*)(o + i), store16_bf16_bits(_mm512_mul_ps(s, load16_bf16(u + i))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* silu8 / gelu_tanh8, the same polynomial as the 16-lane ones (the scalar expf loop took ~110 us for one
     * 8960-wide decode row on an EPYC Zen 3, 28 of them per step of a 1.5B model; this takes 16 us). */
    for (; i + 8 <= I; i += 8) {
        const __m256 x = load8_bf16(g + i);
        const __m256 s = round8_bf16(act ? gelu_tanh8(x) : silu8(x));
        _mm_storeu_si128((__m128i*)(o + i), store8_bf16_bits(_mm256_mul_ps(s, load8_bf16(u + i))));
    }
#endif
    for (; i < I; ++i) {
        const float x = bf16_to_f32(g[i]);
        o[i] = f32_to_bf16(round_bf16(act ? gelu_tanh_scalar(x) : silu_scalar(x)) * bf16_to_f32(u[i]));
    }
}
static inline __attribute__((always_inline)) void act_mul_bf16(const int act, const uint16_t* gu, uint16_t* out,
                                                                int64_t rows, int64_t I) {
    OMP_FOR_IF(rows * I >= PAR_MIN_ELEMS, for (int64_t r = 0; r < rows; ++r) {
        act_mul_row(act, gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I);
    });
}
void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t I) { act_mul_bf16(0, gu, out, rows, I); }
void gelu_tanh_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t I) {
    act_mul_bf16(1, gu, out, rows, I);
}

/* Gemma's RMSNorm (layers/layernorm.py GemmaRMSNorm, HF Gemma3RMSNorm): y = round(x / sqrt(mean(x^2) + eps) * scale)
 * with scale = 1 + weight in float32 and the whole norm in float32, one rounding at the end (as
 * ``F.rms_norm(x.float(), scale).to(bf16)``). Rows are G groups of D values per token: row (t, g) starts at
 * x + t x_stride + g D and goes to out + t out_stride + g D, so the q / k heads of a fused qkv row are normed in
 * place of a slice + cat (G = heads, D = head_dim) and a hidden state is T rows of one group (G = 1, D = hidden). */
void gemma_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const float* scale, uint16_t* out, int64_t out_stride,
                         int64_t T, int64_t G, int64_t D, float eps) {
    OMP_FOR_IF(T * G * D >= PAR_MIN_ELEMS,
    for (int64_t r = 0; r < T * G; ++r) {
        const uint16_t* xr = x + (r / G) * x_stride + (r % G) * D;
        const float inv = 1.0f / sqrtf(bf16_row_sumsq(xr, NULL, NULL, D) / (float)D + eps);
        bf16_row_scale(xr, inv, NULL, scale, out + (r / G) * out_stride + (r % G) * D, D);
    });
}
#if defined(__AVX512F__)
void silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t I) {
    OMP_FOR_IF(rows * I >= PAR_MIN_ELEMS,
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gu + r * 2 * I;
        const float* u = g + I;
        float* o = out + r * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
        for (; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    });
}
#elif defined(__AVX2__) && defined(__FMA__)
void silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t I) {
    OMP_FOR_IF(rows * I >= PAR_MIN_ELEMS,
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gu + r * 2 * I;
        const float* u = g + I;
        float* o = out + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        for (; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    });
}
#else
DEFINE_SILU_MUL(silu_mul_f32, float, f32_id, f32_id, f32_id)
#endif

/* argmax over each row of x [rows, cols] -> out [rows] int64: the first index of the maximum, as torch.argmax;
 * a row containing NaN returns the first NaN's index (torch treats NaN as the maximum). bf16 rows are compared
 * after the exact widening to float32, so both dtypes give torch's answer on the same values. */
#if defined(__AVX512F__)
#include "simd.h"
#define ARGMAX_LOADV_f32(p) _mm512_loadu_ps(p)
#define ARGMAX_LOADV_bf16(p) load16_bf16(p)
#endif
/* NAME_range: the argmax of xr[0, cols) as above (cols >= 1). NAME: rows in parallel when there are several; a single
 * long row (a decode step's logits, >= ARGMAX_SPLIT_COLS) is cut into one contiguous part per thread, each thread
 * reading the part its share of the LM head GEMV wrote (the same static halves, already in its own cache; AMD EPYC
 * Zen 3, Gemma 3's 262,144 logits: one thread reading both halves took ~0.17 ms in the engine's decode step, ~0.04 ms
 * on a row no other core had just written, ~0.1 ms split, Python call included), then the parts merge in order: the first
 * part holding a NaN, else the largest value, the earlier part on ties, which is the whole row's answer. */
#define ARGMAX_SPLIT_COLS 65536
#define DEFINE_ARGMAX(NAME, T, LOAD, SUFFIX)                                                                  \
static int64_t NAME##_range(const T* xr, int64_t cols) {                                                      \
    int64_t best = 0, i = 0;                                                                                  \
    float bv = LOAD(xr[0]);                                                                                   \
    ARGMAX_VECTOR_##SUFFIX                                                                                    \
    if (i == 0) {                                                                                             \
        if (bv != bv) return 0;                                                                               \
        i = 1;                                                                                                \
    }                                                                                                         \
    for (; i < cols; ++i) {                                                                                   \
        const float v = LOAD(xr[i]);                                                                          \
        if (v != v) return i;                                                                                 \
        if (v > bv) { bv = v; best = i; }                                                                     \
    }                                                                                                         \
    return best;                                                                                              \
}                                                                                                             \
void NAME(const T* x, int64_t* out, int64_t rows, int64_t cols) {                                             \
    if (rows == 1 && cols >= ARGMAX_SPLIT_COLS && omp_get_max_threads() > 1) {                                \
        int64_t part[64];                                                                                     \
        int nth = 1;                                                                                          \
        _Pragma("omp parallel num_threads(omp_get_max_threads() < 64 ? omp_get_max_threads() : 64)")       \
        {                                                                                                     \
            const int n = omp_get_num_threads(), t = omp_get_thread_num();                                    \
            const int64_t c0 = cols * t / n, c1 = cols * (t + 1) / n;                                         \
            part[t] = c0 + NAME##_range(x + c0, c1 - c0);                                                     \
            if (t == 0) nth = n;                                                                              \
        }                                                                                                     \
        int64_t best = part[0];                                                                               \
        float bv = LOAD(x[best]);                                                                             \
        for (int t = 1; t < nth && bv == bv; ++t) {                                                           \
            const float v = LOAD(x[part[t]]);                                                                 \
            if (v != v || v > bv) { bv = v; best = part[t]; }                                                 \
        }                                                                                                     \
        out[0] = best;                                                                                        \
        return;                                                                                               \
    }                                                                                                         \
    OMP_FOR_IF(rows * cols >= PAR_MIN_ELEMS && rows > 1,                                                      \
    for (int64_t r = 0; r < rows; ++r) out[r] = NAME##_range(x + r * cols, cols););                          \
}

/* The vector bodies' lanes (running maxima vals[l] at indices idx[l]) merged: the largest, the lower index on ties. */
static inline int64_t argmax_merge_lanes(const float *vals, const int32_t *idx, int n, float *bv) {
    int64_t best = idx[0];
    *bv = vals[0];
    for (int l = 1; l < n; ++l)
        if (vals[l] > *bv || (vals[l] == *bv && idx[l] < best)) { *bv = vals[l]; best = idx[l]; }
    return best;
}

#if defined(__AVX512F__)
/* 4 x 16 running maxima (strict >, so each lane keeps its first maximum) and their indices: accumulator a, lane l
 * sees the indices 64 j + 16 a + l in increasing order (then accumulator 0 takes the last whole 16-wide chunks), so
 * the four compare/select chains run side by side (one chain was bound by its latency: ~6 cycles a 16-wide chunk,
 * ~30 us a 262,144-wide Gemma 3 row); the 64 lanes are merged at the end preferring the lower index on ties. A NaN
 * anywhere sends the row to the scalar loop from index 0. */
#define ARGMAX_VECTOR_BODY(LOADV)                                                                             \
        if (cols >= 64) {                                                                                     \
            __m512 mv[4];                                                                                     \
            __m512i mi[4], cur[4];                                                                            \
            const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);      \
            const __m512i step = _mm512_set1_epi32(64);                                                       \
            __mmask16 nan = 0;                                                                                \
            for (int a = 0; a < 4; ++a) {                                                                     \
                mv[a] = LOADV(xr + 16 * a);                                                                   \
                mi[a] = cur[a] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * a));                           \
                nan |= _mm512_cmp_ps_mask(mv[a], mv[a], _CMP_UNORD_Q);                                        \
            }                                                                                                 \
            for (i = 64; i + 64 <= cols && !nan; i += 64)                                                     \
                for (int a = 0; a < 4; ++a) {                                                                 \
                    cur[a] = _mm512_add_epi32(cur[a], step);                                                  \
                    const __m512 v = LOADV(xr + i + 16 * a);                                                  \
                    const __mmask16 gt = _mm512_cmp_ps_mask(v, mv[a], _CMP_GT_OQ);                            \
                    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                            \
                    mv[a] = _mm512_mask_mov_ps(mv[a], gt, v);                                                 \
                    mi[a] = _mm512_mask_mov_epi32(mi[a], gt, cur[a]);                                         \
                }                                                                                             \
            for (; i + 16 <= cols && !nan; i += 16) {                                                         \
                const __m512 v = LOADV(xr + i);                                                               \
                const __mmask16 gt = _mm512_cmp_ps_mask(v, mv[0], _CMP_GT_OQ);                                \
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                                \
                mv[0] = _mm512_mask_mov_ps(mv[0], gt, v);                                                     \
                mi[0] = _mm512_mask_mov_epi32(mi[0], gt, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));  \
            }                                                                                                 \
            if (nan) {                                                                                        \
                i = 0;                                                                                        \
            } else {                                                                                          \
                float vals[64];                                                                               \
                int32_t idx[64];                                                                              \
                for (int a = 0; a < 4; ++a) {                                                                 \
                    _mm512_storeu_ps(vals + 16 * a, mv[a]);                                                   \
                    _mm512_storeu_si512((void*)(idx + 16 * a), mi[a]);                                        \
                }                                                                                             \
                best = argmax_merge_lanes(vals, idx, 64, &bv);                                               \
            }                                                                                                 \
        }
#define ARGMAX_VECTOR_f32 ARGMAX_VECTOR_BODY(ARGMAX_LOADV_f32)
#define ARGMAX_VECTOR_bf16 ARGMAX_VECTOR_BODY(ARGMAX_LOADV_bf16)
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX-512 body's scheme on 4 x 8 lanes (accumulator a, lane l: indices 32 j + 8 a + l; the last whole 8-wide
 * chunks go to accumulator 0), compare masks as vectors and blends for the selects. Without it the scalar loop ran
 * ~0.3 ms a 262,144-wide Gemma 3 row (AMD EPYC Zen 3), a few % of a decode step. */
#include "simd.h"
#define ARGMAX_LOADV_f32(p) _mm256_loadu_ps(p)
#define ARGMAX_LOADV_bf16(p) load8_bf16(p)
#define ARGMAX_VECTOR_BODY(LOADV)                                                                             \
        if (cols >= 32) {                                                                                     \
            __m256 mv[4], nan = _mm256_setzero_ps();                                                          \
            __m256i mi[4], cur[4];                                                                            \
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), step = _mm256_set1_epi32(32);      \
            for (int a = 0; a < 4; ++a) {                                                                     \
                mv[a] = LOADV(xr + 8 * a);                                                                    \
                mi[a] = cur[a] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * a));                            \
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(mv[a], mv[a], _CMP_UNORD_Q));                           \
            }                                                                                                 \
            for (i = 32; i + 32 <= cols && _mm256_testz_ps(nan, nan); i += 32)                               \
                for (int a = 0; a < 4; ++a) {                                                                 \
                    cur[a] = _mm256_add_epi32(cur[a], step);                                                  \
                    const __m256 v = LOADV(xr + i + 8 * a);                                                   \
                    const __m256 gt = _mm256_cmp_ps(v, mv[a], _CMP_GT_OQ);                                    \
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                               \
                    mv[a] = _mm256_blendv_ps(mv[a], v, gt);                                                   \
                    mi[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mi[a]),                  \
                                                                 _mm256_castsi256_ps(cur[a]), gt));           \
                }                                                                                             \
            for (; i + 8 <= cols && _mm256_testz_ps(nan, nan); i += 8) {                                      \
                const __m256 v = LOADV(xr + i);                                                               \
                const __m256 gt = _mm256_cmp_ps(v, mv[0], _CMP_GT_OQ);                                        \
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                                   \
                mv[0] = _mm256_blendv_ps(mv[0], v, gt);                                                       \
                mi[0] = _mm256_castps_si256(_mm256_blendv_ps(                                                 \
                    _mm256_castsi256_ps(mi[0]),                                                               \
                    _mm256_castsi256_ps(_mm256_add_epi32(lane, _mm256_set1_epi32((int)i))), gt));             \
            }                                                                                                 \
            if (!_mm256_testz_ps(nan, nan)) {                                                                 \
                i = 0;                                                                                        \
            } else {                                                                                          \
                float vals[32];                                                                               \
                int32_t idx[32];                                                                              \
                for (int a = 0; a < 4; ++a) {                                                                 \
                    _mm256_storeu_ps(vals + 8 * a, mv[a]);                                                    \
                    _mm256_storeu_si256((__m256i*)(idx + 8 * a), mi[a]);                                      \
                }                                                                                             \
                best = argmax_merge_lanes(vals, idx, 32, &bv);                                               \
            }                                                                                                 \
        }
#define ARGMAX_VECTOR_f32 ARGMAX_VECTOR_BODY(ARGMAX_LOADV_f32)
#define ARGMAX_VECTOR_bf16 ARGMAX_VECTOR_BODY(ARGMAX_LOADV_bf16)
#else
#define ARGMAX_VECTOR_f32
#define ARGMAX_VECTOR_bf16
#endif

DEFINE_ARGMAX(argmax_rows_f32, float, f32_id, f32)
DEFINE_ARGMAX(argmax_rows_bf16, uint16_t, bf16_to_f32, bf16)

/* Random sampling by inverse CDF, truncation included: out[r] = the first kept i (in index order) with the running sum
 * of kept weights past u[r] times their total, so a kept i is drawn with probability w_i / sum of kept w, from one
 * uniform u[r] in [0, 1) per row (an exponential race over Gemma 3's 262,144 tokens drew, logged and divided 262,144
 * of them, ~1.8 ms a row; with top_p the torch path built, sorted and masked probability tensors, ~2.5 ms a step).
 *   x [R, V] float32 logits (rows ld apart); w_i = exp(d_i), d_i = (x_i - max x) inv_t[r] (a softmax at temperature
 *   1 / inv_t[r], unnormalized), 0 where d_i < -87 (exp8's floor: -inf logits, banned tokens, get exactly 0) or
 *   w_i < min_p[r] (min_p: p_i < min_p max p); u [R] float64; out [R] int64 (0 where every w_i is 0).
 *   top_k[r] > 0: keep w_i >= the k-th largest w (ties kept); top_p[r] < 1: then keep the smallest prefix, by
 *   descending w, whose mass reaches top_p[r] times the mass min_p and top_k left (with top_k: of its k tokens), i.e.
 *   w_i >= the w of that prefix's last token. min_p, top_k, top_p may be NULL (off for every row); vLLM's order.
 * Each row is cut into SAMPLE_CHUNK-token chunks, independent of the threads: per chunk (in parallel) its max, then
 * its sum of w (8 float32 lanes, then the lanes in order) and, for truncated rows, the count and mass of the w whose
 * d is at or above each of SAMPLE_NTH thresholds. Per row (in double, chunk order): a row without top_k / top_p finds
 * the chunk where the running sum passes u S and scans it alone; a truncated row takes the tightest threshold that
 * still holds its top k tokens (or, top_p alone, top_p of the mass), gathers the tokens above it (usually tens),
 * selects (top_k) and sorts them (w descending, then index) for the cuts, and draws among the kept ones in index
 * order. Every sum has a fixed order, so a row's draw is the same bits whatever shares the call and however many
 * threads run it. Where rounding leaves the scan short of its target, the last kept token is taken. Measured on an
 * AMD EPYC Zen 3 (2 threads, one 262,144-token row): temperature alone 0.11-0.16 ms, top_p 0.95 0.14-0.25 ms, top_k
 * 64 + top_p 0.2-0.44 ms (the torch path: 1.4 ms for top_p on the same row); in the engine (Gemma 3 270M, real
 * logits) a decode step with top_p 0.95, or top_k 50 + top_p 0.9, within 0.2-0.55 ms of a greedy one (it was 1.6-2.3
 * ms over). */
#define SAMPLE_CHUNK 8192
#define SAMPLE_NTH 10
static const float sample_log_th[SAMPLE_NTH] = {-1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f,
                                                -10.0f, -13.0f, -17.0f, -87.0f}; /* on d */

/* d = (x - M) inv_t and the weight w = exp(d), 0 where d < -87 or w < fl (the row's min_p), of 8 tokens / of one;
 * every pass computes a token's w with the one its position takes (8 lanes, or the tail's scalar), so the same bits. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 sample_d8(const float *x, __m256 vm, __m256 vt) {
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), vm), vt);
}
static inline __m256 sample_w8(__m256 d, __m256 vf) {
    const __m256 e = _mm256_and_ps(exp8(d), _mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
    return _mm256_and_ps(e, _mm256_cmp_ps(e, vf, _CMP_GE_OQ));
}
#endif
static inline float sample_w1(float d, float fl) {
    const float e = d >= -87.0f ? expf(d) : 0.0f;
    return e >= fl ? e : 0.0f;
}

/* d [n] and w [n] of x [n] (row max M, inv_t, floor fl); n <= SAMPLE_CHUNK. */
static void sample_weights(const float *x, int64_t n, float M, float inv_t, float fl, float *w, float *d) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(M), vt = _mm256_set1_ps(inv_t), vf = _mm256_set1_ps(fl);
    for (; i + 8 <= n; i += 8) {
        const __m256 dv = sample_d8(x + i, vm, vt);
        _mm256_storeu_ps(d + i, dv);
        _mm256_storeu_ps(w + i, sample_w8(dv, vf));
    }
#endif
    for (; i < n; ++i) {
        d[i] = (x[i] - M) * inv_t;
        w[i] = sample_w1(d[i], fl);
    }
}

/* The max of x [n] (-inf if every x_i is -inf or NaN). */
static float sample_chunk_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm); /* a NaN x loses (second operand) */
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

/* sums[j] = the sum of the w [n] whose d [n] >= sample_log_th[j], counts[j] = how many of them have w > 0, for every
 * threshold (nth = SAMPLE_NTH) or only the last (nth = 1; its sum is every w's: w = 0 below d = -87): 8 float32 lanes
 * (token i in lane i % 8, in order), then the lanes in order. 8-token blocks entirely below the second last threshold
 * add only to the last (elsewhere they would add zeros: the same sums). */
static void sample_stats(const float *w, const float *d, int64_t n, int nth, double *sums, int64_t *counts) {
    float lanes[SAMPLE_NTH][8] = {{0}};
    int64_t cnt[SAMPLE_NTH] = {0}, i = 0;
    const int last = SAMPLE_NTH - 1;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    __m256i vc = _mm256_setzero_si256();
    const __m256 z = _mm256_setzero_ps(), low = _mm256_set1_ps(sample_log_th[last - 1]);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i), dv = _mm256_loadu_ps(d + i), pos = _mm256_cmp_ps(v, z, _CMP_GT_OQ);
        acc = _mm256_add_ps(acc, v);
        vc = _mm256_sub_epi32(vc, _mm256_castps_si256(pos));
        if (nth == 1 || !_mm256_movemask_ps(_mm256_cmp_ps(dv, low, _CMP_GE_OQ))) continue;
        for (int j = 0; j < last; ++j) {
            const __m256 m = _mm256_and_ps(_mm256_cmp_ps(dv, _mm256_set1_ps(sample_log_th[j]), _CMP_GE_OQ), pos);
            _mm256_storeu_ps(lanes[j], _mm256_add_ps(_mm256_loadu_ps(lanes[j]), _mm256_and_ps(v, m)));
            cnt[j] += __builtin_popcount((unsigned)_mm256_movemask_ps(m));
        }
    }
    _mm256_storeu_ps(lanes[last], acc);
    int32_t c8[8];
    _mm256_storeu_si256((__m256i *)c8, vc);
    for (int l = 0; l < 8; ++l) cnt[last] += c8[l];
#endif
    for (; i < n; ++i) {
        if (!(w[i] > 0.0f)) continue;
        lanes[last][i % 8] += w[i];
        cnt[last]++;
        for (int j = 0; j < last && nth > 1; ++j)
            if (d[i] >= sample_log_th[j]) {
                lanes[j][i % 8] += w[i];
                cnt[j]++;
            }
    }
    for (int j = nth == 1 ? last : 0; j < SAMPLE_NTH; ++j) {
        double s = 0.0;
        for (int l = 0; l < 8; ++l) s += lanes[j][l];
        sums[j] = s;
        counts[j] = cnt[j];
    }
}

typedef struct { float w; int64_t i; } sample_cand_t;

static int sample_cand_desc(const void *a, const void *b) {
    const sample_cand_t *p = (const sample_cand_t *)a, *q = (const sample_cand_t *)b;
    if (p->w != q->w) return p->w > q->w ? -1 : 1;
    return p->i < q->i ? -1 : p->i > q->i;
}

/* Reorders c [n] so that its first k (0 < k < n) are its k first in sample_cand_desc order (Hoare's selection). */
static void sample_select(sample_cand_t *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const sample_cand_t pv = c[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (sample_cand_desc(&c[i], &pv) < 0) i++;
            while (sample_cand_desc(&c[j], &pv) > 0) j--;
            if (i <= j) {
                const sample_cand_t t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* Appends to c (at *n, at most cap) the tokens of x [m] (the first at index c0) with d >= th and w > 0, in order,
 * computing w only for the 8-token blocks that hold one (sample_weights' bits). */
static void sample_gather(const float *x, int64_t m, int64_t c0, float M, float inv_t, float fl, float th,
                          sample_cand_t *c, int64_t *n, int64_t cap) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(M), vt = _mm256_set1_ps(inv_t), vf = _mm256_set1_ps(fl), vth = _mm256_set1_ps(th);
    for (; i + 8 <= m; i += 8) {
        const __m256 dv = sample_d8(x + i, vm, vt);
        if (!_mm256_movemask_ps(_mm256_cmp_ps(dv, vth, _CMP_GE_OQ))) continue;
        float d8[8], w8[8];
        _mm256_storeu_ps(d8, dv);
        _mm256_storeu_ps(w8, sample_w8(dv, vf));
        for (int l = 0; l < 8; ++l)
            if (d8[l] >= th && w8[l] > 0.0f && *n < cap) c[(*n)++] = (sample_cand_t){w8[l], c0 + i + l};
    }
#endif
    for (; i < m; ++i) {
        const float d = (x[i] - M) * inv_t, w = sample_w1(d, fl);
        if (d >= th && w > 0.0f && *n < cap) c[(*n)++] = (sample_cand_t){w, c0 + i};
    }
}

int sample_rows_f32(const float *x, int64_t R, int64_t V, int64_t ld, const float *inv_t, const float *min_p,
                    const int64_t *top_k, const float *top_p, const double *u, int64_t *out) {
    const int64_t nc = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK, NT = SAMPLE_NTH, ALL = SAMPLE_NTH - 1;
    const int nthr = omp_get_max_threads();
    float *cm = (float *)malloc(sizeof(float) * (size_t)(R * nc)), *rm = (float *)malloc(sizeof(float) * (size_t)R);
    /* [r][c][j]: the sum and count above threshold j; the last's (ALL) are every w's */
    double *cs = (double *)malloc(sizeof(double) * (size_t)(R * nc * NT));
    int64_t *cn = (int64_t *)malloc(sizeof(int64_t) * (size_t)(R * nc * NT));
    float *wd = (float *)malloc(sizeof(float) * 2 * SAMPLE_CHUNK * (size_t)nthr); /* w, d per thread */
    int failed = !cm || !rm || !cs || !cn || !wd;
    if (failed) {
        free(cm);
        free(rm);
        free(cs);
        free(cn);
        free(wd);
        return -1;
    }
#define SAMPLE_TRUNC(r) ((top_k && top_k[r] > 0) || (top_p && top_p[r] < 1.0f))
#define SAMPLE_FLOOR(r) (min_p && min_p[r] > 0.0f ? min_p[r] : 0.0f)
#pragma omp parallel if (R * V >= 1 << 16) num_threads(nthr)
    {
        float *w = wd + (size_t)omp_get_thread_num() * 2 * SAMPLE_CHUNK, *d = w + SAMPLE_CHUNK;
#pragma omp for schedule(static)
        for (int64_t k = 0; k < R * nc; ++k) {
            const int64_t r = k / nc, c0 = (k % nc) * SAMPLE_CHUNK, n = V - c0 < SAMPLE_CHUNK ? V - c0 : SAMPLE_CHUNK;
            cm[k] = sample_chunk_max(x + r * ld + c0, n);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            float M = -INFINITY;
            for (int64_t c = 0; c < nc; ++c) M = cm[r * nc + c] > M ? cm[r * nc + c] : M;
            rm[r] = M;
        }
#pragma omp for schedule(static)
        for (int64_t k = 0; k < R * nc; ++k) {
            const int64_t r = k / nc, c0 = (k % nc) * SAMPLE_CHUNK, n = V - c0 < SAMPLE_CHUNK ? V - c0 : SAMPLE_CHUNK;
            for (int64_t j = 0; j < NT; ++j) {
                cs[k * NT + j] = 0.0;
                cn[k * NT + j] = 0;
            }
            if (rm[r] == -INFINITY) continue;
            sample_weights(x + r * ld + c0, n, rm[r], inv_t[r], SAMPLE_FLOOR(r), w, d);
            sample_stats(w, d, n, SAMPLE_TRUNC(r) ? SAMPLE_NTH : 1, cs + k * NT, cn + k * NT);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            const float *xr = x + r * ld, M = rm[r], t = inv_t[r], fl = SAMPLE_FLOOR(r);
            const double *csr = cs + r * nc * NT;
            double S = 0.0;
            for (int64_t c = 0; c < nc; ++c) S += csr[c * NT + ALL];
            out[r] = 0;
            if (!(S > 0.0)) continue;
            if (!SAMPLE_TRUNC(r)) { /* the chunk where the running sum passes u S, then that chunk alone */
                const double target = u[r] * S;
                double before = 0.0;
                int64_t c = 0, last = -1;
                for (; c < nc; ++c) {
                    if (!(csr[c * NT + ALL] > 0.0)) continue;
                    last = c;
                    if (before + csr[c * NT + ALL] > target) break;
                    before += csr[c * NT + ALL];
                }
                if (c == nc) c = last; /* rounding: the target at or past the total */
                const int64_t c0 = c * SAMPLE_CHUNK, n = V - c0 < SAMPLE_CHUNK ? V - c0 : SAMPLE_CHUNK;
                sample_weights(xr + c0, n, M, t, fl, w, d);
                double acc = 0.0;
                int64_t i = 0, nz = 0;
                for (; i < n; ++i) {
                    if (w[i] > 0.0f) nz = i;
                    acc += w[i];
                    if (w[i] > 0.0f && acc > target - before) break;
                }
                out[r] = c0 + (i < n ? i : nz);
                continue;
            }
            const int64_t k = top_k && top_k[r] > 0 ? top_k[r] : 0;
            const double p = top_p && top_p[r] < 1.0f ? (double)top_p[r] : 1.0;
            int j = 0; /* the tightest threshold holding the top k tokens (or top_p of the mass) */
            int64_t cnt = 0;
            for (; j < NT; ++j) {
                double mass = 0.0;
                cnt = 0;
                for (int64_t c = 0; c < nc; ++c) {
                    mass += csr[c * NT + j];
                    cnt += cn[(r * nc + c) * NT + j];
                }
                if (j == ALL || (cnt > 0 && (k ? cnt >= k : mass >= p * S))) break;
            }
            sample_cand_t *cand = (sample_cand_t *)malloc(sizeof(sample_cand_t) * (size_t)(2 * cnt + 1));
            if (!cand) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            sample_cand_t *sorted = cand + cnt;
            int64_t n = 0;
            for (int64_t c = 0; c < nc; ++c) {
                if (cn[(r * nc + c) * NT + j] == 0) continue;
                const int64_t c0 = c * SAMPLE_CHUNK, m = V - c0 < SAMPLE_CHUNK ? V - c0 : SAMPLE_CHUNK;
                sample_gather(xr + c0, m, c0, M, t, fl, sample_log_th[j], cand, &n, cnt);
            }
            for (int64_t i = 0; i < n; ++i) sorted[i] = cand[i];
            int64_t ns = n; /* sorted[0 .. ns) in order: with top_k only its k first are read */
            if (k && k < n) {
                sample_select(sorted, n, k);
                ns = k;
            }
            qsort(sorted, (size_t)ns, sizeof(sample_cand_t), sample_cand_desc);
            float cut = 0.0f;
            double mass = S;
            if (k && k < n) {
                cut = sorted[k - 1].w;
                mass = 0.0;
                for (int64_t i = 0; i < k; ++i) mass += sorted[i].w;
            } else if (k) {
                mass = 0.0;
                for (int64_t i = 0; i < n; ++i) mass += sorted[i].w;
            }
            if (p < 1.0 && ns > 0) { /* the first prefix whose mass reaches p mass: its last token's w */
                const double target = p * mass;
                double cum = 0.0;
                int64_t i = 0;
                for (; i < ns - 1; ++i) {
                    cum += sorted[i].w;
                    if (cum >= target) break;
                }
                cut = sorted[i].w > cut ? sorted[i].w : cut;
            }
            double total = 0.0;
            for (int64_t i = 0; i < n; ++i) total += cand[i].w >= cut ? cand[i].w : 0.0;
            const double target = u[r] * total;
            double acc = 0.0;
            int64_t pick = -1;
            for (int64_t i = 0; i < n; ++i) {
                if (cand[i].w < cut) continue;
                pick = cand[i].i;
                acc += cand[i].w;
                if (acc > target) break;
            }
            out[r] = pick < 0 ? 0 : pick;
            free(cand);
        }
    }
#undef SAMPLE_TRUNC
#undef SAMPLE_FLOOR
    free(cm);
    free(rm);
    free(cs);
    free(cn);
    free(wd);
    return failed ? -1 : 0;
}

/* Rotary embedding (NeoX "rotate half" form, as HF's apply_rotary_pos_emb) on q and k of every token, in place, then
 * K and V written into the paged cache at their slots.
 *   qkv  [T, row_stride]: q heads [0, H), k heads [H, H + KVH), v heads after (each D wide), contiguous per row;
 *   cs   [T, cs_stride]: cos at cs[t], sin at cs[t] + D (the rotary cache stores [cos, cos] and [-sin, sin]);
 *   cache_k / cache_v [num_slots, KVH, D]; slots [T] int64.
 * y = round(round(x * cos) + roll(x, D/2) * sin), the two roundings of torch.addcmul(x * cos, roll(x), sin). */
#define DEFINE_ROPE_CACHE(NAME, T, LOAD, STORE, ROUND)                                                       \
void NAME(T* qkv, int64_t row_stride, const T* cs, int64_t cs_stride, T* cache_k, T* cache_v,              \
          const int64_t* slots, int64_t T_, int H, int KVH, int D) {                                          \
    const int half = D / 2;                                                                                   \
    OMP_FOR_IF(T_ * (H + KVH) * D >= PAR_MIN_ELEMS,                                                           \
    for (int64_t t = 0; t < T_; ++t) {                                                                        \
        T* row = qkv + t * row_stride;                                                                        \
        const T* c = cs + t * cs_stride;                                                                      \
        const T* s = c + D;                                                                                   \
        float x[512];                                                                                         \
        for (int h = 0; h < H + KVH; ++h) {                                                                   \
            T* xp = row + (int64_t)h * D;                                                                     \
            for (int i = 0; i < D; ++i) x[i] = LOAD(xp[i]);                                                   \
            /* the two halves apart (rotate-half partner i + D/2, then i - D/2) so that each loop vectorizes */ \
            for (int i = 0; i < half; ++i)                                                                    \
                xp[i] = STORE(ROUND(x[i] * LOAD(c[i])) + x[i + half] * LOAD(s[i]));                           \
            for (int i = half; i < D; ++i)                                                                    \
                xp[i] = STORE(ROUND(x[i] * LOAD(c[i])) + x[i - half] * LOAD(s[i]));                           \
        }                                                                                                     \
        const int64_t base = slots[t] * (int64_t)KVH * D;                                                     \
        const T* kp = row + (int64_t)H * D;                                                                   \
        const T* vp = kp + (int64_t)KVH * D;                                                                  \
        for (int i = 0; i < KVH * D; ++i) { cache_k[base + i] = kp[i]; cache_v[base + i] = vp[i]; }           \
    });                                                                                                       \
}

DEFINE_ROPE_CACHE(rope_cache_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_ROPE_CACHE(rope_cache_f32, float, f32_id, f32_id, f32_id)

/* Structured outputs: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (xgrammar's token bitmask: int32
 * words, bit t % 32 of word t / 32, 1 = allowed), for t < vocab.
 *   logits [*, ld] float32; rows [n_rows] int64 (logit row of bitmask row i); bitmask [n_rows, words] int32.
 * A word of all ones is skipped, one of zeros set with a plain loop the compiler vectorizes: a JSON grammar
 * allows few tokens, so the pass is ~one write of the masked rows. */
void apply_token_bitmask_f32(float *logits, int64_t ld, const int64_t *rows, int64_t n_rows, const int32_t *bitmask,
                             int64_t words, int64_t vocab) {
    const float neg = -INFINITY;
#pragma omp parallel for schedule(static) if (n_rows * vocab > (1 << 18))
    for (int64_t i = 0; i < n_rows; ++i) {
        float *row = logits + rows[i] * ld;
        const uint32_t *bm = (const uint32_t *)(bitmask + i * words);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t m = bm[w];
            if (m == 0xFFFFFFFFu) continue;
            const int64_t t0 = w * 32, n = vocab - t0 < 32 ? vocab - t0 : 32;
            if (n <= 0) break;
            if (m == 0) {
                for (int64_t j = 0; j < n; ++j) row[t0 + j] = neg;
                continue;
            }
            for (int64_t j = 0; j < n; ++j)
                if (!((m >> j) & 1u)) row[t0 + j] = neg;
        }
    }
}

/* Reads the n bytes at p once (n % 64 == 0), each OpenMP thread one contiguous share, prefetching `ahead` bytes
 * ahead of its reads (0: none), and returns their sum as 64-bit words (so no read can be dropped): `bench floor`'s
 * streaming read, the way our decode kernels read their weights. torch's sum can read slower: on an AMD EPYC Zen 5 it
 * measured 49 GB/s while the K-quant GEMV streamed 59 GB/s (2026-12-06). */
#include <omp.h>
uint64_t stream_read(const uint8_t* p, int64_t n, int64_t ahead) {
    uint64_t total = 0;
    const int64_t lines = n / 64;
#pragma omp parallel reduction(+ : total)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t l0 = lines * id / nt, l1 = lines * (id + 1) / nt;
        uint64_t a[8] = {0};
        for (int64_t l = l0; l < l1; ++l) {
            const uint64_t* w = (const uint64_t*)(p + l * 64);
            if (ahead) __builtin_prefetch(p + l * 64 + ahead, 0, 3); /* never faults, also past the end */
            for (int j = 0; j < 8; ++j) a[j] += w[j];
        }
        for (int j = 0; j < 8; ++j) total += a[j];
    }
    return total;
}
