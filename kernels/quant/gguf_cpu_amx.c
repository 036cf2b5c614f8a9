/* Batches on GGUF block rows without a dense copy of the weight: AMX bf16 tiles.
 *
 * Built at first use by gguf_cpu_native.py (its flags, cached) and called through
 * ctypes. One entry point:
 *
 *   gguf_amx_linear: out[m, n] = sum_k x[m, k] * W[n, k] for any number M of bf16 rows of x, with W
 *                    given as llama.cpp block rows. W is decoded a tile of rows at a time into bf16
 *                    (by the caller's decoder: gguf_cpu_kernels.c's gguf_dequant_bf16, the exactly
 *                    dequantized float32 values rounded to nearest even, as a bf16 dense copy holds
 *                    them), rearranged into AMX's pair-interleaved B layout in L2, and multiplied by
 *                    x with TDPBF16PS (bf16 products, exact in float32, float32 sums), so the weight
 *                    is read from memory once per call in its block bytes and decoded once per call.
 *
 * The products are those of a bf16 dense copy of the dequantized weight (the same bf16 values
 * times the same bf16 x); only the order of the float32 sums differs from oneDNN's (as between any
 * two GEMMs). Outputs: float32, or bf16 rounded to nearest even from the float32 sums.
 *
 * Threads split the weight's row tiles; each has its own decode scratch. The first call asks Linux
 * for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), as oneDNN does; gguf_amx_available()
 * says 0 where the CPU, the kernel or this build has no AMX.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef int (*dequant_bf16_fn)(int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K,
                               uint16_t *out, int num_threads);

#if defined(HAS_AMX)

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {  /* every tile 16 rows of 64 bytes: C 16 x 16 float32, A 16 x 32 bf16, B 16 x 32 bf16 */
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    __asm__ volatile("" : : "m"(config) : "memory");  /* gcc 12 may drop the stores above as dead otherwise */
    _tile_loadconfig(&config);
}

/* A 16 x 16 transpose of 32-bit words: out row p (out_stride words apart) = word p of in rows 0..15
   (in_stride words apart). On bf16 rows a word is a pair of consecutive k: rows of x become AMX's
   pair-interleaved B tile (B[p][2 m + j] = x[m][2 p + j]); on a float32 C tile, its transpose. */
static inline void transpose16(const uint32_t *in, int64_t in_stride, uint32_t *out, int64_t out_stride) {
    __m512i r[16], t[16];
    for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512((const void *)(in + n * in_stride));
    for (int n = 0; n < 16; n += 2) {
        t[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
        t[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
    }
    for (int n = 0; n < 16; n += 4) {
        r[n] = _mm512_unpacklo_epi64(t[n], t[n + 2]);
        r[n + 1] = _mm512_unpackhi_epi64(t[n], t[n + 2]);
        r[n + 2] = _mm512_unpacklo_epi64(t[n + 1], t[n + 3]);
        r[n + 3] = _mm512_unpackhi_epi64(t[n + 1], t[n + 3]);
    }
    /* r[4 q + i] holds, in its 128-bit lane L, word 4 L + i of rows 4 q .. 4 q + 3: lane L of r[i],
       r[4 + i], r[8 + i], r[12 + i] side by side is out row 4 L + i */
    for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x44);  /* lanes 0, 1 of each */
        const __m512i b = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x44);
        const __m512i c = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xEE);  /* lanes 2, 3 */
        const __m512i d = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xEE);
        _mm512_storeu_si512((void *)(out + (0 + i) * out_stride), _mm512_shuffle_i32x4(a, b, 0x88));
        _mm512_storeu_si512((void *)(out + (4 + i) * out_stride), _mm512_shuffle_i32x4(a, b, 0xDD));
        _mm512_storeu_si512((void *)(out + (8 + i) * out_stride), _mm512_shuffle_i32x4(c, d, 0x88));
        _mm512_storeu_si512((void *)(out + (12 + i) * out_stride), _mm512_shuffle_i32x4(c, d, 0xDD));
    }
}

/* A C tile (16 output columns n0.. x 16 rows of x m0.., float32) into out, only its first num_m rows. */
static inline void store_sums(const float *sums, void *out, int64_t out_stride, int out_bf16, int64_t m0,
                              int64_t num_m, int64_t n0) {
    float rows[256];
    transpose16((const uint32_t *)sums, 16, (uint32_t *)rows, 16);
    for (int64_t m = 0; m < num_m; m++) {
        const __m512 row = _mm512_loadu_ps(rows + m * 16);
        if (out_bf16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (m0 + m) * out_stride + n0),
                                (__m256i)_mm512_cvtneps_pbh(row));
        } else {
            _mm512_storeu_ps((float *)out + (m0 + m) * out_stride + n0, row);
        }
    }
}

/* A buffer of at least `bytes`, kept per thread for the next calls (a fresh one each call would be
   mapped anew and its pages faulted in every time). */
static uint16_t *thread_buffer(int which, size_t bytes) {
    static __thread uint16_t *buffers[2];
    static __thread size_t sizes[2];
    if (sizes[which] < bytes) {
        free(buffers[which]);
        buffers[which] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        sizes[which] = buffers[which] == NULL ? 0 : bytes;
    }
    return buffers[which];
}

/* Output columns [n0, n1) for all M rows of x, from x_pairs (x as B tiles: [M / 16][K / 32][512]).
   The decoded rows sit `ldw` bf16 apart (K plus a cache line: rows 4 KiB apart would share L1 sets). */
static void tile_rows(dequant_bf16_fn dequant, int qtype, const uint8_t *data, int64_t row_stride, int64_t n0,
                      int64_t n1, int64_t K, const uint16_t *x_pairs, int64_t M, void *out, int64_t out_stride,
                      int out_bf16, uint16_t *decoded) {
    const int64_t num_rows = n1 - n0, padded_rows = (num_rows + 31) / 32 * 32, num_k = K / 32, ldw = K + 32;
    for (int64_t n = 0; n < num_rows; n++) dequant(qtype, data + (n0 + n) * row_stride, row_stride, 1, K, decoded + n * ldw, 1);
    for (int64_t n = num_rows; n < padded_rows; n++) memset(decoded + n * ldw, 0, (size_t)K * 2);
    float sums[4][256];
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const uint16_t *b0 = x_pairs + (m0 / 16) * num_k * 512, *b1 = b0 + num_k * 512;
        for (int64_t nb = 0; nb < padded_rows; nb += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t *a0 = decoded + nb * ldw, *a1 = a0 + 16 * ldw;
            for (int64_t kb = 0; kb < num_k; kb++) {
                _tile_loadd(4, a0 + kb * 32, ldw * 2);
                _tile_loadd(5, a1 + kb * 32, ldw * 2);
                _tile_loadd(6, b0 + kb * 512, 64);
                _tile_loadd(7, b1 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
            const int64_t rows0 = M - m0 < 16 ? M - m0 : 16, rows1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
            const int64_t col0 = n0 + nb, col1 = col0 + 16;
            if (col0 < n1) store_sums(sums[0], out, out_stride, out_bf16, m0, rows0, col0);
            if (rows1 > 0 && col0 < n1) store_sums(sums[1], out, out_stride, out_bf16, m0 + 16, rows1, col0);
            if (col1 < n1) store_sums(sums[2], out, out_stride, out_bf16, m0, rows0, col1);
            if (rows1 > 0 && col1 < n1) store_sums(sums[3], out, out_stride, out_bf16, m0 + 16, rows1, col1);
        }
    }
}

#endif

int gguf_amx_available(void) {
#if defined(HAS_AMX)
    static int state = 0;  /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
#else
    return 0;
#endif
}

/* out[M, N] (row stride out_stride; float32, or bf16 if out_bf16) = x[M, K] (bf16, row stride x_stride)
   times the block rows `data` [N, row_stride bytes] decoded `tile_rows` (a multiple of 32) rows at a time
   by `dequant`. N must be a multiple of 16 and K of 32. Returns 0, or -1 without AMX, -2 on bad sizes,
   -3 when memory runs out. */
int gguf_amx_linear(dequant_bf16_fn dequant, int qtype, const uint8_t *data, int64_t row_stride, int64_t N, int64_t K,
                    const uint16_t *x, int64_t x_stride, int64_t M, void *out, int64_t out_stride, int out_bf16,
                    int64_t tile_rows_count, int num_threads) {
#if defined(HAS_AMX)
    if (!gguf_amx_available()) return -1;
    if (K % 32 || N % 16 || x_stride % 2 || tile_rows_count % 32 || tile_rows_count <= 0 || M <= 0) return -2;
    /* x as B tiles, 32-row blocks (zero rows after M): made once, read by every thread. Up to 2 MiB
       kept for the next call (decode steps of many sequences); a prefill's larger copy is freed. */
    const int64_t padded_m = (M + 31) / 32 * 32, num_k = K / 32;
    const size_t pairs_bytes = (size_t)(padded_m * K) * 2;
    const int keep = pairs_bytes <= (2u << 20);
    uint16_t *x_pairs = keep ? thread_buffer(1, pairs_bytes) : aligned_alloc(64, pairs_bytes);
    if (x_pairs == NULL) return -3;
    uint32_t tail[16 * 16];
    for (int64_t mb = 0; mb < padded_m / 16; mb++) {
        const int64_t num_m = M - mb * 16 < 16 ? (M - mb * 16 > 0 ? M - mb * 16 : 0) : 16;
        for (int64_t kb = 0; kb < num_k; kb++) {
            uint32_t *tile = (uint32_t *)(x_pairs + (mb * num_k + kb) * 512);
            if (num_m == 16) {
                transpose16((const uint32_t *)(x + mb * 16 * x_stride + kb * 32), x_stride / 2, tile, 16);
            } else {
                memset(tail, 0, sizeof tail);
                for (int64_t m = 0; m < num_m; m++) memcpy(tail + m * 16, x + (mb * 16 + m) * x_stride + kb * 32, 64);
                transpose16(tail, 16, tile, 16);
            }
        }
    }
    const int64_t num_tiles = (N + tile_rows_count - 1) / tile_rows_count;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_tiles) num_threads = (int)num_tiles;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        uint16_t *decoded = thread_buffer(0, (size_t)(tile_rows_count * (K + 32)) * 2);
        if (decoded == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        int any_failed;
        #pragma omp atomic read
        any_failed = failed;
        if (!any_failed) {  /* every thread sees the same answer: all run the loop or none */
            configure_tiles();
            #pragma omp for schedule(static)
            for (int64_t tile = 0; tile < num_tiles; tile++) {
                const int64_t n0 = tile * tile_rows_count, n1 = n0 + tile_rows_count < N ? n0 + tile_rows_count : N;
                tile_rows(dequant, qtype, data, row_stride, n0, n1, K, x_pairs, M, out, out_stride, out_bf16, decoded);
            }
            _tile_release();
        }
    }
    if (!keep) free(x_pairs);
    return failed ? -3 : 0;
#else
    (void)dequant; (void)qtype; (void)data; (void)row_stride; (void)N; (void)K; (void)x; (void)x_stride; (void)M;
    (void)out; (void)out_stride; (void)out_bf16; (void)tile_rows_count; (void)num_threads;
    return -1;
#endif
}
