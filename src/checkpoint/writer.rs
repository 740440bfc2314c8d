//! Safetensors writer with sharding. Memory is bounded by one shard: tensors are buffered until
//! the next one would overflow the shard, then the shard is written and dropped. The shard count
//! is unknown until the end, so shards are written under temporary names and renamed at
//! `finish` to `model-0000i-of-0000n.safetensors` (or `model.safetensors` when there is one).
//!
//! The writer works in the directory it is given; `synth` gives it a temporary directory staged
//! by `crate::output` (renamed into place when complete), so a failed or killed synth leaves
//! no shard anywhere. Files are written through `crate::output`'s primitives.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::INDEX_FILE;
use crate::{Error, Result};

struct Pending {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

enum Target {
    Dir(PathBuf),
    Memory(Vec<(String, Vec<u8>)>),
}

pub struct ShardWriter {
    target: Target,
    max_shard_bytes: usize,
    pending: Vec<Pending>,
    pending_bytes: usize,
    /// Temporary file (or buffer) names of the shards written so far, with their tensor names.
    done: Vec<(String, Vec<String>)>,
    names: std::collections::HashSet<String>,
    total_bytes: u64,
}

/// Serialise tensors into one safetensors buffer (header padded to 8 bytes, data in the given order).
pub fn serialize(
    tensors: &[(&str, Dtype, &[usize], &[u8])],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut infos = Vec::with_capacity(tensors.len());
    let mut off = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: *dtype,
                shape: shape.to_vec(),
                data_offsets: (off, off + bytes.len()),
            },
        ));
        off += bytes.len();
    }
    let meta = Metadata::new(metadata, infos).map_err(|e| {
        Error::bad(
            "<writer>",
            tensors.first().map(|t| t.0),
            format!("tensor shape/dtype/bytes disagree: {e}"),
        )
    })?;
    let mut header =
        serde_json::to_vec(&meta).map_err(|e| Error::bad("<writer>", None, e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + header.len() + off);
    out.extend((header.len() as u64).to_le_bytes());
    out.extend(header);
    for (_, _, _, b) in tensors {
        out.extend_from_slice(b);
    }
    Ok(out)
}

/// Replace `path` with `bytes` through a temporary renamed into place (see `crate::output`),
/// readable by others (safetensors' own writer leaves 0600).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::output::write_one(path, bytes)
}

/// Shard file names for `n` shards.
fn shard_names(n: usize) -> Vec<String> {
    if n == 1 {
        vec!["model.safetensors".to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    }
}

impl ShardWriter {
    /// Write into `dir` (created if absent), shards of at most `max_shard_bytes` of tensor data
    /// (a single tensor larger than that gets a shard of its own).
    pub fn new(dir: &Path, max_shard_bytes: usize) -> Result<ShardWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        Ok(Self::with_target(
            Target::Dir(dir.to_path_buf()),
            max_shard_bytes,
        ))
    }

    /// Build the shards in memory, for `Checkpoint::from_memory` (see `to_memory`).
    pub fn in_memory(max_shard_bytes: usize) -> ShardWriter {
        Self::with_target(Target::Memory(Vec::new()), max_shard_bytes)
    }

    fn with_target(target: Target, max_shard_bytes: usize) -> ShardWriter {
        ShardWriter {
            target,
            max_shard_bytes: max_shard_bytes.max(1),
            pending: Vec::new(),
            pending_bytes: 0,
            done: Vec::new(),
            names: Default::default(),
            total_bytes: 0,
        }
    }

    pub fn add(&mut self, name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Result<()> {
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let need = numel
            .and_then(|n| n.checked_mul(dtype.bitsize()))
            .map(|b| b.div_ceil(8));
        if need != Some(bytes.len()) {
            return Err(Error::bad(
                "<writer>",
                Some(name),
                format!("{} bytes given for {dtype:?} {shape:?}", bytes.len()),
            ));
        }
        if !self.names.insert(name.to_string()) {
            return Err(Error::bad("<writer>", Some(name), "tensor added twice"));
        }
        if !self.pending.is_empty() && self.pending_bytes + bytes.len() > self.max_shard_bytes {
            self.flush()?;
        }
        self.pending_bytes += bytes.len();
        self.total_bytes += bytes.len() as u64;
        self.pending.push(Pending {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            bytes,
        });
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        let views: Vec<(&str, Dtype, &[usize], &[u8])> = pending
            .iter()
            .map(|p| {
                (
                    p.name.as_str(),
                    p.dtype,
                    p.shape.as_slice(),
                    p.bytes.as_slice(),
                )
            })
            .collect();
        let buf = serialize(
            &views,
            Some(HashMap::from([("format".to_string(), "pt".to_string())])),
        )?;
        let tmp = format!(".shard-{:05}.safetensors.partial", self.done.len() + 1);
        match &mut self.target {
            Target::Dir(d) => crate::output::write_new_file(&d.join(&tmp), &buf)?,
            Target::Memory(v) => v.push((tmp.clone(), buf)),
        }
        self.done
            .push((tmp, pending.into_iter().map(|p| p.name).collect()));
        Ok(())
    }

    fn index_json(&self, names: &[String]) -> Result<Vec<u8>> {
        let mut map = BTreeMap::new();
        for ((_, tensors), file) in self.done.iter().zip(names) {
            for t in tensors {
                map.insert(t.clone(), file.clone());
            }
        }
        let v = serde_json::json!({
            "metadata": {"total_size": self.total_bytes},
            "weight_map": map,
        });
        serde_json::to_vec_pretty(&v).map_err(|e| Error::bad(INDEX_FILE, None, e.to_string()))
    }

    /// Write the last shard, rename shards to their final names, write the index (when
    /// sharded) and `config.json`.
    pub fn finish(mut self, config_json: &str) -> Result<()> {
        self.flush()?;
        let dir = match &self.target {
            Target::Dir(d) => d.clone(),
            Target::Memory(_) => {
                return Err(Error::usage(
                    "ShardWriter::finish on an in-memory writer; use to_memory",
                ))
            }
        };
        if self.done.is_empty() {
            // A checkpoint with no tensors still needs one (empty) shard to be openable.
            self.pending_bytes = 0;
            let buf = serialize(&[], None)?;
            let tmp = ".shard-00001.safetensors.partial".to_string();
            crate::output::write_new_file(&dir.join(&tmp), &buf)?;
            self.done.push((tmp, Vec::new()));
        }
        let names = shard_names(self.done.len());
        for ((tmp, _), name) in self.done.iter().zip(&names) {
            let (from, to) = (dir.join(tmp), dir.join(name));
            std::fs::rename(&from, &to).map_err(|e| Error::io(&to, e))?;
        }
        if names.len() > 1 {
            write_file(&dir.join(INDEX_FILE), &self.index_json(&names)?)?;
        } else if dir.join(INDEX_FILE).is_file() {
            // A stale index from an earlier sharded write would shadow the new single file.
            let p = dir.join(INDEX_FILE);
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
        self.done.clear();
        write_file(&dir.join("config.json"), config_json.as_bytes())
    }

    /// Finish an in-memory writer: `(file name, bytes)` pairs, the index included when sharded.
    pub fn to_memory(mut self) -> Result<Vec<(String, Vec<u8>)>> {
        self.flush()?;
        if self.done.is_empty() {
            let buf = serialize(&[], None)?;
            self.done.push(("empty".into(), Vec::new()));
            if let Target::Memory(v) = &mut self.target {
                v.push(("empty".into(), buf));
            }
        }
        let names = shard_names(self.done.len());
        let index = (names.len() > 1)
            .then(|| self.index_json(&names))
            .transpose()?;
        let Target::Memory(bufs) = std::mem::replace(&mut self.target, Target::Memory(Vec::new()))
        else {
            return Err(Error::usage(
                "ShardWriter::to_memory on a directory writer; use finish",
            ));
        };
        let mut out: Vec<(String, Vec<u8>)> = bufs
            .into_iter()
            .zip(&names)
            .map(|((_, b), n)| (n.clone(), b))
            .collect();
        if let Some(ix) = index {
            out.push((INDEX_FILE.to_string(), ix));
        }
        Ok(out)
    }
}

impl Drop for ShardWriter {
    /// A writer dropped before `finish` (an error midway) leaves no partial shards behind.
    fn drop(&mut self) {
        if let Target::Dir(d) = &self.target {
            for (tmp, _) in &self.done {
                let _ = std::fs::remove_file(d.join(tmp));
            }
        }
    }
}
