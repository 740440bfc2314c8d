//! `--prompt TEXT`: token ids from the checkpoint's own `tokenizer.json` (the `tokenizers` crate,
//! pure-Rust regex backend), exactly what the engine would feed for the same text (no chat template).

use crate::checkpoint::Checkpoint;
use crate::{Error, Result};

/// Encode `text` with `DIR/tokenizer.json`; special tokens (e.g. BOS) are added as the tokenizer's post-processor says.
pub fn encode(ckpt: &Checkpoint, text: &str) -> Result<Vec<u32>> {
    let path = ckpt.location().join("tokenizer.json");
    if !path.is_file() {
        return Err(Error::usage(format!(
            "--prompt needs {} (the checkpoint's tokenizer); give --token-ids or --tokens instead",
            path.display()
        )));
    }
    let tok = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| Error::bad(&path, None, format!("cannot load tokenizer: {e}")))?;
    let enc = tok
        .encode(text, true)
        .map_err(|e| Error::bad(&path, None, format!("cannot encode the prompt: {e}")))?;
    Ok(enc.get_ids().to_vec())
}
