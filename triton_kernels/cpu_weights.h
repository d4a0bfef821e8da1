/* Reading the weight formats (cpu_kernels.h's W_*), shared by the two linear layers
   (cpu_linear.c: float32 arithmetic; cpu_linear_bf16.c: bfloat16 arithmetic): each value widened
   to the float32 that GGUF's own dequantizer (or the checkpoint) gives, and how a matrix's rows
   are shared out to the threads. */

#ifndef PAGESERVE_CPU_WEIGHTS_H
#define PAGESERVE_CPU_WEIGHTS_H

#include "cpu_kernels.h"
#include <omp.h>

/* one row of x: bytes ahead of the weight row's read that are asked for (a software prefetch;
   past a matrix's end it is a hint that fetches nothing, never a fault), because the hardware's
   own prefetch restarts at every piece of every matrix (docs/performance.md) */
#ifndef PREFETCH
#define PREFETCH 4096
#endif

/* weight rows a thread takes at a time: dynamic scheduling in pieces this size, so that a
   thread the OS has paused (the server's event loop shares the cores) holds up only one piece.
   At one row of x the hardware's prefetch starts over at each piece, so pieces are long: 128
   rows beat 64 (docs/performance.md). Fewer where a matrix would not give every thread two
   pieces (piece_rows). */
#define CHUNK_O 128

/* Weights in bfloat16 (the checkpoint's own values, kept at half the bytes where every
   float32 weight's low 16 bits are zero): each is widened to float32 as it is loaded, an
   exact conversion, so the sums are the float32 kernel's to the bit and one stream reads
   half the bytes per step. */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

#ifdef PS_AVX2
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000 | (man << 13); /* inf, nan */
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3FF) << 13);
    } else {
        u = sign;
    }
    union { uint32_t u; float f; } v = {u};
    return v.f;
#endif
}

/* row o of W: rows ldw elements apart (bytes for the block formats) */
static inline const void *weight_row(const void *W, int wtype, long ldw, long o) {
    long unit = wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1;
    return (const uint8_t *)W + o * ldw * unit;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* a block's float32 scale (cpu_kernels.h's I8, F8, I4) */
static inline float f32_at(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* the 16 bits of a half float that is e4m3fn code b divided by 256, exactly (its exponent field
   moved into the half's, whose bias is 8 more; subnormals included); a NaN for a NaN code (0x7F,
   0xFF), whose bits moved so would read 1.875 */
static inline uint16_t f8_half_bits(uint8_t b) {
    return (b & 0x7F) == 0x7F ? (uint16_t)((b & 0x80) << 8 | 0x7F80) : (uint16_t)((b & 0x80) << 8 | (b & 0x7F) << 7);
}

/* the values of the 16 FP4 e2m1 codes (sign, two exponent bits, one mantissa bit) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* bitsandbytes' NormalFloat4 values, each a float32 */
static const float NF4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                              -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                              0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                              0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                              0.7229568362236023f, 1.0f};

/* the 16 values of GGUF's IQ4_NL and IQ4_XS codes (ggml's kvalues_iq4nl) */
static const float IQ4NL[16] = {-127.0f, -104.0f, -83.0f, -65.0f, -49.0f, -35.0f, -22.0f, -10.0f,
                                1.0f, 13.0f, 25.0f, 38.0f, 53.0f, 69.0f, 89.0f, 113.0f};

/* one block's 32 values, one at a time (the builds without AVX2) */
static inline void widen_block_scalar(const uint8_t *blk, int wtype, float *o) {
    if (wtype == W_H16) {
        for (int j = 0; j < 32; j++) o[j] = f16_to_f32(load_u16(blk + 2 * j));
        return;
    }
    if (wtype == W_K4) { /* d * q is exact: one rounding, fused or not */
        float d = f32_at(blk), m = f32_at(blk + 4);
        for (int j = 0; j < 16; j++) {
            o[j] = d * (float)(blk[8 + j] & 0x0F) - m;
            o[j + 16] = d * (float)(blk[8 + j] >> 4) - m;
        }
        return;
    }
    if (wtype == W_K5) { /* as K4, a byte a code */
        float d = f32_at(blk), m = f32_at(blk + 4);
        for (int j = 0; j < 32; j++) o[j] = d * (float)blk[8 + j] - m;
        return;
    }
    if (wtype == W_X8) { /* s * q exact where m is not zero (the formats with offsets): one rounding */
        for (int j = 0; j < 32; j++) o[j] = f32_at(blk + 4 * (j >> 4)) * (float)(int8_t)blk[16 + j] - f32_at(blk + 8 + 4 * (j >> 4));
        return;
    }
    if (wtype == W_K6) {
        float s0 = f32_at(blk), s1 = f32_at(blk + 4);
        for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[8 + j] * (j < 16 ? s0 : s1);
        return;
    }
    if (wtype == W_N4 || wtype == W_L4) {
        const float *table = wtype == W_N4 ? NF4 : IQ4NL;
        float s = f32_at(blk);
        for (int j = 0; j < 16; j++) {
            o[j] = table[blk[4 + j] & 0x0F] * s;
            o[j + 16] = table[blk[4 + j] >> 4] * s;
        }
        return;
    }
    if (wtype == W_K3) {
        float s0 = f32_at(blk), s1 = f32_at(blk + 4);
        for (int j = 0; j < 16; j++) {
            o[j] = (float)((blk[8 + j] & 0x0F) - 8) * s0;
            o[j + 16] = (float)((blk[8 + j] >> 4) - 8) * s1;
        }
        return;
    }
    if (wtype == W_F4) {
        float s0 = f32_at(blk), s1 = f32_at(blk + 4);
        for (int j = 0; j < 16; j++) {
            o[j] = E2M1[blk[8 + j] & 0x0F] * s0;
            o[j + 16] = E2M1[blk[8 + j] >> 4] * s1;
        }
        return;
    }
    if (wtype >= W_I8) {
        float s = f32_at(blk);
        if (wtype == W_I8) {
            for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[4 + j] * s;
        } else if (wtype == W_F8) {
            float s256 = 256.0f * s; /* exact: (q / 256) * (256 s) is q * s, rounded once */
            for (int j = 0; j < 32; j++) o[j] = f16_to_f32(f8_half_bits(blk[4 + j])) * s256;
        } else {
            int z = blk[4];
            for (int j = 0; j < 16; j++) {
                o[j] = (float)((blk[5 + j] & 0x0F) - z) * s;
                o[j + 16] = (float)((blk[5 + j] >> 4) - z) * s;
            }
        }
        return;
    }
    float d = f16_to_f32(load_u16(blk)), m = wtype == W_Q4_1 ? f16_to_f32(load_u16(blk + 2)) : 0.0f;
    if (wtype == W_Q8_0) {
        for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[2 + j] * d;
        return;
    }
    const uint8_t *q = blk + (wtype == W_Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        int lo = q[j] & 0x0F, hi = q[j] >> 4;
        o[j] = wtype == W_Q4_0 ? d * (float)(lo - 8) : d * (float)lo + m;
        o[j + 16] = wtype == W_Q4_0 ? d * (float)(hi - 8) : d * (float)hi + m;
    }
}

#ifdef PS_AVX2
#ifdef __F16C__
/* 16 e4m3fn codes as f8_half_bits gives them: the sign-extended byte shifted left 7 holds the
   sign at bit 15 and the code's other bits at 7-13 (bit 14, a copy of the sign, cleared); adding
   1 at bit 7 carries into bit 14 for a NaN code alone, whose half it makes a NaN */
static inline __m256i f8_halves(__m128i bytes) {
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16((short)0xBF80));
    __m256i nan = _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x80)), _mm256_set1_epi16(0x4000));
    return _mm256_or_si256(h, nan);
}
#endif

/* The 32 values of one block in four registers (values 0-7, 8-15, 16-23, 24-31). d * q is
   exact in float32 (an 11-bit mantissa times a 4- or 8-bit integer), so Q4_1's fma(d, q, m)
   rounds once where numpy rounds d * q + m twice, the first time exactly: the same value. */
static inline __attribute__((always_inline)) void widen_block(const uint8_t *blk, int wtype, __m256 v[4]) {
    __m256 d, m = _mm256_setzero_ps();
#ifdef __F16C__
    if (wtype == W_H16) { /* F16C's conversion is exact */
        for (int g = 0; g < 4; g++) v[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * g)));
        return;
    }
#else
    if (wtype == W_H16 || wtype == W_F8) { /* half floats without F16C: one value at a time */
        float o[32];
        widen_block_scalar(blk, wtype, o);
        for (int g = 0; g < 4; g++) v[g] = _mm256_loadu_ps(o + 8 * g);
        return;
    }
#endif
    if (wtype >= W_I8) {
        d = _mm256_set1_ps(f32_at(blk));
    }
#ifdef __F16C__
    else if (wtype == W_Q4_1) { /* d and m converted together */
        uint32_t dm;
        memcpy(&dm, blk, 4);
        __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        d = _mm256_broadcastss_ps(both);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
    } else {
        d = _mm256_set1_ps(f16_to_f32(load_u16(blk)));
    }
#else
    else {
        d = _mm256_set1_ps(f16_to_f32(load_u16(blk)));
        if (wtype == W_Q4_1) m = _mm256_set1_ps(f16_to_f32(load_u16(blk + 2)));
    }
#endif
    if (wtype == W_K5) { /* d * q exact (q < 32), minus m: one rounding */
        __m256 m5 = _mm256_set1_ps(f32_at(blk + 4));
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 + 8 * g)))), m5);
        return;
    }
    if (wtype == W_X8) { /* values 0-15: s0 and m0; 16-31: s1 and m1 */
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_fmsub_ps(_mm256_set1_ps(f32_at(blk + (g < 2 ? 0 : 4))),
                                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * g)))),
                                   _mm256_set1_ps(f32_at(blk + (g < 2 ? 8 : 12))));
        return;
    }
    if (wtype == W_Q8_0 || wtype == W_I8 || wtype == W_K6) {
        const uint8_t *q = blk + (wtype == W_I8 ? 4 : wtype == W_K6 ? 8 : 2);
        __m256 d1 = wtype == W_K6 ? _mm256_set1_ps(f32_at(blk + 4)) : d; /* K6: values 16-31's scale */
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * g)))),
                                 g < 2 ? d : d1);
        return;
    }
#ifdef __F16C__
    if (wtype == W_F8) {
        d = _mm256_mul_ps(d, _mm256_set1_ps(256.0f)); /* exact: (q / 256) * (256 s) is q * s, rounded once */
        for (int h = 0; h < 2; h++) {
            __m256i halves = f8_halves(_mm_loadu_si128((const __m128i *)(blk + 4 + 16 * h)));
            v[2 * h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), d);
            v[2 * h + 1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), d);
        }
        return;
    }
#endif
    /* bytes 0-7 and 8-15 zero-extended to 32 bits: their low nibbles are values 0-15, their
       high nibbles 16-31 (two byte shuffles a block, not ten) */
    const uint8_t *qs = blk + (wtype == W_Q4_1 || wtype == W_N4 || wtype == W_L4 ? 4 : wtype == W_I4 ? 5
                               : wtype == W_F4 || wtype == W_K4 || wtype == W_K3 ? 8 : 2);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i n[4] = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask), _mm256_srli_epi32(a, 4),
                    _mm256_srli_epi32(b, 4)};
    if (wtype == W_K4) { /* d * q exact, minus m: one rounding */
        __m256 m4 = _mm256_set1_ps(f32_at(blk + 4));
        for (int g = 0; g < 4; g++) v[g] = _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(n[g]), m4);
    } else if (wtype == W_N4 || wtype == W_L4) { /* the table's halves by a code's low 3 bits, chosen by its bit 3 (moved to 31) */
        const float *table = wtype == W_N4 ? NF4 : IQ4NL;
        const __m256 lo = _mm256_loadu_ps(table), hi = _mm256_loadu_ps(table + 8);
        for (int g = 0; g < 4; g++) {
            __m256 val = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, n[g]), _mm256_permutevar8x32_ps(hi, n[g]),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(n[g], 28)));
            v[g] = _mm256_mul_ps(val, d);
        }
    } else if (wtype == W_F4) { /* a code's magnitude from the table by its low 3 bits, its sign bit moved to 31 */
        const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
        for (int g = 0; g < 4; g++) {
            __m256 val = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, n[g]),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(n[g], _mm256_set1_epi32(8)), 28)));
            v[g] = _mm256_mul_ps(val, _mm256_set1_ps(f32_at(blk + (g < 2 ? 0 : 4))));
        }
    } else if (wtype == W_K3) { /* values 0-15: s0; 16-31: s1 */
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(n[g], _mm256_set1_epi32(8))),
                                 _mm256_set1_ps(f32_at(blk + (g < 2 ? 0 : 4))));
    } else if (wtype == W_Q4_0 || wtype == W_I4) {
        __m256i zero = _mm256_set1_epi32(wtype == W_I4 ? blk[4] : 8);
        for (int g = 0; g < 4; g++) v[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[g], zero)));
    } else {
        for (int g = 0; g < 4; g++) v[g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[g]), m);
    }
}
#endif

#ifdef PS_AVX512
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* one block's 32 values in two registers, those of widen_block: a 4-bit block's nibbles index
   the table of the 16 values they stand for (vpermps reads the low 4 bits of each index) */
static inline __attribute__((always_inline)) void widen_block16(const uint8_t *blk, int wtype, __m512 v[2]) {
    if (wtype == W_H16) {
        v[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        v[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        return;
    }
    if (wtype == W_K5) {
        __m512 d = _mm512_set1_ps(f32_at(blk)), m = _mm512_set1_ps(f32_at(blk + 4));
        for (int g = 0; g < 2; g++)
            v[g] = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8 + 16 * g)))), m);
        return;
    }
    if (wtype == W_X8) {
        for (int g = 0; g < 2; g++)
            v[g] = _mm512_fmsub_ps(_mm512_set1_ps(f32_at(blk + 4 * g)),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * g)))),
                                   _mm512_set1_ps(f32_at(blk + 8 + 4 * g)));
        return;
    }
    if (wtype == W_Q8_0 || wtype == W_I8 || wtype == W_K6) {
        __m512 d = _mm512_set1_ps(wtype == W_Q8_0 ? f16_to_f32(load_u16(blk)) : f32_at(blk));
        __m512 d1 = wtype == W_K6 ? _mm512_set1_ps(f32_at(blk + 4)) : d; /* K6: values 16-31's scale */
        const uint8_t *q = blk + (wtype == W_I8 ? 4 : wtype == W_K6 ? 8 : 2);
        for (int g = 0; g < 2; g++)
            v[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * g)))),
                                 g ? d1 : d);
        return;
    }
    if (wtype == W_F8) { /* as f8_halves, 32 at once (h | (h + 0x80) & 0x4000 in one ternary op) */
        __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 4)));
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16((short)0xBF80));
        h = _mm512_ternarylogic_epi32(h, _mm512_add_epi16(h, _mm512_set1_epi16(0x80)), _mm512_set1_epi16(0x4000), 0xF8);
        __m512 d = _mm512_set1_ps(256.0f * f32_at(blk));
        v[0] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), d);
        v[1] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), d);
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if (wtype == W_Q4_1) {
        uint32_t dm;
        memcpy(&dm, blk, 4);
        __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        table = _mm512_fmadd_ps(_mm512_broadcastss_ps(both), iota, _mm512_broadcastss_ps(_mm_movehdup_ps(both)));
    } else if (wtype == W_I4) {
        table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps((float)blk[4])), _mm512_set1_ps(f32_at(blk)));
    } else if (wtype == W_K4) { /* d * i exact, minus m */
        table = _mm512_fmsub_ps(_mm512_set1_ps(f32_at(blk)), iota, _mm512_set1_ps(f32_at(blk + 4)));
    } else if (wtype == W_N4 || wtype == W_L4) {
        table = _mm512_mul_ps(_mm512_loadu_ps(wtype == W_N4 ? NF4 : IQ4NL), _mm512_set1_ps(f32_at(blk)));
    } else if (wtype == W_F4 || wtype == W_K3) { /* a table for each half's scale */
        __m512 codes = wtype == W_F4 ? _mm512_loadu_ps(E2M1) : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8)));
        v[0] = _mm512_permutexvar_ps(q, _mm512_mul_ps(codes, _mm512_set1_ps(f32_at(blk))));
        v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), _mm512_mul_ps(codes, _mm512_set1_ps(f32_at(blk + 4))));
        return;
    } else {
        table = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(load_u16(blk))), _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i *)(blk + (wtype == W_Q4_1 || wtype == W_N4 || wtype == W_L4 ? 4 : wtype == W_I4 ? 5
                                                 : wtype == W_K4 ? 8 : 2))));
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}
#endif

/* n units of work in two pieces a thread: the units of a piece (at least 1) */
static inline long two_a_thread(long n) {
    long threads = omp_get_max_threads(), per = (n + 2 * threads - 1) / (2 * threads);
    return per < 1 ? 1 : per;
}

/* rows of a piece at one row of x: CHUNK_O, or fewer so that O rows make at least two pieces a
   thread (a 576-row matrix is 5 pieces of 128: on 16 threads most would wait), at least 16 */
static inline long piece_rows(long O) {
    long rows = two_a_thread(O);
    return rows > CHUNK_O ? CHUNK_O : rows < 16 ? 16 : rows;
}

static inline float *aligned_floats(long n) { /* on cache lines: at malloc's 16 bytes half the
                                                 loads straddle two lines (docs/performance.md) */
    return (float *)aligned_alloc(64, (sizeof(float) * (size_t)n + 63) & ~(size_t)63);
}

/* K values of one weight row in float32 (K a multiple of 32 for the block formats) */
void widen_row(const void *src, int wtype, long K, float *out);

#endif
