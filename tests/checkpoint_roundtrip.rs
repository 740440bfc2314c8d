//! Write checkpoints in every scheme and naming through `ShardWriter`, read them back through
//! `Checkpoint`, and compare dequantised weights with values computed from the spec formulas.

#[path = "checkpoint_common/mod.rs"]
mod common;

use common::*;
use nvfp4_probe::checkpoint::{Checkpoint, Dtype, Naming, ShardWriter, WeightFormat};
use std::collections::BTreeSet;

/// Scheme each base of `official_layer` must be detected as.
const SCHEMES: [(&str, &str); 10] = [
    ("layers.0.attn.wq_a", "bf16"),
    ("layers.0.attn.wq_b", "fp8-block"),
    ("layers.0.attn.wkv", "fp8-block"),
    ("layers.0.attn.wo_a", "nvfp4-ct"),
    ("layers.0.attn.wo_b", "nvfp4-modelopt"),
    ("layers.0.ffn.experts.0.w1", "mxfp4"),
    ("layers.0.ffn.experts.1.w1", "nvfp4-modelopt"),
    ("layers.0.ffn.experts.1.w2", "nvfp4-modelopt"),
    ("layers.0.ffn.shared_experts.w2", "fp8-block"),
    ("head", "bf16"),
];

/// HF module names, transcribed from docs/DSV4-LAYER.md §2.2.
fn hf_base(base: &str) -> String {
    let map = [
        ("layers.0.attn.wq_a", "model.layers.0.self_attn.q_a_proj"),
        ("layers.0.attn.wq_b", "model.layers.0.self_attn.q_b_proj"),
        ("layers.0.attn.wkv", "model.layers.0.self_attn.kv_proj"),
        ("layers.0.attn.wo_a", "model.layers.0.self_attn.o_a_proj"),
        ("layers.0.attn.wo_b", "model.layers.0.self_attn.o_b_proj"),
        (
            "layers.0.ffn.experts.0.w1",
            "model.layers.0.mlp.experts.0.gate_proj",
        ),
        (
            "layers.0.ffn.experts.1.w1",
            "model.layers.0.mlp.experts.1.gate_proj",
        ),
        (
            "layers.0.ffn.experts.1.w2",
            "model.layers.0.mlp.experts.1.down_proj",
        ),
        (
            "layers.0.ffn.shared_experts.w2",
            "model.layers.0.mlp.shared_experts.down_proj",
        ),
        ("head", "lm_head"),
        ("layers.0.attn_norm", "model.layers.0.input_layernorm"),
        ("layers.0.attn.kv_norm", "model.layers.0.self_attn.kv_norm"),
        ("embed", "model.embed_tokens"),
    ];
    map.iter()
        .find(|(o, _)| *o == base)
        .map(|(_, h)| h.to_string())
        .unwrap()
}

fn hybrid_base(base: &str) -> String {
    match base {
        "head" => "head".into(),
        "embed" => "model.embed_tokens".into(),
        "layers.0.attn.kv_norm" => "model.layers.0.attn.norm".into(),
        b => format!("model.{b}"),
    }
}

fn split(name: &str) -> (&str, &str) {
    let known = [
        "layers.0.attn_norm.weight",
        "layers.0.attn.kv_norm.weight",
        "embed.weight",
    ];
    if known.contains(&name) {
        return name.rsplit_once('.').unwrap();
    }
    (name, "")
}

/// Extras renamed into a naming; tensors without a rename (hc, tid2eid) keep official
/// leaves under the naming's prefix rules.
fn extras_in(naming: Naming) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    extras()
        .into_iter()
        .map(|(n, d, s, b)| {
            let (base, leaf) = split(&n);
            let name = match (naming, leaf) {
                (Naming::Official, _) => n.clone(),
                (Naming::Hf, "weight") => format!("{}.weight", hf_base(base)),
                (Naming::HfHybrid, "weight") => format!("{}.weight", hybrid_base(base)),
                (Naming::Hf, _) if n == "layers.0.hc_attn_fn" => "model.layers.0.attn_hc.fn".into(),
                (Naming::Hf, _) if n == "layers.0.ffn.gate.tid2eid" => {
                    "model.layers.0.mlp.gate.tid2eid".into()
                }
                (_, _) => format!("model.{n}"),
            };
            (name, d, s, b)
        })
        .collect()
}

fn check_layer(ck: &Checkpoint, weights: &[(String, Built)], raw_base: impl Fn(&str) -> String) {
    for ((base, b), (sb, scheme)) in weights.iter().zip(SCHEMES) {
        assert_eq!(base, sb);
        let w = ck.weight(base).unwrap_or_else(|e| panic!("{base}: {e}"));
        assert_eq!(w.scheme(), scheme, "{base}");
        assert_eq!((w.out_features, w.in_features), (b.out, b.inp), "{base}");
        let t = w.dequantize().unwrap();
        assert_eq!(t.shape, vec![b.out, b.inp]);
        assert_f32_eq(&t.data, &b.expected, base);
        let leaf = &b.parts[0].0;
        assert_eq!(
            ck.resolve(&format!("{base}.{leaf}")).unwrap(),
            format!("{}.{leaf}", raw_base(base))
        );
        assert_eq!(w.tensors.weight, format!("{}.{leaf}", raw_base(base)));
    }
    // Activation scales as stored, or None when absent (not an error).
    let g = |b: &str| match ck.weight(b).unwrap().format {
        WeightFormat::Nvfp4 {
            input_global,
            weight_global,
            ..
        } => (weight_global, input_global),
        _ => panic!("{b} not nvfp4"),
    };
    assert_eq!(g("layers.0.attn.wo_a"), (30_927.102, Some(448.0)));
    assert_eq!(g("layers.0.attn.wo_b"), (3.233_41e-5, Some(0.25)));
    assert_eq!(g("layers.0.ffn.experts.1.w1"), (3.233_41e-5, None));
    let bases: BTreeSet<String> = ck.weight_bases().into_iter().collect();
    let want: BTreeSet<String> = SCHEMES.iter().map(|s| s.0.to_string()).collect();
    assert_eq!(bases, want);
}

fn check_extras(ck: &Checkpoint) {
    let t = ck.tensor_f32("layers.0.ffn.gate.tid2eid").unwrap();
    assert_eq!(t.shape, vec![32, 2]);
    assert_eq!(&t.data[..6], &[0.0, 1.0, 2.0, 3.0, 0.0, 1.0]);
    let hc = ck.tensor_f32("layers.0.hc_attn_fn").unwrap();
    assert_eq!(hc.shape, vec![24, 4 * D]);
    assert_eq!(hc.data[5], (5.0f32 * 0.37).sin());
    let kv = ck.tensor_f32("layers.0.attn.kv_norm.weight").unwrap();
    assert_eq!(kv.data[0], 1.0);
    assert_eq!(kv.data[31], 1.0 + 31.0 / 128.0);
    assert_eq!(ck.tensor_f32("embed.weight").unwrap().shape, vec![32, D]);
    assert_eq!(
        ck.tensor_f32("layers.0.attn_norm.weight").unwrap().data[1],
        1.0 + 1.0 / 128.0
    );
}

#[test]
fn official_naming_every_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([16, 16]);
    let mut t = tensors(&weights, |b, s| format!("{b}.{s}"));
    t.extend(extras_in(Naming::Official));
    write(dir.path(), &t, &config_with_block([16, 16]), usize::MAX);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.naming(), Naming::Official);
    assert!(dir.path().join("model.safetensors").is_file());
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    check_layer(&ck, &weights, |b| b.to_string());
    check_extras(&ck);
    assert_eq!(ck.model_config().unwrap().hidden_size, 64);
}

#[test]
fn hf_naming_every_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([128, 128]);
    let mut t = tensors(&weights, |b, s| format!("{}.{s}", hf_base(b)));
    t.extend(extras_in(Naming::Hf));
    write(dir.path(), &t, CONFIG, usize::MAX);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.naming(), Naming::Hf);
    check_layer(&ck, &weights, hf_base);
    check_extras(&ck);
    assert_eq!(ck.resolve("head.weight").unwrap(), "lm_head.weight");
    assert_eq!(
        ck.resolve("layers.0.hc_attn_fn").unwrap(),
        "model.layers.0.attn_hc.fn"
    );
}

#[test]
fn hybrid_naming_every_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([128, 128]);
    let mut t = tensors(&weights, |b, s| format!("{}.{s}", hybrid_base(b)));
    t.extend(extras_in(Naming::HfHybrid));
    write(dir.path(), &t, CONFIG, usize::MAX);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.naming(), Naming::HfHybrid);
    check_layer(&ck, &weights, hybrid_base);
    check_extras(&ck);
    assert_eq!(
        ck.resolve("layers.0.attn.kv_norm.weight").unwrap(),
        "model.layers.0.attn.norm.weight"
    );
    assert_eq!(
        ck.resolve("embed.weight").unwrap(),
        "model.embed_tokens.weight"
    );
}

#[test]
fn sharded_write_and_read() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([128, 128]);
    let mut t = tensors(&weights, |b, s| format!("{b}.{s}"));
    t.extend(extras_in(Naming::Official));
    write(dir.path(), &t, CONFIG, 3000);
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let shards: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    let n = shards.len();
    assert!(n > 2, "expected several shards, got {files:?}");
    for (i, f) in shards.iter().enumerate() {
        assert_eq!(**f, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    assert_eq!(
        files.len(),
        n + 2,
        "only shards, index and config: {files:?}"
    );
    #[cfg(unix)]
    for f in &files {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o644, "{f}");
    }
    // Every shard holding more than one tensor stays within the bound (a tensor larger than
    // the bound gets a shard of its own).
    for f in &shards {
        let buf = std::fs::read(dir.path().join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
        let data: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
        assert!(
            st.len() == 1 || data <= 3000,
            "{f}: {} tensors, {data} bytes",
            st.len()
        );
    }
    let idx: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), t.len());
    let ck = Checkpoint::open(dir.path()).unwrap();
    check_layer(&ck, &weights, |b| b.to_string());
    check_extras(&ck);
}

#[test]
fn in_memory_round_trip() {
    let weights = official_layer([128, 128]);
    let mut t = tensors(&weights, |b, s| format!("{b}.{s}"));
    t.extend(extras_in(Naming::Official));
    for max in [usize::MAX, 2500] {
        let mut w = ShardWriter::in_memory(max);
        for (n, d, s, b) in &t {
            w.add(n, *d, s, b.clone()).unwrap();
        }
        let files = w.to_memory().unwrap();
        assert_eq!(files.len() == 1, max == usize::MAX);
        let ck = Checkpoint::from_memory(CONFIG, files).unwrap();
        assert_eq!(ck.location(), std::path::Path::new("<built-in>"));
        assert!(ck
            .info("head.weight")
            .unwrap()
            .file
            .starts_with("<built-in>"));
        check_layer(&ck, &weights, |b| b.to_string());
        check_extras(&ck);
    }
}

#[test]
fn raw_access_is_zero_copy_and_typed() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([128, 128]);
    write(
        dir.path(),
        &tensors(&weights, |b, s| format!("{b}.{s}")),
        CONFIG,
        usize::MAX,
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    let info = ck.info("layers.0.attn.wo_a.weight_scale").unwrap();
    assert_eq!(info.dtype, Dtype::F8_E4M3);
    assert_eq!(info.shape, vec![32, 4]);
    assert_eq!(info.file, dir.path().join("model.safetensors"));
    let want = &weights[3].1.parts[1].3;
    assert_eq!(
        ck.bytes("layers.0.attn.wo_a.weight_scale").unwrap(),
        &want[..]
    );
    assert!(ck
        .tensor_names()
        .contains(&"layers.0.attn.wo_a.weight_global_scale".to_string()));
    assert!(ck.info("nope").is_none());
    assert!(ck.bytes("nope").is_err());
}

/// HF fused experts: `gate_up_proj` [E, 2I, D] = cat(w1, w3) on dim 1, `down_proj` [E, D, I].
#[test]
fn hf_fused_experts_slice_lazily() {
    let e = 4;
    let gu = |x: usize, r: usize, c: usize| ((x * 7 + r * 3 + c) % 61) as f32 / 32.0 - 1.0;
    let dn = |x: usize, r: usize, c: usize| ((x * 5 + r + c * 11) % 53) as f32 / 16.0 - 1.5;
    let mut gate_up = Vec::new();
    for x in 0..e {
        for r in 0..2 * I {
            for c in 0..D {
                gate_up.push(gu(x, r, c));
            }
        }
    }
    let mut down = Vec::new();
    for x in 0..e {
        for r in 0..D {
            for c in 0..I {
                down.push(dn(x, r, c));
            }
        }
    }
    let t = vec![
        (
            "model.layers.0.mlp.experts.gate_up_proj".to_string(),
            Dtype::BF16,
            vec![e, 2 * I, D],
            bf16_bytes(&gate_up),
        ),
        (
            "model.layers.0.mlp.experts.down_proj".to_string(),
            Dtype::BF16,
            vec![e, D, I],
            bf16_bytes(&down),
        ),
        (
            "model.layers.0.self_attn.q_a_proj.weight".to_string(),
            Dtype::BF16,
            vec![32, D],
            bf16_bytes(&vec![1.0; 32 * D]),
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &t, CONFIG, usize::MAX);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.naming(), Naming::Hf);
    assert_eq!(ck.bytes_read(), 0);

    let w1 = ck.weight("layers.0.ffn.experts.2.w1").unwrap();
    assert_eq!(
        ck.bytes_read(),
        (I * D * 2) as u64,
        "only expert 2's gate rows are read"
    );
    assert_eq!((w1.out_features, w1.in_features), (I, D));
    let want: Vec<f32> = (0..I)
        .flat_map(|r| (0..D).map(move |c| gu(2, r, c)))
        .collect();
    assert_f32_eq(&w1.dequantize().unwrap().data, &want, "w1");

    let w3 = ck.weight("layers.0.ffn.experts.3.w3").unwrap();
    let want: Vec<f32> = (0..I)
        .flat_map(|r| (0..D).map(move |c| gu(3, I + r, c)))
        .collect();
    assert_f32_eq(&w3.dequantize().unwrap().data, &want, "w3");

    let w2 = ck.weight("layers.0.ffn.experts.1.w2").unwrap();
    assert_eq!((w2.out_features, w2.in_features), (D, I));
    let want: Vec<f32> = (0..D)
        .flat_map(|r| (0..I).map(move |c| dn(1, r, c)))
        .collect();
    assert_f32_eq(&w2.dequantize().unwrap().data, &want, "w2");
    assert_eq!(ck.bytes_read(), (3 * I * D * 2) as u64);

    assert_eq!(
        ck.resolve("layers.0.ffn.experts.1.w2.weight").unwrap(),
        "model.layers.0.mlp.experts.down_proj"
    );
    let bases = ck.weight_bases();
    assert_eq!(bases.len(), 3 * e + 1, "{bases:?}");
    assert!(bases.contains(&"layers.0.ffn.experts.3.w3".to_string()));
    assert!(ck.weight("layers.0.ffn.experts.4.w1").is_err());
}

/// Touching one expert reads only its bytes; header-only queries read none of the packed data.
#[test]
fn lazy_reads_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let weights = official_layer([128, 128]);
    write(
        dir.path(),
        &tensors(&weights, |b, s| format!("{b}.{s}")),
        CONFIG,
        usize::MAX,
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.bytes_read(), 0);
    // ModelOpt expert without input scale: packed I·D/2 + scales I·D/16 + weight_scale_2 (4).
    ck.weight("layers.0.ffn.experts.1.w1").unwrap();
    assert_eq!(ck.bytes_read(), (I * D / 2 + I * D / 16 + 4) as u64);

    // Metadata of every weight reads only scalar scales (4 bytes each).
    let before = ck.bytes_read();
    let scalars: usize = weights
        .iter()
        .flat_map(|(_, b)| b.parts.iter())
        .filter(|p| {
            [
                "weight_global_scale",
                "input_global_scale",
                "weight_scale_2",
                "input_scale",
            ]
            .contains(&p.0.as_str())
        })
        .map(|p| p.3.len())
        .sum();
    // the metadata of experts.1.w1 (its 4-byte weight_scale_2) was read by `weight` above and is
    // kept: asking again reads nothing
    for b in ck.weight_bases() {
        ck.weight_meta(&b).unwrap();
    }
    assert_eq!(ck.bytes_read() - before, scalars as u64 - 4);
    let again = ck.bytes_read();
    for b in ck.weight_bases() {
        ck.weight_meta(&b).unwrap();
    }
    assert_eq!(
        ck.bytes_read(),
        again,
        "metadata asked for twice is read once"
    );
}

#[test]
fn writer_leaves_no_partial_shards_and_no_stale_index() {
    let dir = tempfile::tempdir().unwrap();
    let t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    {
        let mut w = ShardWriter::new(dir.path(), 1000).unwrap();
        for (n, d, s, b) in &t {
            w.add(n, *d, s, b.clone()).unwrap();
        }
        // Dropped without finish: an error path.
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    write(dir.path(), &t, CONFIG, 1000);
    assert!(dir.path().join("model.safetensors.index.json").exists());
    write(dir.path(), &t, CONFIG, usize::MAX);
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.info("head.weight").unwrap().file,
        dir.path().join("model.safetensors")
    );
    // Adding a tensor whose bytes disagree with its shape is refused.
    let mut w = ShardWriter::new(dir.path(), 1000).unwrap();
    assert!(w.add("x", Dtype::F32, &[3], vec![0; 8]).is_err());
    w.add("y", Dtype::F32, &[2], vec![0; 8]).unwrap();
    assert!(w.add("y", Dtype::F32, &[2], vec![0; 8]).is_err());
}

/// Less common layouts: F16/F32 dense weights and compressed-tensors MXFP4 (`weight_packed` +
/// U8 `weight_scale` [out, in/32], no global scale).
#[test]
fn other_dense_dtypes_and_ct_mxfp4() {
    let f16: Vec<f32> = (0..32 * D).map(|k| (k % 37) as f32 / 8.0 - 2.0).collect();
    let f32v: Vec<f32> = (0..D * 32).map(|k| (k as f32 * 0.013).cos()).collect();
    let mx = mxfp4(I, D, 11);
    let mut t = vec![
        (
            "layers.0.attn.wq_a.weight".to_string(),
            Dtype::F16,
            vec![32, D],
            f16.iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
        ),
        (
            "layers.0.attn.wo_b.weight".to_string(),
            Dtype::F32,
            vec![D, 32],
            f32_bytes(&f32v),
        ),
    ];
    t.push((
        "layers.0.ffn.experts.2.w3.weight_packed".into(),
        Dtype::U8,
        mx.parts[0].2.clone(),
        mx.parts[0].3.clone(),
    ));
    t.push((
        "layers.0.ffn.experts.2.w3.weight_scale".into(),
        Dtype::U8,
        mx.parts[1].2.clone(),
        mx.parts[1].3.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &t, CONFIG, usize::MAX);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let w = ck.weight("layers.0.attn.wq_a").unwrap();
    assert_eq!(w.scheme(), "f16");
    assert!(!w.is_quantized());
    assert_f32_eq(&w.dequantize().unwrap().data, &f16, "f16");
    let w = ck.weight("layers.0.attn.wo_b").unwrap();
    assert_eq!(w.scheme(), "f32");
    assert_f32_eq(&w.dequantize().unwrap().data, &f32v, "f32");
    let w = ck.weight("layers.0.ffn.experts.2.w3").unwrap();
    assert_eq!(w.scheme(), "mxfp4");
    assert!(w.is_quantized());
    assert_eq!((w.out_features, w.in_features), (I, D));
    assert_f32_eq(&w.dequantize().unwrap().data, &mx.expected, "ct mxfp4");
}

/// The embedding rows of a prompt (read row by row, in parallel tasks of 64 rows) are the whole
/// table's rows, for ids in any order, repeated, and more of them than one task takes.
#[test]
fn embedding_rows_are_the_tables_rows() {
    use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let so = SynthOptions::new(Preset::Tiny, Format::ModelOptNvfp4, Naming::Official, 5);
    synth::synth_to_dir(&so, dir.path()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let table = ck.tensor_f32("embed.weight").unwrap();
    let (vocab, d) = (table.rows(), table.cols());
    let ids: Vec<u32> = (0..300u32)
        .map(|i| (i * 7919 + 13) % vocab as u32)
        .chain([0, vocab as u32 - 1, 0])
        .collect();
    let got = ck.embedding_rows(&ids).unwrap();
    assert_eq!(got.shape, vec![ids.len(), d]);
    for (r, &id) in ids.iter().enumerate() {
        let want = &table.data[id as usize * d..(id as usize + 1) * d];
        let row = &got.data[r * d..(r + 1) * d];
        assert!(
            row.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {r} (id {id})"
        );
    }
    assert!(ck.embedding_rows(&[vocab as u32]).is_err());
}
