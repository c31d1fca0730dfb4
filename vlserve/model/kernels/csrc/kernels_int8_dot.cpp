// int8 x int8 decode linears: the activations quantized in blocks of 32 values (one fp32 scale each, as llama.cpp's
// Q8_0 does for its dot products), the weights' int8 codes multiplied by them as bytes. The fp32-activation kernel
// (kernels_impl.h, int8_rows) spends three vector instructions on every 16 weight bytes (widen, convert, FMA) and
// is limited by them, not by memory, on a 2-core machine (5.7 GB/s a core measured); here 64 weight bytes take
// about four, so a decode step streams its weights at the memory's rate.
//
// Signed bytes times signed bytes: the instructions take one unsigned operand, so the weight's magnitude is that
// operand and the activation takes the weight's sign (both within +-127, so no sum saturates: a pair is at most
// 2 x 127 x 127 = 32258 where AVX2 adds pairs in 16 bits). Weights are interleaved by 4 rows as for int8_rows
// (kernels_impl.h): one 64-byte line holds 16 values of 4 rows, one 128-bit lane each, so the activations' 16 bytes
// are broadcast to the four lanes and lane group j of the int32 sums belongs to row j.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace {
constexpr long DOT_BLOCK = 32;  // activation values per scale
// Prefetch distance in weight bytes (hardware prefetch alone lags). AVX-512 VNNI: 1 KiB, measured with the
// weights in huge pages (model/huge_pages.py) on an Intel Xeon VM: 182 MB of decode GEMVs at 22 GB/s against
// 18-20 with 2 KiB, batch-1 decode faster in 6 of 8 alternating runs. AVX2: 2 KiB, as int8_rows (not measured on
// an AVX2-only CPU since).
constexpr long DOT_AHEAD_AVX512 = 1024, DOT_AHEAD_AVX2 = 2048;
template <long AHEAD>
inline void dot_prefetch(const int8_t* p) { __builtin_prefetch(p + AHEAD); }
// 127 / a block's largest magnitude; 0 for a block of zeros, a bad block (NaN or infinity: its scale is NaN), and
// one so small that the inverse overflows (below 127 / FLT_MAX: its codes would all saturate; its values are
// below 4e-37, so zeros lose nothing)
inline float block_inverse(float amax, bool bad) {
    const float inv = 127.f / amax;
    return bad || !(inv <= 3.4028235e38f) ? 0.f : inv;
}
// the scalar ends of a row past its last whole vector (row_absmax, quantize_row: the same in both copies)
inline void absmax_tail(const float* x, long k, long K, float& amax, bool& nan) {
    for (; k < K; k++) {
        const float a = __builtin_fabsf(x[k]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
}
inline void quantize_tail(const float* x, long k, long K, float divisor, float top, int8_t* out) {
    for (; k < K; k++) {
        const float q = __builtin_nearbyintf(x[k] / divisor);
        out[k] = static_cast<int8_t>(q > top ? top : q < -top ? -top : q == q ? q : 0.f);
    }
}
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
namespace vls_avx512vnni {

// x [M, K] fp32 -> codes [M, K] int8 and scales [M, K / 32]: each block's largest magnitude becomes 127 (x times
// 127 / max, rounded half to even); a block holding a NaN or an infinity gets a NaN scale and zero codes.
void quantize_blocks(const float* x, long M, long K, int8_t* codes, float* scales) {
    const __m512 sign = _mm512_set1_ps(-0.f), big = _mm512_set1_ps(3.4028235e38f);
    for (long r = 0; r < M * (K / DOT_BLOCK); r++) {
        const float* p = x + r * DOT_BLOCK;
        const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
        const __m512 aa = _mm512_andnot_ps(sign, a), ab = _mm512_andnot_ps(sign, b);
        const bool bad = _mm512_cmp_ps_mask(aa, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(ab, big, _CMP_NLE_UQ);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
        const float inv = block_inverse(amax, bad);
        scales[r] = bad ? __builtin_nanf("") : amax / 127.f;
        const __m512 s = _mm512_set1_ps(inv);
        const __mmask16 keep = bad ? 0 : 0xFFFF;  // a bad block's codes are zeros (its values times 0 are NaN)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * DOT_BLOCK),
                         _mm512_cvtsepi32_epi8(_mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(a, s))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * DOT_BLOCK + 16),
                         _mm512_cvtsepi32_epi8(_mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(b, s))));
    }
}

template <int MB>
static inline void dot_tile(const int8_t* xq, const float* xs, long K, const int8_t* tile, const float* scale,
                            float* y, long N, long m, long n) {
    const long blocks = K / DOT_BLOCK;
    const __m512i zero = _mm512_setzero_si512();
    __m512 total[MB];
    for (int i = 0; i < MB; i++) total[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i acc[MB];
        for (int i = 0; i < MB; i++) acc[i] = zero;
        for (long k = b * DOT_BLOCK; k < (b + 1) * DOT_BLOCK; k += 16) {
            const int8_t* line = tile + k * 4;
            dot_prefetch<DOT_AHEAD_AVX512>(line);
            const __m512i w = _mm512_loadu_si512(line);
            const __m512i magnitude = _mm512_abs_epi8(w);
            const __mmask64 negative = _mm512_movepi8_mask(w);
            for (int i = 0; i < MB; i++) {
                const __m512i xv = _mm512_broadcast_i32x4(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + (m + i) * K + k)));
                acc[i] = _mm512_dpbusd_epi32(acc[i], magnitude, _mm512_mask_sub_epi8(xv, negative, zero, xv));
            }
        }
        for (int i = 0; i < MB; i++)
            total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(xs[(m + i) * blocks + b]), total[i]);
    }
    for (int i = 0; i < MB; i++) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, total[i]);
        for (int j = 0; j < 4; j++) {
            const float* l = lanes + 4 * j;
            y[(m + i) * N + n + j] = (((l[0] + l[1]) + l[2]) + l[3]) * scale[n + j];
        }
    }
}

void int8_dot_rows(const int8_t* xq, const float* xs, long M, long K, const int8_t* q, const float* scale, float* y,
                   long N, long n0, long n1) {
    for (long n = n0; n < n1; n += 4) {
        const int8_t* tile = q + n * K;
        long m = 0;
        for (; m + 4 <= M; m += 4) dot_tile<4>(xq, xs, K, tile, scale, y, N, m, n);
        for (; m < M; m++) dot_tile<1>(xq, xs, K, tile, scale, y, N, m, n);
    }
}


// One row of the int8 GEMMs' per-row quantization (ops.cpp quantize_rows): its largest magnitude (and whether it
// holds a NaN), then codes = nearbyint(x / divisor) within +-top, NaN -> 0. Division and rounding as the scalar
// code and torch's passes do them (an IEEE division, ties to even), so the codes are the same bit for bit.
float row_absmax(const float* x, long K, bool* nan) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    __m512 top = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 a = _mm512_andnot_ps(sign, _mm512_loadu_ps(x + k));
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, a);
    }
    float amax = _mm512_reduce_max_ps(top);
    bool any_nan = unordered != 0;
    absmax_tail(x, k, K, amax, any_nan);
    *nan = any_nan;
    return amax;
}

void quantize_row(const float* x, long K, float divisor, float top, int8_t* out) {
    const __m512 d = _mm512_set1_ps(divisor), hi = _mm512_set1_ps(top), lo = _mm512_set1_ps(-top);
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + k), d);
        q = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), q);  // NaN -> 0
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
    }
    quantize_tail(x, k, K, divisor, top, out);
}

}  // namespace vls_avx512vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vls_avx2 {

void quantize_blocks(const float* x, long M, long K, int8_t* codes, float* scales) {
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(3.4028235e38f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long r = 0; r < M * (K / DOT_BLOCK); r++) {
        const float* p = x + r * DOT_BLOCK;
        __m256 v[4], top = _mm256_setzero_ps();
        int bad = 0;
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(p + 8 * c);
            const __m256 a = _mm256_andnot_ps(sign, v[c]);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));
            top = _mm256_max_ps(top, a);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_movehdup_ps(t));
        const float amax = _mm_cvtss_f32(t);
        const float inv = block_inverse(amax, bad);
        scales[r] = bad ? __builtin_nanf("") : amax / 127.f;
        const __m256 s = _mm256_set1_ps(inv);
        __m256i c[4];
        for (int j = 0; j < 4; j++)  // a bad block's codes are zeros (its values times 0 are NaN)
            c[j] = bad ? _mm256_setzero_si256() : _mm256_cvtps_epi32(_mm256_mul_ps(v[j], s));
        // two packs interleave the 128-bit lanes: 4-byte groups come out as c0 c1 c2 c3 (low halves), then the
        // high halves; the permute puts each vector's 8 bytes back together
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + r * DOT_BLOCK),
                            _mm256_permutevar8x32_epi32(packed, order));
    }
}

// 16 vector registers: a 64-byte line is two halves of 2 weight rows each, so each row of x keeps two int32 and
// two fp32 accumulators; two rows of x at a time.
template <int MB>
static inline void dot_tile(const int8_t* xq, const float* xs, long K, const int8_t* tile, const float* scale,
                            float* y, long N, long m, long n) {
    const long blocks = K / DOT_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total[MB][2];
    for (int i = 0; i < MB; i++) total[i][0] = total[i][1] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i acc[MB][2];
        for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (long k = b * DOT_BLOCK; k < (b + 1) * DOT_BLOCK; k += 16) {
            const int8_t* line = tile + k * 4;
            dot_prefetch<DOT_AHEAD_AVX2>(line);
            __m128i xk[MB];
            for (int i = 0; i < MB; i++)
                xk[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + (m + i) * K + k));
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
                const __m256i magnitude = _mm256_abs_epi8(w);
                for (int i = 0; i < MB; i++) {
                    const __m256i signed_x = _mm256_sign_epi8(_mm256_broadcastsi128_si256(xk[i]), w);
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
                    acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int i = 0; i < MB; i++) {
            const __m256 s = _mm256_set1_ps(xs[(m + i) * blocks + b]);
            for (int h = 0; h < 2; h++) total[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), s, total[i][h]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int h = 0; h < 2; h++) {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, total[i][h]);
            for (int j = 0; j < 2; j++) {
                const float* l = lanes + 4 * j;
                const long row = n + 2 * h + j;
                y[(m + i) * N + row] = (((l[0] + l[1]) + l[2]) + l[3]) * scale[row];
            }
        }
}

void int8_dot_rows(const int8_t* xq, const float* xs, long M, long K, const int8_t* q, const float* scale, float* y,
                   long N, long n0, long n1) {
    for (long n = n0; n < n1; n += 4) {
        const int8_t* tile = q + n * K;
        long m = 0;
        for (; m + 2 <= M; m += 2) dot_tile<2>(xq, xs, K, tile, scale, y, N, m, n);
        for (; m < M; m++) dot_tile<1>(xq, xs, K, tile, scale, y, N, m, n);
    }
}


float row_absmax(const float* x, long K, bool* nan) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 top = _mm256_setzero_ps();
    int unordered = 0;
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, a);
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    float amax = _mm_cvtss_f32(t);
    bool any_nan = unordered != 0;
    absmax_tail(x, k, K, amax, any_nan);
    *nan = any_nan;
    return amax;
}

void quantize_row(const float* x, long K, float divisor, float top, int8_t* out) {
    const __m256 d = _mm256_set1_ps(divisor), hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + k), d);
        q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q));  // NaN -> 0
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
        const __m256i c = _mm256_cvtps_epi32(q);  // within +-127: the packs below do not saturate
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(w, w));
    }
    quantize_tail(x, k, K, divisor, top, out);
}

}  // namespace vls_avx2
#pragma GCC pop_options
