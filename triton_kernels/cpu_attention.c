/* Causal paged attention of any step on the CPU, straight from the cache blocks (cpu_kernels.py's
   paged_attention, and the decoder stack's in cpu_kernels.c). Built twice, once for each format
   the KV cache may hold: float32 (this file as it is), bfloat16 (cpu_attention_bf16.c, which
   defines KV_BF16 and includes it) and float8 e4m3fn (cpu_attention_fp8.c, KV_FP8). The
   arithmetic does not depend on the format: a narrow K or V value is widened exactly where it is
   read, and a new one is rounded to nearest even where it is written (as torch rounds it:
   bfloat16 subnormals kept, float8 saturated at 448), so a cache of values already bfloat16
   (the C kernels' bfloat16 arithmetic rounds every K and V so) gives the float32 cache's outputs
   to the bit at half the bytes, and a float8 cache gives those of a float32 cache holding its
   values. The products are float32, except
   under that bfloat16 arithmetic (r16) with AVX512-BF16, where groups of rows with heads of 16n
   floats multiply Q K^T and P V in bfloat16 (score_tile16, pv_run16; vdpbf16ps reads a
   subnormal as zero), in AMX tiles where the CPU has them and heads are 32n floats up to 128
   (scores_amx, pv_amx). */

#include "cpu_kernels.h"
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif

#ifdef KV_BF16
typedef uint16_t kv_t;
#define KV_NAME(name) name##_kv16
static inline float kvf(kv_t h) { /* a bfloat16 value's float32: exact */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline kv_t to_kv(float f) { /* f rounded to nearest even, as torch's .bfloat16() rounds it */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0; /* a NaN: torch's one */
    return (kv_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
#ifdef PS_AVX2
static inline __m256 kv_load8(const kv_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
#ifdef PS_AVX512
static inline __m512 kv_load16(const kv_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif
DEFINE_DOT_AXPY(dot_kv, axpy_kv, kv_t, kv_load8, kvf)
#elif defined(KV_FP8)
/* float8 e4m3fn (torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
   infinity, 0x7F and 0xFF NaN, 448 the largest. Its magnitude bits put at float32's bits
   20-26 read as 2^-120 times the value (subnormals too), so a product with 2^120 widens it
   exactly. */
typedef uint8_t kv_t;
#define KV_NAME(name) name##_kv8
#define FP8_SCALE 1.329227995784916e36f /* 2^120 */
static inline float kvf(kv_t h) {
    if ((h & 0x7F) == 0x7F) return NAN;
    uint32_t u = (uint32_t)(h & 0x7F) << 20;
    float f;
    memcpy(&f, &u, 4);
    f *= FP8_SCALE;
    return h & 0x80 ? -f : f;
}
static inline kv_t to_kv(float f) { /* to nearest even, saturated at 448 (as torch's .to(float8_e4m3fn)) */
    uint32_t u;
    memcpy(&u, &f, 4);
    kv_t sign = (kv_t)(u >> 24 & 0x80);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return sign | 0x7F; /* a NaN, its sign kept */
    float a = fabsf(f);
    if (a >= 464.0f) return sign | 0x7E; /* past the midpoint of 448 and 480: saturated */
    if (a < 0.015625f) { /* below 2^-6: subnormal steps of 2^-9, rounded to nearest even */
        return sign | (kv_t)nearbyintf(a * 512.0f);
    }
    uint32_t b;
    memcpy(&b, &a, 4);
    b += 0x7FFFF + ((b >> 20) & 1); /* round the 23-bit mantissa to 3 */
    return sign | (kv_t)(((b >> 20) - (120u << 3)) & 0x7F);
}
/* vectors of codes: each code c moved to the top byte of a 16-bit lane (c << 8), shifted right one
   place arithmetically and bit 14 cleared, is float16's sign | 0eeee | mmm0000000: 2^-8 times the
   value (subnormals too), widened by vcvtph2ps and scaled back; a NaN code put back by a mask */
#if defined(PS_AVX2) && !defined(__F16C__) /* (every AVX2 CPU known has F16C) */
static inline __m256 kv_load8(const kv_t *p) {
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = kvf(p[i]);
    return _mm256_loadu_ps(f);
}
#elif defined(PS_AVX2)
static inline __m256 kv_load8(const kv_t *p) {
    __m128i c = _mm_loadl_epi64((const __m128i *)p);
    __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), c), 1), _mm_set1_epi16((short)0xBFFF));
    __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)), _mm_set1_epi16(0x3F80));
    return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
#endif
#ifdef PS_AVX512
static inline __m512 kv_load16(const kv_t *p) {
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(
                                     _mm_loadu_si128((const __m128i *)p)), 8), 1), _mm256_set1_epi16((short)0xBFFF));
    __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
    return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(NAN));
}
#endif
DEFINE_DOT_AXPY(dot_kv, axpy_kv, kv_t, kv_load8, kvf)
#else
typedef float kv_t;
#define KV_NAME(name) name##_kv32
#define kvf(h) (h)
#define to_kv(f) (f)
#define kv_load8 _mm256_loadu_ps
#define kv_load16 _mm512_loadu_ps
#define dot_kv dot
#define axpy_kv axpy
#endif

/* the two builds' entries, for the exported one (in the float32 build) to choose from */
int paged_attention_kv32(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                         float *k_cache, float *v_cache, const int64_t *slots, long T, const int32_t *block_tables,
                         long ld_bt, const int32_t *query_start_loc, const int32_t *seq_lens, long B, long H,
                         long Hkv, long D, long block_size, float scale, float *out, int r16, long W, float cap);
int paged_attention_kv16(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                         uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, long T,
                         const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                         const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size, float scale,
                         float *out, int r16, long W, float cap);
int paged_attention_kv8(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                        uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, long T,
                        const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                        const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size, float scale,
                        float *out, int r16, long W, float cap);

/* The first position a row of `len` positions sees under a sliding window of W (0: none): it
   attends to its last W positions only, its own included */
static inline long window_start(long len, long W) { return W > 0 && len > W ? len - W : 0; }

/* Gemma 2's soft cap on n scores: cap * tanh(s / cap) (cap 0: none). tanh as 1 - 2 / (exp(2x) + 1)
   on every lane, a tail through a padded vector, so that a score gets the same bits in every
   path whatever its place; a NaN score stays NaN (exp8 clamps it) */
static void softcap_scores(float *s, long n, float cap) {
    if (cap <= 0.0f) return;
#ifdef PS_AVX2
    const __m256 c = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    for (long i = 0; i < n; i += 8) {
        float t[8] = {0};
        long m = n - i < 8 ? n - i : 8;
        float *at = m == 8 ? s + i : t;
        if (m < 8) memcpy(t, s + i, sizeof(float) * (size_t)m);
        __m256 x = _mm256_loadu_ps(at), e = exp8(_mm256_mul_ps(two, _mm256_div_ps(x, c)));
        __m256 r = _mm256_mul_ps(c, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one))));
        _mm256_storeu_ps(at, _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        if (m < 8) memcpy(s + i, t, sizeof(float) * (size_t)m);
    }
#else
    for (long i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
#endif
}

/* ---- paged attention for decode-only steps: read K/V where they lie in the cache ---- */

#ifdef PS_AVX2
/* the dot products of NH <= 3 query heads (rows D apart) against four rows of k (k, k + D,
   k + 2D, k + 3D; D a multiple of 8), one accumulator each, reduced together: each row loaded
   once for the heads of its KV head, so GQA reads K once (docs/performance.md) */
static inline __attribute__((always_inline)) void dot4_heads(const float *q, int NH, const kv_t *k, long D,
                                                              __m128 out[3]) {
    __m256 a[3][4];
#ifdef PS_AVX512
    if (D % 16 == 0) { /* 16 a register, the halves added before the reduction below */
        __m512 z[3][4];
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++) z[h][r] = _mm512_setzero_ps();
        for (long i = 0; i < D; i += 16) {
            __m512 k0 = kv_load16(k + i), k1 = kv_load16(k + D + i), k2 = kv_load16(k + 2 * D + i),
                   k3 = kv_load16(k + 3 * D + i);
            for (int h = 0; h < NH; h++) {
                __m512 qv = _mm512_loadu_ps(q + h * D + i);
                z[h][0] = _mm512_fmadd_ps(qv, k0, z[h][0]);
                z[h][1] = _mm512_fmadd_ps(qv, k1, z[h][1]);
                z[h][2] = _mm512_fmadd_ps(qv, k2, z[h][2]);
                z[h][3] = _mm512_fmadd_ps(qv, k3, z[h][3]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++)
                a[h][r] = add_halves(z[h][r]);
    } else
#endif
    {
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++) a[h][r] = _mm256_setzero_ps();
        for (long i = 0; i < D; i += 8) {
            __m256 k0 = kv_load8(k + i), k1 = kv_load8(k + D + i), k2 = kv_load8(k + 2 * D + i),
                   k3 = kv_load8(k + 3 * D + i);
            for (int h = 0; h < NH; h++) {
                __m256 qv = _mm256_loadu_ps(q + h * D + i);
                a[h][0] = _mm256_fmadd_ps(qv, k0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(qv, k1, a[h][1]);
                a[h][2] = _mm256_fmadd_ps(qv, k2, a[h][2]);
                a[h][3] = _mm256_fmadd_ps(qv, k3, a[h][3]);
            }
        }
    }
    for (int h = 0; h < NH; h++) {
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        out[h] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    }
}
#endif

#ifdef PS_AVX512
/* NH <= 3 heads' rows of acc (D apart) += sum over i < n of p_h[i] v[i] for floats d0..d0+63,
   p_h: NH rows of probabilities L apart, v: rows D apart: each V row loaded (and widened) once
   for the heads, each head's sums the same chains over the run as one head alone */
static inline __attribute__((always_inline)) void pv64_heads(float *acc, long D, const float *p, long L, int NH,
                                                             const kv_t *v, long n, long d0) {
    __m512 o[3][4];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < 4; r++) o[h][r] = _mm512_loadu_ps(acc + h * D + d0 + 16 * r);
    for (long i = 0; i < n; i++) {
        const kv_t *vr = v + i * D + d0;
        __m512 vv[4];
        for (int r = 0; r < 4; r++) vv[r] = kv_load16(vr + 16 * r);
        for (int h = 0; h < NH; h++) {
            __m512 ph = _mm512_set1_ps(p[h * L + i]);
            for (int r = 0; r < 4; r++) o[h][r] = _mm512_fmadd_ps(ph, vv[r], o[h][r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(acc + h * D + d0 + 16 * r, o[h][r]);
}
#endif

/* The attention of one request's G query heads (q: G rows of D) over its cached positions
   j0..j1-1, each GS of them sharing one KV head (k, v: the first KV head's rows in block 0 of
   the cache, the next one's block_size * D floats on; a block is `tok` floats). s: scratch of
   G * (j1 - j0) floats; acc: G rows of D out. With mx and sm NULL, acc is the attention
   (the probabilities normalised before P V); else a piece of it: acc unnormalised (sum of
   exp(s - mx) v), mx the largest score and sm the sum of the exponentials of each head, for
   merge_pieces. Each head's sums are the same whatever G: an item of several KV heads only
   reads a block's rows of all of them together, where they lie side by side in the cache. */
static void attend_range(const float *q, const kv_t *k, const kv_t *v, const int32_t *bt, long j0, long j1,
                         long G, long GS, long D, long block_size, long tok, float scale, float *s, float *acc,
                         float *mx_out, float *sm_out, int r16, float cap) {
    float mx[64], sum[64]; /* G <= 64 */
    long L = j1 - j0;
    float score_scale = scale;
    if (r16) scale = 1.0f; /* each score rounded to bfloat16 before it is scaled, as torch's q k^T */
    for (long g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.0f; }
    for (long j = j0; j < j1;) { /* scores, a run of one cache block at a time: s[g * L + j - j0] */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j;
        const kv_t *kb0 = k + (long)bt[j / block_size] * tok + off * D;
        for (long g = 0; g < G;) {
            const float *qg = q + g * D;
            const kv_t *kb = kb0 + g / GS * block_size * D;
            long nh = GS - g % GS < 3 ? GS - g % GS : 3; /* heads of this KV head taken together */
            float *sg = s + g * L + (j - j0);
            long i = 0;
#ifdef PS_AVX2
            if (D % 8 == 0)
                for (; i + 4 <= n; i += 4) {
                    __m128 d[3];
                    if (nh == 3) dot4_heads(qg, 3, kb + i * D, D, d);
                    else if (nh == 2) dot4_heads(qg, 2, kb + i * D, D, d);
                    else dot4_heads(qg, 1, kb + i * D, D, d);
                    for (long h = 0; h < nh; h++) _mm_storeu_ps(sg + h * L + i, _mm_mul_ps(d[h], _mm_set1_ps(scale)));
                }
#endif
            for (long h = 0; h < nh; h++)
                for (long r = i; r < n; r++) sg[h * L + r] = dot_kv(qg + h * D, kb + r * D, D) * scale;
            g += nh;
        }
        j += n;
    }
    if (r16)
        for (long i = 0; i < G * L; i++) s[i] = round_bf16(s[i]) * score_scale;
    softcap_scores(s, G * L, cap);
    for (long g = 0; g < G; g++) { /* exp(s - max) and its sum, then the probabilities */
        float *sg = s + g * L;
        long j = 0;
#ifdef PS_AVX2
        if (L >= 8) { /* max_ps keeps its second operand where the first is NaN, as the loop below */
            __m256 mv = _mm256_set1_ps(-INFINITY);
            for (; j + 8 <= L; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sg + j), mv);
            float t[8];
            _mm256_storeu_ps(t, mv);
            for (int e = 0; e < 8; e++) mx[g] = t[e] > mx[g] ? t[e] : mx[g];
        }
#endif
        for (; j < L; j++) mx[g] = sg[j] > mx[g] ? sg[j] : mx[g];
        j = 0;
#ifdef PS_AVX2
        __m256 m = _mm256_set1_ps(mx[g]), tot = _mm256_setzero_ps();
#ifdef PS_AVX512
        __m512 m16 = _mm512_set1_ps(mx[g]), tot16 = _mm512_setzero_ps();
        for (; j + 16 <= L; j += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m16));
            _mm512_storeu_ps(sg + j, e);
            tot16 = _mm512_add_ps(tot16, e);
        }
        tot = add_halves(tot16);
#endif
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
        if (mx_out != NULL) { /* a piece: merge_pieces normalises */
            mx_out[g] = mx[g];
            sm_out[g] = sum[g];
            continue;
        }
        float inv = 1.0f / sum[g];
        if (r16)
            for (j = 0; j < L; j++) sg[j] = round_bf16(sg[j] * inv);
        else
            for (j = 0; j < L; j++) sg[j] *= inv;
    }
    for (long i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (long j = j0; j < j1;) { /* out += P V, a run of one cache block at a time: each V row */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j;
        const kv_t *vb0 = v + (long)bt[j / block_size] * tok + off * D; /* each row read from memory */
        for (long g = 0; g < G;) { /* once for the GS heads that share it */
            long nh = GS - g % GS < 3 ? GS - g % GS : 3, d0 = 0; /* heads of this KV head taken together */
            const kv_t *vb = vb0 + g / GS * block_size * D;
            const float *pg = s + g * L + (j - j0);
#ifdef PS_AVX512
            for (; d0 + 64 <= D; d0 += 64) /* each V row loaded (and widened) once for the nh heads */
                if (nh == 3) pv64_heads(acc + g * D, D, pg, L, 3, vb, n, d0);
                else if (nh == 2) pv64_heads(acc + g * D, D, pg, L, 2, vb, n, d0);
                else pv64_heads(acc + g * D, D, pg, L, 1, vb, n, d0);
#endif
            for (long h = 0; h < nh; h++) {
                float *ag = acc + (g + h) * D;
                const float *ph = pg + h * L;
                long e = d0;
#if defined(PS_AVX2) && !defined(PS_AVX512)
                for (; e + 64 <= D; e += 64) { /* 64 floats of the head in registers over the run */
                    __m256 o[8];
                    for (int r = 0; r < 8; r++) o[r] = _mm256_loadu_ps(ag + e + 8 * r);
                    for (long i = 0; i < n; i++) {
                        __m256 p = _mm256_set1_ps(ph[i]);
                        const kv_t *vr = vb + i * D + e;
                        for (int r = 0; r < 8; r++) o[r] = _mm256_fmadd_ps(p, kv_load8(vr + 8 * r), o[r]);
                    }
                    for (int r = 0; r < 8; r++) _mm256_storeu_ps(ag + e + 8 * r, o[r]);
                }
#endif
                if (e < D) /* the rest of the head (all of it without AVX2) */
                    for (long i = 0; i < n; i++) axpy_kv(ag + e, ph[i], vb + i * D + e, D - e);
            }
            g += nh;
        }
        j += n;
    }
}

#define EMPTY_PIECE (-1.0f) /* the sum of an empty piece's exponentials (a real one is >= 0, or NaN) */

/* One token's G heads from its P pieces (part: P records of G * D sums, G maxima, G sums of
   exponentials, as attend_range leaves them; an empty piece's sum is EMPTY_PIECE) into out.
   A NaN in a piece comes through, as in the whole-context item. */
static void merge_heads(const float *part, long P, long rec, long NR, long h0, long G, long D, float *out);

static void merge_pieces(const float *part, long P, long G, long D, float *out) {
    merge_heads(part, P, G * D + 2 * G, G, 0, G, D, out);
}

/* merge_pieces of heads h0 .. h0 + G - 1 of records of NR heads each (rec floats apart) */
static void merge_heads(const float *part, long P, long rec, long NR, long h0, long G, long D, float *out) {
    for (long g = 0; g < G; g++) {
        long h = h0 + g;
        float m = -INFINITY, den = 0.0f;
        for (long p = 0; p < P; p++) {
            const float *r = part + p * rec;
            if (r[NR * D + NR + h] != EMPTY_PIECE && r[NR * D + h] > m) m = r[NR * D + h];
        }
        for (long i = 0; i < D; i++) out[g * D + i] = 0.0f;
        for (long p = 0; p < P && m != -INFINITY; p++) { /* (no piece saw a position: zeros) */
            const float *r = part + p * rec;
            if (r[NR * D + NR + h] == EMPTY_PIECE) continue;
            float c = expf(r[NR * D + h] - m);
            den += c * r[NR * D + NR + h];
            axpy(out + g * D, c, r + h * D, D);
        }
        float inv = den == 0.0f ? 0.0f : 1.0f / den; /* no position at all: zeros, as a whole item gives */
        for (long i = 0; i < D; i++) out[g * D + i] *= inv;
    }
}

/* A decode step of fewer (token, KV head) pairs than twice the threads (one stream of the
   default model: 3 on 2 threads, one of them doing two thirds of the work): each context is
   cut into P pieces, P chosen so that the pieces share out evenly, then each token's pieces
   merged. An item is one piece of a token's every head, where attend_range takes them all (64
   heads or fewer): a block's rows of every KV head are one read, and two pieces a thread, not
   four, since each piece costs its start and its merge (docs/performance.md). Else a piece of
   one KV head's. W: a sliding window (0: none), whose positions the pieces cut. Returns 1
   where scratch memory could not be had. */
static int decode_pieces(const float *q, long ld_q, const kv_t *k_cache, const kv_t *v_cache,
                         const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B, long H,
                         long Hkv, long D, long block_size, float scale, long threads, float *out, int r16, long W,
                         float cap) {
    long G = H / Hkv, tok = Hkv * block_size * D, NK = H <= 64 ? Hkv : 1, per = Hkv / NK, NG = NK * G;
    long rec = NG * D + 2 * NG, P = (2 * threads + B * per - 1) / (B * per);
    while ((B * per * P) % threads) P++;
    long max_piece = 1;
    for (long b = 0; b < B; b++) max_piece = (seq_lens[b] + P - 1) / P > max_piece ? (seq_lens[b] + P - 1) / P : max_piece;
    float *part = (float *)malloc(sizeof(float) * (size_t)(B * per * P * rec));
    if (part == NULL) return 1;
    int failed = 0;
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(max_piece * NG));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < B * per * P; item++) {
            long b = item / (per * P), hk = item / P % per * NK, L = seq_lens[b], lo = window_start(L, W);
            long len = (L - lo + P - 1) / P, j0 = lo + item % P * len, j1 = j0 + len < L ? j0 + len : L;
            float *r = part + item * rec;
            if (s == NULL) continue;
            if (j0 >= j1) { /* past a short context: an empty piece */
                for (long g = 0; g < NG; g++) r[NG * D + NG + g] = EMPTY_PIECE;
                continue;
            }
            attend_range(q + b * ld_q + hk * G * D, k_cache + hk * block_size * D, v_cache + hk * block_size * D,
                         block_tables + b * ld_bt, j0, j1, NG, G, D, block_size, tok, scale, s, r, r + NG * D,
                         r + NG * D + NG, r16, cap);
        }
        if (!failed) {
#pragma omp for schedule(static)
            for (long bh = 0; bh < B * per; bh++)
                merge_pieces(part + bh * P * rec, P, NG, D, out + bh / per * H * D + bh % per * NG * D);
        }
        free(s);
    }
    free(part);
    return failed;
}

/* ---- verification rows: T consecutive positions of one sequence, each K/V row read once ---- */

/* One vector of VW floats where the build has them (the scalar build: one float) */
#if defined(PS_AVX512)
typedef __m512 vf;
#define VW 16
#define VLOAD _mm512_loadu_ps
#define VLOADKV kv_load16
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMAX _mm512_max_ps
#define VEXP exp16
#elif defined(PS_AVX2)
typedef __m256 vf;
#define VW 8
#define VLOAD _mm256_loadu_ps
#define VLOADKV kv_load8
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMAX _mm256_max_ps
#define VEXP exp8
#else
typedef float vf;
#define VW 1
static inline vf VLOAD(const float *p) { return *p; }
static inline vf VLOADKV(const kv_t *p) { return kvf(*p); }
static inline void VSTORE(float *p, vf v) { *p = v; }
static inline vf VSET1(float f) { return f; }
static inline vf VZERO(void) { return 0.0f; }
static inline vf VFMA(vf a, vf b, vf c) { return a * b + c; }
static inline vf VMUL(vf a, vf b) { return a * b; }
static inline vf VADD(vf a, vf b) { return a + b; }
static inline vf VSUB(vf a, vf b) { return a - b; }
static inline vf VMAX(vf a, vf b) { return a > b ? a : b; }
static inline vf VEXP(vf a) { return expf(a); }
#endif

/* v kept in a register: a value loaded once for several FMAs, not folded into each as a load */
#if VW > 1
#define IN_REG(v) __asm__("" : "+v"(v))
#else
#define IN_REG(v) ((void)0)
#endif

/* each lane rounded to bfloat16 (round_bf16's values) */
static inline vf vround_bf16(vf v) {
#if defined(PS_AVX512_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
    float t[VW];
    VSTORE(t, v);
    for (int i = 0; i < VW; i++) t[i] = round_bf16(t[i]);
    return VLOAD(t);
#endif
}

/* n values of the cache as float32: themselves in a float32 cache, else widened into buf (so
   that a run of rows read for many query heads is widened once) */
static inline const float *rows_f32(const kv_t *src, long n, float *buf) {
#if defined(KV_BF16) || defined(KV_FP8)
    long i = 0;
#ifdef PS_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf + i, kv_load16(src + i));
#endif
    for (; i < n; i++) buf[i] = kvf(src[i]);
    return buf;
#else
    (void)n, (void)buf;
    return src;
#endif
}

/* The scores of NKEY keys (k: rows D apart) against NC * VW query heads (qt: [D] rows Mp apart,
   the heads along each): s[a * Mp + h] = (q_h . k_a) * scale; r16: the dot product rounded to
   bfloat16 first. The heads along the vector: no horizontal sums, each key's value broadcast. */
static inline __attribute__((always_inline)) void score_tile(const float *k, long D, const float *qt, long Mp,
                                                             int NKEY, int NC, float scale, int r16, float *s) {
    vf acc[4][3];
    for (int a = 0; a < NKEY; a++)
        for (int c = 0; c < NC; c++) acc[a][c] = VZERO();
    for (long d = 0; d < D; d++) {
        vf qv[3];
        for (int c = 0; c < NC; c++) {
            qv[c] = VLOAD(qt + d * Mp + c * VW);
            IN_REG(qv[c]);
        }
        for (int a = 0; a < NKEY; a++) {
            vf kv = VSET1(k[a * D + d]);
            for (int c = 0; c < NC; c++) acc[a][c] = VFMA(kv, qv[c], acc[a][c]);
        }
    }
    vf sc = VSET1(scale);
    for (int a = 0; a < NKEY; a++)
        for (int c = 0; c < NC; c++) VSTORE(s + a * Mp + c * VW, VMUL(r16 ? vround_bf16(acc[a][c]) : acc[a][c], sc));
}

/* score_tile over all Mp heads, three vectors of heads at a time */
static inline __attribute__((always_inline)) void score_keys(const float *k, int NKEY, long D, const float *qt,
                                                             long Mp, float scale, int r16, float *s) {
    long C = Mp / VW, c = 0;
    for (; c + 3 <= C; c += 3) score_tile(k, D, qt + c * VW, Mp, NKEY, 3, scale, r16, s + c * VW);
    if (C - c == 2) score_tile(k, D, qt + c * VW, Mp, NKEY, 2, scale, r16, s + c * VW);
    if (C - c == 1) score_tile(k, D, qt + c * VW, Mp, NKEY, 1, scale, r16, s + c * VW);
}

/* acc[h * D + 0:D] += sum over i < n of p[i * Mp + h] v[i * D + 0:D], for NH heads: each V row
   loaded once for them, the heads' sums in registers over the run */
static inline __attribute__((always_inline)) void pv_tile(float *acc, long D, const float *p, long Mp, int NH,
                                                          const float *v, long n) {
    long d0 = 0;
    for (; d0 + 4 * VW <= D; d0 += 4 * VW) {
        vf o[3][4];
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++) o[h][r] = VLOAD(acc + h * D + d0 + r * VW);
        for (long i = 0; i < n; i++) {
            vf vv[4];
            for (int r = 0; r < 4; r++) {
                vv[r] = VLOAD(v + i * D + d0 + r * VW);
                IN_REG(vv[r]);
            }
            for (int h = 0; h < NH; h++) {
                vf pv = VSET1(p[i * Mp + h]);
                for (int r = 0; r < 4; r++) o[h][r] = VFMA(pv, vv[r], o[h][r]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++) VSTORE(acc + h * D + d0 + r * VW, o[h][r]);
    }
    for (; d0 + VW <= D; d0 += VW) {
        vf o[3];
        for (int h = 0; h < NH; h++) o[h] = VLOAD(acc + h * D + d0);
        for (long i = 0; i < n; i++) {
            vf vv = VLOAD(v + i * D + d0);
            for (int h = 0; h < NH; h++) o[h] = VFMA(VSET1(p[i * Mp + h]), vv, o[h]);
        }
        for (int h = 0; h < NH; h++) VSTORE(acc + h * D + d0, o[h]);
    }
    for (; d0 < D; d0++)
        for (int h = 0; h < NH; h++) {
            float o = acc[h * D + d0];
            for (long i = 0; i < n; i++) o += p[i * Mp + h] * v[i * D + d0];
            acc[h * D + d0] = o;
        }
}

#ifdef PS_AVX512_BF16
/* Under bfloat16 arithmetic (r16) a group's Q K^T and P V multiply in bfloat16 where the head
   is a multiple of 16 floats: vdpbf16ps sums two exact products a lane in float32, 32 products
   an instruction where an FMA takes 16. Q, K and V are bfloat16 values there already (every op
   rounds its output so); the probabilities are rounded to bfloat16 for P V, as torch's
   bfloat16 softmax rounds them (here before they are normalised). */
typedef uint32_t bf2; /* two bfloat16 values, the first in the low half: a pair vdpbf16ps takes */

static inline __m512i pairs16(__m256i lo, __m256i hi) { /* lane i: (lo[i], hi[i]) */
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

static inline __m256i bf16x16(const kv_t *p) { /* 16 values of the cache as bfloat16 (a float8 one exactly) */
#ifdef KV_BF16
    return _mm256_loadu_si256((const __m256i *)p);
#else
    return (__m256i)_mm512_cvtneps_pbh(kv_load16(p));
#endif
}

/* n values of the cache (n a multiple of 16) as bfloat16: themselves, or rounded into buf */
static inline const uint16_t *rows_bf16(const kv_t *src, long n, uint16_t *buf) {
#ifdef KV_BF16
    (void)n, (void)buf;
    return src;
#else
    for (long i = 0; i < n; i += 16) _mm256_storeu_si256((__m256i *)(buf + i), bf16x16(src + i));
    return buf;
#endif
}

/* score_tile in bfloat16: qt [D / 2] rows of Mp pairs (each head's values 2e and 2e + 1),
   each key's pair broadcast; the dot product rounded to bfloat16, then scaled */
static inline __attribute__((always_inline)) void score_tile16(const uint16_t *k, long D, const bf2 *qt, long Mp,
                                                               int NKEY, int NC, float scale, float *s) {
    __m512 acc[4][3];
    for (int a = 0; a < NKEY; a++)
        for (int c = 0; c < NC; c++) acc[a][c] = _mm512_setzero_ps();
    for (long e = 0; e < D / 2; e++) {
        __m512bh qv[3];
        for (int c = 0; c < NC; c++) {
            qv[c] = (__m512bh)_mm512_loadu_si512(qt + e * Mp + c * 16);
            IN_REG(qv[c]);
        }
        for (int a = 0; a < NKEY; a++) {
            bf2 kk;
            memcpy(&kk, k + a * D + 2 * e, 4);
            __m512bh kv = (__m512bh)_mm512_set1_epi32((int)kk);
            for (int c = 0; c < NC; c++) acc[a][c] = _mm512_dpbf16_ps(acc[a][c], kv, qv[c]);
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int a = 0; a < NKEY; a++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(s + a * Mp + c * 16, _mm512_mul_ps(vround_bf16(acc[a][c]), sc));
}

static inline __attribute__((always_inline)) void score_keys16(const uint16_t *k, int NKEY, long D, const bf2 *qt,
                                                               long Mp, float scale, float *s) {
    long C = Mp / 16, c = 0;
    for (; c + 3 <= C; c += 3) score_tile16(k, D, qt + c * 16, Mp, NKEY, 3, scale, s + c * 16);
    if (C - c == 2) score_tile16(k, D, qt + c * 16, Mp, NKEY, 2, scale, s + c * 16);
    if (C - c == 1) score_tile16(k, D, qt + c * 16, Mp, NKEY, 1, scale, s + c * 16);
}

/* pv_tile in bfloat16 over np pairs of positions: vp [np] rows of D pairs (two V rows' values
   d), pp [np] rows of Mp pairs (two probabilities of each head); R vectors of 16 a pass */
static inline __attribute__((always_inline)) void pv_tile16(float *acc, long D, const bf2 *pp, long Mp, int NH,
                                                            const bf2 *vp, long np, long d0, int R) {
    __m512 o[3][4];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < R; r++) o[h][r] = _mm512_loadu_ps(acc + h * D + d0 + r * 16);
    for (long i = 0; i < np; i++) {
        __m512bh vv[4];
        for (int r = 0; r < R; r++) {
            vv[r] = (__m512bh)_mm512_loadu_si512(vp + i * D + d0 + r * 16);
            IN_REG(vv[r]);
        }
        for (int h = 0; h < NH; h++) {
            __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[i * Mp + h]);
            for (int r = 0; r < R; r++) o[h][r] = _mm512_dpbf16_ps(o[h][r], pb, vv[r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + h * D + d0 + r * 16, o[h][r]);
}

static inline __attribute__((always_inline)) void pv_heads16(float *acc, long D, const bf2 *pp, long Mp, int NH,
                                                             const bf2 *vp, long np) {
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_tile16(acc, D, pp, Mp, NH, vp, np, d0, 4);
    for (; d0 < D; d0 += 16) pv_tile16(acc, D, pp, Mp, NH, vp, np, d0, 1);
}

/* pair i of a run: V rows 2i and 2i + 1 (v: the run's rows) as D pairs at vp, and the rows'
   probabilities (p: the run's rows of Mp) rounded as Mp pairs at pp; past the run's n rows the
   partner is a zero */
static inline void pair_rows(const kv_t *v, const float *p, long i, long n, long D, long Mp, bf2 *vp, bf2 *pp) {
    const kv_t *v0 = v + 2 * i * D;
    const float *p0 = p + 2 * i * Mp;
    int two = 2 * i + 1 < n;
    __m256i zero = _mm256_setzero_si256();
    for (long d = 0; d < D; d += 16)
        _mm512_storeu_si512(vp + d, pairs16(bf16x16(v0 + d), two ? bf16x16(v0 + D + d) : zero));
    for (long c = 0; c < Mp; c += 16)
        _mm512_storeu_si512(pp + c, pairs16((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p0 + c)),
                                            two ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p0 + Mp + c)) : zero));
}

/* acc[m * D + 0:D] += sum over i < n of p[i * Mp + m] v[i * D + 0:D] for the M heads, in
   bfloat16 pairs of positions: the run's V rows paired into vp ([(n + 1) / 2] rows of D), the
   probabilities rounded and paired into pp ([(n + 1) / 2] rows of Mp); a lone last row's
   partner is a zero */
static void pv_run16(float *acc, long D, const float *p, long Mp, long M, const kv_t *v, long n, bf2 *vp,
                     bf2 *pp) {
    long np = (n + 1) / 2, m = 0;
    for (long i = 0; i < np; i++) pair_rows(v, p, i, n, D, Mp, vp + i * D, pp + i * Mp);
    for (; m + 3 <= M; m += 3) pv_heads16(acc + m * D, D, pp + m, Mp, 3, vp, np);
    if (M - m == 2) pv_heads16(acc + m * D, D, pp + m, Mp, 2, vp, np);
    if (M - m == 1) pv_heads16(acc + m * D, D, pp + m, Mp, 1, vp, np);
}

#ifdef PS_AMX_BF16
/* Q K^T and P V in AMX tiles, where group_piece multiplies in bfloat16 and the head is 32, 64, 96
   or 128 values (amx_ready). TDPBF16PS sums its products at a width of its own, so the bits are
   not the vdpbf16ps path's; both are bfloat16 products summed in float32. */
#define AMX_PAIRS 64 /* pairs of positions gathered for one pass of P V over the tiles */

typedef struct { /* a thread's scratch for them, in group_piece's kvw after a run's keys */
    uint16_t *kpad; /* 16 keys: a run's last ones, zero rows after */
    float *sums;    /* one tile of sums */
    bf2 *vp, *pp;   /* AMX_PAIRS rows of D pairs of V values, of Mp pairs of probabilities */
    bf2 *pt;        /* the probabilities' pairs transposed: per 16 heads, per 16 pairs, 16 x 16 */
    float *acc;     /* P V: Mp rows of D sums */
} amx_scratch;

static inline long amx_floats(long block_size, long D, long Mp) {
    return (block_size * D / 2 + 15) / 16 * 16 + 8 * D + 256 + AMX_PAIRS * (D + 2 * Mp) + Mp * D;
}

static amx_scratch amx_at(float *kvw, long block_size, long D, long Mp) {
    amx_scratch a;
    a.kpad = (uint16_t *)(kvw + (block_size * D / 2 + 15) / 16 * 16);
    a.sums = (float *)a.kpad + 8 * D;
    a.vp = (bf2 *)(a.sums + 256);
    a.pp = a.vp + AMX_PAIRS * D;
    a.pt = a.pp + AMX_PAIRS * Mp;
    a.acc = (float *)(a.pt + AMX_PAIRS * Mp);
    return a;
}

/* tile C += the keys' chunk dc (tile 4 + dc) times the heads' (tile 3): the instruction names
   its tiles as constants */
#define KEYS_X_HEADS(C, dc)                              \
    do {                                                 \
        switch (dc) {                                    \
        case 0: _tile_dpbf16ps(C, 4, 3); break;          \
        case 1: _tile_dpbf16ps(C, 5, 3); break;          \
        case 2: _tile_dpbf16ps(C, 6, 3); break;          \
        default: _tile_dpbf16ps(C, 7, 3);                \
        }                                                \
    } while (0)

/* the scores of a run's n keys (kb: n rows of D bfloat16 values) against the heads (qp: D / 2
   rows of Mp pairs), as score_keys16 writes them: per 16 keys, the keys' chunks of 32 values in
   tiles 4.. and up to three tiles of 16 heads' sums at once */
static void scores_amx(const uint16_t *kb, long n, long D, const bf2 *qp, long Mp, float scale, float *s,
                       amx_scratch *a) {
    long nd = D / 32;
    __m512 sc = _mm512_set1_ps(scale);
    for (long i = 0; i < n; i += 16) {
        long nk = n - i < 16 ? n - i : 16;
        const uint16_t *k = kb + i * D;
        if (nk < 16) {
            memcpy(a->kpad, k, sizeof(uint16_t) * (size_t)(nk * D));
            memset(a->kpad + nk * D, 0, sizeof(uint16_t) * (size_t)((16 - nk) * D));
            k = a->kpad;
        }
        _tile_loadd(4, k, 2 * D);
        if (nd > 1) _tile_loadd(5, k + 32, 2 * D);
        if (nd > 2) _tile_loadd(6, k + 64, 2 * D);
        if (nd > 3) _tile_loadd(7, k + 96, 2 * D);
        for (long c = 0; c < Mp; c += 48) {
            long nc = (Mp - c) / 16 < 3 ? (Mp - c) / 16 : 3;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (long dc = 0; dc < nd; dc++) {
                const bf2 *q = qp + 16 * dc * Mp + c;
                _tile_loadd(3, q, 4 * Mp);
                KEYS_X_HEADS(0, dc);
                if (nc > 1) {
                    _tile_loadd(3, q + 16, 4 * Mp);
                    KEYS_X_HEADS(1, dc);
                }
                if (nc > 2) {
                    _tile_loadd(3, q + 32, 4 * Mp);
                    KEYS_X_HEADS(2, dc);
                }
            }
            for (long t = 0; t < nc; t++) {
                if (t == 0) _tile_stored(0, a->sums, 64);
                if (t == 1) _tile_stored(1, a->sums, 64);
                if (t == 2) _tile_stored(2, a->sums, 64);
                for (long r = 0; r < nk; r++)
                    _mm512_storeu_ps(s + (i + r) * Mp + c + 16 * t,
                                     _mm512_mul_ps(vround_bf16(_mm512_loadu_ps(a->sums + 16 * r)), sc));
            }
        }
    }
}

/* acc (Mp rows of D) += P V over the np pairs gathered in a->vp and a->pp, in order: the pairs
   zero-padded to a multiple of 16 and the probabilities transposed (a->pt), then per 16 heads
   and 64 values, four tiles of sums over every pair */
static void pv_amx(long D, long Mp, long np, amx_scratch *a) {
    long nch = (np + 15) / 16;
    for (long i = np; i < 16 * nch; i++) {
        memset(a->vp + i * D, 0, sizeof(bf2) * (size_t)D);
        memset(a->pp + i * Mp, 0, sizeof(bf2) * (size_t)Mp);
    }
    for (long c = 0; c < Mp / 16; c++)
        for (long ch = 0; ch < nch; ch++) transpose16(a->pp + 16 * ch * Mp + 16 * c, Mp, a->pt + (c * nch + ch) * 256);
    for (long c = 0; c < Mp / 16; c++)
        for (long d0 = 0; d0 < D; d0 += 64) {
            long nt = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4; /* 2 or 4: D is a multiple of 32 */
            float *o = a->acc + 16 * c * D + d0;
            _tile_loadd(0, o, 4 * D);
            _tile_loadd(1, o + 16, 4 * D);
            if (nt > 2) {
                _tile_loadd(2, o + 32, 4 * D);
                _tile_loadd(3, o + 48, 4 * D);
            }
            for (long ch = 0; ch < nch; ch++) {
                const bf2 *v = a->vp + 16 * ch * D + d0;
                _tile_loadd(4, a->pt + (c * nch + ch) * 256, 64);
                _tile_loadd(5, v, 4 * D);
                _tile_loadd(6, v + 16, 4 * D);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                if (nt > 2) {
                    _tile_loadd(7, v + 32, 4 * D);
                    _tile_loadd(5, v + 48, 4 * D);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, o, 4 * D);
            _tile_stored(1, o + 16, 4 * D);
            if (nt > 2) {
                _tile_stored(2, o + 32, 4 * D);
                _tile_stored(3, o + 48, 4 * D);
            }
        }
}
#endif
#endif

/* floats of group_piece's kvw: a run of K or V rows widened, or (bfloat16 products) a run's
   pairs of V rows and of probabilities, or (AMX) amx_floats */
static inline long kvw_floats(long block_size, long D, long Mp) {
    long wide = block_size * D, pairs = (block_size / 2 + 1) * (D + Mp);
#ifdef PS_AMX_BF16
    long tiles = amx_floats(block_size, D, Mp);
    wide = wide > tiles ? wide : tiles;
#endif
    return wide > pairs ? wide : pairs;
}

/* One piece (positions j0..j1-1) of the M = T * G query heads of T rows that share one KV head:
   rows q (ld_q apart) of consecutive positions of one sequence, row t seeing its first lens[t]
   positions (the positions past a row's own masked out). k, v: this KV head's rows in block 0.
   Leaves a piece record at rec as attend_range does: [M][D] unnormalised sums, M maxima, M sums
   of exponentials (head t * G + g: row t's head g). qt: scratch of D * Mp floats, the rows'
   heads gathered transposed (with bfloat16 products: D / 2 rows of Mp pairs); s: (j1 - j0) * Mp
   floats, the scores with the heads along a row; kvw: kvw_floats(block_size, D, Mp) floats, a
   run of K or V rows widened, or a run's pairs. W: a sliding window (0: none), row t seeing
   positions window_start(lens[t], W) on only; a row that sees none of the piece leaves an
   empty piece (EMPTY_PIECE) for merge_heads. */
static void group_piece(const float *q, long ld_q, long T, long G, long D, const kv_t *k, const kv_t *v,
                        const int32_t *bt, long block_size, long tok, const int32_t *lens, long j0, long j1,
                        float scale, int r16, float *qt, float *s, float *rec, float *kvw, long W, float cap) {
    long M = T * G, Mp = (M + 15) / 16 * 16, L = j1 - j0;
    int b16 = 0; /* bfloat16 products */
#ifdef PS_AMX_BF16
    amx_scratch ta = amx_at(kvw, block_size, D, Mp);
    int amx = r16 && D % 32 == 0 && D <= 128 && amx_ready(); /* in AMX tiles (configured only while in use) */
#endif
#ifdef PS_AVX512_BF16
    b16 = r16 && D % 16 == 0;
    if (b16) { /* qt: [D / 2] rows of Mp pairs */
        bf2 *qp = (bf2 *)qt;
        for (long e = 0; e < D / 2; e++)
            for (long m = 0; m < Mp; m++) {
                const float *qm = q + m / G * ld_q + m % G * D + 2 * e;
                bf2 lo, hi;
                float a = m < M ? round_bf16(qm[0]) : 0.0f, b = m < M ? round_bf16(qm[1]) : 0.0f;
                memcpy(&lo, &a, 4);
                memcpy(&hi, &b, 4);
                qp[e * Mp + m] = lo >> 16 | (hi & 0xFFFF0000u);
            }
        for (long j = j0; j < j1;) { /* scores, a run of one cache block at a time */
            long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j, i = 0;
            const uint16_t *kb = rows_bf16(k + (long)bt[j / block_size] * tok + off * D, n * D, (uint16_t *)kvw);
            float *sj = s + (j - j0) * Mp;
#ifdef PS_AMX_BF16
            if (amx) {
                if (j == j0) amx_tiles(8);
                scores_amx(kb, n, D, qp, Mp, scale, sj, &ta);
                j += n;
                if (j == j1) _tile_release();
                continue;
            }
#endif
            for (; i + 4 <= n; i += 4) score_keys16(kb + i * D, 4, D, qp, Mp, scale, sj + i * Mp);
            for (; i < n; i++) score_keys16(kb + i * D, 1, D, qp, Mp, scale, sj + i * Mp);
            j += n;
        }
    }
#endif
    if (!b16) {
        for (long d = 0; d < D; d++)
            for (long m = M; m < Mp; m++) qt[d * Mp + m] = 0.0f;
        for (long t = 0; t < T; t++)
            for (long g = 0; g < G; g++)
                for (long d = 0; d < D; d++) qt[d * Mp + t * G + g] = q[t * ld_q + g * D + d];
        for (long j = j0; j < j1;) { /* scores, a run of one cache block at a time */
            long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j, i = 0;
            const float *kb = rows_f32(k + (long)bt[j / block_size] * tok + off * D, n * D, kvw);
            float *sj = s + (j - j0) * Mp;
            for (; i + 4 <= n; i += 4) score_keys(kb + i * D, 4, D, qt, Mp, scale, r16, sj + i * Mp);
            for (; i < n; i++) score_keys(kb + i * D, 1, D, qt, Mp, scale, r16, sj + i * Mp);
            j += n;
        }
    }
    softcap_scores(s, L * Mp, cap);
    for (long t = 0; t < T; t++) { /* positions past a row's own, or before its window: no weight */
        for (long j = lens[t] > j0 ? lens[t] : j0; j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = -INFINITY;
        for (long j = j0, lo = window_start(lens[t], W); j < lo && j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = -INFINITY;
    }
    float *mx_out = rec + M * D, *sm_out = mx_out + M;
    for (long c = 0; c < Mp; c += VW) { /* each head's max, exp(s - max) and its sum, VW heads at once */
        vf mv = VSET1(-INFINITY), tot = VZERO();
        for (long j = 0; j < L; j++) mv = VMAX(VLOAD(s + j * Mp + c), mv);
        for (long j = 0; j < L; j++) {
            vf e = VEXP(VSUB(VLOAD(s + j * Mp + c), mv));
            VSTORE(s + j * Mp + c, e);
            tot = VADD(tot, e);
        }
        float mxs[VW], sms[VW];
        VSTORE(mxs, mv);
        VSTORE(sms, tot);
        for (long h = 0; h < VW && c + h < M; h++) mx_out[c + h] = mxs[h], sm_out[c + h] = sms[h];
    }
    for (long t = 0; t < T; t++) { /* exp's floor left the masked positions a tiny weight: none */
        for (long j = lens[t] > j0 ? lens[t] : j0; j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = 0.0f;
        long lo = window_start(lens[t], W);
        for (long j = j0; j < lo && j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = 0.0f;
        if (lo >= j1 || lens[t] <= j0) /* (its exponentials summed NaN) */
            for (long g = 0; g < G; g++) sm_out[t * G + g] = EMPTY_PIECE;
    }
    for (long i = 0; i < M * D; i++) rec[i] = 0.0f;
#ifdef PS_AMX_BF16
    if (amx) { /* P V: the runs' pairs gathered AMX_PAIRS at a time */
        long np = 0;
        memset(ta.acc, 0, sizeof(float) * (size_t)(Mp * D));
        amx_tiles(8);
        for (long j = j0; j < j1;) {
            long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j;
            const kv_t *vr = v + (long)bt[j / block_size] * tok + off * D;
            for (long i = 0; i < (n + 1) / 2; i++, np++) {
                if (np == AMX_PAIRS) pv_amx(D, Mp, np, &ta), np = 0;
                pair_rows(vr, s + (j - j0) * Mp, i, n, D, Mp, ta.vp + np * D, ta.pp + np * Mp);
            }
            j += n;
        }
        if (np > 0) pv_amx(D, Mp, np, &ta);
        memcpy(rec, ta.acc, sizeof(float) * (size_t)(M * D));
        _tile_release();
        return;
    }
#endif
    for (long j = j0; j < j1;) { /* P V, a run of one cache block at a time, three heads a pass */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j, m = 0;
        const kv_t *vr = v + (long)bt[j / block_size] * tok + off * D;
        const float *pj = s + (j - j0) * Mp;
#ifdef PS_AVX512_BF16
        if (b16) {
            pv_run16(rec, D, pj, Mp, M, vr, n, (bf2 *)kvw, (bf2 *)kvw + (block_size / 2 + 1) * D);
            j += n;
            continue;
        }
#endif
        const float *vb = rows_f32(vr, n * D, kvw);
        for (; m + 3 <= M; m += 3) pv_tile(rec + m * D, D, pj + m, Mp, 3, vb, n);
        if (M - m == 2) pv_tile(rec + m * D, D, pj + m, Mp, 2, vb, n);
        if (M - m == 1) pv_tile(rec + m * D, D, pj + m, Mp, 1, vb, n);
        j += n;
    }
}

#define GROUP_PIECE 256 /* positions a piece at most: its scores stay in L2 */
#define GROUP_ROWS 17 /* the longest chunk of a step that decode_groups takes (the decoder stack's rows) */

/* A decode step whose rows come in groups (gstart[ng + 1]: group i is rows gstart[i] ..
   gstart[i + 1] - 1), each group consecutive positions of one sequence (the rows of a
   speculative verification; a row of its own is a group of one): a group's rows x G heads of
   a KV head are one item over the positions its first row sees, cut into pieces of at most
   GROUP_PIECE, so each K/V row is read once for all of them; the last piece also covers the
   later rows' own positions, masked per row. Pieces merged per row as decode_pieces merges
   them. A row alone (a decode beside short chunks) would work G lanes of a vector there: in a
   step of at least 4 groups a thread it is one item of all its heads (64 or fewer), as a step
   of as many decodes only takes it (the same bits), else attend_range's pieces of each KV head's
   heads, which the threads share. seq_lens: per row; block_tables: per row, or (by_group) per
   group. W: a sliding window (0: none); the pieces then cut what the first row's window sees.
   Returns 1 where scratch memory could not be had. */
static int decode_groups(const float *q, long ld_q, const kv_t *k_cache, const kv_t *v_cache,
                         const int32_t *block_tables, long ld_bt, int by_group, const int32_t *seq_lens, long B,
                         long H, long Hkv, long D, long block_size, float scale, long threads, const long *gstart,
                         long ng, float *out, int r16, long W, float cap) {
    long G = H / Hkv, tok = Hkv * block_size * D, nitems = 0, total = 0, max_qt = D * 16, max_s = 0;
    long *gp = (long *)malloc(sizeof(long) * (size_t)(4 * ng + B)); /* per group: pieces, length, offset, items */
    if (gp == NULL) return 1;
    long *row_group = gp + 4 * ng;
    int whole = ng >= 4 * threads && H <= 64; /* a row alone: one item of all its heads */
    long split = 0; /* groups cut into items of a KV head */
    for (long i = 0; i < ng; i++)
        split += !(whole && gstart[i + 1] - gstart[i] == 1) && gstart[i + 1] > gstart[i];
    long want = split ? (2 * threads + Hkv * split - 1) / (Hkv * split) : 1; /* pieces a group: two items a thread */
    for (long i = 0; i < ng; i++) {
        long T = gstart[i + 1] - gstart[i], M = T * G, Mp = (M + 15) / 16 * 16;
        long L0 = T > 0 ? seq_lens[gstart[i]] : 0, span = L0 - window_start(L0, W); /* what the first row sees */
        for (long b = gstart[i]; b < gstart[i + 1]; b++) row_group[b] = i;
        if (T == 0 || (whole && T == 1)) { /* no rows; or one item, its output written there */
            gp[4 * i] = 1, gp[4 * i + 1] = L0, gp[4 * i + 2] = total, gp[4 * i + 3] = T;
            nitems += T;
            max_s = (L0 + 1) * H > max_s ? (L0 + 1) * H : max_s;
            continue;
        }
        long P = (span + GROUP_PIECE - 1) / GROUP_PIECE;
        P = P > want ? P : want;
        P = P < span ? P : span;
        P = P > 1 ? P : 1; /* (a row that sees nothing: one empty piece) */
        long len = span > 0 ? (span + P - 1) / P : 0;
        P = span > 0 ? (span + len - 1) / len : 1; /* none empty for the first row */
        gp[4 * i] = P, gp[4 * i + 1] = len, gp[4 * i + 2] = total, gp[4 * i + 3] = Hkv * P;
        total += Hkv * P * (M * D + 2 * M);
        nitems += Hkv * P;
        max_qt = D * Mp > max_qt ? D * Mp : max_qt;
        /* one row more than a piece's scores: GCC's vectorising of pv_tile in a build without
           AVX2 (-march=x86-64) reads the row after a run */
        max_s = (len + T) * Mp > max_s ? (len + T) * Mp : max_s;
    }
    float *part = (float *)malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (part == NULL) {
        free(gp);
        return 1;
    }
    int failed = 0;
#pragma omp parallel if (nitems > 1)
    {
        float *qt = (float *)malloc(sizeof(float) * (size_t)max_qt), *s = (float *)malloc(sizeof(float) * (size_t)max_s);
        float *kvw = (float *)malloc(sizeof(float) * (size_t)kvw_floats(block_size, D, max_qt / D));
        if (qt == NULL || s == NULL || kvw == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < nitems; item++) {
            if (qt == NULL || s == NULL || kvw == NULL) continue;
            long i = 0, first = 0; /* the group: items run group by group */
            while (item >= first + gp[4 * i + 3]) first += gp[4 * i++ + 3];
            long P = gp[4 * i], len = gp[4 * i + 1], b = gstart[i], T = gstart[i + 1] - b, M = T * G;
            const int32_t *bt = block_tables + (by_group ? i : b) * ld_bt;
            if (whole && T == 1) {
                attend_range(q + b * ld_q, k_cache, v_cache, bt, window_start(seq_lens[b], W), seq_lens[b], H, G, D,
                             block_size, tok, scale, s, out + b * H * D, NULL, NULL, r16, cap);
                continue;
            }
            long hk = (item - first) / P, p = (item - first) % P, L0 = seq_lens[b];
            long j0 = window_start(L0, W) + p * len;
            long j1 = p == P - 1 ? seq_lens[b + T - 1] : (j0 + len < L0 ? j0 + len : L0);
            float *rec = part + gp[4 * i + 2] + (item - first) * (M * D + 2 * M);
            if (T == 1) /* attend_range's piece: the same record */
                attend_range(q + b * ld_q + hk * G * D, k_cache + hk * block_size * D, v_cache + hk * block_size * D,
                             bt, j0, j1, G, G, D, block_size, tok, scale, s, rec, rec + M * D, rec + M * D + M, r16,
                             cap);
            else
                group_piece(q + b * ld_q + hk * G * D, ld_q, T, G, D, k_cache + hk * block_size * D,
                            v_cache + hk * block_size * D, bt, block_size, tok, seq_lens + b, j0, j1, scale, r16, qt,
                            s, rec, kvw, W, cap);
        }
        if (!failed) {
#pragma omp for schedule(static)
            for (long bh = 0; bh < B * Hkv; bh++) {
                long b = bh / Hkv, hk = bh % Hkv, i = row_group[b], T = gstart[i + 1] - gstart[i], M = T * G;
                long rec = M * D + 2 * M, P = gp[4 * i];
                if (whole && T == 1) continue; /* written by its item */
                merge_heads(part + gp[4 * i + 2] + hk * P * rec, P, rec, M, (b - gstart[i]) * G, G, D,
                            out + b * H * D + hk * G * D);
            }
        }
        free(qt);
        free(s);
        free(kvw);
    }
    free(part);
    free(gp);
    return failed;
}

#define PROMPT_LANES 48 /* query heads (rows x the heads of a KV head) an item of a long chunk takes at most */

/* A step with a chunk longer than GROUP_ROWS (a prompt): each request's rows cut into groups of
   consecutive positions, PROMPT_LANES query heads at most (rows x the G heads of a KV head). An
   item is one group's heads of one KV head over every position its last row sees, as one piece
   of group_piece (the heads along the vector, so no sums across lanes; each K/V row read once
   for all of them; each row's positions past its own masked), then normalised as merge_pieces
   normalises a single piece. A request of one row (a decode in the step) is one item of all its
   heads (64 or fewer) in attend_range, as without the chunk: a group of one row would work G
   lanes of a vector. bt_rows: request b's block table is row bt_rows[b] (NULL: row b). W: a
   sliding window (0: none); an item then starts where its first row's window does. Returns 1
   where scratch memory could not be had. */
static int prompt_groups(const float *q, long ld_q, const kv_t *k_cache, const kv_t *v_cache,
                         const int32_t *block_tables, long ld_bt, const long *bt_rows,
                         const int32_t *query_start_loc, const int32_t *seq_lens, long B, long H, long Hkv, long D,
                         long block_size, float scale, float *out, int r16, long W, float cap) {
    long G = H / Hkv, tok = Hkv * block_size * D, rows = PROMPT_LANES / G > 1 ? PROMPT_LANES / G : 1;
    long nitems = 0, max_len = 1, Mp = (rows * G + 15) / 16 * 16, all = H <= 64; /* all: a decode's heads one item */
    for (long b = 0; b < B; b++) {
        long n = query_start_loc[b + 1] - query_start_loc[b];
        nitems += n == 1 && all ? 1 : (n + rows - 1) / rows * Hkv;
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    }
    long *items = (long *)malloc(sizeof(long) * (size_t)(3 * nitems + 1)); /* first row, request, KV head (-1: all) */
    if (items == NULL) return 1;
    for (long b = 0, i = 0; b < B; b++) {
        long t0 = query_start_loc[b], end = query_start_loc[b + 1];
        if (end - t0 == 1 && all) {
            items[3 * i] = t0, items[3 * i + 1] = b, items[3 * i + 2] = -1, i++;
            continue;
        }
        for (long t = t0; t < end; t += rows)
            for (long hk = 0; hk < Hkv; hk++, i++) items[3 * i] = t, items[3 * i + 1] = b, items[3 * i + 2] = hk;
    }
    long lanes = Mp > H ? Mp : H; /* a score row: a group's heads, or a decode's every head */
    int failed = 0;
#pragma omp parallel if (nitems > 1)
    {
        float *qt = (float *)malloc(sizeof(float) * (size_t)(D * Mp));
        float *s = (float *)malloc(sizeof(float) * (size_t)((max_len + 1) * lanes)); /* a row more, as decode_groups */
        float *rec = (float *)malloc(sizeof(float) * (size_t)(rows * G * (D + 2)));
        float *kvw = (float *)malloc(sizeof(float) * (size_t)kvw_floats(block_size, D, Mp));
        int32_t lens[PROMPT_LANES];
        if (qt == NULL || s == NULL || rec == NULL || kvw == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < nitems; item++) {
            if (qt == NULL || s == NULL || rec == NULL || kvw == NULL) continue;
            long t0 = items[3 * item], b = items[3 * item + 1], hk = items[3 * item + 2];
            long end = query_start_loc[b + 1], T = end - t0 < rows ? end - t0 : rows, M = T * G;
            const int32_t *bt = block_tables + (bt_rows != NULL ? bt_rows[b] : b) * ld_bt;
            if (hk < 0) { /* a decode beside the chunks: a token's item of every head, as without them */
                attend_range(q + t0 * ld_q, k_cache, v_cache, bt, window_start(seq_lens[b], W), seq_lens[b], H, G, D,
                             block_size, tok, scale, s, out + t0 * H * D, NULL, NULL, r16, cap);
                continue;
            }
            for (long t = 0; t < T; t++) lens[t] = seq_lens[b] - (int32_t)(end - 1 - (t0 + t));
            group_piece(q + t0 * ld_q + hk * G * D, ld_q, T, G, D, k_cache + hk * block_size * D,
                        v_cache + hk * block_size * D, bt, block_size, tok, lens, window_start(lens[0], W),
                        lens[T - 1], scale, r16, qt, s, rec, kvw, W, cap);
            for (long t = 0; t < T; t++)
                merge_heads(rec, 1, M * D + 2 * M, M, t * G, G, D, out + (t0 + t) * H * D + hk * G * D);
        }
        free(qt);
        free(s);
        free(rec);
        free(kvw);
    }
    free(items);
    return failed;
}

/* Rows of a decode step in groups of consecutive positions of one sequence: gstart[0..ng]
   (gstart[ng] = B), each group rows whose seq_lens go up by one and whose block tables agree
   over the blocks each row reads. Returns the number of groups. */
static long find_groups(const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B, long block_size,
                        long *gstart) {
    long ng = 0;
    for (long b = 0; b < B;) {
        long e = b + 1;
        if (seq_lens[b] >= 1)
            while (e < B && seq_lens[e] == seq_lens[e - 1] + 1 &&
                   !memcmp(block_tables + b * ld_bt, block_tables + e * ld_bt,
                           sizeof(int32_t) * (size_t)((seq_lens[e] + block_size - 1) / block_size)))
                e++;
        gstart[ng++] = b;
        b = e;
    }
    gstart[ng] = B;
    return ng;
}

static int attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                     kv_t *k_cache, kv_t *v_cache, const int64_t *slots, long T,
                     const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                     const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                     float scale, float *out, int r16, long W, float cap);

/* Decode rows (one block table each) in groups (gstart, as find_groups leaves them) of which one
   is longer than GROUP_ROWS: each group as a request's chunk of a step (prompt_groups), so a
   prompt's rows passed as decodes (the decoder stack's) attend to the bit as the chunk would,
   and so do decodes beside it. Returns 1 where scratch memory could not be had. */
static int groups_as_prompts(const float *q, long ld_q, const kv_t *k_cache, const kv_t *v_cache,
                             const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long H, long Hkv,
                             long D, long block_size, float scale, const long *gstart, long ng, float *out, int r16,
                             long W, float cap) {
    int32_t *qsl = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * ng + 1)), *lens = qsl + ng + 1;
    if (qsl == NULL) return 1;
    for (long i = 0; i <= ng; i++) qsl[i] = (int32_t)gstart[i];
    for (long i = 0; i < ng; i++) lens[i] = seq_lens[gstart[i + 1] - 1];
    int failed = prompt_groups(q, ld_q, k_cache, v_cache, block_tables, ld_bt, gstart, qsl, lens, ng, H, Hkv, D,
                               block_size, scale, out, r16, W, cap);
    free(qsl);
    return failed;
}

/* Paged attention of any step, straight from the cache blocks. First the step's new K/V
   ([T, Hkv, D], token rows ld_kv apart) are written at their slots (a negative slot writes
   nothing); then each query token attends, causally, to its own position and every one before
   it: for token t of request b, softmax(q . K^T * scale) V over the first L positions of b's
   context, L = its position + 1 (with a sliding window W > 0, the last W of them), in float32 (a max pass, an exp-and-sum pass, a normalising
   pass, as torch's softmax, then the weighted sum; exp is exp8's polynomial, within 2 ulp;
   scores four keys at a time). query_start_loc [B + 1]: request b's query tokens are rows
   query_start_loc[b] .. query_start_loc[b + 1] - 1, the last of its seq_lens[b] positions;
   NULL: one token per request (a decode step, T = B). Returns 1 if scratch memory for the
   scores could not be had (the output is then not to be used), else 0.
   q: [T, H, D] token rows ld_q apart; caches: [blocks, Hkv, block_size, D] contiguous;
   block_tables: [B, ld_bt] int32; out: [T, H, D] contiguous. A work item is one token's G =
   H / Hkv query heads that share a KV head (their K/V rows are read once from memory), or,
   with at least four tokens a thread, all of one token's heads. A decode step of fewer items
   than twice the threads cuts each context into pieces instead (decode_pieces): the same
   arithmetic per piece, the pieces merged by their maxima, so not the same bits as one item.
   A step with rows of one sequence's consecutive positions (decodes found so, or chunks of at
   most GROUP_ROWS) goes by groups instead (decode_groups): each group's K/V read once, in pieces,
   and each row alone, in a step of many groups, one item of its heads as above.
   A step with a longer chunk (a prompt; or decodes found to be a run of more than GROUP_ROWS,
   the decoder stack's prompt rows) goes by groups of up to PROMPT_LANES query heads
   (prompt_groups), each over its whole context at once; the triangle above the causal diagonal
   is computed only within a group (torch's SDPA with a mask computes the whole square).
   r16: the scores, the probabilities (of a token's item) and the output rounded to bfloat16, as
   torch_ops.paged_attention's decode path rounds them in bfloat16; pieces leave their
   probabilities unrounded until normalised, and groups (heads of 16n floats, with AVX512-BF16)
   round them unnormalised for their bfloat16 P V. */
int KV_NAME(paged_attention)(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                            kv_t *k_cache, kv_t *v_cache, const int64_t *slots, long T,
                            const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                            const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                            float scale, float *out, int r16, long W, float cap) {
    int failed = attention(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, T, block_tables, ld_bt,
                           query_start_loc, seq_lens, B, H, Hkv, D, block_size, scale, out, r16, W, cap);
    if (r16 && !failed) /* the output rounded to bfloat16, as torch's P V */
        for (long i = 0; i < T * H * D; i++) out[i] = round_bf16(out[i]);
    return failed;
}

static int attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                     kv_t *k_cache, kv_t *v_cache, const int64_t *slots, long T,
                     const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                     const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                     float scale, float *out, int r16, long W, float cap) {
    long G = H / Hkv, tok = Hkv * block_size * D; /* floats per cache block */
    long max_len = 1;
    for (long b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    for (long t = 0; t < T; t++) {
        if (slots[t] < 0) continue; /* a padding row: writes nowhere */
        long blk = slots[t] / block_size, off = slots[t] % block_size;
        for (long h = 0; h < Hkv; h++) {
            kv_t *kd = k_cache + blk * tok + (h * block_size + off) * D;
            kv_t *vd = v_cache + blk * tok + (h * block_size + off) * D;
            for (long i = 0; i < D; i++) {
                kd[i] = to_kv(k_new[t * ld_kv + h * D + i]);
                vd[i] = to_kv(v_new[t * ld_kv + h * D + i]);
            }
        }
    }
    long threads = omp_get_max_threads();
    long longest = 0; /* a step of chunks of at most GROUP_ROWS rows: each chunk a group */
    for (long b = 0; query_start_loc != NULL && b < B; b++)
        if (query_start_loc[b + 1] - query_start_loc[b] > longest) longest = query_start_loc[b + 1] - query_start_loc[b];
    if (T > 1 && (query_start_loc == NULL || longest <= GROUP_ROWS)) {
        /* rows of one sequence's consecutive positions read its K/V once (decode_groups): the
           decoder stack passes them as decodes, found here; a chunk of a step is one */
        long *gstart = (long *)malloc(sizeof(long) * (size_t)(T + 1));
        int32_t *lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
        int failed = gstart == NULL || lens == NULL;
        if (!failed) {
            long ng = B;
            if (query_start_loc == NULL) {
                ng = find_groups(block_tables, ld_bt, seq_lens, B, block_size, gstart);
                memcpy(lens, seq_lens, sizeof(int32_t) * (size_t)T);
                for (long i = 0; i < ng; i++)
                    if (gstart[i + 1] - gstart[i] > GROUP_ROWS) { /* a prompt's rows: as prompt_groups takes them */
                        failed = groups_as_prompts(q, ld_q, k_cache, v_cache, block_tables, ld_bt, seq_lens, H, Hkv,
                                                   D, block_size, scale, gstart, ng, out, r16, W, cap);
                        free(gstart);
                        free(lens);
                        return failed;
                    }
            } else {
                for (long r = 0; r < B; r++) {
                    gstart[r] = query_start_loc[r];
                    for (long t = query_start_loc[r]; t < query_start_loc[r + 1]; t++)
                        lens[t] = seq_lens[r] - (query_start_loc[r + 1] - 1 - t);
                }
                gstart[B] = T;
            }
            failed = ng < T ? decode_groups(q, ld_q, k_cache, v_cache, block_tables, ld_bt, query_start_loc != NULL,
                                            lens, T, H, Hkv, D, block_size, scale, threads, gstart, ng, out, r16,
                                            W, cap)
                            : -1;
        }
        free(gstart);
        free(lens);
        if (failed >= 0) return failed;
    }
    if (query_start_loc != NULL && longest > GROUP_ROWS)
        return prompt_groups(q, ld_q, k_cache, v_cache, block_tables, ld_bt, NULL, query_start_loc, seq_lens, B, H,
                             Hkv, D, block_size, scale, out, r16, W, cap);
    if (query_start_loc == NULL && threads > 1 && T > 0 && T * Hkv < 2 * threads)
        return decode_pieces(q, ld_q, k_cache, v_cache, block_tables, ld_bt, seq_lens, B, H, Hkv, D, block_size,
                             scale, threads, out, r16, W, cap);
    /* a work item: one token's heads of NK KV heads. All of them where the tokens alone share
       out well, since a block's rows of every KV head lie together and are then one read
       (docs/performance.md); else one KV head's */
    long NK = T >= 4 * threads && H <= 64 ? Hkv : 1, per = Hkv / NK, NG = NK * G;
    int failed = 0;
#pragma omp parallel if (T * per > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(max_len * NG)); /* this thread's scores */
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < T * per; item++) {
            long t = item / per, hk = item % per * NK, b = t, L;
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
            attend_range(q + t * ld_q + hk * G * D, k_cache + hk * block_size * D, v_cache + hk * block_size * D,
                         block_tables + b * ld_bt, window_start(L, W), L, NG, G, D, block_size, tok, scale, s,
                         out + t * H * D + hk * G * D, NULL, NULL, r16, cap);
        }
        free(s);
    }
    return failed;
}

#if !defined(KV_BF16) && !defined(KV_FP8)
/* The exported entries: kv_format says what the caches hold: 0 float32, 1 bfloat16 (uint16_t),
   2 float8 e4m3fn (uint8_t); window: a sliding window (0: none); softcap: Gemma 2's cap on the
   scores (0: none) */
int pageserve_paged_attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                              void *k_cache, void *v_cache, const int64_t *slots, long T,
                              const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                              const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                              float scale, float *out, int r16, int kv_format, long window, float softcap) {
    if (kv_format == 2)
        return paged_attention_kv8(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, T, block_tables, ld_bt,
                                   query_start_loc, seq_lens, B, H, Hkv, D, block_size, scale, out, r16, window,
                                   softcap);
    return kv_format ? paged_attention_kv16(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, T, block_tables,
                                            ld_bt, query_start_loc, seq_lens, B, H, Hkv, D, block_size, scale, out, r16,
                                            window, softcap)
                     : paged_attention_kv32(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, T, block_tables,
                                            ld_bt, query_start_loc, seq_lens, B, H, Hkv, D, block_size, scale, out, r16,
                                            window, softcap);
}

/* pageserve_paged_attention of a decode step: one query token per request (T = B) */
int pageserve_paged_decode(const float *q, long ld_q, const float *k_new, const float *v_new,
                            long ld_kv, void *k_cache, void *v_cache, const int64_t *slots,
                            const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B,
                            long H, long Hkv, long D, long block_size, float scale, float *out, int r16,
                            int kv_format) {
    return pageserve_paged_attention(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, B, block_tables,
                                     ld_bt, NULL, seq_lens, B, H, Hkv, D, block_size, scale, out, r16, kv_format, 0,
                                     0.0f);
}
#endif
