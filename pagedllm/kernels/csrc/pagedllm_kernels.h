/* Prototypes of every function pagedllm's C libraries export (pagedllm/kernels/bindings.py binds exactly these;
 * tests/test_kernels.py checks that the two agree). Every .c file includes this header, so a definition that drifts
 * from its prototype fails to compile. Functions marked (level: ...) exist only in builds for those ISA levels.
 *
 * Conventions: bf16 tensors travel as uint16_t bit patterns; shapes are noted as [rows, cols], row-major. */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H
#include <stdint.h>

/* ---- paged_decode.c: decode attention straight from the paged KV cache ---- */
void paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, const int64_t *rows,
                       uint16_t *out, int n, int H, int KVH, int D, int BS, float scale, int window,
                       int64_t q_stride);
void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                      int64_t max_blocks, const int64_t *seq_lens, const int64_t *rows, float *out, int n, int H,
                      int KVH, int D, int BS, float scale, int window, int64_t q_stride);
void paged_decode_use_amx(int on); /* no-op below level amx */

/* ---- paged_prefill.c: chunk-invariant prefill attention (where the AMX kernel doesn't run) ---- */
int64_t paged_prefill_ws_bytes(const int64_t *seq_lens, int n, int KVH, int D, int is_bf16);
/* 0, or -1 (nothing done) for a shape it doesn't take (D odd or > 256, H / KVH > 16) or a build without SIMD */
int paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *block_tables, int64_t max_blocks, const int64_t *q_starts, const int64_t *q_lens,
                       const int64_t *seq_lens, int n, uint16_t *out, int H, int KVH, int D, int BS, float scale,
                       int window, void *ws);
int paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, int64_t max_blocks, const int64_t *q_starts, const int64_t *q_lens,
                      const int64_t *seq_lens, int n, float *out, int H, int KVH, int D, int BS, float scale,
                      int window, void *ws);

/* ---- cpu_ops.c: fused element-wise passes ---- */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                       uint16_t *residual_out, int64_t rows, int64_t H, float eps);
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                      int64_t rows, int64_t H, float eps);
void gemma_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const float *scale, uint16_t *out, int64_t out_stride,
                         int64_t T, int64_t G, int64_t D, float eps);
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I);
void gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I);
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t I);
void argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t cols);
void argmax_rows_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t cols);
void apply_token_bitmask_f32(float *logits, int64_t ld, const int64_t *rows, int64_t n_rows, const int32_t *bitmask,
                             int64_t words, int64_t vocab);
uint64_t stream_read(const uint8_t *p, int64_t n, int64_t ahead); /* bench floor's read probe */
/* 0, or -1 where it could not allocate its scratch (out then unset) */
int sample_rows_f32(const float *x, int64_t R, int64_t V, int64_t ld, const float *inv_t, const float *min_p,
                    const int64_t *top_k, const float *top_p, const double *u, int64_t *out);
void rope_cache_bf16(uint16_t *qkv, int64_t row_stride, const uint16_t *cs, int64_t cs_stride, uint16_t *cache_k,
                     uint16_t *cache_v, const int64_t *slots, int64_t T, int H, int KVH, int D);
void rope_cache_f32(float *qkv, int64_t row_stride, const float *cs, int64_t cs_stride, float *cache_k,
                    float *cache_v, const int64_t *slots, int64_t T, int H, int KVH, int D);

/* ---- amx_linear.c, amx_attention.c (level: amx) ---- */
int amx_supported(void); /* 1 once Linux granted this process the AMX tile state */
void amx_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *P);
/* mode 0: out bf16 [M, N]; 1: gated packing, out bf16 [M, N] as [gate | up]; 2: gated packing, out bf16
 * silu(gate) * up [M, N / 2]; 3: out float32 [M, N]. bias float32 [N] (packed row order) or NULL. */
void amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                     void *out, int mode);
void amx_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *block_tables, int64_t max_blocks,
                                const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens, int n,
                                uint16_t *out, int H, int KVH, int D, int BS, float scale, int window,
                                uint16_t *vt);

/* ---- dpbf16_linear.c: bf16 linears without AMX (VDPBF16PS at avx512_bf16, AVX2 + FMA at avx2), the ABI and modes of
 * amx_linear_bf16 ---- */
int dpbf16_supported(void); /* the path compiled in: 2 AVX512-BF16, 1 AVX2 + FMA, 0 scalar */
void dpbf16_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *P);
void dpbf16_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                        void *out, int mode);
/* AVX512-BF16 build: the FMA path (VDPBF16PS's bits at FMA's rate) from `rows` rows on (0: off); tune checks bits
 * and speed on this CPU, sets it, and returns the rows (0: off; always 0 in the AVX2 and scalar builds). */
void dpbf16_set_fma_rows(int rows);
int dpbf16_tune(void);

/* ---- int4_cpu.c: int4 / int8 weight-only matmuls ---- */
void int4_gemm(const void *x, int64_t M, int64_t K, const uint8_t *packed, const void *sz, int64_t G,
               int64_t N_pad, int64_t n_out, void *out, int is_bf16);
void int4_expand(const uint8_t *packed, const void *sz, int64_t K, int64_t G, int64_t N_pad, void *w, int is_bf16);
int int4_dequant_packed_bf16(const uint8_t *packed, const void *sz, int is_bf16, int64_t K, int64_t G, int64_t N_pad,
                             int64_t b0, int64_t b1, int layout, uint16_t *P);
void int8_gemm(const void *x, int64_t M, int64_t K, const int8_t *q, const void *scale, int64_t N, void *out,
               int is_bf16);
void int8_logits(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *out,
                 int is_bf16);
/* 1 where the four below exist: AVX512-VNNI + VBMI + BF16 builds, and AVX2 + FMA builds (same bits) */
int int4_gemv_bf16_supported(void);
int int4_gemv_use_amx(int on); /* the fewest rows taking the AMX-INT8 path; 0: off, or none in the build */
void int4_set_prefetch_bytes(int64_t bytes); /* the decode loops' prefetch distance (KernelConfig) */
void int4_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t G,
                    int64_t N_pad, int64_t n_out, uint16_t *out);
void int4_gemv_bf16_a8(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t G,
                       int64_t N_pad, int64_t n_out, uint16_t *out); /* 8-bit activations (prefill rows) */
void int4_gemv_bf16_f32(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz,
                        int64_t G, int64_t N_pad, int64_t n_out, float *out); /* float32 out (logits) */
void int8_logits_vnni(const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                      float *out, int is_bf16);

/* ---- kquant_cpu.c: GGUF Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K values in 16-row tiles (type: the ggml type id) ---- */
int kq_isa(void); /* the path this build runs: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 scalar */
/* bytes of the tiled form of an [N, K] weight; -1: bad type or K */
int64_t kq_packed_bytes(int type, int64_t N, int64_t K);
/* dst = the tiled form of src [N, row_bytes] (the file's ggml blocks); -1: bad type or K */
int kq_pack(int type, const uint8_t *src, int64_t N, int64_t K, int64_t row_bytes, uint8_t *dst);
/* madvise(MADV_DONTNEED) on the whole pages of [p, p + n) of a file mapping (never anonymous memory) */
int kq_release_file_pages(const void *p, int64_t n);
/* x [M, K] bf16 / float32 -> 15-bit activations: xhi, xlo int8 [M, K]; xs, xsum32 float [M, K/32]; isum16 int32
 * [M, K/16] */
void kq_quantize_act(const void *x, int64_t M, int64_t K, int is_bf16, int8_t *xhi, int8_t *xlo, float *xs,
                     float *xsum32, int32_t *isum16, int act_bits);
/* out [M, ldo] float32 / bf16, columns 0..N-1 = activations @ W.T with W tiled (kq_pack); act8: act_bits was 8;
 * -1: bad type */
int kq_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const int8_t *xhi, const int8_t *xlo,
              const float *xs, const float *xsum32, const int32_t *isum16, int64_t M, void *out, int64_t ldo,
              int out_bf16, int act8);
/* One tiled weight of a layer made of several (a fused qkv / gate_up): `rows` rows of ggml type `type` at w. */
typedef struct {
    int64_t type, rows;
    const uint8_t *w;
} kq_shard_t;
#define KQ_MAX_SHARDS 8
void kq_set_prefetch_bytes(int64_t bytes); /* the GEMVs' prefetch distance (KernelConfig) */
/* kq_matmul over shards side by side (shard i's columns after shard i - 1's), in one parallel region */
int kq_matmul_shards(const kq_shard_t *shards, int64_t n_shards, int64_t K, const int8_t *xhi, const int8_t *xlo,
                     const float *xs, const float *xsum32, const int32_t *isum16, int64_t M, void *out, int64_t ldo,
                     int out_bf16, int act8);
/* out [n, K] float32 / bf16 = rows ids of the tiled W dequantized (gguf's values); -1: bad type */
int kq_dequant_rows(int type, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n, void *out,
                    int out_bf16);
/* tiles t0..t1-1 of the tiled W dequantized to bf16 in amx_pack's (layout 0) or dpbf16_pack's (1) layout; -1: bad */
int kq_dequant_packed_bf16(int type, const uint8_t *w, int64_t N, int64_t K, int64_t t0, int64_t t1, int layout,
                           uint16_t *P);

/* ---- llama_stack.c: a Llama (or Gemma 3) model's decoder layers in one call (structs: see that file) ---- */
struct stack_model;
struct stack_step;
int64_t stack_scratch_elems(const struct stack_model *m, int64_t T);
void stack_forward(const struct stack_model *m, const struct stack_step *s);
void gemma_stack_forward(const struct stack_model *m, const struct stack_step *s); /* Gemma 3, decode steps */

#endif
