// nvfp4-probe device code, part 4: the layer's non-linear ops (RMSNorm, RoPE, mHC with Sinkhorn,
// attention with sink and compressed rows, the compressor's pooling, the indexer's scores and
// top-k, the attention's key lists, the router's top-k). Each kernel computes what
// src/device/kern.rs computes on the host, bit for bit: reductions accumulate exact f32 products
// in f64 and round once, transcendentals are evaluated in f64 and rounded once, the short f32
// chains run in the host's order, selections follow the host's total order. fmad=false, so every
// f32 operation rounds where the host's does; the explicit __f*_rn intrinsics say so where it
// matters.

#define INFINITY __uint_as_float(0x7F800000u)

__device__ __forceinline__ double exp64(float x) { return exp((double)x); }

// 1 / (1 + e^-x) in f64, rounded once (kern::sigmoid).
__device__ __forceinline__ float sigmoid_f(float x) {
    return __double2float_rn(__ddiv_rn(1.0, __dadd_rn(1.0, exp(-(double)x))));
}

// max(x, 0) + ln(1 + e^-|x|) in f64, rounded once (kern::softplus). fmax ignores a NaN operand
// like Rust's f64::max; the NaN then comes back through the log term.
__device__ __forceinline__ float softplus_f(float x) {
    double d = (double)x;
    return __double2float_rn(__dadd_rn(fmax(d, 0.0), log1p(exp(-fabs(d)))));
}

// Rust's f32::max / f32::min: a NaN operand yields the other one.
__device__ __forceinline__ float rmax(float a, float b) { return fmaxf(a, b); }

__device__ __forceinline__ double block_sum_d(double v, double* sh) {
    // blockDim.x is a multiple of 32, at most 1024
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0) {
        for (u32 i = 0; i < (blockDim.x >> 5); i++) s += sh[i];
        sh[0] = s;
    }
    __syncthreads();
    s = sh[0];
    __syncthreads();
    return s;
}

// ---- RMSNorm ---------------------------------------------------------------------------------

// r[row] = 1 / sqrt(sum(x^2) / cols + eps) with the sum in f64, rounded once (kern::rms_inv).
// One warp per row of a row-major [rows, cols] matrix.
extern "C" __global__ void row_rms(const float* x, u64 rows, u64 cols, float eps, float* r) {
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 nw = ((u64)gridDim.x * blockDim.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    for (u64 row = warp; row < rows; row += nw) {
        const float* xr = x + row * cols;
        double ss = 0.0;
        for (u64 c = lane; c < cols; c += 32) {
            double v = (double)xr[c];
            ss = __dadd_rn(ss, __dmul_rn(v, v));
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, o);
        if (lane == 0) {
            double m = __dadd_rn(__ddiv_rn(ss, (double)cols), (double)eps);
            r[row] = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(m)));
        }
    }
}

// out = (x * r[row]) * w[col] (w may be 0: no weight), rounded to BF16 when round != 0.
extern "C" __global__ void rms_apply(const float* x, u64 rows, u64 cols, const float* r, const float* w,
                                     int round, float* out) {
    GRID_STRIDE(i, rows * cols) {
        u64 row = i / cols, c = i % cols;
        float v = __fmul_rn(x[i], r[row]);
        if (w) v = __fmul_rn(v, w[c]);
        out[i] = round ? bf16_round(v) : v;
    }
}

// ---- RoPE ------------------------------------------------------------------------------------

// Rotate the pairs of dims [off, off + 2*half) of each of the nh heads (width dh) of row p of
// x [rows, nh*dh] with row p of the host's cos/sin table [rows, half]. mode bit 0: inverse, -sin
// (RopeTable::apply); bit 1: transformers' half-split pairs (j, j + half) instead of the
// interleaved (2j, 2j + 1) (RopeTable::apply_split). In place.
extern "C" __global__ void rope_rows(float* x, u64 rows, u64 nh, u64 dh, u64 off, u64 half,
                                     const float* cs, const float* sn, int mode) {
    GRID_STRIDE(i, rows * nh * half) {
        u64 p = i / (nh * half), rem = i % (nh * half), hh = rem / half, j = rem % half;
        float* v = x + p * nh * dh + hh * dh + off;
        float c = cs[p * half + j], s = sn[p * half + j];
        if (mode & 1) s = -s;
        u64 ia = (mode & 2) ? j : 2 * j, ib = (mode & 2) ? j + half : 2 * j + 1;
        float a = v[ia], b = v[ib];
        v[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[ib] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// ---- mHC ---------------------------------------------------------------------------------------

// In-place softmax of a short row, as kern::softmax: max in f32 (NaN ignored), e = exp(x - max)
// in f64, p = e / sum in f64, rounded once; an all -inf row becomes zeros.
__device__ void softmax_row(float* row, u32 n) {
    float m = -INFINITY;
    for (u32 i = 0; i < n; i++) m = rmax(m, row[i]);
    if (m == -INFINITY) {
        for (u32 i = 0; i < n; i++) row[i] = 0.0f;
        return;
    }
    double s = 0.0;
    for (u32 i = 0; i < n; i++) s = __dadd_rn(s, exp64(__fsub_rn(row[i], m)));
    for (u32 i = 0; i < n; i++) row[i] = __double2float_rn(__ddiv_rn(exp64(__fsub_rn(row[i], m)), s));
}

#define HC_MAX 8

// Per token (one thread each): pre [hc], post [hc], comb [hc, hc] from the mixing row m (already
// scaled by rho), with Sinkhorn (kern::hc_coeffs / kern::sinkhorn). hc <= HC_MAX.
extern "C" __global__ void hc_coeffs(const float* m, u64 t, u64 mix, u64 hc, const float* scale,
                                     const float* base, u64 iters, float eps, float* pre, float* post,
                                     float* comb) {
    GRID_STRIDE(ti, t) {
        const float* mr = m + ti * mix;
        for (u64 j = 0; j < hc; j++) {
            pre[ti * hc + j] = __fadd_rn(sigmoid_f(__fadd_rn(__fmul_rn(mr[j], scale[0]), base[j])), eps);
            post[ti * hc + j] = __fmul_rn(2.0f, sigmoid_f(__fadd_rn(__fmul_rn(mr[hc + j], scale[1]), base[hc + j])));
        }
        float c[HC_MAX * HC_MAX];
        u32 n = (u32)hc;
        for (u32 i = 0; i < n * n; i++) c[i] = __fadd_rn(__fmul_rn(mr[2 * hc + i], scale[2]), base[2 * hc + i]);
        for (u32 r = 0; r < n; r++) {
            softmax_row(c + r * n, n);
            for (u32 k = 0; k < n; k++) c[r * n + k] = __fadd_rn(c[r * n + k], eps);
        }
        u64 rounds = iters > 0 ? iters : 1;
        for (u64 it = 0; it < rounds; it++) {
            if (it > 0) {
                for (u32 r = 0; r < n; r++) {
                    float s = 0.0f;
                    for (u32 k = 0; k < n; k++) s = __fadd_rn(s, c[r * n + k]);
                    for (u32 k = 0; k < n; k++) c[r * n + k] = __fdiv_rn(c[r * n + k], __fadd_rn(s, eps));
                }
            }
            for (u32 k = 0; k < n; k++) {
                float s = 0.0f;
                for (u32 j = 0; j < n; j++) s = __fadd_rn(s, c[j * n + k]);
                for (u32 j = 0; j < n; j++) c[j * n + k] = __fdiv_rn(c[j * n + k], __fadd_rn(s, eps));
            }
        }
        for (u32 i = 0; i < n * n; i++) comb[ti * hc * hc + i] = c[i];
    }
}

// y[t, c] = sum_j coef[t, j] * x[t, j, c] in stream order from +0 (kern::hc_weighted_sum), rounded
// to BF16 when round != 0.
extern "C" __global__ void hc_wsum(const float* x, const float* coef, u64 t, u64 hc, u64 d, int round,
                                   float* y) {
    GRID_STRIDE(i, t * d) {
        u64 ti = i / d, c = i % d;
        float a = 0.0f;
        for (u64 j = 0; j < hc; j++) a = __fadd_rn(a, __fmul_rn(coef[ti * hc + j], x[(ti * hc + j) * d + c]));
        y[i] = round ? bf16_round(a) : a;
    }
}

// out[t, k, c] = post[t, k] * y[t, c] + sum_j comb[t, j, k] * x[t, j, c] (kern::hc_post). One
// thread per (t, c) computes the hc outputs k (x's column read once from memory, then cached).
extern "C" __global__ void hc_post(const float* y, const float* x, const float* post, const float* comb,
                                   u64 t, u64 hc, u64 d, int round, float* out) {
    GRID_STRIDE(i, t * d) {
        u64 ti = i / d, c = i % d;
        float yv = y[i];
        for (u64 k = 0; k < hc; k++) {
            float a = __fmul_rn(post[ti * hc + k], yv);
            for (u64 j = 0; j < hc; j++)
                a = __fadd_rn(a, __fmul_rn(comb[ti * hc * hc + j * hc + k], x[(ti * hc + j) * d + c]));
            out[(ti * hc + k) * d + c] = round ? bf16_round(a) : a;
        }
    }
}

// ---- attention ---------------------------------------------------------------------------------

// The keys of the query at position p (attn_core, attn_gather): its window rows [lo, lo + nwin)
// and the count of compressed rows below its causal bound, min((p + 1) / ratio, n_c) (0 when
// ratio = 0).
__device__ __forceinline__ void attn_window(u64 p, u64 win, u64* lo, u64* nwin) {
    *lo = (p + 1 > win) ? p + 1 - win : 0;
    *nwin = win > 0 ? p + 1 - *lo : 0;
}
__device__ __forceinline__ u64 attn_causal(u64 p, u64 ratio, u64 n_c) {
    u64 m = 0;
    if (ratio > 0) {
        m = (p + 1) / ratio;
        if (m > n_c) m = n_c;
    }
    return m;
}

// The softmax denominator of attn_core's scores sc[0..n) with the sink's logit sk, both less the
// max mx: exp(sk - mx) + sum exp(s - mx) in f64 (the block's threads split the keys).
__device__ __forceinline__ double attn_den(const float* sc, u32 n, float mx, float sk, double* red) {
    double part = 0.0;
    for (u32 key = threadIdx.x; key < n; key += blockDim.x) part = __dadd_rn(part, exp64(__fsub_rn(sc[key], mx)));
    return __dadd_rn(exp64(__fsub_rn(sk, mx)), block_sum_d(part, red));
}

// One block per (query ti, head); blockDim.x a multiple of 32. Query ti sits at position p = q0 + ti.
// Keys: the window [p - win + 1, p] of kv (kv's row 0 is position kv0), then the compressed rows of cmp
// [n_c, dh] below the causal count m = min((p + 1) / ratio, n_c) (none when ratio = 0): with a selection
// (has_sel) the entries of sel[ti * kk ..] in list order up to the first -1 (ascending lists), else 0..m.
// Dynamic shared memory: 32 doubles for reductions, then max_keys floats for the scores and max_keys ints
// for the key rows. Scores f32(q.k in f64) * scale; probabilities f32(exp(s - max) / den) with the f64
// denominator exp(sink - max) + sum exp(s - max); out = f32(sum p * k in f64) (kern::attention_core).
extern "C" __global__ void attn_core(const float* q, const float* kv, const float* cmp, const int* sel, u64 kk,
                                     int has_sel, u64 ratio, const float* sink, u64 t, u64 h, u64 dh, u64 n_c,
                                     u64 win, u64 max_keys, u64 q0, u64 kv0, float scale, float* out) {
    extern __shared__ double shd[];
    double* red = shd;                      // 32 doubles
    float* sc = (float*)(shd + 32);         // scores, window first
    int* kidx = (int*)(sc + max_keys);      // key rows: >= 0 window row, < 0 compressed row -(j+1)
    u64 task = blockIdx.x;
    if (task >= t * h) return;
    u64 ti = task / h, head = task % h;
    u64 p = q0 + ti;
    const float* qv = q + (ti * h + head) * dh;
    u64 lo, nwin;
    attn_window(p, win, &lo, &nwin);
    // list the keys (thread 0; cheap next to the dot products)
    __shared__ u32 nkeys;
    if (threadIdx.x == 0) {
        u32 n = 0;
        for (u64 k = 0; k < nwin; k++) kidx[n++] = (int)(lo + k - kv0);
        u64 m = attn_causal(p, ratio, n_c);
        if (has_sel) {
            for (u64 e = 0; e < kk; e++) {
                int v = sel[ti * kk + e];
                if (v < 0) break;
                if ((u64)v < m && n < max_keys) kidx[n++] = -(v + 1);
            }
        } else {
            for (u64 j = 0; j < m; j++) kidx[n++] = -(int)(j + 1);
        }
        nkeys = n;
    }
    __syncthreads();
    u32 nk = nkeys;
    u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (u32 key = wid; key < nk; key += nwarps) {
        int kr = kidx[key];
        const float* kp = kr >= 0 ? kv + (u64)kr * dh : cmp + (u64)(-kr - 1) * dh;
        double s = 0.0;
        for (u64 c = lane; c < dh; c += 32) s = __dadd_rn(s, __dmul_rn((double)qv[c], (double)kp[c]));
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) sc[key] = __fmul_rn(__double2float_rn(s), scale);
    }
    __syncthreads();
    float sk = sink[head];
    __shared__ float mxs;
    if (threadIdx.x == 0) {
        float mx = sk;
        for (u32 key = 0; key < nk; key++) mx = rmax(mx, sc[key]);
        mxs = mx;
    }
    __syncthreads();
    float mx = mxs;
    double den = attn_den(sc, nk, mx, sk, red);
    for (u32 key = threadIdx.x; key < nk; key += blockDim.x)
        sc[key] = __double2float_rn(__ddiv_rn(exp64(__fsub_rn(sc[key], mx)), den));
    __syncthreads();
    for (u64 c = threadIdx.x; c < dh; c += blockDim.x) {
        double acc = 0.0;
        for (u32 key = 0; key < nk; key++) {
            int kr = kidx[key];
            const float* kp = kr >= 0 ? kv + (u64)kr * dh : cmp + (u64)(-kr - 1) * dh;
            acc = __dadd_rn(acc, __dmul_rn((double)sc[key], (double)kp[c]));
        }
        out[(ti * h + head) * dh + c] = __double2float_rn(acc);
    }
}

// The attention of a block of queries as two batched DGEMMs (backend/attn.rs `attn_blas`): the
// keys that attn_core visits, gathered per query and widened to f64, kg[ti, key, :] (rows past the
// query's key count zero), and the count nk[ti]. The keys are attn_core's list: the window rows,
// then the compressed rows below the causal count m, from the selection when there is one. The
// selection lists here are sel_lists' (ascending, then -1), so the rows attn_core keeps from them
// are a prefix of the list (found by binary search) and key i of the query is found without making
// the list. Grid: x = query, y = groups of ATTN_GATHER_KEYS keys; every thread copies elements.
#define ATTN_GATHER_KEYS 16
extern "C" __global__ void attn_gather(const float* kv, const float* cmp, const int* sel, u64 kk, int has_sel,
                                       u64 ratio, u64 t, u64 dh, u64 n_c, u64 win, u64 max_keys, u64 q0,
                                       u64 kv0, int* nk, double* kg) {
    __shared__ u64 geo[3];  // window start, window rows, compressed rows
    u64 ti = blockIdx.x;
    if (ti >= t) return;
    u64 p = q0 + ti;
    if (threadIdx.x == 0) {
        u64 lo, nwin;
        attn_window(p, win, &lo, &nwin);
        u64 m = attn_causal(p, ratio, n_c);
        u64 room = max_keys > nwin ? max_keys - nwin : 0;
        u64 nc = m;
        if (has_sel) {
            // the length of the prefix of entries v with 0 <= v < m
            const int* sl = sel + ti * kk;
            u64 a = 0, b = kk;
            while (a < b) {
                u64 mid = (a + b) / 2;
                int v = sl[mid];
                if (v >= 0 && (u64)v < m) a = mid + 1; else b = mid;
            }
            nc = a;
        }
        if (nc > room) nc = room;
        geo[0] = lo; geo[1] = nwin; geo[2] = nc;
        if (blockIdx.y == 0) nk[ti] = (int)(nwin + nc);
    }
    __syncthreads();
    const u64 lo = geo[0], nwin = geo[1], n = nwin + geo[2];
    const u64 k0 = (u64)blockIdx.y * ATTN_GATHER_KEYS;
    double* dst = kg + ti * max_keys * dh;
    // key by key (the source row is the block's, found once), threads across the row
    for (u64 key = k0; key < k0 + ATTN_GATHER_KEYS && key < max_keys; key++) {
        const float* src = nullptr;
        if (key < nwin) {
            src = kv + (lo + key - kv0) * dh;
        } else if (key < n) {
            u64 j = key - nwin;
            src = cmp + (has_sel ? (u64)sel[ti * kk + j] : j) * dh;
        }
        double* d = dst + key * dh;
        for (u64 c = threadIdx.x; c < dh; c += blockDim.x) d[c] = src ? (double)src[c] : 0.0;
    }
}

// attn_core's softmax over one (query, head) row of f64 scores s[row, 0..max_keys) (the first
// nk[row / h] are the keys'): scores f32(s) * scale, probabilities f32(exp(s - max) / den) with the
// f64 denominator exp(sink - max) + sum exp(s - max), written widened to f64 into pr (0 past the
// keys). One block per row; dynamic shared memory: max_keys floats.
extern "C" __global__ void attn_softmax(const double* s, const int* nk, const float* sink, u64 rows, u64 h,
                                        u64 max_keys, float scale, double* pr) {
    extern __shared__ float sc[];
    __shared__ double red[32];
    __shared__ float mxw[32];
    u64 row = blockIdx.x;
    if (row >= rows) return;
    u32 n = (u32)nk[row / h];
    const double* sr = s + row * max_keys;
    double* pw = pr + row * max_keys;
    float sk = sink[row % h];
    float mx = sk;
    for (u32 key = threadIdx.x; key < n; key += blockDim.x) {
        float v = __fmul_rn(__double2float_rn(sr[key]), scale);
        sc[key] = v;
        mx = rmax(mx, v);
    }
    for (int o = 16; o > 0; o >>= 1) mx = rmax(mx, __shfl_down_sync(0xffffffffu, mx, o));
    u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
    if (lane == 0) mxw[w] = mx;
    __syncthreads();
    mx = sk;
    for (u32 i = 0; i < (blockDim.x >> 5); i++) mx = rmax(mx, mxw[i]);
    double den = attn_den(sc, n, mx, sk, red);
    for (u64 key = threadIdx.x; key < max_keys; key += blockDim.x)
        pw[key] = key < n ? (double)__double2float_rn(__ddiv_rn(exp64(__fsub_rn(sc[key], mx)), den)) : 0.0;
}

// ---- compressor --------------------------------------------------------------------------------

// Gated softmax pooling (kern::compress_pool), one thread per (block b, channel ch): slots are the
// previous block through channels [0, dc) when c = 2 and b > 0, then this block through channels
// [(c-1)*dc, c*dc); gate = g + ape; softmax with f64 exp and sum; value = f32(sum p * a in f64).
__device__ __forceinline__ void pool_slot(const float* a, const float* g, const float* ape, u64 w, u64 tok,
                                          u64 j, u64 col, float* gate, float* val) {
    *gate = __fadd_rn(g[tok * w + col], ape[j * w + col]);
    *val = a[tok * w + col];
}

extern "C" __global__ void compress_pool(const float* a, const float* g, const float* ape, u64 n_c, u64 dc,
                                         u64 ratio, float* out) {
    u64 c = ratio == 4 ? 2 : 1, w = c * dc, off = (c - 1) * dc;
    GRID_STRIDE(i, n_c * dc) {
        u64 b = i / dc, ch = i % dc;
        bool prev = c == 2 && b > 0;
        float gate, val, m = -INFINITY;
        // pass 1: max over the slots in order
        if (prev)
            for (u64 j = 0; j < ratio; j++) {
                pool_slot(a, g, ape, w, (b - 1) * ratio + j, j, ch, &gate, &val);
                m = rmax(m, gate);
            }
        for (u64 j = 0; j < ratio; j++) {
            pool_slot(a, g, ape, w, b * ratio + j, j, off + ch, &gate, &val);
            m = rmax(m, gate);
        }
        if (m == -INFINITY) {
            // every probability is 0: the f64 sum of 0 * v (NaN where v is not finite)
            double acc = 0.0;
            if (prev)
                for (u64 j = 0; j < ratio; j++) {
                    pool_slot(a, g, ape, w, (b - 1) * ratio + j, j, ch, &gate, &val);
                    acc = __dadd_rn(acc, __dmul_rn(0.0, (double)val));
                }
            for (u64 j = 0; j < ratio; j++) {
                pool_slot(a, g, ape, w, b * ratio + j, j, off + ch, &gate, &val);
                acc = __dadd_rn(acc, __dmul_rn(0.0, (double)val));
            }
            out[i] = __double2float_rn(acc);
            continue;
        }
        // pass 2: the f64 denominator
        double s = 0.0;
        if (prev)
            for (u64 j = 0; j < ratio; j++) {
                pool_slot(a, g, ape, w, (b - 1) * ratio + j, j, ch, &gate, &val);
                s = __dadd_rn(s, exp64(__fsub_rn(gate, m)));
            }
        for (u64 j = 0; j < ratio; j++) {
            pool_slot(a, g, ape, w, b * ratio + j, j, off + ch, &gate, &val);
            s = __dadd_rn(s, exp64(__fsub_rn(gate, m)));
        }
        // pass 3: sum of f32 probabilities times values, in f64
        double acc = 0.0;
        if (prev)
            for (u64 j = 0; j < ratio; j++) {
                pool_slot(a, g, ape, w, (b - 1) * ratio + j, j, ch, &gate, &val);
                float p = __double2float_rn(__ddiv_rn(exp64(__fsub_rn(gate, m)), s));
                acc = __dadd_rn(acc, __dmul_rn((double)p, (double)val));
            }
        for (u64 j = 0; j < ratio; j++) {
            pool_slot(a, g, ape, w, b * ratio + j, j, off + ch, &gate, &val);
            float p = __double2float_rn(__ddiv_rn(exp64(__fsub_rn(gate, m)), s));
            acc = __dadd_rn(acc, __dmul_rn((double)p, (double)val));
        }
        out[i] = __double2float_rn(acc);
    }
}

// ---- indexer -------------------------------------------------------------------------------------

// score[ti, j] = sum_h relu(f32(q[ti, h].k[j] in f64)) * w[ti, h], heads in order from +0 in f32
// (kern::indexer_scores). One warp per (ti, j): lanes split the dot products, lane 0 sums heads.
extern "C" __global__ void indexer_scores(const float* q, const float* ki, const float* w, u64 t, u64 hi,
                                          u64 di, u64 n_c, float* out) {
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 nw = ((u64)gridDim.x * blockDim.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    for (u64 item = warp; item < t * n_c; item += nw) {
        u64 ti = item / n_c, j = item % n_c;
        const float* kj = ki + j * di;
        float acc = 0.0f;
        for (u64 hh = 0; hh < hi; hh++) {
            const float* qh = q + (ti * hi + hh) * di;
            double s = 0.0;
            for (u64 c = lane; c < di; c += 32) s = __dadd_rn(s, __dmul_rn((double)qh[c], (double)kj[c]));
            for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
            float sf = __double2float_rn(s);
            acc = __fadd_rn(acc, __fmul_rn(fmaxf(sf, 0.0f), w[ti * hi + hh]));
        }
        if (lane == 0) out[item] = acc;
    }
}

// indexer_scores from f64 dot products already made (backend/attn.rs, batched as one DGEMM):
// s[(ti * hi + hh) * m + j] = q[ti, hh].k[j] in f64; score[ti * ld + j] = sum_h relu(f32(s)) *
// w[ti, h], heads in order from +0 in f32. One thread per (ti, j).
extern "C" __global__ void indexer_reduce(const double* s, const float* w, u64 t, u64 hi, u64 m, u64 ld,
                                          float* out) {
    GRID_STRIDE(i, t * m) {
        u64 ti = i / m, j = i % m;
        float acc = 0.0f;
        for (u64 hh = 0; hh < hi; hh++) {
            float sf = __double2float_rn(s[(ti * hi + hh) * m + j]);
            acc = __fadd_rn(acc, __fmul_rn(fmaxf(sf, 0.0f), w[ti * hi + hh]));
        }
        out[ti * ld + j] = acc;
    }
}

// The attention's per-query key lists from the indexer's selection (kern::selection_lists and the op's check),
// one thread per query row: the entries of sel[row, 0..kk) that are rows below n_c (truncated like Rust's `as`),
// ascending without repeats (an insertion that costs O(1) per entry on the indexer's ascending lists), then -1.
// The lowest flat index of an entry that is neither -1 nor an integral row below n_c goes to *bad (atomicMin; the
// caller sets it to all ones first).
extern "C" __global__ void sel_lists(const float* sel, u64 t, u64 kk, u64 n_c, int* lists, u64* bad) {
    GRID_STRIDE(row, t) {
        const float* s = sel + row * kk;
        int* o = lists + row * kk;
        u64 n = 0;
        for (u64 e = 0; e < kk; e++) {
            float x = s[e];
            bool row_ok = x >= 0.0f && (double)x < (double)n_c;
            if (!(x == -1.0f || (row_ok && truncf(x) == x))) atomicMin(bad, row * kk + e);
            if (!row_ok) continue;
            int v = (int)x;
            u64 j = n;
            while (j > 0 && o[j - 1] > v) j--;
            if (j > 0 && o[j - 1] == v) continue;
            for (u64 k = n; k > j; k--) o[k] = o[k - 1];
            o[j] = v;
            n++;
        }
        for (u64 e = n; e < kk; e++) o[e] = -1;
    }
}

// The order key of an indexer score for the top-k (ops::topk_order): NaN as -inf, -0 as +0, then the f32 bits mapped
// so that unsigned order is numeric order.
__device__ __forceinline__ u32 topk_key(float v) {
    if (isnan(v)) v = -INFINITY;
    if (v == 0.0f) v = 0.0f;
    u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define TOPK_THREADS 256

// The indexer's top-k of one block of queries (kern::topk_rows of each), one CUDA block of TOPK_THREADS per query:
// query i of the block sits at position p = t0 + i and sees m = min((p + 1) / ratio, n_c) compressed rows, whose
// scores are sc[i * ld ..][0, m). m <= kk: the rows 0..m. Else the kk first by (larger key, lower row on equal keys):
// a radix select over the keys, 8 bits at a time from the top, finds the kk-th largest key K and how many rows of key
// K are kept (rem, the lowest rows), then one pass in row order writes every row of key > K and the first rem rows of
// key K, so the rows come out ascending. Writes row p of out [t, kk]: row indices as f32, -1 after the last.
extern "C" __global__ void indexer_topk(const float* sc, u64 rows, u64 ld, u64 t0, u64 ratio, u64 n_c, u64 kk,
                                        float* out) {
    __shared__ u32 hist[256];
    __shared__ u32 weq[TOPK_THREADS / 32], wsel[TOPK_THREADS / 32];
    __shared__ u32 sh_prefix;
    __shared__ u64 sh_rem;
    u64 i = blockIdx.x;
    if (i >= rows) return;
    u64 p = t0 + i;
    u64 m = ratio > 0 ? (p + 1) / ratio : 0;
    if (m > n_c) m = n_c;
    float* o = out + p * kk;
    if (m <= kk) {
        for (u64 e = threadIdx.x; e < kk; e += blockDim.x) o[e] = e < m ? (float)e : -1.0f;
        return;
    }
    const float* s = sc + i * ld;
    u32 prefix = 0, mask = 0;
    u64 rem = kk;  // the target's rank (from 1, largest first) among the keys that match prefix under mask
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (u64 j = threadIdx.x; j < m; j += blockDim.x) {
            u32 k = topk_key(s[j]);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 cum = 0;
            for (int b = 255; b >= 0; b--) {
                if (cum + hist[b] >= rem) {
                    sh_prefix = prefix | ((u32)b << shift);
                    sh_rem = rem - cum;
                    break;
                }
                cum += hist[b];
            }
        }
        __syncthreads();
        prefix = sh_prefix;
        rem = sh_rem;
        mask |= 255u << shift;
    }
    // prefix is K: keep every key > K and the first rem keys == K in row order
    u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 below = (1u << lane) - 1u;
    u64 eq_seen = 0, written = 0;
    for (u64 base = 0; base < m; base += blockDim.x) {
        u64 j = base + threadIdx.x;
        u32 k = j < m ? topk_key(s[j]) : 0u;
        bool gt = j < m && k > prefix, eq = j < m && k == prefix;
        u32 beq = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) weq[wid] = __popc(beq);
        __syncthreads();
        u64 eq_before = eq_seen + __popc(beq & below);
        for (u32 w = 0; w < wid; w++) eq_before += weq[w];
        bool take = gt || (eq && eq_before < rem);
        u32 bsel = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wsel[wid] = __popc(bsel);
        __syncthreads();
        u64 pos = written + __popc(bsel & below);
        for (u32 w = 0; w < wid; w++) pos += wsel[w];
        if (take && pos < kk) o[pos] = (float)j;
        for (u32 w = 0; w < nw; w++) {
            eq_seen += weq[w];
            written += wsel[w];
        }
        __syncthreads();
    }
    for (u64 e = written + threadIdx.x; e < kk; e += blockDim.x) o[e] = -1.0f;
}

// ---- router ------------------------------------------------------------------------------------

// Score of logit l: 0 = sqrt(softplus), 1 = sigmoid, 2 = softmax over the row (row max m and f64
// sum s precomputed).
__device__ __forceinline__ float route_score(float l, int f, float m, double s) {
    if (f == 0) return __fsqrt_rn(softplus_f(l));
    if (f == 1) return sigmoid_f(l);
    if (m == -INFINITY) return 0.0f;
    return __double2float_rn(__ddiv_rn(exp64(__fsub_rn(l, m)), s));
}

__device__ __forceinline__ float nan_low(float v) { return isnan(v) ? -INFINITY : v; }

// One thread per token (kern::route): top-k of score + bias by repeated selection (larger first,
// ties toward the lower index, NaN as -inf), weights = chosen scores / their f32 sum (norm != 0),
// times rs. Expert ids written as f32.
// given != null (a hash router: expert ids [t, k] as f32, from its table): no selection (bias is
// not read and may be null), the weights of the given experts (kern::hash_route_weights), idx = given.
extern "C" __global__ void route_topk(const float* logits, const float* bias, u64 t, u64 e, u64 k, int f,
                                      int norm, float rs, const float* given, float* wts, float* idx) {
    GRID_STRIDE(ti, t) {
        const float* l = logits + ti * e;
        float m = -INFINITY;
        double s = 0.0;
        if (f == 2) {
            for (u64 i = 0; i < e; i++) m = rmax(m, l[i]);
            if (m != -INFINITY)
                for (u64 i = 0; i < e; i++) s = __dadd_rn(s, exp64(__fsub_rn(l[i], m)));
        }
        long long prev = -1;
        float pk = 0.0f;
        float wsum = 0.0f;
        for (u64 slot = 0; slot < k; slot++) {
            long long best = given ? (long long)given[ti * k + slot] : -1;
            float bk = 0.0f;
            for (u64 i = 0; i < e && !given; i++) {
                float ki = nan_low(__fadd_rn(route_score(l[i], f, m, s), bias[i]));
                if (prev >= 0 && !(pk > ki || (pk == ki && (u64)prev < i))) continue;
                if (best < 0 || ki > bk || (ki == bk && i < (u64)best)) {
                    best = (long long)i;
                    bk = ki;
                }
            }
            if (best < 0) best = 0;
            prev = best;
            pk = bk;
            float sc = route_score(l[best], f, m, s);
            wts[ti * k + slot] = sc;
            idx[ti * k + slot] = (float)best;
            wsum = __fadd_rn(wsum, sc);
        }
        for (u64 slot = 0; slot < k; slot++) {
            float v = wts[ti * k + slot];
            if (norm) v = __fdiv_rn(v, wsum);
            wts[ti * k + slot] = __fmul_rn(v, rs);
        }
    }
}

// out = a + b element by element (the residual sum; f32, rounded once like the host's `+`).
extern "C" __global__ void add_f32(const float* a, const float* b, u64 n, float* out) {
    GRID_STRIDE(i, n) { out[i] = __fadd_rn(a[i], b[i]); }
}

// ---- the model families' ops (device::family) -----------------------------------------------

// out[r, c] = x[r, c0 + c] for c < w: columns [c0, c0 + w) of the rows of x [rows, cols].
extern "C" __global__ void copy_cols(const float* x, u64 rows, u64 cols, u64 c0, u64 w, float* out) {
    GRID_STRIDE(i, rows * w) {
        u64 r = i / w, c = i % w;
        out[i] = x[r * cols + c0 + c];
    }
}

// MLA's keys and values (family::mla_keys): for token ti and head i (row = ti * h + i),
// k[row] = [kvb[row][0, nope), kva[ti][lora, lora + rope)] and v[row] = kvb[row][nope, nope + dv).
extern "C" __global__ void mla_kv(const float* kvb, const float* kva, u64 t, u64 h, u64 nope, u64 rope,
                                  u64 dv, u64 lora, float* k, float* v) {
    u64 dq = nope + rope, w = dq + dv;
    GRID_STRIDE(i, t * h * w) {
        u64 row = i / w, c = i % w, ti = row / h;
        const float* b = kvb + row * (nope + dv);
        if (c < nope) k[row * dq + c] = b[c];
        else if (c < dq) k[row * dq + c] = kva[ti * (lora + rope) + lora + (c - nope)];
        else v[row * dv + (c - dq)] = b[nope + (c - dq)];
    }
}

// gpt-oss's clamped GLU (family::glu_unit), one thread per unit j: its gate at g[stride * j], its
// up at u[stride * j] (the fused projection interleaved: u = g + 1, stride 2; separate gate and up
// projections: stride 1). g = min(gate, L) (a NaN gate gives L, as Rust's f32::min), u = clamp(up,
// -L, L) (a NaN up stays NaN, as Rust's clamp), out = f32((u + 1) * g / (1 + exp(-alpha * g))) in
// f64, alpha the f64 of bits alpha_bits; rounded to BF16 when round != 0.
extern "C" __global__ void glu_oss(const float* gp, const float* up, u64 stride, u64 n, float limit,
                                   u64 alpha_bits, int round, float* out) {
    double alpha = __longlong_as_double((long long)alpha_bits);
    GRID_STRIDE(j, n) {
        float gf = fminf(gp[stride * j], limit);
        float uf = up[stride * j];
        if (uf < -limit) uf = -limit;
        if (uf > limit) uf = limit;
        double g = (double)gf, u = (double)uf;
        double glu = __ddiv_rn(g, __dadd_rn(1.0, exp(__dmul_rn(-alpha, g))));
        float o = __double2float_rn(__dmul_rn(__dadd_rn(u, 1.0), glu));
        out[j] = round ? bf16_round(o) : o;
    }
}

// The largest of every thread's v (NaN ignored, as Rust's f32::max); every thread gets it.
__device__ __forceinline__ float block_max_f(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = rmax(v, __shfl_down_sync(0xffffffffu, v, o));
    u32 lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = sh[0];
        for (u32 i = 1; i < (blockDim.x >> 5); i++) m = rmax(m, sh[i]);
        sh[0] = m;
    }
    __syncthreads();
    float m = sh[0];
    __syncthreads();
    return m;
}

// Keys per tile of gqa_attn's scores in shared memory (GQA_TILE in src/backend/attn.rs).
#define GQA_TILE 1024

// The scores of keys j0 .. j0 + n of key/value head g for the query qv [dq], one warp per key:
// sc[key] = f32(q.k in f64) * scale.
__device__ void gqa_scores(const float* qv, const float* k, u64 j0, u32 n, u64 kvh, u64 g, u64 dq,
                           float scale, float* sc) {
    u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 key = wid; key < n; key += nw) {
        const float* kp = k + ((j0 + key) * kvh + g) * dq;
        double s = 0.0;
        for (u64 c = lane; c < dq; c += 32) s = __dadd_rn(s, __dmul_rn((double)qv[c], (double)kp[c]));
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) sc[key] = __fmul_rn(__double2float_rn(s), scale);
    }
}

// Causal grouped-query attention (family::gqa_core): q [t, h*dq], k [q0 + t, kvh*dq], v [q0 + t,
// kvh*dv] -> out [t, h*dv]; query row ti is key row p = q0 + ti (q0 keys of earlier token chunks
// come first); query head i reads key/value head i / (h / kvh). One CUDA block per (query ti,
// head) task (grid-stride over the t*h tasks), blockDim.x a multiple of 32. The keys of query ti
// are [lo, p] with lo = max(0, p + 1 - win) (win = q0 + t: every earlier key; 0: none); every sum
// runs over keys counted from lo, so a query's bits do not depend on q0. Scores
// f32(q.k in f64) * scale; max over them and the head's sink logit (has_sink); den = exp(sink -
// max) + the f64 sum of exp(s - max); p = f32(exp(s - max) / den); out = f32(sum p * v in f64) in
// key order (one thread per output channel), rounded to BF16 when round != 0. The scores live in
// shared memory GQA_TILE keys at a time: a query of more keys computes them again in each of the
// three passes (max, denominator, weighted sum) instead of holding them, so nothing of size t*t
// exists. Dynamic shared memory: 32 doubles, dv doubles (the sums), GQA_TILE floats.
extern "C" __global__ void gqa_attn(const float* q, const float* k, const float* v, const float* sinks,
                                    int has_sink, u64 t, u64 q0, u64 h, u64 kvh, u64 dq, u64 dv, u64 win, float scale,
                                    int round, float* out) {
    extern __shared__ double shd[];
    double* red = shd;
    double* acc = shd + 32;
    float* sc = (float*)(acc + dv);
    __shared__ float fred[32];
    u64 group = h / kvh;
    for (u64 task = blockIdx.x; task < t * h; task += gridDim.x) {
        u64 ti = task / h, head = task % h, g = head / group;
        const float* qv = q + task * dq;
        u64 p = q0 + ti;
        u64 lo = p + 1 > win ? p + 1 - win : 0;
        u64 nk = p + 1 - lo;
        bool resident = nk <= GQA_TILE;
        float sk = has_sink ? sinks[head] : -INFINITY;
        // pass 1: the scores (kept when they fit one tile) and their max
        float mloc = -INFINITY;
        for (u64 base = 0; base < nk; base += GQA_TILE) {
            u32 n = (u32)(nk - base < GQA_TILE ? nk - base : GQA_TILE);
            gqa_scores(qv, k, lo + base, n, kvh, g, dq, scale, sc);
            __syncthreads();
            for (u32 key = threadIdx.x; key < n; key += blockDim.x) mloc = rmax(mloc, sc[key]);
            __syncthreads();
        }
        float mx = rmax(sk, block_max_f(mloc, fred));
        // pass 2: the f64 denominator
        double part = 0.0;
        for (u64 base = 0; base < nk; base += GQA_TILE) {
            u32 n = (u32)(nk - base < GQA_TILE ? nk - base : GQA_TILE);
            if (!resident) {
                gqa_scores(qv, k, lo + base, n, kvh, g, dq, scale, sc);
                __syncthreads();
            }
            for (u32 key = threadIdx.x; key < n; key += blockDim.x)
                part = __dadd_rn(part, exp64(__fsub_rn(sc[key], mx)));
            __syncthreads();
        }
        double den = block_sum_d(part, red);
        if (has_sink) den = __dadd_rn(exp64(__fsub_rn(sk, mx)), den);
        // pass 3: the probabilities, then the values weighted in key order per channel
        for (u64 c = threadIdx.x; c < dv; c += blockDim.x) acc[c] = 0.0;
        for (u64 base = 0; base < nk; base += GQA_TILE) {
            u32 n = (u32)(nk - base < GQA_TILE ? nk - base : GQA_TILE);
            if (!resident) {
                gqa_scores(qv, k, lo + base, n, kvh, g, dq, scale, sc);
                __syncthreads();
            }
            for (u32 key = threadIdx.x; key < n; key += blockDim.x)
                sc[key] = __double2float_rn(__ddiv_rn(exp64(__fsub_rn(sc[key], mx)), den));
            __syncthreads();
            for (u64 c = threadIdx.x; c < dv; c += blockDim.x) {
                const float* vp = v + ((lo + base) * kvh + g) * dv + c;
                double a = acc[c];
                for (u32 key = 0; key < n; key++)
                    a = __dadd_rn(a, __dmul_rn((double)sc[key], (double)vp[(u64)key * kvh * dv]));
                acc[c] = a;
            }
            __syncthreads();
        }
        for (u64 c = threadIdx.x; c < dv; c += blockDim.x) {
            float o = __double2float_rn(acc[c]);
            out[task * dv + c] = round ? bf16_round(o) : o;
        }
        __syncthreads();
    }
}
