#!/usr/bin/env python3
"""Page cache -> device, end to end, with a launching thread beside it (GPU machine, warm page cache).

The V3 release layer's warm bound (issue 23) asks for ~9 GB moved from the page cache to the device in about
1.5x the pinned DMA time. This measures the two ways there, over the shards of a checkpoint directory
(argv[1], default /tmp/flash), GB (argv[2], default 9) of them:
  A. copy: 16 threads pread 4 MiB pieces into one of two 256 MiB pinned buffers, then one async DMA per buffer
     (what the loader does);
  B. register: cudaHostRegister (read-only) of the file mapping, a piece at a time, then an async DMA straight
     from it; pieces of 64 / 256 / 1024 MiB; unregistering timed apart;
  C. each of A and B again while another thread launches small kernels (torch add_ on 4 KiB) as fast as it can:
     how many launches it got through per ms, against the same thread alone.
  D. B with 2 / 4 / 8 threads registering (and queueing the DMA of) their own pieces at once.
Prints GB/s and launches/ms per variant. Usage: python3 probes/device/regpipe.py /tmp/flash 9
"""
import ctypes, glob, mmap, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/flash"
gb = float(sys.argv[2]) if len(sys.argv) > 2 else 9.0
files = sorted(glob.glob(d + "/*.safetensors"))
spans = []  # (path, offset, bytes), 2 MiB aligned, up to gb GB in all
want = int(gb * 1e9)
for p in files:
    sz = os.path.getsize(p) // (2 << 20) * (2 << 20)
    take = min(sz - (2 << 20), want - sum(s[2] for s in spans))
    if take <= 0:
        break
    spans.append((p, 2 << 20, take))
total = sum(s[2] for s in spans)
print(f"{len(spans)} spans, {total/1e9:.2f} GB")
fds = {p: os.open(p, os.O_RDONLY) for p, _, _ in spans}
for p, o, n in spans:  # warm
    with open(p, "rb") as f:
        while f.read(64 << 20):
            pass

import cudart  # noqa: E402 (this folder)
rt = cudart.load()
torch.cuda.init()
dev = torch.empty(total, dtype=torch.uint8, device="cuda")
stream = torch.cuda.Stream()
sh = ctypes.c_void_p(stream.cuda_stream)
torch.cuda.synchronize()

def check(e, what):
    if e != 0:
        raise RuntimeError(f"{what}: cuda error {e}")

BATCH = 256 << 20
pins = [torch.empty(BATCH, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
pin_views = [memoryview(p.numpy()) for p in pins]
events = [None, None]
pool = ThreadPoolExecutor(16)

def copy_path():
    t = time.perf_counter()
    at = 0
    k = 0
    for p, o, n in spans:
        d0 = 0
        while d0 < n:
            m = min(BATCH, n - d0)
            bi = k % 2
            if events[bi] is not None:
                events[bi].synchronize()
            mv = pin_views[bi]
            def job(q, p=p, base=o + d0, mv=mv, m=m):
                c = min(4 << 20, m - q)
                assert os.preadv(fds[p], [mv[q:q + c]], base + q) == c
            list(pool.map(job, range(0, m, 4 << 20)))
            check(rt.cudaMemcpyAsync(ctypes.c_void_p(dev.data_ptr() + at), ctypes.c_void_p(pins[bi].data_ptr()),
                                     ctypes.c_size_t(m), 1, sh), "dma")
            ev = torch.cuda.Event()
            ev.record(stream)
            events[bi] = ev
            at += m; d0 += m; k += 1
    stream.synchronize()
    return total / (time.perf_counter() - t) / 1e9, 0.0

maps = {}
for p, o, n in spans:
    mm = mmap.mmap(fds[p], o + n, prot=mmap.PROT_READ)
    a = np.frombuffer(mm, dtype=np.uint8)
    maps[p] = (mm, a, a.ctypes.data)

def reg_path(piece):
    t = time.perf_counter()
    at = 0
    regs = []
    for p, o, n in spans:
        base = maps[p][2]
        d0 = 0
        while d0 < n:
            m = min(piece, n - d0)
            ptr = base + o + d0
            check(rt.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(m), ctypes.c_uint(8)), "register")
            regs.append(ptr)
            check(rt.cudaMemcpyAsync(ctypes.c_void_p(dev.data_ptr() + at), ctypes.c_void_p(ptr),
                                     ctypes.c_size_t(m), 1, sh), "dma")
            at += m; d0 += m
    stream.synchronize()
    el = time.perf_counter() - t
    t = time.perf_counter()
    for ptr in regs:
        check(rt.cudaHostUnregister(ctypes.c_void_p(ptr)), "unregister")
    un = time.perf_counter() - t
    return total / el / 1e9, un

small = torch.zeros(1024, device="cuda")
def launcher(stop, out):
    torch.cuda.synchronize()
    n = 0
    t = time.perf_counter()
    while not stop.is_set():
        for _ in range(50):
            small.add_(1.0)
        n += 50
    torch.cuda.synchronize()
    out.append(n / ((time.perf_counter() - t) * 1e3))

def alone_launch_rate(sec=0.3):
    stop = threading.Event(); out = []
    th = threading.Thread(target=launcher, args=(stop, out)); th.start()
    time.sleep(sec); stop.set(); th.join()
    return out[0]

def with_launcher(fn, *a):
    stop = threading.Event(); out = []
    th = threading.Thread(target=launcher, args=(stop, out)); th.start()
    time.sleep(0.02)
    r = fn(*a)
    stop.set(); th.join()
    return r, out[0]

print(f"launches alone: {alone_launch_rate():.1f} /ms")
dma_pin = []
for _ in range(3):
    t = time.perf_counter()
    check(rt.cudaMemcpyAsync(ctypes.c_void_p(dev.data_ptr()), ctypes.c_void_p(pins[0].data_ptr()),
                             ctypes.c_size_t(BATCH), 1, sh), "dma")
    stream.synchronize()
    dma_pin.append(BATCH / (time.perf_counter() - t) / 1e9)
print(f"DMA pinned -> device (256 MiB): {max(dma_pin):.1f} GB/s")
for rep in range(3):
    r, _ = copy_path()
    print(f"A copy path: {r:.1f} GB/s")
for piece in (64 << 20, 256 << 20, 1024 << 20):
    for rep in range(2):
        r, un = reg_path(piece)
        print(f"B register path, pieces {piece>>20} MiB: {r:.1f} GB/s end to end; unregister {un:.3f} s")
for rep in range(2):
    (r, _), lr = with_launcher(copy_path)
    print(f"C copy path with a launcher: {r:.1f} GB/s; launcher {lr:.1f} /ms")
for piece in (64 << 20, 256 << 20):
    for rep in range(2):
        (r, un), lr = with_launcher(reg_path, piece)
        print(f"C register path {piece>>20} MiB with a launcher: {r:.1f} GB/s; launcher {lr:.1f} /ms; unregister {un:.3f} s")
print(f"launches alone again: {alone_launch_rate():.1f} /ms")

def reg_parallel(threads, piece):
    """D: `threads` threads each register and DMA every threads-th piece."""
    jobs = []
    at = 0
    for p, o, n in spans:
        d0 = 0
        while d0 < n:
            m = min(piece, n - d0)
            jobs.append((maps[p][2] + o + d0, at, m))
            at += m; d0 += m
    regs = []
    def work(j):
        ptr, at, m = j
        check(rt.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(m), ctypes.c_uint(8)), "register")
        check(rt.cudaMemcpyAsync(ctypes.c_void_p(dev.data_ptr() + at), ctypes.c_void_p(ptr),
                                 ctypes.c_size_t(m), 1, sh), "dma")
        regs.append(ptr)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, jobs))
    stream.synchronize()
    el = time.perf_counter() - t
    for ptr in regs:
        check(rt.cudaHostUnregister(ctypes.c_void_p(ptr)), "unregister")
    return total / el / 1e9
for threads in (2, 4, 8):
    for piece in (64 << 20, 256 << 20):
        print(f"D register path, {threads} threads, pieces {piece>>20} MiB: {reg_parallel(threads, piece):.1f} GB/s end to end")
