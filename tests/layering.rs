//! The layering of `src/`: every top-level module imports only from its own layer or the layers
//! below it, and no two top-level modules import each other, directly or around a circle. Read
//! from the `crate::…` paths of every `src/**/*.rs` (unit tests included); `lib.rs` and `main.rs`
//! only declare and call the modules. docs/ARCHITECTURE.md draws the same table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module of `src/` and its layer, lowest first.
const LAYERS: &[(&str, u32)] = &[
    // 0 foundation: errors and globs, std only
    ("error", 0),
    ("glob", 0),
    // 1 primitives: number formats, bounded input reading, output files, metrics
    ("numerics", 1),
    ("input", 1),
    ("output", 1),
    ("metrics", 1),
    // 2 values: tensors (host/device data), timers, the run-JSON reader
    ("tensor", 2),
    ("profile", 2),
    ("run_json", 2),
    // 3 the op math behind one interface: `Device`, the host reference kernels, the f64 GEMM
    ("device", 3),
    // 4 the model as data and its op graph, written against `Device` and `OpEnv`
    ("model", 4),
    // 5 checkpoints: files, names, weight formats, the config; the tokenizer
    ("checkpoint", 5),
    ("tokenize", 5),
    // 6 the served numerics: profiles as recipes, loader faults, the served reading of a weight
    ("served", 6),
    // 7 the machines and the checkpoint tools: CUDA backend, lint, synth
    ("backend", 7),
    ("lint", 7),
    ("synth", 7),
    // 8 the runner: paths, environments, findings
    ("probe", 8),
    // 9 what reads a run: reports, the CI gate, plots
    ("report", 9),
    ("gate", 9),
    ("plot", 9),
    // 10 the fault search
    ("bisect", 10),
    // 11 trace comparison and the command-line syntax
    ("trace", 11),
    ("cli", 11),
    // 12 whole-backend self test (kernels and whole runs)
    ("selftest", 12),
    // 13 the commands
    ("commands", 13),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without its `//` comments (doc comments name modules in prose).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a file's code names through `crate::`: `crate::a::…`, `crate::a`
/// and each first segment inside `crate::{a::…, b}`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let mut depth = 1;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    depth == 0
                })
                .map_or(group.len(), |(j, _)| j);
            let inner = &group[..end];
            // first segments at depth 0 of the group
            let mut d = 0;
            let mut start = true;
            let mut word = String::new();
            for c in inner.chars() {
                if start && d == 0 && (c.is_alphanumeric() || c == '_') {
                    word.push(c);
                    continue;
                }
                if !word.is_empty() {
                    out.insert(std::mem::take(&mut word));
                    start = false;
                }
                match c {
                    '{' => d += 1,
                    '}' => d -= 1,
                    ',' if d == 0 => start = true,
                    _ => {}
                }
            }
            if !word.is_empty() {
                out.insert(word);
            }
        } else {
            let w: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.insert(w);
        }
        rest = &rest[i + "crate::".len()..];
    }
    out
}

/// Top-level module → the top-level modules it imports, with one file for each.
fn imports(src: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a path");
        let top = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        assert!(
            layers.contains_key(top.as_str()),
            "src/{top} has no layer: add it to LAYERS (and docs/ARCHITECTURE.md)"
        );
        let text = std::fs::read_to_string(&f).expect("read");
        let e = out.entry(top.clone()).or_default();
        for r in crate_refs(&code(&text)) {
            if r != top && layers.contains_key(r.as_str()) {
                e.entry(r).or_insert_with(|| rel.display().to_string());
            }
        }
    }
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_module_imports_only_from_its_layer_or_below() {
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut up = Vec::new();
    for (m, deps) in imports(&src()) {
        for (d, file) in deps {
            if layers[d.as_str()] > layers[m.as_str()] {
                up.push(format!(
                    "src/{file}: {m} (layer {}) imports {d} (layer {})",
                    layers[m.as_str()],
                    layers[d.as_str()]
                ));
            }
        }
    }
    assert!(up.is_empty(), "imports that run up:\n{}", up.join("\n"));
}

#[test]
fn no_circle_between_top_level_modules() {
    let g = imports(&src());
    // depth-first search for a back edge
    fn visit(
        m: &str,
        g: &BTreeMap<String, BTreeMap<String, String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(m.to_string(), 1);
        path.push(m.to_string());
        for d in g
            .get(m)
            .map(|d| d.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            match state.get(&d).copied().unwrap_or(0) {
                1 => {
                    let i = path.iter().position(|p| *p == d).expect("on path");
                    let mut c = path[i..].to_vec();
                    c.push(d);
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(&d, g, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in g.keys() {
        if state.get(m).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(m, &g, &mut state, &mut Vec::new()) {
                panic!("import circle: {}", c.join(" -> "));
            }
        }
    }
}

#[test]
fn the_reader_sees_grouped_and_plain_paths() {
    let r = crate_refs("use crate::{a::b, c, d::{e, f}};\nlet x = crate::g::h(1);\nuse crate::i;");
    let want: BTreeSet<String> = ["a", "c", "d", "g", "i"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(r, want);
    assert!(crate_refs(&code("// crate::zz::y\nfn f() {}")).is_empty());
}
