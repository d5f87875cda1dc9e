/* All decoder layers of a Llama-family model in one C call per step (pagedllm/models/fused_stack.py).
 *
 * Why: a SmolLM2 decode step makes ~240 kernel calls (4 linears, 2 norms, RoPE + cache write and attention per
 * layer); through Python each costs ~10-20 us of dispatch, argument conversion and output allocation, which is
 * several ms of a 15-35 ms step. Here the same kernels run in the same order on the same data, called through
 * function pointers (the libraries that define them are built separately: amx_linear.c or another linear backend,
 * cpu_ops.c, paged_decode.c, amx_attention.c, int4_cpu.c, kquant_cpu.c), so the result equals the Python path bit
 * for bit.
 *
 * Per layer (pre-norm block; `res` is the residual stream):
 *   xn = rms(x + res) (first layer: rms(x), res = x); qkv = xn W_qkv^T (+ b); RoPE on q, k in place, K and V into
 *   the paged cache; attn = decode attention for the decode rows, AMX prefill attention for the prefill slices;
 *   o = attn W_o^T (+ b); xn = rms(o + res); act = silu(gate) * up (one AMX call, or the int4 GEMV / the K-quant
 *   matmul then silu_mul); x = act W_down^T (+ b).
 * The last layer's x and res go back to the caller for the final norm. No allocation: `scratch` holds the
 * activations. Layouts are the Python path's (see the kernels' own comments); all bf16 unless noted.
 */
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "pagedllm_kernels.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"
#endif

/* The kernels are called through pointers of their own prototypes (pagedllm_kernels.h); a backend with the same
 * ABI as amx_linear_bf16 (modes 0-3) can stand in as `linear`. */
typedef __typeof__(&amx_linear_bf16) linear_fn;
typedef __typeof__(&add_rms_norm_bf16) rms_fn;
typedef __typeof__(&rope_cache_bf16) rope_fn;
typedef __typeof__(&paged_decode_bf16) decode_fn;
typedef __typeof__(&int4_gemv_bf16) int4_fn;
typedef __typeof__(&silu_mul_bf16) silu_mul_fn;
typedef __typeof__(&amx_prefill_attention_bf16) prefill_fn;
typedef __typeof__(&kq_quantize_act) kq_quant_fn;
typedef __typeof__(&kq_matmul_shards) kq_matmul_fn;
typedef __typeof__(&gemma_rms_norm_bf16) gemma_norm_fn;
typedef __typeof__(&gelu_tanh_mul_bf16) gelu_mul_fn;


/* One linear layer: kind 0 = packed for the AMX kernel (w; bias: fp32 or NULL); kind 1 = int4 groups for
 * int4_gemv_bf16 (w = packed codes, sz = scales and zeros, group, n_pad rows packed); kind 2 = GGUF K-quant shards
 * for kq_matmul_shards (w = kq_shard_t[group], their columns side by side). Kinds 1 and 2: bias = bf16 or NULL. */
typedef struct {
    int64_t kind;
    const void *w, *sz;
    const void *bias;
    int64_t group, n_pad;
} stack_linear_t;

typedef struct {
    stack_linear_t qkv, o, gate_up, down; /* gate_up: the AMX kernel's gated packing (kind 0) */
    const uint16_t *ln_in, *ln_post;      /* RMSNorm weights [hidden] */
    uint16_t *k_cache, *v_cache;          /* [num_blocks, BS, KVH, D] */
    int64_t window;                       /* sliding window (tokens), 0 = none */
    /* Gemma 3 (gemma_stack_forward): the float32 scales (1 + weight) of its six norms: input, post-attention,
     * pre- and post-feed-forward [hidden], q and k heads [D]; the attention metadata group of its KV cache (an
     * index into stack_step_t.groups) and which rotary table (0: cs, 1: cs2) */
    const float *g_in, *g_post_attn, *g_pre_ff, *g_post_ff, *g_q, *g_k;
    int64_t group, rope_sel;
} stack_layer_t;

typedef struct stack_model {
    int64_t num_layers, hidden, H, KVH, D, inter, BS;
    float eps, scale;
    linear_fn linear;
    rms_fn rms;
    rope_fn rope;
    decode_fn decode;
    prefill_fn prefill;
    int4_fn int4;          /* kind 1 linears */
    silu_mul_fn silu_mul;  /* after a kind 1 or 2 gate_up */
    kq_quant_fn kq_quant;  /* kind 2 linears: kquant_cpu.c's quantizer and matmul */
    kq_matmul_fn kq_matmul;
    int64_t kq_act_bits;   /* the activations' width (KernelConfig.kquant_decode_bits(bf16): these steps are decode rows) */
    const stack_layer_t *layers;
    gemma_norm_fn gnorm;   /* Gemma 3 only */
    gelu_mul_fn gelu_mul;
} stack_model_t;

/* One KV cache group's decode metadata (Gemma 3: sliding and full layers keep separate block tables). */
typedef struct {
    const int64_t *slots;
    int64_t n_dec, dec_max_blocks;
    const int64_t *dec_bt, *dec_seq_lens, *dec_rows;
} stack_group_t;

typedef struct stack_step {
    int64_t T;
    const uint16_t *x;                  /* [T, hidden]: the embeddings (not written) */
    uint16_t *x_out, *res_out;          /* [T, hidden] each: the last layer's output and residual */
    const uint16_t *cs;                 /* rotary [cos | sin] of each token, rows cs_stride elements apart */
    int64_t cs_stride;
    const int64_t *slots;               /* [T] slot of each token in the paged cache */
    int64_t n_dec, dec_max_blocks;      /* decode requests (one token each) */
    const int64_t *dec_bt, *dec_seq_lens, *dec_rows; /* [n_dec, max_blocks], [n_dec], [n_dec] or NULL (rows 0..) */
    int64_t n_pre, pre_max_blocks;      /* prefill slices */
    const int64_t *pre_bt, *pre_q_starts, *pre_q_lens, *pre_seq_lens;
    uint16_t *pre_ws;                   /* the prefill kernel's V^T workspace */
    uint16_t *scratch;                  /* stack_scratch_elems(model, T) bf16 */
    uint8_t *kq_scratch;                /* kind 2 linears: 5 T max(hidden, H D, inter) / 2 bytes (the quantized x) */
    const uint16_t *cs2;                /* Gemma 3: the full-attention layers' rotary table (cs: the sliding ones') */
    int64_t cs2_stride;
    const stack_group_t *groups;        /* Gemma 3: per KV cache group (decode steps only) */
} stack_step_t;

/* bf16 elements of scratch a step of T tokens needs. */
int64_t stack_scratch_elems(const stack_model_t *m, int64_t T) {
    const int64_t qkv = (m->H + 2 * m->KVH) * m->D;
    return T * (2 * m->hidden + qkv + m->H * m->D + 3 * m->inter);
}

/* The Python path of a K-quant QuantLinear's matmul (kquant_linear on decode rows): x quantized once, one
 * kq_matmul_shards call writing every shard's columns of out in bf16 (run_linear adds the bias). */
static void run_kquant(const stack_model_t *m, const stack_linear_t *L, const uint16_t *x, int64_t T, int64_t k,
                       int64_t n, uint16_t *out, uint8_t *buf) {
    int8_t *xhi = (int8_t *)buf, *xlo = xhi + T * k;
    float *xs = (float *)(xlo + T * k), *xsum = xs + T * (k / 32);
    int32_t *isum = (int32_t *)(xsum + T * (k / 32));
    m->kq_quant(x, T, k, 1, xhi, xlo, xs, xsum, isum, (int)m->kq_act_bits);
    m->kq_matmul((const kq_shard_t *)L->w, L->group, k, xhi, xlo, xs, xsum, isum, T, out, n, 1, m->kq_act_bits == 8);
}

/* x [n] = round(a + b) in bf16, as torch adds two bf16 tensors (a may be x); vectorized (the scalar loop the compiler
 * left alone: ~0.7 us a 640-wide Gemma row, two a layer, AMD EPYC Zen 5, from the fused loop's timers: norm + add
 * 1.4 us, the norm alone 0.7). */
static void add_bf16(uint16_t *x, const uint16_t *a, const uint16_t *b, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(x + i),
                            store16_bf16_bits(_mm512_add_ps(load16_bf16(a + i), load16_bf16(b + i))));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(x + i),
                         store8_bf16_bits(_mm256_add_ps(load8_bf16(a + i), load8_bf16(b + i))));
#endif
    for (; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* out [T, n] += b [n] in bf16, as torch adds two bf16 tensors (the Python path's `y + bias`). */
static void add_bias_bf16(uint16_t *out, const uint16_t *b, int64_t T, int64_t n) {
    for (int64_t t = 0; t < T; t++) add_bf16(out + t * n, out + t * n, b, n);
}

/* out [T, n] = x [T, k] W^T through the layer's kernel; mode: the AMX kernel's (0 plain, 2 gated silu * up). */
static void run_linear(const stack_model_t *m, const stack_linear_t *L, const uint16_t *x, int64_t T, int64_t k,
                       int64_t n, uint16_t *out, int mode, uint8_t *kq_buf) {
    if (L->kind == 0) {
        m->linear(x, T, k, (const uint16_t *)L->w, n, (const float *)L->bias, out, mode);
        return;
    }
    if (L->kind == 1)
        m->int4(x, T, k, (const uint8_t *)L->w, (const uint16_t *)L->sz, L->group, L->n_pad, n, out);
    else
        run_kquant(m, L, x, T, k, n, out, kq_buf);
    if (L->bias)
        add_bias_bf16(out, (const uint16_t *)L->bias, T, n);
}

void stack_forward(const stack_model_t *m, const stack_step_t *s) {
    const int64_t T = s->T, Hd = m->hidden, qkv_n = (m->H + 2 * m->KVH) * m->D, q_n = m->H * m->D;
    uint16_t *xn = s->scratch, *o = xn + T * Hd, *qkv = o + T * Hd, *attn = qkv + T * qkv_n, *act = attn + T * q_n;
    uint16_t *res = s->res_out, *x = s->x_out;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const stack_layer_t *L = &m->layers[l];
        if (l == 0) { /* residual = the embeddings */
            m->rms(s->x, NULL, L->ln_in, xn, NULL, T, Hd, m->eps);
            memcpy(res, s->x, (size_t)(T * Hd) * 2);
        } else {
            m->rms(x, res, L->ln_in, xn, res, T, Hd, m->eps);
        }
        run_linear(m, &L->qkv, xn, T, Hd, qkv_n, qkv, 0, s->kq_scratch);
        m->rope(qkv, qkv_n, s->cs, s->cs_stride, L->k_cache, L->v_cache, s->slots, T, (int)m->H, (int)m->KVH,
                (int)m->D);
        if (s->n_dec)
            m->decode(qkv, L->k_cache, L->v_cache, s->dec_bt, s->dec_max_blocks, s->dec_seq_lens, s->dec_rows, attn,
                      (int)s->n_dec, (int)m->H, (int)m->KVH, (int)m->D, (int)m->BS, m->scale, (int)L->window, qkv_n);
        if (s->n_pre)
            m->prefill(qkv, qkv_n, L->k_cache, L->v_cache, s->pre_bt, s->pre_max_blocks, s->pre_q_starts,
                       s->pre_q_lens, s->pre_seq_lens, (int)s->n_pre, attn, (int)m->H, (int)m->KVH, (int)m->D,
                       (int)m->BS, m->scale, (int)L->window, s->pre_ws);
        run_linear(m, &L->o, attn, T, q_n, Hd, o, 0, s->kq_scratch);
        m->rms(o, res, L->ln_post, xn, res, T, Hd, m->eps);
        if (L->gate_up.kind == 0) { /* silu(gate) * up out of the matmul's epilogue */
            run_linear(m, &L->gate_up, xn, T, Hd, 2 * m->inter, act, 2, s->kq_scratch);
        } else {
            uint16_t *gu = act + T * m->inter; /* [T, 2 * inter], gate first */
            run_linear(m, &L->gate_up, xn, T, Hd, 2 * m->inter, gu, 0, s->kq_scratch);
            m->silu_mul(gu, act, T, m->inter);
        }
        run_linear(m, &L->down, act, T, m->inter, Hd, x, 0, s->kq_scratch);
    }
}

/* Gemma 3's decoder layers (models/gemma3.py, decode steps only), the Python layer loop's kernels in its order:
 *   xn = norm_in(x); qkv = xn W_qkv^T; q, k heads normed in place; RoPE (the layer type's table) and K, V into
 *   the cache; attn = decode attention (the layer's group metadata, its window); h = norm_post_attn(attn W_o^T);
 *   x = x + h; xn = norm_pre_ff(x); act = gelu_tanh(gate) * up; h = norm_post_ff(act W_down^T); x = x + h.
 * x_out gets the last layer's x (the final norm is the caller's); res_out is not used. */
void gemma_stack_forward(const stack_model_t *m, const stack_step_t *s) {
    const int64_t T = s->T, Hd = m->hidden, qkv_n = (m->H + 2 * m->KVH) * m->D, q_n = m->H * m->D;
    uint16_t *xn = s->scratch, *o = xn + T * Hd, *qkv = o + T * Hd, *attn = qkv + T * qkv_n, *act = attn + T * q_n;
    uint16_t *gu = act + T * m->inter, *x = s->x_out;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const stack_layer_t *L = &m->layers[l];
        const stack_group_t *G = &s->groups[L->group];
        const uint16_t *xin = l ? x : s->x;
        m->gnorm(xin, Hd, L->g_in, xn, Hd, T, 1, Hd, m->eps);
        run_linear(m, &L->qkv, xn, T, Hd, qkv_n, qkv, 0, s->kq_scratch);
        m->gnorm(qkv, qkv_n, L->g_q, qkv, qkv_n, T, m->H, m->D, m->eps);
        m->gnorm(qkv + q_n, qkv_n, L->g_k, qkv + q_n, qkv_n, T, m->KVH, m->D, m->eps);
        m->rope(qkv, qkv_n, L->rope_sel ? s->cs2 : s->cs, L->rope_sel ? s->cs2_stride : s->cs_stride, L->k_cache,
                L->v_cache, G->slots, T, (int)m->H, (int)m->KVH, (int)m->D);
        m->decode(qkv, L->k_cache, L->v_cache, G->dec_bt, G->dec_max_blocks, G->dec_seq_lens, G->dec_rows, attn,
                  (int)G->n_dec, (int)m->H, (int)m->KVH, (int)m->D, (int)m->BS, m->scale, (int)L->window, qkv_n);
        run_linear(m, &L->o, attn, T, q_n, Hd, o, 0, s->kq_scratch);
        m->gnorm(o, Hd, L->g_post_attn, o, Hd, T, 1, Hd, m->eps);
        add_bf16(x, xin, o, T * Hd);
        m->gnorm(x, Hd, L->g_pre_ff, xn, Hd, T, 1, Hd, m->eps);
        run_linear(m, &L->gate_up, xn, T, Hd, 2 * m->inter, gu, 0, s->kq_scratch);
        m->gelu_mul(gu, act, T, m->inter);
        run_linear(m, &L->down, act, T, m->inter, Hd, o, 0, s->kq_scratch);
        m->gnorm(o, Hd, L->g_post_ff, o, Hd, T, 1, Hd, m->eps);
        add_bf16(x, x, o, T * Hd);
    }
}
