//! The loader thread's side of the staging (`stage`): its own copy stream, pinned buffers and
//! open files, and its walk over the run's plan ahead of the runner — claim a batch of stored
//! tensors, reserve its device memory under the cap, read it into pinned memory in parallel,
//! copy it to the device and publish it as ready.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result as dres, CudaEvent, CudaStream, DevicePtr};

use super::{plan_bytes, Buf, Entry, Key, Lease, Mem, StageGroup, Stager, BATCH, PINNED, STAGE};
use crate::checkpoint::Checkpoint;
use crate::{Error, Result};

/// The loader's own resources: its copy stream, pinned buffers and open files.
struct Loader<'a> {
    st: &'a Arc<Stager>,
    ckpt: &'a Checkpoint,
    copy: Arc<CudaStream>,
    pinned: Vec<(*mut u8, Option<Arc<CudaEvent>>)>,
    /// Whether `pinned` was allocated here (freed on drop) or lent (`Stager::lent`).
    own_pinned: bool,
    next_pin: usize,
    /// Bytes of one batch (the size of each pinned buffer).
    batch: usize,
    files: HashMap<PathBuf, std::fs::File>,
    pool: rayon::ThreadPool,
}

impl Drop for Loader<'_> {
    fn drop(&mut self) {
        // the DMAs read the pinned buffers until they finish
        let _ = self.copy.synchronize();
        for (p, _) in self.pinned.drain(..) {
            if self.own_pinned {
                unsafe {
                    let _ = dres::free_host(p as _);
                }
            }
        }
    }
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("cuda: stage: {what}: {e:?}"))
}

impl Loader<'_> {
    /// Copy the spans (claimed as `Loading`, their bytes reserved) into one new device
    /// allocation and publish them as ready.
    fn load(&mut self, spans: &[(Key, usize, usize)], total: usize) -> Result<()> {
        for ((p, _), _, _) in spans {
            if !self.files.contains_key(p) {
                let f = std::fs::File::open(p)
                    .map_err(|e| Error::bad(p, None, format!("cannot open shard: {e}")))?;
                self.files.insert(p.clone(), f);
            }
        }
        let t_alloc = Instant::now();
        let slice = unsafe { self.copy.alloc::<u8>(total.max(16)) }
            .map_err(|e| cuda_err(&format!("alloc {total} B"), e))?;
        crate::profile::interval("loader alloc", spans.first().map_or(0, |c| c.2), t_alloc);
        let base_dev = {
            let (p, _g) = slice.device_ptr(&self.copy);
            p
        };
        let mem = Arc::new(Mem::Staged(Lease {
            slice: Some(slice),
            bytes: total,
            st: self.st.clone(),
        }));
        let t0 = Instant::now();
        // the copy stream runs in order: the last DMA's event says the whole batch is there
        let ready = if total > self.batch && spans.len() == 1 {
            // one tensor larger than a batch (the LM head): a batch-sized piece at a time
            let ((path, off), _, step) = &spans[0];
            let mut d = 0usize;
            let mut last = None;
            while d < total {
                let n = self.batch.min(total - d);
                let piece = [((path.clone(), off + d as u64), n, *step)];
                last = Some(self.copy_read(&piece, n, base_dev + d as u64)?);
                d += n;
            }
            last.ok_or_else(|| Error::Backend("internal: stage: an empty tensor in pieces".into()))?
        } else {
            self.copy_read(spans, total, base_dev)?
        };
        let host_s = t0.elapsed().as_secs_f64();
        crate::profile::interval("load", spans.first().map_or(0, |c| c.2), t0);
        let t_pub = Instant::now();
        let mut st = self.st.lock();
        let mut at = 0usize;
        for (key, len, step) in spans {
            self.ckpt.note_read(*len);
            let buf = Buf::shared(&mem, base_dev + at as u64, *len);
            st.entries.insert(
                key.clone(),
                Entry::Ready {
                    buf,
                    ready: ready.clone(),
                    step: *step,
                },
            );
            at += len;
        }
        st.stats.bytes += total as u64;
        st.stats.batches += 1;
        st.stats.host_seconds += host_s;
        drop(st);
        drop(mem);
        self.st.cv.notify_all();
        crate::profile::interval("loader publish", 0, t_pub);
        Ok(())
    }

    /// Positioned reads into a pinned buffer (in parallel), then one DMA. Returns the event
    /// recorded after that DMA (the buffer is free again once it has fired).
    fn copy_read(
        &mut self,
        spans: &[(Key, usize, usize)],
        total: usize,
        base_dev: u64,
    ) -> Result<Arc<CudaEvent>> {
        use std::os::unix::fs::FileExt;
        if self.pinned.is_empty() {
            self.own_pinned = true;
            for _ in 0..PINNED {
                let p = unsafe { dres::malloc_host(self.batch, 0) }
                    .map_err(|e| cuda_err("pinned", e))?;
                self.pinned.push((p as *mut u8, None));
            }
        }
        let ci = self.next_pin;
        self.next_pin = (ci + 1) % self.pinned.len();
        if let Some(ev) = &self.pinned[ci].1 {
            ev.synchronize().map_err(|e| cuda_err("pinned buffer", e))?;
        }
        let pin = self.pinned[ci].0 as usize;
        let mut pieces = Vec::new();
        let mut at = 0usize;
        for (si, (_, len, _)) in spans.iter().enumerate() {
            let mut d = 0;
            while d < *len {
                let n = (4 << 20).min(len - d);
                pieces.push((si, d, at + d, n));
                d += n;
            }
            at += len;
        }
        let files = &self.files;
        self.pool.install(|| {
            use rayon::prelude::*;
            pieces.par_iter().try_for_each(|&(si, d, poff, n)| {
                let ((path, off), _, _) = &spans[si];
                let foff = off + d as u64;
                // disjoint ranges of the pinned buffer
                let dst = unsafe { std::slice::from_raw_parts_mut((pin + poff) as *mut u8, n) };
                files[path].read_exact_at(dst, foff).map_err(|e| {
                    Error::bad(
                        path,
                        None,
                        format!("read of bytes {foff}..{} failed: {e}", foff + n as u64),
                    )
                })
            })
        })?;
        let src = unsafe { std::slice::from_raw_parts(pin as *const u8, total) };
        unsafe { dres::memcpy_htod_async(base_dev, src, self.copy.cu_stream()) }
            .map_err(|e| cuda_err("copy to device", e))?;
        let done = Arc::new(
            self.st
                .ctx
                .new_event(None)
                .map_err(|e| cuda_err("event", e))?,
        );
        done.record(&self.copy).map_err(|e| cuda_err("event", e))?;
        self.pinned[ci].1 = Some(done.clone());
        Ok(done)
    }

    /// Claim what is still unclaimed of `cand` (spans of ops the runner has not passed), reserve
    /// memory first (so a claimed batch never waits on the runner), then load it.
    fn flush(
        &mut self,
        cand: &mut Vec<(Key, usize, usize)>,
        at: &AtomicUsize,
        done: &AtomicBool,
    ) -> Result<bool> {
        if cand.is_empty() {
            return Ok(true);
        }
        let want: usize = cand.iter().map(|c| c.1).sum();
        let t_res = Instant::now();
        let reserved = self.st.reserve(want, at, done);
        crate::profile::interval("loader reserve", cand[0].2, t_res);
        if !reserved {
            cand.clear();
            return Ok(false);
        }
        self.claim_load(cand, want, at)?;
        Ok(true)
    }

    /// Claim what is still unclaimed of `cand` (its `want` bytes reserved) and load it; the bytes
    /// of what someone else claimed first are given back.
    fn claim_load(
        &mut self,
        cand: &mut Vec<(Key, usize, usize)>,
        want: usize,
        at: &AtomicUsize,
    ) -> Result<()> {
        let mut claimed = Vec::new();
        {
            let t_claim = Instant::now();
            let mut st = self.st.lock();
            crate::profile::interval("loader claim lock", 0, t_claim);
            let now = at.load(Relaxed);
            for c in cand.drain(..) {
                if c.2 >= now && !st.entries.contains_key(&c.0) {
                    st.entries.insert(c.0.clone(), Entry::Loading);
                    claimed.push(c);
                }
            }
        }
        let total: usize = claimed.iter().map(|c| c.1).sum();
        self.st.unreserve(want - total);
        if claimed.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.load(&claimed, total) {
            // hand the claimed entries back to the runner (it reads them itself and reports)
            let mut st = self.st.lock();
            for (k, _, _) in &claimed {
                st.entries.insert(k.clone(), Entry::Taken);
            }
            st.outstanding = st.outstanding.saturating_sub(total);
            drop(st);
            self.st.cv.notify_all();
            return Err(e);
        }
        Ok(())
    }

    /// While the loader waits for the routing of step `step`: load the next batch of weights of
    /// later ops that do not depend on routing (`ahead` walks the plan past `step`, routed experts
    /// left out), if it fits under the cap with room left for every expert of `step` (so the
    /// experts, once routed, never wait for memory). False when there is nothing (more) to load
    /// now.
    fn look_ahead(
        &mut self,
        plan: &[Vec<StageGroup>],
        step: usize,
        ahead: &mut (usize, usize, usize),
        at: &AtomicUsize,
        done: &AtomicBool,
    ) -> Result<bool> {
        let experts: usize = plan[step]
            .iter()
            .filter(|g| g.expert.is_some())
            .flat_map(|g| g.spans.iter().map(|s| s.2))
            .sum();
        let Some(room) = self.st.cap.checked_sub(experts) else {
            return Ok(false);
        };
        if *ahead < (step + 1, 0, 0) {
            *ahead = (step + 1, 0, 0);
        }
        // the next batch: spans in plan order up to a batch (or one larger tensor alone)
        let mut cand: Vec<(Key, usize, usize)> = Vec::new();
        let mut bytes = 0usize;
        let mut cur = *ahead;
        {
            let st = self.st.lock();
            while cur.0 < plan.len() {
                let Some(g) = plan[cur.0].get(cur.1) else {
                    cur = (cur.0 + 1, 0, 0);
                    continue;
                };
                let Some((path, off, len)) = g.spans.get(cur.2).filter(|_| g.expert.is_none())
                else {
                    cur = (cur.0, cur.1 + 1, 0);
                    continue;
                };
                let key = (path.clone(), *off);
                if st.entries.contains_key(&key) {
                    cur.2 += 1;
                    continue;
                }
                if !cand.is_empty() && bytes + len > self.batch {
                    break;
                }
                cand.push((key, *len, cur.0));
                bytes += len;
                cur.2 += 1;
                if bytes >= self.batch {
                    break;
                }
            }
        }
        if cand.is_empty() {
            *ahead = cur;
            return Ok(false);
        }
        let t_res = Instant::now();
        if self.st.try_reserve(bytes, room, false, at, done) != Some(true) {
            return Ok(false); // not now: the runner frees memory as it goes
        }
        crate::profile::interval("loader look-ahead reserve", step, t_res);
        *ahead = cur;
        self.claim_load(&mut cand, bytes, at)?;
        Ok(true)
    }
}

/// The loader thread's body: stage the weights of `plan` (per op step, in order) ahead of the
/// runner, whose current step is `at`. A routed expert's group waits for `routed[step]`
/// (published after the router's step, or before the run for hash-routed layers); it is skipped
/// when its op has passed. Returns when the plan is done or `done` is set; an error stops the
/// loader (recorded in the stats) and leaves the rest to the runner.
pub fn run_loader(
    st: &Arc<Stager>,
    ckpt: &Checkpoint,
    plan: &[Vec<StageGroup>],
    routed: &Mutex<HashMap<usize, Vec<bool>>>,
    at: &AtomicUsize,
    done: &AtomicBool,
) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        loader_body(st, ckpt, plan, routed, at, done)
    }));
    let err = match r {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("the loader thread panicked".to_string()),
    };
    // whatever is still claimed goes back to the runner, which never waits on a dead loader
    let mut s = st.lock();
    for e in s.entries.values_mut() {
        if matches!(e, Entry::Loading) {
            *e = Entry::Taken;
        }
    }
    if err.is_some() {
        s.stats.error = err;
    }
    drop(s);
    st.cv.notify_all();
}

fn loader_body(
    st: &Arc<Stager>,
    ckpt: &Checkpoint,
    plan: &[Vec<StageGroup>],
    routed: &Mutex<HashMap<usize, Vec<bool>>>,
    at: &AtomicUsize,
    done: &AtomicBool,
) -> Result<()> {
    st.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("context", e))?;
    let copy = st.ctx.new_stream().map_err(|e| cuda_err("stream", e))?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(8);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("stage-read-{i}"))
        .build()
        .map_err(|e| Error::Backend(format!("stage: thread pool: {e}")))?;
    let mut ld = Loader {
        st,
        ckpt,
        copy,
        pinned: st.lent.iter().map(|&(p, _)| (p as *mut u8, None)).collect(),
        own_pinned: false,
        next_pin: 0,
        batch: 0,
        files: HashMap::new(),
        pool,
    };
    // batches (and the pinned buffers of the read path): pinning is slow and holds the driver
    // up, so no larger than the largest stored tensor the plan stages or a batch
    let largest = plan
        .iter()
        .flatten()
        .flat_map(|g| g.spans.iter().map(|s| s.2))
        .filter(|&n| n <= STAGE)
        .max()
        .unwrap_or(0);
    let batch = BATCH.max(largest).next_multiple_of(1 << 20);
    let batch = if plan_bytes(plan) < batch {
        largest.max(1 << 20)
    } else {
        batch
    };
    // lent buffers: batches of their size (they are there already: no pinning cost)
    let batch = match st.lent.iter().map(|l| l.1).min() {
        Some(n) if n >= largest => n,
        _ => {
            ld.pinned.clear();
            batch
        }
    };
    ld.batch = batch;
    let mut cand: Vec<(Key, usize, usize)> = Vec::new();
    let mut cand_bytes = 0usize;
    // where the look-ahead during routing waits has got to: (step, group, span)
    let mut ahead = (0usize, 0usize, 0usize);
    let look_ahead = std::env::var("NVFP4_PROBE_STAGE_LOOKAHEAD").ok().as_deref() != Some("0");
    for (step, groups) in plan.iter().enumerate() {
        for g in groups {
            if done.load(Relaxed) {
                return Ok(());
            }
            if let Some(e) = g.expert {
                let known = |m: &Mutex<HashMap<usize, Vec<bool>>>| {
                    m.lock()
                        .ok()
                        .and_then(|m| m.get(&step).map(|u| u.get(e).copied().unwrap_or(true)))
                };
                let chosen = match known(routed) {
                    Some(c) => c,
                    None => {
                        // what is gathered so far goes now: the wait may be long
                        if !ld.flush(&mut cand, at, done)? {
                            return Ok(());
                        }
                        cand_bytes = 0;
                        let t0 = Instant::now();
                        let c = loop {
                            if done.load(Relaxed) {
                                return Ok(());
                            }
                            if at.load(Relaxed) > step {
                                break false;
                            }
                            if let Some(c) = known(routed) {
                                break c;
                            }
                            // meanwhile, what later ops read whatever the routing
                            if !(look_ahead && ld.look_ahead(plan, step, &mut ahead, at, done)?) {
                                std::thread::sleep(Duration::from_micros(200));
                            }
                        };
                        st.lock().stats.routing_wait_seconds += t0.elapsed().as_secs_f64();
                        crate::profile::interval("routing wait", step, t0);
                        c
                    }
                };
                if !chosen {
                    continue;
                }
            }
            if at.load(Relaxed) > step {
                continue;
            }
            for (path, off, len) in &g.spans {
                if *len > ld.batch {
                    // alone, in pieces (`Loader::load`)
                    if !ld.flush(&mut cand, at, done)? {
                        return Ok(());
                    }
                    cand_bytes = 0;
                    cand.push(((path.clone(), *off), *len, step));
                    if !ld.flush(&mut cand, at, done)? {
                        return Ok(());
                    }
                    continue;
                }
                if cand_bytes + len > ld.batch {
                    if !ld.flush(&mut cand, at, done)? {
                        return Ok(());
                    }
                    cand_bytes = 0;
                }
                cand.push(((path.clone(), *off), *len, step));
                cand_bytes += len;
            }
        }
        // the end of an op: do not hold its weights back for the next op's
        if !ld.flush(&mut cand, at, done)? {
            return Ok(());
        }
        cand_bytes = 0;
    }
    Ok(())
}
