//! Reading weights ahead of the runner into the page cache (the CUDA backend's run: cold runs
//! are disk-bound, and this overlaps the disk with the device). Two readers: the early reader,
//! started by `run` before the device and the rest of the command are up, and the prefetcher that
//! follows the runner op by op (`backend::run`), reading a routed expert only once a router chose
//! it. Both only warm the page cache: nothing is kept in memory here.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::checkpoint::Checkpoint;
use crate::model::graph::{build_graph, whole_weights, Op, OpKind};

/// Per op, what `f` plans for it (ops in parallel).
pub(super) fn plan_of<T: Send>(ops: &[Op], f: impl Fn(&Op) -> Vec<T> + Sync + Send) -> Vec<Vec<T>> {
    use rayon::prelude::*;
    ops.par_iter().map(f).collect()
}

/// How far (bytes of weights) the prefetch thread may run ahead of the op being computed.
pub(super) const PREFETCH_AHEAD: usize = 8 << 30;

/// Canonical names of the stored tensors some weights occupy (data and block scales).
pub(super) fn prefetch_names(ckpt: &Checkpoint, weights: &[String]) -> Vec<String> {
    let mut v = Vec::new();
    for name in weights {
        if let Ok(l) = ckpt.weight_layout(name) {
            v.push(l.weight);
            v.extend(l.scale);
        } else if ckpt.canonical_info(name).is_some() {
            // a parameter (norm weight, hc mixing, sink, ...): small, but on the critical path
            v.push(name.clone());
        }
    }
    v
}

/// Tensors of an op to read ahead, grouped: one group per routed expert (`expert` set: read only
/// once the router has chosen it), one group for everything else.
pub(super) struct Group {
    expert: Option<usize>,
    names: Vec<String>,
}

pub(super) fn prefetch_groups(ckpt: &Checkpoint, op: &Op) -> Vec<Group> {
    by_expert(op, |w| prefetch_names(ckpt, w))
        .into_iter()
        .map(|(expert, names)| Group { expert, names })
        .collect()
}

/// What `f` makes of the weights an op reads whole, split the way the readers follow the routing:
/// per routed expert (`Some(e)`: weights `[e0.w1, e0.w3, e0.w2, e1.w1, …]`, experts in
/// parallel) for a routed-experts op, else one group (`None`); nothing for an op that reads no
/// whole weight.
pub(super) fn by_expert<T: Send>(
    op: &Op,
    f: impl Fn(&[String]) -> T + Sync + Send,
) -> Vec<(Option<usize>, T)> {
    if whole_weights(op).is_empty() {
        return Vec::new();
    }
    if op.kind == OpKind::Experts {
        use rayon::prelude::*;
        op.weights
            .par_chunks(3)
            .enumerate()
            .map(|(e, w)| (Some(e), f(w)))
            .collect()
    } else {
        vec![(None, f(whole_weights(op)))]
    }
}

/// Bytes the early reader (`start_early_read`) reads at most.
pub const EARLY_READ_BYTES: usize = 2 << 30;

/// Start reading, on a detached thread, up to `budget` bytes of the weights a run over layers
/// `0..=last` will need, in op order, with positioned reads from the files, so the disk works
/// while the device and the rest of the command start. Routed experts are left out (which ones
/// are needed is known only once the run routes), and so are the embedding rows. The page cache
/// is shared, so the runner then finds those bytes there; nothing is kept in memory here, and
/// when the process ends first the thread just ends with it. For the GPU backend (a CPU run is
/// compute-bound). Returns the bytes queued.
pub fn start_early_read(ckpt: &Checkpoint, last: usize, budget: usize) -> usize {
    let Ok(cfg) = ckpt.model_config() else {
        return 0;
    };
    let last = last.min(cfg.num_hidden_layers.saturating_sub(1));
    let with_head = last + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    let mut ranges: Vec<(PathBuf, u64, usize)> = Vec::new();
    let mut total = 0usize;
    'ops: for op in build_graph(cfg, last, with_head) {
        if op.kind == OpKind::Experts {
            continue;
        }
        for name in prefetch_names(ckpt, whole_weights(&op)) {
            if let Ok(crate::checkpoint::Span::File { path, offset, len }) =
                ckpt.canonical_span(&name)
            {
                if total + len > budget {
                    break 'ops;
                }
                total += len;
                ranges.push((path.to_path_buf(), offset, len));
            }
        }
    }
    if ranges.is_empty() {
        return 0;
    }
    let _ = std::thread::Builder::new()
        .name("early-read".into())
        .spawn(move || {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0u8; 8 << 20];
            let mut files: HashMap<PathBuf, std::fs::File> = HashMap::new();
            for (path, mut off, len) in ranges {
                if !files.contains_key(&path) {
                    match std::fs::File::open(&path) {
                        Ok(f) => {
                            files.insert(path.clone(), f);
                        }
                        Err(_) => continue,
                    }
                }
                let f = &files[&path];
                let end = off + len as u64;
                while off < end {
                    let n = ((end - off) as usize).min(buf.len());
                    match f.read_at(&mut buf[..n], off) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => off += k as u64,
                    }
                }
            }
        });
    total
}

/// Read ahead the tensors of the ops after the current one, at most `ahead` bytes (of the plan,
/// every expert counted) beyond it. A routed expert's tensors are read only once the router has
/// chosen it (`routed`); until then the loop waits at that op, so no byte of an expert the run
/// does not use is read.
pub(super) fn prefetch_loop(
    ckpt: &Checkpoint,
    plan: &[Vec<Group>],
    routed: &std::sync::Mutex<HashMap<usize, Vec<bool>>>,
    at: &std::sync::atomic::AtomicUsize,
    done: &std::sync::atomic::AtomicBool,
    ahead: usize,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let size = |n: &String| ckpt.canonical_span(n).map(|s| s.len()).unwrap_or(0);
    let sizes: Vec<Vec<Vec<usize>>> = plan
        .iter()
        .map(|gs| {
            gs.iter()
                .map(|g| g.names.iter().map(size).collect())
                .collect()
        })
        .collect();
    let mut start_of = vec![0usize; plan.len() + 1];
    for (i, s) in sizes.iter().enumerate() {
        start_of[i + 1] = start_of[i] + s.iter().flatten().sum::<usize>();
    }
    // the embedding rows are read first, by the main thread: do not queue I/O in front of them
    while at.load(Relaxed) == 0 && !done.load(Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut pos = 0usize; // bytes of the plan already passed
    for (step, groups) in plan.iter().enumerate() {
        for (gi, g) in groups.iter().enumerate() {
            if let Some(e) = g.expert {
                // wait for the routing (or for the op to be done: then there is nothing to do)
                let chosen = loop {
                    if done.load(Relaxed) {
                        return;
                    }
                    if at.load(Relaxed) > step {
                        break false;
                    }
                    if let Some(u) = routed.lock().ok().and_then(|m| m.get(&step).cloned()) {
                        break u.get(e).copied().unwrap_or(true);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                };
                if !chosen {
                    pos += sizes[step][gi].iter().sum::<usize>();
                    continue;
                }
            }
            for (name, &len) in g.names.iter().zip(&sizes[step][gi]) {
                loop {
                    if done.load(Relaxed) {
                        return;
                    }
                    let cur = at.load(Relaxed).min(plan.len());
                    if step < cur {
                        break; // that op is already done: skip
                    }
                    if pos + len <= start_of[cur] + ahead || step == cur {
                        ckpt.readahead(name);
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                pos += len;
            }
        }
    }
}
