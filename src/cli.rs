//! Command-line arguments (clap derive). `main.rs` parses and dispatches; each command lives in
//! its own module and takes its args struct from here.

use crate::model::layers::LayerRange;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "nvfp4-probe",
    version,
    about = "Layer-by-layer numerical probe for quantized MoE checkpoints (NVFP4, FP8 block, MXFP4, BF16) of \
DeepSeek-V4, Qwen3-MoE, DeepSeek-V3/R1 and gpt-oss",
    long_about = "Runs a quantized checkpoint (DeepSeek-V4, Qwen3-MoE, DeepSeek-V3/R1 or gpt-oss; the family is \
read from config.json) op by op in three numerics paths (FP32 oracle, BF16 oracle, the serving stack's quantized \
numerics), reports amax / NaN / cosine per op, finds the first divergent op and the scale responsible, lints \
checkpoints, and gates CI on numerical regressions.\n\nExit codes: 0 clean, 1 findings (NaN, divergence, lint \
errors, regressions), 2 unusable input."
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
    /// Write a synthetic checkpoint (DeepSeek-V4, or --family qwen3-moe, deepseek-v3, gpt-oss) in a
    /// real on-disk format.
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
    /// The CPU reference backend (multi-threaded; slow on full-size layers).
    Cpu,
    /// The CUDA backend; an error (exit 2) when no usable GPU or driver is found.
    Cuda,
}

/// `selftest`'s device: the CPU is what the GPU is checked against, so it is no choice here.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SelftestBackend {
    /// The GPU when a usable one exists; an error (exit 2) naming why when none does.
    #[default]
    Auto,
    /// The CUDA backend; an error (exit 2) when no usable GPU or driver is found.
    Cuda,
    /// Refused with the reason (selftest compares the GPU with the CPU reference).
    #[value(hide = true)]
    Cpu,
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
    /// Number of synthetic tokens when no other source is given [default: the probe spec's
    /// tokens.seq_len; 64 in the built-in spec].
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
}

/// The memory budget a run's up-front estimate is held to, and its token chunks (run, bisect,
/// compare).
#[derive(Args, Debug, Clone, Default)]
pub struct MemArgs {
    /// Memory budget in GiB (host, and device on CUDA) below what the machine reports available
    /// (a larger one is held to the machine's limit); a run whose estimate exceeds it is refused
    /// before it allocates (exit 2). A prompt too long to run at once within it runs in token
    /// chunks (--chunk).
    #[arg(long, value_name = "GIB")]
    pub max_mem: Option<f64>,
    /// Run each layer over the prompt N tokens at a time: every op of the layer on a chunk, the
    /// window's KV rows, the compressors' pending rows and the compressed keys carried to the
    /// next chunk as the model defines them, so the results are those of the whole prompt at
    /// once (bit for bit on the CPU backend) in the memory of one chunk [default: the whole
    /// prompt when it fits, else the largest chunk that fits --mem-gib or the memory limit].
    #[arg(long, value_name = "N", conflicts_with = "mem_gib")]
    pub chunk: Option<usize>,
    /// Memory budget in GiB (device memory on CUDA, host memory on the CPU) the token chunk is
    /// chosen for: the largest chunk whose estimate fits (a multiple of 512 tokens from 512 on;
    /// on CUDA beside the layers' output streams when a chunk of 4,096 fits there). A budget too
    /// small for a chunk of one token exits 2 naming the smallest workable budget.
    #[arg(long, value_name = "GIB")]
    pub mem_gib: Option<f64>,
}

/// How the served path prefills the prompt (run, bisect).
#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// Prefill the served path as a serving engine's chunked prefill does, N tokens at a time:
    /// each chunk's attention reads the earlier chunks' keys from an FP8 KV cache (vLLM's
    /// fp8_ds_mla: 448 dims E4M3 per 64 with power-of-two scales, 64 RoPE dims BF16), the
    /// indexer its keys from an FP8 cache (one scale per key), the compressors carry their
    /// pending rows across chunks. A chunk-boundary bug then diverges
    /// at the first op after a boundary. The oracles run the whole prompt. DeepSeek-V4 only.
    #[arg(long, value_name = "N")]
    pub served_chunk: Option<usize>,
    /// Emulate an engine bug at the --served-chunk boundaries: KIND or KIND@Ln (one layer).
    /// compressor-state-lost: the compressors' pending rows read as zeros after a boundary;
    /// window-context-zeroed: the sliding window's KV rows of the chunk before read as zeros;
    /// rope-position-reset: q_rope / kv_rope positions counted from each chunk's first token.
    #[arg(
        long = "engine-fault",
        value_name = "KIND[@Ln]",
        requires = "served_chunk"
    )]
    pub engine_faults: Vec<String>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// Checkpoint directory; without it the built-in tiny synthetic model is used.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Layers to run, inclusive: `0..4` is layers 0,1,2,3,4; `3` is layer 3 alone [default:
    /// the probe spec's; 0..4 in the built-in spec].
    #[arg(long, value_name = "A..B")]
    pub layers: Option<LayerRange>,
    #[command(flatten)]
    pub tokens: TokenArgs,
    /// Probe spec (TOML: layers, ops, tokens, served profile, thresholds); the default spec
    /// (probes/default.toml) is built in.
    #[arg(long, value_name = "FILE")]
    pub probe: Option<PathBuf>,
    /// How the serving engine computes the quantized linears (the served path): blackwell-w4a4
    /// (NVFP4 weights and activations, the activations quantized at run time with the
    /// checkpoint's static scale, as Blackwell's W4A4 kernels do), hopper-w4a16 (NVFP4 weights,
    /// BF16 activations: Marlin on Hopper) or emulation (vLLM's emulation backend: activations
    /// quantized and dequantized, weights dequantized to BF16, a BF16 matmul). FP8-block and
    /// MXFP4 weights take FP8 1×128 activations [default: the probe spec's; blackwell-w4a4 in the
    /// built-in spec].
    #[arg(long, value_name = "PROFILE")]
    pub served: Option<String>,
    /// Where the ops run.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Write the run JSON (schema nvfp4-probe.run/1).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the markdown report.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write each path's op outputs as F32 safetensors under DIR (created if absent).
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
    /// With --dump: keep only these token rows (0-based, inclusive ranges: `0,17,4090..4095`),
    /// so a long prompt's dump holds what you look at; the run keeps no other row in memory.
    #[arg(long, value_name = "ROWS", requires = "dump")]
    pub dump_rows: Option<TokenRows>,
    /// Write the three plots STEM-amax, STEM-cos and STEM-heatmap next to FILE (STEM.png or
    /// STEM.svg: the extension picks the format).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Emulate a loader bug in the served path: KIND@TARGET, e.g.
    /// inverted-input-scale@L1.attn.q_b (repeatable; kinds: synth --list-faults).
    #[arg(long = "loader-fault", value_name = "KIND@TARGET")]
    pub loader_faults: Vec<String>,
    /// Seed of the built-in model (when --model is absent).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print only the summary, not the full op table.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub mem: MemArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Absorbed findings (a divergence no later op sees, a lint finding whose effect a norm
    /// removes) are errors too: exit 1 instead of 0.
    #[arg(long)]
    pub strict: bool,
    /// The original (BF16/FP8, any supported layout) to compare the weights the run reads with,
    /// tensor by tensor as `lint --reference` does: a weight that decodes off it is an error
    /// naming the stored scale and the factor. Read only.
    #[arg(long, value_name = "DIR")]
    pub reference: Option<PathBuf>,
    /// Also give every routed expert no token reached the prompt's first 8 rows, as calibration
    /// does, and measure it there (beside the model: its output does not change).
    #[arg(long)]
    pub exercise_experts: bool,
    /// Measure routed-experts ops only as a whole (skip each expert on its own rows).
    #[arg(long, conflicts_with = "exercise_experts")]
    pub no_expert_metrics: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct InspectArgs {
    /// Checkpoint directory (config.json and safetensors shards).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// List the weights whose canonical or raw name matches GLOB (`*` any run, `?` one
    /// character), e.g. `layers.3.ffn.experts.*.w1`, instead of the per-layer summary.
    #[arg(long, value_name = "GLOB")]
    pub filter: Option<String>,
    /// List every weight instead of the per-layer summary.
    #[arg(long)]
    pub all: bool,
    /// Also write the weights as JSON (schema nvfp4-probe.inspect/1).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Dequantize this tensor (checkpoint name of the weight) to F32.
    #[arg(long, value_name = "NAME", requires = "out")]
    pub dequant: Option<String>,
    /// Output safetensors file for --dequant (one F32 tensor).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SynthArgs {
    /// A model family other than DeepSeek-V4, in its release's layout and transformers' names:
    /// qwen3-moe (formats bf16, ct-nvfp4, modelopt-nvfp4), deepseek-v3 (those and fp8-block,
    /// DeepSeek's FP8 release) or gpt-oss (bf16, mxfp4: OpenAI's release, fused experts);
    /// --preset tiny, or release (deepseek-v3 only).
    #[arg(long, value_name = "FAMILY")]
    pub family: Option<String>,
    /// Model size: tiny (5 small layers, tens of MB; 4 layers for a --family), flash-layer
    /// (1 layer of V4-Flash dimensions, GBs) or release (--family deepseek-v3: 2 layers of the
    /// released dimensions, one dense and one of 256 experts; about 8 GB in NVFP4).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// On-disk format: bf16, ct-nvfp4, modelopt-nvfp4, official-mixed, mxfp4 or mxfp8
    /// (fp8-block with --family deepseek-v3; bf16 or mxfp4 with --family gpt-oss).
    #[arg(long, default_value = "bf16")]
    pub format: String,
    /// Tensor naming: official (DeepSeek's release) or hf (Hugging Face transformers)
    /// [default: official; hf with --family, the only naming the families' releases use].
    #[arg(long)]
    pub naming: Option<String>,
    /// Seed of the generated weights (same seed, same bytes).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Plant a fault: KIND@TARGET (repeatable). See --list-faults.
    #[arg(long = "fault", value_name = "KIND@TARGET")]
    pub faults: Vec<String>,
    /// Print the fault catalogue and exit.
    #[arg(long)]
    pub list_faults: bool,
    /// Number of layers [default: the preset's].
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Output directory; must not exist or be empty unless --force. The checkpoint is written
    /// into a temporary directory beside it and renamed into place when complete.
    #[arg(long, value_name = "DIR", required_unless_present = "list_faults")]
    pub out: Option<PathBuf>,
    /// Replace a non-empty --out checkpoint directory (holding config.json or *.safetensors and
    /// no subdirectory), only once the new checkpoint is complete.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct LintArgs {
    /// Checkpoint directory to lint (config.json and safetensors shards).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Also write the findings as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also write the findings as a markdown report.
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
    /// Tensor-parallel size to check the shards of: every sharded dimension must split into
    /// whole scale blocks per rank (rule tp.scale-block).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub tp: Option<u64>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct BisectArgs {
    /// Checkpoint directory; without it the built-in tiny synthetic model is used.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Layers to search, inclusive: `0..4` is layers 0,1,2,3,4; `3` is layer 3 alone
    /// [default: 0..4, the built-in probe spec's].
    #[arg(long, value_name = "A..B")]
    pub layers: Option<LayerRange>,
    #[command(flatten)]
    pub tokens: TokenArgs,
    /// How the serving engine computes the quantized linears (the served path): blackwell-w4a4
    /// (NVFP4 weights and activations, the activations quantized at run time with the
    /// checkpoint's static scale), hopper-w4a16 (NVFP4 weights, BF16 activations: Marlin) or
    /// emulation (vLLM's emulation backend: a BF16 matmul of dequantized operands) [default:
    /// blackwell-w4a4, the built-in probe spec's].
    #[arg(long, value_name = "PROFILE")]
    pub served: Option<String>,
    /// Where the ops run.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Write the verdict, the ranked hypotheses and the search as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the verdict as a markdown report.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Emulate a loader bug in the served path: KIND@TARGET, e.g.
    /// inverted-input-scale@L1.attn.q_b (repeatable; kinds: synth --list-faults).
    #[arg(long = "loader-fault", value_name = "KIND@TARGET")]
    pub loader_faults: Vec<String>,
    /// Seed of the built-in model (when --model is absent).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How to find the first divergent op: `linear` (one full run), `layers` (binary search over
    /// layers on propagated error, then one layer in full), `auto` (see its value below).
    #[arg(long, value_enum, default_value_t = crate::bisect::Search::Auto)]
    pub search: crate::bisect::Search,
    #[command(flatten)]
    pub mem: MemArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Absorbed findings are errors too: exit 1 instead of 0.
    #[arg(long)]
    pub strict: bool,
    /// The original (BF16/FP8, any supported layout) to compare the weights the search reads
    /// with, as `run --reference` does. Read only.
    #[arg(long, value_name = "DIR")]
    pub reference: Option<PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct GateArgs {
    /// The baseline run JSON (`run --json`), e.g. the committed reports/baseline.json.
    #[arg(long, value_name = "BASE.json")]
    pub baseline: PathBuf,
    /// The run JSON to check against the baseline.
    #[arg(long, value_name = "CUR.json")]
    pub current: PathBuf,
    /// Tolerance rules (TOML), checked before the built-in ones (unless the file says
    /// `defaults = false`) [default: the built-in rules].
    #[arg(long, value_name = "FILE")]
    pub tolerances: Option<PathBuf>,
    /// Write a markdown summary (for a PR comment or $GITHUB_STEP_SUMMARY).
    #[arg(long, value_name = "FILE.md")]
    pub summary: Option<PathBuf>,
    /// Write a JUnit XML report (one test case per op).
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
    /// STEM.png or STEM.svg: writes STEM-amax, STEM-cos and STEM-heatmap beside it (the
    /// extension picks the format).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Args, Debug, Clone, Default)]
pub struct CompareArgs {
    /// Checkpoint the engine served; without it the built-in tiny synthetic model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// The engine's dumped activations: one safetensors file, or a directory of them (one per
    /// rank / pass).
    #[arg(long, value_name = "FILE_OR_DIR")]
    pub trace: PathBuf,
    /// How the trace names its tensors: vllm, sglang, hf, official, or a TOML map file.
    #[arg(long, default_value = "official")]
    pub names: String,
    #[command(flatten)]
    pub tokens: TokenArgs,
    /// Write the comparison as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the comparison as a markdown report.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Seed of the built-in model (when --model is absent).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub mem: MemArgs,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SelftestArgs {
    /// The GPU to check against the CPU reference (a GPU is required).
    #[arg(long, value_enum, default_value_t = SelftestBackend::Auto)]
    pub backend: SelftestBackend,
    /// Size multiplier of the random test tensors.
    #[arg(long, default_value_t = 1)]
    pub scale: usize,
    /// Seed of the random test tensors and of the built-in model.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Checkpoint for the whole-run comparison (CPU vs CUDA); default: the built-in tiny model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Layers of the whole-run comparison.
    #[arg(long, value_name = "A..B", default_value = "0..4")]
    pub layers: LayerRange,
    /// Tokens of the whole-run comparison.
    #[arg(long, value_name = "N", default_value_t = 64)]
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
    /// Write how far the GPU's fast approximate reciprocal (the instruction the kernels divide
    /// with) is from the correctly rounded reciprocal to FILE: one signed byte per mantissa of
    /// [1, 2), in units in the last place (2^23 bytes).
    #[arg(long, value_name = "FILE")]
    pub rcp_table: Option<PathBuf>,
}

/// Token rows named on the command line: indices and inclusive ranges, `0,17,4090..4095`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenRows(pub Vec<(usize, usize)>);

impl TokenRows {
    /// The rows of a prompt of `t` tokens, ascending and each once; a row past the prompt is a
    /// usage error naming it and the prompt's length.
    pub fn resolve(&self, t: usize) -> crate::Result<Vec<usize>> {
        let mut rows = Vec::new();
        for &(a, b) in &self.0 {
            if b >= t {
                return Err(crate::Error::usage(format!(
                    "--dump-rows: row {b} is past the prompt's {t} tokens (rows 0..{})",
                    t.saturating_sub(1)
                )));
            }
            rows.extend(a..=b);
        }
        rows.sort_unstable();
        rows.dedup();
        Ok(rows)
    }
}

impl std::str::FromStr for TokenRows {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut v = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            let num = |x: &str| -> std::result::Result<usize, String> {
                x.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("`{x}` in `{s}` is not a token row (0, 1, 2, ...)"))
            };
            let (a, b) = match part.split_once("..") {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(part)?, num(part)?),
            };
            if a > b {
                return Err(format!("`{part}`: a range runs upward (`{b}..{a}`)"));
            }
            v.push((a, b));
        }
        Ok(TokenRows(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every argument of every subcommand says what it is for (`--help` has no blank lines).
    #[test]
    fn every_argument_has_help() {
        let cmd = Cli::command();
        let mut missing = Vec::new();
        let mut seen = 0;
        for sub in cmd.get_subcommands() {
            assert!(sub.get_about().is_some(), "{} has no about", sub.get_name());
            for a in sub.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                seen += 1;
                let help = a
                    .get_long_help()
                    .or(a.get_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default();
                if help.trim().is_empty() {
                    missing.push(format!("{} --{id}", sub.get_name()));
                }
                // enum values say what each one does, too (flags' true/false are not values)
                let values = if a.get_action().takes_values() {
                    a.get_possible_values()
                } else {
                    Vec::new()
                };
                for v in values {
                    if v.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                        missing.push(format!("{} --{id} {}", sub.get_name(), v.get_name()));
                    }
                }
            }
        }
        assert!(seen > 60, "walked only {seen} arguments");
        assert!(missing.is_empty(), "no help: {missing:?}");
    }

    /// `--search auto`'s help states the thresholds the program uses.
    #[test]
    fn search_help_matches_the_auto_thresholds() {
        let cmd = Cli::command();
        let bisect = cmd.find_subcommand("bisect").expect("bisect");
        let search = bisect
            .get_arguments()
            .find(|a| a.get_id() == "search")
            .expect("--search");
        let auto = search
            .get_possible_values()
            .into_iter()
            .find(|v| v.get_name() == "auto")
            .and_then(|v| v.get_help().map(|h| h.to_string()))
            .expect("auto help");
        use crate::bisect::search::{AUTO_LAYER_BYTES, AUTO_MIN_LAYERS};
        assert!(
            auto.contains(&format!("at least {AUTO_MIN_LAYERS} layers")),
            "{auto}"
        );
        assert!(
            auto.contains(&format!("at least {} MiB", AUTO_LAYER_BYTES >> 20)),
            "{auto}"
        );
    }

    /// The defaults the help states are the program's: the built-in spec's layers, tokens and
    /// served profile.
    #[test]
    fn stated_defaults_are_the_built_in_specs() {
        let spec = crate::probe::spec::ProbeSpec::builtin();
        assert_eq!(spec.layers, Some(LayerRange::new(0, 4)));
        assert_eq!(spec.tokens.seq_len, Some(64));
        assert_eq!(spec.served.as_deref(), Some("blackwell-w4a4"));
        let help = Cli::command()
            .find_subcommand_mut("run")
            .expect("run")
            .render_long_help()
            .to_string();
        for want in [
            "0..4 in the built-in spec",
            "64 in the built-in spec",
            "blackwell-w4a4 in the built-in spec",
        ] {
            assert!(help.contains(want), "run --help lacks `{want}`");
        }
    }
}
