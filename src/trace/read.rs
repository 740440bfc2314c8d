//! Reading engine activation dumps: one safetensors file, or a directory of per-rank / per-pass files.
//!
//! File names carry the layout: `rank3`, `tp3` or `-tp3-` give the tensor-parallel rank, `pass2` the forward
//! pass (chunks of one prefill, in order). Everything else in the name is ignored. Values are read as f32
//! whatever the stored dtype (F32, BF16, F16, F64; integer tensors for token ids and expert indices).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::{Error, Result, Tensor};

/// One tensor as dumped, converted to f32.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    /// safetensors dtype name (`BF16`, `F32`, …).
    pub dtype: String,
}

#[derive(Clone, Debug)]
pub struct TraceFile {
    pub path: PathBuf,
    pub rank: usize,
    pub pass: usize,
    pub tensors: BTreeMap<String, RawTensor>,
    pub metadata: BTreeMap<String, String>,
}

/// All files of a trace, sorted by (pass, rank).
#[derive(Clone, Debug)]
pub struct Trace {
    pub root: PathBuf,
    pub files: Vec<TraceFile>,
    pub ranks: usize,
    pub passes: usize,
}

/// Token ids of the trace and where each trace row sits in the oracle's token order.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceTokens {
    /// In position order (what the oracle runs).
    pub ids: Vec<u32>,
    /// Token row i of a full-length trace tensor is oracle row `order[i]` (identity unless `positions`
    /// was dumped); rows past `order.len()` are padding.
    pub order: Vec<usize>,
}

/// Trailing digits after `key` in a lower-cased file stem (`rank12` → 12).
fn number_after(stem: &str, key: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = stem[from..].find(key) {
        let start = from + i + key.len();
        let digits: String = stem[start..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let before_ok = from + i == 0
            || !stem[..from + i]
                .chars()
                .last()
                .is_some_and(|c| c.is_ascii_alphabetic());
        if !digits.is_empty() && before_ok {
            return digits.parse().ok();
        }
        from = start;
    }
    None
}

fn to_f32(path: &Path, name: &str, v: &safetensors::tensor::TensorView) -> Result<RawTensor> {
    let b = v.data();
    let data: Vec<f32> = match v.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| crate::numerics::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        Dtype::I16 => b
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as f32)
            .collect(),
        Dtype::U8 => b.iter().map(|&x| x as f32).collect(),
        d => {
            return Err(Error::bad(
                path,
                Some(name),
                format!("dtype {d:?} is not an activation dtype (F32, BF16, F16, F64, integer)"),
            ))
        }
    };
    Ok(RawTensor {
        shape: v.shape().to_vec(),
        data,
        dtype: format!("{:?}", v.dtype()),
    })
}

fn read_file(path: &Path, rank: usize, pass: usize) -> Result<TraceFile> {
    // a regular file only (a FIFO would block, /dev/zero never ends); the size is the file's own
    let bytes = crate::input::read_bytes(path, "trace file", u64::MAX - 1)?;
    crate::input::check_safetensors_keys(path, &bytes)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::bad(path, None, format!("not a safetensors file: {e}")))?;
    let metadata: BTreeMap<String, String> = meta
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::bad(path, None, format!("not a safetensors file: {e}")))?;
    let mut tensors = BTreeMap::new();
    for (name, v) in st.tensors() {
        let t = to_f32(path, &name, &v)?;
        tensors.insert(name, t);
    }
    Ok(TraceFile {
        path: path.to_path_buf(),
        rank,
        pass,
        tensors,
        metadata,
    })
}

impl Trace {
    /// Read a file, or every `*.safetensors` in a directory (ranks and passes from the file names).
    pub fn open(path: &Path) -> Result<Trace> {
        let mut files = Vec::new();
        if path.is_dir() {
            let rd = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
            let mut paths: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            paths.sort();
            if paths.is_empty() {
                return Err(Error::bad(
                    path,
                    None,
                    "no *.safetensors files in the trace directory",
                ));
            }
            let mut seen = BTreeMap::new();
            for p in paths {
                let stem = p
                    .file_stem()
                    .map(|s| s.to_string_lossy().to_lowercase())
                    .unwrap_or_default();
                let rank = number_after(&stem, "rank")
                    .or_else(|| number_after(&stem, "tp"))
                    .unwrap_or(0);
                let pass = number_after(&stem, "pass").unwrap_or(0);
                if let Some(prev) = seen.insert((pass, rank), p.clone()) {
                    return Err(Error::bad(
                        &p,
                        None,
                        format!(
                            "same pass {pass} and rank {rank} as {} (name files rankN / passN)",
                            prev.display()
                        ),
                    ));
                }
                files.push(read_file(&p, rank, pass)?);
            }
        } else {
            files.push(read_file(path, 0, 0)?);
        }
        files.sort_by_key(|f| (f.pass, f.rank));
        let ranks = files.iter().map(|f| f.rank).max().unwrap_or(0) + 1;
        let passes = files.iter().map(|f| f.pass).max().unwrap_or(0) + 1;
        for p in 0..passes {
            for r in 0..ranks {
                if !files.iter().any(|f| f.pass == p && f.rank == r) {
                    return Err(Error::bad(
                        path,
                        None,
                        format!("pass {p} has no file for rank {r} (ranks 0..{ranks} expected)"),
                    ));
                }
            }
        }
        Ok(Trace {
            root: path.to_path_buf(),
            files,
            ranks,
            passes,
        })
    }

    /// The file of (pass, rank).
    pub fn file(&self, pass: usize, rank: usize) -> &TraceFile {
        self.files
            .iter()
            .find(|f| f.pass == pass && f.rank == rank)
            .expect("every (pass, rank) checked in open")
    }

    /// Metadata of the first file (`rows`, `num_tokens`, producer, dtype notes).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.files[0].metadata
    }

    /// Every tensor name in any file, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .files
            .iter()
            .flat_map(|f| f.tensors.keys().cloned())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// `rows` metadata: the token rows kept in token-row tensors.
    pub fn rows(&self) -> Result<Option<Vec<usize>>> {
        let Some(s) = self.metadata().get("rows") else {
            return Ok(None);
        };
        if self.passes > 1 {
            return Err(Error::bad(
                &self.files[0].path,
                None,
                "`rows` metadata with several passes is not supported (capture whole passes)",
            ));
        }
        s.split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Some)
            .map_err(|e| Error::bad(&self.files[0].path, None, format!("metadata rows: {e}")))
    }

    /// Token ids from the `input_ids` tensors (rank 0 of each pass, concatenated), trimmed to the
    /// `num_tokens` metadata (engines pad batches) and ordered by the `positions` tensors when present.
    pub fn tokens(&self) -> Result<Option<TraceTokens>> {
        let mut ids = Vec::new();
        let mut pos: Option<Vec<usize>> = Some(Vec::new());
        for p in 0..self.passes {
            let f = self.file(p, 0);
            let Some(t) = f.tensors.get("input_ids") else {
                if p == 0 {
                    return Ok(None);
                }
                return Err(Error::bad(
                    &f.path,
                    Some("input_ids"),
                    "missing in this pass",
                ));
            };
            let n = match f.metadata.get("num_tokens") {
                Some(s) => s
                    .trim()
                    .parse::<usize>()
                    .map_err(|e| Error::bad(&f.path, None, format!("metadata num_tokens: {e}")))?,
                None => t.data.len(),
            };
            if n > t.data.len() {
                return Err(Error::bad(
                    &f.path,
                    Some("input_ids"),
                    format!("num_tokens {n} > {} ids", t.data.len()),
                ));
            }
            let base = ids.len();
            for &v in &t.data[..n] {
                if !(v >= 0.0 && v.fract() == 0.0) {
                    return Err(Error::bad(
                        &f.path,
                        Some("input_ids"),
                        format!("bad token id {v}"),
                    ));
                }
                ids.push(v as u32);
            }
            match (f.tensors.get("positions"), pos.as_mut()) {
                (Some(pt), Some(acc)) if pt.data.len() >= n => {
                    acc.extend(pt.data[..n].iter().map(|&x| x.max(0.0) as usize))
                }
                (Some(_), _) => {
                    return Err(Error::bad(
                        &f.path,
                        Some("positions"),
                        "fewer positions than tokens",
                    ))
                }
                (None, Some(acc)) => acc.extend(base..base + n),
                (None, None) => {}
            }
        }
        let order = pos.unwrap_or_else(|| (0..ids.len()).collect());
        let mut seen = vec![false; ids.len()];
        for &p in &order {
            if p >= ids.len() || std::mem::replace(&mut seen[p], true) {
                return Err(Error::bad(
                    &self.root,
                    Some("positions"),
                    "positions are not a permutation of 0..T (one prefill sequence is expected)",
                ));
            }
        }
        let mut sorted = vec![0u32; ids.len()];
        for (i, &p) in order.iter().enumerate() {
            sorted[p] = ids[i];
        }
        Ok(Some(TraceTokens { ids: sorted, order }))
    }
}

/// Stored dtype of a written trace tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteDtype {
    F32,
    Bf16,
}

/// Write tensors as a trace file (what the capture scripts write; used by tests and for hand-made traces).
pub fn write(
    path: &Path,
    tensors: &[(String, Tensor)],
    dtype: WriteDtype,
    input_ids: Option<&[u32]>,
    metadata: &[(&str, String)],
) -> Result<()> {
    let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let (d, b) = match dtype {
            WriteDtype::F32 => (
                Dtype::F32,
                t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            WriteDtype::Bf16 => (
                Dtype::BF16,
                t.data
                    .iter()
                    .flat_map(|&x| crate::numerics::bf16::to_bits(x).to_le_bytes())
                    .collect(),
            ),
        };
        bufs.push((name.clone(), d, t.shape.clone(), b));
    }
    if let Some(ids) = input_ids {
        bufs.push((
            "input_ids".into(),
            Dtype::I64,
            vec![ids.len()],
            ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect(),
        ));
    }
    let views = bufs
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::bad(path, Some(n), format!("{e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: std::collections::HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::bad(path, None, format!("serialize: {e}")))?;
    crate::output::write_one(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_and_pass_from_names() {
        assert_eq!(number_after("rank3", "rank"), Some(3));
        assert_eq!(number_after("dump-tp12-pass0", "tp"), Some(12));
        assert_eq!(number_after("dump-tp12-pass7", "pass"), Some(7));
        assert_eq!(number_after("output", "tp"), None);
        // "stp1" is not a tp marker (letter before it)
        assert_eq!(number_after("stp1", "tp"), None);
    }
}
