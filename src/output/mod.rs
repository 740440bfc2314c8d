//! Every file a command writes goes through here, so that no command can harm the user's files:
//!
//! - **Where**: an output's real path (symlinks, `..` and parents that do not exist yet resolved
//!   by [`resolve::real_path`]) must not lie inside a protected tree: the model directory, the
//!   real directory of any of its shards (shards may be symlinks to elsewhere), or an input of
//!   the command ([`Guard`]).
//! - **What**: only a regular file (or nothing) is replaced; a device node, FIFO, socket or
//!   directory named as an output is refused, never renamed over.
//! - **When**: a command's outputs are staged as temporaries beside their targets
//!   ([`Outputs`]) and published together by renames only when every one of them is complete;
//!   a failing publish puts back what it replaced. Temporaries are removed on error (drop) and
//!   on SIGINT/SIGTERM/SIGHUP ([`cleanup`]); a write past the file-size limit fails (EFBIG, not
//!   SIGXFSZ) and a checkpoint truncated under its mapping (SIGBUS) ends in exit 2 with the
//!   temporaries removed ([`fatal`]).
//!
//! Errors name the path the user gave (and its real path when it differs), never a temporary.
//! Every refusal is an [`Error::Usage`] or [`Error::Io`]: exit 2.

pub mod cleanup;
pub mod fatal;
pub mod resolve;
pub mod term;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Error, Result};

pub use resolve::real_path;

/// Names of temporaries start with this (SIGKILL can leave them; `synth` removes stale ones).
pub const TMP_PREFIX: &str = ".nvfp4-probe-tmp-";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The environment variable of [`test_hold`].
pub const TEST_HOLD_ENV: &str = "NVFP4_PROBE_TEST_HOLD";

/// A test's hold on the process at a named point: with `NVFP4_PROBE_TEST_HOLD=POINT:FILE` set
/// and `point` equal to POINT, the first time the process gets there it creates FILE and waits
/// (up to 120 s) until FILE is removed, so an integration test can act at that exact moment
/// through the real paths (truncate a mapped shard: a real SIGBUS; send SIGTERM right after the
/// outputs are published). Points: `mapped` (a checkpoint's shards mapped and their headers
/// read, `Checkpoint::open`), `published` (a command's outputs renamed into place). Without the
/// variable it costs one environment lookup.
pub fn test_hold(point: &str) {
    static DONE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let Some(v) = std::env::var_os(TEST_HOLD_ENV) else {
        return;
    };
    let v = v.to_string_lossy();
    let Some((p, file)) = v.split_once(':') else {
        return;
    };
    if p != point {
        return;
    }
    {
        let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
        if done.iter().any(|d| d == point) {
            return;
        }
        done.push(point.to_string());
    }
    let file = Path::new(file);
    if std::fs::write(file, point).is_err() {
        return;
    }
    let t0 = std::time::Instant::now();
    while file.exists() && t0.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A fresh temporary name for `name`: `.nvfp4-probe-tmp-<pid>-<n>-<name>` (the name last, so a
/// writer that picks its format by extension, like the PNG encoder, sees the right one).
fn tmp_name(name: &std::ffi::OsStr) -> std::ffi::OsString {
    let mut s = std::ffi::OsString::from(format!(
        "{TMP_PREFIX}{}-{}-",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    s.push(name);
    s
}

/// What a node on disk is, for refusals.
fn kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// `user` with its real path when that says something the given one does not.
fn shown(user: &Path, real: &Path) -> String {
    if std::path::absolute(user).ok().as_deref() == Some(real) {
        user.display().to_string()
    } else {
        format!("{} (resolves to {})", user.display(), real.display())
    }
}

/// One protected path: a tree (directory) or a single file.
#[derive(Clone, Debug)]
struct Protected {
    real: PathBuf,
    what: String,
}

/// The paths no output of a command may land in.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    protected: Vec<Protected>,
}

impl Guard {
    pub fn new() -> Guard {
        Guard::default()
    }

    /// Protect `real` (a real path), described as `what` in refusals.
    pub fn add(&mut self, real: PathBuf, what: String) {
        if !self.protected.iter().any(|p| p.real == real) {
            self.protected.push(Protected { real, what });
        }
    }

    /// An input of the command (a file, or a directory as a whole tree): never replaced.
    pub fn input(mut self, p: &Path, what: &str) -> Guard {
        if let Ok(real) = real_path(p) {
            self.add(real, format!("{what} {}", p.display()));
        }
        self
    }

    /// Refuse `real` (the real path of `user`) when it lies in a protected path.
    fn check(&self, user: &Path, real: &Path) -> Result<()> {
        for p in &self.protected {
            if real.starts_with(&p.real) {
                return Err(Error::usage(format!(
                    "refusing to write {}: inside {}; nvfp4-probe never writes there",
                    shown(user, real),
                    p.what
                )));
            }
        }
        Ok(())
    }
}

/// The real path of output `user`, checked against `guard` and against replacing anything but
/// a regular file. Call it for every output before the work starts; staging calls it again.
pub fn check(guard: &Guard, user: &Path) -> Result<PathBuf> {
    let real = real_path(user).map_err(|e| Error::io(user, e))?;
    guard.check(user, &real)?;
    match std::fs::metadata(&real) {
        Ok(m) if m.is_file() => Ok(real),
        Ok(m) => Err(Error::usage(format!(
            "refusing to replace {}: it is {}, not a regular file",
            shown(user, &real),
            kind(&m)
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(real),
        Err(e) => Err(Error::io(user, e)),
    }
}

/// An output directory (`--dump DIR`): its real path, checked against `guard`; it may exist as
/// a directory (files are written into it) or not at all.
pub fn check_dir(guard: &Guard, user: &Path) -> Result<PathBuf> {
    let real = real_path(user).map_err(|e| Error::io(user, e))?;
    guard.check(user, &real)?;
    match std::fs::metadata(&real) {
        Ok(m) if m.is_dir() => Ok(real),
        Ok(m) => Err(Error::usage(format!(
            "refusing to write into {}: it is {}, not a directory",
            shown(user, &real),
            kind(&m)
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(real),
        Err(e) => Err(Error::io(user, e)),
    }
}

/// A staged output: a complete temporary waiting to be renamed onto its target.
#[derive(Debug)]
struct Staged {
    user: PathBuf,
    real: PathBuf,
    tmp: PathBuf,
    /// A directory (synth's checkpoint); `replace` lets it replace an existing one.
    dir: bool,
    replace: bool,
}

/// What one publish step did, to undo it if it or a later step fails.
struct Done {
    real: PathBuf,
    /// Where the replaced target was kept, and whether it was moved there (a directory, or a
    /// file that could not be hard-linked) or linked (the target still in place).
    backup: Option<(PathBuf, bool)>,
    /// Whether the new output was renamed onto the target.
    placed: bool,
    /// Parent directories created for it, outermost first.
    created: Vec<PathBuf>,
}

/// The outputs of one command, staged as temporaries and published together (module doc).
/// Dropped unpublished (an error anywhere), it removes its temporaries.
#[derive(Debug)]
pub struct Outputs {
    guard: Guard,
    staged: Vec<Staged>,
}

/// Errors from a writer given a temporary path, renamed to the path the user gave.
fn rename_err(e: Error, tmp: &Path, user: &Path) -> Error {
    match e {
        Error::Io { path, source } if path == tmp => Error::io(user, source),
        Error::BadInput { file, tensor, msg } if file == tmp => Error::BadInput {
            file: user.to_path_buf(),
            tensor,
            msg,
        },
        Error::Usage(m) => {
            Error::Usage(m.replace(&tmp.display().to_string(), &user.display().to_string()))
        }
        e => e,
    }
}

impl Outputs {
    pub fn new(guard: Guard) -> Outputs {
        Outputs {
            guard,
            staged: Vec::new(),
        }
    }

    /// See [`check`].
    pub fn check(&self, user: &Path) -> Result<PathBuf> {
        check(&self.guard, user)
    }

    /// See [`check_dir`].
    pub fn check_dir(&self, user: &Path) -> Result<PathBuf> {
        check_dir(&self.guard, user)
    }

    fn claim(&self, user: &Path, real: &Path) -> Result<()> {
        if let Some(s) = self.staged.iter().find(|s| s.real == real) {
            return Err(Error::usage(format!(
                "{} and {} name the same output file",
                s.user.display(),
                user.display()
            )));
        }
        Ok(())
    }

    /// Stage `bytes` for `user`.
    pub fn file(&mut self, user: &Path, bytes: &[u8]) -> Result<()> {
        self.file_with(user, |tmp| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(tmp)
                .map_err(|e| Error::io(tmp, e))?;
            f.write_all(bytes).map_err(|e| Error::io(tmp, e))?;
            f.flush().map_err(|e| Error::io(tmp, e))?;
            f.sync_data().map_err(|e| Error::io(tmp, e))
        })
    }

    /// Stage the file `write` writes at the temporary path it is given (an empty file, created;
    /// its name ends in the target's name, extension included).
    pub fn file_with(
        &mut self,
        user: &Path,
        write: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<()> {
        let real = self.check(user)?;
        self.claim(user, &real)?;
        let name = real
            .file_name()
            .ok_or_else(|| Error::usage(format!("{}: not a file name", user.display())))?;
        let dir = resolve::existing_ancestor(real.parent().unwrap_or(Path::new("/")));
        let tmp = dir.join(tmp_name(name));
        cleanup::create(&tmp, |p| {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o644);
            o.open(p)
        })
        .map_err(|e| Error::io(user, e))?;
        self.staged.push(Staged {
            user: user.to_path_buf(),
            real,
            tmp: tmp.clone(),
            dir: false,
            replace: true,
        });
        write(&tmp).map_err(|e| rename_err(e, &tmp, user))
    }

    /// Stage a directory for `user` and return the temporary directory to fill. Without
    /// `replace` an existing non-empty directory is refused; with it, the old directory is
    /// replaced only at publish, after the new one is complete.
    pub fn dir(&mut self, user: &Path, replace: bool) -> Result<PathBuf> {
        let real = real_path(user).map_err(|e| Error::io(user, e))?;
        self.guard.check(user, &real)?;
        self.claim(user, &real)?;
        match std::fs::metadata(&real) {
            Ok(m) if !m.is_dir() => {
                return Err(Error::usage(format!(
                    "refusing to replace {}: it is {}, not a directory",
                    shown(user, &real),
                    if m.is_file() { "a file" } else { kind(&m) }
                )))
            }
            Ok(_) => {
                let n = std::fs::read_dir(&real)
                    .map_err(|e| Error::io(user, e))?
                    .count();
                if n > 0 && !replace {
                    return Err(Error::usage(format!(
                        "refusing to write into {}: the directory is not empty (--force replaces it once the new checkpoint is complete)",
                        shown(user, &real)
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(user, e)),
        }
        let name = real
            .file_name()
            .ok_or_else(|| Error::usage(format!("{}: not a directory name", user.display())))?;
        let parent = resolve::existing_ancestor(real.parent().unwrap_or(Path::new("/")));
        remove_stale(&parent, name);
        let tmp = parent.join(tmp_name(name));
        cleanup::create(&tmp, |p| std::fs::create_dir(p)).map_err(|e| Error::io(user, e))?;
        self.staged.push(Staged {
            user: user.to_path_buf(),
            real,
            tmp: tmp.clone(),
            dir: true,
            replace,
        });
        Ok(tmp)
    }

    /// Whether nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.staged.is_empty()
    }

    /// Rename every staged temporary onto its target, in staging order. If one rename fails,
    /// the ones before it are undone (the replaced files put back) and the error names the
    /// path the user gave. Returns the paths as given.
    pub fn publish(mut self) -> Result<Vec<PathBuf>> {
        let staged = std::mem::take(&mut self.staged);
        let mut held = cleanup::hold();
        let mut done: Vec<Done> = Vec::new();
        let mut failed = None;
        for s in &staged {
            match publish_one(s, &mut held) {
                Ok(d) => done.push(d),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            for d in done.into_iter().rev() {
                undo(d);
            }
            for s in &staged {
                remove_any(&s.tmp);
                held.forget(&s.tmp);
            }
            return Err(e);
        }
        let backups: Vec<PathBuf> = done
            .iter()
            .filter_map(|d| d.backup.as_ref().map(|b| b.0.clone()))
            .collect();
        for b in &backups {
            held.add(b);
        }
        drop(held);
        for b in &backups {
            cleanup::discard(b);
        }
        test_hold("published");
        Ok(staged.into_iter().map(|s| s.user).collect())
    }

    /// [`Outputs::publish`], then one line `wrote PATH` per file on stdout.
    pub fn publish_and_report(self) -> Result<Vec<PathBuf>> {
        let written = self.publish()?;
        for p in &written {
            println!("wrote {}", p.display());
        }
        Ok(written)
    }
}

impl Drop for Outputs {
    fn drop(&mut self) {
        for s in self.staged.drain(..) {
            cleanup::discard(&s.tmp);
        }
    }
}

fn remove_any(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// Put back what one publish step replaced, remove what it created.
fn undo(d: Done) {
    match (&d.backup, d.placed) {
        (Some((b, true)), placed) => {
            if placed {
                remove_any(&d.real);
            }
            let _ = std::fs::rename(b, &d.real);
        }
        // the link replaces the new file in one rename
        (Some((b, false)), true) => {
            let _ = std::fs::rename(b, &d.real);
        }
        (Some((b, false)), false) => {
            let _ = std::fs::remove_file(b);
        }
        (None, true) => remove_any(&d.real),
        (None, false) => {}
    }
    for c in d.created.iter().rev() {
        let _ = std::fs::remove_dir(c);
    }
}

fn publish_one(s: &Staged, held: &mut cleanup::Held) -> Result<Done> {
    let io = |e| Error::io(&s.user, e);
    let mut done = Done {
        real: s.real.clone(),
        backup: None,
        placed: false,
        created: Vec::new(),
    };
    let fail = |done: Done, e: Error| {
        undo(done);
        Err(e)
    };
    // parents that do not exist yet (`--dump new/dir`)
    if let Some(parent) = s.real.parent() {
        let mut missing = Vec::new();
        let mut p = parent.to_path_buf();
        while std::fs::symlink_metadata(&p).is_err() {
            missing.push(p.clone());
            if !p.pop() {
                break;
            }
        }
        for m in missing.into_iter().rev() {
            if let Err(e) = std::fs::create_dir(&m) {
                return fail(done, io(e));
            }
            done.created.push(m);
        }
    }
    match std::fs::symlink_metadata(&s.real) {
        Ok(m) if s.dir && m.is_dir() => {
            // an empty directory or, with --force, the old checkpoint: kept aside until the
            // whole publish succeeded
            if !s.replace && std::fs::read_dir(&s.real).map_or(true, |mut d| d.next().is_some()) {
                let e = Error::usage(format!(
                    "refusing to write into {}: the directory is not empty",
                    shown(&s.user, &s.real)
                ));
                return fail(done, e);
            }
            let name = s.real.file_name().unwrap_or_default();
            let b = s.real.with_file_name(tmp_name(name));
            if let Err(e) = std::fs::rename(&s.real, &b) {
                return fail(done, io(e));
            }
            done.backup = Some((b, true));
        }
        Ok(m) if !s.dir && m.is_file() => {
            let name = s.real.file_name().unwrap_or_default();
            let b = s.real.with_file_name(tmp_name(name));
            // a hard link keeps the old file without a moment where the target is missing
            if std::fs::hard_link(&s.real, &b).is_ok() {
                done.backup = Some((b, false));
            } else {
                if let Err(e) = std::fs::rename(&s.real, &b) {
                    return fail(done, io(e));
                }
                done.backup = Some((b, true));
            }
        }
        Ok(m) => {
            let e = Error::usage(format!(
                "refusing to replace {}: it is {}",
                shown(&s.user, &s.real),
                kind(&m)
            ));
            return fail(done, e);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return fail(done, io(e)),
    }
    if let Err(e) = std::fs::rename(&s.tmp, &s.real) {
        return fail(done, io(e));
    }
    done.placed = true;
    held.forget(&s.tmp);
    Ok(done)
}

/// Remove temporaries for `name` in `dir` that a killed (SIGKILL) earlier process left: those
/// whose process no longer runs (Linux: no `/proc/PID`; elsewhere nothing is removed).
fn remove_stale(dir: &Path, name: &std::ffi::OsStr) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let name = name.to_string_lossy();
    for e in rd.flatten() {
        let f = e.file_name();
        let f = f.to_string_lossy();
        let Some(rest) = f.strip_prefix(TMP_PREFIX) else {
            continue;
        };
        let mut it = rest.splitn(3, '-');
        let (Some(pid), Some(_), Some(n)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if n != name || pid.parse::<u32>().is_err() {
            continue;
        }
        if !Path::new("/proc").join(pid).exists() {
            remove_any(&e.path());
        }
    }
}

/// Write one file through the whole machinery (no guard but the regular-file check, no
/// report line): for writers outside the commands (trace files of tests and scripts).
pub fn write_one(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut o = Outputs::new(Guard::new());
    o.file(path, bytes)?;
    o.publish().map(|_| ())
}

/// Create `path` (which must not exist) and write `bytes` to it, readable by others: the shard
/// writer's primitive, inside a directory staged by [`Outputs::dir`].
pub fn write_new_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o644);
    let mut f = o.open(path).map_err(|e| Error::io(path, e))?;
    let r = f.write_all(bytes).and_then(|_| f.flush());
    if let Err(e) = r {
        // a truncated file (full disk) is not left for anyone to read as a shard
        drop(f);
        let _ = std::fs::remove_file(path);
        return Err(Error::io(path, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn publishes_all_together_and_creates_missing_parents() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a.json"), d.path().join("new/sub/b.md"));
        std::fs::write(&a, b"old").unwrap();
        let mut o = Outputs::new(Guard::new());
        o.file(&a, b"A").unwrap();
        o.file(&b, b"B").unwrap();
        // staged: nothing published yet, the old file untouched
        assert_eq!(std::fs::read(&a).unwrap(), b"old");
        assert!(!d.path().join("new").exists());
        let w = o.publish().unwrap();
        assert_eq!(w, vec![a.clone(), b.clone()]);
        assert_eq!(std::fs::read(&a).unwrap(), b"A");
        assert_eq!(std::fs::read(&b).unwrap(), b"B");
        assert_eq!(listing(d.path()), ["a.json", "new"]);
    }

    #[test]
    fn a_failing_publish_puts_back_what_it_replaced() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a.json"), d.path().join("b.md"));
        std::fs::write(&a, b"old").unwrap();
        let mut o = Outputs::new(Guard::new());
        o.file(&a, b"A").unwrap();
        o.file(&b, b"B").unwrap();
        // b becomes a directory between staging and publishing: its rename must fail
        std::fs::create_dir(&b).unwrap();
        let e = o.publish().unwrap_err().to_string();
        assert!(e.contains("b.md") && e.contains("directory"), "{e}");
        assert_eq!(std::fs::read(&a).unwrap(), b"old");
        assert_eq!(listing(d.path()), ["a.json", "b.md"]);
        assert!(std::fs::read_dir(&b).unwrap().next().is_none());
    }

    #[test]
    fn dropped_unpublished_leaves_nothing_and_errors_name_the_given_path() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a.png");
        let mut o = Outputs::new(Guard::new());
        let e = o
            .file_with(&a, |tmp| {
                let n = tmp.file_name().unwrap().to_string_lossy();
                assert!(n.starts_with(TMP_PREFIX) && n.ends_with("-a.png"), "{n}");
                assert!(cleanup::is_live(tmp));
                std::fs::write(tmp, b"partial").unwrap();
                Err(Error::io(tmp, std::io::Error::other("disk full")))
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&a.display().to_string()) && e.contains("disk full"),
            "{e}"
        );
        drop(o);
        assert!(listing(d.path()).is_empty());
    }

    #[test]
    fn a_directory_is_refused_when_not_empty_and_replaced_with_replace() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ck");
        std::fs::create_dir(&t).unwrap();
        std::fs::write(t.join("old.safetensors"), b"old").unwrap();
        let mut o = Outputs::new(Guard::new());
        assert!(o
            .dir(&t, false)
            .unwrap_err()
            .to_string()
            .contains("not empty"));
        let tmp = o.dir(&t, true).unwrap();
        std::fs::write(tmp.join("new.safetensors"), b"new").unwrap();
        // the old checkpoint stays until the publish
        assert_eq!(listing(&t), ["old.safetensors"]);
        o.publish().unwrap();
        assert_eq!(listing(&t), ["new.safetensors"]);
        assert_eq!(listing(d.path()), ["ck"]);
    }

    /// What a SIGKILLed synth left (its process gone) is removed by the next synth to the same
    /// target; a live process's temporary is not touched.
    #[test]
    fn stale_temporaries_of_dead_processes_are_removed() {
        let d = tempfile::tempdir().unwrap();
        // above any pid_max: no such process
        let dead = d.path().join(format!("{TMP_PREFIX}999999999-0-ck"));
        let live = d
            .path()
            .join(format!("{TMP_PREFIX}{}-99-ck", std::process::id()));
        let other = d.path().join(format!("{TMP_PREFIX}999999999-0-other"));
        for p in [&dead, &live, &other] {
            std::fs::create_dir(p).unwrap();
            std::fs::write(p.join(".shard-00001.safetensors.partial"), b"x").unwrap();
        }
        let mut o = Outputs::new(Guard::new());
        o.dir(&d.path().join("ck"), false).unwrap();
        assert!(!dead.exists());
        assert!(live.exists() && other.exists());
        drop(o);
        let n = listing(d.path());
        assert_eq!(n.len(), 2, "{n:?}");
    }
}
