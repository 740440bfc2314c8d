//! Signals that would kill the process without a word and leave temporaries behind:
//!
//! - **SIGXFSZ** (a write past the file-size limit, `ulimit -f`): ignored from the start
//!   ([`install`]), so the write fails with EFBIG instead and the output's ordinary error path
//!   names the path and removes the temporaries (exit 2).
//! - **SIGBUS** (a memory-mapped checkpoint file truncated or changed by another process while
//!   it is read): a handler says which file (every mapping is registered with [`watch`]) and
//!   that it changed while being read, removes the temporaries ([`super::cleanup`]'s raw
//!   mirror) and exits 2. It runs on the faulting thread inside the fault, so it uses system
//!   calls alone (`write`, `unlink`, `_exit`): no lock, no allocation.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

/// Slots for mapped files; files mapped beyond this many at once are not named by the handler.
const SLOTS: usize = 4096;

struct Slot {
    /// Start address; 0: free (or being filled).
    start: AtomicUsize,
    len: AtomicUsize,
    /// The file's path, NUL-terminated, leaked (the handler may read it at any moment).
    path: AtomicPtr<libc::c_char>,
    /// Claimed by a mapping.
    used: AtomicBool,
}

static MAPS: [Slot; SLOTS] = [const {
    Slot {
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        path: AtomicPtr::new(std::ptr::null_mut()),
        used: AtomicBool::new(false),
    }
}; SLOTS];

/// A mapping registered for the SIGBUS handler; dropping it unregisters it.
#[derive(Debug)]
pub struct Watched(usize);

impl Drop for Watched {
    fn drop(&mut self) {
        let s = &MAPS[self.0];
        s.start.store(0, Ordering::SeqCst);
        s.len.store(0, Ordering::SeqCst);
        s.path.store(std::ptr::null_mut(), Ordering::SeqCst);
        s.used.store(false, Ordering::SeqCst);
    }
}

/// Register the mapping `start..start + len` of the file `path`, so a SIGBUS inside it names
/// the file. None when every slot is taken (the handler then names no file).
pub fn watch(start: *const u8, len: usize, path: &Path) -> Option<Watched> {
    use std::os::unix::ffi::OsStrExt;
    let i = MAPS.iter().position(|s| {
        s.used
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })?;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .unwrap_or_else(|_| c"(a path with a NUL byte)".to_owned());
    let s = &MAPS[i];
    // leaked on purpose: never freed, as the handler may be reading an old one
    s.path.store(c.into_raw(), Ordering::SeqCst);
    s.len.store(len, Ordering::SeqCst);
    s.start.store(start as usize, Ordering::SeqCst);
    Some(Watched(i))
}

/// The registered file mapped at `addr` (async-signal-safe).
fn file_at(addr: usize) -> Option<*const libc::c_char> {
    for s in &MAPS {
        let start = s.start.load(Ordering::SeqCst);
        if start == 0 || addr < start {
            continue;
        }
        let len = s.len.load(Ordering::SeqCst);
        let p = s.path.load(Ordering::SeqCst);
        if addr - start < len && !p.is_null() {
            return Some(p);
        }
    }
    None
}

fn put(b: &[u8]) {
    // SAFETY: write(2) on stderr of a valid buffer
    unsafe {
        libc::write(2, b.as_ptr().cast(), b.len());
    }
}

static FIRED: AtomicBool = AtomicBool::new(false);

/// What the handler writes, before and after the file's name (exit 2 follows).
pub const SIGBUS_MESSAGE: &str = "a checkpoint file changed or was truncated while being read (SIGBUS); nvfp4-probe reads shards memory-mapped: keep them unchanged while it runs";

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // another thread faulting at the same time waits for the first one's _exit
    if FIRED.swap(true, Ordering::SeqCst) {
        loop {
            // SAFETY: pause(2) is async-signal-safe
            unsafe {
                libc::pause();
            }
        }
    }
    // SAFETY: the kernel passes a valid siginfo with SA_SIGINFO
    #[cfg(target_os = "linux")]
    let addr = unsafe { (*info).si_addr() } as usize;
    #[cfg(not(target_os = "linux"))]
    let addr = unsafe { (*info).si_addr } as usize;
    put(b"\nerror: ");
    match file_at(addr) {
        Some(p) => {
            // SAFETY: a NUL-terminated string leaked by `watch`
            let n = unsafe { libc::strlen(p) };
            put(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) });
            put(b": ");
            put(SIGBUS_MESSAGE.as_bytes());
        }
        None => {
            put(SIGBUS_MESSAGE.as_bytes());
            put(b" (the fault lies outside every mapped shard)");
        }
    }
    put(b"\n");
    // SAFETY: system calls only
    if unsafe { super::cleanup::remove_all_raw() } > 0 {
        put(b"temporary outputs removed\n");
    }
    // SAFETY: _exit(2) is async-signal-safe
    unsafe { libc::_exit(crate::error::EXIT_UNUSABLE) }
}

/// Ignore SIGXFSZ and handle SIGBUS (module doc). Called once at the start of the process.
pub fn install() {
    // SAFETY: sigaction with a handler that only makes async-signal-safe calls
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_mapping_names_its_file_until_dropped() {
        let buf = vec![0u8; 4096];
        let w = watch(
            buf.as_ptr(),
            buf.len(),
            Path::new("/x/model-00001.safetensors"),
        )
        .unwrap();
        let at = |a: usize| {
            file_at(a).map(|p| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_str()
                    .unwrap()
                    .to_string()
            })
        };
        let base = buf.as_ptr() as usize;
        assert_eq!(
            at(base + 100).as_deref(),
            Some("/x/model-00001.safetensors")
        );
        assert_eq!(
            at(base + 4095).as_deref(),
            Some("/x/model-00001.safetensors")
        );
        assert_eq!(at(base + 4096), None);
        drop(w);
        assert_eq!(at(base + 100), None);
    }
}
