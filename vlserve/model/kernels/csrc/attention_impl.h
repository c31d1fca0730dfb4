// Prefill attention (the prompt's queries against its keys, causal or not), flash style: per unit of work (one
// key/value head, one block of queries with all the query heads that share that key/value head) the keys are
// streamed in blocks, the scores of a block stay in a small fp32 buffer, and the softmax is kept online (running
// max and sum per query row), so no [queries x keys] matrix is ever written out. Accumulation is fp32
// throughout; bf16 inputs are widened exactly and the output is rounded once. Uses the vector vocabulary of
// kernels_impl.h plus vmax, vhmax and vexp.

constexpr long ATT_ROWS = VLS_ATT_ROWS;
constexpr long ATT_KEYS = 64;  // keys per block: a multiple of every ISA's width

static inline float scalar_of(float x) { return x; }
static inline float scalar_of(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline long att_scratch_floats(long D) {
    return 2 * ATT_ROWS * D + ATT_ROWS * ATT_KEYS + 2 * D * ATT_KEYS + 2 * ATT_ROWS;
}

// scores[r, 0:ATT_KEYS] = qs[r] . kt[:, j] for a tile of MB rows x NB vectors of keys
template <int MB, int NB>
static inline void att_scores_tile(const float* qs, const float* kt, long D, float* s, long r0, long c0) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vzero();
    for (long d = 0; d < D; d++) {
        vf kv[NB];
        for (int c = 0; c < NB; c++) kv[c] = vload(kt + d * ATT_KEYS + (c0 + c) * W);
        for (int i = 0; i < MB; i++) {
            const vf qb = vset1(qs[(r0 + i) * D + d]);
            for (int c = 0; c < NB; c++) acc[i][c] = vfma(qb, kv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(s + (r0 + i) * ATT_KEYS + (c0 + c) * W, acc[i][c]);
}

// o[r, d-vectors c0..c0+NB) += sum_j p[r, j] * vb[j, :] for MB rows
template <int MB, int NB>
static inline void att_values_tile(const float* p, const float* vb, long bk, long D, float* o, long r0, long c0) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) acc[i][c] = vload(o + (r0 + i) * D + (c0 + c) * W);
    for (long j = 0; j < bk; j++) {
        vf vv[NB];
        for (int c = 0; c < NB; c++) vv[c] = vload(vb + j * D + (c0 + c) * W);
        for (int i = 0; i < MB; i++) {
            const vf pb = vset1(p[(r0 + i) * ATT_KEYS + j]);
            for (int c = 0; c < NB; c++) acc[i][c] = vfma(pb, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int c = 0; c < NB; c++) vstore(o + (r0 + i) * D + (c0 + c) * W, acc[i][c]);
}

template <int NB>
static inline void att_values(const float* p, const float* vb, long bk, long D, float* o, long rows) {
    for (long c0 = 0; c0 < D / W; c0 += NB) {
        long r = 0;
        for (; r + MB_ATTV <= rows; r += MB_ATTV) att_values_tile<MB_ATTV, NB>(p, vb, bk, D, o, r, c0);
        for (; r < rows; r++) att_values_tile<1, NB>(p, vb, bk, D, o, r, c0);
    }
}

// One unit: query positions p0..p1 (all G heads of this key/value head) against keys 0..ctx. Query row
// (p, g) is q[p * q_stride + g * D]; key j is k[j * k_stride], its value v[j * v_stride]. causal: position p
// sees keys up to prefix + p. D is a multiple of W.
template <typename T>
static inline void prefill_attention_impl(const T* q, const T* k, const T* v, T* out, long q_stride, long k_stride,
                                          long v_stride, long out_stride, long D, long G, long p0, long p1, long ctx,
                                          long prefix, bool causal, float scale, float* scratch) {
    const long rows = (p1 - p0) * G;
    float* qs = scratch;                  // [rows, D] scaled queries
    float* o = qs + ATT_ROWS * D;         // [rows, D] unnormalised outputs
    float* s = o + ATT_ROWS * D;          // [rows, ATT_KEYS] scores, then probabilities
    float* kt = s + ATT_ROWS * ATT_KEYS;  // [D, ATT_KEYS] the key block, transposed
    float* vb = kt + D * ATT_KEYS;        // [ATT_KEYS, D] the value block
    float* m = vb + ATT_KEYS * D;         // running max per row
    float* l = m + ATT_ROWS;              // running sum per row
    const float neg_inf = -__builtin_inff();
    for (long r = 0; r < rows; r++) {
        const T* src = q + (p0 + r / G) * q_stride + (r % G) * D;
        for (long d = 0; d < D; d += W) vstore(qs + r * D + d, vmul(vloadT(src + d), vset1(scale)));
        for (long d = 0; d < D; d += W) vstore(o + r * D + d, vzero());
        m[r] = neg_inf, l[r] = 0.f;
    }
    const long last_key = causal ? prefix + p1 : ctx;  // keys [0, last_key) matter to some row
    for (long j0 = 0; j0 < last_key; j0 += ATT_KEYS) {
        const long bk = last_key - j0 < ATT_KEYS ? last_key - j0 : ATT_KEYS;
        for (long j = 0; j < ATT_KEYS; j++) {
            if (j < bk) {
                const T* kr = k + (j0 + j) * k_stride;
                const T* vr = v + (j0 + j) * v_stride;
                for (long d = 0; d < D; d++) kt[d * ATT_KEYS + j] = scalar_of(kr[d]);
                for (long d = 0; d < D; d += W) vstore(vb + j * D + d, vloadT(vr + d));
            } else {
                for (long d = 0; d < D; d++) kt[d * ATT_KEYS + j] = 0.f;
            }
        }
        for (long c0 = 0; c0 < ATT_KEYS / W; c0 += NB_ATT) {
            long r = 0;
            for (; r + MB_ATT <= rows; r += MB_ATT) att_scores_tile<MB_ATT, NB_ATT>(qs, kt, D, s, r, c0);
            for (; r < rows; r++) att_scores_tile<1, NB_ATT>(qs, kt, D, s, r, c0);
        }
        for (long r = 0; r < rows; r++) {
            float* sr = s + r * ATT_KEYS;
            const long visible = (causal ? prefix + p0 + r / G + 1 : ctx) - j0;  // keys of this block it sees
            const long n = visible < bk ? (visible > 0 ? visible : 0) : bk;
            if (n == 0) {  // sees none of this block's keys
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
                const vf e = vexp(vsub(vload(sr + j), vset1(m_new)));
                vstore(sr + j, e);
                sum = vadd(sum, e);
            }
            l[r] = l[r] * corr + vsum(sum);
            m[r] = m_new;
            if (corr != 1.f)
                for (long d = 0; d < D; d += W) vstore(o + r * D + d, vmul(vload(o + r * D + d), vset1(corr)));
        }
        if ((D / W) % 4 == 0)
            att_values<4>(s, vb, bk, D, o, rows);
        else if ((D / W) % 2 == 0)
            att_values<2>(s, vb, bk, D, o, rows);
        else
            att_values<1>(s, vb, bk, D, o, rows);
    }
    for (long r = 0; r < rows; r++) {
        T* dst = out + (p0 + r / G) * out_stride + (r % G) * D;
        const vf inv = vset1(1.f / l[r]);
        for (long d = 0; d < D; d += W) vstoreT(dst + d, vmul(vload(o + r * D + d), inv), true);
    }
}

long prefill_attention_scratch(long D) { return att_scratch_floats(D); }
void prefill_attention_f32(const float* q, const float* k, const float* v, float* out, long q_stride, long k_stride,
                           long v_stride, long out_stride, long D, long G, long p0, long p1, long ctx, long prefix,
                           bool causal, float scale, float* scratch) {
    prefill_attention_impl(q, k, v, out, q_stride, k_stride, v_stride, out_stride, D, G, p0, p1, ctx, prefix, causal,
                           scale, scratch);
}
void prefill_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, long q_stride,
                            long k_stride, long v_stride, long out_stride, long D, long G, long p0, long p1, long ctx,
                            long prefix, bool causal, float scale, float* scratch) {
    prefill_attention_impl(q, k, v, out, q_stride, k_stride, v_stride, out_stride, D, G, p0, p1, ctx, prefix, causal,
                           scale, scratch);
}
