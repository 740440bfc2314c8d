//! Errors are values. Everything that makes an input unusable is an [`Error`] naming the file and
//! the tensor, and maps to exit code 2. Findings about the numbers are not errors: commands
//! return them as results and exit 1.

use std::path::PathBuf;

/// Exit code for a clean result.
pub const EXIT_OK: i32 = 0;
/// Exit code for findings (NaN, divergence, lint errors, gate regressions).
pub const EXIT_FINDINGS: i32 = 1;
/// Exit code for unusable input.
pub const EXIT_UNUSABLE: i32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A checkpoint (or other input file) is malformed; names the file and, where known, the tensor.
    #[error("{file}: {}{msg}", tensor.as_ref().map(|t| format!("tensor `{t}`: ")).unwrap_or_default())]
    BadInput {
        file: PathBuf,
        tensor: Option<String>,
        msg: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{dir}: missing tensor `{tensor}`{}", if .hint.is_empty() { String::new() } else { format!(" ({})", .hint) })]
    MissingTensor {
        dir: PathBuf,
        tensor: String,
        hint: String,
    },
    /// Wrong command-line usage or an impossible request (e.g. layers outside the model).
    #[error("{0}")]
    Usage(String),
    /// The requested backend cannot run here.
    #[error("backend unavailable: {0}")]
    Backend(String),
    /// The device ran out of memory during a run (`backend::oom`): the message names where, the
    /// bytes asked and free, and what makes the run smaller. The backend works; the run is too big.
    #[error("{0}")]
    DeviceMemory(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn bad(file: impl Into<PathBuf>, tensor: Option<&str>, msg: impl Into<String>) -> Self {
        Error::BadInput {
            file: file.into(),
            tensor: tensor.map(str::to_string),
            msg: msg.into(),
        }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::Usage(msg.into())
    }
    /// Every error of this type is "unusable input": exit 2.
    pub fn exit_code(&self) -> i32 {
        EXIT_UNUSABLE
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
