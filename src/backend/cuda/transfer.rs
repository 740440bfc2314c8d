//! Host ↔ device copies: values of host tensors uploaded once and kept with them ([`DevTensor`],
//! [`DevRef`]), device results handed back as tensor data, the pinned staging buffers (and lending
//! them to a run's loader thread) and the pinned bounce buffer small reads land in.

use super::*;

/// A pinned host buffer that small device → host reads land in ([`BOUNCE`] bytes). A read into
/// pageable memory is synchronous inside the driver, and while the GPU works off a long queue it
/// held up the loader thread's driver calls (30-35 ms per Flash layer on the H200); into pinned
/// memory the copy is asynchronous and the host waits with a stream synchronization.
pub struct Bounce {
    ptr: *mut u8,
    lock: Mutex<()>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is only touched under `lock`
unsafe impl Send for Bounce {}

unsafe impl Sync for Bounce {}

const BOUNCE: usize = 1 << 20;

impl Bounce {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Bounce> {
        let p = unsafe { dres::malloc_host(BOUNCE, 0) }.map_err(|e| cuda_err("pinned", e))?;
        Ok(Bounce {
            ptr: p as *mut u8,
            lock: Mutex::new(()),
            ctx: ctx.clone(),
        })
    }

    /// The values at `src` into `out` through the pinned buffer, a [`BOUNCE`]-byte piece at a
    /// time; waits for `stream`.
    pub(super) fn read<T: Copy>(
        &self,
        stream: &CudaStream,
        src: u64,
        out: &mut [T],
    ) -> std::result::Result<(), String> {
        let bytes = std::mem::size_of_val(out);
        // SAFETY: a byte view of `out` (plain values; every bit pattern is written by the copy)
        let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        for (i, piece) in dst.chunks_mut(BOUNCE).enumerate() {
            let pin = unsafe { std::slice::from_raw_parts_mut(self.ptr, piece.len()) };
            let at = src + (i * BOUNCE) as u64;
            unsafe { dres::memcpy_dtoh_async(pin, at, stream.cu_stream()) }
                .map_err(|e| format!("cuda: copy to host: {e:?}"))?;
            stream
                .synchronize()
                .map_err(|e| format!("cuda: kernel execution: {e:?}"))?;
            piece.copy_from_slice(pin);
        }
        Ok(())
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = dres::free_host(self.ptr as _);
        }
    }
}

/// A tensor's values in device memory, produced by a device op or uploaded once from the host
/// (`Gpu::input`); read-only. `Data` fetches them to the host only when host code reads them.
pub struct DevTensor {
    pub(super) buf: Buf,
    pub(super) n: usize,
    pub(super) stream: Arc<CudaStream>,
    pub(super) bounce: Arc<Bounce>,
}

impl crate::tensor::DeviceValues for DevTensor {
    fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    fn len(&self) -> usize {
        self.n
    }
    fn owner(&self) -> usize {
        Arc::as_ptr(&self.stream) as *const u8 as usize
    }
    fn to_host(&self) -> std::result::Result<Vec<f32>, String> {
        let _s = crate::profile::span("host: device values read by host code");
        let mut v = vec![0f32; self.n];
        if self.n > 0 {
            self.bounce.read(&self.stream, self.buf.ptr, &mut v)?;
        } else {
            self.stream
                .synchronize()
                .map_err(|e| format!("cuda: kernel execution: {e:?}"))?;
        }
        Ok(v)
    }
}

/// A device address that stays valid while this lives (it holds the values' allocation).
pub struct DevRef {
    pub ptr: u64,
    _keep: Arc<dyn crate::tensor::DeviceValues>,
}

impl Gpu {
    /// This device state's identity (`DeviceValues::owner` of what it made).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.stream) as *const u8 as usize
    }

    /// The device address of a tensor's values: its device copy, or the host values uploaded
    /// now and kept with the tensor, so the next op (or path) that reads it does not upload again.
    pub fn input(&self, x: &Data) -> Result<DevRef> {
        if let Some(d) = x.device() {
            if d.owner() == self.id() {
                return Ok(DevRef {
                    ptr: d.ptr(),
                    _keep: d.clone(),
                });
            }
        }
        let n = x.len();
        let b = self.upload(&x[..])?;
        let d: Arc<dyn crate::tensor::DeviceValues> = Arc::new(DevTensor {
            buf: b,
            n,
            stream: self.stream.clone(),
            bounce: self.bounce.clone(),
        });
        if x.device().is_none() {
            x.attach_device(d.clone());
        }
        Ok(DevRef {
            ptr: d.ptr(),
            _keep: d,
        })
    }

    /// Device values as a tensor's data, left on the device; `exact`: every value is known to be
    /// a BF16 value (the producer rounded).
    pub fn output(&self, b: Buf, n: usize, exact: bool) -> Data {
        debug_assert!(b.bytes >= n * 4);
        let d = Data::from_device(Arc::new(DevTensor {
            buf: b,
            n,
            stream: self.stream.clone(),
            bounce: self.bounce.clone(),
        }));
        if exact {
            d.set_bf16_exact(true);
        }
        d
    }

    /// A device copy of `x`'s values in a new allocation (for kernels that work in place).
    pub fn input_copy(&self, x: &Data) -> Result<Buf> {
        let n = x.len();
        let src = self.input(x)?;
        let b = self.alloc(n * 4)?;
        if n > 0 {
            self.copy_on_device(b.ptr, src.ptr, n)?;
        }
        Ok(b)
    }

    /// Copy `n` f32 values from `src` to `dst` on the device (queued on the stream).
    pub fn copy_on_device(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        self.timed("copy device->device", || {
            unsafe { dres::memcpy_dtod_async(dst, src, n * 4, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy on device", e))
        })
    }

    /// The BF16 storage rounding of `x` on the device (values that are not on the host stay there).
    pub fn round_data(&self, x: &mut Data) -> Result<()> {
        let n = x.len();
        let src = self.input(x)?;
        let b = self.alloc(n * 4)?;
        // one pass: read x, write its rounding into the new buffer
        self.kern()
            .round_bf16(n as u64, src.ptr, b.ptr, n as u64, 0)?;
        *x = self.output(b, n, true);
        Ok(())
    }

    /// Whether every value of `x` is a BF16 value (NaN counts as one): known from its producer,
    /// scanned on the host when the values are there, else counted on the device.
    pub fn bf16_exact(&mut self, x: &Data) -> Result<bool> {
        if let Some(e) = x.known_bf16_exact() {
            return Ok(e);
        }
        if x.on_host() {
            return Ok(crate::numerics::bf16::all_exact(&x[..]));
        }
        let n = x.len();
        let p = self.input(x)?;
        let c = self.scratch("inexact_count", 8)?;
        self.memset(c, 0, 8)?;
        self.kern()
            .count_inexact_bf16(n as u64, p.ptr, n as u64, c)?;
        let v: Vec<u64> = self.download(c, 1)?;
        let exact = v[0] == 0;
        x.set_bf16_exact(exact);
        Ok(exact)
    }

    /// Pageable host → device (small tensors: activations, scalars).
    pub fn upload<T: Copy>(&self, src: &[T]) -> Result<Buf> {
        let b = self.alloc(std::mem::size_of_val(src))?;
        self.copy_in(b.ptr, src)?;
        Ok(b)
    }

    /// Host → device. From 1 MiB on through the pinned staging buffers (a parallel copy into
    /// pinned memory, then DMA), several times faster than the driver's pageable path.
    pub fn copy_in<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::size_of_val(src);
        if bytes >= STAGED_MIN && !self.pinned.is_empty() {
            // SAFETY: a byte view of initialised `Copy` data
            let b = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, bytes) };
            return self.stage_in(dst, b);
        }
        self.timed("copy host->device (small)", || {
            unsafe { dres::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to device", e))
        })
    }

    /// Device → host; synchronizes the stream. From 1 MiB on through the pinned staging buffers,
    /// below that through the pinned bounce buffer (never into pageable memory: see [`Bounce`]).
    pub fn download<T: Copy + Default>(&self, src: u64, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(&v[..]);
        if bytes >= STAGED_MIN && !self.pinned.is_empty() {
            // SAFETY: every bit pattern is written by the copy; the element types used here
            // (f32, u8, u16, u32, u64, i32) are valid for any bits
            let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes) };
            self.stage_out(b, src)?;
            return Ok(v);
        }
        if n == 0 {
            self.sync()?;
            return Ok(v);
        }
        // (not on the kernel timer: the read waits for the stream inside)
        self.bounce
            .read(&self.stream, src, &mut v)
            .map_err(Error::Backend)?;
        Ok(v)
    }

    /// Host bytes → device through the two pinned buffers: each chunk is copied in parallel into
    /// a pinned buffer once that buffer's previous DMA has finished, then sent asynchronously.
    fn stage_in(&self, dst: u64, src: &[u8]) -> Result<()> {
        use rayon::prelude::*;
        let stage = self.stage_len();
        for (ci, chunk) in src.chunks(stage).enumerate() {
            let (p, _, ev) = &self.pinned[ci % 2];
            {
                let _s = crate::profile::span("host: stage_in wait");
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            let pin = unsafe { std::slice::from_raw_parts_mut(*p, chunk.len()) };
            let _s = crate::profile::span("host: stage_in memcpy");
            pin.par_chunks_mut(1 << 20)
                .zip(chunk.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
            self.timed("copy host->device (staged)", || {
                unsafe {
                    dres::memcpy_htod_async(
                        dst + (ci * stage) as u64,
                        &pin[..],
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| cuda_err("copy to device", e))
            })?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        }
        Ok(())
    }

    /// Device → host bytes through a pinned buffer (DMA, then a parallel copy out).
    fn stage_out(&self, dst: &mut [u8], src: u64) -> Result<()> {
        use rayon::prelude::*;
        let stage = self.stage_len();
        for (ci, chunk) in dst.chunks_mut(stage).enumerate() {
            let (p, _, ev) = &self.pinned[ci % 2];
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            let pin = unsafe { std::slice::from_raw_parts_mut(*p, chunk.len()) };
            self.timed("copy device->host", || {
                unsafe {
                    dres::memcpy_dtoh_async(
                        &mut pin[..],
                        src + (ci * stage) as u64,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| cuda_err("copy to host", e))
            })?;
            {
                let _s = crate::profile::span("host: stage_out wait");
                self.sync()?;
            }
            let _s = crate::profile::span("host: stage_out memcpy");
            chunk
                .par_chunks_mut(1 << 20)
                .zip(pin.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }
        Ok(())
    }

    /// Bytes of one pinned staging buffer in use.
    pub(super) fn stage_len(&self) -> usize {
        self.pinned.first().map_or(STAGE, |p| p.1)
    }

    /// Lend the large pinned staging buffers (pointer, bytes) to a run's loader thread, which
    /// then has them to itself; this state stages through its small set meanwhile (allocated when
    /// it opened). Give them back with [`Gpu::unlend_pinned`] once the loader is done.
    pub fn lend_pinned(&mut self) -> Result<Vec<(usize, usize)>> {
        if self.lent {
            return Ok(Vec::new());
        }
        // nothing of this state may still be copying out of them
        for (_, _, ev) in &self.pinned {
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
        }
        std::mem::swap(&mut self.pinned, &mut self.pinned_spare);
        self.lent = true;
        Ok(self
            .pinned_spare
            .iter()
            .map(|(p, n, _)| (*p as usize, *n))
            .collect())
    }

    /// Take the lent buffers back (the loader has finished every copy out of them).
    pub fn unlend_pinned(&mut self) -> Result<()> {
        if self.lent {
            for (_, _, ev) in &self.pinned {
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            std::mem::swap(&mut self.pinned, &mut self.pinned_spare);
            self.lent = false;
        }
        Ok(())
    }

    /// Copy the first pinned staging buffer to `dst` (asynchronously; for the H2D bandwidth bench).
    pub fn copy_pinned_to(&self, dst: u64) -> Result<usize> {
        let (p, n, _) = &self.pinned[0];
        let src = unsafe { std::slice::from_raw_parts(*p as *const u8, *n) };
        self.timed("copy host->device", || {
            unsafe { dres::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to device", e))
        })?;
        Ok(*n)
    }

    /// Stream bytes from the mmap to the device through two pinned buffers: the copy of one chunk
    /// into pinned memory (parallel, which also faults the pages in from disk) overlaps the DMA of
    /// the previous chunk.
    pub fn upload_staged(&mut self, src: &[u8]) -> Result<Buf> {
        let t0 = Instant::now();
        let b = self.alloc(src.len())?;
        self.copy_in(b.ptr, src)?;
        self.counters.bytes_uploaded += src.len() as u64;
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(b)
    }
}
