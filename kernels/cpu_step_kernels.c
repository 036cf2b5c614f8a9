/* The small ops of a CPU decode step outside the matmuls, each one pass over its rows: RMSNorm of
 * x + residual, SwiGLU, and a layer's attention from its fused qkv projection (rotary, cache write,
 * attention over the paged cache for a few query rows). float32 (dtype 0) or bf16 (dtype 1) tensors;
 * arithmetic in float32, rounded to the tensor dtype where the torch references round (see
 * cpu_step_native.py). Built with -march=native by cpu_step_native.py and called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define DT_F32 0
#define DT_BF16 1
/* Multiply-adds of q . k (positions x query rows x heads x head_dim) from which the attention's
 * (sequence, kv head) pairs are spread over threads: below it a thread's start costs more. */
#define PARALLEL_WORK (1 << 20)

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } b;
    b.u = (uint32_t)v << 16;
    return b.f;
}

/* Round to nearest even, as torch's float -> bfloat16 (NaN kept quiet). */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } b;
    b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40);
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

static inline float round_to(int dtype, float f) {
    return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static inline float load(int dtype, const void *p, int64_t i) {
    return dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(int dtype, void *p, int64_t i, float f) {
    if (dtype == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

/* Rows of `dtype` values into float32 (the loops below then vectorize without a dtype branch). */
static void to_f32(int dtype, const void *src, float *dst, int64_t n) {
    if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static void from_f32(int dtype, const float *src, void *dst, int64_t n) {
    if (dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* normed = w * round(s / rms(s)), s = round(x + residual) (residual may be NULL); sum = s. `sum` may be
 * `residual` or `x` itself (written after it is read). reference: kernels/norm/reference.py rms_norm. */
int step_rms_norm(int dtype, const void *x, const void *residual, const void *weight, float eps, int64_t rows,
                  int64_t dim, void *normed, void *sum) {
    float *s = (float *)malloc((size_t)dim * 2 * sizeof(float));
    if (!s) return 1;
    float *w = s + dim;
    to_f32(dtype, weight, w, dim);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t off = r * dim;
        to_f32(dtype, (const char *)x + off * (dtype == DT_BF16 ? 2 : 4), s, dim);
        if (residual) {
            const void *res = (const char *)residual + off * (dtype == DT_BF16 ? 2 : 4);
            if (dtype == DT_BF16) {
                const uint16_t *rr = (const uint16_t *)res;
                for (int64_t i = 0; i < dim; i++) s[i] = bf16_to_f32(f32_to_bf16(s[i] + bf16_to_f32(rr[i])));
            } else {
                const float *rr = (const float *)res;
                for (int64_t i = 0; i < dim; i++) s[i] += rr[i];
            }
        }
        double squares = 0.0;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += (double)s[i] * s[i];
        const float inv = 1.0f / sqrtf((float)(squares / (double)dim) + eps);
        if (sum) from_f32(dtype, s, (char *)sum + off * (dtype == DT_BF16 ? 2 : 4), dim);
        if (dtype == DT_BF16) {
            uint16_t *out = (uint16_t *)normed + off;
            for (int64_t i = 0; i < dim; i++) out[i] = f32_to_bf16(w[i] * bf16_to_f32(f32_to_bf16(s[i] * inv)));
        } else {
            float *out = (float *)normed + off;
            for (int64_t i = 0; i < dim; i++) out[i] = w[i] * (s[i] * inv);
        }
    }
    free(s);
    return 0;
}

/* exp(x) for x <= 0 .. moderate: Cephes' single-precision polynomial (~1 ulp), vectorizable. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return p * two_to_n;
}

/* x[i] = exp(x[i]): exp_approx's arithmetic, 16 or 8 lanes at a time (2^n put in the exponent bits). */
static void exp_inplace(float *x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
        const __m512 k = _mm512_floor_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
        __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
        r = _mm512_add_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(2.12194440e-4f)));
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
        const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
        _mm512_storeu_ps(x + i, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
        const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
        __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f)));
        r = _mm256_add_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(x + i, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
    }
#endif
    for (; i < n; i++) x[i] = exp_approx(x[i]);
}

/* out = round(silu(gate)) * up over rows of [gate | up] (`inter` each). reference: activation silu_and_mul. */
int step_silu_and_mul(int dtype, const void *x, int64_t rows, int64_t inter, void *out) {
    float *buf = (float *)malloc((size_t)inter * 3 * sizeof(float));
    if (!buf) return 1;
    const int64_t esize = dtype == DT_BF16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        to_f32(dtype, (const char *)x + r * 2 * inter * esize, buf, 2 * inter);
        float *gate = buf, *up = buf + inter, *e = buf + 2 * inter;
        for (int64_t i = 0; i < inter; i++) e[i] = -gate[i];
        exp_inplace(e, inter);
        for (int64_t i = 0; i < inter; i++) gate[i] = gate[i] / (1.0f + e[i]);
        if (dtype == DT_BF16) {
            uint16_t *o = (uint16_t *)out + r * inter;
            for (int64_t i = 0; i < inter; i++) o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gate[i])) * up[i]);
        } else {
            float *o = (float *)out + r * inter;
            for (int64_t i = 0; i < inter; i++) o[i] = gate[i] * up[i];
        }
    }
    free(buf);
    return 0;
}

/* 16 (8) lanes of float32 from cache row `p` (dtype) at element i. */
#if defined(__AVX512F__)
static inline __m512 load16(int dtype, const void *p, int i) {
    if (dtype == DT_BF16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(int dtype, const void *p, int i) {
    if (dtype == DT_BF16) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* q . row in float32 (row in the cache's dtype): vector lanes, then one horizontal sum. */
static inline float dot(int dtype, const float *q, const void *row, int n) {
    int i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(dtype, row, i), acc);
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(dtype, row, i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    sum = _mm_cvtss_f32(half);
#endif
    for (; i < n; i++) sum += q[i] * load(dtype, row, i);
    return sum;
}

/* scores[r * ld + j] = scale * q_r . rows[j] for the R query rows q_r = q + (r / group) * q_stride +
 * (r % group) * D: each key row widened once for all R query rows; each score the same bits as dot(). */
static void score_rows(int dtype, const float *q, int64_t q_stride, int group, int R, const void *const *rows,
                       int64_t n, int D, float scale, float *scores, int64_t ld) {
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 256) {
        __m512 kv[16];
        for (int64_t j = 0; j < n; j++) {
            for (int c = 0; c < D / 16; c++) kv[c] = load16(dtype, rows[j], 16 * c);
            for (int r = 0; r < R; r++) {
                const float *qr = q + (r / group) * q_stride + (r % group) * D;
                __m512 acc = _mm512_setzero_ps();
                for (int c = 0; c < D / 16; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], acc);
                scores[r * ld + j] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        const float *qr = q + (r / group) * q_stride + (r % group) * D;
        for (int64_t j = 0; j < n; j++) scores[r * ld + j] = dot(dtype, qr, rows[j], D) * scale;
    }
}

/* out[c] = sum_j w[j] * rows[j][c] (rows in the cache's dtype): the accumulators stay in registers
 * across the rows j (a loop over out in memory would wait on its own stores). */
static void weighted_rows(int dtype, const float *w, const void *const *rows, int64_t n, int D, float *out) {
    int c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= D; c += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            const __m512 s = _mm512_set1_ps(w[j]);
            a0 = _mm512_fmadd_ps(s, load16(dtype, rows[j], c), a0);
            a1 = _mm512_fmadd_ps(s, load16(dtype, rows[j], c + 16), a1);
            a2 = _mm512_fmadd_ps(s, load16(dtype, rows[j], c + 32), a2);
            a3 = _mm512_fmadd_ps(s, load16(dtype, rows[j], c + 48), a3);
        }
        _mm512_storeu_ps(out + c, a0);
        _mm512_storeu_ps(out + c + 16, a1);
        _mm512_storeu_ps(out + c + 32, a2);
        _mm512_storeu_ps(out + c + 48, a3);
    }
    for (; c + 16 <= D; c += 16) {
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), load16(dtype, rows[j], c), a0);
        _mm512_storeu_ps(out + c, a0);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; c + 32 <= D; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            const __m256 s = _mm256_set1_ps(w[j]);
            a0 = _mm256_fmadd_ps(s, load8(dtype, rows[j], c), a0);
            a1 = _mm256_fmadd_ps(s, load8(dtype, rows[j], c + 8), a1);
            a2 = _mm256_fmadd_ps(s, load8(dtype, rows[j], c + 16), a2);
            a3 = _mm256_fmadd_ps(s, load8(dtype, rows[j], c + 24), a3);
        }
        _mm256_storeu_ps(out + c, a0);
        _mm256_storeu_ps(out + c + 8, a1);
        _mm256_storeu_ps(out + c + 16, a2);
        _mm256_storeu_ps(out + c + 24, a3);
    }
    for (; c + 8 <= D; c += 8) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), load8(dtype, rows[j], c), a0);
        _mm256_storeu_ps(out + c, a0);
    }
#endif
    for (; c < D; c++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a += w[j] * load(dtype, rows[j], c);
        out[c] = a;
    }
}

/* One layer's attention from its fused projection qkv [T, (H + 2 Hkv) * D] (rows `qkv_stride` apart):
 * NeoX rotary of q and k at `positions` over the first `rotary_dim` dims (cos_sin [*, rotary_dim]: cosines
 * then sines), keys and values stored at `slots` of the paged caches [blocks, block_size, Hkv, D], then
 * causal attention of each sequence's queries over its first context_lens[b] cached positions (found
 * through block_tables[b], `table_stride` apart), sliding window `window` (0: none). out [T, H * D].
 * references: rotary_embedding, write_kv_cache, paged_attention (each op's reference.py). */
int step_rope_cache_attention(int dtype, const void *qkv, int64_t qkv_stride, int64_t num_tokens, int num_heads,
                              int num_kv_heads, int head_dim, const int64_t *positions, const void *cos_sin,
                              int rotary_dim, void *key_cache, void *value_cache, const int64_t *slots,
                              int block_size, int num_seqs, const int64_t *query_start_loc,
                              const int64_t *context_lens, const int64_t *block_tables, int64_t table_stride,
                              float scale, int64_t window, void *out, int num_threads) {
    const int64_t esize = dtype == DT_BF16 ? 2 : 4;
    const int D = head_dim, half = rotary_dim / 2;
    const int64_t kv_width = (int64_t)num_kv_heads * D;
    float *queries = (float *)malloc((size_t)num_tokens * num_heads * D * sizeof(float));
    float *row = (float *)malloc((size_t)(num_heads + 2 * num_kv_heads) * D * sizeof(float));
    float *cs = (float *)malloc((size_t)rotary_dim * sizeof(float));
    if (!queries || !row || !cs) { free(queries); free(row); free(cs); return 1; }
    /* rotary and the cache write */
    for (int64_t t = 0; t < num_tokens; t++) {
        to_f32(dtype, (const char *)qkv + t * qkv_stride * esize, row, (int64_t)(num_heads + 2 * num_kv_heads) * D);
        to_f32(dtype, (const char *)cos_sin + positions[t] * rotary_dim * esize, cs, rotary_dim);
        const float *cosv = cs, *sinv = cs + half;
        for (int h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = row + (int64_t)h * D;
            float rotated[512];
            for (int i = 0; i < half; i++) {  /* round(x * cos) + partner * (-+sin), as the CPU routine */
                rotated[i] = round_to(dtype, x[i] * cosv[i]) + x[i + half] * -sinv[i];
                rotated[i + half] = round_to(dtype, x[i + half] * cosv[i]) + x[i] * sinv[i];
            }
            for (int i = 0; i < rotary_dim; i++) x[i] = round_to(dtype, rotated[i]);
            for (int i = rotary_dim; i < D; i++) x[i] = round_to(dtype, x[i]);
        }
        memcpy(queries + t * num_heads * D, row, (size_t)num_heads * D * sizeof(float));
        const int64_t slot = slots[t];
        from_f32(dtype, row + (int64_t)num_heads * D, (char *)key_cache + slot * kv_width * esize, kv_width);
        from_f32(dtype, row + (int64_t)(num_heads + num_kv_heads) * D, (char *)value_cache + slot * kv_width * esize,
                 kv_width);
    }
    free(row);
    free(cs);
    /* attention: per (sequence, kv head) pair, where its visible keys and values are (found once for all
     * of its query rows, read in place), then each query head of that kv head over its own causal range; the pairs
     * spread over `num_threads` OpenMP threads when there is enough work */
    const int group = num_heads / num_kv_heads;
    int64_t max_context = 0, work = 0, max_rows = 1;
    for (int b = 0; b < num_seqs; b++) {
        max_rows = query_start_loc[b + 1] - query_start_loc[b] > max_rows ? query_start_loc[b + 1] - query_start_loc[b]
                                                                           : max_rows;
        max_context = context_lens[b] > max_context ? context_lens[b] : max_context;
        work += context_lens[b] * (query_start_loc[b + 1] - query_start_loc[b]);
    }
    const int64_t num_pairs = (int64_t)num_seqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_pairs > 1 && work * num_heads * D > PARALLEL_WORK)
    {
        /* scores, then the heads' sums, then the key and value row pointers (at an 8-byte boundary) */
        const size_t score_len = ((size_t)max_rows * group * (max_context + 1) + 1) & ~(size_t)1;
        const size_t acc_len = ((size_t)group * D + 1) & ~(size_t)1;
        float *scores = (float *)malloc((score_len + acc_len) * sizeof(float) + 2 * (size_t)(max_context + 1) * sizeof(void *));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t pair = 0; pair < num_pairs; pair++) {
            if (!scores) continue;
            const int b = (int)(pair / num_kv_heads), g = (int)(pair % num_kv_heads);
            float *acc = scores + score_len;
            const void **keys = (const void **)(acc + acc_len), **values = keys + max_context + 1;
            const int64_t first = query_start_loc[b], last = query_start_loc[b + 1], context = context_lens[b];
            if (last <= first) continue;
            const int64_t *table = block_tables + b * table_stride;
            const int64_t first_pos = context - (last - first);
            const int64_t lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            for (int64_t p = lo; p < context; p++) {
                const int64_t slot = table[p / block_size] * block_size + p % block_size;
                const int64_t at = (slot * kv_width + (int64_t)g * D) * esize;
                keys[p - lo] = (const char *)key_cache + at;
                values[p - lo] = (const char *)value_cache + at;
            }
            /* every query row of this kv head against every key any of them sees, then each row's own range */
            const int rows_here = (int)(last - first) * group;
            const int64_t span = context - lo;
            score_rows(dtype, queries + (first * num_heads + (int64_t)g * group) * D, (int64_t)num_heads * D, group,
                       rows_here, keys, span, D, scale, scores, span);
            for (int64_t t = first; t < last; t++) {
                const int64_t pos = context - (last - t);  /* this query's position */
                const int64_t start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                const int64_t n = pos + 1 - start;
                for (int h = 0; h < group; h++) {
                    float *sc = scores + ((t - first) * group + h) * span + (start - lo);
                    float best = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : best)
                    for (int64_t j = 0; j < n; j++) best = sc[j] > best ? sc[j] : best;
                    for (int64_t j = 0; j < n; j++) sc[j] -= best;
                    exp_inplace(sc, n);
#pragma omp simd reduction(+ : total)
                    for (int64_t j = 0; j < n; j++) total += sc[j];
                    const float inv = 1.0f / total;
                    for (int64_t j = 0; j < n; j++) sc[j] *= inv;
                    weighted_rows(dtype, sc, values + (start - lo), n, D, acc + h * D);
                }
                from_f32(dtype, acc, (char *)out + (t * num_heads + (int64_t)g * group) * D * esize, (int64_t)group * D);
            }
        }
        free(scores);
    }
    free(queries);
    return failed;
}

/* ---- every plain decoder layer of a step in one call ------------------------------------------------
 * The loop of engine/models/cpu_step.py run_layers, for models whose linears a step of up to 8 rows
 * multiplies by the GGUF C kernels (kernels/quant/gguf_cpu_kernels.c): each linear is runs of block rows,
 * each run's GEMV writing its columns of the output in place, then the bias (rounded to the dtype as
 * torch's add does). A run's kernel comes as a function pointer: gguf_gemv_bf16_out (bf16 steps) or
 * gguf_gemv (float32) with the block-row signature, gguf_panel_gemv (float32 panels of 8 rows), or
 * q8x_panel_gemv (cpu_int8_activations' int8 panels of 16 rows). The
 * same calls in the same order as the Python loop, so the same bits; what goes is ~10 Python calls a layer
 * between them. */
typedef int (*step_rows_gemv)(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K,
                              const void *x, int M, void *out, int64_t out_stride, int num_threads);
typedef int (*step_panel_gemv)(int qtype, const uint8_t *panels, int64_t N, int64_t K, const void *x, int M,
                               void *out, int64_t out_stride, int num_threads);
/* q8x_panel_gemv (kernels/quant/gguf_cpu_q8x_kernels.c): cpu_int8_activations' panels of 16 rows */
typedef int (*step_int8_gemv)(int qtype, const uint8_t *panels, int64_t N, int64_t K, const void *x, int x_bf16, int M,
                              void *out, int64_t out_stride, int out_bf16, int num_threads);

#define STEP_MAX_RUNS 4
#define STEP_ROWS_KERNEL 0
#define STEP_PANEL_KERNEL 1
#define STEP_INT8_KERNEL 2

typedef struct {
    int64_t num_runs, in_features, out_features;
    int64_t qtype[STEP_MAX_RUNS], rows[STEP_MAX_RUNS], row_stride[STEP_MAX_RUNS], kind[STEP_MAX_RUNS];
    const void *data[STEP_MAX_RUNS];
    const void *kernel[STEP_MAX_RUNS];
    const void *bias; /* [out_features] of the step's dtype, or NULL */
} step_linear;

typedef struct {
    step_linear qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm: per-head RMSNorms (Qwen3) or NULL */
    double input_eps, post_eps, q_eps, k_eps;
    const void *cos_sin;
    int64_t rotary_dim, num_heads, num_kv_heads, head_dim, sliding_window;
    double scale;
} step_layer;

static inline void *at(int dtype, const void *p, int64_t i) {
    return (char *)p + i * (dtype == DT_BF16 ? 2 : 4);
}

static int step_linear_apply(int dtype, const step_linear *linear, const void *x, int64_t rows, void *out,
                             int num_threads) {
    int64_t column = 0;
    for (int64_t r = 0; r < linear->num_runs; r++) {
        const int qtype = (int)linear->qtype[r];
        void *columns = at(dtype, out, column);
        const int status = linear->kind[r] == STEP_PANEL_KERNEL
            ? ((step_panel_gemv)linear->kernel[r])(qtype, (const uint8_t *)linear->data[r], linear->rows[r],
                                                   linear->in_features, x, (int)rows, columns, linear->out_features,
                                                   num_threads)
            : linear->kind[r] == STEP_INT8_KERNEL
            ? ((step_int8_gemv)linear->kernel[r])(qtype, (const uint8_t *)linear->data[r], linear->rows[r],
                                                  linear->in_features, x, dtype == DT_BF16, (int)rows, columns,
                                                  linear->out_features, dtype == DT_BF16, num_threads)
            : ((step_rows_gemv)linear->kernel[r])(qtype, (const uint8_t *)linear->data[r], linear->row_stride[r],
                                                  linear->rows[r], linear->in_features, x, (int)rows, columns,
                                                  linear->out_features, num_threads);
        if (status) return status < 0 ? status : -status;
        column += linear->rows[r];
    }
    if (linear->bias)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t c = 0; c < linear->out_features; c++) {
                const int64_t i = m * linear->out_features + c;
                store(dtype, out, i, load(dtype, out, i) + load(dtype, linear->bias, c));
            }
    return 0;
}

/* hidden_in [rows, hidden_size] through `num_layers` layers; the last layer's output in `hidden`, the
 * residual stream in `residual` (as run_layers returns them). Scratch: normed [rows, hidden_size], qkv
 * [rows, qkv width], heads [rows, H * D], gate_up [rows, 2 I], act [rows, I]. caches: key and value cache of
 * each layer in turn. The step's metadata as step_rope_cache_attention takes it. 0, or the first failing
 * call's status (positive: out of memory, negative: a GEMV refused its arguments). */
int step_decoder_layers(int dtype, const step_layer *layers, int64_t num_layers, void *const *caches, int64_t rows,
                        int64_t hidden_size, const void *hidden_in, void *hidden, void *residual, void *normed,
                        void *qkv, void *heads, void *gate_up, void *act, const int64_t *positions,
                        const int64_t *slots, int64_t block_size, int64_t num_seqs, const int64_t *query_start_loc,
                        const int64_t *context_lens, const int64_t *block_tables, int64_t table_stride,
                        int num_threads) {
    int status;
    for (int64_t i = 0; i < num_layers; i++) {
        const step_layer *layer = layers + i;
        const int64_t H = layer->num_heads, Hkv = layer->num_kv_heads, D = layer->head_dim;
        const int64_t qkv_width = layer->qkv.out_features;
        if ((status = step_rms_norm(dtype, i == 0 ? hidden_in : hidden, i == 0 ? NULL : residual, layer->input_norm,
                                    (float)layer->input_eps, rows, hidden_size, normed, residual)))
            return status;
        if ((status = step_linear_apply(dtype, &layer->qkv, normed, rows, qkv, num_threads))) return status;
        if (layer->q_norm)  /* each row's query heads, then its key heads, normed in place */
            for (int64_t t = 0; t < rows; t++) {
                void *row = at(dtype, qkv, t * qkv_width), *keys = at(dtype, qkv, t * qkv_width + H * D);
                if ((status = step_rms_norm(dtype, row, NULL, layer->q_norm, (float)layer->q_eps, H, D, row, NULL)) ||
                    (status = step_rms_norm(dtype, keys, NULL, layer->k_norm, (float)layer->k_eps, Hkv, D, keys, NULL)))
                    return status;
            }
        if ((status = step_rope_cache_attention(dtype, qkv, qkv_width, rows, (int)H, (int)Hkv, (int)D, positions,
                                                layer->cos_sin, (int)layer->rotary_dim, caches[2 * i],
                                                caches[2 * i + 1], slots, (int)block_size, (int)num_seqs,
                                                query_start_loc, context_lens, block_tables, table_stride,
                                                (float)layer->scale, layer->sliding_window, heads, num_threads)))
            return status;
        if ((status = step_linear_apply(dtype, &layer->o, heads, rows, hidden, num_threads))) return status;
        if ((status = step_rms_norm(dtype, hidden, residual, layer->post_norm, (float)layer->post_eps, rows,
                                    hidden_size, normed, residual)))
            return status;
        if ((status = step_linear_apply(dtype, &layer->gate_up, normed, rows, gate_up, num_threads))) return status;
        if ((status = step_silu_and_mul(dtype, gate_up, rows, layer->gate_up.out_features / 2, act))) return status;
        if ((status = step_linear_apply(dtype, &layer->down, act, rows, hidden, num_threads))) return status;
    }
    return 0;
}
