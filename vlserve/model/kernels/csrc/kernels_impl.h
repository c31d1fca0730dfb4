// The kernels, written once over a small vector vocabulary that the including file defines for its ISA:
//   W (lanes), vf, vzero, vset1, vload, vstore, vfma, vsum, vload_i8 (W int8 -> floats),
//   vload_u4 (W bytes -> low nibbles, high nibbles as floats), vload_bf16 (W bf16 -> floats),
//   and the register tiles MB_I8/NB_I8, MB_I4/NB_I4 (rows of x x rows of the weight per tile).
// Everything here has internal linkage (see kernels.h for why). Accumulation is fp32 throughout.

static inline vf vloadT(const float* p) { return vload(p); }
static inline vf vloadT(const uint16_t* p) { return vload_bf16(p); }

// Weights come interleaved by 4 output rows (`interleave4` in quantized_linear.py): per 16 bytes of a row, the
// same 16 bytes of rows n..n+3 sit together in one 64-byte line, so a tile of 4 rows is one sequential stream
// (hardware prefetchers follow one stream far better than four short ones). Byte b of row n + j lies at
// tile(n) + (b / 16) * 64 + j * 16 + b % 16, with tile(n) = base + n * row_bytes.
static inline long il(long b, long j) { return (b >> 4) * 64 + j * 16 + (b & 15); }

// A decode step streams each weight once from memory. The hardware prefetchers alone leave the loads waiting
// (measured: ~11 GB/s of a 2-core machine's 17-24), so the weight loops ask for the line this far ahead of the
// one they read (10.8 -> 18-20 GB/s there; it runs into the next tile, which is read next).
constexpr long PREFETCH_AHEAD = 2048;
static inline void prefetch_ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + PREFETCH_AHEAD); }

// ---- weight-only int8: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] ----------------------------------------
template <int MB, int NB>
static inline void i8_tile(const float* x, long K, const int8_t* tile, int j0, const float* scale, float* y, long N,
                           long m, long n) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = vzero();
    for (long k0 = 0; k0 < K; k0 += 16) {  // one 64-byte line of the 4-row tile: one prefetch
        prefetch_ahead(tile + il(k0, 0));
        for (long k = k0; k < k0 + 16; k += W) {
            vf w[NB];
            for (int j = 0; j < NB; j++) w[j] = vload_i8(tile + il(k, j0 + j));
            for (int i = 0; i < MB; i++) {
                vf xv = vload(x + (m + i) * K + k);
                for (int j = 0; j < NB; j++) acc[i][j] = vfma(xv, w[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) y[(m + i) * N + n + j0 + j] = vsum(acc[i][j]) * scale[n + j0 + j];
}

// rows n0..n1 (multiples of 4)
void int8_rows(const float* x, long M, long K, const int8_t* q, const float* scale, float* y, long N, long n0,
               long n1) {
    for (long n = n0; n < n1; n += 4) {
        const int8_t* tile = q + n * K;
        for (int j0 = 0; j0 < 4; j0 += NB_I8) {
            long m = 0;
            for (; m + MB_I8 <= M; m += MB_I8) i8_tile<MB_I8, NB_I8>(x, K, tile, j0, scale, y, N, m, n);
            for (; m < M; m++) i8_tile<1, NB_I8>(x, K, tile, j0, scale, y, N, m, n);
        }
    }
}

// rows n0..n1 (multiples of 4) of an interleaved int8 weight, each times its scale, as fp32 rows out[n - n0] (the
// weight of a dense GEMM when a call has too many rows for int8_rows)
void int8_expand(const int8_t* q, const float* scale, long K, long n0, long n1, float* out) {
    for (long n = n0; n < n1; n += 4) {
        const int8_t* tile = q + n * K;
        for (int j = 0; j < 4; j++) {
            const vf s = vset1(scale[n + j]);
            float* row = out + (n - n0 + j) * K;
            for (long k = 0; k < K; k += W) vstore(row + k, vmul(vload_i8(tile + il(k, j)), s));
        }
    }
}

// ---- weight-only int4 with groups: y[m, n] = sum_g scales[n, g] * sum_{k in g} x[m, k] * (q[n, k] - zeros[n, g])
// Per 32 values of k a row has 16 bytes: byte i holds k = i (low nibble) and k = 16 + i (high nibble); rows are
// interleaved by 4 as above. The zero is taken out per group as zeros * sum_k x (xsum, precomputed), so the inner
// loop is one FMA a value.
template <int MB, int NB>
static inline void i4_tile(const float* x, const float* xsum, long K, const uint8_t* tile, int j0,
                           const float* scales, const float* zeros, long group, float* y, long N, long m, long n) {
    const long G = K / group;
    vf total[MB][NB];
    float correction[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) total[i][j] = vzero(), correction[i][j] = 0.f;
    for (long g = 0; g < G; g++) {
        vf acc[MB][NB];
        for (int i = 0; i < MB; i++)
            for (int j = 0; j < NB; j++) acc[i][j] = vzero();
        for (long kb = g * group; kb < (g + 1) * group; kb += 32) {
            prefetch_ahead(tile + il(kb / 2, 0));  // the 64-byte line of these 32 values of the 4 rows
            for (long h = 0; h < 16; h += W) {
                vf lo[NB], hi[NB];
                for (int j = 0; j < NB; j++) vload_u4(tile + il(kb / 2 + h, j0 + j), lo[j], hi[j]);
                for (int i = 0; i < MB; i++) {
                    vf xl = vload(x + (m + i) * K + kb + h), xh = vload(x + (m + i) * K + kb + 16 + h);
                    for (int j = 0; j < NB; j++) acc[i][j] = vfma(xh, hi[j], vfma(xl, lo[j], acc[i][j]));
                }
            }
        }
        for (int j = 0; j < NB; j++) {
            const long row = n + j0 + j;
            const float s = scales[row * G + g], sz = s * zeros[row * G + g];
            for (int i = 0; i < MB; i++) {
                total[i][j] = vfma(vset1(s), acc[i][j], total[i][j]);
                correction[i][j] += sz * xsum[(m + i) * G + g];
            }
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) y[(m + i) * N + n + j0 + j] = vsum(total[i][j]) - correction[i][j];
}

void int4_rows(const float* x, const float* xsum, long M, long K, const uint8_t* packed, const float* scales,
               const float* zeros, long group, float* y, long N, long n0, long n1) {
    for (long n = n0; n < n1; n += 4) {
        const uint8_t* tile = packed + n * (K / 2);
        for (int j0 = 0; j0 < 4; j0 += NB_I4) {
            long m = 0;
            for (; m + MB_I4 <= M; m += MB_I4)
                i4_tile<MB_I4, NB_I4>(x, xsum, K, tile, j0, scales, zeros, group, y, N, m, n);
            for (; m < M; m++) i4_tile<1, NB_I4>(x, xsum, K, tile, j0, scales, zeros, group, y, N, m, n);
        }
    }
}

// ---- paged decode attention, one (sequence, kv head) at a time, reading the cache where it lies -----------
// q: [G, D] (the G query heads sharing this kv head); k/v rows: token t sits at slot blocks[t / bs] * bs + t % bs,
// `stride` elements apart, already offset to this kv head. Scores come out as [G, out_stride], softmax_rows turns
// them into probabilities in place, then values take them back: out [G, D] = p @ V.
// A head's row is a few cache lines, the next one `stride` elements on and the next block anywhere: the hardware
// prefetchers do not follow, so each loop asks for the row ATT_AHEAD tokens ahead while it reads this one.
constexpr long ATT_AHEAD = 8;
template <typename T>
static inline void prefetch_row(const T* base, const int64_t* blocks, long t, long ctx, long bs, long stride, long D) {
    if (t >= ctx) return;
    const char* row = reinterpret_cast<const char*>(base + (blocks[t / bs] * bs + t % bs) * stride);
    const char* end = row + D * static_cast<long>(sizeof(T));
    for (const char* line = row - reinterpret_cast<uintptr_t>(row) % 64; line < end; line += 64)
        __builtin_prefetch(line);  // every line the row touches, its first and last included
}

template <typename T>
static inline void scores_impl(const float* q, const T* k, long stride, const int64_t* blocks, long ctx, long bs,
                               long D, long G, float scale, float* out, long out_stride) {
    for (long t = 0; t < ATT_AHEAD && t < ctx; t++) prefetch_row(k, blocks, t, ctx, bs, stride, D);
    for (long t = 0; t < ctx; t++) {
        prefetch_row(k, blocks, t + ATT_AHEAD, ctx, bs, stride, D);
        const T* row = k + (blocks[t / bs] * bs + t % bs) * stride;
        long g = 0;
        for (; g + 4 <= G; g += 4) {  // four heads share each K load and one reduction tree
            vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
            for (long d = 0; d < D; d += W) {
                const vf kv = vloadT(row + d);
                for (int j = 0; j < 4; j++) acc[j] = vfma(vload(q + (g + j) * D + d), kv, acc[j]);
            }
            float sums[4];
            vsum4(acc[0], acc[1], acc[2], acc[3], sums);
            for (int j = 0; j < 4; j++) out[(g + j) * out_stride + t] = sums[j] * scale;
        }
        for (; g < G; g++) {
            vf acc = vzero();
            for (long d = 0; d < D; d += W) acc = vfma(vload(q + g * D + d), vloadT(row + d), acc);
            out[g * out_stride + t] = vsum(acc) * scale;
        }
    }
}

// out[g] = sum_t p[g, t] * v[t] with the outputs of GB heads x DC vectors held in registers while the tokens
// stream by (each V row chunk loaded and converted once for all GB heads).
template <int GB, int DC, typename T>
static inline void values_tile(const float* p, long p_stride, const T* v, long stride, const int64_t* blocks,
                               long ctx, long bs, long D, long g0, long d0, float* out) {
    vf acc[GB][DC];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < DC; c++) acc[g][c] = vzero();
    for (long t = 0; t < ctx; t++) {
        prefetch_row(v + d0, blocks, t + ATT_AHEAD, ctx, bs, stride, DC * W);
        const T* row = v + (blocks[t / bs] * bs + t % bs) * stride + d0;
        vf vv[DC];
        for (int c = 0; c < DC; c++) vv[c] = vloadT(row + c * W);
        for (int g = 0; g < GB; g++) {
            const vf pg = vset1(p[(g0 + g) * p_stride + t]);
            for (int c = 0; c < DC; c++) acc[g][c] = vfma(pg, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < DC; c++) vstore(out + (g0 + g) * D + d0 + c * W, acc[g][c]);
}

template <int DC, typename T>
static inline void values_heads(const float* p, long p_stride, const T* v, long stride, const int64_t* blocks,
                                long ctx, long bs, long D, long G, float* out) {
    for (long d0 = 0; d0 < D; d0 += DC * W) {
        long g = 0;
        for (; g + 4 <= G; g += 4) values_tile<4, DC>(p, p_stride, v, stride, blocks, ctx, bs, D, g, d0, out);
        for (; g < G; g++) values_tile<1, DC>(p, p_stride, v, stride, blocks, ctx, bs, D, g, d0, out);
    }
}

template <typename T>
static inline void values_impl(const float* p, long p_stride, const T* v, long stride, const int64_t* blocks,
                               long ctx, long bs, long D, long G, float* out) {
    if ((D / W) % 4 == 0)
        values_heads<4>(p, p_stride, v, stride, blocks, ctx, bs, D, G, out);
    else
        values_heads<1>(p, p_stride, v, stride, blocks, ctx, bs, D, G, out);
}

// softmax over the first n entries of each of `rows` rows, `stride` apart, in place
void softmax_rows(float* s, long rows, long n, long stride) {
    const long nv = n / W * W;
    for (long r = 0; r < rows; r++) {
        float* x = s + r * stride;
        float mx = -__builtin_inff();
        if (nv) {
            vf m = vload(x);
            for (long i = W; i < nv; i += W) m = vmax(m, vload(x + i));
            mx = vhmax(m);
        }
        for (long i = nv; i < n; i++) mx = x[i] > mx ? x[i] : mx;
        vf sum = vzero();
        float tail = 0.f;
        for (long i = 0; i < nv; i += W) {
            const vf e = vexp(vsub(vload(x + i), vset1(mx)));
            vstore(x + i, e);
            sum = vadd(sum, e);
        }
        for (long i = nv; i < n; i++) tail += (x[i] = __builtin_expf(x[i] - mx));
        const float inv = 1.f / (vsum(sum) + tail);
        for (long i = 0; i < nv; i += W) vstore(x + i, vmul(vload(x + i), vset1(inv)));
        for (long i = nv; i < n; i++) x[i] *= inv;
    }
}

void scores_f32(const float* q, const float* k, long stride, const int64_t* blocks, long ctx, long bs, long D, long G,
                float scale, float* out, long out_stride) {
    scores_impl(q, k, stride, blocks, ctx, bs, D, G, scale, out, out_stride);
}
void scores_bf16(const float* q, const uint16_t* k, long stride, const int64_t* blocks, long ctx, long bs, long D,
                 long G, float scale, float* out, long out_stride) {
    scores_impl(q, k, stride, blocks, ctx, bs, D, G, scale, out, out_stride);
}
void values_f32(const float* p, long p_stride, const float* v, long stride, const int64_t* blocks, long ctx, long bs,
                long D, long G, float* out) {
    values_impl(p, p_stride, v, stride, blocks, ctx, bs, D, G, out);
}
void values_bf16(const float* p, long p_stride, const uint16_t* v, long stride, const int64_t* blocks, long ctx,
                 long bs, long D, long G, float* out) {
    values_impl(p, p_stride, v, stride, blocks, ctx, bs, D, G, out);
}

// ---- elementwise pieces of every decoder layer, fused (each replaces 6-9 torch ops and their temporaries) ---
static inline void vstoreT(float* p, vf a, bool) { vstore(p, a); }
static inline void vstoreT(uint16_t* p, vf a, bool) { vstore_bf16(p, vround_bf16(a)); }
template <typename T>
static inline vf rnd(vf a);  // the rounding the reference does after an op in dtype T
template <>
inline vf rnd<float>(vf a) { return a; }
template <>
inline vf rnd<uint16_t>(vf a) { return vround_bf16(a); }

// RMSNorm as Qwen2 computes it: y = w * T(x * rsqrt(mean(x^2) + eps)), the norm in fp32, the scale in dtype T.
template <typename T>
static inline void rms_norm_impl(const T* x, const T* w, T* y, long rows, long H, float eps) {
    for (long r = 0; r < rows; r++) {
        const T* xr = x + r * H;
        vf acc = vzero();
        for (long i = 0; i < H; i += W) {
            vf v = vloadT(xr + i);
            acc = vfma(v, v, acc);
        }
        const float inv = 1.0f / __builtin_sqrtf(vsum(acc) / static_cast<float>(H) + eps);
        for (long i = 0; i < H; i += W)
            vstoreT(y + r * H + i, vmul(vloadT(w + i), rnd<T>(vmul(vloadT(xr + i), vset1(inv)))), true);
    }
}
void rms_norm_f32(const float* x, const float* w, float* y, long rows, long H, float eps) {
    rms_norm_impl(x, w, y, rows, H, eps);
}
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, long rows, long H, float eps) {
    rms_norm_impl(x, w, y, rows, H, eps);
}

// SwiGLU's gate: y = T(T(silu(g)) * u) per row of x = [g | u] (I values each), as torch computes
// silu(g) * u in dtype T (silu in fp32, rounded; the product of the rounded values, rounded), in one pass.
template <typename T>
static inline void silu_mul_impl(const T* x, T* y, long rows, long I) {
    for (long r = 0; r < rows; r++) {
        const T *g = x + r * 2 * I, *u = g + I;
        for (long i = 0; i < I; i += W) {
            const vf gv = vloadT(g + i);
            const vf silu = rnd<T>(vdiv(gv, vadd(vset1(1.f), vexp(vsub(vzero(), gv)))));
            vstoreT(y + r * I + i, vmul(silu, vloadT(u + i)), true);
        }
    }
}
void silu_mul_f32(const float* x, float* y, long rows, long I) { silu_mul_impl(x, y, rows, I); }
void silu_mul_bf16(const uint16_t* x, uint16_t* y, long rows, long I) { silu_mul_impl(x, y, rows, I); }

// Rotary in place on the first `heads` heads of each row (head_dim D, rows `row_stride` apart):
// x = x * cos + rotate_half(x) * sin, cos/sin [rows, D] (of type C). `per_op`: round to T after every op (the
// LM computes in its dtype); otherwise compute in fp32 and round once (the vision towers rotate in fp32).
template <typename T, typename C>
static inline void rotary_impl(T* x, long rows, long row_stride, long heads, long D, const C* cos, const C* sin,
                               bool per_op) {
    const long half = D / 2;
    for (long r = 0; r < rows; r++) {
        const C *c = cos + r * D, *s = sin + r * D;
        for (long h = 0; h < heads; h++) {
            T* v = x + r * row_stride + h * D;
            for (long i = 0; i < half; i += W) {
                vf x1 = vloadT(v + i), x2 = vloadT(v + half + i);
                vf c1 = vloadT(c + i), c2 = vloadT(c + half + i), s1 = vloadT(s + i), s2 = vloadT(s + half + i);
                vf a1 = vmul(x1, c1), b1 = vmul(x2, s1), a2 = vmul(x2, c2), b2 = vmul(x1, s2);
                if (per_op) a1 = rnd<T>(a1), b1 = rnd<T>(b1), a2 = rnd<T>(a2), b2 = rnd<T>(b2);
                vstoreT(v + i, vsub(a1, b1), true);
                vstoreT(v + half + i, vadd(a2, b2), true);
            }
        }
    }
}
void rotary_f32(float* x, long rows, long row_stride, long heads, long D, const float* cos, const float* sin) {
    rotary_impl(x, rows, row_stride, heads, D, cos, sin, false);
}
void rotary_bf16(uint16_t* x, long rows, long row_stride, long heads, long D, const uint16_t* cos,
                 const uint16_t* sin) {
    rotary_impl(x, rows, row_stride, heads, D, cos, sin, true);
}
void rotary_bf16_f32(uint16_t* x, long rows, long row_stride, long heads, long D, const float* cos, const float* sin) {
    rotary_impl(x, rows, row_stride, heads, D, cos, sin, false);
}

// Gated delta rule, one decode token of one value head, in place on its state S [Dk, Dv] (fp32), as
// gated_delta.gated_delta_step computes it: S = exp(g) S; stored = S^T k; S += k ((v - stored) beta)^T; out = S^T q.
// Two passes over S instead of torch's many: the first reads it (stored, from the decayed values), the second
// decays, writes and reads out in one go. `fresh`: S starts at zero (the sequence's first token). scratch: Dv.
void gated_delta_step_f32(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                          bool fresh, float* out, long Dk, long Dv, float* scratch) {
    const long Dw = Dv - Dv % W;  // vector part; the rest lane by lane
    float* stored = scratch;
    if (fresh) {
        for (long j = 0; j < Dk * Dv; j++) S[j] = 0.f;
    }
    for (long j = 0; j < Dv; j++) stored[j] = 0.f;
    const vf dv = vset1(decay);
    for (long i = 0; i < Dk; i++) {
        const float* row = S + i * Dv;
        const vf ki = vset1(k[i]);
        long j = 0;
        for (; j < Dw; j += W) vstore(stored + j, vadd(vload(stored + j), vmul(ki, vmul(vload(row + j), dv))));
        for (; j < Dv; j++) stored[j] += k[i] * (row[j] * decay);
    }
    for (long j = 0; j < Dv; j++) {
        stored[j] = (v[j] - stored[j]) * beta;  // the write: what v adds where k points
        out[j] = 0.f;
    }
    for (long i = 0; i < Dk; i++) {
        float* row = S + i * Dv;
        const vf ki = vset1(k[i]), qi = vset1(q[i]);
        long j = 0;
        for (; j < Dw; j += W) {
            const vf s = vadd(vmul(vload(row + j), dv), vmul(ki, vload(stored + j)));
            vstore(row + j, s);
            vstore(out + j, vadd(vload(out + j), vmul(qi, s)));
        }
        for (; j < Dv; j++) {
            const float s = row[j] * decay + k[i] * stored[j];
            row[j] = s;
            out[j] += q[i] * s;
        }
    }
}
