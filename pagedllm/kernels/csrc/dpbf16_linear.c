/* bf16 linear layers without AMX: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), the ABI and output modes of
 * amx_linear.c (so PackedLinear and the fused layer loop take either), for CPUs with AVX512-BF16 (AMD Zen 4/5,
 * Intel Cooper Lake and later), with AVX2 + FMA, or neither (scalar C). The level is chosen when the file is compiled
 * (__AVX512BF16__, then __AVX2__ && __FMA__, else scalar); dpbf16_supported() says which one was built.
 *
 * Why: at decode sizes a linear layer is a stream of its weights; oneDNN's packed bf16 matmul reads them at well
 * under the memory bandwidth there (issue 17: ~1.7x slower than a sequential stream), and its results depend on the
 * number of rows (its blocking, hence its reduction order, changes with M).
 *
 * Packed layout (dpbf16_pack): N is cut into blocks of 64 output columns (the last one 32 when N % 64 == 32),
 * each block's weights stored contiguously, K pair by K pair: for pair p, the block's nv (4 or 2) vectors of 16
 * columns, each 16 x (2 K values) in the pair-interleaved order VDPBF16PS multiplies:
 *   P[block b][p][v][2c + q] = W[64 b + 16 v + c][2 p + q].
 * One thread's share of blocks is one sequential stream. Gated MLPs (W = [gate; up]): the caller interleaves the
 * halves 16 rows at a time (as for the AMX kernel), so a block's vectors are gate, up, gate, up of two 32-column
 * groups; modes 1 and 2 write them back as amx_linear.c does.
 *
 * Numerics, the same for every M (batch invariance): each output element has one float32 accumulator, summed over
 * K in order, pair by pair (VDPBF16PS: acc += x[2p] w[2p] + x[2p+1] w[2p+1], the bf16 products exact; AVX2 and
 * scalar: acc = fma(x[2p], w[2p], acc), then the same for 2p + 1), whatever the row blocking or thread split. Then
 * + bias (float32) and one rounding to bf16 (round to nearest even); mode 3 writes the float32 sums + bias.
 * VDPBF16PS (Intel SDM vol. 2, "VDPBF16PS") treats denormal inputs as zero and flushes denormal results.
 *
 * Measured (Xeon with AMX used as a Zen 4 stand-in: oneDNN capped with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, 2 threads,
 * a loaded shared host, per-call minimum over 30 interleaved runs, the 120 linears of a SmolLM2-135M step): rows 1
 * 10.4 ms vs oneDNN 17.8 ms; rows 16 28.9 vs 91 ms. At 32+ rows this CPU's VDPBF16PS (one per 2 cycles, 88 GFLOP/s a
 * core, measured) binds: 2,048 rows ran at 160 GFLOP/s, 91% of that peak.
 * Compute: rows go in blocks of MR (6 on AVX-512: 6 rows x 4 vectors = 24 accumulators + 4 weight registers), the
 * weights of a column block are read once per row block (from L1/L2 after the first). Work units are (a range of
 * column blocks) x (up to UNIT_ROWS rows), taken dynamically by the OpenMP threads one row panel (PANEL_BYTES of
 * x) at a time; at decode sizes (M <= UNIT_ROWS)
 * one contiguous range per thread, so each thread streams its weights in order (when the column blocks don't divide
 * among the threads, from SPLIT_MIN_ROWS rows one block's rows are cut between two of them).
 * Requires N % 32 == 0 and K % 2 == 0 (the caller checks N % 32 and K % 32).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "pagedllm_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define DP_LEVEL 2
#define MR 6
#include <immintrin.h>
#include "simd.h" /* silu16, round16_bf16, store16_bf16_bits: as cpu_ops.c's silu_mul */
#elif defined(__AVX2__) && defined(__FMA__)
#define DP_LEVEL 1
#include <immintrin.h>
#include "simd.h" /* even8, odd8, silu8, round8_bf16, store8_bf16_bits */
/* 3 rows x 4 half-vectors = 12 accumulators + 2 weights + 2 broadcasts: the 16 ymm registers (4 rows spilled:
 * 576 -> 1536 at 16-32 rows, 2 threads, Zen 3: ~55 vs ~75 GFLOP/s) */
#define MR 3
#else
#define DP_LEVEL 0
#define MR 4
#endif

#define UNIT_ROWS 96                    /* rows of one work unit: 96 x K bf16 stays in L2 with a weight block */
#define UNIT_WEIGHT_BYTES (256 * 1024)  /* weights of one work unit (at most) when M > UNIT_ROWS, bytes */
/* Rows of x one pass of every column block covers when M > UNIT_ROWS, in bytes of x (see dpbf16_linear_bf16). Zen 5,
 * 2 threads, 2,048 rows, Qwen2.5-1.5B's down_proj (K 8,960: x is 37 MB, over this VM's 32 MB L3 share when read
 * whole once per column block): 601-646 -> 714-797 GFLOP/s at 2 MB, 8 / 16 MB 713 / 701; its other three layers
 * (K 1,536) within noise; 512 rows within noise (in-process A/B, medians of 6-8 rounds). */
#ifndef PANEL_BYTES
#define PANEL_BYTES (2 * 1024 * 1024)
#endif
#define KC 128                          /* K pairs of one pass over the rows: 32 KB of a 64-column block's weights */
/* Weights prefetched this many K pairs ahead (16 KB of a 64-column block), into L2 (T1): an L1 prefetch holds a line
 * fill buffer until the line arrives, and ~16 per core cap the stream (as in amx_linear.c). SmolLM2's 120 linears of
 * a step at level avx512_bf16 on the Xeon (interleaved): T0 -> T1 at 1 row 8.5-8.9 -> 7.4-7.8 ms, 8 rows 14.0-14.2
 * -> 11.6-11.8, 16 rows 21.5 -> 18.5-18.9; 32-64 rows (VDPBF16PS-bound) within noise. */
#define PF_PAIRS 64
/* From this many row blocks on, the passes prefetch the next chunk instead (see pf_plan). */
#define PF_CHUNK_ROW_BLOCKS 4
/* Rows from which a decode-size call whose column blocks don't divide among the threads cuts a block's rows
 * between two threads (dpbf16_linear_bf16). Zen 5, 2 threads, SmolLM2's 4 layer shapes x 30 (interleaved, medians):
 * 16 rows 6.20 -> 5.92 ms, 32 rows 10.05 -> 9.68, 96 rows 23.46 -> 22.80; 12 rows within noise (5.49 -> 5.53). */
#define SPLIT_MIN_ROWS 16

/* Which weight lines (64 bytes: one vector of one K pair) a pass over a row block prefetches, one pair at a time.
 * Every pass prefetches, not only the first (a prefetch dropped when the line fill buffers are full is asked again).
 * - Fewer than PF_CHUNK_ROW_BLOCKS row blocks (q == 0): the pair PF_PAIRS ahead, its nv lines.
 * - More: the next KC-pair chunk, its lines dealt round-robin over the nrb passes (pass j, its i-th pair: lines
 *   (i * stride + off + t), t < q, below `limit`, from `base`), so the reads go on the whole time the chunk is
 *   computed. Prefetching in the first pass alone left memory idle in the others and stalled the first: on a Zen 5
 *   (2 threads) the 1.5B model's four layer shapes ran at 24-64 rows at 660-810 GFLOP/s against 920-990 on
 *   cache-resident weights; with this, 760-930 (M 16 562 -> 625, 24 657 -> 760, 32 676 -> 799, 64 809 -> 931;
 *   1-8 rows unchanged; 4 or more passes: 2-3 passes did better on the old plan, measured interleaved). */
typedef struct {
    const uint16_t *base;
    int q, stride, off;
    int64_t limit;
} pf_plan;

/* The plan of pass j of nrb over pairs [p0, p1) of the block whose weights start at wb. */
static inline pf_plan plan(const uint16_t *wb, int nv, int64_t p0, int64_t p1, int j, int nrb) {
    if (nrb < PF_CHUNK_ROW_BLOCKS) return (pf_plan){wb + (p0 + PF_PAIRS) * nv * 32, 0, nv, 0, INT64_MAX};
    const int q = (nv + nrb - 1) / nrb;
    return (pf_plan){wb + p1 * nv * 32, q, nrb * q, j * q, (int64_t)KC * nv};
}

/* Prefetch (into L2) what the plan gives the pass's i-th pair. Past the block's end is the next block's weights;
 * past the matrix, harmless (a prefetch never faults). */
static inline __attribute__((always_inline)) void prefetch_pair(const pf_plan *pf, int64_t i, const int nv) {
    if (pf->q == 0) {
        for (int v = 0; v < nv; v++) __builtin_prefetch(pf->base + 32 * (i * nv + v), 0, 2);
        return;
    }
    const int64_t l0 = i * pf->stride + pf->off;
    for (int t = 0; t < pf->q; t++)
        if (l0 + t < pf->limit) __builtin_prefetch(pf->base + 32 * (l0 + t), 0, 2);
}

static int fma_min_rows = 0; /* AVX-512: rows from which the FMA path runs (dpbf16_tune), 0: never */

/* 2: AVX512-BF16 kernels, 1: AVX2 + FMA, 0: scalar C. */
int dpbf16_supported(void) { return DP_LEVEL; }

/* Column blocks of N: 64 columns each, the last one 32 when N % 64 == 32. */
static inline int64_t num_blocks(int64_t N) { return (N + 63) / 64; }
static inline int block_nv(int64_t N, int64_t b) { return 64 * b + 64 <= N ? 4 : 2; }

/* W [N, K] bf16 row-major -> P (N * K bf16) in the layout above. */
void dpbf16_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *P) {
    const int64_t NB = num_blocks(N);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < NB; b++) {
        const int nv = block_nv(N, b);
        uint16_t *dst = P + 64 * b * K;
        for (int64_t p = 0; p < K / 2; p++)
            for (int v = 0; v < nv; v++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *src = W + (64 * b + 16 * v + c) * K + 2 * p;
                    dst[(p * nv + v) * 32 + 2 * c] = src[0];
                    dst[(p * nv + v) * 32 + 2 * c + 1] = src[1];
                }
    }
}

/* Where the 16 results of vector v of block b go (an element offset in the output row) and whether it is a gate
 * vector, for `mode`; ldo: the output row stride (elements). */
static inline int64_t out_col(int64_t N, int64_t b, int v, int mode) {
    if (mode == 0 || mode == 3) return 64 * b + 16 * v;
    const int64_t g = 2 * b + v / 2; /* the 32-column group: 16 gate rows, then 16 up rows */
    if (mode == 1) return (v & 1) ? N / 2 + 16 * g : 16 * g;
    return 16 * g; /* mode 2: silu(gate) * up */
}

#if DP_LEVEL == 2
static inline __attribute__((always_inline)) void emit_rows(__m512 acc[MR][4], const int nv, const int mr,
                                                             float *ab, int last, const float *bias, void *out,
                                                             int64_t ldo, int64_t N, int64_t b, int mode);

/* rows [0, mr) of x (row stride K) x block weights wb (nv vectors a pair) -> emitted into out rows.
 * xf == NULL: VDPBF16PS on the bf16 rows x. Else the FMA path on xf, x as float32: per K pair
 * acc = fma(x[2p], w[2p], fma(x[2p+1], w[2p+1], acc)) under DAZ + FTZ, which is VDPBF16PS's arithmetic (SDM: the odd
 * product is added first, each addition rounded to nearest even in float32, denormal inputs and results zero), so
 * the two paths give the same bits (dpbf16_tune checks this on the CPU before it enables the FMA path). */
static inline __attribute__((always_inline)) void kernel_rows(const uint16_t *x, const float *xf, int64_t K,
                                                               const uint16_t *wb, const int nv, const int mr,
                                                               int64_t p0, int64_t p1, float *ab, int first,
                                                               int last, const pf_plan *pf, const float *bias,
                                                               void *out, int64_t ldo, int64_t N, int64_t b, int mode) {
    __m512 acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(ab + 64 * r + 16 * v);
    if (xf) {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* DAZ (bit 6) + FTZ (bit 15), as VDPBF16PS */
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int64_t p = p0; p < p1; p++) {
            prefetch_pair(pf, p - p0, nv);
            /* two vectors at a time (4 weight registers + 24 accumulators + 2 broadcasts); the opaque row pointer
             * keeps the compiler from holding all 12 broadcasts across them (register moves, measured slower) */
            for (int v = 0; v < nv; v += 2) {
                const __m512i w0 = _mm512_loadu_si512((const void *)(wb + (p * nv + v) * 32));
                const __m512i w1 = _mm512_loadu_si512((const void *)(wb + (p * nv + v + 1) * 32));
                const __m512 we0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
                const __m512 wo0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));
                const __m512 we1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
                const __m512 wo1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));
                const float *x0 = xf + 2 * p;
                __asm__("" : "+r"(x0));
                for (int r = 0; r < mr; r++) {
                    const __m512 xo = _mm512_set1_ps(x0[r * K + 1]), xe = _mm512_set1_ps(x0[r * K]);
                    acc[r][v] = _mm512_fmadd_ps(xe, we0, _mm512_fmadd_ps(xo, wo0, acc[r][v]));
                    acc[r][v + 1] = _mm512_fmadd_ps(xe, we1, _mm512_fmadd_ps(xo, wo1, acc[r][v + 1]));
                }
            }
        }
        _mm_setcsr(csr);
        emit_rows(acc, nv, mr, ab, last, bias, out, ldo, N, b, mode);
        return;
    }
    for (int64_t p = p0; p < p1; p++) {
        __m512i w[4];
        for (int v = 0; v < nv; v++) w[v] = _mm512_loadu_si512((const void *)(wb + (p * nv + v) * 32));
        prefetch_pair(pf, p - p0, nv);
        for (int r = 0; r < mr; r++) {
            int32_t xp;
            memcpy(&xp, x + r * K + 2 * p, 4);
            const __m512i xb = _mm512_set1_epi32(xp);
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)xb, (__m512bh)w[v]);
        }
    }
    emit_rows(acc, nv, mr, ab, last, bias, out, ldo, N, b, mode);
}

/* The float32 sums of rows [0, mr): kept in ab (not the last K chunk), else + bias and written as `mode` says. */
static inline __attribute__((always_inline)) void emit_rows(__m512 acc[MR][4], const int nv, const int mr,
                                                             float *ab, int last, const float *bias, void *out,
                                                             int64_t ldo, int64_t N, int64_t b, int mode) {
    if (!last) {
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) _mm512_store_ps(ab + 64 * r + 16 * v, acc[r][v]);
        return;
    }
    const float *bb = bias ? bias + 64 * b : NULL;
    for (int r = 0; r < mr; r++) {
        if (mode == 2) {
            uint16_t *o = (uint16_t *)out + r * ldo;
            for (int v = 0; v < nv; v += 2) {
                const __m512 bg = bb ? _mm512_loadu_ps(bb + 16 * v) : _mm512_setzero_ps();
                const __m512 bu = bb ? _mm512_loadu_ps(bb + 16 * v + 16) : _mm512_setzero_ps();
                const __m512 gv = round16_bf16(_mm512_add_ps(acc[r][v], bg));
                const __m512 uv = round16_bf16(_mm512_add_ps(acc[r][v + 1], bu));
                const __m512 s = round16_bf16(silu16(gv));
                _mm256_storeu_si256((__m256i *)(o + out_col(N, b, v, 2)), store16_bf16_bits(_mm512_mul_ps(s, uv)));
            }
            continue;
        }
        for (int v = 0; v < nv; v++) {
            const __m512 y = _mm512_add_ps(acc[r][v], bb ? _mm512_loadu_ps(bb + 16 * v) : _mm512_setzero_ps());
            const int64_t col = out_col(N, b, v, mode);
            if (mode == 3)
                _mm512_storeu_ps((float *)out + r * ldo + col, y);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * ldo + col), store16_bf16_bits(y));
        }
    }
}
#elif DP_LEVEL == 1
/* rows [0, mr) x the block's vectors [v0, v0 + nsv) (16 columns each; nv a pair in the layout). */
static inline __attribute__((always_inline)) void kernel_rows_part(const uint16_t *x, const float *xf, int64_t K,
                                                                    const uint16_t *wb,
                                                                    int nv, const int v0, const int nsv, const int mr,
                                                                    int64_t p0, int64_t p1, float *ab, int first,
                                                                    int last, const float *bias, void *out,
                                                                    int64_t ldo, int64_t N, int64_t b, int mode) {
    __m256 acc[MR][8]; /* [row][2 v + half] */
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2 * nsv; h++)
            acc[r][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(ab + 64 * r + 16 * v0 + 8 * h);
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *wp = wb + (p * nv + v0) * 32;
        for (int h = 0; h < 2 * nsv; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + 16 * h));
            const __m256 we = even8(w), wo = odd8(w);
            for (int r = 0; r < mr; r++) { /* x's float32 copy: one vbroadcastss load each (the same values) */
                const __m256 xe = xf ? _mm256_broadcast_ss(xf + r * K + 2 * p)
                                     : _mm256_set1_ps(bf16_to_f32(x[r * K + 2 * p]));
                const __m256 xo = xf ? _mm256_broadcast_ss(xf + r * K + 2 * p + 1)
                                     : _mm256_set1_ps(bf16_to_f32(x[r * K + 2 * p + 1]));
                acc[r][h] = _mm256_fmadd_ps(xo, wo, _mm256_fmadd_ps(xe, we, acc[r][h]));
            }
        }
    }
    if (!last) {
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2 * nsv; h++) _mm256_store_ps(ab + 64 * r + 16 * v0 + 8 * h, acc[r][h]);
        return;
    }
    const float *bb = bias ? bias + 64 * b : NULL;
    for (int r = 0; r < mr; r++)
        for (int vv = 0; vv < nsv; vv++) {
            const int v = v0 + vv;
            for (int h = 0; h < 2; h++) {
                const int c = 16 * v + 8 * h;
                const __m256 y = _mm256_add_ps(acc[r][2 * vv + h], bb ? _mm256_loadu_ps(bb + c) : _mm256_setzero_ps());
                if (mode == 2) {
                    if (v & 1) { /* the up vector; its gate is vector v - 1, of the same call (nsv even) */
                        const __m256 bg = bb ? _mm256_loadu_ps(bb + c - 16) : _mm256_setzero_ps();
                        const __m256 gv = round8_bf16(_mm256_add_ps(acc[r][2 * (vv - 1) + h], bg));
                        const __m256 s = round8_bf16(silu8(gv));
                        uint16_t *o = (uint16_t *)out + r * ldo + out_col(N, b, v, 2) + 8 * h;
                        _mm_storeu_si128((__m128i *)o, store8_bf16_bits(_mm256_mul_ps(s, round8_bf16(y))));
                    }
                } else if (mode == 3) {
                    _mm256_storeu_ps((float *)out + r * ldo + out_col(N, b, v, mode) + 8 * h, y);
                } else {
                    uint16_t *o = (uint16_t *)out + r * ldo + out_col(N, b, v, mode) + 8 * h;
                    _mm_storeu_si128((__m128i *)o, store8_bf16_bits(y));
                }
            }
        }
}
/* One row: the whole block at once (8 accumulators); several rows: two 16-column vectors at a time (a gate/up pair)
 * for MR rows (8 accumulators). Either way each element's sum runs over K in the same order. */
static inline __attribute__((always_inline)) void kernel_rows(const uint16_t *x, const float *xf, int64_t K,
                                                               const uint16_t *wb, const int nv, const int mr,
                                                               int64_t p0, int64_t p1, float *ab, int first,
                                                               int last, const pf_plan *pf, const float *bias,
                                                               void *out, int64_t ldo, int64_t N, int64_t b, int mode) {
    (void)pf;
    if (mr == 1) {
        kernel_rows_part(x, NULL, K, wb, nv, 0, nv, 1, p0, p1, ab, first, last, bias, out, ldo, N, b, mode);
    } else {
        for (int v0 = 0; v0 < nv; v0 += 2)
            kernel_rows_part(x, xf, K, wb, nv, v0, 2, mr, p0, p1, ab, first, last, bias, out, ldo, N, b, mode);
    }
}
#else
/* Scalar: one row of one block, element by element (one out-of-line function, so every element is summed by the
 * same code whatever M). acc [nv * 16]. */
static __attribute__((noinline)) void row_sums(const uint16_t *x, int64_t p0, int64_t p1, const uint16_t *wb,
                                                int nv, float *acc) {
    for (int j = 0; j < 16 * nv; j++) {
        const int v = j / 16, c = j % 16;
        float a = acc[j];
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *w = wb + (p * nv + v) * 32 + 2 * c;
            a = fmaf(bf16_to_f32(x[2 * p]), bf16_to_f32(w[0]), a);
            a = fmaf(bf16_to_f32(x[2 * p + 1]), bf16_to_f32(w[1]), a);
        }
        acc[j] = a;
    }
}
static void kernel_rows(const uint16_t *x, const float *xf, int64_t K, const uint16_t *wb, const int nv, const int mr,
                        int64_t p0, int64_t p1, float *ab, int first, int last, const pf_plan *pf,
                        const float *bias, void *out,
                        int64_t ldo, int64_t N, int64_t b, int mode) {
    (void)pf;
    (void)xf;
    const float *bb = bias ? bias + 64 * b : NULL;
    for (int r = 0; r < mr; r++) {
        float *acc = ab + 64 * r;
        if (first) memset(acc, 0, 64 * sizeof(float));
        row_sums(x + r * K, p0, p1, wb, nv, acc);
        if (!last) continue;
        for (int j = 0; j < 16 * nv; j++) acc[j] += bb ? bb[j] : 0.f;
        for (int v = 0; v < nv; v++) {
            const int64_t col = out_col(N, b, v, mode);
            for (int c = 0; c < 16; c++) {
                const float y = acc[16 * v + c];
                if (mode == 3) {
                    ((float *)out)[r * ldo + col + c] = y;
                } else if (mode == 2) {
                    if (v & 1) {
                        const float g = round_bf16(acc[16 * (v - 1) + c]);
                        const float s = round_bf16(g / (1.0f + expf(-g)));
                        ((uint16_t *)out)[r * ldo + col + c] = f32_to_bf16(s * round_bf16(y));
                    }
                } else {
                    ((uint16_t *)out)[r * ldo + col + c] = f32_to_bf16(y);
                }
            }
        }
    }
}
#endif

/* Rows [m0, m1) (at most UNIT_ROWS) of block b: K in chunks of KC pairs (their weights stay in L1 while every row
 * block passes, the partial sums wait in float32 in `ab`, so each element is still summed in K order); the row blocks
 * of MR rows, the last one shorter (each size its own unrolled kernel). */
static void block_rows(const uint16_t *x, const float *xf, int64_t m0, int64_t m1, int64_t K, const uint16_t *P,
                       int64_t N, int64_t b, const float *bias, void *out, int mode) {
    const int nv = block_nv(N, b);
    const uint16_t *wb = P + 64 * b * K;
    const int64_t ldo = mode == 2 ? N / 2 : N;
    const int64_t esz = mode == 3 ? 4 : 2;
    const int64_t KP = K / 2;
    float ab[UNIT_ROWS * 64] __attribute__((aligned(64)));
    for (int64_t p0 = 0; p0 < KP; p0 += KC) {
    const int64_t p1 = p0 + KC < KP ? p0 + KC : KP;
    const int first = p0 == 0, last = p1 == KP;
    for (int64_t m = m0; m < m1; m += MR) {
        const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
        const uint16_t *xm = x + m * K;
        const float *xfm = xf ? xf + m * K : NULL;
        void *om = (char *)out + m * ldo * esz;
        float *am = ab + (m - m0) * 64;
        const pf_plan pf = plan(wb, nv, p0, p1, (int)((m - m0) / MR), (int)((m1 - m0 + MR - 1) / MR));
#define KR(NV, R) kernel_rows(xm, xfm, K, wb, NV, R, p0, p1, am, first, last, &pf, bias, om, ldo, N, b, mode)
#define KNV(R) \
    if (nv == 4) KR(4, R); else KR(2, R);
        switch (mr) {
            case 1: KNV(1); break;
            case 2: KNV(2); break;
            case 3: KNV(3); break;
#if MR > 4
            case 4: KNV(4); break;
            case 5: KNV(5); break;
            default: KNV(6); break;
#elif MR == 4
            default: KNV(4); break;
#endif
        }
#undef KNV
#undef KR
    }
    }
}

/* x [M, K] bf16 (row stride K), P packed by dpbf16_pack, bias [N] fp32 (in packed row order) or NULL -> out:
 * mode 0: [M, N] bf16; mode 1 (gated packing): [M, N] bf16 as [gate | up]; mode 2 (gated packing): silu(gate) * up
 * [M, N / 2] bf16; mode 3: [M, N] float32 (`out` points to float32 memory). */
void dpbf16_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                        void *out, int mode) {
    float *xf = NULL; /* the FMA path's float32 copy of x */
#if DP_LEVEL == 2
    if (fma_min_rows > 0 && M >= fma_min_rows) xf = (float *)malloc((size_t)(M * K) * sizeof(float));
#elif DP_LEVEL == 1
    if (M >= 2) xf = (float *)malloc((size_t)(M * K) * sizeof(float)); /* broadcast loads instead of conversions */
#endif
#if DP_LEVEL >= 1
    if (xf) {
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    }
#endif
    const int64_t NB = num_blocks(N);
    const int nthr = omp_get_max_threads();
    const int64_t nmc = (M + UNIT_ROWS - 1) / UNIT_ROWS;
    if (nmc == 1 && nthr > 1 && NB % nthr != 0 && NB >= nthr && M >= SPLIT_MIN_ROWS) {
        /* Decode sizes whose column blocks don't divide among the threads (SmolLM2's 576 and 960 columns: 9 and 15
         * blocks on 2 threads): whole blocks would leave a thread a block short; share the (block, row) pairs evenly
         * instead, block by block, so one block's rows may be cut between two threads. A row's sums don't depend on
         * which rows share its pass, so the bits are the same. */
#pragma omp parallel
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t W = NB * M, w0 = W * t / nt, w1 = W * (t + 1) / nt;
            for (int64_t b = w0 / M; b < NB && b * M < w1; b++) {
                const int64_t m0 = b * M < w0 ? w0 - b * M : 0, m1 = (b + 1) * M > w1 ? w1 - b * M : M;
                if (m1 > m0) block_rows(x, xf, m0, m1, K, P, N, b, bias, out, mode);
            }
        }
        free(xf);
        return;
    }
    /* Blocks per unit: decode sizes (one row chunk): one contiguous share per thread; else their weights fit L2. */
    int64_t bcu = nmc == 1 ? (NB + nthr - 1) / nthr : UNIT_WEIGHT_BYTES / (K * 128);
    if (bcu < 1) bcu = 1;
    const int64_t nbc = (NB + bcu - 1) / bcu;
    /* Row panels of at most PANEL_BYTES of x (whole units, equal sizes): every column block passes over one panel
     * before the next panel starts, so the panel's rows stay in cache while all the weights stream past */
    int64_t panel_units = PANEL_BYTES / (K * 2 * UNIT_ROWS);
    if (panel_units < 1) panel_units = 1;
    const int64_t npanels = (nmc + panel_units - 1) / panel_units;
    const int64_t panel = (nmc + npanels - 1) / npanels * UNIT_ROWS;
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
    const int64_t r1 = r0 + panel < M ? r0 + panel : M;
    const int64_t pmc = (r1 - r0 + UNIT_ROWS - 1) / UNIT_ROWS;
    const int64_t units = nbc * pmc;
#pragma omp parallel for schedule(dynamic, 1) if (units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b0 = (u / pmc) * bcu, b1 = b0 + bcu < NB ? b0 + bcu : NB;
        const int64_t mlo = r0 + (u % pmc) * UNIT_ROWS, mhi = mlo + UNIT_ROWS < r1 ? mlo + UNIT_ROWS : r1;
        for (int64_t b = b0; b < b1; b++) block_rows(x, xf, mlo, mhi, K, P, N, b, bias, out, mode);
    }
    }
    free(xf);
}

/* Rows from which dpbf16_linear_bf16 takes the FMA path (0: never; dpbf16_tune sets it). */
void dpbf16_set_fma_rows(int rows) { fma_min_rows = DP_LEVEL == 2 ? rows : 0; }

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Enables the FMA path where it gives VDPBF16PS's bits and is faster; returns the rows it starts at (0: off).
 * 1. Bits: a gated layer (mode 3 and mode 2) on rows of every magnitude from 2^-140 (bf16 denormals) to 2^20 and
 *    weights of mixed signs, both paths, compared bit for bit (a CPU whose VDPBF16PS rounds otherwise fails here).
 * 2. Speed: a prefill-shaped call (96 x 576 -> 1536), best of 3 each, one thread; the FMA path must be >= 1.15x.
 * On the Xeons here without AMX, VDPBF16PS retires one per two cycles and FMA two per cycle (measured: 78 vs 172
 * GFLOP/s on one core), so the FMA path does twice the work per cycle once the weights are converted;
 * at decode sizes both wait on memory, so it starts at FMA_TUNE_ROWS rows. */
#define FMA_TUNE_ROWS 8
int dpbf16_tune(void) {
    fma_min_rows = 0;
#if DP_LEVEL == 2
    const int64_t K = 576, N = 1536, M = 96;
    uint16_t *W = malloc(N * K * 2), *P = malloc(N * K * 2), *x = malloc(M * K * 2);
    float *o1 = malloc(M * N * 4), *o2 = malloc(M * N * 4), *bias = malloc(N * 4);
    int ok = W && P && x && o1 && o2 && bias;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; ok && i < N * K + M * K + N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t r = (uint32_t)(s >> 33);
        /* sign, exponent spread over 2^-140..2^20 for x (denormals included), 2^-8..2^2 for W */
        const int e = i < N * K ? 119 + (int)(r % 11) : (int)(r % 161) - 13;
        const uint16_t v = (uint16_t)(((r >> 31) << 15) | ((uint32_t)(e < 0 ? 0 : e) << 7) | ((r >> 8) & 0x7F));
        if (i < N * K) W[i] = v;
        else if (i < N * K + M * K) x[i - N * K] = v;
        else bias[i - N * K - M * K] = (float)((int)(r % 2001) - 1000) * 1e-3f;
    }
    if (ok) {
        dpbf16_pack(W, N, K, P);
        for (int mode = 3; ok && mode >= 2; mode--) {
            static const int ms[] = {1, 5, 6, 7, 13, 96}; /* every row-block remainder, several blocks */
            for (int i = 0; ok && i < 6; i++) {
                const int64_t m = ms[i];
                fma_min_rows = 0;
                dpbf16_linear_bf16(x, m, K, P, N, bias, o1, mode);
                fma_min_rows = 1;
                dpbf16_linear_bf16(x, m, K, P, N, bias, o2, mode);
                ok = memcmp(o1, o2, (size_t)(m * (mode == 3 ? N * 4 : N))) == 0;
            }
        }
    }
    if (ok) {
        const int nthr = omp_get_max_threads();
        omp_set_num_threads(1);
        double best[2] = {1e30, 1e30};
        for (int rep = 0; rep < 6; rep++) {
            fma_min_rows = rep & 1;
            const double t0 = seconds();
            dpbf16_linear_bf16(x, M, K, P, N, NULL, o1, 0);
            const double t = seconds() - t0;
            if (t < best[rep & 1]) best[rep & 1] = t;
        }
        omp_set_num_threads(nthr);
        ok = best[0] >= 1.15 * best[1];
    }
    free(W); free(P); free(x); free(o1); free(o2); free(bias);
    fma_min_rows = ok ? FMA_TUNE_ROWS : 0;
#endif
    return fma_min_rows;
}
