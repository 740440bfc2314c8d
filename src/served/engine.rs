//! An engine's chunked prefill, as the served path can run it (`--served-chunk N`), and the
//! engine faults at its chunk boundaries (`--engine-fault`).
//!
//! A serving engine prefills a long prompt N tokens at a time (vLLM: `max_num_batched_tokens`).
//! Each chunk's attention reads the keys of the chunks before it from the KV cache, in the
//! cache's format (vLLM's `fp8_ds_mla` for DeepSeek-V4: the 448 non-RoPE dims in FP8 E4M3 with a
//! power-of-two scale per 64, the 64 RoPE dims in BF16), and its own chunk's keys as computed;
//! the compressors keep the rows of a block that is not complete yet in a state cache, and the
//! indexer its compressed keys in an FP8 cache (E4M3, one power-of-two scale per 128-wide key). The served path emulates that (`probe::prefill`), so a bug at a
//! chunk boundary shows as a divergence at the first op after one. The oracles always run the
//! whole prompt.

use crate::{Error, Result};

/// A bug of the engine's chunked prefill, at every chunk boundary of the layers it targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineFaultKind {
    /// The compressors' state cache is not carried over: the pending block's rows read as zeros.
    CompressorStateLost,
    /// The sliding window's KV rows of the chunk before read as zeros (cache slots never
    /// written, as a slot-mapping bug leaves them).
    WindowContextZeroed,
    /// RoPE positions counted from each chunk's first token instead of the prompt's (a
    /// positions tensor built per chunk without its offset): the queries' and keys' rotations
    /// of every later chunk start again at position 0.
    RopePositionReset,
}

impl EngineFaultKind {
    pub const ALL: [EngineFaultKind; 3] = [
        EngineFaultKind::CompressorStateLost,
        EngineFaultKind::WindowContextZeroed,
        EngineFaultKind::RopePositionReset,
    ];

    pub fn name(self) -> &'static str {
        match self {
            EngineFaultKind::CompressorStateLost => "compressor-state-lost",
            EngineFaultKind::WindowContextZeroed => "window-context-zeroed",
            EngineFaultKind::RopePositionReset => "rope-position-reset",
        }
    }

    /// One line for the help and the docs.
    pub fn describe(self) -> &'static str {
        match self {
            EngineFaultKind::CompressorStateLost => "the compressors' state cache is not carried across a chunk boundary: the rows of the block still pending (ratio 4: and of the block before, which the overlapping pool reads) read as zeros",
            EngineFaultKind::WindowContextZeroed => "the sliding window's KV rows of the chunk before read as zeros (cache slots never written, as a slot-mapping bug leaves them): the first queries of each chunk attend to zero keys",
            EngineFaultKind::RopePositionReset => "RoPE positions counted from each chunk's first token instead of the prompt's (a positions tensor built per chunk without its offset): the q and kv rotations (q_rope, kv_rope) of every later chunk start again at 0",
        }
    }

    pub fn parse(s: &str) -> Option<EngineFaultKind> {
        EngineFaultKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// `KIND` or `KIND@Ln` (only layer n).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineFault {
    pub kind: EngineFaultKind,
    pub layer: Option<usize>,
}

/// Refuse engine faults at a layer the run does not probe (`--layers A..B`, inclusive): no
/// chunk boundary of the served prefill is crossed there, so the fault would change nothing.
pub fn check_fault_layers(faults: &[EngineFault], (a, b): (usize, usize)) -> Result<()> {
    for f in faults {
        if let Some(l) = f.layer.filter(|l| !(a..=b).contains(l)) {
            return Err(Error::usage(format!(
                "engine fault `{}`: targets layer {l}, outside the layers this run probes (--layers {a}..{b}); \
                 it would change nothing (widen --layers to include L{l})",
                f.spec()
            )));
        }
    }
    Ok(())
}

impl EngineFault {
    pub fn parse(spec: &str) -> Result<EngineFault> {
        let (k, t) = match spec.split_once('@') {
            Some((k, t)) => (k, Some(t)),
            None => (spec, None),
        };
        let kind = EngineFaultKind::parse(k).ok_or_else(|| {
            Error::usage(format!(
                "engine fault `{spec}`: unknown kind `{k}` (known: {})",
                EngineFaultKind::ALL.map(|k| k.name()).join(", ")
            ))
        })?;
        let layer = match t {
            None => None,
            Some(t) => Some(
                t.strip_prefix('L')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| {
                        Error::usage(format!(
                            "engine fault `{spec}`: target `{t}` is not a layer (e.g. L1)"
                        ))
                    })?,
            ),
        };
        Ok(EngineFault { kind, layer })
    }

    /// The fault as given on the command line.
    pub fn spec(&self) -> String {
        match self.layer {
            Some(l) => format!("{}@L{l}", self.kind.name()),
            None => self.kind.name().to_string(),
        }
    }
}

/// How the served path prefills: chunks of `chunk` tokens, with `faults` at their boundaries.
#[derive(Clone, Debug, PartialEq)]
pub struct Prefill {
    pub chunk: usize,
    pub faults: Vec<EngineFault>,
}

impl Prefill {
    /// `--served-chunk N` with `--engine-fault`s; N must be at least 1.
    pub fn new(chunk: usize, faults: Vec<EngineFault>) -> Result<Prefill> {
        if chunk == 0 {
            return Err(Error::usage("--served-chunk must be at least 1"));
        }
        Ok(Prefill { chunk, faults })
    }

    /// The first token of the engine chunk that holds token `pos`.
    pub fn chunk_start(&self, pos: usize) -> usize {
        pos / self.chunk * self.chunk
    }

    /// Whether fault `kind` acts at layer `layer`.
    pub fn has(&self, kind: EngineFaultKind, layer: usize) -> bool {
        self.faults
            .iter()
            .any(|f| f.kind == kind && f.layer.is_none_or(|l| l == layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_with_and_without_a_layer() {
        let f = EngineFault::parse("compressor-state-lost").unwrap();
        assert_eq!(f.kind, EngineFaultKind::CompressorStateLost);
        assert_eq!(f.layer, None);
        let f = EngineFault::parse("window-context-zeroed@L3").unwrap();
        assert_eq!(f.layer, Some(3));
        assert_eq!(f.spec(), "window-context-zeroed@L3");
        for bad in [
            "nope",
            "compressor-state-lost@3",
            "compressor-state-lost@Lx",
        ] {
            assert!(EngineFault::parse(bad).is_err(), "{bad}");
        }
        for k in EngineFaultKind::ALL {
            assert_eq!(EngineFaultKind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn faults_at_layers_outside_the_run_are_refused() {
        let f = |s: &str| EngineFault::parse(s).unwrap();
        let e = check_fault_layers(&[f("compressor-state-lost@L3")], (0, 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("compressor-state-lost@L3") && e.contains("--layers 0..1"),
            "{e}"
        );
        assert!(check_fault_layers(&[f("rope-position-reset@L0")], (1, 4)).is_err());
        check_fault_layers(
            &[f("rope-position-reset@L1"), f("compressor-state-lost")],
            (1, 4),
        )
        .unwrap();
    }

    #[test]
    fn chunk_starts_and_targets() {
        let p = Prefill::new(
            64,
            vec![EngineFault::parse("compressor-state-lost@L1").unwrap()],
        )
        .unwrap();
        assert_eq!([0, 63, 64, 130].map(|t| p.chunk_start(t)), [0, 0, 64, 128]);
        assert!(p.has(EngineFaultKind::CompressorStateLost, 1));
        assert!(!p.has(EngineFaultKind::CompressorStateLost, 2));
        assert!(!p.has(EngineFaultKind::WindowContextZeroed, 1));
        assert!(Prefill::new(0, vec![]).is_err());
    }
}
