//! `run --dump DIR --dump-rows ROWS`: the dump holds the named token rows of every token-major
//! output, the compressed rows covering them of a compressor's output, and the rest whole — the
//! same values as the full dump's rows, bit for bit — and says which rows in its metadata; bad
//! rows are refused with exit 2 before anything is written.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_nvfp4-probe");
const T: usize = 40;

fn run(args: &[&str]) -> (i32, String) {
    let o = Command::new(BIN).args(args).output().expect("spawn");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// (shape, f32 values) per tensor, and the metadata, of one dump file.
type Dump = (BTreeMap<String, (Vec<usize>, Vec<f32>)>, Option<String>);

fn read(path: &Path) -> Dump {
    let bytes = std::fs::read(path).expect("dump file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let rows = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("token_rows").cloned());
    let mut m = BTreeMap::new();
    for (name, v) in st.tensors() {
        let vals: Vec<f32> = v
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        m.insert(name, (v.shape().to_vec(), vals));
    }
    (m, rows)
}

#[test]
fn dump_rows_keep_the_named_rows_of_the_full_dump() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    let seq = T.to_string();
    let common = ["run", "--layers", "0..1", "--seq-len", &seq, "--quiet"];
    let (rc, err) = run(&[&common[..], &["--dump", full.to_str().unwrap()]].concat());
    assert!(rc == 0 || rc == 1, "full dump: rc {rc}: {err}");
    let rows_arg = "0,5..7,39,6";
    let (rc, err) = run(&[
        &common[..],
        &["--dump", part.to_str().unwrap(), "--dump-rows", rows_arg],
    ]
    .concat());
    assert!(rc == 0 || rc == 1, "row dump: rc {rc}: {err}");
    let rows = [0usize, 5, 6, 7, 39];
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config");
    let (mut token_major, mut compressed, mut whole) = (0, 0, 0);
    for path in ["oracle_fp32", "oracle_bf16", "served", "served_isolated"] {
        let (f, fmeta) = read(&full.join(format!("{path}.safetensors")));
        let (p, pmeta) = read(&part.join(format!("{path}.safetensors")));
        assert_eq!(fmeta, None, "a full dump names no rows");
        assert_eq!(pmeta.as_deref(), Some("0,5,6,7,39"));
        assert_eq!(
            f.keys().collect::<Vec<_>>(),
            p.keys().collect::<Vec<_>>(),
            "{path}"
        );
        for (id, (fshape, fv)) in &f {
            let (pshape, pv) = &p[id];
            if id == "input_ids" {
                // every dump carries the whole prompt's token ids (what `compare` reads)
                assert_eq!((fshape, pshape), (&vec![T], &vec![T]), "{path}");
                assert_eq!(fv, pv, "{path}: the same ids");
                continue;
            }
            let n = fshape[0];
            let w = fv.len() / n.max(1);
            let want: Vec<usize> = if n == 0 {
                whole += 1;
                Vec::new()
            } else if n == T {
                token_major += 1;
                rows.to_vec()
            } else if id.contains("compressor") || id.contains(".cmp") {
                // a compressor's rows: row j / ratio for token j (the layer's ratio, from the
                // built-in model's config)
                compressed += 1;
                let l: usize = id[1..id.find('.').expect("L<n>.")].parse().expect("layer");
                let r = cfg.ratio(l);
                assert!(r > 1, "{id}: ratio {r}");
                let mut v: Vec<usize> = rows.iter().map(|j| j / r).filter(|&c| c < n).collect();
                v.dedup();
                v
            } else {
                whole += 1;
                (0..n).collect()
            };
            assert_eq!(pshape[0], want.len(), "{path} {id}: rows");
            assert_eq!(&pshape[1..], &fshape[1..], "{path} {id}: row shape");
            for (k, &i) in want.iter().enumerate() {
                let a = &fv[i * w..(i + 1) * w];
                let b = &pv[k * w..(k + 1) * w];
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{path} {id}: row {i}"
                );
            }
        }
    }
    assert!(token_major > 0, "token-major outputs were checked");
    assert!(compressed > 0, "a compressor's output was checked");
    eprintln!("checked {token_major} token-major, {compressed} compressed, {whole} whole");
}

#[test]
fn bad_dump_rows_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("d");
    let seq = T.to_string();
    let base = ["run", "--layers", "0..1", "--seq-len", &seq, "--quiet"];
    let with = |rows: &str| {
        run(&[
            &base[..],
            &["--dump", out.to_str().unwrap(), "--dump-rows", rows],
        ]
        .concat())
    };
    let (rc, err) = with("3,40");
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("row 40") && err.contains("40 tokens"),
        "names the row and the prompt: {err}"
    );
    assert!(!out.exists(), "nothing written");
    for bad in ["7..3", "x", "1,,2", "-1"] {
        let (rc, err) = with(bad);
        assert_eq!(rc, 2, "{bad}: {err}");
        assert!(!out.exists(), "{bad}: nothing written");
    }
    // rows without a dump: a usage error
    let (rc, err) = run(&[&base[..], &["--dump-rows", "0"]].concat());
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("--dump"), "{err}");
}
