/* What the CPU kernels' files share (cpu_linear.c: the linear layer in every weight format;
   cpu_kernels.c: the small ops, the decoder stack; cpu_attention.c: paged attention): the vector
   width, the weight formats, exp, and the entry points they call in one another. */

#ifndef PAGESERVE_CPU_KERNELS_H
#define PAGESERVE_CPU_KERNELS_H

#include <stddef.h>
#include <stdlib.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define PS_AVX2 1
#endif
/* AVX-512 (F, BW, VL): 16 floats a register where the compiler targets it (-march=native on a
   CPU that has it); AVX512-BF16 adds the bfloat16 dot product (vdpbf16ps) */
#if defined(PS_AVX2) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PS_AVX512 1
#endif
#if defined(PS_AVX512) && defined(__AVX512BF16__)
#define PS_AVX512_BF16 1
#endif
/* AMX (Sapphire Rapids and later): tile registers of 16 rows of 64 bytes, and TDPBF16PS, a
   16 x 16 block of float32 sums of 32 bfloat16 products each in one instruction
   (cpu_linear_bf16.c's panels); used once Linux grants the process its tile state (amx_ready) */
#if defined(PS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PS_AMX_BF16 1
#endif
#if defined(PS_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef PS_AMX_BF16
/* dst[16][16] = src[16][16]^T, 32-bit values (rows of src lds apart): what TDPBF16PS takes as
   pairs along a row, from pairs along a column */
static inline void transpose16(const uint32_t *src, long lds, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * lds);
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane, 2 x 2 blocks of 32 bits... */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* ... then 4 x 4: lane L of r[i + j], column 4L + j of rows i..i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* the lanes gathered across the four groups of rows */
        __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
        __m512i w0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
        _mm512_storeu_si512(dst + j * 16, _mm512_shuffle_i32x4(v0, w0, 0x88));
        _mm512_storeu_si512(dst + (8 + j) * 16, _mm512_shuffle_i32x4(v0, w0, 0xDD));
        _mm512_storeu_si512(dst + (4 + j) * 16, _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_storeu_si512(dst + (12 + j) * 16, _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
}

/* 1 where this process may use the tile registers (asked of Linux once), else 0 */
int amx_ready(void);

/* this thread's tiles 0..n-1 as 16 rows of 64 bytes (the palette every AMX CPU has) */
static inline void amx_tiles(int n) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < n; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}
#endif

#ifdef PS_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif
#ifdef PS_AVX512
static inline __m256 add_halves(__m512 v) { /* lanes i and i + 8 added */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline float hsum16(__m512 v) { return hsum8(add_halves(v)); }
#endif

/* f rounded to a bfloat16 value, as vcvtneps2bf16 rounds: to nearest even, a denormal to zero,
   a NaN kept a NaN. With bfloat16 arithmetic (W_DOT16) every kernel rounds its outputs so, where
   torch's bfloat16 ops round theirs. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000) == 0)
        u &= 0x80000000;
    else if ((u & 0x7FFFFFFF) > 0x7F800000)
        u |= 0x00400000;
    else
        u += 0x7FFF + ((u >> 16) & 1);
    u &= 0xFFFF0000;
    memcpy(&f, &u, 4);
    return f;
}

/* A matrix's format (the `wtype` of pageserve_linear): float32; bfloat16 (a float32 model's
   matrices kept at half the bytes where every value's low 16 bits are zero); or blocks of 32
   values. GGUF's, kept as the file holds them: Q8_0 (f16 scale d, 32 int8: d * q), Q4_0 (d, 16
   bytes of nibbles: d * (q - 8)), Q4_1 (d, f16 offset m, nibbles: d * q + m). A quantized
   checkpoint's (cpu_blocks.py packs them), each with a float32 scale s first: I8 (32 int8:
   q * s), F8 (32 float8 e4m3fn codes: q * s; a NaN code widens to a NaN), I4 (a zero point
   byte z, then nibbles: (q - z) * s), F4 (two float32 scales, s0 for values 0-15 and s1 for
   16-31, then nibbles, each an FP4 e2m1 code: e2m1(q) * s, NVFP4's groups of 16), N4 (a scale,
   then nibbles, each a NormalFloat4 code: nf4(q) * s, bitsandbytes' 4-bit); and GGUF's K-quants
   repacked 32 values a block: K4 (Q4_K's sub-block: scale d and offset m as float32, then
   nibbles: d * q - m, d * q exact), K6 (Q6_K's: two float32 scales, one for each 16 values, then
   32 int8 codes: q * s), K5 (Q5_K's sub-block: d and m, then 32 uint8 codes: d * q - m); and X8
   (two float32 scales s0, s1 and two offsets m0, m1, one of each for values 0-15 and 16-31, then
   32 int8 codes: s * q - m), which holds the values of every GGUF format above, for a fused
   matrix whose parts the file keeps in different ones; K3 (two float32 scales, s0 for values 0-15
   and s1 for 16-31, then nibbles: (q - 8) * s, Q3_K's and the TQ types' codes) and L4 (a float32
   scale, then nibbles, each an index into IQ4_NL's 16 int8 values: iq4nl(q) * s, IQ4_NL's and
   IQ4_XS's), 4-bit forms of GGUF types the others hold at a byte a code; and H16 (32 half
   floats: a float16 checkpoint's or a GGUF F16 matrix's values, exactly). The low
   nibbles of a block are its values 0-15, the high ones 16-31. A value is widened to the float32 that its dequantizer computes (GGUF's own; for
   the others the float32 product above), each product and sum rounded once, so every sum is
   that of the dequantized float32 matrix, to the bit. */
/* the block formats: W_Q8_0 and up */
enum { W_F32 = 0, W_BF16 = 1, W_Q8_0 = 2, W_Q4_0 = 3, W_Q4_1 = 4, W_I8 = 5, W_F8 = 6, W_I4 = 7, W_F4 = 8, W_N4 = 9,
       W_K4 = 10, W_K6 = 11, W_K5 = 12, W_X8 = 13, W_K3 = 14, W_L4 = 15, W_H16 = 16 };
/* or'ed into a format: multiply in bfloat16 (cpu_linear_bf16.c) rather than float32 */
enum { W_DOT16 = 32 };

/* bytes of one block of 32 values */
static inline long block_bytes(int wtype) {
    switch (wtype & ~W_DOT16) {
    case W_Q8_0: return 34;
    case W_Q4_0: return 18;
    case W_Q4_1: return 20;
    case W_I4: return 21;
    case W_F4: return 24;
    case W_N4: return 20;
    case W_K4: return 24;
    case W_K6: return 40;
    case W_K5: return 40;
    case W_X8: return 48;
    case W_K3: return 24;
    case W_L4: return 20;
    case W_H16: return 64;
    default: return 36; /* W_I8, W_F8 */
    }
}

/* elements (bytes for the block formats) from one row of a contiguous K-column matrix to the next */
static inline long row_stride(int wtype, long K) {
    return (wtype & ~W_DOT16) >= W_Q8_0 ? K / 32 * block_bytes(wtype) : K;
}

#ifdef PS_AVX2
/* exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial,
   the power of two put into the exponent bits); within 2 ulp of expf over [-87, 88]. Vectorised
   because libm's scalar expf made SiLU-and-mul much slower than torch's (docs/performance.md) */
#define DEFINE_EXP(NAME, V, P, SI, FLOOR)                                                               \
    static inline V NAME(V x) {                                                                         \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                         \
        V fx = FLOOR(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(0.5f)));            \
        x = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                            \
        x = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), x);                                         \
        V y = P##_set1_ps(1.9875691500e-4f);                                                            \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                          \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                          \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                          \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                          \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                          \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)));                        \
        return P##_mul_ps(y, P##_castsi##SI##_ps(P##_slli_epi32(                                        \
                                 P##_add_epi32(P##_cvtps_epi32(fx), P##_set1_epi32(127)), 23)));       \
    }
DEFINE_EXP(exp8, __m256, _mm256, 256, _mm256_floor_ps)
#ifdef PS_AVX512
#define FLOOR16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
DEFINE_EXP(exp16, __m512, _mm512, 512, FLOOR16) /* the same values as exp8's, lane for lane */
#endif
#endif

/* dot (a . b) and axpy (y += a * x) with the second operand of element type T, read 8 at a time
   by LOAD8 (where the build has AVX2) and one at a time by GET: float32 here, a bfloat16 KV
   cache's in cpu_attention.c */
#ifdef PS_AVX2
#define IF_AVX2(...) __VA_ARGS__
#else
#define IF_AVX2(...)
#endif
#define DEFINE_DOT_AXPY(DOT, AXPY, T, LOAD8, GET)                                                          \
    static inline float DOT(const float *a, const T *b, long n) {                                          \
        long i = 0;                                                                                        \
        float s = 0.0f;                                                                                    \
        IF_AVX2(__m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;                                            \
                for (; i + 16 <= n; i += 16) {                                                             \
                    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOAD8(b + i), acc0);                    \
                    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), LOAD8(b + i + 8), acc1);            \
                }                                                                                          \
                for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOAD8(b + i), acc0); \
                s = hsum8(_mm256_add_ps(acc0, acc1));)                                                     \
        for (; i < n; i++) s += a[i] * GET(b[i]);                                                          \
        return s;                                                                                          \
    }                                                                                                      \
    static inline void AXPY(float *y, float a, const T *x, long n) {                                       \
        long i = 0;                                                                                        \
        IF_AVX2(__m256 av = _mm256_set1_ps(a);                                                             \
                for (; i + 8 <= n; i += 8)                                                                 \
                    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, LOAD8(x + i), _mm256_loadu_ps(y + i)));)   \
        for (; i < n; i++) y[i] += a * GET(x[i]);                                                          \
    }
#define AS_FLOAT(v) (v)
DEFINE_DOT_AXPY(dot, axpy, float, _mm256_loadu_ps, AS_FLOAT)

int pageserve_paged_decode(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                           void *k_cache, void *v_cache, const int64_t *slots, const int32_t *block_tables,
                           long ld_bt, const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                           float scale, float *out, int r16, int kv_format);
int pageserve_linear(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                     const float *bias, float *y, long ldy);
int pageserve_linear_bf16(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                          const float *bias, float *y, long ldy);
int pageserve_linear_packed(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                            const void *packed, const float *bias, float *y, long ldy);

#endif
