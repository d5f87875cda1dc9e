/* Scalar bfloat16 <-> float32 conversions shared by the CPU kernels (bf16 = the top 16 bits of a float32). */
#ifndef PAGEDLLM_BF16_H
#define PAGEDLLM_BF16_H
#include <stdint.h>

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
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif
