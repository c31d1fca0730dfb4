// Torch entry points of the int8 x int8 decode linears (int8_dot.cpp; kernels in kernels_int8_dot.cpp).
#pragma once
#include <torch/extension.h>

// 2: AVX-512 VNNI dot products, 1: AVX2 byte products, 0: none here (the caller keeps fp32 activations)
int64_t int8_dot_isa(int64_t cap);
// x [..., K] fp32 or bf16 quantized in blocks of 32, q [N, K] int8 interleaved by 4 rows, scale [N] fp32 ->
// [..., N] in x's dtype (K a multiple of 32, N of 4)
torch::Tensor int8_dot_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t cap);
