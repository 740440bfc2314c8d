#!/usr/bin/env python3
"""Sweep `rcp.approx.ftz.f32` over every f32 significand in [1, 2) on the GPU and record where it differs from
the correctly rounded reciprocal. rcp(m·2^e) = rcp(m)·2^-e for normal results, so one binade describes all.
Writes JSON {mismatches: [[input_bits, gpu_bits, exact_bits], ...], device, count}."""
import json, sys
import cupy as cp
import numpy as np

src = r'''
extern "C" __global__ void k(const unsigned int* in, unsigned int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float x = __uint_as_float(in[i]); float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); out[i] = __float_as_uint(y); }
}'''
k = cp.RawKernel(src, "k")
n = 1 << 23
bits = (np.arange(n, dtype=np.uint32) | np.uint32(0x3F800000))
d_in = cp.asarray(bits)
d_out = cp.empty_like(d_in)
k(((n + 255) // 256,), (256,), (d_in, d_out, np.int32(n)))
gpu = cp.asnumpy(d_out)
x = bits.view(np.float32).astype(np.float64)
exact = (1.0 / x).astype(np.float32).view(np.uint32)
mis = np.nonzero(gpu != exact)[0]
out = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "count": int(mis.size),
       "mismatches": [[int(bits[i]), int(gpu[i]), int(exact[i])] for i in mis[:200000]]}
# a few special inputs
sp = np.array([0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0x3E2AAAAB, 0x40C00000, 0], dtype=np.uint32)
d = cp.asarray(sp); o = cp.empty_like(d); k((1,), (256,), (d, o, np.int32(sp.size)))
out["special"] = [[int(a), int(b)] for a, b in zip(sp, cp.asnumpy(o))]
json.dump(out, open(sys.argv[1], "w"))
print("rcp mismatches vs correctly rounded:", mis.size, "of", n)
