//! How the served path reads a resident weight: NVFP4 scalars as the loader resolves them under
//! the run's faults and hypotheses, nibble order, rearranged block scales (computed in parallel for
//! many experts ahead of use), or a reading prepared on the host; pinned readings for bisect.

use super::*;

/// How the served path computes with a weight.
pub(super) enum ServedDev {
    /// From the stored bytes: NVFP4 scalars as the loader resolved them (scalar loader faults and
    /// hypotheses applied), nibble order, FP8 activation-scale and double-scale faults as flags.
    Native {
        nv: Option<Nvfp4Params>,
        swap: bool,
        non_pow2: bool,
        double_scale: bool,
        /// NVFP4 block-scale bytes the served reading decodes with instead of the stored ones
        /// (layout faults and repairs, bisect's re-read stored scales), linear [n, k/16], and
        /// what they were computed from (reused while that stays the same).
        scales: Option<(Buf, String)>,
    },
    /// Prepared on the host (a loader fault or a bisect hypothesis touches this weight).
    Host {
        w: Buf,
        nv: Option<Nvfp4Params>,
        fp8_act: bool,
        non_pow2: bool,
        dense: bool,
    },
}

/// What an NVFP4 weight's rearranged block scales depend on: its layout faults and repairs.
fn layout_key(faults: &[&Fault], overrides: &[Override]) -> String {
    let f: Vec<_> = faults
        .iter()
        .map(|f| f.kind)
        .filter(|&k| served::is_layout_fault(k))
        .collect();
    let o: Vec<&Override> = overrides
        .iter()
        .filter(|o| served::is_layout_repair(o))
        .collect();
    format!("{f:?}{o:?}")
}

/// The loader faults, hypotheses and pair fusion that decide a base's served reading.
pub(super) fn served_key(lc: &LinearCtx, base: &str) -> String {
    let faults = crate::served::faults::hitting(lc.faults, base);
    let ovs = served::overrides_of(lc.overrides, base);
    if faults.is_empty() && ovs.is_empty() {
        return if lc.fuse_pairs { "f" } else { "-" }.to_string();
    }
    format!("{}{faults:?}{ovs:?}", lc.fuse_pairs)
}

/// `served::nvfp4_served_bytes`' result: rearranged scale bytes, nibble order, scalars.
pub(super) type PreparedLayout = (Option<Vec<u8>>, bool, Nvfp4Params);

impl Gpu {
    /// Serve an NVFP4 weight from its resident bytes (uploaded now if absent) with `scales` as its
    /// block-scale bytes (linear [n, k/16]; None: the stored ones, ignoring the loader's layout
    /// faults) and this nibble order, the scalars resolved from `lc` (faults and hypotheses). Stays
    /// until [`Gpu::forget_served`] or [`Gpu::clear_weights`], whatever later contexts say: bisect's
    /// replay uses it for repairs no `Override` expresses (block scales re-read from the checkpoint).
    pub fn pin_nvfp4_served(
        &mut self,
        lc: &LinearCtx,
        base: &str,
        scales: Option<&[u8]>,
        swap: bool,
    ) -> Result<()> {
        // only the bytes are needed: the served reading is replaced below, so a resident weight
        // is not re-read under `lc` (that recomputed each repair's rearranged block scales once
        // more, one weight at a time, after the caller had prepared them in parallel)
        if !self.weights.contains_key(base) {
            self.ensure_weight(lc, base)?;
        }
        let (n, k) = {
            let w = &self.weights[base];
            (w.n, w.k)
        };
        let m = lc.ckpt.weight_meta(base)?;
        let Some(conv) = m
            .convention
            .filter(|_| matches!(self.weights[base].fmt, DevFmt::Nv { .. }))
        else {
            return Err(Error::usage(format!(
                "internal: {base} is not an NVFP4 weight (block scales pinned)"
            )));
        };
        let faults = crate::served::faults::hitting(lc.faults, base);
        let overrides = served::overrides_of(lc.overrides, base);
        let p = served::nvfp4_params_of(lc.ckpt, &m, conv, lc.fuse_pairs, &faults, &overrides);
        let scales = match scales {
            Some(sc) => Some((
                self.upload_scales(sc, base, &m.file, n, k)?,
                String::from("pinned"),
            )),
            None => None,
        };
        let w = self.weights.get_mut(base).expect("ensured above");
        w.served = ServedDev::Native {
            nv: Some(p),
            swap,
            non_pow2: false,
            double_scale: false,
            scales,
        };
        w.served_key = None;
        Ok(())
    }

    /// Upload NVFP4 block-scale bytes for a served reading (at least [n, k/16]).
    fn upload_scales(
        &mut self,
        sc: &[u8],
        base: &str,
        file: &std::path::Path,
        n: usize,
        k: usize,
    ) -> Result<Buf> {
        if sc.len() < n * (k / 16) {
            return Err(Error::bad(
                file,
                Some(base),
                format!(
                    "block scale has {} bytes, expected {} for [{n}, {k}]",
                    sc.len(),
                    n * (k / 16)
                ),
            ));
        }
        self.upload(sc)
    }

    /// Undo [`Gpu::pin_nvfp4_served`]: the next use recomputes the served reading from its context
    /// (the bytes stay resident).
    pub fn forget_served(&mut self, base: &str) {
        if let Some(w) = self.weights.get_mut(base) {
            w.served_key = Some(String::from("\u{0}stale"));
        }
    }

    /// How the served path reads a weight whose bytes are (or are being made) resident: NVFP4
    /// scalars as the loader resolves them with the faults and hypotheses of `lc`, the nibble
    /// order, and for NVFP4 layout faults/repairs the rearranged block-scale bytes (computed on
    /// the host from the scale tensor alone). Prepared on the host in full: non-NVFP4 weights
    /// with layout faults, a `w13` whose rows are re-ordered, MXFP4 blocks read without scales.
    pub(super) fn served_reading(
        &mut self,
        lc: &LinearCtx,
        base: &str,
        lay: &crate::checkpoint::WeightLayout,
    ) -> Result<ServedDev> {
        let m = &lay.meta;
        let (n, k) = (m.out_features, m.in_features);
        use crate::checkpoint::Scheme;
        let sp = crate::profile::span("host: served_reading filter");
        let faults = crate::served::faults::hitting(lc.faults, base);
        let overrides = served::overrides_of(lc.overrides, base);
        drop(sp);
        use crate::served::faults::FaultKind as K;
        let has = |k: K| faults.iter().any(|f| f.kind == k);
        // values the host prepares (`served::prepare`), not the stored bytes: a re-ordered w13,
        // MXFP4 blocks read without their scales, FP8 / MXFP4 block-scale layout faults
        let host = crate::served::faults::needs_host_reading(base, m.scheme, &faults, &overrides);
        let nvfp4 = matches!(
            m.scheme,
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt
        ) && m.convention.is_some()
            && !host;
        if let (true, Some(conv)) = (nvfp4, m.convention) {
            // every NVFP4 layout fault and repair rearranges the scale bytes or the nibble order:
            // the device decodes the resident packed bytes with the rearranged scales. They
            // depend on the layout faults and repairs only: a scalar hypothesis on a weight with
            // a layout fault keeps the bytes it has.
            let lkey = layout_key(&faults, &overrides);
            let reuse = match self.weights.get_mut(base).map(|w| &mut w.served) {
                Some(ServedDev::Native {
                    scales: sc @ Some(_),
                    ..
                }) if sc.as_ref().is_some_and(|(_, k)| *k == lkey) => sc.take(),
                _ => None,
            };
            if let Some(reused) = reuse {
                let _s = crate::profile::span("host: served_reading params (scales reused)");
                let p =
                    served::nvfp4_params_of(lc.ckpt, m, conv, lc.fuse_pairs, &faults, &overrides);
                return Ok(ServedDev::Native {
                    nv: Some(p),
                    swap: has(K::NibbleSwap) ^ overrides.contains(&Override::NibbleSwap),
                    non_pow2: has(K::NonPow2Ue8m0),
                    double_scale: false,
                    scales: Some(reused),
                });
            }
            let _s = crate::profile::span("host: served_reading served bytes");
            let prepared = self.prepared.remove(base);
            let (sc, swap, p) = if let Some(r) = prepared {
                r
            } else {
                served::nvfp4_served_bytes(
                    lc.ckpt,
                    m,
                    conv,
                    lc.fuse_pairs,
                    &faults,
                    &overrides,
                    || {
                        let name = lay.scale.as_deref().ok_or_else(|| {
                            Error::bad(
                                &m.file,
                                Some(base),
                                "quantized weight without a block-scale tensor",
                            )
                        })?;
                        let _s = crate::profile::span("host: served_reading stored scale bytes");
                        Ok(lc.ckpt.canonical_bytes(name)?.to_vec())
                    },
                )?
            };
            let scales = match sc {
                Some(sc) => {
                    let _s = crate::profile::span("host: served_reading upload rearranged scales");
                    Some((self.upload_scales(&sc, base, &m.file, n, k)?, lkey))
                }
                None => None,
            };
            return Ok(ServedDev::Native {
                nv: Some(p),
                swap,
                non_pow2: has(K::NonPow2Ue8m0),
                double_scale: false,
                scales,
            });
        }
        // faults and hypotheses the device applies itself
        let served = if !host {
            let (non_pow2, double_scale) = served::fp8_act_faults(m.scheme, &faults, &overrides);
            ServedDev::Native {
                nv: None,
                swap: has(K::NibbleSwap) ^ overrides.contains(&Override::NibbleSwap),
                non_pow2,
                double_scale,
                scales: None,
            }
        } else {
            // rare: the CPU reference prepares the weight (an NVFP4 reading decodes its own
            // operand from the stored codes, `served::prepare` reads no dequantized values)
            let qw = lc.ckpt.weight(base)?;
            let f32w = match qw.format.scheme().spec().served {
                crate::checkpoint::formats::Served::Nvfp4 => Vec::new(),
                _ => qw.dequantize()?.data.into_vec(),
            };
            let sw = served::prepare(lc.ckpt, &qw, &f32w, lc.fuse_pairs, &faults, &overrides)?;
            match sw {
                ServedWeight::Dense { w } => ServedDev::Host {
                    w: self.upload(&w)?,
                    nv: None,
                    fp8_act: false,
                    non_pow2: false,
                    dense: true,
                },
                ServedWeight::Fp8Act {
                    w, non_pow2_act, ..
                } => ServedDev::Host {
                    w: self.upload(&w)?,
                    nv: None,
                    fp8_act: true,
                    non_pow2: non_pow2_act,
                    dense: false,
                },
                ServedWeight::Nvfp4 { wq, p } => ServedDev::Host {
                    w: self.upload(&wq)?,
                    nv: Some(p),
                    fp8_act: false,
                    non_pow2: false,
                    dense: false,
                },
            }
        };
        Ok(served)
    }

    /// For the weights among `bases` whose served reading will rearrange NVFP4 block scales
    /// (layout faults or repairs under `lc`, not already resident in that layout), compute the
    /// rearranged bytes in parallel now (`served::nvfp4_served_bytes`, the same call
    /// `served_reading` makes one weight at a time). Failures are left to that sequential path,
    /// which reports them.
    pub(super) fn prepare_layouts(&mut self, lc: &LinearCtx, bases: &[&str]) {
        use crate::checkpoint::Scheme;
        use rayon::prelude::*;
        let _s = crate::profile::span("host: prepare layouts");
        self.prepared.clear();
        let mut todo: Vec<(&str, Vec<&Fault>, Vec<Override>)> = Vec::new();
        for &b in bases {
            let key = served_key(lc, b);
            let w = self.weights.get(b);
            if w.is_some_and(|w| w.served_key.as_ref().is_none_or(|k| *k == key)) {
                continue; // ensure_weight keeps what it has
            }
            let faults = crate::served::faults::hitting(lc.faults, b);
            let ovs = served::overrides_of(lc.overrides, b);
            if !served::nvfp4_layout_changed(&faults, &ovs) {
                continue;
            }
            let lkey = layout_key(&faults, &ovs);
            if matches!(w.map(|w| &w.served), Some(ServedDev::Native { scales: Some((_, k)), .. }) if *k == lkey)
            {
                continue; // reused as it is
            }
            todo.push((b, faults, ovs));
        }
        if todo.len() < 2 {
            return;
        }
        let done: Vec<(String, PreparedLayout)> = todo
            .par_iter()
            .filter_map(|(b, faults, ovs)| {
                let lay = lc.ckpt.weight_layout(b).ok()?;
                let m = &lay.meta;
                let nvfp4 = matches!(
                    m.scheme,
                    Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt
                );
                let conv = m.convention.filter(|_| nvfp4)?;
                let scale = lay.scale.as_deref()?;
                served::nvfp4_served_bytes(lc.ckpt, m, conv, lc.fuse_pairs, faults, ovs, || {
                    Ok(lc.ckpt.canonical_bytes(scale)?.to_vec())
                })
                .ok()
                .map(|r| (b.to_string(), r))
            })
            .collect();
        self.prepared.extend(done);
    }
}
