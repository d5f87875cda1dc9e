/* GGUF K-quant / legacy-quant matmuls over the file's own values, in a row-interleaved layout of ours.
 *
 * The file's blocks (the gguf package's quants.py is the reference for every value computed here):
 *   Q8_0 (type 8,  34 B / 32):  f16 d | int8 q[32]                          w = d q
 *   Q5_0 (type 6,  22 B / 32):  f16 d | u32 qh | u8 qs[16]                  w = d (q - 16), q = nibble | bit << 4
 *   Q4_K (type 12, 144 B / 256): f16 d | f16 dmin | u8 scales[12] | qs[128]  w = d sc_j q - dmin m_j (8 x 32)
 *   Q5_K (type 13, 176 B / 256): as Q4_K with qh[32] before qs: bit j of qh[i] is bit 4 of group j's element i
 *   Q6_K (type 14, 210 B / 256): ql[128] | qh[64] | int8 sc[16] | f16 d     w = d sc_i (q - 32) (16 x 16)
 *
 * Tiled layout (kq_pack, once at load): 16 output rows per tile, tiles one after the other, each tile's
 * (super-)blocks in K order. Within a tile's block, the codes of a group of 32 inputs are "chunk vectors" of 64 bytes:
 * byte 4 r + e of chunk c is row r's code of input 4 c + e (r < 16, e < 4), i.e. one 32-bit lane per row holding
 * 4 consecutive inputs: the layout of vpdpbusd against one broadcast 32-bit word of activations (AVX2 without VNNI
 * widens a chunk's bytes to two int16 vectors for vpmaddwd, see kq_dots_pw).
 * Per group: 4-bit codes as 4 vectors (low nibble: chunk v, high nibble: chunk v + 4), Q5's fifth bits as one
 * vector (bit c of byte 4 r + e: chunk c), Q6_K's two high bits as two vectors (chunk 4 h + c' in vector h, bits
 * 2 c', 2 c' + 1), Q8_0's int8 codes as 8 vectors. Per block: the f16 d (and dmin) of the 16 rows side by side,
 * Q4_K / Q5_K's 6-bit scales and mins unpacked to one byte each ([8 groups][16 rows]: 4 bytes more per 144 / 176,
 * +2.8 % / +2.3 %), Q6_K's int8 scales as [16][16 rows]. Q8_0, Q5_0, Q6_K tiles are exactly the file's size.
 * Every code, scale and min is the file's own (a bijection of its bits; kq_dequant_rows gives gguf's values back).
 * A decode GEMV thus streams each tile once, sequentially, and computes 16 rows per instruction.
 *
 * Activations (kq_quantize_act): per row and block of 32 inputs, xs = max|x| / 16256 and xq = rint(x / xs),
 * |xq| <= 16256 = 127 * 128, split xq = 128 hi + lo (hi in [-127, 127], lo in [0, 127], both int8) so each
 * u8 x s8 dot product (vpdpbusd on AVX512-VNNI / AVX-VNNI) is exact in int32; AVX2 without VNNI multiplies the
 * codes by xq itself as int16 (vpmaddwd), exact too.
 * Rounding error: |x - xs xq| <= 0.504 xs = max|x| / 32256 per element (about 2^-15 of the block's largest |x|),
 * the only approximation besides float32 arithmetic; it is far below a bf16 rounding (2^-9).
 * 8-bit activations (act_bits 8; by default prefill rows, and decode rows of bf16 activations: KernelConfig
 * .kquant_decode_bits): xq = 128 k with k = rint(127 x / max|x|), so lo = 0 and
 * the kernels skip it (one vpdpbusd per chunk instead of two; on AVX2 vpmaddubsw with int16 sums, kq_dots_ub): the
 * same arithmetic on coarser activations, error <= max|x| / 254 per element.
 *
 * Per row and group of 32 (Q6_K: of 16) inputs the exact int32 dot of codes and xq, minus the integer offset
 * (Q5_0: 16, Q6_K: 32, Q8_0 on VNNI: the 128 that makes its codes unsigned) times the exact int sum of xq, is
 * converted to float and FMA-ed into one float32 accumulator per row with the group's scale times xs
 * ((d sc) xs); Q4_K / Q5_K mins enter through a second accumulator, fma(dmin m, xs sum(xq), .), subtracted at the
 * end. Every path (AVX512-VNNI, AVX-VNNI, AVX2, scalar) runs these float operations in this order (the integer
 * parts are exact), and a row's result never depends on M, on the other rows of the call or on the thread count.
 *
 * Plain C ABI, no globals; built with OpenMP (threads over tiles) and -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "omp_for.h"
#include "prefetch.h"
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
#define KQ_R 16          /* rows per tile */
/* Bytes ahead of the group being multiplied that the GEMV prefetches: KernelConfig.kquant_prefetch_bytes, set from
 * Python when the library loads (kq_set_prefetch_bytes; 2 KB until then). Measured with 4 KiB pages, one thread
 * streaming 40-90 MB weights from DRAM: no prefetch 5-7 GB/s, 4 KB ahead 8-9.5 GB/s against a 9-11 GB/s plain read.
 * With the weights in huge pages (utils/hugepages.py), engine decode steps on the Xeon (AMX, 2 threads, interleaved
 * runs): 1.5B Q4_K_M 44.2-45.4 ms at 4 KB, 40.0-41.3 at 2 KB (1 KB 42.4-44.7, 1.5 KB 40.6-43.2, 3 KB 42.9-44.2,
 * 12 KB 49.8-50.0); 0.5B 18.0-18.9 -> 16.8-17.2; Gemma-3-270M 11.4-11.6 -> 10.9-11.1 ms. On an AMD EPYC Zen 5 (2
 * threads, builds interleaved, medians of 2 x 64 steps) the 1.5B Q4_K_M at 2 KB 17.0-22.6 ms a step, 4 KB 16.1-16.9,
 * 6 KB 15.1-17.1, 8 KB 15.0-15.6, 12 KB 15.4-16.0. */
static int64_t g_kq_prefetch = 2048;
void kq_set_prefetch_bytes(int64_t bytes) { g_kq_prefetch = bytes; }
#define KQ_PREFETCH g_kq_prefetch

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ISA 3
#elif defined(__AVXVNNI__)
#define KQ_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_ISA 1
#else
#define KQ_ISA 0
#endif

/* Which code path this build runs: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 scalar. */
int kq_isa(void) { return KQ_ISA; }

static inline float f16_bits_to_f32(uint16_t h) {
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

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_bits_to_f32(h);
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

/* ---- layout constants ----------------------------------------------------------------------------------------- */

static inline int kq_valid(int T) {
    return T == KQ_Q8_0 || T == KQ_Q5_0 || T == KQ_Q4_K || T == KQ_Q5_K || T == KQ_Q6_K;
}
static inline int kq_qk(int T) { return (T == KQ_Q8_0 || T == KQ_Q5_0) ? 32 : 256; }
/* bytes of one file block (one row) */
static inline int kq_fbytes(int T) {
    return T == KQ_Q8_0 ? 34 : T == KQ_Q5_0 ? 22 : T == KQ_Q4_K ? 144 : T == KQ_Q5_K ? 176 : 210;
}
/* bytes of the tile header of one block (scales of 16 rows) and of one group of 32 inputs (codes of 16 rows) */
static inline int kq_hbytes(int T) {
    return (T == KQ_Q8_0 || T == KQ_Q5_0) ? 32 : (T == KQ_Q4_K || T == KQ_Q5_K) ? 64 + 256 : 32 + 256;
}
static inline int kq_gbytes(int T) {
    return T == KQ_Q8_0 ? 512 : T == KQ_Q4_K ? 256 : (T == KQ_Q5_0 || T == KQ_Q5_K) ? 320 : 384;
}
static inline int64_t kq_tbytes(int T) { return kq_hbytes(T) + (int64_t)(kq_qk(T) / 32) * kq_gbytes(T); }

/* Bytes of the tiled form of an [N, K] weight of ggml type `type` (N rounded up to 16); -1 for a bad type/K. */
int64_t kq_packed_bytes(int type, int64_t N, int64_t K) {
    if (!kq_valid(type) || K % kq_qk(type)) return -1;
    return (N + KQ_R - 1) / KQ_R * (K / kq_qk(type)) * kq_tbytes(type);
}

/* ---- activations ---------------------------------------------------------------------------------------------- */

/* Block i (row i / nb, inputs 32 (i % nb) ..) of kq_quantize_act. */
static inline void kq_quant_block(const void *x, int64_t K, int is_bf16, int8_t *xhi, int8_t *xlo, float *xs,
                                  float *xsum32, int32_t *isum16, int a8, int64_t nb, int64_t i) {
    const float qmax = a8 ? 127.0f : KQ_XMAX; /* 8 bits: xq = 128 k, |k| <= 127, lo = 0 */
    const int64_t m = i / nb, b = i % nb, base = m * K + b * 32;
#if KQ_ISA >= 1
    /* the loop below in 8 lanes, bit for bit: max is order-free, cvtps rounds to nearest even as lrintf does
     * (the default MXCSR), and the int sums are exact; EPYC Zen 3, one 8960-wide row: 12.7 us a call */
    {
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 v[4], am = _mm256_setzero_ps();
        for (int e = 0; e < 4; e++) {
            v[e] = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                 (const __m128i *)((const uint16_t *)x + base + 8 * e))), 16))
                           : _mm256_loadu_ps((const float *)x + base + 8 * e);
            am = _mm256_max_ps(am, _mm256_and_ps(v[e], absm));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = _mm_cvtss_f32(m4);
        const float scale = amax / KQ_XMAX, inv = amax > 0.0f ? qmax / amax : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        const int ql = a8 ? 127 : 16256;
        const __m256i lim = _mm256_set1_epi32(ql), nlim = _mm256_set1_epi32(-ql), m7 = _mm256_set1_epi32(127);
        __m256i q[4], hi[4], lo[4];
        for (int e = 0; e < 4; e++) {
            q[e] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[e], iv)), nlim), lim);
            if (a8) q[e] = _mm256_slli_epi32(q[e], 7);
            hi[e] = _mm256_srai_epi32(q[e], 7); /* floor(q / 128) */
            lo[e] = _mm256_and_si256(q[e], m7);
        }
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane interleave */
        const __m256i h8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3])), order);
        const __m256i l8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3])), order);
        _mm256_storeu_si256((__m256i *)(xhi + base), h8);
        _mm256_storeu_si256((__m256i *)(xlo + base), l8);
        int32_t t0[8], t1[8];
        _mm256_storeu_si256((__m256i *)t0, _mm256_add_epi32(q[0], q[1]));
        _mm256_storeu_si256((__m256i *)t1, _mm256_add_epi32(q[2], q[3]));
        int32_t s0 = 0, s1 = 0;
        for (int e = 0; e < 8; e++) { s0 += t0[e]; s1 += t1[e]; }
        xs[m * nb + b] = scale;
        xsum32[m * nb + b] = scale * (float)(s0 + s1);
        isum16[(m * nb + b) * 2] = s0;
        isum16[(m * nb + b) * 2 + 1] = s1;
        return;
    }
#endif
    float v[32], amax = 0.0f;
    for (int e = 0; e < 32; e++) {
        v[e] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[base + e]) : ((const float *)x)[base + e];
        amax = fmaxf(amax, fabsf(v[e]));
    }
    const float scale = amax / KQ_XMAX, inv = amax > 0.0f ? qmax / amax : 0.0f;
    const int32_t ql = a8 ? 127 : 16256;
    int32_t s0 = 0, s1 = 0;
    for (int e = 0; e < 32; e++) {
        int32_t q = (int32_t)lrintf(v[e] * inv);
        q = q > ql ? ql : (q < -ql ? -ql : q);
        if (a8) q *= 128;
        xhi[base + e] = (int8_t)(q >> 7); /* floor(q / 128) */
        xlo[base + e] = (int8_t)(q & 127);
        if (e < 16) s0 += q; else s1 += q;
    }
    xs[m * nb + b] = scale;
    xsum32[m * nb + b] = scale * (float)(s0 + s1);
    isum16[(m * nb + b) * 2] = s0;
    isum16[(m * nb + b) * 2 + 1] = s1;
}

/* x [M][K] (bf16 if is_bf16 else float32), K % 32 == 0 ->
 * xhi, xlo [M][K] int8; xs [M][K/32] (block scale); xsum32 [M][K/32] = xs * sum of xq over the block;
 * isum16 [M][K/16] = the exact int sum of xq over each half block.
 * act_bits 16 (any value but 8): xq = rint(x / xs), |xq| <= 16256, as the file's header describes.
 * act_bits 8: xq = 128 rint(127 x / max|x|) (|xq / 128| <= 127, so lo = 0 and hi holds the 8-bit value; the same
 * xs = max|x| / 16256 keeps every kernel's arithmetic as it is): per element |x - xs xq| <= max|x| / 254 (+ float
 * rounding), the per-32 int8 activations of llama.cpp's Q8_0 / finer than its Q8_K per 256. */
void kq_quantize_act(const void *x, int64_t M, int64_t K, int is_bf16, int8_t *xhi, int8_t *xlo, float *xs,
                     float *xsum32, int32_t *isum16, int act_bits) {
    const int a8 = act_bits == 8;
    const int64_t nb = K / 32;
    OMP_FOR_IF(M * K >= 65536, for (int64_t i = 0; i < M * nb; i++) {
        kq_quant_block(x, K, is_bf16, xhi, xlo, xs, xsum32, isum16, a8, nb, i);
    });
}

/* ---- the file's codes, and the repack ------------------------------------------------------------------------- */

/* Offset of the nibble vectors in a tiled group (after the high-bit vectors). */
static inline int kq_nib_off(const int T) { return (T == KQ_Q5_0 || T == KQ_Q5_K) ? 64 : T == KQ_Q6_K ? 128 : 0; }

/* Codes of lane r in the tiled group g (inverse of the repack; Q8_0 signed). */
static void kq_tile_codes(const int T, const uint8_t *g, int r, int c[32]) {
    for (int k = 0; k < 32; k++) {
        const int ch = k / 4, b = 4 * r + k % 4;
        if (T == KQ_Q8_0) {
            c[k] = (int8_t)g[64 * ch + b];
            continue;
        }
        const int nb = g[kq_nib_off(T) + 64 * (ch & 3) + b];
        int v = ch >= 4 ? nb >> 4 : nb & 15;
        if (T == KQ_Q5_0 || T == KQ_Q5_K) v |= ((g[b] >> ch) & 1) << 4;
        if (T == KQ_Q6_K) v |= ((g[64 * (ch / 4) + b] >> (2 * (ch & 3))) & 3) << 4;
        c[k] = v;
    }
}

static inline uint32_t kq_word(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline void kq_put_word(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* Group j (32 inputs) of one row's file block blk -> that row's lanes of the tiled group (g = the group's start
 * + 4 r). Byte e of a tiled vector's 32-bit word holds the row's code of input 4 ch + e (see the layout at the
 * top), and byte e of 4 consecutive file bytes is input e of them, so each word is a few whole-word operations on
 * the file's bytes. Bit for bit the layout of the per-code loop it replaced (checked on random blocks of every
 * type), 2.5-4x faster (AMD EPYC Zen 5, 1536 x 8960 weights: Q4_K 4.3 -> 10.8 GB/s, Q6_K 2.6 -> 7.8 GB/s);
 * kq_tile_codes reads it back code by code, and the tests compare that with gguf's dequantization. */
static inline __attribute__((always_inline)) void kq_pack_group(const int T, const uint8_t *blk, int j, uint8_t *g) {
    const uint32_t m4 = 0x0F0F0F0Fu;
    if (T == KQ_Q8_0) { /* chunk ch: the signed codes of inputs 4 ch .. 4 ch + 3 as they are */
        for (int ch = 0; ch < 8; ch++) kq_put_word(g + 64 * ch, kq_word(blk + 2 + 4 * ch));
    } else if (T == KQ_Q5_0) { /* file byte i: low nibble input i, high nibble input 16 + i: the tiled nibble word */
        const uint32_t qh = kq_word(blk + 2);
        for (int v = 0; v < 4; v++) kq_put_word(g + kq_nib_off(T) + 64 * v, kq_word(blk + 6 + 4 * v));
        uint32_t bits = 0;
        for (int e = 0; e < 4; e++) {
            uint32_t b = 0;
            for (int ch = 0; ch < 8; ch++) b |= ((qh >> (4 * ch + e)) & 1u) << ch;
            bits |= b << (8 * e);
        }
        kq_put_word(g, bits);
    } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
        const uint8_t *qs = blk + (T == KQ_Q4_K ? 16 : 48) + 32 * (j / 2);
        const int sh = (j & 1) ? 4 : 0;
        for (int v = 0; v < 4; v++) {
            const uint32_t lo = (kq_word(qs + 4 * v) >> sh) & m4, hi = (kq_word(qs + 16 + 4 * v) >> sh) & m4;
            kq_put_word(g + kq_nib_off(T) + 64 * v, lo | (hi << 4));
        }
        if (T == KQ_Q5_K) { /* the fifth bit of input k: bit j of blk[16 + k] */
            uint32_t bits = 0;
            for (int ch = 0; ch < 8; ch++) bits |= ((kq_word(blk + 16 + 4 * ch) >> j) & 0x01010101u) << ch;
            kq_put_word(g, bits);
        }
    } else { /* Q6_K, group j = 4 h + s: low nibbles from ql (high half for s >= 2), 2 high bits from qh >> 2 s */
        const int h = j / 4, s = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (s & 1), *qh = blk + 128 + 32 * h;
        const int sh = s >= 2 ? 4 : 0;
        for (int v = 0; v < 4; v++) {
            const uint32_t lo = (kq_word(ql + 4 * v) >> sh) & m4, hi = (kq_word(ql + 16 + 4 * v) >> sh) & m4;
            kq_put_word(g + kq_nib_off(T) + 64 * v, lo | (hi << 4));
        }
        for (int hh = 0; hh < 2; hh++) {
            uint32_t bits = 0;
            for (int cc = 0; cc < 4; cc++)
                bits |= ((kq_word(qh + 16 * hh + 4 * cc) >> (2 * s)) & 0x03030303u) << (2 * cc);
            kq_put_word(g + 64 * hh, bits);
        }
    }
}

/* Tile t's block sb (16 rows of the file's block sb) -> o (kq_tbytes), T a constant after inlining. */
static inline __attribute__((always_inline)) void kq_pack_block(const int T, const uint8_t *src, int64_t N,
                                                                int64_t row_bytes, int64_t t, int64_t sb,
                                                                uint8_t *o) {
    const int qk = kq_qk(T), fb = kq_fbytes(T), hb = kq_hbytes(T), gb = kq_gbytes(T);
    if (t * KQ_R + KQ_R > N) memset(o, 0, kq_tbytes(T)); /* rows past N stay zero */
    for (int r = 0; r < KQ_R; r++) {
        const int64_t n = t * KQ_R + r;
        if (n >= N) break;
        const uint8_t *blk = src + n * row_bytes + sb * fb;
        if (T == KQ_Q8_0 || T == KQ_Q5_0) {
            memcpy(o + 2 * r, blk, 2);
        } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
            memcpy(o + 2 * r, blk, 2);
            memcpy(o + 32 + 2 * r, blk + 2, 2);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                kq_scale_min(blk + 4, j, &sc, &m);
                o[64 + 16 * j + r] = (uint8_t)sc;
                o[192 + 16 * j + r] = (uint8_t)m;
            }
        } else {
            memcpy(o + 2 * r, blk + 208, 2);
            for (int s = 0; s < 16; s++) o[32 + 16 * s + r] = blk[192 + s];
        }
        for (int j = 0; j < qk / 32; j++) kq_pack_group(T, blk, j, o + hb + j * gb + 4 * r);
    }
}

/* dst (kq_packed_bytes) = the tiled form of src [N][row_bytes] (the file's rows of ggml blocks). Rows past N in
 * the last tile are zero. Returns 0, or -1 for an unsupported type or K. */
int kq_pack(int type, const uint8_t *src, int64_t N, int64_t K, int64_t row_bytes, uint8_t *dst) {
    if (kq_packed_bytes(type, N, K) < 0) return -1;
    const int64_t nsb = K / kq_qk(type), tb = kq_tbytes(type), nt = (N + KQ_R - 1) / KQ_R;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nt * nsb; i++) {
        const int64_t t = i / nsb, sb = i % nsb;
        switch (type) {
            case KQ_Q8_0: kq_pack_block(KQ_Q8_0, src, N, row_bytes, t, sb, dst + i * tb); break;
            case KQ_Q5_0: kq_pack_block(KQ_Q5_0, src, N, row_bytes, t, sb, dst + i * tb); break;
            case KQ_Q4_K: kq_pack_block(KQ_Q4_K, src, N, row_bytes, t, sb, dst + i * tb); break;
            case KQ_Q5_K: kq_pack_block(KQ_Q5_K, src, N, row_bytes, t, sb, dst + i * tb); break;
            default: kq_pack_block(KQ_Q6_K, src, N, row_bytes, t, sb, dst + i * tb); break;
        }
    }
    return 0;
}

/* Drops the whole pages inside [p, p + n) of a read-only or never-written copy-on-write FILE mapping from the
 * process's resident memory (madvise MADV_DONTNEED; a later read faults them in again from the file). Used on a
 * GGUF tensor's mapped bytes once they are tiled, so the process doesn't hold both. Never call it on anonymous
 * memory (its contents would be lost). Returns madvise's result (0, or -1). */
int kq_release_file_pages(const void *p, int64_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + page - 1) / page * page, b = ((uintptr_t)p + (uintptr_t)n) / page * page;
    if (b <= a) return 0;
    return madvise((void *)a, b - a, MADV_DONTNEED);
}

/* ---- the matmul ----------------------------------------------------------------------------------------------- */

typedef struct {
    const int8_t *xhi, *xlo;
    const float *xs, *xsum32;
    const int32_t *isum16;
    int64_t K;
    int act8;            /* 1: act_bits 8 (xlo all zero), the kernels skip lo */
    const int16_t *xq16; /* AVX2 without VNNI: xq = 128 hi + lo [M][K] as int16 (kq_matmul builds it), else NULL */
} kq_act;

static inline int32_t kq_ld32(const int8_t *p) { return (int32_t)kq_word((const uint8_t *)p); }

#if KQ_ISA == 3
typedef __m512i VI;
typedef __m512 VF;
#define KQ_W 16
#define VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define VAND _mm512_and_si512
#define VOR _mm512_or_si512
#define VXOR _mm512_xor_si512
#define VSRL16 _mm512_srli_epi16
#define VSLL16 _mm512_slli_epi16
#define VSET8 _mm512_set1_epi8
#define VSET32 _mm512_set1_epi32
#define VZERO _mm512_setzero_si512()
#define VDP(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define VADD32 _mm512_add_epi32
#define VSUB32 _mm512_sub_epi32
#define VSLL32 _mm512_slli_epi32
#define VCVT _mm512_cvtepi32_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSUBF _mm512_sub_ps
#define VSETF _mm512_set1_ps
#define VZEROF _mm512_setzero_ps()
#define VSTOREF _mm512_storeu_ps
#define VF16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VU8F(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VS8F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif KQ_ISA >= 1
typedef __m256i VI;
typedef __m256 VF;
#define KQ_W 8
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VAND _mm256_and_si256
#define VOR _mm256_or_si256
#define VXOR _mm256_xor_si256
#define VSRL16 _mm256_srli_epi16
#define VSLL16 _mm256_slli_epi16
#define VSET8 _mm256_set1_epi8
#define VSET32 _mm256_set1_epi32
#define VZERO _mm256_setzero_si256()
#if KQ_ISA == 2
#define VDP(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#endif
#define VADD32 _mm256_add_epi32
#define VSUB32 _mm256_sub_epi32
#define VSLL32 _mm256_slli_epi32
#define VCVT _mm256_cvtepi32_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSUBF _mm256_sub_ps
#define VSETF _mm256_set1_ps
#define VZEROF _mm256_setzero_ps()
#define VSTOREF _mm256_storeu_ps
#define VF16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VU8F(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VS8F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

#if KQ_ISA >= 1
/* The unsigned codes of one group's vector of lanes, for the nibble types: g points at the group's lanes (its high-bit
 * bytes first, then the nibbles at kq_nib_off(T)); cv[c] = the codes of the lanes' c-th byte column, the low nibbles in
 * cv[0..3] and the high ones in cv[4..7], with Q5_0/Q5_K's fifth bit or Q6_K's two high bits or-ed in. Used by the
 * integer GEMV and by the bf16 dequantization of prefill tiles alike (Q8_0 codes are loaded as stored by each). */
static inline __attribute__((always_inline)) void kq_unpack_codes(const int T, const uint8_t *g, VI cv[8]) {
    const VI m4 = VSET8(0x0F);
    const int no = kq_nib_off(T);
    for (int v = 0; v < 4; v++) {
        const VI nib = VLOAD(g + no + 64 * v);
        cv[v] = VAND(nib, m4);
        cv[v + 4] = VAND(VSRL16(nib, 4), m4);
    }
    if (T == KQ_Q5_0 || T == KQ_Q5_K) {
        const VI qh = VLOAD(g), b4 = VSET8(0x10);
        cv[0] = VOR(cv[0], VAND(VSLL16(qh, 4), b4));
        cv[1] = VOR(cv[1], VAND(VSLL16(qh, 3), b4));
        cv[2] = VOR(cv[2], VAND(VSLL16(qh, 2), b4));
        cv[3] = VOR(cv[3], VAND(VSLL16(qh, 1), b4));
        cv[4] = VOR(cv[4], VAND(qh, b4));
        cv[5] = VOR(cv[5], VAND(VSRL16(qh, 1), b4));
        cv[6] = VOR(cv[6], VAND(VSRL16(qh, 2), b4));
        cv[7] = VOR(cv[7], VAND(VSRL16(qh, 3), b4));
    } else if (T == KQ_Q6_K) {
        const VI q0 = VLOAD(g), q1 = VLOAD(g + 64), b45 = VSET8(0x30);
        cv[0] = VOR(cv[0], VAND(VSLL16(q0, 4), b45));
        cv[1] = VOR(cv[1], VAND(VSLL16(q0, 2), b45));
        cv[2] = VOR(cv[2], VAND(q0, b45));
        cv[3] = VOR(cv[3], VAND(VSRL16(q0, 2), b45));
        cv[4] = VOR(cv[4], VAND(VSLL16(q1, 4), b45));
        cv[5] = VOR(cv[5], VAND(VSLL16(q1, 2), b45));
        cv[6] = VOR(cv[6], VAND(q1, b45));
        cv[7] = VOR(cv[7], VAND(VSRL16(q1, 2), b45));
    }
}

/* A group's float scales per lane (rows l0 ..): A0 = d (Q8_0, Q5_0), d sc_j (Q4_K, Q5_K; B = dmin m_j) or Q6_K's
 * d sc of its two halves (A0, A1); h is the block's tile header, dv / dmv its d / dmin of these lanes. */
static inline __attribute__((always_inline)) void kq_group_scales(const int T, const uint8_t *h, int j, int l0,
                                                                  VF dv, VF dmv, VF *A0, VF *A1, VF *B) {
    *A1 = *B = VZEROF;
    if (T == KQ_Q8_0 || T == KQ_Q5_0) {
        *A0 = dv;
    } else if (T == KQ_Q4_K || T == KQ_Q5_K) {
        *A0 = VMUL(dv, VU8F(h + 64 + 16 * j + l0));
        *B = VMUL(dmv, VU8F(h + 192 + 16 * j + l0));
    } else {
        *A0 = VMUL(dv, VS8F(h + 32 + 16 * (2 * j) + l0));
        *A1 = VMUL(dv, VS8F(h + 32 + 16 * (2 * j + 1) + l0));
    }
}

/* The float epilogue every vector path shares, in the scalar path's order: for rows m0 .. m0 + MR - 1 of group gi,
 * dq[0][r] = the exact int32 dot of codes and xq (Q6_K: its first half, dq[1][r] the second), minus the offset times
 * the int sum of xq (Q5_0: 16, Q6_K: 32, Q8_0: q8_off, 128 where its codes were made unsigned), converted and FMA-ed
 * with (scale) xs into acc; Q4_K / Q5_K's min term into sacc. */
static inline __attribute__((always_inline)) void kq_group_fma(const int T, const int MR, const int q8_off,
                                                               VI dq[2][4], VF A0, VF A1, VF B, const kq_act *a,
                                                               int64_t m0, int64_t gi, VF acc[4], VF sacc[4]) {
    const int64_t nb32 = a->K / 32;
    for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        const int32_t i0 = a->isum16[m * 2 * nb32 + 2 * gi], i1 = a->isum16[m * 2 * nb32 + 2 * gi + 1];
        const VF xsf = VSETF(a->xs[m * nb32 + gi]);
        if (T == KQ_Q6_K) {
            acc[r] = VFMA(VCVT(VSUB32(dq[0][r], VSET32(32 * i0))), VMUL(A0, xsf), acc[r]);
            acc[r] = VFMA(VCVT(VSUB32(dq[1][r], VSET32(32 * i1))), VMUL(A1, xsf), acc[r]);
        } else {
            const int32_t off = T == KQ_Q5_0 ? 16 : T == KQ_Q8_0 ? q8_off : 0;
            VI d = dq[0][r];
            if (off) d = VSUB32(d, VSET32(off * (i0 + i1)));
            acc[r] = VFMA(VCVT(d), VMUL(A0, xsf), acc[r]);
            if (T == KQ_Q4_K || T == KQ_Q5_K) sacc[r] = VFMA(B, VSETF(a->xsum32[m * nb32 + gi]), sacc[r]);
        }
    }
}

#endif

#if KQ_ISA >= 2
/* Lanes l0 .. l0 + KQ_W - 1 of tile `tile` (all its blocks along K) for activation rows m0 .. m0 + MR - 1:
 * res[r][lane] = the float32 results (VNNI: vpdpbusd of the codes against xq's hi and lo bytes). */
static inline __attribute__((always_inline)) void kq_tile_vec(const int T, const int MR, const int A8,
                                                              const uint8_t *tile, int l0, const kq_act *a, int64_t m0,
                                                              float res[4][KQ_R]) {
    const int64_t K = a->K;
    const int qk = kq_qk(T), ng = qk / 32, hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T);
    const int kmin = (T == KQ_Q4_K || T == KQ_Q5_K);
    VF acc[4], sacc[4];
    for (int r = 0; r < MR; r++) acc[r] = sacc[r] = VZEROF;
    for (int64_t sb = 0; sb < K / qk; sb++) {
        const uint8_t *h = tile + sb * tb;
        const VF dv = VF16(h + 2 * l0);
        const VF dmv = kmin ? VF16(h + 32 + 2 * l0) : VZEROF;
        for (int j = 0; j < ng; j++) {
            const uint8_t *g = h + hb + j * gb;
            const int64_t gi = sb * ng + j;
            const int lb = 4 * l0;
            if (l0 == 0) /* prefetches never fault: past the end of w they are dropped */
                for (int pl = 0; pl < gb; pl += 64) WEIGHT_PREFETCH(g + KQ_PREFETCH + pl, 3);
            VI cv[8];
            if (T == KQ_Q8_0) {
                for (int c = 0; c < 8; c++) {
                    cv[c] = VXOR(VLOAD(g + 64 * c + lb), VSET8((char)0x80)); /* q + 128, unsigned */
                }
            } else {
                kq_unpack_codes(T, g + lb, cv);
            }
            VF A0, A1, B;
            kq_group_scales(T, h, j, l0, dv, dmv, &A0, &A1, &B);
            VI dq[2][4];
            for (int r = 0; r < MR; r++) {
                const int64_t m = m0 + r;
                const int8_t *xh = a->xhi + m * K + 32 * gi, *xl = a->xlo + m * K + 32 * gi;
                VI h0 = VZERO, h1 = VZERO, w0 = VZERO, w1 = VZERO;
                for (int c = 0; c < 8; c++) {
                    const VI sh = VSET32(kq_ld32(xh + 4 * c)), u = cv[c];
                    if (c < 4) h0 = VDP(h0, u, sh);
                    else h1 = VDP(h1, u, sh);
                    if (!A8) { /* 8-bit activations: lo is zero */
                        const VI sl = VSET32(kq_ld32(xl + 4 * c));
                        if (c < 4) w0 = VDP(w0, u, sl);
                        else w1 = VDP(w1, u, sl);
                    }
                }
                const VI d0 = VADD32(VSLL32(h0, 7), w0), d1 = VADD32(VSLL32(h1, 7), w1);
                dq[0][r] = T == KQ_Q6_K ? d0 : VADD32(d0, d1);
                dq[1][r] = d1;
            }
            kq_group_fma(T, MR, 128, dq, A0, A1, B, a, m0, gi, acc, sacc);
        }
    }
    for (int r = 0; r < MR; r++) VSTOREF(res[r] + l0, kmin ? VSUBF(acc[r], sacc[r]) : acc[r]);
}
#endif

#if KQ_ISA == 1
/* AVX2 without VNNI: chunk c's codes of the 8 lanes at g (a tiled group, offset to the lanes): byte 4 r + e = lane r's
 * code of input 4 c + e, unsigned (Q8_0: its signed codes as stored), the high bits or-ed in as kq_unpack_codes does. */
static inline __attribute__((always_inline)) VI kq_chunk_codes(const int T, const uint8_t *g, const int c) {
    if (T == KQ_Q8_0) return VLOAD(g + 64 * c);
    const VI nib = VLOAD(g + kq_nib_off(T) + 64 * (c & 3)), m4 = VSET8(0x0F);
    VI cv = c < 4 ? VAND(nib, m4) : VAND(VSRL16(nib, 4), m4);
    if (T == KQ_Q5_0 || T == KQ_Q5_K) {
        const VI qh = VLOAD(g), b4 = VSET8(0x10);
        const VI bit = c < 4 ? VSLL16(qh, 4 - c) : c == 4 ? qh : VSRL16(qh, c - 4);
        cv = VOR(cv, VAND(bit, b4));
    } else if (T == KQ_Q6_K) {
        const VI q = VLOAD(g + 64 * (c >> 2)), b45 = VSET8(0x30);
        const int sh = 4 - 2 * (c & 3); /* 4, 2, 0, -2 */
        const VI bits = sh > 0 ? VSLL16(q, sh) : sh == 0 ? q : VSRL16(q, -sh);
        cv = VOR(cv, VAND(bits, b45));
    }
    return cv;
}

/* AVX2 without VNNI, every type: the same results as kq_tile_vec, from vpmaddwd of the codes widened to int16
 * against xq as int16 (16 exact products per instruction, as many as vpmaddubsw gives once xq is split in hi / lo, but
 * no vpmaddwd widening after it and one broadcast per chunk instead of two; it replaced that vpmaddubsw path: EPYC
 * Zen 3, 2 threads, 1.2-1.4x at 2-128 rows, Q8_0 2.1x, and 1.0-1.4x at one row). A chunk's 32-bit lane (row r, inputs
 * 4c .. 4c + 3) unpacks to two int16 pairs: vpunpcklbw / vpunpckhbw put rows (0, 1), (4, 5) and (2, 3), (6, 7) of the
 * 8 lanes into 32-bit lanes (r; e0 e1), (r; e2 e3); vpmaddwd against the broadcast 64 bits (x 4c .. 4c + 3) sums each
 * pair and vphaddd of the two accumulators gives the rows' dots back in lane order (Q8_0's signed codes are
 * sign-extended, so its dot needs no +128 offset). |code| <= 128 and |xq| <= 16256, so
 * a group's int32 sums are exact (< 2^27) and equal kq_tile_vec's; the float epilogue is the same code and order. */
static inline __attribute__((always_inline)) void kq_dots_pw(const int T, const int MR, const uint8_t *g,
                                                             const kq_act *a, int64_t m0, int64_t gi, VI dq[2][4]) {
    const int64_t K = a->K;
    const VI zero = VZERO;
    /* Q6_K scales each half group on its own: chunks 0..3, then 4..7; the others sum all 8 at once */
    const int nh = T == KQ_Q6_K ? 2 : 1, cpp = 8 / nh;
#pragma GCC unroll 2
    for (int hh = 0; hh < nh; hh++) {
        VI al[4], ah[4];
        for (int r = 0; r < MR; r++) al[r] = ah[r] = zero;
#pragma GCC unroll 8
        for (int cc = 0; cc < cpp; cc++) {
            const int c = hh * cpp + cc;
            const VI cv = kq_chunk_codes(T, g, c);
            VI lo, hi;
            if (T == KQ_Q8_0) { /* signed codes: sign-extended to int16 */
                const VI sg = _mm256_cmpgt_epi8(zero, cv);
                lo = _mm256_unpacklo_epi8(cv, sg);
                hi = _mm256_unpackhi_epi8(cv, sg);
            } else {
                lo = _mm256_unpacklo_epi8(cv, zero);
                hi = _mm256_unpackhi_epi8(cv, zero);
            }
            for (int r = 0; r < MR; r++) {
                int64_t xv;
                memcpy(&xv, a->xq16 + (m0 + r) * K + 32 * gi + 4 * c, 8);
                const VI xb = _mm256_set1_epi64x(xv);
                al[r] = VADD32(al[r], _mm256_madd_epi16(lo, xb));
                ah[r] = VADD32(ah[r], _mm256_madd_epi16(hi, xb));
                /* keeps each sum a register chain: else gcc reassociates the unrolled sums into a tree
                 * of products parked on the stack (measured 1.5x slower) */
                __asm__("" : "+x"(al[r]), "+x"(ah[r]));
            }
        }
        for (int r = 0; r < MR; r++) dq[hh][r] = _mm256_hadd_epi32(al[r], ah[r]);
    }
}

/* AVX2 without VNNI, 8-bit activations (kq_quantize_act's act_bits 8: lo = 0, xq = 128 hi): vpmaddubsw of each chunk's
 * unsigned codes against 4 broadcast bytes of hi gives 16 int16 pair sums in row order (no widening, no vphaddd),
 * summed in int16 over as many chunks as can't overflow (2 * 127 * max code per chunk: Q4_K 8 chunks, Q5 4, Q6_K 2;
 * Q8_0 1, its signed codes as |q| against sign(hi, q)), then one vpmaddwd against ones per run into int32. The
 * group's dot times 128 is exactly kq_dots_pw's (and the scalar path's) integer, and the float epilogue is the same
 * code, so the bits are equal. EPYC Zen 3, one thread, a 256 x 1536 weight in L2, 1 row: Q4_K 22.5 -> 38.7 GMAC/s
 * against kq_dots_pw on the same activations, Q5_0 1.5x, Q8_0 1.25x, Q5_K / Q6_K 1.17x (their code unpacking
 * dominates); 4 rows 1.0-1.4x. */
static inline __attribute__((always_inline)) void kq_dots_ub(const int T, const int MR, const uint8_t *g,
                                                             const kq_act *a, int64_t m0, int64_t gi, VI dq[2][4]) {
    const int64_t K = a->K;
    /* chunks per int16 run: 2 * 127 * max code * run <= 32767 */
    const int run = T == KQ_Q4_K ? 8 : (T == KQ_Q5_K || T == KQ_Q5_0) ? 4 : T == KQ_Q6_K ? 2 : 1;
    const VI ones = _mm256_set1_epi16(1);
    VI cv[8];
    if (T == KQ_Q8_0) {
        for (int c = 0; c < 8; c++) cv[c] = VLOAD(g + 64 * c);
    } else {
        kq_unpack_codes(T, g, cv);
    }
    for (int r = 0; r < MR; r++) {
        const int8_t *xh = a->xhi + (m0 + r) * K + 32 * gi;
        VI s32[2] = {VZERO, VZERO}, s16 = VZERO;
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const VI xb = VSET32(kq_ld32(xh + 4 * c));
            VI p;
            if (T == KQ_Q8_0)
                p = _mm256_maddubs_epi16(_mm256_abs_epi8(cv[c]), _mm256_sign_epi8(xb, cv[c]));
            else
                p = _mm256_maddubs_epi16(cv[c], xb);
            s16 = (c % run == 0) ? p : _mm256_add_epi16(s16, p);
            if (c % run == run - 1) {
                const int hh = T == KQ_Q6_K ? c / 4 : 0;
                s32[hh] = VADD32(s32[hh], _mm256_madd_epi16(s16, ones));
            }
        }
        dq[0][r] = VSLL32(s32[0], 7);
        dq[1][r] = VSLL32(s32[1], 7);
    }
}

/* AVX2 without VNNI: lanes l0 .. l0 + 8 NH - 1 of a tile for rows m0 .., in one pass over K: each group's dots by
 * kq_dots_ub (A8: 8-bit activations) or kq_dots_pw, then the shared epilogue, per 8-lane half. NH = 2 (both halves;
 * registers allow it for one row) uses each group's 64-byte code lines whole as they arrive; with NH = 1 a tile takes
 * one pass per half and the second re-reads it from L2. Every lane's float operations are the same either way, so
 * the bits are. EPYC Zen 3, 2 threads, interleaved in one process, one row: the 1.5B Q4_K_M's 197 linear matmuls
 * 69-71 -> 48-54 ms a step with NH = 2 (the Q6_K head 7.1-7.4 -> 5.0-5.6 ms); engine decode step over the memory
 * floor 1.57 -> 1.23x (bench compare runs before and after). */
static inline __attribute__((always_inline)) void kq_tile_avx2(const int T, const int MR, const int NH, const int A8,
                                                               const uint8_t *tile, int l0, const kq_act *a,
                                                               int64_t m0, float res[4][KQ_R]) {
    const int64_t K = a->K;
    const int qk = kq_qk(T), ng = qk / 32, hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T);
    const int kmin = (T == KQ_Q4_K || T == KQ_Q5_K);
    VF acc[2][4], sacc[2][4];
    for (int hf = 0; hf < NH; hf++)
        for (int r = 0; r < MR; r++) acc[hf][r] = sacc[hf][r] = VZEROF;
    for (int64_t sb = 0; sb < K / qk; sb++) {
        const uint8_t *h = tile + sb * tb;
        VF dv[2], dmv[2];
        for (int hf = 0; hf < NH; hf++) {
            dv[hf] = VF16(h + 2 * (l0 + KQ_W * hf));
            dmv[hf] = kmin ? VF16(h + 32 + 2 * (l0 + KQ_W * hf)) : VZEROF;
        }
        for (int j = 0; j < ng; j++) {
            const int64_t gi = sb * ng + j;
            if (l0 == 0)
                for (int pl = 0; pl < gb; pl += 64)
                    WEIGHT_PREFETCH(h + hb + j * gb + KQ_PREFETCH + pl, 3);
#pragma GCC unroll 2
            for (int hf = 0; hf < NH; hf++) {
                const int l = l0 + KQ_W * hf;
                VF A0, A1, B;
                kq_group_scales(T, h, j, l, dv[hf], dmv[hf], &A0, &A1, &B);
                VI dq[2][4];
                if (A8) kq_dots_ub(T, MR, h + hb + j * gb + 4 * l, a, m0, gi, dq);
                else kq_dots_pw(T, MR, h + hb + j * gb + 4 * l, a, m0, gi, dq);
                kq_group_fma(T, MR, 0, dq, A0, A1, B, a, m0, gi, acc[hf], sacc[hf]);
            }
        }
    }
    for (int hf = 0; hf < NH; hf++)
        for (int r = 0; r < MR; r++)
            VSTOREF(res[r] + l0 + KQ_W * hf, kmin ? VSUBF(acc[hf][r], sacc[hf][r]) : acc[hf][r]);
}

/* AVX2 without VNNI, 8-bit activations and MR (2-4) rows, or (LO, below) one row on 15-bit activations: all 16 lanes
 * of a tile in one pass, chunk by chunk. Each chunk's codes are unpacked once for both 8-lane halves and every row
 * (kq_dots_ub unpacks all 8 chunks of a half per call, 8
 * registers held across its row loop), each row's 4 broadcast bytes feed both halves' vpmaddubsw, and the int16 sums
 * (2 MR registers) stay in registers over a run of chunks (kq_dots_ub's bound: Q4_K 8, Q5 4, Q6_K 2, Q8_0 1), then
 * widen by vpmaddwd against ones into int32. The integers are the same sums (exact, any order), the float epilogue is
 * kq_group_fma per half, so the bits are those of the one-row and the scalar paths. Against the two passes of
 * kq_dots_ub (EPYC Zen 3, 2 threads, 256 rows, builds interleaved in one process): Qwen2.5-Coder-1.5B's Q4_K 1.3-1.4x,
 * Q6_K 1.1-1.2x; the 0.5B's Q5_0 1.7-1.9x, Q4_K / Q6_K 1.4-1.5x, Q8_0 1.4x; Gemma-3-270M's Q5_0 1.8x; a whole 1,024-token
 * prefill of the 1.5B 19.8 -> 16.4 s (medians of 4 alternating runs on a noisy host). Without the empty asm that
 * pins each int16 sum to a register chain, gcc parked every product on the stack and summed them in a tree (no faster
 * than before). Tried and dropped: Q6_K's codes as signed q - 32 (|q - 32| against sign(hi, q - 32), 4 chunks a run
 * instead of 2): 0.8x. A build with -DKQ_NO_A8_ROWS takes the two-pass path back (for such A/B runs).
 * LO = 1 (MR = 1, 15-bit activations: a decode row): the same pass also multiplies each chunk's codes by the 4 bytes
 * of lo (in [0, 127]: the int16 runs keep their bound) into their own int16 sums, and each run widens to
 * 128 hi + lo (vpmaddwd against 128s and against ones), the exact int32 dot kq_dots_pw computes, so the bits are
 * its bits; the weight stream is prefetched as kq_tile_avx2 does. Per chunk and 8 lanes that is 2 vpmaddubsw and
 * 2 int16 adds where kq_dots_pw takes 2 unpacks, 2 vpmaddwd and 2 int32 adds (and a vphaddd per group), and the codes
 * are unpacked once for both halves. EPYC Zen 3, one thread, weights hot in L2, one row: Q5_0 1.15-1.5x,
 * Q4_K 1.2x, Q6_K 1.07-1.1x; Q8_0 0.8x (each chunk's signs cost 4 vpsignb more), so Q8_0 keeps kq_dots_pw.
 * In the engine (2 threads, builds alternating, host reads 26-38 GB/s): Gemma-3-270M's fused layer stack
 * 3.41-3.51 -> 3.03-3.12 ms a decode step, Qwen2.5-Coder-0.5B's 8.63-8.68 -> 8.13-8.36 ms. -DKQ_NO_W15_ROW builds
 * the kq_dots_pw path back for every type.
 * MR = 1 with 8-bit activations (a decode row of a bf16 model; LO = 0) takes the same single pass, prefetching as
 * LO = 1 does, where it took kq_tile_avx2's two halves of kq_dots_ub (same bits; EPYC Zen 3, one thread, weights hot,
 * builds interleaved: Q5_0 1.08-1.47x, Q6_K 1.14-1.24x, Q4_K 1.04-1.32x, Q8_0 even). -DKQ_NO_A8_ROW builds that back. */
static inline __attribute__((always_inline)) void kq_tile_avx2_a8(const int T, const int MR, const int LO,
                                                                  const uint8_t *tile, const kq_act *a, int64_t m0,
                                                                  float res[4][KQ_R]) {
    const int64_t K = a->K;
    const int qk = kq_qk(T), ng = qk / 32, hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T);
    const int kmin = (T == KQ_Q4_K || T == KQ_Q5_K);
    const int run = T == KQ_Q4_K ? 8 : (T == KQ_Q5_K || T == KQ_Q5_0) ? 4 : T == KQ_Q6_K ? 2 : 1;
    const VI ones = _mm256_set1_epi16(1), v128 = _mm256_set1_epi16(128);
    const int8_t *xr[4], *xl = a->xlo + m0 * K;
    for (int r = 0; r < MR; r++) xr[r] = a->xhi + (m0 + r) * K;
    VF acc[2][4], sacc[2][4];
    for (int hf = 0; hf < 2; hf++)
        for (int r = 0; r < MR; r++) acc[hf][r] = sacc[hf][r] = VZEROF;
    for (int64_t sb = 0; sb < K / qk; sb++) {
        const uint8_t *h = tile + sb * tb;
        for (int j = 0; j < ng; j++) {
            const int64_t gi = sb * ng + j;
            const uint8_t *g = h + hb + j * gb;
            if (MR == 1) /* one-row decode streams the weights: kq_tile_avx2's prefetch */
                for (int pl = 0; pl < gb; pl += 64) WEIGHT_PREFETCH(g + KQ_PREFETCH + pl, 3);
            VI s32[2][2][4]; /* [Q6_K half group][lane half][row] */
            VI s16[2][4], l16[2];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const VI c0 = kq_chunk_codes(T, g, c), c1 = kq_chunk_codes(T, g + 32, c);
                VI u0 = c0, u1 = c1;
                if (T == KQ_Q8_0) { /* signed codes: |q| against sign(hi, q) */
                    u0 = _mm256_abs_epi8(c0);
                    u1 = _mm256_abs_epi8(c1);
                }
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    const VI xb = VSET32(kq_ld32(xr[r] + 32 * gi + 4 * c));
                    const VI p0 = _mm256_maddubs_epi16(u0, T == KQ_Q8_0 ? _mm256_sign_epi8(xb, c0) : xb);
                    const VI p1 = _mm256_maddubs_epi16(u1, T == KQ_Q8_0 ? _mm256_sign_epi8(xb, c1) : xb);
                    s16[0][r] = c % run == 0 ? p0 : _mm256_add_epi16(s16[0][r], p0);
                    s16[1][r] = c % run == 0 ? p1 : _mm256_add_epi16(s16[1][r], p1);
                    __asm__("" : "+x"(s16[0][r]), "+x"(s16[1][r])); /* register chains, as in kq_dots_pw */
                }
                if (LO) { /* the low 7 bits of the one row's 15-bit xq, the same bound on the int16 sums */
                    const VI xb = VSET32(kq_ld32(xl + 32 * gi + 4 * c));
                    const VI p0 = _mm256_maddubs_epi16(u0, T == KQ_Q8_0 ? _mm256_sign_epi8(xb, c0) : xb);
                    const VI p1 = _mm256_maddubs_epi16(u1, T == KQ_Q8_0 ? _mm256_sign_epi8(xb, c1) : xb);
                    l16[0] = c % run == 0 ? p0 : _mm256_add_epi16(l16[0], p0);
                    l16[1] = c % run == 0 ? p1 : _mm256_add_epi16(l16[1], p1);
                    __asm__("" : "+x"(l16[0]), "+x"(l16[1]));
                }
                if (c % run == run - 1) {
                    const int hh = T == KQ_Q6_K ? c / 4 : 0, first = T == KQ_Q6_K ? c % 4 == run - 1 : c == run - 1;
                    for (int hf = 0; hf < 2; hf++)
                        for (int r = 0; r < MR; r++) {
                            /* 8-bit rows: hi sums (x 128 at the end); 15-bit: 128 hi + lo here */
                            const VI w = LO ? VADD32(_mm256_madd_epi16(s16[hf][r], v128), _mm256_madd_epi16(l16[hf], ones))
                                            : _mm256_madd_epi16(s16[hf][r], ones);
                            s32[hh][hf][r] = first ? w : VADD32(s32[hh][hf][r], w);
                        }
                }
            }
            for (int hf = 0; hf < 2; hf++) {
                const VF dv = VF16(h + 2 * KQ_W * hf), dmv = kmin ? VF16(h + 32 + 2 * KQ_W * hf) : VZEROF;
                VF A0, A1, B;
                kq_group_scales(T, h, j, KQ_W * hf, dv, dmv, &A0, &A1, &B);
                VI dq[2][4];
                for (int r = 0; r < MR; r++) {
                    dq[0][r] = LO ? s32[0][hf][r] : VSLL32(s32[0][hf][r], 7);
                    dq[1][r] = T != KQ_Q6_K ? VZERO : LO ? s32[1][hf][r] : VSLL32(s32[1][hf][r], 7);
                }
                kq_group_fma(T, MR, 0, dq, A0, A1, B, a, m0, gi, acc[hf], sacc[hf]);
            }
        }
    }
    for (int hf = 0; hf < 2; hf++)
        for (int r = 0; r < MR; r++)
            VSTOREF(res[r] + KQ_W * hf, kmin ? VSUBF(acc[hf][r], sacc[hf][r]) : acc[hf][r]);
}
#endif

/* The same arithmetic, one lane at a time (the reference the vector paths equal bit for bit). */
static inline __attribute__((always_inline)) void kq_tile_scalar(const int T, const int MR, const uint8_t *tile,
                                                                 const kq_act *a, int64_t m0, float res[4][KQ_R]) {
    const int64_t K = a->K, nb32 = K / 32;
    const int qk = kq_qk(T), ng = qk / 32, hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T);
    const int kmin = (T == KQ_Q4_K || T == KQ_Q5_K);
    for (int l = 0; l < KQ_R; l++) {
        float acc[4] = {0, 0, 0, 0}, sacc[4] = {0, 0, 0, 0};
        for (int64_t sb = 0; sb < K / qk; sb++) {
            const uint8_t *h = tile + sb * tb;
            const float d = f16_to_f32(h + 2 * l), dm = kmin ? f16_to_f32(h + 32 + 2 * l) : 0.0f;
            for (int j = 0; j < ng; j++) {
                const int64_t gi = sb * ng + j;
                int c[32];
                kq_tile_codes(T, h + hb + j * gb, l, c);
                float A0, A1 = 0.0f, B = 0.0f;
                if (T == KQ_Q8_0 || T == KQ_Q5_0) {
                    A0 = d;
                } else if (kmin) {
                    A0 = d * (float)h[64 + 16 * j + l];
                    B = dm * (float)h[192 + 16 * j + l];
                } else {
                    A0 = d * (float)(int8_t)h[32 + 16 * (2 * j) + l];
                    A1 = d * (float)(int8_t)h[32 + 16 * (2 * j + 1) + l];
                }
                for (int r = 0; r < MR; r++) {
                    const int64_t m = m0 + r;
                    const int8_t *xh = a->xhi + m * K + 32 * gi, *xl = a->xlo + m * K + 32 * gi;
                    int32_t d0 = 0, d1 = 0;
                    for (int k = 0; k < 32; k++) {
                        const int32_t p = c[k] * (128 * xh[k] + xl[k]);
                        if (k < 16) d0 += p; else d1 += p;
                    }
                    const int32_t i0 = a->isum16[m * 2 * nb32 + 2 * gi], i1 = a->isum16[m * 2 * nb32 + 2 * gi + 1];
                    const float xs = a->xs[m * nb32 + gi];
                    if (T == KQ_Q6_K) {
                        acc[r] = fmaf((float)(d0 - 32 * i0), A0 * xs, acc[r]);
                        acc[r] = fmaf((float)(d1 - 32 * i1), A1 * xs, acc[r]);
                    } else {
                        const int32_t off = T == KQ_Q5_0 ? 16 : 0;
                        acc[r] = fmaf((float)(d0 + d1 - off * (i0 + i1)), A0 * xs, acc[r]);
                        if (kmin) sacc[r] = fmaf(B, a->xsum32[m * nb32 + gi], sacc[r]);
                    }
                }
            }
        }
        for (int r = 0; r < MR; r++) res[r][l] = kmin ? acc[r] - sacc[r] : acc[r];
    }
}

#if KQ_ISA == 1
/* Whether a one-row tile of type T on 15-bit activations takes kq_tile_avx2_a8 with lo (else kq_dots_pw, the one
 * reader of kq_act.xq16: Q8_0, see kq_tile_avx2_a8; all types in a -DKQ_NO_W15_ROW build). */
static inline int kq_w15_row(const int T) {
#ifdef KQ_NO_W15_ROW
    (void)T;
    return 0;
#else
    return T != KQ_Q8_0;
#endif
}
#endif

/* Whether a one-row tile of type T on 8-bit activations takes kq_tile_avx2_a8 (else kq_tile_avx2's two halves of
 * kq_dots_ub; all types in a -DKQ_NO_A8_ROW build). */
static inline int kq_a8_row(const int T) {
    (void)T;
#ifdef KQ_NO_A8_ROW
    return 0;
#else
    return 1;
#endif
}

static inline __attribute__((always_inline)) void kq_tile(const int T, const int MR, const int A8, const uint8_t *tile,
                                                          const kq_act *a, int64_t m0, float res[4][KQ_R]) {
#if KQ_ISA == 1
    if (MR == 1 && (A8 ? kq_a8_row(T) : kq_w15_row(T))) /* a decode row: 15-bit (LO) or 8-bit activations */
        kq_tile_avx2_a8(T, 1, !A8, tile, a, m0, res);
    else if (MR == 1) /* decode rows: both halves in one pass */
        kq_tile_avx2(T, 1, 2, A8, tile, 0, a, m0, res);
#ifndef KQ_NO_A8_ROWS
    else if (A8)
        kq_tile_avx2_a8(T, MR, 0, tile, a, m0, res);
#endif
    else
        for (int l0 = 0; l0 < KQ_R; l0 += KQ_W) kq_tile_avx2(T, MR, 1, A8, tile, l0, a, m0, res);
#elif KQ_ISA >= 2
    for (int l0 = 0; l0 < KQ_R; l0 += KQ_W) kq_tile_vec(T, MR, A8, tile, l0, a, m0, res);
#else
    (void)A8; /* lo is zero: the same sums */
    kq_tile_scalar(T, MR, tile, a, m0, res);
#endif
}

/* Tiles t0 .. t1 - 1 for all M activation rows. */
static inline __attribute__((always_inline)) void kq_tiles_t(const int T, const int A8, const uint8_t *w, int64_t t0,
                                                              int64_t t1,
                                                              int64_t N, const kq_act *a, int64_t M, void *out,
                                                              int64_t ldo, int out_bf16) {
    const int64_t tsz = (a->K / kq_qk(T)) * kq_tbytes(T);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = w + t * tsz;
        const int64_t n0 = t * KQ_R, nn = N - n0 < KQ_R ? N - n0 : KQ_R;
        float res[4][KQ_R];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = M - m0 < 4 ? M - m0 : 4;
            switch (mr) { /* every row of a tile of rows is computed exactly as in a tile of one */
                case 4: kq_tile(T, 4, A8, tile, a, m0, res); break;
                case 3: kq_tile(T, 3, A8, tile, a, m0, res); break;
                case 2: kq_tile(T, 2, A8, tile, a, m0, res); break;
                default: kq_tile(T, 1, A8, tile, a, m0, res); break;
            }
            for (int64_t r = 0; r < mr; r++) {
                if (out_bf16) {
                    uint16_t *o = (uint16_t *)out + (m0 + r) * ldo + n0;
                    for (int64_t l = 0; l < nn; l++) o[l] = f32_to_bf16(res[r][l]);
                } else {
                    memcpy((float *)out + (m0 + r) * ldo + n0, res[r], nn * sizeof(float));
                }
            }
        }
    }
}

/* out[m][n] (at out + m * ldo + n; float32, or bf16 if out_bf16) = sum_k x[m][k] w[n][k] for the tiled weights of
 * `shards` (kq_pack; shard i's rows are the columns after shard i - 1's) and the activations prepared by
 * kq_quantize_act; act8: they were quantized with act_bits 8 (every xlo zero; the kernels then skip lo: the same
 * bits, about half the integer work). Types: ggml type ids (6, 8, 12, 13, 14); K % 256 == 0 for the K-quants,
 * K % 32 == 0 for the others. One parallel region for all shards (a fused qkv or gate_up layer), its tiles cut into
 * one contiguous share of weight bytes per thread: a tile is computed the same way whichever thread takes it, so
 * the split never changes a bit (per-shard calls cost a fork/join each and left 256-row shards on one thread).
 * Returns 0, -1 for an unsupported type or K, -2 if the AVX2 build's int16 copy of 15-bit activations (M K 2
 * bytes) could not be allocated. */
int kq_matmul_shards(const kq_shard_t *shards, int64_t n_shards, int64_t K, const int8_t *xhi, const int8_t *xlo,
                     const float *xs, const float *xsum32, const int32_t *isum16, int64_t M, void *out, int64_t ldo,
                     int out_bf16, int act8) {
    if (n_shards < 1 || n_shards > KQ_MAX_SHARDS) return -1;
    int64_t tiles[KQ_MAX_SHARDS + 1], tsz[KQ_MAX_SHARDS], bytes = 0, rows = 0;
    tiles[0] = 0;
    for (int64_t i = 0; i < n_shards; i++) {
        if (kq_packed_bytes((int)shards[i].type, shards[i].rows, K) < 0 || shards[i].rows < 1) return -1;
        tsz[i] = kq_packed_bytes((int)shards[i].type, KQ_R, K);
        tiles[i + 1] = tiles[i] + (shards[i].rows + KQ_R - 1) / KQ_R;
        bytes += (tiles[i + 1] - tiles[i]) * tsz[i];
        rows += shards[i].rows;
    }
    kq_act a = {xhi, xlo, xs, xsum32, isum16, K, act8 != 0, NULL};
    int16_t *xq16 = NULL;
#if KQ_ISA == 1
    /* only kq_dots_pw reads it: 15-bit tiles of 2-4 rows, and one-row tiles kq_w15_row leaves to it */
    int need_xq16 = !act8 && M > 1;
    for (int64_t i = 0; i < n_shards && !act8; i++) need_xq16 |= !kq_w15_row((int)shards[i].type);
    if (need_xq16) {
        xq16 = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
        if (!xq16) return -2;
#pragma omp parallel for schedule(static) if (M * K >= 1 << 16)
        for (int64_t i = 0; i < M * K; i++) xq16[i] = (int16_t)(128 * xhi[i] + xlo[i]);
        a.xq16 = xq16;
    }
#endif
    const size_t esz = out_bf16 ? 2 : 4;
#define KQ_CASE(TY)                                                                                      \
    case TY:                                                                                             \
        if (act8) kq_tiles_t(TY, 1, sh->w, t0, t1, sh->rows, &a, M, o, ldo, out_bf16);                   \
        else kq_tiles_t(TY, 0, sh->w, t0, t1, sh->rows, &a, M, o, ldo, out_bf16);                        \
        break;
#pragma omp parallel if (rows * M * K >= 1 << 18)
    {
        /* this thread's bytes [b0, b1) of the shards' tiles laid end to end; a tile is taken by the thread whose
         * share holds its first byte */
        const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t b0 = bytes * id / nth, b1 = bytes * (id + 1) / nth;
        int64_t base = 0, col = 0; /* the shard's first byte and first column */
        for (int64_t i = 0; i < n_shards; i++) {
            const kq_shard_t *sh = &shards[i];
            const int64_t nt = tiles[i + 1] - tiles[i];
            int64_t t0 = b0 <= base ? 0 : (b0 - base + tsz[i] - 1) / tsz[i];
            int64_t t1 = b1 <= base ? 0 : (b1 - base + tsz[i] - 1) / tsz[i];
            t0 = t0 < nt ? t0 : nt;
            t1 = t1 < nt ? t1 : nt;
            void *o = (char *)out + col * esz;
            if (t0 < t1) {
                switch ((int)sh->type) { /* the outlined body is specialized per type */
                    KQ_CASE(KQ_Q8_0)
                    KQ_CASE(KQ_Q5_0)
                    KQ_CASE(KQ_Q4_K)
                    KQ_CASE(KQ_Q5_K)
                    default: KQ_CASE(KQ_Q6_K)
                }
            }
            base += nt * tsz[i];
            col += sh->rows;
        }
    }
#undef KQ_CASE
    free(xq16);
    return 0;
}

/* kq_matmul_shards with one shard: out = activations @ W.T, W [N, K] of ggml type `type`. */
int kq_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const int8_t *xhi, const int8_t *xlo,
              const float *xs, const float *xsum32, const int32_t *isum16, int64_t M, void *out, int64_t ldo,
              int out_bf16, int act8) {
    const kq_shard_t sh = {type, N, w};
    return kq_matmul_shards(&sh, 1, K, xhi, xlo, xs, xsum32, isum16, M, out, ldo, out_bf16, act8);
}

/* ---- dequantization of whole rows (embedding lookups, tests) --------------------------------------------------- */

/* out[i][0..K) (float32, or bf16 if out_bf16) = row ids[i] of the tiled weight w dequantized: gguf's float32 values
 * (d q, d (q - 16), d sc (q - 32) are exact; d sc q - dmin m rounds once), rounded once to bf16 when asked.
 * Returns 0, -1 for an unsupported type, or -2 (nothing written) when an id is outside [0, N). */
int kq_dequant_rows(int type, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n, void *out,
                    int out_bf16) {
    if (kq_packed_bytes(type, N, K) < 0) return -1;
    for (int64_t i = 0; i < n; i++) /* checked here, before any row is read (two torch reductions did it: ~10 us) */
        if (ids[i] < 0 || ids[i] >= N) return -2;
    const int T = type, qk = kq_qk(T), hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T), tsz = (K / qk) * tb;
#pragma omp parallel for schedule(static) if (n * K >= 1 << 18)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *tile = w + ids[i] / KQ_R * tsz;
        const int l = (int)(ids[i] % KQ_R);
        for (int64_t sb = 0; sb < K / qk; sb++) {
            const uint8_t *h = tile + sb * tb;
            const float d = f16_to_f32(h + 2 * l);
            for (int j = 0; j < qk / 32; j++) {
                int c[32];
                kq_tile_codes(T, h + hb + j * gb, l, c);
                float v[32];
                for (int k = 0; k < 32; k++) {
                    if (T == KQ_Q8_0) {
                        v[k] = d * (float)c[k];
                    } else if (T == KQ_Q5_0) {
                        v[k] = d * (float)(c[k] - 16);
                    } else if (T == KQ_Q6_K) {
                        v[k] = (d * (float)(int8_t)h[32 + 16 * (2 * j + k / 16) + l]) * (float)(c[k] - 32);
                    } else {
                        const float a = d * (float)h[64 + 16 * j + l], b = f16_to_f32(h + 32 + 2 * l) *
                                                                           (float)h[192 + 16 * j + l];
                        v[k] = a * (float)c[k] - b;
                    }
                }
                const int64_t base = i * K + sb * qk + 32 * j;
                if (out_bf16)
                    for (int k = 0; k < 32; k++) ((uint16_t *)out)[base + k] = f32_to_bf16(v[k]);
                else
                    memcpy((float *)out + base, v, sizeof v);
            }
        }
    }
    return 0;
}

/* ---- prefill: tiles dequantized to bf16 in a packed bf16 GEMM's layout ------------------------------------------ */

#if KQ_ISA == 3
/* 16 floats -> their bf16 bits (round to nearest even, NaN stays NaN) in the low 16 bits of each int32 lane */
static inline __m512i kq_bf16_bits16(__m512 v) {
#if defined(__AVX512BF16__)
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
#endif
}
#endif

/* Rows 16 t0 .. 16 t1 - 1 of the tiled weight w, dequantized (gguf's float32 values, rounded once to bf16) into P in
 * the packed layout of a bf16 linear kernel over those rows alone (N' = 16 (t1 - t0), a multiple of 32):
 * layout 0: amx_pack's (amx_linear.c), 1: dpbf16_pack's (dpbf16_linear.c). Each tile's group of 32 inputs becomes 16
 * vectors of 16 rows x one pair of inputs, the pair-interleaved form both kernels read. Vectorized where the build is
 * AVX512 (kq_isa() == 3), else scalar (same values). Returns 0, or -1 for a bad type, layout or row range. */
int kq_dequant_packed_bf16(int type, const uint8_t *w, int64_t N, int64_t K, int64_t t0, int64_t t1, int layout,
                           uint16_t *P) {
    if (kq_packed_bytes(type, N, K) < 0 || (layout != 0 && layout != 1) || t0 < 0 || t1 <= t0 ||
        t1 > (N + KQ_R - 1) / KQ_R || (t1 - t0) % 2)
        return -1;
    const int T = type, qk = kq_qk(T), ng = qk / 32, hb = kq_hbytes(T), gb = kq_gbytes(T);
    const int64_t tb = kq_tbytes(T), tsz = (K / qk) * tb, nrows = KQ_R * (t1 - t0), KB = K / 32;
    const int kmin = (T == KQ_Q4_K || T == KQ_Q5_K);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (t1 - t0) * KB; i++) {
        const int64_t tl = i / KB, gi = i % KB, sb = gi / ng; /* tile (relative), 32-group, block */
        const int j = (int)(gi % ng);
        const uint8_t *h = w + (t0 + tl) * tsz + sb * tb, *g = h + hb + j * gb;
        /* where pair-row r (inputs 32 gi + 2 r, + 1) of this tile goes: 16 lanes x 2 bf16 = 32 elements */
        uint16_t *dst;
        int64_t rstride;
        if (layout == 0) { /* P[g][kb][jj][r][2c + p], 32-row group g = tl / 2, jj = tl % 2 */
            dst = P + ((tl / 2) * KB + gi) * 1024 + (tl % 2) * 512;
            rstride = 32;
        } else { /* P[b][p][v][2c + q], 64-row block b = tl / 4, v = tl % 4, nv = 4 (2 for a last block of 32) */
            const int64_t b = tl / 4, nv = (nrows - 64 * b) >= 64 ? 4 : 2;
            dst = P + 64 * b * K + ((16 * gi) * nv + tl % 4) * 32;
            rstride = nv * 32;
        }
#if KQ_ISA == 3
        VI cv[8];
        {
            if (T == KQ_Q8_0) {
                for (int c = 0; c < 8; c++) cv[c] = VLOAD(g + 64 * c);
            } else {
                kq_unpack_codes(T, g, cv);
            }
        }
        const VF dv = VF16(h);
        VF a0 = dv, a1 = dv, bm = VZEROF;
        if (kmin) {
            a0 = a1 = VMUL(dv, VU8F(h + 64 + 16 * j));
            bm = VMUL(VF16(h + 32), VU8F(h + 192 + 16 * j));
        } else if (T == KQ_Q6_K) {
            a0 = VMUL(dv, VS8F(h + 32 + 16 * (2 * j)));
            a1 = VMUL(dv, VS8F(h + 32 + 16 * (2 * j + 1)));
        }
        const int off = T == KQ_Q5_0 ? 16 : T == KQ_Q6_K ? 32 : 0;
        for (int c = 0; c < 8; c++) {
            const VF a = c < 4 ? a0 : a1;
            __m512i bits[4];
            for (int e = 0; e < 4; e++) {
                __m512i q;
                if (T == KQ_Q8_0)
                    q = _mm512_srai_epi32(_mm512_slli_epi32(cv[c], 24 - 8 * e), 24);
                else
                    q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(cv[c], 8 * e), _mm512_set1_epi32(0xFF)),
                                         _mm512_set1_epi32(off));
                const VF qf = VCVT(q);
                const VF v = kmin ? VSUBF(VMUL(a, qf), bm) : VMUL(a, qf);
                bits[e] = kq_bf16_bits16(v);
            }
            _mm512_storeu_si512((void *)(dst + (2 * c) * rstride), VOR(bits[0], VSLL32(bits[1], 16)));
            _mm512_storeu_si512((void *)(dst + (2 * c + 1) * rstride), VOR(bits[2], VSLL32(bits[3], 16)));
        }
#else
        (void)kmin;
        for (int l = 0; l < KQ_R; l++) {
            int c[32];
            kq_tile_codes(T, g, l, c);
            const float dl = f16_to_f32(h + 2 * l);
            for (int k = 0; k < 32; k++) {
                float v;
                if (T == KQ_Q8_0) v = dl * (float)c[k];
                else if (T == KQ_Q5_0) v = dl * (float)(c[k] - 16);
                else if (T == KQ_Q6_K) v = (dl * (float)(int8_t)h[32 + 16 * (2 * j + k / 16) + l]) * (float)(c[k] - 32);
                else v = (dl * (float)h[64 + 16 * j + l]) * (float)c[k] -
                         f16_to_f32(h + 32 + 2 * l) * (float)h[192 + 16 * j + l];
                dst[(k / 2) * rstride + 2 * l + (k % 2)] = f32_to_bf16(v);
            }
        }
#endif
    }
    return 0;
}
