//! What an output must never overwrite, as far as a checkpoint is concerned: the model
//! directory, the real directories of its symlinked entries and of every shard it reads. The
//! guard itself (`output::Guard`) knows paths, not checkpoints.

use std::path::{Path, PathBuf};

use super::{Checkpoint, INDEX_FILE};
use crate::output::{real_path, Guard};

/// An index larger than this is not read for the guard (the reader refuses it anyway).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The checkpoint side of [`Guard`].
pub trait GuardCheckpoint: Sized {
    /// A checkpoint directory: the directory itself, the real directory of every symlinked
    /// entry in it, and the real directory of every shard its index names.
    fn model_dir(self, dir: &Path) -> Self;
    /// The shard files an opened checkpoint reads (skipped for the in-memory built-in model).
    fn checkpoint(self, ck: &Checkpoint) -> Self;
}

/// The real directory of a shard file (or the real directory a symlinked entry names).
fn shard(g: &mut Guard, file: &Path, model: &Path) {
    if let Ok(t) = real_path(file) {
        let d = if t.is_dir() {
            Some(t.as_path())
        } else {
            t.parent()
        };
        if let Some(d) = d {
            g.add(
                d.to_path_buf(),
                format!(
                    "{}, the real directory of shard {} of the model directory {}",
                    d.display(),
                    file.file_name().unwrap_or_default().to_string_lossy(),
                    model.display()
                ),
            );
        }
    }
}

impl GuardCheckpoint for Guard {
    fn model_dir(mut self, dir: &Path) -> Guard {
        let real = real_path(dir).unwrap_or_else(|_| dir.to_path_buf());
        self.add(
            real.clone(),
            format!("the model directory {}", dir.display()),
        );
        let mut names: Vec<PathBuf> = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&real) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_symlink()) {
                    names.push(e.path());
                }
            }
        }
        let index = real.join(INDEX_FILE);
        if std::fs::metadata(&index).is_ok_and(|m| m.is_file() && m.len() <= MAX_INDEX_BYTES) {
            if let Some(map) = std::fs::read(&index)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v.get("weight_map").and_then(|m| m.as_object()).cloned())
            {
                let mut files: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
                files.sort_unstable();
                files.dedup();
                names.extend(files.into_iter().map(|f| real.join(f)));
            }
        }
        for n in names {
            shard(&mut self, &n, dir);
        }
        self
    }

    fn checkpoint(mut self, ck: &Checkpoint) -> Guard {
        if ck.location() == Path::new(super::BUILTIN) {
            return self;
        }
        let mut files: Vec<PathBuf> = ck
            .tensor_names()
            .iter()
            .filter_map(|n| ck.info(n).map(|i| i.file))
            .collect();
        files.sort();
        files.dedup();
        for f in files {
            shard(&mut self, &f, ck.location());
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::check;

    #[test]
    fn guard_refuses_model_dir_shards_and_inputs_and_special_files() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        let (m, s) = (root.join("M"), root.join("S"));
        std::fs::create_dir_all(&m).unwrap();
        std::fs::create_dir_all(&s).unwrap();
        std::fs::write(s.join("model.safetensors"), b"x").unwrap();
        std::os::unix::fs::symlink(s.join("model.safetensors"), m.join("model.safetensors"))
            .unwrap();
        std::fs::write(root.join("in.json"), b"{}").unwrap();
        let g = Guard::new()
            .model_dir(&m)
            .input(&root.join("in.json"), "the input");
        for bad in [
            m.join("r.json"),
            m.join("new/r.json"),
            s.join("r.json"),
            root.join("in.json"),
            root.join("S/../M/x"),
        ] {
            let e = check(&g, &bad).unwrap_err().to_string();
            assert!(e.contains(&bad.display().to_string()), "{e}");
        }
        assert!(check(&g, &root.join("ok.json")).is_ok());
        let e = check(&g, Path::new("/dev/null")).unwrap_err().to_string();
        assert!(
            e.contains("/dev/null") && e.contains("character device"),
            "{e}"
        );
        let e = check(&g, &root).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
    }
}
