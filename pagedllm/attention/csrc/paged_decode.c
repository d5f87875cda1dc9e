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

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)b) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    uint32_t u = x.u;
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float f) { return f; }

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                                  \
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

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(paged_decode_f32, float, f32_id, f32_id)

int paged_decode_max_group(void) { return 64; }
