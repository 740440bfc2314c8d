//! Stored element types to f32. Every float format the checkpoints use widens to f32 exactly;
//! integers are exact up to 2^24 (token and expert ids are far below that).

use safetensors::Dtype;
use std::path::Path;

use crate::numerics::{e4m3, ue8m0};
use crate::{Error, Result};

/// Bytes per element, or None for sub-byte and unsupported types.
pub fn elem_size(d: Dtype) -> Option<usize> {
    let b = d.bitsize();
    (b % 8 == 0).then_some(b / 8)
}

/// Whether `to_f32` handles this dtype.
pub fn supported(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::BF16
            | Dtype::F16
            | Dtype::F32
            | Dtype::F64
            | Dtype::I64
            | Dtype::I32
            | Dtype::I8
            | Dtype::U8
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
    )
}

fn chunks<const N: usize>(b: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    b.chunks_exact(N).map(|c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        a
    })
}

/// Decode little-endian elements of `dtype` to f32. `file`/`name` label the error.
pub fn to_f32(b: &[u8], dtype: Dtype, file: &Path, name: &str) -> Result<Vec<f32>> {
    let size = elem_size(dtype)
        .filter(|_| supported(dtype))
        .ok_or_else(|| {
            Error::bad(
                file,
                Some(name),
                format!("dtype {dtype:?} cannot be read as numbers"),
            )
        })?;
    if b.len() % size != 0 {
        return Err(Error::bad(
            file,
            Some(name),
            format!(
                "{} bytes is not a whole number of {dtype:?} elements",
                b.len()
            ),
        ));
    }
    Ok(match dtype {
        Dtype::BF16 => chunks::<2>(b)
            .map(|c| half::bf16::from_le_bytes(c).to_f32())
            .collect(),
        Dtype::F16 => chunks::<2>(b)
            .map(|c| half::f16::from_le_bytes(c).to_f32())
            .collect(),
        Dtype::F32 => chunks::<4>(b).map(f32::from_le_bytes).collect(),
        Dtype::F64 => chunks::<8>(b)
            .map(|c| f64::from_le_bytes(c) as f32)
            .collect(),
        Dtype::I64 => chunks::<8>(b)
            .map(|c| i64::from_le_bytes(c) as f32)
            .collect(),
        Dtype::I32 => chunks::<4>(b)
            .map(|c| i32::from_le_bytes(c) as f32)
            .collect(),
        Dtype::I8 => b.iter().map(|&x| x as i8 as f32).collect(),
        Dtype::U8 => b.iter().map(|&x| x as f32).collect(),
        Dtype::F8_E4M3 => b.iter().map(|&x| e4m3::decode(x)).collect(),
        Dtype::F8_E8M0 => b.iter().map(|&x| ue8m0::decode(x)).collect(),
        _ => unreachable!("filtered by supported()"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let p = Path::new("x");
        // BF16 0x3FC0 = 1.5, F16 0x3C00 = 1.0, E4M3 0x7E = 448, E8M0 0x7F = 1.0, 0x80 = 2.0.
        assert_eq!(to_f32(&[0xC0, 0x3F], Dtype::BF16, p, "t").unwrap(), [1.5]);
        assert_eq!(to_f32(&[0x00, 0x3C], Dtype::F16, p, "t").unwrap(), [1.0]);
        assert_eq!(
            to_f32(&[0x7E, 0xFE], Dtype::F8_E4M3, p, "t").unwrap(),
            [448.0, -448.0]
        );
        assert_eq!(
            to_f32(&[0x7F, 0x80], Dtype::F8_E8M0, p, "t").unwrap(),
            [1.0, 2.0]
        );
        assert_eq!(
            to_f32(&(-7i64).to_le_bytes(), Dtype::I64, p, "t").unwrap(),
            [-7.0]
        );
        assert_eq!(to_f32(&[0xFF], Dtype::I8, p, "t").unwrap(), [-1.0]);
        assert_eq!(to_f32(&[0xFF], Dtype::U8, p, "t").unwrap(), [255.0]);
        assert!(to_f32(&[0, 0, 0], Dtype::F32, p, "t").is_err());
        assert!(to_f32(&[0], Dtype::BOOL, p, "t").is_err());
    }
}
