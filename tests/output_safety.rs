//! No command harms the user's files (issue 18, items 1–4): every output flag of every command
//! that has a model, pointed into the model directory (directly, through a symlink, through
//! `x/../M`, through a directory that does not exist yet, at a shard or config.json) or into the
//! real directory of its symlinked shards, is refused with exit 2 naming the path, and the
//! directory's files are byte-identical afterwards; special files are never replaced; a command's
//! outputs are published all or none (a failing later output, a full disk, SIGTERM); `synth`
//! refuses a non-empty `--out` unless `--force`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::output::TMP_PREFIX;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use sha2::{Digest, Sha256};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"))
}

fn run(args: &[OsString]) -> Output {
    bin().args(args).output().expect("spawn nvfp4-probe")
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

/// Every file and link under `root` (recursively) with a sha256 of its bytes (or its target).
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let t = e.file_type().unwrap();
            if t.is_symlink() {
                out.insert(
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                );
            } else if t.is_dir() {
                out.insert(rel.clone(), "dir".into());
                walk(root, &p, out);
            } else {
                let h = Sha256::digest(std::fs::read(&p).unwrap());
                out.insert(rel, h.iter().map(|b| format!("{b:02x}")).collect());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// Paths under `root` whose name starts with the temporary prefix.
fn temporaries(root: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                v.push(e.path());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(e.path());
            }
        }
    }
    v
}

/// A workspace: `M` a 3-shard CT-NVFP4 tiny checkpoint; `N` the same checkpoint whose shards
/// are symlinks into `S`; `L` a symlink to `M`; `x` an empty directory.
struct Ws {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Ws {
    fn new() -> Ws {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let m = root.join("M");
        synth_to_dir(
            &SynthOptions::new(Preset::Tiny, Format::CtNvfp4, Naming::Official, 3),
            &m,
        )
        .unwrap();
        let (n, s) = (root.join("N"), root.join("S"));
        std::fs::create_dir(&n).unwrap();
        std::fs::create_dir(&s).unwrap();
        for e in std::fs::read_dir(&m).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            if name.to_string_lossy().ends_with(".safetensors") {
                std::fs::copy(e.path(), s.join(&name)).unwrap();
                std::os::unix::fs::symlink(Path::new("../S").join(&name), n.join(&name)).unwrap();
            } else {
                std::fs::copy(e.path(), n.join(&name)).unwrap();
            }
        }
        std::os::unix::fs::symlink("M", root.join("L")).unwrap();
        std::fs::create_dir(root.join("x")).unwrap();
        Ws { _dir: dir, root }
    }
    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    File,
    Dir,
    /// `--plot STEM.png`: the refusal names `STEM-amax.png`.
    Plot,
}

/// Every command that has a model, with each of its output flags. `MODEL` stands for the model
/// directory under test, `OTHER` for the other checkpoint (lint's second directory).
fn commands() -> Vec<(Vec<&'static str>, &'static str, Kind)> {
    let run = vec![
        "run",
        "--model",
        "MODEL",
        "--layers",
        "0",
        "--seq-len",
        "8",
        "--backend",
        "cpu",
        "--quiet",
    ];
    let bisect = vec![
        "bisect",
        "--model",
        "MODEL",
        "--layers",
        "0",
        "--seq-len",
        "8",
        "--backend",
        "cpu",
    ];
    let lint = vec!["lint", "--model", "MODEL"];
    let lint_ref = vec!["lint", "--model", "OTHER", "--reference", "MODEL"];
    // `run`/`bisect --reference MODEL`: the original is as protected as the model
    let with_ref = |cmd: &[&'static str]| -> Vec<&'static str> {
        let mut v = cmd.to_vec();
        v[2] = "OTHER";
        v.extend(["--reference", "MODEL"]);
        v
    };
    let (run_ref, bisect_ref) = (with_ref(&run), with_ref(&bisect));
    let inspect = vec!["inspect", "--model", "MODEL"];
    let dequant = vec![
        "inspect",
        "--model",
        "MODEL",
        "--dequant",
        "layers.0.attn.wq_a",
    ];
    let compare = vec!["compare", "--model", "MODEL", "--trace", "TRACE"];
    let selftest = vec!["selftest", "--model", "MODEL"];
    vec![
        (run.clone(), "--json", Kind::File),
        (run.clone(), "--markdown", Kind::File),
        (run.clone(), "--plot", Kind::Plot),
        (run, "--dump", Kind::Dir),
        (bisect.clone(), "--json", Kind::File),
        (bisect, "--markdown", Kind::File),
        (run_ref.clone(), "--json", Kind::File),
        (run_ref, "--dump", Kind::Dir),
        (bisect_ref, "--markdown", Kind::File),
        (lint.clone(), "--json", Kind::File),
        (lint, "--markdown", Kind::File),
        (lint_ref.clone(), "--json", Kind::File),
        (lint_ref, "--markdown", Kind::File),
        (inspect, "--json", Kind::File),
        (dequant, "--out", Kind::File),
        (compare.clone(), "--json", Kind::File),
        (compare, "--markdown", Kind::File),
        (selftest.clone(), "--json", Kind::File),
        (selftest, "--rcp-table", Kind::File),
    ]
}

fn refused(ws: &Ws, cmd: &[&str], model: &str, other: &str, flag: &str, target: &Path, kind: Kind) {
    let mut args: Vec<OsString> = cmd
        .iter()
        .map(|a| match *a {
            "MODEL" => ws.p(model).into_os_string(),
            "OTHER" => ws.p(other).into_os_string(),
            "TRACE" => ws.p("trace.safetensors").into_os_string(),
            a => a.into(),
        })
        .collect();
    args.push(flag.into());
    args.push(target.into());
    let o = run(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    let shown = match kind {
        Kind::Plot => target.with_file_name(format!(
            "{}-amax.png",
            target.file_stem().unwrap().to_string_lossy()
        )),
        _ => target.to_path_buf(),
    };
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains("refusing") && err.contains(&shown.display().to_string()),
        "{args:?}: the message must name {}: {err}",
        shown.display()
    );
}

/// (a) Every output flag of every command with a model, pointed into the model directory by
/// every route, is refused, and nothing in the model directory (or the shards' real directory)
/// changes.
#[test]
fn no_output_lands_in_the_model_directory_or_a_shards_real_directory() {
    let ws = Ws::new();
    let before: Vec<_> = ["M", "N", "S"].iter().map(|d| snapshot(&ws.p(d))).collect();
    let mut tried = 0;
    for (cmd, flag, kind) in commands() {
        let name = match kind {
            Kind::File => "out.json",
            Kind::Dir => "dumps",
            Kind::Plot => "p.png",
        };
        let mut targets = vec![
            ws.p("M").join(name),
            ws.p("L").join(name),
            ws.p("x/../M/sub").join(name),
            ws.p("M/new/deeper").join(name),
        ];
        if kind != Kind::Plot {
            targets.push(ws.p("M/model-00001-of-00003.safetensors"));
            targets.push(ws.p("M/config.json"));
        }
        if kind == Kind::Dir {
            targets.push(ws.p("M"));
        }
        for t in &targets {
            refused(&ws, &cmd, "M", "N", flag, t, kind);
            tried += 1;
        }
        // the checkpoint whose shards are symlinks into S: S is as protected as N
        for t in [ws.p("S").join(name), ws.p("S/new").join(name)] {
            refused(&ws, &cmd, "N", "M", flag, &t, kind);
            tried += 1;
        }
    }
    assert!(tried > 100, "{tried} invocations");
    let after: Vec<_> = ["M", "N", "S"].iter().map(|d| snapshot(&ws.p(d))).collect();
    assert_eq!(before, after, "a model directory changed");
    assert!(temporaries(&ws.root).is_empty());
    assert!(!ws.p("x/../M/sub").exists() && !ws.p("M/new").exists());
}

/// The refusal happens before the work: a run pointed into the model directory reads no weight.
#[test]
fn refusal_comes_before_the_run() {
    let ws = Ws::new();
    let t0 = Instant::now();
    let o = run(&[
        os(&["run", "--model"]),
        vec![ws.p("M").into()],
        os(&["--backend", "cpu", "--json"]),
        vec![ws.p("M/r.json").into()],
    ]
    .concat());
    assert_eq!(o.status.code(), Some(2));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains(" ops, "), "the run ran: {out}");
    assert!(t0.elapsed() < Duration::from_secs(30));
}

/// (b) Special files named as outputs are refused, never renamed over.
#[test]
fn special_files_are_never_replaced() {
    let ws = Ws::new();
    let fifo = ws.p("fifo");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success());
    let cases: Vec<(Vec<OsString>, PathBuf, &str)> = vec![
        (
            os(&[
                "run",
                "--layers",
                "0",
                "--seq-len",
                "8",
                "--backend",
                "cpu",
                "--quiet",
                "--json",
                "/dev/null",
            ]),
            "/dev/null".into(),
            "character device",
        ),
        (
            [
                os(&["lint", "--model"]),
                vec![ws.p("M").into(), "--json".into(), fifo.clone().into()],
            ]
            .concat(),
            fifo.clone(),
            "FIFO",
        ),
        (
            [
                os(&["lint", "--model"]),
                vec![ws.p("M").into(), "--markdown".into(), ws.p("x").into()],
            ]
            .concat(),
            ws.p("x"),
            "directory",
        ),
        (
            [
                os(&["gate", "--baseline"]),
                vec![
                    ws.p("M/config.json").into(),
                    "--current".into(),
                    ws.p("M/config.json").into(),
                    "--summary".into(),
                    "/dev/null".into(),
                ],
            ]
            .concat(),
            "/dev/null".into(),
            "character device",
        ),
    ];
    for (args, path, what) in cases {
        let o = run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(&path.display().to_string()) && err.contains(what),
            "{err}"
        );
    }
    let m = std::fs::metadata("/dev/null").unwrap();
    assert!(m.file_type().is_char_device(), "/dev/null replaced");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(std::fs::read_dir(ws.p("x")).unwrap().next().is_none());
    // --dump naming a regular file
    let f = ws.p("plain");
    std::fs::write(&f, b"keep").unwrap();
    let o = run(&[
        os(&[
            "run",
            "--layers",
            "0",
            "--seq-len",
            "8",
            "--backend",
            "cpu",
            "--quiet",
            "--dump",
        ]),
        vec![f.clone().into()],
    ]
    .concat());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(&f).unwrap(), b"keep");
    assert!(temporaries(&ws.root).is_empty());
}

/// A directory no file can be created in, for this user: a 0555 directory, or (for root, who
/// writes anywhere) a directory of /proc.
fn unwritable_dir(root: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let ro = root.join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), b"x").is_err() {
        ro
    } else {
        let _ = std::fs::remove_file(ro.join("probe"));
        PathBuf::from("/proc/self/fdinfo")
    }
}

/// (c) A later output that cannot be written: exit 2, the earlier outputs of the same command
/// are not published (a pre-existing file keeps its bytes), no temporary remains.
#[test]
fn outputs_are_published_all_or_none() {
    let ws = Ws::new();
    let out = ws.p("out");
    std::fs::create_dir(&out).unwrap();
    let bad = unwritable_dir(&ws.root).join("r.md");
    std::fs::write(out.join("r.json"), b"previous").unwrap();
    let base = os(&[
        "run",
        "--layers",
        "0",
        "--seq-len",
        "8",
        "--backend",
        "cpu",
        "--quiet",
    ]);
    let o = run(&[
        base.clone(),
        vec![
            "--json".into(),
            out.join("r.json").into(),
            "--markdown".into(),
            bad.clone().into(),
        ],
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&bad.display().to_string()), "{err}");
    assert!(!err.contains(TMP_PREFIX), "names a temporary: {err}");
    assert_eq!(std::fs::read(out.join("r.json")).unwrap(), b"previous");
    // every kind of output, the failing one last
    let o = run(&[
        base,
        vec![
            "--json".into(),
            out.join("fresh.json").into(),
            "--plot".into(),
            out.join("p.png").into(),
            "--dump".into(),
            out.join("d").into(),
            "--markdown".into(),
            bad.into(),
        ],
    ]
    .concat());
    assert_eq!(o.status.code(), Some(2));
    let mut names: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["r.json"], "published from a failed command");
    assert!(temporaries(&ws.root).is_empty());
}

/// A child whose files may not grow beyond `bytes` (RLIMIT_FSIZE), writes past it failing with
/// EFBIG instead of SIGXFSZ: a full disk.
fn with_file_limit(args: &[OsString], bytes: u64) -> Output {
    let mut c = bin();
    c.args(args);
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: bytes as libc::rlim_t,
                rlim_max: bytes as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    c.output().expect("spawn")
}

/// (d) Full disk: exit 2 naming the path given, nothing published, no temporary left.
#[test]
fn a_full_disk_leaves_nothing_behind() {
    let ws = Ws::new();
    let d = ws.p("full");
    std::fs::create_dir(&d).unwrap();
    let cases: Vec<(Vec<OsString>, u64)> = vec![
        (
            [
                os(&[
                    "run",
                    "--layers",
                    "0..1",
                    "--seq-len",
                    "8",
                    "--backend",
                    "cpu",
                    "--quiet",
                ]),
                vec![
                    "--json".into(),
                    d.join("r.json").into(),
                    "--markdown".into(),
                    d.join("r.md").into(),
                    "--plot".into(),
                    d.join("p.png").into(),
                    "--dump".into(),
                    d.join("dump").into(),
                ],
            ]
            .concat(),
            16 << 10,
        ),
        (
            [
                os(&["synth", "--preset", "tiny", "--out"]),
                vec![d.join("ck").into()],
            ]
            .concat(),
            1 << 20,
        ),
        (
            [
                os(&["lint", "--model"]),
                vec![ws.p("M").into(), "--json".into(), d.join("l.json").into()],
            ]
            .concat(),
            64,
        ),
        (
            [
                os(&["inspect", "--model"]),
                vec![ws.p("M").into(), "--json".into(), d.join("i.json").into()],
            ]
            .concat(),
            1 << 10,
        ),
    ];
    for (args, limit) in cases {
        let o = with_file_limit(&args, limit);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(&d.display().to_string()), "{args:?}: {err}");
        assert!(!err.contains(TMP_PREFIX), "names a temporary: {err}");
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}

/// (d) A real full file system: each case runs in a private mount namespace with its output
/// directory a tmpfs of `size` bytes (writes fail with ENOSPC, as on a full disk). Needs the
/// right to mount (root, or a user namespace); elsewhere it says so and checks nothing more than
/// [`a_full_disk_leaves_nothing_behind`] does.
#[test]
fn a_full_tmpfs_leaves_nothing_behind() {
    let probe = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("d=$(mktemp -d) && mount -t tmpfs -o size=4k tmpfs \"$d\" && umount \"$d\"; rc=$?; rmdir \"$d\"; exit $rc")
        .output();
    if !matches!(&probe, Ok(o) if o.status.success()) {
        eprintln!("skipped: cannot mount a tmpfs in a private namespace here (not root)");
        return;
    }
    let ws = Ws::new();
    let d = ws.p("tiny-fs");
    std::fs::create_dir(&d).unwrap();
    let m = ws.p("M");
    let ds = d.display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            [
                "run",
                "--layers",
                "0..1",
                "--seq-len",
                "8",
                "--backend",
                "cpu",
                "--quiet",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([
                "--json".into(),
                format!("{ds}/r.json"),
                "--markdown".into(),
                format!("{ds}/r.md"),
                "--plot".into(),
                format!("{ds}/p.png"),
            ])
            .collect(),
            "16k",
        ),
        (
            vec![
                "synth".into(),
                "--preset".into(),
                "tiny".into(),
                "--out".into(),
                format!("{ds}/ck"),
            ],
            "1m",
        ),
        (
            // inspect's JSON of 182 weights is ~80 KB: it cannot fit
            vec![
                "inspect".into(),
                "--model".into(),
                m.display().to_string(),
                "--json".into(),
                format!("{ds}/i.json"),
            ],
            "8k",
        ),
    ];
    let exe = env!("CARGO_BIN_EXE_nvfp4-probe");
    for (args, size) in cases {
        // mount, run, list what is left in the directory, all inside the namespace
        let script = format!(
            "mount -t tmpfs -o size={size} tmpfs \"$1\" || exit 99; shift; \"$@\"; rc=$?; \
             echo LEFT:; ls -A \"$D\"; exit $rc"
        );
        let o = Command::new("unshare")
            .args([
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
                "sh",
                &ds,
                exe,
            ])
            .args(&args)
            .env("D", &ds)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(&ds), "{args:?}: {err}");
        assert!(
            err.contains("No space left on device"),
            "{args:?}: not ENOSPC: {err}"
        );
        assert!(!err.contains(TMP_PREFIX), "names a temporary: {err}");
        let left = out.rsplit("LEFT:").next().unwrap().trim();
        assert!(
            left.is_empty(),
            "{args:?} left {left:?} on the full file system"
        );
    }
}

/// Waits up to `limit` for `f`, polling.
fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// (e) SIGTERM while synth writes its shards: the temporary directory and its partial shards
/// are removed, the target is not created, and the exit code says the signal (128 + 15).
#[test]
fn sigterm_mid_write_leaves_no_temporary() {
    let ws = Ws::new();
    let d = ws.p("sig");
    std::fs::create_dir(&d).unwrap();
    // 40 tiny layers: ~300 MB in 8 MB shards, several seconds of writing
    let child = bin()
        .args(["synth", "--preset", "tiny", "--layers", "40", "--out"])
        .arg(d.join("ck"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let partial = || {
        temporaries(&d).iter().any(|t| {
            std::fs::read_dir(t).is_ok_and(|mut r| {
                r.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".partial")))
            })
        })
    };
    let seen = wait_for(Duration::from_secs(120), partial);
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let o = child.wait_with_output().unwrap();
    assert!(seen, "no partial shard appeared within 120 s");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{err}");
    // it removed the staged directory, and says so
    assert!(err.contains("temporary outputs removed"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left {left:?}");
}

/// (e) SIGTERM at any moment of a run with every output: afterwards either all its outputs
/// exist or none, and never a temporary.
#[test]
fn sigterm_at_any_moment_of_a_run_publishes_all_or_none() {
    let ws = Ws::new();
    let args = |d: &Path| -> Vec<OsString> {
        [
            os(&[
                "run",
                "--layers",
                "0..1",
                "--seq-len",
                "16",
                "--backend",
                "cpu",
                "--quiet",
            ]),
            vec![
                "--json".into(),
                d.join("r.json").into(),
                "--markdown".into(),
                d.join("r.md").into(),
                "--plot".into(),
                d.join("p.png").into(),
                "--dump".into(),
                d.join("dump").into(),
            ],
        ]
        .concat()
    };
    let all = [
        "dump",
        "p-amax.png",
        "p-cos.png",
        "p-heatmap.png",
        "r.json",
        "r.md",
    ];
    // how long a whole run takes here
    let d0 = ws.p("t0");
    std::fs::create_dir(&d0).unwrap();
    let t0 = Instant::now();
    let o = run(&args(&d0));
    let whole = t0.elapsed();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for k in 1..=8u32 {
        let d = ws.p(&format!("t{k}"));
        std::fs::create_dir(&d).unwrap();
        let mut child = bin()
            .args(args(&d))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(whole * k / 8);
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = child.wait().unwrap();
        let mut names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert!(
            names.is_empty() || names == all,
            "SIGTERM at {k}/8 of the run left {names:?}"
        );
        if !names.is_empty() {
            assert_eq!(std::fs::read_dir(d.join("dump")).unwrap().count(), 4);
        }
    }
}

/// (f) synth refuses a non-empty --out without --force and leaves it as it was; with --force
/// the old checkpoint is replaced whole (no stale shard beside the new ones); --force refuses a
/// directory that is not a checkpoint.
#[test]
fn synth_refuses_a_non_empty_out_unless_forced() {
    let ws = Ws::new();
    let m = ws.p("M");
    let before = snapshot(&m);
    let o = run(&[
        os(&["synth", "--preset", "tiny", "--format", "bf16", "--out"]),
        vec![m.clone().into()],
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&m.display().to_string()) && err.contains("--force"),
        "{err}"
    );
    assert_eq!(snapshot(&m), before);
    // --force: bf16 tiny has 5 shards where CT-NVFP4 had 3; then back to 3, none stale
    for (format, shards) in [("bf16", 5), ("ct-nvfp4", 3)] {
        let o = run(&[
            os(&[
                "synth", "--preset", "tiny", "--format", format, "--force", "--out",
            ]),
            vec![m.clone().into()],
        ]
        .concat());
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let stdout = String::from_utf8_lossy(&o.stdout);
        let n = std::fs::read_dir(&m)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".safetensors")
            })
            .count();
        assert_eq!(n, shards, "{format}");
        assert_eq!(
            stdout.lines().filter(|l| l.starts_with("wrote ")).count(),
            shards + 2
        );
        nvfp4_probe::checkpoint::Checkpoint::open(&m).unwrap();
    }
    assert!(temporaries(&ws.root).is_empty());
    // an empty directory is fine without --force
    let e = ws.p("empty");
    std::fs::create_dir(&e).unwrap();
    let o = run(&[
        os(&["synth", "--preset", "tiny", "--out"]),
        vec![e.clone().into()],
    ]
    .concat());
    assert_eq!(o.status.code(), Some(0));
    // not a checkpoint: refused even with --force
    let home = ws.p("home");
    std::fs::create_dir_all(home.join("docs")).unwrap();
    std::fs::write(home.join("notes.txt"), b"mine").unwrap();
    let o = run(&[
        os(&["synth", "--preset", "tiny", "--force", "--out"]),
        vec![home.clone().into()],
    ]
    .concat());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(home.join("notes.txt")).unwrap(), b"mine");
}

/// Every command names each file it wrote.
#[test]
fn every_command_lists_the_files_it_wrote() {
    let ws = Ws::new();
    let o = ws.p("o");
    std::fs::create_dir(&o).unwrap();
    let lines = |args: Vec<OsString>| -> Vec<String> {
        let out = run(&args);
        assert!(
            out.status.code().is_some_and(|c| c < 2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("wrote ").map(str::to_string))
            .collect()
    };
    let s = |p: PathBuf| p.display().to_string();
    let got = lines(
        [
            os(&[
                "run",
                "--layers",
                "0",
                "--seq-len",
                "8",
                "--backend",
                "cpu",
                "--quiet",
            ]),
            vec![
                "--json".into(),
                o.join("r.json").into(),
                "--plot".into(),
                o.join("ct.png").into(),
            ],
        ]
        .concat(),
    );
    assert_eq!(
        got,
        [
            s(o.join("r.json")),
            s(o.join("ct-amax.png")),
            s(o.join("ct-cos.png")),
            s(o.join("ct-heatmap.png"))
        ]
    );
    let got = lines(
        [
            os(&["plot"]),
            vec![
                o.join("r.json").into(),
                "--out".into(),
                o.join("q.svg").into(),
            ],
        ]
        .concat(),
    );
    assert_eq!(
        got,
        [
            s(o.join("q-amax.svg")),
            s(o.join("q-cos.svg")),
            s(o.join("q-heatmap.svg"))
        ]
    );
    let got = lines(
        [
            os(&["lint", "--model"]),
            vec![
                ws.p("M").into(),
                "--json".into(),
                o.join("l.json").into(),
                "--markdown".into(),
                o.join("l.md").into(),
            ],
        ]
        .concat(),
    );
    assert_eq!(got, [s(o.join("l.json")), s(o.join("l.md"))]);
    let got = lines(
        [
            os(&["inspect", "--model"]),
            vec![ws.p("M").into(), "--json".into(), o.join("i.json").into()],
        ]
        .concat(),
    );
    assert_eq!(got, [s(o.join("i.json"))]);
    let got = lines(
        [
            os(&["gate", "--baseline"]),
            vec![
                o.join("r.json").into(),
                "--current".into(),
                o.join("r.json").into(),
                "--summary".into(),
                o.join("g.md").into(),
                "--junit".into(),
                o.join("g.xml").into(),
            ],
        ]
        .concat(),
    );
    assert_eq!(got, [s(o.join("g.md")), s(o.join("g.xml"))]);
    for f in [
        "r.json",
        "ct-amax.png",
        "q-cos.svg",
        "l.md",
        "i.json",
        "g.xml",
    ] {
        assert!(std::fs::metadata(o.join(f)).unwrap().len() > 0, "{f}");
    }
}
