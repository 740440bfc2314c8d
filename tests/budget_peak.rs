//! The up-front memory estimate (`probe::budget`) is an upper bound of what a run really
//! allocates: a counting global allocator measures the heap peak of real runs of the built-in
//! model, which must stay under the estimate (and not absurdly far under it, or the estimate
//! would refuse runs that fit). One test in this binary: the counters are process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use nvfp4_probe::probe::budget::{estimate, gib, Plan};
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn runs_allocate_no_more_than_their_estimate() {
    let ck = nvfp4_probe::synth::builtin(0).unwrap();
    let cfg = ck.model_config().unwrap().clone();
    // (layers, tokens, keep outputs, --dump-rows: that many rows kept)
    let mut whole_peak_1024 = 0.0;
    for (layers, t, keep, rows, chunk) in [
        ((0, 4), 256, false, None, None),
        ((0, 4), 96, true, None, None),
        ((2, 3), 384, false, None, None),
        ((0, 4), 384, true, Some(8usize), None),
        // the same prompt whole and in token chunks: the chunks hold less
        ((0, 4), 1024, false, None, None),
        ((0, 4), 1024, false, None, Some(128usize)),
    ] {
        let tokens = synthetic_tokens(t, cfg.vocab_size, 1);
        let with_head = layers.1 + 1 == cfg.num_hidden_layers;
        let plan = Plan {
            layers,
            tokens: t as u64,
            keep_outputs: keep,
            kept_rows: rows.map(|r| r as u64),
            with_head,
            layer_states: false,
            device: false,
            chunk: chunk.map(|c| c as u64),
        };
        let est = estimate(&cfg, &plan);
        let opts = RunOptions {
            keep_outputs: keep,
            keep_rows: rows.map(|r| (0..r).map(|i| i * (t / r)).collect()),
            chunk,
            ..RunOptions::new(layers, tokens)
        };
        let base = CURRENT.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let res = run(&ck, &opts).unwrap();
        let peak = (PEAK.load(Ordering::Relaxed) - base) as f64;
        drop(res);
        eprintln!(
            "layers {layers:?}, {t} tokens, keep {keep} rows {rows:?}, chunk {chunk:?}: heap peak {} vs estimate {} ({est:?})",
            gib(peak),
            gib(est.host())
        );
        assert!(
            peak <= est.host(),
            "{layers:?} × {t}: the run's heap peak {} exceeds its estimate {}",
            gib(peak),
            gib(est.host())
        );
        if t == 1024 {
            match chunk {
                None => whole_peak_1024 = peak,
                Some(_) => assert!(
                    peak < 0.5 * whole_peak_1024,
                    "1024 tokens in chunks of 128: heap peak {} is not well under the whole prompt's {}",
                    gib(peak),
                    gib(whole_peak_1024)
                ),
            }
        }
        assert!(
            est.host() <= 8.0 * peak,
            "{layers:?} × {t}: the estimate {} is more than 8× the heap peak {}",
            gib(est.host()),
            gib(peak)
        );
    }
}
