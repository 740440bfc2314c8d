//! The real path of an output that may not exist yet.
//!
//! `std::fs::canonicalize` fails on a path whose parents do not exist yet, which is exactly the
//! case of `--json M/sub/r.json` or `--dump M/dumps`; a guard that falls back to the path as
//! given is bypassed by it (and by `x/../M/sub`, where `x` is a symlink). This walks the path
//! one component at a time as the kernel would: symlinks are followed (also dangling ones, whose
//! target is where a write would land), `..` of a resolved directory is its real parent, and
//! once a component does not exist the rest is appended lexically (a directory that does not
//! exist cannot be a symlink).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

/// Symlinks followed before giving up (Linux's MAXSYMLINKS).
const MAX_LINKS: usize = 40;

enum Part {
    Parent,
    Name(OsString),
}

fn parts(p: &Path) -> impl Iterator<Item = Part> + '_ {
    p.components().filter_map(|c| match c {
        Component::ParentDir => Some(Part::Parent),
        Component::Normal(n) => Some(Part::Name(n.to_os_string())),
        Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
    })
}

/// The absolute, symlink-free path `p` names now or will name once its missing parents are
/// created. Errors: a symlink loop, a component that is not a directory, an unreadable parent.
pub fn real_path(p: &Path) -> io::Result<PathBuf> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    };
    let mut todo: VecDeque<Part> = parts(&abs).collect();
    let mut real = PathBuf::from("/");
    // whether `real` exists on disk: below a missing directory nothing is looked up
    let mut exists = true;
    let mut links = 0;
    while let Some(part) = todo.pop_front() {
        match part {
            Part::Parent => {
                real.pop();
                exists = exists || std::fs::symlink_metadata(&real).is_ok();
            }
            Part::Name(n) => {
                let cand = real.join(&n);
                if !exists {
                    real = cand;
                    continue;
                }
                match std::fs::symlink_metadata(&cand) {
                    Ok(m) if m.file_type().is_symlink() => {
                        links += 1;
                        if links > MAX_LINKS {
                            return Err(io::Error::other(format!(
                                "too many levels of symbolic links at {}",
                                cand.display()
                            )));
                        }
                        let target = std::fs::read_link(&cand)?;
                        if target.is_absolute() {
                            real = PathBuf::from("/");
                        }
                        for t in parts(&target).collect::<Vec<_>>().into_iter().rev() {
                            todo.push_front(t);
                        }
                    }
                    Ok(m) => {
                        if !m.is_dir() && !todo.is_empty() {
                            return Err(io::Error::other(format!(
                                "{} is not a directory",
                                cand.display()
                            )));
                        }
                        real = cand;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        exists = false;
                        real = cand;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(real)
}

/// The deepest existing directory at or above `real` (itself symlink-free, from [`real_path`]).
pub fn existing_ancestor(real: &Path) -> PathBuf {
    let mut p = real.to_path_buf();
    while !p.is_dir() {
        if !p.pop() {
            return PathBuf::from("/");
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_missing_parents_links_and_dotdot() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        let m = root.join("M");
        std::fs::create_dir(&m).unwrap();
        std::fs::create_dir(root.join("x")).unwrap();
        std::os::unix::fs::symlink(&m, root.join("link")).unwrap();
        std::os::unix::fs::symlink("M/a/b", root.join("dangling")).unwrap();
        // a relative link inside a subdirectory resolves against that subdirectory
        std::os::unix::fs::symlink("../M", root.join("x/up")).unwrap();
        let cases = [
            (root.join("M/sub/r.json"), m.join("sub/r.json")),
            (root.join("link/r.json"), m.join("r.json")),
            (
                root.join("link/new/deeper/r.json"),
                m.join("new/deeper/r.json"),
            ),
            (root.join("x/../M/sub"), m.join("sub")),
            (root.join("x/up/sub/f"), m.join("sub/f")),
            (root.join("x/up/../M/f"), m.join("f")),
            (root.join("dangling"), m.join("a/b")),
            (root.join("M/missing/../f"), m.join("f")),
            (root.join("./x/./f"), root.join("x/f")),
        ];
        for (given, want) in cases {
            assert_eq!(real_path(&given).unwrap(), want, "{}", given.display());
        }
        assert_eq!(existing_ancestor(&m.join("a/b/c")), m);
    }

    #[test]
    fn loops_and_files_as_directories_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        std::os::unix::fs::symlink(root.join("b"), root.join("a")).unwrap();
        std::os::unix::fs::symlink(root.join("a"), root.join("b")).unwrap();
        let e = real_path(&root.join("a/x")).unwrap_err();
        assert!(e.to_string().contains("symbolic links"), "{e}");
        std::fs::write(root.join("f"), b"x").unwrap();
        let e = real_path(&root.join("f/x")).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }
}
