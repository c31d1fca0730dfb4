// AVX-512-BF16 copy of the prefill attention only: the same kernel with its inner products in vdpbf16ps (16 lanes
// x 2 bf16 products per instruction, twice the fp32 FMA rate).
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace vls_avx512bf16 {
#include "isa_avx512.h"
#include "math_impl.h"
static inline void vstoreT(uint16_t* p, vf a, bool) { vstore_bf16(p, vround_bf16(a)); }
#define VLS_DPBF16
#include "attention_impl.h"
#undef VLS_DPBF16
}  // namespace vls_avx512bf16
#pragma GCC pop_options
