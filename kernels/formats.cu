// nvfp4-probe device code, part 1: number formats and weight dequantization.
//
// Compiled at run time by NVRTC for the device in hand (no headers exist there): BF16, FP8 and FP4
// values are raw integer bits decoded with bit operations, exactly as the CPU reference in
// src/numerics does. Compiled with fmad=false so no multiply-add is contracted behind our back:
// every f32 operation rounds where the CPU reference rounds.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)blockDim.x * gridDim.x)

#define F32_NAN __uint_as_float(0x7FC00000u)

// ---- decoders -------------------------------------------------------------------------------

// E2M1 code (low 4 bits) -> f32: 0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.0. The magnitude's
// exponent byte and next byte come from two byte permutes over the 8 values' bytes (no branch,
// no table: the experts' GEMM decodes every weight with it, BENCHMARKS.md session 31).
__device__ __forceinline__ float e2m1_decode(u32 c) {
    const u32 m = c & 7u;
    const u32 hi = __byte_perm(0x3F3F3F00u, 0x40404040u, m) << 24;
    const u32 lo = (__byte_perm(0xC0800000u, 0xC0804000u, m) & 0xFFu) << 16;
    return __uint_as_float(hi | lo | ((c & 8u) << 28));
}

// E4M3FN byte -> f32 (subnormals exact, 0x7F/0xFF NaN).
__device__ __forceinline__ float e4m3_decode(u32 b) {
    b &= 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) return F32_NAN;
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 0u) {
        v = (float)m * 0.001953125f;  // m * 2^-9, exact
    } else {
        v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    }
    return (b & 0x80u) ? -v : v;
}

// UE8M0 byte -> 2^(b-127); 0xFF is NaN; 0x00 is the subnormal 2^-127.
__device__ __forceinline__ float ue8m0_decode(u32 b) {
    b &= 0xFFu;
    if (b == 0xFFu) return F32_NAN;
    if (b == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(b << 23);
}

// ---- encoders -------------------------------------------------------------------------------

// |x| -> E4M3 magnitude code, round to nearest even; may exceed 0x7E (callers saturate).
__device__ __forceinline__ u32 e4m3_round_mag(float a) {
    if (a < 0.015625f) return (u32)rintf(a * 512.0f);
    if (a >= 512.0f) return 0x80u;
    u32 bits = __float_as_uint(a);
    int exp = (int)(bits >> 23) - 127;
    u32 man = bits & 0x7FFFFFu;
    u32 keep = man >> 20, rest = man & 0xFFFFFu, half = 0x80000u;
    u32 up = (rest > half || (rest == half && (keep & 1u))) ? 1u : 0u;
    return ((((u32)(exp + 7)) << 3) | keep) + up;
}

// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3): NaN -> 0x7F, past 448 and inf -> +-448.
__device__ __forceinline__ u32 e4m3_encode_satfinite(float x) {
    if (isnan(x)) return 0x7Fu;
    u32 sign = (__float_as_uint(x) >> 31) << 7;
    float a = fabsf(x);
    u32 code = isinf(a) ? 0x7Eu : min(e4m3_round_mag(a), 0x7Eu);
    return sign | code;
}

// E2M1 magnitude: count the grid midpoints |y| lies beyond (ties to the even code); NaN -> 7.
__device__ __forceinline__ u32 e2m1_mag(float a) {
    return (u32)(!(a <= 0.25f)) + (u32)(!(a < 0.75f)) + (u32)(!(a <= 1.25f)) + (u32)(!(a < 1.75f)) +
           (u32)(!(a <= 2.5f)) + (u32)(!(a < 3.5f)) + (u32)(!(a <= 5.0f));
}

// Serving-kernel E2M1 encoder: sign copied from the f32 sign bit; NaN -> 0x7.
__device__ __forceinline__ u32 e2m1_encode(float x) {
    if (isnan(x)) return 7u;
    return ((__float_as_uint(x) >> 31) << 3) | e2m1_mag(fabsf(x));
}

// f32 -> BF16 bits, round to nearest even, NaN quietened (half::bf16::from_f32).
__device__ __forceinline__ u16 bf16_bits(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((b >> 16) | 0x40u);
    u32 lsb = (b >> 16) & 1u;
    return (u16)((b + 0x7FFFu + lsb) >> 16);
}

// Two BF16 (RNE, NaN quietened) packed lo | hi << 16: equal to
// (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16) for every pair of inputs. Without a NaN,
// bf16_bits(x) is (b + 0x7FFF + bit 16 of b) >> 16 (no u32 overflow: b <= 0xFF800000), and
// __byte_perm(r_lo, r_hi, 0x7632) takes the high halves of both sums in one instruction; with a
// NaN it is bf16_bits itself. Used by the v2 kernels.
__device__ __forceinline__ u32 rne16_sum(float x) {
    u32 b = __float_as_uint(x);
    return b + 0x7FFFu + ((b >> 16) & 1u);
}
__device__ __forceinline__ u32 bf16x2_bits(float lo, float hi) {
    if (isnan(lo) || isnan(hi)) return (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16);
    return __byte_perm(rne16_sum(lo), rne16_sum(hi), 0x7632u);
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// IEEE half bits -> f32 (exact, subnormals and NaN payloads kept).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 s = ((u32)h & 0x8000u) << 16, e = ((u32)h >> 10) & 0x1Fu, m = (u32)h & 0x3FFu;
    if (e == 0u) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return (h & 0x8000u) ? -v : v;
    }
    if (e == 31u) return __uint_as_float(s | 0x7F800000u | (m << 13));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ float bf16_round(float x) { return bf16_to_f32(bf16_bits(x)); }

// PTX rcp.approx.ftz.f32: the reciprocal the serving kernels use (NVFP4.md 3.2).
__device__ __forceinline__ float rcp_approx_ftz(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// ---- element-wise kernels ---------------------------------------------------------------------

// Decode n elements of a format: fmt 0 = E4M3, 1 = UE8M0, 2 = E2M1 (low nibble), 3 = BF16 bits,
// 4 = F16 bits (u16 input for 3 and 4).
extern "C" __global__ void decode_bytes(const u8* in, u64 n, int fmt, float* out) {
    GRID_STRIDE(i, n) {
        float v;
        if (fmt == 0) v = e4m3_decode(in[i]);
        else if (fmt == 1) v = ue8m0_decode(in[i]);
        else if (fmt == 2) v = e2m1_decode(in[i]);
        else if (fmt == 3) v = bf16_to_f32(((const u16*)in)[i]);
        else v = f16_to_f32(((const u16*)in)[i]);
        out[i] = v;
    }
}

// Encode n floats: fmt 0 = E4M3 satfinite, 1 = E2M1 (kernel sign rule), 2 = BF16 bits (u16 output).
extern "C" __global__ void encode_floats(const float* in, u64 n, int fmt, u8* out) {
    GRID_STRIDE(i, n) {
        float x = in[i];
        if (fmt == 0) out[i] = (u8)e4m3_encode_satfinite(x);
        else if (fmt == 1) out[i] = (u8)e2m1_encode(x);
        else ((u16*)out)[i] = bf16_bits(x);
    }
}

// y[i] = bf16(x[i]) in f32 storage (y may be x: in place), or into BF16 bits when out16 != 0
// (y unused). A copy that rounds is one pass instead of a copy and a pass in place.
extern "C" __global__ void round_bf16(const float* x, float* y, u64 n, u16* out16) {
    GRID_STRIDE(i, n) {
        if (out16) out16[i] = bf16_bits(x[i]);
        else y[i] = bf16_round(x[i]);
    }
}

// cnt += number of x[i] that are not BF16 values (NaN counts as one); one atomic per thread.
extern "C" __global__ void count_inexact_bf16(const float* x, u64 n, unsigned long long* cnt) {
    unsigned long long c = 0;
    GRID_STRIDE(i, n) {
        float v = x[i];
        if (!isnan(v) && bf16_round(v) != v) c++;
    }
    if (c) atomicAdd(cnt, c);
}

// GEMM epilogues: y = bf16(y * mul) (round != 0) or y * mul.
extern "C" __global__ void scale_round(float* y, u64 n, float mul, int round) {
    GRID_STRIDE(i, n) {
        float v = __fmul_rn(y[i], mul);
        y[i] = round ? bf16_round(v) : v;
    }
}

// rcp.approx.ftz over x[i] (for the self-test's bit-for-bit sweep).
extern "C" __global__ void rcp_approx_map(const float* x, u64 n, float* out) {
    GRID_STRIDE(i, n) { out[i] = rcp_approx_ftz(x[i]); }
}

// Sweep every f32 mantissa at exponent 2^e and count where rcp.approx.ftz differs from the
// correctly rounded reciprocal; the first `cap` differing inputs are stored.
extern "C" __global__ void rcp_sweep(int e, u64* count, u32* first, u32 cap) {
    GRID_STRIDE(m, 1u << 23) {
        u32 bits = ((u32)(e + 127) << 23) | (u32)m;
        float x = __uint_as_float(bits);
        float a = rcp_approx_ftz(x);
        float c = __frcp_rn(x);
        if (__float_as_uint(a) != __float_as_uint(c)) {
            u64 k = atomicAdd(count, 1ull);
            if (k < cap) first[k] = bits;
        }
    }
}

// rcp.approx.ftz minus the correctly rounded reciprocal, in ulps, for every mantissa of [1, 2).
extern "C" __global__ void rcp_table(signed char* out) {
    GRID_STRIDE(m, 1u << 23) {
        float x = __uint_as_float(0x3F800000u | (u32)m);
        out[m] = (signed char)((int)__float_as_uint(rcp_approx_ftz(x)) - (int)__float_as_uint(__frcp_rn(x)));
    }
}

// ---- weight dequantization ---------------------------------------------------------------------
// out_kind: 0 = f32 values, 1 = BF16 bits of the f32 value (RNE).

__device__ __forceinline__ void store_val(void* out, u64 i, float v, int out_kind) {
    if (out_kind == 0) ((float*)out)[i] = v;
    else ((u16*)out)[i] = bf16_bits(v);
}

// NVFP4: one thread per 16-element block. Per block the multiplier is
//   conv 0 (compressed-tensors): q = s / global; conv 1 (ModelOpt): q = s * global;
//   conv 2 (served e2m1*s, no tensor scale): q = s;
// value = e2m1 * q, then * post when post_mul != 0 (emulation's bf(wq * d_w)).
// swap != 0 reads the nibbles the other way round (a loader fault / its repair).
extern "C" __global__ void dequant_nvfp4(const u8* packed, const u8* scales, u64 nblocks, float global,
                                         int conv, float post, int post_mul, int swap, int out_kind,
                                         void* out) {
    // f32 output: 4 elements (2 packed bytes) per thread, one 16-byte store; BF16 output: 8
    // elements (4 packed bytes) per thread, one 16-byte store. Consecutive threads write
    // consecutive 16-byte pieces: every store instruction is fully coalesced.
    const u32 per = out_kind == 0 ? 4u : 8u;
    GRID_STRIDE(t, nblocks * (16u / per)) {
        u64 b = t / (16u / per);
        float s = e4m3_decode(scales[b]);
        float q = conv == 0 ? __fdiv_rn(s, global) : (conv == 1 ? __fmul_rn(s, global) : s);
        u32 bytes = out_kind == 0 ? (u32)((const u16*)packed)[t] : ((const u32*)packed)[t];
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 byte = (bytes >> (8 * i)) & 0xFFu;
            u32 lo = byte & 15u, hi = byte >> 4;
            if (swap) { u32 tmp = lo; lo = hi; hi = tmp; }
            float v0 = __fmul_rn(e2m1_decode(lo), q);
            float v1 = __fmul_rn(e2m1_decode(hi), q);
            if (post_mul) { v0 = __fmul_rn(v0, post); v1 = __fmul_rn(v1, post); }
            v[2 * i] = v0;
            v[2 * i + 1] = v1;
        }
        if (out_kind == 0) {
            ((float4*)out)[t] = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = (u32)bf16_bits(v[2 * i]) | ((u32)bf16_bits(v[2 * i + 1]) << 16);
            ((uint4*)out)[t] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// ---- dequant_nvfp4_v2: same arguments, same output bits, faster ----------------------------------
// What differs from dequant_nvfp4 (the reference, and the fallback with NVFP4_PROBE_KERNELS=v1):
//  * Two shared tables per CUDA block, built at kernel start WITH THE V1 FUNCTIONS THEMSELVES:
//      dq_q[b] = the block multiplier q for scale byte b, exactly v1's expression
//                (e4m3_decode, then __fdiv_rn / __fmul_rn / nothing by conv);
//      dq_e[p] = (value of the even element, value of the odd element) of packed byte p, by
//                e2m1_decode, with the nibble order (swap) applied as v1 applies it.
//    The hot loop therefore has no E4M3/E2M1 decode, no division and no swap select: every
//    element is __fmul_rn(e, q) (then __fmul_rn(., post) when post_mul) on the very operands v1
//    multiplies. IEEE multiplication is deterministic, so the f32 bits agree, NaN results
//    included (both come from one FMUL on the same operands). BF16 output packs with
//    bf16x2_bits, equal to v1's two bf16_bits for every input (see there).
//  * A "piece" is what one 16-byte store covers, as in v1: 4 elements (2 packed bytes, f32 out)
//    or 8 elements (4 packed bytes, BF16 out); piece p uses scale byte p / (16 / E). A warp takes
//    DQ2_U * 32 consecutive pieces per step, lane l the pieces base + 32 j + l: every load and
//    store instruction is fully coalesced across the warp, and each lane issues all its DQ2_U
//    packed and scale loads before computing (DQ2_U x the bytes in flight of v1).
//  * No idle threads (v1 launches nblocks * 4 threads for BF16 output, which needs nblocks * 2).
//  * Invariants: blockDim.x is a multiple of 32 (the loop is warp-strided; Gpu::grid uses 256);
//    any gridDim works (the loop strides by the total warp count); the tail (a last step with
//    fewer than 32 * DQ2_U pieces) is handled by a per-lane bound. The launcher passes
//    n = ceil(pieces / DQ2_U) work items, one per lane-step; Gpu::grid caps the grid at
//    sm_count * 120 blocks, so the table build is amortised over many steps.
#define DQ2_U 4

// 8 resident blocks of 256 threads per SM (32 registers)
extern "C" __global__ void __launch_bounds__(256, 8)
dequant_nvfp4_v2(const u8* packed, const u8* scales, u64 nblocks, float global, int conv, float post,
                 int post_mul, int swap, int out_kind, void* out) {
    __shared__ float dq_q[256];
    __shared__ float2 dq_e[256];
    for (u32 i = threadIdx.x; i < 256u; i += blockDim.x) {
        float s = e4m3_decode(i);
        dq_q[i] = conv == 0 ? __fdiv_rn(s, global) : (conv == 1 ? __fmul_rn(s, global) : s);
        u32 lo = i & 15u, hi = i >> 4;
        if (swap) { u32 tmp = lo; lo = hi; hi = tmp; }
        dq_e[i] = make_float2(e2m1_decode(lo), e2m1_decode(hi));
    }
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 step = (((u64)gridDim.x * blockDim.x) >> 5) * (32u * DQ2_U);
    const bool pm = post_mul != 0;
    if (out_kind == 0) {
        // f32: piece = 2 packed bytes (one u16) -> 4 floats (one float4); 4 pieces per block
        const u64 np = nblocks * 4u;
        for (u64 base = warp * (32u * DQ2_U); base < np; base += step) {
            // pieces of this lane: base + lane + 32 j for 32 j + lane < lim (warp-uniform lim)
            const u32 lim = np - base < 32u * DQ2_U ? (u32)(np - base) : 32u * DQ2_U;
            const u16* pp = (const u16*)packed + base + lane;
            const u8* sp = scales + ((base + lane) >> 2);
            float4* op = (float4*)out + base + lane;
            u32 w[DQ2_U], sb[DQ2_U];
#pragma unroll
            for (int j = 0; j < DQ2_U; j++) {
                w[j] = 0u;
                sb[j] = 0u;
                if (32u * j + lane < lim) {
                    w[j] = __ldg(pp + 32 * j);
                    sb[j] = __ldg(sp + 8 * j);  // (base + lane + 32 j) >> 2, base % 4 == 0
                }
            }
#pragma unroll
            for (int j = 0; j < DQ2_U; j++) {
                if (32u * j + lane < lim) {
                    float q = dq_q[sb[j]];
                    float2 a = dq_e[w[j] & 0xFFu], b = dq_e[w[j] >> 8];
                    float v0 = __fmul_rn(a.x, q), v1 = __fmul_rn(a.y, q);
                    float v2 = __fmul_rn(b.x, q), v3 = __fmul_rn(b.y, q);
                    if (pm) {
                        v0 = __fmul_rn(v0, post);
                        v1 = __fmul_rn(v1, post);
                        v2 = __fmul_rn(v2, post);
                        v3 = __fmul_rn(v3, post);
                    }
                    op[32 * j] = make_float4(v0, v1, v2, v3);
                }
            }
        }
    } else {
        // BF16: piece = 4 packed bytes (one u32) -> 8 BF16 (one uint4); 2 pieces per block
        const u64 np = nblocks * 2u;
        for (u64 base = warp * (32u * DQ2_U); base < np; base += step) {
            const u32 lim = np - base < 32u * DQ2_U ? (u32)(np - base) : 32u * DQ2_U;
            const u32* pp = (const u32*)packed + base + lane;
            const u8* sp = scales + ((base + lane) >> 1);
            uint4* op = (uint4*)out + base + lane;
            u32 w[DQ2_U], sb[DQ2_U];
#pragma unroll
            for (int j = 0; j < DQ2_U; j++) {
                w[j] = 0u;
                sb[j] = 0u;
                if (32u * j + lane < lim) {
                    w[j] = __ldg(pp + 32 * j);
                    sb[j] = __ldg(sp + 16 * j);  // (base + lane + 32 j) >> 1, base % 2 == 0
                }
            }
#pragma unroll
            for (int j = 0; j < DQ2_U; j++) {
                if (32u * j + lane < lim) {
                    float q = dq_q[sb[j]];
                    u32 o[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        float2 e = dq_e[(w[j] >> (8 * k)) & 0xFFu];
                        float v0 = __fmul_rn(e.x, q), v1 = __fmul_rn(e.y, q);
                        if (pm) {
                            v0 = __fmul_rn(v0, post);
                            v1 = __fmul_rn(v1, post);
                        }
                        o[k] = bf16x2_bits(v0, v1);
                    }
                    op[32 * j] = make_uint4(o[0], o[1], o[2], o[3]);
                }
            }
        }
    }
}

// MXFP4: 32-element blocks with a UE8M0 scale.
extern "C" __global__ void dequant_mxfp4(const u8* packed, const u8* scales, u64 nblocks, int out_kind,
                                         void* out) {
    GRID_STRIDE(b, nblocks) {
        float s = ue8m0_decode(scales[b]);
        const u8* p = packed + b * 16;
        u64 base = b * 32;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 byte = p[i];
            store_val(out, base + 2 * i, __fmul_rn(e2m1_decode(byte & 15u), s), out_kind);
            store_val(out, base + 2 * i + 1, __fmul_rn(e2m1_decode(byte >> 4), s), out_kind);
        }
    }
}

// Generic block-scaled weight, the format table's `Decode` (src/checkpoint/formats) as data:
//   value = elem(code) * q, q = scale (gmode 0), scale / global (1) or scale * global (2),
// each product one f32 rounding, as `formats::decode_blocked` on the host.
//   elem: 0 = E4M3 byte, 1 = E2M1 packed two per byte (the even element in the low nibble);
//   scale_code: 0 = E4M3 byte, 1 = UE8M0 byte, 2 = f32; one scale per bm rows x bn columns,
//   row-major [ceil(rows / bm), ceil(cols / bn)].
// A block-scaled format the table describes needs no kernel of its own; the formats with their
// own kernels above and below (NVFP4, MXFP4, FP8 block) keep them for speed and their faults.
extern "C" __global__ void dequant_blocked(const u8* codes, int elem, const void* scales, int scale_code,
                                           u64 rows, u64 cols, u64 bm, u64 bn, int gmode, float global,
                                           int out_kind, void* out) {
    u64 sc = (cols + bn - 1) / bn;
    GRID_STRIDE(i, rows * cols) {
        u64 r = i / cols, c = i % cols;
        u64 si = (r / bm) * sc + c / bn;
        float s;
        if (scale_code == 0) s = e4m3_decode(((const u8*)scales)[si]);
        else if (scale_code == 1) s = ue8m0_decode(((const u8*)scales)[si]);
        else s = ((const float*)scales)[si];
        float q = gmode == 0 ? s : (gmode == 1 ? __fdiv_rn(s, global) : __fmul_rn(s, global));
        float e;
        if (elem == 0) {
            e = e4m3_decode(codes[i]);
        } else {
            u32 byte = codes[i >> 1];
            e = e2m1_decode((i & 1) ? (byte >> 4) : (byte & 15u));
        }
        store_val(out, i, __fmul_rn(e, q), out_kind);
    }
}

// FP8 block weight: e4m3 * scale[r / bm][c / bn] with f32 multipliers; extra = a second
// multiplication by the same scale (the double-applied-scale loader fault), 0 normally.
extern "C" __global__ void dequant_fp8_block(const u8* w, const float* scales, u64 rows, u64 cols, u64 bm,
                                             u64 bn, int extra, int out_kind, void* out) {
    u64 sc = (cols + bn - 1) / bn;
    GRID_STRIDE(i, rows * cols) {
        u64 r = i / cols, c = i % cols;
        float s = scales[(r / bm) * sc + c / bn];
        float v = __fmul_rn(e4m3_decode(w[i]), s);
        if (extra) v = __fmul_rn(v, s);
        store_val(out, i, v, out_kind);
    }
}

// Dense f32 weight -> out_kind (bf16 bits or an f32 copy rounded to BF16 when round != 0).
extern "C" __global__ void convert_dense(const float* w, u64 n, int round, int out_kind, void* out) {
    GRID_STRIDE(i, n) {
        float v = w[i];
        if (round) v = bf16_round(v);
        store_val(out, i, v, out_kind);
    }
}
