/* SIMD helpers shared by the CPU kernels: AVX-512 (where __AVX512F__ is defined) and AVX2 + FMA (8 lanes). */
#ifndef PAGEDLLM_SIMD_H
#define PAGEDLLM_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)

static inline __m512 load16_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }

/* exp(x) for x <= 0: 2^(x log2 e) split into 2^n * 2^f, f in [-1/2, 1/2]; 2^f by its degree-6 Taylor polynomial in
 * f ln 2 (relative error < 2e-7 on that interval), then _mm512_scalef_ps applies 2^n. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Round-to-nearest-even float32 -> bf16 of 16 lanes (same rounding as the scalar f32_to_bf16; no NaN handling). */
static inline __m256i store16_bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v); /* one instruction, round to nearest even */
#else
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

/* silu(g) = g / (1 + exp(-g)) with exp16 (relative error < 2e-7, far below a bf16 ulp). Past ln(FLT_MAX) = 88.72
 * scalef makes exp(-g) inf and silu(g) -0, as torch's float32 silu (a clamp at 88 gave ~1e-37 instead). */
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(89.0f)));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* GELU, tanh approximation (torch's F.gelu(approximate="tanh")): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x +
 * 0.044715 x^3), tanh(u) = 1 - 2 / (1 + exp(2u)) with exp16. Computed in torch's order, 1 + tanh(u) included: for
 * u < -8.7 tanh(u) is -1 in float32 and the gelu exactly 0 there too (x / (1 + exp(-2u)), the same value in exact
 * arithmetic, gave tiny nonzeros where torch gives 0). */
static inline __m512 gelu_tanh16(__m512 x) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    const __m512 e = exp16(_mm512_min_ps(_mm512_add_ps(u, u), _mm512_set1_ps(89.0f)));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                   _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), t));
}

/* v rounded to bf16 and widened back to float32. */
static inline __m512 round16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(store16_bf16_bits(v)), 16));
}
#endif /* __AVX512F__ */

#if defined(__AVX2__) && defined(__FMA__)
/* bf16 pairs (8 columns x 2) -> the 8 even (K index 2p) and 8 odd (2p + 1) weights as float32. */
static inline __m256 even8(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 odd8(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* Round to nearest even float32 -> bf16 of 8 lanes (as f32_to_bf16). */
static inline __m128i store8_bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(store8_bf16_bits(v)), 16));
}
/* exp(x), x <= 0, as simd.h's exp16 (same polynomial; 2^n built in the exponent field instead of scalef). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* g / (1 + exp(x)) with exp8. exp8 builds 2^n in the exponent field, so n <= 127: for x past 88 exp(x) is
 * 2 exp(x - ln 2), and inf past ln(FLT_MAX) = 88.7228 (the result -0 or 0), as torch's float32 ops. */
static inline __m256 div_1p_exp8(__m256 g, __m256 x) {
    __m256 e = exp8(_mm256_min_ps(x, _mm256_set1_ps(88.0f)));
    const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
    if (_mm256_movemask_ps(big)) {
        const __m256 xc = _mm256_min_ps(x, _mm256_set1_ps(88.7228f));
        __m256 e2 = _mm256_mul_ps(exp8(_mm256_sub_ps(xc, _mm256_set1_ps(0.69314718f))), _mm256_set1_ps(2.0f));
        e2 = _mm256_blendv_ps(e2, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ));
        e = _mm256_blendv_ps(e, e2, big);
    }
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
/* silu(g) = g / (1 + exp(-g)). */
static inline __m256 silu8(__m256 g) { return div_1p_exp8(g, _mm256_sub_ps(_mm256_setzero_ps(), g)); }
/* GELU, tanh approximation, as gelu_tanh16 (exp(2u) through div_1p_exp8: 2 / (1 + exp(2u)) with its large-x care). */
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), div_1p_exp8(_mm256_set1_ps(2.0f), _mm256_add_ps(u, u)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

#endif /* __AVX2__ && __FMA__ */
#endif
