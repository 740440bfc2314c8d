//! Reading and writing a whole safetensors file as (name, dtype, shape, bytes) entries, for tests
//! that rewrite a checkpoint's tensors (rename, drop, edit, re-lay out).

#![allow(dead_code)]

use std::path::Path;

use serde_json::{json, Value};

/// One tensor of a safetensors file: (name, dtype, shape, bytes).
pub type Entry = (String, String, Vec<usize>, Vec<u8>);

/// A safetensors file's tensors: name → (dtype, shape, bytes).
pub fn read_all(path: &Path) -> Vec<Entry> {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut out = Vec::new();
    for (k, v) in h.as_object().unwrap() {
        if k == "__metadata__" {
            continue;
        }
        let off = v["data_offsets"].as_array().unwrap();
        let (s, e) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let shape = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        out.push((
            k.clone(),
            v["dtype"].as_str().unwrap().to_string(),
            shape,
            b[8 + n + s..8 + n + e].to_vec(),
        ));
    }
    out
}

/// Writes the entries in their order (header padded to 8 bytes).
pub fn write_all(path: &Path, tensors: &[Entry]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (k, dt, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            k.clone(),
            json!({"dtype": dt, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut hb = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}
