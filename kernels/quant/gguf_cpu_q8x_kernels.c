/* Int8-activation GEMV kernels for llama.cpp block rows (Q4_0, Q4_1, Q8_0; Q4_K and Q6_K in panels), as
 * llama.cpp computes them.
 *
 * Built at first use by gguf_cpu_q8x.py (the builder of gguf_cpu_native.py, same flags) and called
 * through ctypes. Opt-in (EngineConfig.cpu_int8_activations): not the exact bf16/float32 math.
 *
 *   q8x_quantize: x [M, K] (float32 or bf16) -> per row, per block of 32: scale d = max|x| / 127
 *                 (float32), id = d ? 1 / d : 0, codes q = round-to-nearest-even(x * id) (int8),
 *                 and xsum = d * sum(q) (float32, for the types with a minimum).
 *   q8x_gemv:     out[m, n] = sum over blocks b of (dw_b * d_b) * isum_b + mw_b * xsum_b, isum_b the
 *                 exact integer dot product of the file's codes and x's codes (Q4_0: mw = -8 dw;
 *                 Q8_0: no minimum). float32 sums (or bf16 out, rounded to nearest even).
 *
 * Paths: q8x_panel_gemv (AVX-512 VNNI, or AVX2: the same integer sums, the fast one: the weight repacked by
 * q8x_pack into panels of 16 output rows, one int32 lane per row, see "panels" below; also Q4_K and Q6_K);
 * q8x_gemv, the row kernel:
 * AVX-512 VNNI (vpdpbusd, two blocks per instruction: u8 weight codes x s8 x codes; Q8_0's signed codes as
 * |w| times x with w's sign), AVX2 (vpmaddubsw + vpmaddwd, one block), plain C.
 * Every row of x runs the same operations whatever M is (1..8), so a row's result does not depend on
 * the other rows of the call (a speculative verify row gets a one-row decode step's bits), and the
 * result does not depend on the thread count (threads split the output rows).
 * The float32 accumulation differs between the paths (lanes vs one scalar), not the integer sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 4, Q4_K = 5, Q6_K = 7 };
#define QK 32
#define MAX_M 8

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8X_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8X_AVX2 1
#endif

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {
        exponent = 113;
        while (!(mantissa & 1024)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 1023) << 13);
    } else {
        bits = sign;
    }
    float value;
    memcpy(&value, &bits, 4);
    return value;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint16_t f32_to_bf16(float v) {  /* round to nearest even (NaN kept quiet) */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

int q8x_has_vnni(void) {
#ifdef Q8X_AVX512
    return 1;
#else
    return 0;
#endif
}

int q8x_has_panels(void) {  /* q8x_panel_gemv runs here (AVX-512 VNNI or AVX2) */
#if defined(Q8X_AVX512) || defined(Q8X_AVX2)
    return 1;
#else
    return 0;
#endif
}

int q8x_has_avx2(void) {
#if defined(Q8X_AVX512) || defined(Q8X_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* One row of x (K values, K % 32 == 0) -> codes, scales, xsums; also the kernels' expanded scales
   (8 lanes per block: d and xsum / 8, the latter exact: a power of two). */
static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *d_out, float *s_out,
                         float *d8, float *s8) {
    const int64_t nb = K / QK;
    float v[QK];
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            v[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + j]) : ((const float *)x)[b * QK + j];
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int c = (int)nearbyintf(v[j] * id);  /* default rounding mode: to nearest even */
            c = c > 127 ? 127 : c < -127 ? -127 : c;
            q[b * QK + j] = (int8_t)c;
            sum += c;
        }
        const float s = d * (float)sum;
        if (d_out) d_out[b] = d;
        if (s_out) s_out[b] = s;
        if (d8) for (int j = 0; j < 8; j++) { d8[b * 8 + j] = d; s8[b * 8 + j] = s * 0.125f; }
    }
}

int q8x_quantize(const void *x, int x_bf16, int M, int64_t K, int8_t *q, float *d, float *s) {
    if (K % QK || M < 0) return 1;
    for (int m = 0; m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K),
                     x_bf16, K, q + m * K, d + m * (K / QK), s + m * (K / QK), NULL, NULL);
    return 0;
}

static inline int block_bytes(int qtype) { return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 34; }

/* One output row n: the plain C path. Not auto-vectorized: gcc 12-13 -O2 -march=native turned the
   signed x signed Q8_0 loop into vpdpbusd (unsigned x signed) here, wrong sums (seen on Zen 4). */
__attribute__((optimize("no-tree-vectorize")))
static void row_scalar(int qtype, const uint8_t *w, int64_t nb, int M, const int8_t *q, int64_t K,
                       const float *dx, const float *sx, float *acc) {
    const int bb = block_bytes(qtype);
    for (int m = 0; m < M; m++) {
        const int8_t *xq = q + m * K;
        float a = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bb;
            const float dw = f16(blk);
            int isum = 0;
            float mw = 0.0f;
            if (qtype == Q8_0) {
                for (int j = 0; j < QK; j++) isum += (int)(int8_t)blk[2 + j] * xq[b * QK + j];
            } else {
                const uint8_t *qs = blk + (qtype == Q4_1 ? 4 : 2);
                mw = qtype == Q4_1 ? f16(blk + 2) : -8.0f * dw;
                for (int j = 0; j < 16; j++)
                    isum += (int)(qs[j] & 15) * xq[b * QK + j] + (int)(qs[j] >> 4) * xq[b * QK + j + 16];
            }
            a += (dw * dx[m * nb + b]) * (float)isum;
            if (qtype != Q8_0) a += mw * sx[m * nb + b];
        }
        acc[m] = a;
    }
}

#ifdef Q8X_AVX512
static inline __m512i q4_pair(const uint8_t *q0, const uint8_t *q1) {
    /* [q0 | q1] -> [lo0, hi0, lo1, hi1] (16 bytes each): block b's values 0..15 then 16..31 */
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q0)),
                                              _mm_loadu_si128((const __m128i *)q1), 1);
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline float hsum512(__m512 v) {
    /* fixed order: 16 -> 8 -> 4 -> 2 -> 1 */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 f = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    f = _mm_add_ps(f, _mm_movehl_ps(f, f));
    f = _mm_add_ss(f, _mm_movehdup_ps(f));
    return _mm_cvtss_f32(f);
}

static void row_avx512(int qtype, const uint8_t *w, int64_t nb, int M, const int8_t *q, int64_t K,
                       const float *d8, const float *s8, float *out) {
    const int bb = block_bytes(qtype);
    __m512 acc[MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = w + b * bb, *b1 = b0 + bb;
        const float dw0 = f16(b0), dw1 = f16(b1);
        const __m512 dwv = _mm512_insertf32x8(_mm512_set1_ps(dw0), _mm256_set1_ps(dw1), 1);
        if (qtype == Q8_0) {
            const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                                  _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
            const __m512i wa = _mm512_abs_epi8(wv);
            const __mmask64 neg = _mm512_movepi8_mask(wv);
            for (int m = 0; m < M; m++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(q + m * K + b * QK));
                const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, xs);
                const __m512 scale = _mm512_mul_ps(dwv, _mm512_loadu_ps(d8 + m * nb * 8 + b * 8));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[m]);
            }
        } else {
            const int off = qtype == Q4_1 ? 4 : 2;
            const __m512i wv = q4_pair(b0 + off, b1 + off);
            const float mw0 = qtype == Q4_1 ? f16(b0 + 2) : -8.0f * dw0, mw1 = qtype == Q4_1 ? f16(b1 + 2) : -8.0f * dw1;
            const __m512 mwv = _mm512_insertf32x8(_mm512_set1_ps(mw0), _mm256_set1_ps(mw1), 1);
            for (int m = 0; m < M; m++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(q + m * K + b * QK));
                const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                const __m512 scale = _mm512_mul_ps(dwv, _mm512_loadu_ps(d8 + m * nb * 8 + b * 8));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[m]);
                acc[m] = _mm512_fmadd_ps(mwv, _mm512_loadu_ps(s8 + m * nb * 8 + b * 8), acc[m]);
            }
        }
    }
    if (b < nb) {  /* an odd last block: the upper half's weights and scales zero */
        const uint8_t *b0 = w + b * bb;
        const float dw0 = f16(b0);
        const __m512 dwv = _mm512_insertf32x8(_mm512_set1_ps(dw0), _mm256_setzero_ps(), 1);
        __m512i wv;
        __m512 mwv = _mm512_setzero_ps();
        __mmask64 neg = 0;
        if (qtype == Q8_0) {
            const __m512i raw = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2)));
            wv = _mm512_maskz_mov_epi8(0xFFFFFFFFull, _mm512_abs_epi8(raw));
            neg = _mm512_movepi8_mask(raw) & 0xFFFFFFFFull;
        } else {
            const int off = qtype == Q4_1 ? 4 : 2;
            wv = _mm512_maskz_mov_epi8(0xFFFFFFFFull, q4_pair(b0 + off, b0 + off));
            const float mw0 = qtype == Q4_1 ? f16(b0 + 2) : -8.0f * dw0;
            mwv = _mm512_insertf32x8(_mm512_set1_ps(mw0), _mm256_setzero_ps(), 1);
        }
        for (int m = 0; m < M; m++) {
            __m512i xv = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, (const void *)(q + m * K + b * QK));
            if (qtype == Q8_0) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
            const __m512 d8v = _mm512_maskz_loadu_ps(0xFF, d8 + m * nb * 8 + b * 8);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dwv, d8v), acc[m]);
            if (qtype != Q8_0)
                acc[m] = _mm512_fmadd_ps(mwv, _mm512_maskz_loadu_ps(0xFF, s8 + m * nb * 8 + b * 8), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum512(acc[m]);
}
#endif

#ifdef Q8X_AVX2
static inline float hsum256(__m256 v) {
    __m128 f = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    f = _mm_add_ps(f, _mm_movehl_ps(f, f));
    f = _mm_add_ss(f, _mm_movehdup_ps(f));
    return _mm_cvtss_f32(f);
}

static void row_avx2(int qtype, const uint8_t *w, int64_t nb, int M, const int8_t *q, int64_t K,
                     const float *dx, const float *sx, float *out) {
    const int bb = block_bytes(qtype);
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
    __m256 acc[MAX_M];
    float macc[MAX_M];
    for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); macc[m] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const float dw = f16(blk);
        if (qtype == Q8_0) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i wa = _mm256_sign_epi8(wv, wv);
            for (int m = 0; m < M; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + m * K + b * QK));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv)), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dx[m * nb + b]), acc[m]);
            }
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2)));
            const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
            const __m256i wv = _mm256_and_si256(v, mask);
            const float mw = qtype == Q4_1 ? f16(blk + 2) : -8.0f * dw;
            for (int m = 0; m < M; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + m * K + b * QK));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dx[m * nb + b]), acc[m]);
                macc[m] += mw * sx[m * nb + b];
            }
        }
    }
    for (int m = 0; m < M; m++) out[m] = hsum256(acc[m]) + macc[m];
}
#endif


/* ---- panels of 16 output rows (AVX-512 VNNI): one int32 lane per output row ------------------------
 * Per panel p (rows 16p..16p+15) and block b, PANEL_BYTES(qtype) bytes: the 16 rows' fp16 d (32 B), then
 * Q4_1: their fp16 m (32 B); Q8_0: their int16 code sums (32 B); then the codes as 64-byte vectors, vector t
 * holding, at bytes 4r..4r+3, row r's block bytes 4t..4t+3 (Q4: 4 vectors, whose low nibbles are values
 * 4t..4t+3 and high ones 16+4t..; Q8_0: 8 vectors). So vpdpbusd of vector t and x's 4 codes 4t..4t+3
 * (broadcast) adds each row's 4 products into its own lane: no horizontal sums, one float scale per
 * block per 16 rows. Q8_0's signed codes take x's codes + 128 (unsigned), minus 128 * the code sum. */
#define PANEL 16
static inline int panel_bytes(int qtype) { return qtype == Q4_0 ? 32 + 256 : qtype == Q4_1 ? 64 + 256 : 64 + 512; }

#define Q6K_PANEL (32 + 256 + 4096)
int q8x_panel_bytes(int qtype) {  /* per panel and block (Q4_K, Q6_K: per superblock of 256) */
    return qtype == Q6_K ? Q6K_PANEL : qtype == Q4_K ? 64 + 256 + 2048 : (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) ? panel_bytes(qtype) : 0;
}

/* Q4_K panels, per superblock: 16 fp16 d, 16 fp16 dmin, then sub-block s's 16 6-bit scales (uint8, 8 x 16),
   its 16 mins (8 x 16), then the codes: chunk c (sub-blocks 2c, 2c+1: 32 bytes a row, low nibbles 2c's,
   high 2c+1's) as 8 vectors of 64 bytes, vector t holding row r's chunk bytes 4t..4t+3 at 4r. */
static int pack_q4_k(const uint8_t *w, int64_t stride, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / 256;
    const int pb = 64 + 256 + 2048;
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * pb;
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = w + (p * PANEL + r) * stride + b * 144, *q = blk + 4;
                memcpy(dst + 2 * r, blk, 2);
                memcpy(dst + 32 + 2 * r, blk + 2, 2);
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, mn;
                    if (j < 4) { sc = q[j] & 63; mn = q[j + 4] & 63; }
                    else { sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
                    dst[64 + j * 16 + r] = sc;
                    dst[64 + 128 + j * 16 + r] = mn;
                }
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < 8; t++)
                        memcpy(dst + 320 + c * 512 + t * 64 + 4 * r, blk + 16 + c * 32 + 4 * t, 4);
            }
        }
    return 0;
}

/* Q6_K panels, per superblock: 16 fp16 d, then sub-block s's (16 values) 16 int8 scales (16 x 16), then the
   6-bit codes unpacked to bytes (0..63): x block j (values 32j..32j+31) as 8 vectors of 64 bytes, vector t
   holding row r's values 32j+4t..32j+4t+3 at 4r (1 byte a value: 1.2x the file's bits, no unpacking). */
static int pack_q6_k(const uint8_t *w, int64_t stride, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / 256;
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * Q6K_PANEL;
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = w + (p * PANEL + r) * stride + b * 210;
                uint8_t y[256];
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                    for (int l = 0; l < 32; l++) {
                        y[128 * h + l] = (uint8_t)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4));
                        y[128 * h + l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                        y[128 * h + l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                        y[128 * h + l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                    }
                }
                memcpy(dst + 2 * r, blk + 208, 2);
                for (int sb = 0; sb < 16; sb++) dst[32 + sb * 16 + r] = blk[192 + sb];
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 8; t++) memcpy(dst + 288 + j * 512 + t * 64 + 4 * r, y + 32 * j + 4 * t, 4);
            }
        }
    return 0;
}

int q8x_pack(int qtype, const uint8_t *w, int64_t stride, int64_t N, int64_t K, uint8_t *out) {
    if (qtype == Q6_K) return K % 256 || N % PANEL ? 1 : pack_q6_k(w, stride, N, K, out);
    if (qtype == Q4_K) return K % 256 || N % PANEL ? 1 : pack_q4_k(w, stride, N, K, out);
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K % QK || N % PANEL) return 1;
    const int64_t nb = K / QK;
    const int bb = block_bytes(qtype), pb = panel_bytes(qtype), off = qtype == Q4_1 ? 4 : 2;
    const int vectors = qtype == Q8_0 ? 8 : 4;
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * pb;
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = w + (p * PANEL + r) * stride + b * bb;
                memcpy(dst + 2 * r, blk, 2);
                if (qtype == Q4_1) memcpy(dst + 32 + 2 * r, blk + 2, 2);
                if (qtype == Q8_0) {
                    int16_t sum = 0;
                    for (int j = 0; j < QK; j++) sum = (int16_t)(sum + (int8_t)blk[2 + j]);
                    memcpy(dst + 32 + 2 * r, &sum, 2);
                }
                uint8_t *codes = dst + (qtype == Q4_0 ? 32 : 64);
                for (int t = 0; t < vectors; t++) memcpy(codes + t * 64 + 4 * r, blk + off + 4 * t, 4);
            }
        }
    return 0;
}

#ifdef Q8X_AVX512
/* M a constant in each instance (panel_avx512 below) and the loops over it unrolled: the accumulators
   then live in registers (a rolled loop keeps them on the stack). */
#define UNROLL _Pragma("GCC unroll 8")
static inline __attribute__((always_inline)) void panel_avx512_m(
        int qtype, const uint8_t *panel, int64_t nb, const int M, const int8_t *q, const uint8_t *qu, int64_t K,
        const float *dx, const float *sx, float *out, int64_t ldo) {
    const int pb = panel_bytes(qtype);
    __m512 acc0[MAX_M], acc1[MAX_M];
    UNROLL for (int m = 0; m < M; m++) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); }
    const __m512i mask = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * pb;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        if (qtype == Q8_0) {
            const __m512i corr = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32))), 7);
            __m512i wv[8];
            UNROLL for (int t = 0; t < 8; t++) wv[t] = _mm512_loadu_si512((const void *)(blk + 64 + 64 * t));
            UNROLL for (int m = 0; m < M; m++) {
                const int32_t *xb = (const int32_t *)(qu + m * K + b * QK);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                UNROLL for (int t = 0; t < 8; t += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(xb[t]), wv[t]);
                    s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(xb[t + 1]), wv[t + 1]);
                }
                const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b]));
                if (b & 1) acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc1[m]);
                else acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc0[m]);
            }
        } else {
            const __m512 mw = qtype == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                            : _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f));
            const uint8_t *codes = blk + (qtype == Q4_0 ? 32 : 64);
            __m512i lo[4], hi[4];
            UNROLL for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + 64 * t));
                lo[t] = _mm512_and_si512(v, mask);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
            UNROLL for (int m = 0; m < M; m++) {
                const int32_t *xb = (const int32_t *)(q + m * K + b * QK);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                UNROLL for (int t = 0; t < 4; t++) {
                    s0 = _mm512_dpbusd_epi32(s0, lo[t], _mm512_set1_epi32(xb[t]));
                    s1 = _mm512_dpbusd_epi32(s1, hi[t], _mm512_set1_epi32(xb[t + 4]));
                }
                const __m512i isum = _mm512_add_epi32(s0, s1);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b]));
                __m512 a = b & 1 ? acc1[m] : acc0[m];
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, a);
                a = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), a);
                if (b & 1) acc1[m] = a; else acc0[m] = a;
            }
        }
    }
    UNROLL for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(acc0[m], acc1[m]));
}

static inline __attribute__((always_inline)) void panel_q4_k_m(
        const uint8_t *panel, int64_t nsb, const int M, const int8_t *q, int64_t K, const float *dx, const float *sx,
        float *out, int64_t ldo) {
    const int pb = 64 + 256 + 2048;
    const int64_t nb = nsb * 8;  /* x's blocks of 32 */
    __m512 acc0[MAX_M], acc1[MAX_M];
    UNROLL for (int m = 0; m < M; m++) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); }
    const __m512i mask = _mm512_set1_epi8(15);
    for (int64_t B = 0; B < nsb; B++) {
        const uint8_t *blk = panel + B * pb;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        for (int s = 0; s < 8; s++) {
            /* sub-block s: (d * sc) and -(dmin * mn) in float32, as the reference decodes */
            const __m512 dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 64 + s * 16)))));
            const __m512 mw = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192 + s * 16))))));
            const uint8_t *codes = blk + 320 + (s >> 1) * 512;
            __m512i wv[8];
            UNROLL for (int t = 0; t < 8; t++) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + 64 * t));
                wv[t] = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(v, 4) : v, mask);
            }
            const int64_t xb = B * 8 + s;
            UNROLL for (int m = 0; m < M; m++) {
                const int32_t *xq = (const int32_t *)(q + m * K + xb * QK);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                UNROLL for (int t = 0; t < 8; t += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(xq[t]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[t + 1], _mm512_set1_epi32(xq[t + 1]));
                }
                const __m512i isum = _mm512_add_epi32(s0, s1);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + xb]));
                __m512 a = s & 1 ? acc1[m] : acc0[m];
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, a);
                a = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + xb]), a);
                if (s & 1) acc1[m] = a; else acc0[m] = a;
            }
        }
    }
    UNROLL for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(acc0[m], acc1[m]));
}

/* xs32[m * K / 16 + i]: 32 * the sum of x's codes i*16..i*16+15 (Q6_K's -32 offset, in integers). */
static inline __attribute__((always_inline)) void panel_q6_k_m(
        const uint8_t *panel, int64_t nsb, const int M, const int8_t *q, int64_t K, const float *dx,
        const int32_t *xs32, float *out, int64_t ldo) {
    const int64_t nb = nsb * 8;
    __m512 acc0[MAX_M], acc1[MAX_M];
    UNROLL for (int m = 0; m < M; m++) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); }
    for (int64_t B = 0; B < nsb; B++) {
        const uint8_t *blk = panel + B * Q6K_PANEL;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        for (int j = 0; j < 8; j++) {
            const __m512 dw0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 32 + (2 * j) * 16)))));
            const __m512 dw1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 32 + (2 * j + 1) * 16)))));
            const uint8_t *codes = blk + 288 + j * 512;
            __m512i wv[8];
            UNROLL for (int t = 0; t < 8; t++) wv[t] = _mm512_loadu_si512((const void *)(codes + 64 * t));
            const int64_t xb = B * 8 + j;
            UNROLL for (int m = 0; m < M; m++) {
                const int32_t *xq = (const int32_t *)(q + m * K + xb * QK);
                __m512i s0 = _mm512_set1_epi32(-xs32[m * (K / 16) + 2 * xb]);
                __m512i s1 = _mm512_set1_epi32(-xs32[m * (K / 16) + 2 * xb + 1]);
                UNROLL for (int t = 0; t < 4; t++) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(xq[t]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[t + 4], _mm512_set1_epi32(xq[t + 4]));
                }
                const __m512 xd = _mm512_set1_ps(dx[m * nb + xb]);
                __m512 a = j & 1 ? acc1[m] : acc0[m];
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dw0, xd), a);
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dw1, xd), a);
                if (j & 1) acc1[m] = a; else acc0[m] = a;
            }
        }
    }
    UNROLL for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(acc0[m], acc1[m]));
}

static void panel_avx512(int qtype, const uint8_t *panel, int64_t nb, int M, const int8_t *q, const uint8_t *qu,
                         int64_t K, const float *dx, const float *sx, float *out, int64_t ldo) {
    if (qtype == Q6_K) {  /* qu: the int32 sums xs32 */
        switch (M) {
#define CASE(m) case m: panel_q6_k_m(panel, nb / 8, m, q, K, dx, (const int32_t *)qu, out, ldo); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
        return;
    }
    if (qtype == Q4_K) {
        switch (M) {
#define CASE(m) case m: panel_q4_k_m(panel, nb / 8, m, q, K, dx, sx, out, ldo); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
        return;
    }
    switch (M) {
#define CASE(m) case m: panel_avx512_m(qtype, panel, nb, m, q, qu, K, dx, sx, out, ldo); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}
#endif

#ifdef Q8X_AVX2
/* The same panels on AVX2 (no VNNI). A 64-byte vector of 16 rows is two registers (rows 0..7, 8..15), both
 * multiplied by the same broadcast x codes. vpdpbusd becomes vpmaddubsw (u8 weight codes x s8 x codes, pairs
 * summed in int16), whose int16 sums are added up before one vpmaddwd (ones) widens them: exact, no
 * saturation (4-bit codes: 8 products of |2 * 15 * 127| per lane < 2^15 for a block of 32; Q6_K's 6-bit codes:
 * 2 of |2 * 63 * 127|; Q8_0: |w| times x with w's sign, |2 * 128 * 127|, widened one at a time). The float32
 * steps per block: acc += float(isum) * (dw * dx), then (Q4_1/Q4_K) acc += mw * sx. Rows of x go through in
 * passes of up to Q8X_AVX2_PASS, each row the same operations whatever M is (a verify row gets a one-row
 * step's bits); the accumulators of a pass stay in a small buffer (L1). Not the AVX-512 kernel's bits (its
 * float32 sums alternate two accumulators). */
#define Q8X_AVX2_PASS 4
#define UNROLL2 _Pragma("GCC unroll 8")
/* The panel streams from DRAM once per step: its bytes asked for this far ahead, as gguf_cpu_kernels.c's
   GEMVs do (AMD EPYC Zen 3, 1 row, from DRAM: Q8_0 [49152, 576] 2.6-3.0 -> 2.4 ms, Q4_K [8192, 2048]
   0.91-0.97 -> 0.70-0.80). */
#define Q8X_PREFETCH_BYTES 4096
static inline void prefetch_ahead(const uint8_t *p, int size) {
    for (int i = 0; i < size; i += 64) __builtin_prefetch(p + Q8X_PREFETCH_BYTES + i, 0, 3);
}

static inline __m256i widen16(__m256i p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline void acc_update(float *acc, __m256i isum0, __m256i isum1, __m256 dw0, __m256 dw1, float dx) {
    const __m256 xd = _mm256_set1_ps(dx);
    _mm256_storeu_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum0), _mm256_mul_ps(dw0, xd), _mm256_loadu_ps(acc)));
    _mm256_storeu_ps(acc + 8,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum1), _mm256_mul_ps(dw1, xd), _mm256_loadu_ps(acc + 8)));
}

static inline void min_update(float *acc, __m256 mw0, __m256 mw1, float sx) {
    const __m256 s = _mm256_set1_ps(sx);
    _mm256_storeu_ps(acc, _mm256_fmadd_ps(mw0, s, _mm256_loadu_ps(acc)));
    _mm256_storeu_ps(acc + 8, _mm256_fmadd_ps(mw1, s, _mm256_loadu_ps(acc + 8)));
}

/* Q4_0 / Q4_1 / Q8_0 panels, M rows of x (q, dx, sx at the pass's first row), acc [M][16] */
static inline __attribute__((always_inline)) void panel_avx2_m(
        int qtype, const uint8_t *panel, int64_t nb, const int M, const int8_t *q, int64_t K,
        const float *dx, const float *sx, float *acc) {
    const int pb = panel_bytes(qtype);
    const __m256i mask = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * pb;
        prefetch_ahead(blk, pb);
        const __m256 dw0 = f16x8(blk);
        const __m256 dw1 = f16x8(blk + 16);
        __m256i s0[Q8X_AVX2_PASS], s1[Q8X_AVX2_PASS];
        if (qtype == Q8_0) {
            UNROLL2 for (int m = 0; m < M; m++) s0[m] = s1[m] = _mm256_setzero_si256();
            UNROLL2 for (int t = 0; t < 8; t++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 64 * t));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 64 * t + 32));
                const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
                UNROLL2 for (int m = 0; m < M; m++) {
                    const __m256i xv = _mm256_set1_epi32(((const int32_t *)(q + m * K + b * QK))[t]);
                    s0[m] = _mm256_add_epi32(s0[m], widen16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0))));
                    s1[m] = _mm256_add_epi32(s1[m], widen16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1))));
                }
            }
            UNROLL2 for (int m = 0; m < M; m++) acc_update(acc + 16 * m, s0[m], s1[m], dw0, dw1, dx[m * nb + b]);
        } else {
            const uint8_t *codes = blk + (qtype == Q4_0 ? 32 : 64);
            UNROLL2 for (int m = 0; m < M; m++) s0[m] = s1[m] = _mm256_setzero_si256();
            UNROLL2 for (int t = 0; t < 4; t++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t + 32));
                const __m256i lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
                const __m256i lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
                UNROLL2 for (int m = 0; m < M; m++) {
                    const int32_t *xb = (const int32_t *)(q + m * K + b * QK);
                    const __m256i xl = _mm256_set1_epi32(xb[t]), xh = _mm256_set1_epi32(xb[t + 4]);
                    s0[m] = _mm256_add_epi16(s0[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                     _mm256_maddubs_epi16(hi0, xh)));
                    s1[m] = _mm256_add_epi16(s1[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                     _mm256_maddubs_epi16(hi1, xh)));
                }
            }
            UNROLL2 for (int m = 0; m < M; m++)
                acc_update(acc + 16 * m, widen16(s0[m]), widen16(s1[m]), dw0, dw1, dx[m * nb + b]);
            /* the minimum: Q4_1's fp16 m, Q4_0's -8 d */
            const __m256 mw0 = qtype == Q4_1 ? f16x8(blk + 32) : _mm256_mul_ps(dw0, _mm256_set1_ps(-8.0f));
            const __m256 mw1 = qtype == Q4_1 ? f16x8(blk + 48) : _mm256_mul_ps(dw1, _mm256_set1_ps(-8.0f));
            UNROLL2 for (int m = 0; m < M; m++) min_update(acc + 16 * m, mw0, mw1, sx[m * nb + b]);
        }
    }
}

static inline __attribute__((always_inline)) void panel_q4_k_avx2_m(
        const uint8_t *panel, int64_t nsb, const int M, const int8_t *q, int64_t K, const float *dx, const float *sx,
        float *acc) {
    const int pb = 64 + 256 + 2048;
    const int64_t nb = nsb * 8;
    const __m256i mask = _mm256_set1_epi8(15);
    for (int64_t B = 0; B < nsb; B++) {
        const uint8_t *blk = panel + B * pb;
        prefetch_ahead(blk, pb);
        const __m256 d0 = f16x8(blk);
        const __m256 d1 = f16x8(blk + 16);
        const __m256 dmin0 = f16x8(blk + 32);
        const __m256 dmin1 = f16x8(blk + 48);
        for (int s = 0; s < 8; s++) {
            /* sub-block s: (d * sc) and -(dmin * mn) in float32, as the reference decodes */
            const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 64 + s * 16));
            const __m128i mn = _mm_loadu_si128((const __m128i *)(blk + 192 + s * 16));
            const __m256 dw0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
            const __m256 dw1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))));
            const __m256 mw0 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin0, _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(mn))));
            const __m256 mw1 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin1, _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8)))));
            const uint8_t *codes = blk + 320 + (s >> 1) * 512;
            const int64_t xb = B * 8 + s;
            __m256i s0[Q8X_AVX2_PASS], s1[Q8X_AVX2_PASS];
            UNROLL2 for (int m = 0; m < M; m++) s0[m] = s1[m] = _mm256_setzero_si256();
            UNROLL2 for (int t = 0; t < 8; t++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t + 32));
                const __m256i w0 = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(v0, 4) : v0, mask);
                const __m256i w1 = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(v1, 4) : v1, mask);
                UNROLL2 for (int m = 0; m < M; m++) {
                    const __m256i xv = _mm256_set1_epi32(((const int32_t *)(q + m * K + xb * QK))[t]);
                    s0[m] = _mm256_add_epi16(s0[m], _mm256_maddubs_epi16(w0, xv));
                    s1[m] = _mm256_add_epi16(s1[m], _mm256_maddubs_epi16(w1, xv));
                }
            }
            UNROLL2 for (int m = 0; m < M; m++) {
                acc_update(acc + 16 * m, widen16(s0[m]), widen16(s1[m]), dw0, dw1, dx[m * nb + xb]);
                min_update(acc + 16 * m, mw0, mw1, sx[m * nb + xb]);
            }
        }
    }
}

/* xs32[m * K / 16 + i]: 32 * the sum of x's codes i*16..i*16+15 (Q6_K's -32 offset, in integers). */
static inline __attribute__((always_inline)) void panel_q6_k_avx2_m(
        const uint8_t *panel, int64_t nsb, const int M, const int8_t *q, int64_t K, const float *dx,
        const int32_t *xs32, float *acc) {
    const int64_t nb = nsb * 8;
    for (int64_t B = 0; B < nsb; B++) {
        const uint8_t *blk = panel + B * Q6K_PANEL;
        prefetch_ahead(blk, Q6K_PANEL);
        const __m256 d0 = f16x8(blk);
        const __m256 d1 = f16x8(blk + 16);
        for (int j = 0; j < 8; j++) {
            const uint8_t *codes = blk + 288 + j * 512;
            const int64_t xb = B * 8 + j;
            for (int g = 0; g < 2; g++) {  /* sub-block 2j + g: 16 values, 4 vectors */
                const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 32 + (2 * j + g) * 16));
                const __m256 dw0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
                const __m256 dw1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
                __m256i s0[Q8X_AVX2_PASS], s1[Q8X_AVX2_PASS];
                UNROLL2 for (int m = 0; m < M; m++) s0[m] = s1[m] = _mm256_set1_epi32(-xs32[m * (K / 16) + 2 * xb + g]);
                UNROLL2 for (int t = 4 * g; t < 4 * g + 4; t += 2) {
                    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t));
                    const __m256i a1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * t + 32));
                    const __m256i b0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * (t + 1)));
                    const __m256i b1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * (t + 1) + 32));
                    UNROLL2 for (int m = 0; m < M; m++) {
                        const int32_t *xq = (const int32_t *)(q + m * K + xb * QK);
                        const __m256i xa = _mm256_set1_epi32(xq[t]), xbv = _mm256_set1_epi32(xq[t + 1]);
                        s0[m] = _mm256_add_epi32(s0[m], widen16(_mm256_add_epi16(_mm256_maddubs_epi16(a0, xa),
                                                                                _mm256_maddubs_epi16(b0, xbv))));
                        s1[m] = _mm256_add_epi32(s1[m], widen16(_mm256_add_epi16(_mm256_maddubs_epi16(a1, xa),
                                                                                _mm256_maddubs_epi16(b1, xbv))));
                    }
                }
                UNROLL2 for (int m = 0; m < M; m++) acc_update(acc + 16 * m, s0[m], s1[m], dw0, dw1, dx[m * nb + xb]);
            }
        }
    }
}

/* qu: Q6_K's int32 sums xs32 (else unused: Q8_0 takes the signed codes q); r [M][16] */
static void panel_avx2(int qtype, const uint8_t *panel, int64_t nb, int M, const int8_t *q, const uint8_t *qu,
                       int64_t K, const float *dx, const float *sx, float *r) {
    memset(r, 0, sizeof(float) * (size_t)(M * PANEL));
    for (int m0 = 0; m0 < M; m0 += Q8X_AVX2_PASS) {
        const int rows = M - m0 < Q8X_AVX2_PASS ? M - m0 : Q8X_AVX2_PASS;
        const int8_t *qm = q + m0 * K;
        const float *dm = dx + m0 * nb, *sm = sx + m0 * nb;
        const int32_t *xm = (const int32_t *)qu + m0 * (K / 16);
        float *am = r + m0 * PANEL;
        if (qtype == Q6_K) {
            switch (rows) {
#define CASE(m) case m: panel_q6_k_avx2_m(panel, nb / 8, m, qm, K, dm, xm, am); break;
                CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
            }
        } else if (qtype == Q4_K) {
            switch (rows) {
#define CASE(m) case m: panel_q4_k_avx2_m(panel, nb / 8, m, qm, K, dm, sm, am); break;
                CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
            }
        } else {
            switch (rows) {
#define CASE(m) case m: panel_avx2_m(qtype, panel, nb, m, qm, K, dm, sm, am); break;
                CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
            }
        }
    }
}
#endif

/* As q8x_gemv on q8x_pack's panels (AVX-512 VNNI and AVX2 builds; returns 3 elsewhere). */
int q8x_panel_gemv(int qtype, const uint8_t *panels, int64_t N, int64_t K, const void *x, int x_bf16, int M,
                   void *out, int64_t ldo, int out_bf16, int num_threads) {
#if defined(Q8X_AVX512) || defined(Q8X_AVX2)
    const int super = qtype == Q4_K || qtype == Q6_K;
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0 && !super) || K % (super ? 256 : QK)
            || N % PANEL || M < 1 || M > MAX_M) return 1;
    const int64_t nb = K / QK;
    int8_t *q = (int8_t *)malloc((size_t)(M * K) * 2 + sizeof(int32_t) * (size_t)(M * K / 16));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb * 2));
    if (!q || !dx) { free(q); free(dx); return 2; }
    uint8_t *qu = (uint8_t *)(q + M * K);
    float *sx = dx + M * nb;
    for (int m = 0; m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K),
                     x_bf16, K, q + m * K, dx + m * nb, sx + m * nb, NULL, NULL);
#ifdef Q8X_AVX512
    if (qtype == Q8_0)
        for (int64_t i = 0; i < M * K; i++) qu[i] = (uint8_t)(q[i] + 128);
#endif
    if (qtype == Q6_K) {  /* 32 * the sums of x's codes per 16 (Q6_K's -32 offset), after the codes */
        int32_t *xs32 = (int32_t *)(q + M * K * 2);
        for (int64_t i = 0; i < M * K / 16; i++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[i * 16 + j];
            xs32[i] = 32 * sum;
        }
        qu = (uint8_t *)xs32;
    }
    /* bytes per panel */
    const int64_t panel_stride = qtype == Q6_K ? K / 256 * Q6K_PANEL : qtype == Q4_K ? K / 256 * (64 + 256 + 2048)
                                                                      : nb * panel_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= (1 << 18))
    for (int64_t p = 0; p < N / PANEL; p++) {
        float r[MAX_M * PANEL];
#ifdef Q8X_AVX512
        panel_avx512(qtype, panels + p * panel_stride, nb, M, q, qu, K, dx, sx, r, PANEL);
#else
        panel_avx2(qtype, panels + p * panel_stride, nb, M, q, qu, K, dx, sx, r);
#endif
        for (int m = 0; m < M; m++) {
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + m * ldo + p * PANEL;
                for (int i = 0; i < PANEL; i++) o[i] = f32_to_bf16(r[m * PANEL + i]);
            } else {
                memcpy((float *)out + m * ldo + p * PANEL, r + m * PANEL, sizeof(float) * PANEL);
            }
        }
    }
    free(q); free(dx);
    return 0;
#else
    (void)qtype; (void)panels; (void)N; (void)K; (void)x; (void)x_bf16; (void)M; (void)out; (void)ldo;
    (void)out_bf16; (void)num_threads;
    return 3;
#endif
}

/* out[m * ldo + n] (float32, or bf16 with out_bf16) for M <= 8 rows of x (float32, or bf16 with
   x_bf16), W's N block rows at w + n * stride. Returns 0, or 1 for bad arguments. */
int q8x_gemv(int qtype, const uint8_t *w, int64_t stride, int64_t N, int64_t K, const void *x, int x_bf16, int M,
             void *out, int64_t ldo, int out_bf16, int num_threads) {
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K % QK || M < 1 || M > MAX_M) return 1;
    const int64_t nb = K / QK;
    /* x's codes (padded by 64 bytes: the AVX-512 loads of an odd last block stay in bounds) and scales */
    int8_t *q = (int8_t *)malloc((size_t)(M * K + 64));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb * 2));
    float *d8 = (float *)malloc(sizeof(float) * (size_t)(M * nb * 16 + 16));
    if (!q || !dx || !d8) { free(q); free(dx); free(d8); return 2; }
    float *sx = dx + M * nb, *s8 = d8 + M * nb * 8;
    for (int m = 0; m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K),
                     x_bf16, K, q + m * K, dx + m * nb, sx + m * nb, d8 + m * nb * 8, s8 + m * nb * 8);
    (void)d8; (void)s8;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        float r[MAX_M];
#if defined(Q8X_AVX512)
        row_avx512(qtype, w + n * stride, nb, M, q, K, d8, s8, r);
#elif defined(Q8X_AVX2)
        row_avx2(qtype, w + n * stride, nb, M, q, K, dx, sx, r);
#else
        row_scalar(qtype, w + n * stride, nb, M, q, K, dx, sx, r);
#endif
        for (int m = 0; m < M; m++) {
            if (out_bf16) ((uint16_t *)out)[m * ldo + n] = f32_to_bf16(r[m]);
            else ((float *)out)[m * ldo + n] = r[m];
        }
    }
    free(q); free(dx); free(d8);
    return 0;
}

/* The plain C path whatever this build has (to test the vector paths against). */
int q8x_gemv_scalar(int qtype, const uint8_t *w, int64_t stride, int64_t N, int64_t K, const void *x, int x_bf16,
                    int M, float *out, int64_t ldo) {
    if ((qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0) || K % QK || M < 1 || M > MAX_M) return 1;
    const int64_t nb = K / QK;
    int8_t *q = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb * 2));
    if (!q || !dx) { free(q); free(dx); return 2; }
    float *sx = dx + M * nb;
    for (int m = 0; m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K),
                     x_bf16, K, q + m * K, dx + m * nb, sx + m * nb, NULL, NULL);
    for (int64_t n = 0; n < N; n++) {
        float r[MAX_M];
        row_scalar(qtype, w + n * stride, nb, M, q, K, dx, sx, r);
        for (int m = 0; m < M; m++) out[m * ldo + n] = r[m];
    }
    free(q); free(dx);
    return 0;
}
