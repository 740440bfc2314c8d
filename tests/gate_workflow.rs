//! The example CI workflow uses exactly the documented command lines, and the CLI accepts them.

use clap::Parser;
use nvfp4_probe::cli::{Cli, Command};

const WORKFLOW: &str = include_str!("../.github/workflows/numerics.yml");

fn command_line(prefix: &str) -> Vec<String> {
    let line = WORKFLOW
        .lines()
        .map(str::trim)
        .map(|l| l.strip_prefix("run: ").unwrap_or(l))
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in the workflow"));
    let line = line.replace("\"${{ vars.NVFP4_PROBE_MODEL }}\"", "/models/dsv4");
    line.split_whitespace()
        .map(|s| s.trim_start_matches("./target/release/").to_string())
        .collect()
}

#[test]
fn workflow_commands_are_the_documented_ones() {
    assert!(WORKFLOW.contains("cargo build --release"));
    assert!(WORKFLOW.contains(
        "./target/release/nvfp4-probe run --model \"${{ vars.NVFP4_PROBE_MODEL }}\" --probe probes/default.toml --json current.json --markdown current.md --plot current.png"
    ));
    assert!(WORKFLOW.contains(
        "./target/release/nvfp4-probe gate --baseline reports/baseline.json --current current.json --summary summary.md --junit junit.xml"
    ));
    assert!(WORKFLOW.contains("$GITHUB_STEP_SUMMARY"));
    assert!(WORKFLOW.contains("actions/upload-artifact"));
    assert!(WORKFLOW.contains("actions/github-script"));
}

#[test]
fn the_cli_parses_the_workflow_commands() {
    let run = Cli::try_parse_from(command_line("./target/release/nvfp4-probe run")).unwrap();
    match run.command {
        Command::Run(a) => {
            assert_eq!(a.model.unwrap().to_str(), Some("/models/dsv4"));
            assert_eq!(a.plot.unwrap().to_str(), Some("current.png"));
            assert_eq!(a.json.unwrap().to_str(), Some("current.json"));
        }
        other => panic!("{other:?}"),
    }
    let gate = Cli::try_parse_from(command_line("./target/release/nvfp4-probe gate")).unwrap();
    match gate.command {
        Command::Gate(a) => {
            assert_eq!(a.baseline.to_str(), Some("reports/baseline.json"));
            assert_eq!(a.summary.unwrap().to_str(), Some("summary.md"));
            assert_eq!(a.junit.unwrap().to_str(), Some("junit.xml"));
            assert!(!a.force);
        }
        other => panic!("{other:?}"),
    }
}
