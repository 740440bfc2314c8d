// nvfp4-probe device code, part 3: fused statistics (one pass over a tensor and its reference) and
// the MoE gather / SwiGLU / combine kernels.

// acc (f64, 5): sum |x| over finite x; dot, |x|^2, |r|^2, |x-r|^2 over pairs where both are finite.
// cnt (u64, 12): nan, inf, zeros (finite x), finite x, new non-finite (x non-finite, r finite),
//   non-finite pairs, amax(x) bits, amax over finite pairs of x and of r (f32 bits), the max-error
//   key (f32 error bits << 32 | ~index: largest error, first index on ties), finite pairs, pairs
//   with x == r (an index selection's agreement, read with the other counts: no host read).
#define ACC_N 5
#define CNT_N 12

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ u64 warp_sum_u(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ u64 warp_max_u(u64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        u64 w = __shfl_down_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

// One element (and its reference value b when there is one) into a thread's sums.
struct StatAcc {
    double sabs, dot, nx, nr, ne;
    u64 nan, inf, zeros, fin, newnf, bad, pairs, key, eq;
    float amax, ax, ar;
};
__device__ __forceinline__ void stat_add(StatAcc& s, float a, bool has_r, float b, u64 i) {
    if (isnan(a)) s.nan++;
    else if (isinf(a)) s.inf++;
    else {
        s.amax = fmaxf(s.amax, fabsf(a));
        if (a == 0.0f) s.zeros++;
        s.sabs += (double)fabsf(a);
        s.fin++;
    }
    if (has_r) {
        if (a == b) s.eq++;
        if (!isfinite(a) || !isfinite(b)) {
            s.bad++;
            if (!isfinite(a) && isfinite(b)) s.newnf++;
        } else {
            double da = (double)a, db = (double)b, e = da - db;
            s.dot += da * db;
            s.nx += da * da;
            s.nr += db * db;
            s.ne += e * e;
            s.ax = fmaxf(s.ax, fabsf(a));
            s.ar = fmaxf(s.ar, fabsf(b));
            float ef = (float)fabs(e);
            u64 k = ((u64)__float_as_uint(ef) << 32) | (u64)(0xFFFFFFFFu - (u32)i);
            s.key = k > s.key ? k : s.key;
            s.pairs++;
        }
    }
}

// The grid is kept small (the per-warp atomics at the end), so each thread reads four values of x
// (and of r) per load when both are 16-byte aligned, and issues the loads of FS_UNROLL grid
// strides before it adds any of them: with one float per load a thread had one load in flight and
// the pass ran near memory latency, not bandwidth (0.35 s of a 4,096-token V4-Flash run's device
// time); with one float4 of each per step, at two blocks per SM, still at ~0.7 TB/s (1.66 s of a
// 65,536-token run). Sums are f64 and their order was never fixed (atomics).
#define FS_UNROLL 4
__device__ __forceinline__ void stat_add4(StatAcc& s, float4 a, bool has_r, float4 b, u64 j) {
    stat_add(s, a.x, has_r, b.x, 4 * j);
    stat_add(s, a.y, has_r, b.y, 4 * j + 1);
    stat_add(s, a.z, has_r, b.z, 4 * j + 2);
    stat_add(s, a.w, has_r, b.w, 4 * j + 3);
}
extern "C" __global__ void fused_stats(const float* x, const float* r, u64 n, double* acc, u64* cnt) {
    StatAcc s = {0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0f, 0.0f, 0.0f};
    const bool has_r = r != nullptr;
    const bool vec = ((u64)x & 15u) == 0u && ((u64)r & 15u) == 0u;
    const u64 nv = vec ? n / 4 : 0;
    const u64 stride = (u64)blockDim.x * gridDim.x;
    const float4* x4 = (const float4*)x;
    const float4* r4 = (const float4*)r;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; j + (FS_UNROLL - 1) * stride < nv; j += FS_UNROLL * stride) {
        float4 a[FS_UNROLL], b[FS_UNROLL];
#pragma unroll
        for (int u = 0; u < FS_UNROLL; u++) {
            a[u] = x4[j + u * stride];
            b[u] = has_r ? r4[j + u * stride] : zero;
        }
#pragma unroll
        for (int u = 0; u < FS_UNROLL; u++) stat_add4(s, a[u], has_r, b[u], j + u * stride);
    }
    for (; j < nv; j += stride) stat_add4(s, x4[j], has_r, has_r ? r4[j] : zero, j);
    GRID_STRIDE(t, n - 4 * nv) {
        const u64 i = 4 * nv + t;
        stat_add(s, x[i], has_r, has_r ? r[i] : 0.0f, i);
    }
    double sabs = s.sabs, dot = s.dot, nx = s.nx, nr = s.nr, ne = s.ne;
    u64 nan = s.nan, inf = s.inf, zeros = s.zeros, fin = s.fin, newnf = s.newnf, bad = s.bad,
        pairs = s.pairs, key = s.key, eq = s.eq;
    float amax = s.amax, ax = s.ax, ar = s.ar;
    sabs = warp_sum_d(sabs);
    dot = warp_sum_d(dot);
    nx = warp_sum_d(nx);
    nr = warp_sum_d(nr);
    ne = warp_sum_d(ne);
    nan = warp_sum_u(nan);
    inf = warp_sum_u(inf);
    zeros = warp_sum_u(zeros);
    fin = warp_sum_u(fin);
    newnf = warp_sum_u(newnf);
    bad = warp_sum_u(bad);
    pairs = warp_sum_u(pairs);
    eq = warp_sum_u(eq);
    u64 m0 = warp_max_u((u64)__float_as_uint(amax));
    u64 m1 = warp_max_u((u64)__float_as_uint(ax));
    u64 m2 = warp_max_u((u64)__float_as_uint(ar));
    key = warp_max_u(key);
    if ((threadIdx.x & 31u) == 0u) {
        if (sabs != 0.0) atomicAdd(&acc[0], sabs);
        if (dot != 0.0) atomicAdd(&acc[1], dot);
        if (nx != 0.0) atomicAdd(&acc[2], nx);
        if (nr != 0.0) atomicAdd(&acc[3], nr);
        if (ne != 0.0) atomicAdd(&acc[4], ne);
        add_nonzero(&cnt[0], nan);
        add_nonzero(&cnt[1], inf);
        add_nonzero(&cnt[2], zeros);
        add_nonzero(&cnt[3], fin);
        add_nonzero(&cnt[4], newnf);
        add_nonzero(&cnt[5], bad);
        if (m0) atomicMax(&cnt[6], m0);
        if (m1) atomicMax(&cnt[7], m1);
        if (m2) atomicMax(&cnt[8], m2);
        if (key) atomicMax(&cnt[9], key);
        add_nonzero(&cnt[10], pairs);
        add_nonzero(&cnt[11], eq);
    }
}

// After fused_stats over (x, r): the two values at the largest error's index (what a comparison
// reports next to the error), so the host reads them in the same download as the sums.
// out[0] = x's bits | 1 << 32 when there is such an index, out[1] = r's bits. One thread.
extern "C" __global__ void stats_pick(const float* x, const float* r, u64 n, const u64* cnt, u64* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    u64 a = 0, b = 0;
    if (r && cnt[10] > 0) {
        u64 idx = 0xFFFFFFFFull - (cnt[9] & 0xFFFFFFFFull);
        if (idx < n) {
            a = (u64)__float_as_uint(x[idx]) | (1ull << 32);
            b = (u64)__float_as_uint(r[idx]);
        }
    }
    out[0] = a;
    out[1] = b;
}

// ---- MoE -----------------------------------------------------------------------------------

// out[i, :] = x[rows[i], :]. Grid: x = output row, y = column blocks of blockDim.x.
extern "C" __global__ void gather_rows(const float* x, const int* rows, u64 nrows, u64 d, float* out) {
    u64 r = blockIdx.x, c = (u64)blockIdx.y * blockDim.x + threadIdx.x;
    if (r < nrows && c < d) out[r * d + c] = x[(u64)rows[r] * d + c];
}

// x * sigmoid(x) in f64, rounded once (as the CPU reference computes it).
__device__ __forceinline__ float silu_f(float v) {
    double d = (double)v;
    return (float)__dmul_rn(d, __ddiv_rn(1.0, __dadd_rn(1.0, exp(-d))));
}

// SwiGLU with the clamp: g' = min(g, L), u' = clamp(u, +-L) (NaN kept), a = silu(g') * u'.
// round bit 0: a is rounded to BF16 (the path's storage rounding); bit 1: g and u are stored
// (rounded to BF16) first, as an expert's gate and up projections are. limit <= 0: no clamp.
extern "C" __global__ void swiglu_clamp(const float* g, const float* u, u64 n, float limit, int round,
                                        float* out) {
    GRID_STRIDE(i, n) {
        float g2 = g[i], u2 = u[i];
        if (round & 2) {
            g2 = bf16_round(g2);
            u2 = bf16_round(u2);
        }
        if (limit > 0.0f) {
            g2 = fminf(g2, limit);
            if (!isnan(u2)) u2 = fminf(fmaxf(u2, -limit), limit);
        }
        float a = __fmul_rn(silu_f(g2), u2);
        out[i] = (round & 1) ? bf16_round(a) : a;
    }
}

// Routed combine in the CPU reference's order: for token t, acc = 0, then for its slots j = 0..k
// (sorted by expert id) acc += w_j * y[row_j]; row -1 = empty slot.
extern "C" __global__ void moe_combine(const float* y, const int* slot_row, const float* slot_w, u64 t,
                                       u64 k, u64 d, float* out) {
    GRID_STRIDE(i, t * d) {
        u64 ti = i / d, c = i % d;
        float acc = 0.0f;
        for (u64 j = 0; j < k; j++) {
            int row = slot_row[ti * k + j];
            if (row >= 0) acc = __fadd_rn(acc, __fmul_rn(slot_w[ti * k + j], y[(u64)row * d + c]));
        }
        out[i] = acc;
    }
}

// ---- f64-accumulating GEMM support ------------------------------------------------------------

// Where element i of a [rows, cols] matrix with row stride ld lies: i itself when the rows are
// contiguous (ld == cols, nearly every call: no 64-bit division).
__device__ __forceinline__ u64 strided_at(u64 i, u64 cols, u64 ld) {
    return ld == cols ? i : (i / cols) * ld + i % cols;
}

// f32 or BF16-bits matrix [rows, cols] with row stride ld -> contiguous f64 (exact).
extern "C" __global__ void to_f64(const void* in, int bf16, u64 rows, u64 cols, u64 ld, double* out) {
    GRID_STRIDE(i, rows * cols) {
        const u64 j = strided_at(i, cols, ld);
        float v = bf16 ? bf16_to_f32(((const u16*)in)[j]) : ((const float*)in)[j];
        out[i] = (double)v;
    }
}

// contiguous f64 [rows, cols] -> f32 with row stride ld, rounded once to nearest even.
extern "C" __global__ void from_f64(const double* in, u64 rows, u64 cols, u64 ld, float* out) {
    GRID_STRIDE(i, rows * cols) out[strided_at(i, cols, ld)] = __double2float_rn(in[i]);
}

// Few-row GEMM with f64 accumulation (the routed experts see a handful of tokens each):
// y[r, c] = sum_k x[r, k] * w[c, k] for r < m <= 8, rounded once to f32. One block of
// SMALL_WARPS warps computes four output columns: the warps split k (lanes striding over
// consecutive k, so rows of w are read coalesced), each warp reduces its partial sums with
// shuffles, and thread (r, j) adds the warps' partials in warp order. Operands are f32, or BF16
// bits when bf != 0. Launch with blockDim.x = 32 * SMALL_WARPS.
#define SMALL_M 8
#define SMALL_WARPS 8
__device__ __forceinline__ float ld_op(const void* p, u64 i, int bf) {
    return bf ? bf16_to_f32(((const u16*)p)[i]) : ((const float*)p)[i];
}
extern "C" __global__ void gemm_small_f64(const void* x, const void* w, int bf, u64 m, u64 n, u64 k,
                                          u64 ldx, float* y, u64 ldy) {
    __shared__ double part[SMALL_WARPS][SMALL_M][4];
    u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    const u32 step = 32u * SMALL_WARPS;
    for (u64 c0 = (u64)blockIdx.x * 4; c0 < n; c0 += (u64)gridDim.x * 4) {
        double acc[SMALL_M][4];
#pragma unroll
        for (int r = 0; r < SMALL_M; r++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[r][j] = 0.0;
        for (u64 kk = (u64)wid * 32 + lane; kk < k; kk += step) {
            double wv[4];
#pragma unroll
            for (int j = 0; j < 4; j++) wv[j] = (c0 + j < n) ? (double)ld_op(w, (c0 + j) * k + kk, bf) : 0.0;
#pragma unroll
            for (int r = 0; r < SMALL_M; r++) {
                if ((u64)r < m) {
                    double xv = (double)ld_op(x, (u64)r * ldx + kk, bf);
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[r][j] = __dadd_rn(acc[r][j], __dmul_rn(xv, wv[j]));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < SMALL_M; r++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                double v = acc[r][j];
                for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
                if (lane == 0) part[wid][r][j] = v;
            }
        }
        __syncthreads();
        if (threadIdx.x < SMALL_M * 4) {
            u32 r = threadIdx.x >> 2, j = threadIdx.x & 3u;
            if ((u64)r < m && c0 + j < n) {
                double v = 0.0;
                for (u32 q = 0; q < SMALL_WARPS; q++) v = __dadd_rn(v, part[q][r][j]);
                y[(u64)r * ldy + c0 + j] = __double2float_rn(v);
            }
        }
        __syncthreads();
    }
}

// ---- moe_gemm_f64: the routed experts' linears of one path in one launch -------------------------
// y[r, c] = sum_k x[r, k] * w_e[c, k] for the rows r of every tile, each tile up to MOE_R
// consecutive rows of the gathered activations that one routed expert sees, its weight w_e
// decoded from the stored bytes on the fly, exactly as the dequantization kernels decode it:
//   NVFP4 (conv 0 compressed-tensors q = s / global, 1 ModelOpt q = s * global, 2 the served
//   operand q = s): w = e2m1 * q, then * post (MT_POST); nibbles read the other way round with
//   MT_SWAP (dequant_nvfp4's swap);
//   MXFP4 (conv 3): w = e2m1 * ue8m0 over 32-element blocks (dequant_mxfp4);
//   MT_WBF16: w rounded to BF16 (what the BF16 operand of gemm_small_f64 holds).
// x is f32 or BF16 bits (xbf). Products of two f32 values are exact in f64, so the fused
// multiply-add below equals gemm_small_f64's add of a rounded product; the sum is f64, rounded
// once to f32, then (MT_EPI) scale_round's bf16(y * mul). No [n, k] f32 copy of any weight is
// written or read: each expert weight is read once per tile as 4.5 bits per element.
// Grid: x = column groups of MOE_C (grid-stride), y = tiles. Block: 32 * MOE_WARPS threads; each
// lane takes 16-element pieces of k (k % 16 == 0; x rows 16-byte aligned).
#define MOE_R 4
#define MOE_C 8
#define MOE_WARPS 4
#define MT_CONV 3u
#define MT_POST 4u
#define MT_SWAP 8u
#define MT_WBF16 16u
#define MT_EPI 32u
struct MoeTile {
    u64 packed, scales;
    u32 row0, rows;
    float global, post, mul;
    u32 flags;
};
// A routed expert's weight from its e2m1 value e and block scale q under the tile's decode: the
// product rounded to f32, then the post-scale (MT_POST) and the BF16 rounding (MT_WBF16). The one
// rule of every experts kernel and of moe_mmt_f64's decode table.
__device__ __forceinline__ float moe_weight(float e, float q, const MoeTile& t, bool post, bool wbf) {
    float w = __fmul_rn(e, q);
    if (post) w = __fmul_rn(w, t.post);
    if (wbf) w = bf16_round(w);
    return w;
}
// The work of one tile of R rows (1 <= R <= MOE_R; instantiated per row count, so a tile of one
// token does no work for the rows it lacks). A lane loads its 16 x values per row and piece once
// as f32 and converts them to f64 at each use: a variant that converted them once per half piece
// (more registers, 2 blocks per SM instead of 3) ran 31 % slower on the H200 (BENCHMARKS.md).
template <int R>
__device__ __forceinline__ void moe_tile(const void* x, int xbf, u64 ldx, const MoeTile& t, u64 n,
                                         u64 k, float* y, u64 ldy, const float* mq, const float2* me,
                                         double (*part)[MOE_R][MOE_C]) {
    const bool mx = (t.flags & MT_CONV) == 3u, post = (t.flags & MT_POST) != 0u,
               wbf = (t.flags & MT_WBF16) != 0u;
    const u8* packed = (const u8*)t.packed;
    const u8* scales = (const u8*)t.scales;
    const u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
    const u64 pieces = k / 16;
    for (u64 c0 = (u64)blockIdx.x * MOE_C; c0 < n; c0 += (u64)gridDim.x * MOE_C) {
        double acc[R][MOE_C];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < MOE_C; j++) acc[r][j] = 0.0;
        for (u64 p = threadIdx.x; p < pieces; p += blockDim.x) {
            float xv[R][16];
#pragma unroll
            for (int r = 0; r < R; r++) {
                u64 o = (u64)(t.row0 + r) * ldx + p * 16;
                if (xbf) {
                    const uint4* q = (const uint4*)((const u16*)x + o);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        uint4 u = q[h];
                        u32 wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            xv[r][8 * h + 2 * i] = __uint_as_float(wd[i] << 16);
                            xv[r][8 * h + 2 * i + 1] = __uint_as_float(wd[i] & 0xFFFF0000u);
                        }
                    }
                } else {
                    const float4* q = (const float4*)((const float*)x + o);
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        float4 f = q[h];
                        xv[r][4 * h] = f.x; xv[r][4 * h + 1] = f.y;
                        xv[r][4 * h + 2] = f.z; xv[r][4 * h + 3] = f.w;
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < MOE_C; j++) {
                u64 c = c0 + j;
                if (c >= n) continue;
                u64 e0 = c * k + p * 16;
                uint2 pk = *(const uint2*)(packed + e0 / 2);
                float q = mq[scales[mx ? e0 / 32 : e0 / 16]];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    u32 byte = ((i < 4 ? pk.x : pk.y) >> (8 * (i & 3))) & 0xFFu;
                    float2 e = me[byte];
                    const float w0 = moe_weight(e.x, q, t, post, wbf);
                    const float w1 = moe_weight(e.y, q, t, post, wbf);
                    double d0 = (double)w0, d1 = (double)w1;
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        acc[r][j] = __fma_rn((double)xv[r][2 * i], d0, acc[r][j]);
                        acc[r][j] = __fma_rn((double)xv[r][2 * i + 1], d1, acc[r][j]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int j = 0; j < MOE_C; j++) {
                double v = acc[r][j];
                for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
                if (lane == 0) part[wid][r][j] = v;
            }
        }
        __syncthreads();
        if (threadIdx.x < R * MOE_C) {
            u32 r = threadIdx.x / MOE_C, j = threadIdx.x % MOE_C;
            if (c0 + j < n) {
                double v = 0.0;
                for (u32 w = 0; w < MOE_WARPS; w++) v = __dadd_rn(v, part[w][r][j]);
                float o = __double2float_rn(v);
                if (t.flags & MT_EPI) o = bf16_round(__fmul_rn(o, t.mul));
                y[(u64)(t.row0 + r) * ldy + c0 + j] = o;
            }
        }
        __syncthreads();
    }
}

// A tile's block scale for scale byte i, with its convention's global scale applied.
__device__ __forceinline__ float moe_scale(const MoeTile& t, u32 i) {
    const u32 conv = t.flags & MT_CONV;
    float s = conv == 3u ? ue8m0_decode(i) : e4m3_decode(i);
    return conv == 0u ? __fdiv_rn(s, t.global) : (conv == 1u ? __fmul_rn(s, t.global) : s);
}

// The tile's 256 block scales (moe_scale).
__device__ __forceinline__ void moe_scales(const MoeTile& t, float* mq) {
    for (u32 i = threadIdx.x; i < 256u; i += blockDim.x) mq[i] = moe_scale(t, i);
    __syncthreads();
}

// Whether a tile's code bytes hold their two elements high nibble first (MT_SWAP; never MXFP4).
__device__ __forceinline__ bool moe_swapped(const MoeTile& t) {
    return (t.flags & MT_SWAP) != 0u && (t.flags & MT_CONV) != 3u;
}

// The decode tables of a tile: its block scales and, per code byte, its two e2m1 values.
__device__ __forceinline__ void moe_tables(const MoeTile& t, float* mq, float2* me) {
    const bool swap = moe_swapped(t);
    for (u32 i = threadIdx.x; i < 256u; i += blockDim.x) {
        mq[i] = moe_scale(t, i);
        u32 lo = i & 15u, hi = i >> 4;
        if (swap) { u32 tmp = lo; lo = hi; hi = tmp; }
        me[i] = make_float2(e2m1_decode(lo), e2m1_decode(hi));
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS)
moe_gemm_f64(const void* x, int xbf, u64 ldx, const MoeTile* tiles, u64 n, u64 k, float* y, u64 ldy) {
    __shared__ float mq[256];
    __shared__ float2 me[256];
    __shared__ double part[MOE_WARPS][MOE_R][MOE_C];
    const MoeTile t = tiles[blockIdx.y];
    moe_tables(t, mq, me);
    switch (t.rows) {
        case 1: moe_tile<1>(x, xbf, ldx, t, n, k, y, ldy, mq, me, part); break;
        case 2: moe_tile<2>(x, xbf, ldx, t, n, k, y, ldy, mq, me, part); break;
        case 3: moe_tile<3>(x, xbf, ldx, t, n, k, y, ldy, mq, me, part); break;
        default: moe_tile<MOE_R>(x, xbf, ldx, t, n, k, y, ldy, mq, me, part); break;
    }
}

// ---- moe_mma_f64: the same tiles on the FP64 tensor cores ----------------------------------------
// For every tile (up to MMA_R consecutive rows that one routed expert sees) y[r, c] = sum_k
// x[r, k] * w_e[c, k], with moe_gemm_f64's decodes, exact f64 products, f64 sums, one rounding
// to f32 and its epilogue: only the order of the f64 sum differs (as between cuBLAS's DGEMM and
// the CPU). A block of MMA_WARPS warps computes MMA_C output columns of one tile, four 8-column
// fragments per warp (with m8n8k4 four ran 20 % slower than two on the H200, BENCHMARKS.md session
// 26; with m16n8k16 the shared-memory reads bound it), stepping k by
// 16 (one NVFP4 block, half an MXFP4 one): each step's x rows (converted to f64 once per block)
// and decoded weight rows (decoded once per block and step, not once per row) are staged in
// shared memory, then every warp runs mma.m16n8k16.f64 (one per 16-row fragment, MF of them, and
// 8-column fragment, per step) over its columns. Two register sets hold the global loads of the
// next two steps (each step's loads are issued two steps before it is staged), and the e2m1
// codes are decoded with byte permutes (e2m1_decode), not a shared-memory table: ncu's stall
// sampling put ~12 % of the warps' stalls on the loads one step ahead and ~15 % on the table
// reads (BENCHMARKS.md session 31, 3.89 -> 3.66 s of device time at 16k tokens). Rows past the
// tile's and columns past n are staged as zeros (never read from x or the weight) and never
// stored. m8n8k4, the shape before sm_90, kept the H200's FP64 tensor pipe 67 % busy at 30 % of
// its peak multiply-adds (ncu, BENCHMARKS.md session 29).
// Thread i stages x row i / 2 and weight rows (output columns) c0 + i / 2 + 64 w, elements
// 8 (i % 2)..+8 of the step.
#define MMA_R 64
#define MMA_C 128
#define MMA_WARPS 4
#define MMA_NJ (MMA_C / MMA_WARPS / 8)  // 8-column fragments per warp
#define MMA_WROWS (MMA_C / 64)          // weight rows each of the 128 threads stages
#define MMA_LD 20  // a staged row's stride in doubles (20 = 4 mod 16: a half warp's f64 loads hit 32 banks once)
// One m16n8k16 FP64 tensor-core product (sm_90 on; on the H200 it issues at twice the rate of
// m8n8k4 per multiply-add). Fragments, with g = lane / 4 and q = lane % 4: a[i] = A[g + 8 (i % 2)]
// [q + 4 (i / 2)], b[i] = B[q + 4 i][g] (B as columns), c[i] = C[g + 8 (i / 2)][2 q + i % 2].
__device__ __forceinline__ void dmma16(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
        "{%12,%13,%14,%15}, {%0,%1,%2,%3};"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
          "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}
// What one thread reads from global memory for one step: 8 x values of its row, and 8 codes with
// their scale byte of each of its weight rows (output columns c0 + r + 64 w).
struct MmaFetch {
    float xv[8];
    u32 pk[MMA_WROWS];  // 8 e2m1 codes of a weight row
    u32 sc[MMA_WROWS];  // their scale byte; > 255: a column past n
};
__device__ __forceinline__ void mma_fetch(MmaFetch& f, const void* x, int xbf, u64 ldx,
                                          const MoeTile& t, u32 xrows, u64 c0, u64 n, u64 k,
                                          u64 k0, bool mx) {
    const u32 half = threadIdx.x & 1u, r = threadIdx.x >> 1;
    // rows past the tile's are staged as zeros: never read (past the last tile they lie past x)
    if (r < xrows && r < t.rows) {
        u64 o = (u64)(t.row0 + r) * ldx + k0 + 8 * half;
        if (xbf) {
            uint4 u = *(const uint4*)((const u16*)x + o);
            u32 wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                f.xv[2 * j] = __uint_as_float(wd[j] << 16);
                f.xv[2 * j + 1] = __uint_as_float(wd[j] & 0xFFFF0000u);
            }
        } else {
            const float4* q = (const float4*)((const float*)x + o);
            float4 a = q[0], b = q[1];
            f.xv[0] = a.x; f.xv[1] = a.y; f.xv[2] = a.z; f.xv[3] = a.w;
            f.xv[4] = b.x; f.xv[5] = b.y; f.xv[6] = b.z; f.xv[7] = b.w;
        }
    }
#pragma unroll
    for (int w = 0; w < MMA_WROWS; w++) {
        const u64 c = c0 + r + 64 * w;
        if (c < n) {
            u64 e0 = c * k + k0 + 8 * half;
            f.pk[w] = *(const u32*)((const u8*)t.packed + e0 / 2);
            f.sc[w] = ((const u8*)t.scales)[mx ? e0 / 32 : e0 / 16];
        } else {
            f.pk[w] = 0u;
            f.sc[w] = 256u;
        }
    }
}
__device__ __forceinline__ void mma_stage(const MmaFetch& f, const MoeTile& t, u32 xrows,
                                          const float* mq, double (*xs)[MMA_LD],
                                          double (*ws)[MMA_LD]) {
    const u32 half = threadIdx.x & 1u, r = threadIdx.x >> 1;
    const bool post = (t.flags & MT_POST) != 0u, wbf = (t.flags & MT_WBF16) != 0u;
    const bool swap = moe_swapped(t);
    if (r < xrows) {
        const bool live = r < t.rows;
#pragma unroll
        for (int j = 0; j < 8; j++) xs[r][8 * half + j] = live ? (double)f.xv[j] : 0.0;
    }
#pragma unroll
    for (int w = 0; w < MMA_WROWS; w++) {
        const float q = f.sc[w] < 256u ? mq[f.sc[w]] : 0.0f;
        double* dst = ws[r + 64 * w] + 8 * half;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const u32 byte = (f.pk[w] >> (8 * b)) & 0xFFu;
            const float e0 = e2m1_decode(swap ? byte >> 4 : byte & 15u);
            const float e1 = e2m1_decode(swap ? byte & 15u : byte >> 4);
            const float w0 = moe_weight(e0, q, t, post, wbf);
            const float w1 = moe_weight(e1, q, t, post, wbf);
            dst[2 * b] = (double)w0;
            dst[2 * b + 1] = (double)w1;
        }
    }
}
// One k-step's products: warp w's B fragments (columns c0 + 32 w ..) once, each A fragment once.
template <int MF>
__device__ __forceinline__ void mma_step(double (&acc)[MF][MMA_NJ][4], double (*xs)[MMA_LD],
                                         double (*ws)[MMA_LD], u32 wc, u32 g, u32 tq) {
    double b[MMA_NJ][4];
#pragma unroll
    for (int j = 0; j < MMA_NJ; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) b[j][i] = ws[wc + 8 * j + g][tq + 4 * i];
#pragma unroll
    for (int m = 0; m < MF; m++) {
        double a[8];
#pragma unroll
        for (int i = 0; i < 8; i++) a[i] = xs[16 * m + g + 8 * (i & 1)][tq + 4 * (i >> 1)];
#pragma unroll
        for (int j = 0; j < MMA_NJ; j++) dmma16(acc[m][j], a, b[j]);
    }
}
// The accumulators of a warp's MF x MMA_NJ fragments, zeroed.
template <int MF>
__device__ __forceinline__ void mma_zero(double (&acc)[MF][MMA_NJ][4]) {
#pragma unroll
    for (int m = 0; m < MF; m++)
#pragma unroll
        for (int j = 0; j < MMA_NJ; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][j][i] = 0.0;
}
// A warp's fragments of columns c0 + wc ..: each rounded once to f32 (then the tile's epilogue)
// into y, rows past the tile's and columns past n not stored.
template <int MF>
__device__ __forceinline__ void mma_store(const double (&acc)[MF][MMA_NJ][4], const MoeTile& t,
                                          u64 c0, u32 wc, u32 g, u32 tq, u64 n, float* y, u64 ldy) {
#pragma unroll
    for (int m = 0; m < MF; m++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 r = 16 * m + g + 8 * (i >> 1);
            if (r >= t.rows) continue;
#pragma unroll
            for (int j = 0; j < MMA_NJ; j++) {
                const u64 c = c0 + wc + 8 * j + 2 * tq + (i & 1);
                if (c >= n) continue;
                float o = __double2float_rn(acc[m][j][i]);
                if (t.flags & MT_EPI) o = bf16_round(__fmul_rn(o, t.mul));
                y[(u64)(t.row0 + r) * ldy + c] = o;
            }
        }
    }
}
// MF 16-row fragments of the tile's rows; warp w computes columns c0 + 32 w .. + 32 of them
// (MMA_NJ fragments of 8). Steps alternate between the register sets f0 (even steps) and f1.
template <int MF>
__device__ __forceinline__ void mma_tile(const void* x, int xbf, u64 ldx, const MoeTile& t, u64 n,
                                         u64 k, float* y, u64 ldy, const float* mq,
                                         double (*xs)[MMA_LD], double (*ws)[MMA_LD]) {
    const bool mx = (t.flags & MT_CONV) == 3u;
    const u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3u;
    const u32 xrows = 16 * MF, wc = wid * (8 * MMA_NJ);
    for (u64 c0 = (u64)blockIdx.x * MMA_C; c0 < n; c0 += (u64)gridDim.x * MMA_C) {
        double acc[MF][MMA_NJ][4];
        mma_zero<MF>(acc);
        MmaFetch f0, f1;
        mma_fetch(f0, x, xbf, ldx, t, xrows, c0, n, k, 0, mx);
        if (16 < k) mma_fetch(f1, x, xbf, ldx, t, xrows, c0, n, k, 16, mx);
        for (u64 k0 = 0; k0 < k; k0 += 32) {
            mma_stage(f0, t, xrows, mq, xs, ws);
            __syncthreads();
            if (k0 + 32 < k) mma_fetch(f0, x, xbf, ldx, t, xrows, c0, n, k, k0 + 32, mx);
            mma_step<MF>(acc, xs, ws, wc, g, tq);
            __syncthreads();
            if (k0 + 16 < k) {
                mma_stage(f1, t, xrows, mq, xs, ws);
                __syncthreads();
                if (k0 + 48 < k) mma_fetch(f1, x, xbf, ldx, t, xrows, c0, n, k, k0 + 48, mx);
                mma_step<MF>(acc, xs, ws, wc, g, tq);
                __syncthreads();
            }
        }
        mma_store<MF>(acc, t, c0, wc, g, tq, n, y, ldy);
    }
}

extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
moe_mma_f64(const void* x, int xbf, u64 ldx, const MoeTile* tiles, u64 n, u64 k, float* y, u64 ldy) {
    __shared__ double ws[MMA_C][MMA_LD];
    __shared__ float mq[256];
    __shared__ double xs[MMA_R][MMA_LD];
    const MoeTile t = tiles[blockIdx.y];
    moe_scales(t, mq);
    if (t.rows <= 16) mma_tile<1>(x, xbf, ldx, t, n, k, y, ldy, mq, xs, ws);
    else if (t.rows <= 32) mma_tile<2>(x, xbf, ldx, t, n, k, y, ldy, mq, xs, ws);
    else mma_tile<4>(x, xbf, ldx, t, n, k, y, ldy, mq, xs, ws);
}

// ---- moe_mmt_f64: the same tiles, weights decoded by table into the B fragments ------------------
// moe_mma_f64 decodes every staged weight with ~11 instructions (e2m1 bits, two multiplies, the f64
// conversion, the store) and its warps spend most of a step there while the FP64 tensor pipe waits
// (ptxas paces one warp's m16n8k16 about 64 cycles apart; BENCHMARKS.md session 33). Here a block
// first builds its tile's decode table in shared memory, tab[s][c] = the f32 value of e2m1 code c
// under scale byte s (the tile's global scale, post-scale and BF16 rounding applied as moe_mma_f64
// does), then each lane reads its B fragments' weights straight from global code words and the
// table and converts them to f64: no weight is staged. With 4-byte entries a warp's 32 table reads
// spread over 32 banks; an f64 table (16 bank pairs, 4.8 wavefronts per read under ncu) was 11 %
// slower (BENCHMARKS.md session 33). x rows are staged as f64 in two buffers (one barrier per step)
// and read as moe_mma_f64 reads them, loaded two steps ahead; a lane's code words and scale bytes
// one step ahead, used only in the next step (a use in the step that loads them waits for the load
// there: 15 % of the warps' stall samples under ncu). A column past n reads column c0 + wc + g's
// codes: its products land in its own output column only, which is never stored.
// A staged row's 16-byte units are XOR-swizzled by bit 1 of the row (unit u of row r at
// u ^ ((r >> 1) & 1)): the 8 stores of a quarter warp (rows 4 q .. 4 q + 3, both halves) then hit
// 8 distinct bank groups (2-way conflicts without it), and a lane's A loads keep their banks.
#define MMT_TAB (256 * 16)  // table entries: 256 scale bytes of 16 codes
// The decode table of a tile (mq: its block scales, moe_scales).
__device__ __forceinline__ void mmt_table(const MoeTile& t, const float* mq, float* tab) {
    const bool post = (t.flags & MT_POST) != 0u, wbf = (t.flags & MT_WBF16) != 0u;
    for (u32 i = threadIdx.x; i < (u32)MMT_TAB; i += blockDim.x) {
        tab[i] = moe_weight(e2m1_decode(i & 15u), mq[i >> 4], t, post, wbf);
    }
    __syncthreads();
}
// Where a thread's loads start for its tile and column block: its x row (staged by threads 2 r and
// 2 r + 1, 8 values each), its lane's code and scale bytes of column c0 + wc + g (columns 8 j
// further are j strides on), and which of its 4 columns lie before n.
struct MmtAt {
    const u8* x;       // x row r, element 8 (thread % 2)
    const u8* codes;   // column c0 + wc + g (column c0 when that one lies past n)
    const u8* scales;  // the same column's scale bytes
    u32 cstride, sstride;  // bytes between columns 8 apart: codes, scales
    u32 cols;          // bit j: column j of the lane's lies before n
    bool xlive;        // x row r is one of the tile's
};
template <int XBF>
__device__ __forceinline__ void mmt_fetch_x(uint4 (&f)[2], const MmtAt& at, u32 k, u32 k0) {
    f[0] = make_uint4(0u, 0u, 0u, 0u);
    f[1] = f[0];
    if (at.xlive && k0 < k) {
        const uint4* q = (const uint4*)(at.x + k0 * (XBF ? 2u : 4u));
        f[0] = q[0];
        if (!XBF) f[1] = q[1];
    }
}
template <int XBF>
__device__ __forceinline__ void mmt_stage_x(const uint4 (&f)[2], double* xs) {
    const u32 half = threadIdx.x & 1u, r = threadIdx.x >> 1, sw = (r >> 1) & 1u;
    double2* d = (double2*)(xs + r * MMA_LD);
    const u32 w[8] = {f[0].x, f[0].y, f[0].z, f[0].w, f[1].x, f[1].y, f[1].z, f[1].w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v0, v1;
        if (XBF) {
            v0 = __uint_as_float(w[j] << 16);
            v1 = __uint_as_float(w[j] & 0xFFFF0000u);
        } else {
            v0 = __uint_as_float(w[2 * j]);
            v1 = __uint_as_float(w[2 * j + 1]);
        }
        d[(4u * half + j) ^ sw] = make_double2((double)v0, (double)v1);
    }
}
// A lane's code words (16 codes of a column's step) and scale bytes of its 4 columns at step k0, as
// loaded (a column past n reads a valid column's; past k, step 0's).
__device__ __forceinline__ void mmt_fetch_b(uint2 (&cw)[MMA_NJ], u32 (&sc)[MMA_NJ], const MmtAt& at,
                                            u32 k, u32 k0, u32 ssh) {
    const u32 kk = k0 < k ? k0 : 0u;
#pragma unroll
    for (int j = 0; j < MMA_NJ; j++) {
        const u32 cj = ((at.cols >> j) & 1u) ? j : 0u;
        cw[j] = *(const uint2*)(at.codes + cj * at.cstride + kk / 2);
        sc[j] = at.scales[cj * at.sstride + (kk >> ssh)];
    }
}
template <int MF, int XBF>
__device__ __forceinline__ void mmt_tile(const void* x, u64 ldx, const MoeTile& t, u64 n, u32 k,
                                         float* y, u64 ldy, const float* tabf, double* xsm) {
    const u32 lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3u;
    const u32 wc = wid * (8 * MMA_NJ), r = threadIdx.x >> 1, half = threadIdx.x & 1u;
    const u32 ssh = (t.flags & MT_CONV) == 3u ? 5u : 4u;
    // b[j][i] is element tq + 4 i of the step: nibble (tq + 4 i) % 8 of word i / 2 (the other
    // nibble of its byte when the tile's bytes hold their elements high nibble first)
    const u32 sh0 = (4u * tq) ^ (moe_swapped(t) ? 4u : 0u), sh1 = sh0 + 16u;
    const char* tab = (const char*)tabf;
    // the lane's A values: rows 16 m + g + 8 (i % 2), elements tq + 4 (i / 2), swizzled units
    const u32 abase = g * MMA_LD + 2u * ((tq >> 1) ^ ((g >> 1) & 1u)) + (tq & 1u);
    double* xs0 = xsm;
    double* xs1 = xsm + MMA_R * MMA_LD;
    MmtAt at;
    // rows past the tile's are staged as zeros: never read (past the last tile they lie past x)
    at.xlive = r < 16u * MF && r < t.rows;
    at.x = (const u8*)x + ((u64)(t.row0 + r) * ldx + 8 * half) * (XBF ? 2 : 4);
    at.cstride = 4u * k;
    at.sstride = (8u * k) >> ssh;
    for (u64 c0 = (u64)blockIdx.x * MMA_C; c0 < n; c0 += (u64)gridDim.x * MMA_C) {
        const u64 cl = c0 + wc + g;
        const u64 cf = cl < n ? cl : c0;
        at.codes = (const u8*)t.packed + cf * k / 2;
        at.scales = (const u8*)t.scales + ((cf * k) >> ssh);
        at.cols = 0u;
#pragma unroll
        for (int j = 0; j < MMA_NJ; j++) at.cols |= (cl + 8 * j < n ? 1u : 0u) << j;
        double acc[MF][MMA_NJ][4];
        mma_zero<MF>(acc);
        uint4 fx[2];
        uint2 cw[MMA_NJ];
        u32 sc[MMA_NJ];
        mmt_fetch_x<XBF>(fx, at, k, 0);
        mmt_stage_x<XBF>(fx, xs0);
        mmt_fetch_x<XBF>(fx, at, k, 16);
        mmt_fetch_b(cw, sc, at, k, 0, ssh);
        __syncthreads();
        for (u32 k0 = 0; k0 < k; k0 += 16) {
            // step k0 from buffer (k0 / 16) % 2; step k0 + 16's x staged into the other (every
            // warp is past the barrier after its last reads of it); past k the stage is zeros
            const double* cur = (k0 & 16) ? xs1 : xs0;
            double* nxt = (k0 & 16) ? xs0 : xs1;
            double b[MMA_NJ][4];
#pragma unroll
            for (int j = 0; j < MMA_NJ; j++) {
                const char* row = tab + sc[j] * 64u;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const u32 w = i < 2 ? cw[j].x : cw[j].y;
                    const u32 code = (w >> ((i & 1) ? sh1 : sh0)) & 15u;
                    b[j][i] = (double)*(const float*)(row + 4u * code);
                }
            }
            mmt_stage_x<XBF>(fx, nxt);
            mmt_fetch_x<XBF>(fx, at, k, k0 + 32);
            mmt_fetch_b(cw, sc, at, k, k0 + 16, ssh);
#pragma unroll
            for (int m = 0; m < MF; m++) {
                double a[8];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    a[i] = cur[abase + (16 * m + 8 * (i & 1)) * MMA_LD + 4 * (i >> 1)];
#pragma unroll
                for (int j = 0; j < MMA_NJ; j++) dmma16(acc[m][j], a, b[j]);
            }
            __syncthreads();
        }
        mma_store<MF>(acc, t, c0, wc, g, tq, n, y, ldy);
    }
}
template <int XBF>
__device__ __forceinline__ void mmt_rows(const void* x, u64 ldx, const MoeTile& t, u64 n, u32 k,
                                         float* y, u64 ldy, const float* tab, double* xsm) {
    if (t.rows <= 16) mmt_tile<1, XBF>(x, ldx, t, n, k, y, ldy, tab, xsm);
    else if (t.rows <= 32) mmt_tile<2, XBF>(x, ldx, t, n, k, y, ldy, tab, xsm);
    else mmt_tile<4, XBF>(x, ldx, t, n, k, y, ldy, tab, xsm);
}

extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
moe_mmt_f64(const void* x, int xbf, u64 ldx, const MoeTile* tiles, u64 n, u64 k, float* y, u64 ldy) {
    __shared__ double xsm[2 * MMA_R * MMA_LD];  // two x buffers (37 KB with the table)
    __shared__ float tab[MMT_TAB];
    __shared__ float mq[256];
    const MoeTile t = tiles[blockIdx.y];
    moe_scales(t, mq);
    mmt_table(t, mq, tab);
    if (xbf) mmt_rows<1>(x, ldx, t, n, k, y, ldy, tab, xsm);
    else mmt_rows<0>(x, ldx, t, n, k, y, ldy, tab, xsm);
}
