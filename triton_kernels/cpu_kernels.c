/* Float32 kernels of the CPU path, built at first use by cpu_kernels.py with the machine's own
   -march, together with cpu_linear.c (the linear layer): the small ops of a decoder layer
   (RMSNorm with the residual, rotary embedding, SiLU-and-mul), each one call where torch runs
   3-20 small ops; causal attention of any step straight from the paged cache; and a
   Llama-style model's whole decoder stack for a decode-only step in one call (the
   interpreter's time between ~300 kernel calls a step was a third of one stream's step). The
   attention is cpu_attention.c's. */

#include "cpu_kernels.h"

/* ---- the small ops of a decoder layer: one call each instead of 3-20 torch ops ---- */

#define PAR_ROWS 16 /* a step of fewer rows runs on one thread: starting the team costs more */

/* RMSNorm fused with the residual add. x, residual (or NULL), out, res_out: [T, H] rows ldx,
   ldr, ldo, ldo apart. res_out = x + residual (x when there is none); out = w * res_out *
   rsqrt(mean(res_out^2) + eps). out may alias x, res_out may alias residual (each element
   is read before it is written); the decoder stack below relies on the second. r16: res_out,
   the normed value and out each rounded to bfloat16, as torch_ops.rms_norm rounds in bfloat16. */
/* One row of pageserve_rms_norm (rr and orow may be xr: each value is read before it is written). */
static inline void rms_row(const float *xr, const float *resrow, const float *w, float eps, long H, float *orow,
                           float *rr, int r16) {
    float ss = 0.0f;
    for (long i = 0; i < H; i++) {
        float v = resrow ? xr[i] + resrow[i] : xr[i];
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

void pageserve_rms_norm(const float *x, long ldx, const float *residual, long ldr, const float *w,
                        float eps, long T, long H, float *out, float *res_out, long ldo, int r16) {
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++)
        rms_row(x + t * ldx, residual ? residual + t * ldr : NULL, w, eps, H, out + t * ldo, res_out + t * ldo, r16);
}

/* Neox-style RoPE in place on the first R values of each head of x: [T, heads, >= R], token
   rows ld_t apart, heads ld_h apart (R < ld_h: partial rotary, the rest untouched); cs: [T, R]
   rows ld_cs apart, cos of the R/2 frequencies then their sin. r16: cos, sin, each product and
   each sum rounded to bfloat16, as torch_ops.rotary_embedding in bfloat16. */
void pageserve_rotary(float *x, long T, long heads, long ld_t, long ld_h, long R, const float *cs, long ld_cs,
                      int r16) {
    long half = R / 2;
#pragma omp parallel for if (T >= PAR_ROWS) schedule(static)
    for (long t = 0; t < T; t++) {
        const float *c = cs + t * ld_cs, *s = c + half;
        for (long h = 0; h < heads; h++) {
            float *x1 = x + t * ld_t + h * ld_h, *x2 = x1 + half;
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
#if defined(PS_AMX_BF16)
    return amx_ready() ? "AVX-512 with BF16 and AMX" : "AVX-512 with BF16";
#elif defined(PS_AVX512_BF16)
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

/* Each head's RMSNorm in place on x: [T, heads, D], token rows ld_t apart (Qwen3's q/k norms,
   in the fused qkv rows), as pageserve_rms_norm on the heads as rows. */
static void head_norms(float *x, long T, long heads, long ld_t, long D, const float *w, float eps, int r16) {
#pragma omp parallel for if (T * heads >= 16 * PAR_ROWS) schedule(static)
    for (long r = 0; r < T * heads; r++) {
        float *row = x + r / heads * ld_t + r % heads * D;
        rms_row(row, NULL, w, eps, D, row, row, r16);
    }
}

/* The layers of a model whose every layer is: RMSNorm (with the residual), fused q/k/v
   (+ bias), each head's RMSNorm of q and k (Qwen3; optional), Neox RoPE, paged attention, o_proj, RMSNorm (with the residual), fused gate/up,
   SiLU-and-mul, down; then the final RMSNorm. Each piece is the function above that the
   layer-by-layer path calls, in the same order on the same values, so the output is the
   same to the bit; what goes is the interpreter's time between them.
   x: [T, Hd] the embeddings (T decode tokens, one per request); out: [T, Hd] the final normed
   hidden states. w: per layer 9 pointers (input norm, qkv weight, qkv bias or NULL, o_proj,
   post-attention norm, gate_up, down, q norm and k norm or NULLs), the norms and the bias float32; wtypes: per layer the
   formats of the four matrices (contiguous rows); packed: per layer the four matrices laid out
   by pageserve_pack_amx (or NULL), or NULL; kv: per layer the K and V caches (kv_format:
   0 float32, 1 bfloat16, 2 float8 e4m3fn); cs: [T, D]
   rows ld_cs apart (cos then sin). Returns 1 if scratch memory (the attention's, a block
   format's widening) could not be had, else 0. */
int pageserve_decode_layers(const float *x, long T, long Hd, long L, const void *const *w, const int *wtypes,
                            const void *const *packed, void *const *kv, int kv_format, const float *final_norm, float eps, const float *cs,
                            long ld_cs, const int64_t *slots, const int32_t *block_tables, long ld_bt,
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
        const void *const *lw = w + 9 * l;
        const int *ft = wtypes + 4 * l;
        const void *const none[4] = {NULL, NULL, NULL, NULL}, *const *lp = packed ? packed + 4 * l : none;
        if (l == 0)
            pageserve_rms_norm(x, Hd, NULL, 0, lw[0], eps, T, Hd, h, res, Hd, r16);
        else
            pageserve_rms_norm(y, Hd, res, Hd, lw[0], eps, T, Hd, h, res, Hd, r16);
        if ((failed = pageserve_linear_packed(h, T, Hd, Hd, lw[1], ft[0], QKV, row_stride(ft[0], Hd), lp[0], lw[2], qkv,
                                              QKV)))
            break;
        if (lw[7]) {
            head_norms(qkv, T, H, QKV, D, lw[7], eps, r16);
            head_norms(qkv + H * D, T, Hkv, QKV, D, lw[8], eps, r16);
        }
        pageserve_rotary(qkv, T, H, QKV, D, D, cs, ld_cs, r16);
        pageserve_rotary(qkv + H * D, T, Hkv, QKV, D, D, cs, ld_cs, r16);
        failed = pageserve_paged_decode(qkv, QKV, qkv + H * D, qkv + (H + Hkv) * D, QKV, kv[2 * l], kv[2 * l + 1],
                                        slots, block_tables, ld_bt, seq_lens, T, H, Hkv, D, block_size, scale, attn, r16, kv_format);
        failed = failed || pageserve_linear_packed(attn, T, H * D, H * D, lw[3], ft[1], Hd, row_stride(ft[1], H * D),
                                                   lp[1], NULL, y, Hd);
        if (failed) break;
        pageserve_rms_norm(y, Hd, res, Hd, lw[4], eps, T, Hd, h, res, Hd, r16);
        if ((failed = pageserve_linear_packed(h, T, Hd, Hd, lw[5], ft[2], 2 * I, row_stride(ft[2], Hd), lp[2], NULL, gu,
                                              2 * I)))
            break;
        pageserve_silu_and_mul(gu, 2 * I, T, I, act, r16);
        failed = pageserve_linear_packed(act, T, I, I, lw[6], ft[3], Hd, row_stride(ft[3], I), lp[3], NULL, y, Hd);
    }
    if (!failed) pageserve_rms_norm(y, Hd, res, Hd, final_norm, eps, T, Hd, out, res, Hd, r16);
    return failed;
}
