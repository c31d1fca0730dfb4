// The AVX-512 vector vocabulary of the kernels (16 fp32 lanes, 32 vector registers: larger register tiles), shared
// by the AVX-512 copy and the AVX-512-BF16 one. Included inside each copy's namespace, under its target pragma.
namespace {
constexpr long W = 16;
constexpr int MB_I8 = 4, NB_I8 = 4, MB_I4 = 2, NB_I4 = 4, MB_ATT = 4, NB_ATT = 4, MB_ATTV = 4;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
// the four horizontal sums of a, b, c, d at once (a transpose-and-add tree instead of four reductions)
inline void vsum4(vf a, vf b, vf c, vf d, float* out) {
    vf ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    vf cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    vf x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, x);
    out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
inline vf vload_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vload_u4(const uint8_t* p, vf& lo, vf& hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
// fp32 -> the nearest bf16 (ties to even), still as fp32 (low 16 bits zero); NaN payloads are not preserved
inline vf vround_bf16(vf a) {
    __m512i b = _mm512_castps_si512(a);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore_bf16(uint16_t* p, vf a) {  // a already rounded: truncation is exact
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a), 16)));
}
inline vf vload_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
// for vexp (kernels_impl.h): nearest integer, 2^n for integral n in [-126, 127], zero where x < lo
inline vf vround_int(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) { return _mm512_scalef_ps(vset1(1.f), n); }
inline vf vzero_below(vf v, vf x, float lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(lo), _CMP_GE_OQ), v); }
}  // namespace
