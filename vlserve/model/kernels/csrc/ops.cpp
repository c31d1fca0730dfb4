// Torch entry points of vlserve's CPU kernels: weight-only int8 / int4 linears for small row counts (decode) and
// paged decode attention that reads the KV cache in place. Each picks the best ISA copy this CPU runs, capped by
// the caller's `isa` (0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 with bf16 dot products), and splits its work over
// torch's threads.
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include <torch/extension.h>

#include "cpu_isa.h"
#include "int8_dot.h"
#include "kernels.h"

namespace {

#define VLS_DISPATCH(isa, fn, ...)                                 \
    do {                                                           \
        if ((isa) >= 2) vls_avx512::fn(__VA_ARGS__);               \
        else if ((isa) == 1) vls_avx2::fn(__VA_ARGS__);            \
        else vls_generic::fn(__VA_ARGS__);                         \
    } while (0)

torch::Tensor as_f32(const torch::Tensor& x) { return x.to(torch::kFloat).contiguous(); }

void check_2d(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous 2-D CPU tensor");
}

// x [M, K] (fp32 or bf16), q [N, K] int8 interleaved by 4 rows (kernels_impl.h), scale [N] fp32 -> [M, N] in x's
// dtype (N a multiple of 4, K of 16)
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t cap) {
    check_2d(q, "q");
    TORCH_CHECK(q.scalar_type() == torch::kChar && scale.scalar_type() == torch::kFloat, "int8 weights, fp32 scales");
    const long N = q.size(0), K = q.size(1);
    TORCH_CHECK(x.device().is_cpu() && scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == N,
                "int8_linear: CPU tensors, one scale per output row");
    TORCH_CHECK(x.size(-1) == K && K % 16 == 0 && N % 4 == 0, "int8_linear: N % 4, K % 16 or K mismatch");
    auto xf = as_f32(x.reshape({-1, K}));
    const long M = xf.size(0);
    auto y = torch::empty({M, N}, xf.options());
    const int isa = pick(cap);
    const float *xp = xf.data_ptr<float>(), *sp = scale.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N / 4, 8, [&](int64_t b, int64_t e) {
        VLS_DISPATCH(isa, int8_rows, xp, M, K, qp, sp, yp, N, b * 4, e * 4);
    });
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return y.to(x.scalar_type()).view(sizes);
}

// Per-row symmetric quantization for int8 x int8 GEMMs: x [M, K] fp32 or bf16 -> (codes [M, K] int8, scales [M, 1]
// fp32). Each row's largest magnitude becomes `top` (127, or 63 where 8-bit products would saturate); the same
// arithmetic as the torch fallback (fp32 division, rounding half to even), so both give the same codes.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t top, int64_t cap) {
    check_2d(x, "x");
    TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "quantize_rows: fp32 or bf16");
    TORCH_CHECK(1 <= top && top <= 127, "quantize_rows: top in [1, 127]");
    const long M = x.size(0), K = x.size(1);
    auto codes = torch::empty({M, K}, x.options().dtype(torch::kChar));
    auto scales = torch::empty({M, 1}, x.options().dtype(torch::kFloat));
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    const void* xp = x.data_ptr();
    int8_t* cp = codes.data_ptr<int8_t>();
    float* sp = scales.data_ptr<float>();
    const float t = static_cast<float>(top), tiny = std::numeric_limits<float>::min();
    const int64_t vector = int8_dot_isa(cap);  // the vector copies beside the dot products (the same arithmetic)
    at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
        std::vector<float> row(K);
        for (int64_t m = b; m < e; m++) {
            if (bf16) {
                const uint16_t* src = static_cast<const uint16_t*>(xp) + m * K;
                for (long k = 0; k < K; k++) {
                    const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
                    std::memcpy(&row[k], &bits, 4);
                }
            } else {
                std::memcpy(row.data(), static_cast<const float*>(xp) + m * K, K * sizeof(float));
            }
            float amax = 0.f;
            bool nan = false;
            if (vector == 2) amax = vls_avx512vnni::row_absmax(row.data(), K, &nan);
            else if (vector == 1) amax = vls_avx2::row_absmax(row.data(), K, &nan);
            else
                for (long k = 0; k < K; k++) {
                    const float a = std::fabs(row[k]);
                    nan |= a != a;
                    amax = std::max(amax, a);
                }
            // a NaN makes the scale NaN (the row's outputs NaN, as in the float layer); the stored scale is the one
            // divided by (a row below FLT_MIN * top would otherwise come back smaller than it went in)
            const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax / t, tiny);
            const float divisor = scale;
            sp[m] = scale;
            int8_t* out = cp + m * K;
            if (vector == 2) vls_avx512vnni::quantize_row(row.data(), K, divisor, t, out);
            else if (vector == 1) vls_avx2::quantize_row(row.data(), K, divisor, t, out);
            else
                for (long k = 0; k < K; k++) {
                    const float q = std::nearbyint(row[k] / divisor);  // the default rounding mode: half to even
                    out[k] = static_cast<int8_t>(q > t ? t : q < -t ? -t : q == q ? q : 0.f);
                }
        }
    });
    return {codes, scales};
}

// int32 products acc [M, N] (any strides: the 7-bit path's is a transposed view), row_scale [M] and col_scale [N]
// fp32 -> acc * row_scale * col_scale as `dtype` (fp32 or bf16) [M, N], in one pass (the torch fallback's three
// passes, the same two fp32 products in the same order).
torch::Tensor scale_products(const torch::Tensor& acc, const torch::Tensor& row_scale, const torch::Tensor& col_scale,
                             at::ScalarType dtype) {
    TORCH_CHECK(acc.dim() == 2 && acc.device().is_cpu() && acc.scalar_type() == torch::kInt, "scale_products: int32 2-D");
    TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "scale_products: fp32 or bf16 out");
    const long M = acc.size(0), N = acc.size(1), sm = acc.stride(0), sn = acc.stride(1);
    TORCH_CHECK(row_scale.is_contiguous() && row_scale.numel() == M && col_scale.is_contiguous() &&
                    col_scale.numel() == N && row_scale.scalar_type() == torch::kFloat &&
                    col_scale.scalar_type() == torch::kFloat, "scale_products: fp32 scales, one a row and a column");
    auto out = torch::empty({M, N}, acc.options().dtype(dtype));
    const int32_t* ap = acc.data_ptr<int32_t>();
    const float *rp = row_scale.data_ptr<float>(), *cp = col_scale.data_ptr<float>();
    const bool bf16 = dtype == torch::kBFloat16;
    void* op = out.data_ptr();
    auto put = [&](long m, long n, float v) {
        if (bf16) static_cast<at::BFloat16*>(op)[m * N + n] = at::BFloat16(v);  // rounded to nearest even
        else static_cast<float*>(op)[m * N + n] = v;
    };
    constexpr long TILE = 16;  // rows read together where a row of products is not contiguous (one cache line)
    at::parallel_for(0, (M + TILE - 1) / TILE, 1, [&](int64_t b, int64_t e) {
        for (long m0 = b * TILE; m0 < std::min(M, e * TILE); m0 += TILE) {
            const long m1 = std::min(M, m0 + TILE);
            if (sn == 1) {
                for (long m = m0; m < m1; m++)
                    for (long n = 0; n < N; n++) put(m, n, static_cast<float>(ap[m * sm + n]) * rp[m] * cp[n]);
            } else {
                for (long n = 0; n < N; n++)
                    for (long m = m0; m < m1; m++) put(m, n, static_cast<float>(ap[m * sm + n * sn]) * rp[m] * cp[n]);
            }
        }
    });
    return out;
}

// q [N, K] int8 interleaved by 4 rows, scale [N] fp32 -> rows [n0, n1) of q * scale as fp32 [n1 - n0, K]
// (n0, n1 multiples of 4)
torch::Tensor int8_expand(const torch::Tensor& q, const torch::Tensor& scale, int64_t n0, int64_t n1, int64_t cap) {
    check_2d(q, "q");
    TORCH_CHECK(q.scalar_type() == torch::kChar && scale.scalar_type() == torch::kFloat && scale.is_contiguous() &&
                    scale.device().is_cpu() && scale.numel() == q.size(0), "int8_expand: int8 q, one fp32 scale a row");
    const long N = q.size(0), K = q.size(1);
    TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N && n0 % 4 == 0 && n1 % 4 == 0 && K % 16 == 0, "int8_expand: rows");
    auto out = torch::empty({n1 - n0, K}, scale.options());
    const int isa = pick(cap);
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = scale.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(n0 / 4, n1 / 4, 4, [&](int64_t b, int64_t e) {
        VLS_DISPATCH(isa, int8_expand, qp, sp, K, b * 4, e * 4, op + (b * 4 - n0) * K);
    });
    return out;
}

// x [M, K], packed [N, K/2] uint8 interleaved by 4 rows (kernels_impl.h), scales / zeros [N, K/group] fp32 ->
// [M, N] in x's dtype (N a multiple of 4)
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& zeros, int64_t group, int64_t cap) {
    check_2d(packed, "packed");
    check_2d(scales, "scales");
    check_2d(zeros, "zeros");
    const long N = packed.size(0), K = packed.size(1) * 2;
    TORCH_CHECK(x.size(-1) == K && group % 32 == 0 && K % group == 0 && N % 4 == 0, "int4_linear: shapes");
    TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / group && zeros.sizes() == scales.sizes(),
                "int4_linear: scales shape");
    TORCH_CHECK(x.device().is_cpu() && scales.scalar_type() == torch::kFloat && zeros.scalar_type() == torch::kFloat,
                "int4_linear: CPU tensors, fp32 scales and zeros");
    auto xf = as_f32(x.reshape({-1, K}));
    const long M = xf.size(0);
    auto xsum = xf.view({M, K / group, group}).sum(-1).contiguous();
    auto y = torch::empty({M, N}, xf.options());
    const int isa = pick(cap);
    const float *xp = xf.data_ptr<float>(), *xs = xsum.data_ptr<float>();
    const float *sp = scales.data_ptr<float>(), *zp = zeros.data_ptr<float>();
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N / 4, 8, [&](int64_t b, int64_t e) {
        VLS_DISPATCH(isa, int4_rows, xp, xs, M, K, pp, sp, zp, group, yp, N, b * 4, e * 4);
    });
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return y.to(x.scalar_type()).view(sizes);
}

// One decode token per sequence. q [B, H, D]; k/v cache [slots, KVH, D] (fp32 or bf16); block_table [B, max_blocks]
// int64; context_lens [B] int64. Returns [B, H, D] in q's dtype.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     const torch::Tensor& block_table, const torch::Tensor& context_lens,
                                     int64_t block_size, double scale, int64_t cap) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "paged_decode_attention: shapes");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                    (k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16),
                "paged_decode_attention: fp32 or bf16 cache");
    TORCH_CHECK(block_table.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
                "paged_decode_attention: int64 tables");
    const long B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH;
    TORCH_CHECK(D % 16 == 0 && H % KVH == 0 && k_cache.size(2) == D, "paged_decode_attention: head sizes");
    TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.sizes() == k_cache.sizes(),
                "paged_decode_attention: CPU tensors, K and V caches of one shape");
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B && context_lens.numel() == B && block_size > 0,
                "paged_decode_attention: one block-table row and one length per sequence");
    auto qf = as_f32(q);
    auto table = block_table.contiguous();
    auto lens = context_lens.contiguous();
    long max_ctx = 0;  // (a loop, not lens.max().item(): two dispatched ops less per layer and token)
    for (long b = 0; b < B; b++) max_ctx = std::max<long>(max_ctx, lens.data_ptr<int64_t>()[b]);
    const long max_blocks = table.size(1);
    TORCH_CHECK(max_ctx <= max_blocks * block_size, "paged_decode_attention: context longer than its block table");
    const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
    const int isa = std::min(pick(cap), 2);
    const long stride = KVH * D;
    const int64_t *tp = table.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
    const float* qp = qf.data_ptr<float>();
    auto out = torch::empty({B, H, D}, qf.options());
    float* op = out.data_ptr<float>();
    const void *kp = k_cache.data_ptr(), *vp = v_cache.data_ptr();
    const float sc = static_cast<float>(scale);
    // one (sequence, kv head) at a time, spread over torch's threads: scores, softmax and values in one pass
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> probs(G * max_ctx);
        for (int64_t u = begin; u < end; u++) {
            const long b = u / KVH, h = u % KVH, head0 = b * H + h * G, ctx = lp[b];
            const int64_t* blocks = tp + b * max_blocks;
            float* p = probs.data();
            if (bf16)
                VLS_DISPATCH(isa, scores_bf16, qp + head0 * D, static_cast<const uint16_t*>(kp) + h * D, stride,
                             blocks, ctx, block_size, D, G, sc, p, ctx);
            else
                VLS_DISPATCH(isa, scores_f32, qp + head0 * D, static_cast<const float*>(kp) + h * D, stride, blocks,
                             ctx, block_size, D, G, sc, p, ctx);
            VLS_DISPATCH(isa, softmax_rows, p, G, ctx, ctx);
            if (bf16)
                VLS_DISPATCH(isa, values_bf16, p, ctx, static_cast<const uint16_t*>(vp) + h * D, stride, blocks, ctx,
                             block_size, D, G, op + head0 * D);
            else
                VLS_DISPATCH(isa, values_f32, p, ctx, static_cast<const float*>(vp) + h * D, stride, blocks, ctx,
                             block_size, D, G, op + head0 * D);
        }
    });
    return out.to(q.scalar_type());
}

// The widest ISA copy (at most `isa`) whose vector width divides n: 16 lanes, 8 lanes, or scalar.
int fit(int isa, long n) {
    if (isa >= 2 && n % 16 == 0) return 2;
    if (isa >= 1 && n % 8 == 0) return 1;
    return 0;
}

// x [..., H] fp32 or bf16, weight [H] same dtype -> RMSNorm(x) * weight, rounding as the reference does
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, int64_t cap) {
    TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.is_contiguous(), "rms_norm: dtypes");
    const long H = x.size(-1);
    TORCH_CHECK(x.device().is_cpu() && weight.numel() == H, "rms_norm: CPU tensors, one weight per channel");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const long rows = xc.numel() / H;
    const int isa = fit(pick(cap), H);
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "rms_norm: fp32 or bf16");
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
        if (bf16)
            VLS_DISPATCH(isa, rms_norm_bf16, static_cast<const uint16_t*>(xc.data_ptr()) + b * H,
                         static_cast<const uint16_t*>(weight.data_ptr()), static_cast<uint16_t*>(y.data_ptr()) + b * H,
                         e - b, H, static_cast<float>(eps));
        else
            VLS_DISPATCH(isa, rms_norm_f32, xc.data_ptr<float>() + b * H, weight.data_ptr<float>(),
                         y.data_ptr<float>() + b * H, e - b, H, static_cast<float>(eps));
    });
    return y;
}

// x [..., 2I] = [gate | up] (fp32 or bf16, contiguous) -> silu(gate) * up [..., I], rounding as torch does in x's dtype
torch::Tensor silu_mul(const torch::Tensor& x, int64_t cap) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.size(-1) % 2 == 0, "silu_mul: contiguous [..., 2I]");
    const long I = x.size(-1) / 2, rows = x.numel() / (2 * I);
    auto sizes = x.sizes().vec();
    sizes.back() = I;
    auto y = torch::empty(sizes, x.options());
    const int isa = fit(pick(cap), I);
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "silu_mul: fp32 or bf16");
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
        if (bf16)
            VLS_DISPATCH(isa, silu_mul_bf16, static_cast<const uint16_t*>(x.data_ptr()) + b * 2 * I,
                         static_cast<uint16_t*>(y.data_ptr()) + b * I, e - b, I);
        else
            VLS_DISPATCH(isa, silu_mul_f32, x.data_ptr<float>() + b * 2 * I, y.data_ptr<float>() + b * I, e - b, I);
    });
    return y;
}

// In place on x [T, heads_total, D] (rows may be strided, heads contiguous): rotary on the first `heads` heads.
// cos/sin [T, D]: in x's dtype (rounded after every op, as a computation in that dtype) or fp32 (computed in
// fp32, rounded once).
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t cap) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x must be [T, heads, D]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "rotary_: cos/sin");
    const long T = x.size(0), D = x.size(2), stride = x.stride(0);
    TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && heads <= x.size(1) && D % 2 == 0, "rotary_: shapes");
    TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu(), "rotary_: CPU tensors");
    const int isa = fit(pick(cap), D / 2);
    const auto xt = x.scalar_type(), ct = cos.scalar_type();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        if (xt == torch::kFloat && ct == torch::kFloat)
            VLS_DISPATCH(isa, rotary_f32, x.data_ptr<float>() + b * stride, e - b, stride, heads, D,
                         cos.data_ptr<float>() + b * D, sin.data_ptr<float>() + b * D);
        else if (xt == torch::kBFloat16 && ct == torch::kBFloat16)
            VLS_DISPATCH(isa, rotary_bf16, static_cast<uint16_t*>(x.data_ptr()) + b * stride, e - b, stride, heads,
                         D, static_cast<const uint16_t*>(cos.data_ptr()) + b * D,
                         static_cast<const uint16_t*>(sin.data_ptr()) + b * D);
        else if (xt == torch::kBFloat16 && ct == torch::kFloat)
            VLS_DISPATCH(isa, rotary_bf16_f32, static_cast<uint16_t*>(x.data_ptr()) + b * stride, e - b, stride,
                         heads, D, cos.data_ptr<float>() + b * D, sin.data_ptr<float>() + b * D);
        else
            TORCH_CHECK(false, "rotary_: unsupported dtypes");
    });
}

// Attention of a prompt's queries q [L, H, D] to its keys and values k/v [S, KVH, D] (rows may be strided, heads
// contiguous; fp32 or bf16, all one dtype), H a multiple of KVH. causal: query i sees keys up to S - L + i (a
// cached prefix of S - L keys comes first). Returns [L, H, D] in q's dtype. Keys and values are packed once per
// call in the layout of the copy that runs (attention_impl.h); `isa` 3 allows the bf16 dot-product copy.
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                                double scale, int64_t cap) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
                "prefill_attention: q [L, H, D], k/v [S, KVH, D]");
    const long L = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), KVH = k.size(1);
    TORCH_CHECK(k.size(2) == D && H % KVH == 0 && H / KVH <= VLS_ATT_ROWS && D % 2 == 0, "prefill_attention: heads");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                    (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
                "prefill_attention: q, k, v all fp32 or all bf16");
    TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefill_attention: CPU tensors");
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "prefill_attention: q's heads must be contiguous");
    TORCH_CHECK(!causal || S >= L, "prefill_attention: a causal prompt needs its own keys");
    auto out = torch::empty({L, H, D}, q.options());
    const bool bf16 = q.scalar_type() == torch::kBFloat16;
    const bool dp = bf16 && pick(cap) >= 3 && D % 16 == 0;
    const int isa = fit(std::min(pick(cap), 2), D);
    const long s_pad = (S + VLS_ATT_KEYS - 1) / VLS_ATT_KEYS * VLS_ATT_KEYS;
    // per key/value head, zero-padded to whole key blocks: keys transposed, values as rows (or bf16 pairs)
    auto heads_major = [&](const torch::Tensor& x) {
        return torch::constant_pad_nd(x.permute({1, 0, 2}).to(dp ? torch::kBFloat16 : torch::kFloat),
                                      {0, 0, 0, s_pad - S});  // [KVH, s_pad, D]
    };
    torch::Tensor kt, vt;
    if (dp) {
        kt = heads_major(k).view({KVH, s_pad, D / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // [KVH, D/2, s_pad, 2]
        vt = heads_major(v).view({KVH, s_pad / 2, 2, D}).permute({0, 1, 3, 2}).contiguous();  // [KVH, s_pad/2, D, 2]
    } else {
        kt = heads_major(k).transpose(1, 2).contiguous();  // [KVH, D, s_pad]
        vt = heads_major(v).contiguous();                  // [KVH, s_pad, D]
    }
    const long G = H / KVH, per_block = VLS_ATT_ROWS / G, blocks = (L + per_block - 1) / per_block;
    const long units = KVH * blocks, scratch = vls_generic::prefill_attention_scratch(D);
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf(scratch);
        for (int64_t u = begin; u < end; u++) {
            // later query blocks see more keys: interleave cheap and dear units so that contiguous ranges balance
            const long c = u % 2 == 0 ? u / 2 : units - 1 - u / 2;
            const long h = c % KVH, p0 = c / KVH * per_block, p1 = std::min(L, p0 + per_block);
            const long last_key = causal ? S - L + p1 : S, visible0 = causal ? S - L + p0 + 1 : S;
            const long head = h * D * s_pad;  // this head's packed keys and values
            if (dp)
                vls_avx512bf16::prefill_attention_dp(
                    static_cast<const uint16_t*>(q.data_ptr()) + h * G * D,
                    static_cast<const uint16_t*>(kt.data_ptr()) + head,
                    static_cast<const uint16_t*>(vt.data_ptr()) + head, s_pad, static_cast<uint16_t*>(out.data_ptr()) + h * G * D, q.stride(0), H * D, D, G, p0, p1,
                    last_key, visible0, causal, sc, buf.data());
            else if (bf16)
                VLS_DISPATCH(isa, prefill_attention_bf16, static_cast<const uint16_t*>(q.data_ptr()) + h * G * D,
                             kt.data_ptr<float>() + head, vt.data_ptr<float>() + head, s_pad,
                             static_cast<uint16_t*>(out.data_ptr()) + h * G * D, q.stride(0), H * D, D, G, p0, p1,
                             last_key, visible0, causal, sc, buf.data());
            else
                VLS_DISPATCH(isa, prefill_attention_f32, q.data_ptr<float>() + h * G * D, kt.data_ptr<float>() + head,
                             vt.data_ptr<float>() + head, s_pad, out.data_ptr<float>() + h * G * D, q.stride(0),
                             H * D, D, G, p0, p1, last_key, visible0, causal, sc, buf.data());
        }
    });
    return out;
}

// Gated DeltaNet decode (Qwen3.5's linear attention), one token for each of B sequences, in place on their states
// in the layer's pool: pool [slots, H, Dk, Dv] fp32, slots [B] int64 (distinct), fresh [B] bool (start from zero);
// q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] fp32 (q and k normalized, scaled and repeated to the H value heads
// by the caller) -> the output [B, H, Dv] fp32.
torch::Tensor gated_delta_step(torch::Tensor& pool, const torch::Tensor& slots, const torch::Tensor& fresh,
                               const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& g, const torch::Tensor& beta, int64_t cap) {
    TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.device().is_cpu() &&
                    pool.scalar_type() == torch::kFloat, "gated_delta_step: a contiguous fp32 CPU state pool");
    const long B = slots.numel(), H = pool.size(1), Dk = pool.size(2), Dv = pool.size(3), n = pool.size(0);
    for (const auto* t : {&q, &k, &v, &g, &beta})
        TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == torch::kFloat &&
                        t->size(0) == B && t->size(1) == H, "gated_delta_step: contiguous fp32 [B, H, ...] inputs");
    TORCH_CHECK(q.size(2) == Dk && k.size(2) == Dk && v.size(2) == Dv && g.dim() == 2 && beta.dim() == 2,
                "gated_delta_step: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]");
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && fresh.scalar_type() == torch::kBool &&
                    fresh.is_contiguous() && fresh.numel() == B, "gated_delta_step: int64 slots, bool fresh");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (long b = 0; b < B; b++) TORCH_CHECK(0 <= sp[b] && sp[b] < n, "gated_delta_step: a slot outside the pool");
    auto out = torch::empty({B, H, Dv}, q.options());
    const int isa = pick(cap);
    float *pp = pool.data_ptr<float>(), *op = out.data_ptr<float>();
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
    const bool* fp = fresh.data_ptr<bool>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(Dv);
        for (int64_t u = begin; u < end; u++) {
            const long b = u / H, h = u % H;
            VLS_DISPATCH(isa, gated_delta_step_f32, pp + (sp[b] * H + h) * Dk * Dv, qp + u * Dk, kp + u * Dk,
                         vp + u * Dv, std::exp(gp[u]), bp[u], fp[b], op + u * Dv, Dk, Dv, scratch.data());
        }
    });
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("cpu_isa", &cpu_isa, "best kernel ISA this CPU runs: 0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512-BF16");
    m.def("int8_linear", &int8_linear);
    m.def("int8_expand", &int8_expand);
    m.def("int8_dot_isa", &int8_dot_isa);
    m.def("int8_dot_linear", &int8_dot_linear);
    m.def("quantize_rows", &quantize_rows);
    m.def("scale_products", &scale_products);
    m.def("int4_linear", &int4_linear);
    m.def("paged_decode_attention", &paged_decode_attention);
    m.def("rms_norm", &rms_norm);
    m.def("silu_mul", &silu_mul);
    m.def("rotary_", &rotary_);
    m.def("prefill_attention", &prefill_attention);
    m.def("gated_delta_step", &gated_delta_step);
}
