//! `NVFP4_PROBE_PROFILE=1`: timestamps of a command's phases on stderr (seconds since the process
//! started), for benchmarks of where the time outside the runner goes.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("NVFP4_PROBE_PROFILE").is_some())
}

/// Print `profile: +T s label` when profiling; the first call sets the origin. On Linux the
/// line also gives the bytes this process has made the kernel fetch from storage so far
/// (`read_bytes` of /proc/self/io: page faults and readahead included, page-cache hits not), so
/// a cold run shows what it truly read from disk next to what it asked for.
pub fn mark(label: &str) {
    let t0 = *START.get_or_init(Instant::now);
    if enabled() {
        let io = storage_read_bytes()
            .map(|b| format!("  (storage reads {:.1} MB)", b as f64 / 1e6))
            .unwrap_or_default();
        eprintln!("profile: {:8.3} s  {label}{io}", t0.elapsed().as_secs_f64());
    }
}

/// `read_bytes` of /proc/self/io (bytes fetched from storage for this process), where available.
pub fn storage_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Host seconds and counts of named spans (`span`), summed over the process when profiling.
static SPANS: std::sync::Mutex<Vec<(&'static str, u64, f64)>> = std::sync::Mutex::new(Vec::new());

/// Times the enclosing scope under `name` when profiling (`NVFP4_PROBE_PROFILE=1`); `spans`
/// reports the sums. A no-op otherwise.
pub struct Span(Option<(&'static str, Instant)>);

pub fn span(name: &'static str) -> Span {
    Span(enabled().then(|| (name, Instant::now())))
}

/// The runner's op step, for the spans the timeline records ([`set_step`]).
static STEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The runner entered op `step`: spans recorded on the timeline and device time measured by the
/// kernel timer from now on carry it.
pub fn set_step(step: usize) {
    STEP.store(step, std::sync::atomic::Ordering::Relaxed);
}

/// The op step the runner is in ([`set_step`]).
pub fn step() -> usize {
    STEP.load(std::sync::atomic::Ordering::Relaxed)
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((name, t0)) = self.0 {
            let s = t0.elapsed().as_secs_f64();
            // on the timeline too (spans of 0.1 ms or more: the file stays small)
            if s >= 1e-4 {
                interval(name, step(), t0);
            }
            if let Ok(mut v) = SPANS.lock() {
                match v.iter_mut().find(|e| e.0 == name) {
                    Some(e) => {
                        e.1 += 1;
                        e.2 += s;
                    }
                    None => v.push((name, 1, s)),
                }
            }
        }
    }
}

/// The spans so far as `name s (count)`, longest first.
pub fn spans() -> String {
    let mut v = SPANS.lock().map(|v| v.clone()).unwrap_or_default();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v.iter()
        .map(|(n, c, s)| format!("{n} {s:.3} ({c})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `NVFP4_PROBE_TIMELINE=FILE`: intervals (what, a number such as the op step, start, end; in
/// seconds since the process started) of the runner's ops and the loader's batches, written as
/// JSON lines by [`write_timeline`], for seeing which of them waits on which.
static TIMELINE: std::sync::Mutex<Vec<(&'static str, usize, f64, f64)>> =
    std::sync::Mutex::new(Vec::new());

pub fn timeline_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("NVFP4_PROBE_TIMELINE").is_some())
}

/// Record the interval `[t0, now)` as `what` (with `n`) when the timeline is on.
pub fn interval(what: &'static str, n: usize, t0: Instant) {
    if !timeline_on() {
        return;
    }
    let origin = *START.get_or_init(Instant::now);
    let s = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
    if let Ok(mut v) = TIMELINE.lock() {
        v.push((what, n, s(t0), s(Instant::now())));
    }
}

/// Record a value that is not an interval of this process's clock (such as device seconds of an
/// op, as `[0, secs)`) when the timeline is on.
pub fn record(what: &'static str, n: usize, t0: f64, t1: f64) {
    if !timeline_on() {
        return;
    }
    if let Ok(mut v) = TIMELINE.lock() {
        v.push((what, n, t0, t1));
    }
}

/// Write the recorded intervals to `NVFP4_PROBE_TIMELINE`'s file (when set), one JSON object a line.
pub fn write_timeline() {
    let Some(path) = std::env::var_os("NVFP4_PROBE_TIMELINE") else {
        return;
    };
    let v = TIMELINE.lock().map(|v| v.clone()).unwrap_or_default();
    let text: String = v
        .iter()
        .map(|(w, n, a, b)| format!("{{\"what\":\"{w}\",\"n\":{n},\"t0\":{a:.6},\"t1\":{b:.6}}}\n"))
        .collect();
    if let Err(e) = crate::output::write_one(std::path::Path::new(&path), text.as_bytes()) {
        eprintln!("timeline: cannot write: {e}");
    }
}
