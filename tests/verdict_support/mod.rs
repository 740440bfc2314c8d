//! Shared builders for the verdict tests: tiny checkpoints whose attention output projections are
//! the bytes compressed-tensors 0.20 and ModelOpt 0.47 wrote themselves (tests/data/producers),
//! faults planted by `synth --fault` or by editing stored scalars, and the CLI run on them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use nvfp4_probe::checkpoint::{Checkpoint, Naming, ShardWriter};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use tempfile::TempDir;

pub fn producers() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/producers")
}

/// A clean (or `synth --fault`-planted) tiny checkpoint.
pub fn synth(format: Format, seed: u64, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, seed);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    synth_to_dir(&o, d.path()).unwrap();
    d
}

/// Copy a checkpoint tensor by tensor; `edit` may change a tensor's bytes (and return its new
/// shape) or drop it (None).
pub fn rewrite(
    src: &Path,
    edit: impl Fn(&str, &[usize], &mut Vec<u8>) -> Option<Vec<usize>>,
) -> TempDir {
    let ck = Checkpoint::open(src).unwrap();
    let d = TempDir::new().unwrap();
    let mut w = ShardWriter::new(d.path(), 1 << 30).unwrap();
    for n in ck.tensor_names() {
        let i = ck.info(&n).unwrap();
        let mut b = ck.bytes(&n).unwrap().to_vec();
        if let Some(shape) = edit(&n, &i.shape, &mut b) {
            w.add(&n, i.dtype, &shape, b).unwrap();
        }
    }
    w.finish(&serde_json::to_string(ck.config_json()).unwrap())
        .unwrap();
    if src.join("hf_quant_config.json").exists() {
        std::fs::copy(
            src.join("hf_quant_config.json"),
            d.path().join("hf_quant_config.json"),
        )
        .unwrap();
    }
    d
}

pub fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes(b[..4].try_into().unwrap())
}

pub fn set_f32(b: &mut [u8], v: f32) {
    b[..4].copy_from_slice(&v.to_le_bytes());
}

/// A producer's stored tensor: (shape, bytes).
fn producer_tensor(file: &str, name: &str) -> (Vec<usize>, Vec<u8>) {
    let buf = std::fs::read(producers().join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let t = st.tensor(name).unwrap();
    (t.shape().to_vec(), t.data().to_vec())
}

/// The producers' `case.gaussian` (out 256, in 512: the tiny model's `attn.wo_b`) in place of
/// `wo_b` of every layer: compressed-tensors' packed nibbles and block-scale bytes for a
/// `ct-nvfp4` checkpoint, ModelOpt's for a `modelopt-nvfp4` one, with the tensor scale set so that
/// the weight decodes to 8 × the producer's own dequantization (×8 is exact: NVFP4 scales
/// power-of-two factors out of nibbles and block scales, so these are the bytes the producer
/// writes for 8 × its input; the tiny model's wo_b has an amax of the same order). Activation
/// scales stay the checkpoint's (calibrated on wo_b's input, which this does not change).
pub fn with_producer_wo_b(src: &Path, format: Format) -> TempDir {
    let (file, packed, gscale) = match format {
        Format::CtNvfp4 => (
            "ct-nvfp4.safetensors",
            "weight_packed",
            "weight_global_scale",
        ),
        Format::ModelOptNvfp4 => ("modelopt-nvfp4.safetensors", "weight", "weight_scale_2"),
        f => panic!("no producer bytes for {f:?}"),
    };
    let ct = format == Format::CtNvfp4;
    rewrite(src, |n, shape, b| {
        let Some(rest) = n.strip_prefix("layers.") else {
            return Some(shape.to_vec());
        };
        let Some((_, leaf)) = rest.split_once(".attn.wo_b.") else {
            return Some(shape.to_vec());
        };
        if leaf == packed || leaf == "weight_scale" {
            let (s, bytes) = producer_tensor(file, &format!("case.gaussian.{leaf}"));
            assert_eq!(
                s.iter().product::<usize>() * if leaf == packed { 2 } else { 16 },
                256 * 512,
                "{n}"
            );
            *b = bytes;
            return Some(s);
        }
        if leaf == gscale {
            let (_, bytes) = producer_tensor(file, &format!("case.gaussian.{leaf}"));
            let v = f32_of(&bytes);
            set_f32(b, if ct { v / 8.0 } else { v * 8.0 });
        }
        Some(shape.to_vec())
    })
}

/// Run the CLI; (exit code, stdout).
pub fn cli(args: &[&str], model: &Path) -> (i32, String) {
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("nvfp4-probe"))
        .args(args)
        .arg("--model")
        .arg(model)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// `run --backend cpu --quiet --json` on `model` (exit 0 expected): the report.
pub fn run_report(model: &Path) -> serde_json::Value {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("run.json");
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("nvfp4-probe"))
        .args(["run", "--backend", "cpu", "--quiet", "--model"])
        .arg(model)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// A stored scalar of a checkpoint.
pub fn scalar(dir: &Path, name: &str) -> f32 {
    let ck = Checkpoint::open(dir).unwrap();
    f32_of(ck.bytes(name).unwrap())
}
