//! Weights on the device: the stored bytes of the current op's weights (read through the pinned
//! staging buffers, batched ahead by `preload`, or taken from the loader thread's staged copies),
//! the per-op weight cache, and their dequantization for each path.

use super::*;
use crate::checkpoint::formats::{Block, Elem, Global, ScaleCode, Served};
use crate::checkpoint::Scheme;

/// The weight as stored, resident on the device for the current op.
pub(super) enum DevFmt {
    Dense(Buf),
    Fp8 {
        bytes: Buf,
        scales: Buf,
        bm: usize,
        bn: usize,
    },
    Mx {
        packed: Buf,
        scales: Buf,
    },
    Nv {
        packed: Buf,
        scales: Buf,
        conv: Convention,
        global: f32,
    },
    /// A format read through the format table: its codes and byte block scales as stored,
    /// decoded by `dequant_blocked` as its `Decode` says.
    Blocked {
        codes: Buf,
        scales: Buf,
        scheme: Scheme,
    },
}

impl DevFmt {
    /// How the served path computes with the weight (the format table's `served`).
    pub(super) fn served(&self) -> Served {
        match self {
            DevFmt::Dense(_) => Served::Dense,
            DevFmt::Fp8 { .. } | DevFmt::Mx { .. } => Served::Fp8Act,
            DevFmt::Nv { .. } => Served::Nvfp4,
            DevFmt::Blocked { scheme, .. } => scheme.spec().served,
        }
    }
}

pub(super) struct DevWeight {
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) fmt: DevFmt,
    pub(super) served: ServedDev,
    /// What the served reading was computed from ([`served_key`]): a later call with other
    /// faults or hypotheses for this base recomputes the served reading and keeps the bytes.
    /// None: installed by [`Gpu::pin_nvfp4_served`], kept until [`Gpu::forget_served`].
    pub(super) served_key: Option<String>,
    /// The activation its family's engines give an exact-served weight (FP8 block, MXFP4) per
    /// profile.
    pub(super) recipe: crate::served::ExactRecipe,
}

impl Gpu {
    /// Drop the weights of the finished op (device memory stays bounded by one op's weights).
    pub fn clear_weights(&mut self) {
        self.weights.clear();
        self.preloaded.clear();
        self.prepared.clear();
    }

    pub(super) fn ensure_weight(&mut self, lc: &LinearCtx, base: &str) -> Result<()> {
        let _s = crate::profile::span("host: ensure_weight");
        let key = {
            let _s = crate::profile::span("host: ensure_weight served_key");
            served_key(lc, base)
        };
        if let Some(w) = self.weights.get(base) {
            if w.served_key.as_ref().is_none_or(|k| *k == key) {
                return Ok(());
            }
            // the bytes stay; only the served reading follows the new faults/hypotheses
            let lay = {
                let _s = crate::profile::span("host: ensure_weight layout");
                lc.ckpt.weight_layout(base)?
            };
            let _s = crate::profile::span("host: ensure_weight re-read served");
            let served = self.served_reading(lc, base, &lay)?;
            let w = self.weights.get_mut(base).expect("present above");
            w.served = served;
            w.served_key = Some(key);
            return Ok(());
        }
        let lay = lc.ckpt.weight_layout(base)?;
        let m = &lay.meta;
        let (n, k) = (m.out_features, m.in_features);
        let loc = m.file.clone();
        let bad = |what: &str, got: usize, want: usize| {
            Error::bad(
                &loc,
                Some(base),
                format!("{what} has {got} bytes/elements, expected {want} for [{n}, {k}]"),
            )
        };
        let span = |name: &str| lc.ckpt.canonical_span(name);
        let scale_name = || {
            lay.scale.clone().ok_or_else(|| {
                Error::bad(
                    &loc,
                    Some(base),
                    "quantized weight without a block-scale tensor",
                )
            })
        };
        use crate::checkpoint::{Dtype, Fp8ScaleKind};
        let fmt = match m.scheme {
            Scheme::Dense => {
                let es = match m.weight_dtype {
                    Dtype::BF16 | Dtype::F16 => 2,
                    Dtype::F32 => 4,
                    _ => 0,
                };
                // stored transposed (gpt-oss's fused BF16 experts, [in, out]): the host reads it
                // as [out, in] (`Checkpoint::tensor_f32`), the raw bytes would be the transpose
                if es == 0 || lc.ckpt.stored_transposed(&lay.weight) {
                    let v = lc.ckpt.tensor_f32(&lay.weight)?.data;
                    if v.len() != n * k {
                        return Err(bad("weight", v.len(), n * k));
                    }
                    DevFmt::Dense(self.upload(&v)?)
                } else {
                    let sp = span(&lay.weight)?;
                    if sp.len() != n * k * es {
                        return Err(bad("weight", sp.len() / es, n * k));
                    }
                    let raw = self.upload_span(lc.ckpt, &sp)?;
                    if es == 4 {
                        DevFmt::Dense(raw)
                    } else {
                        let f = self.alloc(n * k * 4)?;
                        let fmt = if m.weight_dtype == Dtype::BF16 { 3 } else { 4 };
                        self.kern().decode_bytes(
                            (n * k) as u64,
                            raw.ptr,
                            (n * k) as u64,
                            fmt,
                            f.ptr,
                        )?;
                        DevFmt::Dense(f)
                    }
                }
            }
            Scheme::Fp8Block => {
                let block = m.block.unwrap_or([128, 128]);
                let sc = scale_name()?;
                let scales: Vec<f32> = match m.fp8_scale_kind.unwrap_or(Fp8ScaleKind::F32) {
                    Fp8ScaleKind::Ue8m0 => lc
                        .ckpt
                        .canonical_bytes(&sc)?
                        .iter()
                        .map(|&b| crate::numerics::ue8m0::decode(b))
                        .collect(),
                    Fp8ScaleKind::F32 => lc.ckpt.tensor_f32(&sc)?.data.into_vec(),
                };
                let ns = n.div_ceil(block[0].max(1)) * k.div_ceil(block[1].max(1));
                let sp = span(&lay.weight)?;
                if sp.len() != n * k {
                    return Err(bad("weight", sp.len(), n * k));
                }
                if scales.len() != ns || block[0] == 0 || block[1] == 0 {
                    return Err(bad("block scale", scales.len(), ns));
                }
                DevFmt::Fp8 {
                    bytes: self.upload_span(lc.ckpt, &sp)?,
                    scales: self.upload(&scales)?,
                    bm: block[0],
                    bn: block[1],
                }
            }
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt => {
                let bl = if m.convention.is_some() { 16 } else { 32 };
                let (wp, sp) = (span(&lay.weight)?, span(&scale_name()?)?);
                if k % bl != 0 || wp.len() != n * k / 2 {
                    return Err(bad("packed weight", wp.len(), n * k / 2));
                }
                if sp.len() != n * k / bl {
                    return Err(bad("block scale", sp.len(), n * k / bl));
                }
                let packed = self.upload_span(lc.ckpt, &wp)?;
                let scales = self.upload_span(lc.ckpt, &sp)?;
                match m.convention {
                    Some(conv) => DevFmt::Nv {
                        packed,
                        scales,
                        conv,
                        global: m.weight_global.unwrap_or(f32::NAN),
                    },
                    None => DevFmt::Mx { packed, scales },
                }
            }
            // every format read through the table: codes and block-scale bytes as stored
            scheme => {
                let d = scheme
                    .spec()
                    .decode
                    .ok_or_else(|| Error::usage(format!("internal: {base}: no decode")))?;
                let bn = match d.block {
                    Block::Row(bn) => bn,
                    Block::Grid => 0,
                };
                let nc = n * k / d.elem.per_byte();
                let (wp, sp) = (span(&lay.weight)?, span(&scale_name()?)?);
                if bn == 0 || k % bn != 0 || wp.len() != nc {
                    return Err(bad("weight", wp.len(), nc));
                }
                if sp.len() != n * k / bn {
                    return Err(bad("block scale", sp.len(), n * k / bn));
                }
                DevFmt::Blocked {
                    codes: self.upload_span(lc.ckpt, &wp)?,
                    scales: self.upload_span(lc.ckpt, &sp)?,
                    scheme,
                }
            }
        };
        let served = self.served_reading(lc, base, &lay)?;
        self.weights.insert(
            base.to_string(),
            DevWeight {
                n,
                k,
                fmt,
                served,
                served_key: Some(key),
                recipe: crate::served::ExactRecipe::in_checkpoint(lc.ckpt, m.scheme),
            },
        );
        Ok(())
    }

    /// The stored tensors `ensure_weight` uploads for a weight, as (file, offset, length): the
    /// data of a BF16/F16/F32 dense weight, the bytes of an FP8 block weight (its scales are read
    /// on the host), the codes and block scales of an NVFP4/MXFP4 weight. Empty for a name that
    /// is not a weight, or a tensor in memory.
    pub fn staged_spans(ckpt: &Checkpoint, base: &str) -> Vec<(std::path::PathBuf, u64, usize)> {
        use crate::checkpoint::{Dtype, Span};
        let Ok(l) = ckpt.weight_layout(base) else {
            return Vec::new();
        };
        let names: Vec<&String> = match l.meta.scheme {
            // read through the host (transposed there), never as staged bytes
            Scheme::Dense if ckpt.stored_transposed(&l.weight) => Vec::new(),
            Scheme::Dense => match l.meta.weight_dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => vec![&l.weight],
                _ => Vec::new(),
            },
            Scheme::Fp8Block => vec![&l.weight],
            // the packed formats and every format of the table: codes and block scales
            _ => std::iter::once(&l.weight).chain(l.scale.as_ref()).collect(),
        };
        names
            .into_iter()
            .filter_map(|n| match ckpt.canonical_span(n) {
                Ok(Span::File { path, offset, len }) => Some((path.to_path_buf(), offset, len)),
                _ => None,
            })
            .collect()
    }

    /// The loader's device copy of a stored tensor, if it staged it (the compute stream then
    /// waits for that copy); `None`: read it here (the loader will not).
    fn take_staged(&mut self, key: &(std::path::PathBuf, u64)) -> Result<Option<Buf>> {
        let Some(st) = &self.stager else {
            return Ok(None);
        };
        let b = st.take(key)?;
        if let Some(b) = &b {
            self.counters.bytes_uploaded += b.bytes as u64;
        }
        Ok(b)
    }

    /// Read the stored tensors of many weights in batches: all their file ranges are read in
    /// parallel into pinned memory (one 256 MiB batch while the previous one is in flight), then
    /// copied to the device; `ensure_weight` then finds them in `preloaded`.
    pub fn preload(&mut self, ckpt: &Checkpoint, bases: &[&str]) -> Result<()> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        let t0 = Instant::now();
        let mut spans: Vec<(std::path::PathBuf, u64, usize)> = Vec::new();
        for b in bases {
            if self.weights.contains_key(*b) {
                continue;
            }
            // (a weight that does not resolve has no spans: ensure_weight reports it)
            for (path, offset, len) in Self::staged_spans(ckpt, b) {
                let key = (path, offset);
                if len <= self.stage_len() && !self.preloaded.contains_key(&key) {
                    if let Some(b) = self.take_staged(&key)? {
                        self.preloaded.insert(key, b);
                        continue;
                    }
                    spans.push((key.0, offset, len));
                }
            }
        }
        for (p, _, _) in &spans {
            if !self.files.contains_key(p) {
                let f = std::fs::File::open(p)
                    .map_err(|e| Error::bad(p, None, format!("cannot open shard: {e}")))?;
                self.files.insert(p.clone(), f);
            }
        }
        let mut i = 0;
        let mut ci = 0usize;
        while i < spans.len() {
            let mut j = i;
            let mut tot = 0usize;
            while j < spans.len() && tot + spans[j].2 <= self.stage_len() {
                tot += spans[j].2;
                j += 1;
            }
            let batch = &spans[i..j];
            let (p, _, ev) = &self.pinned[ci % 2];
            {
                let _s = crate::profile::span("host: preload wait");
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            let base = *p as usize;
            let _s = crate::profile::span("host: preload read");
            // pieces of at most 4 MiB: (span index, offset in file, offset in pinned, length)
            let mut pieces = Vec::new();
            let mut at = 0usize;
            for (si, (_, off, len)) in batch.iter().enumerate() {
                let mut d = 0;
                while d < *len {
                    let n = (4 << 20).min(len - d);
                    pieces.push((si, off + d as u64, at + d, n));
                    d += n;
                }
                at += len;
            }
            let files = &self.files;
            pieces.par_iter().try_for_each(|&(si, foff, poff, n)| {
                // disjoint ranges of the pinned buffer
                let dst = unsafe { std::slice::from_raw_parts_mut((base + poff) as *mut u8, n) };
                files[&batch[si].0].read_exact_at(dst, foff).map_err(|e| {
                    Error::bad(
                        &batch[si].0,
                        None,
                        format!("read of bytes {foff}..{} failed: {e}", foff + n as u64),
                    )
                })
            })?;
            drop(_s);
            // the whole batch in one DMA into one allocation, which its tensors then share
            // (thousands of per-tensor copies ran at half the bus's rate)
            let arena = self.alloc(tot)?;
            let src = unsafe { std::slice::from_raw_parts(base as *const u8, tot) };
            self.timed("copy host->device (weights, batched)", || {
                unsafe { dres::memcpy_htod_async(arena.ptr, src, self.stream.cu_stream()) }
                    .map_err(|e| cuda_err("copy to device", e))
            })?;
            let mut at = 0usize;
            for (path, off, len) in batch {
                ckpt.note_read(*len);
                self.counters.bytes_uploaded += *len as u64;
                let piece = Buf {
                    _s: arena._s.clone(),
                    ptr: arena.ptr + at as u64,
                    bytes: *len,
                };
                self.preloaded.insert((path.clone(), *off), piece);
                at += len;
            }
            self.pinned[ci % 2]
                .2
                .record(&self.stream)
                .map_err(|e| cuda_err("event", e))?;
            ci += 1;
            i = j;
        }
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Read a tensor's bytes onto the device: file ranges with parallel positioned reads into
    /// pinned memory (overlapping the previous chunk's DMA), in-memory shards by copy.
    fn upload_span(&mut self, ckpt: &Checkpoint, sp: &crate::checkpoint::Span) -> Result<Buf> {
        use crate::checkpoint::Span;
        let _s = crate::profile::span("host: upload_span");
        let (path, offset, len) = match sp {
            Span::Mem(b) => {
                ckpt.note_read(b.len());
                return self.upload_staged(b);
            }
            Span::File { path, offset, len } => (*path, *offset, *len),
        };
        if let Some(b) = self.preloaded.remove(&(path.to_path_buf(), offset)) {
            return Ok(b);
        }
        if let Some(b) = self.take_staged(&(path.to_path_buf(), offset))? {
            return Ok(b);
        }
        let t0 = Instant::now();
        ckpt.note_read(len);
        if !self.files.contains_key(path) {
            let f = std::fs::File::open(path)
                .map_err(|e| Error::bad(path, None, format!("cannot open shard: {e}")))?;
            self.files.insert(path.to_path_buf(), f);
        }
        let file = &self.files[path];
        let b = self.alloc(len)?;
        let mut done = 0usize;
        let mut ci = 0usize;
        while done < len {
            let n = self.stage_len().min(len - done);
            let (p, _, ev) = &self.pinned[ci % 2];
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            let dst = unsafe { std::slice::from_raw_parts_mut(*p, n) };
            use rayon::prelude::*;
            use std::os::unix::fs::FileExt;
            let base_off = offset + done as u64;
            dst.par_chunks_mut(4 << 20)
                .enumerate()
                .try_for_each(|(i, d)| file.read_exact_at(d, base_off + (i * (4 << 20)) as u64))
                .map_err(|e| {
                    Error::bad(
                        path,
                        None,
                        format!(
                            "read of bytes {base_off}..{} failed: {e}",
                            base_off + n as u64
                        ),
                    )
                })?;
            self.timed("copy host->device (weights)", || {
                unsafe {
                    dres::memcpy_htod_async(b.ptr + done as u64, &dst[..], self.stream.cu_stream())
                }
                .map_err(|e| cuda_err("copy to device", e))
            })?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
            done += n;
            ci += 1;
        }
        self.counters.bytes_uploaded += len as u64;
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(b)
    }

    /// Dequantize the stored weight into `out` (`Ty::F32` values or BF16 bits).
    /// `conv_override`: for NVFP4, 2 = e2m1·s without the tensor scale (the served operand).
    /// `round`: round f32 output to BF16 values. `post`: a multiplier applied after decoding.
    pub(super) fn dequant(
        &self,
        w: &DevWeight,
        out: u64,
        out_ty: Ty,
        served_operand: bool,
        round: bool,
        post: Option<f32>,
    ) -> Result<()> {
        let ok = if out_ty == Ty::Bf16 { 1 } else { 0 };
        let nk = (w.n * w.k) as u64;
        // (nibble swap, double-applied FP8 scale, NVFP4 block scales other than the stored ones):
        // the served reading's loader faults and repairs
        let flags = match &w.served {
            ServedDev::Native {
                swap,
                double_scale,
                scales,
                ..
            } => (*swap, *double_scale, scales.as_ref().map(|(b, _)| b.ptr)),
            ServedDev::Host { .. } => (false, false, None),
        };
        match &w.fmt {
            DevFmt::Dense(b) => self
                .kern()
                .convert_dense(nk, b.ptr, nk, round as i32, ok, out)?,
            DevFmt::Fp8 {
                bytes,
                scales,
                bm,
                bn,
            } => self.kern().dequant_fp8_block(
                nk,
                bytes.ptr,
                scales.ptr,
                w.n as u64,
                w.k as u64,
                *bm as u64,
                *bn as u64,
                (served_operand && flags.1) as i32,
                ok,
                out,
            )?,
            DevFmt::Mx { packed, scales } => {
                self.kern()
                    .dequant_mxfp4(nk / 32, packed.ptr, scales.ptr, nk / 32, ok, out)?
            }
            DevFmt::Nv {
                packed,
                scales,
                conv,
                global,
            } => {
                let c = if served_operand {
                    2
                } else {
                    match conv {
                        Convention::CompressedTensors => 0,
                        Convention::ModelOpt => 1,
                    }
                };
                let sp = match flags.2 {
                    Some(p) if served_operand => p,
                    _ => scales.ptr,
                };
                self.dequant_nvfp4(
                    packed.ptr,
                    sp,
                    nk / 16,
                    Nvfp4Decode {
                        global: *global,
                        conv: c,
                        post,
                        swap: served_operand && flags.0,
                        out_bf16: ok == 1,
                    },
                    out,
                )?
            }
            DevFmt::Blocked {
                codes,
                scales,
                scheme,
            } => {
                let d = scheme
                    .spec()
                    .decode
                    .ok_or_else(|| Error::usage("internal: a table format without a decode"))?;
                let (bm, bn) = match d.block {
                    Block::Row(bn) => (1, bn),
                    Block::Grid => (0, 0),
                };
                self.kern().dequant_blocked(
                    nk,
                    codes.ptr,
                    match d.elem {
                        Elem::E4m3 => 0,
                        Elem::E2m1Packed => 1,
                    },
                    scales.ptr,
                    match d.scale {
                        ScaleCode::E4m3 => 0,
                        ScaleCode::Ue8m0 => 1,
                        ScaleCode::F32 => 2,
                    },
                    w.n as u64,
                    w.k as u64,
                    bm,
                    bn as u64,
                    match d.global {
                        Global::None => 0,
                        Global::Divide => 1,
                        Global::Multiply => 2,
                    },
                    1.0,
                    ok,
                    out,
                )?
            }
        }
        // BF16 bits are already rounded; f32 output is rounded here when asked
        if round && out_ty == Ty::F32 && !matches!(w.fmt, DevFmt::Dense(_)) {
            self.kern().round_bf16(nk, out, out, nk, 0)?;
        }
        Ok(())
    }
}
