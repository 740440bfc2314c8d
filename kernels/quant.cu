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

// 2^ceil(log2 v) for a normal positive v (UE8M0 "ceil" rounding), as f32.
__device__ __forceinline__ float pow2_ceil(float v) {
    u32 bits = __float_as_uint(v);
    u32 exp = bits >> 23, man = bits & 0x7FFFFFu;
    u32 e = exp + (man != 0u ? 1u : 0u);
    if (e > 0xFEu) e = 0xFEu;
    return __uint_as_float(e << 23);
}

// DeepSeek FP8 1x128 activation quantize-dequantize: one thread per (row, 128-column group).
// pow2 scale s = 2^ceil(log2(max(amax, 1e-4) * fl(1/448))); q = e4m3(clamp(x / s, +-448)); out = q * s.
// non_pow2 != 0 reproduces a kernel that divides by the f32 scale but packs only its exponent.
extern "C" __global__ void act_quant_fp8(const float* x, u64 rows, u64 cols, int non_pow2, float* out) {
    u64 groups = (cols + 127) / 128;
    const float inv448 = 1.0f / 448.0f;
    GRID_STRIDE(t, rows * groups) {
        u64 r = t / groups, g0 = (t % groups) * 128;
        u64 g1 = g0 + 128 < cols ? g0 + 128 : cols;
        const float* xr = x + r * cols;
        float a = 0.0f;
        for (u64 c = g0; c < g1; c++) a = fmaxf(a, fabsf(xr[c]));
        if (!non_pow2) {
            float s = pow2_ceil(__fmul_rn(fmaxf(a, 1e-4f), inv448));
            for (u64 c = g0; c < g1; c++) {
                float v = __fdiv_rn(xr[c], s);
                if (!isnan(v)) v = fminf(fmaxf(v, -448.0f), 448.0f);
                out[r * cols + c] = __fmul_rn(e4m3_decode(e4m3_encode_satfinite(v)), s);
            }
        } else {
            float s = __fdiv_rn(fmaxf(a, 1e-4f), 448.0f);
            float sp = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
            for (u64 c = g0; c < g1; c++) {
                float v = __fdiv_rn(xr[c], s);
                out[r * cols + c] = __fmul_rn(e4m3_decode(e4m3_encode_satfinite(v)), sp);
            }
        }
    }
}
