// Shared math over the vector vocabulary of each copy (vmin, vmax, vround_int, vpow2i, vzero_below and the
// arithmetic): included inside each copy's namespace.

// e^x, one polynomial for every copy (Cephes' expf, ~1 ulp): x = n ln2 + r, e^r by its Taylor-like series,
// times 2^n. Below -87.3 (e^x under fp32's normal range; -inf included) exactly 0.
static inline vf vexp(vf x0) {
    const vf x = vmax(vmin(x0, vset1(89.f)), vset1(-87.3f));  // above ln(FLT_MAX) ~88.72 the result is inf
    const vf n = vround_int(vmul(x, vset1(1.44269504088896341f)));
    const vf r = vsub(vsub(x, vmul(n, vset1(0.693359375f))), vmul(n, vset1(-2.12194440e-4f)));
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vadd(vfma(p, vmul(r, r), r), vset1(1.f));
    // 2^n as 2^min(n, 127) * (1 or 2): n reaches 128 from x ~88.38 on, where e^x is still finite
    const vf n1 = vmin(n, vset1(127.f));
    return vzero_below(vmul(vmul(p, vpow2i(vsub(n, n1))), vpow2i(n1)), x0, -87.3f);
}
