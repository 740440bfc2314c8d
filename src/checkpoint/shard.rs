//! One safetensors file: its bytes (memory-mapped or owned) and its validated header.
//!
//! The header is checked in full before anything else touches the file, so that every later
//! read is an in-range slice and a damaged file fails at open with the file and tensor named,
//! not halfway through a run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::{Error, Result};

/// Where a shard's bytes live. The mmap keeps untouched tensors out of memory; owned buffers
/// serve the built-in model.
pub(crate) enum Backing {
    Mmap(memmap2::Mmap),
    Mem(Vec<u8>),
}

pub(crate) struct Shard {
    pub path: PathBuf,
    /// The mapping registered for the SIGBUS handler (`output::fatal`), which names the file.
    _watched: Option<crate::output::fatal::Watched>,
    backing: Backing,
}

impl Shard {
    /// Asynchronous readahead of a range (MADV_WILLNEED), for a prefetch thread.
    pub fn readahead(&self, start: usize, len: usize) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = &self.backing {
            let _ = m.advise_range(memmap2::Advice::WillNeed, start, len);
        }
        let _ = (start, len);
    }
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mmap(_))
    }
    pub fn buf(&self) -> &[u8] {
        match &self.backing {
            Backing::Mmap(m) => m,
            Backing::Mem(v) => v,
        }
    }
}

/// A tensor as the header declares it, with absolute byte offsets into its shard.
#[derive(Clone, Debug)]
pub(crate) struct RawEntry {
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// Map a file read-only. An empty file cannot be mapped on every platform, and is invalid anyway.
pub(crate) fn map_file(path: &Path) -> Result<Shard> {
    // before `open`: a FIFO would block it, a device or a link to /dev/zero is no shard
    crate::input::regular_file(path, "shard")?;
    let file = std::fs::File::open(path)
        .map_err(|e| Error::bad(path, None, format!("cannot open shard: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| Error::bad(path, None, format!("cannot stat shard: {e}")))?
        .len();
    if len < 8 {
        return Err(Error::bad(
            path,
            None,
            format!("file is {len} bytes, too short for a safetensors header (truncated?)"),
        ));
    }
    // SAFETY: the map is read-only; a checkpoint rewritten underneath a running probe is
    // outside what this tool supports (same contract as every mmap-based safetensors loader):
    // a read of a truncated part faults (SIGBUS), which `output::fatal` reports as such, naming
    // the file (exit 2).
    let mmap = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::bad(path, None, format!("cannot map shard: {e}")))?;
    // Reads are tensor-granular and often tiny (a 4-byte tensor scale next to megabytes of
    // packed experts): default readahead around each fault would pull in the neighbours that
    // laziness is meant to skip. Large reads ask for their own range (`prefetch`).
    #[cfg(unix)]
    let _ = mmap.advise(memmap2::Advice::Random);
    Ok(Shard {
        path: path.to_path_buf(),
        _watched: crate::output::fatal::watch(mmap.as_ptr(), mmap.len(), path),
        backing: Backing::Mmap(mmap),
    })
}

impl Shard {
    /// Ask the kernel to read `start..start+len` ahead, for reads large enough to stream.
    pub fn prefetch(&self, start: usize, len: usize) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = &self.backing {
            if len >= 1 << 16 {
                // One call maps the whole range instead of a page fault per 4 KiB; kernels
                // before 5.14 lack POPULATE_READ and get plain readahead instead.
                #[cfg(target_os = "linux")]
                let done = m
                    .advise_range(memmap2::Advice::PopulateRead, start, len)
                    .is_ok();
                #[cfg(not(target_os = "linux"))]
                let done = false;
                if !done {
                    let _ = m.advise_range(memmap2::Advice::WillNeed, start, len);
                }
            }
        }
        let _ = (start, len);
    }
}

pub(crate) fn mem_shard(path: PathBuf, bytes: Vec<u8>) -> Shard {
    Shard {
        path,
        _watched: None,
        backing: Backing::Mem(bytes),
    }
}

/// Validate a shard's header and list its tensors with absolute offsets.
pub(crate) fn parse(shard_idx: usize, shard: &Shard) -> Result<Vec<(String, RawEntry)>> {
    let buf = shard.buf();
    let path = &shard.path;
    crate::input::check_safetensors_keys(path, buf)?;
    match SafeTensors::read_metadata(buf) {
        Ok((n, meta)) => {
            let base = 8 + n;
            let mut out: Vec<(String, RawEntry)> = meta
                .tensors()
                .into_iter()
                .map(|(name, info)| {
                    (
                        name,
                        RawEntry {
                            shard: shard_idx,
                            dtype: info.dtype,
                            shape: info.shape.clone(),
                            start: base + info.data_offsets.0,
                            end: base + info.data_offsets.1,
                        },
                    )
                })
                .collect();
            out.sort_by_key(|a| a.1.start);
            Ok(out)
        }
        Err(e) => Err(diagnose(path, buf, e)),
    }
}

/// Turn a safetensors validation failure into a message that names the offending tensor.
/// The library's own errors say what is wrong but mostly not where.
fn diagnose(path: &Path, buf: &[u8], err: safetensors::SafeTensorError) -> Error {
    let generic = |t: Option<&str>| Error::bad(path, t, format!("invalid safetensors file: {err}"));
    if buf.len() < 8 {
        return Error::bad(
            path,
            None,
            format!("file is {} bytes, too short for a header", buf.len()),
        );
    }
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8]));
    let avail = (buf.len() - 8) as u64;
    if n > avail {
        return Error::bad(
            path,
            None,
            format!("header length field says {n} bytes but only {avail} bytes follow it (truncated file or lying header length)"),
        );
    }
    let n = n as usize;
    let header: serde_json::Map<String, serde_json::Value> = match std::str::from_utf8(&buf[8..8 + n])
        .ok()
        .and_then(|s| serde_json::from_str(s).ok())
    {
        Some(h) => h,
        None => {
            return Error::bad(
                path,
                None,
                format!("header of {n} bytes is not a JSON object (wrong header length or corrupt header): {err}"),
            )
        }
    };
    let data_len = buf.len() - 8 - n;
    let mut spans: Vec<(usize, usize, String)> = Vec::new();
    for (name, v) in &header {
        if name == "__metadata__" {
            continue;
        }
        let info: safetensors::tensor::TensorInfo = match serde_json::from_value(v.clone()) {
            Ok(i) => i,
            Err(e) => return Error::bad(path, Some(name), format!("bad header entry: {e}")),
        };
        let (s, e) = info.data_offsets;
        if e < s {
            return Error::bad(
                path,
                Some(name),
                format!("data_offsets [{s}, {e}] end before they start"),
            );
        }
        if e > data_len {
            return Error::bad(
                path,
                Some(name),
                format!("data_offsets [{s}, {e}] reach past the {data_len} data bytes of the file (truncated file or out-of-range offsets)"),
            );
        }
        let numel = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let need = numel
            .and_then(|n| n.checked_mul(info.dtype.bitsize()))
            .map(|b| b.div_ceil(8));
        if need != Some(e - s) {
            return Error::bad(
                path,
                Some(name),
                format!(
                    "data_offsets span {} bytes but {:?} {:?} needs {}",
                    e - s,
                    info.dtype,
                    info.shape,
                    need.map(|n| n.to_string())
                        .unwrap_or_else(|| "an overflowing size".into())
                ),
            );
        }
        spans.push((s, e, name.clone()));
    }
    spans.sort();
    let mut pos = 0usize;
    let mut prev: Option<&str> = None;
    for (s, e, name) in &spans {
        if *s < pos {
            return Error::bad(
                path,
                Some(name),
                format!(
                    "data_offsets [{s}, {e}] overlap tensor `{}`",
                    prev.unwrap_or("?")
                ),
            );
        }
        if *s > pos {
            return Error::bad(
                path,
                Some(name),
                format!("gap of {} bytes before data_offsets [{s}, {e}]", s - pos),
            );
        }
        pos = *e;
        prev = Some(name);
    }
    if pos != data_len {
        return Error::bad(
            path,
            prev,
            format!("tensor data ends at byte {pos} but the file holds {data_len} data bytes (trailing bytes or truncated file)"),
        );
    }
    match &err {
        safetensors::SafeTensorError::InvalidOffset(t) => generic(Some(t)),
        _ => generic(None),
    }
}

/// Reject shard file names from an index that could point outside the checkpoint directory.
pub(crate) fn safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains('/')
        && !name.contains('\\')
        && name != "."
        && name != ".."
        && !name.contains('\0')
}

/// Read `weight_map` of an index file.
pub(crate) fn index_map(path: &Path, v: &serde_json::Value) -> Result<HashMap<String, String>> {
    let wm = v
        .get("weight_map")
        .and_then(|w| w.as_object())
        .ok_or_else(|| Error::bad(path, None, "index has no `weight_map` object"))?;
    let mut out = HashMap::new();
    for (t, f) in wm {
        let f = f.as_str().ok_or_else(|| {
            Error::bad(path, Some(t), "weight_map entry is not a file name string")
        })?;
        if !safe_file_name(f) {
            return Err(Error::bad(
                path,
                Some(t),
                format!("shard name `{f}` is not a plain file name"),
            ));
        }
        out.insert(t.clone(), f.to_string());
    }
    Ok(out)
}
