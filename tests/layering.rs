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

/// The file of `src/` a module path names (`["model", "family", "kind"]`): `src/model/family/kind.rs`
/// or `…/kind/mod.rs`; None when no such file exists.
fn module_file(src: &Path, path: &[String]) -> Option<PathBuf> {
    if path.is_empty() {
        return Some(src.join("lib.rs"));
    }
    let mut p = src.to_path_buf();
    for s in path {
        p.push(s);
    }
    let file = p.with_extension("rs");
    if file.is_file() {
        return Some(file);
    }
    let m = p.join("mod.rs");
    m.is_file().then_some(m)
}

/// The module path of a file (`src/model/family/kind.rs` → model, family, kind; `mod.rs` is its folder).
fn module_of(src: &Path, f: &Path) -> Vec<String> {
    let rel = f.strip_prefix(src).expect("under src");
    let mut v: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if v.last().is_some_and(|l| l == "mod" || l == "lib") {
        v.pop();
    }
    v
}

/// Every path of a file's code that starts at `crate::`, `super::`, `self::` or one of the file's
/// own child modules (`mod x;` then `x::…`), written out to its segments (a group `{a, b::c}`
/// expanded one level, the habit of this crate), as module paths from the crate root. `me` is the
/// file's module path.
fn module_paths(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let children: Vec<String> = code
        .split(';')
        .filter_map(|st| {
            let t = st.trim();
            let t = t.strip_prefix("pub ").unwrap_or(t);
            t.strip_prefix("mod ")
                .filter(|n| n.chars().all(ident))
                .map(str::to_string)
        })
        .collect();
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let at_word_start = i == 0 || !(ident(b[i - 1] as char) || b[i - 1] == b':');
        let child = children
            .iter()
            .find(|c| rest.starts_with(c.as_str()) && rest[c.len()..].starts_with("::"));
        let (mut segs, mut j) = if !at_word_start {
            (None, i)
        } else if rest.starts_with("crate::") {
            (Some(Vec::new()), i + "crate::".len())
        } else if rest.starts_with("self::") {
            (Some(me.to_vec()), i + "self::".len())
        } else if rest.starts_with("super::") || child.is_some() {
            (Some(me.to_vec()), i)
        } else {
            (None, i)
        };
        let Some(segs) = segs.as_mut() else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        while code[j..].starts_with("super::") {
            segs.pop();
            j += "super::".len();
        }
        let mut done = false;
        loop {
            if code[j..].starts_with('{') {
                j += 1;
                let end = code[j..].find('}').map_or(code.len(), |e| j + e);
                for item in code[j..end].split(',') {
                    let mut s = segs.clone();
                    s.extend(
                        item.trim()
                            .split("::")
                            .map(|x| x.trim().to_string())
                            .filter(|x| !x.is_empty() && x != "self" && x.chars().all(ident)),
                    );
                    out.push(s);
                }
                j = end;
                done = true;
                break;
            }
            let w: String = code[j..].chars().take_while(|&c| ident(c)).collect();
            if w.is_empty() {
                break;
            }
            j += w.len();
            segs.push(w);
            if code[j..].starts_with("::") {
                j += 2;
            } else {
                break;
            }
        }
        // a glob (`use super::*`) is a child's view of its parent's names, not an import of one
        // of them: the names it uses are the parent's own or imported there
        if !done && !code[j..].starts_with('*') {
            out.push(segs.clone());
        }
        i = j.max(i + 1);
    }
    out
}

/// Names a `mod.rs` hands on from its submodules (`pub use sub::{A, B}`, `pub use sub::A`): name → submodule.
fn reexports(code: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(rest) = s
            .strip_prefix("pub use ")
            .or_else(|| s.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let rest = rest.trim_start_matches("self::");
        let Some((sub, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let last = n
                .trim()
                .rsplit("::")
                .next()
                .unwrap_or("")
                .trim()
                .to_string();
            if !last.is_empty() {
                m.insert(last, sub.trim().to_string());
            }
        }
    }
    m
}

/// File → the files of `src/` it imports, each path resolved to the file that defines what it
/// names (through a `mod.rs`'s re-exports, which are not imports of their own: a folder's face).
/// Not counted: a file's unit tests, globs, and uses of its own ancestor modules (its namespace).
fn file_imports(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let texts: BTreeMap<PathBuf, String> = files
        .iter()
        .map(|f| (f.clone(), code(&std::fs::read_to_string(f).expect("read"))))
        .collect();
    let mut out: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (f, text) in &texts {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        if name == "lib.rs" || name == "main.rs" {
            continue;
        }
        let is_mod = name == "mod.rs";
        let me = module_of(src, f);
        // a file's unit tests are a module one level down (their `super` is the file): left out
        let text = match text.find("#[cfg(test)]\nmod ") {
            Some(i) => &text[..i],
            None => &text[..],
        };
        // a folder's face: the names a mod.rs hands on (`pub use`) are not imports of its own
        let text: String = if is_mod {
            text.split_inclusive(';')
                .filter(|st| {
                    let t = st.trim_start();
                    !(t.starts_with("pub use ") || t.starts_with("pub(crate) use "))
                })
                .collect()
        } else {
            text.to_string()
        };
        let e = out.entry(f.clone()).or_default();
        for path in module_paths(&text, &me) {
            // the longest prefix that is a file; through a mod.rs, the file a name is re-exported from
            let mut target = None;
            for n in (0..=path.len()).rev() {
                if let Some(mut t) = module_file(src, &path[..n]) {
                    if t.ends_with("mod.rs") {
                        if let Some(sub) = path
                            .get(n)
                            .and_then(|next| reexports(&texts[&t]).remove(next))
                        {
                            let mut p2 = path[..n].to_vec();
                            p2.push(sub);
                            if let Some(t2) = module_file(src, &p2) {
                                t = t2;
                            }
                        }
                    }
                    target = Some(t);
                    break;
                }
            }
            let Some(t) = target else { continue };
            if &t == f || t.ends_with("lib.rs") {
                continue;
            }
            // a module's own ancestors (the mod.rs of a folder holding it) are the namespace it
            // lives in, the Rust habit of a child using its parent's types: not counted, as
            // farm-studio does not count them either
            let ancestor_dir = if t.ends_with("mod.rs") {
                t.parent().expect("a folder").to_path_buf()
            } else {
                t.with_extension("") // `a.rs` holding the modules of folder `a/`
            };
            if f.starts_with(&ancestor_dir) {
                continue;
            }
            e.insert(t);
        }
    }
    out
}

#[test]
fn no_circle_between_files() {
    let src = src();
    let g = file_imports(&src);
    fn visit(
        f: &Path,
        g: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        state: &mut BTreeMap<PathBuf, u8>,
        path: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        state.insert(f.to_path_buf(), 1);
        path.push(f.to_path_buf());
        for d in g.get(f).into_iter().flatten() {
            match state.get(d).copied().unwrap_or(0) {
                1 => {
                    let i = path.iter().position(|p| p == d).expect("on path");
                    let mut c = path[i..].to_vec();
                    c.push(d.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(d, g, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(f.to_path_buf(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for f in g.keys() {
        if state.get(f).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(f, &g, &mut state, &mut Vec::new()) {
                let names: Vec<String> = c
                    .iter()
                    .map(|p| p.strip_prefix(&src).unwrap().display().to_string())
                    .collect();
                panic!("import circle between files: {}", names.join(" -> "));
            }
        }
    }
}

#[test]
fn the_file_reader_resolves_super_and_reexports() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    let me = s(&["model", "graph"]);
    let p = module_paths(
        "mod op;\nuse super::config::ModelConfig;\nuse crate::{a::b, c};\nfn f() { op::build(); }",
        &me,
    );
    assert!(p.contains(&s(&["model", "config", "ModelConfig"])), "{p:?}");
    assert!(
        p.contains(&s(&["a", "b"])) && p.contains(&s(&["c"])),
        "{p:?}"
    );
    assert!(p.contains(&s(&["model", "graph", "op", "build"])), "{p:?}");
    let rx = reexports("pub use exec::{exec, run_graph, OpEnv};\npub use config::ModelConfig;");
    assert_eq!(rx.get("OpEnv").map(String::as_str), Some("exec"));
    assert_eq!(rx.get("ModelConfig").map(String::as_str), Some("config"));
    // the crate's own files: model/graph.rs imports model/op.rs and model/family/graph.rs
    let g = file_imports(&src());
    let graph = &g[&src().join("model/graph.rs")];
    assert!(graph.contains(&src().join("model/op.rs")), "{graph:?}");
    assert!(
        graph.contains(&src().join("model/family/graph.rs")),
        "{graph:?}"
    );
}
