/* Shared by pagedllm's AMX kernels (amx_linear.c and amx_attention.c, compiled into one library, and the AMX score
 * pass of paged_decode.c; all in pagedllm/kernels/csrc).
 * Instruction and tile-configuration semantics: Intel Architecture Instruction Set Extensions Programming Reference,
 * ch. 3 (LDTILECFG, TILELOADD, TDPBF16PS); the permission request: Linux arch/x86/include/uapi/asm/prctl.h. */
#ifndef PAGEDLLM_AMX_H
#define PAGEDLLM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for permission to use an XSAVE feature (arch/x86/include/uapi) */
#define XFEATURE_XTILEDATA 18

/* GCC 12's AMX intrinsics are asm statements that don't declare all the memory they read: _tile_loadd has no memory
 * operand and no "memory" clobber, and _tile_loadconfig declares 8 of its 64 bytes. So stores into a buffer that a
 * tile load then reads (a tile configuration, a Q^T or P^T tile built here) may legally be moved past that load or
 * dropped as dead, and at -O3 they are (an in-register-transposed Q^T buffer came out stale). Call amx_fence()
 * between such stores and the load: a compiler barrier, no instruction. */
static inline void amx_fence(void) { __asm__ volatile("" ::: "memory"); }

/* The 64-byte operand of LDTILECFG (palette 1): bytes per row and rows of each of the 8 tiles. */
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* LDTILECFG of `cfg`, after the stores that filled it (see amx_fence). */
static inline void amx_load_tilecfg(const tilecfg_t* cfg) {
    amx_fence();
    _tile_loadconfig(cfg);
}

/* Loads a configuration with all 8 tiles 16 rows x 64 bytes (the attention kernels' only shape). */
static inline void config_tiles_16x64(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    amx_load_tilecfg(&cfg);
}

/* The prefill attention kernel's score tiles (tile numbers must be compile-time constants; paged_decode.c numbers its
 * own): 0 = scores (accumulator), 4 = K rows, 2/3/5/6 = Q^T (VNNI) for dims 0-31/32-63/64-95/96-127. amx_qk_half
 * adds K rows [dims 32c, 32c + 32) x Q^T tile c into tile 0; amx_load_qt loads Q^T tile c. */
static inline void amx_qk_half(int c, const uint16_t* kp, int64_t stride) {
    _tile_loadd(4, kp + 32 * c, stride);
    switch (c) {
        case 0: _tile_dpbf16ps(0, 4, 2); break;
        case 1: _tile_dpbf16ps(0, 4, 3); break;
        case 2: _tile_dpbf16ps(0, 4, 5); break;
        default: _tile_dpbf16ps(0, 4, 6); break;
    }
}

static inline void amx_load_qt(int c, const void* p) {
    amx_fence(); /* p was just written */
    switch (c) {
        case 0: _tile_loadd(2, p, 64); break;
        case 1: _tile_loadd(3, p, 64); break;
        case 2: _tile_loadd(5, p, 64); break;
        default: _tile_loadd(6, p, 64); break;
    }
}

/* In-register transpose of a 16 x 16 matrix of 32-bit elements (r[i] = row i in, column i out): unpack 32- and
 * 64-bit pairs within 128-bit lanes, then a 4 x 4 transpose of the lanes. */
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], lane L: rows 4i..4i+3 of column 4L + c */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c = lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        const __m512i s0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i s2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(s0, s1, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(s0, s1, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(s2, s3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(s2, s3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* amx_build_qt's transpose, without the load: Q^T tile c into buf, column n from cols[n] for n < ncols, zero for
 * n >= ncols or cols[n] == NULL (paged_decode.c: each KV head's tile holds only its own query heads' columns). */
static inline void amx_qt_transpose(int c, const uint16_t* const cols[16], int ncols, uint32_t* buf) {
    __m512i r[16];
    for (int n = 0; n < 16; n++)
        r[n] = n < ncols && cols[n] ? _mm512_loadu_si512((const void*)(cols[n] + 32 * c)) : _mm512_setzero_si512();
    transpose16x16_epi32(r);
    for (int n = 0; n < 16; n++) _mm512_store_si512((void*)(buf + 16 * n), r[n]);
}

/* Builds Q^T tile c in the VNNI "B" layout from up to 16 query vectors and loads it (amx_load_qt): element (r, n) is
 * dims (32 c + 2 r, 32 c + 2 r + 1) of cols[n] as one 32-bit pair, 0 for n >= ncols. buf: 1 KB scratch, 64-byte
 * aligned (the tile load copies it, so one buffer serves every c). A few columns (a prefill chunk's short last
 * group of queries) are scattered into a zeroed buffer; more go through the in-register transpose
 * (amx_qt_transpose). */
static inline void amx_build_qt(int c, const uint16_t* const cols[16], int ncols, uint32_t* buf) {
    if (ncols > 4) {
        amx_qt_transpose(c, cols, ncols, buf);
    } else {
        const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(16)); /* element (r, n) is buf[16 r + n] */
        for (int r = 0; r < 16; r++) _mm512_store_si512((void*)(buf + 16 * r), _mm512_setzero_si512());
        for (int n = 0; n < ncols; n++)
            _mm512_i32scatter_epi32((void*)(buf + n), rows, _mm512_loadu_si512((const void*)(cols[n] + 32 * c)), 4);
    }
    amx_load_qt(c, buf);
}

/* 1 when the CPU has AMX-TILE and AMX-BF16 (CPUID.(EAX=7,ECX=0):EDX bits 24 and 22) and Linux lets this
 * process use the tile state; else 0. Exported once, as amx_supported (amx_linear.c). */
static inline int amx_request_tiles(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#endif
