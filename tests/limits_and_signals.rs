//! Issue 44 (edges, round 3): memory limits and signals. Each test runs the real binary under
//! the limit or the signal a tester used on main:
//!
//! 1. `--max-mem` above the address-space limit (RLIMIT_AS) is bounded by it: exit 2 with the
//!    estimate, not an allocator abort (SIGABRT).
//! 2. `synth` of the large presets is refused up front under a low limit (exit 2 naming the
//!    estimate and the limit), leaving no temporary directory.
//! 3. Under a file-size limit (RLIMIT_FSIZE, without ignoring SIGXFSZ in the child) every output
//!    write fails with exit 2 naming the output and leaves no `.nvfp4-probe-tmp-*`.
//! 4. A shard truncated while it is mapped: exit 2 naming the shard (the SIGBUS handler), not a
//!    silent death by SIGBUS. The test holds the process right after the shards are mapped
//!    (`NVFP4_PROBE_TEST_HOLD=mapped:FILE`, see `output::test_hold`), truncates every shard and
//!    lets it go on: the read that follows faults for real.
//! 5. SIGTERM right after the outputs are published does not claim to remove them.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nvfp4_probe::output::fatal::SIGBUS_MESSAGE;
use nvfp4_probe::output::{TEST_HOLD_ENV, TMP_PREFIX};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"));
    c.env_remove("NVFP4_PROBE_PROFILE")
        .env_remove(TEST_HOLD_ENV);
    c
}

/// `cmd` with the soft and hard limit `res` set to `value` in the child before exec.
fn limited(mut cmd: Command, res: libc::c_int, value: u64) -> Command {
    // the room RLIMIT_AS leaves counts 64 MiB of allocator arenas per worker thread
    // (`probe::budget`): a fixed thread count keeps it the same on any machine
    cmd.env("RAYON_NUM_THREADS", "4");
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec. The
    // child keeps the default disposition of SIGXFSZ (terminate), as a shell's `ulimit` does.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: value as libc::rlim_t,
                rlim_max: value as libc::rlim_t,
            };
            if libc::setrlimit(res as _, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Address-space cap: the tiny model runs in well under it, nothing of a large preset fits.
const CAP: u64 = 2 << 30;

fn output(mut c: Command) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nvfp4-probe");
    // drain the pipes on threads so a chatty child cannot block
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let to = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut v).ok();
        v
    });
    let te = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut v).ok();
        v
    });
    let status = wait_or_kill(&mut child, Duration::from_secs(120));
    Output {
        status,
        stdout: to.join().unwrap(),
        stderr: te.join().unwrap(),
    }
}

fn wait_or_kill(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("nvfp4-probe ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Exit 2 (not a signal), no panic, every needle in stderr.
#[track_caller]
fn refused(o: &Output, needles: &[&str]) -> String {
    use std::os::unix::process::ExitStatusExt;
    let err = text(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(2),
        "expected exit 2, got {:?} (signal {:?}): {err}",
        o.status.code(),
        o.status.signal()
    );
    assert!(!err.contains("panic"), "panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` missing: {err}");
    }
    err
}

/// Every entry of `d`, recursively, as paths.
fn entries(d: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(rd) = std::fs::read_dir(d) {
        for e in rd.flatten() {
            v.push(e.path());
            if e.path().is_dir() {
                v.extend(entries(&e.path()));
            }
        }
    }
    v
}

fn temporaries(d: &Path) -> Vec<PathBuf> {
    entries(d)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(TMP_PREFIX))
        })
        .collect()
}

fn synth_tiny(dir: &Path, format: &str) {
    let o = output({
        let mut c = bin();
        c.args(["synth", "--preset", "tiny", "--format", format, "--out"])
            .arg(dir);
        c
    });
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
}

/// Item 1: A budget above RLIMIT_AS is bounded by it: the run that fits `--max-mem 1000` but not
/// the address space is refused with the estimate (on main: it ran and aborted in the
/// allocator); a small run under the same budget still runs.
#[test]
fn max_mem_above_the_address_space_limit_is_refused_like_the_estimate() {
    let run = |extra: &[&str]| {
        let mut c = bin();
        c.args(["run", "--backend", "cpu", "--layers", "0..4", "--quiet"])
            .args(extra);
        output(limited(c, libc::RLIMIT_AS as libc::c_int, CAP))
    };
    let o = run(&[
        "--seq-len",
        "100000",
        "--chunk",
        "100000",
        "--max-mem",
        "1000",
    ]);
    let err = refused(
        &o,
        &["--seq-len 100000", "estimated", "below --max-mem 1000"],
    );
    assert!(!err.contains("memory allocation"), "{err}");
    // without --max-mem: the same refusal, by the same limit
    let o = run(&["--seq-len", "100000", "--chunk", "100000"]);
    refused(&o, &["--seq-len 100000", "estimated"]);
    // a budget above the limit does not refuse what fits the limit
    let o = run(&["--seq-len", "16", "--max-mem", "1000"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
}

/// Item 2: The large presets are refused before anything is allocated or created; tiny still fits.
#[test]
fn synth_of_a_large_preset_is_refused_up_front_under_a_low_limit() {
    let d = tempfile::tempdir().unwrap();
    let cases: [&[&str]; 3] = [
        &["--preset", "flash-layer"],
        &["--preset", "flash-layer", "--format", "ct-nvfp4"],
        &["--family", "deepseek-v3", "--preset", "release"],
    ];
    for args in cases {
        let out = d.path().join("big");
        let mut c = bin();
        c.arg("synth").args(args).arg("--out").arg(&out);
        let o = output(limited(c, libc::RLIMIT_AS as libc::c_int, CAP));
        refused(&o, &["estimated", "GiB", "limit", "synth --preset"]);
        let left = entries(d.path());
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
    let mut c = bin();
    c.args(["synth", "--preset", "tiny", "--out"])
        .arg(d.path().join("tiny"));
    let o = output(limited(c, libc::RLIMIT_AS as libc::c_int, CAP));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
}

/// The estimate is an upper bound of what synth of the tiny preset really holds: its peak
/// resident memory (VmHWM of the child, read before it exits via the `published` hold) stays
/// within the estimate.
#[test]
fn the_synth_estimate_bounds_the_tiny_preset_s_peak() {
    use nvfp4_probe::checkpoint::Naming;
    use nvfp4_probe::synth::{memory_estimate, Format, Preset, SynthOptions};
    let d = tempfile::tempdir().unwrap();
    let est = memory_estimate(&SynthOptions::new(
        Preset::Tiny,
        Format::Bf16,
        Naming::Official,
        0,
    ))
    .unwrap();
    let hold = d.path().join("hold");
    let mut c = bin();
    c.args(["synth", "--preset", "tiny", "--format", "bf16", "--out"])
        .arg(d.path().join("t"))
        .env(TEST_HOLD_ENV, format!("published:{}", hold.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    assert!(wait_for(|| hold.exists()), "the hold was not reached");
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    std::fs::remove_file(&hold).unwrap();
    assert_eq!(
        wait_or_kill(&mut child, Duration::from_secs(60)).code(),
        Some(0)
    );
    let hwm: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .expect("VmHWM")
        * 1024.0;
    assert!(
        hwm <= est.total(),
        "peak {hwm} bytes above the estimate {est:?}"
    );
    // and the estimate is not absurdly loose for the tiny preset
    assert!(est.total() < 16.0 * hwm.max(64e6), "{est:?} vs peak {hwm}");
}

fn wait_for(mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Item 3: RLIMIT_FSIZE with the default SIGXFSZ disposition (a shell's `ulimit -f`): every
/// command's output write fails with exit 2 naming the output; no temporary, no output.
#[test]
fn a_file_size_limit_fails_every_output_write_with_exit_2() {
    let ws = tempfile::tempdir().unwrap();
    let m = ws.path().join("M");
    synth_tiny(&m, "ct-nvfp4");
    let run_json = ws.path().join("r.json");
    let o = output({
        let mut c = bin();
        c.args([
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "8",
        ])
        .args(["--quiet", "--model"])
        .arg(&m)
        .arg("--json")
        .arg(&run_json);
        c
    });
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-tiny");
    let full = ws.path().join("full");
    std::fs::create_dir(&full).unwrap();
    let f = |n: &str| OsString::from(full.join(n));
    let s = |v: &str| OsString::from(v);
    let p = |v: &Path| OsString::from(v);
    let run = [
        "run",
        "--backend",
        "cpu",
        "--layers",
        "0..1",
        "--seq-len",
        "8",
        "--quiet",
        "--model",
    ]
    .map(s)
    .to_vec();
    let cases: Vec<(Vec<OsString>, PathBuf)> = vec![
        (
            [run.clone(), vec![p(&m), s("--json"), f("r.json")]].concat(),
            full.join("r.json"),
        ),
        (
            [run, vec![p(&m), s("--dump"), f("dump")]].concat(),
            full.join("dump"),
        ),
        (
            vec![s("synth"), s("--preset"), s("tiny"), s("--out"), f("ck")],
            full.join("ck"),
        ),
        (
            vec![
                s("compare"),
                s("--model"),
                p(&hf),
                s("--trace"),
                p(&hf.join("trace-77-bf16.safetensors")),
                s("--names"),
                s("hf"),
                s("--json"),
                f("c.json"),
            ],
            full.join("c.json"),
        ),
        (
            vec![s("plot"), p(&run_json), s("--out"), f("p.png")],
            full.join("p-amax.png"),
        ),
        (
            vec![
                s("inspect"),
                s("--model"),
                p(&m),
                s("--dequant"),
                s("layers.0.attn.wq_a"),
                s("--out"),
                f("w.safetensors"),
            ],
            full.join("w.safetensors"),
        ),
    ];
    for (args, named) in cases {
        let mut c = bin();
        c.args(&args);
        let o = output(limited(c, libc::RLIMIT_FSIZE as libc::c_int, 64));
        let err = refused(&o, &[&named.display().to_string()]);
        assert!(!err.contains(TMP_PREFIX), "names a temporary: {err}");
        let left = entries(&full);
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}

/// Item 4: Every shard truncated after it was mapped, before the run reads its weights: the read
/// faults (SIGBUS) and the handler says which file and exits 2; no output, no temporary.
#[test]
fn a_shard_truncated_while_mapped_is_reported_and_exits_2() {
    let ws = tempfile::tempdir().unwrap();
    let m = ws.path().join("M");
    synth_tiny(&m, "ct-nvfp4");
    let out = ws.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let hold = ws.path().join("hold");
    let mut c = bin();
    c.args([
        "run",
        "--backend",
        "cpu",
        "--layers",
        "0..1",
        "--seq-len",
        "8",
    ])
    .args(["--quiet", "--model"])
    .arg(&m)
    .arg("--json")
    .arg(out.join("r.json"))
    .arg("--dump")
    .arg(out.join("dump"))
    .env(TEST_HOLD_ENV, format!("mapped:{}", hold.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let reached = wait_for(|| hold.exists());
    let mut shards = Vec::new();
    for e in std::fs::read_dir(&m).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".safetensors") {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(e.path())
                .unwrap();
            f.set_len(4096).unwrap();
            shards.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    let _ = std::fs::remove_file(&hold);
    let o = child.wait_with_output().unwrap();
    assert!(reached, "the hold after mapping was not reached");
    assert_eq!(shards.len(), 3);
    let err = refused(&o, &[SIGBUS_MESSAGE]);
    assert!(
        shards
            .iter()
            .any(|s| err.contains(&m.join(s).display().to_string())),
        "no shard named: {err}"
    );
    let left = entries(&out);
    assert!(left.is_empty(), "left {left:?}");
    assert!(temporaries(ws.path()).is_empty());
}

/// Item 5: SIGTERM right after the outputs are published (held there): the outputs stay and the
/// message claims no removal (on main: "temporary outputs removed").
#[test]
fn sigterm_right_after_publishing_claims_no_removal() {
    let ws = tempfile::tempdir().unwrap();
    let m = ws.path().join("M");
    synth_tiny(&m, "bf16");
    let hold = ws.path().join("hold");
    let j = ws.path().join("l.json");
    let mut c = bin();
    c.args(["lint", "--model"])
        .arg(&m)
        .arg("--json")
        .arg(&j)
        .env(TEST_HOLD_ENV, format!("published:{}", hold.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let reached = wait_for(|| hold.exists());
    // SAFETY: kill(2) of our own child
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let o = child.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&hold);
    assert!(reached, "the hold after publishing was not reached");
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(err.contains("interrupted (signal 15)"), "{err}");
    assert!(!err.contains("removed"), "claims a removal: {err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    assert!(v.is_object());
    assert!(temporaries(ws.path()).is_empty());
}
