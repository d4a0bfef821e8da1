/* Float32 kernels of the CPU path, built at first use by cpu_kernels.py with the machine's own
   -march, together with cpu_linear.c (the linear layer): the small ops of a decoder layer
   (RMSNorm with the residual, rotary embedding, SiLU-and-mul), each one call where torch runs
   3-20 small ops; causal attention of any step straight from the paged cache; and a
   Llama-style model's whole decoder stack for a decode-only step in one call (the
   interpreter's time between ~300 kernel calls a step was a third of one stream's step). */

#include "cpu_kernels.h"
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif

/* ---- the small ops of a decoder layer: one call each instead of 3-20 torch ops ---- */

#define PAR_ROWS 16 /* a step of fewer rows runs on one thread: starting the team costs more */

/* RMSNorm fused with the residual add. x, residual (or NULL), out, res_out: [T, H] rows ldx,
   ldr, ldo, ldo apart. res_out = x + residual (x when there is none); out = w * res_out *
   rsqrt(mean(res_out^2) + eps). out may alias x, res_out may alias residual (each element
   is read before it is written); the decoder stack below relies on the second. r16: res_out,
   the normed value and out each rounded to bfloat16, as torch_ops.rms_norm rounds in bfloat16. */
void pageserve_rms_norm(const float *x, long ldx, const float *residual, long ldr, const float *w,
                        float eps, long T, long H, float *out, float *res_out, long ldo, int r16) {
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *rr = res_out + t * ldo, *orow = out + t * ldo;
        float ss = 0.0f;
        for (long i = 0; i < H; i++) {
            float v = residual ? xr[i] + residual[t * ldr + i] : xr[i];
            if (r16) v = round_bf16(v);
            rr[i] = v;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        if (r16)
            for (long i = 0; i < H; i++) orow[i] = round_bf16(w[i] * round_bf16(rr[i] * inv));
        else
            for (long i = 0; i < H; i++) orow[i] = w[i] * (rr[i] * inv);
    }
}

/* Neox-style RoPE in place on x: [T, heads, D], token rows ld_t apart, heads D apart; cs:
   [T, D] rows ld_cs apart, cos of the D/2 frequencies then their sin. r16: cos, sin, each
   product and each sum rounded to bfloat16, as torch_ops.rotary_embedding in bfloat16. */
void pageserve_rotary(float *x, long T, long heads, long ld_t, long D, const float *cs, long ld_cs, int r16) {
    long half = D / 2;
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *c = cs + t * ld_cs, *s = c + half;
        for (long h = 0; h < heads; h++) {
            float *x1 = x + t * ld_t + h * D, *x2 = x1 + half;
            if (r16)
                for (long i = 0; i < half; i++) {
                    float a = x1[i], b = x2[i], ci = round_bf16(c[i]), si = round_bf16(s[i]);
                    x1[i] = round_bf16(round_bf16(a * ci) - round_bf16(b * si));
                    x2[i] = round_bf16(round_bf16(b * ci) + round_bf16(a * si));
                }
            else
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

/* out[T, I] = silu(x[:, :I]) * x[:, I:], x rows ldx apart; r16: silu's value and the product
   rounded to bfloat16 */
void pageserve_silu_and_mul(const float *x, long ldx, long T, long I, float *out, int r16) {
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * I;
        long i = 0;
#ifdef PS_AVX512
        for (; i + 16 <= I; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            __m512 silu = _mm512_div_ps(gv, den);
            _mm512_storeu_ps(o + i, r16 ? silu : _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        }
#endif
#ifdef PS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
            __m256 silu = _mm256_div_ps(gv, den);
            _mm256_storeu_ps(o + i, r16 ? silu : _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = r16 ? g[i] / (1.0f + expf(-g[i])) : g[i] / (1.0f + expf(-g[i])) * u[i];
        if (r16)
            for (i = 0; i < I; i++) o[i] = round_bf16(round_bf16(o[i]) * u[i]);
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
/* the dot products of NH <= 3 query heads (rows D apart) against four rows of k (k, k + D,
   k + 2D, k + 3D; D a multiple of 8), one accumulator each, reduced together: each row loaded
   once for the heads of its KV head, so GQA reads K once (docs/performance.md) */
static inline __attribute__((always_inline)) void dot4_heads(const float *q, int NH, const float *k, long D,
                                                              __m128 out[3]) {
    __m256 a[3][4];
#ifdef PS_AVX512
    if (D % 16 == 0) { /* 16 a register, the halves added before the reduction below */
        __m512 z[3][4];
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++) z[h][r] = _mm512_setzero_ps();
        for (long i = 0; i < D; i += 16) {
            __m512 k0 = _mm512_loadu_ps(k + i), k1 = _mm512_loadu_ps(k + D + i), k2 = _mm512_loadu_ps(k + 2 * D + i),
                   k3 = _mm512_loadu_ps(k + 3 * D + i);
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
            __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + D + i), k2 = _mm256_loadu_ps(k + 2 * D + i),
                   k3 = _mm256_loadu_ps(k + 3 * D + i);
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

/* The attention of one request's G query heads (q: G rows of D) over its cached positions
   j0..j1-1, each GS of them sharing one KV head (k, v: the first KV head's rows in block 0 of
   the cache, the next one's block_size * D floats on; a block is `tok` floats). s: scratch of
   G * (j1 - j0) floats; acc: G rows of D out. With mx and sm NULL, acc is the attention
   (the probabilities normalised before P V); else a piece of it: acc unnormalised (sum of
   exp(s - mx) v), mx the largest score and sm the sum of the exponentials of each head, for
   merge_pieces. Each head's sums are the same whatever G: an item of several KV heads only
   reads a block's rows of all of them together, where they lie side by side in the cache. */
static void attend_range(const float *q, const float *k, const float *v, const int32_t *bt, long j0, long j1,
                         long G, long GS, long D, long block_size, long tok, float scale, float *s, float *acc,
                         float *mx_out, float *sm_out, int r16) {
    float mx[64], sum[64]; /* G <= 64 */
    long L = j1 - j0;
    float score_scale = scale;
    if (r16) scale = 1.0f; /* each score rounded to bfloat16 before it is scaled, as torch's q k^T */
    for (long g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.0f; }
    for (long j = j0; j < j1;) { /* scores, a run of one cache block at a time: s[g * L + j - j0] */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j;
        const float *kb0 = k + (long)bt[j / block_size] * tok + off * D;
        for (long g = 0; g < G;) {
            const float *qg = q + g * D, *kb = kb0 + g / GS * block_size * D;
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
                for (long r = i; r < n; r++) sg[h * L + r] = dot(qg + h * D, kb + r * D, D) * scale;
            g += nh;
        }
        j += n;
    }
    if (r16)
        for (long i = 0; i < G * L; i++) s[i] = round_bf16(s[i]) * score_scale;
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
        const float *vb0 = v + (long)bt[j / block_size] * tok + off * D; /* each row read from memory */
        for (long g = 0; g < G; g++) { /* once for the GS heads that share it */
            const float *pg = s + g * L + (j - j0), *vb = vb0 + g / GS * block_size * D;
            float *ag = acc + g * D;
            long d0 = 0;
#ifdef PS_AVX2
#ifdef PS_AVX512
            for (; d0 + 64 <= D; d0 += 64) { /* the same chains over the run, 16 a register */
                __m512 o[4];
                for (int r = 0; r < 4; r++) o[r] = _mm512_loadu_ps(ag + d0 + 16 * r);
                for (long i = 0; i < n; i++) {
                    __m512 p = _mm512_set1_ps(pg[i]);
                    const float *vr = vb + i * D + d0;
                    for (int r = 0; r < 4; r++) o[r] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * r), o[r]);
                }
                for (int r = 0; r < 4; r++) _mm512_storeu_ps(ag + d0 + 16 * r, o[r]);
            }
#endif
            for (; d0 + 64 <= D; d0 += 64) { /* 64 floats of the head in registers over the run */
                __m256 o[8];
                for (int r = 0; r < 8; r++) o[r] = _mm256_loadu_ps(ag + d0 + 8 * r);
                for (long i = 0; i < n; i++) {
                    __m256 p = _mm256_set1_ps(pg[i]);
                    const float *vr = vb + i * D + d0;
                    for (int r = 0; r < 8; r++) o[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * r), o[r]);
                }
                for (int r = 0; r < 8; r++) _mm256_storeu_ps(ag + d0 + 8 * r, o[r]);
            }
#endif
            if (d0 < D) /* the rest of the head (all of it without AVX2) */
                for (long i = 0; i < n; i++) axpy(ag + d0, pg[i], vb + i * D + d0, D - d0);
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
        for (long p = 0; p < P; p++) {
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
   one KV head's. Returns 1 where scratch memory could not be had. */
static int decode_pieces(const float *q, long ld_q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B, long H,
                         long Hkv, long D, long block_size, float scale, long threads, float *out, int r16) {
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
            long b = item / (per * P), hk = item / P % per * NK, L = seq_lens[b], len = (L + P - 1) / P;
            long j0 = item % P * len, j1 = j0 + len < L ? j0 + len : L;
            float *r = part + item * rec;
            if (s == NULL) continue;
            if (j0 >= j1) { /* past a short context: an empty piece */
                for (long g = 0; g < NG; g++) r[NG * D + NG + g] = EMPTY_PIECE;
                continue;
            }
            attend_range(q + b * ld_q + hk * G * D, k_cache + hk * block_size * D, v_cache + hk * block_size * D,
                         block_tables + b * ld_bt, j0, j1, NG, G, D, block_size, tok, scale, s, r, r + NG * D,
                         r + NG * D + NG, r16);
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

/* One piece (positions j0..j1-1) of the M = T * G query heads of T rows that share one KV head:
   rows q (ld_q apart) of consecutive positions of one sequence, row t seeing its first lens[t]
   positions (the positions past a row's own masked out). k, v: this KV head's rows in block 0.
   Leaves a piece record at rec as attend_range does: [M][D] unnormalised sums, M maxima, M sums
   of exponentials (head t * G + g: row t's head g). qt: scratch of D * Mp floats, the rows'
   heads gathered transposed; s: (j1 - j0) * Mp floats, the scores with the heads along a row. */
static void group_piece(const float *q, long ld_q, long T, long G, long D, const float *k, const float *v,
                        const int32_t *bt, long block_size, long tok, const int32_t *lens, long j0, long j1,
                        float scale, int r16, float *qt, float *s, float *rec) {
    long M = T * G, Mp = (M + 15) / 16 * 16, L = j1 - j0;
    for (long d = 0; d < D; d++)
        for (long m = M; m < Mp; m++) qt[d * Mp + m] = 0.0f;
    for (long t = 0; t < T; t++)
        for (long g = 0; g < G; g++)
            for (long d = 0; d < D; d++) qt[d * Mp + t * G + g] = q[t * ld_q + g * D + d];
    for (long j = j0; j < j1;) { /* scores, a run of one cache block at a time */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j, i = 0;
        const float *kb = k + (long)bt[j / block_size] * tok + off * D;
        float *sj = s + (j - j0) * Mp;
        for (; i + 4 <= n; i += 4) score_keys(kb + i * D, 4, D, qt, Mp, scale, r16, sj + i * Mp);
        for (; i < n; i++) score_keys(kb + i * D, 1, D, qt, Mp, scale, r16, sj + i * Mp);
        j += n;
    }
    for (long t = 0; t < T; t++) /* positions past a row's own: no weight */
        for (long j = lens[t] > j0 ? lens[t] : j0; j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = -INFINITY;
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
    for (long t = 0; t < T; t++) /* exp's floor left the masked positions a tiny weight: none */
        for (long j = lens[t] > j0 ? lens[t] : j0; j < j1; j++)
            for (long g = 0; g < G; g++) s[(j - j0) * Mp + t * G + g] = 0.0f;
    for (long i = 0; i < M * D; i++) rec[i] = 0.0f;
    for (long j = j0; j < j1;) { /* P V, a run of one cache block at a time, three heads a pass */
        long off = j % block_size, n = block_size - off < j1 - j ? block_size - off : j1 - j, m = 0;
        const float *vb = v + (long)bt[j / block_size] * tok + off * D, *pj = s + (j - j0) * Mp;
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
   them. seq_lens: per row; block_tables: per row, or (by_group) per group. Returns 1 where
   scratch memory could not be had. */
static int decode_groups(const float *q, long ld_q, const float *k_cache, const float *v_cache,
                         const int32_t *block_tables, long ld_bt, int by_group, const int32_t *seq_lens, long B,
                         long H, long Hkv, long D, long block_size, float scale, long threads, const long *gstart,
                         long ng, float *out, int r16) {
    long G = H / Hkv, tok = Hkv * block_size * D, nitems = 0, total = 0, max_qt = 0, max_s = 0;
    long *gp = (long *)malloc(sizeof(long) * (size_t)(3 * ng + B)); /* per group: pieces, length, offset */
    if (gp == NULL) return 1;
    long *row_group = gp + 3 * ng;
    long want = (2 * threads + Hkv * ng - 1) / (Hkv * ng); /* pieces a group, for every thread two items */
    for (long i = 0; i < ng; i++) {
        long T = gstart[i + 1] - gstart[i], M = T * G, Mp = (M + 15) / 16 * 16, L0 = seq_lens[gstart[i]];
        long P = (L0 + GROUP_PIECE - 1) / GROUP_PIECE;
        P = P > want ? P : want;
        P = P < L0 ? P : L0;
        long len = (L0 + P - 1) / P;
        P = (L0 + len - 1) / len; /* none empty */
        gp[3 * i] = P, gp[3 * i + 1] = len, gp[3 * i + 2] = total;
        total += Hkv * P * (M * D + 2 * M);
        nitems += Hkv * P;
        max_qt = D * Mp > max_qt ? D * Mp : max_qt;
        max_s = (len + T - 1) * Mp > max_s ? (len + T - 1) * Mp : max_s;
        for (long b = gstart[i]; b < gstart[i + 1]; b++) row_group[b] = i;
    }
    float *part = (float *)malloc(sizeof(float) * (size_t)total);
    if (part == NULL) {
        free(gp);
        return 1;
    }
    int failed = 0;
#pragma omp parallel if (nitems > 1)
    {
        float *qt = (float *)malloc(sizeof(float) * (size_t)max_qt), *s = (float *)malloc(sizeof(float) * (size_t)max_s);
        if (qt == NULL || s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < nitems; item++) {
            if (qt == NULL || s == NULL) continue;
            long i = 0, first = 0; /* the group: items run group by group, Hkv * P each */
            while (item >= first + Hkv * gp[3 * i]) first += Hkv * gp[3 * i++];
            long P = gp[3 * i], len = gp[3 * i + 1], b = gstart[i], T = gstart[i + 1] - b, M = T * G;
            long hk = (item - first) / P, p = (item - first) % P, L0 = seq_lens[b];
            long j0 = p * len, j1 = p == P - 1 ? seq_lens[b + T - 1] : (j0 + len < L0 ? j0 + len : L0);
            group_piece(q + b * ld_q + hk * G * D, ld_q, T, G, D, k_cache + hk * block_size * D,
                        v_cache + hk * block_size * D, block_tables + (by_group ? i : b) * ld_bt, block_size, tok, seq_lens + b, j0,
                        j1, scale, r16, qt, s, part + gp[3 * i + 2] + (item - first) * (M * D + 2 * M));
        }
        if (!failed) {
#pragma omp for schedule(static)
            for (long bh = 0; bh < B * Hkv; bh++) {
                long b = bh / Hkv, hk = bh % Hkv, i = row_group[b], T = gstart[i + 1] - gstart[i], M = T * G;
                long rec = M * D + 2 * M, P = gp[3 * i];
                merge_heads(part + gp[3 * i + 2] + hk * P * rec, P, rec, M, (b - gstart[i]) * G, G, D,
                            out + b * H * D + hk * G * D);
            }
        }
        free(qt);
        free(s);
    }
    free(part);
    free(gp);
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

/* The index of each row's largest value, the first of equal ones (torch.argmax's answer):
   x [R, V] rows ldx apart, out [R]. Here because torch's argmax is an unvectorised loop that
   was most of the engine's own time per step (docs/performance.md). Returns 1 if a row holds a
   NaN (torch ranks NaN above every value; the caller asks torch then). */
int pageserve_argmax(const float *x, long R, long V, long ldx, int64_t *out) {
    int has_nan = 0;
#pragma omp parallel for if (R >= 4) schedule(static) reduction(| : has_nan)
    for (long r = 0; r < R; r++) {
        const float *row = x + r * ldx;
        long best = 0, i = 0;
        float m = row[0];
#ifdef PS_AVX2
        if (V >= 8) { /* per lane the largest value and its first index; lanes hold i = lane mod 8 */
            __m256 mv = _mm256_loadu_ps(row), bad = _mm256_cmp_ps(mv, mv, _CMP_UNORD_Q);
            __m256i iv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = iv;
            for (i = 8; i + 8 <= V; i += 8) {
                at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
                __m256 v = _mm256_loadu_ps(row + i), gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                mv = _mm256_blendv_ps(mv, v, gt);
                iv = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(iv), _mm256_castsi256_ps(at), gt));
            }
            float lm[8];
            int32_t li[8];
            _mm256_storeu_ps(lm, mv);
            _mm256_storeu_si256((__m256i *)li, iv);
            m = lm[0], best = li[0];
            for (int l = 1; l < 8; l++)
                if (lm[l] > m || (lm[l] == m && li[l] < best)) m = lm[l], best = li[l];
            if (_mm256_movemask_ps(bad)) has_nan = 1;
        } else
#endif
            i = 1;
        for (; i < V; i++) {
            if (row[i] != row[i]) has_nan = 1;
            if (row[i] > m) m = row[i], best = i;
        }
        if (m != m) has_nan = 1;
        out[r] = best;
    }
    return has_nan;
}

/* the vector instructions the kernels were built for (-march=native on this CPU) */
const char *pageserve_isa(void) {
#if defined(PS_AVX512_BF16)
    return "AVX-512 with BF16";
#elif defined(PS_AVX512)
    return "AVX-512";
#elif defined(PS_AVX2)
    return "AVX2";
#else
    return "scalar";
#endif
}

/* 1 when built with AVX2 and FMA (the vectorised paths), else 0 */
int pageserve_vectorized(void) {
#ifdef PS_AVX2
    return 1;
#else
    return 0;
#endif
}

static int attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                     float *k_cache, float *v_cache, const int64_t *slots, long T,
                     const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                     const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                     float scale, float *out, int r16);

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
   H / Hkv query heads that share a KV head (their K/V rows are read once from memory), or,
   with at least four tokens a thread, all of one token's heads. A prompt
   chunk's tokens are items of their own, so the triangle above the causal diagonal is never
   computed (torch's SDPA with a mask computes the whole square). A decode step of fewer items
   than twice the threads cuts each context into pieces instead (decode_pieces): the same
   arithmetic per piece, the pieces merged by their maxima, so not the same bits as one item.
   A step with rows of one sequence's consecutive positions (decodes found so, or chunks of at
   most GROUP_ROWS) goes by groups instead (decode_groups): each group's K/V read once, in pieces.
   r16: the scores, the probabilities (of a whole item) and the output rounded to bfloat16, as
   torch_ops.paged_attention's decode path rounds them in bfloat16. */
int pageserve_paged_attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                              float *k_cache, float *v_cache, const int64_t *slots, long T,
                              const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                              const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                              float scale, float *out, int r16) {
    int failed = attention(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, T, block_tables, ld_bt,
                           query_start_loc, seq_lens, B, H, Hkv, D, block_size, scale, out, r16);
    if (r16 && !failed) /* the output rounded to bfloat16, as torch's P V */
        for (long i = 0; i < T * H * D; i++) out[i] = round_bf16(out[i]);
    return failed;
}

static int attention(const float *q, long ld_q, const float *k_new, const float *v_new, long ld_kv,
                     float *k_cache, float *v_cache, const int64_t *slots, long T,
                     const int32_t *block_tables, long ld_bt, const int32_t *query_start_loc,
                     const int32_t *seq_lens, long B, long H, long Hkv, long D, long block_size,
                     float scale, float *out, int r16) {
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
            } else {
                for (long r = 0; r < B; r++) {
                    gstart[r] = query_start_loc[r];
                    for (long t = query_start_loc[r]; t < query_start_loc[r + 1]; t++)
                        lens[t] = seq_lens[r] - (query_start_loc[r + 1] - 1 - t);
                }
                gstart[B] = T;
            }
            failed = ng < T ? decode_groups(q, ld_q, k_cache, v_cache, block_tables, ld_bt, query_start_loc != NULL,
                                            lens, T, H, Hkv, D, block_size, scale, threads, gstart, ng, out, r16)
                            : -1;
        }
        free(gstart);
        free(lens);
        if (failed >= 0) return failed;
    }
    if (query_start_loc == NULL && threads > 1 && T > 0 && T * Hkv < 2 * threads)
        return decode_pieces(q, ld_q, k_cache, v_cache, block_tables, ld_bt, seq_lens, B, H, Hkv, D, block_size,
                             scale, threads, out, r16);
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
                         block_tables + b * ld_bt, 0, L, NG, G, D, block_size, tok, scale, s,
                         out + t * H * D + hk * G * D, NULL, NULL, r16);
        }
        free(s);
    }
    return failed;
}

/* pageserve_paged_attention of a decode step: one query token per request (T = B) */
int pageserve_paged_decode(const float *q, long ld_q, const float *k_new, const float *v_new,
                            long ld_kv, float *k_cache, float *v_cache, const int64_t *slots,
                            const int32_t *block_tables, long ld_bt, const int32_t *seq_lens, long B,
                            long H, long Hkv, long D, long block_size, float scale, float *out, int r16) {
    return pageserve_paged_attention(q, ld_q, k_new, v_new, ld_kv, k_cache, v_cache, slots, B, block_tables,
                                     ld_bt, NULL, seq_lens, B, H, Hkv, D, block_size, scale, out, r16);
}

/* ---- LoRA adapters: each adapter token's delta added to its row of a linear layer's output ---- */

/* y[0..3] = the dot products of four rows of a (lda apart) with x: x loaded once for all four */
static inline void dot4_rows(const float *a, long lda, const float *x, long K, float *y) {
    long i = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef PS_AVX512
    __m512 z[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + 16 <= K; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
        for (int j = 0; j < 4; j++) z[j] = _mm512_fmadd_ps(_mm512_loadu_ps(a + j * lda + i), xv, z[j]);
    }
    for (int j = 0; j < 4; j++) s[j] = hsum16(z[j]);
#elif defined(PS_AVX2)
    __m256 z[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 8 <= K; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        for (int j = 0; j < 4; j++) z[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + j * lda + i), xv, z[j]);
    }
    for (int j = 0; j < 4; j++) s[j] = hsum8(z[j]);
#endif
    for (; i < K; i++)
        for (int j = 0; j < 4; j++) s[j] += a[j * lda + i] * x[i];
    for (int j = 0; j < 4; j++) y[j] = s[j];
}

/* o[0:size] += sum over r < R of y[r] b[r * ldb + 0:size]: each piece of o kept in registers
   through all R rows of b */
static inline void expand_rows(float *o, const float *y, const float *b, long ldb, long R, long size) {
    long i = 0;
#ifdef PS_AVX512
    for (; i + 32 <= size; i += 32) {
        __m512 o0 = _mm512_loadu_ps(o + i), o1 = _mm512_loadu_ps(o + i + 16);
        for (long r = 0; r < R; r++) {
            __m512 yv = _mm512_set1_ps(y[r]);
            o0 = _mm512_fmadd_ps(yv, _mm512_loadu_ps(b + r * ldb + i), o0);
            o1 = _mm512_fmadd_ps(yv, _mm512_loadu_ps(b + r * ldb + i + 16), o1);
        }
        _mm512_storeu_ps(o + i, o0);
        _mm512_storeu_ps(o + i + 16, o1);
    }
#endif
#ifdef PS_AVX2
    for (; i + 8 <= size; i += 8) {
        __m256 acc = _mm256_loadu_ps(o + i);
        for (long r = 0; r < R; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(y[r]), _mm256_loadu_ps(b + r * ldb + i), acc);
        _mm256_storeu_ps(o + i, acc);
    }
#endif
    for (; i < size; i++) {
        float acc = o[i];
        for (long r = 0; r < R; r++) acc += y[r] * b[r * ldb + i];
        o[i] = acc;
    }
}

/* Row t = rows[i] of a group (slot, first i, count) in groups[G][3]: y = a[slot] x[t] (L values:
   one rank-R piece per slice), then out[t, off:off+size] += y[col:col+R] bt[slot][:, off:off+size]
   for each slice (col, off, size) in slices[nsl][3]; bt [R, N] per slot, so that the expand runs
   along the output. One thread a row (a group's rows on one thread read its slot from cache);
   y in scratch [rows, L]. */
void pageserve_lora(const float *x, long ldx, long K, float *out, long ldo, long N, const float *a, long L,
                    const float *bt, long R, const long *slices, long nsl, const int64_t *rows,
                    const long *groups, long G, float *scratch) {
    long n = 0;
    for (long g = 0; g < G; g++) n += groups[3 * g + 2];
#pragma omp parallel for if (n * (L * K + R * N) >= 1 << 18) schedule(static)
    for (long i = 0; i < n; i++) {
        long g = 0;
        while (i >= groups[3 * g + 1] + groups[3 * g + 2]) g++;
        long slot = groups[3 * g];
        const float *xt = x + rows[i] * ldx, *as = a + slot * L * K, *bs = bt + slot * R * N;
        float *y = scratch + i * L, *o = out + rows[i] * ldo;
        long l = 0;
        for (; l + 4 <= L; l += 4) dot4_rows(as + l * K, K, xt, K, y + l);
        for (; l < L; l++) y[l] = dot(as + l * K, xt, K);
        for (long j = 0; j < nsl; j++) {
            long col = slices[3 * j], off = slices[3 * j + 1], size = slices[3 * j + 2];
            expand_rows(o + off, y + col, bs + off, N, R, size);
        }
    }
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
    int failed = 0, r16 = (wtypes[0] & W_DOT16) != 0; /* bfloat16 arithmetic: every output rounded */
    for (long l = 0; l < L && !failed; l++) {
        const void *const *lw = w + 7 * l;
        const int *ft = wtypes + 4 * l;
        if (l == 0)
            pageserve_rms_norm(x, Hd, NULL, 0, lw[0], eps, T, Hd, h, res, Hd, r16);
        else
            pageserve_rms_norm(y, Hd, res, Hd, lw[0], eps, T, Hd, h, res, Hd, r16);
        if ((failed = pageserve_linear(h, T, Hd, Hd, lw[1], ft[0], QKV, row_stride(ft[0], Hd), lw[2], qkv, QKV)))
            break;
        pageserve_rotary(qkv, T, H, QKV, D, cs, ld_cs, r16);
        pageserve_rotary(qkv + H * D, T, Hkv, QKV, D, cs, ld_cs, r16);
        failed = pageserve_paged_decode(qkv, QKV, qkv + H * D, qkv + (H + Hkv) * D, QKV, kv[2 * l], kv[2 * l + 1],
                                        slots, block_tables, ld_bt, seq_lens, T, H, Hkv, D, block_size, scale, attn, r16);
        failed = failed || pageserve_linear(attn, T, H * D, H * D, lw[3], ft[1], Hd, row_stride(ft[1], H * D), NULL,
                                            y, Hd);
        if (failed) break;
        pageserve_rms_norm(y, Hd, res, Hd, lw[4], eps, T, Hd, h, res, Hd, r16);
        if ((failed = pageserve_linear(h, T, Hd, Hd, lw[5], ft[2], 2 * I, row_stride(ft[2], Hd), NULL, gu, 2 * I)))
            break;
        pageserve_silu_and_mul(gu, 2 * I, T, I, act, r16);
        failed = pageserve_linear(act, T, I, I, lw[6], ft[3], Hd, row_stride(ft[3], I), NULL, y, Hd);
    }
    if (!failed) pageserve_rms_norm(y, Hd, res, Hd, final_norm, eps, T, Hd, out, res, Hd, r16);
    return failed;
}
