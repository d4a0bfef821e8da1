/* y[R, O] = x[R, K] @ W[O, K]^T (+ bias) in float32, for the CPU path.

   torch's float32 matmul (MKL sgemm) reads the weights at 11-15 GB/s for one row of x on a
   2-core machine that streams 25-33 GB/s, and does not use the second core: a decode step of
   one request spends most of its time there. This kernel streams each weight row once per
   block of x rows, four weight rows at a time, both cores splitting the output features.

   Register tile: 4 weight rows x 2 x rows, 8 floats wide (AVX2 + FMA), summed across the
   vector at the end; a scalar loop does the same where the compiler has no AVX2. Each output
   is a plain float32 dot product over K: no precision is traded. Built at first use by
   cpu_linear.py with the machine's own -march. */

#include <stddef.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PS_AVX2 1
#endif

#define TILE_O 4
/* weight rows a thread takes at a time: dynamic scheduling in pieces this size, so that a
   thread the OS has paused (the server's event loop shares the cores) holds up only one piece */
#define CHUNK_O 64

#ifdef PS_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* rows o0..o0+no-1 (no <= TILE_O) of W against every row of x */
static void tile(const float *x, long R, long K, long ldx, const float *W, long ldw, long o0,
                 long no, const float *bias, float *y, long ldy) {
    const float *w[TILE_O];
    for (long i = 0; i < TILE_O; i++) w[i] = W + (o0 + (i < no ? i : 0)) * ldw;
    long r = 0;
#ifdef PS_AVX2
    long k8 = K & ~7L;
    for (; r + 1 < R; r += 2) {
        const float *x0 = x + r * ldx, *x1 = x0 + ldx;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
               a30 = a00, a31 = a00;
        for (long k = 0; k < k8; k += 8) {
            __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
            __m256 w0 = _mm256_loadu_ps(w[0] + k), w1 = _mm256_loadu_ps(w[1] + k);
            __m256 w2 = _mm256_loadu_ps(w[2] + k), w3 = _mm256_loadu_ps(w[3] + k);
            a00 = _mm256_fmadd_ps(w0, v0, a00); a01 = _mm256_fmadd_ps(w0, v1, a01);
            a10 = _mm256_fmadd_ps(w1, v0, a10); a11 = _mm256_fmadd_ps(w1, v1, a11);
            a20 = _mm256_fmadd_ps(w2, v0, a20); a21 = _mm256_fmadd_ps(w2, v1, a21);
            a30 = _mm256_fmadd_ps(w3, v0, a30); a31 = _mm256_fmadd_ps(w3, v1, a31);
        }
        float s[TILE_O][2] = {{hsum8(a00), hsum8(a01)}, {hsum8(a10), hsum8(a11)},
                              {hsum8(a20), hsum8(a21)}, {hsum8(a30), hsum8(a31)}};
        for (long i = 0; i < no; i++) {
            for (long k = k8; k < K; k++) {
                s[i][0] += w[i][k] * x0[k];
                s[i][1] += w[i][k] * x1[k];
            }
            float b = bias ? bias[o0 + i] : 0.0f;
            y[r * ldy + o0 + i] = s[i][0] + b;
            y[(r + 1) * ldy + o0 + i] = s[i][1] + b;
        }
    }
    for (; r < R; r++) {
        const float *x0 = x + r * ldx;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long k = 0; k < k8; k += 8) {
            __m256 v0 = _mm256_loadu_ps(x0 + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w[0] + k), v0, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w[1] + k), v0, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w[2] + k), v0, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w[3] + k), v0, a3);
        }
        float s[TILE_O] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
        for (long i = 0; i < no; i++) {
            for (long k = k8; k < K; k++) s[i] += w[i][k] * x0[k];
            y[r * ldy + o0 + i] = s[i] + (bias ? bias[o0 + i] : 0.0f);
        }
    }
#else
    for (; r < R; r++) {
        const float *x0 = x + r * ldx;
        for (long i = 0; i < no; i++) {
            float s = 0.0f;
            for (long k = 0; k < K; k++) s += w[i][k] * x0[k];
            y[r * ldy + o0 + i] = s + (bias ? bias[o0 + i] : 0.0f);
        }
    }
#endif
}

#ifdef PS_AVX2
/* one row of x: each weight row read front to back, four accumulators */
static void row1(const float *x, long K, const float *W, long ldw, long o0, long o1,
                 const float *bias, float *y) {
    long k32 = K & ~31L, k8 = K & ~7L;
    for (long o = o0; o < o1; o++) {
        const float *w = W + o * ldw;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        long k = 0;
        for (; k < k32; k += 32) {
            _mm_prefetch((const char *)(w + k + 512), _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
        }
        for (; k < k8; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < K; k++) s += w[k] * x[k];
        y[o] = s + (bias ? bias[o] : 0.0f);
    }
}
#endif

/* x: [R, K] rows ldx apart; W: [O, K] rows ldw apart; y: [R, O] rows ldy apart; bias: [O] or
   NULL. Weight rows are shared out to the OpenMP threads (torch's own runtime: libgomp is
   loaded by torch before this library). */
void pageserve_linear_f32(const float *x, long R, long K, long ldx, const float *W, long O,
                          long ldw, const float *bias, float *y, long ldy) {
#ifdef PS_AVX2
    if (R == 1) {
        long chunks = (O + CHUNK_O - 1) / CHUNK_O;
#pragma omp parallel for schedule(dynamic, 1)
        for (long c = 0; c < chunks; c++) {
            long o0 = c * CHUNK_O, o1 = o0 + CHUNK_O < O ? o0 + CHUNK_O : O;
            row1(x, K, W, ldw, o0, o1, bias, y);
        }
        return;
    }
#endif
    long tiles = (O + TILE_O - 1) / TILE_O;
#pragma omp parallel for schedule(dynamic, CHUNK_O / TILE_O)
    for (long t = 0; t < tiles; t++) {
        long o0 = t * TILE_O, no = O - o0 < TILE_O ? O - o0 : TILE_O;
        tile(x, R, K, ldx, W, ldw, o0, no, bias, y, ldy);
    }
}
