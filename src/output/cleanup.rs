//! Temporaries that must not outlive the process: a registry of live temporary paths, removed
//! by their owner (drop) on success or error, and by a signal thread on SIGINT/SIGTERM/SIGHUP,
//! which then exits with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).
//!
//! The handler runs on an ordinary thread (signal-hook's iterator), so it may lock and touch the
//! file system. Registration and creation of a temporary happen under the same lock, and the
//! handler holds the lock until the process exits: a temporary is either registered (and then
//! removed) or never created. SIGKILL cannot be caught; what it leaves is named
//! `.nvfp4-probe-tmp-*` (see [`super::TMP_PREFIX`]).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once};

static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
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

fn install() {
    INSTALL.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        // Without the handler a signal kills the process and leaves the temporaries; nothing
        // better can be done if it cannot be installed, so that is not an error.
        if let Ok(mut sigs) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            std::thread::spawn(move || {
                if let Some(sig) = sigs.forever().next() {
                    let mut l = live();
                    for p in l.drain(..) {
                        remove(&p);
                    }
                    eprintln!("interrupted (signal {sig}): temporary outputs removed");
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
        l.push(path.to_path_buf());
    }
    r
}

/// The registry held: while it lives a signal waits, so a group of renames (publishing a
/// command's outputs) is done whole or, on a signal before it starts, not at all.
pub struct Held(MutexGuard<'static, Vec<PathBuf>>);

/// Hold the registry (see [`Held`]).
pub fn hold() -> Held {
    Held(live())
}

impl Held {
    /// Forget `path` (it has been renamed into place).
    pub fn forget(&mut self, path: &Path) {
        self.0.retain(|p| p != path);
    }
    /// Register a path created while held (a backup of a replaced output).
    pub fn add(&mut self, path: &Path) {
        install();
        self.0.push(path.to_path_buf());
    }
}

/// Remove `path` (file or tree) and forget it.
pub fn discard(path: &Path) {
    let mut l = live();
    remove(path);
    l.retain(|p| p != path);
}

/// Whether `path` is registered (tests).
pub fn is_live(path: &Path) -> bool {
    live().iter().any(|p| p == path)
}
