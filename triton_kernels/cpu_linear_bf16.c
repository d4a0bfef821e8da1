/* The linear layer in bfloat16 arithmetic (a format code with W_DOT16 set): y = x W^T with x and
   every weight rounded to bfloat16 (to nearest even, as torch's .bfloat16() rounds), products
   summed in float32 by AVX512-BF16's vdpbf16ps, 32 products an instruction where the float32
   kernel makes 16. The weights stay in their own format (float32, bfloat16, blocks),
   widened as cpu_linear.c widens them, then rounded. torch's bfloat16 matmul computes the same
   products, sums them in another order, and rounds y (plus the bias) to bfloat16, as this does.

   Each output of a row of x sums its 32-value chunks c into accumulator c mod 4 whatever the
   number of rows up to PANEL_ROWS, so those steps give a request the same bits; from there x is
   cut into panels of 32 rows and each output is one chain over its pairs in order, or, where the
   CPU has AMX, multiplied in its tiles (linear_amx). */

#include "cpu_weights.h"

/* A laid-out matrix (pageserve_pack_amx) starts with a header of PACK_HEADER 32-bit words: its
   kind first. PACK_BF16: per 32 rows, pack_pairs' tiles of bfloat16. PACK_Q4_1 and PACK_Q4_0 (the
   GGUF formats): per 32 rows, per chunk of 32 values and half of the rows, the 16 rows' scales
   and offsets (float16, as the blocks hold them) and 16 pairs x 16 rows of 4-bit codes, two a
   byte: 320 bytes for pack_pairs' 1,024, widened into a tile of bfloat16 as each group is
   multiplied (less memory to read: the 32 rows' tiles stay in L1/L2 across the blocks of x). */
#define PACK_HEADER 16
enum { PACK_BF16 = 0, PACK_Q4_1 = 1, PACK_Q4_0 = 2 };
#define Q4_TILE 320

static inline int pack_kind(int wtype) { return wtype == W_Q4_1 ? PACK_Q4_1 : wtype == W_Q4_0 ? PACK_Q4_0 : PACK_BF16; }

/* The bytes pageserve_pack_amx writes for a matrix of O rows of K values in format wtype */
long pageserve_packed_bytes(int wtype, long K, long O) {
    long kc = (K + 31) / 32, groups = (O + 31) / 32;
    return 4 * PACK_HEADER + groups * (pack_kind(wtype & ~W_DOT16) == PACK_BF16 ? 2048 * kc : 2 * kc * Q4_TILE);
}

#ifdef PS_AVX512_BF16

#define TILE_W 8 /* weight rows of a panel tile: 16 accumulators (12 left the dot products' latency bare) */
#define PANEL_ROWS 16 /* rows of x from which they are paneled */

/* 32 floats as 32 bfloat16 in order (vcvtne2ps2bf16 puts its second operand first) */
static inline __m512bh round32(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

/* 16 floats rounded to bfloat16 values, as round_bf16 rounds each */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __mmask16 first_n16(long n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* chunk c (values 32c..32c+31) of one weight row in bfloat16, zero past K (a block format's K
   is a multiple of 32); full: the chunk is known to lie wholly before K */
static inline __attribute__((always_inline)) __m512bh chunk_at(const void *w, int wtype, long c, long K, int full) {
    long k = 32 * c, n = full ? 32 : K - k;
    if (wtype == W_BF16) {
        const uint16_t *h = (const uint16_t *)w + k;
        return (__m512bh)(n >= 32 ? _mm512_loadu_si512(h) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), h));
    }
    if (wtype == W_F32) {
        const float *f = (const float *)w + k;
        if (n >= 32) return round32(_mm512_loadu_ps(f), _mm512_loadu_ps(f + 16));
        return round32(_mm512_maskz_loadu_ps(first_n16(n), f), _mm512_maskz_loadu_ps(first_n16(n - 16), f + 16));
    }
    __m512 v[2];
    widen_block16((const uint8_t *)w + c * block_bytes(wtype), wtype, v);
    return round32(v[0], v[1]);
}

#define chunk_of(w, wtype, c, K) chunk_at(w, wtype, c, K, 0)

static inline long chunk_bytes(int wtype) { return wtype == W_F32 ? 128 : wtype == W_BF16 ? 64 : block_bytes(wtype); }

#define DOT(acc, w, c, full) \
    acc = _mm512_dpbf16_ps(acc, chunk_at(w, wtype, c, K, full), (__m512bh)_mm512_loadu_si512(xb + 32 * (c)))

/* NW weight rows (w[]) against one row of x in bfloat16 (xb, zero-padded to whole chunks): the
   sums of each row, chunk c into its accumulator c mod 4 */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *xb, const void *const *w, int NW,
                                                           int wtype, long K, float *out) {
    __m512 a0[4], a1[4], a2[4], a3[4];
    for (int r = 0; r < NW; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
    long n = (K + 31) / 32, c = 0, cb = chunk_bytes(wtype);
    for (; c + 4 <= K / 32; c += 4)
        _Pragma("GCC unroll 4") for (int r = 0; r < NW; r++) {
            for (long b = 0; b < 4 * cb; b += 64) /* every line the four chunks read */
                _mm_prefetch((const char *)w[r] + c * cb + b + PREFETCH, _MM_HINT_T0);
            DOT(a0[r], w[r], c, 1);
            DOT(a1[r], w[r], c + 1, 1);
            DOT(a2[r], w[r], c + 2, 1);
            DOT(a3[r], w[r], c + 3, 1);
        }
    _Pragma("GCC unroll 4") for (int r = 0; r < NW; r++) { /* up to four chunks left, the last maybe partial */
        if (c < n) DOT(a0[r], w[r], c, 0);
        if (c + 1 < n) DOT(a1[r], w[r], c + 1, 0);
        if (c + 2 < n) DOT(a2[r], w[r], c + 2, 0);
        if (c + 3 < n) DOT(a3[r], w[r], c + 3, 0);
        out[r] = hsum16(_mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r])));
    }
}

/* rows o0..o1-1 of W against one row of x: four rows a quarter of the piece apart at once (four
   streams from memory), the rest one at a time */
static inline __attribute__((always_inline)) void row1_of(const uint16_t *xb, long K, const void *W, int wtype,
                                                          long ldw, long o0, long o1, const float *bias, float *y) {
    long q = (o1 - o0) / 4;
    float s[4];
    for (long o = o0; o < o0 + q; o++) {
        const void *w[4] = {weight_row(W, wtype, ldw, o), weight_row(W, wtype, ldw, o + q),
                            weight_row(W, wtype, ldw, o + 2 * q), weight_row(W, wtype, ldw, o + 3 * q)};
        dot_rows(xb, w, 4, wtype, K, s);
        for (int r = 0; r < 4; r++) y[o + r * q] = round_bf16(s[r] + (bias ? bias[o + r * q] : 0.0f));
    }
    for (long o = o0 + 4 * q; o < o1; o++) {
        const void *w[1] = {weight_row(W, wtype, ldw, o)};
        dot_rows(xb, w, 1, wtype, K, s);
        y[o] = round_bf16(s[0] + (bias ? bias[o] : 0.0f));
    }
}

static void row1(const uint16_t *xb, long K, const void *W, int wtype, long ldw, long o0, long o1,
                 const float *bias, float *y) {
    switch (wtype) { /* one copy per format, the format's branches gone */
    case W_F32: row1_of(xb, K, W, W_F32, ldw, o0, o1, bias, y); break;
    case W_BF16: row1_of(xb, K, W, W_BF16, ldw, o0, o1, bias, y); break;
    case W_Q8_0: row1_of(xb, K, W, W_Q8_0, ldw, o0, o1, bias, y); break;
    case W_Q4_0: row1_of(xb, K, W, W_Q4_0, ldw, o0, o1, bias, y); break;
    case W_I8: row1_of(xb, K, W, W_I8, ldw, o0, o1, bias, y); break;
    case W_F8: row1_of(xb, K, W, W_F8, ldw, o0, o1, bias, y); break;
    case W_I4: row1_of(xb, K, W, W_I4, ldw, o0, o1, bias, y); break;
    case W_F4: row1_of(xb, K, W, W_F4, ldw, o0, o1, bias, y); break;
    case W_N4: row1_of(xb, K, W, W_N4, ldw, o0, o1, bias, y); break;
    case W_K4: row1_of(xb, K, W, W_K4, ldw, o0, o1, bias, y); break;
    case W_K6: row1_of(xb, K, W, W_K6, ldw, o0, o1, bias, y); break;
    case W_K5: row1_of(xb, K, W, W_K5, ldw, o0, o1, bias, y); break;
    case W_X8: row1_of(xb, K, W, W_X8, ldw, o0, o1, bias, y); break;
    case W_K3: row1_of(xb, K, W, W_K3, ldw, o0, o1, bias, y); break;
    case W_L4: row1_of(xb, K, W, W_L4, ldw, o0, o1, bias, y); break;
    case W_H16: row1_of(xb, K, W, W_H16, ldw, o0, o1, bias, y); break;
    default: row1_of(xb, K, W, W_Q4_1, ldw, o0, o1, bias, y); /* W_Q4_1 */
    }
}

/* one weight row in bfloat16, zero-padded to whole chunks (kc of them), at out */
static void round_row(const void *w, int wtype, long K, long kc, uint16_t *out) {
    for (long c = 0; c < kc; c++) _mm512_storeu_si512(out + 32 * c, (__m512i)chunk_of(w, wtype, c, K));
}

/* 2 to PANEL_ROWS - 1 rows of x. Each weight row's chunks are rounded once and each held in a
   register against up to ROWS_BLOCK rows of x (four accumulators a row, as dot_rows keeps them);
   past ROWS_BLOCK rows the rest take the rounded row back from this thread's copy. Each row's
   accumulators are added as dot_rows adds them, and the sums across lanes done for 16 outputs at
   once in hsum16's order (sum16), so every output is row1's, to the bit. */
#define ROWS_BLOCK 7 /* rows of x a register tile holds: 28 accumulators (8: spilled, slower) */

/* weight row w (format wtype, K values; or the rounded copy: W_BF16, K a multiple of 32, copy
   set) against NR rows of x (xb, ldx values apart): out[r] the four accumulators of row r added;
   wb: where to store the rounded row, or NULL */
static inline __attribute__((always_inline)) void rows_tile(const uint16_t *xb, long ldx, int NR, const void *w,
                                                            int wtype, long K, int copy, uint16_t *wb, __m512 *out) {
    __m512 a[ROWS_BLOCK][4];
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    long n = (K + 31) / 32, c = 0, cb = chunk_bytes(wtype);
    for (; c + 4 <= K / 32; c += 4) {
        if (!copy) /* the weights ahead, as dot_rows asks for them (the copy is in L1) */
            for (long b = 0; b < 4 * cb; b += 64) _mm_prefetch((const char *)w + c * cb + b + PREFETCH, _MM_HINT_T0);
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
            __m512bh v = chunk_at(w, wtype, c + j, K, 1);
            if (wb != NULL) _mm512_store_si512(wb + 32 * (c + j), (__m512i)v);
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
                a[r][j] = _mm512_dpbf16_ps(a[r][j], v, (__m512bh)_mm512_loadu_si512(xb + r * ldx + 32 * (c + j)));
        }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) /* up to four chunks left, the last maybe partial */
        if (c + j < n) {
            __m512bh v = chunk_at(w, wtype, c + j, K, 0);
            if (wb != NULL) _mm512_store_si512(wb + 32 * (c + j), (__m512i)v);
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
                a[r][j] = _mm512_dpbf16_ps(a[r][j], v, (__m512bh)_mm512_loadu_si512(xb + r * ldx + 32 * (c + j)));
        }
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
}

/* rows_tile at every NR (a compile-time constant in each copy) */
static inline __attribute__((always_inline)) void rows_tile_n(const uint16_t *xb, long ldx, int NR, const void *w,
                                                              int wtype, long K, int copy, uint16_t *wb,
                                                              __m512 *out) {
    switch (NR) {
    case 1: rows_tile(xb, ldx, 1, w, wtype, K, copy, wb, out); break;
    case 2: rows_tile(xb, ldx, 2, w, wtype, K, copy, wb, out); break;
    case 3: rows_tile(xb, ldx, 3, w, wtype, K, copy, wb, out); break;
    case 4: rows_tile(xb, ldx, 4, w, wtype, K, copy, wb, out); break;
    case 5: rows_tile(xb, ldx, 5, w, wtype, K, copy, wb, out); break;
    case 6: rows_tile(xb, ldx, 6, w, wtype, K, copy, wb, out); break;
    default: rows_tile(xb, ldx, ROWS_BLOCK, w, wtype, K, copy, wb, out);
    }
}

/* the sums of 16 vectors' lanes, each as hsum16 adds them (lanes i and i + 8, then i and i + 4,
   i and i + 2, 0 and 1), in one vector: lane j the sum of v[(j % 4) * 4 + j / 4] */
static inline __m512 sum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

/* weight rows o0..o1-1 against the R rows of x, in groups of 16: each output's vector of lane
   sums kept in sums[row][slot] (output o0 + j at slot (j % 4) * 4 + j / 4, as sum16 reads them) */
static inline __attribute__((always_inline)) void rows_of(const uint16_t *xb, long R, long kc, long K, const void *W,
                                                          int wtype, long ldw, long o0, long o1, const float *bias,
                                                          float *y, long ldy, uint16_t *wb, __m512 *sums) {
    long blocks = (R + ROWS_BLOCK - 1) / ROWS_BLOCK, ldx = 32 * kc;
    for (long g = o0; g < o1; g += 16) {
        long no = o1 - g < 16 ? o1 - g : 16;
        for (long j = 0; j < no; j++) {
            long slot = (j % 4) * 4 + j / 4;
            const void *w = weight_row(W, wtype, ldw, g + j);
            for (long b = 0, r0 = 0; b < blocks; b++) { /* rows in blocks of (nearly) equal size */
                long nr = (R - r0) / (blocks - b);
                __m512 out[ROWS_BLOCK];
                if (b == 0)
                    rows_tile_n(xb, ldx, (int)nr, w, wtype, K, 0, blocks > 1 ? wb : NULL, out);
                else
                    rows_tile_n(xb + r0 * ldx, ldx, (int)nr, wb, W_BF16, ldx, 1, NULL, out);
                for (long r = 0; r < nr; r++) sums[(r0 + r) * 16 + slot] = out[r];
                r0 += nr;
            }
        }
        __mmask16 m = first_n16(no);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + g) : _mm512_setzero_ps();
        for (long r = 0; r < R; r++)
            _mm512_mask_storeu_ps(y + r * ldy + g, m, round16(_mm512_add_ps(sum16(sums + r * 16), bv)));
    }
}

static void rows_fmt(const uint16_t *xb, long R, long kc, long K, const void *W, int wtype, long ldw, long o0,
                     long o1, const float *bias, float *y, long ldy, uint16_t *wb, __m512 *sums) {
    switch (wtype) { /* one copy per format, the format's branches gone */
    case W_F32: rows_of(xb, R, kc, K, W, W_F32, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_BF16: rows_of(xb, R, kc, K, W, W_BF16, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_Q8_0: rows_of(xb, R, kc, K, W, W_Q8_0, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_Q4_0: rows_of(xb, R, kc, K, W, W_Q4_0, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_I8: rows_of(xb, R, kc, K, W, W_I8, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_F8: rows_of(xb, R, kc, K, W, W_F8, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_I4: rows_of(xb, R, kc, K, W, W_I4, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_F4: rows_of(xb, R, kc, K, W, W_F4, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_N4: rows_of(xb, R, kc, K, W, W_N4, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_K4: rows_of(xb, R, kc, K, W, W_K4, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_K6: rows_of(xb, R, kc, K, W, W_K6, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_K5: rows_of(xb, R, kc, K, W, W_K5, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_X8: rows_of(xb, R, kc, K, W, W_X8, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_K3: rows_of(xb, R, kc, K, W, W_K3, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_L4: rows_of(xb, R, kc, K, W, W_L4, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    case W_H16: rows_of(xb, R, kc, K, W, W_H16, ldw, o0, o1, bias, y, ldy, wb, sums); break;
    default: rows_of(xb, R, kc, K, W, W_Q4_1, ldw, o0, o1, bias, y, ldy, wb, sums); /* W_Q4_1 */
    }
}

static int linear_rows(const uint16_t *xb, long R, long K, long kc, const void *W, int wtype, long O, long ldw,
                       const float *bias, float *y, long ldy) {
    long piece = piece_rows(O), pieces = (O + piece - 1) / piece;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *wb = (uint16_t *)aligned_floats(16 * kc);
        __m512 *sums = (__m512 *)aligned_floats(16 * 16 * R);
        if (wb == NULL || sums == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            memset(sums, 0, sizeof(__m512) * 16 * (size_t)R); /* a last, partial group sums slots it does not fill */
        }
#pragma omp for schedule(dynamic, 1)
        for (long p = 0; p < pieces; p++) {
            long o0 = p * piece, o1 = o0 + piece < O ? o0 + piece : O;
            if (wb != NULL && sums != NULL) rows_fmt(xb, R, kc, K, W, wtype, ldw, o0, o1, bias, y, ldy, wb, sums);
        }
        free(wb);
        free(sums);
    }
    return failed;
}

/* TILE_W rounded weight rows (wp: pairs of bfloat16, `pairs` a row) against one panel of x:
   each pair broadcast against two registers of 16 rows, 6 x 32 outputs in twelve accumulators,
   each one chain over the pairs in order; rows r0.. (nr of them) of out, columns o0.. (no) */
static inline void panel_tile(const uint32_t *wp, const uint32_t *xq, long pairs, long no, long nr,
                              const float *bias, float *out, long ldo) {
    __m512 a[TILE_W][2];
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_W; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    _Pragma("GCC unroll 2") for (long k = 0; k < pairs; k++) {
        __m512bh x0 = (__m512bh)_mm512_load_si512(xq + k * 32), x1 = (__m512bh)_mm512_load_si512(xq + k * 32 + 16);
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_W; i++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)wp[i * pairs + k]);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], b, x0);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], b, x1);
        }
    }
    float v[TILE_W][32];
    _Pragma("GCC unroll 8") for (int i = 0; i < TILE_W; i++) {
        __m512 b = _mm512_set1_ps(bias && i < no ? bias[i] : 0.0f);
        _mm512_storeu_ps(v[i], round16(_mm512_add_ps(a[i][0], b)));
        _mm512_storeu_ps(v[i] + 16, round16(_mm512_add_ps(a[i][1], b)));
    }
    for (long i = 0; i < no; i++)
        for (long j = 0; j < nr; j++) out[j * ldo + i] = v[i][j];
}

/* PANEL_ROWS rows of x or more: x in panels of 32 rows, pairs of values k-major (xp[panel][pair]
   [32 rows], each a 32-bit pair as vdpbf16ps reads it). A piece of work is a run of up to four
   tiles; where y's rows lie a multiple of 1 KB apart its outputs are summed into a scratch and
   copied out, as cpu_linear.c's panels do (their writes would share a few L1 sets). */
static int linear_panels(const uint16_t *xb, long R, long kc, const void *W, int wtype, long K, long O, long ldw,
                         const float *bias, float *y, long ldy) {
    long pairs = 16 * kc, panels = (R + 31) / 32, tiles = (O + TILE_W - 1) / TILE_W;
    long run_tiles = two_a_thread(tiles), run = (run_tiles < 4 ? run_tiles : 4) * TILE_W, runs = (O + run - 1) / run;
    int staged = ldy % 256 == 0;
    uint32_t *xp = (uint32_t *)aligned_floats(panels * pairs * 32);
    if (xp == NULL) return 1;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *wb = (uint16_t *)aligned_floats(TILE_W * 16 * kc);
        float *stage = staged ? aligned_floats(R * run) : NULL;
        if (wb == NULL || (staged && stage == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long pk = 0; pk < panels * pairs; pk += 16) { /* 16 pairs of the 32 rows: a line of each row */
            long p = pk / pairs, k0 = pk % pairs;
            uint32_t *dst = xp + pk * 32;
            for (long j = 0; j < 32; j++) {
                const uint32_t *row = p * 32 + j < R ? (const uint32_t *)(xb + (p * 32 + j) * 32 * kc) + k0 : NULL;
                for (long k = 0; k < 16; k++) dst[k * 32 + j] = row ? row[k] : 0;
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (long c = 0; c < runs; c++) {
            long oc = c * run, nc = O - oc < run ? O - oc : run;
            float *out = staged ? stage : y + oc;
            long ldo = staged ? run : ldy;
            if (wb == NULL || out == NULL) continue;
            for (long o0 = oc; o0 < oc + nc; o0 += TILE_W) {
                long no = O - o0 < TILE_W ? O - o0 : TILE_W;
                for (long i = 0; i < TILE_W; i++) {
                    if (i < no) round_row(weight_row(W, wtype, ldw, o0 + i), wtype, K, kc, wb + i * 32 * kc);
                    else memset(wb + i * 32 * kc, 0, 64 * (size_t)kc);
                }
                for (long p = 0; p < panels; p++) {
                    long r0 = p * 32, nr = R - r0 < 32 ? R - r0 : 32;
                    panel_tile((const uint32_t *)wb, xp + p * pairs * 32, pairs, no, nr, bias ? bias + o0 : NULL,
                               out + r0 * ldo + (o0 - oc), ldo);
                }
            }
            if (staged)
                for (long r = 0; r < R; r++) memcpy(y + r * ldy + oc, stage + r * run, sizeof(float) * (size_t)nc);
        }
        free(wb);
        free(stage);
    }
    free(xp);
    return failed;
}

#ifdef PS_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>

static int amx_state = -1; /* -1: not asked yet; 0: refused (an older kernel, a sandbox); 1: granted */

int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_RELAXED);
    if (s < 0) { /* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux 5.16 and later */
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELAXED);
    }
    return s;
}

/* 32 rounded weight rows (wb, 32 * kc values a row) as TDPBF16PS's second operand: for each
   chunk of 32 values and each half of the rows, 16 pairs x 16 rows (wv[c][half][pair][row]) */
static void pack_pairs(const uint32_t *wb, long kc, uint32_t *wv) {
    for (long c = 0; c < kc; c++)
        for (long h = 0; h < 2; h++) transpose16(wb + h * 16 * 16 * kc + 16 * c, 16 * kc, wv + (2 * c + h) * 256);
}

/* weight rows o0..o0 + no - 1 (no <= 32) rounded into wb and laid out in wv as pack_pairs lays
   them out, zero rows past no */
static void pack_group(const void *W, int wtype, long K, long kc, long ldw, long o0, long no, uint32_t *wb,
                       uint32_t *wv) {
    for (long i = 0; i < 32; i++) {
        if (i < no) round_row(weight_row(W, wtype, ldw, o0 + i), wtype, K, kc, (uint16_t *)(wb + i * 16 * kc));
        else memset(wb + i * 16 * kc, 0, 64 * (size_t)kc);
    }
    pack_pairs(wb, kc, wv);
}

/* rows o0..o0 + no - 1 (no <= 32) of a Q4_1 or Q4_0 matrix as 2 * kc tiles of Q4_TILE bytes
   (zero rows past no). A tile row (pair p of 16 rows) is 32 bfloat16 words in pack_pairs' order,
   rows 0-7's pairs then rows 8-15's: byte i of its codes holds word i's code in its low half and
   word 16 + i's in its high half, so the two halves widen into two registers already in order. */
static void pack_group_q4(const void *W, int wtype, long kc, long ldw, long o0, long no, uint8_t *out) {
    long hdr = wtype == W_Q4_1 ? 4 : 2;
    memset(out, 0, (size_t)(2 * kc * Q4_TILE));
    for (long i = 0; i < no; i++) {
        const uint8_t *row = (const uint8_t *)weight_row(W, wtype, ldw, o0 + i);
        for (long c = 0; c < kc; c++) {
            const uint8_t *blk = row + c * block_bytes(wtype);
            uint8_t *t = out + (2 * c + i / 16) * Q4_TILE;
            long j = i % 16, half = j / 8, at = 2 * (j % 8); /* rows 8-15 in the high halves */
            memcpy(t + 2 * j, blk, 2);                                /* d */
            if (wtype == W_Q4_1) memcpy(t + 32 + 2 * j, blk + 2, 2); /* m */
            for (long v = 0; v < 32; v++) { /* value v's code: byte v % 16's low or high half */
                uint8_t q = v < 16 ? blk[hdr + v] & 15 : blk[hdr + v - 16] >> 4;
                t[64 + 16 * (v / 2) + at + v % 2] |= (uint8_t)(q << 4 * half);
            }
        }
    }
}

/* one tile of pack_group_q4's layout widened as pack_pairs lays out the widened rows: the values
   widen_block16 gives (Q4_1: d q + m in one rounding; Q4_0: d (q - 8)), rounded to bfloat16 */
static inline void unpack_q4_tile(const uint8_t *t, int kind, uint32_t *out) {
    const __m512i lo_rows = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi_rows = _mm512_add_epi32(lo_rows, _mm512_set1_epi32(8));
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32)));
    __m512 d0 = _mm512_permutexvar_ps(lo_rows, d), d1 = _mm512_permutexvar_ps(hi_rows, d);
    __m512 m0 = _mm512_permutexvar_ps(lo_rows, m), m1 = _mm512_permutexvar_ps(hi_rows, m);
    for (int p = 0; p < 16; p++) {
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + 64 + 16 * p)));
        __m512 a = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
        __m512 b = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        if (kind == PACK_Q4_1) {
            a = _mm512_fmadd_ps(d0, a, m0);
            b = _mm512_fmadd_ps(d1, b, m1);
        } else {
            a = _mm512_mul_ps(d0, _mm512_sub_ps(a, _mm512_set1_ps(8.0f)));
            b = _mm512_mul_ps(d1, _mm512_sub_ps(b, _mm512_set1_ps(8.0f)));
        }
        _mm512_store_si512(out + 16 * p, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* PANEL_ROWS rows of x or more in AMX tiles: a piece of work is 32 weight rows, rounded and
   packed once, against every block of 32 rows of x (xb, rows padded with zeros to a multiple of
   32): four 16 x 16 blocks of sums in tiles 0-3, one instruction a block a chunk of 32 values.
   TDPBF16PS sums a chunk's 32 products at a width of its own (not vdpbf16ps's chain of
   roundings), so the bits differ from linear_panels'; each output is still x rounded times the
   rounded weights summed in float32 and rounded, as torch's bfloat16 matmul does. packed: the
   whole matrix laid out once (pageserve_pack_amx), or NULL: each piece's rows done here. */
static int linear_amx(const uint16_t *xb, long R, long kc, const void *W, int wtype, long K, long O, long ldw,
                      const uint32_t *packed, const float *bias, float *y, long ldy) {
    long groups = (O + 31) / 32, blocks = (R + 31) / 32, ldx = 64 * kc; /* bytes from a row of xb to the next */
    int failed = 0, kind = packed != NULL ? (int)packed[0] : -1;
    if (packed != NULL) packed += PACK_HEADER;
#pragma omp parallel
    {
        uint32_t *wb = packed ? NULL : (uint32_t *)aligned_floats(32 * 16 * kc);
        uint32_t *wv = kind == PACK_BF16 ? NULL : (uint32_t *)aligned_floats(32 * 16 * kc);
        float sums[4][16][16] __attribute__((aligned(64)));
        int ok = (packed != NULL || wb != NULL) && (kind == PACK_BF16 || wv != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            amx_tiles(8);
        }
#pragma omp for schedule(dynamic, 1)
        for (long g = 0; g < groups; g++) {
            if (!ok) continue;
            long o0 = 32 * g, no = O - o0 < 32 ? O - o0 : 32;
            const uint32_t *w = kind == PACK_BF16 ? packed + g * 512 * kc : wv;
            if (packed == NULL) pack_group(W, wtype, K, kc, ldw, o0, no, wb, wv);
            /* 4-bit codes: each chunk's two tiles widened as the first block of x reaches them (the
               vector work beside the tiles'), read back by the others */
            const uint8_t *codes = kind > PACK_BF16 ? (const uint8_t *)packed + g * 2 * kc * Q4_TILE : NULL;
            for (long b = 0; b < blocks; b++) {
                const uint16_t *x0 = xb + b * 32 * 32 * kc, *x1 = x0 + 16 * 32 * kc;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                int both = 32 * b + 16 < R; /* else the block's second half is padding: not multiplied */
                for (long c = 0; c < kc; c++) {
                    if (b == 0 && codes != NULL) {
                        unpack_q4_tile(codes + 2 * c * Q4_TILE, kind, wv + 2 * c * 256);
                        unpack_q4_tile(codes + (2 * c + 1) * Q4_TILE, kind, wv + (2 * c + 1) * 256);
                    }
                    _tile_loadd(4, x0 + 32 * c, ldx);
                    _tile_loadd(6, w + 2 * c * 256, 64);
                    _tile_loadd(7, w + (2 * c + 1) * 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (both) {
                        _tile_loadd(5, x1 + 32 * c, ldx);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                if (both) {
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                }
                for (int t = 0; t < (both ? 4 : 2); t++) { /* tile t: rows 16 (t / 2).., outputs 16 (t % 2).. */
                    long r0 = 32 * b + 16 * (t / 2), oc = o0 + 16 * (t % 2);
                    __mmask16 m = first_n16(no - 16 * (t % 2));
                    __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + oc) : _mm512_setzero_ps();
                    for (long n = 0; n < 16 && r0 + n < R; n++)
                        _mm512_mask_storeu_ps(y + (r0 + n) * ldy + oc, m,
                                              round16(_mm512_add_ps(_mm512_load_ps(sums[t][n]), bv)));
                }
            }
        }
        if (ok) _tile_release();
        free(wb);
        free(wv);
    }
    return failed;
}
#endif

/* The weights as linear_amx reads them, for a matrix used at 16 rows and more step after step:
   a header (the layout's kind), then per 32 rows (the last zero-padded) the tiles pack_pairs lays
   out (per chunk of 32 values and half of the rows, 16 pairs x 16 rows of bfloat16), or for Q4_1
   and Q4_0 pack_group_q4's; out: pageserve_packed_bytes. Returns 1 where scratch memory could not
   be had, 2 where this build or process has no AMX, else 0. */
int pageserve_pack_amx(const void *W, int wtype, long K, long O, long ldw, uint32_t *out) {
#ifdef PS_AMX_BF16
    if (!amx_ready()) return 2;
    long kc = (K + 31) / 32, groups = (O + 31) / 32;
    int failed = 0;
    wtype &= ~W_DOT16;
    int kind = pack_kind(wtype);
    memset(out, 0, 4 * PACK_HEADER);
    out[0] = (uint32_t)kind;
    out += PACK_HEADER;
#pragma omp parallel
    {
        uint32_t *wb = kind == PACK_BF16 ? (uint32_t *)aligned_floats(32 * 16 * kc) : NULL;
        if (kind == PACK_BF16 && wb == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long g = 0; g < groups; g++) {
            long no = O - 32 * g < 32 ? O - 32 * g : 32;
            if (kind != PACK_BF16) pack_group_q4(W, wtype, kc, ldw, 32 * g, no, (uint8_t *)out + g * 2 * kc * Q4_TILE);
            else if (wb != NULL) pack_group(W, wtype, K, kc, ldw, 32 * g, no, wb, out + g * 512 * kc);
        }
        free(wb);
    }
    return failed;
#else
    (void)W, (void)wtype, (void)K, (void)O, (void)ldw, (void)out;
    return 2;
#endif
}

/* pageserve_linear of a format with W_DOT16 set. packed: pageserve_pack_amx's layout of W, or
   NULL. Returns 1 where scratch memory could not be had (y is then not all written), 2 where this
   build has no AVX512-BF16. */
static int linear_bf16(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                       const uint32_t *packed, const float *bias, float *y, long ldy) {
    wtype &= ~W_DOT16;
    long kc = (K + 31) / 32; /* chunks of 32 values a row */
    int amx = 0;
#ifdef PS_AMX_BF16
    amx = R >= PANEL_ROWS && amx_ready();
#endif
    long padded = amx ? (R + 31) / 32 * 32 : R; /* AMX reads x in blocks of 32 rows */
    uint16_t *xb = (uint16_t *)aligned_floats(padded * 16 * kc);
    if (xb == NULL) return 1;
    memset(xb + R * 32 * kc, 0, sizeof(uint16_t) * 32 * (size_t)(kc * (padded - R)));
#pragma omp parallel for schedule(static) if (R * kc >= 1024)
    for (long r = 0; r < R; r++) /* x rounded to bfloat16, zero-padded to whole chunks */
        for (long c = 0; c < kc; c++)
            _mm512_storeu_si512(xb + (r * kc + c) * 32, (__m512i)chunk_of(x + r * ldx, W_F32, c, K));
    int failed = 0;
    if (R == 1) {
        long piece = piece_rows(O), pieces = (O + piece - 1) / piece;
#pragma omp parallel for schedule(dynamic, 1)
        for (long p = 0; p < pieces; p++) {
            long o0 = p * piece, o1 = o0 + piece < O ? o0 + piece : O;
            row1(xb, K, W, wtype, ldw, o0, o1, bias, y);
        }
    } else if (R < PANEL_ROWS) {
        failed = linear_rows(xb, R, K, kc, W, wtype, O, ldw, bias, y, ldy);
    } else if (amx) {
#ifdef PS_AMX_BF16
        failed = linear_amx(xb, R, kc, W, wtype, K, O, ldw, packed, bias, y, ldy);
#endif
    } else {
        failed = linear_panels(xb, R, kc, W, wtype, K, O, ldw, bias, y, ldy);
    }
    free(xb);
    return failed;
}

int pageserve_linear_bf16(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                          const float *bias, float *y, long ldy) {
    return linear_bf16(x, R, K, ldx, W, wtype, O, ldw, NULL, bias, y, ldy);
}

/* pageserve_linear, with W also laid out by pageserve_pack_amx (packed, or NULL), which the AMX
   tiles read in its place */
int pageserve_linear_packed(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                            const void *packed, const float *bias, float *y, long ldy) {
    if (!(wtype & W_DOT16)) return pageserve_linear(x, R, K, ldx, W, wtype, O, ldw, bias, y, ldy);
    return linear_bf16(x, R, K, ldx, W, wtype, O, ldw, (const uint32_t *)packed, bias, y, ldy);
}

#else

int pageserve_pack_amx(const void *W, int wtype, long K, long O, long ldw, uint32_t *out) {
    (void)W, (void)wtype, (void)K, (void)O, (void)ldw, (void)out;
    return 2;
}

int pageserve_linear_packed(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                            const void *packed, const float *bias, float *y, long ldy) {
    (void)packed;
    if (!(wtype & W_DOT16)) return pageserve_linear(x, R, K, ldx, W, wtype, O, ldw, bias, y, ldy);
    return 2;
}

int pageserve_linear_bf16(const float *x, long R, long K, long ldx, const void *W, int wtype, long O, long ldw,
                          const float *bias, float *y, long ldy) {
    (void)x, (void)R, (void)K, (void)ldx, (void)W, (void)wtype, (void)O, (void)ldw, (void)bias, (void)y, (void)ldy;
    return 2;
}

#endif

/* the bit or'ed into a format for bfloat16 arithmetic (a library built before 076a005 lacks
   this function: its bit is 16) */
int pageserve_dot16_flag(void) { return W_DOT16; }

/* 1 where this build has the bfloat16 dot product, else 0 */
int pageserve_has_bf16_dot(void) {
#ifdef PS_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
