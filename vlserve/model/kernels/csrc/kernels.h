// Declarations of the per-ISA CPU kernels. Each ISA's copy is the same source (kernels_impl.h) compiled under
// its own `#pragma GCC target` in its own namespace; ops.cpp picks one at run time. Plain pointers only: no
// torch types cross into the ISA-specific files (their inline functions must not be compiled for a newer ISA).
#pragma once
#include <cstdint>

constexpr long VLS_ATT_ROWS = 64;  // prefill attention: query rows (position x head) per unit of work
constexpr long VLS_ATT_KEYS = 64;  // and keys per block (key/value heads are packed padded to a multiple)

#define VLS_DECLARE_KERNELS(NS)                                                                                    \
    namespace NS {                                                                                                 \
    void int8_rows(const float* x, long M, long K, const int8_t* q, const float* scale, float* y, long N,          \
                   long n0, long n1);                                                                              \
    void int8_expand(const int8_t* q, const float* scale, long K, long n0, long n1, float* out);                   \
    void int4_rows(const float* x, const float* xsum, long M, long K, const uint8_t* packed, const float* scales,  \
                   const float* zeros, long group, float* y, long N, long n0, long n1);                            \
    void scores_f32(const float* q, const float* k, long stride, const int64_t* blocks, long ctx, long bs,        \
                    long D, long G, float scale, float* out, long out_stride);                                     \
    void scores_bf16(const float* q, const uint16_t* k, long stride, const int64_t* blocks, long ctx, long bs,    \
                     long D, long G, float scale, float* out, long out_stride);                                    \
    void values_f32(const float* p, long p_stride, const float* v, long stride, const int64_t* blocks, long ctx,  \
                    long bs, long D, long G, float* out);                                                          \
    void values_bf16(const float* p, long p_stride, const uint16_t* v, long stride, const int64_t* blocks,        \
                     long ctx, long bs, long D, long G, float* out);                                               \
    void softmax_rows(float* s, long rows, long n, long stride);                                                   \
    void silu_mul_f32(const float* x, float* y, long rows, long I);                                                \
    void silu_mul_bf16(const uint16_t* x, uint16_t* y, long rows, long I);                                         \
    void rms_norm_f32(const float* x, const float* w, float* y, long rows, long H, float eps);                     \
    void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, long rows, long H, float eps);           \
    void rotary_f32(float* x, long rows, long row_stride, long heads, long D, const float* cos, const float* sin);  \
    void rotary_bf16(uint16_t* x, long rows, long row_stride, long heads, long D, const uint16_t* cos,            \
                     const uint16_t* sin);                                                                         \
    void rotary_bf16_f32(uint16_t* x, long rows, long row_stride, long heads, long D, const float* cos,           \
                         const float* sin);                                                                        \
    void gated_delta_step_f32(float* S, const float* q, const float* k, const float* v, float decay, float beta,  \
                              bool fresh, float* out, long Dk, long Dv, float* scratch);                           \
    long prefill_attention_scratch(long D);                                                                        \
    void prefill_attention_f32(const float* q, const float* kt, const float* vt, long s_pad, float* out,           \
                               long q_stride, long out_stride, long D, long G, long p0, long p1, long last_key,    \
                               long visible0, bool causal, float scale, float* scratch);                           \
    void prefill_attention_bf16(const uint16_t* q, const float* kt, const float* vt, long s_pad, uint16_t* out,    \
                                long q_stride, long out_stride, long D, long G, long p0, long p1, long last_key,   \
                                long visible0, bool causal, float scale, float* scratch);                          \
    }

VLS_DECLARE_KERNELS(vls_avx512)
VLS_DECLARE_KERNELS(vls_avx2)
VLS_DECLARE_KERNELS(vls_generic)

// Only on CPUs with AVX-512-BF16: prefill attention with bf16 dot products (kernels_avx512bf16.cpp).
namespace vls_avx512bf16 {
void prefill_attention_dp(const uint16_t* q, const uint16_t* kt, const uint16_t* vt, long s_pad, uint16_t* out,
                          long q_stride, long out_stride, long D, long G, long p0, long p1, long last_key,
                          long visible0, bool causal, float scale, float* scratch);
}

// int8 x int8 decode linears (kernels_int8_dot.cpp): AVX-512 VNNI and AVX2 copies. x quantized in blocks of 32
// values (codes [M, K], scales [M, K / 32]); q interleaved by 4 rows as for int8_rows.
#define VLS_DECLARE_INT8_DOT(NS)                                                                                   \
    namespace NS {                                                                                                 \
    void quantize_blocks(const float* x, long M, long K, int8_t* codes, float* scales);                            \
    void int8_dot_rows(const int8_t* xq, const float* xs, long M, long K, const int8_t* q, const float* scale,     \
                       float* y, long N, long n0, long n1);                                                        \
    float row_absmax(const float* x, long K, bool* nan);                                                           \
    void quantize_row(const float* x, long K, float divisor, float top, int8_t* out);                              \
    }
VLS_DECLARE_INT8_DOT(vls_avx512vnni)
VLS_DECLARE_INT8_DOT(vls_avx2)
