//! Fused expert tensors (one tensor per projection for all of a layer's experts, as transformers 5
//! and the gpt-oss releases store them) read as per-expert canonical tensors: each expert's piece
//! is one contiguous byte range of the fused tensor, so a run reads only the routed experts'
//! bytes and nothing is copied to split them. Which pieces a fused name yields is
//! `naming`'s decision ([`super::naming::FusedLayout`]); their shapes, byte ranges and labels
//! are here.

use std::path::Path;

use super::naming::FusedPart;
use super::shard::RawEntry;
use super::{convert, Dtype, Source};
use crate::{Error, Result};

/// gpt-oss's experts stored both ways at once — the fused tensors of the release or of
/// ModelOpt's export (`mlp.experts.gate_up_proj…`, `mlp.experts.down_proj…`) and llm-compressor's
/// `LinearExperts` (`mlp.experts.experts.E.{gate,up,down}_proj…`, what its
/// `convert_model_for_quantization_gptoss` puts in place of the fused experts): a half-converted
/// checkpoint, refused up front naming one tensor of each (an engine loads one layout and leaves
/// the other's tensors unread).
pub(super) fn check_mixed_experts(
    raw: &std::collections::HashMap<String, RawEntry>,
    shards: &[super::shard::Shard],
) -> Result<()> {
    let first = |f: &dyn Fn(&str) -> bool| {
        let mut v: Vec<&String> = raw.keys().filter(|n| f(n)).collect();
        v.sort();
        v.first().copied()
    };
    let linear = first(&|n| n.contains(".mlp.experts.experts."));
    let fused =
        first(&|n| n.contains(".mlp.experts.gate_up_proj") || n.contains(".mlp.experts.down_proj"));
    let (Some(l), Some(f)) = (linear, fused) else {
        return Ok(());
    };
    Err(Error::bad(
        &shards[raw[l].shard].path,
        Some(l),
        format!(
            "gpt-oss experts stored both as separate gate/up/down linears (llm-compressor's `LinearExperts` layout, `mlp.experts.experts.E.*`) and as fused tensors (`{f}`): a half-converted checkpoint; keep one layout"
        ),
    ))
}

/// The experts a fused tensor holds (its first dimension), at most what a config may declare:
/// a header claiming a million experts of zero bytes each would otherwise name a million tensors.
fn experts_of(name: &str, e: &RawEntry, file: &Path) -> Result<usize> {
    let n = e.shape.first().copied().unwrap_or(0);
    let max = crate::model::limits::N_ROUTED_EXPERTS.max as usize;
    if n > max {
        return Err(Error::bad(
            file,
            Some(name),
            format!("fused expert tensor of {n} experts, more than the {max} a config may declare (`n_routed_experts`)"),
        ));
    }
    Ok(n)
}

/// The canonical pieces of a stacked fused tensor (Qwen3-MoE, DeepSeek-V3 in transformers 5):
/// `gate_up_proj` [E, 2I, D] → w1 (rows 0..I) and w3 (rows I..2I) per expert, `down_proj`
/// [E, D, I] → w2.
pub(super) fn stacked(
    name: &str,
    e: &RawEntry,
    file: &Path,
    prefix: &str,
    gate_up: bool,
) -> Result<Vec<(String, Source)>> {
    if e.shape.len() != 3 || !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(Error::bad(
            file,
            Some(name),
            format!(
                "fused expert tensor must be a 3-D BF16/F16/F32 [E, out, in], found {:?} {:?}",
                e.dtype, e.shape
            ),
        ));
    }
    if gate_up && !e.shape[1].is_multiple_of(2) {
        return Err(Error::bad(
            file,
            Some(name),
            format!("gate_up_proj rows {} are odd", e.shape[1]),
        ));
    }
    let parts: &[(&str, FusedPart)] = if gate_up {
        &[("w1", FusedPart::Gate), ("w3", FusedPart::Up)]
    } else {
        &[("w2", FusedPart::Down)]
    };
    let n = experts_of(name, e, file)?;
    let mut out = Vec::with_capacity(n * parts.len());
    for ex in 0..n {
        for (w, part) in parts {
            out.push((
                format!("{prefix}.ffn.experts.{ex}.{w}.weight"),
                Source::Slice {
                    raw: name.to_string(),
                    expert: ex,
                    part: *part,
                },
            ));
        }
    }
    Ok(out)
}

/// The canonical pieces of an interleaved-layout fused tensor (gpt-oss): expert e's slice is
/// `{prefix}.ffn.experts.{e}.{leaf}`. A weight stored [E, in, out] (`Transposed`) must be a 3-D
/// float tensor or 3-D bytes (ModelOpt's NVFP4 data and block scales); a tensor scale may be one
/// per expert ([E], read as `Whole`) or one for all (a scalar, `[]` or `[1]`:
/// [`FusedPart::Shared`], as many experts as `experts` — the projection's fused weight — holds);
/// every other must have an expert dimension and at least one more.
pub(super) fn per_expert(
    name: &str,
    e: &RawEntry,
    file: &Path,
    prefix: &str,
    leaf: &str,
    part: FusedPart,
    experts: Option<usize>,
) -> Result<Vec<(String, Source)>> {
    // a tensor scale (`Shared` from the naming) is one for all experts, or one per expert [E]
    let scalar_leaf = part == FusedPart::Shared;
    let shared = scalar_leaf && e.shape.iter().product::<usize>() == 1 && e.shape.len() <= 1;
    let ok = match part {
        FusedPart::Transposed => {
            e.shape.len() == 3
                && (matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
                    || convert::elem_size(e.dtype) == Some(1))
        }
        _ if scalar_leaf => e.shape.len() <= 1 && matches!(e.dtype, Dtype::F32 | Dtype::BF16),
        _ => e.shape.len() >= 2,
    };
    if !ok {
        let want = if part == FusedPart::Transposed {
            "a 3-D BF16/F16/F32 [E, in, out] or a 3-D byte tensor [E, in/2, out]"
        } else if scalar_leaf {
            "an F32 scalar or one F32 per expert [E]"
        } else {
            "[E, …] with at least two dimensions"
        };
        return Err(Error::bad(
            file,
            Some(name),
            format!(
                "fused expert tensor must be {want}, found {:?} {:?}",
                e.dtype, e.shape
            ),
        ));
    }
    let (n, part) = if shared {
        let n = experts.ok_or_else(|| {
            Error::bad(
                file,
                Some(name),
                "a scale shared by every expert of a projection, but the checkpoint holds no fused weight of that projection to count the experts by",
            )
        })?;
        (n, FusedPart::Shared)
    } else if scalar_leaf {
        (experts_of(name, e, file)?, FusedPart::Whole)
    } else {
        (experts_of(name, e, file)?, part)
    };
    Ok((0..n)
        .map(|ex| {
            (
                format!("{prefix}.ffn.experts.{ex}.{leaf}"),
                Source::Slice {
                    raw: name.to_string(),
                    expert: ex,
                    part,
                },
            )
        })
        .collect())
}

/// The canonical shape of one expert's `part` of a fused tensor of shape `s` (checked when the
/// checkpoint was opened: [`stacked`], [`per_expert`]).
pub(super) fn shape(s: &[usize], part: FusedPart) -> Vec<usize> {
    match part {
        FusedPart::Gate | FusedPart::Up => vec![s[1] / 2, s[2]],
        FusedPart::Down => vec![s[1], s[2]],
        FusedPart::Transposed => vec![s[2], s[1]],
        FusedPart::Shared => vec![],
        FusedPart::Whole if s.len() == 1 => vec![],
        FusedPart::Whole if s.len() == 2 => vec![s[1]],
        FusedPart::Whole => vec![s[1], s[2..].iter().product()],
    }
}

/// (byte offset from the fused tensor's start, byte length) of one expert's `part`, elements of
/// `es` bytes.
pub(super) fn bytes(s: &[usize], es: usize, expert: usize, part: FusedPart) -> (usize, usize) {
    let per_expert = || s[1..].iter().product::<usize>() * es;
    match part {
        FusedPart::Shared => (0, es),
        FusedPart::Gate => (expert * per_expert(), per_expert() / 2),
        FusedPart::Up => (expert * per_expert() + per_expert() / 2, per_expert() / 2),
        FusedPart::Down | FusedPart::Whole | FusedPart::Transposed => {
            (expert * per_expert(), per_expert())
        }
    }
}

/// Where one expert's piece lies in the fused tensor, for messages: `…gate_up_proj[5, 0..2048]`,
/// `…gate_up_proj_blocks[5]`, `…down_proj[5]ᵀ` (stored [in, out]).
pub(super) fn label(raw: &str, s: &[usize], expert: usize, part: FusedPart) -> String {
    match part {
        FusedPart::Gate => format!("{raw}[{expert}, 0..{}]", s[1] / 2),
        FusedPart::Up => format!("{raw}[{expert}, {}..{}]", s[1] / 2, s[1]),
        FusedPart::Down => format!("{raw}[{expert}, 0..{}]", s[1]),
        FusedPart::Whole => format!("{raw}[{expert}]"),
        FusedPart::Shared => format!("{raw} (every expert)"),
        FusedPart::Transposed => format!("{raw}[{expert}]ᵀ"),
    }
}

/// The transpose of a row-major [rows, cols] matrix: [cols, rows] (f32 values of gpt-oss's BF16
/// experts; ModelOpt's NVFP4 expert bytes stored [in/2, out] → [out, in/2], a byte holding two
/// elements of one output row).
pub fn transpose<T: Copy + Default>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::default(); v.len()];
    for (r, row) in v.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &x) in row.iter().enumerate() {
            out[c * rows + r] = x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_of_each_layout() {
        // stacked [E=3, 2I=8, D=5]
        let s = [3, 8, 5];
        assert_eq!(shape(&s, FusedPart::Up), [4, 5]);
        assert_eq!(bytes(&s, 2, 1, FusedPart::Up), (80 + 40, 40));
        // gpt-oss BF16 [E=3, in=5, out=8]: the transpose of expert e's [5, 8]
        assert_eq!(shape(&s, FusedPart::Transposed), [5, 8]);
        assert_eq!(bytes(&s, 2, 2, FusedPart::Transposed), (160, 80));
        // MXFP4 blocks [E=3, out=8, in/32=2, 16] → [8, 32] bytes; scales [3, 8, 2]; bias [3, 8]
        assert_eq!(shape(&[3, 8, 2, 16], FusedPart::Whole), [8, 32]);
        assert_eq!(bytes(&[3, 8, 2, 16], 1, 2, FusedPart::Whole), (512, 256));
        assert_eq!(shape(&[3, 8, 2], FusedPart::Whole), [8, 2]);
        assert_eq!(shape(&[3, 8], FusedPart::Whole), [8]);
        assert_eq!(bytes(&[3, 8], 2, 1, FusedPart::Whole), (16, 16));
        assert_eq!(
            label("x.down_proj", &s, 2, FusedPart::Transposed),
            "x.down_proj[2]ᵀ"
        );
    }

    /// A header claiming more experts than any config may have is refused before a name is made.
    #[test]
    fn a_million_empty_experts_are_refused() {
        let e = RawEntry {
            shard: 0,
            dtype: Dtype::BF16,
            shape: vec![1 << 20, 0],
            start: 0,
            end: 0,
        };
        let f = Path::new("m.safetensors");
        let m = per_expert(
            "x.gate_up_proj_bias",
            &e,
            f,
            "layers.0",
            "w13.bias",
            FusedPart::Whole,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            m.contains("m.safetensors") && m.contains("1048576 experts"),
            "{m}"
        );
        let e3 = RawEntry {
            shape: vec![1 << 20, 0, 4],
            ..e
        };
        assert!(stacked("x.down_proj", &e3, f, "layers.0", false).is_err());
        let ok = RawEntry {
            shape: vec![8, 4],
            ..e3
        };
        assert_eq!(
            per_expert(
                "x.down_proj_bias",
                &ok,
                f,
                "layers.0",
                "w2.bias",
                FusedPart::Whole,
                None
            )
            .unwrap()
            .len(),
            8
        );
    }

    #[test]
    fn transpose_moves_rows_to_columns() {
        // [[1, 2, 3], [4, 5, 6]] → [[1, 4], [2, 5], [3, 6]]
        let t = transpose(&[1., 2., 3., 4., 5., 6.], 2, 3);
        assert_eq!(t, [1., 4., 2., 5., 3., 6.]);
        assert_eq!(transpose(&t, 3, 2), [1., 2., 3., 4., 5., 6.]);
    }
}
