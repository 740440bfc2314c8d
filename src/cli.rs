//! Command-line arguments (clap derive). `main.rs` parses and dispatches; each command lives in
//! its own module and takes its args struct from here.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "nvfp4-probe",
    version,
    about = "Layer-by-layer numerical probe for quantized DeepSeek-V4 checkpoints (NVFP4, FP8 block, MXFP4, BF16)",
    long_about = "Runs a DeepSeek-V4 checkpoint op by op in three numerics paths (FP32 oracle, BF16 oracle, the \
serving stack's quantized numerics), reports amax / NaN / cosine per op, finds the first divergent op and the \
scale responsible, lints checkpoints, and gates CI on numerical regressions.\n\nExit codes: 0 clean, 1 findings \
(NaN, divergence, lint errors, regressions), 2 unusable input."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run layers op by op on all numerics paths and report per-op metrics.
    Run(RunArgs),
    /// List every weight of a checkpoint with its scheme, scales and health; or dequantize one tensor.
    Inspect(InspectArgs),
    /// Write a synthetic DeepSeek-V4 checkpoint in a real on-disk format.
    Synth(SynthArgs),
    /// Find broken scales in a checkpoint before anything runs.
    Lint(LintArgs),
    /// Find the first divergent op and the scale parameter responsible.
    Bisect(BisectArgs),
    /// Compare a run against a baseline run with tolerances (the CI gate).
    Gate(GateArgs),
    /// Draw the plots of a run JSON.
    Plot(PlotArgs),
    /// Compare an engine's dumped activations against the oracle.
    Compare(CompareArgs),
    /// Check every backend kernel against the CPU reference on random data.
    Selftest(SelftestArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The GPU when a usable one exists, else the CPU (one line says why).
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// Where the tokens come from. Without any of these a fixed synthetic sequence is used.
#[derive(Args, Debug, Clone, Default)]
pub struct TokenArgs {
    /// JSON file holding an array of token ids.
    #[arg(long, value_name = "FILE")]
    pub tokens: Option<PathBuf>,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub token_ids: Option<Vec<u32>>,
    /// Text, tokenized with the checkpoint's tokenizer.json.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Number of synthetic tokens when no other source is given.
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// Checkpoint directory; without it the built-in tiny synthetic model is used.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Layers to run, inclusive: `0..4` is layers 0,1,2,3,4; `3` is layer 3 alone.
    #[arg(long, value_name = "A..B")]
    pub layers: Option<String>,
    #[command(flatten)]
    pub tokens: TokenArgs,
    /// Probe spec (TOML); the default spec is built in.
    #[arg(long, value_name = "FILE")]
    pub probe: Option<PathBuf>,
    /// Served-numerics profile: blackwell-w4a4, hopper-w4a16, emulation.
    #[arg(long, value_name = "PROFILE")]
    pub served: Option<String>,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Write the run JSON (schema nvfp4-probe.run/1).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the markdown report.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write each path's op outputs as F32 safetensors under DIR.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
    /// Write plots (PNG or SVG by extension; FILE is a stem for the three plots).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Emulate a loader bug in the served path: KIND@TARGET (repeatable).
    #[arg(long = "loader-fault", value_name = "KIND@TARGET")]
    pub loader_faults: Vec<String>,
    /// Seed of the built-in model (when --model is absent).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print only the summary, not the full op table.
    #[arg(long)]
    pub quiet: bool,
    /// Absorbed findings (a divergence no later op sees, a lint finding whose effect a norm
    /// removes) are errors too: exit 1 instead of 0.
    #[arg(long)]
    pub strict: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct InspectArgs {
    /// Checkpoint directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// List the weights whose canonical or raw name matches GLOB (`*` any run, `?` one
    /// character), e.g. `layers.3.ffn.experts.*.w1`, instead of the per-layer summary.
    #[arg(long, value_name = "GLOB")]
    pub filter: Option<String>,
    /// List every weight instead of the per-layer summary.
    #[arg(long)]
    pub all: bool,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Dequantize this tensor (checkpoint name of the weight) to F32.
    #[arg(long, value_name = "NAME", requires = "out")]
    pub dequant: Option<String>,
    /// Output safetensors file for --dequant.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SynthArgs {
    /// tiny | flash-layer
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// bf16 | ct-nvfp4 | modelopt-nvfp4 | official-mixed | mxfp4
    #[arg(long, default_value = "bf16")]
    pub format: String,
    /// hf | official
    #[arg(long, default_value = "official")]
    pub naming: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Plant a fault: KIND@TARGET (repeatable). See --list-faults.
    #[arg(long = "fault", value_name = "KIND@TARGET")]
    pub faults: Vec<String>,
    /// Print the fault catalogue and exit.
    #[arg(long)]
    pub list_faults: bool,
    /// Number of layers (preset default when absent).
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long, value_name = "DIR", required_unless_present = "list_faults")]
    pub out: Option<PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct LintArgs {
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// TOML file adjusting rule severities / thresholds.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// Reference checkpoint (BF16 original or another format) to compare tensor by tensor.
    #[arg(long, value_name = "DIR")]
    pub reference: Option<PathBuf>,
    /// List every tensor of a grouped finding with its own evidence (by default findings of one
    /// root cause — same rule, op and fix — are shown as one).
    #[arg(long)]
    pub verbose: bool,
    /// Findings whose effect is provably absorbed downstream are errors too.
    #[arg(long)]
    pub strict: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct BisectArgs {
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    #[arg(long, value_name = "A..B")]
    pub layers: Option<String>,
    #[command(flatten)]
    pub tokens: TokenArgs,
    #[arg(long, value_name = "PROFILE")]
    pub served: Option<String>,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    #[arg(long = "loader-fault", value_name = "KIND@TARGET")]
    pub loader_faults: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How to find the first divergent op: `linear` (one full run), `layers` (binary search over
    /// layers on propagated error, then one layer in full), `auto` (`layers` for big checkpoints).
    #[arg(long, value_enum, default_value_t = crate::bisect::Search::Auto)]
    pub search: crate::bisect::Search,
    /// Absorbed findings are errors too: exit 1 instead of 0.
    #[arg(long)]
    pub strict: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct GateArgs {
    #[arg(long, value_name = "BASE.json")]
    pub baseline: PathBuf,
    #[arg(long, value_name = "CUR.json")]
    pub current: PathBuf,
    #[arg(long, value_name = "FILE")]
    pub tolerances: Option<PathBuf>,
    #[arg(long, value_name = "FILE.md")]
    pub summary: Option<PathBuf>,
    #[arg(long, value_name = "FILE.xml")]
    pub junit: Option<PathBuf>,
    /// Compare even when checkpoint or token fingerprints differ.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct PlotArgs {
    /// Run JSON written by `run --json`.
    pub run_json: PathBuf,
    /// Output stem (`.png` or `.svg` decides the format).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Args, Debug, Clone, Default)]
pub struct CompareArgs {
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    #[arg(long, value_name = "FILE_OR_DIR")]
    pub trace: PathBuf,
    /// vllm | sglang | hf | official | MAPFILE
    #[arg(long, default_value = "official")]
    pub names: String,
    #[command(flatten)]
    pub tokens: TokenArgs,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SelftestArgs {
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Size multiplier of the random test tensors.
    #[arg(long, default_value_t = 1)]
    pub scale: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Checkpoint for the whole-run comparison (CPU vs CUDA); default: the built-in tiny model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Layers of the whole-run comparison.
    #[arg(long, value_name = "A..B", default_value = "0..4")]
    pub layers: String,
    /// Tokens of the whole-run comparison.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Served profiles to compare whole runs under (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "blackwell-w4a4,hopper-w4a16,emulation"
    )]
    pub served: Vec<String>,
    /// Kernel checks only (no whole-run comparison).
    #[arg(long)]
    pub kernels_only: bool,
    /// Also measure kernel bandwidth on tensors of this many GiB (packed NVFP4 weight size).
    #[arg(long, value_name = "GIB")]
    pub bench: Option<f64>,
    /// Write the results as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write rcp.approx.ftz's deviation from the correctly rounded reciprocal (i8 ulps per
    /// mantissa of [1, 2), 2^23 bytes) to FILE.
    #[arg(long, value_name = "FILE")]
    pub rcp_table: Option<PathBuf>,
}
