/* Prefill attention on Intel AMX tiles (AMX-TILE + AMX-BF16), straight from the paged KV cache.
 *
 * out[t, h, :] = softmax(scale * q[t, h] . K[kh]^T + mask) V[kh]   (kh = h / (H / KVH), GQA)
 * for every query row t of every prefill slice: a request with q_len new tokens after `cached = seq_len - q_len`
 * tokens already in the cache. Query i (position cached + i) sees keys j <= cached + i, and with a sliding window
 * only keys with cached + i - j < window (HF Mistral/Gemma convention). This step's K/V must already be in the cache.
 *
 * Layout: q [T, H * D] bf16 (rows q_stride elements apart), out [T, H * D] bf16 contiguous, k_cache/v_cache
 * [num_blocks, BS, KVH, D] bf16, block_tables [n, max_blocks] int64, q_starts/q_lens/seq_lens [n] int64 (first row
 * in q/out, new tokens, context after this step). vt: workspace of sum_i KVH * D * pad32(seq_len_i) bf16.
 * Requires D % 32 == 0, D <= 128, BS % 16 == 0 (the caller checks).
 *
 * Why: torch's CPU flash-attention (SDPA) reaches ~150-200 GFLOP/s here, and prefill attention was ~30% of a chat
 * wave's prefill step (session-5 profile). One task = (slice, query head, 16 queries); per task, three passes over
 * the keys, with the whole score row set kept in L1/L2 (no online rescaling of the output tiles):
 *   1. S^T [keys x 16 queries] = K Q^T on tiles: K rows are the "A" tile, loaded straight from a cache block (16
 *      keys at a row stride of KVH * D), Q^T is held in up to 4 "B" tiles (VNNI pairs of dims); scaled, masked with
 *      -inf, column (query) maxima in fp32 (AVX-512).
 *   2. P = exp(S - max) in fp32 (sums in fp32), paired rows of P^T rounded to bf16 into VNNI "B" tiles, as
 *      FlashAttention-2 rounds P before the P.V product (Dao, 2023).
 *   3. O^T [D x 16 queries] = V^T P^T on tiles: V^T (dims x keys) is the "A" tile, from the workspace `vt`, which
 *      holds each (slice, KV head)'s V transposed, keys zero-padded to a multiple of 32 (built first, in parallel,
 *      32 keys at a time with an in-register transpose).
 * Then out = O / sum, rounded once to bf16. Masked keys get p = 0 exactly. Cache rows past seq_len in the last block
 * are read by the tile loads but always masked.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"                      /* exp16, store16_bf16_bits */
#include "amx.h"   /* config_tiles_16x64 */
#include "pagedllm_kernels.h"

static inline int64_t pad32(int64_t x) { return (x + 31) & ~(int64_t)31; }

/* Tile use: pass 1 (amx.h's score tiles): 0 = S^T of 16 keys, 4 = K rows, 2/3/5/6 = Q^T for dims 0-31/.../96-127.
 *           pass 3: 0-3 = O^T accumulators (16 dims each), 4 = V^T, 5 = P^T. (Tile numbers must be constants.) */
static inline void store_acc(int t, float* p) {
    switch (t) {
        case 0: _tile_stored(0, p, 64); break;
        case 1: _tile_stored(1, p, 64); break;
        case 2: _tile_stored(2, p, 64); break;
        default: _tile_stored(3, p, 64); break;
    }
}

/* 32 keys of V (rows[j]: key j's D values of one head, NULL = past the context: zeros) -> dst[d * cp + j], the
 * transposed layout pass 3 loads as "A" tiles. Keys 2p and 2p+1 are interleaved into 16 (V[2p][d], V[2p+1][d])
 * pairs per 16 dims, and the 16 x 16 matrix of pairs is transposed: row d then holds the 32 keys in order. */
static inline void vt_chunk(const uint16_t* const rows[32], int D, uint16_t* dst, int64_t cp) {
    const __m512i ilv = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int dg = 0; dg < D / 16; dg++) {
        __m512i m[16];
        for (int p = 0; p < 16; p++) {
            const __m256i a = rows[2 * p] ? _mm256_loadu_si256((const __m256i*)(rows[2 * p] + 16 * dg))
                                          : _mm256_setzero_si256();
            const __m256i b = rows[2 * p + 1] ? _mm256_loadu_si256((const __m256i*)(rows[2 * p + 1] + 16 * dg))
                                              : _mm256_setzero_si256();
            m[p] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), ilv, _mm512_castsi256_si512(b));
        }
        transpose16x16_epi32(m);
        for (int d = 0; d < 16; d++) _mm512_storeu_si512((void*)(dst + (int64_t)(16 * dg + d) * cp), m[d]);
    }
}

/* Slice of a flat index, given the prefix sums off[0..n] (n is small: the prefills of one step). */
static inline int slice_of(const int64_t* off, int64_t x) {
    int i = 0;
    while (off[i + 1] <= x) i++;
    return i;
}

void amx_prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                                const uint16_t* v_cache, const int64_t* block_tables, int64_t max_blocks,
                                const int64_t* q_starts, const int64_t* q_lens, const int64_t* seq_lens, int n,
                                uint16_t* out, int H, int KVH, int D, int BS, float scale, int window,
                                uint16_t* vt) {
    const int G = H / KVH, NH = D / 32, NDT = D / 16;
    const int64_t row_elems = (int64_t)KVH * D, k_stride = row_elems * 2;
    int64_t* offs = (int64_t*)malloc(sizeof(int64_t) * 3 * (size_t)(n + 1));
    int64_t *vt_off = offs, *task_off = offs + n + 1, *chunk_off = offs + 2 * (n + 1);
    vt_off[0] = task_off[0] = chunk_off[0] = 0;
    int64_t max_ctx = 32;
    for (int i = 0; i < n; i++) {
        const int64_t cp = pad32(seq_lens[i]);
        vt_off[i + 1] = vt_off[i] + row_elems * cp;
        task_off[i + 1] = task_off[i] + (int64_t)H * ((q_lens[i] + 15) / 16);
        chunk_off[i + 1] = chunk_off[i] + (int64_t)KVH * (cp / 32);
        if (cp > max_ctx) max_ctx = cp;
    }
#pragma omp parallel
    {
        /* V^T per (slice, KV head), 32 keys per work item: vt[d][key], zeros past seq_len. */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunk_off[n]; c++) {
            const int i = slice_of(chunk_off, c);
            const int64_t cp = pad32(seq_lens[i]), nchunk = cp / 32, local = c - chunk_off[i], L = seq_lens[i];
            const int kh = (int)(local / nchunk);
            const int64_t k0 = (local % nchunk) * 32;
            const int64_t* bt = block_tables + (int64_t)i * max_blocks;
            const uint16_t* rows[32];
            for (int j = 0; j < 32; j++) {
                const int64_t k = k0 + j;
                rows[j] = k < L ? v_cache + (bt[k / BS] * BS + k % BS) * row_elems + (int64_t)kh * D : NULL;
            }
            vt_chunk(rows, D, vt + vt_off[i] + (int64_t)kh * D * cp + k0, cp);
        }
        config_tiles_16x64();
        float* S = (float*)aligned_alloc(64, sizeof(float) * 16 * (size_t)max_ctx);       /* S^T, fp32 */
        uint16_t* PT = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)max_ctx); /* P^T, VNNI */
        uint32_t qt_buf[16 * 16] __attribute__((aligned(64)));
        float ot[16 * 16] __attribute__((aligned(64)));
        float osum[16] __attribute__((aligned(64)));
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        /* permutation that interleaves [a0..a15 | b0..b15] (16-bit) into a0 b0 a1 b1 ... (VNNI pairs) */
        const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < task_off[n]; task++) {
            const int i = slice_of(task_off, task);
            const int64_t local = task - task_off[i];
            const int h = (int)(local % H), kh = h / G;
            const int64_t qt = local / H, L = seq_lens[i], qpos0 = L - q_lens[i] + 16 * qt;
            const int nq = (int)(q_lens[i] - 16 * qt < 16 ? q_lens[i] - 16 * qt : 16);
            const int64_t kend = qpos0 + nq; /* keys [kbeg, kend) can be visible to these queries */
            const int64_t kbeg = (window > 0 && qpos0 - window + 1 > 0) ? (qpos0 - window + 1) & ~(int64_t)31 : 0;
            const int64_t* bt = block_tables + (int64_t)i * max_blocks;
            const int64_t row0 = q_starts[i] + 16 * qt;
            const uint16_t* qcols[16]; /* column c of the Q^T tiles: query row0 + c of head h */
            for (int c = 0; c < nq; c++) qcols[c] = q + (row0 + c) * q_stride + (int64_t)h * D;
            for (int hh = 0; hh < NH; hh++) amx_build_qt(hh, qcols, nq, qt_buf);
            /* Pass 1: scaled, masked scores S^T[key - kbeg][query], and each query's maximum. */
            const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32((int)qpos0), lane);
            const __mmask16 valid = (__mmask16)((1u << nq) - 1u);
            __m512 mx = ninf;
            for (int64_t k0 = kbeg; k0 < kend; k0 += 16) {
                float* srow = S + (k0 - kbeg) * 16;
                const uint16_t* kp = k_cache + (bt[k0 / BS] * BS + k0 % BS) * row_elems + (int64_t)kh * D;
                _tile_zero(0);
                for (int hh = 0; hh < NH; hh++) amx_qk_half(hh, kp, k_stride);
                _tile_stored(0, srow, 64);
                /* every key of this tile visible to every query (no causal edge, no window edge): no mask */
                const int full = k0 + 15 <= qpos0 && (window <= 0 || qpos0 + nq - 1 - k0 < window);
                for (int r = 0; r < 16; r++) {
                    __m512 s = _mm512_mul_ps(_mm512_load_ps(srow + 16 * r), vscale);
                    if (!full) { /* query columns >= nq need no mask: only their own outputs, unused */
                        const __m512i kv = _mm512_set1_epi32((int)(k0 + r));
                        __mmask16 vis = valid & _mm512_cmp_epi32_mask(kv, qpos, _MM_CMPINT_LE);
                        if (window > 0)
                            vis &= _mm512_cmp_epi32_mask(_mm512_sub_epi32(qpos, kv), _mm512_set1_epi32(window),
                                                         _MM_CMPINT_LT);
                        s = _mm512_mask_mov_ps(ninf, vis, s);
                    }
                    _mm512_store_ps(srow + 16 * r, s);
                    mx = _mm512_max_ps(mx, s);
                }
            }
            const int64_t nk = kend - kbeg, nk32 = pad32(nk);
            for (int64_t r = ((nk + 15) & ~(int64_t)15); r < nk32; r++) _mm512_store_ps(S + r * 16, ninf);
            mx = _mm512_mask_mov_ps(_mm512_setzero_ps(), valid, mx); /* unused query columns: any finite value */
            /* Pass 2: P = exp(S - max) (0 where masked), fp32 sums; P^T rows (2r, 2r+1) -> one VNNI row. */
            __m512 sum = _mm512_setzero_ps();
            for (int64_t r = 0; r < nk32; r += 2) {
                const __m512 s0 = _mm512_load_ps(S + r * 16), s1 = _mm512_load_ps(S + (r + 1) * 16);
                const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_OQ),
                                                      exp16(_mm512_sub_ps(s0, mx)));
                const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_OQ),
                                                      exp16(_mm512_sub_ps(s1, mx)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* [p0 as bf16 | p1 as bf16] */
                _mm512_store_si512((__m512i*)(PT + r * 16), _mm512_permutexvar_epi16(ilv, pair));
            }
            _mm512_store_ps(osum, sum);
            amx_fence(); /* P^T is loaded as tiles next */
            /* Pass 3: O^T = V^T P^T, up to 4 tiles of 16 dims per sweep over the keys. */
            const int64_t cp = pad32(L);
            const uint16_t* vtk = vt + vt_off[i] + (int64_t)kh * D * cp + kbeg;
            for (int dt0 = 0; dt0 < NDT; dt0 += 4) {
                const int nd = NDT - dt0 < 4 ? NDT - dt0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t r = 0; r < nk32; r += 32) {
                    const uint16_t* a = vtk + (int64_t)(16 * dt0) * cp + r;
                    _tile_loadd(5, PT + r * 16, 64);
                    _tile_loadd(4, a, cp * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nd > 1) {
                        _tile_loadd(4, a + 16 * cp, cp * 2);
                        _tile_dpbf16ps(1, 4, 5);
                    }
                    if (nd > 2) {
                        _tile_loadd(4, a + 32 * cp, cp * 2);
                        _tile_dpbf16ps(2, 4, 5);
                    }
                    if (nd > 3) {
                        _tile_loadd(4, a + 48 * cp, cp * 2);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                for (int t = 0; t < nd; t++) { /* ot[d][c] -> out[row0 + c][h][16 (dt0 + t) + d] / sum[c] */
                    store_acc(t, ot);
                    __m512i col[16]; /* col[c] = column c of ot (in-register transpose) */
                    for (int d = 0; d < 16; d++) col[d] = _mm512_load_si512((const void*)(ot + 16 * d));
                    transpose16x16_epi32(col);
                    for (int c = 0; c < nq; c++) {
                        const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(col[c]), _mm512_set1_ps(1.0f / osum[c]));
                        _mm256_storeu_si256((__m256i*)(out + (row0 + c) * (int64_t)H * D + (int64_t)h * D
                                                       + 16 * (dt0 + t)),
                                            store16_bf16_bits(o));
                    }
                }
            }
        }
        free(S);
        free(PT);
        _tile_release();
    }
    free(offs);
}
