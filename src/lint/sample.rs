//! Row samples of packed weights read straight from the shard file, so that looking at one row
//! costs one row: `Checkpoint::bytes` hands out (and counts) whole tensors.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::checkpoint::{Checkpoint, BUILTIN};
use crate::{Error, Result};

/// Data start and per-tensor byte ranges of one shard.
type Header = (u64, HashMap<String, (u64, u64)>);

#[derive(Default)]
pub struct Sampler {
    headers: Mutex<HashMap<PathBuf, std::sync::Arc<Header>>>,
    bytes: AtomicU64,
}

fn parse_header(path: &Path) -> Result<Header> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| Error::io(path, e))?;
    let n = u64::from_le_bytes(n);
    if n > 512 << 20 {
        return Err(Error::bad(
            path,
            None,
            "safetensors header larger than 512 MiB",
        ));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(|e| Error::io(path, e))?;
    let v: serde_json::Value = serde_json::from_slice(&h)
        .map_err(|e| Error::bad(path, None, format!("header is not JSON: {e}")))?;
    let mut map = HashMap::new();
    if let Some(o) = v.as_object() {
        for (k, e) in o {
            let off = e.get("data_offsets").and_then(|d| d.as_array());
            if let Some([a, b]) = off.map(|a| a.as_slice()) {
                if let (Some(a), Some(b)) = (a.as_u64(), b.as_u64()) {
                    map.insert(k.clone(), (a, b));
                }
            }
        }
    }
    Ok((8 + n, map))
}

impl Sampler {
    /// Bytes read through samples so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes `[row·row_bytes, (row+1)·row_bytes)` of raw tensor `raw` stored in `file`.
    pub fn row(
        &self,
        ck: &Checkpoint,
        raw: &str,
        file: &Path,
        row: usize,
        row_bytes: usize,
    ) -> Result<Vec<u8>> {
        let (lo, hi) = (row * row_bytes, (row + 1) * row_bytes);
        if ck.location() == Path::new(BUILTIN) {
            let b = ck.bytes(raw)?;
            return b.get(lo..hi).map(<[u8]>::to_vec).ok_or_else(|| {
                Error::bad(
                    file,
                    Some(raw),
                    format!("row {row} is past the tensor's end"),
                )
            });
        }
        let header = {
            let mut cache = self
                .headers
                .lock()
                .map_err(|_| Error::usage("sampler lock poisoned"))?;
            match cache.get(file) {
                Some(h) => h.clone(),
                None => {
                    let h = std::sync::Arc::new(parse_header(file)?);
                    cache.insert(file.to_path_buf(), h.clone());
                    h
                }
            }
        };
        let (start, end) = *header
            .1
            .get(raw)
            .ok_or_else(|| Error::bad(file, Some(raw), "tensor not in this shard's header"))?;
        if start + hi as u64 > end {
            return Err(Error::bad(
                file,
                Some(raw),
                format!("row {row} is past the tensor's end"),
            ));
        }
        let mut f = File::open(file).map_err(|e| Error::io(file, e))?;
        f.seek(SeekFrom::Start(header.0 + start + lo as u64))
            .map_err(|e| Error::io(file, e))?;
        let mut buf = vec![0u8; row_bytes];
        f.read_exact(&mut buf).map_err(|e| Error::io(file, e))?;
        self.bytes.fetch_add(row_bytes as u64, Ordering::Relaxed);
        Ok(buf)
    }
}
