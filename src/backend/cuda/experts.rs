//! The routed-experts op on the device, in three steps: [`Gpu::experts_begin`] (gather the
//! routed rows, allocate), [`Gpu::experts_advance`] (the experts' weights and GEMMs, a chunk of
//! experts at a time) and [`Gpu::experts_end`] (combine, counters).
//!
//! [`Gpu::experts`] runs the three back to back. A run can instead defer the op
//! ([`Gpu::defer_experts`]): every path's call then only begins its op and returns the output
//! tensor, still to be written; [`Gpu::experts_flush`] then takes the routed experts chunk by
//! chunk, in the loader's order, and launches every deferred path's GEMMs for each chunk as soon
//! as its weights are on the device. Routed experts can only be read once the router has run, so
//! without this the device sat idle while the loader read them (~120 ms per score-routed V4-Flash
//! layer on the H200), then worked through five paths' GEMMs after the last byte arrived.
//!
//! Each expert's rows, GEMMs, activation quantization and counters are independent of the other
//! experts', and the output combines every expert's rows in one launch at the end, so the result
//! does not depend on the chunking (the self-test checks this bit for bit).

use super::*;

/// One path's routed-experts op between [`Gpu::experts_begin`] and [`Gpu::experts_end`].
pub struct ExpertsJob {
    kind: PathKind,
    layer: usize,
    t: usize,
    d: usize,
    k_slots: usize,
    limit: f32,
    /// Read the health counters back (served observations, w2 amax) at the end.
    counters: bool,
    /// Expert e's rows of the gathered input are `starts[e]..starts[e + 1]`.
    starts: Vec<usize>,
    /// The experts that received tokens, in index order.
    used: Vec<usize>,
    /// (w1, w3, w2) of expert e at `3e..3e + 3`.
    bases: Vec<String>,
    /// Per token slot: its row in the gathered order (-1: none) and its routing weight.
    slot_row: Vec<i32>,
    slot_w: Vec<f32>,
    xs: Buf,
    ys: Buf,
    /// H_SLOTS counters per (used expert, linear).
    hb: Buf,
    /// The op's output [t, d], written by `moe_combine` at the end.
    out: Arc<DevTensor>,
    /// Grouped launches allowed (no expert has more rows than the grouped kernel takes).
    grouped_ok: bool,
    /// Some chunk ran grouped.
    grouped: bool,
    /// How many of `used` have been launched (a prefix), and their served parameters.
    launched: usize,
    params: Vec<(usize, [Option<Nvfp4Params>; 3])>,
}

impl ExpertsJob {
    /// The op's output tensor (written once the op has ended).
    pub fn output(&self) -> Tensor {
        let y: Arc<dyn crate::tensor::DeviceValues> = self.out.clone();
        Tensor::new(vec![self.t, self.d], Data::from_device(y))
    }

    /// The weights the op reads: w1, w3, w2 of every expert that received tokens.
    pub fn touched(&self) -> Vec<String> {
        self.used
            .iter()
            .flat_map(|&e| self.bases[3 * e..3 * e + 3].iter().cloned())
            .collect()
    }
}

/// Experts per chunk of a deferred op: `NVFP4_PROBE_EXPERT_CHUNK` (0 = do not defer).
pub fn expert_chunk_from_env() -> usize {
    std::env::var("NVFP4_PROBE_EXPERT_CHUNK")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_EXPERT_CHUNK)
}

/// Most of a 256 MiB loader batch of V4-Flash experts (14 MB each in NVFP4). On the H200, 16
/// gave a shorter run than 8 (fewer, larger launches: less device time) and than no chunking.
pub const DEFAULT_EXPERT_CHUNK: usize = 16;

impl Gpu {
    /// From now until [`Gpu::experts_flush`], routed-experts ops only begin (their output is
    /// written by the flush). False (nothing deferred) when chunking is off
    /// (`NVFP4_PROBE_EXPERT_CHUNK=0`).
    pub fn defer_experts(&mut self) -> bool {
        self.deferred.clear();
        self.defer = self.expert_chunk > 0;
        self.defer
    }

    /// Whether routed-experts ops are being deferred now.
    pub fn deferring(&self) -> bool {
        self.defer
    }

    /// Stop deferring and drop what was deferred and not flushed (a run that failed midway).
    pub fn cancel_deferred(&mut self) {
        self.defer = false;
        self.deferred.clear();
    }

    /// Run the deferred ops, interleaved chunk by chunk of experts, and end them. Returns each
    /// op's served observations, in the order the ops were deferred.
    pub fn experts_flush(&mut self, lc: &LinearCtx) -> Result<Vec<Vec<(String, LinearObs)>>> {
        self.defer = false;
        let mut jobs = std::mem::take(&mut self.deferred);
        let chunk = self.expert_chunk.max(1);
        self.experts_advance(lc, &mut jobs, chunk)?;
        jobs.into_iter()
            .map(|j| self.experts_end(lc, j).map(|o| o.1))
            .collect()
    }

    /// The routed-experts op of one path on the device: x [t, d], `per[e]` = (token, routing
    /// weight) of expert e, `k_slots` per token; `bases[3e..3e+3]` = (w1, w3, w2) of expert e.
    /// Returns [t, d] and the served observations per expert linear (sub ids as the CPU path
    /// names them). While deferring, the op only begins: the output is written by the flush and
    /// the observations come from it.
    #[allow(clippy::too_many_arguments)]
    pub fn experts(
        &mut self,
        lc: &LinearCtx,
        kind: PathKind,
        layer: usize,
        x: &Tensor,
        per: &[Vec<(usize, f32)>],
        k_slots: usize,
        bases: &[&str],
        limit: f32,
        counters: bool,
    ) -> Result<ExpertsOut> {
        let job = self.experts_begin(kind, layer, x, per, k_slots, bases, limit, counters)?;
        if self.defer {
            let out = (job.output(), Vec::new(), job.touched(), Vec::new());
            self.deferred.push(job);
            return Ok(out);
        }
        let mut jobs = [job];
        self.experts_advance(lc, &mut jobs, usize::MAX)?;
        let [job] = jobs;
        self.experts_end(lc, job)
    }

    /// Gather x's rows in expert order, allocate the op's buffers and zero its counters.
    #[allow(clippy::too_many_arguments)]
    fn experts_begin(
        &mut self,
        kind: PathKind,
        layer: usize,
        x: &Tensor,
        per: &[Vec<(usize, f32)>],
        k_slots: usize,
        bases: &[&str],
        limit: f32,
        counters: bool,
    ) -> Result<ExpertsJob> {
        self.counters.expert_ops += 1;
        let t = x.rows();
        let d = x.cols();
        let mut order: Vec<i32> = Vec::new();
        let mut starts = Vec::new();
        let mut slot_row = vec![-1i32; t * k_slots];
        let mut slot_w = vec![0f32; t * k_slots];
        let mut fill = vec![0usize; t];
        for toks in per {
            starts.push(order.len());
            for &(ti, wv) in toks {
                let j = fill[ti];
                if j < k_slots {
                    slot_row[ti * k_slots + j] = order.len() as i32;
                    slot_w[ti * k_slots + j] = wv;
                    fill[ti] += 1;
                }
                order.push(ti as i32);
            }
        }
        starts.push(order.len());
        let total = order.len();
        let xb = self.input(&x.data)?;
        let ob = self.upload(&order)?;
        let xs = self.alloc(total * d * 4)?;
        self.gather_rows(xb.ptr, ob.ptr, total, d, xs.ptr)?;
        let ys = self.alloc(total * d * 4)?;
        let used: Vec<usize> = (0..per.len()).filter(|&e| !per[e].is_empty()).collect();
        let hb = self.alloc(used.len() * 3 * H_SLOTS * 8)?;
        self.memset(hb.ptr, 0, used.len() * 3 * H_SLOTS * 8)?;
        let most_rows = used
            .iter()
            .map(|&e| starts[e + 1] - starts[e])
            .max()
            .unwrap_or(0);
        let out = Arc::new(DevTensor {
            buf: self.alloc(t * d * 4)?,
            n: t * d,
            stream: self.stream.clone(),
            bounce: self.bounce.clone(),
        });
        Ok(ExpertsJob {
            kind,
            layer,
            t,
            d,
            k_slots,
            limit,
            counters,
            starts,
            bases: bases.iter().map(|b| b.to_string()).collect(),
            slot_row,
            slot_w,
            xs,
            ys,
            hb,
            out,
            grouped_ok: self.grouped_experts
                && self.exact64
                && self.v2
                && self.moe_kernel.takes(most_rows, total, used.len()),
            grouped: false,
            launched: 0,
            params: Vec::with_capacity(used.len()),
            used,
        })
    }

    /// Launch the GEMMs of every job's remaining experts, `chunk` experts (of the jobs' union, in
    /// index order: the loader's) at a time: each chunk's weights are taken from the loader (or
    /// read) and checked, then every job's experts of that chunk are launched.
    fn experts_advance(
        &mut self,
        lc: &LinearCtx,
        jobs: &mut [ExpertsJob],
        chunk: usize,
    ) -> Result<()> {
        let Some(first) = jobs.first() else {
            return Ok(());
        };
        let d = first.d;
        // every job was made for the same op: the same weight names
        let bases = first.bases.clone();
        let mut all: Vec<usize> = jobs.iter().flat_map(|j| j.used.iter().copied()).collect();
        all.sort_unstable();
        all.dedup();
        for part in all.chunks(chunk.max(1)) {
            let names: Vec<&str> = part
                .iter()
                .flat_map(|&e| bases[3 * e..3 * e + 3].iter().map(String::as_str))
                .collect();
            {
                let _s = crate::profile::span("experts: preload");
                self.preload(lc.ckpt, &names)?;
            }
            self.prepare_layouts(lc, &names);
            let _s = crate::profile::span("experts: ensure + checks");
            for (&e, b) in part.iter().zip(names.chunks(3)) {
                self.expert_weights(lc, e, [b[0], b[1], b[2]], d)?;
            }
            self.prepared.clear();
            drop(_s);
            let upto = part[part.len() - 1] + 1;
            let _s = crate::profile::span("experts: plan + launches");
            for job in jobs.iter_mut() {
                self.experts_launch(lc, job, upto)?;
            }
        }
        Ok(())
    }

    /// An expert's three weights on the device, their shapes checked against hidden size `d`.
    fn expert_weights(&mut self, lc: &LinearCtx, e: usize, b: [&str; 3], d: usize) -> Result<()> {
        let [b1, b3, b2] = b;
        for w in b {
            self.ensure_weight(lc, w)?;
        }
        let inter = self.weights[b1].n;
        if self.weights[b3].n != inter || self.weights[b1].k != d || self.weights[b2].k != inter {
            return Err(Error::bad(
                lc.ckpt.location(),
                Some(b1),
                format!("expert {e}: w1/w3/w2 shapes do not fit hidden size {d}"),
            ));
        }
        if self.weights[b2].n != d {
            return Err(Error::bad(
                lc.ckpt.location(),
                Some(b2),
                format!(
                    "expert {e}: w2 has {} outputs, expected {d}",
                    self.weights[b2].n
                ),
            ));
        }
        Ok(())
    }

    /// Launch the job's experts not launched yet whose index is below `upto` (their weights are
    /// on the device): grouped when the plan allows, else expert by expert.
    fn experts_launch(&mut self, lc: &LinearCtx, job: &mut ExpertsJob, upto: usize) -> Result<()> {
        let i0 = job.launched;
        let i1 = i0 + job.used[i0..].iter().take_while(|&&e| e < upto).count();
        if i1 == i0 {
            return Ok(());
        }
        job.launched = i1;
        let sub = &job.used[i0..i1];
        let d = job.d;
        let hb = job.hb.ptr;
        let h = |ui: usize, j: usize| hb + (((ui * 3 + j) * H_SLOTS) * 8) as u64;
        let plan = if job.grouped_ok {
            self.moe_plan(job.kind, lc.profile, sub, &job.bases)
        } else {
            None
        };
        if let Some((acts, plans, inter)) = plan {
            // the chunk's rows are contiguous: its experts' segments, from its first row
            let r0 = job.starts[sub[0]];
            let r1 = job.starts[sub[sub.len() - 1] + 1];
            let segs: Vec<(usize, usize)> = sub
                .iter()
                .map(|&e| (job.starts[e] - r0, job.starts[e + 1] - job.starts[e]))
                .collect();
            let at = (r0 * d * 4) as u64;
            let p = self.experts_grouped(
                job.kind,
                &acts,
                &plans,
                inter,
                sub,
                &segs,
                job.xs.ptr + at,
                r1 - r0,
                d,
                job.ys.ptr + at,
                &|ui, j| h(i0 + ui, j),
                job.limit,
            )?;
            job.params.extend(p);
            job.grouped = true;
            return Ok(());
        }
        let (kind, limit) = (job.kind, job.limit);
        let round = kind != PathKind::OracleFp32;
        for (k, &e) in sub.iter().enumerate() {
            let ui = i0 + k;
            let (s0, s1) = (job.starts[e], job.starts[e + 1]);
            let rows = s1 - s0;
            let b = &job.bases;
            let (b1, b3, b2) = (&b[3 * e], &b[3 * e + 1], &b[3 * e + 2]);
            let inter = self.weights[b1].n;
            let gt = self.scratch("gt", rows * inter * 4)?;
            let up = self.scratch("up", rows * inter * 4)?;
            let act = self.scratch("act", rows * inter * 4)?;
            let xe = job.xs.ptr + (s0 * d * 4) as u64;
            let p1 = self.linear_dev(
                lc,
                kind,
                b1,
                xe,
                rows,
                round,
                WRows::All,
                gt,
                inter,
                Some(h(ui, 0)),
            )?;
            let p3 = self.linear_dev(
                lc,
                kind,
                b3,
                xe,
                rows,
                round,
                WRows::All,
                up,
                inter,
                Some(h(ui, 1)),
            )?;
            let n_el = (rows * inter) as u64;
            self.swiglu_store(gt, up, act, rows * inter, limit, round)?;
            let ye = job.ys.ptr + (s0 * d * 4) as u64;
            let p2 = self.linear_dev(
                lc,
                kind,
                b2,
                act,
                rows,
                round,
                WRows::All,
                ye,
                d,
                Some(h(ui, 2)),
            )?;
            if p2.is_none() {
                // no served NVFP4 quantization observed w2's activation: its amax alone (slot
                // 7; the other counters of this slot are never read for such a linear)
                if n_el.is_multiple_of(16) {
                    let o = ActQuantOut {
                        health: h(ui, 2),
                        ..Default::default()
                    };
                    self.act_quant_nvfp4(act, n_el / 16, 1.0, o)?;
                } else {
                    let a: Vec<f32> = self.download(act, n_el as usize)?;
                    let am = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                    self.copy_in(h(ui, 2) + 7 * 8, &[am.to_bits() as u64])?;
                }
            }
            job.params.push((e, [p1, p3, p2]));
        }
        Ok(())
    }

    /// Experts of one path as grouped launches: per linear one activation step and one
    /// `moe_gemm_f64` over every expert's rows, SwiGLU once over all rows. Same results as the
    /// per-expert sequence (same decodes, quantizers, f64 accumulation and epilogues), without an
    /// f32 copy of any weight and with a dozen launches instead of a dozen per expert. x [total,
    /// d] at `xs` holds the experts' rows, expert `used[i]` at `segs[i]` (first row, rows); the
    /// counters of (i, linear j) at `health(i, j)`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn experts_grouped(
        &mut self,
        kind: PathKind,
        acts: &[MoeAct; 3],
        plans: &[Vec<(MoeTile, Option<Nvfp4Params>)>; 3],
        inter: usize,
        used: &[usize],
        segs: &[(usize, usize)],
        xs: u64,
        total: usize,
        d: usize,
        ys: u64,
        health: &dyn Fn(usize, usize) -> u64,
        limit: f32,
    ) -> Result<Vec<(usize, [Option<Nvfp4Params>; 3])>> {
        let round = kind != PathKind::OracleFp32;
        let kn = self.moe_kernel;
        let per = kn.tile_rows();
        let tiles = |plan: &[(MoeTile, Option<Nvfp4Params>)]| -> Vec<MoeTile> {
            let mut v = Vec::new();
            for (&(r0, rows), (t, _)) in segs.iter().zip(plan) {
                for a in (0..rows).step_by(per) {
                    v.push(MoeTile {
                        row0: (r0 + a) as u32,
                        rows: per.min(rows - a) as u32,
                        ..*t
                    });
                }
            }
            v
        };
        let n_el = total * inter;
        let gt = self.scratch("gt", n_el * 4)?;
        let up = self.scratch("up", n_el * 4)?;
        let act = self.scratch("act", n_el * 4)?;
        for (j, out) in [(0usize, gt), (1, up)] {
            let (xp, xbf) =
                self.moe_act(acts[j], xs, total, d, segs, &plans[j], &|ui| health(ui, j))?;
            self.moe_gemm(kn, xp, xbf, d, &tiles(&plans[j]), inter, d, out, inter)?;
        }
        self.swiglu_store(gt, up, act, n_el, limit, round)?;
        let (xp, xbf) = self.moe_act(acts[2], act, total, inter, segs, &plans[2], &|ui| {
            health(ui, 2)
        })?;
        self.moe_gemm(kn, xp, xbf, inter, &tiles(&plans[2]), d, inter, ys, d)?;
        if plans[2].iter().all(|(_, p)| p.is_none()) {
            // no served NVFP4 quantization observed w2's activation: its amax alone (slot 7), as
            // the per-expert sequence counts it
            let s = aq_segs(segs, inter, &|_| 1.0, &|ui| health(ui, 2));
            self.act_quant_nvfp4_seg(act, &s, ActQuantOut::default())?;
        }
        self.counters.linears += 3 * used.len() as u64;
        Ok(used
            .iter()
            .enumerate()
            .map(|(ui, &e)| (e, [plans[0][ui].1, plans[1][ui].1, plans[2][ui].1]))
            .collect())
    }

    /// Combine the experts' rows into the output (routing weights applied, in slot order) and,
    /// when the job asked for them, read the counters back: the served observations and each
    /// expert's w2 activation amax.
    fn experts_end(&mut self, lc: &LinearCtx, job: ExpertsJob) -> Result<ExpertsOut> {
        let _s = crate::profile::span("experts: combine + counters");
        if job.launched != job.used.len() {
            return Err(Error::Backend(format!(
                "internal: experts op of layer {} ended with {} of {} experts launched",
                job.layer,
                job.launched,
                job.used.len()
            )));
        }
        if job.grouped {
            self.counters.grouped_expert_ops += 1;
        }
        let (t, d, k_slots) = (job.t, job.d, job.k_slots);
        let srb = self.upload(&job.slot_row)?;
        let swb = self.upload(&job.slot_w)?;
        self.kern().moe_combine(
            (t * d) as u64,
            job.ys.ptr,
            srb.ptr,
            swb.ptr,
            t as u64,
            k_slots as u64,
            d as u64,
            job.out.buf.ptr,
        )?;
        let y = job.output();
        let touched = job.touched();
        if !job.counters {
            // nobody reads them: no download, so the host does not wait for the device here
            return Ok((y, Vec::new(), touched, Vec::new()));
        }
        let used = &job.used;
        let h: Vec<u64> = self.download(job.hb.ptr, used.len() * 3 * H_SLOTS)?;
        let w2_amax: Vec<(usize, f32)> = used
            .iter()
            .enumerate()
            .map(|(ui, &e)| (e, f32::from_bits(h[(ui * 3 + 2) * H_SLOTS + 7] as u32)))
            .collect();
        let mut obs = Vec::new();
        if job.kind == PathKind::Served {
            for (ui, (e, ps)) in job.params.iter().enumerate() {
                for (j, (p, nm)) in ps.iter().zip(["w1", "w3", "w2"]).enumerate() {
                    let s = (ui * 3 + j) * H_SLOTS;
                    obs.push((
                        format!("L{}.ffn.expert.{e}.{nm}", job.layer),
                        Self::observation(*p, &h[s..s + H_SLOTS], lc.profile),
                    ));
                }
            }
        }
        Ok((y, obs, touched, w2_amax))
    }
}
