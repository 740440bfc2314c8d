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
