// int8 x int8 decode linears (see kernels_int8_dot.cpp): the activations quantized in blocks of 32, then the rows
// of the weight split over torch's threads.
#include "int8_dot.h"

#include <ATen/Parallel.h>

#include "cpu_isa.h"
#include "kernels.h"

int64_t int8_dot_isa(int64_t cap) {
    const int isa = pick(cap);
    if (isa >= 2 && __builtin_cpu_supports("avx512vnni")) return 2;
    return isa >= 1 ? 1 : 0;
}

torch::Tensor int8_dot_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t cap) {
    TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() && q.scalar_type() == torch::kChar,
                "int8_dot_linear: a contiguous 2-D int8 CPU weight");
    const long N = q.size(0), K = q.size(1);
    TORCH_CHECK(x.device().is_cpu() && scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == N &&
                    scale.scalar_type() == torch::kFloat, "int8_dot_linear: CPU tensors, one fp32 scale per row");
    TORCH_CHECK(x.size(-1) == K && K % 32 == 0 && N % 4 == 0, "int8_dot_linear: N % 4, K % 32 or K mismatch");
    const int64_t isa = int8_dot_isa(cap);
    TORCH_CHECK(isa > 0, "int8_dot_linear: no int8 dot products on this CPU (or under this ISA cap)");
    auto xf = x.reshape({-1, K}).to(torch::kFloat).contiguous();
    const long M = xf.size(0);
    auto codes = torch::empty({M, K}, xf.options().dtype(torch::kChar));
    auto xs = torch::empty({M, K / 32}, xf.options());
    auto y = torch::empty({M, N}, xf.options());
    int8_t* cp = codes.data_ptr<int8_t>();
    float *xsp = xs.data_ptr<float>(), *yp = y.data_ptr<float>();
    const float* sp = scale.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    if (isa == 2) vls_avx512vnni::quantize_blocks(xf.data_ptr<float>(), M, K, cp, xsp);
    else vls_avx2::quantize_blocks(xf.data_ptr<float>(), M, K, cp, xsp);
    at::parallel_for(0, N / 4, 8, [&](int64_t b, int64_t e) {
        if (isa == 2) vls_avx512vnni::int8_dot_rows(cp, xsp, M, K, qp, sp, yp, N, b * 4, e * 4);
        else vls_avx2::int8_dot_rows(cp, xsp, M, K, qp, sp, yp, N, b * 4, e * 4);
    });
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return y.to(x.scalar_type()).view(sizes);
}
