#!/usr/bin/env python3
"""How fast can the host move warm checkpoint bytes toward the GPU? (GPU machine, warm page cache)

Measures, on one shard of a checkpoint directory (argv[1], default /tmp/flash):
  - pread from the page cache into pinned memory, by thread count and piece size;
  - host memcpy pinned -> pinned (the memory bandwidth a copy gets), by thread count;
  - mmap + memcpy into pinned (first touch and again);
  - cudaHostRegister of the mmap (read-only) and a DMA straight from the page cache.
Prints GB/s per variant. Usage: python3 probes/device/hostread.py /tmp/flash
"""
import ctypes, glob, mmap, os, sys, time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/flash"
path = sorted(glob.glob(d + "/*.safetensors"), key=os.path.getsize)[-1]
size = os.path.getsize(path)
N = min(4 << 30, size // 2) // (1 << 20) * (1 << 20)
off0 = 1 << 20
print(f"file {path} ({size/1e9:.1f} GB), {N/1e9:.2f} GB per pass")
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
buf = torch.empty(N, dtype=torch.uint8, pin_memory=True)
arr = buf.numpy()
mv = memoryview(arr)
# warm
for o in range(0, N, 64 << 20):
    os.preadv(fd, [mv[o:o + (64 << 20)]], off0 + o)

def pread_pass(threads, piece):
    def job(o):
        n = min(piece, N - o)
        got = os.preadv(fd, [mv[o:o + n]], off0 + o)
        assert got == n
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(job, range(0, N, piece)))
    return N / (time.perf_counter() - t) / 1e9

for threads in (8, 16, 32):
    for piece in (1 << 20, 4 << 20, 16 << 20):
        r = [pread_pass(threads, piece) for _ in range(3)]
        print(f"pread -> pinned  threads {threads:2d} piece {piece>>20:2d} MiB: {max(r):6.1f} GB/s (best of 3; {', '.join(f'{x:.1f}' for x in r)})")

buf2 = torch.empty(N, dtype=torch.uint8, pin_memory=True)
a2 = buf2.numpy()
def memcpy_pass(threads, piece=16 << 20):
    def job(o):
        n = min(piece, N - o)
        np.copyto(a2[o:o + n], arr[o:o + n])
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(job, range(0, N, piece)))
    return N / (time.perf_counter() - t) / 1e9
for threads in (1, 8, 16):
    r = [memcpy_pass(threads) for _ in range(3)]
    print(f"memcpy pinned->pinned threads {threads:2d}: {max(r):6.1f} GB/s")

mm = mmap.mmap(fd, off0 + N, prot=mmap.PROT_READ)
src = np.frombuffer(mm, dtype=np.uint8)[off0:off0 + N]
def mmap_pass(threads, piece=16 << 20):
    def job(o):
        n = min(piece, N - o)
        np.copyto(arr[o:o + n], src[o:o + n])
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(job, range(0, N, piece)))
    return N / (time.perf_counter() - t) / 1e9
print(f"mmap + memcpy threads 16, first touch: {mmap_pass(16):6.1f} GB/s; again: {mmap_pass(16):6.1f} GB/s")
del src
mm.close()

# cudaHostRegister of a fresh mapping, then DMA from it
import cudart  # noqa: E402 (this folder)
rt = cudart.load()
print("cudart:", rt)
torch.cuda.init()
dev = torch.empty(N, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
def dma(src_ptr, n):
    t = time.perf_counter()
    e = rt.cudaMemcpy(ctypes.c_void_p(dev.data_ptr()), ctypes.c_void_p(src_ptr), ctypes.c_size_t(n), 1)
    assert e == 0, e
    return n / (time.perf_counter() - t) / 1e9
print(f"DMA pinned -> device: {max(dma(buf.data_ptr(), N) for _ in range(3)):6.1f} GB/s")
for flags, nm in ((8, "read-only"), (8 | 2, "read-only|mapped"), (0, "default")):
    mm = mmap.mmap(fd, off0 + N, prot=mmap.PROT_READ)
    a = np.frombuffer(mm, dtype=np.uint8)
    ptr = a.ctypes.data + off0
    page = ptr & ~4095
    n = (ptr + N - page + 4095) & ~4095
    t = time.perf_counter()
    e = rt.cudaHostRegister(ctypes.c_void_p(page), ctypes.c_size_t(n), ctypes.c_uint(flags))
    reg = time.perf_counter() - t
    if e != 0:
        print(f"cudaHostRegister({nm}) of the mmap failed: error {e}")
        rt.cudaGetLastError()
    else:
        r = [dma(ptr, N) for _ in range(3)]
        t = time.perf_counter()
        rt.cudaHostUnregister(ctypes.c_void_p(page))
        un = time.perf_counter() - t
        print(f"cudaHostRegister({nm}) {n/1e9:.2f} GB: {reg:.3f} s ({n/reg/1e9:.1f} GB/s); DMA from the page cache {max(r):.1f} GB/s; unregister {un:.3f} s")
    del a
    mm.close()
