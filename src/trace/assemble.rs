//! From dumped tensors to op outputs: drop padded heads, split fused projections, join tensor-parallel
//! shards, join passes, and recombine a residual the engine keeps split (vLLM's layer boundary, §3.2).

use std::collections::BTreeMap;

use crate::model::ModelConfig;
use crate::trace::names::{NameMap, PerHead, Rule, Shard};
use crate::trace::precision::{self, Precision};
use crate::trace::read::{RawTensor, Trace};
use crate::{Error, Result};

/// One op's output as the engine produced it.
#[derive(Clone, Debug)]
pub struct Assembled {
    pub op: String,
    /// Trace tensor name (or, for a recombined output, the names it came from).
    pub source: String,
    /// Stored dtype of the (first) source tensor.
    pub dtype: String,
    /// Row-major values; the row layout is reconciled against the oracle later.
    pub data: Vec<f32>,
    pub token_rows: bool,
    pub notes: Vec<String>,
}

/// A trace tensor that could not be compared, and why.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Skipped {
    pub trace_name: String,
    pub op: String,
    pub reason: String,
}

/// The result of mapping a whole trace.
#[derive(Clone, Debug, Default)]
pub struct Mapping {
    pub ops: Vec<Assembled>,
    /// Trace tensor names no map entry knows.
    pub unmapped: Vec<String>,
    /// Tensors a map entry knows whose shape cannot be reconciled with the op (split out of
    /// range, ranks that do not join), with the reason.
    pub skipped: Vec<Skipped>,
    pub notes: Vec<String>,
    /// Every floating-point tensor of the trace, mapped or not, as (the op it is, or its name when
    /// no map knows it; the precision its values carry): what the run's precision is read from, so
    /// that it is the trace's and not the map's (a one-entry map naming a float32 norm of a BF16
    /// run must not make the run F32). Tensors of integer values (token ids, expert indices) are
    /// left out.
    pub carried: Vec<(String, Precision)>,
}

fn norm_dim(d: i64, nd: usize, file: &std::path::Path, name: &str) -> Result<usize> {
    let r = if d < 0 { nd as i64 + d } else { d };
    if r < 0 || r as usize >= nd {
        return Err(Error::bad(
            file,
            Some(name),
            format!("dim {d} does not exist in a {nd}-d tensor"),
        ));
    }
    Ok(r as usize)
}

/// `x[.., start..start+len, ..]` along `dim`.
fn slice(t: &RawTensor, dim: usize, start: usize, len: usize) -> Option<RawTensor> {
    let n = t.shape[dim];
    if start + len > n {
        return None;
    }
    let outer: usize = t.shape[..dim].iter().product();
    let inner: usize = t.shape[dim + 1..].iter().product();
    let mut data = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = o * n * inner;
        data.extend_from_slice(&t.data[base + start * inner..base + (start + len) * inner]);
    }
    let mut shape = t.shape.clone();
    shape[dim] = len;
    Some(RawTensor {
        shape,
        data,
        dtype: t.dtype.clone(),
    })
}

fn concat(parts: &[RawTensor], dim: usize) -> Option<RawTensor> {
    let first = parts.first()?;
    for p in parts {
        if p.shape.len() != first.shape.len()
            || p.shape
                .iter()
                .zip(&first.shape)
                .enumerate()
                .any(|(i, (a, b))| i != dim && a != b)
        {
            return None;
        }
    }
    let outer: usize = first.shape[..dim].iter().product();
    let inner: usize = first.shape[dim + 1..].iter().product();
    let total: usize = parts.iter().map(|p| p.shape[dim]).sum();
    let mut data = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for p in parts {
            let w = p.shape[dim] * inner;
            data.extend_from_slice(&p.data[o * w..(o + 1) * w]);
        }
    }
    let mut shape = first.shape.clone();
    shape[dim] = total;
    Some(RawTensor {
        shape,
        data,
        dtype: first.dtype.clone(),
    })
}

/// Keep the first `want` columns of a head-major trailing block when the engine padded heads. Only the
/// last dim, or the last two when the last is one head wide, can hold heads; the leading dim is tokens.
fn unpad_heads(t: RawTensor, dh: usize, heads: usize) -> (RawTensor, Option<String>) {
    let want = dh * heads;
    let nd = t.shape.len();
    let block = if nd >= 3 && t.shape[nd - 1] == dh {
        Some(2)
    } else if nd >= 2 && t.shape[nd - 1] >= want {
        Some(1)
    } else {
        None
    };
    let Some(k) = block else { return (t, None) };
    let w: usize = t.shape[nd - k..].iter().product();
    if w <= want || !w.is_multiple_of(dh) {
        return (t, None);
    }
    let outer = t.data.len() / w;
    let mut data = Vec::with_capacity(outer * want);
    for o in 0..outer {
        data.extend_from_slice(&t.data[o * w..o * w + want]);
    }
    let mut shape = t.shape[..nd - k].to_vec();
    shape.push(want);
    let note = format!("dropped padded heads: {} → {heads} heads", w / dh);
    (
        RawTensor {
            shape,
            data,
            dtype: t.dtype,
        },
        Some(note),
    )
}

/// A rank's piece of a per-head op as [rows, heads · width]: SGLang norms heads as rows
/// ([rows · heads, width]), vLLM as a dim of their own ([rows, heads, width]). Other shapes are
/// left as they are (already [rows, heads · width], or not reconcilable: the comparison says so).
fn fold_heads(t: RawTensor, heads: usize, width: usize) -> RawTensor {
    let nd = t.shape.len();
    let shape = if nd >= 3 && t.shape[nd - 1] == width && t.shape[nd - 2] == heads {
        let mut s = t.shape[..nd - 2].to_vec();
        s.push(heads * width);
        s
    } else if nd == 2 && heads > 1 && t.shape[1] == width && t.shape[0].is_multiple_of(heads) {
        vec![t.shape[0] / heads, heads * width]
    } else {
        return t;
    };
    RawTensor { shape, ..t }
}

/// One rule applied to one pass: per rank unpad, split and fold heads, then join the ranks.
fn one_pass(
    trace: &Trace,
    pass: usize,
    name: &str,
    rule: &Rule,
    cfg: &ModelConfig,
    notes: &mut Vec<String>,
) -> Result<Option<RawTensor>> {
    let ranks = trace.ranks;
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    for r in 0..ranks {
        let f = trace.file(pass, r);
        match f.tensors.get(name) {
            Some(t) => parts.push((r, f.path.clone(), t.clone())),
            None => missing.push(r),
        }
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let sharded = matches!(rule.shard, Shard::Concat(_)) && ranks > 1;
    if sharded && !missing.is_empty() {
        return Err(Error::bad(
            &parts[0].1,
            Some(name),
            format!("column-parallel tensor missing on rank(s) {missing:?} of pass {pass}"),
        ));
    }
    if let (true, Some(PerHead { heads, .. })) = (sharded, rule.per_head) {
        if !heads.is_multiple_of(ranks) {
            return Err(Error::bad(
                &parts[0].1,
                Some(name),
                format!(
                    "op {}: {heads} heads do not divide over {ranks} ranks (ranks that replicate a \
                     head are not joined)",
                    rule.op
                ),
            ));
        }
    }
    let mut done = Vec::new();
    for (_, path, t) in parts.iter().cloned() {
        let mut t = t;
        if let Some(dh) = rule.head_dim {
            let heads = if sharded {
                cfg.num_attention_heads / ranks
            } else {
                cfg.num_attention_heads
            };
            let (u, note) = unpad_heads(t, dh, heads);
            t = u;
            if let Some(n) = note {
                if !notes.contains(&n) {
                    notes.push(n);
                }
            }
        }
        if let Some(s) = &rule.split {
            let nd = t.shape.len();
            let d = norm_dim(s.dim, nd, &path, name)?;
            let (mut start, mut len) = (s.start, s.len);
            if let (true, Shard::Concat(cd)) = (sharded, &rule.shard) {
                if norm_dim(*cd, nd, &path, name)? == d {
                    if !start.is_multiple_of(ranks) || !len.is_multiple_of(ranks) {
                        return Err(Error::bad(
                            &path,
                            Some(name),
                            format!("split {start}+{len} does not divide over {ranks} ranks"),
                        ));
                    }
                    start /= ranks;
                    len /= ranks;
                }
            }
            t = slice(&t, d, start, len).ok_or_else(|| {
                Error::bad(
                    &path,
                    Some(name),
                    format!(
                        "shape {:?}: split {start}..{} of dim {d} is out of range (op {})",
                        t.shape,
                        start + len,
                        rule.op
                    ),
                )
            })?;
        }
        if let Some(PerHead { heads, width }) = rule.per_head {
            let local = if sharded { heads / ranks } else { heads };
            t = fold_heads(t, local, width);
        }
        done.push((path, t));
    }
    let (path0, first) = done[0].clone();
    let joined = match &rule.shard {
        Shard::Replicated => first,
        Shard::Concat(d) => {
            if done.len() == 1 {
                first
            } else {
                let dim = norm_dim(*d, first.shape.len(), &path0, name)?;
                let ts: Vec<RawTensor> = done.into_iter().map(|(_, t)| t).collect();
                concat(&ts, dim).ok_or_else(|| {
                    Error::bad(
                        &path0,
                        Some(name),
                        format!("rank shapes differ outside concat dim {dim}"),
                    )
                })?
            }
        }
        Shard::Sum => {
            if done.iter().any(|(_, t)| t.shape != first.shape) {
                return Err(Error::bad(
                    &path0,
                    Some(name),
                    "rank shapes differ (partial sums)",
                ));
            }
            let same = done.iter().all(|(_, t)| {
                t.data
                    .iter()
                    .zip(&first.data)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            });
            if same {
                first
            } else {
                let mut acc = vec![0f32; first.data.len()];
                for (_, t) in &done {
                    for (a, v) in acc.iter_mut().zip(&t.data) {
                        *a += v;
                    }
                }
                let n = format!(
                    "{name}: per-rank partial sums added over {} ranks",
                    done.len()
                );
                notes.push(n);
                RawTensor {
                    shape: first.shape.clone(),
                    data: acc,
                    dtype: first.dtype.clone(),
                }
            }
        }
    };
    Ok(Some(match rule.scale {
        Some(f) => RawTensor {
            data: joined.data.iter().map(|v| v * f).collect(),
            ..joined
        },
        None => joined,
    }))
}

/// Map every trace tensor to its ops and build each op's output. A tuple's first element is
/// written both as `PATH` and as `PATH:0` (probes/capture/_dump.py): `PATH:0` is passed over when
/// `PATH` is in the trace, so the op is compared (or listed unmapped) once — unless only
/// `PATH:0` is mapped.
pub fn assemble(trace: &Trace, map: &NameMap, cfg: &ModelConfig) -> Result<Mapping> {
    let mut out = Mapping::default();
    let skip = ["input_ids", "positions"];
    let names = trace.names();
    let set: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
    let has = |n: &str| set.contains(n);
    for name in &names {
        let name = name.clone();
        if skip.contains(&name.as_str()) {
            continue;
        }
        let rules = map.rules(&name, cfg, &has);
        if let Some(base) = name.strip_suffix(":0") {
            if has(base) && (rules.is_empty() || !map.rules(base, cfg, &has).is_empty()) {
                continue;
            }
        }
        if rules.is_empty() {
            out.unmapped.push(name);
            continue;
        }
        for rule in &rules {
            let mut notes = Vec::new();
            let mut data = Vec::new();
            let mut dtype = String::new();
            let mut last: Option<RawTensor> = None;
            let mut failed = None;
            for p in 0..trace.passes {
                let t = match one_pass(trace, p, &name, rule, cfg, &mut notes) {
                    Ok(Some(t)) => t,
                    Ok(None) => continue,
                    Err(e) => {
                        failed = Some(e.to_string());
                        break;
                    }
                };
                if dtype.is_empty() {
                    dtype = t.dtype.clone();
                }
                if rule.token_rows {
                    data.extend_from_slice(&t.data);
                }
                last = Some(t);
            }
            if let Some(reason) = failed {
                out.skipped.push(Skipped {
                    trace_name: name.clone(),
                    op: rule.op.clone(),
                    reason,
                });
                continue;
            }
            let Some(last) = last else { continue };
            if !rule.token_rows {
                if trace.passes > 1 {
                    notes.push("not token rows: the last pass's value is compared".into());
                }
                data = last.data;
            }
            out.ops.push(Assembled {
                op: rule.op.clone(),
                source: name.clone(),
                dtype,
                data,
                token_rows: rule.token_rows,
                notes,
            });
        }
    }
    recombine(&mut out, cfg);
    out.carried = carried_by_tensor(trace, map, cfg, &skip, &has);
    Ok(out)
}

/// The precision every floating-point tensor of the trace carries, with the op it is: by `map`,
/// else by the first built-in naming that knows the name (so a weight copy or an index output
/// left out of a user map is still recognised as one), else its own name. Tensors stored as
/// integers, `skip`ped ones and those holding only whole numbers (indices stored as floats) are
/// left out. Every file (rank, pass) counts.
fn carried_by_tensor(
    trace: &Trace,
    map: &NameMap,
    cfg: &ModelConfig,
    skip: &[&str],
    has: &dyn Fn(&str) -> bool,
) -> Vec<(String, Precision)> {
    let builtin = [
        NameMap::Hf,
        NameMap::Official,
        NameMap::Vllm,
        NameMap::Sglang,
    ];
    let mut out = Vec::new();
    for f in &trace.files {
        for (name, t) in &f.tensors {
            if skip.contains(&name.as_str())
                || !matches!(t.dtype.as_str(), "F32" | "F64" | "BF16" | "F16")
                || t.data.iter().all(|v| !v.is_finite() || v.fract() == 0.0)
            {
                continue;
            }
            let op = std::iter::once(map)
                .chain(&builtin)
                .find_map(|m| m.rules(name, cfg, has).into_iter().next())
                .map(|r| r.op)
                .unwrap_or_else(|| name.clone());
            out.push((op, precision::carried(&t.data, &t.dtype)));
        }
    }
    out
}

/// vLLM ends a layer at (y₂, X₁, post_f, C_f) and fuses the FFN-side mHC post into the next layer. When
/// those four are dumped and the layer output is not, build it with §3.2:
/// X'[:, k] = post[k]·y + Σ_j C[j,k]·X₁[:, j] (f32; rounded to BF16 when y was dumped in BF16).
fn recombine(m: &mut Mapping, cfg: &ModelConfig) {
    let find = |m: &Mapping, op: &str| m.ops.iter().position(|a| a.op == op && a.token_rows);
    let (hc, d) = (cfg.hc_mult, cfg.hidden_size);
    for l in 0..cfg.num_hidden_layers {
        let out_id = format!("L{l}.out");
        if m.ops.iter().any(|a| a.op == out_id) {
            continue;
        }
        let ids = [
            format!("L{l}.ffn.out"),
            format!("L{l}.attn.hc_post"),
            format!("L{l}.ffn.hc_pre.post"),
            format!("L{l}.ffn.hc_pre.comb"),
        ];
        let idx: Vec<Option<usize>> = ids.iter().map(|i| find(m, i)).collect();
        let (Some(iy), Some(ix), Some(ip), Some(ic)) = (idx[0], idx[1], idx[2], idx[3]) else {
            if idx[0].is_some() && idx[1].is_none() {
                m.notes.push(format!(
                    "L{l}: the layer output is split (y₂ without :residual/:post/:comb); {out_id} not compared"
                ));
            }
            continue;
        };
        let (y, x, p, c) = (&m.ops[iy], &m.ops[ix], &m.ops[ip], &m.ops[ic]);
        let n = y.data.len() / d.max(1);
        if y.data.len() != n * d
            || x.data.len() != n * hc * d
            || p.data.len() != n * hc
            || c.data.len() != n * hc * hc
        {
            m.notes.push(format!(
                "L{l}: cannot recombine the split residual (sizes y {}, X₁ {}, post {}, comb {} for {n} rows)",
                y.data.len(),
                x.data.len(),
                p.data.len(),
                c.data.len()
            ));
            continue;
        }
        let round = y.dtype == "BF16";
        let mut o = vec![0f32; n * hc * d];
        for t in 0..n {
            for k in 0..hc {
                let pk = p.data[t * hc + k];
                for e in 0..d {
                    let mut acc = pk * y.data[t * d + e];
                    for j in 0..hc {
                        acc += c.data[t * hc * hc + j * hc + k] * x.data[(t * hc + j) * d + e];
                    }
                    o[(t * hc + k) * d + e] = if round {
                        crate::numerics::bf16::round(acc)
                    } else {
                        acc
                    };
                }
            }
        }
        let source = format!(
            "recombined({}, {}, {}, {})",
            y.source, x.source, p.source, c.source
        );
        m.ops.push(Assembled {
            op: out_id,
            source,
            dtype: y.dtype.clone(),
            data: o,
            token_rows: true,
            notes: vec!["split residual recombined (DSV4-LAYER §3.2)".into()],
        });
    }
}

/// Layers a mapping needs the oracle to run (0..=max), and whether it reaches the head.
pub fn needed_layers(m: &Mapping) -> (Option<usize>, bool) {
    let mut max = None;
    let mut head = false;
    for a in &m.ops {
        if let Some(n) =
            a.op.strip_prefix('L')
                .and_then(|r| r.split_once('.'))
                .and_then(|(n, _)| n.parse::<usize>().ok())
        {
            max = Some(max.map_or(n, |m: usize| m.max(n)));
        } else if matches!(a.op.as_str(), "hc_head" | "final_norm" | "head") {
            head = true;
        }
    }
    (max, head)
}

/// Group ops by op id (several trace names may map to one op).
pub fn by_op(m: &Mapping) -> BTreeMap<&str, Vec<&Assembled>> {
    let mut g: BTreeMap<&str, Vec<&Assembled>> = BTreeMap::new();
    for a in &m.ops {
        g.entry(a.op.as_str()).or_default().push(a);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(shape: Vec<usize>) -> RawTensor {
        let n = shape.iter().product::<usize>();
        RawTensor {
            shape,
            data: (0..n).map(|i| i as f32).collect(),
            dtype: "F32".into(),
        }
    }

    #[test]
    fn slice_and_concat_known_values() {
        let t = raw(vec![2, 3]); // [[0,1,2],[3,4,5]]
        let s = slice(&t, 1, 1, 2).unwrap();
        assert_eq!(s.data, vec![1.0, 2.0, 4.0, 5.0]);
        let c = concat(&[s.clone(), s], 1).unwrap();
        assert_eq!(c.shape, vec![2, 4]);
        assert_eq!(c.data, vec![1.0, 2.0, 1.0, 2.0, 4.0, 5.0, 4.0, 5.0]);
        assert!(slice(&t, 1, 2, 2).is_none());
    }

    #[test]
    fn per_head_pieces_fold_to_rows_of_heads() {
        // SGLang: 2 tokens × 3 heads as rows of width 2 → [2, 6], values in place
        let f = fold_heads(raw(vec![6, 2]), 3, 2);
        assert_eq!(f.shape, vec![2, 6]);
        assert_eq!(f.data, raw(vec![2, 6]).data);
        // vLLM: [tokens, heads, width] → [2, 6]
        assert_eq!(fold_heads(raw(vec![2, 3, 2]), 3, 2).shape, vec![2, 6]);
        // already [rows, heads · width], or not a per-head layout: left alone
        assert_eq!(fold_heads(raw(vec![2, 6]), 3, 2).shape, vec![2, 6]);
        assert_eq!(fold_heads(raw(vec![5, 2]), 3, 2).shape, vec![5, 2]);
        assert_eq!(fold_heads(raw(vec![4, 2]), 1, 2).shape, vec![4, 2]);
    }

    #[test]
    fn padded_heads_are_dropped() {
        // 2 tokens, 4 heads of width 2 stored where 3 are real
        let t = raw(vec![2, 4, 2]);
        let (u, note) = unpad_heads(t, 2, 3);
        assert!(note.is_some());
        assert_eq!(u.shape, vec![2, 6]);
        assert_eq!(
            u.data,
            vec![0., 1., 2., 3., 4., 5., 8., 9., 10., 11., 12., 13.]
        );
        // no padding: untouched
        let (u, note) = unpad_heads(raw(vec![1, 3, 6]), 2, 3);
        assert!(note.is_none());
        assert_eq!(u.shape, vec![1, 3, 6]);
    }
}
