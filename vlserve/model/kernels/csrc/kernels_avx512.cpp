// AVX-512 copy of the kernels (16 fp32 lanes, 32 vector registers: larger register tiles).
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace vls_avx512 {
#include "isa_avx512.h"
#include "math_impl.h"
#include "kernels_impl.h"
#include "attention_impl.h"
}  // namespace vls_avx512
#pragma GCC pop_options
