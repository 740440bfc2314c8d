//! Narrow accessors the runner needs: embedding rows without reading the whole table, the scheme
//! of a weight from headers alone, and scalar scales of a weight without its packed data.

use super::{convert, Checkpoint, Source};
use crate::{Error, Result, Tensor};

impl Checkpoint {
    /// Rows `ids` of `embed.weight` as f32 [ids.len(), hidden]; touches only those rows' bytes.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Tensor> {
        let canonical = "embed.weight";
        let info = self
            .canonical_info(canonical)
            .ok_or_else(|| self.missing(canonical, "the token embedding"))?;
        let raw = self.resolve(canonical).unwrap_or_default();
        if info.shape.len() != 2 {
            return Err(Error::bad(
                &info.file,
                Some(&raw),
                format!(
                    "embedding has shape {:?}, expected [vocab, hidden]",
                    info.shape
                ),
            ));
        }
        let (vocab, hidden) = (info.shape[0], info.shape[1]);
        let es = convert::elem_size(info.dtype)
            .filter(|_| convert::supported(info.dtype))
            .ok_or_else(|| {
                Error::bad(
                    &info.file,
                    Some(&raw),
                    format!("dtype {:?} cannot be read as numbers", info.dtype),
                )
            })?;
        let e = match self.canon.get(canonical) {
            Some(Source::Whole(r)) => &self.raw[r],
            _ => return Err(self.missing(canonical, "the token embedding")),
        };
        let buf = self.shards[e.shard].buf();
        let mut data = Vec::with_capacity(ids.len() * hidden);
        for &id in ids {
            let id = id as usize;
            if id >= vocab {
                return Err(Error::usage(format!(
                    "token id {id} is outside the embedding table ({vocab} rows, {})",
                    info.file.display()
                )));
            }
            let start = e.start + id * hidden * es;
            let row = &buf[start..start + hidden * es];
            self.note_read(row.len());
            data.extend(convert::to_f32(row, info.dtype, &info.file, &raw)?);
        }
        Ok(Tensor::new(vec![ids.len(), hidden], data))
    }

    /// Scheme label of a linear weight ("bf16", "fp8-block", "mxfp4", "nvfp4-ct", "nvfp4-modelopt"), from headers.
    pub fn weight_scheme(&self, base: &str) -> Option<&'static str> {
        self.weight_meta(base).ok().map(|m| m.scheme_label())
    }

    /// NVFP4 scalar scales of a weight as stored: (weight global, input global), reading no packed data.
    pub fn nvfp4_scalars(&self, base: &str) -> Option<(f32, Option<f32>)> {
        let m = self.weight_meta(base).ok()?;
        Some((m.weight_global?, m.input_global))
    }
}
