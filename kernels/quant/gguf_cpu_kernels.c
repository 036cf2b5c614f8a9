/* CPU kernels for llama.cpp block rows (GGUF Q4_0 .. Q6_K, and our W4G128), read in place.
 *
 * Built at first use by gguf_cpu_native.py (gcc -O3 -march=native -ffp-contract=off, cached) and
 * called through ctypes, which releases the GIL. Two entry points:
 *
 *   gguf_gemv:    out[m, n] = sum_k x[m, k] * W[n, k] for M <= 8 rows of float32 x (decode steps).
 *                 Each weight block is decoded once into float32 (in L1) and multiplied into every
 *                 row of x, so a step reads the weight's bytes once, whatever M is.
 *   gguf_dequant: W[n0:n1, :] as float32, for the tiled prefill path.
 *   gguf_panel_gemv: as gguf_gemv for Q4_0/Q4_1/Q8_0 repacked into panels of 8 rows
 *                 (gguf_panel_pack): the float32 decode path of AVX2 CPUs (see "panels" below).
 *
 * Exactness: every weight is decoded with the float32 operations, in the order, of
 * gguf_reference.py (itself bit-equal to gguf-py's dequantize): e.g. Q4_K is (d * sc) * q - dmin * mn,
 * two roundings, never fused (-ffp-contract=off). So the weights are bit-equal to the dequantized
 * ones; only the summation order of the dot products differs from a dense GEMV (float32 lanes,
 * then a fixed-order sum of them; the same for any thread count, and for any M of the same
 * accumulator count: M of 1-2, 3-4, 5-8).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The loops over the rows of x (M, a constant in each inlined instance) fully unrolled: -O2 keeps a
   rolled loop, and then acc[m] lives on the stack, not in registers (M = 5: 2-3x the cost per row). */
#define UNROLL_M _Pragma("GCC unroll 8")

enum { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, W4G128 = 8 };

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
    } else if (mantissa) {  /* subnormal: normalise */
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

/* ---- one block -> float32 values, as gguf_reference.py decodes it ----------------------------- */

static inline void decode_q4_0(const uint8_t *b, float *w) {
    const float d = f16(b);
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((int)(b[2 + j] & 15) - 8);
        w[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
    }
}

static inline void decode_q4_1(const uint8_t *b, float *w) {
    const float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)(b[4 + j] & 15) + m;
        w[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static inline void decode_q5_0(const uint8_t *b, float *w) {
    const float d = f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        int lo = (b[6 + j] & 15) | (((qh >> j) & 1) << 4), hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        w[j] = d * (float)(lo - 16);
        w[j + 16] = d * (float)(hi - 16);
    }
}

static inline void decode_q5_1(const uint8_t *b, float *w) {
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        int lo = (b[8 + j] & 15) | (((qh >> j) & 1) << 4), hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        w[j] = d * (float)lo + m;
        w[j + 16] = d * (float)hi + m;
    }
}

static inline void decode_q8_0(const uint8_t *b, float *w) {
    const float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) w[j] = (float)q[j] * d;
}

/* Q4_K/Q5_K: the eight 6-bit scales and mins in the 12 bytes s (gguf_reference.k_scales_and_mins). */
static inline void k_scales(const uint8_t *s, const float d, const float dmin, float *scale, float *minimum) {
    for (int i = 0; i < 4; i++) {
        scale[i] = d * (float)(s[i] & 63);
        minimum[i] = dmin * (float)(s[4 + i] & 63);
        scale[4 + i] = d * (float)((s[8 + i] & 15) | ((s[i] >> 6) << 4));
        minimum[4 + i] = dmin * (float)((s[8 + i] >> 4) | ((s[4 + i] >> 6) << 4));
    }
}

static inline void decode_q4_k(const uint8_t *b, float *w) {
    float scale[8], minimum[8];
    k_scales(b + 4, f16(b), f16(b + 2), scale, minimum);
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++) {
        const float s0 = scale[2 * c], m0 = minimum[2 * c], s1 = scale[2 * c + 1], m1 = minimum[2 * c + 1];
        for (int l = 0; l < 32; l++) {
            w[64 * c + l] = s0 * (float)(qs[32 * c + l] & 15) - m0;
            w[64 * c + 32 + l] = s1 * (float)(qs[32 * c + l] >> 4) - m1;
        }
    }
}

static inline void decode_q5_k(const uint8_t *b, float *w) {
    float scale[8], minimum[8];
    k_scales(b + 4, f16(b), f16(b + 2), scale, minimum);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++) {
        const int s = 2 * c;
        const float s0 = scale[s], m0 = minimum[s], s1 = scale[s + 1], m1 = minimum[s + 1];
        for (int l = 0; l < 32; l++) {
            int lo = (qs[32 * c + l] & 15) | (((qh[l] >> s) & 1) << 4);
            int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (s + 1)) & 1) << 4);
            w[64 * c + l] = s0 * (float)lo - m0;
            w[64 * c + 32 + l] = s1 * (float)hi - m1;
        }
    }
}

static inline void decode_q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    float scale[16];
    for (int i = 0; i < 16; i++) scale[i] = d * (float)sc[i];
    /* element e = 128 h + 64 nib + 32 s2 + l: low nibble `nib` of ql[64 h + 32 s2 + l], high bits
       (2 (2 nib + s2)) of qh[32 h + l]. */
    for (int h = 0; h < 2; h++)
        for (int nib = 0; nib < 2; nib++)
            for (int s2 = 0; s2 < 2; s2++) {
                const int e0 = 128 * h + 64 * nib + 32 * s2, shift = 2 * (2 * nib + s2);
                for (int l = 0; l < 32; l++) {
                    int q = ((ql[64 * h + 32 * s2 + l] >> (4 * nib)) & 15) | (((qh[32 * h + l] >> shift) & 3) << 4);
                    w[e0 + l] = scale[(e0 + l) >> 4] * (float)(q - 32);
                }
            }
}

static inline void decode_w4g128(const uint8_t *b, float *w) {
    const float d = f16(b);
    const int z = b[2];
    for (int j = 0; j < 64; j++) {
        w[j] = d * (float)((int)(b[4 + j] & 15) - z);
        w[j + 64] = d * (float)((int)(b[4 + j] >> 4) - z);
    }
}

/* ---- GEMV: rows [n0, n1) of W times M rows of x ------------------------------------------------ */

/* The weight streams from DRAM once per step; asking for the bytes PREFETCH_BYTES ahead keeps more
   reads in flight than the hardware prefetcher does at this kernel's pace. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096  /* measured on cold weights (12 x [16384, 2048]): Q4_K +30-40%, Q8_0 +70% vs none */
#endif
#define PREFETCH(p, size)                                                                            \
    do {                                                                                             \
        if (PREFETCH_BYTES)                                                                          \
            for (int pf_ = 0; pf_ < (size); pf_ += 64) __builtin_prefetch((const char *)(p) + PREFETCH_BYTES + pf_, 0, 3); \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define U8X8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
/* the 8 lanes' sum in a fixed order */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* AVX-512: each DEC_* macro decodes one block straight into registers, 16 weights at a time, and
   hands each vector to EMIT(vector, offset in the block). The decode multiplies and adds exactly
   as the scalar decoders above (and the reference) do; only the dot products use fused adds. */
/* k_scales with 32-bit word ops (as llama.cpp unpacks them) and one vector multiply per field:
   the same values, far fewer instructions than byte by byte. */
static inline void k_scales_vec(const uint8_t *s, const float d, const float dmin, float *scale, float *minimum) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4);
    const __m128i codes = _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));  /* sc[0..7], mn[0..7] */
    const __m512 factors = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
    const __m512 products = _mm512_mul_ps(factors, values);
    _mm256_storeu_ps(scale, _mm512_castps512_ps256(products));
    _mm256_storeu_ps(minimum, _mm512_extractf32x8_ps(products, 1));
}
#define k_scales k_scales_vec

#define U8X16(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOW4(v) _mm512_and_si512((v), _mm512_set1_epi32(15))
#define HIGH4(v) _mm512_srli_epi32((v), 4)
#define I2F(v) _mm512_cvtepi32_ps(v)

/* 4-bit codes: each block's (or sub-block's) 16 possible weights are computed once, with the
   reference's operations, into a register table, and vpermps picks each lane's (it reads only the
   low 4 bits of each index, so a zero-extended byte indexes by its low nibble as it is). */
#define IOTA16 _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define PICK(table, idx) _mm512_permutexvar_ps((idx), (table))
/* 5-bit codes: two tables (codes 0..15 and 16..31); the code's high bit is a lane mask. */
#define PICK5(low, high, mask, idx) _mm512_mask_permutexvar_ps(PICK(low, idx), (mask), (idx), (high))

#define DEC_Q4_0(b, EMIT) {                                                                          \
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(f16(b)), _mm512_sub_ps(IOTA16, _mm512_set1_ps(8)));  \
    const __m512i q = U8X16((b) + 2);                                                                \
    EMIT(PICK(t, q), 0);                                                                             \
    EMIT(PICK(t, HIGH4(q)), 16); }

#define DEC_Q4_1(b, EMIT) {                                                                          \
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16(b)), IOTA16), _mm512_set1_ps(f16((b) + 2)));  \
    const __m512i q = U8X16((b) + 4);                                                                \
    EMIT(PICK(t, q), 0);                                                                             \
    EMIT(PICK(t, HIGH4(q)), 16); }

#define DEC_Q5_0(b, EMIT) {                                                                          \
    const __m512 d = _mm512_set1_ps(f16(b)), sixteen = _mm512_set1_ps(16);                           \
    const __m512 lo = _mm512_mul_ps(d, _mm512_sub_ps(IOTA16, sixteen)), hi = _mm512_mul_ps(d, IOTA16);  \
    uint32_t qh; memcpy(&qh, (b) + 2, 4);                                                            \
    const __m512i q = U8X16((b) + 6);                                                                \
    EMIT(PICK5(lo, hi, (__mmask16)(qh & 0xFFFF), q), 0);                                             \
    EMIT(PICK5(lo, hi, (__mmask16)(qh >> 16), HIGH4(q)), 16); }

#define DEC_Q5_1(b, EMIT) {                                                                          \
    const __m512 d = _mm512_set1_ps(f16(b)), mn = _mm512_set1_ps(f16((b) + 2));                      \
    const __m512 lo = _mm512_add_ps(_mm512_mul_ps(d, IOTA16), mn);                                   \
    const __m512 hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_add_ps(IOTA16, _mm512_set1_ps(16))), mn);  \
    uint32_t qh; memcpy(&qh, (b) + 4, 4);                                                            \
    const __m512i q = U8X16((b) + 8);                                                                \
    EMIT(PICK5(lo, hi, (__mmask16)(qh & 0xFFFF), q), 0);                                             \
    EMIT(PICK5(lo, hi, (__mmask16)(qh >> 16), HIGH4(q)), 16); }

#define DEC_Q8_0(b, EMIT) {                                                                          \
    const __m512 d = _mm512_set1_ps(f16(b));                                                         \
    EMIT(_mm512_mul_ps(I2F(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((b) + 2)))), d), 0);      \
    EMIT(_mm512_mul_ps(I2F(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((b) + 18)))), d), 16); }

/* Q4_K/Q5_K: chunk c of 32 code bytes holds sub-block 2c (low nibbles) and 2c + 1 (high). */
#define K_TABLE(s, codes) _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale[s]), (codes)), _mm512_set1_ps(minimum[s]))

#define DEC_Q4_K(b, EMIT) {                                                                          \
    float scale[8], minimum[8];                                                                      \
    k_scales((b) + 4, f16(b), f16((b) + 2), scale, minimum);                                         \
    for (int c = 0; c < 4; c++) {                                                                    \
        const __m512 t0 = K_TABLE(2 * c, IOTA16), t1 = K_TABLE(2 * c + 1, IOTA16);                   \
        const __m512i qa = U8X16((b) + 16 + 32 * c), qb = U8X16((b) + 32 + 32 * c);                  \
        EMIT(PICK(t0, qa), 64 * c);                                                                  \
        EMIT(PICK(t0, qb), 64 * c + 16);                                                             \
        EMIT(PICK(t1, HIGH4(qa)), 64 * c + 32);                                                      \
        EMIT(PICK(t1, HIGH4(qb)), 64 * c + 48);                                                      \
    } }

/* Q5_K: the high bit of element 32 s + l is bit s of qh[l]: a lane mask per sub-block. */
#define DEC_Q5_K(b, EMIT) {                                                                          \
    float scale[8], minimum[8];                                                                      \
    k_scales((b) + 4, f16(b), f16((b) + 2), scale, minimum);                                         \
    const __m128i ha = _mm_loadu_si128((const __m128i *)((b) + 16)), hb = _mm_loadu_si128((const __m128i *)((b) + 32));  \
    const __m512 upper = _mm512_add_ps(IOTA16, _mm512_set1_ps(16));                                  \
    for (int c = 0; c < 4; c++) {                                                                    \
        const __m512 l0 = K_TABLE(2 * c, IOTA16), h0 = K_TABLE(2 * c, upper);                        \
        const __m512 l1 = K_TABLE(2 * c + 1, IOTA16), h1 = K_TABLE(2 * c + 1, upper);                \
        const __m128i bit0 = _mm_set1_epi8((char)(1 << (2 * c))), bit1 = _mm_set1_epi8((char)(2 << (2 * c)));  \
        const __m512i qa = U8X16((b) + 48 + 32 * c), qb = U8X16((b) + 64 + 32 * c);                  \
        EMIT(PICK5(l0, h0, _mm_test_epi8_mask(ha, bit0), qa), 64 * c);                               \
        EMIT(PICK5(l0, h0, _mm_test_epi8_mask(hb, bit0), qb), 64 * c + 16);                          \
        EMIT(PICK5(l1, h1, _mm_test_epi8_mask(ha, bit1), HIGH4(qa)), 64 * c + 32);                   \
        EMIT(PICK5(l1, h1, _mm_test_epi8_mask(hb, bit1), HIGH4(qb)), 64 * c + 48);                   \
    } }

/* Q6_K: element e = 128 h + 64 nib + 32 s2 + l (see decode_q6_k). */
#define DEC_Q6_K(b, EMIT) {                                                                          \
    const int8_t *sc_ = (const int8_t *)((b) + 192);                                                 \
    const float d6 = f16((b) + 208);                                                                 \
    const __m512i thirty_two = _mm512_set1_epi32(32), three = _mm512_set1_epi32(3);                  \
    for (int h = 0; h < 2; h++) {                                                                    \
        const __m512i qh0 = U8X16((b) + 128 + 32 * h), qh1 = U8X16((b) + 144 + 32 * h);              \
        for (int s2 = 0; s2 < 2; s2++) {                                                             \
            const __m512i ql0 = U8X16((b) + 64 * h + 32 * s2), ql1 = U8X16((b) + 64 * h + 32 * s2 + 16);   \
            for (int nib = 0; nib < 2; nib++) {                                                      \
                const int e0 = 128 * h + 64 * nib + 32 * s2, shift = 2 * (2 * nib + s2);             \
                const __m512i sh = _mm512_set1_epi32(shift);                                         \
                const __m512i lo0 = nib ? HIGH4(ql0) : LOW4(ql0), lo1 = nib ? HIGH4(ql1) : LOW4(ql1);      \
                const __m512i q0 = _mm512_sub_epi32(_mm512_or_si512(lo0, _mm512_slli_epi32(                \
                    _mm512_and_si512(_mm512_srlv_epi32(qh0, sh), three), 4)), thirty_two);               \
                const __m512i q1 = _mm512_sub_epi32(_mm512_or_si512(lo1, _mm512_slli_epi32(                \
                    _mm512_and_si512(_mm512_srlv_epi32(qh1, sh), three), 4)), thirty_two);               \
                EMIT(_mm512_mul_ps(_mm512_set1_ps(d6 * (float)sc_[e0 >> 4]), I2F(q0)), e0);                 \
                EMIT(_mm512_mul_ps(_mm512_set1_ps(d6 * (float)sc_[(e0 >> 4) + 1]), I2F(q1)), e0 + 16);      \
            }                                                                                        \
        }                                                                                            \
    } }

#define DEC_W4G128(b, EMIT) {                                                                        \
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(f16(b)), _mm512_sub_ps(IOTA16, _mm512_set1_ps((float)(b)[2])));  \
    for (int i = 0; i < 4; i++) {                                                                    \
        const __m512i q = U8X16((b) + 4 + 16 * i);                                                   \
        EMIT(PICK(t, q), 16 * i);                                                                    \
        EMIT(PICK(t, HIGH4(q)), 64 + 16 * i);                                                        \
    } }

/* Accumulators per row of x: vector v of a block (16 v .. 16 v + 15) goes to accumulator v % NACC,
   so one row's fused adds are NACC independent chains; fewer for more rows, to stay in registers. */
#define NACC(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
#define EMIT_DOT(vector, offset) {                                                                   \
    const __m512 w_ = (vector);                                                                      \
    UNROLL_M for (int m = 0; m < M; m++)                                                                      \
        acc[m][((offset) >> 4) & (NACC(M) - 1)] = _mm512_fmadd_ps(                                   \
            w_, _mm512_loadu_ps(xb + m * K + (offset)), acc[m][((offset) >> 4) & (NACC(M) - 1)]); }
#define EMIT_STORE(vector, offset) _mm512_storeu_ps(dst + (offset), (vector));
#if defined(__AVX512BF16__)
/* the float32 values rounded to bf16 (to nearest even, as torch's .to(torch.bfloat16)) */
#define EMIT_STORE_BF16(vector, offset) \
    _mm256_storeu_si256((__m256i *)(dst16 + (offset)), (__m256i)_mm512_cvtneps_pbh(vector));
#define DEQUANT_BF16_FN(NAME, DEC, BS, TS)                                                           \
    static void NAME##_dequant_bf16(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, \
                                    int64_t K, uint16_t *out) {                                      \
        for (int64_t n = n0; n < n1; n++)                                                            \
            for (int64_t blk = 0; blk < K / BS; blk++) {                                             \
                const uint8_t *block = data + n * row_stride + blk * TS;                             \
                uint16_t *dst16 = out + (n - n0) * K + blk * BS;                                     \
                DEC(block, EMIT_STORE_BF16)                                                          \
            }                                                                                        \
    }
#define HAS_DEQUANT_BF16 1
#else
#define DEQUANT_BF16_FN(NAME, DEC, BS, TS)
#endif

/* M is a compile-time constant in each call of NAME##_rows from the switch, so the accumulators
   stay in registers. */
#define GEMV_FN(NAME, DEC, BS, TS)                                                                   \
    static inline __attribute__((always_inline)) void NAME##_rows(                                   \
            const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const float *x,      \
            const int M, float *out, int64_t out_stride) {                                           \
        const int64_t num_blocks = K / BS;                                                           \
        for (int64_t n = n0; n < n1; n++) {                                                          \
            const uint8_t *row = data + n * row_stride;                                              \
            __m512 acc[M][NACC(M)];                                                                  \
            UNROLL_M for (int m = 0; m < M; m++)                                                              \
                for (int a = 0; a < NACC(M); a++) acc[m][a] = _mm512_setzero_ps();                   \
            for (int64_t blk = 0; blk < num_blocks; blk++) {                                         \
                const uint8_t *block = row + blk * TS;                                               \
                const float *xb = x + blk * BS;                                                      \
                PREFETCH(block, TS);                                                                 \
                DEC(block, EMIT_DOT)                                                                 \
            }                                                                                        \
            UNROLL_M for (int m = 0; m < M; m++) {                                                            \
                __m512 total = acc[m][0];                                                            \
                for (int a = 1; a < NACC(M); a++) total = _mm512_add_ps(total, acc[m][a]);           \
                out[m * out_stride + n] = _mm512_reduce_add_ps(total);                               \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    static void NAME(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K,     \
                     const float *x, int M, float *out, int64_t out_stride) {                        \
        switch (M) {                                                                                 \
        case 1: NAME##_rows(data, row_stride, n0, n1, K, x, 1, out, out_stride); break;              \
        case 2: NAME##_rows(data, row_stride, n0, n1, K, x, 2, out, out_stride); break;              \
        case 3: NAME##_rows(data, row_stride, n0, n1, K, x, 3, out, out_stride); break;              \
        case 4: NAME##_rows(data, row_stride, n0, n1, K, x, 4, out, out_stride); break;              \
        case 5: NAME##_rows(data, row_stride, n0, n1, K, x, 5, out, out_stride); break;              \
        case 6: NAME##_rows(data, row_stride, n0, n1, K, x, 6, out, out_stride); break;              \
        case 7: NAME##_rows(data, row_stride, n0, n1, K, x, 7, out, out_stride); break;              \
        default: NAME##_rows(data, row_stride, n0, n1, K, x, 8, out, out_stride); break;             \
        }                                                                                            \
    }                                                                                                \
    static void NAME##_dequant(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1,      \
                               int64_t K, float *out) {                                              \
        for (int64_t n = n0; n < n1; n++)                                                            \
            for (int64_t blk = 0; blk < K / BS; blk++) {                                             \
                const uint8_t *block = data + n * row_stride + blk * TS;                             \
                float *dst = out + (n - n0) * K + blk * BS;                                          \
                DEC(block, EMIT_STORE)                                                               \
            }                                                                                        \
    }                                                                                                \
    DEQUANT_BF16_FN(NAME, DEC, BS, TS)

GEMV_FN(gemv_q4_0, DEC_Q4_0, 32, 18)
GEMV_FN(gemv_q4_1, DEC_Q4_1, 32, 20)
GEMV_FN(gemv_q5_0, DEC_Q5_0, 32, 22)
GEMV_FN(gemv_q5_1, DEC_Q5_1, 32, 24)
GEMV_FN(gemv_q8_0, DEC_Q8_0, 32, 34)
GEMV_FN(gemv_q4_k, DEC_Q4_K, 256, 144)
GEMV_FN(gemv_q5_k, DEC_Q5_K, 256, 176)
GEMV_FN(gemv_q6_k, DEC_Q6_K, 256, 210)
GEMV_FN(gemv_w4g128, DEC_W4G128, 128, 68)

#undef k_scales
#else
/* Portable: decode each block with the scalar decoders, then multiply (gcc vectorizes what it can). */
#define GEMV_FN(NAME, DECODE, BS, TS)                                                                \
    static void NAME(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K,     \
                     const float *x, int M, float *out, int64_t out_stride) {                        \
        float w[BS];                                                                                 \
        for (int64_t n = n0; n < n1; n++) {                                                          \
            float acc[8] = {0};                                                                      \
            for (int64_t blk = 0; blk < K / BS; blk++) {                                             \
                DECODE(data + n * row_stride + blk * TS, w);                                         \
                for (int m = 0; m < M; m++)                                                          \
                    for (int j = 0; j < BS; j++) acc[m] += w[j] * x[m * K + blk * BS + j];           \
            }                                                                                        \
            for (int m = 0; m < M; m++) out[m * out_stride + n] = acc[m];                            \
        }                                                                                            \
    }                                                                                                \
    static void NAME##_dequant(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1,      \
                               int64_t K, float *out) {                                              \
        for (int64_t n = n0; n < n1; n++)                                                            \
            for (int64_t blk = 0; blk < K / BS; blk++)                                               \
                DECODE(data + n * row_stride + blk * TS, out + (n - n0) * K + blk * BS);             \
    }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (no AVX-512): Q4_0, Q4_1 and Q8_0 decoded straight into registers, 8 weights at a time, with
   the reference's operations (d * (q - 8), d * q + m, q * d: separate multiplies and adds), then fused
   into the dot products. Each row of x keeps two accumulators whatever M is, so a row's sums round
   the same in a batch of any size. The pure Q4 layers of the engine take the panel kernels below
   instead (several output rows per vector); these serve the file's own rows (Q8_0 heads, tests). */
#define DEC8_Q4_0(b, EMIT) {                                                                         \
    const __m256 d = _mm256_set1_ps(f16(b));                                                         \
    const __m256i v0 = U8X8((b) + 2), v1 = U8X8((b) + 10), mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8); \
    EMIT(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v0, mask), eight))), 0); \
    EMIT(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v1, mask), eight))), 8); \
    EMIT(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v0, 4), eight))), 16); \
    EMIT(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v1, 4), eight))), 24); }
#define DEC8_Q4_1(b, EMIT) {                                                                         \
    const __m256 d = _mm256_set1_ps(f16(b)), mn = _mm256_set1_ps(f16((b) + 2));                      \
    const __m256i v0 = U8X8((b) + 4), v1 = U8X8((b) + 12), mask = _mm256_set1_epi32(15);             \
    EMIT(_mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask))), mn), 0);    \
    EMIT(_mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask))), mn), 8);    \
    EMIT(_mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4))), mn), 16);     \
    EMIT(_mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))), mn), 24); }
#define DEC8_Q8_0(b, EMIT) {                                                                         \
    const __m256 d = _mm256_set1_ps(f16(b));                                                         \
    _Pragma("GCC unroll 4") for (int j_ = 0; j_ < 4; j_++)                                           \
        EMIT(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(                  \
            (const __m128i *)((b) + 2 + 8 * j_)))), d), 8 * j_); }
/* Q5_0 / Q5_1: element j's fifth bit is bit j of the 32-bit qh (elements 0..15 the low nibbles, 16..31
   the high ones); the 8 lanes at offset o take bits o..o+7 by a variable shift. Then the reference's
   d * (q - 16) and d * q + m. */
#define Q5_BIT16(h, o) _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32((h), _mm256_setr_epi32(         \
    (o), (o) + 1, (o) + 2, (o) + 3, (o) + 4, (o) + 5, (o) + 6, (o) + 7)), _mm256_set1_epi32(1)), 4)
#define Q5_W(WITH_MIN, q) ((WITH_MIN) ? _mm256_add_ps(_mm256_mul_ps(d5_, _mm256_cvtepi32_ps(q)), m5_)         \
                                      : _mm256_mul_ps(d5_, _mm256_cvtepi32_ps(_mm256_sub_epi32((q), sixteen_))))
#define DEC8_Q5(b, QS, QH, WITH_MIN, EMIT) {                                                         \
    const __m256 d5_ = _mm256_set1_ps(f16(b));                                                       \
    const __m256 m5_ = (WITH_MIN) ? _mm256_set1_ps(f16((b) + 2)) : _mm256_setzero_ps();              \
    uint32_t qh_;                                                                                    \
    memcpy(&qh_, (b) + (QH), 4);                                                                     \
    const __m256i h_ = _mm256_set1_epi32((int)qh_), mask_ = _mm256_set1_epi32(15), sixteen_ = _mm256_set1_epi32(16); \
    const __m256i v0_ = U8X8((b) + (QS)), v1_ = U8X8((b) + (QS) + 8);                                \
    (void)m5_; (void)sixteen_;                                                                       \
    EMIT(Q5_W(WITH_MIN, _mm256_or_si256(_mm256_and_si256(v0_, mask_), Q5_BIT16(h_, 0))), 0);         \
    EMIT(Q5_W(WITH_MIN, _mm256_or_si256(_mm256_and_si256(v1_, mask_), Q5_BIT16(h_, 8))), 8);         \
    EMIT(Q5_W(WITH_MIN, _mm256_or_si256(_mm256_srli_epi32(v0_, 4), Q5_BIT16(h_, 16))), 16);          \
    EMIT(Q5_W(WITH_MIN, _mm256_or_si256(_mm256_srli_epi32(v1_, 4), Q5_BIT16(h_, 24))), 24); }
#define DEC8_Q5_0(b, EMIT) DEC8_Q5(b, 6, 2, 0, EMIT)
#define DEC8_Q5_1(b, EMIT) DEC8_Q5(b, 8, 4, 1, EMIT)
#define EMIT_DOT8(vector, offset) {                                                                  \
    const __m256 w_ = (vector);                                                                      \
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)                                              \
        acc[m][((offset) >> 3) & 1] = _mm256_fmadd_ps(w_, _mm256_loadu_ps(xb + m * K + (offset)),             \
                                                      acc[m][((offset) >> 3) & 1]); }
#define EMIT_STORE8(vector, offset) _mm256_storeu_ps(dst + (offset), (vector));

#define GEMV8_FN(NAME, DEC, TS)                                                                      \
    static inline __attribute__((always_inline)) void NAME##_rows(                                   \
            const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const float *x, \
            const int M, float *out, int64_t out_stride) {                                           \
        for (int64_t n = n0; n < n1; n++) {                                                          \
            const uint8_t *row = data + n * row_stride;                                              \
            __m256 acc[M][2];                                                                        \
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps(); \
            for (int64_t blk = 0; blk < K / 32; blk++) {                                             \
                const uint8_t *block = row + blk * TS;                                               \
                const float *xb = x + blk * 32;                                                      \
                PREFETCH(block, TS);                                                                 \
                DEC(block, EMIT_DOT8)                                                                \
            }                                                                                        \
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)                                      \
                out[m * out_stride + n] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));                \
        }                                                                                            \
    }                                                                                                \
    static void NAME(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K,     \
                     const float *x, int M, float *out, int64_t out_stride) {                        \
        switch (M) {                                                                                 \
        case 1: NAME##_rows(data, row_stride, n0, n1, K, x, 1, out, out_stride); break;              \
        case 2: NAME##_rows(data, row_stride, n0, n1, K, x, 2, out, out_stride); break;              \
        default:  /* two rows of x a pass: in registers */                                           \
            for (int m0 = 0; m0 < M; m0 += 2)                                                        \
                NAME##_rows(data, row_stride, n0, n1, K, x + m0 * K, M - m0 < 2 ? M - m0 : 2, out + m0 * out_stride, \
                            out_stride);                                                             \
            break;                                                                                   \
        }                                                                                            \
    }                                                                                                \
    static void NAME##_dequant(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1,      \
                               int64_t K, float *out) {                                              \
        for (int64_t n = n0; n < n1; n++)                                                            \
            for (int64_t blk = 0; blk < K / 32; blk++) {                                             \
                const uint8_t *block = data + n * row_stride + blk * TS;                             \
                float *dst = out + (n - n0) * K + blk * 32;                                          \
                DEC(block, EMIT_STORE8)                                                              \
            }                                                                                        \
    }

GEMV8_FN(gemv_q4_0, DEC8_Q4_0, 18)
GEMV8_FN(gemv_q4_1, DEC8_Q4_1, 20)
GEMV8_FN(gemv_q8_0, DEC8_Q8_0, 34)
GEMV8_FN(gemv_q5_0, DEC8_Q5_0, 22)
GEMV8_FN(gemv_q5_1, DEC8_Q5_1, 24)
#define HAS_AVX2_Q5_KERNELS 1

/* AVX2 (no AVX-512): Q4_K, Q5_K and Q6_K rows, 8 weights a vector. Every code is decoded exactly (an
   integer in float32); Q6_K's weights are then the reference's (d * sc) * (q - 32), one rounding, and
   fused into the dot products. Q4_K/Q5_K factor their scales out as the bf16 kernels do: per sub-block
   of 32, (d * sc) * sum(q x) - (dmin * mn) * sum(x), the sums of x per 32 computed once per call; the
   same exact weights, only where the float32 roundings fall differs (and no multiply and subtract per
   weight). A pass takes one or two rows of x (two fill the 16 registers); each row's sums are the same
   operations whatever M is, so a verify step's rows get a one-row step's bits. */
#define HAS_AVX2_K_KERNELS 1

/* k_scales's 8 scales d * sc and 8 minimums dmin * mn of a Q4_K/Q5_K block (12 bytes s after d, dmin),
   unpacked with 32-bit word ops (as llama.cpp does): the same float32 products. */
static inline void k_scales_avx2(const uint8_t *b, __m256 *scale, __m256 *minimum) {
    uint32_t a, bb, c;
    memcpy(&a, b + 4, 4);
    memcpy(&bb, b + 8, 4);
    memcpy(&c, b + 12, 4);
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = bb & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | (((bb >> 6) & 0x03030303u) << 4);
    *scale = _mm256_mul_ps(_mm256_set1_ps(f16(b)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo))));
    *minimum = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo))));
}

/* x's sums per 32 values, [M, K / 32], each in a fixed order (four 8-lane vectors, then hsum8) */
static void sums_of_32(const float *x, int64_t K, int M, float *xsum) {
    for (int m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 32; g++) {
            const float *p = x + m * K + 32 * g;
            xsum[m * (K / 32) + g] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                                         _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24))));
        }
}

/* bit `bit` (0..7) of each 32-bit lane's byte moved to bit 4 (value 16), all else zero */
static inline __m256i bit_to_16(__m256i v, const int bit) {
    return _mm256_and_si256(bit <= 4 ? _mm256_slli_epi32(v, 4 - bit) : _mm256_srli_epi32(v, bit - 4),
                            _mm256_set1_epi32(16));
}

/* Q4_K (FIVE = 0, 144-byte blocks) and Q5_K (FIVE = 1, 176): chunk c (32 code bytes) holds sub-block
   2c in its low nibbles and 2c + 1 in its high ones; Q5_K's fifth bit of element 32 s + l is bit s of
   qh[l]. */
static inline __attribute__((always_inline)) void k_avx2_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const float *x,
        const float *xsum, const int M, float *out, int64_t out_stride, const int FIVE) {
    const __m256i low_mask = _mm256_set1_epi32(15), high_mask = _mm256_set1_epi32(0xF0), bit8 = _mm256_set1_epi32(256);
    const int64_t num_blocks = K / 256, block_bytes = FIVE ? 176 : 144;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m256 acc[2][2], minsum[2];  /* per row of x: the low and the high sub-blocks' sums apart */
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = minsum[m] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint8_t *b = row + blk * block_bytes, *qs = b + (FIVE ? 48 : 16), *qh = b + 16;
            PREFETCH(b, block_bytes);
            __m256 scales, mins;
            k_scales_avx2(b, &scales, &mins);
            /* the high nibbles stay in place (16 q: an AND, no shift), their scales divided by 16 (exact: a
               power of two), so the sums are the same bits as with q and the scale */
            float scale[8], scale16[8];
            _mm256_storeu_ps(scale, scales);
            _mm256_storeu_ps(scale16, _mm256_mul_ps(scales, _mm256_set1_ps(0.0625f)));
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                __m256 low[2], high[2];
                for (int m = 0; m < M; m++) low[m] = high[m] = _mm256_setzero_ps();
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                    const __m256i v = U8X8(qs + 32 * c + 8 * j);
                    __m256i lo = _mm256_and_si256(v, low_mask), hi = _mm256_and_si256(v, high_mask);
                    if (FIVE) {  /* the fifth bit: 16 for the low code, 256 for the high one (16 q) */
                        const __m256i h = U8X8(qh + 8 * j);
                        lo = _mm256_or_si256(lo, bit_to_16(h, 2 * c));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(h, 7 - 2 * c), bit8));
                    }
                    const __m256 wl = _mm256_cvtepi32_ps(lo), wh = _mm256_cvtepi32_ps(hi);
                    for (int m = 0; m < M; m++) {
                        const float *xb = x + m * K + blk * 256 + 64 * c + 8 * j;
                        low[m] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xb), low[m]);
                        high[m] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xb + 32), high[m]);
                    }
                }
                const __m256 s0 = _mm256_broadcast_ss(scale + 2 * c), s1 = _mm256_broadcast_ss(scale16 + 2 * c + 1);
                for (int m = 0; m < M; m++) {
                    acc[m][0] = _mm256_fmadd_ps(s0, low[m], acc[m][0]);
                    acc[m][1] = _mm256_fmadd_ps(s1, high[m], acc[m][1]);
                }
            }
            for (int m = 0; m < M; m++)
                minsum[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + m * (K / 32) + blk * 8), minsum[m]);
        }
        for (int m = 0; m < M; m++)
            out[m * out_stride + n] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1])) - hsum8(minsum[m]);
    }
}

/* Q6_K: element e = 128 h + 64 nib + 32 s2 + l takes nibble `nib` of ql[64 h + 32 s2 + l] and bits
   2 (2 nib + s2) of qh[32 h + l] (decode_q6_k); weight (d * sc[e / 16]) * (q - 32), here factored as
   the bf16 kernel does: (d * sc) * sum(16 (q - 32) x). The codes of 16 elements are made in one
   register of 16-bit lanes (half the integer work of 32-bit ones) and widened for the float convert. */
static inline __attribute__((always_inline)) void q6_k_avx2_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const float *x,
        const int M, float *out, int64_t out_stride) {
    const __m256i low_mask = _mm256_set1_epi16(15), high_mask = _mm256_set1_epi16(0x30), thirty_two = _mm256_set1_epi16(32);
    const int64_t num_blocks = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m256 acc[2][4];  /* per row of x: four chains (by nib and s2) */
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint8_t *b = row + blk * 210, *ql = b, *qh = b + 128;
            PREFETCH(b, 210);
            const __m256 d = _mm256_set1_ps(f16(b + 208));
            const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
            float scale[16];
            _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
            _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
                _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {
                    const __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qh + 32 * h + 16 * half)));
                    _Pragma("GCC unroll 2") for (int s2 = 0; s2 < 2; s2++) {
                        const __m256i low = _mm256_cvtepu8_epi16(
                            _mm_loadu_si128((const __m128i *)(ql + 64 * h + 32 * s2 + 16 * half)));
                        _Pragma("GCC unroll 2") for (int nib = 0; nib < 2; nib++) {
                            const int shift = 2 * (2 * nib + s2), e = 128 * h + 64 * nib + 32 * s2 + 16 * half;
                            const __m256i bits = _mm256_and_si256(
                                shift <= 4 ? _mm256_slli_epi16(high, 4 - shift) : _mm256_srli_epi16(high, shift - 4), high_mask);
                            const __m256i q = _mm256_sub_epi16(_mm256_or_si256(
                                nib ? _mm256_srli_epi16(low, 4) : _mm256_and_si256(low, low_mask), bits), thirty_two);
                            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q)));
                            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1)));
                            const __m256 group_scale = _mm256_broadcast_ss(scale + (e >> 4));
                            for (int m = 0; m < M; m++) {
                                const float *xe = x + m * K + blk * 256 + e;
                                const __m256 sum = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xe + 8),
                                                                   _mm256_mul_ps(w0, _mm256_loadu_ps(xe)));
                                acc[m][2 * nib + s2] = _mm256_fmadd_ps(group_scale, sum, acc[m][2 * nib + s2]);
                            }
                        }
                    }
                }
        }
        for (int m = 0; m < M; m++)
            out[m * out_stride + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                                          _mm256_add_ps(acc[m][2], acc[m][3])));
    }
}

/* Rows of x two at a time (M a constant in each inlined pass); Q4_K/Q5_K's sums of x once per call. */
#define K_AVX2_FN(NAME, FIVE)                                                                        \
    static void NAME(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K,     \
                     const float *x, int M, float *out, int64_t out_stride) {                        \
        float xsum[8 * 512], *sums = M * (K / 32) <= 8 * 512 ? xsum : malloc(sizeof(float) * M * (K / 32)); \
        if (sums == NULL) return;                                                                    \
        sums_of_32(x, K, M, sums);                                                                   \
        for (int m0 = 0; m0 < M; m0 += 2) {                                                          \
            const float *xm = x + m0 * K, *sm = sums + m0 * (K / 32);                                \
            if (M - m0 >= 2) k_avx2_rows(data, row_stride, n0, n1, K, xm, sm, 2, out + m0 * out_stride, out_stride, FIVE); \
            else k_avx2_rows(data, row_stride, n0, n1, K, xm, sm, 1, out + m0 * out_stride, out_stride, FIVE); \
        }                                                                                            \
        if (sums != xsum) free(sums);                                                                \
    }
K_AVX2_FN(gemv_q4_k, 0)
K_AVX2_FN(gemv_q5_k, 1)
static void gemv_q6_k(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const float *x,
                      int M, float *out, int64_t out_stride) {
    for (int m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2) q6_k_avx2_rows(data, row_stride, n0, n1, K, x + m0 * K, 2, out + m0 * out_stride, out_stride);
        else q6_k_avx2_rows(data, row_stride, n0, n1, K, x + m0 * K, 1, out + m0 * out_stride, out_stride);
    }
}
/* The dequantizers (the tiled path of batches): decode_q4_k / q5_k / q6_k's float32 operations, 8
   weights a vector: (d * sc) * q - dmin * mn (a multiply, then a subtract), (d * sc) * (q - 32). */
static inline __attribute__((always_inline)) void k_avx2_dequant(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, float *out, const int FIVE) {
    const __m256i low_mask = _mm256_set1_epi32(15);
    const int64_t block_bytes = FIVE ? 176 : 144;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint8_t *b = data + n * row_stride + blk * block_bytes, *qs = b + (FIVE ? 48 : 16), *qh = b + 16;
            float *dst = out + (n - n0) * K + blk * 256;
            __m256 scales, mins;
            k_scales_avx2(b, &scales, &mins);
            float scale[8], minimum[8];
            _mm256_storeu_ps(scale, scales);
            _mm256_storeu_ps(minimum, mins);
            for (int c = 0; c < 4; c++) {
                const __m256 s0 = _mm256_broadcast_ss(scale + 2 * c), s1 = _mm256_broadcast_ss(scale + 2 * c + 1);
                const __m256 m0 = _mm256_broadcast_ss(minimum + 2 * c), m1 = _mm256_broadcast_ss(minimum + 2 * c + 1);
                for (int j = 0; j < 4; j++) {
                    const __m256i v = U8X8(qs + 32 * c + 8 * j);
                    __m256i lo = _mm256_and_si256(v, low_mask), hi = _mm256_srli_epi32(v, 4);
                    if (FIVE) {
                        const __m256i h = U8X8(qh + 8 * j);
                        lo = _mm256_or_si256(lo, bit_to_16(h, 2 * c));
                        hi = _mm256_or_si256(hi, bit_to_16(h, 2 * c + 1));
                    }
                    _mm256_storeu_ps(dst + 64 * c + 8 * j, _mm256_sub_ps(_mm256_mul_ps(s0, _mm256_cvtepi32_ps(lo)), m0));
                    _mm256_storeu_ps(dst + 64 * c + 32 + 8 * j, _mm256_sub_ps(_mm256_mul_ps(s1, _mm256_cvtepi32_ps(hi)), m1));
                }
            }
        }
}
static void gemv_q4_k_dequant(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, float *out) {
    k_avx2_dequant(data, rs, n0, n1, K, out, 0);
}
static void gemv_q5_k_dequant(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, float *out) {
    k_avx2_dequant(data, rs, n0, n1, K, out, 1);
}
static void gemv_q6_k_dequant(const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, float *out) {
    const __m256i low_mask = _mm256_set1_epi32(15), high_mask = _mm256_set1_epi32(0x30), thirty_two = _mm256_set1_epi32(32);
    for (int64_t n = n0; n < n1; n++)
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint8_t *b = data + n * row_stride + blk * 210, *ql = b, *qh = b + 128;
            float *dst = out + (n - n0) * K + blk * 256;
            const __m256 d = _mm256_set1_ps(f16(b + 208));
            const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
            float scale[16];
            _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
            _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
            for (int h = 0; h < 2; h++)
                for (int lc = 0; lc < 4; lc++) {
                    const __m256i high = U8X8(qh + 32 * h + 8 * lc);
                    for (int s2 = 0; s2 < 2; s2++) {
                        const __m256i low = U8X8(ql + 64 * h + 32 * s2 + 8 * lc);
                        for (int nib = 0; nib < 2; nib++) {
                            const int shift = 2 * (2 * nib + s2), e = 128 * h + 64 * nib + 32 * s2 + 8 * lc;
                            const __m256i bits = _mm256_and_si256(
                                shift <= 4 ? _mm256_slli_epi32(high, 4 - shift) : _mm256_srli_epi32(high, shift - 4), high_mask);
                            const __m256i q = _mm256_or_si256(nib ? _mm256_srli_epi32(low, 4) : _mm256_and_si256(low, low_mask), bits);
                            _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_broadcast_ss(scale + (e >> 4)),
                                                                    _mm256_cvtepi32_ps(_mm256_sub_epi32(q, thirty_two))));
                        }
                    }
                }
        }
}
#else
GEMV_FN(gemv_q4_0, decode_q4_0, 32, 18)
GEMV_FN(gemv_q4_1, decode_q4_1, 32, 20)
GEMV_FN(gemv_q8_0, decode_q8_0, 32, 34)
#endif
#if !defined(HAS_AVX2_Q5_KERNELS)
GEMV_FN(gemv_q5_0, decode_q5_0, 32, 22)
GEMV_FN(gemv_q5_1, decode_q5_1, 32, 24)
#endif
#if !defined(HAS_AVX2_K_KERNELS)
GEMV_FN(gemv_q4_k, decode_q4_k, 256, 144)
GEMV_FN(gemv_q5_k, decode_q5_k, 256, 176)
GEMV_FN(gemv_q6_k, decode_q6_k, 256, 210)
#endif
GEMV_FN(gemv_w4g128, decode_w4g128, 128, 68)
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
/* ---- bf16 activations (the CPU engine's compute dtype): Q4_0, Q4_1, Q8_0, Q4_K, Q6_K by bf16 dot products
 *
 * A code (Q4_K's 0..15, Q6_K's q - 32) is a small integer, exact in bf16, and so is every bf16 x, so
 * vdpbf16ps multiplies them exactly and adds in float32: 32 products per instruction. The block's
 * float32 scales are then applied to those sums, w x = scale (q x) - min x, so the math still uses
 * the exactly decoded weights; only where the float32 roundings of the sums fall differs (as for any
 * summation order; vdpbf16ps also treats float32 denormals as zero). A code becomes its bf16 value
 * by one vpermw/vpermt2w from a table of bf16 integers (Q8_0's by a float conversion). Every row of x
 * runs the same operations whatever M is (1-8 rows in one pass over the blocks), so a speculative
 * verify step's rows get the bits a one-row step gives them. */
#define HAS_BF16_KERNELS 1

static inline uint16_t bf16_of_int(int v) {
    float f = (float)v;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)(bits >> 16);  /* exact: |v| < 256 */
}

static inline __m512i bf16_table(int first, int mask) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = bf16_of_int(((first + i) & mask) - (mask == 15 ? 0 : 32));
    return _mm512_loadu_si512(t);
}

#define X_BF16(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define DP(w, xp) _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)(w), X_BF16(xp))

#define Q4_WORDS(p) _mm512_mask_srli_epi16(                                                           \
    _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))),       \
    (__mmask32)0xFFFF0000u, _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))), 4)

/* float32 -> bf16 bits, to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN */
static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* A result: float32, or (bf16_out) its bf16 bits rounded to nearest even */
static inline void store_result(void *out, int64_t index, float value, const int bf16_out) {
    if (bf16_out)
        ((uint16_t *)out)[index] = bf16_round(value);
    else
        ((float *)out)[index] = value;
}

/* Q4_K, four code vectors per 64 code bytes (as q4_01_grouped_rows does for Q4_0/Q4_1): chunk c (32
   bytes) holds sub-block 2c in its low nibbles and 2c + 1 in its high ones. One load takes chunks c, c + 1
   (c = 0, 2); word p of it holds bytes 2p, 2p + 1 of chunk c + p / 16 (bytes 2 (p % 16), + 1), and vpermw of
   it shifted right by 0, 8, 4, 12 maps word p to (the low nibble of byte 2p), (the low nibble of 2p + 1),
   (the high nibble of 2p), (the high nibble of 2p + 1): elements 2 (p % 16) and 2 (p % 16) + 1 of
   sub-block 2 (c + p / 16) for the first two, of 2 (c + p / 16) + 1 for the other two. So the first two
   chain into one sum whose lanes 0-7 sum sub-block 2c and lanes 8-15 sub-block 2c + 2, the other two
   sub-blocks 2c + 1 and 2c + 3; one multiply by those sub-blocks' scales each. Per block and row: 2 code
   loads, 6 shifts, 8 vpermw (was 8 loads, 8 vpmovzxbw, 8 shifts, 8 vpermw). x is laid out once per call
   in that order (q4k_x_order); the minimums are one 8-lane multiply of the sub-blocks' x sums. */
static void q4k_x_order(const uint16_t *x, int64_t K, int M, uint16_t *xr) {
    for (int m = 0; m < M; m++)
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint16_t *src = x + m * K + blk * 256;
            uint16_t *dst = xr + m * K + blk * 256;
            for (int z = 0; z < 2; z++)  /* chunks 2z, 2z + 1: sub-blocks 4z .. 4z + 3 */
                for (int p = 0; p < 32; p++) {
                    const int even_sb = 2 * (2 * z + p / 16), e = 2 * (p % 16);
                    dst[128 * z + p] = src[32 * even_sb + e];                 /* shift 0: low nibble of byte 2p */
                    dst[128 * z + 32 + p] = src[32 * even_sb + e + 1];        /* shift 8: low nibble of 2p + 1 */
                    dst[128 * z + 64 + p] = src[32 * (even_sb + 1) + e];      /* shift 4: high nibble of 2p */
                    dst[128 * z + 96 + p] = src[32 * (even_sb + 1) + e + 1];  /* shift 12: high nibble of 2p + 1 */
                }
        }
}

static inline __attribute__((always_inline)) void q4_k_bf16_grouped_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint16_t *xr,
        const float *xsum, const int M, void *out, int64_t out_stride, const int bf16_out) {
    const __m512i table = bf16_table(0, 15);  /* entry i: bf16(i & 15); vpermw reads 5 index bits */
    /* the scales of (sub-blocks 4z + t in lanes 0-7, 4z + t + 2 in 8-15), t = 0, 1, from the products'
       lanes 0-7 (d * sc of sub-blocks 0-7) */
    const __m512i pair_index = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i scale_index[4] = {pair_index, _mm512_add_epi32(pair_index, _mm512_set1_epi32(1)),
                                    _mm512_add_epi32(pair_index, _mm512_set1_epi32(4)),
                                    _mm512_add_epi32(pair_index, _mm512_set1_epi32(5))};
    const __m256i d_index = _mm256_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i shift_c_high = _mm_set_epi32(4, 0, 0, 0);
    const __m128i low_mask = _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F);
    const __m128i high_mask = _mm_set_epi32(0x30303030, 0, 0x30303030, 0);
    const int64_t num_blocks = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m512 acc[M];
        __m256 minsum[M];
        UNROLL_M for (int m = 0; m < M; m++) { acc[m] = _mm512_setzero_ps(); minsum[m] = _mm256_setzero_ps(); }
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint8_t *b = row + blk * 144;
            PREFETCH(b, 144);
            /* k_scales_vec's values in one register: d * sc in lanes 0-7, dmin * mn in 8-15. The 6-bit scales
               and minimums of the 12 bytes after d, dmin (dwords a, b, c) as 16 bytes: a & 0x3F..,
               (c & 0x0F..) | ((a >> 6 & 3..) << 4), b & 0x3F.., (c >> 4 & 0x0F..) | ((b >> 6 & 3..) << 4) */
            const __m128i head = _mm_loadu_si128((const __m128i *)b);  /* d, dmin | a | b | c */
            const __m128i low_bits = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(head, 0xED), shift_c_high),
                                                   low_mask);                       /* (a, c, b, c >> 4) & masks */
            const __m128i six_bits = _mm_ternarylogic_epi32(low_bits, _mm_srli_epi32(_mm_shuffle_epi32(head, 0xA5), 2),
                                                            high_mask, 0xF8);       /* | ((-, a, -, b) >> 2) & 0x30.. */
            const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(six_bits));
            const __m512 factors = _mm512_cvtph_ps(_mm256_permutexvar_epi16(d_index, _mm256_castsi128_si256(head)));
            const __m512 products = _mm512_mul_ps(factors, values);
            const __m256 mins = _mm512_extractf32x8_ps(products, 1);
            for (int z = 0; z < 2; z++) {
                const __m512i codes = _mm512_loadu_si512((const void *)(b + 16 + 64 * z));
                const __m512i w0 = _mm512_permutexvar_epi16(codes, table);
                const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 8), table);
                const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
                const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 12), table);
                const __m512 low_scales = _mm512_permutexvar_ps(scale_index[2 * z], products);
                const __m512 high_scales = _mm512_permutexvar_ps(scale_index[2 * z + 1], products);
                UNROLL_M for (int m = 0; m < M; m++) {
                    const uint16_t *xb = xr + m * K + blk * 256 + 128 * z;
                    const __m512 low = _mm512_dpbf16_ps(DP(w0, xb), (__m512bh)w1, X_BF16(xb + 32));
                    const __m512 high = _mm512_dpbf16_ps(DP(w2, xb + 64), (__m512bh)w3, X_BF16(xb + 96));
                    acc[m] = _mm512_fmadd_ps(low_scales, low, acc[m]);
                    acc[m] = _mm512_fmadd_ps(high_scales, high, acc[m]);
                }
            }
            UNROLL_M for (int m = 0; m < M; m++)
                minsum[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + m * (K / 32) + blk * 8), minsum[m]);
        }
        UNROLL_M for (int m = 0; m < M; m++)
            store_result(out, m * out_stride + n, _mm512_reduce_add_ps(acc[m]) - hsum8(minsum[m]), bf16_out);
    }
}

static void q4_k_grouped(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, const uint16_t *xr,
                         const float *xsum, int M, void *out, int64_t ldo, int bf16_out) {
    switch (M) {
    case 1: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 1, out, ldo, bf16_out); break;
    case 2: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 2, out, ldo, bf16_out); break;
    case 3: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 3, out, ldo, bf16_out); break;
    case 4: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 4, out, ldo, bf16_out); break;
    case 5: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 5, out, ldo, bf16_out); break;
    case 6: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 6, out, ldo, bf16_out); break;
    case 7: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 7, out, ldo, bf16_out); break;
    default: q4_k_bf16_grouped_rows(data, rs, n0, n1, K, xr, xsum, 8, out, ldo, bf16_out); break;
    }
}

/* Q6_K: element e = 128 h + 64 nib + 32 s2 + l takes nibble `nib` of ql[64 h + 32 s2 + l] and bits
   2 (2 nib + s2) of qh[32 h + l] (see decode_q6_k). One load takes half h's 64 ql bytes: word p holds
   bytes 2p, 2p + 1 (s2 = p / 16, l = 2 (p % 16) and + 1); the half's 32 qh bytes, as 16 words, go to both
   256-bit halves, the upper one shifted right by 2 (s2 = 1). Shifting the ql words right by 4 nib + 8 hb
   and the qh words by 4 nib + 8 hb - 4, one ternary-logic op puts the 6-bit code of element 128 h +
   64 nib + 32 (p / 16) + 2 (p % 16) + hb in the low 6 bits of word p (vpermt2w reads no more), mapped to
   bf16(q - 32). hb = 0 and 1 chain into one vdpbf16ps sum whose lane i sums elements of scale group
   8 h + 4 nib + 2 (i / 8) + (i % 8) / 4: one multiply by those scales per (h, nib), four per block and row
   (was eight), and the codes unpacked from 64-byte loads (was 32-byte loads widened by vpmovzxbw). x is
   laid out once per call in that order (q6k_x_order). */
static void q6k_x_order(const uint16_t *x, int64_t K, int M, uint16_t *xr) {
    for (int m = 0; m < M; m++)
        for (int64_t blk = 0; blk < K / 256; blk++) {
            const uint16_t *src = x + m * K + blk * 256;
            uint16_t *dst = xr + m * K + blk * 256;
            for (int h = 0; h < 2; h++)
                for (int nib = 0; nib < 2; nib++)
                    for (int hb = 0; hb < 2; hb++)
                        for (int p = 0; p < 32; p++)
                            dst[128 * h + 64 * nib + 32 * hb + p] = src[128 * h + 64 * nib + 32 * (p / 16) + 2 * (p % 16) + hb];
        }
}

#define Q6_SHIFT(v, by) ((by) > 0 ? _mm512_srli_epi16((v), (by) > 0 ? (by) : 0) :                     \
                         (by) < 0 ? _mm512_slli_epi16((v), (by) < 0 ? -(by) : 0) : (v))
/* the bf16 codes of (nib, hb): ql's nibble in bits 0-3, qh's two bits in 4-5 */
#define Q6_CODES(nib, hb) _mm512_permutex2var_epi16(low_table, _mm512_ternarylogic_epi32(                      \
        Q6_SHIFT(low, 4 * (nib) + 8 * (hb)), Q6_SHIFT(high, 4 * (nib) + 8 * (hb) - 4), mask30, 0xD8), high_table)

static inline __attribute__((always_inline)) void q6_k_bf16_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint16_t *xr,
        const float *xsum, const int M, void *out, int64_t out_stride, const int bf16_out) {
    (void)xsum;
    const __m512i low_table = bf16_table(0, 63), high_table = bf16_table(32, 63);  /* bf16(i - 32), i < 64 */
    const __m512i mask30 = _mm512_set1_epi16(0x30);
    /* lane i -> scale group 2 (i / 8) + (i % 8) / 4 of the (h, nib) */
    const __m512i group_index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const int64_t num_blocks = K / 256;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m512 acc[M][2];
        UNROLL_M for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint8_t *b = row + blk * 210;
            PREFETCH(b, 210);
            /* the 16 scales d * sc (as the reference computes them), once per block */
            const __m512 scales = _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            for (int h = 0; h < 2; h++) {
                const __m512i low = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                const __m512i high = _mm512_mask_srli_epi16(qh, (__mmask32)0xFFFF0000u, qh, 2);
                const __m512i codes[4] = {Q6_CODES(0, 0), Q6_CODES(0, 1), Q6_CODES(1, 0), Q6_CODES(1, 1)};
                for (int nib = 0; nib < 2; nib++) {
                    const __m512 sv = _mm512_permutexvar_ps(
                        _mm512_add_epi32(group_index, _mm512_set1_epi32(8 * h + 4 * nib)), scales);
                    UNROLL_M for (int m = 0; m < M; m++) {
                        const uint16_t *xb = xr + m * K + blk * 256 + 128 * h + 64 * nib;
                        acc[m][nib] = _mm512_fmadd_ps(
                            sv, _mm512_dpbf16_ps(DP(codes[2 * nib], xb), (__m512bh)codes[2 * nib + 1], X_BF16(xb + 32)),
                            acc[m][nib]);
                    }
                }
            }
        }
        UNROLL_M for (int m = 0; m < M; m++)
            store_result(out, m * out_stride + n, _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])), bf16_out);
    }
}

/* Q4_0/Q4_1: a block is 32 weights, codes 0..15 in 16 bytes (low nibbles elements 0-15, high ones
   16-31). The 16 bytes go to both halves of a register of 32 words, the upper half shifted right by
   4, and vpermw maps each code to its bf16 value (Q4_0: code - 8; Q4_1: the code; exact, and vpermw
   reads 5 index bits, so the table repeats every 16 and the low half needs no mask): one vdpbf16ps
   against the block's 32 x, then w x = d (q x) (Q4_1: + m * sum x), d and m the file's fp16 values
   in float32. So the weights are the file's (d (q - 8) exactly; d q + m unrounded), not bf16-rounded
   scales; only where the float32 roundings fall differs from a dense GEMV. */

static inline __m512i q4_word_table(int offset) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = bf16_of_int((i & 15) - offset);
    return _mm512_loadu_si512(t);
}


static inline __attribute__((always_inline)) void q4_01_bf16_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
        const float *xsum, const int M, float *out, int64_t out_stride, const int with_min) {
    const int type_size = with_min ? 20 : 18, codes_at = with_min ? 4 : 2;
    const __m512i table = q4_word_table(with_min ? 0 : 8);
    const int64_t num_blocks = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m512 acc[M][2];
        float minsum[M];
        UNROLL_M for (int m = 0; m < M; m++) { acc[m][0] = acc[m][1] = _mm512_setzero_ps(); minsum[m] = 0.0f; }
        int64_t blk = 0;
#define Q4_01_BLOCK(bi, a) {                                                                          \
            const uint8_t *b = row + (bi) * type_size;                                               \
            const __m512i w = _mm512_permutexvar_epi16(Q4_WORDS(b + codes_at), table);               \
            const __m512 d = _mm512_set1_ps(f16(b));                                                 \
            UNROLL_M for (int m = 0; m < M; m++)                                                              \
                acc[m][a] = _mm512_fmadd_ps(d, DP(w, x + m * K + (bi) * 32), acc[m][a]);             \
            if (with_min) {                                                                          \
                const float mn = f16(b + 2);                                                         \
                UNROLL_M for (int m = 0; m < M; m++) minsum[m] += mn * xsum[m * num_blocks + (bi)];           \
            } }
        for (; blk + 2 <= num_blocks; blk += 2) {
            PREFETCH(row + blk * type_size, 2 * type_size);
            Q4_01_BLOCK(blk, 0)
            Q4_01_BLOCK(blk + 1, 1)
        }
        if (blk < num_blocks) Q4_01_BLOCK(blk, 0)
#undef Q4_01_BLOCK
        UNROLL_M for (int m = 0; m < M; m++)
            out[m * out_stride + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + minsum[m];
    }
}

/* The fast form, four blocks (128 weights) at a time: two loads take the group's bytes, vpermt2b
   gathers its 64 code bytes (block L in 128-bit lane L) and its fp16 d (and m) per lane, and each
   16-bit word of the codes yields four codes by shifts (vpermw reads 5 index bits; the table repeats
   every 16). Word p of the four code vectors holds elements e of block p / 8 with k = p % 8:
   e = 2k, 2k + 1, 16 + 2k, 17 + 2k; x is laid out once per call in that order (q4_x_order), so
   lanes 4L..4L+3 of the dot products sum block L, which one multiply by d (lanes 4L..4L+3 = d_L)
   scales. Q4_1 adds each block's m times its x sum, 16 blocks per multiply. The tail blocks
   (K / 32 % 4) run q4_01_bf16_rows's one-block step on the natural x. */
#define Q4G_WORDS 32  /* bf16 x values per code vector */
static void q4_x_order(const uint16_t *x, int64_t K, int M, uint16_t *xr) {
    const int64_t groups = K / 128;
    for (int m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *src = x + m * K + g * 128;
            uint16_t *dst = xr + m * groups * 128 + g * 128;
            for (int p = 0; p < 32; p++) {
                const int L = p / 8, k = p % 8;
                dst[p] = src[32 * L + 2 * k];
                dst[32 + p] = src[32 * L + 2 * k + 1];
                dst[64 + p] = src[32 * L + 16 + 2 * k];
                dst[96 + p] = src[32 * L + 17 + 2 * k];
            }
        }
}

static inline __attribute__((always_inline)) void q4_01_grouped_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,
        const float *xsum, const uint16_t *xr, const int M, void *out, int64_t out_stride,
        const int with_min, const int bf16_out) {
    const int type_size = with_min ? 20 : 18, codes_at = with_min ? 4 : 2;
    const __m512i table = q4_word_table(with_min ? 0 : 8);
    const int64_t groups = K / 128, num_blocks = K / 32;
    /* byte 16 L + j <- L * type_size + codes_at + j; scale word 4 L + r <- d_L (bytes L ts, L ts + 1).
       Q4_1's m: group g of a quad of four (i = g % 4) puts m_L in word 16 + 4 i + L (bytes L ts + 2, + 3)
       and zeros in the quad's other m words, so OR-ing the quad's four gives the m of its 16 blocks in
       block order, one multiply by those blocks' x sums (xsum) per quad and row. */
    uint8_t code_index[64], scale_index[4][64];
    __mmask64 keep[4];
    for (int i = 0; i < 64; i++) {
        code_index[i] = (uint8_t)((i / 16) * type_size + codes_at + i % 16);
        const int word = i / 2;
        for (int q = 0; q < 4; q++)
            scale_index[q][i] = (uint8_t)(word < 16 ? (word / 4) * type_size + i % 2 : (word % 4) * type_size + 2 + i % 2);
    }
    for (int q = 0; q < 4; q++) keep[q] = (__mmask64)0xFFFFFFFFull | ((__mmask64)0xFFull << (32 + 8 * q));
    const __m512i code_idx = _mm512_loadu_si512(code_index);
    const __m512i scale_idx[4] = {_mm512_loadu_si512(scale_index[0]), _mm512_loadu_si512(scale_index[1]),
                                  _mm512_loadu_si512(scale_index[2]), _mm512_loadu_si512(scale_index[3])};
    const __mmask64 tail_bytes = (__mmask64)((1ull << (4 * type_size - 64)) - 1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m512 acc[M];
        UNROLL_M for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        __m512i quad_m = _mm512_setzero_si512();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = row + g * 4 * type_size;
            PREFETCH(b, 4 * type_size);
            const __m512i lo = _mm512_loadu_si512((const void *)b), hi = _mm512_maskz_loadu_epi8(tail_bytes, b + 64);
            const __m512i codes = _mm512_permutex2var_epi8(lo, code_idx, hi);
            const __m512i halves = _mm512_maskz_permutex2var_epi8(keep[g & 3], lo, scale_idx[g & 3], hi);
            const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
            const __m512i w0 = _mm512_permutexvar_epi16(codes, table);
            const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 8), table);
            const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table);
            const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 12), table);
            UNROLL_M for (int m = 0; m < M; m++) {
                const uint16_t *xg = xr + (m * groups + g) * 128;
                __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, X_BF16(xg));
                sum = _mm512_dpbf16_ps(sum, (__m512bh)w1, X_BF16(xg + 32));
                sum = _mm512_dpbf16_ps(sum, (__m512bh)w2, X_BF16(xg + 64));
                sum = _mm512_dpbf16_ps(sum, (__m512bh)w3, X_BF16(xg + 96));
                acc[m] = _mm512_fmadd_ps(d, sum, acc[m]);
            }
            if (with_min) {
                quad_m = _mm512_or_si512(quad_m, halves);
                if ((g & 3) == 3 || g == groups - 1) {  /* the quad's m times its blocks' x sums */
                    const __m512 mn = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(quad_m, 1));
                    const __mmask16 lanes = (__mmask16)((1u << (4 * ((g & 3) + 1))) - 1);
                    UNROLL_M for (int m = 0; m < M; m++)
                        acc[m] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(lanes, xsum + m * num_blocks + (g & ~3) * 4), acc[m]);
                    quad_m = _mm512_setzero_si512();
                }
            }
        }
        float minsum[8];
        UNROLL_M for (int m = 0; m < M; m++) minsum[m] = 0.0f;
        for (int64_t blk = groups * 4; blk < num_blocks; blk++) {  /* the last 1-3 blocks, one at a time */
            const uint8_t *b = row + blk * type_size;
            const __m512i w = _mm512_permutexvar_epi16(Q4_WORDS(b + codes_at), table);
            const __m512 d = _mm512_set1_ps(f16(b));
            UNROLL_M for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(d, DP(w, x + m * K + blk * 32), acc[m]);
            if (with_min) {
                const float mn = f16(b + 2);
                UNROLL_M for (int m = 0; m < M; m++) minsum[m] += mn * xsum[m * num_blocks + blk];
            }
        }
        UNROLL_M for (int m = 0; m < M; m++) {
            const float total = _mm512_reduce_add_ps(acc[m]) + minsum[m];
            if (bf16_out)
                ((uint16_t *)out)[m * out_stride + n] = bf16_round(total);
            else
                ((float *)out)[m * out_stride + n] = total;
        }
    }
}

#define Q4G_FN(NAME, WITH_MIN)                                                                       \
    static void NAME(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,  \
                     const float *xsum, const uint16_t *xr, int M, void *out, int64_t ldo,            \
                     int bf16_out) {                                                                 \
        switch (M) {                                                                                 \
        case 1: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 1, out, ldo, WITH_MIN, bf16_out); break;  \
        case 2: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 2, out, ldo, WITH_MIN, bf16_out); break;  \
        case 3: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 3, out, ldo, WITH_MIN, bf16_out); break;  \
        case 4: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 4, out, ldo, WITH_MIN, bf16_out); break;  \
        case 5: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 5, out, ldo, WITH_MIN, bf16_out); break;  \
        case 6: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 6, out, ldo, WITH_MIN, bf16_out); break;  \
        case 7: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 7, out, ldo, WITH_MIN, bf16_out); break;  \
        default: q4_01_grouped_rows(data, rs, n0, n1, K, x, xsum, xr, 8, out, ldo, WITH_MIN, bf16_out); break; \
        }                                                                                            \
    }
Q4G_FN(q4_0_grouped, 0)
Q4G_FN(q4_1_grouped, 1)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- Q4_0/Q4_1 rows on AMX: every row count costs about what one row does -------------------------
 *
 * A batch-1 verify step of k + 1 rows through q4_01_grouped_rows costs ~2.5 one-row steps at 5 rows
 * (SmolLM2-135M, 1 thread, AMX Xeon): the vdpbf16ps per row and block dominate once the codes are
 * decoded. Here a tile of 16 weight rows times one block (32 inputs) is one TDPBF16PS: the codes of
 * block j of rows n..n+15, decoded to their exact bf16 values as above (A: 16 rows of 32 bf16), times x's
 * block j (B: x's M rows as AMX's pair-interleaved columns), gives the 16 x M sums q . x of that block
 * (bf16 products, exact in float32, float32 sums), which the block's fp16 d (and m times x's block sum)
 * scale in float32 as q4_01_bf16_rows does. Each output (n, m) takes the same operations whatever M
 * is, so rows keep the bits a one-row step gives them (the one-row decode step runs here too). Where
 * the tile state is not granted (no AMX, an older kernel), or N % 16 rows at the end, the AVX-512
 * kernel above. */
#define HAS_AMX_GEMV 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Off by default: measured (SmolLM2-135M bf16, 1 thread, AMX Xeon, in the engine) a one-row step 30.7 ms
   against 20.6 on the AVX-512 kernel, a 5-row verify step 37.4 against 51.4: the verify ratio 2.49 -> 1.22,
   but plain decode 1.5x slower. -1: ask the kernel at first use (gguf_set_amx_gemv(1)), 0: off, 1: on */
static int amx_gemv_state = 0;

static int amx_gemv_on(void) {
    if (amx_gemv_state < 0) {
        unsigned a, b, c, d;
        const int has_amx = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1);
        /* Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as oneDNN asks */
        amx_gemv_state = has_amx && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx_gemv_state;
}

/* 0: the AVX-512 kernels only (the default); 1: AMX where granted (an experiment). Returns whether AMX is on. */
int gguf_set_amx_gemv(int on) {
    amx_gemv_state = on ? -1 : 0;
    return amx_gemv_on();
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* tiles 0-2: C, 16 weight rows x M float32; 3-5: A, 16 weight rows x 32 bf16 codes; 6: B, x's block, 16 pairs x M */
static void amx_configure(int M) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 7; t++) config.rows[t] = 16;
    for (int t = 0; t < 3; t++) config.colsb[t] = (uint16_t)(4 * M);   /* C tiles */
    for (int t = 3; t < 6; t++) config.colsb[t] = 64;                  /* A tiles */
    config.colsb[6] = (uint16_t)(4 * M);                                /* B */
    __asm__ volatile("" : : "m"(config) : "memory");  /* gcc 12 drops the stores above as dead otherwise */
    _tile_loadconfig(&config);
}

/* A row of A holds a block's 32 codes in the order one variable shift gives them: the block's 16 code
   bytes in each 128-bit lane, as 8 words, shifted right by 0, 4, 8, 12 in lanes 0-3 (vpermw reads the low
   4 bits it needs: the table repeats every 16). So word w = 8 L + t holds element AMX_ELEMENT(w): the low
   (L = 0, 2) or high (1, 3) nibble of byte 2 t (L < 2) or 2 t + 1; element i < 16 is byte i's low nibble,
   16 + i its high one. */
#define AMX_ELEMENT(w) ((((w) / 8) & 1) * 16 + 2 * ((w) % 8) + (w) / 16)

/* x's rows as B tiles, one per block of 32 inputs, in A's element order: xb[(j * 16 + p) * M + m] = the
   pair (x[m][32 j + AMX_ELEMENT(2 p)], x[m][32 j + AMX_ELEMENT(2 p + 1)]) */
static void amx_x_tiles(const uint16_t *x, int64_t K, int M, uint32_t *xb) {
    for (int m = 0; m < M; m++)
        for (int64_t j = 0; j < K / 32; j++)
            for (int p = 0; p < 16; p++) {
                const uint16_t *block = x + m * K + 32 * j;
                xb[(j * 16 + p) * M + m] = (uint32_t)block[AMX_ELEMENT(2 * p)] | (uint32_t)block[AMX_ELEMENT(2 * p + 1)] << 16;
            }
}

static inline __attribute__((always_inline)) void q4_01_amx_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint32_t *xb, const float *xsum_t, const int M, void *out, int64_t out_stride,
                           const int with_min, const int bf16_out) {
    const int type_size = with_min ? 20 : 18, codes_at = with_min ? 4 : 2;
    const __m512i table = q4_word_table(with_min ? 0 : 8);
    const int64_t num_blocks = K / 32;
    /* lane l of accumulator i holds output (n, m) = ((16 i + l) / M, (16 i + l) % M): C's layout */
    __m512i row_of[8], column_of[8];
    for (int i = 0; i < M; i++) {
        int32_t r[16], c[16];
        for (int l = 0; l < 16; l++) { r[l] = (16 * i + l) / M; c[l] = (16 * i + l) % M; }
        row_of[i] = _mm512_loadu_si512(r);
        column_of[i] = _mm512_loadu_si512(c);
    }
    const __m512i row_offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)row_stride));
    const __mmask16 m_lanes = (__mmask16)((1u << M) - 1);
    const __m512i lane_shifts = _mm512_set_epi64(0x000C000C000C000Cll, 0x000C000C000C000Cll, 0x0008000800080008ll,
                                                 0x0008000800080008ll, 0x0004000400040004ll, 0x0004000400040004ll, 0, 0);
    const int prefetch_chunk = (int)(((16 * row_stride + num_blocks - 1) / num_blocks + 63) / 64 * 64);
    uint16_t a[3][16 * 32] __attribute__((aligned(64)));
    float c[3][16 * 8] __attribute__((aligned(64)));
    amx_configure(M);
    /* up to three tiles of 16 rows per pass over the blocks: their TDPBF16PS overlap the next one's decode */
#define AMX_DECODE(t) for (int r = 0; r < 16; r++) {                                                   \
        const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(                                   \
            (const __m128i *)(b + (16 * (t) + r) * row_stride + codes_at)));                              \
        _mm512_store_si512((void *)(a[t] + 32 * r), _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, lane_shifts), table)); }
#define AMX_TILE(t, at) { _tile_zero(t); _tile_loadd(at, a[t], 64); _tile_dpbf16ps(t, at, 6); _tile_stored(t, c[t], 4 * M); }
    for (int64_t n = n0; n < n1;) {
        const int num_tiles = n1 - n >= 48 ? 3 : 1;
        const uint8_t *rows = data + n * row_stride;
        __m512 acc[3][M];
        for (int t = 0; t < 3; t++) UNROLL_M for (int i = 0; i < M; i++) acc[t][i] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const uint8_t *b = rows + blk * type_size;
            PREFETCH(rows + 16 * num_tiles * row_stride + blk * prefetch_chunk * num_tiles - PREFETCH_BYTES, prefetch_chunk * num_tiles);
            _tile_loadd(6, xb + blk * 16 * M, 4 * M);
            AMX_DECODE(0)
            AMX_TILE(0, 3)
            if (num_tiles == 3) {
                AMX_DECODE(1)
                AMX_TILE(1, 4)
                AMX_DECODE(2)
                AMX_TILE(2, 5)
            }
            const __m512 xs = _mm512_maskz_loadu_ps(m_lanes, xsum_t + blk * M);
            for (int t = 0; t < num_tiles; t++) {
                const __m512i heads = _mm512_i32gather_epi32(row_offsets, (const void *)(b + 16 * t * row_stride), 1);  /* d | m << 16 */
                const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads));
                UNROLL_M for (int i = 0; i < M; i++)
                    acc[t][i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(row_of[i], d), _mm512_load_ps(c[t] + 16 * i), acc[t][i]);
                if (with_min) {
                    const __m512 mn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16)));
                    UNROLL_M for (int i = 0; i < M; i++)
                        acc[t][i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(row_of[i], mn), _mm512_permutexvar_ps(column_of[i], xs), acc[t][i]);
                }
            }
        }
        for (int t = 0; t < num_tiles; t++) {
            UNROLL_M for (int i = 0; i < M; i++) _mm512_store_ps(c[t] + 16 * i, acc[t][i]);
            for (int r = 0; r < 16; r++)
                UNROLL_M for (int m = 0; m < M; m++) {
                    if (bf16_out)
                        ((uint16_t *)out)[m * out_stride + n + 16 * t + r] = bf16_round(c[t][r * M + m]);
                    else
                        ((float *)out)[m * out_stride + n + 16 * t + r] = c[t][r * M + m];
                }
        }
        n += 16 * num_tiles;
    }
#undef AMX_DECODE
#undef AMX_TILE
    _tile_release();
}

#define Q4_AMX_FN(NAME, WITH_MIN)                                                                    \
    static void NAME(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, const uint32_t *xb, \
                     const float *xsum_t, int M, void *out, int64_t ldo, int bf16_out) {             \
        switch (M) {                                                                                 \
        case 1: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 1, out, ldo, WITH_MIN, bf16_out); break;  \
        case 2: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 2, out, ldo, WITH_MIN, bf16_out); break;  \
        case 3: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 3, out, ldo, WITH_MIN, bf16_out); break;  \
        case 4: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 4, out, ldo, WITH_MIN, bf16_out); break;  \
        case 5: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 5, out, ldo, WITH_MIN, bf16_out); break;  \
        case 6: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 6, out, ldo, WITH_MIN, bf16_out); break;  \
        case 7: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 7, out, ldo, WITH_MIN, bf16_out); break;  \
        default: q4_01_amx_rows(data, rs, n0, n1, K, xb, xsum_t, 8, out, ldo, WITH_MIN, bf16_out); break; \
        }                                                                                            \
    }
Q4_AMX_FN(q4_0_amx, 0)
Q4_AMX_FN(q4_1_amx, 1)
#endif

#define BF16_FN(NAME, ROWS)                                                                          \
    static void NAME(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, const uint16_t *x,  \
                     const float *xsum, int M, void *out, int64_t ldo, int bf16_out) {               \
        switch (M) {                                                                                 \
        case 1: ROWS(data, rs, n0, n1, K, x, xsum, 1, out, ldo, bf16_out); break;                    \
        case 2: ROWS(data, rs, n0, n1, K, x, xsum, 2, out, ldo, bf16_out); break;                    \
        case 3: ROWS(data, rs, n0, n1, K, x, xsum, 3, out, ldo, bf16_out); break;                    \
        case 4: ROWS(data, rs, n0, n1, K, x, xsum, 4, out, ldo, bf16_out); break;                    \
        case 5: ROWS(data, rs, n0, n1, K, x, xsum, 5, out, ldo, bf16_out); break;                    \
        case 6: ROWS(data, rs, n0, n1, K, x, xsum, 6, out, ldo, bf16_out); break;                    \
        case 7: ROWS(data, rs, n0, n1, K, x, xsum, 7, out, ldo, bf16_out); break;                    \
        default: ROWS(data, rs, n0, n1, K, x, xsum, 8, out, ldo, bf16_out); break;                   \
        }                                                                                            \
    }
BF16_FN(q6_k_bf16, q6_k_bf16_rows)

/* Q8_0: a code (-128..127) is exact in bf16, so each block's 32 products are exact too. Two blocks a
   step: one vdpbf16ps takes block a's elements 0-15 in its lanes 0-7 and block b's 0-15 in lanes 8-15
   (cvtne2ps of their float codes, exact), a second their elements 16-31, chained, then one multiply by
   (d_a in lanes 0-7, d_b in 8-15): w x = d (q x) with the file's fp16 d. x is laid out once per call in
   that order (q8_x_order: per 64 inputs, 0-15, 32-47, 16-31, 48-63; an odd last block as it is). Every
   row of x runs the same operations whatever M is. */
static void q8_x_order(const uint16_t *x, int64_t K, int M, uint16_t *xr) {
    for (int m = 0; m < M; m++) {
        const uint16_t *src = x + m * K;
        uint16_t *dst = xr + m * K;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            memcpy(dst + k, src + k, 32);
            memcpy(dst + k + 16, src + k + 32, 32);
            memcpy(dst + k + 32, src + k + 16, 32);
            memcpy(dst + k + 48, src + k + 48, 32);
        }
        if (k < K) memcpy(dst + k, src + k, (size_t)(K - k) * 2);
    }
}

#define Q8_CODES(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

static inline __attribute__((always_inline)) void q8_0_bf16_rows(
        const uint8_t *data, int64_t row_stride, int64_t n0, int64_t n1, int64_t K, const uint16_t *xr,
        const int M, void *out, int64_t out_stride, const int bf16_out) {
    const int64_t num_blocks = K / 32, pairs = num_blocks / 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = data + n * row_stride;
        __m512 acc[M][2];
        UNROLL_M for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *a = row + p * 68, *b = a + 34;
            PREFETCH(a, 68);
            const __m512i w0 = (__m512i)_mm512_cvtne2ps_pbh(Q8_CODES(b + 2), Q8_CODES(a + 2));
            const __m512i w1 = (__m512i)_mm512_cvtne2ps_pbh(Q8_CODES(b + 18), Q8_CODES(a + 18));
            const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(f16(a)), _mm256_set1_ps(f16(b)), 1);
            UNROLL_M for (int m = 0; m < M; m++) {
                const uint16_t *xp = xr + m * K + 64 * p;
                const __m512 sum = _mm512_dpbf16_ps(DP(w0, xp), (__m512bh)w1, X_BF16(xp + 32));
                acc[m][p & 1] = _mm512_fmadd_ps(d, sum, acc[m][p & 1]);
            }
        }
        if (num_blocks & 1) {  /* the odd last block: elements 0-15 in lanes 0-7, 16-31 in 8-15 */
            const uint8_t *a = row + pairs * 68;
            const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(Q8_CODES(a + 18), Q8_CODES(a + 2));
            const __m512 d = _mm512_set1_ps(f16(a));
            UNROLL_M for (int m = 0; m < M; m++)
                acc[m][0] = _mm512_fmadd_ps(d, DP(w, xr + m * K + 64 * pairs), acc[m][0]);
        }
        UNROLL_M for (int m = 0; m < M; m++)
            store_result(out, m * out_stride + n, _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])), bf16_out);
    }
}

static void q8_0_bf16(const uint8_t *data, int64_t rs, int64_t n0, int64_t n1, int64_t K, const uint16_t *xr,
                      const float *xsum, int M, void *out, int64_t ldo, int bf16_out) {
    (void)xsum;
    switch (M) {
    case 1: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 1, out, ldo, bf16_out); break;
    case 2: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 2, out, ldo, bf16_out); break;
    case 3: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 3, out, ldo, bf16_out); break;
    case 4: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 4, out, ldo, bf16_out); break;
    case 5: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 5, out, ldo, bf16_out); break;
    case 6: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 6, out, ldo, bf16_out); break;
    case 7: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 7, out, ldo, bf16_out); break;
    default: q8_0_bf16_rows(data, rs, n0, n1, K, xr, 8, out, ldo, bf16_out); break;
    }
}

#endif

typedef void (*gemv_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, int, float *, int64_t);
typedef void (*dequant_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *);

static const gemv_fn GEMV[] = {gemv_q4_0, gemv_q4_1, gemv_q5_0, gemv_q5_1, gemv_q8_0,
                               gemv_q4_k, gemv_q5_k, gemv_q6_k, gemv_w4g128};
static const dequant_fn DEQUANT[] = {gemv_q4_0_dequant, gemv_q4_1_dequant, gemv_q5_0_dequant,
                                     gemv_q5_1_dequant, gemv_q8_0_dequant, gemv_q4_k_dequant,
                                     gemv_q5_k_dequant, gemv_q6_k_dequant, gemv_w4g128_dequant};

/* Rows per thread chunk: whole chunks of 16 so neighbouring threads do not share output lines. */
static inline void split(int64_t N, int parts, int part, int64_t *n0, int64_t *n1) {
    int64_t chunks = (N + 15) / 16, per = chunks / parts, extra = chunks % parts;
    int64_t first = part * per + (part < extra ? part : extra), count = per + (part < extra);
    *n0 = first * 16 < N ? first * 16 : N;
    *n1 = (first + count) * 16 < N ? (first + count) * 16 : N;
}

/* CALL, an expression of the rows [n0, n1), over all N rows: on this thread for one thread or few
   rows, else in whole chunks of 16 (split) over num_threads OpenMP threads. */
#define OVER_ROW_PARTS(N, num_threads, CALL)                                           \
    do {                                                                               \
        if ((num_threads) <= 1 || (N) < 32) {                                          \
            const int64_t n0 = 0, n1 = (N);                                            \
            CALL;                                                                      \
        } else {                                                                       \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static, 1)")   \
            for (int part = 0; part < (num_threads); part++) {                         \
                int64_t n0, n1;                                                        \
                split((N), (num_threads), part, &n0, &n1);                             \
                CALL;                                                                  \
            }                                                                          \
        }                                                                              \
    } while (0)

int gguf_gemv(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, const float *x,
              int M, float *out, int64_t out_stride, int num_threads) {
    if (qtype < 0 || qtype > W4G128 || M < 1 || M > 8) return -1;
    const gemv_fn fn = GEMV[qtype];
    OVER_ROW_PARTS(N, num_threads, fn(data, row_stride, n0, n1, K, x, M, out, out_stride));
    return 0;
}

int gguf_dequant(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, float *out,
                 int num_threads) {
    if (qtype < 0 || qtype > W4G128) return -1;
    const dequant_fn fn = DEQUANT[qtype];
    OVER_ROW_PARTS(N, num_threads, fn(data, row_stride, n0, n1, K, out + n0 * K));
    return 0;
}

/* bf16 x: 1 if this build has a bf16 kernel for qtype (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K). */
int gguf_has_bf16(int qtype) {
#if defined(HAS_BF16_KERNELS)
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_K || qtype == Q6_K;
#else
    (void)qtype;
    return 0;
#endif
}

#if defined(HAS_BF16_KERNELS)
/* Q4_K, Q6_K and Q8_0 rows: x laid out once in the kernel's order (x_order), then the rows split over the
   threads (rows: a q*_k_grouped / q6_k_bf16 / q8_0_bf16 of the same signature). */
typedef void (*x_order_fn)(const uint16_t *, int64_t, int, uint16_t *);
typedef void (*laid_out_rows_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const uint16_t *, const float *,
                                 int, void *, int64_t, int);

static int laid_out_gemv(x_order_fn x_order, laid_out_rows_fn rows, const uint8_t *data, int64_t row_stride, int64_t N,
                         int64_t K, const uint16_t *x, const float *xsum, int M, void *out, int64_t out_stride,
                         int num_threads, int bf16_out) {
    uint16_t stack_xr[16384];
    const int on_stack = M * K <= 16384;
    uint16_t *xr = on_stack ? stack_xr : malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (!xr) return -3;
    x_order(x, K, M, xr);
    OVER_ROW_PARTS(N, num_threads, rows(data, row_stride, n0, n1, K, xr, xsum, M, out, out_stride, bf16_out));
    if (!on_stack) free(xr);
    return 0;
}

/* Q4_0/Q4_1 rows by the grouped kernel: x laid out in its order once (q4_x_order), then the rows
   [0, N) split over the threads; out float32, or bf16 (rounded to nearest even) with bf16_out. */
static int q4_gemv(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, const uint16_t *x,
                   const float *xsum, int M, void *out, int64_t out_stride, int num_threads, int bf16_out) {
    const int64_t groups = K / 128;
    uint16_t stack_xr[16384];
    const int on_stack = M * groups * 128 <= 16384;
    uint16_t *xr = on_stack ? stack_xr : malloc(sizeof(uint16_t) * (size_t)(M * groups * 128 + 1));
    if (!xr) return -3;
#if defined(HAS_AMX_GEMV)
    if (amx_gemv_on() && N >= 16) {
        const int64_t num_blocks = K / 32, tiled = N / 16 * 16;
        uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)(M * K / 2));
        float xsum_t[8 * 1024];
        if (!xb) { if (!on_stack) free(xr); return -3; }
        amx_x_tiles(x, K, M, xb);
        if (qtype == Q4_1)
            for (int m = 0; m < M; m++)
                for (int64_t j = 0; j < num_blocks; j++) xsum_t[j * M + m] = xsum[m * num_blocks + j];
        if (qtype == Q4_0)
            OVER_ROW_PARTS(tiled, num_threads, q4_0_amx(data, row_stride, n0, n1, K, xb, xsum_t, M, out, out_stride, bf16_out));
        else
            OVER_ROW_PARTS(tiled, num_threads, q4_1_amx(data, row_stride, n0, n1, K, xb, xsum_t, M, out, out_stride, bf16_out));
        free(xb);
        if (tiled < N) {  /* the last N % 16 rows: always here, so they too are the same for any M */
            q4_x_order(x, K, M, xr);
            if (qtype == Q4_0) q4_0_grouped(data, row_stride, tiled, N, K, x, xsum, xr, M, out, out_stride, bf16_out);
            else q4_1_grouped(data, row_stride, tiled, N, K, x, xsum, xr, M, out, out_stride, bf16_out);
        }
        if (!on_stack) free(xr);
        return 0;
    }
#endif
    q4_x_order(x, K, M, xr);
    if (qtype == Q4_0)
        OVER_ROW_PARTS(N, num_threads, q4_0_grouped(data, row_stride, n0, n1, K, x, xsum, xr, M, out, out_stride, bf16_out));
    else
        OVER_ROW_PARTS(N, num_threads, q4_1_grouped(data, row_stride, n0, n1, K, x, xsum, xr, M, out, out_stride, bf16_out));
    if (!on_stack) free(xr);
    return 0;
}

/* Q4's block sums of x per 32 (Q4_1's minimums multiply these), each in a fixed order */
static void block_sums(const uint16_t *x, int64_t K, int M, float *xsum) {
    for (int m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 32; g++) {
            const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + m * K + g * 32)));
            const __m512i words2 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + m * K + g * 32 + 16)));
            xsum[m * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(words2, 16))));
        }
}
#endif

/* The bf16 kernels for bf16 x (uint16 bits) [M, K], M <= 8: out float32, or (bf16_out) bf16 bits, the float32 sums
   rounded to nearest even. */
static int gemv_bf16_x(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, const uint16_t *x,
                       int M, void *out, int64_t out_stride, int num_threads, int bf16_out) {
#if defined(HAS_BF16_KERNELS)
    const int block_size = qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 ? 32 : 256;
    if (!gguf_has_bf16(qtype) || M < 1 || M > 8 || K % block_size) return -1;
    float xsum[8 * 1024];  /* per 32 inputs of each row of x: Q4_K's and Q4_1's minimums multiply these */
    if (K / 32 > 1024) return -2;
    if (qtype == Q4_K || qtype == Q4_1) block_sums(x, K, M, xsum);
    if (qtype == Q4_0 || qtype == Q4_1)
        return q4_gemv(qtype, data, row_stride, N, K, x, xsum, M, out, out_stride, num_threads, bf16_out);
    return laid_out_gemv(qtype == Q8_0 ? q8_x_order : qtype == Q4_K ? q4k_x_order : q6k_x_order,
                         qtype == Q8_0 ? q8_0_bf16 : qtype == Q4_K ? q4_k_grouped : q6_k_bf16,
                         data, row_stride, N, K, x, xsum, M, out, out_stride, num_threads, bf16_out);
#else
    (void)qtype; (void)data; (void)row_stride; (void)N; (void)K; (void)x; (void)M; (void)out; (void)out_stride;
    (void)num_threads; (void)bf16_out;
    return -1;
#endif
}

/* out[m, n] = sum_k x[m, k] W[n, k] for bf16 x (uint16 bits) [M, K], M <= 8; -1 where
   gguf_has_bf16(qtype) is 0. */
int gguf_gemv_bf16(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, const uint16_t *x,
                   int M, float *out, int64_t out_stride, int num_threads) {
    return gemv_bf16_x(qtype, data, row_stride, N, K, x, M, out, out_stride, num_threads, 0);
}

/* gguf_gemv_bf16 with bf16 out (uint16 bits; the float32 sums rounded to nearest even, as
   .to(torch.bfloat16) would): no float32 output tensor and no cast for the engine's decode steps.
   -1 where gguf_has_bf16(qtype) is 0. */
int gguf_gemv_bf16_out(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, const uint16_t *x,
                       int M, uint16_t *out, int64_t out_stride, int num_threads) {
    return gemv_bf16_x(qtype, data, row_stride, N, K, x, M, out, out_stride, num_threads, 1);
}

/* Rows [n0, n1) of a weight in torch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu: per
   64 output rows, K groups of 32 bytes, byte i holding row i (low nibble) and row 32 + i (high))
   with bf16 scales_and_zeros [K / group, N, 2], as float32: (code - 8) * scale + zero, the values
   _weight_int4pack_mm_for_cpu multiplies by. For the int4 method's large batches (no dense copy). */
int int4pack_dequant(const uint8_t *packed, const uint16_t *scales_and_zeros, int64_t N, int64_t K, int64_t group,
                     int64_t n0, int64_t n1, float *out) {
    if (N % 64 || n0 < 0 || n1 > N || group <= 0 || K % group) return -1;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rows = packed + (n / 64) * K * 32 + (n % 32);
        const int shift = (n % 64) < 32 ? 0 : 4;
        for (int64_t g = 0; g < K / group; g++) {
            uint32_t scale_bits = (uint32_t)scales_and_zeros[(g * N + n) * 2] << 16;
            uint32_t zero_bits = (uint32_t)scales_and_zeros[(g * N + n) * 2 + 1] << 16;
            float scale, zero;
            memcpy(&scale, &scale_bits, 4);
            memcpy(&zero, &zero_bits, 4);
            for (int64_t k = g * group; k < (g + 1) * group; k++)
                out[(n - n0) * K + k] = (float)((int)((rows[k * 32] >> shift) & 15) - 8) * scale + zero;
        }
    }
    return 0;
}

/* The same values transposed, out[k, n - n0] for k < K (rows of out n1 - n0 wide), which the int4
   layout yields 16 rows at a time: vector loads and stores instead of one nibble at a time.
   n0 and n1 multiples of 64. */
int int4pack_dequant_t(const uint8_t *packed, const uint16_t *scales_and_zeros, int64_t N, int64_t K, int64_t group,
                       int64_t n0, int64_t n1, float *out) {
    if (N % 64 || n0 % 64 || n1 % 64 || n0 < 0 || n1 > N || group <= 0 || K % group) return -1;
    const int64_t width = n1 - n0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t nb = n0 / 64; nb < n1 / 64; nb++) {
        for (int64_t g = 0; g < K / group; g++) {
            __m512 scale[4], zero[4];
            for (int q = 0; q < 4; q++) {  /* rows 64 nb + 16 q .. + 15: (scale, zero) bf16 pairs */
                const __m512i pairs = _mm512_loadu_si512((const void *)(scales_and_zeros + (g * N + nb * 64 + 16 * q) * 2));
                scale[q] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));                  /* low halves */
                zero[q] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
            }
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                const uint8_t *bytes = packed + (nb * K + k) * 32;
                float *dst = out + k * width + (nb * 64 - n0);
                const __m512i lo0 = U8X16(bytes), lo1 = U8X16(bytes + 16);
                const __m512i codes[4] = {LOW4(lo0), LOW4(lo1), HIGH4(lo0), HIGH4(lo1)};
                for (int q = 0; q < 4; q++)  /* as the scalar loop: (code - 8) * scale + zero, unfused */
                    _mm512_storeu_ps(dst + 16 * q, _mm512_add_ps(_mm512_mul_ps(
                        _mm512_sub_ps(_mm512_cvtepi32_ps(codes[q]), eight), scale[q]), zero[q]));
            }
        }
    }
#else
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *rows = packed + (n / 64) * K * 32 + (n % 32);
        const int shift = (n % 64) < 32 ? 0 : 4;
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = k / group;
            uint32_t scale_bits = (uint32_t)scales_and_zeros[(g * N + n) * 2] << 16;
            uint32_t zero_bits = (uint32_t)scales_and_zeros[(g * N + n) * 2 + 1] << 16;
            float scale, zero;
            memcpy(&scale, &scale_bits, 4);
            memcpy(&zero, &zero_bits, 4);
            out[k * width + (n - n0)] = (float)((int)((rows[k * 32] >> shift) & 15) - 8) * scale + zero;
        }
    }
#endif
    return 0;
}

/* W[n0:n1] as bf16 (the dequantized float32 values rounded to nearest even): the tiled path's
   tiles for bf16 batches, half the bytes of float32 and no separate cast. -1 without AVX-512 BF16. */
int gguf_dequant_bf16(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, uint16_t *out,
                      int num_threads) {
#if defined(HAS_DEQUANT_BF16)
    typedef void (*fn_t)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, uint16_t *);
    static const fn_t FNS[] = {gemv_q4_0_dequant_bf16, gemv_q4_1_dequant_bf16, gemv_q5_0_dequant_bf16,
                               gemv_q5_1_dequant_bf16, gemv_q8_0_dequant_bf16, gemv_q4_k_dequant_bf16,
                               gemv_q5_k_dequant_bf16, gemv_q6_k_dequant_bf16, gemv_w4g128_dequant_bf16};
    if (qtype < 0 || qtype > W4G128) return -1;
    const fn_t fn = FNS[qtype];
    OVER_ROW_PARTS(N, num_threads, fn(data, row_stride, n0, n1, K, out + n0 * K));
    return 0;
#else
    (void)qtype; (void)data; (void)row_stride; (void)N; (void)K; (void)out; (void)num_threads;
    return -1;
#endif
}

/* ---- panels: Q4_0 / Q4_1 / Q8_0 rows eight at a time, for float32 x on AVX2 + FMA + F16C ----------
 *
 * Without AVX-512 a vector holds 8 float32, and decoding one row's blocks costs more per weight
 * than the dot product (the d / m broadcasts, a scale per block, a horizontal sum per row). So the
 * layer's blocks are repacked once (gguf_panel_pack, the same bytes rearranged, nothing rounded):
 * a panel of 8 output rows, block b of all 8 side by side: their 8 fp16 d (Q4_1: then their 8 m),
 * then the codes with the 8 rows' bytes adjacent (Q4: 16 groups of 8 bytes, group i byte r = byte i
 * of row r's codes: elements i and i + 16; Q8_0: 32 groups, element k). A group's 8 bytes are one
 * vector of 8 rows' codes, times one broadcast x: lane r accumulates output row r, no horizontal sums.
 *
 * Math: per block, s = sum_k q_k x_k (q the exact integer code, Q4_0's q - 8, as float32; four
 * fused-add chains per row of x, then (s0 + s1) + (s2 + s3)), then acc += d * s, and for Q4_1
 * acc += m * (sum of the block's x, in a fixed order): w x = d q x + m x with the file's d and m, the
 * weight d q + m unrounded (Q4_0's d (q - 8) and Q8_0's d q are exact in float32 anyway). Each row
 * of x runs the same operations whatever M is (rows go through in pairs), so its bits do not
 * depend on the batch. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAS_PANELS 1

static int panel_bytes(int qtype) { return qtype == Q4_0 ? 8 * 18 : qtype == Q4_1 ? 8 * 20 : qtype == Q8_0 ? 8 * 34 : 0; }

static inline __attribute__((always_inline)) void q4_panel(
        const uint8_t *pb0, int64_t nb, const float *x, const float *xsum, int64_t K, const int M, float *out,
        int64_t ldo, const int with_min) {
    const int ps = with_min ? 160 : 144, codes_at = with_min ? 32 : 16;
    const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256 acc[M];
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = pb0 + b * ps;
        PREFETCH(pb, ps);
        const float *xb = x + b * 32;
        __m256 s[M][4];
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) s[m][0] = s[m][1] = s[m][2] = s[m][3] = _mm256_setzero_ps();
#define Q4_GROUP(i, c) {                                                                             \
            const __m256i v = U8X8(pb + codes_at + 8 * (i));                                         \
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);                    \
            if (!with_min) { lo = _mm256_sub_epi32(lo, eight); hi = _mm256_sub_epi32(hi, eight); }   \
            const __m256 wl = _mm256_cvtepi32_ps(lo), wh = _mm256_cvtepi32_ps(hi);                   \
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) {                                                            \
                s[m][c] = _mm256_fmadd_ps(wl, _mm256_set1_ps(xb[m * K + (i)]), s[m][c]);             \
                s[m][2 + (c)] = _mm256_fmadd_ps(wh, _mm256_set1_ps(xb[m * K + 16 + (i)]), s[m][2 + (c)]);  \
            } }
        _Pragma("GCC unroll 8") for (int i = 0; i < 16; i += 2) {
            Q4_GROUP(i, 0)
            Q4_GROUP(i + 1, 1)
        }
#undef Q4_GROUP
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb));
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
            acc[m] = _mm256_fmadd_ps(d, _mm256_add_ps(_mm256_add_ps(s[m][0], s[m][1]), _mm256_add_ps(s[m][2], s[m][3])), acc[m]);
        if (with_min) {
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16)));
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * nb + b]), acc[m]);
        }
    }
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

static inline __attribute__((always_inline)) void q8_panel(
        const uint8_t *pb0, int64_t nb, const float *x, int64_t K, const int M, float *out, int64_t ldo) {
    __m256 acc[M];
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = pb0 + b * 272;
        PREFETCH(pb, 272);
        const float *xb = x + b * 32;
        __m256 s[M][4];
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) s[m][0] = s[m][1] = s[m][2] = s[m][3] = _mm256_setzero_ps();
        _Pragma("GCC unroll 8") for (int k = 0; k < 32; k += 4)
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(pb + 16 + 8 * (k + j)))));
                _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) s[m][j] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[m * K + k + j]), s[m][j]);
            }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb));
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
            acc[m] = _mm256_fmadd_ps(d, _mm256_add_ps(_mm256_add_ps(s[m][0], s[m][1]), _mm256_add_ps(s[m][2], s[m][3])), acc[m]);
    }
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

/* Panels [p0, p1) for M rows of x, two rows a pass over each panel (its bytes stay in L1). */
static void panel_rows(int qtype, const uint8_t *packed, int64_t p0, int64_t p1, int64_t K, const float *x,
                       const float *xsum, int M, float *out, int64_t ldo) {
    const int64_t nb = K / 32, ps = panel_bytes(qtype);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pb0 = packed + p * nb * ps;
        for (int m0 = 0; m0 < M; m0 += 2) {
            const float *xm = x + m0 * K, *sm = xsum + m0 * nb;
            float *om = out + m0 * ldo + 8 * p;
            const int two = M - m0 >= 2;
            if (qtype == Q4_1) {
                if (two) q4_panel(pb0, nb, xm, sm, K, 2, om, ldo, 1); else q4_panel(pb0, nb, xm, sm, K, 1, om, ldo, 1);
            } else if (qtype == Q4_0) {
                if (two) q4_panel(pb0, nb, xm, sm, K, 2, om, ldo, 0); else q4_panel(pb0, nb, xm, sm, K, 1, om, ldo, 0);
            } else {
                if (two) q8_panel(pb0, nb, xm, K, 2, om, ldo); else q8_panel(pb0, nb, xm, K, 1, om, ldo);
            }
        }
    }
}
#endif

/* 1 where this build has the AVX-512 paths (else AVX2 or portable C). */
int gguf_has_avx512(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build's float32 GEMV (gguf_gemv) for qtype is vectorized: every type with AVX-512; with
   AVX2 + FMA + F16C, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (the types of Q4_K_M, Q5_K_M, Q6_K
   and Q8_0 files, and the Q5_0/Q5_1 that K-quant files use where rows are not whole superblocks); else
   none (the scalar decoders). */
int gguf_has_vector_float32(int qtype) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return qtype >= 0 && qtype <= W4G128;
#elif defined(HAS_AVX2_K_KERNELS)
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || qtype == Q4_K
        || qtype == Q5_K || qtype == Q6_K;
#else
    (void)qtype;
    return 0;
#endif
}

/* 1 where this build has the panel kernels for qtype (Q4_0, Q4_1, Q8_0 with AVX2 + FMA + F16C). */
int gguf_has_panels(int qtype) {
#if defined(HAS_PANELS)
    return panel_bytes(qtype) > 0;
#else
    (void)qtype;
    return 0;
#endif
}

/* Rows [0, N) of the file's blocks (row_stride bytes apart) into panels (see above); N % 8 == 0.
   out holds N / 8 * (K / 32) * panel bytes: as many bytes as the blocks. */
int gguf_panel_pack(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K, uint8_t *out) {
    const int ts = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
    if (!ts || N % 8 || K % 32) return -1;
    const int with_min = qtype == Q4_1, num_codes = qtype == Q8_0 ? 32 : 16, codes_at = with_min ? 32 : 16;
    const int64_t nb = K / 32;
    for (int64_t p = 0; p < N / 8; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * 8 * ts;
            for (int r = 0; r < 8; r++) {
                const uint8_t *src = data + (8 * p + r) * row_stride + b * ts;
                memcpy(dst + 2 * r, src, 2);
                if (with_min) memcpy(dst + 16 + 2 * r, src + 2, 2);
                for (int i = 0; i < num_codes; i++) dst[codes_at + 8 * i + r] = src[(with_min ? 4 : 2) + i];
            }
        }
    return 0;
}

/* The panels' values as float32 [N, K], each weight with the reference's operations (bit-equal to
   dequantizing the blocks they came from). */
int gguf_panel_dequant(int qtype, const uint8_t *packed, int64_t N, int64_t K, float *out) {
    const int ts = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
    if (!ts || N % 8 || K % 32) return -1;
    const int with_min = qtype == Q4_1, codes_at = with_min ? 32 : 16;
    const int64_t nb = K / 32;
    for (int64_t p = 0; p < N / 8; p++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = packed + (p * nb + b) * 8 * ts, *codes = pb + codes_at;
            for (int r = 0; r < 8; r++) {
                float *w = out + (8 * p + r) * K + 32 * b;
                const float d = f16(pb + 2 * r), mn = with_min ? f16(pb + 16 + 2 * r) : 0.0f;
                for (int i = 0; i < (qtype == Q8_0 ? 32 : 16); i++) {
                    const int q = codes[8 * i + r];
                    if (qtype == Q8_0) {
                        w[i] = (float)(int8_t)q * d;
                    } else if (with_min) {
                        w[i] = d * (float)(q & 15) + mn;
                        w[i + 16] = d * (float)(q >> 4) + mn;
                    } else {
                        w[i] = d * (float)((q & 15) - 8);
                        w[i + 16] = d * (float)((q >> 4) - 8);
                    }
                }
            }
        }
    return 0;
}

/* The same values transposed, out[k * N + n] (W^T, [K, N]): the layout a panel decodes into without a
   transpose (a panel block's code byte i of its 8 rows is one vector), for the batches of a float32 layer
   that keeps only its panels (x @ W^T by the BLAS). The operations of gguf_panel_dequant. */
int gguf_panel_dequant_t(int qtype, const uint8_t *packed, int64_t N, int64_t K, float *out) {
#if defined(HAS_PANELS)
    const int ts = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
    if (!ts || N % 8 || K % 32) return -1;
    const int with_min = qtype == Q4_1, codes_at = with_min ? 32 : 16;
    const int64_t nb = K / 32;
    const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int64_t p = 0; p < N / 8; p++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pb = packed + (p * nb + b) * 8 * ts, *codes = pb + codes_at;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb));
            const __m256 mn = with_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16))) : _mm256_setzero_ps();
            float *w = out + 32 * b * N + 8 * p;
            if (qtype == Q8_0) {
                for (int i = 0; i < 32; i++)
                    _mm256_storeu_ps(w + i * N, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(codes + 8 * i)))), d));
                continue;
            }
            for (int i = 0; i < 16; i++) {
                const __m256i v = U8X8(codes + 8 * i);
                __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);
                if (with_min) {
                    _mm256_storeu_ps(w + i * N, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), mn));
                    _mm256_storeu_ps(w + (i + 16) * N, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)), mn));
                } else {
                    _mm256_storeu_ps(w + i * N, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, eight))));
                    _mm256_storeu_ps(w + (i + 16) * N, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, eight))));
                }
            }
        }
    return 0;
#else
    (void)qtype; (void)packed; (void)N; (void)K; (void)out;
    return -1;
#endif
}

/* out[m, n] = sum_k x[m, k] W[n, k] for float32 x [M, K] (M <= 8) and W in panels; -1 where
   gguf_has_panels(qtype) is 0 or the shapes do not fit (N % 8, K % 32, K <= 32768). */
int gguf_panel_gemv(int qtype, const uint8_t *packed, int64_t N, int64_t K, const float *x, int M, float *out,
                    int64_t out_stride, int num_threads) {
#if defined(HAS_PANELS)
    if (!gguf_has_panels(qtype) || N % 8 || K % 32 || K / 32 > 1024 || M < 1 || M > 8) return -1;
    const int64_t nb = K / 32;
    float xsum[8 * 1024];  /* Q4_1: each block's sum of x, in a fixed order */
    if (qtype == Q4_1)
        _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + m * K + b * 32;
                xsum[m * nb + b] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                                       _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
            }
    OVER_ROW_PARTS(N, num_threads, panel_rows(qtype, packed, n0 / 8, n1 / 8, K, x, xsum, M, out, out_stride));
    return 0;
#else
    (void)qtype; (void)packed; (void)N; (void)K; (void)x; (void)M; (void)out; (void)out_stride; (void)num_threads;
    return -1;
#endif
}
