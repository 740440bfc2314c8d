//! Weights read ahead of the runner on the CUDA backend.
//!
//! A loader thread walks the run's ops in order and, for each weight an op will upload, reads its
//! stored bytes from the checkpoint files into the loader's own pinned buffers (positioned reads
//! in parallel) and copies them to the device on the loader's own stream. The runner's thread
//! then finds them ready ([`Stager::take`]): its compute stream waits on the copy's event instead
//! of the host reading, so the host's reads and the DMA overlap the device's kernels.
//!
//! What is read: the weights of the ops to come, and of a routed-experts op only the experts a
//! path routed to, once known (the router's step publishes them; hash-routed layers know them
//! from the token ids before the run starts). No byte of an unrouted expert is read.
//!
//! Device memory: what the loader has allocated and not yet seen released stays under a cap
//! (`NVFP4_PROBE_STAGE_GIB`, default [`DEFAULT_CAP`]); when full, the loader waits for the
//! runner to finish ops. A staged allocation is freed only after the compute stream has passed
//! the point where its last user let go (an event recorded then), so the two streams never race
//! on memory.
//!
//! The runner never waits for the loader to start something: an entry the loader has not claimed
//! is claimed by the runner's own read (`Taken`), and the loader claims a batch only once the
//! memory for it is reserved, so a claimed (`Loading`) batch always completes.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};

use crate::{Error, Result};

mod loader;
pub use loader::run_loader;

/// A stored tensor's place: (shard file, byte offset).
pub type Key = (PathBuf, u64);

/// Default cap on the device memory the loader holds (allocated and not yet released).
pub const DEFAULT_CAP: usize = 8 << 30;

/// Bytes of the loader's batches (one allocation, one DMA each), unless a tensor is larger.
const BATCH: usize = 64 << 20;
/// The loader's pinned buffers: the read into one overlaps the DMA out of the others.
const PINNED: usize = 3;

fn plan_bytes(plan: &[Vec<StageGroup>]) -> usize {
    plan.iter()
        .flatten()
        .flat_map(|g| g.spans.iter().map(|s| s.2))
        .sum()
}

/// The stored tensors of one op to read ahead: one group per routed expert (`expert` set), one
/// for everything else. Spans are (file, offset, length).
#[derive(Clone, Debug)]
pub struct StageGroup {
    pub expert: Option<usize>,
    pub spans: Vec<(PathBuf, u64, usize)>,
}

enum Entry {
    /// In a batch being read and copied: ready soon.
    Loading,
    /// On the device once `ready` has fired on the loader's stream.
    Ready {
        buf: Buf,
        ready: Arc<CudaEvent>,
        step: usize,
    },
    /// The runner took it or reads it itself: the loader leaves it alone.
    Taken,
}

/// What the loader did (printed with the profile).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StageStats {
    /// Bytes read and copied by the loader, and in how many batches.
    pub bytes: u64,
    pub batches: u64,
    /// Of those, bytes the runner took; bytes dropped unused (the op had passed).
    pub taken_bytes: u64,
    pub dropped_bytes: u64,
    /// (op step, bytes) of what was dropped, by step.
    pub dropped_at: Vec<(usize, u64)>,
    /// Host seconds of the loader's reads into pinned memory (and issuing their DMA).
    pub host_seconds: f64,
    /// Seconds the loader waited for device memory (the cap), and for routing.
    pub memory_wait_seconds: f64,
    pub routing_wait_seconds: f64,
    /// Seconds the runner waited for a batch in flight.
    pub runner_wait_seconds: f64,
    /// The loader's error, if it stopped on one (the runner then reads by itself).
    pub error: Option<String>,
}

#[derive(Default)]
struct State {
    entries: HashMap<Key, Entry>,
    /// Released allocations: freed once their event (on the compute stream) has fired.
    graveyard: VecDeque<(CudaSlice<u8>, Option<CudaEvent>, usize)>,
    /// Bytes allocated by the loader and not yet freed.
    outstanding: usize,
    stopped: bool,
    stats: StageStats,
}

/// The shared state between the loader thread and the runner's device state (`Gpu::stager`).
pub struct Stager {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    /// Pinned buffers lent by the device state for the loader's reads (pointer, bytes).
    lent: Vec<(usize, usize)>,
    state: Mutex<State>,
    cv: Condvar,
    cap: usize,
}

/// A staged allocation: on drop it is handed back to the loader, freed once the compute stream
/// has passed this point.
pub struct Lease {
    slice: Option<CudaSlice<u8>>,
    bytes: usize,
    st: Arc<Stager>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.st.release(s, self.bytes);
        }
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        // nothing on the compute stream may still read what is freed here
        let _ = self.compute.synchronize();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        st.entries.clear();
        st.graveyard.clear();
    }
}

impl Stager {
    /// The loader's shared state for a device context and its compute stream; the cap from
    /// `NVFP4_PROBE_STAGE_GIB` (GiB) or [`DEFAULT_CAP`].
    pub fn new(
        ctx: Arc<CudaContext>,
        compute: Arc<CudaStream>,
        lent: Vec<(usize, usize)>,
    ) -> Arc<Stager> {
        let cap = std::env::var("NVFP4_PROBE_STAGE_GIB")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|g| *g > 0.0)
            .map(|g| (g * (1u64 << 30) as f64) as usize)
            .unwrap_or(DEFAULT_CAP);
        Arc::new(Stager {
            ctx,
            compute,
            lent,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            cap,
        })
    }

    /// Whether the loader is switched on (`NVFP4_PROBE_STAGE=0` switches it off).
    pub fn enabled() -> bool {
        std::env::var("NVFP4_PROBE_STAGE")
            .ok()
            .as_deref()
            .map(str::trim)
            != Some("0")
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> StageStats {
        self.lock().stats.clone()
    }

    fn release(&self, slice: CudaSlice<u8>, bytes: usize) {
        let ev = self
            .ctx
            .new_event(None)
            .ok()
            .filter(|e| e.record(&self.compute).is_ok());
        if ev.is_none() {
            // no event: wait here instead, so freeing it later is safe
            let _ = self.compute.synchronize();
        }
        let mut st = self.lock();
        st.graveyard.push_back((slice, ev, bytes));
        drop(st);
        self.cv.notify_all();
    }

    /// The runner's side: the staged device copy of `key`, with the compute stream made to wait
    /// for its DMA; `None` when the loader does not have it (the runner reads it itself, and the
    /// loader will not). Waits while its batch is in flight.
    pub fn take(&self, key: &Key) -> Result<Option<Buf>> {
        let mut st = self.lock();
        let mut waited: Option<Instant> = None;
        let out = loop {
            match st.entries.get(key) {
                Some(Entry::Loading) => {
                    waited.get_or_insert_with(Instant::now);
                    let _s = crate::profile::span("host: wait for staged weights");
                    st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                Some(Entry::Ready { .. }) => {
                    let Some(Entry::Ready { buf, ready, .. }) =
                        st.entries.insert(key.clone(), Entry::Taken)
                    else {
                        unreachable!("matched Ready above")
                    };
                    st.stats.taken_bytes += buf.bytes as u64;
                    break Some((buf, ready));
                }
                Some(Entry::Taken) => break None,
                None => {
                    st.entries.insert(key.clone(), Entry::Taken);
                    break None;
                }
            }
        };
        if let Some(t) = waited {
            st.stats.runner_wait_seconds += t.elapsed().as_secs_f64();
            crate::profile::interval("staged wait", 0, t);
        }
        drop(st);
        match out {
            Some((buf, ready)) => {
                self.compute
                    .wait(&ready)
                    .map_err(|e| Error::Backend(format!("cuda: wait for staged copy: {e:?}")))?;
                Ok(Some(buf))
            }
            None => Ok(None),
        }
    }

    /// End of the run: no more loading; staged copies nobody took are dropped.
    pub fn shutdown(&self) {
        let mut st = self.lock();
        st.stopped = true;
        let left: Vec<Entry> = st.entries.drain().map(|(_, e)| e).collect();
        drop(st);
        self.cv.notify_all();
        drop(left); // outside the lock: dropping a Buf may release its allocation
    }

    /// Free the released allocations the compute stream is done with; drop ready entries of ops
    /// the runner has passed (`before`). Returns the slices to drop outside the lock.
    fn reap(st: &mut State, before: usize) -> (Vec<CudaSlice<u8>>, Vec<Entry>) {
        let mut freed = Vec::new();
        let mut i = 0;
        while i < st.graveyard.len() {
            if st.graveyard[i].1.as_ref().is_none_or(|e| e.is_complete()) {
                let (s, _, n) = st.graveyard.remove(i).expect("index checked");
                st.outstanding = st.outstanding.saturating_sub(n);
                freed.push(s);
            } else {
                i += 1;
            }
        }
        let stale: Vec<Key> = st
            .entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Ready { step, .. } if *step < before))
            .map(|(k, _)| k.clone())
            .collect();
        let mut dropped = Vec::new();
        for k in stale {
            if let Some(e) = st.entries.remove(&k) {
                if let Entry::Ready { buf, step, .. } = &e {
                    st.stats.dropped_bytes += buf.bytes as u64;
                    match st.stats.dropped_at.iter_mut().find(|d| d.0 == *step) {
                        Some(d) => d.1 += buf.bytes as u64,
                        None => st.stats.dropped_at.push((*step, buf.bytes as u64)),
                    }
                }
                dropped.push(e);
            }
        }
        (freed, dropped)
    }

    /// Reserve `bytes` of device memory under the cap, waiting for the runner to release some.
    /// False when the run is over.
    fn reserve(&self, bytes: usize, at: &AtomicUsize, done: &AtomicBool) -> bool {
        let t0 = Instant::now();
        // alone, a tensor larger than the cap still goes
        let r = loop {
            if let Some(r) = self.try_reserve(bytes, self.cap, true, at, done) {
                break r;
            }
            // sleep until a release, or briefly: events fire without a notify
            let g = self.lock();
            drop(self.cv.wait_timeout(g, Duration::from_micros(500)));
        };
        self.lock().stats.memory_wait_seconds += t0.elapsed().as_secs_f64();
        r
    }

    /// One attempt to reserve `bytes` under `limit` (or over it, `alone` and nothing else
    /// reserved), after freeing what the compute stream is done with: `Some(true)` reserved,
    /// `Some(false)` the run is over, `None` it does not fit now.
    fn try_reserve(
        &self,
        bytes: usize,
        limit: usize,
        alone: bool,
        at: &AtomicUsize,
        done: &AtomicBool,
    ) -> Option<bool> {
        let mut st = self.lock();
        let (freed, dropped) = Self::reap(&mut st, at.load(Relaxed));
        let stop = st.stopped || done.load(Relaxed);
        let fits = st.outstanding + bytes <= limit || (alone && st.outstanding == 0);
        if fits && !stop {
            st.outstanding += bytes;
        }
        drop(st);
        let (t_free, n) = (Instant::now(), freed.len());
        drop(freed);
        drop(dropped); // outside the lock: may release allocations
        if n > 0 {
            crate::profile::interval("loader free", n, t_free);
        }
        (stop || fits).then_some(!stop)
    }

    fn unreserve(&self, bytes: usize) {
        let mut st = self.lock();
        st.outstanding = st.outstanding.saturating_sub(bytes);
    }
}

/// The size of each large pinned staging buffer (two per device state, lent to the loader).
pub(crate) const STAGE: usize = 256 << 20;

/// Device memory: allocated on the compute stream (freed in its order), or staged by the loader
/// thread (handed back to it, freed once the compute stream is past its last use).
pub enum Mem {
    Own(cudarc::driver::CudaSlice<u8>),
    Staged(Lease),
}

/// A device allocation with its raw address (event tracking is off: one stream orders everything,
/// and the loader's copies are ordered by events, `stage`).
pub struct Buf {
    /// The allocation; shared by the pieces of one arena (`Gpu::preload`, the loader's batches),
    /// freed with the last.
    pub(crate) _s: std::sync::Arc<Mem>,
    pub ptr: u64,
    pub bytes: usize,
}

impl Buf {
    /// A piece `[ptr, ptr + bytes)` of a shared allocation.
    pub(crate) fn shared(m: &std::sync::Arc<Mem>, ptr: u64, bytes: usize) -> Buf {
        Buf {
            _s: m.clone(),
            ptr,
            bytes,
        }
    }
}
