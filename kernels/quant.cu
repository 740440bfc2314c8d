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
    float rcp_g = rcp_approx_ftz(g);
    u64 h_blocks = 0, h_zero = 0, h_max = 0, h_nan = 0, h_clip = 0, h_dead = 0;
    float amax_all = 0.0f;
    GRID_STRIDE(b, nblocks) {
        const float4* xb = (const float4*)(x + b * 16);
        float v[16];
        float vmax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 q4 = xb[i];
            v[4 * i] = q4.x;
            v[4 * i + 1] = q4.y;
            v[4 * i + 2] = q4.z;
            v[4 * i + 3] = q4.w;
        }
#pragma unroll
        for (int i = 0; i < 16; i++) vmax = fmaxf(vmax, fabsf(v[i]));
        amax_all = fmaxf(amax_all, vmax);
        h_blocks++;
        float sf = __fmul_rn(g, __fmul_rn(vmax, RCP6));
        u32 code = e4m3_encode_satfinite(sf);
        float sfq = e4m3_decode(code);
        float osc = sfq == 0.0f ? 0.0f : rcp_approx_ftz(__fmul_rn(sfq, rcp_g));
        if (code == 0u) h_zero++;
        else if (code == 0x7Eu) h_max++;
        else if ((code & 0x7Fu) == 0x7Fu) h_nan++;
        if (scales) scales[b] = (u8)code;
        u32 pk[2] = {0u, 0u};
        u32 q16[8];
        float xh[16];
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
            float y0 = __fmul_rn(v[i], osc), y1 = __fmul_rn(v[i + 1], osc);
            u32 c0 = e2m1_encode(y0), c1 = e2m1_encode(y1);
            h_clip += (fabsf(y0) > 6.0f) + (fabsf(y1) > 6.0f);
            h_dead += ((c0 & 7u) == 0u && v[i] != 0.0f) + ((c1 & 7u) == 0u && v[i + 1] != 0.0f);
            pk[i / 8] |= (c0 | (c1 << 4)) << (8 * ((i / 2) & 3));
            q16[i / 2] = (u32)bf16_bits(__fmul_rn(e2m1_decode(c0), sfq)) |
                         ((u32)bf16_bits(__fmul_rn(e2m1_decode(c1), sfq)) << 16);
            if (xhat) {
                float m0 = __fdiv_rn(__fmul_rn(e2m1_decode(c0 & 7u), sfq), g);
                float m1 = __fdiv_rn(__fmul_rn(e2m1_decode(c1 & 7u), sfq), g);
                if (c0 & 8u) m0 = -m0;
                if (c1 & 8u) m1 = -m1;
                if (xhat_bf16) { m0 = bf16_round(m0); m1 = bf16_round(m1); }
                xh[i] = m0;
                xh[i + 1] = m1;
            }
        }
        if (packed) ((uint2*)packed)[b] = make_uint2(pk[0], pk[1]);
        if (xq16) {
            uint4* o = (uint4*)(xq16 + b * 16);
            o[0] = make_uint4(q16[0], q16[1], q16[2], q16[3]);
            o[1] = make_uint4(q16[4], q16[5], q16[6], q16[7]);
        }
        if (xhat) {
            float4* o = (float4*)(xhat + b * 16);
#pragma unroll
            for (int i = 0; i < 4; i++) o[i] = make_float4(xh[4 * i], xh[4 * i + 1], xh[4 * i + 2], xh[4 * i + 3]);
        }
    }
    if (health) {
        add_nonzero(&health[0], h_blocks);
        add_nonzero(&health[1], h_zero);
        add_nonzero(&health[2], h_max);
        add_nonzero(&health[3], h_nan);
        add_nonzero(&health[4], h_clip);
        add_nonzero(&health[5], h_dead);
        add_nonzero(&health[6], h_blocks * 16);
        if (amax_all > 0.0f) atomicMax(&health[7], (u64)__float_as_uint(amax_all));
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
