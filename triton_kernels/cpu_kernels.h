/* What the CPU kernels' two files share (cpu_linear.c: the linear layer in every weight format;
   cpu_kernels.c: the small ops, paged attention, the decoder stack): the vector width, the
   weight formats, and the linear's entry point. */

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
#if defined(PS_AVX2) || defined(__F16C__)
#include <immintrin.h>
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

/* A matrix's format (the `wtype` of pageserve_linear): float32; bfloat16 (a float32 model's
   matrices kept at half the bytes where every value's low 16 bits are zero); or one of GGUF's
   blocks of 32 values, kept as the file holds them: Q8_0 (f16 scale d, 32 int8: d * q), Q4_0
   (d, 16 bytes of nibbles: d * (q - 8)), Q4_1 (d, f16 offset m, nibbles: d * q + m); the low
   nibbles of a block are its values 0-15, the high ones 16-31. A value is widened to the
   float32 that GGUF's own dequantizer computes (one product, one sum, each rounded as
   numpy's float32 does), so every sum is that of the dequantized float32 matrix, to the bit. */
enum { W_F32 = 0, W_BF16 = 1, W_Q8_0 = 2, W_Q4_0 = 3, W_Q4_1 = 4 };

/* bytes of one block of 32 values */
static inline long block_bytes(int wtype) { return wtype == W_Q8_0 ? 34 : wtype == W_Q4_0 ? 18 : 20; }

/* elements (bytes for the block formats) from one row of a contiguous K-column matrix to the next */
static inline long row_stride(int wtype, long K) { return wtype >= W_Q8_0 ? K / 32 * block_bytes(wtype) : K; }

int pageserve_linear(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                     const float *bias, float *y, long ldy);

#endif
