// Prefill attention (a prompt's queries against its keys, causal or not), flash style: per unit of work (one
// key/value head, one block of queries with all the query heads that share that key/value head) the keys are
// streamed in blocks, the scores of a block stay in a small fp32 buffer, and the softmax is kept online (running
// max and sum per query row), so no [queries x keys] matrix is ever written out. Accumulation is fp32.
//
// ops.cpp packs each key/value head once per call, padded to whole key blocks with zeros:
//   fp32 copy (any ISA, fp32 or bf16 inputs widened exactly): kt [D, S_pad] (keys transposed), vt [S_pad, D];
//   bf16 dot-product copy (VLS_DPBF16, AVX-512-BF16): kt [D/2, S_pad, 2] and vt [S_pad/2, D, 2], bf16 pairs, so
//   each vdpbf16ps multiplies 16 lanes x 2 products. Its probabilities are rounded to bf16 for P.V (as flash
//   kernels on bf16 hardware do) and the sums use the same rounded values.
// Uses the vector vocabulary of kernels_impl.h plus vmax, vhmax and vexp.

constexpr long ATT_ROWS = VLS_ATT_ROWS, ATT_KEYS = VLS_ATT_KEYS;

static inline long att_scratch_floats(long D) { return 2 * ATT_ROWS * D + 2 * ATT_ROWS * ATT_KEYS + 2 * ATT_ROWS; }

// The online softmax over one block of scores s [rows, ATT_KEYS] (keys j0..j0+bk); s becomes the probabilities
// (0 where masked), the running max m, sum l and the outputs o are rescaled.
template <bool ROUND>
static inline void att_softmax_block(float* s, long rows, long G, long j0, long bk, long visible0, bool causal,
                                     float* m, float* l, float* o, long D) {
    const float neg_inf = -__builtin_inff();
    for (long r = 0; r < rows; r++) {
        float* sr = s + r * ATT_KEYS;
        const long visible = (causal ? visible0 + r / G : visible0) - j0;  // keys of this block row r sees
        const long n = visible < bk ? (visible > 0 ? visible : 0) : bk;
        if (n == 0) {
            for (long j = 0; j < ATT_KEYS; j++) sr[j] = 0.f;
            continue;
        }
        for (long j = n; j < ATT_KEYS; j++) sr[j] = neg_inf;
        vf mx = vset1(neg_inf);
        for (long j = 0; j < ATT_KEYS; j += W) mx = vmax(mx, vload(sr + j));
        const float m_new = m[r] > vhmax(mx) ? m[r] : vhmax(mx);
        const float corr = __builtin_expf(m[r] - m_new);  // 0 on the first block (m = -inf)
        vf sum = vzero();
        for (long j = 0; j < ATT_KEYS; j += W) {
            vf e = vexp(vsub(vload(sr + j), vset1(m_new)));
            if (ROUND) e = vround_bf16(e);
            vstore(sr + j, e);
            sum = vadd(sum, e);
        }
        l[r] = l[r] * corr + vsum(sum);
        m[r] = m_new;
        if (corr != 1.f)
            for (long d = 0; d < D; d += W) vstore(o + r * D + d, vmul(vload(o + r * D + d), vset1(corr)));
    }
}

template <typename T>
static inline void att_store_outputs(const float* o, const float* l, long rows, long G, long D, T* out,
                                     long out_stride, long p0) {
    for (long r = 0; r < rows; r++) {
        T* dst = out + (p0 + r / G) * out_stride + (r % G) * D;
        const vf inv = vset1(1.f / l[r]);
        for (long d = 0; d < D; d += W) vstoreT(dst + d, vmul(vload(o + r * D + d), inv), true);
    }
}

// Scratch layout per unit: o [ATT_ROWS, D], then per copy its own buffers, then m and l [ATT_ROWS] each.
#ifndef VLS_DPBF16

// s[r, c-vectors] = qs[r] . kt[:, j0 + keys] for a tile of MB rows x NB vectors of keys
template <int MB, int NB>
static inline void att_scores_tile(const float* qs, const float* kt, long s_pad, long D, float* s, long r0, long c0) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vzero();
    for (long d = 0; d < D; d++) {
        vf kv[NB];
        for (int c = 0; c < NB; c++) kv[c] = vload(kt + d * s_pad + (c0 + c) * W);
        for (int i = 0; i < MB; i++) {
            const vf qb = vset1(qs[(r0 + i) * D + d]);
            for (int c = 0; c < NB; c++) acc[i][c] = vfma(qb, kv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(s + (r0 + i) * ATT_KEYS + (c0 + c) * W, acc[i][c]);
}

// o[r, d-vectors c0..c0+NB) += sum_j p[r, j] * vt[j, :] for MB rows
template <int MB, int NB>
static inline void att_values_tile(const float* p, const float* vt, long bk, long D, float* o, long r0, long c0) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vload(o + (r0 + i) * D + (c0 + c) * W);
    for (long j = 0; j < bk; j++) {
        vf vv[NB];
        for (int c = 0; c < NB; c++) vv[c] = vload(vt + j * D + (c0 + c) * W);
        for (int i = 0; i < MB; i++) {
            const vf pb = vset1(p[(r0 + i) * ATT_KEYS + j]);
            for (int c = 0; c < NB; c++) acc[i][c] = vfma(pb, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(o + (r0 + i) * D + (c0 + c) * W, acc[i][c]);
}

template <int NB>
static inline void att_values(const float* p, const float* vt, long bk, long D, float* o, long rows) {
    for (long c0 = 0; c0 < D / W; c0 += NB) {
        long r = 0;
        for (; r + MB_ATTV <= rows; r += MB_ATTV) att_values_tile<MB_ATTV, NB>(p, vt, bk, D, o, r, c0);
        for (; r < rows; r++) att_values_tile<1, NB>(p, vt, bk, D, o, r, c0);
    }
}

// One unit: query positions p0..p1 (all G heads of this key/value head) against keys 0..ctx. Query row (p, g)
// is q[p * q_stride + g * D]. visible0: how many keys row 0 sees (causal: prefix + p0 + 1, and one more per
// position; otherwise ctx for every row). D is a multiple of W.
template <typename T>
static inline void prefill_attention_impl(const T* q, const float* kt, const float* vt, long s_pad, T* out,
                                          long q_stride, long out_stride, long D, long G, long p0, long p1,
                                          long last_key, long visible0, bool causal, float scale, float* scratch) {
    const long rows = (p1 - p0) * G;
    float* o = scratch;                 // [rows, D] unnormalised outputs
    float* qs = o + ATT_ROWS * D;       // [rows, D] scaled queries
    float* s = qs + ATT_ROWS * D;       // [rows, ATT_KEYS] scores, then probabilities
    float* m = s + 2 * ATT_ROWS * ATT_KEYS;
    float* l = m + ATT_ROWS;
    for (long r = 0; r < rows; r++) {
        const T* src = q + (p0 + r / G) * q_stride + (r % G) * D;
        for (long d = 0; d < D; d += W) vstore(qs + r * D + d, vmul(vloadT(src + d), vset1(scale)));
        for (long d = 0; d < D; d += W) vstore(o + r * D + d, vzero());
        m[r] = -__builtin_inff(), l[r] = 0.f;
    }
    for (long j0 = 0; j0 < last_key; j0 += ATT_KEYS) {
        const long bk = last_key - j0 < ATT_KEYS ? last_key - j0 : ATT_KEYS;
        for (long c0 = 0; c0 < ATT_KEYS / W; c0 += NB_ATT) {
            long r = 0;
            for (; r + MB_ATT <= rows; r += MB_ATT) att_scores_tile<MB_ATT, NB_ATT>(qs, kt + j0, s_pad, D, s, r, c0);
            for (; r < rows; r++) att_scores_tile<1, NB_ATT>(qs, kt + j0, s_pad, D, s, r, c0);
        }
        att_softmax_block<false>(s, rows, G, j0, bk, visible0, causal, m, l, o, D);
        if ((D / W) % 4 == 0)
            att_values<4>(s, vt + j0 * D, bk, D, o, rows);
        else if ((D / W) % 2 == 0)
            att_values<2>(s, vt + j0 * D, bk, D, o, rows);
        else
            att_values<1>(s, vt + j0 * D, bk, D, o, rows);
    }
    att_store_outputs(o, l, rows, G, D, out, out_stride, p0);
}

long prefill_attention_scratch(long D) { return att_scratch_floats(D); }
void prefill_attention_f32(const float* q, const float* kt, const float* vt, long s_pad, float* out, long q_stride,
                           long out_stride, long D, long G, long p0, long p1, long last_key, long visible0,
                           bool causal, float scale, float* scratch) {
    prefill_attention_impl(q, kt, vt, s_pad, out, q_stride, out_stride, D, G, p0, p1, last_key, visible0, causal,
                           scale, scratch);
}
void prefill_attention_bf16(const uint16_t* q, const float* kt, const float* vt, long s_pad, uint16_t* out,
                            long q_stride, long out_stride, long D, long G, long p0, long p1, long last_key,
                            long visible0, bool causal, float scale, float* scratch) {
    prefill_attention_impl(q, kt, vt, s_pad, out, q_stride, out_stride, D, G, p0, p1, last_key, visible0, causal,
                           scale, scratch);
}

#else  // VLS_DPBF16: bf16 inputs, pairs multiplied by vdpbf16ps

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// s[r, keys] = scale * q[r] . k[keys]: q rows as bf16 pairs (one 32-bit broadcast per pair), kt [D/2, s_pad, 2]
template <int MB, int NB>
static inline void dp_scores_tile(const uint32_t* const* qrows, const uint16_t* kt, long s_pad, long D, float scale,
                                  float* s, long r0, long c0) {
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vzero();
    for (long t = 0; t < D / 2; t++) {
        __m512i kv[NB];
        for (int c = 0; c < NB; c++) kv[c] = _mm512_loadu_si512(kt + (t * s_pad + (c0 + c) * W) * 2);
        for (int i = 0; i < MB; i++) {
            const __m512i qb = _mm512_set1_epi32(static_cast<int>(qrows[r0 + i][t]));
            for (int c = 0; c < NB; c++) acc[i][c] = dp(acc[i][c], qb, kv[c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(s + (r0 + i) * ATT_KEYS + (c0 + c) * W, vmul(acc[i][c], vset1(scale)));
}

// o[r, d-vectors] += sum over key pairs of p[r, pair] . vt[pair, d, :], p as bf16 pairs [rows, ATT_KEYS / 2]
template <int MB, int NB>
static inline void dp_values_tile(const uint32_t* p, const uint16_t* vt, long pairs, long D, float* o, long r0,
                                  long c0) {
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vload(o + (r0 + i) * D + (c0 + c) * W);
    for (long u = 0; u < pairs; u++) {
        __m512i vv[NB];
        for (int c = 0; c < NB; c++) vv[c] = _mm512_loadu_si512(vt + (u * D + (c0 + c) * W) * 2);
        for (int i = 0; i < MB; i++) {
            const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[(r0 + i) * (ATT_KEYS / 2) + u]));
            for (int c = 0; c < NB; c++) acc[i][c] = dp(acc[i][c], pb, vv[c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(o + (r0 + i) * D + (c0 + c) * W, acc[i][c]);
}

template <int NB>
static inline void dp_values(const uint32_t* p, const uint16_t* vt, long pairs, long D, float* o, long rows) {
    for (long c0 = 0; c0 < D / W; c0 += NB) {
        long r = 0;
        for (; r + 4 <= rows; r += 4) dp_values_tile<4, NB>(p, vt, pairs, D, o, r, c0);
        for (; r < rows; r++) dp_values_tile<1, NB>(p, vt, pairs, D, o, r, c0);
    }
}

void prefill_attention_dp(const uint16_t* q, const uint16_t* kt, const uint16_t* vt, long s_pad, uint16_t* out,
                          long q_stride, long out_stride, long D, long G, long p0, long p1, long last_key,
                          long visible0, bool causal, float scale, float* scratch) {
    const long rows = (p1 - p0) * G;
    float* o = scratch;                                             // [rows, D] unnormalised outputs
    float* s = o + ATT_ROWS * D;                                    // [rows, ATT_KEYS] scores, probabilities
    uint16_t* pb = reinterpret_cast<uint16_t*>(s + ATT_ROWS * ATT_KEYS);  // [rows, ATT_KEYS] probabilities, bf16
    float* m = s + 2 * ATT_ROWS * ATT_KEYS;
    float* l = m + ATT_ROWS;
    const uint32_t* qrows[ATT_ROWS];
    for (long r = 0; r < rows; r++) {
        qrows[r] = reinterpret_cast<const uint32_t*>(q + (p0 + r / G) * q_stride + (r % G) * D);
        for (long d = 0; d < D; d += W) vstore(o + r * D + d, vzero());
        m[r] = -__builtin_inff(), l[r] = 0.f;
    }
    for (long j0 = 0; j0 < last_key; j0 += ATT_KEYS) {
        const long bk = last_key - j0 < ATT_KEYS ? last_key - j0 : ATT_KEYS;
        long r = 0;
        for (; r + 4 <= rows; r += 4) dp_scores_tile<4, 4>(qrows, kt + j0 * 2, s_pad, D, scale, s, r, 0);
        for (; r < rows; r++) dp_scores_tile<1, 4>(qrows, kt + j0 * 2, s_pad, D, scale, s, r, 0);
        att_softmax_block<true>(s, rows, G, j0, bk, visible0, causal, m, l, o, D);
        for (long i = 0; i < rows * ATT_KEYS; i += W) vstore_bf16(pb + i, vload(s + i));  // exact: rounded above
        const uint32_t* p = reinterpret_cast<const uint32_t*>(pb);
        const long pairs = (bk + 1) / 2;  // an odd tail pairs with a zero probability and a zero-padded value
        if ((D / W) % 4 == 0)
            dp_values<4>(p, vt + j0 * D, pairs, D, o, rows);
        else if ((D / W) % 2 == 0)
            dp_values<2>(p, vt + j0 * D, pairs, D, o, rows);
        else
            dp_values<1>(p, vt + j0 * D, pairs, D, o, rows);
    }
    att_store_outputs(o, l, rows, G, D, out, out_stride, p0);
}

#endif
