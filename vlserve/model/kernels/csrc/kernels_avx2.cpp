// AVX2 + FMA copy of the kernels (8 fp32 lanes, 16 vector registers: small register tiles).
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vls_avx2 {
namespace {
constexpr long W = 8;
constexpr int MB_I8 = 2, NB_I8 = 4, MB_I4 = 1, NB_I4 = 2, MB_ATT = 4, NB_ATT = 2, MB_ATTV = 2;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline void vsum4(vf a, vf b, vf c, vf d, float* out) {
    vf h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline vf vload_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vload_u4(const uint8_t* p, vf& lo, vf& hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vround_bf16(vf a) {
    __m256i b = _mm256_castps_si256(a);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore_bf16(uint16_t* p, vf a) {
    __m256i w = _mm256_srli_epi32(_mm256_castps_si256(a), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);  // 8 x u16 in the low 128 bits
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vf vload_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vhmax(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
// for vexp (kernels_impl.h): nearest integer, 2^n for integral n in [-126, 127], zero where x < lo
inline vf vround_int(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vzero_below(vf v, vf x, float lo) { return _mm256_and_ps(v, _mm256_cmp_ps(x, vset1(lo), _CMP_GE_OQ)); }
}  // namespace
#include "math_impl.h"
#include "kernels_impl.h"
#include "attention_impl.h"
}  // namespace vls_avx2
#pragma GCC pop_options
