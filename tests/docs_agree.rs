//! The user documentation names what the code holds: every lint rule in docs/lint-rules.md, every
//! config limit in the README with its bound. A rule or limit added without its documentation
//! fails here.

use nvfp4_probe::lint::rules::RULES;
use nvfp4_probe::model::limits::INTEGER_LIMITS;

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

#[test]
fn every_lint_rule_is_documented() {
    let doc = read("docs/lint-rules.md");
    let missing: Vec<&str> = RULES
        .iter()
        .map(|r| r.id)
        .filter(|id| {
            // a row names the rule itself or its family (`scale.global.non-finite` / `.zero` / …)
            let leaf = id.rsplit('.').next().unwrap();
            !(doc.contains(&format!("`{id}`")) || doc.contains(&format!("`.{leaf}`")))
        })
        .collect();
    assert!(missing.is_empty(), "docs/lint-rules.md lacks {missing:?}");
}

#[test]
fn every_config_limit_is_in_the_readme() {
    let readme = read("README.md");
    let start = readme
        .find("Limits of `config.json`")
        .expect("README section");
    let section = &readme[start..start + readme[start..].find("\n\n").unwrap()];
    for r in INTEGER_LIMITS {
        assert!(
            section.contains(&format!("`{}`", r.field)),
            "README's limits omit {}",
            r.field
        );
    }
    // the bounds as written: 65,536 for widths, 10,000 layers, 1,000 Sinkhorn rounds
    for (field, n) in [
        ("hidden_size", 65_536u64),
        ("num_hidden_layers", 10_000),
        ("hc_sinkhorn_iters", 1_000),
        ("hc_mult", 16),
        ("n_shared_experts", 64),
        ("index_n_heads", 1_024),
        ("n_routed_experts", 4_096),
    ] {
        let r = INTEGER_LIMITS.iter().find(|r| r.field == field).unwrap();
        assert_eq!(r.max, n, "{field}: the README says {n}");
    }
}

/// The README's `run --dump` → `compare` example, run exactly as printed (in an empty directory):
/// the dump carries the run's `input_ids`, so `compare` needs no token options and finds the
/// served path clean.
#[test]
fn readme_dump_then_compare_runs_as_printed() {
    let readme = read("README.md");
    let block = readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("\n```").next())
        .find(|b| b.contains("--dump dumps/") && b.contains("compare --trace dumps/"))
        .expect("README has the dump → compare example");
    let d = tempfile::tempdir().unwrap();
    let mut outputs = Vec::new();
    for line in block.lines() {
        let cmd = line.split('#').next().unwrap().trim();
        let words: Vec<&str> = cmd.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"nvfp4-probe"), "{line}");
        let out = assert_cmd::Command::cargo_bin("nvfp4-probe")
            .unwrap()
            .current_dir(d.path())
            .args(&words[1..])
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        assert_eq!(out.status.code(), Some(0), "`{cmd}`:\n{stdout}\n{stderr}");
        outputs.push(stdout);
    }
    assert_eq!(outputs.len(), 2, "{block}");
    assert!(
        outputs[1].contains("clean: all") && outputs[1].contains("L4.ffn.experts"),
        "{}",
        outputs[1]
    );
}
