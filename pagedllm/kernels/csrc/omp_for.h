/* OMP_FOR_IF(cond, for-loop): the loop as `omp parallel for schedule(static)` when cond holds, else plainly.
 *
 * Why not an `if (cond)` clause: with the clause false the loop still enters libgomp (GOMP_parallel with a team of
 * one), 0.42 us a call against 0.05 us for the bare loop over 640 floats (AMD EPYC Zen 5, gcc 12). A decode step calls
 * such small kernels (norms, activations, RoPE, activation quantization) hundreds of times: ~11 a Gemma 3 layer.
 * The loop may hold no preprocessor directive (a macro argument can't); put such bodies in a function. */
#ifndef PAGEDLLM_OMP_FOR_H
#define PAGEDLLM_OMP_FOR_H
#define OMP_FOR_IF(cond, ...)                                          \
    do {                                                               \
        if (cond) {                                                    \
            _Pragma("omp parallel for schedule(static)") __VA_ARGS__   \
        } else {                                                       \
            __VA_ARGS__                                                \
        }                                                              \
    } while (0)
#endif
