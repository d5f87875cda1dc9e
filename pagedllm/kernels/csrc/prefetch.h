/* WEIGHT_PREFETCH(p, locality): a quantized decode kernel's software prefetch of its weight stream. In a build with
 * WEIGHT_PREFETCH_NTA=1 (kernels.lib's variant for KernelConfig.weight_prefetch_hint "nta") the line is fetched
 * non-temporally (__builtin_prefetch locality 0: PREFETCHNTA on x86), else to the cache level the kernel was tuned with
 * (locality 3: L1). A build-time choice: a runtime switch beside each prefetch made the K-quant kernel's compute-bound
 * prefill 1.3x slower (Qwen2.5-Coder-0.5B, 1,024 tokens: 0.94 -> 1.24 s, AMD EPYC Zen 5).
 * Why non-temporal: at decode sizes every weight line is read once a step; filled as usual, the stream evicts from L2
 * what the step keeps using (activations, the KV cache, the Python state of the scheduler and the runner between the
 * kernels). Measured on an AMD EPYC Zen 5 (2 threads, one request decoding 48 tokens, the choice flipped in one process
 * every other request, medians of 8-12 pairs; step time cache / nta): SmolLM2 int4 1.11x, Qwen2.5-Coder-1.5B Q4_K_M
 * 1.07x, Gemma-3-270M Q4_K_M 1.04x, Qwen2.5-Coder-0.5B 1.03x. Not used by the bf16 GEMM (dpbf16_linear.c), where it
 * changed nothing at one row (1.005x) and lost at 8 (0.985x). The kernels' cached level was tuned on a Xeon (AMX),
 * where it stays off (not measured there). */
#ifndef PAGEDLLM_PREFETCH_H
#define PAGEDLLM_PREFETCH_H
#ifndef WEIGHT_PREFETCH_NTA
#define WEIGHT_PREFETCH_NTA 0
#endif
#define WEIGHT_PREFETCH(p, locality) __builtin_prefetch((const void *)(p), 0, WEIGHT_PREFETCH_NTA ? 0 : (locality))
#endif
