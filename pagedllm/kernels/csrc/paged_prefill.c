/* Chunk-invariant prefill attention for CPUs without the AMX kernel (levels avx512_bf16 and avx2, and shapes the AMX
 * kernel doesn't take), straight from the paged KV cache.
 *
 * out[t, h, :] = softmax(scale * q[t, h] . K[kh]^T + mask) V[kh]   (kh = h / (H / KVH), GQA)
 * for every query row of every prefill slice (a request with q_len new tokens after cached = seq_len - q_len tokens
 * already in the cache): query i sits at position p = cached + i and sees keys j in [start, p], start = p + 1 - window
 * with a sliding window (HF Mistral/Gemma convention), else 0. This step's K/V must already be in the cache.
 *
 * Why not torch's SDPA: its per-row sums depend on the shape of the call (which rows share a query block, and its
 * GEMMs pick their blocking by size), and a prompt's chunk boundaries depend on the other requests of the step (the
 * token budget is shared) and on speculation (verify rows take budget). So with SDPA a request's greedy output
 * depends on its neighbours. Here every query row's arithmetic depends only on the row (its q, its position, the
 * K/V it sees): keys are visited in tiles at absolute positions (0, 16, 32, ...), each score is one fixed chain of
 * products over the head dimension, and rows sharing a task only share loads. Rows of a task that see fewer keys than
 * another get exact zeros (p = 0) from the keys they don't see, which change no sum. So a row's bits are the same
 * in any chunking and any batch (tests/test_paged_prefill.py checks this bit for bit).
 *
 * Per task (slice, KV head, block of up to ROWS query rows; all G query heads of the KV head), three passes, the whole
 * score rows kept in a per-thread scratch (as amx_attention.c does; no online rescaling):
 *   1. S = scale * Q K^T: K^T from a workspace built once per (slice, KV head) (keys along the vector lanes), one
 *      broadcast q element (pair) times one K^T vector per instruction, MB query vectors in registers;
 *   2. P = exp(S - max) (float32 sums, masked keys exactly 0), 1 / sum;
 *   3. O = P V, MB2 query vectors x the head dimension in registers; out = O / sum, rounded once.
 * bf16 with AVX512-BF16: products on VDPBF16PS (q . k pairs of dims; P rounded to bf16 and paired with V by keys, as
 * FlashAttention-2 rounds P before P.V, Dao 2023). Otherwise (float32, or bf16 on AVX2) float32 FMAs, bf16 widened
 * exactly into the workspace.
 *
 * Layout: q [T, H * D] (rows q_stride elements apart), out [T, H * D] contiguous, k_cache/v_cache [num_blocks, BS, KVH,
 * D], block_tables [n, max_blocks] int64, q_starts/q_lens/seq_lens [n] int64. ws: paged_prefill_ws_bytes(...) bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"
#include "pagedllm_kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>
#include "simd.h"

#define ROWS 8     /* query rows per task */
#define MAX_G 16   /* query heads per KV head */
#define MAX_D 256

static inline int64_t pad32(int64_t x) { return (x + 31) & ~(int64_t)31; }
static inline int64_t pad16(int64_t x) { return (x + 15) & ~(int64_t)15; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vexp(vf x) { return exp16(x); }
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
/* x where key t0 + l is in [lo, hi), else `fill` */
static inline vf vvalid(vf x, int64_t t0, int64_t lo, int64_t hi, float fill) {
    const int64_t a = lo > t0 ? lo - t0 : 0, b = hi - t0 < W ? hi - t0 : W;
    const __mmask16 m = b > a ? (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u)) : 0;
    return _mm512_mask_mov_ps(_mm512_set1_ps(fill), m, x);
}
/* W bf16 values widened to float32 (exactly) */
static inline vf vload_bf16(const uint16_t* p) { return load16_bf16(p); }
#else
#define W 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vexp(vf x) { return exp8(x); }
static inline float vhmax(vf x) {
    float l[8];
    _mm256_storeu_ps(l, x);
    float m = l[0];
    for (int i = 1; i < 8; i++) m = l[i] > m ? l[i] : m;
    return m;
}
static inline float vhsum(vf x) { /* a fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
static inline vf vvalid(vf x, int64_t t0, int64_t lo, int64_t hi, float fill) {
    const __m256 idx = _mm256_add_ps(_mm256_set1_ps((float)t0), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(idx, _mm256_set1_ps((float)lo), _CMP_GE_OQ),
                                    _mm256_cmp_ps(idx, _mm256_set1_ps((float)hi), _CMP_LT_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, ok);
}
static inline vf vload_bf16(const uint16_t* p) { return load8_bf16(p); }
#endif

/* The keys of token t of a slice: its row of one KV head in the cache (NULL past the context). */
static inline const void* kv_row(const void* cache, size_t esz, const int64_t* bt, int BS, int KVH, int D, int kh,
                                 int64_t t, int64_t L) {
    if (t >= L) return NULL;
    return (const char*)cache + (((bt[t / BS] * BS + t % BS) * KVH + kh) * (int64_t)D) * esz;
}

/* Per (slice, KV head) workspace, Lp = pad32(seq_len) keys, Dp = pad16(D):
 *   dpbf16 path: KT [D/2][Lp] uint32 (dims 2p, 2p+1 of key t as one pair), VP [Lp/2][Dp] uint32 (keys 2u, 2u+1 of
 *   dim d as one pair);  float32 path: KT [D][Lp] float, V [Lp][Dp] float. Keys past the context are zeros. */
static inline int64_t ws_elems(int64_t L, int D, int dp) {
    return dp ? (int64_t)(D / 2) * pad32(L) + pad32(L) / 2 * pad16(D) : (int64_t)D * pad32(L) + pad32(L) * pad16(D);
}

int64_t paged_prefill_ws_bytes(const int64_t* seq_lens, int n, int KVH, int D, int is_bf16) {
    const int dp = HAVE_DPBF16 && is_bf16;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (int64_t)KVH * ws_elems(seq_lens[i], D, dp);
    return total * 4 + 64;
}

/* ---- building the workspace: keys [t0, t0 + 32) of one (slice, KV head) ---- */
static void build_f32(const void* kc, const void* vc, int is_bf16, const int64_t* bt, int BS, int KVH, int D, int kh,
                      int64_t L, int64_t t0, float* KT, float* V) {
    const int64_t Lp = pad32(L), Dp = pad16(D);
    const size_t esz = is_bf16 ? 2 : 4;
    for (int64_t t = t0; t < t0 + 32; t++) {
        const void* k = kv_row(kc, esz, bt, BS, KVH, D, kh, t, L);
        const void* v = kv_row(vc, esz, bt, BS, KVH, D, kh, t, L);
        for (int d = 0; d < D; d++)
            KT[d * Lp + t] = !k ? 0.f : is_bf16 ? bf16_to_f32(((const uint16_t*)k)[d]) : ((const float*)k)[d];
        for (int d = 0; d < Dp; d++)
            V[t * Dp + d] = (!v || d >= D) ? 0.f : is_bf16 ? bf16_to_f32(((const uint16_t*)v)[d]) : ((const float*)v)[d];
    }
}

#if HAVE_DPBF16
#include "amx.h" /* transpose16x16_epi32 */
static void build_dp(const uint16_t* kc, const uint16_t* vc, const int64_t* bt, int BS, int KVH, int D, int kh,
                     int64_t L, int64_t t0, uint32_t* KT, uint32_t* VP) {
    const int64_t Lp = pad32(L), Dp = pad16(D);
    const int NP = D / 2;
    for (int64_t h = t0; h < t0 + 32; h += 16) { /* K^T: 16 keys x 16 pairs transposed at a time */
        const uint16_t* rows[16];
        for (int i = 0; i < 16; i++) rows[i] = kv_row(kc, 2, bt, BS, KVH, D, kh, h + i, L);
        for (int pg = 0; pg < NP; pg += 16) {
            const int np = NP - pg < 16 ? NP - pg : 16;
            const __mmask16 m = (__mmask16)((1u << np) - 1u);
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = rows[i] ? _mm512_maskz_loadu_epi32(m, rows[i] + 2 * pg) : _mm512_setzero_si512();
            transpose16x16_epi32(r);
            for (int j = 0; j < np; j++) _mm512_storeu_si512((void*)(KT + (int64_t)(pg + j) * Lp + h), r[j]);
        }
    }
    const __m512i ilv = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t t = t0; t < t0 + 32; t += 2) { /* VP: keys t, t + 1 interleaved, 16 dims at a time */
        const uint16_t* a = kv_row(vc, 2, bt, BS, KVH, D, kh, t, L);
        const uint16_t* b = kv_row(vc, 2, bt, BS, KVH, D, kh, t + 1, L);
        for (int d = 0; d < Dp; d += 16) {
            const __mmask16 m = (__mmask16)(D - d >= 16 ? 0xFFFFu : (1u << (D - d)) - 1u);
            const __m256i x = a ? _mm256_maskz_loadu_epi16(m, a + d) : _mm256_setzero_si256();
            const __m256i y = b ? _mm256_maskz_loadu_epi16(m, b + d) : _mm256_setzero_si256();
            _mm512_storeu_si512((void*)(VP + (t / 2) * Dp + d),
                                _mm512_permutex2var_epi16(_mm512_castsi256_si512(x), ilv, _mm512_castsi256_si512(y)));
        }
    }
}
#endif

/* One task's rows: m = row * G + g, row r of the task is query row r0 + r of the slice (position pos0 + r). */
typedef struct {
    int M;                 /* query vectors (rows x G) */
    int64_t lo[ROWS * MAX_G], hi[ROWS * MAX_G]; /* keys [lo, hi) each one sees */
    int64_t klo, khi;      /* the union, klo a multiple of 32, khi = max hi */
} task_rows;

/* Whether keys [t0, t0 + n) all lie in [lo, hi): such tiles need no mask. */
static inline int inside(int64_t t0, int n, int64_t lo, int64_t hi) { return t0 >= lo && t0 + n <= hi; }

/* ---- pass 2, shared: e = exp(S - max) over each vector's own keys (tiles at multiples of W; those past its keys
 * are never visited, which adds nothing to a sum), 1 / sum. S rows are floats from key klo. e goes to `P16` as bf16
 * (bf16 path), else replaces S in place; either way zeros around the vector's keys over [klo, pad32(khi)), since
 * pass 3 runs a block of vectors over the union of their keys (a zero p adds nothing). ---- */
static inline void softmax_rows(const task_rows* tr, float* S, int64_t sstride, const float* mx, float* inv,
                                uint16_t* P16) {
    for (int m = 0; m < tr->M; m++) {
        float* s = S + m * sstride - tr->klo; /* s[t]: key t */
        const int64_t lo = tr->lo[m], hi = tr->hi[m], t_first = lo & ~(int64_t)(W - 1);
        const vf vm = vset1(mx[m]);
        vf sum = vzero();
        uint16_t* pm = P16 ? P16 + m * sstride - tr->klo : NULL;
        for (int64_t t = tr->klo; t < t_first; t++) pm ? (void)(pm[t] = 0) : (void)(s[t] = 0.f);
        for (int64_t t = (hi + W - 1) & ~(int64_t)(W - 1); t < pad32(tr->khi); t++)
            pm ? (void)(pm[t] = 0) : (void)(s[t] = 0.f);
        for (int64_t t0 = t_first; t0 < hi; t0 += W) {
            vf e = vexp(vsub(vload(s + t0), vm));
            if (!inside(t0, W, lo, hi)) e = vvalid(e, t0, lo, hi, 0.f);
            sum = vadd(sum, e);
#if HAVE_DPBF16
            if (pm) {
                _mm256_storeu_si256((__m256i*)(pm + t0), store16_bf16_bits(e));
                continue;
            }
#endif
            vstore(s + t0, e);
        }
        inv[m] = 1.0f / vhsum(sum);
    }
}

/* ---- float32 path ---- */
#if W == 16
#define MBF 12  /* query vectors per register block, pass 1 (2 tiles of keys: 24 accumulators) */
#define MB2F 4  /* pass 3: MB2F vectors x NCF dim vectors of accumulators */
#else
#define MBF 6   /* AVX2: 16 registers (12 accumulators, 2 key vectors, a broadcast) */
#define MB2F 2
#endif
#define NCF 4

/* pass 3 of one block: out[m][c0 .. c0 + nc) for vectors m0 .. m0 + nb, over the keys [t_lo, t_hi) any of them sees
 * (p = 0 outside a vector's own keys). NB_, NC_: the counts, constants in the full-block call. */
static inline __attribute__((always_inline)) void pv_f32(const float* S, int64_t sstride, int64_t klo, int m0,
                                                         const float* V, int Dp, int c0, int64_t t_lo, int64_t t_hi,
                                                         vf* acc, const int NB_, const int NC_) {
    for (int i = 0; i < NB_ * NC_; i++) acc[i] = vzero();
    const float* p = S + m0 * sstride - klo;
    for (int64_t t = t_lo; t < t_hi; t++) {
        vf v[NCF];
        for (int c = 0; c < NC_; c++) v[c] = vload(V + t * Dp + (c0 + c) * W);
        for (int b = 0; b < NB_; b++) {
            const vf pv = vset1(p[b * sstride + t]);
            for (int c = 0; c < NC_; c++) acc[b * NC_ + c] = vfma(pv, v[c], acc[b * NC_ + c]);
        }
    }
}

static void task_f32(const task_rows* tr, const float* qf /* [M][D], scaled later */, const float* KT, const float* V,
                     int64_t Lp, int D, float scale, float* S, int64_t sstride, float* outf /* [M][Dp] */) {
    const int Dp = (int)pad16(D);
    float mx[ROWS * MAX_G], inv[ROWS * MAX_G];
    const vf vs = vset1(scale);
    for (int m0 = 0; m0 < tr->M; m0 += MBF) {
        const int nb = tr->M - m0 < MBF ? tr->M - m0 : MBF;
        vf vmx[MBF];
        for (int b = 0; b < MBF; b++) vmx[b] = vset1(-INFINITY);
        const float* qb = qf + m0 * D;
        for (int64_t t0 = tr->klo; t0 < tr->khi; t0 += 2 * W) { /* two tiles of W keys */
            vf acc[2 * MBF];
            for (int b = 0; b < 2 * MBF; b++) acc[b] = vzero();
            if (nb == MBF) /* a full block: no count test in the loop */
                for (int d = 0; d < D; d++) {
                    const vf k0 = vload(KT + (int64_t)d * Lp + t0), k1 = vload(KT + (int64_t)d * Lp + t0 + W);
                    for (int b = 0; b < MBF; b++) {
                        const vf qv = vset1(qb[b * D + d]);
                        acc[2 * b] = vfma(qv, k0, acc[2 * b]);
                        acc[2 * b + 1] = vfma(qv, k1, acc[2 * b + 1]);
                    }
                }
            else
                for (int d = 0; d < D; d++) {
                    const vf k0 = vload(KT + (int64_t)d * Lp + t0), k1 = vload(KT + (int64_t)d * Lp + t0 + W);
                    for (int b = 0; b < nb; b++) {
                        const vf qv = vset1(qb[b * D + d]);
                        acc[2 * b] = vfma(qv, k0, acc[2 * b]);
                        acc[2 * b + 1] = vfma(qv, k1, acc[2 * b + 1]);
                    }
                }
            for (int b = 0; b < nb; b++) {
                const int m = m0 + b;
                for (int h = 0; h < 2; h++) {
                    const int64_t t = t0 + h * W;
                    const vf sc = vmul(acc[2 * b + h], vs);
                    vstore(S + m * sstride + (t - tr->klo), sc);
                    vmx[b] = vmax(vmx[b], inside(t, W, tr->lo[m], tr->hi[m]) ? sc
                                                                           : vvalid(sc, t, tr->lo[m], tr->hi[m], -INFINITY));
                }
            }
        }
        for (int b = 0; b < nb; b++) mx[m0 + b] = vhmax(vmx[b]);
    }
    softmax_rows(tr, S, sstride, mx, inv, NULL);
    const int ND = Dp / W;
    for (int m0 = 0; m0 < tr->M; m0 += MB2F) {
        const int nb = tr->M - m0 < MB2F ? tr->M - m0 : MB2F;
        int64_t t_lo = tr->khi, t_hi = 0;
        for (int b = 0; b < nb; b++) {
            t_lo = tr->lo[m0 + b] < t_lo ? tr->lo[m0 + b] : t_lo;
            t_hi = tr->hi[m0 + b] > t_hi ? tr->hi[m0 + b] : t_hi;
        }
        for (int c0 = 0; c0 < ND; c0 += NCF) {
            const int nc = ND - c0 < NCF ? ND - c0 : NCF;
            vf acc[MB2F * NCF];
            if (nb == MB2F && nc == NCF)
                pv_f32(S, sstride, tr->klo, m0, V, Dp, c0, t_lo, t_hi, acc, MB2F, NCF);
            else
                pv_f32(S, sstride, tr->klo, m0, V, Dp, c0, t_lo, t_hi, acc, nb, nc);
            for (int b = 0; b < nb; b++) {
                const vf vi = vset1(inv[m0 + b]);
                for (int c = 0; c < nc; c++)
                    vstore(outf + (int64_t)(m0 + b) * Dp + (c0 + c) * W, vmul(acc[b * nc + c], vi));
            }
        }
    }
}

#if HAVE_DPBF16
/* ---- bf16 path on VDPBF16PS ---- */
#define MBD 12 /* query vectors per register block, pass 1 (2 tiles of keys: 24 accumulators) */
static inline __m512bh bcast_pair(const uint32_t* p) { return (__m512bh)_mm512_set1_epi32((int)*p); }

/* pass 3 for MB2 query vectors x ND accumulators of 16 dims (compile-time constants via dp_pv's switch) */
static inline __attribute__((always_inline)) void pv_block(const task_rows* tr, int m0, int nb, const uint32_t* P,
                                                           int64_t pstride, const uint32_t* VP, int Dp, const float* inv,
                                                           float* outf, const int MB2, const int ND) {
    __m512 acc[24];
    for (int i = 0; i < MB2 * ND; i++) acc[i] = _mm512_setzero_ps();
    int64_t ulo = tr->khi, uhi = 0; /* pairs of keys any of the block's vectors sees */
    for (int b = 0; b < nb; b++) {
        const int64_t l = (tr->lo[m0 + b] > tr->klo ? tr->lo[m0 + b] : tr->klo) / 2, h = (tr->hi[m0 + b] + 1) / 2;
        ulo = l < ulo ? l : ulo;
        uhi = h > uhi ? h : uhi;
    }
    const uint32_t* pu = P + m0 * pstride - tr->klo / 2;
    if (nb == MB2) /* a full block: no count test in the loop */
        for (int64_t u = ulo; u < uhi; u++) {
            __m512bh v[16];
            for (int c = 0; c < ND; c++) v[c] = (__m512bh)_mm512_loadu_si512((const void*)(VP + u * Dp + 16 * c));
            for (int b = 0; b < MB2; b++) {
                const __m512bh pb = bcast_pair(pu + b * pstride + u);
                for (int c = 0; c < ND; c++) acc[b * ND + c] = _mm512_dpbf16_ps(acc[b * ND + c], pb, v[c]);
            }
        }
    else
        for (int64_t u = ulo; u < uhi; u++) {
            __m512bh v[16];
            for (int c = 0; c < ND; c++) v[c] = (__m512bh)_mm512_loadu_si512((const void*)(VP + u * Dp + 16 * c));
            for (int b = 0; b < nb; b++) {
                const __m512bh pb = bcast_pair(pu + b * pstride + u);
                for (int c = 0; c < ND; c++) acc[b * ND + c] = _mm512_dpbf16_ps(acc[b * ND + c], pb, v[c]);
            }
        }
    for (int b = 0; b < nb; b++) {
        const __m512 vi = _mm512_set1_ps(inv[m0 + b]);
        for (int c = 0; c < ND; c++) _mm512_storeu_ps(outf + (int64_t)(m0 + b) * Dp + 16 * c,
                                                      _mm512_mul_ps(acc[b * ND + c], vi));
    }
}

static void task_dp(const task_rows* tr, const uint32_t* qp /* [M][D/2] pairs */, const uint32_t* KT,
                    const uint32_t* VP, int64_t Lp, int D, float scale, float* S, int64_t sstride, uint32_t* P,
                    float* outf) {
    const int NP = D / 2, Dp = (int)pad16(D);
    float mx[ROWS * MAX_G], inv[ROWS * MAX_G];
    const __m512 vs = _mm512_set1_ps(scale);
    for (int m0 = 0; m0 < tr->M; m0 += MBD) {
        const int nb = tr->M - m0 < MBD ? tr->M - m0 : MBD;
        __m512 vmx[MBD];
        for (int b = 0; b < MBD; b++) vmx[b] = _mm512_set1_ps(-INFINITY);
        const uint32_t* qb = qp + m0 * NP;
        for (int64_t t0 = tr->klo; t0 < tr->khi; t0 += 32) { /* two tiles of 16 keys */
            __m512 acc[2 * MBD];
            for (int b = 0; b < 2 * MBD; b++) acc[b] = _mm512_setzero_ps();
            if (nb == MBD) /* a full block: no count test in the loop */
                for (int p = 0; p < NP; p++) {
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void*)(KT + (int64_t)p * Lp + t0));
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void*)(KT + (int64_t)p * Lp + t0 + 16));
                    for (int b = 0; b < MBD; b++) {
                        const __m512bh qv = bcast_pair(qb + b * NP + p);
                        acc[2 * b] = _mm512_dpbf16_ps(acc[2 * b], qv, k0);
                        acc[2 * b + 1] = _mm512_dpbf16_ps(acc[2 * b + 1], qv, k1);
                    }
                }
            else
                for (int p = 0; p < NP; p++) {
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void*)(KT + (int64_t)p * Lp + t0));
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void*)(KT + (int64_t)p * Lp + t0 + 16));
                    for (int b = 0; b < nb; b++) {
                        const __m512bh qv = bcast_pair(qb + b * NP + p);
                        acc[2 * b] = _mm512_dpbf16_ps(acc[2 * b], qv, k0);
                        acc[2 * b + 1] = _mm512_dpbf16_ps(acc[2 * b + 1], qv, k1);
                    }
                }
            for (int b = 0; b < nb; b++) {
                const int m = m0 + b;
                for (int h = 0; h < 2; h++) {
                    const int64_t t = t0 + 16 * h;
                    const __m512 sc = _mm512_mul_ps(acc[2 * b + h], vs);
                    _mm512_storeu_ps(S + m * sstride + (t - tr->klo), sc);
                    vmx[b] = _mm512_max_ps(vmx[b], inside(t, 16, tr->lo[m], tr->hi[m]) ? sc
                                                          : vvalid(sc, t, tr->lo[m], tr->hi[m], -INFINITY));
                }
            }
        }
        for (int b = 0; b < nb; b++) mx[m0 + b] = _mm512_reduce_max_ps(vmx[b]);
    }
    /* P as bf16 pairs of keys (klo is even: key 2u is the low half of pair u - klo / 2) */
    const int64_t pstride = sstride / 2;
    softmax_rows(tr, S, sstride, mx, inv, (uint16_t*)P);
    const int ND = Dp / 16;
    switch (ND) {
#define PV_CASE(ND_, MB2_) \
        case ND_: for (int m0 = 0; m0 < tr->M; m0 += MB2_) \
            pv_block(tr, m0, tr->M - m0 < MB2_ ? tr->M - m0 : MB2_, P, pstride, VP, Dp, inv, outf, MB2_, ND_); break;
        PV_CASE(1, 16) PV_CASE(2, 12) PV_CASE(4, 6) PV_CASE(8, 3)
        default: { /* other head sizes: the same arithmetic, counts not known at compile time */
            const int mb2 = 24 / ND;
            for (int m0 = 0; m0 < tr->M; m0 += mb2)
                pv_block(tr, m0, tr->M - m0 < mb2 ? tr->M - m0 : mb2, P, pstride, VP, Dp, inv, outf, mb2, ND);
        }
#undef PV_CASE
    }
}
#endif

static int prefill(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                   int64_t max_blocks, const int64_t* q_starts, const int64_t* q_lens, const int64_t* seq_lens, int n,
                   void* out, int H, int KVH, int D, int BS, float scale, int window, void* ws, int is_bf16) {
    if (KVH <= 0 || H % KVH || H / KVH > MAX_G || D % 2 || D > MAX_D || D <= 0 || BS <= 0) return -1;
    const int G = H / KVH, dp = HAVE_DPBF16 && is_bf16;
    const int64_t Dp = pad16(D);
    /* workspace offsets and task counts per slice */
    int64_t* off = (int64_t*)malloc(sizeof(int64_t) * (size_t)(3 * n + 3));
    int64_t *chunks = off + n + 1, *tasks = chunks + n + 1;
    off[0] = 0, chunks[0] = 0, tasks[0] = 0;
    for (int i = 0; i < n; i++) {
        off[i + 1] = off[i] + (int64_t)KVH * ws_elems(seq_lens[i], D, dp);
        chunks[i + 1] = chunks[i] + KVH * (pad32(seq_lens[i]) / 32);
        tasks[i + 1] = tasks[i] + KVH * ((q_lens[i] + ROWS - 1) / ROWS);
    }
    uint32_t* wsu = (uint32_t*)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    int64_t max_l = 0;
    for (int i = 0; i < n; i++) max_l = seq_lens[i] > max_l ? seq_lens[i] : max_l;
    const size_t esz = is_bf16 ? 2 : 4;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks[n]; c++) { /* the workspace: 32 keys of one (slice, KV head) at a time */
            int i = 0;
            while (chunks[i + 1] <= c) i++;
            const int64_t per = pad32(seq_lens[i]) / 32, kh = (c - chunks[i]) / per, t0 = 32 * ((c - chunks[i]) % per);
            uint32_t* base = wsu + off[i] + kh * ws_elems(seq_lens[i], D, dp);
            const int64_t* bt = block_tables + (int64_t)i * max_blocks;
#if HAVE_DPBF16
            if (dp) {
                build_dp((const uint16_t*)k_cache, (const uint16_t*)v_cache, bt, BS, KVH, D, (int)kh, seq_lens[i], t0,
                         base, base + (int64_t)(D / 2) * pad32(seq_lens[i]));
                continue;
            }
#endif
            build_f32(k_cache, v_cache, is_bf16, bt, BS, KVH, D, (int)kh, seq_lens[i], t0, (float*)base,
                      (float*)base + (int64_t)D * pad32(seq_lens[i]));
        }
        const int64_t sstride = pad32(max_l) + 32;
        const int Mmax = ROWS * G;
        float* S = (float*)aligned_alloc(64, sizeof(float) * (size_t)(Mmax * sstride));
        uint32_t* P = (uint32_t*)aligned_alloc(64, sizeof(uint32_t) * (size_t)(Mmax * sstride / 2));
        float* qf = (float*)aligned_alloc(64, sizeof(float) * (size_t)(Mmax * D + 16));
        float* outf = (float*)aligned_alloc(64, sizeof(float) * (size_t)(Mmax * Dp));
        task_rows tr;
#pragma omp for schedule(dynamic, 1)
        for (int64_t tk = tasks[n] - 1; tk >= 0; tk--) { /* last rows (most keys) first */
            int i = 0;
            while (tasks[i + 1] <= tk) i++;
            const int64_t nblk = (q_lens[i] + ROWS - 1) / ROWS, kh = (tk - tasks[i]) / nblk;
            const int64_t r0 = ROWS * ((tk - tasks[i]) % nblk), nr = q_lens[i] - r0 < ROWS ? q_lens[i] - r0 : ROWS;
            const int64_t L = seq_lens[i], pos0 = L - q_lens[i] + r0;
            tr.M = (int)nr * G;
            tr.khi = 0;
            int64_t lo_min = L;
            for (int r = 0; r < nr; r++) {
                const int64_t hi = pos0 + r + 1, lo = (window > 0 && hi > window) ? hi - window : 0;
                for (int g = 0; g < G; g++) tr.lo[r * G + g] = lo, tr.hi[r * G + g] = hi;
                tr.khi = hi > tr.khi ? hi : tr.khi;
                lo_min = lo < lo_min ? lo : lo_min;
            }
            tr.klo = lo_min & ~(int64_t)31;
            const uint32_t* base = wsu + off[i] + kh * ws_elems(L, D, dp);
            const int64_t Lp = pad32(L);
            for (int r = 0; r < nr; r++)
                for (int g = 0; g < G; g++) {
                    const char* src = (const char*)q + ((q_starts[i] + r0 + r) * q_stride + (kh * G + g) * (int64_t)D) * esz;
                    if (dp) memcpy((uint32_t*)qf + (r * G + g) * (D / 2), src, (size_t)D * 2);
                    else
                        for (int d = 0; d < D; d++)
                            qf[(r * G + g) * D + d] = is_bf16 ? bf16_to_f32(((const uint16_t*)src)[d])
                                                              : ((const float*)src)[d];
                }
#if HAVE_DPBF16
            if (dp)
                task_dp(&tr, (const uint32_t*)qf, base, base + (int64_t)(D / 2) * Lp, Lp, D, scale, S, sstride, P,
                        outf);
            else
#endif
                task_f32(&tr, qf, (const float*)base, (const float*)base + (int64_t)D * Lp, Lp, D, scale, S, sstride,
                         outf);
            for (int r = 0; r < nr; r++)
                for (int g = 0; g < G; g++) {
                    const float* o = outf + (int64_t)(r * G + g) * Dp;
                    const int64_t at = ((q_starts[i] + r0 + r) * (int64_t)H + kh * G + g) * D;
                    if (is_bf16)
                        for (int d = 0; d < D; d++) ((uint16_t*)out)[at + d] = f32_to_bf16(o[d]);
                    else
                        memcpy((float*)out + at, o, sizeof(float) * (size_t)D);
                }
        }
        free(S); free(P); free(qf); free(outf);
    }
    free(off);
    return 0;
}

int paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* q_starts, const int64_t* q_lens,
                       const int64_t* seq_lens, int n, uint16_t* out, int H, int KVH, int D, int BS, float scale,
                       int window, void* ws) {
    return prefill(q, q_stride, k_cache, v_cache, block_tables, max_blocks, q_starts, q_lens, seq_lens, n, out, H, KVH,
                   D, BS, scale, window, ws, 1);
}

int paged_prefill_f32(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* q_starts, const int64_t* q_lens,
                      const int64_t* seq_lens, int n, float* out, int H, int KVH, int D, int BS, float scale,
                      int window, void* ws) {
    return prefill(q, q_stride, k_cache, v_cache, block_tables, max_blocks, q_starts, q_lens, seq_lens, n, out, H, KVH,
                   D, BS, scale, window, ws, 0);
}
#else /* no SIMD build: the caller takes torch's path */
int64_t paged_prefill_ws_bytes(const int64_t* seq_lens, int n, int KVH, int D, int is_bf16) {
    (void)seq_lens, (void)n, (void)KVH, (void)D, (void)is_bf16;
    return 0;
}
int paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* q_starts, const int64_t* q_lens,
                       const int64_t* seq_lens, int n, uint16_t* out, int H, int KVH, int D, int BS, float scale,
                       int window, void* ws) {
    return -1;
}
int paged_prefill_f32(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* q_starts, const int64_t* q_lens,
                      const int64_t* seq_lens, int n, float* out, int H, int KVH, int D, int BS, float scale,
                      int window, void* ws) {
    return -1;
}
#endif
