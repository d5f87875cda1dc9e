/* Paged-attention decode kernel for CPUs (one query token per request), in plain C + OpenMP.
 *
 * Reads each request's K/V straight out of the paged cache (no padded copy), once per KV head for all the query
 * heads that share it (GQA), with a three-pass softmax (scores, max/exp/sum, weighted V) in float32.
 *
 * Layout: q/out [num_tokens, H, D] (rows selected by `rows`; q's rows q_stride elements apart), k_cache/v_cache [num_blocks, BS, KVH, D],
 * block_tables [n, max_blocks], seq_lens [n] (context length including the new token).
 * Token t of request r lives at block block_tables[r][t / BS], offset t % BS (PagedAttention, Kwon et al. 2023).
 * Sliding window (window > 0): the query at position L-1 sees keys L-window .. L-1 (HF Mistral/Gemma convention).
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#include "bf16.h"
#include "pagedllm_kernels.h"

/* Context partitions (the SIMD paths): a context of more than DECODE_PART tokens (after the sliding window) is cut
 * into partitions of DECODE_PART tokens from its first token; each partition's softmax runs on its own (its max m_p,
 * its sum l_p = sum exp(s - m_p), its unnormalized P.V sums a_p), and the partitions are combined in order:
 *   m = max_p m_p,  out = (sum_p a_p exp(m_p - m)) / (sum_p l_p exp(m_p - m))
 * (the split softmax of "flash-decoding", Dao et al. 2023; vLLM's paged attention v2 partitions 512 tokens). The
 * partitions are separate tasks, so one request's long context spreads over every thread. The arithmetic depends on
 * the context length only, never on which requests share the call or how tasks are cut (batch invariant); a context
 * of one partition is computed as before, with no combine. A partition's partial record, PART_STRIDE(D) floats:
 * [a_p: D][m_p][l_p], the rest padding (keeps records 64-byte aligned). The prefetches of a partition run on into the
 * next one (`Lpf`: the request's end), which the same thread computes next when a task holds a whole request.
 * Measured (AMD EPYC Zen 5, 2 threads, SmolLM2's 9 heads on 3, one request decoding at 1,000-1,256 tokens, the fused
 * loop's 30 calls a step): 1.57 ms -> 1.16-1.20 ms a step; 32 requests at 700-800 tokens, 2-3% slower (15.4 -> 15.8
 * ms a step, within the host's noise; partitions of 128 tokens cost 8% there before `Lpf`). */
#define DECODE_PART 256
#define PART_STRIDE(D) ((int64_t)(D) + 16)

static inline void put_part(float* pp, const float* acc, int D, float m, float l) {
    for (int d = 0; d < D; ++d) pp[d] = acc[d];
    pp[D] = m;
    pp[D + 1] = l;
}

/* o [D] = the combined output of one query head from its P partial records, `stride` floats apart. */
static inline void combine_parts(const float* part, int P, int64_t stride, int D, float* o) {
    float m = -INFINITY, l = 0.0f;
    for (int p = 0; p < P; ++p) m = fmaxf(m, part[p * stride + D]);
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int p = 0; p < P; ++p) {
        const float* pp = part + p * stride;
        const float w = expf(pp[D] - m);
        l += pp[D + 1] * w;
        for (int d = 0; d < D; ++d) o[d] += pp[d] * w;
    }
    const float inv = 1.0f / l;
    for (int d = 0; d < D; ++d) o[d] *= inv;
}

#define DEFINE_DECODE_SCALAR(NAME, T, LOAD, STORE)                                                                  \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables, int64_t max_blocks,  \
          const int64_t* seq_lens, const int64_t* rows, T* out, int n, int H, int KVH, int D, int BS,        \
          float scale, int window, int64_t q_stride) {                                                        \
    const int G = H / KVH;                                                                                    \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                          \
    for (int task = 0; task < n * KVH; ++task) {                                                             \
        const int r = task / KVH, kh = task % KVH;                                                           \
        const int L = (int)seq_lens[r];                                                                       \
        const int start = (window > 0 && L > window) ? L - window : 0;                                        \
        const int ctx = L - start;                                                                            \
        const int64_t row = rows ? rows[r] : r;                                                               \
        float* s = (float*)malloc(sizeof(float) * (size_t)G * ctx);                                           \
        float* qf = (float*)malloc(sizeof(float) * (size_t)G * D);                                            \
        float* acc = (float*)calloc((size_t)G * D, sizeof(float));                                            \
        const int64_t* bt = block_tables + (int64_t)r * max_blocks;                                           \
        for (int g = 0; g < G; ++g) {                                                                         \
            const T* qp = q + row * q_stride + ((int64_t)kh * G + g) * D;                                     \
            for (int d = 0; d < D; ++d) qf[g * D + d] = LOAD(qp[d]) * scale;                                  \
        }                                                                                                     \
        for (int t = start; t < L; ++t) {                                                                     \
            const int64_t slot = bt[t / BS] * BS + t % BS;                                                    \
            const T* kp = k_cache + (slot * KVH + kh) * D;                                                    \
            for (int g = 0; g < G; ++g) {                                                                     \
                const float* qg = qf + g * D;                                                                 \
                float dot = 0.f;                                                                              \
                for (int d = 0; d < D; ++d) dot += qg[d] * LOAD(kp[d]);                                       \
                s[g * ctx + (t - start)] = dot;                                                               \
            }                                                                                                 \
        }                                                                                                     \
        float inv_sum[64];                                                                                    \
        for (int g = 0; g < G; ++g) {                                                                         \
            float* sg = s + g * ctx;                                                                          \
            float m = -INFINITY;                                                                              \
            for (int i = 0; i < ctx; ++i) m = sg[i] > m ? sg[i] : m;                                          \
            float sum = 0.f;                                                                                  \
            for (int i = 0; i < ctx; ++i) { sg[i] = expf(sg[i] - m); sum += sg[i]; }                          \
            inv_sum[g] = 1.f / sum;                                                                           \
        }                                                                                                     \
        for (int t = start; t < L; ++t) {                                                                     \
            const int64_t slot = bt[t / BS] * BS + t % BS;                                                    \
            const T* vp = v_cache + (slot * KVH + kh) * D;                                                    \
            for (int g = 0; g < G; ++g) {                                                                     \
                const float p = s[g * ctx + (t - start)];                                                     \
                float* ag = acc + g * D;                                                                      \
                for (int d = 0; d < D; ++d) ag[d] += p * LOAD(vp[d]);                                         \
            }                                                                                                 \
        }                                                                                                     \
        for (int g = 0; g < G; ++g) {                                                                         \
            T* op = out + (row * H + (int64_t)kh * G + g) * D;                                                \
            for (int d = 0; d < D; ++d) op[d] = STORE(acc[g * D + d] * inv_sum[g]);                           \
        }                                                                                                     \
        free(s); free(qf); free(acc);                                                                         \
    }                                                                                                         \
}

DEFINE_DECODE_SCALAR(paged_decode_bf16_scalar, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE_SCALAR(paged_decode_f32_scalar, float, f32_id, f32_id)

#if defined(__AVX512F__)
/* AVX-512 path: 16 float32 lanes; head_dim a multiple of 16, at most 256. K/V rows are widened to float32 once per
 * token and reused by the G query heads of the group; softmax uses a vectorized exp (below). */
#include "simd.h"

/* out[i] = sum of the 16 lanes of a[i], for i < 16: three shuffle+add rounds over all 16 vectors at once (45 ops
 * instead of 16 separate horizontal reductions). Inputs are read in a 4x4-transposed order so the result lands in
 * natural order. */
static inline __m512 reduce16(const __m512* a) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; ++i) {
        const int p0 = 2 * i, p1 = 2 * i + 1;
        const __m512 v0 = a[(p0 % 4) * 4 + p0 / 4], v1 = a[(p1 % 4) * 4 + p1 / 4];
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
    }
    for (int j = 0; j < 4; ++j)
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* One task: request `r`, KV heads [h0, h1). Tokens are visited 16 at a time (a tile); a token's K rows for
 * consecutive KV heads are adjacent in the cache, so the task streams each block's memory in order. Per tile and
 * head, K is widened to float32 once into `ktile` and reused by the G query heads of the group. Tokens [start, L) may
 * be one partition (DECODE_PART): then `part` takes the partial records; prefetches run on to token Lpf - 1. */
#define DEFINE_TASK_AVX512(NAME, T, LOADV, STORE)                                                             \
static inline __attribute__((always_inline)) void NAME(                                                      \
        const T* q, const T* k_cache, const T* v_cache, const int64_t* bt, int L, int start, int64_t row,     \
        T* out, int H, int KVH, int h0, int h1, int G, int BS, float scale, int64_t q_stride, const int ND,   \
        float* s, float* qf, float* acc, float* ktile, float* part, int Lpf) {                                \
    const int D = ND * 16, ctx = L - start, NH = h1 - h0, GH = G * NH;                                        \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        const T* qp = q + row * q_stride + ((int64_t)h0 * G + gh) * D;                                        \
        for (int j = 0; j < ND; ++j)                                                                          \
            _mm512_storeu_ps(qf + gh * D + 16 * j, _mm512_mul_ps(LOADV(qp + 16 * j), _mm512_set1_ps(scale))); \
    }                                                                                                         \
    __m512 mxv[64];                                                                                           \
    for (int gh = 0; gh < GH; ++gh) mxv[gh] = _mm512_set1_ps(-INFINITY);                                      \
    for (int t0 = start; t0 < L; t0 += 16) {                                                                  \
        const int nt = L - t0 < 16 ? L - t0 : 16;                                                             \
        const __mmask16 km = (__mmask16)((1u << nt) - 1u);                                                    \
        const T* rowp[16];                                                                                    \
        for (int i = 0; i < nt; ++i) {                                                                        \
            const int t = t0 + i;                                                                             \
            rowp[i] = k_cache + (bt[t / BS] * BS + t % BS) * (int64_t)KVH * D;                                \
        }                                                                                                     \
        if (t0 + 16 < Lpf) { /* prefetch the next tile's rows of these heads (adjacent in memory) */        \
            const int nn = Lpf - t0 - 16 < 16 ? Lpf - t0 - 16 : 16;                                           \
            for (int i = 0; i < nn; ++i) {                                                                    \
                const int t = t0 + 16 + i;                                                                    \
                const char* pk = (const char*)(k_cache + ((bt[t / BS] * BS + t % BS) * (int64_t)KVH + h0) * D); \
                const char* pv = (const char*)(v_cache + ((bt[t / BS] * BS + t % BS) * (int64_t)KVH + h0) * D); \
                for (int c = 0; c < NH * D * (int)sizeof(T); c += 64) {                                       \
                    _mm_prefetch(pk + c, _MM_HINT_T0);                                                        \
                    _mm_prefetch(pv + c, _MM_HINT_T1);                                                        \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int kh = h0; kh < h1; ++kh) {                                                                    \
            for (int i = 0; i < nt; ++i)                                                                      \
                for (int j = 0; j < ND; ++j)                                                                  \
                    _mm512_storeu_ps(ktile + i * D + 16 * j, LOADV(rowp[i] + (int64_t)kh * D + 16 * j));     \
            for (int g = 0; g < G; ++g) {                                                                     \
                const int gh = (kh - h0) * G + g;                                                             \
                const float* qg = qf + gh * D;                                                                \
                __m512 dots[16];                                                                              \
                for (int i = 0; i < 16; ++i) {                                                                \
                    if (i < nt) {                                                                             \
                        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(ktile + i * D));        \
                        for (int j = 1; j < ND; ++j)                                                          \
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j),                                 \
                                                _mm512_loadu_ps(ktile + i * D + 16 * j), a);                  \
                        dots[i] = a;                                                                          \
                    } else {                                                                                  \
                        dots[i] = _mm512_setzero_ps();                                                        \
                    }                                                                                         \
                }                                                                                             \
                const __m512 sv = reduce16(dots);                                                             \
                _mm512_mask_storeu_ps(s + (int64_t)gh * ctx + (t0 - start), km, sv);                          \
                mxv[gh] = _mm512_mask_max_ps(mxv[gh], km, mxv[gh], sv);                                       \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    float inv_sum[64], mxs[64], sums[64];                                                                     \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        float* sg = s + (int64_t)gh * ctx;                                                                    \
        mxs[gh] = _mm512_reduce_max_ps(mxv[gh]);                                                              \
        const __m512 m = _mm512_set1_ps(mxs[gh]);                                                             \
        __m512 sum = _mm512_setzero_ps();                                                                     \
        int i = 0;                                                                                            \
        for (; i + 16 <= ctx; i += 16) {                                                                      \
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), m));                                \
            _mm512_storeu_ps(sg + i, e);                                                                      \
            sum = _mm512_add_ps(sum, e);                                                                      \
        }                                                                                                     \
        if (i < ctx) {                                                                                        \
            const __mmask16 k = (__mmask16)((1u << (ctx - i)) - 1u);                                          \
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), m))); \
            _mm512_mask_storeu_ps(sg + i, k, e);                                                              \
            sum = _mm512_add_ps(sum, e);                                                                      \
        }                                                                                                     \
        sums[gh] = _mm512_reduce_add_ps(sum);                                                                 \
        inv_sum[gh] = 1.0f / sums[gh];                                                                        \
    }                                                                                                         \
    for (int i = 0; i < GH * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());                      \
    for (int t = start, b = start / BS, o = start % BS; t < L; ++t) {                                         \
        const T* vrow = v_cache + (bt[b] * BS + o) * (int64_t)KVH * D;                                        \
        if (++o == BS) { o = 0; ++b; }                                                                        \
        for (int kh = h0; kh < h1; ++kh) {                                                                    \
            const T* vp = vrow + (int64_t)kh * D;                                                             \
            __m512 vv[16];                                                                                    \
            for (int j = 0; j < ND; ++j) vv[j] = LOADV(vp + 16 * j);                                          \
            for (int g = 0; g < G; ++g) {                                                                     \
                const int gh = (kh - h0) * G + g;                                                             \
                const __m512 p = _mm512_set1_ps(s[(int64_t)gh * ctx + (t - start)]);                          \
                float* ag = acc + gh * D;                                                                     \
                for (int j = 0; j < ND; ++j)                                                                  \
                    _mm512_storeu_ps(ag + 16 * j, _mm512_fmadd_ps(p, vv[j], _mm512_loadu_ps(ag + 16 * j)));   \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    if (part) {                                                                                               \
        for (int gh = 0; gh < GH; ++gh)                                                                       \
            put_part(part + ((int64_t)h0 * G + gh) * PART_STRIDE(D), acc + gh * D, D, mxs[gh], sums[gh]);    \
        return;                                                                                               \
    }                                                                                                         \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        T* op = out + (row * H + (int64_t)h0 * G + gh) * D;                                                   \
        for (int d = 0; d < D; ++d) op[d] = STORE(acc[gh * D + d] * inv_sum[gh]);                             \
    }                                                                                                         \
}

DEFINE_TASK_AVX512(task_bf16, uint16_t, load16_bf16, f32_to_bf16)
DEFINE_TASK_AVX512(task_f32, float, load16_f32, f32_id)

#include <omp.h>

#if defined(__AVX512BF16__)
/* bf16 fast path (CPUs with AVX512-BF16), head_dim 64, 128 or 256: dp_req below. q.k from exact bf16 products summed
 * in float32 (vdpbf16ps, or AMX tiles where the process holds them), no widening of K; P stays float32 (unlike
 * flash-attention kernels that round it to bf16).
 *
 * Memory: a token's K (and V) rows of all KV heads are adjacent in the cache, so the score pass walks a request's
 * context 16 tokens at a time across all the task's heads (one run of memory per block). Each KV block is a jump the
 * hardware prefetcher can't follow, so rows are prefetched in software: K rows K_PREFETCH_BYTES ahead (of the task's
 * heads: at least 16 tokens) into L1, 16 rows a tile, a few lines after each piece of the score pass (one Q^T tile
 * product, or one query head's 16 dots), and each head's V row V_PREFETCH_BYTES ahead (at least 32 tokens) into L2
 * token by token during P.V. Prefetches issued in bursts stall the core once the line fill buffers are full, and then
 * nothing overlaps the memory wait; spread among the arithmetic they keep both going.
 * Measured (Xeon, AMX, 2 threads, random block tables, one layer's call, medians of interleaved runs), against the
 * per-head passes this replaces: SmolLM2's heads (9 on 3, head_dim 64) x 32 requests x 160 tokens ~190 -> ~175 us;
 * Qwen2.5-0.5B's (14 on 2, 64; the float32-widening task before) 230 -> 132 us; Qwen2.5-1.5B's (12 on 2, 128) x 8 x
 * 1,000 tokens 745 -> 475 us; Gemma 3's (4 on 1, 256) unchanged. At level avx512_bf16 (vdpbf16ps scores) the same
 * shapes: ~205 -> ~180, 225 -> 185, 750 -> 550 us. V prefetched in the score pass in one burst per tile 7-16% slower,
 * K in one burst per tile 0-10% (AMX) and 13-17% (vdpbf16ps) slower.
 * The distances in bytes, not tokens: they were 16 K and 32 V tokens, which is 6 KB of K when a task holds all of
 * SmolLM2's 3 KV heads (requests >= 2 x threads) but 2 KB when it holds one (fewer requests: one task a KV head).
 * AMD EPYC Zen 5 (2 threads, level avx512_bf16, contiguous block tables, one layer's call, interleaved), SmolLM2's
 * heads, one request at 150 / 250 / 1,000 tokens: 11.3 / 15.2 / 42.3 -> 10.3 / 12.9 / 34.6 us, 2 x 500 tokens 39.5
 * -> 31.4 us, 4-32 requests within 3%; Qwen2.5-1.5B's, one request at 1,000 tokens 50.9 -> 47.6 us, 8-16 requests
 * within 3%; Gemma 3's unchanged. As many tokens at T1 (into L2) instead of T0 were 3-8% slower at 16-32 requests.
 */
#define K_PREFETCH_BYTES 6144
#define V_PREFETCH_BYTES 8192

/* Tokens ahead that `bytes` of rows of `row_bytes` each make, at least `least`. */
static inline int prefetch_tokens(int bytes, int row_bytes, int least) {
    const int t = (bytes + row_bytes - 1) / row_bytes;
    return t < least ? least : t;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX score pass: see dp_req. On only when the process holds the AMX tile state (paged_decode_use_amx, set from
 * Python once pagedllm.utils.amx has asked for it). Tiles: 0 = scores, 1 = K rows, 2..7 = Q^T. */
#include "amx.h"
#define HAVE_AMX_SCORES 1
static int g_use_amx = 0;
void paged_decode_use_amx(int on) { g_use_amx = on; }

/* Loads Q^T tile p (tile register 2 + p, p < 6) from buf (1 KB, VNNI pairs x 16 columns). */
static inline void qt_load(int p, const uint32_t* buf) {
    amx_fence(); /* buf may just have been written */
    switch (p) {
        case 0: _tile_loadd(2, buf, 64); break;
        case 1: _tile_loadd(3, buf, 64); break;
        case 2: _tile_loadd(4, buf, 64); break;
        case 3: _tile_loadd(5, buf, 64); break;
        case 4: _tile_loadd(6, buf, 64); break;
        default: _tile_loadd(7, buf, 64); break;
    }
}

/* scores tile 0 += K rows (tile 1: 16 rows `stride` bytes apart from kp) x Q^T tile 2 + p */
static inline void qk_tile(int p, const uint16_t* kp, int64_t stride) {
    _tile_loadd(1, kp, stride);
    switch (p) {
        case 0: _tile_dpbf16ps(0, 1, 2); break;
        case 1: _tile_dpbf16ps(0, 1, 3); break;
        case 2: _tile_dpbf16ps(0, 1, 4); break;
        case 3: _tile_dpbf16ps(0, 1, 5); break;
        case 4: _tile_dpbf16ps(0, 1, 6); break;
        default: _tile_dpbf16ps(0, 1, 7); break;
    }
}
#else
#define HAVE_AMX_SCORES 0
static const int g_use_amx = 0;
void paged_decode_use_amx(int on) { (void)on; }
#endif

/* P.V over the whole context for query heads gh0 .. gh0 + GC - 1 (rows of s and acc) of KV head kh: GC x ND float32
 * accumulators in registers, token by token in order, so a head's sums never depend on which heads share the call.
 * V rows are widened 32 dims per load in two ops: even dims (low halves) shifted up, odd dims (high halves) masked,
 * so accumulator 2c holds dims 32c, 32c+2, ... and 2c+1 dims 32c+1, 32c+3, ... (dp_req's epilogue undoes it). */
static inline __attribute__((always_inline)) void pv_span(
        const uint16_t* v_cache, const int64_t* bt, int BS, int start, int L, int64_t row_elems, int kh,
        const float* s, int64_t ctx, int gh0, float* acc, const int GC, const int ND, int Lpf) {
    const int D = ND * 16, NP = ND / 2;
    __m512 a[24];
    for (int i = 0; i < GC * ND; ++i) a[i] = _mm512_setzero_ps();
    const int vpt = prefetch_tokens(V_PREFETCH_BYTES, D * 2, 32);
    int pb = (start + vpt) / BS, po = (start + vpt) % BS;
    for (int t = start, b = start / BS, o = start % BS; t < L; ++t) {
        const uint16_t* vp = v_cache + (bt[b] * BS + o) * row_elems + (int64_t)kh * D;
        if (++o == BS) { o = 0; ++b; }
        if (t + vpt < Lpf) { /* this head's V row ahead, to L2: one row a token, among the FMAs */
            const char* pv = (const char*)(v_cache + (bt[pb] * BS + po) * row_elems + (int64_t)kh * D);
            if (++po == BS) { po = 0; ++pb; }
            for (int c = 0; c < D * 2; c += 64) _mm_prefetch(pv + c, _MM_HINT_T1);
        }
        __m512 vv[16];
        for (int c = 0; c < NP; ++c) {
            const __m512i x = _mm512_loadu_si512((const void*)(vp + 32 * c));
            vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
        }
        for (int g = 0; g < GC; ++g) {
            const __m512 pw = _mm512_set1_ps(s[(int64_t)(gh0 + g) * ctx + (t - start)]);
            for (int j = 0; j < ND; ++j) a[g * ND + j] = _mm512_fmadd_ps(pw, vv[j], a[g * ND + j]);
        }
    }
    for (int g = 0; g < GC; ++g)
        for (int j = 0; j < ND; ++j) _mm512_store_ps(acc + (int64_t)(gh0 + g) * D + 16 * j, a[g * ND + j]);
}

/* pv_span for the G query heads of KV head kh, in parts of at most 24 accumulators (ND 4: 6 heads, 8: 3, 16: 1). */
static inline void pv_head(const uint16_t* v_cache, const int64_t* bt, int BS, int start, int L, int64_t row_elems,
                           int kh, int G, int h0, const float* s, int64_t ctx, float* acc, const int ND, int Lpf) {
    const int cmax = 24 / ND, parts = (G + cmax - 1) / cmax;
    for (int part = 0; part < parts; ++part) {
        const int g0 = G * part / parts, gc = G * (part + 1) / parts - g0, gh0 = (kh - h0) * G + g0;
#define PV_CASE(C_) case C_: pv_span(v_cache, bt, BS, start, L, row_elems, kh, s, ctx, gh0, acc, C_, ND, Lpf); break;
        switch (gc) { PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) default: PV_CASE(6) }
#undef PV_CASE
    }
}

/* Decode attention of one request for KV heads [h0, h1) (G query heads each, G (h1 - h0) <= 64), head_dim 16 ND
 * (ND 4, 8 or 16), bf16, in three passes over the context:
 *   scores: 16 tokens at a time across all the task's heads; q.k either on AMX (`amx`, ND <= 8: one 16-token x
 *   16-column score tile for up to 16 / G KV heads at once, each head's Q^T tiles holding its own G columns and zeros
 *   elsewhere, so a column sums exactly its own head's products in its own dim order while the other heads add exact
 *   zeros) or by vdpbf16ps per (query head, token), the 16 tokens' lanes reduced as reduce16; times `scale`;
 *   softmax per query head (max, exp16, one float32 sum);
 *   P.V per KV head (pv_head).
 * A query head's arithmetic is the same whichever heads share the task or its score tile (tested: alone vs among
 * others at every task split). s: G (h1 - h0) x ctx floats; acc: G (h1 - h0) x D floats, 64-byte aligned; qbuf:
 * (h1 - h0) x ND / 2 KB, 64-byte aligned (AMX only). [start, L) may be one partition of a longer context (see
 * DECODE_PART): `part` non-NULL takes its partial records instead of `out`; prefetches run on to token Lpf - 1. */
static inline __attribute__((always_inline)) void dp_req(
        const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* bt, int L, int start,
        int64_t row, uint16_t* out, int H, int KVH, int h0, int h1, int G, int BS, float scale, int64_t q_stride,
        const int ND, float* s, float* acc, uint32_t* qbuf, int amx, float* part, int Lpf) {
    const int D = ND * 16, ctx = L - start, NP = ND / 2, NH = h1 - h0, GH = NH * G;
    const int64_t row_elems = (int64_t)KVH * D;
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 mxv[64];
    for (int gh = 0; gh < GH; ++gh) mxv[gh] = _mm512_set1_ps(-INFINITY);
#if HAVE_AMX_SCORES
    /* KV heads per score tile: their G columns each fit its 16, their Q^T tiles the 6 registers 2..7 */
    int kc = 16 / G < 6 / NP ? 16 / G : 6 / NP;
    if (kc > NH) kc = NH;
    if (kc < 1) amx = 0;
    const int nchunk = amx ? (NH + kc - 1) / kc : 0;
    float cbuf[16 * 16] __attribute__((aligned(64)));
    for (int kh = h0; amx && kh < h1; ++kh) { /* Q^T tiles in qbuf (1 KB each); loaded once when one chunk holds all */
        const int ch0 = h0 + (kh - h0) / kc * kc;
        const uint16_t* cols[16] = {0};
        for (int g = 0; g < G; ++g) cols[(kh - ch0) * G + g] = q + row * q_stride + ((int64_t)kh * G + g) * D;
        for (int c = 0; c < NP; ++c) {
            uint32_t* buf = qbuf + (int64_t)((kh - h0) * NP + c) * 256;
            amx_qt_transpose(c, cols, 16, buf);
            if (nchunk == 1) qt_load((kh - ch0) * NP + c, buf);
        }
    }
#endif
    const int pf_pieces = amx ? NH * NP : GH; /* Q^T tile products, or query heads, of a tile's score pass */
    int cb = start / BS, co = start % BS;
    const int kpt = prefetch_tokens(K_PREFETCH_BYTES, NH * D * 2, 16);
    int pb = (start + kpt) / BS, po = (start + kpt) % BS;
    for (int t0 = start; t0 < L; t0 += 16) {
        const int nt = L - t0 < 16 ? L - t0 : 16;
        const __mmask16 km = (__mmask16)((1u << nt) - 1u);
        int64_t off[16]; /* the tile's rows in the cache, elements */
        for (int i = 0; i < nt; ++i) {
            off[i] = (bt[cb] * BS + co) * row_elems;
            if (++co == BS) { co = 0; ++cb; }
        }
        /* 16 K rows kpt tokens ahead, to L1, a few lines after each piece of this tile's score work (PF_LINES) */
        const char* pfrow[16];
        int npf = 0, pfi = 0, pfc = 0;
        for (int i = 0; i < 16 && t0 + kpt + i < Lpf; ++i) {
            pfrow[npf++] = (const char*)(k_cache + (bt[pb] * BS + po) * row_elems + (int64_t)h0 * D);
            if (++po == BS) { po = 0; ++pb; }
        }
        const int lpr = NH * D * 2 / 64; /* lines a row */
        const int pfq = (npf * lpr + pf_pieces - 1) / pf_pieces; /* lines after each piece of score work */
#define PF_LINES(k_)                                                                                            \
        for (int k = 0; k < (k_) && pfi < npf; ++k) {                                                           \
            _mm_prefetch(pfrow[pfi] + 64 * pfc, _MM_HINT_T0);                                                   \
            if (++pfc == lpr) { pfc = 0; ++pfi; }                                                               \
        }
#if HAVE_AMX_SCORES
        if (amx) { /* rows past L (same block) are read but masked out by km */
            for (int ch = 0; ch < nchunk; ++ch) {
                const int ch0 = h0 + ch * kc, ch1 = ch0 + kc < h1 ? ch0 + kc : h1;
                if (nchunk > 1)
                    for (int kh = ch0; kh < ch1; ++kh)
                        for (int c = 0; c < NP; ++c)
                            qt_load((kh - ch0) * NP + c, qbuf + (int64_t)((kh - h0) * NP + c) * 256);
                _tile_zero(0);
                for (int kh = ch0; kh < ch1; ++kh)
                    for (int c = 0; c < NP; ++c) {
                        qk_tile((kh - ch0) * NP + c, k_cache + off[0] + (int64_t)kh * D + 32 * c, row_elems * 2);
                        PF_LINES(pfq)
                    }
                _tile_stored(0, cbuf, 64);
                __m512i r[16];
                for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512((const void*)(cbuf + 16 * i));
                transpose16x16_epi32(r); /* r[n]: score column n (a query head) of the 16 tokens */
                for (int n = 0; n < (ch1 - ch0) * G; ++n) {
                    const int gh = (ch0 - h0) * G + n;
                    const __m512 sv = _mm512_mul_ps(_mm512_castsi512_ps(r[n]), vscale);
                    _mm512_mask_storeu_ps(s + (int64_t)gh * ctx + (t0 - start), km, sv);
                    mxv[gh] = _mm512_mask_max_ps(mxv[gh], km, mxv[gh], sv);
                }
            }
            continue;
        }
#endif
        for (int kh = h0; kh < h1; ++kh)
            for (int g = 0; g < G; ++g) {
                const int gh = (kh - h0) * G + g;
                PF_LINES(pfq)
                const uint16_t* qp = q + row * q_stride + ((int64_t)kh * G + g) * D;
                __m512bh qv[8];
                for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512((const void*)(qp + 32 * c));
                __m512 dots[16];
                for (int i = 0; i < 16; ++i) {
                    __m512 a = _mm512_setzero_ps();
                    if (i < nt)
                        for (int c = 0; c < NP; ++c)
                            a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(
                                (const void*)(k_cache + off[i] + (int64_t)kh * D + 32 * c)));
                    dots[i] = a;
                }
                const __m512 sv = _mm512_mul_ps(reduce16(dots), vscale);
                _mm512_mask_storeu_ps(s + (int64_t)gh * ctx + (t0 - start), km, sv);
                mxv[gh] = _mm512_mask_max_ps(mxv[gh], km, mxv[gh], sv);
            }
    }
#undef PF_LINES
    float inv_sum[64], mxs[64], sums[64];
    for (int gh = 0; gh < GH; ++gh) {
        float* sg = s + (int64_t)gh * ctx;
        mxs[gh] = _mm512_reduce_max_ps(mxv[gh]);
        const __m512 m = _mm512_set1_ps(mxs[gh]);
        __m512 sum = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= ctx; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), m));
            _mm512_storeu_ps(sg + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (i < ctx) {
            const __mmask16 k = (__mmask16)((1u << (ctx - i)) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), m)));
            _mm512_mask_storeu_ps(sg + i, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        sums[gh] = _mm512_reduce_add_ps(sum);
        inv_sum[gh] = 1.0f / sums[gh];
    }
    for (int kh = h0; kh < h1; ++kh)
        switch (ND) {
            case 4: pv_head(v_cache, bt, BS, start, L, row_elems, kh, G, h0, s, ctx, acc, 4, Lpf); break;
            case 8: pv_head(v_cache, bt, BS, start, L, row_elems, kh, G, h0, s, ctx, acc, 8, Lpf); break;
            default: pv_head(v_cache, bt, BS, start, L, row_elems, kh, G, h0, s, ctx, acc, 16, Lpf); break;
        }
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* even/odd -> dims */
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    if (part) { /* the partition's unnormalized sums in dims order, its max and its sum (see put_part) */
        for (int gh = 0; gh < GH; ++gh) {
            float* pp = part + ((int64_t)h0 * G + gh) * PART_STRIDE(D);
            const float* ag = acc + (int64_t)gh * D;
            for (int c = 0; c < NP; ++c) {
                const __m512 e = _mm512_load_ps(ag + 32 * c), o = _mm512_load_ps(ag + 32 * c + 16);
                _mm512_storeu_ps(pp + 32 * c, _mm512_permutex2var_ps(e, lo, o));
                _mm512_storeu_ps(pp + 32 * c + 16, _mm512_permutex2var_ps(e, hi, o));
            }
            pp[D] = mxs[gh];
            pp[D + 1] = sums[gh];
        }
        return;
    }
    for (int gh = 0; gh < GH; ++gh) {
        uint16_t* op = out + (row * H + (int64_t)h0 * G + gh) * D;
        const float* ag = acc + (int64_t)gh * D;
        const __m512 is = _mm512_set1_ps(inv_sum[gh]);
        for (int c = 0; c < NP; ++c) {
            const __m512 e = _mm512_mul_ps(_mm512_load_ps(ag + 32 * c), is);
            const __m512 o = _mm512_mul_ps(_mm512_load_ps(ag + 32 * c + 16), is);
            _mm256_storeu_si256((__m256i*)(op + 32 * c), store16_bf16_bits(_mm512_permutex2var_ps(e, lo, o)));
            _mm256_storeu_si256((__m256i*)(op + 32 * c + 16), store16_bf16_bits(_mm512_permutex2var_ps(e, hi, o)));
        }
    }
}

/* Runs KV heads [h0, h1) of one request through dp_req when head_dim is 64, 128 or 256; returns 0 (did nothing)
 * otherwise. */
static int dp_dispatch(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* bt,
                       int L, int start, int64_t row, uint16_t* out, int H, int KVH, int h0, int h1, int G, int BS,
                       float scale, int64_t q_stride, int ND, float* s, float* acc, uint32_t* qbuf, float* part,
                       int Lpf) {
    if (ND != 4 && ND != 8 && ND != 16) return 0;
    /* the AMX score pass needs whole 16-token tiles inside one block */
    const int amx = g_use_amx && BS % 16 == 0 && start % 16 == 0;
    /* one instance per head_dim: with ND a constant the score pass keeps q and the 16 dots in registers (one generic
     * instance kept them on the stack with a bounds check per pair; Zen 5, SmolLM2's heads, 32 requests x 400
     * cache-resident tokens: 172 -> 142 us a call) */
#define DP_CASE(ND_)                                                                                             \
    dp_req(q, k_cache, v_cache, bt, L, start, row, out, H, KVH, h0, h1, G, BS, scale, q_stride, ND_, s, acc, qbuf,  \
           amx, part, Lpf)
    switch (ND) {
        case 4: DP_CASE(4); break;
        case 8: DP_CASE(8); break;
        default: DP_CASE(16); break;
    }
#undef DP_CASE
    return 1;
}
#define TRY_FAST_bf16(...) dp_dispatch(__VA_ARGS__)
#if HAVE_AMX_SCORES /* each thread of the region configures its tiles once (bf16 only) */
#define AMX_TILES_WANTED(T, BS) (sizeof(T) == 2 && g_use_amx && (BS) % 16 == 0)
#define AMX_CONFIG() config_tiles_16x64()
#define AMX_RELEASE() _tile_release()
#endif
#else
#define TRY_FAST_bf16(...) 0
#endif
#define DECODE_LANES 16
#define DECODE_ND_A 4 /* head_dim 64 and 128: unrolled instantiations */
#define DECODE_ND_B 8

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 path: the AVX-512 one with 8 float32 lanes (tiles of 8 tokens, no masks: tails go through small buffers);
 * head_dim a multiple of 8, at most 256. Both passes keep their sums in registers: a tile's 8 score chains advance
 * side by side (one FMA chain per token in turn left each waiting on the last's latency), and P V accumulates over a
 * run of tokens per register block (PV_BLOCK) instead of loading and storing every accumulator once a token. Same
 * bits as those loops (every sum keeps its order). Measured on an AMD EPYC Zen 3 (2 threads, one request, bf16, the
 * kernel called from C-typed arguments, cache warm or flushed alike): Gemma 3 270M's 4 heads on 1 (D 256) at 512
 * tokens 90 -> 34 us a layer; Qwen2.5 1.5B's 12 on 2 (D 128) at 160 tokens 37 -> 15 us, at 512 86 -> 44 us; in the
 * engine, Gemma's 18 layers at 130-190 tokens 440-610 -> 300-410 us a decode step (builds alternating). */
#include <omp.h>
#include "simd.h"
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }

/* out[i] = sum of the 8 lanes of a[i], i < 8 (two hadd rounds, then the two 128-bit halves added). */
static inline __m256 reduce8(const __m256* a) {
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* acc [GB heads][D] (rows D floats apart) += p V over `run` tokens: V rows `vstride` elements apart from `vp`, each
 * head's weights `ctx` floats apart from `sp` (token i at sp[g ctx + i]). Per CH x 8 dims the GB x CH accumulators
 * stay in registers over the run (read and written once a run, not once a token); every accumulator still takes its
 * tokens in order, one FMA each, so the sums are the one-token-at-a-time loop's bit for bit. Dims past the last
 * whole CH x 8 go one vector at a time. */
#define PV_RUN 16
#define PV_BLOCK(T, LOADV, vp, vstride, run, sp, ctx, ap, D, ND, GB, CH)                                      \
    do {                                                                                                      \
        int j0 = 0;                                                                                           \
        for (; j0 + (CH) <= (ND); j0 += (CH)) {                                                               \
            __m256 a_[GB][CH];                                                                                \
            for (int g = 0; g < (GB); ++g)                                                                    \
                for (int c = 0; c < (CH); ++c) a_[g][c] = _mm256_loadu_ps((ap) + g * (D) + 8 * (j0 + c));     \
            for (int i = 0; i < (run); ++i) {                                                                 \
                const T* v_ = (vp) + i * (vstride) + 8 * j0;                                                  \
                __m256 vv_[CH];                                                                               \
                for (int c = 0; c < (CH); ++c) vv_[c] = LOADV(v_ + 8 * c);                                    \
                for (int g = 0; g < (GB); ++g) {                                                              \
                    const __m256 p_ = _mm256_broadcast_ss((sp) + g * (ctx) + i);                              \
                    for (int c = 0; c < (CH); ++c) a_[g][c] = _mm256_fmadd_ps(p_, vv_[c], a_[g][c]);          \
                }                                                                                             \
            }                                                                                                 \
            for (int g = 0; g < (GB); ++g)                                                                    \
                for (int c = 0; c < (CH); ++c) _mm256_storeu_ps((ap) + g * (D) + 8 * (j0 + c), a_[g][c]);     \
        }                                                                                                     \
        for (; j0 < (ND); ++j0) {                                                                             \
            __m256 a_[GB];                                                                                    \
            for (int g = 0; g < (GB); ++g) a_[g] = _mm256_loadu_ps((ap) + g * (D) + 8 * j0);                 \
            for (int i = 0; i < (run); ++i) {                                                                 \
                const __m256 vv_ = LOADV((vp) + i * (vstride) + 8 * j0);                                      \
                for (int g = 0; g < (GB); ++g)                                                                \
                    a_[g] = _mm256_fmadd_ps(_mm256_broadcast_ss((sp) + g * (ctx) + i), vv_, a_[g]);           \
            }                                                                                                 \
            for (int g = 0; g < (GB); ++g) _mm256_storeu_ps((ap) + g * (D) + 8 * j0, a_[g]);                  \
        }                                                                                                     \
    } while (0)

#define DEFINE_TASK_AVX2(NAME, T, LOADV, STORE)                                                               \
static inline __attribute__((always_inline)) void NAME(                                                      \
        const T* q, const T* k_cache, const T* v_cache, const int64_t* bt, int L, int start, int64_t row,     \
        T* out, int H, int KVH, int h0, int h1, int G, int BS, float scale, int64_t q_stride, const int ND,   \
        float* s, float* qf, float* acc, float* ktile, float* part, int Lpf) {                                \
    const int D = ND * 8, ctx = L - start, NH = h1 - h0, GH = G * NH;                                         \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        const T* qp = q + row * q_stride + ((int64_t)h0 * G + gh) * D;                                        \
        for (int j = 0; j < ND; ++j)                                                                          \
            _mm256_storeu_ps(qf + gh * D + 8 * j, _mm256_mul_ps(LOADV(qp + 8 * j), _mm256_set1_ps(scale)));   \
    }                                                                                                         \
    float mx[64];                                                                                             \
    for (int gh = 0; gh < GH; ++gh) mx[gh] = -INFINITY;                                                       \
    for (int t0 = start; t0 < L; t0 += 8) {                                                                   \
        const int nt = L - t0 < 8 ? L - t0 : 8;                                                               \
        const T* rowp[8];                                                                                     \
        for (int i = 0; i < nt; ++i) {                                                                        \
            const int t = t0 + i;                                                                             \
            rowp[i] = k_cache + (bt[t / BS] * BS + t % BS) * (int64_t)KVH * D;                                \
        }                                                                                                     \
        if (t0 + 8 < Lpf) { /* prefetch the next tile's rows of these heads (adjacent in memory) */         \
            const int nn = Lpf - t0 - 8 < 8 ? Lpf - t0 - 8 : 8;                                               \
            for (int i = 0; i < nn; ++i) {                                                                    \
                const int t = t0 + 8 + i;                                                                     \
                const char* pk = (const char*)(k_cache + ((bt[t / BS] * BS + t % BS) * (int64_t)KVH + h0) * D); \
                const char* pv = (const char*)(v_cache + ((bt[t / BS] * BS + t % BS) * (int64_t)KVH + h0) * D); \
                for (int c = 0; c < NH * D * (int)sizeof(T); c += 64) {                                       \
                    _mm_prefetch(pk + c, _MM_HINT_T0);                                                        \
                    _mm_prefetch(pv + c, _MM_HINT_T1);                                                        \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int kh = h0; kh < h1; ++kh) {                                                                    \
            for (int i = 0; i < nt; ++i)                                                                      \
                for (int j = 0; j < ND; ++j)                                                                  \
                    _mm256_storeu_ps(ktile + i * D + 8 * j, LOADV(rowp[i] + (int64_t)kh * D + 8 * j));        \
            for (int i = nt; i < 8; ++i) /* a tail tile's unused rows: zeros (their dots are dropped) */       \
                for (int j = 0; j < ND; ++j) _mm256_storeu_ps(ktile + i * D + 8 * j, _mm256_setzero_ps());    \
            for (int g = 0; g < G; ++g) {                                                                     \
                const int gh = (kh - h0) * G + g;                                                             \
                const float* qg = qf + gh * D;                                                                \
                __m256 dots[8]; /* the 8 tokens' chains side by side (j outer): 8 FMAs in flight, not one */  \
                __m256 qv = _mm256_loadu_ps(qg);                                                              \
                for (int i = 0; i < 8; ++i) dots[i] = _mm256_mul_ps(qv, _mm256_loadu_ps(ktile + i * D));      \
                for (int j = 1; j < ND; ++j) {                                                                \
                    qv = _mm256_loadu_ps(qg + 8 * j);                                                         \
                    for (int i = 0; i < 8; ++i)                                                               \
                        dots[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(ktile + i * D + 8 * j), dots[i]);       \
                }                                                                                             \
                float sv[8];                                                                                  \
                _mm256_storeu_ps(sv, reduce8(dots));                                                          \
                float* sg = s + (int64_t)gh * ctx + (t0 - start);                                             \
                for (int i = 0; i < nt; ++i) {                                                                \
                    sg[i] = sv[i];                                                                            \
                    mx[gh] = sv[i] > mx[gh] ? sv[i] : mx[gh];                                                 \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    float inv_sum[64], sums[64];                                                                              \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        float* sg = s + (int64_t)gh * ctx;                                                                    \
        const __m256 m = _mm256_set1_ps(mx[gh]);                                                              \
        __m256 sum = _mm256_setzero_ps();                                                                     \
        int i = 0;                                                                                            \
        for (; i + 8 <= ctx; i += 8) {                                                                        \
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));                                 \
            _mm256_storeu_ps(sg + i, e);                                                                      \
            sum = _mm256_add_ps(sum, e);                                                                      \
        }                                                                                                     \
        float lanes[8], tail[8] = {0};                                                                        \
        const int nr = ctx - i;                                                                               \
        if (nr > 0) { /* the last < 8 scores: exp of a padded vector, the pad lanes dropped */               \
            for (int l = 0; l < nr; ++l) tail[l] = sg[i + l];                                                 \
            _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), m)));                           \
            for (int l = 0; l < 8; ++l) tail[l] = l < nr ? tail[l] : 0.0f;                                    \
            for (int l = 0; l < nr; ++l) sg[i + l] = tail[l];                                                 \
            sum = _mm256_add_ps(sum, _mm256_loadu_ps(tail));                                                  \
        }                                                                                                     \
        _mm256_storeu_ps(lanes, sum);                                                                         \
        float tot = 0.0f;                                                                                     \
        for (int l = 0; l < 8; ++l) tot += lanes[l];                                                          \
        sums[gh] = tot;                                                                                       \
        inv_sum[gh] = 1.0f / tot;                                                                             \
    }                                                                                                         \
    for (int i = 0; i < GH * D; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());                       \
    /* acc += p V, a run of tokens at a time (those of one cache block, at most PV_RUN), per KV head, per group of \
     * <= 4 query heads and 8 CH dims: the accumulators stay in registers over the run (PV_BLOCK) */         \
    const int64_t vstride = (int64_t)KVH * D;                                                                 \
    for (int t = start; t < L;) {                                                                             \
        const int o = t % BS, left = BS - o < L - t ? BS - o : L - t, run = left < PV_RUN ? left : PV_RUN;    \
        const T* vrun = v_cache + (bt[t / BS] * BS + o) * vstride;                                            \
        for (int kh = h0; kh < h1; ++kh)                                                                      \
            for (int g0 = 0; g0 < G; g0 += 4) {                                                               \
                const int gb = G - g0 < 4 ? G - g0 : 4, gh0 = (kh - h0) * G + g0;                             \
                const float* sp = s + (int64_t)gh0 * ctx + (t - start);                                       \
                float* ap = acc + gh0 * D;                                                                    \
                const T* vp = vrun + (int64_t)kh * D;                                                         \
                switch (gb) {                                                                                 \
                    case 1: PV_BLOCK(T, LOADV, vp, vstride, run, sp, ctx, ap, D, ND, 1, 4); break;            \
                    case 2: PV_BLOCK(T, LOADV, vp, vstride, run, sp, ctx, ap, D, ND, 2, 4); break;            \
                    case 3: PV_BLOCK(T, LOADV, vp, vstride, run, sp, ctx, ap, D, ND, 3, 2); break;            \
                    default: PV_BLOCK(T, LOADV, vp, vstride, run, sp, ctx, ap, D, ND, 4, 2);                  \
                }                                                                                             \
            }                                                                                                 \
        t += run;                                                                                             \
    }                                                                                                         \
    if (part) {                                                                                               \
        for (int gh = 0; gh < GH; ++gh)                                                                       \
            put_part(part + ((int64_t)h0 * G + gh) * PART_STRIDE(D), acc + gh * D, D, mx[gh], sums[gh]);     \
        return;                                                                                               \
    }                                                                                                         \
    for (int gh = 0; gh < GH; ++gh) {                                                                         \
        T* op = out + (row * H + (int64_t)h0 * G + gh) * D;                                                   \
        for (int d = 0; d < D; ++d) op[d] = STORE(acc[gh * D + d] * inv_sum[gh]);                             \
    }                                                                                                         \
}

DEFINE_TASK_AVX2(task_bf16, uint16_t, load8_bf16, f32_to_bf16)
DEFINE_TASK_AVX2(task_f32, float, load8_f32, f32_id)
#define TRY_FAST_bf16(...) 0
#define DECODE_LANES 8
#define DECODE_ND_A 8 /* head_dim 64 and 128 */
#define DECODE_ND_B 16
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TRY_FAST_f32(...) 0
#ifndef AMX_TILES_WANTED
#define AMX_TILES_WANTED(T, BS) 0
#define AMX_CONFIG() ((void)0)
#define AMX_RELEASE() ((void)0)
#endif


/* Work split, over units (request, context partition; see DECODE_PART): with at least 2 x threads requests, one task
 * per request (all its KV heads: sequential memory; its partitions in order, then combined in the task); else one
 * task per (unit, KV head), and with fewer of those than threads (one short request of a model with one KV head:
 * Gemma 3 270M) the G query heads of each KV head are cut into `gs` parts, each a task that reads that head's K and V
 * itself; the partitions' records are combined after all tasks. A query head's arithmetic never depends on which
 * other heads share its task, so every split gives the same bits (the parts run as groups of G' = g1 - g0 heads: the
 * task's q, out and record pointers are shifted so that its head index kh * G' + g lands on kh * G + g0 + g). */
#define DEFINE_DECODE_SIMD(NAME, T, TASK, SCALAR, FAST, STORE)                                                   \
void NAME(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables, int64_t max_blocks,  \
          const int64_t* seq_lens, const int64_t* rows, T* out, int n, int H, int KVH, int D, int BS,        \
          float scale, int window, int64_t q_stride) {                                                        \
    const int G = H / KVH, ND = D / DECODE_LANES;                                                             \
    if (D % DECODE_LANES != 0 || D > 256 || H > 64) {                                                         \
        SCALAR(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, rows, out, n, H, KVH, D, BS, scale,   \
               window, q_stride);                                                                             \
        return;                                                                                               \
    }                                                                                                         \
    const int nthreads = omp_get_max_threads();                                                               \
    const int per_req = n >= 2 * nthreads;                                                                    \
    const int split = per_req ? 1 : KVH;                                                                      \
    const int hpt = KVH / split;                                                                              \
    const int64_t PS = PART_STRIDE(D);                                                                        \
    /* units: request r's partitions are units ustart[r] .. ustart[r + 1] - 1 (ureq: each unit's request) */ \
    int64_t* ustart = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 1));                                    \
    ustart[0] = 0;                                                                                            \
    for (int r = 0; r < n; ++r) {                                                                             \
        const int L = (int)seq_lens[r], start = (window > 0 && L > window) ? L - window : 0;                  \
        ustart[r + 1] = ustart[r] + (L - start + DECODE_PART - 1) / DECODE_PART;                              \
    }                                                                                                         \
    const int64_t nu = ustart[n];                                                                             \
    int* ureq = NULL;                                                                                         \
    float* gpart = NULL; /* the per-unit tasks' records: [unit][H][PS] */                                     \
    if (!per_req) {                                                                                           \
        ureq = (int*)malloc(sizeof(int) * (size_t)nu);                                                        \
        for (int r = 0; r < n; ++r)                                                                           \
            for (int64_t u = ustart[r]; u < ustart[r + 1]; ++u) ureq[u] = r;                                  \
        if (nu > n) gpart = (float*)aligned_alloc(64, sizeof(float) * (size_t)(nu * H * PS));                 \
    }                                                                                                         \
    const int64_t units = per_req ? n : nu * split;                                                           \
    const int gs = units >= nthreads ? 1 : (nthreads / units < G ? (int)(nthreads / units) : G);              \
    const int64_t ntask = units * gs;                                                                         \
    _Pragma("omp parallel if (ntask > 1)")                                                                    \
    {                                                                                                         \
        int cap = 0;                                                                                          \
        int64_t pcap = 0;                                                                                     \
        float* s = NULL;                                                                                      \
        float* tpart = NULL; /* per_req: one request's records, [partition][H][PS] */                         \
        float* qf = (float*)aligned_alloc(64, sizeof(float) * (size_t)H * D);                                 \
        float* acc = (float*)aligned_alloc(64, sizeof(float) * (size_t)H * D);                                \
        float* ktile = (float*)aligned_alloc(64, sizeof(float) * (size_t)16 * D);                             \
        float* ob = (float*)aligned_alloc(64, sizeof(float) * 256);                                           \
        const int tiles = AMX_TILES_WANTED(T, BS);                                                            \
        /* dp_req's AMX score pass: up to 4 Q^T tiles a KV head */                                            \
        uint32_t* qbuf = tiles ? (uint32_t*)aligned_alloc(64, (size_t)1024 * KVH * 4) : NULL;                 \
        if (tiles) AMX_CONFIG();                                                                              \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int64_t task = 0; task < ntask; ++task) {                                                        \
            const int64_t unit = task / gs;                                                                   \
            const int r = per_req ? (int)unit : ureq[unit / split];                                           \
            const int h0 = per_req ? 0 : (int)(unit % split) * hpt, h1 = h0 + hpt;                            \
            const int gi = (int)(task % gs), g0 = G * gi / gs, Gt = G * (gi + 1) / gs - g0;                   \
            const int64_t shift = (int64_t)(h0 * (G - Gt) + g0); /* heads: see the note above */             \
            const T* qt = q + shift * D;                                                                      \
            T* ot = out + shift * D;                                                                          \
            const int L = (int)seq_lens[r];                                                                   \
            const int start = (window > 0 && L > window) ? L - window : 0;                                    \
            const int P = (int)(ustart[r + 1] - ustart[r]);                                                   \
            const int p0 = per_req ? 0 : (int)(unit / split - ustart[r]), p1 = per_req ? P : p0 + 1;          \
            const int64_t row = rows ? rows[r] : r;                                                           \
            const int64_t* bt = block_tables + (int64_t)r * max_blocks;                                       \
            if (per_req && P > 1 && (int64_t)P * H * PS > pcap) {                                             \
                free(tpart);                                                                                  \
                pcap = (int64_t)P * H * PS;                                                                   \
                tpart = (float*)aligned_alloc(64, sizeof(float) * (size_t)pcap);                              \
            }                                                                                                 \
            for (int p = p0; p < p1; ++p) {                                                                   \
                const int ps = start + p * DECODE_PART, pl = L - ps < DECODE_PART ? L : ps + DECODE_PART;     \
                float* pr = P == 1 ? NULL : (per_req ? tpart + (int64_t)p * H * PS                            \
                                                     : gpart + (ustart[r] + p) * H * PS) + shift * PS;        \
                if (G * hpt * (pl - ps) > cap) {                                                              \
                    free(s);                                                                                  \
                    cap = G * hpt * (pl - ps);                                                                \
                    s = (float*)malloc(sizeof(float) * (size_t)cap);                                          \
                }                                                                                             \
                if (FAST(qt, k_cache, v_cache, bt, pl, ps, row, ot, H, KVH, h0, h1, Gt, BS, scale, q_stride,  \
                         ND, s, acc, qbuf, pr, L))                                                            \
                    continue;                                                                                 \
                switch (ND) {                                                                                 \
                    case DECODE_ND_A: TASK(qt, k_cache, v_cache, bt, pl, ps, row, ot, H, KVH, h0, h1, Gt, BS, \
                                           scale, q_stride, DECODE_ND_A, s, qf, acc, ktile, pr, L); break;    \
                    case DECODE_ND_B: TASK(qt, k_cache, v_cache, bt, pl, ps, row, ot, H, KVH, h0, h1, Gt, BS, \
                                           scale, q_stride, DECODE_ND_B, s, qf, acc, ktile, pr, L); break;    \
                    default: TASK(qt, k_cache, v_cache, bt, pl, ps, row, ot, H, KVH, h0, h1, Gt, BS, scale,   \
                                  q_stride, ND, s, qf, acc, ktile, pr, L);                                    \
                }                                                                                             \
            }                                                                                                 \
            if (per_req && P > 1)                                                                             \
                for (int h = 0; h < H; ++h) {                                                                 \
                    combine_parts(tpart + h * PS, P, H * PS, D, ob);                                          \
                    T* op = out + (row * H + h) * D;                                                          \
                    for (int d = 0; d < D; ++d) op[d] = STORE(ob[d]);                                         \
                }                                                                                             \
        }                                                                                                     \
        if (gpart) { /* the multi-partition requests' heads, from the records of every task above */         \
            _Pragma("omp for schedule(static)")                                                               \
            for (int64_t rh = 0; rh < (int64_t)n * H; ++rh) {                                                 \
                const int r = (int)(rh / H), h = (int)(rh % H);                                               \
                const int P = (int)(ustart[r + 1] - ustart[r]);                                               \
                if (P == 1) continue;                                                                         \
                combine_parts(gpart + (ustart[r] * H + h) * PS, P, H * PS, D, ob);                            \
                T* op = out + ((rows ? rows[r] : r) * H + h) * D;                                             \
                for (int d = 0; d < D; ++d) op[d] = STORE(ob[d]);                                             \
            }                                                                                                 \
        }                                                                                                     \
        free(s); free(tpart); free(qf); free(acc); free(ktile); free(ob); free(qbuf);                        \
        if (tiles) AMX_RELEASE();                                                                             \
    }                                                                                                         \
    free(ustart); free(ureq); free(gpart);                                                                    \
}

DEFINE_DECODE_SIMD(paged_decode_bf16, uint16_t, task_bf16, paged_decode_bf16_scalar, TRY_FAST_bf16, f32_to_bf16)
DEFINE_DECODE_SIMD(paged_decode_f32, float, task_f32, paged_decode_f32_scalar, TRY_FAST_f32, f32_id)
#else
DEFINE_DECODE_SCALAR(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE_SCALAR(paged_decode_f32, float, f32_id, f32_id)
#endif


#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
void paged_decode_use_amx(int on) { (void)on; } /* no AMX score pass in this build */
#endif
