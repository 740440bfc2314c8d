//! Statistics on the device: the fused per-tensor statistics and comparisons (queued, copied into
//! pinned metrics slots, collected later), and the per-kernel device timer.

use super::*;

/// Device time per kernel, cuBLAS call and copy, from CUDA events recorded around every one
/// (`NVFP4_PROBE_KERNEL_TIME=1`): the GPU work of a run without the host's gaps between launches.
#[derive(Default)]
pub struct KernelTimer {
    free: Vec<CudaEvent>,
    pending: Vec<(CudaEvent, CudaEvent, &'static str, usize)>,
    by_kernel: HashMap<&'static str, (u64, f64)>,
    /// Device milliseconds and calls by (the runner's op step when enqueued, kernel).
    by_step_kernel: HashMap<(usize, &'static str), (u64, f64)>,
    /// The first timed launch's start event, and the end of the latest one (ms after it).
    origin: Option<CudaEvent>,
    last_end: f64,
    /// Device idle time before timed work (the stream has one queue, so the gap between one
    /// item's end and the next one's start): milliseconds and gaps by the later item's op step.
    idle_by_step: HashMap<usize, (u64, f64)>,
}

/// Idle gaps shorter than this (ms) are the events' own resolution and launch cadence, not waits.
const IDLE_MIN_MS: f64 = 0.02;

impl KernelTimer {
    fn drain(&mut self) -> Result<()> {
        for (a, b, name, step) in std::mem::take(&mut self.pending) {
            let ms = a.elapsed_ms(&b).map_err(|e| cuda_err("event timing", e))?;
            // the first timed item starts the clock
            let start = match &self.origin {
                Some(o) => o.elapsed_ms(&a).map_err(|e| cuda_err("event timing", e))? as f64,
                None => 0.0,
            };
            if start - self.last_end > IDLE_MIN_MS {
                let e = self.idle_by_step.entry(step).or_default();
                e.0 += 1;
                e.1 += start - self.last_end;
            }
            self.last_end = start + ms as f64;
            let e = self.by_kernel.entry(name).or_default();
            e.0 += 1;
            e.1 += ms as f64;
            let e = self.by_step_kernel.entry((step, name)).or_default();
            e.0 += 1;
            e.1 += ms as f64;
            if self.origin.is_none() {
                self.origin = Some(a);
            } else {
                self.free.push(a);
            }
            self.free.push(b);
        }
        Ok(())
    }
}

/// (key, count, seconds) of a timer's (count, milliseconds) table, longest first.
fn longest_first<K: Copy>(m: &HashMap<K, (u64, f64)>) -> Vec<(K, u64, f64)> {
    let mut v: Vec<_> = m.iter().map(|(k, (n, ms))| (*k, *n, ms / 1e3)).collect();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}

/// Bytes of one pinned metrics slot: room for [`METRIC_SLOT`] / 8 / [`STAT_WORDS`] pairs.
const METRIC_SLOT: usize = 8 << 10;

/// Slots per pinned block.
const METRIC_SLOTS_PER_BLOCK: usize = 64;

/// `fused_stats`'s f64 sums (`ACC_N` in kernels/stats.cu), then its counters (`CNT_N`).
const ACC_WORDS: usize = 5;
const CNT_WORDS: usize = 12;
/// Words (u64) per statistics item: the sums, the counters, 2 values at the largest error
/// (`stats_pick`).
const STAT_WORDS: usize = ACC_WORDS + CNT_WORDS + 2;

/// Metrics launched on the device and copied (asynchronously) into a pinned slot; read with
/// [`Gpu::metrics_collect`], which waits only for this copy, not for work queued after it.
pub struct PendingMetrics {
    slot: usize,
    ev: CudaEvent,
    items: Vec<(usize, bool)>,
    _keep: Vec<DevRef>,
    _acc: Buf,
}

impl Gpu {
    /// Run `f` (work enqueued on the stream) between two timing events when the kernel timer is on.
    pub(crate) fn timed<R>(&self, name: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let Some(t) = &self.ktimer else {
            let r = f();
            if self.sync_check {
                // a device fault is named by the launch that made it (`NVFP4_PROBE_SYNC_CHECK=1`)
                self.stream.synchronize().map_err(|e| {
                    cuda_err(&format!("{name} (step {})", crate::profile::step()), e)
                })?;
            }
            return r;
        };
        let ev = |t: &mut KernelTimer| match t.free.pop() {
            Some(e) => Ok(e),
            None => self
                .ctx
                .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("event", e)),
        };
        let (a, b) = {
            let mut t = t.borrow_mut();
            (ev(&mut t)?, ev(&mut t)?)
        };
        a.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        let r = f();
        b.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        let mut t = t.borrow_mut();
        t.pending.push((a, b, name, crate::profile::step()));
        if t.pending.len() >= 4096 {
            t.drain()?;
        }
        r
    }

    /// With the kernel timer on: device seconds (kernels, cuBLAS calls and copies on the compute
    /// stream) by op step, in step order.
    pub fn kernel_times_by_step(&self) -> Option<Vec<(usize, f64)>> {
        let t = self.ktimer_read()?;
        let mut by_step: HashMap<usize, f64> = HashMap::new();
        for ((step, _), (_, ms)) in &t.by_step_kernel {
            *by_step.entry(*step).or_default() += ms / 1e3;
        }
        let mut v: Vec<_> = by_step.into_iter().collect();
        v.sort_by_key(|x| x.0);
        Some(v)
    }

    /// With the kernel timer on: the device's idle time between timed work as (op step of the
    /// work that ended the gap, gaps, seconds), longest first.
    pub fn idle_by_step(&self) -> Option<Vec<(usize, u64, f64)>> {
        Some(longest_first(&self.ktimer_read()?.idle_by_step))
    }

    /// With the kernel timer on: the kernels of op `step` as (name, calls, device seconds),
    /// longest first.
    pub fn kernel_times_of_step(&self, step: usize) -> Vec<(&'static str, u64, f64)> {
        let Some(t) = self.ktimer.as_ref() else {
            return Vec::new();
        };
        let t = t.borrow();
        let mut v: Vec<_> = t
            .by_step_kernel
            .iter()
            .filter(|((s, _), _)| *s == step)
            .map(|((_, k), (n, ms))| (*k, *n, ms / 1e3))
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// With the kernel timer on: (name, calls, device seconds) per kernel, cuBLAS call and copy
    /// kind so far, longest first.
    pub fn kernel_times(&self) -> Option<Vec<(&'static str, u64, f64)>> {
        Some(longest_first(&self.ktimer_read()?.by_kernel))
    }

    /// The kernel timer with every recorded pair of events read, when it is on.
    fn ktimer_read(&self) -> Option<std::cell::RefMut<'_, KernelTimer>> {
        let mut t = self.ktimer.as_ref()?.borrow_mut();
        t.drain().ok()?;
        Some(t)
    }

    /// Statistics of `x` and, with a reference, the comparison, in one pass on the device.
    pub fn stats_compare(
        &mut self,
        x: u64,
        r: Option<u64>,
        n: usize,
    ) -> Result<(Stats, Option<Compare>)> {
        let acc = self.stats_queue(&[(x, r, n)])?;
        let raw: Vec<u64> = self.download(acc.ptr, STAT_WORDS)?;
        Ok(Self::stats_parse(&[(n, r.is_some())], &raw)[0].finish())
    }

    /// Queue, per (x, reference, n), `fused_stats` into its own accumulator words of a new
    /// allocation and, with a reference, `stats_pick` (the two values at the largest error):
    /// [`STAT_WORDS`] words per item, read by [`Gpu::stats_parse`].
    fn stats_queue(&mut self, items: &[(u64, Option<u64>, usize)]) -> Result<Buf> {
        let bytes = items.len().max(1) * STAT_WORDS * 8;
        self.counters.metric_passes += items.len() as u64;
        let acc = self.alloc(bytes)?;
        self.memset(acc.ptr, 0, bytes)?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        for (k, &(x, r, n)) in items.iter().enumerate() {
            let a = acc.ptr + (k * STAT_WORDS * 8) as u64;
            let (cnt, pick) = (
                a + ACC_WORDS as u64 * 8,
                a + (ACC_WORDS + CNT_WORDS) as u64 * 8,
            );
            let r0 = r.unwrap_or(0);
            self.kern().fused_stats(n as u64, x, r0, n as u64, a, cnt)?;
            if r.is_some() {
                self.kern().stats_pick(one, x, r0, n as u64, cnt, pick)?;
            }
        }
        Ok(acc)
    }

    /// Statistics and comparisons from [`Gpu::stats_queue`]'s words, per item (n, has reference).
    fn stats_parse(items: &[(usize, bool)], raw: &[u64]) -> Vec<Partial> {
        items
            .iter()
            .zip(raw.chunks(STAT_WORDS))
            .map(|(&(n, has_ref), v)| {
                let a: [f64; ACC_WORDS] = std::array::from_fn(|j| f64::from_bits(v[j]));
                let c: [u64; CNT_WORDS] = std::array::from_fn(|j| v[ACC_WORDS + j]);
                let (x, r) = (v[ACC_WORDS + CNT_WORDS], v[ACC_WORDS + CNT_WORDS + 1]);
                Self::stats_of(n, &a, &c, has_ref, |_| {
                    (x >> 32 == 1).then(|| (f32::from_bits(x as u32), f32::from_bits(r as u32)))
                })
            })
            .collect()
    }

    /// The sums and counts of `fused_stats` as a [`Partial`]; `at(i)` gives (x[i], r[i]) for
    /// the largest error's index.
    fn stats_of(
        n: usize,
        a: &[f64; ACC_WORDS],
        c: &[u64; CNT_WORDS],
        has_ref: bool,
        at: impl FnOnce(usize) -> Option<(f32, f32)>,
    ) -> Partial {
        let f = |v: u64| f32::from_bits(v as u32) as f64;
        let pair = has_ref.then(|| {
            let max_err = (c[10] > 0)
                .then(|| (0xFFFF_FFFFu64 - (c[9] & 0xFFFF_FFFF)) as usize)
                .and_then(|idx| {
                    let (xa, ra) = at(idx)?;
                    Some(((xa as f64 - ra as f64).abs(), idx))
                });
            PairSums {
                dot: a[1],
                nx: a[2],
                nr: a[3],
                ne: a[4],
                ax: f(c[7]),
                ar: f(c[8]),
                max_err,
                any_non_finite: c[5] > 0,
                new_non_finite: c[4] as usize,
                equal: c[11] as usize,
            }
        });
        Partial::from_counts(
            n,
            c[0] as usize,
            c[1] as usize,
            c[2] as usize,
            c[3] as usize,
            f(c[6]),
            a[0],
            pair,
        )
    }

    /// Upload host tensors once and compute, for each (x, reference) pair, x's statistics and the
    /// comparison; pairs with `None` give statistics only. One synchronization for all pairs.
    pub fn metrics(
        &mut self,
        tensors: &[&Data],
        pairs: &[(usize, Option<usize>)],
    ) -> Result<Vec<(Stats, Option<Compare>)>> {
        let p = self.metrics_launch(tensors, pairs)?;
        Ok(self
            .metrics_collect(p)?
            .iter()
            .map(Partial::finish)
            .collect())
    }

    /// [`Gpu::metrics`] without waiting: the statistics kernels, the pick of the values at each
    /// comparison's largest error, and the copy of the results into a pinned slot are queued on
    /// the stream; [`Gpu::metrics_collect`] reads them.
    pub fn metrics_launch(
        &mut self,
        tensors: &[&Data],
        pairs: &[(usize, Option<usize>)],
    ) -> Result<PendingMetrics> {
        for &(i, j) in pairs {
            let n = tensors[i].len();
            if let Some(j) = j {
                if tensors[j].len() != n {
                    return Err(Error::Backend(format!(
                        "metrics: length mismatch {n} vs {}",
                        tensors[j].len()
                    )));
                }
            }
        }
        let bytes = pairs.len() * STAT_WORDS * 8;
        if bytes > METRIC_SLOT {
            return Err(Error::Backend(format!(
                "metrics: {} pairs in one call (at most {})",
                pairs.len(),
                METRIC_SLOT / 8 / STAT_WORDS
            )));
        }
        let bufs: Vec<DevRef> = tensors
            .iter()
            .map(|t| self.input(t))
            .collect::<Result<_>>()?;
        let items: Vec<(u64, Option<u64>, usize)> = pairs
            .iter()
            .map(|&(i, j)| (bufs[i].ptr, j.map(|j| bufs[j].ptr), tensors[i].len()))
            .collect();
        let acc = self.stats_queue(&items)?;
        if self.metric_free.is_empty() {
            self.add_metric_block()?;
        }
        let slot = self.metric_free.pop().expect("refilled above");
        let dst = unsafe { std::slice::from_raw_parts_mut(slot as *mut u8, bytes) };
        let copied = self.timed("copy device->host (metrics)", || {
            unsafe { dres::memcpy_dtoh_async(dst, acc.ptr, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to host", e))
        });
        let ev = copied.and_then(|_| {
            let ev = self.ctx.new_event(None).map_err(|e| cuda_err("event", e))?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
            Ok(ev)
        });
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                self.metric_free.push(slot);
                return Err(e);
            }
        };
        Ok(PendingMetrics {
            slot,
            ev,
            items: pairs
                .iter()
                .map(|&(i, j)| (tensors[i].len(), j.is_some()))
                .collect(),
            _keep: bufs,
            _acc: acc,
        })
    }

    /// Pin one more block of [`METRIC_SLOTS_PER_BLOCK`] metrics slots.
    pub(super) fn add_metric_block(&mut self) -> Result<()> {
        let blk = unsafe { dres::malloc_host(METRIC_SLOT * METRIC_SLOTS_PER_BLOCK, 0) }
            .map_err(|e| cuda_err("pinned metrics slots", e))? as *mut u8;
        self.metric_blocks.push(blk);
        self.metric_free
            .extend((0..METRIC_SLOTS_PER_BLOCK).map(|i| blk as usize + i * METRIC_SLOT));
        Ok(())
    }

    /// The results of [`Gpu::metrics_launch`], once its copy has landed.
    /// Each item's sums and counts ([`Partial::finish`] gives its metrics).
    pub fn metrics_collect(&mut self, p: PendingMetrics) -> Result<Vec<Partial>> {
        let waited = {
            let _s = crate::profile::span("host: metrics wait");
            let t0 = Instant::now();
            let r = p.ev.synchronize();
            crate::profile::interval("metrics wait", 0, t0);
            r
        };
        let n = p.items.len() * STAT_WORDS;
        let raw: Vec<u64> = unsafe { std::slice::from_raw_parts(p.slot as *const u64, n) }.to_vec();
        self.metric_free.push(p.slot);
        waited.map_err(|e| cuda_err("kernel execution", e))?;
        Ok(Self::stats_parse(&p.items, &raw))
    }
}
