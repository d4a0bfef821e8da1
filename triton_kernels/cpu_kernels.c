/* Float32 kernels of the CPU path, built at first use by cpu_kernels.py with the machine's own
   -march: the linear layer, and the small ops of a decoder layer (RMSNorm with the residual,
   rotary embedding, SiLU-and-mul), each one call where torch runs 3-20 small ops; attention
   of decode-only steps straight from the paged cache; and a Llama-style model's whole decoder
   stack for a decode-only step in one call (the interpreter's time between ~300 kernel calls
   a step was a third of one stream's step).

   Linear: y[R, O] = x[R, K] @ W[O, K]^T (+ bias). torch's float32 matmul (MKL sgemm) reads the weights at 11-15 GB/s for one row of x on a
   2-core machine that streams 25-33 GB/s, and does not use the second core: a decode step of
   one request spends most of its time there. This kernel streams each weight row once per
   block of x rows, six weight rows at a time, both cores splitting the output features.

   Register tile: 6 weight rows x 2 x rows, 8 floats wide (AVX2 + FMA), summed across the
   vector at the end; a scalar loop does the same where the compiler has no AVX2. Each output
   is a plain float32 dot product over K: no precision is traded. */

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

#define TILE_O 6
/* weight rows a thread takes at a time: dynamic scheduling in pieces this size, so that a
   thread the OS has paused (the server's event loop shares the cores) holds up only one piece */
#define CHUNK_O 64
#define WIDEN_ROWS 8

#ifdef PS_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* Weights in bfloat16 (the checkpoint's own values, kept at half the bytes where every
   float32 weight's low 16 bits are zero): each is widened to float32 as it is loaded, an
   exact conversion, so the sums are the float32 kernel's to the bit and one stream reads
   half the bytes per step. */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
/* element i of a weight array in float32 (w16: the array is bfloat16) */
static inline float wval(const void *w, long i, int w16) {
    return w16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#ifdef PS_AVX2
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* sums over k < k8 of TILE_O weight rows (w, rows ldw apart) against NR rows of x (ldx apart):
   TILE_O x NR accumulators (of the tiles timed on a 2-core EPYC, 4x2, 4x3, 3x4, 2x6, 5x2, 6x2,
   7x2, 8x2 and 5x3, 6x2 and 7x2 were the fastest: 109 GFLOP/s at 32 rows where 4x2 made 79).
   WT, LOAD: the weights' element type and its load as 8 floats. */
#define MICRO_TILE(NAME, NR, WT, LOAD)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *x, long ldx, const WT *w, long ldw, \
                                                           long k8, float s[TILE_O][2]) {              \
        __m256 a[TILE_O][NR];                                                                           \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++)                                        \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) a[i][r] = _mm256_setzero_ps();         \
        for (long k = 0; k < k8; k += 8) {                                                              \
            __m256 xv[NR];                                                                              \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k); \
            _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {                                  \
                __m256 wv = LOAD(w + i * ldw + k);                                                      \
                _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) a[i][r] = _mm256_fmadd_ps(wv, xv[r], a[i][r]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++)                                        \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) s[i][r] = hsum8(a[i][r]);              \
    }
MICRO_TILE(micro_1, 1, float, load_f32)
MICRO_TILE(micro_2, 2, float, load_f32)
MICRO_TILE(micro16_1, 1, uint16_t, load_bf16)
MICRO_TILE(micro16_2, 2, uint16_t, load_bf16)
#endif

/* ---- weight formats: float32, bfloat16, and GGUF's block formats, widened as they are read ---- */

/* A matrix's format (the `wtype` of pageserve_linear): float32; bfloat16 (a float32 model's
   matrices kept at half the bytes where every value's low 16 bits are zero); or one of GGUF's
   blocks of 32 values, kept as the file holds them: Q8_0 (f16 scale d, 32 int8: d * q), Q4_0
   (d, 16 bytes of nibbles: d * (q - 8)), Q4_1 (d, f16 offset m, nibbles: d * q + m); the low
   nibbles of a block are its values 0-15, the high ones 16-31. A value is widened to the
   float32 that GGUF's own dequantizer computes (one product, one sum, each rounded as
   numpy's float32 does), so every sum is that of the dequantized float32 matrix, to the bit. */
enum { W_F32 = 0, W_BF16 = 1, W_Q8_0 = 2, W_Q4_0 = 3, W_Q4_1 = 4 };

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

/* bytes of one block of 32 values */
static inline long block_bytes(int wtype) { return wtype == W_Q8_0 ? 34 : wtype == W_Q4_0 ? 18 : 20; }

/* elements (bytes for the block formats) from one row of a contiguous K-column matrix to the next */
static inline long row_stride(int wtype, long K) { return wtype >= W_Q8_0 ? K / 32 * block_bytes(wtype) : K; }

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

#ifdef PS_AVX2
/* The 32 values of one block in four registers (values 0-7, 8-15, 16-23, 24-31). d * q is
   exact in float32 (an 11-bit mantissa times a 4- or 8-bit integer), so Q4_1's fma(d, q, m)
   rounds once where numpy rounds d * q + m twice, the first time exactly: the same value. */
static inline __attribute__((always_inline)) void widen_block(const uint8_t *blk, int wtype, __m256 v[4]) {
    __m256 d, m = _mm256_setzero_ps();
#ifdef __F16C__
    if (wtype == W_Q4_1) { /* d and m converted together */
        uint32_t dm;
        memcpy(&dm, blk, 4);
        __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        d = _mm256_broadcastss_ps(both);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
    } else {
        d = _mm256_set1_ps(f16_to_f32(load_u16(blk)));
    }
#else
    d = _mm256_set1_ps(f16_to_f32(load_u16(blk)));
    if (wtype == W_Q4_1) m = _mm256_set1_ps(f16_to_f32(load_u16(blk + 2)));
#endif
    if (wtype == W_Q8_0) {
        for (int g = 0; g < 4; g++)
            v[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * g)))), d);
        return;
    }
    /* bytes 0-7 and 8-15 zero-extended to 32 bits: their low nibbles are values 0-15, their
       high nibbles 16-31 (two byte shuffles a block, not ten) */
    const uint8_t *qs = blk + (wtype == W_Q4_1 ? 4 : 2);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i n[4] = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask), _mm256_srli_epi32(a, 4),
                    _mm256_srli_epi32(b, 4)};
    if (wtype == W_Q4_0) {
        for (int g = 0; g < 4; g++) v[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[g], _mm256_set1_epi32(8))));
    } else {
        for (int g = 0; g < 4; g++) v[g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[g]), m);
    }
}

/* row1 of a block format, each block widened in registers: the same four accumulators over
   the same values as row1 of the widened row, so the same sums (K is a multiple of 32) */
static inline __attribute__((always_inline)) void row1_blocks_of(const float *x, long K, const uint8_t *W, long ldw,
                                                                 long o0, long o1, const float *bias, float *y,
                                                                 int wtype) {
    long bb = block_bytes(wtype);
    for (long o = o0; o < o1; o++) {
        const uint8_t *w = W + o * ldw;
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (long b = 0; b < K / 32; b++) {
            __m256 v[4];
            widen_block(w + b * bb, wtype, v);
            for (int g = 0; g < 4; g++) a[g] = _mm256_fmadd_ps(v[g], _mm256_loadu_ps(x + 32 * b + 8 * g), a[g]);
        }
        y[o] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + (bias ? bias[o] : 0.0f);
    }
}

static void row1_blocks(const float *x, long K, const uint8_t *W, long ldw, long o0, long o1, const float *bias,
                        float *y, int wtype) {
    switch (wtype) { /* one copy per format, the format's branches gone */
    case W_Q8_0: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_Q8_0); break;
    case W_Q4_0: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_Q4_0); break;
    default: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_Q4_1);
    }
}
#endif

/* K values of one weight row in float32 (K a multiple of 32 for the block formats) */
static void widen_row(const void *src, int wtype, long K, float *out) {
    if (wtype == W_F32) {
        for (long k = 0; k < K; k++) out[k] = ((const float *)src)[k];
        return;
    }
    if (wtype == W_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        long k = 0;
#ifdef PS_AVX2
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, load_bf16(s + k));
#endif
        for (; k < K; k++) out[k] = bf16_to_f32(s[k]);
        return;
    }
    long bb = block_bytes(wtype);
    for (long b = 0; b < K / 32; b++) {
        const uint8_t *blk = (const uint8_t *)src + b * bb;
        float *o = out + b * 32;
#ifdef PS_AVX2
        __m256 v[4];
        widen_block(blk, wtype, v);
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(o + 8 * g, v[g]);
#else
        float d = f16_to_f32(load_u16(blk)), m = wtype == W_Q4_1 ? f16_to_f32(load_u16(blk + 2)) : 0.0f;
        if (wtype == W_Q8_0) {
            for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[2 + j] * d;
        } else {
            const uint8_t *q = blk + (wtype == W_Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                int lo = q[j] & 0x0F, hi = q[j] >> 4;
                o[j] = wtype == W_Q4_0 ? d * (float)(lo - 8) : d * (float)lo + m;
                o[j + 16] = wtype == W_Q4_0 ? d * (float)(hi - 8) : d * (float)hi + m;
            }
        }
#endif
    }
}

/* rows 0..R-1 of W (any format, rows ldw apart) into out [R, K] float32 */
void pageserve_widen(const void *W, int wtype, long R, long K, long ldw, float *out) {
#pragma omp parallel for if (R * K >= (1L << 16)) schedule(static)
    for (long r = 0; r < R; r++) widen_row(weight_row(W, wtype, ldw, r), wtype, K, out + r * K);
}

/* weight rows o0..o0+no-1 (no <= TILE_O; wt: row o0, rows ldw apart) against every row of x,
   two x rows at a time */
static void tile(const float *x, long R, long K, long ldx, const void *wt, int w16, long ldw, long o0,
                 long no, const float *bias, float *y, long ldy) {
    long k8 = 0;
#ifdef PS_AVX2
    if (no == TILE_O) k8 = K & ~7L; /* a partial tile (the last of a matrix) runs the scalar loop */
    const float *w = (const float *)wt;
    const uint16_t *w_16 = (const uint16_t *)wt;
#endif
    for (long r = 0; r < R; r += 2) {
        long nr = R - r < 2 ? R - r : 2;
        const float *x0 = x + r * ldx;
        float s[TILE_O][2] = {{0.0f}};
#ifdef PS_AVX2
        if (k8) {
            if (w16)
                nr == 2 ? micro16_2(x0, ldx, w_16, ldw, k8, s) : micro16_1(x0, ldx, w_16, ldw, k8, s);
            else
                nr == 2 ? micro_2(x0, ldx, w, ldw, k8, s) : micro_1(x0, ldx, w, ldw, k8, s);
        }
#endif
        for (long i = 0; i < no; i++)
            for (long j = 0; j < nr; j++) {
                float v = s[i][j];
                for (long k = k8; k < K; k++) v += wval(wt, i * ldw + k, w16) * x0[j * ldx + k];
                y[(r + j) * ldy + o0 + i] = v + (bias ? bias[o0 + i] : 0.0f);
            }
    }
}

#ifdef PS_AVX2
/* one row of x: each weight row read front to back, four accumulators */
#define ROW1(NAME, WT, LOAD)                                                                            \
    static void NAME(const float *x, long K, const WT *W, long ldw, long o0, long o1, const float *bias, \
                     float *y) {                                                                        \
        long k32 = K & ~31L, k8 = K & ~7L;                                                              \
        for (long o = o0; o < o1; o++) {                                                                \
            const WT *w = W + o * ldw;                                                                  \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                 \
            long k = 0;                                                                                 \
            for (; k < k32; k += 32) {                                                                  \
                a0 = _mm256_fmadd_ps(LOAD(w + k), _mm256_loadu_ps(x + k), a0);                          \
                a1 = _mm256_fmadd_ps(LOAD(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);                  \
                a2 = _mm256_fmadd_ps(LOAD(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);                \
                a3 = _mm256_fmadd_ps(LOAD(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);                \
            }                                                                                           \
            for (; k < k8; k += 8) a0 = _mm256_fmadd_ps(LOAD(w + k), _mm256_loadu_ps(x + k), a0);       \
            float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));               \
            for (; k < K; k++) s += wval(w, k, sizeof(WT) == 2) * x[k];                                 \
            y[o] = s + (bias ? bias[o] : 0.0f);                                                         \
        }                                                                                               \
    }
ROW1(row1, float, load_f32)
ROW1(row1_16, uint16_t, load_bf16)
#endif

/* one row of x against one float32 weight row w: y[0] (+ bias[0]) */
static inline void one_row(const float *x, long K, const float *w, const float *bias, float *y) {
#ifdef PS_AVX2
    row1(x, K, w, K, 0, 1, bias, y);
#else
    tile(x, 1, K, K, w, 0, K, 0, 1, bias, y, 1);
#endif
}

static inline float *aligned_floats(long n) { /* on cache lines: at malloc's 16 bytes half the
                                                 loads straddle two lines (13% slower at 64 rows) */
    return (float *)aligned_alloc(64, (sizeof(float) * (size_t)n + 63) & ~(size_t)63);
}

/* x: [R, K] rows ldx apart; W: [O, K] in format wtype (W_F32 ...), rows ldw elements apart
   (bytes for the block formats); y: [R, O] rows ldy apart; bias: [O] or NULL. Weight rows are
   shared out to the OpenMP threads (torch's own runtime: libgomp is loaded by torch before
   this library). Returns 1 if a block format's widening buffer could not be had (y is then
   not all written), else 0. */
int pageserve_linear(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                     const float *bias, float *y, long ldy) {
    int failed = 0;
#ifdef PS_AVX2
    if (R == 1 && wtype <= W_BF16) {
        long chunks = (O + CHUNK_O - 1) / CHUNK_O;
#pragma omp parallel for schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long o0 = c * CHUNK_O, o1 = o0 + CHUNK_O < O ? o0 + CHUNK_O : O;
            if (wtype == W_BF16)
                row1_16(x, K, (const uint16_t *)W, ldw, o0, o1, bias, y);
            else
                row1(x, K, (const float *)W, ldw, o0, o1, bias, y);
        }
        return 0;
    }
#endif
#ifdef PS_AVX2
    if (R == 1) { /* a block format: each block widened in registers */
        long chunks = (O + CHUNK_O - 1) / CHUNK_O;
#pragma omp parallel for schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long o0 = c * CHUNK_O, o1 = o0 + CHUNK_O < O ? o0 + CHUNK_O : O;
            row1_blocks(x, K, (const uint8_t *)W, ldw, o0, o1, bias, y, wtype);
        }
        return 0;
    }
#endif
    if (R == 1 && wtype >= W_Q8_0) { /* each weight row widened into this thread's copy, then read */
        long chunks = (O + CHUNK_O - 1) / CHUNK_O;
#pragma omp parallel
        {
            float *row = aligned_floats(K);
            if (row == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (long c = 0; c < chunks; c++) {
                long o0 = c * CHUNK_O, o1 = o0 + CHUNK_O < O ? o0 + CHUNK_O : O;
                for (long o = o0; row != NULL && o < o1; o++) {
                    widen_row(weight_row(W, wtype, ldw, o), wtype, K, row);
                    one_row(x, K, row, bias ? bias + o : NULL, y + o);
                }
            }
            free(row);
        }
        return failed;
    }
    long tiles = (O + TILE_O - 1) / TILE_O;
#pragma omp parallel
    {
        /* block formats, and bfloat16 at WIDEN_ROWS rows or more: each tile's weight rows are
           widened once into this thread's float32 copy, then read for every row of x as
           float32 weights are (bfloat16 widened in the inner loop cost 7% at 64 rows). Without
           the memory, bfloat16 widens in the inner loop; a block format cannot. */
        int widen = wtype >= W_Q8_0 || (wtype == W_BF16 && R >= WIDEN_ROWS);
        float *wide = widen ? aligned_floats(TILE_O * K) : NULL;
        if (widen && wide == NULL && wtype >= W_Q8_0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 16)
        for (long t = 0; t < tiles; t++) {
            long o0 = t * TILE_O, no = O - o0 < TILE_O ? O - o0 : TILE_O;
            if (wide) {
                for (long i = 0; i < no; i++) widen_row(weight_row(W, wtype, ldw, o0 + i), wtype, K, wide + i * K);
                tile(x, R, K, ldx, wide, W_F32, K, o0, no, bias, y, ldy);
            } else if (wtype <= W_BF16) {
                tile(x, R, K, ldx, weight_row(W, wtype, ldw, o0), wtype, ldw, o0, no, bias, y, ldy);
            }
        }
        free(wide);
    }
    return failed;
}

/* ---- the small ops of a decoder layer: one call each instead of 3-20 torch ops ---- */

#define PAR_ROWS 16 /* a step of fewer rows runs on one thread: starting the team costs more */

/* RMSNorm fused with the residual add. x, residual (or NULL), out, res_out: [T, H] rows ldx,
   ldr, ldo, ldo apart. res_out = x + residual (x when there is none); out = w * res_out *
   rsqrt(mean(res_out^2) + eps). out may alias x, res_out may alias residual (each element
   is read before it is written); the decoder stack below relies on the second. */
void pageserve_rms_norm(const float *x, long ldx, const float *residual, long ldr, const float *w,
                        float eps, long T, long H, float *out, float *res_out, long ldo) {
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *rr = res_out + t * ldo, *orow = out + t * ldo;
        float ss = 0.0f;
        for (long i = 0; i < H; i++) {
            float v = residual ? xr[i] + residual[t * ldr + i] : xr[i];
            rr[i] = v;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (long i = 0; i < H; i++) orow[i] = w[i] * (rr[i] * inv);
    }
}

/* Neox-style RoPE in place on x: [T, heads, D], token rows ld_t apart, heads D apart; cs:
   [T, D] rows ld_cs apart, cos of the D/2 frequencies then their sin. */
void pageserve_rotary(float *x, long T, long heads, long ld_t, long D, const float *cs, long ld_cs) {
    long half = D / 2;
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *c = cs + t * ld_cs, *s = c + half;
        for (long h = 0; h < heads; h++) {
            float *x1 = x + t * ld_t + h * D, *x2 = x1 + half;
            for (long i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

#ifdef PS_AVX2
/* exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial,
   the power of two put into the exponent bits); within 2 ulp of expf over [-87, 88], where
   libm's scalar expf made SiLU-and-mul 5x slower than torch's vectorised one */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* out[T, I] = silu(x[:, :I]) * x[:, I:], x rows ldx apart */
void pageserve_silu_and_mul(const float *x, long ldx, long T, long I, float *out) {
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * I;
        long i = 0;
#ifdef PS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- paged attention for decode-only steps: read K/V where they lie in the cache ---- */

static inline float dot(const float *a, const float *b, long n) {
    long i = 0;
    float s = 0.0f;
#ifdef PS_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, long n) { /* y += a * x */
    long i = 0;
#ifdef PS_AVX2
    __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#ifdef PS_AVX2
/* four dot products of q against rows k, k + D, k + 2D, k + 3D (D a multiple of 8), one
   accumulator each, reduced together */
static inline __m128 dot4(const float *q, const float *k, long D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long i = 0; i < D; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + i), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* The attention of one request's G query heads (q: G rows of D) that share one KV head
   (k, v: that head's rows in block 0 of the cache; a block is `tok` floats) over its L cached
   positions. s: scratch of G * L floats; acc: G rows of D out. */
static void decode_item(const float *q, const float *k, const float *v, const int32_t *bt, long L,
                        long G, long D, long block_size, long tok, float scale, float *s, float *acc) {
    float mx[64], sum[64]; /* G <= 64 */
    for (long g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.0f; }
    for (long j0 = 0; j0 < L; j0 += block_size) { /* scores, a cache block at a time: s[g * L + j] */
        const float *kb = k + (long)bt[j0 / block_size] * tok;
        long n = L - j0 < block_size ? L - j0 : block_size;
        for (long g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float *sg = s + g * L + j0;
            long j = 0;
#ifdef PS_AVX2
            if (D % 8 == 0)
                for (; j + 4 <= n; j += 4)
                    _mm_storeu_ps(sg + j, _mm_mul_ps(dot4(qg, kb + j * D, D), _mm_set1_ps(scale)));
#endif
            for (; j < n; j++) sg[j] = dot(qg, kb + j * D, D) * scale;
        }
    }
    for (long g = 0; g < G; g++) { /* exp(s - max) and its sum, then the probabilities */
        float *sg = s + g * L;
        for (long j = 0; j < L; j++) mx[g] = sg[j] > mx[g] ? sg[j] : mx[g];
        long j = 0;
#ifdef PS_AVX2
        __m256 m = _mm256_set1_ps(mx[g]), tot = _mm256_setzero_ps();
        for (; j + 8 <= L; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m));
            _mm256_storeu_ps(sg + j, e);
            tot = _mm256_add_ps(tot, e);
        }
        sum[g] = hsum8(tot);
#endif
        for (; j < L; j++) {
            sg[j] = expf(sg[j] - mx[g]);
            sum[g] += sg[j];
        }
        float inv = 1.0f / sum[g];
        for (j = 0; j < L; j++) sg[j] *= inv;
    }
    for (long i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (long j0 = 0; j0 < L; j0 += block_size) { /* out += P V, a cache block at a time: each V row */
        const float *vb = v + (long)bt[j0 / block_size] * tok; /* is read from memory once for the G heads */
        long n = L - j0 < block_size ? L - j0 : block_size;
        for (long g = 0; g < G; g++) {
            const float *pg = s + g * L + j0;
            float *ag = acc + g * D;
            long d0 = 0;
#ifdef PS_AVX2
            for (; d0 + 64 <= D; d0 += 64) { /* 64 floats of the head in registers over the block */
                __m256 o[8];
                for (int r = 0; r < 8; r++) o[r] = _mm256_loadu_ps(ag + d0 + 8 * r);
                for (long j = 0; j < n; j++) {
                    __m256 p = _mm256_set1_ps(pg[j]);
                    const float *vr = vb + j * D + d0;
                    for (int r = 0; r < 8; r++) o[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * r), o[r]);
                }
                for (int r = 0; r < 8; r++) _mm256_storeu_ps(ag + d0 + 8 * r, o[r]);
            }
#endif
            if (d0 < D) /* the rest of the head (all of it without AVX2) */
                for (long j = 0; j < n; j++) axpy(ag + d0, pg[j], vb + j * D + d0, D - d0);
        }
    }
}

/* 1 when built with AVX2 and FMA (the vectorised paths), else 0 */
int pageserve_vectorized(void) {
#ifdef PS_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Paged attention of any step, straight from the cache blocks. First the step's new K/V
   ([T, Hkv, D], token rows ld_kv apart) are written at their slots (a negative slot writes
   nothing); then each query token attends, causally, to its own position and every one before
   it: for token t of request b, softmax(q . K^T * scale) V over the first L positions of b's
   context, L = its position + 1, in float32 (a max pass, an exp-and-sum pass, a normalising
   pass, as torch's softmax, then the weighted sum; exp is exp8's polynomial, within 2 ulp;
   scores four keys at a time). query_start_loc [B + 1]: request b's query tokens are rows
   query_start_loc[b] .. query_start_loc[b + 1] - 1, the last of its seq_lens[b] positions;
   NULL: one token per request (a decode step, T = B). Returns 1 if scratch memory for the
   scores could not be had (the output is then not to be used), else 0.
   q: [T, H, D] token rows ld_q apart; caches: [blocks, Hkv, block_size, D] contiguous;
   block_tables: [B, ld_bt] int32; out: [T, H, D] contiguous. A work item is one token's G =
   H / Hkv query heads that share a KV head: their K/V rows are read once from memory. A prompt
   chunk's tokens are items of their own, so the triangle above the causal diagonal is never
   computed (torch's SDPA with a mask computes the whole square). */
int pageserve_paged_attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                              float *k_cache, float *v_cache, const int64_t *slots, long T,
                              const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                              const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                              float scale, float *out) {
    long G = H / Hkv, tok = Hkv * block_size * D; /* floats per cache block */
    long max_len = 1;
    for (long b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    for (long t = 0; t < T; t++) {
        if (slots[t] < 0) continue; /* a padding row: writes nowhere */
        long blk = slots[t] / block_size, off = slots[t] % block_size;
        for (long h = 0; h < Hkv; h++) {
            float *kd = k_cache + blk * tok + (h * block_size + off) * D;
            float *vd = v_cache + blk * tok + (h * block_size + off) * D;
            for (long i = 0; i < D; i++) {
                kd[i] = k_new[t * ld_kv + h * D + i];
                vd[i] = v_new[t * ld_kv + h * D + i];
            }
        }
    }
    int failed = 0;
#pragma omp parallel if (T * Hkv > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(max_len * G)); /* this thread's scores */
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < T * Hkv; item++) {
            long t = item / Hkv, hk = item % Hkv, b = t, L;
            if (s == NULL) continue;
            if (query_start_loc == NULL) {
                L = seq_lens[b];
            } else { /* the request whose rows hold t: the last b with query_start_loc[b] <= t */
                long lo = 0, hi = B - 1;
                while (lo < hi) {
                    long mid = (lo + hi + 1) / 2;
                    if (query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
                }
                b = lo;
                L = seq_lens[b] - (query_start_loc[b + 1] - 1 - t);
            }
            decode_item(q + t * ld_q + hk * G * D, k_cache + hk * block_size * D, v_cache + hk * block_size * D,
                        block_tables + b * ld_bt, L, G, D, block_size, tok, scale, s, out + t * H * D + hk * G * D);
        }
        free(s);
    }
    return failed;
}

/* pageserve_paged_attention of a decode step: one query token per request (T = B) */
int pageserve_paged_decode(const float *q, long ld_q, const float *k_new, const float *v_new,
                            long ld_kv, float *k_cache, float *v_cache, const int64_t *slots,
                            const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B,
                            long H, long Hkv, long D, long block_size, float scale, float *out) {
    return pageserve_paged_attention(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, B, block_tables,
                                     ld_bt, NULL, seq_lens, B, H, Hkv, D, block_size, scale, out);
}

/* ---- a decode-only step's whole decoder stack in one call (Llama-style layers) ---- */

/* The layers of a model whose every layer is: RMSNorm (with the residual), fused q/k/v
   (+ bias), Neox RoPE, paged attention, o_proj, RMSNorm (with the residual), fused gate/up,
   SiLU-and-mul, down; then the final RMSNorm. Each piece is the function above that the
   layer-by-layer path calls, in the same order on the same values, so the output is the
   same to the bit; what goes is the interpreter's time between them.
   x: [T, Hd] the embeddings (T decode tokens, one per request); out: [T, Hd] the final normed
   hidden states. w: per layer 7 pointers (input norm, qkv weight, qkv bias or NULL, o_proj,
   post-attention norm, gate_up, down), the norms and the bias float32; wtypes: per layer the
   formats of the four matrices (contiguous rows); kv: per layer the K and V caches; cs: [T, D]
   rows ld_cs apart (cos then sin). Returns 1 if scratch memory (the attention's, a block
   format's widening) could not be had, else 0. */
int pageserve_decode_layers(const float *x, long T, long Hd, long L, const void *const *w, const int *wtypes,
                            float *const *kv, const float *final_norm, float eps, const float *cs, long ld_cs,
                            const int64_t *slots, const int32_t *block_tables, long ld_bt,
                            const int32_t *seq_lens, long H, long Hkv, long D, long I, long block_size,
                            float scale, float *scratch, float *out) {
    long QKV = (H + 2 * Hkv) * D;
    /* scratch, T * (3 Hd + QKV + H D + 3 I) floats: residual, normed, layer out, qkv, attention
       out, gate_up, activation (the caller's, kept across steps: a fresh buffer of a few MB
       would be fresh pages, faulted in on every step) */
    float *res = scratch, *h = res + T * Hd, *y = h + T * Hd, *qkv = y + T * Hd, *attn = qkv + T * QKV,
          *gu = attn + T * H * D, *act = gu + T * 2 * I;
    int failed = 0;
    for (long l = 0; l < L && !failed; l++) {
        const void *const *lw = w + 7 * l;
        const int *ft = wtypes + 4 * l;
        if (l == 0)
            pageserve_rms_norm(x, Hd, NULL, 0, lw[0], eps, T, Hd, h, res, Hd);
        else
            pageserve_rms_norm(y, Hd, res, Hd, lw[0], eps, T, Hd, h, res, Hd);
        if ((failed = pageserve_linear(h, T, Hd, Hd, lw[1], ft[0], QKV, row_stride(ft[0], Hd), lw[2], qkv, QKV)))
            break;
        pageserve_rotary(qkv, T, H, QKV, D, cs, ld_cs);
        pageserve_rotary(qkv + H * D, T, Hkv, QKV, D, cs, ld_cs);
        failed = pageserve_paged_decode(qkv, QKV, qkv + H * D, qkv + (H + Hkv) * D, QKV, kv[2 * l], kv[2 * l + 1],
                                        slots, block_tables, ld_bt, seq_lens, T, H, Hkv, D, block_size, scale, attn);
        failed = failed || pageserve_linear(attn, T, H * D, H * D, lw[3], ft[1], Hd, row_stride(ft[1], H * D), NULL,
                                            y, Hd);
        if (failed) break;
        pageserve_rms_norm(y, Hd, res, Hd, lw[4], eps, T, Hd, h, res, Hd);
        if ((failed = pageserve_linear(h, T, Hd, Hd, lw[5], ft[2], 2 * I, row_stride(ft[2], Hd), NULL, gu, 2 * I)))
            break;
        pageserve_silu_and_mul(gu, 2 * I, T, I, act);
        failed = pageserve_linear(act, T, I, I, lw[6], ft[3], Hd, row_stride(ft[3], I), NULL, y, Hd);
    }
    if (!failed) pageserve_rms_norm(y, Hd, res, Hd, final_norm, eps, T, Hd, out, res, Hd);
    return failed;
}
