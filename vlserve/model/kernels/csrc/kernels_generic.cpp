// Portable copy of the kernels: one lane, plain C++ (for CPUs without AVX2; the compiler may still vectorise).
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace vls_generic {
namespace {
constexpr long W = 1;
constexpr int MB_I8 = 1, NB_I8 = 4, MB_I4 = 1, NB_I4 = 2, MB_ATT = 1, NB_ATT = 4, MB_ATTV = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset1(float a) { return a; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf a) { *p = a; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline float vsum(vf a) { return a; }
inline void vsum4(vf a, vf b, vf c, vf d, float* out) { out[0] = a, out[1] = b, out[2] = c, out[3] = d; }
inline vf vload_i8(const int8_t* p) { return static_cast<float>(*p); }
inline void vload_u4(const uint8_t* p, vf& lo, vf& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
}
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vround_bf16(vf a) {
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(&a, &bits, sizeof a);
    return a;
}
inline void vstore_bf16(uint16_t* p, vf a) {
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    *p = static_cast<uint16_t>(bits >> 16);
}
inline vf vload_bf16(const uint16_t* p) {
    uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float vhmax(vf a) { return a; }
inline vf vround_int(vf a) { return __builtin_nearbyintf(a); }
inline vf vpow2i(vf n) { return __builtin_ldexpf(1.f, static_cast<int>(n)); }
inline vf vzero_below(vf v, vf x, float lo) { return x >= lo ? v : 0.f; }
}  // namespace
#include "math_impl.h"
#include "kernels_impl.h"
#include "attention_impl.h"
}  // namespace vls_generic
