// Which ISA copy of the kernels this CPU runs (0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 with bf16 dot products),
// and the best one at most the caller's cap (VLSERVE_CPU_ISA, read on the Python side).
#pragma once
#include <algorithm>
#include <cstdint>

namespace {

inline int cpu_isa() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512bf16") ? 3 : 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

inline int pick(int64_t cap) { return static_cast<int>(std::min<int64_t>(cap, cpu_isa())); }

}  // namespace
