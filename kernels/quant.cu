// nvfp4-probe device code, part 2: run-time activation quantization (NVFP4.md 3.2, DeepSeek FP8 1x128)
// and its health counters.

// 1/6 as rcp.approx.ftz(6.0) gives it on the GPU: the kernels hoist this constant.
#define RCP6 __uint_as_float(0x3E2AAAABu)

// Health counter slots (u64): blocks, scale_zero, scale_max, scale_nan, clipped, dead_zone,
// elements, then the activation's amax as f32 bits (slot 7).
#define H_SLOTS 8

__device__ __forceinline__ void add_nonzero(u64* p, u64 v) {
    if (v) atomicAdd(p, v);
}

// One thread per 16-element block of a row-major [rows, cols] activation (cols % 16 == 0).
// Kernel op order: sf = g * (vmax * 1/6); code = e4m3_satfinite(sf); osc = rcp(sfq * rcp(g)).
// Outputs (each optional, pass 0 to skip):
//   packed/scales: the FP4 codes and E4M3 scale bytes (linear layout);
//   xq16: BF16 bits of e2m1 * sfq (exact; the W4A4 GEMM operand, alpha applied after the GEMM);
//   xhat: f32 e2m1 * sfq / g (the emulation backend's quantize-dequantize), rounded to BF16 when
//         xhat_bf16 != 0;
//   health: H_SLOTS counters, accumulated.
extern "C" __global__ void act_quant_nvfp4(const float* x, u64 nblocks, float g, u8* packed, u8* scales,
                                           u16* xq16, float* xhat, int xhat_bf16, u64* health) {
    // Four threads per 16-element block, each with one coalesced 16-byte load; the block's amax
    // is reduced across the quad with shuffles (quads are never split: nblocks * 4 threads).
    float rcp_g = rcp_approx_ftz(g);
    u32 h_blocks = 0, h_zero = 0, h_max = 0, h_nan = 0, h_clip = 0, h_dead = 0;
    float amax_all = 0.0f;
    GRID_STRIDE(t, nblocks * 4) {
        u64 b = t >> 2;
        u32 q = (u32)(t & 3);
        float4 x4 = ((const float4*)x)[t];
        float v[4] = {x4.x, x4.y, x4.z, x4.w};
        float vmax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        unsigned mask = __activemask();
        vmax = fmaxf(vmax, __shfl_xor_sync(mask, vmax, 1, 4));
        vmax = fmaxf(vmax, __shfl_xor_sync(mask, vmax, 2, 4));
        amax_all = fmaxf(amax_all, vmax);
        float sf = __fmul_rn(g, __fmul_rn(vmax, RCP6));
        u32 code = e4m3_encode_satfinite(sf);
        float sfq = e4m3_decode(code);
        float osc = sfq == 0.0f ? 0.0f : rcp_approx_ftz(__fmul_rn(sfq, rcp_g));
        if (q == 0u) {
            h_blocks++;
            if (code == 0u) h_zero++;
            else if (code == 0x7Eu) h_max++;
            else if ((code & 0x7Fu) == 0x7Fu) h_nan++;
            if (scales) scales[b] = (u8)code;
        }
        u32 c[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float y = __fmul_rn(v[i], osc);
            c[i] = e2m1_encode(y);
            h_clip += fabsf(y) > 6.0f;
            h_dead += (c[i] & 7u) == 0u && v[i] != 0.0f;
        }
        if (packed) ((u16*)packed)[t] = (u16)((c[0] | (c[1] << 4)) | ((c[2] | (c[3] << 4)) << 8));
        if (xq16) {
            u32 lo = (u32)bf16_bits(__fmul_rn(e2m1_decode(c[0]), sfq)) |
                     ((u32)bf16_bits(__fmul_rn(e2m1_decode(c[1]), sfq)) << 16);
            u32 hi = (u32)bf16_bits(__fmul_rn(e2m1_decode(c[2]), sfq)) |
                     ((u32)bf16_bits(__fmul_rn(e2m1_decode(c[3]), sfq)) << 16);
            ((uint2*)xq16)[t] = make_uint2(lo, hi);
        }
        if (xhat) {
            float m[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float mm = __fdiv_rn(__fmul_rn(e2m1_decode(c[i] & 7u), sfq), g);
                if (c[i] & 8u) mm = -mm;
                m[i] = xhat_bf16 ? bf16_round(mm) : mm;
            }
            ((float4*)xhat)[t] = make_float4(m[0], m[1], m[2], m[3]);
        }
    }
    if (health) {
        // one atomic per warp and counter
        u32 r[6] = {h_blocks, h_zero, h_max, h_nan, h_clip, h_dead};
#pragma unroll
        for (int i = 0; i < 6; i++) r[i] = __reduce_add_sync(0xffffffffu, r[i]);
        u32 am = __reduce_max_sync(0xffffffffu, __float_as_uint(amax_all));
        if ((threadIdx.x & 31u) == 0u) {
#pragma unroll
            for (int i = 0; i < 6; i++) add_nonzero(&health[i], (u64)r[i]);
            add_nonzero(&health[6], (u64)r[0] * 16u);
            if (am) atomicMax(&health[7], (u64)am);
        }
    }
}

// ---- act_quant_nvfp4_v2: same arguments, same output bits and counters, faster --------------------

// e4m3_encode_satfinite without branches (same result for every f32 input; checked against the
// v1 function on all 2^32 bit patterns on the CPU, see the commit message):
//  * |x| >= 2^-6: round the f32 mantissa to 3 bits, to nearest even, on the integer bits
//    (a + 0x7FFFF + bit 20 of a); the carry walks into the exponent, and subtracting
//    (127 - 7) << 3 rebiases. This is v1's keep/rest/half rule written as one addition.
//    Everything from 464 up (and inf) gives >= 0x7F and is clamped to 0x7E, as v1 clamps.
//  * |x| < 2^-6 (the E4M3 subnormals, step 2^-9): |x| + 2^14 rounds |x| to a multiple of
//    2^-9 (the ulp of 2^14), ties to even: the same integer as v1's rintf(|x| * 512) (8 for the
//    top of the range = min normal 0x08, as in v1). Needs denormal inputs kept (ftz=false).
//  * sign bit copied; NaN -> 0x7F (no sign), as v1.
__device__ __forceinline__ u32 e4m3_encode_satfinite_v2(float x) {
    u32 b = __float_as_uint(x), a = b & 0x7FFFFFFFu;
    u32 nrm = min(((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u, 0x7Eu);
    u32 sub = __float_as_uint(__fadd_rn(__uint_as_float(a), 16384.0f)) - 0x46800000u;
    u32 code = ((b >> 24) & 0x80u) | (a < 0x3C800000u ? sub : nrm);
    return a > 0x7F800000u ? 0x7Fu : code;
}

// e2m1_encode without branches (same result for every f32 input; checked on all 2^32 patterns):
//  * |y| < 1: |y| + 2^22 rounds |y| to a multiple of 0.5 (ties to even) = the code 0, 1, 2;
//  * 1 <= |y| <= 5: round the mantissa to 1 bit on the integer bits (ties to even), carry into
//    the exponent, rebias by 252 = (127 - 1) << 1: codes 2..6 (5.0 ties to 6 = 4.0, even);
//  * |y| > 5 (inf, NaN included: their bits compare above): 7. The sign bit is copied (-0 gives
//    8, as v1) except for NaN, which gives 7 without sign as in v1 (tested on the bits, not with
//    fminf: a signalling NaN would keep its sign through a host fminf).
__device__ __forceinline__ u32 e2m1_encode_v2(float x) {
    u32 b = __float_as_uint(x), a = b & 0x7FFFFFFFu;
    u32 sub = __float_as_uint(__fadd_rn(__uint_as_float(a), 4194304.0f)) - 0x4A800000u;
    u32 nrm = (a + 0x1FFFFFu + ((a >> 22) & 1u) - 0x3F000000u) >> 22;
    u32 mag = a < 0x3F800000u ? sub : nrm;
    mag = a > 0x40A00000u ? 7u : mag;
    return a > 0x7F800000u ? 7u : (((b >> 28) & 8u) | mag);
}

// What differs from act_quant_nvfp4 (the reference, and the fallback with NVFP4_PROBE_KERNELS=v1):
//  * Shared tables per CUDA block, built at kernel start WITH THE V1 EXPRESSIONS: for every E4M3
//    code, (sfq, osc) = (e4m3_decode(code), sfq == 0 ? 0 : rcp_approx_ftz(sfq * rcp_g)); and
//    e2m1_decode of the 16 nibbles. The hot loop replaces v1's per-block decode, multiply and
//    MUFU reciprocal by one shared load indexed by the code it computed.
//  * Branch-free E4M3 / E2M1 encoders (above), identical results; branch-free counters; BF16
//    packing by bf16x2_bits (equal to v1's two bf16_bits).
//  * Same op order: vmax = the quad's max of |x| (fmaxf, NaN skipped, the same two shuffles),
//    sf = g * (vmax * RCP6) with __fmul_rn, code = E4M3 satfinite, y = x * osc with __fmul_rn,
//    xq16 = bf16(e2m1 * sfq), xhat = v1's expression verbatim.
//  * Each lane loads AQ2_U float4 (coalesced across the warp: a warp step covers items
//    base .. base + 32 AQ2_U - 1, lane l the items base + 32 j + l) before computing: AQ2_U x the
//    bytes in flight of v1.
//  * Quads: four consecutive lanes hold one 16-element block (item t = 4 b + q, q = lane & 3,
//    because base and 32 j are multiples of 4). The loop is warp-uniform (base depends on the
//    warp only), so the full-mask shuffles are legal; lanes past the end (t >= 4 nblocks) load
//    zeros and store nothing, and since 4 nblocks is a multiple of 4 a quad is either wholly
//    valid or wholly past the end (no quad is ever split).
//  * Counters: each valid q == 0 lane counts its block once (blocks, zero, max, NaN scale).
//    Clipped / dead-zone need no validity test: a lane past the end has v = 0, so dead is 0
//    (v != 0 fails) and y = 0 * osc is 0 or NaN (osc is 0 for code 0 / 0x80, NaN for 0x7F when
//    g is not finite), never |y| > 6. amax takes max(vmax) over all lanes; a lane past the end
//    contributes 0, which changes nothing (amax starts at 0). Reduced per warp, added with one
//    atomic per warp and counter exactly as v1 (integer sums and a max of non-negative f32 bits
//    do not depend on the order or grouping).
//  * Invariants: blockDim.x a multiple of 32 (Gpu::grid uses 256); any gridDim. The launcher
//    passes n = ceil(4 nblocks / AQ2_U) work items, one per lane-step; Gpu::grid caps the grid
//    at sm_count * 120 blocks.
// AQ2_U is a template parameter: float4 items each lane loads per step before computing (the
// bytes in flight per warp). Instantiated with U = 2; U = 4 and 8 were measured on the H200 at the
// same speed (BENCHMARKS.md: v2 is instruction-bound, not latency-bound), which led to v3 below.

// Pieces shared by v2 and v3 (each v1's expressions, in v1's order).
// The per-block tables: (sfq, osc) by E4M3 code, e2m1_decode by nibble; ends with a barrier.
__device__ __forceinline__ void aq_tables(float2* aq_s, float* aq_e, float g) {
    float rcp_g = rcp_approx_ftz(g);
    for (u32 i = threadIdx.x; i < 256u; i += blockDim.x) {
        float sfq = e4m3_decode(i);
        float osc = sfq == 0.0f ? 0.0f : rcp_approx_ftz(__fmul_rn(sfq, rcp_g));
        aq_s[i] = make_float2(sfq, osc);
        if (i < 16u) aq_e[i] = e2m1_decode(i);
    }
    __syncthreads();
}

// One thread's health counters (slots 0-5 of H_SLOTS) and activation amax.
struct AqHealth {
    u32 blocks = 0, zero = 0, max = 0, nan = 0, clip = 0, dead = 0;
    float amax = 0.0f;
};

// A block's scale byte counted (when `counted`: the lane that owns the block).
__device__ __forceinline__ void aq_count_block(AqHealth& h, u32 code, bool counted) {
    h.blocks += counted;
    h.zero += counted && code == 0u;
    h.max += counted && code == 0x7Eu;
    h.nan += counted && (code & 0x7Fu) == 0x7Fu;
}

// One element: its E2M1 code, with the clipped / dead-zone counters.
__device__ __forceinline__ u32 aq_encode(float v, float osc, AqHealth& h) {
    float y = __fmul_rn(v, osc);
    u32 c = e2m1_encode_v2(y);
    h.clip += fabsf(y) > 6.0f;
    h.dead += (c & 7u) == 0u && v != 0.0f;
    return c;
}

// The quantize-dequantize value of code c: e2m1 * sfq / g, rounded to BF16 when asked.
__device__ __forceinline__ float aq_xhat(const float* aq_e, u32 c, float sfq, float g, int xhat_bf16) {
    float mm = __fdiv_rn(__fmul_rn(aq_e[c & 7u], sfq), g);
    if (c & 8u) mm = -mm;
    return xhat_bf16 ? bf16_round(mm) : mm;
}

// The counters added to `health`: one atomic per warp and counter, as v1 (integer sums and a max
// of non-negative f32 bits do not depend on the order or grouping).
__device__ __forceinline__ void aq_flush(const AqHealth& h, u64* health) {
    if (!health) return;
    u32 r[6] = {h.blocks, h.zero, h.max, h.nan, h.clip, h.dead};
#pragma unroll
    for (int i = 0; i < 6; i++) r[i] = __reduce_add_sync(0xffffffffu, r[i]);
    u32 am = __reduce_max_sync(0xffffffffu, __float_as_uint(h.amax));
    if ((threadIdx.x & 31u) == 0u) {
#pragma unroll
        for (int i = 0; i < 6; i++) add_nonzero(&health[i], (u64)r[i]);
        add_nonzero(&health[6], (u64)r[0] * 16u);
        if (am) atomicMax(&health[7], (u64)am);
    }
}

template <int AQ2_U>
__device__ __forceinline__ void act_quant_nvfp4_v2_body(const float* x, u64 nblocks, float g,
                   u8* packed, u8* scales, u16* xq16, float* xhat, int xhat_bf16, u64* health) {
    __shared__ float2 aq_s[256];  // (sfq, osc) by E4M3 code
    __shared__ float aq_e[16];    // e2m1_decode by nibble
    aq_tables(aq_s, aq_e, g);
    AqHealth h;
    const u32 lane = threadIdx.x & 31u, q = lane & 3u;
    const u64 n = nblocks * 4u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 step = (((u64)gridDim.x * blockDim.x) >> 5) * (32u * AQ2_U);
    const bool w_packed = packed != 0, w_scales = scales != 0, w_xq = xq16 != 0, w_xhat = xhat != 0;
    for (u64 base = warp * (32u * AQ2_U); base < n; base += step) {
        const u32 lim = n - base < 32u * AQ2_U ? (u32)(n - base) : 32u * AQ2_U;  // warp-uniform
        const u64 t0 = base + lane;
        u8* sp = scales + (t0 >> 2);
        float4 xv[AQ2_U];
#pragma unroll
        for (int j = 0; j < AQ2_U; j++) {
            xv[j] = 32u * j + lane < lim ? __ldcs((const float4*)x + t0 + 32 * j)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < AQ2_U; j++) {
            const bool valid = 32u * j + lane < lim;
            const u64 t = t0 + 32 * j;
            float v[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
            float vmax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
            vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1, 4));
            vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2, 4));
            h.amax = fmaxf(h.amax, vmax);
            float sf = __fmul_rn(g, __fmul_rn(vmax, RCP6));
            u32 code = e4m3_encode_satfinite_v2(sf);
            float2 so = aq_s[code];
            float sfq = so.x, osc = so.y;
            const bool first = valid && q == 0u;
            aq_count_block(h, code, first);
            if (first && w_scales) sp[8 * j] = (u8)code;  // block (t0 + 32 j) >> 2, t0 % 4 == q
            u32 c[4];
#pragma unroll
            for (int i = 0; i < 4; i++) c[i] = aq_encode(v[i], osc, h);
            if (!valid) continue;
            if (w_packed) ((u16*)packed)[t] = (u16)((c[0] | (c[1] << 4)) | ((c[2] | (c[3] << 4)) << 8));
            if (w_xq) {
                u32 lo = bf16x2_bits(__fmul_rn(aq_e[c[0]], sfq), __fmul_rn(aq_e[c[1]], sfq));
                u32 hi = bf16x2_bits(__fmul_rn(aq_e[c[2]], sfq), __fmul_rn(aq_e[c[3]], sfq));
                ((uint2*)xq16)[t] = make_uint2(lo, hi);
            }
            if (w_xhat) {
                float m[4];
#pragma unroll
                for (int i = 0; i < 4; i++) m[i] = aq_xhat(aq_e, c[i], sfq, g, xhat_bf16);
                ((float4*)xhat)[t] = make_float4(m[0], m[1], m[2], m[3]);
            }
        }
    }
    aq_flush(h, health);
}

// U = 2: 6 resident blocks of 256 threads per SM (40 registers, no spills with ptxas 12.8, sm_90)
extern "C" __global__ void __launch_bounds__(256, 6)
act_quant_nvfp4_v2(const float* x, u64 nblocks, float g, u8* packed, u8* scales, u16* xq16,
                   float* xhat, int xhat_bf16, u64* health) {
    act_quant_nvfp4_v2_body<2>(x, nblocks, g, packed, scales, xq16, xhat, xhat_bf16, health);
}

// ---- act_quant_nvfp4_v3: one lane per 16-element block -------------------------------------------
// Same arguments, output bits and counters as v1/v2. v2 gives a block to four lanes, so the
// per-block work (the max, the E4M3 encode, the table load, four counters) runs four times and
// needs two shuffles; on the H200 v2 is instruction-bound (its counters-only call reads at 54 % of
// the copy bandwidth and writing codes adds little). Here one lane does a block once:
//  * loads: four float4 of its 64 bytes through the read-only path (__ldg: the second float4 of
//    each 32-byte sector comes from L1), all before computing;
//  * vmax: the max of the 16 |x| (fmaxf skips NaN; the max of a set does not depend on the order,
//    so it equals v2's two-level quad max, NaN-only blocks included);
//  * then v2's expressions element by element (E4M3 / E2M1 encoders, table lookups, counters);
//  * stores: the scale byte, 8 bytes of codes (uint2), 32 bytes of BF16 operand (2 x uint4),
//    64 bytes of quantize-dequantize (4 x float4) per block.
// Alignment: x, xq16 and xhat 16-byte, packed 8-byte aligned (Gpu::act_quant_nvfp4 falls back to
// v2 otherwise). Grid-stride over blocks; blockDim.x a multiple of 32.
// v3's work on block b (one lane): quantize x[16 b .. 16 b + 16) with encode scale g, count it
// into h, store what is asked for. Shared by act_quant_nvfp4_v3 and act_quant_nvfp4_seg.
__device__ __forceinline__ void aq_v3_block(const float* x, u64 b, float g, const float2* aq_s,
                                            const float* aq_e, AqHealth& h, u8* packed, u8* scales,
                                            u16* xq16, float* xhat, int xhat_bf16) {
    const float4* xp = (const float4*)x + 4 * b;
    float v[16];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float4 f = __ldg(xp + j);
        v[4 * j] = f.x; v[4 * j + 1] = f.y; v[4 * j + 2] = f.z; v[4 * j + 3] = f.w;
    }
    float vmax = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < 16; i++) vmax = fmaxf(vmax, fabsf(v[i]));
    h.amax = fmaxf(h.amax, vmax);
    float sf = __fmul_rn(g, __fmul_rn(vmax, RCP6));
    u32 code = e4m3_encode_satfinite_v2(sf);
    float2 so = aq_s[code];
    float sfq = so.x, osc = so.y;
    aq_count_block(h, code, true);
    if (scales) scales[b] = (u8)code;
    u32 c[16];
#pragma unroll
    for (int i = 0; i < 16; i++) c[i] = aq_encode(v[i], osc, h);
    if (packed) {
        u32 w[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            w[k] = 0u;
#pragma unroll
            for (int i = 0; i < 8; i++) w[k] |= c[8 * k + i] << (4 * i);
        }
        ((uint2*)packed)[b] = make_uint2(w[0], w[1]);
    }
    if (xq16) {
        u32 q[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = bf16x2_bits(__fmul_rn(aq_e[c[2 * k]], sfq), __fmul_rn(aq_e[c[2 * k + 1]], sfq));
        ((uint4*)xq16)[2 * b] = make_uint4(q[0], q[1], q[2], q[3]);
        ((uint4*)xq16)[2 * b + 1] = make_uint4(q[4], q[5], q[6], q[7]);
    }
    if (xhat) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float m[4];
#pragma unroll
            for (int i = 0; i < 4; i++) m[i] = aq_xhat(aq_e, c[4 * j + i], sfq, g, xhat_bf16);
            ((float4*)xhat)[4 * b + j] = make_float4(m[0], m[1], m[2], m[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 4)
act_quant_nvfp4_v3(const float* x, u64 nblocks, float g, u8* packed, u8* scales, u16* xq16,
                   float* xhat, int xhat_bf16, u64* health) {
    __shared__ float2 aq_s[256];  // (sfq, osc) by E4M3 code, built with the v1 expressions
    __shared__ float aq_e[16];    // e2m1_decode by nibble
    aq_tables(aq_s, aq_e, g);
    AqHealth h;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride)
        aq_v3_block(x, b, g, aq_s, aq_e, h, packed, scales, xq16, xhat, xhat_bf16);
    aq_flush(h, health);
}

// ---- act_quant_nvfp4_seg: v3 over many segments in one launch -----------------------------------
// The routed experts quantize their own rows with their own input scale and count into their own
// health slots. Segment blockIdx.y covers blocks [block0, block0 + nblocks) of the shared buffers
// (x, packed, scales, xq16, xhat indexed as v3 indexes them) with encode scale g and counters at
// `health` (H_SLOTS u64, or 0). Per block the work is v3's (aq_v3_block), so the bits and counters
// are v3's. Same alignment as v3.
struct AqSeg {
    u64 block0, nblocks;
    float g;
    u32 pad;
    u64 health;
};
extern "C" __global__ void __launch_bounds__(256, 4)
act_quant_nvfp4_seg(const float* x, const AqSeg* segs, u8* packed, u8* scales, u16* xq16, float* xhat,
                    int xhat_bf16) {
    __shared__ float2 aq_s[256];
    __shared__ float aq_e[16];
    const AqSeg sg = segs[blockIdx.y];
    aq_tables(aq_s, aq_e, sg.g);
    AqHealth h;
    const u64 stride = (u64)gridDim.x * blockDim.x, end = sg.block0 + sg.nblocks;
    for (u64 b = sg.block0 + (u64)blockIdx.x * blockDim.x + threadIdx.x; b < end; b += stride)
        aq_v3_block(x, b, sg.g, aq_s, aq_e, h, packed, scales, xq16, xhat, xhat_bf16);
    aq_flush(h, (u64*)sg.health);
}

// 2^ceil(log2 v) for a normal positive v (UE8M0 "ceil" rounding), as f32.
__device__ __forceinline__ float pow2_ceil(float v) {
    u32 bits = __float_as_uint(v);
    u32 exp = bits >> 23, man = bits & 0x7FFFFFu;
    u32 e = exp + (man != 0u ? 1u : 0u);
    if (e > 0xFEu) e = 0xFEu;
    return __uint_as_float(e << 23);
}

// The largest |x| of xr[g0, g1) (a NaN ignored, as fmaxf).
__device__ __forceinline__ float group_amax(const float* xr, u64 g0, u64 g1) {
    float a = 0.0f;
    for (u64 c = g0; c < g1; c++) a = fmaxf(a, fabsf(xr[c]));
    return a;
}

// DeepSeek's power-of-two FP8 quantize-dequantize of xr[g0, g1) into o[g0, g1):
// s = 2^ceil(log2(max(amax, 1e-4) * fl(1/448))); q = e4m3(clamp(x / s, +-448)); o = q * s.
__device__ __forceinline__ void fp8_pow2_group(const float* xr, float* o, u64 g0, u64 g1) {
    const float inv448 = 1.0f / 448.0f;
    float s = pow2_ceil(__fmul_rn(fmaxf(group_amax(xr, g0, g1), 1e-4f), inv448));
    for (u64 c = g0; c < g1; c++) {
        float v = __fdiv_rn(xr[c], s);
        if (!isnan(v)) v = fminf(fmaxf(v, -448.0f), 448.0f);
        o[c] = __fmul_rn(e4m3_decode(e4m3_encode_satfinite(v)), s);
    }
}

// DeepSeek FP8 1x128 activation quantize-dequantize (fp8_pow2_group): one thread per (row,
// 128-column group). non_pow2 != 0 reproduces a kernel that divides by the f32 scale but packs only its exponent.
extern "C" __global__ void act_quant_fp8(const float* x, u64 rows, u64 cols, int non_pow2, float* out) {
    u64 groups = (cols + 127) / 128;
    GRID_STRIDE(t, rows * groups) {
        u64 r = t / groups, g0 = (t % groups) * 128;
        u64 g1 = g0 + 128 < cols ? g0 + 128 : cols;
        const float* xr = x + r * cols;
        if (!non_pow2) {
            fp8_pow2_group(xr, out + r * cols, g0, g1);
        } else {
            float s = __fdiv_rn(fmaxf(group_amax(xr, g0, g1), 1e-4f), 448.0f);
            float sp = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
            for (u64 c = g0; c < g1; c++) {
                float v = __fdiv_rn(xr[c], s);
                out[r * cols + c] = __fmul_rn(e4m3_decode(e4m3_encode_satfinite(v)), sp);
            }
        }
    }
}

// MXFP8 activation quantize-dequantize as TensorRT-LLM's cvt_warp_fp16_to_mxfp8 (FlashInfer's
// mxfp8_quantize, gpt-oss W4A8 on Blackwell): one thread per (row, 32-column group).
// s = 2^ceil(log2(amax * rcp.approx(448))) (UE8M0 rounded up, no floor); q = e4m3_satfinite(x / s)
// (s a power of two: x * (1/s) exactly); out = q * s; a block whose amax is 0 stays 0.
extern "C" __global__ void act_quant_mxfp8(const float* x, u64 rows, u64 cols, float* out) {
    u64 groups = (cols + 31) / 32;
    const float rcp448 = rcp_approx_ftz(448.0f);
    GRID_STRIDE(t, rows * groups) {
        u64 r = t / groups, g0 = (t % groups) * 32;
        u64 g1 = g0 + 32 < cols ? g0 + 32 : cols;
        const float* xr = x + r * cols;
        float a = group_amax(xr, g0, g1);
        if (a == 0.0f) {
            for (u64 c = g0; c < g1; c++) out[r * cols + c] = 0.0f;
            continue;
        }
        float s = pow2_ceil(__fmul_rn(a, rcp448));
        for (u64 c = g0; c < g1; c++) {
            out[r * cols + c] = __fmul_rn(e4m3_decode(e4m3_encode_satfinite(__fdiv_rn(xr[c], s))), s);
        }
    }
}

// An engine's FP8 cache as read back (the attention's, vLLM's fp8_ds_mla: group 64 over the 448
// non-RoPE dims; the indexer's keys: group 128 over all): columns [0, nope) of each row
// quantize-dequantized per `group` with the power-of-two scale of act_quant_fp8, columns
// [nope, cols) copied. One thread per (row, group): groups 0..ceil(nope/group) quantize, the last
// one copies.
extern "C" __global__ void kv_cache_fp8(const float* x, u64 rows, u64 cols, u64 nope, u64 group, float* out) {
    u64 qg = (nope + group - 1) / group, groups = qg + 1;
    GRID_STRIDE(t, rows * groups) {
        u64 r = t / groups, gi = t % groups;
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        if (gi == qg) {
            for (u64 c = nope; c < cols; c++) orow[c] = xr[c];
            continue;
        }
        u64 g0 = gi * group, g1 = g0 + group < nope ? g0 + group : nope;
        fp8_pow2_group(xr, orow, g0, g1);
    }
}
