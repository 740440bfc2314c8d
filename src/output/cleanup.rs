//! Temporaries that must not outlive the process: a registry of live temporary paths, removed
//! by their owner (drop) on success or error, and by a signal thread on SIGINT/SIGTERM/SIGHUP,
//! which then exits with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).
//!
//! The handler runs on an ordinary thread (signal-hook's iterator), so it may lock and touch the
//! file system. Registration and creation of a temporary happen under the same lock, and the
//! handler holds the lock until the process exits: a temporary is either registered (and then
//! removed) or never created. SIGKILL cannot be caught; what it leaves is named
//! `.nvfp4-probe-tmp-*` (see [`super::TMP_PREFIX`]).
//!
//! The handler says "temporary outputs removed" only when it removed a staged output: a signal
//! after a command's outputs were published (renamed into place, so no longer registered) leaves
//! them as they are and says nothing of a removal.
//!
//! Every registered path is mirrored, as a NUL-terminated byte string, in a fixed table of atomic
//! pointers ([`remove_all_raw`]) that a synchronous fault's handler (SIGBUS: `super::fatal`) can
//! read and remove with system calls alone, without the lock the faulting thread may hold.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

/// A registered temporary: a staged output, or the backup of a file an output replaces.
struct Entry {
    path: PathBuf,
    output: bool,
    /// Its slot in the raw mirror (None when the mirror is full or the path holds a NUL).
    slot: Option<usize>,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

/// Slots of the raw mirror: more temporaries than this at once go unmirrored (a command
/// stages a handful).
const SLOTS: usize = 256;
static RAW: [AtomicPtr<libc::c_char>; SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];

fn live() -> MutexGuard<'static, Vec<Entry>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Mirror `p` in a free slot. The string is leaked on purpose: a fault handler may be reading
/// it while it is unregistered, so it is never freed (a few bytes per temporary).
fn mirror_add(p: &Path) -> Option<usize> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let ptr = c.into_raw();
    for (i, s) in RAW.iter().enumerate() {
        if s.compare_exchange(
            std::ptr::null_mut(),
            ptr,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
        .is_ok()
        {
            return Some(i);
        }
    }
    // SAFETY: not published anywhere; taken back from `into_raw` above
    drop(unsafe { std::ffi::CString::from_raw(ptr) });
    None
}

fn mirror_remove(slot: Option<usize>) {
    if let Some(i) = slot {
        RAW[i].store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

fn entry(path: &Path, output: bool) -> Entry {
    Entry {
        path: path.to_path_buf(),
        output,
        slot: mirror_add(path),
    }
}

/// Remove a file or a whole directory tree; a tree is retried because a writer thread may
/// still be creating files in it.
fn remove(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            for _ in 0..10 {
                if std::fs::remove_dir_all(p).is_ok() || !p.exists() {
                    return;
                }
            }
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// What the signal thread says after removing `outputs` staged outputs.
fn interrupted(sig: i32, outputs: usize) -> String {
    if outputs > 0 {
        format!("interrupted (signal {sig}): temporary outputs removed")
    } else {
        format!("interrupted (signal {sig})")
    }
}

fn install() {
    INSTALL.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        // Without the handler a signal kills the process and leaves the temporaries; nothing
        // better can be done if it cannot be installed, so that is not an error.
        if let Ok(mut sigs) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            std::thread::spawn(move || {
                if let Some(sig) = sigs.forever().next() {
                    let mut l = live();
                    let mut outputs = 0;
                    for e in l.drain(..) {
                        mirror_remove(e.slot);
                        remove(&e.path);
                        outputs += usize::from(e.output);
                    }
                    eprintln!("{}", interrupted(sig, outputs));
                    std::process::exit(128 + sig);
                }
            });
        }
    });
}

/// Register `path` and create it with `create` under the registry lock (see the module doc).
/// On failure nothing stays registered (`create` must not leave anything behind when it fails,
/// as `OpenOptions::create_new` and `create_dir` do not).
pub fn create<T>(
    path: &Path,
    create: impl FnOnce(&Path) -> std::io::Result<T>,
) -> std::io::Result<T> {
    install();
    let mut l = live();
    let r = create(path);
    if r.is_ok() {
        l.push(entry(path, true));
    }
    r
}

/// The registry held: while it lives a signal waits, so a group of renames (publishing a
/// command's outputs) is done whole or, on a signal before it starts, not at all.
pub struct Held(MutexGuard<'static, Vec<Entry>>);

/// Hold the registry (see [`Held`]).
pub fn hold() -> Held {
    Held(live())
}

/// Forget every entry of `path` in `l`.
fn forget_in(l: &mut Vec<Entry>, path: &Path) {
    l.retain(|e| {
        let keep = e.path != path;
        if !keep {
            mirror_remove(e.slot);
        }
        keep
    });
}

impl Held {
    /// Forget `path` (it has been renamed into place).
    pub fn forget(&mut self, path: &Path) {
        forget_in(&mut self.0, path);
    }
    /// Register a path created while held (a backup of a replaced output).
    pub fn add(&mut self, path: &Path) {
        install();
        self.0.push(entry(path, false));
    }
}

/// Remove `path` (file or tree) and forget it.
pub fn discard(path: &Path) {
    let mut l = live();
    remove(path);
    forget_in(&mut l, path);
}

/// Whether `path` is registered (tests).
pub fn is_live(path: &Path) -> bool {
    live().iter().any(|e| e.path == path)
}

/// Remove every registered temporary with system calls alone (async-signal-safe: no lock, no
/// allocation), for a handler of a synchronous fault that must `_exit` (`super::fatal`).
/// Returns how many were removed.
///
/// # Safety
/// Meant for a signal handler; callable anywhere, but it removes the temporaries under the
/// feet of their owners.
pub unsafe fn remove_all_raw() -> usize {
    let mut n = 0;
    for s in &RAW {
        let p = s.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: a NUL-terminated string leaked by `mirror_add`, never freed
            unsafe { raw::remove_path(p) };
            n += 1;
        }
    }
    n
}

/// Removal with system calls only (open, getdents64, unlinkat, close).
mod raw {
    use libc::{c_char, c_int};

    fn errno() -> c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// Remove the file or tree `p` (NUL-terminated).
    pub(super) unsafe fn remove_path(p: *const c_char) {
        unsafe {
            if libc::unlink(p) == 0 {
                return;
            }
            let e = errno();
            if e != libc::EISDIR && e != libc::EPERM {
                return;
            }
            let fd = libc::open(
                p,
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            );
            if fd >= 0 {
                empty_dir(fd, 0);
                libc::close(fd);
            }
            libc::rmdir(p);
        }
    }

    /// Elsewhere than Linux (no getdents64) a tree's files stay; its directory is removed
    /// when empty.
    #[cfg(not(target_os = "linux"))]
    unsafe fn empty_dir(_fd: c_int, _depth: u32) {}

    /// Remove everything in the directory open as `fd`, at most 8 levels deep.
    #[cfg(target_os = "linux")]
    unsafe fn empty_dir(fd: c_int, depth: u32) {
        // entries removed while the directory is read may be skipped: read it again until a
        // pass removes nothing
        for _ in 0..16 {
            let mut removed = 0;
            unsafe {
                libc::lseek(fd, 0, libc::SEEK_SET);
            }
            let mut buf = [0u8; 2048];
            loop {
                // SAFETY: buf is writable for its length
                let n =
                    unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) };
                if n <= 0 {
                    break;
                }
                let mut off = 0usize;
                while off + 19 < n as usize {
                    // struct linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8,
                    // d_name (NUL-terminated)
                    let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
                    if reclen == 0 {
                        break;
                    }
                    let name = buf[off + 19..].as_ptr() as *const c_char;
                    let dot = buf[off + 19] == b'.'
                        && (buf[off + 20] == 0 || (buf[off + 20] == b'.' && buf[off + 21] == 0));
                    if !dot {
                        unsafe {
                            if libc::unlinkat(fd, name, 0) == 0 {
                                removed += 1;
                            } else if errno() == libc::EISDIR && depth < 8 {
                                let sub = libc::openat(
                                    fd,
                                    name,
                                    libc::O_RDONLY
                                        | libc::O_DIRECTORY
                                        | libc::O_NOFOLLOW
                                        | libc::O_CLOEXEC,
                                );
                                if sub >= 0 {
                                    empty_dir(sub, depth + 1);
                                    libc::close(sub);
                                }
                                if libc::unlinkat(fd, name, libc::AT_REMOVEDIR) == 0 {
                                    removed += 1;
                                }
                            }
                        }
                    }
                    off += reclen;
                }
            }
            if removed == 0 {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signal_message_claims_a_removal_only_when_outputs_were_removed() {
        assert_eq!(
            interrupted(15, 2),
            "interrupted (signal 15): temporary outputs removed"
        );
        assert_eq!(interrupted(15, 0), "interrupted (signal 15)");
    }

    /// The raw remover takes a file and a tree (nested directories included) away with
    /// system calls only; a registered temporary is mirrored for it until it is forgotten.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_raw_remover_removes_files_and_trees_and_the_mirror_holds_live_temporaries() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f.tmp");
        let t = d.path().join("tree.tmp");
        create(&f, |p| std::fs::write(p, b"x")).unwrap();
        create(&t, |p| std::fs::create_dir(p)).unwrap();
        let mirrored = |p: &Path| {
            RAW.iter().any(|s| {
                let q = s.load(Ordering::SeqCst);
                // SAFETY: mirror strings are leaked, never freed
                !q.is_null()
                    && unsafe { std::ffi::CStr::from_ptr(q) }.to_bytes() == p.as_os_str().as_bytes()
            })
        };
        assert!(mirrored(&f) && mirrored(&t));
        // enough entries to need several getdents64 reads of a 2 KiB buffer
        for i in 0..200 {
            std::fs::write(t.join(format!("shard-{i:05}.safetensors.partial")), b"y").unwrap();
        }
        std::fs::create_dir_all(t.join("a/b/c")).unwrap();
        std::fs::write(t.join("a/b/c/deep"), b"z").unwrap();
        let kept = d.path().join("kept");
        std::fs::write(&kept, b"k").unwrap();
        for p in [&f, &t] {
            let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
            unsafe { raw::remove_path(c.as_ptr()) };
        }
        assert!(!f.exists() && !t.exists());
        assert!(kept.exists(), "a file beside them was removed");
        discard(&f);
        discard(&t);
        assert!(!is_live(&f) && !is_live(&t));
        assert!(!mirrored(&f) && !mirrored(&t), "forgotten, still mirrored");
    }
}
