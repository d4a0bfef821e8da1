/* The linear layer of the CPU path in C: y[R, O] = x[R, K] @ W[O, K]^T (+ bias), the weights in
   float32, bfloat16 or blocks of 32 values (cpu_kernels.h). torch's float32 matmul reads the
   weights well below the machine's bandwidth for one row of x and leaves the second core idle,
   and a decode step of one request spends most of its time there (docs/performance.md).
   This kernel streams each weight row once per block of x rows, six weight rows at a time,
   both cores splitting the output features.

   Register tile: 6 weight rows x 2 x rows, 8 floats wide (AVX2 + FMA), summed across the
   vector at the end; a scalar loop does the same where the compiler has no AVX2. From 16 rows
   of x, panels of x instead (linear_panels). Each output is a plain float32 dot product over
   K: no precision is traded. */

#include "cpu_weights.h"

#define TILE_O 6
#define WIDEN_ROWS 8


/* element i of a weight array in float32 (w16: the array is bfloat16) */
static inline float wval(const void *w, long i, int w16) {
    return w16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#ifdef PS_AVX2
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

/* sums over k < kv (a multiple of the vector width) of TILE_O weight rows (w, rows ldw apart)
   against NR rows of x (ldx apart): TILE_O x NR accumulators (6x2: the fastest of the tiles
   timed, docs/performance.md). WT, LOAD: the weights' element type and its load as a
   vector of floats; V, N, VOP: the vector type, its width, its intrinsics' prefix; HSUM. */
#define MICRO_TILE(NAME, NR, WT, LOAD, V, N, VOP, HSUM)                                                 \
    static inline __attribute__((always_inline)) void NAME(const float *x, long ldx, const WT *w, long ldw, \
                                                           long kv, float s[TILE_O][2]) {              \
        V a[TILE_O][NR];                                                                                \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++)                                        \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) a[i][r] = VOP##_setzero_ps();          \
        for (long k = 0; k < kv; k += N) {                                                              \
            V xv[NR];                                                                                   \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) xv[r] = VOP##_loadu_ps(x + r * ldx + k); \
            _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {                                  \
                V wv = LOAD(w + i * ldw + k);                                                           \
                _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) a[i][r] = VOP##_fmadd_ps(wv, xv[r], a[i][r]); \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++)                                        \
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) s[i][r] = HSUM(a[i][r]);               \
    }
#if defined(PS_AVX512)
#define TILE_N 16
MICRO_TILE(micro_1, 1, float, _mm512_loadu_ps, __m512, 16, _mm512, hsum16)
MICRO_TILE(micro_2, 2, float, _mm512_loadu_ps, __m512, 16, _mm512, hsum16)
MICRO_TILE(micro16_1, 1, uint16_t, load16_bf16, __m512, 16, _mm512, hsum16)
MICRO_TILE(micro16_2, 2, uint16_t, load16_bf16, __m512, 16, _mm512, hsum16)
#else
#define TILE_N 8
MICRO_TILE(micro_1, 1, float, load_f32, __m256, 8, _mm256, hsum8)
MICRO_TILE(micro_2, 2, float, load_f32, __m256, 8, _mm256, hsum8)
MICRO_TILE(micro16_1, 1, uint16_t, load_bf16, __m256, 8, _mm256, hsum8)
MICRO_TILE(micro16_2, 2, uint16_t, load_bf16, __m256, 8, _mm256, hsum8)
#endif
#endif




#ifdef PS_AVX2

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
            _mm_prefetch((const char *)w + b * bb + PREFETCH, _MM_HINT_T0);
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
    case W_I8: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_I8); break;
    case W_F8: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_F8); break;
    case W_I4: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_I4); break;
    case W_F4: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_F4); break;
    case W_N4: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_N4); break;
    case W_K4: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_K4); break;
    case W_K6: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_K6); break;
    case W_K5: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_K5); break;
    case W_X8: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_X8); break;
    case W_K3: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_K3); break;
    case W_L4: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_L4); break;
    case W_H16: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_H16); break;
    default: row1_blocks_of(x, K, W, ldw, o0, o1, bias, y, W_Q4_1); /* W_Q4_1 */
    }
}
#endif

#ifdef PS_AVX512
/* AVX-512: 16 floats a register. One row of x sums each output in four accumulators (values
   k mod 64 in 0-15, 16-31, 32-47, 48-63; the last 32 and 16 of a row in the first ones),
   whatever the format, so that a block format's sums are those of its widened row to the bit. */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }


#define ACC4_STEP(a, w, k, LOAD)                                                                        \
    a[0] = _mm512_fmadd_ps(LOAD((w) + (k)), _mm512_loadu_ps(x + (k)), a[0]);                            \
    a[1] = _mm512_fmadd_ps(LOAD((w) + (k) + 16), _mm512_loadu_ps(x + (k) + 16), a[1]);                  \
    a[2] = _mm512_fmadd_ps(LOAD((w) + (k) + 32), _mm512_loadu_ps(x + (k) + 32), a[2]);                  \
    a[3] = _mm512_fmadd_ps(LOAD((w) + (k) + 48), _mm512_loadu_ps(x + (k) + 48), a[3]);
#define ACC4_SUM(a) hsum16(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])))
#define ACC4_END(a, w, o, LOAD, W16)                                                                    \
    {                                                                                                   \
        long k = k64;                                                                                   \
        if (k + 32 <= K) {                                                                              \
            a[0] = _mm512_fmadd_ps(LOAD((w) + k), _mm512_loadu_ps(x + k), a[0]);                        \
            a[1] = _mm512_fmadd_ps(LOAD((w) + k + 16), _mm512_loadu_ps(x + k + 16), a[1]);              \
            k += 32;                                                                                    \
        }                                                                                               \
        if (k + 16 <= K) {                                                                              \
            a[0] = _mm512_fmadd_ps(LOAD((w) + k), _mm512_loadu_ps(x + k), a[0]);                        \
            k += 16;                                                                                    \
        }                                                                                               \
        float s = ACC4_SUM(a);                                                                          \
        for (; k < K; k++) s += wval(w, k, W16) * x[k];                                                 \
        y[o] = s + (bias ? bias[o] : 0.0f);                                                             \
    }
/* rows o0..o1-1 of float32 or bfloat16 weights, four rows a quarter of the piece apart at once
   (four streams from memory), the rest one at a time */
#define ROW1_512(NAME, WT, LOAD)                                                                        \
    static void NAME(const float *x, long K, const WT *W, long ldw, long o0, long o1, const float *bias, \
                     float *y) {                                                                        \
        long k64 = K & ~63L, q = (o1 - o0) / 4;                                                         \
        for (long o = o0; o < o0 + q; o++) {                                                            \
            const WT *w[4];                                                                             \
            __m512 a[4][4];                                                                             \
            for (int r = 0; r < 4; r++) {                                                               \
                w[r] = W + (o + r * q) * ldw;                                                           \
                for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_ps();                              \
            }                                                                                           \
            for (long k = 0; k < k64; k += 64) {                                                        \
                ACC4_STEP(a[0], w[0], k, LOAD)                                                          \
                ACC4_STEP(a[1], w[1], k, LOAD)                                                          \
                ACC4_STEP(a[2], w[2], k, LOAD)                                                          \
                ACC4_STEP(a[3], w[3], k, LOAD)                                                          \
            }                                                                                           \
            for (int r = 0; r < 4; r++) ACC4_END(a[r], w[r], o + r * q, LOAD, sizeof(WT) == 2)          \
        }                                                                                               \
        for (long o = o0 + 4 * q; o < o1; o++) {                                                        \
            const WT *w = W + o * ldw;                                                                  \
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
            for (long k = 0; k < k64; k += 64) {                                                        \
                _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);                            \
                ACC4_STEP(a, w, k, LOAD)                                                                \
            }                                                                                           \
            ACC4_END(a, w, o, LOAD, sizeof(WT) == 2)                                                    \
        }                                                                                               \
    }
ROW1_512(row1_512, float, load16_f32)
ROW1_512(row1_16_512, uint16_t, load16_bf16)
/* h16 blocks as the float16 rows they are (K a multiple of 32: the bfloat16 tail never runs):
   the block path's sums, in the same accumulators, read as four streams */
static inline __m512 load16_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
ROW1_512(row1_h16_512, uint16_t, load16_f16)

/* row1 of a block format: two blocks (64 values) into the four accumulators at a time */
static inline __attribute__((always_inline)) void row1_blocks512_of(const float *x, long K, const uint8_t *W,
                                                                    long ldw, long o0, long o1, const float *bias,
                                                                    float *y, int wtype) {
    long bb = block_bytes(wtype), nb = K / 32;
    for (long o = o0; o < o1; o++) {
        const uint8_t *w = W + o * ldw;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        long b = 0;
        for (; b + 2 <= nb; b += 2) {
            __m512 v[2], u[2];
            _mm_prefetch((const char *)w + b * bb + PREFETCH, _MM_HINT_T0);
            widen_block16(w + b * bb, wtype, v);
            widen_block16(w + (b + 1) * bb, wtype, u);
            a[0] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(x + 32 * b), a[0]);
            a[1] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(x + 32 * b + 16), a[1]);
            a[2] = _mm512_fmadd_ps(u[0], _mm512_loadu_ps(x + 32 * b + 32), a[2]);
            a[3] = _mm512_fmadd_ps(u[1], _mm512_loadu_ps(x + 32 * b + 48), a[3]);
        }
        if (b < nb) {
            __m512 v[2];
            widen_block16(w + b * bb, wtype, v);
            a[0] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(x + 32 * b), a[0]);
            a[1] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(x + 32 * b + 16), a[1]);
        }
        y[o] = ACC4_SUM(a) + (bias ? bias[o] : 0.0f);
    }
}

static void row1_blocks512(const float *x, long K, const uint8_t *W, long ldw, long o0, long o1, const float *bias,
                           float *y, int wtype) {
    switch (wtype) {
    case W_Q8_0: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_Q8_0); break;
    case W_Q4_0: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_Q4_0); break;
    case W_I8: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_I8); break;
    case W_F8: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_F8); break;
    case W_I4: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_I4); break;
    case W_F4: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_F4); break;
    case W_N4: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_N4); break;
    case W_K4: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_K4); break;
    case W_K6: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_K6); break;
    case W_K5: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_K5); break;
    case W_X8: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_X8); break;
    case W_K3: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_K3); break;
    case W_L4: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_L4); break;
    case W_H16: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_H16); break;
    default: row1_blocks512_of(x, K, W, ldw, o0, o1, bias, y, W_Q4_1); /* W_Q4_1 */
    }
}
#endif

/* K values of one weight row in float32 (K a multiple of 32 for the block formats) */
void widen_row(const void *src, int wtype, long K, float *out) {
    if (wtype == W_F32) {
        for (long k = 0; k < K; k++) out[k] = ((const float *)src)[k];
        return;
    }
    if (wtype == W_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        long k = 0;
#ifdef PS_AVX512
        for (; k + 16 <= K; k += 16) _mm512_storeu_ps(out + k, load16_bf16(s + k));
#endif
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
#if defined(PS_AVX512)
        __m512 v[2];
        widen_block16(blk, wtype, v);
        _mm512_storeu_ps(o, v[0]);
        _mm512_storeu_ps(o + 16, v[1]);
#elif defined(PS_AVX2)
        __m256 v[4];
        widen_block(blk, wtype, v);
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(o + 8 * g, v[g]);
#else
        widen_block_scalar(blk, wtype, o);
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
    long k8 = 0; /* columns the vectors take: a multiple of their width */
#ifdef PS_AVX2
    if (no == TILE_O) k8 = K & ~(long)(TILE_N - 1); /* a partial tile (the last of a matrix) runs the scalar loop */
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
/* one row of x: each weight row read front to back into four accumulators (a: 32 floats of
   the row a step), finished the same way by every path below, so each output's sum is the
   same to the bit whichever path took it */
#define ROW_STEP(a, w, k, LOAD)                                                                         \
    a[0] = _mm256_fmadd_ps(LOAD((w) + (k)), _mm256_loadu_ps(x + (k)), a[0]);                            \
    a[1] = _mm256_fmadd_ps(LOAD((w) + (k) + 8), _mm256_loadu_ps(x + (k) + 8), a[1]);                    \
    a[2] = _mm256_fmadd_ps(LOAD((w) + (k) + 16), _mm256_loadu_ps(x + (k) + 16), a[2]);                  \
    a[3] = _mm256_fmadd_ps(LOAD((w) + (k) + 24), _mm256_loadu_ps(x + (k) + 24), a[3]);
/* the columns past the last whole 32 of one row, and its sum (+ bias) */
#define ROW_END(a, w, o, LOAD, W16)                                                                    \
    {                                                                                                   \
        long k = k32;                                                                                   \
        for (; k < k8; k += 8) a[0] = _mm256_fmadd_ps(LOAD((w) + k), _mm256_loadu_ps(x + k), a[0]);    \
        float s = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));           \
        for (; k < K; k++) s += wval(w, k, W16) * x[k];                                                 \
        y[o] = s + (bias ? bias[o] : 0.0f);                                                             \
    }
/* Rows o0..o1-1. Four rows a quarter of the piece apart are read together: four streams from
   memory at once read faster than one (docs/performance.md). The rest one at a time,
   prefetched. */
#define ROW1(NAME, WT, LOAD)                                                                            \
    static void NAME(const float *x, long K, const WT *W, long ldw, long o0, long o1, const float *bias, \
                     float *y) {                                                                        \
        long k32 = K & ~31L, k8 = K & ~7L, q = (o1 - o0) / 4;                                           \
        for (long o = o0; o < o0 + q; o++) {                                                            \
            const WT *w[4];                                                                             \
            __m256 a[4][4];                                                                             \
            for (int r = 0; r < 4; r++) {                                                               \
                w[r] = W + (o + r * q) * ldw;                                                           \
                for (int i = 0; i < 4; i++) a[r][i] = _mm256_setzero_ps();                              \
            }                                                                                           \
            for (long k = 0; k < k32; k += 32) {                                                        \
                ROW_STEP(a[0], w[0], k, LOAD)                                                           \
                ROW_STEP(a[1], w[1], k, LOAD)                                                           \
                ROW_STEP(a[2], w[2], k, LOAD)                                                           \
                ROW_STEP(a[3], w[3], k, LOAD)                                                           \
            }                                                                                           \
            for (int r = 0; r < 4; r++) ROW_END(a[r], w[r], o + r * q, LOAD, sizeof(WT) == 2)            \
        }                                                                                               \
        for (long o = o0 + 4 * q; o < o1; o++) {                                                        \
            const WT *w = W + o * ldw;                                                                  \
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
            for (long k = 0; k < k32; k += 32) {                                                        \
                _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);                            \
                ROW_STEP(a, w, k, LOAD)                                                                 \
            }                                                                                           \
            ROW_END(a, w, o, LOAD, sizeof(WT) == 2)                                                     \
        }                                                                                               \
    }
ROW1(row1, float, load_f32)
ROW1(row1_16, uint16_t, load_bf16)
#ifdef __F16C__
static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ROW1(row1_h16, uint16_t, load_f16) /* as row1_h16_512 */
#endif
#endif

/* one row of x against one float32 weight row w: y[0] (+ bias[0]) */
static inline void one_row(const float *x, long K, const float *w, const float *bias, float *y) {
#if defined(PS_AVX512)
    row1_512(x, K, w, K, 0, 1, bias, y);
#elif defined(PS_AVX2)
    row1(x, K, w, K, 0, 1, bias, y);
#else
    tile(x, 1, K, K, w, 0, K, 0, 1, bias, y, 1);
#endif
}


#ifdef PS_AVX2
/* Many rows of x (a batch of decodes, a prefill chunk): the register tile above re-reads six
   widened weight rows (36 KB at K = 1536, past L1) for every pair of x rows and sums each
   accumulator across its lanes at the end. Here x is copied once per call into panels of 16
   rows laid out k-major (xp[panel][k][16]), and each widened weight value is broadcast against
   two vectors of 16 rows: 6 x 16 outputs in twelve accumulators, one load of x per 16 rows, no
   sums across lanes (the BLIS shape for AVX2). Each output is one fma chain over k in order. */
#ifdef PS_AVX512 /* rows of x a panel holds: two registers' worth */
#define PANEL_X 32
#else
#define PANEL_X 16
#endif
#ifndef BIG_ROWS /* rows from which x is paneled: where the panels beat the register tile
                     above (docs/performance.md) */
#define BIG_ROWS 16
#endif

/* rows r0..r0+15 of x (zero past R) into xp[k][16] */
static void panel_x(const float *x, long R, long K, long ldx, long r0, float *xp) {
    for (long k0 = 0; k0 < K; k0 += 16) /* a cache line of each row at a time */
        for (long j = 0; j < PANEL_X; j++) {
            const float *row = r0 + j < R ? x + (r0 + j) * ldx : NULL;
            for (long k = k0; k < K && k < k0 + 16; k++) xp[k * PANEL_X + j] = row ? row[k] : 0.0f;
        }
}

/* y[r0 + j, o0 + i] for i < no, j < nr: TILE_O weight rows (w, rows ldw apart) against one
   panel of x */
static inline __attribute__((always_inline)) void panel_tile(const float *w, long ldw, const float *xp, long K,
                                                             long o0, long no, long r0, long nr, const float *bias,
                                                             float *y, long ldy) {
#ifdef PS_AVX512
    __m512 a[TILE_O][2];
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {
        __m512 x0 = _mm512_load_ps(xp + k * PANEL_X), x1 = _mm512_load_ps(xp + k * PANEL_X + 16);
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {
            __m512 b = _mm512_set1_ps(w[i * ldw + k]);
            a[i][0] = _mm512_fmadd_ps(b, x0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(b, x1, a[i][1]);
        }
    }
    float v[TILE_O][PANEL_X];
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {
        _mm512_storeu_ps(v[i], a[i][0]);
        _mm512_storeu_ps(v[i] + 16, a[i][1]);
    }
#else
    __m256 a[TILE_O][2];
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {
        __m256 x0 = _mm256_load_ps(xp + k * PANEL_X), x1 = _mm256_load_ps(xp + k * PANEL_X + 8);
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {
            __m256 b = _mm256_broadcast_ss(w + i * ldw + k);
            a[i][0] = _mm256_fmadd_ps(b, x0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(b, x1, a[i][1]);
        }
    }
    float v[TILE_O][PANEL_X]; /* stored with constant indices: the accumulators stay in registers */
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_O; i++) {
        _mm256_storeu_ps(v[i], a[i][0]);
        _mm256_storeu_ps(v[i] + 8, a[i][1]);
    }
#endif
    for (long i = 0; i < no; i++) {
        float add = bias ? bias[o0 + i] : 0.0f;
        for (long j = 0; j < nr; j++) y[(r0 + j) * ldy + o0 + i] = v[i][j] + add;
    }
}

static inline void prefetch_bytes(const void *p, long n) {
    for (long i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* pageserve_linear at R >= BIG_ROWS; returns 1 where memory for the copies could not be had
   (y is then not all written). A piece of work is a run of up to four tiles (24 columns of
   y). Where y's rows lie a multiple of 1 KB apart, a panel's 16 rows share at most 4 of the
   L1 cache's 64 sets (one set at 4 KB: 3072 or 49152 columns) and each tile's writes missed
   it: the run is summed into a scratch [R, run] and copied out. Each tile asks for the next
   one's weight rows ahead of its widening. Both gains: docs/performance.md. */
static int linear_panels(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                         const float *bias, float *y, long ldy) {
    long panels = (R + PANEL_X - 1) / PANEL_X, tiles = (O + TILE_O - 1) / TILE_O;
    long run_tiles = two_a_thread(tiles), run = (run_tiles < 4 ? run_tiles : 4) * TILE_O, runs = (O + run - 1) / run;
    int staged = ldy % 256 == 0;
    float *xp = aligned_floats(panels * K * PANEL_X);
    if (xp == NULL) return 1;
    int failed = 0;
#pragma omp parallel
    {
        float *wide = NULL; /* this thread's widened tile, had at its first need */
        float *stage = staged ? aligned_floats(R * run) : NULL;
        if (staged && stage == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) panel_x(x, R, K, ldx, p * PANEL_X, xp + p * K * PANEL_X);
#pragma omp for schedule(dynamic, 1)
        for (long c = 0; c < runs; c++) {
            long oc = c * run, nc = O - oc < run ? O - oc : run;
            float *out = staged ? stage : y + oc;
            long ldo = staged ? run : ldy;
            if (out == NULL) continue;
            int whole = 1; /* every tile of the run summed */
            for (long o0 = oc; o0 < oc + nc; o0 += TILE_O) {
                long no = O - o0 < TILE_O ? O - o0 : TILE_O;
                const float *w = wide;
                long lw = K;
                if (wtype == W_F32 && no == TILE_O) { /* read in place */
                    w = (const float *)W + o0 * ldw;
                    lw = ldw;
                } else if (wide != NULL || (w = wide = aligned_floats(TILE_O * K)) != NULL) {
                    /* widened; the rows of a last, partial tile zero */
                    for (long i = 0; i < no; i++) widen_row(weight_row(W, wtype, ldw, o0 + i), wtype, K, wide + i * K);
                    memset(wide + no * K, 0, sizeof(float) * (size_t)((TILE_O - no) * K));
                } else {
#pragma omp atomic write
                    failed = 1;
                    whole = 0;
                    break;
                }
                if (o0 + TILE_O < oc + nc) { /* the next tile's rows: read while this one is summed */
                    long end = oc + nc < o0 + 2 * TILE_O ? oc + nc : o0 + 2 * TILE_O;
                    const char *next = weight_row(W, wtype, ldw, o0 + TILE_O);
                    prefetch_bytes(next, (const char *)weight_row(W, wtype, ldw, end) - next);
                }
                for (long p = 0; p < panels; p++) { /* all of x: blocks of it were no faster */
                    long r0 = p * PANEL_X, nr = R - r0 < PANEL_X ? R - r0 : PANEL_X;
                    panel_tile(w, lw, xp + p * K * PANEL_X, K, o0 - oc, no, r0, nr, bias ? bias + oc : NULL, out,
                               ldo);
                }
            }
            if (staged && whole)
                for (long r = 0; r < R; r++) memcpy(y + r * ldy + oc, stage + r * run, sizeof(float) * (size_t)nc);
        }
        free(wide);
        free(stage);
    }
    free(xp);
    return failed;
}
#endif

/* x: [R, K] rows ldx apart; W: [O, K] in format wtype (W_F32 ...), rows ldw elements apart
   (bytes for the block formats); y: [R, O] rows ldy apart; bias: [O] or NULL. Weight rows are
   shared out to the OpenMP threads (torch's own runtime: libgomp is loaded by torch before
   this library). Returns 1 if scratch memory (a widening buffer, the panels of x) could not
   be had (y is then not all written), else 0. */
int pageserve_linear(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                     const float *bias, float *y, long ldy) {
    if (wtype & W_DOT16) return pageserve_linear_bf16(x, R, K, ldx, W, wtype, O, ldw, bias, y, ldy);
    int failed = 0;
#ifdef PS_AVX2
    if (R == 1) { /* every format; a block format's blocks widened in registers */
        long piece = piece_rows(O), chunks = (O + piece - 1) / piece;
#pragma omp parallel for schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long o0 = c * piece, o1 = o0 + piece < O ? o0 + piece : O;
#ifdef PS_AVX512
            if (wtype == W_BF16)
                row1_16_512(x, K, (const uint16_t *)W, ldw, o0, o1, bias, y);
            else if (wtype == W_F32)
                row1_512(x, K, (const float *)W, ldw, o0, o1, bias, y);
            else if (wtype == W_H16) /* (ldw: bytes) */
                row1_h16_512(x, K, (const uint16_t *)W, ldw / 2, o0, o1, bias, y);
            else
                row1_blocks512(x, K, (const uint8_t *)W, ldw, o0, o1, bias, y, wtype);
#else
            if (wtype == W_BF16)
                row1_16(x, K, (const uint16_t *)W, ldw, o0, o1, bias, y);
            else if (wtype == W_F32)
                row1(x, K, (const float *)W, ldw, o0, o1, bias, y);
#ifdef __F16C__
            else if (wtype == W_H16)
                row1_h16(x, K, (const uint16_t *)W, ldw / 2, o0, o1, bias, y);
#endif
            else
                row1_blocks(x, K, (const uint8_t *)W, ldw, o0, o1, bias, y, wtype);
#endif
        }
        return 0;
    }
#endif
    if (R == 1 && wtype >= W_Q8_0) { /* each weight row widened into this thread's copy, then read */
        long piece = piece_rows(O), chunks = (O + piece - 1) / piece;
#pragma omp parallel
        {
            float *row = aligned_floats(K);
            if (row == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (long c = 0; c < chunks; c++) {
                long o0 = c * piece, o1 = o0 + piece < O ? o0 + piece : O;
                for (long o = o0; row != NULL && o < o1; o++) {
                    widen_row(weight_row(W, wtype, ldw, o), wtype, K, row);
                    one_row(x, K, row, bias ? bias + o : NULL, y + o);
                }
            }
            free(row);
        }
        return failed;
    }
#ifdef PS_AVX2
    if (R >= BIG_ROWS) return linear_panels(x, R, K, ldx, W, wtype, O, ldw, bias, y, ldy);
#endif
    long tiles = (O + TILE_O - 1) / TILE_O;
#pragma omp parallel
    {
        /* block formats, and bfloat16 at WIDEN_ROWS rows or more: each tile's weight rows are
           widened once into this thread's float32 copy, then read for every row of x as
           float32 weights are (cheaper than widening in the inner loop). Without
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
