/* All decoder layers of a Llama-family model in one C call per step (pagedllm/models/fused_stack.py).
 *
 * Why: a SmolLM2 decode step makes ~240 kernel calls (4 linears, 2 norms, RoPE + cache write and attention per
 * layer); through Python each costs ~10-20 us of dispatch, argument conversion and output allocation, which is
 * several ms of a 15-35 ms step. Here the same kernels run in the same order on the same data, called through
 * function pointers (the libraries that define them are built separately: layers/csrc/amx_linear.c,
 * attention/csrc/cpu_ops.c, paged_decode.c, amx_attention.c), so the result equals the Python path bit for bit.
 *
 * Per layer (pre-norm block; `res` is the residual stream):
 *   xn = rms(x + res) (first layer: rms(x), res = x); qkv = xn W_qkv^T (+ b); RoPE on q, k in place, K and V into
 *   the paged cache; attn = decode attention for the decode rows, AMX prefill attention for the prefill slices;
 *   o = attn W_o^T (+ b); xn = rms(o + res); act = silu(gate) * up (one AMX call); x = act W_down^T (+ b).
 * The last layer's x and res go back to the caller for the final norm. No allocation: `scratch` holds the
 * activations. Layouts are the Python path's (see the kernels' own comments); all bf16 unless noted.
 */
#include <stdint.h>
#include <string.h>

typedef void (*linear_fn)(const uint16_t *x, int64_t M, int64_t K, const uint16_t *P, int64_t N, const float *bias,
                          void *out, int mode);
typedef void (*rms_fn)(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                       uint16_t *residual_out, int64_t rows, int64_t H, float eps);
typedef void (*rope_fn)(uint16_t *qkv, int64_t row_stride, const uint16_t *cs, int64_t cs_stride, uint16_t *cache_k,
                        uint16_t *cache_v, const int64_t *slots, int64_t T, int H, int KVH, int D);
typedef void (*decode_fn)(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                          const int64_t *rows, uint16_t *out, int n, int H, int KVH, int D, int BS, float scale,
                          int window, int64_t q_stride);
typedef void (*prefill_fn)(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *q_starts,
                           const int64_t *q_lens, const int64_t *seq_lens, int n, uint16_t *out, int H, int KVH,
                           int D, int BS, float scale, int window, uint16_t *vt);

typedef struct {
    const uint16_t *w_qkv, *w_o, *w_gate_up, *w_down; /* packed by amx_pack (gate_up: the gated packing) */
    const float *b_qkv, *b_o, *b_gate_up, *b_down;    /* float32 biases in packed order, or NULL */
    const uint16_t *ln_in, *ln_post;                  /* RMSNorm weights [hidden] */
    uint16_t *k_cache, *v_cache;                      /* [num_blocks, BS, KVH, D] */
    int64_t window;                                   /* sliding window (tokens), 0 = none */
} stack_layer_t;

typedef struct {
    int64_t num_layers, hidden, H, KVH, D, inter, BS;
    float eps, scale;
    linear_fn linear;
    rms_fn rms;
    rope_fn rope;
    decode_fn decode;
    prefill_fn prefill;
    const stack_layer_t *layers;
} stack_model_t;

typedef struct {
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
} stack_step_t;

/* bf16 elements of scratch a step of T tokens needs. */
int64_t stack_scratch_elems(const stack_model_t *m, int64_t T) {
    const int64_t qkv = (m->H + 2 * m->KVH) * m->D;
    return T * (2 * m->hidden + qkv + m->H * m->D + m->inter);
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
        m->linear(xn, T, Hd, L->w_qkv, qkv_n, L->b_qkv, qkv, 0);
        m->rope(qkv, qkv_n, s->cs, s->cs_stride, L->k_cache, L->v_cache, s->slots, T, (int)m->H, (int)m->KVH,
                (int)m->D);
        if (s->n_dec)
            m->decode(qkv, L->k_cache, L->v_cache, s->dec_bt, s->dec_max_blocks, s->dec_seq_lens, s->dec_rows, attn,
                      (int)s->n_dec, (int)m->H, (int)m->KVH, (int)m->D, (int)m->BS, m->scale, (int)L->window, qkv_n);
        if (s->n_pre)
            m->prefill(qkv, qkv_n, L->k_cache, L->v_cache, s->pre_bt, s->pre_max_blocks, s->pre_q_starts,
                       s->pre_q_lens, s->pre_seq_lens, (int)s->n_pre, attn, (int)m->H, (int)m->KVH, (int)m->D,
                       (int)m->BS, m->scale, (int)L->window, s->pre_ws);
        m->linear(attn, T, q_n, L->w_o, Hd, L->b_o, o, 0);
        m->rms(o, res, L->ln_post, xn, res, T, Hd, m->eps);
        m->linear(xn, T, Hd, L->w_gate_up, 2 * m->inter, L->b_gate_up, act, 2);
        m->linear(act, T, m->inter, L->w_down, Hd, L->b_down, x, 0);
    }
}
