//! Narrow accessors the runner needs: embedding and tid2eid rows without reading the whole table, the scheme
//! of a weight from headers alone, and scalar scales of a weight without its packed data.

use super::{convert, Checkpoint, Source};
use crate::{Error, Result, Tensor};
use rayon::prelude::*;

impl Checkpoint {
    /// Rows `ids` of `embed.weight` as f32 [ids.len(), hidden]; touches only those rows' bytes.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Tensor> {
        let canonical = "embed.weight";
        let info = self
            .canonical_info(canonical)
            .ok_or_else(|| self.missing(canonical, "the token embedding"))?;
        if info.shape.len() == 2 {
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= info.shape[0]) {
                // the prompt's fault, not the checkpoint's
                return Err(Error::usage(format!(
                    "token id {id} is outside the embedding table ({} rows, {})",
                    info.shape[0],
                    info.file.display()
                )));
            }
        }
        self.tensor_rows(canonical, ids, "the token embedding")
    }

    /// Rows `ids` of the 2-D tensor `canonical` as f32 [ids.len(), cols]; touches only those
    /// rows' bytes (a tensor assembled from several stored pieces is read whole). An id past the
    /// last row is an error naming the file and tensor. `what` names it in a missing-tensor error.
    pub fn tensor_rows(&self, canonical: &str, ids: &[u32], what: &str) -> Result<Tensor> {
        let info = self
            .canonical_info(canonical)
            .ok_or_else(|| self.missing(canonical, what))?;
        let raw = self.resolve(canonical).unwrap_or_default();
        if info.shape.len() != 2 {
            return Err(Error::bad(
                &info.file,
                Some(&raw),
                format!("shape {:?}, expected [rows, cols]", info.shape),
            ));
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= rows) {
            return Err(Error::bad(
                &info.file,
                Some(&raw),
                format!("row {id} asked for, the tensor has {rows} rows"),
            ));
        }
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
            _ => {
                // assembled from several stored pieces: read whole (the ids are in range)
                return self.tensor_f32(canonical)?.select_rows(ids).ok_or_else(|| {
                    Error::bad(&info.file, Some(&raw), "rows of the assembled tensor")
                });
            }
        };
        let buf = self.shards[e.shard].buf();
        // rows in parallel tasks of ROWS_PER_TASK: a long prompt's rows are hundreds of MB of
        // page faults and conversions (65,536 V4-Flash tokens: 537 MB of BF16)
        const ROWS_PER_TASK: usize = 64;
        let mut data = vec![0f32; ids.len() * cols];
        data.par_chunks_mut(cols.max(1) * ROWS_PER_TASK)
            .zip(ids.par_chunks(ROWS_PER_TASK))
            .try_for_each(|(out, ids)| -> Result<()> {
                for (o, &id) in out.chunks_mut(cols.max(1)).zip(ids) {
                    let start = e.start + id as usize * cols * es;
                    let row = &buf[start..start + cols * es];
                    self.note_read(row.len());
                    o.copy_from_slice(&convert::to_f32(row, info.dtype, &info.file, &raw)?);
                }
                Ok(())
            })?;
        Ok(Tensor::new(vec![ids.len(), cols], data))
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
