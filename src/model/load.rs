//! Reading `config.json`: the family the config names ([`family::kind::detect`]) picks the
//! parser, V4's ([`config::parse_v4`]) or the family's ([`family::config::parse`]). This file
//! sits above both, so neither parser imports the other.

use std::path::Path;

use serde_json::Value;

use super::{config, family, ModelConfig};
use crate::{Error, Result};

impl ModelConfig {
    /// Read and parse `DIR/config.json`; errors name the file. Only a regular file is opened (a
    /// FIFO would block), and a key given twice is refused (JSON readers keep one silently).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::input::read_text(path, "config", crate::input::SMALL_FILE_MAX)?;
        let v = crate::input::parse_json(path, &text, "config")?;
        Self::from_json(&v).map_err(|e| match e {
            Error::Usage(m) => Error::bad(path, None, m),
            other => other,
        })
    }

    /// Parse a config value. Errors are `Error::Usage` with the field named (callers attach the
    /// file); every field is checked against its limit as it is read.
    pub fn from_json(v: &Value) -> Result<Self> {
        if !v.is_object() {
            return Err(Error::usage("config is not a JSON object"));
        }
        match family::kind::detect(v) {
            Some(kind) => family::config::parse(v, kind),
            None => config::parse_v4(v),
        }
    }
}
