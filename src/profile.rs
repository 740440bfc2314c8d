//! `NVFP4_PROBE_PROFILE=1`: timestamps of a command's phases on stderr (seconds since the process
//! started), for benchmarks of where the time outside the runner goes.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("NVFP4_PROBE_PROFILE").is_some())
}

/// Print `profile: +T s label` when profiling; the first call sets the origin.
pub fn mark(label: &str) {
    let t0 = *START.get_or_init(Instant::now);
    if enabled() {
        eprintln!("profile: {:8.3} s  {label}", t0.elapsed().as_secs_f64());
    }
}
