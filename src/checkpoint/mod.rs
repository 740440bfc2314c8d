//! Checkpoint reading and writing.
//!
//! A checkpoint is opened once: config parsed, every shard header validated, every raw name
//! mapped to its canonical (official DeepSeek) name. Tensor bytes stay in the mmap until a
//! caller asks for them, so a probe of one layer touches one layer's bytes, and of the experts
//! only those that were routed to.

mod access;
mod complete;
pub mod convert;
mod experts;
pub mod formats;
pub mod guard;
pub mod naming;
pub mod qconfig;
pub mod quant;
pub mod shapes;
mod shard;
pub mod writer;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

pub use complete::MissingTensor;
pub use experts::transpose;
pub use guard::GuardCheckpoint;
pub use naming::{FusedPart, Naming};
pub use quant::{
    Fp8ScaleKind, QuantWeight, RawFormat, RawWeight, ScaleKind, ScaleSummary, Scheme, WeightFormat,
    WeightLayout, WeightMeta, WeightTensors,
};
pub use safetensors::Dtype;
pub use writer::ShardWriter;

/// Where a tensor's bytes are ([`Checkpoint::canonical_span`]).
#[derive(Clone, Debug)]
pub enum Span<'a> {
    File {
        path: &'a Path,
        offset: u64,
        len: usize,
    },
    Mem(Cow<'a, [u8]>),
}

impl Span<'_> {
    pub fn len(&self) -> usize {
        match self {
            Span::File { len, .. } => *len,
            Span::Mem(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

use crate::model::ModelConfig;
use crate::{Error, Result, Tensor};
use naming::Canon;
use shard::{RawEntry, Shard};

/// Label used as the location of an in-memory checkpoint.
pub const BUILTIN: &str = "<built-in>";
/// Name of the shard index file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Header facts of one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub file: PathBuf,
}

/// Where the bytes of a canonical tensor come from.
#[derive(Clone, Debug)]
enum Source {
    Whole(String),
    /// One expert's part of an HF fused expert tensor: a contiguous byte range of `raw`
    /// (`checkpoint::experts`).
    Slice {
        raw: String,
        expert: usize,
        part: FusedPart,
    },
}

pub struct Checkpoint {
    location: PathBuf,
    config_path: PathBuf,
    config: serde_json::Value,
    hf_quant: Option<serde_json::Value>,
    model_config: OnceLock<std::result::Result<ModelConfig, String>>,
    shards: Vec<Shard>,
    raw: HashMap<String, RawEntry>,
    canon: HashMap<String, Source>,
    raw_to_canon: HashMap<String, String>,
    naming: Naming,
    bytes_read: AtomicU64,
    /// `weight_meta` results by base (the headers and scalars never change once opened): the
    /// device runner asks for the same routed experts' metadata on every path and hypothesis.
    meta_cache: std::sync::Mutex<HashMap<String, quant::WeightMeta>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("location", &self.location)
            .field("naming", &self.naming)
            .field("shards", &self.shards.len())
            .field("tensors", &self.raw.len())
            .finish()
    }
}

fn parse_config(path: &Path, text: &str) -> Result<serde_json::Value> {
    let v = crate::input::parse_json(path, text, "config")?;
    if !v.is_object() {
        return Err(Error::bad(path, None, "config is not a JSON object"));
    }
    Ok(v)
}

/// Read a small JSON file of the checkpoint (config, quant config, index): a regular file only,
/// size-capped, parsed without duplicate keys.
fn read_json_file(path: &Path, what: &str) -> Result<String> {
    crate::input::read_text(path, what, crate::input::SMALL_FILE_MAX)
}

/// Does a path exist at all (a dangling symlink, a FIFO or a loop counts: the readers then say
/// what it is instead)?
fn present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

impl Checkpoint {
    /// Open a checkpoint directory (see the module doc for what is read up front).
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(Error::bad(dir, None, "checkpoint path is not a directory")),
            Err(e) => {
                let why = crate::input::why_missing(dir, &e);
                return Err(Error::bad(
                    dir,
                    None,
                    format!("checkpoint directory: {why}"),
                ));
            }
        }
        let config_path = dir.join("config.json");
        let text = read_json_file(&config_path, "config")?;
        let config = parse_config(&config_path, &text)?;
        let hq_path = dir.join("hf_quant_config.json");
        let hf_quant = if present(&hq_path) {
            let t = read_json_file(&hq_path, "quantization config")?;
            Some(parse_config(&hq_path, &t)?)
        } else {
            None
        };

        let index_path = dir.join(INDEX_FILE);
        let mut index = None;
        let mut shards = Vec::new();
        if present(&index_path) {
            let t = read_json_file(&index_path, "index")?;
            let v = crate::input::parse_json(&index_path, &t, "index")?;
            let map = shard::index_map(&index_path, &v)?;
            let mut files: Vec<(&String, &String)> = map.iter().map(|(t, f)| (f, t)).collect();
            files.sort();
            files.dedup_by(|a, b| a.0 == b.0);
            for (f, t) in files {
                let p = dir.join(f);
                if !present(&p) {
                    return Err(Error::bad(
                        &index_path,
                        Some(t),
                        format!(
                            "index names shard `{f}`, which does not exist in {}",
                            dir.display()
                        ),
                    ));
                }
                shards.push(shard::map_file(&p)?);
            }
            index = Some((index_path, map));
        } else if present(&dir.join("model.safetensors")) {
            shards.push(shard::map_file(&dir.join("model.safetensors"))?);
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            for p in files {
                shards.push(shard::map_file(&p)?);
            }
        }
        if shards.is_empty() {
            return Err(Error::bad(
                dir,
                None,
                "no model.safetensors, index or *.safetensors file",
            ));
        }
        let ck = Self::assemble(
            dir.to_path_buf(),
            config_path,
            config,
            hf_quant,
            shards,
            index,
        )?;
        crate::output::test_hold("mapped");
        Ok(ck)
    }

    /// The same over in-memory safetensors buffers (`name → bytes`); an entry named
    /// `model.safetensors.index.json` is read as the index. Location is `<built-in>`.
    pub fn from_memory(config_json: &str, files: Vec<(String, Vec<u8>)>) -> Result<Checkpoint> {
        let loc = PathBuf::from(BUILTIN);
        let config_path = loc.join("config.json");
        let config = parse_config(&config_path, config_json)?;
        let mut shards = Vec::new();
        let mut index = None;
        for (name, bytes) in files {
            let p = loc.join(&name);
            if name == INDEX_FILE {
                let text = std::str::from_utf8(&bytes)
                    .map_err(|e| Error::bad(&p, None, format!("index is not UTF-8: {e}")))?;
                let v = crate::input::parse_json(&p, text, "index")?;
                index = Some((p.clone(), shard::index_map(&p, &v)?));
            } else {
                if bytes.len() < 8 {
                    return Err(Error::bad(
                        &p,
                        None,
                        format!("{} bytes, too short for a safetensors header", bytes.len()),
                    ));
                }
                shards.push(shard::mem_shard(p, bytes));
            }
        }
        if let Some((ip, map)) = &index {
            for (t, f) in map {
                if !shards
                    .iter()
                    .any(|s| s.path.file_name().is_some_and(|n| n == f.as_str()))
                {
                    return Err(Error::bad(
                        ip,
                        Some(t),
                        format!("index names shard `{f}`, which was not given"),
                    ));
                }
            }
        }
        if shards.is_empty() {
            return Err(Error::bad(&loc, None, "no safetensors buffers given"));
        }
        Self::assemble(loc, config_path, config, None, shards, index)
    }

    fn assemble(
        location: PathBuf,
        config_path: PathBuf,
        config: serde_json::Value,
        hf_quant: Option<serde_json::Value>,
        shards: Vec<Shard>,
        index: Option<(PathBuf, HashMap<String, String>)>,
    ) -> Result<Checkpoint> {
        let mut raw: HashMap<String, RawEntry> = HashMap::new();
        for (i, s) in shards.iter().enumerate() {
            for (name, e) in shard::parse(i, s)? {
                if let Some(prev) = raw.get(&name) {
                    return Err(Error::bad(
                        &s.path,
                        Some(&name),
                        format!(
                            "tensor also stored in {}",
                            shards[prev.shard].path.display()
                        ),
                    ));
                }
                raw.insert(name, e);
            }
        }
        if let Some((ip, map)) = &index {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort();
            for (t, f) in entries {
                let in_shard = raw.get(t).is_some_and(|e| {
                    shards[e.shard]
                        .path
                        .file_name()
                        .is_some_and(|n| n == f.as_str())
                });
                if !in_shard {
                    return Err(Error::bad(
                        ip,
                        Some(t),
                        format!("index places this tensor in shard `{f}`, whose header does not contain it"),
                    ));
                }
            }
            // the other way round: engines load by the index, so a tensor it omits is not loaded
            let mut unlisted: Vec<(&String, &RawEntry)> =
                raw.iter().filter(|(t, _)| !map.contains_key(*t)).collect();
            unlisted.sort_by(|a, b| a.0.cmp(b.0));
            if let Some((t, e)) = unlisted.first() {
                return Err(Error::bad(
                    ip,
                    Some(t),
                    format!(
                        "shard {} holds this tensor but the index does not list it{} (engines load by the index and would not see it)",
                        shards[e.shard].path.display(),
                        if unlisted.len() > 1 {
                            format!(", nor {} other tensor(s)", unlisted.len() - 1)
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
        }
        let naming = naming::detect(raw.keys().map(String::as_str));
        // the family decides how its fused expert tensors are laid out (same names, other layouts)
        let layout = match crate::model::family::detect(&config) {
            Some(k) if k.interleaved_experts() => naming::FusedLayout::Interleaved,
            _ => naming::FusedLayout::Stacked,
        };
        if layout == naming::FusedLayout::Interleaved {
            experts::check_mixed_experts(&raw, &shards)?;
        }
        let mut canon: HashMap<String, Source> = HashMap::new();
        let mut raw_to_canon = HashMap::new();
        let mut names: Vec<&String> = raw.keys().collect();
        names.sort_by_cached_key(|n| naming::natural_key(n));
        let mut insert = |c: String, src: Source, raw_name: &str, file: &Path| -> Result<()> {
            if let Some(prev) = canon.get(&c) {
                let p = match prev {
                    Source::Whole(r) | Source::Slice { raw: r, .. } => r.clone(),
                };
                return Err(Error::bad(
                    file,
                    Some(raw_name),
                    format!("maps to canonical `{c}`, as does `{p}`: ambiguous naming"),
                ));
            }
            canon.insert(c, src);
            Ok(())
        };
        for name in names {
            let e = &raw[name];
            let file = &shards[e.shard].path;
            match naming::canonical_in(name, naming, layout) {
                Canon::Plain(c) => {
                    raw_to_canon.insert(name.clone(), c.clone());
                    insert(c, Source::Whole(name.clone()), name, file)?;
                }
                Canon::Fused { prefix, gate_up } => {
                    for (c, src) in experts::stacked(name, e, file, &prefix, gate_up)? {
                        insert(c, src, name, file)?;
                    }
                }
                Canon::PerExpert { prefix, leaf, part } => {
                    // a scale shared by the projection's experts counts them by its fused weight
                    let fused_weight = ["gate_up_proj", "down_proj"].iter().find_map(|p| {
                        let at = name.rfind(p)? + p.len();
                        raw.get(&name[..at]).and_then(|w| w.shape.first().copied())
                    });
                    for (c, src) in
                        experts::per_expert(name, e, file, &prefix, &leaf, part, fused_weight)?
                    {
                        insert(c, src, name, file)?;
                    }
                }
            }
        }
        Ok(Checkpoint {
            location,
            config_path,
            config,
            hf_quant,
            model_config: OnceLock::new(),
            shards,
            raw,
            canon,
            raw_to_canon,
            naming,
            bytes_read: AtomicU64::new(0),
            meta_cache: Default::default(),
        })
    }

    pub fn config_json(&self) -> &serde_json::Value {
        &self.config
    }

    /// `hf_quant_config.json` when the directory has one.
    pub fn hf_quant_config(&self) -> Option<&serde_json::Value> {
        self.hf_quant.as_ref()
    }

    /// The parsed model config (parsed on first use; errors name config.json).
    pub fn model_config(&self) -> Result<&ModelConfig> {
        let r = self.model_config.get_or_init(|| {
            let mut cfg = ModelConfig::from_json(&self.config).map_err(|e| match e {
                Error::Usage(m) => m,
                other => other.to_string(),
            })?;
            // gpt-oss's experts as separate linears (`check_mixed_experts` refused a mix)
            if let Some(f) = cfg.family.as_mut() {
                f.note_expert_names(self.canon.keys().map(String::as_str));
            }
            Ok(cfg)
        });
        r.as_ref()
            .map_err(|m| Error::bad(&self.config_path, None, m.clone()))
    }

    pub fn location(&self) -> &Path {
        &self.location
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn naming(&self) -> Naming {
        self.naming
    }

    /// Raw tensor names in natural order.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.raw.keys().cloned().collect();
        v.sort_by_cached_key(|n| naming::natural_key(n));
        v
    }

    /// Canonical tensor names in natural order (HF fused experts expanded per expert).
    pub fn canonical_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.canon.keys().cloned().collect();
        v.sort_by_cached_key(|n| naming::natural_key(n));
        v
    }

    pub fn info(&self, raw: &str) -> Option<TensorInfo> {
        let e = self.raw.get(raw)?;
        Some(TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
            file: self.shards[e.shard].path.clone(),
        })
    }

    /// Header facts of a canonical tensor; for a fused-expert slice, the slice's own shape.
    pub fn canonical_info(&self, canonical: &str) -> Option<TensorInfo> {
        match self.canon.get(canonical)? {
            Source::Whole(r) => self.info(r),
            Source::Slice { raw, part, .. } => {
                let mut i = self.info(raw)?;
                i.shape = experts::shape(&i.shape, *part);
                Some(i)
            }
        }
    }

    /// The file holding a canonical tensor or weight (`base`, `base.weight`, `base.weight_packed`),
    /// for errors found after loading (a parameter of the wrong size): the checkpoint's location
    /// when no tensor of that name is stored.
    pub fn file_of(&self, name: &str) -> PathBuf {
        [
            name.to_string(),
            format!("{name}.weight"),
            format!("{name}.weight_packed"),
        ]
        .iter()
        .find_map(|n| self.canonical_info(n).or_else(|| self.info(n)))
        .map(|i| i.file)
        .unwrap_or_else(|| self.location.clone())
    }

    /// Raw name of a canonical tensor. For an HF fused-expert slice this is the fused tensor.
    pub fn resolve(&self, canonical: &str) -> Option<String> {
        match self.canon.get(canonical)? {
            Source::Whole(r) | Source::Slice { raw: r, .. } => Some(r.clone()),
        }
    }

    /// Canonical name of a raw tensor (None for fused expert tensors, which have many).
    pub fn canonical_of(&self, raw: &str) -> Option<&str> {
        self.raw_to_canon.get(raw).map(String::as_str)
    }

    /// Human-readable raw location of a canonical tensor, e.g. `…gate_up_proj[5, 0..2048]`.
    pub fn raw_label(&self, canonical: &str) -> Option<String> {
        match self.canon.get(canonical)? {
            Source::Whole(r) => Some(r.clone()),
            Source::Slice { raw, expert, part } => {
                Some(experts::label(raw, &self.raw[raw].shape, *expert, *part))
            }
        }
    }

    /// Count bytes read outside [`Checkpoint::bytes`] (backends that read spans themselves).
    pub fn note_read(&self, n: usize) {
        self.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Bytes of a raw tensor, zero-copy from the mmap.
    pub fn bytes(&self, raw: &str) -> Result<&[u8]> {
        let e = self.raw.get(raw).ok_or_else(|| self.missing(raw, ""))?;
        let shard = &self.shards[e.shard];
        shard.prefetch(e.start, e.end - e.start);
        let b = &shard.buf()[e.start..e.end];
        self.note_read(b.len());
        Ok(b)
    }

    /// Whether a canonical tensor is stored as its transpose (gpt-oss's BF16 fused experts,
    /// [in, out]): its bytes ([`Checkpoint::canonical_bytes`]) are in that stored order, while
    /// [`Checkpoint::canonical_info`], [`Checkpoint::tensor_f32`] and `weight` give [out, in].
    /// Byte tensors stored transposed (ModelOpt's NVFP4 experts of gpt-oss) are not: their
    /// bytes come transposed back to [out, in/2] ([`Checkpoint::canonical_bytes`]).
    pub fn stored_transposed(&self, canonical: &str) -> bool {
        match self.canon.get(canonical) {
            Some(Source::Slice {
                raw,
                part: FusedPart::Transposed,
                ..
            }) => convert::elem_size(self.raw[raw].dtype) != Some(1),
            _ => false,
        }
    }

    /// The [rows, cols] a byte tensor stored transposed per expert has as stored ([in/2, out]),
    /// None for every other tensor (its bytes are canonical as stored).
    fn byte_transposed(&self, canonical: &str) -> Option<(usize, usize)> {
        match self.canon.get(canonical)? {
            Source::Slice {
                raw,
                part: FusedPart::Transposed,
                ..
            } => {
                let e = &self.raw[raw];
                (convert::elem_size(e.dtype) == Some(1)).then(|| (e.shape[1], e.shape[2]))
            }
            _ => None,
        }
    }

    /// Bytes of a canonical tensor; a fused-expert slice touches only that expert's rows. As
    /// stored (borrowed from the mapping), but for byte tensors stored transposed per expert,
    /// which come as a transposed copy in canonical order.
    pub fn canonical_bytes(&self, canonical: &str) -> Result<Cow<'_, [u8]>> {
        let (shard_i, start, len) = self.locate(canonical)?;
        let shard = &self.shards[shard_i];
        shard.prefetch(start, len);
        let b = &shard.buf()[start..start + len];
        self.note_read(b.len());
        Ok(match self.byte_transposed(canonical) {
            Some((rows, cols)) => Cow::Owned(experts::transpose(b, rows, cols)),
            None => Cow::Borrowed(b),
        })
    }

    /// (shard, byte offset, length) of a canonical tensor; a fused-expert slice is that expert's
    /// part of the fused tensor. Checks the range lies inside the file.
    fn locate(&self, canonical: &str) -> Result<(usize, usize, usize)> {
        let (shard_i, start, len) = match self
            .canon
            .get(canonical)
            .ok_or_else(|| self.missing(canonical, ""))?
        {
            Source::Whole(r) => {
                let e = self.raw.get(r).ok_or_else(|| self.missing(r, ""))?;
                (e.shard, e.start, e.end - e.start)
            }
            Source::Slice { raw, expert, part } => {
                let e = &self.raw[raw];
                let es = convert::elem_size(e.dtype).unwrap_or(1);
                let (off, len) = experts::bytes(&e.shape, es, *expert, *part);
                (e.shard, e.start + off, len)
            }
        };
        let shard = &self.shards[shard_i];
        if start + len > shard.buf().len() {
            return Err(Error::bad(
                &shard.path,
                Some(canonical),
                format!(
                    "data range {start}..{} lies past the end of the file ({} bytes)",
                    start + len,
                    shard.buf().len()
                ),
            ));
        }
        Ok((shard_i, start, len))
    }

    /// Where a canonical tensor's bytes lie, without touching them: a file range for mapped
    /// shards (backends read it with large positioned reads, which get the kernel's readahead
    /// where page faults on the mapping would not), the bytes themselves for in-memory shards.
    pub fn canonical_span(&self, canonical: &str) -> Result<Span<'_>> {
        if self.byte_transposed(canonical).is_some() {
            return Ok(Span::Mem(self.canonical_bytes(canonical)?));
        }
        let (shard_i, start, len) = self.locate(canonical)?;
        let shard = &self.shards[shard_i];
        Ok(if shard.is_mapped() {
            Span::File {
                path: &shard.path,
                offset: start as u64,
                len,
            }
        } else {
            Span::Mem(Cow::Borrowed(&shard.buf()[start..start + len]))
        })
    }

    /// Ask the kernel to start reading a tensor's bytes into the page cache, without waiting
    /// (MADV_WILLNEED on the mapping: asynchronous readahead of the whole range). Returns the
    /// length asked for; 0 for in-memory shards.
    pub fn readahead(&self, canonical: &str) -> usize {
        match self.locate(canonical) {
            Ok((shard_i, start, len)) if self.shards[shard_i].is_mapped() => {
                self.shards[shard_i].readahead(start, len);
                len
            }
            _ => 0,
        }
    }

    /// A canonical tensor as f32 with its shape (any numeric dtype; see `convert`).
    pub fn tensor_f32(&self, canonical: &str) -> Result<Tensor> {
        let info = self
            .canonical_info(canonical)
            .ok_or_else(|| self.missing(canonical, ""))?;
        let raw = self.resolve(canonical).unwrap_or_default();
        if !convert::supported(info.dtype) {
            return Err(Error::bad(
                &info.file,
                Some(&raw),
                format!("dtype {:?} cannot be read as numbers", info.dtype),
            ));
        }
        let mut data = convert::to_f32(
            &self.canonical_bytes(canonical)?,
            info.dtype,
            &info.file,
            &raw,
        )?;
        if self.stored_transposed(canonical) {
            data = experts::transpose(&data, info.shape[1], info.shape[0]);
        }
        Ok(Tensor::new(info.shape, data))
    }

    /// Total bytes of tensor data handed out since open.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    pub(crate) fn missing(&self, tensor: &str, hint: impl Into<String>) -> Error {
        Error::MissingTensor {
            dir: self.location.clone(),
            tensor: tensor.to_string(),
            hint: hint.into(),
        }
    }

    /// The quantization config: `quantization_config` of config.json, else
    /// `hf_quant_config.json`'s `quantization` object.
    pub fn quantization_config(&self) -> Option<&serde_json::Value> {
        self.config
            .get("quantization_config")
            .filter(|v| v.is_object())
            .or_else(|| {
                self.hf_quant
                    .as_ref()
                    .and_then(|h| h.get("quantization"))
                    .filter(|v| v.is_object())
            })
    }
}
